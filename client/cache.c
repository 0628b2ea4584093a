/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The cache of references (protocol 1.7). A host entry attached read-only is remembered by name
 * with its daemon reference, its storage fd, its tensor table and, while nobody uses them, a
 * shared read-only mapping and a copy-on-write one (emptied of written pages). When its last
 * tensor is released the entry stays, idle, for up to idle_ms; an attach of the same name
 * meanwhile is answered from it without a round trip.
 *
 * Why that is never stale: an attach that asks the daemon takes its reference with
 * DLPC_WIRE_ATTACH_CACHEABLE, and the daemon writes an INVALIDATE frame to this connection's socket
 * before it answers any replace or unpublish of the entry. An attach answered from here first
 * reads whatever the socket holds (dlpc__drain()), so it sees the invalidation of every change
 * that was answered before it began. If another thread is reading the socket (its call waits)
 * the drain cannot vouch for that, and the attach asks the daemon instead.
 *
 * Entries are found by name in a small hash table; idle ones also sit in an LRU list that the
 * bounds (entries, bytes) and the idle time evict from. An entry leaves the table when its name
 * moves on, when the connection is replaced or closed, or when it is evicted; one still in use
 * then lives until its last region lets go of it (dlpc__cache_put()).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "cache.h"
#include "core.h"
#include "region.h"
#include "table.h"
#include "util.h"

struct dlpc__centry {
	struct dlpc__centry *next;	/* in its bucket, or in cache.dead */
	struct dlpc__centry *prev_idle; /* in the idle list while idle */
	struct dlpc__centry *next_idle;
	uint32_t hash;
	bool linked; /* in the table: attaches may find it */
	bool idle;   /* in the idle list */
	unsigned users;
	int64_t idle_since; /* monotonic ms of its last release */
	uint64_t generation, ref_id, conn_seq;
	int fd;
	size_t len;
	void *map;     /* a shared read-only mapping nobody uses, or NULL */
	void *cow_map; /* a copy-on-write one, no private page left in it, or NULL */
	uint32_t owner_uid, entry_flags;
	int32_t owner_pid;
	bool single; /* one tensor, under the key "" (dlpc__table_single()) */
	uint8_t *table;
	size_t table_len;
	size_t name_len;
	char name[];
};

/* FNV-1a of @p len bytes at @p p. */
static uint32_t name_hash(const char *p, size_t len)
{
	uint32_t h = 2166136261u;

	for (size_t i = 0; i < len; i++)
		h = (h ^ (uint8_t)p[i]) * 16777619u;
	return h;
}

/* $@p env as a whole number >= 0 into *@p v, or @p def when unset. 0 or -EINVAL. */
static int env_u64(const char *env, uint64_t def, uint64_t *v)
{
	const char *s = getenv(env);
	char *end;
	unsigned long long n;

	*v = def;
	if (!s || !*s)
		return 0;
	errno = 0;
	n = strtoull(s, &end, 10);
	if (errno || *end || end == s || s[0] == '-')
		return dlpc__fail(-EINVAL, "%s='%s' is not a whole number", env, s);
	*v = n;
	return 0;
}

int dlpc__cache_init(dlpc_client *c, bool off)
{
	struct dlpc__cache *k = &c->cache;
	uint64_t idle;
	int r;

	r = env_u64(DLPC_CACHE_ENTRIES_ENV, DLPC_CACHE_ENTRIES_DEFAULT, &k->max_entries);
	if (r == 0)
		r = env_u64(DLPC_CACHE_BYTES_ENV, DLPC_CACHE_BYTES_DEFAULT, &k->max_bytes);
	if (r == 0)
		r = env_u64(DLPC_CACHE_IDLE_MS_ENV, DLPC_CACHE_IDLE_MS_DEFAULT, &idle);
	if (r < 0)
		return r;
	k->idle_ms = idle > INT32_MAX ? INT32_MAX : (int64_t)idle;
	k->on = !off && k->max_entries && k->max_bytes && k->idle_ms;
	/* received storages' mappings need nothing of the daemon */
	k->maps_on = !off && k->max_entries && k->max_bytes && k->idle_ms;
	return 0;
}

/* Unmap, close and release what @p e holds, and free it. No lock held. */
static void entry_free(dlpc_client *c, struct dlpc__centry *e)
{
	if (e->map)
		munmap(e->map, e->len);
	if (e->cow_map)
		munmap(e->cow_map, e->len);
	if (e->fd >= 0)
		close(e->fd);
	dlpc__release_ref(c, e->ref_id, e->conn_seq);
	free(e->table);
	free(e);
}

