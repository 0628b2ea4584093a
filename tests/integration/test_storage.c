/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Storage fds: every kind of descriptor that is not a properly sealed memfd is refused with its
 * own reason; the daemon never maps client memory; and an attacher of a read-only entry cannot
 * turn the fd or the mapping it received into write access.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "raw.h"

#define SEALS_RO (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL)
#define SEALS_RW (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

static struct daemon D;

static void setup(void)
{
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

/* Lines of the daemon's /proc/PID/maps that contain @p what. */
static int daemon_maps(const char *what)
{
	char path[64], line[512];
	FILE *f;
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/maps", (int)D.pid);
	f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	while (fgets(line, sizeof(line), f))
		if (strstr(line, what)) {
			fprintf(stderr, "dlpackd maps: %s", line);
			n++;
		}
	fclose(f);
	return n;
}

/* ---- the matrix ---- */

enum kind {
	UNSEALED,
	NO_SHRINK,
	NO_GROW,
	NO_WRITE_SEAL,
	FUTURE_WRITE_ONLY,
	NOT_FINAL,
	WRITE_SEALED_WRITABLE,
	READ_ONLY_WRITABLE,
	SHM_OPEN,
	DISK_FILE,
	PIPE,
	SOCKET,
	O_PATH_FD,
	DIRECTORY,
	DEV_ZERO,
	TOO_SMALL,
	SPARSE,
	PARTLY_SPARSE,
	KINDS
};

struct storage_case {
	enum kind kind;
	const char *what;
	bool writable; /* published DLPC_PUBLISH_WRITABLE */
	int code;
	const char *text;
};

static const struct storage_case cases[KINDS] = {
	{UNSEALED, "memfd without seals", false, EPERM,
	 "not sealed against resizing (F_SEAL_SHRINK and F_SEAL_GROW missing, seals are 0x0)"},
	{NO_SHRINK, "memfd without F_SEAL_SHRINK", false, EPERM,
	 "not sealed against shrinking (F_SEAL_SHRINK missing"},
	{NO_GROW, "memfd without F_SEAL_GROW", false, EPERM,
	 "not sealed against growing (F_SEAL_GROW missing"},
	{NO_WRITE_SEAL, "memfd without F_SEAL_WRITE, published read-only", false, EPERM,
	 "read-only storage memfd is not sealed against writes: F_SEAL_WRITE missing (required"},
	{FUTURE_WRITE_ONLY, "memfd with F_SEAL_FUTURE_WRITE instead of F_SEAL_WRITE", false, EPERM,
	 "F_SEAL_WRITE missing (F_SEAL_FUTURE_WRITE does not revoke writable mappings"},
	{NOT_FINAL, "memfd without F_SEAL_SEAL", false, EPERM, "seals are not final"},
	{WRITE_SEALED_WRITABLE, "memfd with F_SEAL_WRITE, published writable", true, EPERM,
	 "storage published writable is sealed against writes"},
	{READ_ONLY_WRITABLE, "memfd opened O_RDONLY, published writable", true, EBADF,
	 "writable storage fd was not opened read-write"},
	{SHM_OPEN, "shm_open file", false, EPERM, "tmpfs file that does not allow sealing"},
	{DISK_FILE, "file on a disk filesystem", false, EBADF,
	 "storage fd is a file that cannot be sealed"},
	{PIPE, "pipe", false, EBADF, "storage fd is a pipe"},
	{SOCKET, "socket", false, EBADF, "storage fd is a socket"},
	{O_PATH_FD, "O_PATH descriptor of a sealed memfd", false, EBADF,
	 "storage fd is an O_PATH descriptor"},
	{DIRECTORY, "directory", false, EBADF, "storage fd is a directory"},
	{DEV_ZERO, "/dev/zero", false, EBADF, "storage fd is a character device"},
	{TOO_SMALL, "memfd smaller than declared", false, EINVAL,
	 "storage memfd holds 16 bytes, the tensors need 4096"},
	{SPARSE, "memfd never written (no page allocated)", false, EINVAL,
	 "storage memfd is sparse: 0 of its 4096 bytes are allocated"},
	{PARTLY_SPARSE, "memfd with one of its three pages written", false, EINVAL,
	 "storage memfd is sparse: 4096 of its 12288 bytes are allocated"},
};

/* A descriptor of @p kind; @p extra receives a second fd to close afterwards, or -1. */
static int make_storage(enum kind kind, int *extra)
{
	char path[256];
	int fd = -1, sv[2];

	*extra = -1;
	switch (kind) {
	case UNSEALED:
		return memfd_sealed(4096, 0);
	case NO_SHRINK:
		return memfd_sealed(4096, SEALS_RO & ~F_SEAL_SHRINK);
	case NO_GROW:
		return memfd_sealed(4096, SEALS_RO & ~F_SEAL_GROW);
	case NO_WRITE_SEAL:
		return memfd_sealed(4096, SEALS_RW);
	case FUTURE_WRITE_ONLY:
		return memfd_sealed(4096, (SEALS_RO & ~F_SEAL_WRITE) | F_SEAL_FUTURE_WRITE);
	case NOT_FINAL:
		return memfd_sealed(4096, SEALS_RO & ~F_SEAL_SEAL);
	case WRITE_SEALED_WRITABLE:
		return memfd_sealed(4096, SEALS_RO);
	case READ_ONLY_WRITABLE:
		*extra = memfd_sealed(4096, SEALS_RW);
		snprintf(path, sizeof(path), "/proc/self/fd/%d", *extra);
		fd = open(path, O_RDONLY | O_CLOEXEC);
		break;
	case SHM_OPEN:
		snprintf(path, sizeof(path), "/dlpc-test-%d", (int)getpid());
		fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
		ck_assert_int_ge(fd, 0);
		shm_unlink(path);
		ck_assert_int_eq(ftruncate(fd, 4096), 0);
		break;
	case DISK_FILE:
		/* the build tree: /tmp may be tmpfs elsewhere */
		snprintf(path, sizeof(path), "%s/dlpc-on-disk-%d", DLPC_TEST_DISK_DIR,
			 (int)getpid());
		fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
		ck_assert_int_ge(fd, 0);
		unlink(path);
		ck_assert_int_eq(ftruncate(fd, 4096), 0);
		break;
	case PIPE:
		ck_assert_int_eq(pipe2(sv, O_CLOEXEC), 0);
		*extra = sv[1];
		return sv[0];
	case SOCKET:
		ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
		*extra = sv[1];
		return sv[0];
	case O_PATH_FD:
		*extra = memfd_sealed(4096, SEALS_RO);
		snprintf(path, sizeof(path), "/proc/self/fd/%d", *extra);
		fd = open(path, O_PATH | O_CLOEXEC);
		break;
	case DIRECTORY:
		fd = open(DLPC_TEST_DISK_DIR, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		break;
	case DEV_ZERO:
		fd = open("/dev/zero", O_RDWR | O_CLOEXEC);
		break;
	case TOO_SMALL:
		return memfd_sealed(16, SEALS_RO);
	case SPARSE:
	case PARTLY_SPARSE:
		/* sealed as the daemon wants, but not (all) allocated: an attacher would pay */
		fd = memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
		ck_assert_int_ge(fd, 0);
		ck_assert_int_eq(ftruncate(fd, kind == SPARSE ? 4096 : 3 * 4096), 0);
		if (kind == PARTLY_SPARSE)
			ck_assert_int_eq(pwrite(fd, "x", 1, 4096), 1);
		ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, SEALS_RO), 0);
		return fd;
	case KINDS:
		break;
	}
	ck_assert_int_ge(fd, 0);
	return fd;
}

