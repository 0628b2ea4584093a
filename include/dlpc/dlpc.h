/* SPDX-License-Identifier: Apache-2.0 */
/**
 * @file dlpc.h
 * @brief libdlpc: share DLPack tensors between processes through the dlpackd daemon.
 *
 * A process publishes a tensor (or a bundle of tensors on one storage) under a name; other
 * processes attach by name and receive a DLManagedTensorVersioned over the same memory. Host
 * tensors live in sealed memfds that travel over the daemon's Unix socket; attaching maps them and
 * costs one round trip whatever the tensor's size.
 *
 * Generations: a name's first publication has generation 1 and each REPLACE adds one (after
 * INT32_MAX it starts again at 1). Publish and attach return the generation they saw.
 *
 * Conventions:
 * - Functions returning int return a negative errno on failure. dlpc_strerror() turns a code into
 *   text and dlpc_last_error() gives the detailed message (naming the object and, where the daemon
 *   refused, its reason) of the last failure in the calling thread.
 * - A dlpc_client may be shared by threads. It belongs to the process that created it: used from
 *   a forked child it fails with -EBADFD; the child connects anew.
 * - No call waits for dlpackd forever unless asked to: a waiting attach gives up after its
 *   timeout_ms plus DLPC_CALL_GRACE_MS (1 s) even if the daemon never answers (it is stopped,
 *   or wedged), and every other request, dlpc_connect() included, after $DLPC_CALL_TIMEOUT_MS
 *   (DLPC_CALL_TIMEOUT_MS_DEFAULT, 30 s, when unset; 0 or negative: no bound). Either way the
 *   call fails with -ETIMEDOUT and the connection stays usable: a reply that comes later is
 *   dropped, and the reference of a late ATTACH reply given back, when the connection next
 *   reads (with its next call). The bound counts from the call's start and covers connecting
 *   anew, waiting behind another thread's write on the same client, writing the request however
 *   slowly the daemon reads, and waiting for the reply; a request's write also waits at most
 *   $DLPC_CALL_TIMEOUT_MS (a waiting call's included). A request cut short leaves the stream
 *   unusable, so that connection is lost (later calls fail, or connect anew with
 *   DLPC_CONNECT_RECONNECT). A request that timed out may still take effect. Only an attach
 *   with a negative timeout_ms waits without bound; dlpc_close() ends it.
 * - A wait given up on the client's side (an attach, receive or send that timed out there, was
 *   interrupted, or was ended by dlpc_cancel() or dlpc_close()) ends in dlpackd too: the
 *   library tells it (CANCEL, protocol 1.9), so the wait does not stay registered there until
 *   the connection closes (a send's message is not queued). The call never waits for that: while
 *   another thread's write holds the connection, the CANCEL follows that write
 *   (at most DLPC_CANCELS_PENDING_MAX, 64, queued; past it the daemon's own timeout or the
 *   connection's end ends the wait).
 * - A client-side shortage fails the one call, not the connection: a reply whose fd this
 *   process has no room for (RLIMIT_NOFILE reached) fails with -EMFILE, and the reference it
 *   carried goes back to the daemon.
 * - libdlpc is not async-signal-safe: it takes locks and allocates, so calling it from a signal
 *   handler can deadlock. Do the work outside the handler. A thread blocked in a call waiting
 *   for dlpackd can be told to give up with dlpc_set_interrupt() (a check run when a signal
 *   interrupts the wait, and every DLPC_INTERRUPT_CHECK_MS), and every caller of a client at
 *   once with dlpc_cancel().
 * - Tensors handed out by the library own their memory through their deleter, which may be called
 *   from any thread, even after dlpc_close().
 * - GPU tensors (kDLCUDA) need the CUDA driver at run time: the first GPU call loads
 *   libcuda.so.1 (or $DLPC_CUDA_LIBRARY); nothing is linked against CUDA. Without a driver GPU
 *   calls fail with -ENODEV ("CUDA driver (libcuda.so.1) not found"); where the driver cannot
 *   do CUDA IPC (WSL, Tegra) with -ENOTSUP ("not supported on this platform"). Host work never
 *   touches the driver. docs/protocol.md (5.8) has the details.
 * - A deleter unmaps at once but tells the daemon later: the release goes out with the
 *   connection's next request, at dlpc_close(), or after about DLPC_RELEASE_DELAY_MS (5 ms) from
 *   a thread the library starts for this, whichever comes first. Other connections may see the
 *   reference (STAT, LIST) for that long; the same connection never does.
 */
#ifndef DLPC_DLPC_H
#define DLPC_DLPC_H

#include <stddef.h>
#include <stdint.h>
#include <dlpc/dlpack1.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(DLPC_BUILDING) && defined(__GNUC__)
#define DLPC_EXPORT __attribute__((visibility("default")))
#else
#define DLPC_EXPORT
#endif

/** Major version of libdlpc (also the SONAME's). */
#define DLPC_VERSION_MAJOR 0
/** Minor version of libdlpc. */
#define DLPC_VERSION_MINOR 1
/** Patch level of libdlpc. */
#define DLPC_VERSION_PATCH 0

/** Environment variable naming the daemon's socket; overrides the built-in default. */
#define DLPC_SOCKET_ENV "DLPACKD_SOCKET"
/** The system socket: the service's, and where a daemon run by root listens by default. */
#define DLPC_SYSTEM_SOCKET "/run/dlpackd/dlpackd.sock"
/** File name of a per-user daemon's socket inside $XDG_RUNTIME_DIR. */
#define DLPC_USER_SOCKET_NAME "dlpackd.sock"

/**
 * Environment variable bounding, in milliseconds, how long a call without a timeout of its own
 * waits for dlpackd (read by dlpc_connect()): unset or empty for DLPC_CALL_TIMEOUT_MS_DEFAULT,
 * 0 or negative for no bound. See dlpc_connect().
 */
#define DLPC_CALL_TIMEOUT_ENV "DLPC_CALL_TIMEOUT_MS"
/** The bound on a call without a timeout of its own when DLPC_CALL_TIMEOUT_MS is not set. */
#define DLPC_CALL_TIMEOUT_MS_DEFAULT 30000
/** What a waiting attach allows dlpackd beyond its own timeout_ms before giving up itself. */
#define DLPC_CALL_GRACE_MS 1000
/** How often a call waiting for dlpackd runs its thread's interrupt check (dlpc_set_interrupt()),
 * besides whenever a signal interrupts the wait. */
#define DLPC_INTERRUPT_CHECK_MS 200

/** Environment variable naming the CUDA driver library to load instead of libcuda.so.1. */
#define DLPC_CUDA_LIBRARY_ENV "DLPC_CUDA_LIBRARY"
/** The CUDA driver library loaded (dlopen) by the first GPU call. */
#define DLPC_CUDA_LIBRARY_DEFAULT "libcuda.so.1"

/** Longest entry name, in bytes (names are 1..DLPC_NAME_MAX bytes of UTF-8 without NUL). */
#define DLPC_NAME_MAX 255
/** Longest key of a tensor inside a bundle, in bytes (keys may be empty). */
#define DLPC_KEY_MAX 255
/** Most dimensions a shared tensor may have. */
#define DLPC_NDIM_MAX 32
/** Most tensors one bundle may hold. */
#define DLPC_BUNDLE_MAX 16384
/** Alignment of every tensor's data inside a storage, in bytes. */
#define DLPC_ALIGN 256

/** An open connection to dlpackd. */
typedef struct dlpc_client dlpc_client;
/** The tensors of one attached bundle, sharing one mapping. */
typedef struct dlpc_bundle dlpc_bundle;

/** Options for dlpc_attach() and dlpc_attach_bundle(). */
typedef struct dlpc_attach_opts {
	uint32_t size;	/**< sizeof(dlpc_attach_opts): lets the struct grow */
	uint32_t flags; /**< DLPC_ATTACH_* bits */
	/** 0: fail at once if absent; > 0: wait up to this (the library itself gives up this
	 * plus DLPC_CALL_GRACE_MS after sending the request); < 0: forever */
	int64_t timeout_ms;
	void *stream; /**< CUstream the consumer uses (CUDA entries); NULL: wait on the host */
	/** With DLPC_ATTACH_OWNER: the uid the entry must have been published by. An entry of
	 * another uid under the name counts as absent (a waiting attach keeps waiting). */
	uint32_t owner_uid;
} dlpc_attach_opts;

/** Publish: take over an existing name; it gets a new generation. */
#define DLPC_PUBLISH_REPLACE (1u << 0)
/** Publish: the name vanishes when this connection closes. The connection lives on after
 * dlpc_close() while tensors attached through it do, and so does the name. */
#define DLPC_PUBLISH_EPHEMERAL (1u << 1)
/** Publish: attachers may map the storage writable. */
#define DLPC_PUBLISH_WRITABLE (1u << 2)
/*
 * Attach flags (dlpc_attach_opts.flags, and those dlpc_recv_opts.flags names): the library's API.
 * The library acts on most of them itself; only WRITABLE and OWNER of an attach reach dlpackd,
 * whose protocol has attach flags of its own (docs/protocol.md, 5.2).
 */
/** Attach: map writable (the entry must have been published with DLPC_PUBLISH_WRITABLE). */
#define DLPC_ATTACH_WRITABLE (1u << 0)
/** Attach: do not order anything after a legacy CUDA IPC publisher's event (neither
 * opts->stream nor the host); call dlpc_tensor_wait() before using the memory. */
#define DLPC_ATTACH_DEFER_SYNC (1u << 1)
/**
 * Attach: map host storage copy-on-write (MAP_PRIVATE, PROT_READ|PROT_WRITE). Reads share the
 * publisher's pages; a write copies the page it touches into this process's own memory, seen by
 * nobody else (and charged to this process's memory cgroup). A writable private mapping counts
 * its whole size as committed memory at attach: under strict overcommit
 * (vm.overcommit_memory=2) a large one can fail with -ENOMEM. The tensor is writable: no
 * read-only flag. Works on read-only and writable entries; -ENOTSUP for CUDA entries, -EINVAL
 * with DLPC_ATTACH_WRITABLE.
 */
