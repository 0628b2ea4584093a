/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Direct channels (protocol 1.8) against a real dlpackd, driven from separate processes: order
 * and content, exactly one receiver per message, backpressure from the socket's buffer, removal,
 * a killed receiver, a killed daemon, the two kinds kept apart, a hostile sender writing into
 * the channel's socket, and a forked child.
 *
 * A direct channel's messages are memfds named "dlpc:CHANNEL" queued in a socket: whether they
 * were freed is told by no process holding one (/proc/PID/fd, /proc/PID/maps) once the socket
 * queues none (a raw JOIN's dup of the receiving end says how many are queued).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <linux/sockios.h>

#include "direct.h"
#include "harness.h"
#include "limits.h"
#include "raw.h"
#include "table.h"

static struct daemon D;

static void setup(void)
{
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

static dlpc_client *child_connect(void)
{
	dlpc_client *c = NULL;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	return c;
}

static int open_direct(dlpc_client *c, const char *name, uint32_t cap, dlpc_channel_info *info)
{
	return dlpc_channel_open_flags(c, name, cap, DLPC_CHANNEL_DIRECT, info);
}

/* Send a vector of @p n int64 holding v, v+1, ... to @p ch; dlpc_send_bundle()'s result. */
static int send_value(dlpc_client *c, const char *ch, int64_t v, int64_t n, uint32_t flags,
		      int64_t timeout_ms)
{
	dlpc_send_opts o = {.size = sizeof(o), .flags = flags, .timeout_ms = timeout_ms};
	int64_t *data = calloc((size_t)n, sizeof(*data));
	DLManagedTensorVersioned *t;
	int r;

	for (int64_t i = 0; i < n; i++)
		data[i] = v + i;
	t = host_tensor(data, (DLDataType){kDLInt, 64, 1}, 1, &n, NULL, NULL);
	r = dlpc_send_bundle(c, ch, 1, NULL, &t, &o);
	free(data);
	return r;
}

/* Receive one message of @p ch: its first value into *@p v, its length into *@p n if not NULL,
 * whether every element is v, v+1, ... into the result's sign; the tensor into *@p keep if not
 * NULL (else released). dlpc_recv()'s result, or -EILSEQ for bytes not as sent. */
static int recv_value(dlpc_client *c, const char *ch, int64_t timeout_ms, int64_t *v, int64_t *n,
		      DLManagedTensorVersioned **keep)
{
	dlpc_recv_opts o = {.size = sizeof(o), .timeout_ms = timeout_ms};
	DLManagedTensorVersioned *t;
	const int64_t *d;
	int r = dlpc_recv(c, ch, &o, &t);

	if (r < 0)
		return r;
	d = t->dl_tensor.data;
	*v = d[0];
	if (n)
		*n = t->dl_tensor.shape[0];
	for (int64_t i = 0; i < t->dl_tensor.shape[0]; i++)
		if (d[i] != d[0] + i)
			r = -EILSEQ;
	if (keep)
		*keep = t;
	else
		t->deleter(t);
	return r;
}

/* The parent of @p pid, or 0. */
static pid_t parent_of(pid_t pid)
{
	char path[64], line[256];
	FILE *f;
	pid_t pp = 0;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	f = fopen(path, "re");
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "PPid: %d", &pp) == 1)
			break;
	if (f)
		fclose(f);
	return pp;
}

/* Is @p pid this process or one of its descendants (the daemon, the children)? Other
 * suites running meanwhile make memfds of the same names. */
static bool ours(pid_t pid)
{
	for (int depth = 0; pid > 1 && depth < 64; depth++, pid = parent_of(pid))
		if (pid == getpid())
			return true;
	return false;
}

static bool is_want(const char *target, void *arg)
{
	return strcmp(target, arg) == 0;
}

/* fds and mappings, in this process and its descendants, of memfds libdlpc made for channel
 * @p ch ("dlpc:CH"). */
static int memfds_held(const char *ch)
{
	char want[128], path[600], line[1024];
	DIR *proc = opendir("/proc");
	struct dirent *p;
	int n = 0;

	ck_assert_ptr_nonnull(proc);
	snprintf(want, sizeof(want), "/memfd:dlpc:%s (deleted)", ch);
	while ((p = readdir(proc))) {
		FILE *maps;

		if (p->d_name[0] < '1' || p->d_name[0] > '9' || !ours(atoi(p->d_name)))
			continue;
		n += fd_links(atoi(p->d_name), is_want, want);
		snprintf(path, sizeof(path), "/proc/%s/maps", p->d_name);
		maps = fopen(path, "re");
		while (maps && fgets(line, sizeof(line), maps)) {
			char *nl = strchr(line, '\n');

			if (nl)
				*nl = '\0';
			n += strlen(line) >= strlen(want) &&
			     strcmp(line + strlen(line) - strlen(want), want) == 0;
		}
		if (maps)
			fclose(maps);
	}
	closedir(proc);
	return n;
}

/* Wait until the main thread of @p pid sits in poll(): a libdlpc call waiting on a direct
 * channel's end (a child's earlier calls are done by then); whether it got there. */
static bool waits_in_poll(pid_t pid)
{
	char path[64];
	long nr = -1;

	snprintf(path, sizeof(path), "/proc/%d/syscall", (int)pid);
	for (int i = 0; i < scaled_ms(5000) / 5; i++) {
		FILE *f = fopen(path, "re");

		if (f && fscanf(f, "%ld", &nr) != 1)
			nr = -1;
		if (f)
			fclose(f);
		if (nr == SYS_poll || nr == SYS_ppoll)
			return true;
		usleep(5000);
	}
	return false;
}

/* Poll until memfds_held(@p ch) is @p want; whether it got there. */
static bool memfds_reach(const char *ch, int want)
{
	for (int i = 0; i < scaled_ms(5000) / 10; i++) {
		if (memfds_held(ch) == want)
			return true;
		usleep(10000);
	}
	return memfds_held(ch) == want;
}

/* ---- raw access: CHANNEL JOIN ---- */

/* Read one frame with every fd it carries (at most 4) into @p fds; how many came. */
static unsigned raw_recv_all(int fd, struct dlpc__hdr *h, uint8_t *buf, size_t cap, int fds[4])
{
	uint8_t hdr[DLPC_FRAME_HDR_SIZE];
	union {
		struct cmsghdr c;
		char b[CMSG_SPACE(4 * sizeof(int))];
	} ctl;
	struct iovec iov = {.iov_base = hdr, .iov_len = sizeof(hdr)};
	struct msghdr mh = {.msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = ctl.b,
			    .msg_controllen = sizeof(ctl.b)};
	unsigned n = 0;
	size_t got;

	ck_assert_int_eq(recvmsg(fd, &mh, MSG_WAITALL | MSG_CMSG_CLOEXEC), sizeof(hdr));
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
			for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++)
				memcpy(&fds[n++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
	dlpc__hdr_decode(hdr, h);
	ck_assert_int_eq(dlpc__hdr_check(h), 0);
	ck_assert_uint_le(h->len, cap);
	for (got = 0; got < h->len;) {
		ssize_t k = read(fd, buf + got, h->len - got);

		ck_assert_int_gt(k, 0);
		got += (size_t)k;
	}
	return n;
}

/* The code of the ERROR frame @p buf of @p len bytes; its message into @p msg. */
static int error_code(const uint8_t *buf, size_t len, char *msg, size_t msglen)
{
	Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, len, buf);
	int code;

	ck_assert_ptr_nonnull(e);
	code = e->code;
	snprintf(msg, msglen, "%s", e->message);
	dlpackd__v1__error__free_unpacked(e, NULL);
	return code;
}

/* CHANNEL JOIN of @p name on the raw connection @p fd: 0 and the two ends, -1 for a reply
 * without them (a queued channel, 1.10), or the error code (and its message in @p msg). */
static int raw_join(int fd, const char *name, int ends[2], char *msg, size_t len)
{
	Dlpackd__V1__Channel co = DLPACKD__V1__CHANNEL__INIT;
	struct dlpc__hdr h;
	uint8_t buf[4096];
	int fds[4];
	unsigned n;

	co.op = 4;
	co.name.data = (uint8_t *)name;
	co.name.len = strlen(name);
	raw_send(fd, DLPC_MSG_CHANNEL, 8, &co.base, NULL, 0);
	n = raw_recv_all(fd, &h, buf, sizeof(buf), fds);
	if (h.type == DLPC_MSG_ERROR) {
		ck_assert_uint_eq(n, 0);
		return error_code(buf, h.len, msg, len);
	}
	ck_assert_uint_eq(h.type, DLPC_MSG_CHANNEL | DLPC_MSG_REPLY);
	if (n == 0)
		return -1;
	ck_assert_uint_eq(n, 2);
	ends[0] = fds[0];
	ends[1] = fds[1];
	return 0;
}

