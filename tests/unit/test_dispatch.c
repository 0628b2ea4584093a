/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's dispatch, registry and teardown, in-process: a server with no listener on a real
 * libuv loop, its connections over socketpairs whose client ends the test drives frame by frame
 * and loop turn by loop turn. Deterministic, so each case can reach the one state it is about
 * (a socket exactly full, a half-closed client with replies queued).
 *
 * Every case runs in a process of its own, and its checked teardown stops the server and then
 * insists that no connection, reference, waiter, libuv handle, fd or byte of heap is left: the
 * fds against a count taken before the case, the heap against mallinfo2() (or, in a sanitizer
 * build, LeakSanitizer's verdict). mallinfo2() counts the chunks glibc keeps in its per-thread
 * cache as in use, so the suite runs with that cache off (it re-executes itself so).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dispatch.h"
#include "harness.h"
#include "io.h"
#include "msg.h"
#include "raw.h"
#include "reaper.h"
#include "server.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DLPC_TEST_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define DLPC_TEST_ASAN 1
#endif
#ifdef DLPC_TEST_ASAN
#include <sanitizer/lsan_interface.h>
#endif

/* Loop turns (and milliseconds slept between them) a case waits for something at most. */
#define PATIENCE 5000

static uv_loop_t loop;
static struct dlpd_server srv;
static struct dlpd_limits lim;
static int fd_base;
static size_t heap_base;

static size_t heap_in_use(void)
{
#ifdef DLPC_TEST_ASAN
	return 0;
#else
	return mallinfo2().uordblks;
#endif
}

static void setup(void)
{
	/* Check allocates what it reports locations with at the first mark */
	mark_point();
	fd_base = fd_count(getpid());
	heap_base = heap_in_use();
	lim = dlpd_limits;
	ck_assert_int_eq(uv_loop_init(&loop), 0);
	dlpd_server_init(&srv, &loop, &lim);
}

static void teardown(void)
{
	int turns = 0;

	dlpd_server_stop(&srv);
	while (uv_run(&loop, UV_RUN_NOWAIT) && turns < PATIENCE)
		turns++;
	ck_assert_uint_eq(srv.npeers, 0);
	ck_assert_uint_eq(srv.peers_closing, 0);
	ck_assert_uint_eq(srv.reg.refs, 0);
	ck_assert_uint_eq(srv.reg.waiters, 0);
	ck_assert_uint_eq(srv.nwatchers, 0);
	dlpd_server_free(&srv);
	ck_assert_uint_eq(srv.reg.storages, 0);
	ck_assert_int_eq(uv_loop_close(&loop), 0);
	ck_assert_int_eq(fd_count(getpid()), fd_base);
#ifdef DLPC_TEST_ASAN
	ck_assert_int_eq(__lsan_do_recoverable_leak_check(), 0);
#else
	ck_assert_uint_eq(heap_in_use(), heap_base);
#endif
}

static void turn(int n)
{
	for (int i = 0; i < n; i++)
		uv_run(&loop, UV_RUN_NOWAIT);
}

/* A client connection: its end of a non-blocking socketpair; the daemon's end in @p dend. */
static int client(int *dend, int daemon_sndbuf, int client_rcvbuf)
{
	int sv[2];

	ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
	if (daemon_sndbuf)
		setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &daemon_sndbuf, sizeof(int));
	if (client_rcvbuf)
		setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &client_rcvbuf, sizeof(int));
	ck_assert_ptr_nonnull(dlpd_peer_new(&srv, sv[0]));
	if (dend)
		*dend = sv[0];
	return sv[1];
}

/* Write all of @p p (with @p fds on the first byte), letting the daemon run while the socket
 * is full. */
static void put(int fd, const uint8_t *p, size_t len, const int *fds, unsigned nfds)
{
	for (int tries = 0; len > 0; tries++) {
		ssize_t n = send_fds_raw(fd, p, len, fds, nfds);

		ck_assert_int_lt(tries, PATIENCE);
		if (n < 0) {
			ck_assert_int_eq(errno, EAGAIN);
			turn(1);
			continue;
		}
		p += n;
		len -= (size_t)n;
		nfds = 0;
	}
}

