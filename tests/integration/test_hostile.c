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

#include "raw.h"

static struct daemon D;

static void setup(void)
{
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

/* ---- 11. garbage, oversized, fd mismatch: offender dropped, others unaffected ---- */

START_TEST(test_garbage_frames)
{
	static const uint8_t garbage[] = "GET / HTTP/1.1\r\nHost: dlpackd\r\n\r\n";
	uint8_t hdr[DLPC_FRAME_HDR_SIZE];
	int baseline, fd;
	struct dlpc__hdr h = {0};

	good_client_start(&D);
	baseline = good_baseline();

	/* text that is no frame at all: its "length" is absurd */
	fd = raw_connect(&D);
	ck_assert_int_eq(write(fd, garbage, sizeof(garbage)), (ssize_t)sizeof(garbage));
	expect_dropped(fd);

	/* an oversized length, announced before any payload */
	fd = raw_connect(&D);
	h = (struct dlpc__hdr){.len = DLPC_FRAME_MAX + 1, .type = DLPC_MSG_HELLO, .id = 1};
	dlpc__hdr_encode(hdr, &h);
	ck_assert_int_eq(write(fd, hdr, sizeof(hdr)), (ssize_t)sizeof(hdr));
	expect_dropped(fd);

	/* 2^32-1 */
	fd = raw_connect(&D);
	h.len = UINT32_MAX;
	dlpc__hdr_encode(hdr, &h);
	ck_assert_int_eq(write(fd, hdr, sizeof(hdr)), (ssize_t)sizeof(hdr));
	expect_dropped(fd);

	/* a frame declaring one fd but carrying two, after HELLO */
	fd = raw_connect(&D);
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
	fd = raw_connect(&D);
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
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	{
		Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
		int mfd = memfd_sealed(4096, 0);

		raw_send(fd, DLPC_MSG_STAT, 2, &st.base, &mfd, 1);
		close(mfd);
	}
	expect_dropped(fd);

	/* a frame cut short, then EOF */
	fd = raw_connect(&D);
	h = (struct dlpc__hdr){.len = 100, .type = DLPC_MSG_HELLO, .id = 1};
	dlpc__hdr_encode(hdr, &h);
	ck_assert_int_eq(write(fd, hdr, sizeof(hdr)), (ssize_t)sizeof(hdr));
	ck_assert_int_eq(write(fd, "abc", 3), 3);
	close(fd);

	/* a payload that is not protobuf */
	fd = raw_connect(&D);
	h = (struct dlpc__hdr){.len = 8, .type = DLPC_MSG_HELLO, .id = 1};
	dlpc__hdr_encode(hdr, &h);
	ck_assert_int_eq(write(fd, hdr, sizeof(hdr)), (ssize_t)sizeof(hdr));
	ck_assert_int_eq(write(fd, "\xff\xff\xff\xff\xff\xff\xff\xff", 8), 8);
	expect_dropped(fd);

	good_client_check();
	expect_fds(baseline);
	ck_assert_uint_ge(stat_or_die(good_client()).protocol_errors, 7);
	good_client_stop();
}
END_TEST

START_TEST(test_session_rules)
{
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	Dlpackd__V1__Release rel = DLPACKD__V1__RELEASE__INIT;
	Dlpackd__V1__Hello hello = DLPACKD__V1__HELLO__INIT;
	const uint32_t other[][2] = {{99, 3},
				     {DLPC_PROTO_MAJOR, DLPC_PROTO_MINOR - 1},
				     {DLPC_PROTO_MAJOR, DLPC_PROTO_MINOR + 1},
				     {DLPC_PROTO_MAJOR, 0}};
	uint64_t bogus = 12345;
	char msg[512], want[64];
	int baseline, fd;

	good_client_start(&D);
	baseline = good_baseline();

	/* a request before HELLO */
	fd = raw_connect(&D);
	raw_send(fd, DLPC_MSG_STAT, 1, &st.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "before HELLO"));
	expect_dropped(fd);

	/* one protocol version: another major, or another minor older or newer, is refused
	 * alike, naming both versions and what to do */
	for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++) {
		fd = raw_connect(&D);
		hello.version_major = other[i][0];
		hello.version_minor = other[i][1];
		raw_send(fd, DLPC_MSG_HELLO, 1, &hello.base, NULL, 0);
		ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
		snprintf(want, sizeof(want), "client speaks %u.%u", other[i][0], other[i][1]);
		ck_assert_msg(strstr(msg, want), "%s", msg);
		snprintf(want, sizeof(want), "dlpackd speaks %d.%d", DLPC_PROTO_MAJOR,
			 DLPC_PROTO_MINOR);
		ck_assert_msg(strstr(msg, want), "%s", msg);
		ck_assert_msg(strstr(msg, "same build") && strstr(msg, "restart dlpackd"), "%s",
			      msg);
		expect_dropped(fd);
	}

	/* an unknown message type */
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	raw_send(fd, 77, 2, &st.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "type 77"));
	expect_dropped(fd);

	/* HELLO twice */
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	hello.version_major = DLPC_PROTO_MAJOR;
	hello.version_minor = DLPC_PROTO_MINOR;
	raw_send(fd, DLPC_MSG_HELLO, 2, &hello.base, NULL, 0);
	expect_dropped(fd);

	/* releasing a reference it does not hold */
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	rel.n_ref_ids = 1;
	rel.ref_ids = &bogus;
	raw_send(fd, DLPC_MSG_RELEASE, 0, &rel.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "does not hold"));
	expect_dropped(fd);

	/* an ATTACH larger than its type's limit, refused before it is unpacked */
	fd = raw_connect(&D);
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
	fd = raw_connect(&D);
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

