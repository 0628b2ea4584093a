/* SPDX-License-Identifier: Apache-2.0 */
/* The listening socket: taking it over, accepting, stopping (server.c). */
#ifndef DLPD_SERVER_H
#define DLPD_SERVER_H

#include "state.h"

/* Empty server state on @p loop under the limits @p lim, no socket yet (dlpd_server_start()
 * begins with it; the fuzz target and the dispatch tests use it alone and add peers over
 * socketpairs). dlpd_server_stop() and dlpd_server_free() undo it. */
void dlpd_server_init(struct dlpd_server *s, uv_loop_t *loop, const struct dlpd_limits *lim);
/* Serve on @p activated_fd, a listening socket systemd passed, or if it is -1 on a socket of
 * our own at @p path with the configured mode and group, under the limits @p lim. */
int dlpd_server_start(struct dlpd_server *s, uv_loop_t *loop, int activated_fd, const char *path,
		      const struct dlpd_limits *lim);
/* Stop accepting, close every connection and handle; uv_run() returns afterwards. */
void dlpd_server_stop(struct dlpd_server *s);
/* Free what the server still holds once the loop has finished. */
void dlpd_server_free(struct dlpd_server *s);

#endif
