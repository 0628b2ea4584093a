/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Recycled buffers for channel messages (protocol 1.6): dlpc_channel_alloc() hands out host
 * memory from a pool of the connection's, and a message sent from it carries the buffer's pool
 * token. Once a receiver has released the message (or the channel dropped it), dlpackd sends
 * the token back in a RECLAIM notice and the buffer is free to be filled again: a steady
 * pipeline stops asking the kernel for fresh pages.
 *
 * A pooled buffer stays mapped writable here, so a pooled message is not sealed read-only: its
 * sender can write it while a receiver reads (the price of skipping fresh pages, as with
 * torch.multiprocessing). Its sender only: a message carries a read-only descriptor of the
 * buffer (pool_readonly()), which no receiver can map writable, write, or reopen writable, so
 * that nothing a receiver does reaches the receivers of the buffer's later messages. dlpackd
 * refuses a pooled message whose descriptor is writable. Ordinary publishes and sends stay
 * sealed read-only.
 *
 * The pool holds one reference on each buffer's region. A buffer is free when no message of
 * it is in flight and nobody else holds its region (no view handed out is alive).
 *
 * A buffer whose message may be queued but whose RECLAIM can no longer come (the connection
 * that sent it was lost, or its SEND got no answer) leaves the pool: it is never handed out
 * again, and its memory goes when the message and the views let go of it. Tokens carry a
 * serial besides the slot, so a late RECLAIM of a buffer that left never frees the one that
 * took its slot.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"
#include "util.h"

struct pool_buf {
	struct dlpc__region *r;
	bool in_flight; /* sent: waiting for its RECLAIM */
};

struct dlpc__pool {
	pthread_mutex_t mu;
	struct pool_buf bufs[DLPC_POOL_BUFFERS_MAX]; /* r NULL: an empty slot */
	unsigned n;
	uint64_t serial; /* of the last buffer made */
};

/* A token: DLPC__POOL_TOKEN, a serial, and the slot in the low POOL_SLOT_BITS. */
#define POOL_SLOT_BITS 8
_Static_assert(DLPC_POOL_BUFFERS_MAX <= (1 << POOL_SLOT_BITS), "pool slots fit a token");

static unsigned token_slot(uint64_t token)
{
	return (unsigned)(token & ((1u << POOL_SLOT_BITS) - 1));
}

/* The pool of @p c, made on first use; NULL on ENOMEM. */
static struct dlpc__pool *pool_of(dlpc_client *c)
{
	struct dlpc__pool *p;

	pthread_mutex_lock(&c->mu);
	p = c->pool;
	if (!p) {
		p = calloc(1, sizeof(*p));
		if (p) {
			pthread_mutex_init(&p->mu, NULL);
			c->pool = p;
		}
	}
	pthread_mutex_unlock(&c->mu);
	return p;
}

void dlpc__pool_free(struct dlpc__pool *p)
{
	if (!p)
		return;
	for (unsigned i = 0; i < p->n; i++)
		if (p->bufs[i].r)
			dlpc__region_unref(p->bufs[i].r);
	pthread_mutex_destroy(&p->mu);
	free(p);
}

static bool buf_free(const struct pool_buf *b)
{
	return b->r && !b->in_flight && atomic_load(&b->r->refs) == 1;
}

/* The smallest free buffer of at least @p size bytes (and at most twice that), or NULL. Under
 * p->mu. */
static struct pool_buf *find_free(struct dlpc__pool *p, uint64_t size)
{
	struct pool_buf *best = NULL;

	for (unsigned i = 0; i < p->n; i++) {
		struct pool_buf *b = &p->bufs[i];

		if (buf_free(b) && b->r->len >= size && b->r->len / 2 <= size &&
		    (!best || b->r->len < best->r->len))
			best = b;
	}
	return best;
}

/* An empty slot (its buffer left the pool), or NULL. Under p->mu. */
static struct pool_buf *find_empty(struct dlpc__pool *p)
{
	for (unsigned i = 0; i < p->n; i++)
		if (!p->bufs[i].r)
			return &p->bufs[i];
	return NULL;
}

/* A free buffer's slot to replace: the smallest free one, or NULL. Under p->mu. */
static struct pool_buf *find_evictable(struct dlpc__pool *p)
{
	struct pool_buf *best = NULL;

	for (unsigned i = 0; i < p->n; i++)
		if (buf_free(&p->bufs[i]) && (!best || p->bufs[i].r->len < best->r->len))
			best = &p->bufs[i];
	return best;
}

