/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Closes that never return. A client can send the daemon an fd whose close blocks: the last
 * close of a loopback TCP socket with a day of SO_LINGER and a full send queue (no privilege
 * needed), or any close of a file on a FUSE mount whose server never answers FLUSH (an
 * uninterruptible wait). The daemon closes such fds in a closer process of the sender's uid,
 * charged to that uid: the sender is refused at its fd share, everyone else goes on, and SIGTERM
 * and SIGHUP (upgrade) complete with the close still stuck.
 *
 * The suite runs as root; the attacker of the first case drops to nobody (uid 65534). The FUSE
 * cases mount in a mount namespace of their own, served by a thread of the test that answers
 * what opening a file needs and never FLUSH; they abort the connection before they end, so
 * that no process is left in uninterruptible sleep.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/fuse.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>

#include "harness.h"
#include "io.h"
#include "msg.h"
#include "raw.h"

/* The attacker's connections, sending at once. */
#define ATTACK_CONNS 8
/* The daemon's RLIMIT_NOFILE in the first case: a share of 25% of 992 fds, 248. */
#define ATTACK_NOFILE 1024

static struct daemon D;
static bool started;

static void start(const char *const *args, unsigned long nofile)
{
	struct daemon_opts o = {.args = args, .nofile = nofile};

	daemon_start_with(&D, &o);
	started = true;
}

static void teardown(void)
{
	if (started)
		daemon_stop(&D);
	started = false;
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static float data[1024];

static int publish(dlpc_client *c, const char *name)
{
	DLDataType f32 = {kDLFloat, 32, 1};
	int64_t n = 1024;

	return dlpc_publish(c, name, host_tensor(data, f32, 1, &n, NULL, NULL), 0);
}

/* ---- a raw client that survives being dropped ---- */

static int sock_connect(const char *path)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (fd < 0)
		return -1;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		close(fd);
		return -1;
	}
	return fd;
}

/* One frame of @p m with @p fds, the first byte (which carries the fds) apart from the rest
 * when @p between is not NULL: between() runs while the daemon holds the fds unclaimed. */
static int frame_send(int fd, uint16_t type, const ProtobufCMessage *m, const int *fds,
		      unsigned nfds, void (*between)(void))
{
	struct dlpc__scratch s = {0};
	ssize_t len = dlpc__msg_frame(&s, type, 7, m, nfds);
	int r = -EIO;

	if (len > 1 && between) {
		r = dlpc__send_all(fd, s.p, 1, fds, nfds);
		between();
		if (r == 0)
			r = dlpc__send_all(fd, s.p + 1, (size_t)len - 1, NULL, 0);
	} else if (len > 0) {
		r = dlpc__send_all(fd, s.p, (size_t)len, fds, nfds);
	}
	dlpc__scratch_clear(&s);
	return r;
}

/* The reply to the last request: its error code (0 for a reply that is no error), or -1 when
 * the daemon hung up. The error's message in @p msg. */
static int reply(int fd, char *msg, size_t len)
{
	struct dlpc__rx rx;
	struct dlpc__frame f;
	char why[160];
	int code = -1;

	dlpc__rx_init(&rx);
	msg[0] = '\0';
	for (;;) {
		int r = dlpc__rx_next(&rx, &f, why, sizeof(why));

		if (r < 0)
			break;
		if (r == 1) {
			code = 0;
			if (f.hdr.type == DLPC_MSG_ERROR) {
				Dlpackd__V1__Error *e =
					dlpackd__v1__error__unpack(NULL, f.hdr.len, f.payload);

				code = e ? (int)e->code : EPROTO;
				if (e) {
					snprintf(msg, len, "%s", e->message);
					dlpackd__v1__error__free_unpacked(e, NULL);
				}
			}
			dlpc__frame_clear(&f);
			break;
		}
		if (dlpc__rx_read(&rx, fd, why, sizeof(why)) <= 0)
			break;
	}
	dlpc__rx_clear(&rx);
	return code;
}

/* A connection past HELLO, or -1 if the daemon refused it (the reason in @p msg). */
static int hello(const char *path, char *msg, size_t len)
{
	Dlpackd__V1__Hello h = DLPACKD__V1__HELLO__INIT;
	int fd = sock_connect(path);

	if (fd < 0)
		return -1;
	h.version_major = DLPC_PROTO_MAJOR;
	h.version_minor = DLPC_PROTO_MINOR;
	h.client = "test_closes";
	if (frame_send(fd, DLPC_MSG_HELLO, &h.base, NULL, 0, NULL) < 0 ||
	    reply(fd, msg, len) != 0) {
		close(fd);
		return -1;
	}
	return fd;
}

/* Send a PUBLISH with @p storage as the storage of one float. 0 or negative errno. */
static int publish_send(int fd, int storage, void (*between)(void))
{
	Dlpackd__V1__Publish req = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc d = DLPACKD__V1__TENSOR_DESC__INIT, *dp = &d;
	int64_t shape = 1;

	d.dtype_code = kDLFloat;
	d.dtype_bits = 32;
	d.dtype_lanes = 1;
	d.n_shape = 1;
	d.shape = &shape;
	req.name.data = (uint8_t *)"x";
	req.name.len = 1;
	req.device_type = kDLCPU;
	req.storage_size = 4096;
	req.n_tensors = 1;
	req.tensors = &dp;
	return frame_send(fd, DLPC_MSG_PUBLISH, &req.base, &storage, 1, between);
}

/* The same, and the reply's code (see reply()). */
static int publish_fd(int fd, int storage, void (*between)(void), char *msg, size_t len)
{
	if (publish_send(fd, storage, between) < 0)
		return -1;
	return reply(fd, msg, len);
}

/* ---- a lingering socket ---- */

static int listener_port(int l)
{
	struct sockaddr_in a;
	socklen_t al = sizeof(a);

	ck_assert_int_eq(getsockname(l, (struct sockaddr *)&a, &al), 0);
	return ntohs(a.sin_port);
}

/* A loopback listener that never accepts: a connection to it gets a small window, then none. */
static int silent_listener(void)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), small = 4096;

	ck_assert_int_ge(l, 0);
	ck_assert_int_eq(setsockopt(l, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small)), 0);
	ck_assert_int_eq(bind(l, (struct sockaddr *)&a, sizeof(a)), 0);
	ck_assert_int_eq(listen(l, 128), 0);
	return l;
}

/* A connection to @p port whose send queue is full and whose last close waits a day. */
static int lingering_socket(int port)
{
	struct sockaddr_in a = {.sin_family = AF_INET,
				.sin_addr.s_addr = htonl(INADDR_LOOPBACK),
				.sin_port = htons((uint16_t)port)};
	struct linger lg = {.l_onoff = 1, .l_linger = 86400};
	int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), small = 4096;
	static char junk[65536];

	CHILD_CHECK(s >= 0);
	CHILD_CHECK(setsockopt(s, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small)) == 0);
	CHILD_CHECK(connect(s, (struct sockaddr *)&a, sizeof(a)) == 0);
	CHILD_CHECK(fcntl(s, F_SETFL, O_NONBLOCK) == 0);
	/* until the window is shut and the queue full (the zero-window probes keep it so) */
	for (int quiet = 0; quiet < 20;) {
		if (send(s, junk, sizeof(junk), MSG_NOSIGNAL) > 0) {
			quiet = 0;
			continue;
		}
		CHILD_CHECK(errno == EAGAIN);
		quiet++;
		usleep(5000);
	}
	CHILD_CHECK(setsockopt(s, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg)) == 0);
	return s;
}

static int lingering = -1;

/* The daemon holds the lingering socket unclaimed: our own reference goes, so that its close
 * is the last. */
static void drop_ours(void)
{
	close(lingering);
	lingering = -1;
}

/* As nobody: jam its closer with a lingering socket, then send refused fds on ATTACK_CONNS
 * connections until the daemon refuses them at the uid's share and closes each connection. */
