/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The warm pool (client/warm.c): the copy path of a publish takes memfds whose pages a
 * background thread allocated; such a storage is sealed read-only like any other, never handed
 * out twice, bounded in bytes ($DLPC_WARM_BYTES), given back when idle ($DLPC_WARM_IDLE_MS),
 * off with DLPC_WARM_BYTES=0, gone with the last client, and not the child's after a fork.
 *
 * The pool's memfds are found by their label: /proc/self/fd links "/memfd:dlpc:warm (deleted)".
 * A size is kept from its second use within the idle time on (publish_twice()).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "harness.h"
#include "limits.h"

#define MIB (1u << 20)
#define WARM_LINK "/memfd:dlpc:warm (deleted)"
#define SEALS_RO (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL)

static struct daemon D;

static void setup(void)
{
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

/* The fds of this process on memfds labelled @p link; in *@p bytes (if not NULL) the bytes
 * allocated to them, in *@p filled (if not NULL) how many have every page allocated. */
static int fds_scan(const char *link, uint64_t *bytes, int *filled)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	int n = 0;

	ck_assert_ptr_nonnull(d);
	if (bytes)
		*bytes = 0;
	if (filled)
		*filled = 0;
	while ((e = readdir(d))) {
		char path[300], target[300];
		struct stat st;
		ssize_t len;

		snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
		len = readlink(path, target, sizeof(target) - 1);
		if (len <= 0)
			continue;
		target[len] = 0;
		if (strcmp(target, link) != 0)
			continue;
		n++;
		if (stat(path, &st) != 0)
			continue;
		if (bytes)
			*bytes += (uint64_t)st.st_blocks * 512;
		if (filled)
			*filled += (uint64_t)st.st_blocks * 512 >= (uint64_t)st.st_size;
	}
	closedir(d);
	return n;
}

static int fds_on(const char *link, uint64_t *bytes)
{
	return fds_scan(link, bytes, NULL);
}

/* Does the pool hold @p n memfds, each with every page allocated? A fill's memfd shows before
 * its pages are there; a publish then would find nothing ready. */
static bool warm_ready(int n)
{
	int filled;

	return fds_scan(WARM_LINK, NULL, &filled) == n && filled == n;
}

/* Wait (a scaled 5 s at most) until the pool holds @p n memfds, filled; whether it did. */
static bool wait_warm(int n)
{
	for (int i = 0; i < scaled_ms(5000) / 5; i++) {
		if (warm_ready(n))
			return true;
		usleep(5000);
	}
	return warm_ready(n);
}

/* Wait until this process maps @p n memfds of libdlpc's: a fill makes its memfd (seen by
 * wait_warm()) an instant before it maps it. */
static bool wait_mappings(int n)
{
	for (int i = 0; i < scaled_ms(5000) / 5; i++) {
		if (dlpc_mappings() == n)
			return true;
		usleep(5000);
	}
	return dlpc_mappings() == n;
}

/* Publish @p size bytes of @p fill as @p name, and as @p name with "~" first: the second use of
 * a size is the one that has the pool keep a memfd of it (the first only notes the size). */
static void publish_twice(dlpc_client *c, const char *name, size_t size, int fill)
{
	char first[64];

	snprintf(first, sizeof(first), "%s~", name);
	publish_filled(c, first, size, fill);
	publish_filled(c, name, size, fill);
}

/* What an attacher sees of @p name: its bytes all @p fill, its memfd's seals, label and inode. */
struct seen {
	bool bytes_ok;
	int seals;
	char label[128];
	ino_t ino;
};

/* Where this process maps @p p: the /proc/self/map_files path and the label of its line. */
static bool mapped_file(const void *p, char *file, size_t cap, char *label, size_t lcap)
{
	char line[512];
	FILE *f = fopen("/proc/self/maps", "re");
	bool found = false;

	while (f && !found && fgets(line, sizeof(line), f)) {
		unsigned long lo, hi;
		char *slash = strchr(line, '/');

		if (sscanf(line, "%lx-%lx", &lo, &hi) != 2 || (uintptr_t)p < lo ||
		    (uintptr_t)p >= hi)
			continue;
		snprintf(file, cap, "/proc/self/map_files/%lx-%lx", lo, hi);
		snprintf(label, lcap, "%s", slash ? slash : "");
		label[strcspn(label, "\n")] = 0;
		found = true;
	}
	if (f)
		fclose(f);
	return found;
}

