/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Host tensors end to end: a real dlpackd per test, publishers and attachers in separate
 * processes. Each test names the acceptance point of the core issue it proves.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "limits.h"
#include "raw.h"
#include "table.h"

static struct daemon D;

static void setup(void)
{
	/* every client here is one uid, and test_list alone holds 5003 storages: the suite is
	 * about the operations, not about sharing fds between uids (integration_limits is) */
	static const char *const args[] = {"--max-fd-share-per-uid", "100", NULL};
	struct daemon_opts o = {.args = args};

	daemon_start_with(&D, &o);
}

static void teardown(void)
{
	daemon_stop(&D);
}

/* Deterministic byte pattern so that publisher and attacher agree without sharing memory. */
static uint8_t pattern(unsigned seed, size_t i)
{
	return (uint8_t)(i * 131u + seed * 7u + (i >> 9));
}

static void fill(void *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		((uint8_t *)p)[i] = pattern(seed, i);
}

static bool matches(const void *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		if (((const uint8_t *)p)[i] != pattern(seed, i))
			return false;
	return true;
}

static dlpc_client *child_connect(void)
{
	dlpc_client *c = NULL;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	return c;
}

static bool c_contiguous(const DLTensor *t)
{
	int64_t expect = 1;

	if (t->ndim > 0 && !t->strides)
		return false;
	for (int i = t->ndim - 1; i >= 0; i--) {
		if (t->strides[i] != expect)
			return false;
		expect *= t->shape[i];
	}
	return true;
}

/* ---- 1. publish, exit, attach elsewhere: every byte, read-only, writes fault ---- */

#define BIG 1024

static int publish_big(void *arg)
{
	dlpc_client *c = child_connect();
	int64_t shape[2] = {BIG, BIG};
	float *data = malloc(sizeof(float) * BIG * BIG);
	int deleted = 0;

	(void)arg;
	CHILD_CHECK(data);
	for (size_t i = 0; i < BIG * BIG; i++)
		data[i] = (float)i * 0.5f;
	CHILD_CHECK(dlpc_publish(c, "big",
				 host_tensor(data, (DLDataType){kDLFloat, 32, 1}, 2, shape, NULL,
					     &deleted),
				 0) == 1);
	CHILD_CHECK(deleted == 1); /* copied, so the deleter ran at once */
	free(data);
	dlpc_close(c);
	return 0;
}

static int attach_big(void *arg)
{
	dlpc_client *c = child_connect();
	DLManagedTensorVersioned *t;
	const float *v;
	pid_t pid;
	int st;

	(void)arg;
	CHILD_CHECK(dlpc_attach(c, "big", NULL, &t) == 1);
	CHILD_CHECK(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
	CHILD_CHECK(t->dl_tensor.ndim == 2 && t->dl_tensor.shape[0] == BIG &&
		    t->dl_tensor.shape[1] == BIG);
	CHILD_CHECK(t->dl_tensor.dtype.code == kDLFloat && t->dl_tensor.dtype.bits == 32);
	CHILD_CHECK(c_contiguous(&t->dl_tensor) && t->dl_tensor.byte_offset == 0);
	CHILD_CHECK((uintptr_t)t->dl_tensor.data % DLPC_ALIGN == 0);
	v = t->dl_tensor.data;
	for (size_t i = 0; i < BIG * BIG; i++)
		CHILD_CHECK(v[i] == (float)i * 0.5f);
	/* a write through the pointer must fault: try it in a forked copy of this process */
	pid = fork();
	if (pid == 0) {
		*(volatile float *)t->dl_tensor.data = 1.0f;
		_exit(0);
	}
	CHILD_CHECK(waitpid(pid, &st, 0) == pid);
	CHILD_CHECK(WIFSIGNALED(st) && (WTERMSIG(st) == SIGSEGV || WTERMSIG(st) == SIGBUS));
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

static bool no_refs(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->references == 0;
}

START_TEST(test_publish_exit_attach)
{
	dlpc_client *c;

	ck_assert_int_eq(wait_child(spawn(publish_big, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(attach_big, NULL)), 0);
	c = connect_or_die(&D);
	ck_assert(wait_stat(c, no_refs, NULL, 1000));
	ck_assert_uint_eq(stat_or_die(c).entries, 1);
	dlpc_close(c);
}
END_TEST

/* ---- 2. every dtype, ndim 0..8, empty tensors, strided sources ---- */

static const struct {
	const char *name;
	DLDataType dt;
} dtypes[] = {
	{"int8", {kDLInt, 8, 1}},	    {"int16", {kDLInt, 16, 1}},
	{"int32", {kDLInt, 32, 1}},	    {"int64", {kDLInt, 64, 1}},
	{"uint8", {kDLUInt, 8, 1}},	    {"uint16", {kDLUInt, 16, 1}},
	{"uint32", {kDLUInt, 32, 1}},	    {"uint64", {kDLUInt, 64, 1}},
	{"float16", {kDLFloat, 16, 1}},	    {"float32", {kDLFloat, 32, 1}},
	{"float64", {kDLFloat, 64, 1}},	    {"bfloat16", {kDLBfloat, 16, 1}},
	{"complex64", {kDLComplex, 64, 1}}, {"complex128", {kDLComplex, 128, 1}},
	{"bool", {kDLBool, 8, 1}},
};
#define NDTYPES (sizeof(dtypes) / sizeof(dtypes[0]))

static const int64_t nd_shape[8] = {2, 3, 1, 2, 2, 1, 3, 2};
static const int64_t empty_shapes[2][3] = {{0, 4, 0}, {3, 0, 2}};

static size_t numel(const int64_t *shape, int ndim)
{
	size_t n = 1;

	for (int i = 0; i < ndim; i++)
		n *= (size_t)shape[i];
	return n;
}

/* The strided sources: a 6x4 int32 matrix seen transposed, every other row, and a 3-d permute. */
static int32_t base_matrix[6][4];

static int32_t strided_expect(int which, size_t i)
{
	switch (which) {
	case 0: /* transposed: shape 4x6, strides {1, 4} */
		return base_matrix[i % 6][i / 6];
	case 1: /* rows 0, 2, 4: shape 3x4, strides {8, 1} */
		return base_matrix[(i / 4) * 2][i % 4];
	default: /* as 2x3x4 (strides 12,4,1) permuted to 4x2x3: strides {1, 12, 4} */
		return ((int32_t *)base_matrix)[(i % 3) * 4 + ((i / 3) % 2) * 12 + i / 6];
	}
}

static const int64_t strided_shape[3][3] = {{4, 6}, {3, 4}, {4, 2, 3}};
static const int64_t strided_strides[3][3] = {{1, 4}, {8, 1}, {1, 12, 4}};
static const int strided_ndim[3] = {2, 2, 3};

static int publish_matrix(void *arg)
{
	dlpc_client *c = child_connect();
	static uint8_t buf[4096];
	int64_t shape[2] = {3, 5};
	char name[64];

	(void)arg;
	for (size_t k = 0; k < NDTYPES; k++) {
		size_t n = 15 * dtypes[k].dt.bits / 8;

		fill(buf, n, (unsigned)k);
		snprintf(name, sizeof(name), "dt/%s", dtypes[k].name);
		CHILD_CHECK(dlpc_publish(c, name,
					 host_tensor(buf, dtypes[k].dt, 2, shape, NULL, NULL),
					 0) == 1);
	}
	for (int nd = 0; nd <= 8; nd++) {
		fill(buf, numel(nd_shape, nd) * 4, 100u + (unsigned)nd);
		snprintf(name, sizeof(name), "nd/%d", nd);
		CHILD_CHECK(dlpc_publish(c, name,
					 host_tensor(buf, (DLDataType){kDLFloat, 32, 1}, nd,
						     nd_shape, NULL, NULL),
					 0) == 1);
	}
	for (int k = 0; k < 2; k++) {
		snprintf(name, sizeof(name), "empty/%d", k);
		CHILD_CHECK(dlpc_publish(c, name,
					 host_tensor(NULL, (DLDataType){kDLFloat, 64, 1}, 3,
						     empty_shapes[k], NULL, NULL),
					 0) == 1);
	}
	for (int k = 0; k < 3; k++) {
		snprintf(name, sizeof(name), "strided/%d", k);
		CHILD_CHECK(dlpc_publish(c, name,
					 host_tensor(base_matrix, (DLDataType){kDLInt, 32, 1},
						     strided_ndim[k], strided_shape[k],
						     strided_strides[k], NULL),
					 0) == 1);
	}
	dlpc_close(c);
	return 0;
}

static DLManagedTensorVersioned *child_attach(dlpc_client *c, const char *name)
{
	DLManagedTensorVersioned *t = NULL;

	CHILD_CHECK(dlpc_attach(c, name, NULL, &t) == 1);
	CHILD_CHECK(t->version.major == DLPACK_MAJOR_VERSION);
	CHILD_CHECK(t->dl_tensor.device.device_type == kDLCPU);
	CHILD_CHECK(t->dl_tensor.byte_offset == 0);
	CHILD_CHECK((uintptr_t)t->dl_tensor.data % DLPC_ALIGN == 0);
	CHILD_CHECK(t->dl_tensor.ndim == 0 || c_contiguous(&t->dl_tensor));
	return t;
}

static int check_matrix(void *arg)
{
	dlpc_client *c = child_connect();
	DLManagedTensorVersioned *t;
	char name[64];

	(void)arg;
	for (size_t k = 0; k < NDTYPES; k++) {
		snprintf(name, sizeof(name), "dt/%s", dtypes[k].name);
		t = child_attach(c, name);
		CHILD_CHECK(memcmp(&t->dl_tensor.dtype, &dtypes[k].dt, sizeof(DLDataType)) == 0);
		CHILD_CHECK(t->dl_tensor.ndim == 2 && t->dl_tensor.shape[0] == 3 &&
			    t->dl_tensor.shape[1] == 5);
		CHILD_CHECK(matches(t->dl_tensor.data, 15 * dtypes[k].dt.bits / 8, (unsigned)k));
		t->deleter(t);
	}
	for (int nd = 0; nd <= 8; nd++) {
		snprintf(name, sizeof(name), "nd/%d", nd);
		t = child_attach(c, name);
		CHILD_CHECK(t->dl_tensor.ndim == nd);
		for (int i = 0; i < nd; i++)
			CHILD_CHECK(t->dl_tensor.shape[i] == nd_shape[i]);
		CHILD_CHECK(
			matches(t->dl_tensor.data, numel(nd_shape, nd) * 4, 100u + (unsigned)nd));
		t->deleter(t);
	}
	for (int k = 0; k < 2; k++) {
		snprintf(name, sizeof(name), "empty/%d", k);
		t = child_attach(c, name);
		CHILD_CHECK(t->dl_tensor.ndim == 3 && t->dl_tensor.data != NULL);
		for (int i = 0; i < 3; i++)
			CHILD_CHECK(t->dl_tensor.shape[i] == empty_shapes[k][i]);
		t->deleter(t);
	}
	for (int k = 0; k < 3; k++) {
		const int32_t *v;

		snprintf(name, sizeof(name), "strided/%d", k);
		t = child_attach(c, name);
		CHILD_CHECK(t->dl_tensor.ndim == strided_ndim[k]);
		for (int i = 0; i < strided_ndim[k]; i++)
			CHILD_CHECK(t->dl_tensor.shape[i] == strided_shape[k][i]);
		v = t->dl_tensor.data;
		for (size_t i = 0; i < numel(strided_shape[k], strided_ndim[k]); i++)
			CHILD_CHECK(v[i] == strided_expect(k, i));
		t->deleter(t);
	}
	dlpc_close(c);
	return 0;
}

START_TEST(test_dtype_matrix)
{
	for (int i = 0; i < 24; i++)
		((int32_t *)base_matrix)[i] = i * 10 + 1;
	ck_assert_int_eq(wait_child(spawn(publish_matrix, NULL)), 0);
	ck_assert_int_eq(wait_child(spawn(check_matrix, NULL)), 0);
}
END_TEST

/* ---- 3. a bundle of 1,000 tensors: one round trip, one mapping ---- */

#define NBUNDLE 1000

static int publish_bundle(void *arg)
{
	dlpc_client *c = child_connect();
	DLManagedTensorVersioned *ts[NBUNDLE];
	char *keys[NBUNDLE];
	static int32_t data[NBUNDLE][8];
	int64_t shape[1] = {8};
	int deleted = 0;

	(void)arg;
	for (int i = 0; i < NBUNDLE; i++) {
		for (int j = 0; j < 8; j++)
			data[i][j] = i * 8 + j;
		CHILD_CHECK(asprintf(&keys[i], "layer.%d.weight", i) > 0);
		ts[i] = host_tensor(data[i], (DLDataType){kDLInt, 32, 1}, 1, shape, NULL, &deleted);
	}
	CHILD_CHECK(dlpc_publish_bundle(c, "model", NBUNDLE, (const char *const *)keys, ts, 0) ==
		    1);
	CHILD_CHECK(deleted == NBUNDLE);
	for (int i = 0; i < NBUNDLE; i++)
		free(keys[i]);
	dlpc_close(c);
	return 0;
}

START_TEST(test_bundle_one_round_trip)
{
	static int32_t one[2] = {5, 6};
	const char *wkey = "w";
	int64_t two = 2;
	dlpc_client *c;
	dlpc_stats before, after;
	dlpc_bundle *b;
	DLManagedTensorVersioned *kept;
	int maps;

	ck_assert_int_eq(wait_child(spawn(publish_bundle, NULL)), 0);
	c = connect_or_die(&D);
	maps = dlpc_mappings();
	before = stat_or_die(c);
	ck_assert_dlpc(dlpc_attach_bundle(c, "model", NULL, &b), 1);
	after = stat_or_die(c);
	/* one ATTACH request, one fd, one reference, one mapping for 1,000 tensors */
	ck_assert_uint_eq(after.req_attach - before.req_attach, 1);
	ck_assert_uint_eq(after.fds_sent - before.fds_sent, 1);
	ck_assert_uint_eq(after.references - before.references, 1);
	ck_assert_int_eq(dlpc_mappings() - maps, 1);
	ck_assert_uint_eq(dlpc_bundle_count(b), NBUNDLE);
	for (size_t i = 0; i < NBUNDLE; i++) {
		char key[32];
		DLManagedTensorVersioned *t;
		const int32_t *v;

		snprintf(key, sizeof(key), "layer.%zu.weight", i);
		ck_assert_str_eq(dlpc_bundle_key(b, i), key);
		t = dlpc_bundle_take(b, i);
		ck_assert_ptr_nonnull(t);
		ck_assert_ptr_null(dlpc_bundle_take(b, i));
		v = t->dl_tensor.data;
		for (int j = 0; j < 8; j++)
			ck_assert_int_eq(v[j], (int32_t)i * 8 + j);
		if (i == 7)
			kept = t;
		else
			t->deleter(t);
	}
	ck_assert_ptr_null(dlpc_bundle_key(b, NBUNDLE));
	/* the mapping outlives the bundle while one tensor lives */
	dlpc_bundle_free(b);
	ck_assert_uint_eq(stat_or_die(c).references, 1);
	ck_assert_int_eq(((const int32_t *)kept->dl_tensor.data)[3], 7 * 8 + 3);
	kept->deleter(kept);
	ck_assert(wait_stat(c, no_refs, NULL, 1000));
	ck_assert_int_eq(dlpc_mappings(), maps);
	/* a bundle of several refuses to attach as one tensor, with a clear message */
	ck_assert_dlpc(dlpc_attach(c, "model", NULL, &kept), -EINVAL);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "bundle of 1000"));
	/* and so does a bundle of one tensor under a key, attached as a bundle (and cached as
	 * such) first: a single tensor's key is "", and dlpc_attach() would lose this one's */
	kept = host_tensor(one, (DLDataType){kDLInt, 32, 1}, 1, &two, NULL, NULL);
	ck_assert_dlpc(dlpc_publish_bundle(c, "one", 1, &wkey, &kept, 0), 1);
	ck_assert_dlpc(dlpc_attach_bundle(c, "one", NULL, &b), 1);
	ck_assert_str_eq(dlpc_bundle_key(b, 0), "w");
	dlpc_bundle_free(b);
	ck_assert_dlpc(dlpc_attach(c, "one", NULL, &kept), -EINVAL);
	ck_assert_msg(strstr(dlpc_last_error(), "bundle of one tensor, under the key 'w'"), "%s",
		      dlpc_last_error());
	ck_assert_dlpc(dlpc_unpublish(c, "one"), 0);
	dlpc_close(c);
}
END_TEST

/* ---- 4. REPLACE while attached; 5. UNPUBLISH while attached ---- */

struct pub_args {
	const char *name;
	unsigned seed;
	size_t bytes;
	uint32_t flags;
	int expect_gen;
};

static int publish_bytes(void *arg)
{
	const struct pub_args *a = arg;
	dlpc_client *c = child_connect();
	uint8_t *buf = malloc(a->bytes);
	int64_t shape[1] = {(int64_t)a->bytes};

	CHILD_CHECK(buf);
	fill(buf, a->bytes, a->seed);
	CHILD_CHECK(
		dlpc_publish(c, a->name,
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     a->flags) == a->expect_gen);
	free(buf);
	dlpc_close(c);
	return 0;
}

static int attach_expect(void *arg)
{
	const struct pub_args *a = arg;
	dlpc_client *c = child_connect();
	DLManagedTensorVersioned *t;

	CHILD_CHECK(dlpc_attach(c, a->name, NULL, &t) == a->expect_gen);
	CHILD_CHECK(matches(t->dl_tensor.data, a->bytes, a->seed));
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* The created_ns of @p name's entry, as LIST reports it (0 if absent). */
static int64_t created_of(dlpc_client *c, const char *name, uint64_t *generation)
{
	dlpc_entry_info *list;
	int64_t created = 0;
	size_t n;

	ck_assert_dlpc(dlpc_list(c, name, &list, &n), 0);
	for (size_t i = 0; i < n; i++)
		if (!strcmp(list[i].name, name)) {
			created = list[i].created_ns;
			*generation = list[i].generation;
		}
	dlpc_list_free(list, n);
	return created;
}

struct unpub_args {
	const char *name;
	uint64_t generation;
	int64_t created_ns;
	int expect;
};

/* As uid nobody: dlpc_unpublish_if() returns a->expect. */
static int unpublish_as_nobody(void *arg)
{
	const struct unpub_args *a = arg;
	dlpc_client *c;

	become_nobody();
	c = child_connect();
	CHILD_CHECK(dlpc_unpublish_if(c, a->name, a->generation, a->created_ns) == a->expect);
	dlpc_close(c);
	return 0;
}

/* UNPUBLISH with an expected generation and creation (1.11): removes only that entry, checked
 * and removed in one step by the daemon; anything else is refused with ESTALE, changing nothing. */
START_TEST(test_unpublish_if)
{
	struct pub_args v1 = {"cond", 1, 4096, 0, 1};
	struct pub_args v2 = {"cond", 2, 4096, DLPC_PUBLISH_REPLACE, 2};
	dlpc_client *c = connect_or_die(&D);
	uint64_t gen = 0, gen2 = 0, gen_new = 0;
	int64_t created1, created2, created_new;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v1)), 0);
	created1 = created_of(c, "cond", &gen);
	ck_assert_uint_eq(gen, 1);
	ck_assert_int_gt(created1, 0);
	/* another generation expected, or the right one created at another time: refused */
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 2, 0), -ESTALE);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "cannot unpublish 'cond'"));
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "not the expected generation 2"));
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 1, created1 + 1), -ESTALE);
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 0, created1 - 1), -ESTALE);
	ck_assert_int_eq(created_of(c, "cond", &gen), created1);
	ck_assert_uint_eq(stat_or_die(c).entries, 1);
	/* another process replaced it: the expectation of generation 1 no longer removes it */
	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v2)), 0);
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 1, created1), -ESTALE);
	created2 = created_of(c, "cond", &gen2);
	ck_assert_uint_eq(gen2, 2);
	ck_assert_int_gt(created2, created1);
	/* another uid is refused as before, whatever it expects */
	daemon_open_for_others(&D);
	{
		struct unpub_args right = {"cond", 2, created2, -EPERM};
		struct unpub_args wrong = {"cond", 1, created1, -EPERM};

		ck_assert_int_eq(wait_child(spawn(unpublish_as_nobody, &right)), 0);
		ck_assert_int_eq(wait_child(spawn(unpublish_as_nobody, &wrong)), 0);
	}
	ck_assert_int_eq(created_of(c, "cond", &gen), created2);
	/* the expected generation and creation: removed */
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 2, created2), 0);
	ck_assert_uint_eq(stat_or_die(c).entries, 0);
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 2, created2), -ENOENT);
	/* freed, then published anew by another process: generation 1 again, but not the entry a
	 * stale expectation of the first generation 1 means */
	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v1)), 0);
	created_new = created_of(c, "cond", &gen_new);
	ck_assert_uint_eq(gen_new, 1);
	ck_assert_int_ne(created_new, created1);
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 1, created1), -ESTALE);
	ck_assert_int_eq(created_of(c, "cond", &gen), created_new);
	/* generation alone, both 0 (unconditional), the current creation alone: each removes */
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 1, 0), 0);
	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v1)), 0);
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 0, 0), 0);
	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v1)), 0);
	ck_assert_dlpc(dlpc_unpublish_if(c, "cond", 0, created_of(c, "cond", &gen)), 0);
	ck_assert_uint_eq(stat_or_die(c).entries, 0);
	/* what a publish made, as its publisher learns it from the reply */
	{
		uint8_t buf[64] = {0};
		int64_t shape[1] = {64}, ns = 0;
		uint64_t g = 0;
		dlpc_client *other = connect_or_die(&D);

		ck_assert_dlpc(dlpc_last_published(c, &g, &ns), -ENOENT);
		ck_assert_dlpc(dlpc_publish(c, "mine",
					    host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape,
							NULL, NULL),
					    0),
			       1);
		ck_assert_dlpc(dlpc_last_published(c, &g, &ns), 0);
		ck_assert_dlpc(dlpc_last_published(other, &g, NULL), -ENOENT);
		ck_assert_uint_eq(g, 1);
		ck_assert_int_eq(ns, created_of(c, "mine", &gen));
		ck_assert_dlpc(dlpc_unpublish_if(other, "mine", g, ns + 1), -ESTALE);
		ck_assert_dlpc(dlpc_unpublish_if(other, "mine", g, ns), 0);
		dlpc_close(other);
	}
	ck_assert_dlpc(dlpc_unpublish_if(NULL, "cond", 1, 0), -EINVAL);
	ck_assert_dlpc(dlpc_unpublish_if(c, "", 1, 0), -EINVAL);
	ck_assert_str_eq(
		dlpc_strerror(-ESTALE),
		"the name holds another entry than the one expected (replaced or published "
		"anew)");
	dlpc_close(c);
}
END_TEST