static void idle_unlink(struct dlpc__cache *k, struct dlpc__centry *e)
{
	if (e->prev_idle)
		e->prev_idle->next_idle = e->next_idle;
	else
		k->idle_head = e->next_idle;
	if (e->next_idle)
		e->next_idle->prev_idle = e->prev_idle;
	else
		k->idle_tail = e->prev_idle;
	e->prev_idle = e->next_idle = NULL;
	e->idle = false;
	k->nidle--;
	k->idle_bytes -= e->len;
}

static void table_unlink(struct dlpc__cache *k, struct dlpc__centry *e)
{
	struct dlpc__centry **pp = &k->table[e->hash % DLPC__CACHE_BUCKETS];

	while (*pp != e)
		pp = &(*pp)->next;
	*pp = e->next;
	e->next = NULL;
	e->linked = false;
}

/* Take @p e out of the table; if nobody uses it, onto the dead list. Under k->mu. */
static void forget(struct dlpc__cache *k, struct dlpc__centry *e)
{
	table_unlink(k, e);
	if (e->idle) {
		idle_unlink(k, e);
		e->next = k->dead;
		k->dead = e;
	}
}

static struct dlpc__centry *find(struct dlpc__cache *k, const char *name, size_t len, uint32_t hash)
{
	for (struct dlpc__centry *e = k->table[hash % DLPC__CACHE_BUCKETS]; e; e = e->next)
		if (e->hash == hash && e->name_len == len && memcmp(e->name, name, len) == 0)
			return e;
	return NULL;
}

uint64_t dlpc__cache_seq(dlpc_client *c)
{
	uint64_t v;

	pthread_mutex_lock(&c->cache.mu);
	v = c->cache.inval_seq;
	pthread_mutex_unlock(&c->cache.mu);
	return v;
}

struct dlpc__centry *dlpc__cache_get(dlpc_client *c, const char *name, bool owned,
				     uint32_t owner_uid, bool single, bool cow, void **map)
{
	struct dlpc__cache *k = &c->cache;
	size_t len = strlen(name);
	uint32_t hash = name_hash(name, len);
	struct dlpc__centry *e;
	bool was_idle = false;

	*map = NULL;
	pthread_mutex_lock(&k->mu);
	e = find(k, name, len, hash);
	/* another uid's entry, or a bundle for dlpc_attach(): the daemon says why not */
	if (e && ((owned && e->owner_uid != owner_uid) || (single && !e->single)))
		e = NULL;
	if (e) {
		was_idle = e->idle;
		if (e->idle)
			idle_unlink(k, e);
		e->users++;
		if (cow) {
			*map = e->cow_map;
			e->cow_map = NULL;
		} else {
			*map = e->map;
			e->map = NULL;
		}
	}
	pthread_mutex_unlock(&k->mu);
	if (was_idle)
		dlpc__mark_ref(c, e->ref_id, e->conn_seq, false);
	return e;
}

void dlpc__cache_fill(const struct dlpc__centry *e, struct dlpc__region *m, int *fd,
		      const uint8_t **table, size_t *table_len)
{
	m->len = e->len;
	m->ref_id = e->ref_id;
	m->conn_seq = e->conn_seq;
	m->owner_uid = e->owner_uid;
	m->owner_pid = e->owner_pid;
	m->entry_flags = e->entry_flags;
	m->generation = e->generation;
	*fd = e->fd;
	*table = e->table;
	*table_len = e->table_len;
}

struct dlpc__centry *dlpc__cache_insert(dlpc_client *c, uint64_t seq, uint64_t conn_seq,
					const char *name, const struct dlpc__region *m, int fd,
					const uint8_t *table, size_t table_len)
{
	struct dlpc__cache *k = &c->cache;
	size_t len = strlen(name);
	uint32_t hash = name_hash(name, len);
	struct dlpc__centry *e = malloc(sizeof(*e) + len + 1);
	bool ok;

	if (!e)
		return NULL;
	memset(e, 0, sizeof(*e));
	e->table = malloc(table_len ? table_len : 1);
	if (!e->table) {
		free(e);
		return NULL;
	}
	memcpy(e->table, table, table_len);
	e->table_len = table_len;
	e->single = dlpc__table_single(table, table_len);
	memcpy(e->name, name, len + 1);
	e->name_len = len;
	e->hash = hash;
	e->users = 1;
	e->fd = fd;
	e->len = m->len;
	e->generation = m->generation;
	e->ref_id = m->ref_id;
	e->conn_seq = conn_seq;
	e->owner_uid = m->owner_uid;
	e->owner_pid = m->owner_pid;
	e->entry_flags = m->entry_flags;
	pthread_mutex_lock(&k->mu);
	/* An INVALIDATE read since the request went out may have been this entry's, read before
	 * this thread got here: then it must not be cached. Nor may a reference of a connection
	 * replaced meanwhile. */
	ok = k->on && k->inval_seq == seq && conn_seq == c->conn_seq && !find(k, name, len, hash);
	if (ok) {
		struct dlpc__centry **b = &k->table[hash % DLPC__CACHE_BUCKETS];

		e->next = *b;
		*b = e;
		e->linked = true;
	}
	pthread_mutex_unlock(&k->mu);
	if (!ok) {
		free(e->table);
		free(e);
		return NULL;
	}
	return e;
}

