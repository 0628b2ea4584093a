/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Integrity of read-only entries, across real processes: the publisher of dlpc_alloc() memory
 * cannot write its own entry by any route once it is published, while attachers (one of them
 * another uid) read the same bytes throughout; a storage someone still maps writable never
 * becomes a read-only entry; copy-on-write attaches keep their writes to themselves; and an
 * attached tensor says who published it.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/utsname.h>
#include <sys/wait.h>

#include "raw.h"

#ifndef F_SEAL_EXEC
#define F_SEAL_EXEC 0x0020
#endif
#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif

#define SEALS_RO (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL)
#define SEALS_RW (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
#define PAGE 4096
#define SZ (4 * PAGE) /* every storage here: four pages */

static const DLDataType u8 = {kDLUInt, 8, 1};
static const DLDevice cpu = {kDLCPU, 0};
static struct daemon D;
/* What every watcher must read, in memory shared with them (MAP_SHARED, anonymous). */
static uint8_t *expect;

static void setup(void)
{
	daemon_start(&D);
	expect = mmap(NULL, SZ, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ck_assert_ptr_ne(expect, MAP_FAILED);
}

static void teardown(void)
{
	munmap(expect, SZ);
	daemon_stop(&D);
}

static void pattern(uint8_t *p, size_t n, uint8_t seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)(i * 7 + seed);
}

/* In a child that is meant to die of SIGSEGV: leave no core file behind. */
static void no_core(void)
{
	struct rlimit none = {0, 0};

	CHILD_CHECK(setrlimit(RLIMIT_CORE, &none) == 0);
	CHILD_CHECK(prctl(PR_SET_DUMPABLE, 0) == 0);
}

/* ---- storing through a pointer, catching the fault ---- */

static sigjmp_buf fault_jmp;
static volatile sig_atomic_t fault_code;

static void on_segv(int sig, siginfo_t *si, void *uc)
{
	(void)sig;
	(void)uc;
	fault_code = si->si_code;
	siglongjmp(fault_jmp, 1);
}

/* Store @p v at @p p in this process; true if the store faulted (an access error) instead. */
static bool store_faults(volatile uint8_t *p, uint8_t v)
{
	struct sigaction sa = {.sa_sigaction = on_segv, .sa_flags = SA_SIGINFO}, old;
	volatile bool faulted = false;

	sigemptyset(&sa.sa_mask);
	ck_assert_int_eq(sigaction(SIGSEGV, &sa, &old), 0);
	if (sigsetjmp(fault_jmp, 1) == 0)
		*p = v;
	else
		faulted = true;
	ck_assert_int_eq(sigaction(SIGSEGV, &old, NULL), 0);
	if (faulted)
		ck_assert_int_eq(fault_code, SEGV_ACCERR);
	return faulted;
}

/* ---- where this process maps a storage ---- */

/* Where this process maps @p p: the permissions, /proc/self/map_files path, device and inode
 * of its /proc/self/maps line. */
struct mapping {
	char perms[5];
	char file[96];
	dev_t dev;
	ino_t ino;
};

static void mapping_of(const void *p, struct mapping *m)
{
	char line[512];
	FILE *f = fopen("/proc/self/maps", "re");
	bool found = false;

	ck_assert_ptr_nonnull(f);
	while (!found && fgets(line, sizeof(line), f)) {
		unsigned long lo, hi, ino;
		unsigned maj, min;

		if (sscanf(line, "%lx-%lx %4s %*x %x:%x %lu", &lo, &hi, m->perms, &maj, &min,
			   &ino) == 6 &&
		    (uintptr_t)p >= lo && (uintptr_t)p < hi) {
			snprintf(m->file, sizeof(m->file), "/proc/self/map_files/%lx-%lx", lo, hi);
			m->dev = makedev(maj, min);
			m->ino = (ino_t)ino;
			found = true;
		}
	}
	fclose(f);
	ck_assert_msg(found, "%p is not mapped", p);
}

/* The fd of this process open on the file mapped by @p m (libdlpc's memfd). */
static int fd_of(const struct mapping *m)
{
	struct stat st;
	char path[64];

	for (int fd = 3; fd < 1024; fd++) {
		snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
		if (stat(path, &st) == 0 && st.st_dev == m->dev && st.st_ino == m->ino)
			return fd;
	}
	ck_abort_msg("no fd of this process is open on %s", m->file);
	return -1;
}

/* ---- watchers: attachers in other processes that compare what they read with expect ---- */

struct watcher {
	const char *name; /* the entry they attach */
	bool nobody;	  /* run as uid 65534 */
	pid_t pid;
	int cmd[2], ans[2];
};

