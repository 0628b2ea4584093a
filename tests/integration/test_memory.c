/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A publisher in a small memory cgroup: every publish and dlpc_alloc() that the cgroup cannot
 * hold is refused with ENOSPC before anything is allocated, whatever its size, instead of the
 * cgroup's OOM killer ending the process. The test makes the cgroup itself (as root, below the
 * process's own memory cgroup, v1 or v2); where it cannot, the suite exits 77 (skipped, as ctest
 * reports it), saying why.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <sys/wait.h>

#include "harness.h"

/* The cgroup's limit, memory and swap together, and the size of each tensor put into it. */
#define CG_LIMIT (256ull << 20)
#define STEP (16ll << 20)
/* More tensors than the cgroup can hold: the loops below end with a refusal well before. */
#define STEPS_MAX ((int)(CG_LIMIT / STEP) + 1)

static struct daemon D;
static bool started;

static void teardown(void)
{
	if (started)
		daemon_stop(&D);
	started = false;
}

static bool error_says(const char *text)
{
	return strstr(dlpc_last_error(), text) != NULL;
}

static bool write_file(const char *dir, const char *file, const char *text)
{
	char path[1024];
	int fd;
	bool ok;

	snprintf(path, sizeof(path), "%s/%s", dir, file);
	fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0)
		return false;
	ok = write(fd, text, strlen(text)) == (ssize_t)strlen(text);
	close(fd);
	return ok;
}

static bool file_exists(const char *dir, const char *file)
{
	char path[1024];

	snprintf(path, sizeof(path), "%s/%s", dir, file);
	return access(path, F_OK) == 0;
}

/* The directory of this process's memory cgroup into @p dir (v1's memory hierarchy if mounted,
 * else v2's); *@p v2 says which. false if there is none. */
static bool own_memory_cgroup(char *dir, size_t len, bool *v2)
{
	char line[1024];
	bool found = false;
	FILE *f = fopen("/proc/self/cgroup", "re");

	while (f && fgets(line, sizeof(line), f)) {
		char *ctl = strchr(line, ':'), *path = ctl ? strchr(ctl + 1, ':') : NULL;

		if (!path)
			continue;
		*path++ = 0;
		path[strcspn(path, "\n")] = 0;
		if (strstr(ctl + 1, "memory") && !strstr(ctl + 1, "name=")) {
			snprintf(dir, len, "/sys/fs/cgroup/memory%s", path);
			*v2 = false;
			found = true;
			break;
		}
		/* v2 counts where it is mounted at the top (not only beside v1, as "unified") */
		if (strcmp(line, "0") == 0 && !ctl[1] &&
		    access("/sys/fs/cgroup/cgroup.controllers", F_OK) == 0) {
			snprintf(dir, len, "/sys/fs/cgroup%s", path);
			*v2 = found = true;
		}
	}
	if (f)
		fclose(f);
	return found;
}

/*
 * A new memory cgroup below this process's own, limited to @p limit bytes of memory and, where
 * the machine has swap, as many of memory and swap together, so that nothing can go to swap and
 * the limit is the whole story. Its directory into @p dir; false and why into @p why if not.
 */
static bool cgroup_new(uint64_t limit, char *dir, size_t len, char *why, size_t whylen)
{
	char parent[700], value[32];
	struct sysinfo si;
	bool v2 = false, swap;

	if (geteuid() != 0) {
		snprintf(why, whylen, "not root: cannot create a memory cgroup");
		return false;
	}
	if (!own_memory_cgroup(parent, sizeof(parent), &v2)) {
		snprintf(why, whylen, "no memory controller in /proc/self/cgroup");
		return false;
	}
	if (v2 && !write_file(parent, "cgroup.subtree_control", "+memory")) {
		snprintf(why, whylen, "cannot enable the memory controller below %s: %s", parent,
			 strerror(errno));
		return false;
	}
	swap = sysinfo(&si) == 0 && si.totalswap > 0;
	snprintf(dir, len, "%s/dlpc-test-%d", parent, (int)getpid());
	if (mkdir(dir, 0755) < 0) {
		snprintf(why, whylen, "cannot create cgroup %s: %s", dir, strerror(errno));
		return false;
	}
	snprintf(value, sizeof(value), "%llu", (unsigned long long)limit);
	if (!write_file(dir, v2 ? "memory.max" : "memory.limit_in_bytes", value)) {
		snprintf(why, whylen, "cannot limit cgroup %s: %s", dir, strerror(errno));
		goto fail;
	}
	/* v1 wants memory+swap at least the memory limit: set after it */
	if (file_exists(dir, v2 ? "memory.swap.max" : "memory.memsw.limit_in_bytes") &&
	    !write_file(dir, v2 ? "memory.swap.max" : "memory.memsw.limit_in_bytes",
			v2 ? "0" : value)) {
		snprintf(why, whylen, "cannot limit the swap of cgroup %s: %s", dir,
			 strerror(errno));
		goto fail;
	}
	if (swap && !file_exists(dir, v2 ? "memory.swap.max" : "memory.memsw.limit_in_bytes")) {
		snprintf(why, whylen,
			 "this machine has swap, and the swap of cgroup %s cannot be limited (no "
			 "swap accounting)",
			 dir);
		goto fail;
	}
	return true;
fail:
	rmdir(dir);
	return false;
}

