/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Requests and replies: ids, matching replies to callers across threads (one reader at a time,
 * leader/follower), deadlines on the client side, calls abandoned by their deadline or by
 * dlpc_close() (their late replies dropped), and replies whose fds this process had no room for.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* A request waiting for its reply. Lives on its caller's stack. */
struct dlpc__call {
	struct dlpc__call *next;
	uint32_t id;
	bool done;
	bool canceled; /* by dlpc_close(): already unlinked, its id abandoned */
	uint16_t type;
	uint8_t *payload;
	size_t len;
	int fds[DLPC_FRAME_FDS_MAX];
	unsigned nfds;
	unsigned lost;	/* fds of the reply this process had no room for */
	uint64_t epoch; /* the connection (c->epoch) the request went out on */
};

/* End the reader's wait for the socket (it then looks at the state of its call). */
void dlpc__wake_reader(dlpc_client *c)
{
	if (c->wake_fd >= 0 && eventfd_write(c->wake_fd, 1) < 0) {
		/* the counter cannot overflow here; nothing to do */
	}
}

/* Remember that nobody waits for the reply to @p id any more. false if out of memory. Under
 * c->mu. */
static bool abandon(dlpc_client *c, uint32_t id)
{
	if (c->nabandoned == c->abandoned_cap) {
		size_t cap = c->abandoned_cap ? c->abandoned_cap * 2 : 8;
		uint32_t *v = realloc(c->abandoned, cap * sizeof(*v));

		if (!v)
			return false;
		c->abandoned = v;
		c->abandoned_cap = cap;
	}
	c->abandoned[c->nabandoned++] = id;
	return true;
}

/* Was the reply to @p id abandoned? Unless @p keep, forget the id then (its reply has come).
 * Under c->mu. */
static bool take_abandoned(dlpc_client *c, uint32_t id, bool keep)
{
	for (size_t i = 0; i < c->nabandoned; i++)
		if (c->abandoned[i] == id) {
			if (!keep)
				c->abandoned[i] = c->abandoned[--c->nabandoned];
			return true;
		}
	return false;
}

/* The reference an ATTACH or RECV reply grants (to be released by whoever cannot use it), or 0. */
static uint64_t reply_ref(uint16_t type, const uint8_t *payload, size_t len)
{
	Dlpackd__V1__AttachReply *m;
	uint64_t ref;

	/* a RECV reply is an AttachReply too: the message it carried is freed with it */
	if (type != (DLPC_MSG_ATTACH | DLPC_MSG_REPLY) && type != (DLPC_MSG_RECV | DLPC_MSG_REPLY))
		return 0;
	m = dlpackd__v1__attach_reply__unpack(NULL, len, payload);
	if (!m)
		return 0;
	ref = m->ref_id;
	dlpackd__v1__attach_reply__free_unpacked(m, NULL);
	return ref;
}

/*
 * For dlpc_close(): no call starts on @p c any more, and every call still waiting for its reply
 * gives up with -ECANCELED. Its caller still holds its own reference on @p c, so waking it is
 * safe; its id is abandoned, so a reply that comes later is dropped (and an ATTACH reply's
 * reference released) instead of being written into the caller's stack.
 */
void dlpc__cancel_calls(dlpc_client *c)
{
	struct dlpc__call **pp;

	pthread_mutex_lock(&c->mu);
	c->closed = true;
	for (pp = &c->calls; *pp;) {
		struct dlpc__call *call = *pp;

		/* a call whose reply has come already finishes as it would have */
		if (call->done) {
			pp = &call->next;
			continue;
		}
		*pp = call->next;
		call->canceled = true;
		if (!abandon(c, call->id) && !c->broken)
			c->broken = -ENOMEM; /* its reply could no longer be matched */
	}
	/* a HELLO to a daemon that does not answer (a socket activated while its daemon is yet
	 * to start) ends too. Lock order: c->mu before the new connection's. */
	if (c->connecting)
		dlpc__cancel_calls(c->connecting);
	pthread_cond_broadcast(&c->cv);
	dlpc__wake_reader(c);
	/* and every wait on a direct channel's end */
	if (c->direct_wake >= 0 && eventfd_write(c->direct_wake, 1) < 0) {
		/* the counter cannot overflow here; nothing to do */
	}
	pthread_mutex_unlock(&c->mu);
}

