/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers for the wire-layer unit suites: socketpairs, frames, and an fd-leak fixture. */
#include <errno.h>
#include <sys/socket.h>
#include <unistd.h>

#include "wire.h"

static int fd_base;

void fd_setup(void)
{
	fd_base = fd_count(getpid());
}

void fd_teardown(void)
{
	ck_assert_int_eq(fd_count(getpid()), fd_base);
}

void pair_open(int sv[2], bool nonblock)
{
	int type = SOCK_STREAM | SOCK_CLOEXEC | (nonblock ? SOCK_NONBLOCK : 0);

	ck_assert_int_eq(socketpair(AF_UNIX, type, 0, sv), 0);
}

void pair_close(const int sv[2])
{
	ck_assert_int_eq(close(sv[0]), 0);
	ck_assert_int_eq(close(sv[1]), 0);
}

int rx_frame(struct dlpc__rx *rx, int sock, struct dlpc__frame *f, char *why, size_t whylen)
{
	for (;;) {
		int r = dlpc__rx_next(rx, f, why, whylen);
		ssize_t n;

		if (r != 0)
			return r;
		n = dlpc__rx_read(rx, sock, why, whylen);
		if (n <= 0)
			return (int)n;
	}
}
