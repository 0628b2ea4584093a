/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Attaching: one ATTACH round trip returns the storage fd and the tensor descriptions; the
 * storage is mapped once and every tensor of the entry points into that mapping.
 *
 * Ownership: the mapping is a region (view.c) refcounted by the tensors handed out and, until
 * it is freed, by the bundle. The last one unmaps, sends RELEASE and drops the region's
 * reference on the client.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "internal.h"
#include "table.h"
#include "util.h"

/*
 * The public attach flags (DLPC_ATTACH_*, dlpc/dlpc.h) that dlpc_attach() takes: those sent in
 * Attach.flags as they are (proto/frame.h checks that their bits are the wire's), and those this
 * library acts on alone. The wire's own flags (DLPC_WIRE_ATTACH_SINGLE and _CACHEABLE, the
 * `extra` of the functions below) are the library's to add; its internal ones (DLPC__ATTACH_*,
 * internal.h) never come this way.
 */
#define API_ATTACH_FLAGS (API_ATTACH_SENT | API_ATTACH_LOCAL)
#define API_ATTACH_SENT (DLPC_ATTACH_WRITABLE | DLPC_ATTACH_OWNER)
#define API_ATTACH_LOCAL                                                                           \
	(DLPC_ATTACH_DEFER_SYNC | DLPC_ATTACH_PRIVATE | DLPC_ATTACH_GUARDED |                      \
	 DLPC_ATTACH_NO_CACHE | DLPC_ATTACH_POPULATE)
_Static_assert((API_ATTACH_SENT & API_ATTACH_LOCAL) == 0, "an attach flag is sent or local");
_Static_assert((API_ATTACH_SENT & ~DLPC_WIRE_ATTACH_FLAGS) == 0,
	       "the attach flags sent are wire flags");
_Static_assert((API_ATTACH_FLAGS & (DLPC__ATTACH_KEEP_MAP | DLPC__ATTACH_SEALED)) == 0,
	       "the library's internal attach flags are no public ones");

struct dlpc_bundle {
	size_t n;
	struct dlpc__region *region; /* the bundle's own reference, dropped when it is freed */
	char **keys;
	DLManagedTensorVersioned **tensors; /* NULL once taken */
};

/*
 * Check the daemon's tensor table against the storage (a guard against a confused daemon;
 * host tensors are also DLPC_ALIGN-aligned, where a CUDA one sits wherever the publisher's
 * allocator put it): the tensor count, and the total bytes of keys, or -1 when a record is malformed or does not
 * fit the storage.
 */
static int64_t reply_sane(const Dlpackd__V1__AttachReply *rep, size_t *keybytes)
{
	const uint8_t *p = rep->tensor_table.data;
	size_t len = rep->tensor_table.len, pos = 4;
	int64_t n = dlpc__table_count(p, len);
	struct dlpc__table_rec d;

	*keybytes = 0;
	if (n <= 0 || rep->storage_size == 0 || rep->storage_size > SIZE_MAX)
		return -1;
	for (int64_t i = 0; i < n; i++) {
		uint64_t nbytes;

		if (dlpc__table_next(p, len, &pos, &d) < 0 ||
		    dlpc__tensor_nbytes(d.dtype.bits, d.dtype.lanes, d.shape, (size_t)d.ndim,
					&nbytes) < 0 ||
		    (rep->device_type == kDLCPU && d.offset % DLPC_ALIGN != 0) ||
		    d.offset > rep->storage_size || nbytes > rep->storage_size - d.offset)
			return -1;
		*keybytes += d.key_len + 1;
	}
	return pos == len ? n : -1;
}

DLPC_EXPORT void dlpc_bundle_free(dlpc_bundle *b)
{
	if (!b)
		return;
	for (size_t i = 0; i < b->n; i++)
		if (b->tensors[i])
			b->tensors[i]->deleter(b->tensors[i]);
	if (b->region)
		dlpc__region_unref(b->region);
	free(b->keys);
	free(b->tensors);
	free(b);
}

/* Is the CUDA part of @p rep complete: a UUID, and IPC handles of the right size or an fd? */
static bool cuda_sane(const Dlpackd__V1__AttachReply *rep, int fd)
{
	const Dlpackd__V1__CudaIpc *ipc = rep->cuda_ipc;

	if (rep->device_uuid.len != DLPC_CUDA_UUID_SIZE)
		return false;
	if (!ipc)
		return fd >= 0;
	return fd < 0 && ipc->mem_handle.len == DLPC_CUDA_IPC_HANDLE_SIZE &&
	       ipc->event_handle.len == DLPC_CUDA_IPC_HANDLE_SIZE;
}

