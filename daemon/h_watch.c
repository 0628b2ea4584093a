/* SPDX-License-Identifier: Apache-2.0 */
/*
 * WATCH and the events it asks for.
 *
 * A watch is a connection of its own: after the WATCH reply the daemon only pushes EVENT frames
 * (id 0) to it (names.c sends them), and the only frame it may still send is RELEASE. A watcher
 * owns no ephemeral entry and no waiting ATTACH, so destroying one never changes the name map.
 */
#include <errno.h>
#include <string.h>

#include "handlers.h"
#include "peer.h"
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
	if (!dlpd_list_empty(&p->held.ephemeral) || !dlpd_list_empty(&p->held.waiters) ||
	    !dlpd_list_empty(&p->held.chan_waits))
		return dlpd_reply_error(
			p, id, EBUSY,
			"cannot watch on a connection that owns ephemeral entries "
			"or waits in ATTACH, SEND or RECV; watch on a connection of "
			"its own");
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
	dlpd_assert(dlpd_list_empty(&p->held.ephemeral) && dlpd_list_empty(&p->held.waiters));
	dlpd_list_del(&p->watch_link);
	p->srv->nwatchers--;
	p->watching = false;
}
