/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Bad clients and daemon lifecycle: raw frames that bypass libdlpc, storage fds that are not what
 * they claim, and starting, replacing and stopping the daemon.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>

#include "harness.h"
#include "io.h"
#include "msg.h"

static struct daemon D;

static void setup(void)
{
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

/* ---- a raw client: the wire layer without libdlpc ---- */

static int raw_connect(void)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", D.sock);
	ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	return fd;
}

static void raw_send(int fd, uint16_t type, uint32_t id, const ProtobufCMessage *m, const int *fds,
		     unsigned nfds)
{
	struct dlpc__scratch s = {0};
	ssize_t len = dlpc__msg_frame(&s, type, id, m, nfds);

	ck_assert_int_gt(len, 0);
	ck_assert_int_eq(dlpc__send_all(fd, s.p, (size_t)len, fds, nfds), 0);
	dlpc__scratch_clear(&s);
}

/* Read the next frame: 1 and the payload copied into @p buf, or 0 when the daemon hung up. */
static int raw_recv(int fd, struct dlpc__hdr *h, uint8_t *buf, size_t cap)
{
	static struct dlpc__rx rx;
	static int rx_fd = -1;
	struct dlpc__frame f;
	char why[160];

	if (rx_fd != fd) {
		dlpc__rx_clear(&rx);
		rx_fd = fd;
	}
	for (;;) {
		int r = dlpc__rx_next(&rx, &f, why, sizeof(why));
		ssize_t n;

		ck_assert_int_ge(r, 0);
		if (r == 1) {
			*h = f.hdr;
			ck_assert_uint_le(f.hdr.len, cap);
			memcpy(buf, f.payload, f.hdr.len);
			dlpc__frame_clear(&f);
			return 1;
		}
		n = dlpc__rx_read(&rx, fd, why, sizeof(why));
		if (n == 0 || n == -ECONNRESET) {
			dlpc__rx_clear(&rx);
			rx_fd = -1;
			return 0;
		}
		ck_assert_int_gt(n, 0);
	}
}

static void raw_hello(int fd, uint32_t major)
{
	Dlpackd__V1__Hello hello = DLPACKD__V1__HELLO__INIT;
	struct dlpc__hdr h;
	uint8_t buf[512];

	hello.version_major = major;
	hello.client = "test_hostile";
	raw_send(fd, DLPC_MSG_HELLO, 1, &hello.base, NULL, 0);
	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	ck_assert_uint_eq(h.type, DLPC_MSG_HELLO | DLPC_MSG_REPLY);
}

/* Expect an ERROR reply; returns its code and copies its message. */
static int raw_error(int fd, char *msg, size_t len)
{
	struct dlpc__hdr h;
	uint8_t buf[4096];
	Dlpackd__V1__Error *e;
	int code;

	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	ck_assert_uint_eq(h.type, DLPC_MSG_ERROR);
	e = dlpackd__v1__error__unpack(NULL, h.len, buf);
	ck_assert_ptr_nonnull(e);
	code = e->code;
	snprintf(msg, len, "%s", e->message);
	dlpackd__v1__error__free_unpacked(e, NULL);
	return code;
}

/* The daemon hangs up on @p fd (possibly after an ERROR reply). */
static void expect_dropped(int fd)
{
	struct dlpc__hdr h;
	uint8_t buf[4096];
	int frames = 0;

	while (raw_recv(fd, &h, buf, sizeof(buf)) == 1) {
		ck_assert_uint_eq(h.type, DLPC_MSG_ERROR);
		ck_assert_int_lt(++frames, 2);
	}
	close(fd);
}

/* ---- 11. garbage, oversized, fd mismatch: offender dropped, others unaffected ---- */

static dlpc_client *good;
static DLManagedTensorVersioned *held;

/* A well-behaved client holding a reference across the abuse. */
static void good_client_start(void)
{
	uint8_t buf[256];
	int64_t shape[1] = {256};

	for (int i = 0; i < 256; i++)
		buf[i] = (uint8_t)i;
	good = connect_or_die(&D);
	ck_assert_dlpc(
		dlpc_publish(good, "good",
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     0),
		1);
	ck_assert_dlpc(dlpc_attach(good, "good", NULL, &held), 1);
}

static void good_client_check(void)
{
	DLManagedTensorVersioned *t;
	dlpc_stats s = stat_or_die(good);

	ck_assert_dlpc(dlpc_attach(good, "good", NULL, &t), 1);
	for (int i = 0; i < 256; i++)
		ck_assert_int_eq(((uint8_t *)held->dl_tensor.data)[i], i);
	t->deleter(t);
	ck_assert_uint_eq(s.connections, 1);
}

static bool refs_one(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->references == 1 && s->connections == 1;
}

/* Wait until the daemon has closed everything the offenders left, then compare fd counts. */
static void expect_fds(int baseline)
{
	ck_assert(wait_stat(good, refs_one, NULL, 1000));
	ck_assert_int_eq(settled_fds(&D, good, 1), baseline);
}

static void good_client_stop(void)
{
	held->deleter(held);
	dlpc_close(good);
}

static int memfd_sealed(size_t size, int seals)
{
	int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
	if (seals)
		ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, seals), 0);
	return fd;
}

