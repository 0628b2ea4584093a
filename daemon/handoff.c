/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Channels' hand-offs (handoff.h): messages between senders and receivers, the waits of SEND
 * and RECV, producers and the end of a stream, and emptying a channel, as names.c does the
 * same for entries. channel.c holds the data; h_channel.c and h_channel_admin.c check the
 * requests and call here to change anything.
 *
 * A channel never holds a message while a receiver waits, nor keeps a sender waiting while it
 * has room: every change (a send admitted, a message taken, a wait ended) runs pump(), which
 * hands queued messages to the oldest waiting receivers and admits the oldest waiting senders,
 * in the same loop turn. So a receiver blocked in RECV gets a message in the turn its SEND
 * arrives, and a message is handed to exactly one receiver: the RECV reply carries the only
 * reference to its storage there is.
 *
 * Delivery is at most once. A message handed to a receiver is that receiver's: if its
 * connection dies before it read the reply or released the message, the message is freed, never
 * given to another. A SEND whose connection dies while it waits for room is dropped; messages
 * a connection sent before it died stay queued for receivers.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "direct.h"
#include "handoff.h"
#include "mem.h"
#include "names.h"
#include "peer.h"
#include "quota.h"
#include "reclaim.h"
#include "util.h"

static void channel_name(const struct dlpd_channel *ch, char *buf, size_t len)
{
	dlpc__printable(ch->name, ch->len, buf, len);
}

void dlpd_msg_free(struct dlpd_server *s, struct dlpd_msg *m)
{
	s->reg.messages--;
	m->st->usage->memory -= m->memory;
	s->reg.freed += m->memory;
	dlpd_storage_gone(s, dlpd_storage_unname(m->st));
	free(m->tensors_wire);
	free(m);
}

static void wait_closed(uv_handle_t *h)
{
	free(h->data);
}

/* Take @p w off its channel and its connection and free it; its message is the caller's. */
static void wait_free(struct dlpd_chan_wait *w)
{
	dlpd_list_del(&w->ch_link);
	dlpd_list_del(&w->peer_link);
	w->peer->held.nchan_waits--;
	dlpd_mem_uncharge(w->peer->srv, w->peer->usage, w->charged);
	if (w->msg)
		w->ch->nsenders--;
	else
		w->ch->nreceivers--;
	if (w->timeout_ms > 0) {
		w->timer.data = w;
		uv_close((uv_handle_t *)&w->timer, wait_closed);
	} else {
		free(w);
	}
}

/*
 * Answer @p p's RECV @p id with the oldest message of @p ch: a reference of its own on the
 * storage and the storage's fd; the message leaves the channel. Refused (the message stays
 * queued) for a connection being dropped, a bundle asked for as one tensor, or the reference
 * limit. 0 or the reply's negative errno.
 */
