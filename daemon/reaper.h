/* SPDX-License-Identifier: Apache-2.0 */
/* Closing fds on threads, off the event loop (reaper.c says why). */
#ifndef DLPD_REAPER_H
#define DLPD_REAPER_H

#include <stddef.h>

/*
 * The most memory (allocated blocks) a storage fd closed on the loop may hold. Freeing a 4 KiB
 * memfd takes ~3.5 us, 16 KiB ~6 us, 64 KiB ~12 us (a 2-vCPU VM); waking a reaper and running
 * it costs two context switches, ~5 us, on a busy CPU.
 */
#define DLPD_CLOSE_INLINE_BYTES (16u << 10)

int dlpd_reaper_start(void);
/* Close what is queued, then stop the threads. */
void dlpd_reaper_stop(void);
/* Close an fd whose close cannot block (a host storage memfd) off the loop. */
void dlpd_close_later(int fd);
/*
 * Close the fd of a host storage (a sealed memfd or hugetlbfs file that passed storage.c's
 * checks): here, on the loop, when the memory its last close could free is at most
 * DLPD_CLOSE_INLINE_BYTES, which costs less than waking a reaper; off the loop otherwise.
 */
void dlpd_close_storage(int fd);
/* Close nothing more: fds still queued stay open until the process executes a new image, which
 * closes them (they are all close-on-exec). Lets upgrade.c move fds to numbers the queues may
 * hold. */
void dlpd_reaper_freeze(void);
/* fds handed to the reaper and not closed yet. */
size_t dlpd_reaper_pending(void);
/* fds ever handed to the reaper (since the process started). */
size_t dlpd_reaper_handed(void);

#endif
