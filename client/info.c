/* SPDX-License-Identifier: Apache-2.0 */
/* Requests that read or remove names (UNPUBLISH, LIST, STAT) and small helpers. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "util.h"

DLPC_EXPORT int dlpc_unpublish_if(dlpc_client *c, const char *name, uint64_t generation,
				  int64_t created_ns)
{
	Dlpackd__V1__Unpublish req = DLPACKD__V1__UNPUBLISH__INIT;
	Dlpackd__V1__UnpublishReply *rep;
	int r;

	if (!c)
		return dlpc__fail(-EINVAL, "cannot unpublish: client is NULL");
	r = dlpc__check(c);
	if (r < 0)
		return r;
	r = dlpc__name_arg(name, "unpublish");
	if (r < 0)
		return r;
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.generation = generation;
	req.created_ns = created_ns;
	r = dlpc__call(c, DLPC_MSG_UNPUBLISH, &req.base, NULL, 0,
		       &dlpackd__v1__unpublish_reply__descriptor, (ProtobufCMessage **)&rep, NULL,
		       NULL);
	if (r < 0)
		return r;
	dlpackd__v1__unpublish_reply__free_unpacked(rep, NULL);
	return 0;
}

DLPC_EXPORT int dlpc_unpublish(dlpc_client *c, const char *name)
{
	return dlpc_unpublish_if(c, name, 0, 0);
}

static char *dup_bytes(const ProtobufCBinaryData *b)
{
	char *s = malloc(b->len + 1);

	if (s) {
		if (b->len)
			memcpy(s, b->data, b->len);
		s[b->len] = '\0';
	}
	return s;
}

void dlpc__entry_clear(dlpc_entry_info *e)
{
	for (size_t i = 0; e->tensors && i < e->ntensors; i++) {
		free((char *)e->tensors[i].key);
		free((int64_t *)e->tensors[i].shape);
	}
	free(e->tensors);
	free((char *)e->name);
}

DLPC_EXPORT void dlpc_list_free(dlpc_entry_info *list, size_t count)
{
	for (size_t i = 0; list && i < count; i++)
		dlpc__entry_clear(&list[i]);
	free(list);
}

int dlpc__entry_fill(dlpc_entry_info *e, const Dlpackd__V1__EntryInfo *in)
{
	memset(e, 0, sizeof(*e));
	e->name = dup_bytes(&in->name);
	e->generation = in->generation;
	e->device.device_type = (DLDeviceType)in->device_type;
	e->device.device_id = in->device_id;
	e->flags = in->flags;
	e->nbytes = in->nbytes;
	e->refs = in->refs;
	e->cached_refs = in->cached_refs;
	e->owner_uid = in->owner_uid;
	e->owner_pid = in->owner_pid;
	e->created_ns = in->created_ns;
	e->ntensors = in->tensor_count;
	if (!e->name)
		return -ENOMEM;
	if (in->n_tensors == 0 || in->n_tensors != in->tensor_count)
		return 0;
	e->tensors = calloc(in->n_tensors, sizeof(*e->tensors));
	if (!e->tensors)
		return -ENOMEM;
	for (size_t i = 0; i < in->n_tensors; i++) {
		const Dlpackd__V1__TensorDesc *d = in->tensors[i];
		dlpc_tensor_info *t = &e->tensors[i];
		int64_t *shape = malloc((d->n_shape ? d->n_shape : 1) * sizeof(int64_t));

		t->key = dup_bytes(&d->key);
		t->shape = shape;
		if (!t->key || !shape)
			return -ENOMEM;
		if (d->n_shape)
			memcpy(shape, d->shape, d->n_shape * sizeof(int64_t));
		t->ndim = (int32_t)d->n_shape;
		t->dtype.code = (uint8_t)d->dtype_code;
		t->dtype.bits = (uint8_t)d->dtype_bits;
		t->dtype.lanes = (uint16_t)d->dtype_lanes;
		if (dlpc__tensor_nbytes(d->dtype_bits, d->dtype_lanes, d->shape, d->n_shape,
					&t->nbytes) < 0)
			t->nbytes = 0;
	}
	return 0;
}

DLPC_EXPORT int dlpc_list(dlpc_client *c, const char *prefix, dlpc_entry_info **ret, size_t *count)
{
	Dlpackd__V1__List req = DLPACKD__V1__LIST__INIT;
	dlpc_entry_info *v = NULL;
	size_t n = 0, cap = 0;
	char *cursor = NULL;
	bool more = true;
	int r = 0;

	if (!c || !ret || !count)
		return dlpc__fail(-EINVAL, "dlpc_list: NULL argument");
	*ret = NULL;
	*count = 0;
	r = dlpc__check(c);
	if (r < 0)
		return r;
	prefix = prefix ? prefix : "";
	if (strlen(prefix) > DLPC_NAME_MAX)
		return dlpc__fail(-EINVAL, "dlpc_list: prefix longer than %d bytes", DLPC_NAME_MAX);
	req.prefix.data = (uint8_t *)prefix;
	req.prefix.len = strlen(prefix);
	/* a dlpc_close() from another thread between pages must not free the client under us */
	dlpc__client_ref(c);
	/* the daemon answers in pages; each asks for the names after the last one seen */
	while (more && r == 0) {
		Dlpackd__V1__ListReply *rep;
		struct dlpc__arena arena;

		req.start_after.data = (uint8_t *)cursor;
		req.start_after.len = cursor ? strlen(cursor) : 0;
		/* a page holds thousands of entries: unpack it into an arena, not a malloc per field */
		dlpc__arena_init(&arena);
		r = dlpc__call(c, DLPC_MSG_LIST, &req.base, NULL, 0,
			       &dlpackd__v1__list_reply__descriptor, (ProtobufCMessage **)&rep,
			       NULL, &arena.alloc);
		if (r < 0) {
			dlpc__arena_clear(&arena);
			break;
		}
		more = rep->more && rep->n_entries > 0;
		if (n + rep->n_entries > cap) {
			size_t ncap = (n + rep->n_entries) * 2;
			dlpc_entry_info *nv = realloc(v, ncap * sizeof(*v));

			if (!nv)
				r = dlpc__fail(-ENOMEM, "dlpc_list: out of memory");
			else
				v = nv, cap = ncap;
		}
		for (size_t i = 0; r == 0 && i < rep->n_entries; i++) {
			if (dlpc__entry_fill(&v[n++], rep->entries[i]) < 0)
				r = dlpc__fail(-ENOMEM, "dlpc_list: out of memory");
		}
		/* a page that does not move past the cursor would loop forever */
		if (r == 0 && more && cursor && strcmp(v[n - 1].name, cursor) <= 0)
			r = dlpc__fail(-EPROTO,
				       "dlpc_list: dlpackd sent a page that does not advance");
		if (r == 0 && more) {
			free(cursor);
			cursor = n ? strdup(v[n - 1].name) : NULL;
			if (!cursor)
				r = dlpc__fail(-ENOMEM, "dlpc_list: out of memory");
		}
		dlpc__arena_clear(&arena);
	}
	dlpc__client_unref(c);
	free(cursor);
	if (r < 0) {
		dlpc_list_free(v, n);
		return r;
	}
	*ret = v;
	*count = n;
	return 0;
}