/* In this process: attach @p name and look at it (see struct seen). 0 or -1. */
static int look(dlpc_client *c, const char *name, size_t size, int fill, struct seen *s)
{
	DLManagedTensorVersioned *t;
	char file[96];
	const uint8_t *p;
	struct stat st;
	int fd;

	memset(s, 0, sizeof(*s));
	if (dlpc_attach(c, name, NULL, &t) < 0)
		return -1;
	p = t->dl_tensor.data;
	s->bytes_ok = true;
	for (size_t i = 0; i < size; i++)
		s->bytes_ok &= p[i] == (uint8_t)fill;
	if (!mapped_file(p, file, sizeof(file), s->label, sizeof(s->label)))
		return -1;
	fd = open(file, O_RDONLY | O_CLOEXEC);
	if (fd < 0 || fstat(fd, &st) < 0)
		return -1;
	s->seals = fcntl(fd, F_GET_SEALS);
	s->ino = st.st_ino;
	close(fd);
	/* the attacher's mapping cannot be made writable */
	if (mprotect((void *)((uintptr_t)p & ~(uintptr_t)4095), 4096, PROT_READ | PROT_WRITE) == 0)
		s->seals = -1;
	t->deleter(t);
	return 0;
}

struct look_args {
	const char *name;
	size_t size;
	int fill;
	const char *label;
};

/* A child process: attach args->name and check it is a sealed read-only copy from the pool. */
static int attacher(void *arg)
{
	const struct look_args *a = arg;
	dlpc_client *c = connect_or_die(&D);
	struct seen s;

	CHILD_CHECK(look(c, a->name, a->size, a->fill, &s) == 0);
	CHILD_CHECK(s.bytes_ok);
	CHILD_CHECK((s.seals & SEALS_RO) == SEALS_RO);
	if (strcmp(s.label, a->label) != 0) {
		fprintf(stderr, "%s is mapped from '%s', not '%s'\n", a->name, s.label, a->label);
		_exit(1);
	}
	dlpc_close(c);
	return 0;
}

/* A publish once the pool is warm writes into the pool's memfd, sealed read-only. */
START_TEST(test_warm_publish_is_sealed)
{
	dlpc_client *c;
	struct look_args a = {"w/sealed", 3 * MIB, 7, WARM_LINK};

	/* the first use is not forgotten before the second: under valgrind a publish is slow */
	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1);
	c = connect_or_die(&D);
	publish_filled(c, "w/once", 3 * MIB, 1); /* a miss: the pool notes the size, no more */
	usleep((useconds_t)scaled_ms(300) * 1000);
	ck_assert_int_eq(fds_on(WARM_LINK, NULL), 0);
	publish_filled(c, "w/first", 3 * MIB, 1); /* a miss again: now it keeps one */
	ck_assert_msg(wait_warm(1), "the pool made no memfd after two 3 MiB publishes");
	publish_filled(c, a.name, a.size, a.fill);
	ck_assert_int_eq(wait_child(spawn(attacher, &a)), 0);
	dlpc_close(c);
}
END_TEST

#define TWICE_N 6

/* A child process: the TWICE_N entries w/n<i> hold bytes i+1 each, and no two share a memfd. */
static int distinct_attacher(void *arg)
{
	dlpc_client *c = connect_or_die(&D);
	ino_t inos[TWICE_N];
	int warm = 0;

	(void)arg;
	for (int i = 0; i < TWICE_N; i++) {
		char name[32];
		struct seen s;

		snprintf(name, sizeof(name), "w/n%d", i);
		CHILD_CHECK(look(c, name, MIB, i + 1, &s) == 0);
		CHILD_CHECK(s.bytes_ok);
		CHILD_CHECK((s.seals & SEALS_RO) == SEALS_RO);
		warm += strcmp(s.label, WARM_LINK) == 0;
		inos[i] = s.ino;
		for (int j = 0; j < i; j++)
			CHILD_CHECK(inos[j] != inos[i]);
	}
	CHILD_CHECK(warm >= TWICE_N - 2); /* the first two were misses */
	dlpc_close(c);
	return 0;
}

