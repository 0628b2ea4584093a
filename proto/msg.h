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
void dlpc__scratch_clear(struct dlpc__scratch *s);

#endif
