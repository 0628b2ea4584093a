/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Unit suite for the byte and fd buffers of proto/io.c (rx and tx), over real AF_UNIX stream
 * socketpairs. Every test checks that the process holds as many fds at its end as at its start.
 */
#include <check.h>
#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "wire.h"
#include "frame.h"
#include "io.h"
#include "limits.h"

#define HDR DLPC_FRAME_HDR_SIZE
#define FDS_MAX DLPC_FRAME_FDS_MAX

/* ---- helpers ---- */

/* Header + payload into @p buf; returns the frame's total length. */
static size_t frame_build(uint8_t *buf, uint16_t type, uint32_t id, uint8_t nfds,
			  const void *payload, uint32_t len)
{
	struct dlpc__hdr h = {.len = len, .type = type, .nfds = nfds, .id = id};

	dlpc__hdr_encode(buf, &h);
	if (len > 0)
		memcpy(buf + HDR, payload, len);
	return HDR + (size_t)len;
}

/* One raw sendmsg() with any number of fds (the library's own sender caps them at FDS_MAX). */
static void send_raw(int sock, const void *data, size_t len, const int *fds, unsigned nfds)
{
	ck_assert_int_eq(send_fds_raw(sock, data, len, fds, nfds), (ssize_t)len);
}

/* A fresh memfd: each has its own inode, so received fds can be matched to the sent ones. */
static int memfd_new(void)
{
	int fd = memfd_create("test_io", MFD_CLOEXEC);

	ck_assert_int_ge(fd, 0);
	return fd;
}

static ino_t ino_of(int fd)
{
	struct stat st;

	ck_assert_int_eq(fstat(fd, &st), 0);
	return st.st_ino;
}

/* Do two fds refer to the same open file (same device and inode)? */
static bool same_file(int a, int b)
{
	struct stat sa, sb;

	ck_assert_int_eq(fstat(a, &sa), 0);
	ck_assert_int_eq(fstat(b, &sb), 0);
	return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

static bool is_cloexec(int fd)
{
	int fl = fcntl(fd, F_GETFD);

	ck_assert_int_ge(fl, 0);
	return fl & FD_CLOEXEC;
}

/* A payload that tells frames (and offsets inside one) apart. */
static void pattern(uint8_t *p, size_t len, uint32_t id)
{
	for (size_t i = 0; i < len; i++)
		p[i] = (uint8_t)(id * 131 + i * 7 + (i >> 9));
}

static bool pattern_ok(const uint8_t *p, size_t len, uint32_t id)
{
	for (size_t i = 0; i < len; i++)
		if (p[i] != (uint8_t)(id * 131 + i * 7 + (i >> 9)))
			return false;
	return true;
}

/* ---- rx: receiving frames and fds ---- */

/* A frame whose first byte brings an fd, then a frame without fds, each sent a byte at a time. */
START_TEST(test_rx_byte_by_byte)
{
	static const char text[] = "reassembled one byte at a time";
	uint8_t a[HDR + sizeof(text)], b[HDR + 3];
	size_t alen = frame_build(a, DLPC_MSG_PUBLISH, 42, 1, text, sizeof(text));
	size_t blen = frame_build(b, DLPC_MSG_STAT, 43, 0, "xyz", 3);
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256];
	int sv[2], memfd = memfd_new();

	pair_open(sv, false);
	dlpc__rx_init(&rx);
	ck_assert(!dlpc__rx_partial(&rx));

	for (size_t i = 0; i < alen; i++) {
		if (i == 0)
			send_raw(sv[0], a, 1, &memfd, 1);
		else
			ck_assert_int_eq(write(sv[0], a + i, 1), 1);
		ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), 1);
		if (i + 1 < alen) {
			ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 0);
			ck_assert(dlpc__rx_partial(&rx));
		}
	}
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.type, DLPC_MSG_PUBLISH);
	ck_assert_uint_eq(f.hdr.id, 42);
	ck_assert_uint_eq(f.hdr.len, sizeof(text));
	ck_assert_mem_eq(f.payload, text, sizeof(text));
	ck_assert_uint_eq(f.nfds, 1);
	ck_assert(same_file(f.fds[0], memfd));
	dlpc__frame_clear(&f);
	ck_assert(!dlpc__rx_partial(&rx));
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 0);

	for (size_t i = 0; i < blen; i++) {
		ck_assert_int_eq(write(sv[0], b + i, 1), 1);
		ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), 1);
		if (i + 1 < blen)
			ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 0);
	}
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.type, DLPC_MSG_STAT);
	ck_assert_uint_eq(f.hdr.id, 43);
	ck_assert_uint_eq(f.nfds, 0);
	ck_assert_mem_eq(f.payload, "xyz", 3);
	ck_assert(!dlpc__rx_partial(&rx));

	dlpc__rx_clear(&rx);
	close(memfd);
	pair_close(sv);
}
END_TEST

/* Several frames (one of them empty) in one write come out one by one, in order. */
START_TEST(test_rx_many_in_one_write)
{
	static const uint32_t lens[] = {0, 1, 100, 0, 4000, 7};
	enum { N = sizeof(lens) / sizeof(lens[0]) };
	uint8_t buf[N * HDR + 4200], payload[4000];
	struct dlpc__frame f;
	struct dlpc__rx rx;
	size_t len = 0;
	char why[256];
	int sv[2];

	for (uint32_t i = 0; i < N; i++) {
		pattern(payload, lens[i], i);
		len += frame_build(buf + len, DLPC_MSG_LIST, 1000 + i, 0, payload, lens[i]);
	}
	pair_open(sv, false);
	ck_assert_int_eq(write(sv[0], buf, len), (ssize_t)len);

	dlpc__rx_init(&rx);
	for (uint32_t i = 0; i < N; i++) {
		ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
		ck_assert_uint_eq(f.hdr.id, 1000 + i);
		ck_assert_uint_eq(f.hdr.type, DLPC_MSG_LIST);
		ck_assert_uint_eq(f.hdr.len, lens[i]);
		ck_assert_uint_eq(f.nfds, 0);
		ck_assert(pattern_ok(f.payload, lens[i], i));
	}
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 0);
	ck_assert(!dlpc__rx_partial(&rx));
	dlpc__rx_clear(&rx);
	pair_close(sv);
}
END_TEST

