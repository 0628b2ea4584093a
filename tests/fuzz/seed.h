/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What the two seed writers (mkcorpus.c, mkjournal.c) share: an input built in memory, saved
 * as one file of the corpus, and the tensor descriptions their PUBLISH messages carry.
 */
#ifndef DLPC_FUZZ_SEED_H
#define DLPC_FUZZ_SEED_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dlpackd.pb-c.h"

/* Tensors a seed's message describes at most. */
#define SEED_TENSORS_MAX 4

struct input {
	uint8_t buf[1 << 16];
	size_t len;
};

/* Append @p len bytes of @p p to @p in; a seed that does not fit is a bug of the writer. */
static inline void seed_add(struct input *in, const void *p, size_t len)
{
	if (in->len + len > sizeof(in->buf)) {
		fprintf(stderr, "seed: input too large\n");
		exit(1);
	}
	if (len)
		memcpy(in->buf + in->len, p, len);
	in->len += len;
}

/* Write @p in to DIR/NAME. */
static inline void seed_save(const char *dir, const char *name, const struct input *in)
{
	char path[512];
	FILE *f;

	snprintf(path, sizeof(path), "%s/%s", dir, name);
	f = fopen(path, "wb");
	if (!f || fwrite(in->buf, 1, in->len, f) != in->len || fclose(f) != 0) {
		perror(path);
		exit(1);
	}
}

/* @p n float32 tensors of @p ndim dimensions of @p shape, @p bits wide, at @p offset, 256 bytes
 * apart; keyed "a", "b", ... when there are several. @p ptrs gets their addresses. */
static inline void seed_tensors(Dlpackd__V1__TensorDesc *descs, Dlpackd__V1__TensorDesc **ptrs,
				unsigned n, int64_t *shape, size_t ndim, uint32_t bits,
				uint64_t offset)
{
	static const char *const keys[SEED_TENSORS_MAX] = {"a", "b", "c", "d"};

	if (n > SEED_TENSORS_MAX) {
		fprintf(stderr, "seed: %u tensors\n", n);
		exit(1);
	}
	for (unsigned i = 0; i < n; i++) {
		dlpackd__v1__tensor_desc__init(&descs[i]);
		descs[i].key.data = (uint8_t *)(n > 1 ? keys[i] : "");
		descs[i].key.len = n > 1 ? 1 : 0;
		descs[i].dtype_code = 2; /* kDLFloat */
		descs[i].dtype_bits = bits;
		descs[i].dtype_lanes = 1;
		descs[i].n_shape = ndim;
		descs[i].shape = shape;
		descs[i].offset = offset + (uint64_t)i * 256;
		ptrs[i] = &descs[i];
	}
}

#endif
