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
 * again, as does a use that finds the channel gone (EPIPE, end of stream) or its kind changed
 * (the daemon answers EPROTOTYPE). The list changes under the lock of the open clients' list,
 * so that a forked child finds it whole and closes the ends it inherited.
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
	uint64_t epoch; /* the connection it was learnt on */
	bool direct;
	int ends[2];	/* direct: [0] sends, [1] receives */
	unsigned users; /* calls using the ends now */
	bool dropped;	/* out of the list: closed by its last user */
	char name[];
};

/* fds a datagram may bring (a hostile sender's: the kernel's SCM_MAX_FD) */
#define RECV_FDS_MAX 253

static void endpoint_free(struct dlpc__endpoint *e)
{
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
	(void)c;
	dlpc__list_unlock();
	if (last)
		endpoint_free(e);
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
		endpoint_free(e);
	}
}

void dlpc__direct_forked(dlpc_client *c)
{
	/* the child: whatever held them is the parent's; no other thread runs here */
	while (c->endpoints) {
		struct dlpc__endpoint *e = c->endpoints;

		c->endpoints = e->next;
		endpoint_free(e);
	}
	dlpc__close(c->direct_wake);
	c->direct_wake = -1;
}

/* Ask the daemon what @p name is (CHANNEL JOIN) and remember it. 1 direct, 0 queued, or a
 * negative errno (-ENOENT: no such channel). */
static int join(dlpc_client *c, const char *name, struct dlpc__endpoint **ret)
{
	Dlpackd__V1__Channel req = DLPACKD__V1__CHANNEL__INIT;
	Dlpackd__V1__ChannelReply *rep;
	int more[1] = {-1}, fd = -1, r;
	struct dlpc__call_info info = {.more_fds = more, .nmore_fds = 1};
	struct dlpc__endpoint *e;
	size_t len = strlen(name);

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
	dlpc__list_lock();
	/* two threads may have joined at once: both work, the first listed is found next time */
	e->next = c->endpoints;
	c->endpoints = e;
	dlpc__list_unlock();
	*ret = e;
	return e->direct;
}

int dlpc__direct_get(dlpc_client *c, const char *name, struct dlpc__endpoint **ret)
{
	uint64_t epoch;

	*ret = NULL;
	if (c->minor < 8)
		return 0;
	pthread_mutex_lock(&c->mu);
	epoch = c->epoch;
	pthread_mutex_unlock(&c->mu);
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

/* What a wait on a direct channel watches besides the end: dlpc_close()/dlpc_cancel(), and the
 * daemon's going away (the channel may then live on only among processes that joined it). */
struct watch {
	int wake; /* c->direct_wake */
	int sock; /* a dup of the connection's socket, for its hang-up */
};

static int watch_start(dlpc_client *c, struct watch *w)
{
	int r = 0;

	pthread_mutex_lock(&c->mu);
	if (c->direct_wake < 0)
		c->direct_wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	w->wake = c->direct_wake;
	w->sock = c->broken ? -1 : fcntl(c->sock, F_DUPFD_CLOEXEC, 0);
	if (c->closed)
		r = -ECANCELED;
	else if (c->broken)
		r = -ECONNRESET;
	else if (w->wake < 0 || w->sock < 0)
		r = -errno;
	pthread_mutex_unlock(&c->mu);
	if (r < 0 && w->sock >= 0)
		close(w->sock);
	return r;
}

/*
 * Wait until @p fd is ready for @p events, until @p end (monotonic ms; 0: forever), or until the
 * client is closed, the daemon goes away or the thread's interrupt check says to stop. 0 when
 * ready; -ETIMEDOUT, -ECANCELED, -ECONNRESET, -EINTR.
 */
static int wait_end(dlpc_client *c, const struct watch *w, int fd, short events, int64_t end)
{
	for (;;) {
		struct pollfd p[3] = {{.fd = fd, .events = events},
				      {.fd = w->wake, .events = POLLIN},
				      {.fd = w->sock, .events = POLLRDHUP}};
		int64_t left = end ? end - dlpc__mono_ms() : -1;
		int ms = DLPC_INTERRUPT_CHECK_MS, r;

		if (end && left <= 0)
			return -ETIMEDOUT;
		if (left >= 0 && left < ms)
			ms = (int)left;
		r = poll(p, 3, ms);
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
		if (r > 0 && (p[2].revents & (POLLRDHUP | POLLHUP | POLLERR)))
			return -ECONNRESET;
		if (r > 0 && p[0].revents)
			return 0;
		if (dlpc__interrupted())
			return -EINTR;
	}
}

static void watch_end(struct watch *w)
{
	dlpc__close(w->sock);
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
	int64_t end = timeout > 0 ? dlpc__mono_ms() + timeout : 0;
	struct watch w = {.wake = -1, .sock = -1};
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
			/* removed: the caller joins anew, and finds it gone or made again */
			r = w.wake >= 0 ? -EIDRM : -EPIPE;
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
		if (w.wake < 0 && (r = watch_start(c, &w)) < 0) {
			r = wait_failed(r, "send to", channel, timeout);
			break;
		}
		r = wait_end(c, &w, e->ends[0], POLLOUT, end);
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
	watch_end(&w);
	if (r == -EIDRM)
		r = dlpc__fail(r, "channel '%s' was removed", channel);
	return r;
}

/* ---- receiving ---- */

/* Is the table @p t of @p len bytes whole, with keys of names' rules? A count, or -1. */
static int64_t keys_sane(const uint8_t *t, size_t len, char *why, size_t whylen)
{
	int64_t n = dlpc__table_count(t, len);
	struct dlpc__table_rec d;
	size_t pos = 4;

	if (n <= 0) {
		snprintf(why, whylen, "its tensor table counts no tensor, or too many");
		return -1;
	}
	for (int64_t i = 0; i < n; i++) {
		if (dlpc__table_next(t, len, &pos, &d) < 0) {
			snprintf(why, whylen, "tensor %lld of its table is malformed",
				 (long long)i);
			return -1;
		}
		if ((n > 1 || d.key_len) && dlpc__key_check(d.key, d.key_len, why, whylen) < 0)
			return -1;
	}
	if (pos != len) {
		snprintf(why, whylen, "its tensor table has %zu bytes past its last tensor",
			 len - pos);
		return -1;
	}
	return n;
}

/* Take the fds and the sender's credentials of a received datagram: *@p fd the first (or -1),
 * the others closed; how many there were. */
static unsigned take_fds(struct msghdr *mh, int *fd, struct ucred *cred)
{
	unsigned count = 0;

	*fd = -1;
	for (struct cmsghdr *h = CMSG_FIRSTHDR(mh); h; h = CMSG_NXTHDR(mh, h)) {
		if (h->cmsg_level != SOL_SOCKET)
			continue;
		if (h->cmsg_type == SCM_CREDENTIALS &&
		    h->cmsg_len >= CMSG_LEN(sizeof(struct ucred))) {
			memcpy(cred, CMSG_DATA(h), sizeof(*cred));
		} else if (h->cmsg_type == SCM_RIGHTS) {
			size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);

			for (size_t i = 0; i < k; i++) {
				int x;

				memcpy(&x, CMSG_DATA(h) + i * sizeof(int), sizeof(int));
				if (*fd < 0)
					*fd = x;
				else
					dlpc__close(x);
				count++;
			}
		}
	}
	return count;
}

