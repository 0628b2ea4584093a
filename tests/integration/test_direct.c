/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Direct channels (protocol 1.8) against a real dlpackd, driven from separate processes: the
 * tests both kinds of channel share (channel_kinds.c), run for a direct channel, and what only
 * a direct channel has: the two kinds kept apart (and PRODUCE refused on a queued one), its
 * limits (a record's size, no recycled buffers), a hostile sender writing into the channel's
 * socket, a forked child, the endpoints a client remembers, and threads joining at once.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>

#include "direct.h"
#include "channel_kinds.h"
#include "limits.h"
#include "raw.h"
#include "table.h"

static int open_direct(dlpc_client *c, const char *name, uint32_t cap, dlpc_channel_info *info)
{
	return dlpc_channel_open_flags(c, name, cap, DLPC_CHANNEL_DIRECT, info);
}

/* Does this process come to hold @p want fds within a few seconds? A receiver closes what it
 * refuses on libdlpc's thread, not on its own. */
static bool own_fds_become(int want)
{
	for (int waited = 0; fd_count(getpid()) != want; waited += 2) {
		if (waited > scaled_ms(5000))
			return false;
		usleep(2000);
	}
	return true;
}

/* ---- the two kinds kept apart, and what a direct channel refuses ---- */

/* PRODUCE is for a direct channel, whose messages the daemon never sees: on a queued one
 * (whose producers are the connections that send to it) it is refused, and makes no producer
 * that would hold the stream open, unseen, until its connection ends. */
START_TEST(test_produce_on_queued_refused)
{
	Dlpackd__V1__Channel co = DLPACKD__V1__CHANNEL__INIT;
	dlpc_client *c = connect_or_die(&D);
	struct dlpc__hdr h;
	uint8_t buf[4096];
	char msg[256] = "";
	int fd = raw_connect(&D), fds[4];

	raw_hello(fd, DLPC_PROTO_MAJOR);
	ck_assert_dlpc(dlpc_channel_open(c, "d/pq", 0, NULL), 1);
	co.op = 6;
	co.name.data = (uint8_t *)"d/pq";
	co.name.len = 4;
	raw_send(fd, DLPC_MSG_CHANNEL, 9, &co.base, NULL, 0);
	ck_assert_uint_eq(raw_recv_all(fd, &h, buf, sizeof(buf), fds), 0);
	ck_assert_uint_eq(h.type, DLPC_MSG_ERROR);
	ck_assert_int_eq(error_code(buf, h.len, msg, sizeof(msg)), EPROTOTYPE);
	ck_assert_ptr_nonnull(strstr(msg, "'d/pq'"));
	ck_assert_uint_eq(chan_or_die(c, "d/pq").producers, 0);
	close(fd);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/pq"), 0);
	dlpc_close(c);
}
END_TEST

START_TEST(test_kinds)
{
	dlpc_client *c = connect_or_die(&D);
	Dlpackd__V1__Recv rv = DLPACKD__V1__RECV__INIT;
	dlpc_channel_info info = {.size = sizeof(info)};
	static char keys[64][32];
	const char *kp[64];
	static float vals[64];
	DLManagedTensorVersioned *ts[64], *t;
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	dlpc_bundle *b;
	int64_t one = 1, shape[1] = {4};
	char msg[512];
	int raw, st, ends[2], fds0;

	ck_assert_dlpc(open_direct(c, "d/k", 8, &info), 1);
	ck_assert_dlpc(dlpc_channel_open(c, "q/k", 8, NULL), 1);
	/* the other kind asked for: EEXIST naming the kind, both ways */
	ck_assert_dlpc(dlpc_channel_open_flags(c, "d/k", 0, DLPC_CHANNEL_QUEUED, NULL), -EEXIST);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "as a direct channel"));
	ck_assert_dlpc(open_direct(c, "q/k", 0, NULL), -EEXIST);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "as a queued channel"));
	/* no kind asked for: either is opened as it is (1.10) */
	ck_assert_dlpc(dlpc_channel_open(c, "d/k", 0, &info), 0);
	ck_assert_uint_eq(info.flags, DLPC_CHANNEL_DIRECT);
	ck_assert_dlpc(dlpc_channel_open(c, "q/k", 0, &info), 0);
	ck_assert_uint_eq(info.flags, 0);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "q/k", 0, DLPC_CHANNEL_QUEUED, NULL), 0);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "d/x", 0, 2, NULL), -EINVAL);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "d/x", 0,
					       DLPC_CHANNEL_QUEUED | DLPC_CHANNEL_DIRECT, NULL),
		       -EINVAL);
	/* raw SEND and RECV of a direct channel, JOIN of a queued or unknown one */
	raw = raw_connect(&D);
	raw_hello(raw, DLPC_PROTO_MAJOR);
	st = memfd_sealed(4096, SEALS_RO);
	ck_assert_int_eq(raw_send_msg(raw, "d/k", st, 1, NULL, msg, sizeof(msg)), EPROTOTYPE);
	ck_assert_ptr_nonnull(strstr(msg, "direct"));
	close(st);
	rv.channel.data = (uint8_t *)"d/k";
	rv.channel.len = 3;
	raw_send(raw, DLPC_MSG_RECV, 6, &rv.base, NULL, 0);
	ck_assert_int_eq(raw_error(raw, msg, sizeof(msg)), EPROTOTYPE);
	/* a JOIN of a queued channel is answered without fds, not refused */
	ck_assert_int_eq(raw_join(raw, "q/k", ends, msg, sizeof(msg)), -1);
	ck_assert_int_eq(raw_join(raw, "d/none", ends, msg, sizeof(msg)), ENOENT);
	ck_assert_int_eq(raw_join(raw, "d/k", ends, msg, sizeof(msg)), 0);
	close(ends[0]);
	close(ends[1]);
	close(raw);

	/* no recycled buffers */
	ck_assert_dlpc(dlpc_channel_alloc(c, "d/k", (DLDataType){kDLFloat, 32, 1}, 1, shape, &t),
		       -ENOTSUP);

	/* a bundle of many long keys: over the record */
	for (int i = 0; i < 64; i++) {
		snprintf(keys[i], sizeof(keys[i]), "a-rather-long-key-number-%02d", i);
		kp[i] = keys[i];
		vals[i] = (float)i;
		ts[i] = host_tensor(&vals[i], (DLDataType){kDLFloat, 32, 1}, 1, &one, NULL, NULL);
	}
	ck_assert_dlpc(dlpc_send_bundle(c, "d/k", 64, kp, ts, NULL), -EMSGSIZE);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "'d/k'"));
	ck_assert_uint_eq(chan_or_die(c, "d/k").depth, 0);
	/* a few fit */
	for (int i = 0; i < 8; i++)
		ts[i] = host_tensor(&vals[i], (DLDataType){kDLFloat, 32, 1}, 1, &one, NULL, NULL);
	ck_assert_dlpc(dlpc_send_bundle(c, "d/k", 8, kp, ts, NULL), 0);
	ck_assert_dlpc(send_value(c, "d/k", 5, 2, 0, -1), 0);

	/* STAT: the kind, and the depth in messages */
	info = chan_or_die(c, "d/k");
	ck_assert_uint_eq(info.flags, DLPC_CHANNEL_DIRECT);
	ck_assert_uint_eq(info.depth, 2);
	ck_assert_uint_eq(info.bytes_queued, 0);
	ck_assert_uint_eq(info.sent, 0);
	ck_assert_uint_eq(chan_or_die(c, "q/k").flags, 0);

	ck_assert_dlpc(dlpc_recv_bundle(c, "d/k", &now, &b), 0);
	ck_assert_uint_eq(dlpc_bundle_count(b), 8);
	ck_assert_str_eq(dlpc_bundle_key(b, 7), keys[7]);
	t = dlpc_bundle_take(b, 7);
	ck_assert_float_eq(*(const float *)t->dl_tensor.data, 7.0f);
	t->deleter(t);
	dlpc_bundle_free(b);
	ck_assert_uint_eq(chan_or_die(c, "d/k").depth, 1);
	ck_assert_dlpc(dlpc_recv_bundle(c, "d/k", &now, &b), 0);
	ck_assert_uint_eq(dlpc_bundle_count(b), 1);
	dlpc_bundle_free(b);
	ck_assert_uint_eq(chan_or_die(c, "d/k").depth, 0);
	fds0 = settled_fds(&D, c, 1);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/k"), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "q/k"), 0);
	/* a direct channel's two ends went with it */
	ck_assert_int_eq(settled_fds(&D, c, 1), fds0 - 2);
	dlpc_close(c);
}
END_TEST