/* The connection is gone: say why, in the daemon's words when it left some. Called with c->mu. */
static int conn_error(dlpc_client *c, int err)
{
	if (c->fatal[0])
		return dlpc__fail(err, "connection to dlpackd lost: dlpackd said: %s", c->fatal);
	return dlpc__fail(err, "connection to dlpackd lost: %s", strerror(-err));
}

/* Queue the tokens of a RECLAIM notice for the library's thread. Called with c->mu held. */
static int take_reclaim(dlpc_client *c, const struct dlpc__frame *f)
{
	Dlpackd__V1__Reclaim *m = dlpackd__v1__reclaim__unpack(NULL, f->hdr.len, f->payload);
	int r = 0;

	if (!m || m->n_tokens > DLPC_RECLAIM_BATCH_MAX) {
		r = -EPROTO;
		goto out;
	}
	if (c->nreclaimed + m->n_tokens > c->reclaimed_cap) {
		size_t cap = c->nreclaimed + m->n_tokens + 16;
		uint64_t *v = realloc(c->reclaimed, cap * sizeof(*v));

		if (!v) {
			r = -ENOMEM;
			goto out;
		}
		c->reclaimed = v;
		c->reclaimed_cap = cap;
	}
	for (size_t i = 0; i < m->n_tokens; i++) {
		/* a recycled channel buffer (pool.c) is free again; the rest is CUDA's */
		if (m->tokens[i] & DLPC__POOL_TOKEN)
			dlpc__pool_reclaimed(c, m->tokens[i]);
		else
			c->reclaimed[c->nreclaimed++] = m->tokens[i];
	}
	/* the library's thread runs the deleters (loop.c) */
	dlpc__loop_wake();
out:
	if (m)
		dlpackd__v1__reclaim__free_unpacked(m, NULL);
	return r;
}

/*
 * Hand a received frame to the call waiting for it: 0. Or drop the reply to a call whose caller
 * gave up: 1, with *@p drop set to the reference an ATTACH reply granted, for the reader to
 * release once it has let go of c->mu (the frame's fds are closed with it). Called with c->mu
 * held.
 */
static int deliver(dlpc_client *c, struct dlpc__frame *f, uint64_t *drop)
{
	struct dlpc__call *call;

	if (f->hdr.id == 0 && f->hdr.type == DLPC_MSG_RECLAIM)
		return take_reclaim(c, f);
	if (f->hdr.id == 0 && f->hdr.type == DLPC_MSG_INVALIDATE)
		return dlpc__cache_invalidate(c, f) < 0 ? -EPROTO : 1;
	if (f->hdr.id == 0 && f->hdr.type == DLPC_MSG_ERROR) {
		Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, f->hdr.len, f->payload);

		snprintf(c->fatal, sizeof(c->fatal), "%s", e ? e->message : "(malformed ERROR)");
		c->fatal_code = e && e->code > 0 ? e->code : 0;
		if (e)
			dlpackd__v1__error__free_unpacked(e, NULL);
		return -EPROTO;
	}
	for (call = c->calls; call; call = call->next)
		if (call->id == f->hdr.id && !call->done)
			break;
	if (!call && f->hdr.id != 0 && take_abandoned(c, f->hdr.id, false)) {
		*drop = reply_ref(f->hdr.type, f->payload, f->hdr.len);
		return 1;
	}
	if (!call)
		return -EPROTO;
	call->payload = malloc(f->hdr.len ? f->hdr.len : 1);
	if (!call->payload)
		return -ENOMEM;
	memcpy(call->payload, f->payload, f->hdr.len);
	call->len = f->hdr.len;
	call->type = f->hdr.type;
	call->nfds = f->nfds;
	call->lost = f->lost;
	for (unsigned i = 0; i < f->nfds; i++)
		call->fds[i] = dlpc__frame_take_fd(f, i);
	call->done = true;
	return 0;
}

