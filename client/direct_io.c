/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Direct channels (protocol 1.8): a message's way (direct.c says how a client joins a channel
 * and waits on its ends). A message is one datagram of DLPC_DIRECT_RECORD bytes
 * (proto/direct.h) with the storage's fd, sent and received without the daemon.
 *
 * The receiver trusts nothing of what comes: the record, the table of tensors against the
 * storage's size, the keys (as the daemon checks a publish's), the control messages (the
 * storage's fd and the sender's credentials, nothing else), and the fd (a sealed, fully
 * allocated memfd, by proto/storage.c); anything else is closed and dropped, and the receive
 * says why and who sent it (the kernel's credentials). A receiver that finds the pair shut
 * drops what is still queued: removal frees a channel's messages.
 */
#include <assert.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "direct.h"
#include "internal.h"
#include "storage.h"
#include "table.h"
#include "util.h"

/* fds a datagram may bring (a hostile sender's: the kernel's SCM_MAX_FD). Every one of them is
 * taken: a control buffer with room for fewer would have the kernel drop the rest, and the last
 * reference to a file dropped there is let go of in this thread on its way out of recvmsg(),
 * where a lingering socket's close blocks the receive itself (measured: a TCP socket with
 * SO_LINGER {1, 86400} and a full send queue held recvmsg() until killed). Taken, such a socket
 * has its linger turned off, and whatever else may block goes to the closer thread, whose
 * backlog DLPC_CLOSING_MAX bounds. */
#define RECV_FDS_MAX 253
#ifndef SCM_PIDFD
#define SCM_PIDFD 0x04 /* Linux 6.5: a pidfd a joiner may have asked for (SO_PASSPIDFD) */
#endif

/* Room for what a datagram may bring: every fd a sender can put on it, its credentials, and a
 * pidfd a joiner asked for. */
union recv_ctl {
	struct cmsghdr h;
	char buf[CMSG_SPACE(sizeof(int) * RECV_FDS_MAX) + CMSG_SPACE(sizeof(struct ucred)) +
		 CMSG_SPACE(sizeof(int))];
};

/* Is @p fd, an end of a direct channel's pair, shut both ways: was the channel removed? (Its
 * stream's end shuts only the sending end, for writing: the receiving end then sees POLLRDHUP
 * alone, and the sending end nothing.) */
static bool hung_up(int fd)
{
	struct pollfd p = {.fd = fd, .events = POLLRDHUP};

	return poll(&p, 1, 0) > 0 && (p.revents & POLLHUP);
}

/* ---- sending ---- */

/* Send the record @p rec with the storage's @p fd on the sending end @p end, not waiting: what
 * sendmsg() says. */
static ssize_t send_record(int end, const uint8_t rec[DLPC_DIRECT_RECORD], int fd)
{
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} ctl;
	struct iovec iov = {.iov_base = (void *)rec, .iov_len = DLPC_DIRECT_RECORD};
	struct msghdr mh = {.msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = ctl.buf,
			    .msg_controllen = sizeof(ctl.buf)};

	memset(&ctl, 0, sizeof(ctl));
	ctl.h.cmsg_level = SOL_SOCKET;
	ctl.h.cmsg_type = SCM_RIGHTS;
	ctl.h.cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(&ctl.h), &fd, sizeof(int));
	return sendmsg(end, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
}

/* The error of a send to the channel of @p e that failed with @p err (neither EINTR nor EAGAIN),
 * after the send @p waited for room or not. */
