/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Queued channels against a real dlpackd, driven from separate processes: the tests both kinds
 * of channel share (channel_kinds.c), run for a queued channel, and what only a queued channel
 * has: streams ended by other uids, recycled buffers (the pool), a bundle's keys checked as a
 * PUBLISH checks them, what LIST, STAT and WATCH say of channels, malformed requests from a raw
 * client, and the daemon's limits.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "channel_kinds.h"

/* ---- senders waiting for room go in, in turn, one per message received ---- */

static int queued_sender(void *arg)
{
	dlpc_client *c = child_connect();

	CHILD_CHECK(send_value(c, "bq", *(const int64_t *)arg, 1, 0, -1) == 0);
	dlpc_close(c);
	return 0;
}

START_TEST(test_backpressure_queue)
{
	dlpc_client *c = connect_or_die(&D);
	int64_t three = 3, four = 4, v;
	pid_t s3, s4;

	ck_assert_dlpc(dlpc_channel_open(c, "bq", 2, NULL), 1);
	ck_assert_dlpc(send_value(c, "bq", 1, 1, 0, -1), 0);
	ck_assert_dlpc(send_value(c, "bq", 2, 1, 0, -1), 0);
	s3 = spawn(queued_sender, &three);
	ck_assert(WAIT_CHAN(c, "bq", senders_waiting, 1));
	s4 = spawn(queued_sender, &four);
	ck_assert(WAIT_CHAN(c, "bq", senders_waiting, 2));
	/* room for one: the oldest sender goes in, the other still waits behind it */
	ck_assert_dlpc(recv_value(c, "bq", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 1);
	ck_assert_int_eq(wait_child(s3), 0);
	ck_assert_uint_eq(chan_or_die(c, "bq").senders_waiting, 1);
	ck_assert_uint_eq(chan_or_die(c, "bq").depth, 2);
	ck_assert_dlpc(recv_value(c, "bq", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 2);
	ck_assert_int_eq(wait_child(s4), 0);
	for (int64_t want = 3; want <= 4; want++) {
		ck_assert_dlpc(recv_value(c, "bq", 0, &v, NULL, NULL), 0);
		ck_assert_int_eq(v, want);
	}
	ck_assert_dlpc(recv_value(c, "bq", 0, &v, NULL, NULL), -EAGAIN);
	dlpc_close(c);
}
END_TEST

/* uid 65534, which never sent to root's channel, closes it from two connections: without a
 * message of its own that changes nothing (else it would end another uid's stream, which
 * close-all refuses it). */
static int bare_close_other_uid(void *arg)
{
	(void)arg;
	CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(NOBODY) == 0 && setuid(NOBODY) == 0);
	for (int k = 0; k < 2; k++) {
		dlpc_client *c = child_connect();

		CHILD_CHECK(dlpc_channel_close(c, "bare") == 0);
		dlpc_close(c);
	}
	return 0;
}

START_TEST(test_end_other_uid_bare_close)
{
	dlpc_client *c = connect_or_die(&D), *p = connect_or_die(&D);
	dlpc_channel_opts o = {.size = sizeof(o), .producers = 2};
	dlpc_channel_info i;
	int64_t v;

	daemon_open_for_others(&D);
	ck_assert_dlpc(dlpc_channel_open_opts(c, "bare", &o, NULL), 1);
	ck_assert_int_eq(wait_child(spawn(bare_close_other_uid, NULL)), 0);
	i = chan_or_die(c, "bare");
	ck_assert(!(i.flags & DLPC_CHANNEL_ENDED));
	ck_assert_uint_eq(i.producers_closed, 0);
	/* root's two producers: the stream is theirs */
	ck_assert_dlpc(send_value(p, "bare", 5, 1, 0, -1), 0);
	ck_assert_dlpc(dlpc_channel_close(p, "bare"), 0);
	ck_assert(!(chan_or_die(c, "bare").flags & DLPC_CHANNEL_ENDED));
	ck_assert_dlpc(dlpc_channel_close(c, "bare"), 0);
	ck_assert(chan_or_die(c, "bare").flags & DLPC_CHANNEL_ENDED);
	ck_assert_dlpc(recv_value(c, "bare", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 5);
	ck_assert_dlpc(recv_value(c, "bare", 0, &v, NULL, NULL), -EPIPE);
	ck_assert_dlpc(dlpc_channel_remove(c, "bare"), 0);
	dlpc_close(p);
	dlpc_close(c);
}
END_TEST

/* remove() keeps its meaning after an end: what is queued is dropped. */
START_TEST(test_end_then_remove_drops)
{
	dlpc_client *c = connect_or_die(&D);
	uint64_t zero = 0;

	ck_assert_dlpc(dlpc_channel_open(c, "rm", 4, NULL), 1);
	ck_assert_dlpc(send_value(c, "rm", 1, 1, 0, -1), 0);
	ck_assert_dlpc(send_value(c, "rm", 2, 1, 0, -1), 0);
	ck_assert_dlpc(dlpc_channel_close(c, "rm"), 0);
	ck_assert_uint_eq(stat_or_die(c).messages, 2);
	ck_assert_dlpc(dlpc_channel_remove(c, "rm"), 0);
	ck_assert_uint_eq(stat_or_die(c).messages, 0);
	ck_assert(wait_stat(c, storages_are, &zero, scaled_ms(5000)));
	dlpc_close(c);
}
END_TEST

/* A producer's record is charged to its uid's --max-memory-per-uid, and given back with the
 * channel. */
START_TEST(test_end_memory_charged)
{
	static const char *const args[] = {"--max-memory-per-uid=20000", NULL};
	struct daemon_opts dopts = {.args = args};
	struct daemon q;
	dlpc_client *c;
	char name[32], other[32];
	int n = 0, closed = 0, r;

	daemon_start_with(&q, &dopts);
	c = connect_or_die(&q);
	/* channels until the uid's memory is full, then closes until that is too */
	for (;; n++) {
		snprintf(name, sizeof(name), "m/%03d", n);
		if ((r = dlpc_channel_open(c, name, 1, NULL)) < 0)
			break;
	}
	ck_assert_dlpc(r, -EDQUOT);
	ck_assert_int_gt(n, 10);
	for (; closed < n; closed++) {
		snprintf(name, sizeof(name), "m/%03d", closed);
		if ((r = dlpc_channel_close(c, name)) < 0)
			break;
	}
	ck_assert_dlpc(r, -EDQUOT);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "--max-memory-per-uid"));
	ck_assert_int_lt(closed, n);
	/* a channel removed gives back its record and itself: the close fits now */
	snprintf(other, sizeof(other), "m/%03d", closed == n - 1 ? 0 : n - 1);
	ck_assert_dlpc(dlpc_channel_remove(c, other), 0);
	ck_assert_dlpc(dlpc_channel_close(c, name), 0);
	dlpc_close(c);
	daemon_stop(&q);
}
END_TEST

