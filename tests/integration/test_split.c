/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The copy path's copy split over threads (client/split.c): how many threads a copy gets, that
 * each part lands where it belongs whatever the runs' boundaries, that a part whose pages cannot
 * be allocated fails the copy with every thread joined, and a bundle with a strided tensor
 * published through a warm memfd's mapping read back whole by another process.
 */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <stddef.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "limits.h"
#include "region.h"

#define MIB (1u << 20)

static struct daemon D;

static void setup(void)
{
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

/* The CPUs this thread may run on. */
static unsigned cpus(void)
{
	cpu_set_t set;

	ck_assert_int_eq(sched_getaffinity(0, sizeof(set), &set), 0);
	return (unsigned)CPU_COUNT(&set);
}

static unsigned min3(unsigned a, unsigned b, unsigned c)
{
	unsigned m = a < b ? a : b;

	return m < c ? m : c;
}

/* One thread per DLPC__SPLIT_MIN bytes, within DLPC__SPLIT_THREADS_MAX, the CPUs and
 * $DLPC_COPY_THREADS; a value that is not a number is ignored. */
START_TEST(test_split_threads)
{
	uint64_t big = (uint64_t)DLPC__SPLIT_MIN * (DLPC__SPLIT_THREADS_MAX + 3);
	unsigned n = cpus();
	cpu_set_t one, all;

	unsetenv(DLPC_COPY_THREADS_ENV);
	ck_assert_uint_eq(dlpc__split_threads(0), 1);
	ck_assert_uint_eq(dlpc__split_threads(2ull * DLPC__SPLIT_MIN - 1), 1);
	ck_assert_uint_eq(dlpc__split_threads(2ull * DLPC__SPLIT_MIN), min3(2, n, 99));
	ck_assert_uint_eq(dlpc__split_threads(big), min3(DLPC__SPLIT_THREADS_MAX, n, 99));
	setenv(DLPC_COPY_THREADS_ENV, "1", 1);
	ck_assert_uint_eq(dlpc__split_threads(big), 1);
	setenv(DLPC_COPY_THREADS_ENV, "0", 1);
	ck_assert_uint_eq(dlpc__split_threads(big), 1);
	setenv(DLPC_COPY_THREADS_ENV, "2", 1);
	ck_assert_uint_eq(dlpc__split_threads(big), min3(2, n, 99));
	setenv(DLPC_COPY_THREADS_ENV, "1000", 1); /* never past the bound */
	ck_assert_uint_eq(dlpc__split_threads(big), min3(DLPC__SPLIT_THREADS_MAX, n, 99));
	setenv(DLPC_COPY_THREADS_ENV, "-2", 1);
	ck_assert_uint_eq(dlpc__split_threads(big), min3(DLPC__SPLIT_THREADS_MAX, n, 99));
	setenv(DLPC_COPY_THREADS_ENV, "two", 1);
	ck_assert_uint_eq(dlpc__split_threads(big), min3(DLPC__SPLIT_THREADS_MAX, n, 99));
	unsetenv(DLPC_COPY_THREADS_ENV);
	/* a thread pinned to one CPU copies alone */
	ck_assert_int_eq(sched_getaffinity(0, sizeof(all), &all), 0);
	CPU_ZERO(&one);
	for (int i = 0; i < CPU_SETSIZE; i++)
		if (CPU_ISSET(i, &all)) {
			CPU_SET(i, &one);
			break;
		}
	ck_assert_int_eq(sched_setaffinity(0, sizeof(one), &one), 0);
	ck_assert_uint_eq(dlpc__split_threads(big), 1);
	ck_assert_int_eq(sched_setaffinity(0, sizeof(all), &all), 0);
}
END_TEST

/* This process's threads. */
static int threads(void)
{
	DIR *d = opendir("/proc/self/task");
	int n = 0;

	ck_assert_ptr_nonnull(d);
	while (readdir(d))
		n++;
	closedir(d);
	return n - 2; /* . and .. */
}

/* Wait (a scaled second at most) until this process has @p n threads again: a joined thread
 * leaves /proc/self/task an instant after pthread_join() returns. Whether it did. */
static bool threads_back_to(int n)
{
	for (int i = 0; i < scaled_ms(1000); i++) {
		if (threads() == n)
			return true;
		usleep(1000);
	}
	return threads() == n;
}

/* Runs at odd offsets and lengths, across every part's boundary, with gaps between them: each
 * byte lands where it belongs, the gaps stay zero, every page is allocated, and the copy ran
 * on as many threads as dlpc__split_threads() says (more than one wherever two CPUs are). */
START_TEST(test_split_copy)
{
	uint64_t len = 3ull * DLPC__SPLIT_MIN + 5 * 4096 + 123;
	uint8_t *src = malloc(len), *map;
	struct dlpc__run runs[6];
	uint64_t at = 17;
	int fd, before = threads();
	size_t n = 0, bad = SIZE_MAX;
	struct stat st;

	ck_assert_ptr_nonnull(src);
	for (uint64_t i = 0; i < len; i++)
		src[i] = (uint8_t)(i * 7 + 1) | 1; /* never 0 */
	/* lengths such that the runs cross the parts' boundaries (whole huge pages) */
	const uint64_t lens[] = {1,    3 * MIB + 1, DLPC__SPLIT_MIN + 77,
				 4095, 9 * MIB + 3, DLPC__SPLIT_MIN - 11};
	for (size_t i = 0; i < 6 && at < len; i++) {
		uint64_t l = at + lens[i] <= len ? lens[i] : len - at;

		runs[n++] = (struct dlpc__run){src + at, at, l};
		at += l + 4096 + i; /* a gap */
	}
	fd = memfd_create("split", MFD_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)len), 0);
	map = dlpc__huge_map(fd, (size_t)len, false);
	ck_assert_ptr_nonnull(map);
	ck_assert_int_eq(dlpc__split_copy(map, len, fd, DLPC__SPLIT_POPULATE, runs, n),
			 (int)dlpc__split_threads(len));
	if (cpus() >= 2 && dlpc__huge_pmd() <= DLPC__SPLIT_MIN)
		ck_assert_int_ge(dlpc__split_threads(len), 2);
	ck_assert(threads_back_to(before)); /* every one joined */
	for (size_t i = 0, r = 0; i < len && bad == SIZE_MAX; i++) {
		while (r < n && i >= runs[r].off + runs[r].len)
			r++;
		if (map[i] != (r < n && i >= runs[r].off ? src[i] : 0))
			bad = i; /* (Check's assertions are too slow for every byte) */
	}
	ck_assert_msg(bad == SIZE_MAX, "byte %zu is wrong (%s)", bad,
		      bad < len && map[bad] == 0 ? "not copied" : "copied where it should not be");
	ck_assert_int_eq(fstat(fd, &st), 0);
	ck_assert_uint_ge((uint64_t)st.st_blocks * 512, (len + 4095) / 4096 * 4096);
	munmap(map, (size_t)len);
	close(fd);
	free(src);
}
END_TEST

