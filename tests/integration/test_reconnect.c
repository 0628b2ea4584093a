/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Clients riding through a daemon restart (DLPC_CONNECT_RECONNECT): the daemon is SIGKILLed
 * and a new one started on the same socket, with clients in this process and in others.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "harness.h"

#define NV 256

static struct daemon D;

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void setup(void)
{
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

/* SIGKILL the daemon; its socket file stays behind, refusing connections. */
static void daemon_kill(void)
{
	ck_assert_int_eq(kill(D.pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(D.pid, NULL, 0), D.pid);
}

/* A new daemon on the same socket, accepting connections. */
static void daemon_restart(void)
{
	long long deadline = now_ms() + scaled_ms(10000);
	dlpc_client *c;

	D.pid = daemon_spawn(D.sock, D.log);
	while (dlpc_connect(D.sock, &c) < 0) {
		ck_assert_msg(now_ms() < deadline, "the new dlpackd did not come up");
		usleep(5000);
	}
	dlpc_close(c);
}

static void fill(float *v, float base)
{
	for (int i = 0; i < NV; i++)
		v[i] = base + (float)i;
}

static int publish(dlpc_client *c, const char *name, float base, uint32_t flags)
{
	static float v[NV];
	int64_t shape[1] = {NV};

	fill(v, base);
	return dlpc_publish(c, name,
			    host_tensor(v, (DLDataType){kDLFloat, 32, 1}, 1, shape, NULL, NULL),
			    flags);
}

static bool holds(const DLManagedTensorVersioned *t, float base)
{
	float want[NV];

	fill(want, base);
	return t->dl_tensor.shape[0] == NV && memcmp(t->dl_tensor.data, want, sizeof(want)) == 0;
}

static int fds_now(void)
{
	return fd_count(getpid());
}

/* The first call after the kill fails, the next connects anew; a client without the flag
 * keeps failing. What was attached stays readable, and releasing it after the reconnect does
 * not release the reference of the same id that the new connection holds; the ephemeral entry
 * is gone. No fd is left behind. */
START_TEST(reconnect_next_call)
{
	DLManagedTensorVersioned *old = NULL, *fresh = NULL;
	dlpc_client *a, *b;
	dlpc_entry_info *e;
	dlpc_stats st;
	int fds = fds_now(), r;
	size_t n;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, 1u << 7, &a), -EINVAL);
	ck_assert_ptr_null(a);
	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &a), 0);
	ck_assert_dlpc(dlpc_connect(D.sock, &b), 0);
	ck_assert_uint_eq(dlpc_reconnects(a), 0);
	ck_assert_dlpc(publish(a, "r/eph", 1.0f, DLPC_PUBLISH_EPHEMERAL), 1);
	ck_assert_dlpc(publish(a, "r/old", 2.0f, 0), 1);
	ck_assert_dlpc(dlpc_attach(a, "r/old", NULL, &old), 1);

	daemon_kill();
	daemon_restart();
	r = dlpc_list(a, NULL, &e, &n);
	ck_assert_msg(r == -ECONNRESET || r == -EPIPE, "first call after the kill: %d", r);
	r = dlpc_list(b, NULL, &e, &n);
	ck_assert_msg(r == -ECONNRESET || r == -EPIPE, "first call without the flag: %d", r);
	/* the next call connects anew; without the flag the error stays */
	ck_assert_dlpc(dlpc_list(a, NULL, &e, &n), 0);
	ck_assert_uint_eq(n, 0); /* no store: a restart keeps nothing, the ephemeral entry least */
	dlpc_list_free(e, n);
	ck_assert_uint_eq(dlpc_reconnects(a), 1);
	ck_assert_int_lt(dlpc_list(b, NULL, &e, &n), 0);
	ck_assert_uint_eq(dlpc_reconnects(b), 0);
	dlpc_close(b);

	ck_assert(holds(old, 2.0f));
	ck_assert_dlpc(publish(a, "r/new", 3.0f, 0), 1);
	ck_assert_dlpc(dlpc_attach(a, "r/new", NULL, &fresh), 1);
	/* the old tensor's reference had the same id on the old connection */
	old->deleter(old);
	st = stat_or_die(a);
	st = stat_or_die(a); /* a deferred release goes with the next request: the first */
	ck_assert_uint_eq(st.references, 1);
	ck_assert(holds(fresh, 3.0f));
	fresh->deleter(fresh);
	st = stat_or_die(a);
	ck_assert_uint_eq(st.references, 0);
	dlpc_close(a);
	ck_assert_int_eq(fds_now(), fds);
}
END_TEST

struct waiter {
	const char *name;
	int64_t timeout_ms;
	int result;
	long long took_ms;
	char why[512];
	dlpc_client *c;
};

