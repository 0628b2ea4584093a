/* SPDX-License-Identifier: Apache-2.0 */
/*
 * dlpc_watch: a connection that sent WATCH and from then on only receives EVENT frames. It is a
 * dlpc_client underneath (so fork handling and connecting are shared), but after the WATCH reply
 * nobody else reads it: dlpc_watch_next() parses the frames itself.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "util.h"

struct dlpc_watch {
	dlpc_client *c;
	int broken;		     /* 0, or the error that finished the watch */
	dlpc_entry_info entry;	     /* the last event's entry, owned here */
	char prefix[DLPC_NAME_TEXT]; /* for messages */
};

DLPC_EXPORT dlpc_watch *dlpc_watch_open(const char *socket_path, const char *prefix, int *err)
{
	Dlpackd__V1__Watch req = DLPACKD__V1__WATCH__INIT;
	Dlpackd__V1__WatchReply *rep;
	dlpc_watch *w;
	int r, dummy;

	err = err ? err : &dummy;
	prefix = prefix ? prefix : "";
	if (strlen(prefix) > DLPC_NAME_MAX) {
		*err = dlpc__fail(-EINVAL, "cannot watch: prefix longer than %d bytes",
				  DLPC_NAME_MAX);
		return NULL;
	}
	w = calloc(1, sizeof(*w));
	if (!w) {
		*err = dlpc__fail(-ENOMEM, "cannot watch: out of memory");
		return NULL;
	}
	dlpc__printable((const uint8_t *)prefix, strlen(prefix), w->prefix, sizeof(w->prefix));
	r = dlpc_connect(socket_path, &w->c);
	if (r < 0)
		goto fail;
	req.prefix.data = (uint8_t *)prefix;
	req.prefix.len = strlen(prefix);
	r = dlpc__call(w->c, DLPC_MSG_WATCH, &req.base, NULL, 0,
		       &dlpackd__v1__watch_reply__descriptor, (ProtobufCMessage **)&rep, NULL,
		       NULL);
	if (r < 0)
		goto fail;
	dlpackd__v1__watch_reply__free_unpacked(rep, NULL);
	*err = 0;
	return w;
fail:
	dlpc_close(w->c);
	free(w);
	*err = r;
	return NULL;
}

DLPC_EXPORT int dlpc_watch_fd(const dlpc_watch *w)
{
	int r;

	if (!w)
		return dlpc__fail(-EINVAL, "dlpc_watch_fd: watch is NULL");
	r = dlpc__check(w->c);
	return r < 0 ? r : w->c->sock;
}

/* Milliseconds left until @p deadline (CLOCK_MONOTONIC), at least 0. */
static int ms_left(const struct timespec *deadline)
{
	struct timespec now;
	int64_t ms;

	clock_gettime(CLOCK_MONOTONIC, &now);
	ms = (deadline->tv_sec - now.tv_sec) * 1000 + (deadline->tv_nsec - now.tv_nsec) / 1000000;
	return ms < 0 ? 0 : ms > INT32_MAX ? INT32_MAX : (int)ms;
}

/* A channel event (protocol 1.6): its name in ev->entry.name, the rest of the entry zero.
 * Consumes @p e. */
static int channel_event(dlpc_watch *w, Dlpackd__V1__Event *e, dlpc_watch_event *ev)
{
	char *name = malloc(e->channel->name.len + 1);

	if (!name) {
		dlpackd__v1__event__free_unpacked(e, NULL);
		return dlpc__fail(-ENOMEM, "watch on '%s': out of memory", w->prefix);
	}
	memcpy(name, e->channel->name.data, e->channel->name.len);
	name[e->channel->name.len] = '\0';
	memset(ev, 0, sizeof(*ev));
	ev->kind = e->kind;
	ev->reason = e->reason;
	ev->seq = e->seq;
	ev->actor_uid = e->actor_uid;
	ev->actor_pid = e->actor_pid;
	dlpackd__v1__event__free_unpacked(e, NULL);
	dlpc__entry_clear(&w->entry);
	memset(&w->entry, 0, sizeof(w->entry));
	w->entry.name = name;
	ev->entry = w->entry;
	return 1;
}

