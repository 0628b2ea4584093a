/* SPDX-License-Identifier: Apache-2.0 */
/* The message of the last failure, per thread: what dlpc_last_error() returns. */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

static __thread char last_error[DLPC_ERROR_TEXT_MAX];

int dlpc__fail(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	return err;
}

DLPC_EXPORT const char *dlpc_last_error(void)
{
	return last_error;
}
