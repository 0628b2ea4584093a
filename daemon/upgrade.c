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
 * attaches carried across in a form both images agree on. They are shut and their sockets
 * handed to closers (closer.c), never closed by the exec; clients made to reconnect do so on
 * their next call, and only the references they held are lost
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
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "channel.h"
#include "direct.h"
#include "closer.h"
#include "peer.h"
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

/* Copy fds[i] to its slot 3 + i (and record it there); a copy made above the slots (one
 * moved out of the way) is closed, which cannot block: it is not the last reference. */
static int put(int *fds, size_t n, size_t i)
{
	int target = 3 + (int)i;

	if (fds[i] == target)
		return 0;
	if (dup2(fds[i], target) < 0)
		return -errno;
	if (fds[i] >= 3 + (int)n)
		close(fds[i]);
	fds[i] = target;
	return 0;
}

/*
 * Move fds[i] to 3 + i for every i, without close-on-exec. Fds of the daemon that are not
 * handed over may be overwritten: nothing runs but the exec after this. Each fd is handed over
 * once, so the fds whose slots hold another's form chains and cycles: a chain is placed from its
 * end (each slot is overwritten only once the fd on it is copied to its own), and a cycle is
 * opened by moving one of its fds above the slots. The table then never needs more than one
 * fd above the slots at a time: moving every fd in the way up first needed as many as there
 * were, and an upgrade with the fd budget full failed past its point of no return.
 */
static int place(int *fds, size_t n)
{
	/* on[k]: the index whose fd sits on slot 3 + k, or -1; path: a chain being placed */
	size_t *path = malloc(n * sizeof(*path) + 1);
	long *on = malloc(n * sizeof(*on) + 1);
	bool *done = calloc(n + 1, 1);
	int r = 0;

	if (!path || !on || !done) {
		r = -ENOMEM;
		goto out;
	}
	for (size_t k = 0; k < n; k++)
		on[k] = -1;
	for (size_t i = 0; i < n; i++)
		if (fds[i] >= 3 && (size_t)fds[i] < 3 + n)
			on[fds[i] - 3] = (long)i;
	for (size_t i = 0; r == 0 && i < n; i++) {
		size_t len = 0, cur = i;

		if (done[i])
			continue;
		/* follow what must be placed before i: the fd on its slot, and so on */
		for (;;) {
			long j = on[cur];

			path[len++] = cur;
			if (j < 0 || done[j] || (size_t)j == cur)
				break;
			if ((size_t)j == i) {
				/* a cycle: i's fd (on cur's slot) moves up, and cur's slot is free */
				int moved = fcntl(fds[i], F_DUPFD_CLOEXEC, 3 + (int)n);

				if (moved < 0) {
					r = -errno;
					break;
				}
				fds[i] = moved;
				on[cur] = -1;
				break;
			}
			cur = (size_t)j;
		}
		while (r == 0 && len > 0) {
			size_t k = path[--len];

			r = put(fds, n, k);
			done[k] = true;
		}
	}
	for (size_t i = 0; r == 0 && i < n; i++)
		if (fcntl(3 + (int)i, F_SETFD, 0) < 0)
			r = -errno;
out:
	free(path);
	free(on);
	free(done);
	return r;
}

struct handover {
	int *fds;
	size_t n, cap;
	char *names;
	size_t names_len, names_cap;
};