static void put_msg(int fd, uint16_t type, uint32_t id, const ProtobufCMessage *m, const int *fds,
		    unsigned nfds)
{
	struct dlpc__scratch s = {0};
	ssize_t len = dlpc__msg_frame(&s, type, id, m, nfds);

	ck_assert_int_gt(len, 0);
	put(fd, s.p, (size_t)len, fds, nfds);
	dlpc__scratch_clear(&s);
}

/* A frame of @p type with an empty payload (a header alone, fds declared but not sent). */
static void put_empty(int fd, uint16_t type, uint32_t id)
{
	uint8_t hdr[DLPC_FRAME_HDR_SIZE];
	struct dlpc__hdr h = {.type = type, .id = id};

	dlpc__hdr_encode(hdr, &h);
	put(fd, hdr, sizeof(hdr), NULL, 0);
}

/* The next frame from the daemon: 1 and @p f, or 0 at the end of the stream. */
static int get(int fd, struct dlpc__rx *rx, struct dlpc__frame *f)
{
	char why[160];

	for (int tries = 0; tries < PATIENCE; tries++) {
		int r = dlpc__rx_next(rx, f, why, sizeof(why));
		ssize_t n;

		ck_assert_msg(r >= 0, "bad frame from the daemon: %s", why);
		if (r > 0)
			return 1;
		n = dlpc__rx_read(rx, fd, why, sizeof(why));
		if (n == 0)
			return 0;
		ck_assert_msg(n > 0 || n == -EAGAIN, "read: %s", strerror((int)-n));
		if (n == -EAGAIN) {
			turn(1);
			if (tries > 100)
				usleep(1000);
		}
	}
	ck_abort_msg("the daemon sent nothing within %d turns", PATIENCE);
	return -1;
}

/* The next frame must be an ERROR with @p code. */
static void get_error(int fd, struct dlpc__rx *rx, uint32_t code)
{
	struct dlpc__frame f;
	Dlpackd__V1__Error *e;

	ck_assert_int_eq(get(fd, rx, &f), 1);
	ck_assert_uint_eq(f.hdr.type, DLPC_MSG_ERROR);
	e = dlpackd__v1__error__unpack(NULL, f.hdr.len, f.payload);
	ck_assert_ptr_nonnull(e);
	ck_assert_msg((uint32_t)e->code == code, "ERROR %d (%s), expected %u", e->code, e->message,
		      code);
	dlpackd__v1__error__free_unpacked(e, NULL);
	dlpc__frame_clear(&f);
}

/* Nothing more comes: the daemon closed the connection. Closes @p fd. */
static void get_eof(int fd, struct dlpc__rx *rx)
{
	struct dlpc__frame f;
	int r = get(fd, rx, &f);

	if (r > 0)
		dlpc__frame_clear(&f);
	ck_assert_msg(r == 0, "a frame of type 0x%x where the end was expected", f.hdr.type);
	dlpc__rx_clear(rx);
	close(fd);
}

static void hello(int fd, struct dlpc__rx *rx)
{
	Dlpackd__V1__Hello h = DLPACKD__V1__HELLO__INIT;
	struct dlpc__frame f;

	h.version_major = DLPC_PROTO_MAJOR;
	h.version_minor = DLPC_PROTO_MINOR;
	h.client = "test_dispatch";
	put_msg(fd, DLPC_MSG_HELLO, 1, &h.base, NULL, 0);
	ck_assert_int_eq(get(fd, rx, &f), 1);
	ck_assert_uint_eq(f.hdr.type, DLPC_MSG_HELLO | DLPC_MSG_REPLY);
	dlpc__frame_clear(&f);
}