/* Milliseconds until @p dl (CLOCK_MONOTONIC), rounded up, for poll(); 0 once it has passed. */
static int ms_until(const struct timespec *dl)
{
	struct timespec now;
	int64_t ns;

	clock_gettime(CLOCK_MONOTONIC, &now);
	ns = (int64_t)(dl->tv_sec - now.tv_sec) * 1000000000 + (dl->tv_nsec - now.tv_nsec);
	if (ns <= 0)
		return 0;
	return ns >= (int64_t)INT32_MAX * 1000000 ? INT32_MAX : (int)((ns + 999999) / 1000000);
}

/* Has @p dl passed? */
static bool passed(const struct timespec *dl)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return now.tv_sec > dl->tv_sec || (now.tv_sec == dl->tv_sec && now.tv_nsec >= dl->tv_nsec);
}

/* Does @p a come after @p b? */
static bool later(const struct timespec *a, const struct timespec *b)
{
	return a->tv_sec > b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec > b->tv_nsec);
}

/* @p ms from now on CLOCK_MONOTONIC. */
static void deadline_in(struct timespec *dl, int64_t ms)
{
	clock_gettime(CLOCK_MONOTONIC, dl);
	dl->tv_sec += (time_t)(ms / 1000);
	dl->tv_nsec += (long)(ms % 1000) * 1000000;
	if (dl->tv_nsec >= 1000000000) {
		dl->tv_sec++;
		dl->tv_nsec -= 1000000000;
	}
}

/* The calling thread's interrupt check (dlpc_set_interrupt()). */
static __thread dlpc_interrupt_fn interrupt_fn;
static __thread void *interrupt_arg;

int dlpc__pause_lost(dlpc_client *c, int64_t ms)
{
	struct timespec until;
	bool closed;

	deadline_in(&until, ms);
	pthread_mutex_lock(&c->mu);
	while (!c->closed && !passed(&until))
		pthread_cond_timedwait(&c->cv, &c->mu, &until);
	closed = c->closed;
	pthread_mutex_unlock(&c->mu);
	if (closed)
		return dlpc__fail(-ECANCELED,
				  "this client was closed or canceled (dlpc_close() or "
				  "dlpc_cancel()) while waiting for dlpackd to come back");
	if (dlpc__interrupted())
		return dlpc__fail(-EINTR, "interrupted while waiting for dlpackd to come back");
	return 0;
}

DLPC_EXPORT void dlpc_set_interrupt(dlpc_interrupt_fn fn, void *arg)
{
	interrupt_fn = fn;
	interrupt_arg = arg;
}

bool dlpc__interrupted(void)
{
	return interrupt_fn && interrupt_fn(interrupt_arg);
}

bool dlpc__interrupt_set(void)
{
	return interrupt_fn != NULL;
}

/* When the thread's interrupt check is next due (set as each call starts, and after each check). */
static __thread struct timespec check_due;

/* What read_frames() returns when a signal interrupted its wait: the check runs at once. */
#define CHECK_INTERRUPT 3

/* How long to wait at most before the next look at @p dl and the interrupt check. */
static int poll_ms(const struct timespec *dl)
{
	int ms = dl ? ms_until(dl) : -1;

	if (interrupt_fn) {
		int due = ms_until(&check_due);

		if (ms < 0 || due < ms)
			ms = due;
	}
	return ms;
}

/*
 * The reader's turn: parse what is buffered, reading more until at least one frame has been
 * delivered (0). Replies to abandoned calls are dropped on the way. A WATCH reply ends the turn
 * at once: the frames behind it are events, left in the buffer for the watch. The turn also ends
 * (1) when @p dl (NULL: none) passes, the interrupt check falls due or c->wake_fd is signalled
 * with nothing delivered, and (CHECK_INTERRUPT) when a signal interrupts the wait and there is
 * an interrupt check to run. A negative errno: the connection is lost. Called without c->mu,
 * as the reader of connection @p epoch (no other can replace it meanwhile).
 */
