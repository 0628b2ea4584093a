/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Idle mappings of the storages that channels bring again. A sender that recycles its buffers
 * (a pool, or one dlpc_alloc() buffer sent again and again) hands the receiver the same memfd
 * message after message; mapping it anew each time (mmap, the first touch's faults, munmap) is
 * most of what a hand-off costs beyond passing the fd. So when the last tensor of a received
 * message is released, its mapping is kept, idle, if its storage has come more than once, and
 * the next message of that storage is mapped by handing it out again: one fstat() instead of
 * a mmap().
 *
 * A storage is told by its file (device, inode), its change time and the length mapped
 * (struct dlpc__mkey); the fd of each message is still passed and closed. A shared read-only
 * mapping shows the storage's bytes as they are now, as a fresh one would; a copy-on-write one
 * is first emptied of the pages its user wrote (dlpc__cow_clean()). Mappings of any other kind
 * (writable, or a read-only private one) are never kept.
 *
 * What it costs: an idle mapping keeps its storage's memory alive after the sender let go of
 * it, for up to the cache's idle time. That is why a storage seen once (a fresh buffer per
 * message) is never kept, and why the bounds of the cache of references apply here too:
 * $DLPC_CACHE_ENTRIES storages remembered (kept or only seen), $DLPC_CACHE_BYTES bytes kept,
 * $DLPC_CACHE_IDLE_MS of idleness. DLPC_CONNECT_NO_CACHE, or DLPC_ATTACH_NO_CACHE on a
 * receive, keeps nothing. Under the cache's lock (a leaf); munmap() and madvise() run with it
 * let go.
 */
#include <fcntl.h>
#include <linux/fs.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache.h"
#include "core.h"
#include "region.h"

/* PAGEMAP_SCAN (Linux 6.7), for system headers older than that: the ioctl on /proc/PID/pagemap
 * that reports which pages of a range are present, swapped, file-backed, by page-table walk. */
#ifndef PAGEMAP_SCAN
struct page_region {
	__u64 start, end, categories;
};

struct pm_scan_arg {
	__u64 size, flags, start, end, walk_end, vec, vec_len, max_pages;
	__u64 category_inverted, category_mask, category_anyof_mask, return_mask;
};

#define PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#define PAGE_IS_FILE (1 << 2)
#define PAGE_IS_PRESENT (1 << 3)
#define PAGE_IS_SWAPPED (1 << 4)
#endif

/* Ranges of written pages one scan reports; a mapping written in more places than that is
 * emptied whole. */
#define COW_SCAN_RANGES 16

/* This process's /proc/self/pagemap, opened at the first scan (by pagemap_pid) and closed with
 * the process's last client (dlpc__maps_pagemap_close()); pagemap_off: it cannot be scanned
 * (no /proc, a kernel before 6.7). A forked child closes its parent's at the fork
 * (dlpc__maps_atfork()) and opens its own. */
static pthread_mutex_t pagemap_mu = PTHREAD_MUTEX_INITIALIZER;
static int pagemap_fd = -1;
static bool pagemap_off;
static pid_t pagemap_pid;

/* The fd to scan with, or -1. */
static int pagemap(void)
{
	pid_t pid = getpid();
	int fd;

	pthread_mutex_lock(&pagemap_mu);
	if (pagemap_pid != pid) {
		fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
		/* out of fds or memory: not this time; no /proc, no right to it: not at all */
		if (fd >= 0 || (errno != EMFILE && errno != ENFILE && errno != ENOMEM)) {
			pagemap_pid = pid;
			pagemap_fd = fd;
			pagemap_off = fd < 0;
		}
	}
	fd = pagemap_off ? -1 : pagemap_fd;
	pthread_mutex_unlock(&pagemap_mu);
	return fd;
}

void dlpc__maps_pagemap_close(void)
{
	pthread_mutex_lock(&pagemap_mu);
	if (pagemap_fd >= 0)
		close(pagemap_fd);
	pagemap_fd = -1;
	pagemap_off = false;
	pagemap_pid = 0;
	pthread_mutex_unlock(&pagemap_mu);
}

void dlpc__maps_atfork(int phase)
{
	if (phase == 0) {
		pthread_mutex_lock(&pagemap_mu);
	} else if (phase == 1) {
		pthread_mutex_unlock(&pagemap_mu);
	} else {
		/* the parent's: it would read the parent's page tables */
		if (pagemap_fd >= 0)
			close(pagemap_fd);
		pagemap_fd = -1;
		pagemap_off = false;
		pagemap_pid = 0;
		pthread_mutex_init(&pagemap_mu, NULL);
	}
}

