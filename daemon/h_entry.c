/* SPDX-License-Identifier: Apache-2.0 */
/* Handlers that change or read the set of names: PUBLISH, UNPUBLISH, LIST. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "channel.h"
#include "entry.h"
#include "handlers.h"
#include "names.h"
#include "peer.h"
#include "quota.h"
#include "reclaim.h"
#include "table.h"
#include "util.h"

/*
 * Is the device part of @p req sound: host memory with its memfd, or a CUDA device with a UUID
 * and either legacy IPC handles (no fd) or a VMM export fd? 0, or -errno and the reason; -EPROTO
 * for an fd count that contradicts the message (the connection is then dropped). A legacy IPC
 * entry, and a VMM one whose memory is lent (a reclaim token), is always ephemeral: the memory
 * dies with its publisher.
 */
static int check_device(const struct dlpd_peer *p, Dlpackd__V1__Publish *req,
			const struct dlpc__frame *f, char *why, size_t whylen)
{
	const Dlpackd__V1__CudaIpc *ipc = req->cuda_ipc;

	(void)p;
	if (req->device_type == kDLCPU) {
		if (req->device_id != 0 || req->device_uuid.len || ipc) {
			snprintf(why, whylen, "host device %d with CUDA fields", req->device_id);
			return -EINVAL;
		}
		if (f->nfds != 1) {
			snprintf(why, whylen, "host PUBLISH carries %u fds, expected 1", f->nfds);
			return -EPROTO;
		}
		return 0;
	}
	if (req->device_type != kDLCUDA || req->device_id < 0) {
		snprintf(why, whylen, "device %d:%d is not supported", req->device_type,
			 req->device_id);
		return -ENOTSUP;
	}
	if (req->device_uuid.len != DLPC_CUDA_UUID_SIZE) {
		snprintf(why, whylen, "CUDA device UUID of %zu bytes, expected %d",
			 req->device_uuid.len, DLPC_CUDA_UUID_SIZE);
		return -EINVAL;
	}
	if (f->nfds != (ipc ? 0u : 1u)) {
		snprintf(why, whylen, "%s PUBLISH carries %u fds, expected %u",
			 ipc ? "CUDA IPC" : "CUDA VMM", f->nfds, ipc ? 0u : 1u);
		return -EPROTO;
	}
	if (ipc && (ipc->mem_handle.len != DLPC_CUDA_IPC_HANDLE_SIZE ||
		    ipc->event_handle.len != DLPC_CUDA_IPC_HANDLE_SIZE)) {
		snprintf(why, whylen, "CUDA IPC handles of %zu and %zu bytes, expected %d",
			 ipc->mem_handle.len, ipc->event_handle.len, DLPC_CUDA_IPC_HANDLE_SIZE);
		return -EINVAL;
	}
	/* memory the publisher keeps (legacy IPC) or lends (a VMM export fd with a token, 1.5)
	 * lives no longer than its connection, and goes back to it with RECLAIM */
	if (ipc || req->reclaim_token)
		req->flags |= DLPC_PUBLISH_EPHEMERAL;
	return 0;
}

static bool may_change(const struct dlpd_peer *p, const struct dlpd_entry *e)
{
	return p->uid == 0 || p->uid == e->uid;
}

/* Is @p req a publish the daemon can take: its flags, device, storage size, tensors and
 * storage? 0, or negative errno and why; -EPROTO for an fd count that contradicts it. */
static int check_publish(const struct dlpd_peer *p, Dlpackd__V1__Publish *req,
			 const struct dlpc__frame *f, char *why, size_t whylen)
{
	int r;

	if (req->flags & ~DLPC_PUBLISH_FLAGS_ALL) {
		snprintf(why, whylen, "unknown flags 0x%x", req->flags & ~DLPC_PUBLISH_FLAGS_ALL);
		return -EINVAL;
	}
	r = check_device(p, req, f, why, whylen);
	if (r < 0)
		return r;
	if (req->storage_size == 0 || req->storage_size > INT64_MAX) {
		snprintf(why, whylen, "bad storage size %llu",
			 (unsigned long long)req->storage_size);
		return -EINVAL;
	}
	r = dlpd_entry_check_tensors(req, why, whylen);
	if (r < 0)
		return r;
	return dlpd_entry_check_storage(req, f->nfds ? f->fds[0] : -1, why, whylen);
}

/*
 * The entry the checked PUBLISH *@p m makes for @p p, replacing @p old (NULL if none): on a new
 * storage of the frame's fd (taken), charged to @p p's uid, the request taken over (*@p m set
 * to NULL); not visible yet. NULL on ENOMEM, with nothing taken.
 */
