/* SPDX-License-Identifier: Apache-2.0 */
/*
 * GPU tensors against a real dlpackd, across real processes, with the fake CUDA driver
 * (tests/fake_cuda) standing in for libcuda.so.1: legacy IPC publish and attach, the import
 * cache, reclaim notices, VMM storage, stream ordering, and the errors without a driver.
 *
 * Under the fake driver a device pointer is a host address, so the tests fill and read "device"
 * memory directly; the driver calls that matter are read back from the fake's log
 * ($FAKE_CUDA_LOG: one "<pid> <function> <details>" line per call).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <unistd.h>
#include <dirent.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include "cuda_api.h"
#include "gpu.h"
#include "harness.h"
#include "limits.h"
#include "raw.h"

static struct daemon D;
static char logpath[192];

static void setup(void)
{
	daemon_start(&D);
	snprintf(logpath, sizeof(logpath), "%s/fake_cuda.log", D.dir);
	setenv("FAKE_CUDA_LOG", logpath, 1);
	setenv(DLPC_CUDA_LIBRARY_ENV, FAKE_CUDA_LIB, 1);
}

static void teardown(void)
{
	unlink(logpath);
	daemon_stop(&D);
}

/* Lines of the fake driver's log written by @p pid (any if 0) that contain @p text and, if not
 * NULL, @p also. */
static int log_count2(pid_t pid, const char *text, const char *also)
{
	FILE *f = fopen(logpath, "re");
	char line[512], prefix[24];
	int n = 0;

	snprintf(prefix, sizeof(prefix), "%d ", (int)pid);
	while (f && fgets(line, sizeof(line), f))
		if ((pid == 0 || strncmp(line, prefix, strlen(prefix)) == 0) &&
		    strstr(line, text) && (!also || strstr(line, also)))
			n++;
	if (f)
		fclose(f);
	return n;
}

static int log_count(pid_t pid, const char *text)
{
	return log_count2(pid, text, NULL);
}

/* Wait (at most 10 s) until @p pid's log holds @p n lines with @p text: an attached tensor's
 * mapping goes, and its release, on libdlpc's retiring thread once the deleter has returned. */
static bool log_reaches(pid_t pid, const char *text, int n)
{
	for (int i = 0; i < 1000 && log_count(pid, text) < n; i++)
		usleep(10000);
	return log_count(pid, text) == n;
}

/* Wait (at most 10 s) until @p pid's log holds a line with @p text. */
static bool log_appears(pid_t pid, const char *text)
{
	for (int i = 0; i < 1000 && log_count(pid, text) == 0; i++)
		usleep(10000);
	return log_count(pid, text) > 0;
}

/* The daemon's reference count, as @p c's STAT says (which also carries its queued releases). */
static uint64_t refs_now(dlpc_client *c)
{
	dlpc_stats s = {.size = sizeof(s)};

	return dlpc_stat(c, &s) == 0 ? s.references : UINT64_MAX;
}

/* Wait (at most 10 s) until the daemon holds @p n references. */
static bool refs_reach(dlpc_client *c, uint64_t n)
{
	for (int i = 0; i < 1000 && refs_now(c) != n; i++)
		usleep(10000);
	return refs_now(c) == n;
}

/* The daemon keeps @p n references for as long as 200 retiring-thread polls take. */
static bool refs_stay(dlpc_client *c, uint64_t n)
{
	for (int i = 0; i < 20; i++) {
		if (refs_now(c) != n)
			return false;
		usleep(10000);
	}
	return true;
}

/* fake_cuda's test hooks (tests/fake_cuda/README.md) */
void fake_cuda_stream_hold(CUstream s, int on);
void fake_cuda_capture(CUstream s, int on);
void fake_cuda_read_later(CUstream s, const void *src, void *dst, size_t n);
void fake_cuda_write_later(CUstream s, void *dst, const void *src, size_t n);
unsigned fake_cuda_live(void);
void fake_cuda_kernel(CUstream s, unsigned ticks);
void fake_cuda_clock_advance(unsigned ticks);
void fake_cuda_sticky_error(void);

/* ---- device tensors over fake device memory ---- */

struct devt {
	DLManagedTensorVersioned t;
	int64_t shape[1];
	int notify;	/* the deleter writes one byte here, if >= 0 */
	bool probe_ctx; /* that byte says whether a CUDA context was current: 'D' yes, 'N' no */
};

static void devt_deleter(DLManagedTensorVersioned *t)
{
	struct devt *d = (struct devt *)t;
	CUcontext ctx = NULL;

	if (d->probe_ctx && cuCtxGetCurrent(&ctx) != CUDA_SUCCESS)
		ctx = NULL;
	if (d->notify >= 0 && write(d->notify, !d->probe_ctx || ctx ? "D" : "N", 1) != 1)
		abort();
	free(d);
}

/* A float32 vector of @p n elements at @p ptr on CUDA device 0. */
static DLManagedTensorVersioned *dev_tensor(CUdeviceptr ptr, int64_t n, int notify)
{
	struct devt *d = calloc(1, sizeof(*d));

	CHILD_CHECK(d != NULL);
	d->shape[0] = n;
	d->notify = notify;
	d->t.version.major = DLPACK_MAJOR_VERSION;
	d->t.version.minor = DLPACK_MINOR_VERSION;
	d->t.deleter = devt_deleter;
	d->t.dl_tensor.data = (void *)(uintptr_t)ptr;
	d->t.dl_tensor.device = (DLDevice){kDLCUDA, 0};
	d->t.dl_tensor.ndim = 1;
	d->t.dl_tensor.dtype = (DLDataType){kDLFloat, 32, 1};
	d->t.dl_tensor.shape = d->shape;
	return &d->t;
}

static void fill(float *p, int64_t n, float base)
{
	for (int64_t i = 0; i < n; i++)
		p[i] = base + (float)i * 0.5f;
}

static bool same(const float *p, int64_t n, float base)
{
	for (int64_t i = 0; i < n; i++)
		if (p[i] != base + (float)i * 0.5f)
			return false;
	return true;
}

/* ---- a publishing process that stays until told to go ---- */

/* Where the tensors sit: two in one allocation, at offsets that are not 256-aligned. */
#define ALLOC_BYTES (1u << 20)
/* A VMM allocation of the publisher's own: one granule of the fake (and of current GPUs). */
#define VMM_BYTES (2u << 20)
#define OFF_A 1000
#define OFF_B 65540
#define NELEM 1000

struct publisher {
	const char *names[2]; /* published at OFF_A and OFF_B; [1] may be NULL */
	uint32_t flags;
	int ready[2];	  /* the child writes one byte once published */
	int quit[2];	  /* the parent writes (or closes) to let it go */
	int notify[2];	  /* each deleter writes one byte */
	bool self_attach; /* also attach names[0] in the publishing process */
	int many;	  /* if > 0: publish gpu/b/0 .. gpu/b/<many - 1> instead, all at OFF_A */
	bool vmm;	  /* the memory is a VMM mapping of the publisher's own, not cuMemAlloc's */
	pid_t pid;
};

/*
 * In a process that called cuInit: what an allocator built on the driver's VMM calls does
 * (PyTorch's expandable segments): an allocation of @p size bytes exportable as @p types,
 * mapped read-write at the start of a reservation of @p reserve bytes, its handle released
 * (the mapping keeps it).
 */
