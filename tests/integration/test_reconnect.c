/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Clients riding through a daemon restart (DLPC_CONNECT_RECONNECT): the daemon is SIGKILLed
 * and a new one started on the same socket, with clients in this process and in others; or
 * the socket is activated (a listening socket that no daemon accepts on yet, then one started
 * with it), or another server that speaks another protocol takes its place.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>

#include "cuda_api.h"
#include "harness.h"
#include "raw.h"

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

/* This process's fd count once it reaches @p want (within a scaled 5 s), or the last count: a
 * client's last reference may be the library thread's, which then closes its sockets. */
static int fds_settle(int want)
{
	long long deadline = now_ms() + scaled_ms(5000);
	int n;

	while ((n = fds_now()) != want && now_ms() < deadline)
		usleep(2000);
	return n;
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
	ck_assert_int_eq(fds_settle(fds), fds);
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

static bool conns_are(const dlpc_stats *s, void *arg)
{
	return s->connections == (uint64_t)(uintptr_t)arg;
}

static bool refs_are(const dlpc_stats *s, void *arg)
{
	return s->references == (uint64_t)(uintptr_t)arg;
}

/* ---- a socket activated while no daemon runs, and a server that is not dlpackd ---- */

/* A listening socket in place of the killed daemon's, as systemd holds it while no daemon
 * runs: connect() succeeds, and nothing answers until a daemon is started with it. */
static int listen_on_sock(void)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	ck_assert_int_ge(fd, 0);
	unlink(D.sock);
	strcpy(sa.sun_path, D.sock);
	ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	ck_assert_int_eq(listen(fd, 16), 0);
	return fd;
}

/* The next connection waiting on @p lfd, within @p ms. */
static int accept_within(int lfd, int ms)
{
	struct pollfd p = {.fd = lfd, .events = POLLIN};
	int fd;

	ck_assert_msg(poll(&p, 1, scaled_ms(ms)) == 1, "nobody connected");
	fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	return fd;
}

/* Read the HELLO a client sent on @p fd, leaving it unanswered; its id. */
static uint32_t read_hello(int fd)
{
	struct dlpc__hdr h;
	uint8_t buf[512];

	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	ck_assert_uint_eq(h.type, DLPC_MSG_HELLO);
	return h.id;
}

/* The socket is activated and no daemon runs yet: a waiting attach that connects anew waits for
 * the answer to its HELLO no longer than the time left of its wait (not DLPC_CALL_TIMEOUT_MS,
 * 30 s), and its message says so, legibly (the last attempt's message quoted whole). */
START_TEST(activated_hello_bounded_by_wait)
{
	struct waiter w = {.name = "r/never", .timeout_ms = 1500};
	dlpc_client *c = connect_or_die(&D);
	char want[300];
	pthread_t th;
	int lfd;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &w.c), 0);
	ck_assert_int_eq(pthread_create(&th, NULL, wait_thread, &w), 0);
	ck_assert(wait_stat(c, waiters_are, (void *)1, scaled_ms(5000)));
	dlpc_close(c);
	daemon_kill();
	lfd = listen_on_sock();
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_int_eq(w.result, -ETIMEDOUT);
	ck_assert_msg(w.took_ms >= 1400 && w.took_ms < 1500 + DLPC_CALL_GRACE_MS + scaled_ms(1000),
		      "gave up after %lld ms", w.took_ms);
	snprintf(want, sizeof(want),
		 "waited 1500 ms for 'r/never'; dlpackd went away meanwhile and has not come back "
		 "(cannot connect to dlpackd at %s: it did not answer HELLO within ",
		 D.sock);
	ck_assert_msg(strncmp(w.why, want, strlen(want)) == 0, "message: %s", w.why);
	ck_assert_uint_eq(dlpc_reconnects(w.c), 0);
	dlpc_close(w.c);
	close(lfd);
	daemon_restart();
}
END_TEST

/* The socket is activated and no daemon runs yet: dlpc_cancel() and dlpc_close() from another
 * thread end waiting attaches whose HELLO to it goes unanswered, at once. */