START_TEST(test_name_and_request_limits)
{
	char name[DLPC_NAME_MAX + 2], msg[512];
	int fd, storage, baseline;

	good_client_start(&D);
	baseline = good_baseline();
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	storage = memfd_sealed(1 << 20, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);

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
	ck_assert_uint_eq(stat_or_die(good_client()).entries, 4);
	expect_fds(baseline + 3);
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

	good_client_start(&D);
	baseline = settled_fds(&D, good_client(), 1);
	fd = raw_connect(&D);
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
	mfd = memfd_sealed(4096, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
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
	/* nor a file on disk (its close could block) or another driver's device */
	{
		static const char *const paths[] = {DLPC_TEST_DISK_DIR, "/dev/null"};
		static const char *const says[] = {"a file that is not shmem",
						   "a character device of major 1"};

		for (size_t i = 0; i < 2; i++) {
			int f = open(paths[i], O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);

			if (i == 1)
				f = open(paths[i], O_RDWR | O_CLOEXEC);
			ck_assert_msg(f >= 0, "%s: %s", paths[i], strerror(errno));
			ck_assert_int_eq(raw_cuda_publish(fd, "c1",
							  &(struct cuda_pub){.device_type = kDLCUDA,
									     .uuid_len = U,
									     .fds = &f,
									     .nfds = 1},
							  msg, sizeof(msg)),
					 EBADF);
			ck_assert_msg(strstr(msg, says[i]), "%s: %s", paths[i], msg);
			close(f);
		}
	}
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
	ck_assert_dlpc(dlpc_list(good_client(), "c2", &list, &count), 0);
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
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	ck_assert_int_eq(raw_cuda_publish(fd, "c4",
					  &(struct cuda_pub){.device_type = kDLCUDA, .uuid_len = U},
					  msg, sizeof(msg)),
			 EPROTO);
	expect_dropped(fd);
	fd = raw_connect(&D);
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

	good_client_start(&D);
	baseline = settled_fds(&D, good_client(), 1);

	/* a prefix over the limit is refused; the connection stays */
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	memset(prefix, 'p', sizeof(prefix));
	w.prefix.data = prefix;
	w.prefix.len = sizeof(prefix);
	raw_send(fd, DLPC_MSG_WATCH, 2, &w.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EINVAL);
	/* a connection owning an ephemeral entry cannot become a watcher */
	storage = memfd_sealed(256, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
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
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	raw_send(fd, DLPC_MSG_WATCH, 4, &w.base, NULL, 0);
	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	ck_assert_uint_eq(h.type, DLPC_MSG_WATCH | DLPC_MSG_REPLY);
	ck_assert_uint_eq(h.id, 4);
	rep = dlpackd__v1__watch_reply__unpack(NULL, h.len, buf);
	ck_assert_ptr_nonnull(rep);
	ck_assert_uint_eq(rep->queue_max, DLPC_WATCH_QUEUE_MAX);
	dlpackd__v1__watch_reply__free_unpacked(rep, NULL);
	ck_assert_uint_eq(stat_or_die(good_client()).watchers, 1);
	raw_send(fd, DLPC_MSG_STAT, 5, &st.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "STAT on a watching connection"));
	expect_dropped(fd);

	/* EVENT frames travel from the daemon only */
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	raw_send(fd, DLPC_MSG_EVENT, 6, &st.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EPROTO);
	ck_assert_ptr_nonnull(strstr(msg, "unknown message EVENT"));
	expect_dropped(fd);

	expect_fds(baseline);
	ck_assert_uint_eq(stat_or_die(good_client()).watchers, 0);
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

	good_client_start(&D);
	baseline = settled_fds(&D, good_client(), 1);
	fd = raw_connect(&D);
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
		if (stat_or_die(good_client()).tx_queued > 0 && poll(&pf, 1, 200) == 0)
			break;
		poll(&pf, 1, 50);
	}
	dlpc__scratch_clear(&s);
	ck_assert_msg(sent < 2 * DLPC_TX_QUEUE_FDS_MAX, "the daemon read %u requests", sent);

	st = stat_or_die(good_client());
	ck_assert_uint_eq(st.queue_drops, 0);
	ck_assert_uint_lt(st.tx_queued, 4096);			/* one ATTACH reply */
	ck_assert_uint_le(st.fds_open, (uint64_t)baseline + 2); /* its socket, one queued fd */
	ck_assert_uint_lt(st.req_attach, sent);
	/* everyone else is served meanwhile */
	ck_assert_dlpc(dlpc_attach(good_client(), "good", NULL, &t), 1);
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
	ck_assert_uint_ge(stat_or_die(good_client()).req_attach, (uint64_t)sent + 1);
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
	int fd = raw_connect(&D);

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
	/* caps lowered by their flags, so that fewer waiters reach them */
	static const char *const args[] = {"--max-pending-per-connection",
					   "8192",
					   "--max-queue-bytes",
					   "16M",
					   "--max-queue-fds",
					   "1024",
					   NULL};
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
	good_client_start(&D);
	baseline = settled_fds(&D, good_client(), 1);
	for (int i = 0; i < FLOOD_KEYS; i++) {
		snprintf(keybuf[i], sizeof(keybuf[i]), "%0*d", FLOOD_KEY_LEN, i);
		keys[i] = keybuf[i];
		ts[i] = host_tensor(&data[i], (DLDataType){kDLFloat, 32, 1}, 1, &one, NULL, NULL);
	}

	/* bytes: about 1 MiB of tensor table per reply, to more waiters than 64 MiB holds */
	want = 2 * (16u << 20) / (FLOOD_KEYS * FLOOD_KEY_LEN);
	fd = waiting_client("big", (unsigned)want);
	ck_assert(wait_stat(good_client(), waiting_n, &want, 2000));
	ck_assert_dlpc(dlpc_publish_bundle(good_client(), "big", FLOOD_KEYS, keys, ts, 0), 1);
	ck_assert(wait_stat(good_client(), dropped_one, &drops, 2000));
	ck_assert(log_has(D.log, "over the limit of 16777216 (--max-queue-bytes"));
	close(fd);
	ck_assert_dlpc(dlpc_unpublish(good_client(), "big"), 0);

	/* fds: each reply holds a duplicate of the storage fd until it is written */
	want = 1024 + 512;
	fd = waiting_client("late", (unsigned)want);
	ck_assert(wait_stat(good_client(), waiting_n, &want, 5000));
	ts[0] = host_tensor(&data[0], (DLDataType){kDLFloat, 32, 1}, 1, &one, NULL, NULL);
	ck_assert_dlpc(dlpc_publish(good_client(), "late", ts[0], 0), 1);
	drops = 2;
	ck_assert(wait_stat(good_client(), dropped_one, &drops, 2000));
	ck_assert(log_has(D.log, "over the limit of 1024 (--max-queue-fds"));
	close(fd);
	ck_assert_dlpc(dlpc_unpublish(good_client(), "late"), 0);

	expect_fds(baseline);
	ck_assert_uint_eq(stat_or_die(good_client()).tx_queued, 0);
	good_client_stop();
}
END_TEST

