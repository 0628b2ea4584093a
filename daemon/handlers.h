/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Request handlers, one file per family (h_*.c), called by dispatch.c once a frame passed the
 * checks of its row in DLPC_REQUESTS. A handler answers the request itself; it returns -EPROTO
 * for a protocol violation (having sent the ERROR that says so), and dispatch.c then marks the
 * connection.
 */
#ifndef DLPD_HANDLERS_H
#define DLPD_HANDLERS_H

#include <errno.h>
#include <stdlib.h>

#include "state.h"

#define DLPD_X_HANDLER(NAME, name, ...)                                                            \
	int dlpd_on_##name(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m,                 \
			   struct dlpc__frame *f);
DLPC_REQUESTS(DLPD_X_HANDLER)
#undef DLPD_X_HANDLER

/* The most items a LIST reply holds, for a request that asked for @p limit (0: no limit). */
static inline size_t dlpd_list_limit(uint32_t limit)
{
	return limit == 0 || limit > DLPC_LIST_PAGE_MAX ? DLPC_LIST_PAGE_MAX : limit;
}

/* Room for the @p n items of a LIST reply: *@p infos, @p n of @p size bytes each, and
 * *@p ptrs, @p n pointers to them (both NULL for none; the caller frees them). 0 or -ENOMEM,
 * with neither allocated. */
static inline int dlpd_list_room(size_t n, size_t size, void **infos, void **ptrs)
{
	*infos = NULL;
	*ptrs = NULL;
	if (n == 0)
		return 0;
	*infos = calloc(n, size);
	*ptrs = calloc(n, sizeof(void *));
	if (*infos && *ptrs)
		return 0;
	free(*infos);
	free(*ptrs);
	*infos = *ptrs = NULL;
	return -ENOMEM;
}

/* h_watch.c: a watcher is being destroyed: take it off the list. */
void dlpd_watch_drop(struct dlpd_peer *p);

#endif
