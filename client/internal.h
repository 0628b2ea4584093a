/* SPDX-License-Identifier: Apache-2.0 */
/* libdlpc internals shared across its files (dlpc__ prefix, never exported from the .so). */
#ifndef DLPC_CLIENT_INTERNAL_H
#define DLPC_CLIENT_INTERNAL_H

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <time.h>

#include <dlpc/dlpc.h>

#include "io.h"
#include "limits.h"
#include "msg.h"

struct dlpc__call;
struct dlpc__centry;
struct dlpc__mentry;

/* Buckets of a client's cache table (cache.c), by name. */
#define DLPC__CACHE_BUCKETS 64

/*
 * A client's cache of references by name (cache.c): every cacheable attach of a host entry,
 * in use or idle since its last release, until its name moves on (INVALIDATE), the bounds or
 * the idle time evict it, or the connection goes. Its lock is a leaf: nothing else is locked
 * under it, and it is taken under c->mu (INVALIDATE) and under wmu and mu (reconnect).
 */
struct dlpc__cache {
	pthread_mutex_t mu;
	bool on; /* protocol 1.7, no DLPC_CONNECT_NO_CACHE, no bound set to 0: set at connect */
	uint64_t max_entries, max_bytes;
	int64_t idle_ms;
	struct dlpc__centry *table[DLPC__CACHE_BUCKETS];
	struct dlpc__centry *idle_head, *idle_tail; /* idle entries, most recently used first */
	uint64_t nidle, idle_bytes;
	uint64_t inval_seq; /* INVALIDATE frames received: an attach that saw one may not cache */
	struct dlpc__centry *dead; /* unlinked with nobody using them, to be freed unlocked */
	/* received storages' idle mappings (maps.c), under the same lock and bounds */
	bool maps_on; /* no DLPC_CONNECT_NO_CACHE, no bound 0, not closed: set at connect */
	struct dlpc__mentry *maps[DLPC__CACHE_BUCKETS];
	struct dlpc__mentry *maps_head, *maps_tail; /* every storage seen, most recent first */
	uint64_t maps_n, maps_nidle, maps_idle_bytes;
};

/*
 * One connection. Requests may come from many threads: each sends its frame under wmu, then
 * waits for the reply carrying its id. Whichever waiting thread finds nobody reading becomes
 * the reader until some reply arrives or its own deadline passes, handing replies to their
 * callers (leader/follower). The library's own thread (loop.c) flushes deferred releases, and
 * takes the reader's turn without waiting to act on RECLAIM and INVALIDATE frames.
 *
 * The struct is refcounted: the user's handle counts once, each attached mapping once, and each
 * call in progress once (so dlpc_close() from another thread cannot free it under a waiting
 * caller). The socket closes when the last goes, so deleters keep working after dlpc_close().
 * Lock order: wmu before mu, never the other way; then the list of open clients' lock
 * (client.c); and mu before the mu of the connection being made anew (connecting).
 */
struct dlpc_client {
	int sock;
	pid_t pid;	   /* process that connected; others get -EBADFD */
	unsigned fork_gen; /* dlpc__fork_gen when it connected */
	atomic_uint refs;

	int64_t call_timeout_ms; /* DLPC_CALL_TIMEOUT_MS read at connect; <= 0: no bound */

	pthread_mutex_t mu; /* protects the fields below up to wmu */
	pthread_cond_t cv;  /* on CLOCK_MONOTONIC, like every deadline here */
	bool reading;
	bool closed; /* dlpc_close() or dlpc_cancel() was called: no new call starts */
	int broken;  /* 0, or the negative errno that ended the connection */
	uint32_t next_id;
	uint32_t minor; /* protocol minor version agreed at HELLO */
	struct dlpc__call *calls;
	/* ids of requests whose callers stopped waiting (deadline passed, or dlpc_close()): their
	 * replies are dropped when they come, an ATTACH reply's reference released */
	uint32_t *abandoned;
	size_t nabandoned, abandoned_cap;
	/* legacy CUDA IPC publications awaiting their RECLAIM notice, the tokens of notices
	 * received but not yet acted on, and whether the library's thread holds the client to
	 * read them (loop.c) */
	unsigned ipc_pubs; /* of this connection (epoch): counted as their PUBLISH goes out */
	uint64_t *reclaimed;
	size_t nreclaimed, reclaimed_cap;
	bool reclaimer;
	int wake_fd;	    /* eventfd that ends the reader's wait for the socket (dlpc_close) */
	char fatal[256];    /* the daemon's last word (an ERROR with id 0), if any */
	int fatal_code;	    /* and its errno, positive */
	struct dlpc__rx rx; /* used only by the current reader */

