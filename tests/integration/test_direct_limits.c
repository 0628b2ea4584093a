/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What a direct channel lets one user make others hold, against a real dlpackd from separate
 * processes: the daemon's fds for the channels' socket pairs (inside the opener's fd share,
 * --max-fd-share-per-uid, and at most --max-channels-per-uid channels a uid), and a receiving
 * process's fds for what a hostile sender sends and the receiver refuses (DLPC_CLOSING_MAX,
 * when the library's closer thread is held up by a close that does not return).
 *
 * The suite runs as root; children drop to nobody (uid/gid 65534) to be another user.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netinet/in.h>
#include <poll.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "direct.h"
#include "harness.h"
#include "limits.h"
#include "raw.h"
#include "table.h"

static struct daemon D;
static bool started;

static void start(const char *const *args, unsigned long nofile)
{
	struct daemon_opts o = {.args = args, .nofile = nofile};

	daemon_start_with(&D, &o);
	started = true;
	daemon_open_for_others(&D);
}

static void teardown(void)
{
	if (started)
		daemon_stop(&D);
	started = false;
}

static bool error_says(const char *text)
{
	return strstr(dlpc_last_error(), text) != NULL;
}

static int open_direct(dlpc_client *c, const char *name)
{
	return dlpc_channel_open_flags(c, name, 16, DLPC_CHANNEL_DIRECT, NULL);
}

/* ---- the daemon's side: direct channels inside the uid's fd share ---- */

/* The daemon's fd limit here: a uid's share of it is a few dozen fds. */
#define SHARE_NOFILE 256

/* The share an EDQUOT message for --max-fd-share-per-uid names ("..., 56 (--max-fd-..."). */
static long share_named(void)
{
	const char *e = dlpc_last_error(), *at = strstr(e, " (--max-fd-share-per-uid)");

	while (at && at > e && at[-1] >= '0' && at[-1] <= '9')
		at--;
	return at ? strtol(at, NULL, 10) : -1;
}

/* Open direct channels "PREFIX/N" until one is refused; how many were opened, the refusal's
 * error in *@p r. */
static long fill_with_channels(dlpc_client *c, const char *prefix, int *r)
{
	char name[32];
	long n = 0;

	for (;;) {
		snprintf(name, sizeof(name), "%s/%ld", prefix, n);
		*r = open_direct(c, name);
		if (*r != 1 || n > SHARE_NOFILE)
			return n;
		n++;
	}
}

static int nobody_opens_channels(void *arg)
{
	dlpc_channel_info info = {.size = sizeof(info)};
	long *opened = arg;
	dlpc_client *c;
	int r;

	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	*opened = fill_with_channels(c, "hog", &r);
	CHILD_CHECK(r == -EDQUOT);
	CHILD_CHECK(error_says("cannot open direct channel 'hog/") &&
		    error_says("uid 65534 holds") && error_says("(--max-fd-share-per-uid)"));
	/* its connection and two fds a channel, within the share; one more would pass it */
	CHILD_CHECK(1 + 2 * *opened <= share_named() && 1 + 2 * (*opened + 1) > share_named());
	CHILD_CHECK(share_named() == (long)default_fd_share(c));
	/* where no fds are left for a direct channel's pair, DLPC_CHANNEL_PREFER_DIRECT makes a
	 * queued one and says why */
	CHILD_CHECK(dlpc_channel_open_flags(c, "hog/prefer", 0, DLPC_CHANNEL_PREFER_DIRECT,
					    &info) == 1);
	CHILD_CHECK(info.flags == DLPC_CHANNEL_FALLBACK_FDS);
	CHILD_CHECK(dlpc_channel_remove(c, "hog/prefer") == 0);
	/* its exit code says how many it opened */
	dlpc_close(c);
	return 0;
}

/* One uid opening direct channels, which outlive its connection, holds at most its share of
 * the daemon's fds; root still publishes and opens channels afterwards. */
