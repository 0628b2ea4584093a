/* SPDX-License-Identifier: Apache-2.0 */
/*
 * GPU tensors through the CUDA driver API, loaded at run time.
 *
 * Nothing here links against CUDA: the first GPU call dlopen()s libcuda.so.1 (or the file named
 * by $DLPC_CUDA_LIBRARY), resolves every entry point once and calls cuInit(). Host-only work
 * never gets here.
 *
 * Ways of sharing device memory:
 * - legacy CUDA IPC, for any device pointer: the allocation's base is exported with
 *   cuIpcGetMemHandle, together with an interprocess event recorded after the data was written
 *   (past DLPC_CUDA_IPC_EVENTS_MAX live ones, the host waits instead: see event_get()).
 *   The publisher keeps the memory; this file remembers each publication under a token until
 *   the daemon's RECLAIM notice says no attacher can reach it any more, and then calls the
 *   published tensor's deleter.
 * - CUDA VMM, for dlpc_alloc() on a device: cuMemCreate with POSIX fd handles, exported as an
 *   fd that travels like a memfd.
 * - lent VMM memory, for a VMM mapping of someone else's that legacy IPC cannot export: its
 *   allocation's fd (cuMemRetainAllocationHandle), kept and reclaimed like a legacy
 *   publication (struct ipc_pub with vmm set).
 * - bundles: the tensors are copied (cuMemcpyDtoD) into one VMM allocation of the library's.
 *
 * Attaching opens legacy handles through a per-process import cache (handle bytes + device
 * UUID -> mapping, refcounted), so a second attach of the same allocation opens nothing, and an
 * attach in the publishing process itself uses the publisher's own pointer.
 *
 * Driver calls run in the device's primary context, retained once per device and kept.
 *
 * A forked child of a process that initialized the driver makes no driver call at all (see
 * forked()): GPU calls fail with -EBADFD, and inherited GPU tensors release nothing.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_api.h"
#include "core.h"
#include "region.h"
#include "gpu.h"

#define XSTR(x) STR(x)
#define STR(x) #x

/* Every driver entry point used, resolved by its versioned name (cuda.h's macros expand). */
#define CUDA_FUNCS(X)                                                                              \
	X(cuInit)                                                                                  \
	X(cuGetErrorString)                                                                        \
	X(cuDeviceGetCount)                                                                        \
	X(cuDeviceGet)                                                                             \
	X(cuDeviceGetUuid)                                                                         \
	X(cuDevicePrimaryCtxRetain)                                                                \
	X(cuCtxPushCurrent)                                                                        \
	X(cuCtxPopCurrent)                                                                         \
	X(cuMemGetAddressRange)                                                                    \
	X(cuPointerGetAttribute)                                                                   \
	X(cuMemRetainAllocationHandle)                                                             \
	X(cuIpcGetMemHandle)                                                                       \
	X(cuIpcOpenMemHandle)                                                                      \
	X(cuIpcCloseMemHandle)                                                                     \
	X(cuEventCreate)                                                                           \
	X(cuEventRecord)                                                                           \
	X(cuEventSynchronize)                                                                      \
	X(cuEventQuery)                                                                            \
	X(cuStreamIsCapturing)                                                                     \
	X(cuStreamGetFlags)                                                                        \
	X(cuThreadExchangeStreamCaptureMode)                                                       \
	X(cuEventDestroy)                                                                          \
	X(cuIpcGetEventHandle)                                                                     \
	X(cuIpcOpenEventHandle)                                                                    \
	X(cuStreamWaitEvent)                                                                       \
	X(cuStreamSynchronize)                                                                     \
	X(cuCtxSynchronize)                                                                        \
	X(cuMemcpyDtoD)                                                                            \
	X(cuMemGetAllocationGranularity)                                                           \
	X(cuMemCreate)                                                                             \
	X(cuMemRelease)                                                                            \
	X(cuMemExportToShareableHandle)                                                            \
	X(cuMemImportFromShareableHandle)                                                          \
	X(cuMemAddressReserve)                                                                     \
	X(cuMemAddressFree)                                                                        \
	X(cuMemMap)                                                                                \
	X(cuMemUnmap)                                                                              \
	X(cuMemSetAccess)

static struct {
#define FIELD(f) __typeof__(&f) f;
	CUDA_FUNCS(FIELD)
#undef FIELD
} cu;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static pid_t init_pid;	   /* the process that initialized the driver, 0 before */
static int load_err;	   /* 0 once loaded, else the negative errno */
static char load_msg[320]; /* and why */
static pthread_mutex_t ctx_mu = PTHREAD_MUTEX_INITIALIZER;
static CUcontext ctxs[DLPC_CUDA_DEVICES_MAX];

static void load(void)
{
	const char *path = getenv(DLPC_CUDA_LIBRARY_ENV);
	const char *lib = path && *path ? path : DLPC_CUDA_LIBRARY_DEFAULT;
	void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	CUresult e;

	if (!h) {
		const char *why = dlerror();

		load_err = -ENODEV;
		snprintf(load_msg, sizeof(load_msg), "CUDA driver (%s) not found: %s", lib,
			 why ? why : "dlopen failed");
		return;
	}
#define RESOLVE(f)                                                                                 \
	cu.f = (__typeof__(cu.f))dlsym(h, XSTR(f));                                                \
	if (!cu.f) {                                                                               \
		load_err = -ENOSYS;                                                                \
		snprintf(load_msg, sizeof(load_msg), "CUDA driver %s lacks %s (too old?)", lib,    \
			 XSTR(f));                                                                 \
		return;                                                                            \
	}
	CUDA_FUNCS(RESOLVE)
#undef RESOLVE
	e = cu.cuInit(0);
	if (e == CUDA_SUCCESS)
		init_pid = getpid();
	if (e != CUDA_SUCCESS) {
		load_err = e == CUDA_ERROR_NO_DEVICE ? -ENODEV : -EIO;
		snprintf(load_msg, sizeof(load_msg), "CUDA driver %s: cuInit failed (error %d)",
			 lib, (int)e);
	}
	/* the library stays loaded for the life of the process */
}

/*
 * Is this a forked child of the process that initialized the driver? CUDA's state is not
 * carried over by fork(), and any driver call there is undefined: nothing here makes one, so
 * that the locks and caches below, copied in whatever state another thread left them, are
 * never used either. Mappings inherited from the parent are forgotten, not unmapped.
 */
static bool forked(void)
{
	return init_pid && init_pid != getpid();
}