/*
 * Legacy CUDA IPC works only between processes of one PID namespace. After an import of
 * @p rep failed with @p r, add to the message when the publisher (its pid as dlpackd saw it) is
 * not in this process's: not visible here, or in another namespace. Returns @p r.
 */
static int pidns_hint(const Dlpackd__V1__AttachReply *rep, int r)
{
	char path[64], mine[64], theirs[64], was[512];
	ssize_t a, b;

	if (rep->owner_pid <= 0)
		return r;
	snprintf(path, sizeof(path), "/proc/%d/ns/pid", (int)rep->owner_pid);
	a = readlink("/proc/self/ns/pid", mine, sizeof(mine) - 1);
	b = readlink(path, theirs, sizeof(theirs) - 1);
	if (a <= 0 || (b < 0 && errno != ENOENT) ||
	    (b > 0 && a == b && memcmp(mine, theirs, (size_t)a) == 0))
		return r;
	snprintf(was, sizeof(was), "%s", dlpc_last_error());
	return dlpc__fail(r,
			  "%s; its publisher (pid %d to dlpackd) is not in this process's PID "
			  "namespace, and legacy CUDA IPC works only within one: run both in one "
			  "(docker --pid=host, a shared pod namespace), or publish with "
			  "dlpc_alloc() memory (CUDA VMM), which does not need it",
			  was, (int)rep->owner_pid);
}

/*
 * A VMM export outlives its exporter only while the device does: without persistence mode the
 * driver tears the device down, exported memory included, once its last process exits. After
 * an import of @p rep failed with @p r, say so when no process runs under the publisher's pid
 * as seen from here (the pid is dlpackd's view: in another PID namespace the publisher may be
 * alive, so the message says both). Returns @p r.
 */
static int persistence_hint(const Dlpackd__V1__AttachReply *rep, int r)
{
	char was[512];

	if (rep->owner_pid <= 0 || kill((pid_t)rep->owner_pid, 0) == 0 || errno != ESRCH)
		return r;
	snprintf(was, sizeof(was), "%s", dlpc_last_error());
	return dlpc__fail(
		r,
		"%s; its publisher (pid %d to dlpackd) is not running as seen from here: "
		"if it has exited, and persistence mode (nvidia-persistenced) is off, the "
		"driver freed the exported memory once the device's last process exited, "
		"and the entry can no longer be attached (unpublish it); if it runs in "
		"another PID namespace, the driver's error above is the cause",
		was, (int)rep->owner_pid);
}

/* Map the CUDA storage of @p rep into @p m (legacy IPC handles, or the VMM fd @p fd, which is
 * not consumed) and order @p stream after the publisher. 0 or negative errno. */
static int map_cuda(const char *name, const Dlpackd__V1__AttachReply *rep, int fd, void *stream,
		    bool defer, bool writable, struct dlpc__region *m, DLDevice *dev)
{
	int ordinal = 0, r;

	if (rep->cuda_ipc) {
		r = dlpc__cuda_ipc_import(rep->device_uuid.data, rep->cuda_ipc->mem_handle.data,
					  rep->cuda_ipc->event_handle.data, rep->storage_size,
					  stream, defer, name, &m->gpu, &m->base, &ordinal);
		if (r < 0 && r != -ENODEV && r != -EBADFD && r != -EPROTO)
			r = pidns_hint(rep, r);
	} else {
		r = dlpc__cuda_vmm_import(fd, rep->storage_size, rep->device_uuid.data, writable,
					  name, &m->gpu, &m->base, &ordinal);
		if (r < 0 && r != -ENODEV && r != -EBADFD && r != -ENOMEM)
			r = persistence_hint(rep, r);
	}
	if (r < 0)
		return r;
	if (rep->cuda_ipc) {
		m->has_event = true;
		memcpy(m->ev_handle, rep->cuda_ipc->event_handle.data, sizeof(m->ev_handle));
	}
	m->ordinal = ordinal;
	m->device = true;
	/* a stream given at attach is where the consumer works (the host waited without one) */
	if (stream && !defer)
		dlpc__region_note_stream(m, stream);
	dev->device_type = kDLCUDA;
	dev->device_id = ordinal;
	return 0;
}

/*
 * The bundle of @p n views of region @p m (whose reference it takes over) on the tensors of
 * @p table (checked: reply_sane()), with @p keybytes bytes of keys.
 */