static CUdeviceptr vmm_mapping(size_t size, size_t reserve, CUmemAllocationHandleType types)
{
	CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
				    .requestedHandleTypes = types,
				    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
	CUmemAccessDesc rw = {.location = prop.location,
			      .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	CUmemGenericAllocationHandle h;
	CUdeviceptr p;

	CHILD_CHECK(cuMemCreate(&h, size, &prop, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAddressReserve(&p, reserve, 0, 0, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemMap(p, size, 0, h, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemSetAccess(p, size, &rw, 1) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemRelease(h) == CUDA_SUCCESS);
	return p;
}

/* A tensor of the publisher below: its deleter, run at reclaim, reports the current context. */
static DLManagedTensorVersioned *pub_tensor(CUdeviceptr ptr, int notify)
{
	DLManagedTensorVersioned *t = dev_tensor(ptr, NELEM, notify);

	((struct devt *)t)->probe_ctx = true;
	return t;
}

static int publisher_main(void *arg)
{
	struct publisher *p = arg;
	dlpc_client *c = NULL;
	CUdeviceptr base;
	char b;

	close(p->ready[0]);
	close(p->quit[1]);
	close(p->notify[0]);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	if (p->vmm)
		base = vmm_mapping(VMM_BYTES, VMM_BYTES, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	else
		CHILD_CHECK(cuMemAlloc(&base, ALLOC_BYTES) == CUDA_SUCCESS);
	fill((float *)(uintptr_t)(base + OFF_A), NELEM, 1.0f);
	fill((float *)(uintptr_t)(base + OFF_B), NELEM, 7.0f);
	for (int i = 0; i < p->many; i++) {
		char name[32];

		snprintf(name, sizeof(name), "gpu/b/%d", i);
		CHILD_CHECK(dlpc_publish(c, name, pub_tensor(base + OFF_A, p->notify[1]),
					 p->flags) == 1);
	}
	if (!p->many)
		CHILD_CHECK(dlpc_publish(c, p->names[0], pub_tensor(base + OFF_A, p->notify[1]),
					 p->flags) == 1);
	if (p->names[1])
		CHILD_CHECK(dlpc_publish(c, p->names[1], pub_tensor(base + OFF_B, p->notify[1]),
					 p->flags) == 1);
	if (p->self_attach) {
		DLManagedTensorVersioned *t = NULL;

		/* the publisher's own allocation: its own pointer, nothing opened */
		CHILD_CHECK(dlpc_attach(c, p->names[0], NULL, &t) == 1);
		CHILD_CHECK(t->dl_tensor.data == (void *)(uintptr_t)(base + OFF_A));
		CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA);
		CHILD_CHECK(same(t->dl_tensor.data, NELEM, 1.0f));
		CHILD_CHECK(log_count(getpid(), "cuIpcOpenMemHandle") == 0);
		t->deleter(t);
	}
	dlpc_close(c);
	CHILD_CHECK(write(p->ready[1], "R", 1) == 1);
	/* idle: no libdlpc call from here on; reclaim notices are the library's business */
	if (read(p->quit[0], &b, 1) < 0)
		return 1;
	return 0;
}

static void publisher_start(struct publisher *p)
{
	char b;

	ck_assert_int_eq(pipe2(p->ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(p->quit, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(p->notify, O_CLOEXEC), 0);
	p->pid = spawn(publisher_main, p);
	close(p->ready[1]);
	close(p->quit[0]);
	close(p->notify[1]);
	ck_assert_msg(read(p->ready[0], &b, 1) == 1, "the publisher failed before publishing");
}

static void publisher_stop(struct publisher *p)
{
	ck_assert_int_eq(write(p->quit[1], "Q", 1), 1);
	ck_assert_int_eq(wait_child(p->pid), 0);
	close(p->ready[0]);
	close(p->quit[1]);
	close(p->notify[0]);
}

/* Did a deleter of @p p run within @p ms? */
static bool deleter_ran(const struct publisher *p, int ms)
{
	struct pollfd pfd = {.fd = p->notify[0], .events = POLLIN};
	char b;

	if (poll(&pfd, 1, ms) != 1)
		return false;
	return read(p->notify[0], &b, 1) == 1 && b == 'D';
}

/* ---- attaching processes ---- */

struct attacher {
	const char *name;
	float base;	   /* expected content */
	bool with_stream;  /* pass a stream in dlpc_attach_opts */
	bool defer;	   /* attach with DLPC_ATTACH_DEFER_SYNC, then dlpc_tensor_wait() */
	void *stream_seen; /* set by the child (its own copy): the stream it passed */
};

static int attacher_main(void *arg)
{
	struct attacher *a = arg;
	dlpc_attach_opts o = {.size = sizeof(o)};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	CUstream s = NULL;
	char want[96];

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	if (a->with_stream) {
		CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
		CHILD_CHECK(cuStreamCreate(&s, 0) == CUDA_SUCCESS);
		o.stream = s;
	}
	if (a->defer) {
		o.flags = DLPC_ATTACH_DEFER_SYNC;
		CHILD_CHECK(dlpc_attach(c, a->name, &o, &t) == 1);
		/* nothing waited yet; then each wait as asked, as often as asked */
		CHILD_CHECK(log_count(getpid(), "cuStreamWaitEvent") == 0);
		CHILD_CHECK(log_count(getpid(), "cuEventSynchronize") == 0);
		CHILD_CHECK(dlpc_tensor_wait(t, (void *)0x2) == 0);
		CHILD_CHECK(log_count(getpid(), "cuStreamWaitEvent stream=0x2 ") == 1);
		CHILD_CHECK(dlpc_tensor_wait(t, NULL) == 0);
		CHILD_CHECK(log_count(getpid(), "cuEventSynchronize") == 1);
		/* two orderings, one on the host: the release comes after an event on the legacy
		 * stream, which follows every blocking stream */
		t->deleter(t);
		CHILD_CHECK(log_count2(getpid(), "cuEventRecord", "stream=0x1") == 1);
		CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
		CHILD_CHECK(log_count(getpid(), "cuCtxSynchronize") == 0);
		dlpc_close(c);
		return 0;
	}
	CHILD_CHECK(dlpc_attach(c, a->name, &o, &t) == 1);
	CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA);
	CHILD_CHECK(t->dl_tensor.device.device_id == 0);
	CHILD_CHECK(t->dl_tensor.ndim == 1 && t->dl_tensor.shape[0] == NELEM);
	CHILD_CHECK(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, a->base));
	if (a->with_stream) {
		snprintf(want, sizeof(want), "cuStreamWaitEvent stream=%p ", (void *)s);
		CHILD_CHECK(log_count(getpid(), want) == 1);
		CHILD_CHECK(log_count(getpid(), "cuEventSynchronize") == 0);
	} else {
		CHILD_CHECK(log_count(getpid(), "cuEventSynchronize") == 1);
		CHILD_CHECK(log_count(getpid(), "cuStreamWaitEvent") == 0);
	}
	/* nothing waited for the consumer's work before its release */
	CHILD_CHECK(log_count(getpid(), "cuStreamSynchronize") == 0);
	CHILD_CHECK(log_count(getpid(), "cuCtxSynchronize") == 0);
	t->deleter(t);
	/* releasing comes after the consumer's queued work: an event recorded, in the deleter,
	 * on the legacy stream, which follows every blocking stream (s among them, which the
	 * consumer may have destroyed by now: it is never used), looked at from the library's
	 * thread. The deleter itself waits for nothing. */
	CHILD_CHECK(log_count2(getpid(), "cuEventRecord", "stream=0x1") == 1);
	if (a->with_stream) {
		snprintf(want, sizeof(want), "stream=%p", (void *)s);
		CHILD_CHECK(log_count2(getpid(), "cuEventRecord", want) == 0);
	}
	CHILD_CHECK(log_reaches(getpid(), "cuEventQuery", 1));
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	CHILD_CHECK(log_count(getpid(), "cuCtxSynchronize") == 0);
	CHILD_CHECK(log_count(getpid(), "cuStreamSynchronize") == 0);
	CHILD_CHECK(log_count(getpid(), "cuEventSynchronize") == (a->with_stream ? 0 : 1));
	dlpc_close(c);
	return 0;
}

static void attach_in_child(const char *name, float base, bool with_stream)
{
	struct attacher a = {.name = name, .base = base, .with_stream = with_stream};

	ck_assert_int_eq(wait_child(spawn(attacher_main, &a)), 0);
}

/* ---- 1. a tensor inside a larger allocation, attached by another process ---- */

START_TEST(ipc_offset_attach)
{
	struct publisher p = {.names = {"gpu/a", NULL}};

	dlpc_client *c;
	dlpc_stats st;

	publisher_start(&p);
	/* the memory stays the publisher's: no daemon fd, nothing charged to its uid's quota */
	c = connect_or_die(&D);
	st = stat_or_die(c);
	ck_assert_uint_eq(st.storages, 1);
	ck_assert_uint_eq(st.uid_bytes_held, 0);
	dlpc_close(c);
	attach_in_child("gpu/a", 1.0f, false);
	/* opened with the lazy peer access flag (CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1) */
	ck_assert_int_eq(log_count(0, "cuIpcOpenMemHandle"), 1);
	ck_assert_int_eq(log_count(0, "flags=1"), 1);
	ck_assert_int_eq(log_count(0, "cuIpcCloseMemHandle"), 1);
	publisher_stop(&p);
}
END_TEST

/* ---- 2. the import cache ---- */

static int two_attaches(void *arg)
{
	DLManagedTensorVersioned *a = NULL, *b = NULL, *a2 = NULL;
	dlpc_client *c = NULL;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/x", NULL, &a) == 1);
	CHILD_CHECK(dlpc_attach(c, "gpu/y", NULL, &b) == 1);
	CHILD_CHECK(dlpc_attach(c, "gpu/x", NULL, &a2) == 1);
	/* one allocation, opened once, the tensors where the publisher put them */
	CHILD_CHECK(log_count(getpid(), "cuIpcOpenMemHandle") == 1);
	CHILD_CHECK((uint8_t *)b->dl_tensor.data - (uint8_t *)a->dl_tensor.data == OFF_B - OFF_A);
	CHILD_CHECK(a2->dl_tensor.data == a->dl_tensor.data);
	CHILD_CHECK(same(a->dl_tensor.data, NELEM, 1.0f));
	CHILD_CHECK(same(b->dl_tensor.data, NELEM, 7.0f));
	/* closed when the last user lets go, not before (the releases follow the unmaps) */
	a->deleter(a);
	b->deleter(b);
	CHILD_CHECK(refs_reach(c, 1));
	CHILD_CHECK(log_count(getpid(), "cuIpcCloseMemHandle") == 0);
	a2->deleter(a2);
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	dlpc_close(c);
	return 0;
}

START_TEST(ipc_import_cache)
{
	struct publisher p = {.names = {"gpu/x", "gpu/y"}, .self_attach = true};

	publisher_start(&p);
	ck_assert_int_eq(wait_child(spawn(two_attaches, NULL)), 0);
	/* the publisher itself opened nothing (checked in the child too) */
	ck_assert_int_eq(log_count(p.pid, "cuIpcOpenMemHandle"), 0);
	publisher_stop(&p);
}
END_TEST

/* ---- 3. reclaim ---- */

static int attach_hold(void *arg)
{
	int *fds = arg; /* [0]: told when attached; [1]: read to let go */
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	char b;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/r", NULL, &t) == 1);
	CHILD_CHECK(write(fds[0], "A", 1) == 1);
	CHILD_CHECK(read(fds[1], &b, 1) == 1);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

START_TEST(ipc_reclaim_idle_publisher)
{
	struct publisher p = {.names = {"gpu/r", NULL}};
	int attached[2], go[2], fds[2];
	dlpc_client *c = connect_or_die(&D);
	pid_t holder;
	char b;

	publisher_start(&p);
	ck_assert_int_eq(pipe(attached), 0);
	ck_assert_int_eq(pipe(go), 0);
	fds[0] = attached[1];
	fds[1] = go[0];
	holder = spawn(attach_hold, fds);
	ck_assert_int_eq(read(attached[0], &b, 1), 1);
	/* unpublished, but still referenced: the publisher must keep the memory */
	ck_assert_dlpc(dlpc_unpublish(c, "gpu/r"), 0);
	ck_assert_msg(!deleter_ran(&p, scaled_ms(300)),
		      "the deleter ran while an attacher still held the tensor");
	/* the last release: the idle publisher's deleter runs (well inside the 1 s deadline;
	 * libdlpc's own bound is 100 ms, which this test does not time) */
	ck_assert_int_eq(write(go[1], "G", 1), 1);
	ck_assert_int_eq(wait_child(holder), 0);
	ck_assert_msg(deleter_ran(&p, scaled_ms(1000)),
		      "the publisher's deleter did not run after the last release");
	/* and its event is gone with it */
	ck_assert_int_eq(log_count(p.pid, "cuEventDestroy"), 1);
	publisher_stop(&p);
	close(attached[0]);
	close(attached[1]);
	close(go[0]);
	close(go[1]);
	dlpc_close(c);
}
END_TEST

/* The deleter below waits at this gate, which the process's main thread holds meanwhile. */
static pthread_mutex_t deleter_gate = PTHREAD_MUTEX_INITIALIZER;
static int gate_reached[2];

static void gated_deleter(DLManagedTensorVersioned *t)
{
	if (write(gate_reached[1], "G", 1) != 1)
		abort();
	pthread_mutex_lock(&deleter_gate);
	pthread_mutex_unlock(&deleter_gate);
	free(t);
}

/* A publisher whose reclaimed tensor's deleter, run on the library's thread, waits for a lock
 * its main thread holds while it closes another, idle client: the close returns, without
 * waiting for that deleter (it used to wait for the library's thread to let go of the client,
 * which it did only after the deleter: neither went on). SIGALRM ends a hang. */
static int close_while_a_deleter_waits(void *arg)
{
	dlpc_client *a, *b;
	DLManagedTensorVersioned *t;
	CUdeviceptr base;
	char x;

	(void)arg;
	signal(SIGALRM, SIG_DFL);
	alarm(10);
	CHILD_CHECK(pipe2(gate_reached, O_CLOEXEC) == 0);
	CHILD_CHECK(dlpc_connect(D.sock, &a) == 0);
	CHILD_CHECK(dlpc_connect(D.sock, &b) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&base, ALLOC_BYTES) == CUDA_SUCCESS);
	t = dev_tensor(base, NELEM, -1);
	t->deleter = gated_deleter;
	pthread_mutex_lock(&deleter_gate);
	CHILD_CHECK(dlpc_publish(a, "gpu/gated", t, 0) == 1);
	CHILD_CHECK(dlpc_unpublish(a, "gpu/gated") == 0);
	/* the deleter runs on the library's thread, and waits */
	CHILD_CHECK(read(gate_reached[0], &x, 1) == 1);
	dlpc_close(b);
	pthread_mutex_unlock(&deleter_gate);
	dlpc_close(a);
	return 0;
}

START_TEST(ipc_close_while_a_deleter_waits)
{
	int st = wait_child(spawn(close_while_a_deleter_waits, NULL));

	ck_assert_msg(st == 0, "the publisher %s",
		      st == 128 + SIGALRM ? "hung closing a client while a deleter waited"
					  : "failed");
}
END_TEST

START_TEST(ipc_reclaim_on_replace_unreferenced)
{
	struct publisher p = {.names = {"gpu/q", NULL}};
	dlpc_client *c = connect_or_die(&D);

	publisher_start(&p);
	/* no reference at all: replacing the entry frees it at once */
	ck_assert_int_gt(dlpc_publish(c, "gpu/q",
				      host_tensor((float[4]){0}, (DLDataType){kDLFloat, 32, 1}, 1,
						  (int64_t[]){4}, NULL, NULL),
				      DLPC_PUBLISH_REPLACE),
			 0);
	ck_assert_msg(deleter_ran(&p, scaled_ms(1000)),
		      "the publisher's deleter did not run after its entry was replaced");
	publisher_stop(&p);
	dlpc_close(c);
}
END_TEST

static bool no_entries(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->entries == 0;
}

START_TEST(ipc_publisher_killed)
{
	struct publisher p = {.names = {"gpu/k", NULL}};
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t = NULL;

	publisher_start(&p);
	ck_assert_int_eq(kill(p.pid, SIGKILL), 0);
	ck_assert_int_eq(wait_child(p.pid), 128 + SIGKILL);
	ck_assert(wait_stat(c, no_entries, NULL, scaled_ms(5000)));
	ck_assert_dlpc(dlpc_attach(c, "gpu/k", NULL, &t), -ENOENT);
	ck_assert_ptr_null(t);
	close(p.ready[0]);
	close(p.quit[1]);
	close(p.notify[0]);
	dlpc_close(c);
}
END_TEST

/* ---- a publisher that claims more device memory than it shared ---- */

#define LIE_BYTES 4096u /* what the lying publisher allocates */

struct liar {
	int ready[2]; /* the child writes one byte once both entries are published */
	int quit[2];  /* the parent writes (or closes) to let it go */
};

/* PUBLISH, bypassing libdlpc, @p nelem float32s at offset 0 of the legacy allocation whose
 * handles are @p mh and @p eh on the device @p uuid; 0 once published. */
static int raw_ipc_publish(int fd, const char *name, int64_t nelem, const CUuuid *uuid,
			   const CUipcMemHandle *mh, const CUipcEventHandle *eh)
{
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__CudaIpc ipc = DLPACKD__V1__CUDA_IPC__INIT;
	Dlpackd__V1__TensorDesc desc = DLPACKD__V1__TENSOR_DESC__INIT, *dp = &desc;
	int64_t shape[1] = {nelem};
	struct dlpc__hdr h;
	uint8_t buf[4096];

	desc.dtype_code = kDLFloat;
	desc.dtype_bits = 32;
	desc.dtype_lanes = 1;
	desc.n_shape = 1;
	desc.shape = shape;
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.device_type = kDLCUDA;
	req.storage_size = (uint64_t)nelem * sizeof(float);
	req.n_tensors = 1;
	req.tensors = &dp;
	req.device_uuid.data = (uint8_t *)uuid->bytes;
	req.device_uuid.len = sizeof(uuid->bytes);
	ipc.mem_handle.data = (uint8_t *)mh->reserved;
	ipc.mem_handle.len = sizeof(mh->reserved);
	ipc.event_handle.data = (uint8_t *)eh->reserved;
	ipc.event_handle.len = sizeof(eh->reserved);
	req.cuda_ipc = &ipc;
	raw_send(fd, DLPC_MSG_PUBLISH, 1, &req.base, NULL, 0);
	if (raw_recv(fd, &h, buf, sizeof(buf)) != 1)
		return -1;
	return h.type == (DLPC_MSG_PUBLISH | DLPC_MSG_REPLY) ? 0 : -1;
}

/* One allocation of LIE_BYTES (5.0f in each float), published twice over one raw connection:
 * "gpu/true" as the floats it holds, "gpu/lie" as 256 times as many (the daemon cannot tell:
 * it passes IPC handles on as given). */
static int publish_lies(void *arg)
{
	struct liar *l = arg;
	CUipcEventHandle eh;
	CUipcMemHandle mh;
	CUdeviceptr base;
	CUdevice dev;
	CUuuid uuid;
	CUevent ev;
	int fd;
	char b;

	close(l->ready[0]);
	close(l->quit[1]);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuDeviceGetUuid(&uuid, dev) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&base, LIE_BYTES) == CUDA_SUCCESS);
	fill((float *)(uintptr_t)base, LIE_BYTES / sizeof(float), 5.0f);
	CHILD_CHECK(cuIpcGetMemHandle(&mh, base) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventCreate(&ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING) ==
		    CUDA_SUCCESS);
	CHILD_CHECK(cuEventRecord(ev, NULL) == CUDA_SUCCESS);
	CHILD_CHECK(cuIpcGetEventHandle(&eh, ev) == CUDA_SUCCESS);
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	CHILD_CHECK(raw_ipc_publish(fd, "gpu/true", LIE_BYTES / sizeof(float), &uuid, &mh, &eh) ==
		    0);
	CHILD_CHECK(raw_ipc_publish(fd, "gpu/lie", 256 * LIE_BYTES / sizeof(float), &uuid, &mh,
				    &eh) == 0);
	CHILD_CHECK(write(l->ready[1], "R", 1) == 1);
	if (read(l->quit[0], &b, 1) < 0)
		return 1;
	close(fd);
	return 0;
}

static int attach_the_lie(void *arg)
{
	DLManagedTensorVersioned *t = NULL, *u = NULL;
	dlpc_client *c = NULL;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	/* refused before anything reads it, naming both sizes; the handle opened is closed */
	CHILD_CHECK(dlpc_attach(c, "gpu/lie", NULL, &t) == -EPROTO && !t);
	CHILD_CHECK(strstr(dlpc_last_error(), "'gpu/lie'") &&
		    strstr(dlpc_last_error(), "spans 1048576 bytes") &&
		    strstr(dlpc_last_error(), "has 4096"));
	CHILD_CHECK(log_count(getpid(), "cuIpcOpenMemHandle") == 1);
	CHILD_CHECK(log_count(getpid(), "cuIpcCloseMemHandle") == 1);
	/* the same allocation as what it holds attaches, once more through the import cache
	 * while held */
	CHILD_CHECK(dlpc_attach(c, "gpu/true", NULL, &t) == 1);
	CHILD_CHECK(same(t->dl_tensor.data, LIE_BYTES / sizeof(float), 5.0f));
	CHILD_CHECK(dlpc_attach(c, "gpu/lie", NULL, &u) == -EPROTO && !u);
	CHILD_CHECK(log_count(getpid(), "cuIpcOpenMemHandle") == 2);
	t->deleter(t);
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 2));
	dlpc_close(c);
	return 0;
}

