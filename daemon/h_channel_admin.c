/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Handlers for channels (protocol 1.6) that manage them rather than carry messages: CHANNEL
 * (open, remove, describe), the channels of a LIST, and the watch events of opening and
 * removing one. The messages' way through a channel, SEND and RECV, is h_channel.c's; emptying
 * a channel and ending its stream are handoff.c's.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "direct.h"
#include "handlers.h"
#include "handoff.h"
#include "peer.h"
#include "quota.h"
#include "util.h"

#define OP_OPEN 1
#define OP_REMOVE 2
#define OP_STAT 3
#define OP_JOIN 4
#define OP_CLOSE 5
#define OP_PRODUCE 6
#define KIND_FLAGS (DLPC_CHANNEL_DIRECT | DLPC_CHANNEL_QUEUED)
#define OPEN_FLAGS (KIND_FLAGS | DLPC_CHANNEL_PREFER_DIRECT)
#define EV_CHANNEL_OPENED 4
#define EV_CHANNEL_REMOVED 5

/* What LIST, CHANNEL and watch events say of @p ch, queued or direct. */
static void channel_info(const struct dlpd_channel *ch, Dlpackd__V1__ChannelInfo *info)
{
	dlpd_channel_info(ch, info);
	dlpd_direct_info(ch, info);
}

static bool watcher_wants(const struct dlpd_peer *w, const struct dlpd_channel *ch)
{
	return ch->len >= w->watch_prefix_len &&
	       memcmp(ch->name, w->watch_prefix, w->watch_prefix_len) == 0;
}

/* Tell the watchers whose prefix matches that @p ch was opened or removed. */
static void notify(struct dlpd_server *s, uint32_t kind, const struct dlpd_channel *ch,
		   const struct dlpd_peer *actor)
{
	Dlpackd__V1__Event ev = DLPACKD__V1__EVENT__INIT;
	Dlpackd__V1__ChannelInfo info = DLPACKD__V1__CHANNEL_INFO__INIT;
	ssize_t len = 0;
	bool packed = false;

	s->event_seq++;
	for (struct dlpd_list *l = s->watchers.next; l != &s->watchers; l = l->next) {
		struct dlpd_peer *w = dlpd_container_of(l, struct dlpd_peer, watch_link);

		if (!watcher_wants(w, ch))
			continue;
		if (!packed) {
			channel_info(ch, &info);
			ev.kind = kind;
			ev.seq = s->event_seq;
			ev.channel = &info;
			ev.reason = kind == EV_CHANNEL_REMOVED ? DLPC_WATCH_BY_REQUEST : 0;
			ev.actor_uid = actor->uid;
			ev.actor_pid = actor->pid;
			len = dlpc__msg_frame(&s->event_out, DLPC_MSG_EVENT, 0, &ev.base, 0);
			packed = true;
		}
		if (len < 0)
			dlpd_peer_fail(w, LOG_ERR, "cannot build an event: %s",
				       strerror((int)-len));
		else
			dlpd_peer_send(w, s->event_out.p, (size_t)len, NULL, 0);
	}
}

