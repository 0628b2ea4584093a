/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A large copy into new shared memory, split over threads.
 *
 * The copy path of a publish writes host tensors into a fresh memfd through a mapping when its
 * pages come from a mapping's faults (huge pages: shmem_enabled "advise", a hugetlbfs pool) or
 * were faulted in by the warm pool. Allocating and zeroing those pages costs about as much as
 * the copy, and one CPU does the zeroing at a fraction of what the memory bus can take: split
 * over the CPUs this thread may run on, each thread allocating and filling a part of its own,
 * a 400 MiB copy into fresh huge pages takes about 0.6x the time on two CPUs. Where the pages
 * are there already, the gain is what memcpy() leaves of the bus, little on a small machine;
 * but the mapping must go before the seal, and taking down 4 KiB pages of shared memory costs
 * about what copying them did (page by page, in the caller's munmap()): asked to
 * (DLPC__SPLIT_DROP), each thread drops its part's pages from the mapping after its copy, so
 * that cost is split too (a 64 MiB publish from a warm memfd: about 0.8x the time on two CPUs).
 *
 * An attach that populates its mapping (DLPC_ATTACH_POPULATE) of 4 KiB pages is split the same
 * way (dlpc__split_populate()), each thread asking for a page per fault-around window: 400 MiB
 * in about 15 ms on two CPUs, against 35 ms for one MADV_POPULATE_READ of it all.
 *
 * The threads are started for one copy and joined before it returns (none is left behind, none
 * is kept idle), with the signals of faults left unblocked (a source that faults reaches the
 * process's handler, as on the caller's thread), and no cancellation of the caller meanwhile. A
 * thread that cannot be started leaves its part to the caller. The copy path's mappings are
 * MADV_DONTFORK: a fork() meanwhile gives the child none of them (dlpc_alloc()'s mapping is the
 * caller's, inherited as the caller would have it).
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base.h"
#include "region.h"

/* One thread's part of a copy (or of a populate): bytes [lo, hi) of the mapping, done by @p fn. */
struct part {
	void *(*fn)(void *);
	const char *name; /* its thread's */
	uint8_t *map;
	uint64_t lo, hi;
	int fd;
	bool populate, drop;
	const struct dlpc__run *runs;
	size_t n;
	pthread_t thread;
	bool started;
	int err; /* of the allocation of the part's pages */
};

/* The first number of file @p name in directory @p dir and, if @p second, the second of the same
 * line into *@p second; false if absent or not a number ("max", "-1"). */
static bool read_nums(const char *dir, const char *name, long long *first, long long *second)
{
	char path[700], line[64];
	FILE *f;
	bool ok;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	if (!(f = fopen(path, "re")))
		return false;
	ok = fgets(line, sizeof(line), f) && (second ? sscanf(line, "%lld %lld", first, second) == 2
						     : sscanf(line, "%lld", first) == 1);
	fclose(f);
	return ok;
}

/* The CPUs the limit of cgroup directory @p dir allows, rounded up (v2: cpu.max; v1: the CFS
 * quota and period); ~0u without one. */
static unsigned dir_cpus(const char *dir, bool v2)
{
	long long quota, period;
	bool ok = v2 ? read_nums(dir, "cpu.max", &quota, &period)
		     : read_nums(dir, "cpu.cfs_quota_us", &quota, NULL) &&
				  read_nums(dir, "cpu.cfs_period_us", &period, NULL);

	if (!ok || quota <= 0 || period <= 0)
		return ~0u;
	return (unsigned)((quota + period - 1) / period);
}

/* The fewest CPUs that the CPU limits of this process's cgroup and its ancestors allow it,
 * rounded up: cgroup v2's cpu.max, or v1's CFS quota (where the cpu controller is mounted at
 * /sys/fs/cgroup/cpu); ~0u where none limits it or none can be read. */
static unsigned cgroup_cpus(void)
{
	FILE *f = fopen("/proc/self/cgroup", "re");
	char line[512], dir[600];
	unsigned best = ~0u;

	while (f && fgets(line, sizeof(line), f)) {
		char *ctrl = strchr(line, ':'), *path = ctrl ? strchr(ctrl + 1, ':') : NULL;
		bool v2 = ctrl && strncmp(line, "0::", 3) == 0;
		size_t root;

		if (!path ||
		    (!v2 && strncmp(ctrl, ":cpu,", 5) != 0 && strncmp(ctrl, ":cpu:", 5) != 0))
			continue;
		path[strcspn(path, "\n")] = 0;
		*path++ = 0;
		root = (size_t)snprintf(dir, sizeof(dir),
					v2 ? "/sys/fs/cgroup" : "/sys/fs/cgroup/%s", ctrl + 1);
		snprintf(dir + root, sizeof(dir) - root, "%s", strcmp(path, "/") ? path : "");
		/* from the process's own cgroup up to the root as this process sees it: in a cgroup
		 * namespace (a container's) that is the container's own cgroup, and its limit; the
		 * machine's root has none (v2: no cpu.max; v1: a quota of -1) */
		for (;;) {
			unsigned n = dir_cpus(dir, v2);

			best = n < best ? n : best;
			if (strlen(dir) <= root)
				break;
			*strrchr(dir, '/') = 0;
		}
	}
	if (f)
		fclose(f);
	return best;
}

unsigned dlpc__split_threads(uint64_t len)
{
	const char *env = getenv(DLPC_COPY_THREADS_ENV);
	unsigned k = DLPC__SPLIT_THREADS_MAX, quota;
	cpu_set_t cpus;

	if (len / DLPC__SPLIT_MIN < 2)
		return 1;
	if (env && *env) {
		char *end;
		unsigned long want = strtoul(env, &end, 10);

		if (*end == 0 && env[0] != '-' && want < k)
			k = want ? (unsigned)want : 1;
	}
	if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0 && (unsigned)CPU_COUNT(&cpus) < k)
		k = (unsigned)CPU_COUNT(&cpus);
	if (k > 1 && (quota = cgroup_cpus()) < k)
		k = quota;
	if (len / DLPC__SPLIT_MIN < k)
		k = (unsigned)(len / DLPC__SPLIT_MIN);
	return k ? k : 1;
}

/* Allocate the part's pages if asked, then copy into it what of every run falls there. */
static void *copy_part(void *arg)
{
	struct part *p = arg;

	if (p->populate) {
		p->err = dlpc__huge_fill(p->map, p->lo, (size_t)(p->hi - p->lo), p->fd);
		if (p->err < 0)
			return NULL;
	}
	for (size_t i = 0; i < p->n; i++) {
		const struct dlpc__run *r = &p->runs[i];
		uint64_t lo = r->off > p->lo ? r->off : p->lo;
		uint64_t hi = r->off + r->len < p->hi ? r->off + r->len : p->hi;

		if (lo < hi)
			memcpy(p->map + lo, (const uint8_t *)r->src + (lo - r->off),
			       (size_t)(hi - lo));
	}
	/* whole pages only (the last part may end inside one): munmap() takes the rest. A failure
	 * costs the time it would have saved, nothing else. */
	if (p->drop) {
		uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), hi = p->hi / page * page;

		if (hi > p->lo)
			(void)madvise(p->map + p->lo, (size_t)(hi - p->lo), MADV_DONTNEED);
	}
	return NULL;
}

