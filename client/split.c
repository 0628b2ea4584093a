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
 * are there already, the gain is what memcpy() leaves of the bus, little on a small machine.
 *
 * The threads are started for one copy and joined before it returns (none is left behind, none
 * is kept idle). A thread that cannot be started leaves its part to the caller. The copy path's
 * mappings are MADV_DONTFORK: a fork() meanwhile gives the child none of them.
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"
#include "region.h"

/* One thread's part of a copy: bytes [lo, hi) of the mapping. */
struct part {
	uint8_t *map;
	uint64_t lo, hi;
	int fd;
	bool populate;
	const struct dlpc__run *runs;
	size_t n;
	pthread_t thread;
	bool started;
	int err; /* of the allocation of the part's pages */
};

unsigned dlpc__split_threads(uint64_t len)
{
	const char *env = getenv(DLPC_COPY_THREADS_ENV);
	unsigned k = DLPC__SPLIT_THREADS_MAX;
	cpu_set_t cpus;

	if (env && *env) {
		char *end;
		unsigned long want = strtoul(env, &end, 10);

		if (*end == 0 && env[0] != '-' && want < k)
			k = want ? (unsigned)want : 1;
	}
	if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0 && (unsigned)CPU_COUNT(&cpus) < k)
		k = (unsigned)CPU_COUNT(&cpus);
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
	return NULL;
}

/* copy_part() on a thread of its own. */
static void *part_thread(void *arg)
{
	pthread_setname_np(pthread_self(), "dlpc-copy");
	return copy_part(arg);
}

int dlpc__split_copy(uint8_t *map, uint64_t len, int fd, bool populate,
		     const struct dlpc__run *runs, size_t n)
{
	struct part parts[DLPC__SPLIT_THREADS_MAX];
	unsigned k = dlpc__split_threads(len), ran = 1;
	uint64_t pmd = dlpc__huge_pmd();
	/* whole huge pages to each part, so that no two threads fault one in */
	uint64_t each = (len / k + pmd - 1) / pmd * pmd;
	int err = 0;

	for (unsigned i = 0; i < k; i++) {
		uint64_t lo = each * i < len ? each * i : len;

		parts[i] = (struct part){
			map,   lo, lo + each < len ? lo + each : len, fd, populate, runs, n, 0,
			false, 0};
	}
	for (unsigned i = 1; i < k; i++)
		if (parts[i].lo < parts[i].hi)
			parts[i].started =
				dlpc__start_joinable(&parts[i].thread, part_thread, &parts[i]);
	copy_part(&parts[0]);
	for (unsigned i = 1; i < k; i++) {
		if (parts[i].started) {
			pthread_join(parts[i].thread, NULL);
			ran++;
		} else if (parts[i].lo < parts[i].hi) {
			copy_part(&parts[i]);
		}
	}
	for (unsigned i = 0; i < k && err == 0; i++)
		err = parts[i].err;
	return err < 0 ? err : (int)ran;
}