START_TEST(activated_hello_canceled)
{
	struct waiter x = {.name = "r/never", .timeout_ms = -1};
	struct waiter y = {.name = "r/never", .timeout_ms = -1};
	dlpc_client *c = connect_or_die(&D);
	pthread_t tx, ty;
	int lfd, a, b;
	long long t0;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &x.c), 0);
	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &y.c), 0);
	ck_assert_int_eq(pthread_create(&tx, NULL, wait_thread, &x), 0);
	ck_assert_int_eq(pthread_create(&ty, NULL, wait_thread, &y), 0);
	ck_assert(wait_stat(c, waiters_are, (void *)2, scaled_ms(5000)));
	dlpc_close(c);
	daemon_kill();
	lfd = listen_on_sock();
	/* both have connected anew and sent their HELLO, which nobody answers */
	a = accept_within(lfd, 5000);
	b = accept_within(lfd, 5000);
	read_hello(a);
	read_hello(b);
	t0 = now_ms();
	dlpc_cancel(x.c);
	dlpc_close(y.c);
	ck_assert_int_eq(pthread_join(tx, NULL), 0);
	ck_assert_int_eq(pthread_join(ty, NULL), 0);
	ck_assert_msg(now_ms() - t0 < scaled_ms(2000), "ended %lld ms after", now_ms() - t0);
	ck_assert_msg(x.result == -ECANCELED, "%d: %s", x.result, x.why);
	ck_assert_msg(y.result == -ECANCELED, "%d: %s", y.result, y.why);
	dlpc_close(x.c);
	close(a);
	close(b);
	close(lfd);
	daemon_restart();
}
END_TEST

/* The socket is activated while no daemon runs, then a daemon is started with it: waiting
 * attaches in other processes, bounded and not, whose HELLO waited in its backlog, connect
 * anew through it and complete once the name is published. */
START_TEST(activated_daemon_answers)
{
	struct waiter bounded = {.name = "r/later", .timeout_ms = scaled_ms(20000)};
	struct waiter forever = {.name = "r/later", .timeout_ms = -1};
	dlpc_client *c = connect_or_die(&D);
	pid_t p1 = spawn(wait_in_child, &bounded), p2 = spawn(wait_in_child, &forever), act;
	int lfd, st;

	ck_assert(wait_stat(c, waiters_are, (void *)2, scaled_ms(5000)));
	dlpc_close(c);
	daemon_kill();
	lfd = listen_on_sock();
	usleep(300000); /* the waits connect anew, and their HELLO waits */
	act = daemon_spawn_activated(lfd, D.log);
	close(lfd);
	c = connect_or_die(&D);
	ck_assert_msg(wait_stat(c, waiters_are, (void *)2, scaled_ms(10000)),
		      "the waiting attaches did not come back");
	ck_assert_dlpc(publish(c, "r/later", 7.0f, 0), 1);
	ck_assert_int_eq(wait_child(p1), 0);
	ck_assert_int_eq(wait_child(p2), 0);
	dlpc_close(c);
	ck_assert_int_eq(kill(act, SIGTERM), 0);
	ck_assert_int_eq(waitpid(act, &st, 0), act);
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the activated dlpackd: status 0x%x",
		      st);
	daemon_restart();
}
END_TEST

/* Answer one connection's HELLO as a dlpackd of another major version of the protocol would,
 * then wait for the client to hang up. */
