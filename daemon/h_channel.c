/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Handlers for channels (protocol 1.6) that carry messages: SEND and RECV check the request
 * and build the message here; the hand-offs between senders and receivers are handoff.c's
 * (CHANNEL, and the channels of a LIST, are in h_channel_admin.c).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "entry.h"
#include "handlers.h"
#include "handoff.h"
#include "peer.h"
#include "quota.h"
#include "storage.h"
#include "util.h"

/* SEND or RECV of a direct channel: its messages never pass through the daemon. */
static int direct_refused(struct dlpd_peer *p, uint32_t id, const char *verb, const char *name)
{
	return dlpd_reply_error(
		p, id, EPROTOTYPE,
		"cannot %s channel '%s' through dlpackd: it is direct, its messages "
		"go between the processes that join it (CHANNEL JOIN)",
		verb, name);
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
		dlpd_fd_budget_why(s, why, whylen);
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
	m->keyed = pub->n_tensors == 1 && pub->tensors[0]->key.len;
	m->uid = p->uid;
	m->pid = p->pid;
	m->memory = dlpd_record_cost(f->hdr.len, pub->n_tensors);
	m->st->usage->memory += m->memory;
	s->reg.messages++;
	return m;
}

int dlpd_on_send(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **msg, struct dlpc__frame *f)
{
	Dlpackd__V1__Send *req = (Dlpackd__V1__Send *)*msg;
	struct dlpd_server *s = p->srv;
	char why[256], name[DLPC_NAME_TEXT];
	struct dlpd_channel *ch;
	struct dlpd_msg *m;
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
		r = dlpd_handoff_park(p, id, ch, m, 0, req->timeout_ms, why, sizeof(why));
		if (r == 0)
			return 0;
		dlpd_msg_free(s, m);
		return dlpd_reply_error(p, id, r, "cannot wait for room in channel '%s': %s", name,
					why);
	}
	dlpd_handoff_send(p, id, ch, m);
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
	if (ch->depth > 0)
		return dlpd_handoff_recv(p, id, ch, req->flags);
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
	r = dlpd_handoff_park(p, id, ch, NULL, req->flags, req->timeout_ms, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot wait for a message in channel '%s': %s",
					name, why);
	return 0;
}
