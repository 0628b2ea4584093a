/* SPDX-License-Identifier: Apache-2.0 */
/* dlpackd internals shared across the daemon's files. */
#ifndef DLPD_DLPACKD_H
#define DLPD_DLPACKD_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <syslog.h>
#include <uv.h>

#include "io.h"
#include "msg.h"

/* ---- intrusive doubly linked list ---- */
struct dlpd_list {
	struct dlpd_list *prev, *next;
};

static inline void dlpd_list_init(struct dlpd_list *l)
{
	l->prev = l->next = l;
}

static inline bool dlpd_list_empty(const struct dlpd_list *l)
{
	return l->next == l;
}

static inline void dlpd_list_add_tail(struct dlpd_list *head, struct dlpd_list *n)
{
	n->prev = head->prev;
	n->next = head;
	head->prev->next = n;
	head->prev = n;
}

static inline void dlpd_list_del(struct dlpd_list *n)
{
	n->prev->next = n->next;
	n->next->prev = n->prev;
	dlpd_list_init(n);
}

#define dlpd_container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

/* ---- intrusive hash map: the caller hashes and compares, the map only chains ---- */
struct dlpd_hnode {
	struct dlpd_hnode *next;
	uint64_t hash;
};

struct dlpd_hmap {
	struct dlpd_hnode **buckets;
	size_t nbuckets; /* 0 or a power of two */
	size_t count;
};

void dlpd_hmap_init(struct dlpd_hmap *m);
/* Free the bucket array; the nodes belong to the caller. */
void dlpd_hmap_clear(struct dlpd_hmap *m);
/* Insert; 0 or -ENOMEM (then the map is unchanged). */
int dlpd_hmap_insert(struct dlpd_hmap *m, struct dlpd_hnode *n, uint64_t hash);
void dlpd_hmap_remove(struct dlpd_hmap *m, struct dlpd_hnode *n);
/* First node of the chain that may hold @p hash (compare n->hash, then the key). */
struct dlpd_hnode *dlpd_hmap_chain(const struct dlpd_hmap *m, uint64_t hash);
uint64_t dlpd_hash_bytes(const uint8_t *p, size_t len);
uint64_t dlpd_hash_u64(uint64_t x);

