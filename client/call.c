/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Requests and replies: a call sends its request and waits for its reply (taking the reader's
 * turn, reader.c), bounded by its deadline; a lost connection is made anew first
 * (DLPC_CONNECT_RECONNECT); replies whose fds this process had no room for fail their call.
 * Connecting: a new connection's socket and HELLO, and connecting anew.
 */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

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
			const int *fds, unsigned nfds, const struct timespec *dl, size_t *sent)
{
	unsigned n = atomic_load_explicit(&c->npending, memory_order_relaxed);
	ssize_t at = 0, len;
	size_t out = 0;
	int r;

	*sent = 0;
	/* with fds, or more than a frame's worth (queued while a write was stuck): on their own */
	if (n && (nfds || n > DLPC_RELEASE_PENDING_MAX))
		dlpc__flush_locked(c, DLPC__FLUSH_CANCELABLE, dl);
	if (!nfds && atomic_load_explicit(&c->npending, memory_order_relaxed)) {
		at = dlpc__pending_frame(c);
		if (at < 0) /* out of memory: send them on their own, a frame at a time */
			at = 0, dlpc__flush_locked(c, DLPC__FLUSH_CANCELABLE, dl);
	}
	len = dlpc__msg_frame_at(&c->out, (size_t)at, type, id, req, NULL, 0, nfds);
	if (len < 0) {
		/* the request is refused before anything left: the releases still go */
		if (at) {
			dlpc__pending_sent(c, false);
			dlpc__flush_locked(c, DLPC__FLUSH_CANCELABLE, dl);
		}
		return (int)len;
	}
	r = dlpc__send_frame(c, c->out.p, (size_t)len, fds, nfds, dl, true, &out);
	/* gone once any of them left: whole, or cut short (the connection broke, with them) */
	if (at)
		dlpc__pending_sent(c, out > 0);
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
	if (!call->done && !call->canceled && !c->broken && !dlpc__abandon(c, call->id))
		c->broken = -ENOMEM; /* the reply could no longer be matched */
	waits = !call->done && !c->broken;
	pthread_mutex_unlock(&c->mu);
	if (waits)
		dlpc__cancel_wait(c, type, call->id, call->conn_seq);
	if (call->done) {
		ref = dlpc__reply_ref(call->type, call->payload, call->len);
		for (unsigned i = 0; i < call->nfds; i++)
			close(call->fds[i]);
		free(call->payload);
		/* the reference is the connection's the request went out on: another thread may
		 * have connected anew since c->mu was let go */
		if (ref)
			dlpc__release_ref(c, ref, call->conn_seq);
	}
	return call_interrupted(type);
}

/* The reply's fds could not be received: give back what it granted, and say why. */
static int fds_lost(dlpc_client *c, const struct dlpc__call *call)
{
	uint64_t ref = dlpc__reply_ref(call->type, call->payload, call->len);
	struct rlimit rl = {0};

	/* of the connection the request went out on, which may have been replaced already */
	if (ref)
		dlpc__release_ref(c, ref, call->conn_seq);
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

/*
 * Connect anew before a call, if the connection is lost and DLPC_CONNECT_RECONNECT says so,
 * unless another call or the reader still works on the old connection (it fails as that did; a
 * later call connects). Under c->mu: held again on 0, released on failure.
 */
static int call_reconnect(dlpc_client *c, int64_t wait_ms, struct dlpc__call_info *info)
{
	int64_t connect_ms, hello_ms;
	int r;

	if (!c->broken || !c->reconnect || c->calls || c->reading || c->reconnecting)
		return 0;
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
	}
	return r;
}

/* Give @p call an id on @p c's connection and list it, connecting anew first if need be. 0, or a
 * negative errno (closed, lost). Without c->mu either way. */
static int call_start(dlpc_client *c, struct dlpc__call *call, int64_t wait_ms,
		      struct dlpc__call_info *info)
{
	int r;

