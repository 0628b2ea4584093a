/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Direct channels (protocol 1.8, direct.c): a channel whose messages go through a socket pair
 * the daemon makes, never through the daemon. channel.c holds the channel (ch->ends included);
 * this module makes, renews and shuts its sockets and tells what they queue (its depth).
 */
#ifndef DLPD_DIRECT_H
#define DLPD_DIRECT_H

#include "channel.h"

/* Make @p ch direct, with room for about @p capacity messages (ch->direct_capacity
 * says how many the kernel's buffers allow). 0, or a negative errno and why. */
int dlpd_direct_open(struct dlpd_server *s, struct dlpd_channel *ch, uint32_t capacity, char *why,
		     size_t whylen);
/* Shut @p ch's sockets (senders get EPIPE; receivers drop what is queued and read
 * the end) and let go of the daemon's ends. */
void dlpd_direct_close(struct dlpd_server *s, struct dlpd_channel *ch);
/* Undo what a process that joined @p ch may have done to its sockets: credentials
 * turned off, or the pair shut (new sockets then; the old ones closed for @p joiner's uid, in
 * its fd share). 0, or a negative errno and why (the channel keeps its shut pair, and the next
 * JOIN tries again). */
int dlpd_direct_renew(struct dlpd_peer *joiner, struct dlpd_channel *ch, char *why, size_t whylen);
/* Shut every direct channel's sockets (an upgrade: the channels do not survive it,
 * and processes that joined one must not go on using it). */
void dlpd_direct_shutdown_all(struct dlpd_server *s);
/* End @p ch's stream (1.10): its sending end shut for writing, so that senders get
 * EPIPE and receivers read what is queued, then the end (not a removal: nothing is dropped). */
void dlpd_direct_end(struct dlpd_channel *ch);
/* The records queued in @p ch's socket. */
uint32_t dlpd_direct_depth(const struct dlpd_channel *ch);
/* What LIST, CHANNEL and watch events say of a direct @p ch beyond dlpd_channel_info(): its
 * flag, the capacity its sending end allows and the records its socket queues. Nothing for a
 * channel the daemon queues. */
void dlpd_direct_info(const struct dlpd_channel *ch, Dlpackd__V1__ChannelInfo *info);

#endif
