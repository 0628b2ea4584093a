/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The registry (registry.c): names, entries, storages, references, waiting attaches and what
 * each uid holds. Pure data: its functions change these structures and their counters and
 * call nothing else of the daemon's. Telling anyone about a change (watchers, waiters, a
 * publisher awaiting RECLAIM) and closing a freed storage's fd is names.c's job.
 */
#ifndef DLPD_REGISTRY_H
#define DLPD_REGISTRY_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "base.h"
#include "dlpackd.pb-c.h"

/*
 * What one uid holds: charged at publish and accept, released when freed. A storage is charged
 * to its publisher while a name reaches it; once none does and references still keep it alive,
 * it is charged to the uids that hold those references instead (pinned_*), each in full.
 */
struct dlpd_usage {
	struct dlpd_hnode node; /* in registry.uids, hashed by uid */
	uid_t uid;
	uint64_t bytes;	       /* sizes of the storages it published that a name reaches */
	uint64_t storage_fds;  /* those of them that hold an fd (all but legacy CUDA IPC) */
	uint64_t pinned_bytes; /* sizes of the storages no name reaches that it keeps alive */
	uint64_t pinned_fds;   /* those of them that hold an fd */
	uint64_t storages;     /* storages it published and the daemon still holds */
	uint64_t entries;      /* names it has published */
	uint64_t connections;  /* its open connections */
	uint64_t channels;     /* channels it opened (counted as entries too) */
	uint64_t channel_fds;  /* the socket pairs of the direct ones among them (two each) */
	uint64_t memory;       /* the daemon's memory its records take (DLPD_*_COST) */
	/* bytes of the daemon's memory its unfinished frames and waiting requests hold (mem.c) */
	uint64_t pending_bytes;
	uint64_t closing; /* fds of its handed to a closer and not closed yet (closer.c) */
	uint64_t stored;  /* its storages in the service manager's fd store (persist.c) */
	/* copies of fds in replies queued for its connections, which did not read them (mem.c) */
	uint64_t tx_fds;
	/* fds its connections sent for frames not yet complete, received and held (mem.c) */
	uint64_t rx_fds;
	/* fds in flight to its connections that they may not have taken yet (those of its closed
	 * connections too, whose sockets are kept meanwhile: draining), and when they were last
	 * all looked at (loop ms): a share of them at most (peer.c) */
	uint64_t unread_fds, unread_looked, draining;
	/* its closed connections' sockets kept open a moment for their last ERROR (dispatch.c),
	 * what is queued in them still charged as its pending bytes */
	uint64_t lingering;
	bool store_warned; /* told once that it holds its share of the store */
};

/*
 * What the daemon's records cost, as charged to a uid's memory (--max-memory-per-uid):
 * estimates of what it allocates, malloc's overhead and the hash maps' slots included, measured
 * with bench/neighbours.py (88 bytes a reference, 184 a channel, 1108 a connection, 728 an entry
 * of one small tensor, 2.6 KiB of 10 and 112 KiB of 500 with 26-byte keys).
 */
#define DLPD_REF_COST 96
#define DLPD_CHANNEL_COST 192
/* A connection: its state, libuv's handles, the kernel's socket buffers not included; its
 * receive buffer, while it holds part of a frame, counts as unfinished work (mem.c). */
#define DLPD_CONNECTION_COST 1280
/* The least --max-memory-per-uid may be: a connection and the receive buffer of its HELLO
 * (mem.c), or no connection of any uid could ever say HELLO. */
#define DLPD_MEMORY_PER_UID_MIN (DLPD_CONNECTION_COST + DLPC_RX_BUF_SIZE)
#define DLPD_RECORD_COST 512
/* What each tensor of an entry or message adds to its request's bytes once unpacked. */
#define DLPD_TENSOR_COST 160
/* What an entry or a queued message published by a request of @p wire_len bytes with
 * @p ntensors tensors is charged: the request twice (unpacked, and its tensors encoded as attach
 * replies carry them), and each tensor's unpacked structures. */
static inline uint64_t dlpd_record_cost(size_t wire_len, size_t ntensors)
{
	return DLPD_RECORD_COST + 2 * (uint64_t)wire_len + DLPD_TENSOR_COST * (uint64_t)ntensors;
}

/* The daemon's fds charged to @p u's share (--max-fd-share-per-uid): the storages it published
 * or keeps alive, its connections, its direct channels' socket pairs, the fds it sent that a
 * closer has not closed yet, those it sent with frames not yet complete and the copies of fds
 * in replies its connections have not read. */
static inline uint64_t dlpd_uid_fds(const struct dlpd_usage *u)
{
	return u->storage_fds + u->pinned_fds + u->connections + u->channel_fds + u->closing +
	       u->tx_fds + u->rx_fds + u->draining + u->lingering;
}

/* The references one uid holds on one storage. */
struct dlpd_pin {
	struct dlpd_usage *usage;
	uint64_t refs;
};

