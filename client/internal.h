/* SPDX-License-Identifier: Apache-2.0 */
/* libdlpc internals shared across its files (dlpc__ prefix, never exported from the .so): the
 * headers of the core and of each feature, and what the other files share. */
#ifndef DLPC_CLIENT_INTERNAL_H
#define DLPC_CLIENT_INTERNAL_H

#include <errno.h>
#include <stdbool.h>

#include <dlpc/dlpc.h>

#include "base.h"
#include "cache.h"
#include "core.h"
#include "gpu.h"
#include "region.h"

/* Each feature's registration (client.c calls them once, before the first connection). */
void dlpc__pool_register(void);
void dlpc__direct_register(void);

/* attach.c: turn an ATTACH (or RECV) reply that came by connection @p conn_seq, and its fd (-1 for
 * legacy CUDA IPC), into a bundle mapped as DLPC_ATTACH_* @p flags say; consumes @p fd and, on
 * failure, releases the reply's reference; keeps the reference in the cache if @p cache (@p seq:
 * dlpc__cache_seq() before the request); @p key: the storage as maps.c tells it, if known
 * already (NULL: found out here if needed). Messages say "cannot attach '@p name'". */
int dlpc__attach_build(dlpc_client *c, uint64_t conn_seq, bool cache, uint64_t seq,
		       const char *name, const Dlpackd__V1__AttachReply *rep, int fd,
		       uint32_t flags, void *stream, const struct dlpc__mkey *key,
		       dlpc_bundle **ret);
/* publish.c: where a publish's request goes instead of PUBLISH (a channel's SEND); @p fn sends
 * @p req and the storage @p fd (not consumed) and returns 0 or a negative errno. */
struct dlpc__sink {
	int (*fn)(dlpc_client *c, const struct dlpc__sink *sink, Dlpackd__V1__Publish *req, int fd);
	const char *channel;
	const dlpc_send_opts *opts;
	uint64_t pool_token; /* a pooled message: its buffer's token; else 0 */
	bool *unanswered;    /* set if the request went out and no reply came */
};
/* dlpc_publish_bundle() with its request going to @p sink; host tensors only. */
int dlpc__publish_to(dlpc_client *c, const char *name, size_t n, const char *const keys[],
		     DLManagedTensorVersioned *const tensors[], uint32_t flags,
		     const struct dlpc__sink *sink);
/* direct.c, direct_io.c: direct channels (1.8). */
#define DLPC__CHANNEL_JOIN 4
#define DLPC__CHANNEL_CLOSE 5
#define DLPC__CHANNEL_PRODUCE 6
/* A channel this connection used: a direct one's ends, or the note that it is queued. */
struct dlpc__endpoint {
	struct dlpc__endpoint *next;
	struct dlpc__endpoint *all_next; /* in c->all_endpoints until freed: a child closes all */
	uint64_t conn_seq;		 /* the connection it was learnt on */
	bool direct;
	int ends[2];	/* direct: [0] sends, [1] receives */
	unsigned users; /* calls using the ends now */
	bool dropped;	/* out of the list: closed by its last user */
	/* (atomic) not read while DLPC_CLOSING_MAX fds wait to be closed: its senders sent fds
	 * that were refused past that bound (direct_io.c); its ends go to be closed as those */
	bool barred;
	/* its stream had ended when it was joined (1.10): the end read from its ends is the end of
	 * the stream, not a removal to ask about */
	bool ended;
	/* (atomic) this connection told the daemon it produces to it (PRODUCE, 1.10) */
	bool producing;
	char name[];
};

/* What a wait on a direct channel watches besides the end: dlpc_close()/dlpc_cancel(), and the
 * daemon's going away (the channel may then live on only among processes that joined it).
 * Listed on the client while it waits, so that a forked child closes the dup. */
struct dlpc__wait {
	struct dlpc__wait *next;
	int wake; /* c->direct_wake */
	int sock; /* a dup of the connection's socket, for its hang-up */
};
/* What @p name is, asked of the daemon the first time (CHANNEL JOIN): 1 direct, with *@p ret
 * its endpoint in use (dlpc__direct_put() it); 0 queued by the daemon (*@p ret too); or a
 * negative errno (-ENOENT). */
