/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Huge pages for shared memory: what the machine allows, read at run time, and what
 * $DLPC_HUGE_PAGES asks.
 *
 * Shared memory (tmpfs, memfds) gets transparent huge pages as
 * /sys/kernel/mm/transparent_hugepage/shmem_enabled says (and, on kernels with huge pages of
 * several sizes, hugepages-<PMD>kB/shmem_enabled, unless "inherit"): "always" and
 * "within_size" give them to every write and fallocate by themselves; "advise" only to pages
 * first touched through a mapping marked MADV_HUGEPAGE; "never" and "deny" never. A hugetlbfs
 * pool is what an operator reserved (vm.nr_hugepages): a memfd made with MFD_HUGETLB takes
 * pages from it, its size a whole number of huge pages, written through a mapping (hugetlbfs
 * has no write()). Both are read again for each storage large enough: an operator may change
 * them while the process runs.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "region.h"

#define THP_DIR "/sys/kernel/mm/transparent_hugepage/"

/* The first line of @p path into @p buf; false if it cannot be read. */
static bool read_line(const char *path, char *buf, size_t cap)
{
	FILE *f = fopen(path, "re");
	bool ok = f && fgets(buf, (int)cap, f);

	if (f)
		fclose(f);
	return ok;
}

/* The bracketed word of a sysfs choice ("always [advise] never") into @p word. */
static bool chosen(const char *path, char *word, size_t cap)
{
	char line[256], *open, *close;

	if (!read_line(path, line, sizeof(line)) || !(open = strchr(line, '[')) ||
	    !(close = strchr(open, ']')) || (size_t)(close - open) > cap)
		return false;
	memcpy(word, open + 1, (size_t)(close - open - 1));
	word[close - open - 1] = 0;
	return true;
}

uint64_t dlpc__huge_pmd(void)
{
	/* read once, by whichever thread comes first (more than one may: they read the same) */
	static uint64_t pmd;
	uint64_t v = __atomic_load_n(&pmd, __ATOMIC_RELAXED);
	char line[64];

	if (v == 0) {
		v = read_line(THP_DIR "hpage_pmd_size", line, sizeof(line))
			    ? strtoull(line, NULL, 10)
			    : (2u << 20);
		v = v ? v : (2u << 20);
		__atomic_store_n(&pmd, v, __ATOMIC_RELAXED);
	}
	return v;
}

/* Shared memory's transparent huge pages for the PMD size, as the kernel is set now. */
static enum dlpc__huge thp_now(void)
{
	char path[128], word[32];

	snprintf(path, sizeof(path), THP_DIR "hugepages-%llukB/shmem_enabled",
		 (unsigned long long)(dlpc__huge_pmd() >> 10));
	if (!chosen(path, word, sizeof(word)) || strcmp(word, "inherit") == 0)
		if (!chosen(THP_DIR "shmem_enabled", word, sizeof(word)))
			return DLPC__HUGE_NONE;
	if (strcmp(word, "always") == 0 || strcmp(word, "within_size") == 0 ||
	    strcmp(word, "force") == 0)
		return DLPC__HUGE_KERNEL;
	return strcmp(word, "advise") == 0 ? DLPC__HUGE_ADVISE : DLPC__HUGE_NONE;
}

/* Free huge pages of hugetlbfs's default size, if that size is the PMD's; 0 otherwise. */
static uint64_t hugetlb_free(void)
{
	FILE *f = fopen("/proc/meminfo", "re");
	unsigned long long free_pages = 0, kb = 0;
	char line[128];

	while (f && fgets(line, sizeof(line), f))
		if (sscanf(line, "HugePages_Free: %llu", &free_pages) != 1)
			sscanf(line, "Hugepagesize: %llu kB", &kb);
	if (f)
		fclose(f);
	return kb << 10 == dlpc__huge_pmd() ? free_pages : 0;
}

enum dlpc__huge dlpc__huge_for(uint64_t size, bool tlb_ok)
{
	const char *want = getenv(DLPC_HUGE_PAGES_ENV);
	uint64_t pmd = dlpc__huge_pmd();
	bool thp = true, tlb = false;

	/* the hugetlbfs pool only when asked for: every copy-on-write attacher's mapping of it
	 * would otherwise reserve a storage's worth of the pool (see map_host() in attach.c) */
	if (want && strcmp(want, "off") == 0)
		thp = false;
	else if (want && strcmp(want, "hugetlb") == 0) {
		thp = false;
		tlb = tlb_ok;
	}
	if (size < pmd)
		return DLPC__HUGE_NONE;
	/* a hugetlbfs pool that holds all of it */
	if (tlb && (size + pmd - 1) / pmd <= hugetlb_free())
		return DLPC__HUGE_TLB;
	return thp ? thp_now() : DLPC__HUGE_NONE;
}

/* Read: a writable mapping made and not yet MADV_DONTFORK; write: a fork(). */
static pthread_rwlock_t fork_guard = PTHREAD_RWLOCK_INITIALIZER;

void dlpc__huge_atfork(int phase)
{
	if (phase == 0)
		pthread_rwlock_wrlock(&fork_guard);
	else if (phase == 1)
		pthread_rwlock_unlock(&fork_guard);
	else
		pthread_rwlock_init(&fork_guard, NULL);
}

void *dlpc__huge_map(int fd, size_t len, bool advise)
{
	void *p;
	int err = 0;

	/* a child forked between the two calls would inherit the mapping, writable: F_SEAL_WRITE
	 * fails while any exists */
	pthread_rwlock_rdlock(&fork_guard);
	p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p != MAP_FAILED && madvise(p, len, MADV_DONTFORK) < 0) {
		err = errno;
		munmap(p, len);
		p = MAP_FAILED;
	}
	pthread_rwlock_unlock(&fork_guard);
	if (p == MAP_FAILED) {
		errno = err ? err : errno;
		return NULL;
	}
	/* advice only: without it the pages are small, but there all the same */
	if (advise)
		(void)madvise(p, len, MADV_HUGEPAGE);
	return p;
}

int dlpc__huge_fill(void *map, uint64_t off, size_t len, int fd)
{
	int r = madvise((uint8_t *)map + off, len, MADV_POPULATE_WRITE) < 0 ? -errno : 0;

	if (r != -EINVAL) /* MADV_POPULATE_WRITE came with Linux 5.14 */
		return r;
	do
		r = fallocate(fd, 0, (off_t)off, (off_t)len);
	while (r < 0 && errno == EINTR);
	return r < 0 ? -errno : 0;
}
