/* SPDX-License-Identifier: Apache-2.0 */
#include <assert.h>
#include <inttypes.h>
#include <math.h>

#include "json.h"

void json_init(struct json *j, FILE *f)
{
	j->f = f;
	j->depth = 0;
	j->first[0] = true;
	j->key = false;
}

/* Separate a value from the one before it at the same level. */
static void value_begin(struct json *j)
{
	if (j->key) {
		j->key = false;
		return;
	}
	if (!j->first[j->depth])
		fputc(',', j->f);
	j->first[j->depth] = false;
}

static void open_level(struct json *j, char c)
{
	value_begin(j);
	fputc(c, j->f);
	assert(j->depth + 1 < JSON_DEPTH_MAX);
	j->first[++j->depth] = true;
}

void json_obj_begin(struct json *j)
{
	open_level(j, '{');
}

void json_obj_end(struct json *j)
{
	j->depth--;
	fputc('}', j->f);
}

void json_arr_begin(struct json *j)
{
	open_level(j, '[');
}

void json_arr_end(struct json *j)
{
	j->depth--;
	fputc(']', j->f);
}

size_t utf8_seq(const unsigned char *s, size_t len)
{
	uint32_t cp;
	size_t n;

	if (len == 0)
		return 0;
	if (s[0] < 0x80)
		return 1;
	if (s[0] >= 0xc2 && s[0] <= 0xdf)
		n = 2, cp = s[0] & 0x1f;
	else if (s[0] >= 0xe0 && s[0] <= 0xef)
		n = 3, cp = s[0] & 0x0f;
	else if (s[0] >= 0xf0 && s[0] <= 0xf4)
		n = 4, cp = s[0] & 0x07;
	else
		return 0;
	if (len < n)
		return 0;
	for (size_t i = 1; i < n; i++) {
		if ((s[i] & 0xc0) != 0x80)
			return 0;
		cp = cp << 6 | (s[i] & 0x3f);
	}
	if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
	    (cp >= 0xd800 && cp <= 0xdfff))
		return 0;
	return n;
}

void json_str(struct json *j, const char *str, size_t len)
{
	const unsigned char *s = (const unsigned char *)str;

	value_begin(j);
	fputc('"', j->f);
	for (size_t i = 0; i < len;) {
		size_t n = utf8_seq(s + i, len - i);

		if (n == 0) {
			fputs("\\ufffd", j->f);
			i++;
			continue;
		}
		if (n > 1) {
			fwrite(s + i, 1, n, j->f);
		} else if (s[i] == '"' || s[i] == '\\') {
			fputc('\\', j->f);
			fputc(s[i], j->f);
		} else if (s[i] == '\n') {
			fputs("\\n", j->f);
		} else if (s[i] == '\t') {
			fputs("\\t", j->f);
		} else if (s[i] < 0x20 || s[i] == 0x7f) {
			fprintf(j->f, "\\u%04x", s[i]);
		} else {
			fputc(s[i], j->f);
		}
		i += n;
	}
	fputc('"', j->f);
}

void json_cstr(struct json *j, const char *s)
{
	size_t len = 0;

	while (s[len])
		len++;
	json_str(j, s, len);
}

void json_key(struct json *j, const char *key)
{
	json_cstr(j, key);
	fputc(':', j->f);
	j->key = true;
}

void json_u64(struct json *j, uint64_t v)
{
	value_begin(j);
	fprintf(j->f, "%" PRIu64, v);
}

void json_i64(struct json *j, int64_t v)
{
	value_begin(j);
	fprintf(j->f, "%" PRId64, v);
}

void json_double(struct json *j, double v)
{
	/* JSON has no NaN or infinity */
	if (!isfinite(v)) {
		json_null(j);
		return;
	}
	value_begin(j);
	fprintf(j->f, "%.3f", v);
}

void json_bool(struct json *j, bool v)
{
	value_begin(j);
	fputs(v ? "true" : "false", j->f);
}

void json_null(struct json *j)
{
	value_begin(j);
	fputs("null", j->f);
}

/*
 * Is the UTF-8 sequence at @p s (@p n bytes, valid) one a terminal would act on rather than
 * show: a C0 or C1 control, DEL, or a bidirectional override or isolate (U+202A-U+202E,
 * U+2066-U+2069), which reorder the text around them?
 */
static bool unsafe_seq(const unsigned char *s, size_t n)
{
	if (n == 1)
		return s[0] < 0x20 || s[0] == 0x7f;
	if (n == 2)
		return s[0] == 0xc2 && s[1] < 0xa0; /* U+0080-U+009F */
	if (n == 3 && s[0] == 0xe2 && s[1] == 0x80)
		return s[2] >= 0xaa && s[2] <= 0xae;
	if (n == 3 && s[0] == 0xe2 && s[1] == 0x81)
		return s[2] >= 0xa6 && s[2] <= 0xa9;
	return false;
}

size_t text_put(FILE *f, const char *str, size_t len)
{
	const unsigned char *s = (const unsigned char *)str;
	size_t cols = 0;

	for (size_t i = 0; i < len;) {
		size_t n = utf8_seq(s + i, len - i);

		if (n == 0 || unsafe_seq(s + i, n) || (n == 1 && s[i] == '\\')) {
			/* every byte of it, so the name can be told apart and typed back */
			size_t k = n ? n : 1;

			for (size_t b = 0; b < k; b++)
				if (f)
					fprintf(f, "\\x%02x", s[i + b]);
			cols += 4 * k;
			i += k;
			continue;
		}
		if (f)
			fwrite(s + i, 1, n, f);
		cols++;
		i += n;
	}
	return cols;
}

size_t text_width(const char *s, size_t len)
{
	return text_put(NULL, s, len);
}
