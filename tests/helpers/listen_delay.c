/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A test double that test_service preloads into dlpackd (LD_PRELOAD): listen() first waits
 * DLPC_TEST_LISTEN_DELAY_MS milliseconds, so that a socket bound but not yet listening stays
 * so long enough for any client that looks to find it.
 */
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>

__attribute__((visibility("default"))) int listen(int fd, int backlog)
{
	int (*real)(int, int) = (int (*)(int, int))dlsym(RTLD_NEXT, "listen");
	const char *ms = getenv("DLPC_TEST_LISTEN_DELAY_MS");

	if (ms) {
		long v = atol(ms);
		struct timespec ts = {.tv_sec = v / 1000, .tv_nsec = v % 1000 * 1000000L};

		nanosleep(&ts, NULL);
	}
	return real ? real(fd, backlog) : -1;
}
