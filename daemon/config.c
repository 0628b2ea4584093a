/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's configuration: one table of options, each settable by a command-line flag and by
 * an environment variable (the flag wins, and a variable whose flag is given is not even read).
 * The table also writes --help, so the two never drift.
 *
 * To add a setting, add one row to `options` below pointing at the variable it sets: for a
 * number, OPT_UINT(long name, environment variable, variable, minimum, maximum, help), or
 * OPT_SIZE(...) for a byte count that may end in K, M, G or T. The
 * variable's value at start-up is its default and --help shows it. Add the flag to
 * docs/dlpackd.8 too (a test compares the two).
 */
#include <assert.h>
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>
#include <unistd.h>

#include "base.h"
#include "config.h"
#include "limits.h"
#include "registry.h"

struct dlpd_config dlpd_config = {
	.socket_path = NULL,
	.socket_mode = DLPD_DEFAULT_SOCKET_MODE,
	.socket_gid = (gid_t)-1,
};

struct dlpd_limits dlpd_limits = {
	.bytes_per_uid = DLPC_UID_BYTES_DEFAULT,
	.entries_per_uid = DLPC_UID_ENTRIES_DEFAULT,
	.memory_per_uid = DLPC_UID_MEMORY_DEFAULT,
	.connections_per_uid = DLPC_UID_CONNECTIONS_DEFAULT,
	.fd_share_per_uid = DLPC_UID_FD_SHARE_DEFAULT,
	.channels_per_uid = DLPC_UID_CHANNELS_DEFAULT,
	.refs_per_connection = DLPC_CONN_REFS_DEFAULT,
	.pending_per_connection = DLPC_CONN_PENDING_DEFAULT,
	.pending_bytes_per_uid = DLPC_UID_PENDING_BYTES_DEFAULT,
	.frame_timeout_ms = DLPC_FRAME_TIMEOUT_MS_DEFAULT,
	.queue_bytes = DLPC_TX_QUEUE_MAX,
	.queue_fds = DLPC_TX_QUEUE_FDS_MAX,
	.watch_queue_bytes = DLPC_WATCH_QUEUE_MAX,
};

struct option_row;
/* Parse @p val into the row's variable; 0, or -1 with the reason in @p why. */
typedef int parse_fn(const struct option_row *o, const char *val, char *why, size_t len);

struct option_row {
	const char *name; /* long flag, without "--" */
	int short_name;	  /* 0: none */
	const char *env;  /* environment variable, NULL: none */
	const char *arg;  /* the argument's name in --help, NULL: the flag takes none */
	const char *help;
	parse_fn *parse;
	void *dst;	 /* the variable the option sets */
	size_t dst_size; /* for OPT_UINT: sizeof the variable (4 or 8) */
	uint64_t min, max;
	bool bind_only; /* only means something when dlpackd binds the socket itself */
};

static parse_fn parse_path, parse_mode, parse_group, parse_level, parse_uint, parse_size;

/* An unsigned integer setting of 4 or 8 bytes, with its bounds. */
#define OPT_UINT(long_name, env_name, var, lo, hi, text)                                           \
	{                                                                                          \
		.name = long_name, .env = env_name, .arg = "N", .help = text, .parse = parse_uint, \
		.dst = &(var), .dst_size = sizeof(var), .min = (lo), .max = (hi),                  \
	}

/* The same for a byte count, which may end in K, M, G or T (powers of 1024). */
#define OPT_SIZE(long_name, env_name, var, lo, hi, text)                                           \
	{                                                                                          \
		.name = long_name, .env = env_name, .arg = "SIZE", .help = text,                   \
		.parse = parse_size, .dst = &(var), .dst_size = sizeof(var), .min = (lo),          \
		.max = (hi),                                                                       \
	}

