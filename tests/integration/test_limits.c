/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Who may do what, and how much: ownership across real uids, names first-come across uids
 * (attaches that insist on an owner), credentials from the kernel only, socket permissions,
 * seals against reopening, per-uid quotas, per-connection limits, the frame deadline, fd
 * exhaustion, and shared memory that cannot be had.
 *
 * The suite runs as root; children drop to nobody (uid/gid 65534) to be another user.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <sys/un.h>
#include <sys/wait.h>

#include "harness.h"
#include "io.h"
#include "limits.h"
#include "msg.h"

static struct daemon D;
static bool started;

/* Start the daemon with @p args (NULL-terminated, or NULL) and RLIMIT_NOFILE @p nofile (0: as
 * inherited). */
static void start(const char *const *args, unsigned long nofile)
{
	struct daemon_opts o = {.args = args, .nofile = nofile};

	daemon_start_with(&D, &o);
	started = true;
}

static void teardown(void)
{
	if (started)
		daemon_stop(&D);
	started = false;
}

static float data[1024]; /* 4096 bytes: one storage of exactly that size */

/* Publish @p n floats of data (4 * n bytes, rounded up to 256, of storage) as @p name. */
static int publish_n(dlpc_client *c, const char *name, int64_t n, uint32_t flags)
{
	DLDataType f32 = {kDLFloat, 32, 1};

	return dlpc_publish(c, name, host_tensor(data, f32, 1, &n, NULL, NULL), flags);
}

static int publish(dlpc_client *c, const char *name, uint32_t flags)
{
	return publish_n(c, name, 1024, flags);
}

static bool error_says(const char *text)
{
	return strstr(dlpc_last_error(), text) != NULL;
}

/* The entry @p name's owner, from LIST. */
static void owner_of(dlpc_client *c, const char *name, uint32_t *uid, int32_t *pid)
{
	dlpc_entry_info *list;
	size_t n;

	ck_assert_int_eq(dlpc_list(c, name, &list, &n), 0);
	ck_assert_uint_eq(n, 1);
	ck_assert_str_eq(list[0].name, name);
	*uid = list[0].owner_uid;
	*pid = list[0].owner_pid;
	dlpc_list_free(list, n);
}

/* ---- a raw client, for what libdlpc would never send ---- */

static int raw_connect(void)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	CHILD_CHECK(fd >= 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", D.sock);
	CHILD_CHECK(connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	return fd;
}

/* Send @p m as a frame, with @p tail appended to its payload. */
static void raw_send(int fd, uint16_t type, uint32_t id, const ProtobufCMessage *m,
		     const uint8_t *tail, size_t tail_len, const int *fds, unsigned nfds)
{
	struct dlpc__scratch s = {0};
	ssize_t len = dlpc__msg_frame_tail(&s, type, id, m, tail, tail_len, nfds);

	CHILD_CHECK(len > 0);
	CHILD_CHECK(dlpc__send_all(fd, s.p, (size_t)len, fds, nfds) == 0);
	dlpc__scratch_clear(&s);
}

struct raw_rx {
	struct dlpc__rx rx;
	int fd;
};

/* The next frame, which the caller clears; 0 when the daemon hung up. */
static int raw_next(struct raw_rx *r, struct dlpc__frame *f)
{
	char why[160];

	for (;;) {
		int k = dlpc__rx_next(&r->rx, f, why, sizeof(why));
		ssize_t n;

		CHILD_CHECK(k >= 0);
		if (k == 1)
			return 1;
		n = dlpc__rx_read(&r->rx, r->fd, why, sizeof(why));
		if (n == 0 || n == -ECONNRESET)
			return 0;
		CHILD_CHECK(n > 0);
	}
}

/* Expect an ERROR for request @p id; its code, and its message in @p msg. */
static int raw_error(struct raw_rx *r, uint32_t id, char *msg, size_t len)
{
	struct dlpc__frame f;
	Dlpackd__V1__Error *e;
	int code;

	CHILD_CHECK(raw_next(r, &f) == 1);
	CHILD_CHECK(f.hdr.type == DLPC_MSG_ERROR && f.hdr.id == id);
	e = dlpackd__v1__error__unpack(NULL, f.hdr.len, f.payload);
	CHILD_CHECK(e != NULL);
	code = e->code;
	snprintf(msg, len, "%s", e->message);
	dlpackd__v1__error__free_unpacked(e, NULL);
	dlpc__frame_clear(&f);
	return code;
}

static void raw_open(struct raw_rx *r, const char *client)
{
	Dlpackd__V1__Hello hello = DLPACKD__V1__HELLO__INIT;
	struct dlpc__frame f;

	r->fd = raw_connect();
	dlpc__rx_init(&r->rx);
	hello.version_major = DLPC_PROTO_MAJOR;
	hello.version_minor = DLPC_PROTO_MINOR;
	hello.client = (char *)client;
	raw_send(r->fd, DLPC_MSG_HELLO, 1, &hello.base, NULL, 0, NULL, 0);
	CHILD_CHECK(raw_next(r, &f) == 1);
	CHILD_CHECK(f.hdr.type == (DLPC_MSG_HELLO | DLPC_MSG_REPLY));
	dlpc__frame_clear(&f);
}

static void raw_close(struct raw_rx *r)
{
	dlpc__rx_clear(&r->rx);
	close(r->fd);
}

/* Does the daemon hang up on @p r (after at most one ERROR) within @p ms? */
static bool raw_dropped(struct raw_rx *r, int ms)
{
	struct pollfd p = {.fd = r->fd, .events = POLLIN};
	struct dlpc__frame f;

	for (int frames = 0; frames < 2; frames++) {
		if (poll(&p, 1, scaled_ms(ms)) != 1)
			return false;
		if (raw_next(r, &f) == 0)
			return true;
		dlpc__frame_clear(&f);
	}
	return false;
}

/* A sealed read-only memfd of @p size bytes, every page allocated (the daemon refuses sparse
 * storage). */
static int sealed_memfd(uint64_t size)
{
	int fd = memfd_create("test_limits", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	CHILD_CHECK(fd >= 0);
	CHILD_CHECK(ftruncate(fd, (off_t)size) == 0);
	CHILD_CHECK(fallocate(fd, 0, 0, (off_t)size) == 0);
	CHILD_CHECK(fcntl(fd, F_ADD_SEALS,
			  F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) == 0);
	return fd;
}

/* PUBLISH one float at offset 0 of a storage of @p size bytes; the storage fd is closed. */
static void raw_publish(struct raw_rx *r, uint32_t id, const char *name, uint64_t size,
			const uint8_t *tail, size_t tail_len)
{
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc desc = DLPACKD__V1__TENSOR_DESC__INIT, *descs[] = {&desc};
	int64_t one = 1;
	int fd = sealed_memfd(size);

	desc.dtype_code = kDLFloat;
	desc.dtype_bits = 32;
	desc.dtype_lanes = 1;
	desc.n_shape = 1;
	desc.shape = &one;
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.device_type = kDLCPU;
	req.storage_size = size;
	req.n_tensors = 1;
	req.tensors = descs;
	raw_send(r->fd, DLPC_MSG_PUBLISH, id, &req.base, tail, tail_len, &fd, 1);
	close(fd);
}

/* The reply to request @p id: its type (and, for an ERROR, message in @p msg). */
static uint16_t raw_reply(struct raw_rx *r, uint32_t id, char *msg, size_t len)
{
	struct dlpc__frame f;
	uint16_t type;

	CHILD_CHECK(raw_next(r, &f) == 1);
	CHILD_CHECK(f.hdr.id == id);
	type = f.hdr.type;
	msg[0] = 0;
	if (type == DLPC_MSG_ERROR) {
		Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, f.hdr.len, f.payload);

		CHILD_CHECK(e != NULL);
		snprintf(msg, len, "%s", e->message);
		dlpackd__v1__error__free_unpacked(e, NULL);
	}
	dlpc__frame_clear(&f);
	return type;
}

static void raw_attach(struct raw_rx *r, uint32_t id, const char *name, int64_t timeout_ms)
{
	Dlpackd__V1__Attach req = DLPACKD__V1__ATTACH__INIT;

	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.timeout_ms = timeout_ms;
	raw_send(r->fd, DLPC_MSG_ATTACH, id, &req.base, NULL, 0, NULL, 0);
}

/* ---- ownership and access ---- */

static int nobody_and_root_entries(void *arg)
{
	DLManagedTensorVersioned *t;
	dlpc_client *c;

	(void)arg;
	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	/* anyone who can connect may attach read-only */
	CHILD_CHECK(dlpc_attach(c, "root/entry", NULL, &t) == 1);
	CHILD_CHECK(((float *)t->dl_tensor.data)[0] == 7.0f);
	t->deleter(t);
	/* not ours: refused, and the message says whose it is and who asked */
	CHILD_CHECK(publish(c, "root/entry", DLPC_PUBLISH_REPLACE) == -EPERM);
	CHILD_CHECK(error_says("belongs to uid 0") && error_says("uid 65534 may not replace"));
	/* taken by another uid: no word of REPLACE, which would fail as above */
	CHILD_CHECK(publish(c, "root/entry", 0) == -EEXIST);
	CHILD_CHECK(error_says("belongs to uid 0") && error_says("only that uid or root may"));
	CHILD_CHECK(!error_says("REPLACE"));
	CHILD_CHECK(dlpc_unpublish(c, "root/entry") == -EPERM);
	CHILD_CHECK(error_says("belongs to uid 0") && error_says("uid 65534 may not unpublish"));
	/* ours: the owner may replace and unpublish */
	CHILD_CHECK(publish(c, "nobody/own", 0) == 1);
	CHILD_CHECK(publish(c, "nobody/own", 0) == -EEXIST);
	CHILD_CHECK(error_says("publish with REPLACE to take it over"));
	CHILD_CHECK(publish(c, "nobody/own", DLPC_PUBLISH_REPLACE) == 2);
	CHILD_CHECK(publish(c, "nobody/gone", 0) == 1);
	CHILD_CHECK(dlpc_unpublish(c, "nobody/gone") == 0);
	dlpc_close(c);
	return 0;
}

START_TEST(test_ownership_across_uids)
{
	dlpc_client *c;
	uint32_t uid;
	int32_t pid;
	pid_t child;

	start(NULL, 0);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	data[0] = 7.0f;
	ck_assert_dlpc(publish(c, "root/entry", 0), 1);
	child = spawn(nobody_and_root_entries, NULL);
	ck_assert_int_eq(wait_child(child), 0);
	/* the refused requests changed nothing */
	owner_of(c, "root/entry", &uid, &pid);
	ck_assert_uint_eq(uid, 0);
	ck_assert_int_eq(pid, getpid());
	owner_of(c, "nobody/own", &uid, &pid);
	ck_assert_uint_eq(uid, NOBODY);
	ck_assert_int_eq(pid, child);
	/* root may replace and unpublish anyone's entry; the replacement is root's */
	ck_assert_dlpc(publish(c, "nobody/own", DLPC_PUBLISH_REPLACE), 3);
	owner_of(c, "nobody/own", &uid, &pid);
	ck_assert_uint_eq(uid, 0);
	ck_assert_dlpc(dlpc_unpublish(c, "nobody/own"), 0);
	ck_assert_dlpc(dlpc_unpublish(c, "root/entry"), 0);
	dlpc_close(c);
}
END_TEST

/* ---- channels across uids ---- */

static int send_4k(dlpc_client *c, const char *channel)
{
	DLDataType f32 = {kDLFloat, 32, 1};
	int64_t n = 1024;

	return dlpc_send(c, channel, host_tensor(data, f32, 1, &n, NULL, NULL), DLPC_SEND_NOWAIT);
}

/* As nobody, on root's channel under a quota of 8 KiB: not its to remove; root's message is
 * received and then charged to nobody while held; nobody's own messages are charged to it until
 * received, and refused beyond its quota. */
static int nobody_on_roots_channel(void *arg)
{
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	dlpc_channel_info info = {.size = sizeof(info)};
	dlpc_attach_info ai = {.size = sizeof(ai)};
	dlpc_stats st = {.size = sizeof(st)};
	DLManagedTensorVersioned *t;
	dlpc_client *c;

	(void)arg;
	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_channel_remove(c, "root/q") == -EPERM);
	CHILD_CHECK(error_says("channel 'root/q' belongs to uid 0; uid 65534 may not remove it"));
	CHILD_CHECK(dlpc_channel_stat(c, "root/q", &info) == 0);
	CHILD_CHECK(info.owner_uid == 0 && info.depth == 1);
	/* root's message: anyone may receive it; it says who sent it, and the one who holds it
	 * pays for it */
	CHILD_CHECK(dlpc_recv(c, "root/q", &now, &t) == 0);
	CHILD_CHECK(dlpc_tensor_attach_info(t, &ai) == 0 && ai.owner_uid == 0);
	CHILD_CHECK(((const float *)t->dl_tensor.data)[0] == 11.0f);
	CHILD_CHECK(dlpc_stat(c, &st) == 0 && st.uid_bytes_pinned == 4096);
	/* 4096 held and 4096 queued fill its 8 KiB; the next is refused and not queued */
	data[0] = 22.0f;
	CHILD_CHECK(send_4k(c, "root/q") == 0);
	CHILD_CHECK(send_4k(c, "root/q") == -EDQUOT);
	CHILD_CHECK(error_says("uid 65534 holds 8192 bytes and asks for 4096 more") &&
		    error_says("--max-bytes-per-uid"));
	CHILD_CHECK(dlpc_channel_stat(c, "root/q", &info) == 0 && info.depth == 1);
	t->deleter(t);
	CHILD_CHECK(dlpc_stat(c, &st) == 0 && st.uid_bytes_pinned == 0);
	CHILD_CHECK(send_4k(c, "root/q") == 0);
	CHILD_CHECK(dlpc_channel_stat(c, "root/q", &info) == 0 && info.depth == 2);
	dlpc_close(c);
	return 0;
}

