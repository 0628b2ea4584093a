/* SPDX-License-Identifier: Apache-2.0 */
/*
 * dlpc_connect(): where the daemon is, and trying again while it drops connections before HELLO;
 * the features registered on the connection core once, before the first connection (the core:
 * conn.c, write.c, reader.c, call.c, loop.c, serve.c).
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "sockpath.h"
#include "util.h"

/* The bound on calls without a timeout of their own: $DLPC_CALL_TIMEOUT_MS, else the default
 * (<= 0: none). 0, or -EINVAL for a value that is not a whole number of milliseconds. */
static int call_timeout_env(int64_t *ms)
{
	const char *s = getenv(DLPC_CALL_TIMEOUT_ENV);
	char *end;
	long long v;

	*ms = DLPC_CALL_TIMEOUT_MS_DEFAULT;
	if (!s || !*s)
		return 0;
	errno = 0;
	v = strtoll(s, &end, 10);
	if (errno || *end || end == s)
		return dlpc__fail(-EINVAL, "%s='%s' is not a number of milliseconds",
				  DLPC_CALL_TIMEOUT_ENV, s);
	*ms = v;
	return 0;
}

/*
 * connect_new() for dlpc_connect(), tried again while dlpackd drops the connection before it
 * answers HELLO without saying why (-ECONNRESET, -EPIPE; a refusal comes with a reason): an
 * upgrade in place closes the connections its old image accepted, and the new image, listening
 * on the same socket, answers the next. Pausing 10 ms at first, then up to
 * DLPC_RECONNECT_BACKOFF_MAX_MS, within the call timeout @p timeout (<= 0: at most
 * DLPC_RECONNECT_DROPS_MAX connections).
 */
static int connect_dropped_again(const char *path, int64_t timeout, dlpc_client **ret)
{
	int64_t end = dlpc__mono_end(timeout), left = 0, pause = 10;
	char why[DLPC_ERROR_TEXT_MAX];
	unsigned tries = 0;
	int r;

	for (;;) {
		struct timespec ts;

		r = dlpc__connect_new(path, timeout, NULL, left, left, ret);
		tries++;
		if (r != -ECONNRESET && r != -EPIPE)
			break;
		/* without a call timeout an upgrade's drops still end: a socket that closes every
		 * connection without a word (not dlpackd's) is not tried forever */
		if (!end && tries >= DLPC_RECONNECT_DROPS_MAX) {
			snprintf(why, sizeof(why), "%s", dlpc_last_error());
			return dlpc__fail(
				r,
				"cannot connect to dlpackd at %s: it closed each of %u "
				"connections before answering HELLO (DLPC_RECONNECT_DROPS_MAX; "
				"%s sets no bound): %s",
				path, tries, DLPC_CALL_TIMEOUT_ENV, why);
		}
		if (end) {
			left = end - dlpc__mono_ms();
			if (left <= pause) {
				snprintf(why, sizeof(why), "%s", dlpc_last_error());
				return dlpc__fail(r,
						  "cannot connect to dlpackd at %s: it closed each "
						  "of %u connections before answering HELLO, for "
						  "%lld ms (%s): %s",
						  path, tries, (long long)timeout,
						  DLPC_CALL_TIMEOUT_ENV, why);
			}
			left -= pause;
		}
		if (dlpc__interrupted())
			return r;
		ts.tv_sec = (time_t)(pause / 1000);
		ts.tv_nsec = (long)(pause % 1000) * 1000000L;
		nanosleep(&ts, NULL);
		pause = pause * 2 < DLPC_RECONNECT_BACKOFF_MAX_MS ? pause * 2
								  : DLPC_RECONNECT_BACKOFF_MAX_MS;
	}
	return r;
}

/* Does an error of connecting to a socket say that no daemon of ours listens there (so that
 * dlpc_connect(NULL) may look further)? */
static bool nobody_there(int err)
{
	return err == -ENOENT || err == -ECONNREFUSED || err == -EACCES;
}

/* connect_dropped_again() to @p path, which @p rule named (NULL: the caller gave it), with a
 * refused connect()'s message saying who may connect (dlpc__access_hint()). */
static int connect_at(const char *path, const char *rule, int64_t timeout, dlpc_client **ret)
{
	char why[DLPC_ERROR_TEXT_MAX], hint[256] = "";
	int r = connect_dropped_again(path, timeout, ret);

	if (r >= 0 || (!rule && r != -EACCES))
		return r;
	snprintf(why, sizeof(why), "%s", dlpc_last_error());
	if (r == -EACCES)
		dlpc__access_hint(path, hint, sizeof(hint));
	return dlpc__fail(r, "%s%s%s%s%s", why, rule ? " (the path of " : "", rule ? rule : "",
			  rule ? ")" : "", hint);
}

/* The uid of the process at the other end of the connected socket @p sock: 0 or -errno. */
static int peer_uid(int sock, uid_t *uid)
{
	struct ucred cr;
	socklen_t len = sizeof(cr);

	if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0)
		return -errno;
	*uid = cr.uid;
	return 0;
}

/*
 * dlpc_connect(NULL): the places of dlpc__socket_candidates() in turn, going on to the next while
 * nobody listens at one (no socket, a stale one, or one this process may not use); a daemon that
 * answers but fails (refuses, times out) ends the search with its error. The message of a
 * failure names every path tried with its error.
 */
