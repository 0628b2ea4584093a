/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Closers: processes that close the fds clients sent, so that a close that never returns costs
 * its sender, never the service.
 *
 * What the kernel does on close. Every close() of a file on FUSE sends FLUSH to its server (on
 * every close, not only the last) as a forced request: it cannot be interrupted, and a thread
 * waiting for it cannot be killed. The last close of a TCP socket with SO_LINGER waits, up to
 * the linger time, for its send queue to leave (a signal ends that wait). An exit closes the
 * fd table the same way, and so does an execve() for every close-on-exec fd: and execve()
 * first waits for the other threads of the process to die, which a thread in such a close
 * never does. So no thread of the daemon may be the one to close such an fd.
 *
 * A closer is made with clone(CLONE_FILES) but not CLONE_VM: a copy of the daemon's memory (it
 * runs only async-signal-safe calls: it is a fork of a threaded process) sharing the daemon's
 * fd table, so the fd number the daemon received is the one it closes. The daemon writes the
 * numbers to its end of a SOCK_SEQPACKET pair; the closer replaces each by a placeholder with
 * dup2() (which closes the file as close() does, and keeps the number taken, so the daemon never
 * reuses it while the close may be running) and writes the numbers back; the daemon closes the
 * placeholders and uncharges. A close stuck in the kernel stalls that process alone: the
 * daemon's thread group, its stop and its execve() are not held up.
 *
 * One closer per uid with closes pending (made when needed, told to quit after
 * DLPD_CLOSER_IDLE_MS without work), at most DLPC_CLOSERS_MAX of them; past that, fds wait in
 * the daemon until one quits. Each pending close counts against its uid's fd share and the
 * daemon's fd budget (quota.c) until the closer says it is done.
 *
 * Both ends of each pair live in the one shared table, so neither side ever sees end of file:
 * a closer is told to quit with a message, and also quits when idle once its parent is gone.
 * The daemon reaps closers on SIGCHLD, those of the image it replaced at an upgrade too (they
 * are its children: the pid stays).
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/kcmp.h>
#include <stdint.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif

#include "base.h"
#include "closer.h"
#include "io.h"
#include "reaper.h"

/* fd numbers in one message to a closer, and in one acknowledgement. */
#define BATCH 64
/* How often an idle closer looks whether the daemon is still its parent. */
#define PARENT_CHECK_MS 500
/* The message that tells a closer to quit. */
#define QUIT (-1)

struct closer {
	struct dlpd_list link;
	uid_t uid;
	pid_t pid;	/* until reaped */
	int sock;	/* the daemon's end, non-blocking */
	int child_sock; /* the closer's end */
	uv_poll_t poll;
	bool polling, writable_wanted;
	int *fds;	  /* handed and not acknowledged, oldest first */
	size_t nfds, cap; /* fds[0..nsent) are written to the closer, the rest wait */
	size_t nsent;
	bool quitting; /* told to quit: takes nothing new */
	bool was_idle; /* idle at the last tick of the idle timer */
};

/* A close waiting for a closer (none could be made, or DLPC_CLOSERS_MAX are busy). */
struct waiting {
	int fd;
	uid_t uid;
};

static struct {
	uv_loop_t *loop;
	struct dlpd_registry *reg;
	bool running; /* the handles below are set up and open */
	int placeholder;
	/* two fds kept for a closer's socket pair, let go just before a socketpair() that found
	 * the fd table full: otherwise fds waiting to be closed, filling it, would keep every
	 * closer from being made, and so themselves from ever closing */
	int reserve[2];
	bool spawn_warned; /* a closer could not be made: said once, until one is */
	uv_signal_t sigchld;
	uv_timer_t idle;
	struct dlpd_list closers;
	size_t ncloser;
	size_t pending;
	struct waiting *backlog;
	size_t nbacklog, backlog_cap;
	uid_t charge;
	struct dlpd_closing *adopted; /* passed by the image we replaced (dlpd_closers_adopt()) */
	size_t nadopted;
} C = {.placeholder = -1, .reserve = {-1, -1}, .charge = DLPD_UID_NOBODY};

/* ---- in the closer process: async-signal-safe calls only ---- */

/* Is the daemon gone, or has it executed a new image (which took a copy of the fd table and
 * left us the old one)? A closer that is told so quits once nothing is left to close. */
