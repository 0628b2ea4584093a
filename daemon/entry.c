/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What makes an entry sound: the checks and the encoding a PUBLISH and a restored entry
 * (persist.c) go through alike, so that state read back after a restart is trusted no more
 * than a client's request.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "entry.h"
#include "storage.h"
#include "table.h"
#include "util.h"

static int cmp_keys(const void *a, const void *b)
{
	const ProtobufCBinaryData *x = &(*(Dlpackd__V1__TensorDesc *const *)a)->key;
	const ProtobufCBinaryData *y = &(*(Dlpackd__V1__TensorDesc *const *)b)->key;

	return dlpc__bytes_cmp(x->data, x->len, y->data, y->len);
}

int dlpd_entry_check_tensors(const Dlpackd__V1__Publish *req, char *why, size_t whylen)
{
	Dlpackd__V1__TensorDesc **sorted;
	int r = 0;

	if (req->n_tensors == 0 || req->n_tensors > DLPC_BUNDLE_MAX) {
		snprintf(why, whylen, "%zu tensors; an entry holds 1 to %d", req->n_tensors,
			 DLPC_BUNDLE_MAX);
		return -EINVAL;
	}
	for (size_t i = 0; i < req->n_tensors; i++) {
		const Dlpackd__V1__TensorDesc *t = req->tensors[i];
		uint64_t nbytes, end;

		r = dlpc__key_check(t->key.data, t->key.len, why, whylen);
		if (r < 0)
			return r;
		if (t->dtype_code > UINT8_MAX || t->dtype_bits > UINT8_MAX ||
		    t->dtype_lanes > UINT16_MAX || t->n_shape > DLPC_NDIM_MAX) {
			snprintf(why, whylen, "tensor %zu: bad dtype or more than %d dimensions", i,
				 DLPC_NDIM_MAX);
			return -EINVAL;
		}
		r = dlpc__tensor_nbytes(t->dtype_bits, t->dtype_lanes, t->shape, t->n_shape,
					&nbytes);
		if (r < 0) {
			snprintf(why, whylen, "tensor %zu: bad dtype or shape", i);
			return r;
		}
		/* a legacy CUDA IPC tensor, or one in lent VMM memory, sits where its producer's
		 * allocator put it */
		if ((!req->cuda_ipc && !(req->device_type == kDLCUDA && req->reclaim_token) &&
		     t->offset % DLPC_ALIGN != 0) ||
		    __builtin_add_overflow(t->offset, nbytes, &end) || end > req->storage_size) {
			snprintf(why, whylen,
				 "tensor %zu: %llu bytes at offset %llu do not fit an aligned "
				 "place in a storage of %llu bytes",
				 i, (unsigned long long)nbytes, (unsigned long long)t->offset,
				 (unsigned long long)req->storage_size);
			return -EINVAL;
		}
	}
	if (req->n_tensors == 1)
		return 0;
	sorted = malloc(req->n_tensors * sizeof(*sorted));
	if (!sorted)
		return -ENOMEM;
	memcpy(sorted, req->tensors, req->n_tensors * sizeof(*sorted));
	qsort(sorted, req->n_tensors, sizeof(*sorted), cmp_keys);
	for (size_t i = 1; i < req->n_tensors && r == 0; i++)
		if (cmp_keys(&sorted[i - 1], &sorted[i]) == 0) {
			char key[DLPC_NAME_TEXT];

			snprintf(why, whylen, "key '%s' appears twice in the bundle",
				 dlpc__printable(sorted[i]->key.data, sorted[i]->key.len, key,
						 sizeof(key)));
			r = -EINVAL;
		}
	free(sorted);
	return r;
}

static void free_unknown(ProtobufCMessage *m)
{
	for (unsigned i = 0; i < m->n_unknown_fields; i++)
		free(m->unknown_fields[i].data);
	free(m->unknown_fields);
	m->unknown_fields = NULL;
	m->n_unknown_fields = 0;
}

/* protobuf-c's default allocator is malloc */
void dlpd_entry_drop_unknown_fields(Dlpackd__V1__Publish *req)
{
	free_unknown(&req->base);
	for (size_t i = 0; i < req->n_tensors; i++)
		free_unknown(&req->tensors[i]->base);
}

uint8_t *dlpd_entry_encode_tensors(const Dlpackd__V1__Publish *req, size_t *len)
{
	Dlpackd__V1__AttachReply only = DLPACKD__V1__ATTACH_REPLY__INIT;
	uint8_t *table, *wire;

	only.tensor_table.len = dlpc__table_size(req->tensors, req->n_tensors);
	table = malloc(only.tensor_table.len);
	if (!table)
		return NULL;
	dlpc__table_encode(req->tensors, req->n_tensors, table);
	only.tensor_table.data = table;
	*len = dlpackd__v1__attach_reply__get_packed_size(&only);
	wire = malloc(*len);
	if (wire)
		dlpackd__v1__attach_reply__pack(&only, wire);
	free(table);
	return wire;
}

int dlpd_entry_check_storage(const Dlpackd__V1__Publish *req, int fd, char *why, size_t whylen)
{
	if (req->device_type == kDLCPU)
		return dlpc__storage_check(fd, req->storage_size,
					   (req->flags & DLPC_PUBLISH_WRITABLE)
						   ? DLPC__STORAGE_WRITABLE
						   : DLPC__STORAGE_SEALED,
					   why, whylen);
	if (!req->cuda_ipc)
		return dlpc__device_storage_check(fd, why, whylen);
	return 0;
}
