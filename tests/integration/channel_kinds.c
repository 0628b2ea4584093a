/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What channels of both kinds do alike, against a real dlpackd, driven from separate processes:
 * order and content, exactly one receiver per message, backpressure, removal, what a killed
 * receiver, sender or daemon leaves, end of stream, bundles, cancel and reconnect. Each test runs
 * for one kind (its _i); where the kinds differ in what can be seen, it checks each kind's way:
 * a queued channel's messages pass through the daemon (STAT counts them, its waiters are
 * counted), a direct channel's are memfds named "dlpc:CHANNEL" queued in a socket the daemon
 * never reads (whether they were freed is told by no process holding one, /proc/PID/fd and
 * /proc/PID/maps, once the socket queues none).
 */
#include <dirent.h>
#include <errno.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <linux/sockios.h>

#include "channel_kinds.h"
#include "direct.h"

enum chan_kind kind;
struct daemon D;

void channel_setup(void)
{
	daemon_start(&D);
}

void channel_teardown(void)
{
	daemon_stop(&D);
}

dlpc_client *child_connect(void)
{
	dlpc_client *c = NULL;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	return c;
}

int open_kind(dlpc_client *c, const char *name, uint32_t capacity, dlpc_channel_info *info)
{
	if (kind == DIRECT)
		return dlpc_channel_open_flags(c, name, capacity, DLPC_CHANNEL_DIRECT, info);
	return dlpc_channel_open(c, name, capacity, info);
}

/* dlpc_channel_opts.flags that open_kind() asks for. */
static uint32_t open_flags(void)
{
	return kind == DIRECT ? DLPC_CHANNEL_DIRECT : 0;
}