/* A frame carrying 1..FDS_MAX fds delivers exactly those, CLOEXEC, in order. */
START_TEST(test_rx_fds)
{
	unsigned n = (unsigned)_i + 1;
	int fds[FDS_MAX], sv[2], taken, before;
	uint8_t buf[HDR + 1];
	size_t len = frame_build(buf, DLPC_MSG_REPLY | DLPC_MSG_ATTACH, 9, (uint8_t)n, "!", 1);
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256];

	for (unsigned i = 0; i < n; i++)
		fds[i] = memfd_new();
	pair_open(sv, false);
	ck_assert_int_eq(dlpc__send_all(sv[0], buf, len, fds, n), 0);

	before = fd_count(getpid());
	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.nfds, n);
	ck_assert_uint_eq(f.nfds, n);
	ck_assert_int_eq(fd_count(getpid()), before + (int)n);
	for (unsigned i = 0; i < n; i++) {
		ck_assert_int_ge(f.fds[i], 0);
		ck_assert(same_file(f.fds[i], fds[i]));
		ck_assert(is_cloexec(f.fds[i]));
		for (unsigned k = 0; k < i; k++)
			ck_assert(ino_of(fds[k]) != ino_of(fds[i]));
	}
	ck_assert(!dlpc__rx_partial(&rx));

	/* Take the last one; clearing the frame closes only the others. */
	taken = dlpc__frame_take_fd(&f, n - 1);
	ck_assert_int_eq(f.fds[n - 1], -1);
	dlpc__frame_clear(&f);
	ck_assert_uint_eq(f.nfds, 0);
	ck_assert_int_eq(fd_count(getpid()), before + 1);
	ck_assert(same_file(taken, fds[n - 1]));
	dlpc__frame_clear(&f);
	ck_assert_int_eq(close(taken), 0);
	ck_assert_int_eq(fd_count(getpid()), before);

	dlpc__rx_clear(&rx);
	for (unsigned i = 0; i < n; i++)
		close(fds[i]);
	pair_close(sv);
}
END_TEST

/*
 * fds that arrive while earlier bytes still sit unparsed in the buffer still go to their own
 * frame: everything is read before anything is parsed.
 */
START_TEST(test_rx_fds_behind_buffered_bytes)
{
	uint8_t a[HDR + 100], b[HDR + 4], c[HDR + 4], payload[100];
	size_t alen, blen, clen;
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2], fds[3] = {memfd_new(), memfd_new(), memfd_new()}, before, reads = 0;
	ssize_t n;

	pattern(payload, sizeof(payload), 1);
	alen = frame_build(a, DLPC_MSG_LIST, 1, 0, payload, sizeof(payload));
	blen = frame_build(b, DLPC_MSG_PUBLISH, 2, 1, "bbbb", 4);
	clen = frame_build(c, DLPC_MSG_PUBLISH, 3, 2, "cccc", 4);
	pair_open(sv, true);
	dlpc__rx_init(&rx);

	/* Part of A is read and left unparsed... */
	ck_assert_int_eq(write(sv[0], a, 60), 60);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), 60);
	/* ...then the rest of A, B with one fd and C with two all arrive before any parsing. */
	ck_assert_int_eq(write(sv[0], a + 60, alen - 60), (ssize_t)(alen - 60));
	send_raw(sv[0], b, blen, &fds[0], 1);
	send_raw(sv[0], c, clen, &fds[1], 2);
	before = fd_count(getpid());
	while ((n = dlpc__rx_read(&rx, sv[1], why, sizeof(why))) > 0)
		reads++;
	ck_assert_msg(n == -EAGAIN, "rx_read: %zd (%s)", n, why);
	ck_assert_int_ge(reads, 2);
	ck_assert_int_eq(fd_count(getpid()), before + 3);

	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.id, 1);
	ck_assert_uint_eq(f.nfds, 0);
	ck_assert(pattern_ok(f.payload, sizeof(payload), 1));
	ck_assert_msg(dlpc__rx_next(&rx, &f, why, sizeof(why)) == 1, "B: %s", why);
	ck_assert_uint_eq(f.hdr.id, 2);
	ck_assert_uint_eq(f.nfds, 1);
	ck_assert(same_file(f.fds[0], fds[0]));
	dlpc__frame_clear(&f);
	ck_assert_msg(dlpc__rx_next(&rx, &f, why, sizeof(why)) == 1, "C: %s", why);
	ck_assert_uint_eq(f.hdr.id, 3);
	ck_assert_uint_eq(f.nfds, 2);
	ck_assert(same_file(f.fds[0], fds[1]));
	ck_assert(same_file(f.fds[1], fds[2]));
	dlpc__frame_clear(&f);
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 0);
	ck_assert(!dlpc__rx_partial(&rx));
	ck_assert_int_eq(fd_count(getpid()), before);

	dlpc__rx_clear(&rx);
	for (int i = 0; i < 3; i++)
		close(fds[i]);
	pair_close(sv);
}
END_TEST

