/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Direct channels (protocol 1.8). The daemon makes a SOCK_SEQPACKET socket pair for the channel
 * and hands its two ends to every process that joins it (CHANNEL JOIN); messages then go from
 * sender to receiver as datagrams carrying the storage's fd, queued by the kernel. The daemon is
 * not woken by a message: a hand-off costs what an fd passed over a Unix socket costs. What the
 * kernel guarantees takes the place of what the daemon does for a queued channel: a datagram
 * goes to exactly one receiver, in order; a receiver that dies holding a message closes its fd
 * (and the storage goes with the last one); the sending end's buffer bounds the queue.
 *
 * What the daemon keeps: the name, the owner, the ends (so that a process may join at any time,
 * and so that removal can shut them), and what STAT and LIST report. Each message is one record
 * of DLPC_DIRECT_RECORD bytes (proto/direct.h), so the bytes queued in the receiving end count the
 * messages, and the kernel's size of one record with its fd (measured here, once per channel)
 * turns a capacity in messages into the sending end's buffer size. The receivers check every
 * message themselves, with the checks the daemon makes of a publish (proto/storage.c): the
 * daemon never sees them, and never reads what a channel queues (removal shuts the pair). The receiving end passes credentials (SO_PASSCRED), so every message
 * says, from the kernel, which process sent it.
 *
 * Whose fds: the pair the daemon holds (two fds per channel, for as long as the channel lives,
 * whoever's connection opened it) is charged to the opener's uid, in its fd share
 * (--max-fd-share-per-uid) as its storages and connections are, and the channels themselves to
 * --max-channels-per-uid. A joiner's copies of the ends live in its own process, against its own
 * RLIMIT_NOFILE, and cost the daemon nothing; what senders queue in the pair is charged by the
 * kernel to the sender (its fds in flight, bounded by its RLIMIT_NOFILE).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>
#include <linux/sockios.h>

#include "base.h"
#include "channel.h"
#include "closer.h"
#include "direct.h"
#include "limits.h"
#include "quota.h"
#include "reaper.h"

/* The kernel's size of one record with one fd queued in the pair @p ends: what the sending end's
 * buffer is charged for it. 0 if it cannot be measured. */
static int record_truesize(const int ends[2], char *why, size_t whylen)
{
	uint8_t rec[DLPC_DIRECT_RECORD] = {0};
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} ctl;
	struct iovec iov = {.iov_base = rec, .iov_len = sizeof(rec)};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
	int fd = eventfd(0, EFD_CLOEXEC), queued = 0;
	ssize_t n;

	if (fd < 0) {
		snprintf(why, whylen, "cannot make an eventfd: %s", strerror(errno));
		return -errno;
	}
	memset(&ctl, 0, sizeof(ctl));
	mh.msg_control = ctl.buf;
	mh.msg_controllen = sizeof(ctl.buf);
	ctl.h.cmsg_level = SOL_SOCKET;
	ctl.h.cmsg_type = SCM_RIGHTS;
	ctl.h.cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(&ctl.h), &fd, sizeof(int));
	n = sendmsg(ends[0], &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
	close(fd);
	if (n != (ssize_t)sizeof(rec) || ioctl(ends[0], SIOCOUTQ, &queued) < 0 || queued <= 0) {
		snprintf(why, whylen, "cannot measure a record in its socket: %s",
			 n < 0 ? strerror(errno) : "nothing queued");
		return -EIO;
	}
	/* take it back out, closing the eventfd that came with it */
	mh.msg_control = ctl.buf;
	mh.msg_controllen = sizeof(ctl.buf);
	n = recvmsg(ends[1], &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	for (struct cmsghdr *c = n > 0 ? CMSG_FIRSTHDR(&mh) : NULL; c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			memcpy(&fd, CMSG_DATA(c), sizeof(int));
			close(fd);
		}
	return queued;
}

int dlpd_direct_open(struct dlpd_server *s, struct dlpd_channel *ch, uint32_t capacity, char *why,
		     size_t whylen)
{
	int ends[2], one = 1, ts, buf, r;
	socklen_t len = sizeof(buf);
	uint64_t want;

	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, ends) < 0) {
		r = -errno;
		snprintf(why, whylen, "cannot make its sockets: %s", strerror(errno));
		return r;
	}
	if (setsockopt(ends[1], SOL_SOCKET, SO_PASSCRED, &one, sizeof(one)) < 0) {
		r = -errno;
		snprintf(why, whylen, "cannot have its sockets pass credentials: %s",
			 strerror(errno));
		goto fail;
	}
	ts = record_truesize(ends, why, whylen);
	if (ts <= 0) {
		r = ts < 0 ? ts : -EIO;
		goto fail;
	}
	/* A datagram is taken while the buffer's use is below its size: k records fit a buffer
	 * of k times one. The kernel doubles what it is told, caps it at net.core.wmem_max and
	 * raises it to its minimum: what it ends up with says how many fit. */
	want = (uint64_t)capacity * (uint64_t)ts / 2;
	buf = want > INT32_MAX ? INT32_MAX : (int)want;
	if (setsockopt(ends[0], SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf)) < 0 ||
	    getsockopt(ends[0], SOL_SOCKET, SO_SNDBUF, &buf, &len) < 0) {
		r = -errno;
		snprintf(why, whylen, "cannot size its socket's buffer: %s", strerror(errno));
		goto fail;
	}
	ch->ends[0] = ends[0];
	ch->ends[1] = ends[1];
	ch->direct_capacity = (uint32_t)(((uint64_t)buf + (uint64_t)ts - 1) / (uint64_t)ts);
	s->channel_fds += 2;
	ch->usage->channel_fds += 2;
	return 0;
