/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Entries that outlive the daemon (persist.c): storage fds kept in the service manager's fd
 * store, the state journal that names them, and restoring both at start.
 */
#ifndef DLPD_PERSIST_H
#define DLPD_PERSIST_H

#include "state.h"
#include "systemd.h"

/* Names of our fds in the store and across an upgrade; the number follows in hex. */
#define DLPD_FDNAME_STORAGE "st-"  /* a storage, by its sid */
#define DLPD_FDNAME_STATE "state-" /* the state journal, by its generation (journal_gen) */
/* Fds of the store the journal needs: its own, and a second while it is rewritten. */
#define DLPD_STORE_STATE_FDS 2
/* A journal is rewritten once it is this long and more than twice its live records. */
#define DLPD_JOURNAL_COMPACT_MIN (1u << 20)
/* The longest journal read at start; a longer one is refused whole. */
#define DLPD_JOURNAL_MAX (1ull << 30)

/*
 * The journal: this header, then records, each a dlpd_rec_hdr and its payload. A PUT's payload
 * is a dlpd_put_fixed and the entry's Publish request, packed; a DEL's is the name. Native
 * byte order: the journal never leaves the machine.
 */
#define DLPD_JOURNAL_MAGIC "DLPDJNL1"
/* The magic of a journal the daemon gave up on or replaced: never restored. */
#define DLPD_JOURNAL_DEAD "DLPDDEAD"
struct dlpd_journal_hdr {
	char magic[8];
	uint64_t journal_gen; /* its generation: the number its fd name carries */
};

enum { DLPD_REC_PUT = 1, DLPD_REC_DEL = 2 };
/* A PUT whose storage is in the fd store (a snapshot's record may say it is not). */
#define DLPD_REC_STORED 1u

struct dlpd_rec_hdr {
	uint32_t len; /* of the payload that follows */
	uint16_t kind, flags;
	uint64_t check; /* dlpd_journal_check(): a torn or damaged record is skipped */
};

struct dlpd_put_fixed {
	uint64_t sid, generation;
	uint32_t uid;
	int32_t pid;
	int64_t created_ns;
};

/* The largest payload a record may have: a Publish fits a frame. */
#define DLPD_REC_PAYLOAD_MAX (sizeof(struct dlpd_put_fixed) + DLPC_FRAME_MAX)

/* The check of a record of @p kind and @p flags with payload @p p. */
uint64_t dlpd_journal_check(uint16_t kind, uint16_t flags, const uint8_t *p, size_t len);

/* Persistence off; dlpd_persist_restore() turns it on when dlpd_config.fd_store says so. */
void dlpd_persist_init(struct dlpd_server *s);
/*
 * Take the entries back from @p fds, the fds the service manager or an upgrading image passed
 * (storages and state journals by their names; every fd of the list becomes ours, and those
 * not used are closed and dropped from the store), then start a journal of them if the fd
 * store is on. Every entry goes through the checks of a publish; one that fails them is
 * refused and logged, alone. 0, or -ENOMEM.
 */
int dlpd_persist_restore(struct dlpd_server *s, struct dlpd_passed_fd *fds, size_t n);
/*
 * @p e was just given its name (replacing an entry whose journal record was
 * @p old_journaled bytes, 0 if none): hand its storage to the store and record it, if it can
 * outlive the daemon. Returns once the record is written, before the publish is answered.
 */
void dlpd_persist_published(struct dlpd_server *s, struct dlpd_entry *e, uint64_t old_journaled,
			    const struct dlpd_storage *leaving);
/* @p e is being removed: record that. */
void dlpd_persist_removed(struct dlpd_server *s, struct dlpd_entry *e);
/* @p st is being freed: take its fd out of the store. */
void dlpd_persist_storage_gone(struct dlpd_server *s, struct dlpd_storage *st);
/* The connections end with an upgrade's exec: take out of the store the storages that only
 * their references hold, which the new image will not know. */
void dlpd_persist_drop_held(struct dlpd_server *s);
/* A fresh state record of every entry that can outlive the daemon, for an upgrade: a memfd in
 * @p fd, its generation in @p gen. 0 or negative errno. */
int dlpd_persist_snapshot(struct dlpd_server *s, int *fd, uint64_t *gen);
void dlpd_persist_free(struct dlpd_server *s);

#endif
