/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Regions and views: every tensor libdlpc hands out is a view on a refcounted region (a mapping
 * of shared memory). Attached regions send RELEASE when the last view goes; allocated ones
 * close their memfd. Views are independent: each has its own shape, strides and deleter, and any
 * of them may be released first, from any thread.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core.h"
#include "region.h"
#include "gpu.h"

struct view {
	DLManagedTensorVersioned t;
	struct dlpc__region *r;
	int64_t dims[]; /* shape, then C-contiguous strides */
};

void dlpc__region_note_stream(struct dlpc__region *r, void *stream)
{
	if (!dlpc__cuda_stream_followed(stream))
		atomic_store_explicit(&r->sync_ctx, true, memory_order_relaxed);
}

void dlpc__region_unref(struct dlpc__region *r)
{
	if (atomic_fetch_sub_explicit(&r->refs, 1, memory_order_acq_rel) != 1)
		return;
	if (r->ce) {
		/* the cache holds the reference, and may keep the mapping for the next attach */
		dlpc__cache_put(r->client, r->ce, r->base, r->map_kind);
	} else if (!r->device) {
		/* a channel's message: kept for its storage's next message, or unmapped */
		if (!r->keyed || !dlpc__maps_put(r->client, r))
			munmap(r->base, r->len);
	} else if (r->client) {
		/* the consumer's queued kernels may still read it: the mapping goes and the
		 * publisher hears it may reuse the memory only once they are done. Ordered by an
		 * event, not by waiting here (a deleter may run anywhere, during a capture too). */
		if (dlpc__cuda_retire(r))
			return;
		dlpc__cuda_release_sync(r->ordinal, atomic_load(&r->sync_ctx));
		if (r->gpu)
			dlpc__cuda_unmap(r->gpu);
	} else if (r->gpu) {
		dlpc__cuda_unmap(r->gpu);
	}
	dlpc__region_finish(r);
}

static void view_deleter(DLManagedTensorVersioned *t)
{
	struct view *v = (struct view *)t;

	dlpc__region_unref(v->r);
	free(v);
}

DLManagedTensorVersioned *dlpc__view_new(struct dlpc__region *r, void *data, DLDevice dev,
					 DLDataType dtype, int ndim, const int64_t *shape,
					 uint64_t flags)
{
	struct view *v = malloc(sizeof(*v) + 2 * (size_t)ndim * sizeof(int64_t));
	int64_t stride = 1;

	if (!v)
		return NULL;
	for (int i = ndim - 1; i >= 0; i--) {
		v->dims[i] = shape[i];
		v->dims[ndim + i] = stride;
		stride *= shape[i];
	}
	dlpc__region_ref(r);
	v->r = r;
	v->t.version.major = DLPACK_MAJOR_VERSION;
	v->t.version.minor = DLPACK_MINOR_VERSION;
	v->t.manager_ctx = r;
	v->t.deleter = view_deleter;
	v->t.flags = flags;
	v->t.dl_tensor.data = data;
	v->t.dl_tensor.device = dev;
	v->t.dl_tensor.ndim = ndim;
	v->t.dl_tensor.dtype = dtype;
	v->t.dl_tensor.shape = v->dims;
	v->t.dl_tensor.strides = ndim > 0 ? v->dims + ndim : NULL;
	v->t.dl_tensor.byte_offset = 0;
	return &v->t;
}

struct dlpc__region *dlpc__view_region(const DLManagedTensorVersioned *t)
{
	return t && t->deleter == view_deleter ? ((const struct view *)t)->r : NULL;
}

DLPC_EXPORT DLManagedTensorVersioned *dlpc_tensor_share(const DLManagedTensorVersioned *t)
{
	struct dlpc__region *r = dlpc__view_region(t);
	DLManagedTensorVersioned *s;

	if (!r) {
		dlpc__fail(-EINVAL, "dlpc_tensor_share: the tensor was not made by libdlpc");
		return NULL;
	}
	s = dlpc__view_new(r, t->dl_tensor.data, t->dl_tensor.device, t->dl_tensor.dtype,
			   t->dl_tensor.ndim, t->dl_tensor.shape,
			   t->flags |
				   (atomic_load(&r->frozen) ? DLPACK_FLAG_BITMASK_READ_ONLY : 0));
	if (!s)
		dlpc__fail(-ENOMEM, "dlpc_tensor_share: out of memory");
	return s;
}