/* In the watcher: hold one attachment, and on each 'c' compare it and a fresh one. */
static int watch(void *arg)
{
	struct watcher *w = arg;
	DLManagedTensorVersioned *held, *fresh;
	dlpc_client *c;
	char op;

	close(w->cmd[1]);
	close(w->ans[0]);
	if (w->nobody)
		become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, w->name, NULL, &held) > 0);
	while (read(w->cmd[0], &op, 1) == 1) {
		const uint8_t *a, *b;
		bool same;

		CHILD_CHECK(dlpc_attach(c, w->name, NULL, &fresh) > 0);
		a = held->dl_tensor.data;
		b = fresh->dl_tensor.data;
		same = memcmp(a, expect, SZ) == 0 && memcmp(b, expect, SZ) == 0;
		for (size_t i = 0; !same && i < SZ; i++)
			if (a[i] != expect[i] || b[i] != expect[i]) {
				fprintf(stderr,
					"uid %d: byte %zu: held %u, fresh %u, expected %u\n",
					(int)getuid(), i, a[i], b[i], expect[i]);
				break;
			}
		fresh->deleter(fresh);
		CHILD_CHECK(write(w->ans[1], same ? "y" : "n", 1) == 1);
	}
	held->deleter(held);
	dlpc_close(c);
	return 0;
}

/* Start a watcher of @p name as this uid and, when we are root, one as nobody: how many. */
static size_t watchers_start(struct watcher ws[2], const char *name)
{
	size_t n = getuid() == 0 ? 2 : 1;

	if (n == 1)
		fprintf(stderr, "not root: no watcher as uid %d (the second uid is skipped)\n",
			NOBODY);
	else
		daemon_open_for_others(&D);
	for (size_t i = 0; i < n; i++) {
		ws[i] = (struct watcher){.name = name, .nobody = i == 1};
		ck_assert_int_eq(pipe2(ws[i].cmd, O_CLOEXEC), 0);
		ck_assert_int_eq(pipe2(ws[i].ans, O_CLOEXEC), 0);
		ws[i].pid = spawn(watch, &ws[i]);
		close(ws[i].cmd[0]);
		close(ws[i].ans[1]);
	}
	return n;
}

/* Every watcher reads exactly expect, through its old attachment and a new one. */
static void watchers_agree(struct watcher *ws, size_t n, const char *after)
{
	for (size_t i = 0; i < n; i++) {
		char a = 0;

		ck_assert_int_eq(write(ws[i].cmd[1], "c", 1), 1);
		ck_assert_int_eq(read(ws[i].ans[0], &a, 1), 1);
		ck_assert_msg(a == 'y', "after %s, the watcher as uid %d read other bytes", after,
			      ws[i].nobody ? NOBODY : (int)getuid());
	}
}

static void watchers_stop(struct watcher *ws, size_t n)
{
	/* a later watcher inherited the ends of those before it: close all, then wait */
	for (size_t i = 0; i < n; i++) {
		close(ws[i].cmd[1]);
		close(ws[i].ans[0]);
	}
	for (size_t i = 0; i < n; i++)
		ck_assert_int_eq(wait_child(ws[i].pid), 0);
}

/* ---- a. the publisher's own routes to its read-only entry ---- */

/* @p r (a call's result, errno set) is what the route should give: success on a writable entry,
 * failure with @p err on a read-only one. */
#define ROUTE(r, ro, err, what)                                                                    \
	do {                                                                                       \
		bool _ok = (r);                                                                    \
		int _e = errno;                                                                    \
		ck_assert_msg((ro) ? !_ok && _e == (err) : _ok, "%s: %s (%s)", what,               \
			      _ok ? "went through" : "failed", strerror(_e));                      \
	} while (0)

/*
 * Every way to write through a descriptor @p fd of the storage opened anew read-write; on a
 * writable entry each goes through and changes what the watchers read at @p off and page
 * @p hole.
 */
static void file_routes(int fd, bool ro, size_t off, size_t hole, struct watcher *ws, size_t nw)
{
	static const uint8_t junk[8] = "written";
	uint8_t *m;

	errno = 0;
	ck_assert_int_eq(lseek(fd, (off_t)off, SEEK_SET), (off_t)off);
	ROUTE(write(fd, junk, sizeof(junk)) == sizeof(junk), ro, EPERM, "write()");
	if (!ro)
		memcpy(expect + off, junk, sizeof(junk));
	watchers_agree(ws, nw, "write()");
	ROUTE(pwrite(fd, junk, sizeof(junk), (off_t)off + 16) == sizeof(junk), ro, EPERM,
	      "pwrite()");
	if (!ro)
		memcpy(expect + off + 16, junk, sizeof(junk));
	watchers_agree(ws, nw, "pwrite()");
	m = mmap(NULL, SZ, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ROUTE(m != MAP_FAILED, ro, EPERM, "mmap(PROT_WRITE, MAP_SHARED)");
	if (m != MAP_FAILED) {
		m[off + 32] = expect[off + 32] = 0xa5;
		munmap(m, SZ);
	}
	watchers_agree(ws, nw, "a writable shared mapping");
	/* a read-only shared mapping of the read-write descriptor, made writable afterwards
	 * (before Linux 6.7 the kernel refuses the mapping itself: EPERM, no write either) */
	m = mmap(NULL, SZ, PROT_READ, MAP_SHARED, fd, 0);
	if (m == MAP_FAILED) {
		ck_assert_msg(ro && errno == EPERM, "read-only shared mapping: %s",
			      strerror(errno));
	} else {
		ROUTE(mprotect(m, PAGE, PROT_READ | PROT_WRITE) == 0, ro, EACCES,
		      "mprotect() of a new read-only shared mapping");
		if (!ro)
			m[off + 33] = expect[off + 33] = 0x5a;
		munmap(m, SZ);
	}
	watchers_agree(ws, nw, "mprotect() of a new shared mapping");
	ROUTE(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(hole * PAGE),
			PAGE) == 0,
	      ro, EPERM, "fallocate(PUNCH_HOLE)");
	if (!ro)
		memset(expect + hole * PAGE, 0, PAGE);
	watchers_agree(ws, nw, "fallocate(PUNCH_HOLE)");
	/* resizing is sealed on both kinds of entry (F_SEAL_SHRINK, F_SEAL_GROW): no control */
	ck_assert_int_eq(ftruncate(fd, 0), -1);
	ck_assert_int_eq(errno, EPERM);
	ck_assert_int_eq(ftruncate(fd, 2 * SZ), -1);
	ck_assert_int_eq(errno, EPERM);
	watchers_agree(ws, nw, "ftruncate()");
}