/* Stop scanning in this process: the kernel does not have PAGEMAP_SCAN. The fd stays open
 * (another thread may be using it) until the last client goes. */
static void pagemap_unsupported(void)
{
	pthread_mutex_lock(&pagemap_mu);
	if (pagemap_pid == getpid())
		pagemap_off = true;
	pthread_mutex_unlock(&pagemap_mu);
}

int dlpc__cow_clean(void *base, size_t len)
{
	long page = sysconf(_SC_PAGESIZE);
	uint64_t start = (uint64_t)(uintptr_t)base;
	uint64_t end = start + ((len + (uint64_t)page - 1) & ~((uint64_t)page - 1));
	struct page_region v[COW_SCAN_RANGES];
	struct pm_scan_arg a;
	int fd = pagemap(), n = -1;

	/*
	 * The pages its user wrote are its own (anonymous: present or swapped out, not the
	 * file's). Most users write none: then nothing is done, and the pages read stay mapped
	 * for the next user. Else only those ranges are dropped.
	 */
	if (fd >= 0) {
		/* zeroed for tools that cannot see what the ioctl writes (valgrind) */
		memset(v, 0, sizeof(v));
		memset(&a, 0, sizeof(a));
		a.size = sizeof(a);
		a.start = start;
		a.end = end;
		a.vec = (uint64_t)(uintptr_t)v;
		a.vec_len = COW_SCAN_RANGES;
		a.category_inverted = PAGE_IS_FILE;
		a.category_mask = PAGE_IS_FILE;
		a.category_anyof_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED;
		a.return_mask = PAGE_IS_PRESENT | PAGE_IS_SWAPPED;
		n = ioctl(fd, PAGEMAP_SCAN, &a);
		if (n < 0 && (errno == ENOTTY || errno == EINVAL))
			pagemap_unsupported();
	}
	/* a scan that did not cover the whole range (more ranges than fit) empties it all */
	if (n < 0 || (n == COW_SCAN_RANGES && a.walk_end < end))
		return madvise(base, len, MADV_DONTNEED);
	for (int i = 0; i < n; i++)
		if (madvise((void *)(uintptr_t)v[i].start, v[i].end - v[i].start, MADV_DONTNEED) <
		    0)
			return -1;
	return 0;
}

struct dlpc__mentry {
	struct dlpc__mentry *next;	    /* in its bucket, or on a list to be freed */
	struct dlpc__mentry *newer, *older; /* in the list of storages seen */
	struct dlpc__mkey key;
	uint32_t hash;
	uint32_t seen;	    /* messages of this storage mapped (saturates) */
	bool sealed;	    /* passed dlpc__storage_check() read-only in this process */
	void *map;	    /* the idle mapping kept, or NULL */
	uint8_t map_kind;   /* DLPC__MAP_SHARED_RO or DLPC__MAP_COW */
	int64_t idle_since; /* monotonic ms its mapping was kept */
};

static uint32_t key_hash(const struct dlpc__mkey *k)
{
	uint64_t h =
		(k->ino ^ (k->dev << 40) ^ ((uint64_t)k->ctime_ns << 20)) * 0x9e3779b97f4a7c15ull;

	return (uint32_t)(h >> 32);
}

static bool key_eq(const struct dlpc__mkey *a, const struct dlpc__mkey *b)
{
	return a->dev == b->dev && a->ino == b->ino && a->len == b->len &&
	       a->ctime_s == b->ctime_s && a->ctime_ns == b->ctime_ns;
}

static struct dlpc__mentry *find(const struct dlpc__cache *k, const struct dlpc__mkey *key,
				 uint32_t hash)
{
	for (struct dlpc__mentry *e = k->maps[hash % DLPC__CACHE_BUCKETS]; e; e = e->next)
		if (e->hash == hash && key_eq(&e->key, key))
			return e;
	return NULL;
}

static void list_unlink(struct dlpc__cache *k, struct dlpc__mentry *e)
{
	if (e->newer)
		e->newer->older = e->older;
	else
		k->maps_head = e->older;
	if (e->older)
		e->older->newer = e->newer;
	else
		k->maps_tail = e->newer;
	e->newer = e->older = NULL;
}