static int bundle_new(struct dlpc__region *m, const uint8_t *table, size_t table_len, size_t n,
		      size_t keybytes, DLDevice dev, uint64_t tflags, const char *name,
		      dlpc_bundle **ret)
{
	struct dlpc__table_rec d;
	dlpc_bundle *b = calloc(1, sizeof(*b));
	size_t pos = 4;
	char *kp;

	if (b) {
		b->region = m;
		b->keys = malloc(n * sizeof(char *) + keybytes);
		b->tensors = calloc(n, sizeof(*b->tensors));
	}
	if (!b || !b->keys || !b->tensors) {
		if (b)
			dlpc_bundle_free(b);
		else
			dlpc__region_unref(m);
		return dlpc__fail(-ENOMEM, "cannot attach '%s': out of memory", name);
	}
	b->n = n;
	kp = (char *)(b->keys + b->n);
	for (size_t i = 0; i < b->n; i++) {
		int sane = dlpc__table_next(table, table_len, &pos, &d);

		/* checked by reply_sane(): cannot fail */
		assert(sane == 0);
		(void)sane;
		b->keys[i] = kp;
		if (d.key_len)
			memcpy(kp, d.key, d.key_len);
		kp[d.key_len] = '\0';
		kp += d.key_len + 1;
		b->tensors[i] = dlpc__view_new(m, (uint8_t *)m->base + d.offset, dev, d.dtype,
					       d.ndim, d.shape, tflags);
		if (!b->tensors[i]) {
			dlpc_bundle_free(b);
			return dlpc__fail(-ENOMEM, "cannot attach '%s': out of memory", name);
		}
	}
	*ret = b;
	return 0;
}

/* The DLPack flags of tensors attached with DLPC_ATTACH_* @p flags. */
static uint64_t tensor_flags(uint32_t flags)
{
	return (flags & (DLPC_ATTACH_WRITABLE | DLPC_ATTACH_PRIVATE))
		       ? 0
		       : DLPACK_FLAG_BITMASK_READ_ONLY;
}

/*
 * The flags of a private mapping of @p fd: MAP_NORESERVE too on a hugetlbfs file (a publish
 * with DLPC_HUGE_PAGES=hugetlb). The kernel reserves a private mapping's whole range of
 * hugetlbfs from its pool, for the copies its writes may make: each copy-on-write attacher would
 * take another storage's worth of the pool, or fail with ENOMEM when it lacks that. Mapped
 * MAP_NORESERVE, reads share the storage's pages and reserve nothing; a write that finds the
 * pool empty then gets SIGBUS.
 */
static int private_flags(int fd)
{
	struct statfs fs;

	return MAP_PRIVATE |
	       (fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC ? MAP_NORESERVE : 0);
}

/* Map host storage @p fd of @p len bytes as @p flags ask; *@p kind: what the cache may keep
 * it as (DLPC__MAP_*). MAP_FAILED with errno set on failure. */
static void *map_host(int fd, size_t len, uint32_t flags, uint8_t *kind)
{
	bool writable = flags & DLPC_ATTACH_WRITABLE;
	void *p;

	*kind = DLPC__MAP_OTHER;
	/* copy-on-write: reads share the publisher's pages, a write copies one page */
	if (flags & (DLPC_ATTACH_PRIVATE | DLPC_ATTACH_GUARDED)) {
		*kind = DLPC__MAP_COW;
		return mmap(NULL, len, PROT_READ | PROT_WRITE, private_flags(fd), fd, 0);
	}
	p = mmap(NULL, len, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, 0);
	if (p != MAP_FAILED && !writable)
		*kind = DLPC__MAP_SHARED_RO;
	/* Before Linux 6.7 a shared mapping of a read-write descriptor of an F_SEAL_WRITE memfd
	 * is refused even read-only; a private read-only one reads the same pages, which nobody
	 * can change. */
	if (p == MAP_FAILED && errno == EPERM && !writable)
		p = mmap(NULL, len, PROT_READ, private_flags(fd), fd, 0);
	return p;
}

/* Whether the new mapping of @p len bytes of @p fd is best populated a page per fault-around
 * window: 4 KiB pages, of shared memory without huge pages as this process sees the machine's
 * setting, not a hugetlbfs file. */
static bool windowed(int fd, size_t len)
{
	struct statfs fs;

	return sysconf(_SC_PAGESIZE) == 4096 && dlpc__huge_for(len, false) == DLPC__HUGE_NONE &&
	       !(fd >= 0 && fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC);
}

