/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What a uid's unfinished work makes the daemon hold, and giving memory back.
 *
 * Three things grow with what a client sends or fails to read rather than with what it
 * publishes: the receive buffer of a frame not yet complete (up to DLPC_FRAME_MAX, for as long
 * as the frame deadline allows), requests that wait (an ATTACH for a name, a SEND for room, a
 * RECV for a message) and output queued for a connection that does not read (up to
 * --max-queue-bytes each). All are charged to the uid, so that the sum over all of its
 * connections stays within --max-pending-bytes-per-uid whatever their number, and, with what its
 * connections and records take (quota.c), within --max-memory-per-uid. A receive buffer is charged at its
 * capacity while it exists, and it exists only while it holds part of a frame (dispatch.c
 * frees it as soon as it is empty), so idle connections cost nothing here.
 *
 * Freed memory goes back to the system: blocks past DLPC_MEM_MMAP_THRESHOLD are mapped on their
 * own (the threshold is fixed, so glibc does not raise it after the first large free and keep
 * later large buffers in the heap), and after many small frees (waiters, connections) the heap
 * is trimmed, at most once per DLPC_MEM_TRIM_INTERVAL_MS.
 */
#include <errno.h>
#include <malloc.h>
#include <stdio.h>

#include "mem.h"

static void trim(uv_timer_t *t)
{
	struct dlpd_server *s = t->data;

	s->mem_freed = 0;
	s->mem_trimmed_ms = uv_now(s->loop);
#ifdef __GLIBC__
	malloc_trim(0);
#endif
}

/* After each turn of the loop: what the registry's records freed counts towards a trim. */
static void count_records(uv_check_t *c)
{
	struct dlpd_server *s = c->data;

	if (s->reg.freed) {
		dlpd_mem_freed(s, s->reg.freed);
		s->reg.freed = 0;
	}
}

void dlpd_mem_init(struct dlpd_server *s)
{
#ifdef __GLIBC__
	mallopt(M_MMAP_THRESHOLD, DLPC_MEM_MMAP_THRESHOLD);
#endif
	uv_timer_init(s->loop, &s->mem_trim);
	s->mem_trim.data = s;
	/* a trim to come is no reason to keep the loop running */
	uv_unref((uv_handle_t *)&s->mem_trim);
	uv_check_init(s->loop, &s->mem_check);
	s->mem_check.data = s;
	uv_check_start(&s->mem_check, count_records);
	uv_unref((uv_handle_t *)&s->mem_check);
}

void dlpd_mem_stop(struct dlpd_server *s)
{
	uv_close((uv_handle_t *)&s->mem_trim, NULL);
	uv_close((uv_handle_t *)&s->mem_check, NULL);
}

void dlpd_mem_freed(struct dlpd_server *s, uint64_t bytes)
{
	uint64_t now, next;

	s->mem_freed += bytes;
	if (s->mem_freed < DLPC_MEM_TRIM_AFTER || s->stopping ||
	    uv_is_active((uv_handle_t *)&s->mem_trim))
		return;
	now = uv_now(s->loop);
	next = s->mem_trimmed_ms + DLPC_MEM_TRIM_INTERVAL_MS;
	/* never in the middle of a request: on a later turn of the loop */
	uv_timer_start(&s->mem_trim, trim, next > now ? next - now : 0, 0);
}

/* What the two limits leave @p u of unfinished work: the room under
 * --max-pending-bytes-per-uid in @p proom, under --max-memory-per-uid (with its connections and
 * records) in @p mroom. */
static void rooms(const struct dlpd_server *s, const struct dlpd_usage *u, uint64_t *proom,
		  uint64_t *mroom)
{
	uint64_t plimit = s->lim.pending_bytes_per_uid, mlimit = s->lim.memory_per_uid;
	uint64_t all = u->memory + u->pending_bytes;

	*proom = u->pending_bytes < plimit ? plimit - u->pending_bytes : 0;
	*mroom = all < mlimit ? mlimit - all : 0;
}

static uint64_t room(const struct dlpd_server *s, const struct dlpd_usage *u)
{
	uint64_t proom, mroom;

	rooms(s, u, &proom, &mroom);
	return proom < mroom ? proom : mroom;
}

/* Is it --max-pending-bytes-per-uid (rather than --max-memory-per-uid) that leaves @p u less? */
static bool pending_binds(const struct dlpd_server *s, const struct dlpd_usage *u)
{
	uint64_t proom, mroom;

	rooms(s, u, &proom, &mroom);
	return proom <= mroom;
}

/* Does @p u hold more than either limit allows? */
static bool over(const struct dlpd_server *s, const struct dlpd_usage *u)
{
	return u->pending_bytes > s->lim.pending_bytes_per_uid ||
	       u->memory + u->pending_bytes > s->lim.memory_per_uid;
}

/* The limit that binds @p p's uid, for a message: "the limit is N (--flag)", and what it holds
 * besides its unfinished work when that is the memory limit. */
static void limit_text(const struct dlpd_peer *p, const char *lead, char *buf, size_t len)
{
	const struct dlpd_limits *lim = &p->srv->lim;

	if (pending_binds(p->srv, p->usage))
		snprintf(buf, len, "%s %llu (--max-pending-bytes-per-uid)", lead,
			 (unsigned long long)lim->pending_bytes_per_uid);
	else
		snprintf(buf, len,
			 "%s %llu with the %llu bytes of its connections and records "
			 "(--max-memory-per-uid)",
			 lead, (unsigned long long)lim->memory_per_uid,
			 (unsigned long long)p->usage->memory);
}