/* DLPC_PRODUCING_MAX and DLPC_CHANNEL_PRODUCERS_MAX. */
START_TEST(test_end_limits)
{
	static const char *const args[] = {"--max-channels-per-uid=2000", NULL};
	struct daemon_opts dopts = {.args = args};
	struct daemon q;
	dlpc_client *c;
	dlpc_channel_opts o = {.size = sizeof(o), .producers = DLPC_CHANNEL_PRODUCERS_MAX + 1};
	char name[32];

	daemon_start_with(&q, &dopts);
	c = connect_or_die(&q);
	ck_assert_dlpc(dlpc_channel_open_opts(c, "lim", &o, NULL), -EINVAL);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "DLPC_CHANNEL_PRODUCERS_MAX"));
	o.producers = DLPC_CHANNEL_PRODUCERS_MAX;
	ck_assert_dlpc(dlpc_channel_open_opts(c, "lim", &o, NULL), 1);
	o.producers = 3;
	ck_assert_dlpc(dlpc_channel_open_opts(c, "lim", &o, NULL), -EEXIST);
	ck_assert_dlpc(dlpc_channel_remove(c, "lim"), 0);
	for (int i = 0; i <= DLPC_PRODUCING_MAX; i++) {
		snprintf(name, sizeof(name), "p/%d", i);
		ck_assert_dlpc(dlpc_channel_open(c, name, 1, NULL), 1);
		ck_assert_dlpc(dlpc_channel_close(c, name), i < DLPC_PRODUCING_MAX ? 0 : -EDQUOT);
	}
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "DLPC_PRODUCING_MAX"));
	/* removing one lets go of its record */
	ck_assert_dlpc(dlpc_channel_remove(c, "p/0"), 0);
	ck_assert_dlpc(dlpc_channel_close(c, name), 0);
	dlpc_close(c);
	daemon_stop(&q);
}
END_TEST

/* The warnings in the daemon log @p log, printed; one a daemon under valgrind gives at start
 * (it cannot run closer processes there) does not count. */
static int warnings(const char *log)
{
	FILE *f = fopen(log, "r");
	char line[2048];
	int n = 0;

	ck_assert_ptr_nonnull(f);
	while (fgets(line, sizeof(line), f))
		if (strstr(line, ": warning: ") &&
		    !strstr(line, "cannot set up closer processes")) {
			fprintf(stderr, "%s", line);
			n++;
		}
	fclose(f);
	return n;
}

/* An ordinary session on both kinds of channel leaves no warning in the daemon's log: every
 * client asks the daemon the kind of each channel it uses (CHANNEL JOIN), which a queued one
 * once answered with a refusal logged as a warning. */
START_TEST(test_ordinary_session_quiet)
{
	dlpc_client *c = connect_or_die(&D), *r = connect_or_die(&D);
	int64_t v;

	ck_assert_dlpc(dlpc_channel_open(c, "quiet", 0, NULL), 1);
	ck_assert_dlpc(dlpc_channel_open(r, "quiet", 0, NULL), 0);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "quiet/d", 0, DLPC_CHANNEL_DIRECT, NULL), 1);
	ck_assert_dlpc(dlpc_channel_open(r, "quiet/d", 0, NULL), 0);
	for (int k = 0; k < 3; k++) {
		ck_assert_dlpc(send_value(c, "quiet", k, 1, 0, -1), 0);
		ck_assert_dlpc(recv_value(r, "quiet", -1, &v, NULL, NULL), 0);
		ck_assert_dlpc(send_value(c, "quiet/d", k, 1, 0, -1), 0);
		ck_assert_dlpc(recv_value(r, "quiet/d", -1, &v, NULL, NULL), 0);
	}
	ck_assert_dlpc(dlpc_channel_close(c, "quiet"), 0);
	ck_assert_dlpc(dlpc_channel_close(c, "quiet/d"), 0);
	ck_assert_dlpc(recv_value(r, "quiet", -1, &v, NULL, NULL), -EPIPE);
	ck_assert_dlpc(recv_value(r, "quiet/d", -1, &v, NULL, NULL), -EPIPE);
	ck_assert_dlpc(dlpc_channel_remove(c, "quiet"), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "quiet/d"), 0);
	dlpc_close(r);
	dlpc_close(c);
	/* (the log is written before each reply: everything is in it by now) */
	ck_assert_msg(warnings(D.log) == 0,
		      "the daemon logged a warning in an ordinary session (%s)", D.log);
	ck_assert(log_has(D.log, ": debug: "));
}
END_TEST

/* ---- bundles, limits, LIST, STAT, WATCH ---- */

/* ---- a bundle's keys: a SEND refuses what a PUBLISH refuses, in the same words ---- */

#define KEYS_HEAD "cannot publish 'keys': "

/* In another process: each bad key refused by dlpc_send_bundle() as dlpc_publish_bundle()
 * refuses it, the message the same but its head, every tensor released; then a bundle whose
 * key is exactly DLPC_KEY_MAX bytes sent. */
