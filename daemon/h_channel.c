/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Handlers for channels (protocol 1.6): SEND and RECV, and the hand-offs between them (CHANNEL,
 * and the channels of a LIST, are in h_channel_admin.c).
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

#include "channel.h"
#include "direct.h"
#include "entry.h"
#include "handlers.h"
#include "mem.h"
#include "names.h"
#include "peer.h"
#include "quota.h"
#include "reclaim.h"
#include "storage.h"
#include "util.h"

static void channel_name(const struct dlpd_channel *ch, char *buf, size_t len)
{
	dlpc__printable(ch->name, ch->len, buf, len);
}

/* Free @p m, never received: its storage loses the queue's hold. */
static void msg_free(struct dlpd_server *s, struct dlpd_msg *m)
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

	if (p->failed)
		return -EPIPE;
	channel_name(ch, name, sizeof(name));
	if ((flags & DLPC_WIRE_ATTACH_SINGLE) && m->ntensors != 1)
		return dlpd_reply_error(p, id, EINVAL,
					"the next message in channel '%s' is a bundle of %u "
					"tensors; receive it as a bundle",
					name, m->ntensors);
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

/* SEND or RECV of a direct channel: its messages never pass through the daemon. */
static int direct_refused(struct dlpd_peer *p, uint32_t id, const char *verb, const char *name)
{
	return dlpd_reply_error(
		p, id, EPROTOTYPE,
		"cannot %s channel '%s' through dlpackd: it is direct, its messages "
		"go between the processes that join it (CHANNEL JOIN)",
		verb, name);
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
			if (p->failed)
				msg_free(s, m);
			else
				admit(p, id, ch, m);
			continue;
		}
		return;
	}
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
		msg_free(s, m);
		dlpd_reply_error(p, id, ETIMEDOUT,
				 "channel '%s' had no room within %lld ms (%u messages queued, its "
				 "capacity)",
				 name, ms, ch->capacity);
	} else {
		dlpd_reply_error(p, id, ETIMEDOUT, "no message came in channel '%s' within %lld ms",
				 name, ms);
	}
}

/* Make @p p's request @p id wait on @p ch (@p m: a SEND's message) for @p timeout_ms (< 0:
 * without end), charged to its uid with what it holds (mem.c). 0, or -EDQUOT or -ENOMEM and
 * why. */
