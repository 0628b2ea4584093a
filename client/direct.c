/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Direct channels (protocol 1.8), the library's side: joining a channel and waiting on its ends
 * (a message's way, sending and receiving, is direct_io.c's). A client learns a channel's kind
 * the first time it uses it (CHANNEL JOIN): a direct channel's two socket ends come with the
 * reply and are kept (an endpoint), and a queued channel is remembered as such, so that its SEND
 * and RECV go to the daemon as before with no extra round trip.
 *
 * Endpoints belong to the connection they were joined on: a new connection (reconnect) joins
 * again, as does a use that finds the pair shut (the channel removed, or its sockets shut by a
 * process that joined it: the daemon then makes new ones) or its kind changed (the daemon
 * answers EPROTOTYPE). At most DLPC_DIRECT_ENDPOINTS_MAX channels are remembered per connection.
 * The list, every endpoint until it is freed, and the connections' dups that waits watch change
 * under the lock of the open clients' list, so that a forked child finds them whole and closes
 * what it inherited.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "internal.h"

/* Let go of @p e, no longer listed or used: out of c->all_endpoints under the list lock, then
 * its ends closed. */
static void endpoint_free(dlpc_client *c, struct dlpc__endpoint *e)
{
	dlpc__list_lock();
	assert(e->users == 0 && e->dropped);
	for (struct dlpc__endpoint **pp = &c->all_endpoints; *pp; pp = &(*pp)->all_next)
		if (*pp == e) {
			*pp = e->all_next;
			break;
		}
	dlpc__list_unlock();
	if (e->direct && __atomic_load_n(&e->barred, __ATOMIC_RELAXED)) {
		/* its senders sent fds whose close may block: what is still queued in the pair
		 * (direct_io.c stopped taking it) is let go of with the pair's last close */
		dlpc__close_later(e->ends[0]);
		dlpc__close_later(e->ends[1]);
	} else if (e->direct) {
		dlpc__close(e->ends[0]);
		dlpc__close(e->ends[1]);
	}
	free(e);
}

/* Take @p e out of @p c's list, if it is still there. Under the list lock. */
static void unlink_locked(dlpc_client *c, struct dlpc__endpoint *e)
{
	for (struct dlpc__endpoint **pp = &c->endpoints; *pp; pp = &(*pp)->next)
		if (*pp == e) {
			*pp = e->next;
			e->dropped = true;
			return;
		}
}

void dlpc__direct_put(dlpc_client *c, struct dlpc__endpoint *e)
{
	bool last;

	dlpc__list_lock();
	assert(e->users > 0);
	last = --e->users == 0 && e->dropped;
	dlpc__list_unlock();
	if (last)
		endpoint_free(c, e);
}

/* Forget @p e (the channel went, or changed): the next use joins again. Its user keeps it. */
static void endpoint_drop(dlpc_client *c, struct dlpc__endpoint *e)
{
	dlpc__list_lock();
	unlink_locked(c, e);
	dlpc__list_unlock();
}

void dlpc__direct_reset(dlpc_client *c)
{
	struct dlpc__endpoint *gone = NULL;

	dlpc__list_lock();
	while (c->endpoints) {
		struct dlpc__endpoint *e = c->endpoints;

		c->endpoints = e->next;
		e->dropped = true;
		if (e->users == 0) {
			e->next = gone;
			gone = e;
		}
	}
	dlpc__list_unlock();
	while (gone) {
		struct dlpc__endpoint *e = gone;

		gone = e->next;
		endpoint_free(c, e);
	}
}

void dlpc__direct_forked(dlpc_client *c)
{
	/* the child: whatever held them is the parent's (in use by its threads or not); no other
	 * thread runs here, and the list lock is held */
	while (c->all_endpoints) {
		struct dlpc__endpoint *e = c->all_endpoints;

		c->all_endpoints = e->all_next;
		if (e->direct) {
			dlpc__close(e->ends[0]);
			dlpc__close(e->ends[1]);
		}
		free(e);
	}
	c->endpoints = NULL;
	for (struct dlpc__wait *w = c->watches; w; w = w->next)
		dlpc__close(w->sock);
	c->watches = NULL;
	dlpc__close(c->direct_wake);
	c->direct_wake = -1;
}

