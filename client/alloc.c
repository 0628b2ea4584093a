/* SPDX-License-Identifier: Apache-2.0 */
/* Shared memory owned by this process: memfds for publishing, and dlpc_alloc(). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include "internal.h"
#include "util.h"

#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif

/* Below this size, the machine's memory is not consulted before allocating. */
#define SMALL_ALLOC (64u << 20)

/*
 * Refuse sizes that cannot work before the kernel is asked: one over the file size limit would
 * get SIGXFSZ (which kills by default) from ftruncate, and one over the machine's memory and swap
 * would have fallocate or the writes take memory until the OOM killer steps in (memfds are not
 * on /dev/shm and have no size limit of their own).
 */
static int size_fits(const char *name, uint64_t size)
{
	struct rlimit rl;
	struct sysinfo si;

	if (getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && size > rl.rlim_cur)
		return dlpc__fail(-EFBIG,
				  "cannot create %llu bytes of shared memory for '%s': this "
				  "process's file size limit (RLIMIT_FSIZE) is %llu bytes",
				  (unsigned long long)size, name, (unsigned long long)rl.rlim_cur);
	if (size > SMALL_ALLOC && sysinfo(&si) == 0) {
		uint64_t total = ((uint64_t)si.totalram + si.totalswap) * si.mem_unit;

		if (size > total)
			return dlpc__fail(-ENOSPC,
					  "cannot reserve %llu bytes of shared memory for '%s': "
					  "this machine has %llu bytes of memory and swap",
					  (unsigned long long)size, name,
					  (unsigned long long)total);
	}
	return 0;
}

int dlpc__memfd_create(const char *name, uint64_t size, bool reserve)
{
	char label[64];
	int fd, r;

	r = size_fits(name, size);
	if (r < 0)
		return r;
	snprintf(label, sizeof(label), "dlpc:%s", name);
	fd = memfd_create(label, MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL);
	if (fd < 0 && errno == EINVAL) /* kernels before 6.3 */
		fd = memfd_create(label, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return dlpc__fail(-errno, "cannot create shared memory for '%s': memfd_create: %m",
				  name);
	if (ftruncate(fd, (off_t)size) < 0) {
		r = dlpc__fail(-errno, "cannot size shared memory for '%s' to %llu bytes: %m", name,
			       (unsigned long long)size);
		goto fail;
	}
	/* reserve the pages now: a full /dev/shm or memory cgroup fails here, not with SIGBUS in
	 * some attacher later */
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

int dlpc__memfd_seal(int fd, const char *name, bool writable)
{
	int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL | (writable ? 0 : F_SEAL_FUTURE_WRITE);
	int have = fcntl(fd, F_GET_SEALS);

	/* dlpc_alloc memory published a second time is sealed already: fine if the same way */
	if (have >= 0 && (have & F_SEAL_SEAL)) {
		if ((have & want) == want && (writable ? !(have & F_SEAL_FUTURE_WRITE) : true))
			return 0;
		return dlpc__fail(
			-EPERM, "cannot publish '%s' %s: its memory was already published %s", name,
			writable ? "writable" : "read-only", writable ? "read-only" : "writable");
	}
	if (fcntl(fd, F_ADD_SEALS, want) < 0)
		return dlpc__fail(-errno, "cannot publish '%s': cannot seal shared memory: %m",
				  name);
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
	if (device.device_type != kDLCPU || device.device_id != 0)
		return dlpc__fail(-ENOTSUP, "dlpc_alloc: device %d:%d is not supported",
				  (int)device.device_type, (int)device.device_id);
	if (dlpc__tensor_nbytes(dtype.bits, dtype.lanes, shape, (size_t)ndim, &nbytes) < 0 ||
	    !dlpc__align_up(nbytes, &size) || size > INT64_MAX)
		return dlpc__fail(-EINVAL, "dlpc_alloc: bad dtype or shape");
	size = size ? size : DLPC_ALIGN;
	r = calloc(1, sizeof(*r));
	if (!r)
		return dlpc__fail(-ENOMEM, "dlpc_alloc: out of memory");
	r->fd = dlpc__memfd_create("dlpc_alloc", size, true);
	if (r->fd < 0) {
		err = r->fd;
		free(r);
		return err;
	}
	r->len = (size_t)size;
	r->base = mmap(NULL, r->len, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
	if (r->base == MAP_FAILED) {
		err = dlpc__fail(-errno, "dlpc_alloc: cannot map %llu bytes: %m",
				 (unsigned long long)size);
		close(r->fd);
		free(r);
		return err;
	}
	/* the region's own reference is handed to the view, which takes one more */
	atomic_init(&r->refs, 1);
	atomic_init(&r->frozen, false);
	*ret = dlpc__view_new(r, r->base, device, dtype, ndim, shape, 0);
	dlpc__region_unref(r);
	return *ret ? 0 : dlpc__fail(-ENOMEM, "dlpc_alloc: out of memory");
}