/* Every route the publisher has to memory @p p it published (read-only if @p ro). */
static void attack(uint8_t *p, bool ro, struct watcher *ws, size_t nw)
{
	struct mapping map;
	char path[64];
	struct iovec local = {.iov_base = (void *)"x", .iov_len = 1};
	struct iovec remote = {.iov_base = p + 3, .iov_len = 1};
	int mem, reopened[2];

	watchers_agree(ws, nw, "publishing");
	mapping_of(p, &map);
	ck_assert_str_eq(map.perms, ro ? "r--s" : "rw-s");
	/* the pointer it wrote the tensor through */
	ck_assert_int_eq(store_faults(p + 1, 0xa1), ro);
	if (!ro)
		expect[1] = 0xa1;
	watchers_agree(ws, nw, "a store through the publisher's pointer");
	ROUTE(mprotect(p, PAGE, PROT_READ | PROT_WRITE) == 0, ro, EACCES, "mprotect()");
	ck_assert_int_eq(store_faults(p + 2, 0xa2), ro);
	if (!ro)
		expect[2] = 0xa2;
	watchers_agree(ws, nw, "mprotect(PROT_WRITE) and a store");
	/* the kernel's own write paths into this process's memory */
	mem = open("/proc/self/mem", O_RDWR | O_CLOEXEC);
	ck_assert_int_ge(mem, 0);
	ROUTE(pwrite(mem, "y", 1, (off_t)(uintptr_t)(p + 4)) == 1, ro, EIO,
	      "pwrite() to /proc/self/mem");
	close(mem);
	if (!ro)
		expect[4] = 'y';
	watchers_agree(ws, nw, "/proc/self/mem");
	ROUTE(process_vm_writev(getpid(), &local, 1, &remote, 1, 0) == 1, ro, EFAULT,
	      "process_vm_writev()");
	if (!ro)
		expect[3] = 'x';
	watchers_agree(ws, nw, "process_vm_writev()");
	ROUTE(madvise(p + 3 * PAGE, PAGE, MADV_REMOVE) == 0, ro, EACCES, "madvise(MADV_REMOVE)");
	if (!ro)
		memset(expect + 3 * PAGE, 0, PAGE);
	watchers_agree(ws, nw, "madvise(MADV_REMOVE)");
	/* the memfd opened anew read-write, through libdlpc's fd and through the mapping (root
	 * only: /proc/self/map_files needs CAP_SYS_ADMIN) */
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd_of(&map));
	reopened[0] = open(path, O_RDWR | O_CLOEXEC);
	ck_assert_msg(reopened[0] >= 0, "%s: %s", path, strerror(errno));
	reopened[1] = open(map.file, O_RDWR | O_CLOEXEC);
	if (reopened[1] < 0) {
		ck_assert_msg(getuid() != 0, "%s: %s", map.file, strerror(errno));
		fprintf(stderr, "not root: %s not tried (%s)\n", map.file, strerror(errno));
	}
	for (int i = 0; i < 2 && reopened[i] >= 0; i++) {
		file_routes(reopened[i], ro, 64 + 64 * (size_t)i, 1 + (size_t)i, ws, nw);
		close(reopened[i]);
	}
	/* the publisher reads what everyone reads */
	ck_assert_int_eq(memcmp(p, expect, SZ), 0);
}

/* Publish four pages of dlpc_alloc() memory, filled in place, and try every route on it. */
static void publish_and_attack(bool writable)
{
	int64_t shape[1] = {SZ};
	DLManagedTensorVersioned *t, *before, *after;
	struct watcher ws[2];
	dlpc_client *c = connect_or_die(&D);
	uint8_t *p;
	size_t nw;

	ck_assert_dlpc(dlpc_alloc(c, cpu, u8, 1, shape, &t), 0);
	p = t->dl_tensor.data;
	ck_assert_uint_eq((uintptr_t)p % PAGE, 0);
	pattern(p, SZ, 3);
	memcpy(expect, p, SZ);
	before = dlpc_tensor_share(t); /* keeps the pointer past the publish */
	ck_assert_ptr_nonnull(before);
	ck_assert_dlpc(dlpc_publish(c, "entry", t, writable ? DLPC_PUBLISH_WRITABLE : 0), 1);
	/* handles made later say read-only; the one made before keeps its flags */
	after = dlpc_tensor_share(before);
	ck_assert_ptr_eq(after->dl_tensor.data, p);
	ck_assert_int_eq(!!(after->flags & DLPACK_FLAG_BITMASK_READ_ONLY), !writable);
	ck_assert_uint_eq(before->flags & DLPACK_FLAG_BITMASK_READ_ONLY, 0);
	after->deleter(after);
	nw = watchers_start(ws, "entry");
	attack(p, !writable, ws, nw);
	watchers_stop(ws, nw);
	before->deleter(before);
	dlpc_close(c);
}