START_TEST(test_storage_fd_matrix)
{
	char seen[KINDS][512], msg[512];
	int fd, base, storage, extra;

	good_client_start(&D);
	base = good_baseline();
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	for (int i = 0; i < KINDS; i++) {
		const struct storage_case *c = &cases[i];
		char name[16];
		int code;

		ck_assert_int_eq(c->kind, i);
		snprintf(name, sizeof(name), "s%d", i);
		storage = make_storage(c->kind, &extra);
		code = raw_publish(fd, name, strlen(name), storage, 4096,
				   c->writable ? DLPC_PUBLISH_WRITABLE : 0, 1, 1, seen[i],
				   sizeof(seen[i]));
		close(storage);
		if (extra >= 0)
			close(extra);
		ck_assert_msg(code == c->code && strstr(seen[i], c->text),
			      "%s: got %d '%s', expected %d '%s'", c->what, code, seen[i], c->code,
			      c->text);
		/* the reason names the entry */
		ck_assert_msg(strstr(seen[i], name), "%s: '%s' does not name '%s'", c->what,
			      seen[i], name);
	}
	/* each reason is its own */
	for (int i = 0; i < KINDS; i++)
		for (int j = i + 1; j < KINDS; j++)
			ck_assert_msg(strcmp(strchr(seen[i], ':'), strchr(seen[j], ':')) != 0,
				      "%s and %s give the same reason", cases[i].what,
				      cases[j].what);
	/* the right memfds are accepted, read-only and writable */
	storage = memfd_sealed(4096, SEALS_RO);
	ck_assert_int_eq(raw_publish(fd, "ro", 2, storage, 4096, 0, 1, 1, msg, sizeof(msg)), 0);
	close(storage);
	storage = memfd_sealed(4096, SEALS_RW);
	ck_assert_int_eq(raw_publish(fd, "rw", 2, storage, 4096, DLPC_PUBLISH_WRITABLE, 1, 1, msg,
				     sizeof(msg)),
			 0);
	close(storage);
	close(fd);
	good_client_check();
	expect_fds(base + 2); /* ro and rw hold their storage; every refused fd was closed */
	ck_assert_int_eq(daemon_maps("memfd:"), 0);
	ck_assert_int_eq(daemon_maps("/dev/shm"), 0);
	ck_assert_int_eq(daemon_maps("dlpc-on-disk"), 0);
	good_client_stop();
}
END_TEST