#define DLPC_ATTACH_PRIVATE (1u << 2)
/**
 * Attach: map host storage copy-on-write as DLPC_ATTACH_PRIVATE does, but keep the tensor
 * flagged read-only. A safety net for consumers that ignore DLPack's read-only flag (PyTorch):
 * their writes land in pages of their own instead of crashing the process, and nobody else
 * sees them. CUDA entries are attached read-only as without the flag.
 */
#define DLPC_ATTACH_GUARDED (1u << 3)
/** Attach: accept only an entry published by opts->owner_uid (see dlpc_attach_opts). */
#define DLPC_ATTACH_OWNER (1u << 4)
/** Attach: bypass the client's cache of idle references (see dlpc_connect_flags()): ask the
 * daemon, and do not keep this reference once it is released. */
#define DLPC_ATTACH_NO_CACHE (1u << 5)
/**
 * Attach or receive: populate host storage's mapping up front (MADV_POPULATE_READ), before the
 * call returns, in every mapping mode (read-only, DLPC_ATTACH_PRIVATE, DLPC_ATTACH_GUARDED,
 * DLPC_ATTACH_WRITABLE), for a consumer that will read all of it (model weights): reading it
 * then takes no page faults, where an unpopulated mapping takes one per 64 KiB or so (the
 * kernel's fault-around), or per 4 KiB page. The call takes longer instead (the kernel maps
 * every page, as those faults would: with 4 KiB pages the call asks for one page per 64 KiB
 * window and the fault-around maps the rest, and a storage of 32 MiB or more is populated by up
 * to $DLPC_COPY_THREADS threads, started and joined within the call), and a copy-on-write
 * mapping stays shared: only a write copies a page. An attach answered from the client's cache
 * is populated too. A hint: where the kernel cannot populate (before Linux 5.14), or stops part
 * way, the attach still succeeds and the pages fault on first touch as without it; so do pages
 * the kernel had swapped out, but the first of each window. CUDA entries ignore it.
 */
#define DLPC_ATTACH_POPULATE (1u << 6)

/** Environment: the most idle cached references a client keeps, and the most received
 * storages it remembers for their mappings (read by dlpc_connect()); 0 turns the cache off. */
#define DLPC_CACHE_ENTRIES_ENV "DLPC_CACHE_ENTRIES"
/** ...when $DLPC_CACHE_ENTRIES is unset. */
#define DLPC_CACHE_ENTRIES_DEFAULT 64
/** Environment: the most bytes of storage a client's idle cached references may keep alive,
 * and as many its kept mappings of received storages; 0 turns the cache off. */
#define DLPC_CACHE_BYTES_ENV "DLPC_CACHE_BYTES"
/** ...when $DLPC_CACHE_BYTES is unset: 2 GiB. */
#define DLPC_CACHE_BYTES_DEFAULT (2ull << 30)
/** Environment: milliseconds a reference (or a received storage's mapping) stays cached after
 * its last release; 0 turns the cache off. */
#define DLPC_CACHE_IDLE_MS_ENV "DLPC_CACHE_IDLE_MS"
/** ...when $DLPC_CACHE_IDLE_MS is unset. */
#define DLPC_CACHE_IDLE_MS_DEFAULT 1000

/** Environment: the most bytes of shared memory a process keeps allocated ahead of the copy
 * path of its publishes and sends, and of dlpc_alloc() and dlpc_alloc_bundle() (the warm pool:
 * memfds whose pages a background thread allocated, each taken by one publish or allocation and
 * never reused), charged to the process's memory cgroup; 0 turns the pool off. Read once, at
 * the first publish that copies or the first such allocation. A value that is not a whole
 * number is ignored (the default applies). */
#define DLPC_WARM_BYTES_ENV "DLPC_WARM_BYTES"
/** ...when $DLPC_WARM_BYTES is unset: 1 GiB. */
#define DLPC_WARM_BYTES_DEFAULT (1ull << 30)
/** Environment: milliseconds after its last publish that a size's warm memfds are given back,
 * and within which a size must be used twice for the pool to keep any; 0 turns the pool off. */
#define DLPC_WARM_IDLE_MS_ENV "DLPC_WARM_IDLE_MS"
/** ...when $DLPC_WARM_IDLE_MS is unset. */
#define DLPC_WARM_IDLE_MS_DEFAULT 5000
/** Storages smaller than this are never taken from the warm pool: their pages cost less to
 * allocate than waking the pool's thread. */
#define DLPC_WARM_SIZE_MIN (256u << 10)
/** Environment: the most threads (the caller's included) a copy of a publish or send into new
 * shared memory is split over, one per 16 MiB, where it goes through a mapping (new huge pages
 * with shmem_enabled "advise", the hugetlbfs pool, the warm pool's mapped memfds), and so is
 * the populate of an attach with DLPC_ATTACH_POPULATE of 4 KiB pages; unset: 4,
 * never more than the CPUs the caller may run on nor its cgroups' CPU limits allow. 0 or 1: the
 * calling thread alone. A value that is not a whole number is ignored. */
#define DLPC_COPY_THREADS_ENV "DLPC_COPY_THREADS"
/** Environment: huge pages for the shared memory of storages of 2 MiB or more (docs/operations.md).
 * "auto" (unset, or any other value) and "thp": transparent huge pages as
 * /sys/kernel/mm/transparent_hugepage/shmem_enabled allows ("advise": libdlpc asks for them);
 * "hugetlb" (opt-in): a copied publish or send takes the hugetlbfs pool's pages when it has
 * room for the whole storage (its size then rounds up to whole huge pages), else none is asked
 * for; copy-on-write attachers map such a storage MAP_NORESERVE, so that a write of theirs may
 * get SIGBUS when the pool is empty; "off": libdlpc asks for none (with shmem_enabled "always"
 * or "within_size" the kernel gives them all the same). Read at each publish that copies and at
 * each dlpc_alloc(). */
#define DLPC_HUGE_PAGES_ENV "DLPC_HUGE_PAGES"

/** The library's version as "MAJOR.MINOR.PATCH". */
DLPC_EXPORT const char *dlpc_version(void);

/**
 * Write the socket path a client uses when none is given into @p buf.
 *
 * The rule (the same for every user, root included): $DLPACKD_SOCKET if set and not empty; else
 * $XDG_RUNTIME_DIR/dlpackd.sock (a per-user daemon's) if XDG_RUNTIME_DIR is set and that file
 * exists and belongs to the caller's effective uid; else DLPC_SYSTEM_SOCKET, the service's,
 * whose users are the group `dlpack`.
 * dlpc_connect() with no path follows it, and also goes on to the system socket when nobody
 * listens on an existing per-user socket (a stale one). The library, the Python module and
 * dlpackctl all use this rule. A daemon started without --socket listens elsewhere: on
 * $DLPACKD_SOCKET, else DLPC_SYSTEM_SOCKET when run by root, else on the per-user socket.
 * @return the path's length, or -ENAMETOOLONG if it does not fit in @p len bytes or in a socket
 *         address.
 */
DLPC_EXPORT int dlpc_default_socket(char *buf, size_t len);

/**
 * Connect to dlpackd. Both must speak the same protocol version (they come from the same build):
 * another one, major or minor, fails with -EPROTO, the message naming both versions and what to
 * do (restart dlpackd after an upgrade, and the programs that use libdlpc).
 *
 * Reads $DLPC_CALL_TIMEOUT_MS (DLPC_CALL_TIMEOUT_ENV) once: the bound on this client's calls
 * that have no timeout of their own, and on each step of connecting (a daemon whose backlog is
 * full, or a socket that accepts and never answers HELLO).
 *
 * A connection that dlpackd closes before it answers HELLO, without an error saying why, is
 * made again (an upgrade in place closes the connections its old image accepted; the new image
 * answers on the same socket): pausing 10 ms at first, then up to DLPC_RECONNECT_BACKOFF_MAX_MS,
 * until $DLPC_CALL_TIMEOUT_MS has passed since the call began (without one, for at most
 * DLPC_RECONNECT_DROPS_MAX connections), when it fails with -ECONNRESET or -EPIPE. A refusal
 * (over a quota, another protocol) comes with its reason and is not retried, also one that
 * closes the connection as soon as it is accepted (a uid far over its limits): -EDQUOT at once,
 * with dlpackd's words.
 * With @p socket_path NULL, the places of dlpc_default_socket() are tried in turn: only
 * $DLPACKD_SOCKET when it is set; else the per-user socket, and the system socket when nothing
 * listens on the first (no such file, connection refused, or permission denied) or the daemon
 * answering it runs as another uid than the caller's effective uid (a process that inherited
 * another user's XDG_RUNTIME_DIR, as su keeps it; the error names it), stopping at the first
 * daemon that answers. On failure dlpc_last_error() names every path tried with its error and,
 * where a socket's permissions kept the caller out (-EACCES), the group the socket belongs
 * to and how to join it (`sudo usermod -aG GROUP $USER`, then log in again). The return value
 * is then -EACCES if any path gave it, else the error of the last path tried.
 * @param socket_path the daemon's socket, or NULL to look for it (dlpc_default_socket()).
 * @param ret receives the client on success.
 * @return 0, -ECONNREFUSED or -ENOENT when no daemon listens, -EACCES when the socket's
 *         permissions keep the caller out, -EPROTO on a version mismatch,
 *         -ETIMEDOUT when nothing answered in time, -EINVAL when $DLPC_CALL_TIMEOUT_MS is not a
 *         whole number of milliseconds.
 */
DLPC_EXPORT int dlpc_connect(const char *socket_path, dlpc_client **ret);

