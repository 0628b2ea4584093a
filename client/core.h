/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libdlpc's connection core: a client's life and its tables (conn.c), its writes besides
 * requests and the write lock (write.c), the reader's turn (reader.c), calls and connecting
 * (call.c), the library's thread (loop.c, serve.c). Features
 * hang off it through the tables (struct dlpc__notice, struct dlpc__hooks); it names none.
 */
#ifndef DLPC_CLIENT_CORE_H
#define DLPC_CLIENT_CORE_H

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <time.h>

#include <dlpc/dlpc.h>

#include "base.h"
#include "cache.h" /* its state lives in the client, under a lock of its own */
#include "io.h"
#include "limits.h"
#include "msg.h"

/* A request waiting for its reply (call.c; matched by the reader, reader.c). Lives on its
 * caller's stack. */
struct dlpc__call {
	struct dlpc__call *next;
	uint32_t id;
	bool done;
	bool canceled; /* by dlpc_close(): already unlinked, its id abandoned */
	uint16_t type;
	uint8_t *payload;
	size_t len;
	int fds[DLPC_FRAME_FDS_MAX];
	unsigned nfds;
	unsigned lost;	   /* fds of the reply this process had no room for */
	uint64_t conn_seq; /* the connection (c->conn_seq) the request went out on */
};
/*
 * One connection. Requests may come from many threads: each sends its frame under wmu, then
 * waits for the reply carrying its id. Whichever waiting thread finds nobody reading becomes
 * the reader until some reply arrives or its own deadline passes, handing replies to their
 * callers (leader/follower). The library's own thread (loop.c, serve.c) flushes deferred
 * releases, and takes the reader's turn without waiting to act on RECLAIM and INVALIDATE frames.
 *
 * The struct is refcounted: the user's handle counts once, each attached mapping once, and each
 * call in progress once (so dlpc_close() from another thread cannot free it under a waiting
 * caller). The socket closes when the last goes, so deleters keep working after dlpc_close().
 * Lock order: wmu before mu, never the other way; then the list of open clients' lock
 * (conn.c); and mu before the mu of the connection being made anew (connecting). pmu is a
 * leaf: taken under any of them, none under it.
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
	struct dlpc__call *calls;
	/* ids of requests whose callers stopped waiting (deadline passed, or dlpc_close()): their
	 * replies are dropped when they come, an ATTACH reply's reference released */
	uint32_t *abandoned;
	size_t nabandoned, abandoned_cap;
	/* legacy CUDA IPC publications awaiting their RECLAIM notice, the tokens of notices
	 * received but not yet acted on, and whether the library's thread holds the client to
	 * read them (serve.c) */
	unsigned ipc_pubs; /* of this connection (c->conn_seq): counted as their PUBLISH goes out */
	uint64_t *reclaimed;
	size_t nreclaimed, reclaimed_cap;
	atomic_bool reclaimer; /* (also read without mu: dlpc__clients_ref()) */
	int wake_fd;	       /* eventfd that ends the reader's wait for the socket (dlpc_close) */
	char fatal[256];       /* the daemon's last word (an ERROR with id 0), if any */
	int fatal_code;	       /* and its errno, positive */
	struct dlpc__rx rx;    /* used only by the current reader */

	pthread_mutex_t wmu; /* serializes writes; protects out */
	struct dlpc__scratch out;
	/*
	 * References released by deleters but not yet told to the daemon (dlpc__release_ref), and
	 * the cache's marks, under pmu: a lock of their own, never held across a write, so that a
	 * deleter queues without waiting for a write of another thread's (a send the daemon does
	 * not take). The first nsending are in the RELEASE frame that the holder of wmu is
	 * writing; they stay until it is gone. The queue grows past DLPC_RELEASE_PENDING_MAX
	 * (into the heap) only while its flush waits for a write (one stuck on a daemon that does
	 * not read): it is bounded by the references the connection holds, which the daemon
	 * bounds (DLPC_CONN_REFS_DEFAULT), a release and a mark each at most.
	 */
	pthread_mutex_t pmu;
	uint64_t *pending; /* pending_inline, or a larger array on the heap */
	unsigned pending_cap, nsending;
	atomic_uint npending; /* written under pmu; read without it as a hint */
	bool flush_asked;     /* a flush found wmu held: its holder flushes as it lets go */
	/* a flush that must not wait found the socket full: the library's thread polls it for
	 * room and flushes then (serve.c), rather than looking again and again */
	atomic_bool await_room;
	uint64_t pending_inline[DLPC_RELEASE_PENDING_MAX];
	/* CANCELs of waits given up on, under pmu: sent with the deferred releases, so that a call
	 * giving up never waits for another thread's write (dlpc__cancel_wait()) */
	uint32_t cancels[DLPC_CANCELS_PENDING_MAX];
	atomic_uint ncancels; /* written under pmu; read without it as a hint */

	struct dlpc_client *next_open; /* in the list of open clients (conn.c) */
	/* Under that list's lock: the library's thread holds a reference for its turn
	 * (dlpc__clients_ref()); dlpc_close() waits for that turn to let go (no later turn
	 * takes one), so that the connection is closed when it returns if nothing else holds it.
	 * The list's lock comes before the loop's (loop.c), never the other way. */
	bool turn_held, close_wait;

	/* DLPC_CONNECT_RECONNECT: a call that finds the connection lost connects anew first
	 * (dlpc__reconnect()). The fields below change under wmu and mu both. */
	bool reconnect;
	bool no_cache;	   /* DLPC_CONNECT_NO_CACHE */
	bool reconnecting; /* a thread is connecting anew: others fail as the lost connection did */
	/* the connection being made anew, until it replaces the lost one or fails: dlpc_close()
	 * and dlpc_cancel() cancel its HELLO too (under mu) */
	struct dlpc_client *connecting;
	/* the connection's number: how many were made before it (dlpc_reconnects()); a reference,
	 * a call, a cache entry or a channel's endpoint names the one it came by (changes under
	 * pmu too: a release is queued for the connection it names) */
	uint64_t conn_seq;
	char path[108];		 /* the socket, to connect to again */
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

