/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The C half of the benchmarks: the physical floor (a minimal AF_UNIX server handing out one
 * memfd per request, written here), libdlpc attach/release across sizes, the shared read-only
 * mapping against the copy-on-write ones (attach alone and attach + a full read), publishing,
 * aggregate throughput with several client processes, and the daemon's footprint.
 *
 * Usage: bench_c --socket PATH [--quick] [--entries N] [--pin CPU] [--only GROUP,...]
 * GROUP is attach, mapping, bundle, publish, publish_small, throughput or footprint (default: all of them).
 * Prints one JSON object per line (see bench/run.py); progress goes to stderr.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <sched.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <dlpc/dlpc.h>

#define MAX_SIZES 8
#define MAX_CLIENTS 8

static const char *sock_path;
static const char *only;
static bool quick;
static int pin_cpu = -1;
static pid_t daemon_pid;
static size_t sizes[MAX_SIZES];
static int nsizes;

static void die(const char *what)
{
	fprintf(stderr, "bench_c: %s: %s (%s)\n", what, strerror(errno), dlpc_last_error());
	exit(1);
}

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

/* Print a latency row from @p n samples in ns; @p extra, if not NULL, is more JSON members. */
static void row_x(const char *group, const char *impl, long long size, uint64_t *ns, int n,
		  const char *extra)
{
	qsort(ns, (size_t)n, sizeof(*ns), cmp_u64);
	printf("{\"group\": \"%s\", \"impl\": \"%s\", \"size\": ", group, impl);
	if (size < 0)
		printf("null");
	else
		printf("%lld", size);
	printf(", \"median_us\": %.3f, \"p99_us\": %.3f, \"reps\": %d%s%s}\n", ns[n / 2] / 1e3,
	       ns[(size_t)((n - 1) * 0.99)] / 1e3, n, extra ? ", " : "", extra ? extra : "");
	fflush(stdout);
}

static void row(const char *group, const char *impl, long long size, uint64_t *ns, int n)
{
	row_x(group, impl, size, ns, n, NULL);
}

/* Whether the benchmark group @p name is to run (--only). */
static bool wanted(const char *name)
{
	size_t len = strlen(name);

	if (!only)
		return true;
	for (const char *p = only; (p = strstr(p, name)); p += len)
		if ((p == only || p[-1] == ',') && (p[len] == ',' || p[len] == '\0'))
			return true;
	return false;
}

/* How many repetitions for one measurement: bounded by count and by time. */
static int reps_for(size_t size)
{
	if (quick)
		return size > (1 << 20) ? 10 : 100;
	return size >= (256u << 20) ? 50 : size >= (16u << 20) ? 500 : 3000;
}

/*
 * The floor's memory holds written data, like a published tensor. Pages that were only
 * fallocated are not up to date, and a read fault maps them one at a time; written pages are
 * mapped up to 16 at a time around the faulting address (fault-around), which costs more.
 */
static int memfd_of(size_t size)
{
	static char chunk[1 << 16];
	int fd = memfd_create("bench-floor", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	if (fd < 0 || ftruncate(fd, (off_t)size) < 0)
		die("floor memfd");
	memset(chunk, 1, sizeof(chunk));
	for (size_t off = 0; off < size; off += sizeof(chunk)) {
		size_t n = size - off < sizeof(chunk) ? size - off : sizeof(chunk);

		if (pwrite(fd, chunk, n, (off_t)off) != (ssize_t)n)
			die("floor memfd write");
	}
	return fd;
}

/* ---- the floor: one request byte in, one byte and one fd out, over AF_UNIX ---- */

static void floor_serve(int lfd, const int *fds)
{
	struct pollfd pf[MAX_CLIENTS + 1] = {{.fd = lfd, .events = POLLIN}};
	int n = 1;

	for (;;) {
		if (poll(pf, (nfds_t)n, -1) < 0)
			continue;
		if ((pf[0].revents & POLLIN) && n < MAX_CLIENTS + 1) {
			int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);

			if (c >= 0)
				pf[n++] = (struct pollfd){.fd = c, .events = POLLIN};
		}
		for (int i = 1; i < n; i++) {
			union {
				struct cmsghdr a;
				char b[CMSG_SPACE(sizeof(int))];
			} ctl;
			uint8_t idx;
			struct iovec iov = {.iov_base = &idx, .iov_len = 1};
			struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
			struct cmsghdr *cm;

			if (!(pf[i].revents & (POLLIN | POLLHUP)))
				continue;
			if (read(pf[i].fd, &idx, 1) != 1 || idx >= MAX_SIZES) {
				close(pf[i].fd);
				pf[i--] = pf[--n];
				continue;
			}
			msg.msg_control = ctl.b;
			msg.msg_controllen = sizeof(ctl.b);
			cm = CMSG_FIRSTHDR(&msg);
			cm->cmsg_level = SOL_SOCKET;
			cm->cmsg_type = SCM_RIGHTS;
			cm->cmsg_len = CMSG_LEN(sizeof(int));
			memcpy(CMSG_DATA(cm), &fds[idx], sizeof(int));
			if (sendmsg(pf[i].fd, &msg, MSG_NOSIGNAL) != 1) {
				close(pf[i].fd);
				pf[i--] = pf[--n];
			}
		}
	}
}