static int bad_key_sender(void *arg)
{
	static char toolong[DLPC_KEY_MAX + 2], longest[DLPC_KEY_MAX + 1];
	const char *const bad[] = {toolong, "\xc0\x80", "a\xff"};
	dlpc_client *c = child_connect();
	static float v[2] = {1, 2};
	int64_t n = 2;
	DLManagedTensorVersioned *ts[2];

	(void)arg;
	memset(toolong, 'k', DLPC_KEY_MAX + 1);
	memset(longest, 'k', DLPC_KEY_MAX);
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		const char *keys[] = {"ok", bad[i]};
		char pub[1024], want[1100];
		int dead = 0;

		for (int j = 0; j < 2; j++)
			ts[j] = host_tensor(v, (DLDataType){kDLFloat, 32, 1}, 1, &n, NULL, &dead);
		CHILD_CHECK(dlpc_publish_bundle(c, "keys", 2, keys, ts, 0) == -EINVAL);
		snprintf(pub, sizeof(pub), "%s", dlpc_last_error());
		CHILD_CHECK(strncmp(pub, KEYS_HEAD, strlen(KEYS_HEAD)) == 0);
		CHILD_CHECK(strstr(pub, "the key of tensor 1: key is"));
		snprintf(want, sizeof(want), "cannot send to channel 'keys': %s",
			 pub + strlen(KEYS_HEAD));
		for (int j = 0; j < 2; j++)
			ts[j] = host_tensor(v, (DLDataType){kDLFloat, 32, 1}, 1, &n, NULL, &dead);
		CHILD_CHECK(dlpc_send_bundle(c, "keys", 2, keys, ts, NULL) == -EINVAL);
		if (strcmp(dlpc_last_error(), want) != 0) {
			fprintf(stderr, "send says '%s'\npublish said '%s'\n", dlpc_last_error(),
				pub);
			return 1;
		}
		CHILD_CHECK(dead == 4);
	}
	{
		const char *keys[] = {longest, ""};

		for (int j = 0; j < 2; j++)
			ts[j] = host_tensor(v, (DLDataType){kDLFloat, 32, 1}, 1, &n, NULL, NULL);
		CHILD_CHECK(dlpc_send_bundle(c, "keys", 2, keys, ts, NULL) == 0);
	}
	dlpc_close(c);
	return 0;
}

START_TEST(test_bundle_keys)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	char longest[DLPC_KEY_MAX + 1];
	dlpc_channel_info info;
	dlpc_stats st;
	dlpc_bundle *b;

	memset(longest, 'k', DLPC_KEY_MAX);
	longest[DLPC_KEY_MAX] = '\0';
	ck_assert_dlpc(dlpc_channel_open(c, "keys", 4, NULL), 1);
	ck_assert_int_eq(wait_child(spawn(bad_key_sender, NULL)), 0);
	/* only the last message went out, and nothing was published */
	info = chan_or_die(c, "keys");
	ck_assert_uint_eq(info.sent, 1);
	ck_assert_dlpc(dlpc_recv_bundle(c, "keys", &now, &b), 0);
	ck_assert_uint_eq(dlpc_bundle_count(b), 2);
	ck_assert_str_eq(dlpc_bundle_key(b, 0), longest);
	ck_assert_str_eq(dlpc_bundle_key(b, 1), "");
	dlpc_bundle_free(b);
	st = stat_or_die(c);
	ck_assert_uint_eq(st.entries, 0);
	ck_assert_uint_eq(st.protocol_errors, 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "keys"), 0);
	dlpc_close(c);
}
END_TEST

START_TEST(test_list_stat_watch)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_channel_info *v;
	dlpc_watch_event ev;
	dlpc_watch *w;
	size_t n;
	int err;

	w = dlpc_watch_open(D.sock, "l/", &err);
	ck_assert_ptr_nonnull(w);
	ck_assert_dlpc(dlpc_channel_open(c, "l/b", 0, NULL), 1);
	ck_assert_dlpc(dlpc_channel_open(c, "l/a", 2, NULL), 1);
	ck_assert_dlpc(dlpc_channel_open(c, "m/c", 0, NULL), 1);
	ck_assert_dlpc(send_value(c, "l/a", 1, 100, 0, -1), 0);
	ck_assert_dlpc(dlpc_channel_list(c, "l/", &v, &n), 0);
	ck_assert_uint_eq(n, 2);
	ck_assert_str_eq(v[0].name, "l/a");
	ck_assert_uint_eq(v[0].capacity, 2);
	ck_assert_uint_eq(v[0].depth, 1);
	ck_assert_uint_eq(v[0].bytes_queued, 800);
	ck_assert_int_eq(v[0].owner_pid, getpid());
	ck_assert_str_eq(v[1].name, "l/b");
	free(v);
	ck_assert_dlpc(dlpc_channel_list(c, NULL, &v, &n), 0);
	ck_assert_uint_eq(n, 3);
	free(v);
	ck_assert_uint_eq(stat_or_die(c).channels, 3);
	ck_assert_uint_eq(stat_or_die(c).uid_channels, 3);
	/* a channel counts as an entry of its uid */
	ck_assert_uint_eq(stat_or_die(c).uid_entries, 3);
	ck_assert_dlpc(dlpc_channel_remove(c, "l/a"), 0);
	ck_assert_dlpc(dlpc_watch_next(w, &ev, scaled_ms(5000)), 1);
	ck_assert_uint_eq(ev.kind, DLPC_WATCH_CHANNEL_OPENED);
	ck_assert_str_eq(ev.entry.name, "l/b");
	ck_assert_dlpc(dlpc_watch_next(w, &ev, scaled_ms(5000)), 1);
	ck_assert_uint_eq(ev.kind, DLPC_WATCH_CHANNEL_OPENED);
	ck_assert_str_eq(ev.entry.name, "l/a");
	ck_assert_dlpc(dlpc_watch_next(w, &ev, scaled_ms(5000)), 1);
	ck_assert_uint_eq(ev.kind, DLPC_WATCH_CHANNEL_REMOVED);
	ck_assert_str_eq(ev.entry.name, "l/a");
	ck_assert_uint_eq(ev.reason, DLPC_WATCH_BY_REQUEST);
	ck_assert_int_eq(ev.actor_pid, getpid());
	dlpc_watch_close(w);
	dlpc_close(c);
}
END_TEST

