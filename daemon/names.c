/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Changes to the names, applied to the registry and told to whom they concern.
 *
 * Order matters to watchers: an event leaves at the moment its change is applied, so events
 * arrive in the order of the changes. A publish is told to the watchers before its waiters are
 * answered. Nothing here destroys a connection: a send that fails only marks its connection
 * (peer.c), so no entry, waiter or connection disappears while a change is being told.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "closer.h"
#include "invalidate.h"
#include "mem.h"
#include "names.h"
#include "peer.h"
#include "persist.h"
#include "quota.h"
#include "reaper.h"
#include "reclaim.h"
#include "util.h"

/*
 * @p st is held by nothing any more (NULL: nothing to do): tell its legacy CUDA IPC publisher,
 * close its fd and free it. A host storage's fd is closed off the loop unless it is small
 * (dlpd_close_storage()): the last close of a memfd frees its memory. A CUDA VMM export is a
 * driver's file whose close the daemon cannot vouch for, so it goes to its publisher's closer
 * (closer.c), where a close that blocks stalls nothing else.
 */
/* @p st lost a name, and @p freed is what dlpd_entry_unlink() returned: free it if nothing
 * holds it; if references still do but no name reaches it, take it out of the fd store, where
 * it would hold a slot of its publisher's share that a restart could not use (no name would
 * claim it). */
static void storage_unnamed(struct dlpd_server *s, struct dlpd_storage *st,
			    struct dlpd_storage *freed)
{
	if (freed)
		dlpd_storage_gone(s, freed);
	else if (st->names == 0)
		dlpd_persist_storage_gone(s, st);
}

void dlpd_storage_gone(struct dlpd_server *s, struct dlpd_storage *st)
{
	if (!st)
		return;
	if (st->reclaim_holder)
		dlpd_reclaim_storage_freed(st);
	dlpd_persist_storage_gone(s, st);
	if (st->fd >= 0 && st->device_type == kDLCPU)
		dlpd_close_storage(st->fd);
	else if (st->fd >= 0)
		dlpd_close_uid(st->usage ? st->usage->uid : DLPD_UID_NOBODY, st->fd);
	dlpd_storage_free(&s->reg, st);
}

static bool wants(const struct dlpd_peer *w, const ProtobufCBinaryData *name)
{
	return name->len >= w->watch_prefix_len &&
	       memcmp(name->data, w->watch_prefix, w->watch_prefix_len) == 0;
}

/* Tell every watcher whose prefix matches that @p e was published, replaced (@p prev_gen: the
 * generation it replaced) or removed. A watcher that cannot take the event is marked. */
static void notify_watchers(struct dlpd_server *s, int kind, const struct dlpd_entry *e,
			    uint64_t prev_gen, int reason, uid_t actor_uid, pid_t actor_pid)
{
	Dlpackd__V1__Event ev = DLPACKD__V1__EVENT__INIT;
	Dlpackd__V1__EntryInfo info = DLPACKD__V1__ENTRY_INFO__INIT;
	const ProtobufCBinaryData *name = &e->pub->name;
	bool any = false;
	ssize_t len;

	/* every change counts, watched or not, so seq numbers the daemon's history */
	s->event_seq++;
	for (struct dlpd_list *l = s->watchers.next; l != &s->watchers && !any; l = l->next)
		any = wants(dlpd_container_of(l, struct dlpd_peer, watch_link), name);
	if (!any)
		return;
	dlpd_entry_info(e, &info);
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
	for (struct dlpd_list *l = s->watchers.next; l != &s->watchers; l = l->next) {
		struct dlpd_peer *w = dlpd_container_of(l, struct dlpd_peer, watch_link);

		if (!wants(w, name))
			continue;
		if (len < 0)
			dlpd_peer_fail(w, LOG_ERR, "cannot build an event: %s",
				       strerror((int)-len));
		else
			dlpd_peer_send(w, s->event_out.p, (size_t)len, NULL, 0);
	}
}