START_TEST(ipc_lying_publisher)
{
	struct liar l;
	dlpc_client *c;
	pid_t pid;
	char b;

	ck_assert_int_eq(pipe2(l.ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(l.quit, O_CLOEXEC), 0);
	pid = spawn(publish_lies, &l);
	close(l.ready[1]);
	close(l.quit[0]);
	ck_assert_msg(read(l.ready[0], &b, 1) == 1, "the publisher failed before publishing");
	ck_assert_int_eq(wait_child(spawn(attach_the_lie, NULL)), 0);
	/* the refused attaches hold no reference */
	c = connect_or_die(&D);
	ck_assert(refs_reach(c, 0));
	dlpc_close(c);
	ck_assert_int_eq(write(l.quit[1], "Q", 1), 1);
	ck_assert_int_eq(wait_child(pid), 0);
	close(l.ready[0]);
	close(l.quit[1]);
}
END_TEST

/* More publications than one RECLAIM frame may name: freed in one daemon turn. Also more than
 * one process's events: some share the completed one. */
#define MANY (DLPC_RECLAIM_BATCH_MAX + 6)
_Static_assert(MANY > DLPC_CUDA_IPC_EVENTS_MAX + 1, "MANY must pass the event cap");

static int attach_many(void *arg)
{
	int *fds = arg; /* [0]: told when attached; [1]: never written (the parent kills us) */
	dlpc_client *c = NULL;
	char b;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	for (int i = 0; i < MANY; i++) {
		DLManagedTensorVersioned *t = NULL;
		char name[32];

		snprintf(name, sizeof(name), "gpu/b/%d", i);
		CHILD_CHECK(dlpc_attach(c, name, NULL, &t) == 1);
	}
	CHILD_CHECK(write(fds[0], "A", 1) == 1);
	CHILD_CHECK(read(fds[1], &b, 1) == 1);
	return 0;
}

START_TEST(reclaim_batches)
{
	struct publisher p = {.names = {"unused", NULL}, .many = MANY};
	dlpc_client *c = connect_or_die(&D);
	int attached[2], hold[2], fds[2], got = 0;
	pid_t holder;
	char b;

	publisher_start(&p);
	/* past DLPC_CUDA_IPC_EVENTS_MAX events, each publish waited on the host and shares one
	 * completed event: the driver's own limit (the fake's) is never reached */
	ck_assert_int_eq(log_count2(p.pid, "cuEventCreate", "flags=6"),
			 DLPC_CUDA_IPC_EVENTS_MAX + 1);
	ck_assert_int_eq(log_count(p.pid, "cuCtxSynchronize"), MANY - DLPC_CUDA_IPC_EVENTS_MAX);
	ck_assert_int_eq(log_count(0, "ipc-event-limit"), 0);
	ck_assert_int_eq(pipe(attached), 0);
	ck_assert_int_eq(pipe(hold), 0);
	fds[0] = attached[1];
	fds[1] = hold[0];
	holder = spawn(attach_many, fds);
	ck_assert_int_eq(read(attached[0], &b, 1), 1);
	for (int i = 0; i < MANY; i++) {
		char name[32];

		snprintf(name, sizeof(name), "gpu/b/%d", i);
		ck_assert_dlpc(dlpc_unpublish(c, name), 0);
	}
	/* the holder's death frees every storage at once: MANY notices, in two frames */
	ck_assert_int_eq(kill(holder, SIGKILL), 0);
	ck_assert_int_eq(wait_child(holder), 128 + SIGKILL);
	while (got < MANY && deleter_ran(&p, scaled_ms(5000)))
		got++;
	ck_assert_int_eq(got, MANY);
	/* every event went with the last publication using it */
	ck_assert_int_eq(log_count(p.pid, "cuEventDestroy"), DLPC_CUDA_IPC_EVENTS_MAX + 1);
	publisher_stop(&p);
	close(attached[0]);
	close(attached[1]);
	close(hold[0]);
	close(hold[1]);
	dlpc_close(c);
}
END_TEST

/* ---- 4. VMM ---- */

static int vmm_publish(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	int64_t n = NELEM;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_alloc(c, (DLDevice){kDLCUDA, 0}, (DLDataType){kDLFloat, 32, 1}, 1, &n,
			       &t) == 0);
	CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA);
	fill(t->dl_tensor.data, NELEM, 3.0f);
	CHILD_CHECK(dlpc_publish(c, "gpu/v", t, 0) == 1);
	CHILD_CHECK(log_count(getpid(), "cuMemCreate") == 1);
	CHILD_CHECK(log_count(getpid(), "cuMemExportToShareableHandle") == 1);
	dlpc_close(c);
	return 0;
}

/* Does a write to @p p kill a forked child with SIGSEGV? */
static bool write_faults(void *p)
{
	int st;
	pid_t pid = fork();

	if (pid == 0) {
		*(volatile float *)p = 1.0f;
		_exit(0);
	}
	return pid > 0 && waitpid(pid, &st, 0) == pid && WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV;
}

static int vmm_attach(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/v", NULL, &t) == 1);
	CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, 3.0f));
	/* read-only: the mapping refuses writes (the fake models device access with mprotect) */
	CHILD_CHECK(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
	CHILD_CHECK(write_faults(t->dl_tensor.data));
	CHILD_CHECK(log_count(getpid(), "cuMemImportFromShareableHandle") == 1);
	CHILD_CHECK(log_count(getpid(), "cuMemMap") == 1);
	t->deleter(t);
	CHILD_CHECK(log_reaches(getpid(), "cuMemUnmap", 1));
	dlpc_close(c);
	return 0;
}

START_TEST(vmm_outlives_publisher)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_entry_info *list = NULL;
	size_t n = 0;

	ck_assert_int_eq(wait_child(spawn(vmm_publish, NULL)), 0);
	/* the publisher has exited; the daemon holds the export fd */
	ck_assert_dlpc(dlpc_list(c, "gpu/", &list, &n), 0);
	ck_assert_uint_eq(n, 1);
	ck_assert_int_eq(list[0].device.device_type, kDLCUDA);
	ck_assert_uint_eq(list[0].flags & DLPC_PUBLISH_EPHEMERAL, 0);
	dlpc_list_free(list, n);
	ck_assert_int_eq(wait_child(spawn(vmm_attach, NULL)), 0);
	dlpc_close(c);
}
END_TEST

/* ---- 5. stream ordering ---- */

START_TEST(stream_ordering)
{
	struct publisher p = {.names = {"gpu/s", NULL}};
	char rec[64];

	publisher_start(&p);
	/* the publisher recorded the event it exported */
	ck_assert_int_eq(log_count(p.pid, "cuEventRecord"), 1);
	snprintf(rec, sizeof(rec), "event=%d:", (int)p.pid);
	/* the children check their own waits: on the given stream and no host synchronization,
	 * or a synchronization of the publisher's event when no stream is given */
	attach_in_child("gpu/s", 1.0f, true);
	attach_in_child("gpu/s", 1.0f, false);
	ck_assert_int_eq(log_count2(0, "cuIpcOpenEventHandle", rec), 2);
	ck_assert_int_eq(log_count2(0, "cuStreamWaitEvent", rec), 1);
	ck_assert_int_eq(log_count2(0, "cuEventSynchronize", rec), 1);
	/* the wait put off to dlpc_tensor_wait(), as __dlpack__(stream=...) needs it */
	{
		struct attacher a = {.name = "gpu/s", .base = 1.0f, .defer = true};

		ck_assert_int_eq(wait_child(spawn(attacher_main, &a)), 0);
	}
	publisher_stop(&p);
}
END_TEST

/* ---- 6. without a driver ---- */

static int no_driver(void *arg)
{
	static float host[16];
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	int64_t n = 16;
	int fds[2];
	char b;

	(void)arg;
	setenv(DLPC_CUDA_LIBRARY_ENV, "/nonexistent/libcuda.so.1", 1);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	/* host work is unaffected */
	CHILD_CHECK(
		dlpc_publish(c, "host/h",
			     host_tensor(host, (DLDataType){kDLFloat, 32, 1}, 1, &n, NULL, NULL),
			     0) == 1);
	CHILD_CHECK(dlpc_attach(c, "host/h", NULL, &t) == 1);
	t->deleter(t);
	/* GPU calls fail, and say why */
	CHILD_CHECK(dlpc_alloc(c, (DLDevice){kDLCUDA, 0}, (DLDataType){kDLFloat, 32, 1}, 1, &n,
			       &t) == -ENODEV);
	CHILD_CHECK(strstr(dlpc_last_error(), "CUDA driver (/nonexistent/libcuda.so.1) not found"));
	CHILD_CHECK(pipe(fds) == 0);
	CHILD_CHECK(dlpc_publish(c, "gpu/none", dev_tensor((uintptr_t)host, 16, fds[1]), 0) ==
		    -ENODEV);
	CHILD_CHECK(strstr(dlpc_last_error(), "not found"));
	/* the tensor was given back: its deleter ran once */
	CHILD_CHECK(read(fds[0], &b, 1) == 1);
	/* an entry published through the fake driver cannot be attached here */
	CHILD_CHECK(dlpc_attach(c, "gpu/n", NULL, &t) == -ENODEV);
	CHILD_CHECK(strstr(dlpc_last_error(), "not found"));
	dlpc_close(c);
	return 0;
}

static bool no_refs(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->references == 0;
}

START_TEST(no_driver_errors)
{
	struct publisher p = {.names = {"gpu/n", NULL}};
	dlpc_client *c = connect_or_die(&D);

	publisher_start(&p);
	ck_assert_int_eq(wait_child(spawn(no_driver, NULL)), 0);
	/* the failed attach gave its reference back */
	ck_assert(wait_stat(c, no_refs, NULL, scaled_ms(5000)));
	publisher_stop(&p);
	dlpc_close(c);
}
END_TEST

static int bad_devices(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	int64_t n = 4;

	(void)arg;
	/* a device the driver does not have, and one past what libdlpc handles at all */
	CHILD_CHECK(dlpc_alloc(NULL, (DLDevice){kDLCUDA, 1}, (DLDataType){kDLFloat, 32, 1}, 1, &n,
			       &t) == -ENODEV);
	CHILD_CHECK(strstr(dlpc_last_error(), "cuDeviceGet"));
	CHILD_CHECK(dlpc_alloc(NULL, (DLDevice){kDLCUDA, DLPC_CUDA_DEVICES_MAX},
			       (DLDataType){kDLFloat, 32, 1}, 1, &n, &t) == -ENODEV);
	CHILD_CHECK(strstr(dlpc_last_error(), "out of range"));
	CHILD_CHECK(dlpc_alloc(NULL, (DLDevice){kDLCUDA, DLPC_CUDA_DEVICES_MAX - 1},
			       (DLDataType){kDLFloat, 32, 1}, 1, &n, &t) == -ENODEV);
	CHILD_CHECK(!strstr(dlpc_last_error(), "out of range"));
	CHILD_CHECK(t == NULL);
	return 0;
}

START_TEST(device_ordinals)
{
	ck_assert_int_eq(wait_child(spawn(bad_devices, NULL)), 0);
}
END_TEST

static int ipc_unsupported(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	CUdeviceptr base;
	int fds[2];
	char b;

	(void)arg;
	setenv("FAKE_CUDA_NO_IPC", "1", 1);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&base, ALLOC_BYTES) == CUDA_SUCCESS);
	CHILD_CHECK(pipe(fds) == 0);
	CHILD_CHECK(dlpc_publish(c, "gpu/u", dev_tensor(base, NELEM, fds[1]), 0) == -ENOTSUP);
	CHILD_CHECK(strstr(dlpc_last_error(), "not supported on this platform"));
	CHILD_CHECK(read(fds[0], &b, 1) == 1);
	CHILD_CHECK(dlpc_attach(c, "gpu/u", NULL, &t) == -ENOENT);
	dlpc_close(c);
	return 0;
}

START_TEST(ipc_not_supported)
{
	ck_assert_int_eq(wait_child(spawn(ipc_unsupported, NULL)), 0);
}
END_TEST

/* ---- 7. the daemon never links or loads CUDA ---- */

/* Does a file mapped by the process whose maps are @p path have @p text in its base name?
 * (Base names only: the build tree's own path may say anything.) */
static bool maps_have(const char *path, const char *text)
{
	FILE *f = fopen(path, "re");
	char line[1024];
	bool found = false;

	ck_assert_msg(f != NULL, "cannot read %s", path);
	while (!found && fgets(line, sizeof(line), f)) {
		char *base = strrchr(line, '/');

		found = base && strstr(base, text) != NULL;
	}
	fclose(f);
	return found;
}

START_TEST(daemon_without_cuda)
{
	struct publisher p = {.names = {"gpu/d", NULL}};
	char cmd[512], out[256], maps[64];
	FILE *f;
	bool needed = false;

	/* what the daemon's binary asks the dynamic linker for */
	snprintf(cmd, sizeof(cmd), "readelf -d '%s'", DLPACKD_BIN);
	f = popen(cmd, "r");
	ck_assert_ptr_nonnull(f);
	while (fgets(out, sizeof(out), f)) {
		if (!strstr(out, "(NEEDED)"))
			continue;
		needed = true;
		ck_assert_msg(!strstr(out, "cuda") && !strstr(out, "nvidia"), "dlpackd needs %s",
			      out);
	}
	ck_assert_int_eq(pclose(f), 0);
	ck_assert_msg(needed, "readelf found no NEEDED entry at all: the check saw nothing");
	/* what it has mapped after GPU entries went through it, both kinds */
	publisher_start(&p);
	attach_in_child("gpu/d", 1.0f, false);
	ck_assert_int_eq(wait_child(spawn(vmm_publish, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(vmm_attach, NULL)), 0);
	snprintf(maps, sizeof(maps), "/proc/%d/maps", (int)D.pid);
	ck_assert(maps_have(maps, "libuv"));
	ck_assert(!maps_have(maps, "cuda"));
	publisher_stop(&p);
}
END_TEST
/* ---- 14. memory of other allocators ---- */

static int attach_lent(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/lent", NULL, &t) == 1);
	CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA);
	CHILD_CHECK(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, 1.0f));
	CHILD_CHECK(log_count(getpid(), "cuMemImportFromShareableHandle") == 1);
	CHILD_CHECK(log_count(getpid(), "cuIpcOpenMemHandle") == 0);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* A VMM mapping of the publisher's own allocator: lent by its export fd, and given back (its
 * deleter run) once unpublished and released, like legacy IPC memory. */