	pthread_mutex_lock(&c->mu);
	if (c->closed)
		return call_closed(c);
	r = call_reconnect(c, wait_ms, info);
	if (r < 0)
		return r;
	if (c->broken) {
		info->lost = true;
		r = dlpc__conn_error(c, c->broken);
		pthread_mutex_unlock(&c->mu);
		return r;
	}
	/* From here the request belongs to this connection: so does what it makes (a reference,
	 * a lent publication counted now, before any RECLAIM of it can come). */
	call->conn_seq = c->conn_seq;
	info->conn_seq = c->conn_seq;
	info->sent = true;
	if (info->lend)
		c->ipc_pubs++;
	/* ids still owed a reply are skipped, so that the reply is not taken for this call's */
	do
		call->id = ++c->next_id;
	while (call->id == 0 || dlpc__take_abandoned(c, call->id, true));
	call->next = c->calls;
	c->calls = call;
	pthread_mutex_unlock(&c->mu);
	return 0;
}

/* The request of @p call failed (@p r) before its first byte left: it is taken back, and the
 * connection is as good as it was. @p bound and @p wait_ms: the call's (dlpc__call_ex()). Under
 * c->mu, which this releases. */
static int call_refused(dlpc_client *c, struct dlpc__call *call, int r, const ProtobufCMessage *req,
			int64_t bound, int64_t wait_ms, struct dlpc__call_info *info)
{
	int64_t t = c->call_timeout_ms;

	if (!call->canceled)
		unlink_call(c, call);
	pthread_mutex_unlock(&c->mu);
	info->sent = false;
	if (info->lend)
		dlpc__reclaim_count(c, -1, call->conn_seq);
	if (r == -EMSGSIZE)
		return dlpc__fail(r, "request of %zu bytes exceeds the frame limit of %u bytes",
				  protobuf_c_message_get_packed_size(req), DLPC_FRAME_MAX);
	/* a waiting call's own bound, where it is the shorter one (dlpc__write_ms()) */
	if (r == -ETIMEDOUT && wait_ms > 0 && bound > 0 && (t <= 0 || bound < t))
		return dlpc__fail(
			r,
			"dlpackd did not take the request within %lld ms (the call's "
			"%lld ms wait plus %d ms grace): it may be stopped or overloaded, "
			"or another thread's request to it was stuck",
			(long long)bound, (long long)wait_ms, DLPC_CALL_GRACE_MS);
	if (r == -ETIMEDOUT)
		return dlpc__fail(
			r,
			"dlpackd did not take the request within %lld ms (%s): it may be "
			"stopped or overloaded, or another thread's request to it was stuck",
			(long long)t, DLPC_CALL_TIMEOUT_ENV);
	if (r == -ECANCELED)
		return dlpc__fail(r, "this client was closed or canceled (dlpc_close() or "
				     "dlpc_cancel()) while the request waited to be written");
	if (r == -EINTR)
		return dlpc__fail(r, "interrupted while the request waited to be written (another "
				     "thread's request to dlpackd was stuck): nothing was sent");
	return dlpc__fail(r, "cannot send the request to dlpackd: %s", strerror(-r));
}

/*
 * Take @p c's wmu for a request whose call ends at @p dl (NULL: no deadline): 0; -ETIMEDOUT once
 * @p dl passed while another thread's write held it (at most the call timeout, as
 * dlpc__write_ms()), -ECANCELED once dlpc_cancel() or dlpc_close() was called, -EINTR when the
 * thread's interrupt check said to give up (both looked at every DLPC_SEND_CHECK_MS). Without
 * c->mu.
 */
static int write_lock(dlpc_client *c, const struct timespec *dl)
{
	struct timespec until, slice;
	int64_t bound = dlpc__write_ms(c, dl);
	int r;

	if (pthread_mutex_trylock(&c->wmu) == 0)
		return 0;
	if (bound > 0)
		dlpc__deadline_in(&until, bound);
	for (;;) {
		if (dlpc__closed(c))
			return -ECANCELED;
		/* (no lock of the library's held: the check may call back into it) */
		if (dlpc__interrupted())
			return -EINTR;
		dlpc__deadline_in(&slice, DLPC_SEND_CHECK_MS);
		if (bound > 0 && dlpc__ms_left(&until) < DLPC_SEND_CHECK_MS)
			slice = until;
		r = pthread_mutex_clocklock(&c->wmu, CLOCK_MONOTONIC, &slice);
		if (r == 0)
			return 0;
		if (bound > 0 && dlpc__passed(&until))
			return -ETIMEDOUT;
	}
}