struct dlpd_storage {
	int fd; /* -1 for legacy CUDA IPC, whose memory stays with the publisher */
	struct dlpd_usage
		*usage;	  /* the publisher's, charged with @p charged until the storage is freed */
	uint64_t size;	  /* declared by the publisher (the allocation's, for legacy CUDA IPC) */
	uint64_t charged; /* bytes counted against the publisher's quota: size, or 0 for legacy
			   * CUDA IPC, which holds no memory of the daemon's or of the machine's */
	int32_t device_type, device_id;
	unsigned names;	       /* entries pointing at it */
	uint64_t attach_refs;  /* live references held by connections */
	struct dlpd_pin *pins; /* who holds those references, one per uid */
	unsigned npins, pins_cap;
	bool unnamed; /* no name reaches it any more: charged to the pins' uids, not usage's */
	struct dlpd_list refs; /* every dlpd_ref on it (ref->st_link), for invalidations */
	uint64_t cached_refs;  /* of attach_refs, those a client marked idle in its cache */
	/* legacy CUDA IPC: what the publishing connection holds, told (RECLAIM, reclaim.c) when
	 * this is freed; NULL once it is gone */
	struct dlpd_holdings *reclaim_holder;
	struct dlpd_list reclaim_link; /* in reclaim_holder->lent */
	uint64_t reclaim_token;
	/* persist.c: the number that names it across restarts (0: it cannot outlive the daemon:
	 * ephemeral, or legacy CUDA IPC), and whether the service manager keeps its fd */
	uint64_t sid;
	bool stored;
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
	struct dlpd_holdings *owner; /* the publishing connection's if ephemeral, else NULL */
	struct dlpd_list owner_link; /* in owner->ephemeral */
	uint64_t journaled;	     /* persist.c: bytes of its record in the journal, 0 if none */
	uint64_t memory;	     /* charged to usage's memory while linked */
};

struct dlpd_ref {
	struct dlpd_hnode node; /* in holdings.refs, hashed by id */
	uint64_t id;
	struct dlpd_storage *st;
	struct dlpd_holdings *holder; /* the holdings it is in */
	struct dlpd_list st_link;     /* in st->refs */
	bool cacheable;		      /* DLPC_WIRE_ATTACH_CACHEABLE: told of invalidations */
	bool cached;		      /* marked idle in the client's cache (RELEASE cached_ids) */
};

/* The attaches waiting for one name, oldest first. */
struct dlpd_waitq {
	struct dlpd_hnode node; /* in registry.waitqs */
	struct dlpd_list waiters;
	size_t len;
	uint8_t name[];
};

/* An attach waiting in a queue. The connection's side of it (who to answer, its timer) is
 * the handlers' (struct dlpd_attach_wait, names.h), which holds one of these. */
struct dlpd_waiter {
	struct dlpd_list peer_link; /* in holdings.waiters */
	struct dlpd_list q_link;    /* in q->waiters */
	struct dlpd_waitq *q;
	uint32_t req_id;
	uint32_t flags;
	uint32_t owner_uid; /* with DLPC_WIRE_ATTACH_OWNER: only this uid's entry answers */
	int64_t timeout_ms; /* > 0: it ends then */
};

/* What one connection holds in the registry: dropped when it goes. */
struct dlpd_holdings {
	struct dlpd_usage *usage; /* its uid's: charged with what its references pin */
	struct dlpd_hmap refs;	  /* dlpd_ref by id */
	uint64_t next_ref;
	struct dlpd_list ephemeral; /* entries it owns */
	struct dlpd_list waiters;
	uint64_t nwaiters;
	struct dlpd_list chan_waits; /* its SENDs and RECVs waiting on channels (handoff.h) */
	uint64_t nchan_waits;
	struct dlpd_list producing; /* dlpd_producer: channels it produces to (handoff.h) */
	uint64_t nproducing;
	/* legacy IPC or lent VMM storages it published, held (st->reclaim_link, reclaim.c) */
	struct dlpd_list lent;
};

struct dlpd_registry {
	struct dlpd_hmap names;	 /* dlpd_entry by name */
	struct dlpd_hmap waitqs; /* dlpd_waitq by name */
	struct dlpd_hmap uids;	 /* dlpd_usage by uid */
	/* every entry sorted by name, for LIST: rebuilt by the first LIST that finds it not valid,
	 * then kept in order through each publish and removal (sorted_mods of them since the last
	 * LIST), up to DLPD_SORTED_KEPT_MAX, past which it is let go until the next LIST */
	struct dlpd_entry **sorted;
	size_t nsorted, sorted_cap, sorted_mods;
	bool sorted_valid;
	uint64_t storages, bytes, refs, waiters;
	uint64_t storage_fds;	   /* storages that hold an fd (all but legacy CUDA IPC) */
	struct dlpd_hmap channels; /* dlpd_channel by name (channel.h) */
	uint64_t messages;	   /* queued in channels, or waiting for room in one */
	uint64_t cached_refs;	   /* of refs, those marked idle in a client's cache */
	uint64_t freed; /* bytes of records uncharged since mem.c last counted them freed */
	/* the newest entry's created_ns: each publish gets a later one, even if the clock steps
	 * back, so that a name's entries never share one (UNPUBLISH's created_ns check, 1.11) */
	int64_t last_created_ns;
};

