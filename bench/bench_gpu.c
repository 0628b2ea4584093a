/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The GPU half of the benchmarks (docs/gpu.md, "Figures"), in two processes: a publisher forked
 * at start and this one, the consumer.
 *
 * attach: a CUDA tensor of each size published by the other process, attached, read by a first
 *         kernel (a sum of its 32-bit words) and released, by legacy CUDA IPC (cuMemAlloc
 *         memory) and by VMM (dlpc_alloc memory); beside the floor, the driver's own import of
 *         the same memory (cuIpcOpenMemHandle; cuMemImportFromShareableHandle + reserve + map +
 *         set access), then the same kernel read and release.
 * dict:   a state dict of N tensors from the publisher (the "trainer") to this process (the
 *         "inference" one): the time from the start of the publish until this process has
 *         every tensor and a first kernel has read one, bucketed (dlpc_alloc_bundle, one
 *         storage, dlpc_publish_bundle) against one publish per tensor (cuMemAlloc tensors, as
 *         a trainer's are); beside one tensor of the same bytes published and attached alike,
 *         and a device-to-device copy of those bytes tensor by tensor in one process.
 *
 * Usage: bench_gpu --socket PATH [--sizes SIZE,...] [--reps N] [--dict-tensors N]
 *                  [--dict-bytes SIZE] [--dict-reps N] [--only attach|dict]
 * SIZE is bytes with an optional K, M or G suffix (powers of 1024). The driver is
 * $DLPC_CUDA_LIBRARY, else libcuda.so.1: the library libdlpc loads. Without a driver or a
 * device it exits 77 saying why. Prints one JSON object per line (bench/run_gpu.py reads them);
 * progress goes to stderr. Every kernel read is checked against what the publisher wrote (each
 * rep's sum, and after each dict rep every tensor's): a wrong mapping fails the run (exit 1)
 * rather than only slowing it.
 */
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <dlpc/dlpc.h>

#include "cuda_api.h"

#define MAX_SIZES 16
#define MAX_REPS 1000
#define SUM_THREADS 256 /* threads per block of either kernel */
#define SUM_BLOCKS 4096 /* the most blocks: each thread strides over the rest */

/*
 * The two kernels, in PTX: dlpc_fill_u32(p, n, seed) writes p[i] = i * 2654435761 + seed;
 * dlpc_sum_u32(p, n, out) adds the sum of p[0..n) to the 64-bit *out (each warp adds its
 * threads' sums with shuffles, then one atomic add per warp). Both stride over the grid.
 * tests/fake_cuda runs the same two on the host.
 */
static const char ptx[] =
	".version 7.0\n"
	".target sm_52\n"
	".address_size 64\n"
	"\n"
	".visible .entry dlpc_fill_u32(.param .u64 p, .param .u64 n, .param .u32 seed)\n"
	"{\n"
	"	.reg .pred %q;\n"
	"	.reg .b32 %r<8>;\n"
	"	.reg .b64 %d<8>;\n"
	"	ld.param.u64 %d1, [p];\n"
	"	ld.param.u64 %d2, [n];\n"
	"	ld.param.u32 %r1, [seed];\n"
	"	cvta.to.global.u64 %d1, %d1;\n"
	"	mov.u32 %r2, %ctaid.x;\n"
	"	mov.u32 %r3, %ntid.x;\n"
	"	mov.u32 %r4, %tid.x;\n"
	"	mov.u32 %r5, %nctaid.x;\n"
	"	cvt.u64.u32 %d3, %r4;\n"
	"	mad.wide.u32 %d3, %r2, %r3, %d3;\n"
	"	mul.wide.u32 %d4, %r5, %r3;\n"
	"FILL:\n"
	"	setp.ge.u64 %q, %d3, %d2;\n"
	"	@%q bra FILL_END;\n"
	"	cvt.u32.u64 %r6, %d3;\n"
	"	mad.lo.u32 %r6, %r6, -1640531535, %r1;\n"
	"	shl.b64 %d5, %d3, 2;\n"
	"	add.u64 %d5, %d1, %d5;\n"
	"	st.global.u32 [%d5], %r6;\n"
	"	add.u64 %d3, %d3, %d4;\n"
	"	bra FILL;\n"
	"FILL_END:\n"
	"	ret;\n"
	"}\n"
	"\n"
	".visible .entry dlpc_sum_u32(.param .u64 p, .param .u64 n, .param .u64 out)\n"
	"{\n"
	"	.reg .pred %q;\n"
	"	.reg .b32 %r<12>;\n"
	"	.reg .b64 %d<12>;\n"
	"	ld.param.u64 %d1, [p];\n"
	"	ld.param.u64 %d2, [n];\n"
	"	ld.param.u64 %d9, [out];\n"
	"	cvta.to.global.u64 %d1, %d1;\n"
	"	cvta.to.global.u64 %d9, %d9;\n"
	"	mov.u32 %r2, %ctaid.x;\n"
	"	mov.u32 %r3, %ntid.x;\n"
	"	mov.u32 %r4, %tid.x;\n"
	"	mov.u32 %r5, %nctaid.x;\n"
	"	cvt.u64.u32 %d3, %r4;\n"
	"	mad.wide.u32 %d3, %r2, %r3, %d3;\n"
	"	mul.wide.u32 %d4, %r5, %r3;\n"
	"	mov.u64 %d6, 0;\n"
	"SUM:\n"
	"	setp.ge.u64 %q, %d3, %d2;\n"
	"	@%q bra SUM_END;\n"
	"	shl.b64 %d5, %d3, 2;\n"
	"	add.u64 %d5, %d1, %d5;\n"
	"	ld.global.u32 %r6, [%d5];\n"
	"	cvt.u64.u32 %d7, %r6;\n"
	"	add.u64 %d6, %d6, %d7;\n"
	"	add.u64 %d3, %d3, %d4;\n"
	"	bra SUM;\n"
	"SUM_END:\n"
	"	mov.u32 %r7, 16;\n"
	"SHFL:\n"
	"	mov.b64 {%r8, %r9}, %d6;\n"
	"	shfl.sync.down.b32 %r10, %r8, %r7, 31, -1;\n"
	"	shfl.sync.down.b32 %r11, %r9, %r7, 31, -1;\n"
	"	mov.b64 %d7, {%r10, %r11};\n"
	"	add.u64 %d6, %d6, %d7;\n"
	"	shr.u32 %r7, %r7, 1;\n"
	"	setp.ne.u32 %q, %r7, 0;\n"
	"	@%q bra SHFL;\n"
	"	and.b32 %r6, %r4, 31;\n"
	"	setp.ne.u32 %q, %r6, 0;\n"
	"	@%q bra DONE;\n"
	"	atom.global.add.u64 %d8, [%d9], %d6;\n"
	"DONE:\n"
	"	ret;\n"
	"}\n";

#define STR(x) #x
#define XSTR(x) STR(x)
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

static struct {
#define DECLARE(f) __typeof__(f) *f;
	CU_FUNCS(DECLARE)
#undef DECLARE
} cu;

static const char *sock_path;
static const char *only;
static size_t sizes[MAX_SIZES];
static int nsizes, reps = 20, dict_n = 500, dict_reps = 5;
static size_t dict_bytes = (size_t)4 << 30;
static CUcontext ctx;
static CUfunction k_fill, k_sum;
static CUstream stream;
static int chan = -1; /* the socket between the two processes */

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

static void die(const char *what)
{
	fprintf(stderr, "bench_gpu: %s: %s (%s)\n", what, strerror(errno), dlpc_last_error());
	exit(1);
}

static void ck_(CUresult r, const char *call)
{
	const char *s = NULL;

	if (r == CUDA_SUCCESS)
		return;
	if (cu.cuGetErrorString)
		cu.cuGetErrorString(r, &s);
	fprintf(stderr, "bench_gpu: %s: CUDA error %d (%s)\n", call, (int)r, s ? s : "?");
	exit(1);
}
#define CK(call) ck_((call), #call)

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return (x > y) - (x < y);
}

