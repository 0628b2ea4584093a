/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "frame.h"

static void put_le32(uint8_t *p, uint32_t v)
{
	p[0] = v;
	p[1] = v >> 8;
	p[2] = v >> 16;
	p[3] = v >> 24;
}

static uint32_t get_le32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

void dlpc__hdr_encode(uint8_t out[DLPC_FRAME_HDR_SIZE], const struct dlpc__hdr *h)
{
	put_le32(out, h->len);
	out[4] = h->type;
	out[5] = h->type >> 8;
	out[6] = h->nfds;
	out[7] = h->flags;
	put_le32(out + 8, h->id);
}

void dlpc__hdr_decode(const uint8_t in[DLPC_FRAME_HDR_SIZE], struct dlpc__hdr *h)
{
	h->len = get_le32(in);
	h->type = (uint16_t)(in[4] | in[5] << 8);
	h->nfds = in[6];
	h->flags = in[7];
	h->id = get_le32(in + 8);
}

int dlpc__hdr_check(const struct dlpc__hdr *h)
{
	if (h->len > DLPC_FRAME_MAX)
		return -EMSGSIZE;
	if (h->nfds > DLPC_FRAME_FDS_MAX || h->flags != 0)
		return -EPROTO;
	return 0;
}

const char *dlpc__msg_name(uint16_t type, char *buf, size_t len)
{
	static const char *const names[] = {
#define X(NAME, ...) [DLPC_MSG_##NAME] = #NAME,
		DLPC_REQUESTS(X)
#undef X
	};
	uint16_t base = type & ~DLPC_MSG_REPLY;

	if (type == DLPC_MSG_ERROR)
		snprintf(buf, len, "ERROR");
	else if (type == DLPC_MSG_EVENT)
		snprintf(buf, len, "EVENT");
	else if (type == DLPC_MSG_RECLAIM)
		snprintf(buf, len, "RECLAIM");
	else if (type == DLPC_MSG_INVALIDATE)
		snprintf(buf, len, "INVALIDATE");
	else if (base > 0 && base < DLPC_MSG__REQUEST_COUNT)
		snprintf(buf, len, "%s%s", names[base], type & DLPC_MSG_REPLY ? " reply" : "");
	else
		snprintf(buf, len, "type %u", type);
	return buf;
}
