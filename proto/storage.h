/* SPDX-License-Identifier: Apache-2.0 */
/* What dlpackd accepts as storage, and a receiver of a direct channel too (storage.c), judged
 * from the fd alone. */
#ifndef DLPC_PROTO_STORAGE_H
#define DLPC_PROTO_STORAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What host storage is for: sealed read-only (F_SEAL_WRITE); published writable (a read-write
 * descriptor, no write seal); a channel's recycled buffer, which only its sender writes (no
 * write seal, a read-only descriptor of a memfd without write permission bits: no receiver can
 * map it writable, write it, or reopen it writable through /proc/self/fd). */
enum dlpc__storage_kind {
	DLPC__STORAGE_SEALED = 0,
	DLPC__STORAGE_WRITABLE = 1,
	DLPC__STORAGE_POOLED = 2,
};

/* Is @p fd acceptable as host storage of @p kind? 0, or negative errno and the reason. */
int dlpc__storage_check(int fd, uint64_t size, enum dlpc__storage_kind kind, char *why,
			size_t whylen);
/* The same for a CUDA VMM export fd, which the daemon cannot look into: a file of NVIDIA's
 * driver (a character device of its major), or shmem such as the memfd the fake driver of the
 * tests exports. A file on a disk or FUSE filesystem, whose close could block, is refused. */
int dlpc__device_storage_check(int fd, char *why, size_t whylen);

#endif
