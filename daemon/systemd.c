/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The systemd protocols dlpackd speaks, without libsystemd: passed fds (from fd 3 on, described
 * by LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES: the listening socket of socket activation and
 * the fds kept in the fd store), and notification (datagrams such as "READY=1" sent to the
 * socket named by NOTIFY_SOCKET, with fds attached for FDSTORE=1).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include "base.h"
#include "systemd.h"

/* The first fd systemd passes (SD_LISTEN_FDS_START). */
#define LISTEN_FDS_START 3

/* The notification socket's address, taken from the environment once at start. */
static struct sockaddr_un notify_addr;
static socklen_t notify_len;
/* NOTIFY_SOCKET as it was given, for a re-executed image (upgrade.c) */
static char notify_env[sizeof(notify_addr.sun_path) + 1];

/* Parse a decimal number made of digits only; -1 if it is not one. */
static long long parse_decimal(const char *s)
{
	char *end;
	long long v;

	if (!s || *s < '0' || *s > '9')
		return -1;
	errno = 0;
	v = strtoll(s, &end, 10);
	return *end || errno ? -1 : v;
}

int dlpd_listen_check(int fd, char *why, size_t len)
{
	socklen_t vlen = sizeof(int);
	struct stat st;
	int v;

	if (fstat(fd, &st) < 0 || !S_ISSOCK(st.st_mode)) {
		snprintf(why, len, "fd %d passed by socket activation is not a socket", fd);
		return -ENOTSOCK;
	}
	if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &v, &vlen) < 0 || v != AF_UNIX) {
		snprintf(why, len, "fd %d passed by socket activation is not an AF_UNIX socket",
			 fd);
		return -EAFNOSUPPORT;
	}
	vlen = sizeof(v);
	if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &v, &vlen) < 0 || v != SOCK_STREAM) {
		snprintf(why, len, "fd %d passed by socket activation is not a stream socket", fd);
		return -ESOCKTNOSUPPORT;
	}
	vlen = sizeof(v);
	if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &v, &vlen) < 0 || !v) {
		snprintf(why, len, "fd %d passed by socket activation is not listening", fd);
		return -EINVAL;
	}
	/* the loop needs non-blocking accepts */
	if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0) {
		snprintf(why, len, "cannot set up fd %d passed by socket activation: %s", fd,
			 strerror(errno));
		return -errno;
	}
	return 0;
}

/* The @p i-th name of LISTEN_FDNAMES @p names (NULL: none given) into @p out: "unknown" where
 * none was given, as systemd says. */
static void fd_name(const char *names, long long i, char *out, size_t len)
{
	const char *p = names, *end;

	for (; p && i > 0; i--) {
		p = strchr(p, ':');
		p = p ? p + 1 : NULL;
	}
	if (!p) {
		snprintf(out, len, "unknown");
		return;
	}
	end = strchr(p, ':');
	snprintf(out, len, "%.*s", (int)(end ? (size_t)(end - p) : strlen(p)), p);
}

