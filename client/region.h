/* SPDX-License-Identifier: Apache-2.0 */
/* libdlpc: regions (the mappings its tensors point into) and their views (region.c, view.c),
 * and the memfds behind them. */
#ifndef DLPC_CLIENT_REGION_H
#define DLPC_CLIENT_REGION_H

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include <dlpc/dlpc.h>

#include "limits.h"

struct dlpc__centry;
struct dlpc__gpu_map;

/*
 * A mapping of shared memory that views (the tensors libdlpc hands out) point into. Refcounted
 * by its views (and transiently by a bundle). The last unref unmaps it, then closes @p fd
 * (allocated memory) or sends RELEASE of @p ref_id through @p client (attached memory).
 */
/* A storage's identity for maps.c: the file (device, inode) and its change time (an inode
 * number is reused only by a later file, made at a later time), with the size mapped. */
struct dlpc__mkey {
	uint64_t dev, ino, len;
	int64_t ctime_s, ctime_ns;
};

struct dlpc__region {
	atomic_uint refs;
	void *base;
	size_t len;
	int fd; /* dlpc_alloc memory: its memfd (CUDA: its VMM export fd); attached memory: -1 */
	bool device;		   /* CUDA memory: gpu says how to let go of it */
	struct dlpc__gpu_map *gpu; /* CUDA: the mapping; NULL for the publisher's own pointer */
	uint8_t uuid[DLPC_CUDA_UUID_SIZE]; /* CUDA dlpc_alloc memory: its device's UUID */
	bool has_event; /* legacy CUDA IPC: ev_handle is the publisher's, for dlpc_tensor_wait() */
	/* attached CUDA memory: how its release is ordered after the consumer's work. No stream
	 * handle of the consumer's is kept: the consumer owns its streams and may destroy one
	 * before the tensor is dropped (CuPy's `with Stream():`), and a destroyed handle must not
	 * be used. The legacy default stream follows every blocking stream, so an event there is
	 * enough, unless a stream the consumer named is non-blocking (or its flags could not be
	 * read): then sync_ctx, and the whole context is synchronized instead (cuda.c). */
	atomic_bool sync_ctx;
	int ordinal;
	uint8_t ev_handle[DLPC_CUDA_IPC_HANDLE_SIZE];
	dlpc_client *client; /* attached memory: holds a client reference; else NULL */
	uint64_t ref_id;
	uint64_t conn_seq; /* the connection (client->conn_seq) ref_id belongs to */
	/* attached memory held through the client's cache: the entry holds the reference (the
	 * region only one use of it), and may take back the mapping (map_kind) */
	struct dlpc__centry *ce;
	/* a channel's message mapped read-only or copy-on-write (map_kind DLPC__MAP_SHARED_RO or
	 * DLPC__MAP_COW): which storage, for maps.c to keep the mapping for the storage's next
	 * message (keyed) */
	bool keyed;
	struct dlpc__mkey key;
	uint8_t map_kind;   /* DLPC__MAP_* */
	atomic_bool frozen; /* allocated memory sealed read-only (F_SEAL_WRITE), mapped read-only */
	/* dlpc_alloc() memory whose size the warm pool noted: its first publish has the pool
	 * refilled (dlpc__warm_refill()), later ones (the same buffer sent again) do not */
	atomic_bool warm_noted;
	atomic_bool sealed_ro; /* ...and its seals final: sealing it read-only again is a no-op */
	/* attached memory: who published the entry, and what */
	uint32_t owner_uid, entry_flags;
	int32_t owner_pid;
	uint64_t generation;
	/* allocated memory: the tensors dlpc_alloc_bundle() laid out in it (nparts of them, at
	 * parts[i]; NULL: one, at 0), which a zero-copy publish must cover, all and in order */
	size_t nparts;
	uint64_t *parts;
	/* dlpc_channel_alloc() memory: its pool token (DLPC__POOL_TOKEN set) and the connection
	 * whose pool holds it (not a reference); 0 and NULL otherwise */
	uint64_t pool_token;
	const dlpc_client *pool_owner;
	/* dlpc_channel_alloc() memory (pool_token set): an O_RDONLY descriptor of fd, the one its
	 * messages carry, so that no receiver can map or write the buffer (pool.c) */
	int pool_fd;
};