/*
 * DLPC_ATTACH_POPULATE: map every page of the host mapping @p base (@p len bytes) now, as reading
 * each would (copy-on-write mappings stay shared), so that reading it later takes no faults.
 * A new mapping (@p fresh, of @p fd) of 4 KiB pages is populated a page per fault-around window,
 * split over threads (dlpc__split_populate()); one of huge pages, and a kept one (which may have
 * lost any of its pages since: a window whose first page is still there would take no fault), in
 * one call that maps every page. A hint: a kernel without MADV_POPULATE_READ (EINVAL, before
 * Linux 5.14), or one that stops part way (a fatal signal, no memory), leaves the rest to fault
 * on first touch; so do the pages of a window that the kernel had swapped out but its first
 * (fault-around maps only pages in memory).
 */
static void populate(void *base, size_t len, int fd, bool fresh)
{
	int saved = errno;

	if (fresh && windowed(fd, len))
		dlpc__split_populate(base, len);
	else
		(void)madvise(base, len, MADV_POPULATE_READ);
	errno = saved;
}

/* How many tensors the ATTACH reply @p rep (with @p fd) holds, when this process can use it as
 * @p flags ask (*@p keybytes: the bytes of their keys); else, having released its reference and
 * closed @p fd, a negative errno. */
static int64_t reply_usable(dlpc_client *c, uint64_t conn_seq, const char *name,
			    const Dlpackd__V1__AttachReply *rep, int fd, uint32_t flags,
			    size_t *keybytes)
{
	int64_t n = reply_sane(rep, keybytes);

	if ((rep->device_type != kDLCPU || fd < 0) &&
	    (rep->device_type != kDLCUDA || !cuda_sane(rep, fd)))
		n = -1;
	if (n < 0) {
		dlpc__release_ref(c, rep->ref_id, conn_seq);
		dlpc__close(fd);
		return dlpc__fail(-EPROTO, "cannot attach '%s': dlpackd sent an unusable reply",
				  name);
	}
	if (rep->device_type == kDLCUDA && (flags & DLPC_ATTACH_PRIVATE)) {
		dlpc__release_ref(c, rep->ref_id, conn_seq);
		dlpc__close(fd);
		return dlpc__fail(-ENOTSUP,
				  "cannot attach '%s' copy-on-write: it is CUDA memory, which is "
				  "shared in place (attach it read-only, or writable if it was "
				  "published writable)",
				  name);
	}
	return n;
}

/*
 * Is the host storage @p fd that dlpackd sent fit to map for @p len bytes: a memfd whose seals
 * hold its size (a file that could shrink, or one smaller than the daemon says, would turn reads
 * past its end into SIGBUS) and, unless the entry was published @p writable, its contents? The
 * daemon checks this of what it accepts; a client checks it of what it maps, because the socket
 * it reached may not be a dlpackd it trusts. F_GET_SEALS first: it answers from the inode, for
 * shmem and hugetlbfs alone, so fstat() never calls into another filesystem. 0, or -EPROTO.
 */
static int host_storage_sound(const char *name, int fd, size_t len, bool writable)
{
	int need = F_SEAL_SHRINK | F_SEAL_GROW | (writable ? 0 : F_SEAL_WRITE);
	int seals = fcntl(fd, F_GET_SEALS);
	struct stat st;

	if (seals < 0 || (seals & need) != need)
		return dlpc__fail(-EPROTO,
				  "cannot attach '%s': dlpackd sent storage that is not a memfd "
				  "sealed against %s (seals 0x%x)",
				  name, writable ? "resizing" : "resizing and writes",
				  seals < 0 ? 0 : (unsigned)seals);
	if (fstat(fd, &st) < 0)
		return dlpc__fail(-EPROTO,
				  "cannot attach '%s': cannot stat the storage dlpackd sent: %m",
				  name);
	if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size < len)
		return dlpc__fail(-EPROTO,
				  "cannot attach '%s': dlpackd sent storage of %lld bytes for "
				  "tensors of %zu",
				  name, (long long)st.st_size, len);
	return 0;
}

/* Map the host storage @p fd of region @p m (m->len bytes) as @p flags ask: a channel's message
 * may take a mapping kept from its last one (@p key: its storage's, or NULL). 0, or a negative
 * errno. */
