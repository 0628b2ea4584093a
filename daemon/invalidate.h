/* SPDX-License-Identifier: Apache-2.0 */
/* INVALIDATE notices to clients that may cache references (invalidate.c). */
#ifndef DLPD_INVALIDATE_H
#define DLPD_INVALIDATE_H

#include "state.h"

/*
 * @p e's name is about to stop naming it (replaced or removed): tell every connection holding a
 * cacheable reference of its storage, once each, before anything else is sent for the change.
 */
void dlpd_invalidate(struct dlpd_server *s, const struct dlpd_entry *e);

#endif
