/* SPDX-License-Identifier: Apache-2.0 */
/* An upgrade in place: executing the daemon's binary again with its state (upgrade.c). */
#ifndef DLPD_UPGRADE_H
#define DLPD_UPGRADE_H

#include "state.h"

/* Remember the binary's path and the command line, to execute them again later. */
void dlpd_upgrade_init(struct dlpd_server *s, char **argv);
/* Execute the binary again, handing over the listening socket, the storages and their state.
 * Returns only if it could not start (the reason logged); the daemon then goes on. */
void dlpd_upgrade(struct dlpd_server *s);

#endif
