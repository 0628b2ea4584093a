/* SPDX-License-Identifier: Apache-2.0 */
/* The one place that decides the default socket path (daemon, library and tools all call it). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/un.h>
#include <unistd.h>

#include <dlpc/dlpc.h>

DLPC_EXPORT int dlpc_default_socket(char *buf, size_t len)
{
	const char *env = getenv(DLPC_SOCKET_ENV);
	const char *xdg;
	int n;

	if (env && *env)
		n = snprintf(buf, len, "%s", env);
	else if (geteuid() == 0)
		n = snprintf(buf, len, "%s", DLPC_SYSTEM_SOCKET);
	else if ((xdg = getenv("XDG_RUNTIME_DIR")) && *xdg)
		n = snprintf(buf, len, "%s/%s", xdg, DLPC_USER_SOCKET_NAME);
	else
		return -ENOENT;
	if (n < 0 || (size_t)n >= len || (size_t)n >= sizeof(((struct sockaddr_un *)0)->sun_path))
		return -ENAMETOOLONG;
	return n;
}