/* ---- 13. one daemon per socket; stale sockets; SIGTERM ---- */

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

/* ---- the hostile-input list, table by table ---- */

/* After a case: the offender is gone, the good client works, the daemon is back to @p base. */
static void case_done(int base)
{
	good_client_check();
	expect_fds(base);
}

/* Read until the daemon hangs up; one of the frames must be an ERROR naming @p text. */
static void expect_hangup(int fd, int code, const char *text)
{
	struct dlpc__hdr h;
	uint8_t buf[4096];
	bool seen = false;
	int frames = 0;

	while (raw_recv(fd, &h, buf, sizeof(buf)) == 1) {
		ck_assert_int_lt(++frames, 4);
		if (h.type == DLPC_MSG_ERROR) {
			Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, h.len, buf);

			ck_assert_ptr_nonnull(e);
			ck_assert_msg(e->code == code && strstr(e->message, text),
				      "ERROR %d '%s', expected %d '%s'", e->code, e->message, code,
				      text);
			seen = true;
			dlpackd__v1__error__free_unpacked(e, NULL);
		}
	}
	ck_assert_msg(seen, "dlpackd hung up without an ERROR naming '%s'", text);
	close(fd);
}

static size_t varint_size(uint64_t v)
{
	size_t n = 1;

	while (v >= 0x80) {
		v >>= 7;
		n++;
	}
	return n;
}

