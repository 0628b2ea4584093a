/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Unit suite for the frame layer in proto/: the frame header (frame.c) and protobuf messages as
 * frames (msg.c). The msg tests that cross a real AF_UNIX stream socketpair check that the process
 * holds as many fds at their end as at their start.
 */
#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"
#include "wire.h"
#include "frame.h"
#include "io.h"
#include "limits.h"
#include "msg.h"
#include "table.h"
#include "util.h"

#define HDR DLPC_FRAME_HDR_SIZE
#define FDS_MAX DLPC_FRAME_FDS_MAX

/* ---- helpers ---- */

/* ---- frame header ---- */

START_TEST(test_hdr_layout)
{
	static const uint8_t want[HDR] = {0x01, 0x02, 0x03, 0x04, 0x05, 0x06,
					  0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c};
	struct dlpc__hdr h = {
		.len = 0x04030201, .type = 0x0605, .nfds = 0x07, .flags = 0x08, .id = 0x0c0b0a09};
	struct dlpc__hdr d;
	uint8_t b[HDR];

	ck_assert_int_eq(DLPC_FRAME_HDR_SIZE, 12);
	memset(b, 0xee, sizeof(b));
	dlpc__hdr_encode(b, &h);
	ck_assert_mem_eq(b, want, sizeof(want));

	memset(&d, 0xff, sizeof(d));
	dlpc__hdr_decode(want, &d);
	ck_assert_uint_eq(d.len, 0x04030201);
	ck_assert_uint_eq(d.type, 0x0605);
	ck_assert_uint_eq(d.nfds, 0x07);
	ck_assert_uint_eq(d.flags, 0x08);
	ck_assert_uint_eq(d.id, 0x0c0b0a09);
}
END_TEST

START_TEST(test_hdr_round_trip)
{
	static const struct dlpc__hdr cases[] = {
		{0, 0, 0, 0, 0},
		{1, DLPC_MSG_HELLO, 0, 0, 1},
		{DLPC_FRAME_MAX, DLPC_MSG_PUBLISH, FDS_MAX, 0, 0x7fffffff},
		{UINT32_MAX, UINT16_MAX, UINT8_MAX, UINT8_MAX, UINT32_MAX},
		{0x80000000u, DLPC_MSG_REPLY | DLPC_MSG_STAT, 1, 0x80, 0x80000000u},
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct dlpc__hdr d;
		uint8_t b[HDR];

		dlpc__hdr_encode(b, &cases[i]);
		/* Little-endian regardless of the host: spot-check the top bytes. */
		ck_assert_uint_eq(b[3], cases[i].len >> 24);
		ck_assert_uint_eq(b[5], cases[i].type >> 8);
		ck_assert_uint_eq(b[11], cases[i].id >> 24);
		memset(&d, 0x5a, sizeof(d));
		dlpc__hdr_decode(b, &d);
		ck_assert_uint_eq(d.len, cases[i].len);
		ck_assert_uint_eq(d.type, cases[i].type);
		ck_assert_uint_eq(d.nfds, cases[i].nfds);
		ck_assert_uint_eq(d.flags, cases[i].flags);
		ck_assert_uint_eq(d.id, cases[i].id);
	}
}
END_TEST