static void *other_protocol(void *arg)
{
	Dlpackd__V1__HelloReply rep = DLPACKD__V1__HELLO_REPLY__INIT;
	int fd = accept_within(*(int *)arg, 10000);
	uint32_t id = read_hello(fd);
	char b;

	rep.version_major = DLPC_PROTO_MAJOR + 1;
	rep.server = "a dlpackd of another protocol";
	raw_send(fd, DLPC_MSG_HELLO | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
	while (read(fd, &b, 1) > 0)
		;
	close(fd);
	return NULL;
}

/* Connecting anew fails in a way that waiting does not mend (a server of another protocol
 * version took the socket): the waiting attach ends at once with that error, its message naming
 * the entry and the cause, where it used to try again until its 20 s had passed. */
START_TEST(permanent_error_ends_wait)
{
	struct waiter w = {.name = "r/never", .timeout_ms = 20000};
	dlpc_client *c = connect_or_die(&D);
	pthread_t th, srv;
	int lfd;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &w.c), 0);
	ck_assert_int_eq(pthread_create(&th, NULL, wait_thread, &w), 0);
	ck_assert(wait_stat(c, waiters_are, (void *)1, scaled_ms(5000)));
	dlpc_close(c);
	daemon_kill();
	lfd = listen_on_sock();
	ck_assert_int_eq(pthread_create(&srv, NULL, other_protocol, &lfd), 0);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_int_eq(pthread_join(srv, NULL), 0);
	ck_assert_msg(w.result == -EPROTO, "%d after %lld ms: %s", w.result, w.took_ms, w.why);
	ck_assert_msg(w.took_ms < scaled_ms(5000), "gave up after %lld ms", w.took_ms);
	ck_assert_msg(strstr(w.why, "cannot attach 'r/never'") &&
			      strstr(w.why, "protocol version mismatch"),
		      "message: %s", w.why);
	dlpc_close(w.c);
	close(lfd);
	daemon_restart();
}
END_TEST

/* ---- the connection a reference came by, whatever the interrupt check calls ---- */

struct nested {
	dlpc_client *c;	    /* on its first connection: the attach waits here */
	dlpc_client *other; /* on its second: the interrupt check calls it */
	int checks, stat_result, result;
	DLManagedTensorVersioned *t;
};

/* The interrupt check: a request on the other client, and go on. */
static int stat_other(void *arg)
{
	struct nested *n = arg;
	dlpc_stats st = {.size = sizeof(st)};

	n->stat_result = dlpc_stat(n->other, &st);
	__atomic_add_fetch(&n->checks, 1, __ATOMIC_SEQ_CST);
	return 0;
}

static void *nested_waiter(void *arg)
{
	struct nested *n = arg;
	dlpc_attach_opts o = {.size = sizeof(o), .timeout_ms = scaled_ms(20000)};

	dlpc_set_interrupt(stat_other, n);
	n->result = dlpc_attach(n->c, "r/nested", &o, &n->t);
	dlpc_set_interrupt(NULL, NULL);
	return NULL;
}

/* An interrupt check that makes a request on another client, connected anew once, while an
 * attach waits: the reference the attach gets still belongs to its own client's connection,
 * so its release goes out (it was dropped as if of a replaced connection). */
START_TEST(nested_call_keeps_epoch)
{
	struct nested n = {0};
	long long deadline;
	dlpc_client *c;
	pthread_t th;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &n.other), 0);
	daemon_kill();
	daemon_restart();
	c = connect_or_die(&D);
	stat_other(&n);
	ck_assert_int_lt(n.stat_result, 0); /* the call that finds the connection lost */
	stat_other(&n);
	ck_assert_dlpc(n.stat_result, 0);
	ck_assert_uint_eq(dlpc_reconnects(n.other), 1);
	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &n.c), 0);
	n.checks = 0;
	ck_assert_int_eq(pthread_create(&th, NULL, nested_waiter, &n), 0);
	ck_assert(wait_stat(c, waiters_are, (void *)1, scaled_ms(5000)));
	/* the check has made its request while the attach waits */
	deadline = now_ms() + scaled_ms(5000);
	while (__atomic_load_n(&n.checks, __ATOMIC_SEQ_CST) == 0) {
		ck_assert_msg(now_ms() < deadline, "the interrupt check did not run");
		usleep(1000);
	}
	ck_assert_dlpc(publish(c, "r/nested", 5.0f, 0), 1);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_dlpc(n.result, 1);
	ck_assert_dlpc(n.stat_result, 0);
	ck_assert(holds(n.t, 5.0f));
	ck_assert_uint_eq(stat_or_die(c).references, 1);
	n.t->deleter(n.t);
	ck_assert_msg(wait_stat(c, refs_are, (void *)0, scaled_ms(5000)),
		      "the release did not reach dlpackd");
	dlpc_close(n.c);
	dlpc_close(n.other);
	dlpc_close(c);
}
END_TEST

