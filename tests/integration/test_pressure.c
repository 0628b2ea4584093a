/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Clients under pressure: a client out of fds, a daemon that stops answering (SIGSTOP), a socket
 * that accepts and never answers, and dlpc_close() while other threads wait. Each failure is
 * clean and local: the call fails with its own code, the same connection goes on working, the
 * daemon gets back every reference the client could not take, and afterwards a good client is
 * unaffected and the daemon's fds and STAT figures are back at their baseline.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>

#include "raw.h"

static struct daemon D;

static void setup(void)
{
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static bool error_says(const char *text)
{
	return strstr(dlpc_last_error(), text) != NULL;
}

/* In a child: poll STAT on @p c until the references are @p refs (true) or 10 s pass. */
static bool refs_become(dlpc_client *c, uint64_t refs)
{
	long long deadline = now_ms() + scaled_ms(10000);

	for (;;) {
		dlpc_stats s = {.size = sizeof(s)};

		if (dlpc_stat(c, &s) == 0 && s.references == refs)
			return true;
		if (now_ms() > deadline)
			return false;
		usleep(2000);
	}
}

static uint64_t refs_of(dlpc_client *c)
{
	dlpc_stats s = {.size = sizeof(s)};

	CHILD_CHECK(dlpc_stat(c, &s) == 0);
	return s.references;
}

/* 64 bytes 0..63 as "one", and a bundle of three 16-element tensors as "bundle". */
static void publish_fixtures(dlpc_client *c)
{
	static uint8_t one[64];
	static uint32_t parts[3][16];
	const char *keys[3] = {"a", "b", "c"};
	DLManagedTensorVersioned *ts[3];
	int64_t n64[1] = {64}, n16[1] = {16};

	for (int i = 0; i < 64; i++)
		one[i] = (uint8_t)i;
	for (int k = 0; k < 3; k++) {
		for (int i = 0; i < 16; i++)
			parts[k][i] = (uint32_t)(k * 1000 + i);
		ts[k] = host_tensor(parts[k], (DLDataType){kDLUInt, 32, 1}, 1, n16, NULL, NULL);
	}
	ck_assert_dlpc(
		dlpc_publish(c, "one",
			     host_tensor(one, (DLDataType){kDLUInt, 8, 1}, 1, n64, NULL, NULL), 0),
		1);
	ck_assert_dlpc(dlpc_publish_bundle(c, "bundle", 3, keys, ts, 0), 1);
}

static bool one_ok(const DLManagedTensorVersioned *t)
{
	for (int i = 0; i < 64; i++)
		if (((const uint8_t *)t->dl_tensor.data)[i] != i)
			return false;
	return true;
}

/* ---- 1. a client at its fd limit ---- */

/* Open fds until the soft limit, lowered to @p limit, is reached; their count. */
static int fill_fd_table(int *fds, int cap, rlim_t limit)
{
	struct rlimit rl;
	int n = 0;

	CHILD_CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
	rl.rlim_cur = limit;
	CHILD_CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
	for (int fd; (fd = dup(STDERR_FILENO)) >= 0;) {
		CHILD_CHECK(n < cap);
		fds[n++] = fd;
	}
	CHILD_CHECK(errno == EMFILE);
	return n;
}

static int attach_at_fd_limit(void *arg)
{
	dlpc_attach_opts wait = {.size = sizeof(wait), .timeout_ms = 5000};
	const struct daemon *d = arg;
	DLManagedTensorVersioned *t = NULL;
	dlpc_bundle *b = NULL;
	int fill[128], n, fds0;
	dlpc_client *c;
	uint64_t refs0;

	CHILD_CHECK(dlpc_connect(d->sock, &c) == 0);
	fds0 = fd_count(getpid());
	refs0 = refs_of(c);
	n = fill_fd_table(fill, 128, 64);

	/* the reply's fd cannot be installed: -EMFILE naming the limit, the reference given back */
	CHILD_CHECK(dlpc_attach(c, "one", NULL, &t) == -EMFILE);
	CHILD_CHECK(t == NULL);
	CHILD_CHECK(error_says("cannot attach 'one'") && error_says("RLIMIT_NOFILE") &&
		    error_says("limit of 64 open files"));
	CHILD_CHECK(refs_become(c, refs0));
	/* a waiting attach, answered at once because the name is there, the same */
	CHILD_CHECK(dlpc_attach(c, "one", &wait, &t) == -EMFILE);
	CHILD_CHECK(dlpc_attach_bundle(c, "bundle", NULL, &b) == -EMFILE);
	CHILD_CHECK(b == NULL);
	CHILD_CHECK(error_says("cannot attach 'bundle'") && error_says("limit of 64 open files"));
	CHILD_CHECK(refs_become(c, refs0));

	/* one fd free again: the same connection attaches both */
	close(fill[--n]);
	CHILD_CHECK(dlpc_attach(c, "one", NULL, &t) == 1);
	CHILD_CHECK(one_ok(t));
	CHILD_CHECK(refs_of(c) == refs0 + 1);
	t->deleter(t);
	CHILD_CHECK(dlpc_attach_bundle(c, "bundle", NULL, &b) == 1);
	CHILD_CHECK(dlpc_bundle_count(b) == 3 && strcmp(dlpc_bundle_key(b, 2), "c") == 0);
	t = dlpc_bundle_take(b, 2);
	CHILD_CHECK(((const uint32_t *)t->dl_tensor.data)[5] == 2005);
	t->deleter(t);
	dlpc_bundle_free(b);
	while (n > 0)
		close(fill[--n]);
	CHILD_CHECK(refs_become(c, refs0));
	CHILD_CHECK(fd_count(getpid()) == fds0);
	dlpc_close(c);
	return 0;
}

/* A receiver at its fd limit: dlpc_recv fails with -EMFILE before it takes a message, which
 * stays queued (delivery is at most once: a message whose fd could not be installed would be
 * lost), and gets it once an fd is free. */
static int recv_at_fd_limit(void *arg)
{
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	dlpc_recv_opts wait = {.size = sizeof(wait), .timeout_ms = 5000};
	dlpc_channel_info info = {.size = sizeof(info)};
	const struct daemon *d = arg;
	DLManagedTensorVersioned *t = NULL;
	static uint8_t v[64];
	int64_t n64[1] = {64};
	dlpc_bundle *b = NULL;
	int fill[128], n, fds0;
	dlpc_client *c;

	for (int i = 0; i < 64; i++)
		v[i] = (uint8_t)i;
	CHILD_CHECK(dlpc_connect(d->sock, &c) == 0);
	CHILD_CHECK(dlpc_channel_open(c, "fdq", 4, NULL) >= 0);
	CHILD_CHECK(dlpc_send(c, "fdq",
			      host_tensor(v, (DLDataType){kDLUInt, 8, 1}, 1, n64, NULL, NULL),
			      0) == 0);
	fds0 = fd_count(getpid());
	n = fill_fd_table(fill, 128, 64);

	CHILD_CHECK(dlpc_recv(c, "fdq", &now, &t) == -EMFILE);
	CHILD_CHECK(t == NULL);
	CHILD_CHECK(error_says("cannot receive from channel 'fdq'") &&
		    error_says("limit of 64 open files") && error_says("left queued"));
	CHILD_CHECK(dlpc_recv(c, "fdq", &wait, &t) == -EMFILE);
	CHILD_CHECK(dlpc_recv_bundle(c, "fdq", &now, &b) == -EMFILE);
	CHILD_CHECK(dlpc_channel_stat(c, "fdq", &info) == 0);
	CHILD_CHECK(info.depth == 1 && info.received == 0);

	close(fill[--n]);
	CHILD_CHECK(dlpc_recv(c, "fdq", &now, &t) == 0);
	CHILD_CHECK(one_ok(t));
	t->deleter(t);
	while (n > 0)
		close(fill[--n]);
	CHILD_CHECK(dlpc_channel_stat(c, "fdq", &info) == 0);
	CHILD_CHECK(info.depth == 0 && info.received == 1);
	CHILD_CHECK(dlpc_channel_remove(c, "fdq") == 0);
	CHILD_CHECK(fd_count(getpid()) == fds0);
	dlpc_close(c);
	return 0;
}

START_TEST(test_fd_limit)
{
	int baseline;

	good_client_start(&D);
	publish_fixtures(good_client());
	baseline = good_baseline();
	ck_assert_int_eq(wait_child(spawn(attach_at_fd_limit, &D)), 0);
	ck_assert_int_eq(wait_child(spawn(recv_at_fd_limit, &D)), 0);
	good_client_check();
	expect_fds(baseline);
	ck_assert_uint_eq(stat_or_die(good_client()).protocol_errors, 0);
	good_client_stop();
}
END_TEST

/* ---- 5. a daemon that stops answering ---- */

static int against_stopped_daemon(void *arg)
{
	dlpc_attach_opts wait = {.size = sizeof(wait), .timeout_ms = 300};
	const struct daemon *d = arg;
	int bound = scaled_ms(500), fds0;
	static uint8_t late[64];
	int64_t n64[1] = {64};
	DLManagedTensorVersioned *t = NULL, *p;
	dlpc_stats s = {.size = sizeof(s)};
	dlpc_bundle *b = NULL;
	dlpc_client *c;
	int deleted = 0;
	uint64_t refs0;
	long long t0;
	char env[24];

	snprintf(env, sizeof(env), "%d", bound);
	CHILD_CHECK(setenv("DLPC_CALL_TIMEOUT_MS", env, 1) == 0);
	CHILD_CHECK(dlpc_connect(d->sock, &c) == 0);
	fds0 = fd_count(getpid());
	refs0 = refs_of(c);
	for (int i = 0; i < 64; i++)
		late[i] = (uint8_t)(255 - i);
	p = host_tensor(late, (DLDataType){kDLUInt, 8, 1}, 1, n64, NULL, &deleted);

	CHILD_CHECK(kill(d->pid, SIGSTOP) == 0);
	/* a waiting attach gives up after its own 300 ms plus the grace, not never */
	t0 = now_ms();
	CHILD_CHECK(dlpc_attach(c, "one", &wait, &t) == -ETIMEDOUT);
	CHILD_CHECK(now_ms() - t0 < 10000);
	CHILD_CHECK(t == NULL);
	CHILD_CHECK(error_says("did not answer ATTACH within 1300 ms"));
	/* calls without a timeout of their own: DLPC_CALL_TIMEOUT_MS */
	t0 = now_ms();
	CHILD_CHECK(dlpc_stat(c, &s) == -ETIMEDOUT);
	CHILD_CHECK(now_ms() - t0 < bound + 10000);
	CHILD_CHECK(error_says("DLPC_CALL_TIMEOUT_MS"));
	/* an attach that does not wait (timeout 0) is such a call too */
	t0 = now_ms();
	CHILD_CHECK(dlpc_attach_bundle(c, "bundle", NULL, &b) == -ETIMEDOUT);
	CHILD_CHECK(now_ms() - t0 < bound + 10000);
	CHILD_CHECK(b == NULL && error_says("did not answer ATTACH"));
	/* a publish too: the library's ownership of the tensor ends as on any failure */
	t0 = now_ms();
	CHILD_CHECK(dlpc_publish(c, "late", p, 0) == -ETIMEDOUT);
	CHILD_CHECK(now_ms() - t0 < bound + 10000);
	CHILD_CHECK(deleted == 1);
	CHILD_CHECK(kill(d->pid, SIGCONT) == 0);

	/* the same connection goes on: each call gets its own reply, the late ones are dropped
	 * (the ATTACH replies' references given back, their fds closed) */
	CHILD_CHECK(dlpc_stat(c, &s) == 0);
	CHILD_CHECK(s.daemon_pid == (uint32_t)d->pid);
	CHILD_CHECK(refs_become(c, refs0));
	/* a publish that timed out may still have taken effect: this one did */
	CHILD_CHECK(dlpc_attach(c, "late", NULL, &t) == 1);
	CHILD_CHECK(((const uint8_t *)t->dl_tensor.data)[0] == 255);
	t->deleter(t);
	CHILD_CHECK(dlpc_attach(c, "one", &wait, &t) == 1);
	CHILD_CHECK(one_ok(t));
	t->deleter(t);
	CHILD_CHECK(dlpc_unpublish(c, "late") == 0);
	CHILD_CHECK(refs_become(c, refs0));
	CHILD_CHECK(fd_count(getpid()) == fds0);
	dlpc_close(c);
	return 0;
}

START_TEST(test_stopped_daemon)
{
	dlpc_stats before, after;
	int baseline, st;

	good_client_start(&D);
	publish_fixtures(good_client());
	baseline = good_baseline();
	before = stat_or_die(good_client());
	st = wait_child(spawn(against_stopped_daemon, &D));
	kill(D.pid, SIGCONT); /* whatever became of the child */
	ck_assert_int_eq(st, 0);
	good_client_check();
	expect_fds(baseline);
	after = stat_or_die(good_client());
	ck_assert_uint_eq(after.entries, before.entries);
	ck_assert_uint_eq(after.bytes_held, before.bytes_held);
	ck_assert_uint_eq(after.waiters, 0);
	ck_assert_uint_eq(after.protocol_errors, 0);
	good_client_stop();
}
END_TEST

/* ---- 5. a socket that accepts and never answers ---- */

struct mute {
	int listener, conn;
};

static void *accept_and_hold(void *arg)
{
	struct mute *m = arg;

	m->conn = accept4(m->listener, NULL, NULL, SOCK_CLOEXEC);
	return NULL;
}

static int connect_to_mute_socket(void *arg)
{
	const struct daemon *d = arg;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct mute m = {.conn = -1};
	dlpc_client *c = NULL;
	pthread_t th;
	long long t0;
	int fds0;

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/mute.sock", d->dir);
	m.listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	CHILD_CHECK(m.listener >= 0);
	CHILD_CHECK(bind(m.listener, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	CHILD_CHECK(listen(m.listener, 8) == 0);
	CHILD_CHECK(pthread_create(&th, NULL, accept_and_hold, &m) == 0);
	fds0 = fd_count(getpid());

	CHILD_CHECK(setenv("DLPC_CALL_TIMEOUT_MS", "300", 1) == 0);
	t0 = now_ms();
	CHILD_CHECK(dlpc_connect(sa.sun_path, &c) == -ETIMEDOUT);
	CHILD_CHECK(now_ms() - t0 < 10000);
	CHILD_CHECK(c == NULL);
	CHILD_CHECK(error_says(sa.sun_path) && error_says("did not answer HELLO within 300 ms"));
	CHILD_CHECK(pthread_join(th, NULL) == 0);
	CHILD_CHECK(m.conn >= 0);
	close(m.conn);
	/* the client's socket and eventfd are gone again */
	CHILD_CHECK(fd_count(getpid()) == fds0);

	/* a value that is not a number of milliseconds is refused, not ignored */
	CHILD_CHECK(setenv("DLPC_CALL_TIMEOUT_MS", "3s", 1) == 0);
	CHILD_CHECK(dlpc_connect(d->sock, &c) == -EINVAL);
	CHILD_CHECK(error_says("DLPC_CALL_TIMEOUT_MS='3s'"));
	/* 0: no bound; the real daemon answers */
	CHILD_CHECK(setenv("DLPC_CALL_TIMEOUT_MS", "0", 1) == 0);
	CHILD_CHECK(dlpc_connect(d->sock, &c) == 0);
	dlpc_close(c);
	CHILD_CHECK(fd_count(getpid()) == fds0);
	close(m.listener);
	unlink(sa.sun_path);
	return 0;
}

START_TEST(test_mute_socket)
{
	int baseline;

	good_client_start(&D);
	baseline = good_baseline();
	ck_assert_int_eq(wait_child(spawn(connect_to_mute_socket, &D)), 0);
	good_client_check();
	expect_fds(baseline);
	good_client_stop();
}
END_TEST

/* A socket that accepts and closes every connection at once, without a word (not dlpackd, or
 * one that never answers), with no call timeout: dlpc_connect() takes the first few closes for
 * an upgrade's, then gives up after DLPC_RECONNECT_DROPS_MAX of them rather than trying
 * forever. (alarm() only ends a child that would hang.) */
static void *accept_and_close(void *arg)
{
	int listener = *(int *)arg;

	for (;;) {
		int fd = accept4(listener, NULL, NULL, SOCK_CLOEXEC);

		if (fd >= 0)
			close(fd);
	}
	return NULL;
}

static int connect_to_slamming_socket(void *arg)
{
	const struct daemon *d = arg;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	dlpc_client *c = NULL;
	pthread_t th;
	int listener, r;

	alarm(40);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/slam.sock", d->dir);
	listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	CHILD_CHECK(listener >= 0);
	CHILD_CHECK(bind(listener, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	CHILD_CHECK(listen(listener, 8) == 0);
	CHILD_CHECK(pthread_create(&th, NULL, accept_and_close, &listener) == 0);
	CHILD_CHECK(setenv("DLPC_CALL_TIMEOUT_MS", "0", 1) == 0);
	r = dlpc_connect(sa.sun_path, &c);
	CHILD_CHECK(r == -ECONNRESET || r == -EPIPE);
	CHILD_CHECK(c == NULL);
	CHILD_CHECK(error_says(sa.sun_path) && error_says("DLPC_RECONNECT_DROPS_MAX"));
	unlink(sa.sun_path);
	return 0;
}

START_TEST(test_slamming_socket)
{
	ck_assert_int_eq(wait_child(spawn(connect_to_slamming_socket, &D)), 0);
}
END_TEST

/* ---- 6. dlpc_close() while threads wait ---- */

struct waiter {
	dlpc_client *c;
	const char *name;
	int r;
	char msg[512];
};

static void *wait_forever(void *arg)
{
	dlpc_attach_opts forever = {.size = sizeof(forever), .timeout_ms = -1};
	struct waiter *w = arg;
	DLManagedTensorVersioned *t = NULL;

	w->r = dlpc_attach(w->c, w->name, &forever, &t);
	snprintf(w->msg, sizeof(w->msg), "%s", dlpc_last_error());
	if (t)
		t->deleter(t);
	return NULL;
}

static bool waiters_become(dlpc_client *probe, uint64_t n)
{
	long long deadline = now_ms() + scaled_ms(10000);

	for (;;) {
		dlpc_stats s = {.size = sizeof(s)};

		if (dlpc_stat(probe, &s) == 0 && s.waiters == n)
			return true;
		if (now_ms() > deadline)
			return false;
		usleep(2000);
	}
}

static int close_wakes_waiters(void *arg)
{
	const struct daemon *d = arg;
	struct waiter w[4];
	pthread_t th[4];
	DLManagedTensorVersioned *held;
	dlpc_client *kept, *lone, *probe;
	static uint8_t bytes[64];
	int64_t n64[1] = {64};
	uint64_t refs0;
	int fds0;

	CHILD_CHECK(dlpc_connect(d->sock, &probe) == 0);
	fds0 = fd_count(getpid());
	refs0 = refs_of(probe);
	/* "kept" holds a tensor, so its connection outlives dlpc_close(); "lone" holds nothing,
	 * so its last reference is the waiting thread's own */
	CHILD_CHECK(dlpc_connect(d->sock, &kept) == 0);
	CHILD_CHECK(dlpc_connect(d->sock, &lone) == 0);
	CHILD_CHECK(dlpc_attach(kept, "one", NULL, &held) == 1);
	for (int i = 0; i < 4; i++) {
		w[i] = (struct waiter){.c = i < 3 ? kept : lone, .name = "cancel/later", .r = 1};
		CHILD_CHECK(pthread_create(&th[i], NULL, wait_forever, &w[i]) == 0);
	}
	CHILD_CHECK(waiters_become(probe, 4));

	dlpc_close(kept);
	dlpc_close(lone);
	for (int i = 0; i < 4; i++) {
		CHILD_CHECK(pthread_join(th[i], NULL) == 0);
		if (w[i].r != -ECANCELED || !strstr(w[i].msg, "cannot attach 'cancel/later'") ||
		    !strstr(w[i].msg, "dlpc_close()")) {
			fprintf(stderr, "waiter %d: %d (%s)\n", i, w[i].r, w[i].msg);
			_exit(1);
		}
	}
	/* lone is gone with its connection; kept's connection lives on for the held tensor, but
	 * its three waits leave the daemon at once: each call told it it gave up (CANCEL) */
	CHILD_CHECK(waiters_become(probe, 0));
	/* a publish now finds nobody waiting: nothing is sent to the closed client */
	for (int i = 0; i < 64; i++)
		bytes[i] = (uint8_t)i;
	CHILD_CHECK(
		dlpc_publish(probe, "cancel/later",
			     host_tensor(bytes, (DLDataType){kDLUInt, 8, 1}, 1, n64, NULL, NULL),
			     0) == 1);
	CHILD_CHECK(one_ok(held));
	held->deleter(held);
	CHILD_CHECK(refs_become(probe, refs0));
	CHILD_CHECK(dlpc_unpublish(probe, "cancel/later") == 0);
	CHILD_CHECK(fd_count(getpid()) == fds0);
	dlpc_close(probe);
	return 0;
}

START_TEST(test_close_cancels_waiters)
{
	int baseline;

	good_client_start(&D);
	publish_fixtures(good_client());
	baseline = good_baseline();
	ck_assert_int_eq(wait_child(spawn(close_wakes_waiters, &D)), 0);
	good_client_check();
	expect_fds(baseline);
	ck_assert_uint_eq(stat_or_die(good_client()).waiters, 0);
	good_client_stop();
}
END_TEST

/* ---- 6b. a wait the client gives up on leaves the daemon at once (CANCEL) ---- */

struct abandoning {
	dlpc_client *c;
	int kind;	   /* 0 an ATTACH, 1 a RECV, 2 a SEND: each waits without end */
	volatile int stop; /* the thread's interrupt check says to give up */
	int r;
};

static int stop_flag(void *arg)
{
	return __atomic_load_n(&((struct abandoning *)arg)->stop, __ATOMIC_RELAXED);
}

static void *wait_abandoned(void *arg)
{
	struct abandoning *a = arg;
	dlpc_attach_opts forever = {.size = sizeof(forever), .timeout_ms = -1};
	dlpc_recv_opts rforever = {.size = sizeof(rforever), .timeout_ms = -1};
	dlpc_send_opts sforever = {.size = sizeof(sforever), .timeout_ms = -1};
	DLManagedTensorVersioned *t = NULL;
	static uint8_t byte;
	int64_t one = 1;

	dlpc_set_interrupt(stop_flag, a);
	if (a->kind == 0)
		a->r = dlpc_attach(a->c, "abandon/never", &forever, &t);
	else if (a->kind == 1)
		a->r = dlpc_recv(a->c, "abandon/empty", &rforever, &t);
	else
		a->r = dlpc_send_bundle(
			a->c, "abandon/full", 1, NULL,
			(DLManagedTensorVersioned *[]){host_tensor(
				&byte, (DLDataType){kDLUInt, 8, 1}, 1, &one, NULL, NULL)},
			&sforever);
	if (t)
		t->deleter(t);
	return NULL;
}

/* Does @p probe see the three kinds of waits at @p n each (ATTACH waiters, receivers waiting
 * on abandon/empty, senders waiting on abandon/full), within a scaled 10 s? */
static bool waits_become(dlpc_client *probe, uint64_t n)
{
	long long deadline = now_ms() + scaled_ms(10000);
	dlpc_channel_info e = {.size = sizeof(e)}, f = {.size = sizeof(f)};
	dlpc_stats s = {.size = sizeof(s)};

	for (;;) {
		if (dlpc_stat(probe, &s) == 0 &&
		    dlpc_channel_stat(probe, "abandon/empty", &e) == 0 &&
		    dlpc_channel_stat(probe, "abandon/full", &f) == 0 && s.waiters == n &&
		    e.receivers_waiting == n && f.senders_waiting == n)
			return true;
		if (now_ms() > deadline) {
			fprintf(stderr,
				"waits: %llu attaches, %u receives, %u sends; expected %llu\n",
				(unsigned long long)s.waiters, e.receivers_waiting,
				f.senders_waiting, (unsigned long long)n);
			return false;
		}
		usleep(2000);
	}
}

/* An ATTACH, a RECV and a SEND wait without end on clients that stay open; each is given up
 * (the thread's interrupt check, then dlpc_cancel()), and the daemon drops the wait at once,
 * not when the connection closes: STAT and the channels' counts say so while the clients are
 * still connected. */
static int abandoned_waits_leave(void *arg)
{
	const struct daemon *d = arg;
	struct abandoning a[6];
	pthread_t th[6];
	dlpc_client *probe;
	static uint8_t byte;
	int64_t one = 1;
	uint64_t sent0;

	CHILD_CHECK(setenv("DLPC_CALL_TIMEOUT_MS", "0", 1) == 0);
	CHILD_CHECK(dlpc_connect(d->sock, &probe) == 0);
	CHILD_CHECK(dlpc_channel_open(probe, "abandon/empty", 1, NULL) == 1);
	CHILD_CHECK(dlpc_channel_open(probe, "abandon/full", 1, NULL) == 1);
	CHILD_CHECK(dlpc_send(probe, "abandon/full",
			      host_tensor(&byte, (DLDataType){kDLUInt, 8, 1}, 1, &one, NULL, NULL),
			      0) == 0);
	for (int round = 0; round < 2; round++) {
		for (int k = 0; k < 3; k++) {
			struct abandoning *x = &a[round * 3 + k];

			*x = (struct abandoning){.kind = k, .r = 1};
			CHILD_CHECK(dlpc_connect(d->sock, &x->c) == 0);
			CHILD_CHECK(pthread_create(&th[round * 3 + k], NULL, wait_abandoned, x) ==
				    0);
		}
		CHILD_CHECK(waits_become(probe, 1));
		sent0 = chan_or_die(probe, "abandon/full").sent;
		for (int k = 0; k < 3; k++) {
			struct abandoning *x = &a[round * 3 + k];

			if (round == 0)
				__atomic_store_n(&x->stop, 1, __ATOMIC_RELAXED);
			else
				dlpc_cancel(x->c);
			CHILD_CHECK(pthread_join(th[round * 3 + k], NULL) == 0);
			CHILD_CHECK(x->r == (round == 0 ? -EINTR : -ECANCELED));
		}
		/* gone from the daemon while the clients are still connected */
		CHILD_CHECK(waits_become(probe, 0));
		/* the abandoned SEND's message was never admitted */
		CHILD_CHECK(chan_or_die(probe, "abandon/full").depth == 1);
		CHILD_CHECK(chan_or_die(probe, "abandon/full").sent == sent0);
		/* an interrupted client goes on; a canceled one says so */
		for (int k = 0; k < 3; k++)
			CHILD_CHECK(dlpc_stat(a[round * 3 + k].c,
					      &(dlpc_stats){.size = sizeof(dlpc_stats)}) ==
				    (round == 0 ? 0 : -ECANCELED));
	}
	CHILD_CHECK(stat_or_die(probe).req_cancel >= 6);
	for (int i = 0; i < 6; i++)
		dlpc_close(a[i].c);
	CHILD_CHECK(dlpc_channel_remove(probe, "abandon/empty") == 0);
	CHILD_CHECK(dlpc_channel_remove(probe, "abandon/full") == 0);
	dlpc_close(probe);
	return 0;
}

START_TEST(test_abandoned_waits_leave)
{
	int baseline;

	good_client_start(&D);
	baseline = good_baseline();
	ck_assert_int_eq(wait_child(spawn(abandoned_waits_leave, &D)), 0);
	good_client_check();
	expect_fds(baseline);
	ck_assert_uint_eq(stat_or_die(good_client()).waiters, 0);
	good_client_stop();
}
END_TEST

/* ---- 7. interrupting a call: a check of the caller's, or dlpc_cancel() ---- */

static volatile sig_atomic_t got_usr1;

static void on_usr1(int sig)
{
	(void)sig;
	got_usr1 = 1;
}

static int stop_when_signalled(void *arg)
{
	(void)arg;
	return got_usr1;
}

static int never_stop(void *arg)
{
	__atomic_add_fetch((int *)arg, 1, __ATOMIC_RELAXED);
	return 0;
}

struct blocked {
	dlpc_client *c;
	dlpc_interrupt_fn fn;
	void *arg;
	bool attach; /* an attach that waits forever, else a STAT */
	int r;
	uint32_t daemon_pid;
	char msg[256];
};

static void *block(void *arg)
{
	dlpc_attach_opts forever = {.size = sizeof(forever), .timeout_ms = -1};
	dlpc_stats s = {.size = sizeof(s)};
	struct blocked *b = arg;
	DLManagedTensorVersioned *t = NULL;

	dlpc_set_interrupt(b->fn, b->arg);
	b->r = b->attach ? dlpc_attach(b->c, "interrupt/never", &forever, &t) : dlpc_stat(b->c, &s);
	b->daemon_pid = s.daemon_pid;
	snprintf(b->msg, sizeof(b->msg), "%s", dlpc_last_error());
	if (t)
		t->deleter(t);
	return NULL;
}

static int interrupt_against_stopped_daemon(void *arg)
{
	const struct daemon *d = arg;
	struct sigaction sa = {.sa_handler = on_usr1}; /* no SA_RESTART */
	struct blocked sig = {0}, patient = {0}, canceled = {.attach = true};
	dlpc_stats s = {.size = sizeof(s)};
	pthread_t th[3];
	int checks = 0, fds0;

	/* no bound of the library's own: what ends these calls is the test */
	CHILD_CHECK(setenv("DLPC_CALL_TIMEOUT_MS", "0", 1) == 0);
	CHILD_CHECK(sigaction(SIGUSR1, &sa, NULL) == 0);
	CHILD_CHECK(dlpc_connect(d->sock, &sig.c) == 0);
	CHILD_CHECK(dlpc_connect(d->sock, &patient.c) == 0);
	CHILD_CHECK(dlpc_connect(d->sock, &canceled.c) == 0);
	fds0 = fd_count(getpid());
	sig.fn = stop_when_signalled;
	patient.fn = never_stop;
	patient.arg = &checks;

	CHILD_CHECK(kill(d->pid, SIGSTOP) == 0);
	CHILD_CHECK(pthread_create(&th[0], NULL, block, &sig) == 0);
	CHILD_CHECK(pthread_create(&th[1], NULL, block, &patient) == 0);
	CHILD_CHECK(pthread_create(&th[2], NULL, block, &canceled) == 0);
	usleep(scaled_ms(500) * 1000);
	/* a signal interrupts the wait, and the thread's check says to give up */
	CHILD_CHECK(pthread_kill(th[0], SIGUSR1) == 0);
	CHILD_CHECK(pthread_join(th[0], NULL) == 0);
	if (sig.r != -EINTR || !strstr(sig.msg, "interrupted while waiting for dlpackd to "
						"answer STAT")) {
		fprintf(stderr, "interrupted stat: %d (%s)\n", sig.r, sig.msg);
		_exit(1);
	}
	/* every caller of a client at once, without closing it */
	dlpc_cancel(canceled.c);
	CHILD_CHECK(pthread_join(th[2], NULL) == 0);
	CHILD_CHECK(canceled.r == -ECANCELED && strstr(canceled.msg, "dlpc_cancel()"));
	CHILD_CHECK(dlpc_stat(canceled.c, &s) == -ECANCELED);
	dlpc_close(canceled.c);
	/* a check that says to go on: the call waits, looking at it every
	 * DLPC_INTERRUPT_CHECK_MS, and gets its answer once the daemon runs again */
	CHILD_CHECK(__atomic_load_n(&checks, __ATOMIC_RELAXED) > 0);
	CHILD_CHECK(kill(d->pid, SIGCONT) == 0);
	CHILD_CHECK(pthread_join(th[1], NULL) == 0);
	CHILD_CHECK(patient.r == 0 && patient.daemon_pid == (uint32_t)d->pid);
	/* the interrupted client goes on, its late reply dropped */
	CHILD_CHECK(dlpc_stat(sig.c, &s) == 0 && s.daemon_pid == (uint32_t)d->pid);
	dlpc_close(sig.c);
	dlpc_close(patient.c);
	CHILD_CHECK(fd_count(getpid()) < fds0);
	return 0;
}

START_TEST(test_interrupt_and_cancel)
{
	int baseline, st;

	good_client_start(&D);
	publish_fixtures(good_client());
	baseline = good_baseline();
	st = wait_child(spawn(interrupt_against_stopped_daemon, &D));
	kill(D.pid, SIGCONT); /* whatever became of the child */
	ck_assert_int_eq(st, 0);
	good_client_check();
	expect_fds(baseline);
	ck_assert_uint_eq(stat_or_die(good_client()).waiters, 0);
	good_client_stop();
}
END_TEST

/*
 * A check that says to give up has the last word, whatever came while it ran: here the reply
 * itself (read by a call the check makes on the same client) or a dlpc_cancel().
 */
struct meanwhile {
	dlpc_client *c;
	pid_t daemon;
	bool cancel; /* cancel the client, else let the daemon answer and read its replies */
	int runs;
};

static int stop_after_meanwhile(void *arg)
{
	struct meanwhile *m = arg;
	dlpc_stats s = {.size = sizeof(s)};

	if (m->runs++) /* only once: the call made below may run it too */
		return 0;
	if (m->cancel) {
		dlpc_cancel(m->c);
		return 1;
	}
	CHILD_CHECK(kill(m->daemon, SIGCONT) == 0);
	/* the daemon answers in order: this call reads the ATTACH reply first, then its own */
	CHILD_CHECK(dlpc_stat(m->c, &s) == 0);
	return 1;
}

static int interrupt_whatever_came(void *arg)
{
	const struct daemon *d = arg;
	dlpc_attach_opts forever = {.size = sizeof(forever), .timeout_ms = -1};
	struct meanwhile m = {.daemon = d->pid};
	DLManagedTensorVersioned *t = NULL;
	uint64_t refs0;
	int fds0;

	CHILD_CHECK(setenv("DLPC_CALL_TIMEOUT_MS", "0", 1) == 0);
	CHILD_CHECK(dlpc_connect(d->sock, &m.c) == 0);
	refs0 = refs_of(m.c);
	fds0 = fd_count(getpid());
	dlpc_set_interrupt(stop_after_meanwhile, &m);

	/* the ATTACH reply comes while the check runs: the call still ends with -EINTR, and
	 * the reference the reply grants goes back with its fd */
	CHILD_CHECK(kill(d->pid, SIGSTOP) == 0);
	CHILD_CHECK(dlpc_attach(m.c, "one", NULL, &t) == -EINTR && t == NULL);
	CHILD_CHECK(error_says("interrupted while waiting for dlpackd to answer ATTACH"));
	CHILD_CHECK(m.runs == 1);
	dlpc_set_interrupt(NULL, NULL);
	CHILD_CHECK(refs_become(m.c, refs0));
	CHILD_CHECK(fd_count(getpid()) == fds0);
	CHILD_CHECK(dlpc_attach(m.c, "one", NULL, &t) > 0 && one_ok(t));
	t->deleter(t);

	/* canceled while the check runs: still -EINTR, not -ECANCELED */
	m.cancel = true;
	m.runs = 0;
	dlpc_set_interrupt(stop_after_meanwhile, &m);
	CHILD_CHECK(dlpc_attach(m.c, "interrupt/never", &forever, &t) == -EINTR && t == NULL);
	CHILD_CHECK(m.runs == 1);
	dlpc_set_interrupt(NULL, NULL);
	CHILD_CHECK(dlpc_stat(m.c, &(dlpc_stats){.size = sizeof(dlpc_stats)}) == -ECANCELED);
	dlpc_close(m.c);
	CHILD_CHECK(fd_count(getpid()) < fds0);
	return 0;
}

START_TEST(test_interrupt_whatever_came)
{
	uint64_t refs;
	int baseline, st;

	good_client_start(&D);
	publish_fixtures(good_client());
	baseline = good_baseline();
	refs = stat_or_die(good_client()).references;
	st = wait_child(spawn(interrupt_whatever_came, &D));
	kill(D.pid, SIGCONT); /* whatever became of the child */
	ck_assert_int_eq(st, 0);
	good_client_check();
	expect_fds(baseline);
	ck_assert_uint_eq(stat_or_die(good_client()).references, refs);
	good_client_stop();
}
END_TEST

static Suite *pressure_suite(void)
{
	Suite *s = suite_create("pressure");
	TCase *tc = tcase_create("pressure");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, scaled_ms(60000) / 1000);
	tcase_add_test(tc, test_fd_limit);
	tcase_add_test(tc, test_stopped_daemon);
	tcase_add_test(tc, test_mute_socket);
	tcase_add_test(tc, test_slamming_socket);
	tcase_add_test(tc, test_close_cancels_waiters);
	tcase_add_test(tc, test_abandoned_waits_leave);
	tcase_add_test(tc, test_interrupt_and_cancel);
	tcase_add_test(tc, test_interrupt_whatever_came);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(pressure_suite());
}
