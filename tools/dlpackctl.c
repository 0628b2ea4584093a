/* SPDX-License-Identifier: Apache-2.0 */
/*
 * dlpackctl: look at and manage a running dlpackd, through libdlpc's public API only (and, for
 * upgrade, the daemon's pid from the socket and a SIGHUP).
 * Exit status: 0 success, 1 the operation failed (the reason on stderr), 2 bad usage.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pwd.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <dlpc/dlpc.h>

#include "json.h"

#define EXIT_USAGE 2

static const char usage_text[] =
	"Usage: dlpackctl [--socket PATH] COMMAND [ARG]...\n"
	"Look at and manage a running dlpackd.\n"
	"\n"
	"Commands:\n"
	"  ls [PREFIX] [--json]      list the entries whose names start with PREFIX\n"
	"  stat [--json]             show the daemon's counters\n"
	"  rm NAME                   unpublish NAME\n"
	"  channels [PREFIX] [--json]  list the channels whose names start with PREFIX\n"
	"  rmchan NAME               remove the channel NAME and the messages it queues\n"
	"  wait NAME [--timeout S]   wait until NAME is published (at most S seconds)\n"
	"  ping                      check that the daemon answers\n"
	"  check [PREFIX] [--json]   attach every entry under PREFIX, report those that fail\n"
	"  watch [PREFIX] [--json]   print publish, replace and unpublish events as they happen\n"
	"  upgrade [--timeout S]     have the daemon execute its binary again, keeping entries\n"
	"\n"
	"Options:\n"
	"  --socket PATH   the daemon's socket (default: $DLPACKD_SOCKET if set, else\n"
	"                  $XDG_RUNTIME_DIR/dlpackd.sock if it exists, else\n"
	"                  /run/dlpackd/dlpackd.sock)\n"
	"  --json          machine-readable output: one JSON document (ls, stat, check,\n"
	"                  channels) or\n"
	"                  one JSON object per line (watch)\n"
	"  --timeout S     give up waiting after S seconds (wait: default forever;\n"
	"                  upgrade: default 30)\n"
	"  -h, --help      show this help and exit ('dlpackctl COMMAND --help': that\n"
	"                  command's)\n"
	"  -V, --version   show the version and exit\n"
	"  --              end of options (for a NAME or PREFIX that starts with a dash)\n"
	"\n"
	"Exit status: 0 success, 1 the operation failed, 2 usage error.\n";

/* The parsed command line. */
struct args {
	const char *socket;
	const char *cmd;
	const char *pos[2]; /* positional arguments of the command */
	int npos;
	bool json;
	bool has_timeout;
	double timeout;
};

static int usage_error(const char *fmt, const char *arg)
{
	fputs("dlpackctl: ", stderr);
	fprintf(stderr, fmt, arg);
	fputs("\nTry 'dlpackctl --help' for more information.\n", stderr);
	return EXIT_USAGE;
}

/* Report a failed library call: "dlpackctl: rm 'foo': no entry named 'foo'". */
static int fail(const char *what, const char *name, int err)
{
	const char *msg = dlpc_last_error();

	if (!msg[0])
		msg = dlpc_strerror(err);
	if (name) {
		fprintf(stderr, "dlpackctl: %s '", what);
		text_put(stderr, name, strlen(name));
		fprintf(stderr, "': %s\n", msg);
	} else {
		fprintf(stderr, "dlpackctl: %s: %s\n", what, msg);
	}
	return 1;
}

/* ---- formatting ---- */

static const char *dtype_name(DLDataType t, char *buf, size_t len)
{
	static const char *const codes[] = {
		[kDLInt] = "int",	[kDLUInt] = "uint",
		[kDLFloat] = "float",	[kDLOpaqueHandle] = "handle",
		[kDLBfloat] = "bfloat", [kDLComplex] = "complex",
		[kDLBool] = "bool",
	};
	const char *code = t.code < sizeof(codes) / sizeof(codes[0]) ? codes[t.code] : NULL;
	int n;

	if (code)
		n = snprintf(buf, len, "%s%u", code, (unsigned)t.bits);
	else
		n = snprintf(buf, len, "dtype%u_%u", (unsigned)t.code, (unsigned)t.bits);
	if (t.lanes > 1 && n > 0 && (size_t)n < len)
		snprintf(buf + n, len - (size_t)n, "x%u", (unsigned)t.lanes);
	return buf;
}

/* "float32[2,3]" for a single tensor, "bundle(N)" for several, "?" if the daemon left it out. */
static const char *type_text(const dlpc_entry_info *e, char *buf, size_t len)
{
	char dt[32];
	size_t o;

	if (e->ntensors != 1) {
		snprintf(buf, len, "bundle(%zu)", e->ntensors);
		return buf;
	}
	if (!e->tensors) {
		snprintf(buf, len, "?");
		return buf;
	}
	o = (size_t)snprintf(buf, len, "%s[", dtype_name(e->tensors[0].dtype, dt, sizeof(dt)));
	for (int32_t i = 0; i < e->tensors[0].ndim && o < len; i++)
		o += (size_t)snprintf(buf + o, len - o, "%s%" PRId64, i ? "," : "",
				      e->tensors[0].shape[i]);
	if (o < len)
		snprintf(buf + o, len - o, "]");
	return buf;
}