/* dlpc_alloc() @p n bytes and free them at once. */
static int alloc_free(int64_t n)
{
	DLManagedTensorVersioned *t;
	int r = dlpc_alloc(NULL, (DLDevice){kDLCPU, 0}, (DLDataType){kDLUInt, 8, 1}, 1, &n, &t);

	if (r == 0)
		t->deleter(t);
	return r;
}

/*
 * In a child: join the cgroup at @p arg, then take its memory 16 MiB at a time, first with
 * dlpc_alloc() (held), then by publishing copies, until each is refused. Everything is given
 * back before it returns.
 */
static int fill_cgroup(void *arg)
{
	DLManagedTensorVersioned *held[STEPS_MAX];
	DLDataType u8 = {kDLUInt, 8, 1};
	DLDevice cpu = {kDLCPU, 0};
	int64_t n = STEP;
	char name[32], pid[16];
	dlpc_client *c;
	uint8_t *src;
	int k, r = 0;

	/* libdlpc has looked at the cgroups before this process moves (and the parent before
	 * the fork): what it found must not be trusted afterwards */
	CHILD_CHECK(alloc_free(4096) == 0);
	snprintf(pid, sizeof(pid), "%d", (int)getpid());
	CHILD_CHECK(write_file(arg, "cgroup.procs", pid));
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);

	for (k = 0; k < STEPS_MAX; k++)
		if ((r = dlpc_alloc(c, cpu, u8, 1, &n, &held[k])) < 0)
			break;
	fprintf(stderr, "dlpc_alloc: %d x 16 MiB, then: %s\n", k, dlpc_last_error());
	CHILD_CHECK(r == -ENOSPC);
	CHILD_CHECK(error_says("'dlpc_alloc'") && error_says("memory cgroup has") &&
		    error_says("/dlpc-test-"));
	/* the check refuses only what does not fit: most of the cgroup was taken */
	CHILD_CHECK(k >= STEPS_MAX / 2);
	while (k-- > 0)
		held[k]->deleter(held[k]);

	/* the copy path: the source, too, is charged to the cgroup */
	src = malloc((size_t)STEP);
	CHILD_CHECK(src != NULL);
	memset(src, 7, (size_t)STEP);
	for (k = 0; k < STEPS_MAX; k++) {
		snprintf(name, sizeof(name), "cg/%d", k);
		if ((r = dlpc_publish(c, name, host_tensor(src, u8, 1, &n, NULL, NULL), 0)) < 0)
			break;
	}
	fprintf(stderr, "dlpc_publish: %d x 16 MiB, then: %s\n", k, dlpc_last_error());
	CHILD_CHECK(r == -ENOSPC);
	CHILD_CHECK(error_says("'cg/") && error_says("memory cgroup has") &&
		    error_says("/dlpc-test-"));
	CHILD_CHECK(k >= STEPS_MAX / 2);
	while (k > 0) {
		snprintf(name, sizeof(name), "cg/%d", --k);
		CHILD_CHECK(dlpc_unpublish(c, name) == 0);
	}
	free(src);
	dlpc_close(c);
	return 0;
}

static bool back_to(const dlpc_stats *s, void *arg)
{
	const dlpc_stats *b = arg;

	return s->entries == b->entries && s->storages == b->storages &&
	       s->bytes_held == b->bytes_held && s->connections == b->connections &&
	       s->fds_closing == 0;
}

START_TEST(test_small_cgroup_is_enospc_not_oom)
{
	char dir[800], why[1024];
	dlpc_stats before;
	dlpc_client *c;
	int fds, st;

	daemon_start(&D);
	started = true;
	c = connect_or_die(&D);
	before = stat_or_die(c);
	fds = settled_fds(&D, c, 1);
	ck_assert_int_eq(alloc_free(4096), 0);
	/* main() made one already: failing now is a failure, not a skip */
	ck_assert_msg(cgroup_new(CG_LIMIT, dir, sizeof(dir), why, sizeof(why)), "%s", why);
	/* without the check, the cgroup's OOM killer ends the child (SIGKILL) after 15 tensors */
	st = wait_child(spawn(fill_cgroup, dir));
	ck_assert_msg(rmdir(dir) == 0, "rmdir %s: %s", dir, strerror(errno));
	ck_assert_msg(st == 0, "the child in a %llu-byte memory cgroup exited with %d%s", CG_LIMIT,
		      st, st == 128 + SIGKILL ? " (SIGKILL: the cgroup's OOM killer)" : "");
	/* everything published was unpublished: the daemon is back where it was */
	ck_assert_msg(wait_stat(c, back_to, &before, 5000), "the daemon kept what was published");
	ck_assert_int_eq(settled_fds(&D, c, 1), fds);
	dlpc_close(c);
}
END_TEST

