/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The listening socket: taking it over safely, accepting, and stopping.
 *
 * A daemon owns PATH by holding an flock on PATH.lock for its whole life. With the lock held,
 * a socket file that refuses connections was left by a dead daemon and is replaced; one that
 * accepts belongs to a live daemon started without the lock, and we refuse to start. On stop
 * the lock file is unlinked before the socket and the socket before the listener closes, so a
 * daemon starting meanwhile either sees the live listener or finds the path free.
 *
 * Under socket activation systemd owns the path: the daemon takes the listening fd it is given
 * and never locks, replaces or unlinks anything. An image of ours that upgrades in place
 * (upgrade.c) passes its socket with its lock, and the path stays ours.
 */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "closer.h"
#include "dispatch.h"
#include "handoff.h"
#include "mem.h"
#include "names.h"
#include "peer.h"
#include "persist.h"
#include "quota.h"
#include "reclaim.h"
#include "server.h"
#include "systemd.h"
#include "upgrade.h"

/* Wait this long before accepting again after running out of fds. */
#define ACCEPT_RETRY_MS 100

static void on_accept(uv_poll_t *h, int status, int events);

static void accept_resume(uv_timer_t *t)
{
	struct dlpd_server *s = t->data;

	if (!s->stopping)
		uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
}

/*
 * Refuse @p p, just accepted, for a reason given by @p fmt: it is told why in an ERROR (id 0,
 * @p err) before its socket closes, so that a client sees a refusal, not a connection dropped
 * as an upgrade drops it (libdlpc connects again after those, until its call timeout). A new
 * socket's buffer is empty: the ERROR leaves at once, and the connection costs nothing more.
 */
