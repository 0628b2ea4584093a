/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Every limit of the wire protocol, in one place. The daemon and libdlpc check these before
 * allocating anything a peer asked for; the unit suites (tests/unit), the hostile-client tests
 * (tests/integration/test_hostile.c) and the quota tests (tests/integration/test_limits.c)
 * exercise each one.
 */
#ifndef DLPC_PROTO_LIMITS_H
#define DLPC_PROTO_LIMITS_H

#include <dlpc/dlpc.h>

/* Protocol version spoken by this tree, the only one: the daemon and libdlpc ship together, so
 * HELLO refuses a peer of any other version, major or minor, both ways (docs/protocol.md,
 * section 3), with a text that names both versions and ends with DLPC_PROTO_MISMATCH_ADVICE. */
#define DLPC_PROTO_MAJOR 1
#define DLPC_PROTO_MINOR 12
#define DLPC_PROTO_MISMATCH_ADVICE                                                                 \
	"libdlpc and dlpackd must come from the same build: after an upgrade, restart dlpackd "    \
	"(dlpackctl upgrade) and the programs that use libdlpc"

/* A direct channel's record (1.8, direct.h): its size, bytes, every message one of these. */
#define DLPC_DIRECT_RECORD 1024
/* Channels one libdlpc connection remembers (a direct one holds its two socket ends): the least
 * recently joined one not in use is forgotten beyond this. */
#define DLPC_DIRECT_ENDPOINTS_MAX 64
/* fds a process's libdlpc may hold that senders on direct channels sent and it refused, waiting
 * for its one closer thread (whose close() may never return: a file on a stalled FUSE server, a
 * socket holding such a file or a lingering socket in flight). A receive that refuses fds and
 * leaves this many waiting bars its channel: the channel is not read (-EMFILE naming it and the
 * bound) until fewer wait, while other channels go on. A receive takes a datagram whole, up to
 * 253 fds (SCM_MAX_FD) and a pidfd, so a process holds at most this many plus 254 for each
 * channel it receives from. */
#define DLPC_CLOSING_MAX 64
/* How often a sender waiting for room in a full direct channel tries again, ms: the kernel
 * wakes writers of a Unix datagram socket only once its buffer is three quarters free. */
#define DLPC_DIRECT_RETRY_MS 1

/* libdlpc's warm pool (client/warm.c): the most recent sizes it keeps memfds ready for, how
 * many of one size, the most memfds it keeps ready in all (every size at that depth), and the
 * longest $DLPC_WARM_IDLE_MS it honours. */
#define DLPC__WARM_SIZES_MAX 8
#define DLPC__WARM_DEPTH_MAX 2
#define DLPC__WARM_FDS_MAX (DLPC__WARM_SIZES_MAX * DLPC__WARM_DEPTH_MAX)
#define DLPC__WARM_IDLE_MS_MAX 3600000
/* From this many bytes a warm memfd is kept mapped in the process, its pages faulted in, and the
 * copy path copies into the mapping (then unmaps it, before the seal) instead of write(): past
 * a few MiB that saves the page cache's per-page work of write() even with the unmap's cost
 * (bench_c --only publish); below it write() is as fast and maps nothing. */
#define DLPC__WARM_MAP_MIN (8u << 20)
/* ...and is kept mapped only while its memory cgroups have this many bytes of room besides: the
 * page tables of the mapping are charged to them, and a charge that fails in a page fault calls
 * the OOM killer where fallocate() or write() only fail. In a tighter cgroup the pool holds its
 * memfds unmapped and the copy path writes them with write(). */
#define DLPC__WARM_MAP_ROOM (1ull << 30)
/* What libdlpc leaves of a memory cgroup's room when it allocates shared memory: a storage is
 * refused (ENOSPC) unless this much is left besides. The room is read before the allocation; the
 * process's other threads (and its own mallocs, its page tables, the runtime under it) take
 * memory meanwhile and after, and one page too many is the cgroup's OOM killer, not an error. */