/** dlpc_connect_flags(): connect anew after the connection is lost (see there). */
#define DLPC_CONNECT_RECONNECT (1u << 0)
/** dlpc_connect_flags(): keep no cache of idle references (see there). */
#define DLPC_CONNECT_NO_CACHE (1u << 1)

/**
 * dlpc_connect() with @p flags (0, DLPC_CONNECT_RECONNECT, DLPC_CONNECT_NO_CACHE).
 *
 * The cache of idle references: when the last tensor of a host entry attached read-only
 * (default, DLPC_ATTACH_PRIVATE or DLPC_ATTACH_GUARDED) is released, the client keeps the
 * daemon's reference, the storage fd and the mapping (one of each kind: shared read-only,
 * copy-on-write) for up to $DLPC_CACHE_IDLE_MS; an attach of the same name meanwhile is
 * answered locally, with no round trip, the mapping handed out again (a copy-on-write one is
 * first emptied of the pages its user wrote, as below, so no write of an earlier attacher
 * shows; one whose protection its user changed is not for reuse: do not mprotect() attached
 * or received memory). Before answering from the
 * cache the client reads what its socket holds: dlpackd (protocol 1.7) writes an invalidation
 * to it before it answers a replace or unpublish of the entry, so an attach never returns an
 * entry whose replace or removal was answered before the attach began. The cache is bounded by
 * $DLPC_CACHE_ENTRIES idle entries and $DLPC_CACHE_BYTES bytes (least recently used go first)
 * and dropped when the connection is lost or the process forks (a child has no use of its
 * parent's client). Not cached: CUDA entries, writable attaches (DLPC_ATTACH_WRITABLE),
 * DLPC_ATTACH_NO_CACHE, and attaches made while another thread of the process is reading
 * the client's socket, waiting for a reply (those go to the daemon, which is always right).
 * The library's thread reads the invalidations of idle entries as they come, so a replaced
 * entry's storage is let go at once. dlpc_stat() and dlpc_list() count cached references apart
 * (cached_references, cached_refs).
 *
 * The same flag and bounds govern the mappings a receiver keeps (dlpc_recv(),
 * dlpc_recv_bundle()): when the last tensor of a host message mapped read-only or
 * copy-on-write is released, its mapping is kept, idle, if its storage (the same memfd, told by
 * device, inode and change time) already came in an earlier message, as a buffer its sender
 * sends again and again does; the storage's next message is handed that mapping instead of a
 * new one (and a direct channel's receiver skips the checks the storage passed). A storage seen
 * once is never kept. A copy-on-write mapping is first emptied of the pages its user wrote
 * (those the PAGEMAP_SCAN ioctl of Linux 6.7 finds, else all with MADV_DONTNEED); a shared one
 * shows the storage's bytes as they are now, as a new mapping would. The cost: an idle kept
 * mapping keeps its storage's memory alive after its sender let go of it, for up to
 * $DLPC_CACHE_IDLE_MS. $DLPC_CACHE_ENTRIES bounds the storages remembered (kept or seen once),
 * $DLPC_CACHE_BYTES the bytes kept; DLPC_ATTACH_NO_CACHE in a receive's flags keeps nothing of
 * that message. Kept mappings go at dlpc_close() and in a forked child; not a lost connection.
 *
 * With DLPC_CONNECT_RECONNECT a client outlives its connection: once a call has found the
 * connection lost (dlpackd stopped, restarted or upgraded in place; that call still fails, with
 * -ECONNRESET or -EPIPE, and is not retried: a publish may or may not have happened), the next
 * call connects to the same socket again and sends HELLO before its request. While no daemon
 * listens that call fails as dlpc_connect() would (-ECONNREFUSED, -ENOENT) and the one after
 * tries again. A reconnect happens only when no other call is in progress on the client; until
 * then calls fail as the lost connection did. (The library's thread reads the socket of a client
 * with idle cached references or CUDA publications awaiting their reclaim notice: when it finds
 * the loss first, no call fails for it, and the next call connects anew.)
 *
 * What a reconnect means: tensors attached before stay valid (their mappings are this
 * process's), and their deleters send nothing (the references died with the old connection;
 * the daemon no longer counts them). Ephemeral entries the client published are gone, and
 * legacy CUDA IPC publications will never be reclaimed (their memory is kept until the process
 * exits, as after any lost connection); they no longer keep the client's connection open after
 * dlpc_close(): only the new connection's own do. Entries that are not ephemeral survive a
 * restart of dlpackd with its fd store, and an upgrade in place (dlpackd(8), DURABILITY).
 * dlpc_reconnects() counts the reconnects.
 *
 * A waiting attach (timeout_ms not 0) rides through a restart: when the connection is lost
 * while it waits, it connects again (every 10 ms at first, then up to every
 * DLPC_RECONNECT_BACKOFF_MAX_MS, within its timeout) and asks again for the time left, so it
 * completes when the name is published on the restarted daemon. Each attempt is bounded by the
 * time left: connect() by at most DLPC_RECONNECT_BACKOFF_MAX_MS, HELLO by the time left (or
 * $DLPC_CALL_TIMEOUT_MS if shorter; a socket activated while its daemon has not started yet
 * accepts connections that nobody answers). dlpc_cancel(), dlpc_close() (from another thread)
 * and the interrupt check end it at once, during HELLO too (-ECANCELED, -EINTR). Only a daemon
 * not back yet is waited for (-ECONNREFUSED, -ENOENT, -ECONNRESET, -EPIPE, -ETIMEDOUT from
 * connecting again); any other error of connecting again (-EACCES, -EPROTO for another
 * protocol version, -EDQUOT, -EMFILE...) ends the attach at once with that error, the message
 * (dlpc_last_error()) naming the entry and the cause. A wait whose time runs out while no
 * daemon answers fails with -ETIMEDOUT, its message quoting the last attempt's.
 * @return as dlpc_connect(), or -EINVAL for unknown flags.
 */
DLPC_EXPORT int dlpc_connect_flags(const char *socket_path, uint32_t flags, dlpc_client **ret);

/** The longest pause between two attempts of a waiting attach to connect again. */
#define DLPC_RECONNECT_BACKOFF_MAX_MS 200
/** With no call timeout ($DLPC_CALL_TIMEOUT_MS 0 or negative), how many connections in a row
 * dlpc_connect() lets dlpackd close before answering HELLO, without a reason, before it fails
 * (about 10 s of pauses: an upgrade drops one or two). */
#define DLPC_RECONNECT_DROPS_MAX 50

/** How many times @p c has connected anew (DLPC_CONNECT_RECONNECT); 0 for NULL. */
DLPC_EXPORT uint64_t dlpc_reconnects(const dlpc_client *c);

/** 1 if @p c was made by another process, of which this one is a forked child (its calls fail
 * with -EBADFD: connect anew), 0 if by this one or for NULL. */
DLPC_EXPORT int dlpc_inherited(const dlpc_client *c);

/** The socket @p c connected to (the one found by dlpc_connect(NULL), or the one it was given);
 * NULL for NULL. Valid as long as @p c. */
DLPC_EXPORT const char *dlpc_socket_path(const dlpc_client *c);

/**
 * Give up the caller's handle, sending the releases still deferred. The connection itself stays
 * open until the last tensor attached through it has been released, so outstanding deleters keep
 * working, and until the last CUDA tensor published through it by legacy IPC, or lent by its VMM
 * fd, has been given back (see dlpc_publish()). With none left, and no call of another thread's
 * still under way on it, it is closed by the time this returns: this may wait, briefly, for the
 * library's thread to let go of it (never for a deleter the thread runs). Called from such a
 * deleter, it returns at once and the connection closes right after. Accepts NULL.
 *
 * May be called while other threads are blocked in calls on @p c (a waiting attach, or any
 * request dlpackd has not answered yet): each of them returns -ECANCELED at once (one whose
 * request is still being written to a daemon that does not read, within DLPC_SEND_CHECK_MS,
 * and the connection goes with the stream, if it cut one), a wait of theirs ends in dlpackd too
 * (CANCEL), and what the daemon answers later is dropped (a reference given back when the
 * connection is read again, or with the connection). As with any handle, no call may start on
 * @p c once dlpc_close() has been called.
 */
DLPC_EXPORT void dlpc_close(dlpc_client *c);

/**
 * Make every call blocked on @p c return -ECANCELED at once (one still writing its request to
 * a daemon that does not read, within DLPC_SEND_CHECK_MS), and every later call on it too, as
 * dlpc_close() does, but keep the handle: the caller still calls dlpc_close() (for example
 * once the threads it woke have left their calls). Safe while other threads are in calls.
 */
DLPC_EXPORT void dlpc_cancel(dlpc_client *c);

/** See dlpc_set_interrupt(). */
typedef int (*dlpc_interrupt_fn)(void *arg);

/**
 * Set the calling thread's interrupt check (NULL: none, the default). While that thread waits
 * for dlpackd in any call, the library runs @p fn(@p arg), without holding any of its locks,
 * whenever a signal interrupts the wait and at least every DLPC_INTERRUPT_CHECK_MS. The wait for
 * a reply runs it, and so does a request's wait behind another thread's write on the same
 * client (every DLPC_SEND_CHECK_MS; nothing was sent then): connect(2) and sending a request
 * into a full socket are bounded by the call's timeout instead; dlpc_watch_next() runs it too
 * while it waits for an event. If @p fn
 * returns non-zero the call gives up with -EINTR, whatever came meanwhile (a reply that arrived
 * while @p fn ran, or a dlpc_cancel() from it), and the connection stays usable: as after
 * -ETIMEDOUT, that reply or a later one is dropped (an ATTACH reply's reference given back) and
 * the request may still have taken effect. A language runtime uses this to let Ctrl-C interrupt
 * a call to a daemon that does not answer (the Python module does).
 */