static const char *device_text(DLDevice d, char *buf, size_t len)
{
	switch ((int)d.device_type) {
	case kDLCPU:
		snprintf(buf, len, "cpu");
		break;
	case kDLCUDA:
		snprintf(buf, len, "cuda:%d", (int)d.device_id);
		break;
	case kDLCUDAHost:
		snprintf(buf, len, "cuda_host");
		break;
	default:
		snprintf(buf, len, "device%d:%d", (int)d.device_type, (int)d.device_id);
	}
	return buf;
}

static const char *size_text(uint64_t n, char *buf, size_t len)
{
	static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
	double v = (double)n;
	unsigned u = 0;

	while (v >= 1024 && u + 1 < sizeof(units) / sizeof(units[0]))
		v /= 1024, u++;
	if (u == 0)
		snprintf(buf, len, "%" PRIu64 " B", n);
	else
		snprintf(buf, len, "%.1f %s", v, units[u]);
	return buf;
}

static int64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static const char *age_text(int64_t created_ns, char *buf, size_t len)
{
	int64_t s = (now_ns() - created_ns) / 1000000000;

	if (s < 0)
		s = 0;
	if (s < 120)
		snprintf(buf, len, "%" PRId64 "s", s);
	else if (s < 7200)
		snprintf(buf, len, "%" PRId64 "m", s / 60);
	else if (s < 172800)
		snprintf(buf, len, "%" PRId64 "h", s / 3600);
	else
		snprintf(buf, len, "%" PRId64 "d", s / 86400);
	return buf;
}

/* The user's name, or the uid as a number when it has none. */
static const char *user_text(uint32_t uid, char *buf, size_t len)
{
	struct passwd pw, *res = NULL;
	char tmp[1024];

	if (getpwuid_r(uid, &pw, tmp, sizeof(tmp), &res) == 0 && res)
		snprintf(buf, len, "%s", pw.pw_name);
	else
		snprintf(buf, len, "%u", (unsigned)uid);
	return buf;
}

static void put_padded(const char *s, size_t width)
{
	size_t w = text_put(stdout, s, strlen(s));

	while (w++ < width)
		putchar(' ');
}

/*
 * Print a table: @p nrows rows (the first the heading) of @p ncol cells each, row by row in
 * @p cell; every column as wide as its widest cell (as text_put() writes it, names escaped), two
 * spaces apart, the last one unpadded.
 */
static void put_table(const char *const *cell, size_t nrows, size_t ncol)
{
	size_t width[16] = {0};

	for (size_t i = 0; i < nrows; i++)
		for (size_t k = 0; k < ncol && k < 16; k++) {
			size_t w = text_width(cell[i * ncol + k], strlen(cell[i * ncol + k]));

			if (w > width[k])
				width[k] = w;
		}
	for (size_t i = 0; i < nrows; i++) {
		for (size_t k = 0; k < ncol; k++)
			put_padded(cell[i * ncol + k], k + 1 < ncol && k < 16 ? width[k] + 2 : 0);
		putchar('\n');
	}
}

/* ---- JSON ---- */

/* The fields of an entry, into an object already open. */
static void json_entry_fields(struct json *j, const dlpc_entry_info *e)
{
	char buf[64];

	json_key(j, "name");
	json_cstr(j, e->name);
	json_key(j, "generation");
	json_u64(j, e->generation);
	json_key(j, "device");
	json_cstr(j, device_text(e->device, buf, sizeof(buf)));
	json_key(j, "device_type");
	json_i64(j, e->device.device_type);
	json_key(j, "device_id");
	json_i64(j, e->device.device_id);
	json_key(j, "ephemeral");
	json_bool(j, e->flags & DLPC_PUBLISH_EPHEMERAL);
	json_key(j, "writable");
	json_bool(j, e->flags & DLPC_PUBLISH_WRITABLE);
	json_key(j, "nbytes");
	json_u64(j, e->nbytes);
	json_key(j, "refs");
	json_u64(j, e->refs);
	json_key(j, "cached_refs");
	json_u64(j, e->cached_refs);
	json_key(j, "owner_uid");
	json_u64(j, e->owner_uid);
	json_key(j, "owner_user");
	json_cstr(j, user_text(e->owner_uid, buf, sizeof(buf)));
	json_key(j, "owner_pid");
	json_i64(j, e->owner_pid);
	json_key(j, "created_ns");
	json_i64(j, e->created_ns);
	json_key(j, "ntensors");
	json_u64(j, e->ntensors);
	json_key(j, "tensors");
	if (!e->tensors) {
		json_null(j);
		return;
	}
	json_arr_begin(j);
	for (size_t i = 0; i < e->ntensors; i++) {
		const dlpc_tensor_info *t = &e->tensors[i];

		json_obj_begin(j);
		json_key(j, "key");
		json_cstr(j, t->key);
		json_key(j, "dtype");
		json_cstr(j, dtype_name(t->dtype, buf, sizeof(buf)));
		json_key(j, "shape");
		json_arr_begin(j);
		for (int32_t d = 0; d < t->ndim; d++)
			json_i64(j, t->shape[d]);
		json_arr_end(j);
		json_key(j, "nbytes");
		json_u64(j, t->nbytes);
		json_obj_end(j);
	}
	json_arr_end(j);
}

/* ---- commands ---- */