/* Records queued in a channel's receiving end @p rx. */
static int queued(int rx)
{
	int bytes = -1;

	ck_assert_int_eq(ioctl(rx, SIOCINQ, &bytes), 0);
	return bytes / DLPC_DIRECT_RECORD;
}

/* ---- end of stream (1.10) ---- */

#define END_N 50 /* messages each of two producers sends */

/* A producer of "d/end": END_N values from arg's base, then its close. */
static int end_producer(void *arg)
{
	int64_t base = *(int64_t *)arg;
	dlpc_client *c = child_connect();
	dlpc_channel_opts o = {.size = sizeof(o), .producers = 2};
	dlpc_channel_info i = {.size = sizeof(i)};

	/* opened by name: a direct channel, as it is */
	CHILD_CHECK(dlpc_channel_open_opts(c, "d/end", &o, &i) == 0);
	CHILD_CHECK(i.flags & DLPC_CHANNEL_DIRECT);
	for (int64_t k = 0; k < END_N; k++)
		CHILD_CHECK(send_value(c, "d/end", base + k, 1, 0, -1) == 0);
	CHILD_CHECK(dlpc_channel_close(c, "d/end") == 0);
	/* its own sends after its close are refused */
	CHILD_CHECK(send_value(c, "d/end", -1, 1, 0, -1) == -EPIPE);
	dlpc_close(c);
	return 0;
}

/* Two producers, one slow consumer: every message of both, then the end, by itself (without
 * the end the loop below never stops: a receive without a timeout waits for ever). */
START_TEST(test_end_two_producers)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_channel_opts o = {
		.size = sizeof(o), .capacity = 8, .flags = DLPC_CHANNEL_DIRECT, .producers = 2};
	static unsigned char seen[2 * END_N];
	int64_t bases[2] = {0, END_N}, v;
	dlpc_channel_info i = {.size = sizeof(i)};
	pid_t p[2];
	int got = 0, r;

	ck_assert_dlpc(dlpc_channel_open_opts(c, "d/end", &o, &i), 1);
	ck_assert_uint_eq(i.producers_expected, 2);
	p[0] = spawn(end_producer, &bases[0]);
	p[1] = spawn(end_producer, &bases[1]);
	while ((r = recv_value(c, "d/end", -1, &v, NULL, NULL)) == 0) {
		ck_assert(v >= 0 && v < 2 * END_N && !seen[v]);
		seen[v] = 1;
		got++;
		usleep(2000); /* a slow consumer: the producers wait for room */
	}
	ck_assert_dlpc(r, -EPIPE);
	ck_assert_int_eq(got, 2 * END_N);
	ck_assert_int_eq(wait_child(p[0]), 0);
	ck_assert_int_eq(wait_child(p[1]), 0);
	i = chan_or_die(c, "d/end");
	ck_assert_uint_eq(i.flags, DLPC_CHANNEL_DIRECT | DLPC_CHANNEL_ENDED);
	ck_assert_uint_eq(i.producers, 0);
	ck_assert_uint_eq(i.producers_closed, 2);
	/* it stays ended: sends from anyone are refused, receives end at once */
	ck_assert_dlpc(send_value(c, "d/end", 1, 1, 0, -1), -EPIPE);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "'d/end'"));
	ck_assert_dlpc(recv_value(c, "d/end", 0, &v, NULL, NULL), -EPIPE);
	/* a new stream: remove, open again */
	ck_assert_dlpc(dlpc_channel_remove(c, "d/end"), 0);
	ck_assert_dlpc(open_direct(c, "d/end", 0, &i), 1);
	ck_assert(!(i.flags & DLPC_CHANNEL_ENDED));
	ck_assert_dlpc(send_value(c, "d/end", 1, 1, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, "d/end", 0, &v, NULL, NULL), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/end"), 0);
	dlpc_close(c);
}
END_TEST

/* Another process removes "d/next" and opens it anew, for a new stream. */
static int next_stream(void *arg)
{
	dlpc_client *c = child_connect();

	(void)arg;
	CHILD_CHECK(dlpc_channel_remove(c, "d/next") == 0);
	CHILD_CHECK(open_direct(c, "d/next", 0, NULL) == 1);
	dlpc_close(c);
	return 0;
}

/* A process that read one stream to its end (its endpoint learned the end) sends on the next
 * stream of the name, made by another process after a removal: the old end does not stick. */