int dlpd_mem_charge(struct dlpd_peer *p, uint64_t bytes, char *why, size_t whylen)
{
	char limit[192];

	if (bytes > room(p->srv, p->usage)) {
		limit_text(p, "the limit is", limit, sizeof(limit));
		snprintf(why, whylen,
			 "uid %u holds %llu bytes of unfinished frames, waiting requests and "
			 "unread replies and asks for %llu more; %s",
			 (unsigned)p->uid, (unsigned long long)p->usage->pending_bytes,
			 (unsigned long long)bytes, limit);
		return -EDQUOT;
	}
	p->usage->pending_bytes += bytes;
	return 0;
}

void dlpd_mem_uncharge(struct dlpd_server *s, struct dlpd_usage *u, uint64_t bytes)
{
	u->pending_bytes -= bytes;
	dlpd_mem_freed(s, bytes);
}

void dlpd_mem_rx_limit(struct dlpd_peer *p)
{
	uint64_t left = room(p->srv, p->usage);

	/* What its own buffer holds is charged already: it may keep that. A buffer of
	 * DLPC_RX_BUF_SIZE it may always have for a read, so that requests that fit one (RELEASE,
	 * STAT, and whatever frees what the uid holds) are served even at the limit; if part of a
	 * frame is left in it afterwards, dlpd_mem_rx_over() decides. */
	size_t max = left > SIZE_MAX - p->rx.cap ? SIZE_MAX : p->rx.cap + (size_t)left;

	p->rx.cap_max = max > DLPC_RX_BUF_SIZE ? max : DLPC_RX_BUF_SIZE;
}

void dlpd_mem_rx_account(struct dlpd_peer *p)
{
	size_t cap = p->rx.cap;
	unsigned fds = dlpc__rx_fds(&p->rx);

	/* the fds of frames not yet complete: the daemon's, and its uid's */
	p->srv->rx_fds = p->srv->rx_fds - p->rx_fds + fds;
	p->usage->rx_fds = p->usage->rx_fds - p->rx_fds + fds;
	p->rx_fds = fds;
	if (cap > p->rx_charged) {
		p->usage->pending_bytes += cap - p->rx_charged;
	} else if (cap < p->rx_charged) {
		p->usage->pending_bytes -= p->rx_charged - cap;
		/* a buffer of DLPC_RX_BUF_SIZE goes after nearly every read, to be taken again by
		 * the next: that is no reason to trim */
		if (p->rx_charged > DLPC_RX_BUF_SIZE)
			dlpd_mem_freed(p->srv, p->rx_charged - cap);
	}
	p->rx_charged = cap;
}

void dlpd_mem_tx_account(struct dlpd_peer *p)
{
	size_t q = p->tx.bytes;

	/* the copies of fds its queue holds: the daemon's, and its uid's while it has one */
	p->srv->tx_fds = p->srv->tx_fds - p->tx_fds + p->tx.nfds;
	if (p->usage)
		p->usage->tx_fds = p->usage->tx_fds - p->tx_fds + p->tx.nfds;
	p->tx_fds = p->tx.nfds;
	if (!p->usage)
		return;
	if (q > p->tx_charged)
		p->usage->pending_bytes += q - p->tx_charged;
	else if (q < p->tx_charged)
		dlpd_mem_uncharge(p->srv, p->usage, p->tx_charged - q);
	p->tx_charged = q;
}

bool dlpd_mem_tx_over(const struct dlpd_peer *p, char *why, size_t whylen)
{
	char limit[192];

	if (!p->usage || p->tx_charged == 0 || !over(p->srv, p->usage))
		return false;
	limit_text(p, "over the limit of", limit, sizeof(limit));
	snprintf(why, whylen,
		 "it stopped reading and %zu bytes wait for it; uid %u holds %llu bytes of "
		 "unfinished frames, waiting requests and unread replies, %s",
		 p->tx.bytes, (unsigned)p->uid, (unsigned long long)p->usage->pending_bytes, limit);
	return true;
}

void dlpd_mem_forget(struct dlpd_peer *p)
{
	/* its buffer whatever its size: connections closing is when to give memory back */
	dlpd_mem_freed(p->srv, sizeof(*p) + p->rx_charged);
	dlpc__rx_clear(&p->rx);
	dlpd_mem_rx_account(p);
	if (p->tx_charged)
		dlpd_mem_uncharge(p->srv, p->usage, p->tx_charged);
	p->tx_charged = 0;
	/* its queue's fds are no longer its uid's (a connection that lingers has none; its
	 * queued bytes are charged again then: dispatch.c) */
	if (p->usage)
		p->usage->tx_fds -= p->tx_fds;
}

bool dlpd_mem_rx_over(const struct dlpd_peer *p)
{
	return p->rx_charged > 0 && over(p->srv, p->usage);
}

void dlpd_mem_rx_why(const struct dlpd_peer *p, uint32_t *id, char *why, size_t whylen)
{
	const struct dlpc__rx *rx = &p->rx;
	size_t have = rx->end - rx->start;
	char frame[64] = "a frame", limit[192];
	struct dlpc__hdr h;

	*id = 0;
	if (have >= DLPC_FRAME_HDR_SIZE) {
		dlpc__hdr_decode(rx->buf + rx->start, &h);
		*id = h.id;
		snprintf(frame, sizeof(frame), "a frame of %u bytes (request %u)", h.len, h.id);
	}
	limit_text(p, "the limit is", limit, sizeof(limit));
	snprintf(why, whylen,
		 "cannot buffer %s: uid %u holds %llu bytes of unfinished frames, waiting "
		 "requests and unread replies; %s",
		 frame, (unsigned)p->uid, (unsigned long long)p->usage->pending_bytes, limit);
}