START_TEST(vmm_lent)
{
	struct publisher p = {.names = {"gpu/lent", NULL}, .vmm = true};
	dlpc_client *c = connect_or_die(&D);
	dlpc_entry_info *list = NULL;
	size_t n = 0;

	publisher_start(&p);
	ck_assert_int_eq(log_count(p.pid, "cuMemRetainAllocationHandle"), 1);
	ck_assert_int_eq(log_count(p.pid, "cuMemExportToShareableHandle"), 1);
	ck_assert_int_eq(log_count(p.pid, "cuIpcGetMemHandle"), 0);
	/* no event of its own: the host waited for the device before publishing */
	ck_assert_int_eq(log_count(p.pid, "cuCtxSynchronize"), 1);
	ck_assert_int_eq(log_count2(p.pid, "cuEventCreate", "flags=6"), 0);
	ck_assert_dlpc(dlpc_list(c, "gpu/", &list, &n), 0);
	ck_assert_uint_eq(n, 1);
	ck_assert_int_eq(list[0].device.device_type, kDLCUDA);
	ck_assert_uint_ne(list[0].flags & DLPC_PUBLISH_EPHEMERAL, 0);
	dlpc_list_free(list, n);
	ck_assert_int_eq(wait_child(spawn(attach_lent, NULL)), 0);
	ck_assert(!deleter_ran(&p, 200));
	ck_assert_dlpc(dlpc_unpublish(c, "gpu/lent"), 0);
	ck_assert(deleter_ran(&p, scaled_ms(5000)));
	publisher_stop(&p);
	dlpc_close(c);
}
END_TEST

/* Memory neither legacy IPC nor an export fd can share: refused, naming the allocator setting,
 * the tensor's deleter run, nothing published. */
static int unexportable(void *arg)
{
	CUmemAllocationHandleType none = CU_MEM_HANDLE_TYPE_NONE;
	CUmemAllocationHandleType posix = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
				    .requestedHandleTypes = posix,
				    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0}};
	CUdeviceptr pool, plain, split;
	int64_t stride2[1] = {2};
	size_t gran = 0;
	unsigned live;
	int fds[2];
	char b;

	(void)arg;
	CHILD_CHECK(pipe(fds) == 0);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) ==
		    CUDA_SUCCESS);
	/* each refusal leaves the producer's memory as it was: libdlpc holds no import,
	 * mapping or handle reference of it afterwards (fake_cuda_live() unchanged) */
	CHILD_CHECK(cuMemAllocAsync(&pool, ALLOC_BYTES, NULL) == CUDA_SUCCESS);
	live = fake_cuda_live();
	CHILD_CHECK(dlpc_publish(c, "gpu/x", dev_tensor(pool, NELEM, fds[1]), 0) == -ENOTSUP);
	CHILD_CHECK(strstr(dlpc_last_error(), "stream-ordered pool") &&
		    strstr(dlpc_last_error(), "backend:cudaMallocAsync"));
	CHILD_CHECK(read(fds[0], &b, 1) == 1);
	CHILD_CHECK(fake_cuda_live() == live);
	plain = vmm_mapping(gran, gran, none);
	live = fake_cuda_live();
	CHILD_CHECK(dlpc_publish(c, "gpu/x", dev_tensor(plain, NELEM, fds[1]), 0) == -ENOTSUP);
	CHILD_CHECK(strstr(dlpc_last_error(), "expandable_segments"));
	CHILD_CHECK(read(fds[0], &b, 1) == 1);
	CHILD_CHECK(fake_cuda_live() == live);
	/* a tensor that runs from one mapping into the next */
	split = vmm_mapping(gran, 2 * gran, posix);
	live = fake_cuda_live();
	CHILD_CHECK(dlpc_publish(c, "gpu/x", dev_tensor(split + gran - 16, NELEM, fds[1]), 0) ==
		    -EINVAL);
	CHILD_CHECK(strstr(dlpc_last_error(), "spans several VMM mappings"));
	CHILD_CHECK(read(fds[0], &b, 1) == 1);
	CHILD_CHECK(fake_cuda_live() == live);
	/* a strided tensor of exportable memory: refused before anything is exported */
	t = dev_tensor(split, NELEM / 2, fds[1]);
	t->dl_tensor.strides = stride2;
	CHILD_CHECK(dlpc_publish(c, "gpu/x", t, 0) == -ENOTSUP);
	CHILD_CHECK(strstr(dlpc_last_error(), "strided"));
	CHILD_CHECK(read(fds[0], &b, 1) == 1);
	CHILD_CHECK(fake_cuda_live() == live);
	t = NULL;
	/* each refused tensor's deleter ran exactly once, before dlpc_publish() returned */
	CHILD_CHECK(fcntl(fds[0], F_SETFL, O_NONBLOCK) == 0);
	CHILD_CHECK(read(fds[0], &b, 1) < 0 && errno == EAGAIN);
	CHILD_CHECK(log_count(getpid(), "cuMemExportToShareableHandle") == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/x", NULL, &t) == -ENOENT);
	dlpc_close(c);
	return 0;
}

/* An empty CUDA tensor, NULL data pointer and all: published, and attached elsewhere. */
static int attach_empty(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/empty", NULL, &t) == 1);
	CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA &&
		    t->dl_tensor.device.device_id == 0);
	CHILD_CHECK(t->dl_tensor.ndim == 1 && t->dl_tensor.shape[0] == 0);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

static int publish_empty(void *arg)
{
	dlpc_client *c = NULL;
	int fds[2];
	char b;

	(void)arg;
	CHILD_CHECK(pipe(fds) == 0);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_publish(c, "gpu/empty", dev_tensor(0, 0, fds[1]), 0) == 1);
	/* nothing of the producer's to keep */
	CHILD_CHECK(read(fds[0], &b, 1) == 1);
	dlpc_close(c);
	return 0;
}

START_TEST(empty_cuda_tensor)
{
	ck_assert_int_eq(wait_child(spawn(publish_empty, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(attach_empty, NULL)), 0);
}
END_TEST

/* A state dict on the device: three tensors in two allocations, at offsets of their own,
 * published as one bundle (copied into one VMM allocation) and attached whole elsewhere. */
static const char *const bundle_keys[3] = {"layer.0.w", "layer.0.b", "layer.1.w"};

static int publish_cuda_bundle(void *arg)
{
	DLManagedTensorVersioned *ts[3], *mixed[2];
	dlpc_client *c = NULL;
	CUdeviceptr a, b;
	int fds[2];
	char x;

	(void)arg;
	CHILD_CHECK(pipe(fds) == 0);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&a, ALLOC_BYTES) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&b, ALLOC_BYTES) == CUDA_SUCCESS);
	fill((float *)(uintptr_t)(a + OFF_A), NELEM, 1.0f);
	fill((float *)(uintptr_t)(a + OFF_B), NELEM, 7.0f);
	fill((float *)(uintptr_t)(b + 4), NELEM, 9.0f);
	ts[0] = dev_tensor(a + OFF_A, NELEM, fds[1]);
	ts[1] = dev_tensor(a + OFF_B, NELEM, fds[1]);
	ts[2] = dev_tensor(b + 4, NELEM, fds[1]);
	CHILD_CHECK(dlpc_publish_bundle(c, "gpu/bundle", 3, bundle_keys, ts, 0) == 1);
	/* copied: the producers' tensors are given back at once */
	for (int i = 0; i < 3; i++)
		CHILD_CHECK(read(fds[0], &x, 1) == 1);
	CHILD_CHECK(log_count(getpid(), "cuMemcpyDtoD") == 3);
	CHILD_CHECK(log_count(getpid(), "cuMemCreate") == 1);
	CHILD_CHECK(log_count(getpid(), "cuCtxSynchronize") == 1);
	CHILD_CHECK(log_count(getpid(), "cuIpcGetMemHandle") == 0);
	/* a bundle's tensors are all on one device */
	mixed[0] = dev_tensor(a + OFF_A, NELEM, fds[1]);
	mixed[1] = host_tensor((float[4]){0}, (DLDataType){kDLFloat, 32, 1}, 1, (int64_t[1]){4},
			       NULL, NULL);
	CHILD_CHECK(dlpc_publish_bundle(c, "gpu/mixed", 2, bundle_keys, mixed, 0) == -ENOTSUP);
	CHILD_CHECK(strstr(dlpc_last_error(), "all on one device"));
	CHILD_CHECK(read(fds[0], &x, 1) == 1);
	dlpc_close(c);
	return 0;
}

/* A bucket filled in place: dlpc_alloc_bundle() on the device, published with no copy. */
static int publish_alloc_bundle(void *arg)
{
	const DLDataType f32[3] = {{kDLFloat, 32, 1}, {kDLFloat, 32, 1}, {kDLFloat, 32, 1}};
	const int32_t nd[3] = {1, 1, 1};
	const int64_t n[1] = {NELEM};
	const int64_t *const shapes[3] = {n, n, n};
	DLManagedTensorVersioned *ts[3];
	dlpc_client *c = NULL;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_alloc_bundle(c, (DLDevice){kDLCUDA, 0}, 3, f32, nd, shapes, ts) == 0);
	fill(ts[0]->dl_tensor.data, NELEM, 1.0f);
	fill(ts[1]->dl_tensor.data, NELEM, 7.0f);
	fill(ts[2]->dl_tensor.data, NELEM, 9.0f);
	CHILD_CHECK(ts[0]->dl_tensor.device.device_type == kDLCUDA);
	CHILD_CHECK((uint8_t *)ts[2]->dl_tensor.data - (uint8_t *)ts[0]->dl_tensor.data ==
		    2 * ((NELEM * 4 + 255) / 256 * 256));
	CHILD_CHECK(dlpc_publish_bundle(c, "gpu/bucket", 3, bundle_keys, ts, 0) == 1);
	/* one allocation, published by its export fd: no copy, no wait */
	CHILD_CHECK(log_count(getpid(), "cuMemCreate") == 1);
	CHILD_CHECK(log_count(getpid(), "cuMemExportToShareableHandle") == 1);
	CHILD_CHECK(log_count(getpid(), "cuMemcpyDtoD") == 0);
	CHILD_CHECK(log_count(getpid(), "Synchronize") == 0);
	dlpc_close(c);
	return 0;
}

static int attach_cuda_bundle(void *arg)
{
	const float bases[3] = {1.0f, 7.0f, 9.0f};
	dlpc_bundle *b = NULL;
	dlpc_client *c = NULL;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach_bundle(c, arg ? arg : "gpu/bundle", NULL, &b) == 1);
	CHILD_CHECK(dlpc_bundle_count(b) == 3);
	for (size_t i = 0; i < 3; i++) {
		DLManagedTensorVersioned *t;

		CHILD_CHECK(strcmp(dlpc_bundle_key(b, i), bundle_keys[i]) == 0);
		t = dlpc_bundle_take(b, i);
		CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA);
		CHILD_CHECK(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
		CHILD_CHECK(same(t->dl_tensor.data, NELEM, bases[i]));
		t->deleter(t);
	}
	dlpc_bundle_free(b);
	/* one import for the whole bundle */
	CHILD_CHECK(log_count(getpid(), "cuMemImportFromShareableHandle") == 1);
	CHILD_CHECK(log_reaches(getpid(), "cuMemUnmap", 1));
	dlpc_close(c);
	return 0;
}

START_TEST(cuda_bundle)
{
	dlpc_client *c = connect_or_die(&D);

	ck_assert_int_eq(wait_child(spawn(publish_cuda_bundle, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(attach_cuda_bundle, NULL)), 0);
	/* filled in place and published without a copy; the entry outlives its publisher */
	ck_assert_int_eq(wait_child(spawn(publish_alloc_bundle, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(attach_cuda_bundle, "gpu/bucket")), 0);
	ck_assert(wait_stat(c, no_refs, NULL, scaled_ms(5000)));
	dlpc_close(c);
}
END_TEST

/* ---- 16. a publish whose outcome is unknown ---- */

/* A legacy publish that times out against a stopped daemon may still take effect: the memory
 * stays with libdlpc until RECLAIM, never handed back while an entry could reach it. */
static int publish_times_out(void *arg)
{
	struct pollfd pfd;
	dlpc_client *c = NULL, *probe = NULL;
	dlpc_entry_info *list = NULL;
	CUdeviceptr base;
	size_t n = 0;
	int fds[2];
	char b;

	(void)arg;
	CHILD_CHECK(pipe(fds) == 0);
	CHILD_CHECK(setenv("DLPC_CALL_TIMEOUT_MS", "300", 1) == 0);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_connect(D.sock, &probe) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&base, ALLOC_BYTES) == CUDA_SUCCESS);
	fill((float *)(uintptr_t)base, NELEM, 1.0f);
	CHILD_CHECK(kill(D.pid, SIGSTOP) == 0);
	CHILD_CHECK(dlpc_publish(c, "gpu/late", dev_tensor(base, NELEM, fds[1]), 0) == -ETIMEDOUT);
	CHILD_CHECK(kill(D.pid, SIGCONT) == 0);
	/* the publish took effect after all; the tensor was not given back */
	for (int i = 0; i < 500 && n == 0; i++) {
		CHILD_CHECK(dlpc_list(probe, "gpu/late", &list, &n) == 0);
		dlpc_list_free(list, n);
		if (n == 0)
			usleep(10000);
	}
	CHILD_CHECK(n == 1);
	pfd = (struct pollfd){.fd = fds[0], .events = POLLIN};
	CHILD_CHECK(poll(&pfd, 1, 200) == 0);
	/* it comes back with the RECLAIM notice once unpublished */
	CHILD_CHECK(dlpc_unpublish(probe, "gpu/late") == 0);
	pfd.events = POLLIN;
	CHILD_CHECK(poll(&pfd, 1, scaled_ms(5000)) == 1 && read(fds[0], &b, 1) == 1);
	dlpc_close(probe);
	dlpc_close(c);
	return 0;
}

START_TEST(ipc_publish_unknown_outcome)
{
	int st = wait_child(spawn(publish_times_out, NULL));

	kill(D.pid, SIGCONT); /* whatever became of the child */
	ck_assert_int_eq(st, 0);
}
END_TEST

/* ---- 15. PID namespaces ---- */

/* In a new PID namespace with its own /proc: the legacy entry cannot be opened, and the
 * message says why; the VMM entry (an fd) attaches all the same. */