/* A uid at --max-entries-per-uid opens no channel; a message over --max-bytes-per-uid is
 * refused, naming the channel. */
START_TEST(test_quota)
{
	static const char *const args[] = {"--max-entries-per-uid=2", "--max-bytes-per-uid=65536",
					   NULL};
	struct daemon_opts o = {.args = args};
	struct daemon q;
	dlpc_client *c;

	daemon_start_with(&q, &o);
	c = connect_or_die(&q);
	ck_assert_dlpc(dlpc_channel_open(c, "q1", 0, NULL), 1);
	ck_assert_dlpc(dlpc_channel_open(c, "q2", 0, NULL), 1);
	ck_assert_dlpc(dlpc_channel_open(c, "q3", 0, NULL), -EDQUOT);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "--max-entries-per-uid"));
	ck_assert_dlpc(send_value(c, "q1", 1, 4096, 0, -1), 0);
	ck_assert_dlpc(send_value(c, "q1", 1, 8192, 0, -1), -EDQUOT);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "channel 'q1'"));
	ck_assert_uint_eq(stat_or_die(c).storages, 1);
	dlpc_close(c);
	daemon_stop(&q);
}
END_TEST

/* ---- recycled buffers: the storage a receiver released comes back to its sender ---- */

START_TEST(test_pool_recycles)
{
	dlpc_client *s = connect_or_die(&D), *r = connect_or_die(&D);
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	DLManagedTensorVersioned *t, *got, *held[DLPC_POOL_BUFFERS_MAX];
	int64_t shape = 1 << 14;
	DLDataType f32 = {kDLFloat, 32, 1};
	dlpc_attach_info ai = {.size = sizeof(ai)};
	uint64_t zero = 0;
	void *first = NULL;

	ck_assert_dlpc(dlpc_channel_open(s, "pool", 2, NULL), 1);
	for (int round = 0; round < 5; round++) {
		ck_assert_dlpc(dlpc_channel_alloc(s, "pool", f32, 1, &shape, &t), 0);
		/* after the first round, the same memory every time: nothing fresh */
		if (round == 0)
			first = t->dl_tensor.data;
		else
			ck_assert_ptr_eq(t->dl_tensor.data, first);
		ck_assert(!(t->flags & DLPACK_FLAG_BITMASK_READ_ONLY));
		((float *)t->dl_tensor.data)[shape - 1] = (float)round;
		ck_assert_dlpc(dlpc_send(s, "pool", t, 0), 0);
		ck_assert_dlpc(dlpc_recv(r, "pool", &now, &got), 0);
		ck_assert(((float *)got->dl_tensor.data)[shape - 1] == (float)round);
		ck_assert_dlpc(dlpc_tensor_attach_info(got, &ai), 0);
		ck_assert(ai.flags & DLPC_PUBLISH_WRITABLE);
		got->deleter(got);
		/* the release reaches the daemon with the receiver's next request */
		ck_assert_uint_eq(stat_or_die(r).messages, 0);
		ck_assert(wait_stat(s, storages_are, &zero, scaled_ms(5000)));
	}
	/* buffers a user holds are not handed out again; past the pool's size: ENOBUFS */
	for (int i = 0; i < DLPC_POOL_BUFFERS_MAX; i++)
		ck_assert_dlpc(dlpc_channel_alloc(s, "pool", f32, 1, &shape, &held[i]), 0);
	ck_assert_dlpc(dlpc_channel_alloc(s, "pool", f32, 1, &shape, &t), -ENOBUFS);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "DLPC_POOL_BUFFERS_MAX"));
	/* pooled memory goes only on the connection that allocated it */
	ck_assert_dlpc(dlpc_send(r, "pool", held[0], 0), -EINVAL);
	for (int i = 1; i < DLPC_POOL_BUFFERS_MAX; i++)
		held[i]->deleter(held[i]);
	ck_assert_dlpc(dlpc_channel_alloc(s, "pool", f32, 1, &shape, &t), 0);
	t->deleter(t);
	/* a channel removed with a pooled message queued gives the buffer back too */
	ck_assert_dlpc(dlpc_channel_alloc(s, "pool", f32, 1, &shape, &t), 0);
	first = t->dl_tensor.data;
	ck_assert_dlpc(dlpc_send(s, "pool", t, 0), 0);
	ck_assert_dlpc(dlpc_channel_remove(s, "pool"), 0);
	ck_assert(wait_stat(s, storages_are, &zero, scaled_ms(5000)));
	ck_assert_dlpc(dlpc_channel_alloc(s, "pool", f32, 1, &shape, &t), 0);
	ck_assert_ptr_eq(t->dl_tensor.data, first);
	t->deleter(t);
	dlpc_close(r);
	dlpc_close(s);
}
END_TEST

/* ---- recycled buffers: two threads of one client never get the same one ---- */

#define POOL_RACE_ROUNDS 100000

struct pool_racer {
	dlpc_client *c;
	_Atomic(void *) *held; /* [2]: what each racer holds at the moment */
	int me;
	long shared; /* rounds that found the other one's buffer */
	int err;
	char why[256];
};

static void *pool_racer(void *arg)
{
	struct pool_racer *pr = arg;
	DLDataType u8 = {kDLUInt, 8, 1};
	int64_t shape = 4096;

	for (int i = 0; i < POOL_RACE_ROUNDS; i++) {
		DLManagedTensorVersioned *t;
		void *data;

		if ((pr->err = dlpc_channel_alloc(pr->c, "race", u8, 1, &shape, &t)) < 0) {
			snprintf(pr->why, sizeof(pr->why), "%s", dlpc_last_error());
			break;
		}
		data = t->dl_tensor.data;
		atomic_store(&pr->held[pr->me], data);
		if (atomic_load(&pr->held[1 - pr->me]) == data)
			pr->shared++;
		atomic_store(&pr->held[pr->me], NULL);
		t->deleter(t);
	}
	return NULL;
}

