/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The connection core's object: a dlpc_client's life (made, referenced, freed), the list of open
 * clients that fork() walks, and the tables through which features hang off a connection
 * (notices, hooks). Its writes besides requests (the releases deferred until the connection's
 * next request, CANCELs, the write lock): write.c; requests and replies: reader.c and call.c;
 * connecting: call.c; the library's thread: loop.c and serve.c.
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

/*
 * Every open client, so that a forked child can close the sockets it inherited: otherwise a
 * child (a DataLoader worker, a preforked server) would keep its parent's connection, with its
 * references and ephemeral entries, alive after the parent closed it or died. The child cannot
 * use them anyway (dlpc__check). fork() takes the list lock first, so the list is whole in the
 * child.
 */
static pthread_mutex_t open_mu = PTHREAD_MUTEX_INITIALIZER;
/* on open_mu: a turn of the library's thread let go of a client that dlpc_close() waits for */
static pthread_cond_t turn_cv = PTHREAD_COND_INITIALIZER;
static dlpc_client *open_clients;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

const struct dlpc__hooks *dlpc__hooks[DLPC__HOOKS_MAX];
size_t dlpc__nhooks;
static const struct dlpc__notice *notices[DLPC__NOTICES_MAX];
static size_t nnotices;

void dlpc__hooks_add(const struct dlpc__hooks *h)
{
	assert(dlpc__nhooks < DLPC__HOOKS_MAX);
	if (dlpc__nhooks < DLPC__HOOKS_MAX)
		dlpc__hooks[dlpc__nhooks++] = h;
}

void dlpc__notice_add(const struct dlpc__notice *n)
{
	/* one feature a notice, with its handler */
	assert(nnotices < DLPC__NOTICES_MAX && n->take && !dlpc__notice_find(n->type));
	if (nnotices < DLPC__NOTICES_MAX)
		notices[nnotices++] = n;
}

const struct dlpc__notice *dlpc__notice_find(uint16_t type)
{
	for (size_t i = 0; i < nnotices; i++)
		if (notices[i]->type == type)
			return notices[i];
	return NULL;
}

static void atfork_prepare(void)
{
	pthread_mutex_lock(&open_mu);
	dlpc__loop_atfork(0);
	/* the features' locks are leaves: taken after these, by no thread holding one of them */
	for (dlpc_client *c = open_clients; c; c = c->next_open)
		DLPC__HOOKS_RUN(fork, c, 0);
	DLPC__HOOKS_RUN(atfork, 0);
	/* the deferred releases' locks last (leaves, held only across memory calls): a fork in
	 * the middle of growing a queue would leave the child a pointer already freed */
	for (dlpc_client *c = open_clients; c; c = c->next_open)
		pthread_mutex_lock(&c->pmu);
}

static void atfork_parent(void)
{
	for (dlpc_client *c = open_clients; c; c = c->next_open)
		pthread_mutex_unlock(&c->pmu);
	DLPC__HOOKS_RUN(atfork, 1);
	for (dlpc_client *c = open_clients; c; c = c->next_open)
		DLPC__HOOKS_RUN(fork, c, 1);
	dlpc__loop_atfork(1);
	pthread_mutex_unlock(&open_mu);
}

unsigned dlpc__fork_gen;

static void atfork_child(void)
{
	__atomic_add_fetch(&dlpc__fork_gen, 1, __ATOMIC_RELAXED);
	/* the parent's threads that wait on it are not here */
	pthread_cond_init(&turn_cv, NULL);
	for (dlpc_client *c = open_clients; c; c = c->next_open) {
		pthread_mutex_unlock(&c->pmu);
		c->turn_held = c->close_wait = false;
		dlpc__close(c->sock);
		c->sock = -1;
		dlpc__close(c->wake_fd);
		c->wake_fd = -1;
		DLPC__HOOKS_RUN(fork, c, 2);
	}
	DLPC__HOOKS_RUN(atfork, 2);
	/* the parent's deferred releases are the parent's business; no library thread runs here */
	dlpc__loop_atfork(2);
	pthread_mutex_unlock(&open_mu);
}