	pthread_mutex_t wmu; /* serializes writes; protects out and pending */
	struct dlpc__scratch out;
	/* references released by deleters but not yet told to the daemon (dlpc__release_epoch) */
	uint64_t pending[DLPC_RELEASE_PENDING_MAX];
	atomic_uint npending; /* written under wmu; read without it by the library's thread */

	struct dlpc_client *next_open; /* in the list of open clients (client.c) */

	/* DLPC_CONNECT_RECONNECT: a call that finds the connection lost connects anew first
	 * (dlpc__reconnect()). The fields below change under wmu and mu both. */
	bool reconnect;
	bool no_cache;	   /* DLPC_CONNECT_NO_CACHE */
	bool reconnecting; /* a thread is connecting anew: others fail as the lost connection did */
	/* the connection being made anew, until it replaces the lost one or fails: dlpc_close()
	 * and dlpc_cancel() cancel its HELLO too (under mu) */
	struct dlpc_client *connecting;
	uint64_t epoch; /* connections before this one; a reference names the one it came by */
	char path[108]; /* the socket, to connect to again */
	struct dlpc__pool *pool; /* recycled buffers of dlpc_channel_alloc() (pool.c), or NULL */
	struct dlpc__cache cache;
	/* channels used: direct ones' ends, queued ones noted (direct.c); under the open list's
	 * lock (dlpc__list_lock()) */
	struct dlpc__endpoint *endpoints;
	struct dlpc__endpoint *all_endpoints; /* listed and dropped ones alike, until freed */
	/* waits on direct channels, each with a dup of sock (direct.c) */
	struct dlpc__wait *watches;
	int direct_wake; /* eventfd that ends waits on direct channels (dlpc_close()), or -1 */
};

/*
 * A mapping of shared memory that views (the tensors libdlpc hands out) point into. Refcounted
 * by its views (and transiently by a bundle). The last unref unmaps it, then closes @p fd
 * (allocated memory) or sends RELEASE of @p ref_id through @p client (attached memory).
 */
/* A storage's identity for maps.c: the file (device, inode) and its change time (an inode
 * number is reused only by a later file, made at a later time), with the size mapped. */
struct dlpc__mkey {
	uint64_t dev, ino, len;
	int64_t ctime_s, ctime_ns;
};

struct dlpc__region {
	atomic_uint refs;
	void *base;
	size_t len;
	int fd; /* dlpc_alloc memory: its memfd (CUDA: its VMM export fd); attached memory: -1 */
	bool device;		   /* CUDA memory: gpu says how to let go of it */
	struct dlpc__gpu_map *gpu; /* CUDA: the mapping; NULL for the publisher's own pointer */
	uint8_t uuid[DLPC_CUDA_UUID_SIZE]; /* CUDA dlpc_alloc memory: its device's UUID */
	bool has_event; /* legacy CUDA IPC: ev_handle is the publisher's, for dlpc_tensor_wait() */
	/* attached CUDA memory: how its release is ordered after the consumer's work. No stream
	 * handle of the consumer's is kept: the consumer owns its streams and may destroy one
	 * before the tensor is dropped (CuPy's `with Stream():`), and a destroyed handle must not
	 * be used. The legacy default stream follows every blocking stream, so an event there is
	 * enough, unless a stream the consumer named is non-blocking (or its flags could not be
	 * read): then sync_ctx, and the whole context is synchronized instead (cuda.c). */
	atomic_bool sync_ctx;
	int ordinal;
	uint8_t ev_handle[DLPC_CUDA_IPC_HANDLE_SIZE];
	dlpc_client *client; /* attached memory: holds a client reference; else NULL */
	uint64_t ref_id;
	uint64_t epoch; /* the connection (client->epoch) ref_id belongs to */
	/* attached memory held through the client's cache: the entry holds the reference (the
	 * region only one use of it), and may take back the mapping (map_kind) */
	struct dlpc__centry *ce;
	/* a channel's message mapped read-only or copy-on-write (map_kind DLPC__MAP_SHARED_RO or
	 * DLPC__MAP_COW): which storage, for maps.c to keep the mapping for the storage's next
	 * message (keyed) */
	bool keyed;
	struct dlpc__mkey key;
	uint8_t map_kind;   /* DLPC__MAP_* */
	atomic_bool frozen; /* allocated memory sealed read-only (F_SEAL_WRITE), mapped read-only */
	atomic_bool sealed_ro; /* ...and its seals final: sealing it read-only again is a no-op */
	/* attached memory (protocol 1.3 and later): who published the entry, and what */
	bool has_owner;
	uint32_t owner_uid, entry_flags;
	int32_t owner_pid;
	uint64_t generation;
	/* allocated memory: the tensors dlpc_alloc_bundle() laid out in it (nparts of them, at
	 * parts[i]; NULL: one, at 0), which a zero-copy publish must cover, all and in order */
	size_t nparts;
	uint64_t *parts;
	/* dlpc_channel_alloc() memory: its pool token (DLPC__POOL_TOKEN set) and the connection
	 * whose pool holds it (not a reference); 0 and NULL otherwise */
	uint64_t pool_token;
	const dlpc_client *pool_owner;
	/* dlpc_channel_alloc() memory (pool_token set): an O_RDONLY descriptor of fd, the one its
	 * messages carry, so that no receiver can map or write the buffer (pool.c) */
	int pool_fd;
};