DLPC_EXPORT void dlpc_set_interrupt(dlpc_interrupt_fn fn, void *arg);

/**
 * Publish one tensor under @p name.
 *
 * Always takes ownership of @p t: its deleter (if not NULL) runs exactly once, before this
 * returns, whether it succeeds or fails (the exceptions are below). Host tensors are copied into
 * a sealed memfd (strided input is compacted to C-contiguous) unless @p t came from
 * dlpc_alloc(), whose memory is published without a copy.
 *
 * CUDA tensors (kDLCUDA, C-contiguous) are shared in place, never copied. dlpc_alloc() memory
 * on the device is published as its VMM export fd: the entry may outlive this process. An
 * empty tensor goes as the device's smallest VMM allocation. Memory legacy IPC cannot export
 * but which is a VMM mapping exportable as a POSIX fd is lent by that fd, in an ephemeral entry
 * kept and given back like legacy IPC memory below (protocol 1.5); stream-ordered pool memory
 * and VMM mappings without that handle type get -ENOTSUP naming the allocator setting. Any
 * other device pointer is published by legacy CUDA IPC: the entry is always ephemeral, an
 * interprocess event is recorded on the legacy default stream for attachers to wait on, and on
 * success the library keeps @p t: its deleter runs once the entry is unpublished or replaced
 * and every attacher has released it, from a thread of the library's, within about 100 ms of
 * the daemon's notice, whether or not this process makes further calls. Until then the
 * connection stays open, even after dlpc_close() (which therefore does not withdraw the entry:
 * unpublish it first); if the connection breaks, @p t is kept until the process exits, since
 * an attacher may still be using the memory. The same holds when such a publish ends with
 * -EINTR, -ETIMEDOUT, -ECANCELED or a lost connection after the request went out: the entry
 * may exist, so @p t is kept as if published. A request that never went out (the connection
 * was lost, or the client closed, before; connecting anew failed) gives @p t back. In a child
 * forked from a process that used CUDA through the library, CUDA tensors get -EBADFD.
 * @param flags DLPC_PUBLISH_* bits.
 * Unless published DLPC_PUBLISH_WRITABLE, the storage is sealed with F_SEAL_WRITE (plus
 * SHRINK, GROW and SEAL): from then on nobody can change it, the publisher included, and the
 * daemon refuses read-only storage without that seal. Every page of the storage is allocated
 * before it is sent (the daemon refuses sparse storage): a full memory cgroup fails here.
 * @return the new generation (> 0), -EEXIST if the name is taken and REPLACE was not asked,
 *         -EPERM if it belongs to another user, -ENOSPC if shared memory is full, -EBUSY if
 *         dlpc_alloc() memory is still mapped writable in another process, -EINVAL for a
 *         bad name or tensor, -ENOTSUP for a device the library cannot share (or CUDA IPC the
 *         platform does not support), -ENODEV without a CUDA driver, -ETIMEDOUT when dlpackd
 *         did not answer within $DLPC_CALL_TIMEOUT_MS, -ECANCELED when dlpc_close() was called
 *         meanwhile. After -ETIMEDOUT or -ECANCELED the request has been sent and the daemon
 *         may still carry it out: the name may be published (a later attach or dlpc_list()
 *         tells), and a REPLACE may have replaced it.
 */
DLPC_EXPORT int dlpc_publish(dlpc_client *c, const char *name, DLManagedTensorVersioned *t,
			     uint32_t flags);

/**
 * Publish @p n tensors on one storage under @p name (a bundle, e.g. a model's state dict).
 *
 * @p keys are unique, 0..DLPC_KEY_MAX bytes each. A single tensor is the bundle of one tensor
 * under the key "": dlpc_attach() takes it, and refuses every other bundle. Ownership of every tensor passes to the
 * library as for dlpc_publish(), on every path. The tensors are all host memory, or all on one
 * CUDA device. When the tensors are exactly those of one dlpc_alloc_bundle() (or dlpc_alloc())
 * allocation, all of them and in the order it gave them, that allocation is published as it
 * is, without a copy, like dlpc_alloc() memory by dlpc_publish() (read-only: sealed, all of
 * it). A part of such an allocation is copied, so that attachers see only what was
 * published. Otherwise host tensors are copied into one sealed memfd, and CUDA tensors on the
 * device into one VMM allocation of the library's (the calling thread waits for the copies);
 * their deleters run before this returns. A bundle of one CUDA tensor is not copied: it is
 * published as dlpc_publish() would publish it, its key kept.
 * @return the new generation (> 0) or a negative errno as for dlpc_publish(); -ENOTSUP for
 *         tensors on different devices.
 */
DLPC_EXPORT int dlpc_publish_bundle(dlpc_client *c, const char *name, size_t n,
				    const char *const keys[],
				    DLManagedTensorVersioned *const tensors[], uint32_t flags);

/**
 * Allocate a C-contiguous, writable tensor that already lives in shared memory.
 *
 * Fill it in place, then hand it to dlpc_publish(): it is published without a copy. If never
 * published, its deleter frees it. @p device is {kDLCPU, 0} (a memfd) or {kDLCUDA, ordinal}:
 * CUDA VMM memory (cuMemCreate with POSIX-fd handles, mapped read-write on that device; its
 * size is rounded up to the driver's granularity), whose entry can outlive the publisher. Its
 * entry carries no event for attachers to wait on: finish writing (synchronize) first.
 * @p c may be NULL (nothing is asked of the daemon). Other handles on the same memory
 * (dlpc_tensor_share()) stay valid after it is published, at the same addresses. A read-only
 * publish seals the memory against writes for good (F_SEAL_WRITE; even if the daemon then
 * refuses the entry): the library first replaces this process's writable mapping in place by a
 * read-only one, so every later write in this process faults and mprotect() cannot make it
 * writable again. Handles made earlier keep their flags, so do not write through them; handles
 * made later carry the read-only flag. If a writable mapping of the memory survives elsewhere
 * (a child forked while it was mapped), that publish fails with -EBUSY and the memory stays
 * writable here.
 * @return 0 or a negative errno (-ENOSPC when shared memory is full, -ENODEV without a CUDA
 *         driver, -ENOTSUP for another device).
 */
DLPC_EXPORT int dlpc_alloc(dlpc_client *c, DLDevice device, DLDataType dtype, int32_t ndim,
			   const int64_t *shape, DLManagedTensorVersioned **ret);

/**
 * Allocate @p n C-contiguous, writable tensors (tensor i: @p dtypes[i], @p ndims[i] dimensions
 * of @p shapes[i]) in one allocation of shared memory on @p device, host or CUDA, each at the
 * next 256-byte boundary after the one before, and store them in @p ret[0..n-1]: a bucket to
 * fill in place (on a device, with your own kernels or copies) and publish whole with
 * dlpc_publish_bundle() without a copy (all @p n, in this order; a subset is copied). Each
 * tensor has its own deleter; the memory lives until the last is gone. Everything dlpc_alloc()
 * says of its memory holds for this allocation. @p n is 1..DLPC_BUNDLE_MAX.
 * @return 0 or a negative errno as for dlpc_alloc() (-EINVAL for a bad dtype or shape); on
 *         failure every @p ret[i] is NULL.
 */
DLPC_EXPORT int dlpc_alloc_bundle(dlpc_client *c, DLDevice device, size_t n,
				  const DLDataType dtypes[], const int32_t ndims[],
				  const int64_t *const shapes[], DLManagedTensorVersioned *ret[]);

/**
 * Attach the single tensor published under @p name.
 *
 * The tensor is read-only (DLPACK_FLAG_BITMASK_READ_ONLY set, memory mapped PROT_READ) unless
 * publisher and attacher both asked for writable (DLPC_ATTACH_WRITABLE: a shared mapping, writes
 * seen by everyone) or the attacher asked for a copy-on-write mapping (DLPC_ATTACH_PRIVATE,
 * DLPC_ATTACH_GUARDED). Its deleter unmaps and tells the daemon.
 *
 * A read-only entry never changes while it exists: its storage carries F_SEAL_WRITE, so no
 * process, the publisher included, can write it by any route. Names are first-come across uids:
 * DLPC_ATTACH_OWNER with opts->owner_uid treats an entry of another uid as absent (the message of
 * -ENOENT names both uids), and dlpc_tensor_attach_info() says who published what was attached.
 *
 * A CUDA entry gives a tensor on {kDLCUDA, local ordinal} (the device found by its UUID). A
 * legacy IPC allocation is opened once per process whatever the number of attaches (attaching
 * in the publishing process uses its own pointer), and the consumer is ordered after the
 * publisher's event: opts->stream waits for it (cuStreamWaitEvent, the host does not block),
 * or without a stream the calling thread waits (cuEventSynchronize).
 * @param opts NULL for the defaults (fail at once if absent, read-only, no stream).
 * @return the generation (> 0), -ENOENT if absent (also once a legacy IPC publisher is gone,
 *         and with DLPC_ATTACH_OWNER when another uid published it), -ETIMEDOUT if a wait
 *         expired or dlpackd did not answer in time (timeout_ms plus DLPC_CALL_GRACE_MS for a
 *         waiting attach, $DLPC_CALL_TIMEOUT_MS for timeout_ms 0), -EINVAL if the name holds a
 *         bundle (several tensors, or one under a non-empty key), -EACCES for a writable
 *         attach of a read-only entry, -ENOTSUP for a copy-on-write attach of a CUDA entry,
 *         -ENODEV without a CUDA driver or the entry's device, -EMFILE when this process has
 *         no free fd for the storage's (the message names the RLIMIT_NOFILE soft limit; the
 *         reference goes back to the daemon and the client stays usable), -ECANCELED when
 *         dlpc_close() was called meanwhile.
 */
DLPC_EXPORT int dlpc_attach(dlpc_client *c, const char *name, const dlpc_attach_opts *opts,
			    DLManagedTensorVersioned **ret);