static int nobody_jams_its_closer(void *arg)
{
	int port = *(int *)arg, conns[ATTACK_CONNS], open_conns = 0, code;
	long sent = 0, limit = 4L * ATTACK_NOFILE;
	bool share_named = false;
	char msg[512];

	become_nobody();
	lingering = lingering_socket(port);
	for (int i = 0; i < ATTACK_CONNS; i++) {
		conns[i] = hello(D.sock, msg, sizeof(msg));
		CHILD_CHECK(conns[i] >= 0);
		open_conns++;
	}
	code = publish_fd(conns[0], lingering, drop_ours, msg, sizeof(msg));
	CHILD_CHECK(code > 0 && code != EDQUOT);
	/* then pipes, every one refused as storage, every one queued behind the stuck close */
	while (open_conns > 0 && sent < limit)
		for (int i = 0; i < ATTACK_CONNS; i++) {
			int p[2];

			if (conns[i] < 0)
				continue;
			CHILD_CHECK(pipe2(p, O_CLOEXEC) == 0);
			code = publish_fd(conns[i], p[0], NULL, msg, sizeof(msg));
			close(p[0]);
			close(p[1]);
			sent++;
			if (code == EDQUOT) {
				share_named |= strstr(msg, "(--max-fd-share-per-uid)") != NULL &&
					       strstr(msg, "still closing") != NULL;
				/* and the connection is closed after it */
				code = reply(conns[i], msg, sizeof(msg));
			}
			if (code == -1) {
				close(conns[i]);
				conns[i] = -1;
				open_conns--;
			}
		}
	fprintf(stderr, "nobody sent %ld refused fds before all its connections were closed\n",
		sent);
	CHILD_CHECK(open_conns == 0);
	CHILD_CHECK(share_named);
	/* over its share it is not served again until its closes are done */
	CHILD_CHECK(hello(D.sock, msg, sizeof(msg)) < 0);
	return 0;
}

static bool nothing_closing(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->fds_closing == 0;
}

/* A uid that sends fds whose close blocks (a lingering socket) pays for it alone: its closes
 * are charged to its fd share, it is refused (EDQUOT, naming the share) and disconnected once
 * at it, and root still connects and publishes. What the daemon holds for closing stays within
 * the uid's share (and the few fds its dropped connections carried). */
START_TEST(lingering_socket_costs_its_sender)
{
	const char *args[] = {"--log-level", "info", NULL};
	dlpc_client *c, *c2 = NULL;
	uint64_t share;
	dlpc_stats st;
	int l, port;

	start(args, ATTACK_NOFILE);
	daemon_open_for_others(&D);
	l = silent_listener();
	port = listener_port(l);
	ck_assert_int_eq(wait_child(spawn(nobody_jams_its_closer, &port)), 0);
	c = connect_or_die(&D);
	share = default_fd_share(c);
	st = stat_or_die(c);
	fprintf(stderr, "fds closing with nobody's closer stuck: %llu (its share: %llu)\n",
		(unsigned long long)st.fds_closing, (unsigned long long)share);
	ck_assert_uint_ge(st.fds_closing, share / 2);
	ck_assert_uint_le(st.fds_closing, share + DLPC_UID_CONNECTIONS_SLACK +
						  ATTACK_CONNS * (1 + 2 * DLPC_FRAME_FDS_MAX) + 4);
	/* everyone else is served */
	ck_assert_dlpc(publish(c, "root/after"), 1);
	ck_assert_dlpc(dlpc_connect(D.sock, &c2), 0);
	ck_assert_dlpc(dlpc_unpublish(c2, "root/after"), 0);
	dlpc_close(c2);
	/* the peer resets the connection: the close returns, and everything queued after it */
	close(l);
	ck_assert_msg(wait_stat(c, nothing_closing, NULL, 10000), "closes still pending");
	dlpc_close(c);
}
END_TEST

/* ---- a direct channel's pair shut by a joiner ---- */

/* What nobody_shuts_and_joins() is given and reports, in a shared page. */
struct shut_join {
	int port;      /* of the silent listener its lingering socket connects to */
	int code;      /* the refused JOIN's error code */
	int renewals;  /* the JOINs that replaced a shut pair before it */
	char msg[512]; /* the refusal's message */
};

/* As nobody: join root's direct channel "jam/root", queue a lingering TCP socket in its pair
 * (a record carrying it), then shut the pair for everyone and join again (the daemon makes a
 * new pair and closes the old one, where the lingering close blocks), until a JOIN is refused. */
static int nobody_shuts_and_joins(void *arg)
{
	struct shut_join *j = arg;
	uint8_t rec[DLPC_DIRECT_RECORD];
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int))];
	} ctl;
	struct iovec iov = {.iov_base = rec, .iov_len = sizeof(rec)};
	struct msghdr mh = {.msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = ctl.buf,
			    .msg_controllen = sizeof(ctl.buf)};
	int raw, ends[2], l, r;

	become_nobody();
	raw = raw_connect(&D);
	raw_join_or_die(raw, "jam/root", ends);
	raw_small_record(rec);
	l = lingering_socket(j->port);
	memset(&ctl, 0, sizeof(ctl));
	ctl.h.cmsg_level = SOL_SOCKET;
	ctl.h.cmsg_type = SCM_RIGHTS;
	ctl.h.cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(&ctl.h), &l, sizeof(int));
	CHILD_CHECK(sendmsg(ends[0], &mh, MSG_NOSIGNAL) == (ssize_t)sizeof(rec));
	close(l);
	for (;;) {
		CHILD_CHECK(shutdown(ends[0], SHUT_RDWR) == 0);
		close(ends[0]);
		close(ends[1]);
		r = raw_join_again(raw, "jam/root", ends, j->msg, sizeof(j->msg));
		if (r != 0)
			break;
		CHILD_CHECK(++j->renewals < 10000);
	}
	j->code = r;
	close(raw);
	return 0;
}

/* Another uid that joins root's direct channel, leaves a lingering socket in its pair and then
 * shuts the pair and joins again in a loop: each new pair's old one is closed in nobody's
 * closer, charged to nobody's fd share, so nobody's JOIN is refused (EDQUOT naming the share)
 * once the closes stuck behind the lingering one fill it, and root still publishes and opens
 * channels (before: the closes were charged to root, the channel's owner, until the daemon's
 * whole fd budget was held). */
START_TEST(a_joiner_that_shuts_the_pair_pays_for_its_close)
{
	const char *args[] = {"--log-level", "info", NULL};
	struct shut_join *j;
	dlpc_client *c;
	int l;

	start(args, ATTACK_NOFILE);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "jam/root", 16, DLPC_CHANNEL_DIRECT, NULL), 1);
	l = silent_listener();
	j = mmap(NULL, sizeof(*j), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	ck_assert_ptr_ne(j, MAP_FAILED);
	memset(j, 0, sizeof(*j));
	j->port = listener_port(l);
	ck_assert_int_eq(wait_child(spawn(nobody_shuts_and_joins, j)), 0);
	fprintf(stderr, "nobody replaced root's pair %d times, then: %s\n", j->renewals, j->msg);
	ck_assert_int_eq(j->code, EDQUOT);
	ck_assert_msg(strstr(j->msg, "uid 65534 holds") && strstr(j->msg, "still closing") &&
			      strstr(j->msg, "(--max-fd-share-per-uid)"),
		      "%s", j->msg);
	ck_assert_int_gt(j->renewals, 4);
	/* root's share is untouched: it publishes and opens channels */
	ck_assert_dlpc(publish(c, "root/after"), 1);
	ck_assert_dlpc(dlpc_channel_open_flags(c, "root/d", 16, DLPC_CHANNEL_DIRECT, NULL), 1);
	ck_assert_dlpc(dlpc_channel_remove(c, "root/d"), 0);
	ck_assert_dlpc(dlpc_unpublish(c, "root/after"), 0);
	/* the peer resets the connection: the close returns, and everything queued after it */
	close(l);
	ck_assert_msg(wait_stat(c, nothing_closing, NULL, 10000), "closes still pending");
	munmap(j, sizeof(*j));
	dlpc_close(c);
}
END_TEST

/* STAT requests sent at once, whose replies fill the sockets between us and the daemon. */
#define STATS 2048

/* Does the daemon answer a HELLO within @p ms? */
static bool answers_within(int ms)
{
	Dlpackd__V1__Hello h = DLPACKD__V1__HELLO__INIT;
	struct pollfd p = {.events = POLLIN};
	bool ok;

	p.fd = sock_connect(D.sock);
	if (p.fd < 0)
		return false;
	h.version_major = DLPC_PROTO_MAJOR;
	h.version_minor = DLPC_PROTO_MINOR;
	h.client = "probe";
	ok = frame_send(p.fd, DLPC_MSG_HELLO, &h.base, NULL, 0, NULL) == 0 &&
	     poll(&p, 1, scaled_ms(ms)) == 1;
	close(p.fd);
	return ok;
}

/* As nobody: make the daemon stop reading its connection (replies it does not read), then
 * send, in one sendmsg(), more fds than a frame may carry, the last a lingering socket whose
 * only reference is then the one in flight; then read, so that the daemon reads them. */
/* Make the daemon stop reading @p sock: STAT replies pile up unread, and it holds back. The
 * requests go in one write, so that the socket keeps room for one more message. */
