/* SPDX-License-Identifier: Apache-2.0 */
/* Unit suite for proto/util.c: UTF-8, name and key checks, tensor sizes, alignment, printable;
 * and client/base.c's clock arithmetic. */
#include <check.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"
#include "limits.h"
#include "harness.h"
#include "util.h"

/* ---- util ---- */

#define U(lit, ok)                                                                                 \
	{                                                                                          \
		(const uint8_t *)(lit), sizeof(lit) - 1, ok                                        \
	}

START_TEST(test_utf8)
{
	static const struct {
		const uint8_t *s;
		size_t len;
		bool ok;
	} cases[] = {
		U("", true),
		U("plain ASCII ~!", true),
		U("\x7f", true),
		U("\xc2\x80", true),	     /* U+0080 */
		U("\xdf\xbf", true),	     /* U+07FF */
		U("\xe0\xa0\x80", true),     /* U+0800 */
		U("\xed\x9f\xbf", true),     /* U+D7FF */
		U("\xee\x80\x80", true),     /* U+E000 */
		U("\xef\xbf\xbf", true),     /* U+FFFF */
		U("\xf0\x90\x80\x80", true), /* U+10000 */
		U("\xf4\x8f\xbf\xbf", true), /* U+10FFFF */
		U("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", true),
		U("\xc0\x80", false),	      /* overlong NUL */
		U("\xc1\xbf", false),	      /* overlong U+007F */
		U("\xe0\x80\x80", false),     /* overlong, 3 bytes */
		U("\xe0\x9f\xbf", false),     /* overlong U+07FF */
		U("\xf0\x80\x80\x80", false), /* overlong, 4 bytes */
		U("\xf0\x8f\xbf\xbf", false), /* overlong U+FFFF */
		U("\xed\xa0\x80", false),     /* U+D800 */
		U("\xed\xbf\xbf", false),     /* U+DFFF */
		U("\xf4\x90\x80\x80", false), /* U+110000 */
		U("\xf5\x80\x80\x80", false),
		U("\xf8\x88\x80\x80\x80", false),
		U("\xfe", false),
		U("\xff", false),
		U("\x80", false), /* lone continuation */
		U("a\xbf", false),
		U("\xc3", false), /* truncated */
		U("\xe2\x82", false),
		U("\xf0\x9f\x98", false),
		U("ok\xe2\x82", false),
		U("\xc3\x28", false), /* bad continuation */
		U("\xe2\x28\xa1", false),
		U("\xf0\x9f\x28\x80", false),
		U("\0", false), /* NUL */
		U("a\0b", false),
		U("\xc3\xa9\0", false),
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
		ck_assert_msg(dlpc__utf8_valid(cases[i].s, cases[i].len) == cases[i].ok,
			      "case %zu: expected %s", i, cases[i].ok ? "valid" : "invalid");
	/* A length that cuts a valid sequence short. */
	ck_assert(!dlpc__utf8_valid((const uint8_t *)"\xc3\xa9", 1));
	ck_assert(!dlpc__utf8_valid((const uint8_t *)"\xf0\x9f\x98\x80", 3));
	ck_assert(dlpc__utf8_valid(NULL, 0));
}
END_TEST

START_TEST(test_name_key_check)
{
	static const uint8_t fancy[] = "models/r\xc3\xa9seau";
	uint8_t s[DLPC_NAME_MAX + 2];
	char why[256];

	ck_assert_int_eq(DLPC_NAME_MAX, 255);
	ck_assert_int_eq(DLPC_KEY_MAX, 255);
	memset(s, 'n', sizeof(s));

	why[0] = '\0';
	ck_assert_int_eq(dlpc__name_check(s, 0, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "empty"));
	ck_assert_int_eq(dlpc__name_check(s, 1, why, sizeof(why)), 0);
	ck_assert_int_eq(dlpc__name_check(s, DLPC_NAME_MAX, why, sizeof(why)), 0);
	why[0] = '\0';
	ck_assert_int_eq(dlpc__name_check(s, DLPC_NAME_MAX + 1, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "256 bytes"));
	/* The limit counts bytes, not characters. */
	memcpy(s + DLPC_NAME_MAX - 2, "\xc3\xa9", 2);
	ck_assert_int_eq(dlpc__name_check(s, DLPC_NAME_MAX, why, sizeof(why)), 0);
	memset(s, 'n', sizeof(s));
	memcpy(s + DLPC_NAME_MAX - 1, "\xc3\xa9", 2);
	ck_assert_int_eq(dlpc__name_check(s, DLPC_NAME_MAX + 1, why, sizeof(why)), -EINVAL);
	why[0] = '\0';
	ck_assert_int_eq(dlpc__name_check((const uint8_t *)"ab\xff", 3, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "UTF-8"));
	ck_assert_int_eq(dlpc__name_check((const uint8_t *)"a\0b", 3, why, sizeof(why)), -EINVAL);
	ck_assert_int_eq(dlpc__name_check((const uint8_t *)"\xed\xa0\x80", 3, why, sizeof(why)),
			 -EINVAL);
	ck_assert_int_eq(dlpc__name_check(fancy, sizeof(fancy) - 1, why, sizeof(why)), 0);

	/* Keys may be empty (protobuf-c hands an empty bytes field over as {0, NULL}). */
	memset(s, 'k', sizeof(s));
	ck_assert_int_eq(dlpc__key_check(s, 0, why, sizeof(why)), 0);
	ck_assert_int_eq(dlpc__key_check(NULL, 0, why, sizeof(why)), 0);
	ck_assert_int_eq(dlpc__key_check(s, DLPC_KEY_MAX, why, sizeof(why)), 0);
	why[0] = '\0';
	ck_assert_int_eq(dlpc__key_check(s, DLPC_KEY_MAX + 1, why, sizeof(why)), -EINVAL);
	ck_assert_ptr_nonnull(strstr(why, "key"));
	ck_assert_int_eq(dlpc__key_check((const uint8_t *)"\xc0\x80", 2, why, sizeof(why)),
			 -EINVAL);
}
END_TEST

START_TEST(test_tensor_nbytes)
{
	int64_t shape[DLPC_NDIM_MAX + 1];
	uint64_t nb;

	/* Scalars: one element. */
	nb = 0;
	ck_assert_int_eq(dlpc__tensor_nbytes(32, 1, NULL, 0, &nb), 0);
	ck_assert_uint_eq(nb, 4);
	ck_assert_int_eq(dlpc__tensor_nbytes(16, 4, NULL, 0, &nb), 0);
	ck_assert_uint_eq(nb, 8);
	ck_assert_int_eq(dlpc__tensor_nbytes(4, 1, NULL, 0, &nb), 0);
	ck_assert_uint_eq(nb, 1);

	shape[0] = 2;
	shape[1] = 3;
	shape[2] = 5;
	ck_assert_int_eq(dlpc__tensor_nbytes(64, 1, shape, 3, &nb), 0);
	ck_assert_uint_eq(nb, 240);
	ck_assert_int_eq(dlpc__tensor_nbytes(32, 2, shape, 3, &nb), 0);
	ck_assert_uint_eq(nb, 240);

	/* Zero extent: no bytes, whatever the other extents. */
	shape[0] = 7;
	shape[1] = 0;
	shape[2] = INT64_MAX;
	nb = 1;
	ck_assert_int_eq(dlpc__tensor_nbytes(32, 1, shape, 2, &nb), 0);
	ck_assert_uint_eq(nb, 0);
	nb = 1;
	ck_assert_int_eq(dlpc__tensor_nbytes(32, 1, shape + 1, 2, &nb), 0);
	ck_assert_uint_eq(nb, 0);

	/* Negative extents, even after a zero one. */
	shape[0] = -1;
	ck_assert_int_eq(dlpc__tensor_nbytes(8, 1, shape, 1, &nb), -EINVAL);
	shape[0] = 0;
	shape[1] = INT64_MIN;
	ck_assert_int_eq(dlpc__tensor_nbytes(8, 1, shape, 2, &nb), -EINVAL);

	/* Sub-byte elements round up to whole bytes. */
	shape[0] = 3;
	ck_assert_int_eq(dlpc__tensor_nbytes(4, 1, shape, 1, &nb), 0);
	ck_assert_uint_eq(nb, 2);
	shape[0] = 2;
	shape[1] = 3;
	ck_assert_int_eq(dlpc__tensor_nbytes(1, 1, shape, 2, &nb), 0);
	ck_assert_uint_eq(nb, 1);
	shape[0] = 9;
	ck_assert_int_eq(dlpc__tensor_nbytes(1, 1, shape, 1, &nb), 0);
	ck_assert_uint_eq(nb, 2);
	shape[0] = 8;
	ck_assert_int_eq(dlpc__tensor_nbytes(1, 1, shape, 1, &nb), 0);
	ck_assert_uint_eq(nb, 1);

	/* Overflow of the bit count. */
	shape[0] = INT64_MAX;
	ck_assert_int_eq(dlpc__tensor_nbytes(2, 1, shape, 1, &nb), 0);
	ck_assert_uint_eq(nb, UINT64_C(1) << 61);
	ck_assert_int_eq(dlpc__tensor_nbytes(4, 1, shape, 1, &nb), -EOVERFLOW);
	shape[0] = INT64_C(1) << 32;
	shape[1] = INT64_C(1) << 32;
	ck_assert_int_eq(dlpc__tensor_nbytes(8, 1, shape, 2, &nb), -EOVERFLOW);
	ck_assert_int_eq(dlpc__tensor_nbytes(UINT32_MAX, UINT32_MAX, shape, 1, &nb), -EOVERFLOW);
	/* a zero extent anywhere makes 0 bytes, but the other extents' product must still fit
	 * an int64 (strides are computed from it); a negative extent anywhere is invalid */
	shape[0] = INT64_MAX;
	shape[1] = 1;
	shape[2] = 0;
	ck_assert_int_eq(dlpc__tensor_nbytes(8, 1, shape, 3, &nb), 0);
	ck_assert_uint_eq(nb, 0);
	shape[0] = 0;
	shape[1] = INT64_C(1) << 62;
	shape[2] = INT64_C(1) << 62;
	ck_assert_int_eq(dlpc__tensor_nbytes(8, 1, shape, 3, &nb), -EOVERFLOW);
	shape[0] = INT64_MAX;
	shape[1] = INT64_MAX;
	shape[2] = -1;
	ck_assert_int_eq(dlpc__tensor_nbytes(8, 1, shape, 3, &nb), -EINVAL);

	/* Zero bits or lanes, and too many dimensions. */
	ck_assert_int_eq(dlpc__tensor_nbytes(0, 1, NULL, 0, &nb), -EINVAL);
	ck_assert_int_eq(dlpc__tensor_nbytes(8, 0, NULL, 0, &nb), -EINVAL);
	for (int i = 0; i <= DLPC_NDIM_MAX; i++)
		shape[i] = 1;
	ck_assert_int_eq(dlpc__tensor_nbytes(16, 1, shape, DLPC_NDIM_MAX, &nb), 0);
	ck_assert_uint_eq(nb, 2);
	ck_assert_int_eq(dlpc__tensor_nbytes(16, 1, shape, DLPC_NDIM_MAX + 1, &nb), -EINVAL);
}
END_TEST

START_TEST(test_align_up)
{
	uint64_t r;

	ck_assert_uint_eq(DLPC_ALIGN & (DLPC_ALIGN - 1), 0);
	ck_assert(dlpc__align_up(0, &r));
	ck_assert_uint_eq(r, 0);
	ck_assert(dlpc__align_up(1, &r));
	ck_assert_uint_eq(r, DLPC_ALIGN);
	ck_assert(dlpc__align_up(DLPC_ALIGN - 1, &r));
	ck_assert_uint_eq(r, DLPC_ALIGN);
	ck_assert(dlpc__align_up(DLPC_ALIGN, &r));
	ck_assert_uint_eq(r, DLPC_ALIGN);
	ck_assert(dlpc__align_up(DLPC_ALIGN + 1, &r));
	ck_assert_uint_eq(r, 2 * DLPC_ALIGN);
	/* The largest aligned value is reachable; anything past it overflows. */
	ck_assert(dlpc__align_up(UINT64_MAX - DLPC_ALIGN + 1, &r));
	ck_assert_uint_eq(r, UINT64_MAX - DLPC_ALIGN + 1);
	ck_assert(dlpc__align_up(UINT64_MAX - 2 * DLPC_ALIGN + 2, &r));
	ck_assert_uint_eq(r, UINT64_MAX - DLPC_ALIGN + 1);
	ck_assert(!dlpc__align_up(UINT64_MAX - DLPC_ALIGN + 2, &r));
	ck_assert(!dlpc__align_up(UINT64_MAX, &r));
}
END_TEST

START_TEST(test_printable)
{
	static const uint8_t in[] = "a b\n\\\x7f\x01~\t";
	char buf[64], tiny[10];

	ck_assert_ptr_eq(dlpc__printable(in, sizeof(in) - 1, buf, sizeof(buf)), buf);
	ck_assert_str_eq(buf, "a b\\x0a\\x5c\\x7f\\x01~\\x09");
	ck_assert_str_eq(dlpc__printable(in, 0, buf, sizeof(buf)), "");
	ck_assert_str_eq(dlpc__printable((const uint8_t *)"x\0y", 3, buf, sizeof(buf)), "x\\x00y");
	/* valid UTF-8 passes through; bytes of invalid UTF-8 are escaped */
	ck_assert_str_eq(dlpc__printable((const uint8_t *)"caf\xc3\xa9", 5, buf, sizeof(buf)),
			 "caf\xc3\xa9");
	ck_assert_str_eq(dlpc__printable((const uint8_t *)"a\xff", 2, buf, sizeof(buf)), "a\\xff");

	/* Truncation never splits an escape and always leaves a terminated string. */
	memset(tiny, 'z', sizeof(tiny));
	dlpc__printable((const uint8_t *)"\x01\x02\x03", 3, tiny, sizeof(tiny));
	ck_assert_str_eq(tiny, "\\x01\\x02");
	memset(tiny, 'z', sizeof(tiny));
	dlpc__printable((const uint8_t *)"abcdefghijklmnop", 16, tiny, sizeof(tiny));
	ck_assert_uint_lt(strlen(tiny), sizeof(tiny));
	ck_assert_int_eq(strncmp(tiny, "abcdefghij", strlen(tiny)), 0);
	ck_assert_uint_gt(strlen(tiny), 0);

	/* A zero-length buffer is left alone. */
	tiny[0] = 'q';
	ck_assert_ptr_eq(dlpc__printable(in, sizeof(in) - 1, tiny, 0), tiny);
	ck_assert_int_eq(tiny[0], 'q');
}
END_TEST

/* ---- client/base.c: the time left of a deadline ---- */

START_TEST(test_ms_left)
{
	struct timespec dl;
	int64_t left;

	/* rounded up, never past what was asked */
	dlpc__deadline_in(&dl, 1500);
	left = dlpc__ms_left(&dl);
	ck_assert_msg(left > 1400 && left <= 1500, "%lld", (long long)left);
	/* passed: 0 */
	dlpc__deadline_in(&dl, 0);
	dl.tv_sec -= 1;
	ck_assert_int_eq(dlpc__ms_left(&dl), 0);
	/* a timeout of INT64_MAX ms, "for ever", stays one: no overflow to "passed" */
	dlpc__deadline_in(&dl, INT64_MAX);
	ck_assert(dlpc__ms_left(&dl) == INT64_MAX);
	dlpc__deadline_in(&dl, INT64_MAX / 1000);
	left = dlpc__ms_left(&dl);
	ck_assert_msg(left > INT64_MAX / 1000 - 1000 && left <= INT64_MAX / 1000, "%lld",
		      (long long)left);
}
END_TEST

/* dlpc__mono_end(): the end of a timeout, saturated ("for ever" stays that) */
START_TEST(test_mono_end)
{
	int64_t now = dlpc__mono_ms(), end;

	ck_assert(dlpc__mono_end(0) == 0 && dlpc__mono_end(-1) == 0);
	end = dlpc__mono_end(1000);
	ck_assert(end >= now + 1000 && end <= dlpc__mono_ms() + 1000);
	ck_assert(dlpc__mono_end(INT64_MAX) == INT64_MAX);
	ck_assert(dlpc__mono_end(INT64_MAX - now / 2) == INT64_MAX);
}
END_TEST

/* ---- suite ---- */

static Suite *util_suite(void)
{
	Suite *s = suite_create("util");
	TCase *tc = tcase_create("util");

	tcase_set_timeout(tc, 30);
	tcase_add_test(tc, test_utf8);
	tcase_add_test(tc, test_name_key_check);
	tcase_add_test(tc, test_tensor_nbytes);
	tcase_add_test(tc, test_align_up);
	tcase_add_test(tc, test_printable);
	tcase_add_test(tc, test_ms_left);
	tcase_add_test(tc, test_mono_end);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(util_suite());
}
