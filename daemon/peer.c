/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A connection's transport: frames out, the socket events it waits for, and the mark that ends
 * it. Everything here may run in the middle of a request, an event being told to the watchers
 * or a registry change; so when a connection turns out to be broken it is only marked, never
 * destroyed (state.h).
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "closer.h"
#include "mem.h"
#include "peer.h"
#include "quota.h"

/*
 * Fds in flight. A reply's fds are in the kernel from its write until the client reads it, and
 * the kernel counts them against the daemon's user (past its RLIMIT_NOFILE, ETOOMANYREFS for
 * every connection; as root, without bound, in kernel memory). A client that sends requests and
 * reads nothing would hold hundreds per connection. So the fds written to a connection are
 * counted until its socket's send queue is seen empty (SIOCOUTQ: all it was sent, it took), and
 * charged to its uid (also after the connection is closed: dlpd_peer_drain_keep()). A uid may
 * have its fd share of them in flight (--max-fd-share-per-uid), all uids together the fd
 * budget; past that its frames with fds wait in their queues (so nothing more of those
 * connections is read), except that a uid with none in flight may always send one frame. The
 * counts are looked at only when short of room: the connection's own, and those of its uid's
 * other connections (or of every connection, when the budget is short) at most every
 * UNREAD_LOOK_ALL_MS. A waiting connection is looked at again after UNREAD_WAIT_MIN_MS, then
 * twice as long each time nothing went out since the last look, up to UNREAD_WAIT_MAX_MS.
 */
#define UNREAD_WAIT_MIN_MS 1
#define UNREAD_WAIT_MAX_MS 1000
#define UNREAD_LOOK_ALL_MS 100

static void unread_set(struct dlpd_peer *p, unsigned n)
{
	p->srv->unread_fds = p->srv->unread_fds - p->unread_fds + n;
	if (p->usage)
		p->usage->unread_fds = p->usage->unread_fds - p->unread_fds + n;
	p->unread_fds = n;
}

/* Count what the last write to @p p sent. */
static void unread_count(struct dlpd_peer *p)
{
	uint64_t sent = p->tx.fds_sent - p->unread_counted;

	p->unread_counted = p->tx.fds_sent;
	if (sent)
		unread_set(p, p->unread_fds + (unsigned)sent);
}

/* Has @p p's client taken everything it was sent? Then nothing of it is in flight. */
static void unread_look(struct dlpd_peer *p)
{
	int q;

	if (p->unread_fds && ioctl(p->fd, SIOCOUTQ, &q) == 0 && q == 0)
		unread_set(p, 0);
}

/* Look at every connection of @p p's uid (or every connection, @p all), at most every
 * UNREAD_LOOK_ALL_MS for each uid: an idle one's count is not refreshed otherwise. */
static void unread_look_all(struct dlpd_peer *p, bool all)
{
	struct dlpd_server *s = p->srv;
	uint64_t now = uv_now(s->loop);

	if (!p->usage || now - p->usage->unread_looked < UNREAD_LOOK_ALL_MS)
		return;
	p->usage->unread_looked = now;
	for (struct dlpd_list *l = s->peers.next; l != &s->peers; l = l->next) {
		struct dlpd_peer *o = dlpd_container_of(l, struct dlpd_peer, link);

		if (all || o->usage == p->usage)
			unread_look(o);
	}
}

/* The fds that may be written to @p p now (UINT32_MAX: no bound), for a frame of @p want. */
static uint32_t unread_room(struct dlpd_peer *p, unsigned want)
{
	struct dlpd_server *s = p->srv;
	uint64_t share = dlpd_uid_fd_share(s), uid = UINT64_MAX, all = UINT64_MAX, room;

	/* a connection that is closing flushes its last frames (its ERROR), and those only */
	if (p->state != DLPD_CONN_SERVING || !p->usage)
		return UINT32_MAX;
	for (int pass = 0; pass < 2; pass++) {
		if (share < s->fd_budget)
			uid = share > p->usage->unread_fds ? share - p->usage->unread_fds : 0;
		if (s->fd_budget != UINT64_MAX)
			all = s->fd_budget > s->unread_fds ? s->fd_budget - s->unread_fds : 0;
		if (pass || (uid >= want && all >= want))
			break;
		/* short: what its client and its uid's others (all, if the budget is short) took
		 * since is in flight no more */
		unread_look(p);
		unread_look_all(p, all < want);
	}
	room = uid < all ? uid : all;
	if (!p->usage->unread_fds && room < want)
		room = want; /* one frame, for a uid with none in flight */
	return room > UINT32_MAX ? UINT32_MAX : (uint32_t)room;
}

