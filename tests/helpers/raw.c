/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "direct.h"
#include "raw.h"
#include "table.h"

/* The receive state of the one connection raw_recv() reads from at a time. */
static struct dlpc__rx rx;
static int rx_fd = -1;

static void rx_forget(void)
{
	dlpc__rx_clear(&rx);
	rx_fd = -1;
}

int raw_connect(const struct daemon *d)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	ck_assert_int_ge(fd, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", d->sock);
	ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	if (fd == rx_fd) /* a new connection under an old number */
		rx_forget();
	return fd;
}

void raw_send(int fd, uint16_t type, uint32_t id, const ProtobufCMessage *m, const int *fds,
	      unsigned nfds)
{
	struct dlpc__scratch s = {0};
	ssize_t len = dlpc__msg_frame(&s, type, id, m, nfds);

	ck_assert_int_gt(len, 0);
	ck_assert_int_eq(dlpc__send_all(fd, s.p, (size_t)len, fds, nfds), 0);
	dlpc__scratch_clear(&s);
}

int raw_recv_fd(int fd, struct dlpc__hdr *h, uint8_t *buf, size_t cap, int *rfd)
{
	struct dlpc__frame f;
	char why[160];

	if (rx_fd != fd) {
		rx_forget();
		rx_fd = fd;
	}
	for (;;) {
		int r = dlpc__rx_next(&rx, &f, why, sizeof(why));
		ssize_t n;

		ck_assert_msg(r >= 0, "bad frame from dlpackd: %s", why);
		if (r == 1) {
			*h = f.hdr;
			ck_assert_uint_le(f.hdr.len, cap);
			memcpy(buf, f.payload, f.hdr.len);
			if (rfd)
				*rfd = f.nfds > 0 ? dlpc__frame_take_fd(&f, 0) : -1;
			dlpc__frame_clear(&f);
			return 1;
		}
		n = dlpc__rx_read(&rx, fd, why, sizeof(why));
		if (n == 0 || n == -ECONNRESET) {
			rx_forget();
			return 0;
		}
		ck_assert_msg(n > 0, "reading from dlpackd: %s", strerror((int)-n));
	}
}

int raw_recv(int fd, struct dlpc__hdr *h, uint8_t *buf, size_t cap)
{
	return raw_recv_fd(fd, h, buf, cap, NULL);
}

void raw_hello(int fd, uint32_t major)
{
	Dlpackd__V1__Hello hello = DLPACKD__V1__HELLO__INIT;
	struct dlpc__hdr h;
	uint8_t buf[512];

	hello.version_major = major;
	hello.version_minor = DLPC_PROTO_MINOR;
	hello.client = "raw test client";
	raw_send(fd, DLPC_MSG_HELLO, 1, &hello.base, NULL, 0);
	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	ck_assert_uint_eq(h.type, DLPC_MSG_HELLO | DLPC_MSG_REPLY);
}

int raw_error(int fd, char *msg, size_t len)
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

void expect_dropped(int fd)
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

int memfd_sealed(size_t size, int seals)
{
	int fd = memfd_create("test", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
	/* every page allocated, as the daemon requires */
	ck_assert_int_eq(size ? fallocate(fd, 0, 0, (off_t)size) : 0, 0);
	if (seals)
		ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, seals), 0);
	return fd;
}