START_TEST(test_hdr_check)
{
	struct dlpc__hdr h = {.len = 0, .type = DLPC_MSG_PUBLISH};

	ck_assert_int_eq(dlpc__hdr_check(&h), 0);
	h.len = DLPC_FRAME_MAX;
	ck_assert_int_eq(dlpc__hdr_check(&h), 0);
	h.len = DLPC_FRAME_MAX + 1;
	ck_assert_int_eq(dlpc__hdr_check(&h), -EMSGSIZE);
	h.len = 1u << 31;
	ck_assert_int_eq(dlpc__hdr_check(&h), -EMSGSIZE);
	h.len = UINT32_MAX;
	ck_assert_int_eq(dlpc__hdr_check(&h), -EMSGSIZE);

	h.len = 16;
	h.nfds = FDS_MAX;
	ck_assert_int_eq(dlpc__hdr_check(&h), 0);
	h.nfds = FDS_MAX + 1;
	ck_assert_int_eq(dlpc__hdr_check(&h), -EPROTO);
	h.nfds = UINT8_MAX;
	ck_assert_int_eq(dlpc__hdr_check(&h), -EPROTO);

	h.nfds = 1;
	h.flags = 1;
	ck_assert_int_eq(dlpc__hdr_check(&h), -EPROTO);
	h.flags = 0x80;
	ck_assert_int_eq(dlpc__hdr_check(&h), -EPROTO);

	/* Layer 2 does not judge types: unknown ones are the dispatch table's business. */
	h.flags = 0;
	h.type = 0xffff;
	ck_assert_int_eq(dlpc__hdr_check(&h), 0);
}
END_TEST

START_TEST(test_msg_name)
{
	static const struct {
		uint16_t type;
		const char *name;
	} cases[] = {
		{DLPC_MSG_HELLO, "HELLO"},
		{DLPC_MSG_PUBLISH, "PUBLISH"},
		{DLPC_MSG_ATTACH, "ATTACH"},
		{DLPC_MSG_RELEASE, "RELEASE"},
		{DLPC_MSG_UNPUBLISH, "UNPUBLISH"},
		{DLPC_MSG_LIST, "LIST"},
		{DLPC_MSG_STAT, "STAT"},
		{DLPC_MSG_WATCH, "WATCH"},
		{DLPC_MSG_SEND, "SEND"},
		{DLPC_MSG_RECV, "RECV"},
		{DLPC_MSG_CHANNEL, "CHANNEL"},
		{DLPC_MSG_EVENT, "EVENT"},
		{DLPC_MSG_REPLY | DLPC_MSG_HELLO, "HELLO reply"},
		{DLPC_MSG_REPLY | DLPC_MSG_ATTACH, "ATTACH reply"},
		{DLPC_MSG_REPLY | DLPC_MSG_STAT, "STAT reply"},
		{DLPC_MSG_ERROR, "ERROR"},
		{0, "type 0"},
		{DLPC_MSG__REQUEST_COUNT, "type 13"},
		{77, "type 77"},
		{DLPC_MSG_REPLY | DLPC_MSG__REQUEST_COUNT, "type 32781"},
		{0x7fff, "type 32767"},
		{0xffff, "type 65535"},
	};
	char buf[32], small[4];

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		memset(buf, 'z', sizeof(buf));
		ck_assert_ptr_eq(dlpc__msg_name(cases[i].type, buf, sizeof(buf)), buf);
		ck_assert_str_eq(buf, cases[i].name);
	}
	/* A short buffer truncates and stays terminated. */
	ck_assert_str_eq(dlpc__msg_name(DLPC_MSG_UNPUBLISH, small, sizeof(small)), "UNP");
}
END_TEST

/* ---- msg: protobuf messages as frames ---- */

