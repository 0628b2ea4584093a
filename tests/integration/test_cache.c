/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The client's cache of idle references (protocol 1.7), against a real daemon and real
 * processes: a replace or unpublish is never missed by an attach answered from a cache, the
 * bounds hold (counted by the daemon), and the cache goes with a lost connection and in a
 * forked child.
 */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "harness.h"

static struct daemon D;

static void setup(void)
{
	/* on, at their defaults unless a test sets a bound */
	caches_at_defaults();
	daemon_start(&D);
}

static void teardown(void)
{
	daemon_stop(&D);
}

/* Publish @p n bytes, each (@p seed + i) % 251, under @p name; the generation. */
static int publish(dlpc_client *c, const char *name, size_t n, unsigned seed, uint32_t flags)
{
	uint8_t *v = malloc(n);
	int64_t shape[1] = {(int64_t)n};
	int r;

	ck_assert_ptr_nonnull(v);
	for (size_t i = 0; i < n; i++)
		v[i] = (uint8_t)((seed + i) % 251);
	r = dlpc_publish(c, name, host_tensor(v, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL),
			 flags);
	free(v);
	return r;
}

/* Does @p t hold what publish() wrote with @p seed? */
static bool holds(const DLManagedTensorVersioned *t, size_t n, unsigned seed)
{
	const uint8_t *p = t->dl_tensor.data;

	if (t->dl_tensor.ndim != 1 || t->dl_tensor.shape[0] != (int64_t)n)
		return false;
	for (size_t i = 0; i < n; i++)
		if (p[i] != (uint8_t)((seed + i) % 251))
			return false;
	return true;
}

/* A client that counts what the daemon holds: no cache of its own. */
static dlpc_client *observer(void)
{
	dlpc_client *c;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_NO_CACHE, &c), 0);
	return c;
}

struct counts {
	uint64_t refs, cached;
};

static bool refs_are(const dlpc_stats *s, void *arg)
{
	const struct counts *want = arg;

	return s->references == want->refs && s->cached_references == want->cached;
}

/* Wait until the daemon holds @p refs references, @p cached of them cached. */
static void expect_refs(dlpc_client *obs, uint64_t refs, uint64_t cached)
{
	struct counts want = {refs, cached};
	dlpc_stats s;

	if (wait_stat(obs, refs_are, &want, scaled_ms(5000)))
		return;
	s = stat_or_die(obs);
	ck_abort_msg("the daemon holds %llu references, %llu cached; expected %llu, %llu",
		     (unsigned long long)s.references, (unsigned long long)s.cached_references,
		     (unsigned long long)refs, (unsigned long long)cached);
}

/* Attach @p name, check it, release it; the generation. */
static int attach_check(dlpc_client *c, const char *name, uint32_t flags, size_t n, unsigned seed)
{
	dlpc_attach_opts o = {.size = sizeof(o), .flags = flags};
	DLManagedTensorVersioned *t;
	int r = dlpc_attach(c, name, &o, &t);

	if (r < 0)
		return r;
	ck_assert_msg(holds(t, n, seed), "'%s' does not hold seed %u", name, seed);
	t->deleter(t);
	return r;
}

/* A second attach of an unchanged entry is answered from the cache: no ATTACH reaches the
 * daemon, the reference stays (marked cached while unused), the bytes are the same, and a
 * copy-on-write attach does not see an earlier one's writes. */