static bool parent_gone(pid_t parent)
{
	return getppid() != parent ||
	       syscall(SYS_kcmp, (pid_t)getpid(), parent, KCMP_FILES, 0UL, 0UL) > 0;
}

/* Wait until @p sock is ready for @p events; false once the parent is gone (and nothing is
 * there). A QUIT that did not fit in a busy closer's socket is not needed. */
static bool wait_for(int sock, short events, pid_t parent)
{
	for (;;) {
		struct pollfd pfd = {.fd = sock, .events = events};
		int r = poll(&pfd, 1, PARENT_CHECK_MS);

		if (r > 0)
			return true;
		if (r < 0 && errno != EINTR)
			return false;
		if (r == 0 && parent_gone(parent))
			return false;
	}
}

static __attribute__((noreturn)) void closer_main(int sock, int placeholder, pid_t parent)
{
	int buf[BATCH];

	/* killed with the daemon (SIGKILL), unless a close holds it; named for ps(1) */
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	prctl(PR_SET_NAME, "dlpackd-closer");
	if (parent_gone(parent))
		_exit(0);
	for (;;) {
		ssize_t n;

		if (!wait_for(sock, POLLIN, parent))
			_exit(0);
		n = recv(sock, buf, sizeof(buf), MSG_DONTWAIT);
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			continue;
		if (n < (ssize_t)sizeof(int) || buf[0] == QUIT)
			_exit(0);
		/* dup2() closes the file at the number as close() would, and leaves the number
		 * taken (by a placeholder without close-on-exec: see dlpd_closers_handover()) */
		for (size_t i = 0; i < (size_t)n / sizeof(int); i++)
			dup2(placeholder, buf[i]);
		while (send(sock, buf, (size_t)n, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
			if (errno != EAGAIN && errno != EINTR)
				_exit(1);
			if (!wait_for(sock, POLLOUT, parent))
				_exit(0);
		}
	}
}

/* ---- in the daemon ---- */

static void charge(uid_t uid, int delta)
{
	struct dlpd_usage *u;

	if (delta > 0)
		C.pending++;
	else
		C.pending--;
	if (uid == DLPD_UID_NOBODY || !C.reg)
		return;
	u = delta > 0 ? dlpd_usage_get(C.reg, uid) : dlpd_usage_find(C.reg, uid);
	if (!u)
		return;
	if (delta > 0) {
		u->closing++;
	} else {
		u->closing--;
		dlpd_usage_put(C.reg, u);
	}
}

static void on_closer_io(uv_poll_t *h, int status, int events);

static void update_poll(struct closer *c)
{
	bool want = c->nsent < c->nfds;

	if (!C.running || !c->polling || want == c->writable_wanted)
		return;
	c->writable_wanted = want;
	uv_poll_start(&c->poll, UV_READABLE | (want ? UV_WRITABLE : 0), on_closer_io);
}

/* Write what waits for @p c, as far as its socket takes it. */
static void flush(struct closer *c)
{
	while (c->nsent < c->nfds) {
		size_t k = c->nfds - c->nsent;
		ssize_t n;

		if (k > BATCH)
			k = BATCH;
		n = send(c->sock, c->fds + c->nsent, k * sizeof(int), MSG_DONTWAIT | MSG_NOSIGNAL);
		if (n < 0)
			break;
		c->nsent += k;
	}
	update_poll(c);
}

static int push(struct closer *c, int fd)
{
	if (c->nfds == c->cap) {
		size_t cap = c->cap ? c->cap * 2 : 16;
		int *v = realloc(c->fds, cap * sizeof(*v));

		if (!v)
			return -ENOMEM;
		c->fds = v;
		c->cap = cap;
	}
	c->fds[c->nfds++] = fd;
	c->was_idle = false;
	return 0;
}

static void tell_quit(struct closer *c)
{
	int m = QUIT;

	if (c->quitting)
		return;
	c->quitting = true;
	/* a closer with a full socket is busy: it quits when idle once we are gone */
	send(c->sock, &m, sizeof(m), MSG_DONTWAIT | MSG_NOSIGNAL);
}

/* Take the fds of C.reserve that are not held (copies of the placeholder), and move those
 * taken while the table was full (at its top) down to the lowest free numbers: the reserve is
 * for a table full up to a limit, which a lowered RLIMIT_NOFILE may put below them. */
static void reserve_take(void)
{
	for (int i = 0; i < 2 && C.placeholder >= 0; i++) {
		int fd = fcntl(C.placeholder, F_DUPFD_CLOEXEC, 0);

		if (C.reserve[i] < 0 || (fd >= 0 && fd < C.reserve[i])) {
			if (C.reserve[i] >= 0)
				close(C.reserve[i]);
			C.reserve[i] = fd;
		} else if (fd >= 0) {
			close(fd);
		}
	}
}

/* A closer's socket pair in @p sv, made with the reserve if the fd table is full. */
static int closer_pair(int sv[2])
{
	int r = socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv);

	if (r < 0 && errno == EMFILE && C.reserve[0] >= 0 && C.reserve[1] >= 0) {
		close(C.reserve[0]);
		close(C.reserve[1]);
		C.reserve[0] = C.reserve[1] = -1;
		r = socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv);
	}
	if (r < 0 && !C.spawn_warned) {
		C.spawn_warned = true;
		dlpd_log(LOG_WARNING,
			 "cannot make a closer's socket pair (%m); %zu fds wait to be closed, "
			 "trying again every %d ms",
			 C.nbacklog, DLPD_CLOSER_IDLE_MS);
	}
	/* taken again once the table has room: the closer made now frees some */
	reserve_take();
	return r;
}