/* A dlpackd of another protocol minor on a listening socket: answers HELLO with @p minor, then
 * expects the client to hang up without another frame. */
struct other_daemon {
	int lfd;
	uint32_t minor;
};

static int other_minor_daemon(void *arg)
{
	const struct other_daemon *o = arg;
	Dlpackd__V1__HelloReply hr = DLPACKD__V1__HELLO_REPLY__INIT;
	struct dlpc__hdr h;
	uint8_t buf[4096];
	int fd = accept(o->lfd, NULL, NULL);

	CHILD_CHECK(fd >= 0);
	CHILD_CHECK(raw_recv(fd, &h, buf, sizeof(buf)) == 1 && h.type == DLPC_MSG_HELLO);
	hr.version_major = DLPC_PROTO_MAJOR;
	hr.version_minor = o->minor;
	hr.server = "dlpackd of another build";
	hr.max_frame = DLPC_FRAME_MAX;
	raw_send(fd, DLPC_MSG_HELLO | DLPC_MSG_REPLY, h.id, &hr.base, NULL, 0);
	CHILD_CHECK(raw_recv(fd, &h, buf, sizeof(buf)) == 0);
	close(fd);
	return 0;
}

/* One protocol version: libdlpc refuses a daemon that answers HELLO with another minor, older
 * or newer (-EPROTO), and says which versions met and what to do. */
START_TEST(test_connect_other_minor)
{
	const uint32_t minors[] = {DLPC_PROTO_MINOR - 1, DLPC_PROTO_MINOR + 1};
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	char want[128];

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/other.sock", D.dir);
	for (size_t i = 0; i < sizeof(minors) / sizeof(minors[0]); i++) {
		struct other_daemon o = {.lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0),
					 .minor = minors[i]};
		dlpc_client *c = NULL;
		pid_t pid;

		ck_assert_int_ge(o.lfd, 0);
		unlink(sa.sun_path);
		ck_assert_int_eq(bind(o.lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
		ck_assert_int_eq(listen(o.lfd, 1), 0);
		pid = spawn(other_minor_daemon, &o);
		close(o.lfd);
		ck_assert_dlpc(dlpc_connect(sa.sun_path, &c), -EPROTO);
		ck_assert_ptr_null(c);
		snprintf(want, sizeof(want), "libdlpc speaks %d.%d", DLPC_PROTO_MAJOR,
			 DLPC_PROTO_MINOR);
		ck_assert_msg(strstr(dlpc_last_error(), want), "%s", dlpc_last_error());
		snprintf(want, sizeof(want), "speaks %d.%u;", DLPC_PROTO_MAJOR, minors[i]);
		ck_assert_msg(strstr(dlpc_last_error(), want), "%s", dlpc_last_error());
		ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "same build"));
		ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "restart dlpackd"));
		ck_assert_int_eq(wait_child(pid), 0);
	}
	unlink(sa.sun_path);
}
END_TEST

/* ---- a socket that is not a dlpackd we trust: what it hands out is checked before mapping ---- */

#define LIE_SIZE (16u << 20) /* what the lying daemon says its storage holds */

/* How the lying daemon's storage differs from what its ATTACH reply says. */
enum lie { LIE_SMALLER, LIE_UNSEALED, LIE_WRITABLE, LIE_NONE, LIE_COUNT };

/* A daemon that answers HELLO, then each ATTACH (lie i for the i-th) with one uint8 tensor of
 * LIE_SIZE bytes, read-only, over a memfd that is not what it says. */
