/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Huge pages (client/huge.c), run by tests/huge.sh as root with the machine set for them:
 * DLPC_TEST_HUGE=thp with shmem_enabled "advise" or "within_size" (the copy path, the warm pool
 * and dlpc_alloc() give huge pages, and an attacher maps them one PMD per 2 MiB; a fork() in
 * another thread never leaves a child the copy path's writable mapping), or
 * DLPC_TEST_HUGE=hugetlb with a hugetlbfs pool reserved (with DLPC_HUGE_PAGES=hugetlb only, the
 * copy path takes its pages, the storage's size rounded up to whole huge pages, an attacher maps
 * and unmaps it whole, and copy-on-write attachers reserve none of the pool).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

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

/* The value (kB) of @p field in this process's /proc/self/smaps for the mapping holding @p p;
 * -1 if @p p is not mapped. */
static long smaps_kb(const void *p, const char *field)
{
	char line[512];
	FILE *f = fopen("/proc/self/smaps", "re");
	bool in = false;
	long kb = -1;

	ck_assert_ptr_nonnull(f);
	while (fgets(line, sizeof(line), f)) {
		unsigned long lo, hi;
		char name[64];

		if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, ' ') &&
		    sscanf(line, "%63[A-Za-z_]:", name) != 1) {
			if (in)
				break;
			in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
			continue;
		}
		if (in && strncmp(line, field, strlen(field)) == 0 &&
		    sscanf(line + strlen(field), " %ld", &kb) == 1)
			break;
	}
	fclose(f);
	return kb;
}

/* The value of @p field ("HugePages_Free", "HugePages_Rsvd") in /proc/meminfo: a count of
 * hugetlbfs pages of the default size. */
static long meminfo(const char *field)
{
	char line[128];
	FILE *f = fopen("/proc/meminfo", "re");
	size_t n = strlen(field);
	long v = -1;

	ck_assert_ptr_nonnull(f);
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, field, n) == 0 && line[n] == ':' &&
		    sscanf(line + n + 1, " %ld", &v) == 1)
			break;
	fclose(f);
	return v;
}

/* A free huge page count of hugetlbfs, from /proc/meminfo. */
static long hugetlb_free(void)
{
	return meminfo("HugePages_Free");
}

struct want {
	const char *name;
	size_t size;
	int fill;
	const char *field; /* of smaps, for the attacher's mapping */
	long kb;	   /* its value */
};

/* A child process: attach want->name, read all of it, check its bytes and its mapping, release
 * it, and check the mapping went. */
static int attacher(void *arg)
{
	const struct want *w = arg;
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t;
	const uint8_t *p;
	bool same = true;
	int before = dlpc_mappings();
	long kb;

	CHILD_CHECK(dlpc_attach(c, w->name, NULL, &t) > 0);
	p = t->dl_tensor.data;
	for (size_t i = 0; i < w->size; i++)
		same &= p[i] == (uint8_t)w->fill;
	CHILD_CHECK(same);
	kb = smaps_kb(p, w->field);
	if (kb != w->kb) {
		fprintf(stderr, "%s: %s %ld kB, want %ld kB\n", w->name, w->field, kb, w->kb);
		_exit(1);
	}
	t->deleter(t);
	CHILD_CHECK(dlpc_mappings() == before); /* unmapped whole */
	dlpc_close(c);
	return 0;
}

/* The copy path, a miss of the warm pool and a take: an attacher maps it all by PMDs. (The
 * first publish only notes the size; the second, a miss, has the pool keep one.) */
START_TEST(test_thp_publish)
{
	dlpc_client *c = connect_or_die(&D);
	struct want w1 = {"h/one", 64 * MIB, 1, "ShmemPmdMapped:", 64 * 1024};
	struct want w2 = {"h/two", 64 * MIB, 2, "ShmemPmdMapped:", 64 * 1024};

	publish_filled(c, "h/zero", w1.size, 3);
	publish_filled(c, w1.name, w1.size, w1.fill);
	ck_assert_int_eq(wait_child(spawn(attacher, &w1)), 0);
	usleep((useconds_t)scaled_ms(500) * 1000); /* the pool fills meanwhile, or not: both go */
	publish_filled(c, w2.name, w2.size, w2.fill);
	ck_assert_int_eq(wait_child(spawn(attacher, &w2)), 0);
	dlpc_close(c);
}
END_TEST

/* Publishes of the copy path while another thread forks: with shmem_enabled "advise" each one
 * writes through a mapping of its own (the pool off), which no child may inherit (a writable
 * mapping anywhere fails the seal with EBUSY), however close to the mmap() the fork comes. */
#define FORK_PUBLISHES 1000
#define FORK_CHILDREN 32

static atomic_bool forking;

