/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Writes the seed corpus of fuzz_journal (tests/fuzz/corpus-journal/): journals as dlpackd
 * writes them (PUTs of single tensors and bundles, read-only and writable, DELs, replaces,
 * records stored or not, an older journal beside the newest) and the damage a restore must
 * survive (a wrong check, a torn or overlong record, a kind it does not know, a PUT too short
 * or not a Publish, a damaged header, two entries claiming one storage, a storage not passed
 * back or of the wrong kind, fields no publish could have had, an fd that is not dlpackd's).
 *
 *   mkjournal DIR
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "persist.h"
#include "fuzz_journal.h"
#include "seed.h"

/* One record of target kind @p ctl (FJ_REC_* and flag bits) with payload @p p. */
static void record(struct input *in, uint8_t ctl, const void *p, size_t len)
{
	uint8_t h[3] = {ctl, (uint8_t)(len & 0xff), (uint8_t)(len >> 8)};

	seed_add(in, h, sizeof(h));
	seed_add(in, p, len);
}

static void start(struct input *in, uint8_t ctl)
{
	in->len = 0;
	seed_add(in, &ctl, 1);
}

/* What a PUT says besides its name. */
struct put_args {
	uint64_t sid, generation;
	uint32_t uid;
	uint32_t flags;	       /* Publish.flags */
	unsigned ntensors;     /* 0: 1 */
	int32_t device_type;   /* 0: kDLCPU */
	uint64_t storage_size; /* 0: FJ_STORAGE_SIZE */
	uint32_t dtype_bits;   /* 0: 32 */
	size_t ndim;	       /* 0: 2 */
	uint64_t offset;
};

/* A PUT record of entry @p name: the fixed part and the packed Publish. */
static void put(struct input *in, uint8_t flags, const char *name, size_t name_len,
		const struct put_args *a)
{
	Dlpackd__V1__Publish p = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc descs[SEED_TENSORS_MAX], *ptrs[SEED_TENSORS_MAX];
	int64_t shape[40];
	struct dlpd_put_fixed fx = {.sid = a->sid,
				    .generation = a->generation,
				    .uid = a->uid,
				    .pid = 1,
				    .created_ns = 1700000000000000000};
	unsigned n = a->ntensors ? a->ntensors : 1;
	uint8_t payload[4096];
	size_t len;

	for (size_t i = 0; i < sizeof(shape) / sizeof(shape[0]); i++)
		shape[i] = 4;
	seed_tensors(descs, ptrs, n, shape, a->ndim ? a->ndim : 2,
		     a->dtype_bits ? a->dtype_bits : 32, a->offset);
	p.name.data = (uint8_t *)name;
	p.name.len = name_len;
	p.flags = a->flags;
	p.device_type = a->device_type ? a->device_type : 1; /* kDLCPU */
	p.storage_size = a->storage_size ? a->storage_size : FJ_STORAGE_SIZE;
	p.n_tensors = n;
	p.tensors = ptrs;
	len = dlpackd__v1__publish__get_packed_size(&p);
	if (sizeof(fx) + len > sizeof(payload)) {
		fprintf(stderr, "mkjournal: PUT too large\n");
		exit(1);
	}
	memcpy(payload, &fx, sizeof(fx));
	dlpackd__v1__publish__pack(&p, payload + sizeof(fx));
	record(in, (uint8_t)(FJ_REC_PUT | flags), payload, sizeof(fx) + len);
}

#define PUT(in, flags, name, ...)                                                                  \
	put(in, flags, name, strlen(name), &(struct put_args){.generation = 1, __VA_ARGS__})

static void del(struct input *in, const char *name)
{
	record(in, FJ_REC_DEL, name, strlen(name));
}

static const char *dir;

static void save(const char *name, const struct input *in)
{
	seed_save(dir, name, in);
}

#define STORAGES(n, kind) ((uint8_t)((n) | (kind) << FJ_KIND_SHIFT))

int main(int argc, char **argv)
{
	static struct input in;

	if (argc != 2) {
		fprintf(stderr, "usage: mkjournal DIR\n");
		return 2;
	}
	dir = argv[1];

	/* sound journals */
	start(&in, 0);
	save("empty", &in);

	start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
	PUT(&in, 0, "x", .sid = 1);
	save("one", &in);

	start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
	PUT(&in, FJ_REC_STORED, "x", .sid = 1);
	save("one-stored", &in);

	start(&in, STORAGES(1, FJ_FD_MEMFD_RW));
	PUT(&in, 0, "w", .sid = 1, .flags = DLPC_PUBLISH_WRITABLE);
	save("writable", &in);

	start(&in, STORAGES(2, FJ_FD_MEMFD_RO));
	PUT(&in, 0, "bundle", .sid = 1, .ntensors = 4);
	PUT(&in, 0, "y", .sid = 2, .uid = 65534);
	save("bundle-and-other-uid", &in);

	start(&in, STORAGES(2, FJ_FD_MEMFD_RO));
	PUT(&in, 0, "x", .sid = 1);
	PUT(&in, 0, "y", .sid = 2);
	del(&in, "x");
	save("put-del", &in);

	start(&in, STORAGES(2, FJ_FD_MEMFD_RO));
	PUT(&in, 0, "x", .sid = 1);
	put(&in, 0, "x", 1, &(struct put_args){.sid = 2, .generation = 2});
	save("replace", &in);

	start(&in, STORAGES(1, FJ_FD_MEMFD_RO) | FJ_OLDER);
	PUT(&in, 0, "x", .sid = 1);
	save("older-beside", &in);

	/* damage the restore skips, refuses or survives */
	start(&in, STORAGES(1, FJ_FD_MEMFD_RO) | FJ_OLDER | FJ_BAD_HEADER);
	PUT(&in, 0, "x", .sid = 1);
	save("bad-header-older-sound", &in);

	start(&in, STORAGES(2, FJ_FD_MEMFD_RO));
	PUT(&in, FJ_REC_BAD_CHECK, "x", .sid = 1);
	PUT(&in, 0, "y", .sid = 2);
	save("bad-check", &in);

	start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
	PUT(&in, 0, "x", .sid = 1);
	record(&in, FJ_REC_RAW, "torn!", 5);
	save("torn", &in);

	{
		struct dlpd_rec_hdr h = {.len = UINT32_MAX, .kind = DLPD_REC_PUT};

		start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
		record(&in, FJ_REC_RAW, &h, sizeof(h));
		PUT(&in, 0, "x", .sid = 1);
		save("overlong", &in);
	}

	start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
	record(&in, FJ_REC_UNKNOWN, "what", 4);
	PUT(&in, 0, "x", .sid = 1);
	save("unknown-kind", &in);

	start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
	record(&in, FJ_REC_PUT, "short", 5);
	{
		uint8_t junk[sizeof(struct dlpd_put_fixed) + 8] = {1, 0, 0, 0, 0, 0, 0, 0, 1};

		memset(junk + sizeof(struct dlpd_put_fixed), 0xff, 8);
		record(&in, FJ_REC_PUT, junk, sizeof(junk));
	}
	save("not-a-publish", &in);

	start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
	PUT(&in, 0, "a", .sid = 1);
	PUT(&in, 0, "b", .sid = 1);
	save("shared-storage", &in);

	/* the name a check refuses only after the replay has looked it up (found by fuzzing) */
	start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
	put(&in, 0, "", 0, &(struct put_args){.sid = 1, .generation = 1});
	put(&in, 0, "", 0, &(struct put_args){.sid = 1, .generation = 2});
	del(&in, "");
	save("empty-name", &in);

	start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
	PUT(&in, 0, "x", .sid = 5);
	save("storage-missing", &in);

	start(&in, STORAGES(2, FJ_FD_MEMFD_BARE));
	PUT(&in, 0, "x", .sid = 1);
	PUT(&in, 0, "w", .sid = 2, .flags = DLPC_PUBLISH_WRITABLE);
	save("storage-unsealed", &in);

	start(&in, STORAGES(1, FJ_FD_PIPE) | FJ_FOREIGN);
	PUT(&in, 0, "x", .sid = 1);
	save("storage-pipe-and-foreign", &in);

	start(&in, STORAGES(1, FJ_FD_MEMFD_RO));
	PUT(&in, 0, "w", .sid = 1, .flags = DLPC_PUBLISH_WRITABLE);
	save("writable-on-sealed", &in);

	/* fields no publish of an entry that outlives its connection has */
	start(&in, STORAGES(7, FJ_FD_MEMFD_RO));
	PUT(&in, 0, "e", .sid = 1, .flags = DLPC_PUBLISH_EPHEMERAL);
	put(&in, 0, "x", 1, &(struct put_args){.sid = 2, .generation = 0});
	PUT(&in, 0, "cuda", .sid = 3, .device_type = 2);
	PUT(&in, 0, "huge", .sid = 4, .storage_size = (uint64_t)1 << 62);
	PUT(&in, 0, "ndim", .sid = 5, .ndim = 40);
	PUT(&in, 0, "off", .sid = 6, .offset = FJ_STORAGE_SIZE);
	put(&in, 0, "n\0ul", 4, &(struct put_args){.sid = 7, .generation = 1});
	PUT(&in, 0, "bits", .sid = 7, .dtype_bits = 256);
	save("bad-fields", &in);
	return 0;
}
