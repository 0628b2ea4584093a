/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Writes the seed corpus of fuzz_daemon (tests/fuzz/corpus/): real sessions made of valid
 * frames (HELLO, PUBLISH with its fd, ATTACH, RELEASE, LIST, STAT, UNPUBLISH (1.11: also
 * conditional), WATCH, waiters, bundles; channels' SEND, RECV and CHANNEL (1.6); cacheable
 * attaches, release marks and the INVALIDATE a replace causes (1.7); direct channels, their JOIN
 * (1.8); end of stream (1.10)) and the classic bad ones (requests before HELLO, unknown types,
 * wrong fd counts, fds split from their frame, truncated frames, absurd lengths, bad storage
 * fds).
 *
 * One builder per request; a seed is a short sequence of them, or a table of cases where it
 * sends one request many ways.
 *
 *   mkcorpus DIR
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_daemon.h"
#include "msg.h"
#include "seed.h"

/* CHANNEL's operations (dlpackd.proto); 9 is none. */
enum { OPEN = 1, REMOVE, DESCRIBE, JOIN, CLOSE, PRODUCE, BAD_OP = 9 };

/* One chunk: @p len bytes sent with fds of the given kinds. */
static void chunk(struct input *in, unsigned flags, const uint8_t *kinds, unsigned nfds,
		  const void *data, size_t len)
{
	uint8_t ctl = (uint8_t)(flags | nfds),
		lens[2] = {(uint8_t)(len & 0xff), (uint8_t)(len >> 8)};

	seed_add(in, &ctl, 1);
	seed_add(in, kinds, nfds);
	seed_add(in, lens, 2);
	seed_add(in, data, len);
}

