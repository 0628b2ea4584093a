/* SPDX-License-Identifier: Apache-2.0 */
/* libdlpc: its use of the CUDA driver, loaded at run time (cuda.c). */
#ifndef DLPC_CLIENT_GPU_H
#define DLPC_CLIENT_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <dlpc/dlpc.h>

#include "limits.h"

struct dlpc__region;

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
 * publications: then *@p ret is NULL), check that it holds the @p need bytes its entry spans
 * (-EPROTO if not), and unless @p defer order @p stream (NULL: this thread) after the
 * publisher's event. *@p base: the allocation here; *@p ordinal: the local device.
 */
int dlpc__cuda_ipc_import(const uint8_t uuid[DLPC_CUDA_UUID_SIZE],
			  const uint8_t mem_handle[DLPC_CUDA_IPC_HANDLE_SIZE],
			  const uint8_t ev_handle[DLPC_CUDA_IPC_HANDLE_SIZE], uint64_t need,
			  void *stream, bool defer, const char *name, struct dlpc__gpu_map **ret,
			  void **base, int *ordinal);
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
/* How often the library's retiring thread looks at consumer work still running while a graph
 * capture keeps it from recording the event it would sleep on (ms). */
#define DLPC_CUDA_RETIRE_POLL_MS 1
/* How often it looks while releases wait on several devices at once, when it blocks on no one
 * device's event (ms); and the longest a new release waits for the thread to look at it then. */
#define DLPC_CUDA_RETIRE_FALLBACK_MS 100
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

/* Register the CUDA publications' reclaim on the connection core (client.c, once). */
void dlpc__cuda_register(void);

#endif