static int attach_from_pid_namespace(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	pid_t pid;
	int st;

	(void)arg;
	if (unshare(CLONE_NEWPID | CLONE_NEWNS) < 0) {
		fprintf(stderr, "ipc_pid_namespace: skipped: cannot unshare a PID namespace: %m\n");
		return 77;
	}
	pid = fork();
	CHILD_CHECK(pid >= 0);
	if (pid > 0)
		return waitpid(pid, &st, 0) == pid && WIFEXITED(st) ? WEXITSTATUS(st) : 1;
	/* pid 1 of the new namespace, seeing only it in a /proc of its own */
	CHILD_CHECK(mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0);
	CHILD_CHECK(mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) == 0);
	CHILD_CHECK(getpid() == 1);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/ns", NULL, &t) < 0 && t == NULL);
	CHILD_CHECK(strstr(dlpc_last_error(), "not in this process's PID namespace"));
	CHILD_CHECK(dlpc_attach(c, "gpu/v", NULL, &t) == 1);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, 3.0f));
	t->deleter(t);
	dlpc_close(c);
	_exit(0);
}

START_TEST(ipc_pid_namespace)
{
	struct publisher p = {.names = {"gpu/ns", NULL}};
	dlpc_client *c = connect_or_die(&D);
	int st;

	publisher_start(&p);
	ck_assert_int_eq(wait_child(spawn(vmm_publish, NULL)), 0);
	st = wait_child(spawn(attach_from_pid_namespace, NULL));
	ck_assert_msg(st == 0 || st == 77, "status %d", st);
	/* the failed attach gave its reference back */
	ck_assert(wait_stat(c, no_refs, NULL, scaled_ms(5000)));
	publisher_stop(&p);
	dlpc_close(c);
}
END_TEST

START_TEST(unexportable_memory)
{
	ck_assert_int_eq(wait_child(spawn(unexportable, NULL)), 0);
}
END_TEST

/* ---- 13. a forked child of a process using CUDA ---- */

/* In the forked child: no driver call at all, GPU calls refused naming the fork, and the GPU
 * tensors inherited from the parent released without touching the parent's state. */
static int forked_child(DLManagedTensorVersioned *held[4])
{
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	int64_t n = NELEM;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/f", NULL, &t) == -EBADFD && t == NULL);
	CHILD_CHECK(strstr(dlpc_last_error(), "cannot attach 'gpu/f'") &&
		    strstr(dlpc_last_error(), "which forked this one"));
	CHILD_CHECK(dlpc_attach(c, "gpu/v", NULL, &t) == -EBADFD && t == NULL);
	CHILD_CHECK(dlpc_alloc(c, (DLDevice){kDLCUDA, 0}, (DLDataType){kDLFloat, 32, 1}, 1, &n,
			       &t) == -EBADFD);
	/* publishing the parent's device memory: refused, the tensor's deleter run */
	CHILD_CHECK(
		dlpc_publish(c, "gpu/child",
			     dev_tensor((CUdeviceptr)(uintptr_t)held[0]->dl_tensor.data, NELEM, -1),
			     0) == -EBADFD);
	CHILD_CHECK(dlpc_tensor_wait(held[0], NULL) == -EBADFD);
	/* and the parent's dlpc_alloc() memory, which would need no driver call */
	CHILD_CHECK(dlpc_publish(c, "gpu/child-alloc", held[3], 0) == -EBADFD);
	CHILD_CHECK(strstr(dlpc_last_error(), "which forked this one"));
	/* two of them share one mapping in the parent's import cache */
	for (int i = 0; i < 3; i++)
		held[i]->deleter(held[i]);
	/* host tensors still work in the child */
	CHILD_CHECK(dlpc_publish(c, "gpu/host",
				 host_tensor((float[4]){0}, (DLDataType){kDLFloat, 32, 1}, 1,
					     (int64_t[1]){4}, NULL, NULL),
				 0) == 1);
	dlpc_close(c);
	return 0;
}

static int attach_then_fork(void *arg)
{
	DLManagedTensorVersioned *held[4] = {NULL, NULL, NULL, NULL};
	dlpc_client *c = NULL;
	int64_t n = NELEM;
	pid_t child;
	int st;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_alloc(c, (DLDevice){kDLCUDA, 0}, (DLDataType){kDLFloat, 32, 1}, 1, &n,
			       &held[3]) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/f", NULL, &held[0]) == 1);
	CHILD_CHECK(dlpc_attach(c, "gpu/v", NULL, &held[1]) == 1);
	CHILD_CHECK(dlpc_attach(c, "gpu/f", NULL, &held[2]) == 1);
	CHILD_CHECK(log_count(getpid(), "cuIpcOpenMemHandle") == 1);
	child = fork();
	CHILD_CHECK(child >= 0);
	if (child == 0)
		_exit(forked_child(held));
	CHILD_CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0);
	/* the child made no driver call, and nothing it did reached this process's tensors */
	CHILD_CHECK(log_count(child, "after-fork") == 0);
	CHILD_CHECK(log_count(child, "cu") == 0);
	CHILD_CHECK(same(held[0]->dl_tensor.data, NELEM, 1.0f));
	CHILD_CHECK(same(held[1]->dl_tensor.data, NELEM, 3.0f));
	CHILD_CHECK(same(held[2]->dl_tensor.data, NELEM, 1.0f));
	for (int i = 0; i < 4; i++)
		held[i]->deleter(held[i]);
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	CHILD_CHECK(log_reaches(getpid(), "cuMemUnmap", 2));
	dlpc_close(c);
	return 0;
}

START_TEST(fork_child)
{
	struct publisher p = {.names = {"gpu/f", NULL}};
	dlpc_client *c = connect_or_die(&D);

	publisher_start(&p);
	ck_assert_int_eq(wait_child(spawn(vmm_publish, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(attach_then_fork, NULL)), 0);
	/* every reference was given back: the parent's by the parent */
	ck_assert(wait_stat(c, no_refs, NULL, scaled_ms(5000)));
	publisher_stop(&p);
	dlpc_close(c);
}
END_TEST

/* ---- 17. release ordered after the consumer's work ---- */

/*
 * How many times the library's retiring thread may look at a release's event, or wake up to
 * wait on it, while the consumer's kernel runs, however long it runs: once when the release
 * comes, once more for another release or a spurious wake-up. A thread that polled would look
 * every millisecond.
 */
#define PENDING_QUERIES_MAX 3

static int release_behind_held_work(void *arg)
{
	dlpc_attach_opts o = {.size = sizeof(o)};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	CUstream s;
	char want[64];

	(void)arg;
	alarm(30); /* a deleter that waited for the held stream would wait for ever */
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s, 0) == CUDA_SUCCESS);
	o.stream = s;
	CHILD_CHECK(dlpc_attach(c, "gpu/h", &o, &t) == 1);
	CHILD_CHECK(refs_now(c) == 1);
	/* a long kernel that reads the tensor runs on s, and the consumer drops the tensor */
	fake_cuda_stream_hold(s, 1);
	t->deleter(t);
	/* the deleter returned at once, having recorded an event behind that kernel, on the
	 * legacy stream (which follows s, a blocking stream) */
	CHILD_CHECK(log_count2(getpid(), "cuEventRecord", "stream=0x1 behind-held-work") == 1);
	snprintf(want, sizeof(want), "stream=%p", (void *)s);
	CHILD_CHECK(log_count2(getpid(), "cuEventRecord", want) == 0);
	/* while it runs the memory stays mapped and referenced, so no RECLAIM can reach the
	 * publisher; the deleter waited for nothing, and the library's thread, once it found the
	 * event not ready, sleeps in the driver on that (blocking-sync) event: it does not poll,
	 * and it queued nothing on any stream (no host function) */
	CHILD_CHECK(refs_stay(c, 1));
	CHILD_CHECK(log_appears(getpid(), "result=600")); /* cuEventQuery: not ready */
	CHILD_CHECK(log_appears(getpid(), "cuEventSynchronize"));
	CHILD_CHECK(log_count(getpid(), "cuEventQuery") <= PENDING_QUERIES_MAX);
	/* and it stays asleep for as long as the kernel runs */
	usleep(200000);
	CHILD_CHECK(log_count(getpid(), "cuEventQuery") <= PENDING_QUERIES_MAX);
	CHILD_CHECK(log_count2(getpid(), "cuEventSynchronize", "blocking") <= PENDING_QUERIES_MAX);
	CHILD_CHECK(log_count(getpid(), "cuEventSynchronize") ==
		    log_count2(getpid(), "cuEventSynchronize", "blocking"));
	CHILD_CHECK(log_count(getpid(), "cuIpcCloseMemHandle") == 0);
	CHILD_CHECK(log_count(getpid(), "cuCtxSynchronize") == 0);
	CHILD_CHECK(log_count(getpid(), "cuStreamSynchronize") == 0);
	CHILD_CHECK(log_count(getpid(), "cuLaunchHostFunc") == 0);
	/* the kernel ends: unmapped and released without another call of the consumer's */
	fake_cuda_stream_hold(s, 0);
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	CHILD_CHECK(refs_reach(c, 0));
	dlpc_close(c);
	return 0;
}

START_TEST(release_after_consumer_work)
{
	struct publisher p = {.names = {"gpu/h", NULL}};

	publisher_start(&p);
	ck_assert_int_eq(wait_child(spawn(release_behind_held_work, NULL)), 0);
	publisher_stop(&p);
}
END_TEST

/*
 * A release adds nothing to the consumer's streams: work the consumer queues on the legacy
 * stream after dropping a tensor (which every blocking stream follows) runs when the fake's
 * clock says its kernel before it ended, not after a thread of libdlpc's or the driver's has
 * run (the fake holds work queued behind a host function until it returns, as the driver does).
 */
static int release_leaves_streams_free(void *arg)
{
	dlpc_attach_opts o = {.size = sizeof(o)};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	float got[NELEM] = {0};
	int mark = 0, one = 1;
	CUstream s;

	(void)arg;
	alarm(30);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s, 0) == CUDA_SUCCESS);
	o.stream = s;
	CHILD_CHECK(dlpc_attach(c, "gpu/h", &o, &t) == 1);
	fake_cuda_kernel(s, 40);
	fake_cuda_read_later(s, t->dl_tensor.data, got, sizeof(got));
	t->deleter(t);
	/* the consumer's next work, after the release, behind the kernel */
	fake_cuda_write_later(CU_STREAM_LEGACY, &mark, &one, sizeof(mark));
	CHILD_CHECK(refs_stay(c, 1));
	CHILD_CHECK(mark == 0);
	/* the kernel ends: the read and the consumer's next work have run, in this call */
	fake_cuda_clock_advance(40);
	CHILD_CHECK(mark == 1 && same(got, NELEM, 1.0f));
	CHILD_CHECK(log_count(getpid(), "work-behind-host-function") == 0);
	CHILD_CHECK(log_count(getpid(), "cuLaunchHostFunc") == 0);
	/* and then the release */
	CHILD_CHECK(refs_reach(c, 0));
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	CHILD_CHECK(log_count(getpid(), "freed-under-pending-work") == 0);
	dlpc_close(c);
	return 0;
}

/*
 * A release whose event never completes because the context is lost (a sticky error: a
 * kernel faulted) does not stay pending: the retiring thread, asleep on the event, wakes with
 * the error, lets the memory go, and says so on stderr.
 */
static int release_after_sticky_error(void *arg)
{
	dlpc_attach_opts o = {.size = sizeof(o)};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	char err[1024] = {0};
	FILE *f = tmpfile();
	CUstream s;

	(void)arg;
	alarm(30);
	CHILD_CHECK(f && dup2(fileno(f), STDERR_FILENO) == STDERR_FILENO);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s, 0) == CUDA_SUCCESS);
	o.stream = s;
	CHILD_CHECK(dlpc_attach(c, "gpu/h", &o, &t) == 1);
	fake_cuda_stream_hold(s, 1);
	t->deleter(t);
	CHILD_CHECK(log_appears(getpid(), "result=600")); /* looked once: not ready */
	CHILD_CHECK(refs_stay(c, 1));
	fake_cuda_sticky_error();
	CHILD_CHECK(refs_reach(c, 0));
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	CHILD_CHECK(pread(fileno(f), err, sizeof(err) - 1, 0) > 0);
	CHILD_CHECK(strstr(err, "CUDA device 0: the consumer's work ended in a CUDA error "
				"(cuCtxSynchronize failed: CUDA error 719)"));
	dlpc_close(c);
	return 0;
}