static int map_host_storage(dlpc_client *c, const char *name, int fd, uint32_t flags,
			    const struct dlpc__mkey *key, struct dlpc__region *m)
{
	bool writable = flags & DLPC_ATTACH_WRITABLE;
	uint8_t kind = (flags & (DLPC_ATTACH_PRIVATE | DLPC_ATTACH_GUARDED)) ? DLPC__MAP_COW
									     : DLPC__MAP_SHARED_RO;
	bool kept;

	/* a channel's message: its storage's mapping may be kept for its next message */
	if ((flags & DLPC__ATTACH_KEEP_MAP) && !writable && !(flags & DLPC_ATTACH_NO_CACHE))
		m->base = dlpc__maps_take(c, fd, m->len, kind, flags & DLPC__ATTACH_SEALED, key,
					  &m->key, &m->keyed);
	kept = m->base;
	if (kept)
		m->map_kind = kind;
	else
		m->base = map_host(fd, m->len, flags, &m->map_kind);
	if (m->base == MAP_FAILED)
		return dlpc__fail(
			-errno, "cannot attach '%s': cannot map %zu bytes%s: %m", name, m->len,
			(flags & (DLPC_ATTACH_PRIVATE | DLPC_ATTACH_GUARDED)) ? " copy-on-write"
									      : "");
	if (flags & DLPC_ATTACH_POPULATE)
		populate(m->base, m->len, fd, !kept);
	return 0;
}

/* Turn an ATTACH reply that came by connection @p conn_seq and its fd (-1 for legacy CUDA IPC)
 * into a bundle; cache the reference if @p cache (@p seq: dlpc__cache_seq() before the
 * request). Consumes @p fd. */
int dlpc__attach_build(dlpc_client *c, uint64_t conn_seq, bool cache, uint64_t seq,
		       const char *name, const Dlpackd__V1__AttachReply *rep, int fd,
		       uint32_t flags, void *stream, const struct dlpc__mkey *key,
		       dlpc_bundle **ret)
{
	DLDevice dev = {.device_type = kDLCPU, .device_id = 0};
	bool writable = flags & DLPC_ATTACH_WRITABLE;
	struct dlpc__region *m = NULL;
	size_t keybytes;
	int64_t n = reply_usable(c, conn_seq, name, rep, fd, flags, &keybytes);
	int r;

	if (n < 0)
		return (int)n;
	m = calloc(1, sizeof(*m));
	if (!m) {
		r = dlpc__fail(-ENOMEM, "cannot attach '%s': out of memory", name);
		goto fail;
	}
	m->len = (size_t)rep->storage_size;
	if (rep->device_type == kDLCUDA)
		r = map_cuda(name, rep, fd, stream, flags & DLPC_ATTACH_DEFER_SYNC, writable, m,
			     &dev);
	else if ((flags & DLPC__ATTACH_SEALED) ||
		 (r = host_storage_sound(name, fd, m->len, rep->flags & DLPC_PUBLISH_WRITABLE)) ==
			 0)
		r = map_host_storage(c, name, fd, flags, key, m);
	if (r < 0)
		goto fail;
	m->fd = -1;
	m->client = c;
	m->ref_id = rep->ref_id;
	m->conn_seq = conn_seq;
	m->owner_uid = rep->owner_uid;
	m->owner_pid = rep->owner_pid;
	m->entry_flags = rep->flags;
	m->generation = rep->generation;
	/* host memory attached read-only: the cache may keep the reference and the fd */
	if (cache && rep->device_type == kDLCPU && !writable) {
		m->ce = dlpc__cache_insert(c, seq, conn_seq, name, m, fd, rep->tensor_table.data,
					   rep->tensor_table.len);
		if (m->ce)
			fd = -1;
	}
	dlpc__close(fd);
	/* from here the region owns the reference (or its use of the cache's): its last unref
	 * releases it */
	atomic_init(&m->refs, 1);
	dlpc__client_ref(c);
	r = bundle_new(m, rep->tensor_table.data, rep->tensor_table.len, (size_t)n, keybytes, dev,
		       tensor_flags(flags), name, ret);
	return r;
fail:
	dlpc__release_ref(c, rep->ref_id, conn_seq);
	free(m);
	dlpc__close(fd);
	return r;
}

/*
 * Answer an attach from the cache: the generation, 0 when it cannot (ask the daemon), or a
 * negative errno. The socket is read first, so that every invalidation the daemon wrote before
 * this attach began is applied (see cache.c).
 */