/* ---- legacy CUDA IPC publications and the connection they belong to (fake driver) ---- */

/* A CUDA tensor whose deleter writes @p tag to @p notify. */
struct devt {
	DLManagedTensorVersioned t;
	int64_t shape[1];
	int notify;
	char tag;
};

static void devt_deleter(DLManagedTensorVersioned *t)
{
	struct devt *d = (struct devt *)t;

	if (write(d->notify, &d->tag, 1) != 1)
		abort();
	free(d);
}

static DLManagedTensorVersioned *dev_tensor(CUdeviceptr ptr, int notify, char tag)
{
	struct devt *d = calloc(1, sizeof(*d));

	CHILD_CHECK(d != NULL);
	d->shape[0] = NV;
	d->notify = notify;
	d->tag = tag;
	d->t.version.major = DLPACK_MAJOR_VERSION;
	d->t.version.minor = DLPACK_MINOR_VERSION;
	d->t.deleter = devt_deleter;
	d->t.dl_tensor.data = (void *)(uintptr_t)ptr;
	d->t.dl_tensor.device = (DLDevice){kDLCUDA, 0};
	d->t.dl_tensor.ndim = 1;
	d->t.dl_tensor.dtype = (DLDataType){kDLFloat, 32, 1};
	d->t.dl_tensor.shape = d->shape;
	return &d->t;
}

struct ipc_pub {
	int ready[2];  /* the publisher writes a byte at each step */
	int go[2];     /* the test writes (or closes) to let it go on */
	int notify[2]; /* each deleter writes its tag */
};

#define IPC_BYTES (1u << 20)
#define IPC_NEW_AT 65536

static int ipc_publisher(void *arg)
{
	struct ipc_pub *p = arg;
	dlpc_client *c = NULL;
	CUdeviceptr base;
	char b;

	close(p->ready[0]);
	close(p->go[1]);
	close(p->notify[0]);
	CHILD_CHECK(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&base, IPC_BYTES) == CUDA_SUCCESS);
	fill((float *)(uintptr_t)base, 1.0f);
	fill((float *)(uintptr_t)(base + IPC_NEW_AT), 3.0f);
	/* lent on the first connection, and never reclaimed once it is gone */
	CHILD_CHECK(dlpc_publish(c, "ipc/old", dev_tensor(base, p->notify[1], 'O'), 0) == 1);
	CHILD_CHECK(write(p->ready[1], "1", 1) == 1);
	CHILD_CHECK(read(p->go[0], &b, 1) == 1);
	/* The reclaimer, reading the connection, found it lost while the daemon restarted; the
	 * next call connects anew: a lent publish, which the new daemon refuses. */
	CHILD_CHECK(dlpc_publish(c, "ipc/taken", dev_tensor(base + IPC_NEW_AT, p->notify[1], 'T'),
				 0) == -EEXIST);
	CHILD_CHECK(dlpc_reconnects(c) == 1);
	CHILD_CHECK(dlpc_publish(c, "ipc/new", dev_tensor(base + IPC_NEW_AT, p->notify[1], 'N'),
				 0) == 1);
	/* the handle goes; the connection stays, for ipc/new, until its RECLAIM */
	dlpc_close(c);
	CHILD_CHECK(write(p->ready[1], "2", 1) == 1);
	/* idle: no libdlpc call from here on */
	if (read(p->go[0], &b, 1) < 0)
		return 1;
	return 0;
}

static int ipc_attacher(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "ipc/new", NULL, &t) == 1);
	CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA && holds(t, 3.0f));
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* The next tag a deleter of the publisher wrote within @p ms, or -1. */
static int next_tag(const struct ipc_pub *p, int ms)
{
	struct pollfd pfd = {.fd = p->notify[0], .events = POLLIN};
	char b;

	if (poll(&pfd, 1, ms) != 1 || read(p->notify[0], &b, 1) != 1)
		return -1;
	return b;
}