/* Make a closer process for @p uid; NULL if it cannot be made now. */
static struct closer *spawn(uid_t uid)
{
	struct closer *c = calloc(1, sizeof(*c));
	sigset_t all, old;
	pid_t parent = getpid();
	int sv[2];
	long pid;

	if (!c)
		return NULL;
	if (closer_pair(sv) < 0) {
		free(c);
		return NULL;
	}
	fcntl(sv[0], F_SETFL, O_NONBLOCK);
	/* the closer takes no signal (SIGKILL aside): handlers of the daemon's (libuv's write
	 * to the daemon's pipes) must never run there */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	pid = syscall(SYS_clone, CLONE_FILES | SIGCHLD, NULL, NULL, NULL, NULL);
	if (pid == 0)
		closer_main(sv[1], C.placeholder, parent);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (pid < 0) {
		dlpd_log(LOG_WARNING, "cannot start a closer process: %m");
		close(sv[0]);
		close(sv[1]);
		free(c);
		return NULL;
	}
	C.spawn_warned = false;
	c->uid = uid;
	c->pid = (pid_t)pid;
	c->sock = sv[0];
	c->child_sock = sv[1];
	if (C.running && uv_poll_init(C.loop, &c->poll, c->sock) == 0) {
		c->poll.data = c;
		c->polling = true;
		uv_poll_start(&c->poll, UV_READABLE, on_closer_io);
	}
	dlpd_list_add_tail(&C.closers, &c->link);
	C.ncloser++;
	return c;
}

/* The closer serving @p uid, made if need be; NULL if none can serve it now. */
static struct closer *closer_for(uid_t uid)
{
	struct closer *idle = NULL;

	for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
		struct closer *c = dlpd_container_of(l, struct closer, link);

		if (c->quitting)
			continue;
		if (c->uid == uid)
			return c;
		if (c->nfds == 0)
			idle = c;
	}
	if (C.ncloser < DLPC_CLOSERS_MAX)
		return spawn(uid);
	/* all in use: an idle one makes room once it is gone (reap()) */
	if (idle)
		tell_quit(idle);
	return NULL;
}

static void to_backlog(int fd, uid_t uid)
{
	if (C.nbacklog == C.backlog_cap) {
		size_t cap = C.backlog_cap ? C.backlog_cap * 2 : 64;
		struct waiting *v = realloc(C.backlog, cap * sizeof(*v));

		if (!v) {
			/* nowhere to keep it: leave it open rather than close it here */
			dlpd_log(LOG_ERR, "out of memory: fd %d of uid %u is left open", fd,
				 (unsigned)uid);
			return;
		}
		C.backlog = v;
		C.backlog_cap = cap;
	}
	C.backlog[C.nbacklog++] = (struct waiting){fd, uid};
}

/* Hand @p fd (charged to @p uid already) to a closer, or leave it waiting. */
static void hand(int fd, uid_t uid)
{
	struct closer *c = closer_for(uid);

	if (!c || push(c, fd) < 0) {
		to_backlog(fd, uid);
		return;
	}
	flush(c);
}

