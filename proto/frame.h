/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Layer 1: the frame header. A frame is this fixed little-endian header followed by `len` payload
 * bytes; its `nfds` file descriptors ride on the sendmsg() that carries the header's first byte.
 *
 *   offset size field
 *   0      4    len      payload bytes, <= DLPC_FRAME_MAX
 *   4      2    type     DLPC_MSG_*
 *   6      1    nfds     fds that belong to this frame, <= DLPC_FRAME_FDS_MAX
 *   7      1    flags    reserved, must be 0
 *   8      4    id       request id, echoed by the reply; 0 for RELEASE and for frames the
 *                          daemon sends of its own accord (EVENT, RECLAIM, errors below
 *                          dispatch)
 */
#ifndef DLPC_PROTO_FRAME_H
#define DLPC_PROTO_FRAME_H

#include <stdint.h>
#include "limits.h"

/*
 * Every request, in one table that the daemon's dispatch, frame naming (dlpc__msg_name()) and the
 * STAT counters read:
 *
 *   X(NAME, name, type, payload limit, fewest fds, most fds, before HELLO, while watching)
 *
 * NAME makes DLPC_MSG_NAME; name is the protobuf message (dlpackd__v1__<name>), the daemon's
 * handler (dlpd_on_<name>) and the STAT counter (req_<name>). The payload limit is checked before
 * anything is unpacked. "Before HELLO": allowed on a connection that has not completed HELLO;
 * "while watching": allowed on a connection that sent WATCH.
 */
#define DLPC_REQUESTS(X)                                                                           \
	X(HELLO, hello, 1, DLPC_SMALL_MSG_MAX, 0, 0, 1, 0)                                         \
	/* no fd for legacy CUDA IPC, one otherwise: the handler checks which */                   \
	X(PUBLISH, publish, 2, DLPC_FRAME_MAX, 0, 1, 0, 0)                                         \
	X(ATTACH, attach, 3, DLPC_SMALL_MSG_MAX, 0, 0, 0, 0)                                       \
	X(RELEASE, release, 4, DLPC_RELEASE_MSG_MAX, 0, 0, 0, 1)                                   \
	X(UNPUBLISH, unpublish, 5, DLPC_SMALL_MSG_MAX, 0, 0, 0, 0)                                 \
	X(LIST, list, 6, DLPC_SMALL_MSG_MAX, 0, 0, 0, 0)                                           \
	X(STAT, stat, 7, DLPC_SMALL_MSG_MAX, 0, 0, 0, 0)                                           \
	X(WATCH, watch, 8, DLPC_SMALL_MSG_MAX, 0, 0, 0, 0)                                         \
	/* protocol 1.6: channels */                                                               \
	X(SEND, send, 9, DLPC_FRAME_MAX, 1, 1, 0, 0)                                               \
	X(RECV, recv, 10, DLPC_SMALL_MSG_MAX, 0, 0, 0, 0)                                          \
	X(CHANNEL, channel, 11, DLPC_SMALL_MSG_MAX, 0, 0, 0, 0)                                    \
	/* protocol 1.9: a waiting request the client gave up on ends at once */                   \
	X(CANCEL, cancel, 12, DLPC_SMALL_MSG_MAX, 0, 0, 0, 1)

/* clang-format off */
enum dlpc_msg_type {
#define DLPC_X_ENUM(NAME, name, type, ...) DLPC_MSG_##NAME = type,
	DLPC_REQUESTS(DLPC_X_ENUM)
#undef DLPC_X_ENUM
	/* one past the last request type */
	DLPC_MSG__REQUEST_COUNT,
	/* A frame the daemon sends without a request (id 0): a watch event. */
	DLPC_MSG_EVENT = 0x4001,
	/* ...or a reclaim notice to a legacy CUDA IPC (1.2) or lent VMM (1.5) publisher (id 0). */
	DLPC_MSG_RECLAIM = 0x4002,
	/* ...or an invalidation of a client's cached references (1.7, id 0). */
	DLPC_MSG_INVALIDATE = 0x4004,
	/* A reply's type is its request's type with this bit set... */
	DLPC_MSG_REPLY = 0x8000,
	/* ...or exactly this, carrying an Error message. */
	DLPC_MSG_ERROR = 0x8000,
};
/* clang-format on */

/*
 * The flags of Attach.flags and Recv.flags on the wire (docs/protocol.md 5.2, 5.9): the only
 * attach flags the daemon knows. The public DLPC_ATTACH_* flags (dlpc/dlpc.h) are the library's
 * API; of them only WRITABLE and OWNER travel, with the same bits (checked below), and libdlpc
 * acts on the others itself. Bits 16 and up are the protocol's own, set by libdlpc.
 */
/* Map the storage writable: the entry must have been published writable. */
#define DLPC_WIRE_ATTACH_WRITABLE (1u << 0)
/* Only an entry published by Attach.owner_uid counts; another uid's under the name is absent. */
#define DLPC_WIRE_ATTACH_OWNER (1u << 4)
/* Refuse unless the entry (or message) holds exactly one tensor. */
#define DLPC_WIRE_ATTACH_SINGLE (1u << 16)
/* The client may keep the reference in its cache after its last use, so the daemon tells it
 * (INVALIDATE) when the entry's name moves on. */
#define DLPC_WIRE_ATTACH_CACHEABLE (1u << 17)
/* Every flag an ATTACH may carry, and a RECV; others are refused (EINVAL). */
#define DLPC_WIRE_ATTACH_FLAGS                                                                     \
	(DLPC_WIRE_ATTACH_WRITABLE | DLPC_WIRE_ATTACH_OWNER | DLPC_WIRE_ATTACH_SINGLE |            \
	 DLPC_WIRE_ATTACH_CACHEABLE)
#define DLPC_WIRE_RECV_FLAGS DLPC_WIRE_ATTACH_SINGLE
/* libdlpc sends these public flags as they are */
_Static_assert(DLPC_WIRE_ATTACH_WRITABLE == DLPC_ATTACH_WRITABLE,
	       "DLPC_ATTACH_WRITABLE travels as DLPC_WIRE_ATTACH_WRITABLE");
_Static_assert(DLPC_WIRE_ATTACH_OWNER == DLPC_ATTACH_OWNER,
	       "DLPC_ATTACH_OWNER travels as DLPC_WIRE_ATTACH_OWNER");

struct dlpc__hdr {
	uint32_t len;
	uint16_t type;
	uint8_t nfds;
	uint8_t flags;
	uint32_t id;
};

void dlpc__hdr_encode(uint8_t out[DLPC_FRAME_HDR_SIZE], const struct dlpc__hdr *h);
void dlpc__hdr_decode(const uint8_t in[DLPC_FRAME_HDR_SIZE], struct dlpc__hdr *h);
/* 0 if the header is acceptable, else -EMSGSIZE (len), -EPROTO (nfds, flags). */
int dlpc__hdr_check(const struct dlpc__hdr *h);
/* Name of a frame type for messages ("PUBLISH", "ATTACH reply", "type 77"). */
const char *dlpc__msg_name(uint16_t type, char *buf, size_t len);

#endif
