/* SPDX-License-Identifier: Apache-2.0 */
/* Socket activation and readiness notification, without libsystemd (systemd.c). */
#ifndef DLPD_SYSTEMD_H
#define DLPD_SYSTEMD_H

#include <stdbool.h>
#include <stddef.h>
#include <uv.h>

/* The most fds LISTEN_FDS may pass: the daemon's whole fd limit would be reached first. */
#define DLPD_PASSED_FDS_MAX (1 << 20)
/* The longest fd name systemd accepts (FDNAME=). */
#define DLPD_FDNAME_MAX 255
/* How long an upgrade or a stop waits for the service manager to take the notifications that
 * found its queue full. */
#define DLPD_NOTIFY_WAIT_MS 2000
/* The most notifications (each with up to DLPD_NOTIFY_FDS_MAX fds) waiting for room in the
 * service manager's queue; one more fails (-ENOBUFS). */
#define DLPD_NOTIFY_QUEUE_MAX 1024
/* How often the loop offers the waiting notifications to the service manager again. */
#define DLPD_NOTIFY_RETRY_MS 20
/* The most fds one notification carries. */
#define DLPD_NOTIFY_FDS_MAX 4

struct dlpd_passed_fd {
	int fd;
	char name[DLPD_FDNAME_MAX + 1]; /* from LISTEN_FDNAMES; "unknown" where none was given */
};

/*
 * The fds passed to us (LISTEN_PID, LISTEN_FDS, LISTEN_FDNAMES): by socket activation, from
 * the fd store, or by an image of ours that re-executed (upgrade.c). Each is made
 * close-on-exec; the array (free() it) in @p ret. -ENOENT: none passed. Other negative errno:
 * passed wrongly, the reason in @p why. The variables are unset in every case.
 */
int dlpd_passed_fds(struct dlpd_passed_fd **ret, size_t *count, char *why, size_t len);
/* Is @p fd a listening AF_UNIX stream socket? Made non-blocking if so. 0, or negative errno
 * and the reason in @p why. */
int dlpd_listen_check(int fd, char *why, size_t len);
/* Take the address from NOTIFY_SOCKET ("/path" or "@abstract") and unset it. */
int dlpd_notify_init(void);
/* NOTIFY_SOCKET as it was given, or NULL if none was. */
const char *dlpd_notify_socket(void);
/* Send one notification ("READY=1", "STATUS=...") if a service manager asked for them. */
void dlpd_notify(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Send one notification carrying @p nfds fds (FDSTORE=1) without waiting: if the manager's
 * queue is full, or notifications wait already, it waits behind them (with copies of the fds)
 * and goes in order. 0 (sent or waiting), -ENOTCONN without a service manager, -ENOBUFS with
 * DLPD_NOTIFY_QUEUE_MAX waiting, or the negative errno of the send. */
int dlpd_notify_fds(const int *fds, size_t nfds, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* The same, sent now or not at all: -EAGAIN if it would have to wait. */
int dlpd_notify_fds_now(const int *fds, size_t nfds, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* Send what waits, for up to @p wait_ms (0: what goes at once); how many still wait. */
size_t dlpd_notify_flush(int wait_ms);
/* Wait up to DLPD_NOTIFY_WAIT_MS for what waits to go, unless an earlier wait ran out and the
 * manager has not caught up since (then only what goes at once); how many still wait. */
size_t dlpd_notify_settle(void);
/* Take back the notification formatted as @p fmt if it still waits for room (never sent): true
 * if one did (its fds closed), false if there is none (sent, or never made). */
bool dlpd_notify_unqueue(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* How many notifications wait for room. */
size_t dlpd_notify_queued(void);
/* The copies of fds those notifications hold: the daemon's, counted in its fd budget. */
size_t dlpd_notify_queued_fds(void);
/* Offer what waits to the manager from @p loop's timer from now on. */
void dlpd_notify_start(uv_loop_t *loop);
/* At stop: wait up to DLPD_NOTIFY_WAIT_MS for what waits, drop the rest (logged), and close
 * the timer. */
void dlpd_notify_stop(void);

#endif