START_TEST(test_garbage_frames)
{
	static const uint8_t garbage[] = "GET / HTTP/1.1\r\nHost: dlpackd\r\n\r\n";
	uint8_t hdr[DLPC_FRAME_HDR_SIZE];
	int baseline, fd;
	struct dlpc__hdr h = {0};

	good_client_start();
	baseline = settled_fds(&D, good, 1);

	/* text that is no frame at all: its "length" is absurd */
	fd = raw_connect();
	ck_assert_int_eq(write(fd, garbage, sizeof(garbage)), (ssize_t)sizeof(garbage));
	expect_dropped(fd);

	/* an oversized length, announced before any payload */
	fd = raw_connect();
	h = (struct dlpc__hdr){.len = DLPC_FRAME_MAX + 1, .type = DLPC_MSG_HELLO, .id = 1};
	dlpc__hdr_encode(hdr, &h);
	ck_assert_int_eq(write(fd, hdr, sizeof(hdr)), (ssize_t)sizeof(hdr));
	expect_dropped(fd);

	/* 2^32-1 */
	fd = raw_connect();
	h.len = UINT32_MAX;
	dlpc__hdr_encode(hdr, &h);
	ck_assert_int_eq(write(fd, hdr, sizeof(hdr)), (ssize_t)sizeof(hdr));
	expect_dropped(fd);

	/* a frame declaring one fd but carrying two, after HELLO */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	{
		int fds[2] = {memfd_sealed(4096, 0), memfd_sealed(4096, 0)};
		Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
		struct dlpc__scratch s = {0};
		ssize_t len = dlpc__msg_frame(&s, DLPC_MSG_STAT, 2, &st.base, 1);

		ck_assert_int_eq(dlpc__send_all(fd, s.p, (size_t)len, fds, 2), 0);
		close(fds[0]);
		close(fds[1]);
		dlpc__scratch_clear(&s);
	}
	expect_dropped(fd);

	/* a frame declaring an fd but carrying none */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	{
		Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
		struct dlpc__scratch s = {0};
		ssize_t len = dlpc__msg_frame(&s, DLPC_MSG_STAT, 2, &st.base, 1);

		ck_assert_int_eq(dlpc__send_all(fd, s.p, (size_t)len, NULL, 0), 0);
		dlpc__scratch_clear(&s);
	}
	expect_dropped(fd);

	/* a STAT frame that carries an fd it may not have (fd count checked by the table) */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	{
		Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
		int mfd = memfd_sealed(4096, 0);

		raw_send(fd, DLPC_MSG_STAT, 2, &st.base, &mfd, 1);
		close(mfd);
	}
	expect_dropped(fd);

	/* a frame cut short, then EOF */
	fd = raw_connect();
	h = (struct dlpc__hdr){.len = 100, .type = DLPC_MSG_HELLO, .id = 1};
	dlpc__hdr_encode(hdr, &h);
	ck_assert_int_eq(write(fd, hdr, sizeof(hdr)), (ssize_t)sizeof(hdr));
	ck_assert_int_eq(write(fd, "abc", 3), 3);
	close(fd);

	/* a payload that is not protobuf */
	fd = raw_connect();
	h = (struct dlpc__hdr){.len = 8, .type = DLPC_MSG_HELLO, .id = 1};
	dlpc__hdr_encode(hdr, &h);
	ck_assert_int_eq(write(fd, hdr, sizeof(hdr)), (ssize_t)sizeof(hdr));
	ck_assert_int_eq(write(fd, "\xff\xff\xff\xff\xff\xff\xff\xff", 8), 8);
	expect_dropped(fd);

	good_client_check();
	expect_fds(baseline);
	ck_assert_uint_ge(stat_or_die(good).protocol_errors, 7);
	good_client_stop();
}
END_TEST

START_TEST(test_session_rules)
{
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	Dlpackd__V1__Release rel = DLPACKD__V1__RELEASE__INIT;
	Dlpackd__V1__Hello hello = DLPACKD__V1__HELLO__INIT;
	uint64_t bogus = 12345;
	char msg[512];
	int baseline, fd;

	good_client_start();
	baseline = settled_fds(&D, good, 1);

	/* a request before HELLO */
	fd = raw_connect();
	raw_send(fd, DLPC_MSG_STAT, 1, &st.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "before HELLO"));
	expect_dropped(fd);

	/* a version mismatch names both versions */
	fd = raw_connect();
	hello.version_major = 99;
	hello.version_minor = 3;
	raw_send(fd, DLPC_MSG_HELLO, 1, &hello.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "client speaks 99.3"));
	ck_assert_ptr_nonnull(strstr(msg, "dlpackd speaks 1.2"));
	expect_dropped(fd);

	/* an unknown message type */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	raw_send(fd, 77, 2, &st.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "type 77"));
	expect_dropped(fd);

	/* HELLO twice */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	hello.version_major = DLPC_PROTO_MAJOR;
	raw_send(fd, DLPC_MSG_HELLO, 2, &hello.base, NULL, 0);
	expect_dropped(fd);

	/* releasing a reference it does not hold */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	rel.n_ref_ids = 1;
	rel.ref_ids = &bogus;
	raw_send(fd, DLPC_MSG_RELEASE, 0, &rel.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "does not hold"));
	expect_dropped(fd);

	/* an ATTACH larger than its type's limit, refused before it is unpacked */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	{
		Dlpackd__V1__Attach at = DLPACKD__V1__ATTACH__INIT;
		static uint8_t big[DLPC_SMALL_MSG_MAX];

		memset(big, 'x', sizeof(big));
		at.name.data = big;
		at.name.len = sizeof(big);
		raw_send(fd, DLPC_MSG_ATTACH, 3, &at.base, NULL, 0);
	}
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "exceeds its limit of 4096"));
	expect_dropped(fd);

	/* more references in one RELEASE than the limit */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	{
		uint64_t *ids = calloc(DLPC_RELEASE_BATCH_MAX + 1, sizeof(uint64_t));

		rel.n_ref_ids = DLPC_RELEASE_BATCH_MAX + 1;
		rel.ref_ids = ids;
		raw_send(fd, DLPC_MSG_RELEASE, 0, &rel.base, NULL, 0);
		free(ids);
	}
	expect_dropped(fd);

	good_client_check();
	expect_fds(baseline);
	good_client_stop();
}
END_TEST

