/* SPDX-License-Identifier: Apache-2.0 */
/* The checks a publish must pass against the limits (quota.c). */
#ifndef DLPD_QUOTA_H
#define DLPD_QUOTA_H

#include "state.h"

/*
 * May @p p publish a storage charging @p size bytes (and one fd, if @p holds_fd), replacing
 * @p old (NULL if none)? 0, or -EDQUOT and in @p why the limit that refuses it and its value.
 */
int dlpd_quota_publish(const struct dlpd_peer *p, uint64_t size, bool holds_fd,
		       const struct dlpd_entry *old, char *why, size_t whylen);
/*
 * May @p p's uid have records taking @p more bytes of the daemon's memory (registry.h,
 * DLPD_*_COST), of which @p freed come back at once (a replace)? Its unfinished work (mem.c)
 * counts against the same --max-memory-per-uid. 0, or -EDQUOT and why in @p why.
 */
int dlpd_quota_memory(const struct dlpd_peer *p, uint64_t more, uint64_t freed, char *why,
		      size_t whylen);
/* The storage and connection fds one uid may hold: its share of the fd budget. */
uint64_t dlpd_uid_fd_share(const struct dlpd_server *s);
/* Why @p p's uid, holding @p held of them, may not take one more. */
void dlpd_uid_fd_share_why(const struct dlpd_peer *p, uint64_t held, char *why, size_t whylen);
/* Storage and connection fds open or on their way to being closed. */
uint64_t dlpd_fds_in_use(const struct dlpd_server *s);
/* Why the fd budget has no room (STAT's fd_budget and fds_own, with the limit they come
 * from). */
void dlpd_fd_budget_why(const struct dlpd_server *s, char *why, size_t whylen);
/* The most fd numbers dlpd_count_fds() asks about, one by one, when it cannot read
 * /proc/self/fd: about 0.1 s of fcntl() calls. */
#define DLPD_COUNT_FDS_PROBE_MAX (1u << 20)
/* The fds the daemon has open numbered below @p below (the entries of /proc/self/fd, or each
 * number below @p below asked about), or 0 if it cannot tell. An fd numbered at or above RLIMIT_NOFILE (one
 * inherited before the limit was lowered, or a tool's such as valgrind's) takes no number the
 * daemon could open. */
uint64_t dlpd_count_fds(uint64_t below);

#endif
