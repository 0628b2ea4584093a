/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Direct channels (protocol 1.8), the library's side. A client learns a channel's kind the
 * first time it uses it (CHANNEL JOIN): a direct channel's two socket ends come with the reply
 * and are kept (an endpoint), and a queued channel is remembered as such, so that its SEND and
 * RECV go to the daemon as before with no extra round trip. A message on a direct channel is
 * one datagram of DLPC_DIRECT_RECORD bytes (proto/direct.h) with the storage's fd, sent and
 * received without the daemon.
 *
 * The receiver trusts nothing of what comes: the record, the table of tensors against the
 * storage's size (as a reply of the daemon's is checked), the keys, and the fd (a sealed,
 * fully allocated memfd, by proto/storage.c, as the daemon checks a publish's); anything else
 * is closed and dropped, and the receive says why and who sent it (the kernel's credentials).
 *
 * Endpoints belong to the connection they were joined on: a new connection (reconnect) joins
 * again, as does a use that finds the pair shut (the channel removed, or its sockets shut by a
 * process that joined it: the daemon then makes new ones) or its kind changed (the daemon
 * answers EPROTOTYPE). A receiver that finds the pair shut drops what is still queued: removal
 * frees a channel's messages. At most DLPC__ENDPOINTS_MAX channels are remembered per
 * connection. The list, and the connections' dups that waits watch, change under the lock of
 * the open clients' list, so that a forked child finds them whole and closes what it inherited.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "direct.h"
#include "internal.h"
#include "storage.h"
#include "table.h"
#include "util.h"

/* A channel this connection used: a direct one's ends, or the note that it is queued. */
struct dlpc__endpoint {
	struct dlpc__endpoint *next;
	struct dlpc__endpoint *all_next; /* in c->all_endpoints until freed: a child closes all */
	uint64_t epoch;			 /* the connection it was learnt on */
	bool direct;
	int ends[2];	/* direct: [0] sends, [1] receives */
	unsigned users; /* calls using the ends now */
	bool dropped;	/* out of the list: closed by its last user */
	char name[];
};

/* fds a datagram may bring (a hostile sender's: the kernel's SCM_MAX_FD) */
#define RECV_FDS_MAX 253
#ifndef SCM_PIDFD
#define SCM_PIDFD 0x04 /* Linux 6.5: a pidfd a joiner may have asked for (SO_PASSPIDFD) */
#endif

/* What a wait on a direct channel watches besides the end: dlpc_close()/dlpc_cancel(), and the
 * daemon's going away (the channel may then live on only among processes that joined it).
 * Listed on the client while it waits, so that a forked child closes the dup. */
struct dlpc__wait {
	struct dlpc__wait *next;
	int wake; /* c->direct_wake */
	int sock; /* a dup of the connection's socket, for its hang-up */
};

/* Let go of @p e, no longer listed or used: out of c->all_endpoints under the list lock, then
 * its ends closed. */
static void endpoint_free(dlpc_client *c, struct dlpc__endpoint *e)
{
	dlpc__list_lock();
	for (struct dlpc__endpoint **pp = &c->all_endpoints; *pp; pp = &(*pp)->all_next)
		if (*pp == e) {
			*pp = e->all_next;
			break;
		}
	dlpc__list_unlock();
	if (e->direct) {
		dlpc__close(e->ends[0]);
		dlpc__close(e->ends[1]);
	}
	free(e);
}

/* Take @p e out of @p c's list, if it is still there. Under the list lock. */
static void unlink_locked(dlpc_client *c, struct dlpc__endpoint *e)
{
	for (struct dlpc__endpoint **pp = &c->endpoints; *pp; pp = &(*pp)->next)
		if (*pp == e) {
			*pp = e->next;
			e->dropped = true;
			return;
		}
}

void dlpc__direct_put(dlpc_client *c, struct dlpc__endpoint *e)
{
	bool last;

	dlpc__list_lock();
	last = --e->users == 0 && e->dropped;
	dlpc__list_unlock();
	if (last)
		endpoint_free(c, e);
}

/* Forget @p e (the channel went, or changed): the next use joins again. Its user keeps it. */
static void endpoint_drop(dlpc_client *c, struct dlpc__endpoint *e)
{
	dlpc__list_lock();
	unlink_locked(c, e);
	dlpc__list_unlock();
}

void dlpc__direct_reset(dlpc_client *c)
{
	struct dlpc__endpoint *gone = NULL;

	dlpc__list_lock();
	while (c->endpoints) {
		struct dlpc__endpoint *e = c->endpoints;

		c->endpoints = e->next;
		e->dropped = true;
		if (e->users == 0) {
			e->next = gone;
			gone = e;
		}
	}
	dlpc__list_unlock();
	while (gone) {
		struct dlpc__endpoint *e = gone;

		gone = e->next;
		endpoint_free(c, e);
	}
}

void dlpc__direct_forked(dlpc_client *c)
{
	/* the child: whatever held them is the parent's (in use by its threads or not); no other
	 * thread runs here, and the list lock is held */
	while (c->all_endpoints) {
		struct dlpc__endpoint *e = c->all_endpoints;

		c->all_endpoints = e->all_next;
		if (e->direct) {
			dlpc__close(e->ends[0]);
			dlpc__close(e->ends[1]);
		}
		free(e);
	}
	c->endpoints = NULL;
	for (struct dlpc__wait *w = c->watches; w; w = w->next)
		dlpc__close(w->sock);
	c->watches = NULL;
	dlpc__close(c->direct_wake);
	c->direct_wake = -1;
}

void dlpc__direct_forget(dlpc_client *c, const char *name)
{
	struct dlpc__endpoint *gone = NULL;

	dlpc__list_lock();
	for (struct dlpc__endpoint *e = c->endpoints, *next; e; e = next) {
		next = e->next;
		if (strcmp(e->name, name) == 0) {
			unlink_locked(c, e);
			if (e->users == 0) {
				e->next = gone;
				gone = e;
			}
		}
	}
	dlpc__list_unlock();
	while (gone) {
		struct dlpc__endpoint *e = gone;

		gone = e->next;
		endpoint_free(c, e);
	}
}

/* Make room for one more endpoint in @p c's list: the least recently joined unused one goes
 * once DLPC__ENDPOINTS_MAX are there. Under the list lock; what to free after, or NULL. */
static struct dlpc__endpoint *evict_locked(dlpc_client *c)
{
	struct dlpc__endpoint *last = NULL;
	size_t n = 0;

	for (struct dlpc__endpoint *e = c->endpoints; e; e = e->next, n++)
		if (e->users == 0)
			last = e;
	if (n < DLPC__ENDPOINTS_MAX || !last)
		return NULL;
	unlink_locked(c, last);
	return last;
}

/* Ask the daemon what @p name is (CHANNEL JOIN) and remember it. 1 direct, 0 queued, or a
 * negative errno (-ENOENT: no such channel). */
static int join(dlpc_client *c, const char *name, struct dlpc__endpoint **ret)
{
	Dlpackd__V1__Channel req = DLPACKD__V1__CHANNEL__INIT;
	Dlpackd__V1__ChannelReply *rep;
	int more[1] = {-1}, fd = -1, r;
	struct dlpc__call_info info = {.more_fds = more, .nmore_fds = 1};
	struct dlpc__endpoint *e, *old = NULL, *dup = NULL;
	size_t len = strlen(name);
	uint64_t epoch;

	req.op = DLPC__CHANNEL_JOIN;
	req.name.data = (uint8_t *)name;
	req.name.len = len;
	r = dlpc__call_ex(c, DLPC_MSG_CHANNEL, &req.base, NULL, 0, 0, &info,
			  &dlpackd__v1__channel_reply__descriptor, (ProtobufCMessage **)&rep, &fd,
			  NULL);
	if (r == -EPROTOTYPE) {
		fd = -1;
	} else if (r < 0) {
		return r;
	} else {
		dlpackd__v1__channel_reply__free_unpacked(rep, NULL);
		if (fd < 0 || more[0] < 0) {
			dlpc__close(fd);
			dlpc__close(more[0]);
			return dlpc__fail(
				-EPROTO, "cannot join channel '%s': dlpackd sent an unusable reply",
				name);
		}
	}
	e = calloc(1, sizeof(*e) + len + 1);
	if (!e) {
		dlpc__close(fd);
		dlpc__close(more[0]);
		return dlpc__fail(-ENOMEM, "cannot join channel '%s': out of memory", name);
	}
	memcpy(e->name, name, len + 1);
	e->epoch = info.epoch;
	e->direct = fd >= 0;
	e->ends[0] = fd;
	e->ends[1] = more[0];
	e->users = 1;
	/* c->mu then the list lock (the order every path takes both in): the epoch cannot move
	 * meanwhile. Joined on a connection replaced since: used once, never listed. Two threads
	 * may join at once: the one listed first is the one both use. */
	pthread_mutex_lock(&c->mu);
	dlpc__list_lock();
	epoch = c->epoch;
	for (struct dlpc__endpoint *x = c->endpoints; x && e->epoch == epoch; x = x->next)
		if (x->epoch == epoch && strcmp(x->name, name) == 0) {
			x->users++;
			dup = e;
			e = x;
			break;
		}
	if (!dup) {
		e->all_next = c->all_endpoints;
		c->all_endpoints = e;
		if (e->epoch == epoch) {
			old = evict_locked(c);
			e->next = c->endpoints;
			c->endpoints = e;
		} else {
			e->dropped = true;
		}
	}
	dlpc__list_unlock();
	pthread_mutex_unlock(&c->mu);
	if (old)
		endpoint_free(c, old);
	if (dup) {
		if (dup->direct) {
			dlpc__close(dup->ends[0]);
			dlpc__close(dup->ends[1]);
		}
		free(dup);
	}
	*ret = e;
	return e->direct;
}

int dlpc__direct_get(dlpc_client *c, const char *name, struct dlpc__endpoint **ret)
{
	uint64_t epoch;

	uint32_t minor;
	bool closed, broken;

	*ret = NULL;
	pthread_mutex_lock(&c->mu);
	epoch = c->epoch;
	minor = c->minor;
	closed = c->closed;
	broken = c->broken != 0;
	pthread_mutex_unlock(&c->mu);
	/* dlpc_cancel() ends every call after it, a direct one that need not wait too */
	if (closed)
		return dlpc__fail(-ECANCELED, "this client was closed or canceled (dlpc_close() "
					      "or dlpc_cancel())");
	if (minor < 8)
		return 0;
	/* the connection is lost: what it joined went with its daemon; asking anew connects again
	 * (DLPC_CONNECT_RECONNECT) or says why not */
	if (broken)
		return join(c, name, ret);
	dlpc__list_lock();
	for (struct dlpc__endpoint *e = c->endpoints; e; e = e->next)
		if (e->epoch == epoch && strcmp(e->name, name) == 0) {
			e->users++;
			dlpc__list_unlock();
			*ret = e;
			return e->direct;
		}
	dlpc__list_unlock();
	return join(c, name, ret);
}

void dlpc__direct_changed(dlpc_client *c, struct dlpc__endpoint *e)
{
	endpoint_drop(c, e);
}

/* ---- waiting on an end ---- */

static int watch_start(dlpc_client *c, struct dlpc__wait *w)
{
	int r = 0;

	pthread_mutex_lock(&c->mu);
	if (c->direct_wake < 0)
		c->direct_wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	w->wake = c->direct_wake;
	/* listed before the dup is made, under the lock fork() takes: a child finds it */
	dlpc__list_lock();
	w->sock = c->broken ? -1 : fcntl(c->sock, F_DUPFD_CLOEXEC, 0);
	if (c->closed)
		r = -ECANCELED;
	else if (c->broken)
		r = -ECONNRESET;
	else if (w->wake < 0 || w->sock < 0)
		r = -errno;
	if (r == 0) {
		w->next = c->watches;
		c->watches = w;
	} else {
		dlpc__close(w->sock);
		w->sock = -1;
	}
	dlpc__list_unlock();
	pthread_mutex_unlock(&c->mu);
	return r;
}

static void watch_end(dlpc_client *c, struct dlpc__wait *w)
{
	if (w->sock < 0)
		return;
	dlpc__list_lock();
	for (struct dlpc__wait **pp = &c->watches; *pp; pp = &(*pp)->next)
		if (*pp == w) {
			*pp = w->next;
			break;
		}
	dlpc__close(w->sock);
	w->sock = -1;
	dlpc__list_unlock();
}

/*
 * Wait until @p fd is ready for @p events, until @p end (monotonic ms; 0: forever), or until the
 * client is closed, the daemon goes away or the thread's interrupt check says to stop (checked
 * when due at *@p check_at). 0 when ready, or for POLLOUT when it is time to try again;
 * -ETIMEDOUT, -ECANCELED, -ECONNRESET, -EINTR.
 */
static int wait_end(dlpc_client *c, const struct dlpc__wait *w, int fd, short events, int64_t end,
		    int64_t *check_at)
{
	for (;;) {
		struct pollfd p[3] = {{.fd = fd, .events = events},
				      {.fd = w->wake, .events = POLLIN},
				      {.fd = w->sock, .events = POLLRDHUP}};
		int64_t left = end ? end - dlpc__mono_ms() : -1;
		/* The kernel tells a writer of a Unix datagram socket only once its buffer is three
		 * quarters free: a sender looks again every DLPC_DIRECT_RETRY_MS instead */
		int ms = events == POLLOUT ? DLPC_DIRECT_RETRY_MS : DLPC_INTERRUPT_CHECK_MS, r;

		if (end && left <= 0)
			return -ETIMEDOUT;
		if (left >= 0 && left < ms)
			ms = (int)left;
		r = poll(p, 3, ms);
		if (r == 0 && events == POLLOUT) {
			int64_t now = dlpc__mono_ms();

			if (now < *check_at)
				return 0;
			*check_at = now + DLPC_INTERRUPT_CHECK_MS;
			return dlpc__interrupted() ? -EINTR : 0;
		}
		if (r < 0 && errno != EINTR)
			return -errno;
		if (r > 0 && p[1].revents) {
			bool closed;

			pthread_mutex_lock(&c->mu);
			closed = c->closed;
			pthread_mutex_unlock(&c->mu);
			if (closed)
				return -ECANCELED;
		}
		if (r > 0 && (p[2].revents & (POLLRDHUP | POLLHUP | POLLERR))) {
			/* the connection is gone: so the next call knows (and, with
			 * DLPC_CONNECT_RECONNECT, connects anew) */
			pthread_mutex_lock(&c->mu);
			if (!c->broken) {
				c->broken = -ECONNRESET;
				pthread_cond_broadcast(&c->cv);
				dlpc__wake_reader(c);
			}
			pthread_mutex_unlock(&c->mu);
			return -ECONNRESET;
		}
		if (r > 0 && p[0].revents)
			return 0;
		if (dlpc__interrupted())
			return -EINTR;
	}
}

/* The error of a wait that did not end ready, in words naming @p verb and @p channel. */
static int wait_failed(int r, const char *verb, const char *channel, int64_t timeout)
{
	switch (r) {
	case -ETIMEDOUT:
		return dlpc__fail(r, "cannot %s channel '%s': nothing came within %lld ms", verb,
				  channel, (long long)timeout);
	case -ECANCELED:
		return dlpc__fail(r,
				  "cannot %s channel '%s': this client was closed or canceled "
				  "(dlpc_close() or dlpc_cancel()) while the call waited",
				  verb, channel);
	case -ECONNRESET:
		return dlpc__fail(
			r,
			"cannot %s channel '%s': the connection to dlpackd was lost while "
			"the call waited (the channel went with the daemon)",
			verb, channel);
	case -EINTR:
		return dlpc__fail(r, "cannot %s channel '%s': interrupted", verb, channel);
	default:
		return dlpc__fail(r, "cannot %s channel '%s': %s", verb, channel, strerror(-r));
	}
}

/* ---- sending ---- */

int dlpc__direct_send(dlpc_client *c, struct dlpc__endpoint *e, const char *channel,
		      const Dlpackd__V1__Publish *req, int fd, int64_t timeout)
{
	uint8_t rec[DLPC_DIRECT_RECORD], table[DLPC_DIRECT_TABLE_MAX];
	size_t tl = dlpc__table_size(req->tensors, req->n_tensors);
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} ctl;
	int64_t end = timeout > 0 ? dlpc__mono_ms() + timeout : 0, check_at = 0;
	struct dlpc__wait w = {.wake = -1, .sock = -1};
	bool waited = false;
	int r = 0;

	if (tl > DLPC_DIRECT_TABLE_MAX)
		return dlpc__fail(-EMSGSIZE,
				  "cannot send to channel '%s': the message's %zu tensors take %zu "
				  "bytes to describe; a direct channel's record holds %d",
				  channel, req->n_tensors, tl, DLPC_DIRECT_TABLE_MAX);
	dlpc__table_encode(req->tensors, req->n_tensors, table);
	dlpc__direct_encode(rec, req->storage_size, table, tl);
	for (;;) {
		struct iovec iov = {.iov_base = rec, .iov_len = sizeof(rec)};
		struct msghdr mh = {.msg_iov = &iov,
				    .msg_iovlen = 1,
				    .msg_control = ctl.buf,
				    .msg_controllen = sizeof(ctl.buf)};
		ssize_t n;

		memset(&ctl, 0, sizeof(ctl));
		ctl.h.cmsg_level = SOL_SOCKET;
		ctl.h.cmsg_type = SCM_RIGHTS;
		ctl.h.cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(&ctl.h), &fd, sizeof(int));
		n = sendmsg(e->ends[0], &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (n == (ssize_t)sizeof(rec))
			break;
		if (n >= 0)
			errno = EIO; /* a datagram goes whole or not at all */
		if (errno == EINTR)
			continue;
		if (errno == EPIPE) {
			/* shut: removed, or shut by a process that joined; the caller joins anew */
			r = waited ? dlpc__fail(-EIDRM, "channel '%s' was removed", channel)
				   : -ESHUTDOWN;
			break;
		}
		if (errno == ETOOMANYREFS) {
			r = dlpc__fail(-ETOOMANYREFS,
				       "cannot send to channel '%s': this user has too many fds in "
				       "flight in Unix sockets (the kernel bounds them by "
				       "RLIMIT_NOFILE)",
				       channel);
			break;
		}
		if (errno != EAGAIN) {
			r = dlpc__fail(-errno, "cannot send to channel '%s': %s", channel,
				       strerror(errno));
			break;
		}
		if (timeout == 0) {
			r = dlpc__fail(-EAGAIN, "channel '%s' is full", channel);
			break;
		}
		if (!waited && (r = watch_start(c, &w)) < 0) {
			r = wait_failed(r, "send to", channel, timeout);
			break;
		}
		waited = true;
		r = wait_end(c, &w, e->ends[0], POLLOUT, end, &check_at);
		if (r < 0) {
			if (r == -ETIMEDOUT)
				r = dlpc__fail(r,
					       "cannot send to channel '%s': no room came within "
					       "%lld ms",
					       channel, (long long)timeout);
			else
				r = wait_failed(r, "send to", channel, timeout);
			break;
		}
	}
	watch_end(c, &w);
	return r;
}

/* ---- receiving ---- */

/*
 * Is the table @p t of @p len bytes whole, every tensor inside a storage of @p size bytes at an
 * aligned offset, its keys of names' rules and, in a bundle, each once? As the daemon checks a
 * publish's tensors (daemon/entry.c). The count, or -1 with the reason in @p why.
 */
static int64_t table_sane(const uint8_t *t, size_t len, uint64_t size, char *why, size_t whylen)
{
	int64_t n = dlpc__table_count(t, len);
	size_t pos = 4, starts[DLPC_DIRECT_TABLE_MAX / DLPC_TABLE_REC_FIXED + 1];
	struct dlpc__table_rec r, o;

	if (size == 0) {
		snprintf(why, whylen, "its storage_size is 0");
		return -1;
	}
	if (n <= 0 || (size_t)n > sizeof(starts) / sizeof(starts[0])) {
		snprintf(why, whylen, "its tensor table counts no tensor, or too many");
		return -1;
	}
	for (int64_t i = 0; i < n; i++) {
		uint64_t nbytes;

		starts[i] = pos;
		if (dlpc__table_next(t, len, &pos, &r) < 0 ||
		    dlpc__tensor_nbytes(r.dtype.bits, r.dtype.lanes, r.shape, (size_t)r.ndim,
					&nbytes) < 0) {
			snprintf(why, whylen, "tensor %lld of its table is malformed",
				 (long long)i);
			return -1;
		}
		if (r.offset % DLPC_ALIGN != 0 || r.offset > size || nbytes > size - r.offset) {
			snprintf(why, whylen,
				 "tensor %lld: %llu bytes at offset %llu do not fit an aligned "
				 "place "
				 "in a storage of %llu bytes",
				 (long long)i, (unsigned long long)nbytes,
				 (unsigned long long)r.offset, (unsigned long long)size);
			return -1;
		}
		if ((n > 1 || r.key_len) && dlpc__key_check(r.key, r.key_len, why, whylen) < 0)
			return -1;
		/* each key once: a record holds few enough tensors to compare every pair */
		for (int64_t k = 0; k < i; k++) {
			size_t at = starts[k];

			dlpc__table_next(t, len, &at, &o);
			if (o.key_len == r.key_len && memcmp(o.key, r.key, r.key_len) == 0) {
				snprintf(why, whylen, "tensors %lld and %lld have the same key",
					 (long long)k, (long long)i);
				return -1;
			}
		}
	}
	if (pos != len) {
		snprintf(why, whylen, "its tensor table has %zu bytes past its last tensor",
			 len - pos);
		return -1;
	}
	return n;
}

/* Take the fds and the sender's credentials of a received datagram: *@p fd the first storage
 * fd (or -1); every other fd (SCM_RIGHTS beyond the first, a pidfd a joiner asked for) goes to
 * be closed. The number of SCM_RIGHTS fds; *@p odd set if any other control message came. */
static unsigned take_fds(struct msghdr *mh, int *fd, struct ucred *cred, bool *odd, bool *credited)
{
	unsigned count = 0;

	*fd = -1;
	*odd = false;
	*credited = false;
	for (struct cmsghdr *h = CMSG_FIRSTHDR(mh); h; h = CMSG_NXTHDR(mh, h)) {
		size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);

		if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_CREDENTIALS &&
		    h->cmsg_len >= CMSG_LEN(sizeof(struct ucred))) {
			memcpy(cred, CMSG_DATA(h), sizeof(*cred));
			*credited = true;
			continue;
		}
		if (h->cmsg_level != SOL_SOCKET ||
		    (h->cmsg_type != SCM_RIGHTS && h->cmsg_type != SCM_PIDFD)) {
			*odd = true;
			continue;
		}
		for (size_t i = 0; i < k; i++) {
			int x;

			memcpy(&x, CMSG_DATA(h) + i * sizeof(int), sizeof(int));
			if (h->cmsg_type == SCM_RIGHTS && *fd < 0)
				*fd = x;
			else
				dlpc__close_later(x);
		}
		if (h->cmsg_type == SCM_RIGHTS)
			count += (unsigned)k;
		else
			*odd = true;
	}
	return count;
}