/* Bumped in every forked child (pthread_atfork): a client whose fork_gen differs is not ours.
 * Comparing it costs nothing, where getpid() is a system call on every attach and release. */
extern unsigned dlpc__fork_gen;

/* Is @p c usable in this process? */
static inline bool dlpc__ours(const dlpc_client *c)
{
	return c->fork_gen == __atomic_load_n(&dlpc__fork_gen, __ATOMIC_RELAXED);
}

/* ---- conn.c: a dlpc_client's life, the tables ---- */
/* A new client, its socket made (not connected) and listed for fork, calls bounded by @p timeout
 * ms: 0, or a negative errno with the message set. */
int dlpc__client_new(int64_t timeout, dlpc_client **ret);
/* @p c's lost connection is replaced by @p n's, just connected (HELLO done): the sockets and
 * buffers change places (n takes the old ones, to be freed), what belonged to the old connection
 * is void, its count (c->conn_seq) goes up and the features reset. */
void dlpc__client_adopt(dlpc_client *c, dlpc_client *n);
void dlpc__client_ref(dlpc_client *c);
void dlpc__client_unref(dlpc_client *c);
/* dlpc__client_unref() by the library's thread, of the references it took itself
 * (dlpc__clients_ref(), @p turn as it was taken): no wake-up of that thread (which is about to
 * look again anyway). */
void dlpc__client_unref_looked(dlpc_client *c, bool turn);
/* dlpc__client_unref() of the user's handle by dlpc_close(): when only the library's thread's
 * turn holds @p c besides, wait for the turn to let go first, so that @p c is freed (its
 * connection closed) before this returns. */