static pid_t floor_start(const char *path)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fds[MAX_SIZES], lfd;
	pid_t pid;

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	unlink(path);
	lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(lfd, 64) < 0)
		die("floor listen");
	pid = fork();
	if (pid == 0) {
		for (int i = 0; i < nsizes; i++)
			fds[i] = memfd_of(sizes[i]);
		floor_serve(lfd, fds);
		_exit(0);
	}
	close(lfd);
	return pid;
}

static int floor_connect(const char *path)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	for (int i = 0; i < 500; i++) {
		if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0)
			return fd;
		usleep(2000);
	}
	die("floor connect");
	return -1;
}

/* One floor round trip: ask, receive the fd, map, read a byte, unmap, close. */
static void floor_once(int fd, int idx, size_t size, volatile uint8_t *sink)
{
	union {
		struct cmsghdr a;
		char b[CMSG_SPACE(sizeof(int))];
	} ctl;
	uint8_t req = (uint8_t)idx, byte;
	struct iovec iov = {.iov_base = &byte, .iov_len = 1};
	struct msghdr msg = {.msg_iov = &iov,
			     .msg_iovlen = 1,
			     .msg_control = ctl.b,
			     .msg_controllen = sizeof(ctl.b)};
	int mfd;
	void *p;

	if (write(fd, &req, 1) != 1 || recvmsg(fd, &msg, MSG_CMSG_CLOEXEC) != 1)
		die("floor round trip");
	memcpy(&mfd, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof(int));
	p = mmap(NULL, size, PROT_READ, MAP_SHARED, mfd, 0);
	if (p == MAP_FAILED)
		die("floor mmap");
	*sink = *(const uint8_t *)p;
	munmap(p, size);
	close(mfd);
}

/* ---- libdlpc ---- */

/* A client with @p flags: DLPC_CONNECT_NO_CACHE for every group that measures the round trip
 * (the cache would answer their re-attaches of one name), 0 for the cache's own rows. */
static dlpc_client *connect_flags_or_die(uint32_t flags)
{
	dlpc_client *c;

	if (dlpc_connect_flags(sock_path, flags, &c) < 0)
		die("dlpc_connect");
	return c;
}

static dlpc_client *connect_or_die(void)
{
	return connect_flags_or_die(DLPC_CONNECT_NO_CACHE);
}

static void publish_size(dlpc_client *c, const char *name, size_t size)
{
	int64_t shape[1] = {(int64_t)(size / 4)};
	DLManagedTensorVersioned *t;

	/* allocated in shared memory and published as is: setup cost stays out of the way */
	if (dlpc_alloc(c, (DLDevice){kDLCPU, 0}, (DLDataType){kDLFloat, 32, 1}, 1, shape, &t) < 0)
		die("dlpc_alloc");
	memset(t->dl_tensor.data, 1, size);
	if (dlpc_publish(c, name, t, DLPC_PUBLISH_REPLACE) < 0)
		die("dlpc_publish");
}

static void dlpc_once(dlpc_client *c, const char *name, volatile uint8_t *sink)
{
	DLManagedTensorVersioned *t;

	if (dlpc_attach(c, name, NULL, &t) < 0)
		die("dlpc_attach");
	*sink = *(const uint8_t *)t->dl_tensor.data;
	t->deleter(t);
}