START_TEST(test_msg_frame)
{
	static const char name[] = "weights/layer0";
	Dlpackd__V1__Unpublish un = DLPACKD__V1__UNPUBLISH__INIT;
	Dlpackd__V1__Stat st = DLPACKD__V1__STAT__INIT;
	Dlpackd__V1__Unpublish *back;
	struct dlpc__scratch s = {0};
	struct dlpc__hdr h;
	size_t packed;
	ssize_t len;

	un.name.data = (uint8_t *)name;
	un.name.len = sizeof(name) - 1;
	packed = dlpackd__v1__unpublish__get_packed_size(&un);
	len = dlpc__msg_frame(&s, DLPC_MSG_UNPUBLISH, 0xdeadbeef, &un.base, 0);
	ck_assert_int_eq(len, (ssize_t)(HDR + packed));
	ck_assert_ptr_nonnull(s.p);
	ck_assert_uint_ge(s.cap, (size_t)len);
	dlpc__hdr_decode(s.p, &h);
	ck_assert_uint_eq(h.len, packed);
	ck_assert_uint_eq(h.type, DLPC_MSG_UNPUBLISH);
	ck_assert_uint_eq(h.nfds, 0);
	ck_assert_uint_eq(h.flags, 0);
	ck_assert_uint_eq(h.id, 0xdeadbeef);
	ck_assert_int_eq(dlpc__hdr_check(&h), 0);
	back = dlpackd__v1__unpublish__unpack(NULL, h.len, s.p + HDR);
	ck_assert_ptr_nonnull(back);
	ck_assert_uint_eq(back->name.len, sizeof(name) - 1);
	ck_assert_mem_eq(back->name.data, name, sizeof(name) - 1);
	dlpackd__v1__unpublish__free_unpacked(back, NULL);

	/* An empty message, reusing the scratch buffer, with an fd count in the header. */
	len = dlpc__msg_frame(&s, DLPC_MSG_STAT, 7, &st.base, 3);
	ck_assert_int_eq(len, HDR);
	dlpc__hdr_decode(s.p, &h);
	ck_assert_uint_eq(h.len, 0);
	ck_assert_uint_eq(h.type, DLPC_MSG_STAT);
	ck_assert_uint_eq(h.nfds, 3);
	ck_assert_uint_eq(h.id, 7);

	dlpc__scratch_clear(&s);
	ck_assert_ptr_null(s.p);
	ck_assert_uint_eq(s.cap, 0);
	dlpc__scratch_clear(&s);
}
END_TEST

/* Two frames written back to back into one buffer, the first kept while the second grows it. */
START_TEST(test_msg_frame_at)
{
	Dlpackd__V1__Release rel = DLPACKD__V1__RELEASE__INIT;
	Dlpackd__V1__Unpublish un = DLPACKD__V1__UNPUBLISH__INIT;
	Dlpackd__V1__Release *back;
	uint64_t ids[3] = {1, 300, UINT64_MAX};
	static uint8_t big[8000];
	struct dlpc__scratch s = {0};
	struct dlpc__hdr h;
	ssize_t first, len;

	rel.n_ref_ids = 3;
	rel.ref_ids = ids;
	first = dlpc__msg_frame_at(&s, 0, DLPC_MSG_RELEASE, 0, &rel.base, NULL, 0, 0);
	ck_assert_int_gt(first, HDR);
	memset(big, 'n', sizeof(big));
	un.name.data = big;
	un.name.len = sizeof(big); /* past the first allocation: the buffer moves */
	len = dlpc__msg_frame_at(&s, (size_t)first, DLPC_MSG_UNPUBLISH, 9, &un.base, NULL, 0, 0);
	ck_assert_int_eq(len, first + HDR + (ssize_t)dlpackd__v1__unpublish__get_packed_size(&un));
	dlpc__hdr_decode(s.p, &h);
	ck_assert_uint_eq(h.type, DLPC_MSG_RELEASE);
	ck_assert_uint_eq(h.len, (size_t)first - HDR);
	back = dlpackd__v1__release__unpack(NULL, h.len, s.p + HDR);
	ck_assert_ptr_nonnull(back);
	ck_assert_uint_eq(back->n_ref_ids, 3);
	ck_assert_mem_eq(back->ref_ids, ids, sizeof(ids));
	dlpackd__v1__release__free_unpacked(back, NULL);
	dlpc__hdr_decode(s.p + first, &h);
	ck_assert_uint_eq(h.type, DLPC_MSG_UNPUBLISH);
	ck_assert_uint_eq(h.id, 9);
	ck_assert_uint_eq(HDR + h.len, (size_t)(len - first));
	dlpc__scratch_clear(&s);
}
END_TEST

