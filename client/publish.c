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
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "util.h"

/* One tensor to publish and where it goes in the storage. */
struct slot {
	const DLTensor *t;
	const char *key; /* NULL for dlpc_publish()'s single tensor */
	uint64_t nbytes, offset;
	bool contiguous;
};

/* A slot in messages, as printf arguments for "%s%s%s": "tensor 'KEY'" or "the tensor". */
#define SLOT_ARGS(s)                                                                               \
	((s)->key ? "tensor '" : "the tensor"), ((s)->key ? (s)->key : ""), ((s)->key ? "'" : "")

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

/* Bytes gathered from a strided tensor before each pwrite. */
#define BOUNCE_SIZE (1u << 20)

/* pwrite() all of @p buf at @p off, or copy it there into @p map (not NULL: the memfd mapped
 * whole). 0 or negative errno, the message naming @p name. */
static int pwrite_all(int fd, uint8_t *map, const void *buf, size_t len, uint64_t off,
		      const char *name)
{
	const uint8_t *p = buf;

	if (map) {
		memcpy(map + off, buf, len);
		return 0;
	}
	while (len > 0) {
		ssize_t n = pwrite(fd, p, len > (1u << 30) ? (1u << 30) : len, (off_t)off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) {
			int err = n < 0 ? errno : EIO;

			return dlpc__fail(dlpc__space_err(err),
					  "cannot publish '%s': cannot write shared memory: %s",
					  name, strerror(err));
		}
		p += n;
		len -= (size_t)n;
		off += (uint64_t)n;
	}
	return 0;
}

/* Write @p t, which is not contiguous (whole-byte elements), C-contiguous at @p off. */
static int write_strided(int fd, uint8_t *map, uint64_t off, const DLTensor *t, uint8_t *bounce,
			 const char *name)
{
	size_t elem = (size_t)t->dtype.bits * t->dtype.lanes / 8;
	const uint8_t *src = (const uint8_t *)t->data + t->byte_offset;
	int64_t idx[DLPC_NDIM_MAX] = {0};
	size_t inner = elem, outer = 1, used = 0;
	int k = t->ndim, r;

	/* fold the trailing dimensions that are already contiguous into one run */
	while (k > 0 && (t->shape[k - 1] == 1 || (size_t)t->strides[k - 1] * elem == inner))
		inner *= (size_t)t->shape[--k];
	for (int i = 0; i < k; i++)
		outer *= (size_t)t->shape[i];
	for (size_t o = 0; o < outer; o++) {
		const uint8_t *run;
		int64_t pos = 0;

		for (int i = 0; i < k; i++)
			pos += idx[i] * t->strides[i];
		run = src + pos * (int64_t)elem;
		if (used + inner > BOUNCE_SIZE) {
			r = pwrite_all(fd, map, bounce, used, off, name);
			if (r < 0)
				return r;
			off += used;
			used = 0;
		}
		if (inner > BOUNCE_SIZE) {
			/* a run this long is worth its own write */
			r = pwrite_all(fd, map, run, inner, off, name);
			if (r < 0)
				return r;
			off += inner;
		} else {
			memcpy(bounce + used, run, inner);
			used += inner;
		}
		for (int i = k - 1; i >= 0 && ++idx[i] == t->shape[i]; i--)
			idx[i] = 0;
	}
	return used ? pwrite_all(fd, map, bounce, used, off, name) : 0;
}

/* Write every tensor (the strided ones only, if @p strided_only) into the fresh memfd @p fd at its
 * offset (through @p map, its mapping, if not NULL). 0 or negative errno. */
static int write_slots(int fd, uint8_t *map, const struct slot *slots, size_t n, bool strided_only,
		       const char *name)
{
	uint8_t *bounce = NULL;
	int r = 0;

	for (size_t i = 0; i < n && r == 0; i++) {
		const DLTensor *t = slots[i].t;

		if (slots[i].nbytes == 0)
			continue;
		if (slots[i].contiguous && strided_only)
			continue;
		if (slots[i].contiguous) {
			r = pwrite_all(fd, map, (const uint8_t *)t->data + t->byte_offset,
				       slots[i].nbytes, slots[i].offset, name);
			continue;
		}
		if (!bounce && !(bounce = malloc(BOUNCE_SIZE)))
			return dlpc__fail(-ENOMEM, "cannot publish '%s': out of memory", name);
		r = write_strided(fd, map, slots[i].offset, t, bounce, name);
	}
	free(bounce);
	return r;
}