int dlpd_passed_fds(struct dlpd_passed_fd **ret, size_t *count, char *why, size_t len)
{
	const char *pid_env = getenv("LISTEN_PID"), *fds_env = getenv("LISTEN_FDS");
	char pid_buf[32], fds_buf[32];
	const char *pid_s = pid_env ? pid_buf : NULL, *fds_s = fds_env ? fds_buf : NULL;
	char *names = getenv("LISTEN_FDNAMES") ? strdup(getenv("LISTEN_FDNAMES")) : NULL;
	struct dlpd_passed_fd *v;
	long long pid, nfds;

	*ret = NULL;
	*count = 0;
	snprintf(pid_buf, sizeof(pid_buf), "%s", pid_env ? pid_env : "");
	snprintf(fds_buf, sizeof(fds_buf), "%s", fds_env ? fds_env : "");
	pid = parse_decimal(pid_s);
	nfds = parse_decimal(fds_s);
	/* never let these reach anything we might start, whatever they said */
	unsetenv("LISTEN_PID");
	unsetenv("LISTEN_FDS");
	unsetenv("LISTEN_FDNAMES");
	/* as with sd_listen_fds(): without LISTEN_PID, or with another process's (our parent's,
	 * say), the variables are not addressed to us */
	if (!pid_s || !fds_s) {
		free(names);
		return -ENOENT;
	}
	if (pid < 0) {
		snprintf(why, len, "bad LISTEN_PID=%s", pid_s);
		free(names);
		return -EINVAL;
	}
	if (pid != (long long)getpid()) {
		free(names);
		return -ENOENT;
	}
	if (nfds < 0 || nfds > DLPD_PASSED_FDS_MAX) {
		snprintf(why, len, "bad LISTEN_FDS=%s (0 to %d fds)", fds_s, DLPD_PASSED_FDS_MAX);
		free(names);
		return -EINVAL;
	}
	/* LISTEN_FDS=0 passes nothing: not activated, as for sd_listen_fds() */
	if (nfds == 0) {
		free(names);
		return -ENOENT;
	}
	v = calloc((size_t)nfds, sizeof(*v));
	if (!v) {
		snprintf(why, len, "out of memory for %lld passed fds", nfds);
		free(names);
		return -ENOMEM;
	}
	for (long long i = 0; i < nfds; i++) {
		int fd = LISTEN_FDS_START + (int)i;

		/* inherited fds come without close-on-exec; ours all have it */
		if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
			snprintf(why, len, "LISTEN_FDS=%s but fd %d is not open", fds_s, fd);
			/* those not open yet are no one's; those before are closed by the caller
			 * as it exits */
			free(v);
			free(names);
			return -EBADF;
		}
		v[i].fd = fd;
		fd_name(names, i, v[i].name, sizeof(v[i].name));
	}
	free(names);
	*ret = v;
	*count = (size_t)nfds;
	return 0;
}

static int notify_connect(void);

int dlpd_notify_init(void)
{
	const char *path = getenv("NOTIFY_SOCKET");
	size_t n;

	if (!path || !*path)
		return 0;
	n = strlen(path);
	/* a path needs room for its NUL; "@name" becomes "\0name", which needs none */
	if ((path[0] != '/' && path[0] != '@') ||
	    n > sizeof(notify_addr.sun_path) - (path[0] == '/')) {
		dlpd_log(LOG_WARNING, "ignoring NOTIFY_SOCKET=%s: not a socket path", path);
		unsetenv("NOTIFY_SOCKET");
		return -EINVAL;
	}
	notify_addr.sun_family = AF_UNIX;
	memcpy(notify_addr.sun_path, path, n);
	/* "@name" is the abstract address "\0name", whose length counts no terminating NUL */
	if (path[0] == '@')
		notify_addr.sun_path[0] = '\0';
	notify_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + (path[0] == '/'));
	snprintf(notify_env, sizeof(notify_env), "%s", path);
	unsetenv("NOTIFY_SOCKET");
	/* now, so that its socket is among the fds the daemon counts as its own when it starts
	 * serving (server.c); one that fails is tried again at the first send */
	(void)notify_connect();
	return 0;
}

/*
 * One datagram socket connected to the manager's, kept: a connected sender can wait for room in
 * the receiver's queue (a full one makes a send fail with EAGAIN, and poll() says when there is
 * room), where an unconnected one would block.
 */
static int notify_fd = -1;

static int notify_connect(void)
{
	int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);

	if (fd < 0)
		return -errno;
	if (connect(fd, (struct sockaddr *)&notify_addr, notify_len) < 0) {
		int r = -errno;

		close(fd);
		return r;
	}
	notify_fd = fd;
	return 0;
}

const char *dlpd_notify_socket(void)
{
	return notify_len ? notify_env : NULL;
}

/* One datagram now: 0, -EAGAIN when the manager's queue is full, or another negative errno. */
static int send_now(const char *msg, size_t len, const int *fds, size_t nfds)
{
	union {
		struct cmsghdr hdr;
		char buf[CMSG_SPACE(sizeof(int) * DLPD_NOTIFY_FDS_MAX)];
	} ctl;
	struct msghdr mh = {0};
	struct iovec iov = {.iov_base = (void *)msg, .iov_len = len};
	int r;

	mh.msg_iov = &iov;
	mh.msg_iovlen = 1;
	if (nfds) {
		struct cmsghdr *c;

		memset(&ctl, 0, sizeof(ctl));
		mh.msg_control = ctl.buf;
		mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
	}
	for (int tries = 0;; tries++) {
		if (notify_fd < 0) {
			r = notify_connect();
			if (r < 0)
				return r;
		}
		if (sendmsg(notify_fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT) >= 0)
			return 0;
		r = -errno;
		/* the manager made its socket anew: once more, on a fresh connection */
		if ((r == -ECONNREFUSED || r == -ENOTCONN) && tries == 0) {
			close(notify_fd);
			notify_fd = -1;
			continue;
		}
		if (r == -EINTR)
			continue;
		return r;
	}
}