static int cmd_ls(dlpc_client *c, const struct args *a)
{
	const char *prefix = a->npos ? a->pos[0] : "";
	static const char *const head[] = {"NAME", "GEN",    "DEVICE", "TYPE", "SIZE",
					   "REFS", "CACHED", "OWNER",  "AGE"};
	enum { NCOL = 9 };
	size_t n;
	dlpc_entry_info *v;
	char(*cells)[NCOL][160]; /* column 0, the name, is printed from v[i] */
	const char **table;
	int r = dlpc_list(c, prefix, &v, &n);

	if (r < 0)
		return fail("ls", prefix, r);
	if (a->json) {
		struct json j;

		json_init(&j, stdout);
		json_arr_begin(&j);
		for (size_t i = 0; i < n; i++) {
			json_obj_begin(&j);
			json_entry_fields(&j, &v[i]);
			json_obj_end(&j);
		}
		json_arr_end(&j);
		putchar('\n');
		dlpc_list_free(v, n);
		return 0;
	}
	cells = calloc(n, sizeof(*cells));
	table = calloc((n + 1) * NCOL, sizeof(*table));
	if ((n && !cells) || !table) {
		free(cells);
		free(table);
		dlpc_list_free(v, n);
		fprintf(stderr, "dlpackctl: ls: out of memory\n");
		return 1;
	}
	for (int k = 0; k < NCOL; k++)
		table[k] = head[k];
	for (size_t i = 0; i < n; i++) {
		const char **row = table + (i + 1) * NCOL;
		char user[64];

		snprintf(cells[i][1], sizeof(cells[i][1]), "%" PRIu64, v[i].generation);
		device_text(v[i].device, cells[i][2], sizeof(cells[i][2]));
		type_text(&v[i], cells[i][3], sizeof(cells[i][3]));
		size_text(v[i].nbytes, cells[i][4], sizeof(cells[i][4]));
		snprintf(cells[i][5], sizeof(cells[i][5]), "%" PRIu64, v[i].refs);
		snprintf(cells[i][6], sizeof(cells[i][6]), "%" PRIu64, v[i].cached_refs);
		snprintf(cells[i][7], sizeof(cells[i][7]), "%s/%d",
			 user_text(v[i].owner_uid, user, sizeof(user)), (int)v[i].owner_pid);
		age_text(v[i].created_ns, cells[i][8], sizeof(cells[i][8]));
		row[0] = v[i].name;
		for (int k = 1; k < NCOL; k++)
			row[k] = cells[i][k];
	}
	put_table(table, n + 1, NCOL);
	free(table);
	free(cells);
	dlpc_list_free(v, n);
	return 0;
}

static int cmd_stat(dlpc_client *c, const struct args *a)
{
	dlpc_stats s = {.size = sizeof(s)};
	struct json j;
	int r = dlpc_stat(c, &s);
	const struct {
		const char *name;
		uint64_t v;
	} rows[] = {
		{"daemon_pid", s.daemon_pid},
		{"uptime_ms", s.uptime_ms},
		{"connections", s.connections},
		{"entries", s.entries},
		{"storages", s.storages},
		{"bytes_held", s.bytes_held},
		{"references", s.references},
		{"cached_references", s.cached_references},
		{"invalidations", s.invalidations},
		{"waiters", s.waiters},
		{"watchers", s.watchers},
		{"events", s.events},
		{"fds_open", s.fds_open},
		{"fds_closing", s.fds_closing},
		{"fds_own", s.fds_own},
		{"fd_budget", s.fd_budget},
		{"fds_sent", s.fds_sent},
		{"tx_queued", s.tx_queued},
		{"queue_drops", s.queue_drops},
		{"protocol_errors", s.protocol_errors},
		{"req_hello", s.req_hello},
		{"req_publish", s.req_publish},
		{"req_attach", s.req_attach},
		{"req_release", s.req_release},
		{"req_unpublish", s.req_unpublish},
		{"req_list", s.req_list},
		{"req_stat", s.req_stat},
		{"req_watch", s.req_watch},
		{"uid_bytes_held", s.uid_bytes_held},
		{"uid_bytes_pinned", s.uid_bytes_pinned},
		{"uid_entries", s.uid_entries},
		{"uid_connections", s.uid_connections},
		{"channels", s.channels},
		{"messages", s.messages},
		{"req_send", s.req_send},
		{"req_recv", s.req_recv},
		{"req_channel", s.req_channel},
		{"req_cancel", s.req_cancel},
		{"uid_channels", s.uid_channels},
	};

	if (r < 0)
		return fail("stat", NULL, r);
	if (!a->json) {
		int width = 0;

		for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
			if ((int)strlen(rows[i].name) > width)
				width = (int)strlen(rows[i].name);
		for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++)
			printf("%-*s  %" PRIu64 "\n", width, rows[i].name, rows[i].v);
		return 0;
	}
	json_init(&j, stdout);
	json_obj_begin(&j);
	for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
		json_key(&j, rows[i].name);
		json_u64(&j, rows[i].v);
	}
	json_obj_end(&j);
	putchar('\n');
	return 0;
}

static int cmd_rm(dlpc_client *c, const struct args *a)
{
	int r = dlpc_unpublish(c, a->pos[0]);

	return r < 0 ? fail("rm", a->pos[0], r) : 0;
}