static int reply_info(struct dlpd_peer *p, uint32_t id, const struct dlpd_channel *ch, bool created)
{
	Dlpackd__V1__ChannelReply rep = DLPACKD__V1__CHANNEL_REPLY__INIT;
	Dlpackd__V1__ChannelInfo info = DLPACKD__V1__CHANNEL_INFO__INIT;

	channel_info(ch, &info);
	rep.channel = &info;
	rep.created = created;
	return dlpd_reply(p, DLPC_MSG_CHANNEL | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
}

/* An OPEN of @p ch, which exists: answered with its info if it asks for nothing @p ch is not
 * (its producers, its capacity, its kind: @p direct, or either for @p any). */
static int channel_reopen(struct dlpd_peer *p, uint32_t id, const Dlpackd__V1__Channel *req,
			  const struct dlpd_channel *ch, bool direct, bool any, const char *name)
{
	if (req->producers && req->producers != (ch->expected ? ch->expected : 1))
		return dlpd_reply_error(p, id, EEXIST,
					"channel '%s' is open already for %u producers, not %u",
					name, ch->expected ? ch->expected : 1, req->producers);
	/* (a direct channel answers to the capacity asked for and to the one it got) */
	if (req->capacity && req->capacity != ch->capacity &&
	    !(ch->ends[0] >= 0 && req->capacity == ch->direct_capacity))
		return dlpd_reply_error(p, id, EEXIST,
					"channel '%s' is open already with capacity %u, not %u",
					name, ch->capacity, req->capacity);
	if (!any && (ch->ends[0] >= 0) != direct)
		return dlpd_reply_error(p, id, EEXIST,
					"channel '%s' is open already as a %s channel; open it "
					"without asking for a kind to use it as it is",
					name, ch->ends[0] >= 0 ? "direct" : "queued");
	return reply_info(p, id, ch, false);
}

/* May @p p open a new channel named @p name (@p direct: with its socket pair)? 0, or -EDQUOT
 * and the whole reason in @p msg: the daemon's fds, the uid's channels, fds, entries and
 * memory. */
static int channel_quota(const struct dlpd_peer *p, size_t name_len, bool direct, const char *name,
			 char *msg, size_t msglen)
{
	const struct dlpd_server *s = p->srv;
	char why[256];

	if (direct && dlpd_fds_in_use(s) + 2 > s->fd_budget) {
		dlpd_fd_budget_why(s, why, sizeof(why));
		snprintf(msg, msglen, "cannot open channel '%s': %s", name, why);
		return -EDQUOT;
	}
	if (p->usage->channels + 1 > s->lim.channels_per_uid) {
		snprintf(msg, msglen,
			 "cannot open channel '%s': uid %u has %llu channels open; the limit is "
			 "%llu (--max-channels-per-uid)",
			 name, (unsigned)p->uid, (unsigned long long)p->usage->channels,
			 (unsigned long long)s->lim.channels_per_uid);
		return -EDQUOT;
	}
	/* a direct channel's pair is held by the daemon for its opener's uid: in its fd share
	 * (the joiners' copies are in their own processes, under their own RLIMIT_NOFILE) */
	if (direct && dlpd_uid_fds(p->usage) + 2 > dlpd_uid_fd_share(s)) {
		dlpd_uid_fd_share_why(p, dlpd_uid_fds(p->usage), why, sizeof(why));
		snprintf(msg, msglen, "cannot open direct channel '%s': %s", name, why);
		return -EDQUOT;
	}
	if (p->usage->entries + 1 > s->lim.entries_per_uid) {
		snprintf(msg, msglen,
			 "cannot open channel '%s': uid %u has %llu entries and channels; the "
			 "limit is %llu (--max-entries-per-uid)",
			 name, (unsigned)p->uid, (unsigned long long)p->usage->entries,
			 (unsigned long long)s->lim.entries_per_uid);
		return -EDQUOT;
	}
	if (dlpd_quota_memory(p, DLPD_CHANNEL_COST + name_len, 0, why, sizeof(why)) < 0) {
		snprintf(msg, msglen, "cannot open channel '%s': %s", name, why);
		return -EDQUOT;
	}
	return 0;
}

/* Make the new @p ch direct (@p prefer: only where its sockets can be made and a direct
 * channel holds @p cap messages, queued with the reason in ch->fallback otherwise). 0, or
 * negative errno and why. */
static int make_direct(struct dlpd_server *s, struct dlpd_channel *ch, uint32_t cap, bool prefer,
		       char *why, size_t whylen)
{
	int r = dlpd_direct_open(s, ch, cap, why, whylen);

	/* no fds, or no memory, for the pair (ENFILE, EMFILE, ENOMEM...): a queued one serves */
	if (r < 0 && prefer) {
		dlpd_log(LOG_WARNING, "channel '%.*s' made queued: a direct one %s", (int)ch->len,
			 (const char *)ch->name, why);
		ch->fallback = DLPC_CHANNEL_FALLBACK_FDS;
		return 0;
	}
	if (r < 0 || !prefer || ch->direct_capacity >= cap)
		return r;
	dlpd_direct_close(s, ch);
	ch->fallback = DLPC_CHANNEL_FALLBACK_CAPACITY;
	return 0;
}

static int channel_open(struct dlpd_peer *p, uint32_t id, const Dlpackd__V1__Channel *req,
			const char *name)
{
	struct dlpd_server *s = p->srv;
	struct dlpd_channel *ch = dlpd_channel_find(&s->reg, req->name.data, req->name.len);
	uint32_t cap = req->capacity ? req->capacity : DLPC_CHANNEL_CAPACITY_DEFAULT;
	uint32_t kind = req->flags & OPEN_FLAGS, fallback = 0;
	char desc[96], why[256], msg[DLPC_NAME_TEXT + 512];

	if (req->capacity > DLPC_CHANNEL_CAPACITY_MAX)
		return dlpd_reply_error(p, id, EINVAL,
					"cannot open channel '%s': capacity %u exceeds the limit "
					"of %d messages",
					name, req->capacity, DLPC_CHANNEL_CAPACITY_MAX);
	bool direct = kind & DLPC_CHANNEL_DIRECT, prefer = kind & DLPC_CHANNEL_PREFER_DIRECT;

	/* at most one of the three; without DIRECT or QUEUED a channel of either kind is taken */
	if ((req->flags & ~(uint32_t)OPEN_FLAGS) || (kind & (kind - 1)))
		return dlpd_reply_error(p, id, EINVAL, "cannot open channel '%s': flags 0x%x", name,
					req->flags);
	if (req->producers > DLPC_CHANNEL_PRODUCERS_MAX)
		return dlpd_reply_error(p, id, EINVAL,
					"cannot open channel '%s': %u producers exceeds the limit "
					"of %d (DLPC_CHANNEL_PRODUCERS_MAX)",
					name, req->producers, DLPC_CHANNEL_PRODUCERS_MAX);
	if (ch)
		return channel_reopen(p, id, req, ch, direct, !(kind & KIND_FLAGS), name);
	if (channel_quota(p, req->name.len, direct, name, msg, sizeof(msg)) < 0)
		return dlpd_reply_error(p, id, EDQUOT, "%s", msg);
	/* (the quota of a queued one passed: what a direct one lacks is fds) */
	if (prefer && channel_quota(p, req->name.len, true, name, msg, sizeof(msg)) < 0)
		fallback = DLPC_CHANNEL_FALLBACK_FDS;
	ch = dlpd_channel_new(&s->reg, req->name.data, req->name.len, cap, p->usage);
	if (!ch)
		return dlpd_reply_error(p, id, ENOMEM, "cannot open channel '%s': out of memory",
					name);
	ch->uid = p->uid;
	ch->pid = p->pid;
	ch->expected = req->producers;
	ch->fallback = fallback;
	if (direct || (prefer && !fallback)) {
		int r = make_direct(s, ch, cap, prefer, why, sizeof(why));

		if (r < 0) {
			dlpd_channel_free(&s->reg, ch);
			return dlpd_reply_error(p, id, -r, "cannot open direct channel '%s': %s",
						name, why);
		}
	}
	dlpd_log(LOG_DEBUG, "%s: opened %schannel '%s', capacity %u%s",
		 dlpd_peer_desc(p, desc, sizeof(desc)), ch->ends[0] >= 0 ? "direct " : "", name,
		 ch->ends[0] >= 0 ? ch->direct_capacity : cap,
		 ch->fallback == DLPC_CHANNEL_FALLBACK_CAPACITY
			 ? " (queued: a direct one holds fewer here)"
		 : ch->fallback ? " (queued: no fds for a direct one)"
				: "");
	notify(s, EV_CHANNEL_OPENED, ch, p);
	return reply_info(p, id, ch, true);
}

/* Empty, tell and free @p ch, removed by @p p. */
static void channel_drop(struct dlpd_peer *p, struct dlpd_channel *ch, const char *name)
{
	struct dlpd_server *s = p->srv;

	dlpd_channel_empty(s, ch, name);
	notify(s, EV_CHANNEL_REMOVED, ch, p);
	dlpd_channel_free(&s->reg, ch);
}

static int channel_remove(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch,
			  const char *name)
{
	Dlpackd__V1__ChannelReply rep = DLPACKD__V1__CHANNEL_REPLY__INIT;
	Dlpackd__V1__ChannelInfo info = DLPACKD__V1__CHANNEL_INFO__INIT;
	char desc[96];
	int r;

	if (p->uid != 0 && p->uid != ch->uid)
		return dlpd_reply_error(p, id, EPERM,
					"channel '%s' belongs to uid %u; uid %u may not remove it",
					name, (unsigned)ch->uid, (unsigned)p->uid);
	/* the reply describes it as it was, messages included */
	channel_info(ch, &info);
	dlpd_log(LOG_DEBUG, "%s: removed channel '%s' and its %u queued messages",
		 dlpd_peer_desc(p, desc, sizeof(desc)), name, ch->depth);
	rep.channel = &info;
	r = dlpd_reply(p, DLPC_MSG_CHANNEL | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
	channel_drop(p, ch, name);
	return r;
}

/* CLOSE (1.10): @p p's side of @p ch, or with CHANNEL_CLOSE_ALL every producer's. */
static int channel_close(struct dlpd_peer *p, uint32_t id, const Dlpackd__V1__Channel *req,
			 struct dlpd_channel *ch, const char *name)
{
	char why[256], desc[96];
	int r;

	if (req->flags & ~(uint32_t)DLPC_CHANNEL_CLOSE_ALL)
		return dlpd_reply_error(p, id, EINVAL, "cannot close channel '%s': flags 0x%x",
					name, req->flags);
	if (req->flags & DLPC_CHANNEL_CLOSE_ALL) {
		if (p->uid != 0 && p->uid != ch->uid)
			return dlpd_reply_error(p, id, EPERM,
						"channel '%s' belongs to uid %u; uid %u may not "
						"close it for every producer",
						name, (unsigned)ch->uid, (unsigned)p->uid);
		dlpd_log(LOG_DEBUG, "%s: closed channel '%s' for every producer",
			 dlpd_peer_desc(p, desc, sizeof(desc)), name);
		dlpd_channel_end(p->srv, ch);
		return reply_info(p, id, ch, false);
	}
	r = dlpd_channel_close_producer(p, ch, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot close channel '%s': %s", name, why);
	return reply_info(p, id, ch, false);
}

/* PRODUCE (1.10): @p p will send to the direct channel @p ch (the daemon sees no message);
 * EPROTOTYPE for a queued one. */
static int channel_produce(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch,
			   const char *name)
{
	char why[256];
	int r;

	/* a queued channel's producers are the connections that send to it: a PRODUCE would
	 * hold its stream open with no message, unseen */
	if (ch->ends[0] < 0)
		return dlpd_reply_error(p, id, EPROTOTYPE,
					"channel '%s' is queued by dlpackd, not direct: its "
					"producers are the connections that send to it",
					name);
	r = dlpd_channel_produce(p, ch, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot send to channel '%s': %s", name, why);
	return reply_info(p, id, ch, false);
}

/* Hand @p p the ends of the direct channel @p ch: its messages go between the processes. */
static int channel_join(struct dlpd_peer *p, uint32_t id, struct dlpd_channel *ch, const char *name)
{
	Dlpackd__V1__ChannelReply rep = DLPACKD__V1__CHANNEL_REPLY__INIT;
	Dlpackd__V1__ChannelInfo info = DLPACKD__V1__CHANNEL_INFO__INIT;
	char why[320];
	int r;

	/* a queued channel is said so by a reply without fds (not an error: every client asks
	 * this of every channel it uses once) */
	if (ch->ends[0] < 0)
		return reply_info(p, id, ch, false);
	r = dlpd_direct_renew(p, ch, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(p, id, -r,
					"cannot join channel '%s': its sockets were shut, and new "
					"ones cannot be had: %s",
					name, why);
	channel_info(ch, &info);
	rep.channel = &info;
	r = dlpd_reply(p, DLPC_MSG_CHANNEL | DLPC_MSG_REPLY, id, &rep.base, ch->ends, 2);
	if (r == 0)
		p->srv->stats.fds_sent += 2;
	return r;
}

int dlpd_on_channel(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **msg, struct dlpc__frame *f)
{
	Dlpackd__V1__Channel *req = (Dlpackd__V1__Channel *)*msg;
	char why[160], name[DLPC_NAME_TEXT];
	struct dlpd_channel *ch;

	(void)f;
	if (dlpc__name_check(req->name.data, req->name.len, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EINVAL, "bad channel name: %s", why);
	dlpc__printable(req->name.data, req->name.len, name, sizeof(name));
	if (req->op == OP_OPEN)
		return channel_open(p, id, req, name);
	if (req->op != OP_REMOVE && req->op != OP_STAT && req->op != OP_JOIN &&
	    req->op != OP_CLOSE && req->op != OP_PRODUCE)
		return dlpd_reply_error(p, id, EINVAL, "CHANNEL operation %u is unknown", req->op);
	ch = dlpd_channel_find(&p->srv->reg, req->name.data, req->name.len);
	if (!ch)
		return dlpd_reply_error(p, id, ENOENT, "no channel named '%s'", name);
	if (req->op == OP_REMOVE)
		return channel_remove(p, id, ch, name);
	if (req->op == OP_JOIN)
		return channel_join(p, id, ch, name);
	if (req->op == OP_CLOSE)
		return channel_close(p, id, req, ch, name);
	if (req->op == OP_PRODUCE)
		return channel_produce(p, id, ch, name);
	return reply_info(p, id, ch, false);
}

int dlpd_channels_list(struct dlpd_peer *p, uint32_t id, const Dlpackd__V1__List *req)
{
	Dlpackd__V1__ListReply rep = DLPACKD__V1__LIST_REPLY__INIT;
	Dlpackd__V1__ChannelInfo *infos;
	void *room_infos, *room_ptrs;
	struct dlpd_channel **v;
	size_t n, limit, room = DLPC_FRAME_MAX - 64;
	int r;

	limit = dlpd_list_limit(req->limit);
	r = dlpd_channel_range(&p->srv->reg, req->prefix.data, req->prefix.len,
			       req->start_after.data, req->start_after.len, limit + 1, &v, &n);
	if (r < 0)
		return dlpd_reply_error(p, id, r, "cannot list channels: out of memory");
	rep.more = n > limit;
	n = n < limit ? n : limit;
	if (dlpd_list_room(n, sizeof(*infos), &room_infos, &room_ptrs) < 0) {
		free(v);
		return dlpd_reply_error(p, id, ENOMEM, "cannot list channels: out of memory");
	}
	infos = room_infos;
	rep.channels = room_ptrs;
	for (size_t i = 0; i < n; i++) {
		size_t sz;

		dlpackd__v1__channel_info__init(&infos[i]);
		channel_info(v[i], &infos[i]);
		sz = dlpackd__v1__channel_info__get_packed_size(&infos[i]) + 6;
		if (sz > room) {
			rep.more = true;
			break;
		}
		room -= sz;
		rep.channels[rep.n_channels++] = &infos[i];
	}
	r = dlpd_reply(p, DLPC_MSG_LIST | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
	free(rep.channels);
	free(infos);
	free(v);
	return r;
}
