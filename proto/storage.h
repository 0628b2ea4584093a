/* SPDX-License-Identifier: Apache-2.0 */
/* What dlpackd accepts as storage, and a receiver of a direct channel too (storage.c), judged
 * from the fd alone. */
#ifndef DLPC_PROTO_STORAGE_H
#define DLPC_PROTO_STORAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Is @p fd acceptable as host storage? 0, or negative errno and the reason. */
int dlpc__storage_check(int fd, uint64_t size, bool writable, char *why, size_t whylen);
/* The same for a CUDA VMM export fd, which the daemon cannot look into: a file of NVIDIA's
 * driver (a character device of its major), or shmem such as the memfd the fake driver of the
 * tests exports. A file on a disk or FUSE filesystem, whose close could block, is refused. */
int dlpc__device_storage_check(int fd, char *why, size_t whylen);

#endif