/* ---- read-only stays read-only ---- */

#define RO_SIZE 8192

static void pattern(uint8_t *p, size_t n, uint8_t seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)(i * 7 + seed);
}

/* In another process: publish "ro" (read-only) and "rw" (writable) and exit. */
static int publisher(void *arg)
{
	static uint8_t ro[RO_SIZE], rw[RO_SIZE];
	int64_t shape[1] = {RO_SIZE};
	dlpc_client *c;

	(void)arg;
	pattern(ro, sizeof(ro), 1);
	pattern(rw, sizeof(rw), 2);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_publish(c, "ro",
				 host_tensor(ro, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
				 0) == 1);
	CHILD_CHECK(dlpc_publish(c, "rw",
				 host_tensor(rw, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
				 DLPC_PUBLISH_WRITABLE) == 1);
	dlpc_close(c);
	return 0;
}

/* ATTACH @p name over a raw connection and keep the storage fd the reply carries. */
static int raw_attach_fd(int sock, const char *name, uint32_t flags, char *msg, size_t len)
{
	Dlpackd__V1__Attach at = DLPACKD__V1__ATTACH__INIT;
	struct dlpc__hdr h;
	uint8_t buf[4096];
	int fd;

	at.name.data = (uint8_t *)name;
	at.name.len = strlen(name);
	at.flags = flags;
	raw_send(sock, DLPC_MSG_ATTACH, 11, &at.base, NULL, 0);
	ck_assert_int_eq(raw_recv_fd(sock, &h, buf, sizeof(buf), &fd), 1);
	if (h.type == DLPC_MSG_ERROR) {
		Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, h.len, buf);

		ck_assert_ptr_nonnull(e);
		snprintf(msg, len, "%s", e->message);
		fd = -e->code;
		dlpackd__v1__error__free_unpacked(e, NULL);
		return fd;
	}
	ck_assert_uint_eq(h.type, DLPC_MSG_ATTACH | DLPC_MSG_REPLY);
	ck_assert_int_ge(fd, 0);
	return fd;
}

