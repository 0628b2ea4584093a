/* SPDX-License-Identifier: Apache-2.0 */
/*
 * DLPC_ATTACH_POPULATE against a real daemon, the entries published by this process and attached
 * by a child: a 64 MiB entry attached with the flag and then read whole takes (nearly) no minor
 * page faults, in every mapping mode, for a bundle, for an attach answered from the client's
 * cache, and for a message received from a channel; without the flag the same read takes one
 * fault per 64 KiB (one per 2 MiB at least, with shmem huge pages). Faults are counted with
 * getrusage(), around the read alone. A copy-on-write mapping populated stays copy-on-write.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "harness.h"

static struct daemon D;

/* The entry's bytes: 64 MiB. */
#define ENTRY_BYTES (64u << 20)
/* The most minor faults a whole read of a populated mapping may take: none are expected; a few
 * allow for the child's stack and libdlpc's thread. */
#define POPULATED_FAULTS_MAX 16
/* The fewest a whole read of an unpopulated mapping takes: one per 2 MiB even where shmem huge
 * pages are on (one per 64 KiB, 1,024, without them). */
#define UNPOPULATED_FAULTS_MIN (ENTRY_BYTES / (2u << 20))

static void setup(void)
{
	/* the client's cache on, at its defaults, for the cached case */
	caches_at_defaults();
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

/* @p n bytes of words 0, 1, 2...: what every entry here holds (malloc'd). */
static uint64_t *words(size_t n)
{
	uint64_t *w = malloc(n);

	ck_assert_ptr_nonnull(w);
	for (size_t i = 0; i < n / 8; i++)
		w[i] = i;
	return w;
}

static long minflt(void)
{
	struct rusage u;

	getrusage(RUSAGE_SELF, &u);
	return u.ru_minflt;
}

/* The minor faults this process took to read the @p n bytes at @p p; *@p sum: the sum of their
 * words. Not instrumented by AddressSanitizer: its checks of the reads would fault in their
 * shadow memory (one page per 32 KiB read), counted here as if the mapping took them. */
__attribute__((no_sanitize_address)) static long read_faults(const void *p, size_t n, uint64_t *sum)
{
	const volatile uint64_t *w = p;
	long before = minflt();

	for (size_t i = 0; i < n / 8; i++)
		*sum += w[i];
	return minflt() - before;
}

/* What a child reads: the entry @p name (a bundle of halves if @p bundle) attached with
 * @p flags, or received from the channel @p name if @p recv. */
struct reader {
	const char *name;
	uint32_t flags;
	bool bundle, recv;
};

/* The sum of the words a whole entry holds (words() of ENTRY_BYTES, split anywhere). */
static uint64_t entry_sum(void)
{
	uint64_t n = ENTRY_BYTES / 8;

	return n * (n - 1) / 2;
}

/* In a child: are @p faults what @p flags ask for? Prints the count, for the log. */
static bool faults_fit(const struct reader *r, long faults)
{
	bool populated = r->flags & DLPC_ATTACH_POPULATE;

	fprintf(stderr, "%s flags 0x%x%s: %ld minor faults reading %u MiB\n", r->name,
		(unsigned)r->flags, r->bundle ? " (bundle)" : "", faults, ENTRY_BYTES >> 20);
	return populated ? faults <= POPULATED_FAULTS_MAX : faults >= UNPOPULATED_FAULTS_MIN;
}

static int read_child(void *arg)
{
	const struct reader *r = arg;
	dlpc_attach_opts o = {.size = sizeof(o), .flags = r->flags};
	dlpc_recv_opts ro = {.size = sizeof(ro), .flags = r->flags, .timeout_ms = scaled_ms(5000)};
	dlpc_bundle *b = NULL;
	DLManagedTensorVersioned *t[2] = {NULL, NULL};
	uint64_t sum = 0;
	long faults = 0;
	dlpc_client *c;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	if (r->recv)
		CHILD_CHECK(dlpc_recv(c, r->name, &ro, &t[0]) == 0);
	else if (r->bundle)
		CHILD_CHECK(dlpc_attach_bundle(c, r->name, &o, &b) > 0 &&
			    dlpc_bundle_count(b) == 2);
	else
		CHILD_CHECK(dlpc_attach(c, r->name, &o, &t[0]) > 0);
	for (size_t i = 0; b && i < 2; i++)
		t[i] = dlpc_bundle_take(b, i);
	for (size_t i = 0; i < 2 && t[i]; i++)
		faults += read_faults(t[i]->dl_tensor.data, ENTRY_BYTES / (b ? 2 : 1), &sum);
	CHILD_CHECK(sum == entry_sum());
	CHILD_CHECK(faults_fit(r, faults));
	/* a populated copy-on-write mapping still copies what it writes: the readers after this one
	 * see the published words */
	if (r->flags & (DLPC_ATTACH_PRIVATE | DLPC_ATTACH_GUARDED))
		((volatile uint64_t *)t[0]->dl_tensor.data)[1] = 77;
	for (size_t i = 0; i < 2 && t[i]; i++)
		t[i]->deleter(t[i]);
	dlpc_bundle_free(b);
	dlpc_close(c);
	return 0;
}

static void read_in_child(const char *name, uint32_t flags, bool bundle, bool recv)
{
	struct reader r = {.name = name, .flags = flags, .bundle = bundle, .recv = recv};

	ck_assert_int_eq(wait_child(spawn(read_child, &r)), 0);
}

static void publish_entry(dlpc_client *c, const char *name, uint32_t flags)
{
	int64_t shape[1] = {ENTRY_BYTES / 8};
	uint64_t *w = words(ENTRY_BYTES);

	ck_assert_int_gt(
		dlpc_publish(c, name,
			     host_tensor(w, (DLDataType){kDLUInt, 64, 1}, 1, shape, NULL, NULL),
			     flags),
		0);
	free(w);
}

/* Every mapping mode: read-only shared, copy-on-write (both kinds), shared writable. */
START_TEST(test_every_mode)
{
	static const uint32_t modes[] = {0, DLPC_ATTACH_PRIVATE, DLPC_ATTACH_GUARDED,
					 DLPC_ATTACH_WRITABLE};
	dlpc_client *c = connect_or_die(&D);

	publish_entry(c, "weights", DLPC_PUBLISH_WRITABLE);
	for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
		read_in_child("weights", modes[i] | DLPC_ATTACH_POPULATE | DLPC_ATTACH_NO_CACHE,
			      false, false);
		read_in_child("weights", modes[i] | DLPC_ATTACH_NO_CACHE, false, false);
	}
	dlpc_close(c);
}
END_TEST