START_TEST(release_streams_free)
{
	struct publisher p = {.names = {"gpu/h", NULL}};

	publisher_start(&p);
	ck_assert_int_eq(wait_child(spawn(release_leaves_streams_free, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(release_after_sticky_error, NULL)), 0);
	publisher_stop(&p);
}
END_TEST

static int release_while_capturing(void *arg)
{
	DLManagedTensorVersioned *t[5] = {NULL};
	dlpc_client *c = NULL;
	CUstream s1, s2, s3;
	void *streams[5];

	(void)arg;
	alarm(30);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s1, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s2, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s3, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
	/* ordered on s1; on the host; on s2; on the legacy stream (Python's stream=1); on s3, a
	 * non-blocking stream, which the legacy stream does not follow */
	streams[0] = s1;
	streams[1] = NULL;
	streams[2] = s2;
	streams[3] = CU_STREAM_LEGACY;
	streams[4] = s3;
	for (int i = 0; i < 5; i++) {
		dlpc_attach_opts o = {.size = sizeof(o), .stream = streams[i]};

		CHILD_CHECK(dlpc_attach(c, "gpu/g", &o, &t[i]) == 1);
	}
	CHILD_CHECK(refs_now(c) == 5);
	/* another thread of the process captures a graph on s2 (a blocking stream), in global
	 * mode: synchronizing, or using the legacy stream, would invalidate it */
	fake_cuda_capture(s2, 1);
	/* the users of s1 and s3 are done with them, before the tensors ordered there are
	 * dropped: the library holds no handle on either (the fake aborts on one) */
	CHILD_CHECK(cuStreamDestroy(s1) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamDestroy(s3) == CUDA_SUCCESS);
	/* each release waits for an event on the legacy stream, or (s3) for the context to be
	 * synchronized: neither can be had until the capture ends, so the memory stays, and no
	 * event lands in the graph */
	for (int i = 0; i < 5; i++)
		t[i]->deleter(t[i]);
	CHILD_CHECK(refs_stay(c, 5));
	CHILD_CHECK(log_count(getpid(), " captured") == 0);
	CHILD_CHECK(log_count(getpid(), "cuEventRecord stream=") == 0); /* none refused */
	CHILD_CHECK(log_count(getpid(), "cuCtxSynchronize") == 0);
	/* s2 is destroyed as soon as its capture ends: the library holds no handle on it */
	fake_cuda_capture(s2, 0);
	CHILD_CHECK(cuStreamDestroy(s2) == CUDA_SUCCESS);
	CHILD_CHECK(refs_reach(c, 0));
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	/* and the capture was never disturbed; the context was synchronized for s3's only */
	CHILD_CHECK(log_count(getpid(), "capture-invalidated") == 0);
	CHILD_CHECK(log_count(getpid(), "use-after-destroy") == 0);
	CHILD_CHECK(log_count(getpid(), "cuCtxSynchronize") == 1);
	dlpc_close(c);
	return 0;
}

START_TEST(release_during_capture)
{
	struct publisher p = {.names = {"gpu/g", NULL}};

	publisher_start(&p);
	ck_assert_int_eq(wait_child(spawn(release_while_capturing, NULL)), 0);
	publisher_stop(&p);
}
END_TEST

/*
 * Another thread captures a graph on a non-blocking stream (as torch.cuda.graph does) while
 * this one attaches and drops tensors: one read on the legacy stream, one on a non-blocking
 * stream of its own, one waited for on the host. The capture cannot be seen from the legacy
 * stream (as on an H200), and the host wait is made in relaxed mode. The non-blocking one
 * needs its context synchronized, which invalidates any capture under way. With
 * dlpc_cuda_hold_releases() (*@p arg) nothing is released until the resume, and libdlpc's
 * thread sleeps meanwhile (it makes no driver call); without, the legacy-ordered release goes
 * at once and the other one loses the capture, as the docs say.
 */
/* The times the other threads of this process went to sleep so far (voluntary context
 * switches, /proc/self/task/N/status): a thread that polls adds one per look. */
static long other_threads_sleeps(void)
{
	long me = (long)syscall(SYS_gettid), n = 0, v;
	DIR *d = opendir("/proc/self/task");
	struct dirent *e;
	char path[300], line[128];

	while (d && (e = readdir(d))) {
		FILE *f;

		if (e->d_name[0] == '.' || atol(e->d_name) == me)
			continue;
		snprintf(path, sizeof(path), "/proc/self/task/%s/status", e->d_name);
		f = fopen(path, "r");
		while (f && fgets(line, sizeof(line), f))
			if (sscanf(line, "voluntary_ctxt_switches: %ld", &v) == 1)
				n += v;
		if (f)
			fclose(f);
	}
	if (d)
		closedir(d);
	return n;
}

static int release_while_nonblocking_captures(void *arg)
{
	bool hold = *(const bool *)arg;
	DLManagedTensorVersioned *t[3] = {NULL};
	dlpc_attach_opts o = {.size = sizeof(o), .stream = CU_STREAM_LEGACY};
	dlpc_client *c = NULL;
	CUstream cap, side;

	alarm(30);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&cap, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&side, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
	CHILD_CHECK(dlpc_attach(c, "gpu/g", &o, &t[0]) == 1);
	o.stream = side;
	CHILD_CHECK(dlpc_attach(c, "gpu/g", &o, &t[1]) == 1);
	if (hold)
		dlpc_cuda_hold_releases();
	fake_cuda_capture(cap, 1);
	CHILD_CHECK(dlpc_attach(c, "gpu/g", NULL, &t[2]) == 1); /* the host waits */
	CHILD_CHECK(refs_now(c) == 3);
	for (int i = 0; i < 3; i++)
		t[i]->deleter(t[i]);
	if (hold) {
		long sleeps;
		int looks;

		usleep(100000);
		looks = log_count(getpid(), "cuStreamIsCapturing") + log_count(getpid(), "cuEvent");
		sleeps = other_threads_sleeps();
		usleep(300000);
		/* libdlpc's thread sleeps until the resume: no look at the driver, and not a wake-up
		 * per millisecond (a poll would add about 300 here) */
		CHILD_CHECK(other_threads_sleeps() - sleeps < 30);
		CHILD_CHECK(log_count(getpid(), "cuStreamIsCapturing") +
				    log_count(getpid(), "cuEvent") ==
			    looks);
		CHILD_CHECK(refs_now(c) == 3);
		CHILD_CHECK(log_count(getpid(), "cuCtxSynchronize") == 0);
		fake_cuda_capture(cap, 0);
		dlpc_cuda_resume_releases();
		dlpc_cuda_resume_releases(); /* one too many: nothing */
		CHILD_CHECK(refs_reach(c, 0));
		CHILD_CHECK(log_count(getpid(), "capture-invalidated") == 0);
	} else {
		CHILD_CHECK(refs_reach(c, 1));
		CHILD_CHECK(log_appears(getpid(), "capture-invalidated by cuCtxSynchronize"));
		fake_cuda_capture(cap, 0);
		CHILD_CHECK(refs_reach(c, 0));
		CHILD_CHECK(log_count(getpid(), "capture-invalidated by cuEventSynchronize") == 0);
	}
	CHILD_CHECK(log_count(getpid(), " captured") == 0);
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	CHILD_CHECK(cuStreamDestroy(cap) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamDestroy(side) == CUDA_SUCCESS);
	dlpc_close(c);
	return 0;
}

START_TEST(release_during_nonblocking_capture)
{
	struct publisher p = {.names = {"gpu/g", NULL}};
	bool hold = true, no_hold = false;

	publisher_start(&p);
	ck_assert_int_eq(wait_child(spawn(release_while_nonblocking_captures, &hold)), 0);
	ck_assert_int_eq(wait_child(spawn(release_while_nonblocking_captures, &no_hold)), 0);
	publisher_stop(&p);
}
END_TEST

/*
 * CuPy's sequence: the consumer names a stream of its own (__dlpack__(stream=s) inside
 * `with cupy.cuda.Stream():`), destroys that stream when the block ends, and only later drops
 * the array. The deleter must not touch the destroyed stream (the fake aborts if it does, as
 * the real driver may crash), and the release must still come after the work queued there.
 */
struct destroyed_stream {
	bool at_attach; /* the stream named in dlpc_attach_opts, else in dlpc_tensor_wait() */
	unsigned flags; /* cuStreamCreate's: CU_STREAM_NON_BLOCKING or not */
};

static int release_after_stream_destroyed(void *arg)
{
	struct destroyed_stream *d = arg;
	dlpc_attach_opts o = {.size = sizeof(o)};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	CUstream s;

	alarm(30);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s, d->flags) == CUDA_SUCCESS);
	if (d->at_attach)
		o.stream = s;
	else
		o.flags = DLPC_ATTACH_DEFER_SYNC;
	CHILD_CHECK(dlpc_attach(c, "gpu/s", &o, &t) == 1);
	if (!d->at_attach)
		CHILD_CHECK(dlpc_tensor_wait(t, s) == 0);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, 1.0f));
	CHILD_CHECK(refs_now(c) == 1);
	/* the `with` block ends: the stream goes, its queued work still runs to its end */
	CHILD_CHECK(cuStreamDestroy(s) == CUDA_SUCCESS);
	/* the array is dropped later: the deleter runs, the stream handle long gone */
	t->deleter(t);
	CHILD_CHECK(refs_reach(c, 0));
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	CHILD_CHECK(log_count(getpid(), "use-after-destroy") == 0);
	/* a blocking stream is followed by the legacy stream; a non-blocking one is not, so the
	 * context is synchronized, on the library's thread */
	if (d->flags & CU_STREAM_NON_BLOCKING)
		CHILD_CHECK(log_count(getpid(), "cuCtxSynchronize") == 1);
	else
		CHILD_CHECK(log_count2(getpid(), "cuEventRecord", "stream=0x1") == 1);
	dlpc_close(c);
	return 0;
}

START_TEST(release_after_stream_destroyed_case)
{
	struct publisher p = {.names = {"gpu/s", NULL}};
	struct destroyed_stream cases[] = {
		{.at_attach = false, .flags = CU_STREAM_DEFAULT},
		{.at_attach = true, .flags = CU_STREAM_DEFAULT},
		{.at_attach = false, .flags = CU_STREAM_NON_BLOCKING},
		{.at_attach = true, .flags = CU_STREAM_NON_BLOCKING},
	};

	publisher_start(&p);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		ck_assert_msg(wait_child(spawn(release_after_stream_destroyed, &cases[i])) == 0,
			      "case %zu", i);
	/* the publisher lived through it all: its entry is still there, unreferenced */
	publisher_stop(&p);
}
END_TEST

/*
 * Ordering by construction: the consumer's kernel that reads the attached tensor is queued
 * behind a long one (a held stream), and the consumer drops the tensor at once. The fake aborts
 * if the memory is unmapped while that read is still queued (as a kernel would fault on it),
 * so any release that does not wait for it fails here, whatever the log says. The kernel runs
 * on a stream named at attach or in dlpc_tensor_wait(), blocking or not, destroyed before the
 * tensor is dropped or not, or on a blocking stream the consumer never named.
 */
struct queued_read {
	bool named; /* the stream is named (attach or dlpc_tensor_wait()); else the host waits */
	bool at_attach; /* named in dlpc_attach_opts, else in dlpc_tensor_wait() */
	unsigned flags; /* cuStreamCreate's */
	bool destroy;	/* the stream is destroyed before the tensor is dropped */
	unsigned ticks; /* the long kernel takes that many ticks of the fake's clock (0: held) */
};

static int release_after_queued_read(void *arg)
{
	struct queued_read *q = arg;
	dlpc_attach_opts o = {.size = sizeof(o)};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	float got[NELEM] = {0};
	CUstream s;

	alarm(30);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s, q->flags) == CUDA_SUCCESS);
	if (q->named && q->at_attach)
		o.stream = s;
	else if (q->named)
		o.flags = DLPC_ATTACH_DEFER_SYNC;
	CHILD_CHECK(dlpc_attach(c, "gpu/s", &o, &t) == 1);
	if (q->named && !q->at_attach)
		CHILD_CHECK(dlpc_tensor_wait(t, s) == 0);
	/* a long kernel, then one that reads the tensor; the consumer drops it at once */
	if (q->ticks)
		fake_cuda_kernel(s, q->ticks);
	else
		fake_cuda_stream_hold(s, 1);
	fake_cuda_read_later(s, t->dl_tensor.data, got, sizeof(got));
	if (q->destroy)
		CHILD_CHECK(cuStreamDestroy(s) == CUDA_SUCCESS);
	t->deleter(t);
	/* the memory stays mapped and referenced while the read is queued */
	CHILD_CHECK(refs_stay(c, 1));
	CHILD_CHECK(log_count(getpid(), "cuIpcCloseMemHandle") == 0);
	/* the kernels end (the test's hook still reaches a destroyed stream's work) */
	if (q->ticks) {
		fake_cuda_clock_advance(q->ticks - 1);
		CHILD_CHECK(refs_stay(c, 1));
		fake_cuda_clock_advance(1);
	} else {
		fake_cuda_stream_hold(s, 0);
	}
	CHILD_CHECK(refs_reach(c, 0));
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	CHILD_CHECK(same(got, NELEM, 1.0f));
	CHILD_CHECK(log_count(getpid(), "freed-under-pending-work") == 0);
	CHILD_CHECK(log_count(getpid(), "use-after-destroy") == 0);
	dlpc_close(c);
	return 0;
}

START_TEST(release_after_queued_reads)
{
	struct publisher p = {.names = {"gpu/s", NULL}};
	struct queued_read cases[] = {
		{.named = true, .at_attach = true, .flags = CU_STREAM_DEFAULT},
		{.named = true, .at_attach = false, .flags = CU_STREAM_DEFAULT},
		{.named = true, .at_attach = true, .flags = CU_STREAM_NON_BLOCKING},
		{.named = true, .at_attach = false, .flags = CU_STREAM_NON_BLOCKING},
		{.named = true, .at_attach = true, .flags = CU_STREAM_DEFAULT, .destroy = true},
		{.named = true,
		 .at_attach = true,
		 .flags = CU_STREAM_NON_BLOCKING,
		 .destroy = true},
		{.named = false, .flags = CU_STREAM_DEFAULT},
		{.named = false, .flags = CU_STREAM_DEFAULT, .destroy = true},
		/* a kernel timed on the fake's clock, which only the test moves here (a release
		 * for a non-blocking stream synchronizes the context: the time would pass then) */
		{.named = true, .at_attach = true, .flags = CU_STREAM_DEFAULT, .ticks = 50},
	};

	publisher_start(&p);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		ck_assert_msg(wait_child(spawn(release_after_queued_read, &cases[i])) == 0,
			      "case %zu", i);
	publisher_stop(&p);
}
END_TEST

/*
 * The fake's own stream rules, which the ordering tests above rest on: an event is a point in
 * its stream's queue and cuStreamWaitEvent orders another stream after it; the legacy stream
 * follows held blocking streams, not non-blocking ones; a destroyed stream's work still runs.
 */
static int fake_stream_rules(void *arg)
{
	int v = 0, one = 1, two = 2, three = 3;
	CUstream a, b, nb;
	CUevent e;

	(void)arg;
	alarm(30);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&a, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&b, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS);
	/* b waits for an event recorded behind a's long kernel: b's work waits too */
	fake_cuda_stream_hold(a, 1);
	CHILD_CHECK(cuEventRecord(e, a) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventQuery(e) == CUDA_ERROR_NOT_READY);
	CHILD_CHECK(cuStreamWaitEvent(b, e, 0) == CUDA_SUCCESS);
	fake_cuda_write_later(b, &v, &one, sizeof(v));
	CHILD_CHECK(v == 0 && cuStreamQuery(b) == CUDA_ERROR_NOT_READY);
	/* a non-blocking stream is not held back by a, nor is the legacy stream by nb */
	fake_cuda_write_later(nb, &v, &two, sizeof(v));
	CHILD_CHECK(v == 2);
	fake_cuda_stream_hold(nb, 1);
	/* the legacy stream's work waits for a (blocking), and a's destruction does not end it */
	fake_cuda_write_later(CU_STREAM_LEGACY, &v, &three, sizeof(v));
	CHILD_CHECK(v == 2);
	CHILD_CHECK(cuStreamDestroy(a) == CUDA_SUCCESS);
	CHILD_CHECK(v == 2 && cuEventQuery(e) == CUDA_ERROR_NOT_READY);
	/* a's kernel ends: b's write, then the legacy stream's, in that order of release */
	fake_cuda_stream_hold(a, 0);
	CHILD_CHECK(cuEventQuery(e) == CUDA_SUCCESS);
	CHILD_CHECK(v == 3 && cuStreamQuery(b) == CUDA_SUCCESS);
	fake_cuda_stream_hold(nb, 0);
	CHILD_CHECK(cuStreamDestroy(b) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamDestroy(nb) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventDestroy(e) == CUDA_SUCCESS);
	return 0;
}

/* The fake's clock: timed kernels end when it reaches them, which looking does not do and
 * waiting (synchronizing) does. */
