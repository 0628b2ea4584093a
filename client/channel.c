/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Channels (protocol 1.6): dlpc_send() lays a message out as a publish would (publish.c) and
 * sends it with SEND instead of PUBLISH; dlpc_recv() maps a RECV reply as an attach would
 * (attach.c); dlpc_channel_*() open, remove, describe and list channels.
 */
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "internal.h"

#define OP_OPEN 1
#define OP_REMOVE 2
#define OP_STAT 3
#define OPEN_FLAGS (DLPC_CHANNEL_DIRECT | DLPC_CHANNEL_QUEUED | DLPC_CHANNEL_PREFER_DIRECT)
#define SEND_FLAGS DLPC_SEND_NOWAIT
/* The public attach flags dlpc_recv() takes: all acted on here (a RECV carries only
 * DLPC_WIRE_RECV_FLAGS, which the library sets). Not DLPC_ATTACH_WRITABLE: a message is
 * read-only to its receivers (sealed, or a pooled buffer's read-only descriptor). */
#define API_RECV_FLAGS                                                                             \
	(DLPC_ATTACH_PRIVATE | DLPC_ATTACH_GUARDED | DLPC_ATTACH_NO_CACHE | DLPC_ATTACH_POPULATE)

/* The message publish.c or attach.c set says "cannot publish 'NAME'" or "cannot attach 'NAME'":
 * say "cannot send to channel 'NAME'" (or receive from) instead. Returns @p r. */
static int reword(int r, const char *from, const char *to, const char *name)
{
	char old[DLPC_ERROR_TEXT_MAX], head[DLPC_NAME_MAX + 32];
	size_t hl;

	snprintf(head, sizeof(head), "%s '%s'", from, name);
	hl = strlen(head);
	snprintf(old, sizeof(old), "%s", dlpc_last_error());
	if (strncmp(old, head, hl) != 0)
		return r;
	return dlpc__fail(r, "%s channel '%s'%s", to, name, old + hl);
}

static void info_fill(dlpc_channel_info *out, const Dlpackd__V1__ChannelInfo *in)
{
	dlpc_channel_info i = {.size = sizeof(i)};
	size_t len = in->name.len < DLPC_NAME_MAX ? in->name.len : DLPC_NAME_MAX;

	i.capacity = in->capacity;
	i.depth = in->depth;
	i.receivers_waiting = in->receivers_waiting;
	i.senders_waiting = in->senders_waiting;
	i.owner_uid = in->owner_uid;
	i.owner_pid = in->owner_pid;
	i.bytes_queued = in->bytes_queued;
	i.sent = in->sent;
	i.received = in->received;
	i.created_ns = in->created_ns;
	i.flags = in->flags;
	i.producers = in->producers;
	i.producers_closed = in->producers_closed;
	i.producers_expected = in->producers_expected;
	memcpy(i.name, in->name.data, len);
	i.name[len] = '\0';
	/* only as much as the caller's struct holds, keeping its size field */
	memcpy((char *)out + sizeof(out->size), (char *)&i + sizeof(i.size),
	       (out->size < sizeof(i) ? out->size : sizeof(i)) - sizeof(i.size));
}

/* One CHANNEL request; fills @p info if not NULL. 1 if it created the channel, 0, or negative
 * errno. */
static int channel_call(dlpc_client *c, uint32_t op, const char *name, uint32_t capacity,
			uint32_t flags, uint32_t producers, dlpc_channel_info *info,
			const char *what)
{
	Dlpackd__V1__Channel req = DLPACKD__V1__CHANNEL__INIT;
	Dlpackd__V1__ChannelReply *rep;
	struct dlpc__call_info cinfo = {0};
	int r;

	if (!c)
		return dlpc__fail(-EINVAL, "cannot %s channel: client is NULL", what);
	if (info && info->size < offsetof(dlpc_channel_info, depth))
		return dlpc__fail(-EINVAL, "cannot %s channel '%s': info->size is %u", what,
				  name ? name : "", info->size);
	r = dlpc__check(c);
	if (r == 0)
		r = dlpc__name_arg(name, "name a channel");
	if (r < 0)
		return r;
	req.op = op;
	req.name.data = (uint8_t *)name;
	req.name.len = strlen(name);
	req.capacity = capacity;
	req.flags = flags;
	req.producers = producers;
	r = dlpc__call_ex(c, DLPC_MSG_CHANNEL, &req.base, NULL, 0, 0, &cinfo,
			  &dlpackd__v1__channel_reply__descriptor, (ProtobufCMessage **)&rep, NULL,
			  NULL);
	/* -EPIPE is the end of a stream only when dlpackd said so: a connection found closed is
	 * not (as for a send or a receive) */
	if (r == -EPIPE && !cinfo.answered)
		return dlpc__fail(-ECONNRESET, "cannot %s channel '%s': %s", what, name,
				  "the connection to dlpackd was lost");
	if (r < 0)
		return r;
	if (!rep->channel) {
		dlpackd__v1__channel_reply__free_unpacked(rep, NULL);
		return dlpc__fail(-EPROTO, "cannot %s channel '%s': dlpackd sent an unusable reply",
				  what, name);
	}
	if (info)
		info_fill(info, rep->channel);
	r = rep->created ? 1 : 0;
	dlpackd__v1__channel_reply__free_unpacked(rep, NULL);
	return r;
}