START_TEST(test_pool_threads)
{
	dlpc_client *s = connect_or_die(&D);
	_Atomic(void *) held[2] = {NULL, NULL};
	struct pool_racer pr[2];
	pthread_t th[2];

	ck_assert_dlpc(dlpc_channel_open(s, "race", 2, NULL), 1);
	for (int i = 0; i < 2; i++) {
		pr[i] = (struct pool_racer){.c = s, .held = held, .me = i};
		ck_assert_int_eq(pthread_create(&th[i], NULL, pool_racer, &pr[i]), 0);
	}
	for (int i = 0; i < 2; i++) {
		ck_assert_int_eq(pthread_join(th[i], NULL), 0);
		ck_assert_msg(pr[i].err == 0, "racer %d: %s", i, pr[i].why);
		ck_assert_msg(pr[i].shared == 0, "racer %d was handed the other's buffer %ld times",
			      i, pr[i].shared);
	}
	dlpc_close(s);
}
END_TEST

/* ---- recycled buffers: what a receiver got, it cannot write ---- */

#define RO_ROUNDS 6
#define RO_EVIL 0xee

/* The attacker's pipes: it reports on ways[1], and writes whenever the test says so on go[0]
 * (and answers on done[1]). */
struct ro_pipes {
	int ways[2], go[2], done[2];
};

/* A raw RECV of "ro" (waiting up to 5 s): the storage fd the daemon hands out. */
static int raw_recv_storage(int fd)
{
	Dlpackd__V1__Recv rv = DLPACKD__V1__RECV__INIT;
	struct dlpc__hdr h;
	uint8_t buf[4096];
	int st = -1;

	rv.channel.data = (uint8_t *)"ro";
	rv.channel.len = 2;
	rv.timeout_ms = scaled_ms(5000);
	raw_send(fd, DLPC_MSG_RECV, 2, &rv.base, NULL, 0);
	CHILD_CHECK(raw_recv_fd(fd, &h, buf, sizeof(buf), &st) == 1);
	CHILD_CHECK(h.type == (DLPC_MSG_RECV | DLPC_MSG_REPLY) && st >= 0);
	return st;
}

/*
 * uid 65534 receives a pooled message of root's and tries every way to keep write access to
 * its buffer: a shared writable mapping, a read-only one made writable, write(), fallocate()
 * (a punched hole reads as zeros), ftruncate(), fchmod(), and a reopen of /proc/self/fd/N
 * read-write. It reports how many ways worked, lets go of the message (its connection closes),
 * and then writes RO_EVIL through whatever it kept each time the test says so.
 */
static int pool_attacker(void *arg)
{
	struct ro_pipes *pp = arg;
	int fd, st, rw = -1, ways = 0;
	uint8_t *maps[2] = {NULL, NULL}, *m;
	char path[64], go;
	struct stat sb;
	size_t len;

	close(pp->ways[0]);
	close(pp->go[1]);
	close(pp->done[0]);
	CHILD_CHECK(setgroups(0, NULL) == 0 && setgid(NOBODY) == 0 && setuid(NOBODY) == 0);
	CHILD_CHECK(prctl(PR_SET_DUMPABLE, 1) == 0); /* /proc/self/fd ours to open */
	fd = raw_connect(&D);
	raw_hello(fd, 1);
	st = raw_recv_storage(fd);
	CHILD_CHECK(fstat(st, &sb) == 0 && sb.st_size > 0);
	len = (size_t)sb.st_size;
	m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, st, 0);
	if (m != MAP_FAILED) {
		fprintf(stderr, "pool attacker: mapped the buffer shared and writable\n");
		maps[0] = m;
		ways++;
	}
	m = mmap(NULL, len, PROT_READ, MAP_SHARED, st, 0);
	CHILD_CHECK(m != MAP_FAILED);
	if (mprotect(m, len, PROT_READ | PROT_WRITE) == 0) {
		fprintf(stderr, "pool attacker: made a read-only shared mapping writable\n");
		maps[1] = m;
		ways++;
	} else {
		munmap(m, len);
	}
	if (pwrite(st, "x", 1, 0) == 1) {
		fprintf(stderr, "pool attacker: write() to the fd it received\n");
		ways++;
	}
	if (ftruncate(st, (off_t)len) == 0) {
		fprintf(stderr, "pool attacker: ftruncate() of the fd it received\n");
		ways++;
	}
	if (fallocate(st, FALLOC_FL_KEEP_SIZE, 0, (off_t)len) == 0) {
		fprintf(stderr, "pool attacker: fallocate() of the fd it received\n");
		ways++;
	}
	snprintf(path, sizeof(path), "/proc/self/fd/%d", st);
	rw = open(path, O_RDWR | O_CLOEXEC);
	if (rw < 0 && fchmod(st, 0666) == 0) {
		fprintf(stderr, "pool attacker: fchmod() of the fd it received\n");
		ways++;
		rw = open(path, O_RDWR | O_CLOEXEC);
	}
	if (rw >= 0) {
		fprintf(stderr, "pool attacker: reopened /proc/self/fd/N read-write\n");
		ways++;
	}
	/* the message goes back: its buffer returns to the sender's pool */
	close(fd);
	CHILD_CHECK(write(pp->ways[1], &ways, sizeof(ways)) == sizeof(ways));
	while (read(pp->go[0], &go, 1) == 1) {
		for (int i = 0; i < 2; i++)
			if (maps[i])
				memset(maps[i], RO_EVIL, len);
		if (rw >= 0) {
			memset(path, RO_EVIL, sizeof(path));
			for (size_t off = 0; off < len; off += sizeof(path))
				(void)!pwrite(rw, path, sizeof(path), (off_t)off);
		}
		(void)!fallocate(st, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)len);
		CHILD_CHECK(write(pp->done[1], &go, 1) == 1);
	}
	return 0;
}

