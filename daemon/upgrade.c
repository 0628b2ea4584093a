/* SPDX-License-Identifier: Apache-2.0 */
/*
 * An upgrade in place: on SIGHUP (dlpackctl upgrade sends it) dlpackd executes its binary again,
 * from the path it was started from, so that a package upgrade that replaced the file takes
 * effect. The new image keeps the pid and receives, as passed fds (LISTEN_FDS from fd 3 on,
 * named in LISTEN_FDNAMES, the way systemd passes them), the listening socket ("listen"), the
 * lock on its path if the daemon bound it ("lock"), a fresh state journal and every storage of
 * an entry that can outlive the daemon. It restores them as after a restart with systemd's fd
 * store (persist.c).
 *
 * Connections are not handed over: each would need its queues, references and waiting
 * attaches carried across in a form both images agree on. They are closed by the exec; clients
 * made to reconnect do so on their next call, and only the references they held are lost
 * (their mappings stay valid). The listening socket never closes, so a client connecting
 * meanwhile waits in its backlog and is served by the new image.
 *
 * Before anything irreversible the snapshot is written and the binary opened; if either fails
 * the daemon logs why and goes on serving. If the exec itself fails, the running image is
 * executed again (/proc/self/exe) with the same fds.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "channel.h"
#include "persist.h"
#include "reaper.h"
#include "upgrade.h"

/* The longest LISTEN_FDNAMES an exec takes (one string of the environment, MAX_ARG_STRLEN). */
#define FDNAMES_MAX (128 * 1024 - 64)

static char **saved_argv;

void dlpd_upgrade_init(struct dlpd_server *s, char **argv)
{
	char buf[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);

	saved_argv = argv;
	/* the path as it was at start: a package upgrade puts a new file there */
	if (n > 0) {
		buf[n] = '\0';
		s->self_exe = strdup(buf);
	}
}

/* Move fds[i] to 3 + i for every i, without close-on-exec. Fds of the daemon that are not
 * handed over may be overwritten: nothing runs but the exec after this. */
static int place(int *fds, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		int target = 3 + (int)i;

		if (fds[i] == target)
			continue;
		/* a later fd sitting on the target moves out of the way first */
		for (size_t j = i + 1; j < n; j++)
			if (fds[j] == target) {
				int moved = fcntl(target, F_DUPFD_CLOEXEC, 3 + (int)n);

				if (moved < 0)
					return -errno;
				fds[j] = moved;
			}
		if (dup2(fds[i], target) < 0)
			return -errno;
		fds[i] = target;
	}
	for (size_t i = 0; i < n; i++)
		if (fcntl(3 + (int)i, F_SETFD, 0) < 0)
			return -errno;
	return 0;
}

struct handover {
	int *fds;
	size_t n, cap;
	char *names;
	size_t names_len, names_cap;
};

static int add(struct handover *h, int fd, const char *fmt, uint64_t num)
{
	char name[64];
	int len = snprintf(name, sizeof(name), fmt, num);

	if (h->n == h->cap) {
		size_t cap = h->cap ? h->cap * 2 : 64;
		int *fds = realloc(h->fds, cap * sizeof(*fds));

		if (!fds)
			return -ENOMEM;
		h->fds = fds;
		h->cap = cap;
	}
	if (h->names_len + (size_t)len + 2 > h->names_cap) {
		size_t cap = h->names_cap ? h->names_cap * 2 : 1024;
		char *names;

		while (cap < h->names_len + (size_t)len + 2)
			cap *= 2;
		names = realloc(h->names, cap);
		if (!names)
			return -ENOMEM;
		h->names = names;
		h->names_cap = cap;
	}
	if (h->n)
		h->names[h->names_len++] = ':';
	memcpy(h->names + h->names_len, name, (size_t)len + 1);
	h->names_len += (size_t)len;
	h->fds[h->n++] = fd;
	return 0;
}

/* The fds the new image needs, and their names. */
static int collect(struct dlpd_server *s, struct handover *h, int journal, uint64_t epoch)
{
	struct dlpd_hmap *m = &s->reg.names;
	int r = add(h, s->listen_fd, "listen", 0);

	if (r == 0 && s->owns_path)
		r = add(h, s->lock_fd, "lock", 0);
	if (r == 0)
		r = add(h, journal, DLPD_FDNAME_STATE "%" PRIx64, epoch);
	/* the journal in the fd store, older: the new image drops it from the store */
	if (r == 0 && s->persist.journal_fd >= 0)
		r = add(h, s->persist.journal_fd, DLPD_FDNAME_STATE "%" PRIx64, s->persist.epoch);
	for (size_t b = 0; r == 0 && b < m->nbuckets; b++)
		for (struct dlpd_hnode *n = m->buckets[b]; r == 0 && n; n = n->next) {
			struct dlpd_entry *e = dlpd_container_of(n, struct dlpd_entry, node);

			if (!e->owner && e->st->fd >= 0 && e->st->sid)
				r = add(h, e->st->fd, DLPD_FDNAME_STORAGE "%" PRIx64, e->st->sid);
		}
	return r;
}