/*
 * Make the descriptor that the messages of new pooled buffer @p r carry: r->pool_fd, an
 * O_RDONLY reopen of its memfd through /proc/self/fd. No mapping of it can become writable, and
 * write(), ftruncate() and fallocate() refuse it. Reopening a memfd through /proc/PID/fd checks
 * the file's mode, not the descriptor's, so the memfd loses its write permission bits too: a
 * receiver of another uid cannot reopen it read-write through its own /proc/self/fd (one of
 * this uid could give the bits back: it may as well write into this process). Our own mapping,
 * made from the read-write descriptor before, stays writable. 0, or -1 where /proc is not
 * mounted (or the mode cannot change): the buffer cannot be pooled then.
 */
static int pool_readonly(struct dlpc__region *r)
{
	char path[32];

	snprintf(path, sizeof(path), "/proc/self/fd/%d", r->fd);
	r->pool_fd = open(path, O_RDONLY | O_CLOEXEC);
	if (r->pool_fd < 0)
		return -1;
	if (fchmod(r->fd, 0444) < 0) {
		close(r->pool_fd);
		r->pool_fd = -1;
		return -1;
	}
	return 0;
}

/* Read what dlpackd has sent (RECLAIM notices) without waiting. */
static void drain(dlpc_client *c)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	pthread_mutex_lock(&c->mu);
	if (!c->broken && !c->closed)
		dlpc__reader_turn(c, &now);
	pthread_mutex_unlock(&c->mu);
}

/* The region of a free buffer of @p p of at least @p size bytes, taken: with a reference of the
 * caller's, got under p->mu, so that no other thread finds the buffer free meanwhile (nor
 * evicts it). NULL if none is. */
static struct dlpc__region *take_free(struct dlpc__pool *p, uint64_t size)
{
	struct pool_buf *b;

	pthread_mutex_lock(&p->mu);
	b = find_free(p, size);
	if (b)
		dlpc__region_ref(b->r);
	pthread_mutex_unlock(&p->mu);
	return b ? b->r : NULL;
}

/* take_free(), and when no buffer is free, again after reading the RECLAIM notices that may
 * wait in the socket of @p c. */
static struct dlpc__region *find_reusable(dlpc_client *c, struct dlpc__pool *p, uint64_t size)
{
	struct dlpc__region *r = take_free(p, size);

	if (!r) {
		drain(c);
		r = take_free(p, size);
	}
	return r;
}

/* Give the new region @p r (with its read-only descriptor) of @p c a slot of the pool @p p and a
 * pool token. The pool takes the caller's reference to @p r, and the caller gets one of its own
 * (taken under p->mu, as take_free() does). Without a slot to spare, @p r goes and -ENOBUFS
 * comes. */
static int pool_add(dlpc_client *c, struct dlpc__pool *p, struct dlpc__region *r,
		    const char *channel)
{
	struct pool_buf *slot;

	assert(r->pool_fd >= 0);
	pthread_mutex_lock(&p->mu);
	slot = find_empty(p);
	if (!slot && p->n < DLPC_POOL_BUFFERS_MAX)
		slot = &p->bufs[p->n++];
	if (!slot)
		slot = find_evictable(p);
	if (!slot) {
		pthread_mutex_unlock(&p->mu);
		close(r->pool_fd); /* (not a pooled region yet: its unref leaves it) */
		dlpc__region_unref(r);
		return dlpc__fail(-ENOBUFS,
				  "cannot allocate for channel '%s': all %d buffers of this "
				  "connection's pool are in flight or in use "
				  "(DLPC_POOL_BUFFERS_MAX)",
				  channel, DLPC_POOL_BUFFERS_MAX);
	}
	if (slot->r)
		dlpc__region_unref(slot->r);
	/* pool tokens have the top bit set; CUDA reclaim tokens never do */
	p->serial++;
	r->pool_token = DLPC__POOL_TOKEN | ((p->serial << POOL_SLOT_BITS) & ~DLPC__POOL_TOKEN) |
			(uint64_t)(slot - p->bufs);
	r->pool_owner = c;
	slot->r = r;
	slot->in_flight = false;
	dlpc__region_ref(r);
	pthread_mutex_unlock(&p->mu);
	return 0;
}