int send_value(dlpc_client *c, const char *ch, int64_t v, int64_t n, uint32_t flags,
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

int recv_value(dlpc_client *c, const char *ch, int64_t timeout_ms, int64_t *v, int64_t *n,
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

bool storages_are(const dlpc_stats *s, void *arg)
{
	return s->storages == *(uint64_t *)arg && s->messages == 0 && s->references == 0;
}

/* ---- what a direct channel's messages leave in processes ---- */

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

int memfds_held(const char *ch)
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

bool waits_in_poll(pid_t pid)
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

bool memfds_reach(const char *ch, int want)
{
	for (int i = 0; i < scaled_ms(5000) / 10; i++) {
		if (memfds_held(ch) == want)
			return true;
		usleep(10000);
	}
	return memfds_held(ch) == want;
}

/* ---- raw access: CHANNEL JOIN ---- */

unsigned raw_recv_all(int fd, struct dlpc__hdr *h, uint8_t *buf, size_t cap, int fds[4])
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

int error_code(const uint8_t *buf, size_t len, char *msg, size_t msglen)
{
	Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, len, buf);
	int code;

	ck_assert_ptr_nonnull(e);
	code = e->code;
	snprintf(msg, msglen, "%s", e->message);
	dlpackd__v1__error__free_unpacked(e, NULL);
	return code;
}

int raw_join(int fd, const char *name, int ends[2], char *msg, size_t len)
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

int raw_send_msg(int fd, const char *ch, int storage, unsigned nfds,
		 void (*edit)(Dlpackd__V1__Send *), char *msg, size_t len)
{
	Dlpackd__V1__Send req = DLPACKD__V1__SEND__INIT;
	Dlpackd__V1__Publish pub = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc d = DLPACKD__V1__TENSOR_DESC__INIT, *dp = &d;
	int fds[2] = {storage, storage};
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
	if (edit)
		edit(&req);
	raw_send(fd, DLPC_MSG_SEND, 5, &req.base, fds, nfds);
	if (raw_recv(fd, &h, buf, sizeof(buf)) != 1)
		return -1;
	if (h.type == DLPC_MSG_ERROR)
		return error_code(buf, h.len, msg, len);
	ck_assert_uint_eq(h.type, DLPC_MSG_SEND | DLPC_MSG_REPLY);
	return 0;
}

int queued(int rx)
{
	int bytes = -1;

	ck_assert_int_eq(ioctl(rx, SIOCINQ, &bytes), 0);
	return bytes / DLPC_DIRECT_RECORD;
}

/* ---- each kind's way of telling ---- */

/* The capacity @p got of a channel opened asking for @p asked: a queued channel's is what was
 * asked; a direct channel's is what its socket's buffer holds, at least 2 and at most asked. */
static void check_capacity(uint32_t got, uint32_t asked)
{
	if (kind == QUEUED) {
		ck_assert_uint_eq(got, asked);
	} else {
		ck_assert_uint_ge(got, 2);
		ck_assert_uint_le(got, asked);
	}
}

/* Wait until @p pid waits in a call on channel @p ch: a queued channel's waiter is counted by
 * the daemon (@p sending: senders_waiting, else receivers_waiting), a direct channel's sits in
 * poll(). Whether it got there. */
static bool waits_on(dlpc_client *c, const char *ch, pid_t pid, bool sending)
{
	if (kind == DIRECT)
		return waits_in_poll(pid);
	return sending ? WAIT_CHAN(c, ch, senders_waiting, 1)
		       : WAIT_CHAN(c, ch, receivers_waiting, 1);
}

/* Nothing of channel @p ch's messages is left: no storage, message or reference in the daemon;
 * for a direct channel, no memfd of it in any of our processes. */
static void check_freed(dlpc_client *c, const char *ch)
{
	uint64_t zero = 0;

	ck_assert(wait_stat(c, storages_are, &zero, scaled_ms(5000)));
	if (kind == DIRECT)
		ck_assert(memfds_reach(ch, 0));
}

/* fds the daemon holds for a channel: a direct one's socket pair. */
#define CHANNEL_FDS (kind == DIRECT ? 2 : 0)

/* ---- order and content, through a small channel, from another process ---- */

#define ORDER_N 200

static int order_sender(void *arg)
{
	dlpc_client *c = child_connect();

	(void)arg;
	for (int64_t i = 0; i < ORDER_N; i++)
		CHILD_CHECK(send_value(c, CH("ord"), i * 1000, 1 + i % 300, 0, -1) == 0);
	dlpc_close(c);
	return 0;
}

START_TEST(test_order)
{
	dlpc_client *c;
	dlpc_channel_info info = {.size = sizeof(info)};
	uint64_t through;
	int fds0;
	pid_t s;

	kind = _i;
	c = connect_or_die(&D);
	fds0 = settled_fds(&D, c, 1);
	ck_assert_dlpc(open_kind(c, CH("ord"), 8, &info), 1);
	check_capacity(info.capacity, 8);
	ck_assert_uint_eq(info.flags, open_flags());
	ck_assert_str_eq(info.name, CH("ord"));
	s = spawn(order_sender, NULL);
	for (int64_t i = 0; i < ORDER_N; i++) {
		dlpc_attach_info ai = {.size = sizeof(ai)};
		DLManagedTensorVersioned *t;
		int64_t v = -1, n = 0;

		ck_assert_dlpc(recv_value(c, CH("ord"), scaled_ms(5000), &v, &n, &t), 0);
		ck_assert_int_eq(v, i * 1000);
		ck_assert_int_eq(n, 1 + i % 300);
		ck_assert(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
		ck_assert_dlpc(dlpc_tensor_attach_info(t, &ai), 0);
		ck_assert_int_eq(ai.owner_pid, s);
		ck_assert_uint_eq(ai.owner_uid, getuid());
		t->deleter(t);
	}
	ck_assert_int_eq(wait_child(s), 0);
	/* a queued channel's messages all went through the daemon; a direct one's, none */
	through = kind == QUEUED ? ORDER_N : 0;
	info = chan_or_die(c, CH("ord"));
	ck_assert_uint_eq(info.sent, through);
	ck_assert_uint_eq(info.received, through);
	ck_assert_uint_eq(info.depth, 0);
	ck_assert_uint_eq(info.bytes_queued, 0);
	ck_assert_uint_eq(stat_or_die(c).req_send, through);
	check_freed(c, CH("ord"));
	ck_assert_dlpc(dlpc_channel_remove(c, CH("ord")), 0);
	ck_assert_int_eq(settled_fds(&D, c, 1), fds0);
	dlpc_close(c);
}
END_TEST

/* ---- each message to exactly one of several receivers ---- */

#define ONCE_N 300
#define ONCE_RECEIVERS 3

static int once_receiver(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();

	for (;;) {
		int64_t v;

		CHILD_CHECK(recv_value(c, CH("once"), -1, &v, NULL, NULL) == 0);
		if (v < 0)
			break;
		CHILD_CHECK(write(fd, &v, sizeof(v)) == sizeof(v));
	}
	dlpc_close(c);
	return 0;
}

START_TEST(test_exactly_once)
{
	static unsigned char seen[ONCE_N];
	pid_t r[ONCE_RECEIVERS];
	int pfd[2], got = 0;
	dlpc_client *c;
	int64_t v;

	kind = _i;
	c = connect_or_die(&D);
	ck_assert_dlpc(open_kind(c, CH("once"), 8, NULL), 1);
	ck_assert_int_eq(pipe(pfd), 0);
	for (int i = 0; i < ONCE_RECEIVERS; i++)
		r[i] = spawn(once_receiver, &pfd[1]);
	close(pfd[1]);
	/* (the daemon counts a queued channel's receivers that wait) */
	if (kind == QUEUED)
		ck_assert(WAIT_CHAN(c, CH("once"), receivers_waiting, ONCE_RECEIVERS));
	for (int64_t i = 0; i < ONCE_N; i++)
		ck_assert_dlpc(send_value(c, CH("once"), i, 1, 0, -1), 0);
	for (int i = 0; i < ONCE_RECEIVERS; i++)
		ck_assert_dlpc(send_value(c, CH("once"), -1, 1, 0, -1), 0);
	while (read(pfd[0], &v, sizeof(v)) == sizeof(v)) {
		ck_assert(v >= 0 && v < ONCE_N);
		ck_assert_msg(!seen[v], "message %lld received twice", (long long)v);
		seen[v] = 1;
		got++;
	}
	ck_assert_int_eq(got, ONCE_N);
	for (int i = 0; i < ONCE_RECEIVERS; i++)
		ck_assert_int_eq(wait_child(r[i]), 0);
	ck_assert_uint_eq(chan_or_die(c, CH("once")).depth, 0);
	close(pfd[0]);
	dlpc_close(c);
}
END_TEST

/* ---- backpressure ---- */

static int blocked_sender(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();

	/* the channel is full (a direct one joined with this first use), then it waits */
	CHILD_CHECK(send_value(c, CH("bp"), 1000, 1, DLPC_SEND_NOWAIT, -1) == -EAGAIN);
	CHILD_CHECK(write(fd, "s", 1) == 1);
	CHILD_CHECK(send_value(c, CH("bp"), 1000, 1, 0, -1) == 0);
	CHILD_CHECK(write(fd, "d", 1) == 1);
	dlpc_close(c);
	return 0;
}

START_TEST(test_backpressure)
{
	dlpc_channel_info info = {.size = sizeof(info)}, big = {.size = sizeof(big)};
	struct pollfd pl;
	dlpc_client *c;
	int pfd[2];
	uint32_t cap;
	char x;
	pid_t s;
	int64_t v;

	kind = _i;
	c = connect_or_die(&D);
	ck_assert_dlpc(open_kind(c, CH("bp"), 4, &info), 1);
	cap = info.capacity;
	check_capacity(cap, 4);
	for (uint32_t i = 0; i < cap; i++)
		ck_assert_dlpc(send_value(c, CH("bp"), i, 1, DLPC_SEND_NOWAIT, -1), 0);
	ck_assert_uint_eq(chan_or_die(c, CH("bp")).depth, cap);
	ck_assert_dlpc(send_value(c, CH("bp"), 99, 1, DLPC_SEND_NOWAIT, -1), -EAGAIN);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), QUOTED("bp")));
	ck_assert_dlpc(send_value(c, CH("bp"), 99, 1, 0, 0), -EAGAIN);
	ck_assert_dlpc(send_value(c, CH("bp"), 99, 1, 0, scaled_ms(200)), -ETIMEDOUT);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), QUOTED("bp")));
	info = chan_or_die(c, CH("bp"));
	ck_assert_uint_eq(info.depth, cap);
	ck_assert_uint_eq(info.senders_waiting, 0);
	if (kind == QUEUED)
		ck_assert_uint_eq(stat_or_die(c).messages, cap);
	/* a capacity past net.unix.max_dgram_qlen (10): what big.capacity says fits, exactly */
	ck_assert_dlpc(open_kind(c, CH("bp64"), 64, &big), 1);
	check_capacity(big.capacity, 64);
	ck_assert_uint_ge(big.capacity, 11);
	for (uint32_t i = 0; i < big.capacity; i++)
		ck_assert_dlpc(send_value(c, CH("bp64"), i, 1, DLPC_SEND_NOWAIT, -1), 0);
	ck_assert_dlpc(send_value(c, CH("bp64"), 99, 1, DLPC_SEND_NOWAIT, -1), -EAGAIN);
	ck_assert_uint_eq(chan_or_die(c, CH("bp64")).depth, big.capacity);
	/* a sender in another process waits, and goes on once a message is received */
	ck_assert_int_eq(pipe(pfd), 0);
	s = spawn(blocked_sender, &pfd[1]);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert_int_eq(x, 's');
	/* blocked: its message has no room */
	ck_assert(waits_on(c, CH("bp"), s, true));
	pl = (struct pollfd){.fd = pfd[0], .events = POLLIN};
	ck_assert_int_eq(poll(&pl, 1, 0), 0);
	ck_assert_uint_eq(chan_or_die(c, CH("bp")).depth, cap);
	ck_assert_dlpc(recv_value(c, CH("bp"), 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 0);
	/* room for one: the blocked sender's message goes in */
	ck_assert_msg(
		poll(&pl, 1, scaled_ms(5000)) == 1,
		"the blocked sender did not complete once a receive made room (depth %u of %u)",
		chan_or_die(c, CH("bp")).depth, cap);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert_int_eq(x, 'd');
	ck_assert_int_eq(wait_child(s), 0);
	for (uint32_t i = 1; i < cap; i++) {
		ck_assert_dlpc(recv_value(c, CH("bp"), 0, &v, NULL, NULL), 0);
		ck_assert_int_eq(v, i);
	}
	ck_assert_dlpc(recv_value(c, CH("bp"), 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 1000);
	ck_assert_dlpc(recv_value(c, CH("bp"), 0, &v, NULL, NULL), -EAGAIN);
	ck_assert_dlpc(recv_value(c, CH("bp"), scaled_ms(50), &v, NULL, NULL), -ETIMEDOUT);
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(c);
}
END_TEST

/* ---- a killed receiver's messages are freed; a killed waiter takes nothing; it goes on ---- */

/* int64 values per message: under DLPC_WARM_SIZE_MIN, so that each message's memfd is made for it
 * and labelled with the channel's name (one from the warm pool reads "dlpc:warm", and the count of
 * what the receiver holds would miss it). */
#define KILL_VALUES (DLPC_WARM_SIZE_MIN / sizeof(int64_t) / 2)

static int holding_receiver(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();
	DLManagedTensorVersioned *a, *b;
	int64_t v;

	CHILD_CHECK(recv_value(c, CH("kill"), -1, &v, NULL, &a) == 0);
	CHILD_CHECK(recv_value(c, CH("kill"), -1, &v, NULL, &b) == 0);
	CHILD_CHECK(write(fd, "x", 1) == 1);
	pause();
	return 0;
}

static int waiting_receiver(void *arg)
{
	dlpc_client *c = child_connect();
	int64_t v;

	(void)arg;
	recv_value(c, CH("kill"), -1, &v, NULL, NULL);
	_exit(3);
}

START_TEST(test_killed_receiver)
{
	dlpc_channel_info info = {.size = sizeof(info)};
	dlpc_client *c;
	int fds0, pfd[2];
	char x;
	pid_t r;
	int64_t v;

	kind = _i;
	c = connect_or_die(&D);
	fds0 = settled_fds(&D, c, 1);
	ck_assert_int_eq(pipe(pfd), 0);
	ck_assert_dlpc(open_kind(c, CH("kill"), 0, &info), 1);
	check_capacity(info.capacity, DLPC_CHANNEL_CAPACITY_DEFAULT);
	ck_assert_dlpc(send_value(c, CH("kill"), 1, KILL_VALUES, 0, -1), 0);
	ck_assert_dlpc(send_value(c, CH("kill"), 2, KILL_VALUES, 0, -1), 0);
	r = spawn(holding_receiver, &pfd[1]);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert_uint_eq(chan_or_die(c, CH("kill")).depth, 0);
	/* received and held by the child alone: charged to nobody's queue, still alive */
	if (kind == QUEUED) {
		ck_assert_uint_eq(stat_or_die(c).storages, 2);
		ck_assert_uint_eq(stat_or_die(c).references, 2);
		ck_assert_uint_eq(stat_or_die(c).messages, 0);
	} else {
		ck_assert_int_ge(memfds_held(CH("kill")), 2);
	}
	kill(r, SIGKILL);
	ck_assert_int_eq(wait_child(r), 128 + SIGKILL);
	check_freed(c, CH("kill"));
	ck_assert_uint_eq(stat_or_die(c).bytes_held, 0);

	/* a receiver killed while it waits takes no message with it */
	r = spawn(waiting_receiver, NULL);
	ck_assert(waits_on(c, CH("kill"), r, false));
	kill(r, SIGKILL);
	ck_assert_int_eq(wait_child(r), 128 + SIGKILL);
	ck_assert(WAIT_CHAN(c, CH("kill"), receivers_waiting, 0));
	/* another receiver: the channel goes on */
	ck_assert_dlpc(send_value(c, CH("kill"), 7, 3, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, CH("kill"), 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 7);
	check_freed(c, CH("kill"));
	ck_assert_int_eq(settled_fds(&D, c, 1), fds0 + CHANNEL_FDS);
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(c);
}
END_TEST

/* ---- removal ends the waits with EIDRM and frees what is queued ---- */

static int removed_waiter(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();
	int64_t v;

	/* empty (a direct channel joined with this first use), then waiting */
	CHILD_CHECK(recv_value(c, CH("rm2"), 0, &v, NULL, NULL) == -EAGAIN);
	CHILD_CHECK(write(fd, "w", 1) == 1);
	CHILD_CHECK(recv_value(c, CH("rm2"), -1, &v, NULL, NULL) == -EIDRM);
	CHILD_CHECK(strstr(dlpc_last_error(), "removed") != NULL);
	CHILD_CHECK(recv_value(c, CH("rm2"), 0, &v, NULL, NULL) == -ENOENT);
	dlpc_close(c);
	return 0;
}

static int removed_sender(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();

	/* the channel is full: this one waits */
	CHILD_CHECK(send_value(c, CH("rm"), 9, 1, DLPC_SEND_NOWAIT, -1) == -EAGAIN);
	CHILD_CHECK(write(fd, "s", 1) == 1);
	CHILD_CHECK(send_value(c, CH("rm"), 9, 1, 0, -1) == -EIDRM);
	CHILD_CHECK(strstr(dlpc_last_error(), "removed") != NULL);
	CHILD_CHECK(send_value(c, CH("rm"), 9, 1, 0, -1) == -ENOENT);
	dlpc_close(c);
	return 0;
}

START_TEST(test_remove_frees)
{
	dlpc_channel_info info = {.size = sizeof(info)};
	DLManagedTensorVersioned *held;
	dlpc_client *c, *c2;
	int pfd[2], raw = -1, ends[2], fds0;
	char x, msg[256];
	uint32_t cap;
	pid_t w, s;
	int64_t v;

	kind = _i;
	c = connect_or_die(&D);
	fds0 = settled_fds(&D, c, 1);
	ck_assert_dlpc(open_kind(c, CH("rm"), 4, &info), 1);
	cap = info.capacity;
	check_capacity(cap, 4);
	ck_assert_dlpc(open_kind(c, CH("rm"), 0, NULL), 0);
	if (kind == QUEUED) {
		ck_assert_dlpc(open_kind(c, CH("rm"), 4, NULL), 0);
		ck_assert_dlpc(open_kind(c, CH("rm"), 5, NULL), -EEXIST);
	}
	ck_assert_dlpc(open_kind(c, CH("rm2"), 0, NULL), 1);
	/* a watcher of a direct channel's queue: a raw JOIN's ends */
	if (kind == DIRECT) {
		raw = raw_connect(&D);
		raw_hello(raw, DLPC_PROTO_MAJOR);
		ck_assert_int_eq(raw_join(raw, CH("rm"), ends, msg, sizeof(msg)), 0);
	}
	/* a second client that used it (a direct one joined) and uses it again after the removal */
	c2 = connect_or_die(&D);
	ck_assert_dlpc(recv_value(c2, CH("rm"), 0, &v, NULL, NULL), -EAGAIN);
	for (uint32_t i = 0; i < cap; i++)
		ck_assert_dlpc(send_value(c, CH("rm"), (int64_t)i * 4096, 4096, 0, -1), 0);
	if (kind == QUEUED) {
		ck_assert_uint_eq(stat_or_die(c).storages, cap);
		ck_assert_uint_eq(stat_or_die(c).uid_bytes_held, cap * 4096 * 8);
	}
	/* one received and held survives the removal */
	ck_assert_dlpc(recv_value(c, CH("rm"), 0, &v, NULL, &held), 0);
	ck_assert_dlpc(send_value(c, CH("rm"), 77 * 4096, 4096, 0, -1), 0);
	ck_assert_uint_eq(chan_or_die(c, CH("rm")).depth, cap);
	if (kind == DIRECT) {
		ck_assert_int_eq(queued(ends[1]), (int)cap);
		/* every queued message lives in the socket alone; the held one is mapped here */
		ck_assert_int_eq(memfds_held(CH("rm")), 1);
	}
	ck_assert_int_eq(pipe(pfd), 0);
	s = spawn(removed_sender, &pfd[1]);
	w = spawn(removed_waiter, &pfd[1]);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	/* both are past their first use; now in their waits */
	ck_assert(waits_on(c, CH("rm"), s, true));
	ck_assert(waits_on(c, CH("rm2"), w, false));
	ck_assert_dlpc(dlpc_channel_remove(c, CH("rm")), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, CH("rm2")), 0);
	ck_assert_int_eq(wait_child(s), 0);
	ck_assert_int_eq(wait_child(w), 0);
	ck_assert_uint_eq(stat_or_die(c).channels, 0);
	if (kind == QUEUED) {
		/* the daemon dropped what was queued; the held one lives on */
		ck_assert_uint_eq(stat_or_die(c).messages, 0);
		ck_assert_uint_eq(stat_or_die(c).storages, 1);
	} else {
		/* the daemon read nothing: what is queued goes with the pair. A receiver that
		 * joined before drops it on its next use, and reads the end */
		ck_assert_int_eq(queued(ends[1]), (int)cap);
	}
	ck_assert_dlpc(recv_value(c2, CH("rm"), 0, &v, NULL, NULL), -ENOENT);
	if (kind == DIRECT) {
		ck_assert_int_eq(queued(ends[1]), 0);
		ck_assert(memfds_reach(CH("rm"), 1));
	}
	ck_assert_int_eq(((const int64_t *)held->dl_tensor.data)[4095], 4095);
	held->deleter(held);
	check_freed(c, CH("rm"));
	if (kind == DIRECT) {
		close(ends[0]);
		close(ends[1]);
		close(raw);
	}
	ck_assert_dlpc(dlpc_channel_remove(c, CH("rm")), -ENOENT);
	ck_assert_dlpc(recv_value(c, CH("rm"), 0, &v, NULL, NULL), -ENOENT);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), QUOTED("rm")));
	ck_assert_dlpc(send_value(c, CH("rm"), 1, 1, 0, -1), -ENOENT);
	/* the daemon closed what it held for them (a direct channel's copies of the pair) */
	dlpc_close(c2);
	ck_assert_int_eq(settled_fds(&D, c, 1), fds0);
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(c);
}
END_TEST