/* A row of @p n samples in ns; every kernel read behind it was checked. */
static void row(const char *group, const char *impl, long long size, uint64_t *ns, int n,
		const char *extra)
{
	qsort(ns, (size_t)n, sizeof(*ns), cmp_u64);
	printf("{\"group\": \"%s\", \"impl\": \"%s\", \"size\": %lld, \"median_us\": %.3f, "
	       "\"p99_us\": %.3f, \"reps\": %d, \"checked\": true%s}\n",
	       group, impl, size, ns[n / 2] / 1e3, ns[((size_t)n * 99 + 98) / 100 - 1] / 1e3, n,
	       extra ? extra : "");
	fflush(stdout);
}

static bool wanted(const char *name)
{
	return !only || strstr(only, name);
}

/* ---- the driver, the context and the kernels ---- */

/* Load the driver (without starting it: the publisher is forked after); 77 without one. */
static void *driver_open(void)
{
	const char *path = getenv(DLPC_CUDA_LIBRARY_ENV);
	const char *lib = path && *path ? path : DLPC_CUDA_LIBRARY_DEFAULT;
	void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);

	if (!h) {
		fprintf(stderr, "bench_gpu: skipped: no CUDA driver (%s: %s)\n", lib, dlerror());
		exit(77);
	}
#define RESOLVE(f)                                                                                 \
	cu.f = (__typeof__(cu.f))dlsym(h, XSTR(f));                                                \
	if (!cu.f) {                                                                               \
		fprintf(stderr, "bench_gpu: the CUDA driver %s lacks %s\n", lib, XSTR(f));         \
		exit(1);                                                                           \
	}
	CU_FUNCS(RESOLVE)