static int add_named(struct handover *h, int fd, const char *name)
{
	int len = (int)strlen(name);

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

static int add(struct handover *h, int fd, const char *fmt, uint64_t num)
{
	char name[64];

	snprintf(name, sizeof(name), fmt, num);
	return add_named(h, fd, name);
}

/* The fds the new image needs, and their names. */
static int collect(struct dlpd_server *s, struct handover *h, int journal, uint64_t gen)
{
	struct dlpd_hmap *m = &s->reg.names;
	int r = add(h, s->listen_fd, "listen", 0);

	if (r == 0 && s->owns_path)
		r = add(h, s->lock_fd, "lock", 0);
	if (r == 0)
		r = add(h, journal, DLPD_FDNAME_STATE "%" PRIx64, gen);
	/* the journal in the fd store, older: the new image drops it from the store */
	if (r == 0 && s->persist.journal_fd >= 0)
		r = add(h, s->persist.journal_fd, DLPD_FDNAME_STATE "%" PRIx64,
			s->persist.journal_gen);
	for (size_t b = 0; r == 0 && b < m->nbuckets; b++)
		for (struct dlpd_hnode *n = m->buckets[b]; r == 0 && n; n = n->next) {
			struct dlpd_entry *e = dlpd_container_of(n, struct dlpd_entry, node);

			if (!e->owner && e->st->fd >= 0 && e->st->sid)
				r = add(h, e->st->fd, DLPD_FDNAME_STORAGE "%" PRIx64, e->st->sid);
		}
	return r;
}

/*
 * Closes a closer has not finished (closer.c) must survive the exec at the numbers they have:
 * moving one would close it, and a close may block. Those among the numbers the handed-over fds
 * take (3 on) are handed over in place, named DLPD_FDNAME_CLOSING, the others moved around
 * them. All are told to the new image by dlpd_closers_export(), with the uid each is charged to.
 */
static int add_closing(struct handover *h, const struct dlpd_closing *cl, size_t ncl)
{
	struct handover out = {0};
	size_t n = h->n, k, next = 0;
	const char *names = h->names;
	int r = 0;

	/* the slots [3, 3 + n) take the n fds and every close whose number falls among them */
	do {
		k = 0;
		for (size_t i = 0; i < ncl; i++)
			k += cl[i].fd >= 3 && (size_t)cl[i].fd < 3 + n;
		if (h->n + k == n)
			break;
		n = h->n + k;
	} while (1);
	for (size_t slot = 0; r == 0 && slot < n; slot++) {
		const char *colon;
		char name[DLPD_FDNAME_MAX + 1];
		bool closing = false;
		size_t nlen;

		for (size_t i = 0; i < ncl && !closing; i++)
			closing = (size_t)cl[i].fd == 3 + slot;
		if (closing) {
			r = add_named(&out, 3 + (int)slot, DLPD_FDNAME_CLOSING);
			continue;
		}
		/* the next of the fds to hand over, with its name */
		colon = strchr(names, ':');
		nlen = colon ? (size_t)(colon - names) : strlen(names);
		snprintf(name, sizeof(name), "%.*s", (int)nlen, names);
		r = add_named(&out, h->fds[next++], name);
		names = colon ? colon + 1 : names + nlen;
	}
	if (r < 0) {
		free(out.fds);
		free(out.names);
		return r;
	}
	free(h->fds);
	free(h->names);
	*h = out;
	return 0;
}

static void exec_image(const char *path)
{
	execv(path, saved_argv);
	dlpd_log(LOG_ERR, "cannot execute %s: %m", path);
}

/* Hand what clients sent and no frame claimed to their uids' closers: the exec would close it,
 * and such a close may block. */
static void release_unread(struct dlpd_server *s)
{
	for (struct dlpd_list *l = s->peers.next; l != &s->peers; l = l->next) {
		struct dlpd_peer *p = dlpd_container_of(l, struct dlpd_peer, link);
		uid_t was = dlpd_closer_charge(p->uid);

		dlpc__rx_clear(&p->rx);
		dlpd_closer_charge(was);
	}
}

/* The upgrade does not happen after release_unread(): the connections lost what they had sent
 * and not yet framed, so they cannot go on. */
static void abandon(struct dlpd_server *s)
{
	for (struct dlpd_list *l = s->peers.next; l != &s->peers; l = l->next)
		dlpd_peer_fail(dlpd_container_of(l, struct dlpd_peer, link), LOG_DEBUG,
			       "upgrade failed");
}

static int push_closing(struct dlpd_closing **v, size_t *n, size_t *cap, int fd, uid_t uid)
{
	if (*n == *cap) {
		size_t c2 = *cap ? *cap * 2 : 64;
		struct dlpd_closing *nv = realloc(*v, c2 * sizeof(*nv));

		if (!nv)
			return -ENOMEM;
		*v = nv;
		*cap = c2;
	}
	(*v)[(*n)++] = (struct dlpd_closing){fd, uid};
	return 0;
}

/*
 * Sockets whose last close frees what is in flight in them, fds clients sent that nobody read
 * (a lingering socket among them makes that close wait): the connections' (those kept while fds
 * are in flight to them too) and the direct channels' ends. The exec would close them, and place() could replace them, in the daemon's
 * thread; so they are counted with the closes pending (@p cl), and handed to closers at the
 * last moment (hand_sockets()). The channels in @p chans (free() it).
 */
static int add_sockets(struct dlpd_server *s, struct dlpd_closing **cl, size_t *ncl,
		       struct dlpd_channel ***chans, size_t *nchans)
{
	struct dlpd_list *lists[] = {&s->peers, &s->lingering};
	size_t cap = *ncl;
	int r = 0;

	for (size_t i = 0; r == 0 && i < 2; i++)
		for (struct dlpd_list *l = lists[i]->next; r == 0 && l != lists[i]; l = l->next) {
			struct dlpd_peer *p =
				i == 0 ? dlpd_container_of(l, struct dlpd_peer, link)
				       : dlpd_container_of(l, struct dlpd_peer, fail_link);

			r = push_closing(cl, ncl, &cap, p->fd, p->uid);
		}
	for (struct dlpd_list *l = s->drains.next; r == 0 && l != &s->drains; l = l->next) {
		const struct dlpd_drain *d = dlpd_container_of(l, struct dlpd_drain, link);

		r = push_closing(cl, ncl, &cap, d->fd, d->uid);
	}
	if (r == 0)
		r = dlpd_channel_range(&s->reg, (const uint8_t *)"", 0, (const uint8_t *)"", 0,
				       SIZE_MAX, chans, nchans);
	for (size_t i = 0; r == 0 && i < *nchans; i++)
		for (int e = 0; r == 0 && e < 2 && (*chans)[i]->ends[0] >= 0; e++)
			r = push_closing(cl, ncl, &cap, (*chans)[i]->ends[e], (*chans)[i]->uid);
	return r;
}

/* Hand add_sockets()'s sockets to their uids' closers, shut first (their clients see the end
 * at once) and kept open across the exec (passed on as closes pending). */
static void hand_sockets(struct dlpd_server *s, struct dlpd_channel **chans, size_t nchans)
{
	struct dlpd_list *lists[] = {&s->peers, &s->lingering};

	for (size_t i = 0; i < 2; i++)
		for (struct dlpd_list *l = lists[i]->next; l != lists[i]; l = l->next) {
			struct dlpd_peer *p =
				i == 0 ? dlpd_container_of(l, struct dlpd_peer, link)
				       : dlpd_container_of(l, struct dlpd_peer, fail_link);

			fcntl(p->fd, F_SETFD, 0);
			shutdown(p->fd, SHUT_RDWR);
			dlpd_close_uid(p->uid, p->fd);
		}
	dlpd_peer_drains_hand(s);
	for (size_t i = 0; i < nchans; i++)
		if (chans[i]->ends[0] >= 0) {
			fcntl(chans[i]->ends[0], F_SETFD, 0);
			fcntl(chans[i]->ends[1], F_SETFD, 0);
			dlpd_direct_close(s, chans[i]);
		}
	free(chans);
}

/* Can the binary be executed? Then what the new image takes over, the entries and a snapshot
 * of the journal (in *@p journal), into @p h. false, logged, if not. */
static bool handover_prepare(struct dlpd_server *s, struct handover *h, int *journal)
{
	uint64_t gen;
	int r;

	if (!s->self_exe || access(s->self_exe, X_OK) < 0) {
		dlpd_log(LOG_ERR, "not upgrading: cannot execute %s: %s",
			 s->self_exe ? s->self_exe : "the binary (its path is unknown)",
			 s->self_exe ? strerror(errno) : "readlink /proc/self/exe failed at start");
		return false;
	}
	r = dlpd_persist_snapshot(s, journal, &gen);
	if (r == 0)
		r = collect(s, h, *journal, gen);
	if (r == 0 && h->names_len > FDNAMES_MAX)
		r = -E2BIG;
	if (r < 0) {
		dlpd_log(LOG_ERR, "not upgrading: cannot hand over %zu entries: %s",
			 s->reg.names.count, strerror(-r));
		return false;
	}
	return true;
}

/* Drop what handover_prepare() gathered, the upgrade refused. */
static void handover_free(struct handover *h, int journal)
{
	if (journal >= 0)
		close(journal);
	free(h->fds);
	free(h->names);
}

/* Storages only connections hold leave the store (the exec closes the connections), and what
 * waits for the service manager must reach it before this image goes: while it has not, the
 * connections are untouched and the upgrade can still be refused. false (refused, and the
 * manager told) if it did not in time. */
static bool notices_flushed(struct dlpd_server *s)
{
	dlpd_persist_drop_held(s);
	/* notifications waiting for room in the service manager's queue (storages for its fd
	 * store, removals) would die with this image */
	if (dlpd_notify_flush(DLPD_NOTIFY_WAIT_MS) == 0)
		return true;
	dlpd_log(LOG_ERR,
		 "not upgrading: the service manager did not take %zu notifications within "
		 "%d ms",
		 dlpd_notify_queued(), DLPD_NOTIFY_WAIT_MS);
	/* behind the RELOADING=1 that waits with the rest: the manager, once it reads, sees the
	 * reload end and this image serving on */
	dlpd_notify("READY=1\nSTATUS=upgrade refused: the service manager did not take "
		    "its notifications in time");
	return false;
}

/* The closes pending the new image takes over, into @p h: the closers' (*@p cl, *@p ncl) and
 * the sockets (add_sockets(): the channels in *@p chans). 0 or negative errno. */
static int gather_closes(struct dlpd_server *s, struct handover *h, struct dlpd_closing **cl,
			 size_t *ncl, struct dlpd_channel ***chans, size_t *nchans)
{
	int r;

	release_unread(s);
	r = dlpd_closers_handover(cl, ncl);
	if (r == 0)
		r = add_sockets(s, cl, ncl, chans, nchans);
	if (r == 0 && *ncl)
		r = add_closing(h, *cl, *ncl);
	if (r == 0 && h->names_len > FDNAMES_MAX)
		r = -E2BIG;
	return r;
}

/* The environment of a socket-activated start, with @p h's fds. 0, or -1 (logged). */
static int set_listen_env(const struct handover *h)
{
	char pid[32], nfds[32];

	snprintf(pid, sizeof(pid), "%d", (int)getpid());
	snprintf(nfds, sizeof(nfds), "%zu", h->n);
	if (setenv("LISTEN_PID", pid, 1) < 0 || setenv("LISTEN_FDS", nfds, 1) < 0 ||
	    setenv("LISTEN_FDNAMES", h->names, 1) < 0 ||
	    (dlpd_notify_socket() && setenv("NOTIFY_SOCKET", dlpd_notify_socket(), 1) < 0)) {
		dlpd_log(LOG_ERR, "not upgrading: cannot set the environment: %m");
		return -1;
	}
	return 0;
}

static void unset_listen_env(void)
{
	unsetenv("LISTEN_PID");
	unsetenv("LISTEN_FDS");
	unsetenv("LISTEN_FDNAMES");
	unsetenv("NOTIFY_SOCKET");
}

/* No way back: hand the sockets to closers, move @p h's fds to their slots and execute the
 * binary, telling it of the closes pending @p cl. Returns only by exiting. */
static void handover_exec(struct dlpd_server *s, struct handover *h, struct dlpd_closing *cl,
			  size_t ncl, struct dlpd_channel **chans, size_t nchans)
{
	sigset_t hold;
	int r;

	hand_sockets(s, chans, nchans);
	/* channels do not survive: direct ones' users hear it now (EPIPE, end of stream) */
	dlpd_direct_shutdown_all(s);
	/* The new image holds these back until it can handle them (main.c); a signal sent
	 * meanwhile waits instead of killing it by default. The mask survives the exec. */
	sigemptyset(&hold);
	sigaddset(&hold, SIGTERM);
	sigaddset(&hold, SIGINT);
	sigaddset(&hold, SIGHUP);
	/* and a closer's exit: libuv's handler would write to a pipe that place() replaces */
	sigaddset(&hold, SIGCHLD);
	sigprocmask(SIG_BLOCK, &hold, NULL);
	/* from here on the fds move: nothing may close one behind our back */
	dlpd_reaper_freeze();
	r = place(h->fds, h->n);
	if (r < 0) {
		dlpd_log(LOG_ERR, "upgrade failed moving the fds to hand over: %s", strerror(-r));
		_exit(1);
	}
	/* (made now: its fd must not be one of the slots place() fills) */
	r = dlpd_closers_export(cl, ncl);
	if (r < 0)
		dlpd_log(LOG_WARNING,
			 "cannot tell the new image of %zu fds still closing (%s): they stay "
			 "open there",
			 ncl, strerror(-r));
	free(cl);
	/* the loop's fds may be replaced: no more of it; the closers quit once they are done */
	dlpd_closers_exec();
	dlpd_closers_quit_all();
	exec_image(s->self_exe);
	/* the image running now, whatever became of the file */
	exec_image("/proc/self/exe");
	_exit(1);
}

void dlpd_upgrade(struct dlpd_server *s)
{
	struct handover h = {0};
	struct dlpd_closing *cl = NULL;
	struct dlpd_channel **chans = NULL;
	size_t ncl = 0, nchans = 0;
	int journal = -1, r;

	if (!handover_prepare(s, &h, &journal)) {
		handover_free(&h, journal);
		return;
	}
	dlpd_notify("RELOADING=1\nSTATUS=upgrading: executing %s", s->self_exe);
	if (!notices_flushed(s)) {
		handover_free(&h, journal);
		return;
	}
	r = gather_closes(s, &h, &cl, &ncl, &chans, &nchans);
	if (r < 0) {
		dlpd_log(LOG_ERR, "not upgrading: cannot hand over %zu closes pending: %s", ncl,
			 strerror(-r));
		abandon(s);
		free(cl);
		free(chans);
		dlpd_notify("READY=1\nSTATUS=upgrade refused: cannot hand over the closes pending");
		handover_free(&h, journal);
		return;
	}
	dlpd_log(LOG_NOTICE,
		 "upgrading: executing %s with %zu fds (%zu entries); closing %llu connections",
		 s->self_exe, h.n, s->reg.names.count, (unsigned long long)s->npeers);
	if (set_listen_env(&h) < 0) {
		abandon(s);
		free(cl);
		free(chans);
		/* the reload the manager was told of ends here: this image serves on */
		dlpd_notify("READY=1\nSTATUS=upgrade refused: cannot set the environment");
		unset_listen_env();
		handover_free(&h, journal);
		return;
	}
	handover_exec(s, &h, cl, ncl, chans, nchans);
}