void dlpc__region_ref(struct dlpc__region *r);
void dlpc__region_unref(struct dlpc__region *r);
/* A C-contiguous view of @p r at @p data; takes its own region reference. NULL on ENOMEM. */
DLManagedTensorVersioned *dlpc__view_new(struct dlpc__region *r, void *data, DLDevice dev,
					 DLDataType dtype, int ndim, const int64_t *shape,
					 uint64_t flags);
/* The region of a tensor libdlpc made, or NULL for any other tensor. */
struct dlpc__region *dlpc__view_region(const DLManagedTensorVersioned *t);
/* Refuse (-EFBIG, -ENOSPC, message naming @p name) a memfd of @p size bytes that this process
 * could not fill: over RLIMIT_FSIZE, the machine's memory and swap, or its memory cgroups' room
 * (room.c). 0 if it fits. */
int dlpc__size_fits(const char *name, uint64_t size);
/* A memfd of @p size bytes labelled after @p name, its pages allocated now if @p reserve (for
 * memory that will be written through a mapping); fd or negative errno. */
int dlpc__memfd_create(const char *name, uint64_t size, bool reserve);
/* The negative errno for a failed write or reservation of shared memory: a full /dev/shm
 * (ENOSPC) and a full memory cgroup (ENOMEM) are both -ENOSPC, "shared memory is full". */
static inline int dlpc__space_err(int err)
{
	return err == ENOSPC || err == ENOMEM ? -ENOSPC : -err;
}

/* Seal a storage memfd that nothing maps for publishing: F_SEAL_SHRINK, GROW and SEAL, plus
 * F_SEAL_WRITE unless @p writable. 0 or negative errno. */
int dlpc__memfd_seal(int fd, const char *name, bool writable);
/* The same for dlpc_alloc() memory @p r, which this process maps: a read-only seal first makes
 * our own mapping read-only for good, in place. 0, -EBUSY if a writable mapping of it survives
 * in another process, or another negative errno. */
int dlpc__region_seal(struct dlpc__region *r, const char *name, bool writable);

/* Bumped in every forked child (pthread_atfork): a client whose fork_gen differs is not ours.
 * Comparing it costs nothing, where getpid() is a system call on every attach and release. */
extern unsigned dlpc__fork_gen;

/* Is @p c usable in this process? */
static inline bool dlpc__ours(const dlpc_client *c)
{
	return c->fork_gen == __atomic_load_n(&dlpc__fork_gen, __ATOMIC_RELAXED);
}

/* Bytes of the message dlpc_last_error() keeps (longer ones are cut): room for a failed
 * connect's every path tried, with the hint of dlpc__access_hint(). */
#define DLPC_ERROR_TEXT_MAX 1024
/* error.c: record @p err and a message for dlpc_last_error() in this thread; returns @p err. */
int dlpc__fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* discover.c: for a connect() to @p path refused with EACCES, "; the socket belongs to group
 * 'dlpack': join it with ..." (empty when nothing can be said), into @p buf. */
void dlpc__access_hint(const char *path, char *buf, size_t len);
/* 0, or -EBADFD (with the message set) when @p c is used from a process that did not create it. */
int dlpc__check(const dlpc_client *c);
/* What one request says besides its result (dlpc__call_ex()). */
struct dlpc__call_info {
	/* in: the request lends memory that the daemon gives back by RECLAIM (legacy CUDA IPC, a
	 * lent VMM fd): it is counted in c->ipc_pubs as it goes out, on the connection it goes
	 * out on, so that a count never outlives its connection */
	bool lend;
	/* out: the request went out (or may have) on connection @p epoch (c->epoch then): what it
	 * made, a reference or a lent publication, belongs to that connection */
	bool sent;
	uint64_t epoch;
	/* out: a reply (an ERROR one included) came: the daemon has dealt with the request */
	bool answered;
	/* in: room for the reply's fds past the first (which goes to the call's rfd), kept as the
	 * caller set them (-1) where none came */
	int *more_fds;
	unsigned nmore_fds;
	/* out: the call failed because the connection was lost, before or while it waited; or,
	 * when connecting anew failed, that error (lost stays false) */
	bool lost;
	int reconnect_err;
};