void dlpc__client_unref_closed(dlpc_client *c);
/* The lock of the open clients' list, which fork() takes. */
void dlpc__list_lock(void);
void dlpc__list_unlock(void);
/* Every open client of this process, each referenced (unref each), into *@p buf of *@p cap
 * (grown as needed; the caller's to keep or free). Their number. With @p turn, the references
 * are the library's thread's turn's, which dlpc_close() waits for: taken only for work that
 * never waits for the user's code, and not of a client dlpc_close() waits for. Without, only
 * the clients whose reclaims the thread serves (their connections stay open anyway): for the
 * deleters of reclaimed publications, the user's code. */
size_t dlpc__clients_ref(dlpc_client ***buf, size_t *cap, bool turn);
/* Count a legacy CUDA IPC publication of @p c's connection @p conn_seq until its RECLAIM notice
 * (or, with -1, take a failed one back); nothing once @p c has connected anew since: the count
 * went with that connection. */
void dlpc__reclaim_count(dlpc_client *c, int delta, uint64_t conn_seq);
/* ---- write.c: writes besides requests (deferred releases, marks, CANCELs), the write lock ---- */
/* Tags of the ids in c->pending besides releases: a RELEASE mark (protocol 1.7). */
#define DLPC__MARK_CACHED (1ull << 63)
#define DLPC__MARK_USED (1ull << 62)
/* Frame the first DLPC_RELEASE_PENDING_MAX at most of @p c's deferred releases at offset 0 of
 * c->out, and count them as being sent until dlpc__pending_sent(). Length, 0 when none is
 * pending, or negative errno (none counted). Under wmu. */
ssize_t dlpc__pending_frame(dlpc_client *c);
/* The frame of dlpc__pending_frame() left, or the connection is gone (@p gone: they leave the
 * queue), or nothing of it left (they stay, for the next try). Under wmu. */
void dlpc__pending_sent(dlpc_client *c, bool gone);
/* Forget every deferred release and queued CANCEL: the connection they name is gone (write.c).
 * Under pmu, with wmu held. */
void dlpc__pending_drop(dlpc_client *c);
/* How dlpc__flush_locked() writes: as a request's own flush, waiting for room up to the
 * request's deadline or until dlpc_cancel() or dlpc_close(); or only while the socket has room,
 * leaving the rest to the library's thread (it never waits: for deleters, the library's thread,
 * a holder of wmu flushing for others, dlpc_close()). */
enum dlpc__flush { DLPC__FLUSH_CANCELABLE, DLPC__FLUSH_NOWAIT };
/* Send @p c's deferred releases now (write.c), a CANCELABLE flush within the deadline @p dl of
 * the request it goes in front of (dlpc__write_ms()). Under wmu, without c->mu. */
void dlpc__flush_locked(dlpc_client *c, enum dlpc__flush how, const struct timespec *dl);
/* Was dlpc_cancel() or dlpc_close() called on @p c? Without c->mu (under wmu or not: wmu comes
 * before c->mu). */
bool dlpc__closed(dlpc_client *c);
/* How long a write may wait for room in @p c's socket: until @p dl, the deadline of the call it
 * is for (NULL: none), and at most the call timeout, so that a call that may wait for ever
 * still finds a daemon that does not read. <= 0: no bound. */
int64_t dlpc__write_ms(const dlpc_client *c, const struct timespec *dl);
/* Write a frame (@p len bytes of @p data, with @p nfds fds) to @p c's socket within
 * dlpc__write_ms(@p c, @p dl), all of it (dlpc__send_within(); *@p sent: what left), or, if
 * @p cancelable (a request's), until dlpc_cancel() or dlpc_close() (-ECANCELED). A frame cut
 * short leaves the stream broken: the socket is shut for writing at once, so that nothing more
 * lands in it and the daemon drops the connection now, not at its frame timeout. Under wmu,
 * without c->mu. */
