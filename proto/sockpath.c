/* SPDX-License-Identifier: Apache-2.0 */
/* The one place that decides the default socket paths: where a daemon binds, where clients
 * look (daemon, library and tools all call these). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dlpc/dlpc.h>

#include "sockpath.h"

/* Write @p dir, or @p dir/@p file, into @p buf: the length, or -ENAMETOOLONG if it does not fit
 * in @p len bytes or in a socket address. */
static int put(char *buf, size_t len, const char *dir, const char *file)
{
	int n = file ? snprintf(buf, len, "%s/%s", dir, file) : snprintf(buf, len, "%s", dir);

	if (n < 0 || (size_t)n >= len || (size_t)n >= sizeof(((struct sockaddr_un *)0)->sun_path))
		return -ENAMETOOLONG;
	return n;
}

static const char *env_set(const char *name)
{
	const char *v = getenv(name);

	return v && *v ? v : NULL;
}

int dlpc__socket_candidates(struct dlpc__sockpath out[DLPC__SOCKPATHS_MAX])
{
	const char *env = env_set(DLPC_SOCKET_ENV), *xdg = env_set("XDG_RUNTIME_DIR");
	int n = 0;

	out[0].env = env != NULL;
	out[1].env = false;
	if (env) {
		out[0].rule = "$" DLPC_SOCKET_ENV;
		return put(out[0].path, sizeof(out[0].path), env, NULL) < 0 ? -ENAMETOOLONG : 1;
	}
	if (xdg && put(out[n].path, sizeof(out[n].path), xdg, DLPC_USER_SOCKET_NAME) >= 0)
		out[n++].rule = "$XDG_RUNTIME_DIR/" DLPC_USER_SOCKET_NAME;
	out[n].rule = "the system socket";
	put(out[n].path, sizeof(out[n].path), DLPC_SYSTEM_SOCKET, NULL);
	return n + 1;
}

DLPC_EXPORT int dlpc_default_socket(char *buf, size_t len)
{
	struct dlpc__sockpath cand[DLPC__SOCKPATHS_MAX];
	struct stat st;
	int n = dlpc__socket_candidates(cand), i = 0;

	if (n < 0)
		return n;
	/* the per-user socket counts only where it exists, and is this user's (dlpc_connect()
	 * checks the daemon's uid); the system socket is the last word */
	if (n > 1 && (stat(cand[0].path, &st) < 0 || st.st_uid != geteuid()))
		i = 1;
	return put(buf, len, cand[i].path, NULL);
}

int dlpc__listen_socket(char *buf, size_t len)
{
	const char *env = env_set(DLPC_SOCKET_ENV), *xdg;

	if (env)
		return put(buf, len, env, NULL);
	if (geteuid() == 0)
		return put(buf, len, DLPC_SYSTEM_SOCKET, NULL);
	if ((xdg = env_set("XDG_RUNTIME_DIR")))
		return put(buf, len, xdg, DLPC_USER_SOCKET_NAME);
	return -ENOENT;
}