START_TEST(test_publisher_cannot_write_read_only)
{
	publish_and_attack(false);
}
END_TEST

/* The control: the same routes do write an entry published writable, and attachers see it. */
START_TEST(test_publisher_writes_writable)
{
	publish_and_attack(true);
}
END_TEST

/* ---- b. a raw publisher that keeps a writable mapping ---- */

START_TEST(test_future_write_is_not_enough)
{
	DLManagedTensorVersioned *t;
	dlpc_client *c = connect_or_die(&D);
	uint8_t buf[SZ], *m;
	char msg[512];
	int sock, fd;

	sock = raw_connect(&D);
	raw_hello(sock, DLPC_PROTO_MAJOR);
	pattern(buf, SZ, 5);
	fd = memfd_sealed(SZ, 0);
	ck_assert_int_eq(pwrite(fd, buf, SZ, 0), SZ);
	m = mmap(NULL, SZ, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ck_assert_ptr_ne(m, MAP_FAILED);
	/* F_SEAL_WRITE while a writable mapping lives: refused, and nothing is added */
	ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, SEALS_RO), -1);
	ck_assert_int_eq(errno, EBUSY);
	ck_assert_int_eq(fcntl(fd, F_GET_SEALS), 0);
	/* mprotected read-only, the mapping can become writable again: still refused */
	ck_assert_int_eq(mprotect(m, SZ, PROT_READ), 0);
	ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1);
	ck_assert_int_eq(errno, EBUSY);
	ck_assert_int_eq(mprotect(m, SZ, PROT_READ | PROT_WRITE), 0);
	/* F_SEAL_FUTURE_WRITE is granted, and the mapping goes on writing the file */
	ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, (SEALS_RO & ~F_SEAL_WRITE) | F_SEAL_FUTURE_WRITE),
			 0);
	m[0] = 0x42;
	ck_assert_int_eq(pread(fd, buf, 1, 0), 1);
	ck_assert_int_eq(buf[0], 0x42);
	/* such storage is no read-only entry */
	ck_assert_int_eq(raw_publish(sock, "future", 6, fd, SZ, 0, 1, 1, msg, sizeof(msg)), EPERM);
	ck_assert_msg(strstr(msg, "F_SEAL_WRITE missing (F_SEAL_FUTURE_WRITE does not revoke"),
		      "%s", msg);
	ck_assert_dlpc(dlpc_attach(c, "future", NULL, &t), -ENOENT);
	/* and F_SEAL_WRITE can no longer be had (F_SEAL_SEAL) */
	ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1);
	ck_assert_int_eq(errno, EPERM);
	munmap(m, SZ);
	close(fd);

	/* the same storage without the mapping: F_SEAL_WRITE is added, the entry accepted */
	fd = memfd_sealed(SZ, 0);
	pattern(buf, SZ, 6);
	ck_assert_int_eq(pwrite(fd, buf, SZ, 0), SZ);
	m = mmap(NULL, SZ, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ck_assert_ptr_ne(m, MAP_FAILED);
	ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, SEALS_RO), -1);
	ck_assert_int_eq(errno, EBUSY);
	munmap(m, SZ);
	ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, SEALS_RO), 0);
	ck_assert_int_eq(raw_publish(sock, "sealed", 6, fd, SZ, 0, 1, 1, msg, sizeof(msg)), 0);
	ck_assert_int_eq(pwrite(fd, "z", 1, 0), -1);
	ck_assert_int_eq(errno, EPERM);
	close(fd);
	ck_assert_dlpc(dlpc_attach(c, "sealed", NULL, &t), 1);
	ck_assert_int_eq(memcmp(t->dl_tensor.data, buf, sizeof(float)), 0);
	t->deleter(t);
	close(sock);
	dlpc_close(c);
}
END_TEST

/* ---- c. dlpc_alloc() memory still mapped writable in a forked child ---- */

struct holder {
	uint8_t *p;
	int ready[2], go[2];
};

/* In the child forked while the memory was mapped: write it, then wait until told to go. */
static int hold_mapping(void *arg)
{
	struct holder *h = arg;
	char x;

	close(h->ready[0]);
	close(h->go[1]);
	h->p[0] = 0x77;
	CHILD_CHECK(write(h->ready[1], "r", 1) == 1);
	CHILD_CHECK(read(h->go[0], &x, 1) == 0);
	return 0;
}