/* The same size published again and again: each storage is a memfd of its own, and what was
 * published before is never written again. */
START_TEST(test_warm_never_twice)
{
	dlpc_client *c = connect_or_die(&D);

	for (int i = 0; i < TWICE_N; i++) {
		char name[32];

		snprintf(name, sizeof(name), "w/n%d", i);
		publish_filled(c, name, MIB, i + 1);
		ck_assert_msg(i == 0 || wait_warm(1), "the pool was not refilled after publish %d",
			      i);
	}
	ck_assert_int_eq(wait_child(spawn(distinct_attacher, NULL)), 0);
	dlpc_close(c);
}
END_TEST

/* $DLPC_WARM_BYTES bounds the bytes kept warm: a size that would pass it is not kept. */
START_TEST(test_warm_bytes_bound)
{
	dlpc_client *c;
	uint64_t bytes;

	setenv(DLPC_WARM_BYTES_ENV, "3145728", 1); /* 3 MiB */
	c = connect_or_die(&D);
	publish_twice(c, "w/b1", MIB, 1);
	ck_assert(wait_warm(1));
	publish_twice(c, "w/b2", 2 * MIB, 2);
	ck_assert(wait_warm(2));
	publish_twice(c, "w/b4", 4 * MIB, 4); /* no room left for it: misses, and no fill */
	publish_filled(c, "w/b1again", MIB, 1);
	ck_assert(wait_warm(2));
	ck_assert_int_eq(fds_on(WARM_LINK, &bytes), 2);
	ck_assert_msg(bytes <= 3 * MIB, "%llu bytes kept warm", (unsigned long long)bytes);
	dlpc_close(c);
}
END_TEST

/* The pool keeps memfds for the DLPC__WARM_SIZES_MAX sizes used last, one each when each was
 * used twice: the older sizes' go. */
START_TEST(test_warm_sizes_bound)
{
	dlpc_client *c;
	int n = DLPC__WARM_SIZES_MAX + 2;

	/* nothing falls idle meanwhile: under valgrind these publishes take longer than the
	 * default idle time, and the first sizes' memfds would be given back before the count */
	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1);
	c = connect_or_die(&D);
	for (int i = 0; i < n; i++) {
		char name[32];

		snprintf(name, sizeof(name), "w/s%d", i);
		publish_twice(c, name, (size_t)(i + 1) * MIB, i + 1);
	}
	ck_assert(wait_warm(DLPC__WARM_SIZES_MAX));
	usleep((useconds_t)scaled_ms(300) * 1000); /* nothing more comes */
	ck_assert_int_eq(fds_on(WARM_LINK, NULL), DLPC__WARM_SIZES_MAX);
	dlpc_close(c);
}
END_TEST

/* A size of the pool's class @p k (0..DLPC__WARM_SIZES_MAX-1): each a quarter or more above
 * the one before, so that no two classes share memfds (a memfd serves a storage up to an
 * eighth smaller than itself). */
static size_t class_size(int k)
{
	size_t s = MIB;

	for (int i = 0; i < k; i++)
		s += s / 4 + 64 * 1024;
	return s;
}

/* Publish @p misses sizes of class @p k, each 64 KiB larger than the one before: each is a
 * miss (the memfds ready for the class are all smaller than it); the first notes the class,
 * each later one asks the pool for one more memfd of it, up to DLPC__WARM_DEPTH_MAX. */
static void publish_misses(dlpc_client *c, int k, int misses)
{
	for (int i = 0; i < misses; i++) {
		char name[32];

		snprintf(name, sizeof(name), "w/c%d.%d", k, i);
		publish_filled(c, name, class_size(k) + (size_t)i * 64 * 1024, i + 1);
	}
}