/*
 * Legacy CUDA IPC publications are counted per connection. One lent on the first connection
 * goes with it; after the reconnect (made inside a lent publish that is refused) only the new
 * connection's count: a publication on it keeps the connection open after dlpc_close() (the
 * entry is still there to attach), its RECLAIM is acted on while the publisher makes no call,
 * and then nothing keeps the connection open (the first connection's publication, never to be
 * reclaimed, does not count).
 */
START_TEST(ipc_count_per_connection)
{
	struct ipc_pub p;
	dlpc_client *c;
	pid_t pid;
	char b;

	setenv(DLPC_CUDA_LIBRARY_ENV, FAKE_CUDA_LIB, 1);
	ck_assert_int_eq(pipe2(p.ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(p.go, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(p.notify, O_CLOEXEC), 0);
	pid = spawn(ipc_publisher, &p);
	close(p.ready[1]);
	close(p.go[0]);
	close(p.notify[1]);
	ck_assert_msg(read(p.ready[0], &b, 1) == 1, "the publisher failed before publishing");
	daemon_kill();
	daemon_restart();
	c = connect_or_die(&D);
	ck_assert_dlpc(publish(c, "ipc/taken", 2.0f, 0), 1);
	ck_assert_int_eq(write(p.go[1], "G", 1), 1);
	ck_assert_msg(read(p.ready[0], &b, 1) == 1, "the publisher failed after the restart");
	/* the refused publication was given back at once */
	ck_assert_int_eq(next_tag(&p, 0), 'T');
	ck_assert_int_eq(wait_child(spawn(ipc_attacher, NULL)), 0);
	ck_assert_int_eq(next_tag(&p, 0), -1);
	/* unpublished and released by all: reclaimed */
	ck_assert_dlpc(dlpc_unpublish(c, "ipc/new"), 0);
	ck_assert_int_eq(next_tag(&p, scaled_ms(5000)), 'N');
	ck_assert_msg(wait_stat(c, conns_are, (void *)1, scaled_ms(5000)),
		      "the publisher's connection stayed open after its last reclaim");
	ck_assert_int_eq(next_tag(&p, 0), -1);
	ck_assert_int_eq(write(p.go[1], "Q", 1), 1);
	ck_assert_int_eq(wait_child(pid), 0);
	close(p.ready[0]);
	close(p.go[1]);
	close(p.notify[0]);
	dlpc_close(c);
}
END_TEST

/* Pooled channel buffers in flight when the connection was lost never come back by RECLAIM
 * (the daemon that queued their messages is gone): after the reconnect the pool lets go of
 * them, so a producer that had every buffer in flight goes on allocating instead of failing
 * with ENOBUFS for good, and recycles on the new connection. */
START_TEST(pool_after_restart)
{
	DLDataType f32 = {kDLFloat, 32, 1};
	dlpc_recv_opts ro = {.size = sizeof(ro), .timeout_ms = 0};
	DLManagedTensorVersioned *t, *u;
	int64_t shape[1] = {NV};
	long long deadline;
	dlpc_client *a;
	int fds = fds_now(), r;
	void *p;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &a), 0);
	ck_assert_dlpc(dlpc_channel_open(a, "pool/q", DLPC_POOL_BUFFERS_MAX, NULL), 1);
	for (int i = 0; i < DLPC_POOL_BUFFERS_MAX; i++) {
		ck_assert_dlpc(dlpc_channel_alloc(a, "pool/q", f32, 1, shape, &t), 0);
		ck_assert_dlpc(dlpc_send(a, "pool/q", t, DLPC_SEND_NOWAIT), 0);
	}
	ck_assert_dlpc(dlpc_channel_alloc(a, "pool/q", f32, 1, shape, &t), -ENOBUFS);

	daemon_kill();
	daemon_restart();
	r = dlpc_channel_open(a, "pool/q", 4, NULL);
	ck_assert_msg(r == -ECONNRESET || r == -EPIPE, "first call after the kill: %d", r);
	ck_assert_dlpc(dlpc_channel_open(a, "pool/q", 4, NULL), 1);
	ck_assert_uint_eq(dlpc_reconnects(a), 1);
	ck_assert_dlpc(dlpc_channel_alloc(a, "pool/q", f32, 1, shape, &t), 0);
	p = t->dl_tensor.data;
	ck_assert_dlpc(dlpc_send(a, "pool/q", t, 0), 0);
	ck_assert_dlpc(dlpc_recv(a, "pool/q", &ro, &u), 0);
	u->deleter(u);
	/* the buffer comes back once the release has reached the daemon and its RECLAIM this
	 * client, which reads it with the reply to a request */
	deadline = now_ms() + scaled_ms(5000);
	for (;;) {
		dlpc_channel_info info = {.size = sizeof(info)};

		ck_assert_dlpc(dlpc_channel_stat(a, "pool/q", &info), 0);
		ck_assert_dlpc(dlpc_channel_alloc(a, "pool/q", f32, 1, shape, &t), 0);
		if (t->dl_tensor.data == p)
			break;
		t->deleter(t);
		ck_assert_msg(now_ms() < deadline, "the recycled buffer did not come back");
		usleep(2000);
	}
	t->deleter(t);
	ck_assert_dlpc(dlpc_channel_remove(a, "pool/q"), 0);
	dlpc_close(a);
	ck_assert_int_eq(fds_settle(fds), fds);
}
END_TEST

