/* SPDX-License-Identifier: Apache-2.0 */
/* What the daemon accepts as storage (storage.c), judged from the fd alone. */
#ifndef DLPD_STORAGE_H
#define DLPD_STORAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Is @p fd acceptable as host storage? 0, or negative errno and the reason. */
int dlpd_storage_check(int fd, uint64_t size, bool writable, char *why, size_t whylen);
/* The same for a CUDA VMM export fd, which the daemon cannot look into: a file of NVIDIA's
 * driver (a character device of its major), or shmem such as the memfd the fake driver of the
 * tests exports. A file on a disk or FUSE filesystem, whose close could block, is refused. */
int dlpd_device_storage_check(int fd, char *why, size_t whylen);

#endif