const char *dlpd_peer_desc(const struct dlpd_peer *p, char *buf, size_t len)
{
	snprintf(buf, len, "client %llu (pid %d, uid %u)", (unsigned long long)p->serial,
		 (int)p->pid, (unsigned)p->uid);
	return buf;
}

void dlpd_peer_unread_init(struct dlpd_peer *p)
{
	uv_timer_init(p->srv->loop, &p->unread_timer);
	p->unread_timer.data = p;
}

/*
 * A destroyed connection's fds in flight stay in the client's socket until it reads them or
 * closes its end, whatever the daemon does with its own: closing it frees none of them. So its
 * socket is kept (shut, so that the client sees the end), still charged to its uid (the fds in
 * flight, and the socket as one of its fds), and looked at every DRAIN_LOOK_MS until nothing
 * it was sent is left in it; then it goes to its uid's closer.
 */
#define DRAIN_LOOK_MS 100
/* The most fds one message carries (the kernel's SCM_MAX_FD). */
#define SCM_FDS 253

void dlpd_peer_drain_keep(struct dlpd_peer *p)
{
	struct dlpd_server *s = p->srv;
	struct dlpd_drain *d;

	unread_look(p);
	uv_timer_stop(&p->unread_timer);
	d = p->unread_fds && !s->stopping ? calloc(1, sizeof(*d)) : NULL;
	if (!d) {
		unread_set(p, 0);
		return;
	}
	/* the counts stay as they are, the drain's now */
	d->fd = -1;
	d->uid = p->uid;
	d->usage = p->usage;
	d->fds = p->unread_fds;
	d->usage->draining++;
	s->draining++;
	p->unread_fds = 0;
	p->drain = d;
}

/* @p d is done: its counts go, and its socket to its uid's closer. */
static void drain_end(struct dlpd_server *s, struct dlpd_drain *d)
{
	dlpd_list_del(&d->link);
	s->unread_fds -= d->fds;
	d->usage->unread_fds -= d->fds;
	s->draining--;
	d->usage->draining--;
	dlpd_close_uid(d->uid, d->fd);
	dlpd_usage_put(&s->reg, d->usage);
	free(d);
}

static void drain_look(uv_timer_t *t)
{
	struct dlpd_server *s = t->data;

	for (struct dlpd_list *l = s->drains.next, *next; l != &s->drains; l = next) {
		struct dlpd_drain *d = dlpd_container_of(l, struct dlpd_drain, link);
		int q;

		next = l->next;
		if (ioctl(d->fd, SIOCOUTQ, &q) < 0 || q == 0)
			drain_end(s, d);
	}
	if (dlpd_list_empty(&s->drains))
		uv_timer_stop(&s->drain_timer);
}

/*
 * What the client sent and the daemon never read stays in the kept socket's receive queue: its
 * fds, and among them perhaps the client's own end of this very socket, which would then never
 * close (it could only go with the queue, which goes only once the socket is closed). The
 * queue is read out, and its fds go to the uid's closer. (Nothing more comes: it is shut.)
 */
static void drain_read_out(struct dlpd_drain *d)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * SCM_FDS)];
	} ctl;
	static uint8_t junk[1 << 16];

	for (;;) {
		struct iovec iov = {.iov_base = junk, .iov_len = sizeof(junk)};
		struct msghdr mh = {.msg_iov = &iov,
				    .msg_iovlen = 1,
				    .msg_control = ctl.buf,
				    .msg_controllen = sizeof(ctl.buf)};
		ssize_t n = recvmsg(d->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);

		if (n <= 0 && !(n < 0 && errno == EINTR))
			return;
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
			size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			int fd;

			if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
				continue;
			for (size_t i = 0; i < k; i++) {
				memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(fd));
				dlpd_close_uid(d->uid, fd);
			}
		}
	}
}

void dlpd_peer_drain_start(struct dlpd_peer *p)
{
	struct dlpd_server *s = p->srv;
	struct dlpd_drain *d = p->drain;

	d->fd = p->fd;
	p->drain = NULL;
	drain_read_out(d);
	dlpd_list_add_tail(&s->drains, &d->link);
	/* (a connection destroyed before the daemon began to stop, closed after) */
	if (s->stopping) {
		drain_end(s, d);
		return;
	}
	if (!uv_is_active((uv_handle_t *)&s->drain_timer))
		uv_timer_start(&s->drain_timer, drain_look, DRAIN_LOOK_MS, DRAIN_LOOK_MS);
}