/* However often a size misses, the pool keeps DLPC__WARM_DEPTH_MAX memfds of it, no more. */
START_TEST(test_warm_depth_bound)
{
	dlpc_client *c;
	uint64_t bytes;
	int misses = DLPC__WARM_DEPTH_MAX + 3;

	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1);
	c = connect_or_die(&D);
	publish_misses(c, 3, misses);
	ck_assert_msg(wait_warm(DLPC__WARM_DEPTH_MAX), "the pool holds %d memfds after %d misses",
		      fds_on(WARM_LINK, NULL), misses);
	usleep((useconds_t)scaled_ms(300) * 1000); /* nothing more comes */
	ck_assert_int_eq(fds_on(WARM_LINK, &bytes), DLPC__WARM_DEPTH_MAX);
	/* all of the size last asked for: those too small for it were given back */
	ck_assert_uint_ge(bytes, DLPC__WARM_DEPTH_MAX *
					 (class_size(3) + (uint64_t)(misses - 1) * 64 * 1024));
	dlpc_close(c);
}
END_TEST

/* Every size the pool keeps (DLPC__WARM_SIZES_MAX) used at the depth it allows: DLPC__WARM_FDS_MAX
 * memfds, no more, also once one more size takes the place of the least recently used one. */
START_TEST(test_warm_fds_bound)
{
	dlpc_client *c;

	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1);
	c = connect_or_die(&D);
	for (int k = 0; k < DLPC__WARM_SIZES_MAX; k++)
		publish_misses(c, k, DLPC__WARM_DEPTH_MAX + 1);
	ck_assert_msg(wait_warm(DLPC__WARM_FDS_MAX), "the pool holds %d memfds, not %d",
		      fds_on(WARM_LINK, NULL), DLPC__WARM_FDS_MAX);
	/* a size more: its memfds take the place of the least recently used size's */
	publish_misses(c, DLPC__WARM_SIZES_MAX, DLPC__WARM_DEPTH_MAX + 1);
	usleep((useconds_t)scaled_ms(300) * 1000);
	ck_assert_int_le(fds_on(WARM_LINK, NULL), DLPC__WARM_FDS_MAX);
	ck_assert(wait_warm(DLPC__WARM_FDS_MAX));
	dlpc_close(c);
}
END_TEST

/* A $DLPC_WARM_IDLE_MS past DLPC__WARM_IDLE_MS_MAX is that maximum: the pool keeps its memfds
 * (a deadline of now + the value as given would wrap around and give them back at once). */
START_TEST(test_warm_idle_max)
{
	dlpc_client *c;

	setenv(DLPC_WARM_IDLE_MS_ENV, "9223372036854775807", 1);
	c = connect_or_die(&D);
	publish_twice(c, "w/long", 2 * MIB, 1);
	ck_assert_msg(wait_warm(1), "no memfd kept with DLPC_WARM_IDLE_MS=INT64_MAX");
	usleep((useconds_t)scaled_ms(300) * 1000);
	ck_assert_int_eq(fds_on(WARM_LINK, NULL), 1);
	dlpc_close(c);
}
END_TEST

/* The thread's voluntary context switches: how often it woke. */
static long thread_wakes(void)
{
	DIR *d = opendir("/proc/self/task");
	struct dirent *e;
	long wakes = -1;

	ck_assert_ptr_nonnull(d);
	while ((e = readdir(d))) {
		char path[300], line[256];
		FILE *f;
		bool ours = false;

		snprintf(path, sizeof(path), "/proc/self/task/%s/status", e->d_name);
		f = fopen(path, "re");
		while (f && fgets(line, sizeof(line), f)) {
			ours |= strcmp(line, "Name:\tdlpc-warm\n") == 0;
			if (ours && sscanf(line, "voluntary_ctxt_switches: %ld", &wakes) == 1)
				break;
		}
		if (f)
			fclose(f);
		if (ours)
			break;
	}
	closedir(d);
	return wakes;
}

/* The pool gives its memory back once idle for $DLPC_WARM_IDLE_MS, and its thread then sleeps
 * (no wake-up at all while nothing is published). */
