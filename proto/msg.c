/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "msg.h"

ssize_t dlpc__msg_frame(struct dlpc__scratch *s, uint16_t type, uint32_t id,
			const ProtobufCMessage *m, unsigned nfds)
{
	return dlpc__msg_frame_at(s, 0, type, id, m, NULL, 0, nfds);
}

ssize_t dlpc__msg_frame_tail(struct dlpc__scratch *s, uint16_t type, uint32_t id,
			     const ProtobufCMessage *m, const uint8_t *tail, size_t tail_len,
			     unsigned nfds)
{
	return dlpc__msg_frame_at(s, 0, type, id, m, tail, tail_len, nfds);
}

ssize_t dlpc__msg_frame_at(struct dlpc__scratch *s, size_t at, uint16_t type, uint32_t id,
			   const ProtobufCMessage *m, const uint8_t *tail, size_t tail_len,
			   unsigned nfds)
{
	size_t head = protobuf_c_message_get_packed_size(m), len = head + tail_len;
	struct dlpc__hdr h = {.len = (uint32_t)len, .type = type, .nfds = (uint8_t)nfds, .id = id};
	uint8_t *f;

	if (len > DLPC_FRAME_MAX)
		return -EMSGSIZE;
	if (s->cap < at + DLPC_FRAME_HDR_SIZE + len) {
		size_t cap = at + DLPC_FRAME_HDR_SIZE + len;
		uint8_t *p;

		cap = cap < 4096 ? 4096 : cap;
		p = realloc(s->p, cap);
		if (!p)
			return -ENOMEM;
		s->p = p;
		s->cap = cap;
	}
	f = s->p + at;
	dlpc__hdr_encode(f, &h);
	protobuf_c_message_pack(m, f + DLPC_FRAME_HDR_SIZE);
	if (tail_len)
		memcpy(f + DLPC_FRAME_HDR_SIZE + head, tail, tail_len);
	return (ssize_t)(at + DLPC_FRAME_HDR_SIZE + len);
}

struct dlpc__arena_chunk {
	struct dlpc__arena_chunk *next;
	size_t used, cap;
	max_align_t data[];
};

#define ARENA_CHUNK (64u << 10)

static void *arena_alloc(void *data, size_t size)
{
	struct dlpc__arena *a = data;
	struct dlpc__arena_chunk *c = a->chunks;

	size = (size + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
	if (!c || c->cap - c->used < size) {
		size_t cap = size > ARENA_CHUNK ? size : ARENA_CHUNK;

		c = malloc(sizeof(*c) + cap);
		if (!c)
			return NULL;
		c->used = 0;
		c->cap = cap;
		c->next = a->chunks;
		a->chunks = c;
	}
	c->used += size;
	return (char *)c->data + c->used - size;
}

static void arena_free(void *data, void *p)
{
	(void)data;
	(void)p; /* everything goes at dlpc__arena_clear() */
}

void dlpc__arena_init(struct dlpc__arena *a)
{
	a->chunks = NULL;
	a->alloc.alloc = arena_alloc;
	a->alloc.free = arena_free;
	a->alloc.allocator_data = a;
}

void dlpc__arena_clear(struct dlpc__arena *a)
{
	while (a->chunks) {
		struct dlpc__arena_chunk *c = a->chunks;

		a->chunks = c->next;
		free(c);
	}
}

void dlpc__scratch_clear(struct dlpc__scratch *s)
{
	free(s->p);
	s->p = NULL;
	s->cap = 0;
}