/* A frame that declares 2 fds but brings 1 is a protocol error; clearing rx closes the one. */
START_TEST(test_rx_missing_fd)
{
	uint8_t buf[HDR + 4];
	size_t len = frame_build(buf, DLPC_MSG_PUBLISH, 5, 2, "data", 4);
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2], memfd = memfd_new(), before;

	pair_open(sv, false);
	send_raw(sv[0], buf, len, &memfd, 1);
	before = fd_count(getpid());
	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), -EPROTO);
	ck_assert_ptr_nonnull(strstr(why, "declares 2 fds"));
	ck_assert_int_eq(fd_count(getpid()), before + 1);
	ck_assert(dlpc__rx_partial(&rx));
	dlpc__rx_clear(&rx);
	ck_assert_int_eq(fd_count(getpid()), before);
	ck_assert(!dlpc__rx_partial(&rx));

	close(memfd);
	pair_close(sv);
}
END_TEST

/* A frame that declares fds but arrives with none is a protocol error too. */
START_TEST(test_rx_no_fd)
{
	uint8_t buf[HDR];
	size_t len = frame_build(buf, DLPC_MSG_PUBLISH, 5, 1, NULL, 0);
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2];

	pair_open(sv, false);
	ck_assert_int_eq(write(sv[0], buf, len), (ssize_t)len);
	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), -EPROTO);
	ck_assert_ptr_nonnull(strstr(why, "declares 1 fds but 0 arrived"));
	dlpc__rx_clear(&rx);
	pair_close(sv);
}
END_TEST

/* A frame that brings more fds than it declares is a protocol error as well. */
START_TEST(test_rx_extra_fd)
{
	uint8_t buf[HDR + 4];
	size_t len = frame_build(buf, DLPC_MSG_PUBLISH, 5, 1, "data", 4);
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2], fds[2] = {memfd_new(), memfd_new()}, before;

	pair_open(sv, false);
	send_raw(sv[0], buf, len, fds, 2);
	before = fd_count(getpid());
	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), -EPROTO);
	ck_assert_ptr_nonnull(strstr(why, "declares 1 fds but 2 arrived"));
	ck_assert_int_eq(fd_count(getpid()), before + 2);
	dlpc__rx_clear(&rx);
	ck_assert_int_eq(fd_count(getpid()), before);

	close(fds[0]);
	close(fds[1]);
	pair_close(sv);
}
END_TEST

/*
 * fds that ride on a frame declaring none belong to no frame: rejected before the next frame is
 * handed out, even when that one declares an fd and brings its own.
 */
START_TEST(test_rx_fds_without_frame)
{
	uint8_t a[HDR + 2], b[HDR + 2];
	size_t alen = frame_build(a, DLPC_MSG_LIST, 1, 0, "aa", 2);
	size_t blen = frame_build(b, DLPC_MSG_PUBLISH, 2, (uint8_t)_i, "bb", 2);
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2], stray = memfd_new(), own = memfd_new(), before;

	pair_open(sv, false);
	send_raw(sv[0], a, alen, &stray, 1);
	send_raw(sv[0], b, blen, &own, (unsigned)_i);
	before = fd_count(getpid());

	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.id, 1);
	ck_assert_uint_eq(f.nfds, 0);
	/* The stray fd is still queued, so the stream is not at a clean boundary. */
	ck_assert(dlpc__rx_partial(&rx));
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), -EPROTO);
	ck_assert_ptr_nonnull(strstr(why, "arrived without a frame"));

	/* Take in whatever else came (B's bytes and fd) so that rx_clear has it all to close. */
	ck_assert_int_eq(fcntl(sv[1], F_SETFL, O_NONBLOCK), 0);
	while (dlpc__rx_read(&rx, sv[1], why, sizeof(why)) > 0)
		;
	dlpc__rx_clear(&rx);
	ck_assert_int_eq(fd_count(getpid()), before);

	close(stray);
	close(own);
	pair_close(sv);
}
END_TEST

/* More fds in one sendmsg than a frame may carry: all arrive (none is dropped by the kernel in
 * this thread, where the last close of one could block), are closed, and the read fails. */
START_TEST(test_rx_too_many_fds)
{
	static const unsigned counts[] = {FDS_MAX + 1, 2 * FDS_MAX, 3 * FDS_MAX + 1};
	unsigned n = counts[_i];
	int fds[3 * FDS_MAX + 1], sv[2], before;
	uint8_t buf[HDR + 1];
	size_t len = frame_build(buf, DLPC_MSG_PUBLISH, 3, FDS_MAX, "x", 1);
	struct dlpc__rx rx;
	char why[256] = "";

	for (unsigned i = 0; i < n; i++)
		fds[i] = memfd_new();
	pair_open(sv, false);
	send_raw(sv[0], buf, len, fds, n);
	before = fd_count(getpid());

	dlpc__rx_init(&rx);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), -EPROTO);
	ck_assert_ptr_nonnull(strstr(why, "more than 4 fds in one message"));
	ck_assert_int_eq(fd_count(getpid()), before);
	ck_assert_uint_eq(rx.nbatch, 0);
	dlpc__rx_clear(&rx);

	for (unsigned i = 0; i < n; i++)
		close(fds[i]);
	pair_close(sv);
}
END_TEST

/*
 * A receiver that has room for one fd when a frame brings two: the kernel installs the first,
 * cannot install the second and sets MSG_CTRUNC with room to spare in the control buffer. With
 * report_lost_fds (libdlpc) the fd that came is closed, the frame arrives with lost = 2 and the
 * stream goes on with the next frame; without it (the daemon) the read is a protocol violation,
 * as it always was.
 */