static const struct option_row options[] = {
	{.name = "socket",
	 .short_name = 's',
	 .env = DLPC_SOCKET_ENV,
	 .arg = "PATH",
	 .help = "listen on PATH (default: " DLPC_SYSTEM_SOCKET " for root,\n"
		 "$XDG_RUNTIME_DIR/" DLPC_USER_SOCKET_NAME " for other users)",
	 .parse = parse_path,
	 .dst = &dlpd_config.socket_path,
	 .bind_only = true},
	{.name = "socket-mode",
	 .env = "DLPACKD_SOCKET_MODE",
	 .arg = "MODE",
	 .help = "permissions of the socket, in octal (default 0660)",
	 .parse = parse_mode,
	 .dst = &dlpd_config.socket_mode,
	 .bind_only = true},
	{.name = "socket-group",
	 .env = "DLPACKD_SOCKET_GROUP",
	 .arg = "GROUP",
	 .help = "give the socket to GROUP, a name or a number\n"
		 "(default: the daemon's own group)",
	 .parse = parse_group,
	 .dst = &dlpd_config.socket_gid,
	 .bind_only = true},
	{.name = "log-level",
	 .short_name = 'l',
	 .env = "DLPACKD_LOG_LEVEL",
	 .arg = "LEVEL",
	 .help = "err, warning, notice, info (default) or debug",
	 .parse = parse_level,
	 .dst = &dlpd_log_level},
	OPT_UINT("fd-store", "FDSTORE", dlpd_config.fd_store, 0, UINT32_MAX,
		 "fds the service manager keeps for dlpackd across\nrestarts "
		 "(FileDescriptorStoreMax=); with 0,\nentries end with the daemon"),
	OPT_SIZE("max-bytes-per-uid", "DLPACKD_MAX_BYTES_PER_UID", dlpd_limits.bytes_per_uid, 1,
		 UINT64_MAX, "storage bytes one uid may hold, counted on the\ndeclared size"),
	OPT_UINT("max-entries-per-uid", "DLPACKD_MAX_ENTRIES_PER_UID", dlpd_limits.entries_per_uid,
		 1, UINT64_MAX, "names and channels one uid may have"),
	OPT_SIZE("max-memory-per-uid", "DLPACKD_MAX_MEMORY_PER_UID", dlpd_limits.memory_per_uid,
		 DLPD_MEMORY_PER_UID_MIN, UINT64_MAX,
		 "dlpackd's own memory that one uid's entries,\nmessages, channels and references "
		 "may take"),
	OPT_UINT("max-connections-per-uid", "DLPACKD_MAX_CONNECTIONS_PER_UID",
		 dlpd_limits.connections_per_uid, 1, UINT64_MAX, "open connections of one uid"),
	OPT_UINT("max-fd-share-per-uid", "DLPACKD_MAX_FD_SHARE_PER_UID",
		 dlpd_limits.fd_share_per_uid, 1, 100,
		 "percent of the daemon's fds for storages,\nconnections and direct channels that "
		 "one uid\nmay hold"),
	OPT_UINT("max-channels-per-uid", "DLPACKD_MAX_CHANNELS_PER_UID",
		 dlpd_limits.channels_per_uid, 1, UINT64_MAX,
		 "channels one uid may have open (they outlive\nthe connection that opened them)"),
	OPT_UINT("max-refs-per-connection", "DLPACKD_MAX_REFS_PER_CONNECTION",
		 dlpd_limits.refs_per_connection, 1, UINT64_MAX,
		 "references one connection may hold"),
	OPT_UINT("max-pending-per-connection", "DLPACKD_MAX_PENDING_PER_CONNECTION",
		 dlpd_limits.pending_per_connection, 1, UINT64_MAX,
		 "ATTACH, SEND and RECV waiting per connection"),
	/* below DLPC_FRAME_HDR_SIZE + DLPC_FRAME_MAX, the largest frames cannot be sent */
	OPT_SIZE("max-pending-bytes-per-uid", "DLPACKD_MAX_PENDING_BYTES_PER_UID",
		 dlpd_limits.pending_bytes_per_uid, DLPC_RX_BUF_SIZE, UINT64_MAX,
		 "daemon memory one uid's unfinished frames and\nwaiting requests may hold"),
	OPT_UINT("frame-timeout-ms", "DLPACKD_FRAME_TIMEOUT_MS", dlpd_limits.frame_timeout_ms, 1,
		 UINT64_MAX, "time a client has to finish a frame it began,\nand to send HELLO"),
	/* at least one whole reply of the largest frame, or a big LIST page could drop a client
	 * that does read */
	OPT_SIZE("max-queue-bytes", "DLPACKD_MAX_QUEUE_BYTES", dlpd_limits.queue_bytes,
		 DLPC_FRAME_HDR_SIZE + DLPC_FRAME_MAX, UINT64_MAX,
		 "bytes waiting for a client that does not read\n(then it is dropped)"),
	OPT_UINT("max-queue-fds", "DLPACKD_MAX_QUEUE_FDS", dlpd_limits.queue_fds, 1, UINT64_MAX,
		 "fds waiting for a client that does not read"),
	OPT_SIZE("max-watch-queue-bytes", "DLPACKD_MAX_WATCH_QUEUE_BYTES",
		 dlpd_limits.watch_queue_bytes, 65536, UINT64_MAX,
		 "bytes of events waiting for a watcher"),
	{.name = "help", .short_name = 'h', .help = "show this help and exit"},
	{.name = "version", .short_name = 'V', .help = "show the version and exit"},
};

#define NOPTIONS (sizeof(options) / sizeof(options[0]))

/* Which rows were given, by flag or environment. */
static bool given[NOPTIONS];

