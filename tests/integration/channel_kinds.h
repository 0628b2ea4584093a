/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The channel suites (test_channel.c: queued channels, test_direct.c: direct ones) share one
 * set of tests, written once for both kinds (channel_kinds.c): each suite runs them for its
 * kind, as Check loop tests whose _i is the kind, and adds what only its kind has.
 *
 * Names: a shared test's channels are named "q/..." on a queued channel, "d/..." on a direct
 * one (CH()), so that a log or a failure says which kind it was.
 */
#ifndef DLPC_TEST_CHANNEL_KINDS_H
#define DLPC_TEST_CHANNEL_KINDS_H

#include <fcntl.h>

#include "raw.h"

enum chan_kind { QUEUED, DIRECT, CHAN_KINDS };

/* The kind the running test is about (set by each shared test from _i; a forked child has it). */
extern enum chan_kind kind;

/* The channel @p base of the running test's kind, and the same in quotes as messages say it. */
#define CH(base) (kind == DIRECT ? "d/" base : "q/" base)
#define QUOTED(base) (kind == DIRECT ? "'d/" base "'" : "'q/" base "'")

/* The daemon of the suite's fixture. */
extern struct daemon D;
void channel_setup(void);
void channel_teardown(void);
/* In a child: a connection to D, or exit 1. */
dlpc_client *child_connect(void);

/* Open @p name as a channel of the running test's kind (a queued one with dlpc_channel_open(),
 * a direct one asking for DLPC_CHANNEL_DIRECT); dlpc_channel_open*()'s result. */
int open_kind(dlpc_client *c, const char *name, uint32_t capacity, dlpc_channel_info *info);
/* Send a vector of @p n int64 holding v, v+1, ... to @p ch; dlpc_send_bundle()'s result. */
int send_value(dlpc_client *c, const char *ch, int64_t v, int64_t n, uint32_t flags,
	       int64_t timeout_ms);
/* Receive one message of @p ch: its first value into *@p v, its length into *@p n if not NULL;
 * the tensor into *@p keep if not NULL (else released). dlpc_recv()'s result, or -EILSEQ when
 * its elements are not v, v+1, ... as sent. */
int recv_value(dlpc_client *c, const char *ch, int64_t timeout_ms, int64_t *v, int64_t *n,
	       DLManagedTensorVersioned **keep);
/* wait_stat() condition: *arg storages, and no message or reference left. */
bool storages_are(const dlpc_stats *s, void *arg);

/* fds and mappings, in this process and its descendants, of memfds libdlpc made for the
 * direct channel @p ch ("dlpc:CH"). */
int memfds_held(const char *ch);
/* Poll until memfds_held(@p ch) is @p want; whether it got there. */
bool memfds_reach(const char *ch, int want);
/* Wait until the main thread of @p pid sits in poll(): a libdlpc call waiting on a direct
 * channel's end (a child's earlier calls are done by then); whether it got there. */
bool waits_in_poll(pid_t pid);

/* Read one frame with every fd it carries (at most 4) into @p fds; how many came. */
unsigned raw_recv_all(int fd, struct dlpc__hdr *h, uint8_t *buf, size_t cap, int fds[4]);
/* The code of the ERROR frame @p buf of @p len bytes; its message into @p msg. */
int error_code(const uint8_t *buf, size_t len, char *msg, size_t msglen);
/* CHANNEL JOIN of @p name on the raw connection @p fd: 0 and the two ends, -1 for a reply
 * without them (a queued channel, 1.10), or the error code (and its message in @p msg). */
int raw_join(int fd, const char *name, int ends[2], char *msg, size_t len);
/* A SEND to @p ch of one float32 of @p storage (@p nfds fds of it), with @p edit applied to
 * the request first (NULL: none); the daemon's error code (0: admitted) and message. -1: it
 * hung up. */
int raw_send_msg(int fd, const char *ch, int storage, unsigned nfds,
		 void (*edit)(Dlpackd__V1__Send *), char *msg, size_t len);
/* Seals of a memfd a read-only entry or message accepts. */
#define SEALS_RO (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL | F_SEAL_WRITE)
/* Records queued in a direct channel's receiving end @p rx. */
int queued(int rx);

/* The suite @p name for channels of kind @p k: a test case of that name with D as its fixture
 * (*@p tc) and one without (*@p plain, for tests that start daemons of their own), both
 * holding the shared tests for @p k. The caller adds its kind's own tests to them. */
Suite *channel_suite(const char *name, enum chan_kind k, TCase **tc, TCase **plain);

#endif