#define DLPC__ROOM_RESERVE (4u << 20)
/* A memfd of S bytes is filled only while the memory cgroups have room for this many times S:
 * a publish that checked its room before the fill began (dlpc__size_fits()) still finds S
 * bytes for itself once the fill is done, instead of meeting the cgroup's limit (the OOM
 * killer) halfway through its write. In a cgroup without that much room the pool stays empty. */
#define DLPC__WARM_ROOM_FACTOR 2

/* A copy of the copy path through a mapping (fresh huge pages, or a warm memfd mapped) is split
 * over threads (client/split.c): at most this many, the caller's included... */
#define DLPC__SPLIT_THREADS_MAX 4
/* ...each given this many bytes at least: below, a thread's start and its share of the page
 * tables' lock cost about what it saves. */
#define DLPC__SPLIT_MIN (16u << 20)
/* An attach that populates its mapping of 4 KiB pages asks for one page per this many bytes:
 * each fault maps the pages around it as far as the kernel's fault-around reaches (64 KiB by
 * default), at about 0.6x the cost of populating every page in one call, and it is split over
 * threads as a copy is. Pages a smaller fault-around leaves are faulted in when first read. */
#define DLPC__POPULATE_STEP (64u << 10)

/* The longest socket path dlpackd binds itself, bytes: a socket address's 107 less the ".new"
 * of the name it binds first and renames onto the path once it listens (daemon/server.c), so
 * that the path never names a socket that refuses connections. */
#define DLPC_DAEMON_SOCKET_PATH_MAX 103

/* Size of the fixed frame header, bytes. */
#define DLPC_FRAME_HDR_SIZE 12
/* Largest frame payload (protobuf bytes after the header). */
#define DLPC_FRAME_MAX (8u << 20)
/* Most fds one frame may carry. */
#define DLPC_FRAME_FDS_MAX 4
/* Receive buffer of a connection; a larger frame grows it until drained. libdlpc keeps it between
 * frames; the daemon frees it whenever it holds no part of a frame. */
#define DLPC_RX_BUF_SIZE (16u << 10)
/* Name, key, ndim and bundle limits are public: see DLPC_NAME_MAX, DLPC_KEY_MAX, DLPC_NDIM_MAX,
 * DLPC_BUNDLE_MAX in dlpc.h. */
/* Every DLPC_PUBLISH_* flag this protocol version knows. */
#define DLPC_PUBLISH_FLAGS_ALL                                                                     \
	(DLPC_PUBLISH_REPLACE | DLPC_PUBLISH_EPHEMERAL | DLPC_PUBLISH_WRITABLE)
/* Room for a name or key in log and error text: every byte may become \xNN. */
#define DLPC_NAME_TEXT (DLPC_NAME_MAX * 4 + 1)

/* Most references one RELEASE frame may carry. */
#define DLPC_RELEASE_BATCH_MAX 1024
/*
 * libdlpc defers a RELEASE so that it rides in the same write as the connection's next request
 * (one daemon wake-up per attach instead of two). A connection holds at most
 * DLPC_RELEASE_PENDING_MAX deferred ids, and none longer than about DLPC_RELEASE_DELAY_MS: then
 * they go out on their own, a frame of at most DLPC_RELEASE_PENDING_MAX each. (More wait only
 * while a write of the connection's is stuck: a deleter never waits for it.)
 */
#define DLPC_RELEASE_PENDING_MAX 256
#define DLPC_RELEASE_DELAY_MS 5
/* How often a client's request stuck in a write (a daemon that does not read) looks whether
 * dlpc_cancel() or dlpc_close() was called meanwhile: it then gives up, and with it the
 * connection, whose stream it cut. */
#define DLPC_SEND_CHECK_MS 100
/* libdlpc: CANCELs of waits given up on (a timeout, dlpc_cancel(), an interrupt) that one
 * connection queues while another thread's write holds it (a daemon that does not read): they
 * go out with the deferred releases, once the write lets go. One more is dropped: that wait
 * then ends in the daemon with its own timeout, or with the connection. */
