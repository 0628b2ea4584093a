/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The receiver's kept mappings (client/maps.c), against a real daemon, with the messages sent
 * from another process: the mapping of a storage that comes again is kept and handed out again,
 * never that of a storage seen once; what a copy-on-write user wrote never shows to the next
 * message; a recycled buffer refilled by its sender shows its new bytes; two storages are never
 * confused; the bounds, the idle time, the opt-outs, dlpc_close() and fork() let go of them.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "direct.h"
#include "harness.h"
#include "raw.h"
#include "table.h"

static struct daemon D;

/* Bytes of the messages: 96 pages, room for more written ranges than one scan reports. */
#define MSG_BYTES (96 * 4096)

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

static void fill(uint8_t *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)((seed + i) % 251);
}

static bool holds(const DLManagedTensorVersioned *t, unsigned seed)
{
	const uint8_t *p = t->dl_tensor.data;

	if (t->dl_tensor.ndim != 1 || t->dl_tensor.shape[0] != MSG_BYTES)
		return false;
	for (size_t i = 0; i < MSG_BYTES; i++)
		if (p[i] != (uint8_t)((seed + i) % 251))
			return false;
	return true;
}

/* Is a memfd mapped at @p addr in this process? */
static bool mapped(const void *addr)
{
	FILE *f = fopen("/proc/self/maps", "r");
	char line[512];
	bool found = false;

	ck_assert_ptr_nonnull(f);
	while (!found && fgets(line, sizeof(line), f))
		found = strtoull(line, NULL, 16) == (uintptr_t)addr && strstr(line, "/memfd:");
	fclose(f);
	return found;
}

/* What a sender child sends: @p n messages to @p ch, message i of storage order[i] (storages
 * made with dlpc_alloc(), filled with seed 1 + their index), or of fresh memory (a copy) each
 * if order is NULL (seed 1 + i). */
struct plan {
	const char *ch;
	int n;
	const int *order;
};

static int sender(void *arg)
{
	const struct plan *p = arg;
	int64_t shape = MSG_BYTES;
	DLDataType u8 = {kDLUInt, 8, 1};
	DLManagedTensorVersioned *bufs[4] = {0};
	uint8_t *copy = malloc(MSG_BYTES);
	dlpc_client *c;

	CHILD_CHECK(copy && dlpc_connect(D.sock, &c) == 0);
	for (int i = 0; i < p->n; i++) {
		DLManagedTensorVersioned *t;

		if (!p->order) {
			fill(copy, MSG_BYTES, 1 + (unsigned)i);
			t = host_tensor(copy, u8, 1, &shape, NULL, NULL);
		} else {
			int k = p->order[i];

			if (!bufs[k]) {
				CHILD_CHECK(dlpc_alloc(c, (DLDevice){kDLCPU, 0}, u8, 1, &shape,
						       &bufs[k]) == 0);
				fill(bufs[k]->dl_tensor.data, MSG_BYTES, 1 + (unsigned)k);
			}
			t = dlpc_tensor_share(bufs[k]);
			CHILD_CHECK(t);
		}
		CHILD_CHECK(dlpc_send(c, p->ch, t, 0) == 0);
	}
	for (int k = 0; k < 4; k++)
		if (bufs[k])
			bufs[k]->deleter(bufs[k]);
	free(copy);
	dlpc_close(c);
	return 0;
}

/* Open @p ch (direct or queued) on @p c for @p p's messages, and start sending them. */
static pid_t start_sender(dlpc_client *c, struct plan *p, bool direct)
{
	dlpc_channel_info info = {.size = sizeof(info)};

	/* 1: made now */
	ck_assert_dlpc(dlpc_channel_open_flags(c, p->ch, (uint32_t)p->n,
					       direct ? DLPC_CHANNEL_DIRECT : 0, &info),
		       1);
	return spawn(sender, p);
}

static DLManagedTensorVersioned *recv_or_die(dlpc_client *c, const char *ch, uint32_t flags)
{
	dlpc_recv_opts o = {.size = sizeof(o), .flags = flags, .timeout_ms = scaled_ms(5000)};
	DLManagedTensorVersioned *t = NULL;

	ck_assert_dlpc(dlpc_recv(c, ch, &o, &t), 0);
	return t;
}