static int read_frames(dlpc_client *c, const struct timespec *dl, uint64_t epoch)
{
	char why[160];

	for (;;) {
		struct pollfd p[2] = {{.fd = c->sock, .events = POLLIN},
				      {.fd = c->wake_fd, .events = POLLIN}};
		struct dlpc__frame f;
		int delivered = 0, r;
		ssize_t n;

		while ((r = dlpc__rx_next(&c->rx, &f, why, sizeof(why))) == 1) {
			bool watch = f.hdr.type == (DLPC_MSG_WATCH | DLPC_MSG_REPLY);
			bool inval = f.hdr.type == DLPC_MSG_INVALIDATE;
			uint64_t drop = 0;

			pthread_mutex_lock(&c->mu);
			r = deliver(c, &f, &drop);
			pthread_mutex_unlock(&c->mu);
			dlpc__frame_clear(&f);
			if (drop)
				dlpc__release_epoch(c, drop, epoch);
			if (inval)
				dlpc__cache_reap(c);
			if (r < 0)
				return r;
			if (r == 0)
				delivered++;
			if (watch && r == 0)
				return 0;
		}
		if (r < 0)
			return r;
		if (delivered)
			return 0;
		r = poll(p, 2, poll_ms(dl));
		/* the check runs once the reader's turn is given up (dlpc__reader_turn()): it may
		 * run code that calls the library on this very client */
		if (interrupt_fn && r < 0 && errno == EINTR)
			return CHECK_INTERRUPT;
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0)
			return -errno;
		if (p[1].revents) {
			eventfd_t v;

			eventfd_read(c->wake_fd, &v);
			return 1;
		}
		if (r == 0)
			return 1;
		n = dlpc__rx_read(&c->rx, c->sock, why, sizeof(why));
		if (n == 0)
			return -ECONNRESET;
		if (n < 0 && n != -EAGAIN)
			return (int)n;
	}
}

/*
 * Deliver every frame the socket holds now, without waiting: 0, or a negative errno when the
 * connection is lost. As the reader of connection @p epoch, without c->mu.
 */
static int read_ready(dlpc_client *c, uint64_t epoch)
{
	char why[160];

	for (;;) {
		struct dlpc__frame f;
		ssize_t n;
		int r;

		while ((r = dlpc__rx_next(&c->rx, &f, why, sizeof(why))) == 1) {
			bool inval = f.hdr.type == DLPC_MSG_INVALIDATE;
			uint64_t drop = 0;

			pthread_mutex_lock(&c->mu);
			r = deliver(c, &f, &drop);
			pthread_mutex_unlock(&c->mu);
			dlpc__frame_clear(&f);
			if (drop)
				dlpc__release_epoch(c, drop, epoch);
			if (inval)
				dlpc__cache_reap(c);
			if (r < 0)
				return r;
		}
		if (r < 0)
			return r;
		n = dlpc__rx_read_flags(&c->rx, c->sock, MSG_DONTWAIT, why, sizeof(why));
		if (n == -EAGAIN)
			return 0;
		if (n == 0)
			return -ECONNRESET;
		if (n < 0)
			return (int)n;
	}
}

int dlpc__drain(dlpc_client *c, bool closed_ok)
{
	uint64_t epoch;
	int r;

	pthread_mutex_lock(&c->mu);
	/* a reader (another call's thread, the library's) may hold frames it has not delivered
	 * yet, or be about to read them: nothing here can vouch for what it has not seen */
	if (c->reading || c->broken || (c->closed && !closed_ok)) {
		pthread_mutex_unlock(&c->mu);
		return 0;
	}
	c->reading = true;
	epoch = c->epoch;
	pthread_mutex_unlock(&c->mu);
	r = read_ready(c, epoch);
	pthread_mutex_lock(&c->mu);
	c->reading = false;
	if (r < 0 && !c->broken)
		c->broken = r;
	pthread_cond_broadcast(&c->cv);
	pthread_mutex_unlock(&c->mu);
	return r == 0;
}