int dlpc__direct_get(dlpc_client *c, const char *name, struct dlpc__endpoint **ret);
void dlpc__direct_put(dlpc_client *c, struct dlpc__endpoint *e);
/* @p e no longer says what its channel is (removed, made again, of the other kind): the next
 * use asks anew. */
void dlpc__direct_changed(dlpc_client *c, struct dlpc__endpoint *e);
/* A new connection, or dlpc_close(): forget every channel. */
void dlpc__direct_reset(dlpc_client *c);
/* Forget the channel @p name (this client removed it). */
void dlpc__direct_forget(dlpc_client *c, const char *name);
/* In a forked child: close the ends inherited. Under the open list's lock. */
void dlpc__direct_forked(dlpc_client *c);
/* direct.c: start watching, for a wait on a direct channel's end, what ends it besides the end:
 * dlpc_close()/dlpc_cancel() and the connection's hang-up (listed on @p c for fork). 0 or a
 * negative errno (-ECANCELED, -ECONNRESET). */
int dlpc__direct_watch_start(dlpc_client *c, struct dlpc__wait *w);
/* Stop watching (nothing if dlpc__direct_watch_start() failed or never ran: w->sock < 0). */
void dlpc__direct_watch_end(dlpc_client *c, struct dlpc__wait *w);
/* Wait until @p fd is ready for @p events, until @p end (monotonic ms; 0: forever), or until the
 * client is closed, the daemon goes away (the connection is then marked lost) or the thread's
 * interrupt check says to stop (checked when due at *@p check_at). 0 when ready, or for POLLOUT
 * when it is time to try again; -ETIMEDOUT, -ECANCELED, -ECONNRESET, -EINTR. */
int dlpc__direct_wait_end(dlpc_client *c, const struct dlpc__wait *w, int fd, short events,
			  int64_t end, int64_t *check_at);
/* The error of such a wait that did not end ready, in words naming @p verb and @p channel. */
int dlpc__direct_wait_failed(int r, const char *verb, const char *channel, int64_t timeout);
/* direct_io.c: send the message @p req with its storage @p fd on the direct channel of @p e, waiting for
 * room up to @p timeout ms (< 0: forever; 0: -EAGAIN at once). 0; -ESHUTDOWN if the channel's
 * pair was shut before the call waited (-EIDRM while it waited); a negative errno. */
int dlpc__direct_send(dlpc_client *c, struct dlpc__endpoint *e, const char *channel,
		      const Dlpackd__V1__Publish *req, int fd, int64_t timeout);
/* direct_io.c: receive a message of the direct channel of @p e into *@p ret, as
 * dlpc_recv_bundle() does;
 * -ESHUTDOWN if the channel's pair was shut before the call waited. */
int dlpc__direct_recv(dlpc_client *c, struct dlpc__endpoint *e, const char *channel, uint32_t flags,
		      int64_t timeout, bool single, dlpc_bundle **ret);
/* pool.c: recycled channel buffers. A pool token has this bit set (CUDA reclaim tokens, a
 * counter from 1, never do). */
#define DLPC__POOL_TOKEN (1ull << 63)
struct dlpc__pool;
/* Free @p p (NULL: nothing) and let go of its buffers. */
void dlpc__pool_free(struct dlpc__pool *p);
/* The buffer of @p token is (@p sending) or is not in flight in a message. */
void dlpc__pool_sending(dlpc_client *c, uint64_t token, bool sending);
/* RECLAIM of @p token came: its buffer is free again. Under c->mu. */
void dlpc__pool_reclaimed(dlpc_client *c, uint64_t token);
/* The message of @p token's buffer may be queued, but no RECLAIM of it is sure to come: the
 * buffer leaves the pool. Not under c->mu. */
void dlpc__pool_lost(dlpc_client *c, uint64_t token);
/* @p c connected anew: the buffers in flight on the old connection leave the pool. Not under
 * c->mu. */
void dlpc__pool_reset(dlpc_client *c);
/* Fill @p e from a LIST or EVENT entry (strings copied); 0 or -ENOMEM (clear it anyway). */
int dlpc__entry_fill(dlpc_entry_info *e, const Dlpackd__V1__EntryInfo *in);
/* Free what dlpc__entry_fill() allocated. */
void dlpc__entry_clear(dlpc_entry_info *e);

#endif