static bool is_pagemap(const char *target, void *arg)
{
	(void)arg;
	return strstr(target, "/pagemap") != NULL;
}

/* This process's fds open on a /proc/PID/pagemap. */
static int pagemap_fds(void)
{
	return fd_links(getpid(), is_pagemap, NULL);
}

/* Wait until nothing is mapped at @p addr any more; whether it happened. */
static bool unmapped_soon(const void *addr)
{
	for (int i = 0; i < scaled_ms(5000) / 10; i++) {
		if (!mapped(addr))
			return true;
		usleep(10000);
	}
	return false;
}

/* Two storages, A and B, alternate: each is mapped anew until it came twice, then kept and
 * handed out again; neither is ever shown for the other; unused, they go after the idle time. */
static void recurring(bool direct, uint32_t flags)
{
	static const int order[] = {0, 1, 0, 1, 0, 1, 0};
	struct plan p = {direct ? "m/direct" : "m/queued", 7, order};
	const void *kept[2] = {NULL, NULL};
	dlpc_client *c;
	pid_t pid;

	setenv(DLPC_CACHE_IDLE_MS_ENV, "400", 1);
	c = connect_or_die(&D);
	pid = start_sender(c, &p, direct);
	for (int i = 0; i < 6; i++) {
		DLManagedTensorVersioned *t = recv_or_die(c, p.ch, flags);
		int k = order[i];
		void *at = t->dl_tensor.data;

		ck_assert_msg(holds(t, 1 + (unsigned)k), "message %d: not storage %d's bytes", i,
			      k);
		/* from its second message on, a storage's mapping is the one kept */
		if (kept[k])
			ck_assert_ptr_eq(at, kept[k]);
		t->deleter(t);
		if (i < 2) {
			ck_assert_msg(!mapped(at), "storage %d seen once: its mapping stayed", k);
		} else {
			ck_assert_msg(mapped(at), "storage %d came again: its mapping went", k);
			kept[k] = at;
		}
	}
	ck_assert_int_eq(wait_child(pid), 0);
	/* idle past DLPC_CACHE_IDLE_MS: the library's thread unmaps them */
	ck_assert_msg(unmapped_soon(kept[0]) && unmapped_soon(kept[1]),
		      "kept mappings outlived the idle time");
	{
		DLManagedTensorVersioned *t = recv_or_die(c, p.ch, flags);

		ck_assert(holds(t, 1));
		t->deleter(t);
	}
	dlpc_close(c);
}

START_TEST(direct_recurring_storage_is_kept)
{
	recurring(true, 0);
}
END_TEST

START_TEST(queued_recurring_storage_is_kept)
{
	recurring(false, 0);
}
END_TEST

START_TEST(guarded_recurring_storage_is_kept)
{
	recurring(true, DLPC_ATTACH_GUARDED);
}
END_TEST

/* How many copy-on-write mappings (private, writable) of a memfd this process holds. */
static int cow_mappings(void)
{
	FILE *f = fopen("/proc/self/maps", "r");
	char line[512];
	int n = 0;

	ck_assert_ptr_nonnull(f);
	while (fgets(line, sizeof(line), f))
		n += strstr(line, " rw-p ") && strstr(line, "/memfd:");
	fclose(f);
	return n;
}

/* A storage whose kept copy-on-write mapping waits idle while its messages keep coming
 * read-only, and another storage kept and taken in between: the copy-on-write mapping still
 * goes after DLPC_CACHE_IDLE_MS. (maps.c moves the storage up the list with its old mapping,
 * and the sweep stops at the first young mapping it meets: the other storage's.) */