/* Every way to write through a storage fd; true if any of them got through. */
static bool try_writes(int fd, const char *what)
{
	static const uint8_t junk[16] = "overwritten!!!!";
	bool wrote = false;
	void *m;

	if (write(fd, junk, sizeof(junk)) >= 0)
		wrote = true, fprintf(stderr, "%s: write() went through\n", what);
	else
		ck_assert_msg(errno == EPERM, "%s: write: %s", what, strerror(errno));
	if (pwrite(fd, junk, sizeof(junk), 100) >= 0)
		wrote = true, fprintf(stderr, "%s: pwrite() went through\n", what);
	else
		ck_assert_msg(errno == EPERM, "%s: pwrite: %s", what, strerror(errno));
	m = mmap(NULL, RO_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (m != MAP_FAILED) {
		wrote = true, fprintf(stderr, "%s: writable shared mapping\n", what);
		memcpy(m, junk, sizeof(junk));
		munmap(m, RO_SIZE);
	} else {
		ck_assert_msg(errno == EPERM, "%s: mmap: %s", what, strerror(errno));
	}
	m = mmap(NULL, RO_SIZE, PROT_READ, MAP_SHARED, fd, 0);
	ck_assert_msg(m != MAP_FAILED, "%s: read-only mmap: %s", what, strerror(errno));
	if (mprotect(m, RO_SIZE, PROT_READ | PROT_WRITE) == 0) {
		wrote = true, fprintf(stderr, "%s: mprotect made it writable\n", what);
		memcpy(m, junk, sizeof(junk));
	} else {
		ck_assert_msg(errno == EACCES, "%s: mprotect: %s", what, strerror(errno));
	}
	munmap(m, RO_SIZE);
	if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) == 0)
		wrote = true, fprintf(stderr, "%s: punched a hole\n", what);
	if (ftruncate(fd, 0) == 0)
		wrote = true, fprintf(stderr, "%s: truncated\n", what);
	ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), -1);
	return wrote;
}

