/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Request handlers, one file per family (h_*.c), called by dispatch.c once a frame passed the
 * checks of its row in DLPC_REQUESTS. A handler answers the request itself; it returns -EPROTO
 * for a protocol violation (having sent the ERROR that says so), and dispatch.c then marks the
 * connection.
 */
#ifndef DLPD_HANDLERS_H
#define DLPD_HANDLERS_H

#include "state.h"

#define DLPD_X_HANDLER(NAME, name, ...)                                                            \
	int dlpd_on_##name(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m,                 \
			   struct dlpc__frame *f);
DLPC_REQUESTS(DLPD_X_HANDLER)
#undef DLPD_X_HANDLER

/* h_watch.c: a watcher is being destroyed: take it off the list. */
void dlpd_watch_drop(struct dlpd_peer *p);

#endif
