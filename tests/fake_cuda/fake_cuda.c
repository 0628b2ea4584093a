/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A fake CUDA driver: a test double for libdlpc's GPU paths on machines without a GPU. Never
 * installed. It exports the driver entry points libdlpc and bench/bench_gpu resolve, under the
 * same (versioned) symbol names and signatures, and backs "device memory" with host memfds so
 * that it works across real processes:
 *
 * - A device pointer is a host address: tests read and write device memory directly.
 * - cuMemAlloc makes a memfd and maps it. Its IPC handle holds the exporter's pid, the memfd's
 *   fd number and an allocation id; cuIpcOpenMemHandle reopens /proc/<pid>/fd/<fd> (checking
 *   the memfd's name carries the id) and maps it. Opening one's own handle fails, as it does
 *   with the real driver.
 * - cuMemCreate makes a memfd; its POSIX-fd export is a duplicate of it; import, reserve, map
 *   and set-access do what their names say with mmap and mprotect.
 * - Events and streams are small records. An interprocess event handle carries the creator's
 *   pid and the event's id, so a test can tell which event a consumer waited on.
 * - $FAKE_CUDA_DEVICES devices (1 to FAKE_DEVICES_MAX, default 1), device k with the UUID
 *   "fake-cuda-dev-k!"; $FAKE_CUDA_VISIBLE ("1,0") lists which of them the process sees, in
 *   its ordinal order, as CUDA_VISIBLE_DEVICES does. Each has a primary context; memory
 *   belongs to the device whose context is current when it is made (device 0's when none is,
 *   more lenient than the real driver), or that cuMemCreate names.
 * - A process may hold FAKE_IPC_EVENTS_MAX interprocess events ($FAKE_CUDA_IPC_EVENTS_MAX);
 *   one more (created or opened) is CUDA_ERROR_OUT_OF_MEMORY, logged as "ipc-event-limit".
 * - Every call but cuGetErrorString needs cuInit first, in the calling process: before it, and
 *   in a forked child of a process that called it (where the real driver's behaviour is
 *   undefined), calls answer CUDA_ERROR_NOT_INITIALIZED; a child's are logged as "after-fork".
 *
 * Every call a test may ask about is appended as one line, "<pid> <function> <details>", to the
 * file named by $FAKE_CUDA_LOG (if set). $FAKE_CUDA_NO_IPC=1 makes the IPC calls answer
 * CUDA_ERROR_NOT_SUPPORTED, as on WSL or Tegra; $FAKE_CUDA_NO_DEVICE=1 makes cuInit answer
 * CUDA_ERROR_NO_DEVICE. $FAKE_CUDA_DEVICE_STATE naming a file models a device without
 * persistence mode (device_start() below).
 *
 * Work on a stream is complete when the call returns, unless a test holds the stream
 * (fake_cuda_stream_hold(), standing for a long kernel, or fake_cuda_kernel(), one that ends
 * when the fake's clock says so): then events recorded on it stay
 * pending (cuEventQuery: CUDA_ERROR_NOT_READY) and synchronizing waits, until it is let go,
 * destroyed or not. Work the tests queue (fake_cuda_write_later(), _read_later()) runs in
 * stream order, after the events its stream waits for; memory it uses that is freed or
 * unmapped before it ran aborts the process ("freed-under-pending-work"). A
 * test can also start a capture on a stream (fake_cuda_capture(), as another thread of the
 * process would, in global mode): while one runs, a potentially unsafe call (synchronizing,
 * querying an event) from a thread not in relaxed mode (cuThreadExchangeStreamCaptureMode)
 * fails and invalidates the capture, logged as "capture-invalidated by <function>", as with
 * the real driver; the legacy stream is unusable only while a blocking stream captures (the
 * README says what was seen on an H200).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_api.h"

#define EXPORT __attribute__((visibility("default")))
#define FAKE_DEVICES_MAX 8
#define FAKE_GRANULARITY (2u << 20) /* what current GPUs report */
#define IPC_MAGIC 0x46414b45u	    /* "FAKE" */
#define DEAD_MAGIC 0x44454144u	    /* "DEAD": a destroyed stream */

struct ipc_mem {
	uint32_t magic;
	int32_t pid, fd;
	uint32_t id;
	uint64_t size;
	int32_t dev; /* the device it lives on */
};

struct ipc_ev {
	uint32_t magic;
	int32_t pid;
	uint32_t id;
};

enum kind { ALLOC, IMPORT, VMM_HANDLE, RESERVED };

struct obj {
	struct obj *next;
	enum kind kind;
	uint32_t id;
	uintptr_t base;
	size_t size;
	int fd;		 /* ALLOC and VMM_HANDLE: the memfd */
	bool pool;	 /* ALLOC: from cuMemAllocAsync (a stream-ordered pool) */
	unsigned refs;	 /* VMM_HANDLE: its creator's, and one per mapping or retain */
	uint32_t mapped; /* RESERVED: the handle mapped at its start (0: none) */
	size_t msize;	 /* and the size of that mapping */
	int dev;	 /* ALLOC, IMPORT, VMM_HANDLE: the device it lives on */
};

/* Work queued on a stream that cannot run yet (fake_cuda_write_later(), _read_later(), a
 * host function of cuLaunchHostFunc() or a kernel of cuLaunchKernel()). */
struct op {
	struct op *next;
	void *dst;
	const void *src;
	size_t n;
	void *copy;  /* a write's bytes, taken when it was queued */
	CUhostFn fn; /* a host function: called on the fake's host-function thread */
	void *arg;
	CUstream on; /* a host function's stream: its later work waits until it returns */
	/* a kernel of cuLaunchKernel(): run on the host, with its arguments taken at launch */
	void (*kern)(const struct op *o);
	uint64_t kargs[3];
};

struct CUstream_st {
	uint32_t magic; /* IPC_MAGIC; DEAD_MAGIC once destroyed */
	unsigned flags; /* cuStreamCreate's: CU_STREAM_NON_BLOCKING or not */
	bool held;	/* fake_cuda_stream_hold(): its work does not complete */
	uint64_t
		until; /* held by fake_cuda_kernel() until the clock reaches it (0: until let go) */
	unsigned releases; /* how many times it was let go */
	bool capturing;	   /* fake_cuda_capture() */
	int32_t wait_pid;  /* waits for that process's interprocess event (0: none) */
	uint32_t wait_id;
	/* waits for an event of this process's (cuStreamWaitEvent): recorded behind the work of
	 * held stream wait_on, up to its let-go number wait_releases, or on the legacy stream
	 * while a blocking stream was held (wait_legacy) */
	CUstream wait_on;
	unsigned wait_releases;
	bool wait_legacy;
	struct op *ops, **ops_end; /* queued work, in order */
	bool host_fn_running;	   /* a host function of its runs: its later work waits for it */
	CUstream next_dead;	   /* once destroyed */
	CUstream next_all;	   /* every stream made, destroyed ones included */
};

struct CUevent_st {
	uint32_t magic, id;
	int32_t pid; /* creator of the event (the exporter's, for an opened IPC event) */
	unsigned flags;
	CUstream behind; /* recorded on this held stream, pending until it is let go */
	unsigned behind_releases;
	bool captured;	    /* recorded inside a capture: the graph holds it, not the stream */
	bool behind_legacy; /* recorded on the legacy stream while a stream was held */
	int32_t after_pid;  /* recorded on a stream waiting for that process's event */
	uint32_t after_id;
	CUstream via; /* recorded on a stream waiting for held stream via (its wait_on) */
	unsigned via_releases;
	bool via_legacy;     /* recorded on a stream waiting for the legacy stream's held work */
	CUevent next_marked; /* see marked */
	bool marked;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct obj *objs;
static uint32_t next_id;
static char ctx_tokens[FAKE_DEVICES_MAX]; /* device k's primary context: &ctx_tokens[k] */
static __thread int ctx_stack[64];	  /* the devices of this thread's pushed contexts */
static __thread int ctx_depth;
static int ndevices = 1;		    /* $FAKE_CUDA_DEVICES */
static int visible[FAKE_DEVICES_MAX] = {0}; /* ordinal -> device ($FAKE_CUDA_VISIBLE) */
static int nvisible = 1;
static pid_t init_pid;	  /* the process that called cuInit, 0 before */
static unsigned instance; /* the device instance this process runs on (device_start()) */
static pthread_cond_t let_go_cv = PTHREAD_COND_INITIALIZER; /* a held stream was let go */
static unsigned held_streams, captures;			    /* how many streams are so */
static unsigned held_blocking;	   /* held streams that are blocking: the legacy stream waits */
static uint64_t fake_clock;	   /* the fake's time, in ticks (fake_cuda_kernel()) */
static bool capture_broken;	   /* a call invalidated the captures under way */
static unsigned blocking_captures; /* of them, on blocking streams (the legacy one unusable) */
static bool sticky;		   /* fake_cuda_sticky_error(): the context is lost */
/* Interprocess events of this process recorded behind work that has not run: each has a marker
 * file (marker_path()) while it is pending, which is how other processes see it. */
static CUevent marked;
static CUstream dead_streams; /* destroyed streams (see cuStreamDestroy) */
static CUstream all_streams;  /* every stream made (next_all) */
/* The queue of work the hooks put on the legacy stream (NULL, CU_STREAM_LEGACY) or the
 * per-thread default stream, which the fake does not tell apart from it. */
static struct CUstream_st legacy_q = {.magic = IPC_MAGIC, .ops_end = &legacy_q.ops};
/* Host functions whose turn has come, for the fake's host-function thread (as the driver has
 * one of its own: never the caller's thread), in order. */
static struct op *host_fns, **host_fns_end = &host_fns;
static pthread_cond_t host_fns_cv = PTHREAD_COND_INITIALIZER;
static __thread CUstreamCaptureMode capture_mode; /* GLOBAL, the default */
/* Interprocess events alive in this process (created or opened), and how many the fake allows
 * ($FAKE_CUDA_IPC_EVENTS_MAX, default FAKE_IPC_EVENTS_MAX): the real driver runs out of them
 * at a limit of its own. */
#define FAKE_IPC_EVENTS_MAX 1024
static unsigned ipc_events;

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void logf_(const char *fmt, ...)
{
	const char *path = getenv("FAKE_CUDA_LOG");
	char line[512];
	int n, fd;
	va_list ap;

	if (!path)
		return;
	n = snprintf(line, sizeof(line), "%d ", (int)getpid());
	va_start(ap, fmt);
	n += vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	line[n++] = '\n';
	fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return;
	if (write(fd, line, (size_t)n) < 0) {
		/* a test that reads the log fails on its own */
	}
	close(fd);
}

/*
 * Can the calling process use the driver? Not before cuInit, as with the real one; and not in
 * a forked child of a process that initialized it, where the real driver's behaviour is
 * undefined: every such call is logged as "after-fork <function>", for tests to catch.
 */
static bool usable(const char *fn)
{
	if (init_pid == getpid())
		return true;
	if (init_pid)
		logf_("after-fork %s (initialized by %d)", fn, (int)init_pid);
	return false;
}

/* A stream the fake made (not NULL, CU_STREAM_LEGACY or CU_STREAM_PER_THREAD). */
static bool made_stream(CUstream s)
{
	return (uintptr_t)s > 2 && s->magic == IPC_MAGIC;
}

/*
 * Is @p s usable by @p fn? The special streams (NULL, legacy, per-thread) are; a stream the fake
 * made is until cuStreamDestroy. Using a destroyed stream is undefined behaviour with the real
 * driver, which may crash on it at any later time: the fake aborts at once, naming the call,
 * so a test sees a crash rather than an error code it might ignore.
 */
static bool stream_ok(CUstream s, const char *fn)
{
	if ((uintptr_t)s <= 2)
		return true;
	if (s->magic == DEAD_MAGIC) {
		logf_("use-after-destroy %s stream=%p", fn, (void *)s);
		fprintf(stderr,
			"fake_cuda: %s: stream %p was destroyed by cuStreamDestroy; using it is "
			"undefined behaviour (the real driver may crash): aborting\n",
			fn, (void *)s);
		abort();
	}
	return s->magic == IPC_MAGIC;
}

/* Where the marker of process @p pid's interprocess event @p id lies: beside the log. */
static void marker_path(char *buf, size_t len, int32_t pid, uint32_t id)
{
	const char *log = getenv("FAKE_CUDA_LOG");

	snprintf(buf, len, "%s.ev-%d-%u", log && *log ? log : "/tmp/fake-cuda", (int)pid, id);
}

/* Is process @p pid's interprocess event @p id still pending (its marker there)? */
static bool remote_pending(int32_t pid, uint32_t id)
{
	char path[600];

	marker_path(path, sizeof(path), pid, id);
	return access(path, F_OK) == 0;
}

/* Is @p e's record still behind work that has not run? Called with mu. */
static bool pending(CUevent e)
{
	/* an event opened from another process: as that process says */
	if (e->pid != getpid())
		return remote_pending(e->pid, e->id);
	if (e->after_pid && remote_pending(e->after_pid, e->after_id))
		return true;
	/* recorded on a stream that waited for another stream's work that has not run */
	if ((e->via && e->via->held && e->via->releases == e->via_releases) ||
	    (e->via_legacy && held_blocking > 0))
		return true;
	/* the legacy stream waits for every (blocking) stream: pending while any is held */
	if (e->behind_legacy)
		return held_blocking > 0;
	return e->behind && e->behind->held && e->behind->releases == e->behind_releases;
}

/*
 * Can work on @p s not run yet (held, or waiting for an event whose work has not run: another
 * process's, or this one's behind a held stream)? The legacy stream's queue waits for every
 * held blocking stream. With mu.
 */
static bool blocked(CUstream s)
{
	if (s->host_fn_running)
		return true;
	if (s == &legacy_q)
		return held_blocking > 0;
	if (s->wait_pid && !remote_pending(s->wait_pid, s->wait_id))
		s->wait_pid = 0;
	/* the work the event was recorded behind must have run too, not only been let go */
	if (s->wait_on && !(s->wait_on->held && s->wait_on->releases == s->wait_releases) &&
	    !s->wait_on->ops)
		s->wait_on = NULL;
	if (s->wait_legacy && held_blocking == 0)
		s->wait_legacy = false;
	return s->held || s->wait_pid || s->wait_on || s->wait_legacy;
}

/* Run @p s's queued work if it can run. Called with mu. */
static void run_ops(CUstream s)
{
	struct op *o;

	if (blocked(s))
		return;
	while ((o = s->ops)) {
		s->ops = o->next;
		if (o->fn) {
			/* the work after it waits until it returns, as with the real driver */
			o->next = NULL;
			o->on = s;
			*host_fns_end = o;
			host_fns_end = &o->next;
			s->host_fn_running = true;
			pthread_cond_signal(&host_fns_cv);
			if (s->ops)
				logf_("work-behind-host-function stream=%p",
				      s == &legacy_q ? (void *)CU_STREAM_LEGACY : (void *)s);
			break;
		}
		if (o->kern)
			o->kern(o);
		else
			memcpy(o->dst, o->copy ? o->copy : o->src, o->n);
		free(o->copy);
		free(o);
	}
	if (!s->ops)
		s->ops_end = &s->ops;
}

/* Run the queued work of every stream (destroyed ones too) that can run now, until none
 * moves: a stream waiting for another's work runs once that work has run, whichever of the two
 * was made first. With mu. */
static void run_all(void)
{
	bool moved = true;

	while (moved) {
		struct op *before;

		moved = false;
		for (CUstream s = all_streams; s; s = s->next_all) {
			before = s->ops;
			run_ops(s);
			moved |= s->ops != before;
		}
		before = legacy_q.ops;
		run_ops(&legacy_q);
		moved |= legacy_q.ops != before;
	}
}

/* Does queued work @p o touch [@p base, @p base + @p size)? */
static bool op_touches(const struct op *o, uintptr_t base, size_t size)
{
	uintptr_t d = (uintptr_t)o->dst, s = (uintptr_t)o->src;

	return (d < base + size && base < d + o->n) ||
	       (!o->copy && s < base + size && base < s + o->n);
}

/*
 * Memory at [@p base, @p base + @p size) is about to be unmapped or freed by @p fn. Work still
 * queued on a stream that reads or writes it would fault on the device (an illegal address,
 * which ends the context): the fake logs "freed-under-pending-work <function>", says so on
 * stderr and aborts, so that a release ordered too early fails by construction.
 */
static void check_no_work_on(uintptr_t base, size_t size, const char *fn)
{
	bool busy = false;

	pthread_mutex_lock(&mu);
	run_all();
	for (CUstream s = all_streams; s && !busy; s = s->next_all)
		for (struct op *o = s->ops; o && !busy; o = o->next)
			busy = op_touches(o, base, size);
	for (struct op *o = legacy_q.ops; o && !busy; o = o->next)
		busy = op_touches(o, base, size);
	pthread_mutex_unlock(&mu);
	if (!busy)
		return;
	logf_("freed-under-pending-work %s ptr=%#lx", fn, (unsigned long)base);
	fprintf(stderr,
		"fake_cuda: %s: memory at %#lx is still used by work queued on a stream that has "
		"not run (a kernel would fault on it): aborting\n",
		fn, (unsigned long)base);
	abort();
}

/* Take down the markers of this process's events that are no longer pending. With mu. */
static void sweep_markers(void)
{
	char path[600];

	for (CUevent *pp = &marked; *pp;) {
		CUevent e = *pp;

		if (e->magic == IPC_MAGIC && pending(e)) {
			pp = &e->next_marked;
			continue;
		}
		marker_path(path, sizeof(path), e->pid, e->id);
		unlink(path);
		e->marked = false;
		*pp = e->next_marked;
	}
}

/* The legacy stream (NULL is it too, for the driver API) while a blocking stream captures:
 * every use of it is an error. A capture on a non-blocking stream leaves it alone, as the
 * legacy stream does not follow such a stream (seen on an H200: cuStreamIsCapturing of the
 * legacy stream says NONE, and an event recorded on it keeps the capture whole). With mu. */
static bool legacy_unusable(CUstream s)
{
	return !made_stream(s) && s != CU_STREAM_PER_THREAD && blocking_captures > 0;
}

/* A capture was invalidated by @p fn: logged, and the capturing streams say so. */
static void invalidate(const char *fn)
{
	pthread_mutex_lock(&mu);
	capture_broken = true;
	pthread_mutex_unlock(&mu);
	logf_("capture-invalidated by %s", fn);
}

/*
 * A potentially unsafe call while a stream captures in global mode (as fake_cuda_capture()
 * models it): refused, and the capture invalidated, unless the calling thread is in relaxed or
 * thread-local mode (which ignores other threads' captures). true if refused.
 */
static bool capture_refuses(const char *fn)
{
	bool refuse;

	pthread_mutex_lock(&mu);
	refuse = captures && capture_mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
	pthread_mutex_unlock(&mu);
	if (refuse)
		invalidate(fn);
	return refuse;
}

/* Test hooks (tests find them with dlsym): see the top of this file. */
EXPORT void fake_cuda_stream_hold(CUstream s, int on);
EXPORT void fake_cuda_capture(CUstream s, int on);
EXPORT void fake_cuda_write_later(CUstream s, void *dst, const void *src, size_t n);
EXPORT void fake_cuda_read_later(CUstream s, const void *src, void *dst, size_t n);
EXPORT unsigned fake_cuda_live(void);
EXPORT void fake_cuda_kernel(CUstream s, unsigned ticks);
EXPORT void fake_cuda_clock_advance(unsigned ticks);
EXPORT void fake_cuda_sticky_error(void);
static bool time_step(void);

static bool env_on(const char *name)
{
	const char *v = getenv(name);

	return v && strcmp(v, "1") == 0;
}

/* Take one of the interprocess events the fake allows (false: none left). */
static bool ipc_event_take(void)
{
	const char *v = getenv("FAKE_CUDA_IPC_EVENTS_MAX");
	unsigned max = v && *v ? (unsigned)strtoul(v, NULL, 10) : FAKE_IPC_EVENTS_MAX;
	bool ok;

	pthread_mutex_lock(&mu);
	ok = ipc_events < max;
	ipc_events += ok;
	pthread_mutex_unlock(&mu);
	if (!ok)
		logf_("ipc-event-limit %u", max);
	return ok;
}

static struct obj *obj_new(enum kind kind, uintptr_t base, size_t size, int fd)
{
	struct obj *o = calloc(1, sizeof(*o));

	if (!o)
		return NULL;
	o->kind = kind;
	o->base = base;
	o->size = size;
	o->fd = fd;
	pthread_mutex_lock(&mu);
	o->id = ++next_id;
	o->next = objs;
	objs = o;
	pthread_mutex_unlock(&mu);
	return o;
}

/* The object of @p kind at or (if @p inside) containing @p p; unlinked if @p take. */
static struct obj *obj_find(int kind, uintptr_t p, bool inside, bool take)
{
	struct obj *o = NULL;

	pthread_mutex_lock(&mu);
	for (struct obj **pp = &objs; *pp; pp = &(*pp)->next) {
		struct obj *x = *pp;

		if ((kind >= 0 && x->kind != (enum kind)kind) || x->kind == VMM_HANDLE)
			continue;
		if (x->base == p || (inside && p > x->base && p < x->base + x->size)) {
			o = x;
			if (take)
				*pp = x->next;
			break;
		}
	}
	pthread_mutex_unlock(&mu);
	return o;
}

static struct obj *handle_find(CUmemGenericAllocationHandle h, bool take)
{
	struct obj *o = NULL;

	pthread_mutex_lock(&mu);
	for (struct obj **pp = &objs; *pp; pp = &(*pp)->next)
		if ((*pp)->kind == VMM_HANDLE && (*pp)->id == h) {
			o = *pp;
			if (take)
				*pp = o->next;
			break;
		}
	pthread_mutex_unlock(&mu);
	return o;
}

/* The device of the thread's current context (device 0's when there is none). */
static int current_device(void)
{
	return ctx_depth ? ctx_stack[ctx_depth - 1] : visible[0];
}

/* The ordinal this process sees device @p dev under; -1 if it does not see it. */
static int ordinal_of(int dev)
{
	for (int i = 0; i < nvisible; i++)
		if (visible[i] == dev)
			return i;
	return -1;
}

/* Read $FAKE_CUDA_DEVICES and $FAKE_CUDA_VISIBLE; false if they make no sense. */
static bool devices_start(void)
{
	const char *n = getenv("FAKE_CUDA_DEVICES"), *v = getenv("FAKE_CUDA_VISIBLE");
	char *end;

	if (n && *n) {
		ndevices = (int)strtol(n, &end, 10);
		if (*end || ndevices < 1 || ndevices > FAKE_DEVICES_MAX)
			return false;
	}
	nvisible = ndevices;
	for (int i = 0; i < ndevices; i++)
		visible[i] = i;
	if (v) {
		nvisible = 0;
		while (*v) {
			long d = strtol(v, &end, 10);

			if (end == v || d < 0 || d >= ndevices || nvisible == FAKE_DEVICES_MAX)
				return false;
			visible[nvisible++] = (int)d;
			v = *end == ',' ? end + 1 : end;
			if (*end && *end != ',')
				return false;
		}
	}
	return nvisible > 0;
}

static int memfd_of(size_t size, uint32_t *id, int dev)
{
	char name[48];
	int fd;

	pthread_mutex_lock(&mu);
	*id = ++next_id;
	pthread_mutex_unlock(&mu);
	snprintf(name, sizeof(name), "fake-cuda:%u@%u:dev%d", *id, instance, dev);
	fd = memfd_create(name, MFD_CLOEXEC);
	if (fd < 0)
		return -1;
	if (ftruncate(fd, (off_t)size) < 0) {
		close(fd);
		return -1;
	}
	return fd;
}

/*
 * Without persistence mode the real driver tears a device down when the last process using it
 * exits, and the memory exported from it goes too: an fd exported by a process that has exited
 * may no longer import. With $FAKE_CUDA_DEVICE_STATE naming a file the fake models that (and
 * otherwise behaves as with persistence mode on). Every process that calls cuInit holds a
 * shared lock on the file while it lives; one that finds no other holder starts a new device
 * instance, a counter kept in the file. Allocations carry the instance they were made on (in
 * their memfd's name), and an import of one from an earlier instance fails.
 */
static void device_start(void)
{
	const char *path = getenv("FAKE_CUDA_DEVICE_STATE");
	char buf[16] = {0};
	unsigned n = 0;
	ssize_t len;
	int fd;

	if (!path || !*path)
		return;
	fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return;
	if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
		len = pread(fd, buf, sizeof(buf) - 1, 0);
		n = (len > 0 ? (unsigned)strtoul(buf, NULL, 10) : 0) + 1;
		len = snprintf(buf, sizeof(buf), "%u\n", n);
		if (pwrite(fd, buf, (size_t)len, 0) != len || ftruncate(fd, len) < 0)
			n = 0;
		logf_("device-instance %u (the device was idle: started anew)", n);
	}
	/* read after the process that starts an instance has written it */
	if (flock(fd, LOCK_SH) < 0) {
		close(fd);
		return;
	}
	len = pread(fd, buf, sizeof(buf) - 1, 0);
	buf[len > 0 ? len : 0] = 0;
	instance = (unsigned)strtoul(buf, NULL, 10);
	/* fd stays open, holding the lock, for as long as the process lives */
}

/* The name of the fake's memfd @p fd ("/memfd:fake-cuda:<id>@<instance>:dev<device>..."), in
 * @p buf of @p len bytes; NULL for any other file. */
static const char *memfd_name(int fd, char *buf, size_t len)
{
	char path[64];
	ssize_t n;

	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	n = readlink(path, buf, len - 1);
	if (n <= 0)
		return NULL;
	buf[n] = 0;
	return strncmp(buf, "/memfd:fake-cuda:", 17) == 0 ? buf : NULL;
}

/* The device instance an allocation's memfd was made on (0: unknown). */
static unsigned instance_of(int fd)
{
	char buf[128];
	const char *name = memfd_name(fd, buf, sizeof(buf)), *at = name ? strchr(name, '@') : NULL;

	return at ? (unsigned)strtoul(at + 1, NULL, 10) : 0;
}

/* The device an allocation's memfd was made on (0: unknown). */
static int device_of(int fd)
{
	char buf[128];
	const char *name = memfd_name(fd, buf, sizeof(buf)),
		   *d = name ? strstr(name, ":dev") : NULL;

	return d ? (int)strtol(d + 4, NULL, 10) : 0;
}

EXPORT CUresult cuInit(unsigned int flags)
{
	(void)flags;
	if (init_pid && init_pid != getpid()) {
		logf_("after-fork cuInit (initialized by %d)", (int)init_pid);
		return CUDA_ERROR_NOT_INITIALIZED;
	}
	if (env_on("FAKE_CUDA_NO_DEVICE"))
		return CUDA_ERROR_NO_DEVICE;
	if (!init_pid && !devices_start())
		return CUDA_ERROR_INVALID_VALUE;
	if (!init_pid)
		device_start();
	init_pid = getpid();
	return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorString(CUresult error, const char **str)
{
	switch (error) {
	case CUDA_SUCCESS:
		*str = "no error";
		break;
	case CUDA_ERROR_INVALID_VALUE:
		*str = "invalid argument";
		break;
	case CUDA_ERROR_OUT_OF_MEMORY:
		*str = "out of memory";
		break;
	case CUDA_ERROR_NOT_SUPPORTED:
		*str = "operation not supported";
		break;
	case CUDA_ERROR_INVALID_HANDLE:
		*str = "invalid resource handle";
		break;
	case CUDA_ERROR_INVALID_CONTEXT:
		*str = "invalid device context";
		break;
	case CUDA_ERROR_NOT_INITIALIZED:
		*str = "initialization error";
		break;
	case CUDA_ERROR_NOT_READY:
		*str = "device not ready";
		break;
	case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
		*str = "operation not permitted when stream is capturing";
		break;
	case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
		*str = "operation would make the legacy stream depend on a capturing blocking "
		       "stream";
		break;
	default:
		*str = "unknown error";
	}
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int *count)
{
	if (!usable("cuDeviceGetCount"))
		return CUDA_ERROR_NOT_INITIALIZED;
	*count = nvisible;
	return CUDA_SUCCESS;
}

/* A CUdevice is the ordinal here. */
EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
	if (!usable("cuDeviceGet"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ordinal < 0 || ordinal >= nvisible)
		return CUDA_ERROR_INVALID_DEVICE;
	*device = ordinal;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice dev)
{
	char id[17];

	if (!usable("cuDeviceGetUuid"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (dev < 0 || dev >= nvisible)
		return CUDA_ERROR_INVALID_DEVICE;
	snprintf(id, sizeof(id), "fake-cuda-dev-%d!", visible[dev]);
	memcpy(uuid->bytes, id, sizeof(uuid->bytes));
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
	if (!usable("cuDevicePrimaryCtxRetain"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (dev < 0 || dev >= nvisible)
		return CUDA_ERROR_INVALID_DEVICE;
	*pctx = (CUcontext)&ctx_tokens[visible[dev]];
	return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
	if (!usable("cuDevicePrimaryCtxRelease"))
		return CUDA_ERROR_NOT_INITIALIZED;
	return dev >= 0 && dev < nvisible ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

/* The device whose primary context @p ctx is; -1 for anything else. */
static int ctx_device(CUcontext ctx)
{
	char *c = (char *)ctx;

	return c >= ctx_tokens && c < ctx_tokens + ndevices ? (int)(c - ctx_tokens) : -1;
}

EXPORT CUresult cuCtxPushCurrent(CUcontext ctx)
{
	int dev = ctx_device(ctx);

	if (!usable("cuCtxPushCurrent"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (dev < 0 || ordinal_of(dev) < 0 ||
	    ctx_depth == (int)(sizeof(ctx_stack) / sizeof(ctx_stack[0])))
		return CUDA_ERROR_INVALID_CONTEXT;
	ctx_stack[ctx_depth++] = dev;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxPopCurrent(CUcontext *pctx)
{
	if (!usable("cuCtxPopCurrent"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ctx_depth == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	ctx_depth--;
	if (pctx)
		*pctx = (CUcontext)&ctx_tokens[ctx_stack[ctx_depth]];
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext *pctx)
{
	if (!usable("cuCtxGetCurrent"))
		return CUDA_ERROR_NOT_INITIALIZED;
	*pctx = ctx_depth ? (CUcontext)&ctx_tokens[ctx_stack[ctx_depth - 1]] : NULL;
	return CUDA_SUCCESS;
}

/* The handle types VMM handle @p id may be exported as. */
static unsigned long long handle_types(uint32_t id)
{
	unsigned long long t = 0;

	pthread_mutex_lock(&mu);
	for (struct obj *o = objs; o; o = o->next)
		if (o->kind == VMM_HANDLE && o->id == id)
			t = o->base ? CU_MEM_HANDLE_TYPE_NONE
				    : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	pthread_mutex_unlock(&mu);
	return t;
}

EXPORT CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr)
{
	struct obj *o, *h;
	int dev;

	if (!usable("cuPointerGetAttribute"))
		return CUDA_ERROR_NOT_INITIALIZED;
	o = obj_find(-1, (uintptr_t)ptr, true, false);
	if (!o || (o->kind == RESERVED && (!o->mapped || ptr >= o->base + o->msize)))
		return CUDA_ERROR_INVALID_VALUE;
	dev = o->kind == RESERVED ? (h = handle_find(o->mapped, false)) ? h->dev : 0 : o->dev;
	if (attribute == CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
		*(int *)data = ordinal_of(dev);
	else if (attribute == CU_POINTER_ATTRIBUTE_CONTEXT)
		*(CUcontext *)data = (CUcontext)&ctx_tokens[dev];
	/* cuMemAlloc memory only: not VMM mappings, not stream-ordered pools */
	else if (attribute == CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE)
		*(int *)data = o->kind == ALLOC && !o->pool;
	/* what the allocation may be exported as: a VMM mapping's handle types; none for the
	 * default pool of cuMemAllocAsync, nor for cuMemAlloc memory */
	else if (attribute == CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES)
		*(unsigned long long *)data = o->kind == RESERVED ? handle_types(o->mapped) : 0;
	else if (attribute == CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)
		*(void **)data = o->kind == ALLOC && o->pool ? (void *)&ctx_tokens[dev] : NULL;
	else
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc(CUdeviceptr *dptr, size_t bytesize)
{
	uint32_t id;
	int fd;
	void *p;
	struct obj *o;

	if (!usable("cuMemAlloc"))
		return CUDA_ERROR_NOT_INITIALIZED;
	fd = memfd_of(bytesize, &id, current_device());
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED || !(o = obj_new(ALLOC, (uintptr_t)p, bytesize, fd))) {
		if (p != MAP_FAILED)
			munmap(p, bytesize);
		close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	o->id = id;
	o->dev = current_device();
	*dptr = (CUdeviceptr)(uintptr_t)p;
	logf_("cuMemAlloc ptr=%#llx size=%zu id=%u", (unsigned long long)*dptr, bytesize, id);
	return CUDA_SUCCESS;
}

/* Stream-ordered allocation from the device's default pool: memory like cuMemAlloc's, which
 * neither legacy IPC nor a shareable handle can export. */
EXPORT CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream)
{
	struct obj *o;
	CUresult e;

	(void)hStream;
	e = cuMemAlloc(dptr, bytesize);
	if (e != CUDA_SUCCESS)
		return e;
	o = obj_find(ALLOC, (uintptr_t)*dptr, false, false);
	o->pool = true;
	logf_("cuMemAllocAsync ptr=%#llx", (unsigned long long)*dptr);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
	(void)hStream;
	return cuMemFree(dptr);
}

EXPORT CUresult cuMemFree(CUdeviceptr dptr)
{
	struct obj *o;

	if (!usable("cuMemFree"))
		return CUDA_ERROR_NOT_INITIALIZED;
	o = obj_find(ALLOC, (uintptr_t)dptr, false, true);
	if (!o)
		return CUDA_ERROR_INVALID_VALUE;
	logf_("cuMemFree ptr=%#llx id=%u", (unsigned long long)dptr, o->id);
	check_no_work_on(o->base, o->size, "cuMemFree");
	munmap((void *)o->base, o->size);
	close(o->fd);
	free(o);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
	struct obj *o = obj_find(-1, (uintptr_t)dptr, true, false);

	if (!usable("cuMemGetAddressRange"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!o || (o->kind == RESERVED && (!o->mapped || dptr >= o->base + o->msize)))
		return CUDA_ERROR_NOT_FOUND;
	/* a VMM address: the mapped region holding it, not the whole reservation */
	if (pbase)
		*pbase = o->base;
	if (psize)
		*psize = o->kind == RESERVED ? o->msize : o->size;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
	struct ipc_mem h = {.magic = IPC_MAGIC, .pid = getpid()};
	struct obj *o;

	if (!usable("cuIpcGetMemHandle"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (env_on("FAKE_CUDA_NO_IPC"))
		return CUDA_ERROR_NOT_SUPPORTED;
	o = obj_find(ALLOC, (uintptr_t)dptr, false, false);
	if (!o || o->pool)
		return CUDA_ERROR_INVALID_VALUE;
	h.fd = o->fd;
	h.id = o->id;
	h.size = o->size;
	h.dev = o->dev;
	memset(pHandle, 0, sizeof(*pHandle));
	memcpy(pHandle->reserved, &h, sizeof(h));
	logf_("cuIpcGetMemHandle ptr=%#llx id=%u", (unsigned long long)dptr, o->id);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags)
{
	if (!usable("cuIpcOpenMemHandle"))
		return CUDA_ERROR_NOT_INITIALIZED;
	struct ipc_mem h;
	char path[64], target[128], want[64];
	struct obj *o;
	ssize_t n;
	void *p;
	int fd;

	memcpy(&h, handle.reserved, sizeof(h));
	/* opened into the current context: a test can check that it is the memory's device's */
	logf_("cuIpcOpenMemHandle pid=%d id=%u flags=%u dev=%d ctx-dev=%d", h.pid, h.id, Flags,
	      h.dev, ctx_depth ? ctx_stack[ctx_depth - 1] : -1);
	if (env_on("FAKE_CUDA_NO_IPC"))
		return CUDA_ERROR_NOT_SUPPORTED;
	if (h.magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_VALUE;
	/* the real driver refuses to open a handle in the process that made it */
	if (h.pid == getpid())
		return CUDA_ERROR_INVALID_CONTEXT;
	snprintf(path, sizeof(path), "/proc/%d/fd/%d", h.pid, h.fd);
	snprintf(want, sizeof(want), "/memfd:fake-cuda:%u@", h.id);
	n = readlink(path, target, sizeof(target) - 1);
	if (n < 0)
		return CUDA_ERROR_INVALID_HANDLE;
	target[n] = 0;
	if (strncmp(target, want, strlen(want)) != 0)
		return CUDA_ERROR_INVALID_HANDLE;
	fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd < 0)
		return CUDA_ERROR_INVALID_HANDLE;
	p = mmap(NULL, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (p == MAP_FAILED)
		return CUDA_ERROR_MAP_FAILED;
	if (!(o = obj_new(IMPORT, (uintptr_t)p, h.size, -1))) {
		munmap(p, h.size);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	o->dev = h.dev;
	*pdptr = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
	struct obj *o;

	if (!usable("cuIpcCloseMemHandle"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (capture_refuses("cuIpcCloseMemHandle"))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	o = obj_find(IMPORT, (uintptr_t)dptr, false, true);
	if (!o)
		return CUDA_ERROR_INVALID_VALUE;
	logf_("cuIpcCloseMemHandle ptr=%#llx", (unsigned long long)dptr);
	check_no_work_on(o->base, o->size, "cuIpcCloseMemHandle");
	munmap((void *)o->base, o->size);
	free(o);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags)
{
	CUevent e;

	if (!usable("cuEventCreate"))
		return CUDA_ERROR_NOT_INITIALIZED;
	e = calloc(1, sizeof(*e));
	if (!e || ((Flags & CU_EVENT_INTERPROCESS) && !ipc_event_take())) {
		free(e);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	pthread_mutex_lock(&mu);
	e->id = ++next_id;
	pthread_mutex_unlock(&mu);
	e->magic = IPC_MAGIC;
	e->pid = getpid();
	e->flags = Flags;
	*phEvent = e;
	logf_("cuEventCreate event=%d:%u flags=%u", e->pid, e->id, Flags);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
	if (!usable("cuEventRecord"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!hEvent || hEvent->magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!stream_ok(hStream, "cuEventRecord"))
		return CUDA_ERROR_INVALID_HANDLE;
	pthread_mutex_lock(&mu);
	if (legacy_unusable(hStream)) {
		pthread_mutex_unlock(&mu);
		logf_("cuEventRecord stream=%p refused: a blocking stream captures",
		      (void *)hStream);
		/* and the capture is lost, even from a thread in relaxed mode (seen on an H200) */
		invalidate("cuEventRecord");
		return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
	}
	hEvent->captured = made_stream(hStream) && hStream->capturing;
	hEvent->behind = made_stream(hStream) && hStream->held ? hStream : NULL;
	hEvent->behind_releases = hEvent->behind ? hStream->releases : 0;
	hEvent->behind_legacy =
		!made_stream(hStream) && hStream != CU_STREAM_PER_THREAD && held_blocking > 0;
	hEvent->after_pid = made_stream(hStream) && blocked(hStream) ? hStream->wait_pid : 0;
	hEvent->after_id = hEvent->after_pid ? hStream->wait_id : 0;
	hEvent->via = made_stream(hStream) ? hStream->wait_on : NULL;
	hEvent->via_releases = hEvent->via ? hStream->wait_releases : 0;
	hEvent->via_legacy = made_stream(hStream) && hStream->wait_legacy;
	/* pending here: other processes that open it see so through its marker */
	if ((hEvent->flags & CU_EVENT_INTERPROCESS) && !hEvent->marked && pending(hEvent)) {
		char path[600];
		int fd;

		marker_path(path, sizeof(path), hEvent->pid, hEvent->id);
		fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
		if (fd >= 0) {
			close(fd);
			hEvent->marked = true;
			hEvent->next_marked = marked;
			marked = hEvent;
		}
	}
	pthread_mutex_unlock(&mu);
	logf_("cuEventRecord event=%d:%u stream=%p%s%s", hEvent->pid, hEvent->id, (void *)hStream,
	      hEvent->captured ? " captured" : "",
	      hEvent->behind || hEvent->behind_legacy ? " behind-held-work" : "");
	return CUDA_SUCCESS;
}

EXPORT CUresult cuEventQuery(CUevent hEvent)
{
	CUresult r;

	if (!usable("cuEventQuery"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!hEvent || hEvent->magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	/* even of an event recorded outside it (seen on an H200) */
	if (capture_refuses("cuEventQuery"))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	pthread_mutex_lock(&mu);
	/* querying an event recorded inside a capture is an error whatever the mode */
	r = sticky	       ? CUDA_ERROR_LAUNCH_FAILED
	    : hEvent->captured ? CUDA_ERROR_CAPTURED_EVENT
	    : pending(hEvent)  ? CUDA_ERROR_NOT_READY
			       : CUDA_SUCCESS;
	pthread_mutex_unlock(&mu);
	logf_("cuEventQuery event=%d:%u result=%d", hEvent->pid, hEvent->id, (int)r);
	return r;
}

EXPORT CUresult cuEventSynchronize(CUevent hEvent)
{
	if (!usable("cuEventSynchronize"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!hEvent || hEvent->magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	logf_("cuEventSynchronize event=%d:%u%s", hEvent->pid, hEvent->id,
	      hEvent->flags & CU_EVENT_BLOCKING_SYNC ? " blocking" : "");
	if (capture_refuses("cuEventSynchronize"))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	pthread_mutex_lock(&mu);
	while (pending(hEvent) && !sticky) {
		/* a blocking-sync event of this process's: the thread sleeps until the clock (or
		 * the test's let-go) reaches the event; it moves no time itself */
		if ((hEvent->flags & CU_EVENT_BLOCKING_SYNC) && hEvent->pid == getpid()) {
			pthread_cond_wait(&let_go_cv, &mu);
			continue;
		}
		if (time_step())
			continue;
		/* another process's work ends without a word to this one: look again */
		pthread_mutex_unlock(&mu);
		usleep(1000);
		pthread_mutex_lock(&mu);
	}
	pthread_mutex_unlock(&mu);
	return sticky ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy(CUevent hEvent)
{
	if (!usable("cuEventDestroy"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!hEvent || hEvent->magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	logf_("cuEventDestroy event=%d:%u", hEvent->pid, hEvent->id);
	if (hEvent->flags & CU_EVENT_INTERPROCESS) {
		pthread_mutex_lock(&mu);
		ipc_events--;
		pthread_mutex_unlock(&mu);
	}
	pthread_mutex_lock(&mu);
	hEvent->magic = 0; /* its marker goes with it */
	if (hEvent->marked)
		sweep_markers();
	pthread_mutex_unlock(&mu);
	free(hEvent);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcGetEventHandle(CUipcEventHandle *pHandle, CUevent event)
{
	struct ipc_ev h = {.magic = IPC_MAGIC};

	if (!usable("cuIpcGetEventHandle"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (env_on("FAKE_CUDA_NO_IPC"))
		return CUDA_ERROR_NOT_SUPPORTED;
	if (!event || event->magic != IPC_MAGIC || !(event->flags & CU_EVENT_INTERPROCESS) ||
	    !(event->flags & CU_EVENT_DISABLE_TIMING))
		return CUDA_ERROR_INVALID_VALUE;
	h.pid = event->pid;
	h.id = event->id;
	memset(pHandle, 0, sizeof(*pHandle));
	memcpy(pHandle->reserved, &h, sizeof(h));
	return CUDA_SUCCESS;
}

EXPORT CUresult cuIpcOpenEventHandle(CUevent *phEvent, CUipcEventHandle handle)
{
	struct ipc_ev h;
	CUevent e;

	if (!usable("cuIpcOpenEventHandle"))
		return CUDA_ERROR_NOT_INITIALIZED;
	memcpy(&h, handle.reserved, sizeof(h));
	if (env_on("FAKE_CUDA_NO_IPC"))
		return CUDA_ERROR_NOT_SUPPORTED;
	if (h.magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_VALUE;
	e = calloc(1, sizeof(*e));
	if (!e || !ipc_event_take()) {
		free(e);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	e->magic = IPC_MAGIC;
	e->pid = h.pid;
	e->id = h.id;
	e->flags = CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING;
	*phEvent = e;
	logf_("cuIpcOpenEventHandle event=%d:%u", h.pid, h.id);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags)
{
	CUstream s;

	if (!usable("cuStreamCreate"))
		return CUDA_ERROR_NOT_INITIALIZED;
	s = calloc(1, sizeof(*s));
	if (!s)
		return CUDA_ERROR_OUT_OF_MEMORY;
	s->magic = IPC_MAGIC;
	s->flags = Flags;
	s->ops_end = &s->ops;
	pthread_mutex_lock(&mu);
	s->next_all = all_streams;
	all_streams = s;
	pthread_mutex_unlock(&mu);
	*phStream = s;
	logf_("cuStreamCreate stream=%p%s", (void *)s,
	      Flags & CU_STREAM_NON_BLOCKING ? " non-blocking" : "");
	return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamGetFlags(CUstream hStream, unsigned int *flags)
{
	if (!usable("cuStreamGetFlags"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!stream_ok(hStream, "cuStreamGetFlags") || !flags)
		return CUDA_ERROR_INVALID_HANDLE;
	*flags = made_stream(hStream) ? hStream->flags : CU_STREAM_DEFAULT;
	logf_("cuStreamGetFlags stream=%p flags=%u", (void *)hStream, *flags);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamQuery(CUstream hStream)
{
	bool busy;

	if (!usable("cuStreamQuery"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!stream_ok(hStream, "cuStreamQuery"))
		return CUDA_ERROR_INVALID_HANDLE;
	pthread_mutex_lock(&mu);
	busy = made_stream(hStream) ? blocked(hStream)
				    : hStream != CU_STREAM_PER_THREAD && held_blocking > 0;
	pthread_mutex_unlock(&mu);
	logf_("cuStreamQuery stream=%p", (void *)hStream);
	return busy ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy(CUstream hStream)
{
	if (!usable("cuStreamDestroy"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if ((uintptr_t)hStream <= 2 || !stream_ok(hStream, "cuStreamDestroy"))
		return CUDA_ERROR_INVALID_HANDLE;
	/* a capture ends with its stream; its queued work does not: as with the real driver,
	 * cuStreamDestroy returns at once and that work still runs to its end (a held stream's
	 * when the test lets it go) */
	fake_cuda_capture(hStream, 0);
	logf_("cuStreamDestroy stream=%p%s", (void *)hStream, hStream->held ? " held" : "");
	pthread_mutex_lock(&mu);
	run_ops(hStream);
	/* kept, not freed: events recorded on it may still point at it (pending() reads it) */
	hStream->magic = DEAD_MAGIC;
	hStream->next_dead = dead_streams;
	dead_streams = hStream;
	pthread_mutex_unlock(&mu);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream hStream)
{
	bool invalid;

	if (!usable("cuStreamSynchronize"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!stream_ok(hStream, "cuStreamSynchronize"))
		return CUDA_ERROR_INVALID_HANDLE;
	if (ctx_depth == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	logf_("cuStreamSynchronize stream=%p", (void *)hStream);
	pthread_mutex_lock(&mu);
	invalid = (made_stream(hStream) && hStream->capturing) || legacy_unusable(hStream);
	pthread_mutex_unlock(&mu);
	/* synchronizing a capturing stream, or the legacy stream during one, is invalid
	 * whatever the mode */
	if (invalid) {
		invalidate("cuStreamSynchronize");
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	}
	if (capture_refuses("cuStreamSynchronize"))
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	pthread_mutex_lock(&mu);
	/* the legacy stream waits for every (blocking) stream, held ones included */
	while (!sticky &&
	       (made_stream(hStream) ? blocked(hStream)
				     : hStream != CU_STREAM_PER_THREAD && held_blocking > 0)) {
		if (time_step())
			continue;
		pthread_mutex_unlock(&mu);
		usleep(1000);
		pthread_mutex_lock(&mu);
	}
	run_ops(made_stream(hStream) ? hStream : &legacy_q);
	invalid = sticky;
	pthread_mutex_unlock(&mu);
	return invalid ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
}

EXPORT CUresult cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus)
{
	CUresult r = CUDA_SUCCESS;

	if (!usable("cuStreamIsCapturing"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!stream_ok(hStream, "cuStreamIsCapturing"))
		return CUDA_ERROR_INVALID_HANDLE;
	pthread_mutex_lock(&mu);
	if (made_stream(hStream))
		*captureStatus = !hStream->capturing ? CU_STREAM_CAPTURE_STATUS_NONE
				 : capture_broken    ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
						     : CU_STREAM_CAPTURE_STATUS_ACTIVE;
	else if (legacy_unusable(hStream))
		r = CUDA_ERROR_STREAM_CAPTURE_IMPLICIT; /* the legacy stream while one captures */
	else
		*captureStatus = CU_STREAM_CAPTURE_STATUS_NONE;
	pthread_mutex_unlock(&mu);
	logf_("cuStreamIsCapturing stream=%p result=%d", (void *)hStream, (int)r);
	return r;
}

EXPORT CUresult cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode)
{
	CUstreamCaptureMode was = capture_mode;

	if (!usable("cuThreadExchangeStreamCaptureMode"))
		return CUDA_ERROR_NOT_INITIALIZED;
	capture_mode = *mode;
	*mode = was;
	logf_("cuThreadExchangeStreamCaptureMode mode=%d", (int)capture_mode);
	return CUDA_SUCCESS;
}

/* Hold @p s, or let it go (its long kernel ends). With mu. */
static void hold_locked(CUstream s, bool on)
{
	if (on && !s->held) {
		s->held = true;
		held_streams++;
		held_blocking += !(s->flags & CU_STREAM_NON_BLOCKING);
	} else if (!on && s->held) {
		s->held = false;
		s->releases++;
		held_streams--;
		held_blocking -= !(s->flags & CU_STREAM_NON_BLOCKING);
		/* its work runs, then what was recorded behind it completes, and the work of
		 * streams that waited for it */
		run_all();
		sweep_markers();
		pthread_cond_broadcast(&let_go_cv);
	}
	s->until = 0;
}

/* Test hook: hold @p s (a long kernel runs on it, until let go) or let it go. */
EXPORT void fake_cuda_stream_hold(CUstream s, int on)
{
	pthread_mutex_lock(&mu);
	hold_locked(s, on);
	pthread_mutex_unlock(&mu);
	logf_("hold stream=%p %s", (void *)s, on ? "on" : "off");
}

/*
 * Test hook: a kernel of @p ticks on @p s, after the kernels queued there before it: the
 * stream is held until the fake's clock reaches its end. The clock moves when a test advances
 * it (fake_cuda_clock_advance()) and when a call waits for such work (cuStreamSynchronize,
 * cuEventSynchronize, cuCtxSynchronize: time passes while the host waits); never by itself, and
 * never when a call only looks (cuEventQuery, cuStreamQuery). On a stream held until let go,
 * the kernel ends when it is let go.
 */
EXPORT void fake_cuda_kernel(CUstream s, unsigned ticks)
{
	pthread_mutex_lock(&mu);
	if (!s->held) {
		hold_locked(s, true);
		s->until = fake_clock + ticks;
	} else if (s->until) {
		s->until += ticks;
	}
	pthread_mutex_unlock(&mu);
	logf_("kernel stream=%p ticks=%u", (void *)s, ticks);
}

/* Let go of every stream whose timed work ends by @p t, the clock then at @p t. With mu. */
static void time_to(uint64_t t)
{
	if (t > fake_clock)
		fake_clock = t;
	for (CUstream s = all_streams; s; s = s->next_all)
		if (s->held && s->until && s->until <= fake_clock)
			hold_locked(s, false);
}

/* Test hook: @p ticks of the fake's time pass. */
EXPORT void fake_cuda_clock_advance(unsigned ticks)
{
	pthread_mutex_lock(&mu);
	time_to(fake_clock + ticks);
	pthread_mutex_unlock(&mu);
	logf_("clock advance=%u", ticks);
}

/*
 * A call waits for work that is not done: if timed work is held, time passes to the end of the
 * earliest such kernel (true), else nothing can move time (false). With mu.
 */
static bool time_step(void)
{
	uint64_t next = 0;

	for (CUstream s = all_streams; s; s = s->next_all)
		if (s->held && s->until && (!next || s->until < next))
			next = s->until;
	if (next)
		time_to(next);
	return next != 0;
}

/*
 * Copy @p n bytes from @p src to @p dst as work on @p s: now if @p s can run, else queued
 * behind its earlier work. A write (@p take) takes its bytes now; a read takes them when it
 * runs. With no memory to queue it, it runs now.
 */
static void later(CUstream s, void *dst, const void *src, size_t n, bool take)
{
	struct op *o = calloc(1, sizeof(*o));

	if ((uintptr_t)s <= 2)
		s = &legacy_q;
	else
		stream_ok(s, "fake_cuda_write_later/read_later");
	pthread_mutex_lock(&mu);
	if (!blocked(s) || !o || (take && !(o->copy = malloc(n)))) {
		memcpy(dst, src, n);
		free(o);
	} else {
		if (take)
			memcpy(o->copy, src, n);
		else
			o->src = src;
		o->dst = dst;
		o->n = n;
		*s->ops_end = o;
		s->ops_end = &o->next;
	}
	pthread_mutex_unlock(&mu);
}

/* Test hook: a kernel on @p s that writes @p n bytes of @p src (taken now) to @p dst: at once,
 * or when the stream's earlier work has run. */
EXPORT void fake_cuda_write_later(CUstream s, void *dst, const void *src, size_t n)
{
	later(s, dst, src, n, true);
	logf_("write-later stream=%p bytes=%zu", (void *)s, n);
}

/* Test hook: a kernel on @p s that reads @p n bytes at @p src into @p dst: at once, or when
 * the stream's earlier work (a wait for another process's event) has run. */
EXPORT void fake_cuda_read_later(CUstream s, const void *src, void *dst, size_t n)
{
	later(s, dst, src, n, false);
	logf_("read-later stream=%p bytes=%zu", (void *)s, n);
}

/* Test hook: a capture (global mode, as another thread would begin it) on @p s starts or ends. */
EXPORT void fake_cuda_capture(CUstream s, int on)
{
	bool blocking = !(s->flags & CU_STREAM_NON_BLOCKING);

	pthread_mutex_lock(&mu);
	if (on && !s->capturing) {
		captures++;
		blocking_captures += blocking;
	} else if (!on && s->capturing) {
		captures--;
		blocking_captures -= blocking;
	}
	s->capturing = on;
	if (!captures)
		capture_broken = false;
	pthread_mutex_unlock(&mu);
	logf_("capture stream=%p %s", (void *)s, on ? "begins" : "ends");
}

/* Device to device, on the legacy default stream: a memcpy here, between memory of the fake's
 * (an allocation, or a mapped VMM region), in a current context. */
EXPORT CUresult cuMemcpyDtoD(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount)
{
	struct obj *d, *s;

	if (!usable("cuMemcpyDtoD"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ctx_depth == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	d = obj_find(-1, (uintptr_t)dstDevice, true, false);
	s = obj_find(-1, (uintptr_t)srcDevice, true, false);
	if (!d || !s ||
	    dstDevice + ByteCount > d->base + (d->kind == RESERVED ? d->msize : d->size) ||
	    srcDevice + ByteCount > s->base + (s->kind == RESERVED ? s->msize : s->size))
		return CUDA_ERROR_INVALID_VALUE;
	memcpy((void *)(uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount);
	logf_("cuMemcpyDtoD bytes=%zu", ByteCount);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void)
{
	bool busy;

	if (!usable("cuCtxSynchronize"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ctx_depth == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	logf_("cuCtxSynchronize");
	/* a context with a capturing stream cannot be synchronized, whatever the mode */
	pthread_mutex_lock(&mu);
	busy = captures > 0;
	pthread_mutex_unlock(&mu);
	if (busy) {
		invalidate("cuCtxSynchronize");
		return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
	}
	pthread_mutex_lock(&mu);
	while (held_streams > 0 && !sticky)
		if (!time_step())
			pthread_cond_wait(&let_go_cv, &mu);
	run_all();
	busy = sticky;
	pthread_mutex_unlock(&mu);
	return busy ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
}

/*
 * Test hook: a sticky error (a kernel faulted): from now on event queries and
 * synchronizations answer CUDA_ERROR_LAUNCH_FAILED at once (those waiting wake up with it),
 * the held work never completes, and queued host functions never run.
 */
EXPORT void fake_cuda_sticky_error(void)
{
	pthread_mutex_lock(&mu);
	sticky = true;
	pthread_cond_broadcast(&let_go_cv);
	pthread_mutex_unlock(&mu);
	logf_("sticky-error");
}

EXPORT CUresult cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags)
{
	bool implicit;

	if (!usable("cuStreamWaitEvent"))
		return CUDA_ERROR_NOT_INITIALIZED;
	/* the special streams (legacy 0x1, per-thread 0x2) and NULL are valid without a record */
	if (!stream_ok(hStream, "cuStreamWaitEvent"))
		return CUDA_ERROR_INVALID_HANDLE;
	if (!hEvent || hEvent->magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	pthread_mutex_lock(&mu);
	implicit = legacy_unusable(hStream);
	/* later work on the stream waits for another process's pending event, or for the
	 * work this process's event was recorded behind */
	if (!implicit && made_stream(hStream) && hEvent->pid != getpid() && pending(hEvent)) {
		hStream->wait_pid = hEvent->pid;
		hStream->wait_id = hEvent->id;
	} else if (!implicit && made_stream(hStream) && pending(hEvent)) {
		CUstream on = hEvent->behind ? hEvent->behind : hEvent->via;

		if (on) {
			hStream->wait_on = on;
			hStream->wait_releases =
				hEvent->behind ? hEvent->behind_releases : hEvent->via_releases;
		} else {
			hStream->wait_legacy = true;
		}
	}
	pthread_mutex_unlock(&mu);
	logf_("cuStreamWaitEvent stream=%p event=%d:%u flags=%u%s", (void *)hStream, hEvent->pid,
	      hEvent->id, Flags, implicit ? " refused: a blocking stream captures" : "");
	return implicit ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
}

/* The driver's host-function thread: runs each host function once its stream reached it. */
static void *host_fn_thread(void *arg)
{
	struct op *o;

	(void)arg;
	pthread_mutex_lock(&mu);
	for (;;) {
		while (!host_fns || sticky) /* after a sticky error none runs */
			pthread_cond_wait(&host_fns_cv, &mu);
		o = host_fns;
		host_fns = o->next;
		if (!host_fns)
			host_fns_end = &host_fns;
		pthread_mutex_unlock(&mu);
		logf_("host-function runs");
		o->fn(o->arg);
		pthread_mutex_lock(&mu);
		/* it returned: the work queued after it on its stream may run */
		o->on->host_fn_running = false;
		run_ops(o->on);
		free(o);
	}
	return NULL;
}

static void host_fn_thread_start(void)
{
	pthread_t t;

	if (pthread_create(&t, NULL, host_fn_thread, NULL) == 0)
		pthread_detach(t);
}

/*
 * Launched work @p o (a host function, a kernel) on @p s: refused on the legacy stream while a
 * blocking stream captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT), a node of the graph on a
 * capturing stream (never run here), else queued and run if the stream can run. Takes @p o.
 * With mu.
 */
static CUresult launch_work(CUstream s, struct op *o)
{
	CUstream q = (uintptr_t)s <= 2 ? &legacy_q : s;

	if (legacy_unusable(s) || (made_stream(s) && s->capturing)) {
		free(o);
		return legacy_unusable(s) ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
	}
	*q->ops_end = o;
	q->ops_end = &o->next;
	run_ops(q);
	return CUDA_SUCCESS;
}

/*
 * A host function runs on a thread of the driver's once the work queued before it on the
 * stream has run (at once when there is none), never on the caller's thread. On the legacy
 * stream while a blocking stream captures: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT; on a capturing
 * stream it goes into the graph (here: never runs).
 */
EXPORT CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
{
	static pthread_once_t once = PTHREAD_ONCE_INIT;
	struct op *o;
	CUresult r = CUDA_SUCCESS;

	if (!usable("cuLaunchHostFunc"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!stream_ok(hStream, "cuLaunchHostFunc"))
		return CUDA_ERROR_INVALID_HANDLE;
	if (!fn)
		return CUDA_ERROR_INVALID_VALUE;
	o = calloc(1, sizeof(*o));
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o->fn = fn;
	o->arg = userData;
	pthread_once(&once, host_fn_thread_start);
	pthread_mutex_lock(&mu);
	r = launch_work(hStream, o);
	pthread_mutex_unlock(&mu);
	logf_("cuLaunchHostFunc stream=%p result=%d", (void *)hStream, (int)r);
	return r;
}

EXPORT CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
					      CUmemAllocationGranularity_flags option)
{
	if (!usable("cuMemGetAllocationGranularity"))
		return CUDA_ERROR_NOT_INITIALIZED;
	(void)option;
	if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
	    prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id < 0 ||
	    prop->location.id >= nvisible)
		return CUDA_ERROR_INVALID_VALUE;
	*granularity = FAKE_GRANULARITY;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
			    const CUmemAllocationProp *prop, unsigned long long flags)
{
	uint32_t id;
	struct obj *o;
	int fd;

	if (!usable("cuMemCreate"))
		return CUDA_ERROR_NOT_INITIALIZED;
	(void)flags;
	if (size == 0 || size % FAKE_GRANULARITY || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
	    prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop->location.id < 0 ||
	    prop->location.id >= nvisible)
		return CUDA_ERROR_INVALID_VALUE;
	fd = memfd_of(size, &id, visible[prop->location.id]);
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o = obj_new(VMM_HANDLE, 0, size, fd);
	if (!o) {
		close(fd);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	o->refs = 1;
	o->dev = visible[prop->location.id];
	/* the handle's export type was fixed at creation */
	if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
		o->base = 1;
	*handle = o->id;
	logf_("cuMemCreate handle=%u size=%zu", o->id, size);
	return CUDA_SUCCESS;
}

/* Drop one reference to VMM handle @p handle; the last one frees it. false: no such handle. */
static bool handle_put(CUmemGenericAllocationHandle handle)
{
	struct obj *o = NULL;
	bool last = false;

	pthread_mutex_lock(&mu);
	for (struct obj **pp = &objs; *pp; pp = &(*pp)->next)
		if ((*pp)->kind == VMM_HANDLE && (*pp)->id == handle) {
			o = *pp;
			last = --o->refs == 0;
			if (last)
				*pp = o->next;
			break;
		}
	pthread_mutex_unlock(&mu);
	if (last) {
		close(o->fd);
		free(o);
	}
	return o != NULL;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
	if (!usable("cuMemRelease"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!handle_put(handle))
		return CUDA_ERROR_INVALID_VALUE;
	/* a mapping keeps the handle alive, as with the real driver */
	logf_("cuMemRelease handle=%u", (unsigned)handle);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr)
{
	struct obj *r, *h = NULL;

	if (!usable("cuMemRetainAllocationHandle"))
		return CUDA_ERROR_NOT_INITIALIZED;
	r = obj_find(RESERVED, (uintptr_t)addr, true, false);
	if (!r || !r->mapped || (uintptr_t)addr >= r->base + r->msize)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&mu);
	for (struct obj *o = objs; o; o = o->next)
		if (o->kind == VMM_HANDLE && o->id == r->mapped) {
			h = o;
			h->refs++;
			break;
		}
	pthread_mutex_unlock(&mu);
	if (!h)
		return CUDA_ERROR_INVALID_VALUE;
	*handle = h->id;
	logf_("cuMemRetainAllocationHandle handle=%u", h->id);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemExportToShareableHandle(void *shareableHandle,
					     CUmemGenericAllocationHandle handle,
					     CUmemAllocationHandleType handleType,
					     unsigned long long flags)
{
	struct obj *o = handle_find(handle, false);
	int fd;

	if (!usable("cuMemExportToShareableHandle"))
		return CUDA_ERROR_NOT_INITIALIZED;
	(void)flags;
	if (!o || o->base || handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
		return CUDA_ERROR_INVALID_VALUE;
	fd = fcntl(o->fd, F_DUPFD_CLOEXEC, 0);
	if (fd < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	*(int *)shareableHandle = fd;
	logf_("cuMemExportToShareableHandle handle=%u", o->id);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
					       CUmemAllocationHandleType shHandleType)
{
	int fd = (int)(intptr_t)osHandle, dup;
	struct stat st;
	struct obj *o;

	if (!usable("cuMemImportFromShareableHandle"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || fstat(fd, &st) < 0 ||
	    !S_ISREG(st.st_mode) || st.st_size == 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (instance && instance_of(fd) != instance) {
		logf_("cuMemImportFromShareableHandle device-reset (made on instance %u, now %u)",
		      instance_of(fd), instance);
		return CUDA_ERROR_INVALID_HANDLE;
	}
	dup = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (dup < 0)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o = obj_new(VMM_HANDLE, 0, (size_t)st.st_size, dup);
	if (!o) {
		close(dup);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	o->refs = 1;
	o->dev = device_of(dup);
	*handle = o->id;
	logf_("cuMemImportFromShareableHandle handle=%u size=%lld", o->id, (long long)st.st_size);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
				    CUdeviceptr addr, unsigned long long flags)
{
	void *p;

	if (!usable("cuMemAddressReserve"))
		return CUDA_ERROR_NOT_INITIALIZED;
	(void)alignment;
	(void)addr;
	(void)flags;
	if (size == 0 || size % FAKE_GRANULARITY)
		return CUDA_ERROR_INVALID_VALUE;
	p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	if (!obj_new(RESERVED, (uintptr_t)p, size, -1)) {
		munmap(p, size);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	*ptr = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
	struct obj *o;

	if (!usable("cuMemAddressFree"))
		return CUDA_ERROR_NOT_INITIALIZED;
	o = obj_find(RESERVED, (uintptr_t)ptr, false, true);
	if (!o || o->size != size)
		return CUDA_ERROR_INVALID_VALUE;
	munmap((void *)o->base, o->size);
	free(o);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
			 CUmemGenericAllocationHandle handle, unsigned long long flags)
{
	struct obj *h = handle_find(handle, false);
	struct obj *r = obj_find(RESERVED, (uintptr_t)ptr, false, false);

	if (!usable("cuMemMap"))
		return CUDA_ERROR_NOT_INITIALIZED;
	(void)flags;
	if (!h || !r || size > r->size || offset + size > h->size)
		return CUDA_ERROR_INVALID_VALUE;
	if (r->mapped)
		return CUDA_ERROR_ALREADY_MAPPED;
	/* mapped but not accessible until cuMemSetAccess, as with the real driver */
	if (mmap((void *)r->base, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset) ==
	    MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	pthread_mutex_lock(&mu);
	h->refs++;
	r->mapped = h->id;
	r->msize = size;
	pthread_mutex_unlock(&mu);
	logf_("cuMemMap ptr=%#llx size=%zu handle=%u", (unsigned long long)ptr, size, h->id);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
	struct obj *r = obj_find(RESERVED, (uintptr_t)ptr, false, false);

	/* not refused while another thread captures, whatever the mode (seen on an H200) */
	if (!usable("cuMemUnmap"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!r || size > r->size)
		return CUDA_ERROR_INVALID_VALUE;
	check_no_work_on(r->base, size, "cuMemUnmap");
	if (mmap((void *)r->base, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1,
		 0) == MAP_FAILED)
		return CUDA_ERROR_UNKNOWN;
	if (r->mapped)
		handle_put(r->mapped);
	r->mapped = 0;
	r->msize = 0;
	logf_("cuMemUnmap ptr=%#llx", (unsigned long long)ptr);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
			       size_t count)
{
	struct obj *r = obj_find(RESERVED, (uintptr_t)ptr, false, false), *h;

	if (!usable("cuMemSetAccess"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!r || size > r->size || count != 1 ||
	    desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE || desc->location.id < 0 ||
	    desc->location.id >= nvisible)
		return CUDA_ERROR_INVALID_VALUE;
	/* the device the memory lives on; peer access to it from another is not modelled */
	h = handle_find(r->mapped, false);
	if (!h || visible[desc->location.id] != h->dev)
		return CUDA_ERROR_INVALID_DEVICE;
	if (mprotect((void *)r->base, size,
		     desc->flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE
								       : PROT_READ) < 0)
		return CUDA_ERROR_INVALID_VALUE;
	return CUDA_SUCCESS;
}

/* Test hook: how many allocations, imports, reservations and VMM handle references (its
 * creator's, each mapping's, each retain's) this process holds: a refused publish must leave
 * it as it was. */
EXPORT unsigned fake_cuda_live(void)
{
	unsigned n = 0;

	pthread_mutex_lock(&mu);
	for (struct obj *o = objs; o; o = o->next)
		n += o->kind == VMM_HANDLE ? o->refs : 1;
	pthread_mutex_unlock(&mu);
	return n;
}

/* ---- modules and kernels: the few the fake runs on the host ---- */

#define FAKE_MODULE_ENTRIES 16 /* kernels one module may declare */
#define FAKE_NAME_MAX 64       /* and the length of their names */

/* Is [@p p, @p p + @p n) inside one allocation or mapping of the fake's? */
static bool in_fake(uintptr_t p, size_t n)
{
	struct obj *o = obj_find(-1, p, true, false);

	return o && n <= (o->kind == RESERVED ? o->msize : o->size) - (p - o->base);
}

/* dlpc_fill_u32(uint32_t *p, uint64_t n, uint32_t seed): p[i] = i * 2654435761 + seed */
static void k_fill(const struct op *o)
{
	uint32_t *p = o->dst;

	for (uint64_t i = 0; i < o->kargs[0]; i++)
		p[i] = (uint32_t)i * 2654435761u + (uint32_t)o->kargs[1];
}

/* dlpc_sum_u32(const uint32_t *p, uint64_t n, uint64_t *out): *out += the sum of p[i] */
static void k_sum(const struct op *o)
{
	const uint32_t *p = o->dst;
	uint64_t s = 0;

	for (uint64_t i = 0; i < o->kargs[0]; i++)
		s += p[i];
	*(uint64_t *)(uintptr_t)o->kargs[1] += s;
}

/* The kernels the fake knows, by the names a module declares them under (".entry"): those of
 * bench/bench_gpu.c's PTX. Each takes a device pointer to 32-bit words, their count, and a
 * third argument: 32 bits (val32) or a device pointer to 8 bytes (out). */
static const struct fake_kernel {
	const char *name;
	void (*run)(const struct op *o);
	bool val32;
} fake_kernels[] = {
	{"dlpc_fill_u32", k_fill, true},
	{"dlpc_sum_u32", k_sum, false},
};

struct CUfunc_st {
	uint32_t magic;
	const struct fake_kernel *k; /* NULL: declared, but the fake cannot run it */
	char name[FAKE_NAME_MAX];
};

struct CUmod_st {
	uint32_t magic;
	unsigned n;
	struct CUfunc_st funcs[FAKE_MODULE_ENTRIES];
};

/*
 * A module from PTX text: the names after each ".entry" are its kernels. An image without
 * ".version" or without an entry is CUDA_ERROR_INVALID_IMAGE; nothing else of the PTX is
 * checked (tests/fake_cuda/README.md).
 */
EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
	const char *s = image;
	struct CUmod_st *m;

	if (!usable("cuModuleLoadData"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ctx_depth == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!module || !image)
		return CUDA_ERROR_INVALID_VALUE;
	m = calloc(1, sizeof(*m));
	if (!m)
		return CUDA_ERROR_OUT_OF_MEMORY;
	m->magic = IPC_MAGIC;
	while ((s = strstr(s, ".entry")) && m->n < FAKE_MODULE_ENTRIES) {
		struct CUfunc_st *f = &m->funcs[m->n];
		size_t len;

		s += strlen(".entry");
		s += strspn(s, " \t\n");
		len = strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_$");
		if (len == 0 || len >= sizeof(f->name))
			continue;
		memcpy(f->name, s, len);
		f->magic = IPC_MAGIC;
		for (size_t i = 0; i < sizeof(fake_kernels) / sizeof(fake_kernels[0]); i++)
			if (strcmp(f->name, fake_kernels[i].name) == 0)
				f->k = &fake_kernels[i];
		m->n++;
	}
	if (!strstr(image, ".version") || m->n == 0) {
		free(m);
		logf_("cuModuleLoadData result=%d", CUDA_ERROR_INVALID_IMAGE);
		return CUDA_ERROR_INVALID_IMAGE;
	}
	*module = m;
	logf_("cuModuleLoadData entries=%u", m->n);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleUnload(CUmodule hmod)
{
	if (!usable("cuModuleUnload"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!hmod || hmod->magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	hmod->magic = DEAD_MAGIC;
	free(hmod);
	logf_("cuModuleUnload");
	return CUDA_SUCCESS;
}

/* A kernel the module declares: CUDA_ERROR_NOT_FOUND for any other name, as with the driver;
 * also for a declared kernel the fake has no host code for (logged as "no-host-kernel"). */
EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name)
{
	if (!usable("cuModuleGetFunction"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (!hmod || hmod->magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	if (!hfunc || !name)
		return CUDA_ERROR_INVALID_VALUE;
	for (unsigned i = 0; i < hmod->n; i++) {
		if (strcmp(hmod->funcs[i].name, name) != 0)
			continue;
		if (!hmod->funcs[i].k) {
			logf_("no-host-kernel %s", name);
			break;
		}
		*hfunc = &hmod->funcs[i];
		logf_("cuModuleGetFunction name=%s", name);
		return CUDA_SUCCESS;
	}
	logf_("cuModuleGetFunction name=%s result=%d", name, CUDA_ERROR_NOT_FOUND);
	return CUDA_ERROR_NOT_FOUND;
}

/*
 * A kernel as work on @p hStream: its arguments are taken now, and it runs on the host once
 * the work queued before it on that stream has run (at once when there is none), as the
 * hooks' writes and reads do. Memory outside the fake's is a fault on the device: the launch
 * succeeds and the context is lost (a sticky error, logged as "illegal-address"). On the legacy
 * stream during a capture: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT; on a capturing stream the
 * kernel goes into the graph (here: never runs). @p extra is not supported.
 */
EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
			       unsigned int gridDimZ, unsigned int blockDimX,
			       unsigned int blockDimY, unsigned int blockDimZ,
			       unsigned int sharedMemBytes, CUstream hStream, void **kernelParams,
			       void **extra)
{
	CUresult r = CUDA_SUCCESS;
	bool fault;
	struct op *o;

	if (!usable("cuLaunchKernel"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ctx_depth == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!stream_ok(hStream, "cuLaunchKernel") || !f || f->magic != IPC_MAGIC)
		return CUDA_ERROR_INVALID_HANDLE;
	(void)sharedMemBytes;
	if (!kernelParams || extra || !gridDimX || !gridDimY || !gridDimZ || !blockDimX ||
	    !blockDimY || !blockDimZ || (uint64_t)blockDimX * blockDimY * blockDimZ > 1024)
		return CUDA_ERROR_INVALID_VALUE;
	o = calloc(1, sizeof(*o));
	if (!o)
		return CUDA_ERROR_OUT_OF_MEMORY;
	o->kern = f->k->run;
	o->dst = (void *)(uintptr_t) * (CUdeviceptr *)kernelParams[0];
	o->src = o->dst;
	o->kargs[0] = *(uint64_t *)kernelParams[1];
	o->kargs[1] = f->k->val32 ? *(uint32_t *)kernelParams[2] : *(CUdeviceptr *)kernelParams[2];
	o->n = o->kargs[0] * sizeof(uint32_t);
	fault = !in_fake((uintptr_t)o->dst, o->n) ||
		(!f->k->val32 && !in_fake((uintptr_t)o->kargs[1], sizeof(uint64_t)));
	pthread_mutex_lock(&mu);
	if (fault && !legacy_unusable(hStream)) {
		sticky = true; /* an illegal address: the context is lost */
		pthread_cond_broadcast(&let_go_cv);
		free(o);
	} else {
		r = launch_work(hStream, o);
	}
	pthread_mutex_unlock(&mu);
	if (fault)
		logf_("illegal-address cuLaunchKernel %s", f->name);
	logf_("cuLaunchKernel %s stream=%p result=%d", f->name, (void *)hStream, (int)r);
	return r;
}

/* Copies between the host and the fake's memory: complete when they return. */
EXPORT CUresult cuMemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount)
{
	if (!usable("cuMemcpyHtoD"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ctx_depth == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!in_fake((uintptr_t)dstDevice, ByteCount))
		return CUDA_ERROR_INVALID_VALUE;
	memcpy((void *)(uintptr_t)dstDevice, srcHost, ByteCount);
	logf_("cuMemcpyHtoD bytes=%zu", ByteCount);
	return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount)
{
	if (!usable("cuMemcpyDtoH"))
		return CUDA_ERROR_NOT_INITIALIZED;
	if (ctx_depth == 0)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (!in_fake((uintptr_t)srcDevice, ByteCount))
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
	logf_("cuMemcpyDtoH bytes=%zu", ByteCount);
	return CUDA_SUCCESS;
}