START_TEST(test_rx_fds_lost)
{
	bool report = _i;
	uint8_t a[HDR + 3], b[HDR + 3];
	size_t alen = frame_build(a, DLPC_MSG_ATTACH | DLPC_MSG_REPLY, 7, 2, "abc", 3);
	size_t blen = frame_build(b, DLPC_MSG_STAT | DLPC_MSG_REPLY, 8, 0, "xyz", 3);
	int fds[2] = {memfd_new(), memfd_new()}, sv[2], fill[64], nfill = 0, before;
	struct rlimit rl, low;
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	ssize_t n;

	pair_open(sv, false);
	send_raw(sv[0], a, alen, fds, 2);
	send_raw(sv[0], b, blen, NULL, 0);
	close(fds[0]);
	close(fds[1]);
	before = fd_count(getpid());
	dlpc__rx_init(&rx);
	rx.report_lost_fds = report;

	/* fill the fd table up to a soft limit of 64, then free one slot */
	ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
	low = rl;
	low.rlim_cur = 64;
	ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
	for (int fd; (fd = dup(sv[0])) >= 0;) {
		ck_assert_int_lt(nfill, 64);
		fill[nfill++] = fd;
	}
	ck_assert_int_eq(errno, EMFILE);
	close(fill[--nfill]);
	n = dlpc__rx_read(&rx, sv[1], why, sizeof(why));
	while (nfill > 0)
		close(fill[--nfill]);
	ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &rl), 0);
	/* either way, the one fd that was installed is closed again */
	ck_assert_int_eq(fd_count(getpid()), before);

	if (!report) {
		ck_assert_int_eq(n, -EPROTO);
		ck_assert_ptr_nonnull(strstr(why, "truncated"));
		ck_assert_uint_eq(rx.nbatch, 0);
	} else {
		ck_assert_int_eq(n, (ssize_t)alen);
		ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 1);
		ck_assert_uint_eq(f.hdr.id, 7);
		ck_assert_uint_eq(f.nfds, 0);
		ck_assert_uint_eq(f.lost, 2);
		ck_assert_mem_eq(f.payload, "abc", 3);
		dlpc__frame_clear(&f);
		/* the stream is intact: the next frame follows, with nothing lost */
		ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
		ck_assert_uint_eq(f.hdr.id, 8);
		ck_assert_uint_eq(f.lost, 0);
		ck_assert_mem_eq(f.payload, "xyz", 3);
		dlpc__frame_clear(&f);
		ck_assert(!dlpc__rx_partial(&rx));
	}
	dlpc__rx_clear(&rx);
	ck_assert(rx.report_lost_fds == report);
	pair_close(sv);
}
END_TEST

/* fd batches that pile up without frames claiming them: the third read is refused. */
START_TEST(test_rx_fds_pile_up)
{
	static const uint8_t byte = 0;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2], memfd = memfd_new(), before;

	ck_assert_int_eq(DLPC_RX_BATCH_MAX, 2);
	pair_open(sv, false);
	for (int i = 0; i < 3; i++)
		send_raw(sv[0], &byte, 1, &memfd, 1);
	before = fd_count(getpid());

	dlpc__rx_init(&rx);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), 1);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), 1);
	ck_assert_int_eq(fd_count(getpid()), before + 2);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), -EPROTO);
	ck_assert_ptr_nonnull(strstr(why, "faster than frames"));
	ck_assert_int_eq(fd_count(getpid()), before + 2);
	dlpc__rx_clear(&rx);
	ck_assert_int_eq(fd_count(getpid()), before);

	close(memfd);
	pair_close(sv);
}
END_TEST

/* An oversized length is refused from the header alone, before the buffer grows for it. */
START_TEST(test_rx_oversized)
{
	static const uint32_t lens[] = {DLPC_FRAME_MAX + 1, 1u << 31, UINT32_MAX};
	uint8_t buf[HDR];
	size_t len = frame_build(buf, DLPC_MSG_PUBLISH, 1, 0, NULL, 0);
	struct dlpc__hdr h = {.len = lens[_i], .type = DLPC_MSG_PUBLISH, .id = 1};
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2];

	dlpc__hdr_encode(buf, &h);
	pair_open(sv, true);
	ck_assert_int_eq(write(sv[0], buf, len), (ssize_t)len);
	dlpc__rx_init(&rx);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), HDR);
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), -EMSGSIZE);
	ck_assert_ptr_nonnull(strstr(why, "exceeds the limit"));
	ck_assert_uint_le(rx.cap, DLPC_RX_BUF_SIZE);
	ck_assert_uint_eq(rx.want, HDR);
	/* A caller that keeps reading does not trigger the allocation either. */
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), -EAGAIN);
	ck_assert_uint_le(rx.cap, DLPC_RX_BUF_SIZE);
	dlpc__rx_clear(&rx);
	pair_close(sv);
}
END_TEST

/* A header at exactly DLPC_FRAME_MAX is accepted and waits for its payload. */
START_TEST(test_rx_max_header_waits)
{
	struct dlpc__hdr h = {.len = DLPC_FRAME_MAX, .type = DLPC_MSG_PUBLISH, .id = 1};
	uint8_t buf[HDR];
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2];

	dlpc__hdr_encode(buf, &h);
	pair_open(sv, true);
	ck_assert_int_eq(write(sv[0], buf, HDR), HDR);
	dlpc__rx_init(&rx);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), HDR);
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 0);
	ck_assert_uint_eq(rx.want, HDR + (size_t)DLPC_FRAME_MAX);
	ck_assert(dlpc__rx_partial(&rx));
	dlpc__rx_clear(&rx);
	pair_close(sv);
}
END_TEST

/*
 * rx.cap_max: a read that needs a larger buffer fails with -EDQUOT and reads nothing; one that
 * fits is served, in a buffer smaller than DLPC_RX_BUF_SIZE if that is all it allows; raised,
 * the frame comes whole; dlpc__rx_release() frees a drained buffer and keeps one holding part
 * of a frame.
 */