static int attach_cached(dlpc_client *c, const char *name, uint32_t flags, uint32_t extra,
			 uint32_t owner_uid, dlpc_bundle **ret)
{
	bool cow = flags & (DLPC_ATTACH_PRIVATE | DLPC_ATTACH_GUARDED);
	DLDevice dev = {.device_type = kDLCPU, .device_id = 0};
	const uint8_t *table;
	size_t table_len, keybytes = 0, pos = 4;
	struct dlpc__centry *e;
	struct dlpc__region *m;
	struct dlpc__table_rec d;
	void *map;
	int64_t n;
	int fd, r;

	if (!dlpc__drain(c, false))
		return 0;
	e = dlpc__cache_get(c, name, flags & DLPC_ATTACH_OWNER, owner_uid,
			    extra & DLPC_WIRE_ATTACH_SINGLE, cow, &map);
	if (!e)
		return 0;
	m = calloc(1, sizeof(*m));
	if (!m) {
		dlpc__cache_put(c, e, map, cow ? DLPC__MAP_COW : DLPC__MAP_SHARED_RO);
		return dlpc__fail(-ENOMEM, "cannot attach '%s': out of memory", name);
	}
	dlpc__cache_fill(e, m, &fd, &table, &table_len);
	if (map) {
		m->base = map;
		m->map_kind = cow ? DLPC__MAP_COW : DLPC__MAP_SHARED_RO;
	} else {
		m->base = map_host(fd, m->len, flags, &m->map_kind);
		if (m->base == MAP_FAILED) {
			r = dlpc__fail(-errno, "cannot attach '%s': cannot map %zu bytes: %m", name,
				       m->len);
			dlpc__cache_put(c, e, NULL, DLPC__MAP_OTHER);
			free(m);
			return r;
		}
	}
	/* a kept mapping may have lost pages since (reclaim) or never had them */
	if (flags & DLPC_ATTACH_POPULATE)
		populate(m->base, m->len, map ? -1 : fd, !map);
	m->fd = -1;
	m->client = c;
	m->ce = e;
	atomic_init(&m->refs, 1);
	dlpc__client_ref(c);
	n = dlpc__table_count(table, table_len);
	for (int64_t i = 0; i < n; i++) {
		dlpc__table_next(table, table_len, &pos, &d);
		keybytes += d.key_len + 1;
	}
	r = bundle_new(m, table, table_len, (size_t)n, keybytes, dev, tensor_flags(flags), name,
		       ret);
	return r < 0 ? r : (int)m->generation;
}

/*
 * Send @p req and wait for its reply, which came by connection *@p conn_seq. A waiting attach of a
 * client made with DLPC_CONNECT_RECONNECT rides through a daemon restart: if the connection is
 * lost while it waits, it connects again (call_bounded() does, at the next request, within the
 * time left) and asks anew for the time left, pausing between attempts while no daemon answers.
 * Only a daemon that is not back yet makes it try again: an error of connecting anew that
 * waiting does not end (permissions, the protocol, resources) is the attach's.
 */
static int attach_call(dlpc_client *c, Dlpackd__V1__Attach *req, int64_t timeout,
		       Dlpackd__V1__AttachReply **rep, int *fd, struct dlpc__arena *arena,
		       uint64_t *conn_seq)
{
	int64_t end = dlpc__mono_end(timeout), left = timeout, pause = 10;
	char why[DLPC_ERROR_TEXT_MAX];
	int r;

	for (;;) {
		struct dlpc__call_info info = {0};

		req->timeout_ms = left;
		r = dlpc__call_ex(c, DLPC_MSG_ATTACH, &req->base, NULL, 0, left, &info,
				  &dlpackd__v1__attach_reply__descriptor, (ProtobufCMessage **)rep,
				  fd, &arena->alloc);
		*conn_seq = info.conn_seq;
		if (r >= 0 || timeout == 0 || !c->reconnect)
			return r;
		/* the thread's interrupt check ended it: as for any call */
		if (info.reconnect_err == -EINTR)
			return r;
		if (info.reconnect_err && !dlpc__reconnect_transient(info.reconnect_err)) {
			snprintf(why, sizeof(why), "%s", dlpc_last_error());
			return dlpc__fail(
				r,
				"cannot attach '%.*s': the connection to dlpackd was lost, "
				"and connecting again failed in a way that waiting does not "
				"mend: %s",
				(int)req->name.len, (const char *)req->name.data, why);
		}
		if (!info.lost && !info.reconnect_err)
			return r;
		if (timeout > 0) {
			left = end - dlpc__mono_ms();
			/* the last attempt's message goes into the new one: copied first, for it
			 * lives in the very buffer the new one is written to */
			snprintf(why, sizeof(why), "%s", dlpc_last_error());
			if (left <= 0)
				return dlpc__fail(-ETIMEDOUT,
						  "waited %lld ms for '%.*s'; dlpackd went away "
						  "meanwhile and has not come back (%s)",
						  (long long)timeout, (int)req->name.len,
						  (const char *)req->name.data, why);
		}
		r = dlpc__pause_lost(c, timeout > 0 && left < pause ? left : pause);
		if (r < 0)
			return r;
		pause = pause * 2 < DLPC_RECONNECT_BACKOFF_MAX_MS ? pause * 2
								  : DLPC_RECONNECT_BACKOFF_MAX_MS;
		if (timeout > 0) {
			left = end - dlpc__mono_ms();
			if (left <= 0)
				left = 1;
		}
	}
}

