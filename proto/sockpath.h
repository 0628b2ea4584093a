/* SPDX-License-Identifier: Apache-2.0 */
/* Where dlpackd listens: the rules shared by the daemon (where to bind) and the library (where to
 * connect). */
#ifndef DLPC_PROTO_SOCKPATH_H
#define DLPC_PROTO_SOCKPATH_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/un.h>

/* The most places dlpc_connect(NULL) tries: the per-user socket, then the system socket. */
#define DLPC__SOCKPATHS_MAX 2

/* A place a client looks for dlpackd, and the rule that named it (for messages). */
struct dlpc__sockpath {
	/* "$DLPACKD_SOCKET", "$XDG_RUNTIME_DIR/dlpackd.sock" or "the system socket" */
	const char *rule;
	bool env; /* named by $DLPACKD_SOCKET: the only place tried */
	char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
};

/*
 * The places a client without a socket of its own tries, in order: $DLPACKD_SOCKET alone when it
 * is set (and not empty); else $XDG_RUNTIME_DIR/dlpackd.sock when XDG_RUNTIME_DIR is set, then
 * DLPC_SYSTEM_SOCKET. Fills @p out and returns how many (1 or 2), or -ENAMETOOLONG for a
 * $DLPACKD_SOCKET too long for a socket address (a per-user path too long is left out).
 */
int dlpc__socket_candidates(struct dlpc__sockpath out[DLPC__SOCKPATHS_MAX]);

/*
 * Where a daemon started without a socket listens: $DLPACKD_SOCKET, else DLPC_SYSTEM_SOCKET for
 * root, else $XDG_RUNTIME_DIR/dlpackd.sock. The length, -ENOENT for a user other than root
 * without XDG_RUNTIME_DIR, or -ENAMETOOLONG.
 */
int dlpc__listen_socket(char *buf, size_t len);

#endif
