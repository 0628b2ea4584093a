/* SPDX-License-Identifier: Apache-2.0 */
/* Closing fds on threads, off the event loop (reaper.c says why). */
#ifndef DLPD_REAPER_H
#define DLPD_REAPER_H

#include <stddef.h>

int dlpd_reaper_start(void);
/* Close what is queued, then stop the threads. */
void dlpd_reaper_stop(void);
/* Close an fd whose close cannot block (a host storage memfd, a client socket) off the loop. */
void dlpd_close_later(int fd);
/* Close an fd a client sent (or one whose file the daemon cannot vouch for) off the loop, on
 * a thread of its own. */
void dlpd_close_untrusted(int fd);
/* Close nothing more: fds still queued stay open until the process executes a new image, which
 * closes them (they are all close-on-exec). Lets upgrade.c move fds to numbers the queues may
 * hold. */
void dlpd_reaper_freeze(void);
/* fds handed to the reapers and not closed yet. */
size_t dlpd_reaper_pending(void);

#endif