int dlpd_attach_answer(struct dlpd_peer *p, uint32_t id, struct dlpd_entry *e, uint32_t flags)
{
	Dlpackd__V1__AttachReply rep = DLPACKD__V1__ATTACH_REPLY__INIT;
	const Dlpackd__V1__Publish *pub = e->pub;
	struct dlpd_server *s = p->srv;
	char name[DLPC_NAME_TEXT], why[256];
	struct dlpd_ref *ref;
	int r;

	/* a marked connection would never read the reference it was given */
	if (dlpd_peer_marked(p))
		return -EPIPE;
	if ((flags & DLPC_WIRE_ATTACH_WRITABLE) && !(pub->flags & DLPC_PUBLISH_WRITABLE))
		return dlpd_reply_error(
			p, id, EACCES, "'%s' was not published writable; attach it read-only",
			dlpc__printable(pub->name.data, pub->name.len, name, sizeof(name)));
	if ((flags & DLPC_WIRE_ATTACH_SINGLE) && pub->n_tensors != 1)
		return dlpd_reply_error(
			p, id, EINVAL, "'%s' is a bundle of %zu tensors; attach it as a bundle",
			dlpc__printable(pub->name.data, pub->name.len, name, sizeof(name)),
			pub->n_tensors);
	/* a single tensor has the key "": one under a key was published as a bundle */
	if ((flags & DLPC_WIRE_ATTACH_SINGLE) && pub->tensors[0]->key.len)
		return dlpd_reply_error(
			p, id, EINVAL,
			"'%s' is a bundle of one tensor, under the key '%s'; attach it as a bundle",
			dlpc__printable(pub->name.data, pub->name.len, name, sizeof(name)),
			dlpc__printable(pub->tensors[0]->key.data, pub->tensors[0]->key.len, why,
					sizeof(why)));
	if (p->held.refs.count >= s->lim.refs_per_connection)
		return dlpd_reply_error(
			p, id, EDQUOT,
			"cannot attach '%s': this connection holds %zu references; the limit is "
			"%llu (--max-refs-per-connection)",
			dlpc__printable(pub->name.data, pub->name.len, name, sizeof(name)),
			p->held.refs.count, (unsigned long long)s->lim.refs_per_connection);
	r = dlpd_quota_memory(p, DLPD_REF_COST, 0, why, sizeof(why));
	if (r < 0)
		return dlpd_reply_error(
			p, id, r, "cannot attach '%s': %s",
			dlpc__printable(pub->name.data, pub->name.len, name, sizeof(name)), why);
	ref = dlpd_ref_new(&s->reg, &p->held, e->st);
	if (!ref)
		return dlpd_reply_error(p, id, ENOMEM, "cannot attach: out of memory");
	ref->cacheable = flags & DLPC_WIRE_ATTACH_CACHEABLE;
	rep.generation = e->generation;
	rep.ref_id = ref->id;
	rep.flags = pub->flags;
	rep.device_type = e->st->device_type;
	rep.device_id = e->st->device_id;
	rep.storage_size = e->st->size;
	rep.device_uuid = pub->device_uuid;
	rep.cuda_ipc = pub->cuda_ipc;
	rep.owner_uid = (uint32_t)e->uid;
	rep.owner_pid = (int32_t)e->pid;
	/* the descriptions were encoded once, at publish; legacy CUDA IPC sends no fd */
	r = dlpd_reply_tail(p, DLPC_MSG_ATTACH | DLPC_MSG_REPLY, id, &rep.base, e->tensors_wire,
			    e->tensors_wire_len, &e->st->fd, e->st->fd >= 0 ? 1 : 0);
	if (r == 0 && e->st->fd >= 0)
		s->stats.fds_sent++;
	return r;
}

/* Answer the waiters that @p e, just published, satisfies; those that asked for another owner
 * stay queued. */
static void wake_waiters(struct dlpd_server *s, struct dlpd_entry *e)
{
	const ProtobufCBinaryData *name = &e->pub->name;
	struct dlpd_waiter *w;

	while ((w = dlpd_waitq_first_match(&s->reg, name->data, name->len, (uint32_t)e->uid))) {
		struct dlpd_attach_wait *aw = dlpd_container_of(w, struct dlpd_attach_wait, w);
		struct dlpd_peer *p = aw->peer;
		uint32_t id = w->req_id, flags = w->flags;

		dlpd_waiter_free(aw);
		dlpd_attach_answer(p, id, e, flags);
	}
}