/* Is the pair of @p e shut (removed, or shut by a process that joined)? */
static bool shut(const struct dlpc__endpoint *e)
{
	struct pollfd p = {.fd = e->ends[1], .events = POLLRDHUP};

	return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP));
}

/* Drop what is still queued in the shut pair of @p e: removal frees a channel's messages. */
static void drop_queued(struct dlpc__endpoint *e)
{
	uint8_t rec[DLPC_DIRECT_RECORD];
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * RECV_FDS_MAX) + CMSG_SPACE(sizeof(struct ucred)) +
			 CMSG_SPACE(sizeof(int))];
	} ctl;

	for (;;) {
		struct iovec iov = {.iov_base = rec, .iov_len = sizeof(rec)};
		struct msghdr mh = {.msg_iov = &iov,
				    .msg_iovlen = 1,
				    .msg_control = ctl.buf,
				    .msg_controllen = sizeof(ctl.buf)};
		struct ucred cred;
		bool odd, credited;
		int fd;

		/* shut, the end reads as 0 bytes with no control message, and never blocks */
		if (recvmsg(e->ends[1], &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) < 0 ||
		    mh.msg_controllen == 0)
			break;
		take_fds(&mh, &fd, &cred, &odd, &credited);
		dlpc__close_later(fd);
	}
}