int dlpc__reader_turn(dlpc_client *c, const struct timespec *dl)
{
	bool now = false, stop;
	int r;

	if (c->reading) {
		struct timespec until;

		if (!interrupt_fn) {
			if (dl)
				pthread_cond_timedwait(&c->cv, &c->mu, dl);
			else
				pthread_cond_wait(&c->cv, &c->mu);
			return 0;
		}
		until = check_due;
		if (dl && later(&until, dl))
			until = *dl;
		pthread_cond_timedwait(&c->cv, &c->mu, &until);
	} else {
		uint64_t epoch = c->epoch;

		c->reading = true;
		pthread_mutex_unlock(&c->mu);
		r = read_frames(c, dl, epoch);
		pthread_mutex_lock(&c->mu);
		c->reading = false;
		if (r < 0 && !c->broken)
			c->broken = r;
		pthread_cond_broadcast(&c->cv);
		now = r == CHECK_INTERRUPT;
	}
	/* at most every DLPC_INTERRUPT_CHECK_MS however often frames wake the caller, and at once
	 * after a signal; not under c->mu: the check may take locks of its own (a language
	 * runtime's) or call the library itself */
	if (!interrupt_fn || !(now || passed(&check_due)))
		return 0;
	pthread_mutex_unlock(&c->mu);
	stop = dlpc__interrupted();
	pthread_mutex_lock(&c->mu);
	deadline_in(&check_due, DLPC_INTERRUPT_CHECK_MS);
	return stop ? DLPC__INTERRUPTED : 0;
}

static void unlink_call(dlpc_client *c, struct dlpc__call *call)
{
	struct dlpc__call **pp = &c->calls;

	while (*pp != call)
		pp = &(*pp)->next;
	*pp = call->next;
}

/*
 * Write a request frame, with the deferred releases in front of it in the same write when the
 * request carries no fds (fds must ride with the first byte of their own frame, so a request
 * with fds sends the releases first, on their own). Under wmu. Returns 0 or a negative errno;
 * @p sent counts the request's bytes that left.
 */
static int send_request(dlpc_client *c, uint16_t type, uint32_t id, const ProtobufCMessage *req,
			const int *fds, unsigned nfds, size_t *sent)
{
	ssize_t at = 0, len;
	size_t out = 0;
	int r;

	*sent = 0;
	if (atomic_load_explicit(&c->npending, memory_order_relaxed)) {
		if (nfds)
			dlpc__flush_locked(c);
		else
			at = dlpc__pending_frame(c);
		if (at < 0) /* out of memory: send them on their own, a frame at a time */
			at = 0, dlpc__flush_locked(c);
	}
	len = dlpc__msg_frame_at(&c->out, (size_t)at, type, id, req, NULL, 0, nfds);
	if (len < 0) {
		/* the request is refused before anything left: the releases still go */
		if (at)
			dlpc__flush_locked(c);
		return (int)len;
	}
	r = dlpc__send_counted(c->sock, c->out.p, (size_t)len, fds, nfds, &out);
	if (at && out >= (size_t)at)
		atomic_store_explicit(&c->npending, 0, memory_order_relaxed);
	*sent = out > (size_t)at ? out - (size_t)at : 0;
	/* a write cut inside the releases has broken the stream just the same */
	if (r < 0 && out > 0 && *sent == 0)
		*sent = 1;
	return r;
}

/* Why a call stopped waiting before its reply came: the message, and the return value. */
static int call_gave_up(uint16_t type, int64_t bound, int64_t wait_ms)
{
	char name[32];

	dlpc__msg_name(type, name, sizeof(name));
	if (wait_ms > 0)
		return dlpc__fail(-ETIMEDOUT,
				  "dlpackd did not answer %s within %lld ms (its %lld ms wait plus "
				  "%d ms grace): it may be stopped or overloaded",
				  name, (long long)bound, (long long)wait_ms, DLPC_CALL_GRACE_MS);
	return dlpc__fail(-ETIMEDOUT,
			  "dlpackd did not answer %s within %lld ms (%s): it may be stopped or "
			  "overloaded",
			  name, (long long)bound, DLPC_CALL_TIMEOUT_ENV);
}

/* The thread's interrupt check ended the wait for the reply. */
static int call_interrupted(uint16_t type)
{
	char name[32];

	dlpc__msg_name(type, name, sizeof(name));
	return dlpc__fail(-EINTR,
			  "interrupted while waiting for dlpackd to answer %s (the request may "
			  "still take effect)",
			  name);
}

