/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's memory that a uid's unfinished work holds (mem.c): receive buffers of frames not
 * yet complete, waiting requests and output its connections have not read, charged to the uid
 * against --max-pending-bytes-per-uid; and giving freed memory back to the system.
 */
#ifndef DLPD_MEM_H
#define DLPD_MEM_H

#include "state.h"

/* What a waiting ATTACH costs the daemon: the waiter, the queue of its name (counted for each
 * waiter, as if every name were waited for once), and allocator and hash-map overhead. */
#define DLPD_ATTACH_WAIT_COST                                                                      \
	(sizeof(struct dlpd_attach_wait) + sizeof(struct dlpd_waitq) + DLPC_NAME_MAX + 64)

void dlpd_mem_init(struct dlpd_server *s);
void dlpd_mem_stop(struct dlpd_server *s);
/*
 * Charge @p bytes to @p p's uid. 0, or -EDQUOT with nothing charged when that would take the
 * uid past --max-pending-bytes-per-uid; @p why then names the limit and its value.
 */
int dlpd_mem_charge(struct dlpd_peer *p, uint64_t bytes, char *why, size_t whylen);
/* Give back a charge of @p bytes to @p u, and count them freed (dlpd_mem_freed()). */
void dlpd_mem_uncharge(struct dlpd_server *s, struct dlpd_usage *u, uint64_t bytes);
/* Count @p bytes freed: once DLPC_MEM_TRIM_AFTER were, the memory goes back to the system
 * (soon, and at most once per DLPC_MEM_TRIM_INTERVAL_MS). */
void dlpd_mem_freed(struct dlpd_server *s, uint64_t bytes);
/* Before @p p reads: its receive buffer may grow by what its uid may still hold. */
void dlpd_mem_rx_limit(struct dlpd_peer *p);
/* After @p p's receive buffer may have changed: charge its uid what it holds now. */
void dlpd_mem_rx_account(struct dlpd_peer *p);
/* After @p p's output queue changed: charge its uid what waits in it now. */
void dlpd_mem_tx_account(struct dlpd_peer *p);
/* Does what waits for @p p take its uid past the limit? Then @p why says so. */
bool dlpd_mem_tx_over(const struct dlpd_peer *p, char *why, size_t whylen);
/* @p p is destroyed: what still waits for it (an ERROR, for at most DLPC_ERROR_LINGER_MS) is no
 * longer its uid's. */
void dlpd_mem_forget(struct dlpd_peer *p);
/* After @p p's frames were served: does part of a frame left in its buffer take its uid past
 * the limit? (Then it cannot be kept, and the connection goes.) */
bool dlpd_mem_rx_over(const struct dlpd_peer *p);
/* Why @p p's buffer cannot grow or be kept (-EDQUOT from dlpc__rx_read(), or
 * dlpd_mem_rx_over()), for its ERROR and the log; @p id: the request whose frame it is, or 0. */
void dlpd_mem_rx_why(const struct dlpd_peer *p, uint32_t *id, char *why, size_t whylen);

#endif
