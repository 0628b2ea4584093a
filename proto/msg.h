/* SPDX-License-Identifier: Apache-2.0 */
/* Layer 3 helper shared by daemon and library: a protobuf-c message as a complete frame. */
#ifndef DLPC_PROTO_MSG_H
#define DLPC_PROTO_MSG_H

#include <protobuf-c/protobuf-c.h>
#include <sys/types.h>

#include "dlpackd.pb-c.h"
#include "frame.h"

/* A growable buffer reused for outgoing frames. */
struct dlpc__scratch {
	uint8_t *p;
	size_t cap;
};

/* Write header + packed @p m into @p s. Returns the frame's length, -EMSGSIZE or -ENOMEM. */
ssize_t dlpc__msg_frame(struct dlpc__scratch *s, uint16_t type, uint32_t id,
			const ProtobufCMessage *m, unsigned nfds);
/*
 * The same, with @p tail (already encoded fields of the same message) appended to the payload.
 * Protobuf fields may come in any order, so packed(m) + tail parses as one message.
 */
ssize_t dlpc__msg_frame_tail(struct dlpc__scratch *s, uint16_t type, uint32_t id,
			     const ProtobufCMessage *m, const uint8_t *tail, size_t tail_len,
			     unsigned nfds);

/*
 * The same, written at offset @p at of @p s (whose first @p at bytes are kept), so that several
 * frames can go out in one write. Returns @p at plus the frame's length, -EMSGSIZE or -ENOMEM.
 */
ssize_t dlpc__msg_frame_at(struct dlpc__scratch *s, size_t at, uint16_t type, uint32_t id,
			   const ProtobufCMessage *m, const uint8_t *tail, size_t tail_len,
			   unsigned nfds);

/*
 * A bump allocator for unpacking a message whose parts all die together: one malloc per
 * chunk instead of one per field. Unpack with dlpc__arena_allocator(), never free the message
 * itself; dlpc__arena_clear() frees everything.
 */
struct dlpc__arena {
	struct dlpc__arena_chunk *chunks;
	ProtobufCAllocator alloc;
};

void dlpc__arena_init(struct dlpc__arena *a);
void dlpc__arena_clear(struct dlpc__arena *a);
void dlpc__scratch_clear(struct dlpc__scratch *s);

#endif