/* Are all @p n bytes at @p p equal to @p v? */
static bool all_bytes(const uint8_t *p, size_t n, uint8_t v)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != v)
			return false;
	return true;
}

/* A recycled buffer published writable (dlpc_publish(), not a send) goes as the read-write
 * memfd a writable publish is: the read-only descriptor is its messages' only. */
START_TEST(test_pool_buffer_published_writable)
{
	dlpc_client *s = connect_or_die(&D), *r = connect_or_die(&D);
	DLManagedTensorVersioned *t, *got;
	int64_t shape = 4096;
	DLDataType u8 = {kDLUInt, 8, 1};

	ck_assert_dlpc(dlpc_channel_open(s, "pw", 2, NULL), 1);
	ck_assert_dlpc(dlpc_channel_alloc(s, "pw", u8, 1, &shape, &t), 0);
	memset(t->dl_tensor.data, 0x5a, (size_t)shape);
	ck_assert_dlpc(dlpc_publish(s, "pw/x", t, DLPC_PUBLISH_WRITABLE), 1);
	ck_assert_dlpc(dlpc_attach(r, "pw/x", NULL, &got), 1);
	ck_assert_uint_eq(((uint8_t *)got->dl_tensor.data)[shape - 1], 0x5a);
	got->deleter(got);
	dlpc_close(r);
	dlpc_close(s);
}
END_TEST

START_TEST(test_pool_read_only)
{
	dlpc_client *s = connect_or_die(&D), *r = connect_or_die(&D);
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = scaled_ms(5000)};
	DLManagedTensorVersioned *t, *got;
	int64_t shape = 1 << 16;
	DLDataType u8 = {kDLUInt, 8, 1};
	struct ro_pipes pp;
	int ways = -1, spoiled = 0;
	uint64_t zero = 0;
	void *first;
	char go = 'g';
	pid_t pid;

	/* the attacker, another uid, may connect */
	daemon_open_for_others(&D);
	ck_assert_int_eq(pipe(pp.ways), 0);
	ck_assert_int_eq(pipe(pp.go), 0);
	ck_assert_int_eq(pipe(pp.done), 0);
	ck_assert_dlpc(dlpc_channel_open(s, "ro", 2, NULL), 1);
	ck_assert_dlpc(dlpc_channel_alloc(s, "ro", u8, 1, &shape, &t), 0);
	first = t->dl_tensor.data;
	memset(first, 0x11, (size_t)shape);
	ck_assert_dlpc(dlpc_send(s, "ro", t, 0), 0);
	pid = spawn(pool_attacker, &pp);
	close(pp.ways[1]);
	close(pp.go[0]);
	close(pp.done[1]);
	ck_assert_int_eq(read(pp.ways[0], &ways, sizeof(ways)), sizeof(ways));
	/* its release is in: the buffer is back in the sender's pool */
	ck_assert(wait_stat(s, storages_are, &zero, scaled_ms(5000)));
	for (int i = 0; i < RO_ROUNDS; i++) {
		uint8_t v = (uint8_t)(0x20 + i);

		/* the same buffer each time, which the attacker received first. Its RECLAIM comes
		 * on the daemon's turn after the storage was freed: a buffer allocated before that
		 * goes back to the pool, a STAT reads what came meanwhile, and the next one is the
		 * first again */
		for (int tries = 0;; tries++) {
			ck_assert_dlpc(dlpc_channel_alloc(s, "ro", u8, 1, &shape, &t), 0);
			if (t->dl_tensor.data == first)
				break;
			t->deleter(t);
			ck_assert_msg(tries < 1000, "the first buffer never came back (round %d)",
				      i);
			stat_or_die(s);
			usleep(1000);
		}
		memset(t->dl_tensor.data, v, (size_t)shape);
		ck_assert_dlpc(dlpc_send(s, "ro", t, 0), 0);
		/* the attacker writes what it can, while the message waits in the channel */
		ck_assert_int_eq(write(pp.go[1], &go, 1), 1);
		ck_assert_int_eq(read(pp.done[0], &go, 1), 1);
		ck_assert_dlpc(dlpc_recv(r, "ro", &now, &got), 0);
		spoiled += !all_bytes(got->dl_tensor.data, (size_t)shape, v);
		got->deleter(got);
		ck_assert_uint_eq(stat_or_die(r).messages, 0);
		ck_assert(wait_stat(s, storages_are, &zero, scaled_ms(5000)));
	}
	close(pp.go[1]);
	ck_assert_int_eq(wait_child(pid), 0);
	close(pp.ways[0]);
	close(pp.done[0]);
	ck_assert_msg(spoiled == 0, "%d of %d later messages carried the attacker's bytes", spoiled,
		      RO_ROUNDS);
	ck_assert_msg(ways == 0, "uid %d kept %d ways to write a buffer it received", NOBODY, ways);
	dlpc_close(r);
	dlpc_close(s);
}
END_TEST

/* ---- malformed channel requests, from a raw client ---- */

static void named(Dlpackd__V1__Send *r)
{
	r->message->name.data = (uint8_t *)"x";
	r->message->name.len = 1;
}

static void pooled_read_only(Dlpackd__V1__Send *r)
{
	r->pool_token = 7;
}

static void pooled_writable(Dlpackd__V1__Send *r)
{
	r->pool_token = 7;
	r->message->flags = DLPC_PUBLISH_WRITABLE;
}

static void cuda(Dlpackd__V1__Send *r)
{
	r->message->device_type = kDLCUDA;
}

static void no_message(Dlpackd__V1__Send *r)
{
	r->message = NULL;
}

static void flagged(Dlpackd__V1__Send *r)
{
	r->flags = 4;
}

static void bad_channel(Dlpackd__V1__Send *r)
{
	r->channel.len = 0;
}