START_TEST(idle_mapping_of_other_kind_goes_in_time)
{
	static const int order[] = {0, 0, 1, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0,
				    1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0};
	struct plan p = {"m/kinds", 25, order};
	dlpc_client *c;
	pid_t pid;
	int i = 0;

	setenv(DLPC_CACHE_IDLE_MS_ENV, "300", 1);
	c = connect_or_die(&D);
	pid = start_sender(c, &p, true);
	for (; i < 25; i++) {
		/* storage 0 twice copy-on-write (its mapping kept so), then read-only */
		DLManagedTensorVersioned *t = recv_or_die(c, p.ch, i < 2 ? DLPC_ATTACH_PRIVATE : 0);

		ck_assert(holds(t, 1 + (unsigned)order[i]));
		t->deleter(t);
		if (i == 1)
			ck_assert_int_eq(cow_mappings(), 1);
		if (i >= 4 && order[i] == 0)
			usleep((useconds_t)scaled_ms(60) * 1000);
	}
	ck_assert_int_eq(wait_child(pid), 0);
	/* about 10 x 60 ms since storage 0's copy-on-write mapping was kept, idle, and never
	 * handed out again: twice the idle time */
	ck_assert_msg(cow_mappings() == 0,
		      "a kept copy-on-write mapping outlived DLPC_CACHE_IDLE_MS (300 ms) by far");
	dlpc_close(c);
}
END_TEST

/* A fresh storage per message (a copy each time) is never kept: each message's mapping goes
 * with its last release. */
START_TEST(fresh_storages_are_not_kept)
{
	struct plan p = {"m/fresh", 5, NULL};
	dlpc_client *c = connect_or_die(&D);
	pid_t pid = start_sender(c, &p, true);

	for (int i = 0; i < 5; i++) {
		DLManagedTensorVersioned *t = recv_or_die(c, p.ch, 0);
		void *at = t->dl_tensor.data;

		ck_assert(holds(t, 1 + (unsigned)i));
		t->deleter(t);
		ck_assert_msg(!mapped(at), "message %d: a storage seen once stayed mapped", i);
	}
	ck_assert_int_eq(wait_child(pid), 0);
	dlpc_close(c);
}
END_TEST

/* What a copy-on-write receiver wrote (a few pages; then more ranges than one scan reports;
 * then every page) never shows in a later message of the same storage. */
START_TEST(copy_on_write_writes_never_show_again)
{
	static const int order[] = {0, 0, 0, 0, 0, 0};
	struct plan p = {"m/cow", 6, order};
	dlpc_client *c = connect_or_die(&D);
	pid_t pid = start_sender(c, &p, true);
	void *kept = NULL;

	for (int i = 0; i < 6; i++) {
		DLManagedTensorVersioned *t =
			recv_or_die(c, p.ch, i % 2 ? DLPC_ATTACH_GUARDED : DLPC_ATTACH_PRIVATE);
		uint8_t *d = t->dl_tensor.data;

		ck_assert_msg(holds(t, 1), "message %d shows an earlier receiver's writes", i);
		if (kept)
			ck_assert_ptr_eq(d, kept);
		/* written as a consumer that ignores the read-only flag would */
		if (i % 3 == 0) {
			d[0] = d[MSG_BYTES - 1] = 0xee;
		} else if (i % 3 == 1) {
			for (size_t pg = 0; pg < MSG_BYTES / 4096; pg += 2)
				d[pg * 4096 + 7] ^= 0x5a;
		} else {
			memset(d, 0x33, MSG_BYTES);
		}
		t->deleter(t);
		if (i >= 1) {
			ck_assert(mapped(d));
			kept = d;
		}
	}
	ck_assert_int_eq(wait_child(pid), 0);
	/* the written pages were found through this process's one pagemap fd, which goes with
	 * its last client */
	ck_assert_int_eq(pagemap_fds(), 1);
	dlpc_close(c);
	ck_assert_int_eq(pagemap_fds(), 0);
}
END_TEST

/* Opting out keeps nothing: DLPC_ATTACH_NO_CACHE on a receive, DLPC_CONNECT_NO_CACHE, a byte
 * bound smaller than the storage, an entries bound of 1 with two storages alternating (each
 * pushes the other out before it comes again). */
static void never_kept(dlpc_client *c, const char *ch, const int *order, int n, uint32_t flags)
{
	struct plan p = {ch, n, order};
	pid_t pid = start_sender(c, &p, true);

	for (int i = 0; i < n; i++) {
		DLManagedTensorVersioned *t = recv_or_die(c, ch, flags);
		void *at = t->dl_tensor.data;

		ck_assert(holds(t, 1 + (unsigned)order[i]));
		t->deleter(t);
		ck_assert_msg(!mapped(at), "'%s' message %d: its mapping was kept", ch, i);
	}
	ck_assert_int_eq(wait_child(pid), 0);
}