/*
 * A bundle next in the channel of @p e, when a single tensor is asked for, stays queued as on a
 * queued channel: a look at the record without taking it (no control buffer: no fd comes
 * with a look) says so. -EINVAL then, else 0. (Another receiver may take that message between
 * the look and the receive: the one received instead is checked again, and a bundle then is
 * dropped.)
 */
static int single_waits(struct dlpc__endpoint *e, const char *channel)
{
	uint8_t rec[DLPC_DIRECT_RECORD];
	struct iovec iov = {.iov_base = rec, .iov_len = sizeof(rec)};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
	const uint8_t *table;
	size_t table_len;
	uint64_t size;
	char why[256];
	int64_t n;
	ssize_t got = recvmsg(e->ends[1], &mh, MSG_PEEK | MSG_DONTWAIT);

	/* only a well-formed bundle stays: anything else is taken, and dropped if bad */
	if (got != (ssize_t)sizeof(rec) || (mh.msg_flags & MSG_TRUNC) ||
	    dlpc__direct_decode(rec, sizeof(rec), &size, &table, &table_len, why, sizeof(why)) < 0)
		return 0;
	n = table_sane(table, table_len, size, why, sizeof(why));
	if (n <= 1)
		return 0;
	return dlpc__fail(-EINVAL,
			  "the next message in channel '%s' is a bundle of %lld tensors; receive "
			  "it as a bundle",
			  channel, (long long)n);
}