/* A pooled message whose SEND went out but got no answer (the daemon stopped answering, the
 * call gave up) may be queued: its buffer leaves the pool instead of being handed out again
 * under a receiver. Its late RECLAIM, once a receiver let go of it, frees nothing else: not
 * the buffer that took its slot, in flight meanwhile. */
START_TEST(pool_unanswered_send)
{
	DLDataType u8 = {kDLUInt, 8, 1};
	dlpc_recv_opts ro = {.size = sizeof(ro), .timeout_ms = 0};
	dlpc_channel_info info = {.size = sizeof(info)};
	DLManagedTensorVersioned *t, *u;
	int64_t shape[1] = {4096};
	dlpc_client *a;
	int r;

	ck_assert_int_eq(setenv(DLPC_CALL_TIMEOUT_ENV, "300", 1), 0);
	ck_assert_dlpc(dlpc_connect(D.sock, &a), 0);
	ck_assert_dlpc(dlpc_channel_open(a, "pool/late", 4, NULL), 1);
	ck_assert_dlpc(dlpc_channel_alloc(a, "pool/late", u8, 1, shape, &t), 0);
	memset(t->dl_tensor.data, 1, 4096);
	/* (a send that may wait for room waits for its answer as long; one that may not is
	 * bounded by DLPC_CALL_TIMEOUT_MS) */
	ck_assert_int_eq(kill(D.pid, SIGSTOP), 0);
	r = dlpc_send(a, "pool/late", t, DLPC_SEND_NOWAIT);
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);
	ck_assert_dlpc(r, -ETIMEDOUT);
	/* the daemon took the message after all */
	ck_assert_dlpc(dlpc_channel_stat(a, "pool/late", &info), 0);
	ck_assert_uint_eq(info.depth, 1);
	/* (addresses may repeat once a mapping is gone: the bytes tell the buffers apart) */
	ck_assert_dlpc(dlpc_channel_alloc(a, "pool/late", u8, 1, shape, &t), 0);
	memset(t->dl_tensor.data, 2, 4096);
	ck_assert_dlpc(dlpc_send(a, "pool/late", t, 0), 0);
	/* the first message, intact, then its RECLAIM (read with the reply to a STAT) */
	ck_assert_dlpc(dlpc_recv(a, "pool/late", &ro, &u), 0);
	ck_assert_uint_eq(((const uint8_t *)u->dl_tensor.data)[4095], 1);
	u->deleter(u);
	usleep(50 * 1000); /* the release goes out within DLPC_RELEASE_DELAY_MS */
	ck_assert_dlpc(dlpc_channel_stat(a, "pool/late", &info), 0);
	ck_assert_uint_eq(info.depth, 1);
	/* the second is still queued: its buffer is not handed out */
	ck_assert_dlpc(dlpc_channel_alloc(a, "pool/late", u8, 1, shape, &t), 0);
	memset(t->dl_tensor.data, 3, 4096);
	t->deleter(t);
	ck_assert_dlpc(dlpc_recv(a, "pool/late", &ro, &u), 0);
	ck_assert_uint_eq(((const uint8_t *)u->dl_tensor.data)[0], 2);
	u->deleter(u);
	ck_assert_dlpc(dlpc_channel_remove(a, "pool/late"), 0);
	dlpc_close(a);
}
END_TEST