void dlpc__direct_forget(dlpc_client *c, const char *name)
{
	struct dlpc__endpoint *gone = NULL;

	dlpc__list_lock();
	for (struct dlpc__endpoint *e = c->endpoints, *next; e; e = next) {
		next = e->next;
		if (strcmp(e->name, name) == 0) {
			unlink_locked(c, e);
			if (e->users == 0) {
				e->next = gone;
				gone = e;
			}
		}
	}
	dlpc__list_unlock();
	while (gone) {
		struct dlpc__endpoint *e = gone;

		gone = e->next;
		endpoint_free(c, e);
	}
}

/* Make room for one more endpoint in @p c's list: the least recently joined unused one goes
 * once DLPC_DIRECT_ENDPOINTS_MAX are there. Under the list lock; what to free after, or NULL. */
static struct dlpc__endpoint *evict_locked(dlpc_client *c)
{
	struct dlpc__endpoint *last = NULL;
	size_t n = 0;

	for (struct dlpc__endpoint *e = c->endpoints; e; e = e->next, n++)
		if (e->users == 0)
			last = e;
	if (n < DLPC_DIRECT_ENDPOINTS_MAX || !last)
		return NULL;
	unlink_locked(c, last);
	return last;
}

/* Ask the daemon what @p name is (CHANNEL JOIN): a direct channel's pair of ends in @p ends (-1
 * each for a queued one), whether its stream has *@p ended, and the *@p conn_seq of the connection
 * that asked. 0, or a negative errno (-ENOENT: no such channel). */
static int ask_join(dlpc_client *c, const char *name, int ends[2], bool *ended, uint64_t *conn_seq)
{
	Dlpackd__V1__Channel req = DLPACKD__V1__CHANNEL__INIT;
	Dlpackd__V1__ChannelReply *rep;
	int more[1] = {-1}, fd = -1, r;
	struct dlpc__call_info info = {.more_fds = more, .nmore_fds = 1};
	bool queued = false;

	*ended = false;
	req.op = DLPC__CHANNEL_JOIN;
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	r = dlpc__call_ex(c, DLPC_MSG_CHANNEL, &req.base, NULL, 0, 0, &info,
			  &dlpackd__v1__channel_reply__descriptor, (ProtobufCMessage **)&rep, &fd,
			  NULL);
	if (r < 0)
		return r;
	/* a queued channel is answered without fds */
	if (rep->channel) {
		*ended = rep->channel->flags & DLPC_CHANNEL_ENDED;
		queued = !(rep->channel->flags & DLPC_CHANNEL_DIRECT);
	}
	dlpackd__v1__channel_reply__free_unpacked(rep, NULL);
	if (queued ? fd >= 0 || more[0] >= 0 : fd < 0 || more[0] < 0) {
		dlpc__close(fd);
		dlpc__close(more[0]);
		return dlpc__fail(-EPROTO,
				  "cannot join channel '%s': dlpackd sent an unusable reply", name);
	}
	ends[0] = fd;
	ends[1] = more[0];
	*conn_seq = info.conn_seq;
	return 0;
}

/* List the endpoint @p e, just joined, in @p c (making room for it), or, when another thread
 * listed one of the same channel meanwhile, free @p e for that one. The endpoint to use. */
static struct dlpc__endpoint *endpoint_add(dlpc_client *c, struct dlpc__endpoint *e)
{
	struct dlpc__endpoint *old = NULL, *dup = NULL;
	uint64_t conn_seq;

	/* c->mu then the list lock (the order every path takes both in): the conn_seq cannot move
	 * meanwhile. Joined on a connection replaced since: used once, never listed. Two threads
	 * may join at once: the one listed first is the one both use. */
	pthread_mutex_lock(&c->mu);
	dlpc__list_lock();
	conn_seq = c->conn_seq;
	for (struct dlpc__endpoint *x = c->endpoints; x && e->conn_seq == conn_seq; x = x->next)
		if (x->conn_seq == conn_seq && strcmp(x->name, e->name) == 0) {
			x->users++;
			dup = e;
			e = x;
			break;
		}
	if (!dup) {
		e->all_next = c->all_endpoints;
		c->all_endpoints = e;
		if (e->conn_seq == conn_seq) {
			old = evict_locked(c);
			e->next = c->endpoints;
			c->endpoints = e;
		} else {
			e->dropped = true;
		}
	}
	dlpc__list_unlock();
	pthread_mutex_unlock(&c->mu);
	if (old)
		endpoint_free(c, old);
	if (dup) {
		if (dup->direct) {
			dlpc__close(dup->ends[0]);
			dlpc__close(dup->ends[1]);
		}
		free(dup);
	}
	return e;
}