START_TEST(test_rx_cap_max)
{
	static uint8_t buf[2 * HDR + 4096];
	uint8_t payload[4096];
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	size_t len;
	int sv[2];

	pattern(payload, sizeof(payload), 7);
	len = frame_build(buf, DLPC_MSG_PUBLISH, 7, 0, payload, sizeof(payload));
	pair_open(sv, true);
	ck_assert_int_eq(write(sv[0], buf, len), (ssize_t)len);
	dlpc__rx_init(&rx);
	ck_assert_uint_eq(rx.cap_max, SIZE_MAX);
	/* room for the header alone: it is read, the payload is refused */
	rx.cap_max = HDR;
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), HDR);
	ck_assert_uint_eq(rx.cap, HDR);
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 0);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), -EDQUOT);
	ck_assert_uint_eq(rx.cap, HDR);
	/* held part of a frame: release keeps it */
	dlpc__rx_release(&rx);
	ck_assert_ptr_nonnull(rx.buf);
	rx.cap_max = HDR + sizeof(payload);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), (ssize_t)sizeof(payload));
	ck_assert_uint_eq(rx.cap, HDR + sizeof(payload));
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 1);
	ck_assert(pattern_ok(f.payload, sizeof(payload), 7));
	dlpc__frame_clear(&f);
	/* drained: release frees it, and the next read allocates DLPC_RX_BUF_SIZE again */
	dlpc__rx_release(&rx);
	ck_assert_ptr_null(rx.buf);
	ck_assert_uint_eq(rx.cap, 0);
	ck_assert_int_eq(write(sv[0], buf, len), (ssize_t)len);
	rx.cap_max = SIZE_MAX;
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), (ssize_t)len);
	ck_assert_uint_eq(rx.cap, DLPC_RX_BUF_SIZE);
	ck_assert_int_eq(dlpc__rx_next(&rx, &f, why, sizeof(why)), 1);
	dlpc__frame_clear(&f);
	dlpc__rx_clear(&rx);
	pair_close(sv);
}
END_TEST

/* Too many fds or nonzero flags in a header: -EPROTO before the payload is awaited. */
START_TEST(test_rx_bad_header)
{
	struct dlpc__hdr h = {.len = 100, .type = DLPC_MSG_PUBLISH, .id = 1};
	uint8_t buf[HDR];
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2];

	if (_i == 0)
		h.nfds = FDS_MAX + 1;
	else
		h.flags = 1;
	dlpc__hdr_encode(buf, &h);
	pair_open(sv, false);
	ck_assert_int_eq(write(sv[0], buf, HDR), HDR);
	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), -EPROTO);
	ck_assert_ptr_nonnull(strstr(why, "bad frame header"));
	dlpc__rx_clear(&rx);
	pair_close(sv);
}
END_TEST

/* End of stream inside a frame (with its fd queued) leaves rx partial; rx_clear closes the fd. */
START_TEST(test_rx_eof_mid_frame)
{
	uint8_t buf[HDR + 64], payload[64];
	size_t len;
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2], memfd = memfd_new(), before;

	pattern(payload, sizeof(payload), 7);
	len = frame_build(buf, DLPC_MSG_PUBLISH, 7, 1, payload, sizeof(payload));
	pair_open(sv, false);
	send_raw(sv[0], buf, len - 10, &memfd, 1);
	ck_assert_int_eq(shutdown(sv[0], SHUT_WR), 0);
	before = fd_count(getpid());

	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 0);
	ck_assert(dlpc__rx_partial(&rx));
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), 0);
	ck_assert_int_eq(fd_count(getpid()), before + 1);
	dlpc__rx_clear(&rx);
	ck_assert(!dlpc__rx_partial(&rx));
	ck_assert_int_eq(fd_count(getpid()), before);

	close(memfd);
	pair_close(sv);
}
END_TEST

/* End of stream inside a header, and at a frame boundary. */
START_TEST(test_rx_eof_boundaries)
{
	uint8_t buf[HDR + 2];
	size_t len = frame_build(buf, DLPC_MSG_STAT, 1, 0, "ok", 2);
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2];

	/* Only 5 header bytes. */
	pair_open(sv, false);
	ck_assert_int_eq(write(sv[0], buf, 5), 5);
	ck_assert_int_eq(shutdown(sv[0], SHUT_WR), 0);
	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 0);
	ck_assert(dlpc__rx_partial(&rx));
	dlpc__rx_clear(&rx);
	pair_close(sv);

	/* A whole frame, then end of stream: nothing partial. */
	pair_open(sv, false);
	ck_assert_int_eq(write(sv[0], buf, len), (ssize_t)len);
	ck_assert_int_eq(shutdown(sv[0], SHUT_WR), 0);
	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
	ck_assert_mem_eq(f.payload, "ok", 2);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 0);
	ck_assert(!dlpc__rx_partial(&rx));
	dlpc__rx_clear(&rx);
	pair_close(sv);
}
END_TEST

START_TEST(test_rx_eagain)
{
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2];

	pair_open(sv, true);
	dlpc__rx_init(&rx);
	ck_assert_int_eq(dlpc__rx_read(&rx, sv[1], why, sizeof(why)), -EAGAIN);
	ck_assert(!dlpc__rx_partial(&rx));
	dlpc__rx_clear(&rx);
	pair_close(sv);
}
END_TEST

/*
 * A child writes, with dlpc__send_all() on a blocking socket: a small frame, a DLPC_FRAME_MAX
 * frame carrying an fd, and a small frame carrying another. The buffer grows for the big frame,
 * every byte and fd arrives where it belongs, and the buffer shrinks back once drained.
 */