DLPC_EXPORT int dlpc_stat(dlpc_client *c, dlpc_stats *out)
{
	Dlpackd__V1__Stat req = DLPACKD__V1__STAT__INIT;
	Dlpackd__V1__StatReply *rep;
	dlpc_stats s = {.size = sizeof(s)};
	int r;

	if (!c || !out || out->size < offsetof(dlpc_stats, uptime_ms))
		return dlpc__fail(-EINVAL, "dlpc_stat: NULL argument or out->size not set");
	r = dlpc__check(c);
	if (r < 0)
		return r;
	r = dlpc__call(c, DLPC_MSG_STAT, &req.base, NULL, 0, &dlpackd__v1__stat_reply__descriptor,
		       (ProtobufCMessage **)&rep, NULL, NULL);
	if (r < 0)
		return r;
	s.daemon_pid = rep->daemon_pid;
	s.uptime_ms = rep->uptime_ms;
	s.connections = rep->connections;
	s.entries = rep->entries;
	s.storages = rep->storages;
	s.bytes_held = rep->bytes_held;
	s.references = rep->references;
	s.waiters = rep->waiters;
	s.fds_open = rep->fds_open;
	s.fds_sent = rep->fds_sent;
#define X(NAME, name, ...) s.req_##name = rep->req_##name;
	DLPC_REQUESTS(X)
#undef X
	s.protocol_errors = rep->protocol_errors;
	s.fds_closing = rep->fds_closing;
	s.watchers = rep->watchers;
	s.events = rep->events;
	s.tx_queued = rep->tx_queued;
	s.queue_drops = rep->queue_drops;
	s.uid_bytes_held = rep->uid_bytes_held;
	s.uid_entries = rep->uid_entries;
	s.uid_connections = rep->uid_connections;
	s.uid_bytes_pinned = rep->uid_bytes_pinned;
	s.channels = rep->channels;
	s.messages = rep->messages;
	s.uid_channels = rep->uid_channels;
	s.cached_references = rep->cached_references;
	s.invalidations = rep->invalidations;
	s.fd_budget = rep->fd_budget;
	s.fds_own = rep->fds_own;
	dlpackd__v1__stat_reply__free_unpacked(rep, NULL);
	/* copy only as much as the caller's struct holds, keeping its size field */
	memcpy((char *)out + sizeof(out->size), (char *)&s + sizeof(s.size),
	       (out->size < sizeof(s) ? out->size : sizeof(s)) - sizeof(s.size));
	return 0;
}

