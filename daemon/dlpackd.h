/* SPDX-License-Identifier: Apache-2.0 */
/* dlpackd internals shared across the daemon's files. */
#ifndef DLPD_DLPACKD_H
#define DLPD_DLPACKD_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
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

/* ---- registry: names, entries, storages, references ---- */
struct dlpd_peer;

struct dlpd_storage {
	int fd;
	uint64_t size;
	int32_t device_type, device_id;
	unsigned names;	      /* entries pointing at it */
	uint64_t attach_refs; /* live references held by connections */
};

struct dlpd_entry {
	struct dlpd_hnode node;	   /* in registry.names, hashed by name */
	Dlpackd__V1__Publish *pub; /* the request that published it: name, flags, tensors */
	struct dlpd_storage *st;
	uint8_t *tensors_wire; /* the tensors as an AttachReply encodes them, made at publish */
	size_t tensors_wire_len;
	uint64_t generation;
	uid_t uid;
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
	int64_t timeout_ms;
	bool timed;
	uv_timer_t timer;
};

struct dlpd_registry {
	struct dlpd_hmap names;	 /* dlpd_entry by name */
	struct dlpd_hmap waitqs; /* dlpd_waitq by name */
	/* every entry sorted by name, for LIST; rebuilt on the first LIST after a change */
	struct dlpd_entry **sorted;
	size_t nsorted, sorted_cap;
	bool sorted_valid;
	uint64_t storages, bytes, refs, waiters;
};

/* ---- server and peers ---- */
struct dlpd_stats {
	uint64_t req[DLPC_MSG__REQUEST_COUNT];
	uint64_t fds_sent;
	uint64_t protocol_errors;
};

struct dlpd_server {
	uv_loop_t *loop;
	int listen_fd;
	int lock_fd;
	char *path, *lock_path;
	uv_poll_t listen_poll;
	uv_timer_t accept_retry; /* resumes accepting after EMFILE */
	uv_signal_t sig_term, sig_int;
	struct dlpd_list peers;
	uint64_t npeers, next_serial;
	uint64_t peers_closing; /* killed, socket not yet handed to the reaper */
	struct dlpd_registry reg;
	struct dlpc__scratch out; /* outgoing frames are packed here */
	struct dlpd_stats stats;
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
	int events; /* uv_poll events currently asked for */
	bool hello, dead;
	struct dlpc__rx rx;
	struct dlpc__tx tx;
	struct dlpd_hmap refs; /* dlpd_ref by id */
	uint64_t next_ref;
	struct dlpd_list ephemeral; /* entries this connection owns */
	struct dlpd_list waiters;
	struct dlpd_list link; /* in srv->peers */
};

/* server.c */
/* Empty server state on @p loop, no socket yet (dlpd_server_start() begins with it; the fuzz
 * target uses it alone and adds peers over socketpairs). dlpd_server_free() undoes it. */
void dlpd_server_init(struct dlpd_server *s, uv_loop_t *loop);
int dlpd_server_start(struct dlpd_server *s, uv_loop_t *loop, const char *path, mode_t mode);
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
/* Send an ERROR reply with a formatted message; @p err is an errno (either sign). */
int dlpd_reply_error(struct dlpd_peer *p, uint32_t id, int err, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
/* Short description of a peer for log lines: "client 7 (pid 123, uid 0)". */
const char *dlpd_peer_desc(const struct dlpd_peer *p, char *buf, size_t len);

/* registry.c */
void dlpd_registry_init(struct dlpd_registry *r);
void dlpd_registry_clear(struct dlpd_registry *r);
struct dlpd_entry *dlpd_entry_find(struct dlpd_registry *r, const uint8_t *name, size_t len);
/* Make @p e visible under its name, replacing @p old (NULL if none), and wake its waiters.
 * On failure (-ENOMEM) @p e is freed. */
int dlpd_entry_insert(struct dlpd_server *s, struct dlpd_entry *e, struct dlpd_entry *old);
/* Remove @p e from the names and free it; its storage lives on while referenced. */
void dlpd_entry_remove(struct dlpd_server *s, struct dlpd_entry *e);
struct dlpd_storage *dlpd_storage_new(struct dlpd_registry *r, int fd, uint64_t size,
				      int32_t device_type, int32_t device_id);
/* Drop one holder (a name when @p name is true, else a reference); frees it when unreachable. */
void dlpd_storage_unref(struct dlpd_registry *r, struct dlpd_storage *st, bool name);
/* A reference for @p p on @p st; NULL on ENOMEM. */
struct dlpd_ref *dlpd_ref_new(struct dlpd_peer *p, struct dlpd_storage *st);
struct dlpd_ref *dlpd_ref_find(struct dlpd_peer *p, uint64_t id);
void dlpd_ref_drop(struct dlpd_peer *p, struct dlpd_ref *ref);
/* Queue @p w to be woken when @p name is published. */
int dlpd_waiter_add(struct dlpd_server *s, struct dlpd_waiter *w, const uint8_t *name, size_t len);
/* The oldest waiter for @p name, or NULL. */
struct dlpd_waiter *dlpd_waitq_first(struct dlpd_server *s, const uint8_t *name, size_t len);
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

/* storage.c: is @p fd acceptable as host storage? 0, or negative errno and the reason. */
int dlpd_storage_check(int fd, uint64_t size, bool writable, char *why, size_t whylen);

/* handlers: one file per family. */
int dlpd_on_hello(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_stat(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_publish(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_unpublish(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m,
		      struct dlpc__frame *f);
int dlpd_on_list(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_attach(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
int dlpd_on_release(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f);
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