void dlpc__cache_put(dlpc_client *c, struct dlpc__centry *e, void *base, int kind)
{
	size_t len = e->len;
	struct dlpc__cache *k = &c->cache;
	struct dlpc__centry *dead = NULL, *v;
	uint64_t ref_id = e->ref_id, conn_seq = e->conn_seq;
	bool idle = false;
	int64_t now = 0;

	/* a forked child: the entry is its parent's, and so is the lock */
	if (!dlpc__ours(c)) {
		if (base)
			munmap(base, len);
		return;
	}
	/*
	 * A copy-on-write mapping may hold pages its user wrote: dlpc__cow_clean() drops them
	 * (for a private file mapping the next access reads the file again), so the next
	 * attacher sees the storage's bytes, as from a fresh mapping.
	 */
	if (base && kind == DLPC__MAP_COW && (!e->linked || dlpc__cow_clean(base, len) < 0))
		kind = DLPC__MAP_OTHER;
	now = dlpc__mono_ms();
	pthread_mutex_lock(&k->mu);
	if (base && kind == DLPC__MAP_SHARED_RO && e->linked && !e->map) {
		e->map = base;
		base = NULL;
	} else if (base && kind == DLPC__MAP_COW && e->linked && !e->cow_map) {
		e->cow_map = base;
		base = NULL;
	}
	if (--e->users == 0) {
		if (!e->linked) {
			dead = e;
		} else {
			idle = true;
			e->idle = true;
			e->idle_since = now;
			e->prev_idle = NULL;
			e->next_idle = k->idle_head;
			if (k->idle_head)
				k->idle_head->prev_idle = e;
			else
				k->idle_tail = e;
			k->idle_head = e;
			k->nidle++;
			k->idle_bytes += e->len;
			/* the bounds: least recently used go first (this one too, if it is
			 * larger than the whole budget) */
			while (k->idle_tail &&
			       (k->nidle > k->max_entries || k->idle_bytes > k->max_bytes)) {
				v = k->idle_tail;
				if (v == e)
					idle = false;
				forget(k, v);
			}
		}
	}
	if (idle)
		now = e->idle_since;
	pthread_mutex_unlock(&k->mu);
	if (base)
		munmap(base, len);
	/* e may be evicted and freed by another thread from here: use the copies */
	if (idle) {
		dlpc__mark_ref(c, ref_id, conn_seq, true);
		dlpc__sweep_at(now + k->idle_ms);
	}
	if (dead)
		entry_free(c, dead);
	dlpc__cache_reap(c);
}

int dlpc__cache_invalidate(dlpc_client *c, const struct dlpc__frame *f)
{
	Dlpackd__V1__Invalidate *m = dlpackd__v1__invalidate__unpack(NULL, f->hdr.len, f->payload);
	struct dlpc__cache *k = &c->cache;
	struct dlpc__centry *e;

	if (!m)
		return -EPROTO;
	pthread_mutex_lock(&k->mu);
	k->inval_seq++;
	e = find(k, (const char *)m->name.data, m->name.len,
		 name_hash((const char *)m->name.data, m->name.len));
	/* a newer generation cached since (its own reply came after this frame) stays */
	if (e && e->generation <= m->generation)
		forget(k, e);
	pthread_mutex_unlock(&k->mu);
	dlpackd__v1__invalidate__free_unpacked(m, NULL);
	return 0;
}

void dlpc__cache_reap(dlpc_client *c)
{
	struct dlpc__centry *e;

	pthread_mutex_lock(&c->cache.mu);
	e = c->cache.dead;
	c->cache.dead = NULL;
	pthread_mutex_unlock(&c->cache.mu);
	while (e) {
		struct dlpc__centry *next = e->next;

		entry_free(c, e);
		e = next;
	}
}