static void hold_back(int sock)
{
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	struct dlpc__scratch s = {0};
	static char junk[1 << 20];
	int queued = -1, now = 0;
	ssize_t len;

	len = dlpc__msg_frame(&s, DLPC_MSG_STAT, 1, &st.base, 0);
	CHILD_CHECK(len > 0 && (size_t)len * STATS <= sizeof(junk));
	for (int i = 0; i < STATS; i++)
		memcpy(junk + (size_t)i * (size_t)len, s.p, (size_t)len);
	CHILD_CHECK(dlpc__send_all(sock, junk, (size_t)len * STATS, NULL, 0) == 0);
	dlpc__scratch_clear(&s);
	while (now != queued) {
		queued = now;
		usleep(50000);
		CHILD_CHECK(ioctl(sock, FIONREAD, &now) == 0);
	}
}

static int nobody_sends_excess_fds(void *arg)
{
	int port = *(int *)arg, sock, p[2], fds[DLPC_FRAME_FDS_MAX + 1];
	static char junk[1 << 20];
	char msg[512], byte = 0;

	become_nobody();
	lingering = lingering_socket(port);
	sock = hello(D.sock, msg, sizeof(msg));
	CHILD_CHECK(sock >= 0);
	hold_back(sock);
	CHILD_CHECK(pipe2(p, O_CLOEXEC) == 0);
	for (int i = 0; i < DLPC_FRAME_FDS_MAX; i++)
		fds[i] = p[0];
	fds[DLPC_FRAME_FDS_MAX] = lingering;
	CHILD_CHECK(send_fds_raw(sock, &byte, 1, fds, DLPC_FRAME_FDS_MAX + 1) == 1);
	drop_ours();
	close(p[0]);
	close(p[1]);
	/* now it reads them: a violation, and the end of the connection (unless it is stuck) */
	for (;;) {
		struct pollfd pf = {.fd = sock, .events = POLLIN};

		if (poll(&pf, 1, scaled_ms(5000)) != 1 || read(sock, junk, sizeof(junk)) <= 0)
			break;
	}
	close(sock);
	return 0;
}

/* More fds in one message than a frame may carry, the one in excess a socket whose last close
 * lingers: the daemon takes them all in and closes them in the sender's closer, and so keeps
 * serving (the kernel would otherwise drop the excess in the daemon's own thread, where that
 * last close would block it). */
START_TEST(excess_fds_in_flight_block_nobody)
{
	dlpc_client *c;
	bool answers;
	int l, port;

	start(NULL, 0);
	daemon_open_for_others(&D);
	l = silent_listener();
	port = listener_port(l);
	ck_assert_int_eq(wait_child(spawn(nobody_sends_excess_fds, &port)), 0);
	answers = answers_within(5000);
	/* the peer resets: a close blocked anywhere returns */
	close(l);
	ck_assert_msg(answers, "dlpackd stopped answering after fds in excess of a frame");
	c = connect_or_die(&D);
	ck_assert_msg(wait_stat(c, nothing_closing, NULL, 10000), "closes still pending");
	dlpc_close(c);
}
END_TEST

/* Connections of one uid that each send two unfinished frames' worth of fds (the most a
 * connection may hold: DLPC_RX_BATCH_MAX batches of DLPC_FRAME_FDS_MAX), 8 fds and the socket:
 * 576 fds, more than twice its share of a daemon with ATTACK_NOFILE. */
#define UNFINISHED_CONNS 64

struct unfinished {
	int ready[2]; /* the attacker says it is done: how many connections it kept */
	int go[2];    /* the test says it may go */
	int shut;     /* nobody_never_reads(): this many ATTACHes each, then shut for writing;
		       * nobody_sends_its_end(): 1 to leave a thread reading instead */
};

/* As nobody: UNFINISHED_CONNS connections, each after HELLO sending one byte of a frame with
 * DLPC_FRAME_FDS_MAX fds twice, and never the rest; held until the test says go. */
static int nobody_leaves_frames_unfinished(void *arg)
{
	struct unfinished *u = arg;
	int socks[UNFINISHED_CONNS], p[2], fds[DLPC_FRAME_FDS_MAX], n = 0, kept = 0;
	char msg[512], byte = 0;

	become_nobody();
	CHILD_CHECK(pipe2(p, O_CLOEXEC) == 0);
	for (int i = 0; i < DLPC_FRAME_FDS_MAX; i++)
		fds[i] = p[0];
	for (int i = 0; i < UNFINISHED_CONNS; i++) {
		int s = hello(D.sock, msg, sizeof(msg));

		if (s < 0)
			continue; /* refused at HELLO: over its share */
		socks[n++] = s;
		/* a connection dropped meanwhile fails the send: so be it */
		if (send_fds_raw(s, &byte, 1, fds, DLPC_FRAME_FDS_MAX) == 1)
			(void)send_fds_raw(s, &byte, 1, fds, DLPC_FRAME_FDS_MAX);
	}
	usleep(200 * 1000); /* the daemon reads the last of them */
	for (int i = 0; i < n; i++) {
		struct pollfd pf = {.fd = socks[i], .events = POLLIN};

		/* still open on the daemon's side: nothing to read, no end */
		kept += poll(&pf, 1, 0) == 0;
	}
	CHILD_CHECK(write(u->ready[1], &kept, sizeof(kept)) == sizeof(kept));
	CHILD_CHECK(read(u->go[0], &byte, 1) == 1);
	return 0;
}

/* Start @p fn, an attacker given @p u (its pipes made here), as *@p pid, and wait until it says
 * it is ready: what it says then. */