static void bench_attach(void)
{
	char floor_path[256], name[64];
	volatile uint8_t sink;
	dlpc_client *c = connect_or_die();
	uint64_t *ns;
	pid_t fpid;
	int ffd, n;

	snprintf(floor_path, sizeof(floor_path), "%s.floor", sock_path);
	fpid = floor_start(floor_path);
	ffd = floor_connect(floor_path);
	ns = malloc(sizeof(*ns) * 5000);
	for (int i = 0; i < nsizes; i++) {
		snprintf(name, sizeof(name), "bench/attach/%zu", sizes[i]);
		publish_size(c, name, sizes[i]);
		n = reps_for(sizes[i]);
		fprintf(stderr, "attach %zu bytes x %d\n", sizes[i], n);
		/* interleave the two so that drift on the machine hits both alike */
		for (int w = 0; w < 5; w++) {
			floor_once(ffd, i, sizes[i], &sink);
			dlpc_once(c, name, &sink);
		}
		uint64_t *fl = malloc(sizeof(*fl) * (size_t)n);

		for (int r = 0; r < n; r++) {
			uint64_t t0 = now_ns();

			floor_once(ffd, i, sizes[i], &sink);
			fl[r] = now_ns() - t0;
			t0 = now_ns();
			dlpc_once(c, name, &sink);
			ns[r] = now_ns() - t0;
		}
		row("attach_c", "floor", (long long)sizes[i], fl, n);
		row("attach_c", "dlpc", (long long)sizes[i], ns, n);
		free(fl);
		if (dlpc_unpublish(c, name) < 0)
			die("dlpc_unpublish");
	}
	free(ns);
	close(ffd);
	kill(fpid, SIGKILL);
	waitpid(fpid, NULL, 0);
	unlink(floor_path);
	dlpc_close(c);
}

/*
 * Warm re-attach: attach + first byte + release of an unchanged entry by a client whose cache
 * holds it (no round trip: the socket is read without waiting, the mapping handed out again),
 * next to the same on a client without the cache, interleaved.
 */
static void bench_reattach(void)
{
	dlpc_client *c = connect_or_die(), *cached = connect_flags_or_die(0);
	volatile uint8_t sink;
	uint64_t *ns, *rt;
	char name[64];
	int n;

	for (int i = 0; i < nsizes; i++) {
		dlpc_stats s0 = {.size = sizeof(s0)}, s1 = {.size = sizeof(s1)};

		snprintf(name, sizeof(name), "bench/reattach/%zu", sizes[i]);
		publish_size(c, name, sizes[i]);
		n = quick ? 200 : 5000;
		ns = malloc(sizeof(*ns) * (size_t)n);
		rt = malloc(sizeof(*rt) * (size_t)n);
		if (!ns || !rt)
			die("malloc");
		fprintf(stderr, "reattach %zu bytes x %d\n", sizes[i], n);
		for (int w = 0; w < 5; w++) {
			dlpc_once(cached, name, &sink);
			dlpc_once(c, name, &sink);
		}
		if (dlpc_stat(c, &s0) < 0)
			die("dlpc_stat");
		for (int r = 0; r < n; r++) {
			uint64_t t0 = now_ns();

			dlpc_once(cached, name, &sink);
			ns[r] = now_ns() - t0;
			t0 = now_ns();
			dlpc_once(c, name, &sink);
			rt[r] = now_ns() - t0;
		}
		if (dlpc_stat(c, &s1) < 0)
			die("dlpc_stat");
		/* every round trip is the uncached client's: the cache answered all of its own */
		if (s1.req_attach - s0.req_attach != (uint64_t)n)
			fprintf(stderr, "reattach: %llu ATTACH requests for %d uncached attaches\n",
				(unsigned long long)(s1.req_attach - s0.req_attach), n);
		row("reattach_c", "dlpc_cached", (long long)sizes[i], ns, n);
		row("reattach_c", "dlpc", (long long)sizes[i], rt, n);
		free(ns);
		free(rt);
		if (dlpc_unpublish(c, name) < 0)
			die("dlpc_unpublish");
	}
	dlpc_close(cached);
	dlpc_close(c);
}

/* Wait for the daemon to finish closing (freeing) what was unpublished: its closer threads
 * share our CPU when pinned. */
static void settle(dlpc_client *c)
{
	dlpc_stats s = {.size = sizeof(s)};

	for (int i = 0; i < 5000; i++) {
		if (dlpc_stat(c, &s) < 0)
			die("dlpc_stat");
		if (s.fds_closing == 0)
			return;
		usleep(1000);
	}
}

/* ---- the shared read-only mapping against the copy-on-write ones ---- */

static const struct {
	const char *impl;
	uint32_t flags;
} mappings[] = {
	{"shared", 0}, /* the default: MAP_SHARED, PROT_READ */
	{"private", DLPC_ATTACH_PRIVATE},
	{"guarded", DLPC_ATTACH_GUARDED},
};
#define NMAPPINGS (int)(sizeof(mappings) / sizeof(mappings[0]))