/* DLManagedTensor wrapper around a versioned tensor. */
struct legacy {
	DLManagedTensor t;
	DLManagedTensorVersioned *inner;
};

static void legacy_deleter(DLManagedTensor *t)
{
	struct legacy *l = (struct legacy *)t;

	if (l->inner->deleter)
		l->inner->deleter(l->inner);
	free(l);
}

DLPC_EXPORT DLManagedTensor *dlpc_to_legacy(DLManagedTensorVersioned *t)
{
	struct legacy *l;

	if (!t) {
		dlpc__fail(-EINVAL, "dlpc_to_legacy: tensor is NULL");
		return NULL;
	}
	l = malloc(sizeof(*l));
	if (!l) {
		dlpc__fail(-ENOMEM, "dlpc_to_legacy: out of memory");
		if (t->deleter)
			t->deleter(t);
		return NULL;
	}
	l->t.dl_tensor = t->dl_tensor;
	l->t.manager_ctx = l;
	l->t.deleter = legacy_deleter;
	l->inner = t;
	return &l->t;
}

DLPC_EXPORT const char *dlpc_strerror(int err)
{
	const char *s;

	switch (err) {
	case 0:
		return "success";
	case -EBADFD:
		return "client used in a process other than the one that connected (after fork)";
	case -ECONNREFUSED:
		return "no dlpackd is listening on the socket";
	case -ENOENT:
		return "no such name (or no daemon socket)";
	case -EEXIST:
		return "name is already published";
	case -ESTALE:
		return "the name holds another entry than the one expected (replaced or published "
		       "anew)";
	case -EPROTO:
		return "protocol error between libdlpc and dlpackd";
	case -EDQUOT:
		return "a dlpackd quota would be exceeded";
	case -ENOSPC:
		return "shared memory is full";
	case -ETIMEDOUT:
		/* not the C library's "Connection timed out": no connection timed out, a wait did
		 * (for a name to appear, a channel's message or room, or dlpackd's answer) */
		return "timed out: what was waited for (a name, a channel message, dlpackd's "
		       "answer) did not come in time";
	default:
		s = err < 0 ? strerrordesc_np(-err) : NULL;
		return s ? s : "unknown error";
	}
}