START_TEST(reattach_is_local)
{
	dlpc_client *c, *obs = observer();
	DLManagedTensorVersioned *t;
	dlpc_attach_opts cow = {.size = sizeof(cow), .flags = DLPC_ATTACH_PRIVATE};
	dlpc_entry_info *e;
	uint64_t before;
	size_t n;

	ck_assert_dlpc(dlpc_connect(D.sock, &c), 0);
	ck_assert_dlpc(publish(obs, "c/a", 4096, 7, 0), 1);
	ck_assert_dlpc(attach_check(c, "c/a", 0, 4096, 7), 1);
	expect_refs(obs, 1, 1);
	before = stat_or_die(obs).req_attach;
	for (int i = 0; i < 100; i++) {
		ck_assert_dlpc(attach_check(c, "c/a", 0, 4096, 7), 1);
		ck_assert_dlpc(attach_check(c, "c/a", DLPC_ATTACH_GUARDED, 4096, 7), 1);
	}
	ck_assert_uint_eq(stat_or_die(obs).req_attach, before);
	/* held: not cached; the list says so too */
	ck_assert_dlpc(dlpc_attach(c, "c/a", &cow, &t), 1);
	memset(t->dl_tensor.data, 0, 4096); /* private pages */
	expect_refs(obs, 1, 0);
	ck_assert_dlpc(dlpc_list(obs, "c/", &e, &n), 0);
	ck_assert_uint_eq(n, 1);
	ck_assert_uint_eq(e[0].refs, 1);
	ck_assert_uint_eq(e[0].cached_refs, 0);
	dlpc_list_free(e, n);
	t->deleter(t);
	ck_assert_dlpc(attach_check(c, "c/a", DLPC_ATTACH_PRIVATE, 4096, 7), 1);
	expect_refs(obs, 1, 1);
	ck_assert_dlpc(dlpc_list(obs, "c/", &e, &n), 0);
	ck_assert_uint_eq(e[0].cached_refs, 1);
	dlpc_list_free(e, n);
	ck_assert_uint_eq(stat_or_die(obs).req_attach, before);
	/* the bypass asks the daemon and keeps nothing */
	ck_assert_dlpc(attach_check(c, "c/a", DLPC_ATTACH_NO_CACHE, 4096, 7), 1);
	ck_assert_uint_eq(stat_or_die(obs).req_attach, before + 1);
	expect_refs(obs, 1, 1);
	/* dlpc_close() gives the cached reference back */
	dlpc_close(c);
	expect_refs(obs, 0, 0);
	dlpc_close(obs);
}
END_TEST

/* With the cache off (flag or environment) every attach asks the daemon. */
START_TEST(cache_off)
{
	dlpc_client *c, *obs = observer();
	uint64_t before;

	ck_assert_dlpc(publish(obs, "c/off", 64, 1, 0), 1);
	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_NO_CACHE, &c), 0);
	before = stat_or_die(obs).req_attach;
	for (int i = 0; i < 10; i++)
		ck_assert_dlpc(attach_check(c, "c/off", 0, 64, 1), 1);
	ck_assert_uint_eq(stat_or_die(obs).req_attach, before + 10);
	dlpc_close(c);
	setenv(DLPC_CACHE_IDLE_MS_ENV, "0", 1);
	ck_assert_dlpc(dlpc_connect(D.sock, &c), 0);
	for (int i = 0; i < 10; i++)
		ck_assert_dlpc(attach_check(c, "c/off", 0, 64, 1), 1);
	ck_assert_uint_eq(stat_or_die(obs).req_attach, before + 20);
	expect_refs(obs, 0, 0);
	dlpc_close(c);
	setenv(DLPC_CACHE_IDLE_MS_ENV, "ten", 1);
	ck_assert_dlpc(dlpc_connect(D.sock, &c), -EINVAL);
	dlpc_close(obs);
}
END_TEST

#define ROUNDS 300

struct pipes {
	int go[2];   /* A to B: the round's seed, generation and what to expect */
	int done[2]; /* B to A: checked */
};

struct round {
	int32_t seed;
	int32_t generation; /* 0: the name is unpublished */
};

/* Process B: each round, once A says what the name holds now, attach it (twice: the second
 * is the cache's to answer) and check the bytes and the generation. */
