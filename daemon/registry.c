/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Names, entries, storages and references.
 *
 * A storage is held by the entries that name it and by the references connections took by
 * attaching. It is freed (its fd closed) when neither remains. Entries are held by the name map
 * alone; an ephemeral entry is also listed on its publishing connection so that closing the
 * connection can remove it.
 */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dlpackd.h"
#include "util.h"

void dlpd_registry_init(struct dlpd_registry *r)
{
	memset(r, 0, sizeof(*r));
	dlpd_hmap_init(&r->names);
	dlpd_hmap_init(&r->waitqs);
	dlpd_hmap_init(&r->uids);
}

static bool entry_is(const struct dlpd_entry *e, const uint8_t *name, size_t len)
{
	return e->pub->name.len == len && memcmp(e->pub->name.data, name, len) == 0;
}

struct dlpd_entry *dlpd_entry_find(struct dlpd_registry *r, const uint8_t *name, size_t len)
{
	uint64_t h = dlpd_hash_bytes(name, len);

	for (struct dlpd_hnode *n = dlpd_hmap_chain(&r->names, h); n; n = n->next) {
		struct dlpd_entry *e = dlpd_container_of(n, struct dlpd_entry, node);

		if (n->hash == h && entry_is(e, name, len))
			return e;
	}
	return NULL;
}

static void entry_free(struct dlpd_registry *r, struct dlpd_entry *e)
{
	if (e->owner)
		dlpd_list_del(&e->owner_link);
	e->usage->entries--;
	dlpd_usage_put(r, e->usage);
	dlpd_storage_unref(r, e->st, true);
	free(e->tensors_wire);
	dlpackd__v1__publish__free_unpacked(e->pub, NULL);
	free(e);
}

/* Take @p e out of the names and free it, telling nobody. */
static void entry_unlink(struct dlpd_server *s, struct dlpd_entry *e)
{
	s->reg.sorted_valid = false;
	dlpd_hmap_remove(&s->reg.names, &e->node);
	entry_free(&s->reg, e);
}

int dlpd_entry_insert(struct dlpd_server *s, struct dlpd_entry *e, struct dlpd_entry *old)
{
	const ProtobufCBinaryData *name = &e->pub->name;
	uint64_t prev_gen = old ? old->generation : 0;
	int r;

	/* Removing old first cannot make the insert fail: the map has buckets already. Nothing
	 * runs in between, so no attacher sees the name absent, and watchers see one REPLACED. */
	if (old)
		entry_unlink(s, old);
	s->reg.sorted_valid = false;
	r = dlpd_hmap_insert(&s->reg.names, &e->node, dlpd_hash_bytes(name->data, name->len));
	if (r < 0) {
		/* only the first insert into an empty map can fail, so there was no old entry */
		assert(!old);
		entry_free(&s->reg, e);
		return r;
	}
	/* Watchers hear of it before the waiters are answered: answering may kill a connection
	 * whose ephemeral entries then vanish, and those events must come after this one. */
	dlpd_watch_event(s, old ? DLPC_WATCH_REPLACED : DLPC_WATCH_PUBLISHED, e, prev_gen, 0,
			 e->uid, e->pid);
	dlpd_wake_waiters(s, e);
	return 0;
}

void dlpd_entry_remove(struct dlpd_server *s, struct dlpd_entry *e, int reason,
		       const struct dlpd_peer *actor)
{
	dlpd_watch_event(s, DLPC_WATCH_UNPUBLISHED, e, 0, reason, actor->uid, actor->pid);
	entry_unlink(s, e);
}

struct dlpd_storage *dlpd_storage_new(struct dlpd_registry *r, struct dlpd_usage *u, int fd,
				      uint64_t size, int32_t device_type, int32_t device_id)
{
	struct dlpd_storage *st = calloc(1, sizeof(*st));

	if (!st)
		return NULL;
	st->fd = fd;
	st->size = size;
	st->device_type = device_type;
	st->device_id = device_id;
	st->usage = u;
	st->charged = fd >= 0 ? size : 0;
	dlpd_list_init(&st->reclaim_link);
	u->storages++;
	u->bytes += st->charged;
	r->storages++;
	r->storage_fds += fd >= 0;
	r->bytes += size;
	return st;
}