/* A part's work on a thread of its own. */
static void *part_thread(void *arg)
{
	struct part *p = arg;

	pthread_setname_np(pthread_self(), p->name);
	return p->fn(p);
}

/* Run the @p k parts, each but the first on a thread of its own (or the caller's, if the
 * thread cannot be started), the first on the caller's, and join them all. The number of
 * threads that ran at once. */
static unsigned run_parts(struct part *parts, unsigned k)
{
	unsigned ran = 1;
	int cancel;

	/* the parts live on the caller's stack until every thread is joined: no cancellation
	 * meanwhile */
	pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &cancel);
	for (unsigned i = 1; i < k; i++)
		if (parts[i].lo < parts[i].hi)
			parts[i].started =
				dlpc__start_joinable(&parts[i].thread, part_thread, &parts[i]);
	parts[0].fn(&parts[0]);
	for (unsigned i = 1; i < k; i++) {
		if (parts[i].started) {
			pthread_join(parts[i].thread, NULL);
			ran++;
		} else if (parts[i].lo < parts[i].hi) {
			parts[i].fn(&parts[i]);
		}
	}
	pthread_setcancelstate(cancel, NULL);
	return ran;
}

/* Lay the @p len bytes out in @p k parts like @p like, each a whole number of @p unit bytes but
 * the last, which ends at @p len whatever the rounding. */
