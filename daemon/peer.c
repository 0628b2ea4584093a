/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A connection's transport: frames out, the socket events it waits for, and the mark that ends
 * it. Everything here may run in the middle of a request, an event being told to the watchers
 * or a registry change; so when a connection turns out to be broken it is only marked, never
 * destroyed (state.h).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "mem.h"
#include "peer.h"
#include "quota.h"

const char *dlpd_peer_desc(const struct dlpd_peer *p, char *buf, size_t len)
{
	snprintf(buf, len, "client %llu (pid %d, uid %u)", (unsigned long long)p->serial,
		 (int)p->pid, (unsigned)p->uid);
	return buf;
}

void dlpd_peer_update_events(struct dlpd_peer *p)
{
	int events = 0;

	if (p->broken || p->state == DLPD_CONN_MARKED)
		events = 0;
	else if (p->tx.head)
		/* backpressure: nothing is read while replies wait (see dispatch.c) */
		events = UV_WRITABLE;
	else if (!dlpd_peer_marked(p) && !p->hup)
		events = UV_READABLE | UV_DISCONNECT;
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
	int r = dlpc__tx_flush(&p->tx, p->fd);

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
	r = dlpc__tx_send(&p->tx, p->fd, frame, len, fds, nfds);
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