int dlpc__direct_recv(dlpc_client *c, struct dlpc__endpoint *e, const char *channel, uint32_t flags,
		      int64_t timeout, bool single, dlpc_bundle **ret)
{
	uint8_t rec[DLPC_DIRECT_RECORD + 1];
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * RECV_FDS_MAX) + CMSG_SPACE(sizeof(struct ucred))];
	} ctl;
	Dlpackd__V1__AttachReply rep = DLPACKD__V1__ATTACH_REPLY__INIT;
	int64_t end = timeout > 0 ? dlpc__mono_ms() + timeout : 0, n;
	struct watch w = {.wake = -1, .sock = -1};
	struct ucred cred = {.pid = 0, .uid = (uid_t)-1};
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
		got = recvmsg(e->ends[1], &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		if (got > 0 || (got == 0 && mh.msg_controllen > 0))
			break;
		if (got == 0) {
			/* the end of the stream: the channel was removed */
			watch_end(&w);
			return w.wake >= 0 ? dlpc__fail(-EIDRM, "channel '%s' was removed", channel)
					   : -EPIPE;
		}
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN) {
			r = -errno;
			watch_end(&w);
			return dlpc__fail(r, "cannot receive from channel '%s': %s", channel,
					  strerror(-r));
		}
		if (timeout == 0) {
			watch_end(&w);
			return dlpc__fail(-EAGAIN, "channel '%s' is empty", channel);
		}
		/* another receiver may take what made the end readable: then wait again */
		r = w.wake < 0 ? watch_start(c, &w) : 0;
		if (r == 0)
			r = wait_end(c, &w, e->ends[1], POLLIN, end);
		if (r < 0) {
			watch_end(&w);
			return r == -ETIMEDOUT ? dlpc__fail(r,
							    "no message came in channel '%s' "
							    "within %lld ms",
							    channel, (long long)timeout)
					       : wait_failed(r, "receive from", channel, timeout);
		}
	}
	watch_end(&w);
	nfds = take_fds(&mh, &fd, &cred);
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
	} else if (dlpc__direct_decode(rec, (size_t)got, &size, &table, &table_len, why,
				       sizeof(why)) < 0) {
		r = -EBADMSG;
	} else if (nfds != 1) {
		snprintf(why, sizeof(why), "%u fds came with it, not one", nfds);
		r = -EBADMSG;
	} else if ((n = keys_sane(table, table_len, why, sizeof(why))) < 0) {
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
		if (fd >= 0)
			dlpc__close(fd);
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