int dlpc__send_frame(dlpc_client *c, const void *data, size_t len, const int *fds, unsigned nfds,
		     const struct timespec *dl, bool cancelable, size_t *sent);
/* Let go of c->wmu: every holder does so through this. A flush that found it held (a deleter's,
 * the library's thread's: dlpc__flush_nowait()) was left to the holder, which sends the
 * releases first. Without c->mu. */
void dlpc__write_unlock(dlpc_client *c);
/* Let go of c->wmu after the holder's own write failed (out of time, or the stream cut): a
 * flush left to it is not done on its thread, which would wait for the same stuck socket
 * again, but left to the library's thread (or the next holder). Without c->mu. */
void dlpc__write_unlock_failed(dlpc_client *c);
/* Send @p c's deferred releases and queued CANCELs now if no other thread writes, else have the
 * writer send them as it lets go of c->wmu: never waits for it. Without any lock of c's. */
void dlpc__flush_nowait(dlpc_client *c);
/* The caller stopped waiting for the reply to request @p id (@p type) of connection @p conn_seq
 * (its deadline passed, it was canceled or interrupted): if the request may wait in the daemon
 * (ATTACH, RECV, SEND), tell it (CANCEL, 1.9), so that the wait ends there instead of when the
 * connection closes: at once if the socket has room and no other thread writes, else queued
 * (DLPC_CANCELS_PENDING_MAX) for the writer as it lets go, or the library's thread. Never waits.
 * Its ECANCELED reply is dropped as any late one. Not under c->mu or c->wmu. */
void dlpc__cancel_wait(dlpc_client *c, uint16_t type, uint32_t id, uint64_t conn_seq);
/* End the reader's wait for the socket: it then looks at the state of its call again. */
void dlpc__wake_reader(dlpc_client *c);
/*
 * Fire-and-forget RELEASE of one reference, which came by connection @p conn_seq: dropped if the
 * client has connected anew since (that connection, and the reference with it, is gone); does
 * nothing in a forked child. The id waits in c->pending and goes out with the connection's next
 * request, or after DLPC_RELEASE_DELAY_MS through the library's thread (loop.c), whichever comes
 * first. Waits for no write (a deleter runs it from any thread); only where the library's
 * thread cannot run does it write, when no other thread does.
 */
void dlpc__release_ref(dlpc_client *c, uint64_t ref_id, uint64_t conn_seq);
/* Queue a RELEASE mark of reference @p ref_id of connection @p conn_seq: idle in the cache
 * (@p cached) or in use again. */
void dlpc__mark_ref(dlpc_client *c, uint64_t ref_id, uint64_t conn_seq, bool cached);

/* ---- the connection core's two tables: how features hang off a connection ---- */
/*
 * A notice: a frame with id 0 that a feature acts on (INVALIDATE: the cache). @p take runs on
 * the reader, under c->mu: 0 when the frame counts as delivered (it ends the reader's wait as a
 * reply does), 1 when it does not, or a negative errno that ends the connection. @p after (NULL:
 * none) runs next on the reader, with no lock of c's held, whatever @p take returned.
 */
struct dlpc__notice {
	uint16_t type;
	int (*take)(dlpc_client *c, const struct dlpc__frame *f);
	void (*after)(dlpc_client *c);
};

/*
 * What a feature does at a connection's turning points (reset, fork, close, free) and for the
 * library's thread. Every slot may be NULL. The core calls the registered tables in the order
 * they were registered, each feature keeping its own state and lock; it names no feature.
 */