fail:
	close(ends[0]);
	close(ends[1]);
	return r;
}

/* Shut both sockets of @p ends: every copy, in every process that joined, sees it at once. */
static void shut(const int ends[2])
{
	shutdown(ends[0], SHUT_RDWR);
	shutdown(ends[1], SHUT_RDWR);
}

/* Shut and let go of the pair @p ends, closed in the closer of @p uid. Nothing queued is read
 * here: those are fds and records of whoever joined, not the daemon's to vouch for. The
 * receivers drop what they find once the pair is shut (client/direct_io.c), and the last close
 * of the pair frees the rest (a lingering socket in flight there blocks it): the daemon's closes
 * go to a closer, where a close that blocks stalls only that uid's closes. */
static void let_go(struct dlpd_server *s, struct dlpd_channel *ch, const int ends[2], uid_t uid)
{
	shut(ends);
	dlpd_close_uid(uid, ends[0]);
	dlpd_close_uid(uid, ends[1]);
	s->channel_fds -= 2;
	ch->usage->channel_fds -= 2;
}

void dlpd_direct_close(struct dlpd_server *s, struct dlpd_channel *ch)
{
	if (ch->ends[0] >= 0) {
		let_go(s, ch, ch->ends, ch->uid);
		ch->ends[0] = ch->ends[1] = -1;
	}
}

int dlpd_direct_renew(struct dlpd_peer *joiner, struct dlpd_channel *ch, char *why, size_t whylen)
{
	struct dlpd_server *s = joiner->srv;
	struct pollfd p[2] = {{.fd = ch->ends[0], .events = POLLRDHUP},
			      {.fd = ch->ends[1], .events = POLLRDHUP}};
	int old[2] = {ch->ends[0], ch->ends[1]}, one = 1, r;

	/* A process that joined holds the same sockets as every other: it may have turned the
	 * credentials off (every joiner's receive then refuses what comes), or shut them for all.
	 * The first is undone here; a shut pair is given up for a new one, which every user joins
	 * anew. The old one stays until the new one is made. */
	setsockopt(ch->ends[1], SOL_SOCKET, SO_PASSCRED, &one, sizeof(one));
	/* an ended channel's pair is shut for writing on purpose: its receivers read the rest */
	if (ch->ended || poll(p, 2, 0) <= 0 ||
	    !((p[0].revents | p[1].revents) & (POLLHUP | POLLRDHUP)))
		return 0;
	if (dlpd_fds_in_use(s) + 2 > s->fd_budget) {
		dlpd_fd_budget_why(s, why, whylen);
		return -EDQUOT;
	}
	/* The shut pair is closed for the uid whose JOIN renews it, in its closer and its fd
	 * share: whatever a joiner left queued there (a lingering socket blocks that close) then
	 * costs the uid that comes back for new sockets, not the channel's owner, and a joiner
	 * that shuts and joins in a loop is refused at its own share. */
	if (dlpd_uid_fds(joiner->usage) + 2 > dlpd_uid_fd_share(s)) {
		dlpd_uid_fd_share_why(joiner, dlpd_uid_fds(joiner->usage), why, whylen);
		return -EDQUOT;
	}
	/* (dlpd_direct_open() sets the ends only once it made them) */
	r = dlpd_direct_open(s, ch, ch->capacity, why, whylen);
	if (r < 0)
		return r;
	dlpd_log(LOG_NOTICE,
		 "a direct channel's sockets were shut by a process that joined it: "
		 "made new ones (uid %u closes the old ones)",
		 (unsigned)joiner->uid);
	let_go(s, ch, old, joiner->uid);
	return 0;
}

void dlpd_direct_shutdown_all(struct dlpd_server *s)
{
	struct dlpd_channel **v;
	size_t n;

	if (dlpd_channel_range(&s->reg, (const uint8_t *)"", 0, (const uint8_t *)"", 0, SIZE_MAX,
			       &v, &n) < 0) {
		dlpd_log(LOG_WARNING, "cannot list the direct channels to shut: out of memory; "
				      "processes that joined one keep it until they reconnect");
		return;
	}
	for (size_t i = 0; i < n; i++)
		if (v[i]->ends[0] >= 0)
			shut(v[i]->ends);
	free(v);
}

void dlpd_direct_end(struct dlpd_channel *ch)
{
	/* Only the sending end, only for writing: the receiving end then reads every datagram
	 * still queued, and 0 bytes after the last (POLLRDHUP without POLLHUP). A removal shuts
	 * both ends both ways (POLLHUP): receivers tell the two apart by that (direct_io.c). */
	if (ch->ends[0] >= 0)
		shutdown(ch->ends[0], SHUT_WR);
}

uint32_t dlpd_direct_depth(const struct dlpd_channel *ch)
{
	int bytes = 0;

	if (ch->ends[1] < 0 || ioctl(ch->ends[1], SIOCINQ, &bytes) < 0 || bytes < 0)
		return 0;
	return (uint32_t)(bytes / DLPC_DIRECT_RECORD);
}

void dlpd_direct_info(const struct dlpd_channel *ch, Dlpackd__V1__ChannelInfo *info)
{
	if (ch->ends[0] < 0)
		return;
	info->flags |= DLPC_CHANNEL_DIRECT;
	info->capacity = ch->direct_capacity;
	info->depth = dlpd_direct_depth(ch);
}