START_TEST(test_end_then_new_stream_send)
{
	dlpc_client *c = connect_or_die(&D);
	int64_t v = -1;

	ck_assert_dlpc(open_direct(c, "d/next", 0, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/next", 3, 1, 0, -1), 0);
	ck_assert_dlpc(dlpc_channel_close(c, "d/next"), 0);
	ck_assert_dlpc(recv_value(c, "d/next", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 3);
	ck_assert_dlpc(recv_value(c, "d/next", 0, &v, NULL, NULL), -EPIPE);
	ck_assert_int_eq(wait_child(spawn(next_stream, NULL)), 0);
	ck_assert_dlpc(send_value(c, "d/next", 4, 1, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, "d/next", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 4);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/next"), 0);
	dlpc_close(c);
}
END_TEST

/* PRODUCE is for a direct channel, whose messages the daemon never sees: on a queued one
 * (whose producers are the connections that send to it) it is refused, and makes no producer
 * that would hold the stream open, unseen, until its connection ends. */
START_TEST(test_produce_on_queued_refused)
{
	Dlpackd__V1__Channel co = DLPACKD__V1__CHANNEL__INIT;
	dlpc_client *c = connect_or_die(&D);
	struct dlpc__hdr h;
	uint8_t buf[4096];
	char msg[256] = "";
	int fd = raw_connect(&D), fds[4];

	raw_hello(fd, DLPC_PROTO_MAJOR);
	ck_assert_dlpc(dlpc_channel_open(c, "d/pq", 0, NULL), 1);
	co.op = 6;
	co.name.data = (uint8_t *)"d/pq";
	co.name.len = 4;
	raw_send(fd, DLPC_MSG_CHANNEL, 9, &co.base, NULL, 0);
	ck_assert_uint_eq(raw_recv_all(fd, &h, buf, sizeof(buf), fds), 0);
	ck_assert_uint_eq(h.type, DLPC_MSG_ERROR);
	ck_assert_int_eq(error_code(buf, h.len, msg, sizeof(msg)), EPROTOTYPE);
	ck_assert_ptr_nonnull(strstr(msg, "'d/pq'"));
	ck_assert_uint_eq(chan_or_die(c, "d/pq").producers, 0);
	close(fd);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/pq"), 0);
	dlpc_close(c);
}
END_TEST

/* A receiver waiting on an empty direct channel: its first message, then the end. */
static int end_waiter(void *arg)
{
	dlpc_client *c = child_connect();
	int64_t v;

	CHILD_CHECK(recv_value(c, "d/wake", -1, &v, NULL, NULL) == 0 && v == 7);
	/* it says so when it waits: the test then closes */
	CHILD_CHECK(write(*(int *)arg, "w", 1) == 1);
	CHILD_CHECK(recv_value(c, "d/wake", -1, &v, NULL, NULL) == -EPIPE);
	dlpc_close(c);
	return 0;
}

START_TEST(test_end_wakes_waiter)
{
	dlpc_client *c = connect_or_die(&D);
	int pfd[2];
	char ch;
	pid_t w;

	ck_assert_int_eq(pipe(pfd), 0);
	ck_assert_dlpc(open_direct(c, "d/wake", 0, NULL), 1);
	w = spawn(end_waiter, &pfd[1]);
	ck_assert_dlpc(send_value(c, "d/wake", 7, 1, 0, -1), 0);
	ck_assert_int_eq(read(pfd[0], &ch, 1), 1);
	usleep(20000); /* (most often it waits by now; either way it must end) */
	ck_assert_dlpc(dlpc_channel_close(c, "d/wake"), 0);
	ck_assert_int_eq(wait_child(w), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/wake"), 0);
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(c);
}
END_TEST

/* A producer that sends two messages and dies without closing. */
static int end_crasher(void *arg)
{
	dlpc_client *c = child_connect();

	(void)arg;
	CHILD_CHECK(send_value(c, "d/crash", 1, 1, 0, -1) == 0);
	CHILD_CHECK(send_value(c, "d/crash", 2, 1, 0, -1) == 0);
	kill(getpid(), SIGKILL);
	return 1;
}

START_TEST(test_end_producer_crash)
{
	dlpc_client *c = connect_or_die(&D);
	int64_t v;

	ck_assert_dlpc(open_direct(c, "d/crash", 8, NULL), 1);
	ck_assert_int_eq(wait_child(spawn(end_crasher, NULL)), 128 + SIGKILL);
	/* its connection's end is its close: the consumer gets what it sent, then the end */
	ck_assert(WAIT_CHAN(c, "d/crash", producers_closed, 1));
	ck_assert_dlpc(recv_value(c, "d/crash", -1, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 1);
	ck_assert_dlpc(recv_value(c, "d/crash", -1, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 2);
	ck_assert_dlpc(recv_value(c, "d/crash", -1, &v, NULL, NULL), -EPIPE);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/crash"), 0);
	dlpc_close(c);
}
END_TEST

/* Closed as a whole by its owner: what is queued is received, later sends get EPIPE. */
START_TEST(test_end_close_all)
{
	dlpc_client *c = connect_or_die(&D), *p = connect_or_die(&D);
	int64_t v;

	ck_assert_dlpc(open_direct(c, "d/all", 8, NULL), 1);
	ck_assert_dlpc(send_value(p, "d/all", 1, 1, 0, -1), 0);
	ck_assert_dlpc(send_value(p, "d/all", 2, 1, 0, -1), 0);
	ck_assert_dlpc(dlpc_channel_close_flags(c, "d/all", DLPC_CHANNEL_CLOSE_ALL), 0);
	ck_assert_uint_eq(chan_or_die(c, "d/all").producers, 1); /* p never closed */
	ck_assert_dlpc(send_value(p, "d/all", 3, 1, 0, -1), -EPIPE);
	ck_assert_dlpc(recv_value(c, "d/all", -1, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 1);
	ck_assert_uint_eq(chan_or_die(c, "d/all").depth, 1);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/all"), 0);
	ck_assert_dlpc(recv_value(c, "d/all", 0, &v, NULL, NULL), -ENOENT);
	dlpc_close(p);
	dlpc_close(c);
}
END_TEST

/* ---- 1: order and content, from another process ---- */

#define ORDER_N 200

static int order_sender(void *arg)
{
	dlpc_client *c = child_connect();

	(void)arg;
	for (int64_t i = 0; i < ORDER_N; i++)
		CHILD_CHECK(send_value(c, "d/ord", i * 1000, 1 + i % 300, 0, -1) == 0);
	dlpc_close(c);
	return 0;
}

START_TEST(test_order)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_channel_info info = {.size = sizeof(info)};
	pid_t s;

	ck_assert_dlpc(open_direct(c, "d/ord", 8, &info), 1);
	ck_assert_uint_eq(info.flags, DLPC_CHANNEL_DIRECT);
	ck_assert_uint_ge(info.capacity, 2);
	ck_assert_uint_le(info.capacity, 8);
	ck_assert_str_eq(info.name, "d/ord");
	s = spawn(order_sender, NULL);
	for (int64_t i = 0; i < ORDER_N; i++) {
		dlpc_attach_info ai = {.size = sizeof(ai)};
		DLManagedTensorVersioned *t;
		int64_t v = -1, n = 0;

		ck_assert_dlpc(recv_value(c, "d/ord", scaled_ms(5000), &v, &n, &t), 0);
		ck_assert_int_eq(v, i * 1000);
		ck_assert_int_eq(n, 1 + i % 300);
		ck_assert(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
		ck_assert_dlpc(dlpc_tensor_attach_info(t, &ai), 0);
		ck_assert_int_eq(ai.owner_pid, s);
		ck_assert_uint_eq(ai.owner_uid, getuid());
		t->deleter(t);
	}
	ck_assert_int_eq(wait_child(s), 0);
	info = chan_or_die(c, "d/ord");
	ck_assert_uint_eq(info.depth, 0);
	ck_assert_uint_eq(info.sent, 0);
	ck_assert_uint_eq(info.received, 0);
	ck_assert_uint_eq(info.bytes_queued, 0);
	/* the daemon saw none of it */
	ck_assert_uint_eq(stat_or_die(c).storages, 0);
	ck_assert_uint_eq(stat_or_die(c).req_send, 0);
	ck_assert(memfds_reach("d/ord", 0));
	ck_assert_dlpc(dlpc_channel_remove(c, "d/ord"), 0);
	dlpc_close(c);
}
END_TEST

/* ---- 2: each message to exactly one of several receivers ---- */

#define ONCE_N 300
#define ONCE_RECEIVERS 3

static int once_receiver(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();

	for (;;) {
		int64_t v;

		CHILD_CHECK(recv_value(c, "d/once", -1, &v, NULL, NULL) == 0);
		if (v < 0)
			break;
		CHILD_CHECK(write(fd, &v, sizeof(v)) == sizeof(v));
	}
	dlpc_close(c);
	return 0;
}

START_TEST(test_exactly_once)
{
	dlpc_client *c = connect_or_die(&D);
	static unsigned char seen[ONCE_N];
	pid_t r[ONCE_RECEIVERS];
	int pfd[2], got = 0;
	int64_t v;

	ck_assert_dlpc(open_direct(c, "d/once", 8, NULL), 1);
	ck_assert_int_eq(pipe(pfd), 0);
	for (int i = 0; i < ONCE_RECEIVERS; i++)
		r[i] = spawn(once_receiver, &pfd[1]);
	close(pfd[1]);
	for (int64_t i = 0; i < ONCE_N; i++)
		ck_assert_dlpc(send_value(c, "d/once", i, 1, 0, -1), 0);
	for (int i = 0; i < ONCE_RECEIVERS; i++)
		ck_assert_dlpc(send_value(c, "d/once", -1, 1, 0, -1), 0);
	while (read(pfd[0], &v, sizeof(v)) == sizeof(v)) {
		ck_assert(v >= 0 && v < ONCE_N);
		ck_assert_msg(!seen[v], "message %lld received twice", (long long)v);
		seen[v] = 1;
		got++;
	}
	ck_assert_int_eq(got, ONCE_N);
	for (int i = 0; i < ONCE_RECEIVERS; i++)
		ck_assert_int_eq(wait_child(r[i]), 0);
	ck_assert_uint_eq(chan_or_die(c, "d/once").depth, 0);
	close(pfd[0]);
	dlpc_close(c);
}
END_TEST

/* ---- 3: backpressure ---- */

static int blocked_sender(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();

	/* joined (the first use), then waiting */
	CHILD_CHECK(send_value(c, "d/bp", 1000, 1, DLPC_SEND_NOWAIT, -1) == -EAGAIN);
	CHILD_CHECK(write(fd, "s", 1) == 1);
	CHILD_CHECK(send_value(c, "d/bp", 1000, 1, 0, -1) == 0);
	CHILD_CHECK(write(fd, "d", 1) == 1);
	dlpc_close(c);
	return 0;
}

START_TEST(test_backpressure)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_channel_info info = {.size = sizeof(info)}, big = {.size = sizeof(big)};
	struct pollfd pl;
	int pfd[2];
	uint32_t cap;
	char x;
	pid_t s;
	int64_t v;

	ck_assert_dlpc(open_direct(c, "d/bp", 4, &info), 1);
	cap = info.capacity;
	ck_assert_uint_ge(cap, 2);
	ck_assert_uint_le(cap, 4);
	for (uint32_t i = 0; i < cap; i++)
		ck_assert_dlpc(send_value(c, "d/bp", i, 1, DLPC_SEND_NOWAIT, -1), 0);
	ck_assert_uint_eq(chan_or_die(c, "d/bp").depth, cap);
	ck_assert_dlpc(send_value(c, "d/bp", 99, 1, DLPC_SEND_NOWAIT, -1), -EAGAIN);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "'d/bp'"));
	ck_assert_dlpc(send_value(c, "d/bp", 99, 1, 0, 0), -EAGAIN);
	ck_assert_dlpc(send_value(c, "d/bp", 99, 1, 0, scaled_ms(200)), -ETIMEDOUT);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "'d/bp'"));
	info = chan_or_die(c, "d/bp");
	ck_assert_uint_eq(info.depth, cap);
	ck_assert_uint_eq(info.senders_waiting, 0);
	/* a capacity past net.unix.max_dgram_qlen (10): what big.capacity says fits, exactly */
	ck_assert_dlpc(open_direct(c, "d/bp64", 64, &big), 1);
	ck_assert_uint_ge(big.capacity, 11);
	ck_assert_uint_le(big.capacity, 64);
	for (uint32_t i = 0; i < big.capacity; i++)
		ck_assert_dlpc(send_value(c, "d/bp64", i, 1, DLPC_SEND_NOWAIT, -1), 0);
	ck_assert_dlpc(send_value(c, "d/bp64", 99, 1, DLPC_SEND_NOWAIT, -1), -EAGAIN);
	ck_assert_uint_eq(chan_or_die(c, "d/bp64").depth, big.capacity);
	/* a sender in another process waits, and goes on once a message is received */
	ck_assert_int_eq(pipe(pfd), 0);
	s = spawn(blocked_sender, &pfd[1]);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert_int_eq(x, 's');
	/* blocked: its message has no room */
	ck_assert(waits_in_poll(s));
	pl = (struct pollfd){.fd = pfd[0], .events = POLLIN};
	ck_assert_int_eq(poll(&pl, 1, 0), 0);
	ck_assert_uint_eq(chan_or_die(c, "d/bp").depth, cap);
	ck_assert_dlpc(recv_value(c, "d/bp", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 0);
	/* room for one: the blocked sender's message goes in */
	ck_assert_msg(
		poll(&pl, 1, scaled_ms(5000)) == 1,
		"the blocked sender did not complete once a receive made room (depth %u of %u)",
		chan_or_die(c, "d/bp").depth, cap);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert_int_eq(x, 'd');
	ck_assert_int_eq(wait_child(s), 0);
	for (uint32_t i = 1; i < cap; i++) {
		ck_assert_dlpc(recv_value(c, "d/bp", 0, &v, NULL, NULL), 0);
		ck_assert_int_eq(v, i);
	}
	ck_assert_dlpc(recv_value(c, "d/bp", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 1000);
	ck_assert_dlpc(recv_value(c, "d/bp", 0, &v, NULL, NULL), -EAGAIN);
	ck_assert_dlpc(recv_value(c, "d/bp", scaled_ms(50), &v, NULL, NULL), -ETIMEDOUT);
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(c);
}
END_TEST

/* Does this process come to hold @p want fds within a few seconds? A receiver closes what it
 * refuses on libdlpc's thread, not on its own. */
static bool own_fds_become(int want)
{
	for (int waited = 0; fd_count(getpid()) != want; waited += 2) {
		if (waited > scaled_ms(5000))
			return false;
		usleep(2000);
	}
	return true;
}

/* ---- 4: removal ends the waits with EIDRM and frees what is queued ---- */

static int removed_waiter(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();
	int64_t v;

	/* joined (the first use), then waiting */
	CHILD_CHECK(recv_value(c, "d/rm2", 0, &v, NULL, NULL) == -EAGAIN);
	CHILD_CHECK(write(fd, "w", 1) == 1);
	CHILD_CHECK(recv_value(c, "d/rm2", -1, &v, NULL, NULL) == -EIDRM);
	CHILD_CHECK(strstr(dlpc_last_error(), "removed") != NULL);
	CHILD_CHECK(recv_value(c, "d/rm2", 0, &v, NULL, NULL) == -ENOENT);
	dlpc_close(c);
	return 0;
}

static int removed_sender(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();

	/* the channel is full: this one waits */
	CHILD_CHECK(send_value(c, "d/rm", 9, 1, DLPC_SEND_NOWAIT, -1) == -EAGAIN);
	CHILD_CHECK(write(fd, "s", 1) == 1);
	CHILD_CHECK(send_value(c, "d/rm", 9, 1, 0, -1) == -EIDRM);
	CHILD_CHECK(strstr(dlpc_last_error(), "removed") != NULL);
	CHILD_CHECK(send_value(c, "d/rm", 9, 1, 0, -1) == -ENOENT);
	dlpc_close(c);
	return 0;
}

START_TEST(test_remove_frees)
{
	dlpc_client *c = connect_or_die(&D), *c2;
	dlpc_channel_info info = {.size = sizeof(info)};
	DLManagedTensorVersioned *held;
	int pfd[2], raw, ends[2], fds0;
	char x, msg[256];
	uint32_t cap;
	pid_t w, s;
	int64_t v;

	fds0 = settled_fds(&D, c, 1);
	ck_assert_dlpc(open_direct(c, "d/rm", 4, &info), 1);
	cap = info.capacity;
	ck_assert_dlpc(open_direct(c, "d/rm", 0, NULL), 0);
	ck_assert_dlpc(open_direct(c, "d/rm2", 0, NULL), 1);
	/* a watcher of the queue: a raw JOIN's ends */
	raw = raw_connect(&D);
	raw_hello(raw, DLPC_PROTO_MAJOR);
	ck_assert_int_eq(raw_join(raw, "d/rm", ends, msg, sizeof(msg)), 0);
	/* a second client that joined (its first receive) and uses it again after the removal */
	c2 = connect_or_die(&D);
	ck_assert_dlpc(recv_value(c2, "d/rm", 0, &v, NULL, NULL), -EAGAIN);
	for (uint32_t i = 0; i < cap; i++)
		ck_assert_dlpc(send_value(c, "d/rm", (int64_t)i * 4096, 4096, 0, -1), 0);
	/* one received and held survives the removal */
	ck_assert_dlpc(recv_value(c, "d/rm", 0, &v, NULL, &held), 0);
	ck_assert_dlpc(send_value(c, "d/rm", 77 * 4096, 4096, 0, -1), 0);
	ck_assert_int_eq(queued(ends[1]), (int)cap);
	ck_assert_uint_eq(chan_or_die(c, "d/rm").depth, cap);
	/* every queued message lives in the socket alone; the held one is mapped here */
	ck_assert_int_eq(memfds_held("d/rm"), 1);
	ck_assert_int_eq(pipe(pfd), 0);
	s = spawn(removed_sender, &pfd[1]);
	w = spawn(removed_waiter, &pfd[1]);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	/* both are past their first use; now in their waits */
	ck_assert(waits_in_poll(s));
	ck_assert(waits_in_poll(w));
	ck_assert_dlpc(dlpc_channel_remove(c, "d/rm"), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/rm2"), 0);
	ck_assert_int_eq(wait_child(s), 0);
	ck_assert_int_eq(wait_child(w), 0);
	ck_assert_uint_eq(stat_or_die(c).channels, 0);
	/* the daemon read nothing: what is queued goes with the pair. A receiver that joined
	 * before drops it on its next use, and reads the end */
	ck_assert_int_eq(queued(ends[1]), (int)cap);
	ck_assert_dlpc(recv_value(c2, "d/rm", 0, &v, NULL, NULL), -ENOENT);
	ck_assert_int_eq(queued(ends[1]), 0);
	ck_assert(memfds_reach("d/rm", 1));
	ck_assert_int_eq(((const int64_t *)held->dl_tensor.data)[4095], 4095);
	held->deleter(held);
	ck_assert(memfds_reach("d/rm", 0));
	close(ends[0]);
	close(ends[1]);
	close(raw);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/rm"), -ENOENT);
	ck_assert_dlpc(recv_value(c, "d/rm", 0, &v, NULL, NULL), -ENOENT);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "'d/rm'"));
	ck_assert_dlpc(send_value(c, "d/rm", 1, 1, 0, -1), -ENOENT);
	/* the daemon closed its copies of the pair */
	dlpc_close(c2);
	ck_assert_int_eq(settled_fds(&D, c, 1), fds0);
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(c);
}
END_TEST

/* ---- 5: a killed receiver's messages are freed; the channel goes on ---- */

static int holding_receiver(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();
	DLManagedTensorVersioned *a, *b;
	int64_t v;

	CHILD_CHECK(recv_value(c, "d/kill", -1, &v, NULL, &a) == 0);
	CHILD_CHECK(recv_value(c, "d/kill", -1, &v, NULL, &b) == 0);
	CHILD_CHECK(write(fd, "x", 1) == 1);
	pause();
	return 0;
}

START_TEST(test_killed_receiver)
{
	dlpc_client *c = connect_or_die(&D);
	int pfd[2];
	char x;
	pid_t r;
	int64_t v;

	ck_assert_int_eq(pipe(pfd), 0);
	ck_assert_dlpc(open_direct(c, "d/kill", 0, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/kill", 1, 1 << 16, 0, -1), 0);
	ck_assert_dlpc(send_value(c, "d/kill", 2, 1 << 16, 0, -1), 0);
	r = spawn(holding_receiver, &pfd[1]);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert_uint_eq(chan_or_die(c, "d/kill").depth, 0);
	/* received and held by the child alone */
	ck_assert_int_ge(memfds_held("d/kill"), 2);
	kill(r, SIGKILL);
	ck_assert_int_eq(wait_child(r), 128 + SIGKILL);
	ck_assert(memfds_reach("d/kill", 0));
	/* another receiver: the channel goes on */
	ck_assert_dlpc(send_value(c, "d/kill", 7, 3, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, "d/kill", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 7);
	ck_assert(memfds_reach("d/kill", 0));
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(c);
}
END_TEST

/* ---- 6: the daemon killed while a receiver waits ---- */

static int daemon_gone_waiter(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();
	int64_t v;
	int r;

	CHILD_CHECK(recv_value(c, "d/dead", 0, &v, NULL, NULL) == -EAGAIN);
	CHILD_CHECK(write(fd, "w", 1) == 1);
	/* a hang is a failure: SIGALRM kills this child */
	alarm((unsigned)(scaled_ms(20000) / 1000));
	r = recv_value(c, "d/dead", -1, &v, NULL, NULL);
	if (r != -ECONNRESET)
		fprintf(stderr, "daemon_gone_waiter: %d %s\n", r, dlpc_last_error());
	CHILD_CHECK(r == -ECONNRESET);
	dlpc_close(c);
	return 0;
}

START_TEST(test_daemon_killed)
{
	dlpc_client *c = connect_or_die(&D);
	int pfd[2];
	char x;
	pid_t w;

	ck_assert_dlpc(open_direct(c, "d/dead", 0, NULL), 1);
	ck_assert_int_eq(pipe(pfd), 0);
	w = spawn(daemon_gone_waiter, &pfd[1]);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert(waits_in_poll(w));
	dlpc_close(c);
	ck_assert_int_eq(kill(D.pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(D.pid, NULL, 0), D.pid);
	ck_assert_int_eq(wait_child(w), 0);
	/* a fresh daemon for the fixture's teardown */
	D.pid = daemon_spawn(D.sock, D.log);
	for (int i = 0; i < scaled_ms(5000); i++) {
		if (dlpc_connect(D.sock, &c) == 0)
			break;
		c = NULL;
		usleep(1000);
	}
	ck_assert_ptr_nonnull(c);
	dlpc_close(c);
	close(pfd[0]);
	close(pfd[1]);
}
END_TEST

/* ---- 7: the two kinds kept apart, and what a direct channel refuses ---- */

#define SEALS_RO (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL | F_SEAL_WRITE)

/* A SEND of one float32 of @p storage to @p ch; the daemon's error code (0: admitted). */
static int raw_send_to(int fd, const char *ch, int storage, char *msg, size_t len)
{
	Dlpackd__V1__Send req = DLPACKD__V1__SEND__INIT;
	Dlpackd__V1__Publish pub = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc d = DLPACKD__V1__TENSOR_DESC__INIT, *dp = &d;
	int64_t one = 1;
	struct dlpc__hdr h;
	uint8_t buf[4096];

	d.dtype_code = kDLFloat;
	d.dtype_bits = 32;
	d.dtype_lanes = 1;
	d.n_shape = 1;
	d.shape = &one;
	pub.device_type = kDLCPU;
	pub.storage_size = 4096;
	pub.n_tensors = 1;
	pub.tensors = &dp;
	req.channel.data = (uint8_t *)ch;
	req.channel.len = strlen(ch);
	req.message = &pub;
	raw_send(fd, DLPC_MSG_SEND, 5, &req.base, &storage, 1);
	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	if (h.type != DLPC_MSG_ERROR)
		return 0;
	return error_code(buf, h.len, msg, len);
}

START_TEST(test_kinds)
{
	dlpc_client *c = connect_or_die(&D);
	Dlpackd__V1__Recv rv = DLPACKD__V1__RECV__INIT;
	dlpc_channel_info info = {.size = sizeof(info)};
	static char keys[64][32];
	const char *kp[64];
	static float vals[64];
	DLManagedTensorVersioned *ts[64], *t;
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	dlpc_bundle *b;
	int64_t one = 1, shape[1] = {4};
	char msg[512];
	int raw, st, ends[2], fds0;

	ck_assert_dlpc(open_direct(c, "d/k", 8, &info), 1);
	ck_assert_dlpc(dlpc_channel_open(c, "q/k", 8, NULL), 1);
	/* the other kind asked for: EEXIST naming the kind, both ways */
	ck_assert_dlpc(dlpc_channel_open_flags(c, "d/k", 0, DLPC_CHANNEL_QUEUED, NULL), -EEXIST);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "as a direct channel"));
	ck_assert_dlpc(open_direct(c, "q/k", 0, NULL), -EEXIST);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "as a queued channel"));
	/* no kind asked for: either is opened as it is (1.10) */
	ck_assert_dlpc(dlpc_channel_open(c, "d/k", 0, &info), 0);
	ck_assert_uint_eq(info.flags, DLPC_CHANNEL_DIRECT);
	ck_assert_dlpc(dlpc_channel_open(c, "q/k", 0, &info), 0);
	ck_assert_uint_eq(info.flags, 0);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "q/k", 0, DLPC_CHANNEL_QUEUED, NULL), 0);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "d/x", 0, 2, NULL), -EINVAL);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "d/x", 0,
					       DLPC_CHANNEL_QUEUED | DLPC_CHANNEL_DIRECT, NULL),
		       -EINVAL);
	/* raw SEND and RECV of a direct channel, JOIN of a queued or unknown one */
	raw = raw_connect(&D);
	raw_hello(raw, DLPC_PROTO_MAJOR);
	st = memfd_sealed(4096, SEALS_RO);
	ck_assert_int_eq(raw_send_to(raw, "d/k", st, msg, sizeof(msg)), EPROTOTYPE);
	ck_assert_ptr_nonnull(strstr(msg, "direct"));
	close(st);
	rv.channel.data = (uint8_t *)"d/k";
	rv.channel.len = 3;
	raw_send(raw, DLPC_MSG_RECV, 6, &rv.base, NULL, 0);
	ck_assert_int_eq(raw_error(raw, msg, sizeof(msg)), EPROTOTYPE);
	/* a JOIN of a queued channel is answered without fds, not refused */
	ck_assert_int_eq(raw_join(raw, "q/k", ends, msg, sizeof(msg)), -1);
	ck_assert_int_eq(raw_join(raw, "d/none", ends, msg, sizeof(msg)), ENOENT);
	ck_assert_int_eq(raw_join(raw, "d/k", ends, msg, sizeof(msg)), 0);
	close(ends[0]);
	close(ends[1]);
	close(raw);

	/* no recycled buffers */
	ck_assert_dlpc(dlpc_channel_alloc(c, "d/k", (DLDataType){kDLFloat, 32, 1}, 1, shape, &t),
		       -ENOTSUP);

	/* a bundle of many long keys: over the record */
	for (int i = 0; i < 64; i++) {
		snprintf(keys[i], sizeof(keys[i]), "a-rather-long-key-number-%02d", i);
		kp[i] = keys[i];
		vals[i] = (float)i;
		ts[i] = host_tensor(&vals[i], (DLDataType){kDLFloat, 32, 1}, 1, &one, NULL, NULL);
	}
	ck_assert_dlpc(dlpc_send_bundle(c, "d/k", 64, kp, ts, NULL), -EMSGSIZE);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "'d/k'"));
	ck_assert_uint_eq(chan_or_die(c, "d/k").depth, 0);
	/* a few fit */
	for (int i = 0; i < 8; i++)
		ts[i] = host_tensor(&vals[i], (DLDataType){kDLFloat, 32, 1}, 1, &one, NULL, NULL);
	ck_assert_dlpc(dlpc_send_bundle(c, "d/k", 8, kp, ts, NULL), 0);
	ck_assert_dlpc(send_value(c, "d/k", 5, 2, 0, -1), 0);

	/* STAT: the kind, and the depth in messages */
	info = chan_or_die(c, "d/k");
	ck_assert_uint_eq(info.flags, DLPC_CHANNEL_DIRECT);
	ck_assert_uint_eq(info.depth, 2);
	ck_assert_uint_eq(info.bytes_queued, 0);
	ck_assert_uint_eq(info.sent, 0);
	ck_assert_uint_eq(chan_or_die(c, "q/k").flags, 0);

	ck_assert_dlpc(dlpc_recv_bundle(c, "d/k", &now, &b), 0);
	ck_assert_uint_eq(dlpc_bundle_count(b), 8);
	ck_assert_str_eq(dlpc_bundle_key(b, 7), keys[7]);
	t = dlpc_bundle_take(b, 7);
	ck_assert_float_eq(*(const float *)t->dl_tensor.data, 7.0f);
	t->deleter(t);
	dlpc_bundle_free(b);
	ck_assert_uint_eq(chan_or_die(c, "d/k").depth, 1);
	ck_assert_dlpc(dlpc_recv_bundle(c, "d/k", &now, &b), 0);
	ck_assert_uint_eq(dlpc_bundle_count(b), 1);
	dlpc_bundle_free(b);
	ck_assert_uint_eq(chan_or_die(c, "d/k").depth, 0);
	fds0 = settled_fds(&D, c, 1);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/k"), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "q/k"), 0);
	/* a direct channel's two ends went with it */
	ck_assert_int_eq(settled_fds(&D, c, 1), fds0 - 2);
	dlpc_close(c);
}
END_TEST

