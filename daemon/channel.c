/* SPDX-License-Identifier: Apache-2.0 */
/* Channels and their queues: the data alone (channel.h says what holds and charges what). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "channel.h"
#include "util.h"

struct dlpd_channel *dlpd_channel_find(struct dlpd_registry *r, const uint8_t *name, size_t len)
{
	uint64_t h = dlpd_hash_bytes(name, len);

	for (struct dlpd_hnode *n = dlpd_hmap_chain(&r->channels, h); n; n = n->next) {
		struct dlpd_channel *ch = dlpd_container_of(n, struct dlpd_channel, node);

		if (n->hash == h && ch->len == len && memcmp(ch->name, name, len) == 0)
			return ch;
	}
	return NULL;
}

struct dlpd_channel *dlpd_channel_new(struct dlpd_registry *r, const uint8_t *name, size_t len,
				      uint32_t capacity, struct dlpd_usage *u)
{
	struct dlpd_channel *ch = calloc(1, sizeof(*ch) + len);
	struct timespec now;

	if (!ch)
		return NULL;
	memcpy(ch->name, name, len);
	ch->len = len;
	ch->capacity = capacity;
	dlpd_list_init(&ch->queue);
	dlpd_list_init(&ch->senders);
	dlpd_list_init(&ch->receivers);
	dlpd_list_init(&ch->producers);
	ch->ends[0] = ch->ends[1] = -1;
	if (dlpd_hmap_insert(&r->channels, &ch->node, dlpd_hash_bytes(name, len)) < 0) {
		free(ch);
		return NULL;
	}
	clock_gettime(CLOCK_REALTIME, &now);
	ch->created_ns = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec;
	ch->usage = u;
	u->entries++;
	u->channels++;
	u->memory += DLPD_CHANNEL_COST + len;
	return ch;
}

void dlpd_channel_free(struct dlpd_registry *r, struct dlpd_channel *ch)
{
	dlpd_assert(ch->depth == 0 && ch->nsenders == 0 && ch->nreceivers == 0);
	dlpd_hmap_remove(&r->channels, &ch->node);
	ch->usage->entries--;
	ch->usage->channels--;
	ch->usage->memory -= DLPD_CHANNEL_COST + ch->len;
	r->freed += DLPD_CHANNEL_COST + ch->len;
	dlpd_usage_put(r, ch->usage);
	free(ch);
}

struct dlpd_channel *dlpd_channel_any(struct dlpd_registry *r, size_t *cursor)
{
	struct dlpd_hnode *n = dlpd_hmap_next(&r->channels, cursor);

	return n ? dlpd_container_of(n, struct dlpd_channel, node) : NULL;
}

static int cmp_channels(const void *a, const void *b)
{
	const struct dlpd_channel *x = *(struct dlpd_channel *const *)a;
	const struct dlpd_channel *y = *(struct dlpd_channel *const *)b;

	return dlpc__bytes_cmp(x->name, x->len, y->name, y->len);
}

int dlpd_channel_range(struct dlpd_registry *r, const uint8_t *prefix, size_t plen,
		       const uint8_t *after, size_t alen, size_t limit, struct dlpd_channel ***ret,
		       size_t *n)
{
	struct dlpd_channel **v = NULL;
	size_t count = 0;

	*ret = NULL;
	*n = 0;
	if (r->channels.count == 0)
		return 0;
	v = malloc(r->channels.count * sizeof(*v));
	if (!v)
		return -ENOMEM;
	/* every chain of every bucket (dlpd_hmap_next() is for emptying a map) */
	for (size_t b = 0; b < r->channels.nbuckets; b++)
		for (struct dlpd_hnode *hn = r->channels.buckets[b]; hn; hn = hn->next) {
			struct dlpd_channel *ch = dlpd_container_of(hn, struct dlpd_channel, node);

			if (ch->len >= plen && (plen == 0 || memcmp(ch->name, prefix, plen) == 0) &&
			    (alen == 0 || dlpc__bytes_cmp(ch->name, ch->len, after, alen) > 0))
				v[count++] = ch;
		}
	qsort(v, count, sizeof(*v), cmp_channels);
	*ret = v;
	*n = count < limit ? count : limit;
	return 0;
}

void dlpd_channel_push(struct dlpd_registry *r, struct dlpd_channel *ch, struct dlpd_msg *m)
{
	(void)r;
	dlpd_assert(ch->ends[0] < 0); /* a direct channel's messages never pass here */
	m->seq = ++ch->sent;
	dlpd_list_add_tail(&ch->queue, &m->link);
	ch->depth++;
	ch->bytes += m->st->size;
}

struct dlpd_msg *dlpd_channel_pop(struct dlpd_registry *r, struct dlpd_channel *ch)
{
	struct dlpd_msg *m;

	(void)r;
	if (dlpd_list_empty(&ch->queue))
		return NULL;
	m = dlpd_container_of(ch->queue.next, struct dlpd_msg, link);
	dlpd_list_del(&m->link);
	ch->depth--;
	ch->bytes -= m->st->size;
	return m;
}

void dlpd_channel_info(const struct dlpd_channel *ch, Dlpackd__V1__ChannelInfo *info)
{
	info->name.data = (uint8_t *)ch->name;
	info->name.len = ch->len;
	info->capacity = ch->capacity;
	info->depth = ch->depth;
	info->bytes_queued = ch->bytes;
	info->owner_uid = (uint32_t)ch->uid;
	info->owner_pid = (int32_t)ch->pid;
	info->created_ns = ch->created_ns;
	info->sent = ch->sent;
	info->received = ch->received;
	info->receivers_waiting = ch->nreceivers;
	info->senders_waiting = ch->nsenders;
	info->producers = ch->producing;
	info->producers_closed = ch->closed;
	info->producers_expected = ch->expected ? ch->expected : 1;
	if (ch->ended)
		info->flags |= DLPC_CHANNEL_ENDED;
	info->flags |= ch->fallback;
}