static int attacker_ready(int (*fn)(void *), struct unfinished *u, pid_t *pid)
{
	int said;

	ck_assert_int_eq(pipe2(u->ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(u->go, O_CLOEXEC), 0);
	*pid = spawn(fn, u);
	ck_assert_int_eq(read(u->ready[0], &said, sizeof(said)), sizeof(said));
	return said;
}

/* Let the attacker @p pid go, read the @p n numbers it says then into @p said, and see it exit
 * 0; @p u's pipes close. */
static void attacker_go(struct unfinished *u, pid_t pid, int *said, int n)
{
	ck_assert_int_eq(write(u->go[1], "x", 1), 1);
	for (int i = 0; i < n; i++)
		ck_assert_int_eq(read(u->ready[0], &said[i], sizeof(*said)), sizeof(*said));
	ck_assert_int_eq(wait_child(pid), 0);
	for (int i = 0; i < 2; i++) {
		close(u->ready[i]);
		close(u->go[i]);
	}
}

/* Wait until the daemon holds no more than @p base + @p more fds. */
static void daemon_fds_back(int base, int more)
{
	for (int i = 0; fd_count(D.pid) > base + more; i++) {
		ck_assert_msg(i < scaled_ms(10000) / 10, "the daemon holds %d fds, %d before",
			      fd_count(D.pid), base);
		usleep(10 * 1000);
	}
}

/*
 * The fds a uid sends with frames it never finishes count against its fd share (they used to
 * count nowhere: 64 connections held 512 of them for as long as the frame timeout, and a few
 * hundred such connections filled the daemon's fd table for good). Past its share each such
 * connection is dropped, the daemon holds no more than the share for it, root still connects
 * and publishes, and every fd is given back once the attacker is gone.
 */
START_TEST(unfinished_frames_fds_count_against_the_share)
{
	const char *args[] = {"--log-level", "info", NULL};
	struct unfinished u;
	uint64_t share;
	dlpc_client *c;
	int base, held, kept;
	pid_t pid;

	start(args, ATTACK_NOFILE);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	share = default_fd_share(c);
	base = fd_count(D.pid);
	kept = attacker_ready(nobody_leaves_frames_unfinished, &u, &pid);
	ck_assert_msg(wait_stat(c, nothing_closing, NULL, scaled_ms(10000)), "closes pending");
	held = fd_count(D.pid) - base;
	fprintf(stderr,
		"nobody kept %d connections of %d, the daemon holds %d fds for them "
		"(its share: %llu)\n",
		kept, UNFINISHED_CONNS, held, (unsigned long long)share);
	ck_assert_msg(held <= (int)share, "the daemon holds %d fds for nobody, its share %llu",
		      held, (unsigned long long)share);
	ck_assert_int_lt(kept, UNFINISHED_CONNS);
	ck_assert(log_has(D.log, "fds of an unfinished frame"));
	ck_assert_int_eq(publish(c, "root/ok"), 1);
	ck_assert(answers_within(5000));
	attacker_go(&u, pid, NULL, 0);
	/* its connections' ends take their fds with them */
	daemon_fds_back(base, 1);
	dlpc_close(c);
}
END_TEST

/* The fd limit of a daemon whose table one uid fills (its share 100%). */
#define FULL_NOFILE 128

/* The lowest fd number process @p pid has free (below FULL_NOFILE). */
static int lowest_free_fd(pid_t pid)
{
	bool used[FULL_NOFILE] = {false};
	char path[64];
	struct dirent *e;
	DIR *d;
	int fd = 0;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	d = opendir(path);
	ck_assert(d);
	while ((e = readdir(d)))
		if (e->d_name[0] != '.' && atoi(e->d_name) < FULL_NOFILE)
			used[atoi(e->d_name)] = true;
	closedir(d);
	while (fd < FULL_NOFILE && used[fd])
		fd++;
	return fd;
}

/*
 * A uid allowed the whole budget (--max-fd-share-per-uid 100) fills the daemon's fd table with
 * connections and the fds of unfinished frames, then goes: every fd it left must be closed by
 * a closer, which needs a socket pair of its own in that full table (it used to get none, and
 * nothing was ever closed again). Then the daemon answers, and holds what it held before.
 */
START_TEST(a_full_fd_table_still_gets_its_closer)
{
	const char *args[] = {"--log-level", "info", "--max-fd-share-per-uid", "100", NULL};
	struct unfinished u;
	struct rlimit lim;
	dlpc_client *c;
	int base, kept;
	pid_t pid;

	start(args, FULL_NOFILE);
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	base = fd_count(D.pid);
	kept = attacker_ready(nobody_leaves_frames_unfinished, &u, &pid);
	fprintf(stderr, "nobody kept %d connections; the daemon holds %d fds of %d\n", kept,
		fd_count(D.pid), FULL_NOFILE);
	/* the closers that closed what was refused have quit (idle), and no fd is left at all:
	 * the limit lowered to the lowest free fd number */
	ck_assert(wait_stat(c, nothing_closing, NULL, scaled_ms(10000)));
	usleep(800 * 1000); /* closers quit after 250-500 ms idle */
	lim.rlim_cur = (rlim_t)lowest_free_fd(D.pid);
	lim.rlim_max = FULL_NOFILE;
	ck_assert_int_eq(prlimit(D.pid, RLIMIT_NOFILE, &lim, NULL), 0);
	attacker_go(&u, pid, NULL, 0);
	daemon_fds_back(base, 2);
	/* the limit back as it was: publishing takes fds */
	lim.rlim_cur = FULL_NOFILE;
	ck_assert_int_eq(prlimit(D.pid, RLIMIT_NOFILE, &lim, NULL), 0);
	ck_assert(answers_within(5000));
	ck_assert_int_eq(publish(c, "root/ok"), 1);
	dlpc_close(c);
}
END_TEST

/* The uid dlpackd runs as in the in-flight case (Debian's "daemon"), as a service user's is: the
 * kernel then bounds the fds in flight from it by its RLIMIT_NOFILE, which root's are not. */
#define SERVICE_UID 1
/* The attacker's connections that ask and never read, and the daemon's fd limit then. */
#define UNREAD_CONNS 16
/* The ATTACHes each sends (or fewer, if its socket takes no more): 16,000, far past a share. */
#define UNREAD_ASKED 1000
#define UNREAD_NOFILE 1024

/* Read what @p sock has now, waiting up to @p ms for it: the fds that came (closed; 0 for bytes
 * without), -1 when nothing came, -2 at its end. */
static int fds_now(int sock, int ms)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * 64)];
	} ctl;
	static char junk[1 << 16];
	struct iovec iov = {.iov_base = junk, .iov_len = sizeof(junk)};
	struct msghdr mh = {.msg_iov = &iov,
			    .msg_iovlen = 1,
			    .msg_control = ctl.buf,
			    .msg_controllen = sizeof(ctl.buf)};
	struct pollfd pf = {.fd = sock, .events = POLLIN};
	int n = 0;

	ssize_t got;

	if (poll(&pf, 1, ms) != 1)
		return -1;
	got = recvmsg(sock, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	if (got <= 0)
		return got == 0 ? -2 : -1;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
		int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));

		for (int f = 0; f < k; f++)
			close(((int *)CMSG_DATA(c))[f]);
		n += k;
	}
	return n;
}

/* As nobody: UNREAD_CONNS connections, each sending UNREAD_ASKED ATTACHes of root's "shared"
 * while its socket takes them (or u->shut of them, then shutting it for writing), reading
 * nothing. Once told
 * to go, it reads what came without waiting and says how many fds that was (those in flight
 * to it); then it reads on, and says how many of its ATTACHes were not answered within 30 s
 * (those held back must come once it reads). */
static int nobody_never_reads(void *arg)
{
	Dlpackd__V1__Attach a = DLPACKD__V1__ATTACH__INIT;
	struct unfinished *u = arg;
	struct dlpc__scratch s = {0};
	int socks[UNREAD_CONNS], asked[UNREAD_CONNS], total = 0, missing = 0, n;
	bool ends[UNREAD_CONNS] = {false};
	long long end;
	char msg[512], x;
	ssize_t len;

	become_nobody();
	a.name.data = (uint8_t *)"shared";
	a.name.len = strlen("shared");
	len = dlpc__msg_frame(&s, DLPC_MSG_ATTACH, 1, &a.base, 0);
	CHILD_CHECK(len > 0);
	for (int i = 0; i < UNREAD_CONNS; i++) {
		socks[i] = hello(D.sock, msg, sizeof(msg));
		CHILD_CHECK(socks[i] >= 0);
		for (asked[i] = 0; asked[i] < (u->shut ? u->shut : UNREAD_ASKED); asked[i]++)
			if (send(socks[i], s.p, (size_t)len, MSG_DONTWAIT | MSG_NOSIGNAL) != len)
				break;
		/* the daemon closes its end once it answered what came before the hang-up */
		if (u->shut)
			CHILD_CHECK(shutdown(socks[i], SHUT_WR) == 0);
	}
	dlpc__scratch_clear(&s);
	usleep(300 * 1000); /* the daemon has written what it would */
	CHILD_CHECK(write(u->ready[1], &total, sizeof(total)) == sizeof(total));
	CHILD_CHECK(read(u->go[0], &x, 1) == 1);
	for (int i = 0; i < UNREAD_CONNS; i++)
		while ((n = fds_now(socks[i], 0)) >= 0) {
			total += n;
			asked[i] -= n;
		}
	/* then it reads whatever comes on any of them, as a reader would */
	end = now_ms() + scaled_ms(30000);
	for (bool waiting = true; waiting && now_ms() < end;) {
		struct pollfd pf[UNREAD_CONNS];

		waiting = false;
		for (int i = 0; i < UNREAD_CONNS; i++) {
			pf[i].fd = asked[i] > 0 && !ends[i] ? socks[i] : -1;
			pf[i].events = POLLIN;
			waiting = waiting || pf[i].fd >= 0;
		}
		if (!waiting || poll(pf, UNREAD_CONNS, 100) <= 0)
			continue;
		for (int i = 0; i < UNREAD_CONNS; i++) {
			n = pf[i].revents ? fds_now(socks[i], 0) : -1;
			if (n >= 0)
				asked[i] -= n;
			else if (n == -2)
				ends[i] = true; /* what did not come now never will */
		}
	}
	for (int i = 0; i < UNREAD_CONNS; i++) {
		missing += asked[i] > 0 ? asked[i] : 0;
		close(socks[i]);
	}
	CHILD_CHECK(write(u->ready[1], &total, sizeof(total)) == sizeof(total));
	CHILD_CHECK(write(u->ready[1], &missing, sizeof(missing)) == sizeof(missing));
	return 0;
}

/*
 * A uid that asks for replies with fds and never reads them holds at most its fd share of them
 * in flight: the rest wait in the daemon, which reads nothing more of those connections. Run as
 * a service user, dlpackd used to write them all (hundreds a connection) until the kernel
 * refused any more fds from it (ETOOMANYREFS, at its RLIMIT_NOFILE), and every other uid's
 * ATTACH then failed with its connection lost; run as root, they cost kernel memory without
 * bound. Root attaches meanwhile.
 */
