/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Publishing host tensors: lay them out in a memfd (copying, or not at all for dlpc_alloc()
 * memory), seal it, and hand the fd to the daemon.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"
#include "util.h"

#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif

#define PUBLISH_FLAGS (DLPC_PUBLISH_REPLACE | DLPC_PUBLISH_EPHEMERAL | DLPC_PUBLISH_WRITABLE)

/* Memory handed out by dlpc_alloc(): a whole memfd, mapped writable. */
struct alloc_ctx {
	int fd;
	void *base;
	size_t len;
	int64_t dims[]; /* shape, then strides */
};

/* One tensor to publish and where it goes in the storage. */
struct slot {
	const DLTensor *t;
	uint64_t nbytes, offset;
	bool contiguous;
};

/* A memfd of @p size bytes, its pages reserved now so that a full /dev/shm fails here. */
static int storage_create(const char *name, uint64_t size)
{
	char label[64];
	int fd, r;

	snprintf(label, sizeof(label), "dlpc:%s", name);
	fd = memfd_create(label, MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL);
	if (fd < 0 && errno == EINVAL)
		fd = memfd_create(label, MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return dlpc__fail(-errno, "cannot publish '%s': memfd_create: %m", name);
	if (ftruncate(fd, (off_t)size) < 0) {
		r = dlpc__fail(-errno,
			       "cannot publish '%s': cannot size shared memory to %llu "
			       "bytes: %m",
			       name, (unsigned long long)size);
		goto fail;
	}
	do
		r = fallocate(fd, 0, 0, (off_t)size);
	while (r < 0 && errno == EINTR);
	if (r < 0 && errno != EOPNOTSUPP) {
		r = dlpc__fail(
			errno == ENOSPC ? -ENOSPC : -errno,
			"cannot publish '%s': cannot reserve %llu bytes of shared memory: %m", name,
			(unsigned long long)size);
		goto fail;
	}
	return fd;
fail:
	close(fd);
	return r;
}

static int storage_seal(int fd, const char *name, bool writable)
{
	int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

	if (!writable)
		seals |= F_SEAL_FUTURE_WRITE;
	if (fcntl(fd, F_ADD_SEALS, seals) < 0)
		return dlpc__fail(-errno, "cannot publish '%s': cannot seal shared memory: %m",
				  name);
	return 0;
}

static bool is_contiguous(const DLTensor *t)
{
	int64_t expect = 1;

	if (!t->strides)
		return true;
	for (int i = t->ndim - 1; i >= 0; i--) {
		if (t->shape[i] == 0)
			return true;
		if (t->shape[i] != 1 && t->strides[i] != expect)
			return false;
		expect *= t->shape[i];
	}
	return true;
}

/* Copy @p t into @p dst as C-contiguous bytes. @p t is not contiguous; elements are whole bytes. */
static void copy_strided(uint8_t *dst, const DLTensor *t)
{
	size_t elem = (size_t)t->dtype.bits * t->dtype.lanes / 8;
	const uint8_t *src = (const uint8_t *)t->data + t->byte_offset;
	int64_t idx[DLPC_NDIM_MAX] = {0};
	size_t inner = elem, outer = 1;
	int k = t->ndim;

	/* fold the trailing dimensions that are already contiguous into one run */
	while (k > 0 && (t->shape[k - 1] == 1 || (size_t)t->strides[k - 1] * elem == inner))
		inner *= (size_t)t->shape[--k];
	for (int i = 0; i < k; i++)
		outer *= (size_t)t->shape[i];
	for (size_t o = 0; o < outer; o++) {
		int64_t off = 0;

		for (int i = 0; i < k; i++)
			off += idx[i] * t->strides[i];
		memcpy(dst, src + off * (int64_t)elem, inner);
		dst += inner;
		for (int i = k - 1; i >= 0 && ++idx[i] == t->shape[i]; i--)
			idx[i] = 0;
	}
}

/* Check @p t and size it; the message names the tensor. */
static int slot_init(struct slot *s, const DLManagedTensorVersioned *mt, const char *name, size_t i)
{
	const DLTensor *t = &mt->dl_tensor;

	s->t = t;
	if (t->device.device_type != kDLCPU)
		return dlpc__fail(-ENOTSUP,
				  "cannot publish '%s': tensor %zu is on device type %d; only host "
				  "(kDLCPU) memory can be shared",
				  name, i, (int)t->device.device_type);
	if (t->ndim < 0 || t->ndim > DLPC_NDIM_MAX || (t->ndim > 0 && !t->shape))
		return dlpc__fail(-EINVAL,
				  "cannot publish '%s': tensor %zu has %d dimensions "
				  "(0 to %d supported)",
				  name, i, t->ndim, DLPC_NDIM_MAX);
	if (dlpc__tensor_nbytes(t->dtype.bits, t->dtype.lanes, t->shape, (size_t)t->ndim,
				&s->nbytes) < 0)
		return dlpc__fail(-EINVAL,
				  "cannot publish '%s': tensor %zu has a bad dtype or shape", name,
				  i);
	s->contiguous = is_contiguous(t);
	if (!s->contiguous && (t->dtype.bits * t->dtype.lanes) % 8 != 0)
		return dlpc__fail(-ENOTSUP,
				  "cannot publish '%s': tensor %zu is strided with "
				  "sub-byte elements",
				  name, i);
	if (s->nbytes > 0 && !t->data)
		return dlpc__fail(-EINVAL, "cannot publish '%s': tensor %zu has no data", name, i);
	return 0;
}

static void fill_desc(Dlpackd__V1__TensorDesc *d, const struct slot *s, const char *key)
{
	dlpackd__v1__tensor_desc__init(d);
	d->key.data = (uint8_t *)key;
	d->key.len = strlen(key);
	d->dtype_code = s->t->dtype.code;
	d->dtype_bits = s->t->dtype.bits;
	d->dtype_lanes = s->t->dtype.lanes;
	d->n_shape = (size_t)s->t->ndim;
	d->shape = s->t->shape;
	d->offset = s->offset;
}

static void alloc_deleter(DLManagedTensorVersioned *t)
{
	struct alloc_ctx *ctx = t->manager_ctx;

	munmap(ctx->base, ctx->len);
	close(ctx->fd);
	free(ctx);
	free(t);
}

/* If @p mt is dlpc_alloc() memory still laid out as allocated, the ctx to publish it as is. */
static struct alloc_ctx *zero_copy_source(const DLManagedTensorVersioned *mt, const struct slot *s)
{
	struct alloc_ctx *ctx = mt->manager_ctx;
	const uint8_t *data;

	if (mt->deleter != alloc_deleter || !s->contiguous)
		return NULL;
	data = (const uint8_t *)mt->dl_tensor.data + mt->dl_tensor.byte_offset;
	if (data < (const uint8_t *)ctx->base || (data - (const uint8_t *)ctx->base) % DLPC_ALIGN ||
	    (uint64_t)(data - (const uint8_t *)ctx->base) + s->nbytes > ctx->len)
		return NULL;
	return ctx;
}

static int send_publish(dlpc_client *c, Dlpackd__V1__Publish *req, int fd)
{
	Dlpackd__V1__PublishReply *rep;
	int r;

	r = dlpc__call(c, DLPC_MSG_PUBLISH, &req->base, &fd, 1,
		       &dlpackd__v1__publish_reply__descriptor, (ProtobufCMessage **)&rep, NULL);
	if (r < 0)
		return r;
	r = rep->generation > 0 && rep->generation <= INT32_MAX
		    ? (int)rep->generation
		    : dlpc__fail(-EPROTO, "dlpackd returned generation %llu",
				 (unsigned long long)rep->generation);
	dlpackd__v1__publish_reply__free_unpacked(rep, NULL);
	return r;
}

/* Check the arguments publish() cannot go on without. 0 or negative errno, message set. */
static int publish_args(dlpc_client *c, const char *name, size_t n,
			DLManagedTensorVersioned *const tensors[], const char *const keys[],
			uint32_t flags)
{
	int r;

	if (!c)
		return dlpc__fail(-EINVAL, "cannot publish: client is NULL");
	r = dlpc__check(c);
	if (r < 0)
		return r;
	r = dlpc__name_arg(name, "publish");
	if (r < 0)
		return r;
	if (flags & ~PUBLISH_FLAGS)
		return dlpc__fail(-EINVAL, "cannot publish '%s': unknown flags 0x%x", name,
				  flags & ~PUBLISH_FLAGS);
	if (n == 0 || n > DLPC_BUNDLE_MAX || !tensors || (n > 1 && !keys))
		return dlpc__fail(-EINVAL, "cannot publish '%s': %zu tensors (1 to %d, with keys)",
				  name, n, DLPC_BUNDLE_MAX);
	return 0;
}

static int publish(dlpc_client *c, const char *name, size_t n, const char *const keys[],
		   DLManagedTensorVersioned *const tensors[], uint32_t flags)
{
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc *descs = NULL, **dptrs = NULL;
	struct slot *slots = NULL;
	struct alloc_ctx *zc = NULL;
	uint64_t size = 0;
	uint8_t *map;
	int fd = -1, r;

	r = publish_args(c, name, n, tensors, keys, flags);
	if (r < 0)
		goto out;
	slots = calloc(n, sizeof(*slots));
	descs = calloc(n, sizeof(*descs));
	dptrs = calloc(n, sizeof(*dptrs));
	if (!slots || !descs || !dptrs) {
		r = dlpc__fail(-ENOMEM, "cannot publish '%s': out of memory", name);
		goto out;
	}
	for (size_t i = 0; i < n; i++) {
		const char *key = keys ? keys[i] : "";
		char why[160];

		if (!tensors[i] || !key) {
			r = dlpc__fail(-EINVAL, "cannot publish '%s': tensor or key %zu is NULL",
				       name, i);
			goto out;
		}
		if (dlpc__key_check((const uint8_t *)key, strlen(key), why, sizeof(why)) < 0) {
			r = dlpc__fail(-EINVAL, "cannot publish '%s': tensor %zu: %s", name, i,
				       why);
			goto out;
		}
		r = slot_init(&slots[i], tensors[i], name, i);
		if (r < 0)
			goto out;
		if (!dlpc__align_up(size, &slots[i].offset) ||
		    __builtin_add_overflow(slots[i].offset, slots[i].nbytes, &size)) {
			r = dlpc__fail(-EOVERFLOW, "cannot publish '%s': tensors too large", name);
			goto out;
		}
		fill_desc(&descs[i], &slots[i], key);
		dptrs[i] = &descs[i];
	}
	if (n == 1)
		zc = zero_copy_source(tensors[0], &slots[0]);
	if (zc) {
		fd = zc->fd;
		size = zc->len;
		descs[0].offset =
			(uint64_t)((const uint8_t *)tensors[0]->dl_tensor.data +
				   tensors[0]->dl_tensor.byte_offset - (const uint8_t *)zc->base);
	} else {
		size = size ? size : DLPC_ALIGN;
		fd = storage_create(name, size);
		if (fd < 0) {
			r = fd;
			goto out;
		}
		map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (map == MAP_FAILED) {
			r = dlpc__fail(-errno, "cannot publish '%s': cannot map shared memory: %m",
				       name);
			goto out;
		}
		for (size_t i = 0; i < n; i++) {
			const DLTensor *t = slots[i].t;

			if (slots[i].nbytes == 0)
				continue;
			if (slots[i].contiguous)
				memcpy(map + slots[i].offset,
				       (const uint8_t *)t->data + t->byte_offset, slots[i].nbytes);
			else
				copy_strided(map + slots[i].offset, t);
		}
		munmap(map, size);
	}
	r = storage_seal(fd, name, flags & DLPC_PUBLISH_WRITABLE);
	if (r < 0)
		goto out;
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.flags = flags;
	req.device_type = kDLCPU;
	req.storage_size = size;
	req.n_tensors = n;
	req.tensors = dptrs;
	r = send_publish(c, &req, fd);
out:
	if (!zc && fd >= 0)
		close(fd);
	free(dptrs);
	free(descs);
	free(slots);
	/* ownership passed to us on every path: each deleter runs exactly once */
	for (size_t i = 0; tensors && i < n; i++)
		if (tensors[i] && tensors[i]->deleter)
			tensors[i]->deleter(tensors[i]);
	return r;
}

DLPC_EXPORT int dlpc_publish(dlpc_client *c, const char *name, DLManagedTensorVersioned *t,
			     uint32_t flags)
{
	return publish(c, name, 1, NULL, &t, flags);
}

DLPC_EXPORT int dlpc_publish_bundle(dlpc_client *c, const char *name, size_t n,
				    const char *const keys[],
				    DLManagedTensorVersioned *const tensors[], uint32_t flags)
{
	return publish(c, name, n, keys, tensors, flags);
}

DLPC_EXPORT int dlpc_alloc(dlpc_client *c, DLDevice device, DLDataType dtype, int32_t ndim,
			   const int64_t *shape, DLManagedTensorVersioned **ret)
{
	DLManagedTensorVersioned *t = NULL;
	struct alloc_ctx *ctx = NULL;
	uint64_t nbytes, size;
	int r;

	if (!c || !ret || ndim < 0 || ndim > DLPC_NDIM_MAX || (ndim > 0 && !shape))
		return dlpc__fail(-EINVAL, "dlpc_alloc: bad arguments (ndim %d)", (int)ndim);
	*ret = NULL;
	r = dlpc__check(c);
	if (r < 0)
		return r;
	if (device.device_type != kDLCPU)
		return dlpc__fail(-ENOTSUP, "dlpc_alloc: device type %d is not supported",
				  (int)device.device_type);
	if (dlpc__tensor_nbytes(dtype.bits, dtype.lanes, shape, (size_t)ndim, &nbytes) < 0 ||
	    !dlpc__align_up(nbytes, &size) || size > INT64_MAX)
		return dlpc__fail(-EINVAL, "dlpc_alloc: bad dtype or shape");
	size = size ? size : DLPC_ALIGN;
	t = calloc(1, sizeof(*t));
	ctx = calloc(1, sizeof(*ctx) + 2 * (size_t)ndim * sizeof(int64_t));
	if (!t || !ctx) {
		r = dlpc__fail(-ENOMEM, "dlpc_alloc: out of memory");
		goto fail;
	}
	ctx->fd = storage_create("dlpc_alloc", size);
	if (ctx->fd < 0) {
		r = ctx->fd;
		goto fail;
	}
	ctx->len = size;
	ctx->base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, ctx->fd, 0);
	if (ctx->base == MAP_FAILED) {
		r = dlpc__fail(-errno, "dlpc_alloc: cannot map %llu bytes: %m",
			       (unsigned long long)size);
		close(ctx->fd);
		goto fail;
	}
	int64_t stride = 1;

	for (int32_t i = ndim - 1; i >= 0; i--) {
		ctx->dims[i] = shape[i];
		ctx->dims[ndim + i] = stride;
		stride *= shape[i];
	}
	t->version.major = DLPACK_MAJOR_VERSION;
	t->version.minor = DLPACK_MINOR_VERSION;
	t->manager_ctx = ctx;
	t->deleter = alloc_deleter;
	t->dl_tensor.data = ctx->base;
	t->dl_tensor.device = device;
	t->dl_tensor.ndim = ndim;
	t->dl_tensor.dtype = dtype;
	t->dl_tensor.shape = ctx->dims;
	t->dl_tensor.strides = ndim > 0 ? ctx->dims + ndim : NULL;
	*ret = t;
	return 0;
fail:
	free(ctx);
	free(t);
	return r;
}