/* Ask the daemon what @p name is (CHANNEL JOIN) and remember it. 1 direct, 0 queued, or a
 * negative errno (-ENOENT: no such channel). */
static int join(dlpc_client *c, const char *name, struct dlpc__endpoint **ret)
{
	size_t len = strlen(name);
	struct dlpc__endpoint *e;
	int ends[2] = {-1, -1}, r;
	bool ended = false;
	uint64_t conn_seq = 0;

	r = ask_join(c, name, ends, &ended, &conn_seq);
	if (r < 0)
		return r;
	e = calloc(1, sizeof(*e) + len + 1);
	if (!e) {
		dlpc__close(ends[0]);
		dlpc__close(ends[1]);
		return dlpc__fail(-ENOMEM, "cannot join channel '%s': out of memory", name);
	}
	memcpy(e->name, name, len + 1);
	e->conn_seq = conn_seq;
	e->direct = ends[0] >= 0;
	e->ended = ended;
	e->ends[0] = ends[0];
	e->ends[1] = ends[1];
	e->users = 1;
	*ret = endpoint_add(c, e);
	return (*ret)->direct;
}

int dlpc__direct_get(dlpc_client *c, const char *name, struct dlpc__endpoint **ret)
{
	uint64_t conn_seq;
	bool closed, broken;

	*ret = NULL;
	pthread_mutex_lock(&c->mu);
	conn_seq = c->conn_seq;
	closed = c->closed;
	broken = c->broken != 0;
	pthread_mutex_unlock(&c->mu);
	/* dlpc_cancel() ends every call after it, a direct one that need not wait too */
	if (closed)
		return dlpc__fail(-ECANCELED, "this client was closed or canceled (dlpc_close() "
					      "or dlpc_cancel())");
	/* the connection is lost: what it joined went with its daemon; asking anew connects again
	 * (DLPC_CONNECT_RECONNECT) or says why not */
	if (broken)
		return join(c, name, ret);
	dlpc__list_lock();
	for (struct dlpc__endpoint *e = c->endpoints; e; e = e->next)
		if (e->conn_seq == conn_seq && strcmp(e->name, name) == 0) {
			e->users++;
			dlpc__list_unlock();
			*ret = e;
			return e->direct;
		}
	dlpc__list_unlock();
	return join(c, name, ret);
}

void dlpc__direct_changed(dlpc_client *c, struct dlpc__endpoint *e)
{
	endpoint_drop(c, e);
}

/* ---- waiting on an end ---- */

int dlpc__direct_watch_start(dlpc_client *c, struct dlpc__wait *w)
{
	int r = 0;

	pthread_mutex_lock(&c->mu);
	if (c->direct_wake < 0)
		c->direct_wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	w->wake = c->direct_wake;
	/* listed before the dup is made, under the lock fork() takes: a child finds it */
	dlpc__list_lock();
	w->sock = c->broken ? -1 : fcntl(c->sock, F_DUPFD_CLOEXEC, 0);
	if (c->closed)
		r = -ECANCELED;
	else if (c->broken)
		r = -ECONNRESET;
	else if (w->wake < 0 || w->sock < 0)
		r = -errno;
	if (r == 0) {
		w->next = c->watches;
		c->watches = w;
	} else {
		dlpc__close(w->sock);
		w->sock = -1;
	}
	dlpc__list_unlock();
	pthread_mutex_unlock(&c->mu);
	return r;
}

void dlpc__direct_watch_end(dlpc_client *c, struct dlpc__wait *w)
{
	if (w->sock < 0)
		return;
	dlpc__list_lock();
	for (struct dlpc__wait **pp = &c->watches; *pp; pp = &(*pp)->next)
		if (*pp == w) {
			*pp = w->next;
			break;
		}
	dlpc__close(w->sock);
	w->sock = -1;
	dlpc__list_unlock();
}

