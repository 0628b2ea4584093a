/* SPDX-License-Identifier: Apache-2.0 */
/* dlpackd: command line, setup and the event loop. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "dlpackd.h"

/* Mode of a socket the daemon binds itself. */
#define DEFAULT_SOCKET_MODE 0660

static void usage(FILE *f)
{
	fprintf(f,
		"Usage: dlpackd [OPTION]...\n"
		"Share DLPack tensors between processes on this machine.\n"
		"\n"
		"  -s, --socket PATH      listen on PATH instead of the default socket\n"
		"  -l, --log-level LEVEL  err, warning, notice, info (default) or debug\n"
		"\n"
		"Limits (every uid, root included; over a limit a request gets EDQUOT):\n"
		"      --max-bytes-per-uid SIZE          storage bytes one uid may hold (default "
		"%lluG;\n"
		"                                        SIZE may end in K, M, G or T)\n"
		"      --max-entries-per-uid N           names one uid may publish (default %u)\n"
		"      --max-connections-per-uid N       connections of one uid (default %u)\n"
		"      --max-refs-per-connection N       references one connection may hold "
		"(default %u)\n"
		"      --max-pending-per-connection N    waiting ATTACHes of one connection "
		"(default %u)\n"
		"      --frame-timeout-ms MS             time to finish a frame, and HELLO "
		"(default "
		"%u)\n"
		"\n"
		"  -h, --help             show this help and exit\n"
		"  -V, --version          show the version and exit\n"
		"\n"
		"The default socket is $DLPACKD_SOCKET if set, else %s for root and\n"
		"$XDG_RUNTIME_DIR/%s for other users.\n",
		DLPC_UID_BYTES_DEFAULT >> 30, DLPC_UID_ENTRIES_DEFAULT,
		DLPC_UID_CONNECTIONS_DEFAULT, DLPC_CONN_REFS_DEFAULT, DLPC_CONN_PENDING_DEFAULT,
		DLPC_FRAME_TIMEOUT_MS_DEFAULT, DLPC_SYSTEM_SOCKET, DLPC_USER_SOCKET_NAME);
}

/* ---- the limit flags: one table and one parser, self-contained ---- */
enum { OPT_LIMIT_FIRST = 0x100 };

static const struct {
	const char *name;
	size_t field; /* offset in struct dlpd_limits */
	bool size;    /* accepts K, M, G, T */
} limit_opts[] = {
	{"max-bytes-per-uid", offsetof(struct dlpd_limits, bytes_per_uid), true},
	{"max-entries-per-uid", offsetof(struct dlpd_limits, entries_per_uid), false},
	{"max-connections-per-uid", offsetof(struct dlpd_limits, connections_per_uid), false},
	{"max-refs-per-connection", offsetof(struct dlpd_limits, refs_per_connection), false},
	{"max-pending-per-connection", offsetof(struct dlpd_limits, pending_per_connection), false},
	{"frame-timeout-ms", offsetof(struct dlpd_limits, frame_timeout_ms), false},
};
#define N_LIMIT_OPTS (sizeof(limit_opts) / sizeof(limit_opts[0]))

/* Parse a count, or a size with an optional binary suffix. 0 or -EINVAL. */
static int parse_count(const char *arg, bool size, uint64_t *out)
{
	unsigned long long v;
	unsigned shift = 0;
	char *end;

	errno = 0;
	if (!*arg || *arg == '-')
		return -EINVAL;
	v = strtoull(arg, &end, 10);
	if (errno || end == arg)
		return -EINVAL;
	if (size && *end) {
		const char *units = "KMGT", *u = strchr(units, *end);

		if (!u || end[1])
			return -EINVAL;
		shift = 10 * (unsigned)(u - units + 1);
		end++;
	}
	if (*end || v > (UINT64_MAX >> shift) || v == 0)
		return -EINVAL;
	*out = (uint64_t)v << shift;
	return 0;
}

/* Handle getopt code @p c if it is a limit flag: 1 done, 0 not ours, -1 bad value (printed). */
static int limit_opt(int c, const char *arg, struct dlpd_limits *lim)
{
	unsigned i = (unsigned)(c - OPT_LIMIT_FIRST);

	if (c < OPT_LIMIT_FIRST || i >= N_LIMIT_OPTS)
		return 0;
	if (parse_count(arg, limit_opts[i].size, (uint64_t *)((char *)lim + limit_opts[i].field)) <
	    0) {
		fprintf(stderr, "dlpackd: --%s needs a positive number%s, not '%s'\n",
			limit_opts[i].name, limit_opts[i].size ? " (K, M, G or T may follow)" : "",
			arg);
		return -1;
	}
	return 1;
}