START_TEST(test_direct_channels_in_fd_share)
{
	static float data[64];
	DLDataType f32 = {kDLFloat, 32, 1};
	int64_t n = 64;
	dlpc_client *c;
	long opened = 0, *shared;
	int before, held, r;
	pid_t pid;

	start(NULL, SHARE_NOFILE);
	c = connect_or_die(&D);
	before = settled_fds(&D, c, 1);
	/* the count comes back through a shared page */
	shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ck_assert_ptr_ne(shared, MAP_FAILED);
	pid = spawn(nobody_opens_channels, shared);
	ck_assert_int_eq(wait_child(pid), 0);
	opened = *shared;
	munmap(shared, 4096);
	ck_assert_int_gt(opened, 0);
	/* the channels outlived nobody's connection: the daemon holds their pairs */
	held = settled_fds(&D, c, 1) - before;
	ck_assert_int_eq(held, 2 * opened);
	fprintf(stderr, "uid 65534 made dlpackd hold %d fds in %ld direct channels (share %lld)\n",
		held, opened, (long long)default_fd_share(c));
	/* root's own share is untouched: it publishes and opens a direct channel */
	ck_assert_dlpc(dlpc_publish(c, "root/x", host_tensor(data, f32, 1, &n, NULL, NULL), 0), 1);
	ck_assert_dlpc(open_direct(c, "root/d"), 1);
	ck_assert_dlpc(open_direct(c, "root/e"), 1);
	/* and root may remove them: the daemon is back where it started */
	for (long i = 0; i < opened; i++) {
		char name[32];

		snprintf(name, sizeof(name), "hog/%ld", i);
		ck_assert_dlpc(dlpc_channel_remove(c, name), 0);
	}
	ck_assert_dlpc(dlpc_channel_remove(c, "root/d"), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "root/e"), 0);
	ck_assert_dlpc(dlpc_unpublish(c, "root/x"), 0);
	r = settled_fds(&D, c, 1);
	ck_assert_int_eq(r, before);
	dlpc_close(c);
}
END_TEST

/* ---- the daemon's side: channels per uid ---- */

static const char *const three_channels[] = {"--max-channels-per-uid", "3", NULL};

static int nobody_opens_four(void *arg)
{
	dlpc_client *c;

	(void)arg;
	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(open_direct(c, "n/0") == 1);
	CHILD_CHECK(dlpc_channel_open(c, "n/1", 4, NULL) == 1);
	CHILD_CHECK(open_direct(c, "n/2") == 1);
	CHILD_CHECK(open_direct(c, "n/3") == -EDQUOT);
	CHILD_CHECK(error_says("uid 65534 has 3 channels open; the limit is 3 "
			       "(--max-channels-per-uid)"));
	CHILD_CHECK(dlpc_channel_open(c, "n/4", 4, NULL) == -EDQUOT);
	dlpc_close(c);
	return 0;
}

static int nobody_opens_one(void *arg)
{
	dlpc_client *c;
	int *want = arg;

	become_nobody();
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	CHILD_CHECK(open_direct(c, "n/5") == *want);
	dlpc_close(c);
	return 0;
}

/* A uid's channels outlive its connections: --max-channels-per-uid bounds them, whichever
 * connection opened them; other uids open theirs. */
START_TEST(test_channels_per_uid)
{
	dlpc_client *c;
	int want = -EDQUOT;

	start(three_channels, 0);
	c = connect_or_die(&D);
	ck_assert_int_eq(wait_child(spawn(nobody_opens_four, NULL)), 0);
	/* a new connection of the same uid gets no more */
	ck_assert_int_eq(wait_child(spawn(nobody_opens_one, &want)), 0);
	/* root's are its own */
	ck_assert_dlpc(open_direct(c, "r/0"), 1);
	ck_assert_dlpc(dlpc_channel_open(c, "r/1", 4, NULL), 1);
	/* one of nobody's removed: it may open one again */
	ck_assert_dlpc(dlpc_channel_remove(c, "n/0"), 0);
	want = 1;
	ck_assert_int_eq(wait_child(spawn(nobody_opens_one, &want)), 0);
	dlpc_close(c);
}
END_TEST

/* ---- the receiver's side: fds a hostile sender sends, refused ---- */

/* The receiving process's fd limit: room for DLPC_CLOSING_MAX, one datagram's 253 beyond it,
 * and what the process holds itself. */
#define RECV_NOFILE 512
/* fds in each of the hostile sender's records */
#define FLOOD_FDS 250

/* A loopback TCP socket whose close waits a day: SO_LINGER {1, 86400}, its send queue full
 * towards a peer that never reads. The peer (kept open by the caller: its exit resets the
 * connection, which ends the wait) in *@p peer. */