static void refuse(struct dlpd_peer *p, int err, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static void refuse(struct dlpd_peer *p, int err, const char *fmt, ...)
{
	Dlpackd__V1__Error e = DLPACKD__V1__ERROR__INIT;
	char why[384];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(why, sizeof(why), fmt, ap);
	va_end(ap);
	e.code = err;
	e.message = why;
	dlpd_reply(p, DLPC_MSG_ERROR, 0, &e.base, NULL, 0);
	dlpd_peer_fail(p, LOG_WARNING, "refused: %s", why);
}

/* Stop accepting for ACCEPT_RETRY_MS: the connections open are served meanwhile. */
static void accept_pause(struct dlpd_server *s)
{
	s->accept_paused = true;
	uv_poll_stop(&s->listen_poll);
	uv_timer_start(&s->accept_retry, accept_resume, ACCEPT_RETRY_MS, 0);
}

/* Refuse @p p, just accepted, at once if its uid is far over a quota (its connections, the
 * memory they and its records take, its share @p share of the fds); only over one, it is
 * refused at HELLO, with the reason. Whether it was refused. */
static bool refused_far_over(struct dlpd_peer *p, uint64_t share)
{
	struct dlpd_server *s = p->srv;
	uint64_t uid_fds;

	if (p->usage->connections > s->lim.connections_per_uid + DLPC_UID_CONNECTIONS_SLACK) {
		refuse(p, EDQUOT,
		       "uid %u has %llu connections, over the limit of %llu "
		       "(--max-connections-per-uid) by more than %d",
		       (unsigned)p->uid, (unsigned long long)p->usage->connections - 1,
		       (unsigned long long)s->lim.connections_per_uid, DLPC_UID_CONNECTIONS_SLACK);
		return true;
	}
	if (p->usage->memory >
	    s->lim.memory_per_uid + DLPC_UID_CONNECTIONS_SLACK * DLPD_CONNECTION_COST) {
		refuse(p, EDQUOT,
		       "uid %u has %llu bytes of dlpackd's memory, over the "
		       "limit of %llu (--max-memory-per-uid) by more than %d "
		       "connections",
		       (unsigned)p->uid, (unsigned long long)p->usage->memory,
		       (unsigned long long)s->lim.memory_per_uid, DLPC_UID_CONNECTIONS_SLACK);
		return true;
	}
	uid_fds = dlpd_uid_fds(p->usage);
	if (share < s->fd_budget && uid_fds > share + DLPC_UID_CONNECTIONS_SLACK) {
		char why[256];

		dlpd_uid_fd_share_why(p, uid_fds - 1, why, sizeof(why));
		refuse(p, EDQUOT, "%s, by more than %d", why, DLPC_UID_CONNECTIONS_SLACK);
		return true;
	}
	return false;
}

static void on_accept(uv_poll_t *h, int status, int events)
{
	struct dlpd_server *s = h->data;

	(void)status;
	(void)events;
	while (!s->stopping) {
		uint64_t fds = dlpd_fds_in_use(s), share = dlpd_uid_fd_share(s);
		struct dlpd_peer *p;
		char desc[96];
		int fd;

		/* Connections (and the fds of frames being received, dispatch.c) may use half of
		 * the reserve that publishing leaves (so that new clients still get in when
		 * storages fill the budget), never the other half, kept for what the daemon opens
		 * for a moment: past it they wait in the backlog until fds are free, as when
		 * accept itself fails. */
		if (s->fd_budget != UINT64_MAX && fds + 1 > s->fd_budget + DLPC_FD_RESERVE / 2) {
			if (!s->accept_paused)
				dlpd_log(LOG_WARNING,
					 "%llu storage and connection fds open, the most the fd "
					 "limit allows (RLIMIT_NOFILE less %llu fds of dlpackd's "
					 "own and %d in reserve); serving the open connections and "
					 "retrying every %d ms",
					 (unsigned long long)fds, (unsigned long long)s->fds_own,
					 DLPC_FD_RESERVE / 2, ACCEPT_RETRY_MS);
			accept_pause(s);
			return;
		}
		fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);

		if (fd < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK)
				return;
			/* EMFILE, ENFILE, ENOBUFS, ENOMEM: serve who we have, retry later (and say
			 * so once, not at every retry) */
			if (!s->accept_paused)
				dlpd_log(LOG_WARNING,
					 "cannot accept a connection (%m); serving the %llu open "
					 "ones "
					 "and retrying every %d ms",
					 (unsigned long long)s->npeers, ACCEPT_RETRY_MS);
			accept_pause(s);
			return;
		}
		if (s->accept_paused) {
			s->accept_paused = false;
			dlpd_log(LOG_NOTICE, "accepting connections again");
		}
		p = dlpd_peer_new(s, fd);
		if (!p) {
			dlpd_log(LOG_WARNING, "cannot set up a new connection: %m");
			close(fd);
			continue;
		}
		if (refused_far_over(p, share))
			continue;
		dlpd_log(LOG_DEBUG, "%s: accepted", dlpd_peer_desc(p, desc, sizeof(desc)));
	}
}

static void on_signal(uv_signal_t *h, int signum)
{
	struct dlpd_server *s = h->data;

	if (signum == SIGHUP) {
		dlpd_log(LOG_NOTICE, "received %s, upgrading in place", strsignal(signum));
		dlpd_upgrade(s);
		return;
	}
	dlpd_log(LOG_NOTICE, "received %s, stopping", strsignal(signum));
	dlpd_server_stop(s);
}

/* Is a daemon answering on @p path? 1 yes, 0 no (stale or absent), negative errno: unusable. */
static int probe(const char *path)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd, r;

	strcpy(sa.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	r = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
	r = r == 0 ? 1 : errno == ECONNREFUSED || errno == ENOENT ? 0 : -errno;
	close(fd);
	return r;
}

/* How long a starting daemon waits for the lock on its path to be let go. */
#define LOCK_WAIT_MS 1000

