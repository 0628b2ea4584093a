/* SPDX-License-Identifier: Apache-2.0 */
/* The connection: connect, HELLO, fork, deferred releases, close (requests and replies: call.c;
 * the library's thread: loop.c). */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "sockpath.h"
#include "util.h"

int dlpc__check(const dlpc_client *c)
{
	if (!dlpc__ours(c))
		return dlpc__fail(-EBADFD,
				  "this dlpc_client belongs to process %d; a forked child must "
				  "call dlpc_connect() itself",
				  (int)c->pid);
	return 0;
}

int dlpc__name_arg(const char *name, const char *what)
{
	char why[160];

	if (!name)
		return dlpc__fail(-EINVAL, "cannot %s: name is NULL", what);
	if (dlpc__name_check((const uint8_t *)name, strlen(name), why, sizeof(why)) < 0)
		return dlpc__fail(-EINVAL, "cannot %s: %s", what, why);
	return 0;
}

/*
 * Every open client, so that a forked child can close the sockets it inherited: otherwise a
 * child (a DataLoader worker, a preforked server) would keep its parent's connection, with its
 * references and ephemeral entries, alive after the parent closed it or died. The child cannot
 * use them anyway (dlpc__check). fork() takes the list lock first, so the list is whole in the
 * child.
 */
static pthread_mutex_t open_mu = PTHREAD_MUTEX_INITIALIZER;
static dlpc_client *open_clients;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void atfork_prepare(void)
{
	pthread_mutex_lock(&open_mu);
	dlpc__loop_atfork(0);
	/* the caches' locks are leaves: taken after these, by no thread holding one of them */
	for (dlpc_client *c = open_clients; c; c = c->next_open)
		dlpc__cache_lock(c, true);
	dlpc__maps_atfork(0);
}

static void atfork_parent(void)
{
	dlpc__maps_atfork(1);
	for (dlpc_client *c = open_clients; c; c = c->next_open)
		dlpc__cache_lock(c, false);
	dlpc__loop_atfork(1);
	pthread_mutex_unlock(&open_mu);
}

unsigned dlpc__fork_gen;

static void atfork_child(void)
{
	__atomic_add_fetch(&dlpc__fork_gen, 1, __ATOMIC_RELAXED);
	for (dlpc_client *c = open_clients; c; c = c->next_open) {
		dlpc__close(c->sock);
		c->sock = -1;
		dlpc__close(c->wake_fd);
		c->wake_fd = -1;
		dlpc__cache_forked(c);
		dlpc__direct_forked(c);
	}
	dlpc__maps_atfork(2);
	/* the parent's deferred releases are the parent's business; no library thread runs here */
	dlpc__loop_atfork(2);
	pthread_mutex_unlock(&open_mu);
}