static void *wait_thread(void *arg)
{
	struct waiter *w = arg;
	DLManagedTensorVersioned *t = NULL;
	dlpc_attach_opts o = {.size = sizeof(o), .timeout_ms = w->timeout_ms};
	long long t0 = now_ms();

	w->result = dlpc_attach(w->c, w->name, &o, &t);
	w->took_ms = now_ms() - t0;
	snprintf(w->why, sizeof(w->why), "%s", w->result < 0 ? dlpc_last_error() : "");
	if (w->result > 0 && !holds(t, 7.0f))
		w->result = -EILSEQ;
	if (t)
		t->deleter(t);
	return NULL;
}

/* A process waiting for a name, bounded or not, across a kill and a restart. */
static int wait_in_child(void *arg)
{
	struct waiter *w = arg;
	pthread_t th;

	CHILD_CHECK(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &w->c) == 0);
	CHILD_CHECK(pthread_create(&th, NULL, wait_thread, w) == 0);
	CHILD_CHECK(pthread_join(th, NULL) == 0);
	CHILD_CHECK(w->result == 1);
	CHILD_CHECK(dlpc_reconnects(w->c) == 1);
	dlpc_close(w->c);
	return 0;
}

static bool waiters_are(const dlpc_stats *s, void *arg)
{
	return s->waiters == (uint64_t)(uintptr_t)arg;
}

START_TEST(waiting_attach_survives_restart)
{
	struct waiter bounded = {.name = "r/later", .timeout_ms = scaled_ms(20000)};
	struct waiter forever = {.name = "r/later", .timeout_ms = -1};
	dlpc_client *c = connect_or_die(&D);
	pid_t p1 = spawn(wait_in_child, &bounded), p2 = spawn(wait_in_child, &forever);

	ck_assert(wait_stat(c, waiters_are, (void *)2, scaled_ms(5000)));
	dlpc_close(c);
	daemon_kill();
	/* no daemon for a while: the waits go on */
	usleep(300000);
	daemon_restart();
	c = connect_or_die(&D);
	ck_assert_msg(wait_stat(c, waiters_are, (void *)2, scaled_ms(5000)),
		      "the waiting attaches did not come back");
	ck_assert_dlpc(publish(c, "r/later", 7.0f, 0), 1);
	ck_assert_int_eq(wait_child(p1), 0);
	ck_assert_int_eq(wait_child(p2), 0);
	dlpc_close(c);
}
END_TEST

/* A wait whose time runs out while no daemon answers fails with ETIMEDOUT, in its time. */
START_TEST(waiting_attach_times_out_while_down)
{
	struct waiter w = {.name = "r/never", .timeout_ms = 1500};
	dlpc_client *c = connect_or_die(&D);
	pthread_t th;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &w.c), 0);
	ck_assert_int_eq(pthread_create(&th, NULL, wait_thread, &w), 0);
	ck_assert(wait_stat(c, waiters_are, (void *)1, scaled_ms(5000)));
	dlpc_close(c);
	daemon_kill();
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_int_eq(w.result, -ETIMEDOUT);
	ck_assert_msg(w.took_ms >= 1400 && w.took_ms < 1500 + DLPC_CALL_GRACE_MS + scaled_ms(1000),
		      "gave up after %lld ms", w.took_ms);
	ck_assert_msg(strstr(w.why, "'r/never'") && strstr(w.why, "went away"), "message: %s",
		      w.why);
	dlpc_close(w.c);
	daemon_restart();
}
END_TEST

/* dlpc_cancel() ends a wait that is pausing between attempts to connect again. */
START_TEST(cancel_while_down)
{
	struct waiter w = {.name = "r/never", .timeout_ms = -1};
	dlpc_client *c = connect_or_die(&D);
	pthread_t th;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &w.c), 0);
	ck_assert_int_eq(pthread_create(&th, NULL, wait_thread, &w), 0);
	ck_assert(wait_stat(c, waiters_are, (void *)1, scaled_ms(5000)));
	dlpc_close(c);
	daemon_kill();
	usleep(500000);
	dlpc_cancel(w.c);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_int_eq(w.result, -ECANCELED);
	dlpc_close(w.c);
	daemon_restart();
}
END_TEST

static Suite *reconnect_suite(void)
{
	Suite *s = suite_create("reconnect");
	TCase *tc = tcase_create("restart");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	tcase_add_test(tc, reconnect_next_call);
	tcase_add_test(tc, waiting_attach_survives_restart);
	tcase_add_test(tc, waiting_attach_times_out_while_down);
	tcase_add_test(tc, cancel_while_down);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(reconnect_suite());
}