START_TEST(opting_out_keeps_nothing)
{
	static const int same[] = {0, 0, 0, 0};
	static const int alternate[] = {0, 1, 0, 1, 0, 1};
	dlpc_client *c = connect_or_die(&D);

	never_kept(c, "m/nocache-flag", same, 4, DLPC_ATTACH_NO_CACHE);
	dlpc_close(c);
	ck_assert_dlpc(dlpc_connect_flags(D.sock, DLPC_CONNECT_NO_CACHE, &c), 0);
	never_kept(c, "m/nocache-client", same, 4, 0);
	dlpc_close(c);
	setenv(DLPC_CACHE_BYTES_ENV, "65536", 1);
	c = connect_or_die(&D);
	never_kept(c, "m/bytes", same, 4, 0);
	dlpc_close(c);
	unsetenv(DLPC_CACHE_BYTES_ENV);
	setenv(DLPC_CACHE_ENTRIES_ENV, "1", 1);
	c = connect_or_die(&D);
	never_kept(c, "m/entries", alternate, 6, 0);
	dlpc_close(c);
}
END_TEST

static const void *forked_kept;

static int forked_child(void *arg)
{
	(void)arg;
	/* the parent's kept mapping is not this process's to keep */
	return mapped(forked_kept) ? 1 : 0;
}

/* A kept mapping goes in a forked child at once, in the parent at dlpc_close(). */
START_TEST(fork_and_close_let_go)
{
	static const int order[] = {0, 0};
	struct plan p = {"m/fork", 2, order};
	dlpc_client *c = connect_or_die(&D);
	pid_t pid = start_sender(c, &p, true);

	for (int i = 0; i < 2; i++) {
		DLManagedTensorVersioned *t = recv_or_die(c, p.ch, 0);

		forked_kept = t->dl_tensor.data;
		t->deleter(t);
	}
	ck_assert_int_eq(wait_child(pid), 0);
	ck_assert(mapped(forked_kept));
	ck_assert_int_eq(wait_child(spawn(forked_child, NULL)), 0);
	ck_assert(mapped(forked_kept));
	dlpc_close(c);
	ck_assert(!mapped(forked_kept));
}
END_TEST

/* A receiver with no library thread (its uid at RLIMIT_NPROC: pthread_create fails) keeps
 * mappings all the same, and nothing sweeps them by time; each mapping it keeps sweeps those
 * idle past DLPC_CACHE_IDLE_MS instead, so they last no longer than the traffic that made
 * them. Storages A, A (kept), then after the idle time B, B (kept: A goes). */
static int threadless_receiver(void *arg)
{
	const char *ch = arg;
	dlpc_recv_opts o = {.size = sizeof(o), .timeout_ms = scaled_ms(5000)};
	struct rlimit one = {1, 1};
	DLManagedTensorVersioned *t;
	dlpc_client *c;
	void *a = NULL;

	CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(65534) == 0 && setuid(65534) == 0);
	/* setuid made /proc/self root's: take it back, for /proc/self/maps */
	CHILD_CHECK(prctl(PR_SET_DUMPABLE, 1) == 0);
	CHILD_CHECK(setrlimit(RLIMIT_NPROC, &one) == 0);
	setenv(DLPC_CACHE_IDLE_MS_ENV, "100", 1);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	for (int i = 0; i < 4; i++) {
		CHILD_CHECK(dlpc_recv(c, ch, &o, &t) == 0);
		CHILD_CHECK(holds(t, i < 2 ? 1 : 2));
		if (i == 1)
			a = t->dl_tensor.data;
		t->deleter(t);
		if (i == 1) {
			CHILD_CHECK(mapped(a));
			usleep(400 * 1000);
			/* no thread: still there */
			CHILD_CHECK(mapped(a));
		}
	}
	/* B kept, A idle past its time: swept by B's keeping */
	CHILD_CHECK(!mapped(a));
	dlpc_close(c);
	return 0;
}