/* A copy of one run from the first byte to the last of lengths that do not divide evenly, with
 * 2, 3 and 4 threads asked for: the last bytes land too, the last page is allocated. */
START_TEST(test_split_copy_tail)
{
	for (unsigned k = 2; k <= DLPC__SPLIT_THREADS_MAX; k++) {
		uint64_t len = (uint64_t)k * DLPC__SPLIT_MIN + k - 1;
		uint8_t *src = malloc(len), *map;
		struct dlpc__run run = {src, 0, len};
		char want[8];
		struct stat st;
		int fd;

		ck_assert_ptr_nonnull(src);
		memset(src, 0x5a, len);
		snprintf(want, sizeof(want), "%u", k);
		setenv(DLPC_COPY_THREADS_ENV, want, 1);
		fd = memfd_create("split", MFD_CLOEXEC);
		ck_assert_int_ge(fd, 0);
		ck_assert_int_eq(ftruncate(fd, (off_t)len), 0);
		map = dlpc__huge_map(fd, (size_t)len, false);
		ck_assert_ptr_nonnull(map);
		ck_assert_int_ge(dlpc__split_copy(map, len, fd, DLPC__SPLIT_POPULATE, &run, 1), 1);
		ck_assert_msg(memcmp(map, src, len) == 0, "%u threads asked: bytes missing", k);
		ck_assert_int_eq(fstat(fd, &st), 0);
		ck_assert_uint_ge((uint64_t)st.st_blocks * 512, (len + 4095) / 4096 * 4096);
		munmap(map, (size_t)len);
		close(fd);
		free(src);
	}
	unsetenv(DLPC_COPY_THREADS_ENV);
}
END_TEST