static void exec_image(const char *path)
{
	execv(path, saved_argv);
	dlpd_log(LOG_ERR, "cannot execute %s: %m", path);
}

void dlpd_upgrade(struct dlpd_server *s)
{
	struct handover h = {0};
	char pid[32], nfds[32];
	sigset_t hold;
	uint64_t epoch;
	int journal = -1, r;

	if (!s->self_exe || access(s->self_exe, X_OK) < 0) {
		dlpd_log(LOG_ERR, "not upgrading: cannot execute %s: %s",
			 s->self_exe ? s->self_exe : "the binary (its path is unknown)",
			 s->self_exe ? strerror(errno) : "readlink /proc/self/exe failed at start");
		return;
	}
	r = dlpd_persist_snapshot(s, &journal, &epoch);
	if (r == 0)
		r = collect(s, &h, journal, epoch);
	if (r == 0 && h.names_len > FDNAMES_MAX)
		r = -E2BIG;
	if (r < 0) {
		dlpd_log(LOG_ERR, "not upgrading: cannot hand over %zu entries: %s",
			 s->reg.names.count, strerror(-r));
		if (journal >= 0)
			close(journal);
		free(h.fds);
		free(h.names);
		return;
	}
	dlpd_log(LOG_NOTICE,
		 "upgrading: executing %s with %zu fds (%zu entries); closing %llu connections",
		 s->self_exe, h.n, s->reg.names.count, (unsigned long long)s->npeers);
	dlpd_notify("RELOADING=1\nSTATUS=upgrading: executing %s", s->self_exe);
	snprintf(pid, sizeof(pid), "%d", (int)getpid());
	snprintf(nfds, sizeof(nfds), "%zu", h.n);
	if (setenv("LISTEN_PID", pid, 1) < 0 || setenv("LISTEN_FDS", nfds, 1) < 0 ||
	    setenv("LISTEN_FDNAMES", h.names, 1) < 0 ||
	    (dlpd_notify_socket() && setenv("NOTIFY_SOCKET", dlpd_notify_socket(), 1) < 0)) {
		dlpd_log(LOG_ERR, "not upgrading: cannot set the environment: %m");
		/* the reload the manager was told of ends here: this image serves on */
		dlpd_notify("READY=1\nSTATUS=upgrade refused: cannot set the environment");
		unsetenv("LISTEN_PID");
		unsetenv("LISTEN_FDS");
		unsetenv("LISTEN_FDNAMES");
		unsetenv("NOTIFY_SOCKET");
		close(journal);
		free(h.fds);
		free(h.names);
		return;
	}
	dlpd_persist_drop_held(s);
	/* notifications waiting for room in the service manager's queue (storages for its fd
	 * store, removals) would die with this image */
	if (dlpd_notify_flush(DLPD_NOTIFY_WAIT_MS) > 0) {
		dlpd_log(LOG_ERR,
			 "not upgrading: the service manager did not take %zu notifications within "
			 "%d ms",
			 dlpd_notify_queued(), DLPD_NOTIFY_WAIT_MS);
		/* behind the RELOADING=1 that waits with the rest: the manager, once it reads,
		 * sees the reload end and this image serving on */
		dlpd_notify("READY=1\nSTATUS=upgrade refused: the service manager did not take "
			    "its notifications in time");
		unsetenv("LISTEN_PID");
		unsetenv("LISTEN_FDS");
		unsetenv("LISTEN_FDNAMES");
		unsetenv("NOTIFY_SOCKET");
		close(journal);
		free(h.fds);
		free(h.names);
		return;
	}
	/* channels do not survive: direct ones' users hear it now (EPIPE, end of stream) */
	dlpd_direct_shutdown_all(s);
	/* The new image holds these back until it can handle them (main.c); a signal sent
	 * meanwhile waits instead of killing it by default. The mask survives the exec. */
	sigemptyset(&hold);
	sigaddset(&hold, SIGTERM);
	sigaddset(&hold, SIGINT);
	sigaddset(&hold, SIGHUP);
	sigprocmask(SIG_BLOCK, &hold, NULL);
	/* from here on the fds move: nothing may close one behind our back */
	dlpd_reaper_freeze();
	r = place(h.fds, h.n);
	if (r < 0) {
		dlpd_log(LOG_ERR, "upgrade failed moving the fds to hand over: %s", strerror(-r));
		_exit(1);
	}
	exec_image(s->self_exe);
	/* the image running now, whatever became of the file */
	exec_image("/proc/self/exe");
	_exit(1);
}