/*
 * The thread's interrupt check said to give up (under c->mu, which this releases). That is the
 * call's result whatever came meanwhile (its reply, a cancel, a broken connection): the check
 * may have left its own error (a language runtime's exception) for the caller to report. A
 * reply that came is dropped as a late one would be, and the reference it grants given back.
 */
static int call_stopped(dlpc_client *c, struct dlpc__call *call, uint16_t type)
{
	bool waits = false;
	uint64_t ref = 0;

	if (!call->canceled) /* dlpc_close() or dlpc_cancel() unlinked it and abandoned its id */
		unlink_call(c, call);
	if (!call->done && !call->canceled && !c->broken && !abandon(c, call->id))
		c->broken = -ENOMEM; /* the reply could no longer be matched */
	waits = !call->done && !c->broken;
	pthread_mutex_unlock(&c->mu);
	if (waits)
		dlpc__cancel_wait(c, type, call->id, call->epoch);
	if (call->done) {
		ref = reply_ref(call->type, call->payload, call->len);
		for (unsigned i = 0; i < call->nfds; i++)
			close(call->fds[i]);
		free(call->payload);
		/* the reference is the connection's the request went out on: another thread may
		 * have connected anew since c->mu was let go */
		if (ref)
			dlpc__release_epoch(c, ref, call->epoch);
	}
	return call_interrupted(type);
}

/* The reply's fds could not be received: give back what it granted, and say why. */
static int fds_lost(dlpc_client *c, const struct dlpc__call *call)
{
	uint64_t ref = reply_ref(call->type, call->payload, call->len);
	struct rlimit rl = {0};

	/* of the connection the request went out on, which may have been replaced already */
	if (ref)
		dlpc__release_epoch(c, ref, call->epoch);
	getrlimit(RLIMIT_NOFILE, &rl);
	if (rl.rlim_cur == RLIM_INFINITY)
		return dlpc__fail(-EMFILE,
				  "no free file descriptor to receive the one dlpackd sent (the "
				  "kernel refused to install it)%s",
				  ref ? "; the reference was given back" : "");
	return dlpc__fail(-EMFILE,
			  "no free file descriptor to receive the one dlpackd sent: this process "
			  "has reached its limit of %llu open files (RLIMIT_NOFILE)%s",
			  (unsigned long long)rl.rlim_cur,
			  ref ? "; the reference was given back" : "");
}

/*
 * How long connecting anew before a call that the daemon may hold for @p wait_ms may take: HELLO
 * as long as the call itself may wait (the time left of a waiting call's wait, if shorter),
 * connect() likewise, and for a waiting call at most DLPC_RECONNECT_BACKOFF_MAX_MS at a time (a
 * full backlog cannot be woken by dlpc_close(): the call tries again after its pause). <= 0: no
 * bound.
 */
static void reconnect_bounds(const dlpc_client *c, int64_t wait_ms, int64_t *connect_ms,
			     int64_t *hello_ms)
{
	int64_t t = c->call_timeout_ms;

	*hello_ms = wait_ms > 0 && (t <= 0 || wait_ms < t) ? wait_ms : t;
	*connect_ms = *hello_ms;
	if (wait_ms != 0 && (*connect_ms <= 0 || *connect_ms > DLPC_RECONNECT_BACKOFF_MAX_MS))
		*connect_ms = DLPC_RECONNECT_BACKOFF_MAX_MS;
}

/* A call found dlpc_close() or dlpc_cancel() called. Under c->mu, which this releases. */
static int call_closed(dlpc_client *c)
{
	pthread_mutex_unlock(&c->mu);
	return dlpc__fail(-ECANCELED,
			  "this client was closed or canceled (dlpc_close() or dlpc_cancel())");
}

/* dlpc__call() bounded by @p bound ms (<= 0: not at all); @p wait_ms is for the message and for
 * connecting anew. */