/* WAITING of 'channels': "-" when nobody waits, else "2 recv", "1 send" or "2 recv, 1 send". */
static const char *waiting_text(uint32_t recv, uint32_t send, char *buf, size_t len)
{
	if (!recv && !send)
		snprintf(buf, len, "-");
	else if (!send)
		snprintf(buf, len, "%u recv", (unsigned)recv);
	else if (!recv)
		snprintf(buf, len, "%u send", (unsigned)send);
	else
		snprintf(buf, len, "%u recv, %u send", (unsigned)recv, (unsigned)send);
	return buf;
}

/* STATE of 'channels': "open" or "ended", and once producers are known or more than one is
 * expected, ", C/N closed": C closed of the N closes the end waits for as known now (those
 * expected, or more where more producers came). */
static const char *state_text(const dlpc_channel_info *i, char *buf, size_t len)
{
	const char *word = (i->flags & DLPC_CHANNEL_ENDED) ? "ended" : "open";
	uint32_t known = i->producers + i->producers_closed;
	uint32_t need = i->producers_expected > known ? i->producers_expected : known;

	if (!known && need <= 1)
		snprintf(buf, len, "%s", word);
	else
		snprintf(buf, len, "%s, %u/%u closed", word, (unsigned)i->producers_closed,
			 (unsigned)need);
	return buf;
}

static int cmd_channels(dlpc_client *c, const struct args *a)
{
	const char *prefix = a->npos ? a->pos[0] : "";
	static const char *const head[] = {"NAME",     "KIND",	  "DEPTH", "QUEUED", "SENT",
					   "RECEIVED", "WAITING", "STATE", "OWNER"};
	enum { NCOL = 9 };
	dlpc_channel_info *v;
	size_t n;
	int r = dlpc_channel_list(c, prefix, &v, &n);
	char(*cells)[NCOL][96]; /* column 0, the name, is printed from v[i] */
	const char **table;
	struct json j;

	if (r < 0)
		return fail("channels", prefix, r);
	if (a->json) {
		json_init(&j, stdout);
		json_arr_begin(&j);
		for (size_t i = 0; i < n; i++) {
			const struct {
				const char *key;
				uint64_t v;
			} f[] = {
				{"capacity", v[i].capacity},
				{"depth", v[i].depth},
				{"bytes_queued", v[i].bytes_queued},
				{"sent", v[i].sent},
				{"received", v[i].received},
				{"receivers_waiting", v[i].receivers_waiting},
				{"senders_waiting", v[i].senders_waiting},
				{"owner_uid", v[i].owner_uid},
				{"producers", v[i].producers},
				{"producers_closed", v[i].producers_closed},
				{"producers_expected", v[i].producers_expected},
			};

			json_obj_begin(&j);
			json_key(&j, "name");
			json_str(&j, v[i].name, strlen(v[i].name));
			for (size_t k = 0; k < sizeof(f) / sizeof(f[0]); k++) {
				json_key(&j, f[k].key);
				json_u64(&j, f[k].v);
			}
			json_key(&j, "owner_pid");
			json_i64(&j, v[i].owner_pid);
			json_key(&j, "created_ns");
			json_i64(&j, v[i].created_ns);
			json_key(&j, "direct");
			json_bool(&j, (v[i].flags & DLPC_CHANNEL_DIRECT) != 0);
			json_key(&j, "ended");
			json_bool(&j, (v[i].flags & DLPC_CHANNEL_ENDED) != 0);
			json_obj_end(&j);
		}
		json_arr_end(&j);
		putchar('\n');
		free(v);
		return 0;
	}
	cells = calloc(n, sizeof(*cells));
	table = calloc((n + 1) * NCOL, sizeof(*table));
	if ((n && !cells) || !table) {
		free(cells);
		free(table);
		free(v);
		fprintf(stderr, "dlpackctl: channels: out of memory\n");
		return 1;
	}
	for (int k = 0; k < NCOL; k++)
		table[k] = head[k];
	for (size_t i = 0; i < n; i++) {
		const char **row = table + (i + 1) * NCOL;
		char user[64];

		row[0] = v[i].name;
		for (int k = 1; k < NCOL; k++)
			row[k] = cells[i][k];
		snprintf(cells[i][2], sizeof(cells[i][2]), "%u/%u", v[i].depth, v[i].capacity);
		state_text(&v[i], cells[i][7], sizeof(cells[i][7]));
		snprintf(cells[i][8], sizeof(cells[i][8]), "%s/%d",
			 user_text(v[i].owner_uid, user, sizeof(user)), (int)v[i].owner_pid);
		/* a direct channel's messages never pass the daemon: it counts only the queue */
		if (v[i].flags & DLPC_CHANNEL_DIRECT) {
			row[1] = "direct";
			row[3] = row[4] = row[5] = row[6] = "-";
			continue;
		}
		row[1] = "queued";
		size_text(v[i].bytes_queued, cells[i][3], sizeof(cells[i][3]));
		snprintf(cells[i][4], sizeof(cells[i][4]), "%" PRIu64, v[i].sent);
		snprintf(cells[i][5], sizeof(cells[i][5]), "%" PRIu64, v[i].received);
		waiting_text(v[i].receivers_waiting, v[i].senders_waiting, cells[i][6],
			     sizeof(cells[i][6]));
	}
	put_table(table, n + 1, NCOL);
	free(table);
	free(cells);
	free(v);
	return 0;
}

