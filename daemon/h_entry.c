/* SPDX-License-Identifier: Apache-2.0 */
/* Handlers that change or read the set of names: PUBLISH, UNPUBLISH, LIST. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "handlers.h"
#include "names.h"
#include "peer.h"
#include "quota.h"
#include "reclaim.h"
#include "storage.h"
#include "table.h"
#include "util.h"

static int cmp_keys(const void *a, const void *b)
{
	const ProtobufCBinaryData *x = &(*(Dlpackd__V1__TensorDesc *const *)a)->key;
	const ProtobufCBinaryData *y = &(*(Dlpackd__V1__TensorDesc *const *)b)->key;

	return dlpc__bytes_cmp(x->data, x->len, y->data, y->len);
}

/* Are the tensor descriptions of @p req sound? 0, or -errno and the reason. */
static int check_tensors(const Dlpackd__V1__Publish *req, char *why, size_t whylen)
{
	Dlpackd__V1__TensorDesc **sorted;
	int r = 0;

	if (req->n_tensors == 0 || req->n_tensors > DLPC_BUNDLE_MAX) {
		snprintf(why, whylen, "%zu tensors; an entry holds 1 to %d", req->n_tensors,
			 DLPC_BUNDLE_MAX);
		return -EINVAL;
	}
	for (size_t i = 0; i < req->n_tensors; i++) {
		const Dlpackd__V1__TensorDesc *t = req->tensors[i];
		uint64_t nbytes, end;

		r = dlpc__key_check(t->key.data, t->key.len, why, whylen);
		if (r < 0)
			return r;
		if (t->dtype_code > UINT8_MAX || t->dtype_bits > UINT8_MAX ||
		    t->dtype_lanes > UINT16_MAX || t->n_shape > DLPC_NDIM_MAX) {
			snprintf(why, whylen, "tensor %zu: bad dtype or more than %d dimensions", i,
				 DLPC_NDIM_MAX);
			return -EINVAL;
		}
		r = dlpc__tensor_nbytes(t->dtype_bits, t->dtype_lanes, t->shape, t->n_shape,
					&nbytes);
		if (r < 0) {
			snprintf(why, whylen, "tensor %zu: bad dtype or shape", i);
			return r;
		}
		/* a legacy CUDA IPC tensor, or one in lent VMM memory, sits where its producer's
		 * allocator put it */
		if ((!req->cuda_ipc && !(req->device_type == kDLCUDA && req->reclaim_token) &&
		     t->offset % DLPC_ALIGN != 0) ||
		    __builtin_add_overflow(t->offset, nbytes, &end) || end > req->storage_size) {
			snprintf(why, whylen,
				 "tensor %zu: %llu bytes at offset %llu do not fit an aligned "
				 "place in a storage of %llu bytes",
				 i, (unsigned long long)nbytes, (unsigned long long)t->offset,
				 (unsigned long long)req->storage_size);
			return -EINVAL;
		}
	}
	if (req->n_tensors == 1)
		return 0;
	sorted = malloc(req->n_tensors * sizeof(*sorted));
	if (!sorted)
		return -ENOMEM;
	memcpy(sorted, req->tensors, req->n_tensors * sizeof(*sorted));
	qsort(sorted, req->n_tensors, sizeof(*sorted), cmp_keys);
	for (size_t i = 1; i < req->n_tensors && r == 0; i++)
		if (cmp_keys(&sorted[i - 1], &sorted[i]) == 0) {
			char key[DLPC_NAME_TEXT];

			snprintf(why, whylen, "key '%s' appears twice in the bundle",
				 dlpc__printable(sorted[i]->key.data, sorted[i]->key.len, key,
						 sizeof(key)));
			r = -EINVAL;
		}
	free(sorted);
	return r;
}

static void free_unknown(ProtobufCMessage *m)
{
	for (unsigned i = 0; i < m->n_unknown_fields; i++)
		free(m->unknown_fields[i].data);
	free(m->unknown_fields);
	m->unknown_fields = NULL;
	m->n_unknown_fields = 0;
}

/* Fields this daemon does not know would be kept, one allocation each, for the entry's life:
 * free them now. (protobuf-c's default allocator is malloc.) */
static void drop_unknown_fields(Dlpackd__V1__Publish *req)
{
	free_unknown(&req->base);
	for (size_t i = 0; i < req->n_tensors; i++)
		free_unknown(&req->tensors[i]->base);
}

/* The descriptions as an ATTACH reply encodes them: its tensor_table field, tag and length
 * included (an AttachReply with only that field set packs to exactly those bytes). Every
 * ATTACH of the entry appends them instead of encoding anything. NULL on ENOMEM. */
static uint8_t *encode_tensors(const Dlpackd__V1__Publish *req, size_t *len)
{
	Dlpackd__V1__AttachReply only = DLPACKD__V1__ATTACH_REPLY__INIT;
	uint8_t *table, *wire;

	only.tensor_table.len = dlpc__table_size(req->tensors, req->n_tensors);
	table = malloc(only.tensor_table.len);
	if (!table)
		return NULL;
	dlpc__table_encode(req->tensors, req->n_tensors, table);
	only.tensor_table.data = table;
	*len = dlpackd__v1__attach_reply__get_packed_size(&only);
	wire = malloc(*len);
	if (wire)
		dlpackd__v1__attach_reply__pack(&only, wire);
	free(table);
	return wire;
}

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

