/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What a connection writes besides requests, and the lock its writes take: the releases and
 * marks deferred until the connection's next request (queued by deleters, which never wait for
 * a write), the CANCELs of waits given up on, and who sends them when (the holder of the write
 * lock as it lets go, a request in front of itself, the library's thread). Requests: call.c.
 */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include "core.h"

/* End the reader's wait for the socket (it then looks at the state of its call). */
void dlpc__wake_reader(dlpc_client *c)
{
	if (c->wake_fd >= 0 && eventfd_write(c->wake_fd, 1) < 0) {
		/* the counter cannot overflow here; nothing to do */
	}
}

bool dlpc__closed(dlpc_client *c)
{
	bool closed;

	pthread_mutex_lock(&c->mu);
	closed = c->closed;
	pthread_mutex_unlock(&c->mu);
	return closed;
}

/* (dlpc__send_within()'s stop) dlpc__closed() of client @p arg. */
static bool closed_meanwhile(void *arg)
{
	return dlpc__closed(arg);
}

int64_t dlpc__write_ms(const dlpc_client *c, const struct timespec *dl)
{
	int64_t t = c->call_timeout_ms, left;

	if (!dl)
		return t;
	left = dlpc__ms_left(dl);
	if (left < 1) /* (0 would mean no bound) */
		left = 1;
	return t <= 0 || left < t ? left : t;
}

int dlpc__send_frame(dlpc_client *c, const void *data, size_t len, const int *fds, unsigned nfds,
		     const struct timespec *dl, bool cancelable, size_t *sent)
{
	int r = dlpc__send_within(c->sock, data, len, fds, nfds, dlpc__write_ms(c, dl),
				  cancelable ? closed_meanwhile : NULL, c, sent);

	if (r < 0 && *sent > 0)
		(void)shutdown(c->sock, SHUT_WR);
	return r;
}

/* A write of @p c's that failed (@p r) after @p sent bytes left cut its frame short: that breaks
 * the stream, nothing may follow it. Without c->mu. */
static void cut_short(dlpc_client *c, int r, size_t sent)
{
	if (r >= 0 || sent == 0)
		return;
	pthread_mutex_lock(&c->mu);
	if (!c->broken)
		c->broken = r == -EAGAIN ? -ETIMEDOUT : r;
	pthread_cond_broadcast(&c->cv);
	dlpc__wake_reader(c);
	pthread_mutex_unlock(&c->mu);
}

/* The tags of the cache's marks in c->pending. */
#define MARKS (DLPC__MARK_CACHED | DLPC__MARK_USED)

/* c->npending is @p n now; an empty queue gives its array on the heap back. Under pmu. */
static void pending_set(dlpc_client *c, unsigned n)
{
	if (n == 0 && c->pending != c->pending_inline) {
		free(c->pending);
		c->pending = c->pending_inline;
		c->pending_cap = DLPC_RELEASE_PENDING_MAX;
	}
	atomic_store_explicit(&c->npending, n, memory_order_relaxed);
}

void dlpc__pending_drop(dlpc_client *c)
{
	pending_set(c, 0);
	atomic_store_explicit(&c->ncancels, 0, memory_order_relaxed);
}

/* Room in c->pending for one more past its @p n: false when out of memory. Under pmu. */
static bool pending_room(dlpc_client *c, unsigned n)
{
	unsigned cap = c->pending_cap * 2;
	uint64_t *p;

	if (n < c->pending_cap)
		return true;
	if (c->pending == c->pending_inline) {
		p = malloc(cap * sizeof(*p));
		if (p)
			memcpy(p, c->pending, n * sizeof(*p));
	} else {
		p = realloc(c->pending, cap * sizeof(*p));
	}
	if (!p)
		return false;
	c->pending = p;
	c->pending_cap = cap;
	return true;
}

/*
 * The first @p k of the @p n entries of c->pending stay after all (their frame did not leave),
 * ahead of those queued meanwhile. A mark queued meanwhile for a reference that one of the @p k
 * marks undoes it (both go) or repeats it (it goes): one frame never carries both marks of a
 * reference, as the daemon applies a frame's marks kind by kind, not in their order. The new
 * count. Under pmu.
 */
static unsigned pending_merge(dlpc_client *c, unsigned k, unsigned n)
{
	uint64_t *p = c->pending;
	unsigned to = 0;

	for (unsigned j = k; j < n; j++) {
		if (!(p[j] & MARKS))
			continue;
		for (unsigned i = 0; i < k; i++)
			if ((p[i] & MARKS) && (p[i] & ~MARKS) == (p[j] & ~MARKS)) {
				if (p[i] != p[j])
					p[i] = 0;
				p[j] = 0;
				break;
			}
	}
	/* no entry is 0 (a release of reference 0 is never queued, a mark is tagged): 0 is one
	 * that went */
	for (unsigned i = 0; i < n; i++)
		if (p[i])
			p[to++] = p[i];
	return to;
}

ssize_t dlpc__pending_frame(dlpc_client *c)
{
	Dlpackd__V1__Release msg = DLPACKD__V1__RELEASE__INIT;
	uint64_t rel[DLPC_RELEASE_PENDING_MAX], cached[DLPC_RELEASE_PENDING_MAX],
		used[DLPC_RELEASE_PENDING_MAX];
	unsigned n;
	ssize_t len;

	/* releases and the cache's marks (1.7) share the queue, told apart by tag bits */
	msg.ref_ids = rel;
	msg.cached_ids = cached;
	msg.used_ids = used;
	pthread_mutex_lock(&c->pmu);
	assert(c->nsending == 0);
	n = atomic_load_explicit(&c->npending, memory_order_relaxed);
	if (n > DLPC_RELEASE_PENDING_MAX)
		n = DLPC_RELEASE_PENDING_MAX;
	for (unsigned i = 0; i < n; i++) {
		uint64_t v = c->pending[i];

		if (v & DLPC__MARK_CACHED)
			cached[msg.n_cached_ids++] = v & ~DLPC__MARK_CACHED;
		else if (v & DLPC__MARK_USED)
			used[msg.n_used_ids++] = v & ~DLPC__MARK_USED;
		else
			rel[msg.n_ref_ids++] = v;
	}
	/* they stay where they are until the frame is gone: a mark does not undo them in place */
	c->nsending = n;
	pthread_mutex_unlock(&c->pmu);
	if (n == 0)
		return 0;
	/* framed without pmu: a deleter does not wait for the allocation */
	len = dlpc__msg_frame(&c->out, DLPC_MSG_RELEASE, 0, &msg.base, 0);
	if (len < 0)
		dlpc__pending_sent(c, false);
	return len;
}

void dlpc__pending_sent(dlpc_client *c, bool gone)
{
	unsigned k, n;

	pthread_mutex_lock(&c->pmu);
	k = c->nsending;
	n = atomic_load_explicit(&c->npending, memory_order_relaxed);
	c->nsending = 0;
	if (gone) {
		memmove(c->pending, c->pending + k, (n - k) * sizeof(*c->pending));
		n -= k;
	} else {
		n = pending_merge(c, k, n);
	}
	pending_set(c, n);
	pthread_mutex_unlock(&c->pmu);
}

/* Has @p c room to write now (without waiting)? */
static bool has_room(dlpc_client *c)
{
	return poll(&(struct pollfd){.fd = c->sock, .events = POLLOUT}, 1, 0) == 1;
}

/* A flush that must not wait found no room in @p c's socket: the library's thread waits for
 * room in it and flushes then (serve.c). Without that thread, the next request carries them. */
static void await_room(dlpc_client *c)
{
	atomic_store(&c->await_room, true);
	(void)dlpc__loop_start();
}

/*
 * Send @p c's queued CANCELs, after its releases, one frame each, as dlpc__flush_locked() says.
 * Under wmu: the only thread that takes them off the queue.
 */
static void send_cancels(dlpc_client *c, enum dlpc__flush how, const struct timespec *dl)
{
	Dlpackd__V1__Cancel msg = DLPACKD__V1__CANCEL__INIT;

	while (atomic_load_explicit(&c->ncancels, memory_order_relaxed)) {
		size_t sent = 0;
		unsigned n;
		ssize_t len;
		int r;

		if (how == DLPC__FLUSH_NOWAIT && !has_room(c)) {
			await_room(c);
			return;
		}
		pthread_mutex_lock(&c->pmu);
		msg.request_id = c->cancels[0];
		pthread_mutex_unlock(&c->pmu);
		len = dlpc__msg_frame(&c->out, DLPC_MSG_CANCEL, 0, &msg.base, 0);
		r = len < 0 ? (int)len
			    : dlpc__send_frame(c, c->out.p, (size_t)len, NULL, 0, dl,
					       how == DLPC__FLUSH_CANCELABLE, &sent);
		/* nothing left, and the connection lives (or no memory for the frame): kept */
		if (r < 0 && sent == 0 && r != -EPIPE && r != -ECONNRESET && r != -EBADF) {
			(void)dlpc__loop_flush_soon(false);
			return;
		}
		pthread_mutex_lock(&c->pmu);
		n = atomic_load_explicit(&c->ncancels, memory_order_relaxed);
		if (r < 0) { /* the connection went, and its waits with it */
			n = 0;
		} else {
			memmove(c->cancels, c->cancels + 1, (n - 1) * sizeof(*c->cancels));
			n--;
		}
		atomic_store_explicit(&c->ncancels, n, memory_order_relaxed);
		pthread_mutex_unlock(&c->pmu);
		if (r < 0) {
			cut_short(c, r, sent);
			return;
		}
	}
}

/*
 * Send @p c's deferred releases now, those queued when it starts, a frame at a time, as @p how
 * says, then its queued CANCELs. Under wmu. A write cut short, or a connection gone, takes the references with it: none
 * is pending any more. A frame that could not be built, or of which nothing left on a live
 * connection (the daemon took none of it in time, the kernel had no memory), keeps them, and the
 * library's thread tries again after DLPC_RELEASE_DELAY_MS (or the next request carries them).
 */
void dlpc__flush_locked(dlpc_client *c, enum dlpc__flush how, const struct timespec *dl)
{
	unsigned left = atomic_load_explicit(&c->npending, memory_order_relaxed);
	size_t sent;
	ssize_t len;
	bool broken;
	int r;

	if (how == DLPC__FLUSH_NOWAIT &&
	    (left || atomic_load_explicit(&c->ncancels, memory_order_relaxed))) {
		pthread_mutex_lock(&c->mu);
		broken = c->broken;
		pthread_mutex_unlock(&c->mu);
		/* (a socket shut by a frame cut short never polls writable again) */
		if (broken) {
			pthread_mutex_lock(&c->pmu);
			pending_set(c, 0);
			atomic_store_explicit(&c->ncancels, 0, memory_order_relaxed);
			pthread_mutex_unlock(&c->pmu);
			return;
		}
	}
	while (left) {
		/* no room (a daemon that does not read, for now or for good): this thread would
		 * wait for the call timeout; where it polls writable, three quarters of the buffer
		 * are free, and a release frame goes out whole at once */
		if (how == DLPC__FLUSH_NOWAIT && !has_room(c)) {
			await_room(c);
			return;
		}
		len = dlpc__pending_frame(c);
		/* none left (a mark undid the last), or out of memory for the frame: keep them
		 * rather than lose them, and try again later; the CANCELs go either way */
		if (len < 0)
			(void)dlpc__loop_flush_soon(false);
		if (len <= 0)
			break;
		r = dlpc__send_frame(c, c->out.p, (size_t)len, NULL, 0, dl,
				     how == DLPC__FLUSH_CANCELABLE, &sent);
		/* nothing left, and the connection lives: keep them, for later */
		if (r < 0 && sent == 0 && r != -EPIPE && r != -ECONNRESET && r != -EBADF) {
			dlpc__pending_sent(c, false);
			(void)dlpc__loop_flush_soon(false);
			return;
		}
		dlpc__pending_sent(c, true);
		if (r < 0) {
			pthread_mutex_lock(&c->pmu);
			pending_set(c, 0);
			atomic_store_explicit(&c->ncancels, 0, memory_order_relaxed);
			pthread_mutex_unlock(&c->pmu);
			cut_short(c, r, sent);
			return;
		}
		left -= left < DLPC_RELEASE_PENDING_MAX ? left : DLPC_RELEASE_PENDING_MAX;
	}
	send_cancels(c, how, dl);
}

/* Did a flush that found wmu held leave its work to the holder (dlpc__flush_nowait())? */
static bool flush_asked(dlpc_client *c)
{
	bool asked;

	pthread_mutex_lock(&c->pmu);
	asked = c->flush_asked;
	pthread_mutex_unlock(&c->pmu);
	return asked;
}

/* Do the flush that was asked of the holder of wmu, without waiting for room. Under wmu. */
static void flush_as_asked(dlpc_client *c)
{
	pthread_mutex_lock(&c->pmu);
	c->flush_asked = false;
	pthread_mutex_unlock(&c->pmu);
	dlpc__flush_locked(c, DLPC__FLUSH_NOWAIT, NULL);
}

/*
 * The flag is read under pmu after wmu is let go, and set under pmu before wmu is tried
 * (dlpc__flush_nowait()): either the holder sees it here, or its unlock came first and the
 * try finds wmu free (or held by a later holder, which looks here in turn). So a flush left to
 * the holder is never left behind.
 */
void dlpc__write_unlock(dlpc_client *c)
{
	for (;;) {
		pthread_mutex_unlock(&c->wmu);
		if (!flush_asked(c) || pthread_mutex_trylock(&c->wmu) != 0)
			return;
		flush_as_asked(c);
	}
}

void dlpc__write_unlock_failed(dlpc_client *c)
{
	pthread_mutex_unlock(&c->wmu);
	/* the flag stays: whoever takes wmu next, or the library's thread, sends them */
	if (flush_asked(c))
		(void)dlpc__loop_flush_soon(false);
}

void dlpc__flush_nowait(dlpc_client *c)
{
	if (!atomic_load_explicit(&c->npending, memory_order_relaxed) &&
	    !atomic_load_explicit(&c->ncancels, memory_order_relaxed))
		return;
	pthread_mutex_lock(&c->pmu);
	c->flush_asked = true;
	pthread_mutex_unlock(&c->pmu);
	/* held: its holder sends them as it lets go (dlpc__write_unlock()) */
	if (pthread_mutex_trylock(&c->wmu) != 0)
		return;
	flush_as_asked(c);
	dlpc__write_unlock(c);
}

static bool pending_lock(dlpc_client *c, uint64_t conn_seq);

void dlpc__cancel_wait(dlpc_client *c, uint16_t type, uint32_t id, uint64_t conn_seq)
{
	unsigned n;

	if (type != DLPC_MSG_ATTACH && type != DLPC_MSG_RECV && type != DLPC_MSG_SEND)
		return;
	/* a request of a connection replaced since died with it */
	if (!pending_lock(c, conn_seq))
		return;
	n = atomic_load_explicit(&c->ncancels, memory_order_relaxed);
	if (n < DLPC_CANCELS_PENDING_MAX) {
		c->cancels[n] = id;
		atomic_store_explicit(&c->ncancels, n + 1, memory_order_relaxed);
	}
	pthread_mutex_unlock(&c->pmu);
	/* sent now if the socket has room and no other thread writes; else by the writer as it
	 * lets go, or by the library's thread */
	dlpc__flush_nowait(c);
}

/*
 * Queue @p v (a reference id, maybe tagged) on c->pending and see that it goes out. Under pmu,
 * which this releases. A deleter runs this, from any thread, maybe one that must not wait (a
 * garbage collector's, holding an interpreter's lock): it writes nothing and waits for no write
 * of another thread's, however stuck. The library's thread sends the first of a quiet spell
 * after DLPC_RELEASE_DELAY_MS and a frame's worth at once, unless a request carries them
 * first; where that thread cannot run (a process at its thread limit), they go from here,
 * unless another thread writes: that one sends them as it lets go of wmu.
 */
static void pending_add(dlpc_client *c, uint64_t v)
{
	unsigned n = atomic_load_explicit(&c->npending, memory_order_relaxed), waiting;

	/* out of memory: this reference stays with the daemon until the connection closes */
	if (!pending_room(c, n)) {
		pthread_mutex_unlock(&c->pmu);
		return;
	}
	c->pending[n++] = v;
	atomic_store_explicit(&c->npending, n, memory_order_relaxed);
	/* those that no frame being written carries */
	waiting = n - c->nsending;
	pthread_mutex_unlock(&c->pmu);
	if (waiting != 1 && waiting % DLPC_RELEASE_PENDING_MAX)
		return;
	if (!dlpc__loop_flush_soon(waiting > 1))
		dlpc__flush_nowait(c);
}

/*
 * Take c->pmu to queue something about a reference of connection @p conn_seq: true. false (no
 * lock taken) in a forked child, where the reference is the parent's (the daemon drops it when
 * the parent releases it or goes away), and when @p c has connected anew since: the reference
 * died with its connection, and its id may name another now.
 */
static bool pending_lock(dlpc_client *c, uint64_t conn_seq)
{
	if (!dlpc__ours(c))
		return false;
	pthread_mutex_lock(&c->pmu);
	if (conn_seq != c->conn_seq) {
		pthread_mutex_unlock(&c->pmu);
		return false;
	}
	return true;
}

void dlpc__mark_ref(dlpc_client *c, uint64_t ref_id, uint64_t conn_seq, bool cached)
{
	uint64_t v = ref_id | (cached ? DLPC__MARK_CACHED : DLPC__MARK_USED);
	uint64_t undo = ref_id | (cached ? DLPC__MARK_USED : DLPC__MARK_CACHED);
	unsigned n;

	if (!pending_lock(c, conn_seq))
		return;
	/* a mark not sent yet that this one undoes goes instead: a re-attach loop queues nothing
	 * more than its last release's mark. Not one of the frame being written: this one
	 * follows it. */
	n = atomic_load_explicit(&c->npending, memory_order_relaxed);
	for (unsigned i = c->nsending; i < n; i++)
		if (c->pending[i] == undo || c->pending[i] == v) {
			if (c->pending[i] == undo) {
				c->pending[i] = c->pending[n - 1];
				pending_set(c, n - 1);
			}
			pthread_mutex_unlock(&c->pmu);
			return;
		}
	pending_add(c, v);
}

void dlpc__release_ref(dlpc_client *c, uint64_t ref_id, uint64_t conn_seq)
{
	/* a direct channel's message holds no reference of the daemon's */
	if (ref_id == 0)
		return;
	if (!pending_lock(c, conn_seq))
		return;
	pending_add(c, ref_id);
}