static int cmd_rmchan(dlpc_client *c, const struct args *a)
{
	int r = dlpc_channel_remove(c, a->pos[0]);

	return r < 0 ? fail("rmchan", a->pos[0], r) : 0;
}

static int cmd_wait(dlpc_client *c, const struct args *a)
{
	dlpc_attach_opts opts = {.size = sizeof(opts), .timeout_ms = -1};
	dlpc_bundle *b;
	int r;

	if (a->has_timeout)
		/* at least 1 ms: 0 would mean "do not wait" */
		opts.timeout_ms = a->timeout * 1000 < 1 ? 1 : (int64_t)ceil(a->timeout * 1000);
	/* attaching waits for the name in the daemon; the reference goes right away */
	r = dlpc_attach_bundle(c, a->pos[0], &opts, &b);
	if (r < 0)
		return fail("wait", a->pos[0], r);
	dlpc_bundle_free(b);
	return 0;
}

static int cmd_ping(dlpc_client *c, const struct args *a)
{
	dlpc_stats s = {.size = sizeof(s)};
	int r = dlpc_stat(c, &s);

	(void)a;
	if (r < 0)
		return fail("ping", NULL, r);
	printf("dlpackd pid %u answers on %s, up %.1f s\n", (unsigned)s.daemon_pid,
	       dlpc_socket_path(c), (double)s.uptime_ms / 1000);
	return 0;
}

/* One entry of 'check': attach it whole (importing GPU memory), then let it go. */
static void check_one(dlpc_client *c, const dlpc_entry_info *e, struct json *j, int *failed)
{
	dlpc_attach_opts o = {.size = sizeof(o), .flags = DLPC_ATTACH_DEFER_SYNC};
	char dev[32], why[1024] = "";
	const char *state = "ok";
	dlpc_bundle *b = NULL;
	int r = dlpc_attach_bundle(c, e->name, &o, &b);

	if (r > 0) {
		dlpc_bundle_free(b);
	} else if (r == -ENOENT) {
		state = "gone"; /* unpublished since it was listed */
	} else {
		state = "failed";
		snprintf(why, sizeof(why), "%s",
			 dlpc_last_error()[0] ? dlpc_last_error() : dlpc_strerror(r));
		++*failed;
	}
	device_text(e->device, dev, sizeof(dev));
	if (j) {
		json_obj_begin(j);
		json_key(j, "name");
		json_cstr(j, e->name);
		json_key(j, "generation");
		json_u64(j, r > 0 ? (uint64_t)r : e->generation);
		json_key(j, "device");
		json_cstr(j, dev);
		json_key(j, "state");
		json_cstr(j, state);
		json_key(j, "error");
		if (why[0])
			json_cstr(j, why);
		else
			json_null(j);
		json_obj_end(j);
		return;
	}
	printf("%-6s  ", state);
	text_put(stdout, e->name, strlen(e->name));
	printf(" gen %" PRIu64 " %s", r > 0 ? (uint64_t)r : e->generation, dev);
	if (why[0]) {
		fputs(": ", stdout);
		text_put(stdout, why, strlen(why));
	}
	putchar('\n');
}

/*
 * Attach every entry under a prefix, as a consumer would, and report each: a CUDA VMM entry
 * whose device was torn down since its publisher exited lists like any other but cannot be
 * imported any more. Exit status 1 when any failed.
 */
static int cmd_check(dlpc_client *c, const struct args *a)
{
	const char *prefix = a->npos ? a->pos[0] : "";
	dlpc_entry_info *v;
	struct json j;
	int failed = 0;
	size_t n;
	int r = dlpc_list(c, prefix, &v, &n);

	if (r < 0)
		return fail("check", prefix, r);
	if (a->json) {
		json_init(&j, stdout);
		json_arr_begin(&j);
	}
	for (size_t i = 0; i < n; i++)
		check_one(c, &v[i], a->json ? &j : NULL, &failed);
	if (a->json) {
		json_arr_end(&j);
		putchar('\n');
	}
	dlpc_list_free(v, n);
	if (failed)
		fprintf(stderr, "dlpackctl: check: %d of %zu entries cannot be attached\n", failed,
			n);
	return failed ? 1 : 0;
}

static const char *const kind_names[] = {
	[DLPC_WATCH_PUBLISHED] = "published",	       [DLPC_WATCH_REPLACED] = "replaced",
	[DLPC_WATCH_UNPUBLISHED] = "unpublished",      [DLPC_WATCH_CHANNEL_OPENED] = "chan-opened",
	[DLPC_WATCH_CHANNEL_REMOVED] = "chan-removed",
};

/* A channel opened or removed: its name, who did it. */
static void print_channel_event(const dlpc_watch_event *ev, bool json)
{
	struct json j;

	if (!json) {
		printf("%-11s ", kind_names[ev->kind]);
		text_put(stdout, ev->entry.name, strlen(ev->entry.name));
		printf(" (by pid %d)\n", (int)ev->actor_pid);
		fflush(stdout);
		return;
	}
	json_init(&j, stdout);
	json_obj_begin(&j);
	json_key(&j, "event");
	json_cstr(&j, kind_names[ev->kind]);
	json_key(&j, "seq");
	json_u64(&j, ev->seq);
	json_key(&j, "channel");
	json_str(&j, ev->entry.name, strlen(ev->entry.name));
	json_key(&j, "actor_uid");
	json_u64(&j, ev->actor_uid);
	json_key(&j, "actor_pid");
	json_i64(&j, ev->actor_pid);
	json_obj_end(&j);
	putchar('\n');
	fflush(stdout);
}