/* 0 when the driver is usable, else a negative errno with the message set for @p what. */
static int driver(const char *what)
{
	if (forked())
		return dlpc__fail(-EBADFD,
				  "%s: CUDA was initialized in process %d, which forked this one, "
				  "and a forked child cannot use it: start the process with exec "
				  "(multiprocessing's 'spawn' or 'forkserver') instead",
				  what, (int)init_pid);
	pthread_once(&load_once, load);
	if (load_err)
		return dlpc__fail(load_err, "%s: %s", what, load_msg);
	return 0;
}

int dlpc__cuda_check(const char *what)
{
	return driver(what);
}

/* A failed driver call as a negative errno, the message naming @p what and @p fn. */
static int cu_fail(CUresult e, const char *fn, const char *what)
{
	const char *s = NULL;

	if (cu.cuGetErrorString)
		cu.cuGetErrorString(e, &s);
	if (e == CUDA_ERROR_NOT_SUPPORTED)
		return dlpc__fail(-ENOTSUP, "%s: %s: not supported on this platform", what, fn);
	return dlpc__fail(e == CUDA_ERROR_OUT_OF_MEMORY	   ? -ENOMEM
			  : e == CUDA_ERROR_INVALID_VALUE  ? -EINVAL
			  : e == CUDA_ERROR_INVALID_DEVICE ? -ENODEV
							   : -EIO,
			  "%s: %s failed: %s (CUDA error %d)", what, fn, s ? s : "unknown error",
			  (int)e);
}