static void list_push(struct dlpc__cache *k, struct dlpc__mentry *e)
{
	e->newer = NULL;
	e->older = k->maps_head;
	if (k->maps_head)
		k->maps_head->newer = e;
	else
		k->maps_tail = e;
	k->maps_head = e;
}

/* Forget @p e: out of the table and the list, onto *@p dead to be freed unlocked. */
static void evict(struct dlpc__cache *k, struct dlpc__mentry *e, struct dlpc__mentry **dead)
{
	struct dlpc__mentry **pp = &k->maps[e->hash % DLPC__CACHE_BUCKETS];

	while (*pp != e)
		pp = &(*pp)->next;
	*pp = e->next;
	list_unlink(k, e);
	k->maps_n--;
	if (e->map) {
		k->maps_nidle--;
		k->maps_idle_bytes -= e->key.len;
	}
	e->next = *dead;
	*dead = e;
}

static void free_dead(struct dlpc__mentry *e)
{
	while (e) {
		struct dlpc__mentry *next = e->next;

		if (e->map)
			munmap(e->map, e->key.len);
		free(e);
		e = next;
	}
}

/* The key of @p len bytes of storage @p fd, if the cache is on: 0, or -1. */
static int key_of(const struct dlpc__cache *k, int fd, size_t len, struct dlpc__mkey *key)
{
	struct stat st;

	if (!__atomic_load_n(&k->maps_on, __ATOMIC_RELAXED) || fstat(fd, &st) < 0)
		return -1;
	key->dev = (uint64_t)st.st_dev;
	key->ino = (uint64_t)st.st_ino;
	key->len = (uint64_t)len;
	key->ctime_s = (int64_t)st.st_ctim.tv_sec;
	key->ctime_ns = (int64_t)st.st_ctim.tv_nsec;
	return 0;
}

bool dlpc__maps_sealed(dlpc_client *c, int fd, size_t len, struct dlpc__mkey *key, bool *keyed)
{
	struct dlpc__cache *k = &c->cache;
	struct dlpc__mentry *e;
	bool sealed;
	int seals = fcntl(fd, F_GET_SEALS);

	/* F_GET_SEALS first, as dlpc__storage_check() does: it answers from the inode, for shmem
	 * and hugetlbfs alone, so that fstat() below never calls into a hostile sender's
	 * filesystem (a FUSE server that never answers would block the receive) */
	*keyed = false;
	if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL)) !=
				 (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL))
		return false;
	if (key_of(k, fd, len, key) < 0)
		return false;
	*keyed = true;
	pthread_mutex_lock(&k->mu);
	e = find(k, key, key_hash(key));
	sealed = e && e->sealed;
	pthread_mutex_unlock(&k->mu);
	return sealed;
}

void *dlpc__maps_take(dlpc_client *c, int fd, size_t len, uint8_t kind, bool sealed,
		      const struct dlpc__mkey *known, struct dlpc__mkey *key, bool *keyed)
{
	struct dlpc__cache *k = &c->cache;
	struct dlpc__mentry *e, *fresh = NULL, *dead = NULL;
	void *map = NULL;
	uint32_t hash;

	*keyed = false;
	if (known && __atomic_load_n(&k->maps_on, __ATOMIC_RELAXED))
		*key = *known;
	else if (known || key_of(k, fd, len, key) < 0)
		return NULL;
	hash = key_hash(key);
	pthread_mutex_lock(&k->mu);
	e = find(k, key, hash);
	/* a storage not seen yet: its entry is made with the lock let go */
	if (!e && k->maps_on) {
		pthread_mutex_unlock(&k->mu);
		fresh = calloc(1, sizeof(*fresh));
		pthread_mutex_lock(&k->mu);
		e = find(k, key, hash);
	}
	if (!k->maps_on) {
		e = NULL;
		goto out;
	}
	if (e) {
		if (e->seen < UINT32_MAX)
			e->seen++;
		/* a mapping of another kind stays for a message that wants it */
		if (e->map && e->map_kind == kind) {
			map = e->map;
			e->map = NULL;
			k->maps_nidle--;
			k->maps_idle_bytes -= len;
		}
		list_unlink(k, e);
		list_push(k, e);
	} else if (fresh) {
		e = fresh;
		fresh = NULL;
		e->key = *key;
		e->hash = hash;
		e->seen = 1;
		e->next = k->maps[hash % DLPC__CACHE_BUCKETS];
		k->maps[hash % DLPC__CACHE_BUCKETS] = e;
		list_push(k, e);
		/* the oldest storage seen goes, with its mapping if it kept one */
		if (++k->maps_n > k->max_entries)
			evict(k, k->maps_tail, &dead);
	}
	if (e) {
		e->sealed = e->sealed || sealed;
		*keyed = true;
	}
out:
	pthread_mutex_unlock(&k->mu);
	free(fresh);
	free_dead(dead);
	return map;
}