static int lingering_socket(int *peer)
{
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t len = sizeof(sa);
	struct linger day = {1, 86400};
	int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), s, small = 4096;
	char junk[65536] = {0};

	CHILD_CHECK(ls >= 0 && bind(ls, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	CHILD_CHECK(listen(ls, 1) == 0 && getsockname(ls, (struct sockaddr *)&sa, &len) == 0);
	s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	CHILD_CHECK(s >= 0);
	setsockopt(s, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
	CHILD_CHECK(connect(s, (struct sockaddr *)&sa, sizeof(sa)) == 0);
	*peer = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
	CHILD_CHECK(*peer >= 0);
	setsockopt(*peer, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
	close(ls);
	while (send(s, junk, sizeof(junk), MSG_DONTWAIT) > 0)
		;
	CHILD_CHECK(setsockopt(s, SOL_SOCKET, SO_LINGER, &day, sizeof(day)) == 0);
	return s;
}

/* A Unix socket holding a lingering socket in flight: its last close frees that one, and
 * waits as long (turning the carrier's own linger off changes nothing). */
static int carrier_of(int lingering)
{
	int sv[2];
	char b = 0;

	CHILD_CHECK(socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, sv) == 0);
	CHILD_CHECK(send_fds_raw(sv[0], &b, 1, &lingering, 1) == 1);
	close(sv[0]);
	return sv[1];
}

/* Send @p rec with @p fds on @p tx, waiting for room while @p stop is not readable; whether it
 * went. */
static bool send_record(int tx, const uint8_t *rec, const int *fds, unsigned n, int stop)
{
	for (;;) {
		struct pollfd p[2] = {{.fd = tx, .events = POLLOUT},
				      {.fd = stop, .events = POLLIN}};

		if (send_fds_raw(tx, rec, DLPC_DIRECT_RECORD, fds, n) == DLPC_DIRECT_RECORD)
			return true;
		CHILD_CHECK(errno == EAGAIN);
		CHILD_CHECK(poll(p, 2, 1000) >= 0);
		if (p[1].revents)
			return false;
	}
}

/* The hostile sender, as nobody: a lingering TCP socket, then a Unix socket carrying another
 * one, then, once its own copies are closed, tells the receiver to start (@p arg[2]), and sends
 * records of FLOOD_FDS fds each until told to stop (@p arg[0..1]: the pipe whose write end the
 * test closes then). */
static int hostile_sender(void *arg)
{
	int stop = ((int *)arg)[0], go = ((int *)arg)[2], raw, ends[2], peer1, peer2, l1, l2,
	    carrier, two[2];
	int flood[FLOOD_FDS], null;
	uint8_t rec[DLPC_DIRECT_RECORD];
	char b;

	close(((int *)arg)[1]); /* the test's, whose close says stop */
	become_nobody();
	raw = raw_connect(&D);
	raw_join_or_die(raw, "flood/evil", ends);
	close(ends[1]);
	raw_small_record(rec);
	null = open("/dev/null", O_RDONLY | O_CLOEXEC);
	CHILD_CHECK(null >= 0);
	l1 = lingering_socket(&peer1);
	l2 = lingering_socket(&peer2);
	carrier = carrier_of(l2);
	close(l2);
	/* the receiver's copies are the last ones: its close is the one that waits */
	two[0] = null;
	two[1] = l1;
	CHILD_CHECK(send_record(ends[0], rec, two, 2, stop));
	close(l1);
	two[1] = carrier;
	CHILD_CHECK(send_record(ends[0], rec, two, 2, stop));
	close(carrier);
	/* now that the receiver's copies are the only ones, it may start */
	CHILD_CHECK(write(go, "g", 1) == 1);
	close(go);
	for (int i = 0; i < FLOOD_FDS; i++)
		flood[i] = null;
	while (send_record(ends[0], rec, flood, FLOOD_FDS, stop))
		;
	/* until the test is done: the peers' close ends the lingering */
	while (read(stop, &b, 1) > 0)
		;
	close(peer1);
	close(peer2);
	return 0;
}

/* The receiver: joined (says so on @p arg[0]), waits for the sender's word (@p arg[1]), and
 * with RLIMIT_NOFILE RECV_NOFILE receives from flood/evil until the bound stops
 * it, its fds bounded throughout; then it still opens files and uses flood/good. */
static int flooded_receiver(void *arg)
{
	int ready = ((int *)arg)[0], go = ((int *)arg)[1];
	char b;
	struct rlimit rl = {RECV_NOFILE, RECV_NOFILE};
	dlpc_recv_opts wait = {.size = sizeof(wait), .timeout_ms = scaled_ms(10000)};
	dlpc_recv_opts now = {.size = sizeof(now), .timeout_ms = 0};
	int base, most = 0, refused = 0, r = 0, opened[64];
	DLManagedTensorVersioned *t;
	dlpc_client *c;
	static float v[4] = {1, 2, 3, 4};
	DLDataType f32 = {kDLFloat, 32, 1};
	int64_t four = 4;
	char bound[64];

	CHILD_CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
	CHILD_CHECK(dlpc_connect(D.sock, &c) == 0);
	/* joined both (before the sender starts), and the library's wait fds made */
	CHILD_CHECK(dlpc_recv(c, "flood/good", &now, &t) == -EAGAIN);
	CHILD_CHECK(dlpc_recv(c, "flood/evil", &now, &t) == -EAGAIN);
	CHILD_CHECK(dlpc_recv(c, "flood/evil",
			      &(dlpc_recv_opts){.size = sizeof(now), .timeout_ms = 1},
			      &t) == -ETIMEDOUT);
	base = fd_count(getpid());
	CHILD_CHECK(write(ready, "r", 1) == 1);
	CHILD_CHECK(read(go, &b, 1) == 1);
	for (int i = 0; i < 64; i++) {
		t = NULL;
		r = dlpc_recv(c, "flood/evil", &wait, &t);
		if (fd_count(getpid()) > most)
			most = fd_count(getpid());
		if (r != -EBADMSG)
			break;
		refused++;
	}
	fprintf(stderr,
		"receiver: %d receives refused, then %d: %s; at most %d fds, %d before (RLIMIT "
		"%d)\n",
		refused, r, dlpc_last_error(), most, base, RECV_NOFILE);
	snprintf(bound, sizeof(bound), "DLPC_CLOSING_MAX (%d)", DLPC_CLOSING_MAX);
	CHILD_CHECK(r == -EMFILE && error_says("channel 'flood/evil'") && error_says(bound));
	CHILD_CHECK(most <= base + DLPC_CLOSING_MAX + 253 + 1);
	/* the channel is not read any more: at once the same error, nothing taken */
	CHILD_CHECK(dlpc_recv(c, "flood/evil", &wait, &t) == -EMFILE && error_says(bound));
	CHILD_CHECK(fd_count(getpid()) <= base + DLPC_CLOSING_MAX + 253 + 1);
	/* the process still opens files */
	for (int i = 0; i < 64; i++) {
		opened[i] = open("/dev/null", O_RDONLY | O_CLOEXEC);
		CHILD_CHECK(opened[i] >= 0);
	}
	for (int i = 0; i < 64; i++)
		close(opened[i]);
	/* and uses other channels */
	CHILD_CHECK(dlpc_send(c, "flood/good", host_tensor(v, f32, 1, &four, NULL, NULL), 0) == 0);
	t = NULL;
	CHILD_CHECK(dlpc_recv(c, "flood/good", &wait, &t) == 0);
	CHILD_CHECK(((float *)t->dl_tensor.data)[3] == 4);
	t->deleter(t);
	/* (its closer thread still waits on the lingering socket: the exit ends it) */
	_exit(0);
}

/* A hostile sender on a direct channel sends records carrying hundreds of fds, after a socket
 * whose close blocks the receiver's closer thread: the receiver refuses each, holds at most
 * DLPC_CLOSING_MAX of them plus one record's, stops reading that channel with an error naming
 * the bound, and keeps opening files and using other channels. */
START_TEST(test_refused_fds_bounded)
{
	dlpc_client *c;
	int stop[3], ready[2], go[2], rarg[2];
	pid_t sender, receiver;
	char b;

	start(NULL, 0);
	c = connect_or_die(&D);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "flood/evil", 64, DLPC_CHANNEL_DIRECT, NULL), 1);
	ck_assert_dlpc(open_direct(c, "flood/good"), 1);
	ck_assert_int_eq(pipe2(ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(go, O_CLOEXEC), 0);
	rarg[0] = ready[1];
	rarg[1] = go[0];
	receiver = spawn(flooded_receiver, rarg);
	close(ready[1]);
	close(go[0]);
	ck_assert_int_eq(read(ready[0], &b, 1), 1);
	close(ready[0]);
	ck_assert_int_eq(pipe2(stop, O_CLOEXEC), 0);
	stop[2] = go[1];
	sender = spawn(hostile_sender, stop);
	close(go[1]);
	ck_assert_int_eq(wait_child(receiver), 0);
	/* what it did not take is still queued */
	ck_assert_uint_gt(chan_or_die(c, "flood/evil").depth, 0);
	close(stop[1]);
	close(stop[0]);
	ck_assert_int_eq(wait_child(sender), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "flood/evil"), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "flood/good"), 0);
	dlpc_close(c);
}
END_TEST