DLPC_EXPORT int dlpc_channel_open_opts(dlpc_client *c, const char *name,
				       const dlpc_channel_opts *opts, dlpc_channel_info *info)
{
	uint32_t capacity, flags, producers;

	if (!opts || opts->size < sizeof(*opts))
		return dlpc__fail(-EINVAL, "cannot open channel '%s': opts is NULL or too small",
				  name ? name : "");
	capacity = opts->capacity;
	flags = opts->flags;
	producers = opts->producers;
	if (producers > DLPC_CHANNEL_PRODUCERS_MAX)
		return dlpc__fail(-EINVAL,
				  "cannot open channel '%s': %u producers exceeds the limit of %d "
				  "(DLPC_CHANNEL_PRODUCERS_MAX)",
				  name ? name : "", producers, DLPC_CHANNEL_PRODUCERS_MAX);
	if (capacity > DLPC_CHANNEL_CAPACITY_MAX)
		return dlpc__fail(-EINVAL,
				  "cannot open channel '%s': capacity %u exceeds the limit of %d",
				  name ? name : "", capacity, DLPC_CHANNEL_CAPACITY_MAX);
	if (flags & ~OPEN_FLAGS)
		return dlpc__fail(-EINVAL, "cannot open channel '%s': unknown flags 0x%x",
				  name ? name : "", flags & ~OPEN_FLAGS);
	if (flags & (flags - 1))
		return dlpc__fail(-EINVAL,
				  "cannot open channel '%s': flags 0x%x: at most one of "
				  "DLPC_CHANNEL_DIRECT, DLPC_CHANNEL_QUEUED and "
				  "DLPC_CHANNEL_PREFER_DIRECT",
				  name ? name : "", flags);
	return channel_call(c, OP_OPEN, name, capacity, flags, producers, info, "open");
}

DLPC_EXPORT int dlpc_channel_open_flags(dlpc_client *c, const char *name, uint32_t capacity,
					uint32_t flags, dlpc_channel_info *info)
{
	dlpc_channel_opts o = {.size = sizeof(o), .capacity = capacity, .flags = flags};

	return dlpc_channel_open_opts(c, name, &o, info);
}

DLPC_EXPORT int dlpc_channel_open(dlpc_client *c, const char *name, uint32_t capacity,
				  dlpc_channel_info *info)
{
	return dlpc_channel_open_flags(c, name, capacity, 0, info);
}

DLPC_EXPORT int dlpc_channel_close_flags(dlpc_client *c, const char *name, uint32_t flags)
{
	int r;

	if (flags & ~DLPC_CHANNEL_CLOSE_ALL)
		return dlpc__fail(-EINVAL, "cannot close channel '%s': unknown flags 0x%x",
				  name ? name : "", flags & ~DLPC_CHANNEL_CLOSE_ALL);
	r = channel_call(c, DLPC__CHANNEL_CLOSE, name, 0, flags, 0, NULL, "close");
	/* a direct channel's endpoint knew this connection as a producer: the next send asks
	 * the daemon again, and is refused */
	if (r >= 0) {
		dlpc__direct_forget(c, name);
		r = 0;
	}
	return r;
}

DLPC_EXPORT int dlpc_channel_close(dlpc_client *c, const char *name)
{
	return dlpc_channel_close_flags(c, name, 0);
}

DLPC_EXPORT int dlpc_channel_remove(dlpc_client *c, const char *name)
{
	int r = channel_call(c, OP_REMOVE, name, 0, 0, 0, NULL, "remove");

	/* its ends, if this client joined it, are shut now: let go of them */
	if (r >= 0)
		dlpc__direct_forget(c, name);
	return r;
}

