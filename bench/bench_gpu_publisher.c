/* SPDX-License-Identifier: Apache-2.0 */
/* bench_gpu's publisher (the "trainer"): the tensors the consumer asks for, made, filled by a
 * kernel, synchronized and published, each request answered with what the consumer checks
 * against (bench_gpu.h). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "bench_gpu.h"

/* A cuMemAlloc tensor of the publisher's: its deleter frees the memory. */
struct owned {
	DLManagedTensorVersioned m;
	int64_t shape[1];
	CUdeviceptr d;
};

static void owned_free(DLManagedTensorVersioned *t)
{
	struct owned *o = t->manager_ctx;

	CK(cu.cuCtxPushCurrent(gpu_ctx));
	CK(cu.cuMemFree(o->d));
	CK(cu.cuCtxPopCurrent(NULL));
	free(o);
}

/* A cuMemAlloc tensor of @p size bytes filled with @p seed's words. */
static DLManagedTensorVersioned *owned_new(size_t size, uint32_t seed)
{
	struct owned *o = calloc(1, sizeof(*o));

	if (!o)
		gpu_die("calloc");
	CK(cu.cuMemAlloc(&o->d, size));
	gpu_fill(o->d, size / 4, seed);
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
		gpu_die("dlpc_alloc");
	gpu_fill(gpu_data_of(vmm), req->size / 4, req->seed);
	CK(cu.cuStreamSynchronize(gpu_stream));
	CK(cu.cuIpcGetMemHandle(&m.ipc, gpu_data_of(legacy)));
	CK(cu.cuMemGetAddressRange(&base, &m.vsize, gpu_data_of(vmm)));
	m.offset = gpu_data_of(vmm) - base;
	CK(cu.cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)base));
	CK(cu.cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
	CK(cu.cuMemRelease(h));
	if (dlpc_publish(c, "bench/gpu/legacy", legacy, DLPC_PUBLISH_REPLACE) < 0)
		gpu_die("dlpc_publish (legacy)");
	if (dlpc_publish(c, "bench/gpu/vmm", vmm, DLPC_PUBLISH_REPLACE) < 0)
		gpu_die("dlpc_publish (vmm)");
	m.first = gpu_expected(req->size / 4, req->seed);
	gpu_send(&m, fd);
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
		gpu_die("calloc");
	if (req->op == OP_PER_TENSOR) {
		for (uint32_t i = 0; i < n; i++)
			ts[i] = owned_new(words * 4, req->seed + i);
	} else {
		DLDataType *dt = calloc(n, sizeof(*dt));
		int32_t *nd = calloc(n, sizeof(*nd));
		const int64_t **sh = calloc(n, sizeof(*sh));
		int64_t shape[1] = {(int64_t)words};

		if (!dt || !nd || !sh)
			gpu_die("calloc");
		for (uint32_t i = 0; i < n; i++) {
			dt[i] = (DLDataType){kDLUInt, 32, 1};
			nd[i] = 1;
			sh[i] = shape;
		}
		if (dlpc_alloc_bundle(c, (DLDevice){kDLCUDA, 0}, n, dt, nd, sh, ts) < 0)
			gpu_die("dlpc_alloc_bundle");
		for (uint32_t i = 0; i < n; i++)
			gpu_fill(gpu_data_of(ts[i]), words, req->seed + i);
		free(dt);
		free(nd);
		free(sh);
	}
	CK(cu.cuStreamSynchronize(gpu_stream));
	for (uint32_t i = 0; i < n; i++)
		m.all += gpu_expected(words, req->seed + i);
	m.first = gpu_expected(words, req->seed);
	m.t0_ns = gpu_now_ns();
	if (req->op == OP_BUNDLE) {
		char(*keys)[16] = calloc(n, sizeof(*keys));
		const char **kp = calloc(n, sizeof(*kp));

		if (!keys || !kp)
			gpu_die("calloc");
		for (uint32_t i = 0; i < n; i++) {
			snprintf(keys[i], sizeof(keys[i]), "w%05u", i);
			kp[i] = keys[i];
		}
		if (dlpc_publish_bundle(c, "bench/gpu/dict", n, kp, ts, DLPC_PUBLISH_REPLACE) < 0)
			gpu_die("dlpc_publish_bundle");
		free(keys);
		free(kp);
	} else if (req->op == OP_SINGLE) {
		if (dlpc_publish(c, "bench/gpu/dict", ts[0], DLPC_PUBLISH_REPLACE) < 0)
			gpu_die("dlpc_publish");
	} else {
		for (uint32_t i = 0; i < n; i++) {
			snprintf(name, sizeof(name), "bench/gpu/dict/%05u", i);
			if (dlpc_publish(c, name, ts[i], DLPC_PUBLISH_REPLACE) < 0)
				gpu_die("dlpc_publish");
		}
	}
	gpu_send(&m, -1);
	free(ts);
}

/* The publisher's loop: each request served, OP_DONE unpublishes what the last one made. */
void gpu_publisher(const char *sock_path)
{
	dlpc_client *c;
	struct msg req, last = {0};
	char name[64];

	gpu_driver_start();
	if (dlpc_connect_flags(sock_path, DLPC_CONNECT_NO_CACHE, &c) < 0)
		gpu_die("dlpc_connect");
	for (;;) {
		gpu_recv(&req, NULL);
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
			gpu_send(&req, -1); /* the consumer goes on once it is gone */
			break;
		default:
			dlpc_close(c);
			exit(0);
		}
		if (req.op != OP_DONE)
			last = req;
	}
}