/* ---- logging ---- */
extern int dlpd_log_level;
void dlpd_log_init(void);
void dlpd_log(int prio, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Parse "err", "warning", "notice", "info", "debug" (or 3..7). -1 if unknown. */
int dlpd_log_parse_level(const char *s);

/* ---- configuration (config.c): flags and environment, one table ---- */
/* Mode of a socket the daemon binds itself. */
#define DLPD_DEFAULT_SOCKET_MODE 0660

struct dlpd_config {
	const char *socket_path; /* NULL: dlpc_default_socket() */
	unsigned socket_mode;	 /* these two apply only to a socket the daemon binds itself */
	gid_t socket_gid;	 /* (gid_t)-1: the daemon's own group */
};
extern struct dlpd_config dlpd_config;

/* Read the environment, then the command line. 0: run; 1: help or version printed, exit 0;
 * -1: a bad value, the message printed, exit 2. */
int dlpd_config_load(int argc, char **argv);
void dlpd_config_usage(FILE *f);
/* The long name of a socket option that was given (by flag or by its variable, @p env), or
 * NULL. */
const char *dlpd_config_bind_option_given(const char **env);

/* ---- systemd.c: socket activation and readiness notification, without libsystemd ---- */
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

/* ---- limits: defaults in limits.h, flags in config.c ---- */
struct dlpd_limits {
	uint64_t bytes_per_uid;
	uint64_t entries_per_uid;
	uint64_t connections_per_uid;
	uint64_t refs_per_connection;
	uint64_t pending_per_connection;
	uint64_t frame_timeout_ms;
	uint64_t queue_bytes;	    /* output queue of a connection that does not read */
	uint64_t queue_fds;	    /* fds in that queue */
	uint64_t watch_queue_bytes; /* output queue of a watcher */
};

/* The defaults of limits.h. */
void dlpd_limits_init(struct dlpd_limits *l);
/* The limits in force: the defaults, changed by flags and environment (config.c). */
extern struct dlpd_limits dlpd_limits;

/* What one uid holds: charged at publish and accept, released when freed. */
struct dlpd_usage {
	struct dlpd_hnode node; /* in registry.uids, hashed by uid */
	uid_t uid;
	uint64_t bytes;	      /* sizes of the storages it published that are still held */
	uint64_t storages;    /* those storages */
	uint64_t entries;     /* names it has published */
	uint64_t connections; /* its open connections */
};

/* ---- registry: names, entries, storages, references ---- */
struct dlpd_peer;

struct dlpd_storage {
	int fd; /* -1 for legacy CUDA IPC, whose memory stays with the publisher */
	struct dlpd_usage
		*usage;	  /* the publisher's, charged with @p charged until the storage is freed */
	uint64_t size;	  /* declared by the publisher (the allocation's, for legacy CUDA IPC) */
	uint64_t charged; /* bytes counted against the publisher's quota: size, or 0 for legacy
			   * CUDA IPC, which holds no memory of the daemon's or of the machine's */
	int32_t device_type, device_id;
	unsigned names;	      /* entries pointing at it */
	uint64_t attach_refs; /* live references held by connections */
	/* legacy CUDA IPC: the publishing connection, told (RECLAIM) when this is freed; NULL once
	 * it is gone */
	struct dlpd_peer *reclaim_peer;
	struct dlpd_list reclaim_link; /* in reclaim_peer->ipc_storages */
	uint64_t reclaim_token;
};

struct dlpd_entry {
	struct dlpd_hnode node;	   /* in registry.names, hashed by name */
	Dlpackd__V1__Publish *pub; /* the request that published it: name, flags, tensors */
	struct dlpd_storage *st;
	uint8_t *tensors_wire; /* the tensors as an AttachReply encodes them, made at publish */
	size_t tensors_wire_len;
	uint64_t generation;
	uid_t uid;
	struct dlpd_usage *usage; /* uid's, charged with one entry */
	pid_t pid;
	int64_t created_ns;
	struct dlpd_peer *owner;     /* publishing connection if ephemeral, else NULL */
	struct dlpd_list owner_link; /* in owner->ephemeral */
};

struct dlpd_ref {
	struct dlpd_hnode node; /* in peer->refs, hashed by id */
	uint64_t id;
	struct dlpd_storage *st;
};

/* The attaches waiting for one name, oldest first. */
struct dlpd_waitq {
	struct dlpd_hnode node; /* in registry.waitqs */
	struct dlpd_list waiters;
	size_t len;
	uint8_t name[];
};

struct dlpd_waiter {
	struct dlpd_list peer_link; /* in peer->waiters */
	struct dlpd_list q_link;    /* in q->waiters */
	struct dlpd_waitq *q;
	struct dlpd_peer *peer;
	uint32_t req_id;
	uint32_t flags;
	uint32_t owner_uid; /* with DLPC_ATTACH_OWNER in flags: only this uid's entry answers */
	int64_t timeout_ms;
	bool timed;
	uv_timer_t timer;
};

struct dlpd_registry {
	struct dlpd_hmap names;	 /* dlpd_entry by name */
	struct dlpd_hmap waitqs; /* dlpd_waitq by name */
	struct dlpd_hmap uids;	 /* dlpd_usage by uid */
	/* every entry sorted by name, for LIST; rebuilt on the first LIST after a change */
	struct dlpd_entry **sorted;
	size_t nsorted, sorted_cap;
	bool sorted_valid;
	uint64_t storages, bytes, refs, waiters;
	uint64_t storage_fds; /* storages that hold an fd (all but legacy CUDA IPC) */
};

/* ---- server and peers ---- */
struct dlpd_stats {
	uint64_t req[DLPC_MSG__REQUEST_COUNT];
	uint64_t fds_sent;
	uint64_t protocol_errors;
	uint64_t queue_drops; /* connections dropped for a full output queue */
};

struct dlpd_server {
	uv_loop_t *loop;
	int listen_fd;
	int lock_fd;
	char *path, *lock_path;
	bool owns_path; /* bound by us, not passed by systemd: unlink it at stop */
	uv_poll_t listen_poll;
	uv_timer_t accept_retry; /* resumes accepting after EMFILE */
	bool accept_paused;	 /* accept failed and has not succeeded since */
	uv_signal_t sig_term, sig_int;
	struct dlpd_list peers;
	uint64_t npeers, next_serial;
	uint64_t peers_closing; /* killed, socket not yet handed to the reaper */
	struct dlpd_registry reg;
	struct dlpc__scratch out;	/* outgoing frames are packed here */
	struct dlpd_list watchers;	/* peers that sent WATCH, in the order they did */
	struct dlpd_list reclaimers;	/* peers with RECLAIM notices to send (reclaim.c) */
	uv_timer_t reclaim_timer;	/* sends them on the next loop turn */
	uint64_t nwatchers, event_seq;	/* event_seq: changes of the name map so far */
	struct dlpc__scratch event_out; /* an event is packed here once for every watcher */
	struct dlpd_stats stats;
	struct dlpd_limits lim;
	uint64_t fd_budget; /* storages + connections allowed: RLIMIT_NOFILE - DLPC_FD_RESERVE */
	uint64_t start_ms;
	bool stopping;
};

struct dlpd_peer {
	struct dlpd_server *srv;
	uv_poll_t poll;
	int fd;
	uid_t uid;
	gid_t gid;
	pid_t pid;
	uint64_t serial;
	struct dlpd_usage *usage; /* its uid's, charged with this connection */
	int events;		  /* uv_poll events currently asked for */
	bool hello, dead;
	bool watching;		     /* sent WATCH: receives events, sends nothing but RELEASE */
	struct dlpd_list watch_link; /* in srv->watchers */
	size_t watch_prefix_len;
	uint8_t watch_prefix[DLPC_NAME_MAX];
	/* The frame deadline: armed when a read leaves part of a frame buffered (or at accept,
	 * for HELLO), never for frames that arrive whole. */
	uv_timer_t deadline;
	uint64_t frames_done;	/* complete frames read */
	uint64_t partial_frame; /* frames_done when the buffered partial frame began */
	uint64_t partial_since; /* loop time (ms) it began */
	unsigned handles_open;	/* poll and deadline, until their uv_close() callbacks */
	uint64_t nwaiters;	/* in waiters */
	struct dlpc__rx rx;
	struct dlpc__tx tx;
	struct dlpd_hmap refs; /* dlpd_ref by id */
	uint64_t next_ref;
	struct dlpd_list ephemeral;    /* entries this connection owns */
	struct dlpd_list ipc_storages; /* legacy CUDA IPC storages it published, still held */
	uint64_t *reclaims;	       /* their tokens, freed but not yet told (reclaim.c) */
	size_t nreclaims, reclaims_cap;
	struct dlpd_list reclaim_link; /* in srv->reclaimers while nreclaims > 0 */
	struct dlpd_list waiters;
	struct dlpd_list link; /* in srv->peers */
};

/* server.c */
/* Empty server state on @p loop under the limits @p lim, no socket yet (dlpd_server_start()
 * begins with it; the fuzz target uses it alone and adds peers over socketpairs).
 * dlpd_server_free() undoes it. */
void dlpd_server_init(struct dlpd_server *s, uv_loop_t *loop, const struct dlpd_limits *lim);
/* Serve on @p activated_fd, a listening socket systemd passed, or if it is -1 on a socket of
 * our own at @p path with the configured mode and group, under the limits @p lim. */
int dlpd_server_start(struct dlpd_server *s, uv_loop_t *loop, int activated_fd, const char *path,
		      const struct dlpd_limits *lim);
/* Stop accepting, close every connection and handle; uv_run() returns afterwards. */
void dlpd_server_stop(struct dlpd_server *s);
/* Free what the server still holds once the loop has finished. */
void dlpd_server_free(struct dlpd_server *s);

/* peer.c */
struct dlpd_peer *dlpd_peer_new(struct dlpd_server *s, int fd);
/* Mark @p p dead, drop what it holds, and free it after libuv has closed its handle. */
void dlpd_peer_kill(struct dlpd_peer *p, int prio, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
/* Send a reply frame; on a broken connection the peer is killed. */
int dlpd_reply(struct dlpd_peer *p, uint16_t type, uint32_t id, const ProtobufCMessage *m,
	       const int *fds, unsigned nfds);
/* The same, appending @p tail: fields of the same message, already encoded. */
int dlpd_reply_tail(struct dlpd_peer *p, uint16_t type, uint32_t id, const ProtobufCMessage *m,
		    const uint8_t *tail, size_t tail_len, const int *fds, unsigned nfds);
/*
 * Queue a whole frame for @p p. A connection whose output queue passes its limit
 * (DLPC_TX_QUEUE_MAX, DLPC_WATCH_QUEUE_MAX for a watcher, DLPC_TX_QUEUE_FDS_MAX) is dropped, as
 * is one whose socket failed. 0 or a negative errno (the peer was killed).
 */
int dlpd_peer_send(struct dlpd_peer *p, const uint8_t *frame, size_t len, const int *fds,
		   unsigned nfds);
/* Send an ERROR reply with a formatted message; @p err is an errno (either sign). */
int dlpd_reply_error(struct dlpd_peer *p, uint32_t id, int err, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
/* Short description of a peer for log lines: "client 7 (pid 123, uid 0)". */
const char *dlpd_peer_desc(const struct dlpd_peer *p, char *buf, size_t len);

/* registry.c */
void dlpd_registry_init(struct dlpd_registry *r);
void dlpd_registry_clear(struct dlpd_registry *r);
struct dlpd_entry *dlpd_entry_find(struct dlpd_registry *r, const uint8_t *name, size_t len);
/* Make @p e visible under its name, replacing @p old (NULL if none), tell the watchers and wake
 * its waiters. On failure (-ENOMEM) @p e is freed. */
int dlpd_entry_insert(struct dlpd_server *s, struct dlpd_entry *e, struct dlpd_entry *old);
/* Remove @p e from the names, tell the watchers (@p reason: a DLPC_WATCH_BY_*,
 * @p actor: the connection that caused it) and free it; its storage lives on while referenced. */
void dlpd_entry_remove(struct dlpd_server *s, struct dlpd_entry *e, int reason,
		       const struct dlpd_peer *actor);
/* A storage charged to @p u (size and one storage); NULL on ENOMEM. */
struct dlpd_storage *dlpd_storage_new(struct dlpd_registry *r, struct dlpd_usage *u, int fd,
				      uint64_t size, int32_t device_type, int32_t device_id);
/* Drop one holder (a name when @p name is true, else a reference); frees it when unreachable. */
void dlpd_storage_unref(struct dlpd_registry *r, struct dlpd_storage *st, bool name);
/* A reference for @p p on @p st; NULL on ENOMEM. */
struct dlpd_ref *dlpd_ref_new(struct dlpd_peer *p, struct dlpd_storage *st);
struct dlpd_ref *dlpd_ref_find(struct dlpd_peer *p, uint64_t id);
void dlpd_ref_drop(struct dlpd_peer *p, struct dlpd_ref *ref);
/* Queue @p w to be woken when @p name is published. */
int dlpd_waiter_add(struct dlpd_server *s, struct dlpd_waiter *w, const uint8_t *name, size_t len);
/* The oldest waiter for @p name that an entry published by @p uid answers, or NULL. */
struct dlpd_waiter *dlpd_waitq_first_match(struct dlpd_server *s, const uint8_t *name, size_t len,
					   uint32_t uid);
/* Unlink @p w and free it (after its timer closed, if it had one). */
void dlpd_waiter_free(struct dlpd_server *s, struct dlpd_waiter *w);
/* Drop everything @p p holds: waiters, ephemeral entries, references. */
void dlpd_registry_drop_peer(struct dlpd_server *s, struct dlpd_peer *p);
/*
 * Up to @p limit entries, sorted by name, whose names start with the prefix and come after
 * @p after. The array belongs to the registry and is valid until the next publish or unpublish.
 */
int dlpd_registry_range(struct dlpd_registry *r, const uint8_t *prefix, size_t plen,
			const uint8_t *after, size_t alen, size_t limit, struct dlpd_entry ***ret,
			size_t *count);

/* quota.c: per-uid usage and the checks against the limits. */
/* The usage of @p uid, created empty if it has none; NULL on ENOMEM. Free it with
 * dlpd_usage_put() if nothing gets charged to it. */
struct dlpd_usage *dlpd_usage_get(struct dlpd_registry *r, uid_t uid);
/* The usage of @p uid, or NULL if it holds nothing. */
struct dlpd_usage *dlpd_usage_find(const struct dlpd_registry *r, uid_t uid);
/* Free @p u if nothing is charged to it any more. */
void dlpd_usage_put(struct dlpd_registry *r, struct dlpd_usage *u);
/*
 * May @p p publish a storage charging @p size bytes (and one fd, if @p holds_fd), replacing
 * @p old (NULL if none)? 0, or -EDQUOT and in @p why the limit that refuses it and its value.
 */
int dlpd_quota_publish(const struct dlpd_peer *p, uint64_t size, bool holds_fd,
		       const struct dlpd_entry *old, char *why, size_t whylen);

/* storage.c: is @p fd acceptable as host storage? 0, or negative errno and the reason. */
int dlpd_storage_check(int fd, uint64_t size, bool writable, char *why, size_t whylen);
/* The same for a CUDA VMM export fd, which the daemon cannot look into: only that it is an open
 * file of a kind a driver could hand out (not a socket, pipe, directory or O_PATH). */
int dlpd_device_storage_check(int fd, char *why, size_t whylen);
/* reclaim.c: RECLAIM notices to legacy CUDA IPC publishers. */
/* Make @p p the publisher told when @p st is freed, with @p token. */
void dlpd_reclaim_watch(struct dlpd_peer *p, struct dlpd_storage *st, uint64_t token);
/* @p st is being freed: queue its notice for the next loop turn (never sent from here, where
 * a failed write could tear down a connection in the middle of a registry change). */
void dlpd_reclaim_storage_freed(struct dlpd_storage *st);
/* @p p is going away: forget its storages and its unsent notices. */
void dlpd_reclaim_drop_peer(struct dlpd_peer *p);
void dlpd_reclaim_init(struct dlpd_server *s);
void dlpd_reclaim_stop(struct dlpd_server *s);

/* handlers: one file per family. */
int dlpd_on_hello(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_stat(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_publish(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_unpublish(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m,
		      struct dlpc__frame *f);
int dlpd_on_list(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_attach(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_release(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_watch(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
/*
 * h_watch.c: tell every watcher whose prefix matches that @p e was published, replaced
 * (@p prev_gen: the generation it replaced) or removed. Called by the registry at the moment of
 * the change, so events leave in the order the changes were applied. A watcher that cannot take
 * the event is dropped; dropping one never changes the name map (a watcher owns no entries).
 */
void dlpd_watch_event(struct dlpd_server *s, int kind, const struct dlpd_entry *e,
		      uint64_t prev_gen, int reason, uid_t actor_uid, pid_t actor_pid);
/* A watcher is gone: take it off the list. */
void dlpd_watch_drop(struct dlpd_peer *p);
/* h_attach.c: answer the waiters of a name that was just published. */
void dlpd_wake_waiters(struct dlpd_server *s, struct dlpd_entry *e);

/* reaper.c: close fds on threads, off the event loop (see there why). */
int dlpd_reaper_start(void);
/* Close what is queued, then stop the threads. */
void dlpd_reaper_stop(void);
/* Close one of the daemon's own fds (a storage memfd, a client socket) off the loop. */
void dlpd_close_later(int fd);
/* Close an fd a client sent and the daemon did not keep, off the loop, on its own thread. */
void dlpd_close_untrusted(int fd);
/* fds handed to the reaper and not closed yet. */
size_t dlpd_reaper_pending(void);

/* Monotonic milliseconds. */
uint64_t dlpd_now_ms(void);

#endif