static int take_lock(struct dlpd_server *s)
{
	size_t n = strlen(s->path) + sizeof(".lock");
	struct stat held, now;

	s->lock_path = malloc(n);
	if (!s->lock_path)
		return -ENOMEM;
	snprintf(s->lock_path, n, "%s.lock", s->path);
	/* A stopping daemon unlinks the lock file: if ours was unlinked between open() and
	 * flock(), the lock we got guards nothing. Try again on the file now at the path. */
	for (int tries = 0; tries < 10; tries++) {
		s->lock_fd = open(s->lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
		if (s->lock_fd < 0) {
			int r = -errno;

			dlpd_log(LOG_ERR, "cannot open lock file %s: %m", s->lock_path);
			return r;
		}
		/* The closer processes of a daemon killed a moment ago (closer.c) share its fd
		 * table, lock included, until they are gone too: give them that moment. */
		for (int waited = 0; flock(s->lock_fd, LOCK_EX | LOCK_NB) < 0 &&
				     errno == EWOULDBLOCK && waited < LOCK_WAIT_MS;
		     waited += 10)
			usleep(10000);
		if (flock(s->lock_fd, LOCK_EX | LOCK_NB) < 0) {
			int r = -errno;

			if (errno == EWOULDBLOCK)
				dlpd_log(LOG_ERR, "another dlpackd is already running on %s",
					 s->path);
			else
				dlpd_log(LOG_ERR, "cannot lock %s: %m", s->lock_path);
			return r == -EWOULDBLOCK ? -EADDRINUSE : r;
		}
		if (fstat(s->lock_fd, &held) == 0 && stat(s->lock_path, &now) == 0 &&
		    held.st_ino == now.st_ino && held.st_dev == now.st_dev)
			return 0;
		close(s->lock_fd);
		s->lock_fd = -1;
	}
	dlpd_log(LOG_ERR, "lock file %s keeps changing under us", s->lock_path);
	return -EAGAIN;
}

/* Create the socket's directory if it is missing (one level, like RuntimeDirectory=). */
static void make_parent(const char *path)
{
	char *copy = strdup(path);

	if (!copy)
		return;
	if (mkdir(dirname(copy), 0755) == 0)
		dlpd_log(LOG_INFO, "created directory %s", copy);
	free(copy);
}

/* RLIMIT_NOFILE now, UINT64_MAX for none. */
static uint64_t fd_limit(void)
{
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY)
		return UINT64_MAX;
	return rl.rlim_cur;
}

/* Storages and connections may use the fds @p limit allows, less the daemon's own (@p own)
 * and DLPC_FD_RESERVE. */
static uint64_t fd_budget(uint64_t limit, uint64_t own)
{
	if (limit == UINT64_MAX)
		return UINT64_MAX;
	return limit > DLPC_FD_RESERVE + own ? limit - DLPC_FD_RESERVE - own : 0;
}

/*
 * Count the fds the daemon holds for itself: whatever is open and neither in the budget (a
 * storage, a connection, a closer's) nor one of the @p passed storages and journals still to be
 * restored. That includes fds it was started with and does not know (a service manager's, a
 * parent's that were not close-on-exec), so that DLPC_FD_RESERVE stays whole for what it
 * opens while serving.
 */
static void count_own_fds(struct dlpd_server *s, size_t passed)
{
	uint64_t open, counted = dlpd_fds_in_use(s) + passed;

	s->fd_limit = fd_limit();
	/* those that take numbers below the limit: a tool's above it (valgrind's) take none */
	open = dlpd_count_fds(s->fd_limit);

	if (open == 0)
		dlpd_log(LOG_WARNING,
			 "cannot count the fds open (/proc/self/fd: %m): the fd budget leaves "
			 "out only DLPC_FD_RESERVE (%d)",
			 DLPC_FD_RESERVE);
	s->fds_own = open > counted ? open - counted : 0;
	s->fd_budget = fd_budget(s->fd_limit, s->fds_own);
	dlpd_log(LOG_DEBUG,
		 "%llu fds open, %llu of them in the budget and %zu to restore: %llu are "
		 "dlpackd's own",
		 (unsigned long long)open, (unsigned long long)(counted - passed), passed,
		 (unsigned long long)s->fds_own);
}

/*
 * The suffix of the name a socket of our own is bound to first, in the socket's directory: it
 * gets its mode and group and starts listening there, and only then is renamed onto the path,
 * so the path never names a socket that refuses connections (a client that sees the file can
 * connect at once). An upgraded image finds it in the name its listening socket was bound to.
 */