static int connect_default(int64_t timeout, dlpc_client **ret)
{
	struct dlpc__sockpath cand[DLPC__SOCKPATHS_MAX];
	char tried[DLPC_ERROR_TEXT_MAX] = "", why[DLPC_ERROR_TEXT_MAX], hint[256] = "";
	int n = dlpc__socket_candidates(cand), r = 0, err = 0;
	size_t off = 0;

	if (n < 0)
		return dlpc__fail(n, "$%s is longer than a socket address allows (%zu bytes)",
				  DLPC_SOCKET_ENV, sizeof(cand[0].path) - 1);
	if (cand[0].env)
		return connect_at(cand[0].path, cand[0].rule, timeout, ret);
	for (int i = 0; i < n; i++) {
		uid_t uid = 0;

		r = connect_dropped_again(cand[i].path, timeout, ret);
		/* the per-user socket counts only where its daemon runs as this process's uid: one
		 * that inherited another user's XDG_RUNTIME_DIR (su keeps it) must not take that
		 * user's daemon, which would hand it descriptors of its choosing, for its own */
		if (r >= 0 && i == 0 && n > 1 &&
		    (peer_uid((*ret)->sock, &uid) < 0 || uid != geteuid())) {
			dlpc_close(*ret);
			*ret = NULL;
			err = err == -EACCES ? err : -EPERM;
			off += (size_t)snprintf(tried + off, sizeof(tried) - off,
						"%s%s (%s): its daemon runs as uid %u, not as this "
						"process's uid %u",
						off ? "; " : "", cand[i].path, cand[i].rule,
						(unsigned)uid, (unsigned)geteuid());
			if (off >= sizeof(tried))
				off = sizeof(tried) - 1;
			continue;
		}
		if (r >= 0)
			return r;
		if (!nobody_there(r)) {
			if (!off)
				return r;
			snprintf(why, sizeof(why), "%s", dlpc_last_error());
			return dlpc__fail(r, "%s (tried first: %s)", why, tried);
		}
		if (r == -EACCES && !hint[0])
			dlpc__access_hint(cand[i].path, hint, sizeof(hint));
		if (err != -EACCES)
			err = r;
		off += (size_t)snprintf(tried + off, sizeof(tried) - off, "%s%s (%s): %s",
					off ? "; " : "", cand[i].path, cand[i].rule, strerror(-r));
		if (off >= sizeof(tried))
			off = sizeof(tried) - 1;
	}
	/* (the per-user socket is left out where XDG_RUNTIME_DIR is unset, or too long) */
	return dlpc__fail(err, "cannot connect to dlpackd: tried %s%s%s", tried,
			  n == DLPC__SOCKPATHS_MAX ? ""
			  : getenv("XDG_RUNTIME_DIR") && *getenv("XDG_RUNTIME_DIR")
				  ? " ($XDG_RUNTIME_DIR/" DLPC_USER_SOCKET_NAME
				    " is longer than a socket address allows)"
				  : " ($XDG_RUNTIME_DIR is not set)",
			  hint[0] ? hint
				  : "; no dlpackd listens there: start one (the service, or "
				    "'dlpackd' as yourself), or set $" DLPC_SOCKET_ENV
				    " to a daemon's socket");
}

/* The features, in the order their hooks run. */
static pthread_once_t features_once = PTHREAD_ONCE_INIT;

static void features_register(void)
{
	dlpc__serve_register();
	dlpc__pool_register();
	dlpc__cache_register();
	dlpc__maps_register();
	dlpc__direct_register();
	dlpc__cuda_register();
	dlpc__warm_register();
}

DLPC_EXPORT int dlpc_connect_flags(const char *socket_path, uint32_t flags, dlpc_client **ret)
{
	int64_t timeout;
	int r;

	if (!ret)
		return dlpc__fail(-EINVAL, "dlpc_connect: ret is NULL");
	*ret = NULL;
	if (flags & ~(DLPC_CONNECT_RECONNECT | DLPC_CONNECT_NO_CACHE))
		return dlpc__fail(-EINVAL, "dlpc_connect_flags: unknown flags 0x%x",
				  flags & ~(DLPC_CONNECT_RECONNECT | DLPC_CONNECT_NO_CACHE));
	if (socket_path && strlen(socket_path) >= sizeof((*ret)->path))
		return dlpc__fail(-ENAMETOOLONG, "socket path %s is too long", socket_path);
	r = call_timeout_env(&timeout);
	if (r < 0)
		return r;
	pthread_once(&features_once, features_register);
	r = socket_path ? connect_at(socket_path, NULL, timeout, ret)
			: connect_default(timeout, ret);
	if (r < 0)
		return r;
	(*ret)->reconnect = flags & DLPC_CONNECT_RECONNECT;
	(*ret)->no_cache = flags & DLPC_CONNECT_NO_CACHE;
	r = dlpc__cache_init(*ret, (*ret)->no_cache);
	if (r < 0) {
		dlpc_close(*ret);
		*ret = NULL;
	}
	return r;
}

DLPC_EXPORT int dlpc_connect(const char *socket_path, dlpc_client **ret)
{
	return dlpc_connect_flags(socket_path, 0, ret);
}

DLPC_EXPORT uint64_t dlpc_reconnects(const dlpc_client *c)
{
	uint64_t n;

	if (!c)
		return 0;
	pthread_mutex_lock((pthread_mutex_t *)&c->mu);
	n = c->conn_seq;
	pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
	return n;
}

DLPC_EXPORT int dlpc_inherited(const dlpc_client *c)
{
	return c && !dlpc__ours(c);
}

DLPC_EXPORT const char *dlpc_socket_path(const dlpc_client *c)
{
	return c ? c->path : NULL;
}

DLPC_EXPORT const char *dlpc_version(void)
{
	return DLPD_VERSION;
}
