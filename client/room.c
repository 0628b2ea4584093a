/* SPDX-License-Identifier: Apache-2.0 */
/* Room for shared memory: the file size limit, the machine's memory, the memory cgroups; and
 * the memfds it goes in (dlpc__memfd_open(), below alloc.c and warm.c, which both make them). */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "region.h"

#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif
/*
 * What the memory cgroups of this process can still be charged is asked before every memfd is
 * sized, so that a publish that cannot fit fails with ENOSPC instead of the cgroup's OOM killer
 * ending the process halfway through writing it. Asking must cost little next to the smallest
 * publish, so what rarely changes is kept: the cgroups with a limit are found from
 * /proc/self/cgroup, their limits read, and each one's usage file kept open (CLOEXEC) to be
 * read afresh with one pread per check. That is looked up again after a fork (a child is often
 * moved to a cgroup of its own), once a second (a process moved by someone else, a limit
 * changed), before refusing, and when /proc/self/cgroup, read again before every allocation of
 * CG_RECHECK_SIZE or more (cheap next to it, and where being wrong costs most), has changed.
 */

/* How long the cgroups and limits found are trusted. */
#define CG_RECHECK_NS 1000000000LL
/* Allocations from this size first check that the process is still in the same cgroups. */
#define CG_RECHECK_SIZE (16u << 20)
/* Memory cgroups with a limit followed per process (its own and its ancestors'). */
#define CG_LEVELS_MAX 8
/* Longest cgroup file path, and the most of /proc/self/cgroup read. */
#define CG_PATH_MAX 4096
#define CG_SELF_MAX 8192

/* The files of a memory cgroup hierarchy. */
struct cg_kind {
	const char *mount, *max, *used, *swmax, *swused, *cache;
	bool memsw; /* swmax and swused count memory and swap together (v1) */
};

static const struct cg_kind cg_kinds[] = {
	{"/sys/fs/cgroup", "memory.max", "memory.current", "memory.swap.max", "memory.swap.current",
	 "inactive_file", false},
	{"/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
	 "memory.memsw.limit_in_bytes", "memory.memsw.usage_in_bytes", "total_inactive_file", true},
};

/* A kept-open file, and what it is: an fd closed by someone else may be reused for another. */
struct cg_file {
	int fd;
	dev_t dev;
	ino_t ino;
};

/* A memory cgroup of this process with a limit below the machine's memory. */
struct cg_level {
	const struct cg_kind *kind;
	char *dir;
	uint64_t max, swmax; /* its limits when found; swmax UINT64_MAX if swap is not limited */
	struct cg_file used, sw; /* usage files; sw.fd -1 where swap does not count */
};

static struct {
	pthread_mutex_t mu;
	bool found;		/* false: look again at the next check (never looked, or forked) */
	int64_t found_ns;	/* when they were found, CLOCK_MONOTONIC_COARSE */
	uint64_t machine;	/* the machine's memory and swap */
	uint64_t totalswap;	/* its swap */
	char self[CG_SELF_MAX]; /* /proc/self/cgroup as it was then */
	char now[CG_SELF_MAX];	/* and as it is now, when looked at again */
	struct cg_level lv[CG_LEVELS_MAX];
	int n;
} cg = {.mu = PTHREAD_MUTEX_INITIALIZER};

static pthread_once_t cg_once = PTHREAD_ONCE_INIT;

static void cg_lock(void)
{
	pthread_mutex_lock(&cg.mu);
}

static void cg_unlock(void)
{
	pthread_mutex_unlock(&cg.mu);
}

/* In a forked child the kept files stay valid, but the child may be moved: look again. */
static void cg_child(void)
{
	cg.found = false;
	pthread_mutex_unlock(&cg.mu);
}

static void cg_atfork(void)
{
	pthread_atfork(cg_lock, cg_unlock, cg_child);
}

static int64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static uint64_t sub0(uint64_t a, uint64_t b)
{
	return a > b ? a - b : 0;
}

/*
 * Up to @p len - 1 bytes of the file @p path, NUL-terminated, into @p buf; length or -1. One
 * read: cgroup and /proc files fill as much of it as they have at once.
 */
