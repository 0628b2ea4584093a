/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The daemon's state: the server and its connections (peers). Definitions only; the functions
 * that work on them live in server.c (the listener), peer.c (a connection's transport),
 * dispatch.c (reading requests, and the one place a connection is destroyed) and names.c.
 *
 * A connection ends in two steps. Whatever finds it broken or misbehaving marks it
 * (dlpd_peer_fail(): a sticky error, after which it reads nothing and is sent nothing new);
 * dispatch.c destroys marked connections once the code that marked them has returned to the
 * event loop: at the end of the socket event being handled, or, for a mark made by a timer,
 * before the loop next waits for I/O. Nothing that runs during a request, a send or a registry
 * change ever sees a connection vanish, and the next event handled finds it gone.
 */
#ifndef DLPD_STATE_H
#define DLPD_STATE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "base.h"
#include "config.h"
#include "io.h"
#include "msg.h"
#include "registry.h"

struct dlpd_stats {
	uint64_t req[DLPC_MSG__REQUEST_COUNT];
	uint64_t fds_sent;
	uint64_t protocol_errors;
	uint64_t queue_drops;	/* connections dropped for a full output queue */
	uint64_t invalidations; /* INVALIDATE frames sent (invalidate.c) */
};

/* Entries that outlive the daemon (persist.c). */
struct dlpd_persist {
	uint64_t store_max;	  /* fds the service manager keeps for us (--fd-store); 0: none */
	uint64_t storages_stored; /* storage fds of ours in the store */
	int journal_fd;		  /* the state journal, -1 without a store */
	/* the journal's generation: its name in the store is state-<journal_gen> */
	uint64_t journal_gen;
	uint64_t journal_len; /* bytes written */
	uint64_t live_len;    /* of them, records of entries that still exist */
	uint64_t next_sid;    /* the last storage id given */
	bool broken;	      /* the store or the journal failed: nothing more is recorded */
	bool warned_full;
	uint8_t *rec; /* a record is built here */
	size_t rec_cap;
};

struct dlpd_server {
	uv_loop_t *loop;
	int listen_fd;
	int lock_fd;
	char *path, *lock_path;
	bool owns_path; /* bound by us, not passed by systemd: unlink it at stop */
	bool listening; /* the handles below are set up (dlpd_server_start() got this far) */
	uv_poll_t listen_poll;
	uv_timer_t accept_retry;		/* resumes accepting after EMFILE */
	bool accept_paused;			/* accept failed and has not succeeded since */
	uv_signal_t sig_term, sig_int, sig_hup; /* SIGHUP: upgrade in place (upgrade.c) */
	struct dlpd_list peers;	    /* live connections, and marked ones not yet destroyed */
	struct dlpd_list failed;    /* marked connections, not yet destroyed */
	struct dlpd_list lingering; /* destroyed, flushing their last frames (fail_link) */
	uv_prepare_t teardown;	    /* destroys them before every wait for I/O (dispatch.c) */
	uv_poll_cb peer_io;	    /* dispatch.c's handler of a connection's socket events */
	uint64_t npeers, next_serial;
	uint64_t peers_closing; /* destroyed, socket not yet handed to the reaper */
	uint64_t channel_fds;	/* the ends of direct channels (two each) */
	uint64_t tx_fds;	/* copies of fds in replies queued for connections (mem.c) */
	uint64_t rx_fds;	/* fds received for frames not yet complete (mem.c) */
	uint64_t unread_fds;	/* fds in flight to connections that may not have taken them */
	/* the sockets of destroyed connections with fds in flight to them, kept open until the
	 * client took those or closed its end (peer.c), and the timer that looks at them */
	struct dlpd_list drains;
	uint64_t draining;
	uv_timer_t drain_timer;
	struct dlpd_registry reg;
	struct dlpc__scratch out;	/* outgoing frames are packed here */
	struct dlpd_list watchers;	/* peers that sent WATCH, in the order they did */
	struct dlpd_list reclaimers;	/* peers with RECLAIM notices to send (reclaim.c) */
	uv_timer_t reclaim_timer;	/* sends them on the next loop turn */
	uv_timer_t mem_trim;		/* gives freed memory back (mem.c) */
	uv_check_t mem_check;		/* counts what the registry freed (mem.c) */
	uint64_t mem_freed;		/* bytes freed since the last time it did */
	uint64_t mem_trimmed_ms;	/* loop time it last did */
	uint64_t nwatchers, event_seq;	/* event_seq: changes of the name map so far */
	struct dlpc__scratch event_out; /* an event is packed here once for every watcher */
	struct dlpd_stats stats;
	uint64_t inval_seq; /* invalidations so far (invalidate.c), to tell each peer once */
	struct dlpd_limits lim;
	/* storages + connections allowed: RLIMIT_NOFILE less fds_own and DLPC_FD_RESERVE */
	uint64_t fd_budget;
	uint64_t fds_own;  /* the daemon's own fds when it started serving (server.c) */
	uint64_t fd_limit; /* RLIMIT_NOFILE then, UINT64_MAX for none */
	uint64_t start_ms;
	struct dlpd_persist persist;
	char *self_exe; /* upgrade.c: the binary to execute again, resolved at start */
	bool stopping;
	bool upgrading; /* stopping to execute the binary again (upgrade.c) */
};

/*
 * Where a connection is in its life; it only ever moves down this list (LINGERING only for one
 * with frames left to flush). What may happen at any step is kept apart, in dlpd_peer: it sent
 * WATCH (watching), it shut down its sending side (hup), its socket failed (broken).
 */
enum dlpd_conn_state {
	DLPD_CONN_GREETING,  /* accepted: only HELLO is served, due within the frame deadline */
	DLPD_CONN_SERVING,   /* said HELLO: its requests are served */
	DLPD_CONN_MARKED,    /* dlpd_peer_fail(): reads nothing, takes no new frames, waits in
			      * srv->failed to be destroyed (dispatch.c) */
	DLPD_CONN_LINGERING, /* destroyed, flushing its last frames (an ERROR) within a bound */
};

/* The kept socket of a destroyed connection with fds in flight to it (peer.c). */
struct dlpd_drain {
	struct dlpd_list link; /* in srv->drains */
	int fd;
	uid_t uid;
	struct dlpd_usage *usage;
	unsigned fds; /* in flight to it */
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
	enum dlpd_conn_state state;
	bool broken;   /* its socket failed, or its queue overflowed: nothing more is written */
	bool hup;      /* it shut down its sending side: its buffered requests are still served */
	bool watching; /* sent WATCH: receives events, sends nothing but RELEASE (until it is
			 * destroyed, marked or not: dlpd_watch_drop()) */
	uint64_t inval_seen; /* the last invalidation it was sent (srv->inval_seq), invalidate.c */
	struct dlpd_list watch_link; /* in srv->watchers */
	struct dlpd_list fail_link;  /* in srv->failed while marked, then in srv->lingering */
	size_t watch_prefix_len;
	uint8_t watch_prefix[DLPC_NAME_MAX];
	/* The frame deadline: armed when a read leaves part of a frame buffered (or at accept,
	 * for HELLO), never for frames that arrive whole. Once lingering, the flush bound. */
	uv_timer_t deadline;
	uint64_t frames_done;	/* complete frames read */
	uint64_t partial_frame; /* frames_done when the buffered partial frame began */
	uint64_t partial_since; /* loop time (ms) it began */
	unsigned
		handles_open; /* poll, deadline and unread_timer, until their uv_close() callbacks */
	struct dlpc__rx rx;
	size_t rx_charged; /* rx's buffer, as charged to its uid (mem.c) */
	size_t tx_charged; /* tx's queued bytes, the same */
	unsigned tx_fds;   /* tx's queued fds (copies the daemon holds), as counted (mem.c) */
	unsigned rx_fds;   /* fds rx holds for frames not yet complete, as counted (mem.c) */
	/* fds written to its socket that it may not have taken yet, as counted (peer.c), the
	 * tx.fds_sent they were counted at, and the look for what it took while frames with fds
	 * wait for it (every unread_wait_ms, doubling) */
	unsigned unread_fds;
	uint64_t unread_counted; /* tx.fds_sent when counted */
	uv_timer_t unread_timer;
	unsigned unread_wait_ms;
	/* while it waits: its socket's send queue (SIOCOUTQ) at the last look, and the loop time
	 * (ms) since which that has not changed (0: not waiting) */
	int unread_q;
	uint64_t unread_still_since;
	bool unread_writes;	  /* the timer runs only for that look: it is polled for room */
	struct dlpd_drain *drain; /* destroyed with fds in flight: its socket is kept (peer.c) */
	struct dlpc__tx tx;
	struct dlpd_holdings held; /* references, ephemeral entries, waiting attaches */
	uint64_t *
		reclaims; /* tokens of its lent storages (held.lent), freed but not yet told (reclaim.c) */
	size_t nreclaims, reclaims_cap;
	struct dlpd_list reclaim_link; /* in srv->reclaimers while nreclaims > 0 */
	struct dlpd_list link;	       /* in srv->peers */
};

/* Was @p p marked (dlpd_peer_fail()), lingering or not? Then nothing new is done for it. */
static inline bool dlpd_peer_marked(const struct dlpd_peer *p)
{
	return p->state >= DLPD_CONN_MARKED;
}

/* An ATTACH waiting for its name: the registry's record (w) and the connection's side. */
struct dlpd_attach_wait {
	struct dlpd_waiter w;
	struct dlpd_peer *peer; /* to be answered */
	bool timed;		/* timer runs (w.timeout_ms > 0) */
	uv_timer_t timer;
};

/* The wait whose w.peer_link is @p l (in holdings.waiters). */
static inline struct dlpd_attach_wait *dlpd_attach_wait_of(struct dlpd_list *l)
{
	return dlpd_container_of(dlpd_container_of(l, struct dlpd_waiter, peer_link),
				 struct dlpd_attach_wait, w);
}

#endif