static int send_failed(const struct dlpc__endpoint *e, const char *channel, int err, bool waited)
{
	if (err == EPIPE) {
		/* shut: removed (both ends shut both ways), its stream ended (the sending end shut
		 * for writing), or shut by a process that joined; the caller joins anew, and
		 * learns which */
		if (hung_up(e->ends[0]))
			/* removed since (maybe opened anew, for a new stream) */
			return waited ? dlpc__fail(-EIDRM, "channel '%s' was removed", channel)
				      : -ESHUTDOWN;
		if (e->ended)
			return dlpc__fail(-EPIPE,
					  "cannot send to channel '%s': its stream has ended "
					  "(every producer closed it)",
					  channel);
		return -ESHUTDOWN;
	}
	if (err == ETOOMANYREFS)
		return dlpc__fail(-ETOOMANYREFS,
				  "cannot send to channel '%s': this user has too many fds in "
				  "flight in Unix sockets (the kernel bounds them by "
				  "RLIMIT_NOFILE)",
				  channel);
	return dlpc__fail(-err, "cannot send to channel '%s': %s", channel, strerror(err));
}

int dlpc__direct_send(dlpc_client *c, struct dlpc__endpoint *e, const char *channel,
		      const Dlpackd__V1__Publish *req, int fd, int64_t timeout)
{
	uint8_t rec[DLPC_DIRECT_RECORD], table[DLPC_DIRECT_TABLE_MAX];
	size_t tl = dlpc__table_size(req->tensors, req->n_tensors);
	int64_t end = dlpc__mono_end(timeout), check_at = 0;
	struct dlpc__wait w = {.wake = -1, .sock = -1};
	bool waited = false;
	int r = 0;

	assert(e->direct);
	if (tl > DLPC_DIRECT_TABLE_MAX)
		return dlpc__fail(-EMSGSIZE,
				  "cannot send to channel '%s': the message's %zu tensors take %zu "
				  "bytes to describe; a direct channel's record holds %d (a "
				  "queued channel takes any: create it with DLPC_CHANNEL_QUEUED; "
				  "in Python, direct=False)",
				  channel, req->n_tensors, tl, DLPC_DIRECT_TABLE_MAX);
	dlpc__table_encode(req->tensors, req->n_tensors, table);
	dlpc__direct_encode(rec, req->storage_size, table, tl);
	for (;;) {
		ssize_t n = send_record(e->ends[0], rec, fd);

		if (n == (ssize_t)sizeof(rec))
			break;
		if (n >= 0)
			errno = EIO; /* a datagram goes whole or not at all */
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN) {
			r = send_failed(e, channel, errno, waited);
			break;
		}
		if (timeout == 0) {
			r = dlpc__fail(-EAGAIN, "channel '%s' is full", channel);
			break;
		}
		if (!waited && (r = dlpc__direct_watch_start(c, &w)) < 0) {
			r = dlpc__direct_wait_failed(r, "send to", channel, timeout);
			break;
		}
		waited = true;
		r = dlpc__direct_wait_end(c, &w, e->ends[0], POLLOUT, end, &check_at);
		if (r < 0) {
			if (r == -ETIMEDOUT)
				r = dlpc__fail(r,
					       "cannot send to channel '%s': no room came within "
					       "%lld ms",
					       channel, (long long)timeout);
			else
				r = dlpc__direct_wait_failed(r, "send to", channel, timeout);
			break;
		}
	}
	dlpc__direct_watch_end(c, &w);
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

/* Is the pair of @p e shut both ways (removed, or shut by a process that joined)? */
static bool shut(const struct dlpc__endpoint *e)
{
	return hung_up(e->ends[1]);
}

/* Does the receiving end of @p e read its end: shut, or its stream ended (1.10)? */
static bool at_end(const struct dlpc__endpoint *e)
{
	struct pollfd p = {.fd = e->ends[1], .events = POLLRDHUP};

	return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP));
}

/* Is @p e barred (not read while DLPC_CLOSING_MAX refused fds wait to be closed)? */
static bool barred(struct dlpc__endpoint *e)
{
	return __atomic_load_n(&e->barred, __ATOMIC_RELAXED);
}

static void bar(struct dlpc__endpoint *e, bool on)
{
	__atomic_store_n(&e->barred, on, __ATOMIC_RELAXED);
}

/* The error of a receive from @p channel that takes nothing more: @p held fds refused wait to be
 * closed, and @p why (or NULL) what was dropped last. */