#undef RESOLVE
	return h;
}

/* Start the driver in this process: device 0's primary context, a stream, the kernels. */
static void driver_start(void)
{
	CUmodule mod;
	CUdevice dev;
	CUresult r = cu.cuInit(0);

	if (r == CUDA_ERROR_NO_DEVICE) {
		fprintf(stderr, "bench_gpu: skipped: no CUDA device (cuInit: %d)\n", (int)r);
		exit(77);
	}
	CK(r);
	CK(cu.cuDeviceGet(&dev, 0));
	CK(cu.cuDevicePrimaryCtxRetain(&ctx, dev));
	CK(cu.cuCtxPushCurrent(ctx));
	CK(cu.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
	CK(cu.cuModuleLoadData(&mod, ptx));
	CK(cu.cuModuleGetFunction(&k_fill, mod, "dlpc_fill_u32"));
	CK(cu.cuModuleGetFunction(&k_sum, mod, "dlpc_sum_u32"));
}

static unsigned blocks_for(uint64_t n)
{
	uint64_t b = (n + SUM_THREADS - 1) / SUM_THREADS;

	return b == 0 ? 1 : b > SUM_BLOCKS ? SUM_BLOCKS : (unsigned)b;
}

/* Queue dlpc_fill_u32 or dlpc_sum_u32 over the @p n words at @p p on the stream. */
static void launch(CUfunction f, CUdeviceptr p, uint64_t n, void *third)
{
	void *args[] = {&p, &n, third};

	CK(cu.cuLaunchKernel(f, blocks_for(n), 1, 1, SUM_THREADS, 1, 1, 0, stream, args, NULL));
}

static void fill(CUdeviceptr p, uint64_t n, uint32_t seed)
{
	launch(k_fill, p, n, &seed);
}

static void sum(CUdeviceptr p, uint64_t n, CUdeviceptr out)
{
	launch(k_sum, p, n, &out);
}

/* What dlpc_sum_u32 gives for what dlpc_fill_u32 wrote. */
static uint64_t expected(uint64_t n, uint32_t seed)
{
	uint64_t s = 0;

	for (uint64_t i = 0; i < n; i++)
		s += (uint32_t)((uint32_t)i * 2654435761u + seed);
	return s;
}

/* ---- the channel between the two processes ---- */

static void send_msg(const struct msg *m, int fd)
{
	char cbuf[CMSG_SPACE(sizeof(int))] = {0};
	struct iovec iov = {(void *)m, sizeof(*m)};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};

	if (fd >= 0) {
		struct cmsghdr *cm;

		mh.msg_control = cbuf;
		mh.msg_controllen = sizeof(cbuf);
		cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	}
	if (sendmsg(chan, &mh, 0) != (ssize_t)sizeof(*m))
		die("sendmsg");
}

/* The next message; its fd (or -1) in *@p fd if not NULL. Exits when the peer is gone. */
static void recv_msg(struct msg *m, int *fd)
{
	char cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec iov = {m, sizeof(*m)};
	struct msghdr mh = {.msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = cbuf,
			    .msg_controllen = sizeof(cbuf)};
	struct cmsghdr *cm;
	ssize_t n = recvmsg(chan, &mh, MSG_CMSG_CLOEXEC);

	if (n == 0)
		exit(1);
	if (n != (ssize_t)sizeof(*m))
		die("recvmsg");
	if (fd)
		*fd = -1;
	cm = CMSG_FIRSTHDR(&mh);
	if (cm && cm->cmsg_type == SCM_RIGHTS && fd)
		memcpy(fd, CMSG_DATA(cm), sizeof(int));
}