START_TEST(test_alloc_mapped_by_child_is_ebusy)
{
	int64_t shape[1] = {SZ};
	DLManagedTensorVersioned *t, *keep, *fresh, *seen;
	struct holder h;
	dlpc_client *c = connect_or_die(&D);
	struct mapping map;
	char x;
	pid_t child;

	ck_assert_dlpc(dlpc_alloc(c, cpu, u8, 1, shape, &t), 0);
	h.p = t->dl_tensor.data;
	pattern(h.p, SZ, 9);
	keep = dlpc_tensor_share(t);
	ck_assert_int_eq(pipe2(h.ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(h.go, O_CLOEXEC), 0);
	child = spawn(hold_mapping, &h);
	close(h.ready[1]);
	close(h.go[0]);
	ck_assert_int_eq(read(h.ready[0], &x, 1), 1);
	ck_assert_int_eq(h.p[0], 0x77); /* the child writes the memory we are about to publish */

	ck_assert_dlpc(dlpc_publish(c, "held", t, 0), -EBUSY);
	ck_assert_msg(strstr(dlpc_last_error(), "cannot publish 'held' read-only: its memory is "
						"still mapped writable elsewhere"),
		      "%s", dlpc_last_error());
	/* nothing was sealed, nothing published, and the memory is writable here again */
	mapping_of(h.p, &map);
	ck_assert_str_eq(map.perms, "rw-s");
	ck_assert_int_eq(fcntl(fd_of(&map), F_GET_SEALS) & ~F_SEAL_EXEC, 0);
	ck_assert(!store_faults(h.p + 1, 0x55));
	ck_assert_int_eq(h.p[1], 0x55);
	ck_assert_dlpc(dlpc_attach(c, "held", NULL, &seen), -ENOENT);
	t = dlpc_tensor_share(keep);
	ck_assert_uint_eq(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY, 0);
	t->deleter(t);

	/* once the child is gone, the same memory is published read-only, and so is new memory */
	close(h.go[1]);
	close(h.ready[0]);
	ck_assert_int_eq(wait_child(child), 0);
	ck_assert_dlpc(dlpc_publish(c, "held", dlpc_tensor_share(keep), 0), 1);
	ck_assert(store_faults(h.p + 1, 0x66));
	ck_assert_dlpc(dlpc_attach(c, "held", NULL, &seen), 1);
	ck_assert_int_eq(memcmp(seen->dl_tensor.data, h.p, SZ), 0);
	ck_assert_int_eq(((uint8_t *)seen->dl_tensor.data)[1], 0x55);
	seen->deleter(seen);
	ck_assert_dlpc(dlpc_alloc(c, cpu, u8, 1, shape, &fresh), 0);
	pattern(fresh->dl_tensor.data, SZ, 10);
	ck_assert_dlpc(dlpc_publish(c, "fresh", fresh, 0), 1);
	ck_assert_dlpc(dlpc_attach(c, "fresh", NULL, &seen), 1);
	ck_assert_int_eq(((uint8_t *)seen->dl_tensor.data)[SZ - 1], (uint8_t)((SZ - 1) * 7 + 10));
	seen->deleter(seen);
	keep->deleter(keep);
	dlpc_close(c);
}
END_TEST

/* In a child with a mount namespace of its own and no /proc: publish dlpc_alloc memory
 * read-only, which cannot reopen the memfd read-only there; it must seal all the same. */
static int publish_without_proc(void *arg)
{
	int64_t shape[1] = {SZ};
	DLManagedTensorVersioned *t, *keep;
	dlpc_client *c;
	uint8_t *p;

	(void)arg;
	CHILD_CHECK(unshare(CLONE_NEWNS) == 0);
	CHILD_CHECK(mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0);
	CHILD_CHECK(umount2("/proc", MNT_DETACH) == 0);
	CHILD_CHECK(open("/proc/self/fd", O_RDONLY | O_CLOEXEC) < 0 && errno == ENOENT);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_alloc(c, cpu, u8, 1, shape, &t) == 0);
	p = t->dl_tensor.data;
	memcpy(p, expect, SZ);
	keep = dlpc_tensor_share(t);
	CHILD_CHECK(dlpc_publish(c, "noproc", t, 0) == 1);
	/* same addresses, same bytes, read-only for good */
	CHILD_CHECK(memcmp(p, expect, SZ) == 0);
	CHILD_CHECK(store_faults(p, 0x42));
	CHILD_CHECK(mprotect(p, SZ, PROT_READ | PROT_WRITE) < 0 && errno == EACCES);
	keep->deleter(keep);
	dlpc_close(c);
	return 0;
}

START_TEST(test_read_only_publish_without_proc)
{
	DLManagedTensorVersioned *seen;
	dlpc_client *c;

	if (geteuid() != 0) {
		fprintf(stderr, "not root: no mount namespace, the publish without /proc is not "
				"tried\n");
		return;
	}
	pattern(expect, SZ, 21);
	ck_assert_int_eq(wait_child(spawn(publish_without_proc, NULL)), 0);
	c = connect_or_die(&D);
	ck_assert_dlpc(dlpc_attach(c, "noproc", NULL, &seen), 1);
	ck_assert_int_eq(memcmp(seen->dl_tensor.data, expect, SZ), 0);
	seen->deleter(seen);
	dlpc_close(c);
}
END_TEST

/* ---- d. copy-on-write attaches ---- */

struct cow {
	const char *name;
	uint32_t flags;
	bool read_only_flag; /* the tensor it gets carries DLPACK_FLAG_BITMASK_READ_ONLY */
	int ready[2], go[2];
};