START_TEST(test_channels_across_uids)
{
	static const char *const args[] = {"--max-bytes-per-uid", "8K", NULL};
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	dlpc_attach_info ai = {.size = sizeof(ai)};
	DLManagedTensorVersioned *t;
	dlpc_client *c;
	pid_t child;

	start(args, 0);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	ck_assert_dlpc(dlpc_channel_open(c, "root/q", 8, NULL), 1);
	data[0] = 11.0f;
	ck_assert_dlpc(send_4k(c, "root/q"), 0);
	ck_assert_uint_eq(stat_or_die(c).uid_bytes_held, 4096);
	child = spawn(nobody_on_roots_channel, NULL);
	ck_assert_int_eq(wait_child(child), 0);
	/* received by nobody and released: root pays for nothing more; nobody's two messages
	 * wait, charged to nobody, and say who sent them */
	ck_assert_uint_eq(stat_or_die(c).uid_bytes_held, 0);
	for (int i = 0; i < 2; i++) {
		ck_assert_dlpc(dlpc_recv(c, "root/q", &now, &t), 0);
		ck_assert_dlpc(dlpc_tensor_attach_info(t, &ai), 0);
		ck_assert_uint_eq(ai.owner_uid, NOBODY);
		ck_assert_int_eq(ai.owner_pid, child);
		ck_assert(((const float *)t->dl_tensor.data)[0] == 22.0f);
		t->deleter(t);
	}
	ck_assert_dlpc(dlpc_channel_remove(c, "root/q"), 0);
	dlpc_close(c);
}
END_TEST

/* Is @p word one of the '_'-separated words of @p name? ("device_uuid" names no uid.) */
static bool has_word(const char *name, const char *word)
{
	size_t n = strlen(word);

	for (const char *p = name; (p = strstr(p, word)); p += n)
		if ((p == name || p[-1] == '_') && (p[n] == '\0' || p[n] == '_'))
			return true;
	return false;
}

/* No field of a request names a user, process or group: the daemon could not take one from a
 * client even if it wanted to. */
static void no_identity_fields(const ProtobufCMessageDescriptor *d)
{
	static const char *const words[] = {"uid", "gid", "pid", "owner", "cred", "user"};

	for (unsigned i = 0; i < d->n_fields; i++) {
		/* the one exception names someone else: the publisher an attach insists on, which
		 * the daemon compares with the entry's SO_PEERCRED owner (test_owner_filter) */
		if (d == &dlpackd__v1__attach__descriptor &&
		    strcmp(d->fields[i].name, "owner_uid") == 0)
			continue;
		for (size_t w = 0; w < sizeof(words) / sizeof(words[0]); w++)
			ck_assert_msg(!has_word(d->fields[i].name, words[w]),
				      "%s.%s looks like an identity", d->name, d->fields[i].name);
	}
	ck_assert(has_word("owner_uid", "uid") && has_word("uid", "uid"));
}

/* As nobody, over the raw wire: HELLO claims to be root, and PUBLISH smuggles field 8 (EntryInfo's
 * owner_uid) = 0 and field 9 (owner_pid) = 1. Then try to unpublish root's entry. */
static int claim_root(void *arg)
{
	/* field 8, varint, 0; field 9, varint, 1 */
	static const uint8_t smuggled[] = {0x40, 0x00, 0x48, 0x01};
	struct raw_rx r;
	Dlpackd__V1__Unpublish un = DLPACKD__V1__UNPUBLISH__INIT;
	char msg[512];

	(void)arg;
	become_nobody();
	raw_open(&r, "uid=0 (root) pid=1");
	raw_publish(&r, 2, "claimed", 4096, smuggled, sizeof(smuggled));
	CHILD_CHECK(raw_reply(&r, 2, msg, sizeof(msg)) == (DLPC_MSG_PUBLISH | DLPC_MSG_REPLY));
	un.name.data = (uint8_t *)"root/entry";
	un.name.len = strlen("root/entry");
	raw_send(r.fd, DLPC_MSG_UNPUBLISH, 3, &un.base, NULL, 0, NULL, 0);
	CHILD_CHECK(raw_error(&r, 3, msg, sizeof(msg)) == EPERM);
	CHILD_CHECK(strstr(msg, "uid 65534 may not unpublish"));
	raw_close(&r);
	return 0;
}

START_TEST(test_credentials_from_kernel_only)
{
	dlpc_client *c;
	uint32_t uid;
	int32_t pid;
	pid_t child;

	no_identity_fields(&dlpackd__v1__hello__descriptor);
	no_identity_fields(&dlpackd__v1__publish__descriptor);
	no_identity_fields(&dlpackd__v1__tensor_desc__descriptor);
	no_identity_fields(&dlpackd__v1__attach__descriptor);
	no_identity_fields(&dlpackd__v1__unpublish__descriptor);
	no_identity_fields(&dlpackd__v1__release__descriptor);
	start(NULL, 0);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	ck_assert_dlpc(publish(c, "root/entry", 0), 1);
	child = spawn(claim_root, NULL);
	ck_assert_int_eq(wait_child(child), 0);
	owner_of(c, "claimed", &uid, &pid);
	ck_assert_uint_eq(uid, NOBODY);
	ck_assert_int_eq(pid, child);
	owner_of(c, "root/entry", &uid, &pid);
	ck_assert_uint_eq(uid, 0);
	dlpc_close(c);
}
END_TEST

static int nobody_connects(void *arg)
{
	dlpc_client *c;
	int expect = *(int *)arg, r;

	become_nobody();
	r = dlpc_connect(D.sock, &c);
	CHILD_CHECK(r == expect);
	if (r == 0)
		dlpc_close(c);
	return 0;
}

START_TEST(test_socket_permissions_decide_who_connects)
{
	struct stat st;
	int expect;

	start(NULL, 0);
	ck_assert_int_eq(stat(D.sock, &st), 0);
	ck_assert_uint_eq(st.st_mode & 07777, 0660);
	ck_assert_int_eq(chmod(D.dir, 0755), 0);
	/* 0660 root:root: nobody is neither owner nor in the group */
	expect = -EACCES;
	ck_assert_int_eq(wait_child(spawn(nobody_connects, &expect)), 0);
	/* the group decides (the systemd unit uses group dlpack): give it to nobody's group */
	ck_assert_int_eq(chown(D.sock, 0, NOBODY), 0);
	expect = 0;
	ck_assert_int_eq(wait_child(spawn(nobody_connects, &expect)), 0);
}
END_TEST

