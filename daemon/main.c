/* SPDX-License-Identifier: Apache-2.0 */
/* dlpackd: command line, setup and the event loop. */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
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
		"  -h, --help             show this help and exit\n"
		"  -V, --version          show the version and exit\n"
		"\n"
		"The default socket is $DLPACKD_SOCKET if set, else %s for root and\n"
		"$XDG_RUNTIME_DIR/%s for other users.\n",
		DLPC_SYSTEM_SOCKET, DLPC_USER_SOCKET_NAME);
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
	static const struct option opts[] = {
		{"socket", required_argument, NULL, 's'},
		{"log-level", required_argument, NULL, 'l'},
		{"help", no_argument, NULL, 'h'},
		{"version", no_argument, NULL, 'V'},
		{0},
	};
	const char *socket_path = NULL;
	char defpath[108];
	struct dlpd_server srv;
	sigset_t stop_signals;
	uv_loop_t loop;
	int c, r;

	while ((c = getopt_long(argc, argv, "s:l:hV", opts, NULL)) != -1) {
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
	r = dlpd_server_start(&srv, &loop, socket_path, DEFAULT_SOCKET_MODE);
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
