/* SPDX-License-Identifier: Apache-2.0 */
/* Shared memory owned by this process: memfds for publishing, and dlpc_alloc(). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core.h"
#include "region.h"
#include "gpu.h"
#include "util.h"

int dlpc__memfd_create(const char *name, uint64_t size, bool reserve)
{
	int fd, r;

	r = dlpc__size_fits(name, size);
	if (r < 0)
		return r;
	fd = dlpc__memfd_open(name, size, 0);
	if (fd < 0)
		return fd;
	/* reserve the pages now: memory that cannot be had fails here, not with SIGBUS in some
	 * attacher later */
	do
		r = reserve ? fallocate(fd, 0, 0, (off_t)size) : 0;
	while (r < 0 && errno == EINTR);
	if (r < 0 && errno != EOPNOTSUPP) {
		r = dlpc__fail(dlpc__space_err(errno),
			       "cannot reserve %llu bytes of shared memory for '%s': %m",
			       (unsigned long long)size, name);
		goto fail;
	}
	return fd;
fail:
	close(fd);
	return r;
}

/* Seals every published storage carries; read-only ones add F_SEAL_WRITE. */
#define SEALS_FINAL (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/*
 * Memory published a second time is sealed already (F_SEAL_SEAL is set): 1 if the same way as
 * this publish asks, a negative errno naming the conflict if not; 0 if not sealed yet.
 */
static int sealed_already(int fd, const char *name, bool writable)
{
	int have = fcntl(fd, F_GET_SEALS);

	if (have < 0 || !(have & F_SEAL_SEAL))
		return 0;
	if ((have & SEALS_FINAL) == SEALS_FINAL &&
	    (writable ? !(have & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) : (have & F_SEAL_WRITE)))
		return 1;
	return dlpc__fail(-EPERM, "cannot publish '%s' %s: its memory was already published %s",
			  name, writable ? "writable" : "read-only",
			  writable ? "read-only" : "writable");
}

/* Add @p seals to @p fd; the message explains the EBUSY of a surviving writable mapping. */
static int add_seals(int fd, int seals, const char *name)
{
	if (fcntl(fd, F_ADD_SEALS, seals) == 0)
		return 0;
	if (errno == EBUSY)
		return dlpc__fail(-EBUSY,
				  "cannot publish '%s' read-only: its memory is still mapped "
				  "writable elsewhere (a child forked while it was mapped, or a "
				  "mapping of the memfd made outside libdlpc), so F_SEAL_WRITE "
				  "cannot be added; unmap it there or publish writable",
				  name);
	return dlpc__fail(-errno, "cannot publish '%s': cannot seal shared memory: %m", name);
}

int dlpc__memfd_seal(int fd, const char *name, bool writable)
{
	int r = sealed_already(fd, name, writable);

	if (r != 0)
		return r < 0 ? r : 0;
	return add_seals(fd, SEALS_FINAL | (writable ? 0 : F_SEAL_WRITE), name);
}

/* Freezing dlpc_alloc() memory is rare and must not race another publish of the same memory. */
static pthread_mutex_t seal_mu = PTHREAD_MUTEX_INITIALIZER;

/* After a failed seal: put the writable mapping back; should even that fail (out of memory),
 * the memory stays read-only here and new views say so. */
static void remap_writable(struct dlpc__region *r)
{
	if (mmap(r->base, r->len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, r->fd, 0) ==
	    MAP_FAILED)
		atomic_store(&r->frozen, true);
}

/*
 * region_freeze() where /proc is not mounted (a chroot, a bare mount namespace): no read-only
 * descriptor can be had. Our mapping is swapped for an inaccessible placeholder (same
 * addresses, never a gap another mmap could take), the memfd is sealed, and the memory mapped
 * back read-only. From Linux 6.7 a shared mapping of a write-sealed memfd can never become
 * writable; before that the kernel refuses it, and a private read-only mapping shows the same
 * pages (making that one writable would change nothing anyone else sees). Other threads that
 * read the memory during the swap fault; /proc avoids that window.
 */