#define DLPC_CANCELS_PENDING_MAX 64
#if DLPC_RELEASE_PENDING_MAX > DLPC_RELEASE_BATCH_MAX
#error "deferred releases must fit one RELEASE frame"
#endif
/* Most publication tokens one RECLAIM notice carries (more go out in further frames). */
#define DLPC_RECLAIM_BATCH_MAX 1024
/* Sizes of the CUDA identifiers a PUBLISH carries: IPC memory and event handles, device UUID. */
#define DLPC_CUDA_IPC_HANDLE_SIZE 64
#define DLPC_CUDA_UUID_SIZE 16
/* libdlpc: interprocess CUDA events one process's legacy IPC publications hold at once (one
 * each, until reclaimed; drivers run out of them at a limit of their own). Past it a publish
 * waits on the host for the device's work and shares one event already complete. */
#define DLPC_CUDA_IPC_EVENTS_MAX 1000
/* libdlpc: CUDA devices it can use in one process (ordinals 0 to this - 1); one primary
 * context is kept for each it has used. */
#define DLPC_CUDA_DEVICES_MAX 64
/* Largest payload of a HELLO, ATTACH, UNPUBLISH, LIST, STAT or WATCH (a name and a few numbers). */
#define DLPC_SMALL_MSG_MAX 4096
/* Largest payload of a RELEASE: DLPC_RELEASE_BATCH_MAX ids of up to 10 bytes, plus framing. */
#define DLPC_RELEASE_MSG_MAX (DLPC_RELEASE_BATCH_MAX * 10 + 16)
/* Most entries in one LIST reply page (fewer when DLPC_FRAME_MAX is reached first). */
#define DLPC_LIST_PAGE_MAX 16384
/*
 * Most bytes the daemon keeps queued for one connection that does not read what it is sent;
 * past this the connection is dropped. Eight of the largest frames: a client with several
 * threads waiting for LIST pages at once stays well inside it.
 */
#define DLPC_TX_QUEUE_MAX (8 * DLPC_FRAME_MAX)
/* Most fds waiting in one connection's output queue (each ATTACH reply holds a duplicate). */
#define DLPC_TX_QUEUE_FDS_MAX 4096
/* Milliseconds the daemon keeps a connection it is dropping open so that what it was last sent
 * (the ERROR saying why) can leave; a client that does not read it by then loses it. */
#define DLPC_ERROR_LINGER_MS 1000
/* The same byte limit for a watching connection: events are small and a watcher that falls
 * this far behind is not keeping up. */
#define DLPC_WATCH_QUEUE_MAX (1u << 20)

/*
 * Defaults of the daemon's resource limits; each has a dlpackd flag (docs/security.md).
 * Every limit applies to root too. A request over a limit gets -EDQUOT and a message naming
 * the limit and its value.
 */
/* Bytes of storage one uid may hold: the declared storage sizes of its publications, counted
 * from publish until the storage is freed (a replaced or unpublished storage still referenced
 * by attachers still counts). --max-bytes-per-uid */
#define DLPC_UID_BYTES_DEFAULT (1ull << 40)
/* Names one uid may have published at once. --max-entries-per-uid */
#define DLPC_UID_ENTRIES_DEFAULT (1u << 20)
/* Bytes of the daemon's own memory that one uid may make it hold, whatever its number of
 * connections: its connections, its entries (the request that published each, its tensors as
 * attach replies carry them), the messages it queued in channels, its channels and the
 * references its connections hold, each charged with an estimate of what the daemon allocates
 * for it (registry.h, DLPD_*_COST), and its unfinished work (--max-pending-bytes-per-uid below,
 * which it includes). The default keeps any one uid within 64 MiB: about 85,000 entries of one
 * tensor, 500 of 500 tensors, or 700,000 references.
 * --max-memory-per-uid */
#define DLPC_UID_MEMORY_DEFAULT (64ull << 20)
/* Open connections of one uid. --max-connections-per-uid */
#define DLPC_UID_CONNECTIONS_DEFAULT 4096
/* References (attaches not yet released) one connection may hold. --max-refs-per-connection */
#define DLPC_CONN_REFS_DEFAULT 65536
/* Requests of one connection waiting for an answer (ATTACH waiting for a name).
 * --max-pending-per-connection */