/* A framed message crosses a socket and unpacks on the other side. */
START_TEST(test_msg_frame_over_socket)
{
	static const char name[] = "shared/tensor";
	Dlpackd__V1__Unpublish un = DLPACKD__V1__UNPUBLISH__INIT;
	Dlpackd__V1__Unpublish *back;
	struct dlpc__scratch s = {0};
	struct dlpc__frame f;
	struct dlpc__rx rx;
	char why[256] = "";
	ssize_t len;
	int sv[2];

	un.name.data = (uint8_t *)name;
	un.name.len = sizeof(name) - 1;
	len = dlpc__msg_frame(&s, DLPC_MSG_UNPUBLISH, 12, &un.base, 0);
	ck_assert_int_gt(len, HDR);
	pair_open(sv, false);
	ck_assert_int_eq(dlpc__send_all(sv[0], s.p, (size_t)len, NULL, 0), 0);
	dlpc__rx_init(&rx);
	ck_assert_int_eq(rx_frame(&rx, sv[1], &f, why, sizeof(why)), 1);
	ck_assert_uint_eq(f.hdr.type, DLPC_MSG_UNPUBLISH);
	ck_assert_uint_eq(f.hdr.id, 12);
	back = dlpackd__v1__unpublish__unpack(NULL, f.hdr.len, f.payload);
	ck_assert_ptr_nonnull(back);
	ck_assert_uint_eq(back->name.len, sizeof(name) - 1);
	ck_assert_mem_eq(back->name.data, name, sizeof(name) - 1);
	dlpackd__v1__unpublish__free_unpacked(back, NULL);
	dlpc__rx_clear(&rx);
	dlpc__scratch_clear(&s);
	pair_close(sv);
}
END_TEST

/* A message of exactly DLPC_FRAME_MAX packed bytes frames; one byte more is -EMSGSIZE. */
/*
 * The limits fit together: the widest tensor description the daemon accepts, DLPC_BUNDLE_MAX
 * times, in an ATTACH reply with every number at its widest, still fits one frame. So any entry
 * the daemon accepts can be attached. Widest description: a DLPC_KEY_MAX key, dtype fields at
 * their limits, DLPC_NDIM_MAX extents whose non-zero product fits an int64 (1-byte extents plus
 * eight 2-byte ones of 128: 2^56), the largest offset.
 */
START_TEST(test_widest_entry_fits_a_reply)
{
	static uint8_t key[DLPC_KEY_MAX];
	int64_t shape[DLPC_NDIM_MAX];
	Dlpackd__V1__TensorDesc d = DLPACKD__V1__TENSOR_DESC__INIT;
	Dlpackd__V1__TensorDesc *one[1] = {&d};
	Dlpackd__V1__AttachReply rep = DLPACKD__V1__ATTACH_REPLY__INIT;
	uint64_t nbytes, each, total;

	for (int i = 0; i < DLPC_NDIM_MAX; i++)
		shape[i] = i < 8 ? 128 : 1;
	/* this shape is accepted, and one more factor of 128 would not be */
	ck_assert_int_eq(dlpc__tensor_nbytes(8, 1, shape, DLPC_NDIM_MAX, &nbytes), 0);
	shape[8] = INT64_C(1) << 8;
	ck_assert_int_eq(dlpc__tensor_nbytes(8, 1, shape, DLPC_NDIM_MAX, &nbytes), -EOVERFLOW);
	shape[8] = 1;
	memset(key, 'k', sizeof(key));
	d.key.data = key;
	d.key.len = DLPC_KEY_MAX;
	d.dtype_code = UINT8_MAX;
	d.dtype_bits = UINT8_MAX;
	d.dtype_lanes = UINT16_MAX;
	d.n_shape = DLPC_NDIM_MAX;
	d.shape = shape;
	d.offset = UINT64_MAX;
	rep.generation = INT32_MAX;
	rep.ref_id = UINT64_MAX;
	rep.flags = UINT32_MAX;
	rep.device_type = INT32_MIN;
	rep.device_id = INT32_MIN;
	rep.storage_size = UINT64_MAX;
	each = dlpc__table_size(one, 1) - 4; /* one record, without the count */
	rep.tensor_table.len = 4 + each * DLPC_BUNDLE_MAX;
	total = dlpackd__v1__attach_reply__get_packed_size(&rep);
	ck_assert_uint_le(total, DLPC_FRAME_MAX);
	/* and so does the PUBLISH that declared it */
	each = dlpackd__v1__tensor_desc__get_packed_size(&d) + 4; /* tag and length */
	ck_assert_uint_le(each * DLPC_BUNDLE_MAX + 64, DLPC_FRAME_MAX);
}
END_TEST