DLPC_EXPORT int dlpc_channel_stat(dlpc_client *c, const char *name, dlpc_channel_info *info)
{
	if (!info)
		return dlpc__fail(-EINVAL, "cannot describe channel: info is NULL");
	return channel_call(c, OP_STAT, name, 0, 0, 0, info, "describe");
}

DLPC_EXPORT int dlpc_channel_list(dlpc_client *c, const char *prefix, dlpc_channel_info **ret,
				  size_t *n)
{
	Dlpackd__V1__List req = DLPACKD__V1__LIST__INIT;
	char after[DLPC_NAME_MAX + 1] = "";
	dlpc_channel_info *v = NULL;
	size_t count = 0, cap = 0;
	int r;

	if (!c || !ret || !n)
		return dlpc__fail(-EINVAL, "cannot list channels: NULL argument");
	*ret = NULL;
	*n = 0;
	prefix = prefix ? prefix : "";
	if (strlen(prefix) > DLPC_NAME_MAX)
		return dlpc__fail(-EINVAL, "cannot list channels: prefix longer than %d bytes",
				  DLPC_NAME_MAX);
	r = dlpc__check(c);
	if (r < 0)
		return r;
	req.prefix.data = (uint8_t *)prefix;
	req.prefix.len = strlen(prefix);
	req.channels = true;
	/* a dlpc_close() from another thread between pages must not free the client under us */
	dlpc__client_ref(c);
	for (;;) {
		Dlpackd__V1__ListReply *rep;
		bool more;

		req.start_after.data = (uint8_t *)after;
		req.start_after.len = strlen(after);
		r = dlpc__call(c, DLPC_MSG_LIST, &req.base, NULL, 0,
			       &dlpackd__v1__list_reply__descriptor, (ProtobufCMessage **)&rep,
			       NULL, NULL);
		if (r < 0)
			goto fail;
		if (count + rep->n_channels > cap) {
			size_t ncap = (count + rep->n_channels) * 2;
			dlpc_channel_info *nv = realloc(v, ncap * sizeof(*nv));

			if (!nv) {
				dlpackd__v1__list_reply__free_unpacked(rep, NULL);
				r = dlpc__fail(-ENOMEM, "cannot list channels: out of memory");
				goto fail;
			}
			v = nv;
			cap = ncap;
		}
		for (size_t i = 0; i < rep->n_channels; i++) {
			v[count].size = sizeof(*v);
			info_fill(&v[count++], rep->channels[i]);
		}
		more = rep->more && rep->n_channels > 0;
		dlpackd__v1__list_reply__free_unpacked(rep, NULL);
		if (!more)
			break;
		/* a page that does not move past the cursor would loop forever */
		if (after[0] && strcmp(v[count - 1].name, after) <= 0) {
			r = dlpc__fail(-EPROTO, "cannot list channels: dlpackd sent a page that "
						"does not advance");
			goto fail;
		}
		snprintf(after, sizeof(after), "%s", v[count - 1].name);
	}
	dlpc__client_unref(c);
	*ret = v;
	*n = count;
	return 0;
fail:
	dlpc__client_unref(c);
	free(v);
	return r;
}

/* A SEND of the laid-out message to a queued channel. */
static int send_queued(dlpc_client *c, const struct dlpc__sink *sink, Dlpackd__V1__Publish *req,
		       int fd)
{
	Dlpackd__V1__Send s = DLPACKD__V1__SEND__INIT;
	Dlpackd__V1__SendReply *rep;
	struct dlpc__call_info info = {0};
	const dlpc_send_opts *o = sink->opts;
	int64_t timeout = o->flags & DLPC_SEND_NOWAIT ? 0 : o->timeout_ms;
	int r;

	s.channel.data = (uint8_t *)sink->channel;
	s.channel.len = strlen(sink->channel);
	s.timeout_ms = timeout;
	s.message = req;
	s.pool_token = sink->pool_token;
	r = dlpc__call_ex(c, DLPC_MSG_SEND, &s.base, &fd, 1, timeout, &info,
			  &dlpackd__v1__send_reply__descriptor, (ProtobufCMessage **)&rep, NULL,
			  NULL);
	/* (a second attempt must not clear what the first found) */
	if (sink->unanswered && info.sent && !info.answered)
		*sink->unanswered = true;
	/* -EPIPE is the end of a stream: a write that found the connection closed is not */
	if (r == -EPIPE && !info.answered)
		r = dlpc__fail(-ECONNRESET, "cannot send to channel '%s': %s", sink->channel,
			       "the connection to dlpackd was lost");
	if (r < 0)
		return r;
	dlpackd__v1__send_reply__free_unpacked(rep, NULL);
	return 0;
}

