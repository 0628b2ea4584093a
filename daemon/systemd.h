/* SPDX-License-Identifier: Apache-2.0 */
/* Socket activation and readiness notification, without libsystemd (systemd.c). */
#ifndef DLPD_SYSTEMD_H
#define DLPD_SYSTEMD_H

#include <stddef.h>

/*
 * The listening socket passed by socket activation (LISTEN_PID/LISTEN_FDS), checked to be one
 * listening AF_UNIX stream socket. -ENOENT: not activated. Other negative errno: activated
 * wrongly, the reason in @p why. The variables are unset in every case.
 */
int dlpd_listen_fd(char *why, size_t len);
/* Take the address from NOTIFY_SOCKET ("/path" or "@abstract") and unset it. */
int dlpd_notify_init(void);
/* Send one notification ("READY=1", "STATUS=...") if a service manager asked for them. */
void dlpd_notify(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