static int give(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch, uint32_t flags)
{
	Dlpackd__V1__AttachReply rep = DLPACKD__V1__ATTACH_REPLY__INIT;
	struct dlpd_server *s = p->srv;
	struct dlpd_msg *m = dlpd_container_of(ch->queue.next, struct dlpd_msg, link);
	char name[DLPC_NAME_TEXT], why[256];
	struct dlpd_ref *ref;
	int r;

	if (dlpd_peer_marked(p))
		return -EPIPE;
	channel_name(ch, name, sizeof(name));
	if ((flags & DLPC_WIRE_ATTACH_SINGLE) && (m->ntensors != 1 || m->keyed))
		return dlpd_reply_error(p, id, EINVAL,
					"the next message in channel '%s' is a bundle of %u "
					"tensor%s; receive it as a bundle",
					name, m->ntensors, m->ntensors == 1 ? " under a key" : "s");
	if (p->held.refs.count >= s->lim.refs_per_connection)
		return dlpd_reply_error(
			p, id, EDQUOT,
			"cannot receive from channel '%s': this connection holds %zu references; "
			"the limit is %llu (--max-refs-per-connection)",
			name, p->held.refs.count, (unsigned long long)s->lim.refs_per_connection);
	r = dlpd_quota_memory(p, DLPD_REF_COST, 0, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot receive from channel '%s': %s", name,
					why);
	ref = dlpd_ref_new(&s->reg, &p->held, m->st);
	if (!ref)
		return dlpd_reply_error(p, id, ENOMEM,
					"cannot receive from channel '%s': out of memory", name);
	dlpd_channel_pop(&s->reg, ch);
	ch->received++;
	rep.generation = m->seq;
	rep.ref_id = ref->id;
	rep.flags = m->flags;
	rep.device_type = kDLCPU;
	rep.storage_size = m->st->size;
	rep.owner_uid = (uint32_t)m->uid;
	rep.owner_pid = (int32_t)m->pid;
	r = dlpd_reply_tail(p, DLPC_MSG_RECV | DLPC_MSG_REPLY, id, &rep.base, m->tensors_wire,
			    m->tensors_wire_len, &m->st->fd, 1);
	if (r == 0)
		s->stats.fds_sent++;
	/* the reference holds it now: this cannot free it */
	m->st->usage->memory -= m->memory;
	s->reg.freed += m->memory;
	dlpd_storage_unname(m->st);
	s->reg.messages--;
	free(m->tensors_wire);
	free(m);
	return r;
}

/* Queue @p m, @p p's, on @p ch; its seq. */
static uint64_t push(struct dlpd_peer *p, struct dlpd_channel *ch, struct dlpd_msg *m)
{
	dlpd_channel_push(&p->srv->reg, ch, m);
	/* a pooled message's storage goes back to its sender (RECLAIM) once freed; only once
	 * admitted, so that a refused SEND is never answered with a RECLAIM too */
	if (m->pool_token)
		dlpd_reclaim_watch(p, m->st, m->pool_token);
	return m->seq;
}