/* A copy into a memfd whose pages are faulted in already (as the warm pool's are), asked to
 * drop them from the mapping after: with 1 to 4 threads asked for, every byte is in the memfd
 * (read with pread(), not through the mapping); on more than one thread the mapping keeps no
 * page but the last one, which the last part ends inside, and on one it keeps them all (one
 * munmap() takes them down faster). */
START_TEST(test_split_copy_drop)
{
	for (unsigned k = 1; k <= DLPC__SPLIT_THREADS_MAX; k++) {
		uint64_t len = (uint64_t)k * DLPC__SPLIT_MIN + 3 * 4096 + 77,
			 pages = len / 4096 + 1;
		uint8_t *src = malloc(len), *back = malloc(len), *map;
		struct dlpc__run run = {src, 0, len};
		char want[8];
		int fd, ran;

		ck_assert(src && back);
		for (uint64_t i = 0; i < len; i++)
			src[i] = (uint8_t)(i * 11 + k) | 1;
		snprintf(want, sizeof(want), "%u", k);
		setenv(DLPC_COPY_THREADS_ENV, want, 1);
		fd = memfd_create("split", MFD_CLOEXEC);
		ck_assert_int_ge(fd, 0);
		ck_assert_int_eq(ftruncate(fd, (off_t)len), 0);
		map = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		ck_assert_ptr_ne(map, MAP_FAILED);
		memset(map, 0, (size_t)len); /* every page faulted in */
		ck_assert_uint_eq(pages_mapped(map, len), pages);
		ran = dlpc__split_copy(map, len, fd, DLPC__SPLIT_DROP, &run, 1);
		ck_assert_int_eq(ran, (int)dlpc__split_threads(len));
		if (k >= 2 && cpus() >= 2) /* the drop itself is tested, not only its absence */
			ck_assert_int_ge(ran, 2);
		ck_assert_uint_eq(pages_mapped(map, len), ran > 1 ? 1 : pages);
		ck_assert_int_eq(pread(fd, back, (size_t)len, 0), (ssize_t)len);
		ck_assert_msg(memcmp(back, src, (size_t)len) == 0, "%u threads asked: bytes lost",
			      k);
		munmap(map, (size_t)len);
		close(fd);
		free(src);
		free(back);
	}
	unsetenv(DLPC_COPY_THREADS_ENV);
}
END_TEST

/* Whether page @p i of @p map is mapped: pagemap's bit 63. */
static bool page_mapped(int pagemap, const uint8_t *map, uint64_t i)
{
	uint64_t e;

	ck_assert_int_eq(pread(pagemap, &e, sizeof(e), (off_t)((uintptr_t)map / 4096 + i) * 8),
			 (ssize_t)sizeof(e));
	return e >> 63;
}

/* A populate of a read-only mapping that starts 3 pages past a DLPC__POPULATE_STEP boundary and
 * ends a page past one, with 1 to 4 threads asked for: every window of DLPC__POPULATE_STEP
 * bytes it covers, the first and the last included, has a page mapped (the ones populated: the
 * kernel's fault-around maps the rest of each window with it, 64 KiB by default, which is
 * printed), and it ran on as many threads as dlpc__split_threads() says. */
