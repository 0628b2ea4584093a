/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <stdlib.h>

#include "base.h"

void dlpd_hmap_init(struct dlpd_hmap *m)
{
	m->buckets = NULL;
	m->nbuckets = 0;
	m->count = 0;
}

void dlpd_hmap_clear(struct dlpd_hmap *m)
{
	free(m->buckets);
	dlpd_hmap_init(m);
}

static int grow(struct dlpd_hmap *m)
{
	size_t nb = m->nbuckets ? m->nbuckets * 2 : 16;
	struct dlpd_hnode **b = calloc(nb, sizeof(*b));

	if (!b)
		return -ENOMEM;
	for (size_t i = 0; i < m->nbuckets; i++) {
		struct dlpd_hnode *n = m->buckets[i], *next;

		for (; n; n = next) {
			next = n->next;
			n->next = b[n->hash & (nb - 1)];
			b[n->hash & (nb - 1)] = n;
		}
	}
	free(m->buckets);
	m->buckets = b;
	m->nbuckets = nb;
	return 0;
}

int dlpd_hmap_insert(struct dlpd_hmap *m, struct dlpd_hnode *n, uint64_t hash)
{
	struct dlpd_hnode **slot;

	/* keep the load factor at or below 1; a failed grow is fatal only for the first bucket */
	if (m->count >= m->nbuckets && grow(m) < 0 && m->nbuckets == 0)
		return -ENOMEM;
	n->hash = hash;
	slot = &m->buckets[hash & (m->nbuckets - 1)];
	n->next = *slot;
	*slot = n;
	m->count++;
	return 0;
}

void dlpd_hmap_remove(struct dlpd_hmap *m, struct dlpd_hnode *n)
{
	struct dlpd_hnode **pp = &m->buckets[n->hash & (m->nbuckets - 1)];

	while (*pp != n)
		pp = &(*pp)->next;
	*pp = n->next;
	m->count--;
}

struct dlpd_hnode *dlpd_hmap_next(const struct dlpd_hmap *m, size_t *from)
{
	for (; *from < m->nbuckets; ++*from)
		if (m->buckets[*from])
			return m->buckets[*from];
	return NULL;
}

struct dlpd_hnode *dlpd_hmap_chain(const struct dlpd_hmap *m, uint64_t hash)
{
	return m->nbuckets ? m->buckets[hash & (m->nbuckets - 1)] : NULL;
}

uint64_t dlpd_hash_bytes(const uint8_t *p, size_t len)
{
	uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */

	for (size_t i = 0; i < len; i++)
		h = (h ^ p[i]) * 0x100000001b3ull;
	return dlpd_hash_u64(h);
}

uint64_t dlpd_hash_u64(uint64_t x)
{
	/* a 64-bit finalizer: every input bit affects every output bit */
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	x ^= x >> 33;
	return x;
}