DLPC_EXPORT int dlpc_channel_alloc(dlpc_client *c, const char *channel, DLDataType dtype,
				   int32_t ndim, const int64_t *shape,
				   DLManagedTensorVersioned **ret)
{
	DLDevice dev = {.device_type = kDLCPU, .device_id = 0};
	struct dlpc__region *r = NULL;
	struct dlpc__endpoint *e;
	struct dlpc__pool *p;
	uint64_t nbytes, size;
	int err, kind;

	if (!c || !ret || ndim < 0 || ndim > DLPC_NDIM_MAX || (ndim > 0 && !shape))
		return dlpc__fail(-EINVAL, "dlpc_channel_alloc: bad arguments (ndim %d)",
				  (int)ndim);
	*ret = NULL;
	if ((err = dlpc__check(c)) < 0 || (err = dlpc__name_arg(channel, "allocate for")) < 0)
		return err;
	kind = dlpc__direct_get(c, channel, &e);
	if (e)
		dlpc__direct_put(c, e);
	/* (a channel that is not there yet may be made queued: its send will tell) */
	if (kind == 1)
		return dlpc__fail(-ENOTSUP,
				  "cannot allocate for channel '%s': it is direct, and recycled "
				  "buffers need a channel dlpackd queues: create it queued "
				  "(DLPC_CHANNEL_QUEUED; in Python, direct=False)",
				  channel);
	if (dlpc__tensor_nbytes(dtype.bits, dtype.lanes, shape, (size_t)ndim, &nbytes) < 0 ||
	    !dlpc__align_up(nbytes, &size) || size > INT64_MAX)
		return dlpc__fail(-EINVAL, "cannot allocate for channel '%s': bad dtype or shape",
				  channel);
	size = size ? size : DLPC_ALIGN;
	p = pool_of(c);
	if (!p)
		return dlpc__fail(-ENOMEM, "cannot allocate for channel '%s': out of memory",
				  channel);
	r = find_reusable(c, p, size);
	if (!r) {
		/* not from the warm pool: the buffer is made once and used again and again */
		err = dlpc__alloc_region(dev, size, "dlpc_channel_alloc", false, &r);
		if (err < 0)
			return err;
		if (pool_readonly(r) < 0) {
			/* no read-only descriptor to send: memory of its own, sealed read-only
			 * when sent, as dlpc_alloc()'s is */
			*ret = dlpc__view_new(r, r->base, dev, dtype, ndim, shape, 0);
			dlpc__region_unref(r);
			return *ret ? 0 : dlpc__fail(-ENOMEM, "dlpc_channel_alloc: out of memory");
		}
		if ((err = pool_add(c, p, r, channel)) < 0)
			return err;
	}
	/* the view holds its own region reference, the pool its own; ours goes */
	*ret = dlpc__view_new(r, r->base, dev, dtype, ndim, shape, 0);
	dlpc__region_unref(r);
	return *ret ? 0 : dlpc__fail(-ENOMEM, "dlpc_channel_alloc: out of memory");
}

void dlpc__pool_sending(dlpc_client *c, uint64_t token, bool sending)
{
	struct dlpc__pool *p = c->pool;
	unsigned i = token_slot(token);

	assert(token & DLPC__POOL_TOKEN);
	if (!p || i >= DLPC_POOL_BUFFERS_MAX)
		return;
	pthread_mutex_lock(&p->mu);
	if (i < p->n && p->bufs[i].r && p->bufs[i].r->pool_token == token)
		p->bufs[i].in_flight = sending;
	pthread_mutex_unlock(&p->mu);
}

/* Take the buffers that @p all (every one in flight) or the one of @p token out of @p c's
 * pool, and let go of the pool's references on them. */
static void pool_leave(dlpc_client *c, bool all, uint64_t token)
{
	struct dlpc__region *gone[DLPC_POOL_BUFFERS_MAX];
	struct dlpc__pool *p;
	unsigned n = 0;

	pthread_mutex_lock(&c->mu);
	p = c->pool;
	pthread_mutex_unlock(&c->mu);
	if (!p)
		return;
	pthread_mutex_lock(&p->mu);
	for (unsigned i = 0; i < p->n; i++) {
		struct pool_buf *b = &p->bufs[i];

		if (b->r && (all ? b->in_flight : b->r->pool_token == token)) {
			gone[n++] = b->r;
			b->r = NULL;
			b->in_flight = false;
		}
	}
	pthread_mutex_unlock(&p->mu);
	for (unsigned i = 0; i < n; i++)
		dlpc__region_unref(gone[i]);
}

void dlpc__pool_lost(dlpc_client *c, uint64_t token)
{
	assert(token & DLPC__POOL_TOKEN);
	pool_leave(c, false, token);
}

void dlpc__pool_reset(dlpc_client *c)
{
	pool_leave(c, true, 0);
}

void dlpc__pool_reclaimed(dlpc_client *c, uint64_t token)
{
	dlpc__pool_sending(c, token, false);
}

static void pool_free_hook(dlpc_client *c)
{
	dlpc__pool_free(c->pool);
}

/* A recycled channel buffer's token: free again. */
static bool pool_reclaimed_hook(dlpc_client *c, uint64_t token)
{
	if (!(token & DLPC__POOL_TOKEN))
		return false;
	dlpc__pool_reclaimed(c, token);
	return true;
}

void dlpc__pool_register(void)
{
	static const struct dlpc__hooks hooks = {
		.reset = dlpc__pool_reset,
		.free = pool_free_hook,
		.reclaimed = pool_reclaimed_hook,
	};

	dlpc__hooks_add(&hooks);
}