/* ---- the publisher ---- */

/* A cuMemAlloc tensor of the publisher's: its deleter frees the memory. */
struct owned {
	DLManagedTensorVersioned m;
	int64_t shape[1];
	CUdeviceptr d;
};

static void owned_free(DLManagedTensorVersioned *t)
{
	struct owned *o = t->manager_ctx;

	CK(cu.cuCtxPushCurrent(ctx));
	CK(cu.cuMemFree(o->d));
	CK(cu.cuCtxPopCurrent(NULL));
	free(o);
}

/* A cuMemAlloc tensor of @p size bytes filled with @p seed's words. */
static DLManagedTensorVersioned *owned_new(size_t size, uint32_t seed)
{
	struct owned *o = calloc(1, sizeof(*o));

	if (!o)
		die("calloc");
	CK(cu.cuMemAlloc(&o->d, size));
	fill(o->d, size / 4, seed);
	o->shape[0] = (int64_t)(size / 4);
	o->m = (DLManagedTensorVersioned){.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION},
					  .manager_ctx = o,
					  .deleter = owned_free,
					  .dl_tensor = {.data = (void *)(uintptr_t)o->d,
							.device = {kDLCUDA, 0},
							.ndim = 1,
							.dtype = {kDLUInt, 32, 1},
							.shape = o->shape}};
	return &o->m;
}

static CUdeviceptr data_of(const DLManagedTensorVersioned *t)
{
	return (CUdeviceptr)(uintptr_t)t->dl_tensor.data + t->dl_tensor.byte_offset;
}

/* OP_ATTACH: one tensor of each kind, published, and the floor's handles on their memory. */
static void serve_attach(dlpc_client *c, const struct msg *req)
{
	int64_t shape[1] = {(int64_t)(req->size / 4)};
	struct msg m = {.op = OP_READY};
	DLManagedTensorVersioned *legacy = owned_new(req->size, req->seed), *vmm;
	CUmemGenericAllocationHandle h;
	CUdeviceptr base;
	int fd;

	if (dlpc_alloc(c, (DLDevice){kDLCUDA, 0}, (DLDataType){kDLUInt, 32, 1}, 1, shape, &vmm) < 0)
		die("dlpc_alloc");
	fill(data_of(vmm), req->size / 4, req->seed);
	CK(cu.cuStreamSynchronize(stream));
	CK(cu.cuIpcGetMemHandle(&m.ipc, data_of(legacy)));
	CK(cu.cuMemGetAddressRange(&base, &m.vsize, data_of(vmm)));
	m.offset = data_of(vmm) - base;
	CK(cu.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)base));
	CK(cu.cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	CK(cu.cuMemRelease(h));
	if (dlpc_publish(c, "bench/gpu/legacy", legacy, DLPC_PUBLISH_REPLACE) < 0)
		die("dlpc_publish (legacy)");
	if (dlpc_publish(c, "bench/gpu/vmm", vmm, DLPC_PUBLISH_REPLACE) < 0)
		die("dlpc_publish (vmm)");
	m.first = expected(req->size / 4, req->seed);
	send_msg(&m, fd);
	close(fd);
}

/* The dict ops: @p req->count tensors made, filled and synchronized, then published (timed
 * from here) bucketed, one by one, or (OP_SINGLE) as one tensor of all their bytes. */