/* Read the options @p opts (or NULL) of an attach of @p name: its DLPC_ATTACH_* *@p flags,
 * *@p timeout, CUDA *@p stream and the *@p owner_uid it asks for, as far as opts->size says
 * they are there. 0, or -EINVAL. */
static int attach_opts_read(const char *name, const dlpc_attach_opts *opts, uint32_t *flags,
			    int64_t *timeout, void **stream, uint32_t *owner_uid)
{
	if (!opts)
		return 0;
	if (opts->size < offsetof(dlpc_attach_opts, stream))
		return dlpc__fail(-EINVAL, "cannot attach '%s': opts->size is %u", name,
				  opts->size);
	*flags = opts->flags;
	*timeout = opts->timeout_ms;
	if (opts->size >= offsetof(dlpc_attach_opts, stream) + sizeof(opts->stream))
		*stream = opts->stream;
	if (opts->size >= offsetof(dlpc_attach_opts, owner_uid) + sizeof(opts->owner_uid))
		*owner_uid = opts->owner_uid;
	else if (*flags & DLPC_ATTACH_OWNER)
		return dlpc__fail(-EINVAL,
				  "cannot attach '%s': DLPC_ATTACH_OWNER needs "
				  "opts->owner_uid (opts->size is %u)",
				  name, opts->size);
	return 0;
}

/* attach() once it holds a reference on @p c. */
static int attach_ref(dlpc_client *c, const char *name, const dlpc_attach_opts *opts,
		      uint32_t extra, dlpc_bundle **ret)
{
	Dlpackd__V1__Attach req = DLPACKD__V1__ATTACH__INIT;
	Dlpackd__V1__AttachReply *rep;
	struct dlpc__arena arena;
	uint64_t conn_seq = 0, seq = 0;
	bool cache;
	uint32_t flags = 0;
	int64_t timeout = 0;
	void *stream = NULL;
	int fd, r;

	r = dlpc__name_arg(name, "attach");
	if (r < 0)
		return r;
	r = attach_opts_read(name, opts, &flags, &timeout, &stream, &req.owner_uid);
	if (r < 0)
		return r;
	if (flags & ~API_ATTACH_FLAGS)
		return dlpc__fail(-EINVAL, "cannot attach '%s': unknown flags 0x%x", name,
				  flags & ~API_ATTACH_FLAGS);
	if ((flags & DLPC_ATTACH_WRITABLE) && (flags & (DLPC_ATTACH_PRIVATE | DLPC_ATTACH_GUARDED)))
		return dlpc__fail(-EINVAL,
				  "cannot attach '%s': DLPC_ATTACH_WRITABLE (a shared writable "
				  "mapping) and a copy-on-write mapping exclude each other",
				  name);
	/* the cache serves read-only attaches (shared, or copy-on-write from the kept fd) */
	cache = c->cache.on && !(flags & (DLPC_ATTACH_WRITABLE | DLPC_ATTACH_NO_CACHE));
	if (cache) {
		r = attach_cached(c, name, flags, extra, req.owner_uid, ret);
		if (r != 0)
			return r;
		seq = dlpc__cache_seq(c);
	}
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	/* how this process maps the storage is its own business, not the daemon's */
	req.flags = (flags & API_ATTACH_SENT) | extra | (cache ? DLPC_WIRE_ATTACH_CACHEABLE : 0);
	req.timeout_ms = timeout;
	/* the reply lives until the bundle is built: unpack it into an arena, not a malloc per
	 * field (a 500-tensor bundle would be 1,500 of them) */
	dlpc__arena_init(&arena);
	r = attach_call(c, &req, timeout, &rep, &fd, &arena, &conn_seq);
	if (r < 0) {
		dlpc__arena_clear(&arena);
		/* the library's own reasons, which do not name the entry yet */
		if (r == -EMFILE || r == -ECANCELED) {
			char why[512];

			snprintf(why, sizeof(why), "%s", dlpc_last_error());
			r = dlpc__fail(r, "cannot attach '%s': %s", name, why);
		}
		return r;
	}
	if ((fd < 0 && !rep->cuda_ipc) || rep->generation == 0 || rep->generation > INT32_MAX) {
		if (rep->ref_id)
			dlpc__release_ref(c, rep->ref_id, conn_seq);
		dlpc__close(fd);
		r = dlpc__fail(-EPROTO, "cannot attach '%s': dlpackd sent an unusable reply", name);
	} else {
		r = dlpc__attach_build(c, conn_seq, cache, seq, name, rep, fd, flags, stream, NULL,
				       ret);
		if (r == 0)
			r = (int)rep->generation;
	}
	dlpc__arena_clear(&arena);
	return r;
}