/* Fill the socket from the daemon's end @p dend towards the client with junk; its size. */
static size_t fill(int dend)
{
	static const uint8_t junk[4096];
	size_t total = 0;
	ssize_t n;

	while ((n = send(dend, junk, sizeof(junk), MSG_DONTWAIT | MSG_NOSIGNAL)) > 0)
		total += (size_t)n;
	ck_assert_int_eq(errno, EAGAIN);
	return total;
}

/* Read and discard @p len bytes of junk, letting the daemon run meanwhile. */
static void skip(int fd, size_t len)
{
	uint8_t buf[4096];

	for (int tries = 0; len > 0; tries++) {
		ssize_t n = read(fd, buf, len < sizeof(buf) ? len : sizeof(buf));

		ck_assert_int_lt(tries, PATIENCE);
		if (n < 0) {
			ck_assert_int_eq(errno, EAGAIN);
			turn(1);
			continue;
		}
		ck_assert_int_gt(n, 0);
		len -= (size_t)n;
	}
}

/* ---- the table: each row's rules, before HELLO and while watching ---- */

static const struct {
	uint16_t type;
	bool before_hello, while_watching;
} rows[] = {
#define X(NAME, name, type, max_len, min_fds, max_fds, before_hello, while_watching)               \
	{DLPC_MSG_##NAME, before_hello, while_watching},
	DLPC_REQUESTS(X)
#undef X
};

START_TEST(test_table_before_hello)
{
	struct dlpc__rx rx;
	int fd;

	if (rows[_i].before_hello)
		return;
	dlpc__rx_init(&rx);
	fd = client(NULL, 0, 0);
	put_empty(fd, rows[_i].type, 5);
	get_error(fd, &rx, EPROTO);
	get_eof(fd, &rx);
	ck_assert_uint_eq(srv.stats.protocol_errors, 1);
	ck_assert_uint_eq(srv.stats.req[rows[_i].type], 0);
}
END_TEST

START_TEST(test_table_while_watching)
{
	Dlpackd__V1__Watch w = DLPACKD__V1__WATCH__INIT;
	struct dlpc__frame f;
	struct dlpc__rx rx;
	int fd;

	if (rows[_i].while_watching)
		return;
	dlpc__rx_init(&rx);
	fd = client(NULL, 0, 0);
	hello(fd, &rx);
	put_msg(fd, DLPC_MSG_WATCH, 2, &w.base, NULL, 0);
	ck_assert_int_eq(get(fd, &rx, &f), 1);
	ck_assert_uint_eq(f.hdr.type, DLPC_MSG_WATCH | DLPC_MSG_REPLY);
	dlpc__frame_clear(&f);
	put_empty(fd, rows[_i].type, 3);
	get_error(fd, &rx, EPROTO);
	get_eof(fd, &rx);
	ck_assert_uint_eq(srv.nwatchers, 0);
}
END_TEST

/* ---- teardown ---- */

/* Read every frame the socket holds now, without letting the daemon run; their types go to
 * @p types (at most @p max). The count, or -1 once the stream ended. */
static int grab(int fd, struct dlpc__rx *rx, uint16_t *types, int max)
{
	struct dlpc__frame f;
	char why[160];
	int n = 0;

	for (;;) {
		int r = dlpc__rx_next(rx, &f, why, sizeof(why));
		ssize_t got;

		ck_assert_msg(r >= 0, "bad frame from the daemon: %s", why);
		if (r > 0) {
			ck_assert_int_lt(n, max);
			types[n++] = f.hdr.type;
			dlpc__frame_clear(&f);
			continue;
		}
		got = dlpc__rx_read(rx, fd, why, sizeof(why));
		if (got == -EAGAIN)
			return n;
		/* a daemon that closes with the client's frames unread resets the stream */
		if (got == 0 || got == -ECONNRESET)
			return n > 0 ? n : -1;
		ck_assert_int_gt(got, 0);
	}
}

/*
 * A violation found while the output queue drains, with a frame carrying an fd still in the
 * socket from a client that then half-closed: the marked connection reads nothing more, and the
 * fd is closed with the socket. (That read used to go into a connection already torn down: its
 * 16 KiB buffer and the fd leaked.)
 */
START_TEST(test_no_read_after_mark)
{
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	Dlpackd__V1__Release rel = DLPACKD__V1__RELEASE__INIT;
	struct dlpc__rx rx;
	uint16_t types[256];
	int fd, spare = memfd_sealed(4096, 0), fit, n, stats = 0, errors = 0;

	dlpc__rx_init(&rx);
	fd = client(NULL, 4096, 4096);
	hello(fd, &rx);
	/* how many STAT replies the socket holds before the daemon's queue takes over */
	for (int i = 0; i < 64; i++)
		put_msg(fd, DLPC_MSG_STAT, 10, &st.base, NULL, 0);
	turn(10);
	fit = grab(fd, &rx, types, 256);
	ck_assert_int_gt(fit, 0);
	ck_assert_int_lt(fit, 62);
	for (n = fit; n < 64; turn(1))
		n += grab(fd, &rx, types, 256);

	/* two STATs more than fit, then a violation: the daemon stops at the queue */
	for (int i = 0; i < fit + 2; i++)
		put_msg(fd, DLPC_MSG_STAT, 20, &st.base, NULL, 0);
	put_empty(fd, 0x77, 99);
	turn(10);
	/* the daemon holds back; this frame and its fd wait in the socket */
	put_msg(fd, DLPC_MSG_RELEASE, 0, &rel.base, &spare, 1);
	close(spare);
	shutdown(fd, SHUT_WR);
	/* the queue drains and the violation is found in one loop turn */
	while ((n = grab(fd, &rx, types, 256)) >= 0) {
		for (int i = 0; i < n; i++) {
			stats += types[i] == (DLPC_MSG_STAT | DLPC_MSG_REPLY);
			errors += types[i] == DLPC_MSG_ERROR;
		}
		turn(1);
	}
	ck_assert_int_eq(stats, fit + 2);
	ck_assert_int_eq(errors, 1);
	dlpc__rx_clear(&rx);
	close(fd);
}
END_TEST

/*
 * A violation when the client's socket is full: the ERROR saying why waits in the queue and
 * leaves once the client reads. (It used to be dropped with the queue.)
 */
START_TEST(test_error_outlives_full_socket)
{
	struct dlpc__rx rx;
	int fd, dend;
	size_t junk;

	dlpc__rx_init(&rx);
	fd = client(&dend, 0, 0);
	hello(fd, &rx);
	junk = fill(dend);
	put_empty(fd, 0x77, 7);
	turn(10);
	/* marked, destroyed, and holding its last frame */
	ck_assert_uint_eq(srv.npeers, 0);
	ck_assert(!dlpd_list_empty(&srv.lingering));
	skip(fd, junk);
	get_error(fd, &rx, EPROTO);
	get_eof(fd, &rx);
}
END_TEST

/* A client that never reads its ERROR loses it after DLPC_ERROR_LINGER_MS, and the connection
 * goes; until then its socket and what is queued in it are charged to its uid (a uid could
 * otherwise make connection after connection linger, charged to nobody). */
START_TEST(test_linger_is_bounded)
{
	struct dlpc__rx rx;
	struct dlpd_usage *u;
	int fd, dend;

	dlpc__rx_init(&rx);
	fd = client(&dend, 0, 0);
	hello(fd, &rx);
	fill(dend);
	put_empty(fd, 0x77, 7);
	turn(10);
	ck_assert(!dlpd_list_empty(&srv.lingering));
	/* its socket, and the ERROR queued in it, are still its uid's: one fd, pending bytes */
	u = dlpd_usage_find(&srv.reg, getuid());
	ck_assert_ptr_nonnull(u);
	ck_assert_uint_eq(u->connections, 0);
	ck_assert_uint_eq(u->lingering, 1);
	ck_assert_uint_eq(dlpd_uid_fds(u), 1);
	ck_assert_uint_gt(u->pending_bytes, 0);
	/* the linger timer is all that keeps the loop alive now */
	for (int i = 0; i < 100 && srv.peers_closing > 0; i++)
		uv_run(&loop, UV_RUN_ONCE);
	ck_assert_uint_eq(srv.peers_closing, 0);
	ck_assert(dlpd_list_empty(&srv.lingering));
	/* and then nothing is: the uid's record goes with the last thing charged to it */
	ck_assert_ptr_null(dlpd_usage_find(&srv.reg, getuid()));
	dlpc__rx_clear(&rx);
	close(fd);
}
END_TEST

/*
 * A client that sends its requests and shuts down its sending side gets every reply, even
 * those that queue because it reads only afterwards. (They used to be dropped at the
 * hang-up.)
 */
START_TEST(test_half_closed_client_gets_replies)
{
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	struct dlpc__frame f;
	struct dlpc__rx rx;
	int fd, got = 0;

	dlpc__rx_init(&rx);
	fd = client(NULL, 4096, 4096);
	hello(fd, &rx);
	for (int i = 0; i < 300; i++)
		put_msg(fd, DLPC_MSG_STAT, 10 + i, &st.base, NULL, 0);
	shutdown(fd, SHUT_WR);
	/* the daemon sees the hang-up with replies still queued */
	turn(50);
	while (get(fd, &rx, &f) == 1) {
		ck_assert_uint_eq(f.hdr.type, DLPC_MSG_STAT | DLPC_MSG_REPLY);
		ck_assert_uint_eq(f.hdr.id, 10 + (uint32_t)got);
		dlpc__frame_clear(&f);
		got++;
	}
	ck_assert_int_eq(got, 300);
	dlpc__rx_clear(&rx);
	close(fd);
}
END_TEST

/* A name published by @p fd (host memory, one float), with @p flags; the reply's created_ns. */
static int64_t publish(int fd, struct dlpc__rx *rx, const char *name, uint32_t flags)
{
	Dlpackd__V1__PublishReply *rep;
	int64_t created;
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc t = DLPACKD__V1__TENSOR_DESC__INIT;
	Dlpackd__V1__TensorDesc *tp = &t;
	int64_t shape[1] = {1};
	int mfd = memfd_sealed(4096, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
	struct dlpc__frame f;

	t.dtype_code = kDLFloat;
	t.dtype_bits = 32;
	t.dtype_lanes = 1;
	t.n_shape = 1;
	t.shape = shape;
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.flags = flags;
	req.device_type = kDLCPU;
	req.storage_size = 4096;
	req.n_tensors = 1;
	req.tensors = &tp;
	put_msg(fd, DLPC_MSG_PUBLISH, 3, &req.base, &mfd, 1);
	close(mfd);
	ck_assert_int_eq(get(fd, rx, &f), 1);
	ck_assert_uint_eq(f.hdr.type, DLPC_MSG_PUBLISH | DLPC_MSG_REPLY);
	rep = dlpackd__v1__publish_reply__unpack(NULL, f.hdr.len, f.payload);
	ck_assert_ptr_nonnull(rep);
	created = rep->created_ns;
	dlpackd__v1__publish_reply__free_unpacked(rep, NULL);
	dlpc__frame_clear(&f);
	return created;
}

/* An UNPUBLISH of @p name; the reply's type (an ERROR's code in *code). */
static uint16_t unpublish(int fd, struct dlpc__rx *rx, const char *name, uint64_t generation,
			  int64_t created_ns, int *code)
{
	Dlpackd__V1__Unpublish req = DLPACKD__V1__UNPUBLISH__INIT;
	struct dlpc__frame f;
	uint16_t type;

	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.generation = generation;
	req.created_ns = created_ns;
	put_msg(fd, DLPC_MSG_UNPUBLISH, 4, &req.base, NULL, 0);
	ck_assert_int_eq(get(fd, rx, &f), 1);
	type = f.hdr.type;
	*code = 0;
	if (type == DLPC_MSG_ERROR) {
		Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, f.hdr.len, f.payload);

		ck_assert_ptr_nonnull(e);
		*code = e->code;
		dlpackd__v1__error__free_unpacked(e, NULL);
	}
	dlpc__frame_clear(&f);
	return type;
}

/* A name's entries never share a created_ns, also if the clock steps back (here: the newest
 * entry seems to come from an hour ahead): each publish gets one later than the last. */
START_TEST(test_created_ns_only_grows)
{
	struct dlpc__rx rx;
	struct timespec now;
	int64_t ahead, first, again;
	int fd, code;

	dlpc__rx_init(&rx);
	fd = client(NULL, 0, 0);
	hello(fd, &rx);
	clock_gettime(CLOCK_REALTIME, &now);
	ahead = ((int64_t)now.tv_sec + 3600) * 1000000000;
	srv.reg.last_created_ns = ahead;
	first = publish(fd, &rx, "n", 0);
	ck_assert_int_eq(first, ahead + 1);
	ck_assert_uint_eq(unpublish(fd, &rx, "n", 1, first, &code),
			  DLPC_MSG_UNPUBLISH | DLPC_MSG_REPLY);
	again = publish(fd, &rx, "n", 0);
	ck_assert_int_eq(again, ahead + 2);
	/* generation 1 again, but not the entry first was */
	ck_assert_uint_eq(unpublish(fd, &rx, "n", 1, first, &code), DLPC_MSG_ERROR);
	ck_assert_int_eq(code, ESTALE);
	ck_assert_uint_eq(srv.reg.names.count, 1);
	ck_assert_uint_eq(unpublish(fd, &rx, "n", 1, again, &code),
			  DLPC_MSG_UNPUBLISH | DLPC_MSG_REPLY);
	ck_assert_uint_eq(srv.reg.names.count, 0);
	dlpc__rx_clear(&rx);
	close(fd);
}
END_TEST

/*
 * A publisher's ephemeral entries vanish with it while a watcher that does not read overflows:
 * both connections are destroyed in the same pass, in either order, and nothing is left.
 */
START_TEST(test_watcher_overflows_during_teardown)
{
	Dlpackd__V1__Watch w = DLPACKD__V1__WATCH__INIT;
	struct dlpc__rx wrx, prx;
	struct dlpc__frame f;
	int wfd, pfd, wend;
	char name[32];

	lim.watch_queue_bytes = 768;
	srv.lim = lim;
	dlpc__rx_init(&wrx);
	dlpc__rx_init(&prx);
	wfd = client(&wend, 0, 0);
	hello(wfd, &wrx);
	put_msg(wfd, DLPC_MSG_WATCH, 2, &w.base, NULL, 0);
	ck_assert_int_eq(get(wfd, &wrx, &f), 1);
	dlpc__frame_clear(&f);
	fill(wend);
	pfd = client(NULL, 0, 0);
	hello(pfd, &prx);
	for (int i = 0; i < 8; i++) {
		snprintf(name, sizeof(name), "eph/%d", i);
		publish(pfd, &prx, name, DLPC_PUBLISH_EPHEMERAL);
	}
	ck_assert_uint_eq(srv.reg.names.count, 8);
	/* the watcher holds the publish events, within its limit; the removals will not fit */
	ck_assert_uint_eq(srv.nwatchers, 1);
	ck_assert_uint_eq(srv.stats.queue_drops, 0);
	close(pfd);
	dlpc__rx_clear(&prx);
	turn(20);
	ck_assert_uint_eq(srv.reg.names.count, 0);
	ck_assert_uint_eq(srv.reg.storages, 0);
	ck_assert_uint_eq(srv.stats.queue_drops, 1);
	ck_assert_uint_eq(srv.npeers, 0);
	ck_assert_uint_eq(srv.reg.uids.count, 0);
	dlpc__rx_clear(&wrx);
	close(wfd);
}
END_TEST

/* Entries outlive their publisher unless ephemeral; the server frees the rest at stop. */
START_TEST(test_entries_freed_at_stop)
{
	struct dlpc__rx rx;
	int fd;

	dlpc__rx_init(&rx);
	fd = client(NULL, 0, 0);
	hello(fd, &rx);
	publish(fd, &rx, "kept", 0);
	publish(fd, &rx, "gone", DLPC_PUBLISH_EPHEMERAL);
	close(fd);
	dlpc__rx_clear(&rx);
	turn(10);
	ck_assert_uint_eq(srv.npeers, 0);
	ck_assert_uint_eq(srv.reg.names.count, 1);
	ck_assert_uint_eq(srv.reg.storages, 1);
}
END_TEST

/* A memfd of @p size bytes, every page allocated, as a storage that passed storage.c is. */
static int storage_fd(size_t size)
{
	int fd = memfd_create("test-storage", MFD_CLOEXEC);

	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
	ck_assert_int_eq(fallocate(fd, 0, 0, (off_t)size), 0);
	return fd;
}

/* A storage of at most DLPD_CLOSE_INLINE_BYTES is closed at once, on the calling thread; a
 * larger one goes to a reaper, which closes it before dlpd_reaper_stop() returns. */
START_TEST(test_close_storage_inline)
{
	size_t handed;
	int fd;

	ck_assert_int_eq(dlpd_reaper_start(), 0);
	handed = dlpd_reaper_handed();
	fd = storage_fd(DLPD_CLOSE_INLINE_BYTES);
	dlpd_close_storage(fd);
	ck_assert_uint_eq(dlpd_reaper_handed(), handed);
	ck_assert_int_eq(fcntl(fd, F_GETFD), -1);
	ck_assert_int_eq(errno, EBADF);

	fd = storage_fd(DLPD_CLOSE_INLINE_BYTES + 4096);
	dlpd_close_storage(fd);
	ck_assert_uint_eq(dlpd_reaper_handed(), handed + 1);
	dlpd_reaper_stop();
	ck_assert_uint_eq(dlpd_reaper_pending(), 0);
	ck_assert_int_eq(fcntl(fd, F_GETFD), -1);
	ck_assert_int_eq(errno, EBADF);
}
END_TEST

static Suite *dispatch_suite(void)
{
	Suite *s = suite_create("dispatch");
	TCase *tc;
	int nrows = (int)(sizeof(rows) / sizeof(rows[0]));

	tc = tcase_create("table");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_loop_test(tc, test_table_before_hello, 0, nrows);
	tcase_add_loop_test(tc, test_table_while_watching, 0, nrows);
	suite_add_tcase(s, tc);

	tc = tcase_create("teardown");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_no_read_after_mark);
	tcase_add_test(tc, test_error_outlives_full_socket);
	tcase_add_test(tc, test_linger_is_bounded);
	tcase_add_test(tc, test_half_closed_client_gets_replies);
	tcase_add_test(tc, test_watcher_overflows_during_teardown);
	tcase_add_test(tc, test_entries_freed_at_stop);
	tcase_add_test(tc, test_created_ns_only_grows);
	suite_add_tcase(s, tc);

	tc = tcase_create("reaper");
	tcase_add_test(tc, test_close_storage_inline);
	suite_add_tcase(s, tc);
	return s;
}

int main(int argc, char **argv)
{
	uv_loop_t once;

	(void)argc;
#ifndef DLPC_TEST_ASAN
	if (!getenv("DLPC_TEST_NO_TCACHE")) {
		setenv("DLPC_TEST_NO_TCACHE", "1", 1);
		setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0", 1);
		execv("/proc/self/exe", argv);
		perror("test_dispatch: cannot re-execute itself");
		return EXIT_FAILURE;
	}
#endif
	signal(SIGPIPE, SIG_IGN);
	if (!getenv("DLPC_TEST_LOG"))
		dlpd_log_level = LOG_EMERG - 1;
	/* libuv opens what it keeps for the process's life with the first loop: before any case
	 * counts fds */
	uv_loop_init(&once);
	uv_loop_close(&once);
	return run_suite(dispatch_suite());
}