/* Set the daemon's RLIMIT_NOFILE (soft) to @p n; its old value. */
static rlim_t daemon_nofile(rlim_t n)
{
	struct rlimit now, want;

	ck_assert_int_eq(prlimit(D.pid, RLIMIT_NOFILE, NULL, &now), 0);
	want = (struct rlimit){n, now.rlim_max};
	ck_assert_int_eq(prlimit(D.pid, RLIMIT_NOFILE, &want, NULL), 0);
	return now.rlim_cur;
}

/* A daemon that cannot make a direct channel's sockets (here: its fd limit reached, well
 * inside its fd budget and the uid's share) makes a channel opened with
 * DLPC_CHANNEL_PREFER_DIRECT queued, and says why; one asked for as direct fails naming the
 * sockets. Once it can again, a new channel is direct. */
START_TEST(test_prefer_direct_without_fds)
{
	dlpc_channel_info info = {.size = sizeof(info)};
	dlpc_client *c;
	rlim_t old;

	start(NULL, SHARE_NOFILE);
	c = connect_or_die(&D);
	old = daemon_nofile(3); /* no fd number free below it */
	ck_assert_dlpc(
		dlpc_channel_open_flags(c, "nofd/prefer", 0, DLPC_CHANNEL_PREFER_DIRECT, &info), 1);
	ck_assert_uint_eq(info.flags, DLPC_CHANNEL_FALLBACK_FDS);
	ck_assert_int_eq(open_direct(c, "nofd/direct"), -EMFILE);
	ck_assert_msg(
		error_says("cannot open direct channel 'nofd/direct': cannot make its sockets"),
		"%s", dlpc_last_error());
	/* the queued one serves */
	memset(&info, 0, sizeof(info));
	info.size = sizeof(info);
	ck_assert_dlpc(dlpc_channel_stat(c, "nofd/prefer", &info), 0);
	ck_assert_uint_eq(info.flags, DLPC_CHANNEL_FALLBACK_FDS);
	daemon_nofile(old);
	ck_assert_dlpc(
		dlpc_channel_open_flags(c, "nofd/again", 0, DLPC_CHANNEL_PREFER_DIRECT, &info), 1);
	ck_assert_uint_eq(info.flags & DLPC_CHANNEL_FALLBACK_FDS, 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "nofd/prefer"), 0);
	ck_assert_dlpc(dlpc_channel_remove(c, "nofd/again"), 0);
	dlpc_close(c);
}
END_TEST

