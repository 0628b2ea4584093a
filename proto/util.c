/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "limits.h"
#include "util.h"

int64_t dlpc__mono_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t dlpc__mono_end(int64_t timeout_ms)
{
	int64_t now;

	if (timeout_ms <= 0)
		return 0;
	now = dlpc__mono_ms();
	return timeout_ms > INT64_MAX - now ? INT64_MAX : now + timeout_ms;
}

int dlpc__bytes_cmp(const uint8_t *a, size_t alen, const uint8_t *b, size_t blen)
{
	size_t n = alen < blen ? alen : blen;
	int c = n ? memcmp(a, b, n) : 0;

	return c ? c : (alen > blen) - (alen < blen);
}

bool dlpc__utf8_valid(const uint8_t *s, size_t len)
{
	size_t i = 0;

	while (i < len) {
		uint8_t c = s[i];
		uint32_t cp;
		unsigned more;

		if (c == 0)
			return false;
		if (c < 0x80) {
			i++;
			continue;
		}
		if (c >= 0xc2 && c <= 0xdf) {
			more = 1;
			cp = c & 0x1f;
		} else if (c >= 0xe0 && c <= 0xef) {
			more = 2;
			cp = c & 0x0f;
		} else if (c >= 0xf0 && c <= 0xf4) {
			more = 3;
			cp = c & 0x07;
		} else {
			return false;
		}
		if (len - i <= more)
			return false;
		for (unsigned k = 1; k <= more; k++) {
			if ((s[i + k] & 0xc0) != 0x80)
				return false;
			cp = cp << 6 | (s[i + k] & 0x3f);
		}
		/* overlong forms, UTF-16 surrogates, beyond U+10FFFF */
		if ((more == 2 && cp < 0x800) || (more == 3 && cp < 0x10000) ||
		    (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
			return false;
		i += more + 1;
	}
	return true;
}

static int text_check(const char *what, const uint8_t *s, size_t len, size_t min, size_t max,
		      char *why, size_t whylen)
{
	if (len < min) {
		snprintf(why, whylen, "%s is empty", what);
		return -EINVAL;
	}
	if (len > max) {
		snprintf(why, whylen, "%s is %zu bytes, more than the limit of %zu", what, len,
			 max);
		return -EINVAL;
	}
	if (!dlpc__utf8_valid(s, len)) {
		snprintf(why, whylen, "%s is not valid UTF-8 or contains NUL", what);
		return -EINVAL;
	}
	return 0;
}

int dlpc__name_check(const uint8_t *s, size_t len, char *why, size_t whylen)
{
	return text_check("name", s, len, 1, DLPC_NAME_MAX, why, whylen);
}

int dlpc__key_check(const uint8_t *s, size_t len, char *why, size_t whylen)
{
	return text_check("key", s, len, 0, DLPC_KEY_MAX, why, whylen);
}

int dlpc__tensor_nbytes(unsigned bits, unsigned lanes, const int64_t *shape, size_t ndim,
			uint64_t *nbytes)
{
	uint64_t n;

	if (bits == 0 || lanes == 0 || ndim > DLPC_NDIM_MAX)
		return -EINVAL;
	if (__builtin_mul_overflow((uint64_t)bits, (uint64_t)lanes, &n))
		return -EOVERFLOW;
	/* A negative extent is an error wherever it is. The product of the non-zero extents must
	 * fit an int64 even when a zero extent makes the tensor empty: strides are computed from
	 * it. The byte count is 0 if any extent is. */
	int64_t elems = 1;
	bool empty = false;

	for (size_t i = 0; i < ndim; i++)
		if (shape[i] < 0)
			return -EINVAL;
	for (size_t i = 0; i < ndim; i++) {
		if (shape[i] == 0)
			empty = true;
		else if (__builtin_mul_overflow(elems, shape[i], &elems))
			return -EOVERFLOW;
	}
	if (empty)
		n = 0;
	else if (__builtin_mul_overflow(n, (uint64_t)elems, &n))
		return -EOVERFLOW;
	*nbytes = n / 8 + (n % 8 != 0);
	return 0;
}

bool dlpc__align_up(uint64_t x, uint64_t *ret)
{
	if (x > UINT64_MAX - (DLPC_ALIGN - 1))
		return false;
	*ret = (x + DLPC_ALIGN - 1) & ~(uint64_t)(DLPC_ALIGN - 1);
	return true;
}

const char *dlpc__printable(const uint8_t *s, size_t len, char *buf, size_t buflen)
{
	/* well-formed UTF-8 passes through; otherwise every byte above ASCII is escaped too */
	uint8_t top = dlpc__utf8_valid(s, len) ? 0xff : 0x7e;
	size_t o = 0;

	if (buflen == 0)
		return buf;
	for (size_t i = 0; i < len; i++) {
		bool plain = s[i] >= 0x20 && s[i] <= top && s[i] != 0x7f && s[i] != '\\';

		if (plain && o + 1 < buflen)
			buf[o++] = (char)s[i];
		else if (!plain && o + 4 < buflen)
			o += (size_t)snprintf(buf + o, buflen - o, "\\x%02x", s[i]);
		else
			break;
	}
	buf[o] = '\0';
	return buf;
}