/*
 * The full read: one 8-byte load per 64-byte cache line, summed. Every line of the tensor comes
 * through the cache and every page is faulted in, as a consumer reading all of it would.
 */
static uint64_t read_all(const uint8_t *p, size_t size)
{
	uint64_t sum = 0, w;

	for (size_t off = 0; off + sizeof(w) <= size; off += 64) {
		memcpy(&w, p + off, sizeof(w));
		sum += w;
	}
	return sum;
}

/* Attach with @p flags, read the first byte (@p full: every cache line), release. */
static void mapping_once(dlpc_client *c, const char *name, uint32_t flags, size_t size, bool full,
			 volatile uint64_t *sink)
{
	dlpc_attach_opts o = {.size = sizeof(o), .flags = flags};
	DLManagedTensorVersioned *t;
	const uint8_t *p;

	if (dlpc_attach(c, name, &o, &t) < 0)
		die("dlpc_attach");
	p = (const uint8_t *)t->dl_tensor.data + t->dl_tensor.byte_offset;
	*sink = full ? read_all(p, size) : *p;
	t->deleter(t);
}

static long minor_faults(void)
{
	struct rusage ru;

	getrusage(RUSAGE_SELF, &ru);
	return ru.ru_minflt;
}

static int mapping_reps(size_t size, bool full)
{
	if (!full)
		return reps_for(size);
	if (quick)
		return size > (64u << 10) ? 20 : 100;
	if (size >= (256u << 20))
		return 15;
	if (size >= (16u << 20))
		return 40;
	return size >= (1u << 20) ? 300 : 3000;
}

/*
 * Every mapping in turn, @p full read or first byte only, rotating which goes first so that what
 * one leaves in the caches favours none. Rows carry the minor page faults per attach.
 */
static void mapping_measure(dlpc_client *c, const char *name, size_t size, bool full)
{
	int n = mapping_reps(size, full);
	uint64_t *ns[NMAPPINGS];
	long flt[NMAPPINGS] = {0};
	volatile uint64_t sink;
	char extra[64];

	fprintf(stderr, "mapping %zu bytes, %s x %d\n", size, full ? "full read" : "first byte", n);
	for (int k = 0; k < NMAPPINGS; k++) {
		ns[k] = malloc(sizeof(*ns[k]) * (size_t)n);
		if (!ns[k])
			die("malloc");
	}
	for (int r = -2; r < n; r++) {
		for (int j = 0; j < NMAPPINGS; j++) {
			int k = (r + 2 + j) % NMAPPINGS;
			long f0 = minor_faults();
			uint64_t t0 = now_ns();

			mapping_once(c, name, mappings[k].flags, size, full, &sink);
			if (r < 0)
				continue;
			ns[k][r] = now_ns() - t0;
			flt[k] += minor_faults() - f0;
		}
	}
	for (int k = 0; k < NMAPPINGS; k++) {
		snprintf(extra, sizeof(extra), "\"minflt\": %.1f", (double)flt[k] / n);
		row_x(full ? "mapping_read" : "mapping_attach", mappings[k].impl, (long long)size,
		      ns[k], n, extra);
		free(ns[k]);
	}
}

/* Attach + release, and attach + a full read + release, shared against copy-on-write. */
static void bench_mapping(void)
{
	static const size_t all[] = {4096, 1u << 20, 64u << 20, 1u << 30};
	dlpc_client *c = connect_or_die();
	size_t n = quick ? 2 : sizeof(all) / sizeof(all[0]);
	char name[64];

	for (size_t i = 0; i < n; i++) {
		snprintf(name, sizeof(name), "bench/mapping/%zu", all[i]);
		publish_size(c, name, all[i]);
		mapping_measure(c, name, all[i], false);
		mapping_measure(c, name, all[i], true);
		if (dlpc_unpublish(c, name) < 0)
			die("dlpc_unpublish");
		settle(c);
	}
	dlpc_close(c);
}

/* ---- a bundle of BUNDLE_N tensors in one attach, against one single attach ---- */

#define BUNDLE_N 500
#define BUNDLE_ELEMS 256 /* float32 each, as in the Python harness */

