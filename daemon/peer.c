/* SPDX-License-Identifier: Apache-2.0 */
/*
 * One connection: reading frames, the dispatch table, writing replies, teardown.
 *
 * A peer dies in two steps. dlpd_peer_kill() marks it dead, stops reading and drops everything
 * it holds in the registry at once (so STAT reflects a crashed client immediately); the struct and
 * its socket are freed in one place, the uv_close() callback.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dlpackd.h"

/* Layer 3: what each frame type needs before its handler runs. */
struct handler {
	int (*fn)(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
	const ProtobufCMessageDescriptor *desc;
	uint8_t min_fds, max_fds;
	uint32_t max_len; /* largest payload this type may have: checked before unpacking */
};

static const struct handler handlers[DLPC_MSG__REQUEST_COUNT] = {
	[DLPC_MSG_HELLO] = {dlpd_on_hello, &dlpackd__v1__hello__descriptor, 0, 0,
			    DLPC_SMALL_MSG_MAX},
	/* no fd for legacy CUDA IPC, one otherwise: the handler checks which */
	[DLPC_MSG_PUBLISH] = {dlpd_on_publish, &dlpackd__v1__publish__descriptor, 0, 1,
			      DLPC_FRAME_MAX},
	[DLPC_MSG_ATTACH] = {dlpd_on_attach, &dlpackd__v1__attach__descriptor, 0, 0,
			     DLPC_SMALL_MSG_MAX},
	[DLPC_MSG_RELEASE] = {dlpd_on_release, &dlpackd__v1__release__descriptor, 0, 0,
			      DLPC_RELEASE_MSG_MAX},
	[DLPC_MSG_UNPUBLISH] = {dlpd_on_unpublish, &dlpackd__v1__unpublish__descriptor, 0, 0,
				DLPC_SMALL_MSG_MAX},
	[DLPC_MSG_LIST] = {dlpd_on_list, &dlpackd__v1__list__descriptor, 0, 0, DLPC_SMALL_MSG_MAX},
	[DLPC_MSG_STAT] = {dlpd_on_stat, &dlpackd__v1__stat__descriptor, 0, 0, DLPC_SMALL_MSG_MAX},
	[DLPC_MSG_WATCH] = {dlpd_on_watch, &dlpackd__v1__watch__descriptor, 0, 0,
			    DLPC_SMALL_MSG_MAX},
};

static void on_poll(uv_poll_t *h, int status, int events);
static void deadline_check(uv_timer_t *t);

const char *dlpd_peer_desc(const struct dlpd_peer *p, char *buf, size_t len)
{
	snprintf(buf, len, "client %llu (pid %d, uid %u)", (unsigned long long)p->serial,
		 (int)p->pid, (unsigned)p->uid);
	return buf;
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
	dlpc__rx_init(&p->rx);
	dlpc__tx_init(&p->tx);
	dlpd_hmap_init(&p->refs);
	dlpd_list_init(&p->ephemeral);
	dlpd_list_init(&p->ipc_storages);
	dlpd_list_init(&p->reclaim_link);
	dlpd_list_init(&p->waiters);
	dlpd_list_init(&p->watch_link);
	p->poll.data = p;
	p->events = UV_READABLE | UV_DISCONNECT;
	uv_poll_start(&p->poll, p->events, on_poll);
	/* HELLO is due within the frame deadline, like any frame begun */
	uv_timer_init(s->loop, &p->deadline);
	p->deadline.data = p;
	p->partial_since = uv_now(s->loop);
	uv_timer_start(&p->deadline, deadline_check, s->lim.frame_timeout_ms, 0);
	p->handles_open = 2;
	dlpd_list_add_tail(&s->peers, &p->link);
	s->npeers++;
	return p;
}

static void peer_closed(uv_handle_t *h)
{
	struct dlpd_peer *p = h->data;

	if (--p->handles_open > 0)
		return;
	p->srv->peers_closing--;
	dlpd_close_later(p->fd);
	free(p);
}

void dlpd_peer_kill(struct dlpd_peer *p, int prio, const char *fmt, ...)
{
	char msg[512], desc[96];
	va_list ap;

	if (p->dead)
		return;
	p->dead = true;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	dlpd_log(prio, "%s: %s", dlpd_peer_desc(p, desc, sizeof(desc)), msg);
	dlpd_list_del(&p->link);
	dlpd_watch_drop(p);
	/* before its entries go: their storages must not queue notices for a dead connection */
	dlpd_reclaim_drop_peer(p);
	p->srv->npeers--;
	p->srv->peers_closing++;
	dlpd_registry_drop_peer(p->srv, p);
	p->usage->connections--;
	dlpd_usage_put(&p->srv->reg, p->usage);
	p->usage = NULL;
	dlpc__rx_clear(&p->rx);
	dlpc__tx_clear(&p->tx);
	uv_close((uv_handle_t *)&p->poll, peer_closed);
	uv_close((uv_handle_t *)&p->deadline, peer_closed);
}

/* The frame deadline passed, or a new frame began since it was set: drop the peer, or wait for
 * what is left of the new frame's time. */
static void deadline_check(uv_timer_t *t)
{
	struct dlpd_peer *p = t->data;
	uint64_t limit = p->srv->lim.frame_timeout_ms;
	uint64_t waited;

	/* held back (below) is not stalled: the clock restarts when reading does */
	if (p->dead || p->tx.head || (p->hello && !dlpc__rx_partial(&p->rx)))
		return;
	waited = uv_now(p->srv->loop) - p->partial_since;
	if (waited < limit) {
		uv_timer_start(&p->deadline, deadline_check, limit - waited, 0);
		return;
	}
	if (!p->hello)
		dlpd_peer_kill(
			p, LOG_WARNING,
			"no complete HELLO within %llu ms of connecting (--frame-timeout-ms); "
			"dropped",
			(unsigned long long)limit);
	else
		dlpd_peer_kill(
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

static void want_events(struct dlpd_peer *p, int events)
{
	if (p->dead || p->events == events)
		return;
	p->events = events;
	uv_poll_start(&p->poll, events, on_poll);
}

int dlpd_reply(struct dlpd_peer *p, uint16_t type, uint32_t id, const ProtobufCMessage *m,
	       const int *fds, unsigned nfds)
{
	return dlpd_reply_tail(p, type, id, m, NULL, 0, fds, nfds);
}

int dlpd_peer_send(struct dlpd_peer *p, const uint8_t *frame, size_t len, const int *fds,
		   unsigned nfds)
{
	const struct dlpd_limits *lim = &p->srv->lim;
	uint64_t max = p->watching ? lim->watch_queue_bytes : lim->queue_bytes;
	const char *limit = p->watching ? "--max-watch-queue-bytes, default DLPC_WATCH_QUEUE_MAX"
					: "--max-queue-bytes, default DLPC_TX_QUEUE_MAX";
	int r;

	if (p->dead)
		return -EPIPE;
	r = dlpc__tx_send(&p->tx, p->fd, frame, len, fds, nfds);
	if (r < 0) {
		dlpd_peer_kill(p, LOG_DEBUG, "write failed: %s", strerror(-r));
		return r;
	}
	if (!p->tx.head)
		return 0;
	/* A client that does not read what it asked for (or, watching, cannot keep up) would
	 * otherwise grow this queue without bound. */
	if (p->tx.bytes > max || p->tx.nfds > lim->queue_fds) {
		p->srv->stats.queue_drops++;
		if (p->tx.bytes > max)
			dlpd_peer_kill(
				p, LOG_WARNING,
				"dropped: it stopped reading and %zu bytes wait for it, over "
				"the limit of %llu (%s)",
				p->tx.bytes, (unsigned long long)max, limit);
		else
			dlpd_peer_kill(
				p, LOG_WARNING,
				"dropped: it stopped reading and %u fds wait for it, over the "
				"limit of %llu (--max-queue-fds, default DLPC_TX_QUEUE_FDS_MAX)",
				p->tx.nfds, (unsigned long long)lim->queue_fds);
		return -ENOBUFS;
	}
	/* Backpressure: no more requests from it until it has read what waits (see
	 * process_frames), so the queue holds the replies of one read at most, and the fds they
	 * carry stay few. */
	want_events(p, UV_WRITABLE | UV_DISCONNECT);
	return 0;
}

int dlpd_reply_tail(struct dlpd_peer *p, uint16_t type, uint32_t id, const ProtobufCMessage *m,
		    const uint8_t *tail, size_t tail_len, const int *fds, unsigned nfds)
{
	struct dlpc__scratch *out = &p->srv->out;
	ssize_t len;

	if (p->dead)
		return -EPIPE;
	len = dlpc__msg_frame_tail(out, type, id, m, tail, tail_len, nfds);
	if (len < 0) {
		dlpd_peer_kill(p, LOG_ERR, "cannot build a reply: %s", strerror((int)-len));
		return (int)len;
	}
	return dlpd_peer_send(p, out->p, (size_t)len, fds, nfds);
}

/*
 * How loudly to log a refused request. Answers a client is built to expect (no such name, name
 * taken, wait expired) are routine; a protocol violation is logged by the disconnect that
 * follows; everything else (not allowed, invalid, unsupported, bad storage, out of memory) is a
 * rejection an operator may want to see.
 */
static int refusal_prio(uint32_t code)
{
	switch (code) {
	case ENOENT:
	case EEXIST:
	case ETIMEDOUT:
	case EPROTO:
		return LOG_DEBUG;
	default:
		return LOG_WARNING;
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

/* Run one complete frame through the table. -EPROTO: a protocol violation. */
static int dispatch(struct dlpd_peer *p, struct dlpc__frame *f)
{
	uint16_t type = f->hdr.type;
	const struct handler *h = type < DLPC_MSG__REQUEST_COUNT ? &handlers[type] : NULL;
	ProtobufCMessage *m;
	char name[32];
	int r;

	if (!h || !h->fn) {
		dlpd_reply_error(p, f->hdr.id, EPROTO, "unknown message %s",
				 dlpc__msg_name(type, name, sizeof(name)));
		dlpd_peer_kill(p, LOG_WARNING, "protocol violation: unknown message %s", name);
		return -EPROTO;
	}
	if (p->watching && type != DLPC_MSG_RELEASE) {
		dlpd_reply_error(p, f->hdr.id, EPROTO, "%s on a watching connection",
				 dlpc__msg_name(type, name, sizeof(name)));
		dlpd_peer_kill(p, LOG_WARNING, "protocol violation: %s after WATCH", name);
		return -EPROTO;
	}
	if (!p->hello && type != DLPC_MSG_HELLO) {
		dlpd_reply_error(p, f->hdr.id, EPROTO, "%s before HELLO",
				 dlpc__msg_name(type, name, sizeof(name)));
		dlpd_peer_kill(p, LOG_WARNING, "protocol violation: %s before HELLO", name);
		return -EPROTO;
	}
	if (f->nfds < h->min_fds || f->nfds > h->max_fds) {
		dlpd_reply_error(p, f->hdr.id, EPROTO, "%s carries %u fds, expected %s%u",
				 dlpc__msg_name(type, name, sizeof(name)), f->nfds,
				 h->min_fds == h->max_fds ? ""
				 : f->nfds > h->max_fds	  ? "at most "
							  : "at least ",
				 f->nfds > h->max_fds ? h->max_fds : h->min_fds);
		dlpd_peer_kill(p, LOG_WARNING, "protocol violation: %s with %u fds", name, f->nfds);
		return -EPROTO;
	}
	if (f->hdr.len > h->max_len) {
		dlpd_reply_error(p, f->hdr.id, EPROTO, "%s of %u bytes exceeds its limit of %u",
				 dlpc__msg_name(type, name, sizeof(name)), f->hdr.len, h->max_len);
		dlpd_peer_kill(p, LOG_WARNING, "protocol violation: %s of %u bytes", name,
			       f->hdr.len);
		return -EPROTO;
	}
	m = protobuf_c_message_unpack(h->desc, NULL, f->hdr.len, f->payload);
	if (!m) {
		dlpd_reply_error(p, f->hdr.id, EPROTO, "malformed %s payload",
				 dlpc__msg_name(type, name, sizeof(name)));
		dlpd_peer_kill(p, LOG_WARNING, "protocol violation: malformed %s payload", name);
		return -EPROTO;
	}
	p->srv->stats.req[type]++;
	r = h->fn(p, f->hdr.id, &m, f);
	if (m)
		protobuf_c_message_free_unpacked(m, NULL);
	return r;
}

static void process_frames(struct dlpd_peer *p);

static void on_readable(struct dlpd_peer *p)
{
	char why[160];
	ssize_t n;

	n = dlpc__rx_read(&p->rx, p->fd, why, sizeof(why));
	if (n == -EAGAIN)
		return;
	if (n == 0) {
		if (dlpc__rx_partial(&p->rx))
			dlpd_peer_kill(p, LOG_WARNING,
				       "closed the connection in the middle of a frame");
		else
			dlpd_peer_kill(p, LOG_DEBUG, "disconnected");
		return;
	}
	if (n == -EPROTO) {
		p->srv->stats.protocol_errors++;
		dlpd_reply_error(p, 0, EPROTO, "protocol violation: %s", why);
		dlpd_peer_kill(p, LOG_WARNING, "protocol violation: %s", why);
		return;
	}
	if (n < 0) {
		dlpd_peer_kill(p, LOG_DEBUG, "read failed: %s", strerror((int)-n));
		return;
	}
	process_frames(p);
}

/*
 * Dispatch the complete frames buffered for @p p, but none while replies wait in its output
 * queue: a client that does not read is not served, and what it sent stays in the socket (and
 * in the receive buffer) until it does. on_poll() calls this again once the queue drains.
 */
static void process_frames(struct dlpd_peer *p)
{
	char why[160];

	while (!p->dead && !p->tx.head) {
		struct dlpc__frame f;
		int r = dlpc__rx_next(&p->rx, &f, why, sizeof(why));

		if (r == 0)
			break;
		if (r < 0) {
			p->srv->stats.protocol_errors++;
			dlpd_reply_error(p, 0, EPROTO, "protocol violation: %s", why);
			dlpd_peer_kill(p, LOG_WARNING, "protocol violation: %s", why);
			break;
		}
		p->frames_done++;
		r = dispatch(p, &f);
		dlpc__frame_clear(&f);
		/* other failures (a reply that could not be written) already killed the peer */
		if (r == -EPROTO) {
			p->srv->stats.protocol_errors++;
			dlpd_peer_kill(p, LOG_WARNING, "protocol violation in request %u",
				       f.hdr.id);
		}
	}
	if (!p->dead && !p->tx.head)
		deadline_arm(p);
}

static void on_poll(uv_poll_t *h, int status, int events)
{
	struct dlpd_peer *p = h->data;

	if (p->dead)
		return;
	if (status < 0) {
		dlpd_peer_kill(p, LOG_DEBUG, "poll failed: %s", uv_strerror(status));
		return;
	}
	if (events & UV_WRITABLE) {
		int r = dlpc__tx_flush(&p->tx, p->fd);

		if (r < 0) {
			dlpd_peer_kill(p, LOG_DEBUG, "write failed: %s", strerror(-r));
			return;
		}
		if (r == 1) {
			want_events(p, UV_READABLE | UV_DISCONNECT);
			process_frames(p);
		}
	}
	if (events & (UV_READABLE | UV_DISCONNECT))
		on_readable(p);
}