static int parse_path(const struct option_row *o, const char *val, char *why, size_t len)
{
	if (!*val) {
		snprintf(why, len, "the path is empty");
		return -1;
	}
	if (strlen(val) > DLPC_DAEMON_SOCKET_PATH_MAX) {
		snprintf(why, len,
			 "the path is longer than %d bytes (DLPC_DAEMON_SOCKET_PATH_MAX: a socket "
			 "address holds %zu, and the socket is bound as PATH.new first)",
			 DLPC_DAEMON_SOCKET_PATH_MAX,
			 sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
		return -1;
	}
	*(const char **)o->dst = val;
	return 0;
}

static int parse_mode(const struct option_row *o, const char *val, char *why, size_t len)
{
	char *end;
	unsigned long v;

	errno = 0;
	v = strtoul(val, &end, 8);
	if (!*val || *end || errno || v > 0777 || val[0] == '-' || val[0] == '+') {
		snprintf(why, len, "not an octal mode between 0 and 0777");
		return -1;
	}
	*(unsigned *)o->dst = (unsigned)v;
	return 0;
}

static int parse_group(const struct option_row *o, const char *val, char *why, size_t len)
{
	struct group gr, *res = NULL;
	long hint = sysconf(_SC_GETGR_R_SIZE_MAX);
	size_t size = hint > 0 ? (size_t)hint : 4096;
	char *buf = NULL, *end;
	unsigned long long v;
	int r;

	if (*val >= '0' && *val <= '9') {
		errno = 0;
		v = strtoull(val, &end, 10);
		if (*end || errno || v >= (gid_t)-1) {
			snprintf(why, len, "not a group number");
			return -1;
		}
		*(gid_t *)o->dst = (gid_t)v;
		return 0;
	}
	/* a group with many members needs a larger buffer than the hint: grow it (to 16 MiB) */
	for (;;) {
		char *nbuf = realloc(buf, size);

		if (!nbuf) {
			r = ENOMEM;
			break;
		}
		buf = nbuf;
		r = getgrnam_r(val, &gr, buf, size, &res);
		if (r != ERANGE || size >= (16u << 20))
			break;
		size *= 2;
	}
	if (r != 0 || !res) {
		snprintf(why, len, "%s", r ? strerror(r) : "no such group");
		free(buf);
		return -1;
	}
	*(gid_t *)o->dst = res->gr_gid;
	free(buf);
	return 0;
}

static int parse_level(const struct option_row *o, const char *val, char *why, size_t len)
{
	int v = dlpd_log_parse_level(val);

	if (v < 0) {
		snprintf(why, len, "not a log level (err, warning, notice, info, debug)");
		return -1;
	}
	*(int *)o->dst = v;
	return 0;
}

static int parse_uint(const struct option_row *o, const char *val, char *why, size_t len)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(val, &end, 10);
	if (!*val || *end || errno || val[0] < '0' || val[0] > '9' || v < o->min || v > o->max) {
		snprintf(why, len, "not a whole number from %" PRIu64 " to %" PRIu64, o->min,
			 o->max);
		return -1;
	}
	if (o->dst_size == sizeof(uint32_t))
		*(uint32_t *)o->dst = (uint32_t)v;
	else
		*(uint64_t *)o->dst = v;
	return 0;
}

static int parse_size(const struct option_row *o, const char *val, char *why, size_t len)
{
	static const char units[] = "KMGT";
	const char *u;
	unsigned long long v;
	unsigned shift = 0;
	char *end;

	errno = 0;
	v = strtoull(val, &end, 10);
	if (*end && !end[1] && (u = strchr(units, *end)) != NULL) {
		shift = 10 * (unsigned)(u - units + 1);
		end++;
	}
	if (!*val || *end || errno || val[0] < '0' || val[0] > '9' || v > (UINT64_MAX >> shift) ||
	    (v << shift) < o->min || (v << shift) > o->max) {
		snprintf(why, len, "not a byte count from %" PRIu64 " (K, M, G or T may follow)",
			 o->min);
		return -1;
	}
	*(uint64_t *)o->dst = (uint64_t)v << shift;
	return 0;
}

static uint64_t uint_value(const struct option_row *o)
{
	return o->dst_size == sizeof(uint32_t) ? *(uint32_t *)o->dst : *(uint64_t *)o->dst;
}

/* Print @p text with every line after the first indented to the help column. */
static void print_help_text(FILE *f, const char *text)
{
	for (const char *p = text; *p; p++) {
		fputc(*p, f);
		if (*p == '\n')
			fprintf(f, "%30s", "");
	}
}