/* Give waiting fds to closers, as far as there are closers for them. */
static void serve_backlog(void)
{
	size_t n = C.nbacklog;
	struct waiting *v = C.backlog;

	if (n == 0)
		return;
	C.backlog = NULL;
	C.nbacklog = C.backlog_cap = 0;
	for (size_t i = 0; i < n; i++)
		hand(v[i].fd, v[i].uid);
	free(v);
}

void dlpd_close_uid(uid_t uid, int fd)
{
	if (fd < 0)
		return;
	if (C.placeholder < 0) {
		/* no closers (the in-process tests, the fuzz target, valgrind): the reaper's
		 * thread, or here where it does not run */
		dlpd_close_later(fd);
		return;
	}
	charge(uid, +1);
	hand(fd, uid);
}

void dlpd_close_untrusted(int fd)
{
	dlpd_close_uid(C.charge, fd);
}

uid_t dlpd_closer_charge(uid_t uid)
{
	uid_t was = C.charge;

	C.charge = uid;
	return was;
}

size_t dlpd_closers_pending(void)
{
	return C.pending;
}

size_t dlpd_closers_fds(void)
{
	return C.pending + 2 * C.ncloser;
}

size_t dlpd_closers_count(void)
{
	return C.ncloser;
}

/* @p c acknowledged @p fd: it is closed, and a placeholder holds its number. */
static void acknowledged(struct closer *c, int fd)
{
	size_t i = 0;

	while (i < c->nsent && c->fds[i] != fd)
		i++;
	if (i == c->nsent)
		return;
	memmove(c->fds + i, c->fds + i + 1, (c->nfds - i - 1) * sizeof(int));
	c->nfds--;
	c->nsent--;
	close(fd);
	charge(c->uid, -1);
}

static void on_closer_io(uv_poll_t *h, int status, int events)
{
	struct closer *c = h->data;
	int buf[BATCH];
	ssize_t n;

	if (status < 0)
		return;
	if (events & UV_READABLE)
		while ((n = recv(c->sock, buf, sizeof(buf), MSG_DONTWAIT)) > 0)
			for (size_t i = 0; i < (size_t)n / sizeof(int); i++)
				acknowledged(c, buf[i]);
	flush(c);
}

static void closer_closed(uv_handle_t *h)
{
	free(h->data);
}

/* @p c exited: what it had not acknowledged is closed or not (the number holds the file or a
 * placeholder): either way it goes to another closer. */
static void closer_gone(struct closer *c)
{
	int *fds = c->fds;
	size_t n = c->nfds;

	dlpd_list_del(&c->link);
	C.ncloser--;
	close(c->sock);
	close(c->child_sock);
	c->fds = NULL;
	c->nfds = 0;
	for (size_t i = 0; i < n; i++)
		to_backlog(fds[i], c->uid);
	free(fds);
	if (c->polling) {
		c->poll.data = c;
		uv_close((uv_handle_t *)&c->poll, closer_closed);
	} else {
		free(c);
	}
}

/* Reap every child that exited: our closers, and those of the image we replaced. */
static void reap(void)
{
	pid_t pid;
	int st;

	while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
		for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
			struct closer *c = dlpd_container_of(l, struct closer, link);

			if (c->pid == pid) {
				closer_gone(c);
				break;
			}
		}
	serve_backlog();
}

static void on_sigchld(uv_signal_t *h, int signum)
{
	(void)h;
	(void)signum;
	reap();
}

/* Closers idle for a whole tick quit; the backlog is tried again, and the reserve taken again
 * if a closer was made with it. */
static void on_idle_tick(uv_timer_t *t)
{
	(void)t;
	reserve_take();
	for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
		struct closer *c = dlpd_container_of(l, struct closer, link);

		if (c->nfds == 0 && c->was_idle)
			tell_quit(c);
		c->was_idle = c->nfds == 0;
	}
	serve_backlog();
}