int dlpc__direct_recv(dlpc_client *c, struct dlpc__endpoint *e, const char *channel, uint32_t flags,
		      int64_t timeout, bool single, dlpc_bundle **ret)
{
	uint8_t rec[DLPC_DIRECT_RECORD + 1];
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * RECV_FDS_MAX) + CMSG_SPACE(sizeof(struct ucred)) +
			 CMSG_SPACE(sizeof(int))];
	} ctl;
	Dlpackd__V1__AttachReply rep = DLPACKD__V1__ATTACH_REPLY__INIT;
	int64_t end = timeout > 0 ? dlpc__mono_ms() + timeout : 0, n, check_at = 0;
	struct dlpc__wait w = {.wake = -1, .sock = -1};
	struct ucred cred = {.pid = 0, .uid = (uid_t)-1};
	bool waited = false, odd, credited;
	const uint8_t *table;
	size_t table_len;
	uint64_t size;
	char why[256];
	struct msghdr mh;
	unsigned nfds;
	ssize_t got;
	int fd, r;

	for (;;) {
		struct iovec iov = {.iov_base = rec, .iov_len = sizeof(rec)};

		memset(&mh, 0, sizeof(mh));
		mh.msg_iov = &iov;
		mh.msg_iovlen = 1;
		mh.msg_control = ctl.buf;
		mh.msg_controllen = sizeof(ctl.buf);
		if (single && (r = single_waits(e, channel)) < 0) {
			watch_end(c, &w);
			return r;
		}
		got = recvmsg(e->ends[1], &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		/* every datagram comes with the sender's credentials (SO_PASSCRED): 0 bytes and no
		 * control message is the end of the stream, or a datagram of nothing from a
		 * joiner that turned the credentials off */
		if (got > 0 || (got == 0 && mh.msg_controllen > 0))
			break;
		if (got == 0 && !shut(e)) {
			watch_end(c, &w);
			return dlpc__fail(-EBADMSG,
					  "cannot receive from channel '%s': an empty datagram "
					  "without its sender's credentials came (a process that "
					  "joined the channel turned them off); it was dropped",
					  channel);
		}
		if (got == 0) {
			watch_end(c, &w);
			return waited ? dlpc__fail(-EIDRM, "channel '%s' was removed", channel)
				      : -ESHUTDOWN;
		}
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN) {
			r = -errno;
			watch_end(c, &w);
			return dlpc__fail(r, "cannot receive from channel '%s': %s", channel,
					  strerror(-r));
		}
		if (timeout == 0) {
			watch_end(c, &w);
			return dlpc__fail(-EAGAIN, "channel '%s' is empty", channel);
		}
		/* another receiver may take what made the end readable: then wait again */
		r = waited ? 0 : watch_start(c, &w);
		waited = true;
		if (r == 0)
			r = wait_end(c, &w, e->ends[1], POLLIN, end, &check_at);
		if (r < 0) {
			watch_end(c, &w);
			return r == -ETIMEDOUT ? dlpc__fail(r,
							    "no message came in channel '%s' "
							    "within %lld ms",
							    channel, (long long)timeout)
					       : wait_failed(r, "receive from", channel, timeout);
		}
	}
	watch_end(c, &w);
	nfds = take_fds(&mh, &fd, &cred, &odd, &credited);
	/* a message that came after the channel was removed is not delivered */
	if (shut(e)) {
		dlpc__close_later(fd);
		drop_queued(e);
		return waited ? dlpc__fail(-EIDRM, "channel '%s' was removed", channel)
			      : -ESHUTDOWN;
	}
	/* the message is this receiver's now: anything wrong with it drops it */
	r = 0;
	if (mh.msg_flags & MSG_CTRUNC) {
		r = dlpc__fail(-EMFILE,
			       "cannot receive from channel '%s': a message came with more fds "
			       "than this process had room for; it was lost",
			       channel);
	} else if (mh.msg_flags & MSG_TRUNC || got != DLPC_DIRECT_RECORD) {
		snprintf(why, sizeof(why), "a datagram of %zd bytes, not a record of %d", got,
			 DLPC_DIRECT_RECORD);
		r = -EBADMSG;
	} else if (odd) {
		snprintf(why, sizeof(why), "a control message other than its fd came with it");
		r = -EBADMSG;
	} else if (!credited) {
		snprintf(why, sizeof(why),
			 "it came without its sender's credentials (a process that joined the "
			 "channel turned them off)");
		r = -EBADMSG;
	} else if (dlpc__direct_decode(rec, (size_t)got, &size, &table, &table_len, why,
				       sizeof(why)) < 0) {
		r = -EBADMSG;
	} else if (nfds != 1) {
		snprintf(why, sizeof(why), "%u fds came with it, not one", nfds);
		r = -EBADMSG;
	} else if ((n = table_sane(table, table_len, size, why, sizeof(why))) < 0) {
		r = -EBADMSG;
	} else if (single && n != 1) {
		snprintf(why, sizeof(why),
			 "it is a bundle of %lld tensors, and a single tensor was asked for "
			 "(receive bundles with dlpc_recv_bundle())",
			 (long long)n);
		r = -EINVAL;
	} else if ((r = dlpc__storage_check(fd, size, false, why, sizeof(why))) < 0) {
		r = -EBADMSG;
	}
	if (r < 0) {
		dlpc__close_later(fd);
		if (r == -EMFILE)
			return r;
		return dlpc__fail(r,
				  "cannot receive from channel '%s': the message from pid %d (uid "
				  "%d) was dropped: %s",
				  channel, (int)cred.pid, (int)cred.uid, why);
	}
	rep.generation = 0;
	rep.ref_id = 0; /* no reference of the daemon's: the fd is the message */
	rep.device_type = kDLCPU;
	rep.storage_size = size;
	rep.tensor_table.data = (uint8_t *)table;
	rep.tensor_table.len = table_len;
	rep.owner_uid = (uint32_t)cred.uid;
	rep.owner_pid = (int32_t)cred.pid;
	return dlpc__attach_build(c, e->epoch, false, 0, channel, &rep, fd, flags, NULL, ret);
}
