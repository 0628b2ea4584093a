/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The tensor table of an ATTACH reply: every tensor description of an entry in one flat byte
 * string, so that attaching a bundle decodes a few fixed-width fields per tensor instead of a
 * protobuf message each. All integers little-endian:
 *
 *   u32 count
 *   count records of:
 *     u8 dtype_code, u8 dtype_bits, u16 dtype_lanes, u8 ndim, u8 key_len, u16 zero,
 *     u64 offset, shape: ndim extents as unsigned LEB128 varints, key bytes (key_len)
 *
 * Extents are varints so that the widest entry the daemon accepts (DLPC_BUNDLE_MAX tensors of
 * DLPC_NDIM_MAX extents and DLPC_KEY_MAX-byte keys) still fits one reply frame.
 *
 * The daemon encodes it once per entry, at publish; docs/protocol.md is the contract.
 */
#ifndef DLPC_PROTO_TABLE_H
#define DLPC_PROTO_TABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <dlpc/dlpack1.h>

#include "dlpackd.pb-c.h"
#include "limits.h"

/* Bytes of a record's fixed part, before its shape and key. */
#define DLPC_TABLE_REC_FIXED 16

/* Bytes of the table of @p n checked descriptions (dtype fields, ndim and key within limits). */
size_t dlpc__table_size(Dlpackd__V1__TensorDesc *const *t, size_t n);
/* Write that table to @p out, which holds dlpc__table_size() bytes. */
void dlpc__table_encode(Dlpackd__V1__TensorDesc *const *t, size_t n, uint8_t *out);

/* One decoded record. @p key points into the table. */
struct dlpc__table_rec {
	DLDataType dtype;
	int ndim;
	uint64_t offset;
	int64_t shape[DLPC_NDIM_MAX];
	const uint8_t *key;
	size_t key_len;
};

/* The table's tensor count, or -EPROTO if it is too short or counts more than DLPC_BUNDLE_MAX. */
int64_t dlpc__table_count(const uint8_t *p, size_t len);
/*
 * Decode the record at *@p pos (start at 4, past the count) into @p r and advance *@p pos.
 * 0, or -EPROTO for a record that runs past the end, has more than DLPC_NDIM_MAX dimensions,
 * an extent over INT64_MAX or in more than 10 bytes, a key over DLPC_KEY_MAX bytes or a
 * non-zero reserved field.
 */
int dlpc__table_next(const uint8_t *p, size_t len, size_t *pos, struct dlpc__table_rec *r);
/* Does the table hold a single tensor: one, under the key "" (one under a key is a bundle)? */
bool dlpc__table_single(const uint8_t *p, size_t len);

#endif