/* Send @p call's request by the call's deadline @p dl (NULL: none; bound and wait_ms: the
 * call's): 0, with c->mu held; or the error of a request refused before it left, without. A
 * request cut short breaks the connection (the wait for its reply then ends). */
static int call_send(dlpc_client *c, struct dlpc__call *call, uint16_t type,
		     const ProtobufCMessage *req, const int *fds, unsigned nfds,
		     const struct timespec *dl, int64_t bound, int64_t wait_ms,
		     struct dlpc__call_info *info)
{
	size_t sent = 0;
	ssize_t len;
	int r;

	/* behind another thread's write, for no longer than this call may take */
	r = write_lock(c, dl);
	if (r < 0) {
		pthread_mutex_lock(&c->mu);
		return call_refused(c, call, r, req, bound, wait_ms, info);
	}
	len = send_request(c, type, call->id, req, fds, nfds, dl, &sent);
	r = len < 0 ? (int)len : 0;
	if (r < 0)
		dlpc__write_unlock_failed(c);
	else
		dlpc__write_unlock(c);
	/* the call timeout passed while writing: the daemon does not read */
	if (r == -EAGAIN)
		r = -ETIMEDOUT;
	pthread_mutex_lock(&c->mu);
	/* too large, out of memory, an fd the kernel would not pass, a daemon that does not read */
	if (r < 0 && sent == 0 && r != -EPIPE && r != -ECONNRESET && r != -EBADF)
		return call_refused(c, call, r, req, bound, wait_ms, info);
	if (r < 0 && !c->broken) {
		c->broken = r;
		pthread_cond_broadcast(&c->cv);
	}
	return 0;
}

/* Wait for @p call's reply until @p dl (NULL: none). Under c->mu, which this releases. 0 when
 * the reply came; else the call is over (canceled, out of time, interrupted, connection lost). */
static int call_wait(dlpc_client *c, struct dlpc__call *call, uint16_t type,
		     const struct timespec *dl, int64_t bound, int64_t wait_ms,
		     struct dlpc__call_info *info)
{
	bool stopped = false, waits;
	int r;

	while (!call->done && !call->canceled && !c->broken && !(dl && dlpc__passed(dl)) &&
	       !stopped)
		stopped = dlpc__reader_turn(c, dl) == DLPC__INTERRUPTED;
	if (stopped)
		return call_stopped(c, call, type);
	info->lost = !call->done && !call->canceled && c->broken;
	if (call->canceled) {
		/* dlpc_close() unlinked it and abandoned its id; the daemon may still hold it */
		waits = !c->broken;
		info->lost = false;
		pthread_mutex_unlock(&c->mu);
		if (waits)
			dlpc__cancel_wait(c, type, call->id, call->conn_seq);
		return dlpc__fail(-ECANCELED,
				  "this client was closed or canceled (dlpc_close() "
				  "or dlpc_cancel()) while the call waited for dlpackd");
	}
	unlink_call(c, call);
	if (!call->done && !c->broken) {
		/* Out of time. The request may still take effect: its reply is dropped when it
		 * comes, and an ATTACH reply's reference given back. */
		waits = dlpc__abandon(c, call->id);
		if (!waits)
			c->broken = -ENOMEM; /* the reply could no longer be matched */
		pthread_mutex_unlock(&c->mu);
		if (waits)
			dlpc__cancel_wait(c, type, call->id, call->conn_seq);
		return call_gave_up(type, bound, wait_ms);
	}
	r = call->done ? 0 : dlpc__conn_error(c, c->broken);
	pthread_mutex_unlock(&c->mu);
	if (call->done)
		info->answered = true;
	return r;
}

/* The reply to @p call (of @p type) came: unpack it into *@p rep with @p rdesc and hand out its
 * fds (*@p rfd, then info->more_fds; the rest closed). 0, or the error it says. */
