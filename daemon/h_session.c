/* SPDX-License-Identifier: Apache-2.0 */
/* Handlers for the session itself: HELLO (the version check) and STAT (counters). */
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "closer.h"
#include "handlers.h"
#include "peer.h"
#include "quota.h"
#include "reaper.h"
#include "util.h"

int dlpd_on_hello(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	Dlpackd__V1__Hello *req = (Dlpackd__V1__Hello *)*m;
	Dlpackd__V1__HelloReply rep = DLPACKD__V1__HELLO_REPLY__INIT;
	char desc[96], client[96];
	uint64_t uid_fds;

	(void)f;
	if (p->state != DLPD_CONN_GREETING) {
		dlpd_reply_error(p, id, EPROTO, "HELLO sent twice");
		return -EPROTO;
	}
	dlpc__printable((const uint8_t *)req->client, strlen(req->client), client, sizeof(client));
	/* one version only: a client of another build is refused, whichever is newer */
	if (req->version_major != DLPC_PROTO_MAJOR || req->version_minor != DLPC_PROTO_MINOR) {
		dlpd_reply_error(p, id, EPROTO,
				 "protocol version mismatch: client speaks %u.%u, dlpackd speaks "
				 "%u.%u; " DLPC_PROTO_MISMATCH_ADVICE,
				 req->version_major, req->version_minor, DLPC_PROTO_MAJOR,
				 DLPC_PROTO_MINOR);
		dlpd_peer_fail(p, LOG_WARNING, "protocol version mismatch: client %s speaks %u.%u",
			       client, req->version_major, req->version_minor);
		return -EPROTO;
	}
	/* counted since accept; refused here, so that the client learns why */
	if (p->usage->connections > p->srv->lim.connections_per_uid) {
		unsigned long long n = p->usage->connections - 1;
		unsigned long long max = p->srv->lim.connections_per_uid;

		dlpd_reply_error(p, id, EDQUOT,
				 "uid %u has %llu connections open; the limit is %llu "
				 "(--max-connections-per-uid)",
				 (unsigned)p->uid, n, max);
		dlpd_peer_fail(p, LOG_NOTICE,
			       "refused: uid %u has %llu connections open, the limit is %llu",
			       (unsigned)p->uid, n, max);
		return -EDQUOT;
	}
	/* and its memory among its uid's (which its records may have taken already) */
	if (p->usage->memory + p->usage->pending_bytes > p->srv->lim.memory_per_uid) {
		char why[256];

		dlpd_quota_memory(p, DLPD_CONNECTION_COST, DLPD_CONNECTION_COST, why, sizeof(why));
		dlpd_reply_error(p, id, EDQUOT, "%s", why);
		dlpd_peer_fail(p, LOG_NOTICE, "refused: %s", why);
		return -EDQUOT;
	}
	/* its connection counts among its uid's fds, which may not pass their share (at 100%
	 * the share is the whole budget, where accept's own reserve rules) */
	uid_fds = dlpd_uid_fds(p->usage);
	if (dlpd_uid_fd_share(p->srv) < p->srv->fd_budget && uid_fds > dlpd_uid_fd_share(p->srv)) {
		char why[256];

		dlpd_uid_fd_share_why(p, uid_fds - 1, why, sizeof(why));
		dlpd_reply_error(p, id, EDQUOT, "%s", why);
		dlpd_peer_fail(p, LOG_NOTICE, "refused: %s", why);
		return -EDQUOT;
	}
	p->state = DLPD_CONN_SERVING;
	rep.version_major = DLPC_PROTO_MAJOR;
	rep.version_minor = DLPC_PROTO_MINOR;
	rep.server = "dlpackd " DLPD_VERSION;
	rep.max_frame = DLPC_FRAME_MAX;
	dlpd_log(LOG_DEBUG, "%s: connected with %s", dlpd_peer_desc(p, desc, sizeof(desc)), client);
	return dlpd_reply(p, DLPC_MSG_HELLO | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
}

int dlpd_on_stat(struct dlpd_peer *p, uint32_t id, ProtobufCMessage **m, struct dlpc__frame *f)
{
	struct dlpd_server *s = p->srv;
	Dlpackd__V1__StatReply rep = DLPACKD__V1__STAT_REPLY__INIT;

	(void)m;
	(void)f;
	rep.daemon_pid = (uint32_t)getpid();
	rep.uptime_ms = dlpd_now_ms() - s->start_ms;
	rep.connections = s->npeers;
	rep.entries = s->reg.names.count;
	rep.storages = s->reg.storages;
	rep.bytes_held = s->reg.bytes;
	rep.references = s->reg.refs;
	rep.cached_references = s->reg.cached_refs;
	rep.invalidations = s->stats.invalidations;
	rep.waiters = s->reg.waiters;
	/* pending first: only this thread adds to it, so fds_open is counted after */
	rep.fds_closing =
		dlpd_reaper_pending() + dlpd_closers_fds() + s->peers_closing + s->draining;
	rep.fds_open = dlpd_count_fds(UINT64_MAX);
	rep.fds_own = s->fds_own;
	rep.fd_budget = s->fd_budget;
	rep.fds_sent = s->stats.fds_sent;
#define X(NAME, name, ...) rep.req_##name = s->stats.req[DLPC_MSG_##NAME];
	DLPC_REQUESTS(X)
#undef X
	rep.protocol_errors = s->stats.protocol_errors;
	rep.watchers = s->nwatchers;
	rep.events = s->event_seq;
	rep.queue_drops = s->stats.queue_drops;
	for (struct dlpd_list *l = s->peers.next; l != &s->peers; l = l->next)
		rep.tx_queued += dlpd_container_of(l, struct dlpd_peer, link)->tx.bytes;
	rep.uid_bytes_held = p->usage->bytes;
	rep.uid_bytes_pinned = p->usage->pinned_bytes;
	rep.uid_entries = p->usage->entries;
	rep.uid_connections = p->usage->connections;
	rep.channels = s->reg.channels.count;
	rep.messages = s->reg.messages;
	rep.uid_channels = p->usage->channels;
	return dlpd_reply(p, DLPC_MSG_STAT | DLPC_MSG_REPLY, id, &rep.base, NULL, 0);
}
