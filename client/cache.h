/* SPDX-License-Identifier: Apache-2.0 */
/* libdlpc: the cache of references by name (cache.c) and of received storages' mappings
 * (maps.c). */
#ifndef DLPC_CLIENT_CACHE_H
#define DLPC_CLIENT_CACHE_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <dlpc/dlpc.h>

struct dlpc__frame;
struct dlpc__mkey;
struct dlpc__region;

struct dlpc__centry;
struct dlpc__mentry;

/* Buckets of a client's cache table (cache.c), by name. */
#define DLPC__CACHE_BUCKETS 64

/*
 * A client's cache of references by name (cache.c): every cacheable attach of a host entry,
 * in use or idle since its last release, until its name moves on (INVALIDATE), the bounds or
 * the idle time evict it, or the connection goes. Its lock is a leaf: nothing else is locked
 * under it, and it is taken under c->mu (INVALIDATE) and under wmu and mu (reconnect).
 */
struct dlpc__cache {
	pthread_mutex_t mu;
	bool on; /* no DLPC_CONNECT_NO_CACHE, no bound set to 0: set at connect */
	uint64_t max_entries, max_bytes;
	int64_t idle_ms;
	struct dlpc__centry *table[DLPC__CACHE_BUCKETS];
	struct dlpc__centry *idle_head, *idle_tail; /* idle entries, most recently used first */
	uint64_t nidle, idle_bytes;
	uint64_t inval_seq; /* INVALIDATE frames received: an attach that saw one may not cache */
	struct dlpc__centry *dead; /* unlinked with nobody using them, to be freed unlocked */
	/* received storages' idle mappings (maps.c), under the same lock and bounds */
	bool maps_on; /* no DLPC_CONNECT_NO_CACHE, no bound 0, not closed: set at connect */
	struct dlpc__mentry *maps[DLPC__CACHE_BUCKETS];
	struct dlpc__mentry *maps_head, *maps_tail; /* every storage seen, most recent first */
	uint64_t maps_n, maps_nidle, maps_idle_bytes;
};

/* ---- cache.c: references kept after their last release ---- */
/* What an attached host mapping is, for the cache to keep it for the next attach. */
#define DLPC__MAP_OTHER 0     /* not to be handed out again: unmapped */
#define DLPC__MAP_SHARED_RO 1 /* MAP_SHARED, PROT_READ */
#define DLPC__MAP_COW 2	      /* MAP_PRIVATE, PROT_READ|PROT_WRITE */
/* Read the bounds ($DLPC_CACHE_*) and turn @p c's cache on unless @p off. 0, or -EINVAL for a
 * value that is not a whole number. */
int dlpc__cache_init(dlpc_client *c, bool off);
/* Free what the cache holds (at client_free(): nothing uses it any more). */
void dlpc__cache_clear(dlpc_client *c);
/* Number of INVALIDATE frames @p c has received: an attach notes it before its request and
 * caches the reference it gets only if it has not changed meanwhile. */
uint64_t dlpc__cache_seq(dlpc_client *c);
/* An entry answering an attach of @p name (with @p owner_uid, if @p owned; one tensor, if
 * @p single) from the cache, in use once more; NULL: ask the daemon. *@p map receives the idle
 * mapping of the kind asked for (a copy-on-write one if @p cow), if it kept one. */
struct dlpc__centry *dlpc__cache_get(dlpc_client *c, const char *name, bool owned,
				     uint32_t owner_uid, bool single, bool cow, void **map);
/* What a region made from entry @p e needs of it. */
void dlpc__cache_fill(const struct dlpc__centry *e, struct dlpc__region *m, int *fd,
		      const uint8_t **table, size_t *table_len);
/*
 * Cache the reference of a reply just received (@p seq: dlpc__cache_seq() before its request),
 * taking over @p fd; the entry is in use once. NULL (nothing taken) when it cannot be: the name
 * is cached already, an invalidation came meanwhile, another connection, no memory.
 */
struct dlpc__centry *dlpc__cache_insert(dlpc_client *c, uint64_t seq, uint64_t conn_seq,
					const char *name, const struct dlpc__region *m, int fd,
					const uint8_t *table, size_t table_len);
/* One use of @p e ends; its mapping @p base (NULL: none) of DLPC__MAP_* @p kind goes back to
 * it if it has none of that kind (a copy-on-write one emptied of its private pages first), or
 * is unmapped. The last use makes the entry idle, or frees it if invalidated. */