static void bench_bundle(void)
{
	static float data[BUNDLE_N][BUNDLE_ELEMS];
	DLManagedTensorVersioned *ts[BUNDLE_N];
	char keys[BUNDLE_N][8];
	const char *kp[BUNDLE_N];
	int64_t shape[1] = {BUNDLE_ELEMS};
	int n = quick ? 200 : 2000;
	uint64_t *bns = malloc(sizeof(*bns) * (size_t)n), *sns = malloc(sizeof(*sns) * (size_t)n);
	dlpc_client *c = connect_or_die();
	volatile uint8_t sink;

	for (int i = 0; i < BUNDLE_N; i++) {
		for (int j = 0; j < BUNDLE_ELEMS; j++)
			data[i][j] = (float)i;
		snprintf(keys[i], sizeof(keys[i]), "t%03d", i);
		kp[i] = keys[i];
	}
	for (int i = 0; i < BUNDLE_N; i++) {
		/* no deleter: the publishes below copy and leave these alone */
		static DLManagedTensorVersioned m[BUNDLE_N];

		m[i] = (DLManagedTensorVersioned){
			.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION},
			.dl_tensor = {.data = data[i],
				      .device = {kDLCPU, 0},
				      .ndim = 1,
				      .dtype = {kDLFloat, 32, 1},
				      .shape = shape}};
		ts[i] = &m[i];
	}
	if (dlpc_publish_bundle(c, "bench/bundle", BUNDLE_N, kp, ts, DLPC_PUBLISH_REPLACE) < 0)
		die("dlpc_publish_bundle");
	if (dlpc_publish(c, "bench/bundle1", ts[0], DLPC_PUBLISH_REPLACE) < 0)
		die("dlpc_publish");
	fprintf(stderr, "bundle of %d x %d\n", BUNDLE_N, n);
	for (int r = -5; r < n; r++) {
		uint64_t t0 = now_ns();
		dlpc_bundle *b;

		if (dlpc_attach_bundle(c, "bench/bundle", NULL, &b) < 0)
			die("dlpc_attach_bundle");
		/* every tensor handed out and released; one byte read, as in the single attach */
		for (int i = 0; i < BUNDLE_N; i++) {
			DLManagedTensorVersioned *t = dlpc_bundle_take(b, (size_t)i);

			if (i == 0)
				sink = *(const uint8_t *)t->dl_tensor.data;
			t->deleter(t);
		}
		dlpc_bundle_free(b);
		if (r >= 0)
			bns[r] = now_ns() - t0;
		t0 = now_ns();
		dlpc_once(c, "bench/bundle1", &sink);
		if (r >= 0)
			sns[r] = now_ns() - t0;
	}
	row("bundle_c", "attach_bundle", -1, bns, n);
	row("bundle_c", "single_x1", -1, sns, n);
	dlpc_unpublish(c, "bench/bundle");
	dlpc_unpublish(c, "bench/bundle1");
	free(bns);
	free(sns);
	dlpc_close(c);
}

/*
 * Publishing and unpublishing a 4 KiB tensor (copy path) under fresh names: the cost of a
 * publish itself, which the fd store adds to (run.py runs this against a daemon with a store
 * too). Unpublishes are timed apart from publishes, each waiting for nothing.
 */
static void bench_publish_small(void)
{
	static float data[1024];
	int64_t shape[1] = {1024};
	int n = quick ? 200 : 3000;
	uint64_t *pub = calloc((size_t)n, sizeof(*pub)), *unp = calloc((size_t)n, sizeof(*unp));
	dlpc_client *c = connect_or_die();
	char name[64];

	if (!pub || !unp)
		die("calloc");
	for (int r = 0; r < n; r++) {
		DLManagedTensorVersioned t = {
			.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION},
			.dl_tensor = {.data = data,
				      .device = {kDLCPU, 0},
				      .ndim = 1,
				      .dtype = {kDLFloat, 32, 1},
				      .shape = shape},
		};
		uint64_t t0;

		snprintf(name, sizeof(name), "bench/small/%d", r);
		t0 = now_ns();
		if (dlpc_publish(c, name, &t, 0) < 0)
			die("publish small");
		pub[r] = now_ns() - t0;
		t0 = now_ns();
		if (dlpc_unpublish(c, name) < 0)
			die("unpublish small");
		unp[r] = now_ns() - t0;
	}
	row("publish_small", "publish", 4096, pub, n);
	row("publish_small", "unpublish", 4096, unp, n);
	free(pub);
	free(unp);
	settle(c);
	dlpc_close(c);
}

/*
 * One round of a recycled channel buffer (issue 17): take @p size bytes from the pool of
 * @p c (dlpc_channel_alloc), fill them from @p src, send: the time of that. Then @p rc
 * receives and releases the message, and @p c reads the RECLAIM that gives the buffer back.
 */