/*
 * A frame whose payload is exactly @p len bytes: @p m packed, then an unknown bytes field (number
 * 100) padding it out. Unknown fields are legal protobuf, so the frame is valid at any length
 * that fits the message. Returns the frame (header included); free it.
 */
static uint8_t *padded_frame(uint16_t type, uint32_t id, const ProtobufCMessage *m, uint32_t len,
			     uint8_t nfds)
{
	size_t packed = protobuf_c_message_get_packed_size(m), pad = 0, k;
	struct dlpc__hdr h = {.len = len, .type = type, .nfds = nfds, .id = id};
	uint8_t *buf = calloc(1, DLPC_FRAME_HDR_SIZE + (size_t)len), *p;

	ck_assert_ptr_nonnull(buf);
	for (k = 1; k <= 5; k++) {
		pad = len - packed - 2 - k;
		if (varint_size(pad) == k)
			break;
	}
	ck_assert_uint_le(k, 5);
	dlpc__hdr_encode(buf, &h);
	p = buf + DLPC_FRAME_HDR_SIZE;
	p += protobuf_c_message_pack(m, p);
	*p++ = ((100 << 3 | 2) & 0x7f) | 0x80; /* tag of field 100, wire type 2: two bytes */
	*p++ = (100 << 3 | 2) >> 7;
	for (uint64_t v = pad; v >= 0x80; v >>= 7)
		*p++ = (uint8_t)(v | 0x80);
	*p++ = (uint8_t)(pad >> 7 * (k - 1));
	ck_assert_uint_eq((size_t)(p - buf) + pad, DLPC_FRAME_HDR_SIZE + (size_t)len);
	return buf;
}

/* A refused request left the connection usable: STAT gets its reply. */
static void stat_still_works(int fd)
{
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	struct dlpc__hdr h;
	uint8_t buf[4096];

	raw_send(fd, DLPC_MSG_STAT, 6, &st.base, NULL, 0);
	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	ck_assert_uint_eq(h.type, DLPC_MSG_STAT | DLPC_MSG_REPLY);
	ck_assert_uint_eq(h.id, 6);
}

enum outcome { ANSWERED, REFUSED, DROPPED };

struct len_case {
	const char *what;
	uint16_t type;
	uint32_t len;
	bool hello;	     /* send HELLO first */
	const char *payload; /* literal payload of len bytes, or NULL: a padded valid message */
	enum outcome outcome;
	const char *text; /* in the ERROR's message */
};

