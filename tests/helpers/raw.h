/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A raw client for the hostile-input suites: frames written with the wire layer directly,
 * bypassing libdlpc, and a well-behaved libdlpc client that must stay unaffected meanwhile.
 */
#ifndef DLPC_TEST_RAW_H
#define DLPC_TEST_RAW_H

#include <stddef.h>
#include <stdint.h>

#include "harness.h"
#include "io.h"
#include "limits.h"
#include "msg.h"

/* A blocking connection to @p d's socket (no HELLO yet). */
int raw_connect(const struct daemon *d);
/* Send one frame of @p m declaring @p nfds fds and carrying exactly those. */
void raw_send(int fd, uint16_t type, uint32_t id, const ProtobufCMessage *m, const int *fds,
	      unsigned nfds);
/* Read the next frame: 1 and the payload copied into @p buf, or 0 when the daemon hung up. If
 * @p rfd is not NULL it receives the frame's first fd (or -1); other fds are closed. */
int raw_recv_fd(int fd, struct dlpc__hdr *h, uint8_t *buf, size_t cap, int *rfd);
int raw_recv(int fd, struct dlpc__hdr *h, uint8_t *buf, size_t cap);
/* HELLO with @p major, expecting the HELLO reply. */
void raw_hello(int fd, uint32_t major);
/* Expect an ERROR reply; returns its code and copies its message. */
int raw_error(int fd, char *msg, size_t len);
/* The daemon hangs up on @p fd (possibly after one ERROR reply); closes @p fd. */
void expect_dropped(int fd);
/* A memfd of @p size bytes with @p seals added (0: none), sealing allowed. */
int memfd_sealed(size_t size, int seals);
/*
 * PUBLISH @p ntensors float32 tensors of @p ndim dimensions of 1 element each, all at offset
 * 0, with @p storage as the fd. 0 and "published", or the error code and its message.
 */
int raw_publish(int fd, const char *name, size_t name_len, int storage, uint64_t size,
		uint32_t flags, size_t ntensors, size_t ndim, char *msg, size_t len);

/* CHANNEL JOIN of @p name on the raw connection @p fd (HELLO 1.8 first): the two ends of the
 * direct channel's pair in @p ends. Exits 1 (CHILD_CHECK) if it cannot. */
void raw_join_or_die(int fd, const char *name, int ends[2]);
/* CHANNEL JOIN of @p name on @p fd after HELLO: 0 and the pair in @p ends, or the ERROR's code
 * and its message in @p msg. Exits 1 (CHILD_CHECK) on anything else. */
int raw_join_again(int fd, const char *name, int ends[2], char *msg, size_t len);
/* A direct channel's record of a 4096-byte storage holding one float32 tensor of 4 elements. */
void raw_small_record(uint8_t rec[DLPC_DIRECT_RECORD]);

/* A well-behaved client holding a reference across the abuse ("good", 256 bytes 0..255). */
void good_client_start(const struct daemon *d);
/* Its reference still reads right, and a publish/attach round trip works. */
void good_client_check(void);
/* Wait until the daemon has closed what the offenders left, then insist on @p baseline fds. */
void expect_fds(int baseline);
/* The good client's connection (to STAT with). */
dlpc_client *good_client(void);
void good_client_stop(void);
/* The daemon's fd count once only the good client is connected and nothing is closing. */
int good_baseline(void);

#endif