void dlpd_registry_init(struct dlpd_registry *r);
/* Free the maps; every entry must be gone (dlpd_entry_unlink), and with the connections every
 * reference, waiter and charge. */
void dlpd_registry_clear(struct dlpd_registry *r);
void dlpd_holdings_init(struct dlpd_holdings *h);

struct dlpd_entry *dlpd_entry_find(struct dlpd_registry *r, const uint8_t *name, size_t len);
/* An entry, to empty the registry with at stop (see dlpd_hmap_next()); NULL when none is left. */
struct dlpd_entry *dlpd_entry_any(struct dlpd_registry *r, size_t *cursor);
/* Give @p e its name, charged to its usage (and listed on @p owner if not NULL). 0, or -ENOMEM
 * with nothing changed. The name must be free. */
int dlpd_entry_link(struct dlpd_registry *r, struct dlpd_entry *e, struct dlpd_holdings *owner);
/*
 * Take @p e out of the names and free it; its storage loses a holder. Returns that storage if
 * nothing holds it any more: the caller then tells whom it must and frees it
 * (dlpd_storage_free()). NULL otherwise.
 */
struct dlpd_storage *dlpd_entry_unlink(struct dlpd_registry *r, struct dlpd_entry *e);
/* Free an entry that never got its name. */
void dlpd_entry_free_unlinked(struct dlpd_entry *e);

/* A storage charged to @p u (size and one storage); NULL on ENOMEM. */
struct dlpd_storage *dlpd_storage_new(struct dlpd_registry *r, struct dlpd_usage *u, int fd,
				      uint64_t size, int32_t device_type, int32_t device_id);
/* Uncharge and free @p st, which nothing holds; its fd is the caller's to close. */
void dlpd_storage_free(struct dlpd_registry *r, struct dlpd_storage *st);

/* Drop the hold a name (or a queued channel message, which counts as one) has on @p st; returns
 * @p st if nothing holds it any more (see dlpd_entry_unlink()). */
struct dlpd_storage *dlpd_storage_unname(struct dlpd_storage *st);
/* Does a reference of @p u's keep @p st alive? */
bool dlpd_storage_pinned_by(const struct dlpd_storage *st, const struct dlpd_usage *u);
/* A reference in @p h on @p st; NULL on ENOMEM. */
struct dlpd_ref *dlpd_ref_new(struct dlpd_registry *r, struct dlpd_holdings *h,
			      struct dlpd_storage *st);
struct dlpd_ref *dlpd_ref_find(struct dlpd_holdings *h, uint64_t id);
/* Free @p ref; returns its storage if nothing holds it any more (see dlpd_entry_unlink()). */
struct dlpd_storage *dlpd_ref_drop(struct dlpd_registry *r, struct dlpd_holdings *h,
				   struct dlpd_ref *ref);
/* Mark @p ref idle in its client's cache (@p cached) or in use again; counted for STAT and
 * LIST. */
void dlpd_ref_mark(struct dlpd_registry *r, struct dlpd_ref *ref, bool cached);
/* A reference of @p h, to drop them all with (see dlpd_hmap_next()); NULL when none is left. */
struct dlpd_ref *dlpd_ref_any(struct dlpd_holdings *h, size_t *cursor);

/* Queue @p w (listed in @p h) to be woken when @p name is published. 0 or -ENOMEM. */
int dlpd_waiter_add(struct dlpd_registry *r, struct dlpd_holdings *h, struct dlpd_waiter *w,
		    const uint8_t *name, size_t len);
/* The oldest waiter for @p name that an entry published by @p uid answers, or NULL. */
struct dlpd_waiter *dlpd_waitq_first_match(struct dlpd_registry *r, const uint8_t *name, size_t len,
					   uint32_t uid);
/* Take @p w off its queue and off @p h; freeing it is the caller's. */
void dlpd_waiter_unlink(struct dlpd_registry *r, struct dlpd_holdings *h, struct dlpd_waiter *w);

/* The usage of @p uid, created empty if it has none; NULL on ENOMEM. Free it with
 * dlpd_usage_put() if nothing gets charged to it. */
struct dlpd_usage *dlpd_usage_get(struct dlpd_registry *r, uid_t uid);
/* The usage of @p uid, or NULL if it holds nothing. */
struct dlpd_usage *dlpd_usage_find(const struct dlpd_registry *r, uid_t uid);
/* Free @p u if nothing is charged to it any more. */
void dlpd_usage_put(struct dlpd_registry *r, struct dlpd_usage *u);

/* What LIST and watch events say of @p e. */
void dlpd_entry_info(const struct dlpd_entry *e, Dlpackd__V1__EntryInfo *info);

/*
 * Up to @p limit entries, sorted by name, whose names start with the prefix and come after
 * @p after. The array belongs to the registry and is valid until the next publish or unpublish.
 */
int dlpd_registry_range(struct dlpd_registry *r, const uint8_t *prefix, size_t plen,
			const uint8_t *after, size_t alen, size_t limit, struct dlpd_entry ***ret,
			size_t *count);

#endif