static void print_event(const dlpc_watch_event *ev, bool json)
{
	const dlpc_entry_info *e = &ev->entry;
	char type[160], dev[32], size[32], user[64];

	if (ev->kind == DLPC_WATCH_CHANNEL_OPENED || ev->kind == DLPC_WATCH_CHANNEL_REMOVED) {
		print_channel_event(ev, json);
		return;
	}
	if (json) {
		struct json j;

		json_init(&j, stdout);
		json_obj_begin(&j);
		json_key(&j, "event");
		json_cstr(&j, kind_names[ev->kind]);
		json_key(&j, "seq");
		json_u64(&j, ev->seq);
		json_key(&j, "previous_generation");
		if (ev->kind == DLPC_WATCH_REPLACED)
			json_u64(&j, ev->previous_generation);
		else
			json_null(&j);
		json_key(&j, "reason");
		if (ev->kind != DLPC_WATCH_UNPUBLISHED)
			json_null(&j);
		else
			json_cstr(&j, ev->reason == DLPC_WATCH_BY_DISCONNECT ? "disconnect"
									     : "request");
		json_key(&j, "actor_uid");
		json_u64(&j, ev->actor_uid);
		json_key(&j, "actor_pid");
		json_i64(&j, ev->actor_pid);
		json_entry_fields(&j, e);
		json_obj_end(&j);
		putchar('\n');
		fflush(stdout);
		return;
	}
	printf("%-11s ", kind_names[ev->kind]);
	text_put(stdout, e->name, strlen(e->name));
	printf(" gen %" PRIu64, e->generation);
	if (ev->kind == DLPC_WATCH_REPLACED)
		printf(" (was %" PRIu64 ")", ev->previous_generation);
	printf(" %s %s %s owner %s/%d", device_text(e->device, dev, sizeof(dev)),
	       type_text(e, type, sizeof(type)), size_text(e->nbytes, size, sizeof(size)),
	       user_text(e->owner_uid, user, sizeof(user)), (int)e->owner_pid);
	if (ev->kind == DLPC_WATCH_UNPUBLISHED)
		printf(ev->reason == DLPC_WATCH_BY_DISCONNECT ? " (publisher disconnected)"
							      : " (by pid %d)",
		       (int)ev->actor_pid);
	putchar('\n');
	fflush(stdout);
}

static int cmd_watch(const struct args *a)
{
	const char *prefix = a->npos ? a->pos[0] : "";
	dlpc_watch_event ev;
	dlpc_watch *w;
	int r;

	w = dlpc_watch_open(a->socket, prefix, &r);
	if (!w)
		return fail("watch", prefix, r);
	/* a watcher that is dropped or sees the daemon stop has failed: report it */
	while ((r = dlpc_watch_next(w, &ev, -1)) >= 0 || r == -EINTR) {
		if (r != 1)
			continue;
		print_event(&ev, a->json);
		/* a reader that went away (EPIPE) or a full disk ends the watch */
		if (fflush(stdout) != 0 || ferror(stdout)) {
			fprintf(stderr, "dlpackctl: watch: cannot write the output: %s\n",
				strerror(errno));
			dlpc_watch_close(w);
			return 1;
		}
	}
	/* the library's message already names the watch and its prefix */
	fprintf(stderr, "dlpackctl: %s\n", dlpc_last_error());
	dlpc_watch_close(w);
	return 1;
}

/* The pid of the process that listens on the daemon's socket, as this process sees it (0 in
 * another pid namespace); negative errno if none answers. */
static int daemon_pid(const char *socket_path)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct ucred cred;
	socklen_t len = sizeof(cred);
	int fd, r;

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", socket_path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	r = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 ||
			    getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0
		    ? -errno
		    : (int)cred.pid;
	close(fd);
	return r;
}

static uint64_t mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* SIGHUP the daemon (it executes its binary again, keeping entries and socket), then wait for
 * the new image: the same pid answering with an uptime that began after the signal. @p c is
 * NULL when the daemon speaks another protocol version (another build, the one to replace):
 * the pid comes from the socket alone, and the new image must speak this dlpackctl's. */
