/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Writes the seed corpus of fuzz_daemon (tests/fuzz/corpus/): real sessions made of valid
 * frames (HELLO, PUBLISH with its fd, ATTACH, RELEASE, LIST, STAT, UNPUBLISH (1.11: also
 * conditional), WATCH, waiters, bundles; channels' SEND, RECV and CHANNEL (1.6); cacheable attaches, release marks and the
 * INVALIDATE a replace causes (1.7); direct channels, their JOIN (1.8); end of stream (1.10)) and
 * the classic bad ones (requests before HELLO, unknown types, wrong fd counts, fds split from their frame, truncated frames,
 * absurd lengths, bad storage fds).
 *
 *   mkcorpus DIR
 */
#include <stdbool.h>
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
	h.version_minor = DLPC_PROTO_MINOR;
	h.client = "mkcorpus";
	frame(in, DLPC_MSG_HELLO, 1, &h.base, 0, NULL, 0);
}

/* HELLO of @p minor: only DLPC_PROTO_MINOR is accepted. */
static void hello_minor(struct input *in, uint32_t minor)
{
	Dlpackd__V1__Hello h = DLPACKD__V1__HELLO__INIT;

	h.version_major = DLPC_PROTO_MAJOR;
	h.version_minor = minor;
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

/* CANCEL (1.9) of the wait of request @p which. */
static void cancel(struct input *in, uint32_t which)
{
	Dlpackd__V1__Cancel c = DLPACKD__V1__CANCEL__INIT;

	c.request_id = which;
	frame(in, DLPC_MSG_CANCEL, 0, &c.base, 0, NULL, 0);
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

/* UNPUBLISH of @p name only if it is @p generation created at @p created_ns (1.11). */
static void unpublish_if(struct input *in, uint32_t id, const char *name, uint64_t generation,
			 int64_t created_ns)
{
	Dlpackd__V1__Unpublish u = DLPACKD__V1__UNPUBLISH__INIT;

	u.name.data = (uint8_t *)name;
	u.name.len = strlen(name);
	u.generation = generation;
	u.created_ns = created_ns;
	frame(in, DLPC_MSG_UNPUBLISH, id, &u.base, 0, NULL, 0);
}

/* RELEASE of @p nref ids of @p refs, marking @p cached idle and @p used in use again (1.7). */
static void release_marks(struct input *in, uint64_t *refs, size_t nref, uint64_t *cached,
			  size_t ncached, uint64_t *used, size_t nused)
{
	Dlpackd__V1__Release r = DLPACKD__V1__RELEASE__INIT;

	r.n_ref_ids = nref;
	r.ref_ids = refs;
	r.n_cached_ids = ncached;
	r.cached_ids = cached;
	r.n_used_ids = nused;
	r.used_ids = used;
	frame(in, DLPC_MSG_RELEASE, 0, &r.base, 0, NULL, 0);
}

/* CHANNEL @p op (1 OPEN, 2 REMOVE, 3 STAT, 4 JOIN, 5 CLOSE, 6 PRODUCE, others bad) of channel
 * @p name, with @p flags (1.8: CHANNEL_DIRECT on OPEN; 1.10: CHANNEL_QUEUED, CLOSE_ALL). */
static void channel_flags(struct input *in, uint32_t id, uint32_t op, const char *name,
			  uint32_t capacity, uint32_t flags)
{
	Dlpackd__V1__Channel c = DLPACKD__V1__CHANNEL__INIT;

	c.op = op;
	c.name.data = (uint8_t *)name;
	c.name.len = strlen(name);
	c.capacity = capacity;
	c.flags = flags;
	frame(in, DLPC_MSG_CHANNEL, id, &c.base, 0, NULL, 0);
}

static void channel(struct input *in, uint32_t id, uint32_t op, const char *name, uint32_t capacity)
{
	channel_flags(in, id, op, name, capacity, 0);
}

/* What a SEND carries besides its channel: the message, its fd and whatever edit a seed makes. */
struct send_args {
	uint32_t flags;	    /* Send.flags (0 is the only valid) */
	uint32_t pub_flags; /* the message's PUBLISH flags */
	unsigned ntensors;  /* 1 to 4 */
	int64_t timeout_ms;
	uint64_t pool_token;
	const char *key; /* the first tensor's key (NULL: "" or "a") */
	size_t key_len;
	const char *msg_name; /* a name the message must not have */
	uint32_t device_type; /* 0: host */
	unsigned nfds;	      /* fds sent (the header declares 1) */
	uint8_t kind;
};

/* SEND to channel @p name of @p a's message. */
static void send_msg(struct input *in, uint32_t id, const char *name, const struct send_args *a)
{
	Dlpackd__V1__Send sr = DLPACKD__V1__SEND__INIT;
	Dlpackd__V1__Publish p = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc descs[4], *ptrs[4];
	int64_t shape[2] = {4, 4};
	static const char *const keys[4] = {"a", "b", "c", "d"};

	for (unsigned i = 0; i < a->ntensors; i++) {
		dlpackd__v1__tensor_desc__init(&descs[i]);
		descs[i].key.data = (uint8_t *)(a->ntensors > 1 ? keys[i] : "");
		descs[i].key.len = a->ntensors > 1 ? 1 : 0;
		descs[i].dtype_code = 2; /* kDLFloat */
		descs[i].dtype_bits = 32;
		descs[i].dtype_lanes = 1;
		descs[i].n_shape = 2;
		descs[i].shape = shape;
		descs[i].offset = (uint64_t)i * 256;
		ptrs[i] = &descs[i];
	}
	if (a->key) {
		descs[0].key.data = (uint8_t *)a->key;
		descs[0].key.len = a->key_len;
	}
	if (a->msg_name) {
		p.name.data = (uint8_t *)a->msg_name;
		p.name.len = strlen(a->msg_name);
	}
	p.flags = a->pub_flags;
	p.device_type = a->device_type ? a->device_type : 1; /* kDLCPU */
	p.storage_size = 4096;
	p.n_tensors = a->ntensors;
	p.tensors = ptrs;
	sr.channel.data = (uint8_t *)name;
	sr.channel.len = strlen(name);
	sr.flags = a->flags;
	sr.timeout_ms = a->timeout_ms;
	sr.message = &p;
	sr.pool_token = a->pool_token;
	frame(in, DLPC_MSG_SEND, id, &sr.base, 1, &a->kind, a->nfds);
}

/* SEND of one read-only tensor, failing at once if the channel is full. */
#define SEND_ONE (&(struct send_args){.ntensors = 1, .nfds = 1, .kind = FUZZ_FD_MEMFD_RO})

static void recv_msg(struct input *in, uint32_t id, const char *name, uint32_t flags,
		     int64_t timeout_ms)
{
	Dlpackd__V1__Recv r = DLPACKD__V1__RECV__INIT;

	r.channel.data = (uint8_t *)name;
	r.channel.len = strlen(name);
	r.flags = flags;
	r.timeout_ms = timeout_ms;
	frame(in, DLPC_MSG_RECV, id, &r.base, 0, NULL, 0);
}

static void list_channels(struct input *in, uint32_t id, const char *prefix)
{
	Dlpackd__V1__List l = DLPACKD__V1__LIST__INIT;

	l.prefix.data = (uint8_t *)prefix;
	l.prefix.len = strlen(prefix);
	l.channels = true;
	frame(in, DLPC_MSG_LIST, id, &l.base, 0, NULL, 0);
}

/* WATCH of @p len bytes of @p prefix: the connection then only receives events. */
static void watch(struct input *in, uint32_t id, const char *prefix, size_t len)
{
	Dlpackd__V1__Watch w = DLPACKD__V1__WATCH__INIT;

	w.prefix.data = (uint8_t *)prefix;
	w.prefix.len = len;
	frame(in, DLPC_MSG_WATCH, id, &w.base, 0, NULL, 0);
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
	/* (1.11) conditional UNPUBLISH: another generation and another creation refused (ESTALE),
	 * then the replacing generation removed */
	SEED("unpublish-if", {
		hello(&in, DLPC_PROTO_MAJOR);
		publish(&in, 2, "u", 0, 1, ro);
		unpublish_if(&in, 3, "u", 2, 0);
		unpublish_if(&in, 4, "u", 1, 1);
		publish(&in, 5, "u", DLPC_PUBLISH_REPLACE, 1, ro);
		unpublish_if(&in, 6, "u", 1, 0);
		unpublish_if(&in, 7, "u", 2, 0);
		unpublish_if(&in, 8, "u", 2, 0);
	});
	SEED("bundle-writable", {
		hello(&in, DLPC_PROTO_MAJOR);
		publish(&in, 2, "b", DLPC_PUBLISH_WRITABLE, 3, rw);
		attach(&in, 3, "b", DLPC_ATTACH_WRITABLE, 0);
		attach(&in, 4, "b", DLPC_WIRE_ATTACH_SINGLE, 0);
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
	/* ---- channels (1.6): SEND (9), RECV (10), CHANNEL (11) ---- */
	SEED("channel", {
		hello_minor(&in, DLPC_PROTO_MINOR);
		channel(&in, 2, 1, "c", 2);
		channel(&in, 3, 1, "c", 0);
		send_msg(&in, 4, "c", SEND_ONE);
		send_msg(&in, 5, "c",
			 &(struct send_args){.ntensors = 3,
					     .pub_flags = DLPC_PUBLISH_WRITABLE,
					     .nfds = 1,
					     .kind = rw});
		send_msg(&in, 6, "c", SEND_ONE); /* full: EAGAIN */
		channel(&in, 7, 3, "c", 0);
		list_channels(&in, 8, "");
		recv_msg(&in, 9, "c", 0, 0);
		recv_msg(&in, 10, "c", DLPC_WIRE_ATTACH_SINGLE, 0); /* a bundle: refused, kept */
		recv_msg(&in, 11, "c", 0, 0);
		recv_msg(&in, 12, "c", 0, 0); /* empty: EAGAIN */
		release(&in, 1);
		release(&in, 2);
		channel(&in, 13, 2, "c", 0);
		stat_req(&in, 14);
	});
	SEED("channel-waits", {
		/* a RECV that waits and is answered, one that expires, a SEND that waits for
		 * room, one that expires, a remove that ends the waiting ones */
		hello_minor(&in, DLPC_PROTO_MINOR);
		channel(&in, 2, 1, "w", 1);
		recv_msg(&in, 3, "w", 0, -1);
		send_msg(&in, 4, "w", SEND_ONE);
		recv_msg(&in, 5, "w", 0, 1);
		chunk(&in, FUZZ_WAIT | FUZZ_RUN, NULL, 0, NULL, 0);
		send_msg(&in, 6, "w", SEND_ONE);
		send_msg(&in, 7, "w",
			 &(struct send_args){
				 .ntensors = 1, .timeout_ms = -1, .nfds = 1, .kind = ro});
		send_msg(
			&in, 8, "w",
			&(struct send_args){.ntensors = 1, .timeout_ms = 1, .nfds = 1, .kind = ro});
		chunk(&in, FUZZ_WAIT | FUZZ_RUN, NULL, 0, NULL, 0);
		recv_msg(&in, 9, "w", 0, 0);
		channel(&in, 10, 1, "e", 0);
		recv_msg(&in, 11, "e", 0, -1);
		send_msg(&in, 12, "w",
			 &(struct send_args){
				 .ntensors = 1, .timeout_ms = -1, .nfds = 1, .kind = ro});
		channel(&in, 13, 2, "w", 0);
		channel(&in, 14, 2, "e", 0);
	});
	/* ---- CANCEL (1.9): waits the client gave up on, and ids that wait no more ---- */
	SEED("cancel", {
		hello_minor(&in, DLPC_PROTO_MINOR);
		attach(&in, 2, "never", 0, -1);
		attach(&in, 3, "never", 0, 1000);
		channel(&in, 4, 1, "w", 1);
		recv_msg(&in, 5, "w", 0, -1);
		send_msg(&in, 6, "w", SEND_ONE);
		send_msg(&in, 7, "w", SEND_ONE);
		send_msg(&in, 8, "w",
			 &(struct send_args){
				 .ntensors = 1, .timeout_ms = -1, .nfds = 1, .kind = ro});
		cancel(&in, 3);
		cancel(&in, 8);
		cancel(&in, 5); /* answered already */
		cancel(&in, 99);
		cancel(&in, 2);
		cancel(&in, 2);
		stat_req(&in, 9);
		channel(&in, 10, 2, "w", 0);
	});
	SEED("channel-hangup", {
		/* the connection ends with a RECV and a SEND waiting and messages queued */
		hello_minor(&in, DLPC_PROTO_MINOR);
		channel(&in, 2, 1, "h", 1);
		channel(&in, 3, 1, "r", 0);
		send_msg(&in, 4, "h", SEND_ONE);
		send_msg(&in, 5, "h",
			 &(struct send_args){
				 .ntensors = 2, .timeout_ms = -1, .nfds = 1, .kind = ro});
		recv_msg(&in, 6, "r", 0, -1);
		chunk(&in, FUZZ_SHUTDOWN | FUZZ_RUN, NULL, 0, NULL, 0);
	});
	SEED("channel-direct", {
		/* (1.8) a direct channel: opened, joined (its two ends come with the reply),
		 * described, listed; SEND and RECV on it refused (EPROTOTYPE), a JOIN of a queued
		 * one too; the other kind refused (EEXIST), unknown flags; removed */
		hello_minor(&in, DLPC_PROTO_MINOR);
		channel_flags(&in, 2, 1, "d", 4, DLPC_CHANNEL_DIRECT);
		channel_flags(&in, 3, 1, "d", 0, DLPC_CHANNEL_DIRECT);
		channel_flags(&in, 4, 1, "d", 0, 0);
		channel_flags(&in, 5, 1, "x", 0, 2);
		channel(&in, 6, 4, "d", 0);
		channel(&in, 7, 3, "d", 0);
		list_channels(&in, 8, "");
		send_msg(&in, 9, "d", SEND_ONE);
		recv_msg(&in, 10, "d", 0, 0);
		channel(&in, 11, 1, "q", 0);
		channel(&in, 12, 4, "q", 0);
		channel(&in, 13, 4, "none", 0);
		channel(&in, 14, 2, "d", 0);
		channel(&in, 15, 2, "q", 0);
		stat_req(&in, 16);
	});
	SEED("channel-end", {
		/* (1.10) end of stream: a RECV waiting woken by the producer's CLOSE, a queued
		 * message received after the end, SEND after it refused; PRODUCE and CLOSE of a
		 * direct channel (its sending end shut), close-all, bad flags and producers */
		hello_minor(&in, DLPC_PROTO_MINOR);
		channel(&in, 2, 1, "e", 4);
		recv_msg(&in, 3, "e", 0, -1);
		channel(&in, 4, 6, "e", 0);
		channel(&in, 5, 5, "e", 0);
		channel(&in, 6, 1, "e2", 2);
		send_msg(&in, 7, "e2", SEND_ONE);
		channel(&in, 8, 5, "e2", 0);
		channel(&in, 9, 5, "e2", 0);
		send_msg(&in, 10, "e2", SEND_ONE);
		recv_msg(&in, 11, "e2", 0, 0);
		recv_msg(&in, 12, "e2", 0, 0);
		channel_flags(&in, 13, 1, "d", 0, DLPC_CHANNEL_DIRECT);
		channel(&in, 14, 6, "d", 0);
		channel(&in, 15, 4, "d", 0);
		channel_flags(&in, 16, 5, "d", 0, DLPC_CHANNEL_CLOSE_ALL);
		channel(&in, 17, 6, "d", 0);
		channel_flags(&in, 18, 5, "e2", 0, 8);
		channel_flags(&in, 19, 1, "q", 0, DLPC_CHANNEL_QUEUED);
		channel_flags(&in, 20, 1, "q", 0, DLPC_CHANNEL_QUEUED | DLPC_CHANNEL_DIRECT);
		channel_flags(&in, 21, 1, "d", 0, DLPC_CHANNEL_QUEUED);
		channel(&in, 22, 4, "q", 0);
		channel(&in, 23, 6, "none", 0);
		channel(&in, 24, 1, "e2", 0);
		channel(&in, 25, 3, "e2", 0);
		channel(&in, 26, 2, "e2", 0);
		chunk(&in, FUZZ_SHUTDOWN | FUZZ_RUN, NULL, 0, NULL, 0);
	});
	SEED("channel-direct-hangup", {
		/* the connection ends with a direct channel open and joined */
		hello_minor(&in, DLPC_PROTO_MINOR);
		channel_flags(&in, 2, 1, "dh", 1, DLPC_CHANNEL_DIRECT);
		channel(&in, 3, 4, "dh", 0);
		chunk(&in, FUZZ_SHUTDOWN | FUZZ_RUN, NULL, 0, NULL, 0);
	});
	SEED("channel-pooled", {
		/* a pooled message: received, released, its token told back (RECLAIM) */
		hello_minor(&in, DLPC_PROTO_MINOR);
		channel(&in, 2, 1, "p", 4);
		send_msg(&in, 3, "p",
			 &(struct send_args){.ntensors = 1,
					     .pub_flags = DLPC_PUBLISH_WRITABLE,
					     .pool_token = (1ull << 63) | 1,
					     .nfds = 1,
					     .kind = rw});
		send_msg(&in, 4, "p",
			 &(struct send_args){.ntensors = 1,
					     .pool_token = 2,
					     .nfds = 1,
					     .kind = ro}); /* not WRITABLE: EINVAL */
		recv_msg(&in, 5, "p", 0, 0);
		release(&in, 1);
		stat_req(&in, 6);
		channel(&in, 7, 2, "p", 0);
	});
	SEED("channel-refused", {
		/* refused requests that leave the connection up: bad channel names and ops, a
		 * message with a name, flags, a device, bad keys, a bad storage; no channel */
		static char long_key[DLPC_KEY_MAX + 1];

		memset(long_key, 'k', sizeof(long_key));
		hello(&in, DLPC_PROTO_MAJOR);
		channel(&in, 2, 1, "", 0);
		channel(&in, 3, 9, "c", 0);
		channel(&in, 4, 1, "c", DLPC_CHANNEL_CAPACITY_MAX + 1);
		channel(&in, 5, 1, "c", 1);
		channel(&in, 6, 1, "c", 2); /* exists with another capacity */
		channel(&in, 7, 3, "none", 0);
		channel(&in, 8, 2, "none", 0);
		send_msg(&in, 9, "", SEND_ONE);
		send_msg(&in, 10, "none", SEND_ONE);
		send_msg(&in, 11, "c",
			 &(struct send_args){.ntensors = 1, .flags = 4, .nfds = 1, .kind = ro});
		send_msg(
			&in, 12, "c",
			&(struct send_args){.ntensors = 1, .msg_name = "x", .nfds = 1, .kind = ro});
		send_msg(&in, 13, "c",
			 &(struct send_args){
				 .ntensors = 1, .device_type = 2, .nfds = 1, .kind = ro});
		send_msg(
			&in, 14, "c",
			&(struct send_args){
				.ntensors = 2, .key = "a\0b", .key_len = 3, .nfds = 1, .kind = ro});
		send_msg(&in, 15, "c",
			 &(struct send_args){.ntensors = 2,
					     .key = long_key,
					     .key_len = sizeof(long_key),
					     .nfds = 1,
					     .kind = ro});
		send_msg(&in, 16, "c",
			 &(struct send_args){.ntensors = 2,
					     .key = "b",
					     .key_len = 1,
					     .nfds = 1,
					     .kind = ro}); /* "b" twice */
		send_msg(&in, 17, "c",
			 &(struct send_args){
				 .ntensors = 1, .nfds = 1, .kind = FUZZ_FD_MEMFD_NOSEAL});
		send_msg(&in, 18, "c",
			 &(struct send_args){.ntensors = 1, .nfds = 1, .kind = FUZZ_FD_PIPE});
		recv_msg(&in, 19, "c", 1, 0);
		recv_msg(&in, 20, "none", 0, 0);
		recv_msg(&in, 21, "", 0, 0);
		channel(&in, 22, 2, "c", 0);
		stat_req(&in, 23);
	});
	SEED("send-no-fd", {
		hello_minor(&in, DLPC_PROTO_MINOR);
		channel(&in, 2, 1, "c", 0);
		send_msg(&in, 3, "c", &(struct send_args){.ntensors = 1, .nfds = 0});
	});
	SEED("send-two-fds", {
		static const uint8_t two[2] = {FUZZ_FD_MEMFD_RO, FUZZ_FD_MEMFD_RO};
		Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;

		hello_minor(&in, DLPC_PROTO_MINOR);
		channel(&in, 2, 1, "c", 0);
		/* SEND's header declaring two fds: a violation before its payload is parsed */
		frame(&in, DLPC_MSG_SEND, 3, &st.base, 2, two, 2);
	});
	SEED("recv-with-fd", {
		hello_minor(&in, DLPC_PROTO_MINOR);
		channel(&in, 2, 1, "c", 0);
		send_msg(&in, 3, "c", SEND_ONE);
		{
			Dlpackd__V1__Recv r = DLPACKD__V1__RECV__INIT;

			r.channel.data = (uint8_t *)"c";
			r.channel.len = 1;
			frame(&in, DLPC_MSG_RECV, 4, &r.base, 1, &ro, 1);
		}
	});
	SEED("channel-before-hello", channel(&in, 1, 1, "c", 0));

	/* ---- the client's cache (1.7): cacheable attaches, release marks, INVALIDATE ---- */
	SEED("cache", {
		uint64_t one = 1, two = 2;

		hello_minor(&in, DLPC_PROTO_MINOR);
		publish(&in, 2, "k", 0, 1, ro);
		attach(&in, 3, "k", DLPC_WIRE_ATTACH_CACHEABLE, 0);
		attach(&in, 4, "k", DLPC_WIRE_ATTACH_CACHEABLE | DLPC_WIRE_ATTACH_SINGLE, 0);
		release_marks(&in, NULL, 0, &one, 1, NULL, 0);
		list(&in, 5, "", 0);
		stat_req(&in, 6);
		release_marks(&in, NULL, 0, NULL, 0, &one, 1);
		release_marks(&in, &two, 1, &one, 1, NULL, 0);	   /* marks, then the release */
		release_marks(&in, NULL, 0, &two, 1, &two, 1);	   /* unknown ids: skipped */
		publish(&in, 7, "k", DLPC_PUBLISH_REPLACE, 1, ro); /* INVALIDATE, then the reply */
		attach(&in, 8, "k", DLPC_WIRE_ATTACH_CACHEABLE, 0);
		unpublish(&in, 9, "k"); /* INVALIDATE again */
		release(&in, 1);
		stat_req(&in, 10);
	});
	SEED("cache-ephemeral", {
		/* the ephemeral publisher's entry goes with its connection, cached or not */
		hello_minor(&in, DLPC_PROTO_MINOR);
		publish(&in, 2, "e", DLPC_PUBLISH_EPHEMERAL, 2, ro);
		attach(&in, 3, "e", DLPC_WIRE_ATTACH_CACHEABLE, 0);
		attach(&in, 4, "e", DLPC_WIRE_ATTACH_CACHEABLE, 0);
	});
	SEED("cache-unread", {
		/* the client reads nothing while its cacheable references' entry is replaced:
		 * the INVALIDATE may not fit the socket whole, which drops the connection */
		hello_minor(&in, DLPC_PROTO_MINOR);
		publish(&in, 2, "u", 0, 4, ro);
		frame_flags = FUZZ_RUN | FUZZ_HOLD;
		for (uint32_t id = 3; id < 40; id++)
			attach(&in, id, "u", DLPC_WIRE_ATTACH_CACHEABLE, 0);
		publish(&in, 40, "u", DLPC_PUBLISH_REPLACE, 4, ro);
		frame_flags = FUZZ_RUN;
		stat_req(&in, 41);
	});
	SEED("version-minor-mismatch", {
		/* another minor is refused like another major: ERROR and the connection ends */
		hello_minor(&in, DLPC_PROTO_MINOR - 1);
		publish(&in, 2, "o", 0, 1, ro);
	});
	SEED("marks-too-many", {
		/* the three lists together count against the 1024 ids of a RELEASE */
		static uint64_t ids[600];

		for (size_t i = 0; i < 600; i++)
			ids[i] = i + 1;
		hello_minor(&in, DLPC_PROTO_MINOR);
		release_marks(&in, NULL, 0, ids, 600, ids, 600);
	});
	SEED("invalidate-to-daemon", {
		/* INVALIDATE travels only from the daemon: sent to it, an unknown type */
		Dlpackd__V1__Invalidate iv = DLPACKD__V1__INVALIDATE__INIT;

		hello_minor(&in, DLPC_PROTO_MINOR);
		iv.name.data = (uint8_t *)"k";
		iv.name.len = 1;
		iv.generation = 1;
		frame(&in, DLPC_MSG_INVALIDATE, 0, &iv.base, 0, NULL, 0);
	});
	/* WATCH: a watching connection sends nothing but RELEASE; a prefix has at most 255
	 * bytes; not before HELLO, nor twice */
	SEED("watch", {
		hello_minor(&in, DLPC_PROTO_MINOR);
		publish(&in, 2, "m/w", 0, 1, ro);
		attach(&in, 3, "m/w", 0, 0);
		watch(&in, 4, "m/", 2);
		release(&in, 1);
		stat_req(&in, 5);
	});
	SEED("watch-twice", {
		hello_minor(&in, DLPC_PROTO_MINOR);
		watch(&in, 2, "", 0);
		watch(&in, 3, "x", 1);
	});
	SEED("watch-prefix-long", {
		static char prefix[300];

		memset(prefix, 'p', sizeof(prefix));
		hello_minor(&in, DLPC_PROTO_MINOR);
		watch(&in, 2, prefix, sizeof(prefix));
		stat_req(&in, 3);
	});
	SEED("watch-before-hello", watch(&in, 1, "", 0));
	SEED("garbage", chunk(&in, FUZZ_RUN, NULL, 0, "GET / HTTP/1.1\r\n\r\n", 18));
	return 0;
}