static int fake_clock_rules(void *arg)
{
	CUcontext ctx;
	CUdevice dev;
	CUstream s;
	CUevent e;

	(void)arg;
	alarm(30);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuDeviceGet(&dev, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS);
	CHILD_CHECK(cuCtxPushCurrent(ctx) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS);
	/* two kernels of 5 and 3 ticks, then an event */
	fake_cuda_kernel(s, 5);
	fake_cuda_kernel(s, 3);
	CHILD_CHECK(cuEventRecord(e, s) == CUDA_SUCCESS);
	for (int i = 0; i < 100; i++)
		CHILD_CHECK(cuEventQuery(e) == CUDA_ERROR_NOT_READY);
	fake_cuda_clock_advance(7);
	CHILD_CHECK(cuEventQuery(e) == CUDA_ERROR_NOT_READY);
	fake_cuda_clock_advance(1);
	CHILD_CHECK(cuEventQuery(e) == CUDA_SUCCESS);
	/* waiting lets the time pass: the legacy stream follows the timed blocking stream */
	fake_cuda_kernel(s, 1000);
	CHILD_CHECK(cuEventRecord(e, CU_STREAM_LEGACY) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventQuery(e) == CUDA_ERROR_NOT_READY);
	CHILD_CHECK(cuStreamSynchronize(CU_STREAM_LEGACY) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventQuery(e) == CUDA_SUCCESS);
	fake_cuda_kernel(s, 10);
	CHILD_CHECK(cuCtxSynchronize() == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamQuery(s) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventDestroy(e) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamDestroy(s) == CUDA_SUCCESS);
	return 0;
}

/* A host function that returns once the test writes a byte to the pipe it reads. */
static void host_fn_gate(void *arg)
{
	char b;

	if (read(*(int *)arg, &b, 1) != 1)
		abort();
}

static void *event_sync(void *arg)
{
	return (void *)(intptr_t)cuEventSynchronize(arg);
}

/*
 * The fake's host functions and blocking-sync events, as the driver's: work queued after a
 * host function waits until the function returns; cuEventSynchronize of a blocking-sync event
 * sleeps until the clock reaches the event, and does not move the clock itself.
 */
static int fake_host_fn_rules(void *arg)
{
	int gate[2], v = 0, one = 1;
	pthread_t t;
	void *ret;
	CUstream s;
	CUevent e;

	(void)arg;
	alarm(30);
	CHILD_CHECK(pipe(gate) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s, 0) == CUDA_SUCCESS);
	fake_cuda_stream_hold(s, 1);
	CHILD_CHECK(cuLaunchHostFunc(CU_STREAM_LEGACY, host_fn_gate, &gate[0]) == CUDA_SUCCESS);
	fake_cuda_write_later(CU_STREAM_LEGACY, &v, &one, sizeof(v));
	fake_cuda_stream_hold(s, 0);
	/* the host function runs, and the write behind it waits until it returns */
	CHILD_CHECK(log_appears(getpid(), "host-function runs"));
	CHILD_CHECK(log_count(getpid(), "work-behind-host-function") == 1);
	CHILD_CHECK(__atomic_load_n(&v, __ATOMIC_SEQ_CST) == 0);
	CHILD_CHECK(write(gate[1], "x", 1) == 1);
	for (int i = 0; i < 1000 && __atomic_load_n(&v, __ATOMIC_SEQ_CST) == 0; i++)
		usleep(10000);
	CHILD_CHECK(__atomic_load_n(&v, __ATOMIC_SEQ_CST) == 1);
	/* a blocking-sync event behind a timed kernel: its synchronization waits for the test */
	CHILD_CHECK(cuEventCreate(&e, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING) ==
		    CUDA_SUCCESS);
	fake_cuda_kernel(s, 20);
	CHILD_CHECK(cuEventRecord(e, s) == CUDA_SUCCESS);
	CHILD_CHECK(pthread_create(&t, NULL, event_sync, e) == 0);
	CHILD_CHECK(log_appears(getpid(), "cuEventSynchronize"));
	CHILD_CHECK(cuEventQuery(e) == CUDA_ERROR_NOT_READY);
	fake_cuda_clock_advance(19);
	CHILD_CHECK(cuEventQuery(e) == CUDA_ERROR_NOT_READY);
	fake_cuda_clock_advance(1);
	CHILD_CHECK(pthread_join(t, &ret) == 0 && (intptr_t)ret == CUDA_SUCCESS);
	CHILD_CHECK(cuEventQuery(e) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventDestroy(e) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamDestroy(s) == CUDA_SUCCESS);
	close(gate[0]);
	close(gate[1]);
	return 0;
}

START_TEST(fake_streams)
{
	ck_assert_int_eq(wait_child(spawn(fake_stream_rules, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(fake_clock_rules, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(fake_host_fn_rules, NULL)), 0);
}
END_TEST

/*
 * The fake's modules and kernels, as bench/bench_gpu.c relies on them: a launch is work on its
 * stream (after the work queued before it: a held stream, a timed kernel, an event waited
 * for), names the module does not declare fail as with the driver, bad launches are refused,
 * a capture takes the kernel into its graph, and memory outside the fake's is a sticky fault.
 */
static const char fake_ptx[] = ".version 7.0\n.target sm_52\n.address_size 64\n"
			       ".visible .entry dlpc_fill_u32(.param .u64 p, .param .u64 n, "
			       ".param .u32 seed)\n{\n\tret;\n}\n"
			       ".visible .entry dlpc_sum_u32(.param .u64 p, .param .u64 n, "
			       ".param .u64 out)\n{\n\tret;\n}\n"
			       ".visible .entry another(.param .u64 p)\n{\n\tret;\n}\n";

#define KWORDS 1000

static CUresult kernel_on(CUstream s, CUfunction f, CUdeviceptr p, uint64_t n, void *third)
{
	void *args[] = {&p, &n, third};

	return cuLaunchKernel(f, 4, 1, 1, 256, 1, 1, 0, s, args, NULL);
}

static int fake_kernel_rules(void *arg)
{
	uint32_t seed = 7, host[KWORDS];
	uint64_t want = 0, n = KWORDS;
	CUdeviceptr buf, out, bad = (CUdeviceptr)(uintptr_t)host;
	CUfunction fill_k, sum_k, f;
	void *args[] = {&buf, &n, &seed};
	CUstream s, w, cap;
	CUcontext ctx;
	CUmodule mod;
	CUevent e;

	(void)arg;
	alarm(30);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuDevicePrimaryCtxRetain(&ctx, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuModuleLoadData(&mod, fake_ptx) == CUDA_ERROR_INVALID_CONTEXT);
	CHILD_CHECK(cuCtxPushCurrent(ctx) == CUDA_SUCCESS);
	CHILD_CHECK(cuModuleLoadData(&mod, "not ptx") == CUDA_ERROR_INVALID_IMAGE);
	CHILD_CHECK(cuModuleLoadData(&mod, fake_ptx) == CUDA_SUCCESS);
	CHILD_CHECK(cuModuleGetFunction(&f, mod, "dlpc_sum") == CUDA_ERROR_NOT_FOUND);
	CHILD_CHECK(cuModuleGetFunction(&f, mod, "another") == CUDA_ERROR_NOT_FOUND);
	CHILD_CHECK(cuModuleGetFunction(&fill_k, mod, "dlpc_fill_u32") == CUDA_SUCCESS);
	CHILD_CHECK(cuModuleGetFunction(&sum_k, mod, "dlpc_sum_u32") == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&buf, KWORDS * 4) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&out, 8) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemcpyHtoD(out, &want, 8) == CUDA_SUCCESS);
	for (uint32_t i = 0; i < KWORDS; i++)
		want += (uint32_t)(i * 2654435761u + seed);
	CHILD_CHECK(cuStreamCreate(&s, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&w, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&cap, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS);
	/* bad launches are refused and queue nothing */
	CHILD_CHECK(cuLaunchKernel(fill_k, 4, 1, 1, 256, 1, 1, 0, s, NULL, NULL) ==
		    CUDA_ERROR_INVALID_VALUE);
	CHILD_CHECK(cuLaunchKernel(fill_k, 4, 1, 1, 256, 1, 1, 0, s, args, args) ==
		    CUDA_ERROR_INVALID_VALUE);
	CHILD_CHECK(cuLaunchKernel(fill_k, 1, 1, 1, 2048, 1, 1, 0, s, args, NULL) ==
		    CUDA_ERROR_INVALID_VALUE);
	CHILD_CHECK(cuLaunchKernel(fill_k, 0, 1, 1, 256, 1, 1, 0, s, args, NULL) ==
		    CUDA_ERROR_INVALID_VALUE);
	CHILD_CHECK(cuLaunchKernel(NULL, 1, 1, 1, 256, 1, 1, 0, s, args, NULL) ==
		    CUDA_ERROR_INVALID_HANDLE);
	/* behind a long kernel: the fill and the sum wait, in order, until it ends */
	fake_cuda_stream_hold(s, 1);
	CHILD_CHECK(kernel_on(s, fill_k, buf, KWORDS, &seed) == CUDA_SUCCESS);
	CHILD_CHECK(kernel_on(s, sum_k, buf, KWORDS, &out) == CUDA_SUCCESS);
	CHILD_CHECK(((uint32_t *)(uintptr_t)buf)[1] == 0 && *(uint64_t *)(uintptr_t)out == 0);
	CHILD_CHECK(cuStreamQuery(s) == CUDA_ERROR_NOT_READY);
	/* a stream waiting for an event behind that kernel holds its launch back too */
	CHILD_CHECK(cuEventRecord(e, s) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamWaitEvent(w, e, 0) == CUDA_SUCCESS);
	CHILD_CHECK(kernel_on(w, sum_k, buf, KWORDS, &out) == CUDA_SUCCESS);
	CHILD_CHECK(*(uint64_t *)(uintptr_t)out == 0);
	fake_cuda_stream_hold(s, 0);
	CHILD_CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamSynchronize(w) == CUDA_SUCCESS);
	CHILD_CHECK(((uint32_t *)(uintptr_t)buf)[1] == 2654435761u + seed);
	CHILD_CHECK(*(uint64_t *)(uintptr_t)out == 2 * want);
	/* behind a timed kernel: the sum runs when the clock reaches its end (a wait moves it) */
	fake_cuda_kernel(s, 5);
	CHILD_CHECK(kernel_on(s, sum_k, buf, KWORDS, &out) == CUDA_SUCCESS);
	CHILD_CHECK(*(uint64_t *)(uintptr_t)out == 2 * want);
	CHILD_CHECK(cuStreamSynchronize(s) == CUDA_SUCCESS);
	CHILD_CHECK(*(uint64_t *)(uintptr_t)out == 3 * want);
	/* a capture takes the launch into its graph (it never runs here); the legacy stream
	 * refuses one meanwhile */
	fake_cuda_capture(cap, 1);
	CHILD_CHECK(kernel_on(cap, sum_k, buf, KWORDS, &out) == CUDA_SUCCESS);
	CHILD_CHECK(kernel_on(CU_STREAM_LEGACY, sum_k, buf, KWORDS, &out) ==
		    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
	fake_cuda_capture(cap, 0);
	CHILD_CHECK(cuStreamSynchronize(cap) == CUDA_SUCCESS);
	CHILD_CHECK(*(uint64_t *)(uintptr_t)out == 3 * want);
	/* the copies check their ranges */
	CHILD_CHECK(cuMemcpyDtoH(&want, out, 8) == CUDA_SUCCESS && want % 3 == 0);
	CHILD_CHECK(cuMemcpyDtoH(&want, out + 4, 8) == CUDA_ERROR_INVALID_VALUE);
	CHILD_CHECK(cuMemcpyHtoD(bad, &want, 8) == CUDA_ERROR_INVALID_VALUE);
	/* memory that is not the fake's: the launch succeeds, the context is lost */
	CHILD_CHECK(kernel_on(s, sum_k, bad, KWORDS, &out) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamSynchronize(s) == CUDA_ERROR_LAUNCH_FAILED);
	CHILD_CHECK(cuModuleUnload(mod) == CUDA_SUCCESS);
	return 0;
}

/* Memory a queued kernel still reads, freed: a fault on the device, so the fake aborts. */
static int fake_kernel_freed(void *arg)
{
	uint64_t n = KWORDS;
	CUdeviceptr buf, out;
	CUfunction sum_k;
	CUcontext ctx;
	CUmodule mod;
	CUstream s;

	(void)arg;
	alarm(30);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuDevicePrimaryCtxRetain(&ctx, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuCtxPushCurrent(ctx) == CUDA_SUCCESS);
	CHILD_CHECK(cuModuleLoadData(&mod, fake_ptx) == CUDA_SUCCESS);
	CHILD_CHECK(cuModuleGetFunction(&sum_k, mod, "dlpc_sum_u32") == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&buf, KWORDS * 4) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&out, 8) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&s, 0) == CUDA_SUCCESS);
	fake_cuda_stream_hold(s, 1);
	CHILD_CHECK(kernel_on(s, sum_k, buf, n, &out) == CUDA_SUCCESS);
	cuMemFree(buf); /* aborts */
	return 0;
}

START_TEST(fake_kernels)
{
	ck_assert_int_eq(wait_child(spawn(fake_kernel_rules, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(fake_kernel_freed, NULL)), 128 + SIGABRT);
}
END_TEST

/* ---- 18. several devices ---- */

/*
 * The fake has two devices here. Device 1's memory: a legacy IPC tensor of cuMemAlloc memory
 * made in its context, and a dlpc_alloc() VMM tensor, both published as cuda:1; the process
 * stays until told to go (legacy IPC needs it).
 */
struct dev1_publisher {
	int ready[2]; /* one byte once published */
	int quit[2];  /* closed by the parent to let it go */
};

static int publish_on_device_1(void *arg)
{
	struct dev1_publisher *p = arg;
	DLManagedTensorVersioned *v = NULL, *mix[2];
	dlpc_client *c = NULL;
	CUdeviceptr base;
	CUcontext ctx;
	int64_t n = NELEM;
	int dev = -1;
	char b;

	close(p->ready[0]);
	close(p->quit[1]);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuDevicePrimaryCtxRetain(&ctx, 1) == CUDA_SUCCESS);
	CHILD_CHECK(cuCtxPushCurrent(ctx) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&base, ALLOC_BYTES) == CUDA_SUCCESS);
	CHILD_CHECK(cuCtxPopCurrent(NULL) == CUDA_SUCCESS);
	CHILD_CHECK(cuPointerGetAttribute(&dev, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, base) ==
		    CUDA_SUCCESS);
	CHILD_CHECK(dev == 1);
	fill((float *)(uintptr_t)(base + OFF_A), NELEM, 5.0f);
	mix[0] = dev_tensor(base + OFF_A, NELEM, -1);
	mix[0]->dl_tensor.device.device_id = 1;
	CHILD_CHECK(dlpc_publish(c, "gpu/d1/ipc", mix[0], 0) == 1);
	CHILD_CHECK(dlpc_alloc(c, (DLDevice){kDLCUDA, 1}, (DLDataType){kDLFloat, 32, 1}, 1, &n,
			       &v) == 0);
	CHILD_CHECK(v->dl_tensor.device.device_id == 1);
	fill(v->dl_tensor.data, NELEM, 6.0f);
	CHILD_CHECK(dlpc_publish(c, "gpu/d1/vmm", v, 0) == 1);
	/* a bundle across the two devices is refused, naming both */
	mix[0] = dev_tensor(base + OFF_B, NELEM, -1);
	mix[0]->dl_tensor.device.device_id = 1;
	CHILD_CHECK(cuMemAlloc(&base, ALLOC_BYTES) == CUDA_SUCCESS); /* device 0 */
	mix[1] = dev_tensor(base, NELEM, -1);
	CHILD_CHECK(dlpc_publish_bundle(c, "gpu/d1/mixed", 2, (const char *const[]){"a", "b"}, mix,
					0) == -ENOTSUP);
	CHILD_CHECK(strstr(dlpc_last_error(), "device"));
	CHILD_CHECK(write(p->ready[1], "R", 1) == 1);
	if (read(p->quit[0], &b, 1) < 0)
		return 1;
	dlpc_close(c);
	return 0;
}