void dlpc__cache_put(dlpc_client *c, struct dlpc__centry *e, void *base, int kind);
/* INVALIDATE frame @p f: forget the entry it names (under c->mu). 0 or -EPROTO. */
int dlpc__cache_invalidate(dlpc_client *c, const struct dlpc__frame *f);
/* Free the entries invalidated or dropped meanwhile (with no lock of @p c held). */
void dlpc__cache_reap(dlpc_client *c);
/* Forget every entry (connection replaced, dlpc_close()); free them with dlpc__cache_reap(). */
void dlpc__cache_drop(dlpc_client *c);
/* Turn the cache off for good and free what it holds (dlpc_close()). No lock held. */
void dlpc__cache_off(dlpc_client *c);
/* Evict what has been idle too long; the monotonic ms when the next entry expires, or 0. */
int64_t dlpc__cache_sweep(dlpc_client *c);
/* In a forked child: close the parent's cached fds and mappings, start the lock afresh. */
void dlpc__cache_forked(dlpc_client *c);
/* For fork: hold @p c's cache lock (prepare) or let go of it (parent). */
void dlpc__cache_lock(dlpc_client *c, bool lock);
/* ---- maps.c: idle mappings of storages that channels bring again ---- */
/* The library's internal attach flags: they ride with the public DLPC_ATTACH_* flags between
 * its own functions, on bits no public flag has (attach.c checks), and are never sent.
 * Of channel receives: map a message's storage through maps.c. */
#define DLPC__ATTACH_KEEP_MAP (1u << 31)

/* Internal attach flag: the storage passed dlpc__storage_check() read-only (direct channels). */
#define DLPC__ATTACH_SEALED (1u << 30)

/* A mapping of DLPC__MAP_* @p kind (SHARED_RO or COW) of @p len bytes of storage @p fd for a
 * message: an idle one kept from the same storage's earlier message, or NULL (map it). Fills
 * *@p key (from @p known, or fstat() when NULL) for dlpc__maps_put() and sets *@p keyed, unless
 * the storage cannot be told (fstat() failed, no memory) or the cache is off; remembers that
 * the storage passed dlpc__storage_check() read-only if @p sealed. */
void *dlpc__maps_take(dlpc_client *c, int fd, size_t len, uint8_t kind, bool sealed,
		      const struct dlpc__mkey *known, struct dlpc__mkey *key, bool *keyed);
/* Did storage @p fd, for @p len bytes, pass dlpc__storage_check() read-only in an earlier
 * message? Such a storage cannot have changed since: its seals are final, its size sealed and
 * no page of a write-sealed memfd can be taken away. Fills *@p key and sets *@p keyed when it
 * could tell the storage (for dlpc__maps_take()'s @p known: no second fstat()). */
bool dlpc__maps_sealed(dlpc_client *c, int fd, size_t len, struct dlpc__mkey *key, bool *keyed);
/* Empty copy-on-write mapping @p base of @p len bytes of the pages its user wrote, so that it
 * shows the storage's bytes as a fresh mapping would: the written pages found (PAGEMAP_SCAN),
 * or all (MADV_DONTNEED) where the kernel cannot tell. 0, or -1 with errno set. */
int dlpc__cow_clean(void *base, size_t len);
/* The last use of region @p r's mapping ends: keep it, idle, if its storage came more than
 * once (true), else leave it to the caller to unmap (false). */
bool dlpc__maps_put(dlpc_client *c, const struct dlpc__region *r);
/* Unmap the idle mappings: all (@p all), or those idle past the bounds; the monotonic ms when
 * the next one expires, or 0. Under no lock. */
int64_t dlpc__maps_sweep(dlpc_client *c, bool all);
/* Turn the cache of mappings off for good, forget every storage and unmap the idle mappings
 * (dlpc_close(), client_free(); in a forked child, the parent's, once the cache's lock is
 * started afresh). */
void dlpc__maps_clear(dlpc_client *c);
/* Close this process's /proc/self/pagemap, opened by dlpc__cow_clean() (its last client went). */
void dlpc__maps_pagemap_close(void);
/* fork(): hold the lock of this process's pagemap fd (@p phase 0, prepare), let go of it (1,
 * parent), or close the parent's fd and start afresh (2, child). */
void dlpc__maps_atfork(int phase);

/* Register the cache's and the mappings' tables on the connection core (client.c, once). */
void dlpc__cache_register(void);
void dlpc__maps_register(void);

#endif
