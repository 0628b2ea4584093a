/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The checks a publish must pass against the limits. What each uid holds is counted in the
 * registry (registry.c says what is charged when).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>

#include "closer.h"
#include "quota.h"
#include "reaper.h"
#include "systemd.h"

uint64_t dlpd_count_fds(uint64_t below)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *de;
	uint64_t n = 0;

	if (!d) {
		/* the table full (EMFILE), as at a start with as many fds passed as the limit
		 * allows: ask about each number instead, which takes no fd */
		if (below > DLPD_COUNT_FDS_PROBE_MAX)
			return 0;
		for (int fd = 0; fd < (int)below; fd++)
			n += fcntl(fd, F_GETFD) >= 0;
		return n;
	}
	while ((de = readdir(d))) {
		char *end;
		unsigned long long fd = strtoull(de->d_name, &end, 10);

		/* not "." or "..", nor the directory's own fd */
		if (*end == '\0' && end != de->d_name && fd < below && (int)fd != dirfd(d))
			n++;
	}
	closedir(d);
	return n;
}

uint64_t dlpd_fds_in_use(const struct dlpd_server *s)
{
	return s->reg.storage_fds + s->npeers + s->peers_closing + s->channel_fds + s->tx_fds +
	       s->rx_fds + s->draining + dlpd_reaper_pending() + dlpd_closers_fds() +
	       dlpd_notify_queued_fds();
}

void dlpd_fd_budget_why(const struct dlpd_server *s, char *why, size_t whylen)
{
	snprintf(why, whylen,
		 "dlpackd holds %llu storage, connection and channel fds, and its fd limit "
		 "leaves room for %llu (RLIMIT_NOFILE %llu, less %llu fds of its own and %d in "
		 "reserve)",
		 (unsigned long long)dlpd_fds_in_use(s), (unsigned long long)s->fd_budget,
		 (unsigned long long)s->fd_limit, (unsigned long long)s->fds_own, DLPC_FD_RESERVE);
}

int dlpd_quota_publish(const struct dlpd_peer *p, uint64_t size, bool holds_fd,
		       const struct dlpd_entry *old, char *why, size_t whylen)
{
	const struct dlpd_server *s = p->srv;
	const struct dlpd_limits *lim = &s->lim;
	const struct dlpd_usage *u = p->usage;
	/* what it publishes and what its references keep alive that no name reaches */
	uint64_t bytes = u->bytes + u->pinned_bytes, entries = u->entries;
	uint64_t uid_fds = dlpd_uid_fds(u);
	uint64_t fds = dlpd_fds_in_use(s), comes_pinned = 0;
	bool old_last_name = old && old->st->names == 1;

	/* A replace of one's own entry keeps the entry count. The old storage, if no other name
	 * reaches it, is freed at once when nobody has it attached, and otherwise is charged from
	 * then on to those who do: either way no longer to its publisher, unless it is one of
	 * them, and from then on to a replacer that holds it (root replacing another uid's
	 * entry) as well. */
	if (old && old->uid == p->uid)
		entries--;
	if (old_last_name && old->st->attach_refs == 0)
		fds -= old->st->fd >= 0;
	if (old_last_name && old->st->usage == u && !dlpd_storage_pinned_by(old->st, u)) {
		bytes -= old->st->charged;
		uid_fds -= old->st->fd >= 0;
	} else if (old_last_name && old->st->usage != u && dlpd_storage_pinned_by(old->st, u)) {
		comes_pinned = old->st->charged;
		bytes += comes_pinned;
		uid_fds += old->st->fd >= 0;
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
		char pinned[160] = "";

		if (u->pinned_bytes + comes_pinned)
			snprintf(pinned, sizeof(pinned),
				 " (%llu of them in storages no name reaches any more, which its "
				 "references keep alive%s)",
				 (unsigned long long)(u->pinned_bytes + comes_pinned),
				 comes_pinned ? ", the one this replace unnames among them" : "");
		snprintf(why, whylen,
			 "uid %u holds %llu bytes%s and asks for %llu more; the limit is %llu "
			 "bytes (--max-bytes-per-uid)",
			 (unsigned)p->uid, (unsigned long long)bytes, pinned,
			 (unsigned long long)size, (unsigned long long)lim->bytes_per_uid);
		return -EDQUOT;
	}
	/* The storage fd is ours already (it came with the frame): keeping it must leave the
	 * reserve untouched. Connections count because each holds an fd as well. */
	if (holds_fd && fds + 1 > s->fd_budget) {
		dlpd_fd_budget_why(s, why, whylen);
		return -EDQUOT;
	}
	/* No uid may hold more than its share of the fd budget, so that one uid's entries (which
	 * outlive its connections) cannot leave others unable to publish. */
	if (holds_fd && uid_fds + 1 > dlpd_uid_fd_share(s)) {
		dlpd_uid_fd_share_why(p, uid_fds, why, whylen);
		return -EDQUOT;
	}
	return 0;
}

int dlpd_quota_memory(const struct dlpd_peer *p, uint64_t more, uint64_t freed, char *why,
		      size_t whylen)
{
	const struct dlpd_usage *u = p->usage;
	uint64_t held = u->memory - freed + u->pending_bytes, limit = p->srv->lim.memory_per_uid;

	if (more <= limit && held <= limit - more)
		return 0;
	snprintf(why, whylen,
		 "uid %u has %llu bytes of dlpackd's memory in connections, entries, messages, "
		 "channels and references and %llu in unfinished frames, waiting requests and "
		 "unread replies, and this needs %llu more; the limit is %llu "
		 "(--max-memory-per-uid)",
		 (unsigned)p->uid, (unsigned long long)(u->memory - freed),
		 (unsigned long long)u->pending_bytes, (unsigned long long)more,
		 (unsigned long long)limit);
	return -EDQUOT;
}

uint64_t dlpd_uid_fd_share(const struct dlpd_server *s)
{
	if (s->fd_budget == UINT64_MAX)
		return UINT64_MAX;
	return s->fd_budget * s->lim.fd_share_per_uid / 100;
}

void dlpd_uid_fd_share_why(const struct dlpd_peer *p, uint64_t held, char *why, size_t whylen)
{
	const struct dlpd_server *s = p->srv;

	char closing[128] = "";

	if (p->usage && p->usage->closing)
		snprintf(closing, sizeof(closing), " (%llu of them fds it sent, still closing)",
			 (unsigned long long)p->usage->closing);
	else if (p->usage && p->usage->rx_fds)
		snprintf(closing, sizeof(closing),
			 " (%llu of them fds it sent with frames not yet complete)",
			 (unsigned long long)p->usage->rx_fds);
	else if (p->usage && p->usage->draining)
		snprintf(closing, sizeof(closing),
			 " (%llu of them sockets of closed connections with fds in flight to them, "
			 "which its processes have not read)",
			 (unsigned long long)p->usage->draining);
	snprintf(why, whylen,
		 "uid %u holds %llu storage, connection and direct channel fds%s; a uid may hold "
		 "%llu%% of the %llu dlpackd has for them, %llu (--max-fd-share-per-uid)",
		 (unsigned)p->uid, (unsigned long long)held, closing,
		 (unsigned long long)s->lim.fd_share_per_uid, (unsigned long long)s->fd_budget,
		 (unsigned long long)dlpd_uid_fd_share(s));
}