/* A channel removed and made again under the same name, direct or queued: a client that had
 * joined the old one finds the new one. */
START_TEST(test_made_again)
{
	dlpc_client *c = connect_or_die(&D), *r = connect_or_die(&D);
	dlpc_attach_info ai = {.size = sizeof(ai)};
	DLManagedTensorVersioned *t;
	int64_t v;

	ck_assert_dlpc(open_direct(c, "d/again", 4, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/again", 1, 2, 0, -1), 0);
	ck_assert_dlpc(recv_value(r, "d/again", 0, &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 1);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/again"), 0);
	ck_assert_dlpc(open_direct(c, "d/again", 4, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/again", 2, 2, 0, -1), 0);
	ck_assert_dlpc(recv_value(r, "d/again", scaled_ms(5000), &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 2);
	/* made again queued: through dlpackd now */
	ck_assert_dlpc(dlpc_channel_remove(c, "d/again"), 0);
	ck_assert_dlpc(dlpc_channel_open(c, "d/again", 4, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/again", 3, 2, 0, -1), 0);
	ck_assert_uint_eq(chan_or_die(c, "d/again").sent, 1);
	ck_assert_dlpc(dlpc_recv(r, "d/again", NULL, &t), 0);
	ck_assert_int_eq(*(const int64_t *)t->dl_tensor.data, 3);
	ck_assert_dlpc(dlpc_tensor_attach_info(t, &ai), 0);
	ck_assert_int_eq(ai.owner_pid, getpid());
	t->deleter(t);
	/* and direct again */
	ck_assert_dlpc(dlpc_channel_remove(c, "d/again"), 0);
	ck_assert_dlpc(open_direct(c, "d/again", 4, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/again", 4, 2, 0, -1), 0);
	ck_assert_uint_eq(chan_or_die(c, "d/again").depth, 1);
	ck_assert_dlpc(recv_value(r, "d/again", scaled_ms(5000), &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 4);
	dlpc_close(r);
	dlpc_close(c);
}
END_TEST

/* ---- a hostile sender writing into the channel's socket ---- */

/* A record of @p storage_size bytes describing @p n float32 tensors of @p elems elements each,
 * at offsets 0, 256, ..., keyed by @p keys (NULL: none), into @p rec. */
static void make_record(uint8_t rec[DLPC_DIRECT_RECORD], uint64_t storage_size, size_t n,
			int64_t elems, const char *const *keys)
{
	Dlpackd__V1__TensorDesc d[4], *dp[4];
	uint8_t table[DLPC_DIRECT_TABLE_MAX];
	size_t tl;

	ck_assert_uint_le(n, 4);
	for (size_t i = 0; i < n; i++) {
		dlpackd__v1__tensor_desc__init(&d[i]);
		d[i].dtype_code = kDLFloat;
		d[i].dtype_bits = 32;
		d[i].dtype_lanes = 1;
		d[i].n_shape = 1;
		d[i].shape = &elems;
		d[i].offset = 256 * i;
		if (keys) {
			d[i].key.data = (uint8_t *)keys[i];
			d[i].key.len = strlen(keys[i]);
		}
		dp[i] = &d[i];
	}
	tl = dlpc__table_size(dp, n);
	dlpc__table_encode(dp, n, table);
	ck_assert_int_eq(dlpc__direct_encode(rec, storage_size, table, tl), 0);
}

/* Append a failure to @p buf. */
__attribute__((format(printf, 3, 4))) static void report(char *buf, size_t len, const char *fmt,
							 ...)
{
	size_t used = strlen(buf);
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(buf + used, len - used, fmt, ap);
	va_end(ap);
}

static int memfd_sparse(size_t size)
{
	int fd = memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
	ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, SEALS_RO), 0);
	return fd;
}

START_TEST(test_hostile_sender)
{
	static const char *const badkeys[] = {"a", "\xff"};
	dlpc_client *c = connect_or_die(&D);
	dlpc_recv_opts wait = {.size = sizeof(wait), .timeout_ms = scaled_ms(5000)};
	uint8_t good[DLPC_DIRECT_RECORD], rec[DLPC_DIRECT_RECORD], big[2 * DLPC_DIRECT_RECORD];
	int raw, ends[2], fds0, pipefd[2], two[2], closed;
	char msg[256], pidstr[64], fails[4096] = "";
	dlpc_bundle *b;
	int64_t v;
	struct {
		const char *what;
		const void *data;
		size_t len;
		int fd;	     /* storage to send (closed here after), -1 none */
		bool two;    /* send it twice */
		bool bundle; /* a bundle: receive it with dlpc_recv_bundle() */
	} cases[16];
	size_t nc = 0;
	static uint8_t magic[DLPC_DIRECT_RECORD], past[DLPC_DIRECT_RECORD],
		keyrec[DLPC_DIRECT_RECORD], zero[DLPC_DIRECT_RECORD];

	ck_assert_dlpc(open_direct(c, "d/evil", 16, NULL), 1);
	/* joined, and a wait's eventfd made: fd counts stay put from here */
	ck_assert_dlpc(recv_value(c, "d/evil", 1, &v, NULL, NULL), -ETIMEDOUT);
	raw = raw_connect(&D);
	raw_hello(raw, DLPC_PROTO_MAJOR);
	ck_assert_int_eq(raw_join(raw, "d/evil", ends, msg, sizeof(msg)), 0);
	close(ends[1]);
	snprintf(pidstr, sizeof(pidstr), "pid %d ", (int)getpid());

	make_record(good, 4096, 1, 4, NULL);
	memcpy(magic, good, sizeof(magic));
	magic[0] ^= 0xff;
	make_record(past, 4096, 1, 2048, NULL); /* 8192 bytes in a storage of 4096 */
	make_record(keyrec, 4096, 2, 4, badkeys);
	make_record(zero, 0, 1, 4, NULL);
	ck_assert_int_eq(pipe(pipefd), 0);
	memset(big, 0, sizeof(big));
	memcpy(big, good, sizeof(good));

#define CASE(w, d, l, f, t, b)                                                                     \
	cases[nc++] =                                                                              \
		(typeof(cases[0])){.what = w, .data = d, .len = l, .fd = f, .two = t, .bundle = b}
	CASE("0 bytes, no fd", good, 0, -1, false, false);
	CASE("100 bytes", good, 100, memfd_sealed(4096, SEALS_RO), false, false);
	CASE("2048 bytes", big, sizeof(big), memfd_sealed(4096, SEALS_RO), false, false);
	CASE("bad magic", magic, sizeof(magic), memfd_sealed(4096, SEALS_RO), false, false);
	CASE("no fd", good, sizeof(good), -1, false, false);
	CASE("two fds", good, sizeof(good), memfd_sealed(4096, SEALS_RO), true, false);
	CASE("unsealed memfd", good, sizeof(good), memfd_sealed(4096, 0), false, false);
	CASE("a pipe", good, sizeof(good), pipefd[0], false, false);
	CASE("sparse memfd", good, sizeof(good), memfd_sparse(4096), false, false);
	CASE("tensor past the storage", past, sizeof(past), memfd_sealed(4096, SEALS_RO), false,
	     false);
	CASE("key not UTF-8", keyrec, sizeof(keyrec), memfd_sealed(4096, SEALS_RO), false, true);
	CASE("storage_size 0", zero, sizeof(zero), memfd_sealed(4096, SEALS_RO), false, false);
#undef CASE

	fds0 = fd_count(getpid());
	closed = 0;
	for (size_t i = 0; i < nc; i++) {
		dlpc_recv_opts o = wait;
		DLManagedTensorVersioned *t = NULL;
		int r, before;

		two[0] = two[1] = cases[i].fd;
		ck_assert_int_eq(send_fds_raw(ends[0], cases[i].data, cases[i].len, two,
					      cases[i].fd < 0 ? 0
					      : cases[i].two  ? 2
							      : 1),
				 (ssize_t)cases[i].len);
		if (cases[i].fd >= 0 && cases[i].fd != pipefd[0]) {
			close(cases[i].fd);
			closed++;
		}
		before = fd_count(getpid());
		if (cases[i].bundle)
			r = dlpc_recv_bundle(c, "d/evil", &o, &b);
		else
			r = dlpc_recv(c, "d/evil", &o, &t);
		if (r != -EBADMSG || !strstr(dlpc_last_error(), pidstr) ||
		    !strstr(dlpc_last_error(), "'d/evil'"))
			report(fails, sizeof(fails),
			       "%s: %d, expected -EBADMSG naming pid %d: %s; ", cases[i].what, r,
			       (int)getpid(), dlpc_last_error());
		if (r == 0) {
			if (t)
				t->deleter(t);
			else
				dlpc_bundle_free(b);
		}
		if (!own_fds_become(before))
			report(fails, sizeof(fails), "%s: %d fds after, %d before; ", cases[i].what,
			       fd_count(getpid()), before);
		ck_assert_uint_eq(chan_or_die(c, "d/evil").depth, 0);
	}
	close(pipefd[0]);
	close(pipefd[1]);
	ck_assert_msg(fails[0] == '\0', "%s", fails);
	/* all of the cases' fds and the pipe closed here, nothing kept by the receives */
	ck_assert_msg(own_fds_become(fds0 - closed - 2), "%d fds, %d before the cases, %d closed",
		      fd_count(getpid()), fds0, closed + 2);
	/* a good message after all of them: received intact */
	ck_assert_dlpc(send_value(c, "d/evil", 40, 100, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, "d/evil", scaled_ms(5000), &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 40);
	/* and the raw one's good record too */
	rec[0] = 0;
	memcpy(rec, good, sizeof(rec));
	two[0] = memfd_sealed(4096, SEALS_RO);
	ck_assert_int_eq(send_fds_raw(ends[0], rec, sizeof(rec), two, 1), sizeof(rec));
	close(two[0]);
	ck_assert_dlpc(dlpc_recv_bundle(c, "d/evil", &wait, &b), 0);
	ck_assert_uint_eq(dlpc_bundle_count(b), 1);
	dlpc_bundle_free(b);
	close(ends[0]);
	close(raw);
	dlpc_close(c);
}
END_TEST

/* ---- a forked child closes the ends it inherited, and joins anew ---- */

struct inodes {
	unsigned long *ino;
	int n, max;
};

static bool socket_inode(const char *target, void *arg)
{
	struct inodes *set = arg;

	if (set->n < set->max && sscanf(target, "socket:[%lu]", &set->ino[set->n]) == 1)
		set->n++;
	return false;
}

/* The socket inodes open in this process ("socket:[N]"), at most @p max into @p ino. */
static int sockets_open(unsigned long *ino, int max)
{
	struct inodes set = {ino, 0, max};

	fd_links(getpid(), socket_inode, &set);
	return set.n;
}

static bool has(const unsigned long *set, int n, unsigned long x)
{
	for (int i = 0; i < n; i++)
		if (set[i] == x)
			return true;
	return false;
}

START_TEST(test_fork)
{
	unsigned long before[64], after[64], ends[4];
	int n0 = sockets_open(before, 64), nb, na, ne = 0, pfd[2];
	dlpc_client *c = connect_or_die(&D);
	pid_t p;
	int64_t v;

	ck_assert_dlpc(open_direct(c, "d/fork", 8, NULL), 1);
	nb = sockets_open(before, 64);
	ck_assert_dlpc(send_value(c, "d/fork", 1, 4, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, "d/fork", 0, &v, NULL, NULL), 0);
	na = sockets_open(after, 64);
	for (int i = 0; i < na; i++)
		if (!has(before, nb, after[i]) && ne < 4)
			ends[ne++] = after[i];
	/* joining brought the two ends */
	ck_assert_int_eq(ne, 2);
	ck_assert_int_eq(pipe(pfd), 0);
	p = fork();
	ck_assert_int_ge(p, 0);
	if (p == 0) {
		unsigned long mine[64];
		int nm = sockets_open(mine, 64);
		dlpc_client *k = NULL;
		int64_t w;

		/* the inherited ends and connection are closed: the sockets open are those open
		 * before the parent connected */
		for (int i = 0; i < ne; i++)
			CHILD_CHECK(!has(mine, nm, ends[i]));
		CHILD_CHECK(nm == n0);
		/* the inherited client cannot be used; a new one joins and both ways work */
		CHILD_CHECK(dlpc_connect(D.sock, &k) == 0);
		CHILD_CHECK(recv_value(k, "d/fork", scaled_ms(5000), &w, NULL, NULL) == 0);
		CHILD_CHECK(w == 10);
		CHILD_CHECK(send_value(k, "d/fork", 20, 4, 0, -1) == 0);
		CHILD_CHECK(write(pfd[1], "c", 1) == 1);
		dlpc_close(k);
		_exit(0);
	}
	ck_assert_dlpc(send_value(c, "d/fork", 10, 4, 0, -1), 0);
	ck_assert_int_eq(wait_child(p), 0);
	ck_assert_dlpc(recv_value(c, "d/fork", scaled_ms(5000), &v, NULL, NULL), 0);
	ck_assert_int_eq(v, 20);
	/* the parent's ends were untouched by the child's closing its copies */
	ck_assert_int_eq(sockets_open(after, 64), na);
	close(pfd[0]);
	close(pfd[1]);
	dlpc_close(c);
}
END_TEST

/* A client that uses many direct channels remembers at most DLPC_DIRECT_ENDPOINTS_MAX of them:
 * its fds stay bounded (two per remembered channel), and a channel it removes is forgotten at
 * once. */
START_TEST(test_endpoints_bounded)
{
	dlpc_client *owner = connect_or_die(&D), *c = connect_or_die(&D);
	int n = DLPC_DIRECT_ENDPOINTS_MAX + 36, fds0, most = 0;
	char name[64];
	int64_t v;

	/* the library's threads and a wait's eventfd come with the first use: count after it */
	ck_assert_dlpc(open_direct(owner, "d/many/first", 0, NULL), 1);
	ck_assert_dlpc(send_value(c, "d/many/first", 1, 1, 0, -1), 0);
	ck_assert_dlpc(recv_value(c, "d/many/first", 1000, &v, NULL, NULL), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "d/many/first"), 0);
	fds0 = fd_count(getpid());
	for (int i = 0; i < n; i++) {
		snprintf(name, sizeof(name), "d/many/%d", i);
		ck_assert_dlpc(open_direct(owner, name, 0, NULL), 1);
		ck_assert_dlpc(send_value(c, name, i, 1, 0, -1), 0);
		ck_assert_dlpc(recv_value(c, name, 1000, &v, NULL, NULL), 0);
		ck_assert_int_eq(v, i);
		if (fd_count(getpid()) - fds0 > most)
			most = fd_count(getpid()) - fds0;
	}
	/* the owner's client joined none: only c holds ends */
	ck_assert_int_le(most, 2 * DLPC_DIRECT_ENDPOINTS_MAX);
	ck_assert_int_ge(most, 2 * DLPC_DIRECT_ENDPOINTS_MAX - 2);
	/* removed by this client: forgotten at once, its ends closed */
	for (int i = 0; i < n; i++) {
		snprintf(name, sizeof(name), "d/many/%d", i);
		ck_assert_dlpc(dlpc_channel_remove(c, name), 0);
	}
	ck_assert_int_eq(fd_count(getpid()), fds0);
	dlpc_close(c);
	dlpc_close(owner);
}
END_TEST

/* A record whose table merely claims two tensors (its table is garbage) is not a bundle: a
 * single-tensor receive takes it and drops it (-EBADMSG, as section 5.11 says), and the good
 * message behind it comes next. (Before, libdlpc's look trusted the count alone: the record
 * stayed, and every dlpc_recv() failed with -EINVAL "a bundle" for as long as it was there.) */
START_TEST(test_malformed_bundle_not_kept_for_single)
{
	dlpc_client *c = connect_or_die(&D);
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	uint8_t rec[DLPC_DIRECT_RECORD], table[8] = {2, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef};
	DLManagedTensorVersioned *t = NULL;
	int raw, ends[2], fd;
	int64_t v = 0;
	char msg[256];

	ck_assert_dlpc(open_direct(c, "d/jam", 8, NULL), 1);
	raw = raw_connect(&D);
	raw_hello(raw, DLPC_PROTO_MAJOR);
	ck_assert_int_eq(raw_join(raw, "d/jam", ends, msg, sizeof(msg)), 0);
	ck_assert_int_eq(dlpc__direct_encode(rec, 4096, table, sizeof(table)), 0);
	fd = memfd_sealed(4096, SEALS_RO);
	ck_assert_int_eq(send_fds_raw(ends[0], rec, sizeof(rec), &fd, 1), (ssize_t)sizeof(rec));
	close(fd);
	/* a good message behind it */
	ck_assert_dlpc(send_value(c, "d/jam", 7, 4, 0, 1000), 0);
	ck_assert_dlpc(dlpc_recv(c, "d/jam", &now, &t), -EBADMSG);
	ck_assert_dlpc(recv_value(c, "d/jam", 0, &v, NULL, NULL), 0);
	close(ends[0]);
	close(ends[1]);
	close(raw);
	dlpc_close(c);
}
END_TEST

/* Threads of one client that use a channel for the first time at once each JOIN it; the
 * channel is listed once, whatever they got. Once it is removed and made again elsewhere, the
 * next call finds the pair shut, joins again and works (before: each thread's copy was listed,
 * and a call went from one stale copy to the next and failed with -EIDRM on a live channel). */
static dlpc_client *dup_c;
static char dup_name[64];
static pthread_barrier_t dup_bar;

static void *dup_first_use(void *arg)
{
	dlpc_recv_opts o = {.size = sizeof(o), .timeout_ms = 0};
	DLManagedTensorVersioned *t;

	(void)arg;
	pthread_barrier_wait(&dup_bar);
	dlpc_recv(dup_c, dup_name, &o, &t);
	return NULL;
}

START_TEST(test_concurrent_first_uses)
{
	dlpc_client *other = connect_or_die(&D);
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	DLManagedTensorVersioned *t;
	int bad = 0;

	dup_c = connect_or_die(&D);
	for (int k = 0; k < 20; k++) {
		pthread_t th[8];

		snprintf(dup_name, sizeof(dup_name), "d/dup%d", k);
		ck_assert_dlpc(open_direct(other, dup_name, 8, NULL), 1);
		pthread_barrier_init(&dup_bar, NULL, 8);
		for (int i = 0; i < 8; i++)
			ck_assert_int_eq(pthread_create(&th[i], NULL, dup_first_use, NULL), 0);
		for (int i = 0; i < 8; i++)
			pthread_join(th[i], NULL);
		pthread_barrier_destroy(&dup_bar);
		ck_assert_dlpc(dlpc_channel_remove(other, dup_name), 0);
		ck_assert_dlpc(open_direct(other, dup_name, 8, NULL), 1);
		if (dlpc_recv(dup_c, dup_name, &now, &t) != -EAGAIN)
			bad++;
	}
	ck_assert_int_eq(bad, 0);
	dlpc_close(dup_c);
	dlpc_close(other);
}
END_TEST

static int prefer(dlpc_client *c, const char *name, uint32_t cap, dlpc_channel_info *info)
{
	return dlpc_channel_open_flags(c, name, cap, DLPC_CHANNEL_PREFER_DIRECT, info);
}

/* In another process: the channels test_prefer_direct made, opened by name as they are, and a
 * message through the one that is direct. */
static void prefer_child(uint32_t big_flags)
{
	dlpc_channel_info info = {.size = sizeof(info)};
	dlpc_client *k = child_connect();
	int64_t v;

	CHILD_CHECK(prefer(k, "p/d", 0, &info) == 0 && info.flags == DLPC_CHANNEL_DIRECT);
	CHILD_CHECK(prefer(k, "p/q", 0, &info) == 0 && info.flags == 0);
	CHILD_CHECK(prefer(k, "p/big", 0, &info) == 0 && info.flags == big_flags);
	CHILD_CHECK(recv_value(k, "p/d", scaled_ms(5000), &v, NULL, NULL) == 0 && v == 3);
	dlpc_close(k);
	_exit(0);
}

/* DLPC_CHANNEL_PREFER_DIRECT (dlpack_ipc.channel()'s default): a new channel is direct where
 * that kind queues its capacity, and queued, saying why, where it cannot; an existing channel
 * is opened as the kind it is, in another process too; it goes with no other kind flag. */
START_TEST(test_prefer_direct)
{
	static const char *const names[] = {"p/d", "p/q", "p/probe", "p/held", "p/big"};
	dlpc_channel_info info = {.size = sizeof(info)}, probe = {.size = sizeof(probe)};
	Dlpackd__V1__Channel req = DLPACKD__V1__CHANNEL__INIT;
	uint32_t max = DLPC_CHANNEL_CAPACITY_MAX, big_flags;
	dlpc_client *c = connect_or_die(&D);
	char msg[512];
	int raw;
	pid_t p;

	ck_assert_dlpc(prefer(c, "p/d", 0, &info), 1);
	ck_assert_uint_eq(info.flags, DLPC_CHANNEL_DIRECT);
	ck_assert_uint_ge(info.capacity, DLPC_CHANNEL_CAPACITY_DEFAULT);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "p/q", 4, DLPC_CHANNEL_QUEUED, NULL), 1);
	/* the most a direct channel queues here (the kernel's buffer limit) */
	ck_assert_dlpc(open_direct(c, "p/probe", max, &probe), 1);
	ck_assert_dlpc(prefer(c, "p/held", probe.capacity, &info), 1);
	ck_assert_uint_eq(info.flags, DLPC_CHANNEL_DIRECT);
	if (probe.capacity < max) {
		/* one more than that: queued, with the capacity asked for */
		ck_assert_dlpc(prefer(c, "p/big", probe.capacity + 1, &info), 1);
		big_flags = DLPC_CHANNEL_FALLBACK_CAPACITY;
		ck_assert_uint_eq(info.capacity, probe.capacity + 1);
	} else {
		ck_assert_dlpc(prefer(c, "p/big", max, &info), 1);
		big_flags = DLPC_CHANNEL_DIRECT;
	}
	ck_assert_uint_eq(info.flags, big_flags);
	ck_assert_dlpc(dlpc_channel_stat(c, "p/big", &info), 0);
	ck_assert_uint_eq(info.flags, big_flags);
	/* with another kind flag: refused, naming the three */
	ck_assert_dlpc(dlpc_channel_open_flags(
			       c, "p/x", 0, DLPC_CHANNEL_PREFER_DIRECT | DLPC_CHANNEL_DIRECT, NULL),
		       -EINVAL);
	ck_assert_ptr_nonnull(strstr(dlpc_last_error(), "DLPC_CHANNEL_PREFER_DIRECT"));
	ck_assert_dlpc(dlpc_channel_open_flags(
			       c, "p/x", 0, DLPC_CHANNEL_PREFER_DIRECT | DLPC_CHANNEL_QUEUED, NULL),
		       -EINVAL);
	/* the daemon refuses them too, from a client that skips libdlpc's check */
	raw = raw_connect(&D);
	raw_hello(raw, DLPC_PROTO_MAJOR);
	req.op = 1;
	req.name.data = (uint8_t *)"p/x";
	req.name.len = 3;
	req.flags = DLPC_CHANNEL_PREFER_DIRECT | DLPC_CHANNEL_DIRECT;
	raw_send(raw, DLPC_MSG_CHANNEL, 7, &req.base, NULL, 0);
	ck_assert_int_eq(raw_error(raw, msg, sizeof(msg)), EINVAL);
	close(raw);
	p = fork();
	ck_assert_int_ge(p, 0);
	if (p == 0)
		prefer_child(big_flags);
	ck_assert_dlpc(send_value(c, "p/d", 3, 4, 0, -1), 0);
	ck_assert_int_eq(wait_child(p), 0);
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		ck_assert_dlpc(dlpc_channel_remove(c, names[i]), 0);
	dlpc_close(c);
}
END_TEST

int main(void)
{
	TCase *tc, *plain;
	Suite *s = channel_suite("direct", DIRECT, &tc, &plain);

	tcase_add_test(tc, test_kinds);
	tcase_add_test(tc, test_prefer_direct);
	tcase_add_test(tc, test_produce_on_queued_refused);
	tcase_add_test(tc, test_made_again);
	tcase_add_test(tc, test_hostile_sender);
	tcase_add_test(tc, test_fork);
	tcase_add_test(tc, test_endpoints_bounded);
	tcase_add_test(tc, test_malformed_bundle_not_kept_for_single);
	tcase_add_test(tc, test_concurrent_first_uses);
	return run_suite(s);
}