static ssize_t read_text(const char *path, char *buf, size_t len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	ssize_t n;

	assert(len > 0);
	if (fd < 0)
		return -1;
	n = read(fd, buf, len - 1);
	close(fd);
	buf[n > 0 ? n : 0] = 0;
	return n;
}

/* A number from the one-line file @p file of cgroup @p dir; false if absent or "max". */
static bool read_u64(const char *dir, const char *file, uint64_t *v)
{
	char path[CG_PATH_MAX], buf[32];

	if (snprintf(path, sizeof(path), "%s/%s", dir, file) >= (int)sizeof(path) ||
	    read_text(path, buf, sizeof(buf)) <= 0 || buf[0] < '0' || buf[0] > '9')
		return false;
	*v = strtoull(buf, NULL, 10);
	return true;
}

/* The number in kept file @p f now; false if it cannot be read. */
static bool pread_u64(const struct cg_file *f, uint64_t *v)
{
	char buf[32];
	ssize_t n = pread(f->fd, buf, sizeof(buf) - 1, 0);

	if (n <= 0)
		return false;
	buf[n] = 0;
	if (buf[0] < '0' || buf[0] > '9')
		return false;
	*v = strtoull(buf, NULL, 10);
	return true;
}

/* The value of @p key in the memory.stat of cgroup @p dir, or 0. */
static uint64_t read_stat(const char *dir, const char *key)
{
	char path[CG_PATH_MAX], buf[8192];
	size_t klen = strlen(key);

	if (snprintf(path, sizeof(path), "%s/memory.stat", dir) >= (int)sizeof(path) ||
	    read_text(path, buf, sizeof(buf)) <= 0)
		return 0;
	for (char *line = buf; line; line = strchr(line, '\n'), line = line ? line + 1 : NULL)
		if (strncmp(line, key, klen) == 0 && line[klen] == ' ')
			return strtoull(line + klen + 1, NULL, 10);
	return 0;
}

static bool file_open(const char *dir, const char *file, struct cg_file *f)
{
	char path[CG_PATH_MAX];
	struct stat st;

	f->fd = -1;
	if (snprintf(path, sizeof(path), "%s/%s", dir, file) >= (int)sizeof(path))
		return false;
	f->fd = open(path, O_RDONLY | O_CLOEXEC);
	if (f->fd >= 0 && fstat(f->fd, &st) == 0) {
		f->dev = st.st_dev;
		f->ino = st.st_ino;
		return true;
	}
	if (f->fd >= 0)
		close(f->fd);
	f->fd = -1;
	return false;
}

/* Close @p f, unless its number now belongs to another file (closed and reused behind us). */
static void file_close(struct cg_file *f)
{
	struct stat st;

	if (f->fd >= 0 && fstat(f->fd, &st) == 0 && st.st_dev == f->dev && st.st_ino == f->ino)
		close(f->fd);
	f->fd = -1;
}

/* Follow cgroup @p dir of kind @p k if it has a limit that can matter. */
static void cg_level_add(const struct cg_kind *k, const char *dir)
{
	struct cg_level *l = &cg.lv[cg.n];
	uint64_t max, swmax;

	/* no limit, or one above all the memory there is: nothing for this cgroup to refuse */
	if (cg.n == CG_LEVELS_MAX || !read_u64(dir, k->max, &max) || max >= cg.machine)
		return;
	*l = (struct cg_level){.kind = k, .max = max, .swmax = UINT64_MAX};
	l->sw.fd = -1;
	if (!file_open(dir, k->used, &l->used))
		return;
	/* where there is swap, a cgroup's pages over its memory limit go there, up to its swap
	 * limit if it has one */
	if (cg.totalswap && read_u64(dir, k->swmax, &swmax) &&
	    swmax < (k->memsw ? cg.machine : cg.totalswap) && file_open(dir, k->swused, &l->sw))
		l->swmax = swmax;
	l->dir = strdup(dir);
	if (!l->dir) {
		file_close(&l->used);
		file_close(&l->sw);
		return;
	}
	cg.n++;
}

static void cg_forget(void)
{
	for (int i = 0; i < cg.n; i++) {
		file_close(&cg.lv[i].used);
		file_close(&cg.lv[i].sw);
		free(cg.lv[i].dir);
	}
	cg.n = 0;
}