/* Attach both of device 1's tensors where it is local ordinal @p ordinal; -1: not seen here. */
static int attach_device_1(void *arg)
{
	int ordinal = *(int *)arg;
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	if (ordinal < 0) {
		CHILD_CHECK(dlpc_attach(c, "gpu/d1/ipc", NULL, &t) == -ENODEV && !t);
		CHILD_CHECK(strstr(dlpc_last_error(), "not visible in this process"));
		CHILD_CHECK(dlpc_attach(c, "gpu/d1/vmm", NULL, &t) == -ENODEV && !t);
		CHILD_CHECK(strstr(dlpc_last_error(), "not visible in this process"));
		dlpc_close(c);
		return 0;
	}
	CHILD_CHECK(dlpc_attach(c, "gpu/d1/ipc", NULL, &t) == 1);
	CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA);
	CHILD_CHECK(t->dl_tensor.device.device_id == ordinal);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, 5.0f));
	/* opened in the context of the device the memory lives on */
	CHILD_CHECK(log_count2(getpid(), "cuIpcOpenMemHandle", "dev=1 ctx-dev=1") == 1);
	t->deleter(t);
	CHILD_CHECK(dlpc_attach(c, "gpu/d1/vmm", NULL, &t) == 1);
	CHILD_CHECK(t->dl_tensor.device.device_id == ordinal);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, 6.0f));
	t->deleter(t);
	CHILD_CHECK(log_reaches(getpid(), "cuMemUnmap", 1));
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 1));
	dlpc_close(c);
	return 0;
}

/*
 * Releases waiting on two devices at once: the retiring thread blocks on neither device's event
 * (that would keep the other's release waiting for it), and it does not poll either: it looks
 * every DLPC_CUDA_RETIRE_FALLBACK_MS. A graph capture makes both wait for one look, which
 * records both events behind a held blocking stream.
 */
#define SPREAD_WAIT_MS 500
#define SPREAD_QUERIES_MAX (2 * (SPREAD_WAIT_MS / DLPC_CUDA_RETIRE_FALLBACK_MS + 2))

static int release_on_two_devices(void *arg)
{
	DLManagedTensorVersioned *t0 = NULL, *t1 = NULL;
	dlpc_client *c = NULL;
	CUstream cap, held;
	int q;

	(void)arg;
	alarm(30);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(dlpc_attach(c, "gpu/h", NULL, &t0) == 1);
	CHILD_CHECK(dlpc_attach(c, "gpu/d1/ipc", NULL, &t1) == 1);
	CHILD_CHECK(t0->dl_tensor.device.device_id == 0 && t1->dl_tensor.device.device_id == 1);
	CHILD_CHECK(cuStreamCreate(&cap, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate(&held, 0) == CUDA_SUCCESS);
	fake_cuda_stream_hold(held, 1);
	fake_cuda_capture(cap, 1);
	t0->deleter(t0);
	t1->deleter(t1);
	fake_cuda_capture(cap, 0);
	CHILD_CHECK(log_reaches(getpid(), "stream=0x1 behind-held-work", 2));
	CHILD_CHECK(log_appears(getpid(), "result=600")); /* cuEventQuery: not ready */
	q = log_count(getpid(), "cuEventQuery");
	usleep(SPREAD_WAIT_MS * 1000);
	CHILD_CHECK(log_count(getpid(), "cuEventQuery") - q <= SPREAD_QUERIES_MAX);
	CHILD_CHECK(log_count2(getpid(), "cuEventSynchronize", "blocking") == 0);
	CHILD_CHECK(log_count(getpid(), "cuIpcCloseMemHandle") == 0);
	fake_cuda_stream_hold(held, 0);
	CHILD_CHECK(log_reaches(getpid(), "cuIpcCloseMemHandle", 2));
	CHILD_CHECK(cuStreamDestroy(cap) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamDestroy(held) == CUDA_SUCCESS);
	dlpc_close(c);
	return 0;
}

START_TEST(several_devices)
{
	struct publisher dev0 = {.names = {"gpu/h", NULL}};
	struct dev1_publisher p;
	int same_order = 1, swapped = 0, unseen = -1;
	pid_t pub;
	char b;

	ck_assert_int_eq(setenv("FAKE_CUDA_DEVICES", "2", 1), 0);
	ck_assert_int_eq(pipe2(p.ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(p.quit, O_CLOEXEC), 0);
	pub = spawn(publish_on_device_1, &p);
	close(p.ready[1]);
	close(p.quit[0]);
	ck_assert_msg(read(p.ready[0], &b, 1) == 1, "the publisher failed before publishing");
	/* the same devices in the same order; device 1 as ordinal 0 (as CUDA_VISIBLE_DEVICES=1,0
	 * does); only device 0 visible: not here, and the attach says so */
	ck_assert_int_eq(wait_child(spawn(attach_device_1, &same_order)), 0);
	ck_assert_int_eq(setenv("FAKE_CUDA_VISIBLE", "1,0", 1), 0);
	ck_assert_int_eq(wait_child(spawn(attach_device_1, &swapped)), 0);
	ck_assert_int_eq(setenv("FAKE_CUDA_VISIBLE", "0", 1), 0);
	ck_assert_int_eq(wait_child(spawn(attach_device_1, &unseen)), 0);
	unsetenv("FAKE_CUDA_VISIBLE");
	publisher_start(&dev0);
	ck_assert_int_eq(wait_child(spawn(release_on_two_devices, NULL)), 0);
	publisher_stop(&dev0);
	unsetenv("FAKE_CUDA_DEVICES");
	close(p.quit[1]);
	close(p.ready[0]);
	ck_assert_int_eq(wait_child(pub), 0);
}
END_TEST

/* ---- 19. the publisher's work still running ---- */

struct slow {
	int ready[2]; /* the publisher: published; each consumer: about to wait */
	int go[2];    /* to the publisher: let the kernels run */
};

/*
 * Publish "gpu/slow" (legacy IPC) while the kernel that writes its data is still queued behind
 * a long one: the memory holds the old values (base 0) until the parent says go, and then the
 * new ones (base 4). The publish's event comes after both kernels.
 */
static int publish_before_the_kernel_ran(void *arg)
{
	struct slow *p = arg;
	float fours[NELEM];
	dlpc_client *c = NULL;
	CUdeviceptr base;
	CUstream s;
	char b;

	close(p->ready[0]);
	close(p->go[1]);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&base, ALLOC_BYTES) == CUDA_SUCCESS);
	fill((float *)(uintptr_t)(base + OFF_A), NELEM, 0.0f);
	CHILD_CHECK(cuStreamCreate(&s, 0) == CUDA_SUCCESS);
	fake_cuda_stream_hold(s, 1);
	fill(fours, NELEM, 4.0f);
	fake_cuda_write_later(s, (void *)(uintptr_t)(base + OFF_A), fours, sizeof(fours));
	CHILD_CHECK(dlpc_publish(c, "gpu/slow", pub_tensor(base + OFF_A, -1), 0) == 1);
	CHILD_CHECK(log_count2(getpid(), "cuEventRecord", "behind-held-work") == 1);
	CHILD_CHECK(write(p->ready[1], "R", 1) == 1);
	CHILD_CHECK(read(p->go[0], &b, 1) == 1);
	fake_cuda_stream_hold(s, 0);
	/* stays for the consumers (legacy IPC); the parent closes go when they are done */
	if (read(p->go[0], &b, 1) < 0)
		return 1;
	dlpc_close(c);
	return 0;
}

/* Without any wait a consumer reads what the publisher's kernel has not written yet: the fake
 * catches a missing wait. */
static int read_without_waiting(void *arg)
{
	dlpc_attach_opts o = {.size = sizeof(o), .flags = DLPC_ATTACH_DEFER_SYNC};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/slow", &o, &t) == 1);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, 0.0f));
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* On the host: dlpc_tensor_wait(t, NULL) returns once the publisher's kernel has run. */
static int wait_on_the_host(void *arg)
{
	struct slow *p = arg;
	dlpc_attach_opts o = {.size = sizeof(o), .flags = DLPC_ATTACH_DEFER_SYNC};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;

	alarm(30);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/slow", &o, &t) == 1);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, 0.0f));
	CHILD_CHECK(write(p->ready[1], "W", 1) == 1);
	CHILD_CHECK(dlpc_tensor_wait(t, NULL) == 0);
	CHILD_CHECK(same(t->dl_tensor.data, NELEM, 4.0f));
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* On a stream: the attach returns at once, and a kernel queued on the stream reads the new
 * values, once the publisher's have run. */
static int wait_on_a_stream(void *arg)
{
	struct slow *p = arg;
	dlpc_attach_opts o = {.size = sizeof(o)};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = NULL;
	float got[NELEM];
	CUcontext ctx;

	alarm(30);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamCreate((CUstream *)&o.stream, 0) == CUDA_SUCCESS);
	CHILD_CHECK(dlpc_attach(c, "gpu/slow", &o, &t) == 1);
	fill(got, NELEM, -100.0f);
	fake_cuda_read_later(o.stream, t->dl_tensor.data, got, sizeof(got));
	CHILD_CHECK(same(got, NELEM, -100.0f)); /* queued behind the publisher's event */
	CHILD_CHECK(write(p->ready[1], "S", 1) == 1);
	CHILD_CHECK(cuDevicePrimaryCtxRetain(&ctx, 0) == CUDA_SUCCESS);
	CHILD_CHECK(cuCtxPushCurrent(ctx) == CUDA_SUCCESS);
	CHILD_CHECK(cuStreamSynchronize(o.stream) == CUDA_SUCCESS);
	CHILD_CHECK(cuCtxPopCurrent(NULL) == CUDA_SUCCESS);
	CHILD_CHECK(same(got, NELEM, 4.0f));
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

START_TEST(wait_for_publisher_work)
{
	struct slow p;
	pid_t pub, host, stream;
	char b;

	ck_assert_int_eq(pipe2(p.ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(p.go, O_CLOEXEC), 0);
	pub = spawn(publish_before_the_kernel_ran, &p);
	ck_assert_msg(read(p.ready[0], &b, 1) == 1, "the publisher failed before publishing");
	ck_assert_int_eq(wait_child(spawn(read_without_waiting, NULL)), 0);
	host = spawn(wait_on_the_host, &p);
	stream = spawn(wait_on_a_stream, &p);
	for (int i = 0; i < 2; i++)
		ck_assert_msg(read(p.ready[0], &b, 1) == 1, "a consumer failed before waiting");
	/* both are waiting (or about to): the publisher's kernels run only now */
	usleep(scaled_ms(100) * 1000);
	ck_assert_int_eq(write(p.go[1], "G", 1), 1);
	ck_assert_int_eq(wait_child(host), 0);
	ck_assert_int_eq(wait_child(stream), 0);
	close(p.go[1]);
	close(p.ready[1]);
	close(p.ready[0]);
	close(p.go[0]);
	ck_assert_int_eq(wait_child(pub), 0);
}
END_TEST

static Suite *gpu_suite(void)
{
	Suite *s = suite_create("gpu");
	struct {
		const char *name;
		const TTest *test;
	} cases[] = {
		{"ipc_offset_attach", ipc_offset_attach},
		{"ipc_import_cache", ipc_import_cache},
		{"ipc_reclaim", ipc_reclaim_idle_publisher},
		{"ipc_reclaim_replace", ipc_reclaim_on_replace_unreferenced},
		{"ipc_close_while_a_deleter_waits", ipc_close_while_a_deleter_waits},
		{"ipc_publisher_killed", ipc_publisher_killed},
		{"ipc_lying_publisher", ipc_lying_publisher},
		{"reclaim_batches", reclaim_batches},
		{"vmm_outlives_publisher", vmm_outlives_publisher},
		{"stream_ordering", stream_ordering},
		{"no_driver", no_driver_errors},
		{"ipc_not_supported", ipc_not_supported},
		{"device_ordinals", device_ordinals},
		{"daemon_without_cuda", daemon_without_cuda},
		{"fork_child", fork_child},
		{"vmm_lent", vmm_lent},
		{"unexportable_memory", unexportable_memory},
		{"empty_cuda_tensor", empty_cuda_tensor},
		{"cuda_bundle", cuda_bundle},
		{"ipc_pid_namespace", ipc_pid_namespace},
		{"ipc_publish_unknown_outcome", ipc_publish_unknown_outcome},
		{"release_after_consumer_work", release_after_consumer_work},
		{"release_streams_free", release_streams_free},
		{"release_during_capture", release_during_capture},
		{"release_during_nonblocking_capture", release_during_nonblocking_capture},
		{"release_after_stream_destroyed", release_after_stream_destroyed_case},
		{"release_after_queued_reads", release_after_queued_reads},
		{"fake_streams", fake_streams},
		{"fake_kernels", fake_kernels},
		{"several_devices", several_devices},
		{"wait_for_publisher_work", wait_for_publisher_work},
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		TCase *tc = tcase_create(cases[i].name);

		tcase_add_checked_fixture(tc, setup, teardown);
		tcase_set_timeout(tc, 60);
		tcase_add_test(tc, cases[i].test);
		suite_add_tcase(s, tc);
	}
	return s;
}

int main(void)
{
	return run_suite(gpu_suite());
}