/* A chunk of no bytes with control bits @p flags only (wait, shut down, run). */
static void control(struct input *in, unsigned flags)
{
	chunk(in, flags, NULL, 0, NULL, 0);
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

/* A STAT frame, sent as frame type @p type declaring @p declared fds and carrying @p nfds. */
static void stat_as(struct input *in, uint16_t type, uint32_t id, unsigned declared,
		    const uint8_t *kinds, unsigned nfds)
{
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;

	frame(in, type, id, &st.base, declared, kinds, nfds);
}

static void stat_req(struct input *in, uint32_t id)
{
	stat_as(in, DLPC_MSG_STAT, id, 0, NULL, 0);
}

/* HELLO of version @p major.@p minor. */
static void hello_v(struct input *in, uint32_t major, uint32_t minor)
{
	Dlpackd__V1__Hello h = DLPACKD__V1__HELLO__INIT;

	h.version_major = major;
	h.version_minor = minor;
	h.client = "mkcorpus";
	frame(in, DLPC_MSG_HELLO, 1, &h.base, 0, NULL, 0);
}

/* HELLO of this build's version: the only one the daemon accepts. */
static void hello(struct input *in)
{
	hello_v(in, DLPC_PROTO_MAJOR, DLPC_PROTO_MINOR);
}

/* What a PUBLISH carries besides its name: the message, its fd and whatever edit a seed makes
 * (a SEND carries one too). */
struct msg_args {
	uint32_t flags;	    /* Send.flags (0 is the only valid) */
	uint32_t pub_flags; /* the message's PUBLISH flags */
	unsigned ntensors;  /* 1 to 4 */
	int64_t timeout_ms;
	uint64_t pool_token;
	const char *key; /* the first tensor's key (NULL: "" or "a") */
	size_t key_len;
	const char *msg_name; /* a SEND's message: a name it must not have */
	uint32_t device_type; /* 0: host */
	unsigned nfds;	      /* fds sent (the header declares 1) */
	uint8_t kind;
};

/* Fill @p p (and @p descs, @p ptrs, @p shape it points to) as @p a says, named @p name. */
static void message(Dlpackd__V1__Publish *p, Dlpackd__V1__TensorDesc *descs,
		    Dlpackd__V1__TensorDesc **ptrs, int64_t shape[2], const char *name,
		    const struct msg_args *a)
{
	shape[0] = shape[1] = 4;
	seed_tensors(descs, ptrs, a->ntensors, shape, 2, 32, 0);
	if (a->key) {
		descs[0].key.data = (uint8_t *)a->key;
		descs[0].key.len = a->key_len;
	}
	if (name) {
		p->name.data = (uint8_t *)name;
		p->name.len = strlen(name);
	}
	p->flags = a->pub_flags;
	p->device_type = a->device_type ? a->device_type : 1; /* kDLCPU */
	p->storage_size = 4096;
	p->n_tensors = a->ntensors;
	p->tensors = ptrs;
}

/* PUBLISH of @p ntensors float32 tensors of 16 elements with one fd of kind @p kind. */
static void publish(struct input *in, uint32_t id, const char *name, uint32_t flags,
		    unsigned ntensors, uint8_t kind)
{
	Dlpackd__V1__Publish p = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc descs[SEED_TENSORS_MAX], *ptrs[SEED_TENSORS_MAX];
	int64_t shape[2];

	message(&p, descs, ptrs, shape, name,
		&(struct msg_args){.pub_flags = flags, .ntensors = ntensors});
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

/* ATTACHes @p first to @p last - 1 of @p name, sent without reading the replies (they pile up
 * in the daemon's send queue: its socket buffer is small). */
static void unread_attaches(struct input *in, uint32_t first, uint32_t last, const char *name,
			    uint32_t flags)
{
	frame_flags = FUZZ_RUN | FUZZ_HOLD;
	for (uint32_t id = first; id < last; id++)
		attach(in, id, name, flags, 0);
}

/* CANCEL (1.9) of the wait of request @p which. */
static void cancel(struct input *in, uint32_t which)
{
	Dlpackd__V1__Cancel c = DLPACKD__V1__CANCEL__INIT;

	c.request_id = which;
	frame(in, DLPC_MSG_CANCEL, 0, &c.base, 0, NULL, 0);
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

static void release(struct input *in, uint64_t ref)
{
	release_marks(in, &ref, 1, NULL, 0, NULL, 0);
}

/* LIST of entries (or, @p channels, of channels) named from @p prefix. */
static void list(struct input *in, uint32_t id, const char *prefix, uint32_t limit, bool channels)
{
	Dlpackd__V1__List l = DLPACKD__V1__LIST__INIT;

	l.prefix.data = (uint8_t *)prefix;
	l.prefix.len = strlen(prefix);
	l.limit = limit;
	l.channels = channels;
	frame(in, DLPC_MSG_LIST, id, &l.base, 0, NULL, 0);
}

/* UNPUBLISH of @p name; only if it is @p generation created at @p created_ns where they are not
 * 0 (1.11). */
static void unpublish(struct input *in, uint32_t id, const char *name, uint64_t generation,
		      int64_t created_ns)
{
	Dlpackd__V1__Unpublish u = DLPACKD__V1__UNPUBLISH__INIT;

	u.name.data = (uint8_t *)name;
	u.name.len = strlen(name);
	u.generation = generation;
	u.created_ns = created_ns;
	frame(in, DLPC_MSG_UNPUBLISH, id, &u.base, 0, NULL, 0);
}

/* One CHANNEL request: its operation (an op of the enum above, or another, bad one), channel,
 * capacity and flags (1.8: CHANNEL_DIRECT on OPEN; 1.10: CHANNEL_QUEUED, CLOSE_ALL). */
struct chan_req {
	uint32_t op;
	const char *name;
	uint32_t capacity, flags;
};

static void channel_req(struct input *in, uint32_t id, const struct chan_req *r)
{
	Dlpackd__V1__Channel c = DLPACKD__V1__CHANNEL__INIT;

	c.op = r->op;
	c.name.data = (uint8_t *)r->name;
	c.name.len = strlen(r->name);
	c.capacity = r->capacity;
	c.flags = r->flags;
	frame(in, DLPC_MSG_CHANNEL, id, &c.base, 0, NULL, 0);
}

static void channel(struct input *in, uint32_t id, uint32_t op, const char *name, uint32_t capacity)
{
	channel_req(in, id, &(struct chan_req){op, name, capacity, 0});
}

/* The CHANNEL requests of table @p reqs, ids from @p id on; the next id. */
#define CHANNELS(in, id, ...)                                                                      \
	channels(in, id, (const struct chan_req[]){__VA_ARGS__},                                   \
		 sizeof((const struct chan_req[]){__VA_ARGS__}) / sizeof(struct chan_req))

static uint32_t channels(struct input *in, uint32_t id, const struct chan_req *reqs, size_t n)
{
	for (size_t i = 0; i < n; i++)
		channel_req(in, id++, &reqs[i]);
	return id;
}

/* SEND to channel @p name of @p a's message. */
static void send_msg(struct input *in, uint32_t id, const char *name, const struct msg_args *a)
{
	Dlpackd__V1__Send sr = DLPACKD__V1__SEND__INIT;
	Dlpackd__V1__Publish p = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc descs[SEED_TENSORS_MAX], *ptrs[SEED_TENSORS_MAX];
	int64_t shape[2];

	message(&p, descs, ptrs, shape, a->msg_name, a);
	sr.channel.data = (uint8_t *)name;
	sr.channel.len = strlen(name);
	sr.flags = a->flags;
	sr.timeout_ms = a->timeout_ms;
	sr.message = &p;
	sr.pool_token = a->pool_token;
	frame(in, DLPC_MSG_SEND, id, &sr.base, 1, &a->kind, a->nfds);
}

/* SEND of one read-only tensor, failing at once if the channel is full. */
#define SEND_ONE (&(struct msg_args){.ntensors = 1, .nfds = 1, .kind = FUZZ_FD_MEMFD_RO})
/* The same, waiting for room for ever. */
#define SEND_WAIT                                                                                  \
	(&(struct msg_args){.ntensors = 1, .timeout_ms = -1, .nfds = 1, .kind = FUZZ_FD_MEMFD_RO})

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

/* STAT frames of a wrong type or with the wrong fds, after a HELLO */
static const uint8_t seven_kinds[7] = {0, 1, 2, 3, 4, 5, 6};
static const struct {
	const char *name;
	uint16_t type;
	unsigned declared;
	const uint8_t *kinds;
	unsigned nfds;
} bad_stats[] = {
	{"unknown-type", 77, 0, NULL, 0},
	{"fds-undeclared", DLPC_MSG_STAT, 0, seven_kinds, 1}, /* one read-only memfd */
	{"fds-missing", DLPC_MSG_STAT, 1, NULL, 0},
	{"fds-too-many", DLPC_MSG_STAT, 4, seven_kinds, 7},
};

int main(int argc, char **argv)
{
	static struct input input;
	struct input *const in = &input;
	const char *dir;

	if (argc != 2) {
		fprintf(stderr, "usage: mkcorpus DIR\n");
		return 2;
	}
	dir = argv[1];

/* The seed @p name: what the statements after it send. SEED_UNREAD's client reads none of the
 * daemon's replies: every frame goes with FUZZ_HOLD (as the committed seeds have always had it). */
#define SEED_AS(name, flags, ...)                                                                  \
	do {                                                                                       \
		in->len = 0;                                                                       \
		frame_flags = (flags);                                                             \
		__VA_ARGS__;                                                                       \
		seed_save(dir, name, in);                                                          \
	} while (0)
#define SEED(name, ...) SEED_AS(name, FUZZ_RUN, __VA_ARGS__)
#define SEED_UNREAD(name, ...) SEED_AS(name, FUZZ_RUN | FUZZ_HOLD, __VA_ARGS__)

	SEED("hello", { hello(in); });
	SEED("hello-stat", {
		hello(in);
		stat_req(in, 2);
	});
	SEED("session", {
		hello(in);
		publish(in, 2, "m/w", 0, 1, FUZZ_FD_MEMFD_RO);
		attach(in, 3, "m/w", 0, 0);
		list(in, 4, "m/", 0, false);
		release(in, 1);
		unpublish(in, 5, "m/w", 0, 0);
		stat_req(in, 6);
	});
	/* (1.11) conditional UNPUBLISH: another generation and another creation refused (ESTALE),
	 * then the replacing generation removed */
	SEED("unpublish-if", {
		static const struct {
			uint64_t generation;
			int64_t created_ns;
		} tries[] = {{2, 0}, {1, 1}, {0, 0} /* the replace */, {1, 0}, {2, 0}, {2, 0}};

		hello(in);
		publish(in, 2, "u", 0, 1, FUZZ_FD_MEMFD_RO);
		for (uint32_t i = 0; i < sizeof(tries) / sizeof(tries[0]); i++)
			if (tries[i].generation)
				unpublish(in, 3 + i, "u", tries[i].generation, tries[i].created_ns);
			else
				publish(in, 3 + i, "u", DLPC_PUBLISH_REPLACE, 1, FUZZ_FD_MEMFD_RO);
	});
	SEED("bundle-writable", {
		hello(in);
		publish(in, 2, "b", DLPC_PUBLISH_WRITABLE, 3, FUZZ_FD_MEMFD_RW);
		attach(in, 3, "b", DLPC_WIRE_ATTACH_WRITABLE, 0);
		attach(in, 4, "b", DLPC_WIRE_ATTACH_SINGLE, 0);
		list(in, 5, "", 1, false);
	});
	SEED("replace-ephemeral", {
		hello(in);
		publish(in, 2, "x", DLPC_PUBLISH_EPHEMERAL, 1, FUZZ_FD_MEMFD_RO);
		attach(in, 3, "x", 0, 0);
		publish(in, 4, "x", DLPC_PUBLISH_REPLACE, 1, FUZZ_FD_MEMFD_RO);
		publish(in, 5, "x", 0, 1, FUZZ_FD_MEMFD_RO);
		release(in, 1);
	});
	SEED("waiter", {
		hello(in);
		attach(in, 2, "later", 0, -1);
		attach(in, 3, "later", 0, 1000);
		publish(in, 4, "later", 0, 1, FUZZ_FD_MEMFD_RO);
	});
	/* a PUBLISH with each kind of storage the daemon refuses, and a writable one of a sealed
	 * memfd */
	SEED("bad-storage", {
		static const uint8_t kinds[] = {FUZZ_FD_MEMFD_BARE, FUZZ_FD_MEMFD_NOSEAL,
						FUZZ_FD_PIPE,	    FUZZ_FD_FILE,
						FUZZ_FD_DEVNULL,    FUZZ_FD_SOCKET};
		char name[8];

		hello(in);
		for (uint32_t i = 0; i < sizeof(kinds); i++) {
			snprintf(name, sizeof(name), "s%u", i);
			publish(in, 2 + i, name, 0, 1, kinds[i]);
		}
		publish(in, 8, "s6", DLPC_PUBLISH_WRITABLE, 1, FUZZ_FD_MEMFD_RO);
	});
	SEED("before-hello", { stat_req(in, 1); });
	SEED("version-mismatch", { hello_v(in, 99, DLPC_PROTO_MINOR); });
	SEED("hello-twice", {
		hello(in);
		hello(in);
	});
	SEED("release-unknown", {
		hello(in);
		release(in, 12345);
	});
	for (size_t i = 0; i < sizeof(bad_stats) / sizeof(bad_stats[0]); i++)
		SEED(bad_stats[i].name, {
			hello(in);
			stat_as(in, bad_stats[i].type, 2, bad_stats[i].declared, bad_stats[i].kinds,
				bad_stats[i].nfds);
		});
	/* the header alone with the fd, the payload in a second sendmsg */
	SEED("fds-split", {
		static const uint8_t ro = FUZZ_FD_MEMFD_RO;
		Dlpackd__V1__Publish p = DLPACKD__V1__PUBLISH__INIT;
		struct dlpc__scratch s = {0};
		ssize_t len;

		hello(in);
		p.name.data = (uint8_t *)"split";
		p.name.len = 5;
		p.device_type = 1;
		p.storage_size = 4096;
		len = dlpc__msg_frame(&s, DLPC_MSG_PUBLISH, 2, &p.base, 1);
		chunk(in, FUZZ_RUN, NULL, 0, s.p, DLPC_FRAME_HDR_SIZE);
		chunk(in, FUZZ_RUN, &ro, 1, s.p + DLPC_FRAME_HDR_SIZE,
		      (size_t)len - DLPC_FRAME_HDR_SIZE);
		dlpc__scratch_clear(&s);
	});
	SEED("cut-short", {
		hello(in);
		raw_header(in, 100, DLPC_MSG_LIST, 0);
		chunk(in, FUZZ_SHUTDOWN, NULL, 0, "abc", 3);
	});
	SEED("len-max-plus-one", { raw_header(in, DLPC_FRAME_MAX + 1, DLPC_MSG_HELLO, 0); });
	SEED("len-2-32-minus-1", { raw_header(in, UINT32_MAX, DLPC_MSG_HELLO, 0); });
	SEED("not-protobuf", {
		raw_header(in, 8, DLPC_MSG_HELLO, 0);
		chunk(in, FUZZ_RUN, NULL, 0, "\xff\xff\xff\xff\xff\xff\xff\xff", 8);
	});
	/* attach replies (each with an fd) pile up in the daemon's send queue */
	SEED("unread-replies", {
		hello(in);
		publish(in, 2, "q", 0, 2, FUZZ_FD_MEMFD_RO);
		unread_attaches(in, 3, 40, "q", 0);
		list(in, 40, "", 0, false);
		frame_flags = FUZZ_RUN;
		stat_req(in, 41);
	});
	/* dropped with replies and their fds still queued */
	SEED("unread-then-violation", {
		hello(in);
		publish(in, 2, "q", 0, 1, FUZZ_FD_MEMFD_RO);
		unread_attaches(in, 3, 40, "q", 0);
		release(in, 999);
	});
	SEED_UNREAD("wait-expires", {
		hello(in);
		attach(in, 2, "never", 0, 1);
		control(in, FUZZ_WAIT | FUZZ_RUN);
		stat_req(in, 3);
	});
	/* ---- channels (1.6): SEND (9), RECV (10), CHANNEL (11) ---- */
	SEED_UNREAD("channel", {
		hello(in);
		channel(in, 2, OPEN, "c", 2);
		channel(in, 3, OPEN, "c", 0);
		send_msg(in, 4, "c", SEND_ONE);
		send_msg(in, 5, "c",
			 &(struct msg_args){.ntensors = 3,
					    .pub_flags = DLPC_PUBLISH_WRITABLE,
					    .nfds = 1,
					    .kind = FUZZ_FD_MEMFD_RW});
		send_msg(in, 6, "c", SEND_ONE); /* full: EAGAIN */
		channel(in, 7, DESCRIBE, "c", 0);
		list(in, 8, "", 0, true);
		recv_msg(in, 9, "c", 0, 0);
		recv_msg(in, 10, "c", DLPC_WIRE_ATTACH_SINGLE, 0); /* a bundle: refused, kept */
		recv_msg(in, 11, "c", 0, 0);
		recv_msg(in, 12, "c", 0, 0); /* empty: EAGAIN */
		release(in, 1);
		release(in, 2);
		channel(in, 13, REMOVE, "c", 0);
		stat_req(in, 14);
	});
	/* a RECV that waits and is answered, one that expires, a SEND that waits for room, one that
	 * expires, a remove that ends the waiting ones */
	SEED_UNREAD("channel-waits", {
		hello(in);
		channel(in, 2, OPEN, "w", 1);
		recv_msg(in, 3, "w", 0, -1);
		send_msg(in, 4, "w", SEND_ONE);
		recv_msg(in, 5, "w", 0, 1);
		control(in, FUZZ_WAIT | FUZZ_RUN);
		send_msg(in, 6, "w", SEND_ONE);
		send_msg(in, 7, "w", SEND_WAIT);
		send_msg(in, 8, "w",
			 &(struct msg_args){.ntensors = 1,
					    .timeout_ms = 1,
					    .nfds = 1,
					    .kind = FUZZ_FD_MEMFD_RO});
		control(in, FUZZ_WAIT | FUZZ_RUN);
		recv_msg(in, 9, "w", 0, 0);
		channel(in, 10, OPEN, "e", 0);
		recv_msg(in, 11, "e", 0, -1);
		send_msg(in, 12, "w", SEND_WAIT);
		channel(in, 13, REMOVE, "w", 0);
		channel(in, 14, REMOVE, "e", 0);
	});
	/* ---- CANCEL (1.9): waits the client gave up on, and ids that wait no more ---- */
	SEED_UNREAD("cancel", {
		static const uint32_t cancels[] = {3, 8, 5 /* answered already */, 99, 2, 2};

		hello(in);
		attach(in, 2, "never", 0, -1);
		attach(in, 3, "never", 0, 1000);
		channel(in, 4, OPEN, "w", 1);
		recv_msg(in, 5, "w", 0, -1);
		send_msg(in, 6, "w", SEND_ONE);
		send_msg(in, 7, "w", SEND_ONE);
		send_msg(in, 8, "w", SEND_WAIT);
		for (size_t i = 0; i < sizeof(cancels) / sizeof(cancels[0]); i++)
			cancel(in, cancels[i]);
		stat_req(in, 9);
		channel(in, 10, REMOVE, "w", 0);
	});
	/* the connection ends with a RECV and a SEND waiting and messages queued */
	SEED_UNREAD("channel-hangup", {
		hello(in);
		channel(in, 2, OPEN, "h", 1);
		channel(in, 3, OPEN, "r", 0);
		send_msg(in, 4, "h", SEND_ONE);
		send_msg(in, 5, "h",
			 &(struct msg_args){.ntensors = 2,
					    .timeout_ms = -1,
					    .nfds = 1,
					    .kind = FUZZ_FD_MEMFD_RO});
		recv_msg(in, 6, "r", 0, -1);
		control(in, FUZZ_SHUTDOWN | FUZZ_RUN);
	});
	/* (1.8) a direct channel: opened, joined (its two ends come with the reply), described,
	 * listed; SEND and RECV on it refused (EPROTOTYPE), a JOIN of a queued one too; the other
	 * kind refused (EEXIST), unknown flags; removed */
	SEED_UNREAD("channel-direct", {
		hello(in);
		CHANNELS(in, 2, {OPEN, "d", 4, DLPC_CHANNEL_DIRECT},
			 {OPEN, "d", 0, DLPC_CHANNEL_DIRECT}, {OPEN, "d", 0, 0}, {OPEN, "x", 0, 2},
			 {JOIN, "d", 0, 0}, {DESCRIBE, "d", 0, 0});
		list(in, 8, "", 0, true);
		send_msg(in, 9, "d", SEND_ONE);
		recv_msg(in, 10, "d", 0, 0);
		CHANNELS(in, 11, {OPEN, "q", 0, 0}, {JOIN, "q", 0, 0}, {JOIN, "none", 0, 0},
			 {REMOVE, "d", 0, 0}, {REMOVE, "q", 0, 0});
		stat_req(in, 16);
	});
	/* (1.10) end of stream: a RECV waiting woken by the producer's CLOSE, a queued message
	 * received after the end, SEND after it refused; PRODUCE and CLOSE of a direct channel (its
	 * sending end shut), close-all, bad flags and producers */
	SEED_UNREAD("channel-end", {
		hello(in);
		channel(in, 2, OPEN, "e", 4);
		recv_msg(in, 3, "e", 0, -1);
		CHANNELS(in, 4, {PRODUCE, "e", 0, 0}, {CLOSE, "e", 0, 0}, {OPEN, "e2", 2, 0});
		send_msg(in, 7, "e2", SEND_ONE);
		CHANNELS(in, 8, {CLOSE, "e2", 0, 0}, {CLOSE, "e2", 0, 0});
		send_msg(in, 10, "e2", SEND_ONE);
		recv_msg(in, 11, "e2", 0, 0);
		recv_msg(in, 12, "e2", 0, 0);
		CHANNELS(in, 13, {OPEN, "d", 0, DLPC_CHANNEL_DIRECT}, {PRODUCE, "d", 0, 0},
			 {JOIN, "d", 0, 0}, {CLOSE, "d", 0, DLPC_CHANNEL_CLOSE_ALL},
			 {PRODUCE, "d", 0, 0}, {CLOSE, "e2", 0, 8},
			 {OPEN, "q", 0, DLPC_CHANNEL_QUEUED},
			 {OPEN, "q", 0, DLPC_CHANNEL_QUEUED | DLPC_CHANNEL_DIRECT},
			 {OPEN, "d", 0, DLPC_CHANNEL_QUEUED}, {JOIN, "q", 0, 0},
			 {PRODUCE, "none", 0, 0}, {OPEN, "e2", 0, 0}, {DESCRIBE, "e2", 0, 0},
			 {REMOVE, "e2", 0, 0});
		control(in, FUZZ_SHUTDOWN | FUZZ_RUN);
	});
	/* (1.12) the default kind: PREFER_DIRECT makes a direct channel, opens an existing one as
	 * it is, falls back to queued for a capacity the direct kind cannot hold; refused beside
	 * a kind flag */
	SEED_UNREAD("channel-prefer-direct", {
		hello(in);
		CHANNELS(in, 2, {OPEN, "p", 0, DLPC_CHANNEL_PREFER_DIRECT},
			 {OPEN, "p", 0, DLPC_CHANNEL_PREFER_DIRECT},
			 {OPEN, "big", 1u << 20, DLPC_CHANNEL_PREFER_DIRECT},
			 {DESCRIBE, "big", 0, 0},
			 {OPEN, "x", 0, DLPC_CHANNEL_PREFER_DIRECT | DLPC_CHANNEL_DIRECT},
			 {OPEN, "y", 0, DLPC_CHANNEL_PREFER_DIRECT | DLPC_CHANNEL_QUEUED},
			 {JOIN, "p", 0, 0}, {REMOVE, "p", 0, 0});
		control(in, FUZZ_SHUTDOWN | FUZZ_RUN);
	});
	/* the connection ends with a direct channel open and joined */
	SEED_UNREAD("channel-direct-hangup", {
		hello(in);
		CHANNELS(in, 2, {OPEN, "dh", 1, DLPC_CHANNEL_DIRECT}, {JOIN, "dh", 0, 0});
		control(in, FUZZ_SHUTDOWN | FUZZ_RUN);
	});
	/* a pooled message: received, released, its token told back (RECLAIM) */
	SEED_UNREAD("channel-pooled", {
		hello(in);
		channel(in, 2, OPEN, "p", 4);
		send_msg(in, 3, "p",
			 &(struct msg_args){.ntensors = 1,
					    .pub_flags = DLPC_PUBLISH_WRITABLE,
					    .pool_token = (1ull << 63) | 1,
					    .nfds = 1,
					    .kind = FUZZ_FD_MEMFD_RW});
		send_msg(in, 4, "p",
			 &(struct msg_args){.ntensors = 1,
					    .pool_token = 2,
					    .nfds = 1,
					    .kind = FUZZ_FD_MEMFD_RO}); /* not WRITABLE: EINVAL */
		recv_msg(in, 5, "p", 0, 0);
		release(in, 1);
		stat_req(in, 6);
		channel(in, 7, REMOVE, "p", 0);
	});
	/* refused requests that leave the connection up: bad channel names and ops, a message with
	 * a name, flags, a device, bad keys, a bad storage; no channel */
	SEED_UNREAD("channel-refused", {
		static char long_key[DLPC_KEY_MAX + 1];
		const struct msg_args sends[] = {
			{.ntensors = 1, .flags = 4, .nfds = 1},
			{.ntensors = 1, .msg_name = "x", .nfds = 1},
			{.ntensors = 1, .device_type = 2, .nfds = 1},
			{.ntensors = 2, .key = "a\0b", .key_len = 3, .nfds = 1},
			{.ntensors = 2, .key = long_key, .key_len = sizeof(long_key), .nfds = 1},
			{.ntensors = 2, .key = "b", .key_len = 1, .nfds = 1}, /* "b" twice */
			{.ntensors = 1, .nfds = 1, .kind = FUZZ_FD_MEMFD_NOSEAL},
			{.ntensors = 1, .nfds = 1, .kind = FUZZ_FD_PIPE},
		};
		uint32_t id;

		memset(long_key, 'k', sizeof(long_key));
		hello(in);
		id = CHANNELS(in, 2, {OPEN, "", 0, 0}, {BAD_OP, "c", 0, 0},
			      {OPEN, "c", DLPC_CHANNEL_CAPACITY_MAX + 1, 0}, {OPEN, "c", 1, 0},
			      {OPEN, "c", 2, 0} /* exists with another capacity */,
			      {DESCRIBE, "none", 0, 0}, {REMOVE, "none", 0, 0});
		send_msg(in, id++, "", SEND_ONE);
		send_msg(in, id++, "none", SEND_ONE);
		for (size_t i = 0; i < sizeof(sends) / sizeof(sends[0]); i++)
			send_msg(in, id++, "c", &sends[i]);
		recv_msg(in, id++, "c", 1, 0);
		recv_msg(in, id++, "none", 0, 0);
		recv_msg(in, id++, "", 0, 0);
		channel(in, id++, REMOVE, "c", 0);
		stat_req(in, id);
	});
	SEED_UNREAD("send-no-fd", {
		hello(in);
		channel(in, 2, OPEN, "c", 0);
		send_msg(in, 3, "c", &(struct msg_args){.ntensors = 1, .nfds = 0});
	});
	/* SEND's header declaring two fds: a violation before its payload is parsed */
	SEED_UNREAD("send-two-fds", {
		static const uint8_t two[2] = {FUZZ_FD_MEMFD_RO, FUZZ_FD_MEMFD_RO};

		hello(in);
		channel(in, 2, OPEN, "c", 0);
		stat_as(in, DLPC_MSG_SEND, 3, 2, two, 2);
	});
	SEED_UNREAD("recv-with-fd", {
		static const uint8_t ro = FUZZ_FD_MEMFD_RO;
		Dlpackd__V1__Recv r = DLPACKD__V1__RECV__INIT;

		hello(in);
		channel(in, 2, OPEN, "c", 0);
		send_msg(in, 3, "c", SEND_ONE);
		r.channel.data = (uint8_t *)"c";
		r.channel.len = 1;
		frame(in, DLPC_MSG_RECV, 4, &r.base, 1, &ro, 1);
	});
	SEED_UNREAD("channel-before-hello", { channel(in, 1, OPEN, "c", 0); });
	/* ---- the client's cache (1.7): cacheable attaches, release marks, INVALIDATE ---- */
	SEED_UNREAD("cache", {
		uint64_t one = 1, two = 2;

		hello(in);
		publish(in, 2, "k", 0, 1, FUZZ_FD_MEMFD_RO);
		attach(in, 3, "k", DLPC_WIRE_ATTACH_CACHEABLE, 0);
		attach(in, 4, "k", DLPC_WIRE_ATTACH_CACHEABLE | DLPC_WIRE_ATTACH_SINGLE, 0);
		release_marks(in, NULL, 0, &one, 1, NULL, 0);
		list(in, 5, "", 0, false);
		stat_req(in, 6);
		release_marks(in, NULL, 0, NULL, 0, &one, 1);
		release_marks(in, &two, 1, &one, 1, NULL, 0); /* marks, then the release */
		release_marks(in, NULL, 0, &two, 1, &two, 1); /* unknown ids: skipped */
		publish(in, 7, "k", DLPC_PUBLISH_REPLACE, 1,
			FUZZ_FD_MEMFD_RO); /* INVALIDATE, the reply */
		attach(in, 8, "k", DLPC_WIRE_ATTACH_CACHEABLE, 0);
		unpublish(in, 9, "k", 0, 0); /* INVALIDATE again */
		release(in, 1);
		stat_req(in, 10);
	});
	/* the ephemeral publisher's entry goes with its connection, cached or not */
	SEED_UNREAD("cache-ephemeral", {
		hello(in);
		publish(in, 2, "e", DLPC_PUBLISH_EPHEMERAL, 2, FUZZ_FD_MEMFD_RO);
		attach(in, 3, "e", DLPC_WIRE_ATTACH_CACHEABLE, 0);
		attach(in, 4, "e", DLPC_WIRE_ATTACH_CACHEABLE, 0);
	});
	/* the client reads nothing while its cacheable references' entry is replaced: the
	 * INVALIDATE may not fit the socket whole, which drops the connection */
	SEED_UNREAD("cache-unread", {
		hello(in);
		publish(in, 2, "u", 0, 4, FUZZ_FD_MEMFD_RO);
		unread_attaches(in, 3, 40, "u", DLPC_WIRE_ATTACH_CACHEABLE);
		publish(in, 40, "u", DLPC_PUBLISH_REPLACE, 4, FUZZ_FD_MEMFD_RO);
		frame_flags = FUZZ_RUN;
		stat_req(in, 41);
	});
	/* another minor is refused like another major: ERROR and the connection ends */
	SEED("version-minor-mismatch", {
		hello_v(in, DLPC_PROTO_MAJOR, DLPC_PROTO_MINOR - 1);
		publish(in, 2, "o", 0, 1, FUZZ_FD_MEMFD_RO);
	});
	/* the three lists together count against the 1024 ids of a RELEASE */
	SEED("marks-too-many", {
		static uint64_t ids[600];

		for (size_t i = 0; i < 600; i++)
			ids[i] = i + 1;
		hello(in);
		release_marks(in, NULL, 0, ids, 600, ids, 600);
	});
	/* INVALIDATE travels only from the daemon: sent to it, an unknown type */
	SEED("invalidate-to-daemon", {
		Dlpackd__V1__Invalidate iv = DLPACKD__V1__INVALIDATE__INIT;

		hello(in);
		iv.name.data = (uint8_t *)"k";
		iv.name.len = 1;
		iv.generation = 1;
		frame(in, DLPC_MSG_INVALIDATE, 0, &iv.base, 0, NULL, 0);
	});
	/* WATCH: a watching connection sends nothing but RELEASE; a prefix has at most 255 bytes;
	 * not before HELLO, nor twice */
	SEED("watch", {
		hello(in);
		publish(in, 2, "m/w", 0, 1, FUZZ_FD_MEMFD_RO);
		attach(in, 3, "m/w", 0, 0);
		watch(in, 4, "m/", 2);
		release(in, 1);
		stat_req(in, 5);
	});
	SEED("watch-twice", {
		hello(in);
		watch(in, 2, "", 0);
		watch(in, 3, "x", 1);
	});
	SEED("watch-prefix-long", {
		static char prefix[300];

		memset(prefix, 'p', sizeof(prefix));
		hello(in);
		watch(in, 2, prefix, sizeof(prefix));
		stat_req(in, 3);
	});
	SEED("watch-before-hello", { watch(in, 1, "", 0); });
	SEED("garbage", { chunk(in, FUZZ_RUN, NULL, 0, "GET / HTTP/1.1\r\n\r\n", 18); });
	return 0;
}
