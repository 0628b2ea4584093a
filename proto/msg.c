/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <stdlib.h>

#include "msg.h"

ssize_t dlpc__msg_frame(struct dlpc__scratch *s, uint16_t type, uint32_t id,
			const ProtobufCMessage *m, unsigned nfds)
{
	size_t len = protobuf_c_message_get_packed_size(m);
	struct dlpc__hdr h = {.len = (uint32_t)len, .type = type, .nfds = (uint8_t)nfds, .id = id};

	if (len > DLPC_FRAME_MAX)
		return -EMSGSIZE;
	if (s->cap < DLPC_FRAME_HDR_SIZE + len) {
		size_t cap = DLPC_FRAME_HDR_SIZE + len;
		uint8_t *p;

		cap = cap < 4096 ? 4096 : cap;
		p = realloc(s->p, cap);
		if (!p)
			return -ENOMEM;
		s->p = p;
		s->cap = cap;
	}
	dlpc__hdr_encode(s->p, &h);
	protobuf_c_message_pack(m, s->p + DLPC_FRAME_HDR_SIZE);
	return (ssize_t)(DLPC_FRAME_HDR_SIZE + len);
}

void dlpc__scratch_clear(struct dlpc__scratch *s)
{
	free(s->p);
	s->p = NULL;
	s->cap = 0;
}