/* A bundle's one mapping is populated whole: both its tensors. */
START_TEST(test_bundle)
{
	const char *keys[2] = {"a", "b"};
	int64_t shape[1] = {ENTRY_BYTES / 16};
	uint64_t *w = words(ENTRY_BYTES);
	DLDataType u64 = {kDLUInt, 64, 1};
	DLManagedTensorVersioned *t[2] = {
		host_tensor(w, u64, 1, shape, NULL, NULL),
		host_tensor(w + ENTRY_BYTES / 16, u64, 1, shape, NULL, NULL)};
	dlpc_client *c = connect_or_die(&D);

	ck_assert_int_gt(dlpc_publish_bundle(c, "dict", 2, keys, t, 0), 0);
	free(w);
	read_in_child("dict", DLPC_ATTACH_GUARDED | DLPC_ATTACH_POPULATE, true, false);
	read_in_child("dict", DLPC_ATTACH_GUARDED, true, false);
	dlpc_close(c);
}
END_TEST

/* In a child: attach @p name with the client's cache on and release it unread, so that the
 * cache keeps it; then attach it again with @p flags (answered from the cache: no ATTACH reaches
 * the daemon) and count the faults of reading it. */
static int cached_child(void *arg)
{
	const struct reader *r = arg;
	dlpc_attach_opts o = {.size = sizeof(o), .flags = r->flags & ~DLPC_ATTACH_POPULATE};
	DLManagedTensorVersioned *t;
	uint64_t served, sum = 0;
	dlpc_client *c;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, r->name, &o, &t) > 0);
	t->deleter(t);
	served = stat_or_die(c).req_attach;
	o.flags = r->flags;
	CHILD_CHECK(dlpc_attach(c, r->name, &o, &t) > 0);
	CHILD_CHECK(stat_or_die(c).req_attach == served);
	CHILD_CHECK(faults_fit(r, read_faults(t->dl_tensor.data, ENTRY_BYTES, &sum)));
	CHILD_CHECK(sum == entry_sum());
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* An attach answered from the client's cache (its kept mapping, or the kept fd mapped anew) is
 * populated as one from the daemon is. */