static int lying_daemon(void *arg)
{
	const struct other_daemon *o = arg;
	Dlpackd__V1__HelloReply hr = DLPACKD__V1__HELLO_REPLY__INIT;
	Dlpackd__V1__TensorDesc d = DLPACKD__V1__TENSOR_DESC__INIT, *dp = &d;
	int64_t shape[1] = {LIE_SIZE};
	uint8_t buf[4096], table[256];
	struct dlpc__hdr h;
	int fd = accept(o->lfd, NULL, NULL);

	CHILD_CHECK(fd >= 0);
	CHILD_CHECK(raw_recv(fd, &h, buf, sizeof(buf)) == 1 && h.type == DLPC_MSG_HELLO);
	hr.version_major = DLPC_PROTO_MAJOR;
	hr.version_minor = DLPC_PROTO_MINOR;
	hr.server = "a socket that lies";
	hr.max_frame = DLPC_FRAME_MAX;
	raw_send(fd, DLPC_MSG_HELLO | DLPC_MSG_REPLY, h.id, &hr.base, NULL, 0);
	d.dtype_code = kDLUInt;
	d.dtype_bits = 8;
	d.dtype_lanes = 1;
	d.n_shape = 1;
	d.shape = shape;
	CHILD_CHECK(dlpc__table_size(&dp, 1) <= sizeof(table));
	dlpc__table_encode(&dp, 1, table);
	for (int lie = 0; raw_recv(fd, &h, buf, sizeof(buf)) == 1;) {
		Dlpackd__V1__AttachReply r = DLPACKD__V1__ATTACH_REPLY__INIT;
		const int all = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL;
		int storage;

		if (h.type == DLPC_MSG_LIST) {
			/* the same page again and again, each saying there is more */
			Dlpackd__V1__ListReply lr = DLPACKD__V1__LIST_REPLY__INIT;
			Dlpackd__V1__EntryInfo e = DLPACKD__V1__ENTRY_INFO__INIT, *ep = &e;
			Dlpackd__V1__ChannelInfo ci = DLPACKD__V1__CHANNEL_INFO__INIT, *cp = &ci;

			e.name.data = (uint8_t *)"e";
			e.name.len = 1;
			ci.name = e.name;
			lr.n_entries = lr.n_channels = 1;
			lr.entries = &ep;
			lr.channels = &cp;
			lr.more = true;
			raw_send(fd, DLPC_MSG_LIST | DLPC_MSG_REPLY, h.id, &lr.base, NULL, 0);
			continue;
		}
		if (h.type != DLPC_MSG_ATTACH)
			continue; /* (the RELEASE of what the client refused) */
		CHILD_CHECK(lie < LIE_COUNT);
		storage = lie == LIE_SMALLER	? memfd_sealed(4096, all)
			  : lie == LIE_UNSEALED ? memfd_sealed(LIE_SIZE, F_SEAL_WRITE)
			  : lie == LIE_WRITABLE ? memfd_sealed(LIE_SIZE, all & ~F_SEAL_WRITE)
						: memfd_sealed(LIE_SIZE, all);
		r.generation = 1;
		r.ref_id = (uint64_t)lie + 1;
		r.device_type = kDLCPU;
		r.storage_size = LIE_SIZE;
		r.tensor_table.data = table;
		r.tensor_table.len = dlpc__table_size(&dp, 1);
		raw_send(fd, DLPC_MSG_ATTACH | DLPC_MSG_REPLY, h.id, &r.base, &storage, 1);
		close(storage);
		lie++;
	}
	close(fd);
	return 0;
}

/* A socket that passes for dlpackd (one of another uid named by $DLPACKD_SOCKET, say) hands out
 * a memfd smaller than it says, one that can shrink, or a writable one as read-only: libdlpc
 * refuses each (-EPROTO) rather than map it, so that no read of the tensor faults with SIGBUS,
 * and keeps no fd of them. A sound reply still attaches, and reads its last byte. A LIST that
 * sends the same page for ever ends with -EPROTO, not a loop. */
START_TEST(test_attach_from_a_lying_daemon)
{
	static const char *const says[] = {"of 4096 bytes for tensors of 16777216", "resizing",
					   "resizing and writes"};
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct other_daemon o = {.lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)};
	DLManagedTensorVersioned *t;
	dlpc_channel_info *channels;
	dlpc_entry_info *entries;
	dlpc_client *c = NULL;
	size_t n;
	int before;
	pid_t pid;

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/liar.sock", D.dir);
	ck_assert_int_ge(o.lfd, 0);
	unlink(sa.sun_path);
	ck_assert_int_eq(bind(o.lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	ck_assert_int_eq(listen(o.lfd, 1), 0);
	pid = spawn(lying_daemon, &o);
	close(o.lfd);
	ck_assert_dlpc(dlpc_connect(sa.sun_path, &c), 0);
	before = fd_count(getpid());
	for (int lie = 0; lie < LIE_NONE; lie++) {
		ck_assert_dlpc(dlpc_attach(c, "w", NULL, &t), -EPROTO);
		ck_assert_msg(strstr(dlpc_last_error(), says[lie]), "lie %d: %s", lie,
			      dlpc_last_error());
		ck_assert_int_eq(fd_count(getpid()), before);
	}
	ck_assert_dlpc(dlpc_attach(c, "w", NULL, &t), 1);
	ck_assert_int_eq(((volatile uint8_t *)t->dl_tensor.data)[LIE_SIZE - 1], 0);
	t->deleter(t);
	ck_assert_dlpc(dlpc_list(c, NULL, &entries, &n), -EPROTO);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "does not advance"));
	ck_assert_dlpc(dlpc_channel_list(c, NULL, &channels, &n), -EPROTO);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "does not advance"));
	dlpc_close(c);
	ck_assert_int_eq(wait_child(pid), 0);
	unlink(sa.sun_path);
}
END_TEST

START_TEST(test_replace_while_attached)
{
	struct pub_args v1 = {"w", 1, 1 << 20, 0, 1};
	struct pub_args v2 = {"w", 2, 3 << 20, DLPC_PUBLISH_REPLACE, 2};
	struct pub_args taken = {"w", 3, 4096, 0, -EEXIST};
	DLManagedTensorVersioned *old;
	dlpc_client *c = connect_or_die(&D);
	dlpc_stats s;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v1)), 0);
	ck_assert_dlpc(dlpc_attach(c, "w", NULL, &old), 1);
	ck_assert_int_eq(wait_child(spawn(publish_bytes, &taken)), 0);
	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v2)), 0);
	s = stat_or_die(c);
	ck_assert_uint_eq(s.storages, 2);
	ck_assert_uint_eq(s.bytes_held, (1 << 20) + (3 << 20));
	/* the old holder keeps the old bytes; a new attacher sees generation 2 */
	ck_assert(matches(old->dl_tensor.data, 1 << 20, 1));
	ck_assert_int_eq(wait_child(spawn(attach_expect, &v2)), 0);
	old->deleter(old);
	ck_assert(wait_stat(c, no_refs, NULL, 1000));
	s = stat_or_die(c);
	ck_assert_uint_eq(s.storages, 1);
	ck_assert_uint_eq(s.bytes_held, 3 << 20);
	dlpc_close(c);
}
END_TEST

START_TEST(test_unpublish_while_attached)
{
	struct pub_args v1 = {"gone", 5, 1 << 20, 0, 1};
	DLManagedTensorVersioned *t;
	dlpc_client *c = connect_or_die(&D);
	dlpc_stats s;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v1)), 0);
	ck_assert_dlpc(dlpc_attach(c, "gone", NULL, &t), 1);
	ck_assert_dlpc(dlpc_unpublish(c, "gone"), 0);
	ck_assert_dlpc(dlpc_unpublish(c, "gone"), -ENOENT);
	s = stat_or_die(c);
	ck_assert_uint_eq(s.entries, 0);
	ck_assert_uint_eq(s.storages, 1);
	ck_assert_uint_eq(s.bytes_held, 1 << 20);
	ck_assert(matches(t->dl_tensor.data, 1 << 20, 5));
	t->deleter(t);
	ck_assert(wait_stat(c, no_refs, NULL, 1000));
	s = stat_or_die(c);
	ck_assert_uint_eq(s.storages, 0);
	ck_assert_uint_eq(s.bytes_held, 0);
	dlpc_close(c);
}
END_TEST

/* ---- 6. SIGKILL of a holder: its references are gone within 100 ms ---- */

static int hold_100(void *arg)
{
	int *pipefd = arg;
	dlpc_client *c = child_connect();
	DLManagedTensorVersioned *t;

	for (int i = 0; i < 100; i++)
		CHILD_CHECK(dlpc_attach(c, "held", NULL, &t) == 1);
	CHILD_CHECK(write(pipefd[1], "k", 1) == 1);
	pause();
	return 0;
}

struct want {
	uint64_t refs;
};

static bool refs_are(const dlpc_stats *s, void *arg)
{
	return s->references == ((struct want *)arg)->refs;
}

START_TEST(test_sigkill_drops_references)
{
	struct pub_args v = {"held", 9, 4096, 0, 1};
	struct want w100 = {100}, w0 = {0};
	dlpc_client *c = connect_or_die(&D);
	int pipefd[2];
	pid_t pid;
	char ch;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v)), 0);
	ck_assert_int_eq(pipe(pipefd), 0);
	pid = spawn(hold_100, pipefd);
	ck_assert_int_eq(read(pipefd[0], &ch, 1), 1);
	ck_assert(wait_stat(c, refs_are, &w100, 1000));
	ck_assert_int_eq(kill(pid, SIGKILL), 0);
	ck_assert_int_eq(wait_child(pid), 128 + SIGKILL);
	/* from the holder's death, not from any later call of ours */
	ck_assert_msg(wait_stat(c, refs_are, &w0, 100), "references outlived the killed holder");
	ck_assert_uint_eq(stat_or_die(c).storages, 1);
	close(pipefd[0]);
	close(pipefd[1]);
	dlpc_close(c);
}
END_TEST

/* ---- 7. EPHEMERAL names vanish with their publisher; default ones stay ---- */

static int publish_two_and_exit(void *arg)
{
	struct pub_args e = {"eph", 1, 100, DLPC_PUBLISH_EPHEMERAL, 1};
	struct pub_args p = {"perm", 2, 100, 0, 1};
	dlpc_client *c = child_connect();
	uint8_t buf[100];
	int64_t shape[1] = {100};

	(void)arg;
	fill(buf, 100, e.seed);
	CHILD_CHECK(
		dlpc_publish(c, e.name,
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     e.flags) == 1);
	fill(buf, 100, p.seed);
	CHILD_CHECK(
		dlpc_publish(c, p.name,
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     p.flags) == 1);
	/* while the publisher lives, both are there */
	DLManagedTensorVersioned *t;
	CHILD_CHECK(dlpc_attach(c, "eph", NULL, &t) == 1);
	t->deleter(t);
	_exit(0); /* no dlpc_close: the connection ends with the process */
}

static bool one_entry_gone(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->entries == 0 && s->connections == 1;
}

static bool one_entry(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->entries == 1;
}

START_TEST(test_ephemeral)
{
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t;

	ck_assert_int_eq(wait_child(spawn(publish_two_and_exit, NULL)), 0);
	ck_assert(wait_stat(c, one_entry, NULL, 1000));
	ck_assert_dlpc(dlpc_attach(c, "eph", NULL, &t), -ENOENT);
	ck_assert_dlpc(dlpc_attach(c, "perm", NULL, &t), 1);
	ck_assert(matches(t->dl_tensor.data, 100, 2));
	t->deleter(t);
	dlpc_close(c);
}
END_TEST

/* ---- 8. attach waits for a later publish; expiry; timeout 0 ---- */

static int publish_late(void *arg)
{
	struct pub_args *a = arg;

	usleep(200 * 1000);
	return publish_bytes(a);
}

START_TEST(test_attach_wait)
{
	struct pub_args late = {"late", 4, 1000, 0, 1};
	dlpc_attach_opts wait5 = {.size = sizeof(wait5), .timeout_ms = 5000};
	dlpc_attach_opts wait100 = {.size = sizeof(wait100), .timeout_ms = 100};
	dlpc_attach_opts now = {.size = sizeof(now), .timeout_ms = 0};
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t;
	pid_t pid;

	pid = spawn(publish_late, &late);
	ck_assert_dlpc(dlpc_attach(c, "late", &wait5, &t), 1);
	ck_assert(matches(t->dl_tensor.data, 1000, 4));
	t->deleter(t);
	ck_assert_int_eq(wait_child(pid), 0);
	ck_assert_dlpc(dlpc_attach(c, "never", &wait100, &t), -ETIMEDOUT);
	/* the name and the wait, not "Connection timed out" */
	ck_assert_msg(strstr(dlpc_last_error(), "no entry named 'never' appeared within 100 ms"),
		      "%s", dlpc_last_error());
	ck_assert_dlpc(dlpc_attach(c, "never", &now, &t), -ENOENT);
	ck_assert_dlpc(dlpc_attach(c, "never", NULL, &t), -ENOENT);
	ck_assert_uint_eq(stat_or_die(c).waiters, 0);
	dlpc_close(c);
}
END_TEST

/* Only the caller's connection is open and nothing is referenced. */
static bool conns_are(const dlpc_stats *s, void *arg)
{
	return s->connections == *(unsigned *)arg;
}

static bool alone(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->connections == 1 && s->references == 0;
}

