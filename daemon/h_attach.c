/* SPDX-License-Identifier: Apache-2.0 */
/* Handlers for references: ATTACH (with its waiters), RELEASE, and CANCEL of a waiting
 * request. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "channel.h"
#include "handlers.h"
#include "mem.h"
#include "names.h"
#include "peer.h"
#include "util.h"

/* Does @p e count for an attach that asked (DLPC_WIRE_ATTACH_OWNER in @p flags) for @p owner? */
static bool owner_ok(const struct dlpd_entry *e, uint32_t flags, uint32_t owner)
{
	return !(flags & DLPC_WIRE_ATTACH_OWNER) || e->uid == (uid_t)owner;
}

static void waiter_expired(uv_timer_t *t)
{
	struct dlpd_waiter *w = t->data;
	struct dlpd_peer *p = w->peer;
	uint32_t id = w->req_id;
	long long ms = (long long)w->timeout_ms;
	bool owned = w->flags & DLPC_WIRE_ATTACH_OWNER;
	uint32_t owner = w->owner_uid;
	char name[DLPC_NAME_TEXT];

	dlpc__printable(w->q->name, w->q->len, name, sizeof(name));
	dlpd_waiter_free(p, w);
	if (owned)
		dlpd_reply_error(p, id, ETIMEDOUT,
				 "no entry named '%s' published by uid %u appeared within %lld ms",
				 name, (unsigned)owner, ms);
	else
		dlpd_reply_error(p, id, ETIMEDOUT, "no entry named '%s' appeared within %lld ms",
				 name, ms);
}

int dlpd_on_attach(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__Attach *req = (Dlpackd__V1__Attach *)*m;
	struct dlpd_server *s = p->srv;
	struct dlpd_waiter *w;
	struct dlpd_entry *e;
	char why[256], name[DLPC_NAME_TEXT];

	(void)f;
	if (dlpc__name_check(req->name.data, req->name.len, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EINVAL, "cannot attach: %s", why);
	if (req->flags & ~DLPC_WIRE_ATTACH_FLAGS)
		return dlpd_reply_error(p, id, EINVAL, "cannot attach: unknown flags 0x%x",
					req->flags & ~DLPC_WIRE_ATTACH_FLAGS);
	e = dlpd_entry_find(&s->reg, req->name.data, req->name.len);
	if (e && owner_ok(e, req->flags, req->owner_uid))
		return dlpd_attach_answer(p, id, e, req->flags);
	dlpc__printable(req->name.data, req->name.len, name, sizeof(name));
	/* another uid's entry under the name is no answer to this attach: as if absent */
	if (req->timeout_ms == 0 && e)
		return dlpd_reply_error(p, id, ENOENT,
					"no entry named '%s' published by uid %u (the entry there "
					"was published by uid %u)",
					name, (unsigned)req->owner_uid, (unsigned)e->uid);
	if (req->timeout_ms == 0)
		return dlpd_reply_error(p, id, ENOENT, "no entry named '%s'", name);
	if (p->held.nwaiters >= s->lim.pending_per_connection)
		return dlpd_reply_error(p, id, EDQUOT,
					"cannot wait for '%s': this connection has %llu requests "
					"waiting; the limit is %llu (--max-pending-per-connection)",
					name, (unsigned long long)p->held.nwaiters,
					(unsigned long long)s->lim.pending_per_connection);

	if (dlpd_mem_charge(p, DLPD_ATTACH_WAIT_COST, why, sizeof(why)) < 0)
		return dlpd_reply_error(p, id, EDQUOT, "cannot wait for '%s': %s", name, why);
	w = calloc(1, sizeof(*w));
	if (!w) {
		dlpd_mem_uncharge(s, p->usage, DLPD_ATTACH_WAIT_COST);
		return dlpd_reply_error(p, id, ENOMEM, "cannot wait for '%s': out of memory", name);
	}
	w->peer = p;
	w->req_id = id;
	w->flags = req->flags;
	w->owner_uid = req->owner_uid;
	if (dlpd_waiter_add(&s->reg, &p->held, w, req->name.data, req->name.len) < 0) {
		free(w);
		dlpd_mem_uncharge(s, p->usage, DLPD_ATTACH_WAIT_COST);
		return dlpd_reply_error(p, id, ENOMEM, "cannot wait for '%s': out of memory", name);
	}
	if (req->timeout_ms > 0) {
		uv_timer_init(s->loop, &w->timer);
		w->timer.data = w;
		w->timed = true;
		w->timeout_ms = req->timeout_ms;
		uv_timer_start(&w->timer, waiter_expired, (uint64_t)req->timeout_ms, 0);
	}
	return 0;
}

int dlpd_on_release(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__Release *req = (Dlpackd__V1__Release *)*m;

	(void)id;
	(void)f;
	size_t n = req->n_ref_ids + req->n_cached_ids + req->n_used_ids;

	if (n > DLPC_RELEASE_BATCH_MAX) {
		dlpd_reply_error(p, 0, EPROTO, "RELEASE of %zu references exceeds the limit of %d",
				 n, DLPC_RELEASE_BATCH_MAX);
		return -EPROTO;
	}
	/* marks only change what STAT and LIST say: one for a reference released meanwhile (or
	 * of a connection the client has since replaced) is no violation */
	for (size_t i = 0; i < req->n_cached_ids; i++) {
		struct dlpd_ref *ref = dlpd_ref_find(&p->held, req->cached_ids[i]);

		if (ref)
			dlpd_ref_mark(&p->srv->reg, ref, true);
	}
	for (size_t i = 0; i < req->n_used_ids; i++) {
		struct dlpd_ref *ref = dlpd_ref_find(&p->held, req->used_ids[i]);

		if (ref)
			dlpd_ref_mark(&p->srv->reg, ref, false);
	}
	for (size_t i = 0; i < req->n_ref_ids; i++) {
		struct dlpd_ref *ref = dlpd_ref_find(&p->held, req->ref_ids[i]);

		if (!ref) {
			dlpd_reply_error(
				p, 0, EPROTO,
				"RELEASE of reference %llu, which this client does not hold",
				(unsigned long long)req->ref_ids[i]);
			return -EPROTO;
		}
		dlpd_names_release(p, ref);
	}
	return 0;
}

int dlpd_on_cancel(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__Cancel *req = (Dlpackd__V1__Cancel *)*m;
	struct dlpd_list *l;

	(void)id;
	(void)f;
	/* a waiting ATTACH of this connection's, else a waiting SEND or RECV; an id that waits
	 * no more (answered meanwhile) is no violation */
	for (l = p->held.waiters.next; l != &p->held.waiters; l = l->next) {
		struct dlpd_waiter *w = dlpd_container_of(l, struct dlpd_waiter, peer_link);
		char name[DLPC_NAME_TEXT];

		if (w->req_id != req->request_id)
			continue;
		dlpc__printable(w->q->name, w->q->len, name, sizeof(name));
		dlpd_waiter_free(p, w);
		dlpd_reply_error(p, req->request_id, ECANCELED,
				 "the wait for '%s' was canceled by the client", name);
		return 0;
	}
	dlpd_channel_cancel(p, req->request_id);
	return 0;
}