/* Attempts to connect anew that fail in failed_reconnects_while_the_library_thread_turns (ASan
 * reported the use-after-free it guards against in the first run with the bug). */
#define FAILED_RECONNECTS 100000

/* Another client's attaches and releases, whose deferred releases the library's thread flushes:
 * each flush is a turn of that thread, which takes references to every open client. */
struct churn {
	dlpc_client *c;
	atomic_bool stop;
	int err; /* the first failure, or 0 */
	unsigned long n;
};

static void *churn(void *arg)
{
	struct churn *ch = arg;

	while (!atomic_load(&ch->stop) && !ch->err) {
		DLManagedTensorVersioned *t;
		int r = dlpc_attach(ch->c, "r/churn", NULL, &t);

		if (r < 0)
			ch->err = r;
		else
			t->deleter(t);
		ch->n++;
	}
	return NULL;
}

/* Connecting anew fails over and over (nobody listens) while the library's thread turns: the
 * client of each attempt is on the list of open clients from the start, so the thread may hold a
 * reference to it, and it must be let go by that reference, not freed under the thread (under
 * ASan, a heap-use-after-free in the thread before the fix). Then the daemon comes back and the
 * client connects anew. */
START_TEST(failed_reconnects_while_the_library_thread_turns)
{
	struct churn ch = {.err = 0};
	dlpc_stats st = {.size = sizeof(st)};
	long long deadline;
	struct daemon d2;
	dlpc_client *y;
	pthread_t t;
	int r;

	daemon_start(&d2);
	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_NO_CACHE, &ch.c), 0);
	ck_assert_dlpc(publish(ch.c, "r/churn", 1.0f, 0), 1);
	ck_assert_dlpc(dlpc_connect_flags(d2.sock, DLPC_CONNECT_RECONNECT, &y), 0);
	ck_assert_int_eq(kill(d2.pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(d2.pid, NULL, 0), d2.pid);
	ck_assert_int_eq(pthread_create(&t, NULL, churn, &ch), 0);
	/* fewer under a slow wrapper (valgrind): each attempt is a socket and a connect() */
	for (int i = 0; i < FAILED_RECONNECTS / (scaled_ms(1000) / 1000); i++) {
		r = dlpc_stat(y, &st);
		ck_assert_msg(r == -ECONNREFUSED || r == -ECONNRESET || r == -EPIPE,
			      "a call while no daemon listens: %d", r);
	}
	atomic_store(&ch.stop, true);
	ck_assert_int_eq(pthread_join(t, NULL), 0);
	ck_assert_dlpc(ch.err, 0);
	ck_assert_uint_gt(ch.n, 0);
	d2.pid = daemon_spawn(d2.sock, d2.log);
	deadline = now_ms() + scaled_ms(10000);
	while ((r = dlpc_stat(y, &st)) < 0) {
		ck_assert_msg(now_ms() < deadline, "no reconnect to the new dlpackd: %d", r);
		usleep(5000);
	}
	ck_assert_uint_eq(dlpc_reconnects(y), 1);
	dlpc_close(y);
	dlpc_close(ch.c);
	daemon_stop(&d2);
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
	tcase_add_test(tc, activated_hello_bounded_by_wait);
	tcase_add_test(tc, activated_hello_canceled);
	tcase_add_test(tc, activated_daemon_answers);
	tcase_add_test(tc, permanent_error_ends_wait);
	tcase_add_test(tc, nested_call_keeps_epoch);
	tcase_add_test(tc, ipc_count_per_connection);
	tcase_add_test(tc, pool_after_restart);
	tcase_add_test(tc, pool_unanswered_send);
	tcase_add_test(tc, failed_reconnects_while_the_library_thread_turns);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(reconnect_suite());
}