static struct dlpd_entry *entry_new(struct dlpd_peer *p, ProtobufCMessage **m,
				    struct dlpc__frame *f, const struct dlpd_entry *old)
{
	Dlpackd__V1__Publish *req = (Dlpackd__V1__Publish *)*m;
	struct dlpd_server *s = p->srv;
	struct dlpd_storage *st;
	struct dlpd_entry *e;
	struct timespec now;
	uint8_t *wire;
	size_t wire_len;

	dlpd_entry_drop_unknown_fields(req);
	wire = dlpd_entry_encode_tensors(req, &wire_len);
	e = wire ? calloc(1, sizeof(*e)) : NULL;
	/* charged to the connection's uid, whose usage record its connection keeps alive */
	st = e ? dlpd_storage_new(&s->reg, p->usage, f->nfds ? f->fds[0] : -1, req->storage_size,
				  req->device_type, req->device_id)
	       : NULL;
	if (!st) {
		free(e);
		free(wire);
		return NULL;
	}
	if (f->nfds)
		dlpc__frame_take_fd(f, 0);
	st->names = 1;
	e->st = st;
	e->pub = req;
	*m = NULL;
	/* what the entry is, not how it was published */
	req->flags &= ~DLPC_PUBLISH_REPLACE;
	clock_gettime(CLOCK_REALTIME, &now);
	e->generation = old && old->generation < INT32_MAX ? old->generation + 1 : 1;
	e->uid = p->uid;
	e->usage = p->usage;
	e->memory = dlpd_record_cost(f->hdr.len, req->n_tensors);
	e->pid = p->pid;
	e->created_ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
	if (e->created_ns <= s->reg.last_created_ns)
		e->created_ns = s->reg.last_created_ns + 1;
	s->reg.last_created_ns = e->created_ns;
	e->tensors_wire = wire;
	e->tensors_wire_len = wire_len;
	return e;
}