int dlpd_on_publish(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__Publish *req = (Dlpackd__V1__Publish *)*m;
	Dlpackd__V1__PublishReply rep = DLPACKD__V1__PUBLISH_REPLY__INIT;
	struct dlpd_server *s = p->srv;
	struct dlpd_entry *old, *e;
	struct dlpd_storage *st;
	uint8_t *wire;
	size_t wire_len;
	char why[256], name[DLPC_NAME_TEXT], desc[96];
	struct timespec now;
	int r;

	if (dlpc__name_check(req->name.data, req->name.len, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EINVAL, "cannot publish: %s", why);
	dlpc__printable(req->name.data, req->name.len, name, sizeof(name));
	if (req->flags & ~DLPC_PUBLISH_FLAGS_ALL)
		return dlpd_reply_error(p, id, EINVAL, "cannot publish '%s': unknown flags 0x%x",
					name, req->flags & ~DLPC_PUBLISH_FLAGS_ALL);
	r = check_device(p, req, f, why, sizeof(why));
	if (r == -EPROTO) {
		dlpd_reply_error(p, id, EPROTO, "cannot publish '%s': %s", name, why);
		dlpd_peer_fail(p, LOG_WARNING, "protocol violation: PUBLISH: %s", why);
		return -EPROTO;
	}
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot publish '%s': %s", name, why);
	if (req->storage_size == 0 || req->storage_size > INT64_MAX)
		return dlpd_reply_error(p, id, EINVAL, "cannot publish '%s': bad storage size %llu",
					name, (unsigned long long)req->storage_size);
	r = check_tensors(req, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot publish '%s': %s", name, why);
	if (req->device_type == kDLCPU)
		r = dlpd_storage_check(f->fds[0], req->storage_size,
				       req->flags & DLPC_PUBLISH_WRITABLE, why, sizeof(why));
	else if (!req->cuda_ipc)
		r = dlpd_device_storage_check(f->fds[0], why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot publish '%s': %s", name, why);
	old = dlpd_entry_find(&s->reg, req->name.data, req->name.len);
	if (old && !(req->flags & DLPC_PUBLISH_REPLACE))
		return dlpd_reply_error(p, id, EEXIST,
					"'%s' is already published (generation %llu); publish with "
					"REPLACE to take it over",
					name, (unsigned long long)old->generation);
	if (old && !may_change(p, old))
		return dlpd_reply_error(p, id, EPERM,
					"'%s' belongs to uid %u; uid %u may not replace it", name,
					(unsigned)old->uid, (unsigned)p->uid);
	/* legacy CUDA IPC memory stays the publisher's: it holds no fd and no bytes of ours */
	r = dlpd_quota_publish(p, req->cuda_ipc ? 0 : req->storage_size, !req->cuda_ipc, old, why,
			       sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot publish '%s': %s", name, why);

	drop_unknown_fields(req);
	wire = encode_tensors(req, &wire_len);
	e = wire ? calloc(1, sizeof(*e)) : NULL;
	/* charged to the connection's uid, whose usage record its connection keeps alive */
	st = e ? dlpd_storage_new(&s->reg, p->usage, f->nfds ? f->fds[0] : -1, req->storage_size,
				  req->device_type, req->device_id)
	       : NULL;
	if (!st) {
		free(e);
		free(wire);
		return dlpd_reply_error(p, id, ENOMEM, "cannot publish '%s': out of memory", name);
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
	e->pid = p->pid;
	e->created_ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
	rep.generation = e->generation;
	dlpd_log(LOG_DEBUG, "%s: published '%s' generation %llu, %zu tensors, %llu bytes",
		 dlpd_peer_desc(p, desc, sizeof(desc)), name, (unsigned long long)e->generation,
		 req->n_tensors, (unsigned long long)req->storage_size);
	e->tensors_wire = wire;
	e->tensors_wire_len = wire_len;
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
	rep.generation = e->generation;
	dlpd_names_remove(p->srv, e, DLPC_WATCH_BY_REQUEST, p);
	return dlpd_reply(p, DLPC_MSG_UNPUBLISH | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
}

int dlpd_on_list(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__List *req = (Dlpackd__V1__List *)*m;
	Dlpackd__V1__ListReply rep = DLPACKD__V1__LIST_REPLY__INIT;
	Dlpackd__V1__EntryInfo *infos = NULL;
	struct dlpd_entry **v;
	size_t n, limit, room = DLPC_FRAME_MAX - 64;
	int r;

	(void)f;
	if (req->prefix.len > DLPC_NAME_MAX || req->start_after.len > DLPC_NAME_MAX)
		return dlpd_reply_error(p, id, EINVAL, "LIST prefix or cursor longer than %d bytes",
					DLPC_NAME_MAX);
	limit = req->limit == 0 || req->limit > DLPC_LIST_PAGE_MAX ? DLPC_LIST_PAGE_MAX
								   : req->limit;
	/* one more than a page, to know whether more follow */
	r = dlpd_registry_range(&p->srv->reg, req->prefix.data, req->prefix.len,
				req->start_after.data, req->start_after.len, limit + 1, &v, &n);
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot list: out of memory");
	rep.more = n > limit;
	n = n < limit ? n : limit;
	if (n > 0) {
		infos = calloc(n, sizeof(*infos));
		rep.entries = calloc(n, sizeof(*rep.entries));
		if (!infos || !rep.entries) {
			free(infos);
			free(rep.entries);
			return dlpd_reply_error(p, id, ENOMEM, "cannot list: out of memory");
		}
	}
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