/* ---- 9. deleters on other threads and after close; 8 threads on one client ---- */

static void *run_deleter(void *arg)
{
	DLManagedTensorVersioned *t = arg;

	t->deleter(t);
	return NULL;
}

struct worker {
	dlpc_client *c;
	int errors;
};

static void *attach_loop(void *arg)
{
	struct worker *w = arg;

	for (int i = 0; i < 500; i++) {
		DLManagedTensorVersioned *t;

		if (dlpc_attach(w->c, "shared", NULL, &t) != 1 ||
		    !matches(t->dl_tensor.data, 4096, 6)) {
			w->errors++;
			continue;
		}
		t->deleter(t);
	}
	return NULL;
}

START_TEST(test_threads_and_late_deleters)
{
	struct pub_args v = {"shared", 6, 4096, 0, 1};
	struct worker w[8];
	pthread_t th[8];
	DLManagedTensorVersioned *a, *b;
	dlpc_client *c, *probe;
	int fds0 = fd_count(getpid());
	int dfds0;
	dlpc_stats s;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v)), 0);
	probe = connect_or_die(&D);
	dfds0 = settled_fds(&D, probe, 1); /* the probe's socket and one storage included */
	c = connect_or_die(&D);
	for (int i = 0; i < 8; i++) {
		w[i] = (struct worker){c, 0};
		ck_assert_int_eq(pthread_create(&th[i], NULL, attach_loop, &w[i]), 0);
	}
	for (int i = 0; i < 8; i++) {
		ck_assert_int_eq(pthread_join(th[i], NULL), 0);
		ck_assert_int_eq(w[i].errors, 0);
	}
	/* the last releases may still wait in libdlpc (DLPC_RELEASE_DELAY_MS) */
	ck_assert(wait_stat(probe, no_refs, NULL, 1000));
	s = stat_or_die(probe);
	ck_assert_uint_ge(s.req_attach, 8 * 500);

	/* a deleter on another thread, then one after dlpc_close */
	ck_assert_dlpc(dlpc_attach(c, "shared", NULL, &a), 1);
	ck_assert_dlpc(dlpc_attach(c, "shared", NULL, &b), 1);
	ck_assert_int_eq(pthread_create(&th[0], NULL, run_deleter, a), 0);
	ck_assert_int_eq(pthread_join(th[0], NULL), 0);
	dlpc_close(c); /* sends the deferred release of a; b keeps the connection */
	ck_assert(wait_stat(probe, refs_are, &(struct want){.refs = 1}, 1000));
	ck_assert(matches(b->dl_tensor.data, 4096, 6));
	ck_assert_int_eq(pthread_create(&th[0], NULL, run_deleter, b), 0);
	ck_assert_int_eq(pthread_join(th[0], NULL), 0);
	ck_assert(wait_stat(probe, no_refs, NULL, 1000));
	dlpc_close(probe);
	/* no fd left behind on either side */
	ck_assert_int_eq(fd_count(getpid()), fds0);
	probe = connect_or_die(&D);
	ck_assert(wait_stat(probe, alone, NULL, 1000));
	ck_assert_int_eq(settled_fds(&D, probe, 1), dfds0);
	dlpc_close(probe);
}
END_TEST

/* ---- a deleter waits for no write of another thread's ---- */

/* A bundle whose PUBLISH frame (DLPC_BUNDLE_MAX keys of some 250 bytes: over 4 MiB) is far more
 * than a socket's buffer holds while the daemon reads nothing. */
#define STUCK_KEYS DLPC_BUNDLE_MAX
#define STUCK_KEY_LEN 250

struct stuck_publish {
	dlpc_client *c;
	const char **keys;
	DLManagedTensorVersioned **ts;
	atomic_int tid;
	int r;
	size_t n; /* of the STUCK_KEYS tensors, how many to publish (0: all) */
};

static void *publish_stuck(void *arg)
{
	struct stuck_publish *p = arg;

	atomic_store(&p->tid, (int)syscall(SYS_gettid));
	p->r = dlpc_publish_bundle(p->c, "stuck", p->n ? p->n : STUCK_KEYS,
				   (const char *const *)p->keys, p->ts, 0);
	return NULL;
}

/* Is thread @p tid of this process waiting to write: in sendmsg(), or in poll() for room
 * (/proc's view of its system call)? */
static bool in_sendmsg(int tid)
{
	char path[64];
	long nr = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/self/task/%d/syscall", tid);
	f = fopen(path, "r");
	if (!f)
		return false;
	if (fscanf(f, "%ld", &nr) != 1)
		nr = -1;
	fclose(f);
#ifdef SYS_poll
	if (nr == SYS_poll)
		return true;
#endif
	return nr == SYS_sendmsg || nr == SYS_ppoll;
}

/* Fill @p p's keys and tensors with the bundle of STUCK_KEYS one-byte tensors; its keys live in
 * *@p keys. Free the three with stuck_free(). */
static void stuck_bundle(struct stuck_publish *p, char **keys)
{
	static uint8_t byte = 7;
	static int64_t one = 1;
	DLDataType u8 = {kDLUInt, 8, 1};

	*keys = malloc((size_t)STUCK_KEYS * (STUCK_KEY_LEN + 1));
	p->keys = malloc(STUCK_KEYS * sizeof(*p->keys));
	p->ts = malloc(STUCK_KEYS * sizeof(*p->ts));
	ck_assert(*keys && p->keys && p->ts);
	for (int i = 0; i < STUCK_KEYS; i++) {
		char *k = *keys + (size_t)i * (STUCK_KEY_LEN + 1);

		memset(k, 'k', STUCK_KEY_LEN);
		snprintf(k + STUCK_KEY_LEN - 6, 7, "%06d", i);
		p->keys[i] = k;
		p->ts[i] = host_tensor(&byte, u8, 1, &one, NULL, NULL);
	}
}

static void stuck_free(struct stuck_publish *p, char *keys)
{
	free(p->ts);
	free(p->keys);
	free(keys);
}

/* A client of D with a call timeout of @p ms ($DLPC_CALL_TIMEOUT_MS, read at connect). */
static dlpc_client *connect_timed(const char *ms)
{
	dlpc_client *c;

	ck_assert_int_eq(setenv(DLPC_CALL_TIMEOUT_ENV, ms, 1), 0);
	c = connect_or_die(&D);
	ck_assert_int_eq(unsetenv(DLPC_CALL_TIMEOUT_ENV), 0);
	return c;
}

static pid_t stopped_daemon;

/* (SIGALRM) The deleter took too long: let the daemon run, so that a blocked one returns and the
 * test fails on its time instead of hanging with the daemon stopped. */
static volatile sig_atomic_t daemon_continued;

static void continue_daemon(int sig)
{
	(void)sig;
	daemon_continued = 1;
	kill(stopped_daemon, SIGCONT);
}

/* Stop D's daemon (SIGALRM lets it run again: continue_daemon()), then start @p p's publish on
 * thread *@p th and return once it waits to write (copying comes first). */
static void publish_until_stuck(struct stuck_publish *p, pthread_t *th)
{
	struct sigaction sa = {.sa_handler = continue_daemon};

	stopped_daemon = D.pid;
	daemon_continued = 0;
	ck_assert_int_eq(sigaction(SIGALRM, &sa, NULL), 0);
	ck_assert_int_eq(kill(D.pid, SIGSTOP), 0);
	ck_assert_int_eq(pthread_create(th, NULL, publish_stuck, p), 0);
	for (int i = 0; !(atomic_load(&p->tid) && in_sendmsg(atomic_load(&p->tid))); i++) {
		ck_assert_msg(i < 10000, "the publish never waited to write");
		usleep(1000);
	}
}

/* The end of a test whose stuck publish @p p dlpc_cancel() ended, the daemon running again: the
 * publish failed -ECANCELED, and the daemon dropped its connection (the stream it cut) at once;
 * @p p's client, @p probe and the bundle go. */
static void canceled_publish_done(struct stuck_publish *p, dlpc_client *probe, char *keys)
{
	ck_assert_msg(p->r == -ECANCELED, "publish: %d", p->r);
	ck_assert_msg(wait_stat(probe, conns_are, &(unsigned){1}, scaled_ms(5000)),
		      "the daemon kept the connection of the canceled write");
	dlpc_close(p->c);
	dlpc_close(probe);
	stuck_free(p, keys);
}

/*
 * A tensor's deleter returns at once while another thread of the client is stuck in a send:
 * with no call timeout and the daemon stopped, a PUBLISH too large for the socket's buffer
 * blocks in sendmsg(), holding the connection's write; the deleter, run meanwhile, only queues
 * its release (it used to wait for that write, for ever: a garbage collector running it would
 * freeze its interpreter). Once the daemon runs again the release reaches it.
 */
START_TEST(test_deleter_while_a_send_is_stuck)
{
	struct stuck_publish p = {.r = 0};
	struct timespec t0, t1;
	DLManagedTensorVersioned *t;
	dlpc_client *probe;
	pthread_t th;
	char *keys;
	long ms;

	probe = connect_or_die(&D);
	publish_filled(probe, "held", 4096, 5);
	/* no call timeout: the send waits for as long as the daemon reads nothing */
	p.c = connect_timed("0");
	ck_assert_dlpc(dlpc_attach(p.c, "held", NULL, &t), 1);
	ck_assert(wait_stat(probe, refs_are, &(struct want){.refs = 1}, scaled_ms(1000)));
	stuck_bundle(&p, &keys);
	publish_until_stuck(&p, &th);
	usleep(50 * 1000); /* still there: stuck, not passing through */
	ck_assert(in_sendmsg(atomic_load(&p.tid)));

	alarm(5);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	t->deleter(t);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	alarm(0);
	ms = (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
	/* not a measure of speed: a deleter that waited for the send would wait until SIGCONT */
	ck_assert_msg(ms < 2000, "the deleter waited %ld ms for another thread's send", ms);
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);

	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_dlpc(p.r, 1);
	/* the release went out, after the publish or from the library's thread */
	ck_assert(wait_stat(probe, refs_are, &(struct want){.refs = 0}, scaled_ms(5000)));
	dlpc_close(p.c);
	dlpc_close(probe);
	stuck_free(&p, keys);
}
END_TEST

/*
 * dlpc_cancel() ends a request stuck in its write (no call timeout, the daemon stopped, the frame
 * larger than the socket's buffer) within DLPC_SEND_CHECK_MS, as it ends a call waiting for its
 * reply: -ECANCELED, saying why; the stream it cut costs the connection.
 */
START_TEST(test_cancel_ends_a_stuck_write)
{
	struct stuck_publish p = {.r = 0};
	dlpc_client *probe;
	pthread_t th;
	char *keys;

	probe = connect_or_die(&D);
	p.c = connect_timed("0");
	stuck_bundle(&p, &keys);
	publish_until_stuck(&p, &th);
	/* a cancel that did not end it: the daemon runs again after 5 s, the publish goes on and
	 * the test fails on its result */
	alarm((unsigned)(scaled_ms(5000) / 1000));
	dlpc_cancel(p.c);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	alarm(0);
	ck_assert_msg(!daemon_continued,
		      "the cancel did not end the write: the publish returned "
		      "(%d) only once the daemon ran again",
		      p.r);
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);
	canceled_publish_done(&p, probe, keys);
}
END_TEST

/* An attach of a name nobody publishes, on its own thread or the caller's: its result and
 * message. */
struct waiting_attach {
	dlpc_client *c;
	int64_t timeout_ms;
	int r;
	long ms;
	char msg[512];
};

static void *attach_waiting(void *arg)
{
	struct waiting_attach *w = arg;
	dlpc_attach_opts o = {.size = sizeof(o), .timeout_ms = w->timeout_ms};
	DLManagedTensorVersioned *t = NULL;
	struct timespec t0, t1;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	w->r = dlpc_attach(w->c, "nobody/publishes/this", &o, &t);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	w->ms = (t1.tv_sec - t0.tv_sec) * 1000 + (t1.tv_nsec - t0.tv_nsec) / 1000000;
	snprintf(w->msg, sizeof(w->msg), "%s", dlpc_last_error());
	return NULL;
}

/*
 * A call's whole time is bounded by its own deadline, the wait behind another thread's stuck
 * write included. The call timeout is a minute and the daemon stopped, so a publish too large
 * for the socket's buffer holds the connection's write: an attach that may wait 300 ms for its
 * name gives up with -ETIMEDOUT once its 300 ms and DLPC_CALL_GRACE_MS have passed, saying
 * so, not after the publish's minute; one that may wait for ever is ended by dlpc_cancel()
 * (looked at every DLPC_SEND_CHECK_MS), with the publish.
 */
