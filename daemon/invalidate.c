/* SPDX-License-Identifier: Apache-2.0 */
/*
 * INVALIDATE notices (1.7). A client may keep a reference it no longer uses in its cache and
 * answer a later attach of the same name from it, without asking the daemon. That is safe only
 * if the client learns that the name has moved on before anyone can expect it to: so when an
 * entry is replaced or removed, every connection holding a cacheable reference of its storage
 * is sent an INVALIDATE frame, and this happens before the request that made the change is
 * answered (names.c calls here before it changes the registry, the handler replies after).
 *
 * The guarantee rests on the frame being in the client's socket by then: a stream socket
 * delivers in order, so a client that reads what its socket holds before answering from its
 * cache sees every invalidation of changes that were answered before it looked. A frame that
 * could not be written at once (the client stopped reading and its socket is full) would sit
 * in our queue instead, and the client could answer from its cache meanwhile: such a
 * connection is dropped, which ends its cache with it.
 */
#include <string.h>

#include "invalidate.h"
#include "peer.h"

void dlpd_invalidate(struct dlpd_server *s, const struct dlpd_entry *e)
{
	Dlpackd__V1__Invalidate m = DLPACKD__V1__INVALIDATE__INIT;
	struct dlpd_list *head = &e->st->refs;
	ssize_t len = 0;
	bool built = false;

	s->inval_seq++;
	for (struct dlpd_list *l = head->next; l != head; l = l->next) {
		struct dlpd_ref *ref = dlpd_container_of(l, struct dlpd_ref, st_link);
		struct dlpd_peer *p = dlpd_container_of(ref->holder, struct dlpd_peer, held);

		if (!ref->cacheable || p->inval_seen == s->inval_seq || dlpd_peer_marked(p) ||
		    p->broken)
			continue;
		p->inval_seen = s->inval_seq;
		if (!built) {
			m.name = e->pub->name;
			m.generation = e->generation;
			len = dlpc__msg_frame(&s->event_out, DLPC_MSG_INVALIDATE, 0, &m.base, 0);
			built = true;
		}
		if (len < 0) {
			dlpd_peer_fail(p, LOG_ERR, "cannot build an invalidation: %s",
				       strerror((int)-len));
			continue;
		}
		if (dlpd_peer_send(p, s->event_out.p, (size_t)len, NULL, 0) < 0)
			continue;
		s->stats.invalidations++;
		if (p->tx.head)
			dlpd_peer_fail(p, LOG_WARNING,
				       "dropped: it stopped reading, and an invalidation of its "
				       "cache could not be written to its socket before the change "
				       "is answered");
	}
}