START_TEST(test_malformed)
{
	static const struct {
		void (*edit)(Dlpackd__V1__Send *);
		int seals, code;
		const char *says;
	} cases[] = {
		{named, SEALS_RO, EINVAL, "no name"},
		{pooled_read_only, SEALS_RO, EINVAL, "WRITABLE"},
		{cuda, SEALS_RO, ENOTSUP, "host memory only"},
		{no_message, SEALS_RO, EINVAL, "no message"},
		{flagged, SEALS_RO, EINVAL, "flags"},
		{bad_channel, SEALS_RO, EINVAL, "channel name"},
		{NULL, 0, EPERM,
		 "'raw'"}, /* unsealed: refused like a PUBLISH, naming the channel */
	};
	Dlpackd__V1__Recv rv = DLPACKD__V1__RECV__INIT;
	Dlpackd__V1__Channel co = DLPACKD__V1__CHANNEL__INIT;
	char msg[512], path[64];
	int base, fd, st, ro, code;

	good_client_start(&D);
	base = good_baseline();
	ck_assert_dlpc(dlpc_channel_open(good_client(), "raw", 1, NULL), 1);
	fd = raw_connect(&D);
	raw_hello(fd, 1);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		st = memfd_sealed(4096, cases[i].seals);
		code = raw_send_msg(fd, "raw", st, 1, cases[i].edit, msg, sizeof(msg));
		close(st);
		if (cases[i].code == EPERM)
			ck_assert_msg(code != 0 && code != -1, "case %zu: %d", i, code);
		else
			ck_assert_msg(code == cases[i].code, "case %zu: %d %s", i, code, msg);
		ck_assert_msg(strstr(msg, cases[i].says), "case %zu: %s", i, msg);
	}
	/* a pooled message (writable by its sender) whose fd a receiver could write through:
	 * read-write, or read-only of a memfd it could reopen read-write */
	st = memfd_sealed(4096, SEALS_RO & ~F_SEAL_WRITE);
	ck_assert_int_eq(raw_send_msg(fd, "raw", st, 1, pooled_writable, msg, sizeof(msg)), EPERM);
	ck_assert_msg(strstr(msg, "O_RDONLY"), "%s", msg);
	snprintf(path, sizeof(path), "/proc/self/fd/%d", st);
	ro = open(path, O_RDONLY | O_CLOEXEC);
	ck_assert_int_ge(ro, 0);
	ck_assert_int_eq(raw_send_msg(fd, "raw", ro, 1, pooled_writable, msg, sizeof(msg)), EPERM);
	ck_assert_msg(strstr(msg, "write permission (mode 0"), "%s", msg);
	close(ro);
	close(st);
	/* refused, every one: nothing was queued */
	ck_assert_uint_eq(stat_or_die(good_client()).messages, 0);
	/* admitted once, then full: EAGAIN at once for timeout 0 */
	st = memfd_sealed(4096, SEALS_RO);
	ck_assert_int_eq(raw_send_msg(fd, "raw", st, 1, NULL, msg, sizeof(msg)), 0);
	ck_assert_int_eq(raw_send_msg(fd, "raw", st, 1, NULL, msg, sizeof(msg)), EAGAIN);
	close(st);
	rv.channel.data = (uint8_t *)"raw";
	rv.channel.len = 3;
	rv.flags = 1;
	raw_send(fd, DLPC_MSG_RECV, 6, &rv.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EINVAL);
	co.op = 9;
	co.name.data = (uint8_t *)"raw";
	co.name.len = 3;
	raw_send(fd, DLPC_MSG_CHANNEL, 7, &co.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EINVAL);
	/* a SEND without its fd, or with two: a protocol violation, the connection dropped */
	st = memfd_sealed(4096, SEALS_RO);
	ck_assert_int_eq(raw_send_msg(fd, "raw", st, 0, NULL, msg, sizeof(msg)), EPROTO);
	expect_dropped(fd);
	fd = raw_connect(&D);
	raw_hello(fd, 1);
	ck_assert_int_eq(raw_send_msg(fd, "raw", st, 2, NULL, msg, sizeof(msg)), EPROTO);
	expect_dropped(fd);
	close(st);
	good_client_check();
	ck_assert_dlpc(dlpc_channel_remove(good_client(), "raw"), 0);
	expect_fds(base);
	good_client_stop();
}
END_TEST

/* ---- a raw client's bad keys: SEND refused as PUBLISH is, by the daemon's one check ---- */

static ProtobufCBinaryData raw_key;

static void keyed(Dlpackd__V1__Send *r)
{
	r->message->tensors[0]->key = raw_key;
}

/* A PUBLISH of "raw" with the message raw_send_msg() sends, keyed raw_key; the daemon's
 * error code (0: published) and message. */
static int raw_publish_keyed(int fd, int storage, char *msg, size_t len)
{
	Dlpackd__V1__Publish pub = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc d = DLPACKD__V1__TENSOR_DESC__INIT, *dp = &d;
	int64_t one = 1;
	struct dlpc__hdr h;
	uint8_t buf[4096];
	int code = 0;

	d.key = raw_key;
	d.dtype_code = kDLFloat;
	d.dtype_bits = 32;
	d.dtype_lanes = 1;
	d.n_shape = 1;
	d.shape = &one;
	pub.name.data = (uint8_t *)"raw";
	pub.name.len = 3;
	pub.device_type = kDLCPU;
	pub.storage_size = 4096;
	pub.n_tensors = 1;
	pub.tensors = &dp;
	raw_send(fd, DLPC_MSG_PUBLISH, 8, &pub.base, &storage, 1);
	ck_assert_int_eq(raw_recv(fd, &h, buf, sizeof(buf)), 1);
	if (h.type == DLPC_MSG_ERROR)
		code = error_code(buf, h.len, msg, len);
	else
		ck_assert_uint_eq(h.type, DLPC_MSG_PUBLISH | DLPC_MSG_REPLY);
	return code;
}

