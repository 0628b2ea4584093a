/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Channels (protocol 1.6): named FIFOs of messages. A message is a storage and its tensors, an
 * entry without a name; the queue holds its storage the way a name does (st->names), so until
 * it is received it is charged to its sender's uid. Receiving it turns that hold into a
 * reference of the receiver's (the storage is then charged to the receiver, like an unnamed
 * storage it keeps alive) and the message itself is gone: it is received exactly once.
 *
 * channel.c holds the data (the map, the queues); handoff.c (handoff.h) the hand-offs between
 * senders and receivers, what each connection waits for, producers and emptying a channel;
 * h_channel.c SEND and RECV; h_channel_admin.c CHANNEL (open, remove, describe), LIST's
 * channels and their watch events; direct.c (direct.h) a direct channel's sockets.
 */
#ifndef DLPD_CHANNEL_H
#define DLPD_CHANNEL_H

#include "state.h"

struct dlpd_msg {
	struct dlpd_list link;	 /* in ch->queue once admitted */
	struct dlpd_storage *st; /* held as by a name until received */
	uint8_t *tensors_wire;	 /* the tensors as an AttachReply encodes them */
	size_t tensors_wire_len;
	uint32_t flags;	     /* DLPC_PUBLISH_WRITABLE for a pooled message */
	uint32_t ntensors;   /* 1, or a bundle's count */
	bool keyed;	     /* its one tensor has a key: a bundle of one, not a single tensor */
	uint64_t pool_token; /* a pooled message: its sender's buffer, told back by RECLAIM */
	uint64_t seq;	     /* its number in the channel, given when admitted */
	uint64_t memory;     /* charged to st->usage's memory while queued */
	uid_t uid;	     /* the sender's */
	pid_t pid;
};

struct dlpd_channel {
	struct dlpd_hnode node; /* in registry.channels, hashed by name */
	struct dlpd_list queue; /* dlpd_msg, oldest first */
	uint32_t depth, capacity;
	uint64_t bytes;			     /* the queued storages' sizes */
	struct dlpd_list senders, receivers; /* dlpd_chan_wait, oldest first */
	uint32_t nsenders, nreceivers;
	uid_t uid; /* who opened it, charged with one entry */
	pid_t pid;
	/* A direct channel (1.8, direct.c): its messages go through this SOCK_SEQPACKET pair,
	 * [0] the sending end, [1] the receiving end, never through the daemon, and the queue
	 * above stays empty. -1 and -1 for a channel the daemon queues. */
	int ends[2];
	uint32_t direct_capacity; /* the messages the kernel lets the sending end queue */
	/* DLPC_CHANNEL_FALLBACK_*: why an OPEN with DLPC_CHANNEL_PREFER_DIRECT made it queued */
	uint32_t fallback;
	struct dlpd_usage *usage;
	int64_t created_ns;
	uint64_t sent, received;
	/* End of stream (1.10): the connections that produce to it (dlpd_producer), how many of
	 * them have not closed, how many closed (a connection that ended included), and how many
	 * closes the end waits for at least. Once ended it stays so until removed. */
	struct dlpd_list producers;
	uint32_t producing, closed, expected;
	bool ended;
	size_t len;
	uint8_t name[];
};

struct dlpd_channel *dlpd_channel_find(struct dlpd_registry *r, const uint8_t *name, size_t len);
/* A new empty channel named @p name, charged to @p u as one entry; NULL on ENOMEM. */
struct dlpd_channel *dlpd_channel_new(struct dlpd_registry *r, const uint8_t *name, size_t len,
				      uint32_t capacity, struct dlpd_usage *u);
/* Take @p ch (empty, nobody waiting) out of the map, uncharge and free it. */
void dlpd_channel_free(struct dlpd_registry *r, struct dlpd_channel *ch);
/* A channel, to empty the map with at stop (see dlpd_hmap_next()); NULL when none is left. */
struct dlpd_channel *dlpd_channel_any(struct dlpd_registry *r, size_t *cursor);
/* Every channel whose name starts with @p prefix and comes after @p after, sorted by name, up
 * to @p limit: a malloc'd array (the caller frees it), *@p n set. -ENOMEM. */
int dlpd_channel_range(struct dlpd_registry *r, const uint8_t *prefix, size_t plen,
		       const uint8_t *after, size_t alen, size_t limit, struct dlpd_channel ***ret,
		       size_t *n);
/* Append @p m to the queue (it holds m->st as a name does); gives it its seq. */
void dlpd_channel_push(struct dlpd_registry *r, struct dlpd_channel *ch, struct dlpd_msg *m);
/* Take the oldest message off the queue; NULL if empty. Its storage is still held. */
struct dlpd_msg *dlpd_channel_pop(struct dlpd_registry *r, struct dlpd_channel *ch);
/* What LIST, CHANNEL and watch events say of @p ch as a queued channel (a direct one's
 * sockets add theirs: dlpd_direct_info()). */
void dlpd_channel_info(const struct dlpd_channel *ch, Dlpackd__V1__ChannelInfo *info);

/* h_channel_admin.c: the channels part of a LIST reply (List.channels). */
int dlpd_channels_list(struct dlpd_peer *p, uint32_t id, const Dlpackd__V1__List *req);

#endif