struct dlpc__hooks {
	/* a new dlpc_client, before it connects: set up the feature's state (its lock) */
	void (*init)(dlpc_client *c);
	/* @p c connected anew (dlpc__reconnect()): under c->wmu and c->mu ... */
	void (*reset_locked)(dlpc_client *c);
	/* ... then with no lock of c's held: what belonged to the old connection goes */
	void (*reset)(dlpc_client *c);
	/* dlpc_close() in the process that connected, no lock held */
	void (*close)(dlpc_client *c);
	/* dlpc_close() or dlpc_cancel(), under c->mu: end the feature's own waits at once */
	void (*cancel)(dlpc_client *c);
	/* the last reference on @p c went: nothing uses it any more, free what the feature holds */
	void (*free)(dlpc_client *c);
	/* fork(), for each open client, under the open clients' list's lock: @p phase 0 before
	 * (take the feature's locks), 1 in the parent after (let go), 2 in the child (start
	 * afresh, letting go of the parent's fds) */
	void (*fork)(dlpc_client *c, int phase);
	/* fork(), once for the process: after the clients' (phase 0 and 2), before them (1) */
	void (*atfork)(int phase);
	/* the process's last open client went */
	void (*last_client)(void);
	/* the library's thread: should it read @p c's socket when no call does? Under c->mu. */
	bool (*wants_reading)(dlpc_client *c);
	/* the library's thread, when a sweep is due (dlpc__sweep_at()): let go of what has been idle
	 * too long; the monotonic ms when the next is due, or 0 */
	int64_t (*sweep)(dlpc_client *c);
	/* a RECLAIM notice's @p token, under c->mu: true when it is the feature's, and dealt with */
	bool (*reclaimed)(dlpc_client *c, uint64_t token);
	/* the library's thread, no lock held: run the deleter of the publication of @p token; true
	 * when it was the feature's */
	bool (*reclaim_run)(uint64_t token);
};

/* How many features may register (DLPC__NOTICES_MAX: notices). */
#define DLPC__HOOKS_MAX 8
#define DLPC__NOTICES_MAX 4
/* Register a feature's table (static, never freed), before the first connection (client.c). */
void dlpc__hooks_add(const struct dlpc__hooks *h);
void dlpc__notice_add(const struct dlpc__notice *n);
/* The notice registered for frames of @p type, or NULL. */
const struct dlpc__notice *dlpc__notice_find(uint16_t type);
/* Call slot @p slot of every registered table that has one, with @p c. */
#define DLPC__HOOKS_RUN(slot, ...)                                                                 \
	do {                                                                                       \
		for (size_t hook_i_ = 0; hook_i_ < dlpc__nhooks; hook_i_++)                        \
			if (dlpc__hooks[hook_i_]->slot)                                            \
				dlpc__hooks[hook_i_]->slot(__VA_ARGS__);                           \
	} while (0)
/* The registered tables (for DLPC__HOOKS_RUN()). */
extern const struct dlpc__hooks *dlpc__hooks[DLPC__HOOKS_MAX];
extern size_t dlpc__nhooks;

/* ---- reader.c: the reader's turn ---- */
/* Remember that nobody waits for the reply to @p id any more. false if out of memory. Under
 * c->mu. */
bool dlpc__abandon(dlpc_client *c, uint32_t id);
/* Was the reply to @p id abandoned? Unless @p keep, forget the id then (its reply has come).
 * Under c->mu. */
bool dlpc__take_abandoned(dlpc_client *c, uint32_t id, bool keep);
/* The reference an ATTACH or RECV reply grants (to be released by whoever cannot use it), or 0. */
uint64_t dlpc__reply_ref(uint16_t type, const uint8_t *payload, size_t len);
/* The connection is gone: say why, in the daemon's words when it left some. Under c->mu. */
int dlpc__conn_error(dlpc_client *c, int err);
/* A call starts: the thread's interrupt check is next due in DLPC_INTERRUPT_CHECK_MS. */
void dlpc__interrupt_arm(void);
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
/* Read what @p c's socket holds without waiting, delivering it, if no other thread reads it:
 * 1; 0 when another does (or the connection is lost, or closed unless @p closed_ok). */
