/* SPDX-License-Identifier: Apache-2.0 */
/* The daemon's settings (config.c): flags and environment, one table; the limits in force. */
#ifndef DLPD_CONFIG_H
#define DLPD_CONFIG_H

#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

/* Mode of a socket the daemon binds itself. */
#define DLPD_DEFAULT_SOCKET_MODE 0660

struct dlpd_config {
	const char *socket_path; /* NULL: dlpc_default_socket() */
	unsigned socket_mode;	 /* these two apply only to a socket the daemon binds itself */
	gid_t socket_gid;	 /* (gid_t)-1: the daemon's own group */
	uint64_t fd_store;	 /* fds the service manager keeps for us; 0: no fd store */
};
extern struct dlpd_config dlpd_config;

/* Read the environment, then the command line. 0: run; 1: help or version printed, exit 0;
 * -1: a bad value, the message printed, exit 2. */
int dlpd_config_load(int argc, char **argv);
void dlpd_config_usage(FILE *f);
/* The long name of a socket option that was given (by flag or by its variable, @p env), or
 * NULL. */
const char *dlpd_config_bind_option_given(const char **env);

/* The resource limits; defaults in limits.h, each settable by a flag (config.c). */
struct dlpd_limits {
	uint64_t bytes_per_uid;
	uint64_t entries_per_uid;
	uint64_t memory_per_uid; /* the daemon's memory its records take (limits.h) */
	uint64_t connections_per_uid;
	uint64_t fd_share_per_uid; /* percent of the fd budget */
	uint64_t channels_per_uid;
	uint64_t refs_per_connection;
	uint64_t pending_per_connection;
	uint64_t pending_bytes_per_uid; /* unfinished frames and waiting requests (mem.c) */
	uint64_t frame_timeout_ms;
	uint64_t queue_bytes;	    /* output queue of a connection that does not read */
	uint64_t queue_fds;	    /* fds in that queue */
	uint64_t watch_queue_bytes; /* output queue of a watcher */
};

/* The limits in force: the defaults of limits.h, changed by flags and environment. */
extern struct dlpd_limits dlpd_limits;

#endif