static uint64_t pool_round(dlpc_client *c, dlpc_client *rc, const char *src, size_t size,
			   const int64_t *shape)
{
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	dlpc_stats st = {.size = sizeof(st)};
	DLManagedTensorVersioned *t;
	uint64_t t0 = now_ns(), ns;

	if (dlpc_channel_alloc(c, "bench/pool", (DLDataType){kDLFloat, 32, 1}, 1, shape, &t) < 0)
		die("dlpc_channel_alloc");
	memcpy(t->dl_tensor.data, src, size);
	if (dlpc_send(c, "bench/pool", t, 0) < 0)
		die("dlpc_send pooled");
	ns = now_ns() - t0;
	if (dlpc_recv(rc, "bench/pool", &now, &t) < 0)
		die("dlpc_recv");
	t->deleter(t);
	/* the release goes out with this request; the RECLAIM follows on the daemon's next turn */
	dlpc_stat(rc, &st);
	usleep(2000);
	dlpc_stat(c, &st);
	return ns;
}

/*
 * Publishing 1 GiB (64 MiB with --quick): one memcpy, the copy path, the zero-copy path of memory
 * as dlpc_alloc() returns it, and of memory filled first (every page mapped in the publisher,
 * whose read-only publish then replaces that mapping); and a fill of a recycled channel buffer
 * and its send (dlpc_channel_alloc), whose pages were used before, like a warm memcpy's.
 */
static void bench_publish(void)
{
	size_t size = quick ? (64u << 20) : (1u << 30);
	int64_t shape[1] = {(int64_t)(size / 4)};
	int n = quick ? 3 : 7;
	uint64_t mc[16], mf[16], cp[16], zc[16], zw[16], pl[16];
	dlpc_client *c = connect_or_die(), *rc = connect_or_die();
	char *src = malloc(size), *dst = malloc(size);

	if (!src || !dst)
		die("malloc");
	memset(src, 3, size);
	memset(dst, 0, size); /* fault both in: the floor is a warm memcpy */
	fprintf(stderr, "publish %zu bytes x %d\n", size, n);
	if (dlpc_channel_open(c, "bench/pool", 1, NULL) < 0)
		die("dlpc_channel_open");
	pool_round(c, rc, src, size, shape); /* the pool's first buffer: fresh pages, untimed */
	for (int r = 0; r < n; r++) {
		DLManagedTensorVersioned src_t = {
			.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION},
			.dl_tensor = {.data = src,
				      .device = {kDLCPU, 0},
				      .ndim = 1,
				      .dtype = {kDLFloat, 32, 1},
				      .shape = shape},
		};
		DLManagedTensorVersioned *a;
		uint64_t t0 = now_ns();

		memcpy(dst, src, size);
		mc[r] = now_ns() - t0;
		/* publishing must write into memory nobody used before: the kernel hands out (and
		 * zeroes) fresh pages, which a warm memcpy does not pay for */
		char *fresh = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
				   -1, 0);

		if (fresh == MAP_FAILED)
			die("mmap");
		t0 = now_ns();
		memcpy(fresh, src, size);
		mf[r] = now_ns() - t0;
		munmap(fresh, size);
		/* fresh names, unpublished outside the timed part: replacing would free the previous
		 * storage on the daemon's reaper while the next publish is being timed */
		t0 = now_ns();
		if (dlpc_publish(c, "bench/publish/copy", &src_t, 0) < 0)
			die("publish copy");
		cp[r] = now_ns() - t0;
		if (dlpc_alloc(c, (DLDevice){kDLCPU, 0}, (DLDataType){kDLFloat, 32, 1}, 1, shape,
			       &a) < 0)
			die("dlpc_alloc");
		t0 = now_ns();
		if (dlpc_publish(c, "bench/publish/zero", a, 0) < 0)
			die("publish zero-copy");
		zc[r] = now_ns() - t0;
		if (dlpc_alloc(c, (DLDevice){kDLCPU, 0}, (DLDataType){kDLFloat, 32, 1}, 1, shape,
			       &a) < 0)
			die("dlpc_alloc");
		memset(a->dl_tensor.data, 4, size);
		t0 = now_ns();
		if (dlpc_publish(c, "bench/publish/written", a, 0) < 0)
			die("publish zero-copy, written");
		zw[r] = now_ns() - t0;
		dlpc_unpublish(c, "bench/publish/copy");
		dlpc_unpublish(c, "bench/publish/zero");
		dlpc_unpublish(c, "bench/publish/written");
		settle(c);
		pl[r] = pool_round(c, rc, src, size, shape);
	}
	row("publish", "memcpy", (long long)size, mc, n);
	row("publish", "memcpy_fresh", (long long)size, mf, n);
	row("publish", "dlpc_copy", (long long)size, cp, n);
	row("publish", "dlpc_alloc", (long long)size, zc, n);
	row("publish", "dlpc_alloc_written", (long long)size, zw, n);
	row("publish", "dlpc_pool", (long long)size, pl, n);
	dlpc_channel_remove(c, "bench/pool");
	free(src);
	free(dst);
	dlpc_close(rc);
	dlpc_close(c);
}

