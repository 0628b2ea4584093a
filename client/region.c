/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A region's references and the end of its teardown, once its memory is unmapped: shared by the
 * views (view.c) and by the CUDA thread that lets go of device memory after the consumer's work
 * (cuda.c).
 */
#include <stdlib.h>
#include <unistd.h>

#include "core.h"
#include "region.h"

void dlpc__region_ref(struct dlpc__region *r)
{
	atomic_fetch_add_explicit(&r->refs, 1, memory_order_relaxed);
}

void dlpc__region_finish(struct dlpc__region *r)
{
	if (r->fd >= 0)
		close(r->fd);
	if (r->pool_token && r->pool_fd >= 0)
		close(r->pool_fd);
	if (r->client) {
		if (!r->ce)
			dlpc__release_ref(r->client, r->ref_id, r->conn_seq);
		dlpc__client_unref(r->client);
	}
	free(r->parts);
	free(r);
}
