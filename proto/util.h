/* SPDX-License-Identifier: Apache-2.0 */
/* Checks and helpers that daemon and library must apply identically. */
#ifndef DLPC_PROTO_UTIL_H
#define DLPC_PROTO_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Monotonic milliseconds. */
int64_t dlpc__mono_ms(void);
/* dlpc__mono_ms() when @p timeout_ms (> 0) will have passed, INT64_MAX where that is further
 * than it can say; 0 (no end) for a timeout <= 0. */
int64_t dlpc__mono_end(int64_t timeout_ms);
/* Byte-wise order of two strings, shorter first on a tie; either may be NULL when empty. */
int dlpc__bytes_cmp(const uint8_t *a, size_t alen, const uint8_t *b, size_t blen);
/* Is s[0..len) well-formed UTF-8 (no overlongs, surrogates or NUL)? */
bool dlpc__utf8_valid(const uint8_t *s, size_t len);
/* 0 if an entry name is acceptable, else -EINVAL with the reason in why. */
int dlpc__name_check(const uint8_t *s, size_t len, char *why, size_t whylen);
/* Same for a bundle key (may be empty). */
int dlpc__key_check(const uint8_t *s, size_t len, char *why, size_t whylen);
/*
 * Bytes of a C-contiguous tensor: ceil(prod(shape) * bits * lanes / 8). 0 or -EINVAL (negative
 * extent, zero bits or lanes, ndim over DLPC_NDIM_MAX) or -EOVERFLOW.
 */
int dlpc__tensor_nbytes(unsigned bits, unsigned lanes, const int64_t *shape, size_t ndim,
			uint64_t *nbytes);
/* x rounded up to DLPC_ALIGN; false on overflow. */
bool dlpc__align_up(uint64_t x, uint64_t *ret);
/* Copy s[0..len) into buf as printable text for log and error lines: control bytes, backslash
 * and, unless s is valid UTF-8, every byte above ASCII become \xNN. Truncates to fit. */
const char *dlpc__printable(const uint8_t *s, size_t len, char *buf, size_t buflen);

#endif