START_TEST(test_split_populate)
{
	const uint64_t step = DLPC__POPULATE_STEP, pages_per = step / 4096;

	for (unsigned k = 1; k <= DLPC__SPLIT_THREADS_MAX; k++) {
		/* the file: three windows more than k parts, so that the populate can start 3 pages
		 * into one and end a page into another, k parts long at least */
		size_t total = (size_t)((uint64_t)k * DLPC__SPLIT_MIN + 3 * step);
		uint64_t len = total - step - 3 * 4096 - (step - 4096), pages = len / 4096;
		unsigned ran;
		uint64_t mapped = 0, windows = 0;
		int fd = memfd_create("split", MFD_CLOEXEC), pagemap;
		uint8_t *map, *base;
		char want[8];

		snprintf(want, sizeof(want), "%u", k);
		setenv(DLPC_COPY_THREADS_ENV, want, 1);
		ck_assert_int_ge(fd, 0);
		ck_assert_int_eq(ftruncate(fd, (off_t)total), 0);
		/* written, as a storage is: fault-around maps only pages that hold data */
		map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		ck_assert_ptr_ne(map, MAP_FAILED);
		memset(map, 7, total);
		munmap(map, total);
		map = mmap(NULL, total, PROT_READ, MAP_SHARED, fd, 0);
		ck_assert_ptr_ne(map, MAP_FAILED);
		base = (uint8_t *)(((uintptr_t)map + step - 1) / step * step) + 3 * 4096;
		ran = dlpc__split_populate(base, (size_t)len);
		if (ran == 0) {
			fprintf(stderr, "populate: skipped: the kernel does not know "
					"MADV_POPULATE_READ (Linux 5.14)\n");
			munmap(map, total);
			close(fd);
			break;
		}
		ck_assert_uint_eq(ran, dlpc__split_threads(len));
		pagemap = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
		ck_assert_int_ge(pagemap, 0);
		for (uint64_t i = 0; i < pages; i++) {
			bool first = i == 0 || ((uintptr_t)base / 4096 + i) % pages_per == 0;
			bool on = page_mapped(pagemap, base, i);

			mapped += on;
			windows += first;
			ck_assert_msg(!first || on,
				      "%u threads: page %llu, which starts a window, is not mapped",
				      k, (unsigned long long)i);
		}
		fprintf(stderr,
			"populate, %u threads asked: %llu of %llu pages mapped (%llu windows)\n", k,
			(unsigned long long)mapped, (unsigned long long)pages,
			(unsigned long long)windows);
		close(pagemap);
		munmap(map, total);
		close(fd);
	}
	unsetenv(DLPC_COPY_THREADS_ENV);
}
END_TEST

/* A part whose pages cannot be allocated (past the end of the file: the fault has no page to
 * give) fails the copy with a negative errno, when it is another thread's part as when it is
 * the caller's; the parts before it are copied, every thread is joined, and nothing is left
 * running. On a kernel without MADV_POPULATE_WRITE the fallback's fallocate() grows the file
 * instead: the copy then succeeds whole. */
START_TEST(test_split_copy_fails)
{
	uint64_t len = 4ull * DLPC__SPLIT_MIN;
	uint8_t *src = malloc(len), *map;
	struct dlpc__run run;
	bool populate_write;
	unsigned k;
	int fd, before = threads(), r;

	ck_assert_ptr_nonnull(src);
	memset(src, 0x77, len);
	run = (struct dlpc__run){src, 0, len};
	setenv(DLPC_COPY_THREADS_ENV, "2", 1);
	k = dlpc__split_threads(len); /* 2, or 1 on one CPU */
	fd = memfd_create("split", MFD_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	/* every part but the last has its pages; the mapping runs on past the end */
	ck_assert_int_eq(ftruncate(fd, (off_t)(len - len / k)), 0);
	map = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ck_assert_ptr_ne(map, MAP_FAILED);
	populate_write = madvise(map, 4096, MADV_POPULATE_WRITE) == 0 || errno != EINVAL;
	r = dlpc__split_copy(map, len, fd, DLPC__SPLIT_POPULATE, &run, 1);
	if (populate_write) {
		ck_assert_msg(r < 0, "a copy past the end of its memfd gave %d", r);
		if (k > 1) /* the caller's part was copied all the same */
			ck_assert(memcmp(map, src, len - len / k) == 0);
	} else {
		ck_assert_int_eq(r, (int)k);
	}
	ck_assert(threads_back_to(before));
	unsetenv(DLPC_COPY_THREADS_ENV);
	munmap(map, (size_t)len);
	close(fd);
	free(src);
}
END_TEST

/* The process's SIGBUS handler: the child below exits with this. */
#define HANDLED 42
static void on_sigbus(int sig)
{
	(void)sig;
	_exit(HANDLED);
}

/* A child: copy from a source whose second half faults (a mapping of a file past its end) with
 * the copy split in two: the fault comes on the copy's thread. */
static int faulting_copy(void *arg)
{
	uint64_t len = 2ull * DLPC__SPLIT_MIN;
	int sfd = memfd_create("src", MFD_CLOEXEC), dfd = memfd_create("dst", MFD_CLOEXEC);
	struct dlpc__run run;
	uint8_t *src, *dst;

	(void)arg;
	CHILD_CHECK(sfd >= 0 && dfd >= 0);
	CHILD_CHECK(ftruncate(sfd, (off_t)(len / 2)) == 0 && ftruncate(dfd, (off_t)len) == 0);
	src = mmap(NULL, (size_t)len, PROT_READ, MAP_SHARED, sfd, 0);
	dst = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED, dfd, 0);
	CHILD_CHECK(src != MAP_FAILED && dst != MAP_FAILED);
	run = (struct dlpc__run){src, 0, len};
	signal(SIGBUS, on_sigbus);
	setenv(DLPC_COPY_THREADS_ENV, "2", 1);
	dlpc__split_copy(dst, len, dfd, 0, &run, 1);
	return 1; /* the fault never came */
}