START_TEST(test_readonly_cannot_gain_write)
{
	uint8_t want[RO_SIZE], *priv;
	DLManagedTensorVersioned *t, *t2;
	dlpc_client *c;
	char path[64], msg[512];
	int sock, fd, again;
	long page = sysconf(_SC_PAGESIZE);

	ck_assert_int_eq(wait_child(spawn(publisher, NULL)), 0);
	pattern(want, sizeof(want), 1);
	c = connect_or_die(&D);
	sock = raw_connect(&D);
	raw_hello(sock, DLPC_PROTO_MAJOR);

	/* the mapping libdlpc made cannot be made writable */
	ck_assert_dlpc(dlpc_attach(c, "ro", NULL, &t), 1);
	ck_assert_int_eq(memcmp(t->dl_tensor.data, want, RO_SIZE), 0);
	ck_assert_int_eq(mprotect((void *)((uintptr_t)t->dl_tensor.data & ~(uintptr_t)(page - 1)),
				  (size_t)page, PROT_READ | PROT_WRITE),
			 -1);
	ck_assert_int_eq(errno, EACCES);

	/* writable attach of a read-only entry is refused */
	ck_assert_int_eq(raw_attach_fd(sock, "ro", DLPC_ATTACH_WRITABLE, msg, sizeof(msg)),
			 -EACCES);
	ck_assert_ptr_nonnull(strstr(msg, "'ro' was not published writable"));

	/* the fd itself, and the same file reopened read-write through /proc */
	fd = raw_attach_fd(sock, "ro", 0, msg, sizeof(msg));
	ck_assert(!try_writes(fd, "received fd"));
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	again = open(path, O_RDWR | O_CLOEXEC);
	if (again >= 0) {
		/* the seals let the open succeed; what it opens cannot write */
		fprintf(stderr, "reopening a read-only storage O_RDWR succeeds; writes fail\n");
		ck_assert(!try_writes(again, "reopened O_RDWR"));
		close(again);
	} else {
		ck_assert_int_eq(errno, EPERM);
	}
	/* a private writable mapping is the attacher's own copy */
	priv = mmap(NULL, RO_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
	ck_assert_ptr_ne(priv, MAP_FAILED);
	memset(priv, 0xee, RO_SIZE);
	munmap(priv, RO_SIZE);
	close(fd);

	/* the published bytes are unchanged, for old and new attachers */
	ck_assert_int_eq(memcmp(t->dl_tensor.data, want, RO_SIZE), 0);
	ck_assert_dlpc(dlpc_attach(c, "ro", NULL, &t2), 1);
	ck_assert_int_eq(memcmp(t2->dl_tensor.data, want, RO_SIZE), 0);
	t2->deleter(t2);
	t->deleter(t);

	/* the control: the same attempts do get through on an entry published writable */
	fd = raw_attach_fd(sock, "rw", 0, msg, sizeof(msg));
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	again = open(path, O_RDWR | O_CLOEXEC);
	ck_assert_int_ge(again, 0);
	ck_assert(try_writes(again, "writable entry (control)"));
	close(again);
	close(fd);

	close(sock);
	ck_assert_int_eq(daemon_maps("memfd:"), 0);
	dlpc_close(c);
}
END_TEST

/* Open fds of the daemon that are memfds (links named "/memfd:..."). */
static int daemon_memfds(void)
{
	char dir[64], path[384], target[256];
	struct dirent *de;
	DIR *d;
	int n = 0;

	snprintf(dir, sizeof(dir), "/proc/%d/fd", (int)D.pid);
	d = opendir(dir);
	ck_assert_ptr_nonnull(d);
	while ((de = readdir(d))) {
		ssize_t len;

		snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
		len = readlink(path, target, sizeof(target) - 1);
		if (len > 0) {
			target[len] = 0;
			n += strncmp(target, "/memfd:", 7) == 0;
		}
	}
	closedir(d);
	return n;
}

/* The daemon holds storage fds but never maps them, whatever clients publish and attach. */
START_TEST(test_daemon_never_maps)
{
	static uint8_t data[3][1 << 16];
	static const char *const keys[3] = {"a", "b", "c"};
	DLManagedTensorVersioned *t[3], *single, *w, *al;
	dlpc_attach_opts wopts = {.size = sizeof(wopts), .flags = DLPC_ATTACH_WRITABLE};
	int64_t shape[1] = {1 << 16};
	dlpc_bundle *b;
	dlpc_client *c = connect_or_die(&D);

	for (int i = 0; i < 3; i++) {
		pattern(data[i], sizeof(data[i]), (uint8_t)i);
		t[i] = host_tensor(data[i], (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL);
	}
	ck_assert_dlpc(dlpc_publish_bundle(c, "bundle", 3, keys, t, 0), 1);
	ck_assert_dlpc(dlpc_publish(c, "one",
				    host_tensor(data[0], (DLDataType){kDLUInt, 8, 1}, 1, shape,
						NULL, NULL),
				    0),
		       1);
	ck_assert_dlpc(dlpc_publish(c, "writable",
				    host_tensor(data[1], (DLDataType){kDLUInt, 8, 1}, 1, shape,
						NULL, NULL),
				    DLPC_PUBLISH_WRITABLE),
		       1);
	ck_assert_dlpc(
		dlpc_alloc(c, (DLDevice){kDLCPU, 0}, (DLDataType){kDLUInt, 8, 1}, 1, shape, &al),
		0);
	memset(al->dl_tensor.data, 0x5a, (size_t)shape[0]);
	ck_assert_dlpc(dlpc_publish(c, "allocated", al, 0), 1);

	ck_assert_dlpc(dlpc_attach_bundle(c, "bundle", NULL, &b), 1);
	ck_assert_dlpc(dlpc_attach(c, "one", NULL, &single), 1);
	ck_assert_dlpc(dlpc_attach(c, "writable", &wopts, &w), 1);
	((uint8_t *)w->dl_tensor.data)[0] = 1;
	/* four storages held as fds, none mapped */
	settled_fds(&D, c, 1);
	ck_assert_int_eq(daemon_memfds(), 4);
	ck_assert_int_eq(daemon_maps("memfd:"), 0);
	dlpc_bundle_free(b);
	single->deleter(single);
	w->deleter(w);
	ck_assert_int_eq(daemon_maps("memfd:"), 0);
	dlpc_close(c);
}
END_TEST

static Suite *storage_suite(void)
{
	Suite *s = suite_create("storage");
	TCase *tc = tcase_create("storage");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, scaled_ms(60000) / 1000);
	tcase_add_test(tc, test_storage_fd_matrix);
	tcase_add_test(tc, test_readonly_cannot_gain_write);
	tcase_add_test(tc, test_daemon_never_maps);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(storage_suite());
}