/*
 * Allocate whatever pages of the @p size bytes of @p fd the writes left unallocated (a bundle of
 * empty tensors writes nothing): the daemon refuses sparse storage, whose pages would be charged
 * to the first attacher that reads them. One fstat when nothing is missing.
 */
static int allocate_rest(int fd, uint64_t size, const char *name)
{
	long page = sysconf(_SC_PAGESIZE);
	uint64_t need = (size + (uint64_t)page - 1) / (uint64_t)page * (uint64_t)page;
	struct stat st;
	int r;

	if (fstat(fd, &st) == 0 && (uint64_t)st.st_blocks * 512 >= need)
		return 0;
	do
		r = fallocate(fd, 0, 0, (off_t)size);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		return dlpc__fail(dlpc__space_err(errno),
				  "cannot publish '%s': cannot allocate %llu bytes of shared "
				  "memory: %m",
				  name, (unsigned long long)size);
	return 0;
}

/* Check @p t and size it; the message names the tensor by its @p key (NULL: the only one). */
static int slot_init(struct slot *s, const DLManagedTensorVersioned *mt, const char *name,
		     const char *key)
{
	const DLTensor *t = &mt->dl_tensor;

	s->t = t;
	s->key = key;
	if (t->device.device_type != kDLCPU && t->device.device_type != kDLCUDA)
		return dlpc__fail(-ENOTSUP,
				  "cannot publish '%s': %s%s%s is on device type %d; only host "
				  "(kDLCPU) and CUDA (kDLCUDA) memory can be shared",
				  name, SLOT_ARGS(s), (int)t->device.device_type);
	if (t->ndim < 0 || t->ndim > DLPC_NDIM_MAX || (t->ndim > 0 && !t->shape))
		return dlpc__fail(-EINVAL,
				  "cannot publish '%s': %s%s%s has %d dimensions "
				  "(0 to %d supported)",
				  name, SLOT_ARGS(s), t->ndim, DLPC_NDIM_MAX);
	if (dlpc__tensor_nbytes(t->dtype.bits, t->dtype.lanes, t->shape, (size_t)t->ndim,
				&s->nbytes) < 0)
		return dlpc__fail(-EINVAL, "cannot publish '%s': %s%s%s has a bad dtype or shape",
				  name, SLOT_ARGS(s));
	s->contiguous = is_contiguous(t);
	if (t->device.device_type == kDLCUDA && !s->contiguous)
		return dlpc__fail(-ENOTSUP,
				  "cannot publish '%s': %s%s%s is a strided CUDA tensor; make it "
				  "contiguous first (device memory is shared in place, not copied)",
				  name, SLOT_ARGS(s));
	if (!s->contiguous && (t->dtype.bits * t->dtype.lanes) % 8 != 0)
		return dlpc__fail(-ENOTSUP,
				  "cannot publish '%s': %s%s%s is strided with "
				  "sub-byte elements",
				  name, SLOT_ARGS(s));
	if (s->nbytes > 0 && !t->data)
		return dlpc__fail(-EINVAL, "cannot publish '%s': %s%s%s has no data", name,
				  SLOT_ARGS(s));
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

/* If @p mt is dlpc_alloc() memory laid out as allocated, its region: publish it as is. */
static struct dlpc__region *zero_copy_source(const DLManagedTensorVersioned *mt,
					     const struct slot *s)
{
	struct dlpc__region *r = dlpc__view_region(mt);
	const uint8_t *data, *base;

	if (!r || r->fd < 0 || !s->contiguous)
		return NULL;
	base = r->base;
	data = (const uint8_t *)mt->dl_tensor.data + mt->dl_tensor.byte_offset;
	if (data < base || (data - base) % DLPC_ALIGN ||
	    (uint64_t)(data - base) + s->nbytes > r->len)
		return NULL;
	return r;
}

/*
 * The one allocation of dlpc_alloc() or dlpc_alloc_bundle() memory that the @p n tensors make
 * up: each in it, at the place the allocation laid out for the tensor of its index, so that
 * the whole allocation is published and nothing else (a part of a bucket left out would
 * become visible to attachers, and read-only for good here). NULL if they do not; fills in
 * descs[i].offset when they do.
 */
static struct dlpc__region *zero_copy_all(DLManagedTensorVersioned *const tensors[],
					  const struct slot *slots, Dlpackd__V1__TensorDesc *descs,
					  size_t n)
{
	struct dlpc__region *r = zero_copy_source(tensors[0], &slots[0]);

	if (r && r->nparts != n)
		r = NULL;
	for (size_t i = 0; r && i < n; i++)
		if (zero_copy_source(tensors[i], &slots[i]) != r ||
		    (const uint8_t *)tensors[i]->dl_tensor.data +
				    tensors[i]->dl_tensor.byte_offset !=
			    (const uint8_t *)r->base + (r->parts ? r->parts[i] : 0))
			r = NULL;
	for (size_t i = 0; r && i < n; i++)
		descs[i].offset =
			(uint64_t)((const uint8_t *)tensors[i]->dl_tensor.data +
				   tensors[i]->dl_tensor.byte_offset - (const uint8_t *)r->base);
	return r;
}

/* What the calling thread's last successful publish made (dlpc_last_published()). */
static __thread struct {
	const dlpc_client *c;
	uint64_t generation;
	int64_t created_ns;
} last_published;

DLPC_EXPORT int dlpc_last_published(dlpc_client *c, uint64_t *generation, int64_t *created_ns)
{
	if (!c || last_published.c != c)
		return dlpc__fail(-ENOENT, "this thread published nothing through this client");
	if (generation)
		*generation = last_published.generation;
	if (created_ns)
		*created_ns = last_published.created_ns;
	return 0;
}

/* Send @p req with the storage @p fd (none if -1), with @p info (NULL: none); the generation,
 * or a negative errno. */
static int send_publish_info(dlpc_client *c, Dlpackd__V1__Publish *req, int fd,
			     struct dlpc__call_info *info)
{
	Dlpackd__V1__PublishReply *rep;
	int r;

	r = dlpc__call_ex(c, DLPC_MSG_PUBLISH, &req->base, &fd, fd >= 0 ? 1 : 0, 0, info,
			  &dlpackd__v1__publish_reply__descriptor, (ProtobufCMessage **)&rep, NULL,
			  NULL);
	if (r < 0)
		return r;
	r = rep->generation > 0 && rep->generation <= INT32_MAX
		    ? (int)rep->generation
		    : dlpc__fail(-EPROTO, "dlpackd returned generation %llu",
				 (unsigned long long)rep->generation);
	if (r > 0) {
		last_published.c = c;
		last_published.generation = rep->generation;
		last_published.created_ns = rep->created_ns;
	}
	dlpackd__v1__publish_reply__free_unpacked(rep, NULL);
	return r;
}

static int send_publish(dlpc_client *c, Dlpackd__V1__Publish *req, int fd)
{
	return send_publish_info(c, req, fd, NULL);
}

/* send_publish() of memory lent until RECLAIM (legacy IPC, a lent VMM fd): counted on the
 * connection the request goes out on (@p info says which). */
static int send_lent(dlpc_client *c, Dlpackd__V1__Publish *req, int fd,
		     struct dlpc__call_info *info)
{
	info->lend = true;
	return send_publish_info(c, req, fd, info);
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
	if (flags & ~DLPC_PUBLISH_FLAGS_ALL)
		return dlpc__fail(-EINVAL, "cannot publish '%s': unknown flags 0x%x", name,
				  flags & ~DLPC_PUBLISH_FLAGS_ALL);
	if (n == 0 || n > DLPC_BUNDLE_MAX || !tensors || (n > 1 && !keys))
		return dlpc__fail(-EINVAL, "cannot publish '%s': %zu tensors (1 to %d, with keys)",
				  name, n, DLPC_BUNDLE_MAX);
	return 0;
}

/*
 * After a PUBLISH (@p info) of memory its publisher keeps (legacy IPC, lent VMM) under @p token:
 * whether the library keeps the tensor until RECLAIM (*@p kept). A refusal gives it back at
 * once, and so does a request that never went out. Nothing else does: when the call was
 * interrupted, timed out, canceled or lost its connection (@p r) after sending, the entry may
 * exist and attachers may hold it, so the memory is kept as if published; if the entry was
 * never made, until the process exits. Returns @p r.
 */
static int lent(dlpc_client *c, int r, const struct dlpc__call_info *info, uint64_t token,
		bool *kept)
{
	bool unknown = r == -EINTR || r == -ETIMEDOUT || r == -ECANCELED || r == -EPIPE ||
		       r == -ECONNRESET;

	if (!info->sent) {
		dlpc__cuda_reclaim(token, false);
		return r;
	}
	if (r < 0 && !unknown) {
		dlpc__reclaim_count(c, -1, info->conn_seq);
		dlpc__cuda_reclaim(token, false);
		return r;
	}
	*kept = true;
	dlpc__reclaim_start(c);
	return r;
}

/*
 * An empty CUDA tensor has no memory to share, and its data pointer may be NULL: it goes as the
 * smallest VMM allocation the device has, of our own, so that attachers find its device.
 */
static int publish_cuda_empty(dlpc_client *c, Dlpackd__V1__Publish *req, int ordinal,
			      const char *name)
{
	uint8_t uuid[DLPC_CUDA_UUID_SIZE];
	struct dlpc__gpu_map *m;
	void *base;
	size_t len;
	int fd, r;
	char what[DLPC_NAME_MAX + 32];

	snprintf(what, sizeof(what), "cannot publish '%s'", name);
	r = dlpc__cuda_vmm_alloc(ordinal, 0, &m, &base, &len, &fd, uuid, what);
	if (r < 0)
		return r;
	dlpc__cuda_unmap(m);
	req->storage_size = len;
	req->device_uuid.data = uuid;
	req->tensors[0]->offset = 0;
	r = send_publish(c, req, fd);
	close(fd);
	return r;
}

/*
 * Publish the CUDA tensor @p t: dlpc_alloc() memory on the device goes as its VMM export fd;
 * someone else's VMM mapping is lent by its allocation's fd, and any other device pointer goes
 * through legacy IPC: in both cases the library keeps @p t (*@p kept) until the daemon's
 * RECLAIM notice. The generation or a negative errno.
 */
static int publish_cuda(dlpc_client *c, const char *name, DLManagedTensorVersioned *t,
			const struct slot *s, Dlpackd__V1__TensorDesc **dptrs, uint32_t flags,
			bool *kept)
{
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__CudaIpc ipc = DLPACKD__V1__CUDA_IPC__INIT;
	Dlpackd__V1__TensorDesc probe = DLPACKD__V1__TENSOR_DESC__INIT;
	/* the whole allocation only: one tensor of a bucket goes the other ways */
	struct dlpc__region *zc = zero_copy_all(&t, s, &probe, 1);
	char what[DLPC_NAME_MAX + 32];
	struct dlpc__call_info info = {0};
	struct dlpc__ipc_export x;
	int r;

	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.flags = flags;
	req.device_type = kDLCUDA;
	req.device_id = t->dl_tensor.device.device_id;
	req.n_tensors = 1;
	req.tensors = dptrs;
	req.device_uuid.len = DLPC_CUDA_UUID_SIZE;
	if (s->nbytes == 0)
		return publish_cuda_empty(c, &req, t->dl_tensor.device.device_id, name);
	if (zc && zc->device) {
		/* the export fd needs no driver call, but GPU memory in a forked child is the
		 * parent's, as for every other GPU call there */
		snprintf(what, sizeof(what), "cannot publish '%s'", name);
		if ((r = dlpc__cuda_check(what)) < 0)
			return r;
		req.storage_size = zc->len;
		req.device_uuid.data = zc->uuid;
		dptrs[0]->offset = (uint64_t)((const uint8_t *)t->dl_tensor.data +
					      t->dl_tensor.byte_offset - (const uint8_t *)zc->base);
		return send_publish(c, &req, zc->fd);
	}
	r = dlpc__cuda_ipc_export(t, s->nbytes, name, &x);
	if (r < 0)
		return r;
	if (x.fd >= 0) {
		/* lent, not given: the entry goes with this connection, and the memory comes
		 * back (RECLAIM) like legacy IPC memory */
		req.storage_size = x.alloc_size;
		req.device_uuid.data = x.uuid;
		req.reclaim_token = x.token;
		req.flags |= DLPC_PUBLISH_EPHEMERAL;
		dptrs[0]->offset = x.offset;
		r = send_lent(c, &req, x.fd, &info);
		close(x.fd);
		return lent(c, r, &info, x.token, kept);
	}
	ipc.mem_handle.data = x.mem_handle;
	ipc.mem_handle.len = sizeof(x.mem_handle);
	ipc.event_handle.data = x.event_handle;
	ipc.event_handle.len = sizeof(x.event_handle);
	req.cuda_ipc = &ipc;
	req.device_uuid.data = x.uuid;
	req.storage_size = x.alloc_size;
	req.reclaim_token = x.token;
	/* the memory stays this process's: the entry goes when the connection does */
	req.flags |= DLPC_PUBLISH_EPHEMERAL;
	dptrs[0]->offset = x.offset;
	r = send_lent(c, &req, -1, &info);
	return lent(c, r, &info, x.token, kept);
}

/*
 * Publish @p n CUDA tensors of one device as a bundle: those of one dlpc_alloc_bundle()
 * allocation (@p zc, their offsets in dptrs already) as that allocation's VMM export fd; any
 * others copied, on the device, into one VMM allocation of ours (each at slots[i].offset,
 * @p size bytes in all). The daemon holds either like any VMM entry, and one import serves
 * every attacher's whole bundle. The generation or a negative errno; the tensors stay the
 * caller's (their deleters run when publish() ends).
 */
static int publish_cuda_bundle(dlpc_client *c, const char *name, size_t n,
			       DLManagedTensorVersioned *const tensors[], const struct slot *slots,
			       Dlpackd__V1__TensorDesc **dptrs, uint64_t size, uint32_t flags,
			       const struct dlpc__region *zc)
{
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	int ordinal = tensors[0]->dl_tensor.device.device_id;
	uint8_t uuid[DLPC_CUDA_UUID_SIZE];
	char what[DLPC_NAME_MAX + 32];
	struct dlpc__gpu_map *m;
	const void **srcs;
	uint64_t *offsets;
	size_t *sizes, len;
	void *base;
	int fd, r;

	for (size_t i = 0; i < n; i++) {
		DLDevice d = tensors[i]->dl_tensor.device;

		if (d.device_type != kDLCUDA || d.device_id != ordinal)
			return dlpc__fail(-ENOTSUP,
					  "cannot publish '%s': %s%s%s is on device %d:%d and "
					  "%s%s%s on CUDA device %d; a bundle's tensors are all "
					  "on one device",
					  name, SLOT_ARGS(&slots[i]), d.device_type, d.device_id,
					  SLOT_ARGS(&slots[0]), ordinal);
	}
	snprintf(what, sizeof(what), "cannot publish '%s'", name);
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.flags = flags;
	req.device_type = kDLCUDA;
	req.device_id = ordinal;
	req.device_uuid.len = DLPC_CUDA_UUID_SIZE;
	req.n_tensors = n;
	req.tensors = dptrs;
	if (zc && zc->device) {
		if ((r = dlpc__cuda_check(what)) < 0)
			return r;
		req.device_uuid.data = (uint8_t *)zc->uuid;
		req.storage_size = zc->len;
		return send_publish(c, &req, zc->fd);
	}
	srcs = calloc(n, sizeof(*srcs));
	offsets = calloc(n, sizeof(*offsets));
	sizes = calloc(n, sizeof(*sizes));
	if (!srcs || !offsets || !sizes) {
		r = dlpc__fail(-ENOMEM, "%s: out of memory", what);
		goto out;
	}
	for (size_t i = 0; i < n; i++) {
		const DLTensor *t = &tensors[i]->dl_tensor;

		srcs[i] = (const uint8_t *)t->data + t->byte_offset;
		offsets[i] = slots[i].offset;
		sizes[i] = (size_t)slots[i].nbytes;
	}
	r = dlpc__cuda_vmm_alloc(ordinal, size, &m, &base, &len, &fd, uuid, what);
	if (r < 0)
		goto out;
	r = dlpc__cuda_gather(ordinal, base, n, offsets, (const void *const *)srcs, sizes, what);
	/* the export fd keeps the allocation; this process needs no mapping of it */
	dlpc__cuda_unmap(m);
	if (r == 0) {
		req.device_uuid.data = uuid;
		req.storage_size = len;
		r = send_publish(c, &req, fd);
	}
	close(fd);
out:
	free(srcs);
	free(offsets);
	free(sizes);
	return r;
}

/*
 * Check the @p n tensors and their @p keys (NULL: none) of the publish of @p name, and lay them
 * out in one storage: each one's slot (at an aligned offset) and its description in @p descs,
 * pointed at by @p dptrs. *@p size the bytes they take in all. 0, or a negative errno.
 */
static int lay_out(const char *name, size_t n, const char *const keys[],
		   DLManagedTensorVersioned *const tensors[], struct slot *slots,
		   Dlpackd__V1__TensorDesc *descs, Dlpackd__V1__TensorDesc **dptrs, uint64_t *size)
{
	int r;

	for (size_t i = 0; i < n; i++) {
		const char *key = keys ? keys[i] : "";
		char why[160];

		if (!tensors[i] || !key)
			return dlpc__fail(-EINVAL, "cannot publish '%s': tensor or key %zu is NULL",
					  name, i);
		if (dlpc__key_check((const uint8_t *)key, strlen(key), why, sizeof(why)) < 0)
			/* a key that is not valid text is named by its place */
			return dlpc__fail(-EINVAL, "cannot publish '%s': the key of tensor %zu: %s",
					  name, i, why);
		r = slot_init(&slots[i], tensors[i], name, keys ? key : NULL);
		if (r < 0)
			return r;
		if (!dlpc__align_up(*size, &slots[i].offset) ||
		    __builtin_add_overflow(slots[i].offset, slots[i].nbytes, size))
			return dlpc__fail(-EOVERFLOW, "cannot publish '%s': tensors too large",
					  name);
		fill_desc(&descs[i], &slots[i], key);
		dptrs[i] = &descs[i];
	}
	return 0;
}

/*
 * Write the tensors into the memfd @p fd (@p size bytes) mapped writable at @p map, the
 * contiguous ones split over threads (dlpc__split_copy(), doing what @p how asks besides), each
 * allocating its part's pages first with DLPC__SPLIT_POPULATE: memory that cannot be had fails
 * here, not with SIGBUS. The strided ones after, on this thread (and then no part is dropped
 * from the mapping before them). 0 or negative errno, the message set unless @p quiet and it is
 * the allocation's.
 */
static int write_split(int fd, uint8_t *map, uint64_t size, unsigned how, bool quiet,
		       const struct slot *slots, size_t n, const char *name)
{
	struct dlpc__run one = {0}, *runs = n <= 1 ? &one : malloc(n * sizeof(*runs));
	size_t nruns = 0;
	bool strided = false;
	int r;

	if (!runs)
		return dlpc__fail(-ENOMEM, "cannot publish '%s': out of memory", name);
	for (size_t i = 0; i < n; i++) {
		if (slots[i].nbytes == 0)
			continue;
		if (!slots[i].contiguous) {
			strided = true;
			continue;
		}
		runs[nruns++] = (struct dlpc__run){(const uint8_t *)slots[i].t->data +
							   slots[i].t->byte_offset,
						   slots[i].offset, slots[i].nbytes};
	}
	r = dlpc__split_copy(map, size, fd, strided ? how & ~DLPC__SPLIT_DROP : how, runs, nruns);
	if (runs != &one)
		free(runs);
	if (r < 0 && quiet)
		return r;
	if (r < 0)
		return dlpc__fail(
			dlpc__space_err(-r),
			"cannot publish '%s': cannot allocate %llu bytes of shared memory: "
			"%s",
			name, (unsigned long long)size, strerror(-r));
	return strided ? write_slots(fd, map, slots, n, true, name) : 0;
}

/* Write the tensors into the fresh memfd @p fd (@p size bytes) through a mapping that asks for
 * huge pages (shmem_enabled "advise"), its pages all allocated first (write_split()). 0 or
 * negative errno. */
static int write_mapped(int fd, uint64_t size, const struct slot *slots, size_t n, const char *name)
{
	uint8_t *map = dlpc__huge_map(fd, (size_t)size, true);
	int r;

	if (!map)
		return write_slots(fd, NULL, slots, n, false, name);
	r = write_split(fd, map, size, DLPC__SPLIT_POPULATE, false, slots, n, name);
	munmap(map, (size_t)size);
	return r;
}

/* The tensors written into a memfd of the hugetlbfs pool, whose size *@p size rounds up to whole
 * huge pages (hugetlbfs has no write(): through a mapping). The fd, or a negative errno (the
 * pool had no room after all: the caller goes on without it). */
static int copy_hugetlb(const char *name, const struct slot *slots, size_t n, uint64_t *size)
{
	uint64_t pmd = dlpc__huge_pmd(), len = (*size + pmd - 1) / pmd * pmd;
	uint8_t *map;
	int fd, r;

	fd = dlpc__memfd_open(name, len, MFD_HUGETLB);
	if (fd < 0)
		return fd;
	map = dlpc__huge_map(fd, (size_t)len, false);
	r = map ? write_split(fd, map, len, DLPC__SPLIT_POPULATE, true, slots, n, name) : -errno;
	if (map)
		munmap(map, (size_t)len);
	if (r < 0) {
		close(fd);
		return r;
	}
	*size = len;
	return fd;
}

/*
 * Write the @p n tensors laid out in @p slots into a new memfd for the publish of @p name, and
 * allocate what the writes left. Its size *@p size, rounded up to whole huge pages for one of
 * the hugetlbfs pool. A memfd of the warm pool has its pages allocated already (and, if large,
 * mapped here, faulted in: the copy is a memcpy() into it, unmapped after); a fresh one has
 * them allocated as they are written (pwrite, not a mapping: no page faults, unless huge pages
 * must be asked for), so memory that cannot be had fails here, at publish, like a reservation
 * would. A copy through a mapping is split over threads (write_split()). The fd or a negative
 * errno.
 */
static int copy_once(const char *name, const struct slot *slots, size_t n, uint64_t *size)
{
	enum dlpc__huge huge = dlpc__huge_for(*size, true);
	size_t map_len;
	void *map;
	int fd, r;

	if (huge == DLPC__HUGE_TLB && (fd = copy_hugetlb(name, slots, n, size)) >= 0)
		return fd;
	fd = dlpc__warm_take(*size, &map, &map_len);
	if (fd >= 0) {
		/* its pages dropped from the mapping by the threads that wrote them: the munmap()
		 * below has little left to do */
		r = map ? write_split(fd, map, *size, DLPC__SPLIT_DROP, false, slots, n, name)
			: write_slots(fd, NULL, slots, n, false, name);
		/* before the seal, whatever the copy gave: the writable mapping bars F_SEAL_WRITE */
		if (map)
			munmap(map, map_len);
	} else {
		fd = dlpc__memfd_create(name, *size, false);
		if (fd < 0)
			return fd;
		r = huge == DLPC__HUGE_ADVISE ? write_mapped(fd, *size, slots, n, name)
					      : write_slots(fd, NULL, slots, n, false, name);
	}
	if (r == 0)
		r = allocate_rest(fd, *size, name);
	if (r < 0) {
		close(fd);
		return r;
	}
	return fd;
}

/* copy_once(), and once more if memory ran out while the warm pool held some: the pool gives
 * it all back first, a publish never fails for it. */
static int copy_out(const char *name, const struct slot *slots, size_t n, uint64_t *size)
{
	int fd = copy_once(name, slots, n, size);

	if (fd == -ENOSPC && dlpc__warm_drop())
		fd = copy_once(name, slots, n, size);
	return fd;
}

/*
 * Publish @p n host tensors laid out in @p slots (@p size bytes) as one sealed memfd, or send
 * them as a message through @p sink (not NULL): the memfd of their one zero-copy allocation
 * (@p zc, or NULL), or one written here. The generation (0 for a message) or a negative errno.
 */
static int publish_host(dlpc_client *c, const char *name, size_t n,
			DLManagedTensorVersioned *const tensors[], const struct slot *slots,
			Dlpackd__V1__TensorDesc **dptrs, uint64_t size, uint32_t flags,
			const struct dlpc__sink *sink, struct dlpc__region *zc)
{
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	int fd = -1, r;

	for (size_t i = 0; i < n; i++)
		if (tensors[i]->dl_tensor.device.device_type != kDLCPU)
			return dlpc__fail(
				-ENOTSUP,
				"cannot publish '%s': %s%s%s is a CUDA tensor and %s%s%s a host "
				"one; a bundle's tensors are all on one device",
				name, SLOT_ARGS(&slots[i]), SLOT_ARGS(&slots[0]));
	if (zc && zc->device)
		zc = NULL;
	if (zc) {
		/* offsets in descs already; a pooled buffer sent as one (with its token) goes as
		 * its read-only descriptor, published as the memfd any allocation's is */
		fd = sink && sink->pool_token ? zc->pool_fd : zc->fd;
		size = zc->len;
	} else {
		size = size ? size : DLPC_ALIGN;
		fd = copy_out(name, slots, n, &size);
		if (fd < 0) {
			r = fd; /* the pool is refilled below all the same */
			goto out;
		}
	}
	/* Sealed read-only is read-only for everyone from now on, this process included (whatever
	 * the daemon answers: a seal cannot be undone). Shares made later say so in their flags. */
	r = zc ? dlpc__region_seal(zc, name, flags & DLPC_PUBLISH_WRITABLE)
	       : dlpc__memfd_seal(fd, name, flags & DLPC_PUBLISH_WRITABLE);
	if (r < 0)
		goto out;

	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.flags = flags;
	req.device_type = kDLCPU;
	req.storage_size = size;
	req.n_tensors = n;
	req.tensors = dptrs;
	if (sink) {
		/* a message has no name of its own */
		req.name.len = 0;
		r = sink->fn(c, sink, &req, fd);
	} else {
		r = send_publish(c, &req, fd);
	}
out:
	if (!zc && fd >= 0)
		close(fd);
	/* a dlpc_alloc() region's size was noted by the pool too (alloc.c): refilled at its first
	 * publish only, so that a buffer published again and again keeps no size alive */
	if (size >= DLPC_WARM_SIZE_MIN && (!zc || atomic_exchange(&zc->warm_noted, false)))
		dlpc__warm_refill(size);
	return r;
}

static int publish(dlpc_client *c, const char *name, size_t n, const char *const keys[],
		   DLManagedTensorVersioned *const tensors[], uint32_t flags,
		   const struct dlpc__sink *sink)
{
	bool kept = false;
	Dlpackd__V1__TensorDesc *descs = NULL, **dptrs = NULL;
	struct slot *slots = NULL;
	struct dlpc__region *zc;
	dlpc_client *held = NULL;
	uint64_t size = 0;
	int r;

	r = publish_args(c, name, n, tensors, keys, flags);
	if (r < 0)
		goto out;
	/* a dlpc_close() from another thread meanwhile must not free the client under us */
	dlpc__client_ref(c);
	held = c;
	slots = calloc(n, sizeof(*slots));
	descs = calloc(n, sizeof(*descs));
	dptrs = calloc(n, sizeof(*dptrs));
	if (!slots || !descs || !dptrs) {
		r = dlpc__fail(-ENOMEM, "cannot publish '%s': out of memory", name);
		goto out;
	}
	r = lay_out(name, n, keys, tensors, slots, descs, dptrs, &size);
	if (r < 0)
		goto out;
	if (sink && tensors[0]->dl_tensor.device.device_type != kDLCPU) {
		r = dlpc__fail(-ENOTSUP, "cannot publish '%s': channels carry host tensors only",
			       name);
		goto out;
	}
	if (n == 1 && tensors[0]->dl_tensor.device.device_type == kDLCUDA) {
		r = publish_cuda(c, name, tensors[0], &slots[0], dptrs, flags, &kept);
		goto out;
	}
	zc = zero_copy_all(tensors, slots, descs, n);
	if (tensors[0]->dl_tensor.device.device_type == kDLCUDA)
		r = publish_cuda_bundle(c, name, n, tensors, slots, dptrs, size, flags, zc);
	else
		r = publish_host(c, name, n, tensors, slots, dptrs, size, flags, sink, zc);
out:
	free(dptrs);
	free(descs);
	free(slots);
	/* ownership passed to us on every path: each deleter runs exactly once */
	for (size_t i = 0; tensors && i < n && !kept; i++)
		if (tensors[i] && tensors[i]->deleter)
			tensors[i]->deleter(tensors[i]);
	if (held)
		dlpc__client_unref(held);
	return r;
}

DLPC_EXPORT int dlpc_publish(dlpc_client *c, const char *name, DLManagedTensorVersioned *t,
			     uint32_t flags)
{
	return publish(c, name, 1, NULL, &t, flags, NULL);
}

DLPC_EXPORT int dlpc_publish_bundle(dlpc_client *c, const char *name, size_t n,
				    const char *const keys[],
				    DLManagedTensorVersioned *const tensors[], uint32_t flags)
{
	return publish(c, name, n, keys, tensors, flags, NULL);
}

int dlpc__publish_to(dlpc_client *c, const char *name, size_t n, const char *const keys[],
		     DLManagedTensorVersioned *const tensors[], uint32_t flags,
		     const struct dlpc__sink *sink)
{
	return publish(c, name, n, keys, tensors, flags, sink);
}