#define BIND_SUFFIX ".new"
_Static_assert(sizeof(((struct sockaddr_un *)0)->sun_path) - sizeof(BIND_SUFFIX) ==
		       DLPC_DAEMON_SOCKET_PATH_MAX,
	       "PATH.new fits a socket address");

/* Remove a socket left at @p path by a daemon that was killed; refuse anything else there. We
 * hold the lock. 0 or negative errno. */
static int clear_stale(const char *path)
{
	struct stat st;

	if (lstat(path, &st) < 0)
		return 0;
	if (!S_ISSOCK(st.st_mode)) {
		dlpd_log(LOG_ERR, "%s exists and is not a socket; not touching it", path);
		return -EEXIST;
	}
	if (unlink(path) == 0)
		dlpd_log(LOG_NOTICE, "removed stale socket %s", path);
	return 0;
}

/* Bind and listen on @p path, a socket of our own with the configured mode and group. */
static int bind_own(struct dlpd_server *s, const char *path)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	const char *tmp = sa.sun_path;
	int r;

	/* (a path from the default, $XDG_RUNTIME_DIR's, is not checked by config.c) */
	if (strlen(path) > DLPC_DAEMON_SOCKET_PATH_MAX) {
		dlpd_log(LOG_ERR,
			 "socket path %s is longer than %d bytes (DLPC_DAEMON_SOCKET_PATH_MAX: a "
			 "socket address holds %zu, and the socket is bound as PATH" BIND_SUFFIX
			 " first)",
			 path, DLPC_DAEMON_SOCKET_PATH_MAX, sizeof(sa.sun_path) - 1);
		return -ENAMETOOLONG;
	}
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s" BIND_SUFFIX, path);
	s->path = strdup(path);
	if (!s->path)
		return -ENOMEM;
	make_parent(path);
	r = take_lock(s);
	if (r < 0)
		return r;
	r = probe(path);
	if (r == 1) {
		dlpd_log(LOG_ERR, "another dlpackd is already running on %s", path);
		return -EADDRINUSE;
	}
	if (r < 0) {
		dlpd_log(LOG_ERR, "cannot check socket %s: %s", path, strerror(-r));
		return r;
	}
	if ((r = clear_stale(path)) < 0 || (r = clear_stale(tmp)) < 0)
		return r;
	s->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (s->listen_fd < 0 || bind(s->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		r = -errno;
		dlpd_log(LOG_ERR, "cannot bind %s: %m", tmp);
		return r;
	}
	/* mode and group are right before listen(): until then nobody can connect */
	if (chmod(tmp, dlpd_config.socket_mode) < 0) {
		r = -errno;
		dlpd_log(LOG_ERR, "cannot set the mode of %s to %04o: %m", tmp,
			 dlpd_config.socket_mode);
		goto fail;
	}
	if (dlpd_config.socket_gid != (gid_t)-1 &&
	    chown(tmp, (uid_t)-1, dlpd_config.socket_gid) < 0) {
		r = -errno;
		dlpd_log(LOG_ERR, "cannot give %s to group %u: %m", tmp,
			 (unsigned)dlpd_config.socket_gid);
		goto fail;
	}
	if (listen(s->listen_fd, SOMAXCONN) < 0) {
		r = -errno;
		dlpd_log(LOG_ERR, "cannot listen on %s: %m", tmp);
		goto fail;
	}
	/* the path appears listening; never over something that came there meanwhile */
	r = renameat2(AT_FDCWD, tmp, AT_FDCWD, path, RENAME_NOREPLACE);
	if (r < 0 && (errno == EINVAL || errno == ENOSYS))
		r = rename(tmp, path);
	if (r < 0) {
		r = -errno;
		dlpd_log(LOG_ERR, "cannot rename %s to %s: %m", tmp, path);
		goto fail;
	}
	s->owns_path = true;
	return 0;
fail:
	unlink(tmp);
	return r;
}

/* Adopt @p fd, a listening socket passed to us. Its path stays systemd's business, and is kept
 * for log lines only (or "@name" for an abstract address), unless @p lock_fd, the lock on it
 * that an upgrading image of ours held, says we own it. */