/* ---- names and request limits: answered with an error, the connection stays ---- */

static int raw_publish(int fd, const char *name, size_t name_len, int storage, uint64_t size,
		       uint32_t flags, size_t ntensors, size_t ndim, char *msg, size_t len)
{
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc *descs = calloc(ntensors, sizeof(*descs));
	Dlpackd__V1__TensorDesc **ptrs = calloc(ntensors, sizeof(*ptrs));
	int64_t *shape = calloc(ndim ? ndim : 1, sizeof(int64_t));
	char(*keys)[24] = calloc(ntensors, 24);
	struct dlpc__hdr h;
	uint8_t buf[4096];
	int code = 0;

	for (size_t i = 0; i < ndim; i++)
		shape[i] = 1;
	for (size_t i = 0; i < ntensors; i++) {
		dlpackd__v1__tensor_desc__init(&descs[i]);
		snprintf(keys[i], 24, "k%zu", i);
		descs[i].key.data = (uint8_t *)keys[i];
		descs[i].key.len = ntensors > 1 ? strlen(keys[i]) : 0;
		descs[i].dtype_code = kDLFloat;
		descs[i].dtype_bits = 32;
		descs[i].dtype_lanes = 1;
		descs[i].n_shape = ndim;
		descs[i].shape = shape;
		ptrs[i] = &descs[i];
	}
	req.name.data = (uint8_t *)name;
	req.name.len = name_len;
	req.flags = flags;
	req.device_type = kDLCPU;
	req.storage_size = size;
	req.n_tensors = ntensors;
	req.tensors = ptrs;
	raw_send(fd, DLPC_MSG_PUBLISH, 9, &req.base, &storage, 1);
	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	if (h.type == DLPC_MSG_ERROR) {
		Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, h.len, buf);

		code = e->code;
		snprintf(msg, len, "%s", e->message);
		dlpackd__v1__error__free_unpacked(e, NULL);
	} else {
		ck_assert_uint_eq(h.type, DLPC_MSG_PUBLISH | DLPC_MSG_REPLY);
		snprintf(msg, len, "published");
	}
	free(keys);
	free(shape);
	free(ptrs);
	free(descs);
	return code;
}

START_TEST(test_name_and_request_limits)
{
	char name[DLPC_NAME_MAX + 2], msg[512];
	int fd, storage, baseline;

	good_client_start();
	baseline = settled_fds(&D, good, 1);
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	storage = memfd_sealed(1 << 20,
			       F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);

	memset(name, 'a', sizeof(name));
	ck_assert_int_eq(
		raw_publish(fd, name, DLPC_NAME_MAX, storage, 4, 0, 1, 1, msg, sizeof(msg)), 0);
	ck_assert_int_eq(
		raw_publish(fd, name, DLPC_NAME_MAX + 1, storage, 4, 0, 1, 1, msg, sizeof(msg)),
		EINVAL);
	ck_assert_ptr_nonnull(strstr(msg, "more than the limit of 255"));
	ck_assert_int_eq(raw_publish(fd, "", 0, storage, 4, 0, 1, 1, msg, sizeof(msg)), EINVAL);
	ck_assert_int_eq(raw_publish(fd, "a\0b", 3, storage, 4, 0, 1, 1, msg, sizeof(msg)), EINVAL);
	ck_assert_int_eq(raw_publish(fd, "\xc0\xaf", 2, storage, 4, 0, 1, 1, msg, sizeof(msg)),
			 EINVAL);
	ck_assert_ptr_nonnull(strstr(msg, "UTF-8"));
	/* ndim limit */
	ck_assert_int_eq(
		raw_publish(fd, "nd", 2, storage, 4, 0, 1, DLPC_NDIM_MAX, msg, sizeof(msg)), 0);
	ck_assert_int_eq(
		raw_publish(fd, "nd2", 3, storage, 4, 0, 1, DLPC_NDIM_MAX + 1, msg, sizeof(msg)),
		EINVAL);
	/* bundle size limit (tensors of 4 bytes at 256-byte steps would not fit: all at 0) */
	ck_assert_int_eq(raw_publish(fd, "b0", 2, storage, 4, 0, 0, 1, msg, sizeof(msg)), EINVAL);
	ck_assert_int_eq(
		raw_publish(fd, "b1", 2, storage, 4, 0, DLPC_BUNDLE_MAX + 1, 1, msg, sizeof(msg)),
		EINVAL);
	ck_assert_ptr_nonnull(strstr(msg, "16384"));
	/* descriptors beyond the declared storage size, unknown flags */
	ck_assert_int_eq(raw_publish(fd, "big", 3, storage, 2, 0, 1, 1, msg, sizeof(msg)), EINVAL);
	ck_assert_int_eq(raw_publish(fd, "fl", 2, storage, 4, 1u << 9, 1, 1, msg, sizeof(msg)),
			 EINVAL);
	/* all answered with errors: the connection is still good */
	ck_assert_int_eq(raw_publish(fd, "ok", 2, storage, 4, 0, 1, 1, msg, sizeof(msg)), 0);
	close(storage);
	close(fd);
	good_client_check();
	/* three entries stayed, each holding the one storage fd: +1 fd per storage */
	ck_assert_uint_eq(stat_or_die(good).entries, 4);
	expect_fds(baseline + 3);
	good_client_stop();
}
END_TEST