int dlpc__drain(dlpc_client *c, bool closed_ok);
/* Wait @p ms for a lost connection's daemon to come back: 0, or -ECANCELED (dlpc_close(),
 * dlpc_cancel()) or -EINTR (the thread's interrupt check said stop), the message set. */
int dlpc__pause_lost(dlpc_client *c, int64_t ms);

/* ---- call.c: calls, connecting ---- */
/* What one request says besides its result (dlpc__call_ex()). */
struct dlpc__call_info {
	/* in: the request lends memory that the daemon gives back by RECLAIM (legacy CUDA IPC, a
	 * lent VMM fd): it is counted in c->ipc_pubs as it goes out, on the connection it goes
	 * out on, so that a count never outlives its connection */
	bool lend;
	/* out: the request went out (or may have) on connection @p conn_seq (c->conn_seq then): what it
	 * made, a reference or a lent publication, belongs to that connection */
	bool sent;
	uint64_t conn_seq;
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
 * c->call_timeout_ms (-ETIMEDOUT); -ECANCELED once dlpc_close() or dlpc_cancel() was called;
 * -EMFILE when the reply's fds could not be received (an ATTACH reply's reference is released).
 * After these the connection stays usable: a reply that comes later is dropped.
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
/* A new connection to @p path, HELLO done, with calls bounded by @p timeout ms. For
 * dlpc__reconnect() of @p parent (NULL: dlpc_connect()), connect() waits at most @p connect_ms and
 * HELLO @p hello_ms, and dlpc_close() or dlpc_cancel() of @p parent cancels the HELLO. */
int dlpc__connect_new(const char *path, int64_t timeout, dlpc_client *parent, int64_t connect_ms,
		      int64_t hello_ms, dlpc_client **ret);
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

/* ---- loop.c: when the library's thread runs, and what wakes it ---- */
/* How soon the loop looks again at a socket whose reader's turn another thread held (ms). */
#define DLPC__LOOP_BUSY_MS 10
/* What the thread does, turn after turn (serve.c); set before the first connection. */
void dlpc__loop_init(void (*turn)(void));
/* Start the thread unless it runs, and wake it. false when it cannot run. */
bool dlpc__loop_start(void);
/* The poll() timeout until the next deadline (-1: none), and what is due now (taken). */
int dlpc__loop_due(bool *flush, bool *sweep);
/* Wait until woken, @p timeout ms (< 0: no bound) pass or, when @p np > 1, one of the sockets
 * p[1..@p np) is ready (p[0] is set to the loop's wake-up). How many entries of @p p to look at
 * for revents (0: none). */
size_t dlpc__loop_wait(struct pollfd *p, size_t np, int timeout);
/* The turn has looked at everything: a wake-up before now is spent. */
void dlpc__loop_looked(void);
/* Make sure the thread will send deferred releases soon: within DLPC_RELEASE_DELAY_MS, or at
 * once when @p now. false when it cannot run. */
bool dlpc__loop_flush_soon(bool now);
/* Have the thread look at everything again now (async-signal-safe, any lock held). */
void dlpc__loop_wake(void);
/* Is the caller the library's thread? */
bool dlpc__loop_is_self(void);
/* fork(): 0 before (lock), 1 in the parent after, 2 in the child (start afresh). */
void dlpc__loop_atfork(int phase);
/* Have the library's thread sweep the caches at monotonic ms @p when; false when
 * that thread cannot run (a process at its thread limit). */
bool dlpc__sweep_at(int64_t when);

/* ---- serve.c: the library's thread's turn ---- */
/* Hand the thread its turn (dlpc__loop_init()). */
void dlpc__serve_register(void);
/* Have the library's thread watch @p c: it reads the connection whenever no request
 * does, so that RECLAIM notices are acted on while the process makes no calls, and holds a
 * reference on @p c until the last publication is reclaimed or the connection is lost. */
void dlpc__reclaim_start(dlpc_client *c);

#endif