static int adopt(struct dlpd_server *s, int fd, int lock_fd)
{
	struct sockaddr_un sa;
	socklen_t len = sizeof(sa);
	size_t n;

	s->listen_fd = fd;
	memset(&sa, 0, sizeof(sa));
	if (getsockname(fd, (struct sockaddr *)&sa, &len) < 0 ||
	    len <= offsetof(struct sockaddr_un, sun_path) + 1) {
		if (lock_fd >= 0)
			close(lock_fd);
		s->path = strdup("an unnamed socket");
		return s->path ? 0 : -ENOMEM;
	}
	n = len - offsetof(struct sockaddr_un, sun_path);
	if (sa.sun_path[0] == '\0')
		sa.sun_path[0] = '@';
	s->path = strndup(sa.sun_path, n);
	if (!s->path)
		return -ENOMEM;
	/* a path, absolute or relative (dlpackd does not change directory); not an abstract name */
	if (lock_fd >= 0 && s->path[0] != '@') {
		size_t ln;

		/* ours, bound as PATH.new and renamed to PATH (bind_own()) */
		n = strlen(s->path);
		if (n > strlen(BIND_SUFFIX) &&
		    strcmp(s->path + n - strlen(BIND_SUFFIX), BIND_SUFFIX) == 0)
			s->path[n - strlen(BIND_SUFFIX)] = '\0';
		ln = strlen(s->path) + sizeof(".lock");

		s->lock_path = malloc(ln);
		if (!s->lock_path)
			return -ENOMEM;
		snprintf(s->lock_path, ln, "%s.lock", s->path);
		s->lock_fd = lock_fd;
		s->owns_path = true;
	} else if (lock_fd >= 0) {
		close(lock_fd);
	}
	return 0;
}

/* On failure nothing is unlinked (the path may be another daemon's); dlpd_server_free() closes
 * what was opened. */
void dlpd_server_init(struct dlpd_server *s, uv_loop_t *loop, const struct dlpd_limits *lim)
{
	memset(s, 0, sizeof(*s));
	s->lim = *lim;
	/* until dlpd_server_start() counts the daemon's own */
	s->fd_limit = fd_limit();
	s->fd_budget = fd_budget(s->fd_limit, 0);
	s->loop = loop;
	s->listen_fd = s->lock_fd = -1;
	dlpd_list_init(&s->peers);
	dlpd_list_init(&s->watchers);
	dlpd_list_init(&s->reclaimers);
	dlpd_registry_init(&s->reg);
	dlpd_dispatch_init(s);
	dlpd_reclaim_init(s);
	dlpd_mem_init(s);
	s->start_ms = dlpd_now_ms();
	dlpd_persist_init(s);
}

