/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Names, entries, storages, references, waiting attaches and usage: the data alone.
 *
 * A storage is held by the entries that name it and by the references connections took by
 * attaching; when neither remains the function that dropped the last holder hands it back to
 * its caller, which frees it. Entries are held by the name map alone; an ephemeral entry is also
 * listed on its publishing connection's holdings so that closing the connection can remove it.
 *
 * A uid is charged with the declared size (and the fd) of every storage it publishes while a name
 * reaches it. A storage that was replaced or unpublished but is still referenced is kept alive
 * by the references' holders, not by its publisher: from then on each uid holding one is charged
 * with it (pinned_bytes, pinned_fds), until its last reference of it goes. So no uid can pin
 * another's quota by attaching and holding each generation of its entry. Entries and connections
 * are charged while they exist. A usage record lives while anything is charged to it.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "registry.h"
#include "util.h"

void dlpd_registry_init(struct dlpd_registry *r)
{
	memset(r, 0, sizeof(*r));
	dlpd_hmap_init(&r->names);
	dlpd_hmap_init(&r->waitqs);
	dlpd_hmap_init(&r->uids);
	dlpd_hmap_init(&r->channels);
}

void dlpd_registry_clear(struct dlpd_registry *r)
{
	dlpd_assert(r->names.count == 0 && r->channels.count == 0);
	dlpd_hmap_clear(&r->names);
	free(r->sorted);
	r->sorted = NULL;
	r->sorted_valid = false;
	dlpd_hmap_clear(&r->waitqs);
	dlpd_hmap_clear(&r->uids);
	dlpd_hmap_clear(&r->channels);
}