#define CU_CALL(what, fn, ...)                                                                     \
	({                                                                                         \
		CUresult _e = cu.fn(__VA_ARGS__);                                                  \
		_e == CUDA_SUCCESS ? 0 : cu_fail(_e, #fn, what);                                   \
	})

/* 0 if libdlpc can use device @p ordinal at all; -ENODEV past DLPC_CUDA_DEVICES_MAX. */
static int ordinal_check(int ordinal, const char *what)
{
	if (ordinal < 0 || ordinal >= DLPC_CUDA_DEVICES_MAX)
		return dlpc__fail(
			-ENODEV,
			"%s: CUDA device %d is out of range (libdlpc uses devices 0 to %d)", what,
			ordinal, DLPC_CUDA_DEVICES_MAX - 1);
	return 0;
}

/* Make device @p ordinal's primary context current (pop_ctx() undoes it). */
static int push_ctx(int ordinal, const char *what)
{
	CUcontext ctx;
	CUdevice dev;
	int r = 0;

	r = ordinal_check(ordinal, what);
	if (r < 0)
		return r;
	pthread_mutex_lock(&ctx_mu);
	if (!ctxs[ordinal]) {
		r = CU_CALL(what, cuDeviceGet, &dev, ordinal);
		if (r == 0)
			r = CU_CALL(what, cuDevicePrimaryCtxRetain, &ctxs[ordinal], dev);
	}
	ctx = ctxs[ordinal];
	pthread_mutex_unlock(&ctx_mu);
	return r < 0 ? r : CU_CALL(what, cuCtxPushCurrent, ctx);
}

static void pop_ctx(void)
{
	CUcontext ctx;

	cu.cuCtxPopCurrent(&ctx);
}

/* The ordinal of the device with @p uuid in this process. */
static int uuid_ordinal(const uint8_t uuid[DLPC_CUDA_UUID_SIZE], const char *what)
{
	int n = 0, r = CU_CALL(what, cuDeviceGetCount, &n);

	for (int i = 0; r == 0 && i < n && i < DLPC_CUDA_DEVICES_MAX; i++) {
		CUdevice dev;
		CUuuid u;

		r = CU_CALL(what, cuDeviceGet, &dev, i);
		if (r == 0)
			r = CU_CALL(what, cuDeviceGetUuid, &u, dev);
		if (r == 0 && memcmp(u.bytes, uuid, DLPC_CUDA_UUID_SIZE) == 0)
			return i;
	}
	return r < 0 ? r
		     : dlpc__fail(-ENODEV,
				  "%s: its CUDA device is not visible in this process (%d devices)",
				  what, n);
}

int dlpc__cuda_device_uuid(int ordinal, uint8_t uuid[DLPC_CUDA_UUID_SIZE], const char *what)
{
	CUdevice dev;
	CUuuid u;
	int r = driver(what);

	if (r == 0)
		r = ordinal_check(ordinal, what);
	if (r == 0)
		r = CU_CALL(what, cuDeviceGet, &dev, ordinal);
	if (r == 0)
		r = CU_CALL(what, cuDeviceGetUuid, &u, dev);
	if (r == 0)
		memcpy(uuid, u.bytes, DLPC_CUDA_UUID_SIZE);
	return r;
}

/* ---- legacy IPC: the publisher's side ---- */

/* A legacy IPC or lent VMM publication of this process, kept until its RECLAIM notice. */
struct ipc_pub {
	struct ipc_pub *next;
	uint64_t token;
	DLManagedTensorVersioned *t; /* the published tensor: its deleter runs at reclaim */
	CUevent ev;
	int ordinal;
	uint8_t key[DLPC_CUDA_IPC_HANDLE_SIZE + DLPC_CUDA_UUID_SIZE]; /* handle + UUID */
	uint8_t ev_handle[DLPC_CUDA_IPC_HANDLE_SIZE];
	CUdeviceptr base;
	bool shared_ev; /* ev is its device's completed event (done_ev), not its own */
	bool vmm;	/* lent as a VMM export fd: no IPC handle, no event */
};

static pthread_mutex_t pubs_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ipc_pub *pubs;
static uint64_t next_token;
/*
 * Under pubs_mu: the interprocess events the publications own, at most
 * DLPC_CUDA_IPC_EVENTS_MAX; and per device, the event that publications past that share: it
 * was recorded and waited for once, so waiting on it is free, with how many share it.
 */
static unsigned own_events;
static struct {
	CUevent ev;
	unsigned users;
} done_ev[DLPC_CUDA_DEVICES_MAX];

/*
 * Give @p p an interprocess event that its attachers can wait on, in its device's context: its
 * own, recorded now on the legacy default stream (after the work of every blocking stream), or
 * past DLPC_CUDA_IPC_EVENTS_MAX the shared completed one, once the host has waited for all of
 * the context's work.
 */
static int event_get(struct ipc_pub *p, const char *what)
{
	CUevent ev = NULL;
	bool own;
	int r;

	pthread_mutex_lock(&pubs_mu);
	own = own_events < DLPC_CUDA_IPC_EVENTS_MAX;
	own_events += own;
	pthread_mutex_unlock(&pubs_mu);
	if (own) {
		r = CU_CALL(what, cuEventCreate, &ev,
			    CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
		if (r == 0)
			r = CU_CALL(what, cuEventRecord, ev, (CUstream)0);
		if (r < 0) {
			if (ev)
				cu.cuEventDestroy(ev);
			pthread_mutex_lock(&pubs_mu);
			own_events--;
			pthread_mutex_unlock(&pubs_mu);
			return r;
		}
		p->ev = ev;
		return 0;
	}
	r = CU_CALL(what, cuCtxSynchronize);
	if (r < 0)
		return r;
	pthread_mutex_lock(&pubs_mu);
	if (!done_ev[p->ordinal].ev) {
		r = CU_CALL(what, cuEventCreate, &ev,
			    CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS);
		if (r == 0)
			r = CU_CALL(what, cuEventRecord, ev, (CUstream)0);
		if (r == 0)
			r = CU_CALL(what, cuEventSynchronize, ev);
		if (r == 0)
			done_ev[p->ordinal].ev = ev;
		else if (ev)
			cu.cuEventDestroy(ev);
	}
	if (r == 0) {
		done_ev[p->ordinal].users++;
		p->ev = done_ev[p->ordinal].ev;
		p->shared_ev = true;
	}
	pthread_mutex_unlock(&pubs_mu);
	return r;
}

/* Undo event_get(), in @p p's device context if @p in_ctx (else the event is leaked). */
static void event_put(struct ipc_pub *p, bool in_ctx)
{
	CUevent ev = p->ev;

	pthread_mutex_lock(&pubs_mu);
	if (!p->shared_ev)
		own_events -= in_ctx; /* one that cannot be destroyed still counts */
	else if (--done_ev[p->ordinal].users > 0)
		ev = NULL;
	else
		done_ev[p->ordinal].ev = NULL;
	pthread_mutex_unlock(&pubs_mu);
	if (ev && in_ctx)
		cu.cuEventDestroy(ev);
	p->ev = NULL;
}

/* Can @p ptr's allocation go by legacy IPC? A driver that does not know the attribute says so
 * later, through cuIpcGetMemHandle. */
static bool legacy_capable(CUdeviceptr ptr)
{
	int capable = 1;

	if (cu.cuPointerGetAttribute(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
				     ptr) != CUDA_SUCCESS)
		return true;
	return capable != 0;
}

/*
 * Export the VMM allocation mapped at @p ptr (PyTorch's expandable segments, any cuMemMap
 * user) as a POSIX fd in *@p fd, once the host has waited for the context's work: it goes with
 * no interprocess event. Memory that can go neither this way nor by legacy IPC gets an error
 * naming the allocator setting behind it. In the device's context.
 */
static int vmm_export(CUdeviceptr ptr, int *fd, const char *what)
{
	unsigned long long types = 0;
	CUmemGenericAllocationHandle h;
	void *pool = NULL;
	int r;

	if (cu.cuPointerGetAttribute(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr) ==
		    CUDA_SUCCESS &&
	    pool)
		return dlpc__fail(
			-ENOTSUP,
			"%s: its memory comes from a stream-ordered pool (cudaMallocAsync; "
			"PyTorch's PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, CuPy's "
			"MemoryAsyncPool), which CUDA IPC cannot export: allocate it with "
			"the default allocator or dlpc_alloc() (dlpack_ipc.empty(..., "
			"device=\"cuda:N\")) instead",
			what);
	if (cu.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)ptr) != CUDA_SUCCESS)
		return dlpc__fail(
			-ENOTSUP,
			"%s: the driver says its memory cannot go by legacy CUDA IPC, and "
			"it is no VMM mapping either: allocate it with the default "
			"allocator or dlpc_alloc() instead",
			what);
	if (cu.cuPointerGetAttribute(&types, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, ptr) !=
	    CUDA_SUCCESS)
		types = 0;
	if (!(types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
		cu.cuMemRelease(h);
		return dlpc__fail(-ENOTSUP,
				  "%s: its memory is a CUDA VMM mapping made without a POSIX file "
				  "descriptor handle type (as PyTorch's expandable_segments:True "
				  "makes them), which cannot be exported: turn expandable segments "
				  "off, or allocate with dlpc_alloc() instead",
				  what);
	}
	r = CU_CALL(what, cuMemExportToShareableHandle, fd, h,
		    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	/* the mapping keeps the allocation; the export fd keeps it for the daemon */
	cu.cuMemRelease(h);
	if (r < 0)
		return r;
	if (fcntl(*fd, F_SETFD, FD_CLOEXEC) < 0)
		r = dlpc__fail(-errno, "%s: cannot set close-on-exec on the export fd: %m", what);
	if (r == 0)
		r = CU_CALL(what, cuCtxSynchronize);
	if (r < 0) {
		close(*fd);
		*fd = -1;
	}
	return r;
}

int dlpc__cuda_ipc_export(DLManagedTensorVersioned *t, uint64_t nbytes, const char *name,
			  struct dlpc__ipc_export *x)
{
	char what[DLPC_NAME_MAX + 32];
	const DLTensor *d = &t->dl_tensor;
	CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)d->data + d->byte_offset, base;
	struct ipc_pub *p;
	size_t size;
	int r;

	x->fd = -1;
	snprintf(what, sizeof(what), "cannot publish '%s'", name);
	r = driver(what);
	if (r < 0)
		return r;
	p = calloc(1, sizeof(*p));
	if (!p)
		return dlpc__fail(-ENOMEM, "%s: out of memory", what);
	p->ordinal = d->device.device_id;
	r = push_ctx(p->ordinal, what);
	if (r < 0) {
		free(p);
		return r;
	}
	r = CU_CALL(what, cuMemGetAddressRange, &base, &size, ptr);
	p->vmm = r == 0 && !legacy_capable(ptr);
	if (r == 0 && (ptr - base) + nbytes > size)
		r = dlpc__fail(-EINVAL, "%s: %llu bytes at %#llx run past its allocation%s", what,
			       (unsigned long long)nbytes, (unsigned long long)ptr,
			       p->vmm ? " (it spans several VMM mappings, as PyTorch's "
					"expandable segments may place a tensor)"
				      : "");
	if (r == 0 && p->vmm) {
		r = vmm_export(ptr, &x->fd, what);
	} else if (r == 0) {
		r = CU_CALL(what, cuIpcGetMemHandle, (CUipcMemHandle *)x->mem_handle, base);
		if (r == 0)
			r = event_get(p, what);
		if (r == 0)
			r = CU_CALL(what, cuIpcGetEventHandle, (CUipcEventHandle *)x->event_handle,
				    p->ev);
	}
	if (r == 0)
		r = dlpc__cuda_device_uuid(p->ordinal, x->uuid, what);
	if (r < 0) {
		if (p->ev)
			event_put(p, true);
		if (x->fd >= 0)
			close(x->fd);
		x->fd = -1;
		pop_ctx();
		free(p);
		return r;
	}
	pop_ctx();
	x->offset = ptr - base;
	x->alloc_size = size;
	p->t = t;
	p->base = base;
	if (!p->vmm) {
		memcpy(p->key, x->mem_handle, DLPC_CUDA_IPC_HANDLE_SIZE);
		memcpy(p->key + DLPC_CUDA_IPC_HANDLE_SIZE, x->uuid, DLPC_CUDA_UUID_SIZE);
		memcpy(p->ev_handle, x->event_handle, DLPC_CUDA_IPC_HANDLE_SIZE);
	}
	pthread_mutex_lock(&pubs_mu);
	p->token = x->token = ++next_token;
	p->next = pubs;
	pubs = p;
	pthread_mutex_unlock(&pubs_mu);
	return 0;
}

/* Unlink the publication with @p token; NULL if none. */
static struct ipc_pub *pub_take(uint64_t token)
{
	struct ipc_pub *p = NULL;

	pthread_mutex_lock(&pubs_mu);
	for (struct ipc_pub **pp = &pubs; *pp; pp = &(*pp)->next)
		if ((*pp)->token == token) {
			p = *pp;
			*pp = p->next;
			break;
		}
	pthread_mutex_unlock(&pubs_mu);
	return p;
}

bool dlpc__cuda_reclaim(uint64_t token, bool run_deleter)
{
	struct ipc_pub *p;
	bool pushed;

	if (forked())
		return false;
	p = pub_take(token);
	if (!p)
		return false;
	/* the producer's deleter runs in its device's context too: it may free the memory */
	pushed = push_ctx(p->ordinal, "reclaim") == 0;
	if (p->ev)
		event_put(p, pushed);
	if (run_deleter && p->t->deleter)
		p->t->deleter(p->t);
	if (pushed)
		pop_ctx();
	free(p);
	return true;
}

/* ---- attaching ---- */

/* An opened legacy allocation, or an imported VMM one. */
struct dlpc__gpu_map {
	struct dlpc__gpu_map *next; /* in the import cache (legacy only) */
	unsigned refs;		    /* under cache_mu */
	bool vmm;
	int ordinal;
	CUdeviceptr base;
	size_t size;
	CUmemGenericAllocationHandle handle; /* VMM, this process's allocation: its handle */
	uint8_t key[DLPC_CUDA_IPC_HANDLE_SIZE + DLPC_CUDA_UUID_SIZE];
};

static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static struct dlpc__gpu_map *cache;

/*
 * Order work after the publisher's event: on @p stream, or by waiting here if it is NULL. An
 * event of this process's own publications is used as is (a process cannot open its own IPC
 * handles). Called in the device's context.
 */
static int wait_event(const uint8_t ev_handle[DLPC_CUDA_IPC_HANDLE_SIZE], void *stream,
		      const char *what)
{
	CUipcEventHandle h;
	CUevent ev = NULL;
	bool own = false;
	int r = 0;

	/* the publication (and its event) lives while an attached tensor holds its entry */
	pthread_mutex_lock(&pubs_mu);
	for (struct ipc_pub *p = pubs; p; p = p->next)
		if (!p->vmm && memcmp(p->ev_handle, ev_handle, DLPC_CUDA_IPC_HANDLE_SIZE) == 0) {
			ev = p->ev;
			own = true;
			break;
		}
	pthread_mutex_unlock(&pubs_mu);
	if (!own) {
		memcpy(h.reserved, ev_handle, sizeof(h.reserved));
		r = CU_CALL(what, cuIpcOpenEventHandle, &ev, h);
	}
	if (r < 0)
		return r;
	if (stream) {
		r = CU_CALL(what, cuStreamWaitEvent, (CUstream)stream, ev, 0);
	} else {
		/* relaxed: in global mode the wait would be refused, and another thread's graph
		 * capture invalidated (an event query was, on an H200); put back as it was */
		CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_RELAXED;
		bool swapped = cu.cuThreadExchangeStreamCaptureMode(&mode) == CUDA_SUCCESS;

		r = CU_CALL(what, cuEventSynchronize, ev);
		if (swapped)
			cu.cuThreadExchangeStreamCaptureMode(&mode);
	}
	if (!own)
		cu.cuEventDestroy(ev);
	return r;
}

void dlpc__cuda_release_sync(int ordinal, bool all)
{
	if (driver("release") < 0 || push_ctx(ordinal, "release") < 0)
		return;
	if (all)
		cu.cuCtxSynchronize();
	else
		cu.cuStreamSynchronize(CU_STREAM_LEGACY);
	pop_ctx();
}

/* ---- letting go of attached memory after the consumer's work ---- */

/*
 * Why no stream of the consumer's is used here. DLPack leaves the stream a consumer names in
 * __dlpack__(stream=...) (dlpc_tensor_wait(), dlpc_attach_opts.stream) the consumer's: the
 * producer may use it during that call, no later. Consumers do destroy it before they drop the
 * tensor (CuPy's `with cupy.cuda.Stream():` block ends, the array lives on), and a destroyed
 * stream's handle is undefined behaviour in the driver (a segfault, seen on an H200). An event
 * recorded on it at that call would come before the work that follows, so it orders nothing.
 *
 * What is safe at release, long after: the work queued on a destroyed stream still runs to its
 * end, and the legacy default stream, which is never destroyed, follows the work of every
 * blocking stream (the per-thread default streams and CuPy's and most other streams among
 * them). So the release waits for an event recorded on the legacy stream. A non-blocking stream
 * (PyTorch's side streams) is followed by no other stream: for a consumer that named one, known
 * while its handle was valid (dlpc__cuda_stream_followed()), the library's thread synchronizes
 * the whole context instead. That is correct for any stream but costs more: the release waits
 * for all of the context's work queued by then, and the thread is blocked meanwhile (never the
 * consumer); and while a graph captures in the context it cannot be done at all, so it waits
 * for the capture to end (a capture on a non-blocking stream is invisible from here, and a
 * synchronization that meets one fails it, as with the event's record during any capture).
 */
bool dlpc__cuda_stream_followed(void *stream)
{
	unsigned flags = 0;

	if (!stream || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD)
		return true;
	if (forked() || driver("stream") < 0)
		return false; /* the release then waits on the host, for the whole context */
	return cu.cuStreamGetFlags((CUstream)stream, &flags) == CUDA_SUCCESS &&
	       !(flags & CU_STREAM_NON_BLOCKING);
}

/* An attached region whose last view is gone, waiting for the consumer's work on it. */
struct retiring {
	struct retiring *next;
	struct dlpc__region *r;
	bool record;  /* the event is still to be recorded on the legacy stream */
	CUevent ev;   /* recorded after the consumer's work (blocking sync: see retire_block()) */
	bool sync;    /* synchronize the context instead (no event to be had, or not enough) */
	CUresult err; /* the context's synchronization failed so (reported once let go) */
	unsigned long seq; /* order of the releases (retire_oldest()) */
};

static pthread_mutex_t retire_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t retire_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t retire_idle_cv = PTHREAD_COND_INITIALIZER;
static struct retiring *retiring;
static bool retirer_running;
static bool retire_busy;	       /* the retiring thread is working through a batch */
static bool retire_stopping;	       /* the process is exiting: no more driver calls from it */
static unsigned retire_wakes;	       /* releases queued: something new to look at */
static _Atomic unsigned release_holds; /* dlpc_cuda_hold_releases() not yet resumed */

/*
 * At exit: let the retiring thread finish the batch it is on, then stop it, so that none of
 * its driver calls runs while the driver tears itself down. What it has not released, dlpackd
 * drops with the connection. Not in a forked child, which inherits the handler (and maybe a
 * held retire_mu) but not the thread.
 */
static void retire_stop(void)
{
	if (forked())
		return;
	pthread_mutex_lock(&retire_mu);
	retire_stopping = true;
	pthread_cond_broadcast(&retire_cv);
	while (retire_busy)
		pthread_cond_wait(&retire_idle_cv, &retire_mu);
	pthread_mutex_unlock(&retire_mu);
}

/* Does @p e say that a graph capture is in the way (try again once it has ended)? */
static bool capture_err(CUresult e)
{
	return e == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ||
	       e == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED ||
	       e == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
}

/* Is a blocking stream of the current context capturing a graph (the legacy stream unusable)? */
static bool legacy_captured(void)
{
	CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
	CUresult e = cu.cuStreamIsCapturing(CU_STREAM_LEGACY, &st);

	return e == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT ||
	       (e == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE);
}

/*
 * Record @p x's event on the legacy default stream, after the work of every blocking stream so
 * far, unless a graph capture is in the way: the legacy stream cannot be used at all while a
 * blocking stream captures (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT). Then x->record stays, for a
 * later look from the retiring thread (later is still after the consumer's work). Never on a
 * stream of the consumer's (see dlpc__cuda_stream_followed()). In the device's context.
 */
static void record_after(struct retiring *x)
{
	CUresult e;

	/* held: a capture may be under way or begin between the look and the record, and a
	 * record during a blocking stream's capture loses it (seen on an H200) */
	if (atomic_load(&release_holds) > 0 || legacy_captured())
		return;
	/* blocking sync: the retiring thread's cuEventSynchronize sleeps instead of spinning */
	e = x->ev ? CUDA_SUCCESS
		  : cu.cuEventCreate(&x->ev, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING);
	if (e == CUDA_SUCCESS)
		e = cu.cuEventRecord(x->ev, CU_STREAM_LEGACY);
	if (capture_err(e))
		return;
	x->record = false;
	x->sync = e != CUDA_SUCCESS; /* no event to be had */
}

/* Is the consumer's work on @p x's region done? Called on the retiring thread. */
static bool retire_due(struct retiring *x)
{
	bool done = true;
	CUresult e;

	if (push_ctx(x->r->ordinal, "release") < 0)
		return true;
	if (x->record)
		record_after(x);
	if (x->record) {
		done = false;
	} else if (!x->sync) {
		e = cu.cuEventQuery(x->ev);
		done = e != CUDA_ERROR_NOT_READY;
		x->sync = done && e != CUDA_SUCCESS;
	}
	/* a non-blocking stream, or no event: synchronizing during a capture would fail it, so
	 * wait for a capture that can be seen to end, or that the caller said may be under way
	 * (dlpc_cuda_hold_releases()), and try again after one that could not be seen */
	if (x->sync && (atomic_load(&release_holds) > 0 || legacy_captured())) {
		done = false;
	} else if (x->sync) {
		e = cu.cuCtxSynchronize();
		done = !capture_err(e);
		x->err = done ? e : CUDA_SUCCESS;
	}
	pop_ctx();
	return done;
}

/*
 * Say on stderr that @p x's consumer work ended in an error of the driver's (a sticky error
 * such as a faulting kernel: the device's context is lost, and nothing of it runs any more),
 * and that its memory is let go all the same. The retiring thread has no caller to tell.
 */
static void retire_report(const struct retiring *x)
{
	fprintf(stderr,
		"libdlpc: release of an attached tensor on CUDA device %d: the consumer's work "
		"ended in a CUDA error (cuCtxSynchronize failed: CUDA error %d); its memory is "
		"let go\n",
		x->r->ordinal, (int)x->err);
}

/*
 * Let go of each region of @p todo whose consumer work is done (unmap, RELEASE); the others
 * are returned, and *@p poll says whether one of them has no event to wait on (a graph
 * capture was in the way of its record, or of its context's synchronization), unless it
 * waits for the end of a hold (dlpc_cuda_resume_releases() wakes the thread).
 */
static struct retiring *retire_batch(struct retiring *todo, bool *poll)
{
	struct retiring *left = NULL, *x;

	*poll = false;
	while ((x = todo)) {
		todo = x->next;
		if (!retire_due(x)) {
			*poll |= (x->record || x->sync) && atomic_load(&release_holds) == 0;
			x->next = left;
			left = x;
			continue;
		}
		if (x->err != CUDA_SUCCESS)
			retire_report(x);
		if (x->ev)
			cu.cuEventDestroy(x->ev);
		if (x->r->gpu)
			dlpc__cuda_unmap(x->r->gpu);
		dlpc__region_finish(x->r);
		free(x);
	}
	return left;
}

/*
 * The waiting region to block on: of @p left's that wait for an event (not for a record or a
 * context synchronization held back by dlpc_cuda_hold_releases()), the oldest (its event completes
 * first, the legacy stream being in order), if they are all on one device; NULL when they
 * are spread over several (blocking on one device's event would keep another's releases
 * waiting) or when none waits for an event (*@p held then says so).
 */
static struct retiring *retire_oldest(struct retiring *left, bool *held)
{
	struct retiring *old = NULL;

	*held = true;
	for (struct retiring *x = left; x; x = x->next) {
		if (x->sync || x->record)
			continue;
		*held = false;
		if (old && x->r->ordinal != old->r->ordinal)
			return NULL;
		if (!old || x->seq < old->seq)
			old = x;
	}
	return old;
}

/*
 * Block the retiring thread, not holding retire_mu (a releaser needs it), until @p x's event
 * has completed: it was created CU_EVENT_BLOCKING_SYNC, so the driver puts the thread to sleep
 * instead of spinning, and nothing is added to any stream. A sticky error ends the wait at
 * once with that error, which the next look at the event finds and reports.
 */
static void retire_block(struct retiring *x)
{
	pthread_mutex_unlock(&retire_mu);
	if (push_ctx(x->r->ordinal, "release") == 0) {
		cu.cuEventSynchronize(x->ev);
		pop_ctx();
	}
	pthread_mutex_lock(&retire_mu);
}

/*
 * Wait with retire_mu for a new release (or a hold's end), or for
 * DLPC_CUDA_RETIRE_FALLBACK_MS, whichever comes first, or with @p held for the first of the
 * two only (@p seen: retire_wakes when the thread last looked).
 */
static void retire_fallback_wait(unsigned seen, bool held)
{
	struct timespec until;

	while (held && retire_wakes == seen && !retire_stopping)
		pthread_cond_wait(&retire_cv, &retire_mu);

	clock_gettime(CLOCK_REALTIME, &until); /* retire_cv's clock */
	until.tv_nsec += DLPC_CUDA_RETIRE_FALLBACK_MS * 1000000L;
	until.tv_sec += until.tv_nsec / 1000000000L;
	until.tv_nsec %= 1000000000L;
	while (retire_wakes == seen && !retire_stopping)
		if (pthread_cond_timedwait(&retire_cv, &retire_mu, &until) == ETIMEDOUT)
			break;
}

/*
 * The retiring thread: lets go of each waiting region whose consumer work is done. Between
 * looks it sleeps in cuEventSynchronize on the oldest waiting release's event (retire_block()),
 * or, while they are spread over several devices, until a new release or
 * DLPC_CUDA_RETIRE_FALLBACK_MS. Only while a graph capture keeps an event from being recorded
 * does it look every DLPC_CUDA_RETIRE_POLL_MS. It runs in relaxed capture mode: its calls
 * (unmapping among them) are not refused while another thread captures a graph in global mode.
 */
static void *retirer(void *arg)
{
	const struct timespec poll_ts = {.tv_nsec = DLPC_CUDA_RETIRE_POLL_MS * 1000000L};
	CUstreamCaptureMode relaxed = CU_STREAM_CAPTURE_MODE_RELAXED;
	struct retiring *left, *x, *oldest;
	unsigned seen;
	bool poll, held = false;

	(void)arg;
	cu.cuThreadExchangeStreamCaptureMode(&relaxed);
	pthread_mutex_lock(&retire_mu);
	for (;;) {
		while (!retiring && !retire_stopping)
			pthread_cond_wait(&retire_cv, &retire_mu);
		if (retire_stopping)
			break;
		left = retiring;
		retiring = NULL;
		retire_busy = true;
		seen = retire_wakes;
		pthread_mutex_unlock(&retire_mu);
		left = retire_batch(left, &poll);
		if (left && poll)
			nanosleep(&poll_ts, NULL);
		held = false;
		oldest = left && !poll ? retire_oldest(left, &held) : NULL;
		pthread_mutex_lock(&retire_mu);
		while ((x = left)) {
			left = x->next;
			x->next = retiring;
			retiring = x;
		}
		retire_busy = false; /* not while blocked: an exit does not wait for the GPU */
		pthread_cond_broadcast(&retire_idle_cv);
		if (oldest && !retire_stopping)
			retire_block(oldest);
		else if (retiring && !poll)
			retire_fallback_wait(seen, held);
	}
	pthread_mutex_unlock(&retire_mu);
	return NULL;
}

bool dlpc__cuda_retire(struct dlpc__region *r)
{
	struct retiring *x;
	bool stopping;

	if (forked() || driver("release") < 0)
		return false;
	pthread_mutex_lock(&retire_mu);
	stopping = retire_stopping;
	pthread_mutex_unlock(&retire_mu);
	/* during exit: no more driver calls; the daemon drops the reference with the connection */
	if (stopping)
		return true;
	x = calloc(1, sizeof(*x));
	if (!x)
		return false;
	x->r = r;
	/*
	 * After the work queued so far on every blocking stream (an event on the legacy default
	 * stream), or, once the consumer named a non-blocking stream, after all of the context's
	 * work (synchronized on the retiring thread, not here: a deleter waits for nothing). The
	 * consumer's stream itself may be gone by now.
	 */
	x->sync = atomic_load(&r->sync_ctx);
	x->record = !x->sync;
	if (x->record) {
		if (push_ctx(r->ordinal, "release") < 0) {
			free(x);
			return false;
		}
		record_after(x);
		pop_ctx();
	}
	pthread_mutex_lock(&retire_mu);
	if (!retirer_running) {
		retirer_running = dlpc__start_thread(retirer, NULL);
		if (retirer_running)
			atexit(retire_stop);
	}
	if (retirer_running) {
		x->seq = retire_wakes++;
		x->next = retiring;
		retiring = x;
		pthread_cond_signal(&retire_cv);
	}
	pthread_mutex_unlock(&retire_mu);
	if (retirer_running)
		return true;
	if (x->ev)
		cu.cuEventDestroy(x->ev);
	free(x);
	return false;
}

void dlpc_cuda_hold_releases(void)
{
	atomic_fetch_add(&release_holds, 1);
}

void dlpc_cuda_resume_releases(void)
{
	unsigned n = atomic_load(&release_holds);

	/* never below zero: a resume without its hold changes nothing */
	while (n > 0 && !atomic_compare_exchange_weak(&release_holds, &n, n - 1))
		;
	/* a forked child has no retiring thread, and retire_mu may have been held at the fork */
	if (n != 1 || forked())
		return;
	pthread_mutex_lock(&retire_mu);
	retire_wakes++;
	pthread_cond_broadcast(&retire_cv);
	pthread_mutex_unlock(&retire_mu);
}

int dlpc__cuda_wait(const uint8_t ev_handle[DLPC_CUDA_IPC_HANDLE_SIZE], int ordinal, void *stream,
		    const char *what)
{
	int r = driver(what);

	if (r == 0)
		r = push_ctx(ordinal, what);
	if (r < 0)
		return r;
	r = wait_event(ev_handle, stream, what);
	pop_ctx();
	return r;
}

/*
 * Whether the legacy allocation at @p base, of @p size bytes, holds the @p need bytes its entry
 * spans: the daemon passes an IPC handle on as the publisher gave it, and a publisher that is
 * not libdlpc may claim more than it allocated (the consumer's kernels would then read past the
 * allocation, which faults its context). -EPROTO if not.
 */
static int ipc_holds(CUdeviceptr base, size_t size, uint64_t need, const char *what)
{
	if (need <= size)
		return 0;
	return dlpc__fail(
		-EPROTO,
		"%s: the entry spans %llu bytes, and the allocation its publisher "
		"shared at %#llx has %zu: refused (the publisher is not libdlpc, or lies)",
		what, (unsigned long long)need, (unsigned long long)base, size);
}

/*
 * The import cache's mapping of the allocation @p key names (its IPC handle, then its device's
 * UUID), opened into device @p ord's context (current) if no attach holds it yet; its size
 * looked up then. 0 and *@p ret (a reference: dlpc__cuda_unmap()), or a negative errno.
 */
static int ipc_open(const uint8_t key[DLPC_CUDA_IPC_HANDLE_SIZE + DLPC_CUDA_UUID_SIZE], int ord,
		    const char *what, struct dlpc__gpu_map **ret)
{
	struct dlpc__gpu_map *m;
	CUipcMemHandle h;
	int r = 0;

	pthread_mutex_lock(&cache_mu);
	for (m = cache; m; m = m->next)
		if (memcmp(m->key, key, sizeof(m->key)) == 0) {
			m->refs++;
			break;
		}
	if (!m) {
		m = calloc(1, sizeof(*m));
		if (!m) {
			r = dlpc__fail(-ENOMEM, "%s: out of memory", what);
		} else {
			memcpy(h.reserved, key, sizeof(h.reserved));
			r = CU_CALL(what, cuIpcOpenMemHandle, &m->base, h,
				    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
			/* its size, for every attach of it (ipc_holds()) */
			if (r == 0) {
				r = CU_CALL(what, cuMemGetAddressRange, NULL, &m->size, m->base);
				if (r < 0)
					cu.cuIpcCloseMemHandle(m->base);
			}
		}
		if (r == 0) {
			memcpy(m->key, key, sizeof(m->key));
			m->refs = 1;
			m->ordinal = ord;
			m->next = cache;
			cache = m;
		} else {
			free(m);
			m = NULL;
		}
	}
	pthread_mutex_unlock(&cache_mu);
	*ret = m;
	return r;
}

int dlpc__cuda_ipc_import(const uint8_t uuid[DLPC_CUDA_UUID_SIZE],
			  const uint8_t mem_handle[DLPC_CUDA_IPC_HANDLE_SIZE],
			  const uint8_t ev_handle[DLPC_CUDA_IPC_HANDLE_SIZE], uint64_t need,
			  void *stream, bool defer, const char *name, struct dlpc__gpu_map **ret,
			  void **base, int *ordinal)
{
	uint8_t key[DLPC_CUDA_IPC_HANDLE_SIZE + DLPC_CUDA_UUID_SIZE];
	char what[DLPC_NAME_MAX + 32];
	struct dlpc__gpu_map *m = NULL;
	int r, ord;

	snprintf(what, sizeof(what), "cannot attach '%s'", name);
	*ret = NULL;
	r = driver(what);
	if (r < 0)
		return r;
	memcpy(key, mem_handle, DLPC_CUDA_IPC_HANDLE_SIZE);
	memcpy(key + DLPC_CUDA_IPC_HANDLE_SIZE, uuid, DLPC_CUDA_UUID_SIZE);
	ord = uuid_ordinal(uuid, what);
	if (ord < 0)
		return ord;
	*ordinal = ord;
	r = push_ctx(ord, what);
	if (r < 0)
		return r;
	/* the publisher's own allocation: its pointer, nothing to open or close */
	pthread_mutex_lock(&pubs_mu);
	for (struct ipc_pub *p = pubs; p; p = p->next)
		if (!p->vmm && memcmp(p->key, key, sizeof(key)) == 0) {
			CUdeviceptr own = p->base;
			size_t size = 0;

			*base = (void *)(uintptr_t)own;
			pthread_mutex_unlock(&pubs_mu);
			r = CU_CALL(what, cuMemGetAddressRange, NULL, &size, own);
			if (r == 0)
				r = ipc_holds(own, size, need, what);
			if (r == 0 && !defer)
				r = wait_event(ev_handle, stream, what);
			pop_ctx();
			return r;
		}
	pthread_mutex_unlock(&pubs_mu);
	r = ipc_open(key, ord, what, &m);
	if (r == 0)
		r = ipc_holds(m->base, m->size, need, what);
	if (r == 0 && !defer)
		r = wait_event(ev_handle, stream, what);
	pop_ctx();
	if (r < 0) {
		if (m)
			dlpc__cuda_unmap(m);
		return r;
	}
	*ret = m;
	*base = (void *)(uintptr_t)m->base;
	return 0;
}

/* Undo a VMM mapping of @p size bytes at @p base (the driver keeps errors to itself here). */
static void vmm_unmap(CUdeviceptr base, size_t size)
{
	cu.cuMemUnmap(base, size);
	cu.cuMemAddressFree(base, size);
}

void dlpc__cuda_unmap(struct dlpc__gpu_map *m)
{
	/* a legacy mapping is shared through the import cache, which this child must not touch:
	 * it is forgotten; a VMM one belongs to its region alone */
	if (forked()) {
		if (m->vmm)
			free(m);
		return;
	}
	if (!m->vmm) {
		pthread_mutex_lock(&cache_mu);
		if (--m->refs > 0) {
			pthread_mutex_unlock(&cache_mu);
			return;
		}
		for (struct dlpc__gpu_map **pp = &cache; *pp; pp = &(*pp)->next)
			if (*pp == m) {
				*pp = m->next;
				break;
			}
		/* closed before the lock goes: an attach of the same allocation meanwhile would
		 * otherwise open a handle that is still open */
		if (push_ctx(m->ordinal, "unmap") == 0) {
			cu.cuIpcCloseMemHandle(m->base);
			pop_ctx();
		}
		pthread_mutex_unlock(&cache_mu);
		free(m);
		return;
	}
	if (push_ctx(m->ordinal, "unmap") == 0) {
		vmm_unmap(m->base, m->size);
		if (m->handle)
			cu.cuMemRelease(m->handle);
		pop_ctx();
	}
	free(m);
}

/* ---- VMM ---- */

/* Reserve @p size bytes of address space, map @p h there and make it readable, and writable
 * if @p writable (a read-only attach must not be able to change the entry for everyone). */
static int vmm_map(CUmemGenericAllocationHandle h, size_t size, int ordinal, bool writable,
		   CUdeviceptr *ret, const char *what)
{
	CUmemAccessDesc access = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ordinal},
				  .flags = writable ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
						    : CU_MEM_ACCESS_FLAGS_PROT_READ};
	CUdeviceptr p = 0;
	int r = CU_CALL(what, cuMemAddressReserve, &p, size, 0, 0, 0);

	if (r < 0)
		return r;
	r = CU_CALL(what, cuMemMap, p, size, 0, h, 0);
	if (r < 0) {
		cu.cuMemAddressFree(p, size);
		return r;
	}
	r = CU_CALL(what, cuMemSetAccess, p, size, &access, 1);
	if (r < 0) {
		vmm_unmap(p, size);
		return r;
	}
	*ret = p;
	return 0;
}