START_TEST(test_frame_lengths)
{
	static const struct len_case cases[] = {
		{"HELLO of 0 bytes (version 0.0)", DLPC_MSG_HELLO, 0, false, "", DROPPED,
		 "client speaks 0.0"},
		{"STAT of 0 bytes", DLPC_MSG_STAT, 0, true, "", ANSWERED, NULL},
		{"STAT of 1 byte (field number 0)", DLPC_MSG_STAT, 1, true, "\x00", DROPPED,
		 "malformed STAT payload"},
		{"ATTACH of 1 byte (a tag without its value)", DLPC_MSG_ATTACH, 1, true, "\x08",
		 DROPPED, "malformed ATTACH payload"},
		{"ATTACH of DLPC_SMALL_MSG_MAX - 1 bytes", DLPC_MSG_ATTACH, DLPC_SMALL_MSG_MAX - 1,
		 true, NULL, REFUSED, "no entry named 'nobody'"},
		{"ATTACH of DLPC_SMALL_MSG_MAX bytes", DLPC_MSG_ATTACH, DLPC_SMALL_MSG_MAX, true,
		 NULL, REFUSED, "no entry named 'nobody'"},
		{"ATTACH of DLPC_SMALL_MSG_MAX + 1 bytes", DLPC_MSG_ATTACH, DLPC_SMALL_MSG_MAX + 1,
		 true, NULL, DROPPED, "exceeds its limit of 4096"},
		{"PUBLISH of DLPC_FRAME_MAX - 1 bytes", DLPC_MSG_PUBLISH, DLPC_FRAME_MAX - 1, true,
		 NULL, ANSWERED, NULL},
		{"PUBLISH of DLPC_FRAME_MAX bytes", DLPC_MSG_PUBLISH, DLPC_FRAME_MAX, true, NULL,
		 ANSWERED, NULL},
		{"PUBLISH of DLPC_FRAME_MAX + 1 bytes", DLPC_MSG_PUBLISH, DLPC_FRAME_MAX + 1, true,
		 NULL, DROPPED, "frame of 8388609 bytes exceeds the limit of 8388608"},
		{"HELLO of 2^31 bytes", DLPC_MSG_HELLO, 1u << 31, false, NULL, DROPPED,
		 "frame of 2147483648 bytes exceeds the limit"},
		{"HELLO of 2^32 - 1 bytes", DLPC_MSG_HELLO, UINT32_MAX, false, NULL, DROPPED,
		 "frame of 4294967295 bytes exceeds the limit"},
	};
	int base;

	good_client_start(&D);
	base = good_baseline();
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct len_case *c = &cases[i];
		int fd = raw_connect(&D), storage = -1;
		struct dlpc__hdr h;
		uint8_t reply[4096];
		char msg[512];

		fprintf(stderr, "case: %s\n", c->what);
		if (c->hello)
			raw_hello(fd, DLPC_PROTO_MAJOR);
		if (c->type == DLPC_MSG_PUBLISH)
			storage = memfd_sealed(4096, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE |
							     F_SEAL_SEAL);
		if (c->payload) {
			uint8_t buf[DLPC_FRAME_HDR_SIZE + 1] = {0};
			struct dlpc__hdr fh = {.len = c->len, .type = c->type, .id = 5};

			dlpc__hdr_encode(buf, &fh);
			memcpy(buf + DLPC_FRAME_HDR_SIZE, c->payload, c->len);
			ck_assert_int_eq(
				dlpc__send_all(fd, buf, DLPC_FRAME_HDR_SIZE + c->len, NULL, 0), 0);
		} else if (c->len > DLPC_FRAME_MAX) {
			/* only the header: the daemon must refuse it before any payload */
			uint8_t buf[DLPC_FRAME_HDR_SIZE];
			struct dlpc__hdr fh = {.len = c->len,
					       .type = c->type,
					       .id = 5,
					       .nfds = storage >= 0 ? 1 : 0};

			dlpc__hdr_encode(buf, &fh);
			ck_assert_int_eq(dlpc__send_all(fd, buf, sizeof(buf), &storage,
							storage >= 0 ? 1 : 0),
					 0);
		} else if (c->type == DLPC_MSG_ATTACH) {
			Dlpackd__V1__Attach at = DLPACKD__V1__ATTACH__INIT;
			uint8_t *frame;

			at.name.data = (uint8_t *)"nobody";
			at.name.len = 6;
			frame = padded_frame(c->type, 5, &at.base, c->len, 0);
			ck_assert_int_eq(
				dlpc__send_all(fd, frame, DLPC_FRAME_HDR_SIZE + c->len, NULL, 0),
				0);
			free(frame);
		} else {
			Dlpackd__V1__Publish pub = DLPACKD__V1__PUBLISH__INIT;
			Dlpackd__V1__TensorDesc desc = DLPACKD__V1__TENSOR_DESC__INIT, *dp = &desc;
			int64_t shape[1] = {16};
			uint8_t *frame;

			desc.dtype_code = kDLFloat;
			desc.dtype_bits = 32;
			desc.dtype_lanes = 1;
			desc.n_shape = 1;
			desc.shape = shape;
			pub.name.data = (uint8_t *)"len/limit";
			pub.name.len = 9;
			pub.device_type = kDLCPU;
			pub.storage_size = 64;
			pub.n_tensors = 1;
			pub.tensors = &dp;
			frame = padded_frame(c->type, 5, &pub.base, c->len, 1);
			ck_assert_int_eq(dlpc__send_all(fd, frame, DLPC_FRAME_HDR_SIZE + c->len,
							&storage, 1),
					 0);
			free(frame);
		}
		if (storage >= 0)
			close(storage);
		switch (c->outcome) {
		case ANSWERED:
			ck_assert_int_eq(raw_recv(fd, &h, reply, sizeof(reply)), 1);
			ck_assert_uint_eq(h.type, c->type | DLPC_MSG_REPLY);
			ck_assert_uint_eq(h.id, 5);
			if (c->type == DLPC_MSG_PUBLISH)
				ck_assert_dlpc(dlpc_unpublish(good_client(), "len/limit"), 0);
			close(fd);
			break;
		case REFUSED:
			ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), ENOENT);
			ck_assert_ptr_nonnull(strstr(msg, c->text));
			stat_still_works(fd);
			close(fd);
			break;
		case DROPPED:
			expect_hangup(fd, EPROTO, c->text);
			break;
		}
		case_done(base);
	}
	good_client_stop();
}
END_TEST