START_TEST(test_warm_idle)
{
	dlpc_client *c;
	char idle[32];
	long wakes;

	/* scaled: the two publishes of a size fall within it under valgrind too */
	snprintf(idle, sizeof(idle), "%d", scaled_ms(200));
	setenv(DLPC_WARM_IDLE_MS_ENV, idle, 1);
	c = connect_or_die(&D);
	publish_twice(c, "w/idle", 2 * MIB, 1);
	ck_assert(wait_warm(1));
	ck_assert_msg(wait_warm(0), "the pool kept its memfd past DLPC_WARM_IDLE_MS");
	usleep((useconds_t)scaled_ms(200) * 1000); /* its thread goes to sleep after closing */
	wakes = thread_wakes();
	ck_assert_int_ge(wakes, 0);
	usleep(500000);
	ck_assert_int_eq(thread_wakes(), wakes);
	/* and it comes back to life */
	publish_twice(c, "w/idle2", 2 * MIB, 2);
	ck_assert(wait_warm(1));
	dlpc_close(c);
}
END_TEST

/* DLPC_WARM_BYTES=0: today's path, a fresh memfd labelled with the name, and no pool. */
START_TEST(test_warm_off)
{
	dlpc_client *c;
	struct look_args a = {"w/off", 2 * MIB, 9, "/memfd:dlpc:w/off (deleted)"};

	setenv(DLPC_WARM_BYTES_ENV, "0", 1);
	c = connect_or_die(&D);
	publish_filled(c, "w/off0", 2 * MIB, 1);
	publish_filled(c, a.name, a.size, a.fill);
	usleep(100000);
	ck_assert_int_eq(fds_on(WARM_LINK, NULL), 0);
	ck_assert_int_eq(wait_child(spawn(attacher, &a)), 0);
	dlpc_close(c);
}
END_TEST

/* dlpc_close() of the last client leaves no memfd of the pool's, a fill under way included. */
START_TEST(test_warm_last_close)
{
	dlpc_client *c = connect_or_die(&D);

	publish_twice(c, "w/close", 64 * MIB, 1);
	dlpc_close(c); /* most likely while the thread fills */
	/* the last reference may be the library thread's, which lets the client go a moment later */
	ck_assert(wait_warm(0));
	c = connect_or_die(&D);
	publish_twice(c, "w/close2", MIB, 1);
	ck_assert(wait_warm(1));
	dlpc_close(c);
	ck_assert(wait_warm(0));
}
END_TEST

/* A forked child: holds none of the parent's warm memfds, publishes with a pool of its own, and
 * empties it when its last client (the inherited one too) is closed. */
static int forked_publisher(void *arg)
{
	dlpc_client *c;
	struct look_args a = {"w/child2", MIB, 5, WARM_LINK};

	CHILD_CHECK(fds_on(WARM_LINK, NULL) == 0);
	c = connect_or_die(&D);
	publish_twice(c, "w/child1", MIB, 4);
	CHILD_CHECK(wait_warm(1));
	publish_filled(c, a.name, a.size, a.fill);
	CHILD_CHECK(wait_child(spawn(attacher, &a)) == 0);
	dlpc_close(arg); /* the parent's client, inherited */
	dlpc_close(c);
	CHILD_CHECK(wait_warm(0));
	return 0;
}

START_TEST(test_warm_fork)
{
	dlpc_client *c;
	struct look_args a = {"w/parent2", MIB, 6, WARM_LINK};

	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1); /* nothing falls idle meanwhile */
	c = connect_or_die(&D);
	publish_twice(c, "w/parent1", MIB, 3);
	ck_assert(wait_warm(1));
	ck_assert_int_eq(dlpc_mappings(), 0); /* below DLPC__WARM_MAP_MIN: not mapped */
	ck_assert_int_eq(wait_child(spawn(forked_publisher, c)), 0);
	/* the parent's pool is whole: its memfd is still there, and taken */
	ck_assert_int_eq(fds_on(WARM_LINK, NULL), 1);
	publish_filled(c, a.name, a.size, a.fill);
	ck_assert_int_eq(wait_child(spawn(attacher, &a)), 0);
	dlpc_close(c);
	ck_assert(wait_warm(0));
}
END_TEST

