/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A connection's transport (peer.c): queueing frames, writing them, the socket events asked
 * for, and marking a connection that must end. Nothing here destroys a connection: that is
 * dispatch.c's.
 */
#ifndef DLPD_PEER_H
#define DLPD_PEER_H

#include "state.h"

/*
 * Mark @p p: log why (the first reason only), stop reading, and queue it to be destroyed once
 * the caller has returned to the event loop.
 * Frames already queued (an ERROR saying why) are still flushed then, within
 * DLPC_ERROR_LINGER_MS, unless the connection is broken. Safe to call from anywhere, any
 * number of times.
 */
void dlpd_peer_fail(struct dlpd_peer *p, int prio, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/*
 * Queue a whole frame for @p p. A connection whose output queue passes its limit
 * (DLPC_TX_QUEUE_MAX, DLPC_WATCH_QUEUE_MAX for a watcher, DLPC_TX_QUEUE_FDS_MAX) is marked
 * broken, as is one whose socket failed. 0, or a negative errno: nothing was queued (-EPIPE for
 * a marked connection).
 */
int dlpd_peer_send(struct dlpd_peer *p, const uint8_t *frame, size_t len, const int *fds,
		   unsigned nfds);
/* Send a reply frame (see dlpd_peer_send()). */
int dlpd_reply(struct dlpd_peer *p, uint16_t type, uint32_t id, const ProtobufCMessage *m,
	       const int *fds, unsigned nfds);
/* The same, appending @p tail: fields of the same message, already encoded. */
int dlpd_reply_tail(struct dlpd_peer *p, uint16_t type, uint32_t id, const ProtobufCMessage *m,
		    const uint8_t *tail, size_t tail_len, const int *fds, unsigned nfds);
/* Send an ERROR reply with a formatted message; @p err is an errno (either sign). */
int dlpd_reply_error(struct dlpd_peer *p, uint32_t id, int err, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
/* Write what waits in @p p's queue. 1: the queue is empty; 0: more waits; negative errno: the
 * socket failed (@p p is marked broken). */
int dlpd_peer_flush(struct dlpd_peer *p);
/* Ask for the socket events @p p's state calls for: writable while frames wait to be sent,
 * else readable while it is served, else none. */
void dlpd_peer_update_events(struct dlpd_peer *p);
/* Set up @p p's count of fds in flight to it (peer.c), before its first event. */
void dlpd_peer_unread_init(struct dlpd_peer *p);
/* @p p is being destroyed (its usage still set): if fds are in flight to it, its socket is to
 * be kept, charged to its uid, until they are taken (dlpd_peer_drain_start()); else they are
 * no longer counted. */
void dlpd_peer_drain_keep(struct dlpd_peer *p);
/* @p p's handles are closed: keep its (shut) socket as dlpd_peer_drain_keep() decided. */
void dlpd_peer_drain_start(struct dlpd_peer *p);
void dlpd_peer_drains_init(struct dlpd_server *s);
/* The daemon stops: the kept sockets go to their closers. */
void dlpd_peer_drains_stop(struct dlpd_server *s);
/* An upgrade: the kept sockets go to their closers, kept open across the exec (upgrade.c). */
void dlpd_peer_drains_hand(struct dlpd_server *s);
/* Short description of a peer for log lines: "client 7 (pid 123, uid 0)". */
const char *dlpd_peer_desc(const struct dlpd_peer *p, char *buf, size_t len);

#endif