START_TEST(test_a_call_behind_a_stuck_write_keeps_its_own_bound)
{
	struct stuck_publish p = {.r = 0};
	struct waiting_attach w = {.timeout_ms = 300}, forever = {.timeout_ms = -1};
	dlpc_client *probe;
	pthread_t th, fth;
	char *keys;

	probe = connect_or_die(&D);
	p.c = w.c = forever.c = connect_timed("60000");
	stuck_bundle(&p, &keys);
	publish_until_stuck(&p, &th);
	/* an attach that waited for the publish's write would return only once the daemon runs
	 * again, 20 s from now, and fail below on what it says */
	alarm((unsigned)(scaled_ms(20000) / 1000));
	attach_waiting(&w);
	ck_assert_msg(w.r == -ETIMEDOUT && !daemon_continued,
		      "the attach returned %d after %ld ms (%s)", w.r, w.ms, w.msg);
	ck_assert_msg(strstr(w.msg, "within 1300 ms (the call's 300 ms wait plus 1000 ms grace)") &&
			      strstr(w.msg, "another thread's request to it was stuck"),
		      "%s", w.msg);
	ck_assert(in_sendmsg(atomic_load(&p.tid))); /* the publish still waits to write */
	ck_assert_int_eq(pthread_create(&fth, NULL, attach_waiting, &forever), 0);
	usleep(200 * 1000); /* (it waits behind the publish; if not yet, the cancel ends it too) */
	dlpc_cancel(p.c);
	ck_assert_int_eq(pthread_join(fth, NULL), 0);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	alarm(0);
	ck_assert_msg(!daemon_continued, "the cancel ended the calls only once the daemon ran");
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);
	ck_assert_msg(forever.r == -ECANCELED && strstr(forever.msg, "canceled"), "%d: %s",
		      forever.r, forever.msg);
	canceled_publish_done(&p, probe, keys);
}
END_TEST

/* (dlpc_set_interrupt()) Give up once the test says so. */
static atomic_bool give_up;

static int giving_up(void *arg)
{
	(void)arg;
	return atomic_load(&give_up);
}

static bool waiters_are(const dlpc_stats *s, void *arg)
{
	return s->waiters == *(uint64_t *)arg;
}

/* attach_waiting(), with the thread's interrupt check giving_up(). */
static void *attach_interruptible(void *arg)
{
	dlpc_set_interrupt(giving_up, NULL);
	attach_waiting(arg);
	dlpc_set_interrupt(NULL, NULL);
	return NULL;
}

/*
 * A call that gives up after its request left (here interrupted: its wait has no end) tells
 * the daemon with a CANCEL, but never waits for another thread's write to do so: with the
 * daemon stopped and a publish stuck in its write (call timeout a minute), the attach returns
 * -EINTR at once, its CANCEL queued; once the daemon runs again and the publish is through, the
 * CANCEL follows it and the daemon's wait, which had no end of its own, is gone.
 */
START_TEST(test_a_call_giving_up_behind_a_stuck_write_queues_its_cancel)
{
	struct stuck_publish p = {.r = 0};
	struct waiting_attach w = {.timeout_ms = -1};
	dlpc_client *probe;
	pthread_t th, wth;
	char *keys;

	probe = connect_or_die(&D);
	p.c = w.c = connect_timed("60000");
	atomic_store(&give_up, false);
	ck_assert_int_eq(pthread_create(&wth, NULL, attach_interruptible, &w), 0);
	ck_assert(wait_stat(probe, waiters_are, &(uint64_t){1}, scaled_ms(5000)));
	stuck_bundle(&p, &keys);
	publish_until_stuck(&p, &th);
	/* a call that waited for the publish's write returns only once the daemon runs again */
	alarm((unsigned)(scaled_ms(20000) / 1000));
	atomic_store(&give_up, true);
	ck_assert_int_eq(pthread_join(wth, NULL), 0);
	ck_assert_msg(w.r == -EINTR && !daemon_continued,
		      "the attach returned %d after %ld ms (%s)", w.r, w.ms, w.msg);
	alarm(0);
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_dlpc(p.r, 1);
	ck_assert_msg(wait_stat(probe, waiters_are, &(uint64_t){0}, scaled_ms(5000)),
		      "the daemon still holds the wait whose CANCEL was queued");
	dlpc_close(p.c);
	dlpc_close(probe);
	stuck_free(&p, keys);
}
END_TEST

/*
 * DLPC_CANCELS_PENDING_MAX: one connection queues that many CANCELs while a write holds it, and
 * drops one more. DLPC_CANCELS_PENDING_MAX + 1 attaches without end wait in the daemon; with the
 * daemon stopped and a publish stuck in its write, all are interrupted; once the publish is
 * through, the queued CANCELs end their waits and the dropped one's wait stays until the
 * connection closes.
 */
START_TEST(test_cancels_pending_max)
{
	enum { N = DLPC_CANCELS_PENDING_MAX + 1 };
	struct stuck_publish p = {.r = 0};
	struct waiting_attach w[N];
	pthread_t th, wth[N];
	dlpc_client *probe;
	char *keys;
	int eintr = 0;

	probe = connect_or_die(&D);
	p.c = connect_timed("60000");
	atomic_store(&give_up, false);
	for (int i = 0; i < N; i++) {
		w[i] = (struct waiting_attach){.c = p.c, .timeout_ms = -1};
		ck_assert_int_eq(pthread_create(&wth[i], NULL, attach_interruptible, &w[i]), 0);
	}
	ck_assert(wait_stat(probe, waiters_are, &(uint64_t){N}, scaled_ms(5000)));
	stuck_bundle(&p, &keys);
	publish_until_stuck(&p, &th);
	alarm((unsigned)(scaled_ms(20000) / 1000));
	atomic_store(&give_up, true);
	for (int i = 0; i < N; i++) {
		ck_assert_int_eq(pthread_join(wth[i], NULL), 0);
		eintr += w[i].r == -EINTR;
	}
	ck_assert_msg(eintr == N && !daemon_continued, "%d of %d interrupted in time", eintr, N);
	alarm(0);
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_dlpc(p.r, 1);
	ck_assert_msg(wait_stat(probe, waiters_are, &(uint64_t){1}, scaled_ms(5000)),
		      "not DLPC_CANCELS_PENDING_MAX waits ended by the queued CANCELs");
	dlpc_close(p.c);
	ck_assert(wait_stat(probe, waiters_are, &(uint64_t){0}, scaled_ms(5000)));
	dlpc_close(probe);
	stuck_free(&p, keys);
}
END_TEST

/* (a thread) dlpc_stat() on client @p arg, its thread id first in *@p arg's tid. */
struct stat_call {
	dlpc_client *c;
	atomic_int tid;
	int r;
};

static void *stat_call(void *arg)
{
	struct stat_call *s = arg;
	dlpc_stats st = {.size = sizeof(st)};

	atomic_store(&s->tid, (int)syscall(SYS_gettid));
	s->r = dlpc_stat(s->c, &st);
	return NULL;
}

/* The timeout in ms of the poll() thread @p tid of this process waits in (-1: none), from
 * /proc's view of its system call; -2 when it is in neither poll nor ppoll. */
static long long poll_timeout_of(int tid)
{
	unsigned long long a[3];
	char path[64];
	long nr = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/self/task/%d/syscall", tid);
	f = fopen(path, "r");
	if (!f)
		return -2;
	if (fscanf(f, "%ld %llx %llx %llx", &nr, &a[0], &a[1], &a[2]) != 4)
		nr = -1;
	fclose(f);
#ifdef SYS_poll
	if (nr == SYS_poll)
		return (int)a[2];
#endif
	if (nr == SYS_ppoll) { /* its timespec, on the sleeping thread's stack */
		const struct timespec *ts = (const struct timespec *)(uintptr_t)a[2];

		return ts ? (long long)ts->tv_sec * 1000 + ts->tv_nsec / 1000000 : -1;
	}
	return -2;
}

/*
 * A call timeout of INT64_MAX ms means none: a call to a stopped daemon sleeps in poll() without
 * end, looked at 50 times (a deadline that far had overflowed into "passed", and the wait polled
 * with a timeout of 0, a whole core for as long as the daemon was stopped).
 */
START_TEST(test_a_call_timeout_of_int64_max_waits_without_spinning)
{
	struct stat_call s = {.r = 1};
	int polls = 0, spins = 0;
	pthread_t th;

	s.c = connect_timed("9223372036854775807");
	ck_assert_int_eq(kill(D.pid, SIGSTOP), 0);
	ck_assert_int_eq(pthread_create(&th, NULL, stat_call, &s), 0);
	while (!atomic_load(&s.tid))
		usleep(1000);
	for (int i = 0; i < 50; i++) {
		long long t = poll_timeout_of(atomic_load(&s.tid));

		polls += t != -2;
		spins += t >= 0 && t < 1000;
		usleep(10 * 1000);
	}
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_int_eq(s.r, 0);
	ck_assert_msg(polls > 0 && spins == 0,
		      "the waiting call was in poll() %d times of 50, %d of them with a timeout "
		      "under a second",
		      polls, spins);
	dlpc_close(s.c);
}
END_TEST

/* The id of this process's thread named @p name, or 0 when none is. */
static int thread_named(const char *name)
{
	char path[300], comm[32];
	struct dirent *d;
	int tid = 0;
	DIR *dir;

	dir = opendir("/proc/self/task");
	ck_assert(dir);
	while (!tid && (d = readdir(dir))) {
		FILE *f;

		if (d->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/self/task/%s/comm", d->d_name);
		f = fopen(path, "r");
		if (!f)
			continue;
		if (fgets(comm, sizeof(comm), f)) {
			comm[strcspn(comm, "\n")] = '\0';
			if (strcmp(comm, name) == 0)
				tid = atoi(d->d_name);
		}
		fclose(f);
	}
	closedir(dir);
	return tid;
}

/*
 * Stop D once @p p's publish, of about half the socket's send buffer, went out whole on thread
 * *@p th and waits for its reply: the socket has too little room left for more (a quarter of
 * the buffer must be free for it to poll writable). SIGALRM lets the daemon run again.
 */
static void publish_half_then_stop(struct stuck_publish *p, pthread_t *th, char **keys)
{
	struct sigaction sa = {.sa_handler = continue_daemon};
	long wmem = 212992;
	FILE *f;

	/* a frame of about half the default send buffer: it fits whole, a quarter is not free */
	f = fopen("/proc/sys/net/core/wmem_default", "r");
	if (f) {
		ck_assert_int_eq(fscanf(f, "%ld", &wmem), 1);
		fclose(f);
	}
	stuck_bundle(p, keys);
	p->n = (size_t)wmem / 2 / (STUCK_KEY_LEN + 16);
	ck_assert_uint_lt(p->n, STUCK_KEYS);
	for (size_t i = p->n; i < STUCK_KEYS; i++) /* not published: not the publish's to free */
		p->ts[i]->deleter(p->ts[i]);
	stopped_daemon = D.pid;
	ck_assert_int_eq(sigaction(SIGALRM, &sa, NULL), 0);
	alarm((unsigned)(scaled_ms(30000) / 1000));
	ck_assert_int_eq(kill(D.pid, SIGSTOP), 0);
	ck_assert_int_eq(pthread_create(th, NULL, publish_stuck, p), 0);
	/* its write never waits (the frame fits): in poll(), it waits for the reply (a machine
	 * busy with other work may take seconds to get it there) */
	for (int i = 0; !(atomic_load(&p->tid) && in_sendmsg(atomic_load(&p->tid))); i++) {
		ck_assert_msg(i < scaled_ms(10000), "the publish never waited for its reply");
		usleep(1000);
	}
}

/* Context switches of thread @p tid of this process so far. */
static long switches_of(int tid)
{
	char path[64], line[128];
	long n = 0, v;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/self/task/%d/status", tid);
	f = fopen(path, "r");
	ck_assert(f);
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "voluntary_ctxt_switches: %ld", &v) == 1 ||
		    sscanf(line, "nonvoluntary_ctxt_switches: %ld", &v) == 1)
			n += v;
	fclose(f);
	return n;
}

/* The library's thread sleeps: looked at 50 times over half a second, it is in poll() with
 * no timeout under a second, and it ran (was switched to) hardly at all meanwhile. */
static void loop_sleeps(void)
{
	int polls = 0, spins = 0, tid = 0;
	long ran;

	for (int i = 0; !(tid = thread_named("dlpc-loop")); i++) {
		ck_assert_msg(i < 1000, "no thread named dlpc-loop");
		usleep(1000);
	}
	usleep(50 * 1000); /* the release fell due, and found no room */
	ran = switches_of(tid);
	for (int i = 0; i < 50; i++) {
		long long ms = poll_timeout_of(tid);

		polls += ms != -2;
		spins += ms >= 0 && ms < 1000;
		usleep(10 * 1000);
	}
	ran = switches_of(tid) - ran;
	ck_assert_msg(polls > 0 && spins == 0 && ran < 10,
		      "the library's thread was in poll() %d times of 50, %d of them with a "
		      "timeout under a second, and ran %ld times",
		      polls, spins, ran);
}

/*
 * Releases that find the socket full wait for room with the library's thread asleep in poll()
 * on that socket, and go out once the daemon reads again. The daemon is stopped after a
 * publish that left too little room (publish_half_then_stop()); a deleter then queues a
 * release. That thread used to look again every DLPC_RELEASE_DELAY_MS (200 times a second) for
 * as long as the daemon read nothing. Meanwhile the same thread serves the process's client of
 * another daemon: its release goes.
 */