static int park(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch, struct dlpd_msg *m,
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

/* May @p p wait once more? 0, or -EDQUOT with the reason in @p why. */
static int may_wait(const struct dlpd_peer *p, char *why, size_t whylen)
{
	uint64_t n = p->held.nwaiters + p->held.nchan_waits;

	if (n < p->srv->lim.pending_per_connection)
		return 0;
	snprintf(why, whylen,
		 "this connection has %llu requests waiting; the limit is %llu "
		 "(--max-pending-per-connection)",
		 (unsigned long long)n, (unsigned long long)p->srv->lim.pending_per_connection);
	return -EDQUOT;
}

/* May @p p queue a message of @p size bytes (one storage fd)? 0 or -EDQUOT and why. */
static int quota_message(const struct dlpd_peer *p, uint64_t size, char *why, size_t whylen)
{
	const struct dlpd_server *s = p->srv;
	const struct dlpd_usage *u = p->usage;
	uint64_t bytes = u->bytes + u->pinned_bytes, limit = s->lim.bytes_per_uid;
	uint64_t uid_fds = dlpd_uid_fds(u);

	if (size > limit || bytes > limit - size) {
		snprintf(why, whylen,
			 "uid %u holds %llu bytes and asks for %llu more; the limit is %llu bytes "
			 "(--max-bytes-per-uid)",
			 (unsigned)p->uid, (unsigned long long)bytes, (unsigned long long)size,
			 (unsigned long long)limit);
		return -EDQUOT;
	}
	if (dlpd_fds_in_use(s) + 1 > s->fd_budget) {
		snprintf(why, whylen,
			 "dlpackd holds %llu storage and connection fds; its fd limit leaves room "
			 "for %llu (RLIMIT_NOFILE minus %d in reserve)",
			 (unsigned long long)dlpd_fds_in_use(s), (unsigned long long)s->fd_budget,
			 DLPC_FD_RESERVE);
		return -EDQUOT;
	}
	if (uid_fds + 1 > dlpd_uid_fd_share(s)) {
		dlpd_uid_fd_share_why(p, uid_fds, why, whylen);
		return -EDQUOT;
	}
	return 0;
}

/* Is @p pub a message a channel can carry (@p pooled: a recycled buffer's)? 0, or negative
 * errno and why. */
static int check_message(const Dlpackd__V1__Publish *pub, int fd, bool pooled, char *why,
			 size_t whylen)
{
	int r;

	if (pub->name.len != 0 || (pub->flags & ~DLPC_PUBLISH_WRITABLE)) {
		snprintf(why, whylen, "a message has no name and no flags but WRITABLE");
		return -EINVAL;
	}
	if (pub->device_type != kDLCPU || pub->device_id != 0 || pub->device_uuid.len ||
	    pub->cuda_ipc || pub->reclaim_token) {
		snprintf(why, whylen, "channels carry host memory only (device %d:%d)",
			 pub->device_type, pub->device_id);
		return -ENOTSUP;
	}
	if (pub->storage_size == 0 || pub->storage_size > INT64_MAX) {
		snprintf(why, whylen, "bad storage size %llu",
			 (unsigned long long)pub->storage_size);
		return -EINVAL;
	}
	r = dlpd_entry_check_tensors(pub, why, whylen);
	if (r < 0)
		return r;
	if (pooled)
		return dlpc__storage_check(fd, pub->storage_size, DLPC__STORAGE_POOLED, why,
					   whylen);
	return dlpd_entry_check_storage(pub, fd, why, whylen);
}

/* A message of @p p's from the checked @p pub and the frame's fd (taken); NULL on ENOMEM. */
static struct dlpd_msg *msg_new(struct dlpd_peer *p, Dlpackd__V1__Publish *pub,
				struct dlpc__frame *f)
{
	struct dlpd_server *s = p->srv;
	struct dlpd_msg *m = calloc(1, sizeof(*m));

	if (!m)
		return NULL;
	dlpd_entry_drop_unknown_fields(pub);
	m->tensors_wire = dlpd_entry_encode_tensors(pub, &m->tensors_wire_len);
	m->st = m->tensors_wire ? dlpd_storage_new(&s->reg, p->usage, f->fds[0], pub->storage_size,
						   kDLCPU, 0)
				: NULL;
	if (!m->st) {
		free(m->tensors_wire);
		free(m);
		return NULL;
	}
	dlpc__frame_take_fd(f, 0);
	m->st->names = 1;
	m->flags = pub->flags;
	m->ntensors = (uint32_t)pub->n_tensors;
	m->uid = p->uid;
	m->pid = p->pid;
	m->memory = dlpd_record_cost(f->hdr.len, pub->n_tensors);
	m->st->usage->memory += m->memory;
	s->reg.messages++;
	return m;
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
			msg_free(s, m);
		dlpd_reply_error(p, id, EPIPE,
				 m ? "cannot send to channel '%s': its stream was closed for every "
				     "producer while the send waited for room"
				   : "channel '%s' has ended: every producer closed it and every "
				     "message was received",
				 name);
	}
	dlpd_direct_end(ch);
}