/* The tensor table round-trips, and a malformed one is refused wherever it breaks. */
START_TEST(test_tensor_table)
{
	static uint8_t key[DLPC_KEY_MAX];
	int64_t shape_a[3] = {2, 0, INT64_MAX}, shape_b[1] = {300};
	Dlpackd__V1__TensorDesc a = DLPACKD__V1__TENSOR_DESC__INIT, b = a, *both[2] = {&a, &b};
	struct dlpc__table_rec r;
	uint8_t *t, bad[64];
	size_t len, pos = 4;

	memset(key, 'k', sizeof(key));
	a.dtype_code = kDLFloat;
	a.dtype_bits = 16;
	a.dtype_lanes = 4;
	a.n_shape = 3;
	a.shape = shape_a;
	a.offset = UINT64_MAX - 255;
	b.key.data = key;
	b.key.len = DLPC_KEY_MAX;
	b.dtype_code = kDLUInt;
	b.dtype_bits = 8;
	b.dtype_lanes = 1;
	b.n_shape = 1;
	b.shape = shape_b;
	b.offset = 256;
	len = dlpc__table_size(both, 2);
	/* 4 + 16 + (1 + 1 + 9) + 0, then 16 + 2 + 255 */
	ck_assert_uint_eq(len, 4 + 27 + 273);
	t = malloc(len);
	dlpc__table_encode(both, 2, t);
	ck_assert_int_eq(dlpc__table_count(t, len), 2);
	ck_assert_int_eq(dlpc__table_next(t, len, &pos, &r), 0);
	ck_assert_uint_eq(r.dtype.code, kDLFloat);
	ck_assert_uint_eq(r.dtype.bits, 16);
	ck_assert_uint_eq(r.dtype.lanes, 4);
	ck_assert_int_eq(r.ndim, 3);
	ck_assert_mem_eq(r.shape, shape_a, sizeof(shape_a));
	ck_assert_uint_eq(r.offset, UINT64_MAX - 255);
	ck_assert_uint_eq(r.key_len, 0);
	ck_assert_int_eq(dlpc__table_next(t, len, &pos, &r), 0);
	ck_assert_int_eq(r.ndim, 1);
	ck_assert_int_eq(r.shape[0], 300);
	ck_assert_uint_eq(r.key_len, DLPC_KEY_MAX);
	ck_assert_mem_eq(r.key, key, DLPC_KEY_MAX);
	ck_assert_uint_eq(pos, len);
	ck_assert_int_eq(dlpc__table_next(t, len, &pos, &r), -EPROTO); /* past the end */
	/* every cut short of a whole record is refused */
	for (size_t cut = 4; cut < 4 + 27; cut++) {
		pos = 4;
		ck_assert_int_eq(dlpc__table_next(t, cut, &pos, &r), -EPROTO);
	}
	free(t);

	ck_assert_int_eq(dlpc__table_count(bad, 3), -EPROTO);
	memset(bad, 0, sizeof(bad));
	bad[0] = 0x01, bad[1] = 0x40, bad[2] = 0x00, bad[3] = 0x00; /* 16385 */
	ck_assert_int_eq(dlpc__table_count(bad, sizeof(bad)), -EPROTO);
	bad[1] = 0;
	bad[4 + 4] = DLPC_NDIM_MAX + 1; /* too many dimensions */
	pos = 4;
	ck_assert_int_eq(dlpc__table_next(bad, sizeof(bad), &pos, &r), -EPROTO);
	bad[4 + 4] = 0;
	bad[4 + 6] = 1; /* reserved field set */
	pos = 4;
	ck_assert_int_eq(dlpc__table_next(bad, sizeof(bad), &pos, &r), -EPROTO);
	bad[4 + 6] = 0;
	bad[4 + 4] = 1; /* one extent of 2^63: over INT64_MAX */
	memset(bad + 20, 0x80, 9);
	bad[29] = 0x01;
	pos = 4;
	ck_assert_int_eq(dlpc__table_next(bad, sizeof(bad), &pos, &r), -EPROTO);
	bad[29] = 0x02; /* a tenth byte with bits past 64 */
	pos = 4;
	ck_assert_int_eq(dlpc__table_next(bad, sizeof(bad), &pos, &r), -EPROTO);
	memset(bad + 20, 0x80, 20); /* a varint that never ends */
	pos = 4;
	ck_assert_int_eq(dlpc__table_next(bad, 40, &pos, &r), -EPROTO);
}
END_TEST

