/* SPDX-License-Identifier: Apache-2.0 */
/* dlpackd: command line, setup and the event loop. */
#include <errno.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "base.h"
#include "config.h"
#include "reaper.h"
#include "server.h"
#include "systemd.h"

/* Every entry holds an fd: use all the fds the hard limit allows, not the soft 1024. */
static void raise_fd_limit(void)
{
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
			dlpd_log(LOG_WARNING, "cannot raise the fd limit to %llu: %m",
				 (unsigned long long)rl.rlim_max);
	}
}

int main(int argc, char **argv)
{
	const char *socket_path, *ignored, *ignored_env;
	char defpath[108], why[160];
	struct dlpd_server srv;
	sigset_t stop_signals;
	uv_loop_t loop;
	int r, listen_fd;

	r = dlpd_config_load(argc, argv);
	if (r != 0)
		return r > 0 ? 0 : 2;
	dlpd_log_init();
	dlpd_notify_init();
	listen_fd = dlpd_listen_fd(why, sizeof(why));
	if (listen_fd < 0 && listen_fd != -ENOENT) {
		dlpd_log(LOG_ERR, "refusing to start: %s", why);
		return 2;
	}
	socket_path = dlpd_config.socket_path;
	if (listen_fd >= 0) {
		ignored = dlpd_config_bind_option_given(&ignored_env);
		if (ignored)
			dlpd_log(LOG_WARNING,
				 "ignoring --%s (or %s): the socket comes from socket activation",
				 ignored, ignored_env);
	} else if (!socket_path) {
		r = dlpc_default_socket(defpath, sizeof(defpath));
		if (r < 0) {
			dlpd_log(LOG_ERR, "no socket path: %s; pass --socket or set %s",
				 r == -ENOENT ? "XDG_RUNTIME_DIR is not set"
					      : "the path is too long",
				 DLPC_SOCKET_ENV);
			return 2;
		}
		socket_path = defpath;
	}
	signal(SIGPIPE, SIG_IGN);
	raise_fd_limit();
	/* Clients can connect as soon as the socket listens, which is before the SIGTERM handler
	 * exists: hold the signals back until it does, so that none kills us by default. */
	sigemptyset(&stop_signals);
	sigaddset(&stop_signals, SIGTERM);
	sigaddset(&stop_signals, SIGINT);
	sigprocmask(SIG_BLOCK, &stop_signals, NULL);
	uv_loop_init(&loop);
	r = dlpd_reaper_start();
	if (r < 0) {
		dlpd_log(LOG_ERR, "cannot start the fd reaper thread: %s", strerror(-r));
		uv_loop_close(&loop);
		if (listen_fd >= 0)
			close(listen_fd);
		return 1;
	}
	r = dlpd_server_start(&srv, &loop, listen_fd, socket_path, &dlpd_limits);
	/* returns once dlpd_server_stop() has closed every handle */
	if (r == 0) {
		sigprocmask(SIG_UNBLOCK, &stop_signals, NULL);
		dlpd_notify("READY=1\nSTATUS=listening on %s", srv.path);
	} else {
		/* close the handles the server set up before it failed */
		dlpd_server_stop(&srv);
	}
	uv_run(&loop, UV_RUN_DEFAULT);
	dlpd_server_free(&srv);
	dlpd_reaper_stop();
	uv_loop_close(&loop);
	if (r == 0)
		dlpd_log(LOG_NOTICE, "stopped");
	return r == 0 ? 0 : 1;
}