int dlpd_names_publish(struct dlpd_server *s, struct dlpd_entry *e, struct dlpd_entry *old,
		       struct dlpd_peer *owner)
{
	uint64_t prev_gen = old ? old->generation : 0, old_journaled = old ? old->journaled : 0;
	struct dlpd_storage *old_st = NULL, *old_held = old ? old->st : NULL;
	int r;

	dlpd_assert(e->st->names == 1 && e->st->attach_refs == 0);
	/* Removing old first cannot make the link fail: the map has buckets already. Nothing
	 * runs in between, so no attacher sees the name absent, and watchers see one REPLACED. */
	if (old) {
		dlpd_invalidate(s, old);
		old_st = dlpd_entry_unlink(&s->reg, old);
	}
	r = dlpd_entry_link(&s->reg, e, owner ? &owner->held : NULL);
	if (r < 0) {
		struct dlpd_storage *st = e->st;

		/* the name is gone: the journal must not bring back the entry it had */
		e->journaled = old_journaled;
		dlpd_persist_removed(s, e);
		dlpd_entry_free_unlinked(e);
		st->names--;
		dlpd_storage_gone(s, st);
		if (old_held)
			storage_unnamed(s, old_held, old_st);
		return r;
	}
	/* Recorded before anyone hears of it, so that nobody is told of an entry a crash would
	 * lose, and before the old storage leaves the fd store, so that a crash in between
	 * finds one of the two entries whole (the old one's place in its uid's share is the new
	 * one's meanwhile). */
	dlpd_persist_published(s, e, old_journaled,
			       old_held && old_held->names == 0 ? old_held : NULL);
	if (old_held)
		storage_unnamed(s, old_held, old_st);
	notify_watchers(s, old ? DLPC_WATCH_REPLACED : DLPC_WATCH_PUBLISHED, e, prev_gen, 0, e->uid,
			e->pid);
	wake_waiters(s, e);
	return 0;
}

void dlpd_names_remove(struct dlpd_server *s, struct dlpd_entry *e, int reason,
		       const struct dlpd_peer *actor)
{
	struct dlpd_storage *st;

	dlpd_invalidate(s, e);
	dlpd_persist_removed(s, e);
	notify_watchers(s, DLPC_WATCH_UNPUBLISHED, e, 0, reason, actor->uid, actor->pid);
	st = e->st;
	storage_unnamed(s, st, dlpd_entry_unlink(&s->reg, e));
}

void dlpd_names_release(struct dlpd_peer *p, struct dlpd_ref *ref)
{
	dlpd_storage_gone(p->srv, dlpd_ref_drop(&p->srv->reg, &p->held, ref));
}

static void waiter_closed(uv_handle_t *h)
{
	free(h->data);
}

void dlpd_waiter_free(struct dlpd_attach_wait *aw)
{
	struct dlpd_peer *p = aw->peer;

	dlpd_waiter_unlink(&p->srv->reg, &p->held, &aw->w);
	dlpd_mem_uncharge(p->srv, p->usage, DLPD_ATTACH_WAIT_COST);
	if (aw->timed) {
		aw->timer.data = aw;
		uv_close((uv_handle_t *)&aw->timer, waiter_closed);
	} else {
		free(aw);
	}
}

void dlpd_names_drop_peer(struct dlpd_peer *p)
{
	struct dlpd_ref *ref;
	size_t cursor = 0;

	while (!dlpd_list_empty(&p->held.waiters))
		dlpd_waiter_free(dlpd_attach_wait_of(p->held.waiters.next));
	while (!dlpd_list_empty(&p->held.ephemeral))
		dlpd_names_remove(
			p->srv,
			dlpd_container_of(p->held.ephemeral.next, struct dlpd_entry, owner_link),
			DLPC_WATCH_BY_DISCONNECT, p);
	while ((ref = dlpd_ref_any(&p->held, &cursor)))
		dlpd_names_release(p, ref);
	dlpd_hmap_clear(&p->held.refs);
}

void dlpd_names_clear(struct dlpd_server *s)
{
	struct dlpd_entry *e;
	size_t cursor = 0;

	/* no watcher and no connection is left to tell */
	while ((e = dlpd_entry_any(&s->reg, &cursor)))
		dlpd_storage_gone(s, dlpd_entry_unlink(&s->reg, e));
}