/* ---- 12. storage fds that are not sealed memfds ---- */

START_TEST(test_storage_fd_matrix)
{
	char msg[512], seen[7][512], path[160];
	int fd, baseline, storage, pipefd[2], code[7];

	good_client_start();
	baseline = settled_fds(&D, good, 1);
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);

	storage = memfd_sealed(4096, 0); /* unsealed */
	code[0] = raw_publish(fd, "s0", 2, storage, 4, 0, 1, 1, seen[0], sizeof(seen[0]));
	close(storage);
	storage = memfd_sealed(4096, F_SEAL_SHRINK | F_SEAL_GROW); /* no write seal, read-only */
	code[1] = raw_publish(fd, "s1", 2, storage, 4, 0, 1, 1, seen[1], sizeof(seen[1]));
	/* the same memfd, its seals made final, is fine for a writable entry */
	ck_assert_int_eq(fcntl(storage, F_ADD_SEALS, F_SEAL_SEAL), 0);
	ck_assert_int_eq(raw_publish(fd, "s1w", 3, storage, 4, DLPC_PUBLISH_WRITABLE, 1, 1, msg,
				     sizeof(msg)),
			 0);
	close(storage);
	/* /tmp may be tmpfs: use the build tree's filesystem for a file on disk */
	snprintf(path, sizeof(path), "%s/dlpc-on-disk-%d", DLPC_TEST_DISK_DIR, (int)getpid());
	storage = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	ck_assert_int_ge(storage, 0);
	ck_assert_int_eq(ftruncate(storage, 4096), 0);
	unlink(path);
	code[2] = raw_publish(fd, "s2", 2, storage, 4, 0, 1, 1, seen[2], sizeof(seen[2]));
	close(storage);
	ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
	code[3] = raw_publish(fd, "s3", 2, pipefd[0], 4, 0, 1, 1, seen[3], sizeof(seen[3]));
	close(pipefd[0]);
	close(pipefd[1]);
	storage = memfd_sealed(16, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
	code[4] = raw_publish(fd, "s4", 2, storage, 4096, 0, 1, 1, seen[4], sizeof(seen[4]));
	close(storage);
	storage = open("/dev/null", O_RDWR | O_CLOEXEC);
	code[5] = raw_publish(fd, "s5", 2, storage, 4, 0, 1, 1, seen[5], sizeof(seen[5]));
	close(storage);
	storage = memfd_sealed(4096, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE);
	code[6] = raw_publish(fd, "s6", 2, storage, 4, 0, 1, 1, seen[6], sizeof(seen[6]));
	close(storage);

	ck_assert_int_eq(code[0], EPERM);
	ck_assert_ptr_nonnull(strstr(seen[0], "not sealed against resizing"));
	ck_assert_int_eq(code[1], EPERM);
	ck_assert_ptr_nonnull(strstr(seen[1], "F_SEAL_FUTURE_WRITE"));
	ck_assert_int_eq(code[2], EBADF);
	ck_assert_ptr_nonnull(strstr(seen[2], "cannot be sealed"));
	ck_assert_int_eq(code[3], EBADF);
	ck_assert_ptr_nonnull(strstr(seen[3], "a pipe"));
	ck_assert_int_eq(code[4], EINVAL);
	ck_assert_ptr_nonnull(strstr(seen[4], "holds 16 bytes"));
	ck_assert_int_eq(code[5], EBADF);
	ck_assert_ptr_nonnull(strstr(seen[5], "character device"));
	ck_assert_int_eq(code[6], EPERM);
	ck_assert_ptr_nonnull(strstr(seen[6], "not final"));
	/* every message is its own */
	for (int i = 0; i < 7; i++)
		for (int j = i + 1; j < 7; j++)
			ck_assert_str_ne(seen[i], seen[j]);
	close(fd);
	good_client_check();
	expect_fds(baseline + 1); /* s1w holds its storage */
	good_client_stop();
}
END_TEST

/* ---- 14. CUDA entries: what a PUBLISH of device memory must carry (protocol 1.2) ---- */

/* What raw_cuda_publish() sends: a CUDA tensor of 4 floats (at offset 100 for legacy IPC). */
struct cuda_pub {
	int32_t device_type;
	size_t uuid_len, mem_len, ev_len; /* mem_len 0: no cuda_ipc (VMM) */
	const int *fds;
	unsigned nfds;
	uint64_t token;
	uint32_t flags;
};

/* Send it as @p name; 0 and the reply's frame type, or the ERROR's code and message. */
static int raw_cuda_publish(int fd, const char *name, const struct cuda_pub *c, char *msg,
			    size_t len)
{
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__CudaIpc ipc = DLPACKD__V1__CUDA_IPC__INIT;
	Dlpackd__V1__TensorDesc desc = DLPACKD__V1__TENSOR_DESC__INIT, *dp = &desc;
	uint8_t bytes[DLPC_CUDA_IPC_HANDLE_SIZE + 1] = "cuda handle bytes", buf[4096];
	int64_t shape[1] = {4};
	struct dlpc__hdr h;
	int code = 0;

	desc.dtype_code = kDLFloat;
	desc.dtype_bits = 32;
	desc.dtype_lanes = 1;
	desc.n_shape = 1;
	desc.shape = shape;
	desc.offset = c->mem_len ? 100 : 0; /* IPC offsets need no alignment */
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.flags = c->flags;
	req.device_type = c->device_type;
	req.storage_size = 4096;
	req.n_tensors = 1;
	req.tensors = &dp;
	req.device_uuid.data = bytes;
	req.device_uuid.len = c->uuid_len;
	req.reclaim_token = c->token;
	if (c->mem_len) {
		ipc.mem_handle.data = bytes;
		ipc.mem_handle.len = c->mem_len;
		ipc.event_handle.data = bytes;
		ipc.event_handle.len = c->ev_len;
		req.cuda_ipc = &ipc;
	}
	raw_send(fd, DLPC_MSG_PUBLISH, 9, &req.base, c->fds, c->nfds);
	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	if (h.type == DLPC_MSG_ERROR) {
		Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, h.len, buf);

		code = e->code;
		snprintf(msg, len, "%s", e->message);
		dlpackd__v1__error__free_unpacked(e, NULL);
	} else {
		ck_assert_uint_eq(h.type, DLPC_MSG_PUBLISH | DLPC_MSG_REPLY);
	}
	return code;
}