void dlpd_storage_unref(struct dlpd_registry *r, struct dlpd_storage *st, bool name)
{
	if (name)
		st->names--;
	else
		st->attach_refs--;
	if (st->names > 0 || st->attach_refs > 0)
		return;
	r->storages--;
	r->storage_fds -= st->fd >= 0;
	r->bytes -= st->size;
	st->usage->storages--;
	st->usage->bytes -= st->charged;
	dlpd_usage_put(r, st->usage);
	if (st->reclaim_peer)
		dlpd_reclaim_storage_freed(st);
	/* the last close of a memfd frees its memory: not on the loop */
	if (st->fd >= 0)
		dlpd_close_later(st->fd);
	free(st);
}

struct dlpd_ref *dlpd_ref_new(struct dlpd_peer *p, struct dlpd_storage *st)
{
	struct dlpd_ref *ref = malloc(sizeof(*ref));

	if (!ref)
		return NULL;
	ref->id = ++p->next_ref;
	ref->st = st;
	if (dlpd_hmap_insert(&p->refs, &ref->node, dlpd_hash_u64(ref->id)) < 0) {
		free(ref);
		return NULL;
	}
	st->attach_refs++;
	p->srv->reg.refs++;
	return ref;
}

struct dlpd_ref *dlpd_ref_find(struct dlpd_peer *p, uint64_t id)
{
	uint64_t h = dlpd_hash_u64(id);

	for (struct dlpd_hnode *n = dlpd_hmap_chain(&p->refs, h); n; n = n->next) {
		struct dlpd_ref *ref = dlpd_container_of(n, struct dlpd_ref, node);

		if (ref->id == id)
			return ref;
	}
	return NULL;
}

void dlpd_ref_drop(struct dlpd_peer *p, struct dlpd_ref *ref)
{
	dlpd_hmap_remove(&p->refs, &ref->node);
	p->srv->reg.refs--;
	dlpd_storage_unref(&p->srv->reg, ref->st, false);
	free(ref);
}

static struct dlpd_waitq *waitq_find(struct dlpd_registry *r, const uint8_t *name, size_t len,
				     uint64_t h)
{
	for (struct dlpd_hnode *n = dlpd_hmap_chain(&r->waitqs, h); n; n = n->next) {
		struct dlpd_waitq *q = dlpd_container_of(n, struct dlpd_waitq, node);

		if (n->hash == h && q->len == len && memcmp(q->name, name, len) == 0)
			return q;
	}
	return NULL;
}

int dlpd_waiter_add(struct dlpd_server *s, struct dlpd_waiter *w, const uint8_t *name, size_t len)
{
	uint64_t h = dlpd_hash_bytes(name, len);
	struct dlpd_waitq *q = waitq_find(&s->reg, name, len, h);

	if (!q) {
		q = malloc(sizeof(*q) + len);
		if (!q)
			return -ENOMEM;
		dlpd_list_init(&q->waiters);
		q->len = len;
		memcpy(q->name, name, len);
		if (dlpd_hmap_insert(&s->reg.waitqs, &q->node, h) < 0) {
			free(q);
			return -ENOMEM;
		}
	}
	w->q = q;
	dlpd_list_add_tail(&q->waiters, &w->q_link);
	dlpd_list_add_tail(&w->peer->waiters, &w->peer_link);
	s->reg.waiters++;
	w->peer->nwaiters++;
	return 0;
}

struct dlpd_waiter *dlpd_waitq_first_match(struct dlpd_server *s, const uint8_t *name, size_t len,
					   uint32_t uid)
{
	struct dlpd_waitq *q = waitq_find(&s->reg, name, len, dlpd_hash_bytes(name, len));

	if (!q)
		return NULL;
	for (struct dlpd_list *l = q->waiters.next; l != &q->waiters; l = l->next) {
		struct dlpd_waiter *w = dlpd_container_of(l, struct dlpd_waiter, q_link);

		if (!(w->flags & DLPC_ATTACH_OWNER) || w->owner_uid == uid)
			return w;
	}
	return NULL;
}

static void waiter_closed(uv_handle_t *h)
{
	free(h->data);
}

void dlpd_waiter_free(struct dlpd_server *s, struct dlpd_waiter *w)
{
	struct dlpd_waitq *q = w->q;

	dlpd_list_del(&w->q_link);
	dlpd_list_del(&w->peer_link);
	s->reg.waiters--;
	w->peer->nwaiters--;
	if (dlpd_list_empty(&q->waiters)) {
		dlpd_hmap_remove(&s->reg.waitqs, &q->node);
		free(q);
	}
	if (w->timed) {
		w->timer.data = w;
		uv_close((uv_handle_t *)&w->timer, waiter_closed);
	} else {
		free(w);
	}
}

