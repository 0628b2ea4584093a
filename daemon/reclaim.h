/* SPDX-License-Identifier: Apache-2.0 */
/* RECLAIM notices to legacy CUDA IPC and lent VMM publishers (reclaim.c). */
#ifndef DLPD_RECLAIM_H
#define DLPD_RECLAIM_H

#include "state.h"

/* Make @p p the publisher told when @p st is freed, with @p token. */
void dlpd_reclaim_watch(struct dlpd_peer *p, struct dlpd_storage *st, uint64_t token);
/* @p st is being freed: queue its notice for the next loop turn. */
void dlpd_reclaim_storage_freed(struct dlpd_storage *st);
/* @p p is going away: forget its storages and its unsent notices. */
void dlpd_reclaim_drop_peer(struct dlpd_peer *p);
void dlpd_reclaim_init(struct dlpd_server *s);
void dlpd_reclaim_stop(struct dlpd_server *s);

#endif