START_TEST(test_rx_max_frame_send_all)
{
	uint8_t *big = malloc(HDR + (size_t)DLPC_FRAME_MAX), *payload = malloc(DLPC_FRAME_MAX);
	uint8_t small[2][HDR + 3];
	int sv[2], fds[2] = {memfd_new(), memfd_new()}, status;
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	pid_t pid;

	ck_assert_ptr_nonnull(big);
	ck_assert_ptr_nonnull(payload);
	pattern(payload, DLPC_FRAME_MAX, 2);
	frame_build(small[0], DLPC_MSG_LIST, 1, 0, "one", 3);
	frame_build(big, DLPC_MSG_PUBLISH, 2, 1, payload, DLPC_FRAME_MAX);
	frame_build(small[1], DLPC_MSG_ATTACH, 3, 1, "two", 3);
	pair_open(sv, false);

	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		bool ok;

		close(sv[1]);
		ok = dlpc__send_all(sv[0], small[0], sizeof(small[0]), NULL, 0) == 0 &&
		     dlpc__send_all(sv[0], big, HDR + (size_t)DLPC_FRAME_MAX, &fds[0], 1) == 0 &&
		     dlpc__send_all(sv[0], small[1], sizeof(small[1]), &fds[1], 1) == 0;
		free(payload);
		free(big);
		_exit(ok ? 0 : 1);
	}
	close(sv[0]);

	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.id, 1);
	ck_assert_mem_eq(f.payload, "one", 3);
	ck_assert_uint_eq(f.nfds, 0);

	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.id, 2);
	ck_assert_uint_eq(f.hdr.len, DLPC_FRAME_MAX);
	ck_assert(memcmp(f.payload, payload, DLPC_FRAME_MAX) == 0);
	ck_assert_uint_eq(f.nfds, 1);
	ck_assert(same_file(f.fds[0], fds[0]));
	ck_assert_uint_ge(rx.cap, HDR + (size_t)DLPC_FRAME_MAX);
	dlpc__frame_clear(&f);

	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.id, 3);
	ck_assert_mem_eq(f.payload, "two", 3);
	ck_assert_uint_eq(f.nfds, 1);
	ck_assert(same_file(f.fds[0], fds[1]));
	dlpc__frame_clear(&f);

	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 0);
	ck_assert(!dlpc__rx_partial(&rx));
	ck_assert_uint_le(rx.cap, DLPC_RX_BUF_SIZE);

	dlpc__rx_clear(&rx);
	close(sv[1]);
	close(fds[0]);
	close(fds[1]);
	free(payload);
	free(big);
}
END_TEST

/* ---- tx: writing frames ---- */

/* Send fd-less frames from @p id on until the socket no longer takes them; returns the next id. */
static uint32_t tx_fill(struct dlpc__tx *tx, int sock, uint32_t id)
{
	uint8_t buf[HDR + 1000], payload[1000];

	while (tx->bytes == 0) {
		size_t len;

		ck_assert_uint_lt(id, 100000);
		pattern(payload, sizeof(payload), id);
		len = frame_build(buf, DLPC_MSG_PUBLISH, id, 0, payload, sizeof(payload));
		ck_assert_int_eq(dlpc__tx_send(tx, sock, buf, len, NULL, 0), 0);
		id++;
	}
	return id;
}

struct fd_frame {
	uint32_t id;
	unsigned n;
	ino_t ino[FDS_MAX];
};

/* Payload size of frame @p id in test_tx_queue_flush: frame 1 is far larger than the socket. */
static size_t txq_size(uint32_t id)
{
	return id == 1 ? (size_t)1 << 20 : 1000;
}

/*
 * With a peer that does not read, dlpc__tx_send() writes what the socket takes (the fds go with
 * the first byte) and queues the rest; behind a non-empty queue it queues whole frames holding
 * duplicates of the caller's fds. After the peer drains, dlpc__tx_flush() delivers every frame in
 * order, each fd on its own frame.
 */