/* A size the pool keeps mapped in the process (DLPC__WARM_MAP_MIN), its pages faulted in. */
#define MAPPED (2 * (size_t)DLPC__WARM_MAP_MIN)

/* The pipes between mapped_child() and its parent: the child says it is done on up[1], then
 * lives until the parent closes down[1]. */
struct pipes {
	int up[2];
	int down[2];
};

/* A child forked while the parent's pool holds a mapped memfd: it has no mapping of the
 * parent's, publishes with a pool of its own (mapped too), and stays alive while the parent
 * takes and seals the memfd it was forked with. */
static int mapped_child(void *arg)
{
	const struct pipes *p = arg;
	dlpc_client *c;
	char b;

	close(p->up[0]);
	close(p->down[1]);
	CHILD_CHECK(dlpc_mappings() == 0);
	c = connect_or_die(&D);
	publish_twice(c, "w/mchild1", MAPPED, 7);
	CHILD_CHECK(wait_warm(1));
	CHILD_CHECK(wait_mappings(1));
	publish_filled(c, "w/mchild2", MAPPED, 8);
	CHILD_CHECK(write(p->up[1], "", 1) == 1);
	CHILD_CHECK(read(p->down[0], &b, 1) == 0);
	dlpc_close(c);
	return 0;
}

/* Publish @p size bytes of @p fill as @p name, writable (not sealed against writes: a mapping
 * left behind would not fail the seal). */
static void publish_writable(dlpc_client *c, const char *name, size_t size, int fill)
{
	int64_t shape[1] = {(int64_t)size};
	uint8_t *src = malloc(size);

	ck_assert_ptr_nonnull(src);
	memset(src, fill, size);
	ck_assert_dlpc(
		dlpc_publish(c, name,
			     host_tensor(src, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     DLPC_PUBLISH_WRITABLE),
		1);
	free(src);
}

/* Large memfds of the pool are mapped here until taken; a publish leaves no mapping of its
 * storage behind (the process maps no more memfds than the pool holds); a child forked meanwhile
 * inherits none of those mappings, so the parent's seal of the memfd goes through while the child
 * lives; the last close unmaps them all. */
START_TEST(test_warm_mapped)
{
	struct look_args a = {"w/m2", MAPPED, 2, WARM_LINK};
	struct pipes p;
	int maps;
	dlpc_client *c;
	pid_t pid;
	char b;

	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1); /* nothing falls idle meanwhile */
	c = connect_or_die(&D);
	publish_twice(c, "w/m1", MAPPED, 1);
	ck_assert(wait_warm(1));
	ck_assert(wait_mappings(1));
	ck_assert_int_eq(pipe(p.up), 0);
	ck_assert_int_eq(pipe(p.down), 0);
	pid = spawn(mapped_child, &p);
	close(p.up[1]);
	close(p.down[0]);
	ck_assert_int_eq(read(p.up[0], &b, 1), 1);
	publish_filled(c, a.name, a.size, a.fill); /* sealed: the child maps none of it */
	ck_assert_int_eq(wait_child(spawn(attacher, &a)), 0);
	close(p.down[1]);
	close(p.up[0]);
	ck_assert_int_eq(wait_child(pid), 0);
	for (int i = 0; i < 3; i++) {
		char name[32];

		snprintf(name, sizeof(name), "w/mw%d", i);
		publish_writable(c, name, MAPPED, 3 + i);
		maps = dlpc_mappings(); /* before the fds: a fill meanwhile adds an fd first */
		ck_assert_int_le(maps, fds_on(WARM_LINK, NULL));
	}
	dlpc_close(c);
	ck_assert(wait_warm(0));
	ck_assert_int_eq(dlpc_mappings(), 0);
}
END_TEST

/* dlpc_alloc() of MAPPED - ALLOC_LESS bytes: fits the pool's memfds of MAPPED bytes, and
 * leaves a tail of theirs to cut off. */
#define ALLOC_LESS (MIB - 4096)

struct alloc_args {
	const uint8_t *p;
	size_t len;
};