/* A PUBLISH frame of a good request (name "fd/case"), declaring @p declared fds. */
static size_t publish_frame(struct dlpc__scratch *s, unsigned declared)
{
	Dlpackd__V1__Publish pub = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc desc = DLPACKD__V1__TENSOR_DESC__INIT, *dp = &desc;
	int64_t shape[1] = {16};
	ssize_t len;

	desc.dtype_code = kDLFloat;
	desc.dtype_bits = 32;
	desc.dtype_lanes = 1;
	desc.n_shape = 1;
	desc.shape = shape;
	pub.name.data = (uint8_t *)"fd/case";
	pub.name.len = 7;
	pub.device_type = kDLCPU;
	pub.storage_size = 64;
	pub.n_tensors = 1;
	pub.tensors = &dp;
	len = dlpc__msg_frame(s, DLPC_MSG_PUBLISH, 7, &pub.base, declared);
	ck_assert_int_gt(len, DLPC_FRAME_HDR_SIZE);
	return (size_t)len;
}

struct fd_case {
	const char *what;
	unsigned declared;	/* nfds in the header */
	unsigned first, second; /* fds on the header's sendmsg and on the payload's */
	const char *text;	/* in the ERROR */
};

/* Frames whose fds do not match their header; fds in excess of what a control buffer holds. */
START_TEST(test_fd_mismatch)
{
	static const struct fd_case cases[] = {
		{"declares 1 fd, carries none", 1, 0, 0, "declares 1 fds but 0 arrived"},
		{"declares 1 fd, carries 2", 1, 2, 0, "declares 1 fds but 2 arrived"},
		{"declares 2 fds, carries 2 (PUBLISH takes 1)", 2, 2, 0,
		 "PUBLISH carries 2 fds, expected at most 1"},
		{"declares 0 fds, carries 1", 0, 1, 0, "PUBLISH carries 0 fds, expected 1"},
		{"declares 2 fds, split 1 + 1 over two sendmsg", 2, 1, 1,
		 "declares 2 fds but 1 arrived"},
		{"declares 4 fds, split 2 + 2 over two sendmsg", 4, 2, 2,
		 "declares 4 fds but 2 arrived"},
		{"declares 5 fds (over DLPC_FRAME_FDS_MAX)", 5, 0, 0, "bad frame header (5 fds"},
		{"declares 4, carries 5: more than a message may carry", 4, 5, 0,
		 "more than 4 fds in one message (5)"},
		{"declares 4, carries 253 = SCM_MAX_FD: all arrive, and are closed", 4, 253, 0,
		 "more than 4 fds in one message (253)"},
	};
	int base;

	good_client_start(&D);
	base = good_baseline();
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct fd_case *c = &cases[i];
		int fd = raw_connect(&D), *fds = calloc(c->first + c->second + 1, sizeof(int));
		struct dlpc__scratch s = {0};
		size_t len = publish_frame(&s, c->declared);

		fprintf(stderr, "case: %s\n", c->what);
		raw_hello(fd, DLPC_PROTO_MAJOR);
		for (unsigned k = 0; k < c->first + c->second; k++)
			fds[k] = memfd_sealed(4096, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE |
							    F_SEAL_SEAL);
		ck_assert_int_eq(send_fds_raw(fd, s.p, DLPC_FRAME_HDR_SIZE, fds, c->first),
				 DLPC_FRAME_HDR_SIZE);
		/* the payload may find the connection closed already */
		send_fds_raw(fd, s.p + DLPC_FRAME_HDR_SIZE, len - DLPC_FRAME_HDR_SIZE,
			     fds + c->first, c->second);
		for (unsigned k = 0; k < c->first + c->second; k++)
			close(fds[k]);
		free(fds);
		dlpc__scratch_clear(&s);
		expect_hangup(fd, EPROTO, c->text);
		case_done(base);
	}
	good_client_stop();
}
END_TEST

/* More fds than the kernel passes in one message: refused by sendmsg, nothing reaches the
 * daemon and the connection stays good. */
START_TEST(test_fds_over_scm_max)
{
	int fds[254], fd, base;
	struct dlpc__scratch s = {0};
	size_t len;

	good_client_start(&D);
	base = good_baseline();
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	fds[0] = memfd_sealed(4096, 0);
	for (int k = 1; k < 254; k++)
		fds[k] = fcntl(fds[0], F_DUPFD_CLOEXEC, 3);
	len = publish_frame(&s, 4);
	ck_assert_int_eq(send_fds_raw(fd, s.p, len, fds, 254), -1);
	ck_assert_int_eq(errno, EINVAL);
	for (int k = 0; k < 254; k++)
		close(fds[k]);
	dlpc__scratch_clear(&s);
	stat_still_works(fd);
	close(fd);
	case_done(base);
	good_client_stop();
}
END_TEST

