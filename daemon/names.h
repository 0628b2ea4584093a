/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Changes to the names and everyone they concern (names.c): a publish, replace or removal is
 * applied to the registry and told, in order, to the watchers, to the attaches waiting for the
 * name and, when a storage is freed, to a legacy CUDA IPC or lent VMM publisher waiting for
 * RECLAIM.
 */
#ifndef DLPD_NAMES_H
#define DLPD_NAMES_H

#include "state.h"

/*
 * Make @p e (its storage held by it alone so far) visible under its name, replacing @p old
 * (NULL if none); if @p owner is not NULL the entry is ephemeral and goes with that
 * connection. The watchers hear of it, then its waiters are answered. On failure (-ENOMEM) @p e
 * and its storage are freed.
 */
int dlpd_names_publish(struct dlpd_server *s, struct dlpd_entry *e, struct dlpd_entry *old,
		       struct dlpd_peer *owner);
/* Remove @p e, tell the watchers (@p reason: a DLPC_WATCH_BY_*, by @p actor) and free it; its
 * storage lives on while referenced. */
void dlpd_names_remove(struct dlpd_server *s, struct dlpd_entry *e, int reason,
		       const struct dlpd_peer *actor);
/* Answer an ATTACH of @p e by @p p: a new reference and the storage fd, or the reason it is
 * refused. */
int dlpd_attach_answer(struct dlpd_peer *p, uint32_t id, struct dlpd_entry *e, uint32_t flags);
/* Drop @p ref, one of @p p's references. */
void dlpd_names_release(struct dlpd_peer *p, struct dlpd_ref *ref);
/* Take @p aw off its queue and free it (after its timer closed, if it had one). */
void dlpd_waiter_free(struct dlpd_attach_wait *aw);
/* Drop everything @p p holds: waiting attaches, ephemeral entries, references. */
void dlpd_names_drop_peer(struct dlpd_peer *p);
/* @p st is held by nothing any more (NULL: nothing to do): tell its lender, close its fd and
 * free it. */
void dlpd_storage_gone(struct dlpd_server *s, struct dlpd_storage *st);
/* Free every entry at stop, once every connection is gone. */
void dlpd_names_clear(struct dlpd_server *s);

#endif