void dlpd_registry_drop_peer(struct dlpd_server *s, struct dlpd_peer *p)
{
	while (!dlpd_list_empty(&p->waiters))
		dlpd_waiter_free(s,
				 dlpd_container_of(p->waiters.next, struct dlpd_waiter, peer_link));
	while (!dlpd_list_empty(&p->ephemeral))
		dlpd_entry_remove(
			s, dlpd_container_of(p->ephemeral.next, struct dlpd_entry, owner_link),
			DLPC_WATCH_BY_DISCONNECT, p);
	for (size_t i = 0; i < p->refs.nbuckets; i++)
		while (p->refs.buckets[i])
			dlpd_ref_drop(p,
				      dlpd_container_of(p->refs.buckets[i], struct dlpd_ref, node));
	dlpd_hmap_clear(&p->refs);
}

void dlpd_registry_clear(struct dlpd_registry *r)
{
	for (size_t i = 0; i < r->names.nbuckets; i++)
		while (r->names.buckets[i]) {
			struct dlpd_entry *e =
				dlpd_container_of(r->names.buckets[i], struct dlpd_entry, node);

			r->names.buckets[i] = e->node.next;
			entry_free(r, e);
		}
	dlpd_hmap_clear(&r->names);
	free(r->sorted);
	r->sorted = NULL;
	r->sorted_valid = false;
	/* waiters belong to peers, which are all gone by now, and so is everything charged */
	dlpd_hmap_clear(&r->waitqs);
	dlpd_hmap_clear(&r->uids);
}

static int cmp_entries(const void *a, const void *b)
{
	const ProtobufCBinaryData *x = &(*(struct dlpd_entry *const *)a)->pub->name;
	const ProtobufCBinaryData *y = &(*(struct dlpd_entry *const *)b)->pub->name;

	return dlpc__bytes_cmp(x->data, x->len, y->data, y->len);
}

/* Rebuild the sorted view of all names if a publish or unpublish changed them. */
static int sorted_refresh(struct dlpd_registry *r)
{
	size_t n = 0;

	if (r->sorted_valid)
		return 0;
	if (r->sorted_cap < r->names.count) {
		size_t cap = r->names.count * 2;
		struct dlpd_entry **v = realloc(r->sorted, cap * sizeof(*v));

		if (!v)
			return -ENOMEM;
		r->sorted = v;
		r->sorted_cap = cap;
	}
	for (size_t i = 0; i < r->names.nbuckets; i++)
		for (struct dlpd_hnode *h = r->names.buckets[i]; h; h = h->next)
			r->sorted[n++] = dlpd_container_of(h, struct dlpd_entry, node);
	if (n > 1)
		qsort(r->sorted, n, sizeof(*r->sorted), cmp_entries);
	r->nsorted = n;
	r->sorted_valid = true;
	return 0;
}

/* Index of the first sorted name >= (@p key, @p len), or > it when @p strict. */
static size_t sorted_bound(const struct dlpd_registry *r, const uint8_t *key, size_t len,
			   bool strict)
{
	size_t lo = 0, hi = r->nsorted;

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		const ProtobufCBinaryData *name = &r->sorted[mid]->pub->name;
		int c = dlpc__bytes_cmp(name->data, name->len, key, len);

		if (c < 0 || (strict && c == 0))
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

int dlpd_registry_range(struct dlpd_registry *r, const uint8_t *prefix, size_t plen,
			const uint8_t *a, size_t alen, size_t limit, struct dlpd_entry ***ret,
			size_t *count)
{
	size_t i, n = 0;
	int err = sorted_refresh(r);

	if (err < 0)
		return err;
	/* start at the prefix, or just after the cursor if that comes later */
	i = sorted_bound(r, prefix, plen, false);
	if (alen > 0 && dlpc__bytes_cmp(a, alen, prefix, plen) >= 0) {
		size_t j = sorted_bound(r, a, alen, true);

		i = j > i ? j : i;
	}
	while (i + n < r->nsorted && n < limit) {
		const ProtobufCBinaryData *name = &r->sorted[i + n]->pub->name;

		if (name->len < plen || dlpc__bytes_cmp(name->data, plen, prefix, plen) != 0)
			break;
		n++;
	}
	*ret = n ? r->sorted + i : NULL;
	*count = n;
	return 0;
}
