/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The library's thread: one per process, started when first needed, with every signal blocked.
 * This file says when it runs and what wakes it (deadlines, wake-ups, the sockets it polls);
 * what it does each turn is serve.c's, handed over by dlpc__loop_init(). An event loop (poll())
 * that serves, for every open client of the process:
 *
 *  - deferred releases (and the cache's marks): sent DLPC_RELEASE_DELAY_MS after the first of
 *    a quiet spell, unless a request of the connection carried them first; where the socket
 *    had no room for them, when it has (serve.c polls it for room);
 *  - RECLAIM notices of legacy CUDA IPC and lent VMM publications: the socket of a connection
 *    with such publications outstanding is read whenever no call of the process reads it, so a
 *    notice is acted on (the publication's deleter run, here, outside every lock) while the
 *    process makes no calls; the loop holds a reference on the client meanwhile, which keeps
 *    the connection open after dlpc_close() until the last publication is reclaimed (or the
 *    connection is lost: the publications are then kept until the process exits, nobody can say
 *    any more whether an attacher still uses them);
 *  - the features' hooks (struct dlpc__hooks): the cache (cache.c) has INVALIDATE frames read
 *    from the sockets of clients with idle entries, so that a replaced entry's storage is let go
 *    at once, and its idle entries evicted when their time is up.
 *
 * (A second thread, base.c's, started when first needed, closes the fds a peer sent that libdlpc
 * refused, dlpc__close_later(): such a close may block, and must not stop this loop. One thread
 * only, whatever blocks it: the fds it has yet to close are counted (dlpc__closing_held()), and
 * past DLPC_CLOSING_MAX a direct channel that sends more is no longer read, direct_io.c.)
 *
 * Reading a socket is taking the reader's turn without waiting (dlpc__drain()): when a call's
 * thread has it, that thread delivers what comes, and the loop looks again a little later
 * (DLPC__LOOP_BUSY_MS) or when woken (a RECLAIM delivered by another reader wakes it).
 */
#include <assert.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core.h"

static pthread_mutex_t loop_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t loop_cv = PTHREAD_COND_INITIALIZER; /* waited on with no socket to read */
static bool running;	      /* in this process: a forked child starts its own */
static void (*turn_fn)(void); /* what the thread does, turn after turn (serve.c) */
static bool woken;	      /* dlpc__loop_wake() since the loop last looked */
/* eventfd that wakes a poll() of sockets: made the first time the loop reads one (a process
 * that never does has no fd of the library's beyond its connections) */
static int loop_fd = -1;
static bool flush_wanted; /* deferred releases wait, to go at flush_due */
static int64_t flush_due;
static int64_t sweep_due; /* when the caches' idle entries are next due (monotonic ms; 0: none) */

/* Wait on loop_cv until woken or @p timeout ms (< 0: none) pass. Under loop_mu. */
static void wait_woken(int timeout)
{
	struct timespec ts;

	if (timeout < 0) {
		pthread_cond_wait(&loop_cv, &loop_mu);
		return;
	}
	/* loop_cv runs on CLOCK_REALTIME: a jump of that clock makes one look early or late, and
	 * the next look is computed afresh */
	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += timeout / 1000;
	ts.tv_nsec += (long)(timeout % 1000) * 1000000L;
	if (ts.tv_nsec >= 1000000000L) {
		ts.tv_sec++;
		ts.tv_nsec -= 1000000000L;
	}
	pthread_cond_timedwait(&loop_cv, &loop_mu, &ts);
}

/* Wake the loop. Under loop_mu. */
static void wake_locked(void)
{
	woken = true;
	pthread_cond_signal(&loop_cv);
	if (loop_fd >= 0 && eventfd_write(loop_fd, 1) < 0) {
		/* the counter cannot overflow here; nothing to do */
	}
}

void dlpc__loop_wake(void)
{
	pthread_mutex_lock(&loop_mu);
	wake_locked();
	pthread_mutex_unlock(&loop_mu);
}

void dlpc__loop_atfork(int phase)
{
	if (phase == 0) {
		pthread_mutex_lock(&loop_mu);
	} else if (phase == 1) {
		pthread_mutex_unlock(&loop_mu);
	} else {
		/* the child: the parent's thread does not run here, and the lock may be in any
		 * state the fork froze; start afresh */
		dlpc__close(loop_fd);
		loop_fd = -1;
		running = false;
		woken = false;
		flush_wanted = false;
		sweep_due = 0;
		dlpc__closer_forked();
		/* the parent's thread may count as a waiter of the condition variable */
		pthread_cond_init(&loop_cv, NULL);
		pthread_mutex_init(&loop_mu, NULL);
	}
}

/* The poll() timeout until the next deadline (-1: none), and what is due now. */
int dlpc__loop_due(bool *flush, bool *sweep)
{
	int64_t now = dlpc__mono_ms(), next = -1;

	pthread_mutex_lock(&loop_mu);
	*flush = flush_wanted && now >= flush_due;
	if (*flush)
		flush_wanted = false;
	*sweep = sweep_due && now >= sweep_due;
	if (*sweep)
		sweep_due = 0;
	if (flush_wanted)
		next = flush_due - now;
	if (sweep_due && (next < 0 || sweep_due - now < next))
		next = sweep_due - now;
	pthread_mutex_unlock(&loop_mu);
	return next < 0 ? -1 : next > INT32_MAX ? INT32_MAX : (int)next;
}

static _Thread_local bool on_loop;

bool dlpc__loop_is_self(void)
{
	return on_loop;
}

static void *loop_main(void *arg)
{
	(void)arg;
	on_loop = true;
	pthread_setname_np(pthread_self(), "dlpc-loop"); /* for top -H, gdb, and the tests */
	for (;;)
		turn_fn();
	return NULL;
}

/* Start the thread unless it runs. Under loop_mu. false when it cannot run (or has nothing to
 * run: no connection was made yet). */
static bool start_locked(void)
{
	if (!running && turn_fn)
		running = dlpc__start_thread(loop_main, NULL);
	return running;
}

void dlpc__loop_init(void (*turn)(void))
{
	assert(turn);
	pthread_mutex_lock(&loop_mu);
	turn_fn = turn;
	pthread_mutex_unlock(&loop_mu);
}

bool dlpc__loop_start(void)
{
	bool ok;

	pthread_mutex_lock(&loop_mu);
	ok = start_locked();
	wake_locked();
	pthread_mutex_unlock(&loop_mu);
	return ok;
}

size_t dlpc__loop_wait(struct pollfd *p, size_t np, int timeout)
{
	pthread_mutex_lock(&loop_mu);
	if (np > 1 && loop_fd < 0)
		loop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	/* no fd to be woken by (poll() skips p[0] then): look again soon */
	if (np > 1 && loop_fd < 0 && (timeout < 0 || timeout > DLPC__LOOP_BUSY_MS))
		timeout = DLPC__LOOP_BUSY_MS;
	if (p)
		p[0].fd = loop_fd;
	if (woken) {
		timeout = 0;
	} else if (np == 1 && timeout != 0) {
		wait_woken(timeout);
		timeout = 0;
	}
	woken = false;
	pthread_mutex_unlock(&loop_mu);
	if (np > 1 && poll(p, (nfds_t)np, timeout) > 0) {
		eventfd_t x;

		if (p[0].revents)
			eventfd_read(loop_fd, &x);
		return np;
	}
	return 0;
}

void dlpc__loop_looked(void)
{
	pthread_mutex_lock(&loop_mu);
	woken = false;
	pthread_mutex_unlock(&loop_mu);
}

bool dlpc__loop_flush_soon(bool now)
{
	int64_t due = dlpc__mono_ms() + (now ? 0 : DLPC_RELEASE_DELAY_MS);
	bool ok;

	pthread_mutex_lock(&loop_mu);
	ok = start_locked();
	if (ok && (!flush_wanted || due < flush_due)) {
		flush_wanted = true;
		flush_due = due;
		wake_locked();
	}
	pthread_mutex_unlock(&loop_mu);
	return ok;
}

bool dlpc__sweep_at(int64_t when)
{
	bool ok;

	pthread_mutex_lock(&loop_mu);
	/* without the thread idle entries go when the bounds or a later release push them out */
	ok = start_locked();
	if (ok && (!sweep_due || when < sweep_due)) {
		sweep_due = when;
		wake_locked();
	}
	pthread_mutex_unlock(&loop_mu);
	return ok;
}