/* Turn one frame into @p ev: 1, or a negative errno with the message set. */
static int take_event(dlpc_watch *w, const struct dlpc__frame *f, dlpc_watch_event *ev)
{
	Dlpackd__V1__Event *e;
	int r;

	if (f->hdr.type == DLPC_MSG_ERROR && f->hdr.id == 0) {
		Dlpackd__V1__Error *err = dlpackd__v1__error__unpack(NULL, f->hdr.len, f->payload);

		r = dlpc__fail(-EPROTO, "watch on '%s' ended: dlpackd said: %s", w->prefix,
			       err ? err->message : "(malformed ERROR)");
		if (err)
			dlpackd__v1__error__free_unpacked(err, NULL);
		return r;
	}
	if (f->hdr.type != DLPC_MSG_EVENT || f->hdr.id != 0 || f->nfds != 0 || f->lost != 0)
		return dlpc__fail(-EPROTO, "watch on '%s': dlpackd sent frame type 0x%x id %u",
				  w->prefix, f->hdr.type, f->hdr.id);
	e = dlpackd__v1__event__unpack(NULL, f->hdr.len, f->payload);
	if (e && e->channel &&
	    (e->kind == DLPC_WATCH_CHANNEL_OPENED || e->kind == DLPC_WATCH_CHANNEL_REMOVED))
		return channel_event(w, e, ev);
	if (!e || !e->entry || e->kind < DLPC_WATCH_PUBLISHED || e->kind > DLPC_WATCH_UNPUBLISHED) {
		if (e)
			dlpackd__v1__event__free_unpacked(e, NULL);
		return dlpc__fail(-EPROTO, "watch on '%s': malformed event from dlpackd",
				  w->prefix);
	}
	memset(ev, 0, sizeof(*ev));
	ev->kind = e->kind;
	ev->reason = e->reason;
	ev->seq = e->seq;
	ev->previous_generation = e->previous_generation;
	ev->actor_uid = e->actor_uid;
	ev->actor_pid = e->actor_pid;
	r = dlpc__entry_fill(&w->entry, e->entry);
	dlpackd__v1__event__free_unpacked(e, NULL);
	if (r < 0) {
		dlpc__entry_clear(&w->entry);
		memset(&w->entry, 0, sizeof(w->entry));
		return dlpc__fail(r, "watch on '%s': out of memory", w->prefix);
	}
	ev->entry = w->entry;
	return 1;
}

DLPC_EXPORT int dlpc_watch_next(dlpc_watch *w, dlpc_watch_event *ev, int timeout_ms)
{
	struct timespec deadline;
	char why[160];
	bool check;
	int r, ms;

	if (!w || !ev)
		return dlpc__fail(-EINVAL, "dlpc_watch_next: NULL argument");
	r = dlpc__check(w->c);
	if (r < 0)
		return r;
	if (w->broken)
		return dlpc__fail(w->broken, "watch on '%s' has ended: %s", w->prefix,
				  dlpc_strerror(w->broken));
	dlpc__entry_clear(&w->entry);
	memset(&w->entry, 0, sizeof(w->entry));
	if (timeout_ms > 0) {
		clock_gettime(CLOCK_MONOTONIC, &deadline);
		deadline.tv_sec += timeout_ms / 1000;
		deadline.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
		if (deadline.tv_nsec >= 1000000000) {
			deadline.tv_sec++;
			deadline.tv_nsec -= 1000000000;
		}
	}
	for (;;) {
		struct pollfd pfd = {.fd = w->c->sock, .events = POLLIN};
		struct dlpc__frame f;
		ssize_t n;

		r = dlpc__rx_next(&w->c->rx, &f, why, sizeof(why));
		if (r == 1) {
			r = take_event(w, &f, ev);
			dlpc__frame_clear(&f);
			break;
		}
		if (r < 0) {
			r = dlpc__fail(r, "watch on '%s': %s", w->prefix, why);
			break;
		}
		ms = timeout_ms > 0 ? ms_left(&deadline) : timeout_ms;
		/* the thread's interrupt check runs at least every DLPC_INTERRUPT_CHECK_MS */
		check = dlpc__interrupt_set() && (ms < 0 || ms > DLPC_INTERRUPT_CHECK_MS);
		r = poll(&pfd, 1, check ? DLPC_INTERRUPT_CHECK_MS : ms);
		if ((r < 0 && errno == EINTR) || (r == 0 && check)) {
			if (!dlpc__interrupt_set() || dlpc__interrupted())
				return dlpc__fail(-EINTR, "watch on '%s': interrupted", w->prefix);
			continue;
		}
		if (r < 0) {
			r = dlpc__fail(-errno, "watch on '%s': poll failed: %m", w->prefix);
			break;
		}
		if (r == 0)
			return 0;
		n = dlpc__rx_read(&w->c->rx, w->c->sock, why, sizeof(why));
		if (n == -EINTR || n == -EAGAIN)
			continue;
		if (n == 0) {
			r = dlpc__fail(-ECONNRESET,
				       "watch on '%s' ended: dlpackd closed the connection (it "
				       "stopped, or this watcher fell more than %u bytes behind)",
				       w->prefix, DLPC_WATCH_QUEUE_MAX);
			break;
		}
		if (n < 0) {
			r = dlpc__fail((int)n, "watch on '%s': %s", w->prefix,
				       n == -EPROTO ? why : strerror((int)-n));
			break;
		}
	}
	if (r < 0)
		w->broken = r;
	return r;
}

DLPC_EXPORT void dlpc_watch_close(dlpc_watch *w)
{
	if (!w)
		return;
	dlpc__entry_clear(&w->entry);
	dlpc_close(w->c);
	free(w);
}
