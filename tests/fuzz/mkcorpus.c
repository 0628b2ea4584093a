/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Writes the seed corpus of fuzz_daemon (tests/fuzz/corpus/): real sessions made of valid
 * frames (HELLO, PUBLISH with its fd, ATTACH, RELEASE, LIST, STAT, UNPUBLISH, waiters, bundles)
 * and the classic bad ones (requests before HELLO, unknown types, wrong fd counts, fds split
 * from their frame, truncated frames, absurd lengths, bad storage fds).
 *
 *   mkcorpus DIR
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_daemon.h"
#include "msg.h"

struct input {
	uint8_t buf[1 << 16];
	size_t len;
};

/* One chunk: @p len bytes sent with fds of the given kinds. */
static void chunk(struct input *in, unsigned flags, const uint8_t *kinds, unsigned nfds,
		  const void *data, size_t len)
{
	if (in->len + 3 + nfds + len > sizeof(in->buf)) {
		fprintf(stderr, "mkcorpus: input too large\n");
		exit(1);
	}
	in->buf[in->len++] = (uint8_t)(flags | nfds);
	if (nfds)
		memcpy(in->buf + in->len, kinds, nfds);
	in->len += nfds;
	in->buf[in->len++] = (uint8_t)(len & 0xff);
	in->buf[in->len++] = (uint8_t)(len >> 8);
	if (len)
		memcpy(in->buf + in->len, data, len);
	in->len += len;
}

/* Control bits of the chunks frame() makes. */
static unsigned frame_flags = FUZZ_RUN;

/* A whole frame in one chunk; @p kinds gives its fds (the header declares @p declared). */
static void frame(struct input *in, uint16_t type, uint32_t id, const ProtobufCMessage *m,
		  unsigned declared, const uint8_t *kinds, unsigned nfds)
{
	struct dlpc__scratch s = {0};
	ssize_t len = dlpc__msg_frame(&s, type, id, m, declared);

	if (len < 0)
		exit(1);
	chunk(in, frame_flags, kinds, nfds, s.p, (size_t)len);
	dlpc__scratch_clear(&s);
}

static void hello(struct input *in, uint32_t major)
{
	Dlpackd__V1__Hello h = DLPACKD__V1__HELLO__INIT;

	h.version_major = major;
	h.client = "mkcorpus";
	frame(in, DLPC_MSG_HELLO, 1, &h.base, 0, NULL, 0);
}

static void stat_req(struct input *in, uint32_t id)
{
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;

	frame(in, DLPC_MSG_STAT, id, &st.base, 0, NULL, 0);
}

/* PUBLISH of @p ntensors float32 tensors of 16 elements with one fd of kind @p kind. */
static void publish(struct input *in, uint32_t id, const char *name, uint32_t flags,
		    unsigned ntensors, uint8_t kind)
{
	Dlpackd__V1__Publish p = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc descs[4], *ptrs[4];
	int64_t shape[2] = {4, 4};
	static const char *const keys[4] = {"a", "b", "c", "d"};

	for (unsigned i = 0; i < ntensors; i++) {
		dlpackd__v1__tensor_desc__init(&descs[i]);
		descs[i].key.data = (uint8_t *)(ntensors > 1 ? keys[i] : "");
		descs[i].key.len = ntensors > 1 ? 1 : 0;
		descs[i].dtype_code = 2; /* kDLFloat */
		descs[i].dtype_bits = 32;
		descs[i].dtype_lanes = 1;
		descs[i].n_shape = 2;
		descs[i].shape = shape;
		descs[i].offset = (uint64_t)i * 256;
		ptrs[i] = &descs[i];
	}
	p.name.data = (uint8_t *)name;
	p.name.len = strlen(name);
	p.flags = flags;
	p.device_type = 1; /* kDLCPU */
	p.storage_size = 4096;
	p.n_tensors = ntensors;
	p.tensors = ptrs;
	frame(in, DLPC_MSG_PUBLISH, id, &p.base, 1, &kind, 1);
}

static void attach(struct input *in, uint32_t id, const char *name, uint32_t flags,
		   int64_t timeout_ms)
{
	Dlpackd__V1__Attach a = DLPACKD__V1__ATTACH__INIT;

	a.name.data = (uint8_t *)name;
	a.name.len = strlen(name);
	a.flags = flags;
	a.timeout_ms = timeout_ms;
	frame(in, DLPC_MSG_ATTACH, id, &a.base, 0, NULL, 0);
}