static int reader(void *arg)
{
	struct pipes *p = arg;
	dlpc_client *c;
	struct round r;

	close(p->go[1]);
	close(p->done[0]);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	while (read(p->go[0], &r, sizeof(r)) == sizeof(r)) {
		for (int k = 0; k < 2; k++) {
			DLManagedTensorVersioned *t = NULL;
			int g = dlpc_attach(c, "c/x", NULL, &t);

			if (r.generation == 0) {
				CHILD_CHECK(g == -ENOENT);
				continue;
			}
			CHILD_CHECK(g == r.generation);
			CHILD_CHECK(holds(t, 4096, (unsigned)r.seed));
			/* the second attach overlaps the first's tensor in one round of
			 * three: a held entry answers too */
			if (k == 0 && r.seed % 3 == 0) {
				DLManagedTensorVersioned *u;

				CHILD_CHECK(dlpc_attach(c, "c/x", NULL, &u) == r.generation);
				CHILD_CHECK(holds(u, 4096, (unsigned)r.seed));
				u->deleter(u);
			}
			t->deleter(t);
		}
		CHILD_CHECK(write(p->done[1], "k", 1) == 1);
	}
	dlpc_close(c);
	return 0;
}

/* A replaces or unpublishes the entry, then tells B out of band (a pipe); B's attaches, cached
 * or not, must see the change every time. The daemon answered far fewer ATTACH requests than
 * B made: the cache answered the rest. */
START_TEST(never_stale_across_processes)
{
	dlpc_client *a = observer();
	struct pipes p;
	uint64_t before;
	pid_t b;
	char k;

	ck_assert_int_eq(pipe(p.go), 0);
	ck_assert_int_eq(pipe(p.done), 0);
	b = spawn(reader, &p);
	close(p.go[0]);
	close(p.done[1]);
	before = stat_or_die(a).req_attach;
	for (int i = 1; i <= ROUNDS; i++) {
		struct round r = {.seed = i};

		if (i % 10 == 0) {
			ck_assert_dlpc(dlpc_unpublish(a, "c/x"), 0);
			r.generation = 0;
		} else {
			r.generation = publish(a, "c/x", 4096, (unsigned)i, DLPC_PUBLISH_REPLACE);
			ck_assert_int_gt(r.generation, 0);
		}
		ck_assert_int_eq(write(p.go[1], &r, sizeof(r)), sizeof(r));
		ck_assert_int_eq(read(p.done[0], &k, 1), 1);
		/* now and then B asks again before anything changes: the cache answers */
		if (i % 4 == 0) {
			ck_assert_int_eq(write(p.go[1], &r, sizeof(r)), sizeof(r));
			ck_assert_int_eq(read(p.done[0], &k, 1), 1);
		}
	}
	close(p.go[1]);
	ck_assert_int_eq(wait_child(b), 0);
	close(p.done[0]);
	ck_assert_uint_lt(stat_or_die(a).req_attach - before, (uint64_t)ROUNDS * 2);
	ck_assert_uint_gt(stat_or_die(a).invalidations, 0);
	dlpc_close(a);
}
END_TEST

/* The entry bound, the byte bound and the idle time each evict, as the daemon counts. */
START_TEST(bounds_hold)
{
	dlpc_client *c, *obs = observer();
	char name[32];

	for (int i = 0; i < 4; i++) {
		snprintf(name, sizeof(name), "c/b%d", i);
		ck_assert_dlpc(publish(obs, name, 1 << 16, (unsigned)i, 0), 1);
	}
	/* two entries at most */
	setenv(DLPC_CACHE_ENTRIES_ENV, "2", 1);
	ck_assert_dlpc(dlpc_connect(D.sock, &c), 0);
	for (int i = 0; i < 4; i++) {
		snprintf(name, sizeof(name), "c/b%d", i);
		ck_assert_dlpc(attach_check(c, name, 0, 1 << 16, (unsigned)i), 1);
	}
	expect_refs(obs, 2, 2);
	dlpc_close(c);
	expect_refs(obs, 0, 0);
	unsetenv(DLPC_CACHE_ENTRIES_ENV);

	/* room for one storage and a half */
	setenv(DLPC_CACHE_BYTES_ENV, "100000", 1);
	ck_assert_dlpc(dlpc_connect(D.sock, &c), 0);
	for (int i = 0; i < 4; i++) {
		snprintf(name, sizeof(name), "c/b%d", i);
		ck_assert_dlpc(attach_check(c, name, 0, 1 << 16, (unsigned)i), 1);
	}
	expect_refs(obs, 1, 1);
	/* one larger than the whole budget is not kept at all */
	setenv(DLPC_CACHE_BYTES_ENV, "1000", 1);
	dlpc_close(c);
	ck_assert_dlpc(dlpc_connect(D.sock, &c), 0);
	ck_assert_dlpc(attach_check(c, "c/b0", 0, 1 << 16, 0), 1);
	expect_refs(obs, 0, 0);
	dlpc_close(c);
	unsetenv(DLPC_CACHE_BYTES_ENV);

	/* idle entries go after their time, with no call made meanwhile */
	setenv(DLPC_CACHE_IDLE_MS_ENV, "50", 1);
	ck_assert_dlpc(dlpc_connect(D.sock, &c), 0);
	for (int i = 0; i < 3; i++) {
		snprintf(name, sizeof(name), "c/b%d", i);
		ck_assert_dlpc(attach_check(c, name, 0, 1 << 16, (unsigned)i), 1);
	}
	expect_refs(obs, 0, 0);
	dlpc_close(c);
	dlpc_close(obs);
}
END_TEST