START_TEST(unread_replies_hold_a_share_of_fds_in_flight)
{
	struct daemon_opts o = {.nofile = UNREAD_NOFILE, .uid = SERVICE_UID};
	uint64_t share;
	DLManagedTensorVersioned *t;
	struct unfinished u = {.shut = _i * 100};
	int total, missing, said[2];
	dlpc_client *c;
	pid_t pid;

	daemon_start_with(&D, &o);
	started = true;
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	share = default_fd_share(c);
	ck_assert_int_eq(publish(c, "shared"), 1);
	/* connections that attach, read and close leave nothing counted in flight (twice the
	 * share of them, which a count left behind would pass) */
	for (int i = 0; i < 2 * (int)share; i++) {
		dlpc_client *k = connect_or_die(&D);

		ck_assert_dlpc(dlpc_attach(k, "shared", NULL, &t), 1);
		t->deleter(t);
		dlpc_close(k);
	}
	(void)attacker_ready(nobody_never_reads, &u, &pid);
	for (int i = 0; i < 200; i++) {
		ck_assert_dlpc(dlpc_attach(c, "shared", NULL, &t), 1);
		t->deleter(t);
	}
	attacker_go(&u, pid, said, 2);
	total = said[0];
	missing = said[1];
	ck_assert_msg(missing == 0, "%d ATTACHes of nobody's were never answered once it read",
		      missing);
	fprintf(stderr,
		"fds in flight to nobody's %d connections that never read%s: %d (its share: "
		"%llu)\n",
		UNREAD_CONNS, u.shut ? ", each shut after 100 ATTACHes" : "", total,
		(unsigned long long)share);
	ck_assert_msg(total > 0 && (uint64_t)total <= share + 1,
		      "%d fds were in flight to nobody, its share %llu", total,
		      (unsigned long long)share);
	ck_assert_dlpc(dlpc_attach(c, "shared", NULL, &t), 1);
	t->deleter(t);
	dlpc_close(c);
}
END_TEST

static bool one_connection(const dlpc_stats *s, void *arg)
{
	(void)arg;
	return s->connections == 1;
}

struct late_reader {
	int sock, asked, ready;
};

/* After longer than the frame timeout, read what the connection was sent, and say how many
 * fds that was; the process ends with this thread. */
static void *read_late(void *arg)
{
	struct late_reader *r = arg;
	int n, got = 0;

	sleep(3);
	while (got < r->asked && (n = fds_now(r->sock, 2000)) >= 0)
		got += n;
	if (write(r->ready, &got, sizeof(got)) != sizeof(got))
		_exit(1);
	_exit(0);
}

/* As nobody: one connection sending UNREAD_ASKED ATTACHes of root's "shared" while its socket
 * takes them, reading nothing, and says how many it sent. Then (u->shut 0) its own end of that
 * socket (with a byte), and it exits; or (1) its main thread exits while another, later, reads
 * everything. */
static int nobody_sends_its_end(void *arg)
{
	Dlpackd__V1__Attach a = DLPACKD__V1__ATTACH__INIT;
	struct unfinished *u = arg;
	struct dlpc__scratch s = {0};
	int sock, asked;
	char msg[512], byte = 0, *all;
	ssize_t len, sent;

	become_nobody();
	a.name.data = (uint8_t *)"shared";
	a.name.len = strlen("shared");
	len = dlpc__msg_frame(&s, DLPC_MSG_ATTACH, 1, &a.base, 0);
	CHILD_CHECK(len > 0);
	sock = hello(D.sock, msg, sizeof(msg));
	CHILD_CHECK(sock >= 0);
	/* in one write: each write takes room in the socket's buffer of its own, and the daemon
	 * soon reads no more of it */
	all = malloc((size_t)len * UNREAD_ASKED);
	CHILD_CHECK(all != NULL);
	for (int i = 0; i < UNREAD_ASKED; i++)
		memcpy(all + i * len, s.p, (size_t)len);
	dlpc__scratch_clear(&s);
	sent = send(sock, all, (size_t)len * UNREAD_ASKED, MSG_DONTWAIT | MSG_NOSIGNAL);
	free(all);
	CHILD_CHECK(sent > 0);
	asked = (int)(sent / len);
	usleep(300 * 1000); /* the daemon has written what it would */
	if (u->shut) {
		static struct late_reader r;
		pthread_t th;

		r = (struct late_reader){sock, asked, u->ready[1]};
		CHILD_CHECK(write(u->ready[1], &asked, sizeof(asked)) == sizeof(asked));
		CHILD_CHECK(pthread_create(&th, NULL, read_late, &r) == 0);
		pthread_exit(NULL);
	}
	CHILD_CHECK(send_fds_raw(sock, &byte, 1, &sock, 1) == 1);
	CHILD_CHECK(write(u->ready[1], &asked, sizeof(asked)) == sizeof(asked));
	return 0;
}

/*
 * A client that sends its own end of its connection on it, leaves replies unread, and exits:
 * its end lives on in the daemon's receive queue of that connection, which the daemon does not
 * read while replies wait, so the connection never ends by itself (it used to stay, charged to
 * the uid with every fd in flight, until the daemon stopped). Once nothing it was sent has been
 * taken for the frame timeout and its process is gone, the daemon closes it, and every fd goes.
 * Loop 0: its replies wait for room in its socket (dlpackd as root, a large fd budget); loop 1:
 * for its uid's share of fds in flight (as a service user, RLIMIT_NOFILE 1024).
 */
/* A daemon started with @p o, open to other uids, with root's "shared" published on the client
 * returned. */
static dlpc_client *shared_daemon(const struct daemon_opts *o)
{
	dlpc_client *c;

	daemon_start_with(&D, o);
	started = true;
	daemon_open_for_others(&D);
	c = connect_or_die(&D);
	ck_assert_int_eq(publish(c, "shared"), 1);
	return c;
}

START_TEST(a_gone_client_that_sent_its_own_end_is_closed)
{
	const char *args[] = {"--frame-timeout-ms", "1000", NULL};
	struct daemon_opts o = {
		.args = args, .nofile = _i ? UNREAD_NOFILE : 0, .uid = _i ? SERVICE_UID : 0};
	DLManagedTensorVersioned *t;
	struct unfinished u = {.shut = 0};
	int base, asked;
	dlpc_client *c;
	pid_t pid;

	c = shared_daemon(&o);
	base = fd_count(D.pid);
	asked = attacker_ready(nobody_sends_its_end, &u, &pid);
	attacker_go(&u, pid, NULL, 0);
	ck_assert_int_gt(asked, 300);
	/* nobody's connection and the replies in flight to it are gone within a few seconds */
	ck_assert_msg(wait_stat(c, one_connection, NULL, scaled_ms(10000)),
		      "nobody's connection is still open");
	ck_assert(log_has(D.log, "its process is gone, yet its socket stays open"));
	ck_assert(wait_stat(c, nothing_closing, NULL, scaled_ms(5000)));
	daemon_fds_back(base, 0);
	ck_assert_dlpc(dlpc_attach(c, "shared", NULL, &t), 1);
	t->deleter(t);
	dlpc_close(c);
}
END_TEST

/* Not a gone client: one whose main thread exited while another thread of its process reads
 * later (longer than the frame timeout) is left alone, and gets every reply. */
START_TEST(a_client_whose_main_thread_exited_is_not_gone)
{
	const char *args[] = {"--frame-timeout-ms", "1000", NULL};
	struct daemon_opts o = {.args = args};
	struct unfinished u = {.shut = 1};
	int asked, got;
	dlpc_client *c;
	pid_t pid;

	c = shared_daemon(&o);
	asked = attacker_ready(nobody_sends_its_end, &u, &pid);
	attacker_go(&u, pid, &got, 1);
	ck_assert_msg(got == asked, "%d of %d replies came", got, asked);
	ck_assert(!log_has(D.log, "its process is gone"));
	dlpc_close(c);
}
END_TEST

/* Fds sent before HELLO, which carries none: a violation at once, not at the frame timeout. */
START_TEST(fds_before_hello_are_refused)
{
	const char *args[] = {"--log-level", "info", NULL};
	int s, p[2], fds[DLPC_FRAME_FDS_MAX];
	char byte = 0, junk[512];
	struct pollfd pf = {.events = POLLIN};

	start(args, 0);
	s = sock_connect(D.sock);
	ck_assert_int_ge(s, 0);
	ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
	for (int i = 0; i < DLPC_FRAME_FDS_MAX; i++)
		fds[i] = p[0];
	ck_assert_int_eq(send_fds_raw(s, &byte, 1, fds, DLPC_FRAME_FDS_MAX), 1);
	pf.fd = s;
	/* within a fraction of the frame timeout (10 s): an ERROR, then the end */
	for (;;) {
		ck_assert_msg(poll(&pf, 1, scaled_ms(3000)) == 1, "still connected after 3 s");
		if (read(s, junk, sizeof(junk)) <= 0)
			break;
	}
	ck_assert(log_has(D.log, "fds sent before HELLO"));
	close(s);
	close(p[0]);
	close(p[1]);
}
END_TEST

/* Uids that jam a closer each: more than there may be closers. */
#define JAM_UIDS (DLPC_CLOSERS_MAX + 6)
#define JAM_UID0 20000

struct jam {
	int port;
	uid_t uid;
};

