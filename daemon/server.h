/* SPDX-License-Identifier: Apache-2.0 */
/* The listening socket: taking it over, accepting, stopping (server.c). */
#ifndef DLPD_SERVER_H
#define DLPD_SERVER_H

#include "state.h"
#include "systemd.h"

/* Empty server state on @p loop under the limits @p lim, no socket yet (dlpd_server_start()
 * begins with it; the fuzz target and the dispatch tests use it alone and add peers over
 * socketpairs). dlpd_server_stop() and dlpd_server_free() undo it. */
void dlpd_server_init(struct dlpd_server *s, uv_loop_t *loop, const struct dlpd_limits *lim);
/* How dlpd_server_start() gets its socket and what it restores. */
struct dlpd_start {
	int listen_fd;	  /* a listening socket passed to us, or -1 to bind @p path */
	int lock_fd;	  /* with listen_fd: the lock on its path, passed by an upgrading image
			   * (we own the path then), or -1 */
	const char *path; /* with listen_fd -1: the socket to bind, with the configured mode and
			   * group */
	struct dlpd_passed_fd *restore; /* storages and state journals to take entries back from */
	size_t nrestore;
};

/* Serve as @p how says under the limits @p lim. The fds in @p how become the server's, even on
 * failure. */
int dlpd_server_start(struct dlpd_server *s, uv_loop_t *loop, const struct dlpd_start *how,
		      const struct dlpd_limits *lim);
/* Stop accepting, close every connection and handle; uv_run() returns afterwards. */
void dlpd_server_stop(struct dlpd_server *s);
/* Free what the server still holds once the loop has finished. */
void dlpd_server_free(struct dlpd_server *s);

#endif