/* Answer @p p's SEND @p id: its message was admitted with @p seq. */
static void reply_sent(struct dlpd_peer *p, uint32_t id, uint64_t seq, uint32_t depth)
{
	Dlpackd__V1__SendReply rep = DLPACKD__V1__SEND_REPLY__INIT;

	rep.seq = seq;
	rep.depth = depth;
	dlpd_reply(p, DLPC_MSG_SEND | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
}

/* Queue @p m on @p ch and answer its SEND @p id from @p p. */
static void admit(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch, struct dlpd_msg *m)
{
	uint64_t seq = push(p, ch, m);

	reply_sent(p, id, seq, ch->depth);
}

/* Hand queued messages to waiting receivers and admit waiting senders while either can move.
 * A wait whose connection is being dropped ends without taking anything. */
static void pump(struct dlpd_server *s, struct dlpd_channel *ch)
{
	for (;;) {
		struct dlpd_chan_wait *w;

		if (ch->depth > 0 && ch->nreceivers > 0) {
			struct dlpd_peer *p;
			uint32_t id, flags;

			w = dlpd_container_of(ch->receivers.next, struct dlpd_chan_wait, ch_link);
			p = w->peer;
			id = w->req_id;
			flags = w->flags;
			wait_free(w);
			give(p, id, ch, flags);
			continue;
		}
		if (ch->nsenders > 0 && ch->depth < ch->capacity) {
			struct dlpd_msg *m;
			struct dlpd_peer *p;
			uint32_t id;

			w = dlpd_container_of(ch->senders.next, struct dlpd_chan_wait, ch_link);
			m = w->msg;
			p = w->peer;
			id = w->req_id;
			wait_free(w);
			if (dlpd_peer_marked(p))
				dlpd_msg_free(s, m);
			else
				admit(p, id, ch, m);
			continue;
		}
		return;
	}
}

void dlpd_handoff_send(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch,
		       struct dlpd_msg *m)
{
	uint64_t seq;

	dlpd_assert(ch->depth < ch->capacity && ch->nsenders == 0);
	seq = push(p, ch, m);
	/* A receiver waiting gets it now, in this turn, and before the sender hears back: the
	 * receiver's reply is written first, so on a busy CPU the receiver is not queued behind
	 * the sender's wake-up. */
	pump(p->srv, ch);
	reply_sent(p, id, seq, ch->depth);
}

int dlpd_handoff_recv(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch, uint32_t flags)
{
	int r;

	dlpd_assert(ch->depth > 0);
	r = give(p, id, ch, flags);
	/* room was made: a waiting sender comes in */
	pump(p->srv, ch);
	return r;
}

static void wait_expired(uv_timer_t *t)
{
	struct dlpd_chan_wait *w = t->data;
	struct dlpd_server *s = w->peer->srv;
	struct dlpd_channel *ch = w->ch;
	struct dlpd_peer *p = w->peer;
	struct dlpd_msg *m = w->msg;
	long long ms = (long long)w->timeout_ms;
	uint32_t id = w->req_id;
	char name[DLPC_NAME_TEXT];

	channel_name(ch, name, sizeof(name));
	wait_free(w);
	if (m) {
		dlpd_msg_free(s, m);
		dlpd_reply_error(p, id, ETIMEDOUT,
				 "channel '%s' had no room within %lld ms (%u messages queued, its "
				 "capacity)",
				 name, ms, ch->capacity);
	} else {
		dlpd_reply_error(p, id, ETIMEDOUT, "no message came in channel '%s' within %lld ms",
				 name, ms);
	}
}

int dlpd_handoff_park(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch, struct dlpd_msg *m,
		      uint32_t flags, int64_t timeout_ms, char *why, size_t whylen)
{
	uint64_t cost = DLPD_CHAN_WAIT_COST + (m ? sizeof(*m) + m->tensors_wire_len : 0);
	struct dlpd_chan_wait *w;

	if (dlpd_mem_charge(p, cost, why, whylen) < 0)
		return -EDQUOT;
	w = calloc(1, sizeof(*w));
	if (!w) {
		dlpd_mem_uncharge(p->srv, p->usage, cost);
		snprintf(why, whylen, "out of memory");
		return -ENOMEM;
	}
	w->charged = cost;
	w->ch = ch;
	w->peer = p;
	w->req_id = id;
	w->flags = flags;
	w->msg = m;
	w->timeout_ms = timeout_ms;
	dlpd_list_add_tail(m ? &ch->senders : &ch->receivers, &w->ch_link);
	dlpd_list_add_tail(&p->held.chan_waits, &w->peer_link);
	p->held.nchan_waits++;
	if (m)
		ch->nsenders++;
	else
		ch->nreceivers++;
	if (timeout_ms > 0) {
		uv_timer_init(p->srv->loop, &w->timer);
		w->timer.data = w;
		uv_timer_start(&w->timer, wait_expired, (uint64_t)timeout_ms, 0);
	}
	return 0;
}

/* @p p's producer record of @p ch, or NULL. (A connection produces to few channels.) */
static struct dlpd_producer *producer_find(struct dlpd_peer *p, const struct dlpd_channel *ch)
{
	for (struct dlpd_list *l = p->held.producing.next; l != &p->held.producing; l = l->next) {
		struct dlpd_producer *pr = dlpd_container_of(l, struct dlpd_producer, peer_link);

		if (pr->ch == ch)
			return pr;
	}
	return NULL;
}

/* A new producer record of @p p's on @p ch, open; NULL with why (-EDQUOT or -ENOMEM in *@p r). */
static struct dlpd_producer *producer_new(struct dlpd_peer *p, struct dlpd_channel *ch, int *r,
					  char *why, size_t whylen)
{
	struct dlpd_producer *pr;

	if (p->held.nproducing >= DLPC_PRODUCING_MAX) {
		snprintf(why, whylen,
			 "this connection is a producer of %llu channels; the limit is %d "
			 "(DLPC_PRODUCING_MAX)",
			 (unsigned long long)p->held.nproducing, DLPC_PRODUCING_MAX);
		*r = -EDQUOT;
		return NULL;
	}
	*r = dlpd_quota_memory(p, DLPD_PRODUCER_COST, 0, why, whylen);
	if (*r < 0)
		return NULL;
	pr = calloc(1, sizeof(*pr));
	if (!pr) {
		snprintf(why, whylen, "out of memory");
		*r = -ENOMEM;
		return NULL;
	}
	pr->ch = ch;
	pr->holder = &p->held;
	dlpd_list_add_tail(&ch->producers, &pr->ch_link);
	dlpd_list_add_tail(&p->held.producing, &pr->peer_link);
	p->held.nproducing++;
	p->usage->memory += DLPD_PRODUCER_COST;
	ch->producing++;
	return pr;
}

/* Free @p pr (its connection or its channel goes). */
static void producer_free(struct dlpd_server *s, struct dlpd_producer *pr)
{
	dlpd_list_del(&pr->ch_link);
	dlpd_list_del(&pr->peer_link);
	pr->holder->nproducing--;
	pr->holder->usage->memory -= DLPD_PRODUCER_COST;
	s->reg.freed += DLPD_PRODUCER_COST;
	free(pr);
}

/* @p pr closes: the stream ends once every producer has, and at least as many as expected. */
static void producer_close(struct dlpd_server *s, struct dlpd_producer *pr)
{
	struct dlpd_channel *ch = pr->ch;

	if (pr->closed)
		return;
	pr->closed = true;
	ch->producing--;
	ch->closed++;
	if (!ch->ended && ch->producing == 0 && ch->closed >= (ch->expected ? ch->expected : 1))
		dlpd_channel_end(s, ch);
}

int dlpd_channel_produce(struct dlpd_peer *p, struct dlpd_channel *ch, char *why, size_t whylen)
{
	struct dlpd_producer *pr = producer_find(p, ch);
	int r = 0;

	if (ch->ended) {
		snprintf(why, whylen,
			 "its stream has ended (every producer closed it); remove it and open it "
			 "again for a new stream");
		return -EPIPE;
	}
	if (pr && pr->closed) {
		snprintf(why, whylen, "this connection closed its side of it (channel close)");
		return -EPIPE;
	}
	if (!pr)
		producer_new(p, ch, &r, why, whylen);
	return r;
}

int dlpd_channel_close_producer(struct dlpd_peer *p, struct dlpd_channel *ch, char *why,
				size_t whylen)
{
	struct dlpd_producer *pr = producer_find(p, ch);
	int r = 0;

	/* A connection of another uid that never sent has no part in the stream: its CLOSE
	 * changes nothing. (Counted, it would let any uid end a stream whose producers have not
	 * begun, with no message of its own: what close-all refuses it.) */
	if (!pr && p->uid != 0 && p->uid != ch->uid)
		return 0;
	/* one of the owner's that never sent closes as a producer that had nothing to send */
	if (!pr && !ch->ended)
		pr = producer_new(p, ch, &r, why, whylen);
	if (pr)
		producer_close(p->srv, pr);
	return r;
}

void dlpd_channel_end(struct dlpd_server *s, struct dlpd_channel *ch)
{
	char name[DLPC_NAME_TEXT];

	if (ch->ended)
		return;
	ch->ended = true;
	channel_name(ch, name, sizeof(name));
	dlpd_log(LOG_DEBUG, "channel '%s' ended: %u producers closed, %u messages still queued",
		 name, ch->closed, ch->ends[0] >= 0 ? dlpd_direct_depth(ch) : ch->depth);
	/* receivers wait only on an empty queue: each is told now */
	while (!dlpd_list_empty(&ch->senders) || !dlpd_list_empty(&ch->receivers)) {
		struct dlpd_list *l =
			dlpd_list_empty(&ch->senders) ? ch->receivers.next : ch->senders.next;
		struct dlpd_chan_wait *w = dlpd_container_of(l, struct dlpd_chan_wait, ch_link);
		struct dlpd_peer *p = w->peer;
		struct dlpd_msg *m = w->msg;
		uint32_t id = w->req_id;

		wait_free(w);
		if (m)
			dlpd_msg_free(s, m);
		dlpd_reply_error(p, id, EPIPE,
				 m ? "cannot send to channel '%s': its stream was closed for every "
				     "producer while the send waited for room"
				   : "channel '%s' has ended: every producer closed it and every "
				     "message was received",
				 name);
	}
	dlpd_direct_end(ch);
}

void dlpd_channel_empty(struct dlpd_server *s, struct dlpd_channel *ch, const char *name)
{
	struct dlpd_msg *m;

	while (!dlpd_list_empty(&ch->senders) || !dlpd_list_empty(&ch->receivers)) {
		struct dlpd_list *l =
			dlpd_list_empty(&ch->senders) ? ch->receivers.next : ch->senders.next;
		struct dlpd_chan_wait *w = dlpd_container_of(l, struct dlpd_chan_wait, ch_link);
		struct dlpd_peer *p = w->peer;
		uint32_t id = w->req_id;

		m = w->msg;
		wait_free(w);
		if (m)
			dlpd_msg_free(s, m);
		dlpd_reply_error(p, id, EIDRM, "channel '%s' was removed", name);
	}
	while ((m = dlpd_channel_pop(&s->reg, ch)))
		dlpd_msg_free(s, m);
	while (!dlpd_list_empty(&ch->producers))
		producer_free(s,
			      dlpd_container_of(ch->producers.next, struct dlpd_producer, ch_link));
	dlpd_direct_close(s, ch);
}

void dlpd_channels_drop_peer(struct dlpd_peer *p)
{
	while (!dlpd_list_empty(&p->held.chan_waits)) {
		struct dlpd_chan_wait *w = dlpd_container_of(p->held.chan_waits.next,
							     struct dlpd_chan_wait, peer_link);
		struct dlpd_msg *m = w->msg;

		wait_free(w);
		if (m)
			dlpd_msg_free(p->srv, m);
	}
	/* a producer whose connection ends has closed: its consumers never wait on the dead */
	while (!dlpd_list_empty(&p->held.producing)) {
		struct dlpd_producer *pr =
			dlpd_container_of(p->held.producing.next, struct dlpd_producer, peer_link);

		producer_close(p->srv, pr);
		producer_free(p->srv, pr);
	}
}

bool dlpd_channel_cancel(struct dlpd_peer *p, uint32_t id)
{
	struct dlpd_list *l;

	for (l = p->held.chan_waits.next; l != &p->held.chan_waits; l = l->next) {
		struct dlpd_chan_wait *w = dlpd_container_of(l, struct dlpd_chan_wait, peer_link);
		struct dlpd_msg *m = w->msg;
		char name[DLPC_NAME_TEXT];

		if (w->req_id != id)
			continue;
		channel_name(w->ch, name, sizeof(name));
		wait_free(w);
		if (m)
			dlpd_msg_free(p->srv, m);
		dlpd_reply_error(p, id, ECANCELED,
				 m ? "the send to channel '%s' was canceled by the client"
				   : "the receive from channel '%s' was canceled by the client",
				 name);
		return true;
	}
	return false;
}

void dlpd_channels_clear(struct dlpd_server *s)
{
	struct dlpd_channel *ch;
	size_t cursor = 0;

	while ((ch = dlpd_channel_any(&s->reg, &cursor))) {
		char name[DLPC_NAME_TEXT];

		channel_name(ch, name, sizeof(name));
		dlpd_channel_empty(s, ch, name);
		dlpd_channel_free(&s->reg, ch);
		cursor = 0;
	}
}