static int cmd_upgrade(dlpc_client *c, const struct args *a)
{
	dlpc_stats before = {.size = sizeof(before)}, after = {.size = sizeof(after)};
	uint64_t t0, limit = a->has_timeout ? (uint64_t)(a->timeout * 1000) : 30000;
	char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
	int r = c ? dlpc_stat(c, &before) : 0, pid;

	if (r < 0)
		return fail("upgrade", NULL, r);
	if (c)
		snprintf(path, sizeof(path), "%s", dlpc_socket_path(c));
	else if (a->socket)
		snprintf(path, sizeof(path), "%s", a->socket);
	else if ((r = dlpc_default_socket(path, sizeof(path))) < 0)
		return fail("upgrade", NULL, r);
	pid = daemon_pid(path);
	if (pid <= 0) {
		fprintf(stderr, "dlpackctl: upgrade: %s\n",
			pid == 0
				? "dlpackd runs in another pid namespace: send it SIGHUP from there"
				: strerror(-pid));
		return 1;
	}
	t0 = mono_ms();
	if (kill(pid, SIGHUP) < 0) {
		fprintf(stderr, "dlpackctl: upgrade: cannot signal dlpackd (pid %d): %s%s\n", pid,
			strerror(errno), errno == EPERM ? "; run as its user or as root" : "");
		return 1;
	}
	for (;;) {
		dlpc_client *n;
		uint64_t t;

		usleep(20000);
		r = dlpc_connect(a->socket, &n);
		if (r == 0) {
			r = dlpc_stat(n, &after);
			dlpc_close(n);
		}
		t = mono_ms();
		/* another daemon answering (the service manager started one after the old one
		 * died) is a restart, not an upgrade in place: its entries may be gone */
		if (r == 0 && after.daemon_pid != (uint32_t)pid) {
			fprintf(stderr,
				"dlpackctl: upgrade: dlpackd pid %d is gone; pid %u answers at %s "
				"now (a restart, not an upgrade in place): %llu entries\n",
				pid, (unsigned)after.daemon_pid, path,
				(unsigned long long)after.entries);
			return 1;
		}
		if (r == 0 && after.uptime_ms <= t - t0)
			break;
		if (t - t0 > limit) {
			fprintf(stderr,
				"dlpackctl: upgrade: dlpackd (pid %d) did not come back within "
				"%.1f "
				"s%s%s\n",
				pid, (double)limit / 1000,
				r < 0 ? ": " : " (it still runs the old image)",
				r < 0 ? dlpc_strerror(r) : "");
			return 1;
		}
	}
	if (c)
		printf("dlpackd pid %u upgraded in place: %llu entries (%llu before)\n",
		       (unsigned)after.daemon_pid, (unsigned long long)after.entries,
		       (unsigned long long)before.entries);
	else
		printf("dlpackd pid %u upgraded in place from another protocol version: %llu "
		       "entries\n",
		       (unsigned)after.daemon_pid, (unsigned long long)after.entries);
	return 0;
}

/* ---- command line ---- */

static const struct command {
	const char *name;
	int min_pos, max_pos;
	bool json, timeout;
	const char *args; /* what follows the name in its usage line */
	const char *help; /* what it does, for 'dlpackctl COMMAND --help' */
} commands[] = {
	{"ls", 0, 1, true, false, "[PREFIX] [--json]",
	 "List the entries whose names start with PREFIX (every entry without one): NAME, GEN\n"
	 "(generation), DEVICE, TYPE (dtype and shape, or bundle(N)), SIZE, REFS (attach\n"
	 "references), CACHED (of REFS, idle in clients' caches), OWNER (user/pid) and AGE.\n"
	 "--json: one JSON array of objects.\n"},
	{"stat", 0, 0, true, false, "[--json]",
	 "Show the daemon's counters, one 'name value' per line (--json: one JSON object).\n"
	 "The uid_ counters are the caller's uid's.\n"},
	{"rm", 1, 1, false, false, "NAME",
	 "Unpublish NAME. Tensors attached already stay valid; only the name's owner (its uid)\n"
	 "or root may remove it.\n"},
	{"wait", 1, 1, false, true, "NAME [--timeout S]",
	 "Wait until NAME is published, at most S seconds (default: as long as it takes).\n"},
	{"ping", 0, 0, false, false, "",
	 "Check that the daemon answers: its pid, the socket it answers on, its uptime.\n"},
	{"watch", 0, 1, true, false, "[PREFIX] [--json]",
	 "Print publish, replace and unpublish events of the names under PREFIX as they happen,\n"
	 "until interrupted (--json: one JSON object per line).\n"},
	{"check", 0, 1, true, false, "[PREFIX] [--json]",
	 "Attach every entry under PREFIX (importing GPU memory), let it go, and report those\n"
	 "that fail; exit status 1 if any does.\n"},
	{"upgrade", 0, 0, false, true, "[--timeout S]",
	 "Have the daemon execute its binary again in place, keeping entries and socket; wait\n"
	 "up to S seconds (default 30) for the new image to answer.\n"},
	{"channels", 0, 1, true, false, "[PREFIX] [--json]",
	 "List the channels whose names start with PREFIX: NAME, KIND (queued or direct),\n"
	 "DEPTH (queued/capacity), QUEUED (bytes), SENT, RECEIVED, WAITING (receivers and\n"
	 "senders waiting: '-' for none, else '2 recv, 1 send'), STATE (the stream: 'open'\n"
	 "or 'ended', with ', 1/2 closed' once producers are known or several are expected:\n"
	 "producers closed of the closes its end waits for) and OWNER (user/pid).\n"
	 "--json: one JSON array of objects.\n"},
	{"rmchan", 1, 1, false, false, "NAME",
	 "Remove the channel NAME and the messages it queues.\n"},
};