static void lay_out(struct part *parts, unsigned k, uint64_t len, uint64_t unit,
		    const struct part *like)
{
	uint64_t each = ((len + k - 1) / k + unit - 1) / unit * unit;

	for (unsigned i = 0; i < k; i++) {
		parts[i] = *like;
		parts[i].lo = each * i < len ? each * i : len;
		parts[i].hi = i == k - 1 || parts[i].lo + each > len ? len : parts[i].lo + each;
	}
}

int dlpc__split_copy(uint8_t *map, uint64_t len, int fd, unsigned how, const struct dlpc__run *runs,
		     size_t n)
{
	struct part parts[DLPC__SPLIT_THREADS_MAX];
	unsigned k = dlpc__split_threads(len), ran;
	/* on one thread, munmap() alone takes the pages down faster than a drop and then it */
	bool drop = (how & DLPC__SPLIT_DROP) && k > 1;
	struct part like = {.fn = copy_part,
			    .name = "dlpc-copy",
			    .map = map,
			    .fd = fd,
			    .populate = how & DLPC__SPLIT_POPULATE,
			    .drop = drop,
			    .runs = runs,
			    .n = n};
	int err = 0;

	/* whole huge pages to each part when it allocates them, so that no two threads fault one
	 * in, or drops them, so that none drops a part of one (which splits its mapping); whole
	 * pages otherwise */
	lay_out(parts, k, len, like.populate || drop ? dlpc__huge_pmd() : 4096, &like);
	ran = run_parts(parts, k);
	for (unsigned i = 0; i < k && err == 0; i++)
		err = parts[i].err;
	return err < 0 ? err : (int)ran;
}

/* Set once MADV_POPULATE_READ was refused as unknown (EINVAL: before Linux 5.14): no thread is
 * started for it again. */
static _Atomic bool populate_unknown;

/* Map the part's pages (4 KiB ones: the caller checked) as reading them would: one
 * MADV_POPULATE_READ of a page per DLPC__POPULATE_STEP window (aligned), each fault mapping the
 * window's other pages with it. It stops at the first error (an old kernel, a fatal signal, no
 * memory, a file cut short). */
static void *populate_part(void *arg)
{
	struct part *p = arg;
	uintptr_t at = (uintptr_t)p->map + p->lo, end = (uintptr_t)p->map + p->hi;
	int saved = errno;

	for (; at < end; at = (at & ~(uintptr_t)(DLPC__POPULATE_STEP - 1)) + DLPC__POPULATE_STEP)
		if (madvise((void *)(at & ~(uintptr_t)4095), 4096, MADV_POPULATE_READ) < 0) {
			if (errno == EINVAL)
				atomic_store(&populate_unknown, true);
			break;
		}
	errno = saved;
	return NULL;
}

unsigned dlpc__split_populate(void *base, size_t len)
{
	struct part parts[DLPC__SPLIT_THREADS_MAX];
	unsigned k = dlpc__split_threads(len);
	struct part like = {.fn = populate_part, .name = "dlpc-populate", .map = base};

	if (atomic_load(&populate_unknown))
		return 0;
	/* the first window on this thread first: a kernel that does not know the advice says so
	 * before any thread is started */
	lay_out(parts, 1, len < DLPC__POPULATE_STEP ? len : DLPC__POPULATE_STEP, 4096, &like);
	populate_part(&parts[0]);
	if (atomic_load(&populate_unknown))
		return 0;
	lay_out(parts, k, len, dlpc__huge_pmd(), &like);
	return run_parts(parts, k);
}