/* dlpc_recv() of a bundle on a direct channel: -EINVAL, and the bundle stays queued for
 * dlpc_recv_bundle(), as dlpc_recv()'s documentation says of every channel. */
START_TEST(test_bundle_as_single_stays_queued)
{
	dlpc_client *c = connect_or_die(&D);
	static float a[2] = {1, 2}, bv[2] = {3, 4};
	int64_t two = 2;
	const char *keys[] = {"a", "b"};
	DLManagedTensorVersioned *ts[2], *t;
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	dlpc_bundle *b;

	ck_assert_dlpc(open_direct(c, "d/bun", 4, NULL), 1);
	ts[0] = host_tensor(a, (DLDataType){kDLFloat, 32, 1}, 1, &two, NULL, NULL);
	ts[1] = host_tensor(bv, (DLDataType){kDLFloat, 32, 1}, 1, &two, NULL, NULL);
	ck_assert_dlpc(dlpc_send_bundle(c, "d/bun", 2, keys, ts, NULL), 0);
	ck_assert_dlpc(dlpc_recv(c, "d/bun", &now, &t), -EINVAL);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "bundle"));
	ck_assert_uint_eq(chan_or_die(c, "d/bun").depth, 1);
	ck_assert_dlpc(dlpc_recv_bundle(c, "d/bun", &now, &b), 0);
	ck_assert_uint_eq(dlpc_bundle_count(b), 2);
	dlpc_bundle_free(b);
	dlpc_close(c);
}
END_TEST