static void serve_dict(dlpc_client *c, const struct msg *req)
{
	uint32_t n = req->op == OP_SINGLE ? 1 : req->count;
	uint64_t words = req->op == OP_SINGLE ? req->size * req->count / 4 : req->size / 4;
	DLManagedTensorVersioned **ts = calloc(n, sizeof(*ts));
	struct msg m = {.op = OP_READY};
	char name[64];

	if (!ts)
		die("calloc");
	if (req->op == OP_PER_TENSOR) {
		for (uint32_t i = 0; i < n; i++)
			ts[i] = owned_new(words * 4, req->seed + i);
	} else {
		DLDataType *dt = calloc(n, sizeof(*dt));
		int32_t *nd = calloc(n, sizeof(*nd));
		const int64_t **sh = calloc(n, sizeof(*sh));
		int64_t shape[1] = {(int64_t)words};

		if (!dt || !nd || !sh)
			die("calloc");
		for (uint32_t i = 0; i < n; i++) {
			dt[i] = (DLDataType){kDLUInt, 32, 1};
			nd[i] = 1;
			sh[i] = shape;
		}
		if (dlpc_alloc_bundle(c, (DLDevice){kDLCUDA, 0}, n, dt, nd, sh, ts) < 0)
			die("dlpc_alloc_bundle");
		for (uint32_t i = 0; i < n; i++)
			fill(data_of(ts[i]), words, req->seed + i);
		free(dt);
		free(nd);
		free(sh);
	}
	CK(cu.cuStreamSynchronize(stream));
	for (uint32_t i = 0; i < n; i++)
		m.all += expected(words, req->seed + i);
	m.first = expected(words, req->seed);
	m.t0_ns = now_ns();
	if (req->op == OP_BUNDLE) {
		char(*keys)[16] = calloc(n, sizeof(*keys));
		const char **kp = calloc(n, sizeof(*kp));

		if (!keys || !kp)
			die("calloc");
		for (uint32_t i = 0; i < n; i++) {
			snprintf(keys[i], sizeof(keys[i]), "w%05u", i);
			kp[i] = keys[i];
		}
		if (dlpc_publish_bundle(c, "bench/gpu/dict", n, kp, ts, DLPC_PUBLISH_REPLACE) < 0)
			die("dlpc_publish_bundle");
		free(keys);
		free(kp);
	} else if (req->op == OP_SINGLE) {
		if (dlpc_publish(c, "bench/gpu/dict", ts[0], DLPC_PUBLISH_REPLACE) < 0)
			die("dlpc_publish");
	} else {
		for (uint32_t i = 0; i < n; i++) {
			snprintf(name, sizeof(name), "bench/gpu/dict/%05u", i);
			if (dlpc_publish(c, name, ts[i], DLPC_PUBLISH_REPLACE) < 0)
				die("dlpc_publish");
		}
	}
	send_msg(&m, -1);
	free(ts);
}

/* The publisher's loop: each request served, OP_DONE unpublishes what the last one made. */
static void publisher(void)
{
	dlpc_client *c;
	struct msg req, last = {0};
	char name[64];

	driver_start();
	if (dlpc_connect_flags(sock_path, DLPC_CONNECT_NO_CACHE, &c) < 0)
		die("dlpc_connect");
	for (;;) {
		recv_msg(&req, NULL);
		switch (req.op) {
		case OP_ATTACH:
			serve_attach(c, &req);
			break;
		case OP_BUNDLE:
		case OP_PER_TENSOR:
		case OP_SINGLE:
			serve_dict(c, &req);
			break;
		case OP_DONE:
			if (last.op == OP_ATTACH) {
				dlpc_unpublish(c, "bench/gpu/legacy");
				dlpc_unpublish(c, "bench/gpu/vmm");
			} else if (last.op == OP_PER_TENSOR) {
				for (uint32_t i = 0; i < last.count; i++) {
					snprintf(name, sizeof(name), "bench/gpu/dict/%05u", i);
					dlpc_unpublish(c, name);
				}
			} else {
				dlpc_unpublish(c, "bench/gpu/dict");
			}
			send_msg(&req, -1); /* the consumer goes on once it is gone */
			break;
		default:
			dlpc_close(c);
			exit(0);
		}
		if (req.op != OP_DONE)
			last = req;
	}
}

/* ---- the consumer ---- */

static dlpc_client *client;
static CUdeviceptr outs; /* one 64-bit sum per rep */

static void request(enum op op, uint64_t size, uint32_t count, uint32_t seed, struct msg *ans,
		    int *fd)
{
	struct msg m = {.op = op, .size = size, .count = count, .seed = seed};

	send_msg(&m, -1);
	recv_msg(ans, fd);
}

static void done(void)
{
	struct msg m;

	request(OP_DONE, 0, 0, 0, &m, NULL);
}

/* Zero the first @p n sums. */
static void outs_clear(int n)
{
	static const uint64_t zeros[MAX_REPS + 2];

	CK(cu.cuMemcpyHtoD(outs, zeros, sizeof(uint64_t) * (size_t)n));
}

