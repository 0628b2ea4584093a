/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers for the wire-layer unit suites (test_frame.c, test_io.c). */
#ifndef DLPC_TEST_WIRE_H
#define DLPC_TEST_WIRE_H

#include <stdbool.h>
#include <stddef.h>

#include "harness.h"
#include "io.h"

/* Checked fixture: remember the process's fd count, and insist on it when the test is done. */
void fd_setup(void);
void fd_teardown(void);
/* A connected AF_UNIX stream pair, CLOEXEC, optionally non-blocking on both ends. */
void pair_open(int sv[2], bool nonblock);
void pair_close(const int sv[2]);
/*
 * Read from @p sock until the next frame is complete. Returns dlpc__rx_next()'s verdict (1 or a
 * negative errno), 0 at end of stream, or dlpc__rx_read()'s error.
 */
int rx_frame(struct dlpc__rx *rx, int sock, struct dlpc__frame *f, char *why, size_t whylen);

#endif