/* Attach "ro" over the raw wire to hold its fd, and try every way to write through it. */
static int try_to_write(void *arg)
{
	struct raw_rx r;
	struct dlpc__frame f;
	char path[64], byte = 1;
	void *p;
	int fd, rw;

	if (arg)
		become_nobody();
	raw_open(&r, "writer");
	raw_attach(&r, 2, "ro", 0);
	CHILD_CHECK(raw_next(&r, &f) == 1);
	CHILD_CHECK(f.hdr.type == (DLPC_MSG_ATTACH | DLPC_MSG_REPLY) && f.nfds == 1);
	fd = dlpc__frame_take_fd(&f, 0);
	dlpc__frame_clear(&f);
	errno = 0;
	CHILD_CHECK(pwrite(fd, &byte, 1, 0) < 0 && errno == EPERM);
	CHILD_CHECK(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) == MAP_FAILED &&
		    errno == EPERM);
	/* a read-only shared mapping cannot be made writable later */
	p = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
	CHILD_CHECK(p != MAP_FAILED);
	CHILD_CHECK(mprotect(p, 4096, PROT_READ | PROT_WRITE) < 0 && errno == EACCES);
	munmap(p, 4096);
	/* nor does opening the file again, read-write, through /proc */
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	rw = open(path, O_RDWR | O_CLOEXEC);
	if (rw >= 0) {
		CHILD_CHECK(pwrite(rw, &byte, 1, 0) < 0 && errno == EPERM);
		CHILD_CHECK(mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rw, 0) ==
				    MAP_FAILED &&
			    errno == EPERM);
		CHILD_CHECK(ftruncate(rw, 0) < 0 && errno == EPERM);
		CHILD_CHECK(fallocate(rw, 0, 0, 1 << 20) < 0 && errno == EPERM);
		close(rw);
	} else {
		CHILD_CHECK(errno == EACCES);
	}
	close(fd);
	raw_close(&r);
	return 0;
}

START_TEST(test_read_only_stays_read_only)
{
	DLManagedTensorVersioned *t;
	dlpc_attach_opts wr = {.size = sizeof(wr), .flags = DLPC_ATTACH_WRITABLE};
	dlpc_client *c;
	int nobody = 1;

	start(NULL, 0);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	data[0] = 3.0f;
	ck_assert_dlpc(publish(c, "ro", 0), 1);
	ck_assert_dlpc(dlpc_attach(c, "ro", &wr, &t), -EACCES);
	ck_assert_int_eq(wait_child(spawn(try_to_write, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(try_to_write, &nobody)), 0);
	/* nothing changed */
	ck_assert_dlpc(dlpc_attach(c, "ro", NULL, &t), 1);
	ck_assert(((float *)t->dl_tensor.data)[0] == 3.0f);
	t->deleter(t);
	dlpc_close(c);
}
END_TEST

static bool waiters_are(const dlpc_stats *s, void *arg)
{
	return s->waiters == *(uint64_t *)arg;
}

/* ---- names are first-come across uids ---- */

struct squatter {
	int cmd[2], ans[2];
};

/* As nobody: publish "a/model" (66.0f) first; then on each command byte from the parent, 'u'
 * unpublish it, 'p' publish it again or 'r' replace it, and answer with the same byte; exit at
 * EOF. */
static int squat(void *arg)
{
	struct squatter *q = arg;
	dlpc_client *c;
	char op;

	close(q->cmd[1]);
	close(q->ans[0]);
	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	data[0] = 66.0f;
	CHILD_CHECK(publish(c, "a/model", 0) == 1);
	CHILD_CHECK(write(q->ans[1], "r", 1) == 1);
	while (read(q->cmd[0], &op, 1) == 1) {
		if (op == 'u')
			CHILD_CHECK(dlpc_unpublish(c, "a/model") == 0);
		else
			CHILD_CHECK(publish(c, "a/model", op == 'r' ? DLPC_PUBLISH_REPLACE : 0) >
				    0);
		CHILD_CHECK(write(q->ans[1], &op, 1) == 1);
	}
	dlpc_close(c);
	return 0;
}

/* Have the squatter do @p op, and wait until it has. */
static void squatter_does(struct squatter *q, char op)
{
	char got = 0;

	ck_assert_int_eq(write(q->cmd[1], &op, 1), 1);
	ck_assert_int_eq(read(q->ans[0], &got, 1), 1);
	ck_assert_int_eq(got, op);
}

/* As root: wait for "a/model" as published by uid 0, and get root's bytes (7.0f). */
static int wait_for_root(void *arg)
{
	dlpc_attach_opts o = {.size = sizeof(o), .flags = DLPC_ATTACH_OWNER, .owner_uid = 0};
	dlpc_attach_info info = {.size = sizeof(info)};
	DLManagedTensorVersioned *t;
	dlpc_client *c;

	o.timeout_ms = *(int *)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "a/model", &o, &t) > 0);
	CHILD_CHECK(((float *)t->dl_tensor.data)[0] == 7.0f);
	CHILD_CHECK(dlpc_tensor_attach_info(t, &info) == 0);
	CHILD_CHECK(info.owner_uid == 0 && info.owner_pid == getppid());
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

