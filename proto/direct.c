/* SPDX-License-Identifier: Apache-2.0 */
/* A direct channel's record: direct.h has its layout. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "direct.h"

static void put16(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)v;
	p[1] = (uint8_t)(v >> 8);
}

static void put32(uint8_t *p, uint32_t v)
{
	put16(p, (uint16_t)v);
	put16(p + 2, (uint16_t)(v >> 16));
}

static uint16_t get16(const uint8_t *p)
{
	return (uint16_t)(p[0] | p[1] << 8);
}

static uint32_t get32(const uint8_t *p)
{
	return get16(p) | (uint32_t)get16(p + 2) << 16;
}

int dlpc__direct_encode(uint8_t out[DLPC_DIRECT_RECORD], uint64_t storage_size,
			const uint8_t *table, size_t table_len)
{
	if (table_len > DLPC_DIRECT_TABLE_MAX)
		return -EMSGSIZE;
	memset(out, 0, DLPC_DIRECT_RECORD);
	put32(out, DLPC_DIRECT_MAGIC);
	put16(out + 4, DLPC_DIRECT_VERSION);
	put32(out + 8, (uint32_t)storage_size);
	put32(out + 12, (uint32_t)(storage_size >> 32));
	put32(out + 16, (uint32_t)table_len);
	memcpy(out + DLPC_DIRECT_HEADER, table, table_len);
	return 0;
}

int dlpc__direct_decode(const uint8_t *rec, size_t len, uint64_t *storage_size,
			const uint8_t **table, size_t *table_len, char *why, size_t whylen)
{
	uint32_t tl;

	if (len != DLPC_DIRECT_RECORD) {
		snprintf(why, whylen, "a record of %zu bytes, not %d", len, DLPC_DIRECT_RECORD);
		return -EBADMSG;
	}
	if (get32(rec) != DLPC_DIRECT_MAGIC || get16(rec + 4) != DLPC_DIRECT_VERSION ||
	    get16(rec + 6) != 0 || get32(rec + 20) != 0) {
		snprintf(why, whylen, "not a record of version %d (magic 0x%08x, version %u)",
			 DLPC_DIRECT_VERSION, get32(rec), get16(rec + 4));
		return -EBADMSG;
	}
	tl = get32(rec + 16);
	if (tl > DLPC_DIRECT_TABLE_MAX) {
		snprintf(why, whylen, "a tensor table of %u bytes, over the %d a record holds", tl,
			 DLPC_DIRECT_TABLE_MAX);
		return -EBADMSG;
	}
	*storage_size = get32(rec + 8) | (uint64_t)get32(rec + 12) << 32;
	*table = rec + DLPC_DIRECT_HEADER;
	*table_len = tl;
	return 0;
}