static void atfork_register(void)
{
	pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* Create @p c's socket and wake-up eventfd and list them in one step: a fork in between would
 * leave the child fds the list does not know, so the child would not close them. 0 or negative
 * errno. */
static int open_socket_listed(dlpc_client *c)
{
	int r = 0;

	pthread_once(&atfork_once, atfork_register);
	pthread_mutex_lock(&open_mu);
	c->sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (c->sock < 0)
		r = -errno;
	else if ((c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
		r = -errno;
	c->next_open = open_clients;
	open_clients = c;
	pthread_mutex_unlock(&open_mu);
	return r;
}

void dlpc__list_lock(void)
{
	pthread_mutex_lock(&open_mu);
}

void dlpc__list_unlock(void)
{
	pthread_mutex_unlock(&open_mu);
}

static void open_list_remove(dlpc_client *c)
{
	bool last;

	pthread_mutex_lock(&open_mu);
	for (dlpc_client **pp = &open_clients; *pp; pp = &(*pp)->next_open)
		if (*pp == c) {
			*pp = c->next_open;
			break;
		}
	last = !open_clients;
	pthread_mutex_unlock(&open_mu);
	/* no client, so no mapping of one left to clean: the process's pagemap fd goes too */
	if (last)
		dlpc__maps_pagemap_close();
}

void dlpc__client_ref(dlpc_client *c)
{
	atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
}

static void client_free(dlpc_client *c)
{
	open_list_remove(c);
	dlpc__close(c->sock);
	dlpc__rx_clear(&c->rx);
	dlpc__scratch_clear(&c->out);
	free(c->reclaimed);
	dlpc__pool_free(c->pool);
	free(c->abandoned);
	dlpc__cache_clear(c);
	dlpc__direct_reset(c);
	dlpc__close(c->direct_wake);
	dlpc__close(c->wake_fd);
	pthread_mutex_destroy(&c->mu);
	pthread_mutex_destroy(&c->wmu);
	pthread_cond_destroy(&c->cv);
	free(c);
}

void dlpc__client_unref(dlpc_client *c)
{
	if (atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel) == 1)
		client_free(c);
}

DLPC_EXPORT void dlpc_cancel(dlpc_client *c)
{
	/* in a forked child no call of the parent's waits here, and its locks may be held */
	if (c && dlpc__ours(c))
		dlpc__cancel_calls(c);
}

DLPC_EXPORT void dlpc_close(dlpc_client *c)
{
	if (!c)
		return;
	/* the connection may live on for attached mappings: tell the daemon what is released */
	if (dlpc__ours(c)) {
		dlpc__cancel_calls(c);
		/* idle references go back now; those in use when their last tensor is released */
		dlpc__cache_off(c);
		/* the library's thread may be reading the socket for the cache: let it look again,
		 * so that it holds the client no longer than the user does */
		dlpc__loop_wake();
		pthread_mutex_lock(&c->wmu);
		dlpc__flush_locked(c);
		pthread_mutex_unlock(&c->wmu);
	}
	dlpc__client_unref(c);
}

/* Frame @p c's deferred releases at offset 0 of c->out. Length, or negative errno. Under wmu. */
ssize_t dlpc__pending_frame(dlpc_client *c)
{
	Dlpackd__V1__Release msg = DLPACKD__V1__RELEASE__INIT;
	unsigned n = atomic_load_explicit(&c->npending, memory_order_relaxed);
	uint64_t rel[DLPC_RELEASE_PENDING_MAX], cached[DLPC_RELEASE_PENDING_MAX],
		used[DLPC_RELEASE_PENDING_MAX];

	/* releases and the cache's marks (1.7) share the queue, told apart by tag bits */
	msg.ref_ids = rel;
	msg.cached_ids = cached;
	msg.used_ids = used;
	for (unsigned i = 0; i < n; i++) {
		uint64_t v = c->pending[i];

		if (v & DLPC__MARK_CACHED)
			cached[msg.n_cached_ids++] = v & ~DLPC__MARK_CACHED;
		else if (v & DLPC__MARK_USED)
			used[msg.n_used_ids++] = v & ~DLPC__MARK_USED;
		else
			rel[msg.n_ref_ids++] = v;
	}
	return dlpc__msg_frame(&c->out, DLPC_MSG_RELEASE, 0, &msg.base, 0);
}

/*
 * Send @p c's deferred releases now. Under wmu. A failed write means the connection is gone,
 * and the references with it; either way none is pending any more (unless the frame could
 * not even be built, or the daemon took none of it within the send timeout: then they wait for
 * the next try).
 */
void dlpc__flush_locked(dlpc_client *c)
{
	size_t sent;
	ssize_t len;
	int r;

	if (!atomic_load_explicit(&c->npending, memory_order_relaxed))
		return;
	len = dlpc__pending_frame(c);
	/* out of memory for the frame: keep them for the next try rather than lose them */
	if (len < 0)
		return;
	r = dlpc__send_counted(c->sock, c->out.p, (size_t)len, NULL, 0, &sent);
	/* the daemon took nothing within the send timeout (it is stopped): keep them too */
	if (r == -EAGAIN && sent == 0)
		return;
	atomic_store_explicit(&c->npending, 0, memory_order_relaxed);
	/* a frame cut short breaks the stream: nothing may follow it */
	if (r < 0 && sent > 0) {
		pthread_mutex_lock(&c->mu);
		if (!c->broken)
			c->broken = r == -EAGAIN ? -ETIMEDOUT : r;
		pthread_cond_broadcast(&c->cv);
		dlpc__wake_reader(c);
		pthread_mutex_unlock(&c->mu);
	}
}

void dlpc__cancel_wait(dlpc_client *c, uint16_t type, uint32_t id, uint64_t epoch)
{
	Dlpackd__V1__Cancel msg = DLPACKD__V1__CANCEL__INIT;
	size_t sent = 0;
	ssize_t len;
	int r;

	if (type != DLPC_MSG_ATTACH && type != DLPC_MSG_RECV && type != DLPC_MSG_SEND)
		return;
	msg.request_id = id;
	pthread_mutex_lock(&c->wmu);
	/* a request of a connection replaced since died with it */
	if (epoch != c->epoch || c->minor < 9) {
		pthread_mutex_unlock(&c->wmu);
		return;
	}
	/* (without memory for the frame, the wait ends when the connection does) */
	len = dlpc__msg_frame(&c->out, DLPC_MSG_CANCEL, 0, &msg.base, 0);
	r = len < 0 ? 0 : dlpc__send_counted(c->sock, c->out.p, (size_t)len, NULL, 0, &sent);
	pthread_mutex_unlock(&c->wmu);
	/* a frame cut short breaks the stream: nothing may follow it */
	if (r < 0 && sent > 0) {
		pthread_mutex_lock(&c->mu);
		if (!c->broken)
			c->broken = r == -EAGAIN ? -ETIMEDOUT : r;
		pthread_cond_broadcast(&c->cv);
		dlpc__wake_reader(c);
		pthread_mutex_unlock(&c->mu);
	}
}

/*
 * dlpackd closed @p c's new connection before HELLO was answered: read what it said first, if
 * anything. A refusal at accept comes as an ERROR with id 0 written just before the close; when
 * the close came before HELLO left, the send failed (EPIPE) and nothing was read, but the
 * ERROR still waits in the socket.
 */
static void last_word(dlpc_client *c)
{
	uint8_t buf[DLPC_FRAME_HDR_SIZE + 1024];
	Dlpackd__V1__Error *e;
	struct dlpc__hdr h;
	ssize_t n;

	if (c->fatal[0] || c->rx.end > c->rx.start)
		return;
	n = recv(c->sock, buf, sizeof(buf), MSG_DONTWAIT);
	if (n < (ssize_t)DLPC_FRAME_HDR_SIZE)
		return;
	dlpc__hdr_decode(buf, &h);
	if (h.type != DLPC_MSG_ERROR || h.id != 0 || h.nfds ||
	    h.len > (size_t)n - DLPC_FRAME_HDR_SIZE)
		return;
	e = dlpackd__v1__error__unpack(NULL, h.len, buf + DLPC_FRAME_HDR_SIZE);
	if (!e)
		return;
	snprintf(c->fatal, sizeof(c->fatal), "%s", e->message);
	c->fatal_code = e->code > 0 ? e->code : 0;
	dlpackd__v1__error__free_unpacked(e, NULL);
}

/* Take a reference on @p c unless its last one is already gone (it is being freed). */
static bool client_tryref(dlpc_client *c)
{
	unsigned n = atomic_load_explicit(&c->refs, memory_order_relaxed);

	while (n)
		if (atomic_compare_exchange_weak_explicit(&c->refs, &n, n + 1, memory_order_acquire,
							  memory_order_relaxed))
			return true;
	return false;
}

size_t dlpc__clients_ref(dlpc_client ***buf, size_t *cap)
{
	size_t n = 0;

	pthread_mutex_lock(&open_mu);
	for (dlpc_client *c = open_clients; c; c = c->next_open) {
		if (!dlpc__ours(c))
			continue;
		if (n == *cap) {
			size_t ncap = *cap ? *cap * 2 : 8;
			dlpc_client **nv = realloc(*buf, ncap * sizeof(*nv));

			if (!nv)
				break;
			*buf = nv;
			*cap = ncap;
		}
		if (client_tryref(c))
			(*buf)[n++] = c;
	}
	pthread_mutex_unlock(&open_mu);
	return n;
}

/* See internal.h. */
bool dlpc__start_thread(void *(*fn)(void *), void *arg)
{
	sigset_t all, old;
	pthread_attr_t attr;
	pthread_t t;
	bool ok;

	sigfillset(&all);
	pthread_attr_init(&attr);
	pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	ok = pthread_create(&t, &attr, fn, arg) == 0;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&attr);
	return ok;
}

/* Queue @p v (a reference id, maybe tagged) on c->pending and tell the library's thread. Under wmu, which
 * this releases. */
static void pending_add(dlpc_client *c, uint64_t v)
{
	unsigned n = atomic_load_explicit(&c->npending, memory_order_relaxed);

	/* full only if the last flush had no memory for its frame: try again; failing that, this
	 * reference stays with the daemon until the connection closes */
	if (n == DLPC_RELEASE_PENDING_MAX)
		dlpc__flush_locked(c);
	n = atomic_load_explicit(&c->npending, memory_order_relaxed);
	if (n < DLPC_RELEASE_PENDING_MAX) {
		c->pending[n++] = v;
		atomic_store_explicit(&c->npending, n, memory_order_relaxed);
	}
	if (n == DLPC_RELEASE_PENDING_MAX)
		dlpc__flush_locked(c);
	pthread_mutex_unlock(&c->wmu);
	if (n == 1 && !dlpc__loop_flush_soon()) {
		pthread_mutex_lock(&c->wmu);
		dlpc__flush_locked(c);
		pthread_mutex_unlock(&c->wmu);
	}
}

void dlpc__mark_epoch(dlpc_client *c, uint64_t ref_id, uint64_t epoch, bool cached)
{
	uint64_t v = ref_id | (cached ? DLPC__MARK_CACHED : DLPC__MARK_USED);
	uint64_t undo = ref_id | (cached ? DLPC__MARK_USED : DLPC__MARK_CACHED);
	unsigned n;

	if (!dlpc__ours(c))
		return;
	pthread_mutex_lock(&c->wmu);
	if (epoch != c->epoch) {
		pthread_mutex_unlock(&c->wmu);
		return;
	}
	/* a mark not sent yet that this one undoes goes instead: a re-attach loop queues nothing
	 * more than its last release's mark */
	n = atomic_load_explicit(&c->npending, memory_order_relaxed);
	for (unsigned i = 0; i < n; i++)
		if (c->pending[i] == undo || c->pending[i] == v) {
			if (c->pending[i] == undo) {
				c->pending[i] = c->pending[n - 1];
				atomic_store_explicit(&c->npending, n - 1, memory_order_relaxed);
			}
			pthread_mutex_unlock(&c->wmu);
			return;
		}
	pending_add(c, v);
}

void dlpc__release_epoch(dlpc_client *c, uint64_t ref_id, uint64_t epoch)
{
	/* a direct channel's message holds no reference of the daemon's */
	if (ref_id == 0)
		return;
	/* in a forked child the reference is the parent's; the daemon drops it when the parent
	 * releases it or goes away */
	if (!dlpc__ours(c))
		return;
	pthread_mutex_lock(&c->wmu);
	/* a reference of a connection replaced since died with it; its id may name another now */
	if (epoch != c->epoch) {
		pthread_mutex_unlock(&c->wmu);
		return;
	}
	pending_add(c, ref_id);
}

void dlpc__reclaim_count(dlpc_client *c, int delta, uint64_t epoch)
{
	pthread_mutex_lock(&c->mu);
	/* a publication of a connection replaced since went with it, and so did its count */
	if (epoch != c->epoch) {
		pthread_mutex_unlock(&c->mu);
		return;
	}
	c->ipc_pubs += (unsigned)delta;
	/* a publication taken back (its publish failed) may leave the library's thread watching
	 * a socket that has nothing more to say for it: let it look again */
	if (c->ipc_pubs == 0 && c->reclaimer)
		dlpc__loop_wake();
	pthread_mutex_unlock(&c->mu);
}

/* The bound on calls without a timeout of their own: $DLPC_CALL_TIMEOUT_MS, else the default
 * (<= 0: none). 0, or -EINVAL for a value that is not a whole number of milliseconds. */
static int call_timeout_env(int64_t *ms)
{
	const char *s = getenv(DLPC_CALL_TIMEOUT_ENV);
	char *end;
	long long v;

	*ms = DLPC_CALL_TIMEOUT_MS_DEFAULT;
	if (!s || !*s)
		return 0;
	errno = 0;
	v = strtoll(s, &end, 10);
	if (errno || *end || end == s)
		return dlpc__fail(-EINVAL, "%s='%s' is not a number of milliseconds",
				  DLPC_CALL_TIMEOUT_ENV, s);
	*ms = v;
	return 0;
}

/* Say whether @p parent, connecting anew through @p c, may go on; and let dlpc_close() and
 * dlpc_cancel() of @p parent cancel @p c's HELLO (NULL: no more). 0 or -ECANCELED. */
static int connecting(dlpc_client *parent, dlpc_client *c)
{
	int r = 0;

	pthread_mutex_lock(&parent->mu);
	if (c && parent->closed)
		r = dlpc__fail(-ECANCELED, "this client was closed or canceled (dlpc_close() or "
					   "dlpc_cancel()) while it connected anew");
	else
		parent->connecting = c;
	pthread_mutex_unlock(&parent->mu);
	return r;
}

/* SO_SNDTIMEO of @p sock: @p ms (<= 0: none). */
static void send_timeout(int sock, int64_t ms)
{
	struct timeval tv = {0};

	if (ms > 0) {
		tv.tv_sec = (time_t)(ms / 1000);
		tv.tv_usec = (suseconds_t)(ms % 1000) * 1000;
	}
	setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

/*
 * A new connection to @p path, HELLO done, with calls bounded by @p timeout ms. For
 * dlpc__reconnect() of @p parent (NULL: dlpc_connect()), connect() waits at most @p connect_ms
 * and HELLO @p hello_ms (the time left of a waiting call, which may be shorter), and
 * dlpc_close() or dlpc_cancel() of @p parent cancels the HELLO.
 */
static int connect_new(const char *path, int64_t timeout, dlpc_client *parent, int64_t connect_ms,
		       int64_t hello_ms, dlpc_client **ret)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	Dlpackd__V1__Hello hello = DLPACKD__V1__HELLO__INIT;
	Dlpackd__V1__HelloReply *rep;
	pthread_condattr_t ca;
	dlpc_client *c;
	int r;

	c = calloc(1, sizeof(*c));
	if (!c)
		return dlpc__fail(-ENOMEM, "out of memory");
	c->pid = getpid();
	c->wake_fd = -1;
	c->direct_wake = -1;
	c->watches = NULL;
	c->fork_gen = __atomic_load_n(&dlpc__fork_gen, __ATOMIC_RELAXED);
	c->call_timeout_ms = timeout;
	atomic_init(&c->refs, 1);
	pthread_mutex_init(&c->mu, NULL);
	pthread_mutex_init(&c->wmu, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&c->cv, &ca);
	pthread_condattr_destroy(&ca);
	dlpc__rx_init(&c->rx);
	pthread_mutex_init(&c->cache.mu, NULL);
	/* a reply's fd that this process has no room for fails that call, not the connection */
	c->rx.report_lost_fds = true;
	/* dlpc_connect(): the call timeout, or the time left of it after a dropped HELLO */
	if (!parent && connect_ms <= 0)
		connect_ms = hello_ms = timeout;
	r = open_socket_listed(c);
	if (r < 0) {
		r = dlpc__fail(r, "cannot create a socket: %s", strerror(-r));
		goto fail;
	}
	if (parent && (r = connecting(parent, c)) < 0)
		goto fail;
	/* Every write, and connect()'s wait while the daemon's backlog is full, gives up after the
	 * call timeout: a daemon that stops reading cannot hold the caller forever. */
	send_timeout(c->sock, connect_ms);
	strcpy(sa.sun_path, path);
	while (connect(c->sock, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		/* a signal handler ran (with SO_SNDTIMEO set, connect() is never restarted):
		 * connecting anew goes on unless the thread's interrupt check says stop */
		if (errno == EINTR && parent && !dlpc__interrupted())
			continue;
		if (errno == EAGAIN)
			r = dlpc__fail(-ETIMEDOUT,
				       "cannot connect to dlpackd at %s: it did not accept the "
				       "connection within %lld ms (%s)",
				       path, (long long)connect_ms,
				       connect_ms == timeout ? DLPC_CALL_TIMEOUT_ENV
							     : "its backlog is full");
		else
			r = dlpc__fail(-errno, "cannot connect to dlpackd at %s: %m", path);
		goto fail;
	}
	if (connect_ms != timeout)
		send_timeout(c->sock, timeout);
	hello.version_major = DLPC_PROTO_MAJOR;
	hello.version_minor = DLPC_PROTO_MINOR;
	hello.client = "libdlpc " DLPD_VERSION;
	c->call_timeout_ms = hello_ms;
	r = dlpc__call(c, DLPC_MSG_HELLO, &hello.base, NULL, 0,
		       &dlpackd__v1__hello_reply__descriptor, (ProtobufCMessage **)&rep, NULL,
		       NULL);
	c->call_timeout_ms = timeout;
	if (r == -ETIMEDOUT && hello_ms != timeout)
		r = dlpc__fail(r,
			       "cannot connect to dlpackd at %s: it did not answer HELLO within "
			       "%lld ms, the time left to wait: it may be starting (socket "
			       "activation), stopped or overloaded",
			       path, (long long)hello_ms);
	else if (r == -ETIMEDOUT) {
		char why[DLPC_ERROR_TEXT_MAX];

		snprintf(why, sizeof(why), "%s", dlpc_last_error());
		r = dlpc__fail(r, "cannot connect to dlpackd at %s: %s", path, why);
	}
	if (r == -EPIPE || r == -ECONNRESET || r == -EPROTO)
		last_word(c);
	/* refused with a reason (over a limit of its uid's at accept): not an upgrade's drop */
	if (r < 0 && c->fatal_code && c->fatal[0])
		r = dlpc__fail(-c->fatal_code, "cannot connect to dlpackd at %s: it refused: %s",
			       path, c->fatal);
	if (r < 0)
		goto fail;
	if (rep->version_major != DLPC_PROTO_MAJOR) {
		r = dlpc__fail(-EPROTO,
			       "protocol version mismatch: libdlpc speaks %d.%d, dlpackd at %s "
			       "speaks %u.%u",
			       DLPC_PROTO_MAJOR, DLPC_PROTO_MINOR, path, rep->version_major,
			       rep->version_minor);
		dlpackd__v1__hello_reply__free_unpacked(rep, NULL);
		goto fail;
	}
	c->minor = rep->version_minor;
	dlpackd__v1__hello_reply__free_unpacked(rep, NULL);
	snprintf(c->path, sizeof(c->path), "%s", path);
	if (parent)
		connecting(parent, NULL);
	*ret = c;
	return 0;
fail:
	if (parent)
		connecting(parent, NULL);
	/* listed since open_socket_listed(): the library's thread may hold a reference to it */
	dlpc__client_unref(c);
	return r;
}

/*
 * connect_new() for dlpc_connect(), tried again while dlpackd drops the connection before it
 * answers HELLO without saying why (-ECONNRESET, -EPIPE; a refusal comes with a reason): an
 * upgrade in place closes the connections its old image accepted, and the new image, listening
 * on the same socket, answers the next. Pausing 10 ms at first, then up to
 * DLPC_RECONNECT_BACKOFF_MAX_MS, within the call timeout @p timeout (<= 0: at most
 * DLPC_RECONNECT_DROPS_MAX connections).
 */
static int connect_dropped_again(const char *path, int64_t timeout, dlpc_client **ret)
{
	int64_t end = timeout > 0 ? dlpc__mono_ms() + timeout : 0, left = 0, pause = 10;
	char why[DLPC_ERROR_TEXT_MAX];
	unsigned tries = 0;
	int r;

	for (;;) {
		struct timespec ts;

		r = connect_new(path, timeout, NULL, left, left, ret);
		tries++;
		if (r != -ECONNRESET && r != -EPIPE)
			break;
		/* without a call timeout an upgrade's drops still end: a socket that closes every
		 * connection without a word (not dlpackd's) is not tried forever */
		if (!end && tries >= DLPC_RECONNECT_DROPS_MAX) {
			snprintf(why, sizeof(why), "%s", dlpc_last_error());
			return dlpc__fail(
				r,
				"cannot connect to dlpackd at %s: it closed each of %u "
				"connections before answering HELLO (DLPC_RECONNECT_DROPS_MAX; "
				"%s sets no bound): %s",
				path, tries, DLPC_CALL_TIMEOUT_ENV, why);
		}
		if (end) {
			left = end - dlpc__mono_ms();
			if (left <= pause) {
				snprintf(why, sizeof(why), "%s", dlpc_last_error());
				return dlpc__fail(r,
						  "cannot connect to dlpackd at %s: it closed each "
						  "of %u connections before answering HELLO, for "
						  "%lld ms (%s): %s",
						  path, tries, (long long)timeout,
						  DLPC_CALL_TIMEOUT_ENV, why);
			}
			left -= pause;
		}
		if (dlpc__interrupted())
			return r;
		ts.tv_sec = (time_t)(pause / 1000);
		ts.tv_nsec = (long)(pause % 1000) * 1000000L;
		nanosleep(&ts, NULL);
		pause = pause * 2 < DLPC_RECONNECT_BACKOFF_MAX_MS ? pause * 2
								  : DLPC_RECONNECT_BACKOFF_MAX_MS;
	}
	return r;
}

/* Does an error of connecting to a socket say that no daemon of ours listens there (so that
 * dlpc_connect(NULL) may look further)? */
static bool nobody_there(int err)
{
	return err == -ENOENT || err == -ECONNREFUSED || err == -EACCES;
}

/* connect_dropped_again() to @p path, which @p rule named (NULL: the caller gave it), with a
 * refused connect()'s message saying who may connect (dlpc__access_hint()). */
static int connect_at(const char *path, const char *rule, int64_t timeout, dlpc_client **ret)
{
	char why[DLPC_ERROR_TEXT_MAX], hint[256] = "";
	int r = connect_dropped_again(path, timeout, ret);

	if (r >= 0 || (!rule && r != -EACCES))
		return r;
	snprintf(why, sizeof(why), "%s", dlpc_last_error());
	if (r == -EACCES)
		dlpc__access_hint(path, hint, sizeof(hint));
	return dlpc__fail(r, "%s%s%s%s%s", why, rule ? " (the path of " : "", rule ? rule : "",
			  rule ? ")" : "", hint);
}

/* The uid of the process at the other end of the connected socket @p sock: 0 or -errno. */
static int peer_uid(int sock, uid_t *uid)
{
	struct ucred cr;
	socklen_t len = sizeof(cr);

	if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0)
		return -errno;
	*uid = cr.uid;
	return 0;
}

/*
 * dlpc_connect(NULL): the places of dlpc__socket_candidates() in turn, going on to the next while
 * nobody listens at one (no socket, a stale one, or one this process may not use); a daemon that
 * answers but fails (refuses, times out) ends the search with its error. The message of a
 * failure names every path tried with its error.
 */
static int connect_default(int64_t timeout, dlpc_client **ret)
{
	struct dlpc__sockpath cand[DLPC__SOCKPATHS_MAX];
	char tried[DLPC_ERROR_TEXT_MAX] = "", why[DLPC_ERROR_TEXT_MAX], hint[256] = "";
	int n = dlpc__socket_candidates(cand), r = 0, err = 0;
	size_t off = 0;

	if (n < 0)
		return dlpc__fail(n, "$%s is longer than a socket address allows (%zu bytes)",
				  DLPC_SOCKET_ENV, sizeof(cand[0].path) - 1);
	if (cand[0].env)
		return connect_at(cand[0].path, cand[0].rule, timeout, ret);
	for (int i = 0; i < n; i++) {
		uid_t uid = 0;

		r = connect_dropped_again(cand[i].path, timeout, ret);
		/* the per-user socket counts only where its daemon runs as this process's uid: one
		 * that inherited another user's XDG_RUNTIME_DIR (su keeps it) must not take that
		 * user's daemon, which would hand it descriptors of its choosing, for its own */
		if (r >= 0 && i == 0 && n > 1 &&
		    (peer_uid((*ret)->sock, &uid) < 0 || uid != geteuid())) {
			dlpc_close(*ret);
			*ret = NULL;
			err = err == -EACCES ? err : -EPERM;
			off += (size_t)snprintf(tried + off, sizeof(tried) - off,
						"%s%s (%s): its daemon runs as uid %u, not as this "
						"process's uid %u",
						off ? "; " : "", cand[i].path, cand[i].rule,
						(unsigned)uid, (unsigned)geteuid());
			if (off >= sizeof(tried))
				off = sizeof(tried) - 1;
			continue;
		}
		if (r >= 0)
			return r;
		if (!nobody_there(r)) {
			if (!off)
				return r;
			snprintf(why, sizeof(why), "%s", dlpc_last_error());
			return dlpc__fail(r, "%s (tried first: %s)", why, tried);
		}
		if (r == -EACCES && !hint[0])
			dlpc__access_hint(cand[i].path, hint, sizeof(hint));
		if (err != -EACCES)
			err = r;
		off += (size_t)snprintf(tried + off, sizeof(tried) - off, "%s%s (%s): %s",
					off ? "; " : "", cand[i].path, cand[i].rule, strerror(-r));
		if (off >= sizeof(tried))
			off = sizeof(tried) - 1;
	}
	/* (the per-user socket is left out where XDG_RUNTIME_DIR is unset, or too long) */
	return dlpc__fail(err, "cannot connect to dlpackd: tried %s%s%s", tried,
			  n == DLPC__SOCKPATHS_MAX ? ""
			  : getenv("XDG_RUNTIME_DIR") && *getenv("XDG_RUNTIME_DIR")
				  ? " ($XDG_RUNTIME_DIR/" DLPC_USER_SOCKET_NAME
				    " is longer than a socket address allows)"
				  : " ($XDG_RUNTIME_DIR is not set)",
			  hint[0] ? hint
				  : "; no dlpackd listens there: start one (the service, or "
				    "'dlpackd' as yourself), or set $" DLPC_SOCKET_ENV
				    " to a daemon's socket");
}

DLPC_EXPORT int dlpc_connect_flags(const char *socket_path, uint32_t flags, dlpc_client **ret)
{
	int64_t timeout;
	int r;

	if (!ret)
		return dlpc__fail(-EINVAL, "dlpc_connect: ret is NULL");
	*ret = NULL;
	if (flags & ~(DLPC_CONNECT_RECONNECT | DLPC_CONNECT_NO_CACHE))
		return dlpc__fail(-EINVAL, "dlpc_connect_flags: unknown flags 0x%x",
				  flags & ~(DLPC_CONNECT_RECONNECT | DLPC_CONNECT_NO_CACHE));
	if (socket_path && strlen(socket_path) >= sizeof((*ret)->path))
		return dlpc__fail(-ENAMETOOLONG, "socket path %s is too long", socket_path);
	r = call_timeout_env(&timeout);
	if (r < 0)
		return r;
	r = socket_path ? connect_at(socket_path, NULL, timeout, ret)
			: connect_default(timeout, ret);
	if (r < 0)
		return r;
	(*ret)->reconnect = flags & DLPC_CONNECT_RECONNECT;
	(*ret)->no_cache = flags & DLPC_CONNECT_NO_CACHE;
	r = dlpc__cache_init(*ret, (*ret)->no_cache);
	if (r < 0) {
		dlpc_close(*ret);
		*ret = NULL;
	}
	return r;
}

DLPC_EXPORT int dlpc_connect(const char *socket_path, dlpc_client **ret)
{
	return dlpc_connect_flags(socket_path, 0, ret);
}

DLPC_EXPORT uint64_t dlpc_reconnects(const dlpc_client *c)
{
	uint64_t n;

	if (!c)
		return 0;
	pthread_mutex_lock((pthread_mutex_t *)&c->mu);
	n = c->epoch;
	pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
	return n;
}

DLPC_EXPORT int dlpc_inherited(const dlpc_client *c)
{
	return c && !dlpc__ours(c);
}

DLPC_EXPORT const char *dlpc_socket_path(const dlpc_client *c)
{
	return c ? c->path : NULL;
}

int dlpc__reconnect(dlpc_client *c, int64_t connect_ms, int64_t hello_ms)
{
	struct dlpc__rx rx;
	dlpc_client *n;
	eventfd_t v;
	int r = connect_new(c->path, c->call_timeout_ms, c, connect_ms, hello_ms, &n), sock;

	if (r < 0)
		return r;
	/* The new connection's socket and buffer become c's; c's old ones go with n. Whatever
	 * belonged to the old connection is void: its references (the daemon dropped them with
	 * it: releases of its epoch are dropped), the replies owed to abandoned calls, and the
	 * count of legacy CUDA IPC publications whose RECLAIM it would have carried (they are
	 * kept, as after any lost connection: nobody can say any more whether an attacher still
	 * uses them; only the new connection's own count from now on). The sockets change places
	 * under the lock of the open clients' list too, so that a fork meanwhile finds each
	 * listed once, and its child closes both. */
	pthread_mutex_lock(&c->wmu);
	pthread_mutex_lock(&c->mu);
	pthread_mutex_lock(&open_mu);
	sock = c->sock;
	c->sock = n->sock;
	n->sock = sock;
	pthread_mutex_unlock(&open_mu);
	rx = c->rx;
	c->rx = n->rx;
	n->rx = rx;
	c->minor = n->minor;
	c->broken = 0;
	c->fatal[0] = '\0';
	c->next_id = 0;
	c->nabandoned = 0;
	c->ipc_pubs = 0;
	c->nreclaimed = 0;
	atomic_store_explicit(&c->npending, 0, memory_order_relaxed);
	c->epoch++;
	eventfd_read(c->wake_fd, &v); /* a wake-up meant for the old connection's reader */
	/* the cached references died with the old connection; the new one may not speak 1.7 */
	dlpc__cache_drop(c);
	pthread_mutex_lock(&c->cache.mu);
	c->cache.on = !c->no_cache && !c->closed && c->minor >= 7 && c->cache.max_entries &&
		      c->cache.max_bytes && c->cache.idle_ms;
	pthread_mutex_unlock(&c->cache.mu);
	pthread_mutex_unlock(&c->mu);
	pthread_mutex_unlock(&c->wmu);
	dlpc__cache_reap(c);
	/* pooled buffers in flight on the old connection: their RECLAIM went with it */
	dlpc__pool_reset(c);
	/* the channels the old daemon knew: a new one knows them anew, or not at all */
	dlpc__direct_reset(c);
	/* n (now the old connection's) is listed: the library's thread may hold a reference */
	dlpc__client_unref(n);
	return 0;
}

DLPC_EXPORT const char *dlpc_version(void)
{
	return DLPD_VERSION;
}
