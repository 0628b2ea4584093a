/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Resource limits: what each uid holds, and the checks a publish must pass.
 *
 * A uid is charged with the declared size of every storage it publishes, from the publish until
 * the storage is freed: a storage that was replaced or unpublished but is still referenced by
 * attachers is still memory the daemon keeps alive for that uid, so it still counts. Entries and
 * connections are charged while they exist. A usage record lives while anything is charged to it.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "dlpackd.h"

void dlpd_limits_init(struct dlpd_limits *l)
{
	l->bytes_per_uid = DLPC_UID_BYTES_DEFAULT;
	l->entries_per_uid = DLPC_UID_ENTRIES_DEFAULT;
	l->connections_per_uid = DLPC_UID_CONNECTIONS_DEFAULT;
	l->refs_per_connection = DLPC_CONN_REFS_DEFAULT;
	l->pending_per_connection = DLPC_CONN_PENDING_DEFAULT;
	l->frame_timeout_ms = DLPC_FRAME_TIMEOUT_MS_DEFAULT;
	l->queue_bytes = DLPC_TX_QUEUE_MAX;
	l->queue_fds = DLPC_TX_QUEUE_FDS_MAX;
	l->watch_queue_bytes = DLPC_WATCH_QUEUE_MAX;
}

struct dlpd_usage *dlpd_usage_find(const struct dlpd_registry *r, uid_t uid)
{
	uint64_t h = dlpd_hash_u64(uid);

	for (struct dlpd_hnode *n = dlpd_hmap_chain(&r->uids, h); n; n = n->next) {
		struct dlpd_usage *u = dlpd_container_of(n, struct dlpd_usage, node);

		if (u->uid == uid)
			return u;
	}
	return NULL;
}

struct dlpd_usage *dlpd_usage_get(struct dlpd_registry *r, uid_t uid)
{
	struct dlpd_usage *u = dlpd_usage_find(r, uid);

	if (u)
		return u;
	u = calloc(1, sizeof(*u));
	if (!u)
		return NULL;
	u->uid = uid;
	if (dlpd_hmap_insert(&r->uids, &u->node, dlpd_hash_u64(uid)) < 0) {
		free(u);
		return NULL;
	}
	return u;
}

void dlpd_usage_put(struct dlpd_registry *r, struct dlpd_usage *u)
{
	if (!u || u->storages || u->entries || u->connections)
		return;
	dlpd_hmap_remove(&r->uids, &u->node);
	free(u);
}

int dlpd_quota_publish(const struct dlpd_peer *p, uint64_t size, bool holds_fd,
		       const struct dlpd_entry *old, char *why, size_t whylen)
{
	const struct dlpd_server *s = p->srv;
	const struct dlpd_limits *lim = &s->lim;
	const struct dlpd_usage *u = p->usage;
	uint64_t bytes = u->bytes, entries = u->entries;
	uint64_t fds = s->reg.storage_fds + s->npeers + s->peers_closing + dlpd_reaper_pending();
	bool old_freed = old && old->st->names == 1 && old->st->attach_refs == 0;

	/* A replace of one's own entry keeps the entry count; the old storage is freed at once
	 * if nobody has it attached. */
	if (old && old->uid == p->uid)
		entries--;
	if (old_freed) {
		fds -= old->st->fd >= 0;
		if (old->st->usage == u)
			bytes -= old->st->charged;
	}
	if (entries + 1 > lim->entries_per_uid) {
		snprintf(why, whylen,
			 "uid %u has %llu entries published; the limit is %llu "
			 "(--max-entries-per-uid)",
			 (unsigned)p->uid, (unsigned long long)entries,
			 (unsigned long long)lim->entries_per_uid);
		return -EDQUOT;
	}
	if (size > lim->bytes_per_uid || bytes > lim->bytes_per_uid - size) {
		snprintf(why, whylen,
			 "uid %u holds %llu bytes and asks for %llu more; the limit is %llu bytes "
			 "(--max-bytes-per-uid)",
			 (unsigned)p->uid, (unsigned long long)bytes, (unsigned long long)size,
			 (unsigned long long)lim->bytes_per_uid);
		return -EDQUOT;
	}
	/* The storage fd is ours already (it came with the frame): keeping it must leave the
	 * reserve untouched. Connections count because each holds an fd as well. */
	if (holds_fd && fds + 1 > s->fd_budget) {
		snprintf(why, whylen,
			 "dlpackd holds %llu storage and connection fds; its fd limit leaves room "
			 "for "
			 "%llu (RLIMIT_NOFILE minus %d in reserve)",
			 (unsigned long long)fds, (unsigned long long)s->fd_budget,
			 DLPC_FD_RESERVE);
		return -EDQUOT;
	}
	return 0;
}