void dlpc__region_ref(struct dlpc__region *r);
void dlpc__region_unref(struct dlpc__region *r);
/* A C-contiguous view of @p r at @p data; takes its own region reference. NULL on ENOMEM. */
DLManagedTensorVersioned *dlpc__view_new(struct dlpc__region *r, void *data, DLDevice dev,
					 DLDataType dtype, int ndim, const int64_t *shape,
					 uint64_t flags);
/* The region of a tensor libdlpc made, or NULL for any other tensor. */
struct dlpc__region *dlpc__view_region(const DLManagedTensorVersioned *t);
/* Refuse (-EFBIG, -ENOSPC, message naming @p name) a memfd of @p size bytes that this process
 * could not fill: over RLIMIT_FSIZE, the machine's memory and swap, or its memory cgroups' room
 * (room.c). 0 if it fits. */
int dlpc__size_fits(const char *name, uint64_t size);
/* A memfd of @p size bytes labelled after @p name, its pages allocated now if @p reserve (for
 * memory that will be written through a mapping); fd or negative errno. */
int dlpc__memfd_create(const char *name, uint64_t size, bool reserve);
/* The same without the check of dlpc__size_fits() nor the reservation, made with memfd_create()
 * @p flags too (MFD_HUGETLB). */
int dlpc__memfd_open(const char *name, uint64_t size, unsigned flags);
/* warm.c: a memfd of exactly @p size bytes whose pages are all allocated already, from the
 * process's warm pool, or -1 when it has none that fits (then the caller makes its own). Never
 * fails otherwise; the memfd is the caller's, never handed out again. *@p map: NULL, or a
 * writable mapping of it (*@p map_len bytes, at least @p size; MADV_DONTFORK), its pages faulted
 * in, that the caller writes through and munmap()s before the seal (dlpc_alloc() keeps it as
 * its region's, MADV_DOFORK). Notes the size as used: from a size's second use within
 * $DLPC_WARM_IDLE_MS, the pool keeps one ready for the next publish or dlpc_alloc() of about
 * that size. */
int dlpc__warm_take(uint64_t size, void **map, size_t *map_len);
/* After the publish that called dlpc__warm_take(@p size), or published the dlpc_alloc() memory
 * that did: have the pool refilled, in the background.
 * Not before: on a machine with few CPUs the refill would compete with the copy (or with the
 * caller filling what it allocated). */
void dlpc__warm_refill(uint64_t size);
/* Memory ran out: give back every memfd the pool holds, and fill no more until it falls idle.
 * Whether there was any. */
bool dlpc__warm_drop(void);
void dlpc__warm_register(void);

/* Linux 5.14's madvise() advice, which older C libraries do not name. */
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

/* split.c: a copy into new shared memory, split over threads. */
/* One contiguous run of a copy: @p len bytes from @p src, to byte @p off of the mapping. */
struct dlpc__run {
	const void *src;
	uint64_t off, len;
};
/* How many threads a copy of @p len bytes is split over: one per DLPC__SPLIT_MIN bytes, at most
 * DLPC__SPLIT_THREADS_MAX, $DLPC_COPY_THREADS, the CPUs the calling thread may run on and its
 * cgroups' CPU limits; at least 1 (the caller alone). */
unsigned dlpc__split_threads(uint64_t len);
/* What dlpc__split_copy()'s threads do besides the copy. */
enum {
	/* allocate the part's pages first (dlpc__huge_fill()) */
	DLPC__SPLIT_POPULATE = 1u << 0,
	/* drop the part's pages from the mapping after its copy (MADV_DONTNEED: the memfd keeps
	 * them), where the copy runs on more than one thread: the caller's munmap() before the
	 * seal then has no page left to unmap, the part of it that costs as much as the copy */
	DLPC__SPLIT_DROP = 1u << 1,
};
/* Copy the @p n runs into @p map, a writable mapping of the @p len bytes of the memfd @p fd,
 * split over dlpc__split_threads(@p len) threads, each with its part of the mapping (whole huge
 * pages with DLPC__SPLIT_POPULATE, whole pages otherwise), doing what @p how asks besides. The
 * number of threads that ran at once (1: the caller alone), or the negative errno of an
 * allocation that failed (then some of the bytes may not be there). */