START_TEST(test_cuda_publish_rules)
{
	const size_t H = DLPC_CUDA_IPC_HANDLE_SIZE, U = DLPC_CUDA_UUID_SIZE;
	Dlpackd__V1__Unpublish un = DLPACKD__V1__UNPUBLISH__INIT;
	dlpc_entry_info *list = NULL;
	char msg[512];
	int fd, baseline, pipefd[2], sv[2], mfd, n;
	struct dlpc__hdr h;
	uint8_t buf[4096];
	size_t count = 0;

	good_client_start();
	baseline = settled_fds(&D, good, 1);
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	/* sizes of the CUDA identifiers: one byte short of each is refused */
	ck_assert_int_eq(raw_cuda_publish(fd, "c1",
					  &(struct cuda_pub){.device_type = kDLCUDA,
							     .uuid_len = U - 1,
							     .mem_len = H,
							     .ev_len = H},
					  msg, sizeof(msg)),
			 EINVAL);
	ck_assert_ptr_nonnull(strstr(msg, "UUID of 15 bytes"));
	ck_assert_int_eq(raw_cuda_publish(fd, "c1",
					  &(struct cuda_pub){.device_type = kDLCUDA,
							     .uuid_len = U,
							     .mem_len = H - 1,
							     .ev_len = H},
					  msg, sizeof(msg)),
			 EINVAL);
	ck_assert_ptr_nonnull(strstr(msg, "CUDA IPC handles of 63 and 64 bytes"));
	ck_assert_int_eq(raw_cuda_publish(fd, "c1",
					  &(struct cuda_pub){.device_type = kDLCUDA,
							     .uuid_len = U,
							     .mem_len = H,
							     .ev_len = H + 1},
					  msg, sizeof(msg)),
			 EINVAL);
	/* another device, and CUDA fields on a host entry */
	ck_assert_int_eq(raw_cuda_publish(fd, "c1",
					  &(struct cuda_pub){.device_type = kDLROCM,
							     .uuid_len = U,
							     .mem_len = H,
							     .ev_len = H},
					  msg, sizeof(msg)),
			 ENOTSUP);
	mfd = memfd_sealed(4096, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
	ck_assert_int_eq(raw_cuda_publish(fd, "c1",
					  &(struct cuda_pub){.device_type = kDLCPU,
							     .uuid_len = U,
							     .mem_len = 0,
							     .ev_len = 0,
							     .fds = &mfd,
							     .nfds = 1},
					  msg, sizeof(msg)),
			 EINVAL);
	/* a VMM fd that no driver exports: a pipe, a socket */
	ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
	ck_assert_int_eq(raw_cuda_publish(fd, "c1",
					  &(struct cuda_pub){.device_type = kDLCUDA,
							     .uuid_len = U,
							     .fds = pipefd,
							     .nfds = 1},
					  msg, sizeof(msg)),
			 EBADF);
	ck_assert_ptr_nonnull(strstr(msg, "a pipe"));
	ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
	ck_assert_int_eq(raw_cuda_publish(fd, "c1",
					  &(struct cuda_pub){.device_type = kDLCUDA,
							     .uuid_len = U,
							     .fds = sv,
							     .nfds = 1},
					  msg, sizeof(msg)),
			 EBADF);
	ck_assert_ptr_nonnull(strstr(msg, "a socket"));
	/* a legacy IPC entry is ephemeral whatever its flags, its offsets need no alignment, and
	 * its publisher hears of it with its own token once the storage is freed */
	ck_assert_int_eq(raw_cuda_publish(fd, "c2",
					  &(struct cuda_pub){.device_type = kDLCUDA,
							     .uuid_len = U,
							     .mem_len = H,
							     .ev_len = H,
							     .token = 0xfeedbeef},
					  msg, sizeof(msg)),
			 0);
	ck_assert_dlpc(dlpc_list(good, "c2", &list, &count), 0);
	ck_assert_uint_eq(count, 1);
	ck_assert_uint_eq(list[0].flags, DLPC_PUBLISH_EPHEMERAL);
	ck_assert_int_eq(list[0].device.device_type, kDLCUDA);
	dlpc_list_free(list, count);
	un.name.data = (uint8_t *)"c2";
	un.name.len = 2;
	raw_send(fd, DLPC_MSG_UNPUBLISH, 10, &un.base, NULL, 0);
	for (n = 0; n < 2; n++) {
		ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
		if (h.type == DLPC_MSG_RECLAIM) {
			Dlpackd__V1__Reclaim *r = dlpackd__v1__reclaim__unpack(NULL, h.len, buf);

			ck_assert_ptr_nonnull(r);
			ck_assert_uint_eq(h.id, 0);
			ck_assert_uint_eq(r->n_tokens, 1);
			ck_assert_uint_eq(r->tokens[0], 0xfeedbeef);
			dlpackd__v1__reclaim__free_unpacked(r, NULL);
		} else {
			ck_assert_uint_eq(h.type, DLPC_MSG_UNPUBLISH | DLPC_MSG_REPLY);
		}
	}
	/* fd counts that contradict the message are violations: IPC with an fd... */
	ck_assert_int_eq(raw_cuda_publish(fd, "c3",
					  &(struct cuda_pub){.device_type = kDLCUDA,
							     .uuid_len = U,
							     .mem_len = H,
							     .ev_len = H,
							     .fds = &mfd,
							     .nfds = 1},
					  msg, sizeof(msg)),
			 EPROTO);
	expect_dropped(fd);
	/* ...and host or VMM storage without one */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	ck_assert_int_eq(raw_cuda_publish(fd, "c4",
					  &(struct cuda_pub){.device_type = kDLCUDA, .uuid_len = U},
					  msg, sizeof(msg)),
			 EPROTO);
	expect_dropped(fd);
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	ck_assert_int_eq(raw_cuda_publish(fd, "c5", &(struct cuda_pub){.device_type = kDLCPU}, msg,
					  sizeof(msg)),
			 EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "carries 0 fds, expected 1"));
	expect_dropped(fd);
	close(mfd);
	close(pipefd[0]);
	close(pipefd[1]);
	close(sv[0]);
	close(sv[1]);
	good_client_check();
	expect_fds(baseline);
	good_client_stop();
}
END_TEST