/* A fault of the caller's source on a copy thread reaches the process's own handler, as it
 * would on the caller's thread, instead of killing the process (the thread does not block the
 * signals of faults). */
START_TEST(test_split_fault_reaches_handler)
{
	int status;
	pid_t pid = fork();

	ck_assert_int_ge(pid, 0);
	if (pid == 0)
		_exit(faulting_copy(NULL));
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == HANDLED, "the child %s %d",
		      WIFEXITED(status) ? "exited" : "was killed by signal",
		      WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
}
END_TEST

/* Write @p text to file @p name of directory @p dir; whether it could. */
static bool put(const char *dir, const char *name, const char *text)
{
	char path[300];
	FILE *f;
	bool ok;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	if (!(f = fopen(path, "we")))
		return false;
	ok = fputs(text, f) >= 0;
	return fclose(f) == 0 && ok;
}

/* A child in a CPU cgroup limited to one CPU (cgroup v1's CFS quota, as root) splits no copy:
 * its threads would only wait for the quota. Where no cgroup can be made (not root, no v1 cpu
 * controller mounted) the case says so and checks nothing. */
START_TEST(test_split_cpu_quota)
{
	uint64_t big = (uint64_t)DLPC__SPLIT_MIN * DLPC__SPLIT_THREADS_MAX;
	char dir[128], me[32];
	int status;
	pid_t pid;

	if (geteuid() != 0 || access("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", W_OK) != 0) {
		printf("test_split_cpu_quota: not checked: not root or no cgroup v1 cpu "
		       "controller\n");
		return;
	}
	unsetenv(DLPC_COPY_THREADS_ENV);
	snprintf(dir, sizeof(dir), "/sys/fs/cgroup/cpu/dlpc-split-%d", (int)getpid());
	ck_assert_msg(mkdir(dir, 0755) == 0 || errno == EEXIST, "mkdir %s: %m", dir);
	ck_assert(put(dir, "cpu.cfs_period_us", "100000"));
	ck_assert(put(dir, "cpu.cfs_quota_us", "100000"));
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		snprintf(me, sizeof(me), "%d", (int)getpid());
		CHILD_CHECK(put(dir, "cgroup.procs", me));
		CHILD_CHECK(dlpc__split_threads(big) == 1);
		_exit(0);
	}
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	rmdir(dir);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child in %s failed", dir);
	/* outside it, as many as the CPUs allow */
	ck_assert_uint_eq(dlpc__split_threads(big), min3(DLPC__SPLIT_THREADS_MAX, cpus(), 99));
}
END_TEST

/* A child: attach @p arg's bundle and check every byte of both tensors. */
struct bundle_src {
	const char *name;
	const uint8_t *a;  /* contiguous, A_BYTES */
	const uint8_t *tb; /* the strided tensor's source, read transposed */
};
/* b (4 MiB) first, then a, to the storage's last byte: 36 MiB + 1 in all, a length that no split
 * into whole huge pages divides evenly */
#define A_BYTES (2 * (size_t)DLPC__SPLIT_MIN + 1)
#define B_ROWS 1024
#define B_COLS 4096