int dlpd_closers_init(uv_loop_t *loop, struct dlpd_registry *reg)
{
#ifdef RUNNING_ON_VALGRIND
	/* it cannot run a clone() that shares the fd table and not the memory */
	if (RUNNING_ON_VALGRIND)
		return -ENOTSUP;
#endif
	C.loop = loop;
	C.reg = reg;
	dlpd_list_init(&C.closers);
	C.placeholder = eventfd(0, EFD_CLOEXEC);
	if (C.placeholder < 0)
		return -errno;
	reserve_take();
	uv_signal_init(loop, &C.sigchld);
	uv_signal_start(&C.sigchld, on_sigchld, SIGCHLD);
	uv_timer_init(loop, &C.idle);
	uv_timer_start(&C.idle, on_idle_tick, DLPD_CLOSER_IDLE_MS, DLPD_CLOSER_IDLE_MS);
	uv_unref((uv_handle_t *)&C.idle);
	uv_unref((uv_handle_t *)&C.sigchld);
	C.running = true;
	/* closers of the image we replaced that exited before we could hear of it */
	reap();
	for (size_t i = 0; i < C.nadopted; i++)
		dlpd_close_uid(C.adopted[i].uid, C.adopted[i].fd);
	if (C.nadopted)
		dlpd_log(LOG_NOTICE, "%zu fds the previous image was closing are closed here",
			 C.nadopted);
	free(C.adopted);
	C.adopted = NULL;
	C.nadopted = 0;
	return 0;
}

/* Take @p n closes of @p uid off its usage (the count of pending closes stays). */
static void uncharge_usage(uid_t uid, size_t n)
{
	struct dlpd_usage *u;

	if (uid == DLPD_UID_NOBODY || n == 0 || !(u = dlpd_usage_find(C.reg, uid)))
		return;
	u->closing -= n;
	dlpd_usage_put(C.reg, u);
}

void dlpd_closers_stop(void)
{
	if (!C.running)
		return;
	C.running = false;
	/* the registry goes before the closers are done: nothing is charged from now on */
	for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
		struct closer *c = dlpd_container_of(l, struct closer, link);

		uncharge_usage(c->uid, c->nfds);
	}
	for (size_t i = 0; i < C.nbacklog; i++)
		uncharge_usage(C.backlog[i].uid, 1);
	C.reg = NULL;
	uv_close((uv_handle_t *)&C.sigchld, NULL);
	uv_close((uv_handle_t *)&C.idle, NULL);
	for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
		struct closer *c = dlpd_container_of(l, struct closer, link);

		if (c->polling) {
			c->polling = false;
			c->poll.data = NULL;
			uv_close((uv_handle_t *)&c->poll, NULL);
		}
	}
}

static int cmp_int(const void *a, const void *b)
{
	int x = *(const int *)a, y = *(const int *)b;

	return (x > y) - (x < y);
}

/* Close every fd from @p lo to @p hi (inclusive). */
static void close_span(int lo, int hi)
{
	if (lo > hi)
		return;
	long most = sysconf(_SC_OPEN_MAX);

	if (syscall(SYS_close_range, (unsigned)lo, (unsigned)hi, 0u) == 0)
		return;
	/* without close_range() (a seccomp filter): one by one, up to the fd limit */
	for (int fd = lo; fd <= hi && fd < most; fd++)
		close(fd);
}

void dlpd_closers_leave(void)
{
	size_t n = 0, cap = C.nbacklog + 2;
	int *keep;

	if (C.placeholder < 0)
		return;
	for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
		struct closer *c = dlpd_container_of(l, struct closer, link);

		cap += c->nfds + 2;
	}
	keep = malloc(cap * sizeof(*keep));
	for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
		struct closer *c = dlpd_container_of(l, struct closer, link);

		flush(c);
		tell_quit(c);
		if (!keep)
			continue;
		memcpy(keep + n, c->fds, c->nfds * sizeof(int));
		n += c->nfds;
		keep[n++] = c->sock;
		keep[n++] = c->child_sock;
	}
	if (!keep || C.ncloser == 0) {
		/* nothing shares the table (or we cannot say what to keep): the exit closes it */
		free(keep);
		return;
	}
	for (size_t i = 0; i < C.nbacklog; i++)
		keep[n++] = C.backlog[i].fd;
	keep[n++] = C.placeholder;
	qsort(keep, n, sizeof(*keep), cmp_int);
	/* everything else goes now: connections see their end, storages are freed, and no
	 * lock or socket outlives us in a closer that is stuck */
	{
		int from = 3;

		for (size_t i = 0; i < n; i++) {
			close_span(from, keep[i] - 1);
			if (keep[i] + 1 > from)
				from = keep[i] + 1;
		}
		close_span(from, INT32_MAX);
	}
	free(keep);
	/* Those not stuck close what they were handed, then quit: wait for them a moment, so
	 * that none is killed with what it holds still open (a stuck one keeps it anyway). */
	for (int waited = 0; C.ncloser > 0 && waited < DLPD_CLOSER_LEAVE_MS; waited += 5) {
		pid_t pid;

		while ((pid = waitpid(-1, NULL, WNOHANG)) > 0)
			for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
				struct closer *c = dlpd_container_of(l, struct closer, link);

				if (c->pid == pid) {
					dlpd_list_del(&c->link);
					C.ncloser--;
					free(c->fds);
					free(c);
					break;
				}
			}
		if (C.ncloser > 0)
			usleep(5000);
	}
}