/* A child forked while the parent holds dlpc_alloc() memory from the pool: it inherits the
 * mapping (the pool's own are kept from children) and reads the parent's bytes. */
static int alloc_reader(void *arg)
{
	const struct alloc_args *a = arg;

	for (size_t i = 0; i < a->len; i += 4096)
		CHILD_CHECK(a->p[i] == (uint8_t)(i / 4096));
	return 0;
}

/* dlpc_alloc() of @p len bytes from the pool: the pool's memfd is in its list of ready ones only
 * once its pages are faulted in, an instant after wait_warm() and wait_mappings() see it, so an
 * allocation that came too early (its own memfd, "dlpc_alloc") is freed and asked again, for a
 * scaled 5 s at most. The tensor, its memfd's label in *@p label. */
static DLManagedTensorVersioned *alloc_from_pool(dlpc_client *c, size_t len, char *label,
						 size_t lcap)
{
	int64_t shape[1] = {(int64_t)len};
	DLManagedTensorVersioned *t;
	char file[96];

	for (int i = 0;; i++) {
		ck_assert_dlpc(dlpc_alloc(c, (DLDevice){kDLCPU, 0}, (DLDataType){kDLUInt, 8, 1}, 1,
					  shape, &t),
			       0);
		ck_assert(mapped_file(t->dl_tensor.data, file, sizeof(file), label, lcap));
		if (strcmp(label, WARM_LINK) == 0 || i >= scaled_ms(5000) / 20)
			return t;
		t->deleter(t);
		usleep(20000);
	}
}

/* dlpc_alloc() of a size the pool keeps takes the pool's memfd, mapped with its pages in
 * already (no fault to fill it), its tail past the size cut off; a forked child inherits it;
 * published, it is sealed read-only like any allocation. */
START_TEST(test_warm_alloc)
{
	const size_t len = MAPPED - ALLOC_LESS;
	struct look_args a = {"w/alloc", len, 0, WARM_LINK};
	char file[96], label[128];
	unsigned long lo, hi;
	DLManagedTensorVersioned *t;
	dlpc_client *c;
	uint8_t *p;

	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1); /* nothing falls idle meanwhile */
	c = connect_or_die(&D);
	publish_twice(c, "w/a1", MAPPED, 1); /* misses: the pool keeps the size */
	ck_assert(wait_warm(1));
	t = alloc_from_pool(c, len, label, sizeof(label));
	ck_assert_str_eq(label, WARM_LINK);
	p = t->dl_tensor.data;
	ck_assert(mapped_file(p, file, sizeof(file), label, sizeof(label)));
	ck_assert_int_eq(sscanf(strrchr(file, '/') + 1, "%lx-%lx", &lo, &hi), 2);
	ck_assert_uint_eq(hi - lo, (len + 4095) / 4096 * 4096);
	ck_assert_uint_eq(pages_mapped(p, len), (len + 4095) / 4096);
	for (size_t i = 0; i < len; i += 4096)
		p[i] = (uint8_t)(i / 4096);
	{
		struct alloc_args r = {p, len};

		ck_assert_int_eq(wait_child(spawn(alloc_reader, &r)), 0);
	}
	memset(p, 0, len);
	ck_assert_dlpc(dlpc_publish(c, a.name, t, 0), 1);
	ck_assert_int_eq(wait_child(spawn(attacher, &a)), 0);
	dlpc_close(c);
	ck_assert(wait_warm(0));
}
END_TEST

/* A dlpc_alloc() buffer sent on a channel again and again (dlpc_tensor_share()): the pool
 * refills after its first send only, so the size falls idle and its memfd is given back while
 * the buffer still goes; a buffer taken from the pool again after a kept size also works. */