int raw_publish(int fd, const char *name, size_t name_len, int storage, uint64_t size,
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

		ck_assert_ptr_nonnull(e);
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

/* ---- the good client ---- */

static const struct daemon *good_d;
static dlpc_client *good;
static DLManagedTensorVersioned *held;

void good_client_start(const struct daemon *d)
{
	uint8_t buf[256];
	int64_t shape[1] = {256};

	for (int i = 0; i < 256; i++)
		buf[i] = (uint8_t)i;
	good_d = d;
	good = connect_or_die(d);
	ck_assert_dlpc(
		dlpc_publish(good, "good",
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     0),
		1);
	ck_assert_dlpc(dlpc_attach(good, "good", NULL, &held), 1);
}

static bool one_connection(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->connections == 1;
}

void good_client_check(void)
{
	DLManagedTensorVersioned *t;
	uint32_t v[64];
	int64_t shape[1] = {64};

	/* the offenders' connections are gone (the daemon may see a close after we made it) */
	ck_assert_msg(wait_stat(good, one_connection, NULL, 2000), "offenders are still connected");
	for (int i = 0; i < 256; i++)
		ck_assert_int_eq(((uint8_t *)held->dl_tensor.data)[i], i);
	/* a full round trip: publish, attach, read, release, unpublish */
	for (int i = 0; i < 64; i++)
		v[i] = 0xc0de0000u + (uint32_t)i;
	ck_assert_dlpc(
		dlpc_publish(good, "good/round-trip",
			     host_tensor(v, (DLDataType){kDLUInt, 32, 1}, 1, shape, NULL, NULL), 0),
		1);
	ck_assert_dlpc(dlpc_attach(good, "good/round-trip", NULL, &t), 1);
	ck_assert_int_eq(memcmp(t->dl_tensor.data, v, sizeof(v)), 0);
	t->deleter(t);
	ck_assert_dlpc(dlpc_unpublish(good, "good/round-trip"), 0);
}

static bool refs_one(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->references == 1 && s->connections == 1;
}

void expect_fds(int baseline)
{
	ck_assert_msg(wait_stat(good, refs_one, NULL, 2000),
		      "offending connections or references outlived the test case");
	ck_assert_int_eq(settled_fds(good_d, good, 1), baseline);
}

int good_baseline(void)
{
	return settled_fds(good_d, good, 1);
}

dlpc_client *good_client(void)
{
	return good;
}

void good_client_stop(void)
{
	held->deleter(held);
	held = NULL;
	dlpc_close(good);
	good = NULL;
}

int raw_join_again(int fd, const char *name, int ends[2], char *msg, size_t len)
{
	Dlpackd__V1__Channel co = DLPACKD__V1__CHANNEL__INIT;
	uint8_t hdr[DLPC_FRAME_HDR_SIZE], buf[4096];
	union {
		struct cmsghdr c;
		char b[CMSG_SPACE(4 * sizeof(int))];
	} ctl;
	struct iovec iov = {.iov_base = hdr, .iov_len = sizeof(hdr)};
	struct msghdr mh = {.msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = ctl.b,
			    .msg_controllen = sizeof(ctl.b)};
	struct dlpc__hdr h;
	unsigned n = 0;

	co.op = 4;
	co.name.data = (uint8_t *)name;
	co.name.len = strlen(name);
	raw_send(fd, DLPC_MSG_CHANNEL, 8, &co.base, NULL, 0);
	CHILD_CHECK(recvmsg(fd, &mh, MSG_WAITALL | MSG_CMSG_CLOEXEC) == sizeof(hdr));
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
			for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int) && n < 2;
			     i++)
				memcpy(&ends[n++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
	dlpc__hdr_decode(hdr, &h);
	CHILD_CHECK(h.len <= sizeof(buf));
	for (size_t got = 0; got < h.len;) {
		ssize_t k = read(fd, buf + got, h.len - got);

		CHILD_CHECK(k > 0);
		got += (size_t)k;
	}
	if (h.type == DLPC_MSG_ERROR) {
		Dlpackd__V1__Error *e = dlpackd__v1__error__unpack(NULL, h.len, buf);
		int code;

		CHILD_CHECK(e != NULL && n == 0);
		code = e->code;
		snprintf(msg, len, "%s", e->message);
		dlpackd__v1__error__free_unpacked(e, NULL);
		return code;
	}
	CHILD_CHECK(h.type == (DLPC_MSG_CHANNEL | DLPC_MSG_REPLY) && n == 2);
	return 0;
}

/* CHANNEL JOIN of @p name on the raw connection @p fd (HELLO 1.8 first): the two ends. */
void raw_join_or_die(int fd, const char *name, int ends[2])
{
	Dlpackd__V1__Hello hello = DLPACKD__V1__HELLO__INIT;
	struct dlpc__hdr h;
	uint8_t buf[4096];
	char msg[512];

	hello.version_major = DLPC_PROTO_MAJOR;
	hello.version_minor = DLPC_PROTO_MINOR;
	hello.client = "raw test client";
	raw_send(fd, DLPC_MSG_HELLO, 1, &hello.base, NULL, 0);
	CHILD_CHECK(raw_recv(fd, &h, buf, sizeof(buf)) == 1);
	CHILD_CHECK(raw_join_again(fd, name, ends, msg, sizeof(msg)) == 0);
}

/* A direct record of a 4096-byte storage holding one float32 tensor of 4 elements. */
void raw_small_record(uint8_t rec[DLPC_DIRECT_RECORD])
{
	Dlpackd__V1__TensorDesc d, *dp = &d;
	uint8_t table[DLPC_DIRECT_TABLE_MAX];
	int64_t elems = 4;

	dlpackd__v1__tensor_desc__init(&d);
	d.dtype_code = kDLFloat;
	d.dtype_bits = 32;
	d.dtype_lanes = 1;
	d.n_shape = 1;
	d.shape = &elems;
	dlpc__table_encode(&dp, 1, table);
	CHILD_CHECK(dlpc__direct_encode(rec, 4096, table, dlpc__table_size(&dp, 1)) == 0);
}