/**
 * Attach every tensor of the entry @p name in one round trip and one mapping.
 * @return the generation (> 0) or a negative errno as for dlpc_attach().
 */
DLPC_EXPORT int dlpc_attach_bundle(dlpc_client *c, const char *name, const dlpc_attach_opts *opts,
				   dlpc_bundle **ret);

/** Number of tensors in @p b. */
DLPC_EXPORT size_t dlpc_bundle_count(const dlpc_bundle *b);

/** Key of tensor @p i of @p b ("" for a single published tensor); NULL if out of range. */
DLPC_EXPORT const char *dlpc_bundle_key(const dlpc_bundle *b, size_t i);

/**
 * Take tensor @p i out of @p b. The caller owns it and must call its deleter.
 * @return the tensor, or NULL if @p i is out of range or was already taken.
 */
DLPC_EXPORT DLManagedTensorVersioned *dlpc_bundle_take(dlpc_bundle *b, size_t i);

/** Free @p b and release the tensors not taken. The mapping lives on while taken tensors do. */
DLPC_EXPORT void dlpc_bundle_free(dlpc_bundle *b);

/**
 * A second, independent handle on the memory of @p t, which must be a tensor libdlpc made
 * (attached, taken from a bundle, allocated, or itself shared). Same data, dtype, shape and
 * flags; its own deleter. The memory lives until the last handle's deleter has run.
 * @return the new tensor, or NULL (see dlpc_last_error()) for a foreign tensor or no memory.
 */
DLPC_EXPORT DLManagedTensorVersioned *dlpc_tensor_share(const DLManagedTensorVersioned *t);

/**
 * Order work after the publisher of @p t (a tensor libdlpc made): for a tensor attached from a
 * legacy CUDA IPC entry, @p stream (a CUstream, or the special handles CU_STREAM_LEGACY (0x1)
 * and CU_STREAM_PER_THREAD (0x2)) waits for the publisher's event with cuStreamWaitEvent, or
 * without a stream the calling thread waits (cuEventSynchronize). For any other tensor there
 * is nothing to wait for. Meant for attaches with DLPC_ATTACH_DEFER_SYNC, where the consumer's
 * stream is known only later (DLPack's __dlpack__(stream=...)); may be called more than once.
 *
 * @p stream stays the caller's, as DLPack says: it is used during this call only (and
 * opts->stream during dlpc_attach() only), never kept, so the caller may destroy it before it
 * drops the tensor.
 *
 * An attached CUDA tensor is unmapped and released only after the consumer's work queued on it
 * (so the publisher never reuses memory a kernel still reads), without blocking its deleter:
 * the deleter records an event on the legacy default stream, which follows the work of every
 * blocking stream (destroyed ones included: their queued work still runs), and a thread of the
 * library's unmaps and releases once the event has completed: it sleeps in
 * cuEventSynchronize on that (blocking-sync) event, queueing nothing on any stream, so it does
 * not poll (it looks every 100 ms while releases wait on several devices, and every
 * millisecond only while a graph capture keeps the event from being recorded); a sticky
 * error ends the wait, lets the memory go and says so on stderr. The legacy stream does not
 * follow streams created non-blocking: once a non-blocking stream was named (here or at
 * attach), that thread synchronizes the whole
 * context instead (cuCtxSynchronize), which waits for all of the context's work queued by
 * then. Work that the consumer puts on a non-blocking stream it never named (after the host
 * waited) is not waited for: name that stream. While any blocking stream captures a CUDA
 * graph the legacy stream cannot be used, nor the context synchronized, and the release waits
 * for the capture's end (a capture on a non-blocking stream cannot be seen, and a context
 * synchronization that meets one invalidates it: hold such releases around it with
 * dlpc_cuda_hold_releases()). A host wait (no stream named) is made in relaxed capture mode,
 * so that another thread's capture does not refuse it. A deleter that cannot
 * hand the tensor over (no memory, no thread) waits on the host instead. Once the process
 * exits (the library's atexit handler has run), no driver call is made any more: a deleter
 * then leaves the mapping alone and releases nothing, and dlpackd drops the reference with the
 * connection.
 * @return 0, -EINVAL for a foreign tensor, or a negative errno from the driver.
 */
DLPC_EXPORT int dlpc_tensor_wait(const DLManagedTensorVersioned *t, void *stream);

/**
 * Hold back, in this whole process, the releases of attached CUDA tensors, until as many
 * dlpc_cuda_resume_releases() have been called. Call it before a CUDA graph capture on a
 * non-blocking stream (PyTorch's side streams and torch.cuda.graph's own) and resume after
 * the capture ends, when another thread (a garbage collector) may drop attached tensors
 * meanwhile.
 *
 * Why: the release of a tensor whose consumer named a non-blocking stream waits for all of the
 * context's work (see dlpc_tensor_wait()), and a context synchronization invalidates any
 * capture under way in that context, even one on another thread's stream. A capture on a
 * non-blocking stream cannot be seen from outside that stream, so libdlpc cannot wait for its
 * end by itself, as it does for a capture on a blocking stream. While held, libdlpc's thread
 * makes no release at all and sleeps until the last hold ends: the tensors dropped meanwhile
 * keep their memory mapped and their references. That includes the releases ordered by an
 * event on the legacy default stream (recorded once the hold ends: later is still after the
 * consumer's work), since a capture on a blocking stream, which libdlpc sees and waits for,
 * could begin between its look and its record, and the record would lose it.
 *
 * Holds nest and may be taken and resumed on any thread (in a forked child a resume only
 * counts); a resume without a hold does nothing. Not held: a deleter that cannot hand its
 * tensor to libdlpc's thread (no memory, no thread) synchronizes on the host at once. Nothing
 * to do without CUDA.
 */
DLPC_EXPORT void dlpc_cuda_hold_releases(void);

/** End one dlpc_cuda_hold_releases(); the last one lets the held releases go. */
DLPC_EXPORT void dlpc_cuda_resume_releases(void);

/** Where an attached tensor came from, as dlpc_tensor_attach_info() reports it. */
typedef struct dlpc_attach_info {
	uint32_t size;	     /**< set by the caller to sizeof(dlpc_attach_info) */
	uint32_t owner_uid;  /**< the publisher's uid (from SO_PEERCRED) */
	int32_t owner_pid;   /**< the publisher's pid (from SO_PEERCRED) */
	uint32_t flags;	     /**< DLPC_PUBLISH_* bits the entry was published with */
	uint64_t generation; /**< the generation attached */
} dlpc_attach_info;

/**
 * Who published the entry that @p t (attached, taken from an attached bundle, or a share of
 * one) came from, and which generation. Set out->size to sizeof(*out) first; fields past that
 * size are left alone. Names are first-come across uids: check the owner here, or ask for it
 * up front with DLPC_ATTACH_OWNER, before trusting the bytes.
 * @return 0, -EINVAL for a tensor that was not attached through libdlpc.
 */
DLPC_EXPORT int dlpc_tensor_attach_info(const DLManagedTensorVersioned *t, dlpc_attach_info *out);

/**
 * Remove @p name. Attached tensors stay valid; the storage is freed after their release.
 * @return 0, -ENOENT if absent, -EPERM if published by another user.
 */
DLPC_EXPORT int dlpc_unpublish(dlpc_client *c, const char *name);

/**
 * Remove @p name only if it still is the entry of @p generation created at @p created_ns
 * (dlpc_entry_info's fields; 0 for either: not checked, both 0: dlpc_unpublish()). The daemon
 * checks and removes in one step, so a replace by another process that lands first is never
 * removed. A generation starts again at 1 once a name is freed: pass @p created_ns too to tell
 * a name published anew from the entry you mean (a daemon gives every publish its own).
 * @return 0, -ESTALE if the name holds another generation or creation (nothing is removed),
 *         -ENOENT if absent, -EPERM if published by another user.
 */
DLPC_EXPORT int dlpc_unpublish_if(dlpc_client *c, const char *name, uint64_t generation,
				  int64_t created_ns);

/**
 * The entry that the calling thread's last successful publish through @p c made (by
 * dlpc_publish() or dlpc_publish_bundle()): its generation and created_ns as the daemon
 * answered, what dlpc_unpublish_if() takes to remove that entry and no other. Either pointer
 * may be NULL.
 * @return 0, -ENOENT if this thread published nothing through @p c.
 */
DLPC_EXPORT int dlpc_last_published(dlpc_client *c, uint64_t *generation, int64_t *created_ns);

/**
 * Wrap a versioned tensor for a consumer that only knows DLManagedTensor (DLPack < 1.0).
 * Takes ownership of @p t; the wrapper's deleter calls @p t's. The read-only flag cannot be
 * expressed in the legacy struct.
 * @return the wrapper, or NULL if out of memory (then @p t's deleter has run).
 */
DLPC_EXPORT DLManagedTensor *dlpc_to_legacy(DLManagedTensorVersioned *t);

/** Text for a negative errno returned by libdlpc. Never NULL. */
DLPC_EXPORT const char *dlpc_strerror(int err);

/**
 * The detailed message of the last failed libdlpc call in the calling thread, naming what
 * failed and, where the daemon refused, its reason. Empty if nothing failed yet.
 */
DLPC_EXPORT const char *dlpc_last_error(void);

/** One tensor of a listed entry. */
typedef struct dlpc_tensor_info {
	const char *key;      /**< key inside the bundle ("" for a single tensor) */
	DLDataType dtype;     /**< element type */
	int32_t ndim;	      /**< number of dimensions */
	const int64_t *shape; /**< ndim extents */
	uint64_t nbytes;      /**< bytes of data */
} dlpc_tensor_info;