int dlpc__cuda_vmm_alloc(int ordinal, uint64_t nbytes, struct dlpc__gpu_map **ret, void **base,
			 size_t *len, int *fd, uint8_t uuid[DLPC_CUDA_UUID_SIZE], const char *what)
{
	CUmemAllocationProp prop = {
		.type = CU_MEM_ALLOCATION_TYPE_PINNED,
		.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
		.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ordinal},
	};
	struct dlpc__gpu_map *m;
	size_t gran = 0, size;
	int r = driver(what);

	*fd = -1;
	if (r < 0)
		return r;
	r = dlpc__cuda_device_uuid(ordinal, uuid, what);
	if (r < 0)
		return r;
	m = calloc(1, sizeof(*m));
	if (!m)
		return dlpc__fail(-ENOMEM, "%s: out of memory", what);
	m->vmm = true;
	m->ordinal = ordinal;
	r = push_ctx(ordinal, what);
	if (r < 0) {
		free(m);
		return r;
	}
	r = CU_CALL(what, cuMemGetAllocationGranularity, &gran, &prop,
		    CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (r == 0 && gran == 0)
		r = dlpc__fail(-EIO, "%s: the driver reports an allocation granularity of 0", what);
	if (r < 0)
		goto fail;
	nbytes = nbytes ? nbytes : 1;
	if (nbytes > SIZE_MAX - gran) {
		r = dlpc__fail(-ENOMEM, "%s: %llu bytes is too large", what,
			       (unsigned long long)nbytes);
		goto fail;
	}
	size = (nbytes + gran - 1) / gran * gran;
	m->size = size;
	r = CU_CALL(what, cuMemCreate, &m->handle, size, &prop, 0);
	if (r < 0)
		goto fail;
	r = CU_CALL(what, cuMemExportToShareableHandle, fd, m->handle,
		    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
	/* the driver's fd may lack close-on-exec, which every fd of ours has */
	if (r == 0 && fcntl(*fd, F_SETFD, FD_CLOEXEC) < 0)
		r = dlpc__fail(-errno, "%s: cannot set close-on-exec on the export fd: %m", what);
	if (r == 0)
		r = vmm_map(m->handle, size, ordinal, true, &m->base, what);
	if (r < 0) {
		if (*fd >= 0)
			close(*fd);
		*fd = -1;
		cu.cuMemRelease(m->handle);
		goto fail;
	}
	pop_ctx();
	*ret = m;
	*base = (void *)(uintptr_t)m->base;
	*len = size;
	return 0;
fail:
	pop_ctx();
	free(m);
	return r;
}

int dlpc__cuda_gather(int ordinal, void *dst, size_t n, const uint64_t offsets[],
		      const void *const srcs[], const size_t sizes[], const char *what)
{
	int r = driver(what);

	if (r == 0)
		r = push_ctx(ordinal, what);
	if (r < 0)
		return r;
	/* on the legacy default stream: after the work of every blocking stream, as the event
	 * of a legacy IPC publication orders */
	for (size_t i = 0; i < n && r == 0; i++)
		if (sizes[i])
			r = CU_CALL(what, cuMemcpyDtoD, (CUdeviceptr)(uintptr_t)dst + offsets[i],
				    (CUdeviceptr)(uintptr_t)srcs[i], sizes[i]);
	/* the entry carries no event: the copies are done before it is published */
	if (r == 0)
		r = CU_CALL(what, cuCtxSynchronize);
	pop_ctx();
	return r;
}

int dlpc__cuda_vmm_import(int fd, uint64_t size, const uint8_t uuid[DLPC_CUDA_UUID_SIZE],
			  bool writable, const char *name, struct dlpc__gpu_map **ret, void **base,
			  int *ordinal)
{
	char what[DLPC_NAME_MAX + 32];
	CUmemGenericAllocationHandle h;
	struct dlpc__gpu_map *m;
	int r, ord;

	snprintf(what, sizeof(what), "cannot attach '%s'", name);
	r = driver(what);
	if (r < 0)
		return r;
	ord = uuid_ordinal(uuid, what);
	if (ord < 0)
		return ord;
	m = calloc(1, sizeof(*m));
	if (!m)
		return dlpc__fail(-ENOMEM, "%s: out of memory", what);
	r = push_ctx(ord, what);
	if (r < 0) {
		free(m);
		return r;
	}
	r = CU_CALL(what, cuMemImportFromShareableHandle, &h, (void *)(uintptr_t)fd,
		    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	if (r == 0) {
		r = vmm_map(h, (size_t)size, ord, writable, &m->base, what);
		/* the mapping holds the memory from here on */
		cu.cuMemRelease(h);
	}
	pop_ctx();
	if (r < 0) {
		free(m);
		return r;
	}
	m->vmm = true;
	m->ordinal = ord;
	m->size = (size_t)size;
	*ret = m;
	*base = (void *)(uintptr_t)m->base;
	*ordinal = ord;
	return 0;
}

static bool cuda_reclaim_run(uint64_t token)
{
	return dlpc__cuda_reclaim(token, true);
}

void dlpc__cuda_register(void)
{
	static const struct dlpc__hooks hooks = {.reclaim_run = cuda_reclaim_run};

	dlpc__hooks_add(&hooks);
}
