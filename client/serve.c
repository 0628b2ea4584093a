/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The library's thread's turn (when it runs and what wakes it: loop.c): for every open client,
 * run the deleters of reclaimed publications, let the features sweep what has been idle too long,
 * send deferred releases that fell due or whose socket has room again, and read the sockets
 * that a feature, or a publication awaiting its RECLAIM, wants read while no call reads them.
 */
#include <poll.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

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
		uint64_t *v = malloc(n * sizeof(*v)), conn_seq = c->conn_seq;

		if (!v)
			break; /* out of memory: the next turn tries again */
		memcpy(v, c->reclaimed, n * sizeof(*v));
		c->nreclaimed = 0;
		pthread_mutex_unlock(&c->mu);
		/* a deleter may call libdlpc: no lock held */
		for (size_t i = 0; i < n; i++)
			if (reclaim_run(v[i]))
				dlpc__reclaim_count(c, -1, conn_seq);
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

/* Kept from turn to turn in globals, not on the thread's stack only: in a child forked while the
 * loop waits they are still reachable (no leak to report). The clients of this turn (v), and
 * the sockets polled (p[1..]: p[0] is the loop's wake-up) with the client of each (owner). */
static dlpc_client **v, **owner;
static struct pollfd *p;
static size_t cap, pcap;

/* Let the features sweep each of the @p n clients of @p v for as long as a sweep is due; whether
 * a flush is due (*@p flush); the poll() timeout until the next deadline (-1: none). */
static int sweep_due(size_t n, bool *flush)
{
	bool flush2, sweep;
	int timeout = dlpc__loop_due(flush, &sweep);

	/* a sweep may fall due again while one runs (a slow machine): until none is due */
	while (sweep) {
		int64_t next = 0;

		for (size_t i = 0; i < n; i++)
			for (size_t h = 0; h < dlpc__nhooks; h++) {
				int64_t t = dlpc__hooks[h]->sweep ? dlpc__hooks[h]->sweep(v[i]) : 0;

				if (t && (!next || t < next))
					next = t;
			}
		if (next)
			dlpc__sweep_at(next);
		/* what became due meanwhile, and the next deadline: a flush taken now stays taken */
		timeout = dlpc__loop_due(&flush2, &sweep);
		*flush = *flush || flush2;
	}
	return timeout;
}

/* Is @p c's socket one the loop should wait on for room: a flush that must not wait found it
 * full (write.c)? Once the user closed it, only while more than the loop holds it (a mapping
 * that lives on): otherwise its end makes the releases void, and the loop must not keep it
 * open (dlpc__client_unref() wakes the loop when its last other holder goes). Under c->mu. */
static bool wants_room(dlpc_client *c)
{
	/* this turn's reference, and the one kept while publications await RECLAIM */
	unsigned loop_refs = 1 + (c->reclaimer ? 1 : 0);

	if (!atomic_load(&c->await_room) || c->broken || c->sock < 0)
		return false;
	return !c->closed || atomic_load(&c->refs) > loop_refs;
}

/* The sockets of the @p n clients of @p v that want reading, or room, into p and owner: their
 * number plus one (p[0]). *@p busy: one that wants reading has a reader already, or there was
 * no memory to list them (look again soon). */
static size_t poll_set(size_t n, bool *busy)
{
	size_t np = 1;

	*busy = false;
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

		short events = 0;

		pthread_mutex_lock(&c->mu);
		if (wants_reading(c)) {
			if (c->reading)
				*busy = true;
			else
				events = POLLIN;
		}
		/* read too while no call does: a daemon that holds back until its replies are
		 * read would otherwise never make room */
		if (wants_room(c))
			events |= c->reading ? POLLOUT : POLLOUT | POLLIN;
		if (events) {
			p[np].fd = c->sock;
			p[np].events = events;
			owner[np++] = c;
		}
		pthread_mutex_unlock(&c->mu);
	}
	if (n + 1 > pcap)
		*busy = true; /* out of memory: look again soon */
	return np;
}

/* @p c's socket, polled for @p events, reported @p revents: read it, or flush into the room that
 * came. A connection that ended reports POLLHUP: reading finds that out, and a flush then drops
 * what it had to send rather than wait for room again. */
static void ready(dlpc_client *c, short events, short revents)
{
	if (revents & (POLLIN | POLLERR | POLLHUP))
		dlpc__drain(c, true);
	if ((events & POLLOUT) && (revents & (POLLOUT | POLLERR | POLLHUP))) {
		atomic_store(&c->await_room, false);
		dlpc__flush_nowait(c);
	}
}

/* One turn: what is due now, then wait for the sockets, the wake-up or the next deadline. */
static void turn(void)
{
	size_t n = dlpc__clients_ref(&v, &cap, false), np, nready;
	bool flush, busy;
	int timeout;

	/* reclaims first: they may have been delivered by any reader since the last turn. Their
	 * deleters are the user's code, which may wait for a thread in dlpc_close(): the clients
	 * that have reclaims are held for them by references that dlpc_close() does not wait
	 * for, and no other client is held meanwhile. */
	for (size_t i = 0; i < n; i++)
		reclaim(v[i]);
	for (size_t i = 0; i < n; i++)
		dlpc__client_unref_looked(v[i], false);
	n = dlpc__clients_ref(&v, &cap, true);
	timeout = sweep_due(n, &flush);
	/* a client whose write is under way (a call's, maybe stuck on a daemon that does not read)
	 * has its writer send them: the thread goes on serving the others */
	if (flush)
		for (size_t i = 0; i < n; i++)
			dlpc__flush_nowait(v[i]);
	np = poll_set(n, &busy);
	if (busy && (timeout < 0 || timeout > DLPC__LOOP_BUSY_MS))
		timeout = DLPC__LOOP_BUSY_MS;
	/* only the clients whose sockets are polled stay referenced while the loop waits: a
	 * client closed meanwhile is freed by whoever lets go last, not kept by the loop */
	for (size_t i = 0; i < n; i++) {
		bool polled = false;

		for (size_t k = 1; k < np; k++)
			polled = polled || owner[k] == v[i];
		if (!polled)
			dlpc__client_unref_looked(v[i], true);
	}
	nready = dlpc__loop_wait(p, np, timeout);
	for (size_t i = 1; i < nready; i++)
		ready(owner[i], p[i].events, p[i].revents);
	dlpc__loop_looked();
	for (size_t i = 1; i < np; i++)
		dlpc__client_unref_looked(owner[i], true);
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
	ok = dlpc__loop_start();
	if (hold && !ok) {
		pthread_mutex_lock(&c->mu);
		c->reclaimer = false;
		pthread_mutex_unlock(&c->mu);
		dlpc__client_unref(c);
	}
}

void dlpc__serve_register(void)
{
	dlpc__loop_init(turn);
}