/* ---- end of stream (1.10) ---- */

#define END_N 50 /* messages each of two producers sends */

/* A producer of "end": END_N values from arg's base, then its close. */
static int end_producer(void *arg)
{
	int64_t base = *(int64_t *)arg;
	dlpc_client *c = child_connect();
	dlpc_channel_opts o = {.size = sizeof(o), .producers = 2};
	dlpc_channel_info i = {.size = sizeof(i)};

	/* opened by name, asking no kind: the channel as it is */
	CHILD_CHECK(dlpc_channel_open_opts(c, CH("end"), &o, &i) == 0);
	CHILD_CHECK((i.flags & DLPC_CHANNEL_DIRECT) == open_flags());
	for (int64_t k = 0; k < END_N; k++)
		CHILD_CHECK(send_value(c, CH("end"), base + k, 1, 0, -1) == 0);
	CHILD_CHECK(dlpc_channel_close(c, CH("end")) == 0);
	/* its own sends after its close are refused */
	CHILD_CHECK(send_value(c, CH("end"), -1, 1, 0, -1) == -EPIPE);
	dlpc_close(c);
	return 0;
}

/* Two producers, one slow consumer: every message of both, then the end, by itself (without
 * the end the loop below never stops: a receive without a timeout waits for ever). */
START_TEST(test_end_two_producers)
{
	dlpc_channel_opts o = {.size = sizeof(o), .capacity = END_N, .producers = 2};
	static unsigned char seen[2 * END_N];
	int64_t bases[2] = {0, END_N}, v;
	dlpc_channel_info i = {.size = sizeof(i)};
	dlpc_client *c;
	pid_t p[2];
	int got = 0, r;

	kind = _i;
	c = connect_or_die(&D);
	o.flags = open_flags();
	ck_assert_dlpc(dlpc_channel_open_opts(c, CH("end"), &o, &i), 1);
	ck_assert_uint_eq(i.producers_expected, 2);
	p[0] = spawn(end_producer, &bases[0]);
	if (kind == QUEUED) {
		/* the first producer may finish before the second starts (its messages fit): the
		 * stream waits for two */
		ck_assert_int_eq(wait_child(p[0]), 0);
		ck_assert(!(chan_or_die(c, CH("end")).flags & DLPC_CHANNEL_ENDED));
	}
	p[1] = spawn(end_producer, &bases[1]);
	while ((r = recv_value(c, CH("end"), -1, &v, NULL, NULL)) == 0) {
		ck_assert(v >= 0 && v < 2 * END_N && !seen[v]);
		seen[v] = 1;
		got++;
		usleep(2000); /* a slow consumer: the producers wait for room */
	}
	ck_assert_dlpc(r, -EPIPE);
	ck_assert_int_eq(got, 2 * END_N);
	if (kind == DIRECT)
		ck_assert_int_eq(wait_child(p[0]), 0);
	ck_assert_int_eq(wait_child(p[1]), 0);
	i = chan_or_die(c, CH("end"));
	ck_assert_uint_eq(i.flags, open_flags() | DLPC_CHANNEL_ENDED);
	ck_assert_uint_eq(i.producers, 0);
	ck_assert_uint_eq(i.producers_closed, 2);
	/* it stays ended: sends from anyone are refused, receives end at once */
	ck_assert_dlpc(send_value(c, CH("end"), 1, 1, 0, -1), -EPIPE);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), QUOTED("end")));
	ck_assert_dlpc(recv_value(c, CH("end"), 0, &v, NULL, NULL), -EPIPE);
	check_freed(c, CH("end"));
	/* a new stream: remove, open again */
	ck_assert_dlpc(dlpc_channel_remove(c, CH("end")), 0);
	ck_assert_dlpc(open_kind(c, CH("end"), 0, &i), 1);
	ck_assert(!(i.flags & DLPC_CHANNEL_ENDED));
	ck_assert_dlpc(send_value(c, CH("end"), 1, 1, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, CH("end"), 0, &v, NULL, NULL), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, CH("end")), 0);
	dlpc_close(c);
}
END_TEST