START_TEST(test_msg_frame_limit)
{
	Dlpackd__V1__Unpublish un = DLPACKD__V1__UNPUBLISH__INIT;
	struct dlpc__scratch s = {0};
	uint8_t *name = calloc(1, DLPC_FRAME_MAX);
	struct dlpc__hdr h;

	ck_assert_ptr_nonnull(name);
	memset(name, 'n', DLPC_FRAME_MAX);
	un.name.data = name;
	/* 1 tag byte + 4 length-varint bytes + the name. */
	un.name.len = DLPC_FRAME_MAX - 5;
	ck_assert_uint_eq(dlpackd__v1__unpublish__get_packed_size(&un), DLPC_FRAME_MAX);
	ck_assert_int_eq(dlpc__msg_frame(&s, DLPC_MSG_UNPUBLISH, 1, &un.base, 0),
			 (ssize_t)(HDR + DLPC_FRAME_MAX));
	dlpc__hdr_decode(s.p, &h);
	ck_assert_uint_eq(h.len, DLPC_FRAME_MAX);
	ck_assert_int_eq(dlpc__hdr_check(&h), 0);
	dlpc__scratch_clear(&s);

	un.name.len = DLPC_FRAME_MAX - 4;
	ck_assert_int_eq(dlpc__msg_frame(&s, DLPC_MSG_UNPUBLISH, 1, &un.base, 0), -EMSGSIZE);
	ck_assert_ptr_null(s.p);
	ck_assert_uint_eq(s.cap, 0);
	free(name);
}
END_TEST

/* ---- suite ---- */

static TCase *tcase_new(const char *name, bool fds)
{
	TCase *tc = tcase_create(name);

	tcase_set_timeout(tc, 30);
	if (fds)
		tcase_add_checked_fixture(tc, fd_setup, fd_teardown);
	return tc;
}

static Suite *frame_suite(void)
{
	Suite *s = suite_create("frame");
	TCase *tc;

	tc = tcase_new("frame", false);
	tcase_add_test(tc, test_hdr_layout);
	tcase_add_test(tc, test_hdr_round_trip);
	tcase_add_test(tc, test_hdr_check);
	tcase_add_test(tc, test_msg_name);
	suite_add_tcase(s, tc);

	tc = tcase_new("msg", true);
	tcase_add_test(tc, test_msg_frame);
	tcase_add_test(tc, test_msg_frame_at);
	tcase_add_test(tc, test_tensor_table);
	tcase_add_test(tc, test_msg_frame_over_socket);
	tcase_add_test(tc, test_msg_frame_limit);
	tcase_add_test(tc, test_widest_entry_fits_a_reply);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(frame_suite());
}