/* May @p r's mapping be kept? Under the lock: its storage's entry, or NULL. */
static struct dlpc__mentry *keeper(struct dlpc__cache *k, const struct dlpc__region *r)
{
	struct dlpc__mentry *e;

	if (!k->maps_on || r->len > k->max_bytes)
		return NULL;
	e = find(k, &r->key, key_hash(&r->key));
	return e && e->seen >= 2 && !e->map ? e : NULL;
}

bool dlpc__maps_put(dlpc_client *c, const struct dlpc__region *r)
{
	struct dlpc__cache *k = &c->cache;
	struct dlpc__mentry *e, *dead = NULL;
	int64_t now;
	bool cow = r->map_kind == DLPC__MAP_COW;

	/* a forked child: the parent's mapping, and the parent's lock */
	if (!r->keyed || (r->map_kind != DLPC__MAP_SHARED_RO && !cow) || !dlpc__ours(c))
		return false;
	pthread_mutex_lock(&k->mu);
	e = keeper(k, r);
	pthread_mutex_unlock(&k->mu);
	if (!e)
		return false;
	/* the pages its user wrote go (the next access reads the storage again), with the lock
	 * let go: a large tensor written all over takes a while */
	if (cow && dlpc__cow_clean(r->base, r->len) < 0)
		return false;
	now = dlpc__mono_ms();
	pthread_mutex_lock(&k->mu);
	/* looked up again: it may have gone meanwhile */
	e = keeper(k, r);
	if (e) {
		e->map = r->base;
		e->map_kind = r->map_kind;
		e->idle_since = now;
		list_unlink(k, e);
		list_push(k, e);
		k->maps_nidle++;
		k->maps_idle_bytes += r->len;
		/* the bytes bound: the mappings of the storages used least recently go first (not
		 * this one: its storage is the most recent, and it fits) */
		for (struct dlpc__mentry *v = k->maps_tail, *newer;
		     v && k->maps_idle_bytes > k->max_bytes; v = newer) {
			newer = v->newer;
			if (v->map)
				evict(k, v, &dead);
		}
	}
	pthread_mutex_unlock(&k->mu);
	free_dead(dead);
	/* with no library thread to sweep by time (it cannot start), each mapping kept sweeps
	 * those idle too long, so they last no longer than the traffic that made them */
	if (e && !dlpc__sweep_at(now + k->idle_ms))
		dlpc__maps_sweep(c, false);
	return e != NULL;
}

int64_t dlpc__maps_sweep(dlpc_client *c, bool all)
{
	struct dlpc__cache *k = &c->cache;
	struct dlpc__mentry *dead = NULL;
	int64_t now = dlpc__mono_ms(), next = 0;

	pthread_mutex_lock(&k->mu);
	/* the whole list (at most $DLPC_CACHE_ENTRIES): the kept mappings are not in the order
	 * they were kept (a message that wants another kind moves its storage up with its idle
	 * mapping), so the first young one does not end the sweep */
	for (struct dlpc__mentry *v = k->maps_tail, *newer; v; v = newer) {
		newer = v->newer;
		if (all || (v->map && now - v->idle_since >= k->idle_ms))
			evict(k, v, &dead);
		else if (v->map && (!next || v->idle_since + k->idle_ms < next))
			next = v->idle_since + k->idle_ms;
	}
	pthread_mutex_unlock(&k->mu);
	free_dead(dead);
	return next;
}

void dlpc__maps_clear(dlpc_client *c)
{
	pthread_mutex_lock(&c->cache.mu);
	__atomic_store_n(&c->cache.maps_on, false, __ATOMIC_RELAXED);
	pthread_mutex_unlock(&c->cache.mu);
	dlpc__maps_sweep(c, true);
}

void dlpc__maps_register(void)
{
	static const struct dlpc__hooks hooks = {
		.atfork = dlpc__maps_atfork,
		.last_client = dlpc__maps_pagemap_close,
	};

	dlpc__hooks_add(&hooks);
}