/* Every one of the first @p n sums is @p want, or the run fails naming @p what. */
static void outs_check(int n, uint64_t want, const char *what, size_t size)
{
	static uint64_t got[MAX_REPS + 2];

	CK(cu.cuMemcpyDtoH(got, outs, sizeof(uint64_t) * (size_t)n));
	for (int i = 0; i < n; i++)
		if (got[i] != want) {
			fprintf(stderr,
				"bench_gpu: %s of %zu bytes: the kernel read sum %llu, the "
				"publisher "
				"wrote %llu (a wrong mapping)\n",
				what, size, (unsigned long long)got[i], (unsigned long long)want);
			exit(1);
		}
}

static const dlpc_attach_opts *opts(void)
{
	static dlpc_attach_opts o = {.size = sizeof(o)};

	o.stream = stream;
	return &o;
}

enum attach_kind { FLOOR_LEGACY, DLPC_LEGACY, FLOOR_VMM, DLPC_VMM };
static const char *const attach_impls[] = {"floor_legacy", "dlpc_legacy", "floor_vmm", "dlpc_vmm"};

/* One attach + first kernel read (into sum slot @p slot) + release of @p kind. */
static void attach_once(enum attach_kind kind, const struct msg *ready, int fd, size_t size,
			int slot)
{
	CUdeviceptr out = outs + sizeof(uint64_t) * (size_t)slot, d;
	CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0},
			       CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	CUmemGenericAllocationHandle h;
	DLManagedTensorVersioned *t;

	switch (kind) {
	case FLOOR_LEGACY:
		CK(cu.cuIpcOpenMemHandle(&d, ready->ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
		sum(d, size / 4, out);
		CK(cu.cuStreamSynchronize(stream));
		CK(cu.cuIpcCloseMemHandle(d));
		break;
	case FLOOR_VMM:
		CK(cu.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
						     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
		CK(cu.cuMemAddressReserve(&d, ready->vsize, 0, 0, 0));
		CK(cu.cuMemMap(d, ready->vsize, 0, h, 0));
		CK(cu.cuMemSetAccess(d, ready->vsize, &acc, 1));
		sum(d + ready->offset, size / 4, out);
		CK(cu.cuStreamSynchronize(stream));
		CK(cu.cuMemUnmap(d, ready->vsize));
		CK(cu.cuMemAddressFree(d, ready->vsize));
		CK(cu.cuMemRelease(h));
		break;
	default:
		if (dlpc_attach(client, kind == DLPC_LEGACY ? "bench/gpu/legacy" : "bench/gpu/vmm",
				opts(), &t) < 0)
			die("dlpc_attach");
		sum(data_of(t), size / 4, out);
		CK(cu.cuStreamSynchronize(stream));
		t->deleter(t);
	}
}

/* Per size: each kind in a block of its own (the floor's open of the legacy memory never
 * meets libdlpc's), two warm-up reps first, every sum checked. */
static void bench_attach(void)
{
	uint64_t *ns = calloc((size_t)reps, sizeof(*ns));
	struct msg ready;
	int fd;

	if (!ns)
		die("calloc");
	for (int i = 0; i < nsizes; i++) {
		request(OP_ATTACH, sizes[i], 0, 0x5eed0000u + (uint32_t)i, &ready, &fd);
		fprintf(stderr, "gpu attach %zu bytes x %d\n", sizes[i], reps);
		for (int k = FLOOR_LEGACY; k <= DLPC_VMM; k++) {
			outs_clear(reps + 2);
			for (int r = -2; r < reps; r++) {
				uint64_t t0 = now_ns();

				attach_once((enum attach_kind)k, &ready, fd, sizes[i], r + 2);
				if (r >= 0)
					ns[r] = now_ns() - t0;
			}
			outs_check(reps + 2, ready.first, attach_impls[k], sizes[i]);
			row("gpu_attach", attach_impls[k], (long long)sizes[i], ns, reps, NULL);
		}
		close(fd);
		done();
	}
	free(ns);
}

/* One dict rep of @p op: the time from the publisher's start until a first kernel has read
 * the first tensor here (every tensor attached), then every tensor checked and released. */
static uint64_t dict_once(enum op op, size_t each, uint32_t seed)
{
	uint32_t n = op == OP_SINGLE ? 1 : (uint32_t)dict_n;
	DLManagedTensorVersioned **ts = calloc((size_t)dict_n, sizeof(*ts));
	dlpc_bundle *b = NULL;
	struct msg ready;
	uint64_t t1, got;
	char name[64];

	if (!ts)
		die("calloc");
	outs_clear(2);
	request(op, each, (uint32_t)dict_n, seed, &ready, NULL);
	if (op == OP_BUNDLE) {
		if (dlpc_attach_bundle(client, "bench/gpu/dict", opts(), &b) < 0)
			die("dlpc_attach_bundle");
		for (uint32_t i = 0; i < n; i++)
			ts[i] = dlpc_bundle_take(b, i);
	} else if (op == OP_SINGLE) {
		if (dlpc_attach(client, "bench/gpu/dict", opts(), &ts[0]) < 0)
			die("dlpc_attach");
	} else {
		for (uint32_t i = 0; i < n; i++) {
			snprintf(name, sizeof(name), "bench/gpu/dict/%05u", i);
			if (dlpc_attach(client, name, opts(), &ts[i]) < 0)
				die("dlpc_attach");
		}
	}
	sum(data_of(ts[0]), ts[0]->dl_tensor.shape[0], outs);
	CK(cu.cuStreamSynchronize(stream));
	t1 = now_ns();
	outs_check(1, ready.first, "dict: the first tensor", each);
	for (uint32_t i = 0; i < n; i++)
		sum(data_of(ts[i]), ts[i]->dl_tensor.shape[0], outs + sizeof(uint64_t));
	CK(cu.cuStreamSynchronize(stream));
	CK(cu.cuMemcpyDtoH(&got, outs + sizeof(uint64_t), sizeof(got)));
	if (got != ready.all) {
		fprintf(stderr,
			"bench_gpu: dict (op %d): the tensors sum to %llu, the publisher "
			"wrote %llu (a wrong mapping)\n",
			(int)op, (unsigned long long)got, (unsigned long long)ready.all);
		exit(1);
	}
	for (uint32_t i = 0; i < n; i++)
		ts[i]->deleter(ts[i]);
	dlpc_bundle_free(b);
	free(ts);
	done();
	return t1 - ready.t0_ns;
}

/* The same bytes copied device to device, tensor by tensor, in this process; checked. */
static void dict_copy(size_t each, uint64_t *ns)
{
	size_t total = each * (size_t)dict_n;
	CUdeviceptr src, dst;
	uint64_t got;

	CK(cu.cuMemAlloc(&src, total));
	CK(cu.cuMemAlloc(&dst, total));
	fill(src, total / 4, 7);
	CK(cu.cuStreamSynchronize(stream));
	for (int r = -1; r < dict_reps; r++) {
		uint64_t t0 = now_ns();

		for (int i = 0; i < dict_n; i++)
			CK(cu.cuMemcpyDtoD(dst + each * (size_t)i, src + each * (size_t)i, each));
		CK(cu.cuCtxSynchronize());
		if (r >= 0)
			ns[r] = now_ns() - t0;
	}
	outs_clear(1);
	sum(dst, total / 4, outs);
	CK(cu.cuStreamSynchronize(stream));
	CK(cu.cuMemcpyDtoH(&got, outs, sizeof(got)));
	if (got != expected(total / 4, 7)) {
		fprintf(stderr, "bench_gpu: dict copy: wrong bytes copied\n");
		exit(1);
	}
	CK(cu.cuMemFree(src));
	CK(cu.cuMemFree(dst));
}

static void bench_dict(void)
{
	static const struct {
		enum op op;
		const char *impl;
	} kinds[] = {{OP_BUNDLE, "bundle"}, {OP_PER_TENSOR, "per_tensor"}, {OP_SINGLE, "single"}};
	size_t each = dict_bytes / (size_t)dict_n / 256 * 256; /* the bundle's 256-byte steps */
	uint64_t *ns = calloc((size_t)dict_reps, sizeof(*ns));
	char extra[96];

	if (!ns || each == 0)
		die("dict: --dict-bytes / --dict-tensors is under 256 bytes");
	snprintf(extra, sizeof(extra), ", \"tensors\": %d, \"tensor_bytes\": %zu", dict_n, each);
	for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
		fprintf(stderr, "gpu dict %s: %d x %zu bytes x %d\n", kinds[k].impl, dict_n, each,
			dict_reps);
		for (int r = -1; r < dict_reps; r++) {
			uint64_t t = dict_once(kinds[k].op, each, 0xd1c70000u + (uint32_t)r);

			if (r >= 0)
				ns[r] = t;
		}
		row("gpu_dict", kinds[k].impl, (long long)(each * (size_t)dict_n), ns, dict_reps,
		    extra);
	}
	fprintf(stderr, "gpu dict d2d_copy: %d x %zu bytes x %d\n", dict_n, each, dict_reps);
	dict_copy(each, ns);
	row("gpu_dict", "d2d_copy", (long long)(each * (size_t)dict_n), ns, dict_reps, extra);
	free(ns);
}

/* ---- main ---- */

/* SIZE: bytes with an optional K, M or G suffix. */
static size_t parse_size(const char *s)
{
	char *end;
	unsigned long long v = strtoull(s, &end, 10);

	switch (*end) {
	case 'K':
		v <<= 10;
		end++;
		break;
	case 'M':
		v <<= 20;
		end++;
		break;
	case 'G':
		v <<= 30;
		end++;
		break;
	}
	if (end == s || (*end && *end != ',') || v == 0 || v % 4) {
		fprintf(stderr, "bench_gpu: bad size %s (a multiple of 4 bytes)\n", s);
		exit(2);
	}
	return (size_t)v;
}

static void parse_sizes(const char *list)
{
	nsizes = 0;
	for (const char *p = list; p && *p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL) {
		if (nsizes == MAX_SIZES) {
			fprintf(stderr, "bench_gpu: more than %d sizes\n", MAX_SIZES);
			exit(2);
		}
		sizes[nsizes++] = parse_size(p);
	}
}

static void parse_args(int argc, char **argv)
{
	static const struct option lopts[] = {
		{"socket", required_argument, NULL, 's'},
		{"sizes", required_argument, NULL, 'z'},
		{"reps", required_argument, NULL, 'r'},
		{"dict-tensors", required_argument, NULL, 'n'},
		{"dict-bytes", required_argument, NULL, 'b'},
		{"dict-reps", required_argument, NULL, 'd'},
		{"only", required_argument, NULL, 'o'},
		{0},
	};
	int c;

	parse_sizes("4K,64K,1M,16M,256M,1G");
	while ((c = getopt_long(argc, argv, "s:z:r:n:b:d:o:", lopts, NULL)) != -1) {
		switch (c) {
		case 's':
			sock_path = optarg;
			break;
		case 'z':
			parse_sizes(optarg);
			break;
		case 'r':
			reps = atoi(optarg);
			break;
		case 'n':
			dict_n = atoi(optarg);
			break;
		case 'b':
			dict_bytes = parse_size(optarg);
			break;
		case 'd':
			dict_reps = atoi(optarg);
			break;
		case 'o':
			only = optarg;
			break;
		default:
			fprintf(stderr,
				"usage: bench_gpu --socket PATH [--sizes SIZE,...] [--reps N] "
				"[--dict-tensors N] [--dict-bytes SIZE] [--dict-reps N] "
				"[--only attach|dict]\n");
			exit(2);
		}
	}
	if (!sock_path || reps < 1 || reps > MAX_REPS || dict_n < 1 || dict_n > DLPC_BUNDLE_MAX ||
	    dict_reps < 1 || dict_reps > MAX_REPS) {
		fprintf(stderr,
			"bench_gpu: --socket is required; --reps and --dict-reps are 1..%d, "
			"--dict-tensors 1..%d\n",
			MAX_REPS, DLPC_BUNDLE_MAX);
		exit(2);
	}
}

int main(int argc, char **argv)
{
	int sv[2], status;
	struct msg quit = {.op = OP_QUIT};
	pid_t pub;

	parse_args(argc, argv);
	signal(SIGPIPE, SIG_IGN);
	driver_open();
	/* the publisher is forked before either process starts the driver */
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
		die("socketpair");
	pub = fork();
	if (pub < 0)
		die("fork");
	if (pub == 0) {
		close(sv[0]);
		chan = sv[1];
		publisher();
	}
	close(sv[1]);
	chan = sv[0];
	driver_start();
	if (dlpc_connect_flags(sock_path, DLPC_CONNECT_NO_CACHE, &client) < 0)
		die("dlpc_connect");
	CK(cu.cuMemAlloc(&outs, sizeof(uint64_t) * (MAX_REPS + 2)));
	if (wanted("attach"))
		bench_attach();
	if (wanted("dict"))
		bench_dict();
	send_msg(&quit, -1);
	if (waitpid(pub, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		fprintf(stderr, "bench_gpu: the publisher failed (status %d)\n", status);
		return 1;
	}
	CK(cu.cuMemFree(outs));
	dlpc_close(client);
	return 0;
}