/* ---- 13. one daemon per socket; stale sockets; SIGTERM ---- */

/* ---- WATCH: its checks, and a watching connection may send nothing but RELEASE ---- */

START_TEST(test_watch_rules)
{
	Dlpackd__V1__Watch w = DLPACKD__V1__WATCH__INIT;
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	Dlpackd__V1__WatchReply *rep;
	uint8_t prefix[DLPC_NAME_MAX + 1], buf[512];
	struct dlpc__hdr h;
	char msg[512];
	int fd, storage, baseline;

	good_client_start();
	baseline = settled_fds(&D, good, 1);

	/* a prefix over the limit is refused; the connection stays */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	memset(prefix, 'p', sizeof(prefix));
	w.prefix.data = prefix;
	w.prefix.len = sizeof(prefix);
	raw_send(fd, DLPC_MSG_WATCH, 2, &w.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EINVAL);
	/* a connection owning an ephemeral entry cannot become a watcher */
	storage =
		memfd_sealed(256, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL);
	ck_assert_int_eq(raw_publish(fd, "eph", 3, storage, 4, DLPC_PUBLISH_EPHEMERAL, 1, 1, msg,
				     sizeof(msg)),
			 0);
	close(storage);
	w.prefix.len = 0;
	raw_send(fd, DLPC_MSG_WATCH, 3, &w.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EBUSY);
	ck_assert_ptr_nonnull(strstr(msg, "connection of its own"));
	shutdown(fd, SHUT_WR);
	expect_dropped(fd);

	/* after the reply, any request but RELEASE is a violation */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	raw_send(fd, DLPC_MSG_WATCH, 4, &w.base, NULL, 0);
	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	ck_assert_uint_eq(h.type, DLPC_MSG_WATCH | DLPC_MSG_REPLY);
	ck_assert_uint_eq(h.id, 4);
	rep = dlpackd__v1__watch_reply__unpack(NULL, h.len, buf);
	ck_assert_ptr_nonnull(rep);
	ck_assert_uint_eq(rep->queue_max, DLPC_WATCH_QUEUE_MAX);
	dlpackd__v1__watch_reply__free_unpacked(rep, NULL);
	ck_assert_uint_eq(stat_or_die(good).watchers, 1);
	raw_send(fd, DLPC_MSG_STAT, 5, &st.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "STAT on a watching connection"));
	expect_dropped(fd);

	/* EVENT frames travel from the daemon only */
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	raw_send(fd, DLPC_MSG_EVENT, 6, &st.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "unknown message EVENT"));
	expect_dropped(fd);

	expect_fds(baseline);
	ck_assert_uint_eq(stat_or_die(good).watchers, 0);
	good_client_check();
	good_client_stop();
}
END_TEST

/* ---- a client that never reads its replies ---- */

/*
 * Requests from a client that does not read its replies are not served beyond one reply queued:
 * the daemon stops reading that connection (its sends then block), holds at most one reply and
 * its fd, serves everyone else, and answers every request in order once the client reads.
 */
