/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A direct channel's record (protocol 1.8, docs/protocol.md 5.11). A direct channel is a
 * SOCK_SEQPACKET socket pair that dlpackd makes and hands to the processes that join it; each
 * message is one datagram of exactly DLPC_DIRECT_RECORD bytes with the storage's fd, kernel-
 * queued from sender to receiver without the daemon. All integers little-endian:
 *   u32 magic (DLPC_DIRECT_MAGIC), u16 version (1), u16 flags (0), u64 storage_size,
 *   u32 table_len, u32 zero, the tensor table (table.h) of table_len bytes, zeros to the end.
 * Records of one size let the daemon count a channel's messages from the bytes its socket
 * queues, and the kernel's accounting of one make a channel's capacity a number of messages.
 */
#ifndef DLPC_PROTO_DIRECT_H
#define DLPC_PROTO_DIRECT_H

#include <stddef.h>
#include <stdint.h>

#include "limits.h"

#define DLPC_DIRECT_MAGIC 0x43444c44u /* "DLDC" */
#define DLPC_DIRECT_VERSION 1
/* Bytes before the table. */
#define DLPC_DIRECT_HEADER 24
/* The longest tensor table a record carries. */
#define DLPC_DIRECT_TABLE_MAX (DLPC_DIRECT_RECORD - DLPC_DIRECT_HEADER)

/* Write the record of a message of @p storage_size bytes described by @p table into @p out.
 * -EMSGSIZE if the table is longer than DLPC_DIRECT_TABLE_MAX. */
int dlpc__direct_encode(uint8_t out[DLPC_DIRECT_RECORD], uint64_t storage_size,
			const uint8_t *table, size_t table_len);
/* Read the record @p rec of @p len bytes: 0 and its storage size and table (pointing into
 * @p rec), or -EBADMSG and what is wrong in @p why. The table itself is the caller's to check. */
int dlpc__direct_decode(const uint8_t *rec, size_t len, uint64_t *storage_size,
			const uint8_t **table, size_t *table_len, char *why, size_t whylen);

#endif