static int call_bounded(dlpc_client *c, uint16_t type, const ProtobufCMessage *req, const int *fds,
			unsigned nfds, int64_t bound, int64_t wait_ms, struct dlpc__call_info *info,
			const ProtobufCMessageDescriptor *rdesc, ProtobufCMessage **rep, int *rfd,
			ProtobufCAllocator *alloc)
{
	struct dlpc__call_info none = {0};
	struct dlpc__call call = {0};
	struct timespec deadline, *dl = NULL;
	bool stopped = false;
	size_t sent = 0;
	ssize_t len;
	int r;

	if (!info)
		info = &none;
	info->sent = false;
	info->answered = false;
	info->epoch = 0;
	info->lost = false;
	info->reconnect_err = 0;
	if (rfd)
		*rfd = -1;
	*rep = NULL;
	if (bound > 0) {
		deadline_in(&deadline, bound);
		dl = &deadline;
	}
	deadline_in(&check_due, DLPC_INTERRUPT_CHECK_MS);
	pthread_mutex_lock(&c->mu);
	if (c->closed)
		return call_closed(c);
	/* lost: with DLPC_CONNECT_RECONNECT connect anew, unless another call or the reader
	 * still works on the old connection (it fails as that did; a later call connects) */
	if (c->broken && c->reconnect && !c->calls && !c->reading && !c->reconnecting) {
		int64_t connect_ms, hello_ms;

		reconnect_bounds(c, wait_ms, &connect_ms, &hello_ms);
		c->reconnecting = true;
		pthread_mutex_unlock(&c->mu);
		r = dlpc__reconnect(c, connect_ms, hello_ms);
		pthread_mutex_lock(&c->mu);
		c->reconnecting = false;
		if (c->closed)
			return call_closed(c);
		if (r < 0) {
			info->reconnect_err = r;
			pthread_mutex_unlock(&c->mu);
			return r;
		}
	}
	if (c->broken) {
		info->lost = true;
		r = conn_error(c, c->broken);
		pthread_mutex_unlock(&c->mu);
		return r;
	}
	/* From here the request belongs to this connection: so does what it makes (a reference,
	 * a lent publication counted now, before any RECLAIM of it can come). */
	call.epoch = c->epoch;
	info->epoch = c->epoch;
	info->sent = true;
	if (info->lend)
		c->ipc_pubs++;
	/* ids still owed a reply are skipped, so that the reply is not taken for this call's */
	do
		call.id = ++c->next_id;
	while (call.id == 0 || take_abandoned(c, call.id, true));
	call.next = c->calls;
	c->calls = &call;
	pthread_mutex_unlock(&c->mu);

	pthread_mutex_lock(&c->wmu);
	len = send_request(c, type, call.id, req, fds, nfds, &sent);
	r = len < 0 ? (int)len : 0;
	pthread_mutex_unlock(&c->wmu);
	/* the socket's send timeout (SO_SNDTIMEO) expired: the daemon does not read */
	if (r == -EAGAIN)
		r = -ETIMEDOUT;

	pthread_mutex_lock(&c->mu);
	/* a request that failed before its first byte left (too large, out of memory, an fd the
	 * kernel would not pass, a daemon that does not read) leaves the connection as good as it
	 * was */
	if (r < 0 && sent == 0 && r != -EPIPE && r != -ECONNRESET && r != -EBADF) {
		if (!call.canceled)
			unlink_call(c, &call);
		pthread_mutex_unlock(&c->mu);
		info->sent = false;
		if (info->lend)
			dlpc__reclaim_count(c, -1, call.epoch);
		if (r == -EMSGSIZE)
			return dlpc__fail(
				r, "request of %zu bytes exceeds the frame limit of %u bytes",
				protobuf_c_message_get_packed_size(req), DLPC_FRAME_MAX);
		if (r == -ETIMEDOUT)
			return dlpc__fail(r,
					  "dlpackd did not take the request within %lld ms (%s): "
					  "it may be stopped or overloaded",
					  (long long)c->call_timeout_ms, DLPC_CALL_TIMEOUT_ENV);
		return dlpc__fail(r, "cannot send the request to dlpackd: %s", strerror(-r));
	}
	if (r < 0 && !c->broken) {
		c->broken = r;
		pthread_cond_broadcast(&c->cv);
	}
	while (!call.done && !call.canceled && !c->broken && !(dl && passed(dl)) && !stopped)
		stopped = dlpc__reader_turn(c, dl) == DLPC__INTERRUPTED;
	if (stopped)
		return call_stopped(c, &call, type);
	info->lost = !call.done && !call.canceled && c->broken;
	if (call.canceled) {
		/* dlpc_close() unlinked it and abandoned its id; the daemon may still hold it */
		bool waits = !c->broken;

		info->lost = false;
		pthread_mutex_unlock(&c->mu);
		if (waits)
			dlpc__cancel_wait(c, type, call.id, call.epoch);
		return dlpc__fail(-ECANCELED,
				  "this client was closed or canceled (dlpc_close() "
				  "or dlpc_cancel()) while the call waited for dlpackd");
	}
	unlink_call(c, &call);
	if (!call.done && !c->broken) {
		/* Out of time. The request may still take effect: its reply is dropped when it
		 * comes, and an ATTACH reply's reference given back. */
		bool waits = abandon(c, call.id);

		if (!waits)
			c->broken = -ENOMEM; /* the reply could no longer be matched */
		pthread_mutex_unlock(&c->mu);
		if (waits)
			dlpc__cancel_wait(c, type, call.id, call.epoch);
		return call_gave_up(type, bound, wait_ms);
	}
	r = call.done ? 0 : conn_error(c, c->broken);
	pthread_mutex_unlock(&c->mu);
	if (!call.done)
		return r;
	info->answered = true;

	r = 0;
	if (call.lost) {
		r = fds_lost(c, &call);
	} else if (call.type == DLPC_MSG_ERROR) {
		Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, call.len, call.payload);

		r = e && e->code > 0 ? dlpc__fail(-e->code, "%s", e->message)
				     : dlpc__fail(-EPROTO, "malformed ERROR reply from dlpackd");
		if (e)
			dlpackd__v1__error__free_unpacked(e, NULL);
	} else if (call.type != (type | DLPC_MSG_REPLY)) {
		r = dlpc__fail(-EPROTO, "dlpackd answered with frame type 0x%x", call.type);
	} else {
		*rep = protobuf_c_message_unpack(rdesc, alloc, call.len, call.payload);
		if (!*rep)
			r = dlpc__fail(-EPROTO, "malformed reply from dlpackd");
	}
	for (unsigned i = 0, more = 0; i < call.nfds; i++) {
		if (r == 0 && rfd && *rfd < 0)
			*rfd = call.fds[i];
		else if (r == 0 && more < info->nmore_fds)
			info->more_fds[more++] = call.fds[i];
		else
			close(call.fds[i]);
	}
	free(call.payload);
	return r;
}