/** One published entry, as dlpc_list() reports it. */
typedef struct dlpc_entry_info {
	const char *name;	   /**< the entry's name */
	uint64_t generation;	   /**< its generation (see the file's comment) */
	DLDevice device;	   /**< where its storage lives */
	uint32_t flags;		   /**< DLPC_PUBLISH_* bits it was published with */
	uint64_t nbytes;	   /**< size of its storage */
	uint64_t refs;		   /**< live attach references to its storage */
	uint32_t owner_uid;	   /**< publisher's uid (from SO_PEERCRED) */
	int32_t owner_pid;	   /**< publisher's pid (from SO_PEERCRED) */
	int64_t created_ns;	   /**< publication time, ns since the Unix epoch */
	size_t ntensors;	   /**< tensors in the entry */
	dlpc_tensor_info *tensors; /**< their descriptions; NULL if the daemon left them out */
	uint64_t cached_refs;	   /**< of refs, those idle in a client's cache (protocol 1.7) */
} dlpc_entry_info;

/**
 * List the entries whose names start with @p prefix (NULL or "" for all), sorted by name.
 * @param ret receives an array of @p count entries, freed with dlpc_list_free().
 * @return 0 or a negative errno.
 */
DLPC_EXPORT int dlpc_list(dlpc_client *c, const char *prefix, dlpc_entry_info **ret, size_t *count);

/** Free what dlpc_list() returned. Accepts NULL. */
DLPC_EXPORT void dlpc_list_free(dlpc_entry_info *list, size_t count);

/** The daemon's counters, as dlpc_stat() reports them. */
typedef struct dlpc_stats {
	uint32_t size;		  /**< set by the caller to sizeof(dlpc_stats) */
	uint32_t daemon_pid;	  /**< the daemon's pid */
	uint64_t uptime_ms;	  /**< time since the daemon started */
	uint64_t connections;	  /**< open client connections */
	uint64_t entries;	  /**< published names */
	uint64_t storages;	  /**< storages held (named or still referenced) */
	uint64_t bytes_held;	  /**< sum of the storages' sizes */
	uint64_t references;	  /**< live attach references */
	uint64_t waiters;	  /**< attaches waiting for a name */
	uint64_t fds_open;	  /**< file descriptors the daemon has open */
	uint64_t fds_sent;	  /**< storage fds sent to attachers so far */
	uint64_t req_hello;	  /**< HELLO requests served */
	uint64_t req_publish;	  /**< PUBLISH requests served */
	uint64_t req_attach;	  /**< ATTACH requests served */
	uint64_t req_release;	  /**< RELEASE messages received */
	uint64_t req_unpublish;	  /**< UNPUBLISH requests served */
	uint64_t req_list;	  /**< LIST requests served */
	uint64_t req_stat;	  /**< STAT requests served */
	uint64_t protocol_errors; /**< connections dropped for protocol violations */
	uint64_t fds_closing;	  /**< fds the daemon is closing (on its reaper thread, or in the
				       closer process of the uid that sent them), and sockets of
				       closed connections it keeps while fds are in flight to them */
	uint64_t req_watch;	  /**< WATCH requests served */
	uint64_t watchers;	  /**< connections watching now */
	uint64_t events;	  /**< changes of the name map since start (last event's seq) */
	uint64_t tx_queued;	  /**< bytes waiting in the daemon's output queues, all together */
	uint64_t queue_drops;	  /**< connections dropped because their output queue was full */
	uint64_t uid_bytes_held;  /**< bytes of storages the caller's uid published that a name
				       still reaches (its quota counts them) */
	uint64_t uid_entries;	  /**< entries the caller's uid has published */
	uint64_t uid_connections; /**< connections of the caller's uid, this one included */
	/** bytes of storages no name reaches any more that references of the caller's uid keep
	 * alive (its quota counts them too) */
	uint64_t uid_bytes_pinned;
	uint64_t req_send;     /**< SEND requests served */
	uint64_t req_recv;     /**< RECV requests served */
	uint64_t req_channel;  /**< CHANNEL requests served */
	uint64_t channels;     /**< channels open */
	uint64_t messages;     /**< messages queued in channels, and sends waiting for room */
	uint64_t uid_channels; /**< channels the caller's uid opened (its entry quota counts
				    them) */
	/** of references, those idle in a client's cache */
	uint64_t cached_references;
	/** cache invalidations dlpackd has sent, since it started */
	uint64_t invalidations;
	/** CANCEL requests served: waits that clients gave up on */
	uint64_t req_cancel;
	/** fds that storages and connections may use together: RLIMIT_NOFILE less fds_own and
	 * DLPC_FD_RESERVE (UINT64_MAX if the daemon could not read its limit) */
	uint64_t fd_budget;
	/** fds the daemon had open for itself when it started serving */
	uint64_t fds_own;
} dlpc_stats;

/**
 * Fetch the daemon's counters into @p out. Set out->size to sizeof(*out) first; fields past that
 * size are left alone.
 * @return 0 or a negative errno.
 */
DLPC_EXPORT int dlpc_stat(dlpc_client *c, dlpc_stats *out);

/** A watch on the names under a prefix (see dlpc_watch_open()). */
typedef struct dlpc_watch dlpc_watch;

/** Watch event: a name that was free now holds an entry. */
#define DLPC_WATCH_PUBLISHED 1
/** Watch event: a new generation replaced a name's entry. */
#define DLPC_WATCH_REPLACED 2
/** Watch event: a name was removed. */
#define DLPC_WATCH_UNPUBLISHED 3
/** Why an entry was unpublished: an UNPUBLISH request (dlpc_unpublish()). */
#define DLPC_WATCH_BY_REQUEST 1
/** Why an entry was unpublished: its ephemeral publisher's connection closed. */
#define DLPC_WATCH_BY_DISCONNECT 2
/** Watch event (protocol 1.6): a channel was opened; entry.name is its name, the rest of entry
 * is zero. */
#define DLPC_WATCH_CHANNEL_OPENED 4
/** Watch event (protocol 1.6): a channel was removed (reason DLPC_WATCH_BY_REQUEST). */
#define DLPC_WATCH_CHANNEL_REMOVED 5

/** One change of the name map, as dlpc_watch_next() reports it. */
typedef struct dlpc_watch_event {
	uint32_t kind;	 /**< DLPC_WATCH_PUBLISHED, _REPLACED or _UNPUBLISHED */
	uint32_t reason; /**< UNPUBLISHED: DLPC_WATCH_BY_*; otherwise 0 */
	uint64_t seq;	 /**< the daemon's change counter: 1, 2, 3... since it started */
	uint64_t previous_generation; /**< REPLACED: the generation replaced; otherwise 0 */
	uint32_t actor_uid;	      /**< uid of the connection that made the change */
	int32_t actor_pid;	      /**< its pid */
	/**
	 * The entry published, or the one removed (refs as they were at that moment).
	 * entry.tensors describes the tensor when the entry holds exactly one; for a bundle it is
	 * NULL and entry.ntensors gives the count.
	 */
	dlpc_entry_info entry;
} dlpc_watch_event;

/**
 * Start watching the names that begin with the bytes of @p prefix (NULL or "" for all).
 *
 * The watch has a connection of its own (a watching connection can make no other request). From
 * the moment this returns, every publish, replace and unpublish of a matching name is reported
 * once, in the order the daemon applied them. The daemon drops a watcher that falls
 * DLPC_WATCH_QUEUE_MAX bytes behind (proto/limits.h, 1 MiB): read events promptly; the next
 * call then fails with -ECONNRESET. Like a dlpc_client, a watch belongs to the process that
 * opened it (a forked child gets -EBADFD and never holds the connection open). Use it from one
 * thread at a time.
 * @param socket_path the daemon's socket, or NULL for dlpc_default_socket()'s.
 * @param err receives 0 or a negative errno (may be NULL).
 * @return the watch, or NULL with *err and dlpc_last_error() set.
 */
DLPC_EXPORT dlpc_watch *dlpc_watch_open(const char *socket_path, const char *prefix, int *err);

/**
 * The socket to poll for readability, for event loops. When it is readable call
 * dlpc_watch_next() with a timeout of 0 until it returns 0: events may also be buffered already.
 * @return the fd, or a negative errno.
 */
DLPC_EXPORT int dlpc_watch_fd(const dlpc_watch *w);

/**
 * Wait for the next event.
 *
 * @p ev and its strings belong to the watch and stay valid until the next call on it or
 * dlpc_watch_close().
 * @param timeout_ms 0: do not wait; > 0: wait up to this many ms; < 0: wait forever.
 * @return 1 and @p ev filled, 0 if none came in time, -EINTR if a signal interrupted the wait
 *         (with an interrupt check, dlpc_set_interrupt(): if the check said to stop),
 *         -ECONNRESET when the daemon closed the watch (it stopped, or the watcher fell too far
 *         behind), another negative errno on failure. After a failure other than -EINTR the
 *         watch is finished: close it and open a new one.
 */
DLPC_EXPORT int dlpc_watch_next(dlpc_watch *w, dlpc_watch_event *ev, int timeout_ms);

/** Stop watching and free @p w. Accepts NULL; in a forked child it only frees memory. */
DLPC_EXPORT void dlpc_watch_close(dlpc_watch *w);

