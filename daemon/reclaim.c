/* SPDX-License-Identifier: Apache-2.0 */
/*
 * RECLAIM notices. A legacy CUDA IPC publication, or a VMM one with a reclaim token (lent memory,
 * 1.5), leaves the memory with its publisher, which may free it only once no attacher can reach
 * it: when the storage is freed (unpublished or replaced, and every reference released). The
 * daemon then tells the publishing connection, with the token it chose at publish, in a RECLAIM
 * frame of its own accord (id 0).
 *
 * Storages are freed deep inside registry changes (a RELEASE, another connection closing, a
 * replace in the middle of a PUBLISH). A freed storage only queues its token on the publisher,
 * and a zero-delay timer sends the queued notices on the loop's next turn, so that the tokens
 * freed by one change go out in one frame.
 */
#include <stdlib.h>

#include "peer.h"
#include "reclaim.h"

static void reclaim_flush(uv_timer_t *t)
{
	struct dlpd_server *s = t->data;

	while (!dlpd_list_empty(&s->reclaimers)) {
		struct dlpd_peer *p =
			dlpd_container_of(s->reclaimers.next, struct dlpd_peer, reclaim_link);
		Dlpackd__V1__Reclaim msg = DLPACKD__V1__RECLAIM__INIT;
		size_t done = 0;

		dlpd_list_del(&p->reclaim_link);
		while (done < p->nreclaims && !dlpd_peer_marked(p)) {
			size_t n = p->nreclaims - done;

			msg.n_tokens = n > DLPC_RECLAIM_BATCH_MAX ? DLPC_RECLAIM_BATCH_MAX : n;
			msg.tokens = p->reclaims + done;
			done += msg.n_tokens;
			/* a failure marks p, whose destruction frees what is left */
			if (dlpd_reply(p, DLPC_MSG_RECLAIM, 0, &msg.base, NULL, 0) < 0)
				break;
		}
		if (!dlpd_peer_marked(p))
			p->nreclaims = 0;
	}
}

void dlpd_reclaim_init(struct dlpd_server *s)
{
	uv_timer_init(s->loop, &s->reclaim_timer);
	s->reclaim_timer.data = s;
}

void dlpd_reclaim_stop(struct dlpd_server *s)
{
	uv_close((uv_handle_t *)&s->reclaim_timer, NULL);
}

void dlpd_reclaim_watch(struct dlpd_peer *p, struct dlpd_storage *st, uint64_t token)
{
	st->reclaim_holder = &p->held;
	st->reclaim_token = token;
	dlpd_list_add_tail(&p->held.lent, &st->reclaim_link);
}

void dlpd_reclaim_storage_freed(struct dlpd_storage *st)
{
	struct dlpd_peer *p = dlpd_container_of(st->reclaim_holder, struct dlpd_peer, held);
	struct dlpd_server *s = p->srv;

	dlpd_list_del(&st->reclaim_link);
	st->reclaim_holder = NULL;
	if (s->stopping || dlpd_peer_marked(p))
		return;
	if (p->nreclaims == p->reclaims_cap) {
		size_t cap = p->reclaims_cap ? p->reclaims_cap * 2 : 16;
		uint64_t *v = realloc(p->reclaims, cap * sizeof(*v));

		if (!v) {
			char desc[96];

			/* the publisher keeps the memory until its connection closes */
			dlpd_log(LOG_WARNING, "%s: out of memory; a RECLAIM notice is lost",
				 dlpd_peer_desc(p, desc, sizeof(desc)));
			return;
		}
		p->reclaims = v;
		p->reclaims_cap = cap;
	}
	p->reclaims[p->nreclaims++] = st->reclaim_token;
	if (p->nreclaims == 1)
		dlpd_list_add_tail(&s->reclaimers, &p->reclaim_link);
	uv_timer_start(&s->reclaim_timer, reclaim_flush, 0, 0);
}

void dlpd_reclaim_drop_peer(struct dlpd_peer *p)
{
	while (!dlpd_list_empty(&p->held.lent)) {
		struct dlpd_storage *st =
			dlpd_container_of(p->held.lent.next, struct dlpd_storage, reclaim_link);

		dlpd_list_del(&st->reclaim_link);
		st->reclaim_holder = NULL;
	}
	dlpd_list_del(&p->reclaim_link);
	free(p->reclaims);
	p->reclaims = NULL;
	p->nreclaims = p->reclaims_cap = 0;
}