/* Every entry holds an fd: use all the fds the hard limit allows, not the soft 1024. */
static void raise_fd_limit(void)
{
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			dlpd_log(LOG_WARNING, "cannot raise the fd limit to %llu: %m",
				 (unsigned long long)rl.rlim_max);
	}
}

int main(int argc, char **argv)
{
	static const struct option base_opts[] = {
		{"socket", required_argument, NULL, 's'},
		{"log-level", required_argument, NULL, 'l'},
		{"help", no_argument, NULL, 'h'},
		{"version", no_argument, NULL, 'V'},
	};
	struct option opts[sizeof(base_opts) / sizeof(base_opts[0]) + N_LIMIT_OPTS + 1] = {{0}};
	size_t nopts = sizeof(base_opts) / sizeof(base_opts[0]);
	struct dlpd_limits lim;
	const char *socket_path = NULL;
	char defpath[108];
	struct dlpd_server srv;
	sigset_t stop_signals;
	uv_loop_t loop;
	int c, r;

	dlpd_limits_init(&lim);
	memcpy(opts, base_opts, sizeof(base_opts));
	for (size_t i = 0; i < N_LIMIT_OPTS; i++)
		opts[nopts + i] = (struct option){limit_opts[i].name, required_argument, NULL,
						  OPT_LIMIT_FIRST + (int)i};
	while ((c = getopt_long(argc, argv, "s:l:hV", opts, NULL)) != -1) {
		r = limit_opt(c, optarg, &lim);
		if (r < 0)
			return 2;
		if (r > 0)
			continue;
		switch (c) {
		case 's':
			socket_path = optarg;
			break;
		case 'l':
			dlpd_log_level = dlpd_log_parse_level(optarg);
			if (dlpd_log_level < 0) {
				fprintf(stderr, "dlpackd: unknown log level '%s'\n", optarg);
				return 2;
			}
			break;
		case 'h':
			usage(stdout);
			return 0;
		case 'V':
			printf("dlpackd %s (protocol %d.%d)\n", DLPD_VERSION, DLPC_PROTO_MAJOR,
			       DLPC_PROTO_MINOR);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "dlpackd: unexpected argument '%s'\n", argv[optind]);
		return 2;
	}
	dlpd_log_init();
	if (!socket_path) {
		r = dlpc_default_socket(defpath, sizeof(defpath));
		if (r < 0) {
			dlpd_log(LOG_ERR, "no socket path: %s; pass --socket or set %s",
				 r == -ENOENT ? "XDG_RUNTIME_DIR is not set"
					      : "the path is too long",
				 DLPC_SOCKET_ENV);
			return 1;
		}
		socket_path = defpath;
	}
	signal(SIGPIPE, SIG_IGN);
	raise_fd_limit();
	/* Clients can connect as soon as the socket listens, which is before the SIGTERM handler
	 * exists: hold the signals back until it does, so that none kills us by default. */
	sigemptyset(&stop_signals);
	sigaddset(&stop_signals, SIGTERM);
	sigaddset(&stop_signals, SIGINT);
	sigprocmask(SIG_BLOCK, &stop_signals, NULL);
	uv_loop_init(&loop);
	r = dlpd_reaper_start();
	if (r < 0) {
		dlpd_log(LOG_ERR, "cannot start the fd reaper thread: %s", strerror(-r));
		uv_loop_close(&loop);
		return 1;
	}
	r = dlpd_server_start(&srv, &loop, socket_path, DEFAULT_SOCKET_MODE, &lim);
	/* returns once dlpd_server_stop() has closed every handle */
	if (r == 0) {
		sigprocmask(SIG_UNBLOCK, &stop_signals, NULL);
		uv_run(&loop, UV_RUN_DEFAULT);
	}
	dlpd_server_free(&srv);
	dlpd_reaper_stop();
	uv_loop_close(&loop);
	if (r == 0)
		dlpd_log(LOG_NOTICE, "stopped");
	return r == 0 ? 0 : 1;
}