/* 'dlpackctl COMMAND --help': its usage line, what it does, the options it takes. */
static void command_help(const struct command *cmd)
{
	printf("Usage: dlpackctl [--socket PATH] %s%s%s\n%s\nOptions:\n", cmd->name,
	       cmd->args[0] ? " " : "", cmd->args, cmd->help);
	printf("  --socket PATH   the daemon's socket (see 'dlpackctl --help')\n");
	if (cmd->json)
		printf("  --json          machine-readable output\n");
	if (cmd->timeout)
		printf("  --timeout S     give up waiting after S seconds\n");
	printf("  -h, --help      show this help and exit\n");
}

static bool parse_seconds(const char *s, double *ret)
{
	char *end;
	double v;

	errno = 0;
	v = strtod(s, &end);
	if (errno || end == s || *end || !isfinite(v) || v < 0 || v > 86400.0 * 365 * 100)
		return false;
	*ret = v;
	return true;
}

/* Fill @p a from argv; 0 or EXIT_USAGE (message printed), -1 when help or version was shown. */
static int parse(int argc, char **argv, struct args *a)
{
	const struct command *cmd = NULL;
	bool opts_done = false;

	for (int i = 1; i < argc; i++) {
		const char *arg = argv[i];
		const char *val = NULL;

		if (!opts_done && (!strcmp(arg, "-h") || !strcmp(arg, "--help"))) {
			/* after a command: that command's help */
			if (cmd)
				command_help(cmd);
			else
				fputs(usage_text, stdout);
			return -1;
		}
		if (!opts_done && (!strcmp(arg, "-V") || !strcmp(arg, "--version"))) {
			printf("dlpackctl %s\n", dlpc_version());
			return -1;
		}
		if (!opts_done && !strcmp(arg, "--")) {
			opts_done = true;
			continue;
		}
		if (!opts_done && arg[0] == '-' && arg[1]) {
			size_t klen = strcspn(arg, "=");
			bool takes = !strncmp(arg, "--socket", klen) && klen == 8;

			takes = takes || (!strncmp(arg, "--timeout", klen) && klen == 9);
			if (takes) {
				if (arg[klen] == '=')
					val = arg + klen + 1;
				else if (i + 1 < argc)
					val = argv[++i];
				else
					return usage_error("option '%s' needs a value", arg);
			}
			if (!strncmp(arg, "--socket", 8) && klen == 8) {
				if (!*val)
					return usage_error("%s", "--socket needs a non-empty path");
				a->socket = val;
			} else if (!strncmp(arg, "--timeout", 9) && klen == 9) {
				if (!parse_seconds(val, &a->timeout))
					return usage_error("bad --timeout '%s': give seconds >= 0",
							   val);
				a->has_timeout = true;
			} else if (!strcmp(arg, "--json")) {
				a->json = true;
			} else {
				return usage_error("unknown option '%s'", arg);
			}
			continue;
		}
		if (!cmd) {
			for (size_t k = 0; k < sizeof(commands) / sizeof(commands[0]); k++)
				if (!strcmp(arg, commands[k].name))
					cmd = &commands[k];
			if (!cmd)
				return usage_error("unknown command '%s'", arg);
			a->cmd = cmd->name;
			continue;
		}
		if (a->npos >= cmd->max_pos)
			return usage_error("too many arguments for '%s'", cmd->name);
		a->pos[a->npos++] = arg;
	}
	if (!cmd)
		return usage_error("%s", "no command given");
	if (a->npos < cmd->min_pos)
		return usage_error("'%s' needs a NAME", cmd->name);
	if (a->json && !cmd->json)
		return usage_error("'%s' has no --json output", cmd->name);
	if (a->has_timeout && !cmd->timeout)
		return usage_error("--timeout applies to 'wait' and 'upgrade', not '%s'",
				   cmd->name);
	return 0;
}

int main(int argc, char **argv)
{
	struct args a = {0};
	dlpc_client *c;
	int r = parse(argc, argv, &a);

	if (r)
		return r < 0 ? 0 : r;
	if (!strcmp(a.cmd, "watch"))
		return cmd_watch(&a);
	r = dlpc_connect(a.socket, &c);
	/* a daemon of another build (another protocol version) is what an upgrade replaces */
	if (r == -EPROTO && !strcmp(a.cmd, "upgrade")) {
		fprintf(stderr, "dlpackctl: upgrade: %s\n", dlpc_last_error());
		return cmd_upgrade(NULL, &a);
	}
	if (r < 0)
		return fail(a.cmd, NULL, r);
	if (!strcmp(a.cmd, "ls"))
		r = cmd_ls(c, &a);
	else if (!strcmp(a.cmd, "stat"))
		r = cmd_stat(c, &a);
	else if (!strcmp(a.cmd, "rm"))
		r = cmd_rm(c, &a);
	else if (!strcmp(a.cmd, "wait"))
		r = cmd_wait(c, &a);
	else if (!strcmp(a.cmd, "check"))
		r = cmd_check(c, &a);
	else if (!strcmp(a.cmd, "upgrade"))
		r = cmd_upgrade(c, &a);
	else if (!strcmp(a.cmd, "channels"))
		r = cmd_channels(c, &a);
	else if (!strcmp(a.cmd, "rmchan"))
		r = cmd_rmchan(c, &a);
	else
		r = cmd_ping(c, &a);
	dlpc_close(c);
	if (fflush(stdout) != 0 || ferror(stdout)) {
		fprintf(stderr, "dlpackctl: %s: cannot write the output\n", a.cmd);
		return 1;
	}
	return r;
}