/*
 * Send @p req with @p nfds fds and wait for its reply, unpacked with @p rdesc into @p rep (the
 * caller frees it, with @p alloc: NULL for the default allocator, or an arena's). If @p rfd is
 * not NULL it receives the reply's fd (or -1).
 * An ERROR reply returns its negative code and sets the thread's message. The wait is bounded by
 * c->call_timeout_ms (-ETIMEDOUT); -ECANCELED once dlpc_close() or dlpc_cancel() was called; -EMFILE when the
 * reply's fds could not be received (an ATTACH reply's reference is released). After these the
 * connection stays usable: a reply that comes later is dropped.
 */
int dlpc__call(dlpc_client *c, uint16_t type, const ProtobufCMessage *req, const int *fds,
	       unsigned nfds, const ProtobufCMessageDescriptor *rdesc, ProtobufCMessage **rep,
	       int *rfd, ProtobufCAllocator *alloc);
/*
 * dlpc__call() with @p info (NULL: none), for a request the daemon may hold for @p wait_ms (a
 * waiting ATTACH): > 0 bounds the wait by @p wait_ms + DLPC_CALL_GRACE_MS, and a connection made
 * anew first by @p wait_ms too; < 0 leaves the wait unbounded; 0 is dlpc__call()'s bound.
 */
int dlpc__call_ex(dlpc_client *c, uint16_t type, const ProtobufCMessage *req, const int *fds,
		  unsigned nfds, int64_t wait_ms, struct dlpc__call_info *info,
		  const ProtobufCMessageDescriptor *rdesc, ProtobufCMessage **rep, int *rfd,
		  ProtobufCAllocator *alloc);
/*
 * Fire-and-forget RELEASE of one reference, which came by connection @p epoch: dropped if the
 * client has connected anew since (that connection, and the reference with it, is gone); does
 * nothing in a forked child. The id waits in c->pending and goes out with the connection's next
 * request, or after DLPC_RELEASE_DELAY_MS through the library's thread (loop.c), whichever comes
 * first.
 */
void dlpc__release_epoch(dlpc_client *c, uint64_t ref_id, uint64_t epoch);
/* Replace @p c's lost connection by a new one to the same socket (HELLO included), waiting
 * @p connect_ms at most for connect() and @p hello_ms for HELLO (<= 0: no bound). 0, or the
 * negative errno of connecting (the old connection's error stays): -ECANCELED when
 * dlpc_close() or dlpc_cancel() ended it. */
int dlpc__reconnect(dlpc_client *c, int64_t connect_ms, int64_t hello_ms);
/* Is @p err, from connecting anew, one that a daemon on its way back gives (none listens yet,
 * its socket is not there yet, it went again, it did not answer in time)? Other errors
 * (permissions, the protocol, resources) last: waiting does not end them. */
static inline bool dlpc__reconnect_transient(int err)
{
	return err == -ECONNREFUSED || err == -ENOENT || err == -ECONNRESET || err == -EPIPE ||
	       err == -ETIMEDOUT;
}
/* Wait @p ms for a lost connection's daemon to come back: 0, or -ECANCELED (dlpc_close(),
 * dlpc_cancel()) or -EINTR (the thread's interrupt check said stop), the message set. */
int dlpc__pause_lost(dlpc_client *c, int64_t ms);
void dlpc__client_ref(dlpc_client *c);
void dlpc__client_unref(dlpc_client *c);
/* Start a detached thread of the library's running @p fn(@p arg), every signal blocked on it
 * (the user's handlers never run there). false if none could be made. */
bool dlpc__start_thread(void *(*fn)(void *), void *arg);

/* ---- client.c and call.c: the connection's request machinery ---- */
/* Frame @p c's deferred releases at offset 0 of c->out. Length, or negative errno. Under wmu. */
ssize_t dlpc__pending_frame(dlpc_client *c);
/* Send @p c's deferred releases now (see client.c). Under wmu, without c->mu. */
void dlpc__flush_locked(dlpc_client *c);
/* The caller stopped waiting for the reply to request @p id (@p type) of connection @p epoch
 * (its deadline passed, it was canceled or interrupted): if the request may wait in the daemon
 * (ATTACH, RECV, SEND), tell it (CANCEL, 1.9), so that the wait ends there at once instead of
 * when the connection closes. Its ECANCELED reply is dropped as any late one. Not under c->mu
 * or c->wmu. */