void dlpc__cache_drop(dlpc_client *c)
{
	struct dlpc__cache *k = &c->cache;

	pthread_mutex_lock(&k->mu);
	for (size_t i = 0; i < DLPC__CACHE_BUCKETS; i++)
		while (k->table[i])
			forget(k, k->table[i]);
	pthread_mutex_unlock(&k->mu);
}

void dlpc__cache_off(dlpc_client *c)
{
	pthread_mutex_lock(&c->cache.mu);
	c->cache.on = false;
	pthread_mutex_unlock(&c->cache.mu);
	dlpc__cache_drop(c);
	dlpc__cache_reap(c);
	dlpc__maps_clear(c);
}

int64_t dlpc__cache_sweep(dlpc_client *c)
{
	struct dlpc__cache *k = &c->cache;
	int64_t now = dlpc__mono_ms(), next = dlpc__maps_sweep(c, false);

	pthread_mutex_lock(&k->mu);
	while (k->idle_tail && now - k->idle_tail->idle_since >= k->idle_ms)
		forget(k, k->idle_tail);
	if (k->idle_tail && (!next || k->idle_tail->idle_since + k->idle_ms < next))
		next = k->idle_tail->idle_since + k->idle_ms;
	pthread_mutex_unlock(&k->mu);
	dlpc__cache_reap(c);
	return next;
}

void dlpc__cache_clear(dlpc_client *c)
{
	/* nothing uses an entry any more: every region held a reference on the client */
	dlpc__cache_drop(c);
	dlpc__cache_reap(c);
	dlpc__maps_clear(c);
	pthread_mutex_destroy(&c->cache.mu);
}

void dlpc__cache_lock(dlpc_client *c, bool lock)
{
	if (lock)
		pthread_mutex_lock(&c->cache.mu);
	else
		pthread_mutex_unlock(&c->cache.mu);
}

void dlpc__cache_forked(dlpc_client *c)
{
	struct dlpc__cache *k = &c->cache;

	/* The parent's fds and idle mappings would keep its storages alive here: let go of them.
	 * The entries themselves stay (regions of the parent's may point at them) but nobody
	 * finds them: this client is unusable in the child (dlpc__check()). */
	for (size_t i = 0; i < DLPC__CACHE_BUCKETS; i++)
		for (struct dlpc__centry *e = k->table[i]; e; e = e->next) {
			if (e->map)
				munmap(e->map, e->len);
			if (e->cow_map)
				munmap(e->cow_map, e->len);
			e->map = e->cow_map = NULL;
			dlpc__close(e->fd);
			e->fd = -1;
		}
	k->on = false;
	pthread_mutex_init(&k->mu, NULL);
	dlpc__maps_clear(c);
}

static void cache_init_lock(dlpc_client *c)
{
	pthread_mutex_init(&c->cache.mu, NULL);
}

/* Connected anew: the cached references died with the old connection. Under c->wmu and c->mu. */
static void cache_reset_locked(dlpc_client *c)
{
	dlpc__cache_drop(c);
	pthread_mutex_lock(&c->cache.mu);
	c->cache.on = !c->no_cache && !c->closed && c->cache.max_entries && c->cache.max_bytes &&
		      c->cache.idle_ms;
	pthread_mutex_unlock(&c->cache.mu);
}

static void cache_fork(dlpc_client *c, int phase)
{
	if (phase == 2)
		dlpc__cache_forked(c);
	else
		dlpc__cache_lock(c, phase == 0);
}

/* Idle entries: the library's thread reads the socket so that their invalidations free their
 * storage at once. */
static bool cache_wants_reading(dlpc_client *c)
{
	bool idle;

	pthread_mutex_lock(&c->cache.mu);
	idle = c->cache.nidle > 0;
	pthread_mutex_unlock(&c->cache.mu);
	return idle;
}

static int take_invalidate(dlpc_client *c, const struct dlpc__frame *f)
{
	return dlpc__cache_invalidate(c, f) < 0 ? -EPROTO : 1;
}

void dlpc__cache_register(void)
{
	static const struct dlpc__hooks hooks = {
		.init = cache_init_lock,
		.reset_locked = cache_reset_locked,
		.reset = dlpc__cache_reap,
		.close = dlpc__cache_off,
		.free = dlpc__cache_clear,
		.fork = cache_fork,
		.wants_reading = cache_wants_reading,
		.sweep = dlpc__cache_sweep,
	};
	static const struct dlpc__notice invalidate = {
		.type = DLPC_MSG_INVALIDATE,
		.take = take_invalidate,
		.after = dlpc__cache_reap,
	};

	dlpc__hooks_add(&hooks);
	dlpc__notice_add(&invalidate);
}
