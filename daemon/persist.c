/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Entries that outlive the daemon.
 *
 * A storage is an fd, and a service manager can keep fds for a service across its restarts
 * (systemd's fd store: FDSTORE=1 with FDNAME=, undone by FDSTOREREMOVE=1; the fds come back as
 * LISTEN_FDS/LISTEN_FDNAMES). Every entry that may outlive its connection (not ephemeral, not
 * legacy CUDA IPC) gets a storage id (sid), and with the store on its storage fd goes there as
 * "st-<sid>" the moment it is published. What the fds mean (names, generations, owners, flags,
 * tensor tables) is in the state journal, a memfd in the store as "state-<generation>": records
 * appended with pwrite() before a publish or unpublish is answered, a PUT for each entry (its
 * Publish request as received, plus sid, generation, owner and time) and a DEL for each removal.
 * A replace is a PUT alone. When the journal is long and mostly dead it is rewritten into a new
 * memfd of the next generation, stored before the old one is dropped, so the store always holds a
 * complete record. A journal dropped (rewritten, or given up) is invalidated in place first
 * (journal_kill()): the store holds the same memfd, so it can never come back, whether or not
 * the service manager takes its removal. Notifications that find the manager's queue full wait
 * in order (systemd.c): a publish waits for its storage's to go, for a bound, while the manager
 * keeps up, and a rewrite waits until none is left.
 *
 * At start the journal of the highest generation that reads whole (every record intact) is replayed
 * (a newer one that does not is skipped, and logged; only if none reads whole are the intact
 * records of the newest that reads at all used), and each entry it
 * names goes through the checks of a publish (name, flags, device, tensors, the storage's seals
 * and size, the owner's quota) before it is trusted. One that fails is refused and logged
 * alone; a storage no entry claims is closed and dropped from the store. The record is written
 * in native byte order: it never leaves the machine, nor the daemon's service.
 *
 * An upgrade without a store (upgrade.c) passes a fresh journal (dlpd_persist_snapshot()) and
 * the storages the same way, so one restore serves both.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "entry.h"
#include "persist.h"
#include "quota.h"
#include "util.h"

uint64_t dlpd_journal_check(uint16_t kind, uint16_t flags, const uint8_t *p, size_t len)
{
	return dlpd_hash_bytes(p, len) ^ dlpd_hash_u64((uint64_t)kind << 16 | flags);
}

static bool store_on(const struct dlpd_persist *p)
{
	return p->store_max > 0 && !p->broken;
}

/*
 * Make the journal @p fd one no restore takes: its header says it was given up. The service
 * manager's store holds the same memfd, so this holds at once, whether or not the manager ever
 * takes the FDSTOREREMOVE that follows. 0 or negative errno.
 */
static int journal_kill(int fd)
{
	static const char dead[8] = DLPD_JOURNAL_DEAD;

	if (pwrite(fd, dead, sizeof(dead), 0) == (ssize_t)sizeof(dead))
		return 0;
	/* too short for a header: refused as well */
	return ftruncate(fd, 0) == 0 ? 0 : -errno;
}

/* Drop the journal @p fd, of @p gen, from the store for good: invalidated first, then the
 * manager asked to let go of it; closed. */
static void journal_drop(int fd, uint64_t gen)
{
	int r = journal_kill(fd);

	if (r < 0)
		dlpd_log(LOG_ERR,
			 "cannot invalidate state journal " DLPD_FDNAME_STATE "%" PRIx64 ": %s",
			 gen, strerror(-r));
	dlpd_notify_fds(NULL, 0, "FDSTOREREMOVE=1\nFDNAME=" DLPD_FDNAME_STATE "%" PRIx64, gen);
	close(fd);
}

/* Persistence stops: say why and what it means, once. */
static void give_up(struct dlpd_server *s, const char *what, int err)
{
	struct dlpd_persist *p = &s->persist;

	if (p->broken)
		return;
	p->broken = true;
	dlpd_log(LOG_ERR, "%s: %s; entries will not survive a restart of dlpackd from now on", what,
		 strerror(err));
	/* A journal that stops here would bring back, after a restart, entries removed since:
	 * better none, whether or not the manager takes its removal. A restart then closes every
	 * stored storage. */
	if (p->journal_fd >= 0) {
		journal_drop(p->journal_fd, p->journal_gen);
		p->journal_fd = -1;
	}
	dlpd_notify("STATUS=entries no longer persisted: %s", what);
}

/* Room in a growing buffer; false on ENOMEM. */
static bool reserve(struct dlpd_persist *p, size_t need)
{
	uint8_t *np;
	size_t cap = p->rec_cap ? p->rec_cap : 4096;

	if (need <= p->rec_cap)
		return true;
	while (cap < need)
		cap *= 2;
	np = realloc(p->rec, cap);
	if (!np)
		return false;
	p->rec = np;
	p->rec_cap = cap;
	return true;
}

/* Build the record of @p e (flags: DLPD_REC_STORED or not) in p->rec; its length, or 0 on ENOMEM. */
static size_t put_record(struct dlpd_persist *p, const struct dlpd_entry *e, uint16_t flags)
{
	size_t plen = dlpackd__v1__publish__get_packed_size(e->pub);
	size_t len = sizeof(struct dlpd_put_fixed) + plen;
	struct dlpd_rec_hdr h = {.len = (uint32_t)len, .kind = DLPD_REC_PUT, .flags = flags};
	struct dlpd_put_fixed fx = {.sid = e->st->sid,
				    .generation = e->generation,
				    .uid = (uint32_t)e->uid,
				    .pid = (int32_t)e->pid,
				    .created_ns = e->created_ns};
	uint8_t *payload;

	if (!reserve(p, sizeof(h) + len))
		return 0;
	payload = p->rec + sizeof(h);
	memcpy(payload, &fx, sizeof(fx));
	dlpackd__v1__publish__pack(e->pub, payload + sizeof(fx));
	h.check = dlpd_journal_check(h.kind, h.flags, payload, len);
	memcpy(p->rec, &h, sizeof(h));
	return sizeof(h) + len;
}

static size_t del_record(struct dlpd_persist *p, const struct dlpd_entry *e)
{
	const ProtobufCBinaryData *name = &e->pub->name;
	struct dlpd_rec_hdr h = {.len = (uint32_t)name->len, .kind = DLPD_REC_DEL};

	if (!reserve(p, sizeof(h) + name->len))
		return 0;
	memcpy(p->rec + sizeof(h), name->data, name->len);
	h.check = dlpd_journal_check(h.kind, h.flags, name->data, name->len);
	memcpy(p->rec, &h, sizeof(h));
	return sizeof(h) + name->len;
}

static int write_at(int fd, const uint8_t *b, size_t len, uint64_t off)
{
	while (len > 0) {
		ssize_t n = pwrite(fd, b, len, (off_t)off);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			return n < 0 ? -errno : -ENOSPC;
		b += n;
		len -= (size_t)n;
		off += (uint64_t)n;
	}
	return 0;
}

/* Is @p e one that can outlive the daemon? Ephemeral entries end with their connection, and
 * legacy CUDA IPC memory (no fd) with its publisher. */
static bool lasting(const struct dlpd_entry *e)
{
	return !e->owner && e->st->fd >= 0 && e->st->sid != 0;
}

/*
 * A new journal of generation @p gen holding a PUT of every lasting entry (@p all) or of those
 * whose storage is stored (!@p all, for the store), but @p skip, an entry being removed. The
 * memfd in @p fd; each entry's journaled is set (to 0 where it has no record) when @p mark.
 * -EFBIG if it would be longer than a restore reads.
 */
static int write_journal(struct dlpd_server *s, uint64_t gen, bool all, bool mark,
			 const struct dlpd_entry *skip, int *fd, uint64_t *len_out,
			 uint64_t *live_out)
{
	struct dlpd_persist *p = &s->persist;
	struct dlpd_journal_hdr jh = {.journal_gen = gen};
	uint64_t off = sizeof(jh), live = 0;
	struct dlpd_hmap *m = &s->reg.names;
	int jfd, r;

	memcpy(jh.magic, DLPD_JOURNAL_MAGIC, sizeof(jh.magic));
	jfd = memfd_create("dlpackd-state", MFD_CLOEXEC);
	if (jfd < 0)
		return -errno;
	r = write_at(jfd, (const uint8_t *)&jh, sizeof(jh), 0);
	for (size_t b = 0; r == 0 && b < m->nbuckets; b++)
		for (struct dlpd_hnode *n = m->buckets[b]; r == 0 && n; n = n->next) {
			struct dlpd_entry *e = dlpd_container_of(n, struct dlpd_entry, node);
			size_t len;

			if (mark)
				e->journaled = 0;
			if (e == skip || !lasting(e) || (!all && !e->st->stored))
				continue;
			len = put_record(p, e, e->st->stored ? DLPD_REC_STORED : 0);
			r = !len			   ? -ENOMEM
			    : off + len > DLPD_JOURNAL_MAX ? -EFBIG
							   : write_at(jfd, p->rec, len, off);
			off += len;
			live += len;
			if (mark)
				e->journaled = len;
		}
	if (r < 0) {
		close(jfd);
		return r;
	}
	*fd = jfd;
	*len_out = off;
	*live_out = live;
	return 0;
}

/*
 * Replace the journal by a new one of the next generation holding only the live records (not
 * @p skip's): in the store first (sent, not waiting in dlpd_notify_fds()'s queue), so that the
 * store always holds a whole record, then the old one invalidated. While notifications wait
 * for the service manager the rewrite waits too (the old journal stays whole), unless it
 * @p must happen now: then it waits up to DLPD_NOTIFY_WAIT_MS for the manager, or gives up.
 */
static void compact(struct dlpd_server *s, const struct dlpd_entry *skip, bool must)
{
	struct dlpd_persist *p = &s->persist;
	uint64_t len, live;
	int fd, r;

	if (must)
		dlpd_notify_flush(DLPD_NOTIFY_WAIT_MS);
	else if (dlpd_notify_queued())
		return;
	r = write_journal(s, p->journal_gen + 1, false, true, skip, &fd, &len, &live);
	if (r < 0) {
		give_up(s, "cannot rewrite the state journal", -r);
		return;
	}
	r = dlpd_notify_fds_now(&fd, 1, "FDSTORE=1\nFDNAME=" DLPD_FDNAME_STATE "%" PRIx64,
				p->journal_gen + 1);
	if (r == -EAGAIN && !must) {
		/* the manager's queue filled meanwhile: another time */
		close(fd);
		return;
	}
	if (r < 0) {
		close(fd);
		give_up(s, "cannot hand the state journal to the service manager", -r);
		return;
	}
	if (p->journal_fd >= 0)
		journal_drop(p->journal_fd, p->journal_gen);
	dlpd_log(LOG_DEBUG, "state journal rewritten: %" PRIu64 " bytes, was %" PRIu64, len,
		 p->journal_len);
	p->journal_fd = fd;
	p->journal_gen++;
	p->journal_len = len;
	p->live_len = live;
}

/* Append the record in p->rec, @p len bytes long (0: it could not be built), and rewrite the
 * journal when it is due, without @p skip (an entry being removed but still in the map). */
static void append(struct dlpd_server *s, size_t len, const struct dlpd_entry *skip)
{
	struct dlpd_persist *p = &s->persist;
	int r;

	if (len == 0) {
		give_up(s, "cannot build a state journal record", ENOMEM);
		return;
	}
	/* A restore refuses a journal longer than DLPD_JOURNAL_MAX: rewrite it instead. Every
	 * record describes a change already made to the names (or to @p skip), so the rewrite
	 * holds it; one that would still be too long gives up. */
	if (p->journal_len + len > DLPD_JOURNAL_MAX) {
		compact(s, skip, true);
		return;
	}
	r = write_at(p->journal_fd, p->rec, len, p->journal_len);
	if (r < 0) {
		give_up(s, "cannot write the state journal", -r);
		return;
	}
	p->journal_len += len;
	if (p->journal_len >= DLPD_JOURNAL_COMPACT_MIN && p->journal_len > 2 * p->live_len)
		compact(s, skip, false);
}

/* The store's slots for storages that one uid may fill: its fd share (--max-fd-share-per-uid)
 * of them, at least one, so that one uid's lasting entries cannot keep every other uid's from
 * surviving a restart. */
static uint64_t store_uid_share(const struct dlpd_server *s)
{
	uint64_t slots = s->persist.store_max > DLPD_STORE_STATE_FDS
				 ? s->persist.store_max - DLPD_STORE_STATE_FDS
				 : 0;
	uint64_t share = slots * s->lim.fd_share_per_uid / 100;

	return share ? share : 1;
}

/* Hand @p st's fd to the store; false if it is not there (full, its uid's share of it taken,
 * or the send failed). @p leaving (NULL: none) is a storage that leaves the store right after,
 * the one st replaces: its place in its uid's share is st's. */
static bool store_storage(struct dlpd_server *s, struct dlpd_storage *st,
			  const struct dlpd_storage *leaving)
{
	struct dlpd_persist *p = &s->persist;
	struct dlpd_usage *u = st->usage;
	bool frees_own = leaving && leaving->stored && leaving->usage == u;
	int r;

	if (st->stored)
		return true;
	/* the store's own limit is hard (a journal rewritten now needs a slot): the storage
	 * leaving frees one only after st is in */
	if (p->storages_stored + DLPD_STORE_STATE_FDS >= p->store_max) {
		if (!p->warned_full)
			dlpd_log(LOG_WARNING,
				 "the fd store is full (%" PRIu64 " fds, FDSTORE= or "
				 "--fd-store): entries published from now on will not survive "
				 "a restart of dlpackd until some are removed",
				 p->store_max);
		p->warned_full = true;
		return false;
	}
	if (u->stored - frees_own + 1 > store_uid_share(s)) {
		if (!u->store_warned)
			dlpd_log(LOG_WARNING,
				 "uid %u holds %" PRIu64 " entries in the fd store, its share "
				 "(%" PRIu64 "%% of %" PRIu64
				 " slots, --max-fd-share-per-uid): its "
				 "entries published from now on will not survive a restart of "
				 "dlpackd until some are removed",
				 (unsigned)u->uid, u->stored, s->lim.fd_share_per_uid,
				 p->store_max - DLPD_STORE_STATE_FDS);
		u->store_warned = true;
		return false;
	}
	r = dlpd_notify_fds(&st->fd, 1, "FDSTORE=1\nFDNAME=" DLPD_FDNAME_STORAGE "%" PRIx64,
			    st->sid);
	if (r < 0) {
		give_up(s, "cannot hand a storage to the service manager", -r);
		return false;
	}
	/* in the store before the publish is answered, as long as the manager keeps up: a kill
	 * loses nothing acknowledged (one that stalls delays this, it never ends persistence) */
	dlpd_notify_settle();
	st->stored = true;
	p->storages_stored++;
	u->stored++;
	p->warned_full = false;
	u->store_warned = false;
	return true;
}

void dlpd_persist_published(struct dlpd_server *s, struct dlpd_entry *e, uint64_t old_journaled,
			    const struct dlpd_storage *leaving)
{
	struct dlpd_persist *p = &s->persist;

	p->live_len -= old_journaled;
	if (!e->owner && e->st->fd >= 0 && !e->st->sid)
		e->st->sid = ++p->next_sid;
	if (store_on(p) && lasting(e) && store_storage(s, e->st, leaving)) {
		size_t len = put_record(p, e, DLPD_REC_STORED);

		/* counted first: a rewrite inside append() counts again, from the names */
		e->journaled = len;
		p->live_len += len;
		append(s, len, NULL);
		if (!p->broken)
			return;
	}
	/* the entry it replaced must not come back either */
	if (old_journaled && store_on(p))
		append(s, del_record(p, e), NULL);
}

void dlpd_persist_removed(struct dlpd_server *s, struct dlpd_entry *e)
{
	struct dlpd_persist *p = &s->persist;

	if (!e->journaled)
		return;
	p->live_len -= e->journaled;
	e->journaled = 0;
	/* e is still in the names: a rewrite that this DEL sets off must leave it out */
	if (store_on(p))
		append(s, del_record(p, e), e);
}

void dlpd_persist_storage_gone(struct dlpd_server *s, struct dlpd_storage *st)
{
	struct dlpd_persist *p = &s->persist;

	/* at stop the store keeps everything: that is what it is for */
	if (!st->stored || s->stopping)
		return;
	st->stored = false;
	p->storages_stored--;
	st->usage->stored--;
	/* its FDSTORE=1 still waiting for the manager (which reads slowly) never goes, and then
	 * there is nothing to remove: churn cannot make the backlog grow, nor keep memory alive
	 * in it (the waiting notification holds a copy of the fd) */
	if (dlpd_notify_unqueue("FDSTORE=1\nFDNAME=" DLPD_FDNAME_STORAGE "%" PRIx64, st->sid))
		return;
	/* even with the journal given up: a storage left there would hold a slot of the store
	 * and its memory until the next restart */
	dlpd_notify_fds(NULL, 0, "FDSTOREREMOVE=1\nFDNAME=" DLPD_FDNAME_STORAGE "%" PRIx64,
			st->sid);
}

void dlpd_persist_drop_held(struct dlpd_server *s)
{
	for (struct dlpd_list *l = s->peers.next; l != &s->peers; l = l->next) {
		struct dlpd_peer *peer = dlpd_container_of(l, struct dlpd_peer, link);

		for (size_t b = 0; b < peer->held.refs.nbuckets; b++)
			for (struct dlpd_hnode *n = peer->held.refs.buckets[b]; n; n = n->next) {
				struct dlpd_ref *ref = dlpd_container_of(n, struct dlpd_ref, node);

				if (ref->st->names == 0)
					dlpd_persist_storage_gone(s, ref->st);
			}
	}
}

int dlpd_persist_snapshot(struct dlpd_server *s, int *fd, uint64_t *gen)
{
	uint64_t len, live;
	int r;

	/* the next generation: it wins over the journal in the store, which the new image drops */
	r = write_journal(s, s->persist.journal_gen + 1, true, false, NULL, fd, &len, &live);
	if (r == 0)
		*gen = s->persist.journal_gen + 1;
	return r;
}

void dlpd_persist_init(struct dlpd_server *s)
{
	struct dlpd_persist *p = &s->persist;

	memset(p, 0, sizeof(*p));
	p->journal_fd = -1;
}

void dlpd_persist_free(struct dlpd_server *s)
{
	struct dlpd_persist *p = &s->persist;

	if (p->journal_fd >= 0)
		close(p->journal_fd);
	p->journal_fd = -1;
	free(p->rec);
	p->rec = NULL;
	p->rec_cap = 0;
}

/* ---- restore ---- */

/* A passed fd of ours: a storage or a journal, by the number its name carries. */
struct passed {
	int fd;
	uint64_t num;
	size_t pos; /* in the list passed */
	bool claimed;
	char name[DLPD_FDNAME_MAX + 1];
};

/* The last PUT of a name while the journal is replayed. */
struct live_rec {
	struct dlpd_hnode node;
	const uint8_t *payload; /* into the journal's bytes */
	size_t len;
	uint16_t flags;
	uint64_t off;
	ProtobufCBinaryData name; /* into the unpacked request */
	Dlpackd__V1__Publish *pub;
};

struct restore {
	struct dlpd_server *s;
	struct passed *storages, *journals;
	size_t nstorages, njournals;
	struct dlpd_hmap live;
	unsigned restored, refused, orphans, damaged;
	uint64_t bytes;
};

/* "st-1f" -> 0x1f; false if @p name is not @p prefix and a hex number. */
static bool parse_name(const char *name, const char *prefix, uint64_t *num)
{
	size_t n = strlen(prefix);
	char *end;

	if (strncmp(name, prefix, n) != 0 || !name[n] || name[n] == '-' || name[n] == '+')
		return false;
	errno = 0;
	*num = strtoull(name + n, &end, 16);
	return !*end && !errno && *num != 0;
}

/* Close a passed fd we will not use, and drop it from the store: with the store off too, for
 * the service manager may still keep what an earlier run put there. */
static void drop_passed(int fd, const char *name)
{
	close(fd);
	if (dlpd_notify_socket())
		dlpd_notify_fds(NULL, 0, "FDSTOREREMOVE=1\nFDNAME=%s", name);
}

static int by_num(const void *a, const void *b)
{
	uint64_t x = ((const struct passed *)a)->num, y = ((const struct passed *)b)->num;

	return x < y ? -1 : x > y;
}

static int by_num_then_pos(const void *a, const void *b)
{
	const struct passed *x = a, *y = b;
	int r = by_num(a, b);

	return r ? r : x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* The storages are sorted by sid (sort_passed()). */
static struct passed *find_storage(struct restore *rs, uint64_t sid)
{
	struct passed key = {.num = sid};

	return rs->nstorages
		       ? bsearch(&key, rs->storages, rs->nstorages, sizeof(*rs->storages), by_num)
		       : NULL;
}

/* The journal's bytes, whole, or NULL (and the reason logged). */
static uint8_t *read_journal(const struct passed *j, size_t *len)
{
	struct dlpd_journal_hdr jh;
	struct stat st;
	uint8_t *buf;
	size_t got = 0;

	if (fstat(j->fd, &st) < 0 || !S_ISREG(st.st_mode)) {
		dlpd_log(LOG_ERR, "state journal %s is not a file; ignoring it", j->name);
		return NULL;
	}
	if ((uint64_t)st.st_size < sizeof(jh) || (uint64_t)st.st_size > DLPD_JOURNAL_MAX) {
		dlpd_log(LOG_ERR, "state journal %s holds %lld bytes, not %zu to %llu; ignoring it",
			 j->name, (long long)st.st_size, sizeof(jh), DLPD_JOURNAL_MAX);
		return NULL;
	}
	buf = malloc((size_t)st.st_size);
	if (!buf) {
		dlpd_log(LOG_ERR, "no memory to read state journal %s", j->name);
		return NULL;
	}
	while (got < (size_t)st.st_size) {
		ssize_t n = pread(j->fd, buf + got, (size_t)st.st_size - got, (off_t)got);

		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		got += (size_t)n;
	}
	memcpy(&jh, buf, sizeof(jh) <= got ? sizeof(jh) : 0);
	if (got >= sizeof(jh) && memcmp(jh.magic, DLPD_JOURNAL_DEAD, sizeof(jh.magic)) == 0) {
		dlpd_log(LOG_WARNING,
			 "state journal %s was given up by the daemon that wrote it (it may miss "
			 "removals made since); ignoring it",
			 j->name);
		free(buf);
		return NULL;
	}
	if (got < sizeof(jh) || memcmp(jh.magic, DLPD_JOURNAL_MAGIC, sizeof(jh.magic)) != 0 ||
	    jh.journal_gen != j->num) {
		dlpd_log(LOG_ERR,
			 "state journal %s is not one of dlpackd's (bad header or generation); "
			 "ignoring it",
			 j->name);
		free(buf);
		return NULL;
	}
	*len = got;
	return buf;
}

/* Does every record of the journal @p buf (@p len bytes, its header read) read whole: its
 * length within the journal, its checksum right, a PUT's request decodable? If not, false and
 * the first that does not, in @p why. */
static bool journal_whole(const uint8_t *buf, size_t len, char *why, size_t whylen)
{
	size_t off = sizeof(struct dlpd_journal_hdr);

	while (off < len) {
		struct dlpd_rec_hdr h;
		const uint8_t *payload;

		if (len - off < sizeof(h)) {
			snprintf(why, whylen, "it ends in a torn record at byte %zu", off);
			return false;
		}
		memcpy(&h, buf + off, sizeof(h));
		payload = buf + off + sizeof(h);
		if (h.len > DLPD_REC_PAYLOAD_MAX || h.len > len - off - sizeof(h)) {
			snprintf(why, whylen,
				 "the record at byte %zu claims %u bytes, more than %s", off, h.len,
				 h.len > DLPD_REC_PAYLOAD_MAX ? "a record may hold"
							      : "the journal holds");
			return false;
		}
		if (dlpd_journal_check(h.kind, h.flags, payload, h.len) != h.check ||
		    (h.kind != DLPD_REC_PUT && h.kind != DLPD_REC_DEL)) {
			snprintf(why, whylen, "the record at byte %zu is damaged (bad checksum)",
				 off);
			return false;
		}
		if (h.kind == DLPD_REC_PUT) {
			Dlpackd__V1__Publish *pub =
				h.len < sizeof(struct dlpd_put_fixed)
					? NULL
					: dlpackd__v1__publish__unpack(
						  NULL, h.len - sizeof(struct dlpd_put_fixed),
						  payload + sizeof(struct dlpd_put_fixed));

			if (!pub) {
				snprintf(why, whylen, "the entry at byte %zu cannot be decoded",
					 off);
				return false;
			}
			dlpackd__v1__publish__free_unpacked(pub, NULL);
		}
		off += sizeof(h) + h.len;
	}
	return true;
}

static void live_free(struct live_rec *l)
{
	dlpackd__v1__publish__free_unpacked(l->pub, NULL);
	free(l);
}

static struct live_rec *live_find(struct restore *rs, const uint8_t *name, size_t len)
{
	uint64_t h = dlpd_hash_bytes(name, len);

	for (struct dlpd_hnode *n = dlpd_hmap_chain(&rs->live, h); n; n = n->next) {
		struct live_rec *l = dlpd_container_of(n, struct live_rec, node);

		/* an empty name (refused later, by its check) unpacks with no data at all */
		if (n->hash == h && l->name.len == len &&
		    (len == 0 || memcmp(l->name.data, name, len) == 0))
			return l;
	}
	return NULL;
}

/* Apply the journal's records in order: the last PUT of each name not DELeted since. */
static void replay(struct restore *rs, const uint8_t *buf, size_t len, const char *jname)
{
	size_t off = sizeof(struct dlpd_journal_hdr);

	while (off < len) {
		struct dlpd_rec_hdr h;
		const uint8_t *payload;
		struct live_rec *l;

		if (len - off < sizeof(h)) {
			dlpd_log(LOG_WARNING,
				 "state journal %s ends in a torn record at byte %zu; ignoring "
				 "its %zu bytes",
				 jname, off, len - off);
			rs->damaged++;
			return;
		}
		memcpy(&h, buf + off, sizeof(h));
		payload = buf + off + sizeof(h);
		if (h.len > DLPD_REC_PAYLOAD_MAX || h.len > len - off - sizeof(h)) {
			dlpd_log(LOG_WARNING,
				 "state journal %s: the record at byte %zu claims %u bytes, more "
				 "than %s; ignoring the rest of the journal",
				 jname, off, h.len,
				 h.len > DLPD_REC_PAYLOAD_MAX ? "a record may hold"
							      : "the journal holds");
			rs->damaged++;
			return;
		}
		off += sizeof(h) + h.len;
		if (dlpd_journal_check(h.kind, h.flags, payload, h.len) != h.check ||
		    (h.kind != DLPD_REC_PUT && h.kind != DLPD_REC_DEL)) {
			dlpd_log(LOG_WARNING,
				 "state journal %s: the record at byte %zu is damaged (kind %u, "
				 "bad checksum); skipping it",
				 jname, off - sizeof(h) - h.len, h.kind);
			rs->damaged++;
			continue;
		}
		if (h.kind == DLPD_REC_DEL) {
			l = live_find(rs, payload, h.len);
			if (l) {
				dlpd_hmap_remove(&rs->live, &l->node);
				live_free(l);
			}
			continue;
		}
		l = calloc(1, sizeof(*l));
		if (l && h.len >= sizeof(struct dlpd_put_fixed))
			l->pub = dlpackd__v1__publish__unpack(
				NULL, h.len - sizeof(struct dlpd_put_fixed),
				payload + sizeof(struct dlpd_put_fixed));
		if (!l || !l->pub) {
			dlpd_log(LOG_WARNING,
				 "state journal %s: the entry at byte %zu cannot be decoded%s; "
				 "skipping it",
				 jname, off - sizeof(h) - h.len, l ? "" : " (out of memory)");
			free(l);
			rs->damaged++;
			continue;
		}
		l->payload = payload;
		l->len = h.len;
		l->flags = h.flags;
		l->off = off - sizeof(h) - h.len;
		l->name = l->pub->name;
		struct live_rec *old = live_find(rs, l->name.data, l->name.len);

		if (old) {
			dlpd_hmap_remove(&rs->live, &old->node);
			live_free(old);
		}
		if (dlpd_hmap_insert(&rs->live, &l->node,
				     dlpd_hash_bytes(l->name.data, l->name.len)) < 0) {
			dlpd_log(LOG_ERR, "state journal %s: out of memory at byte %zu", jname,
				 l->off);
			live_free(l);
			rs->damaged++;
		}
	}
}

/* The restore-time quota check: the limits in force now apply to what comes back. */
static int restore_quota(const struct dlpd_server *s, const struct dlpd_usage *u, uint64_t size,
			 char *why, size_t whylen)
{
	const struct dlpd_limits *lim = &s->lim;

	if (u->entries + 1 > lim->entries_per_uid) {
		snprintf(why, whylen,
			 "uid %u would have more than %llu entries (--max-entries-per-uid)",
			 (unsigned)u->uid, (unsigned long long)lim->entries_per_uid);
		return -EDQUOT;
	}
	if (size > lim->bytes_per_uid || u->bytes > lim->bytes_per_uid - size) {
		snprintf(why, whylen,
			 "uid %u would hold more than %llu bytes (--max-bytes-per-uid)",
			 (unsigned)u->uid, (unsigned long long)lim->bytes_per_uid);
		return -EDQUOT;
	}
	if (s->reg.storage_fds + 1 > s->fd_budget) {
		dlpd_fd_budget_why(s, why, whylen);
		return -EDQUOT;
	}
	return 0;
}

/* Is the request of a lasting entry one a publish could have made? 0, or -EINVAL and why. */
static int restore_check_request(const Dlpackd__V1__Publish *req, char *why, size_t whylen)
{
	int r = dlpc__name_check(req->name.data, req->name.len, why, whylen);

	if (r < 0)
		return r;
	if (req->flags & ~DLPC_PUBLISH_WRITABLE) {
		snprintf(why, whylen,
			 "flags 0x%x are not those of an entry that outlives its "
			 "connection",
			 req->flags);
		return -EINVAL;
	}
	if (req->cuda_ipc || req->reclaim_token) {
		snprintf(why, whylen, "CUDA memory of a process cannot outlive the daemon");
		return -EINVAL;
	}
	if (req->device_type == kDLCPU && (req->device_id != 0 || req->device_uuid.len)) {
		snprintf(why, whylen, "host device %d with CUDA fields", req->device_id);
		return -EINVAL;
	}
	if (req->device_type != kDLCPU && (req->device_type != kDLCUDA || req->device_id < 0 ||
					   req->device_uuid.len != DLPC_CUDA_UUID_SIZE)) {
		snprintf(why, whylen, "device %d:%d is not one an entry can have", req->device_type,
			 req->device_id);
		return -EINVAL;
	}
	if (req->storage_size == 0 || req->storage_size > INT64_MAX) {
		snprintf(why, whylen, "bad storage size %llu",
			 (unsigned long long)req->storage_size);
		return -EINVAL;
	}
	return dlpd_entry_check_tensors(req, why, whylen);
}

/* Does @p l (its fixed part @p fx) pass every check against what was passed back and the
 * limits in force? 0 with its storage's passed fd in *@p spp; else negative errno and why.
 * Its uid's usage is in *@p up once looked up (the caller puts it back on failure). */
static int restore_check(struct restore *rs, const struct live_rec *l,
			 const struct dlpd_put_fixed *fx, struct passed **spp,
			 struct dlpd_usage **up, char *why, size_t whylen)
{
	struct dlpd_server *s = rs->s;
	const Dlpackd__V1__Publish *req = l->pub;
	struct passed *sp;
	int r = restore_check_request(req, why, whylen);

	if (r < 0)
		return r;
	if (fx->generation == 0 || fx->generation > INT32_MAX) {
		snprintf(why, whylen, "bad generation %llu", (unsigned long long)fx->generation);
		return -EINVAL;
	}
	sp = find_storage(rs, fx->sid);
	if (!sp) {
		snprintf(why, whylen,
			 "its storage " DLPD_FDNAME_STORAGE "%" PRIx64 " was not passed back",
			 fx->sid);
		return -ENOENT;
	}
	if (sp->claimed) {
		snprintf(why, whylen,
			 "its storage " DLPD_FDNAME_STORAGE "%" PRIx64 " belongs to another entry",
			 fx->sid);
		return -EINVAL;
	}
	r = dlpd_entry_check_storage(req, sp->fd, why, whylen);
	if (r < 0)
		return r;
	*up = dlpd_usage_get(&s->reg, (uid_t)fx->uid);
	if (!*up) {
		snprintf(why, whylen, "out of memory");
		return -ENOMEM;
	}
	*spp = sp;
	return restore_quota(s, *up, req->storage_size, why, whylen);
}

/* The entry @p l describes, checked: its request taken over, on a new storage of @p sp's fd
 * charged to @p u; not linked yet. NULL on ENOMEM, with @p l unchanged. */
static struct dlpd_entry *restore_build(struct restore *rs, struct live_rec *l,
					const struct dlpd_put_fixed *fx, const struct passed *sp,
					struct dlpd_usage *u)
{
	struct dlpd_server *s = rs->s;
	Dlpackd__V1__Publish *req = l->pub;
	struct dlpd_storage *st;
	struct dlpd_entry *e;
	uint8_t *wire;
	size_t wire_len;

	dlpd_entry_drop_unknown_fields(req);
	wire = dlpd_entry_encode_tensors(req, &wire_len);
	e = wire ? calloc(1, sizeof(*e)) : NULL;
	st = e ? dlpd_storage_new(&s->reg, u, sp->fd, req->storage_size, req->device_type,
				  req->device_id)
	       : NULL;
	if (!st) {
		free(e);
		free(wire);
		return NULL;
	}
	st->names = 1;
	st->sid = fx->sid;
	st->stored = s->persist.store_max && (l->flags & DLPD_REC_STORED);
	e->st = st;
	e->pub = req;
	l->pub = NULL;
	e->generation = fx->generation;
	e->uid = (uid_t)fx->uid;
	e->usage = u;
	e->memory =
		dlpd_record_cost(protobuf_c_message_get_packed_size(&req->base), req->n_tensors);
	e->pid = (pid_t)fx->pid;
	e->created_ns = fx->created_ns;
	if (e->created_ns > s->reg.last_created_ns)
		s->reg.last_created_ns = e->created_ns;
	e->tensors_wire = wire;
	e->tensors_wire_len = wire_len;
	return e;
}

/* Trust @p l (its request taken over) if it passes every check; log why not otherwise. */
static void restore_entry(struct restore *rs, struct live_rec *l)
{
	struct dlpd_server *s = rs->s;
	struct dlpd_put_fixed fx;
	struct passed *sp = NULL;
	struct dlpd_usage *u = NULL;
	struct dlpd_entry *e = NULL;
	struct dlpd_storage *st;
	char why[256], name[DLPC_NAME_TEXT];
	int r;

	memcpy(&fx, l->payload, sizeof(fx));
	dlpc__printable(l->pub->name.data, l->pub->name.len, name, sizeof(name));
	r = restore_check(rs, l, &fx, &sp, &u, why, sizeof(why));
	if (r == 0) {
		e = restore_build(rs, l, &fx, sp, u);
		if (!e) {
			snprintf(why, sizeof(why), "out of memory");
			r = -ENOMEM;
		}
	}
	if (r < 0) {
		dlpd_log(LOG_ERR, "not restoring '%s' (journal byte %" PRIu64 "): %s", name, l->off,
			 why);
		rs->refused++;
		dlpd_usage_put(&s->reg, u);
		return;
	}
	st = e->st;
	if (dlpd_entry_link(&s->reg, e, NULL) < 0) {
		/* the storage goes with the fd, closed as an orphan below */
		dlpd_entry_free_unlinked(e);
		st->names = 0;			/* the entry that held it never got its name */
		dlpd_storage_free(&s->reg, st); /* and u, if nothing else is charged to it */
		dlpd_log(LOG_ERR, "not restoring '%s': out of memory", name);
		rs->refused++;
		return;
	}
	sp->claimed = true;
	if (st->stored) {
		s->persist.storages_stored++;
		st->usage->stored++;
	} else if ((l->flags & DLPD_REC_STORED) && dlpd_notify_socket())
		/* back, but the store is off now: the service manager lets go of it */
		dlpd_notify_fds(NULL, 0, "FDSTOREREMOVE=1\nFDNAME=%s", sp->name);
	rs->restored++;
	rs->bytes += st->size;
	dlpd_log(LOG_DEBUG, "restored '%s' generation %llu of uid %u, %llu bytes", name,
		 (unsigned long long)e->generation, (unsigned)e->uid, (unsigned long long)st->size);
}

static int by_offset(const void *a, const void *b)
{
	uint64_t x = (*(struct live_rec *const *)a)->off, y = (*(struct live_rec *const *)b)->off;

	return x < y ? -1 : x > y;
}

/* Sort the passed fds into storages and journals; anything else is closed. */
static int sort_passed(struct restore *rs, struct dlpd_passed_fd *fds, size_t n)
{
	size_t kept = 0;

	rs->storages = calloc(n ? n : 1, sizeof(*rs->storages));
	rs->journals = calloc(n ? n : 1, sizeof(*rs->journals));
	if (!rs->storages || !rs->journals)
		return -ENOMEM;
	for (size_t i = 0; i < n; i++) {
		struct passed *p = NULL;
		uint64_t num;

		if (parse_name(fds[i].name, DLPD_FDNAME_STORAGE, &num)) {
			p = &rs->storages[rs->nstorages++];
		} else if (parse_name(fds[i].name, DLPD_FDNAME_STATE, &num)) {
			p = &rs->journals[rs->njournals++];
		} else {
			dlpd_log(LOG_WARNING, "closing passed fd %d named '%s': not one of ours",
				 fds[i].fd, fds[i].name);
			drop_passed(fds[i].fd, fds[i].name);
			continue;
		}
		p->fd = fds[i].fd;
		p->num = num;
		p->pos = i;
		snprintf(p->name, sizeof(p->name), "%s", fds[i].name);
	}
	/* Sorted by sid, once: a restore of many entries looks each one up. The store keeps
	 * every fd sent under a name, so a name may come twice: the first passed is kept (a
	 * stable order, by position among equals) and its copies closed. */
	qsort(rs->storages, rs->nstorages, sizeof(*rs->storages), by_num_then_pos);
	for (size_t i = 0; i < rs->nstorages; i++) {
		if (kept && rs->storages[kept - 1].num == rs->storages[i].num) {
			close(rs->storages[i].fd);
			continue;
		}
		rs->storages[kept++] = rs->storages[i];
	}
	rs->nstorages = kept;
	/* Ids go on from the highest passed, claimed or not: one given again while the store
	 * still holds a storage under its name would pass that one back after a restart. */
	if (kept && rs->storages[kept - 1].num > rs->s->persist.next_sid)
		rs->s->persist.next_sid = rs->storages[kept - 1].num;
	return 0;
}

/* The fd store in use: --fd-store, unless no service manager is there to keep fds. */
static void store_choose(struct dlpd_persist *p)
{
	p->store_max = dlpd_config.fd_store;
	if (p->store_max && !dlpd_notify_socket()) {
		dlpd_log(LOG_WARNING,
			 "--fd-store=%llu (or FDSTORE) without NOTIFY_SOCKET: no service "
			 "manager keeps fds, entries end with the daemon",
			 (unsigned long long)p->store_max);
		p->store_max = 0;
	}
}

/*
 * The journal to restore from, read into *@p buf (*@p len bytes); NULL if none reads. Newest
 * first, the first that reads whole wins: a newer one damaged (its records can no longer say
 * what was removed) is skipped, with the reason. Only when none reads whole are the intact
 * records of the newest one that reads at all restored (*@p whole false).
 */
static const struct passed *journal_choose(struct restore *rs, uint8_t **buf, size_t *len,
					   bool *whole)
{
	const struct passed *best = NULL;

	*buf = NULL;
	*len = 0;
	*whole = false;
	for (;;) {
		struct passed *cand = NULL;
		uint8_t *b;
		size_t blen;
		char why[256];

		for (size_t i = 0; i < rs->njournals; i++)
			if (!rs->journals[i].claimed && (!cand || rs->journals[i].num > cand->num))
				cand = &rs->journals[i];
		if (!cand)
			return best;
		cand->claimed = true;
		b = read_journal(cand, &blen);
		if (!b)
			continue;
		if (journal_whole(b, blen, why, sizeof(why))) {
			free(*buf);
			*buf = b;
			*len = blen;
			*whole = true;
			return cand;
		}
		dlpd_log(LOG_WARNING, "skipping state journal %s: %s; looking for an older one",
			 cand->name, why);
		if (*buf) {
			free(b);
			continue;
		}
		*buf = b;
		*len = blen;
		best = cand;
	}
}

/* Replay the journal @p jname (@p len bytes at @p buf) and restore its live entries in the
 * journal's order: of two entries claiming one storage, the first wins. */
static void restore_journal(struct restore *rs, const uint8_t *buf, size_t len, const char *jname)
{
	struct live_rec **order;
	struct dlpd_hnode *node;
	size_t k = 0, cursor = 0;

	replay(rs, buf, len, jname);
	order = malloc((rs->live.count ? rs->live.count : 1) * sizeof(*order));
	while ((node = dlpd_hmap_next(&rs->live, &cursor))) {
		struct live_rec *l = dlpd_container_of(node, struct live_rec, node);

		dlpd_hmap_remove(&rs->live, node);
		if (order) {
			order[k++] = l;
			continue;
		}
		dlpd_log(LOG_ERR, "not restoring '%.*s': out of memory", (int)l->name.len,
			 (const char *)l->name.data);
		rs->refused++;
		live_free(l);
	}
	if (order)
		qsort(order, k, sizeof(*order), by_offset);
	for (size_t i = 0; i < k; i++) {
		restore_entry(rs, order[i]);
		live_free(order[i]);
	}
	free(order);
}

/* Close the passed storages no restored entry claimed. */
static void close_orphans(struct restore *rs)
{
	for (size_t i = 0; i < rs->nstorages; i++)
		if (!rs->storages[i].claimed) {
			dlpd_log(LOG_WARNING, "closing storage %s: no entry names it",
				 rs->storages[i].name);
			drop_passed(rs->storages[i].fd, rs->storages[i].name);
			rs->orphans++;
		}
}

/* A fresh journal of what came back, with the storages an upgrade passed that are not in the
 * store yet. */
static void store_restored(struct dlpd_server *s)
{
	struct dlpd_hnode **b = s->reg.names.buckets;

	for (size_t i = 0; i < s->reg.names.nbuckets; i++)
		for (struct dlpd_hnode *x = b[i]; x; x = x->next) {
			struct dlpd_entry *e = dlpd_container_of(x, struct dlpd_entry, node);

			if (lasting(e) && !e->st->stored)
				store_storage(s, e->st, NULL);
		}
	compact(s, NULL, true);
}

int dlpd_persist_restore(struct dlpd_server *s, struct dlpd_passed_fd *fds, size_t n)
{
	struct dlpd_persist *p = &s->persist;
	struct restore rs = {.s = s};
	const struct passed *best;
	uint8_t *buf;
	size_t len;
	uint64_t top_gen = 0;
	bool whole;
	int r;

	store_choose(p);
	dlpd_hmap_init(&rs.live);
	r = sort_passed(&rs, fds, n);
	if (r < 0) {
		for (size_t i = 0; i < n; i++)
			close(fds[i].fd);
		free(rs.storages);
		free(rs.journals);
		dlpd_log(LOG_ERR, "out of memory restoring %zu passed fds", n);
		return r;
	}
	/* the newest journal that reads as one; a rewrite stores the new one before it drops the
	 * old, so both may be here */
	for (size_t i = 0; i < rs.njournals; i++)
		if (rs.journals[i].num > top_gen)
			top_gen = rs.journals[i].num;
	best = journal_choose(&rs, &buf, &len, &whole);
	if (best && !whole)
		dlpd_log(LOG_WARNING,
			 "no state journal reads whole: restoring the intact records of %s, the "
			 "newest",
			 best->name);
	if (best)
		restore_journal(&rs, buf, len, best->name);
	else if (rs.nstorages)
		dlpd_log(LOG_ERR,
			 "%zu storages were passed without a state journal that reads; "
			 "closing them",
			 rs.nstorages);
	free(buf);
	dlpd_hmap_clear(&rs.live);
	close_orphans(&rs);
	p->journal_gen = top_gen;
	if (p->store_max)
		store_restored(s);
	/* once the new journal is stored (if it could not be, no journal is better than one that
	 * stops here: see give_up()), invalidated first so that none can come back */
	for (size_t i = 0; i < rs.njournals; i++)
		journal_drop(rs.journals[i].fd, rs.journals[i].num);
	if (best || rs.nstorages)
		dlpd_log(LOG_NOTICE,
			 "restored %u entries (%llu bytes) from state journal %s; refused %u, "
			 "%u damaged records, closed %u storages no entry named",
			 rs.restored, (unsigned long long)rs.bytes, best ? best->name : "(none)",
			 rs.refused, rs.damaged, rs.orphans);
	free(rs.storages);
	free(rs.journals);
	return 0;
}