START_TEST(test_unread_replies_backpressure)
{
	Dlpackd__V1__Attach at = DLPACKD__V1__ATTACH__INIT;
	struct dlpc__scratch s = {0};
	struct dlpc__rx rx;
	DLManagedTensorVersioned *t;
	unsigned sent = 0, got = 0;
	dlpc_stats st;
	int fd, baseline;
	ssize_t len;
	char why[160];

	good_client_start();
	baseline = settled_fds(&D, good, 1);
	fd = raw_connect();
	raw_hello(fd, DLPC_PROTO_MAJOR);
	at.name.data = (uint8_t *)"good";
	at.name.len = 4;
	len = dlpc__msg_frame(&s, DLPC_MSG_ATTACH, 7, &at.base, 0);
	ck_assert_int_gt(len, 0);
	/* a frame this small leaves whole or not at all; when the socket is full, either the
	 * daemon is busy (wait for room) or it holds replies back (what this test is after) */
	while (sent < 2 * DLPC_TX_QUEUE_FDS_MAX) {
		struct pollfd pf = {.fd = fd, .events = POLLOUT};

		if (send(fd, s.p, (size_t)len, MSG_DONTWAIT | MSG_NOSIGNAL) == len) {
			sent++;
			continue;
		}
		ck_assert_int_eq(errno, EAGAIN);
		if (stat_or_die(good).tx_queued > 0 && poll(&pf, 1, 200) == 0)
			break;
		poll(&pf, 1, 50);
	}
	dlpc__scratch_clear(&s);
	ck_assert_msg(sent < 2 * DLPC_TX_QUEUE_FDS_MAX, "the daemon read %u requests", sent);

	st = stat_or_die(good);
	ck_assert_uint_eq(st.queue_drops, 0);
	ck_assert_uint_lt(st.tx_queued, 4096);			/* one ATTACH reply */
	ck_assert_uint_le(st.fds_open, (uint64_t)baseline + 2); /* its socket, one queued fd */
	ck_assert_uint_lt(st.req_attach, sent);
	/* everyone else is served meanwhile */
	ck_assert_dlpc(dlpc_attach(good, "good", NULL, &t), 1);
	ck_assert_int_eq(((uint8_t *)t->dl_tensor.data)[255], 255);
	t->deleter(t);

	/* reading, it gets every reply, in order, each with its fd */
	dlpc__rx_init(&rx);
	while (got < sent) {
		struct dlpc__frame f;
		int r = dlpc__rx_next(&rx, &f, why, sizeof(why));

		ck_assert_int_ge(r, 0);
		if (r == 0) {
			ck_assert_int_gt(dlpc__rx_read(&rx, fd, why, sizeof(why)), 0);
			continue;
		}
		ck_assert_uint_eq(f.hdr.type, DLPC_MSG_ATTACH | DLPC_MSG_REPLY);
		ck_assert_uint_eq(f.hdr.id, 7);
		ck_assert_uint_eq(f.nfds, 1);
		dlpc__frame_clear(&f);
		got++;
	}
	dlpc__rx_clear(&rx);
	/* all of them served: the flood, and the attach above */
	ck_assert_uint_ge(stat_or_die(good).req_attach, (uint64_t)sent + 1);
	close(fd);
	expect_fds(baseline);
	good_client_stop();
}
END_TEST

static bool dropped_one(const dlpc_stats *s, void *arg)
{
	return s->queue_drops == *(const uint64_t *)arg;
}

static bool waiting_n(const dlpc_stats *s, void *arg)
{
	return s->waiters == *(const uint64_t *)arg;
}

/* Send @p n ATTACHes of @p name that wait for it forever, and do not read. */
static int waiting_client(const char *name, unsigned n)
{
	Dlpackd__V1__Attach at = DLPACKD__V1__ATTACH__INIT;
	int fd = raw_connect();

	raw_hello(fd, DLPC_PROTO_MAJOR);
	at.name.data = (uint8_t *)name;
	at.name.len = strlen(name);
	at.timeout_ms = -1;
	for (unsigned i = 0; i < n; i++)
		raw_send(fd, DLPC_MSG_ATTACH, i + 1, &at.base, NULL, 0);
	return fd;
}

#define FLOOD_KEYS 4096
#define FLOOD_KEY_LEN 200

/*
 * Replies the client did not ask for just now are not held back: waiting ATTACHes all answered
 * when their name appears. A client that reads none of them is dropped at the byte cap
 * (DLPC_TX_QUEUE_MAX, large bundle replies) or at the fd cap (DLPC_TX_QUEUE_FDS_MAX, more
 * waiters than fds allowed), and nothing stays behind.
 */
START_TEST(test_unread_replies_dropped_at_caps)
{
	static const char *const args[] = {"--max-pending-per-connection", "8192", NULL};
	const struct daemon_opts o = {.args = args};
	static float data[FLOOD_KEYS];
	static char keybuf[FLOOD_KEYS][FLOOD_KEY_LEN + 1];
	const char *keys[FLOOD_KEYS];
	DLManagedTensorVersioned *ts[FLOOD_KEYS];
	uint64_t drops = 1, want;
	int64_t one = 1;
	int fd, baseline;

	daemon_stop(&D);
	daemon_start_with(&D, &o);
	good_client_start();
	baseline = settled_fds(&D, good, 1);
	for (int i = 0; i < FLOOD_KEYS; i++) {
		snprintf(keybuf[i], sizeof(keybuf[i]), "%0*d", FLOOD_KEY_LEN, i);
		keys[i] = keybuf[i];
		ts[i] = host_tensor(&data[i], (DLDataType){kDLFloat, 32, 1}, 1, &one, NULL, NULL);
	}

	/* bytes: about 1 MiB of tensor table per reply, to more waiters than 64 MiB holds */
	want = 2 * DLPC_TX_QUEUE_MAX / (FLOOD_KEYS * FLOOD_KEY_LEN);
	fd = waiting_client("big", (unsigned)want);
	ck_assert(wait_stat(good, waiting_n, &want, 2000));
	ck_assert_dlpc(dlpc_publish_bundle(good, "big", FLOOD_KEYS, keys, ts, 0), 1);
	ck_assert(wait_stat(good, dropped_one, &drops, 2000));
	ck_assert(log_has(D.log, "DLPC_TX_QUEUE_MAX"));
	close(fd);
	ck_assert_dlpc(dlpc_unpublish(good, "big"), 0);

	/* fds: each reply holds a duplicate of the storage fd until it is written */
	want = DLPC_TX_QUEUE_FDS_MAX + 512;
	fd = waiting_client("late", (unsigned)want);
	ck_assert(wait_stat(good, waiting_n, &want, 5000));
	ts[0] = host_tensor(&data[0], (DLDataType){kDLFloat, 32, 1}, 1, &one, NULL, NULL);
	ck_assert_dlpc(dlpc_publish(good, "late", ts[0], 0), 1);
	drops = 2;
	ck_assert(wait_stat(good, dropped_one, &drops, 2000));
	ck_assert(log_has(D.log, "DLPC_TX_QUEUE_FDS_MAX"));
	close(fd);
	ck_assert_dlpc(dlpc_unpublish(good, "late"), 0);

	expect_fds(baseline);
	ck_assert_uint_eq(stat_or_die(good).tx_queued, 0);
	good_client_stop();
}
END_TEST