void dlpc__cancel_wait(dlpc_client *c, uint16_t type, uint32_t id, uint64_t epoch);
/* End the reader's wait for the socket: it then looks at the state of its call again. */
void dlpc__wake_reader(dlpc_client *c);
/* For dlpc_close(): no call starts any more; every call still waiting returns -ECANCELED. */
void dlpc__cancel_calls(dlpc_client *c);
/*
 * One step of waiting for frames, under c->mu (held again on return): if another thread has
 * the reader's turn, wait until it ends or @p dl (NULL: none) passes; otherwise take the turn
 * and read until a frame is delivered, @p dl passes or dlpc__wake_reader() is called. A lost
 * connection sets c->broken. Callers loop until what they wait for has happened. 0, or
 * DLPC__INTERRUPTED when the thread's interrupt check (dlpc_set_interrupt()) said to give up.
 */
int dlpc__reader_turn(dlpc_client *c, const struct timespec *dl);
/* Does the calling thread's interrupt check (dlpc_set_interrupt()) say to give up? false
 * without one. Called without any lock of the library's. */
bool dlpc__interrupted(void);
/* Has the calling thread an interrupt check (dlpc_set_interrupt())? */
bool dlpc__interrupt_set(void);
/* What dlpc__reader_turn() returns when the thread's interrupt check asked to give up. */
#define DLPC__INTERRUPTED 2
/* attach.c: turn an ATTACH (or RECV) reply that came by connection @p epoch, and its fd (-1 for
 * legacy CUDA IPC), into a bundle mapped as DLPC_ATTACH_* @p flags say; consumes @p fd and, on
 * failure, releases the reply's reference; keeps the reference in the cache if @p cache (@p seq:
 * dlpc__cache_seq() before the request); @p key: the storage as maps.c tells it, if known
 * already (NULL: found out here if needed). Messages say "cannot attach '@p name'". */
int dlpc__attach_build(dlpc_client *c, uint64_t epoch, bool cache, uint64_t seq, const char *name,
		       const Dlpackd__V1__AttachReply *rep, int fd, uint32_t flags, void *stream,
		       const struct dlpc__mkey *key, dlpc_bundle **ret);
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
/* alloc.c: a new region of @p size bytes (> 0) on @p device holding one reference (the
 * caller's); errors name @p what. */