/* Tell the daemon this connection produces to the direct channel of @p e (it sees no message
 * of it), once per endpoint: it then counts this connection among the producers whose close
 * or end its stream waits for. 1, or a negative errno (-EPIPE: the stream ended, or this
 * connection closed its side). */
static int produce(dlpc_client *c, struct dlpc__endpoint *e, const char *channel)
{
	int r;

	assert(e->direct);
	r = channel_call(c, DLPC__CHANNEL_PRODUCE, channel, 0, 0, 0, NULL, "send to");
	if (r < 0)
		return r;
	__atomic_store_n(&e->producing, true, __ATOMIC_RELAXED);
	return 1;
}

/*
 * The sink of dlpc__publish_to(): the laid-out message to the channel, through the daemon (a
 * queued channel) or straight to its receivers (a direct one). The sink still holds the message
 * when it finds the channel made again, or of the other kind: it tries once more.
 */
static int send_sink(dlpc_client *c, const struct dlpc__sink *sink, Dlpackd__V1__Publish *req,
		     int fd)
{
	const dlpc_send_opts *o = sink->opts;
	int64_t timeout = o->flags & DLPC_SEND_NOWAIT ? 0 : o->timeout_ms;

	for (int attempt = 0;; attempt++) {
		struct dlpc__endpoint *e;
		int r = dlpc__direct_get(c, sink->channel, &e);

		if (r < 0)
			return r;
		if (r == 1 && sink->pool_token) {
			dlpc__direct_put(c, e);
			return dlpc__fail(-ENOTSUP,
					  "cannot send to channel '%s': it is direct, and recycled "
					  "buffers need a channel dlpackd queues: create it "
					  "queued (DLPC_CHANNEL_QUEUED; in Python, direct=False)",
					  sink->channel);
		}
		if (r == 1 && !__atomic_load_n(&e->producing, __ATOMIC_RELAXED))
			r = produce(c, e, sink->channel);
		if (r == 1)
			r = dlpc__direct_send(c, e, sink->channel, req, fd, timeout);
		else if (r == 0)
			r = send_queued(c, sink, req, fd);
		/* shut (removed and maybe made again, or shut by a process that joined), or now
		 * of the other kind: ask anew, once */
		if (e && (r == -ESHUTDOWN || r == -EPROTOTYPE))
			dlpc__direct_changed(c, e);
		if (e)
			dlpc__direct_put(c, e);
		if ((r == -ESHUTDOWN || r == -EPROTOTYPE) && attempt == 0)
			continue;
		if (r == -ESHUTDOWN)
			return dlpc__fail(-EIDRM, "channel '%s' was removed", sink->channel);
		return r;
	}
}

static void drop_tensors(size_t n, DLManagedTensorVersioned *const tensors[])
{
	for (size_t i = 0; tensors && i < n; i++)
		if (tensors[i] && tensors[i]->deleter)
			tensors[i]->deleter(tensors[i]);
}