/* As @p arg's uid: jam that uid's closer with a lingering socket. */
static int uid_jams(void *arg)
{
	const struct jam *j = arg;
	char msg[512];
	int sock;

	CHILD_CHECK(setgroups(0, NULL) == 0);
	CHILD_CHECK(setgid(j->uid) == 0);
	CHILD_CHECK(setuid(j->uid) == 0);
	lingering = lingering_socket(j->port);
	sock = hello(D.sock, msg, sizeof(msg));
	CHILD_CHECK(sock >= 0);
	CHILD_CHECK(publish_fd(sock, lingering, drop_ours, msg, sizeof(msg)) == EBADF);
	close(sock);
	return 0;
}

/* The daemon's child processes (its closers). */
static int closers(void)
{
	char path[64], buf[8192];
	int fd, n = 0;
	ssize_t len;

	snprintf(path, sizeof(path), "/proc/%d/task/%d/children", (int)D.pid, (int)D.pid);
	fd = open(path, O_RDONLY | O_CLOEXEC);
	ck_assert_int_ge(fd, 0);
	len = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	ck_assert_int_ge(len, 0);
	buf[len] = '\0';
	for (char *p = strtok(buf, " \n"); p; p = strtok(NULL, " \n"))
		n++;
	return n;
}

static bool closing_at_least(const dlpc_stats *s, void *arg)
{
	return s->fds_closing >= *(const uint64_t *)arg;
}

/* More uids than DLPC_CLOSERS_MAX jam their closers at once: there are never more closer
 * processes than that (the other uids' closes wait, charged to them), root is served all
 * along, and once the closes return every closer goes. */
START_TEST(closers_are_bounded)
{
	uint64_t jammed = JAM_UIDS;
	dlpc_client *c;
	long long deadline;
	int l, most = 0;

	start(NULL, 0);
	daemon_open_for_others(&D);
	l = silent_listener();
	for (int i = 0; i < JAM_UIDS; i++) {
		struct jam j = {.port = listener_port(l), .uid = JAM_UID0 + (uid_t)i};

		ck_assert_int_eq(wait_child(spawn(uid_jams, &j)), 0);
		if (closers() > most)
			most = closers();
	}
	c = connect_or_die(&D);
	/* a lingering socket and a connection of each uid */
	ck_assert(wait_stat(c, closing_at_least, &jammed, 5000));
	if (closers() > most)
		most = closers();
	fprintf(stderr, "%d closers at most for %d jammed uids\n", most, JAM_UIDS);
	ck_assert_int_eq(most, DLPC_CLOSERS_MAX);
	ck_assert(answers_within(5000));
	ck_assert_dlpc(publish(c, "root/during"), 1);
	ck_assert_dlpc(dlpc_unpublish(c, "root/during"), 0);
	close(l);
	ck_assert_msg(wait_stat(c, nothing_closing, NULL, 20000), "closes still pending");
	deadline = now_ms() + scaled_ms(10000);
	while (closers() > 0 && now_ms() < deadline)
		usleep(10000);
	ck_assert_int_eq(closers(), 0);
	dlpc_close(c);
}
END_TEST

static int count_in_log(const char *log, const char *text);

/* An upgrade with a uid's closer jammed and its share of closes pending: every one of them is
 * passed to the new image, which closes them (all but the jammed one are quick), serves root,
 * and reaps the old closer once its close returns. */
START_TEST(upgrade_passes_every_pending_close)
{
	const char *args[] = {"--log-level", "info", NULL};
	dlpc_client *c;
	long long deadline;
	uint64_t pending;
	int l, port;

	start(args, ATTACK_NOFILE);
	daemon_open_for_others(&D);
	l = silent_listener();
	port = listener_port(l);
	ck_assert_int_eq(wait_child(spawn(nobody_jams_its_closer, &port)), 0);
	c = connect_or_die(&D);
	pending = stat_or_die(c).fds_closing;
	dlpc_close(c);
	ck_assert_uint_ge(pending, 200);
	ck_assert_int_eq(kill(D.pid, SIGHUP), 0);
	deadline = now_ms() + scaled_ms(5000);
	while (count_in_log(D.log, "listening on") < 2 && now_ms() < deadline)
		usleep(5000);
	ck_assert_int_ge(count_in_log(D.log, "listening on"), 2);
	ck_assert(log_has(D.log, "the previous image was closing are closed here"));
	{
		char line[1024];
		long passed = -1;
		FILE *f = fopen(D.log, "r");

		while (f && fgets(line, sizeof(line), f)) {
			char *at = strstr(line, " fds the previous image was closing");

			while (at && at > line && at[-1] >= '0' && at[-1] <= '9')
				at--;
			if (at)
				passed = strtol(at, NULL, 10);
		}
		if (f)
			fclose(f);
		fprintf(stderr, "%llu fds closing before the upgrade, %ld passed on\n",
			(unsigned long long)pending, passed);
		ck_assert_int_ge(passed, 200);
	}
	c = connect_or_die(&D);
	/* the jammed close stays with the old closer: the new image is done with its copies */
	ck_assert_msg(wait_stat(c, nothing_closing, NULL, 10000), "closes still pending");
	ck_assert_dlpc(publish(c, "root/after"), 1);
	close(l);
	deadline = now_ms() + scaled_ms(10000);
	while (closers() > 0 && now_ms() < deadline)
		usleep(10000);
	ck_assert_int_eq(closers(), 0);
	dlpc_close(c);
}
END_TEST

/* Connections made and closed first, to free low fd numbers in the daemon. */
#define UNREAD_LOW 32

struct unread {
	int port;
	int ready[2], release[2]; /* pipes: the child is ready; the parent lets it go */
};

/* As nobody: make the daemon stop reading, send a PUBLISH carrying a lingering socket whose only
 * reference is then the one in flight, unread, and stay connected until let go. */
static int nobody_leaves_unread(void *arg)
{
	struct unread *u = arg;
	char msg[512], b = 1;
	int sock;

	close(u->ready[0]);
	close(u->release[1]);
	become_nobody();
	lingering = lingering_socket(u->port);
	sock = hello(D.sock, msg, sizeof(msg));
	CHILD_CHECK(sock >= 0);
	hold_back(sock);
	CHILD_CHECK(publish_send(sock, lingering, NULL) == 0);
	drop_ours();
	CHILD_CHECK(write(u->ready[1], &b, 1) == 1);
	while (read(u->release[0], &b, 1) < 0 && errno == EINTR)
		;
	close(sock);
	return 0;
}

/* An upgrade while a connection has a lingering socket in flight, unread (the daemon was holding
 * back): its socket is closed by its uid's closer, not by the exec (or by the moves before it)
 * in the daemon's thread, so the new image comes up. */