/* In another process: attach with the flags asked, check them, and overwrite every byte as a
 * consumer that ignores the read-only flag would; hold until told to go. */
static int cow_writer(void *arg)
{
	struct cow *w = arg;
	dlpc_attach_opts o = {.size = sizeof(o), .flags = w->flags};
	DLManagedTensorVersioned *t;
	dlpc_client *c;
	uint8_t *p;
	char x;

	close(w->ready[0]);
	close(w->go[1]);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, w->name, &o, &t) > 0);
	CHILD_CHECK(!!(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY) == w->read_only_flag);
	p = t->dl_tensor.data;
	CHILD_CHECK(memcmp(p, expect, SZ) == 0);
	memset(p, 0xee, SZ);
	for (size_t i = 0; i < SZ; i++)
		CHILD_CHECK(p[i] == 0xee);
	CHILD_CHECK(write(w->ready[1], "w", 1) == 1);
	CHILD_CHECK(read(w->go[0], &x, 1) == 0);
	for (size_t i = 0; i < SZ; i++)
		CHILD_CHECK(p[i] == 0xee);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* In another process: a plain attach of @p arg reads expect. */
static int plain_reader(void *arg)
{
	DLManagedTensorVersioned *t;
	dlpc_client *c;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, arg, NULL, &t) > 0);
	CHILD_CHECK(memcmp(t->dl_tensor.data, expect, SZ) == 0);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* While a copy-on-write attacher of @p name holds its writes, the publisher (@p mine) and a
 * second attacher in another process read the published bytes. */
static void cow_case(const char *name, uint32_t flags, bool read_only_flag, const uint8_t *mine)
{
	struct cow w = {.name = name, .flags = flags, .read_only_flag = read_only_flag};
	pid_t writer;
	char x;

	ck_assert_int_eq(pipe2(w.ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(w.go, O_CLOEXEC), 0);
	writer = spawn(cow_writer, &w);
	close(w.ready[1]);
	close(w.go[0]);
	ck_assert_msg(read(w.ready[0], &x, 1) == 1, "the writer of '%s' (flags 0x%x) failed", name,
		      flags);
	ck_assert_int_eq(memcmp(mine, expect, SZ), 0);
	ck_assert_int_eq(wait_child(spawn(plain_reader, (void *)name)), 0);
	close(w.go[1]);
	close(w.ready[0]);
	ck_assert_int_eq(wait_child(writer), 0);
	ck_assert_int_eq(memcmp(mine, expect, SZ), 0);
}

/* Publish @p name from dlpc_alloc() memory holding expect; a handle on it for reading. */
static DLManagedTensorVersioned *publish_alloc(dlpc_client *c, const char *name, uint32_t flags)
{
	int64_t shape[1] = {SZ};
	DLManagedTensorVersioned *t, *keep;

	ck_assert_dlpc(dlpc_alloc(c, cpu, u8, 1, shape, &t), 0);
	memcpy(t->dl_tensor.data, expect, SZ);
	keep = dlpc_tensor_share(t);
	ck_assert_dlpc(dlpc_publish(c, name, t, flags), 1);
	return keep;
}

START_TEST(test_copy_on_write_stays_private)
{
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *ro, *rw;

	pattern(expect, SZ, 11);
	ro = publish_alloc(c, "ro", 0);
	rw = publish_alloc(c, "rw", DLPC_PUBLISH_WRITABLE);
	cow_case("ro", DLPC_ATTACH_PRIVATE, false, ro->dl_tensor.data);
	cow_case("ro", DLPC_ATTACH_GUARDED, true, ro->dl_tensor.data);
	cow_case("rw", DLPC_ATTACH_PRIVATE, false, rw->dl_tensor.data);
	cow_case("rw", DLPC_ATTACH_GUARDED, true, rw->dl_tensor.data);
	ro->deleter(ro);
	rw->deleter(rw);
	dlpc_close(c);
}
END_TEST

/* In another process: a plain attach of @p arg, then a store into it (which must kill it). */
static int strict_writer(void *arg)
{
	DLManagedTensorVersioned *t;
	dlpc_client *c;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, arg, NULL, &t) > 0);
	CHILD_CHECK(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
	no_core();
	((volatile uint8_t *)t->dl_tensor.data)[0] = 0xee;
	fprintf(stderr, "a store into a plain attach of '%s' went through\n", (char *)arg);
	_exit(3);
}