static int exit_status(pid_t pid)
{
	int st;

	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

START_TEST(test_second_daemon_refused)
{
	char log[160];
	dlpc_client *c;

	snprintf(log, sizeof(log), "%s/second.log", D.dir);
	ck_assert_int_eq(exit_status(daemon_spawn(D.sock, log)), 1);
	ck_assert(log_has(log, "another dlpackd is already running"));
	/* the first one is untouched */
	c = connect_or_die(&D);
	ck_assert_uint_eq(stat_or_die(c).connections, 1);
	dlpc_close(c);
}
END_TEST

/* A file that is not a socket is never removed, whatever its name. */
START_TEST(test_path_is_not_a_socket)
{
	char path[160], log[160];
	FILE *f;

	snprintf(path, sizeof(path), "%s/notes.txt", D.dir);
	snprintf(log, sizeof(log), "%s/notes.log", D.dir);
	f = fopen(path, "w");
	ck_assert_ptr_nonnull(f);
	fputs("precious\n", f);
	fclose(f);
	ck_assert_int_eq(exit_status(daemon_spawn(path, log)), 1);
	ck_assert(log_has(log, "is not a socket"));
	ck_assert_int_eq(access(path, F_OK), 0);
}
END_TEST

START_TEST(test_stale_socket_taken_over)
{
	dlpc_client *c;
	uint8_t buf[8] = {0};
	int64_t shape[1] = {8};

	/* a daemon killed without cleanup leaves its socket file behind */
	ck_assert_int_eq(kill(D.pid, SIGKILL), 0);
	ck_assert_int_eq(exit_status(D.pid), 128 + SIGKILL);
	ck_assert_int_eq(access(D.sock, F_OK), 0);
	D.pid = daemon_spawn(D.sock, D.log);
	for (int i = 0; i < scaled_ms(5000) && !log_has(D.log, "removed stale socket"); i++)
		usleep(1000);
	ck_assert(log_has(D.log, "removed stale socket"));
	for (int i = 0; i < scaled_ms(5000); i++) {
		if (dlpc_connect(D.sock, &c) == 0)
			break;
		c = NULL;
		usleep(1000);
	}
	ck_assert_ptr_nonnull(c);
	ck_assert_dlpc(
		dlpc_publish(c, "x",
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     0),
		1);
	dlpc_close(c);
}
END_TEST

START_TEST(test_sigterm_with_clients)
{
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t;
	uint8_t buf[8] = {0};
	int64_t shape[1] = {8};

	ck_assert_dlpc(
		dlpc_publish(c, "x",
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     0),
		1);
	ck_assert_dlpc(dlpc_attach(c, "x", NULL, &t), 1);
	/* the fixture's teardown sends SIGTERM with this client connected and holding a
	 * reference; it checks exit 0, the socket gone and, under valgrind, nothing leaked */
	daemon_stop(&D);
	/* the tensor stays readable; its deleter's RELEASE goes nowhere, harmlessly */
	ck_assert_int_eq(((uint8_t *)t->dl_tensor.data)[0], 0);
	t->deleter(t);
	ck_assert_int_lt(dlpc_attach(c, "x", NULL, &t), 0);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "connection to dlpackd lost"));
	dlpc_close(c);
	daemon_start(&D);
}
END_TEST

/* SIGTERM the moment the socket accepts (before the daemon may have set up its handler). */
START_TEST(test_sigterm_right_after_start)
{
	for (int i = 0; i < 20; i++) {
		struct daemon d;

		daemon_start(&d);
		daemon_stop(&d); /* expects exit 0 and the socket gone */
	}
}
END_TEST

static Suite *hostile_suite(void)
{
	Suite *s = suite_create("hostile");
	TCase *tc = tcase_create("frames");
	TCase *life = tcase_create("lifecycle");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, scaled_ms(60000) / 1000);
	tcase_add_test(tc, test_garbage_frames);
	tcase_add_test(tc, test_session_rules);
	tcase_add_test(tc, test_name_and_request_limits);
	tcase_add_test(tc, test_storage_fd_matrix);
	tcase_add_test(tc, test_cuda_publish_rules);
	tcase_add_test(tc, test_watch_rules);
	tcase_add_test(tc, test_unread_replies_backpressure);
	tcase_add_test(tc, test_unread_replies_dropped_at_caps);
	suite_add_tcase(s, tc);
	tcase_add_checked_fixture(life, setup, teardown);
	tcase_set_timeout(life, scaled_ms(60000) / 1000);
	tcase_add_test(life, test_second_daemon_refused);
	tcase_add_test(life, test_stale_socket_taken_over);
	tcase_add_test(life, test_path_is_not_a_socket);
	tcase_add_test(life, test_sigterm_with_clients);
	tcase_add_test(life, test_sigterm_right_after_start);
	suite_add_tcase(s, life);
	return s;
}

int main(void)
{
	return run_suite(hostile_suite());
}
