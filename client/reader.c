/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The reader's turn: one thread at a time reads the connection and hands each reply to the call
 * waiting for it (leader/follower), drops the replies of calls abandoned by their deadline or by
 * dlpc_close(), and gives notices (frames with id 0) to the feature registered for them; and the
 * thread's interrupt check, which ends a wait.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

/* Remember that nobody waits for the reply to @p id any more. false if out of memory. Under
 * c->mu. */
bool dlpc__abandon(dlpc_client *c, uint32_t id)
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
bool dlpc__take_abandoned(dlpc_client *c, uint32_t id, bool keep)
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
uint64_t dlpc__reply_ref(uint16_t type, const uint8_t *payload, size_t len)
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
		if (!dlpc__abandon(c, call->id) && !c->broken)
			c->broken = -ENOMEM; /* its reply could no longer be matched */
	}
	/* a HELLO to a daemon that does not answer (a socket activated while its daemon is yet
	 * to start) ends too. Lock order: c->mu before the new connection's. */
	if (c->connecting)
		dlpc__cancel_calls(c->connecting);
	pthread_cond_broadcast(&c->cv);
	dlpc__wake_reader(c);
	/* and the features' own waits (on a direct channel's end) */
	DLPC__HOOKS_RUN(cancel, c);
	pthread_mutex_unlock(&c->mu);
}

/* The connection is gone: say why, in the daemon's words when it left some. Called with c->mu. */
int dlpc__conn_error(dlpc_client *c, int err)
{
	if (c->fatal[0])
		return dlpc__fail(err, "connection to dlpackd lost: dlpackd said: %s", c->fatal);
	return dlpc__fail(err, "connection to dlpackd lost: %s", strerror(-err));
}

/* Is RECLAIM's @p token a feature's (dealt with then)? Under c->mu. */
static bool reclaimed_by_feature(dlpc_client *c, uint64_t token)
{
	for (size_t i = 0; i < dlpc__nhooks; i++)
		if (dlpc__hooks[i]->reclaimed && dlpc__hooks[i]->reclaimed(c, token))
			return true;
	return false;
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
		/* a feature's token (a recycled channel buffer's) is dealt with now; the rest are
		 * publications whose deleters the library's thread runs */
		if (!reclaimed_by_feature(c, m->tokens[i]))
			c->reclaimed[c->nreclaimed++] = m->tokens[i];
	}
	/* the library's thread runs the deleters (serve.c) */
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
	const struct dlpc__notice *notice;
	struct dlpc__call *call;

	if (f->hdr.id == 0 && f->hdr.type == DLPC_MSG_RECLAIM)
		return take_reclaim(c, f);
	if (f->hdr.id == 0 && (notice = dlpc__notice_find(f->hdr.type)))
		return notice->take(c, f);
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
	if (!call && f->hdr.id != 0 && dlpc__take_abandoned(c, f->hdr.id, false)) {
		*drop = dlpc__reply_ref(f->hdr.type, f->payload, f->hdr.len);
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

/*
 * deliver() frame @p f as the reader of connection @p conn_seq, without c->mu, and clear it; then
 * release the reference of a reply dropped, and run the notice's step that wants no lock. What
 * deliver() returned.
 */
static int deliver_unlocked(dlpc_client *c, struct dlpc__frame *f, uint64_t conn_seq)
{
	const struct dlpc__notice *notice = dlpc__notice_find(f->hdr.type);
	uint64_t drop = 0;
	int r;

	pthread_mutex_lock(&c->mu);
	r = deliver(c, f, &drop);
	pthread_mutex_unlock(&c->mu);
	dlpc__frame_clear(f);
	if (drop)
		dlpc__release_ref(c, drop, conn_seq);
	if (notice && notice->after)
		notice->after(c);
	return r;
}

/* Milliseconds until @p dl (CLOCK_MONOTONIC), rounded up, for poll(); 0 once it has passed. */
static int ms_until(const struct timespec *dl)
{
	int64_t ms = dlpc__ms_left(dl);

	return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

/* Does @p a come after @p b? */
static bool later(const struct timespec *a, const struct timespec *b)
{
	return a->tv_sec > b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec > b->tv_nsec);
}

/* The calling thread's interrupt check (dlpc_set_interrupt()). */
static __thread dlpc_interrupt_fn interrupt_fn;
static __thread void *interrupt_arg;

int dlpc__pause_lost(dlpc_client *c, int64_t ms)
{
	struct timespec until;
	bool closed;

	dlpc__deadline_in(&until, ms);
	pthread_mutex_lock(&c->mu);
	while (!c->closed && !dlpc__passed(&until))
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
 * as the reader of connection @p conn_seq (no other can replace it meanwhile).
 */
static int read_frames(dlpc_client *c, const struct timespec *dl, uint64_t conn_seq)
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

			r = deliver_unlocked(c, &f, conn_seq);
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
 * connection is lost. As the reader of connection @p conn_seq, without c->mu.
 */
static int read_ready(dlpc_client *c, uint64_t conn_seq)
{
	char why[160];

	for (;;) {
		struct dlpc__frame f;
		ssize_t n;
		int r;

		while ((r = dlpc__rx_next(&c->rx, &f, why, sizeof(why))) == 1) {
			r = deliver_unlocked(c, &f, conn_seq);
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
	uint64_t conn_seq;
	int r;

	pthread_mutex_lock(&c->mu);
	/* a reader (another call's thread, the library's) may hold frames it has not delivered
	 * yet, or be about to read them: nothing here can vouch for what it has not seen */
	if (c->reading || c->broken || (c->closed && !closed_ok)) {
		pthread_mutex_unlock(&c->mu);
		return 0;
	}
	c->reading = true;
	conn_seq = c->conn_seq;
	pthread_mutex_unlock(&c->mu);
	r = read_ready(c, conn_seq);
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
		uint64_t conn_seq = c->conn_seq;

		c->reading = true;
		pthread_mutex_unlock(&c->mu);
		r = read_frames(c, dl, conn_seq);
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
	if (!interrupt_fn || !(now || dlpc__passed(&check_due)))
		return 0;
	pthread_mutex_unlock(&c->mu);
	stop = dlpc__interrupted();
	pthread_mutex_lock(&c->mu);
	dlpc__deadline_in(&check_due, DLPC_INTERRUPT_CHECK_MS);
	return stop ? DLPC__INTERRUPTED : 0;
}

void dlpc__interrupt_arm(void)
{
	dlpc__deadline_in(&check_due, DLPC_INTERRUPT_CHECK_MS);
}