START_TEST(test_tx_queue_flush)
{
	uint8_t *buf = malloc(HDR + txq_size(1)), *payload = malloc(txq_size(1));
	struct fd_frame fdf[6];
	unsigned nfdf = 0;
	struct dlpc__frame f;
	struct dlpc__tx tx;
	struct dlpc__rx rx;
	uint32_t id, next = 0;
	char why[256] = "";
	int sv[2], sndbuf = 64 << 10, before, r;
	size_t len;
	bool flushed = false;

	ck_assert_ptr_nonnull(buf);
	ck_assert_ptr_nonnull(payload);
	pair_open(sv, true);
	/* A known, small send buffer, so that frame 1 cannot fit whole. */
	ck_assert_int_eq(setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf)), 0);
	dlpc__tx_init(&tx);

	/*
	 * Frame 0 goes straight out, frame 1 partly; each carries an fd that leaves with its first
	 * byte, so nothing is duplicated.
	 */
	for (id = 0; id < 2; id++) {
		int fd = memfd_new();

		fdf[nfdf++] = (struct fd_frame){.id = id, .n = 1, .ino = {ino_of(fd)}};
		pattern(payload, txq_size(id), id);
		len = frame_build(buf, DLPC_MSG_PUBLISH, id, 1, payload, (uint32_t)txq_size(id));
		before = fd_count(getpid());
		ck_assert_int_eq(dlpc__tx_send(&tx, sv[0], buf, len, &fd, 1), 0);
		ck_assert_int_eq(fd_count(getpid()), before);
		close(fd);
	}
	ck_assert_uint_gt(tx.bytes, 0);
	ck_assert_uint_lt(tx.bytes, len);
	ck_assert_ptr_nonnull(tx.head);

	/* Behind a non-empty queue every frame is queued whole; frames 3, 5, 7 carry fds. */
	for (unsigned k = 0; k < 6; k++, id++) {
		unsigned n = k == 5 ? FDS_MAX : k % 2;
		int fds[FDS_MAX];
		size_t queued = tx.bytes;
		unsigned queued_fds = tx.nfds;

		for (unsigned i = 0; i < n; i++)
			fds[i] = memfd_new();
		if (n > 0) {
			fdf[nfdf] = (struct fd_frame){.id = id, .n = n};
			for (unsigned i = 0; i < n; i++)
				fdf[nfdf].ino[i] = ino_of(fds[i]);
			nfdf++;
		}
		pattern(payload, txq_size(id), id);
		len = frame_build(buf, DLPC_MSG_PUBLISH, id, (uint8_t)n, payload,
				  (uint32_t)txq_size(id));
		before = fd_count(getpid());
		ck_assert_int_eq(dlpc__tx_send(&tx, sv[0], buf, len, fds, n), 0);
		ck_assert_uint_eq(tx.bytes, queued + len);
		ck_assert_uint_eq(tx.nfds, queued_fds + n);
		ck_assert_int_eq(fd_count(getpid()), before + (int)n);
		/* The queue owns duplicates, so the caller may close its own at once. */
		for (unsigned i = 0; i < n; i++)
			close(fds[i]);
	}

	dlpc__rx_init(&rx);
	while (next < id) {
		ssize_t n;

		if (!flushed) {
			r = dlpc__tx_flush(&tx, sv[0]);
			ck_assert_int_ge(r, 0);
			flushed = r == 1;
		}
		n = dlpc__rx_read(&rx, sv[1], why, sizeof(why));
		ck_assert_msg(n > 0 || n == -EAGAIN, "rx_read: %zd (%s)", n, why);
		while ((r = dlpc__rx_next(&rx, &f, why, sizeof(why))) == 1) {
			unsigned want = 0;

			ck_assert_uint_eq(f.hdr.id, next);
			ck_assert_uint_eq(f.hdr.len, txq_size(next));
			ck_assert(pattern_ok(f.payload, txq_size(next), next));
			for (unsigned j = 0; j < nfdf; j++) {
				if (fdf[j].id != next)
					continue;
				want = fdf[j].n;
				for (unsigned i = 0; i < f.nfds && i < want; i++)
					ck_assert(ino_of(f.fds[i]) == fdf[j].ino[i]);
			}
			ck_assert_uint_eq(f.nfds, want);
			dlpc__frame_clear(&f);
			next++;
		}
		ck_assert_msg(r == 0, "rx_next: %d (%s)", r, why);
	}
	ck_assert(flushed);
	ck_assert_uint_eq(tx.bytes, 0);
	ck_assert_uint_eq(tx.nfds, 0);
	ck_assert_ptr_null(tx.head);
	ck_assert_int_eq(dlpc__tx_flush(&tx, sv[0]), 1);
	ck_assert(!dlpc__rx_partial(&rx));

	dlpc__rx_clear(&rx);
	dlpc__tx_clear(&tx);
	pair_close(sv);
	free(payload);
	free(buf);
}
END_TEST

/* dlpc__tx_clear() closes the duplicates the queue holds. */
START_TEST(test_tx_clear_closes_fds)
{
	uint8_t buf[HDR + 8];
	size_t len = frame_build(buf, DLPC_MSG_PUBLISH, 99, 2, "payload!", 8);
	struct dlpc__tx tx;
	int sv[2], fds[2] = {memfd_new(), memfd_new()}, before;

	pair_open(sv, true);
	dlpc__tx_init(&tx);
	tx_fill(&tx, sv[0], 1);
	before = fd_count(getpid());
	ck_assert_int_eq(dlpc__tx_send(&tx, sv[0], buf, len, fds, 2), 0);
	ck_assert_int_eq(fd_count(getpid()), before + 2);
	ck_assert_uint_eq(tx.nfds, 2);
	close(fds[0]);
	close(fds[1]);
	ck_assert_int_eq(fd_count(getpid()), before);

	dlpc__tx_clear(&tx);
	ck_assert_int_eq(fd_count(getpid()), before - 2);
	ck_assert_uint_eq(tx.bytes, 0);
	ck_assert_uint_eq(tx.nfds, 0);
	ck_assert_ptr_null(tx.head);
	dlpc__tx_clear(&tx);
	pair_close(sv);
}
END_TEST

/* A frame whose fd cannot be duplicated is refused whole, leaving nothing behind. */
START_TEST(test_tx_bad_fd)
{
	uint8_t buf[HDR + 1];
	size_t len = frame_build(buf, DLPC_MSG_PUBLISH, 99, 2, "x", 1);
	struct dlpc__tx tx;
	int sv[2], fds[2], before;
	size_t queued;

	pair_open(sv, true);
	dlpc__tx_init(&tx);
	tx_fill(&tx, sv[0], 1);
	fds[0] = memfd_new();
	fds[1] = -1;
	queued = tx.bytes;
	before = fd_count(getpid());
	ck_assert_int_eq(dlpc__tx_send(&tx, sv[0], buf, len, fds, 2), -EBADF);
	ck_assert_uint_eq(tx.bytes, queued);
	ck_assert_uint_eq(tx.nfds, 0);
	ck_assert_int_eq(fd_count(getpid()), before);

	close(fds[0]);
	dlpc__tx_clear(&tx);
	pair_close(sv);
}
END_TEST