int dlpd_server_start(struct dlpd_server *s, uv_loop_t *loop, const struct dlpd_start *how,
		      const struct dlpd_limits *lim)
{
	int r;

	dlpd_server_init(s, loop, lim);
	r = how->listen_fd >= 0 ? adopt(s, how->listen_fd, how->lock_fd) : bind_own(s, how->path);
	if (r < 0) {
		for (size_t i = 0; i < how->nrestore; i++)
			close(how->restore[i].fd);
		return r;
	}
	s->listening = true;
	uv_poll_init(loop, &s->listen_poll, s->listen_fd);
	s->listen_poll.data = s;
	uv_poll_start(&s->listen_poll, UV_READABLE, on_accept);
	uv_timer_init(loop, &s->accept_retry);
	dlpd_notify_start(loop);
	s->accept_retry.data = s;
	uv_signal_init(loop, &s->sig_term);
	uv_signal_init(loop, &s->sig_int);
	uv_signal_init(loop, &s->sig_hup);
	s->sig_term.data = s->sig_int.data = s->sig_hup.data = s;
	uv_signal_start(&s->sig_term, on_signal, SIGTERM);
	uv_signal_start(&s->sig_int, on_signal, SIGINT);
	uv_signal_start(&s->sig_hup, on_signal, SIGHUP);
	r = dlpd_closers_init(loop, &s->reg);
	if (r < 0)
		dlpd_log(LOG_WARNING,
			 "cannot set up closer processes (%s): fds clients sent are "
			 "closed on the reaper thread",
			 strerror(-r));
	/* Restored last, against the budget the daemon serves with: restoring more storages
	 * than that would leave no fd to accept a client with, not even one to unpublish. */
	count_own_fds(s, how->nrestore);
	/* room for the state journal that the restore keeps open with a store (it learns of
	 * the store itself) */
	if (s->fd_budget != UINT64_MAX && s->fd_budget > 0)
		s->fd_budget--;
	r = dlpd_persist_restore(s, how->restore, how->nrestore);
	if (r < 0)
		return r;
	/* the state journal a restore keeps open is the daemon's own too */
	count_own_fds(s, 0);
	dlpd_log(s->fds_own > DLPC_FD_RESERVE ? LOG_NOTICE : LOG_DEBUG,
		 "%llu fds are dlpackd's own; %llu are left for storages and connections "
		 "(RLIMIT_NOFILE %llu, less those and %d in reserve)",
		 (unsigned long long)s->fds_own, (unsigned long long)s->fd_budget,
		 (unsigned long long)s->fd_limit, DLPC_FD_RESERVE);
	dlpd_log(LOG_NOTICE, "dlpackd %s listening on %s%s", DLPD_VERSION, s->path,
		 s->owns_path ? "" : " (socket activation)");
	dlpd_log(LOG_INFO,
		 "limits: %llu bytes, %llu entries, %llu connections and %llu%% of the fds per "
		 "uid; %llu bytes of unfinished frames, waiting requests and unread replies per "
		 "uid; %llu references and %llu waiting requests per connection; frames finish "
		 "within %llu ms; %llu fds for storages and connections",
		 (unsigned long long)lim->bytes_per_uid, (unsigned long long)lim->entries_per_uid,
		 (unsigned long long)lim->connections_per_uid,
		 (unsigned long long)lim->fd_share_per_uid,
		 (unsigned long long)lim->pending_bytes_per_uid,
		 (unsigned long long)lim->refs_per_connection,
		 (unsigned long long)lim->pending_per_connection,
		 (unsigned long long)lim->frame_timeout_ms, (unsigned long long)s->fd_budget);
	return 0;
}

static void listener_closed(uv_handle_t *h)
{
	struct dlpd_server *s = h->data;

	/* Its last close frees the connections still in its backlog, and with them what their
	 * clients sent (a lingering socket among it makes that close wait): a closer's, then. */
	dlpd_close_uid(DLPD_UID_NOBODY, s->listen_fd);
	s->listen_fd = -1;
}

void dlpd_server_stop(struct dlpd_server *s)
{
	if (s->stopping)
		return;
	s->stopping = true;
	dlpd_notify("STOPPING=1");
	/* a socket systemd passed stays: it is systemd's, and it may start us again on it */
	if (s->owns_path) {
		unlink(s->lock_path);
		unlink(s->path);
	}
	/* a server that never listened (the fuzz target's, the dispatch tests') has only its
	 * connections */
	if (s->listening) {
		uv_close((uv_handle_t *)&s->listen_poll, listener_closed);
		uv_close((uv_handle_t *)&s->accept_retry, NULL);
		uv_close((uv_handle_t *)&s->sig_term, NULL);
		uv_close((uv_handle_t *)&s->sig_int, NULL);
		uv_close((uv_handle_t *)&s->sig_hup, NULL);
		dlpd_notify_stop();
	}
	dlpd_reclaim_stop(s);
	dlpd_dispatch_stop(s);
	dlpd_mem_stop(s);
	dlpd_closers_stop();
}

void dlpd_server_free(struct dlpd_server *s)
{
	dlpd_channels_clear(s);
	dlpd_names_clear(s);
	dlpd_registry_clear(&s->reg);
	dlpd_persist_free(s);
	free(s->self_exe);
	dlpc__scratch_clear(&s->out);
	dlpc__scratch_clear(&s->event_out);
	if (s->listen_fd >= 0)
		close(s->listen_fd);
	if (s->lock_fd >= 0)
		close(s->lock_fd);
	free(s->lock_path);
	free(s->path);
}
