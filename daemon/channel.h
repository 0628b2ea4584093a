/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Channels (protocol 1.6): named FIFOs of messages. A message is a storage and its tensors, an
 * entry without a name; the queue holds its storage the way a name does (st->names), so until
 * it is received it is charged to its sender's uid. Receiving it turns that hold into a
 * reference of the receiver's (the storage is then charged to the receiver, like an unnamed
 * storage it keeps alive) and the message itself is gone: it is received exactly once.
 *
 * channel.c holds the data (the map, the queues, what each connection waits for); h_channel.c
 * SEND, RECV and the hand-offs between senders and receivers; h_channel_admin.c CHANNEL (open,
 * remove, describe), LIST's channels and their watch events; direct.c (direct.h) a direct channel's
 * sockets.
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

/* A connection that produces to a channel (1.10): made by its first SEND, a PRODUCE (a direct
 * channel's sender, before its first message) or a CLOSE; kept, closed or not, until the
 * connection or the channel goes, so that a closed producer's later sends are refused. */
struct dlpd_producer {
	struct dlpd_list ch_link;   /* in ch->producers */
	struct dlpd_list peer_link; /* in holdings.producing */
	struct dlpd_channel *ch;
	struct dlpd_holdings *holder;
	bool closed;
};

/* What a producer record costs its uid's memory (--max-memory-per-uid). */
#define DLPD_PRODUCER_COST 96

/* A SEND waiting for room, or a RECV waiting for a message. */
struct dlpd_chan_wait {
	struct dlpd_list ch_link;   /* in ch->senders or ch->receivers */
	struct dlpd_list peer_link; /* in holdings.chan_waits */
	struct dlpd_channel *ch;
	struct dlpd_peer *peer;
	uint32_t req_id;
	uint32_t flags;	      /* RECV: ATTACH_SINGLE */
	struct dlpd_msg *msg; /* SEND: the message to admit; NULL for a RECV */
	int64_t timeout_ms;   /* > 0: timer runs */
	uv_timer_t timer;
	uint64_t charged; /* to its uid's pending bytes (mem.c): itself and a SEND's message */
};

/* What a waiting SEND or RECV costs the daemon besides a SEND's message: the wait and
 * allocator overhead. */
#define DLPD_CHAN_WAIT_COST (sizeof(struct dlpd_chan_wait) + 32)

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

/* h_channel.c: end every wait on @p ch with EIDRM ("channel '@p name' was removed") and free
 * every message it holds; @p ch stays. */
void dlpd_channel_empty(struct dlpd_server *s, struct dlpd_channel *ch, const char *name);
/* h_channel.c: @p p a producer of @p ch (1.10): 0, or -EPIPE (the stream ended, or @p p
 * closed its side), -EDQUOT (DLPC_PRODUCING_MAX, memory) with why. */
int dlpd_channel_produce(struct dlpd_peer *p, struct dlpd_channel *ch, char *why, size_t whylen);
/* h_channel.c: @p p closes its side of @p ch (a record made if it had none, unless @p p is of
 * another uid than @p ch's and not root: then nothing changes): 0 or -EDQUOT. */
int dlpd_channel_close_producer(struct dlpd_peer *p, struct dlpd_channel *ch, char *why,
				size_t whylen);
/* h_channel.c: end @p ch's stream now (close-all, or its last producer closed): waiting
 * receivers get EPIPE, waiting senders too (their messages freed), a direct channel's sending
 * end is shut for writing. */
void dlpd_channel_end(struct dlpd_server *s, struct dlpd_channel *ch);
/* h_channel.c: drop what @p p waits for on channels (its blocked SENDs' messages are freed)
 * and its producer records (a producer not closed counts as closed: its stream may end). */
void dlpd_channels_drop_peer(struct dlpd_peer *p);
/* End @p p's SEND or RECV @p id if it waits on a channel (CANCEL): ERROR ECANCELED, a SEND's
 * message freed. Whether one did. */
bool dlpd_channel_cancel(struct dlpd_peer *p, uint32_t id);
/* h_channel.c: free every channel and its messages at stop, once every connection is gone. */
void dlpd_channels_clear(struct dlpd_server *s);
/* h_channel_admin.c: the channels part of a LIST reply (List.channels). */
int dlpd_channels_list(struct dlpd_peer *p, uint32_t id, const Dlpackd__V1__List *req);

#endif