/* ---- the daemon's side: fds in replies a uid does not read ---- */

/* The daemon's fd limit here: a share of 1,016 fds per uid. */
#define UNREAD_NOFILE 4096
/* nobody's connections, and the ATTACHes each makes wait for a name, never reading a reply:
 * more replies than its share once the name comes, fewer than --max-queue-fds each. */
#define UNREAD_CONNS 2
#define UNREAD_WAITERS 1000

struct unread {
	int stop, go;	 /* the pipe whose write end (go, the test's) the test closes when done */
	int ready, seen; /* the pipe on which the child says its ATTACHes are sent */
};

/* As nobody: UNREAD_CONNS connections, each with UNREAD_WAITERS ATTACHes of "unread/x" that wait
 * for it; no reply is read. Says so, then waits until the test is done. */
static int nobody_waits_unread(void *arg)
{
	Dlpackd__V1__Attach at = DLPACKD__V1__ATTACH__INIT;
	struct unread *u = arg;
	int fds[UNREAD_CONNS];
	char b;

	close(u->go);
	close(u->seen);
	become_nobody();
	at.name.data = (uint8_t *)"unread/x";
	at.name.len = strlen("unread/x");
	at.timeout_ms = -1;
	for (int c = 0; c < UNREAD_CONNS; c++) {
		fds[c] = raw_connect(&D);
		raw_hello(fds[c], DLPC_PROTO_MAJOR);
		for (unsigned i = 0; i < UNREAD_WAITERS; i++)
			raw_send(fds[c], DLPC_MSG_ATTACH, i + 2, &at.base, NULL, 0);
	}
	CHILD_CHECK(write(u->ready, "r", 1) == 1);
	while (read(u->stop, &b, 1) > 0)
		;
	for (int c = 0; c < UNREAD_CONNS; c++)
		close(fds[c]);
	return 0;
}