START_TEST(threadless_receiver_expires_by_traffic)
{
	static const int order[] = {0, 0, 1, 1};
	struct plan p = {"m/threadless", 4, order};
	dlpc_client *c = connect_or_die(&D);
	pid_t rx;

	daemon_open_for_others(&D);
	ck_assert_int_eq(wait_child(start_sender(c, &p, true)), 0);
	rx = spawn(threadless_receiver, (void *)p.ch);
	ck_assert_int_eq(wait_child(rx), 0);
	dlpc_close(c);
}
END_TEST

/* A recycled buffer (dlpc_channel_alloc) refilled by its sender between messages: the kept
 * mapping shows the new bytes, as a fresh one would. The sender waits for each message to be
 * taken and its buffer to come back before the next. */
static int pool_sender(void *arg)
{
	const char *ch = arg;
	int64_t shape = MSG_BYTES;
	dlpc_client *c;

	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	for (int i = 0; i < 12; i++) {
		DLManagedTensorVersioned *t, *ack;
		dlpc_recv_opts o = {.size = sizeof(o), .timeout_ms = scaled_ms(5000)};

		CHILD_CHECK(dlpc_channel_alloc(c, ch, (DLDataType){kDLUInt, 8, 1}, 1, &shape, &t) ==
			    0);
		fill(t->dl_tensor.data, MSG_BYTES, 10 + (unsigned)i);
		CHILD_CHECK(dlpc_send(c, ch, t, 0) == 0);
		CHILD_CHECK(dlpc_recv(c, "m/pool-ack", &o, &ack) == 0);
		ack->deleter(ack);
		/* the receiver's release reaches dlpackd within DLPC_RELEASE_DELAY_MS, and the
		 * buffer comes back to this pool after it */
		usleep((useconds_t)scaled_ms(30) * 1000);
	}
	dlpc_close(c);
	return 0;
}

START_TEST(recycled_buffer_shows_new_bytes)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_channel_info info = {.size = sizeof(info)};
	int64_t one = 1;
	uint8_t b = 1;
	int hits = 0;
	void *last[2] = {NULL, NULL}; /* kept, of each kind of mapping */
	pid_t pid;

	ck_assert_dlpc(dlpc_channel_open(c, "m/pool", 2, &info), 1);
	ck_assert_dlpc(dlpc_channel_open(c, "m/pool-ack", 2, &info), 1);
	pid = spawn(pool_sender, "m/pool");
	for (int i = 0; i < 12; i++) {
		DLManagedTensorVersioned *t =
			recv_or_die(c, "m/pool", i % 2 ? DLPC_ATTACH_GUARDED : 0);
		void *at = t->dl_tensor.data;

		ck_assert_msg(holds(t, 10 + (unsigned)i), "message %d: not the bytes sent", i);
		hits += at == last[i % 2];
		t->deleter(t);
		last[i % 2] = mapped(at) ? at : NULL;
		ck_assert_dlpc(
			dlpc_send(c, "m/pool-ack",
				  host_tensor(&b, (DLDataType){kDLUInt, 8, 1}, 1, &one, NULL, NULL),
				  0),
			0);
	}
	ck_assert_int_eq(wait_child(pid), 0);
	/* the buffer did come back, and was received through its kept mapping */
	ck_assert_msg(hits > 0, "no message came in a kept mapping");
	dlpc_close(c);
}
END_TEST

/* ---- a hostile sender on a direct channel ---- */

struct stalled_recv {
	dlpc_client *c;
	int r;
	volatile int done;
};

static void *stalled_recv_thread(void *arg)
{
	struct stalled_recv *s = arg;
	dlpc_recv_opts o = {.size = sizeof(o), .timeout_ms = scaled_ms(2000)};
	DLManagedTensorVersioned *t = NULL;

	s->r = dlpc_recv(s->c, "m/stall", &o, &t);
	if (t)
		t->deleter(t);
	__atomic_store_n(&s->done, 1, __ATOMIC_RELEASE);
	return NULL;
}