/*
 * ---- Channels (protocol 1.6) ----
 *
 * A channel is a named FIFO of messages held by dlpackd; a message is one tensor or a bundle.
 * Each message goes to exactly one receiver, in the order the sends were answered. A receiver
 * waiting in dlpc_recv() is handed a message in the daemon turn that admits it, so a hand-off
 * costs the sender one round trip and the receiver none beyond its pending request. A channel
 * holds at most its capacity of messages: further senders wait for room, or fail with -EAGAIN.
 *
 * Delivery is at most once: a received message belongs to its receiver, its storage freed when
 * the receiver releases every tensor of it (or its connection closes); it is never given to
 * anyone else. A message sent is queued even if its sender exits afterwards; a send still
 * waiting for room when its connection closes is dropped. Removing a channel frees the messages
 * it queues and ends every send and receive waiting on it with -EIDRM; messages already
 * received stay valid until released. Channels do not survive a daemon restart.
 *
 * End of stream (protocol 1.10): a connection becomes a producer of a channel with its first
 * send to it (or dlpc_channel_close(), from the channel's owner uid or root: another uid's
 * close before it sent changes nothing). dlpc_channel_close() says this producer sends no more;
 * a producer's connection that ends (its process exits or crashes) counts as its close. Once
 * every producer has closed, and at least as many as the channel was opened for
 * (dlpc_channel_opts.producers, default 1), the stream has ended: receivers get every message
 * still queued, then -EPIPE, and a receiver waiting then is woken with -EPIPE; sends fail with
 * -EPIPE. dlpc_channel_close_flags() with DLPC_CHANNEL_CLOSE_ALL ends it for every producer at
 * once. An ended channel stays ended (STAT shows DLPC_CHANNEL_ENDED) until it is removed; open
 * it anew after dlpc_channel_remove() for a new stream. -EPIPE from these calls never means a
 * lost connection: that is -ECONNRESET.
 *
 * Messages are sealed read-only like ordinary publishes (see dlpc_publish()).
 */

/** Messages a channel queues when opened with capacity 0. */
#define DLPC_CHANNEL_CAPACITY_DEFAULT 16
/** The largest capacity a channel may be opened with. */
#define DLPC_CHANNEL_CAPACITY_MAX 65536

/**
 * dlpc_channel_open_flags(): a direct channel (protocol 1.8). Its messages go from sender to
 * receiver through a socket pair that dlpackd makes and hands to every process that uses the
 * channel, queued by the kernel, without the daemon between them: a hand-off costs about what
 * passing an fd over a Unix socket costs. Delivery is as on any channel (exactly one receiver,
 * in order, at most once; a receiver that dies holding a message frees it; removal ends sends
 * and receives with -EIDRM and frees what is queued). What differs:
 *  - the capacity is what the kernel lets the socket queue: the channel is opened with room
 *    for @p capacity messages if the kernel's buffer limit (net.core.wmem_max) allows, fewer
 *    otherwise, and at least 2; dlpc_channel_info.capacity says how many (a waiting sender
 *    looks for room every DLPC_DIRECT_RETRY_MS);
 *  - STAT and LIST report the messages queued (depth) but not their bytes, the counts of sent
 *    and received messages or the waiting calls (0): the daemon sees none of it;
 *  - a message is checked by its receiver, with the checks dlpackd makes of a publish; one
 *    that fails them (a hostile sender's) is dropped, and dlpc_recv() says so (-EBADMSG). Its
 *    fds are closed on a thread of libdlpc's own (one per process), as such a close may never
 *    return (a file on a stalled FUSE server); at most DLPC_CLOSING_MAX (64) may wait for it:
 *    a channel that brings more refused fds once that many wait is no longer read (-EMFILE
 *    naming the channel and the bound) until they are closed, other channels go on. A process
 *    holds at most 64 + 253 such fds (+ a pidfd) per channel it receives from;
 *    dlpc_recv() leaves a bundle queued (-EINVAL) as on any channel, unless another receiver
 *    took it between libdlpc's look and its receive: a bundle that comes then is dropped;
 *  - a message describes at most about 1000 bytes of tensors (a few dozen tensors of a
 *    bundle; -EMSGSIZE beyond); no recycled buffers (dlpc_channel_alloc(): -ENOTSUP); no
 *    per-uid byte quota of the daemon's (the queued memory is the senders', in their memory
 *    cgroups; the kernel bounds the fds in flight by the senders' RLIMIT_NOFILE);
 *  - messages keep flowing between processes that joined if dlpackd dies; a process waiting
 *    on the channel sees the daemon go and fails with -ECONNRESET;
 *  - every process that uses the channel holds the same sockets: any of them can end it for
 *    all, as any receiver could take every message. They are trusted with its availability,
 *    never with each other's memory (a receiver checks every message).
 * Removal ends the sends and receives waiting on the channel with -EIDRM; later calls get
 * -ENOENT.
 */
#define DLPC_CHANNEL_DIRECT (1u << 0)
/** dlpc_channel_info.flags (protocol 1.10): the channel's stream has ended (see above). */
#define DLPC_CHANNEL_ENDED (1u << 1)
/**
 * dlpc_channel_open_flags() (protocol 1.10): a queued channel, created as one, and -EEXIST if
 * the channel exists as a direct one. Without DLPC_CHANNEL_QUEUED or DLPC_CHANNEL_DIRECT an
 * existing channel is opened whatever its kind (info->flags says which), and a new one is
 * queued (DLPC_CHANNEL_PREFER_DIRECT: direct where it can serve): only creating a channel picks
 * its kind.
 */
#define DLPC_CHANNEL_QUEUED (1u << 2)
/**
 * dlpc_channel_open_flags(): the kind dlpack_ipc.channel() picks by default (docs/channels.md,
 * "Which kind"): an existing channel is opened as the kind it is; a new one is direct where
 * the direct kind can serve, and queued where it cannot: where the kernel lets a direct channel
 * queue fewer messages than @p capacity (dlpc_channel_info.flags then has
 * DLPC_CHANNEL_FALLBACK_CAPACITY), or where dlpackd's fds or the uid's fd share have no room for
 * its two sockets or dlpackd cannot make them (DLPC_CHANNEL_FALLBACK_FDS). Not with
 * DLPC_CHANNEL_DIRECT or DLPC_CHANNEL_QUEUED (-EINVAL). Without any of the three flags, a new
 * channel is queued.
 */
#define DLPC_CHANNEL_PREFER_DIRECT (1u << 3)
/** dlpc_channel_info.flags: DLPC_CHANNEL_PREFER_DIRECT made this channel queued, as a direct
 * one could not queue its capacity (the kernel's socket buffer limit, net.core.wmem_max). */
#define DLPC_CHANNEL_FALLBACK_CAPACITY (1u << 4)
/** dlpc_channel_info.flags: DLPC_CHANNEL_PREFER_DIRECT made this channel queued, as dlpackd's
 * fd limit or the uid's fd share (--max-fd-share-per-uid) had no room for a direct one's two
 * sockets, or dlpackd could not make them (its RLIMIT_NOFILE, the system's file table, memory:
 * its log says which). */
#define DLPC_CHANNEL_FALLBACK_FDS (1u << 5)
/** dlpc_channel_close_flags(): end the stream for every producer, not only this one. */
#define DLPC_CHANNEL_CLOSE_ALL (1u << 0)

/** A channel, as dlpc_channel_open(), dlpc_channel_stat() and dlpc_channel_list() report it. */
typedef struct dlpc_channel_info {
	uint32_t size;		    /**< set by the caller to sizeof(dlpc_channel_info) */
	uint32_t capacity;	    /**< most messages it queues */
	uint32_t depth;		    /**< messages queued now */
	uint32_t receivers_waiting; /**< dlpc_recv() calls waiting for a message */
	uint32_t senders_waiting;   /**< dlpc_send() calls waiting for room */
	uint32_t owner_uid;	    /**< who opened it (it, or root, may remove it) */
	int32_t owner_pid;
	uint64_t bytes_queued; /**< the queued messages' storage sizes */
	uint64_t sent;	       /**< messages admitted since it was opened */
	uint64_t received;     /**< messages handed to receivers */
	int64_t created_ns;    /**< CLOCK_REALTIME when it was opened */
	char name[DLPC_NAME_MAX + 1];
	uint32_t flags;		     /**< DLPC_CHANNEL_DIRECT for a direct channel,
			   DLPC_CHANNEL_ENDED once its stream has ended (1.10),
			   DLPC_CHANNEL_FALLBACK_* for a queued one that
			   DLPC_CHANNEL_PREFER_DIRECT made queued */
	uint32_t producers;	     /**< 1.10: producers that have not closed */
	uint32_t producers_closed;   /**< 1.10: producers that closed (or whose connection ended) */
	uint32_t producers_expected; /**< 1.10: closes the end waits for at least (as opened) */
} dlpc_channel_info;

/**
 * Open the channel @p name, creating it with @p capacity (0: DLPC_CHANNEL_CAPACITY_DEFAULT) if
 * it does not exist. A channel counts as one entry against its uid's --max-entries-per-uid and
 * lives until dlpc_channel_remove(). If @p info is not NULL (info->size set) it is filled.
 * @return 1 if it was created, 0 if it existed; -EEXIST if it exists with another capacity than
 *         a non-zero @p capacity, -EINVAL for a bad name or a capacity above
 *         DLPC_CHANNEL_CAPACITY_MAX, -EDQUOT.
 */
DLPC_EXPORT int dlpc_channel_open(dlpc_client *c, const char *name, uint32_t capacity,
				  dlpc_channel_info *info);

/**
 * dlpc_channel_open() with @p flags: DLPC_CHANNEL_DIRECT opens (creates) a direct channel,
 * DLPC_CHANNEL_QUEUED a queued one; neither opens an existing channel of either kind and
 * creates a queued one; DLPC_CHANNEL_PREFER_DIRECT opens an existing channel of either kind and
 * creates a direct one where that kind can serve (dlpack_ipc.channel()'s default; the rule is
 * docs/channels.md's "Which kind").
 * @return as dlpc_channel_open(); -EEXIST also if the channel exists as the other kind than
 *         the one asked for (the message names its kind), -EINVAL for unknown flags or more
 *         than one of the three.
 */
DLPC_EXPORT int dlpc_channel_open_flags(dlpc_client *c, const char *name, uint32_t capacity,
					uint32_t flags, dlpc_channel_info *info);