static bool waiting_at_least(const dlpc_stats *s, void *arg)
{
	return s->waiters >= *(const uint64_t *)arg;
}

static bool nothing_waiting(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->waiters == 0;
}

/* Another uid's connections wait for a name with many ATTACHes and read none of the replies: once
 * root publishes the name, the copies of its fd queued for them count in nobody's fd share, and
 * a connection of nobody's is dropped when they pass it by more than DLPC_UID_TX_FDS_SLACK, so
 * the daemon holds no more than that for it and root goes on publishing (before: every unread
 * reply's copy stayed, past nobody's share, up to the daemon's fd limit). */
START_TEST(test_unread_reply_fds_count_in_the_share)
{
	static float data[64];
	DLDataType f32 = {kDLFloat, 32, 1};
	uint64_t want = UNREAD_CONNS * UNREAD_WAITERS, share;
	int64_t n = 64;
	int stop[2], ready[2], before, held;
	struct unread u;
	dlpc_client *c;
	dlpc_stats st;
	pid_t pid;
	char b;

	start(NULL, UNREAD_NOFILE);
	c = connect_or_die(&D);
	share = default_fd_share(c);
	before = settled_fds(&D, c, 1);
	ck_assert_int_eq(pipe2(stop, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(ready, O_CLOEXEC), 0);
	u = (struct unread){.stop = stop[0], .go = stop[1], .ready = ready[1], .seen = ready[0]};
	pid = spawn(nobody_waits_unread, &u);
	close(stop[0]);
	close(ready[1]);
	ck_assert_int_eq(read(ready[0], &b, 1), 1);
	ck_assert_msg(wait_stat(c, waiting_at_least, &want, scaled_ms(10000)),
		      "the ATTACHes do not wait");
	ck_assert_dlpc(dlpc_publish(c, "unread/x", host_tensor(data, f32, 1, &n, NULL, NULL), 0),
		       1);
	ck_assert_msg(wait_stat(c, nothing_waiting, NULL, scaled_ms(10000)), "ATTACHes still wait");
	held = fd_count(D.pid) - before;
	st = stat_or_die(c);
	fprintf(stderr,
		"%llu unread replies to uid 65534: dlpackd holds %d fds more, %llu connections "
		"dropped (share %llu)\n",
		(unsigned long long)want, held, (unsigned long long)st.queue_drops,
		(unsigned long long)share);
	ck_assert_int_le(held, (int)share + DLPC_UID_TX_FDS_SLACK + UNREAD_CONNS + 2);
	ck_assert_uint_ge(st.queue_drops, 1);
	/* root is served meanwhile, nobody's child still there */
	ck_assert_dlpc(dlpc_publish(c, "unread/y", host_tensor(data, f32, 1, &n, NULL, NULL), 0),
		       1);
	ck_assert_dlpc(dlpc_unpublish(c, "unread/y"), 0);
	close(stop[1]);
	close(ready[0]);
	ck_assert_int_eq(wait_child(pid), 0);
	dlpc_close(c);
}
END_TEST

static Suite *direct_limits_suite(void)
{
	Suite *s = suite_create("direct_limits");
	TCase *daemon = tcase_create("daemon"), *recv = tcase_create("receiver");
	TCase *all[] = {daemon, recv};

	for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
		tcase_add_checked_fixture(all[i], NULL, teardown);
		tcase_set_timeout(all[i], scaled_ms(60000) / 1000);
		suite_add_tcase(s, all[i]);
	}
	tcase_add_test(daemon, test_direct_channels_in_fd_share);
	tcase_add_test(daemon, test_channels_per_uid);
	tcase_add_test(daemon, test_prefer_direct_without_fds);
	tcase_add_test(daemon, test_unread_reply_fds_count_in_the_share);
	tcase_add_test(recv, test_refused_fds_bounded);
	return s;
}

int main(void)
{
	return run_suite(direct_limits_suite());
}
