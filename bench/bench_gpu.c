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
 *        bench_gpu --ptx    (prints the kernels' PTX: the ctest bench_gpu_ptx assembles it)
 * SIZE is bytes with an optional K, M or G suffix (powers of 1024). The driver is
 * $DLPC_CUDA_LIBRARY, else libcuda.so.1: the library libdlpc loads. Without a driver or a
 * device it exits 77 saying why. Prints one JSON object per line (bench/run_gpu.py reads them);
 * progress goes to stderr. Every kernel read is checked against what the publisher wrote (each
 * rep's sum, and after each dict rep every tensor's): a wrong mapping fails the run (exit 1)
 * rather than only slowing it.
 */
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_gpu.h"

#define MAX_SIZES 16
#define MAX_REPS 1000

static const char *sock_path;
static const char *only;
static size_t sizes[MAX_SIZES];
static int nsizes, reps = 20, dict_n = 500, dict_reps = 5;
static size_t dict_bytes = (size_t)4 << 30;

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

/* ---- the consumer ---- */

static dlpc_client *client;
static CUdeviceptr outs; /* one 64-bit sum per rep */

static void request(enum op op, uint64_t size, uint32_t count, uint32_t seed, struct msg *ans,
		    int *fd)
{
	struct msg m = {.op = op, .size = size, .count = count, .seed = seed};

	gpu_send(&m, -1);
	gpu_recv(ans, fd);
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
	/* a copy from pageable memory may still be under way when it returns, on the legacy
	 * stream, which gpu_stream (non-blocking) does not follow */
	CK(cu.cuCtxSynchronize());
}

/* A kernel read @p got where the publisher wrote @p want: the run fails, naming @p what. */
static void wrong(const char *what, size_t size, uint64_t got, uint64_t want)
{
	fprintf(stderr, "bench_gpu: %s (%zu bytes): the kernel read sum %llu, ", what, size,
		(unsigned long long)got);
	fprintf(stderr, "the publisher wrote %llu (a wrong mapping)\n", (unsigned long long)want);
	exit(1);
}

/* Every one of the first @p n sums is @p want, or the run fails naming @p what. */
static void outs_check(int n, uint64_t want, const char *what, size_t size)
{
	static uint64_t got[MAX_REPS + 2];

	CK(cu.cuMemcpyDtoH(got, outs, sizeof(uint64_t) * (size_t)n));
	for (int i = 0; i < n; i++)
		if (got[i] != want)
			wrong(what, size, got[i], want);
}

static const dlpc_attach_opts *opts(void)
{
	static dlpc_attach_opts o = {.size = sizeof(o)};

	o.stream = gpu_stream;
	return &o;
}

enum attach_kind { FLOOR_LEGACY, DLPC_LEGACY, FLOOR_VMM, DLPC_VMM };
/* How long libdlpc may take to let go of a mapping after its deleter (it waits for the
 * consumer's work on the GPU, then closes it; DLPC_CUDA_RETIRE_FALLBACK_MS is 100). */
#define RELEASE_WAIT_MS 2000
static const char *const attach_impls[] = {"floor_legacy", "dlpc_legacy", "floor_vmm", "dlpc_vmm"};

/* One attach + first kernel read (into sum slot @p slot) + release of @p kind (libdlpc's
 * deleter only queues the release: see wait_released()). */
static void attach_once(enum attach_kind kind, const struct msg *ready, int fd, size_t size,
			int slot)
{
	CUdeviceptr out = outs + sizeof(uint64_t) * (size_t)slot, d;
	CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READ};
	CUmemGenericAllocationHandle h;
	DLManagedTensorVersioned *t;

	switch (kind) {
	case FLOOR_LEGACY:
		CK(cu.cuIpcOpenMemHandle(&d, ready->ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
		gpu_sum(d, size / 4, out);
		CK(cu.cuStreamSynchronize(gpu_stream));
		CK(cu.cuIpcCloseMemHandle(d));
		break;
	case FLOOR_VMM:
		CK(cu.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
						     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
		CK(cu.cuMemAddressReserve(&d, ready->vsize, 0, 0, 0));
		CK(cu.cuMemMap(d, ready->vsize, 0, h, 0));
		CK(cu.cuMemSetAccess(d, ready->vsize, &acc, 1));
		gpu_sum(d + ready->offset, size / 4, out);
		CK(cu.cuStreamSynchronize(gpu_stream));
		CK(cu.cuMemUnmap(d, ready->vsize));
		CK(cu.cuMemAddressFree(d, ready->vsize));
		CK(cu.cuMemRelease(h));
		break;
	default:
		if (dlpc_attach(client, kind == DLPC_LEGACY ? "bench/gpu/legacy" : "bench/gpu/vmm",
				opts(), &t) < 0)
			gpu_die("dlpc_attach");
		d = gpu_data_of(t);
		gpu_sum(d, size / 4, out);
		CK(cu.cuStreamSynchronize(gpu_stream));
		t->deleter(t);
	}
}

/* The daemon's count of live attach references (this process is the only attacher). */
static uint64_t references(void)
{
	dlpc_stats st = {.size = sizeof(st)};

	if (dlpc_stat(client, &st) < 0)
		gpu_die("dlpc_stat");
	return st.references;
}

/*
 * Wait (untimed) until libdlpc has let go of what its deleter handed to a thread of its own:
 * an attach while the mapping is still open would reuse it (the library keeps one import per
 * handle) where the floor opens the memory every time. The library closes the mapping before
 * it sends the RELEASE, so the daemon's references back at @p before say it is closed. (The
 * driver's own answer is no test: on an H200 with driver 580, cuMemGetAddressRange still
 * found a closed legacy IPC mapping's range.)
 */
static void wait_released(uint64_t before)
{
	for (int i = 0; i < RELEASE_WAIT_MS * 10; i++) {
		if (references() <= before)
			return;
		usleep(100);
	}
	fprintf(stderr,
		"bench_gpu: libdlpc has not released its attach %d ms after its deleter ran\n",
		RELEASE_WAIT_MS);
	exit(1);
}

/* Per size: each kind in a block of its own (the floor's open of the legacy memory never
 * meets libdlpc's), two warm-up reps first, every sum checked. */
static void bench_attach(void)
{
	uint64_t *ns = calloc((size_t)reps, sizeof(*ns));
	struct msg ready;
	int fd;

	if (!ns)
		gpu_die("calloc");
	for (int i = 0; i < nsizes; i++) {
		request(OP_ATTACH, sizes[i], 0, 0x5eed0000u + (uint32_t)i, &ready, &fd);
		fprintf(stderr, "gpu attach %zu bytes x %d\n", sizes[i], reps);
		for (int k = FLOOR_LEGACY; k <= DLPC_VMM; k++) {
			outs_clear(reps + 2);
			for (int r = -2; r < reps; r++) {
				bool ours = k == DLPC_LEGACY || k == DLPC_VMM;
				uint64_t before = ours ? references() : 0, t0 = gpu_now_ns();

				attach_once((enum attach_kind)k, &ready, fd, sizes[i], r + 2);
				if (r >= 0)
					ns[r] = gpu_now_ns() - t0;
				if (ours)
					wait_released(before);
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
		gpu_die("calloc");
	outs_clear(2);
	request(op, each, (uint32_t)dict_n, seed, &ready, NULL);
	if (op == OP_BUNDLE) {
		if (dlpc_attach_bundle(client, "bench/gpu/dict", opts(), &b) < 0)
			gpu_die("dlpc_attach_bundle");
		for (uint32_t i = 0; i < n; i++)
			ts[i] = dlpc_bundle_take(b, i);
	} else if (op == OP_SINGLE) {
		if (dlpc_attach(client, "bench/gpu/dict", opts(), &ts[0]) < 0)
			gpu_die("dlpc_attach");
	} else {
		for (uint32_t i = 0; i < n; i++) {
			snprintf(name, sizeof(name), "bench/gpu/dict/%05u", i);
			if (dlpc_attach(client, name, opts(), &ts[i]) < 0)
				gpu_die("dlpc_attach");
		}
	}
	gpu_sum(gpu_data_of(ts[0]), ts[0]->dl_tensor.shape[0], outs);
	CK(cu.cuStreamSynchronize(gpu_stream));
	t1 = gpu_now_ns();
	outs_check(1, ready.first, "dict: the first tensor", each);
	for (uint32_t i = 0; i < n; i++)
		gpu_sum(gpu_data_of(ts[i]), ts[i]->dl_tensor.shape[0], outs + sizeof(uint64_t));
	CK(cu.cuStreamSynchronize(gpu_stream));
	CK(cu.cuMemcpyDtoH(&got, outs + sizeof(uint64_t), sizeof(got)));
	if (got != ready.all)
		wrong("dict: every tensor", each * n, got, ready.all);
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
	gpu_fill(src, total / 4, 7);
	CK(cu.cuStreamSynchronize(gpu_stream));
	for (int r = -1; r < dict_reps; r++) {
		uint64_t t0 = gpu_now_ns();

		for (int i = 0; i < dict_n; i++)
			CK(cu.cuMemcpyDtoD(dst + each * (size_t)i, src + each * (size_t)i, each));
		CK(cu.cuCtxSynchronize());
		if (r >= 0)
			ns[r] = gpu_now_ns() - t0;
	}
	outs_clear(1);
	gpu_sum(dst, total / 4, outs);
	CK(cu.cuStreamSynchronize(gpu_stream));
	CK(cu.cuMemcpyDtoH(&got, outs, sizeof(got)));
	if (got != gpu_expected(total / 4, 7))
		wrong("dict: the copy", total, got, gpu_expected(total / 4, 7));
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
		gpu_die("dict: --dict-bytes / --dict-tensors is under 256 bytes");
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
		{"ptx", no_argument, NULL, 'p'}, /* print the kernels' PTX and exit */
		{0},
	};
	int c;

	parse_sizes("4K,64K,1M,16M,256M,1G");
	while ((c = getopt_long(argc, argv, "s:z:r:n:b:d:o:p", lopts, NULL)) != -1) {
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
		case 'p':
			fputs(gpu_ptx, stdout);
			exit(0);
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
	gpu_driver_open();
	/* the publisher is forked before either process starts the driver */
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
		gpu_die("socketpair");
	pub = fork();
	if (pub < 0)
		gpu_die("fork");
	if (pub == 0) {
		close(sv[0]);
		gpu_chan = sv[1];
		gpu_publisher(sock_path);
	}
	close(sv[1]);
	gpu_chan = sv[0];
	gpu_driver_start();
	if (dlpc_connect_flags(sock_path, DLPC_CONNECT_NO_CACHE, &client) < 0)
		gpu_die("dlpc_connect");
	CK(cu.cuMemAlloc(&outs, sizeof(uint64_t) * (MAX_REPS + 2)));
	if (wanted("attach"))
		bench_attach();
	if (wanted("dict"))
		bench_dict();
	gpu_send(&quit, -1);
	if (waitpid(pub, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
		fprintf(stderr, "bench_gpu: the publisher failed (status %d)\n", status);
		return 1;
	}
	CK(cu.cuMemFree(outs));
	dlpc_close(client);
	return 0;
}