/* An unpublish by another client is seen at once by the next attach, which then fails; an
 * entry in use when its name moves on is not handed out again. */
START_TEST(unpublish_in_process)
{
	dlpc_client *c, *obs = observer();
	DLManagedTensorVersioned *t;
	int g;

	ck_assert_dlpc(dlpc_connect(D.sock, &c), 0);
	ck_assert_dlpc(publish(obs, "c/u", 256, 3, 0), 1);
	ck_assert_dlpc(attach_check(c, "c/u", 0, 256, 3), 1);
	ck_assert_dlpc(dlpc_unpublish(obs, "c/u"), 0);
	ck_assert_dlpc(attach_check(c, "c/u", 0, 256, 3), -ENOENT);
	g = publish(obs, "c/u", 256, 4, 0);
	ck_assert_int_gt(g, 0);
	ck_assert_dlpc(dlpc_attach(c, "c/u", NULL, &t), g);
	g = publish(obs, "c/u", 256, 5, DLPC_PUBLISH_REPLACE);
	ck_assert_int_gt(g, 0);
	ck_assert_dlpc(attach_check(c, "c/u", 0, 256, 5), g);
	ck_assert(holds(t, 256, 4));
	t->deleter(t);
	/* the old storage's reference went, the new one is cached */
	expect_refs(obs, 1, 1);
	dlpc_close(c);
	dlpc_close(obs);
}
END_TEST

static bool one_storage_no_refs(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->storages == 1 && s->references == 0;
}

/* The library's thread reads the invalidation of an idle entry while the process makes no
 * call: the replaced storage is let go at once, not when the idle time (here a minute) is up. */
START_TEST(invalidation_frees_while_idle)
{
	dlpc_client *c, *obs = observer();

	setenv(DLPC_CACHE_IDLE_MS_ENV, "60000", 1);
	ck_assert_dlpc(dlpc_connect(D.sock, &c), 0);
	ck_assert_dlpc(publish(obs, "c/i", 1 << 20, 1, 0), 1);
	ck_assert_dlpc(attach_check(c, "c/i", 0, 1 << 20, 1), 1);
	expect_refs(obs, 1, 1);
	ck_assert_dlpc(publish(obs, "c/i", 1 << 20, 2, DLPC_PUBLISH_REPLACE), 2);
	ck_assert(wait_stat(obs, one_storage_no_refs, NULL, scaled_ms(5000)));
	ck_assert_dlpc(attach_check(c, "c/i", 0, 1 << 20, 2), 2);
	dlpc_close(c);
	dlpc_close(obs);
}
END_TEST

/* A lost connection takes the cache with it: after the daemon restarts and the client connects
 * anew, an attach of the same name (same generation number, other bytes) is asked of the new
 * daemon, not answered from the old mapping. */
