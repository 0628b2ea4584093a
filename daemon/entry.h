/* SPDX-License-Identifier: Apache-2.0 */
/* The checks and the encoding every entry goes through, published or restored (entry.c). */
#ifndef DLPD_ENTRY_H
#define DLPD_ENTRY_H

#include <stddef.h>
#include <stdint.h>

#include "dlpackd.pb-c.h"

/* Are the tensor descriptions of @p req sound (count, keys, dtypes, shapes, each within the
 * storage and aligned)? 0, or negative errno and the reason. */
int dlpd_entry_check_tensors(const Dlpackd__V1__Publish *req, char *why, size_t whylen);
/* Is @p fd acceptable storage for @p req: a sealed memfd for host memory, a driver export for
 * CUDA VMM (legacy CUDA IPC has none)? 0, or negative errno and the reason. */
int dlpd_entry_check_storage(const Dlpackd__V1__Publish *req, int fd, char *why, size_t whylen);
/* Fields this daemon does not know would be kept, one allocation each, for the entry's life:
 * free them. */
void dlpd_entry_drop_unknown_fields(Dlpackd__V1__Publish *req);
/* The descriptions as an ATTACH reply encodes them: its tensor_table field, tag and length
 * included (an AttachReply with only that field set packs to exactly those bytes). Every
 * ATTACH of the entry appends them instead of encoding anything. NULL on ENOMEM. */
uint8_t *dlpd_entry_encode_tensors(const Dlpackd__V1__Publish *req, size_t *len);

#endif