static void release(struct input *in, uint64_t ref)
{
	Dlpackd__V1__Release r = DLPACKD__V1__RELEASE__INIT;

	r.n_ref_ids = 1;
	r.ref_ids = &ref;
	frame(in, DLPC_MSG_RELEASE, 0, &r.base, 0, NULL, 0);
}

static void list(struct input *in, uint32_t id, const char *prefix, uint32_t limit)
{
	Dlpackd__V1__List l = DLPACKD__V1__LIST__INIT;

	l.prefix.data = (uint8_t *)prefix;
	l.prefix.len = strlen(prefix);
	l.limit = limit;
	frame(in, DLPC_MSG_LIST, id, &l.base, 0, NULL, 0);
}

static void unpublish(struct input *in, uint32_t id, const char *name)
{
	Dlpackd__V1__Unpublish u = DLPACKD__V1__UNPUBLISH__INIT;

	u.name.data = (uint8_t *)name;
	u.name.len = strlen(name);
	frame(in, DLPC_MSG_UNPUBLISH, id, &u.base, 0, NULL, 0);
}

static void raw_header(struct input *in, uint32_t len, uint16_t type, uint8_t nfds)
{
	struct dlpc__hdr h = {.len = len, .type = type, .nfds = nfds, .id = 9};
	uint8_t hdr[DLPC_FRAME_HDR_SIZE];

	dlpc__hdr_encode(hdr, &h);
	chunk(in, FUZZ_RUN, NULL, 0, hdr, sizeof(hdr));
}

static const char *dir;

static void save(const char *name, const struct input *in)
{
	char path[512];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(path, "wb");
	if (!f || fwrite(in->buf, 1, in->len, f) != in->len || fclose(f) != 0) {
		perror(path);
		exit(1);
	}
}