/*
 * Notifications the manager's queue had no room for (it holds net.unix.max_dgram_qlen
 * datagrams, 10 by default), in the order they were made, each with its own copies of its fds:
 * sent by the loop's timer as the manager reads, and waited for at an upgrade and at stop. A
 * notification made while some wait joins them, so the manager sees every one in order.
 */
static int format(char *msg, size_t size, const char *fmt, va_list ap);
/* The longest notification the daemon sends (its status lines included). */
#define NOTIFY_MSG_MAX 256

struct queued {
	struct queued *next;
	size_t nfds, len;
	int fds[DLPD_NOTIFY_FDS_MAX];
	char msg[];
};
static struct queued *queue_head, **queue_tail = &queue_head;
static size_t queue_len, queue_fds;
static uv_timer_t queue_timer;
static bool timer_on, queue_closed;

static void queue_pop(void)
{
	struct queued *q = queue_head;

	queue_head = q->next;
	if (!queue_head)
		queue_tail = &queue_head;
	queue_len--;
	queue_fds -= q->nfds;
	for (size_t i = 0; i < q->nfds; i++)
		close(q->fds[i]);
	free(q);
}

/* The manager let a wait run out (dlpd_notify_settle()): no more waits until it catches up. */
static bool manager_slow;

static void on_queue_timer(uv_timer_t *t)
{
	(void)t;
	if (dlpd_notify_flush(0) == 0) {
		uv_timer_stop(&queue_timer);
		manager_slow = false;
	}
}

size_t dlpd_notify_settle(void)
{
	size_t left;

	if (!queue_head)
		return 0;
	left = dlpd_notify_flush(manager_slow ? 0 : DLPD_NOTIFY_WAIT_MS);
	if (left && !manager_slow)
		dlpd_log(LOG_WARNING,
			 "the service manager took no notification for %d ms; %zu wait for it, "
			 "and the daemon goes on without waiting until it catches up",
			 DLPD_NOTIFY_WAIT_MS, left);
	manager_slow = left > 0;
	return left;
}

static int queue_add(const char *msg, size_t len, const int *fds, size_t nfds)
{
	struct queued *q;

	if (queue_len >= DLPD_NOTIFY_QUEUE_MAX || queue_closed)
		return -ENOBUFS;
	q = malloc(sizeof(*q) + len);
	if (!q)
		return -ENOMEM;
	q->next = NULL;
	q->len = len;
	memcpy(q->msg, msg, len);
	for (q->nfds = 0; q->nfds < nfds; q->nfds++) {
		q->fds[q->nfds] = fcntl(fds[q->nfds], F_DUPFD_CLOEXEC, 3);
		if (q->fds[q->nfds] < 0) {
			int r = -errno;

			while (q->nfds > 0)
				close(q->fds[--q->nfds]);
			free(q);
			return r;
		}
	}
	*queue_tail = q;
	queue_tail = &q->next;
	queue_len++;
	queue_fds += q->nfds;
	if (timer_on && !uv_is_active((uv_handle_t *)&queue_timer))
		uv_timer_start(&queue_timer, on_queue_timer, DLPD_NOTIFY_RETRY_MS,
			       DLPD_NOTIFY_RETRY_MS);
	return 0;
}

size_t dlpd_notify_flush(int wait_ms)
{
	uint64_t deadline = dlpd_now_ms() + (uint64_t)(wait_ms > 0 ? wait_ms : 0);

	while (queue_head) {
		struct queued *q = queue_head;
		uint64_t now;
		int r = send_now(q->msg, q->len, q->fds, q->nfds);

		if (r == 0) {
			queue_pop();
			continue;
		}
		if (r != -EAGAIN) {
			/* the manager went away: this one cannot be told any more */
			dlpd_log(LOG_WARNING, "dropping a notification for the service manager: %s",
				 strerror(-r));
			queue_pop();
			continue;
		}
		now = dlpd_now_ms();
		if (now >= deadline)
			break;
		struct pollfd pfd = {.fd = notify_fd, .events = POLLOUT};

		poll(&pfd, 1, (int)(deadline - now));
	}
	return queue_len;
}