int dlpc__alloc_region(DLDevice device, uint64_t size, const char *what, struct dlpc__region **ret);
/* direct.c, direct_io.c: direct channels (1.8). */
#define DLPC__CHANNEL_JOIN 4
#define DLPC__CHANNEL_CLOSE 5
#define DLPC__CHANNEL_PRODUCE 6
/* A channel this connection used: a direct one's ends, or the note that it is queued. */
struct dlpc__endpoint {
	struct dlpc__endpoint *next;
	struct dlpc__endpoint *all_next; /* in c->all_endpoints until freed: a child closes all */
	uint64_t epoch;			 /* the connection it was learnt on */
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
 * its endpoint in use (dlpc__direct_put() it); 0 queued by the daemon (*@p ret too, unless the
 * daemon is older than 1.8: NULL); or a negative errno (-ENOENT). */
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
/* loop.c: close @p fd on a thread of the library's own (one a peer sent and libdlpc refused:
 * its close may block), or here if that thread cannot run. A socket's SO_LINGER is turned off
 * first. */
void dlpc__close_later(int fd);
/* loop.c: the fds dlpc__close_later() was given that are not closed yet (DLPC_CLOSING_MAX). */
size_t dlpc__closing_held(void);
/* client.c: the lock of the open clients' list, which fork() takes */
void dlpc__list_lock(void);
void dlpc__list_unlock(void);
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
/* Validate a user-supplied name; 0 or -EINVAL with the message set. */
int dlpc__name_arg(const char *name, const char *what);

/* Count a legacy CUDA IPC publication of @p c's connection @p epoch until its RECLAIM notice
 * (or, with -1, take a failed one back); nothing once @p c has connected anew since: the count
 * went with that connection. */
void dlpc__reclaim_count(dlpc_client *c, int delta, uint64_t epoch);
/* Have the library's thread watch @p c (loop.c): it reads the connection whenever no request
 * does, so that RECLAIM notices are acted on while the process makes no calls, and holds a
 * reference on @p c until the last publication is reclaimed or the connection is lost. */
void dlpc__reclaim_start(dlpc_client *c);

/* ---- loop.c: the library's thread ---- */
/* Make sure the thread will send deferred releases soon. false when it cannot run. */
bool dlpc__loop_flush_soon(void);
/* Have the thread look at everything again now (async-signal-safe, any lock held). */
void dlpc__loop_wake(void);
/* fork(): 0 before (lock), 1 in the parent after, 2 in the child (start afresh). */
void dlpc__loop_atfork(int phase);
/* Every open client of this process, each referenced (unref each), into *@p buf of *@p cap
 * (grown as needed; the caller's to keep or free). Their number. */
size_t dlpc__clients_ref(dlpc_client ***buf, size_t *cap);

/* ---- cache.c: references kept after their last release ---- */
/* What an attached host mapping is, for the cache to keep it for the next attach. */
#define DLPC__MAP_OTHER 0     /* not to be handed out again: unmapped */
#define DLPC__MAP_SHARED_RO 1 /* MAP_SHARED, PROT_READ */
#define DLPC__MAP_COW 2	      /* MAP_PRIVATE, PROT_READ|PROT_WRITE */
/* Tags of the ids in c->pending besides releases: a RELEASE mark (protocol 1.7). */
#define DLPC__MARK_CACHED (1ull << 63)
#define DLPC__MARK_USED (1ull << 62)

/* Read the bounds ($DLPC_CACHE_*) and turn @p c's cache on unless @p off. 0, or -EINVAL for a
 * value that is not a whole number. */
int dlpc__cache_init(dlpc_client *c, bool off);
/* Free what the cache holds (at client_free(): nothing uses it any more). */
void dlpc__cache_clear(dlpc_client *c);
/* Number of INVALIDATE frames @p c has received: an attach notes it before its request and
 * caches the reference it gets only if it has not changed meanwhile. */
uint64_t dlpc__cache_seq(dlpc_client *c);
/* An entry answering an attach of @p name (with @p owner_uid, if @p owned; one tensor, if
 * @p single) from the cache, in use once more; NULL: ask the daemon. *@p map receives the idle
 * mapping of the kind asked for (a copy-on-write one if @p cow), if it kept one. */
struct dlpc__centry *dlpc__cache_get(dlpc_client *c, const char *name, bool owned,
				     uint32_t owner_uid, bool single, bool cow, void **map);
/* What a region made from entry @p e needs of it. */
void dlpc__cache_fill(const struct dlpc__centry *e, struct dlpc__region *m, int *fd,
		      const uint8_t **table, size_t *table_len);
/*
 * Cache the reference of a reply just received (@p seq: dlpc__cache_seq() before its request),
 * taking over @p fd; the entry is in use once. NULL (nothing taken) when it cannot be: the name
 * is cached already, an invalidation came meanwhile, another connection, no memory.
 */
struct dlpc__centry *dlpc__cache_insert(dlpc_client *c, uint64_t seq, uint64_t epoch,
					const char *name, const struct dlpc__region *m, int fd,
					const uint8_t *table, size_t table_len);
/* One use of @p e ends; its mapping @p base (NULL: none) of DLPC__MAP_* @p kind goes back to
 * it if it has none of that kind (a copy-on-write one emptied of its private pages first), or
 * is unmapped. The last use makes the entry idle, or frees it if invalidated. */
void dlpc__cache_put(dlpc_client *c, struct dlpc__centry *e, void *base, int kind);
/* INVALIDATE frame @p f: forget the entry it names (under c->mu). 0 or -EPROTO. */
int dlpc__cache_invalidate(dlpc_client *c, const struct dlpc__frame *f);
/* Free the entries invalidated or dropped meanwhile (with no lock of @p c held). */
void dlpc__cache_reap(dlpc_client *c);
/* Forget every entry (connection replaced, dlpc_close()); free them with dlpc__cache_reap(). */
void dlpc__cache_drop(dlpc_client *c);
/* Turn the cache off for good and free what it holds (dlpc_close()). No lock held. */
void dlpc__cache_off(dlpc_client *c);
/* Evict what has been idle too long; the monotonic ms when the next entry expires, or 0. */
int64_t dlpc__cache_sweep(dlpc_client *c);
/* In a forked child: close the parent's cached fds and mappings, start the lock afresh. */
void dlpc__cache_forked(dlpc_client *c);
/* For fork: hold @p c's cache lock (prepare) or let go of it (parent). */
void dlpc__cache_lock(dlpc_client *c, bool lock);
/* Queue a RELEASE mark of reference @p ref_id of connection @p epoch: idle in the cache
 * (@p cached) or in use again (client.c). */
void dlpc__mark_epoch(dlpc_client *c, uint64_t ref_id, uint64_t epoch, bool cached);
/* Have the library's thread sweep the caches at monotonic ms @p when (loop.c); false when
 * that thread cannot run (a process at its thread limit). */
bool dlpc__sweep_at(int64_t when);
/* Read what @p c's socket holds without waiting, delivering it, if no other thread reads it:
 * 1; 0 when another does (or the connection is lost, or closed unless @p closed_ok). */
int dlpc__drain(dlpc_client *c, bool closed_ok);
/* Monotonic milliseconds. */
int64_t dlpc__mono_ms(void);

/* ---- maps.c: idle mappings of storages that channels bring again ---- */
/* Internal attach flag of channel receives: map a message's storage through maps.c. */
#define DLPC__ATTACH_KEEP_MAP (1u << 31)

/* Internal attach flag: the storage passed dlpc__storage_check() read-only (direct channels). */
#define DLPC__ATTACH_SEALED (1u << 30)

/* A mapping of DLPC__MAP_* @p kind (SHARED_RO or COW) of @p len bytes of storage @p fd for a
 * message: an idle one kept from the same storage's earlier message, or NULL (map it). Fills
 * *@p key (from @p known, or fstat() when NULL) for dlpc__maps_put() and sets *@p keyed, unless
 * the storage cannot be told (fstat() failed, no memory) or the cache is off; remembers that
 * the storage passed dlpc__storage_check() read-only if @p sealed. */
void *dlpc__maps_take(dlpc_client *c, int fd, size_t len, uint8_t kind, bool sealed,
		      const struct dlpc__mkey *known, struct dlpc__mkey *key, bool *keyed);
/* Did storage @p fd, for @p len bytes, pass dlpc__storage_check() read-only in an earlier
 * message? Such a storage cannot have changed since: its seals are final, its size sealed and
 * no page of a write-sealed memfd can be taken away. Fills *@p key and sets *@p keyed when it
 * could tell the storage (for dlpc__maps_take()'s @p known: no second fstat()). */
bool dlpc__maps_sealed(dlpc_client *c, int fd, size_t len, struct dlpc__mkey *key, bool *keyed);
/* Empty copy-on-write mapping @p base of @p len bytes of the pages its user wrote, so that it
 * shows the storage's bytes as a fresh mapping would: the written pages found (PAGEMAP_SCAN),
 * or all (MADV_DONTNEED) where the kernel cannot tell. 0, or -1 with errno set. */
int dlpc__cow_clean(void *base, size_t len);
/* The last use of region @p r's mapping ends: keep it, idle, if its storage came more than
 * once (true), else leave it to the caller to unmap (false). */
bool dlpc__maps_put(dlpc_client *c, const struct dlpc__region *r);
/* Unmap the idle mappings: all (@p all), or those idle past the bounds; the monotonic ms when
 * the next one expires, or 0. Under no lock. */
int64_t dlpc__maps_sweep(dlpc_client *c, bool all);
/* Turn the cache of mappings off for good, forget every storage and unmap the idle mappings
 * (dlpc_close(), client_free(); in a forked child, the parent's, once the cache's lock is
 * started afresh). */
void dlpc__maps_clear(dlpc_client *c);
/* Close this process's /proc/self/pagemap, opened by dlpc__cow_clean() (its last client went). */
void dlpc__maps_pagemap_close(void);
/* fork(): hold the lock of this process's pagemap fd (@p phase 0, prepare), let go of it (1,
 * parent), or close the parent's fd and start afresh (2, child). */
void dlpc__maps_atfork(int phase);

/* ---- cuda.c: the CUDA driver, loaded at run time ---- */
struct dlpc__gpu_map;

/* What a legacy IPC publication sends. */
struct dlpc__ipc_export {
	int fd; /* >= 0: memory legacy IPC cannot export, lent as this VMM export fd instead */
	uint8_t mem_handle[DLPC_CUDA_IPC_HANDLE_SIZE];
	uint8_t event_handle[DLPC_CUDA_IPC_HANDLE_SIZE];
	uint8_t uuid[DLPC_CUDA_UUID_SIZE];
	uint64_t offset;     /* of the tensor's data in its allocation */
	uint64_t alloc_size; /* the allocation's size */
	uint64_t token;	     /* for the RECLAIM notice */
};

/* The 16-byte UUID of CUDA device @p ordinal. 0 or negative errno, message naming @p what. */
int dlpc__cuda_device_uuid(int ordinal, uint8_t uuid[DLPC_CUDA_UUID_SIZE], const char *what);
/*
 * Export the allocation holding @p t's @p nbytes with an IPC handle and an interprocess event
 * recorded now on the legacy default stream; or, for a VMM mapping legacy IPC cannot export
 * (x->fd >= 0, the caller's to close), as its POSIX export fd once the host has waited for the
 * device. On success the library keeps @p t under x->token until dlpc__cuda_reclaim().
 * -ENODEV without a driver, -ENOTSUP where IPC is unsupported or the allocator's memory cannot
 * be exported (the message names the setting).
 */
int dlpc__cuda_ipc_export(DLManagedTensorVersioned *t, uint64_t nbytes, const char *name,
			  struct dlpc__ipc_export *x);
/* Forget the publication @p token, running its tensor's deleter if @p run_deleter. false if
 * the token is unknown. */
bool dlpc__cuda_reclaim(uint64_t token, bool run_deleter);
/*
 * Open a legacy IPC allocation through the import cache (or find it among this process's own
 * publications: then *@p ret is NULL), and unless @p defer order @p stream (NULL: this thread)
 * after the publisher's event. *@p base: the allocation here; *@p ordinal: the local device.
 */
int dlpc__cuda_ipc_import(const uint8_t uuid[DLPC_CUDA_UUID_SIZE],
			  const uint8_t mem_handle[DLPC_CUDA_IPC_HANDLE_SIZE],
			  const uint8_t ev_handle[DLPC_CUDA_IPC_HANDLE_SIZE], void *stream,
			  bool defer, const char *name, struct dlpc__gpu_map **ret, void **base,
			  int *ordinal);
/*
 * Before attached device memory is unmapped and released: wait for the work the consumer queued
 * on it, on the legacy default stream, or on every stream of the context if @p all. Errors are
 * the driver's to keep (a deleter cannot fail). Only where dlpc__cuda_retire() cannot take the
 * region.
 */
void dlpc__cuda_release_sync(int ordinal, bool all);
/*
 * Let go of the attached device region @p r (its last view gone) once the consumer's work on it
 * is done, without waiting here: an event is recorded on the legacy default stream (or, for
 * r->sync_ctx, the context is synchronized) and a thread of the library's unmaps and releases
 * when it completes (cuda.c). No stream of the consumer's is used. false when that cannot be
 * arranged (no driver, a forked child, no memory or thread): the caller then lets go itself.
 */
bool dlpc__cuda_retire(struct dlpc__region *r);
/*
 * Does the legacy default stream follow the work queued on the consumer's @p stream (NULL, the
 * special handles, a blocking stream)? false for a non-blocking stream or one whose flags
 * cannot be read. Only while @p stream is known to be valid: in the call it was passed to.
 */
bool dlpc__cuda_stream_followed(void *stream);
/* How often the library's retiring thread looks at consumer work still running (ms). */
#define DLPC_CUDA_RETIRE_POLL_MS 1
/* The end of a region's teardown, once its memory is unmapped: release it, free it. */
void dlpc__region_finish(struct dlpc__region *r);
/* The consumer was ordered on @p stream (valid now, perhaps not later): note for
 * dlpc__cuda_retire() whether the legacy default stream follows it; the handle is not kept. */
void dlpc__region_note_stream(struct dlpc__region *r, void *stream);
/* Order @p stream (NULL: this thread) on device @p ordinal after the event @p ev_handle. */
int dlpc__cuda_wait(const uint8_t ev_handle[DLPC_CUDA_IPC_HANDLE_SIZE], int ordinal, void *stream,
		    const char *what);
/* Copy @p n device buffers (srcs[i], sizes[i] bytes) to @p dst + offsets[i] on device
 * @p ordinal, and wait on the host until they are done. Errors name @p what. */
int dlpc__cuda_gather(int ordinal, void *dst, size_t n, const uint64_t offsets[],
		      const void *const srcs[], const size_t sizes[], const char *what);
/* Allocate @p nbytes of VMM memory on device @p ordinal, exportable as the fd *@p fd; errors
 * name @p what. */
int dlpc__cuda_vmm_alloc(int ordinal, uint64_t nbytes, struct dlpc__gpu_map **ret, void **base,
			 size_t *len, int *fd, uint8_t uuid[DLPC_CUDA_UUID_SIZE], const char *what);
/* Import the VMM export @p fd (not consumed) of @p size bytes and map it read-write. */
int dlpc__cuda_vmm_import(int fd, uint64_t size, const uint8_t uuid[DLPC_CUDA_UUID_SIZE],
			  bool writable, const char *name, struct dlpc__gpu_map **ret, void **base,
			  int *ordinal);
/* 0 if this process may use the CUDA driver: loaded, and not a forked child of the process
 * that started it (-EBADFD, message naming @p what). Loads it. */
int dlpc__cuda_check(const char *what);
/* Drop one use of @p m: the last closes the IPC handle or unmaps the VMM range. */
void dlpc__cuda_unmap(struct dlpc__gpu_map *m);

#endif