DLPC_EXPORT int dlpc_send_bundle(dlpc_client *c, const char *channel, size_t n,
				 const char *const keys[],
				 DLManagedTensorVersioned *const tensors[],
				 const dlpc_send_opts *opts)
{
	dlpc_send_opts o = {.size = sizeof(o), .flags = 0, .timeout_ms = -1};
	bool unanswered = false;
	struct dlpc__sink sink = {
		.fn = send_sink, .channel = channel, .opts = &o, .unanswered = &unanswered};
	struct dlpc__region *pooled;
	int r;

	/* every path takes ownership of the tensors, as dlpc_publish() does */
	if (opts && opts->size < sizeof(o)) {
		drop_tensors(n, tensors);
		return dlpc__fail(-EINVAL, "cannot send to channel '%s': opts->size is %u",
				  channel ? channel : "", opts->size);
	}
	if (opts)
		o = *opts;
	if (o.flags & ~SEND_FLAGS) {
		drop_tensors(n, tensors);
		return dlpc__fail(-EINVAL, "cannot send to channel '%s': unknown flags 0x%x",
				  channel ? channel : "", o.flags & ~SEND_FLAGS);
	}
	/* recycled memory (pool.c) goes writable, marked with its token, and is in flight until
	 * dlpackd gives it back */
	pooled = n == 1 && tensors ? dlpc__view_region(tensors[0]) : NULL;
	if (pooled && !pooled->pool_token)
		pooled = NULL;
	if (pooled && pooled->pool_owner != c) {
		drop_tensors(n, tensors);
		return dlpc__fail(-EINVAL,
				  "cannot send to channel '%s': the tensor is pooled memory of "
				  "another connection; send it on the one that allocated it",
				  channel ? channel : "");
	}
	if (pooled) {
		sink.pool_token = pooled->pool_token;
		dlpc__pool_sending(c, sink.pool_token, true);
	}
	r = dlpc__publish_to(c, channel, n, n == 1 && !keys ? NULL : keys, tensors,
			     pooled ? DLPC_PUBLISH_WRITABLE : 0, &sink);
	/* Refused, the buffer never left: it is free again. Sent but not answered (the connection
	 * was lost, or the call gave up): the message may be queued and its RECLAIM may never
	 * come, so the buffer leaves the pool rather than be filled again under a receiver. */
	if (pooled && r < 0 && unanswered)
		dlpc__pool_lost(c, sink.pool_token);
	else if (pooled && r < 0)
		dlpc__pool_sending(c, sink.pool_token, false);
	return r < 0 && channel ? reword(r, "cannot publish", "cannot send to", channel) : r;
}

DLPC_EXPORT int dlpc_send(dlpc_client *c, const char *channel, DLManagedTensorVersioned *t,
			  uint32_t flags)
{
	dlpc_send_opts o = {.size = sizeof(o), .flags = flags, .timeout_ms = -1};

	return dlpc_send_bundle(c, channel, 1, NULL, &t, &o);
}

/*
 * Is an fd free for the storage of a message? One whose fd this process could not take would be
 * lost (delivery is at most once), so a receiver at its fd limit fails before it takes one.
 * (Another thread that takes the last free fd while the reply is on its way can still make
 * that message lost: the receive fails with -EMFILE then too.) 0 or -EMFILE.
 */
static int fd_room(dlpc_client *c, const char *channel)
{
	struct rlimit rl = {0};
	int fd = fcntl(c->wake_fd, F_DUPFD_CLOEXEC, 0);

	if (fd >= 0) {
		close(fd);
		return 0;
	}
	if (errno != EMFILE)
		return 0; /* not a matter of room: the receive finds out what it is */
	getrlimit(RLIMIT_NOFILE, &rl);
	return dlpc__fail(-EMFILE,
			  "cannot receive from channel '%s': no free file descriptor for a "
			  "message's storage: this process has reached its limit of %llu open "
			  "files (RLIMIT_NOFILE); the message is left queued",
			  channel, (unsigned long long)rl.rlim_cur);
}

/* Receive one message of @p channel into a bundle; @p single: refuse a bundle. */
static int recv_queued(dlpc_client *c, const char *channel, uint32_t flags, int64_t timeout,
		       bool single, dlpc_bundle **ret);

static int recv_ref(dlpc_client *c, const char *channel, const dlpc_recv_opts *opts, bool single,
		    dlpc_bundle **ret)
{
	uint32_t flags = 0;
	int64_t timeout = -1;
	int r;

	if (opts && opts->size < sizeof(*opts))
		return dlpc__fail(-EINVAL, "cannot receive from channel '%s': opts->size is %u",
				  channel, opts->size);
	if (opts) {
		flags = opts->flags;
		timeout = opts->timeout_ms;
	}
	if (flags & DLPC_ATTACH_WRITABLE)
		return dlpc__fail(-EINVAL,
				  "cannot receive from channel '%s' writable: a message is "
				  "read-only to its receivers (DLPC_ATTACH_PRIVATE maps it "
				  "copy-on-write)",
				  channel);
	if (flags & ~API_RECV_FLAGS)
		return dlpc__fail(-EINVAL, "cannot receive from channel '%s': unknown flags 0x%x",
				  channel, flags & ~API_RECV_FLAGS);
	r = fd_room(c, channel);
	if (r < 0)
		return r;
	/* a storage that comes again is mapped once (maps.c) */
	flags |= DLPC__ATTACH_KEEP_MAP;
	for (int attempt = 0;; attempt++) {
		struct dlpc__endpoint *e;

		r = dlpc__direct_get(c, channel, &e);
		if (r < 0)
			return reword(r, "cannot join", "cannot receive from", channel);
		if (r == 1) {
			r = dlpc__direct_recv(c, e, channel, flags, timeout, single, ret);
			if (r < 0 && r != -ESHUTDOWN)
				r = reword(r, "cannot attach", "cannot receive from", channel);
		} else {
			r = recv_queued(c, channel, flags, timeout, single, ret);
		}
		if (e && (r == -ESHUTDOWN || r == -EPROTOTYPE))
			dlpc__direct_changed(c, e);
		if (e)
			dlpc__direct_put(c, e);
		if ((r == -ESHUTDOWN || r == -EPROTOTYPE) && attempt == 0)
			continue;
		if (r == -ESHUTDOWN)
			return dlpc__fail(-EIDRM, "channel '%s' was removed", channel);
		return r;
	}
}