bool dlpd_notify_unqueue(const char *fmt, ...)
{
	char msg[NOTIFY_MSG_MAX];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = format(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (n < 0)
		return false;
	for (struct queued **pp = &queue_head; *pp; pp = &(*pp)->next) {
		struct queued *q = *pp;

		if (q->len != (size_t)n || memcmp(q->msg, msg, (size_t)n) != 0)
			continue;
		*pp = q->next;
		if (queue_tail == &q->next)
			queue_tail = pp;
		queue_len--;
		for (size_t i = 0; i < q->nfds; i++)
			close(q->fds[i]);
		free(q);
		return true;
	}
	return false;
}

size_t dlpd_notify_queued(void)
{
	return queue_len;
}

size_t dlpd_notify_queued_fds(void)
{
	return queue_fds;
}

void dlpd_notify_start(uv_loop_t *loop)
{
	uv_timer_init(loop, &queue_timer);
	timer_on = true;
	if (queue_head)
		uv_timer_start(&queue_timer, on_queue_timer, DLPD_NOTIFY_RETRY_MS,
			       DLPD_NOTIFY_RETRY_MS);
}

void dlpd_notify_stop(void)
{
	size_t left = dlpd_notify_flush(DLPD_NOTIFY_WAIT_MS);

	if (left)
		dlpd_log(LOG_WARNING,
			 "the service manager did not take %zu notifications within %d ms; "
			 "dropping them (storages among them are not in its fd store)",
			 left, DLPD_NOTIFY_WAIT_MS);
	while (queue_head)
		queue_pop();
	queue_closed = true;
	if (timer_on)
		uv_close((uv_handle_t *)&queue_timer, NULL);
	timer_on = false;
}

static int format(char *msg, size_t size, const char *fmt, va_list ap)
{
	int n = vsnprintf(msg, size, fmt, ap);

	return n < 0 || (size_t)n >= size ? -EMSGSIZE : n;
}

/* The notification of @p fmt into @p msg, if one can be sent with @p nfds fds: its length, or
 * a negative errno. */
static int prepare(char msg[NOTIFY_MSG_MAX], size_t nfds, const char *fmt, va_list ap)
{
	if (!notify_len)
		return -ENOTCONN;
	if (nfds > DLPD_NOTIFY_FDS_MAX)
		return -EINVAL;
	return format(msg, NOTIFY_MSG_MAX, fmt, ap);
}

int dlpd_notify_fds(const int *fds, size_t nfds, const char *fmt, ...)
{
	char msg[NOTIFY_MSG_MAX];
	va_list ap;
	int n, r;

	va_start(ap, fmt);
	n = prepare(msg, nfds, fmt, ap);
	va_end(ap);
	if (n < 0)
		return n;
	/* behind those waiting, never before them */
	if (!queue_head) {
		r = send_now(msg, (size_t)n, fds, nfds);
		if (r != -EAGAIN)
			return r;
	}
	return queue_add(msg, (size_t)n, fds, nfds);
}

int dlpd_notify_fds_now(const int *fds, size_t nfds, const char *fmt, ...)
{
	char msg[NOTIFY_MSG_MAX];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = prepare(msg, nfds, fmt, ap);
	va_end(ap);
	if (n < 0)
		return n;
	return queue_head ? -EAGAIN : send_now(msg, (size_t)n, fds, nfds);
}

void dlpd_notify(const char *fmt, ...)
{
	char msg[NOTIFY_MSG_MAX];
	va_list ap;
	int n, r;

	if (!notify_len)
		return;
	va_start(ap, fmt);
	n = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= sizeof(msg))
		return;
	r = dlpd_notify_fds(NULL, 0, "%s", msg);
	if (r < 0)
		dlpd_log(LOG_WARNING, "cannot notify the service manager: %s", strerror(-r));
}