int dlpc__split_copy(uint8_t *map, uint64_t len, int fd, unsigned how, const struct dlpc__run *runs,
		     size_t n);
/* Map the @p len bytes of the read mapping @p base, of 4 KiB pages, as reading them would, split
 * over dlpc__split_threads(@p len) threads, a page per DLPC__POPULATE_STEP: a hint that stops at
 * the first error. The number of threads that ran at once, or 0 where the kernel does not know
 * MADV_POPULATE_READ (before Linux 5.14; it is not asked again). */
unsigned dlpc__split_populate(void *base, size_t len);

/* huge.c: how a memfd of some size gets huge pages. */
enum dlpc__huge {
	DLPC__HUGE_NONE,   /* not at all: too small, not allowed, or not asked for */
	DLPC__HUGE_KERNEL, /* shmem_enabled always or within_size: by itself, nothing to do */
	DLPC__HUGE_ADVISE, /* shmem_enabled advise: pages first touched through a mapping marked
			    * MADV_HUGEPAGE (dlpc__huge_fill()) */
	DLPC__HUGE_TLB,	   /* a hugetlbfs pool has room: MFD_HUGETLB, the size a whole number of
			    * dlpc__huge_pmd() bytes, written through a mapping */
};
/* What $DLPC_HUGE_PAGES and the machine, as set now, give a memfd of @p size bytes; never
 * DLPC__HUGE_TLB unless @p tlb_ok. */
enum dlpc__huge dlpc__huge_for(uint64_t size, bool tlb_ok);
/* The size of a huge page mapped by one page-table entry (PMD): 2 MiB on x86-64. */
uint64_t dlpc__huge_pmd(void);
/* Map @p len bytes of @p fd shared and writable, for this process only (MADV_DONTFORK: a
 * writable mapping in a child would bar F_SEAL_WRITE; a fork() waits until it is marked),
 * asking for huge pages if @p advise (MADV_HUGEPAGE). NULL if it cannot (errno says why). */
void *dlpc__huge_map(int fd, size_t len, bool advise);
/* Allocate the pages of bytes [@p off, @p off + @p len) of the memfd @p fd mapped writable at
 * @p map, by faulting them in (MADV_POPULATE_WRITE), so that a mapping's MADV_HUGEPAGE applies.
 * 0 or negative errno. */
int dlpc__huge_fill(void *map, uint64_t off, size_t len, int fd);
/* fork(), @p phase as struct dlpc__hooks' atfork: holds off a fork() while dlpc__huge_map() has
 * a mapping not yet kept from children. Called by the warm pool's hook, after it took its own
 * locks (a fill maps under them). */
void dlpc__huge_atfork(int phase);
/* The negative errno for a failed write or reservation of shared memory: a full /dev/shm
 * (ENOSPC) and a full memory cgroup (ENOMEM) are both -ENOSPC, "shared memory is full". */
static inline int dlpc__space_err(int err)
{
	return err == ENOSPC || err == ENOMEM ? -ENOSPC : -err;
}

/* Seal a storage memfd that nothing maps for publishing: F_SEAL_SHRINK, GROW and SEAL, plus
 * F_SEAL_WRITE unless @p writable. 0 or negative errno. */
int dlpc__memfd_seal(int fd, const char *name, bool writable);
/* The same for dlpc_alloc() memory @p r, which this process maps: a read-only seal first makes
 * our own mapping read-only for good, in place. 0, -EBUSY if a writable mapping of it survives
 * in another process, or another negative errno. */
int dlpc__region_seal(struct dlpc__region *r, const char *name, bool writable);

/* The end of a region's teardown, once its memory is unmapped: release it, free it. */
void dlpc__region_finish(struct dlpc__region *r);
/* The consumer was ordered on @p stream (valid now, perhaps not later): note for
 * dlpc__cuda_retire() whether the legacy default stream follows it; the handle is not kept. */
void dlpc__region_note_stream(struct dlpc__region *r, void *stream);

/* alloc.c: a new region of @p size bytes (> 0) on @p device holding one reference (the
 * caller's); errors name @p what. Host memory comes from the warm pool where @p warm (memory
 * used once, as dlpc_alloc()'s, not a channel's buffer recycled for ever). */
int dlpc__alloc_region(DLDevice device, uint64_t size, const char *what, bool warm,
		       struct dlpc__region **ret);

#endif