/* Has this process been moved to other cgroups since they were found? (Reads cg.now.) */
static bool cg_moved(void)
{
	if (read_text("/proc/self/cgroup", cg.now, sizeof(cg.now)) < 0)
		cg.now[0] = 0;
	return strcmp(cg.now, cg.self) != 0;
}

/* Find the memory cgroups of this process from cg.now (/proc/self/cgroup) and their limits. */
static void cg_find(int64_t now)
{
	char line[CG_PATH_MAX], dir[CG_PATH_MAX];
	struct sysinfo si;
	const char *p;

	cg_forget();
	cg.found = true;
	cg.found_ns = now;
	memcpy(cg.self, cg.now, sizeof(cg.self));
	cg.machine = UINT64_MAX;
	cg.totalswap = 0;
	if (sysinfo(&si) == 0) {
		cg.machine = ((uint64_t)si.totalram + si.totalswap) * si.mem_unit;
		cg.totalswap = (uint64_t)si.totalswap * si.mem_unit;
	}
	for (p = cg.self; *p; p += strcspn(p, "\n"), p += *p == '\n') {
		size_t len = strcspn(p, "\n");
		char *ctl, *path;
		const struct cg_kind *k;

		snprintf(line, sizeof(line), "%.*s", (int)len, p);
		ctl = strchr(line, ':');
		path = ctl ? strchr(ctl + 1, ':') : NULL;
		if (!path)
			continue;
		*path++ = 0;
		ctl++;
		if (strcmp(line, "0") == 0 && !*ctl)
			k = &cg_kinds[0];
		else if (strstr(ctl, "memory") && !strstr(ctl, "name="))
			k = &cg_kinds[1];
		else
			continue;
		/* from the process's cgroup up to the top of the hierarchy */
		while (*path == '/' && path[1]) {
			char *slash = strrchr(path, '/');

			snprintf(dir, sizeof(dir), "%s%s", k->mount, path);
			cg_level_add(k, dir);
			if (slash == path)
				break;
			*slash = 0;
		}
		/* and the mount's own top: in a container without a cgroup namespace the path
		 * above names the host's hierarchy, while the container's limit is mounted here */
		cg_level_add(k, k->mount);
	}
}

/*
 * Bytes cgroup @p l can still be charged, its usage less @p cache, with @p freeswap bytes of
 * swap free on the machine; false if its usage cannot be read.
 */
static bool level_room(const struct cg_level *l, uint64_t cache, uint64_t freeswap, uint64_t *room)
{
	uint64_t used, swused, mem;

	if (!pread_u64(&l->used, &used) || (l->sw.fd >= 0 && !pread_u64(&l->sw, &swused)))
		return false;
	mem = sub0(l->max, sub0(used, cache));
	*room = mem + freeswap < mem ? UINT64_MAX : mem + freeswap;
	if (l->sw.fd < 0)
		return true;
	if (l->kind->memsw) /* v1: memory and swap against one limit */
		*room = *room < sub0(l->swmax, sub0(swused, cache))
				? *room
				: sub0(l->swmax, sub0(swused, cache));
	else /* v2: swap against a limit of its own */
		*room = mem +
			(freeswap < sub0(l->swmax, swused) ? freeswap : sub0(l->swmax, swused));
	return true;
}

/*
 * The least room among the cgroups followed into *@p room (UINT64_MAX if none limits) and the
 * cgroup that has it into *@p at (NULL if none); false if a usage could not be read.
 */
static bool cg_room(uint64_t size, uint64_t *room, const struct cg_level **at)
{
	uint64_t freeswap = 0, r;
	struct sysinfo si;
	bool ok = true;

	*room = UINT64_MAX;
	*at = NULL;
	if (cg.n && cg.totalswap && sysinfo(&si) == 0)
		freeswap = (uint64_t)si.freeswap * si.mem_unit;
	for (int i = 0; i < cg.n; i++) {
		const struct cg_level *l = &cg.lv[i];

		if (!level_room(l, 0, freeswap, &r)) {
			ok = false;
			continue;
		}
		/* page cache it could drop is no obstacle: the kernel reclaims it before charging
		 * fails (read only when it makes the difference: memory.stat is slow to read) */
		if (size > r && !level_room(l, read_stat(l->dir, l->kind->cache), freeswap, &r))
			ok = false;
		else if (r < *room) {
			*room = r;
			*at = l;
		}
	}
	return ok;
}

