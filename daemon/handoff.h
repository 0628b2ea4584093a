/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Channels' hand-offs (handoff.c): what changes a channel and everyone it concerns. A message
 * admitted, handed to a receiver or freed; a SEND or RECV waiting, timing out, canceled or
 * ended; a producer closing and a stream ending; a channel emptied before it is freed. The
 * handlers check a request, then call here; channel.c holds the data.
 */
#ifndef DLPD_HANDOFF_H
#define DLPD_HANDOFF_H

#include "channel.h"

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

/* Free @p m, never received: its storage loses the queue's hold. */
void dlpd_msg_free(struct dlpd_server *s, struct dlpd_msg *m);
/* Queue @p m, @p p's, on @p ch (which has room and no sender waiting), hand it to a waiting
 * receiver if one is, and answer @p p's SEND @p id. */
void dlpd_handoff_send(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch,
		       struct dlpd_msg *m);
/*
 * Answer @p p's RECV @p id with the oldest message of @p ch (not empty): a reference of its own
 * on the storage and the storage's fd; the message leaves the channel and a waiting sender
 * takes its room. Refused (the message stays queued) for a connection being dropped, a bundle
 * asked for as one tensor (DLPC_WIRE_ATTACH_SINGLE in @p flags), or the reference limit. 0 or the
 * reply's negative errno.
 */
int dlpd_handoff_recv(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch, uint32_t flags);
/* Make @p p's request @p id wait on @p ch (@p m: a SEND's message; NULL for a RECV) for
 * @p timeout_ms (< 0: without end), charged to its uid with what it holds (mem.c). 0, or
 * -EDQUOT or -ENOMEM and why. */
int dlpd_handoff_park(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch, struct dlpd_msg *m,
		      uint32_t flags, int64_t timeout_ms, char *why, size_t whylen);
/* End every wait on @p ch with EIDRM ("channel '@p name' was removed"), free every message
 * and producer record it holds and close a direct one's sockets; @p ch stays, to be freed
 * (dlpd_channel_free()). */
void dlpd_channel_empty(struct dlpd_server *s, struct dlpd_channel *ch, const char *name);
/* @p p a producer of @p ch (1.10): 0, or -EPIPE (the stream ended, or @p p closed its side),
 * -EDQUOT (DLPC_PRODUCING_MAX, memory) with why. */
int dlpd_channel_produce(struct dlpd_peer *p, struct dlpd_channel *ch, char *why, size_t whylen);
/* @p p closes its side of @p ch (a record made if it had none, unless @p p is of another uid
 * than @p ch's and not root: then nothing changes): 0 or -EDQUOT. */
int dlpd_channel_close_producer(struct dlpd_peer *p, struct dlpd_channel *ch, char *why,
				size_t whylen);
/* End @p ch's stream now (close-all, or its last producer closed): waiting receivers get
 * EPIPE, waiting senders too (their messages freed), a direct channel's sending end is shut
 * for writing. */
void dlpd_channel_end(struct dlpd_server *s, struct dlpd_channel *ch);
/* Drop what @p p waits for on channels (its blocked SENDs' messages are freed) and its
 * producer records (a producer not closed counts as closed: its stream may end). */
void dlpd_channels_drop_peer(struct dlpd_peer *p);
/* End @p p's SEND or RECV @p id if it waits on a channel (CANCEL): ERROR ECANCELED, a SEND's
 * message freed. Whether one did. */
bool dlpd_channel_cancel(struct dlpd_peer *p, uint32_t id);
/* Free every channel and its messages at stop, once every connection is gone. */
void dlpd_channels_clear(struct dlpd_server *s);

#endif
