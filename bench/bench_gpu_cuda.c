/* SPDX-License-Identifier: Apache-2.0 */
/* bench_gpu: the CUDA driver, loaded at run time, its two kernels, and the channel between the
 * two processes (bench_gpu.h). */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bench_gpu.h"

#define STR(x) #x
#define XSTR(x) STR(x)
#define SUM_THREADS 256 /* threads per block of either kernel */
#define SUM_BLOCKS 4096 /* the most blocks: each thread strides over the rest */

struct gpu_cu cu;
CUcontext gpu_ctx;
CUstream gpu_stream;
int gpu_chan = -1;
static CUfunction k_fill, k_sum;

/*
 * The two kernels, in PTX: dlpc_fill_u32(p, n, seed) writes p[i] = i * 2654435761 + seed;
 * dlpc_sum_u32(p, n, out) adds the sum of p[0..n) to the 64-bit *out (each warp adds its
 * threads' sums with shuffles, then one atomic add per warp). Both stride over the grid.
 * tests/fake_cuda runs the same two on the host.
 */
/* Both kernels' start: %d3 this thread's first index, %d4 the grid's stride (%r4 its tid.x). */
#define PTX_GRID_STRIDE                                                                            \
	"	mov.u32 %r2, %ctaid.x;\n"                                                                \
	"	mov.u32 %r3, %ntid.x;\n"                                                                 \
	"	mov.u32 %r4, %tid.x;\n"                                                                  \
	"	mov.u32 %r5, %nctaid.x;\n"                                                               \
	"	cvt.u64.u32 %d3, %r4;\n"                                                                 \
	"	mad.wide.u32 %d3, %r2, %r3, %d3;\n"                                                      \
	"	mul.wide.u32 %d4, %r5, %r3;\n"

/* clang-format off */
const char gpu_ptx[] =
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
	PTX_GRID_STRIDE
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
	PTX_GRID_STRIDE
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
/* clang-format on */

void gpu_die(const char *what)
{
	fprintf(stderr, "bench_gpu: %s: %s (%s)\n", what, strerror(errno), dlpc_last_error());
	exit(1);
}

void gpu_ck(CUresult r, const char *call)
{
	const char *s = NULL;

	if (r == CUDA_SUCCESS)
		return;
	if (cu.cuGetErrorString)
		cu.cuGetErrorString(r, &s);
	fprintf(stderr, "bench_gpu: %s: CUDA error %d (%s)\n", call, (int)r, s ? s : "?");
	exit(1);
}

uint64_t gpu_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- the driver, the context and the kernels ---- */

/* Load the driver (without starting it: the publisher is forked after); 77 without one. */
void gpu_driver_open(void)
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
}

/* Start the driver in this process: device 0's primary context, a gpu_stream, the kernels. */
void gpu_driver_start(void)
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
	CK(cu.cuDevicePrimaryCtxRetain(&gpu_ctx, dev));
	CK(cu.cuCtxPushCurrent(gpu_ctx));
	CK(cu.cuStreamCreate(&gpu_stream, CU_STREAM_NON_BLOCKING));
	CK(cu.cuModuleLoadData(&mod, gpu_ptx));
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

	CK(cu.cuLaunchKernel(f, blocks_for(n), 1, 1, SUM_THREADS, 1, 1, 0, gpu_stream, args, NULL));
}

void gpu_fill(CUdeviceptr p, uint64_t n, uint32_t seed)
{
	launch(k_fill, p, n, &seed);
}

void gpu_sum(CUdeviceptr p, uint64_t n, CUdeviceptr out)
{
	launch(k_sum, p, n, &out);
}

/* What dlpc_sum_u32 gives for what dlpc_fill_u32 wrote. */
uint64_t gpu_expected(uint64_t n, uint32_t seed)
{
	uint64_t s = 0;

	for (uint64_t i = 0; i < n; i++)
		s += (uint32_t)((uint32_t)i * 2654435761u + seed);
	return s;
}

/* ---- the channel between the two processes ---- */

void gpu_send(const struct msg *m, int fd)
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
	if (sendmsg(gpu_chan, &mh, 0) != (ssize_t)sizeof(*m))
		gpu_die("sendmsg");
}

/* The next message; its fd (or -1) in *@p fd if not NULL. Exits when the peer is gone. */
void gpu_recv(struct msg *m, int *fd)
{
	char cbuf[CMSG_SPACE(sizeof(int))];
	struct iovec iov = {m, sizeof(*m)};
	struct msghdr mh = {.msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = cbuf,
			    .msg_controllen = sizeof(cbuf)};
	struct cmsghdr *cm;
	ssize_t n = recvmsg(gpu_chan, &mh, MSG_CMSG_CLOEXEC);

	if (n == 0)
		exit(1);
	if (n != (ssize_t)sizeof(*m))
		gpu_die("recvmsg");
	if (fd)
		*fd = -1;
	cm = CMSG_FIRSTHDR(&mh);
	if (cm && cm->cmsg_type == SCM_RIGHTS && fd)
		memcpy(fd, CMSG_DATA(cm), sizeof(int));
}

CUdeviceptr gpu_data_of(const DLManagedTensorVersioned *t)
{
	return (CUdeviceptr)(uintptr_t)t->dl_tensor.data + t->dl_tensor.byte_offset;
}
