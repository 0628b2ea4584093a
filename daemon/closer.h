/* SPDX-License-Identifier: Apache-2.0 */
/* Closing the fds a client sent, each charged to a uid, in closer processes (closer.c). */
#ifndef DLPD_CLOSER_H
#define DLPD_CLOSER_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>
#include <uv.h>

#include "registry.h"

/* How long a closer stays without work before it is told to quit. */
#define DLPD_CLOSER_IDLE_MS 250
/* How long a stopping daemon waits for its closers to close what they were handed and quit. */
#define DLPD_CLOSER_LEAVE_MS 500
/* The uid of closes no client is charged with (fds queued to a connection that is gone). */
#define DLPD_UID_NOBODY ((uid_t)-1)
/* The environment variable in which an upgrading image names the fd (a memfd) of the list of
 * its pending closes ("fd:uid" lines). */
#define DLPD_CLOSING_ENV "DLPD_CLOSING_FDS"
/* The name an upgrading image gives, in LISTEN_FDNAMES, a pending close that sits among the
 * fds it passes (its number is kept, not moved). */
#define DLPD_FDNAME_CLOSING "closing"

/* Start serving closes from @p loop, charging them in @p reg. */
int dlpd_closers_init(uv_loop_t *loop, struct dlpd_registry *reg);
/* Close the closers' handles (at stop): what is handed later is still closed, unwatched. */
void dlpd_closers_stop(void);
/*
 * The last thing the daemon does: tell every closer to quit once its queue is closed, and
 * close every fd of the process except 0-2, those still handed to closers and the closers'
 * sockets. The closers share the daemon's fd table, so the daemon's exit alone would close
 * nothing while one of them lives.
 */
void dlpd_closers_leave(void);
/* Close @p fd, sent by a client of @p uid (DLPD_UID_NOBODY: no one), in that uid's closer,
 * charging the uid until it is closed. Never blocks the loop. */
void dlpd_close_uid(uid_t uid, int fd);
/* The same, charged to the uid dlpd_closer_charge() named last (dlpc__set_closer()'s). */
void dlpd_close_untrusted(int fd);
/* Charge the closes dlpd_close_untrusted() is given from now on to @p uid; returns the uid
 * charged until now. */
uid_t dlpd_closer_charge(uid_t uid);
/* fds handed to closers and not closed yet (all uids). */
size_t dlpd_closers_pending(void);
/* fds the daemon holds for closing: those pending and two sockets per closer. */
size_t dlpd_closers_fds(void);
/* Live closer processes. */
size_t dlpd_closers_count(void);

/* One pending close, for an upgrade (upgrade.c). */
struct dlpd_closing {
	int fd;
	uid_t uid;
};
/*
 * For an upgrade: every close still pending, in @p ret (free() it), each fd made to survive the
 * exec (close-on-exec cleared: an exec that closed it could block as the closer did), and
 * every closer told to quit once its queue is closed. Nothing more is handed to the closers
 * afterwards: later closes are left to the exec. 0 or -ENOMEM.
 */
int dlpd_closers_handover(struct dlpd_closing **ret, size_t *n);
/* An upgrade is about to execute: the event loop is not to be used from now on. */
void dlpd_closers_exec(void);
/* Tell every closer to quit once what it was handed is closed (an upgrade, before the exec). */
void dlpd_closers_quit_all(void);
/* For an upgrade, after the fds are in place: write the list of @p n pending closes to a memfd
 * the new image inherits, named in DLPD_CLOSING_ENV. 0 or negative errno. */
int dlpd_closers_export(const struct dlpd_closing *cl, size_t n);
/* Take the closes an upgrading image passed (DLPD_CLOSING_ENV); call it before anything opens
 * an fd. dlpd_closers_init() hands them to our closers. */
void dlpd_closers_adopt(void);

#endif