START_TEST(test_owner_filter)
{
	dlpc_attach_opts o = {.size = sizeof(o), .flags = DLPC_ATTACH_OWNER, .owner_uid = 0};
	dlpc_attach_opts small = o;
	dlpc_attach_info info = {.size = sizeof(info)};
	DLManagedTensorVersioned *t;
	struct squatter q;
	uint64_t one = 1, none = 0;
	int wait_ms = scaled_ms(20000), short_ms = scaled_ms(200);
	pid_t squatter, waiter;
	dlpc_client *c;
	char text[160], x;

	start(NULL, 0);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	ck_assert_int_eq(pipe2(q.cmd, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(q.ans, O_CLOEXEC), 0);
	squatter = spawn(squat, &q);
	close(q.cmd[0]);
	close(q.ans[1]);
	ck_assert_int_eq(read(q.ans[0], &x, 1), 1);

	/* without the owner check, the squatter's entry is what one gets, and says whose it is */
	ck_assert_dlpc(dlpc_attach(c, "a/model", NULL, &t), 1);
	ck_assert(((float *)t->dl_tensor.data)[0] == 66.0f);
	ck_assert_dlpc(dlpc_tensor_attach_info(t, &info), 0);
	ck_assert_uint_eq(info.owner_uid, NOBODY);
	ck_assert_int_eq(info.owner_pid, squatter);
	t->deleter(t);
	/* with it, at once: absent, and the message names both uids */
	ck_assert_dlpc(dlpc_attach(c, "a/model", &o, &t), -ENOENT);
	ck_assert_msg(error_says("no entry named 'a/model' published by uid 0 (the entry there "
				 "was published by uid 65534)"),
		      "%s", dlpc_last_error());
	/* waiting for an owner that never publishes: the wait expires, naming that owner */
	o.owner_uid = 4242;
	o.timeout_ms = short_ms;
	ck_assert_dlpc(dlpc_attach(c, "a/model", &o, &t), -ETIMEDOUT);
	snprintf(text, sizeof(text),
		 "no entry named '%s' published by uid %u appeared within %d ms", "a/model",
		 o.owner_uid, short_ms);
	ck_assert_msg(error_says(text), "%s", dlpc_last_error());
	ck_assert(wait_stat(c, waiters_are, &none, 5000));
	/* the owner is an option field: options too short to hold it are refused */
	small.size = offsetof(dlpc_attach_opts, owner_uid);
	ck_assert_dlpc(dlpc_attach(c, "a/model", &small, &t), -EINVAL);

	/* a waiter for root's entry waits while the squatter's is there, through the squatter
	 * replacing it, and through the squatter publishing again the moment the name is free */
	waiter = spawn(wait_for_root, &wait_ms);
	ck_assert(wait_stat(c, waiters_are, &one, 5000));
	squatter_does(&q, 'r');
	ck_assert_uint_eq(stat_or_die(c).waiters, 1);
	squatter_does(&q, 'u');
	squatter_does(&q, 'p');
	ck_assert_uint_eq(stat_or_die(c).waiters, 1);
	ck_assert_int_eq(waitpid(waiter, NULL, WNOHANG), 0);
	squatter_does(&q, 'u');
	ck_assert_uint_eq(stat_or_die(c).waiters, 1);
	/* root publishes: the waiter gets root's bytes */
	data[0] = 7.0f;
	ck_assert_dlpc(publish(c, "a/model", 0), 1);
	ck_assert_int_eq(wait_child(waiter), 0);
	ck_assert_uint_eq(stat_or_die(c).waiters, 0);
	/* root may also take the name back by replacing the squatter's entry: that answers too */
	ck_assert_dlpc(dlpc_unpublish(c, "a/model"), 0);
	squatter_does(&q, 'p');
	waiter = spawn(wait_for_root, &wait_ms);
	ck_assert(wait_stat(c, waiters_are, &one, 5000));
	ck_assert_dlpc(publish(c, "a/model", DLPC_PUBLISH_REPLACE), 2);
	ck_assert_int_eq(wait_child(waiter), 0);
	close(q.cmd[1]);
	close(q.ans[0]);
	ck_assert_int_eq(wait_child(squatter), 0);
	dlpc_close(c);
}
END_TEST

/* ---- per-uid quotas ---- */

static int nobody_entries(void *arg)
{
	dlpc_client *c;
	int limit = *(int *)arg;
	char name[32];

	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	for (int i = 0; i < limit; i++) {
		snprintf(name, sizeof(name), "nobody/%d", i);
		CHILD_CHECK(publish(c, name, 0) == 1);
	}
	CHILD_CHECK(publish(c, "nobody/over", 0) == -EDQUOT);
	CHILD_CHECK(error_says("uid 65534 has 3 entries published; the limit is 3"));
	dlpc_close(c);
	return 0;
}

START_TEST(test_quota_entries_per_uid)
{
	static const char *const args[] = {"--max-entries-per-uid", "3", NULL};
	dlpc_client *c;
	dlpc_stats s;
	int limit = 3;

	start(args, 0);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	ck_assert_dlpc(publish(c, "a", 0), 1);
	ck_assert_dlpc(publish(c, "b", 0), 1);
	ck_assert_dlpc(publish(c, "c", DLPC_PUBLISH_EPHEMERAL), 1);
	ck_assert_dlpc(publish(c, "d", 0), -EDQUOT);
	ck_assert_msg(error_says("cannot publish 'd'") &&
			      error_says("uid 0 has 3 entries published; the limit is 3 "
					 "(--max-entries-per-uid)"),
		      "%s", dlpc_last_error());
	/* replacing one's own entry adds none */
	ck_assert_dlpc(publish(c, "a", DLPC_PUBLISH_REPLACE), 2);
	s = stat_or_die(c);
	ck_assert_uint_eq(s.uid_entries, 3);
	ck_assert_uint_eq(s.entries, 3);
	/* another uid has a quota of its own */
	ck_assert_int_eq(wait_child(spawn(nobody_entries, &limit)), 0);
	/* an unpublished name makes room */
	ck_assert_dlpc(dlpc_unpublish(c, "b"), 0);
	ck_assert_dlpc(publish(c, "d", 0), 1);
	ck_assert_uint_eq(stat_or_die(c).uid_entries, 3);
	dlpc_close(c);
}
END_TEST

/* --max-memory-per-uid in the memory test: room for a few hundred references. */
#define MEMORY_LIMIT 65536
#define MEMORY_REFS_MAX 1024

/* What the memory test's child tells its parent, and when the parent lets it go on. */
struct memory_test {
	int full[2], done[2];
};

/* Attach 'x' over two connections until the uid's memory is full; how many it took. */
static size_t attach_until_full(dlpc_client *c[2], DLManagedTensorVersioned **held)
{
	size_t n = 0;
	int r;

	while (n < MEMORY_REFS_MAX && (r = dlpc_attach(c[n % 2], "x", NULL, &held[n])) == 1)
		n++;
	CHILD_CHECK(n < MEMORY_REFS_MAX && r == -EDQUOT);
	CHILD_CHECK(error_says("cannot attach 'x': uid 65534 has") &&
		    error_says("the limit is 65536 (--max-memory-per-uid)"));
	return n;
}

static int nobody_memory(void *arg)
{
	static DLManagedTensorVersioned *held[MEMORY_REFS_MAX];
	struct memory_test *t = arg;
	dlpc_client *c[2], *third;
	size_t n, again;
	char go;

	become_nobody();
	for (int i = 0; i < 2; i++)
		CHILD_CHECK(dlpc_connect_flags(D.sock, DLPC_CONNECT_NO_CACHE, &c[i]) == 0);
	/* the bound is the uid's, across its connections (each may hold 65536 references) */
	n = attach_until_full(c, held);
	/* (its connections and the frame being read take part of it) */
	CHILD_CHECK(n >= MEMORY_LIMIT / 256 && n <= MEMORY_LIMIT / 64);
	/* while it is full, nothing else that takes the daemon's memory is let in */
	CHILD_CHECK(publish(c[0], "nobody/e", 0) == -EDQUOT && error_says("--max-memory-per-uid"));
	CHILD_CHECK(dlpc_channel_open(c[0], "nobody/ch", 0, NULL) == -EDQUOT &&
		    error_says("--max-memory-per-uid"));
	/* a connection takes memory too: a third one is refused at HELLO */
	CHILD_CHECK(dlpc_connect(D.sock, &third) == -EDQUOT &&
		    error_says("connections, entries, messages, channels and references") &&
		    error_says("--max-memory-per-uid"));
	CHILD_CHECK(write(t->full[1], "f", 1) == 1);
	CHILD_CHECK(read(t->done[0], &go, 1) == 1);
	/* released references give their memory back: as many again, and no more */
	for (size_t i = 0; i < n; i++)
		held[i]->deleter(held[i]);
	again = attach_until_full(c, held);
	CHILD_CHECK(again == n);
	for (size_t i = 0; i < n; i++)
		held[i]->deleter(held[i]);
	/* and so do unpublished entries: publish until full, unpublish, publish as many again */
	for (n = 0; n < MEMORY_REFS_MAX; n++) {
		char name[32];

		snprintf(name, sizeof(name), "nobody/%zu", n);
		if (publish(c[0], name, 0) != 1)
			break;
	}
	CHILD_CHECK(n > 0 && n < MEMORY_LIMIT / 512 && error_says("--max-memory-per-uid"));
	for (size_t i = 0; i < n; i++) {
		char name[32];

		snprintf(name, sizeof(name), "nobody/%zu", i);
		CHILD_CHECK(dlpc_unpublish(c[0], name) == 0);
	}
	CHILD_CHECK(publish(c[0], "nobody/0", 0) == 1);
	dlpc_close(c[0]);
	dlpc_close(c[1]);
	return 0;
}

/* One uid's connections, references, entries and channels take at most --max-memory-per-uid of
 * the daemon's memory, across all its connections; reaching it costs that uid alone; releasing gives it
 * back. */
START_TEST(test_memory_per_uid)
{
	static const char *const args[] = {"--max-memory-per-uid", "65536", NULL};
	struct memory_test t;
	DLManagedTensorVersioned *mine;
	dlpc_client *c;
	pid_t child;
	char got;

	ck_assert_int_eq(pipe2(t.full, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(t.done, O_CLOEXEC), 0);
	start(args, 0);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	ck_assert_dlpc(publish(c, "x", 0), 1);
	child = spawn(nobody_memory, &t);
	ck_assert_int_eq(read(t.full[0], &got, 1), 1);
	/* root is another uid: it publishes, attaches and opens channels all along */
	ck_assert_dlpc(publish(c, "root/y", 0), 1);
	ck_assert_dlpc(dlpc_attach(c, "x", NULL, &mine), 1);
	ck_assert_dlpc(dlpc_channel_open(c, "root/ch", 0, NULL), 1);
	mine->deleter(mine);
	ck_assert_int_eq(write(t.done[1], "g", 1), 1);
	ck_assert_int_eq(wait_child(child), 0);
	for (int i = 0; i < 2; i++) {
		close(t.full[i]);
		close(t.done[i]);
	}
	dlpc_close(c);
}
END_TEST

/* A storage far larger than the one float it holds (16 MiB, allocated). */
#define BIG (16ull << 20)

static int nobody_big(void *arg)
{
	struct raw_rx r;
	char msg[512];

	(void)arg;
	become_nobody();
	raw_open(&r, "big");
	raw_publish(&r, 2, "nobody/big", BIG, NULL, 0);
	CHILD_CHECK(raw_reply(&r, 2, msg, sizeof(msg)) == (DLPC_MSG_PUBLISH | DLPC_MSG_REPLY));
	raw_close(&r);
	return 0;
}

START_TEST(test_quota_bytes_count_declared_size)
{
	static const char *const args[] = {"--max-bytes-per-uid", "16M", NULL};
	struct raw_rx r;
	dlpc_client *c;
	char msg[512];

	start(args, 0);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	/* 16 MiB holding one float count as 16 MiB: the declared storage, not the tensor */
	raw_open(&r, "big");
	raw_publish(&r, 2, "big", BIG, NULL, 0);
	ck_assert_uint_eq(raw_reply(&r, 2, msg, sizeof(msg)), DLPC_MSG_PUBLISH | DLPC_MSG_REPLY);
	ck_assert_uint_eq(stat_or_die(c).uid_bytes_held, BIG);
	/* not even one float (a storage of 4 bytes) fits now */
	ck_assert_dlpc(publish_n(c, "one", 1, 0), -EDQUOT);
	ck_assert_msg(error_says("uid 0 holds 16777216 bytes and asks for 4 more; the "
				 "limit is 16777216 bytes (--max-bytes-per-uid)"),
		      "%s", dlpc_last_error());
	raw_publish(&r, 3, "big2", BIG, NULL, 0);
	ck_assert_uint_eq(raw_reply(&r, 3, msg, sizeof(msg)), DLPC_MSG_ERROR);
	ck_assert_msg(strstr(msg, "--max-bytes-per-uid"), "%s", msg);
	/* nobody has 16 MiB of its own */
	ck_assert_int_eq(wait_child(spawn(nobody_big, NULL)), 0);
	ck_assert_uint_eq(stat_or_die(c).bytes_held, 2 * BIG);
	raw_close(&r);
	dlpc_close(c);
}
END_TEST

static bool uid_pinned_is(const dlpc_stats *s, void *arg)
{
	return s->uid_bytes_pinned == *(uint64_t *)arg;
}

START_TEST(test_quota_bytes_held_until_freed)
{
	static const char *const args[] = {"--max-bytes-per-uid", "8K", NULL};
	DLManagedTensorVersioned *held;
	dlpc_client *c;
	uint64_t want;

	start(args, 0);
	c = connect_or_die(&D);
	ck_assert_dlpc(publish(c, "a", 0), 1);
	ck_assert_dlpc(dlpc_attach(c, "a", NULL, &held), 1);
	/* the replaced storage lives on for its attacher, and still counts: against the uid
	 * whose reference keeps it, here the same */
	ck_assert_dlpc(publish(c, "a", DLPC_PUBLISH_REPLACE), 2);
	ck_assert_uint_eq(stat_or_die(c).uid_bytes_held, 4096);
	ck_assert_uint_eq(stat_or_die(c).uid_bytes_pinned, 4096);
	ck_assert_dlpc(publish(c, "b", 0), -EDQUOT);
	ck_assert_msg(error_says("holds 8192 bytes (4096 of them in storages no name reaches any "
				 "more, which its references keep alive) and asks for 4096 more; "
				 "the limit is 8192"),
		      "%s", dlpc_last_error());
	/* released, it is freed, and its bytes return */
	held->deleter(held);
	want = 0;
	ck_assert(wait_stat(c, uid_pinned_is, &want, 5000));
	ck_assert_uint_eq(stat_or_die(c).uid_bytes_held, 4096);
	ck_assert_dlpc(publish(c, "b", 0), 1);
	/* at the limit, a replace whose old storage nobody holds fits: it is freed at once */
	ck_assert_dlpc(publish(c, "b", DLPC_PUBLISH_REPLACE), 2);
	ck_assert_uint_eq(stat_or_die(c).uid_bytes_held, 8192);
	/* an unpublished storage nobody holds returns its bytes */
	ck_assert_dlpc(dlpc_unpublish(c, "a"), 0);
	ck_assert_uint_eq(stat_or_die(c).uid_bytes_held, 4096);
	dlpc_close(c);
}
END_TEST

static int nobody_connects_twice(void *arg)
{
	dlpc_client *a, *b;

	(void)arg;
	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &a) == 0);
	CHILD_CHECK(dlpc_connect(D.sock, &b) == 0);
	dlpc_close(a);
	dlpc_close(b);
	return 0;
}

static bool conns_are(const dlpc_stats *s, void *arg)
{
	return s->connections == *(uint64_t *)arg;
}

static bool uid_conns_at_most(const dlpc_stats *s, void *arg)
{
	return s->uid_connections <= *(uint64_t *)arg;
}

/* ---- storage no name reaches: charged to whoever keeps it alive ---- */

/* Generations of a 1 MiB entry that uid 65534 attaches and holds. */
#define PIN_GENERATIONS 6
#define PIN_SIZE (1u << 20)
static float pin_data[PIN_SIZE / sizeof(float)];

static int publish_mib(dlpc_client *c, const char *name, uint32_t flags)
{
	DLDataType f32 = {kDLFloat, 32, 1};
	int64_t n = PIN_SIZE / sizeof(float);

	return dlpc_publish(c, name, host_tensor(pin_data, f32, 1, &n, NULL, NULL), flags);
}