static void *forker(void *arg)
{
	unsigned *forks = arg;

	unsigned alive = 0;

	/* as many forks as can be: children hold what they inherited a while, not waited for */
	while (atomic_load(&forking)) {
		pid_t pid = alive < FORK_CHILDREN ? fork() : -1;

		if (pid == 0) {
			usleep(2000);
			_exit(0);
		}
		alive += pid > 0;
		*forks += pid > 0;
		while (alive > 0 && waitpid(-1, NULL, alive < FORK_CHILDREN ? WNOHANG : 0) > 0)
			alive--;
	}
	while (alive > 0 && waitpid(-1, NULL, 0) > 0)
		alive--;
	return NULL;
}

START_TEST(test_thp_publish_fork)
{
	dlpc_client *c;
	pthread_t t;
	unsigned forks = 0;
	int r = 0;

	setenv(DLPC_WARM_BYTES_ENV, "0", 1);
	c = connect_or_die(&D);
	atomic_store(&forking, true);
	ck_assert_int_eq(pthread_create(&t, NULL, forker, &forks), 0);
	for (int i = 0; i < FORK_PUBLISHES && r >= 0; i++) {
		int64_t shape[1] = {2 * MIB};
		uint8_t *src = calloc(1, 2 * MIB);

		ck_assert_ptr_nonnull(src);
		r = dlpc_publish(
			c, "h/fork",
			host_tensor(src, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			DLPC_PUBLISH_REPLACE);
		free(src);
	}
	atomic_store(&forking, false);
	pthread_join(t, NULL);
	ck_assert_msg(r > 0, "a publish while forking failed: %d: %s", r, dlpc_last_error());
	ck_assert_uint_gt(forks, 0);
	dlpc_close(c);
}
END_TEST

/* dlpc_alloc(): huge pages in the publisher's mapping, and in an attacher's. */
START_TEST(test_thp_alloc)
{
	dlpc_client *c = connect_or_die(&D);
	int64_t shape[1] = {64 * MIB};
	struct want w = {"h/alloc", 64 * MIB, 3, "ShmemPmdMapped:", 64 * 1024};
	DLManagedTensorVersioned *t;

	ck_assert_dlpc(
		dlpc_alloc(c, (DLDevice){kDLCPU, 0}, (DLDataType){kDLUInt, 8, 1}, 1, shape, &t), 0);
	memset(t->dl_tensor.data, 3, w.size);
	ck_assert_int_eq(smaps_kb(t->dl_tensor.data, "ShmemPmdMapped:"), 64 * 1024);
	ck_assert_dlpc(dlpc_publish(c, w.name, t, 0) > 0, 1);
	ck_assert_int_eq(wait_child(spawn(attacher, &w)), 0);
	dlpc_close(c);
}
END_TEST

/* Wait (a scaled 5 s at most) for hugetlbfs to have @p n pages free again; whether it did. */
static bool wait_free(long n)
{
	for (int i = 0; i < scaled_ms(5000) / 10 && hugetlb_free() != n; i++)
		usleep(10000);
	return hugetlb_free() == n;
}

/* The copy path takes the pool's pages, whole ones (3 MiB and a page: 2 of 2 MiB), and gives
 * them back with the entry; an attacher maps and unmaps them. */
START_TEST(test_hugetlb_publish)
{
	dlpc_client *c = connect_or_die(&D);
	struct want w = {"h/tlb", 3 * MIB + 4096, 4, "KernelPageSize:", 2048};
	struct want big = {"h/tlbbig", 64 * MIB, 5, "KernelPageSize:", 2048};
	long before = hugetlb_free();
	dlpc_entry_info *list;
	size_t n;

	setenv(DLPC_HUGE_PAGES_ENV, "hugetlb", 1);
	publish_filled(c, w.name, w.size, w.fill);
	ck_assert_int_eq(hugetlb_free(), before - 2);
	ck_assert_dlpc(dlpc_list(c, w.name, &list, &n), 0);
	ck_assert_int_eq(n, 1);
	ck_assert_int_eq(list[0].nbytes, 4 * MIB); /* what it takes: whole huge pages */
	dlpc_list_free(list, n);
	ck_assert_int_eq(wait_child(spawn(attacher, &w)), 0);
	publish_filled(c, big.name, big.size, big.fill);
	ck_assert_int_eq(hugetlb_free(), before - 2 - 32);
	ck_assert_int_eq(wait_child(spawn(attacher, &big)), 0);
	ck_assert_dlpc(dlpc_unpublish(c, w.name), 0);
	ck_assert_dlpc(dlpc_unpublish(c, big.name), 0);
	ck_assert_msg(wait_free(before), "hugetlbfs pages not given back: %ld free, %ld before",
		      hugetlb_free(), before);
	dlpc_close(c);
}
END_TEST

/* A child process: attach want->name copy-on-write (DLPC_ATTACH_PRIVATE) and read all of it,
 * while the hugetlbfs pool lacks room for another copy of it: the mapping neither fails nor
 * reserves or takes the pool's pages. A write then copies one page. */
static int cow_attacher(void *arg)
{
	const struct want *w = arg;
	dlpc_client *c = connect_or_die(&D);
	dlpc_attach_opts o = {.size = sizeof(o), .flags = DLPC_ATTACH_PRIVATE};
	long free_before = hugetlb_free(), rsvd_before = meminfo("HugePages_Rsvd");
	DLManagedTensorVersioned *t;
	uint8_t *p;
	bool same = true;

	CHILD_CHECK(dlpc_attach(c, w->name, &o, &t) > 0);
	p = t->dl_tensor.data;
	for (size_t i = 0; i < w->size; i++)
		same &= p[i] == (uint8_t)w->fill;
	CHILD_CHECK(same);
	if (hugetlb_free() != free_before || meminfo("HugePages_Rsvd") != rsvd_before) {
		fprintf(stderr,
			"copy-on-write attach: HugePages_Free %ld -> %ld, Rsvd %ld -> %ld\n",
			free_before, hugetlb_free(), rsvd_before, meminfo("HugePages_Rsvd"));
		_exit(1);
	}
	CHILD_CHECK(smaps_kb(p, "KernelPageSize:") == 2048);
	p[0] = (uint8_t)(w->fill + 1); /* its own copy of the first huge page */
	CHILD_CHECK(hugetlb_free() == free_before - 1);
	t->deleter(t);
	CHILD_CHECK(hugetlb_free() == free_before);
	dlpc_close(c);
	return 0;
}

/* A copy-on-write attacher of a hugetlbfs storage, the pool nearly full, maps it with no
 * reservation, one after the other; the publisher's bytes stay as they were. */
START_TEST(test_hugetlb_cow_attach)
{
	dlpc_client *c = connect_or_die(&D);
	struct want w = {"h/cow", 64 * MIB, 7, "KernelPageSize:", 2048};
	long before = hugetlb_free(), left;
	bool filler;
	pid_t a, b;

	setenv(DLPC_HUGE_PAGES_ENV, "hugetlb", 1);
	publish_filled(c, w.name, w.size, w.fill);
	ck_assert_int_eq(hugetlb_free(), before - 32);
	/* leave 2 pages free: no room for the 32 a reserving mapping would take */
	filler = hugetlb_free() > 2;
	if (filler)
		publish_filled(c, "h/filler", (size_t)(hugetlb_free() - 2) * 2 * MIB, 8);
	left = hugetlb_free();
	ck_assert_int_eq(left, 2);
	a = spawn(cow_attacher, &w);
	ck_assert_int_eq(wait_child(a), 0);
	b = spawn(cow_attacher, &w);
	ck_assert_int_eq(wait_child(b), 0);
	ck_assert_int_eq(hugetlb_free(), left);
	ck_assert_int_eq(wait_child(spawn(attacher, &w)), 0); /* unchanged by their writes */
	ck_assert_dlpc(dlpc_unpublish(c, w.name), 0);
	if (filler)
		ck_assert_dlpc(dlpc_unpublish(c, "h/filler"), 0);
	ck_assert_msg(wait_free(before), "hugetlbfs pages not given back: %ld free, %ld before",
		      hugetlb_free(), before);
	dlpc_close(c);
}
END_TEST

/* Unless DLPC_HUGE_PAGES=hugetlb asks for it, the copy path leaves the hugetlbfs pool alone:
 * by default (auto) as with thp. */
START_TEST(test_hugetlb_not_asked)
{
	const char *modes[] = {NULL, "auto", "thp"};
	long before = hugetlb_free();

	for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
		struct want w = {"h/small", 8 * MIB, 6, "KernelPageSize:", 4};
		dlpc_client *c;

		if (modes[i])
			setenv(DLPC_HUGE_PAGES_ENV, modes[i], 1);
		else
			unsetenv(DLPC_HUGE_PAGES_ENV);
		c = connect_or_die(&D);
		publish_filled(c, w.name, w.size, w.fill);
		ck_assert_int_eq(hugetlb_free(), before);
		ck_assert_int_eq(wait_child(spawn(attacher, &w)), 0);
		ck_assert_dlpc(dlpc_unpublish(c, w.name), 0);
		dlpc_close(c);
	}
}
END_TEST

int main(void)
{
	const char *kind = getenv("DLPC_TEST_HUGE");
	Suite *s = suite_create("huge");
	TCase *tc = tcase_create(kind ? kind : "none");

	if (!kind || (strcmp(kind, "thp") != 0 && strcmp(kind, "hugetlb") != 0)) {
		fprintf(stderr, "test_huge: set DLPC_TEST_HUGE to thp or hugetlb (tests/huge.sh "
				"does, as root, with the machine set for it)\n");
		return 77;
	}
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 60);
	if (strcmp(kind, "thp") == 0) {
		tcase_add_test(tc, test_thp_publish);
		tcase_add_test(tc, test_thp_alloc);
		tcase_add_test(tc, test_thp_publish_fork);
	} else {
		tcase_add_test(tc, test_hugetlb_publish);
		tcase_add_test(tc, test_hugetlb_cow_attach);
		tcase_add_test(tc, test_hugetlb_not_asked);
	}
	suite_add_tcase(s, tc);
	return run_suite(s);
}