START_TEST(test_raw_keys)
{
	static char toolong[DLPC_KEY_MAX + 1];
	static const struct {
		const char *key;
		size_t len;
		const char *says;
	} cases[] = {
		{"a\0b", 3, "contains NUL"},
		{toolong, DLPC_KEY_MAX + 1, "more than the limit"},
		{"\xc0\x80", 2, "not valid UTF-8"},
	};
	char pub[512], snd[512];
	dlpc_stats st;
	int base, fd;

	memset(toolong, 'k', sizeof(toolong));
	good_client_start(&D);
	base = good_baseline();
	ck_assert_dlpc(dlpc_channel_open(good_client(), "raw", 1, NULL), 1);
	fd = raw_connect(&D);
	raw_hello(fd, 1);
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		int mem = memfd_sealed(4096, SEALS_RO);

		raw_key.data = (uint8_t *)cases[i].key;
		raw_key.len = cases[i].len;
		ck_assert_int_eq(raw_publish_keyed(fd, mem, pub, sizeof(pub)), EINVAL);
		ck_assert_int_eq(raw_send_msg(fd, "raw", mem, 1, keyed, snd, sizeof(snd)), EINVAL);
		close(mem);
		ck_assert_msg(strncmp(pub, "cannot publish 'raw': ", 22) == 0, "%s", pub);
		ck_assert_msg(strncmp(snd, "cannot send to channel 'raw': ", 30) == 0, "%s", snd);
		ck_assert_str_eq(snd + 30, pub + 22);
		ck_assert_msg(strstr(snd, cases[i].says), "case %zu: %s", i, snd);
	}
	/* refused as bad requests, not as violations: the same connection sends a good one */
	raw_key.data = (uint8_t *)toolong;
	raw_key.len = DLPC_KEY_MAX;
	{
		int mem = memfd_sealed(4096, SEALS_RO);

		ck_assert_int_eq(raw_send_msg(fd, "raw", mem, 1, keyed, snd, sizeof(snd)), 0);
		close(mem);
	}
	st = stat_or_die(good_client());
	ck_assert_uint_eq(st.messages, 1);
	ck_assert_uint_eq(st.protocol_errors, 0);
	close(fd);
	good_client_check();
	ck_assert_dlpc(dlpc_channel_remove(good_client(), "raw"), 0);
	expect_fds(base);
	good_client_stop();
}
END_TEST

/* --max-pending-per-connection counts waiting RECVs and SENDs; --max-refs-per-connection
 * refuses a RECV, leaving the message queued. */
START_TEST(test_connection_limits)
{
	static const char *const args[] = {"--max-pending-per-connection=2",
					   "--max-refs-per-connection=1", NULL};
	struct daemon_opts o = {.args = args};
	Dlpackd__V1__Recv rv = DLPACKD__V1__RECV__INIT;
	struct daemon q;
	dlpc_client *c;
	DLManagedTensorVersioned *held, *t;
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	char msg[512];
	int fd;

	daemon_start_with(&q, &o);
	c = connect_or_die(&q);
	ck_assert_dlpc(dlpc_channel_open(c, "lim", 1, NULL), 1);
	fd = raw_connect(&q);
	raw_hello(fd, 1);
	rv.channel.data = (uint8_t *)"lim";
	rv.channel.len = 3;
	rv.timeout_ms = -1;
	raw_send(fd, DLPC_MSG_RECV, 1, &rv.base, NULL, 0);
	raw_send(fd, DLPC_MSG_RECV, 2, &rv.base, NULL, 0);
	raw_send(fd, DLPC_MSG_RECV, 3, &rv.base, NULL, 0);
	ck_assert_int_eq(raw_error(fd, msg, sizeof(msg)), EDQUOT);
	ck_assert_ptr_nonnull(strstr(msg, "--max-pending-per-connection"));
	ck_assert_ptr_nonnull(strstr(msg, "'lim'"));
	ck_assert_uint_eq(chan_or_die(c, "lim").receivers_waiting, 2);
	close(fd);
	ck_assert(WAIT_CHAN(c, "lim", receivers_waiting, 0));
	ck_assert_dlpc(send_value(c, "lim", 1, 1, 0, -1), 0);
	ck_assert_dlpc(dlpc_recv(c, "lim", &now, &held), 0);
	ck_assert_dlpc(send_value(c, "lim", 2, 1, 0, -1), 0);
	ck_assert_dlpc(dlpc_recv(c, "lim", &now, &t), -EDQUOT);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "--max-refs-per-connection"));
	ck_assert_uint_eq(chan_or_die(c, "lim").depth, 1);
	held->deleter(held);
	ck_assert_dlpc(dlpc_recv(c, "lim", &now, &t), 0);
	ck_assert_int_eq(*(int64_t *)t->dl_tensor.data, 2);
	t->deleter(t);
	dlpc_close(c);
	daemon_stop(&q);
}
END_TEST

int main(void)
{
	TCase *tc, *plain;
	Suite *s = channel_suite("channel", QUEUED, &tc, &plain);

	tcase_add_test(tc, test_backpressure_queue);
	tcase_add_test(tc, test_end_other_uid_bare_close);
	tcase_add_test(tc, test_end_then_remove_drops);
	tcase_add_test(tc, test_ordinary_session_quiet);
	tcase_add_test(tc, test_bundle_keys);
	tcase_add_test(tc, test_list_stat_watch);
	tcase_add_test(tc, test_pool_recycles);
	tcase_add_test(tc, test_pool_threads);
	tcase_add_test(tc, test_pool_read_only);
	tcase_add_test(tc, test_pool_buffer_published_writable);
	tcase_add_test(tc, test_malformed);
	tcase_add_test(tc, test_raw_keys);
	tcase_add_test(plain, test_quota);
	tcase_add_test(plain, test_end_limits);
	tcase_add_test(plain, test_end_memory_charged);
	tcase_add_test(plain, test_connection_limits);
	return run_suite(s);
}