static int attach(dlpc_client *c, const char *name, const dlpc_attach_opts *opts, uint32_t extra,
		  dlpc_bundle **ret)
{
	int r;

	if (!c || !ret)
		return dlpc__fail(-EINVAL, "cannot attach: client or result pointer is NULL");
	*ret = NULL;
	r = dlpc__check(c);
	if (r < 0)
		return r;
	/* a dlpc_close() from another thread meanwhile must not free the client under us */
	dlpc__client_ref(c);
	r = attach_ref(c, name, opts, extra, ret);
	dlpc__client_unref(c);
	return r;
}

DLPC_EXPORT int dlpc_attach_bundle(dlpc_client *c, const char *name, const dlpc_attach_opts *opts,
				   dlpc_bundle **ret)
{
	return attach(c, name, opts, 0, ret);
}

DLPC_EXPORT int dlpc_attach(dlpc_client *c, const char *name, const dlpc_attach_opts *opts,
			    DLManagedTensorVersioned **ret)
{
	dlpc_bundle *b;
	int r;

	if (!ret)
		return dlpc__fail(-EINVAL, "cannot attach: result pointer is NULL");
	*ret = NULL;
	r = attach(c, name, opts, DLPC_WIRE_ATTACH_SINGLE, &b);
	if (r < 0)
		return r;
	*ret = dlpc_bundle_take(b, 0);
	dlpc_bundle_free(b);
	return r;
}

DLPC_EXPORT size_t dlpc_bundle_count(const dlpc_bundle *b)
{
	return b ? b->n : 0;
}

DLPC_EXPORT const char *dlpc_bundle_key(const dlpc_bundle *b, size_t i)
{
	return b && i < b->n ? b->keys[i] : NULL;
}

DLPC_EXPORT DLManagedTensorVersioned *dlpc_bundle_take(dlpc_bundle *b, size_t i)
{
	DLManagedTensorVersioned *t;

	if (!b || i >= b->n)
		return NULL;
	t = b->tensors[i];
	b->tensors[i] = NULL;
	return t;
}

DLPC_EXPORT int dlpc_tensor_wait(const DLManagedTensorVersioned *t, void *stream)
{
	struct dlpc__region *r = dlpc__view_region(t);

	if (!r)
		return dlpc__fail(-EINVAL, "dlpc_tensor_wait: the tensor was not made by libdlpc");
	if (r->device && r->client)
		dlpc__region_note_stream(r, stream);
	if (!r->has_event)
		return 0;
	return dlpc__cuda_wait(r->ev_handle, r->ordinal, stream, "dlpc_tensor_wait");
}

DLPC_EXPORT int dlpc_tensor_attach_info(const DLManagedTensorVersioned *t, dlpc_attach_info *out)
{
	struct dlpc__region *r = dlpc__view_region(t);

	if (!out || out->size < offsetof(dlpc_attach_info, owner_uid) + sizeof(out->owner_uid))
		return dlpc__fail(-EINVAL, "dlpc_tensor_attach_info: out is NULL or out->size is "
					   "too small");
	if (!r || !r->client)
		return dlpc__fail(-EINVAL, "dlpc_tensor_attach_info: the tensor was not attached "
					   "through libdlpc");
#define SET(field)                                                                                 \
	do {                                                                                       \
		if (out->size >= offsetof(dlpc_attach_info, field) + sizeof(out->field))           \
			out->field = r->field;                                                     \
	} while (0)
	SET(owner_uid);
	SET(owner_pid);
	if (out->size >= offsetof(dlpc_attach_info, flags) + sizeof(out->flags))
		out->flags = r->entry_flags;
	SET(generation);
#undef SET
	return 0;
}