static void atfork_register(void)
{
	pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

/* Create @p c's socket and wake-up eventfd and list them in one step: a fork in between would
 * leave the child fds the list does not know, so the child would not close them. 0 or negative
 * errno. */
static int open_socket_listed(dlpc_client *c)
{
	int r = 0;

	pthread_once(&atfork_once, atfork_register);
	pthread_mutex_lock(&open_mu);
	c->sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (c->sock < 0)
		r = -errno;
	else if ((c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
		r = -errno;
	c->next_open = open_clients;
	open_clients = c;
	pthread_mutex_unlock(&open_mu);
	return r;
}

void dlpc__list_lock(void)
{
	pthread_mutex_lock(&open_mu);
}

void dlpc__list_unlock(void)
{
	pthread_mutex_unlock(&open_mu);
}

static void open_list_remove(dlpc_client *c)
{
	bool last;

	pthread_mutex_lock(&open_mu);
	for (dlpc_client **pp = &open_clients; *pp; pp = &(*pp)->next_open)
		if (*pp == c) {
			*pp = c->next_open;
			break;
		}
	last = !open_clients;
	pthread_mutex_unlock(&open_mu);
	/* no client, so no mapping of one left to clean: the process's pagemap fd goes too */
	if (last)
		DLPC__HOOKS_RUN(last_client);
}

void dlpc__client_ref(dlpc_client *c)
{
	atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
}

/* Free @p c now: its last reference went. A listed client is never freed otherwise, as the
 * library's thread may hold a reference to it (dlpc__clients_ref()). */
static void client_free(dlpc_client *c)
{
	open_list_remove(c);
	dlpc__close(c->sock);
	dlpc__rx_clear(&c->rx);
	dlpc__scratch_clear(&c->out);
	free(c->reclaimed);
	free(c->abandoned);
	DLPC__HOOKS_RUN(free, c);
	dlpc__close(c->wake_fd);
	pthread_mutex_destroy(&c->mu);
	pthread_mutex_destroy(&c->wmu);
	if (c->pending != c->pending_inline)
		free(c->pending);
	pthread_mutex_destroy(&c->pmu);
	pthread_cond_destroy(&c->cv);
	free(c);
}

/* Let go of a reference on @p c; true if perhaps only the library's thread holds it now. */
static bool unref(dlpc_client *c)
{
	/* read first: once this reference is gone another thread may free it */
	bool room = atomic_load(&c->await_room);
	unsigned was = atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel);

	assert(was > 0);
	if (was == 1)
		client_free(c);
	return was > 1 && was <= 3 && room;
}

void dlpc__client_unref(dlpc_client *c)
{
	/* perhaps only the library's thread holds it now, waiting for room on a connection
	 * closed meanwhile: let it look again and let go (serve.c) */
	if (unref(c))
		dlpc__loop_wake();
}

/* Drop a reference on @p c unless it is the last; whether it was dropped. */
static bool unref_unless_last(dlpc_client *c)
{
	unsigned n = atomic_load_explicit(&c->refs, memory_order_relaxed);

	while (n > 1)
		if (atomic_compare_exchange_weak_explicit(&c->refs, &n, n - 1, memory_order_acq_rel,
							  memory_order_relaxed))
			return true;
	return false;
}

void dlpc__client_unref_looked(dlpc_client *c, bool turn)
{
	bool dropped;

	if (!turn) {
		(void)unref(c);
		return;
	}
	/* the turn's hold and its reference go together, under the lock under which
	 * dlpc__client_unref_closed() reads both: it either waits for them or finds them gone */
	pthread_mutex_lock(&open_mu);
	c->turn_held = false;
	dropped = unref_unless_last(c);
	/* (dropped when it waits: it holds a reference of its own) */
	if (dropped && c->close_wait)
		pthread_cond_broadcast(&turn_cv);
	pthread_mutex_unlock(&open_mu);
	if (!dropped)
		(void)unref(c);
}

void dlpc__client_unref_closed(dlpc_client *c)
{
	bool dropped, room;

	pthread_mutex_lock(&open_mu);
	/* the handle's reference and the turn's only: no call, tensor or reclaim holds it, and
	 * none can start now; the thread, once woken, lets go within its turn (which runs no
	 * deleter of the user's: serve.c) */
	if (c->turn_held && atomic_load(&c->refs) == 2 && !dlpc__loop_is_self()) {
		c->close_wait = true;
		dlpc__loop_wake();
		while (c->turn_held)
			pthread_cond_wait(&turn_cv, &open_mu);
		/* a reference taken meanwhile (a call begun against the rules) keeps it
		 * served */
		c->close_wait = false;
	}
	/* Under the lock, as the turns take theirs: another holder frees it, later; if the
	 * handle's is the last, no turn may take one before it goes, below. */
	room = atomic_load(&c->await_room);
	dropped = unref_unless_last(c);
	if (!dropped)
		c->close_wait = true;
	pthread_mutex_unlock(&open_mu);
	if (!dropped)
		dlpc__client_unref(c);
	else if (room)
		dlpc__loop_wake(); /* as dlpc__client_unref() would: the thread may let go now */
}

/* Take a reference on @p c unless its last one is already gone (it is being freed). */
static bool client_tryref(dlpc_client *c)
{
	unsigned n = atomic_load_explicit(&c->refs, memory_order_relaxed);

	while (n)
		if (atomic_compare_exchange_weak_explicit(&c->refs, &n, n + 1, memory_order_acquire,
							  memory_order_relaxed))
			return true;
	return false;
}

size_t dlpc__clients_ref(dlpc_client ***buf, size_t *cap, bool turn)
{
	size_t n = 0;

	pthread_mutex_lock(&open_mu);
	for (dlpc_client *c = open_clients; c; c = c->next_open) {
		/* dlpc_close() waits for the turn before to let go of it */
		if (!dlpc__ours(c) || (turn ? c->close_wait : !atomic_load(&c->reclaimer)))
			continue;
		if (n == *cap) {
			size_t ncap = *cap ? *cap * 2 : 8;
			dlpc_client **nv = realloc(*buf, ncap * sizeof(*nv));

			if (!nv)
				break;
			*buf = nv;
			*cap = ncap;
		}
		if (client_tryref(c)) {
			c->turn_held = c->turn_held || turn;
			(*buf)[n++] = c;
		}
	}
	pthread_mutex_unlock(&open_mu);
	return n;
}

void dlpc__reclaim_count(dlpc_client *c, int delta, uint64_t conn_seq)
{
	pthread_mutex_lock(&c->mu);
	/* a publication of a connection replaced since went with it, and so did its count */
	if (conn_seq != c->conn_seq) {
		pthread_mutex_unlock(&c->mu);
		return;
	}
	c->ipc_pubs += (unsigned)delta;
	/* a publication taken back (its publish failed) may leave the library's thread watching
	 * a socket that has nothing more to say for it: let it look again */
	if (c->ipc_pubs == 0 && c->reclaimer)
		dlpc__loop_wake();
	pthread_mutex_unlock(&c->mu);
}

int dlpc__client_new(int64_t timeout, dlpc_client **ret)
{
	pthread_condattr_t ca;
	dlpc_client *c;
	int r;

	c = calloc(1, sizeof(*c));
	if (!c)
		return dlpc__fail(-ENOMEM, "out of memory");
	c->pid = getpid();
	c->wake_fd = -1;
	c->direct_wake = -1;
	c->watches = NULL;
	c->fork_gen = __atomic_load_n(&dlpc__fork_gen, __ATOMIC_RELAXED);
	c->call_timeout_ms = timeout;
	atomic_init(&c->refs, 1);
	pthread_mutex_init(&c->mu, NULL);
	pthread_mutex_init(&c->wmu, NULL);
	pthread_mutex_init(&c->pmu, NULL);
	c->pending = c->pending_inline;
	c->pending_cap = DLPC_RELEASE_PENDING_MAX;
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&c->cv, &ca);
	pthread_condattr_destroy(&ca);
	dlpc__rx_init(&c->rx);
	DLPC__HOOKS_RUN(init, c);
	/* a reply's fd that this process has no room for fails that call, not the connection */
	c->rx.report_lost_fds = true;
	r = open_socket_listed(c);
	if (r < 0) {
		r = dlpc__fail(r, "cannot create a socket: %s", strerror(-r));
		/* listed even so: the library's thread may hold a reference to it */
		dlpc__client_unref(c);
		return r;
	}
	*ret = c;
	return 0;
}

void dlpc__client_adopt(dlpc_client *c, dlpc_client *n)
{
	struct dlpc__rx rx;
	eventfd_t v;
	int sock;

	assert(c != n && n->conn_seq == 0);
	/* Whatever belonged to the old connection is void: its references (the daemon dropped
	 * them with it: releases naming it are dropped), the replies owed to abandoned calls,
	 * and the count of legacy CUDA IPC publications whose RECLAIM it would have carried (they
	 * are kept, as after any lost connection: nobody can say any more whether an attacher
	 * still uses them; only the new connection's own count from now on). The sockets change
	 * places under the lock of the open clients' list too, so that a fork meanwhile finds
	 * each listed once, and its child closes both. */
	pthread_mutex_lock(&c->wmu);
	pthread_mutex_lock(&c->mu);
	pthread_mutex_lock(&open_mu);
	sock = c->sock;
	c->sock = n->sock;
	n->sock = sock;
	pthread_mutex_unlock(&open_mu);
	rx = c->rx;
	c->rx = n->rx;
	n->rx = rx;
	c->broken = 0;
	c->fatal[0] = '\0';
	c->next_id = 0;
	c->nabandoned = 0;
	c->ipc_pubs = 0;
	c->nreclaimed = 0;
	/* no frame of releases is being written: wmu is held */
	pthread_mutex_lock(&c->pmu);
	dlpc__pending_drop(c);
	c->conn_seq++;
	pthread_mutex_unlock(&c->pmu);
	atomic_store(&c->await_room, false); /* the old socket's */
	eventfd_read(c->wake_fd, &v);	     /* a wake-up meant for the old connection's reader */
	/* what the features kept of the old connection goes with it (the cached references,
	 * pooled buffers in flight, the channels the old daemon knew) */
	DLPC__HOOKS_RUN(reset_locked, c);
	pthread_mutex_unlock(&c->mu);
	dlpc__write_unlock(c);
	DLPC__HOOKS_RUN(reset, c);
}