START_TEST(upgrade_with_unread_lingering_socket)
{
	const char *args[] = {"--log-level", "info", NULL};
	struct unread u;
	long long deadline;
	dlpc_client *c;
	bool up = false;
	pid_t child;
	char b;
	int l;

	start(args, 0);
	daemon_open_for_others(&D);
	l = silent_listener();
	u.port = listener_port(l);
	/* low fd numbers freed in the daemon, for nobody's connection to take, under the numbers
	 * of the storages the upgrade passes on (3 and up, one per entry) */
	c = connect_or_die(&D);
	{
		char msg[512];
		int conns[UNREAD_LOW];

		for (int i = 0; i < UNREAD_LOW; i++)
			ck_assert_int_ge(conns[i] = hello(D.sock, msg, sizeof(msg)), 0);
		for (int i = 0; i < UNREAD_LOW; i++)
			close(conns[i]);
		ck_assert(wait_stat(c, nothing_closing, NULL, 10000));
	}
	ck_assert_int_eq(pipe2(u.ready, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(u.release, O_CLOEXEC), 0);
	child = spawn(nobody_leaves_unread, &u);
	close(u.ready[1]);
	close(u.release[0]);
	ck_assert_int_eq(read(u.ready[0], &b, 1), 1);
	for (int i = 0; i < 2 * UNREAD_LOW; i++) {
		char name[32];

		snprintf(name, sizeof(name), "keep/%d", i);
		ck_assert_dlpc(publish(c, name), 1);
	}
	dlpc_close(c);
	ck_assert_int_eq(kill(D.pid, SIGHUP), 0);
	deadline = now_ms() + scaled_ms(5000);
	while (!up && now_ms() < deadline) {
		up = count_in_log(D.log, "listening on") >= 2 && answers_within(100);
		usleep(5000);
	}
	/* let everything go, whatever happened */
	close(u.release[1]);
	close(u.ready[0]);
	close(l);
	ck_assert_int_eq(wait_child(child), 0);
	ck_assert_msg(up, "the upgraded dlpackd did not come up");
	c = connect_or_die(&D);
	ck_assert_dlpc(publish(c, "after/upgrade"), 1);
	ck_assert_msg(wait_stat(c, nothing_closing, NULL, 10000), "closes still pending");
	dlpc_close(c);
}
END_TEST

/* ---- a FUSE file system that never answers FLUSH ---- */

struct stall_fs {
	char dir[64];
	int dev; /* /dev/fuse */
	pthread_t thread;
	volatile int stop;    /* the server thread returns */
	volatile int flushes; /* FLUSH requests seen (never answered) */
	bool mounted;
};

static void fill_attr(struct fuse_attr *a, uint64_t ino)
{
	memset(a, 0, sizeof(*a));
	a->ino = ino;
	a->mode = ino == FUSE_ROOT_ID ? S_IFDIR | 0755 : S_IFREG | 0644;
	a->nlink = 1;
	a->size = ino == FUSE_ROOT_ID ? 0 : 4096;
	a->blocks = a->size / 512;
	a->blksize = 4096;
}

static void answer(int dev, uint64_t unique, int error, const void *out, size_t len)
{
	uint8_t buf[sizeof(struct fuse_out_header) + 256];
	struct fuse_out_header h = {
		.len = (uint32_t)(sizeof(h) + len), .error = -error, .unique = unique};

	memcpy(buf, &h, sizeof(h));
	if (len)
		memcpy(buf + sizeof(h), out, len);
	if (write(dev, buf, h.len) < 0)
		return; /* the request was interrupted, or the connection is gone */
}

/* Serve what opening the one file "f" needs; never answer FLUSH. */
static void *stall_serve(void *arg)
{
	struct stall_fs *fs = arg;
	static uint8_t buf[FUSE_MIN_READ_BUFFER + 65536];

	while (!fs->stop) {
		struct pollfd p = {.fd = fs->dev, .events = POLLIN};
		struct fuse_in_header *in = (struct fuse_in_header *)buf;
		const void *arg_in = buf + sizeof(*in);
		ssize_t n;

		if (poll(&p, 1, 20) <= 0)
			continue;
		n = read(fs->dev, buf, sizeof(buf));
		if (n < (ssize_t)sizeof(*in))
			continue;
		switch (in->opcode) {
		case FUSE_INIT: {
			const struct fuse_init_in *ii = arg_in;
			struct fuse_init_out o = {.major = FUSE_KERNEL_VERSION,
						  .minor = ii->minor < FUSE_KERNEL_MINOR_VERSION
								   ? ii->minor
								   : FUSE_KERNEL_MINOR_VERSION,
						  .max_write = 4096,
						  .max_background = 4,
						  .congestion_threshold = 4,
						  .time_gran = 1};

			answer(fs->dev, in->unique, 0, &o, sizeof(o));
			break;
		}
		case FUSE_LOOKUP: {
			struct fuse_entry_out o = {.nodeid = 2, .generation = 1};

			if (strcmp(arg_in, "f") != 0) {
				answer(fs->dev, in->unique, ENOENT, NULL, 0);
				break;
			}
			fill_attr(&o.attr, 2);
			answer(fs->dev, in->unique, 0, &o, sizeof(o));
			break;
		}
		case FUSE_GETATTR: {
			struct fuse_attr_out o = {0};

			fill_attr(&o.attr, in->nodeid);
			answer(fs->dev, in->unique, 0, &o, sizeof(o));
			break;
		}
		case FUSE_OPEN:
		case FUSE_OPENDIR: {
			struct fuse_open_out o = {.fh = 1};

			answer(fs->dev, in->unique, 0, &o, sizeof(o));
			break;
		}
		case FUSE_FLUSH:
			__atomic_add_fetch(&fs->flushes, 1, __ATOMIC_RELEASE);
			break;
		case FUSE_INTERRUPT:
		case FUSE_FORGET:
		case FUSE_BATCH_FORGET:
			break;
		case FUSE_RELEASE:
		case FUSE_RELEASEDIR:
			answer(fs->dev, in->unique, 0, NULL, 0);
			break;
		default:
			answer(fs->dev, in->unique, ENOSYS, NULL, 0);
		}
	}
	return NULL;
}

/* Mount the stalling file system in a mount namespace of this test's own; false (and why,
 * printed) where /dev/fuse is absent or mounting is refused. */
static bool stall_mount(struct stall_fs *fs)
{
	char opts[128];

	memset(fs, 0, sizeof(*fs));
	snprintf(fs->dir, sizeof(fs->dir), "/tmp/dlpc-closes-fuse-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(fs->dir));
	fs->dev = open("/dev/fuse", O_RDWR | O_CLOEXEC);
	if (fs->dev < 0) {
		fprintf(stderr, "skipped: no /dev/fuse: %s\n", strerror(errno));
		rmdir(fs->dir);
		return false;
	}
	snprintf(opts, sizeof(opts), "fd=%d,rootmode=40000,user_id=0,group_id=0", fs->dev);
	/* before the server thread: a threaded process cannot enter a mount namespace */
	if (unshare(CLONE_NEWNS) < 0 || mount("none", "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
	    mount("dlpcstall", fs->dir, "fuse", MS_NOSUID | MS_NODEV, opts) < 0) {
		fprintf(stderr, "skipped: cannot mount FUSE here: %s\n", strerror(errno));
		close(fs->dev);
		rmdir(fs->dir);
		return false;
	}
	fs->mounted = true;
	ck_assert_int_eq(pthread_create(&fs->thread, NULL, stall_serve, fs), 0);
	return true;
}

/* The process that sends the stalling file and keeps its own descriptor of it: its close would
 * stick too, so it waits until the connection is aborted. Not the test's own process, whose
 * children (a daemon it starts) close what they inherit. */
struct holder {
	pid_t pid;
	int release; /* closed: the holder exits */
};

/* Abort the connection: the server stops and its device closes (and fusectl's abort, where it
 * is mounted), so every request waiting for it (the FLUSH a closer is stuck in) fails at once;
 * then the holder goes. */
static void stall_abort(struct stall_fs *fs, struct holder *h)
{
	struct stat st;
	char path[96];
	int fd;

	if (!fs->mounted)
		return;
	if (stat(fs->dir, &st) == 0) {
		snprintf(path, sizeof(path), "/sys/fs/fuse/connections/%u/abort", minor(st.st_dev));
		fd = open(path, O_WRONLY | O_CLOEXEC);
		if (fd >= 0) {
			if (write(fd, "1", 1) < 0)
				fprintf(stderr, "%s: %s\n", path, strerror(errno));
			close(fd);
		}
	}
	fs->stop = 1;
	pthread_join(fs->thread, NULL);
	close(fs->dev);
	if (h && h->pid > 0) {
		close(h->release);
		waitpid(h->pid, NULL, 0);
		h->pid = 0;
	}
	umount2(fs->dir, MNT_DETACH);
	rmdir(fs->dir);
	fs->mounted = false;
}

/* In a holder process: send an opened file of @p fs to the daemon as a PUBLISH storage
 * (refused: not a memfd), tell the answer, and wait to be let go. */
static void hold(struct stall_fs *fs, int answer_fd, int release_fd)
{
	char path[96], msg[512], b;
	int f, sock, code = -1;

	close(fs->dev);
	snprintf(path, sizeof(path), "%s/f", fs->dir);
	f = open(path, O_RDONLY | O_CLOEXEC);
	sock = f >= 0 ? hello(D.sock, msg, sizeof(msg)) : -1;
	if (sock >= 0)
		code = publish_fd(sock, f, NULL, msg, sizeof(msg));
	if (write(answer_fd, &code, sizeof(code)) < 0)
		_exit(1);
	while (read(release_fd, &b, 1) < 0 && errno == EINTR)
		;
	_exit(0);
}

/* Have a holder send the file, and wait until the daemon's close of it is stuck in FLUSH. */
static void send_stalling_file(struct stall_fs *fs, struct holder *h)
{
	int answer[2], release[2], code = 0;
	long long deadline;

	ck_assert_int_eq(pipe2(answer, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(release, O_CLOEXEC), 0);
	h->pid = fork();
	ck_assert_int_ge(h->pid, 0);
	if (h->pid == 0) {
		close(answer[0]);
		close(release[1]);
		hold(fs, answer[1], release[0]);
	}
	close(answer[1]);
	close(release[0]);
	h->release = release[1];
	ck_assert_int_eq(read(answer[0], &code, sizeof(code)), (ssize_t)sizeof(code));
	close(answer[0]);
	ck_assert_msg(code == EBADF, "PUBLISH of a FUSE file answered %d", code);
	deadline = now_ms() + scaled_ms(5000);
	while (__atomic_load_n(&fs->flushes, __ATOMIC_ACQUIRE) == 0 && now_ms() < deadline)
		usleep(2000);
	ck_assert_msg(fs->flushes > 0, "the daemon never closed the file");
}

/* Has @p pid exited (reaped here), waiting up to @p ms? */
static bool exits_within(pid_t pid, int ms)
{
	long long deadline = now_ms() + scaled_ms(ms);

	while (now_ms() < deadline) {
		if (waitpid(pid, NULL, WNOHANG) == pid)
			return true;
		usleep(5000);
	}
	return false;
}

/* SIGTERM with a close stuck in FUSE's FLUSH forever: the daemon exits all the same (its closer
 * alone waits), its socket and lock are let go, and a new daemon starts at once on the path. */
START_TEST(stop_completes_with_close_stuck_in_fuse)
{
	struct stall_fs fs;
	struct holder h;
	dlpc_client *c;
	char msg[512];
	bool gone;
	pid_t old;
	int conn;

	if (!stall_mount(&fs))
		return;
	start(NULL, 0);
	conn = hello(D.sock, msg, sizeof(msg));
	ck_assert_int_ge(conn, 0);
	send_stalling_file(&fs, &h);
	old = D.pid;
	ck_assert_int_eq(kill(old, SIGTERM), 0);
	gone = exits_within(old, 2000);
	if (gone) {
		long long deadline = now_ms() + scaled_ms(5000);
		struct pollfd p = {.fd = conn, .events = POLLIN};
		char b;

		/* a connection of the same uid as the stuck close sees its end */
		ck_assert_int_eq(poll(&p, 1, scaled_ms(5000)), 1);
		ck_assert_int_eq(read(conn, &b, 1), 0);

		D.pid = daemon_spawn(D.sock, D.log);
		while (dlpc_connect(D.sock, &c) < 0) {
			ck_assert_msg(now_ms() < deadline, "no new dlpackd on the path");
			usleep(5000);
		}
		ck_assert_dlpc(publish(c, "after/stop"), 1);
		dlpc_close(c);
	}
	/* let the stuck close return, whatever happened, before anything can fail */
	stall_abort(&fs, &h);
	close(conn);
	if (!gone) {
		waitpid(old, NULL, 0);
		started = false;
	}
	ck_assert_msg(gone, "dlpackd did not exit on SIGTERM with a close stuck in FUSE");
}
END_TEST

static int count_in_log(const char *log, const char *text)
{
	char line[1024];
	int n = 0;
	FILE *f = fopen(log, "r");

	while (f && fgets(line, sizeof(line), f))
		n += strstr(line, text) != NULL;
	if (f)
		fclose(f);
	return n;
}

/* SIGHUP (an upgrade in place) with a close stuck in FUSE's FLUSH forever: the new image comes
 * up on the same socket with every entry, and takes over the close. */
START_TEST(upgrade_completes_with_close_stuck_in_fuse)
{
	const char *args[] = {"--log-level", "info", NULL};
	struct stall_fs fs;
	struct holder h;
	dlpc_client *c;
	dlpc_entry_info *e = NULL;
	size_t n = 0;
	long long deadline;
	bool up = false;

	if (!stall_mount(&fs))
		return;
	start(args, 0);
	c = connect_or_die(&D);
	ck_assert_dlpc(publish(c, "keep/0"), 1);
	ck_assert_dlpc(publish(c, "keep/1"), 1);
	ck_assert_dlpc(publish(c, "keep/2"), 1);
	dlpc_close(c);
	send_stalling_file(&fs, &h);
	ck_assert_int_eq(kill(D.pid, SIGHUP), 0);
	deadline = now_ms() + scaled_ms(5000);
	while (!up && now_ms() < deadline) {
		up = count_in_log(D.log, "listening on") >= 2;
		usleep(5000);
	}
	if (up) {
		c = connect_or_die(&D);
		ck_assert_int_eq(dlpc_list(c, "keep/", &e, &n), 0);
		dlpc_list_free(e, n);
		ck_assert_dlpc(publish(c, "after/upgrade"), 1);
		dlpc_close(c);
		ck_assert(log_has(D.log, "the previous image was closing are closed here"));
	}
	stall_abort(&fs, &h);
	ck_assert_msg(up, "the upgraded dlpackd did not come up with a close stuck in FUSE");
	ck_assert_uint_eq(n, 3);
	/* the close returned: the new image's closes are done, and every closer, the old
	 * image's included, is gone (reaped by the new image) */
	c = connect_or_die(&D);
	ck_assert_msg(wait_stat(c, nothing_closing, NULL, 10000), "closes still pending");
	deadline = now_ms() + scaled_ms(10000);
	while (closers() > 0 && now_ms() < deadline)
		usleep(10000);
	ck_assert_int_eq(closers(), 0);
	dlpc_close(c);
}
END_TEST

/* An upgrade, then SIGTERM, with the close still stuck: the upgraded image, which took the
 * close over, stops all the same, and a new daemon starts on the path. */
START_TEST(upgrade_then_stop_with_close_stuck_in_fuse)
{
	const char *args[] = {"--log-level", "info", NULL};
	struct stall_fs fs;
	struct holder h;
	dlpc_client *c;
	long long deadline;
	bool up = false, gone = false;
	pid_t old;

	if (!stall_mount(&fs))
		return;
	start(args, 0);
	send_stalling_file(&fs, &h);
	ck_assert_int_eq(kill(D.pid, SIGHUP), 0);
	deadline = now_ms() + scaled_ms(5000);
	while (!up && now_ms() < deadline) {
		up = count_in_log(D.log, "listening on") >= 2;
		usleep(5000);
	}
	old = D.pid;
	if (up) {
		ck_assert_int_eq(kill(old, SIGTERM), 0);
		gone = exits_within(old, 2000);
	}
	if (gone) {
		deadline = now_ms() + scaled_ms(5000);
		D.pid = daemon_spawn(D.sock, D.log);
		while (dlpc_connect(D.sock, &c) < 0) {
			ck_assert_msg(now_ms() < deadline, "no new dlpackd on the path");
			usleep(5000);
		}
		ck_assert_dlpc(publish(c, "after/stop"), 1);
		dlpc_close(c);
	}
	stall_abort(&fs, &h);
	if (!gone) {
		kill(old, SIGTERM);
		waitpid(old, NULL, 0);
		started = false;
	}
	ck_assert_msg(up, "the upgraded dlpackd did not come up with a close stuck in FUSE");
	ck_assert_msg(gone, "the upgraded dlpackd did not exit on SIGTERM with a close stuck");
}
END_TEST

int main(void)
{
	Suite *s = suite_create("closes");
	TCase *linger = tcase_create("linger"), *fuse = tcase_create("fuse");
	TCase *gone = tcase_create("gone");

	tcase_add_checked_fixture(gone, NULL, teardown);
	tcase_set_timeout(gone, 60);
	tcase_add_loop_test(gone, a_gone_client_that_sent_its_own_end_is_closed, 0, 2);
	tcase_add_test(gone, a_client_whose_main_thread_exited_is_not_gone);
	suite_add_tcase(s, gone);

	tcase_add_checked_fixture(linger, NULL, teardown);
	tcase_set_timeout(linger, 120);
	tcase_add_test(linger, lingering_socket_costs_its_sender);
	tcase_add_test(linger, a_joiner_that_shuts_the_pair_pays_for_its_close);
	tcase_add_test(linger, excess_fds_in_flight_block_nobody);
	tcase_add_test(linger, unfinished_frames_fds_count_against_the_share);
	tcase_add_test(linger, fds_before_hello_are_refused);
	tcase_add_test(linger, a_full_fd_table_still_gets_its_closer);
	/* 0: never read; 1: 100 ATTACHes each, then shut (the daemon closes the connection, and
	 * what is in flight to it stays in flight) */
	tcase_add_loop_test(linger, unread_replies_hold_a_share_of_fds_in_flight, 0, 2);
	tcase_add_test(linger, closers_are_bounded);
	tcase_add_test(linger, upgrade_passes_every_pending_close);
	tcase_add_test(linger, upgrade_with_unread_lingering_socket);
	suite_add_tcase(s, linger);
	tcase_add_checked_fixture(fuse, NULL, teardown);
	tcase_set_timeout(fuse, 120);
	tcase_add_test(fuse, stop_completes_with_close_stuck_in_fuse);
	tcase_add_test(fuse, upgrade_completes_with_close_stuck_in_fuse);
	tcase_add_test(fuse, upgrade_then_stop_with_close_stuck_in_fuse);
	suite_add_tcase(s, fuse);
	return run_suite(s);
}
