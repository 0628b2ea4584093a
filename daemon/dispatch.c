/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A connection's life: it is created here at accept, its requests are read and run through the
 * table here, and it is destroyed here, in one place (destroy()), once the code that marked it
 * (dlpd_peer_fail()) has returned to the event loop. Policy lives here too: which failures end a connection and what
 * the log says of them.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "closer.h"
#include "dispatch.h"
#include "handlers.h"
#include "handoff.h"
#include "mem.h"
#include "names.h"
#include "peer.h"
#include "quota.h"
#include "reaper.h"
#include "reclaim.h"

/* What each request needs before its handler runs: its row of DLPC_REQUESTS. */
struct request {
	int (*fn)(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
	const ProtobufCMessageDescriptor *desc;
	uint32_t max_len; /* largest payload this type may have: checked before unpacking */
	uint8_t min_fds, max_fds;
	bool before_hello, while_watching;
};

/* clang-format off */
static const struct request requests[DLPC_MSG__REQUEST_COUNT] = {
#define X(NAME, name, type, max_len, min_fds, max_fds, before_hello, while_watching)               \
	[DLPC_MSG_##NAME] = {dlpd_on_##name, &dlpackd__v1__##name##__descriptor, max_len, min_fds, \
			     max_fds, before_hello, while_watching},
	DLPC_REQUESTS(X)
#undef X
};
/* clang-format on */

static void deadline_check(uv_timer_t *t);

static void peer_closed(uv_handle_t *h)
{
	struct dlpd_peer *p = h->data;

	if (--p->handles_open > 0)
		return;
	p->srv->peers_closing--;
	/* Its last close frees what is still in flight in it: fds it sent that were never read
	 * (a lingering socket among them blocks that close), so it is its uid's to close, after
	 * whatever that uid's closer was given before. The client sees the end now. */
	shutdown(p->fd, SHUT_RDWR);
	if (p->drain)
		dlpd_peer_drain_start(p);
	else
		dlpd_close_uid(p->uid, p->fd);
	free(p);
}

static void close_handles(struct dlpd_peer *p)
{
	uid_t was;

	if (uv_is_closing((uv_handle_t *)&p->poll))
		return;
	dlpd_list_del(&p->fail_link);
	was = dlpd_closer_charge(p->uid);
	dlpc__tx_clear(&p->tx);
	dlpd_closer_charge(was);
	p->srv->tx_fds -= p->tx_fds;
	p->tx_fds = 0;
	/* a lingering one was its uid's until now (destroy()) */
	if (p->usage) {
		dlpd_mem_tx_account(p);
		p->usage->lingering--;
		dlpd_usage_put(&p->srv->reg, p->usage);
		p->usage = NULL;
	}
	uv_close((uv_handle_t *)&p->poll, peer_closed);
	uv_close((uv_handle_t *)&p->deadline, peer_closed);
	uv_close((uv_handle_t *)&p->unread_timer, peer_closed);
}

static void linger_expired(uv_timer_t *t)
{
	struct dlpd_peer *p = t->data;
	char desc[96];

	dlpd_log(LOG_DEBUG, "%s: %zu bytes it did not read within %d ms are dropped",
		 dlpd_peer_desc(p, desc, sizeof(desc)), p->tx.bytes, DLPC_ERROR_LINGER_MS);
	close_handles(p);
}

/*
 * The one place a connection is destroyed: everything it holds goes (so STAT and attachers see
 * a crashed client gone), then its socket closes, once what it was last sent (the ERROR that
 * says why) has left or DLPC_ERROR_LINGER_MS passed.
 */
static void destroy(struct dlpd_peer *p)
{
	struct dlpd_server *s = p->srv;

	dlpd_assert(p->state == DLPD_CONN_MARKED);
	dlpd_list_del(&p->fail_link);
	dlpd_list_del(&p->link);
	s->npeers--;
	s->peers_closing++;
	dlpd_watch_drop(p);
	/* before its entries go: their storages must not queue notices for it */
	dlpd_reclaim_drop_peer(p);
	dlpd_channels_drop_peer(p);
	dlpd_names_drop_peer(p);
	/* its receive buffer goes, and with it the fds it sent that no frame claimed: closed in
	 * its uid's closer, charged to it */
	{
		uid_t was = dlpd_closer_charge(p->uid);

		dlpd_mem_forget(p);
		dlpd_closer_charge(was);
	}
	/* what is in flight to it stays its uid's until the client takes it */
	dlpd_peer_drain_keep(p);
	p->usage->connections--;
	p->usage->memory -= DLPD_CONNECTION_COST;
	uv_timer_stop(&p->deadline);
	/* It lingers to deliver its last ERROR, not replies with fds (a client could reconnect
	 * and do it again, and again). Its socket and what is queued in it stay its uid's
	 * meanwhile, one of its fds and its pending bytes: a uid that makes connection after
	 * connection linger holds its share at most. */
	if (p->tx.head && !p->broken && !s->stopping && p->tx.nfds == 0) {
		p->usage->lingering++;
		dlpd_mem_tx_account(p);
		p->state = DLPD_CONN_LINGERING;
		dlpd_list_add_tail(&s->lingering, &p->fail_link);
		dlpd_peer_update_events(p);
		uv_timer_start(&p->deadline, linger_expired, DLPC_ERROR_LINGER_MS, 0);
		return;
	}
	dlpd_usage_put(&s->reg, p->usage);
	p->usage = NULL;
	close_handles(p);
}

/* Destroy every marked connection; destroying one may mark others (a watcher that cannot take
 * the event of an entry going), which are destroyed in the same pass. Runs at the end of each
 * socket event, before every wait for I/O (for marks made by timers), and at stop. */
static void teardown(uv_prepare_t *h)
{
	struct dlpd_server *s = h->data;

	while (!dlpd_list_empty(&s->failed))
		destroy(dlpd_container_of(s->failed.next, struct dlpd_peer, fail_link));
}

/* The frame deadline passed, or a new frame began since it was set: mark the peer, or wait for
 * what is left of the new frame's time. */
static void deadline_check(uv_timer_t *t)
{
	struct dlpd_peer *p = t->data;
	uint64_t limit = p->srv->lim.frame_timeout_ms;
	uint64_t waited;

	/* held back (below) is not stalled: the clock restarts when reading does */
	if (dlpd_peer_marked(p) || p->tx.head ||
	    (p->state == DLPD_CONN_SERVING && !dlpc__rx_partial(&p->rx)))
		return;
	waited = uv_now(p->srv->loop) - p->partial_since;
	if (waited < limit) {
		uv_timer_start(&p->deadline, deadline_check, limit - waited, 0);
		return;
	}
	if (p->state == DLPD_CONN_GREETING)
		dlpd_peer_fail(
			p, LOG_WARNING,
			"no complete HELLO within %llu ms of connecting (--frame-timeout-ms); "
			"dropped",
			(unsigned long long)limit);
	else
		dlpd_peer_fail(
			p, LOG_WARNING,
			"a frame begun %llu ms ago is still incomplete; the limit is %llu ms "
			"(--frame-timeout-ms); dropped",
			(unsigned long long)waited, (unsigned long long)limit);
}

/* After a read: if part of a frame is left buffered, make sure its deadline is set. A frame
 * that arrived whole costs nothing here. */
static void deadline_arm(struct dlpd_peer *p)
{
	if (!dlpc__rx_partial(&p->rx))
		return;
	if (p->partial_frame != p->frames_done) {
		p->partial_frame = p->frames_done;
		p->partial_since = uv_now(p->srv->loop);
	}
	if (!uv_is_active((uv_handle_t *)&p->deadline))
		deadline_check(&p->deadline);
}

/* A protocol violation: say why in an ERROR (flushed before the socket closes), then mark. */
static void violation(struct dlpd_peer *p, uint32_t id, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static void violation(struct dlpd_peer *p, uint32_t id, const char *fmt, ...)
{
	char why[256];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(why, sizeof(why), fmt, ap);
	va_end(ap);
	p->srv->stats.protocol_errors++;
	dlpd_reply_error(p, id, EPROTO, "protocol violation: %s", why);
	dlpd_peer_fail(p, LOG_WARNING, "protocol violation: %s", why);
}

/*
 * A uid with closes pending whose fds (storages, connections and those closes) would pass its
 * share with the fds of this request sends fds faster than they close (a close that blocks, on
 * a stalled filesystem or a lingering socket): the request is refused with EDQUOT before it
 * runs and the connection is closed, so that nothing more of that uid is read there. Its fds go
 * to its closer, charged to it; new connections of the uid are refused while it is over its
 * share (server.c, HELLO). A uid without closes pending is left to the request's own checks.
 */
static bool closing_over_share(struct dlpd_peer *p, const struct dlpc__frame *f, const char *name)
{
	const struct dlpd_server *s = p->srv;
	const struct dlpd_usage *u = p->usage;
	uint64_t share = dlpd_uid_fd_share(s), held;
	char why[320];

	if (f->nfds == 0 || u->closing == 0 || share >= s->fd_budget)
		return false;
	held = dlpd_uid_fds(u);
	if (held + f->nfds <= share)
		return false;
	dlpd_uid_fd_share_why(p, held, why, sizeof(why));
	dlpd_reply_error(p, f->hdr.id, EDQUOT, "%s; %s with %u fds refused, connection closed", why,
			 name, f->nfds);
	dlpd_peer_fail(p, LOG_WARNING, "refused: %s", why);
	return true;
}

/* Run one complete frame through the table. */
static void dispatch(struct dlpd_peer *p, struct dlpc__frame *f)
{
	uint16_t type = f->hdr.type;
	const struct request *rq = type < DLPC_MSG__REQUEST_COUNT ? &requests[type] : NULL;
	ProtobufCMessage *m;
	char name[32];
	int r;

	dlpc__msg_name(type, name, sizeof(name));
	if (!rq || !rq->fn) {
		violation(p, f->hdr.id, "unknown message %s", name);
		return;
	}
	if (p->watching && !rq->while_watching) {
		violation(p, f->hdr.id, "%s on a watching connection", name);
		return;
	}
	if (p->state == DLPD_CONN_GREETING && !rq->before_hello) {
		violation(p, f->hdr.id, "%s before HELLO", name);
		return;
	}
	if (f->nfds < rq->min_fds || f->nfds > rq->max_fds) {
		violation(p, f->hdr.id, "%s carries %u fds, expected %s%u", name, f->nfds,
			  rq->min_fds == rq->max_fds ? ""
			  : f->nfds > rq->max_fds    ? "at most "
						     : "at least ",
			  f->nfds > rq->max_fds ? rq->max_fds : rq->min_fds);
		return;
	}
	if (f->hdr.len > rq->max_len) {
		violation(p, f->hdr.id, "%s of %u bytes exceeds its limit of %u", name, f->hdr.len,
			  rq->max_len);
		return;
	}
	if (closing_over_share(p, f, name))
		return;
	m = protobuf_c_message_unpack(rq->desc, NULL, f->hdr.len, f->payload);
	if (!m) {
		violation(p, f->hdr.id, "malformed %s payload", name);
		return;
	}
	p->srv->stats.req[type]++;
	r = rq->fn(p, f->hdr.id, &m, f);
	if (m)
		protobuf_c_message_free_unpacked(m, NULL);
	if (r == -EPROTO) {
		p->srv->stats.protocol_errors++;
		dlpd_peer_fail(p, LOG_WARNING, "protocol violation in %s request %u", name,
			       f->hdr.id);
	}
}

/* @p p's unfinished frame would take its uid past --max-pending-bytes-per-uid. It cannot be
 * refused on its own (its bytes keep coming): the connection goes, told why if it reads. */
static void rx_over(struct dlpd_peer *p)
{
	char why[320];
	uint32_t id;

	dlpd_mem_rx_why(p, &id, why, sizeof(why));
	dlpd_reply_error(p, id, EDQUOT, "%s; connection dropped", why);
	dlpd_peer_fail(p, LOG_WARNING, "%s; dropped", why);
}

/*
 * The fds @p p sent with frames not yet complete count against its uid's share and the
 * daemon's budget (mem.c) for as long as the frame takes (--frame-timeout-ms at most). Past its
 * share, or past the budget and the half of DLPC_FD_RESERVE that connections may use too
 * (server.c), the connection goes, told why if it reads: nothing else would bound them across
 * connections. Before HELLO, which carries none, any such fd is a violation.
 */
static void rx_fds_check(struct dlpd_peer *p)
{
	const struct dlpd_server *s = p->srv;
	uint64_t share, held;
	char why[320];

	if (p->rx_fds == 0)
		return;
	share = dlpd_uid_fd_share(s);
	held = dlpd_uid_fds(p->usage);
	if (p->state == DLPD_CONN_GREETING) {
		violation(p, 0, "%u fds sent before HELLO, which carries none", p->rx_fds);
		return;
	}
	if (share < s->fd_budget && held > share) {
		dlpd_uid_fd_share_why(p, held, why, sizeof(why));
	} else if (s->fd_budget != UINT64_MAX &&
		   dlpd_fds_in_use(s) > s->fd_budget + DLPC_FD_RESERVE / 2) {
		snprintf(why, sizeof(why),
			 "dlpackd holds %llu fds, the most its fd limit allows (RLIMIT_NOFILE)",
			 (unsigned long long)dlpd_fds_in_use(s));
	} else {
		return;
	}
	dlpd_reply_error(
		p, 0, EDQUOT,
		"%s; the %u fds of an unfinished frame are refused and the connection dropped", why,
		p->rx_fds);
	dlpd_peer_fail(p, LOG_WARNING, "%s; %u fds of an unfinished frame: dropped", why,
		       p->rx_fds);
}

/*
 * Dispatch the complete frames buffered for @p p, but none while replies wait in its output
 * queue: a client that does not read is not served, and what it sent stays in the socket (and
 * in the receive buffer) until it does. on_poll() calls this again once the queue drains.
 */
static void process_frames(struct dlpd_peer *p)
{
	char why[160];

	while (!dlpd_peer_marked(p) && !p->tx.head) {
		struct dlpc__frame f;
		int r = dlpc__rx_next(&p->rx, &f, why, sizeof(why));

		if (r == 0)
			break;
		if (r < 0) {
			violation(p, 0, "%s", why);
			break;
		}
		p->frames_done++;
		/* its fds are the frame's now, not the unfinished frames' (the request's own
		 * checks count what its uid holds) */
		dlpd_mem_rx_account(p);
		dispatch(p, &f);
		dlpc__frame_clear(&f);
	}
	/* a buffer that holds no part of a frame is freed, so that an idle connection holds none
	 * (mem.c charges it to the uid while it exists) */
	dlpc__rx_release(&p->rx);
	dlpd_mem_rx_account(p);
	if (!dlpd_peer_marked(p) && dlpd_mem_rx_over(p))
		rx_over(p);
	if (!dlpd_peer_marked(p))
		rx_fds_check(p);
	if (dlpd_peer_marked(p) || p->tx.head)
		return;
	/* every request it sent before hanging up is answered: now it is gone */
	if (p->hup) {
		if (dlpc__rx_partial(&p->rx))
			dlpd_peer_fail(p, LOG_WARNING,
				       "closed the connection in the middle of a frame");
		else
			dlpd_peer_fail(p, LOG_DEBUG, "disconnected");
		return;
	}
	deadline_arm(p);
}

static void on_readable(struct dlpd_peer *p)
{
	char why[160];
	ssize_t n;

	dlpd_mem_rx_limit(p);
	n = dlpc__rx_read(&p->rx, p->fd, why, sizeof(why));
	dlpd_mem_rx_account(p);
	if (n == -EAGAIN)
		return;
	if (n == -EDQUOT) {
		rx_over(p);
		return;
	}
	if (n == -EPROTO) {
		violation(p, 0, "%s", why);
		return;
	}
	if (n < 0) {
		p->broken = true;
		dlpd_peer_fail(p, LOG_DEBUG, "read failed: %s", strerror((int)-n));
		return;
	}
	if (n == 0) {
		/* It shut down its sending side (or closed): what it sent before is still
		 * served, and its replies go out while the socket takes them. */
		p->hup = true;
		dlpd_peer_update_events(p);
	}
	process_frames(p);
}

static void peer_io(struct dlpd_peer *p, int status, int events)
{
	if (p->state == DLPD_CONN_LINGERING) {
		if (status < 0 || dlpd_peer_flush(p) != 0)
			close_handles(p);
		return;
	}
	if (dlpd_peer_marked(p))
		return;
	if (status < 0) {
		p->broken = true;
		dlpd_peer_fail(p, LOG_DEBUG, "poll failed: %s", uv_strerror(status));
		return;
	}
	if (events & UV_WRITABLE) {
		if (dlpd_peer_flush(p) == 1)
			process_frames(p);
		return;
	}
	if (events & (UV_READABLE | UV_DISCONNECT))
		on_readable(p);
}

static void on_poll(uv_poll_t *h, int status, int events)
{
	struct dlpd_peer *p = h->data;
	struct dlpd_server *s = p->srv;
	/* what it sent and is refused is closed in its uid's closer, charged to it */
	uid_t was = dlpd_closer_charge(p->uid);

	peer_io(p, status, events);
	dlpd_closer_charge(was);
	/* nothing of this event is on the stack any more: what it marked goes now, before the
	 * next event of the same wait is handled */
	teardown(&s->teardown);
}

struct dlpd_peer *dlpd_peer_new(struct dlpd_server *s, int fd)
{
	struct dlpd_peer *p = calloc(1, sizeof(*p));
	struct ucred cred;
	socklen_t clen = sizeof(cred);

	if (!p)
		return NULL;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) < 0) {
		free(p);
		return NULL;
	}
	p->srv = s;
	p->fd = fd;
	p->uid = cred.uid;
	p->gid = cred.gid;
	p->pid = cred.pid;
	p->serial = ++s->next_serial;
	p->usage = dlpd_usage_get(&s->reg, cred.uid);
	if (!p->usage || uv_poll_init(s->loop, &p->poll, fd) < 0) {
		dlpd_usage_put(&s->reg, p->usage);
		free(p);
		return NULL;
	}
	p->usage->connections++;
	p->usage->memory += DLPD_CONNECTION_COST;
	dlpc__rx_init(&p->rx);
	dlpc__tx_init(&p->tx);
	dlpd_holdings_init(&p->held);
	p->held.usage = p->usage;
	dlpd_list_init(&p->reclaim_link);
	dlpd_list_init(&p->watch_link);
	dlpd_list_init(&p->fail_link);
	p->poll.data = p;
	dlpd_peer_unread_init(p);
	dlpd_peer_update_events(p);
	/* HELLO is due within the frame deadline, like any frame begun */
	uv_timer_init(s->loop, &p->deadline);
	p->deadline.data = p;
	p->partial_since = uv_now(s->loop);
	uv_timer_start(&p->deadline, deadline_check, s->lim.frame_timeout_ms, 0);
	p->handles_open = 3;
	dlpd_list_add_tail(&s->peers, &p->link);
	s->npeers++;
	return p;
}

void dlpd_dispatch_init(struct dlpd_server *s)
{
	dlpd_list_init(&s->failed);
	dlpd_list_init(&s->lingering);
	s->peer_io = on_poll;
	dlpd_peer_drains_init(s);
	uv_prepare_init(s->loop, &s->teardown);
	s->teardown.data = s;
	uv_prepare_start(&s->teardown, teardown);
	/* an idle daemon has nothing to tear down: this handle alone keeps no loop running */
	uv_unref((uv_handle_t *)&s->teardown);
}

void dlpd_dispatch_stop(struct dlpd_server *s)
{
	for (struct dlpd_list *l = s->peers.next; l != &s->peers; l = l->next)
		dlpd_peer_fail(dlpd_container_of(l, struct dlpd_peer, link), LOG_DEBUG,
			       "daemon stopping");
	teardown(&s->teardown);
	while (!dlpd_list_empty(&s->lingering))
		close_handles(dlpd_container_of(s->lingering.next, struct dlpd_peer, fail_link));
	dlpd_peer_drains_stop(s);
	uv_close((uv_handle_t *)&s->teardown, NULL);
}