int dlpc__call(dlpc_client *c, uint16_t type, const ProtobufCMessage *req, const int *fds,
	       unsigned nfds, const ProtobufCMessageDescriptor *rdesc, ProtobufCMessage **rep,
	       int *rfd, ProtobufCAllocator *alloc)
{
	return dlpc__call_ex(c, type, req, fds, nfds, 0, NULL, rdesc, rep, rfd, alloc);
}

int dlpc__call_ex(dlpc_client *c, uint16_t type, const ProtobufCMessage *req, const int *fds,
		  unsigned nfds, int64_t wait_ms, struct dlpc__call_info *info,
		  const ProtobufCMessageDescriptor *rdesc, ProtobufCMessage **rep, int *rfd,
		  ProtobufCAllocator *alloc)
{
	int64_t bound = c->call_timeout_ms;
	int r;

	if (wait_ms < 0 || wait_ms > INT64_MAX - DLPC_CALL_GRACE_MS)
		bound = -1;
	else if (wait_ms > 0)
		bound = wait_ms + DLPC_CALL_GRACE_MS;
	/* a caller blocked here keeps the client alive through a dlpc_close() meanwhile */
	dlpc__client_ref(c);
	r = call_bounded(c, type, req, fds, nfds, bound, wait_ms, info, rdesc, rep, rfd, alloc);
	dlpc__client_unref(c);
	return r;
}