/* Writing to a closed peer fails with -EPIPE, without SIGPIPE. */
START_TEST(test_tx_epipe)
{
	uint8_t buf[HDR];
	size_t len = frame_build(buf, DLPC_MSG_STAT, 1, 0, NULL, 0);
	struct dlpc__tx tx;
	int sv[2];

	pair_open(sv, true);
	close(sv[1]);
	dlpc__tx_init(&tx);
	ck_assert_int_eq(dlpc__tx_send(&tx, sv[0], buf, len, NULL, 0), -EPIPE);
	ck_assert_uint_eq(tx.bytes, 0);
	ck_assert_int_eq(dlpc__send_all(sv[0], buf, len, NULL, 0), -EPIPE);
	dlpc__tx_clear(&tx);
	close(sv[0]);
}
END_TEST

/* dlpc__send_all() on a blocking socket, with fds. */
START_TEST(test_send_all)
{
	uint8_t buf[HDR + 5];
	size_t len = frame_build(buf, DLPC_MSG_REPLY | DLPC_MSG_ATTACH, 77, 2, "hello", 5);
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	int sv[2], fds[2] = {memfd_new(), memfd_new()};

	pair_open(sv, false);
	ck_assert_int_eq(dlpc__send_all(sv[0], buf, len, fds, 2), 0);
	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.id, 77);
	ck_assert_uint_eq(f.hdr.type, DLPC_MSG_REPLY | DLPC_MSG_ATTACH);
	ck_assert_mem_eq(f.payload, "hello", 5);
	ck_assert_uint_eq(f.nfds, 2);
	ck_assert(same_file(f.fds[0], fds[0]));
	ck_assert(same_file(f.fds[1], fds[1]));
	dlpc__frame_clear(&f);
	dlpc__rx_clear(&rx);
	close(fds[0]);
	close(fds[1]);
	pair_close(sv);
}
END_TEST

/* dlpc__send_within() keeps one deadline for the whole frame: a peer that reads a little now
 * and then (so that every single write makes progress, and no per-write timeout such as
 * SO_SNDTIMEO would ever expire) does not stretch it; the write fails with -EAGAIN, counting
 * what left. Without a bound it is dlpc__send_counted(). */
#define TRICKLE_BYTES 4096
#define TRICKLE_EVERY_US 20000

START_TEST(test_send_within_a_trickle)
{
	size_t len = 64u << 20, sent = 0;
	uint8_t *big = calloc(1, len);
	int sv[2];
	pid_t pid;

	ck_assert_ptr_nonnull(big);
	pair_open(sv, false);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		char buf[TRICKLE_BYTES];

		close(sv[0]);
		while (read(sv[1], buf, sizeof(buf)) > 0)
			usleep(TRICKLE_EVERY_US);
		_exit(0);
	}
	ck_assert_int_eq(dlpc__send_within(sv[0], big, len, NULL, 0, 300, NULL, NULL, &sent),
			 -EAGAIN);
	ck_assert_uint_gt(sent, 0);
	ck_assert_uint_lt(sent, len);
	kill(pid, SIGKILL);
	ck_assert_int_eq(waitpid(pid, NULL, 0), pid);
	pair_close(sv);
	/* no bound: all of it, as dlpc__send_counted() */
	pair_open(sv, false);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		size_t got = 0;
		ssize_t n;

		close(sv[0]);
		while (got < len && (n = read(sv[1], big, len - got)) > 0)
			got += (size_t)n;
		_exit(got == len ? 0 : 1);
	}
	ck_assert_int_eq(dlpc__send_within(sv[0], big, len, NULL, 0, 0, NULL, NULL, &sent), 0);
	ck_assert_uint_eq(sent, len);
	ck_assert_int_eq(wait_child(pid), 0);
	pair_close(sv);
	free(big);
}
END_TEST

/* ---- suite ---- */

static TCase *tcase_new(const char *name)
{
	TCase *tc = tcase_create(name);

	tcase_set_timeout(tc, 30);
	tcase_add_checked_fixture(tc, fd_setup, fd_teardown);
	return tc;
}

static Suite *io_suite(void)
{
	Suite *s = suite_create("io");
	TCase *tc;

	tc = tcase_new("rx");
	tcase_add_test(tc, test_rx_byte_by_byte);
	tcase_add_test(tc, test_rx_many_in_one_write);
	tcase_add_loop_test(tc, test_rx_fds, 0, FDS_MAX);
	tcase_add_test(tc, test_rx_fds_behind_buffered_bytes);
	tcase_add_test(tc, test_rx_missing_fd);
	tcase_add_test(tc, test_rx_no_fd);
	tcase_add_test(tc, test_rx_extra_fd);
	tcase_add_loop_test(tc, test_rx_fds_without_frame, 0, 2);
	tcase_add_loop_test(tc, test_rx_too_many_fds, 0, 3);
	tcase_add_loop_test(tc, test_rx_fds_lost, 0, 2);
	tcase_add_test(tc, test_rx_fds_pile_up);
	tcase_add_loop_test(tc, test_rx_oversized, 0, 3);
	tcase_add_test(tc, test_rx_cap_max);
	tcase_add_test(tc, test_rx_max_header_waits);
	tcase_add_loop_test(tc, test_rx_bad_header, 0, 2);
	tcase_add_test(tc, test_rx_eof_mid_frame);
	tcase_add_test(tc, test_rx_eof_boundaries);
	tcase_add_test(tc, test_rx_eagain);
	tcase_add_test(tc, test_rx_max_frame_send_all);
	suite_add_tcase(s, tc);

	tc = tcase_new("tx");
	tcase_add_test(tc, test_tx_queue_flush);
	tcase_add_test(tc, test_tx_clear_closes_fds);
	tcase_add_test(tc, test_tx_bad_fd);
	tcase_add_test(tc, test_tx_epipe);
	tcase_add_test(tc, test_send_all);
	tcase_add_test(tc, test_send_within_a_trickle);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(io_suite());
}