/*
 * Wait until @p fd is ready for @p events, until @p end (monotonic ms; 0: forever), or until the
 * client is closed, the daemon goes away or the thread's interrupt check says to stop (checked
 * when due at *@p check_at). 0 when ready, or for POLLOUT when it is time to try again;
 * -ETIMEDOUT, -ECANCELED, -ECONNRESET, -EINTR.
 */
int dlpc__direct_wait_end(dlpc_client *c, const struct dlpc__wait *w, int fd, short events,
			  int64_t end, int64_t *check_at)
{
	for (;;) {
		struct pollfd p[3] = {{.fd = fd, .events = events},
				      {.fd = w->wake, .events = POLLIN},
				      {.fd = w->sock, .events = POLLRDHUP}};
		int64_t left = end ? end - dlpc__mono_ms() : -1;
		/* The kernel tells a writer of a Unix datagram socket only once its buffer is three
		 * quarters free: a sender looks again every DLPC_DIRECT_RETRY_MS instead */
		int ms = events == POLLOUT ? DLPC_DIRECT_RETRY_MS : DLPC_INTERRUPT_CHECK_MS, r;

		if (end && left <= 0)
			return -ETIMEDOUT;
		if (left >= 0 && left < ms)
			ms = (int)left;
		r = poll(p, 3, ms);
		if (r == 0 && events == POLLOUT) {
			int64_t now = dlpc__mono_ms();

			if (now < *check_at)
				return 0;
			*check_at = now + DLPC_INTERRUPT_CHECK_MS;
			return dlpc__interrupted() ? -EINTR : 0;
		}
		if (r < 0 && errno != EINTR)
			return -errno;
		if (r > 0 && p[1].revents) {
			bool closed;

			pthread_mutex_lock(&c->mu);
			closed = c->closed;
			pthread_mutex_unlock(&c->mu);
			if (closed)
				return -ECANCELED;
		}
		if (r > 0 && (p[2].revents & (POLLRDHUP | POLLHUP | POLLERR))) {
			/* the connection is gone: so the next call knows (and, with
			 * DLPC_CONNECT_RECONNECT, connects anew) */
			pthread_mutex_lock(&c->mu);
			if (!c->broken) {
				c->broken = -ECONNRESET;
				pthread_cond_broadcast(&c->cv);
				dlpc__wake_reader(c);
			}
			pthread_mutex_unlock(&c->mu);
			return -ECONNRESET;
		}
		if (r > 0 && p[0].revents)
			return 0;
		if (dlpc__interrupted())
			return -EINTR;
	}
}

/* The error of a wait that did not end ready, in words naming @p verb and @p channel. */
int dlpc__direct_wait_failed(int r, const char *verb, const char *channel, int64_t timeout)
{
	switch (r) {
	case -ETIMEDOUT:
		return dlpc__fail(r, "cannot %s channel '%s': nothing came within %lld ms", verb,
				  channel, (long long)timeout);
	case -ECANCELED:
		return dlpc__fail(r,
				  "cannot %s channel '%s': this client was closed or canceled "
				  "(dlpc_close() or dlpc_cancel()) while the call waited",
				  verb, channel);
	case -ECONNRESET:
		return dlpc__fail(
			r,
			"cannot %s channel '%s': the connection to dlpackd was lost while "
			"the call waited (the channel went with the daemon)",
			verb, channel);
	case -EINTR:
		return dlpc__fail(r, "cannot %s channel '%s': interrupted", verb, channel);
	default:
		return dlpc__fail(r, "cannot %s channel '%s': %s", verb, channel, strerror(-r));
	}
}

/* dlpc_close(), dlpc_cancel(): every wait on a direct channel's end ends. Under c->mu. */
static void direct_cancel(dlpc_client *c)
{
	if (c->direct_wake >= 0 && eventfd_write(c->direct_wake, 1) < 0) {
		/* the counter cannot overflow here; nothing to do */
	}
}

static void direct_free(dlpc_client *c)
{
	dlpc__direct_reset(c);
	dlpc__close(c->direct_wake);
}

static void direct_fork(dlpc_client *c, int phase)
{
	if (phase == 2)
		dlpc__direct_forked(c);
}

void dlpc__direct_register(void)
{
	static const struct dlpc__hooks hooks = {
		.reset = dlpc__direct_reset,
		.cancel = direct_cancel,
		.free = direct_free,
		.fork = direct_fork,
	};

	dlpc__hooks_add(&hooks);
}