static int bundle_child(void *arg)
{
	const struct bundle_src *s = arg;
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *a, *b;
	dlpc_bundle *bundle;
	const uint8_t *pa, *pb;

	CHILD_CHECK(dlpc_attach_bundle(c, s->name, NULL, &bundle) > 0);
	CHILD_CHECK(dlpc_bundle_count(bundle) == 2);
	CHILD_CHECK(strcmp(dlpc_bundle_key(bundle, 1), "a") == 0);
	b = dlpc_bundle_take(bundle, 0);
	a = dlpc_bundle_take(bundle, 1);
	pa = a->dl_tensor.data;
	pb = b->dl_tensor.data;
	CHILD_CHECK(memcmp(pa, s->a, A_BYTES) == 0);
	/* b[i][j] == tb[j][i]: written C-contiguous from the transposed view */
	for (size_t i = 0; i < B_COLS; i++)
		for (size_t j = 0; j < B_ROWS; j++)
			CHILD_CHECK(pb[i * B_ROWS + j] == s->tb[j * B_COLS + i]);
	a->deleter(a);
	b->deleter(b);
	dlpc_bundle_free(bundle);
	dlpc_close(c);
	return 0;
}

/* Wait (a scaled 5 s at most) until this process maps a memfd of libdlpc's: the warm pool's,
 * filled (it maps it once its pages are in). */
static bool wait_mapped_warm(void)
{
	for (int i = 0; i < scaled_ms(5000) / 5; i++) {
		if (dlpc_mappings() >= 1)
			return true;
		usleep(5000);
	}
	return dlpc_mappings() >= 1;
}

/* A bundle of a contiguous tensor and a strided one (a transposed view), large enough to be
 * split, published three times: the first two write fresh memfds (with write(), or through a
 * mapping where shmem huge pages are on; the pool keeps a size from its second use), the third
 * takes the warm pool's mapped memfd and copies through its mapping, split. Another process
 * reads each back whole. */
START_TEST(test_split_publish_bundle)
{
	uint8_t *a = malloc(A_BYTES), *tb = malloc((size_t)B_ROWS * B_COLS);
	int64_t shape_a[1] = {(int64_t)A_BYTES}, shape_b[2] = {B_COLS, B_ROWS};
	int64_t strides_b[2] = {1, B_COLS};
	const char *keys[2] = {"b", "a"};
	struct bundle_src s = {"s/bundle", a, tb};
	dlpc_client *c;

	ck_assert_ptr_nonnull(a);
	ck_assert_ptr_nonnull(tb);
	for (size_t i = 0; i < A_BYTES; i++)
		a[i] = (uint8_t)(i * 13 + 5);
	for (size_t i = 0; i < (size_t)B_ROWS * B_COLS; i++)
		tb[i] = (uint8_t)(i * 31 + 3);
	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1);
	c = connect_or_die(&D);
	for (int round = 0; round < 3; round++) {
		DLManagedTensorVersioned *t[2] = {
			host_tensor(tb, (DLDataType){kDLUInt, 8, 1}, 2, shape_b, strides_b, NULL),
			host_tensor(a, (DLDataType){kDLUInt, 8, 1}, 1, shape_a, NULL, NULL)};
		int r = dlpc_publish_bundle(c, s.name, 2, keys, t, DLPC_PUBLISH_REPLACE);

		ck_assert_msg(r > 0, "publish: %d: %s", r, dlpc_last_error());
		ck_assert_int_eq(wait_child(spawn(bundle_child, &s)), 0);
		/* the pool fills and maps a memfd of this size for the third round */
		if (round == 1)
			ck_assert_msg(wait_mapped_warm(), "the warm pool mapped no memfd");
	}
	dlpc_close(c);
	free(a);
	free(tb);
}
END_TEST

