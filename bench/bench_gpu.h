/* SPDX-License-Identifier: Apache-2.0 */
/* bench_gpu's two processes share this (bench_gpu.c: the consumer and main; bench_gpu_publisher.c;
 * bench_gpu_cuda.c: the driver, the kernels and the channel between the two). */
#ifndef DLPC_BENCH_GPU_H
#define DLPC_BENCH_GPU_H

#include <stdbool.h>
#include <stdint.h>

#include <dlpc/dlpc.h>

#include "cuda_api.h"

/* The driver's entry points this program calls (versioned names through cuda_api.h's macros). */
#define CU_FUNCS(X)                                                                                \
	X(cuInit)                                                                                  \
	X(cuGetErrorString)                                                                        \
	X(cuDeviceGet)                                                                             \
	X(cuDevicePrimaryCtxRetain)                                                                \
	X(cuCtxPushCurrent)                                                                        \
	X(cuCtxPopCurrent)                                                                         \
	X(cuCtxSynchronize)                                                                        \
	X(cuMemAlloc)                                                                              \
	X(cuMemFree)                                                                               \
	X(cuMemcpyHtoD)                                                                            \
	X(cuMemcpyDtoH)                                                                            \
	X(cuMemcpyDtoD)                                                                            \
	X(cuMemGetAddressRange)                                                                    \
	X(cuStreamCreate)                                                                          \
	X(cuStreamSynchronize)                                                                     \
	X(cuModuleLoadData)                                                                        \
	X(cuModuleGetFunction)                                                                     \
	X(cuLaunchKernel)                                                                          \
	X(cuIpcGetMemHandle)                                                                       \
	X(cuIpcOpenMemHandle)                                                                      \
	X(cuIpcCloseMemHandle)                                                                     \
	X(cuMemRetainAllocationHandle)                                                             \
	X(cuMemExportToShareableHandle)                                                            \
	X(cuMemImportFromShareableHandle)                                                          \
	X(cuMemAddressReserve)                                                                     \
	X(cuMemAddressFree)                                                                        \
	X(cuMemMap)                                                                                \
	X(cuMemUnmap)                                                                              \
	X(cuMemSetAccess)                                                                          \
	X(cuMemRelease)

/* the driver's entry points, resolved by gpu_driver_open() */
extern struct gpu_cu {
#define DECLARE(f) __typeof__(f) *f;
	CU_FUNCS(DECLARE)
#undef DECLARE
} cu;

extern CUcontext gpu_ctx;   /* device 0's primary context, current on the main thread */
extern CUstream gpu_stream; /* this process's stream (non-blocking): every kernel runs there */
extern int gpu_chan;	    /* the socket between the two processes */

/* The consumer's requests and the publisher's answers. */
enum op { OP_ATTACH, OP_BUNDLE, OP_PER_TENSOR, OP_SINGLE, OP_DONE, OP_QUIT, OP_READY };

struct msg {
	enum op op;
	uint32_t seed;
	uint64_t size;	    /* OP_ATTACH: the tensor's bytes; dict ops: each tensor's */
	uint32_t count;	    /* dict ops: how many tensors */
	uint64_t first;	    /* OP_READY: the sum of the (first) tensor's words */
	uint64_t all;	    /* and of every tensor's */
	uint64_t t0_ns;	    /* dict ops: when the publish began (CLOCK_MONOTONIC) */
	uint64_t offset;    /* OP_ATTACH: the VMM tensor's offset in its allocation */
	uint64_t vsize;	    /* and the allocation's size */
	CUipcMemHandle ipc; /* OP_ATTACH: the legacy tensor's memory (the floor's) */
};

/* Exit 1 saying @p what failed, with errno and libdlpc's last error. */
void gpu_die(const char *what) __attribute__((noreturn));
/* Exit 1 unless @p r is CUDA_SUCCESS, naming the @p call. */
void gpu_ck(CUresult r, const char *call);
#define CK(call) gpu_ck((call), #call)
uint64_t gpu_now_ns(void);

/* Load the driver (not started: the publisher is forked after); exit 77 without one. */
void gpu_driver_open(void);
/* Start the driver in this process: device 0's primary context, gpu_stream, the kernels; exit 77
 * without a device. */
void gpu_driver_start(void);
/* Queue the kernels over the @p n 32-bit words at @p p on gpu_stream: write them from @p seed,
 * or add their sum to the 64-bit word at @p out. */
void gpu_fill(CUdeviceptr p, uint64_t n, uint32_t seed);
void gpu_sum(CUdeviceptr p, uint64_t n, CUdeviceptr out);
/* What gpu_sum() gives for what gpu_fill() wrote. */
uint64_t gpu_expected(uint64_t n, uint32_t seed);
CUdeviceptr gpu_data_of(const DLManagedTensorVersioned *t);
/* The kernels' PTX. */
extern const char gpu_ptx[];

/* The channel: a message with an fd (-1: none); the next one, its fd in *@p fd if not NULL
 * (exit when the other process is gone). */
void gpu_send(const struct msg *m, int fd);
void gpu_recv(struct msg *m, int *fd);

/* The publisher's process: serves the consumer's requests until OP_QUIT. */
void gpu_publisher(const char *sock_path) __attribute__((noreturn));

#endif