/* A RECV of a queued channel. */
static int recv_queued(dlpc_client *c, const char *channel, uint32_t flags, int64_t timeout,
		       bool single, dlpc_bundle **ret)
{
	Dlpackd__V1__Recv req = DLPACKD__V1__RECV__INIT;
	Dlpackd__V1__AttachReply *rep;
	struct dlpc__call_info info = {0};
	struct dlpc__arena arena;
	int fd = -1, r;

	req.channel.data = (uint8_t *)channel;
	req.channel.len = strlen(channel);
	req.flags = single ? DLPC_WIRE_ATTACH_SINGLE : 0;
	req.timeout_ms = timeout;
	dlpc__arena_init(&arena);
	r = dlpc__call_ex(c, DLPC_MSG_RECV, &req.base, NULL, 0, timeout, &info,
			  &dlpackd__v1__attach_reply__descriptor, (ProtobufCMessage **)&rep, &fd,
			  &arena.alloc);
	if (r == -EPIPE && !info.answered)
		r = dlpc__fail(-ECONNRESET, "cannot receive from channel '%s': %s", channel,
			       "the connection to dlpackd was lost");
	if (r < 0) {
		dlpc__arena_clear(&arena);
		if (r == -EMFILE || r == -ECANCELED) {
			char why[DLPC_ERROR_TEXT_MAX];

			snprintf(why, sizeof(why), "%s", dlpc_last_error());
			r = dlpc__fail(r, "cannot receive from channel '%s': %s", channel, why);
		}
		return r;
	}
	if (fd < 0 || rep->device_type != kDLCPU || rep->cuda_ipc) {
		if (rep->ref_id)
			dlpc__release_ref(c, rep->ref_id, info.conn_seq);
		dlpc__close(fd);
		dlpc__arena_clear(&arena);
		return dlpc__fail(
			-EPROTO, "cannot receive from channel '%s': dlpackd sent an unusable reply",
			channel);
	}
	r = dlpc__attach_build(c, info.conn_seq, false, 0, channel, rep, fd, flags, NULL, NULL,
			       ret);
	dlpc__arena_clear(&arena);
	return r < 0 ? reword(r, "cannot attach", "cannot receive from", channel) : 0;
}

DLPC_EXPORT int dlpc_recv_bundle(dlpc_client *c, const char *channel, const dlpc_recv_opts *opts,
				 dlpc_bundle **ret)
{
	int r;

	if (!c || !ret)
		return dlpc__fail(-EINVAL, "cannot receive: client or result pointer is NULL");
	*ret = NULL;
	r = dlpc__check(c);
	if (r == 0)
		r = dlpc__name_arg(channel, "receive");
	if (r < 0)
		return r;
	dlpc__client_ref(c);
	r = recv_ref(c, channel, opts, false, ret);
	dlpc__client_unref(c);
	return r;
}

DLPC_EXPORT int dlpc_recv(dlpc_client *c, const char *channel, const dlpc_recv_opts *opts,
			  DLManagedTensorVersioned **ret)
{
	dlpc_bundle *b;
	int r;

	if (!c || !ret)
		return dlpc__fail(-EINVAL, "cannot receive: client or result pointer is NULL");
	*ret = NULL;
	r = dlpc__check(c);
	if (r == 0)
		r = dlpc__name_arg(channel, "receive");
	if (r < 0)
		return r;
	dlpc__client_ref(c);
	r = recv_ref(c, channel, opts, true, &b);
	dlpc__client_unref(c);
	if (r < 0)
		return r;
	*ret = dlpc_bundle_take(b, 0);
	dlpc_bundle_free(b);
	return 0;
}
