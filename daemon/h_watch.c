/* SPDX-License-Identifier: Apache-2.0 */
/*
 * WATCH and the events it asks for.
 *
 * A watch is a connection of its own: after the WATCH reply the daemon only pushes EVENT frames
 * (id 0) to it, and the only frame it may still send is RELEASE. Because a watcher may own no
 * ephemeral entry and no waiting ATTACH, dropping one (its queue overflowed, its socket failed)
 * never changes the name map, so an event being delivered can never cause another.
 */
#include <assert.h>
#include <errno.h>
#include <string.h>

#include "dlpackd.h"
#include "util.h"

int dlpd_on_watch(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__Watch *req = (Dlpackd__V1__Watch *)*m;
	Dlpackd__V1__WatchReply rep = DLPACKD__V1__WATCH_REPLY__INIT;
	struct dlpd_server *s = p->srv;
	char desc[96], prefix[DLPC_NAME_TEXT];
	int r;

	(void)f;
	if (req->prefix.len > DLPC_NAME_MAX)
		return dlpd_reply_error(p, id, EINVAL, "WATCH prefix longer than %d bytes",
					DLPC_NAME_MAX);
	if (!dlpd_list_empty(&p->ephemeral) || !dlpd_list_empty(&p->waiters))
		return dlpd_reply_error(p, id, EBUSY,
					"cannot watch on a connection that owns ephemeral entries "
					"or waits in ATTACH; watch on a connection of its own");
	rep.seq = s->event_seq;
	rep.queue_max = p->srv->lim.watch_queue_bytes;
	r = dlpd_reply(p, DLPC_MSG_WATCH | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
	if (r < 0)
		return r;
	p->watching = true;
	p->watch_prefix_len = req->prefix.len;
	if (req->prefix.len)
		memcpy(p->watch_prefix, req->prefix.data, req->prefix.len);
	dlpd_list_add_tail(&s->watchers, &p->watch_link);
	s->nwatchers++;
	dlpd_log(LOG_DEBUG, "%s: watching names that start with '%s'",
		 dlpd_peer_desc(p, desc, sizeof(desc)),
		 dlpc__printable(p->watch_prefix, p->watch_prefix_len, prefix, sizeof(prefix)));
	return 0;
}

void dlpd_watch_drop(struct dlpd_peer *p)
{
	if (!p->watching)
		return;
	/* what makes dropping a watcher safe in the middle of delivering an event */
	assert(dlpd_list_empty(&p->ephemeral) && dlpd_list_empty(&p->waiters));
	dlpd_list_del(&p->watch_link);
	p->srv->nwatchers--;
	p->watching = false;
}

static bool wants(const struct dlpd_peer *w, const ProtobufCBinaryData *name)
{
	return name->len >= w->watch_prefix_len &&
	       memcmp(name->data, w->watch_prefix, w->watch_prefix_len) == 0;
}

void dlpd_watch_event(struct dlpd_server *s, int kind, const struct dlpd_entry *e,
		      uint64_t prev_gen, int reason, uid_t actor_uid, pid_t actor_pid)
{
	Dlpackd__V1__Event ev = DLPACKD__V1__EVENT__INIT;
	Dlpackd__V1__EntryInfo info = DLPACKD__V1__ENTRY_INFO__INIT;
	const ProtobufCBinaryData *name = &e->pub->name;
	struct dlpd_list *l, *next;
	bool any = false;
	ssize_t len;

	/* every change counts, watched or not, so seq numbers the daemon's history */
	s->event_seq++;
	for (l = s->watchers.next; l != &s->watchers && !any; l = l->next)
		any = wants(dlpd_container_of(l, struct dlpd_peer, watch_link), name);
	if (!any)
		return;

	info.name = *name;
	info.generation = e->generation;
	info.device_type = e->st->device_type;
	info.device_id = e->st->device_id;
	info.flags = e->pub->flags;
	info.nbytes = e->st->size;
	info.refs = e->st->attach_refs;
	info.owner_uid = e->uid;
	info.owner_pid = e->pid;
	info.created_ns = e->created_ns;
	info.tensor_count = (uint32_t)e->pub->n_tensors;
	/* one tensor's description is a line's worth; a bundle's could be megabytes */
	if (e->pub->n_tensors == 1) {
		info.n_tensors = 1;
		info.tensors = e->pub->tensors;
	}
	ev.kind = kind;
	ev.seq = s->event_seq;
	ev.entry = &info;
	ev.previous_generation = prev_gen;
	ev.reason = reason;
	ev.actor_uid = actor_uid;
	ev.actor_pid = actor_pid;
	/* packed once, queued for each watcher */
	len = dlpc__msg_frame(&s->event_out, DLPC_MSG_EVENT, 0, &ev.base, 0);
	for (l = s->watchers.next; l != &s->watchers; l = next) {
		struct dlpd_peer *w = dlpd_container_of(l, struct dlpd_peer, watch_link);

		/* sending may drop w, which unlinks w alone */
		next = l->next;
		if (!wants(w, name))
			continue;
		if (len < 0)
			dlpd_peer_kill(w, LOG_ERR, "cannot build an event: %s",
				       strerror((int)-len));
		else
			dlpd_peer_send(w, s->event_out.p, (size_t)len, NULL, 0);
	}
}