int main(int argc, char **argv)
{
	static struct input in;
	const uint8_t ro = FUZZ_FD_MEMFD_RO, rw = FUZZ_FD_MEMFD_RW;

	if (argc != 2) {
		fprintf(stderr, "usage: mkcorpus DIR\n");
		return 2;
	}
	dir = argv[1];

#define SEED(name, ...)                                                                            \
	do {                                                                                       \
		in.len = 0;                                                                        \
		__VA_ARGS__;                                                                       \
		save(name, &in);                                                                   \
	} while (0)

	SEED("hello", hello(&in, DLPC_PROTO_MAJOR));
	SEED("hello-stat", {
		hello(&in, DLPC_PROTO_MAJOR);
		stat_req(&in, 2);
	});
	SEED("session", {
		hello(&in, DLPC_PROTO_MAJOR);
		publish(&in, 2, "m/w", 0, 1, ro);
		attach(&in, 3, "m/w", 0, 0);
		list(&in, 4, "m/", 0);
		release(&in, 1);
		unpublish(&in, 5, "m/w");
		stat_req(&in, 6);
	});
	SEED("bundle-writable", {
		hello(&in, DLPC_PROTO_MAJOR);
		publish(&in, 2, "b", DLPC_PUBLISH_WRITABLE, 3, rw);
		attach(&in, 3, "b", DLPC_ATTACH_WRITABLE, 0);
		attach(&in, 4, "b", DLPC_ATTACH_SINGLE, 0);
		list(&in, 5, "", 1);
	});
	SEED("replace-ephemeral", {
		hello(&in, DLPC_PROTO_MAJOR);
		publish(&in, 2, "x", DLPC_PUBLISH_EPHEMERAL, 1, ro);
		attach(&in, 3, "x", 0, 0);
		publish(&in, 4, "x", DLPC_PUBLISH_REPLACE, 1, ro);
		publish(&in, 5, "x", 0, 1, ro);
		release(&in, 1);
	});
	SEED("waiter", {
		hello(&in, DLPC_PROTO_MAJOR);
		attach(&in, 2, "later", 0, -1);
		attach(&in, 3, "later", 0, 1000);
		publish(&in, 4, "later", 0, 1, ro);
	});
	SEED("bad-storage", {
		hello(&in, DLPC_PROTO_MAJOR);
		publish(&in, 2, "s0", 0, 1, FUZZ_FD_MEMFD_BARE);
		publish(&in, 3, "s1", 0, 1, FUZZ_FD_MEMFD_NOSEAL);
		publish(&in, 4, "s2", 0, 1, FUZZ_FD_PIPE);
		publish(&in, 5, "s3", 0, 1, FUZZ_FD_FILE);
		publish(&in, 6, "s4", 0, 1, FUZZ_FD_DEVNULL);
		publish(&in, 7, "s5", 0, 1, FUZZ_FD_SOCKET);
		publish(&in, 8, "s6", DLPC_PUBLISH_WRITABLE, 1, ro);
	});
	SEED("before-hello", stat_req(&in, 1));
	SEED("version-mismatch", hello(&in, 99));
	SEED("hello-twice", {
		hello(&in, DLPC_PROTO_MAJOR);
		hello(&in, DLPC_PROTO_MAJOR);
	});
	SEED("unknown-type", {
		Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;

		hello(&in, DLPC_PROTO_MAJOR);
		frame(&in, 77, 2, &st.base, 0, NULL, 0);
	});
	SEED("release-unknown", {
		hello(&in, DLPC_PROTO_MAJOR);
		release(&in, 12345);
	});
	SEED("fds-undeclared", {
		Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;

		hello(&in, DLPC_PROTO_MAJOR);
		frame(&in, DLPC_MSG_STAT, 2, &st.base, 0, &ro, 1);
	});
	SEED("fds-missing", {
		Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;

		hello(&in, DLPC_PROTO_MAJOR);
		frame(&in, DLPC_MSG_STAT, 2, &st.base, 1, NULL, 0);
	});
	SEED("fds-too-many", {
		static const uint8_t kinds[7] = {0, 1, 2, 3, 4, 5, 6};
		Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;

		hello(&in, DLPC_PROTO_MAJOR);
		frame(&in, DLPC_MSG_STAT, 2, &st.base, 4, kinds, 7);
	});
	SEED("fds-split", {
		/* the header alone with the fd, the payload in a second sendmsg */
		Dlpackd__V1__Publish p = DLPACKD__V1__PUBLISH__INIT;
		struct dlpc__scratch s = {0};
		ssize_t len;

		hello(&in, DLPC_PROTO_MAJOR);
		p.name.data = (uint8_t *)"split";
		p.name.len = 5;
		p.device_type = 1;
		p.storage_size = 4096;
		len = dlpc__msg_frame(&s, DLPC_MSG_PUBLISH, 2, &p.base, 1);
		chunk(&in, FUZZ_RUN, NULL, 0, s.p, DLPC_FRAME_HDR_SIZE);
		chunk(&in, FUZZ_RUN, &ro, 1, s.p + DLPC_FRAME_HDR_SIZE,
		      (size_t)len - DLPC_FRAME_HDR_SIZE);
		dlpc__scratch_clear(&s);
	});
	SEED("cut-short", {
		hello(&in, DLPC_PROTO_MAJOR);
		raw_header(&in, 100, DLPC_MSG_LIST, 0);
		chunk(&in, FUZZ_SHUTDOWN, NULL, 0, "abc", 3);
	});
	SEED("len-max-plus-one", raw_header(&in, DLPC_FRAME_MAX + 1, DLPC_MSG_HELLO, 0));
	SEED("len-2-32-minus-1", raw_header(&in, UINT32_MAX, DLPC_MSG_HELLO, 0));
	SEED("not-protobuf", {
		raw_header(&in, 8, DLPC_MSG_HELLO, 0);
		chunk(&in, FUZZ_RUN, NULL, 0, "\xff\xff\xff\xff\xff\xff\xff\xff", 8);
	});
	SEED("unread-replies", {
		/* attach replies (each with an fd) pile up in the daemon's send queue */
		hello(&in, DLPC_PROTO_MAJOR);
		publish(&in, 2, "q", 0, 2, ro);
		frame_flags = FUZZ_RUN | FUZZ_HOLD;
		for (uint32_t id = 3; id < 40; id++)
			attach(&in, id, "q", 0, 0);
		list(&in, 40, "", 0);
		frame_flags = FUZZ_RUN;
		stat_req(&in, 41);
	});
	SEED("unread-then-violation", {
		/* dropped with replies and their fds still queued */
		hello(&in, DLPC_PROTO_MAJOR);
		publish(&in, 2, "q", 0, 1, ro);
		frame_flags = FUZZ_RUN | FUZZ_HOLD;
		for (uint32_t id = 3; id < 40; id++)
			attach(&in, id, "q", 0, 0);
		release(&in, 999);
	});
	SEED("wait-expires", {
		hello(&in, DLPC_PROTO_MAJOR);
		attach(&in, 2, "never", 0, 1);
		chunk(&in, FUZZ_WAIT | FUZZ_RUN, NULL, 0, NULL, 0);
		stat_req(&in, 3);
	});
	SEED("garbage", chunk(&in, FUZZ_RUN, NULL, 0, "GET / HTTP/1.1\r\n\r\n", 18));
	return 0;
}
