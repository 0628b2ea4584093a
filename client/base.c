/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What every file of libdlpc may use and that uses nothing of the library's but error.c: the
 * clock, the library's threads, the checks of a caller's arguments, and the thread that closes
 * the fds a peer sent that libdlpc refused (dlpc__close_later()).
 */
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "util.h"

/* Has @p dl passed? */
bool dlpc__passed(const struct timespec *dl)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return now.tv_sec > dl->tv_sec || (now.tv_sec == dl->tv_sec && now.tv_nsec >= dl->tv_nsec);
}

/* @p ms from now on CLOCK_MONOTONIC. */
void dlpc__deadline_in(struct timespec *dl, int64_t ms)
{
	clock_gettime(CLOCK_MONOTONIC, dl);
	dl->tv_sec += (time_t)(ms / 1000);
	dl->tv_nsec += (long)(ms % 1000) * 1000000;
	if (dl->tv_nsec >= 1000000000) {
		dl->tv_sec++;
		dl->tv_nsec -= 1000000000;
	}
}

int64_t dlpc__ms_left(const struct timespec *dl)
{
	struct timespec now;
	int64_t s, ns;

	clock_gettime(CLOCK_MONOTONIC, &now);
	s = (int64_t)dl->tv_sec - (int64_t)now.tv_sec;
	ns = (int64_t)dl->tv_nsec - now.tv_nsec;
	if (ns < 0) {
		s--;
		ns += 1000000000;
	}
	if (s < 0 || (s == 0 && ns == 0))
		return 0;
	/* a deadline of INT64_MAX ms (a timeout that means "for ever") stays one */
	if (s >= INT64_MAX / 1000 - 1)
		return INT64_MAX;
	return s * 1000 + (ns + 999999) / 1000000;
}

/* A thread of the library's running @p fn(@p arg), every signal blocked on it; joinable, its id
 * in *@p t, if @p t is not NULL, else detached. A joinable one works for a caller that waits for
 * it: the signals of a fault of its own stay unblocked, so that a fault there (a bad pointer of
 * the caller's) reaches the process's handler as it would on the caller's thread, instead of
 * killing the process. */
static bool start(pthread_t *t, void *(*fn)(void *), void *arg)
{
	static const int faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP};
	sigset_t all, old;
	pthread_attr_t attr;
	pthread_t detached;
	bool ok;

	sigfillset(&all);
	for (size_t i = 0; t && i < sizeof(faults) / sizeof(faults[0]); i++)
		sigdelset(&all, faults[i]);
	pthread_attr_init(&attr);
	if (!t)
		pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	ok = pthread_create(t ? t : &detached, &attr, fn, arg) == 0;
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	pthread_attr_destroy(&attr);
	return ok;
}

/* See base.h. */
bool dlpc__start_thread(void *(*fn)(void *), void *arg)
{
	return start(NULL, fn, arg);
}

/* See base.h. */
bool dlpc__start_joinable(pthread_t *t, void *(*fn)(void *), void *arg)
{
	return start(t, fn, arg);
}

int dlpc__check(const dlpc_client *c)
{
	if (!dlpc__ours(c))
		return dlpc__fail(-EBADFD,
				  "this dlpc_client belongs to process %d; a forked child must "
				  "call dlpc_connect() itself",
				  (int)c->pid);
	return 0;
}

int dlpc__name_arg(const char *name, const char *what)
{
	char why[160];

	if (!name)
		return dlpc__fail(-EINVAL, "cannot %s: name is NULL", what);
	if (dlpc__name_check((const uint8_t *)name, strlen(name), why, sizeof(why)) < 0)
		return dlpc__fail(-EINVAL, "cannot %s: %s", what, why);
	return 0;
}

/* fds to close on a thread of their own (dlpc__close_later()): what a peer sent that libdlpc
 * refused, whose close may block (a file on a stalling filesystem). Not the thread of loop.c:
 * a close that never returns would stop the releases and the cache with it. */
static pthread_mutex_t closer_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t closer_cv = PTHREAD_COND_INITIALIZER;
static bool closer_running;
static int *closing;
static size_t nclosing, closing_cap;
static size_t closing_now; /* 1 while the thread is in close() */

static void *closer_main(void *arg)
{
	(void)arg;
	pthread_mutex_lock(&closer_mu);
	for (;;) {
		int fd;

		while (nclosing == 0)
			pthread_cond_wait(&closer_cv, &closer_mu);
		fd = closing[--nclosing];
		closing_now = 1;
		pthread_mutex_unlock(&closer_mu);
		close(fd);
		pthread_mutex_lock(&closer_mu);
		closing_now = 0;
	}
	return NULL;
}

size_t dlpc__closing_held(void)
{
	size_t n;

	pthread_mutex_lock(&closer_mu);
	n = nclosing + closing_now;
	pthread_mutex_unlock(&closer_mu);
	return n;
}

void dlpc__close_later(int fd)
{
	/* A socket's close waits out its SO_LINGER (a peer's TCP socket with a day of it and a
	 * full send queue would hold the thread that long): the option is the fd holder's to set,
	 * and this close has nothing to deliver. For any other fd the call fails (ENOTSOCK) and
	 * changes nothing. */
	static const struct linger none = {0, 0};

	if (fd < 0)
		return;
	setsockopt(fd, SOL_SOCKET, SO_LINGER, &none, sizeof(none));
	pthread_mutex_lock(&closer_mu);
	if (!closer_running)
		closer_running = dlpc__start_thread(closer_main, NULL);
	if (closer_running && nclosing == closing_cap) {
		size_t cap = closing_cap ? closing_cap * 2 : 16;
		int *grown = realloc(closing, cap * sizeof(*grown));

		if (grown) {
			closing = grown;
			closing_cap = cap;
		}
	}
	if (closer_running && nclosing < closing_cap) {
		closing[nclosing++] = fd;
		pthread_cond_signal(&closer_cv);
		fd = -1;
	}
	pthread_mutex_unlock(&closer_mu);
	/* no thread, or no memory: here, then */
	if (fd >= 0)
		close(fd);
}

void dlpc__closer_forked(void)
{
	/* the parent's to close: in the child they are copies, left to its exit or exec
	 * (close-on-exec), as a close here could block fork() itself */
	nclosing = 0;
	closing_now = 0;
	closer_running = false;
	pthread_cond_init(&closer_cv, NULL);
	pthread_mutex_init(&closer_mu, NULL);
}