START_TEST(test_warm_buffer_sent_again)
{
	const size_t size = 2 * MIB;
	int64_t shape[1] = {(int64_t)size};
	DLManagedTensorVersioned *t;
	dlpc_client *c;
	char idle[32];
	bool gone = false;

	snprintf(idle, sizeof(idle), "%d", scaled_ms(300));
	setenv(DLPC_WARM_IDLE_MS_ENV, idle, 1);
	c = connect_or_die(&D);
	ck_assert_dlpc(dlpc_channel_open(c, "w/again", 1000, NULL), 1);
	publish_filled(c, "w/again0", size, 1); /* the size's first use */
	ck_assert_dlpc(
		dlpc_alloc(c, (DLDevice){kDLCPU, 0}, (DLDataType){kDLUInt, 8, 1}, 1, shape, &t),
		0); /* its second: the pool keeps it, refilled after the first send */
	memset(t->dl_tensor.data, 5, size);
	ck_assert_dlpc(dlpc_send(c, "w/again", dlpc_tensor_share(t), 0), 0);
	ck_assert(wait_warm(1));
	/* sent every 20 ms (scaled), for up to 10 idle times (150 sends, within the channel's
	 * capacity): the memfd goes all the same */
	for (int i = 0; !gone && i < 150; i++) {
		ck_assert_dlpc(dlpc_send(c, "w/again", dlpc_tensor_share(t), 0), 0);
		gone = fds_on(WARM_LINK, NULL) == 0;
		usleep((useconds_t)scaled_ms(20) * 1000);
	}
	ck_assert_msg(gone, "the pool kept a memfd while one buffer was resent");
	t->deleter(t);
	ck_assert_dlpc(dlpc_channel_remove(c, "w/again"), 0);
	dlpc_close(c);
}
END_TEST

/* A channel's buffers (dlpc_channel_alloc()) are made once and recycled: never from the pool,
 * which keeps its memfd of that size for a publish, and they note no size. */
START_TEST(test_warm_channel_buffers)
{
	const size_t size = 3 * MIB;
	int64_t shape[1] = {(int64_t)size};
	DLManagedTensorVersioned *b[3];
	char file[96], label[128];
	dlpc_client *c;

	setenv(DLPC_WARM_IDLE_MS_ENV, "600000", 1);
	c = connect_or_die(&D);
	ck_assert_dlpc(dlpc_channel_open(c, "w/bufs", 8, NULL), 1);
	publish_twice(c, "w/kept", size, 1);
	ck_assert(wait_warm(1));
	for (int i = 0; i < 3; i++) {
		ck_assert_dlpc(dlpc_channel_alloc(c, "w/bufs", (DLDataType){kDLUInt, 8, 1}, 1,
						  shape, &b[i]),
			       0);
		ck_assert(mapped_file(b[i]->dl_tensor.data, file, sizeof(file), label,
				      sizeof(label)));
		ck_assert_str_ne(label, WARM_LINK);
	}
	usleep((useconds_t)scaled_ms(300) * 1000);
	ck_assert_int_eq(fds_on(WARM_LINK, NULL), 1); /* the pool's, untouched */
	for (int i = 0; i < 3; i++)
		b[i]->deleter(b[i]);
	ck_assert_dlpc(dlpc_channel_remove(c, "w/bufs"), 0);
	dlpc_close(c);
}
END_TEST

static Suite *warm_suite(void)
{
	Suite *s = suite_create("warm");
	TCase *tc = tcase_create("pool");

	tcase_add_checked_fixture(tc, setup, teardown);
	/* scaled: under valgrind on a busy machine a case takes minutes */
	tcase_set_timeout(tc, scaled_ms(60000) / 1000);
	tcase_add_test(tc, test_warm_publish_is_sealed);
	tcase_add_test(tc, test_warm_never_twice);
	tcase_add_test(tc, test_warm_bytes_bound);
	tcase_add_test(tc, test_warm_sizes_bound);
	tcase_add_test(tc, test_warm_depth_bound);
	tcase_add_test(tc, test_warm_fds_bound);
	tcase_add_test(tc, test_warm_idle_max);
	tcase_add_test(tc, test_warm_idle);
	tcase_add_test(tc, test_warm_off);
	tcase_add_test(tc, test_warm_last_close);
	tcase_add_test(tc, test_warm_fork);
	tcase_add_test(tc, test_warm_mapped);
	tcase_add_test(tc, test_warm_alloc);
	tcase_add_test(tc, test_warm_buffer_sent_again);
	tcase_add_test(tc, test_warm_channel_buffers);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(warm_suite());
}