/** Options of dlpc_channel_open_opts(). */
typedef struct dlpc_channel_opts {
	uint32_t size;	    /**< sizeof(dlpc_channel_opts) */
	uint32_t capacity;  /**< as dlpc_channel_open()'s */
	uint32_t flags;	    /**< as dlpc_channel_open_flags()'s */
	uint32_t producers; /**< a new channel: its stream ends only once at least this many
			       producers closed (0: 1), so that producers starting at different
			       times cannot end it early; at most DLPC_CHANNEL_PRODUCERS_MAX. An
			       existing channel opened with another non-zero count: -EEXIST */
} dlpc_channel_opts;

/** The largest dlpc_channel_opts.producers. */
#define DLPC_CHANNEL_PRODUCERS_MAX 65536
/** Channels one connection may be a producer of at once (protocol 1.10): dlpackd keeps a small
 * record for each (charged to the uid's --max-memory-per-uid) until the connection or the
 * channel goes. */
#define DLPC_PRODUCING_MAX 1024

/** dlpc_channel_open_flags() with every option (protocol 1.10 for producers). */
DLPC_EXPORT int dlpc_channel_open_opts(dlpc_client *c, const char *name,
				       const dlpc_channel_opts *opts, dlpc_channel_info *info);

/**
 * This connection sends no more to the channel @p name (protocol 1.10): it counts as a producer
 * that has closed, whether or not it sent anything (a consumer does not call it). Once every
 * producer has closed, and at least dlpc_channel_opts.producers of them, the stream ends (see
 * "End of stream" above). Closing twice is as once. Its later sends fail with -EPIPE; it may
 * still receive.
 * @return 0; -ENOENT, -EDQUOT (the connection is a producer of DLPC_PRODUCING_MAX channels).
 */
DLPC_EXPORT int dlpc_channel_close(dlpc_client *c, const char *name);

/**
 * dlpc_channel_close() with @p flags: DLPC_CHANNEL_CLOSE_ALL ends the stream at once for every
 * producer (the channel's owner uid or root only: -EPERM); sends waiting for room fail with
 * -EPIPE and their messages are dropped, what is queued stays for the receivers.
 */
DLPC_EXPORT int dlpc_channel_close_flags(dlpc_client *c, const char *name, uint32_t flags);

/**
 * Remove the channel @p name: its queued messages are freed, unread (to end a stream and keep
 * them for the receivers, dlpc_channel_close()), and every send or receive waiting on it fails
 * with -EIDRM. Only its owner's uid or root may.
 * @return 0, -ENOENT if there is none, -EPERM.
 */
DLPC_EXPORT int dlpc_channel_remove(dlpc_client *c, const char *name);

/** Describe the channel @p name into @p info (info->size set). @return 0 or -ENOENT. */
DLPC_EXPORT int dlpc_channel_stat(dlpc_client *c, const char *name, dlpc_channel_info *info);

/**
 * Every channel whose name starts with @p prefix (NULL or "": all), sorted by name, in a new
 * array of *@p n (*@p ret, freed with free(); NULL when there are none).
 * @return 0 or a negative errno.
 */
DLPC_EXPORT int dlpc_channel_list(dlpc_client *c, const char *prefix, dlpc_channel_info **ret,
				  size_t *n);

/** dlpc_send(), dlpc_send_bundle(): fail with -EAGAIN at once when the channel is full. */
#define DLPC_SEND_NOWAIT (1u << 0)

/** Options of dlpc_send_bundle(). */
typedef struct dlpc_send_opts {
	uint32_t size;	    /**< sizeof(dlpc_send_opts) */
	uint32_t flags;	    /**< DLPC_SEND_* bits */
	int64_t timeout_ms; /**< the channel full: wait up to this long for room; < 0: without
			       end; 0: as DLPC_SEND_NOWAIT */
} dlpc_send_opts;

/**
 * Send @p t as one message to the channel @p channel, waiting for room as long as it takes
 * (unless DLPC_SEND_NOWAIT is in @p flags). The tensor is copied into fresh shared memory, or
 * sent as is if it is dlpc_alloc() memory (then it is sealed read-only, as by dlpc_publish()).
 * Like dlpc_publish(), the call takes ownership of @p t: its deleter runs exactly once, here.
 * Host tensors only.
 * The first send makes this connection a producer of the channel (see "End of stream").
 * @return 0; -ENOENT if no such channel is open, -EAGAIN if it is full and the call may not
 *         wait, -EIDRM if it was removed while the call waited, -EPIPE if its stream has ended
 *         or this connection closed it (dlpc_channel_close()), -ENOTSUP for a CUDA tensor,
 *         -EDQUOT, or another negative errno of dlpc_publish().
 */
DLPC_EXPORT int dlpc_send(dlpc_client *c, const char *channel, DLManagedTensorVersioned *t,
			  uint32_t flags);

/**
 * Send @p n tensors under @p keys as one message (a bundle; with @p n 1, @p keys may be NULL
 * and the message is one tensor). @p opts NULL: wait for room without end. Otherwise as
 * dlpc_send(), -ETIMEDOUT when opts->timeout_ms passed without room.
 */
DLPC_EXPORT int dlpc_send_bundle(dlpc_client *c, const char *channel, size_t n,
				 const char *const keys[],
				 DLManagedTensorVersioned *const tensors[],
				 const dlpc_send_opts *opts);

/** Buffers one connection's pool of recycled channel memory holds (dlpc_channel_alloc()). */
#define DLPC_POOL_BUFFERS_MAX 64

/**
 * Recycled memory for a message to @p channel: a writable host tensor of @p dtype and
 * @p shape from this connection's pool. Send it with dlpc_send() on the same connection; once
 * a receiver has released the message (or the channel dropped it) dlpackd gives the buffer back
 * and a later dlpc_channel_alloc() of a size that fits (up to twice the need) hands it out
 * again, already mapped: a steady pipeline asks the kernel for no fresh pages.
 *
 * A pooled message is NOT read-only for its sender: its buffer stays mapped writable in the
 * sender, which can change it while a receiver reads it. That is the price of recycling, as
 * with torch.multiprocessing; ordinary sends and publishes stay sealed read-only. Do not write a
 * buffer after sending it. Receivers cannot write it: the message carries a read-only
 * descriptor (O_RDONLY) of a memfd without write permission bits, which a receiver can neither
 * map writable, write, nor reopen read-write through /proc/self/fd; a receiver that wants to
 * write receives it copy-on-write (DLPC_ATTACH_PRIVATE). Where /proc is not mounted, no
 * read-only descriptor can be had: the tensor is then memory of its own, not pooled, sealed
 * read-only when sent (as dlpc_alloc() memory is).
 *
 * A buffer whose message may be queued but whose return can no longer come (in flight when the
 * connection was lost, or sent without an answer: the call gave up) leaves the pool for good;
 * its memory goes when the message and every handle on it are gone.
 *
 * @return 0; -ENOBUFS when all DLPC_POOL_BUFFERS_MAX buffers are in flight or held,
 *         -EINVAL, -ENOSPC.
 */
DLPC_EXPORT int dlpc_channel_alloc(dlpc_client *c, const char *channel, DLDataType dtype,
				   int32_t ndim, const int64_t *shape,
				   DLManagedTensorVersioned **ret);

/** Options of dlpc_recv() and dlpc_recv_bundle(). */
typedef struct dlpc_recv_opts {
	uint32_t size;	    /**< sizeof(dlpc_recv_opts) */
	uint32_t flags;	    /**< DLPC_ATTACH_PRIVATE or DLPC_ATTACH_GUARDED: how to map it;
			       DLPC_ATTACH_NO_CACHE: do not keep its mapping (dlpc_connect_flags());
			       DLPC_ATTACH_POPULATE: populate it up front (DLPC_ATTACH_WRITABLE
			       is refused, -EINVAL: a message is read-only to its receivers) */
	int64_t timeout_ms; /**< the channel empty: 0 fail with -EAGAIN; > 0 wait up to this
			       long; < 0 wait without end */
} dlpc_recv_opts;

/**
 * Receive the oldest message of the channel @p channel, a single tensor: mapped read-only
 * like an attached entry (see dlpc_attach()), its storage freed once the tensor's deleter ran.
 * @p opts NULL: wait without end, read-only mapping. dlpc_tensor_attach_info() says who sent it
 * (generation: the message's sequence number in the channel; 0 on a direct channel).
 * @return 0; -EPIPE once the stream has ended and every message queued before the end was
 *         received (a call waiting then is woken with it), -EAGAIN (empty, timeout 0),
 *         -ETIMEDOUT, -ENOENT (no such channel), -EIDRM (it was removed while the call
 *         waited), -EINVAL if the next message is a bundle, of several tensors or of one
 *         under a non-empty key (it stays
 *         queued: receive it with dlpc_recv_bundle()), -EMFILE when this process has no free
 *         fd for the storage's (checked before a message is taken: it stays queued; another
 *         thread taking the last fd meanwhile can still make one lost); on a direct channel
 *         also -EBADMSG (a message that failed the receiver's checks, dropped), -EMFILE
 *         naming DLPC_CLOSING_MAX (the channel's senders sent fds that were refused while
 *         that many waited to be closed: nothing more is taken from it until they are),
 *         -ECONNRESET
 *         (the connection to dlpackd ended while the call waited); -ECANCELED after
 *         dlpc_close() or dlpc_cancel(); or another negative errno.
 */
DLPC_EXPORT int dlpc_recv(dlpc_client *c, const char *channel, const dlpc_recv_opts *opts,
			  DLManagedTensorVersioned **ret);

/** Receive the oldest message of @p channel, a bundle or a single tensor (one tensor, key "").
 * As dlpc_recv() otherwise. */
DLPC_EXPORT int dlpc_recv_bundle(dlpc_client *c, const char *channel, const dlpc_recv_opts *opts,
				 dlpc_bundle **ret);

#ifdef __cplusplus
}
#endif

#endif /* DLPC_DLPC_H */