/* Fds that arrive with no frame to claim them: one byte at a time, each with an fd. */
START_TEST(test_fds_piling_up)
{
	int fd, base, m = memfd_sealed(4096, 0);
	uint8_t hdr[DLPC_FRAME_HDR_SIZE];
	struct dlpc__hdr h = {.len = 100, .type = DLPC_MSG_PUBLISH, .nfds = 1, .id = 3};

	good_client_start(&D);
	base = good_baseline();
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	dlpc__hdr_encode(hdr, &h);
	for (int k = 0; k < 3; k++)
		send_fds_raw(fd, hdr + k, 1, &m, 1);
	close(m);
	expect_hangup(fd, EPROTO, "fds arrived faster than frames claimed them");
	case_done(base);
	good_client_stop();
}
END_TEST

struct cut_case {
	const char *what;
	size_t bytes; /* of the PUBLISH frame sent before EOF */
	bool fd;
};

/* A frame cut short, then EOF: no reply, the connection and anything it sent are let go. */
START_TEST(test_cut_short)
{
	static const struct cut_case cases[] = {
		{"1 byte of a header", 1, false},
		{"11 bytes of a header", DLPC_FRAME_HDR_SIZE - 1, false},
		{"a header alone", DLPC_FRAME_HDR_SIZE, false},
		{"a header and its fd", DLPC_FRAME_HDR_SIZE, true},
		{"all but one byte, with the fd", 0, true},
	};
	int base;

	good_client_start(&D);
	base = good_baseline();
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct cut_case *c = &cases[i];
		struct dlpc__scratch s = {0};
		size_t len = publish_frame(&s, 1), n = c->bytes ? c->bytes : len - 1;
		int fd = raw_connect(&D),
		    m = memfd_sealed(4096,
				     F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
		struct dlpc__hdr h;
		uint8_t buf[512];

		fprintf(stderr, "case: %s\n", c->what);
		raw_hello(fd, DLPC_PROTO_MAJOR);
		ck_assert_int_eq(send_fds_raw(fd, s.p, n, &m, c->fd ? 1 : 0), (ssize_t)n);
		close(m);
		dlpc__scratch_clear(&s);
		ck_assert_int_eq(shutdown(fd, SHUT_WR), 0);
		ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 0);
		close(fd);
		case_done(base);
	}
	ck_assert(log_has(D.log, "closed the connection in the middle of a frame"));
	good_client_stop();
}
END_TEST

/* Types no request has: 0, the first past the table, replies and errors, anything else. */
START_TEST(test_unknown_types)
{
	static const uint16_t types[] = {
		0,
		DLPC_MSG__REQUEST_COUNT,
		77,
		0x7fff,
		DLPC_MSG_ERROR,
		DLPC_MSG_HELLO | DLPC_MSG_REPLY,
		DLPC_MSG_STAT | DLPC_MSG_REPLY,
		0xffff,
	};
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	int base;

	good_client_start(&D);
	base = good_baseline();
	for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
		for (int hello = 0; hello < 2; hello++) {
			int fd = raw_connect(&D);

			fprintf(stderr, "case: type 0x%x%s\n", types[i],
				hello ? " after HELLO" : "");
			if (hello)
				raw_hello(fd, DLPC_PROTO_MAJOR);
			raw_send(fd, types[i], 4, &st.base, NULL, 0);
			expect_hangup(fd, EPROTO, "unknown message");
			case_done(base);
		}
	good_client_stop();
}
END_TEST

/* Every request type before HELLO: refused and dropped; a PUBLISH's storage is not kept. */
START_TEST(test_requests_before_hello)
{
	Dlpackd__V1__Attach at = DLPACKD__V1__ATTACH__INIT;
	Dlpackd__V1__Release rel = DLPACKD__V1__RELEASE__INIT;
	Dlpackd__V1__Unpublish un = DLPACKD__V1__UNPUBLISH__INIT;
	Dlpackd__V1__List li = DLPACKD__V1__LIST__INIT;
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	uint64_t one = 1;
	int base;

	at.name.data = un.name.data = (uint8_t *)"good";
	at.name.len = un.name.len = 4;
	rel.n_ref_ids = 1;
	rel.ref_ids = &one;
	good_client_start(&D);
	base = good_baseline();
	for (uint16_t type = DLPC_MSG_PUBLISH; type < DLPC_MSG__REQUEST_COUNT; type++) {
		int fd = raw_connect(&D);
		char text[64], name[32];

		fprintf(stderr, "case: %s before HELLO\n",
			dlpc__msg_name(type, name, sizeof(name)));
		snprintf(text, sizeof(text), "%s before HELLO", name);
		if (type == DLPC_MSG_PUBLISH) {
			struct dlpc__scratch s = {0};
			size_t len = publish_frame(&s, 1);
			int m = memfd_sealed(4096, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE |
							   F_SEAL_SEAL);

			ck_assert_int_eq(dlpc__send_all(fd, s.p, len, &m, 1), 0);
			close(m);
			dlpc__scratch_clear(&s);
		} else {
			const ProtobufCMessage *m = type == DLPC_MSG_ATTACH	 ? &at.base
						    : type == DLPC_MSG_RELEASE	 ? &rel.base
						    : type == DLPC_MSG_UNPUBLISH ? &un.base
						    : type == DLPC_MSG_LIST	 ? &li.base
										 : &st.base;

			raw_send(fd, type, 8, m, NULL, 0);
		}
		expect_hangup(fd, EPROTO, text);
		case_done(base);
	}
	/* nothing was published, unpublished or released by them */
	ck_assert_uint_eq(stat_or_die(good_client()).entries, 1);
	good_client_stop();
}
END_TEST