void dlpd_holdings_init(struct dlpd_holdings *h)
{
	memset(h, 0, sizeof(*h));
	dlpd_hmap_init(&h->refs);
	dlpd_list_init(&h->ephemeral);
	dlpd_list_init(&h->waiters);
	dlpd_list_init(&h->chan_waits);
	dlpd_list_init(&h->producing);
	dlpd_list_init(&h->lent);
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

struct dlpd_entry *dlpd_entry_any(struct dlpd_registry *r, size_t *cursor)
{
	struct dlpd_hnode *n = dlpd_hmap_next(&r->names, cursor);

	return n ? dlpd_container_of(n, struct dlpd_entry, node) : NULL;
}

/*
 * Changes to the names between two LISTs that the sorted view is kept in order through, each
 * one binary search and one memmove of the pointers after it; past them it is let go and the
 * next LIST sorts every name again. One change costs about what a thousandth of a sort of all
 * names does (a memmove of pointers against a sort's cache-missing name compares), so a LIST
 * costs at most about two sorts' worth, however the changes and LISTs interleave, and a client
 * that alternates a change and a LIST no longer makes each LIST sort every name.
 */
#define DLPD_SORTED_KEPT_MAX 1024

static size_t sorted_bound(const struct dlpd_registry *r, const uint8_t *key, size_t len,
			   bool strict);

/* Is the sorted view still to be kept in order through one more change? */
static bool sorted_keep(struct dlpd_registry *r)
{
	if (!r->sorted_valid)
		return false;
	if (++r->sorted_mods > DLPD_SORTED_KEPT_MAX) {
		r->sorted_valid = false;
		return false;
	}
	return true;
}

/* @p e got its name: put it in the sorted view, if that is kept. */
static void sorted_insert(struct dlpd_registry *r, struct dlpd_entry *e)
{
	const ProtobufCBinaryData *name = &e->pub->name;
	size_t i;

	if (!sorted_keep(r))
		return;
	if (r->nsorted == r->sorted_cap) {
		size_t cap = r->sorted_cap ? 2 * r->sorted_cap : 64;
		struct dlpd_entry **v = realloc(r->sorted, cap * sizeof(*v));

		if (!v) {
			r->sorted_valid = false; /* the next LIST tries again */
			return;
		}
		r->sorted = v;
		r->sorted_cap = cap;
	}
	i = sorted_bound(r, name->data, name->len, false);
	memmove(r->sorted + i + 1, r->sorted + i, (r->nsorted - i) * sizeof(*r->sorted));
	r->sorted[i] = e;
	r->nsorted++;
}

/* @p e loses its name: take it out of the sorted view, if that is kept. */
static void sorted_remove(struct dlpd_registry *r, struct dlpd_entry *e)
{
	const ProtobufCBinaryData *name = &e->pub->name;
	size_t i;

	if (!sorted_keep(r))
		return;
	i = sorted_bound(r, name->data, name->len, false);
	if (i >= r->nsorted || r->sorted[i] != e) {
		r->sorted_valid = false; /* not where it should be: sorted again */
		return;
	}
	memmove(r->sorted + i, r->sorted + i + 1, (r->nsorted - i - 1) * sizeof(*r->sorted));
	r->nsorted--;
}

int dlpd_entry_link(struct dlpd_registry *r, struct dlpd_entry *e, struct dlpd_holdings *owner)
{
	const ProtobufCBinaryData *name = &e->pub->name;
	int err = dlpd_hmap_insert(&r->names, &e->node, dlpd_hash_bytes(name->data, name->len));

	if (err < 0)
		return err;
	sorted_insert(r, e);
	e->usage->entries++;
	e->usage->memory += e->memory;
	e->owner = owner;
	if (owner)
		dlpd_list_add_tail(&owner->ephemeral, &e->owner_link);
	return 0;
}

void dlpd_entry_free_unlinked(struct dlpd_entry *e)
{
	free(e->tensors_wire);
	if (e->pub)
		dlpackd__v1__publish__free_unpacked(e->pub, NULL);
	free(e);
}

/* Charge (@p sign 1) or uncharge (-1) @p u with @p st as a storage it keeps alive. */
static void pin_charge(struct dlpd_usage *u, const struct dlpd_storage *st, int sign)
{
	u->pinned_bytes += (uint64_t)sign * st->charged;
	u->pinned_fds += (uint64_t)sign * (st->fd >= 0);
}

/* Drop one holder of @p st (a name when @p name is true, else a reference). */
static struct dlpd_storage *storage_unhold(struct dlpd_storage *st, bool name)
{
	dlpd_assert(name ? st->names > 0 : st->attach_refs > 0);
	if (name)
		st->names--;
	else
		st->attach_refs--;
	if (st->names == 0 && st->attach_refs > 0 && !st->unnamed) {
		/* the last name went, references keep it: their uids pay from now on */
		st->unnamed = true;
		st->usage->bytes -= st->charged;
		st->usage->storage_fds -= st->fd >= 0;
		for (unsigned i = 0; i < st->npins; i++)
			pin_charge(st->pins[i].usage, st, 1);
	}
	return st->names > 0 || st->attach_refs > 0 ? NULL : st;
}

struct dlpd_storage *dlpd_storage_unname(struct dlpd_storage *st)
{
	return storage_unhold(st, true);
}

struct dlpd_storage *dlpd_entry_unlink(struct dlpd_registry *r, struct dlpd_entry *e)
{
	struct dlpd_storage *st = e->st;

	sorted_remove(r, e);
	dlpd_hmap_remove(&r->names, &e->node);
	if (e->owner)
		dlpd_list_del(&e->owner_link);
	e->usage->entries--;
	e->usage->memory -= e->memory;
	r->freed += e->memory;
	dlpd_usage_put(r, e->usage);
	dlpd_entry_free_unlinked(e);
	return storage_unhold(st, true);
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
	dlpd_list_init(&st->refs);
	u->storages++;
	u->storage_fds += fd >= 0;
	u->bytes += st->charged;
	r->storages++;
	r->storage_fds += fd >= 0;
	r->bytes += size;
	return st;
}

void dlpd_storage_free(struct dlpd_registry *r, struct dlpd_storage *st)
{
	dlpd_assert(st->names == 0 && st->attach_refs == 0);
	r->storages--;
	r->storage_fds -= st->fd >= 0;
	r->bytes -= st->size;
	st->usage->storages--;
	if (!st->unnamed) {
		st->usage->storage_fds -= st->fd >= 0;
		st->usage->bytes -= st->charged;
	}
	dlpd_usage_put(r, st->usage);
	free(st->pins);
	free(st);
}

bool dlpd_storage_pinned_by(const struct dlpd_storage *st, const struct dlpd_usage *u)
{
	for (unsigned i = 0; i < st->npins; i++)
		if (st->pins[i].usage == u)
			return true;
	return false;
}

/* @p h takes one more reference on @p st: count it on its uid's pin. 0 or -ENOMEM. */
static int pin_add(struct dlpd_storage *st, struct dlpd_usage *u)
{
	for (unsigned i = 0; i < st->npins; i++)
		if (st->pins[i].usage == u) {
			st->pins[i].refs++;
			return 0;
		}
	if (st->npins == st->pins_cap) {
		unsigned cap = st->pins_cap ? st->pins_cap * 2 : 2;
		struct dlpd_pin *v = realloc(st->pins, cap * sizeof(*v));

		if (!v)
			return -ENOMEM;
		st->pins = v;
		st->pins_cap = cap;
	}
	st->pins[st->npins++] = (struct dlpd_pin){.usage = u, .refs = 1};
	if (st->unnamed)
		pin_charge(u, st, 1);
	return 0;
}

static void pin_drop(struct dlpd_storage *st, struct dlpd_usage *u)
{
	for (unsigned i = 0; i < st->npins; i++) {
		if (st->pins[i].usage != u)
			continue;
		if (--st->pins[i].refs > 0)
			return;
		if (st->unnamed)
			pin_charge(u, st, -1);
		st->pins[i] = st->pins[--st->npins];
		return;
	}
}

struct dlpd_ref *dlpd_ref_new(struct dlpd_registry *r, struct dlpd_holdings *h,
			      struct dlpd_storage *st)
{
	struct dlpd_ref *ref = malloc(sizeof(*ref));

	if (!ref)
		return NULL;
	ref->id = ++h->next_ref;
	ref->st = st;
	ref->holder = h;
	ref->cacheable = false;
	ref->cached = false;
	if (pin_add(st, h->usage) < 0) {
		free(ref);
		return NULL;
	}
	if (dlpd_hmap_insert(&h->refs, &ref->node, dlpd_hash_u64(ref->id)) < 0) {
		pin_drop(st, h->usage);
		free(ref);
		return NULL;
	}
	st->attach_refs++;
	dlpd_list_add_tail(&st->refs, &ref->st_link);
	r->refs++;
	h->usage->memory += DLPD_REF_COST;
	return ref;
}

struct dlpd_ref *dlpd_ref_find(struct dlpd_holdings *h, uint64_t id)
{
	uint64_t hash = dlpd_hash_u64(id);

	for (struct dlpd_hnode *n = dlpd_hmap_chain(&h->refs, hash); n; n = n->next) {
		struct dlpd_ref *ref = dlpd_container_of(n, struct dlpd_ref, node);

		if (ref->id == id)
			return ref;
	}
	return NULL;
}

void dlpd_ref_mark(struct dlpd_registry *r, struct dlpd_ref *ref, bool cached)
{
	if (ref->cached == cached)
		return;
	ref->cached = cached;
	ref->st->cached_refs += cached ? 1 : (uint64_t)-1;
	r->cached_refs += cached ? 1 : (uint64_t)-1;
}

struct dlpd_ref *dlpd_ref_any(struct dlpd_holdings *h, size_t *cursor)
{
	struct dlpd_hnode *n = dlpd_hmap_next(&h->refs, cursor);

	return n ? dlpd_container_of(n, struct dlpd_ref, node) : NULL;
}

struct dlpd_storage *dlpd_ref_drop(struct dlpd_registry *r, struct dlpd_holdings *h,
				   struct dlpd_ref *ref)
{
	struct dlpd_storage *st = ref->st;

	dlpd_assert(ref->holder == h);
	dlpd_hmap_remove(&h->refs, &ref->node);
	dlpd_ref_mark(r, ref, false);
	dlpd_list_del(&ref->st_link);
	r->refs--;
	h->usage->memory -= DLPD_REF_COST;
	r->freed += DLPD_REF_COST;
	free(ref);
	pin_drop(st, h->usage);
	return storage_unhold(st, false);
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

int dlpd_waiter_add(struct dlpd_registry *r, struct dlpd_holdings *h, struct dlpd_waiter *w,
		    const uint8_t *name, size_t len)
{
	uint64_t hash = dlpd_hash_bytes(name, len);
	struct dlpd_waitq *q = waitq_find(r, name, len, hash);

	if (!q) {
		q = malloc(sizeof(*q) + len);
		if (!q)
			return -ENOMEM;
		dlpd_list_init(&q->waiters);
		q->len = len;
		memcpy(q->name, name, len);
		if (dlpd_hmap_insert(&r->waitqs, &q->node, hash) < 0) {
			free(q);
			return -ENOMEM;
		}
	}
	w->q = q;
	dlpd_list_add_tail(&q->waiters, &w->q_link);
	dlpd_list_add_tail(&h->waiters, &w->peer_link);
	r->waiters++;
	h->nwaiters++;
	return 0;
}

struct dlpd_waiter *dlpd_waitq_first_match(struct dlpd_registry *r, const uint8_t *name, size_t len,
					   uint32_t uid)
{
	struct dlpd_waitq *q = waitq_find(r, name, len, dlpd_hash_bytes(name, len));

	if (!q)
		return NULL;
	for (struct dlpd_list *l = q->waiters.next; l != &q->waiters; l = l->next) {
		struct dlpd_waiter *w = dlpd_container_of(l, struct dlpd_waiter, q_link);

		if (!(w->flags & DLPC_WIRE_ATTACH_OWNER) || w->owner_uid == uid)
			return w;
	}
	return NULL;
}

void dlpd_waiter_unlink(struct dlpd_registry *r, struct dlpd_holdings *h, struct dlpd_waiter *w)
{
	struct dlpd_waitq *q = w->q;

	dlpd_assert(q != NULL); /* queued, not unlinked already */
	dlpd_list_del(&w->q_link);
	dlpd_list_del(&w->peer_link);
	r->waiters--;
	h->nwaiters--;
	if (dlpd_list_empty(&q->waiters)) {
		dlpd_hmap_remove(&r->waitqs, &q->node);
		free(q);
	}
	w->q = NULL;
}

struct dlpd_usage *dlpd_usage_find(const struct dlpd_registry *r, uid_t uid)
{
	uint64_t h = dlpd_hash_u64(uid);

	for (struct dlpd_hnode *n = dlpd_hmap_chain(&r->uids, h); n; n = n->next) {
		struct dlpd_usage *u = dlpd_container_of(n, struct dlpd_usage, node);

		if (u->uid == uid)
			return u;
	}
	return NULL;
}

struct dlpd_usage *dlpd_usage_get(struct dlpd_registry *r, uid_t uid)
{
	struct dlpd_usage *u = dlpd_usage_find(r, uid);

	if (u)
		return u;
	u = calloc(1, sizeof(*u));
	if (!u)
		return NULL;
	u->uid = uid;
	if (dlpd_hmap_insert(&r->uids, &u->node, dlpd_hash_u64(uid)) < 0) {
		free(u);
		return NULL;
	}
	return u;
}

void dlpd_usage_put(struct dlpd_registry *r, struct dlpd_usage *u)
{
	if (!u || u->storages || u->entries || u->connections || u->pinned_bytes || u->pinned_fds ||
	    u->memory || u->pending_bytes || u->closing || u->unread_fds || u->draining ||
	    u->lingering)
		return;
	dlpd_hmap_remove(&r->uids, &u->node);
	free(u);
}

void dlpd_entry_info(const struct dlpd_entry *e, Dlpackd__V1__EntryInfo *info)
{
	info->name = e->pub->name;
	info->generation = e->generation;
	info->device_type = e->st->device_type;
	info->device_id = e->st->device_id;
	info->flags = e->pub->flags;
	info->nbytes = e->st->size;
	info->refs = e->st->attach_refs;
	info->cached_refs = e->st->cached_refs;
	info->owner_uid = e->uid;
	info->owner_pid = e->pid;
	info->created_ns = e->created_ns;
	info->tensor_count = (uint32_t)e->pub->n_tensors;
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

	r->sorted_mods = 0;
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