static int publish_pinned(dlpc_client *c, uint32_t flags)
{
	return publish_mib(c, "pinned", flags);
}

struct pin_pipes {
	int go[2], done[2];
};

static int nobody_pins_each_generation(void *arg)
{
	struct pin_pipes *pp = arg;
	DLManagedTensorVersioned *held[PIN_GENERATIONS];
	dlpc_client *c;
	dlpc_stats s = {.size = sizeof(s)};
	char x;

	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	for (int i = 0; i < PIN_GENERATIONS; i++) {
		CHILD_CHECK(read(pp->go[0], &x, 1) == 1);
		CHILD_CHECK(dlpc_attach(c, "pinned", NULL, &held[i]) == i + 1);
		CHILD_CHECK(write(pp->done[1], "x", 1) == 1);
	}
	/* all but the generation a name still reaches are its to pay for */
	CHILD_CHECK(dlpc_stat(c, &s) == 0);
	CHILD_CHECK(s.uid_bytes_pinned == (PIN_GENERATIONS - 1) * (uint64_t)PIN_SIZE);
	CHILD_CHECK(s.uid_bytes_held == 0);
	/* ... against its own quota: 5 MiB pinned leave no room under 3 MiB */
	CHILD_CHECK(publish(c, "nobody/small", 0) == -EDQUOT);
	CHILD_CHECK(error_says("which its references keep alive") &&
		    error_says("--max-bytes-per-uid"));
	for (int i = 0; i < PIN_GENERATIONS; i++)
		held[i]->deleter(held[i]);
	/* the releases ride with this request */
	CHILD_CHECK(dlpc_stat(c, &s) == 0);
	CHILD_CHECK(s.uid_bytes_pinned == 0);
	CHILD_CHECK(publish(c, "nobody/small", 0) == 1);
	dlpc_close(c);
	return 0;
}

/* Uid 65534 attaches and holds every generation of root's entry; root replaces it again and
 * again under a 3 MiB quota, charged only for the generation its name reaches. */
START_TEST(test_pinned_storage_charged_to_holder)
{
	static const char *const args[] = {"--max-bytes-per-uid", "3M", NULL};
	struct pin_pipes pp;
	dlpc_client *c;
	dlpc_stats s;
	pid_t child;
	char x;

	start(args, 0);
	daemon_open_for_others(&D);
	ck_assert_int_eq(pipe2(pp.go, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(pp.done, O_CLOEXEC), 0);
	c = connect_or_die(&D);
	ck_assert_dlpc(publish_pinned(c, 0), 1);
	child = spawn(nobody_pins_each_generation, &pp);
	for (int i = 0; i < PIN_GENERATIONS; i++) {
		ck_assert_int_eq(write(pp.go[1], "x", 1), 1);
		ck_assert_int_eq(read(pp.done[0], &x, 1), 1);
		if (i + 1 < PIN_GENERATIONS)
			ck_assert_dlpc(publish_pinned(c, DLPC_PUBLISH_REPLACE), i + 2);
		s = stat_or_die(c);
		ck_assert_uint_eq(s.uid_bytes_held, PIN_SIZE);
		ck_assert_uint_eq(s.uid_bytes_pinned, 0);
	}
	ck_assert_int_eq(wait_child(child), 0);
	/* released: the old generations are freed, the daemon holds the live one alone */
	s = stat_or_die(c);
	ck_assert_uint_eq(s.uid_bytes_held, PIN_SIZE);
	ck_assert_uint_eq(s.storages, 2); /* the live generation and nobody/small */
	for (int i = 0; i < 2; i++) {
		close(pp.go[i]);
		close(pp.done[i]);
	}
	dlpc_close(c);
}
END_TEST

static int nobody_publishes_pinned(void *arg)
{
	dlpc_client *c;

	(void)arg;
	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(publish_pinned(c, 0) == 1);
	dlpc_close(c);
	return 0;
}

/* Root holds uid 65534's entry and replaces it: the old storage it keeps alive counts against
 * its quota before the replace is let through, not after. */
START_TEST(test_replace_of_a_held_entry_counts_what_it_pins)
{
	static const char *const args[] = {"--max-bytes-per-uid", "3M", NULL};
	DLManagedTensorVersioned *held;
	dlpc_client *c;
	dlpc_stats s;
	uint64_t none = 0;

	start(args, 0);
	daemon_open_for_others(&D);
	ck_assert_int_eq(wait_child(spawn(nobody_publishes_pinned, NULL)), 0);
	c = connect_or_die(&D);
	ck_assert_dlpc(dlpc_attach(c, "pinned", NULL, &held), 1);
	ck_assert_dlpc(publish_mib(c, "mine/1", 0), 1);
	ck_assert_dlpc(publish_mib(c, "mine/2", 0), 1);
	/* 2 MiB held, 1 MiB new, and the 1 MiB it holds would be its to pay for */
	ck_assert_dlpc(publish_pinned(c, DLPC_PUBLISH_REPLACE), -EDQUOT);
	ck_assert_msg(error_says("uid 0 holds 3145728 bytes") &&
			      error_says("the one this replace unnames among them"),
		      "%s", dlpc_last_error());
	s = stat_or_die(c);
	ck_assert_uint_eq(s.uid_bytes_held, 2 * PIN_SIZE);
	ck_assert_uint_eq(s.uid_bytes_pinned, 0);
	/* released, the replace fits, and the old generation is freed at once */
	held->deleter(held);
	ck_assert_dlpc(publish_pinned(c, DLPC_PUBLISH_REPLACE), 2);
	ck_assert(wait_stat(c, uid_pinned_is, &none, 5000));
	s = stat_or_die(c);
	ck_assert_uint_eq(s.uid_bytes_held, 3 * PIN_SIZE);
	ck_assert_uint_eq(s.storages, 3);
	dlpc_close(c);
}
END_TEST

START_TEST(test_quota_connections_per_uid)
{
	static const char *const args[] = {"--max-connections-per-uid", "2", NULL};
	dlpc_client *a, *b, *x = NULL;
	uint64_t one = 1;

	start(args, 0);
	daemon_open_for_others(&D);
	a = connect_or_die(&D);
	b = connect_or_die(&D);
	ck_assert_dlpc(dlpc_connect(D.sock, &x), -EDQUOT);
	ck_assert_ptr_null(x);
	ck_assert_msg(error_says("uid 0 has 2 connections open; the limit is 2 "
				 "(--max-connections-per-uid)"),
		      "%s", dlpc_last_error());
	ck_assert_uint_eq(stat_or_die(a).uid_connections, 2);
	/* another uid is not affected */
	ck_assert_int_eq(wait_child(spawn(nobody_connects_twice, NULL)), 0);
	/* a closed connection makes room */
	dlpc_close(b);
	ck_assert(wait_stat(a, conns_are, &one, 5000));
	b = connect_or_die(&D);
	ck_assert(log_has(D.log, "refused: uid 0 has 2 connections open, the limit is 2"));
	/* connections that never send HELLO are not a way around it: past the limit plus
	 * DLPC_UID_CONNECTIONS_SLACK they are closed as soon as they are accepted */
	{
		int socks[2 + DLPC_UID_CONNECTIONS_SLACK + 16];
		uint64_t most = 2 + DLPC_UID_CONNECTIONS_SLACK, conns;

		for (size_t i = 0; i < sizeof(socks) / sizeof(socks[0]); i++)
			socks[i] = raw_connect();
		for (int i = 0; i < 100 && !log_has(D.log, "by more than"); i++)
			usleep(scaled_ms(20) * 1000);
		ck_assert(log_has(D.log, "(--max-connections-per-uid) by more than 8"));
		/* a refused connection is destroyed once its loop turn is over (and its ERROR
		 * has left): soon, not necessarily before this STAT is answered */
		ck_assert(wait_stat(a, uid_conns_at_most, &most, 5000));
		conns = stat_or_die(a).uid_connections;
		ck_assert_msg(conns <= most, "uid 0 holds %llu connections",
			      (unsigned long long)conns);
		for (size_t i = 0; i < sizeof(socks) / sizeof(socks[0]); i++)
			close(socks[i]);
	}
	dlpc_close(a);
	dlpc_close(b);
}
END_TEST

/* In a child, as nobody: hold DLPC_UID_CONNECTIONS_SLACK + 2 connections that never send
 * HELLO (the limit being 1), so that the next is refused as soon as it is accepted; then
 * dlpc_connect() must fail at once with the daemon's reason, not retry it as if an upgrade had
 * dropped it until the call timeout ends (or forever, without one). */
static int nobody_refused_at_accept(void *arg)
{
	int socks[DLPC_UID_CONNECTIONS_SLACK + 2];
	dlpc_client *c = NULL;
	int r;

	(void)arg;
	become_nobody();
	for (size_t i = 0; i < sizeof(socks) / sizeof(socks[0]); i++)
		socks[i] = raw_connect();
	/* long enough that a retry loop could not hide the refusal: it would end with it */
	CHILD_CHECK(setenv(DLPC_CALL_TIMEOUT_ENV, "20000", 1) == 0);
	r = dlpc_connect(D.sock, &c);
	if (r != -EDQUOT || !error_says("--max-connections-per-uid")) {
		fprintf(stderr, "dlpc_connect() = %d: %s\n", r, dlpc_last_error());
		return 1;
	}
	CHILD_CHECK(c == NULL);
	for (size_t i = 0; i < sizeof(socks) / sizeof(socks[0]); i++)
		close(socks[i]);
	return 0;
}

START_TEST(test_refused_at_accept_says_why)
{
	static const char *const args[] = {"--max-connections-per-uid", "1", "--frame-timeout-ms",
					   "120000", NULL};

	start(args, 0);
	daemon_open_for_others(&D);
	ck_assert_int_eq(wait_child(spawn(nobody_refused_at_accept, NULL)), 0);
	ck_assert(log_has(D.log, "(--max-connections-per-uid) by more than 8"));
}
END_TEST

/* ---- per-connection limits ---- */

START_TEST(test_refs_per_connection)
{
	static const char *const args[] = {"--max-refs-per-connection", "2", NULL};
	DLManagedTensorVersioned *t[3];
	dlpc_client *c, *other;
	struct raw_rx r;
	char msg[512];

	start(args, 0);
	c = connect_or_die(&D);
	other = connect_or_die(&D);
	ck_assert_dlpc(publish(c, "x", 0), 1);
	ck_assert_dlpc(dlpc_attach(c, "x", NULL, &t[0]), 1);
	ck_assert_dlpc(dlpc_attach(c, "x", NULL, &t[1]), 1);
	ck_assert_dlpc(dlpc_attach(c, "x", NULL, &t[2]), -EDQUOT);
	ck_assert_msg(error_says("cannot attach 'x': this connection holds 2 references; the "
				 "limit is 2 (--max-refs-per-connection)"),
		      "%s", dlpc_last_error());
	/* per connection: another one attaches */
	ck_assert_dlpc(dlpc_attach(other, "x", NULL, &t[2]), 1);
	t[2]->deleter(t[2]);
	/* a release makes room */
	t[0]->deleter(t[0]);
	ck_assert_dlpc(dlpc_attach(c, "x", NULL, &t[0]), 1);
	t[0]->deleter(t[0]);
	t[1]->deleter(t[1]);
	/* an attach that waited is held to the limit when a publish answers it */
	raw_open(&r, "waiter");
	raw_attach(&r, 2, "x", 0);
	raw_attach(&r, 3, "x", 0);
	raw_attach(&r, 4, "y", -1);
	ck_assert_uint_eq(raw_reply(&r, 2, msg, sizeof(msg)), DLPC_MSG_ATTACH | DLPC_MSG_REPLY);
	ck_assert_uint_eq(raw_reply(&r, 3, msg, sizeof(msg)), DLPC_MSG_ATTACH | DLPC_MSG_REPLY);
	ck_assert_dlpc(publish(c, "y", 0), 1);
	ck_assert_int_eq(raw_error(&r, 4, msg, sizeof(msg)), EDQUOT);
	ck_assert_msg(strstr(msg, "cannot attach 'y'") && strstr(msg, "--max-refs-per-connection"),
		      "%s", msg);
	raw_close(&r);
	dlpc_close(c);
	dlpc_close(other);
}
END_TEST

START_TEST(test_pending_per_connection)
{
	static const char *const args[] = {"--max-pending-per-connection", "2", NULL};
	struct raw_rx r;
	dlpc_client *c;
	char msg[512];
	uint64_t two = 2, none = 0;

	start(args, 0);
	c = connect_or_die(&D);
	raw_open(&r, "waiter");
	raw_attach(&r, 2, "later/a", -1);
	raw_attach(&r, 3, "later/b", -1);
	raw_attach(&r, 4, "later/c", -1);
	ck_assert_int_eq(raw_error(&r, 4, msg, sizeof(msg)), EDQUOT);
	ck_assert_msg(strstr(msg, "cannot wait for 'later/c': this connection has 2 requests "
				  "waiting; the limit is 2 (--max-pending-per-connection)"),
		      "%s", msg);
	ck_assert(wait_stat(c, waiters_are, &two, 5000));
	/* the connection is still served: publishing wakes a waiter, which frees a place */
	ck_assert_dlpc(publish(c, "later/a", 0), 1);
	ck_assert_uint_eq(raw_reply(&r, 2, msg, sizeof(msg)), DLPC_MSG_ATTACH | DLPC_MSG_REPLY);
	raw_attach(&r, 5, "later/c", 0);
	ck_assert_int_eq(raw_error(&r, 5, msg, sizeof(msg)), ENOENT);
	raw_attach(&r, 6, "later/c", -1);
	ck_assert(wait_stat(c, waiters_are, &two, 5000));
	raw_close(&r);
	ck_assert(wait_stat(c, waiters_are, &none, 5000));
	dlpc_close(c);
}
END_TEST

START_TEST(test_frame_deadline)
{
	int ms = scaled_ms(300);
	char arg[32], text[128];
	const char *const args[] = {"--frame-timeout-ms", arg, NULL};
	struct raw_rx stall, idle, mute;
	Dlpackd__V1__Stat req = DLPACKD__V1__STAT__INIT;
	struct dlpc__scratch s = {0};
	dlpc_client *c;
	ssize_t len;
	char msg[512];

	snprintf(arg, sizeof(arg), "%d", ms);
	start(args, 0);
	c = connect_or_die(&D);
	raw_open(&stall, "stall");
	raw_open(&idle, "idle");
	mute.fd = raw_connect();
	dlpc__rx_init(&mute.rx);
	ck_assert_msg(raw_dropped(&mute, 10000), "a connection without HELLO was not dropped");
	snprintf(text, sizeof(text), "no complete HELLO within %d ms of connecting", ms);
	ck_assert(log_has(D.log, text));
	/* connections that send whole frames may stay idle as long as they like */
	usleep((useconds_t)ms * 2 * 1000);
	raw_send(idle.fd, DLPC_MSG_STAT, 7, &req.base, NULL, 0, NULL, 0);
	ck_assert_uint_eq(raw_reply(&idle, 7, msg, sizeof(msg)), DLPC_MSG_STAT | DLPC_MSG_REPLY);
	raw_send(stall.fd, DLPC_MSG_STAT, 8, &req.base, NULL, 0, NULL, 0);
	ck_assert_uint_eq(raw_reply(&stall, 8, msg, sizeof(msg)), DLPC_MSG_STAT | DLPC_MSG_REPLY);
	len = dlpc__msg_frame(&s, DLPC_MSG_STAT, 9, &req.base, 0);
	ck_assert_int_gt(len, 8);
	/* half a frame, long after HELLO, then nothing: dropped */
	ck_assert_int_eq(write(stall.fd, s.p, 6), 6);
	dlpc__scratch_clear(&s);
	ck_assert_msg(raw_dropped(&stall, 10000), "a stalled frame was not dropped");
	snprintf(text, sizeof(text), "is still incomplete; the limit is %d ms (--frame-timeout-ms)",
		 ms);
	ck_assert(log_has(D.log, text));
	ck_assert_uint_eq(stat_or_die(c).protocol_errors, 0);
	raw_close(&stall);
	raw_close(&mute);
	raw_close(&idle);
	dlpc_close(c);
}
END_TEST

/* ---- fd exhaustion ---- */

/* The daemon's CPU time so far, in clock ticks (utime + stime, /proc/PID/stat). */
static long cpu_ticks(pid_t pid)
{
	char path[64], buf[1024], *p;
	long utime, stime;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	ck_assert_ptr_nonnull(fgets(buf, sizeof(buf), f));
	fclose(f);
	/* after the command name, which ends with the last ')': fields 3.. */
	p = strrchr(buf, ')');
	ck_assert_ptr_nonnull(p);
	ck_assert_int_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %ld %ld",
				&utime, &stime),
			 2);
	return utime + stime;
}