START_TEST(reconnect_drops_cache)
{
	dlpc_client *c, *obs;
	dlpc_entry_info *e;
	size_t n;
	int r;

	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_RECONNECT, &c), 0);
	obs = observer();
	ck_assert_dlpc(publish(obs, "c/r", 512, 1, 0), 1);
	ck_assert_dlpc(attach_check(c, "c/r", 0, 512, 1), 1);
	dlpc_close(obs);
	ck_assert_int_eq(kill(D.pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(D.pid, NULL, 0), D.pid);
	D.pid = daemon_spawn(D.sock, D.log);
	for (int i = 0; dlpc_connect_flags(D.sock, DLPC_CONNECT_NO_CACHE, &obs) < 0; i++) {
		ck_assert_int_lt(i, 2000);
		usleep(5000);
	}
	ck_assert_dlpc(publish(obs, "c/r", 512, 2, 0), 1);
	/* the first call finds the connection lost, the next connects anew; or the library's
	 * thread, reading the socket for the cache's idle entry, found it lost first */
	r = dlpc_list(c, NULL, &e, &n);
	ck_assert_msg(r == -ECONNRESET || r == -EPIPE || r == 0, "first call after the kill: %d",
		      r);
	if (r < 0)
		ck_assert_dlpc(dlpc_list(c, NULL, &e, &n), 0);
	dlpc_list_free(e, n);
	ck_assert_uint_eq(dlpc_reconnects(c), 1);
	ck_assert_dlpc(attach_check(c, "c/r", 0, 512, 2), 1);
	ck_assert_uint_eq(stat_or_die(obs).req_attach, 1);
	expect_refs(obs, 1, 1);
	dlpc_close(c);
	expect_refs(obs, 0, 0);
	dlpc_close(obs);
}
END_TEST

static dlpc_client *forked_parent;

/* In the child: the parent's client (and so its cache) is refused; a client of its own asks
 * the daemon and gets the bytes. */
static int fork_child(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	dlpc_client *c;
	dlpc_stats s = {.size = sizeof(s)};
	uint64_t before;

	(void)arg;
	CHILD_CHECK(dlpc_attach(forked_parent, "c/f", NULL, &t) == -EBADFD);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(dlpc_stat(c, &s) == 0);
	before = s.req_attach;
	CHILD_CHECK(dlpc_attach(c, "c/f", NULL, &t) == 1);
	CHILD_CHECK(holds(t, 1024, 9));
	t->deleter(t);
	CHILD_CHECK(dlpc_stat(c, &s) == 0);
	CHILD_CHECK(s.req_attach == before + 1);
	dlpc_close(c);
	return 0;
}

START_TEST(fork_child_has_no_cache)
{
	dlpc_client *obs = observer();

	ck_assert_dlpc(dlpc_connect(D.sock, &forked_parent), 0);
	ck_assert_dlpc(publish(obs, "c/f", 1024, 9, 0), 1);
	ck_assert_dlpc(attach_check(forked_parent, "c/f", 0, 1024, 9), 1);
	ck_assert_int_eq(wait_child(spawn(fork_child, NULL)), 0);
	/* the parent's cache is untouched by the child */
	expect_refs(obs, 1, 1);
	ck_assert_dlpc(attach_check(forked_parent, "c/f", 0, 1024, 9), 1);
	dlpc_close(forked_parent);
	expect_refs(obs, 0, 0);
	dlpc_close(obs);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("cache");
	TCase *tc = tcase_create("cache");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, reattach_is_local);
	tcase_add_test(tc, cache_off);
	tcase_add_test(tc, never_stale_across_processes);
	tcase_add_test(tc, bounds_hold);
	tcase_add_test(tc, unpublish_in_process);
	tcase_add_test(tc, invalidation_frees_while_idle);
	tcase_add_test(tc, reconnect_drops_cache);
	tcase_add_test(tc, fork_child_has_no_cache);
	suite_add_tcase(s, tc);
	return run_suite(s);
}