static int region_freeze_without_proc(struct dlpc__region *r, const char *name)
{
	int err;

	if (mmap(r->base, r->len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
	    MAP_FAILED)
		return dlpc__fail(-errno, "cannot publish '%s' read-only: cannot remap it: %m",
				  name);
	err = add_seals(r->fd, SEALS_FINAL | F_SEAL_WRITE, name);
	if (err < 0) {
		remap_writable(r);
		return err;
	}
	if (mmap(r->base, r->len, PROT_READ, MAP_SHARED | MAP_FIXED, r->fd, 0) == MAP_FAILED &&
	    mmap(r->base, r->len, PROT_READ, MAP_PRIVATE | MAP_FIXED, r->fd, 0) == MAP_FAILED)
		return dlpc__fail(-errno,
				  "cannot publish '%s' read-only: sealed, but cannot map it again "
				  "here: %m",
				  name);
	return 0;
}

/*
 * Seal the memfd of dlpc_alloc() memory @p r for a read-only publish. F_SEAL_WRITE is refused
 * while any writable shared mapping exists, ours included, and a mapping of a read-write
 * descriptor counts as writable even when mprotected read-only (it may become writable again).
 * So our mapping is first replaced, at the same addresses (views and pointers into it stay
 * valid), by one made from a read-only descriptor of the same memfd: that one can never be made
 * writable. If sealing still fails, a writable mapping lives on elsewhere; the writable mapping
 * is put back and the publish fails.
 */
static int region_freeze(struct dlpc__region *r, const char *name)
{
	char path[32];
	int ro, err;

	snprintf(path, sizeof(path), "/proc/self/fd/%d", r->fd);
	ro = open(path, O_RDONLY | O_CLOEXEC);
	if (ro < 0)
		return region_freeze_without_proc(r, name);
	if (mmap(r->base, r->len, PROT_READ, MAP_SHARED | MAP_FIXED, ro, 0) == MAP_FAILED) {
		err = dlpc__fail(-errno, "cannot publish '%s' read-only: cannot remap it: %m",
				 name);
		close(ro);
		return err;
	}
	close(ro); /* the mapping holds the file */
	err = add_seals(r->fd, SEALS_FINAL | F_SEAL_WRITE, name);
	if (err < 0)
		remap_writable(r);
	return err;
}

int dlpc__region_seal(struct dlpc__region *r, const char *name, bool writable)
{
	int err;

	/* sent again and again (a buffer a channel's sender reuses): nothing left to do */
	if (!writable && atomic_load(&r->sealed_ro))
		return 0;
	pthread_mutex_lock(&seal_mu);
	err = sealed_already(r->fd, name, writable);
	if (err == 0 && writable)
		err = add_seals(r->fd, SEALS_FINAL, name);
	else if (err == 0)
		err = region_freeze(r, name);
	else if (err > 0)
		err = 0;
	if (err == 0 && !writable) {
		atomic_store(&r->frozen, true);
		atomic_store(&r->sealed_ro, true);
	}
	pthread_mutex_unlock(&seal_mu);
	return err;
}

/* Check @p device for dlpc_alloc() and dlpc_alloc_bundle() (@p what). 0 or -ENOTSUP. */
static int alloc_device(DLDevice device, const char *what)
{
	if ((device.device_type != kDLCPU || device.device_id != 0) &&
	    (device.device_type != kDLCUDA || device.device_id < 0))
		return dlpc__fail(-ENOTSUP, "%s: device %d:%d is not supported", what,
				  (int)device.device_type, (int)device.device_id);
	return 0;
}

/* A memfd of the warm pool for @p r (@p size bytes), mapped here writable with every page
 * allocated (from DLPC__WARM_MAP_MIN bytes, faulted in too); false if the pool has none of about
 * that size. Either way the pool has noted the size (r->warm_noted): it keeps one from a size's
 * second use, filled once the allocation is published (dlpc__warm_refill()). */
static bool alloc_warm(struct dlpc__region *r, uint64_t size)
{
	size_t map_len, len = (size_t)size;
	void *map;
	int fd = dlpc__warm_take(size, &map, &map_len);

	atomic_store(&r->warm_noted, true);
	if (fd < 0)
		return false;
	if (map) {
		/* the pool's mapping is kept from forked children (a seal fails while a writable
		 * mapping exists); dlpc_alloc() memory is inherited as any other mapping. The tail
		 * past the memfd's new size goes first, so that the advice covers the whole mapping
		 * (no split); where either fails, a mapping of our own instead (the pages stay). */
		size_t keep = ((len - 1) | ((size_t)sysconf(_SC_PAGESIZE) - 1)) + 1;

		if ((map_len > keep && munmap((uint8_t *)map + keep, map_len - keep) < 0) ||
		    madvise(map, keep, MADV_DOFORK) < 0) {
			munmap(map, map_len);
			map = NULL;
		}
	}
	if (!map) {
		map = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (map == MAP_FAILED) {
			close(fd);
			return false;
		}
	}
	r->fd = fd;
	r->base = map;
	r->len = len;
	return true;
}

/* alloc_host()'s memfd of its own: 0 or negative errno (-ENOSPC where memory ran out). */
static int alloc_own(struct dlpc__region *r, uint64_t size, const char *what)
{
	/* with shmem_enabled "advise", huge pages go to pages first touched through a mapping
	 * marked MADV_HUGEPAGE: the reservation faults them in through ours */
	bool advise = dlpc__huge_for(size, false) == DLPC__HUGE_ADVISE;
	int err;

	r->fd = dlpc__memfd_create(what, size, !advise);
	if (r->fd < 0)
		return r->fd;
	r->len = (size_t)size;
	r->base = mmap(NULL, r->len, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
	if (r->base == MAP_FAILED) {
		err = dlpc__fail(-errno, "%s: cannot map %llu bytes: %m", what,
				 (unsigned long long)size);
		close(r->fd);
		return err;
	}
	if (advise) {
		(void)madvise(r->base, r->len, MADV_HUGEPAGE);
		/* no runs: the threads only allocate, each its part */
		err = dlpc__split_copy(r->base, size, r->fd, DLPC__SPLIT_POPULATE, NULL, 0);
		if (err < 0) {
			err = dlpc__fail(dlpc__space_err(-err),
					 "cannot reserve %llu bytes of shared memory for '%s': %s",
					 (unsigned long long)size, what, strerror(-err));
			munmap(r->base, r->len);
			close(r->fd);
			return err;
		}
	}
	return 0;
}

/* The memfd of @p r, @p size bytes mapped here with every page allocated (huge ones where the
 * machine allows them; with "advise" faulted in by threads, dlpc__split_copy()), for dlpc_alloc()
 * (@p what): one of the warm pool's where @p warm and it has one of that size. 0 or negative
 * errno. */
static int alloc_host(struct dlpc__region *r, uint64_t size, const char *what, bool warm)
{
	int err;

	if (warm && size >= DLPC_WARM_SIZE_MIN && alloc_warm(r, size))
		return 0;
	err = alloc_own(r, size, what);
	/* memory the warm pool holds never makes an allocation fail: it is given back first */
	if (err == -ENOSPC && dlpc__warm_drop())
		err = alloc_own(r, size, what);
	return err;
}

/* A new region of @p size bytes (> 0) on @p device, holding one reference (the caller's):
 * a memfd mapped here, or CUDA VMM memory exportable as an fd the daemon can hold. */
int dlpc__alloc_region(DLDevice device, uint64_t size, const char *what, bool warm,
		       struct dlpc__region **ret)
{
	struct dlpc__region *r = calloc(1, sizeof(*r));
	int err;

	if (!r)
		return dlpc__fail(-ENOMEM, "%s: out of memory", what);
	atomic_init(&r->warm_noted, false);
	if (device.device_type == kDLCUDA) {
		err = dlpc__cuda_vmm_alloc(device.device_id, size, &r->gpu, &r->base, &r->len,
					   &r->fd, r->uuid, what);
		if (err < 0) {
			free(r);
			return err;
		}
		r->device = true;
	} else {
		err = alloc_host(r, size, what, warm);
		if (err < 0) {
			free(r);
			return err;
		}
	}
	atomic_init(&r->refs, 1);
	atomic_init(&r->frozen, false);
	atomic_init(&r->sealed_ro, false);
	r->nparts = 1;
	*ret = r;
	return 0;
}

DLPC_EXPORT int dlpc_alloc(dlpc_client *c, DLDevice device, DLDataType dtype, int32_t ndim,
			   const int64_t *shape, DLManagedTensorVersioned **ret)
{
	struct dlpc__region *r;
	uint64_t nbytes, size;
	int err;

	if (!ret || ndim < 0 || ndim > DLPC_NDIM_MAX || (ndim > 0 && !shape))
		return dlpc__fail(-EINVAL, "dlpc_alloc: bad arguments (ndim %d)", (int)ndim);
	*ret = NULL;
	if (c && (err = dlpc__check(c)) < 0)
		return err;
	if ((err = alloc_device(device, "dlpc_alloc")) < 0)
		return err;
	if (dlpc__tensor_nbytes(dtype.bits, dtype.lanes, shape, (size_t)ndim, &nbytes) < 0 ||
	    !dlpc__align_up(nbytes, &size) || size > INT64_MAX)
		return dlpc__fail(-EINVAL, "dlpc_alloc: bad dtype or shape");
	err = dlpc__alloc_region(device, size ? size : DLPC_ALIGN, "dlpc_alloc", true, &r);
	if (err < 0)
		return err;
	/* the region's own reference is handed to the view, which takes one more */
	*ret = dlpc__view_new(r, r->base, device, dtype, ndim, shape, 0);
	dlpc__region_unref(r);
	return *ret ? 0 : dlpc__fail(-ENOMEM, "dlpc_alloc: out of memory");
}

DLPC_EXPORT int dlpc_alloc_bundle(dlpc_client *c, DLDevice device, size_t n,
				  const DLDataType dtypes[], const int32_t ndims[],
				  const int64_t *const shapes[], DLManagedTensorVersioned *ret[])
{
	struct dlpc__region *r = NULL;
	uint64_t *offsets, size = 0, nbytes;
	int err;

	for (size_t i = 0; ret && n <= DLPC_BUNDLE_MAX && i < n; i++)
		ret[i] = NULL;
	if (!ret || n == 0 || n > DLPC_BUNDLE_MAX || !dtypes || !ndims || !shapes)
		return dlpc__fail(-EINVAL,
				  "dlpc_alloc_bundle: bad arguments (%zu tensors, at most "
				  "DLPC_BUNDLE_MAX %d)",
				  n, DLPC_BUNDLE_MAX);
	if (c && (err = dlpc__check(c)) < 0)
		return err;
	if ((err = alloc_device(device, "dlpc_alloc_bundle")) < 0)
		return err;
	offsets = calloc(n, sizeof(*offsets));
	if (!offsets)
		return dlpc__fail(-ENOMEM, "dlpc_alloc_bundle: out of memory");
	/* the layout dlpc_publish_bundle() makes of a copy: each tensor at the next boundary */
	for (size_t i = 0; i < n; i++) {
		if (ndims[i] < 0 || ndims[i] > DLPC_NDIM_MAX || (ndims[i] > 0 && !shapes[i]) ||
		    dlpc__tensor_nbytes(dtypes[i].bits, dtypes[i].lanes, shapes[i],
					(size_t)ndims[i], &nbytes) < 0 ||
		    !dlpc__align_up(size, &offsets[i]) ||
		    __builtin_add_overflow(offsets[i], nbytes, &size) || size > INT64_MAX) {
			free(offsets);
			return dlpc__fail(-EINVAL,
					  "dlpc_alloc_bundle: bad dtype or shape (tensor "
					  "%zu), or too large",
					  i);
		}
	}
	if (!dlpc__align_up(size, &size)) {
		free(offsets);
		return dlpc__fail(-EINVAL, "dlpc_alloc_bundle: too large");
	}
	err = dlpc__alloc_region(device, size ? size : DLPC_ALIGN, "dlpc_alloc_bundle", true, &r);
	if (err == 0) {
		/* the region keeps the layout: only all of it is published without a copy */
		r->nparts = n;
		r->parts = offsets;
		offsets = NULL;
	}
	for (size_t i = 0; err == 0 && i < n; i++) {
		ret[i] = dlpc__view_new(r, (uint8_t *)r->base + r->parts[i], device, dtypes[i],
					ndims[i], shapes[i], 0);
		if (!ret[i])
			err = dlpc__fail(-ENOMEM, "dlpc_alloc_bundle: out of memory");
	}
	/* the views hold the region; on failure none is handed out */
	for (size_t i = 0; err < 0 && i < n && ret[i]; i++) {
		ret[i]->deleter(ret[i]);
		ret[i] = NULL;
	}
	if (r)
		dlpc__region_unref(r);
	free(offsets);
	return err;
}