int dlpd_on_publish(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__Publish *req = (Dlpackd__V1__Publish *)*m;
	Dlpackd__V1__PublishReply rep = DLPACKD__V1__PUBLISH_REPLY__INIT;
	struct dlpd_server *s = p->srv;
	struct dlpd_entry *old, *e;
	struct dlpd_storage *st;
	char why[256], name[DLPC_NAME_TEXT], desc[96];
	int r;

	if (dlpc__name_check(req->name.data, req->name.len, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EINVAL, "cannot publish: %s", why);
	dlpc__printable(req->name.data, req->name.len, name, sizeof(name));
	r = check_publish(p, req, f, why, sizeof(why));
	if (r == -EPROTO) {
		dlpd_reply_error(p, id, EPROTO, "cannot publish '%s': %s", name, why);
		dlpd_peer_fail(p, LOG_WARNING, "protocol violation: PUBLISH: %s", why);
		return -EPROTO;
	}
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot publish '%s': %s", name, why);
	old = dlpd_entry_find(&s->reg, req->name.data, req->name.len);
	/* REPLACE is offered only to whom it would serve: another uid's name stays its own */
	if (old && !(req->flags & DLPC_PUBLISH_REPLACE) && may_change(p, old))
		return dlpd_reply_error(p, id, EEXIST,
					"'%s' is already published (generation %llu); publish with "
					"REPLACE to take it over",
					name, (unsigned long long)old->generation);
	if (old && !(req->flags & DLPC_PUBLISH_REPLACE))
		return dlpd_reply_error(
			p, id, EEXIST,
			"'%s' is already published (generation %llu) and belongs to "
			"uid %u: only that uid or root may replace it; choose another "
			"name",
			name, (unsigned long long)old->generation, (unsigned)old->uid);
	if (old && !may_change(p, old))
		return dlpd_reply_error(
			p, id, EPERM,
			"'%s' belongs to uid %u; uid %u may not replace it (only that "
			"uid or root may)",
			name, (unsigned)old->uid, (unsigned)p->uid);
	/* legacy CUDA IPC memory stays the publisher's: it holds no fd and no bytes of ours */
	r = dlpd_quota_publish(p, req->cuda_ipc ? 0 : req->storage_size, !req->cuda_ipc, old, why,
			       sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot publish '%s': %s", name, why);
	r = dlpd_quota_memory(p, dlpd_record_cost(f->hdr.len, req->n_tensors),
			      old && old->usage == p->usage ? old->memory : 0, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot publish '%s': %s", name, why);
	e = entry_new(p, m, f, old);
	if (!e)
		return dlpd_reply_error(p, id, ENOMEM, "cannot publish '%s': out of memory", name);
	st = e->st;
	rep.generation = e->generation;
	rep.created_ns = e->created_ns;
	dlpd_log(LOG_DEBUG, "%s: published '%s' generation %llu, %zu tensors, %llu bytes",
		 dlpd_peer_desc(p, desc, sizeof(desc)), name, (unsigned long long)e->generation,
		 req->n_tensors, (unsigned long long)req->storage_size);
	if (dlpd_names_publish(s, e, old, req->flags & DLPC_PUBLISH_EPHEMERAL ? p : NULL) < 0)
		return dlpd_reply_error(p, id, ENOMEM, "cannot publish '%s': out of memory", name);
	/* memory its publisher keeps or lends goes back to it when freed: only once published,
	 * so that a publish that failed is not answered with a RECLAIM as well */
	if (st->fd < 0 || (req->device_type == kDLCUDA && req->reclaim_token))
		dlpd_reclaim_watch(p, st, req->reclaim_token);
	return dlpd_reply(p, DLPC_MSG_PUBLISH | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
}

int dlpd_on_unpublish(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__Unpublish *req = (Dlpackd__V1__Unpublish *)*m;
	Dlpackd__V1__UnpublishReply rep = DLPACKD__V1__UNPUBLISH_REPLY__INIT;
	char why[160], name[DLPC_NAME_TEXT];
	struct dlpd_entry *e;

	(void)f;
	if (dlpc__name_check(req->name.data, req->name.len, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EINVAL, "cannot unpublish: %s", why);
	dlpc__printable(req->name.data, req->name.len, name, sizeof(name));
	e = dlpd_entry_find(&p->srv->reg, req->name.data, req->name.len);
	if (!e)
		return dlpd_reply_error(p, id, ENOENT, "no entry named '%s'", name);
	if (!may_change(p, e))
		return dlpd_reply_error(p, id, EPERM,
					"'%s' belongs to uid %u; uid %u may not unpublish it", name,
					(unsigned)e->uid, (unsigned)p->uid);
	if ((req->generation && req->generation != e->generation) ||
	    (req->created_ns && req->created_ns != e->created_ns))
		return dlpd_reply_error(
			p, id, ESTALE,
			"cannot unpublish '%s': it is generation %llu created at %lld ns, "
			"not the expected generation %llu created at %lld ns",
			name, (unsigned long long)e->generation, (long long)e->created_ns,
			(unsigned long long)req->generation, (long long)req->created_ns);
	rep.generation = e->generation;
	dlpd_names_remove(p->srv, e, DLPC_WATCH_BY_REQUEST, p);
	return dlpd_reply(p, DLPC_MSG_UNPUBLISH | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
}

int dlpd_on_list(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__List *req = (Dlpackd__V1__List *)*m;
	Dlpackd__V1__ListReply rep = DLPACKD__V1__LIST_REPLY__INIT;
	Dlpackd__V1__EntryInfo *infos;
	void *room_infos, *room_ptrs;
	struct dlpd_entry **v;
	size_t n, limit, room = DLPC_FRAME_MAX - 64;
	int r;

	(void)f;
	if (req->prefix.len > DLPC_NAME_MAX || req->start_after.len > DLPC_NAME_MAX)
		return dlpd_reply_error(p, id, EINVAL, "LIST prefix or cursor longer than %d bytes",
					DLPC_NAME_MAX);
	if (req->channels)
		return dlpd_channels_list(p, id, req);
	limit = dlpd_list_limit(req->limit);
	/* one more than a page, to know whether more follow */
	r = dlpd_registry_range(&p->srv->reg, req->prefix.data, req->prefix.len,
				req->start_after.data, req->start_after.len, limit + 1, &v, &n);
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot list: out of memory");
	rep.more = n > limit;
	n = n < limit ? n : limit;
	if (dlpd_list_room(n, sizeof(*infos), &room_infos, &room_ptrs) < 0)
		return dlpd_reply_error(p, id, ENOMEM, "cannot list: out of memory");
	infos = room_infos;
	rep.entries = room_ptrs;
	for (size_t i = 0; i < n; i++) {
		Dlpackd__V1__EntryInfo *info = &infos[i];
		const struct dlpd_entry *e = v[i];
		size_t sz;

		dlpackd__v1__entry_info__init(info);
		dlpd_entry_info(e, info);
		info->n_tensors = e->pub->n_tensors;
		info->tensors = e->pub->tensors;
		/* field tag + length prefix: at most 6 bytes around each entry */
		sz = dlpackd__v1__entry_info__get_packed_size(info) + 6;
		if (sz > room && i == 0) {
			/* alone too big for a frame: send it without its tensor list */
			info->n_tensors = 0;
			info->tensors = NULL;
			sz = dlpackd__v1__entry_info__get_packed_size(info) + 6;
		}
		if (sz > room) {
			rep.more = true;
			break;
		}
		room -= sz;
		rep.entries[rep.n_entries++] = info;
	}
	r = dlpd_reply(p, DLPC_MSG_LIST | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
	free(rep.entries);
	free(infos);
	return r;
}
