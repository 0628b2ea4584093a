/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <string.h>

#include "table.h"

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

static void put64(uint8_t *p, uint64_t v)
{
	put32(p, (uint32_t)v);
	put32(p + 4, (uint32_t)(v >> 32));
}

static uint16_t get16(const uint8_t *p)
{
	return (uint16_t)(p[0] | p[1] << 8);
}

static uint32_t get32(const uint8_t *p)
{
	return get16(p) | (uint32_t)get16(p + 2) << 16;
}

static uint64_t get64(const uint8_t *p)
{
	return get32(p) | (uint64_t)get32(p + 4) << 32;
}

static size_t varint_len(uint64_t v)
{
	size_t n = 1;

	while (v >= 0x80) {
		v >>= 7;
		n++;
	}
	return n;
}

size_t dlpc__table_size(Dlpackd__V1__TensorDesc *const *t, size_t n)
{
	size_t len = 4;

	for (size_t i = 0; i < n; i++) {
		len += DLPC_TABLE_REC_FIXED + t[i]->key.len;
		for (size_t k = 0; k < t[i]->n_shape; k++)
			len += varint_len((uint64_t)t[i]->shape[k]);
	}
	return len;
}

void dlpc__table_encode(Dlpackd__V1__TensorDesc *const *t, size_t n, uint8_t *out)
{
	put32(out, (uint32_t)n);
	out += 4;
	for (size_t i = 0; i < n; i++) {
		const Dlpackd__V1__TensorDesc *d = t[i];

		out[0] = (uint8_t)d->dtype_code;
		out[1] = (uint8_t)d->dtype_bits;
		put16(out + 2, (uint16_t)d->dtype_lanes);
		out[4] = (uint8_t)d->n_shape;
		out[5] = (uint8_t)d->key.len;
		put16(out + 6, 0);
		put64(out + 8, d->offset);
		out += DLPC_TABLE_REC_FIXED;
		for (size_t k = 0; k < d->n_shape; k++) {
			uint64_t v = (uint64_t)d->shape[k];

			for (; v >= 0x80; v >>= 7)
				*out++ = (uint8_t)(v | 0x80);
			*out++ = (uint8_t)v;
		}
		if (d->key.len)
			memcpy(out, d->key.data, d->key.len);
		out += d->key.len;
	}
}

int64_t dlpc__table_count(const uint8_t *p, size_t len)
{
	uint32_t n;

	if (len < 4)
		return -EPROTO;
	n = get32(p);
	return n > DLPC_BUNDLE_MAX ? -EPROTO : (int64_t)n;
}

int dlpc__table_next(const uint8_t *p, size_t len, size_t *pos, struct dlpc__table_rec *r)
{
	const uint8_t *q, *end = p + len;

	if (*pos > len || len - *pos < DLPC_TABLE_REC_FIXED)
		return -EPROTO;
	q = p + *pos;
	r->dtype.code = q[0];
	r->dtype.bits = q[1];
	r->dtype.lanes = get16(q + 2);
	r->ndim = q[4];
	r->key_len = q[5];
	if (r->ndim > DLPC_NDIM_MAX || r->key_len > DLPC_KEY_MAX || get16(q + 6) != 0)
		return -EPROTO;
	r->offset = get64(q + 8);
	q += DLPC_TABLE_REC_FIXED;
	for (int k = 0; k < r->ndim; k++) {
		uint64_t v = 0;
		unsigned shift = 0;

		for (;;) {
			if (q == end || (shift == 63 && *q > 1))
				return -EPROTO;
			v |= (uint64_t)(*q & 0x7f) << shift;
			if (!(*q++ & 0x80))
				break;
			shift += 7;
		}
		if (v > INT64_MAX)
			return -EPROTO;
		r->shape[k] = (int64_t)v;
	}
	if ((size_t)(end - q) < r->key_len)
		return -EPROTO;
	r->key = q;
	*pos = (size_t)(q + r->key_len - p);
	return 0;
}

bool dlpc__table_single(const uint8_t *p, size_t len)
{
	struct dlpc__table_rec r;
	size_t pos = 4;

	return dlpc__table_count(p, len) == 1 && dlpc__table_next(p, len, &pos, &r) == 0 &&
	       r.key_len == 0;
}