int dlpd_on_send(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **msg, struct dlpc__frame *f)
{
	Dlpackd__V1__Send *req = (Dlpackd__V1__Send *)*msg;
	struct dlpd_server *s = p->srv;
	char why[256], name[DLPC_NAME_TEXT];
	struct dlpd_channel *ch;
	struct dlpd_msg *m;
	uint64_t seq;
	int r;

	if (dlpc__name_check(req->channel.data, req->channel.len, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EINVAL, "cannot send: channel name: %s", why);
	dlpc__printable(req->channel.data, req->channel.len, name, sizeof(name));
	if (req->flags)
		return dlpd_reply_error(p, id, EINVAL, "cannot send to channel '%s': flags 0x%x",
					name, req->flags);
	if (!req->message)
		return dlpd_reply_error(p, id, EINVAL, "cannot send to channel '%s': no message",
					name);
	if (req->pool_token && !(req->message->flags & DLPC_PUBLISH_WRITABLE))
		return dlpd_reply_error(p, id, EINVAL,
					"cannot send to channel '%s': a pooled message is "
					"writable by its sender; send it WRITABLE",
					name);
	r = check_message(req->message, f->fds[0], req->pool_token != 0, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot send to channel '%s': %s", name, why);
	ch = dlpd_channel_find(&s->reg, req->channel.data, req->channel.len);
	if (!ch)
		return dlpd_reply_error(p, id, ENOENT, "no channel named '%s'; open it first",
					name);
	if (ch->ends[0] >= 0)
		return direct_refused(p, id, "send to", name);
	r = dlpd_channel_produce(p, ch, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot send to channel '%s': %s", name, why);
	r = quota_message(p, req->message->storage_size, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot send to channel '%s': %s", name, why);
	r = dlpd_quota_memory(p, dlpd_record_cost(f->hdr.len, req->message->n_tensors), 0, why,
			      sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot send to channel '%s': %s", name, why);
	if ((ch->nsenders > 0 || ch->depth >= ch->capacity) && req->timeout_ms == 0)
		return dlpd_reply_error(p, id, EAGAIN,
					"channel '%s' is full (%u messages queued, its capacity)",
					name, ch->depth);
	if ((ch->nsenders > 0 || ch->depth >= ch->capacity) && may_wait(p, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EDQUOT, "cannot wait for room in channel '%s': %s",
					name, why);
	m = msg_new(p, req->message, f);
	if (m)
		m->pool_token = req->pool_token;
	if (!m)
		return dlpd_reply_error(p, id, ENOMEM, "cannot send to channel '%s': out of memory",
					name);
	if (ch->nsenders > 0 || ch->depth >= ch->capacity) {
		r = park(p, id, ch, m, 0, req->timeout_ms, why, sizeof(why));
		if (r == 0)
			return 0;
		msg_free(s, m);
		return dlpd_reply_error(p, id, r, "cannot wait for room in channel '%s': %s", name,
					why);
	}
	seq = push(p, ch, m);
	/* A receiver waiting gets it now, in this turn, and before the sender hears back: the
	 * receiver's reply is written first, so on a busy CPU the receiver is not queued behind
	 * the sender's wake-up. */
	pump(s, ch);
	reply_sent(p, id, seq, ch->depth);
	return 0;
}

int dlpd_on_recv(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **msg, struct dlpc__frame *f)
{
	Dlpackd__V1__Recv *req = (Dlpackd__V1__Recv *)*msg;
	struct dlpd_server *s = p->srv;
	char why[256], name[DLPC_NAME_TEXT];
	struct dlpd_channel *ch;
	int r;

	(void)f;
	if (dlpc__name_check(req->channel.data, req->channel.len, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EINVAL, "cannot receive: channel name: %s", why);
	dlpc__printable(req->channel.data, req->channel.len, name, sizeof(name));
	if (req->flags & ~DLPC_WIRE_RECV_FLAGS)
		return dlpd_reply_error(p, id, EINVAL,
					"cannot receive from channel '%s': unknown flags 0x%x",
					name, req->flags & ~DLPC_WIRE_RECV_FLAGS);
	ch = dlpd_channel_find(&s->reg, req->channel.data, req->channel.len);
	if (!ch)
		return dlpd_reply_error(p, id, ENOENT, "no channel named '%s'; open it first",
					name);
	if (ch->ends[0] >= 0)
		return direct_refused(p, id, "receive from", name);
	if (ch->depth > 0) {
		r = give(p, id, ch, req->flags);
		/* room was made: a waiting sender comes in */
		pump(s, ch);
		return r;
	}
	if (ch->ended)
		return dlpd_reply_error(
			p, id, EPIPE,
			"channel '%s' has ended: every producer closed it and every "
			"message was received",
			name);
	if (req->timeout_ms == 0)
		return dlpd_reply_error(p, id, EAGAIN, "channel '%s' is empty", name);
	if (may_wait(p, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EDQUOT,
					"cannot wait for a message in channel '%s': %s", name, why);
	r = park(p, id, ch, NULL, req->flags, req->timeout_ms, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot wait for a message in channel '%s': %s",
					name, why);
	return 0;
}

/* End every wait on @p ch with @p err and free every message it holds; @p ch stays. */
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
			msg_free(s, m);
		dlpd_reply_error(p, id, EIDRM, "channel '%s' was removed", name);
	}
	while ((m = dlpd_channel_pop(&s->reg, ch)))
		msg_free(s, m);
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
			msg_free(p->srv, m);
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
			msg_free(p->srv, m);
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