static int call_reply(dlpc_client *c, struct dlpc__call *call, uint16_t type,
		      const ProtobufCMessageDescriptor *rdesc, ProtobufCMessage **rep, int *rfd,
		      struct dlpc__call_info *info, ProtobufCAllocator *alloc)
{
	int r = 0;

	if (call->lost) {
		r = fds_lost(c, call);
	} else if (call->type == DLPC_MSG_ERROR) {
		Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, call->len, call->payload);

		r = e && e->code > 0 ? dlpc__fail(-e->code, "%s", e->message)
				     : dlpc__fail(-EPROTO, "malformed ERROR reply from dlpackd");
		if (e)
			dlpackd__v1__error__free_unpacked(e, NULL);
	} else if (call->type != (type | DLPC_MSG_REPLY)) {
		r = dlpc__fail(-EPROTO, "dlpackd answered with frame type 0x%x", call->type);
	} else {
		*rep = protobuf_c_message_unpack(rdesc, alloc, call->len, call->payload);
		if (!*rep)
			r = dlpc__fail(-EPROTO, "malformed reply from dlpackd");
	}
	for (unsigned i = 0, more = 0; i < call->nfds; i++) {
		if (r == 0 && rfd && *rfd < 0)
			*rfd = call->fds[i];
		else if (r == 0 && more < info->nmore_fds)
			info->more_fds[more++] = call->fds[i];
		else
			close(call->fds[i]);
	}
	free(call->payload);
	return r;
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
	int r;

	if (!info)
		info = &none;
	info->sent = false;
	info->answered = false;
	info->conn_seq = 0;
	info->lost = false;
	info->reconnect_err = 0;
	if (rfd)
		*rfd = -1;
	*rep = NULL;
	if (bound > 0) {
		dlpc__deadline_in(&deadline, bound);
		dl = &deadline;
	}
	dlpc__interrupt_arm();
	r = call_start(c, &call, wait_ms, info);
	if (r == 0)
		r = call_send(c, &call, type, req, fds, nfds, dl, bound, wait_ms, info);
	if (r == 0)
		r = call_wait(c, &call, type, dl, bound, wait_ms, info);
	if (r == 0)
		r = call_reply(c, &call, type, rdesc, rep, rfd, info, alloc);
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

	assert(rep && rdesc);
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
		/* the cache's idle references go back now; those in use when their last tensor is
		 * released */
		DLPC__HOOKS_RUN(close, c);
		/* the library's thread may be reading the socket for the cache: let it look again,
		 * so that it holds the client no longer than the user does */
		dlpc__loop_wake();
		/* (a call stuck writing ends within DLPC_SEND_CHECK_MS, canceled above; with no
		 * room, the library's thread sends them later, or the connection's end drops the
		 * references they name) */
		pthread_mutex_lock(&c->wmu);
		dlpc__flush_locked(c, DLPC__FLUSH_NOWAIT, NULL);
		dlpc__write_unlock(c);
		/* nothing else holding it, its connection is closed on return */
		dlpc__client_unref_closed(c);
		return;
	}
	dlpc__client_unref(c);
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
 * connect() @p c's socket to @p path, waiting @p connect_ms at most while the daemon's backlog is
 * full (SO_SNDTIMEO); frames are then written within each call's deadline by dlpc__send_frame(),
 * so that a daemon that stops reading cannot hold the caller forever. When connecting @p again, a
 * signal does not end it unless the thread's interrupt check says stop. 0, or a negative errno
 * with the message set.
 */
static int connect_socket(dlpc_client *c, const char *path, bool again, int64_t connect_ms,
			  int64_t timeout)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};

	/* dlpc_connect_flags() refused a longer path; c->path holds what was reached */
	assert(strlen(path) < sizeof(sa.sun_path) && strlen(path) < sizeof(c->path));
	send_timeout(c->sock, connect_ms);
	strcpy(sa.sun_path, path);
	while (connect(c->sock, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		/* a signal handler ran (with SO_SNDTIMEO set, connect() is never restarted) */
		if (errno == EINTR && again && !dlpc__interrupted())
			continue;
		if (errno == EAGAIN)
			return dlpc__fail(-ETIMEDOUT,
					  "cannot connect to dlpackd at %s: it did not accept the "
					  "connection within %lld ms (%s)",
					  path, (long long)connect_ms,
					  connect_ms == timeout ? DLPC_CALL_TIMEOUT_ENV
								: "its backlog is full");
		return dlpc__fail(-errno, "cannot connect to dlpackd at %s: %m", path);
	}
	if (connect_ms != timeout)
		send_timeout(c->sock, timeout);
	return 0;
}