int dlpd_closers_handover(struct dlpd_closing **ret, size_t *count)
{
	size_t n = C.nbacklog;
	struct dlpd_closing *v;

	*ret = NULL;
	*count = 0;
	for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next)
		n += dlpd_container_of(l, struct closer, link)->nfds;
	if (n == 0)
		return 0;
	v = malloc(n * sizeof(*v));
	if (!v)
		return -ENOMEM;
	n = 0;
	for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
		struct closer *c = dlpd_container_of(l, struct closer, link);

		for (size_t i = 0; i < c->nfds; i++)
			v[n++] = (struct dlpd_closing){c->fds[i], c->uid};
	}
	for (size_t i = 0; i < C.nbacklog; i++)
		v[n++] = (struct dlpd_closing){C.backlog[i].fd, C.backlog[i].uid};
	/* The exec copies the fd table (the closers keep theirs): each of these it would close,
	 * as close-on-exec, could block it as the closer is blocked. Kept open, they are the new
	 * image's to close: the file, or the placeholder a closer put there (dup2() gives it no
	 * close-on-exec, whenever it runs). */
	for (size_t i = 0; i < n; i++)
		fcntl(v[i].fd, F_SETFD, 0);
	*ret = v;
	*count = n;
	return 0;
}

void dlpd_closers_exec(void)
{
	/* the loop's fds may be replaced already: from here on the closers are written to, and
	 * made, without it */
	C.running = false;
}

void dlpd_closers_quit_all(void)
{
	for (struct dlpd_list *l = C.closers.next; l != &C.closers; l = l->next) {
		struct closer *c = dlpd_container_of(l, struct closer, link);

		flush(c);
		tell_quit(c);
	}
}

int dlpd_closers_export(const struct dlpd_closing *cl, size_t n)
{
	char buf[4096], num[16];
	size_t used = 0;
	int fd, r = 0;

	if (n == 0)
		return 0;
	/* without close-on-exec: the new image reads it first thing */
	fd = memfd_create("dlpackd-closing", 0);
	if (fd < 0)
		return -errno;
	for (size_t i = 0; r == 0 && i <= n; i++) {
		if (i == n || used + 32 > sizeof(buf)) {
			if (write(fd, buf, used) != (ssize_t)used)
				r = -EIO;
			used = 0;
		}
		if (i < n)
			used += (size_t)snprintf(buf + used, sizeof(buf) - used, "%d:%u\n",
						 cl[i].fd, (unsigned)cl[i].uid);
	}
	snprintf(num, sizeof(num), "%d", fd);
	if (r == 0 && setenv(DLPD_CLOSING_ENV, num, 1) < 0)
		r = -errno;
	if (r < 0)
		close(fd);
	return r;
}

void dlpd_closers_adopt(void)
{
	const char *env = getenv(DLPD_CLOSING_ENV);
	size_t n = 0, cap = 0;
	char *end;
	long list;
	FILE *f;

	if (!env)
		return;
	list = strtol(env, &end, 10);
	unsetenv(DLPD_CLOSING_ENV);
	if (*end || list < 0 || list > INT32_MAX || fcntl((int)list, F_GETFD) < 0)
		return;
	f = fdopen((int)list, "r");
	if (!f) {
		close((int)list);
		return;
	}
	rewind(f);
	for (;;) {
		int fd;
		unsigned uid;

		if (fscanf(f, "%d:%u\n", &fd, &uid) != 2)
			break;
		/* only what is open here is ours: nothing else has been opened yet */
		if (fd < 0 || fd == (int)list || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
			continue;
		if (n == cap) {
			size_t c2 = cap ? cap * 2 : 64;
			struct dlpd_closing *v = realloc(C.adopted, c2 * sizeof(*v));

			if (!v)
				break;
			C.adopted = v;
			cap = c2;
		}
		C.adopted[n++] = (struct dlpd_closing){fd, (uid_t)uid};
	}
	fclose(f);
	C.nadopted = n;
}