/* Does @p size fit a cgroup's @p room, DLPC__ROOM_RESERVE left besides (UINT64_MAX: no limit)? */
static bool fits_room(uint64_t size, uint64_t room)
{
	return room == UINT64_MAX ||
	       (room >= DLPC__ROOM_RESERVE && size <= room - DLPC__ROOM_RESERVE);
}

/*
 * Refuse sizes that cannot work before the kernel is asked: one over the file size limit would
 * get SIGXFSZ (which kills by default) from ftruncate, and one over the machine's memory and swap,
 * or over what the memory cgroups have left, would have fallocate or the writes take memory until
 * the OOM killer steps in (memfds are not on /dev/shm and have no size limit of their own).
 */
int dlpc__size_fits(const char *name, uint64_t size)
{
	char dir[CG_PATH_MAX] = "";
	uint64_t machine, room = UINT64_MAX, limit = 0;
	int64_t now = now_ns();
	const struct cg_level *at;
	struct rlimit rl;
	bool fresh, ok;

	if (getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && size > rl.rlim_cur)
		return dlpc__fail(-EFBIG,
				  "cannot create %llu bytes of shared memory for '%s': this "
				  "process's file size limit (RLIMIT_FSIZE) is %llu bytes",
				  (unsigned long long)size, name, (unsigned long long)rl.rlim_cur);
	pthread_once(&cg_once, cg_atfork);
	cg_lock();
	fresh = !cg.found || now - cg.found_ns >= CG_RECHECK_NS;
	if (fresh || (size >= CG_RECHECK_SIZE && cg_moved())) {
		if (fresh)
			cg_moved();
		cg_find(now);
		fresh = true;
	}
	machine = cg.machine;
	if (size <= machine) {
		ok = cg_room(size + DLPC__ROOM_RESERVE, &room, &at);
		/* what was found may be stale (moved, a limit raised, a kept file closed behind
		 * our back): never refuse on it */
		if ((!ok || !fits_room(size, room)) && !fresh) {
			cg_moved();
			cg_find(now);
			cg_room(size + DLPC__ROOM_RESERVE, &room, &at);
		}
		if (!fits_room(size, room) && at) {
			snprintf(dir, sizeof(dir), "%s", at->dir);
			limit = at->max;
		}
	}
	cg_unlock();
	if (size > machine)
		return dlpc__fail(-ENOSPC,
				  "cannot reserve %llu bytes of shared memory for '%s': "
				  "this machine has %llu bytes of memory and swap",
				  (unsigned long long)size, name, (unsigned long long)machine);
	if (!fits_room(size, room))
		return dlpc__fail(
			-ENOSPC,
			"cannot reserve %llu bytes of shared memory for '%s': "
			"this process's memory cgroup has %llu bytes left, of which %u are "
			"left to the process (%s, limit %llu bytes)",
			(unsigned long long)size, name, (unsigned long long)room,
			DLPC__ROOM_RESERVE, dir, (unsigned long long)limit);
	return 0;
}

int dlpc__memfd_open(const char *name, uint64_t size, unsigned flags)
{
	char label[64];
	int fd, r;

	snprintf(label, sizeof(label), "dlpc:%s", name);
	fd = memfd_create(label, MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL | flags);
	if (fd < 0 && errno == EINVAL) /* kernels before 6.3 */
		fd = memfd_create(label, MFD_CLOEXEC | MFD_ALLOW_SEALING | flags);
	if (fd < 0)
		return dlpc__fail(-errno, "cannot create shared memory for '%s': memfd_create: %m",
				  name);
	if (ftruncate(fd, (off_t)size) < 0) {
		r = dlpc__fail(-errno, "cannot size shared memory for '%s' to %llu bytes: %m", name,
			       (unsigned long long)size);
		close(fd);
		return r;
	}
	return fd;
}