START_TEST(test_strict_attach_faults)
{
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *ro, *rw, *t;
	static const uint32_t bad[] = {DLPC_ATTACH_PRIVATE | DLPC_ATTACH_WRITABLE,
				       DLPC_ATTACH_GUARDED | DLPC_ATTACH_WRITABLE};

	pattern(expect, SZ, 12);
	ro = publish_alloc(c, "ro", 0);
	rw = publish_alloc(c, "rw", DLPC_PUBLISH_WRITABLE);
	ck_assert_int_eq(wait_child(spawn(strict_writer, "ro")), 128 + SIGSEGV);
	ck_assert_int_eq(wait_child(spawn(strict_writer, "rw")), 128 + SIGSEGV);
	/* a shared writable mapping and a copy-on-write one exclude each other */
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		dlpc_attach_opts o = {.size = sizeof(o), .flags = bad[i]};

		ck_assert_dlpc(dlpc_attach(c, "rw", &o, &t), -EINVAL);
		ck_assert_msg(strstr(dlpc_last_error(), "exclude each other"), "%s",
			      dlpc_last_error());
		ck_assert_dlpc(dlpc_attach(c, "ro", &o, &t), -EINVAL);
	}
	ck_assert_int_eq(wait_child(spawn(plain_reader, "ro")), 0);
	ck_assert_int_eq(wait_child(spawn(plain_reader, "rw")), 0);
	ck_assert_int_eq(memcmp(ro->dl_tensor.data, expect, SZ), 0);
	ro->deleter(ro);
	rw->deleter(rw);
	dlpc_close(c);
}
END_TEST

/* ---- e. what the kernel allows on memfds sealed the project's ways ---- */

/* Both mappings an attacher may make of @p fd (@p rdwr: opened read-write) under @p seals. */
static void map_sealed(int fd, bool rdwr, int seals, const uint8_t *want)
{
	bool ro = seals & F_SEAL_WRITE;
	uint8_t *priv, *shared, *writable, byte;
	int r;

	priv = mmap(NULL, SZ, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	ck_assert_msg(priv != MAP_FAILED, "MAP_PRIVATE: %s", strerror(errno));
	shared = mmap(NULL, SZ, PROT_READ, MAP_SHARED, fd, 0);
	ck_assert_msg(shared != MAP_FAILED, "MAP_SHARED, PROT_READ: %s", strerror(errno));
	ck_assert_int_eq(memcmp(priv, want, SZ), 0);
	ck_assert_int_eq(memcmp(shared, want, SZ), 0);
	/* a writable shared one only for a writable storage through a read-write fd */
	writable = mmap(NULL, SZ, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	ck_assert_msg((writable != MAP_FAILED) == (!ro && rdwr), "MAP_SHARED, PROT_WRITE: %s",
		      writable != MAP_FAILED ? "mapped" : strerror(errno));
	if (writable == MAP_FAILED)
		ck_assert_int_eq(errno, rdwr ? EPERM : EACCES);
	else
		munmap(writable, SZ);
	/* private writes stay private */
	memset(priv + PAGE, 0xee, PAGE);
	ck_assert_int_eq(priv[PAGE + 1], 0xee);
	ck_assert_int_eq(memcmp(shared, want, SZ), 0);
	ck_assert_int_eq(pread(fd, &byte, 1, PAGE + 1), 1);
	ck_assert_int_eq(byte, want[PAGE + 1]);
	/* the shared one becomes writable only for a writable storage through a read-write fd */
	r = mprotect(shared, SZ, PROT_READ | PROT_WRITE);
	ck_assert_int_eq(r, ro || !rdwr ? -1 : 0);
	if (r < 0)
		ck_assert_int_eq(errno, EACCES);
	munmap(priv, SZ);
	munmap(shared, SZ);
}

START_TEST(test_mmap_under_every_seal_set)
{
	static const struct {
		const char *what;
		unsigned mfd;
		int seals;
	} sets[] = {
		{"read-only", 0, SEALS_RO},
		{"read-only + F_SEAL_EXEC", 0, SEALS_RO | F_SEAL_EXEC},
		{"read-only, MFD_NOEXEC_SEAL", MFD_NOEXEC_SEAL, SEALS_RO},
		{"writable", 0, SEALS_RW},
		{"writable, MFD_NOEXEC_SEAL", MFD_NOEXEC_SEAL, SEALS_RW},
	};
	struct utsname u;
	uint8_t want[SZ];

	ck_assert_int_eq(uname(&u), 0);
	fprintf(stderr, "kernel %s %s\n", u.sysname, u.release);
	pattern(want, SZ, 13);
	for (size_t i = 0; i < sizeof(sets) / sizeof(sets[0]); i++) {
		int fd = memfd_create("seals", MFD_CLOEXEC | MFD_ALLOW_SEALING | sets[i].mfd), ro;
		char path[64];

		if (fd < 0 && errno == EINVAL && sets[i].mfd) {
			fprintf(stderr, "%s: not run, kernel %s lacks MFD_NOEXEC_SEAL\n",
				sets[i].what, u.release);
			continue;
		}
		ck_assert_int_ge(fd, 0);
		ck_assert_int_eq(pwrite(fd, want, SZ, 0), SZ);
		ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, sets[i].seals), 0);
		snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
		ro = open(path, O_RDONLY | O_CLOEXEC);
		ck_assert_int_ge(ro, 0);
		map_sealed(fd, true, fcntl(fd, F_GET_SEALS), want);
		map_sealed(ro, false, fcntl(fd, F_GET_SEALS), want);
		fprintf(stderr,
			"%s (seals 0x%x): private and shared read mappings of O_RDWR and "
			"O_RDONLY fds: fine\n",
			sets[i].what, (unsigned)fcntl(fd, F_GET_SEALS));
		close(ro);
		close(fd);
	}
}
END_TEST

/* ---- f. who published what was attached ---- */