void dlpd_peer_drains_init(struct dlpd_server *s)
{
	dlpd_list_init(&s->drains);
	uv_timer_init(s->loop, &s->drain_timer);
	s->drain_timer.data = s;
	/* what is in flight to a closed connection is no reason to keep the loop running */
	uv_unref((uv_handle_t *)&s->drain_timer);
}

void dlpd_peer_drains_hand(struct dlpd_server *s)
{
	while (!dlpd_list_empty(&s->drains)) {
		struct dlpd_drain *d = dlpd_container_of(s->drains.next, struct dlpd_drain, link);

		fcntl(d->fd, F_SETFD, 0);
		drain_end(s, d);
	}
}

void dlpd_peer_drains_stop(struct dlpd_server *s)
{
	while (!dlpd_list_empty(&s->drains))
		drain_end(s, dlpd_container_of(s->drains.next, struct dlpd_drain, link));
	uv_close((uv_handle_t *)&s->drain_timer, NULL);
}

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77 /* Linux 6.5; Debian 12's headers lack it */
#endif

/*
 * Has the process that connected @p p exited, all of its threads? A pidfd of it (SO_PEERPIDFD)
 * says so however its pid was reused and in whatever pid namespace (readable once the whole
 * thread group is gone: a main thread that exited while others run is not). Where the kernel
 * has none (before 6.5), or no fd is left for one, its pid says whether it was reaped.
 */