/* HELLO on @p c, just connected to @p path, waiting @p hello_ms for the answer (the call
 * timeout @p timeout, or the time left of a waiting call). 0, or a negative errno with the
 * message set: the daemon's own words when it refused. */
static int hello(dlpc_client *c, const char *path, int64_t timeout, int64_t hello_ms)
{
	Dlpackd__V1__Hello msg = DLPACKD__V1__HELLO__INIT;
	Dlpackd__V1__HelloReply *rep;
	int r;

	msg.version_major = DLPC_PROTO_MAJOR;
	msg.version_minor = DLPC_PROTO_MINOR;
	msg.client = "libdlpc " DLPD_VERSION;
	c->call_timeout_ms = hello_ms;
	r = dlpc__call(c, DLPC_MSG_HELLO, &msg.base, NULL, 0, &dlpackd__v1__hello_reply__descriptor,
		       (ProtobufCMessage **)&rep, NULL, NULL);
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
		return r;
	/* one version only: a daemon of another build is refused, whichever is newer */
	if (rep->version_major != DLPC_PROTO_MAJOR || rep->version_minor != DLPC_PROTO_MINOR) {
		r = dlpc__fail(-EPROTO,
			       "protocol version mismatch: libdlpc speaks %d.%d, dlpackd at %s "
			       "speaks %u.%u; " DLPC_PROTO_MISMATCH_ADVICE,
			       DLPC_PROTO_MAJOR, DLPC_PROTO_MINOR, path, rep->version_major,
			       rep->version_minor);
		dlpackd__v1__hello_reply__free_unpacked(rep, NULL);
		return r;
	}
	dlpackd__v1__hello_reply__free_unpacked(rep, NULL);
	return 0;
}

int dlpc__connect_new(const char *path, int64_t timeout, dlpc_client *parent, int64_t connect_ms,
		      int64_t hello_ms, dlpc_client **ret)
{
	struct timespec until;
	dlpc_client *c;
	int r;

	/* dlpc_connect(): the call timeout, or the time left of it after a dropped HELLO */
	if (!parent && connect_ms <= 0)
		connect_ms = hello_ms = timeout;
	/* connect() and HELLO together within hello_ms: HELLO gets what connect() left */
	if (hello_ms > 0)
		dlpc__deadline_in(&until, hello_ms);
	r = dlpc__client_new(timeout, &c);
	if (r < 0)
		return r;
	if (parent)
		r = connecting(parent, c);
	if (r == 0)
		r = connect_socket(c, path, parent != NULL, connect_ms, timeout);
	if (r == 0 && hello_ms > 0) {
		hello_ms = dlpc__ms_left(&until);
		if (hello_ms < 1) /* (0 would mean no bound) */
			hello_ms = 1;
	}
	if (r == 0)
		r = hello(c, path, timeout, hello_ms);
	if (parent)
		connecting(parent, NULL);
	if (r < 0) {
		/* listed since dlpc__client_new(): the library's thread may hold a reference to it */
		dlpc__client_unref(c);
		return r;
	}
	snprintf(c->path, sizeof(c->path), "%s", path);
	*ret = c;
	return 0;
}

int dlpc__reconnect(dlpc_client *c, int64_t connect_ms, int64_t hello_ms)
{
	dlpc_client *n;
	int r = dlpc__connect_new(c->path, c->call_timeout_ms, c, connect_ms, hello_ms, &n);

	if (r < 0)
		return r;
	/* the new connection's socket and buffer become c's; c's old ones go with n */
	dlpc__client_adopt(c, n);
	/* n (now the old connection's) is listed: the library's thread may hold a reference */
	dlpc__client_unref(n);
	return 0;
}