/*
 * Latency is measured with this process (and the floor server it forks) and the daemon on one
 * CPU: on a small VM a round trip costs twice as much when the scheduler happens to put the two
 * ends on different CPUs, and it picks differently from run to run. Throughput uses them all.
 */
static void pin(bool on)
{
	cpu_set_t set;

	if (pin_cpu < 0)
		return;
	CPU_ZERO(&set);
	if (on) {
		CPU_SET(pin_cpu, &set);
	} else {
		for (int i = 0; i < CPU_SETSIZE; i++)
			CPU_SET(i, &set);
	}
	if (sched_setaffinity(0, sizeof(set), &set) < 0 ||
	    (daemon_pid && sched_setaffinity(daemon_pid, sizeof(set), &set) < 0))
		fprintf(stderr, "bench_c: cannot set CPU affinity: %s\n", strerror(errno));
}

/* ---- throughput: N processes attaching and releasing for a while ---- */

static void throughput(const char *impl, int clients, double secs, const char *floor_path,
		       uint32_t flags)
{
	int pipes[MAX_CLIENTS][2];
	pid_t pids[MAX_CLIENTS];
	uint64_t total = 0;

	for (int k = 0; k < clients; k++) {
		if (pipe(pipes[k]) < 0)
			die("pipe");
		pids[k] = fork();
		if (pids[k] == 0) {
			volatile uint8_t sink;
			uint64_t ops = 0, end;
			dlpc_client *c = floor_path ? NULL : connect_flags_or_die(flags);
			int ffd = floor_path ? floor_connect(floor_path) : -1;

			end = now_ns() + (uint64_t)(secs * 1e9);
			while (now_ns() < end) {
				for (int j = 0; j < 64; j++) {
					if (floor_path)
						floor_once(ffd, 0, sizes[0], &sink);
					else
						dlpc_once(c, "bench/throughput", &sink);
				}
				ops += 64;
			}
			if (write(pipes[k][1], &ops, sizeof(ops)) != sizeof(ops))
				_exit(1);
			_exit(0);
		}
		close(pipes[k][1]);
	}
	for (int k = 0; k < clients; k++) {
		uint64_t ops = 0;

		if (read(pipes[k][0], &ops, sizeof(ops)) != sizeof(ops))
			die("throughput child");
		close(pipes[k][0]);
		waitpid(pids[k], NULL, 0);
		total += ops;
	}
	printf("{\"group\": \"throughput\", \"impl\": \"%s\", \"size\": %zu, \"clients\": %d, "
	       "\"ops_per_s\": %.1f}\n",
	       impl, sizes[0], clients, (double)total / secs);
	fflush(stdout);
}

static void bench_throughput(void)
{
	static const int counts[] = {1, 2, 4, 8};
	double secs = quick ? 0.3 : 2.0;
	char floor_path[256];
	dlpc_client *c = connect_or_die();
	pid_t fpid;

	snprintf(floor_path, sizeof(floor_path), "%s.floor", sock_path);
	fpid = floor_start(floor_path);
	publish_size(c, "bench/throughput", sizes[0]);
	for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
		fprintf(stderr, "throughput with %d clients\n", counts[i]);
		throughput("floor", counts[i], secs, floor_path, 0);
		throughput("dlpc", counts[i], secs, NULL, DLPC_CONNECT_NO_CACHE);
		throughput("dlpc_cached", counts[i], secs, NULL, 0);
	}
	kill(fpid, SIGKILL);
	waitpid(fpid, NULL, 0);
	unlink(floor_path);
	dlpc_unpublish(c, "bench/throughput");
	dlpc_close(c);
}

/* ---- footprint: the daemon's RSS idle and with many entries, and LIST time ---- */

static long rss_kib(pid_t pid)
{
	char path[64], line[256];
	long kib = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	f = fopen(path, "r");
	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
			break;
	if (f)
		fclose(f);
	return kib;
}