/* The daemon's fd limit in the EMFILE test: few enough to run out with a handful of clients. */
#define LOW_NOFILE 64

/* One uid may use all the fds here: these tests are about the daemon's whole budget. */
static const char *const whole_budget[] = {"--max-fd-share-per-uid", "100", NULL};

START_TEST(test_accept_pauses_when_fds_run_out)
{
	int socks[2 * LOW_NOFILE];
	dlpc_client *c, *late;
	DLManagedTensorVersioned *t;
	long before, spent;
	uint64_t one = 1;

	start(whole_budget, LOW_NOFILE);
	c = connect_or_die(&D);
	ck_assert_dlpc(publish(c, "kept", 0), 1);
	/* more connections than the daemon has fds: the kernel queues what it cannot accept */
	for (int i = 0; i < 2 * LOW_NOFILE; i++)
		socks[i] = raw_connect();
	for (int i = 0; i < 100 && !log_has(D.log, "the most the fd limit allows"); i++)
		usleep(scaled_ms(20) * 1000);
	/* it stops at its fd budget, before the fd limit itself */
	ck_assert_msg(log_has(D.log, "the most the fd limit allows (RLIMIT_NOFILE less ") &&
			      log_has(D.log, "fds of dlpackd's own and 16 in reserve); serving the "
					     "open connections"),
		      "the daemon never paused accepting");
	ck_assert(!log_has(D.log, "cannot accept a connection"));
	/* existing clients are served all along, and a publish, whose fd arrives in the reserve,
	 * is refused with a reason rather than cut off */
	ck_assert_dlpc(dlpc_attach(c, "kept", NULL, &t), 1);
	t->deleter(t);
	ck_assert_dlpc(publish(c, "one-more", 0), -EDQUOT);
	ck_assert_msg(error_says("its fd limit leaves room for"), "%s", dlpc_last_error());
	/* and waiting for fds costs next to nothing: a resource check, not a speed test */
	before = cpu_ticks(D.pid);
	sleep(1);
	spent = cpu_ticks(D.pid) - before;
	ck_assert_msg(spent * 4 < sysconf(_SC_CLK_TCK),
		      "dlpackd used %ld ticks in 1 s while out of fds", spent);
	/* when clients leave, accepting resumes and the queued ones are taken (and found closed) */
	for (int i = 0; i < 2 * LOW_NOFILE; i++)
		close(socks[i]);
	ck_assert(wait_stat(c, conns_are, &one, 10000));
	late = connect_or_die(&D);
	ck_assert(log_has(D.log, "accepting connections again"));
	ck_assert_dlpc(dlpc_attach(late, "kept", NULL, &t), 1);
	t->deleter(t);
	dlpc_close(late);
	dlpc_close(c);
}
END_TEST

START_TEST(test_publish_refused_before_fds_run_out)
{
	dlpc_client *c, *late;
	dlpc_stats s;
	char name[32];
	int n = 0, r;

	start(whole_budget, LOW_NOFILE);
	c = connect_or_die(&D);
	for (;;) {
		snprintf(name, sizeof(name), "fd/%d", n);
		r = publish(c, name, 0);
		if (r != 1)
			break;
		ck_assert_int_lt(++n, LOW_NOFILE);
	}
	ck_assert_dlpc(r, -EDQUOT);
	ck_assert_msg(error_says("its fd limit leaves room for") && error_says("RLIMIT_NOFILE"),
		      "%s", dlpc_last_error());
	/* refused with fds to spare: the daemon still accepts and serves new clients */
	s = stat_or_die(c);
	ck_assert_int_gt(n, 0);
	ck_assert_uint_eq(s.storages, (uint64_t)n);
	ck_assert_uint_lt(s.fds_open, LOW_NOFILE);
	late = connect_or_die(&D);
	ck_assert_uint_eq(stat_or_die(late).connections, 2);
	dlpc_close(late);
	/* an unpublished storage makes room once its fd is closed */
	ck_assert_dlpc(dlpc_unpublish(c, "fd/0"), 0);
	settled_fds(&D, c, 1);
	ck_assert_dlpc(publish(c, "fd/again", 0), 1);
	ck_assert(!log_has(D.log, "cannot accept a connection"));
	dlpc_close(c);
}
END_TEST