START_TEST(test_releases_wait_for_room_without_spinning)
{
	struct stuck_publish p = {.r = 0};
	DLManagedTensorVersioned *t, *t2;
	dlpc_client *probe, *probe2, *c2;
	struct daemon d2;
	pthread_t th;
	char *keys;

	daemon_start(&d2);
	probe2 = connect_or_die(&d2);
	c2 = connect_or_die(&d2);
	publish_filled(probe2, "held", 4096, 6);
	ck_assert_dlpc(dlpc_attach(c2, "held", NULL, &t2), 1);

	probe = connect_or_die(&D);
	publish_filled(probe, "held", 4096, 5);
	p.c = connect_timed("0");
	ck_assert_dlpc(dlpc_attach(p.c, "held", NULL, &t), 1);
	ck_assert(wait_stat(probe, refs_are, &(struct want){.refs = 1}, scaled_ms(1000)));
	publish_half_then_stop(&p, &th, &keys);
	t->deleter(t);
	loop_sleeps();
	/* the other daemon's client is served meanwhile */
	ck_assert(wait_stat(probe2, refs_are, &(struct want){.refs = 1}, scaled_ms(1000)));
	t2->deleter(t2);
	ck_assert_msg(wait_stat(probe2, refs_are, &(struct want){.refs = 0}, scaled_ms(5000)),
		      "a release to another daemon waited for the stopped one");
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);
	alarm(0);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_dlpc(p.r, 1);
	/* the room came: the release went out */
	ck_assert(wait_stat(probe, refs_are, &(struct want){.refs = 0}, scaled_ms(5000)));
	dlpc_close(p.c);
	dlpc_close(probe);
	dlpc_close(c2);
	dlpc_close(probe2);
	daemon_stop(&d2);
	stuck_free(&p, keys);
}
END_TEST

/*
 * The same after dlpc_close(), with a tensor of the client still alive (which keeps its
 * connection): the release waits for room, the thread asleep, and goes once it comes; the
 * canceled publish's reply is read and dropped meanwhile. When the last tensor goes, so does
 * the connection.
 */
START_TEST(test_releases_of_a_closed_client_wait_for_room)
{
	struct stuck_publish p = {.r = 0};
	DLManagedTensorVersioned *t, *kept;
	dlpc_client *probe;
	pthread_t th;
	char *keys;

	probe = connect_or_die(&D);
	publish_filled(probe, "held", 4096, 5);
	p.c = connect_timed("0");
	ck_assert_dlpc(dlpc_attach(p.c, "held", NULL, &t), 1);
	ck_assert_dlpc(dlpc_attach(p.c, "held", NULL, &kept), 1);
	ck_assert(wait_stat(probe, refs_are, &(struct want){.refs = 2}, scaled_ms(1000)));
	publish_half_then_stop(&p, &th, &keys);
	t->deleter(t);
	dlpc_close(p.c);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_dlpc(p.r, -ECANCELED);
	loop_sleeps();
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);
	alarm(0);
	ck_assert_msg(wait_stat(probe, refs_are, &(struct want){.refs = 1}, scaled_ms(5000)),
		      "the closed client's release never went out");
	ck_assert(wait_stat(probe, conns_are, &(unsigned){2}, scaled_ms(1000)));
	kept->deleter(kept);
	ck_assert(wait_stat(probe, refs_are, &(struct want){.refs = 0}, scaled_ms(5000)));
	ck_assert(wait_stat(probe, conns_are, &(unsigned){1}, scaled_ms(5000)));
	ck_assert_dlpc(dlpc_unpublish(probe, "stuck"), 0);
	dlpc_close(probe);
	stuck_free(&p, keys);
}
END_TEST

/* dlpc_close() of a client that holds nothing closes its connection before it returns: the
 * library's thread, which it wakes and which may be in a turn holding the client then, lets go
 * first (its fds, and the process's pagemap fd with the last client, are gone on return). */
struct churner {
	dlpc_client *c;
	atomic_bool stop;
	int failed; /* an attach's result other than 1, if any (no assertion off the test's
		     * thread: it would move Check's record of where the test is) */
};

/* Attach and release on its own client until told to stop: each release has the library's
 * thread take a turn soon. */
static void *churn_releases(void *arg)
{
	struct churner *ch = arg;

	while (!atomic_load(&ch->stop) && !ch->failed) {
		DLManagedTensorVersioned *t;
		int r = dlpc_attach(ch->c, "closed", NULL, &t);

		if (r != 1)
			ch->failed = r ? r : -1;
		else
			t->deleter(t);
	}
	return NULL;
}

/* The fd and inode of a socket of this process's that is not in @p known (@p n of them); -1 if
 * none. */
static int new_socket(const ino_t *known, size_t n, ino_t *ino)
{
	DIR *dir = opendir("/proc/self/fd");
	struct dirent *de;
	int found = -1;

	ck_assert_ptr_nonnull(dir);
	while (found < 0 && (de = readdir(dir))) {
		struct stat st;
		int fd = atoi(de->d_name);
		bool seen = false;

		if (de->d_name[0] == '.' || fd == dirfd(dir) || fstat(fd, &st) ||
		    !S_ISSOCK(st.st_mode))
			continue;
		for (size_t i = 0; i < n; i++)
			seen = seen || known[i] == st.st_ino;
		if (!seen) {
			found = fd;
			*ino = st.st_ino;
		}
	}
	closedir(dir);
	return found;
}

START_TEST(test_close_returns_with_the_connection_closed)
{
	dlpc_client *probe = connect_or_die(&D), *c, *idle[64];
	struct churner ch = {.c = connect_or_die(&D)};
	ino_t known[sizeof(idle) / sizeof(idle[0]) + 16];
	size_t nknown = 0;
	pthread_t th;

	publish_filled(probe, "closed", 4096, 7);
	/* many clients make each turn longer, and a thread that releases makes turns often */
	for (size_t i = 0; i < sizeof(idle) / sizeof(idle[0]); i++)
		idle[i] = connect_or_die(&D);
	while (new_socket(known, nknown, &known[nknown]) >= 0)
		ck_assert_uint_lt(++nknown, sizeof(known) / sizeof(known[0]));
	ck_assert_int_eq(pthread_create(&th, NULL, churn_releases, &ch), 0);
	for (int i = 0; i < 2000; i++) {
		DLManagedTensorVersioned *t;
		struct stat st;
		ino_t ino;
		int fd;

		c = connect_or_die(&D);
		fd = new_socket(known, nknown, &ino);
		ck_assert_int_ge(fd, 0);
		ck_assert_dlpc(dlpc_attach(c, "closed", NULL, &t), 1);
		t->deleter(t);
		dlpc_close(c);
		/* the same number may be another fd by now, but not that socket */
		ck_assert_msg(fstat(fd, &st) || st.st_ino != ino,
			      "round %d: the connection's socket is open after dlpc_close()", i);
	}
	atomic_store(&ch.stop, true);
	ck_assert_int_eq(pthread_join(th, NULL), 0);
	ck_assert_msg(!ch.failed, "the churner's attach returned %d", ch.failed);
	dlpc_close(ch.c);
	for (size_t i = 0; i < sizeof(idle) / sizeof(idle[0]); i++)
		dlpc_close(idle[i]);
	ck_assert(wait_stat(probe, refs_are, &(struct want){.refs = 0}, scaled_ms(5000)));
	dlpc_close(probe);
}
END_TEST

/*
 * A request whose write the call timeout cut short (the daemon stopped, the frame larger than
 * the socket's buffer) fails with -ETIMEDOUT and costs its connection: the socket is shut for
 * writing, so nothing more lands in the broken stream and the daemon, once it runs again, drops
 * the connection at the end of what came (not at its frame timeout, 10 s), and the client's
 * next call fails at once.
 */
START_TEST(test_a_request_cut_short_costs_the_connection)
{
	struct stuck_publish p = {.r = 0};
	dlpc_stats s = {.size = sizeof(s)};
	dlpc_client *probe;
	dlpc_entry_info *l;
	char *keys;
	size_t n;

	probe = connect_or_die(&D);
	p.c = connect_timed("300");
	ck_assert(wait_stat(probe, conns_are, &(unsigned){2}, scaled_ms(1000)));
	stuck_bundle(&p, &keys);
	ck_assert_int_eq(kill(D.pid, SIGSTOP), 0);
	publish_stuck(&p);
	ck_assert_int_eq(kill(D.pid, SIGCONT), 0);
	ck_assert_msg(p.r == -ETIMEDOUT, "publish: %d %s", p.r, dlpc_last_error());
	ck_assert_msg(wait_stat(probe, conns_are, &(unsigned){1}, scaled_ms(5000)),
		      "the daemon kept the connection of the frame cut short");
	ck_assert_int_lt(dlpc_stat(p.c, &s), 0);
	/* (nothing of it was published) */
	ck_assert_dlpc(dlpc_list(probe, "stuck", &l, &n), 0);
	ck_assert_uint_eq(n, 0);
	dlpc_list_free(l, n);
	dlpc_close(p.c);
	dlpc_close(probe);
	stuck_free(&p, keys);
}
END_TEST

/* ---- 10. 100 processes x 1,000 attach/release ---- */

/* ---- deferred releases: they ride with the next request, or go out on their own ---- */

/* In a forked child: attach, release, say so on @p arg's pipe, then make no call at all. */
static int release_then_idle(void *arg)
{
	int *pipefd = arg;
	dlpc_client *c = child_connect();
	DLManagedTensorVersioned *t;

	CHILD_CHECK(dlpc_attach(c, "deferred", NULL, &t) == 1);
	t->deleter(t);
	CHILD_CHECK(write(pipefd[1], "r", 1) == 1);
	pause();
	return 0;
}

START_TEST(test_deferred_release)
{
	struct pub_args v = {"deferred", 3, 4096, 0, 1};
	DLManagedTensorVersioned *t[DLPC_RELEASE_PENDING_MAX * 2 + 3];
	dlpc_client *c, *probe;
	int pipefd[2];
	char byte;
	pid_t pid;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v)), 0);
	c = connect_or_die(&D);
	probe = connect_or_die(&D);

	/* the connection's own next request carries the release in front of it */
	ck_assert_dlpc(dlpc_attach(c, "deferred", NULL, &t[0]), 1);
	t[0]->deleter(t[0]);
	ck_assert_uint_eq(stat_or_die(c).references, 0);

	/* with no further call, the flusher thread sends it */
	ck_assert_dlpc(dlpc_attach(c, "deferred", NULL, &t[0]), 1);
	t[0]->deleter(t[0]);
	ck_assert(wait_stat(probe, no_refs, NULL, 1000));

	/* more releases than one connection defers at once */
	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
		ck_assert_dlpc(dlpc_attach(c, "deferred", NULL, &t[i]), 1);
	ck_assert(
		wait_stat(probe, refs_are, &(struct want){.refs = sizeof(t) / sizeof(t[0])}, 1000));
	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
		t[i]->deleter(t[i]);
	ck_assert(wait_stat(probe, no_refs, NULL, 1000));

	/*
	 * A forked child's own connection gets a flusher of its own: forked while the parent's
	 * flusher sleeps before a flush, then while it waits for work (a condition variable the
	 * child inherits with a waiter that does not exist there).
	 */
	ck_assert_int_eq(pipe(pipefd), 0);
	for (int round = 0; round < 2; round++) {
		ck_assert_dlpc(dlpc_attach(c, "deferred", NULL, &t[0]), 1);
		t[0]->deleter(t[0]);
		if (round == 1) {
			ck_assert(wait_stat(probe, no_refs, NULL, 1000));
			usleep(20 * 1000); /* let the flusher go back to waiting */
		}
		pid = spawn(release_then_idle, pipefd);
		ck_assert_int_eq(read(pipefd[0], &byte, 1), 1);
		ck_assert(wait_stat(probe, no_refs, NULL, 1000));
		kill(pid, SIGKILL);
		ck_assert_int_eq(wait_child(pid), 128 + SIGKILL);
	}
	close(pipefd[0]);
	close(pipefd[1]);
	dlpc_close(c);
	dlpc_close(probe);
}
END_TEST

static int churn(void *arg)
{
	dlpc_client *c = child_connect();

	(void)arg;
	for (int i = 0; i < 1000; i++) {
		DLManagedTensorVersioned *t;

		CHILD_CHECK(dlpc_attach(c, "churn", NULL, &t) == 1);
		CHILD_CHECK(((const uint8_t *)t->dl_tensor.data)[17] == pattern(8, 17));
		t->deleter(t);
	}
	dlpc_close(c);
	return 0;
}

START_TEST(test_many_processes)
{
	struct pub_args v = {"churn", 8, 65536, 0, 1};
	pid_t pids[100];
	dlpc_client *c;
	int dfds0;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v)), 0);
	c = connect_or_die(&D);
	/* the publisher's connection closes asynchronously: baseline once only ours is left */
	dfds0 = settled_fds(&D, c, 1);
	for (int i = 0; i < 100; i++)
		pids[i] = spawn(churn, NULL);
	for (int i = 0; i < 100; i++)
		ck_assert_int_eq(wait_child(pids[i]), 0);
	ck_assert(wait_stat(c, alone, NULL, 1000));
	ck_assert_uint_ge(stat_or_die(c).req_attach, 100 * 1000);
	ck_assert_int_eq(settled_fds(&D, c, 1), dfds0);
	dlpc_close(c);
}
END_TEST

/* ---- more library behaviour: zero-copy alloc, writable, fork, list, legacy ---- */