static void metric(const char *name, double value, const char *unit)
{
	printf("{\"group\": \"footprint\", \"metric\": \"%s\", \"value\": %.3f, \"unit\": "
	       "\"%s\"}\n",
	       name, value, unit);
	fflush(stdout);
}

static void bench_footprint(int entries)
{
	dlpc_client *c = connect_or_die();
	dlpc_stats s = {.size = sizeof(s)};
	int64_t shape[1] = {16};
	float data[16] = {0};
	dlpc_entry_info *list;
	uint64_t ns[5];
	size_t n;
	char name[64];
	long idle;

	if (dlpc_stat(c, &s) < 0)
		die("dlpc_stat");
	idle = rss_kib((pid_t)s.daemon_pid);
	metric("idle_rss", idle / 1024.0, "MiB");
	fprintf(stderr, "footprint: publishing %d entries\n", entries);
	for (int i = 0; i < entries; i++) {
		DLManagedTensorVersioned t = {
			.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION},
			.dl_tensor = {.data = data,
				      .device = {kDLCPU, 0},
				      .ndim = 1,
				      .dtype = {kDLFloat, 32, 1},
				      .shape = shape},
		};

		snprintf(name, sizeof(name), "bench/many/%07d", i);
		if (dlpc_publish(c, name, &t, 0) < 0)
			die("publish many");
	}
	metric("entries", entries, "count");
	metric("rss_per_entry", (rss_kib((pid_t)s.daemon_pid) - idle) * 1024.0 / entries, "bytes");
	for (int r = 0; r < 5; r++) {
		uint64_t t0 = now_ns();

		if (dlpc_list(c, "bench/many/", &list, &n) < 0 || (int)n != entries)
			die("list many");
		ns[r] = now_ns() - t0;
		dlpc_list_free(list, n);
	}
	qsort(ns, 5, sizeof(ns[0]), cmp_u64);
	metric("list_ms", ns[2] / 1e6, "ms");
	for (int i = 0; i < entries; i++) {
		snprintf(name, sizeof(name), "bench/many/%07d", i);
		dlpc_unpublish(c, name);
	}
	dlpc_close(c);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{"socket", required_argument, NULL, 's'},
		{"quick", no_argument, NULL, 'q'},
		{"entries", required_argument, NULL, 'e'},
		{"pin", required_argument, NULL, 'p'},
		{"only", required_argument, NULL, 'o'}, /* comma-separated groups */
		{0},
	};
	static const size_t all[] = {4096, 65536, 1 << 20, 16 << 20, 256 << 20, 1u << 30};
	int c, entries = -1;

	while ((c = getopt_long(argc, argv, "s:qe:p:o:", opts, NULL)) != -1) {
		switch (c) {
		case 's':
			sock_path = optarg;
			break;
		case 'q':
			quick = true;
			break;
		case 'e':
			entries = atoi(optarg);
			break;
		case 'p':
			pin_cpu = atoi(optarg);
			break;
		case 'o':
			only = optarg;
			break;
		default:
			fprintf(stderr, "usage: bench_c --socket PATH [--quick] [--entries N] "
					"[--pin CPU] [--only GROUP,...]\n");
			return 2;
		}
	}
	if (!sock_path) {
		fprintf(stderr, "bench_c: --socket is required\n");
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	if (quick) {
		sizes[nsizes++] = 4096;
		sizes[nsizes++] = 1 << 20;
	} else {
		for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
			sizes[nsizes++] = all[i];
	}
	if (pin_cpu >= 0) {
		dlpc_client *cl = connect_or_die();
		dlpc_stats s = {.size = sizeof(s)};

		if (dlpc_stat(cl, &s) < 0)
			die("dlpc_stat");
		daemon_pid = (pid_t)s.daemon_pid;
		dlpc_close(cl);
	}
	pin(true);
	if (wanted("attach"))
		bench_attach();
	if (wanted("reattach"))
		bench_reattach();
	if (wanted("mapping"))
		bench_mapping();
	if (wanted("bundle"))
		bench_bundle();
	if (wanted("publish")) {
		/* 1 GiB copies: a throughput, which libdlpc spreads over the CPUs the caller may
		 * use (as the warm memcpy floor does not) */
		pin(false);
		bench_publish();
		pin(true);
	}
	if (wanted("publish_small"))
		bench_publish_small();
	pin(false);
	if (wanted("throughput"))
		bench_throughput();
	if (wanted("footprint"))
		bench_footprint(entries > 0 ? entries : quick ? 1000 : 100000);
	return 0;
}