/* The daemon's fd limit in the fd-share test: a uid's share of it is a few dozen fds. */
#define SHARE_NOFILE 256

/* The share an EDQUOT message for --max-fd-share-per-uid names ("..., 53 (--max-fd-..."). */
static long share_named(void)
{
	const char *e = dlpc_last_error(), *at = strstr(e, " (--max-fd-share-per-uid)");

	while (at && at > e && at[-1] >= '0' && at[-1] <= '9')
		at--;
	return at ? strtol(at, NULL, 10) : -1;
}

/* Publish entries that outlive @p c until the share refuses one; how many were published. */
static long fill_share(dlpc_client *c, const char *prefix)
{
	char name[32];
	long n = 0;
	int r;

	for (;;) {
		snprintf(name, sizeof(name), "%s/%ld", prefix, n);
		r = publish(c, name, 0);
		if (r != 1)
			break;
		if (++n > SHARE_NOFILE)
			return -1;
	}
	return r == -EDQUOT && error_says("--max-fd-share-per-uid") ? n : -1;
}

static int nobody_fills_its_share(void *arg)
{
	dlpc_client *c;
	long n;

	(void)arg;
	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	n = fill_share(c, "hog");
	CHILD_CHECK(n > 0 && error_says("uid 65534 holds"));
	/* its connection is one of its fds; the share is DLPC_UID_FD_SHARE_DEFAULT percent */
	CHILD_CHECK(n + 1 == share_named());
	CHILD_CHECK(share_named() == (long)default_fd_share(c));
	dlpc_close(c);
	return 0;
}

/* A uid that publishes all it can, with entries that outlive it, leaves the fds other uids
 * need: each uid holds at most its share of the budget. */
START_TEST(test_fd_share_per_uid)
{
	dlpc_client *c, *x = NULL;
	char name[32];
	int baseline;
	long n;

	start(NULL, SHARE_NOFILE);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	baseline = settled_fds(&D, c, 1);
	ck_assert_int_eq(wait_child(spawn(nobody_fills_its_share, NULL)), 0);
	n = fill_share(c, "root");
	ck_assert_msg(n > 0 && error_says("uid 0 holds"), "%s", dlpc_last_error());
	ck_assert_int_eq(n + 1, share_named());
	/* both got their share: the first took nothing from the second */
	ck_assert_uint_eq(stat_or_die(c).entries, 2 * (uint64_t)n);
	/* a connection is one of its fds too: one more is refused at HELLO */
	ck_assert_dlpc(dlpc_connect(D.sock, &x), -EDQUOT);
	ck_assert_msg(error_says("--max-fd-share-per-uid"), "%s", dlpc_last_error());
	ck_assert_ptr_null(x);
	/* connections that never send HELLO are not a way around it: past the share plus
	 * DLPC_UID_CONNECTIONS_SLACK they are closed as soon as they are accepted */
	settled_fds(&D, c, 1);
	{
		int socks[DLPC_UID_CONNECTIONS_SLACK + 16];
		uint64_t most = 1 + DLPC_UID_CONNECTIONS_SLACK, conns;

		for (size_t i = 0; i < sizeof(socks) / sizeof(socks[0]); i++)
			socks[i] = raw_connect();
		for (int i = 0; i < 100 && !log_has(D.log, "(--max-fd-share-per-uid), by more");
		     i++)
			usleep(scaled_ms(20) * 1000);
		ck_assert(log_has(D.log, "(--max-fd-share-per-uid), by more than 8"));
		/* a refused connection is destroyed once its loop turn is over (and its ERROR
		 * has left): soon, not necessarily before this STAT is answered */
		ck_assert(wait_stat(c, uid_conns_at_most, &most, 5000));
		conns = stat_or_die(c).uid_connections;
		ck_assert_msg(conns <= most, "uid 0 holds %llu connections",
			      (unsigned long long)conns);
		for (size_t i = 0; i < sizeof(socks) / sizeof(socks[0]); i++)
			close(socks[i]);
	}
	/* root may remove anyone's entries: then the daemon is back where it started */
	for (long i = 0; i < n; i++) {
		snprintf(name, sizeof(name), "hog/%ld", i);
		ck_assert_dlpc(dlpc_unpublish(c, name), 0);
		snprintf(name, sizeof(name), "root/%ld", i);
		ck_assert_dlpc(dlpc_unpublish(c, name), 0);
	}
	ck_assert_int_eq(settled_fds(&D, c, 1), baseline);
	ck_assert_uint_eq(stat_or_die(c).uid_entries, 0);
	dlpc_close(c);
}
END_TEST

/* The fds test_fds_it_was_started_with_are_its_own's daemon is started with, besides stdio. */
#define INHERITED_FDS 48

/*
 * A daemon started with fds it does not know (a parent's, not marked close-on-exec) counts them
 * as its own, out of the fd budget: storages and connections filling that budget leave it
 * DLPC_FD_RESERVE fds free, so the publish past it is refused for the budget, naming it, and
 * clients still connect and are answered. (Before, the budget was the limit less a fixed
 * reserve, which the daemon's own fds and these took more than all of.)
 */
START_TEST(test_fds_it_was_started_with_are_its_own)
{
	const char *args[] = {"--max-fd-share-per-uid", "100", NULL};
	struct daemon_opts o = {.args = args, .nofile = SHARE_NOFILE, .inherit = INHERITED_FDS};
	dlpc_client *c, *x;
	char name[32];
	dlpc_stats st;
	long n = 0;
	int r;

	daemon_start_with(&D, &o);
	started = true;
	c = connect_or_die(&D);
	st = stat_or_die(c);
	fprintf(stderr, "dlpackd started with %d fds: %llu of its own, a budget of %llu\n",
		3 + INHERITED_FDS, (unsigned long long)st.fds_own,
		(unsigned long long)st.fd_budget);
	ck_assert_uint_ge(st.fds_own, 3 + INHERITED_FDS);
	ck_assert_uint_le(st.fd_budget + st.fds_own + DLPC_FD_RESERVE, SHARE_NOFILE);
	do {
		snprintf(name, sizeof(name), "fill/%ld", n);
		r = publish(c, name, 0);
	} while (r == 1 && ++n <= SHARE_NOFILE);
	ck_assert_msg(r == -EDQUOT && error_says("fds of its own"), "publish %ld: %d %s", n, r,
		      dlpc_last_error());
	/* the budget is what was refused: its connection, the storages and what is being closed
	 * (a closer's two sockets, the refused publish's fd) fill it */
	st = stat_or_die(c);
	ck_assert_uint_le(n + 1, st.fd_budget);
	ck_assert_uint_ge(n + 1 + st.fds_closing, st.fd_budget);
	/* the refused publish's fd came into the reserve; half of it is left for the daemon */
	ck_assert_int_le(fd_count(D.pid), SHARE_NOFILE - DLPC_FD_RESERVE / 2);
	/* connections may go into half the reserve: one more gets in, is answered, and is
	 * refused a publish for the budget too */
	x = connect_or_die(&D);
	ck_assert_uint_eq(stat_or_die(x).entries, (uint64_t)n);
	ck_assert_dlpc(publish(x, "fill/more", 0), -EDQUOT);
	ck_assert_msg(error_says("RLIMIT_NOFILE"), "%s", dlpc_last_error());
	dlpc_close(x);
	for (long i = 0; i < n; i++) {
		snprintf(name, sizeof(name), "fill/%ld", i);
		ck_assert_dlpc(dlpc_unpublish(c, name), 0);
	}
	ck_assert_dlpc(publish(c, "after", 0), 1);
	dlpc_close(c);
}
END_TEST

/* ---- shared memory that cannot be had ---- */

static int alloc_too_much(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	DLDataType u8 = {kDLUInt, 8, 1};
	DLDevice cpu = {kDLCPU, 0};
	int64_t n = *(int64_t *)arg;
	int fds = fd_count(getpid());

	CHILD_CHECK(dlpc_alloc(NULL, cpu, u8, 1, &n, &t) == -ENOSPC);
	CHILD_CHECK(t == NULL);
	CHILD_CHECK(error_says("cannot reserve") && error_says("memory and swap"));
	CHILD_CHECK(fd_count(getpid()) == fds);
	return 0;
}

START_TEST(test_alloc_beyond_memory_is_enospc)
{
	struct sysinfo si;
	int64_t n;

	ck_assert_int_eq(sysinfo(&si), 0);
	n = (int64_t)(((uint64_t)si.totalram + si.totalswap) * si.mem_unit) * 2;
	/* in a child: should the check be missing, the OOM killer picks that one */
	ck_assert_int_eq(wait_child(spawn(alloc_too_much, &n)), 0);
}
END_TEST

/* The memory cgroup the child of test_alloc_beyond_cgroup_is_enospc runs in, and its limit. */
#define CG_LIMIT (96ull << 20)