static bool peer_gone(const struct dlpd_peer *p)
{
	int pidfd = -1;
	socklen_t len = sizeof(pidfd);

	if (getsockopt(p->fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0 && pidfd >= 0) {
		struct pollfd pf = {.fd = pidfd, .events = POLLIN};
		bool gone = poll(&pf, 1, 0) == 1;

		close(pidfd);
		return gone;
	}
	return p->pid > 0 && kill(p->pid, 0) < 0 && errno == ESRCH;
}

/*
 * Is waiting connection @p p's client gone for good? Its process has exited, and nothing of
 * what it was sent (something was) has been taken for --frame-timeout-ms. Its end of the
 * socket lives on all the same when something else holds it; where that is the daemon itself
 * (the client sent its own end on this connection, and it waits unread in the receive queue
 * that the daemon does not read while the connection waits), nothing would ever end it.
 * Closed, the connection's socket is kept and that queue read out (dlpd_peer_drain_start()):
 * the client's end goes, and what was in flight in it with it. (A process that handed its end
 * to another that still reads is not stalled: whatever that one takes restarts the clock.)
 */
static bool unread_orphaned(struct dlpd_peer *p)
{
	uint64_t now = uv_now(p->srv->loop);
	int q;

	if (ioctl(p->fd, SIOCOUTQ, &q) < 0 || !p->unread_still_since || q != p->unread_q) {
		p->unread_q = q;
		p->unread_still_since = now;
		return false;
	}
	/* (one that was sent nothing unread waits for its uid's other connections) */
	return q > 0 && now - p->unread_still_since >= p->srv->lim.frame_timeout_ms && peer_gone(p);
}

/* Look again whether @p t's connection may be sent its waiting frames: as if it polled
 * writable (dispatch.c flushes, then serves it if nothing is left waiting). */
static void unread_again(uv_timer_t *t)
{
	struct dlpd_peer *p = t->data;
	uint64_t sent = p->tx.fds_sent;

	if (unread_orphaned(p)) {
		dlpd_peer_fail(p, LOG_NOTICE,
			       "its process is gone, yet its socket stays open and has taken "
			       "nothing it was sent for %llu ms (--frame-timeout-ms); closed",
			       (unsigned long long)p->srv->lim.frame_timeout_ms);
		return;
	}
	if (p->unread_writes) {
		/* polled for room meanwhile: only the look above, now and then */
		uv_timer_start(t, unread_again, UNREAD_WAIT_MAX_MS, 0);
		return;
	}

	/* later and later while nothing goes out, soon again while its frames do (its client
	 * reads): the flush below restarts this timer if frames still wait */
	if (p->unread_wait_ms < UNREAD_WAIT_MAX_MS)
		p->unread_wait_ms *= 2;
	p->srv->peer_io(&p->poll, 0, UV_WRITABLE);
	if (p->tx.fds_sent != sent && uv_is_active((uv_handle_t *)t)) {
		p->unread_wait_ms = UNREAD_WAIT_MIN_MS;
		uv_timer_start(t, unread_again, UNREAD_WAIT_MIN_MS, 0);
	}
}

void dlpd_peer_update_events(struct dlpd_peer *p)
{
	int events = 0;

	bool waits = false, writes = false;

	if (p->broken || p->state == DLPD_CONN_MARKED) {
		events = 0;
	} else if (dlpc__tx_held(&p->tx) && p->state == DLPD_CONN_SERVING) {
		/* its fds in flight wait for it to read (above): the socket has room, and
		 * polling it for room would never wait */
		waits = true;
	} else if (p->tx.head) {
		/* backpressure: nothing is read while replies wait (see dispatch.c); its
		 * client may be gone for good all the same (unread_orphaned()) */
		events = UV_WRITABLE;
		writes = true;
	} else if (!dlpd_peer_marked(p) && !p->hup) {
		events = UV_READABLE | UV_DISCONNECT;
	}
	/* from polling for room to waiting: the first look comes soon, not a while later */
	if (waits && p->unread_writes)
		uv_timer_stop(&p->unread_timer);
	p->unread_writes = writes;
	if ((waits || writes) && !uv_is_active((uv_handle_t *)&p->unread_timer)) {
		if (waits)
			p->unread_wait_ms =
				p->unread_wait_ms ? p->unread_wait_ms : UNREAD_WAIT_MIN_MS;
		uv_timer_start(&p->unread_timer, unread_again,
			       waits ? p->unread_wait_ms : UNREAD_WAIT_MAX_MS, 0);
	} else if (!waits && !writes) {
		uv_timer_stop(&p->unread_timer);
		p->unread_still_since = 0;
	}
	/* the wait starts afresh, soon, each time it comes */
	if (!waits)
		p->unread_wait_ms = 0;
	if (events == p->events)
		return;
	p->events = events;
	if (events)
		uv_poll_start(&p->poll, events, p->srv->peer_io);
	else
		uv_poll_stop(&p->poll);
}

void dlpd_peer_fail(struct dlpd_peer *p, int prio, const char *fmt, ...)
{
	char msg[512], desc[96];
	va_list ap;

	if (dlpd_peer_marked(p))
		return;
	p->state = DLPD_CONN_MARKED;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	dlpd_log(prio, "%s: %s", dlpd_peer_desc(p, desc, sizeof(desc)), msg);
	dlpd_list_add_tail(&p->srv->failed, &p->fail_link);
	dlpd_peer_update_events(p);
}

/* The socket failed: nothing more can be written. */
static void broken(struct dlpd_peer *p, int err)
{
	p->broken = true;
	dlpd_peer_fail(p, LOG_DEBUG, "write failed: %s", strerror(-err));
	dlpd_peer_update_events(p);
}

int dlpd_peer_flush(struct dlpd_peer *p)
{
	int r;

	/* (a connection closing flushes its last frames whatever is in flight: its linger
	 * time bounds that) */
	p->tx.fds_room = p->tx.nfds ? unread_room(p, DLPC_FRAME_FDS_MAX) : UINT32_MAX;
	r = dlpc__tx_flush(&p->tx, p->fd);
	unread_count(p);
	dlpd_mem_tx_account(p);
	if (r < 0) {
		broken(p, r);
		return r;
	}
	dlpd_peer_update_events(p);
	return r;
}

int dlpd_peer_send(struct dlpd_peer *p, const uint8_t *frame, size_t len, const int *fds,
		   unsigned nfds)
{
	const struct dlpd_limits *lim = &p->srv->lim;
	uint64_t max = p->watching ? lim->watch_queue_bytes : lim->queue_bytes;
	const char *limit = p->watching ? "--max-watch-queue-bytes, default DLPC_WATCH_QUEUE_MAX"
					: "--max-queue-bytes, default DLPC_TX_QUEUE_MAX";
	char why[320];
	int r;

	if (dlpd_peer_marked(p) || p->broken)
		return -EPIPE;
	if (nfds)
		p->tx.fds_room = unread_room(p, nfds);
	r = dlpc__tx_send(&p->tx, p->fd, frame, len, fds, nfds);
	unread_count(p);
	if (r < 0) {
		broken(p, r);
		return r;
	}
	if (!p->tx.head)
		return 0;
	/* what waits counts against its uid, with its unfinished frames and waiting requests
	 * (mem.c): so many connections that do not read cannot multiply the queue limit */
	dlpd_mem_tx_account(p);
	if (dlpd_mem_tx_over(p, why, sizeof(why))) {
		p->srv->stats.queue_drops++;
		p->broken = true;
		dlpd_peer_fail(p, LOG_WARNING, "dropped: %s", why);
		dlpd_peer_update_events(p);
		return -ENOBUFS;
	}
	/* The copies of fds its queue holds count in its uid's fd share and the daemon's budget:
	 * connections that do not read the replies of waiting ATTACHes and RECVs (answered when
	 * their name or message comes, not held back) would otherwise make the daemon hold fds
	 * past both. A uid may be at its share for ordinary reasons and still be sent a reply that
	 * has to wait: the connection that queues one is closed only once its uid is past its
	 * share, and then either DLPC_UID_TX_FDS_SLACK past it or with the daemon past its budget
	 * (another uid's use of the budget never closes a connection of a uid within its share). */
	if (p->tx.nfds > 0 && p->usage && dlpd_uid_fds(p->usage) > dlpd_uid_fd_share(p->srv) &&
	    (dlpd_uid_fds(p->usage) > dlpd_uid_fd_share(p->srv) + DLPC_UID_TX_FDS_SLACK ||
	     dlpd_fds_in_use(p->srv) > p->srv->fd_budget)) {
		char share[320];

		p->srv->stats.queue_drops++;
		p->broken = true;
		dlpd_uid_fd_share_why(p, dlpd_uid_fds(p->usage), share, sizeof(share));
		dlpd_peer_fail(p, LOG_WARNING,
			       "dropped: it stopped reading and %u fds wait for it; %s", p->tx.nfds,
			       share);
		dlpd_peer_update_events(p);
		return -ENOBUFS;
	}
	/* A client that does not read what it asked for (or, watching, cannot keep up) would
	 * otherwise grow this queue without bound. */
	if (p->tx.bytes > max || p->tx.nfds > lim->queue_fds) {
		p->srv->stats.queue_drops++;
		p->broken = true;
		if (p->tx.bytes > max)
			dlpd_peer_fail(
				p, LOG_WARNING,
				"dropped: it stopped reading and %zu bytes wait for it, over "
				"the limit of %llu (%s)",
				p->tx.bytes, (unsigned long long)max, limit);
		else
			dlpd_peer_fail(
				p, LOG_WARNING,
				"dropped: it stopped reading and %u fds wait for it, over the "
				"limit of %llu (--max-queue-fds, default DLPC_TX_QUEUE_FDS_MAX)",
				p->tx.nfds, (unsigned long long)lim->queue_fds);
		dlpd_peer_update_events(p);
		return -ENOBUFS;
	}
	dlpd_peer_update_events(p);
	return 0;
}

int dlpd_reply(struct dlpd_peer *p, uint16_t type, uint32_t id, const ProtobufCMessage *m,
	       const int *fds, unsigned nfds)
{
	return dlpd_reply_tail(p, type, id, m, NULL, 0, fds, nfds);
}

int dlpd_reply_tail(struct dlpd_peer *p, uint16_t type, uint32_t id, const ProtobufCMessage *m,
		    const uint8_t *tail, size_t tail_len, const int *fds, unsigned nfds)
{
	struct dlpc__scratch *out = &p->srv->out;
	ssize_t len;

	if (dlpd_peer_marked(p) || p->broken)
		return -EPIPE;
	len = dlpc__msg_frame_tail(out, type, id, m, tail, tail_len, nfds);
	if (len < 0) {
		dlpd_peer_fail(p, LOG_ERR, "cannot build a reply: %s", strerror((int)-len));
		return (int)len;
	}
	return dlpd_peer_send(p, out->p, (size_t)len, fds, nfds);
}

/*
 * How loudly to log a refused request. A refusal is the client's business, and its answer says
 * why: no such name, name taken, a wait expired or canceled, not allowed, invalid, over a quota,
 * the other kind of channel, a channel empty, full, ended or removed. All of that is routine for a
 * daemon shared by many programs, so debug. A warning is for what an operator must act on: the
 * daemon itself out of memory, fds or space. (A protocol violation is logged by the mark that
 * follows it.)
 */
static int refusal_prio(uint32_t code)
{
	switch (code) {
	case ENOMEM:
	case EMFILE:
	case ENFILE:
	case ENOSPC:
	case EIO:
		return LOG_WARNING;
	default:
		return LOG_DEBUG;
	}
}

int dlpd_reply_error(struct dlpd_peer *p, uint32_t id, int err, const char *fmt, ...)
{
	Dlpackd__V1__Error e = DLPACKD__V1__ERROR__INIT;
	char msg[512], desc[96];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	e.code = err < 0 ? -err : err;
	e.message = msg;
	dlpd_log(refusal_prio(e.code), "%s: request %u refused: %s (%s)",
		 dlpd_peer_desc(p, desc, sizeof(desc)), id, msg, strerror(e.code));
	return dlpd_reply(p, DLPC_MSG_ERROR, id, &e.base, NULL, 0);
}
