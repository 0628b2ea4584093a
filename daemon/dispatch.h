/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A connection's life (dispatch.c): reading its requests and running them through the table,
 * and destroying it once it was marked. The only place a connection is created or destroyed.
 */
#ifndef DLPD_DISPATCH_H
#define DLPD_DISPATCH_H

#include "state.h"

void dlpd_dispatch_init(struct dlpd_server *s);
/* A connection on the accepted socket @p fd, reading; NULL on failure (@p fd is the caller's). */
struct dlpd_peer *dlpd_peer_new(struct dlpd_server *s, int fd);
/* At stop: mark every connection and destroy them all now, flushing nothing. */
void dlpd_dispatch_stop(struct dlpd_server *s);

#endif