void dlpd_config_usage(FILE *f)
{
	fprintf(f, "Usage: dlpackd [OPTION]...\n"
		   "Share DLPack tensors between processes on this machine.\n\n");
	for (size_t i = 0; i < NOPTIONS; i++) {
		const struct option_row *o = &options[i];
		char flag[64];
		int n;

		if (o->short_name)
			n = snprintf(flag, sizeof(flag), "  -%c, --%s", o->short_name, o->name);
		else
			n = snprintf(flag, sizeof(flag), "      --%s", o->name);
		if (o->arg)
			snprintf(flag + n, sizeof(flag) - (size_t)n, "=%s", o->arg);
		if (strlen(flag) < 30)
			fprintf(f, "%-29s ", flag);
		else /* the help goes below a long flag */
			fprintf(f, "%s\n%30s", flag, "");
		print_help_text(f, o->help);
		if (o->parse == parse_uint)
			fprintf(f, " (default %" PRIu64 ")", uint_value(o));
		if (o->parse == parse_size) {
			static const char *const unit[] = {"", "K", "M", "G", "T"};
			uint64_t v = uint_value(o);
			int u = 0;

			while (u < 4 && v && v % 1024 == 0) {
				v /= 1024;
				u++;
			}
			fprintf(f, " (default %" PRIu64 "%s)", v, unit[u]);
		}
		if (o->env)
			fprintf(f, "\n%30s[env %s]", "", o->env);
		fputc('\n', f);
	}
	fprintf(f, "\nEach flag may instead be set by the environment variable named beside it;\n"
		   "the flag wins. Socket path, mode and group apply only when dlpackd binds its\n"
		   "socket itself, not when systemd passes one (socket activation).\n");
}

static int apply(const struct option_row *o, const char *val, const char *source)
{
	char why[160];

	if (o->parse(o, val, why, sizeof(why)) < 0) {
		fprintf(stderr, "dlpackd: invalid %s '%s': %s\n", source, val, why);
		return -1;
	}
	given[o - options] = true;
	return 0;
}

int dlpd_config_load(int argc, char **argv)
{
	struct option longopts[NOPTIONS + 1];
	char shortopts[2 * NOPTIONS + 1], source[64];
	size_t ns = 0;
	int c;

	memset(longopts, 0, sizeof(longopts));
	for (size_t i = 0; i < NOPTIONS; i++) {
		const struct option_row *o = &options[i];

		/* OPT_UINT stores 4 or 8 bytes, and a 4-byte variable cannot hold more */
		assert(o->parse != parse_uint || o->dst_size == sizeof(uint64_t) ||
		       (o->dst_size == sizeof(uint32_t) && o->max <= UINT32_MAX));
		assert(o->parse != parse_size || o->dst_size == sizeof(uint64_t));
		longopts[i] = (struct option){o->name, o->arg ? required_argument : no_argument,
					      NULL, o->short_name ? o->short_name : 256 + (int)i};
		if (o->short_name) {
			shortopts[ns++] = (char)o->short_name;
			if (o->arg)
				shortopts[ns++] = ':';
		}
	}
	shortopts[ns] = '\0';
	while ((c = getopt_long(argc, argv, shortopts, longopts, NULL)) != -1) {
		const struct option_row *o = NULL;

		if (c == 'h') {
			dlpd_config_usage(stdout);
			return 1;
		}
		if (c == 'V') {
			printf("dlpackd %s (protocol %d.%d)\n", DLPD_VERSION, DLPC_PROTO_MAJOR,
			       DLPC_PROTO_MINOR);
			return 1;
		}
		for (size_t i = 0; i < NOPTIONS && !o; i++)
			if (c == (options[i].short_name ? options[i].short_name : 256 + (int)i))
				o = &options[i];
		if (!o || !o->parse) {
			fprintf(stderr, "Try 'dlpackd --help' for the options.\n");
			return -1;
		}
		snprintf(source, sizeof(source), "--%s", o->name);
		if (apply(o, optarg, source) < 0)
			return -1;
	}
	if (optind < argc) {
		fprintf(stderr, "dlpackd: unexpected argument '%s'\n", argv[optind]);
		return -1;
	}
	/* then the environment, for what no flag set: the flag wins even over a bad value */
	for (size_t i = 0; i < NOPTIONS; i++) {
		const struct option_row *o = &options[i];
		const char *val = o->env ? getenv(o->env) : NULL;

		/* an empty variable counts as unset, like an empty DLPACKD_SOCKET for clients */
		if (given[i] || !val || !*val || !o->parse)
			continue;
		snprintf(source, sizeof(source), "%s", o->env);
		if (apply(o, val, source) < 0)
			return -1;
	}
	return 0;
}

const char *dlpd_config_bind_option_given(const char **env)
{
	for (size_t i = 0; i < NOPTIONS; i++)
		if (given[i] && options[i].bind_only) {
			*env = options[i].env;
			return options[i].name;
		}
	return NULL;
}