/* Another process removes "next" and opens it anew, for a new stream. */
static int next_stream(void *arg)
{
	dlpc_client *c = child_connect();

	(void)arg;
	CHILD_CHECK(dlpc_channel_remove(c, CH("next")) == 0);
	CHILD_CHECK(open_kind(c, CH("next"), 0, NULL) == 1);
	dlpc_close(c);
	return 0;
}

/* A process that read one stream to its end (a direct channel's endpoint learned the end)
 * sends on the next stream of the name, made by another process after a removal: the old end
 * does not stick. */
START_TEST(test_end_then_new_stream_send)
{
	dlpc_client *c;
	int64_t v = -1;

	kind = _i;
	c = connect_or_die(&D);
	ck_assert_dlpc(open_kind(c, CH("next"), 0, NULL), 1);
	ck_assert_dlpc(send_value(c, CH("next"), 3, 1, 0, -1), 0);
	ck_assert_dlpc(dlpc_channel_close(c, CH("next")), 0);
	ck_assert_dlpc(recv_value(c, CH("next"), 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 3);
	ck_assert_dlpc(recv_value(c, CH("next"), 0, &v, NULL, NULL), -EPIPE);
	ck_assert_int_eq(wait_child(spawn(next_stream, NULL)), 0);
	ck_assert_dlpc(send_value(c, CH("next"), 4, 1, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, CH("next"), 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 4);
	ck_assert_dlpc(dlpc_channel_remove(c, CH("next")), 0);
	dlpc_close(c);
}
END_TEST

/* A receiver waiting on an empty channel: its first message, then the end. */
static int end_waiter(void *arg)
{
	dlpc_client *c = child_connect();
	int64_t v;

	CHILD_CHECK(recv_value(c, CH("wake"), -1, &v, NULL, NULL) == 0 && v == 7);
	/* it says so before it waits again: the test then closes */
	CHILD_CHECK(write(*(int *)arg, "w", 1) == 1);
	CHILD_CHECK(recv_value(c, CH("wake"), -1, &v, NULL, NULL) == -EPIPE);
	dlpc_close(c);
	return 0;
}

START_TEST(test_end_wakes_waiter)
{
	dlpc_client *c, *other;
	int pfd[2];
	char ch;
	pid_t w;

	kind = _i;
	c = connect_or_die(&D);
	other = connect_or_die(&D);
	ck_assert_int_eq(pipe(pfd), 0);
	ck_assert_dlpc(open_kind(c, CH("wake"), 0, NULL), 1);
	w = spawn(end_waiter, &pfd[1]);
	ck_assert(waits_on(c, CH("wake"), w, false));
	ck_assert_dlpc(send_value(c, CH("wake"), 7, 1, 0, -1), 0);
	ck_assert_int_eq(read(pfd[0], &ch, 1), 1);
	if (kind == QUEUED)
		ck_assert(WAIT_CHAN(c, CH("wake"), received, 1));
	ck_assert(waits_on(c, CH("wake"), w, false));
	/* a close by a connection that never sent counts as a producer's that had nothing to
	 * send: the stream goes on while a producer that sent has not closed */
	ck_assert_dlpc(dlpc_channel_close(other, CH("wake")), 0);
	ck_assert_uint_eq(chan_or_die(c, CH("wake")).producers, 1);
	ck_assert_uint_eq(chan_or_die(c, CH("wake")).producers_closed, 1);
	ck_assert(!(chan_or_die(c, CH("wake")).flags & DLPC_CHANNEL_ENDED));
	if (kind == QUEUED)
		ck_assert_uint_eq(chan_or_die(c, CH("wake")).receivers_waiting, 1);
	/* twice is as once */
	ck_assert_dlpc(dlpc_channel_close(other, CH("wake")), 0);
	ck_assert_uint_eq(chan_or_die(c, CH("wake")).producers_closed, 1);
	ck_assert_dlpc(dlpc_channel_close(c, CH("wake")), 0);
	ck_assert_int_eq(wait_child(w), 0);
	ck_assert(chan_or_die(c, CH("wake")).flags & DLPC_CHANNEL_ENDED);
	ck_assert_dlpc(dlpc_channel_close(c, CH("none")), -ENOENT);
	ck_assert_dlpc(dlpc_channel_close_flags(c, CH("wake"), 2), -EINVAL);
	ck_assert_dlpc(dlpc_channel_remove(c, CH("wake")), 0);
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(other);
	dlpc_close(c);
}
END_TEST

/* uid 65534 may not close "all" of root's for every producer. */
static int close_all_other_uid(void *arg)
{
	dlpc_client *c;

	(void)arg;
	become_nobody();
	c = child_connect();
	CHILD_CHECK(dlpc_channel_close_flags(c, CH("all"), DLPC_CHANNEL_CLOSE_ALL) == -EPERM);
	CHILD_CHECK(strstr(dlpc_last_error(), QUOTED("all")) != NULL);
	dlpc_close(c);
	return 0;
}

/* Closed as a whole by its owner: what is queued is received, later sends get EPIPE. */
START_TEST(test_end_close_all)
{
	dlpc_client *c, *p;
	int64_t v;

	kind = _i;
	c = connect_or_die(&D);
	p = connect_or_die(&D);
	daemon_open_for_others(&D);
	ck_assert_dlpc(open_kind(c, CH("all"), 2, NULL), 1);
	ck_assert_dlpc(send_value(p, CH("all"), 1, 1, 0, -1), 0);
	ck_assert_dlpc(send_value(p, CH("all"), 2, 1, 0, -1), 0);
	ck_assert_int_eq(wait_child(spawn(close_all_other_uid, NULL)), 0);
	ck_assert(!(chan_or_die(c, CH("all")).flags & DLPC_CHANNEL_ENDED));
	ck_assert_dlpc(dlpc_channel_close_flags(c, CH("all"), DLPC_CHANNEL_CLOSE_ALL), 0);
	ck_assert_uint_eq(chan_or_die(c, CH("all")).producers, 1); /* p never closed */
	ck_assert_dlpc(send_value(p, CH("all"), 3, 1, 0, -1), -EPIPE);
	ck_assert_dlpc(recv_value(c, CH("all"), -1, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 1);
	ck_assert_uint_eq(chan_or_die(c, CH("all")).depth, 1);
	ck_assert_dlpc(recv_value(c, CH("all"), -1, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 2);
	ck_assert_dlpc(recv_value(c, CH("all"), -1, &v, NULL, NULL), -EPIPE);
	check_freed(c, CH("all"));
	ck_assert_dlpc(dlpc_channel_remove(c, CH("all")), 0);
	ck_assert_dlpc(recv_value(c, CH("all"), 0, &v, NULL, NULL), -ENOENT);
	dlpc_close(p);
	dlpc_close(c);
}
END_TEST

/* ---- a producer that dies: what it sent stays, and its death is its close ---- */

/* Sends values 0 .. capacity - 1 into "gone" (the channel then full), then one more that waits
 * for room: the process is killed while it waits. */
static int send_until_killed(void *arg)
{
	uint32_t cap = *(uint32_t *)arg;
	dlpc_client *c = child_connect();

	for (uint32_t i = 0; i < cap; i++)
		CHILD_CHECK(send_value(c, CH("gone"), i, 1, 0, -1) == 0);
	send_value(c, CH("gone"), 99, 1, 0, -1);
	_exit(3);
}

START_TEST(test_sender_dies_waiting)
{
	dlpc_channel_info info = {.size = sizeof(info)};
	dlpc_client *c;
	uint32_t cap;
	pid_t s;
	int64_t v;

	kind = _i;
	c = connect_or_die(&D);
	ck_assert_dlpc(open_kind(c, CH("gone"), 2, &info), 1);
	cap = info.capacity;
	check_capacity(cap, 2);
	s = spawn(send_until_killed, &cap);
	/* (a child in poll() may still wait for an earlier call's reply: count, then wait) */
	ck_assert(WAIT_CHAN(c, CH("gone"), depth, cap));
	ck_assert(waits_on(c, CH("gone"), s, true));
	ck_assert_uint_eq(chan_or_die(c, CH("gone")).producers, 1);
	ck_assert_uint_eq(chan_or_die(c, CH("gone")).depth, cap);
	kill(s, SIGKILL);
	ck_assert_int_eq(wait_child(s), 128 + SIGKILL);
	if (kind == QUEUED) {
		/* its waiting send went with it; what it sent stays */
		ck_assert(WAIT_CHAN(c, CH("gone"), senders_waiting, 0));
		ck_assert_uint_eq(stat_or_die(c).messages, cap);
	}
	/* its only producer died without closing: that is its close, and the stream ended after
	 * the messages it sent */
	ck_assert(WAIT_CHAN(c, CH("gone"), producers_closed, 1));
	ck_assert_uint_eq(chan_or_die(c, CH("gone")).producers, 0);
	ck_assert(chan_or_die(c, CH("gone")).flags & DLPC_CHANNEL_ENDED);
	for (uint32_t i = 0; i < cap; i++) {
		ck_assert_dlpc(recv_value(c, CH("gone"), 0, &v, NULL, NULL), 0);
		ck_assert_int_eq(v, i);
	}
	ck_assert_dlpc(recv_value(c, CH("gone"), 0, &v, NULL, NULL), -EPIPE);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(),
				     kind == DIRECT ? "'d/gone' has ended" : "'q/gone' has ended"));
	check_freed(c, CH("gone"));
	ck_assert_dlpc(dlpc_channel_remove(c, CH("gone")), 0);
	dlpc_close(c);
}
END_TEST

/* A producer that sends two messages and dies without closing. */
static int end_crasher(void *arg)
{
	dlpc_client *c = child_connect();

	(void)arg;
	CHILD_CHECK(send_value(c, CH("crash"), 1, 1, 0, -1) == 0);
	CHILD_CHECK(send_value(c, CH("crash"), 2, 1, 0, -1) == 0);
	kill(getpid(), SIGKILL);
	return 1;
}

START_TEST(test_end_producer_crash)
{
	dlpc_client *c;
	int64_t v;

	kind = _i;
	c = connect_or_die(&D);
	ck_assert_dlpc(open_kind(c, CH("crash"), 8, NULL), 1);
	ck_assert_int_eq(wait_child(spawn(end_crasher, NULL)), 128 + SIGKILL);
	/* its connection's end is its close: the consumer gets what it sent, then the end */
	ck_assert(WAIT_CHAN(c, CH("crash"), producers_closed, 1));
	ck_assert_dlpc(recv_value(c, CH("crash"), -1, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 1);
	ck_assert_dlpc(recv_value(c, CH("crash"), -1, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 2);
	ck_assert_dlpc(recv_value(c, CH("crash"), -1, &v, NULL, NULL), -EPIPE);
	ck_assert_dlpc(dlpc_channel_remove(c, CH("crash")), 0);
	dlpc_close(c);
}
END_TEST

/* ---- bundles ---- */

/* A bundle received whole, as one tensor refused (-EINVAL) and left queued for
 * dlpc_recv_bundle(), as dlpc_recv()'s documentation says of every channel, also a bundle of
 * one tensor under a key (a single tensor's key is ""); the bounds of a capacity and a name. */
START_TEST(test_bundles)
{
	static float a[4] = {1, 2, 3, 4};
	static int32_t b[3] = {7, 8, 9};
	int64_t sa = 4, sb = 3;
	const char *keys[] = {"a", "b"};
	DLManagedTensorVersioned *ts[2], *t;
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	dlpc_attach_info ai = {.size = sizeof(ai)};
	dlpc_bundle *bun;
	dlpc_client *c;

	kind = _i;
	c = connect_or_die(&D);
	ck_assert_dlpc(open_kind(c, CH("bun"), DLPC_CHANNEL_CAPACITY_MAX + 1, NULL), -EINVAL);
	ck_assert_dlpc(open_kind(c, CH("bun"), DLPC_CHANNEL_CAPACITY_MAX, NULL), 1);
	ts[0] = host_tensor(a, (DLDataType){kDLFloat, 32, 1}, 1, &sa, NULL, NULL);
	ts[1] = host_tensor(b, (DLDataType){kDLInt, 32, 1}, 1, &sb, NULL, NULL);
	ck_assert_dlpc(dlpc_send_bundle(c, CH("bun"), 2, keys, ts, NULL), 0);
	ck_assert_dlpc(dlpc_recv(c, CH("bun"), &now, &t), -EINVAL);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "bundle"));
	ck_assert_uint_eq(chan_or_die(c, CH("bun")).depth, 1);
	/* a message is read-only to its receivers: asking for it writable is refused before it
	 * leaves the channel, not lost in a mapping that fails */
	now.flags = DLPC_ATTACH_WRITABLE;
	ck_assert_dlpc(dlpc_recv_bundle(c, CH("bun"), &now, &bun), -EINVAL);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "writable"));
	ck_assert_uint_eq(chan_or_die(c, CH("bun")).depth, 1);
	now.flags = 0;
	ck_assert_dlpc(dlpc_recv_bundle(c, CH("bun"), &now, &bun), 0);
	ck_assert_uint_eq(dlpc_bundle_count(bun), 2);
	ck_assert_str_eq(dlpc_bundle_key(bun, 1), "b");
	t = dlpc_bundle_take(bun, 1);
	ck_assert_int_eq(((int32_t *)t->dl_tensor.data)[2], 9);
	ck_assert(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
	ck_assert_dlpc(dlpc_tensor_attach_info(t, &ai), 0);
	/* a queued message is an entry of the daemon's, of generation 1; a direct one none */
	ck_assert_uint_eq(ai.generation, kind == QUEUED ? 1 : 0);
	ck_assert_int_eq(ai.owner_pid, getpid());
	t->deleter(t);
	dlpc_bundle_free(bun);
	ck_assert_uint_eq(chan_or_die(c, CH("bun")).depth, 0);
	/* one tensor under a key */
	ts[0] = host_tensor(a, (DLDataType){kDLFloat, 32, 1}, 1, &sa, NULL, NULL);
	ck_assert_dlpc(dlpc_send_bundle(c, CH("bun"), 1, keys, ts, NULL), 0);
	ck_assert_dlpc(dlpc_recv(c, CH("bun"), &now, &t), -EINVAL);
	ck_assert_msg(strstr(dlpc_last_error(), "a bundle of 1 tensor under a key"), "%s",
		      dlpc_last_error());
	ck_assert_uint_eq(chan_or_die(c, CH("bun")).depth, 1);
	ck_assert_dlpc(dlpc_recv_bundle(c, CH("bun"), &now, &bun), 0);
	ck_assert_uint_eq(dlpc_bundle_count(bun), 1);
	ck_assert_str_eq(dlpc_bundle_key(bun, 0), "a");
	dlpc_bundle_free(bun);
	ck_assert_uint_eq(chan_or_die(c, CH("bun")).depth, 0);
	ck_assert_dlpc(open_kind(c, "", 0, NULL), -EINVAL);
	ck_assert_dlpc(dlpc_recv(c, CH("bun"), NULL, NULL), -EINVAL);
	ck_assert_dlpc(dlpc_channel_remove(c, CH("bun")), 0);
	dlpc_close(c);
}
END_TEST

/* ---- the daemon gone ---- */

static int daemon_gone_waiter(void *arg)
{
	int fd = *(int *)arg;
	dlpc_client *c = child_connect();
	int64_t v;
	int r;

	CHILD_CHECK(recv_value(c, CH("dead"), 0, &v, NULL, NULL) == -EAGAIN);
	CHILD_CHECK(write(fd, "w", 1) == 1);
	/* a hang is a failure: SIGALRM kills this child */
	alarm((unsigned)(scaled_ms(20000) / 1000));
	r = recv_value(c, CH("dead"), -1, &v, NULL, NULL);
	if (r != -ECONNRESET)
		fprintf(stderr, "daemon_gone_waiter: %d %s\n", r, dlpc_last_error());
	CHILD_CHECK(r == -ECONNRESET);
	dlpc_close(c);
	return 0;
}

/* A fresh daemon on D's socket for the fixture's teardown, once it accepts. */
static void daemon_again(void)
{
	dlpc_client *probe = NULL;

	D.pid = daemon_spawn(D.sock, D.log);
	for (int i = 0; i < scaled_ms(5000) && !probe; i++)
		if (dlpc_connect(D.sock, &probe) < 0)
			usleep(1000);
	ck_assert_ptr_nonnull(probe);
	dlpc_close(probe);
}

/* The daemon killed while a receiver waits: the wait ends with -ECONNRESET. */
START_TEST(test_daemon_killed)
{
	dlpc_client *c;
	int pfd[2];
	char x;
	pid_t w;

	kind = _i;
	c = connect_or_die(&D);
	ck_assert_dlpc(open_kind(c, CH("dead"), 0, NULL), 1);
	ck_assert_int_eq(pipe(pfd), 0);
	w = spawn(daemon_gone_waiter, &pfd[1]);
	ck_assert_int_eq(read(pfd[0], &x, 1), 1);
	ck_assert(waits_on(c, CH("dead"), w, false));
	dlpc_close(c);
	ck_assert_int_eq(kill(D.pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(D.pid, NULL, 0), D.pid);
	ck_assert_int_eq(wait_child(w), 0);
	daemon_again();
	close(pfd[0]);
	close(pfd[1]);
}
END_TEST

/* With DLPC_CONNECT_RECONNECT, "once a call has found the connection lost ... the next call
 * connects ... again": a wait on a channel that sees the daemon go marks the connection lost,
 * so the next call connects to the new daemon, which has no such channel (before, a direct
 * channel's later waits failed at once with -ECONNRESET, even once a new daemon listened). */
START_TEST(test_daemon_gone_then_reconnect)
{
	dlpc_client *c = NULL;
	int64_t v;

	kind = _i;
	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &c), 0);
	ck_assert_dlpc(open_kind(c, CH("rc"), 0, NULL), 1);
	ck_assert_dlpc(recv_value(c, CH("rc"), 1, &v, NULL, NULL), -ETIMEDOUT);
	ck_assert_int_eq(kill(D.pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(D.pid, NULL, 0), D.pid);
	ck_assert_dlpc(recv_value(c, CH("rc"), 1000, &v, NULL, NULL), -ECONNRESET);
	daemon_again();
	/* the channel did not survive: a reconnected client finds none */
	ck_assert_dlpc(recv_value(c, CH("rc"), 1000, &v, NULL, NULL), -ENOENT);
	dlpc_close(c);
}
END_TEST

/* -EPIPE from a channel call is the end of a stream only: a daemon gone under a close, a remove
 * or an open reads as a lost connection (-ECONNRESET), as it does for a send or a receive. */
START_TEST(test_lost_connection_is_not_the_end)
{
	struct daemon q;
	dlpc_client *c;

	kind = _i;
	daemon_start(&q);
	c = connect_or_die(&q);
	ck_assert_dlpc(open_kind(c, CH("gone"), 4, NULL), 1);
	ck_assert_dlpc(send_value(c, CH("gone"), 1, 1, 0, -1), 0);
	daemon_stop(&q);
	ck_assert_dlpc(dlpc_channel_close(c, CH("gone")), -ECONNRESET);
	ck_assert_dlpc(dlpc_channel_remove(c, CH("gone")), -ECONNRESET);
	ck_assert_dlpc(open_kind(c, CH("gone"), 4, NULL), -ECONNRESET);
	dlpc_close(c);
}
END_TEST

/* dlpc_cancel() makes "every later call on it" return -ECANCELED: a channel's send and receive
 * too, also those that need not wait (before, a direct channel's looked only when they
 * waited). */
START_TEST(test_cancel_ends_calls)
{
	dlpc_client *c;
	int64_t v;

	kind = _i;
	c = connect_or_die(&D);
	ck_assert_dlpc(open_kind(c, CH("cancel"), 8, NULL), 1);
	ck_assert_dlpc(send_value(c, CH("cancel"), 1, 4, 0, 1000), 0);
	dlpc_cancel(c);
	ck_assert_dlpc(send_value(c, CH("cancel"), 2, 4, 0, 1000), -ECANCELED);
	ck_assert_dlpc(recv_value(c, CH("cancel"), 1000, &v, NULL, NULL), -ECANCELED);
	dlpc_close(c);
}
END_TEST

Suite *channel_suite(const char *name, enum chan_kind k, TCase **tc, TCase **plain)
{
	Suite *s = suite_create(name);

	*tc = tcase_create(name);
	tcase_add_checked_fixture(*tc, channel_setup, channel_teardown);
	tcase_set_timeout(*tc, scaled_ms(60000) / 1000);
	tcase_add_loop_test(*tc, test_order, k, k + 1);
	tcase_add_loop_test(*tc, test_exactly_once, k, k + 1);
	tcase_add_loop_test(*tc, test_backpressure, k, k + 1);
	tcase_add_loop_test(*tc, test_killed_receiver, k, k + 1);
	tcase_add_loop_test(*tc, test_remove_frees, k, k + 1);
	tcase_add_loop_test(*tc, test_end_two_producers, k, k + 1);
	tcase_add_loop_test(*tc, test_end_then_new_stream_send, k, k + 1);
	tcase_add_loop_test(*tc, test_end_wakes_waiter, k, k + 1);
	tcase_add_loop_test(*tc, test_end_close_all, k, k + 1);
	tcase_add_loop_test(*tc, test_sender_dies_waiting, k, k + 1);
	tcase_add_loop_test(*tc, test_end_producer_crash, k, k + 1);
	tcase_add_loop_test(*tc, test_bundles, k, k + 1);
	tcase_add_loop_test(*tc, test_daemon_killed, k, k + 1);
	tcase_add_loop_test(*tc, test_daemon_gone_then_reconnect, k, k + 1);
	tcase_add_loop_test(*tc, test_cancel_ends_calls, k, k + 1);
	suite_add_tcase(s, *tc);
	*plain = tcase_create("own daemons");
	tcase_set_timeout(*plain, scaled_ms(60000) / 1000);
	tcase_add_loop_test(*plain, test_lost_connection_is_not_the_end, k, k + 1);
	suite_add_tcase(s, *plain);
	return s;
}