struct name_case {
	const char *what;
	const char *name;
	size_t len;
	const char *text;
};

/* Bad names in every request that takes one: EINVAL naming the problem; the connection stays. */
START_TEST(test_bad_names)
{
	static char longname[DLPC_NAME_MAX + 1];
	static const struct name_case cases[] = {
		{"empty", "", 0, "is empty"},
		{"NUL inside", "a\0b", 3, "not valid UTF-8 or contains NUL"},
		{"NUL at the end", "ab\0", 3, "not valid UTF-8 or contains NUL"},
		{"over-long", longname, DLPC_NAME_MAX + 1, "more than the limit of 255"},
		{"overlong UTF-8 encoding of '/'", "\xc0\xaf", 2, "not valid UTF-8"},
		{"UTF-16 surrogate", "x\xed\xa0\x80", 4, "not valid UTF-8"},
		{"truncated sequence", "x\xe2\x82", 3, "not valid UTF-8"},
		{"beyond U+10FFFF", "\xf4\x90\x80\x80", 4, "not valid UTF-8"},
		{"lone continuation byte", "\x80", 1, "not valid UTF-8"},
		{"byte 0xff", "a\xff", 2, "not valid UTF-8"},
	};
	int base, fd, storage;

	memset(longname, 'n', sizeof(longname));
	good_client_start(&D);
	base = good_baseline();
	fd = raw_connect(&D);
	raw_hello(fd, DLPC_PROTO_MAJOR);
	storage = memfd_sealed(4096, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct name_case *c = &cases[i];
		Dlpackd__V1__Attach at = DLPACKD__V1__ATTACH__INIT;
		Dlpackd__V1__Unpublish un = DLPACKD__V1__UNPUBLISH__INIT;
		char msg[512];

		fprintf(stderr, "case: name %s\n", c->what);
		ck_assert_int_eq(
			raw_publish(fd, c->name, c->len, storage, 4, 0, 1, 1, msg, sizeof(msg)),
			EINVAL);
		ck_assert_msg(strstr(msg, c->text), "PUBLISH: '%s'", msg);
		for (int wait = 0; wait < 2; wait++) {
			at.name.data = (uint8_t *)c->name;
			at.name.len = c->len;
			at.timeout_ms = wait ? -1 : 0; /* nobody may wait for a bad name either */
			raw_send(fd, DLPC_MSG_ATTACH, 3, &at.base, NULL, 0);
			ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EINVAL);
			ck_assert_msg(strstr(msg, c->text), "ATTACH: '%s'", msg);
		}
		un.name.data = (uint8_t *)c->name;
		un.name.len = c->len;
		raw_send(fd, DLPC_MSG_UNPUBLISH, 4, &un.base, NULL, 0);
		ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EINVAL);
		ck_assert_msg(strstr(msg, c->text), "UNPUBLISH: '%s'", msg);
	}
	/* the edges that are fine: 255 bytes, and the largest code point */
	ck_assert_int_eq(raw_publish(fd, longname, DLPC_NAME_MAX, storage, 4, 0, 1, 1, NULL, 0), 0);
	ck_assert_int_eq(raw_publish(fd, "\xf4\x8f\xbf\xbf", 4, storage, 4, 0, 1, 1, NULL, 0), 0);
	ck_assert_uint_eq(stat_or_die(good_client()).waiters, 0);
	close(storage);
	stat_still_works(fd);
	close(fd);
	good_client_check();
	expect_fds(base + 2); /* each good name holds its own copy of the storage fd */
	good_client_stop();
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
	tcase_add_test(tc, test_frame_lengths);
	tcase_add_test(tc, test_fd_mismatch);
	tcase_add_test(tc, test_fds_over_scm_max);
	tcase_add_test(tc, test_fds_piling_up);
	tcase_add_test(tc, test_cut_short);
	tcase_add_test(tc, test_unknown_types);
	tcase_add_test(tc, test_requests_before_hello);
	tcase_add_test(tc, test_bad_names);
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