START_TEST(test_alloc_zero_copy)
{
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t, *a;
	int64_t shape[2] = {256, 1024};
	struct pub_args check = {"zc", 11, 256 * 1024 * 4, 0, 1};

	ck_assert_dlpc(
		dlpc_alloc(c, (DLDevice){kDLCPU, 0}, (DLDataType){kDLFloat, 32, 1}, 2, shape, &t),
		0);
	ck_assert(c_contiguous(&t->dl_tensor));
	ck_assert_uint_eq(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY, 0);
	fill(t->dl_tensor.data, check.bytes, check.seed);
	ck_assert_dlpc(dlpc_publish(c, "zc", t, 0), 1);
	/* published as is: the storage is exactly the allocation, no second copy */
	ck_assert_uint_eq(stat_or_die(c).bytes_held, check.bytes);
	ck_assert_int_eq(wait_child(spawn(attach_expect, &check)), 0);
	/* an allocation that is never published is freed by its deleter */
	ck_assert_dlpc(
		dlpc_alloc(c, (DLDevice){kDLCPU, 0}, (DLDataType){kDLUInt, 8, 1}, 1, shape, &a), 0);
	a->deleter(a);
	ck_assert_dlpc(
		dlpc_alloc(c, (DLDevice){kDLROCM, 0}, (DLDataType){kDLUInt, 8, 1}, 1, shape, &a),
		-ENOTSUP);
	dlpc_close(c);
}
END_TEST

static const char *const bucket_keys[3] = {"w", "b", "empty"};

/* Another process attaches "bucket" and sees the publisher's writes made after publishing. */
static int attach_bucket(void *arg)
{
	dlpc_client *c = child_connect();
	DLManagedTensorVersioned *t[3];
	dlpc_bundle *b = NULL;

	(void)arg;
	CHILD_CHECK(dlpc_attach_bundle(c, "bucket", NULL, &b) == 1);
	CHILD_CHECK(dlpc_bundle_count(b) == 3);
	for (size_t i = 0; i < 3; i++) {
		CHILD_CHECK(strcmp(dlpc_bundle_key(b, i), bucket_keys[i]) == 0);
		t[i] = dlpc_bundle_take(b, i);
	}
	CHILD_CHECK(t[0]->dl_tensor.ndim == 2 && t[0]->dl_tensor.shape[1] == 5);
	CHILD_CHECK(((float *)t[0]->dl_tensor.data)[19] == 19.0f);
	CHILD_CHECK(((float *)t[0]->dl_tensor.data)[3] == 99.0f); /* written after publishing */
	CHILD_CHECK(((int16_t *)t[1]->dl_tensor.data)[6] == -6);
	CHILD_CHECK(t[2]->dl_tensor.shape[0] == 0 && t[2]->dl_tensor.dtype.code == kDLUInt);
	for (size_t i = 0; i < 3; i++)
		t[i]->deleter(t[i]);
	dlpc_bundle_free(b);
	dlpc_close(c);
	return 0;
}

/* A bucket allocated with dlpc_alloc_bundle() is published whole, as it is: no copy. */
START_TEST(test_alloc_bundle_zero_copy)
{
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t[3], *mine;
	const DLDataType dt[3] = {{kDLFloat, 32, 1}, {kDLInt, 16, 1}, {kDLUInt, 8, 1}};
	const int32_t nd[3] = {2, 1, 1}, bad_nd[1] = {-1};
	const int64_t s0[2] = {4, 5}, s1[1] = {7}, s2[1] = {0};
	const int64_t *const shapes[3] = {s0, s1, s2};

	ck_assert_dlpc(dlpc_alloc_bundle(c, (DLDevice){kDLCPU, 0}, 3, dt, nd, shapes, t), 0);
	/* 80 bytes at 0, 14 at the next 256-byte boundary, the empty one at the one after */
	ck_assert_ptr_eq((uint8_t *)t[1]->dl_tensor.data - 256, t[0]->dl_tensor.data);
	ck_assert_ptr_eq((uint8_t *)t[2]->dl_tensor.data - 512, t[0]->dl_tensor.data);
	ck_assert_uint_eq(t[0]->flags & DLPACK_FLAG_BITMASK_READ_ONLY, 0);
	for (int i = 0; i < 20; i++)
		((float *)t[0]->dl_tensor.data)[i] = (float)i;
	for (int i = 0; i < 7; i++)
		((int16_t *)t[1]->dl_tensor.data)[i] = (int16_t)-i;
	mine = dlpc_tensor_share(t[0]);
	ck_assert_ptr_nonnull(mine);
	ck_assert_dlpc(dlpc_publish_bundle(c, "bucket", 3, bucket_keys, t, DLPC_PUBLISH_WRITABLE),
		       1);
	/* the entry is this very memory: a write made now is seen by an attacher */
	((float *)mine->dl_tensor.data)[3] = 99.0f;
	ck_assert_uint_eq(stat_or_die(c).bytes_held, 512);
	ck_assert_int_eq(wait_child(spawn(attach_bucket, NULL)), 0);
	mine->deleter(mine);
	/* tensors of two allocations are copied as before */
	ck_assert_dlpc(dlpc_alloc_bundle(c, (DLDevice){kDLCPU, 0}, 1, dt, nd, shapes, &t[0]), 0);
	ck_assert_dlpc(dlpc_alloc_bundle(c, (DLDevice){kDLCPU, 0}, 1, dt, nd, shapes, &t[1]), 0);
	mine = dlpc_tensor_share(t[0]);
	ck_assert_dlpc(dlpc_publish_bundle(c, "two", 2, bucket_keys, t, DLPC_PUBLISH_WRITABLE), 1);
	((float *)mine->dl_tensor.data)[0] = 42.0f;
	{
		dlpc_bundle *b;
		DLManagedTensorVersioned *w;

		ck_assert_dlpc(dlpc_attach_bundle(c, "two", NULL, &b), 1);
		w = dlpc_bundle_take(b, 0);
		ck_assert(((float *)w->dl_tensor.data)[0] != 42.0f);
		w->deleter(w);
		dlpc_bundle_free(b);
	}
	mine->deleter(mine);
	/* a part of a bucket is copied: sharing the allocation would show attachers the rest,
	 * and a read-only publish would seal the rest here too */
	{
		const int64_t k[1] = {1000};
		const int64_t *const ks[2] = {k, k};
		const int32_t one[2] = {1, 1};
		const DLDataType f32[2] = {{kDLFloat, 32, 1}, {kDLFloat, 32, 1}};
		DLManagedTensorVersioned *part[2], *rest;
		uint64_t held = stat_or_die(c).bytes_held;

		ck_assert_dlpc(dlpc_alloc_bundle(c, (DLDevice){kDLCPU, 0}, 2, f32, one, ks, part),
			       0);
		rest = part[1];
		ck_assert_dlpc(dlpc_publish_bundle(c, "part", 1, bucket_keys, part, 0), 1);
		ck_assert_uint_eq(stat_or_die(c).bytes_held - held, 4000); /* a copy, not 8192 */
		((float *)rest->dl_tensor.data)[999] = 5.0f;		   /* still writable */
		ck_assert_uint_eq(rest->flags & DLPACK_FLAG_BITMASK_READ_ONLY, 0);
		rest->deleter(rest);
	}
	/* bad arguments: nothing allocated, every slot NULL */
	t[0] = t[1] = (DLManagedTensorVersioned *)1;
	ck_assert_dlpc(dlpc_alloc_bundle(c, (DLDevice){kDLCPU, 0}, 0, dt, nd, shapes, t), -EINVAL);
	ck_assert_dlpc(dlpc_alloc_bundle(c, (DLDevice){kDLCPU, 0}, 1, dt, bad_nd, shapes, t),
		       -EINVAL);
	ck_assert_ptr_null(t[0]);
	ck_assert_dlpc(
		dlpc_alloc_bundle(c, (DLDevice){kDLCPU, 0}, DLPC_BUNDLE_MAX + 1, dt, nd, shapes, t),
		-EINVAL);
	ck_assert_dlpc(dlpc_alloc_bundle(c, (DLDevice){kDLROCM, 0}, 3, dt, nd, shapes, t),
		       -ENOTSUP);
	ck_assert_ptr_null(t[0]);
	t[0] = (DLManagedTensorVersioned *)1;
	ck_assert_dlpc(dlpc_alloc_bundle(c, (DLDevice){kDLCPU, 0}, 1, NULL, nd, shapes, t),
		       -EINVAL);
	ck_assert_ptr_null(t[0]);
	dlpc_close(c);
}
END_TEST

/* Shares of an allocation outlive its publication; a read-only publish freezes them too. */
START_TEST(test_alloc_shares)
{
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t, *view, *again, *foreign;
	int64_t shape[1] = {4096};
	uint8_t buf[4];
	int st;
	pid_t pid;

	ck_assert_dlpc(
		dlpc_alloc(NULL, (DLDevice){kDLCPU, 0}, (DLDataType){kDLUInt, 8, 1}, 1, shape, &t),
		0);
	fill(t->dl_tensor.data, 4096, 21);
	view = dlpc_tensor_share(t);
	again = dlpc_tensor_share(t);
	ck_assert_ptr_nonnull(view);
	ck_assert_ptr_eq(view->dl_tensor.data, t->dl_tensor.data);
	ck_assert_dlpc(dlpc_publish(c, "frozen", t, 0), 1);
	/* the shares still read the published bytes, but may no longer write them */
	ck_assert(matches(view->dl_tensor.data, 4096, 21));
	pid = fork();
	if (pid == 0) {
		((volatile uint8_t *)view->dl_tensor.data)[0] = 1;
		_exit(0);
	}
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	ck_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV);
	/* shares made from now on say it is read-only */
	{
		DLManagedTensorVersioned *late = dlpc_tensor_share(view);

		ck_assert(late->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
		late->deleter(late);
	}
	/* the same memory published again read-only is fine; writable is refused */
	ck_assert_dlpc(dlpc_publish(c, "frozen2", view, 0), 1);
	ck_assert_dlpc(dlpc_publish(c, "thawed", again, DLPC_PUBLISH_WRITABLE), -EPERM);
	ck_assert_uint_eq(stat_or_die(c).storages, 2);
	/* a tensor libdlpc did not make cannot be shared */
	foreign = host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL);
	ck_assert_ptr_null(dlpc_tensor_share(foreign));
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "not made by libdlpc"));
	foreign->deleter(foreign);
	dlpc_close(c);
}
END_TEST

/* Shares of an attached tensor: each holds the mapping; the reference goes with the last. */
START_TEST(test_attach_shares)
{
	struct pub_args v = {"sh", 22, 8192, 0, 1};
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t, *s1, *s2;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v)), 0);
	ck_assert_dlpc(dlpc_attach(c, "sh", NULL, &t), 1);
	s1 = dlpc_tensor_share(t);
	s2 = dlpc_tensor_share(s1);
	ck_assert(s1->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
	t->deleter(t);
	s1->deleter(s1);
	ck_assert_uint_eq(stat_or_die(c).references, 1);
	ck_assert(matches(s2->dl_tensor.data, 8192, 22));
	ck_assert_int_eq(s2->dl_tensor.shape[0], 8192);
	s2->deleter(s2);
	ck_assert(wait_stat(c, no_refs, NULL, 1000));
	dlpc_close(c);
}
END_TEST

START_TEST(test_writable)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_attach_opts rw = {.size = sizeof(rw), .flags = DLPC_ATTACH_WRITABLE};
	DLManagedTensorVersioned *w1, *w2, *t;
	uint8_t buf[64] = {0};
	int64_t shape[1] = {64};

	ck_assert_dlpc(
		dlpc_publish(c, "rw",
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     DLPC_PUBLISH_WRITABLE),
		1);
	ck_assert_dlpc(
		dlpc_publish(c, "ro",
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     0),
		1);
	ck_assert_dlpc(dlpc_attach(c, "rw", &rw, &w1), 1);
	ck_assert_dlpc(dlpc_attach(c, "rw", &rw, &w2), 1);
	ck_assert_uint_eq(w1->flags & DLPACK_FLAG_BITMASK_READ_ONLY, 0);
	((uint8_t *)w1->dl_tensor.data)[5] = 42;
	ck_assert_int_eq(((uint8_t *)w2->dl_tensor.data)[5], 42);
	/* without asking, even a writable entry maps read-only */
	ck_assert_dlpc(dlpc_attach(c, "rw", NULL, &t), 1);
	ck_assert(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY);
	t->deleter(t);
	ck_assert_dlpc(dlpc_attach(c, "ro", &rw, &t), -EACCES);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "'ro'"));
	w1->deleter(w1);
	w2->deleter(w2);
	dlpc_close(c);
}
END_TEST

START_TEST(test_fork_child_refused)
{
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t;
	struct pub_args v = {"f", 3, 64, 0, 1};
	pid_t pid;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v)), 0);
	ck_assert_dlpc(dlpc_attach(c, "f", NULL, &t), 1);
	pid = fork();
	if (pid == 0) {
		DLManagedTensorVersioned *u;

		CHILD_CHECK(dlpc_attach(c, "f", NULL, &u) == -EBADFD);
		CHILD_CHECK(strstr(dlpc_last_error(), "fork") != NULL);
		/* the inherited tensor still reads, and its deleter releases nothing */
		CHILD_CHECK(matches(t->dl_tensor.data, 64, 3));
		t->deleter(t);
		_exit(0);
	}
	ck_assert_int_eq(wait_child(pid), 0);
	ck_assert_uint_eq(stat_or_die(c).references, 1);
	t->deleter(t);
	ck_assert(wait_stat(c, no_refs, NULL, 1000));
	dlpc_close(c);
}
END_TEST