static int barred_fail(const char *channel, size_t held, const char *why)
{
	return dlpc__fail(-EMFILE,
			  "cannot receive from channel '%s': %s%s%zu fds that senders on direct "
			  "channels sent and this process refused are waiting to be closed (a "
			  "close that does not return holds them up); past DLPC_CLOSING_MAX (%d) "
			  "a channel whose senders send such fds is not read until they are",
			  channel, why ? why : "", why ? "; " : "", held, DLPC_CLOSING_MAX);
}

/* Drop what is still queued in the shut pair of @p e: removal frees a channel's messages. Past
 * DLPC_CLOSING_MAX the rest stays queued, for the pair's last close (e is barred: its ends then
 * go to the closer thread too). */
static void drop_queued(struct dlpc__endpoint *e)
{
	uint8_t rec[DLPC_DIRECT_RECORD];
	union recv_ctl ctl;

	for (;;) {
		struct iovec iov = {.iov_base = rec, .iov_len = sizeof(rec)};
		struct msghdr mh = {.msg_iov = &iov,
				    .msg_iovlen = 1,
				    .msg_control = ctl.buf,
				    .msg_controllen = sizeof(ctl.buf)};
		struct ucred cred;
		bool odd, credited;
		int fd;

		if (dlpc__closing_held() >= DLPC_CLOSING_MAX) {
			bar(e, true);
			break;
		}
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
	if (n < 1 || dlpc__table_single(table, table_len))
		return 0;
	return dlpc__fail(-EINVAL,
			  "the next message in channel '%s' is a bundle of %lld tensor%s; receive "
			  "it as a bundle",
			  channel, (long long)n, n == 1 ? " under a key" : "s");
}

/* A datagram taken from a direct channel, and what its receive learns of it on the way to
 * delivering it. */
struct incoming {
	uint8_t rec[DLPC_DIRECT_RECORD + 1];
	union recv_ctl ctl;
	struct iovec iov;
	struct msghdr mh;
	ssize_t got;	      /* its bytes */
	bool waited;	      /* the receive waited for it */
	int fd;		      /* the storage's fd, or -1 */
	unsigned nfds;	      /* SCM_RIGHTS fds that came with it */
	struct ucred cred;    /* its sender's */
	bool odd, credited;   /* as take_fds() says */
	uint64_t size;	      /* of its storage */
	const uint8_t *table; /* its tensor table, in rec */
	size_t table_len;
	struct dlpc__mkey key; /* the storage's, where this process mapped it already */
	bool keyed;
	char why[256]; /* what is wrong with it */
};

/* What a read of nothing from the receiving end of @p e means, @p waited for or not: a datagram
 * of nothing without credentials, the end of the channel's stream, or its removal. The error. */
static int read_nothing(const struct dlpc__endpoint *e, const char *channel, bool waited)
{
	if (!at_end(e))
		return dlpc__fail(-EBADMSG,
				  "cannot receive from channel '%s': an empty datagram "
				  "without its sender's credentials came (a process that "
				  "joined the channel turned them off); it was dropped",
				  channel);
	/* the end: of the stream once every message queued before it was read (the daemon said
	 * so when this endpoint joined: otherwise it is asked, by joining anew), or a removal */
	if (!shut(e) && e->ended)
		return dlpc__fail(-EPIPE,
				  "channel '%s' has ended: every producer closed it and "
				  "every message was received",
				  channel);
	return waited && shut(e) ? dlpc__fail(-EIDRM, "channel '%s' was removed", channel)
				 : -ESHUTDOWN;
}

/* Take the next datagram from the channel of @p e into @p m, waiting up to @p timeout ms (0: not
 * at all, <0: forever) for one to come. 0, or the error. */
static int wait_datagram(dlpc_client *c, struct dlpc__endpoint *e, const char *channel,
			 int64_t timeout, bool single, struct incoming *m)
{
	int64_t end = dlpc__mono_end(timeout), check_at = 0;
	struct dlpc__wait w = {.wake = -1, .sock = -1};
	int r;

	for (;;) {
		m->iov = (struct iovec){.iov_base = m->rec, .iov_len = sizeof(m->rec)};
		memset(&m->mh, 0, sizeof(m->mh));
		m->mh.msg_iov = &m->iov;
		m->mh.msg_iovlen = 1;
		m->mh.msg_control = m->ctl.buf;
		m->mh.msg_controllen = sizeof(m->ctl.buf);
		if (single && (r = single_waits(e, channel)) < 0)
			break;
		m->got = recvmsg(e->ends[1], &m->mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
		/* every datagram comes with the sender's credentials (SO_PASSCRED): 0 bytes and no
		 * control message is the end of the stream, or a datagram of nothing from a
		 * joiner that turned the credentials off */
		if (m->got > 0 || (m->got == 0 && m->mh.msg_controllen > 0)) {
			r = 0;
			break;
		}
		if (m->got == 0) {
			r = read_nothing(e, channel, m->waited);
			break;
		}
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN) {
			r = -errno;
			r = dlpc__fail(r, "cannot receive from channel '%s': %s", channel,
				       strerror(-r));
			break;
		}
		if (timeout == 0) {
			r = dlpc__fail(-EAGAIN, "channel '%s' is empty", channel);
			break;
		}
		/* another receiver may take what made the end readable: then wait again */
		r = m->waited ? 0 : dlpc__direct_watch_start(c, &w);
		m->waited = true;
		if (r == 0)
			r = dlpc__direct_wait_end(c, &w, e->ends[1], POLLIN, end, &check_at);
		if (r < 0) {
			r = r == -ETIMEDOUT
				    ? dlpc__fail(r,
						 "no message came in channel '%s' "
						 "within %lld ms",
						 channel, (long long)timeout)
				    : dlpc__direct_wait_failed(r, "receive from", channel, timeout);
			break;
		}
	}
	dlpc__direct_watch_end(c, &w);
	return r;
}

/* Is the message in @p m whole and sound: one record, one sealed storage's fd, the sender's
 * credentials, a sane table (of one tensor when @p single)? 0, or the error with the reason in
 * m->why (-EMFILE, for fds lost for want of room, has failed already). */
static int check_message(dlpc_client *c, const char *channel, bool single, struct incoming *m)
{
	int64_t n;

	if (m->mh.msg_flags & MSG_CTRUNC)
		return dlpc__fail(-EMFILE,
				  "cannot receive from channel '%s': a message came with more fds "
				  "than this process had room for; it was lost",
				  channel);
	if (m->mh.msg_flags & MSG_TRUNC || m->got != DLPC_DIRECT_RECORD) {
		snprintf(m->why, sizeof(m->why), "a datagram of %zd bytes, not a record of %d",
			 m->got, DLPC_DIRECT_RECORD);
		return -EBADMSG;
	}
	if (m->odd) {
		snprintf(m->why, sizeof(m->why),
			 "a control message other than its fd came with it");
		return -EBADMSG;
	}
	if (!m->credited) {
		snprintf(m->why, sizeof(m->why),
			 "it came without its sender's credentials (a process that joined the "
			 "channel turned them off)");
		return -EBADMSG;
	}
	if (dlpc__direct_decode(m->rec, (size_t)m->got, &m->size, &m->table, &m->table_len, m->why,
				sizeof(m->why)) < 0)
		return -EBADMSG;
	if (m->nfds != 1) {
		snprintf(m->why, sizeof(m->why), "%u fds came with it, not one", m->nfds);
		return -EBADMSG;
	}
	if ((n = table_sane(m->table, m->table_len, m->size, m->why, sizeof(m->why))) < 0)
		return -EBADMSG;
	if (single && !dlpc__table_single(m->table, m->table_len)) {
		snprintf(m->why, sizeof(m->why),
			 "it is a bundle of %lld tensor%s, and a single tensor was asked for "
			 "(receive bundles with dlpc_recv_bundle())",
			 (long long)n, n == 1 ? " under a key" : "s");
		return -EINVAL;
	}
	if (!dlpc__maps_sealed(c, m->fd, m->size, &m->key, &m->keyed) &&
	    dlpc__storage_check(m->fd, m->size, DLPC__STORAGE_SEALED, m->why, sizeof(m->why)) < 0)
		return -EBADMSG;
	return 0;
}

/* Drop the message in @p m, found wrong (@p r, as check_message() says): its fd goes to be
 * closed, and past DLPC_CLOSING_MAX fds waiting for that, @p e is barred. The error. */
static int drop_message(struct dlpc__endpoint *e, const char *channel, const struct incoming *m,
			int r)
{
	size_t held;

	dlpc__close_later(m->fd);
	held = dlpc__closing_held();
	if (held >= DLPC_CLOSING_MAX) {
		char what[400];

		bar(e, true);
		snprintf(what, sizeof(what), "the message from pid %d (uid %d) was dropped (%s)",
			 (int)m->cred.pid, (int)m->cred.uid,
			 r == -EMFILE ? "more fds than room for them" : m->why);
		return barred_fail(channel, held, what);
	}
	if (r == -EMFILE)
		return r;
	return dlpc__fail(r,
			  "cannot receive from channel '%s': the message from pid %d (uid "
			  "%d) was dropped: %s",
			  channel, (int)m->cred.pid, (int)m->cred.uid, m->why);
}

/* Hand the sound message in @p m to the caller, as an attach of its storage would. */
static int deliver(dlpc_client *c, struct dlpc__endpoint *e, const char *channel, uint32_t flags,
		   struct incoming *m, dlpc_bundle **ret)
{
	Dlpackd__V1__AttachReply rep = DLPACKD__V1__ATTACH_REPLY__INIT;

	rep.generation = 0;
	rep.ref_id = 0; /* no reference of the daemon's: the fd is the message */
	rep.device_type = kDLCPU;
	rep.storage_size = m->size;
	rep.tensor_table.data = (uint8_t *)m->table;
	rep.tensor_table.len = m->table_len;
	rep.owner_uid = (uint32_t)m->cred.uid;
	rep.owner_pid = (int32_t)m->cred.pid;
	return dlpc__attach_build(c, e->conn_seq, false, 0, channel, &rep, m->fd,
				  flags | DLPC__ATTACH_SEALED, NULL, m->keyed ? &m->key : NULL,
				  ret);
}

int dlpc__direct_recv(dlpc_client *c, struct dlpc__endpoint *e, const char *channel, uint32_t flags,
		      int64_t timeout, bool single, dlpc_bundle **ret)
{
	struct incoming m;
	int r;

	assert(e->direct);
	/* a channel that sent fds refused past the bound stays unread while they wait */
	if (barred(e)) {
		size_t held = dlpc__closing_held();

		if (held >= DLPC_CLOSING_MAX)
			return barred_fail(channel, held, NULL);
		bar(e, false);
	}
	m.waited = false;
	m.keyed = false;
	m.cred = (struct ucred){.pid = 0, .uid = (uid_t)-1};
	r = wait_datagram(c, e, channel, timeout, single, &m);
	if (r < 0)
		return r;
	m.nfds = take_fds(&m.mh, &m.fd, &m.cred, &m.odd, &m.credited);
	/* a message that came after the channel was removed is not delivered */
	if (shut(e)) {
		dlpc__close_later(m.fd);
		drop_queued(e);
		return m.waited ? dlpc__fail(-EIDRM, "channel '%s' was removed", channel)
				: -ESHUTDOWN;
	}
	/* the message is this receiver's now: anything wrong with it drops it */
	r = check_message(c, channel, single, &m);
	if (r < 0)
		return drop_message(e, channel, &m, r);
	return deliver(c, e, channel, flags, &m, ret);
}
