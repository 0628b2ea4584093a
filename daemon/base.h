/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What every daemon file may use and what uses nothing of the daemon's: intrusive lists, the
 * hash map (hmap.c), logging (log.c), the monotonic clock and dlpd_assert().
 */
#ifndef DLPD_BASE_H
#define DLPD_BASE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <syslog.h>
#include <time.h>

/*
 * An invariant, or a precondition a header states: checked in every build (NDEBUG or not), so
 * cheap ones only. A daemon that broke one would go on with corrupt state: it stops instead,
 * saying where.
 */
#define dlpd_assert(cond)                                                                          \
	((cond) ? (void)0 : dlpd_assert_failed(#cond, __FILE__, __LINE__, __func__))

__attribute__((noreturn, cold)) static inline void
dlpd_assert_failed(const char *cond, const char *file, int line, const char *func)
{
	fprintf(stderr, "dlpackd: %s:%d: %s: assertion failed: %s\n", file, line, func, cond);
	abort();
}

/* ---- intrusive doubly linked list ---- */
struct dlpd_list {
	struct dlpd_list *prev, *next;
};

static inline void dlpd_list_init(struct dlpd_list *l)
{
	l->prev = l->next = l;
}

static inline bool dlpd_list_empty(const struct dlpd_list *l)
{
	return l->next == l;
}

static inline void dlpd_list_add_tail(struct dlpd_list *head, struct dlpd_list *n)
{
	n->prev = head->prev;
	n->next = head;
	head->prev->next = n;
	head->prev = n;
}

static inline void dlpd_list_del(struct dlpd_list *n)
{
	n->prev->next = n->next;
	n->next->prev = n->prev;
	dlpd_list_init(n);
}

#define dlpd_container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

/* ---- intrusive hash map (hmap.c): the caller hashes and compares, the map only chains ---- */
struct dlpd_hnode {
	struct dlpd_hnode *next;
	uint64_t hash;
};

struct dlpd_hmap {
	struct dlpd_hnode **buckets;
	size_t nbuckets; /* 0 or a power of two */
	size_t count;
};

void dlpd_hmap_init(struct dlpd_hmap *m);
/* Free the bucket array; the nodes belong to the caller. */
void dlpd_hmap_clear(struct dlpd_hmap *m);
/* Insert; 0 or -ENOMEM (then the map is unchanged). */
int dlpd_hmap_insert(struct dlpd_hmap *m, struct dlpd_hnode *n, uint64_t hash);
void dlpd_hmap_remove(struct dlpd_hmap *m, struct dlpd_hnode *n);
/* A node in a bucket at or after *@p from (which is advanced to it), for emptying the map:
 * start at 0 and remove each node returned. NULL when none is left. */
struct dlpd_hnode *dlpd_hmap_next(const struct dlpd_hmap *m, size_t *from);
/* First node of the chain that may hold @p hash (compare n->hash, then the key). */
struct dlpd_hnode *dlpd_hmap_chain(const struct dlpd_hmap *m, uint64_t hash);
uint64_t dlpd_hash_bytes(const uint8_t *p, size_t len);
uint64_t dlpd_hash_u64(uint64_t x);

/* ---- logging (log.c) ---- */
extern int dlpd_log_level;
void dlpd_log_init(void);
void dlpd_log(int prio, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Parse "err", "warning", "notice", "info", "debug" (or 3..7). -1 if unknown. */
int dlpd_log_parse_level(const char *s);

/* Monotonic milliseconds. */
static inline uint64_t dlpd_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

#endif