/* A forked child does not keep its parent's connection (nor its ephemeral names) alive. */
START_TEST(test_fork_does_not_keep_connection)
{
	dlpc_client *c = connect_or_die(&D), *probe = connect_or_die(&D);
	uint8_t buf[8] = {0};
	int64_t shape[1] = {8};
	int pipefd[2];
	char ch;
	pid_t pid;

	ck_assert_dlpc(
		dlpc_publish(c, "mine",
			     host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			     DLPC_PUBLISH_EPHEMERAL),
		1);
	ck_assert_int_eq(pipe(pipefd), 0);
	pid = fork();
	if (pid == 0) {
		/* hold on until the parent is done checking */
		close(pipefd[1]);
		CHILD_CHECK(read(pipefd[0], &ch, 1) == 0);
		_exit(0);
	}
	close(pipefd[0]);
	dlpc_close(c);
	ck_assert(wait_stat(probe, one_entry_gone, NULL, 1000));
	close(pipefd[1]);
	ck_assert_int_eq(wait_child(pid), 0);
	dlpc_close(probe);
}
END_TEST

static int cmp_str(const void *a, const void *b)
{
	return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* LIST of @p prefix says exactly the names of @p names[i] for which @p live[i], sorted. */
static void list_is(dlpc_client *c, const char *prefix, char names[][16], const bool *live,
		    size_t n)
{
	const char *want[64];
	dlpc_entry_info *l;
	size_t m = 0, got;

	for (size_t i = 0; i < n; i++)
		if (live[i] && strncmp(names[i], prefix, strlen(prefix)) == 0)
			want[m++] = names[i];
	qsort(want, m, sizeof(*want), cmp_str);
	ck_assert_dlpc(dlpc_list(c, prefix, &l, &got), 0);
	ck_assert_uint_eq(got, m);
	for (size_t i = 0; i < m; i++)
		ck_assert_str_eq(l[i].name, want[i]);
	dlpc_list_free(l, got);
}

/* LISTs between publishes, replaces and removals in any order: every LIST gives exactly the
 * names there are, sorted, with a prefix too. The daemon keeps its sorted view of the names in
 * order through changes between LISTs (DLPD_SORTED_KEPT_MAX of them) and sorts anew past that:
 * here a LIST follows each change, then 1,500 changes pass with none, then LISTs follow each
 * change again. */
START_TEST(test_list_follows_changes)
{
	dlpc_client *c = connect_or_die(&D);
	char names[64][16];
	bool live[64] = {false};
	uint8_t buf[4] = {0};
	int64_t one = 1;
	unsigned seed = 20261128;

	for (int k = 0; k < 64; k++)
		snprintf(names[k], sizeof(names[k]), "lf/%c%02d", 'a' + (k * 5) % 7, k);
	for (int step = 0; step < 4000; step++) {
		int k = rand_r(&seed) % 64, op = rand_r(&seed) % 3;

		if (op < 2) {
			ck_assert_int_ge(dlpc_publish(c, names[k],
						      host_tensor(buf, (DLDataType){kDLInt, 32, 1},
								  1, &one, NULL, NULL),
						      DLPC_PUBLISH_REPLACE),
					 1);
			live[k] = true;
		} else if (live[k]) {
			ck_assert_dlpc(dlpc_unpublish(c, names[k]), 0);
			live[k] = false;
		}
		if (step < 1000 || step >= 2500) {
			list_is(c, "lf/", names, live, 64);
			if (step % 7 == 0)
				list_is(c, step % 2 ? "lf/c" : "lf/g", names, live, 64);
		}
	}
	list_is(c, "lf/", names, live, 64);
	dlpc_close(c);
}
END_TEST

START_TEST(test_list)
{
	dlpc_client *c = connect_or_die(&D);
	DLManagedTensorVersioned *t;
	dlpc_entry_info *l;
	size_t n;
	uint8_t buf[24] = {0};
	int64_t shape[2] = {2, 3};
	char name[32];

	for (int i = 0; i < 5000; i++) {
		snprintf(name, sizeof(name), "%s/%05d", i % 2 ? "odd" : "even", i);
		ck_assert_dlpc(dlpc_publish(c, name,
					    host_tensor(buf, (DLDataType){kDLInt, 32, 1}, 2, shape,
							NULL, NULL),
					    0),
			       1);
	}
	ck_assert_dlpc(dlpc_attach(c, "odd/00001", NULL, &t), 1);
	/* three bundles whose descriptions take ~3 MiB each: no two fit one 8 MiB LIST page, so
	 * the library must follow the daemon's pages to get everything */
	for (int b = 0; b < 3; b++) {
		enum { NT = 12000 };
		DLManagedTensorVersioned **ts = calloc(NT, sizeof(*ts));
		char **keys = calloc(NT, sizeof(*keys));
		int64_t one[1] = {1};

		for (int i = 0; i < NT; i++) {
			ck_assert_int_gt(asprintf(&keys[i], "%0240d", i), 0);
			ts[i] = host_tensor(buf, (DLDataType){kDLInt, 8, 1}, 1, one, NULL, NULL);
		}
		snprintf(name, sizeof(name), "huge/%d", b);
		ck_assert_dlpc(dlpc_publish_bundle(c, name, NT, (const char *const *)keys, ts, 0),
			       1);
		for (int i = 0; i < NT; i++)
			free(keys[i]);
		free(keys);
		free(ts);
	}
	ck_assert_dlpc(dlpc_list(c, "", &l, &n), 0);
	ck_assert_uint_eq(n, 5003);
	for (size_t i = 1; i < n; i++)
		ck_assert_int_lt(strcmp(l[i - 1].name, l[i].name), 0);
	for (size_t i = 0; i < n; i++)
		if (strncmp(l[i].name, "huge/", 5) == 0) {
			ck_assert_uint_eq(l[i].ntensors, 12000);
			ck_assert_ptr_nonnull(l[i].tensors);
			ck_assert_str_eq(l[i].tensors[11999].key + 235, "11999");
		}
	dlpc_list_free(l, n);
	ck_assert_uint_ge(stat_or_die(c).req_list, 2);
	ck_assert_dlpc(dlpc_list(c, "odd/", &l, &n), 0);
	ck_assert_uint_eq(n, 2500);
	ck_assert_str_eq(l[0].name, "odd/00001");
	ck_assert_uint_eq(l[0].refs, 1);
	ck_assert_uint_eq(l[1].refs, 0);
	ck_assert_uint_eq(l[0].generation, 1);
	ck_assert_int_eq(l[0].owner_pid, getpid());
	ck_assert_uint_eq(l[0].owner_uid, getuid());
	ck_assert_uint_eq(l[0].ntensors, 1);
	ck_assert_str_eq(l[0].tensors[0].key, "");
	ck_assert_int_eq(l[0].tensors[0].ndim, 2);
	ck_assert_int_eq(l[0].tensors[0].shape[1], 3);
	ck_assert_uint_eq(l[0].tensors[0].nbytes, 24);
	ck_assert_int_eq(l[0].tensors[0].dtype.code, kDLInt);
	ck_assert_int_gt(l[0].created_ns, 0);
	dlpc_list_free(l, n);
	ck_assert_dlpc(dlpc_list(c, "none/", &l, &n), 0);
	ck_assert_uint_eq(n, 0);
	dlpc_list_free(l, n);
	t->deleter(t);
	dlpc_close(c);
}
END_TEST

START_TEST(test_legacy_and_errors)
{
	dlpc_client *c = connect_or_die(&D), *none;
	struct pub_args v = {"leg", 12, 64, 0, 1};
	DLManagedTensorVersioned *t;
	DLManagedTensor *l;
	char longname[300];
	uint8_t buf[4];
	int64_t shape[1] = {4};
	int deleted = 0;

	ck_assert_int_eq(wait_child(spawn(publish_bytes, &v)), 0);
	ck_assert_dlpc(dlpc_attach(c, "leg", NULL, &t), 1);
	l = dlpc_to_legacy(t);
	ck_assert_ptr_nonnull(l);
	ck_assert(matches(l->dl_tensor.data, 64, 12));
	l->deleter(l);
	ck_assert(wait_stat(c, no_refs, NULL, 1000));

	memset(longname, 'n', sizeof(longname) - 1);
	longname[sizeof(longname) - 1] = '\0';
	ck_assert_dlpc(dlpc_attach(c, longname, NULL, &t), -EINVAL);
	ck_assert_dlpc(dlpc_attach(c, "", NULL, &t), -EINVAL);
	ck_assert_dlpc(dlpc_attach(c, "bad\xff", NULL, &t), -EINVAL);
	/* publish owns its tensor even when it fails: the deleter still runs once */
	ck_assert_dlpc(dlpc_publish(c, "",
				    host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL,
						&deleted),
				    0),
		       -EINVAL);
	ck_assert_dlpc(dlpc_publish(c, "leg",
				    host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL,
						&deleted),
				    0),
		       -EEXIST);
	ck_assert_int_eq(deleted, 2);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "already published"));
	/* errors name a bundle's tensor by its key, and a single tensor as "the tensor" */
	{
		const char *keys[2] = {"emb.weight", "head.bias"};
		DLManagedTensorVersioned *two[2] = {
			host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, &deleted),
			host_tensor(buf, (DLDataType){kDLFloat, 0, 1}, 1, shape, NULL, &deleted),
		};

		ck_assert_dlpc(dlpc_publish_bundle(c, "keys", 2, keys, two, 0), -EINVAL);
		ck_assert_msg(strstr(dlpc_last_error(),
				     "cannot publish 'keys': tensor 'head.bias' has a bad dtype"),
			      "%s", dlpc_last_error());
		t = host_tensor(buf, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, &deleted);
		t->dl_tensor.device.device_type = kDLOpenCL;
		ck_assert_dlpc(dlpc_publish(c, "one", t, 0), -ENOTSUP);
		ck_assert_msg(
			strstr(dlpc_last_error(), "cannot publish 'one': the tensor is on device"),
			"%s", dlpc_last_error());
		ck_assert_int_eq(deleted, 5);
	}
	ck_assert_dlpc(dlpc_unpublish(c, "absent"), -ENOENT);
	ck_assert_str_eq(dlpc_strerror(-ENOENT), "no such name (or no daemon socket)");
	/* a name that never appeared is no "Connection timed out" */
	ck_assert_ptr_null(strstr(dlpc_strerror(-ETIMEDOUT), "onnection"));
	ck_assert_ptr_nonnull(strstr(dlpc_strerror(-ETIMEDOUT), "a name"));
	ck_assert_dlpc(dlpc_connect("/nonexistent/dlpackd.sock", &none), -ENOENT);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "/nonexistent/dlpackd.sock"));
	dlpc_close(c);
}
END_TEST

static Suite *core_suite(void)
{
	Suite *s = suite_create("core");
	TCase *tc = tcase_create("host");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, scaled_ms(60000) / 1000);
	tcase_add_test(tc, test_publish_exit_attach);
	tcase_add_test(tc, test_dtype_matrix);
	tcase_add_test(tc, test_bundle_one_round_trip);
	tcase_add_test(tc, test_replace_while_attached);
	tcase_add_test(tc, test_unpublish_while_attached);
	tcase_add_test(tc, test_unpublish_if);
	tcase_add_test(tc, test_connect_other_minor);
	tcase_add_test(tc, test_attach_from_a_lying_daemon);
	tcase_add_test(tc, test_sigkill_drops_references);
	tcase_add_test(tc, test_ephemeral);
	tcase_add_test(tc, test_attach_wait);
	tcase_add_test(tc, test_threads_and_late_deleters);
	tcase_add_test(tc, test_deferred_release);
	tcase_add_test(tc, test_deleter_while_a_send_is_stuck);
	tcase_add_test(tc, test_a_request_cut_short_costs_the_connection);
	tcase_add_test(tc, test_cancel_ends_a_stuck_write);
	tcase_add_test(tc, test_a_call_behind_a_stuck_write_keeps_its_own_bound);
	tcase_add_test(tc, test_a_call_giving_up_behind_a_stuck_write_queues_its_cancel);
	tcase_add_test(tc, test_cancels_pending_max);
	tcase_add_test(tc, test_a_call_timeout_of_int64_max_waits_without_spinning);
	tcase_add_test(tc, test_releases_wait_for_room_without_spinning);
	tcase_add_test(tc, test_releases_of_a_closed_client_wait_for_room);
	tcase_add_test(tc, test_close_returns_with_the_connection_closed);
	tcase_add_test(tc, test_many_processes);
	tcase_add_test(tc, test_alloc_zero_copy);
	tcase_add_test(tc, test_alloc_bundle_zero_copy);
	tcase_add_test(tc, test_alloc_shares);
	tcase_add_test(tc, test_attach_shares);
	tcase_add_test(tc, test_writable);
	tcase_add_test(tc, test_fork_child_refused);
	tcase_add_test(tc, test_fork_does_not_keep_connection);
	tcase_add_test(tc, test_list);
	tcase_add_test(tc, test_list_follows_changes);
	tcase_add_test(tc, test_legacy_and_errors);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(core_suite());
}
