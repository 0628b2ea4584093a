/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The reaper: a thread that closes file descriptors for the event loop.
 *
 * close() can take long: the last close of a storage memfd frees all its memory (a 1 GiB
 * storage takes tens of milliseconds), and a client may send an fd on a filesystem that stalls
 * on close (FUSE). Neither may hold up the loop that serves every client. Closing is the only
 * thing the thread does; it shares nothing else with the loop.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#include "dlpackd.h"

static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int *fds;
	size_t n, cap;
	unsigned closing; /* taken off the queue, close() not returned yet */
	bool stop, running;
	pthread_t thread;
} reaper = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static void *reap(void *unused)
{
	(void)unused;
	pthread_mutex_lock(&reaper.mu);
	for (;;) {
		while (reaper.n == 0 && !reaper.stop)
			pthread_cond_wait(&reaper.cv, &reaper.mu);
		if (reaper.n == 0)
			break;
		int fd = reaper.fds[--reaper.n];

		reaper.closing++;
		pthread_mutex_unlock(&reaper.mu);
		close(fd);
		pthread_mutex_lock(&reaper.mu);
		reaper.closing--;
	}
	pthread_mutex_unlock(&reaper.mu);
	return NULL;
}

int dlpd_reaper_start(void)
{
	sigset_t all, old;
	int r;

	/* the thread takes no signals: SIGTERM and SIGINT belong to the loop */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	r = pthread_create(&reaper.thread, NULL, reap, NULL);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (r != 0)
		return -r;
	reaper.running = true;
	dlpc__set_closer(dlpd_close_later);
	return 0;
}

void dlpd_reaper_stop(void)
{
	if (!reaper.running)
		return;
	dlpc__set_closer(NULL);
	pthread_mutex_lock(&reaper.mu);
	reaper.stop = true;
	pthread_cond_signal(&reaper.cv);
	pthread_mutex_unlock(&reaper.mu);
	/* it drains what is queued before it returns */
	pthread_join(reaper.thread, NULL);
	reaper.running = false;
	free(reaper.fds);
	reaper.fds = NULL;
	reaper.cap = 0;
}

size_t dlpd_reaper_pending(void)
{
	size_t n;

	pthread_mutex_lock(&reaper.mu);
	n = reaper.n + reaper.closing;
	pthread_mutex_unlock(&reaper.mu);
	return n;
}

void dlpd_close_later(int fd)
{
	if (fd < 0)
		return;
	pthread_mutex_lock(&reaper.mu);
	if (!reaper.running || reaper.stop) {
		pthread_mutex_unlock(&reaper.mu);
		close(fd);
		return;
	}
	if (reaper.n == reaper.cap) {
		size_t cap = reaper.cap ? reaper.cap * 2 : 64;
		int *fds = realloc(reaper.fds, cap * sizeof(*fds));

		if (!fds) {
			/* no room to queue it: closing here is slow, not wrong */
			pthread_mutex_unlock(&reaper.mu);
			close(fd);
			return;
		}
		reaper.fds = fds;
		reaper.cap = cap;
	}
	reaper.fds[reaper.n++] = fd;
	pthread_cond_signal(&reaper.cv);
	pthread_mutex_unlock(&reaper.mu);
}