START_TEST(test_cached)
{
	static const uint32_t modes[] = {0, DLPC_ATTACH_GUARDED};
	dlpc_client *c = connect_or_die(&D);

	publish_entry(c, "cached", 0);
	for (size_t i = 0; i < sizeof(modes) / sizeof(modes[0]); i++) {
		struct reader pop = {.name = "cached", .flags = modes[i] | DLPC_ATTACH_POPULATE};
		struct reader lazy = {.name = "cached", .flags = modes[i]};

		ck_assert_int_eq(wait_child(spawn(cached_child, &pop)), 0);
		ck_assert_int_eq(wait_child(spawn(cached_child, &lazy)), 0);
	}
	dlpc_close(c);
}
END_TEST

/* A message received from a channel (dlpc_recv_opts.flags) is populated too. */
START_TEST(test_recv)
{
	dlpc_channel_info info = {.size = sizeof(info)};
	int64_t shape[1] = {ENTRY_BYTES / 8};
	uint64_t *w = words(ENTRY_BYTES);
	dlpc_client *c = connect_or_die(&D);

	ck_assert_dlpc(dlpc_channel_open_flags(c, "ch", 2, 0, &info), 1);
	for (int i = 0; i < 2; i++)
		ck_assert_dlpc(dlpc_send(c, "ch",
					 host_tensor(w, (DLDataType){kDLUInt, 64, 1}, 1, shape,
						     NULL, NULL),
					 0),
			       0);
	free(w);
	read_in_child("ch", DLPC_ATTACH_GUARDED | DLPC_ATTACH_POPULATE, false, true);
	read_in_child("ch", DLPC_ATTACH_GUARDED, false, true);
	dlpc_close(c);
}
END_TEST

/* An unknown flag next to it is still refused: the flag is known, not a free pass. */
START_TEST(test_known_flag)
{
	dlpc_attach_opts o = {.size = sizeof(o), .flags = DLPC_ATTACH_POPULATE | (1u << 12)};
	dlpc_recv_opts ro = {.size = sizeof(ro), .flags = DLPC_ATTACH_POPULATE | (1u << 12)};
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c = connect_or_die(&D);

	ck_assert_dlpc(dlpc_attach(c, "nothing", &o, &t), -EINVAL);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "unknown flags 0x1000"));
	ck_assert_dlpc(dlpc_recv(c, "nothing", &ro, &t), -EINVAL);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "unknown flags 0x1000"));
	o.flags = DLPC_ATTACH_POPULATE;
	ck_assert_dlpc(dlpc_attach(c, "nothing", &o, &t), -ENOENT);
	dlpc_close(c);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("populate");
	TCase *tc = tcase_create("populate");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_every_mode);
	tcase_add_test(tc, test_bundle);
	tcase_add_test(tc, test_cached);
	tcase_add_test(tc, test_recv);
	tcase_add_test(tc, test_known_flag);
	suite_add_tcase(s, tc);
	return run_suite(s);
}