/* A hostile sender on a direct channel sends a descriptor of a file whose filesystem never
 * answers (a FUSE mount whose server reads nothing): the receiver drops it with EBADMSG within
 * its timeout, as the storage checks (F_GET_SEALS first, then cached attributes only) always
 * did, and never blocks in an fstat() of it. Needs /dev/fuse and the right to mount (root). */
START_TEST(direct_stalling_file_never_blocks_the_receiver)
{
	char dir[] = "/tmp/dlpc-maps-fuse-XXXXXX", opts[128];
	uint8_t rec[DLPC_DIRECT_RECORD];
	struct stalled_recv s = {0};
	dlpc_recv_opts o = {.size = sizeof(o), .timeout_ms = 1};
	DLManagedTensorVersioned *t = NULL;
	int fuse, stall, raw, ends[2];
	pthread_t th;
	bool hung;

	fuse = open("/dev/fuse", O_RDWR | O_CLOEXEC);
	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(opts, sizeof(opts), "fd=%d,rootmode=40000,user_id=%u,group_id=%u", fuse,
		 (unsigned)getuid(), (unsigned)getgid());
	/* in a mount namespace of this test's own: the mount goes with it, whatever happens */
	if (fuse < 0 || unshare(CLONE_NEWNS) < 0 ||
	    mount("none", "/", "none", MS_REC | MS_PRIVATE, NULL) < 0 ||
	    mount("dlpcstall", dir, "fuse", MS_NOSUID | MS_NODEV, opts) < 0) {
		fprintf(stderr, "skipped: cannot mount FUSE here: %s\n", strerror(errno));
		if (fuse >= 0)
			close(fuse);
		rmdir(dir);
		return;
	}
	/* no request to the server: an O_PATH open of the mount's root */
	stall = open(dir, O_PATH | O_CLOEXEC);
	ck_assert_int_ge(stall, 0);
	s.c = connect_or_die(&D);
	ck_assert_dlpc(dlpc_channel_open_flags(s.c, "m/stall", 4, DLPC_CHANNEL_DIRECT, NULL), 1);
	ck_assert_dlpc(dlpc_recv(s.c, "m/stall", &o, &t), -ETIMEDOUT);
	raw = raw_connect(&D);
	raw_join_or_die(raw, "m/stall", ends);
	close(ends[1]);
	raw_small_record(rec);
	ck_assert_int_eq(send_fds_raw(ends[0], rec, sizeof(rec), &stall, 1), (ssize_t)sizeof(rec));
	close(stall);
	ck_assert_int_eq(pthread_create(&th, NULL, stalled_recv_thread, &s), 0);
	for (int i = 0; i < scaled_ms(5000) / 10 && !__atomic_load_n(&s.done, __ATOMIC_ACQUIRE);
	     i++)
		usleep(10000);
	hung = !__atomic_load_n(&s.done, __ATOMIC_ACQUIRE);
	/* the server goes: a request it never answered fails, and the receive returns */
	close(fuse);
	umount2(dir, MNT_DETACH);
	rmdir(dir);
	pthread_join(th, NULL);
	close(ends[0]);
	close(raw);
	ck_assert_msg(!hung, "dlpc_recv() blocked in the filesystem of a hostile sender's fd, "
			     "past its timeout");
	ck_assert_int_eq(s.r, -EBADMSG);
	dlpc_close(s.c);
}
END_TEST

int main(void)
{
	Suite *s = suite_create("maps");
	TCase *tc = tcase_create("maps");

	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, direct_recurring_storage_is_kept);
	tcase_add_test(tc, queued_recurring_storage_is_kept);
	tcase_add_test(tc, guarded_recurring_storage_is_kept);
	tcase_add_test(tc, fresh_storages_are_not_kept);
	tcase_add_test(tc, copy_on_write_writes_never_show_again);
	tcase_add_test(tc, opting_out_keeps_nothing);
	tcase_add_test(tc, fork_and_close_let_go);
	tcase_add_test(tc, recycled_buffer_shows_new_bytes);
	tcase_add_test(tc, threadless_receiver_expires_by_traffic);
	tcase_add_test(tc, idle_mapping_of_other_kind_goes_in_time);
	tcase_add_test(tc, direct_stalling_file_never_blocks_the_receiver);
	suite_add_tcase(s, tc);
	return run_suite(s);
}