static int one_child(void *arg)
{
	const struct bundle_src *s = arg;
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t;

	CHILD_CHECK(dlpc_attach(c, s->name, NULL, &t) > 0);
	CHILD_CHECK(t->dl_tensor.shape[0] == (int64_t)A_BYTES);
	CHILD_CHECK(memcmp(t->dl_tensor.data, s->a, A_BYTES) == 0);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* A_BYTES of bytes i * @p mul + @p add (malloc'd). */
static uint8_t *pattern(unsigned mul, unsigned add)
{
	uint8_t *a = malloc(A_BYTES);

	ck_assert_ptr_nonnull(a);
	for (size_t i = 0; i < A_BYTES; i++)
		a[i] = (uint8_t)(i * mul + add);
	return a;
}

/* Publish @p s's contiguous tensor alone under its name, replacing what was there. */
static void publish_one(dlpc_client *c, const struct bundle_src *s)
{
	int64_t shape[1] = {(int64_t)A_BYTES};
	int r = dlpc_publish(
		c, s->name,
		host_tensor((void *)s->a, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
		DLPC_PUBLISH_REPLACE);

	ck_assert_msg(r > 0, "publish: %d: %s", r, dlpc_last_error());
}

/* One contiguous tensor, large enough to be split, published three times: the third publish
 * takes the warm pool's mapped memfd (the pool keeps a size from its second use), whose threads
 * drop the pages they wrote from the mapping (DLPC__SPLIT_DROP) before the seal. A guard of the bytes: another process reads every one
 * back each time (that the drop happens is split_copy_drop's). */
START_TEST(test_split_publish_dropped)
{
	uint8_t *a = pattern(29, 7);
	struct bundle_src s = {"s/one", a, NULL};
	dlpc_client *c;

	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1);
	c = connect_or_die(&D);
	for (int round = 0; round < 3; round++) {
		publish_one(c, &s);
		ck_assert_int_eq(wait_child(spawn(one_child, &s)), 0);
		if (round == 1)
			ck_assert_msg(wait_mapped_warm(), "the warm pool mapped no memfd");
	}
	dlpc_close(c);
	free(a);
}
END_TEST

/* In a child whose kernel refuses MADV_POPULATE_READ as unknown, as one before Linux 5.14 does
 * (a seccomp filter answers EINVAL): an attach with DLPC_ATTACH_POPULATE of the entry still
 * succeeds with every byte, and the split populate says it did nothing (0) once it was told. */
static int unknown_advice_child(void *arg)
{
	const struct bundle_src *s = arg;
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_madvise, 0, 3),
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[2])),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, MADV_POPULATE_READ, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EINVAL),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog prog = {sizeof(f) / sizeof(f[0]), f};
	dlpc_attach_opts o = {.size = sizeof(o), .flags = DLPC_ATTACH_POPULATE};
	DLManagedTensorVersioned *t;
	dlpc_client *c;

	CHILD_CHECK(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0);
	CHILD_CHECK(prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0);
	c = connect_or_die(&D);
	CHILD_CHECK(dlpc_attach(c, s->name, &o, &t) > 0);
	CHILD_CHECK(memcmp(t->dl_tensor.data, s->a, A_BYTES) == 0);
	CHILD_CHECK(dlpc__split_populate(t->dl_tensor.data, A_BYTES) == 0);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

START_TEST(test_split_populate_unknown)
{
	uint8_t *a = pattern(17, 3);
	struct bundle_src s = {"s/unknown", a, NULL};
	dlpc_client *c = connect_or_die(&D);

	publish_one(c, &s);
	ck_assert_int_eq(wait_child(spawn(unknown_advice_child, &s)), 0);
	dlpc_close(c);
	free(a);
}
END_TEST

static Suite *split_suite(void)
{
	Suite *s = suite_create("split");
	TCase *unit = tcase_create("copy");
	TCase *tc = tcase_create("publish");

	tcase_set_timeout(unit, scaled_ms(60000) / 1000);
	tcase_add_test(unit, test_split_threads);
	tcase_add_test(unit, test_split_copy);
	tcase_add_test(unit, test_split_copy_tail);
	tcase_add_test(unit, test_split_copy_drop);
	tcase_add_test(unit, test_split_populate);
	tcase_add_test(unit, test_split_copy_fails);
	tcase_add_test(unit, test_split_fault_reaches_handler);
	tcase_add_test(unit, test_split_cpu_quota);
	suite_add_tcase(s, unit);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, scaled_ms(60000) / 1000);
	tcase_add_test(tc, test_split_publish_bundle);
	tcase_add_test(tc, test_split_publish_dropped);
	tcase_add_test(tc, test_split_populate_unknown);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(split_suite());
}
