/* SPDX-License-Identifier: Apache-2.0 */
/* libdlpc: what every file may use (base.c, error.c, discover.c); none of it calls into the
 * library. */
#ifndef DLPC_CLIENT_BASE_H
#define DLPC_CLIENT_BASE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include <dlpc/dlpc.h>

#include "util.h" /* dlpc__mono_ms() */

/* ---- base.c: what every file may use; it uses nothing of the library's but error.c ---- */
/* Has @p dl (CLOCK_MONOTONIC) passed? */
bool dlpc__passed(const struct timespec *dl);
/* @p ms from now on CLOCK_MONOTONIC. */
void dlpc__deadline_in(struct timespec *dl, int64_t ms);
/* The milliseconds left until @p dl (CLOCK_MONOTONIC), rounded up; 0 once it has passed,
 * INT64_MAX for one further than INT64_MAX ms can say. */
int64_t dlpc__ms_left(const struct timespec *dl);
/* Start a detached thread of the library's running @p fn(@p arg), every signal blocked on it
 * (the user's handlers never run there). false if none could be made. */
bool dlpc__start_thread(void *(*fn)(void *), void *arg);
/* The same, joinable (its id in *@p t, for pthread_join()), the signals of a fault of its own
 * (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP) not blocked: it works for a caller that waits. */
bool dlpc__start_joinable(pthread_t *t, void *(*fn)(void *), void *arg);
/* 0, or -EBADFD (with the message set) when @p c is used from a process that did not create it. */
int dlpc__check(const dlpc_client *c);
/* Validate a user-supplied name; 0 or -EINVAL with the message set. */
int dlpc__name_arg(const char *name, const char *what);
/* Close @p fd on a thread of the library's own (one a peer sent and libdlpc refused: its close
 * may block), or here if that thread cannot run. A socket's SO_LINGER is turned off first. */
void dlpc__close_later(int fd);
/* The fds dlpc__close_later() was given that are not closed yet (DLPC_CLOSING_MAX). */
size_t dlpc__closing_held(void);
/* In a forked child: the parent's fds to close are the parent's; start the closing afresh. */
void dlpc__closer_forked(void);

/* Bytes of the message dlpc_last_error() keeps (longer ones are cut): room for a failed
 * connect's every path tried, with the hint of dlpc__access_hint(). */
#define DLPC_ERROR_TEXT_MAX 1024
/* error.c: record @p err and a message for dlpc_last_error() in this thread; returns @p err. */
int dlpc__fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* discover.c: for a connect() to @p path refused with EACCES, "; the socket belongs to group
 * 'dlpack': join it with ..." (empty when nothing can be said), into @p buf. */
void dlpc__access_hint(const char *path, char *buf, size_t len);

#endif
