/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The library's thread: one per process, started when first needed, with every signal blocked.
 * An event loop (poll()) that serves, for every open client of the process:
 *
 *  - deferred releases (and the cache's marks): sent DLPC_RELEASE_DELAY_MS after the first of
 *    a quiet spell, unless a request of the connection carried them first;
 *  - RECLAIM notices of legacy CUDA IPC and lent VMM publications: the socket of a connection
 *    with such publications outstanding is read whenever no call of the process reads it, so a
 *    notice is acted on (the publication's deleter run, here, outside every lock) while the
 *    process makes no calls; the loop holds a reference on the client meanwhile, which keeps
 *    the connection open after dlpc_close() until the last publication is reclaimed (or the
 *    connection is lost: the publications are then kept until the process exits, nobody can say
 *    any more whether an attacher still uses them);
 *  - the cache (cache.c): INVALIDATE frames read from the sockets of clients with idle entries,
 *    so that a replaced entry's storage is let go at once, and idle entries evicted when their
 *    time is up.
 *
 * (A second thread, started when first needed, closes the fds a peer sent that libdlpc refused,
 * dlpc__close_later(): such a close may block, and must not stop this loop. One thread only,
 * whatever blocks it: the fds it has yet to close are counted (dlpc__closing_held()), and past
 * DLPC_CLOSING_MAX a direct channel that sends more is no longer read, direct_io.c.)
 *
 * Reading a socket is taking the reader's turn without waiting (dlpc__drain()): when a call's
 * thread has it, that thread delivers what comes, and the loop looks again a little later
 * (DLPC__LOOP_BUSY_MS) or when woken (a RECLAIM delivered by another reader wakes it).
 */
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"

/* How soon the loop looks again at a socket whose reader's turn another thread held (ms). */
#define DLPC__LOOP_BUSY_MS 10

static pthread_mutex_t loop_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t loop_cv = PTHREAD_COND_INITIALIZER; /* waited on with no socket to read */
static bool running; /* in this process: a forked child starts its own */
static bool woken;   /* dlpc__loop_wake() since the loop last looked */
/* eventfd that wakes a poll() of sockets: made the first time the loop reads one (a process
 * that never does has no fd of the library's beyond its connections) */
static int loop_fd = -1;
static bool flush_wanted; /* deferred releases wait, to go at flush_due */
static int64_t flush_due;
static int64_t sweep_due; /* when the caches' idle entries are next due (monotonic ms; 0: none) */

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

/* Is @p c's socket one the loop should read: publications awaiting RECLAIM, or idle cache
 * entries whose invalidations should free their storage? Under c->mu. */
static bool wants_reading(dlpc_client *c)
{
	if (c->broken || c->sock < 0)
		return false;
	if (c->reclaimer)
		return true;
	for (size_t i = 0; i < dlpc__nhooks; i++)
		if (dlpc__hooks[i]->wants_reading && dlpc__hooks[i]->wants_reading(c))
			return true;
	return false;
}

/* Run the deleter of the publication of RECLAIM's @p token: true if a feature knew it. */
static bool reclaim_run(uint64_t token)
{
	for (size_t i = 0; i < dlpc__nhooks; i++)
		if (dlpc__hooks[i]->reclaim_run && dlpc__hooks[i]->reclaim_run(token))
			return true;
	return false;
}

/* Run the deleters of @p c's reclaimed publications; let go of the loop's hold on @p c when
 * none is outstanding any more, or its connection is lost. */
static void reclaim(dlpc_client *c)
{
	bool drop = false;

	pthread_mutex_lock(&c->mu);
	while (c->nreclaimed) {
		size_t n = c->nreclaimed;
		uint64_t *v = malloc(n * sizeof(*v)), epoch = c->epoch;

		if (!v)
			break; /* out of memory: the next turn tries again */
		memcpy(v, c->reclaimed, n * sizeof(*v));
		c->nreclaimed = 0;
		pthread_mutex_unlock(&c->mu);
		/* a deleter may call libdlpc: no lock held */
		for (size_t i = 0; i < n; i++)
			if (reclaim_run(v[i]))
				dlpc__reclaim_count(c, -1, epoch);
		free(v);
		pthread_mutex_lock(&c->mu);
	}
	if (c->reclaimer && !c->nreclaimed && (c->broken || c->ipc_pubs == 0)) {
		c->reclaimer = false;
		drop = true;
	}
	pthread_mutex_unlock(&c->mu);
	if (drop)
		dlpc__client_unref(c);
}

/* The poll() timeout until the next deadline (-1: none), and what is due now. */
static int due(bool *flush, bool *sweep)
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

/* One turn: what is due now, then wait for the sockets, the wake-up or the next deadline. */
static void turn(void)
{
	/* kept from turn to turn in globals, not on this thread's stack only: in a child forked
	 * while the loop waits they are still reachable (no leak to report) */
	static dlpc_client **v, **owner;
	static struct pollfd *p;
	static size_t cap, pcap;
	size_t n = dlpc__clients_ref(&v, &cap), np = 1, nwait;
	bool flush, flush2, sweep, busy = false;
	int64_t next = 0;
	int timeout;

	/* reclaims first: they may have been delivered by any reader since the last turn */
	for (size_t i = 0; i < n; i++)
		reclaim(v[i]);

	timeout = due(&flush, &sweep);
	/* a sweep may fall due again while one runs (a slow machine): until none is due */
	while (sweep) {
		next = 0;
		for (size_t i = 0; i < n; i++)
			for (size_t h = 0; h < dlpc__nhooks; h++) {
				int64_t t = dlpc__hooks[h]->sweep ? dlpc__hooks[h]->sweep(v[i]) : 0;

				if (t && (!next || t < next))
					next = t;
			}
		if (next)
			dlpc__sweep_at(next);
		/* what became due meanwhile, and the next deadline: a flush taken now stays taken */
		timeout = due(&flush2, &sweep);
		flush = flush || flush2;
	}
	if (flush)
		for (size_t i = 0; i < n; i++) {
			pthread_mutex_lock(&v[i]->wmu);
			dlpc__flush_locked(v[i]);
			pthread_mutex_unlock(&v[i]->wmu);
		}
	if (n + 1 > pcap) {
		struct pollfd *grown = realloc(p, (n + 1) * sizeof(*p));
		dlpc_client **no = grown ? realloc(owner, (n + 1) * sizeof(*owner)) : NULL;

		if (grown)
			p = grown;
		if (no)
			owner = no;
		if (grown && no)
			pcap = n + 1;
	}
	if (p)
		p[0].events = POLLIN;
	for (size_t i = 0; n + 1 <= pcap && i < n; i++) {
		dlpc_client *c = v[i];

		pthread_mutex_lock(&c->mu);
		if (wants_reading(c)) {
			if (c->reading) {
				busy = true;
			} else {
				p[np].fd = c->sock;
				p[np].events = POLLIN;
				owner[np++] = c;
			}
		}
		pthread_mutex_unlock(&c->mu);
	}
	if (n + 1 > pcap)
		busy = true; /* out of memory: look again soon */
	if (busy && (timeout < 0 || timeout > DLPC__LOOP_BUSY_MS))
		timeout = DLPC__LOOP_BUSY_MS;
	/* only the clients whose sockets are polled stay referenced while the loop waits: a
	 * client closed meanwhile is freed by whoever lets go last, not kept by the loop */
	for (size_t i = 0; i < n; i++) {
		bool polled = false;

		for (size_t k = 1; k < np; k++)
			polled = polled || owner[k] == v[i];
		if (!polled)
			dlpc__client_unref(v[i]);
	}
	pthread_mutex_lock(&loop_mu);
	if (np > 1 && loop_fd < 0)
		loop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	nwait = np;
	if (np > 1 && loop_fd < 0)
		nwait = 1, timeout = DLPC__LOOP_BUSY_MS; /* no fd to be woken by: look again soon */
	if (p)
		p[0].fd = loop_fd;
	if (woken) {
		timeout = 0;
	} else if (nwait == 1 && timeout != 0) {
		struct timespec ts;

		/* loop_cv runs on CLOCK_REALTIME: a jump of that clock makes one look early or
		 * late, and the next look is computed afresh */
		clock_gettime(CLOCK_REALTIME, &ts);
		if (timeout > 0) {
			ts.tv_sec += timeout / 1000;
			ts.tv_nsec += (long)(timeout % 1000) * 1000000L;
			if (ts.tv_nsec >= 1000000000L) {
				ts.tv_sec++;
				ts.tv_nsec -= 1000000000L;
			}
			pthread_cond_timedwait(&loop_cv, &loop_mu, &ts);
		} else {
			pthread_cond_wait(&loop_cv, &loop_mu);
		}
		timeout = 0;
	}
	woken = false;
	pthread_mutex_unlock(&loop_mu);
	if (nwait > 1 && poll(p, (nfds_t)nwait, timeout) > 0) {
		eventfd_t x;

		if (p[0].revents)
			eventfd_read(loop_fd, &x);
		for (size_t i = 1; i < nwait; i++)
			if (p[i].revents)
				dlpc__drain(owner[i], true);
	}
	pthread_mutex_lock(&loop_mu);
	woken = false;
	pthread_mutex_unlock(&loop_mu);
	for (size_t i = 1; i < np; i++)
		dlpc__client_unref(owner[i]);
}

static void *loop_main(void *arg)
{
	(void)arg;
	for (;;)
		turn();
	return NULL;
}

/* Start the thread unless it runs. Under loop_mu. false when it cannot run. */
static bool start_locked(void)
{
	if (!running)
		running = dlpc__start_thread(loop_main, NULL);
	return running;
}

bool dlpc__loop_flush_soon(void)
{
	bool ok;

	pthread_mutex_lock(&loop_mu);
	ok = start_locked();
	if (ok && !flush_wanted) {
		flush_wanted = true;
		flush_due = dlpc__mono_ms() + DLPC_RELEASE_DELAY_MS;
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

void dlpc__reclaim_start(dlpc_client *c)
{
	bool hold = false, ok;

	pthread_mutex_lock(&c->mu);
	if (!c->reclaimer && !c->broken) {
		/* the loop's hold on the client, dropped by reclaim() */
		dlpc__client_ref(c);
		c->reclaimer = hold = true;
	}
	pthread_mutex_unlock(&c->mu);
	pthread_mutex_lock(&loop_mu);
	ok = start_locked();
	wake_locked();
	pthread_mutex_unlock(&loop_mu);
	if (hold && !ok) {
		pthread_mutex_lock(&c->mu);
		c->reclaimer = false;
		pthread_mutex_unlock(&c->mu);
		dlpc__client_unref(c);
	}
}