/* A channel removed and made again under the same name, direct or queued: a client that had
 * joined the old one finds the new one. */
START_TEST(test_made_again)
{
	dlpc_client *c = connect_or_die(&D), *r = connect_or_die(&D);
	dlpc_attach_info ai = {.size = sizeof(ai)};
	DLManagedTensorVersioned *t;
	int64_t v;

	ck_assert_dlpc(open_direct(c, "d/again", 4, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/again", 1, 2, 0, -1), 0);
	ck_assert_dlpc(recv_value(r, "d/again", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 1);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/again"), 0);
	ck_assert_dlpc(open_direct(c, "d/again", 4, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/again", 2, 2, 0, -1), 0);
	ck_assert_dlpc(recv_value(r, "d/again", scaled_ms(5000), &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 2);
	/* made again queued: through dlpackd now */
	ck_assert_dlpc(dlpc_channel_remove(c, "d/again"), 0);
	ck_assert_dlpc(dlpc_channel_open(c, "d/again", 4, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/again", 3, 2, 0, -1), 0);
	ck_assert_uint_eq(chan_or_die(c, "d/again").sent, 1);
	ck_assert_dlpc(dlpc_recv(r, "d/again", NULL, &t), 0);
	ck_assert_int_eq(*(const int64_t *)t->dl_tensor.data, 3);
	ck_assert_dlpc(dlpc_tensor_attach_info(t, &ai), 0);
	ck_assert_int_eq(ai.owner_pid, getpid());
	t->deleter(t);
	/* and direct again */
	ck_assert_dlpc(dlpc_channel_remove(c, "d/again"), 0);
	ck_assert_dlpc(open_direct(c, "d/again", 4, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/again", 4, 2, 0, -1), 0);
	ck_assert_uint_eq(chan_or_die(c, "d/again").depth, 1);
	ck_assert_dlpc(recv_value(r, "d/again", scaled_ms(5000), &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 4);
	dlpc_close(r);
	dlpc_close(c);
}
END_TEST

/* ---- 8: a hostile sender writing into the channel's socket ---- */

/* A record of @p storage_size bytes describing @p n float32 tensors of @p elems elements each,
 * at offsets 0, 256, ..., keyed by @p keys (NULL: none), into @p rec. */
static void make_record(uint8_t rec[DLPC_DIRECT_RECORD], uint64_t storage_size, size_t n,
			int64_t elems, const char *const *keys)
{
	Dlpackd__V1__TensorDesc d[4], *dp[4];
	uint8_t table[DLPC_DIRECT_TABLE_MAX];
	size_t tl;

	ck_assert_uint_le(n, 4);
	for (size_t i = 0; i < n; i++) {
		dlpackd__v1__tensor_desc__init(&d[i]);
		d[i].dtype_code = kDLFloat;
		d[i].dtype_bits = 32;
		d[i].dtype_lanes = 1;
		d[i].n_shape = 1;
		d[i].shape = &elems;
		d[i].offset = 256 * i;
		if (keys) {
			d[i].key.data = (uint8_t *)keys[i];
			d[i].key.len = strlen(keys[i]);
		}
		dp[i] = &d[i];
	}
	tl = dlpc__table_size(dp, n);
	dlpc__table_encode(dp, n, table);
	ck_assert_int_eq(dlpc__direct_encode(rec, storage_size, table, tl), 0);
}

/* Append a failure to @p buf. */
__attribute__((format(printf, 3, 4))) static void report(char *buf, size_t len, const char *fmt,
							 ...)
{
	size_t used = strlen(buf);
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf + used, len - used, fmt, ap);
	va_end(ap);
}

static int memfd_sparse(size_t size)
{
	int fd = memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
	ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, SEALS_RO), 0);
	return fd;
}

START_TEST(test_hostile_sender)
{
	static const char *const badkeys[] = {"a", "\xff"};
	dlpc_client *c = connect_or_die(&D);
	dlpc_recv_opts wait = {.size = sizeof(wait), .timeout_ms = scaled_ms(5000)};
	uint8_t good[DLPC_DIRECT_RECORD], rec[DLPC_DIRECT_RECORD], big[2 * DLPC_DIRECT_RECORD];
	int raw, ends[2], fds0, pipefd[2], two[2], closed;
	char msg[256], pidstr[64], fails[4096] = "";
	dlpc_bundle *b;
	int64_t v;
	struct {
		const char *what;
		const void *data;
		size_t len;
		int fd;	     /* storage to send (closed here after), -1 none */
		bool two;    /* send it twice */
		bool bundle; /* a bundle: receive it with dlpc_recv_bundle() */
	} cases[16];
	size_t nc = 0;
	static uint8_t magic[DLPC_DIRECT_RECORD], past[DLPC_DIRECT_RECORD],
		keyrec[DLPC_DIRECT_RECORD], zero[DLPC_DIRECT_RECORD];

	ck_assert_dlpc(open_direct(c, "d/evil", 16, NULL), 1);
	/* joined, and a wait's eventfd made: fd counts stay put from here */
	ck_assert_dlpc(recv_value(c, "d/evil", 1, &v, NULL, NULL), -ETIMEDOUT);
	raw = raw_connect(&D);
	raw_hello(raw, DLPC_PROTO_MAJOR);
	ck_assert_int_eq(raw_join(raw, "d/evil", ends, msg, sizeof(msg)), 0);
	close(ends[1]);
	snprintf(pidstr, sizeof(pidstr), "pid %d ", (int)getpid());

	make_record(good, 4096, 1, 4, NULL);
	memcpy(magic, good, sizeof(magic));
	magic[0] ^= 0xff;
	make_record(past, 4096, 1, 2048, NULL); /* 8192 bytes in a storage of 4096 */
	make_record(keyrec, 4096, 2, 4, badkeys);
	make_record(zero, 0, 1, 4, NULL);
	ck_assert_int_eq(pipe(pipefd), 0);
	memset(big, 0, sizeof(big));
	memcpy(big, good, sizeof(good));

#define CASE(w, d, l, f, t, b)                                                                     \
	cases[nc++] =                                                                              \
		(typeof(cases[0])){.what = w, .data = d, .len = l, .fd = f, .two = t, .bundle = b}
	CASE("0 bytes, no fd", good, 0, -1, false, false);
	CASE("100 bytes", good, 100, memfd_sealed(4096, SEALS_RO), false, false);
	CASE("2048 bytes", big, sizeof(big), memfd_sealed(4096, SEALS_RO), false, false);
	CASE("bad magic", magic, sizeof(magic), memfd_sealed(4096, SEALS_RO), false, false);
	CASE("no fd", good, sizeof(good), -1, false, false);
	CASE("two fds", good, sizeof(good), memfd_sealed(4096, SEALS_RO), true, false);
	CASE("unsealed memfd", good, sizeof(good), memfd_sealed(4096, 0), false, false);
	CASE("a pipe", good, sizeof(good), pipefd[0], false, false);
	CASE("sparse memfd", good, sizeof(good), memfd_sparse(4096), false, false);
	CASE("tensor past the storage", past, sizeof(past), memfd_sealed(4096, SEALS_RO), false,
	     false);
	CASE("key not UTF-8", keyrec, sizeof(keyrec), memfd_sealed(4096, SEALS_RO), false, true);
	CASE("storage_size 0", zero, sizeof(zero), memfd_sealed(4096, SEALS_RO), false, false);
#undef CASE

	fds0 = fd_count(getpid());
	closed = 0;
	for (size_t i = 0; i < nc; i++) {
		dlpc_recv_opts o = wait;
		DLManagedTensorVersioned *t = NULL;
		int r, before;

		two[0] = two[1] = cases[i].fd;
		ck_assert_int_eq(send_fds_raw(ends[0], cases[i].data, cases[i].len, two,
					      cases[i].fd < 0 ? 0
					      : cases[i].two  ? 2
							      : 1),
				 (ssize_t)cases[i].len);
		if (cases[i].fd >= 0 && cases[i].fd != pipefd[0]) {
			close(cases[i].fd);
			closed++;
		}
		before = fd_count(getpid());
		if (cases[i].bundle)
			r = dlpc_recv_bundle(c, "d/evil", &o, &b);
		else
			r = dlpc_recv(c, "d/evil", &o, &t);
		if (r != -EBADMSG || !strstr(dlpc_last_error(), pidstr) ||
		    !strstr(dlpc_last_error(), "'d/evil'"))
			report(fails, sizeof(fails),
			       "%s: %d, expected -EBADMSG naming pid %d: %s; ", cases[i].what, r,
			       (int)getpid(), dlpc_last_error());
		if (r == 0) {
			if (t)
				t->deleter(t);
			else
				dlpc_bundle_free(b);
		}
		if (!own_fds_become(before))
			report(fails, sizeof(fails), "%s: %d fds after, %d before; ", cases[i].what,
			       fd_count(getpid()), before);
		ck_assert_uint_eq(chan_or_die(c, "d/evil").depth, 0);
	}
	close(pipefd[0]);
	close(pipefd[1]);
	ck_assert_msg(fails[0] == '\0', "%s", fails);
	/* all of the cases' fds and the pipe closed here, nothing kept by the receives */
	ck_assert_msg(own_fds_become(fds0 - closed - 2), "%d fds, %d before the cases, %d closed",
		      fd_count(getpid()), fds0, closed + 2);
	/* a good message after all of them: received intact */
	ck_assert_dlpc(send_value(c, "d/evil", 40, 100, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, "d/evil", scaled_ms(5000), &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 40);
	/* and the raw one's good record too */
	rec[0] = 0;
	memcpy(rec, good, sizeof(rec));
	two[0] = memfd_sealed(4096, SEALS_RO);
	ck_assert_int_eq(send_fds_raw(ends[0], rec, sizeof(rec), two, 1), sizeof(rec));
	close(two[0]);
	ck_assert_dlpc(dlpc_recv_bundle(c, "d/evil", &wait, &b), 0);
	ck_assert_uint_eq(dlpc_bundle_count(b), 1);
	dlpc_bundle_free(b);
	close(ends[0]);
	close(raw);
	dlpc_close(c);
}
END_TEST

/* ---- 9: a forked child closes the ends it inherited, and joins anew ---- */

struct inodes {
	unsigned long *ino;
	int n, max;
};

static bool socket_inode(const char *target, void *arg)
{
	struct inodes *set = arg;

	if (set->n < set->max && sscanf(target, "socket:[%lu]", &set->ino[set->n]) == 1)
		set->n++;
	return false;
}

/* The socket inodes open in this process ("socket:[N]"), at most @p max into @p ino. */
static int sockets_open(unsigned long *ino, int max)
{
	struct inodes set = {ino, 0, max};

	fd_links(getpid(), socket_inode, &set);
	return set.n;
}

static bool has(const unsigned long *set, int n, unsigned long x)
{
	for (int i = 0; i < n; i++)
		if (set[i] == x)
			return true;
	return false;
}

START_TEST(test_fork)
{
	unsigned long before[64], after[64], ends[4];
	int n0 = sockets_open(before, 64), nb, na, ne = 0, pfd[2];
	dlpc_client *c = connect_or_die(&D);
	pid_t p;
	int64_t v;

	ck_assert_dlpc(open_direct(c, "d/fork", 8, NULL), 1);
	nb = sockets_open(before, 64);
	ck_assert_dlpc(send_value(c, "d/fork", 1, 4, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, "d/fork", 0, &v, NULL, NULL), 0);
	na = sockets_open(after, 64);
	for (int i = 0; i < na; i++)
		if (!has(before, nb, after[i]) && ne < 4)
			ends[ne++] = after[i];
	/* joining brought the two ends */
	ck_assert_int_eq(ne, 2);
	ck_assert_int_eq(pipe(pfd), 0);
	p = fork();
	ck_assert_int_ge(p, 0);
	if (p == 0) {
		unsigned long mine[64];
		int nm = sockets_open(mine, 64);
		dlpc_client *k = NULL;
		int64_t w;

		/* the inherited ends and connection are closed: the sockets open are those open
		 * before the parent connected */
		for (int i = 0; i < ne; i++)
			CHILD_CHECK(!has(mine, nm, ends[i]));
		CHILD_CHECK(nm == n0);
		/* the inherited client cannot be used; a new one joins and both ways work */
		CHILD_CHECK(dlpc_connect(D.sock, &k) == 0);
		CHILD_CHECK(recv_value(k, "d/fork", scaled_ms(5000), &w, NULL, NULL) == 0);
		CHILD_CHECK(w == 10);
		CHILD_CHECK(send_value(k, "d/fork", 20, 4, 0, -1) == 0);
		CHILD_CHECK(write(pfd[1], "c", 1) == 1);
		dlpc_close(k);
		_exit(0);
	}
	ck_assert_dlpc(send_value(c, "d/fork", 10, 4, 0, -1), 0);
	ck_assert_int_eq(wait_child(p), 0);
	ck_assert_dlpc(recv_value(c, "d/fork", scaled_ms(5000), &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 20);
	/* the parent's ends were untouched by the child's closing its copies */
	ck_assert_int_eq(sockets_open(after, 64), na);
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(c);
}
END_TEST

/* A client that uses many direct channels remembers at most DLPC_DIRECT_ENDPOINTS_MAX of them:
 * its fds stay bounded (two per remembered channel), and a channel it removes is forgotten at
 * once. */
START_TEST(test_endpoints_bounded)
{
	dlpc_client *owner = connect_or_die(&D), *c = connect_or_die(&D);
	int n = DLPC_DIRECT_ENDPOINTS_MAX + 36, fds0, most = 0;
	char name[64];
	int64_t v;

	/* the library's threads and a wait's eventfd come with the first use: count after it */
	ck_assert_dlpc(open_direct(owner, "d/many/first", 0, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/many/first", 1, 1, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, "d/many/first", 1000, &v, NULL, NULL), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/many/first"), 0);
	fds0 = fd_count(getpid());
	for (int i = 0; i < n; i++) {
		snprintf(name, sizeof(name), "d/many/%d", i);
		ck_assert_dlpc(open_direct(owner, name, 0, NULL), 1);
		ck_assert_dlpc(send_value(c, name, i, 1, 0, -1), 0);
		ck_assert_dlpc(recv_value(c, name, 1000, &v, NULL, NULL), 0);
		ck_assert_int_eq(v, i);
		if (fd_count(getpid()) - fds0 > most)
			most = fd_count(getpid()) - fds0;
	}
	/* the owner's client joined none: only c holds ends */
	ck_assert_int_le(most, 2 * DLPC_DIRECT_ENDPOINTS_MAX);
	ck_assert_int_ge(most, 2 * DLPC_DIRECT_ENDPOINTS_MAX - 2);
	/* removed by this client: forgotten at once, its ends closed */
	for (int i = 0; i < n; i++) {
		snprintf(name, sizeof(name), "d/many/%d", i);
		ck_assert_dlpc(dlpc_channel_remove(c, name), 0);
	}
	ck_assert_int_eq(fd_count(getpid()), fds0);
	dlpc_close(c);
	dlpc_close(owner);
}
END_TEST

/* A record whose table merely claims two tensors (its table is garbage) is not a bundle: a
 * single-tensor receive takes it and drops it (-EBADMSG, as section 5.11 says), and the good
 * message behind it comes next. (Before, libdlpc's look trusted the count alone: the record
 * stayed, and every dlpc_recv() failed with -EINVAL "a bundle" for as long as it was there.) */
START_TEST(test_malformed_bundle_not_kept_for_single)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	uint8_t rec[DLPC_DIRECT_RECORD], table[8] = {2, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef};
	DLManagedTensorVersioned *t = NULL;
	int raw, ends[2], fd;
	int64_t v = 0;
	char msg[256];

	ck_assert_dlpc(open_direct(c, "d/jam", 8, NULL), 1);
	raw = raw_connect(&D);
	raw_hello(raw, DLPC_PROTO_MAJOR);
	ck_assert_int_eq(raw_join(raw, "d/jam", ends, msg, sizeof(msg)), 0);
	ck_assert_int_eq(dlpc__direct_encode(rec, 4096, table, sizeof(table)), 0);
	fd = memfd_sealed(4096, SEALS_RO);
	ck_assert_int_eq(send_fds_raw(ends[0], rec, sizeof(rec), &fd, 1), (ssize_t)sizeof(rec));
	close(fd);
	/* a good message behind it */
	ck_assert_dlpc(send_value(c, "d/jam", 7, 4, 0, 1000), 0);
	ck_assert_dlpc(dlpc_recv(c, "d/jam", &now, &t), -EBADMSG);
	ck_assert_dlpc(recv_value(c, "d/jam", 0, &v, NULL, NULL), 0);
	close(ends[0]);
	close(ends[1]);
	close(raw);
	dlpc_close(c);
}
END_TEST

/* dlpc_cancel() makes "every later call on it" return -ECANCELED: a direct channel's send and
 * receive too, also those that need not wait (before, they looked only when they waited). */
START_TEST(test_cancel_ends_direct_calls)
{
	dlpc_client *c = connect_or_die(&D);
	int64_t v;

	ck_assert_dlpc(open_direct(c, "d/cancel", 8, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/cancel", 1, 4, 0, 1000), 0);
	dlpc_cancel(c);
	ck_assert_dlpc(send_value(c, "d/cancel", 2, 4, 0, 1000), -ECANCELED);
	ck_assert_dlpc(recv_value(c, "d/cancel", 1000, &v, NULL, NULL), -ECANCELED);
	dlpc_close(c);
}
END_TEST

/* With DLPC_CONNECT_RECONNECT, "once a call has found the connection lost ... the next call
 * connects ... again": a wait on a direct channel that sees the daemon go marks the connection
 * lost, so the next call connects to the new daemon, which has no such channel (before: every
 * later wait failed at once with -ECONNRESET, even once a new daemon listened). */
START_TEST(test_daemon_gone_then_reconnect)
{
	dlpc_client *c = NULL, *probe = NULL;
	int64_t v;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &c), 0);
	ck_assert_dlpc(open_direct(c, "d/rc", 0, NULL), 1);
	ck_assert_dlpc(recv_value(c, "d/rc", 1, &v, NULL, NULL), -ETIMEDOUT);
	ck_assert_int_eq(kill(D.pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(D.pid, NULL, 0), D.pid);
	ck_assert_dlpc(recv_value(c, "d/rc", 1000, &v, NULL, NULL), -ECONNRESET);
	D.pid = daemon_spawn(D.sock, D.log);
	for (int i = 0; i < scaled_ms(5000) && !probe; i++)
		if (dlpc_connect(D.sock, &probe) < 0)
			usleep(1000);
	ck_assert_ptr_nonnull(probe);
	dlpc_close(probe);
	/* the channel did not survive: a reconnected client joins anew and finds none */
	ck_assert_dlpc(recv_value(c, "d/rc", 1000, &v, NULL, NULL), -ENOENT);
	dlpc_close(c);
}
END_TEST

/* Threads of one client that use a channel for the first time at once each JOIN it; the
 * channel is listed once, whatever they got. Once it is removed and made again elsewhere, the
 * next call finds the pair shut, joins again and works (before: each thread's copy was listed,
 * and a call went from one stale copy to the next and failed with -EIDRM on a live channel). */
static dlpc_client *dup_c;
static char dup_name[64];
static pthread_barrier_t dup_bar;

static void *dup_first_use(void *arg)
{
	dlpc_recv_opts o = {.size = sizeof(o), .timeout_ms = 0};
	DLManagedTensorVersioned *t;

	(void)arg;
	pthread_barrier_wait(&dup_bar);
	dlpc_recv(dup_c, dup_name, &o, &t);
	return NULL;
}

START_TEST(test_concurrent_first_uses)
{
	dlpc_client *other = connect_or_die(&D);
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	DLManagedTensorVersioned *t;
	int bad = 0;

	dup_c = connect_or_die(&D);
	for (int k = 0; k < 20; k++) {
		pthread_t th[8];

		snprintf(dup_name, sizeof(dup_name), "d/dup%d", k);
		ck_assert_dlpc(open_direct(other, dup_name, 8, NULL), 1);
		pthread_barrier_init(&dup_bar, NULL, 8);
		for (int i = 0; i < 8; i++)
			ck_assert_int_eq(pthread_create(&th[i], NULL, dup_first_use, NULL), 0);
		for (int i = 0; i < 8; i++)
			pthread_join(th[i], NULL);
		pthread_barrier_destroy(&dup_bar);
		ck_assert_dlpc(dlpc_channel_remove(other, dup_name), 0);
		ck_assert_dlpc(open_direct(other, dup_name, 8, NULL), 1);
		if (dlpc_recv(dup_c, dup_name, &now, &t) != -EAGAIN)
			bad++;
	}
	ck_assert_int_eq(bad, 0);
	dlpc_close(dup_c);
	dlpc_close(other);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("direct");
	TCase *tc = tcase_create("direct");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, scaled_ms(60000) / 1000);
	tcase_add_test(tc, test_order);
	tcase_add_test(tc, test_exactly_once);
	tcase_add_test(tc, test_backpressure);
	tcase_add_test(tc, test_remove_frees);
	tcase_add_test(tc, test_killed_receiver);
	tcase_add_test(tc, test_daemon_killed);
	tcase_add_test(tc, test_kinds);
	tcase_add_test(tc, test_end_two_producers);
	tcase_add_test(tc, test_end_then_new_stream_send);
	tcase_add_test(tc, test_produce_on_queued_refused);
	tcase_add_test(tc, test_end_wakes_waiter);
	tcase_add_test(tc, test_end_producer_crash);
	tcase_add_test(tc, test_end_close_all);
	tcase_add_test(tc, test_bundle_as_single_stays_queued);
	tcase_add_test(tc, test_made_again);
	tcase_add_test(tc, test_hostile_sender);
	tcase_add_test(tc, test_fork);
	tcase_add_test(tc, test_endpoints_bounded);
	tcase_add_test(tc, test_malformed_bundle_not_kept_for_single);
	tcase_add_test(tc, test_cancel_ends_direct_calls);
	tcase_add_test(tc, test_daemon_gone_then_reconnect);
	tcase_add_test(tc, test_concurrent_first_uses);
	suite_add_tcase(s, tc);
	return run_suite(s);
}