/* In another process: "one" (writable) and the bundle "b" twice (generation 2), then exit. */
static int info_publisher(void *arg)
{
	static const char *const keys[2] = {"x", "y"};
	static uint8_t bytes[2][64];
	int64_t shape[1] = {64};
	DLManagedTensorVersioned *ts[2];
	dlpc_client *c;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_publish(c, "one", host_tensor(bytes[0], u8, 1, shape, NULL, NULL),
				 DLPC_PUBLISH_WRITABLE) == 1);
	for (int gen = 1; gen <= 2; gen++) {
		for (int i = 0; i < 2; i++)
			ts[i] = host_tensor(bytes[i], u8, 1, shape, NULL, NULL);
		CHILD_CHECK(dlpc_publish_bundle(c, "b", 2, keys, ts,
						gen > 1 ? DLPC_PUBLISH_REPLACE : 0) == gen);
	}
	dlpc_close(c);
	return 0;
}

/* @p t came from @p pid's entry of generation @p gen, published with @p flags. */
static void info_is(const DLManagedTensorVersioned *t, pid_t pid, uint32_t flags, uint64_t gen)
{
	dlpc_attach_info info = {.size = sizeof(info)};

	ck_assert_dlpc(dlpc_tensor_attach_info(t, &info), 0);
	ck_assert_uint_eq(info.owner_uid, getuid());
	ck_assert_int_eq(info.owner_pid, pid);
	ck_assert_uint_eq(info.flags, flags);
	ck_assert_uint_eq(info.generation, gen);
}

START_TEST(test_attach_info)
{
	int64_t shape[1] = {64};
	DLManagedTensorVersioned *one, *taken, *share, *al;
	dlpc_attach_info info = {.size = sizeof(info)};
	dlpc_client *c = connect_or_die(&D);
	uint8_t bytes[64];
	dlpc_bundle *b;
	pid_t pub;

	pub = spawn(info_publisher, NULL);
	ck_assert_int_eq(wait_child(pub), 0);
	ck_assert_dlpc(dlpc_attach(c, "one", NULL, &one), 1);
	info_is(one, pub, DLPC_PUBLISH_WRITABLE, 1);
	share = dlpc_tensor_share(one);
	one->deleter(one);
	info_is(share, pub, DLPC_PUBLISH_WRITABLE, 1);
	share->deleter(share);
	ck_assert_dlpc(dlpc_attach_bundle(c, "b", NULL, &b), 2);
	taken = dlpc_bundle_take(b, 1);
	ck_assert_ptr_nonnull(taken);
	dlpc_bundle_free(b);
	info_is(taken, pub, 0, 2);
	share = dlpc_tensor_share(taken);
	taken->deleter(taken);
	info_is(share, pub, 0, 2);
	/* fields past out->size are left alone */
	info = (dlpc_attach_info){
		.size = offsetof(dlpc_attach_info, flags), .flags = 77, .generation = 88};
	ck_assert_dlpc(dlpc_tensor_attach_info(share, &info), 0);
	ck_assert_int_eq(info.owner_pid, pub);
	ck_assert_uint_eq(info.flags, 77);
	ck_assert_uint_eq(info.generation, 88);
	info.size = 4;
	ck_assert_dlpc(dlpc_tensor_attach_info(share, &info), -EINVAL);
	ck_assert_dlpc(dlpc_tensor_attach_info(share, NULL), -EINVAL);
	share->deleter(share);
	/* tensors that were not attached */
	info.size = sizeof(info);
	ck_assert_dlpc(dlpc_alloc(c, cpu, u8, 1, shape, &al), 0);
	ck_assert_dlpc(dlpc_tensor_attach_info(al, &info), -EINVAL);
	ck_assert_msg(strstr(dlpc_last_error(), "not attached"), "%s", dlpc_last_error());
	share = dlpc_tensor_share(al);
	ck_assert_dlpc(dlpc_tensor_attach_info(share, &info), -EINVAL);
	share->deleter(share);
	al->deleter(al);
	one = host_tensor(bytes, u8, 1, shape, NULL, NULL);
	ck_assert_dlpc(dlpc_tensor_attach_info(one, &info), -EINVAL);
	one->deleter(one);
	dlpc_close(c);
}
END_TEST

static Suite *integrity_suite(void)
{
	Suite *s = suite_create("integrity");
	TCase *tc = tcase_create("integrity"), *kernel = tcase_create("kernel");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, scaled_ms(60000) / 1000);
	tcase_add_test(tc, test_publisher_cannot_write_read_only);
	tcase_add_test(tc, test_publisher_writes_writable);
	tcase_add_test(tc, test_future_write_is_not_enough);
	tcase_add_test(tc, test_alloc_mapped_by_child_is_ebusy);
	tcase_add_test(tc, test_read_only_publish_without_proc);
	tcase_add_test(tc, test_copy_on_write_stays_private);
	tcase_add_test(tc, test_strict_attach_faults);
	tcase_add_test(tc, test_attach_info);
	tcase_add_test(kernel, test_mmap_under_every_seal_set);
	suite_add_tcase(s, tc);
	suite_add_tcase(s, kernel);
	return s;
}

int main(void)
{
	return run_suite(integrity_suite());
}