/* Count this process's memfds of the warm pool that hold @p bytes allocated. */
static int warm_held(uint64_t bytes)
{
	int n = 0;

	for (int fd = 3; fd < 1024; fd++) {
		char path[64], target[128];
		struct stat st;
		ssize_t len;

		snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
		len = readlink(path, target, sizeof(target) - 1);
		if (len <= 0)
			continue;
		target[len] = 0;
		n += strcmp(target, "/memfd:dlpc:warm (deleted)") == 0 && fstat(fd, &st) == 0 &&
		     (uint64_t)st.st_blocks * 512 == bytes;
	}
	return n;
}

#define WARM_SRC (96ll << 20)
#define WARM_A (48ll << 20)
#define WARM_B (80ll << 20)

/*
 * In a child, in the cgroup at @p arg: dlpc_alloc() 48 MiB and free it (the pool notes the size:
 * it keeps one from a size's second use), then publish 48 MiB from a 96 MiB source (144 of the
 * 256 MiB; the 112 left are DLPC__WARM_ROOM_FACTOR times 48 MiB and more, so the warm pool
 * refills its 48 MiB memfd: 192), then 80 MiB of another size, which only fits once the pool
 * gives its memory back: it must, the publish succeeds.
 */
static int warm_gives_way(void *arg)
{
	DLDataType u8 = {kDLUInt, 8, 1};
	int64_t a = WARM_A, b = WARM_B;
	char pid[16];
	dlpc_client *c;
	uint8_t *src;
	int i;

	CHILD_CHECK(alloc_free(4096) == 0);
	snprintf(pid, sizeof(pid), "%d", (int)getpid());
	CHILD_CHECK(write_file(arg, "cgroup.procs", pid));
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	src = malloc((size_t)WARM_SRC);
	CHILD_CHECK(src != NULL);
	memset(src, 7, (size_t)WARM_SRC);
	CHILD_CHECK(alloc_free(WARM_A) == 0);
	CHILD_CHECK(dlpc_publish(c, "cg/a", host_tensor(src, u8, 1, &a, NULL, NULL), 0) > 0);
	for (i = 0; i < scaled_ms(5000) / 10 && warm_held((uint64_t)WARM_A) != 1; i++)
		usleep(10000);
	CHILD_CHECK(warm_held((uint64_t)WARM_A) == 1);
	/* the cgroup has less than DLPC__WARM_MAP_ROOM to spare: held unmapped */
	CHILD_CHECK(dlpc_mappings() == 0);
	CHILD_CHECK(dlpc_publish(c, "cg/b", host_tensor(src, u8, 1, &b, NULL, NULL), 0) > 0);
	CHILD_CHECK(dlpc_unpublish(c, "cg/a") == 0 && dlpc_unpublish(c, "cg/b") == 0);
	free(src);
	dlpc_close(c);
	return 0;
}

/* Memory the warm pool holds never makes a publish fail: it is given back first. */
START_TEST(test_warm_pool_gives_way)
{
	char dir[800], why[1024];
	int st;

	daemon_start(&D);
	started = true;
	ck_assert_msg(cgroup_new(CG_LIMIT, dir, sizeof(dir), why, sizeof(why)), "%s", why);
	st = wait_child(spawn(warm_gives_way, dir));
	ck_assert_msg(rmdir(dir) == 0, "rmdir %s: %s", dir, strerror(errno));
	ck_assert_int_eq(st, 0);
}
END_TEST

static Suite *memory_suite(void)
{
	Suite *s = suite_create("memory");
	TCase *tc = tcase_create("cgroup");

	tcase_add_checked_fixture(tc, NULL, teardown);
	tcase_set_timeout(tc, scaled_ms(60000) / 1000);
	tcase_add_test(tc, test_small_cgroup_is_enospc_not_oom);
	tcase_add_test(tc, test_warm_pool_gives_way);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	char dir[800], why[1024];

	/* every test here needs a memory cgroup of its own: where none can be made the suite is
	 * skipped, saying why, with 77 (ctest's SKIP_RETURN_CODE), never passed */
	if (!cgroup_new(CG_LIMIT, dir, sizeof(dir), why, sizeof(why))) {
		fprintf(stderr, "test_memory: skipped: %s\n", why);
		return 77;
	}
	if (rmdir(dir) < 0) {
		fprintf(stderr, "test_memory: rmdir %s: %s\n", dir, strerror(errno));
		return 1;
	}
	return run_suite(memory_suite());
}
