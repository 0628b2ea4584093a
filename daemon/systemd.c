/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The two systemd protocols dlpackd speaks, without libsystemd: socket activation (the listening
 * socket arrives as fd 3, described by LISTEN_PID and LISTEN_FDS) and readiness notification
 * (datagrams such as "READY=1" sent to the socket named by NOTIFY_SOCKET).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "base.h"
#include "systemd.h"

/* The first fd systemd passes (SD_LISTEN_FDS_START). */
#define LISTEN_FDS_START 3

/* The notification socket's address, taken from the environment once at start. */
static struct sockaddr_un notify_addr;
static socklen_t notify_len;

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

int dlpd_listen_fd(char *why, size_t len)
{
	const char *pid_env = getenv("LISTEN_PID"), *fds_env = getenv("LISTEN_FDS");
	char pid_buf[32], fds_buf[32];
	const char *pid_s = pid_env ? pid_buf : NULL, *fds_s = fds_env ? fds_buf : NULL;
	long long pid, nfds;
	int fd = LISTEN_FDS_START, v;
	socklen_t vlen = sizeof(v);
	struct stat st;

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
	if (!pid_s || !fds_s)
		return -ENOENT;
	if (pid < 0) {
		snprintf(why, len, "bad LISTEN_PID=%s", pid_s);
		return -EINVAL;
	}
	if (pid != (long long)getpid())
		return -ENOENT;
	/* LISTEN_FDS=0 passes nothing: not activated, as for sd_listen_fds() */
	if (nfds == 0)
		return -ENOENT;
	if (nfds != 1) {
		snprintf(why, len, "expected one socket from socket activation, got LISTEN_FDS=%s",
			 fds_s);
		return -EINVAL;
	}
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
	/* inherited fds come without these; ours are all close-on-exec and the loop needs
	 * non-blocking accepts */
	if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0 ||
	    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0) {
		snprintf(why, len, "cannot set up fd %d passed by socket activation: %s", fd,
			 strerror(errno));
		return -errno;
	}
	return fd;
}

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
	unsetenv("NOTIFY_SOCKET");
	return 0;
}

void dlpd_notify(const char *fmt, ...)
{
	char msg[256];
	va_list ap;
	int fd, n;

	if (!notify_len)
		return;
	va_start(ap, fmt);
	n = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= sizeof(msg))
		return;
	fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || sendto(fd, msg, (size_t)n, MSG_NOSIGNAL, (struct sockaddr *)&notify_addr,
			     notify_len) < 0)
		dlpd_log(LOG_WARNING, "cannot notify the service manager: %m");
	if (fd >= 0)
		close(fd);
}