#define DLPC_CONN_PENDING_DEFAULT 1024
/*
 * Bytes of the daemon's memory that one uid's unfinished work may hold, across all of its
 * connections: the receive buffers of frames not yet complete (a buffer grows to the frame's
 * size, up to DLPC_FRAME_MAX, as soon as its header has arrived) and its waiting requests
 * (ATTACH waiting for a name, SEND waiting for room, RECV waiting for a message), each counted
 * at what it costs the daemon, and the output queued for its connections that do not read. A
 * waiting request past it is refused with -EDQUOT; a connection whose frame would need more
 * buffer is sent that -EDQUOT and dropped, one whose output queue would pass it dropped. The
 * default bounds what a uid can make the daemon hold this way whatever its number of
 * connections; it counts against --max-memory-per-uid as well.
 * --max-pending-bytes-per-uid
 */
#define DLPC_UID_PENDING_BYTES_DEFAULT (32ull << 20)
/* Milliseconds a connection has to finish a frame it started, and to complete HELLO after
 * connecting. --frame-timeout-ms */
#define DLPC_FRAME_TIMEOUT_MS_DEFAULT 10000
/* fds the daemon keeps out of the storage budget beyond its own (those open when it starts
 * serving: listener, lock, event loop, reaper thread, fds it was started with): half for
 * connections past the budget, half for what it opens for a moment (closer processes' sockets
 * count in the budget). Storages and connections together may use RLIMIT_NOFILE minus its own
 * fds and this (STAT's fd_budget); a PUBLISH beyond that is refused. */
#define DLPC_FD_RESERVE 32
/* Percent of the fds for storages and connections (the fd budget, see DLPC_FD_RESERVE) that
 * one uid's storages and connections may hold, so that no uid can take the fds every other
 * uid needs to publish. --max-fd-share-per-uid */
#define DLPC_UID_FD_SHARE_DEFAULT 25
/* Closer processes (daemon/closer.c) at once: each closes the fds one uid sent, so that a close
 * that never returns (a stalled FUSE server, a lingering socket) holds up that uid's closes
 * alone. Past this many uids with closes pending, the others' fds wait, still charged to them,
 * until a closer is idle. */
#define DLPC_CLOSERS_MAX 64
/* Connections of one uid accepted beyond --max-connections-per-uid or its fd share, so that
 * each can still be told why at HELLO; past that a connection is closed as soon as it is
 * accepted. */
#define DLPC_UID_CONNECTIONS_SLACK 8
/* The copies of fds in replies waiting for a uid's connections that may take it past its fd
 * share before the connection that queues one more is closed (at once, while the daemon is past
 * its fd budget): a uid at its share for ordinary reasons is still sent a reply that has to
 * wait (dlpackd). */
#define DLPC_UID_TX_FDS_SLACK 64

/* The daemon gives memory back to the system (malloc_trim()) once at least this many bytes of
 * buffers, waiting requests and connections were freed, at most once per
 * DLPC_MEM_TRIM_INTERVAL_MS; blocks larger than DLPC_MEM_MMAP_THRESHOLD (a large frame's
 * receive buffer) are mapped on their own and go back as soon as they are freed. */
#define DLPC_MEM_TRIM_AFTER (1u << 20)
#define DLPC_MEM_TRIM_INTERVAL_MS 250
#define DLPC_MEM_MMAP_THRESHOLD (128u << 10)

/* Channels (protocol 1.6): DLPC_CHANNEL_CAPACITY_DEFAULT and _MAX are public (dlpc.h).
 * Channels count against --max-entries-per-uid like names; queued messages against their
 * sender's --max-bytes-per-uid; waiting SENDs and RECVs against --max-pending-per-connection
 * and --max-pending-bytes-per-uid. */
/* Channels one uid may have open at once, queued and direct alike: a channel outlives the
 * connection that opened it, until it is removed. A direct channel's socket pair (two fds,
 * held by the daemon) counts against its opener's --max-fd-share-per-uid as well.
 * --max-channels-per-uid */
#define DLPC_UID_CHANNELS_DEFAULT 256
/* DLPC_POOL_BUFFERS_MAX (dlpc.h): buffers in one connection's pool of recycled channel
 * memory. */

#endif
