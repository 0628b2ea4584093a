/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Reapers: threads that close file descriptors for the event loop.
 *
 * close() can take long: the last close of a storage memfd frees all its memory (a 1 GiB
 * storage takes tens of milliseconds), and an fd a client sent may sit on a filesystem that
 * stalls on close (FUSE). Neither may hold up the loop that serves every client. (A storage
 * of a few pages is the exception: freeing it costs less than waking a thread, so
 * dlpd_close_storage() closes it on the loop.) The reaper closes only fds whose close the
 * daemon can vouch for: host storages, which passed the checks of storage.c and are shmem.
 * Every other fd a client sent or can reach (refused ones, CUDA VMM exports, client sockets,
 * whose last close frees the fds in flight in them) goes to the closer processes of closer.c,
 * where a close that never returns stalls only its sender's closer. At stop the reaper is
 * drained and joined.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base.h"
#include "io.h"
#include "reaper.h"

/* How long a freeze waits for a close taken off the queue to return. */
#define FREEZE_WAIT_MS 100

struct reaper {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int *fds;
	size_t n, cap;
	unsigned closing; /* taken off the queue, close() not returned yet */
	bool stop, running, done;
	bool frozen;   /* takes nothing more off the queue (dlpd_reaper_freeze()) */
	size_t handed; /* fds ever queued */
	pthread_t thread;
};

static struct reaper own = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void *reap(void *arg)
{
	struct reaper *rp = arg;

	pthread_mutex_lock(&rp->mu);
	for (;;) {
		while ((rp->n == 0 || rp->frozen) && !rp->stop)
			pthread_cond_wait(&rp->cv, &rp->mu);
		if (rp->n == 0 || rp->frozen)
			break;
		int fd = rp->fds[--rp->n];

		rp->closing++;
		pthread_mutex_unlock(&rp->mu);
		close(fd);
		pthread_mutex_lock(&rp->mu);
		rp->closing--;
		pthread_cond_broadcast(&rp->cv);
	}
	rp->done = true;
	pthread_cond_broadcast(&rp->cv);
	pthread_mutex_unlock(&rp->mu);
	return NULL;
}

static int start(struct reaper *rp)
{
	sigset_t all, old;
	int r;

	/* the threads take no signals: SIGTERM and SIGINT belong to the loop */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	r = pthread_create(&rp->thread, NULL, reap, rp);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (r != 0)
		return -r;
	rp->running = true;
	return 0;
}

/* Ask @p rp to drain and stop; wait for it up to @p ms (forever if < 0). Joined if it ended. */
static void stop(struct reaper *rp, int ms)
{
	struct timespec until;
	bool done;

	if (!rp->running)
		return;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += ms / 1000;
	until.tv_nsec += (long)(ms % 1000) * 1000000;
	if (until.tv_nsec >= 1000000000) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000;
	}
	pthread_mutex_lock(&rp->mu);
	rp->stop = true;
	pthread_cond_signal(&rp->cv);
	while (!rp->done && (ms < 0 || pthread_cond_timedwait(&rp->cv, &rp->mu, &until) == 0))
		if (ms < 0)
			pthread_cond_wait(&rp->cv, &rp->mu);
	done = rp->done;
	pthread_mutex_unlock(&rp->mu);
	if (!done) {
		dlpd_log(LOG_WARNING,
			 "%zu fds from clients still closing (a stalled filesystem?); "
			 "leaving them to the exit",
			 rp->n + rp->closing);
		return;
	}
	pthread_join(rp->thread, NULL);
	rp->running = false;
	free(rp->fds);
	rp->fds = NULL;
	rp->cap = 0;
}

static void queue(struct reaper *rp, int fd)
{
	if (fd < 0)
		return;
	pthread_mutex_lock(&rp->mu);
	if (!rp->running || rp->stop) {
		pthread_mutex_unlock(&rp->mu);
		close(fd);
		return;
	}
	if (rp->n == rp->cap) {
		size_t cap = rp->cap ? rp->cap * 2 : 64;
		int *fds = realloc(rp->fds, cap * sizeof(*fds));

		if (!fds) {
			/* no room to queue it: closing here is slow, not wrong */
			pthread_mutex_unlock(&rp->mu);
			close(fd);
			return;
		}
		rp->fds = fds;
		rp->cap = cap;
	}
	rp->fds[rp->n++] = fd;
	rp->handed++;
	pthread_cond_signal(&rp->cv);
	pthread_mutex_unlock(&rp->mu);
}

static size_t pending(struct reaper *rp)
{
	size_t n;

	pthread_mutex_lock(&rp->mu);
	n = rp->n + rp->closing;
	pthread_mutex_unlock(&rp->mu);
	return n;
}

int dlpd_reaper_start(void)
{
	int r = start(&own);

	if (r < 0)
		return r;
	return 0;
}

void dlpd_reaper_stop(void)
{
	stop(&own, -1);
}

void dlpd_close_later(int fd)
{
	queue(&own, fd);
}

void dlpd_close_storage(int fd)
{
	struct stat st;
	bool frozen;

	if (fd < 0)
		return;
	pthread_mutex_lock(&own.mu);
	frozen = own.frozen;
	pthread_mutex_unlock(&own.mu);
	/* a frozen reaper keeps what it is given open (an upgrade is moving fds): so does this */
	if (!frozen && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
	    (uint64_t)st.st_blocks * 512 <= DLPD_CLOSE_INLINE_BYTES) {
		close(fd);
		return;
	}
	queue(&own, fd);
}

size_t dlpd_reaper_pending(void)
{
	return pending(&own);
}

size_t dlpd_reaper_handed(void)
{
	size_t n;

	pthread_mutex_lock(&own.mu);
	n = own.handed;
	pthread_mutex_unlock(&own.mu);
	return n;
}

/* Let @p rp take nothing more off its queue, and wait a moment for the close it took. */
static void freeze(struct reaper *rp)
{
	struct timespec until;

	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_nsec += FREEZE_WAIT_MS * 1000000L;
	if (until.tv_nsec >= 1000000000) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000;
	}
	pthread_mutex_lock(&rp->mu);
	rp->frozen = true;
	while (rp->closing && pthread_cond_timedwait(&rp->cv, &rp->mu, &until) == 0)
		;
	pthread_mutex_unlock(&rp->mu);
}

void dlpd_reaper_freeze(void)
{
	/* A close taken off the queue, and still not returned after the wait, is in the kernel
	 * (a stalled filesystem): its fd number is free already. */
	freeze(&own);
}