static bool write_file(const char *dir, const char *file, const char *text)
{
	char path[512];
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

/* Make a child memory cgroup of ours in @p dir, limited to CG_LIMIT. false and why, if not. */
static bool cgroup_make(char *dir, size_t len, char *why, size_t whylen)
{
	char line[1024], limit[32], parent[600] = "";
	bool v2 = false;
	FILE *f = fopen("/proc/self/cgroup", "re");

	while (f && fgets(line, sizeof(line), f)) {
		char *ctl = strchr(line, ':'), *path = ctl ? strchr(ctl + 1, ':') : NULL;

		if (!path)
			continue;
		*path++ = 0;
		path[strcspn(path, "\n")] = 0;
		if (strstr(ctl + 1, "memory") && !strstr(ctl + 1, "name=")) {
			snprintf(parent, sizeof(parent), "/sys/fs/cgroup/memory%s", path);
			v2 = false;
			break;
		}
		if (strcmp(line, "0") == 0 && !ctl[1]) {
			snprintf(parent, sizeof(parent), "/sys/fs/cgroup%s", path);
			v2 = true;
		}
	}
	if (f)
		fclose(f);
	if (!parent[0]) {
		snprintf(why, whylen, "no memory cgroup in /proc/self/cgroup");
		return false;
	}
	if (v2 && !write_file(parent, "cgroup.subtree_control", "+memory")) {
		snprintf(why, whylen, "cannot enable the memory controller below %s: %s", parent,
			 strerror(errno));
		return false;
	}
	snprintf(dir, len, "%s/dlpc-test-%d", parent, (int)getpid());
	if (mkdir(dir, 0755) < 0) {
		snprintf(why, whylen, "cannot create cgroup %s: %s", dir, strerror(errno));
		return false;
	}
	snprintf(limit, sizeof(limit), "%llu", CG_LIMIT);
	if (!write_file(dir, v2 ? "memory.max" : "memory.limit_in_bytes", limit)) {
		snprintf(why, whylen, "cannot limit cgroup %s: %s", dir, strerror(errno));
		rmdir(dir);
		return false;
	}
	return true;
}

/* The bytes cgroup @p dir charges now (memory.current, or v1's memory.usage_in_bytes); 0 if
 * neither can be read. */
static unsigned long long cg_usage(const char *dir)
{
	static const char *const files[] = {"memory.current", "memory.usage_in_bytes"};
	unsigned long long v = 0;

	for (size_t i = 0; i < 2 && v == 0; i++) {
		char path[900];
		FILE *f;

		snprintf(path, sizeof(path), "%s/%s", dir, files[i]);
		f = fopen(path, "re");
		if (f && fscanf(f, "%llu", &v) != 1)
			v = 0;
		if (f)
			fclose(f);
	}
	return v;
}

static int alloc_in_cgroup(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	DLDataType u8 = {kDLUInt, 8, 1};
	DLDevice cpu = {kDLCPU, 0};
	int64_t n = (int64_t)(CG_LIMIT + (32 << 20));
	char pid[16];

	snprintf(pid, sizeof(pid), "%d", (int)getpid());
	CHILD_CHECK(write_file(arg, "cgroup.procs", pid));
	/* what would leave less than DLPC__ROOM_RESERVE of the cgroup's room is refused too */
	n = (int64_t)(CG_LIMIT - cg_usage(arg) - DLPC__ROOM_RESERVE / 2);
	CHILD_CHECK(cg_usage(arg) > 0);
	CHILD_CHECK(dlpc_alloc(NULL, cpu, u8, 1, &n, &t) == -ENOSPC);
	CHILD_CHECK(error_says("left to the process"));
	/* more than the cgroup may hold: refused, not left to the cgroup's OOM killer */
	CHILD_CHECK(dlpc_alloc(NULL, cpu, u8, 1, &n, &t) == -ENOSPC);
	CHILD_CHECK(error_says("memory cgroup has") && error_says("bytes left"));
	/* what it can hold is allocated */
	n = (int64_t)(CG_LIMIT / 2);
	CHILD_CHECK(dlpc_alloc(NULL, cpu, u8, 1, &n, &t) == 0);
	t->deleter(t);
	return 0;
}

START_TEST(test_alloc_beyond_cgroup_is_enospc)
{
	char dir[700], why[800];
	struct sysinfo si;
	int st;

	ck_assert_int_eq(sysinfo(&si), 0);
	if (si.totalswap > 0) {
		/* pages can then go to swap: the library leaves the cgroup to the kernel */
		fprintf(stderr,
			"test_alloc_beyond_cgroup_is_enospc: skipped: this machine has swap\n");
		return;
	}
	if (!cgroup_make(dir, sizeof(dir), why, sizeof(why))) {
		fprintf(stderr, "test_alloc_beyond_cgroup_is_enospc: skipped: %s\n", why);
		return;
	}
	/* should the check be missing, the cgroup's OOM killer kills the child, and only it */
	st = wait_child(spawn(alloc_in_cgroup, dir));
	ck_assert_int_eq(rmdir(dir), 0);
	ck_assert_msg(st == 0, "the child in a %llu-byte memory cgroup exited with %d", CG_LIMIT,
		      st);
}
END_TEST

static int over_fsize(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	DLDataType u8 = {kDLUInt, 8, 1};
	DLDevice cpu = {kDLCPU, 0};
	int64_t n = 4 << 20;
	struct rlimit rl = {1 << 20, 1 << 20};
	static uint8_t big[4 << 20];
	dlpc_client *c;

	(void)arg;
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	/* SIGXFSZ keeps its default action (terminate): the library must not trigger it */
	CHILD_CHECK(setrlimit(RLIMIT_FSIZE, &rl) == 0);
	CHILD_CHECK(dlpc_alloc(c, cpu, u8, 1, &n, &t) == -EFBIG);
	CHILD_CHECK(error_says("RLIMIT_FSIZE") && error_says("4194304 bytes"));
	CHILD_CHECK(dlpc_publish(c, "big", host_tensor(big, u8, 1, &n, NULL, NULL), 0) == -EFBIG);
	CHILD_CHECK(error_says("'big'") && error_says("RLIMIT_FSIZE"));
	n = 1 << 10;
	CHILD_CHECK(dlpc_publish(c, "small", host_tensor(big, u8, 1, &n, NULL, NULL), 0) == 1);
	dlpc_close(c);
	return 0;
}

START_TEST(test_file_size_limit_is_efbig)
{
	start(NULL, 0);
	ck_assert_int_eq(wait_child(spawn(over_fsize, NULL)), 0);
}
END_TEST

/* dlpackd with @p flag @p value exits 2 at once, saying why. */
/* dlpackd exits 2 naming @p flag and @p value, given as "--flag value", or as the environment
 * variable @p flag when it does not start with "--". */
static void flag_refused(const char *flag, const char *value)
{
	int out[2], st;
	char buf[512] = "";
	pid_t pid;

	ck_assert_int_eq(pipe2(out, O_CLOEXEC), 0);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		dup2(out[1], STDERR_FILENO);
		if (strncmp(flag, "--", 2) != 0) {
			setenv(flag, value, 1);
			execl(DLPACKD_BIN, DLPACKD_BIN, "--socket", "/nonexistent/dlpackd.sock",
			      (char *)NULL);
		}
		execl(DLPACKD_BIN, DLPACKD_BIN, "--socket", "/nonexistent/dlpackd.sock", flag,
		      value, (char *)NULL);
		_exit(127);
	}
	close(out[1]);
	ck_assert_int_gt(read(out[0], buf, sizeof(buf) - 1), 0);
	close(out[0]);
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "%s %s: status %d", flag, value, st);
	ck_assert_msg(strstr(buf, flag + (flag[0] == '-' ? 2 : 0)) && strstr(buf, value), "%s",
		      buf);
}

START_TEST(test_limit_flags_checked)
{
	flag_refused("--max-bytes-per-uid", "5X");
	flag_refused("--max-bytes-per-uid", "1KB");
	flag_refused("--max-bytes-per-uid", "17179869184T"); /* 2^64 */
	flag_refused("--max-entries-per-uid", "0");
	flag_refused("--max-connections-per-uid", "-1");
	flag_refused("--max-channels-per-uid", "0");
	flag_refused("--max-refs-per-connection", "1K"); /* suffixes are for sizes */
	flag_refused("--max-pending-per-connection", "");
	flag_refused("--frame-timeout-ms", "ten");
	/* and each through its environment variable */
	flag_refused("DLPACKD_MAX_BYTES_PER_UID", "1KB");
	flag_refused("DLPACKD_MAX_ENTRIES_PER_UID", "0");
	flag_refused("DLPACKD_MAX_CONNECTIONS_PER_UID", "-1");
	flag_refused("DLPACKD_MAX_REFS_PER_CONNECTION", "1K");
	flag_refused("DLPACKD_MAX_PENDING_PER_CONNECTION", "x");
	flag_refused("DLPACKD_FRAME_TIMEOUT_MS", "ten");
	flag_refused("--max-queue-bytes", "8M"); /* below one largest frame and its header */
	flag_refused("--max-queue-fds", "0");
	flag_refused("DLPACKD_MAX_WATCH_QUEUE_BYTES", "lots");
	/* below a connection and the receive buffer of its HELLO: no connection of any uid could
	 * ever say HELLO */
	flag_refused("--max-memory-per-uid", "16K");
	flag_refused("DLPACKD_MAX_MEMORY_PER_UID", "17663");
}
END_TEST

/* At the smallest --max-memory-per-uid the daemon takes, a uid can still connect. */
START_TEST(test_memory_per_uid_at_its_minimum)
{
	static const char *const args[] = {"--max-memory-per-uid", "17664", NULL};
	dlpc_client *c;

	start(args, 0);
	c = connect_or_die(&D);
	ck_assert_uint_eq(stat_or_die(c).uid_connections, 1);
	dlpc_close(c);
}
END_TEST

static Suite *limits_suite(void)
{
	Suite *s = suite_create("limits");
	TCase *own = tcase_create("ownership"), *quota = tcase_create("quota");
	TCase *conn = tcase_create("connection"), *fds = tcase_create("fds");
	TCase *mem = tcase_create("memory");
	TCase *all[] = {own, quota, conn, fds, mem};

	for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
		tcase_add_checked_fixture(all[i], NULL, teardown);
		tcase_set_timeout(all[i], scaled_ms(60000) / 1000);
		suite_add_tcase(s, all[i]);
	}
	tcase_add_test(own, test_ownership_across_uids);
	tcase_add_test(own, test_credentials_from_kernel_only);
	tcase_add_test(own, test_socket_permissions_decide_who_connects);
	tcase_add_test(own, test_read_only_stays_read_only);
	tcase_add_test(own, test_owner_filter);
	tcase_add_test(own, test_channels_across_uids);
	tcase_add_test(quota, test_limit_flags_checked);
	tcase_add_test(quota, test_quota_entries_per_uid);
	tcase_add_test(quota, test_memory_per_uid);
	tcase_add_test(quota, test_memory_per_uid_at_its_minimum);
	tcase_add_test(quota, test_quota_bytes_count_declared_size);
	tcase_add_test(quota, test_quota_bytes_held_until_freed);
	tcase_add_test(quota, test_quota_connections_per_uid);
	tcase_add_test(quota, test_refused_at_accept_says_why);
	tcase_add_test(quota, test_pinned_storage_charged_to_holder);
	tcase_add_test(quota, test_replace_of_a_held_entry_counts_what_it_pins);
	tcase_add_test(conn, test_refs_per_connection);
	tcase_add_test(conn, test_pending_per_connection);
	tcase_add_test(conn, test_frame_deadline);
	tcase_add_test(fds, test_accept_pauses_when_fds_run_out);
	tcase_add_test(fds, test_publish_refused_before_fds_run_out);
	tcase_add_test(fds, test_fd_share_per_uid);
	tcase_add_test(fds, test_fds_it_was_started_with_are_its_own);
	tcase_add_test(mem, test_alloc_beyond_memory_is_enospc);
	tcase_add_test(mem, test_alloc_beyond_cgroup_is_enospc);
	tcase_add_test(mem, test_file_size_limit_is_efbig);
	return s;
}

int main(void)
{
	return run_suite(limits_suite());
}
