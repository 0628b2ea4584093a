/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A small streaming JSON writer for dlpackctl, and the text escaping both output formats share.
 * Strings are byte strings: valid UTF-8 passes through, control characters are escaped, and a
 * byte that is not part of valid UTF-8 becomes U+FFFD in JSON and \xNN in text.
 */
#ifndef DLPCTL_JSON_H
#define DLPCTL_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define JSON_DEPTH_MAX 16

struct json {
	FILE *f;
	int depth;
	bool first[JSON_DEPTH_MAX]; /* nothing written yet at this level */
	bool key;		    /* a key was just written: the value needs no comma */
};

void json_init(struct json *j, FILE *f);
void json_obj_begin(struct json *j);
void json_obj_end(struct json *j);
void json_arr_begin(struct json *j);
void json_arr_end(struct json *j);
void json_key(struct json *j, const char *key);
void json_str(struct json *j, const char *s, size_t len);
void json_cstr(struct json *j, const char *s);
void json_u64(struct json *j, uint64_t v);
void json_i64(struct json *j, int64_t v);
void json_double(struct json *j, double v);
void json_bool(struct json *j, bool v);
void json_null(struct json *j);

/*
 * Length of the valid UTF-8 sequence (no overlong forms, surrogates or code points above
 * U+10FFFF) at the start of s[0..len), or 0 if the first byte does not begin one.
 */
size_t utf8_seq(const unsigned char *s, size_t len);
/* Write s[0..len) as text for a terminal: control bytes, backslash and bytes that are not valid
 * UTF-8 become \xNN. Returns the columns it takes (one per character). */
size_t text_put(FILE *f, const char *s, size_t len);
/* Columns text_put() would take for s. */
size_t text_width(const char *s, size_t len);

#endif
