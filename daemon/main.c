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
#include "closer.h"
#include "config.h"
#include "reaper.h"
#include "persist.h"
#include "server.h"
#include "sockpath.h"
#include "systemd.h"
#include "upgrade.h"

/* The kernel's settings of transparent huge pages. */
#define THP_DIR "/sys/kernel/mm/transparent_hugepage/"

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

/* The bracketed word of the sysfs choice in THP_DIR @p file ("always [advise] never") into
 * @p word (32 bytes); false where it cannot be read. */
static bool thp_choice(const char *file, char word[32])
{
	char path[160], line[160] = "", *open, *close;
	FILE *f;

	snprintf(path, sizeof(path), THP_DIR "%s", file);
	f = fopen(path, "re");
	if (!f)
		return false;
	if (!fgets(line, sizeof(line), f))
		line[0] = '\0';
	fclose(f);
	open = strchr(line, '[');
	close = open ? strchr(open, ']') : NULL;
	if (!close || close - open > 32)
		return false;
	snprintf(word, 32, "%.*s", (int)(close - open - 1), open + 1);
	return true;
}

/* "hugepages-<PMD size>kB/shmem_enabled" into @p file; false where the PMD size is unknown. */
static bool pmd_kib(char *file, size_t cap)
{
	FILE *f = fopen(THP_DIR "hpage_pmd_size", "re");
	unsigned long long bytes = 0;
	bool ok = f && fscanf(f, "%llu", &bytes) == 1 && bytes >= 1024;

	if (f)
		fclose(f);
	if (ok)
		snprintf(file, cap, "hugepages-%llukB/shmem_enabled", bytes >> 10);
	return ok;
}

/* The kernel's setting of transparent huge pages for shared memory, which decides the page size
 * of the storages libdlpc copies into (as libdlpc reads it: the PMD size's own setting unless
 * it says "inherit", else shmem_enabled): a notice where it leaves them 4 KiB pages
 * (dlpackd(8), LOGGING). Read once at start; an upgrade (@p upgrading) does not repeat it. */
static void note_shmem_huge_pages(bool upgrading)
{
	char pmd[32] = "", file[96], word[32];

	if (upgrading || !thp_choice("shmem_enabled", word))
		return;
	if (!pmd_kib(file, sizeof(file)))
		snprintf(file, sizeof(file), "hugepages-2048kB/shmem_enabled");
	if (thp_choice(file, pmd) && strcmp(pmd, "inherit") != 0)
		snprintf(word, sizeof(word), "%s", pmd);
	else
		snprintf(file, sizeof(file), "shmem_enabled");
	if (strcmp(word, "never") == 0 || strcmp(word, "deny") == 0)
		dlpd_log(LOG_NOTICE,
			 "shared memory has no transparent huge pages (%s%s: %s): storages that "
			 "libdlpc copies into take 4 KiB pages, which a publisher allocates and an "
			 "attacher maps one by one; 'advise' there lets them take 2 MiB pages",
			 THP_DIR, file, word);
}

/* Sort the passed fds: the listening socket, the lock an upgrading image passes with it, and
 * storages and journals to restore. 0, or -1 with the reason logged (refuse to start). */
static int sort_passed(struct dlpd_passed_fd *fds, size_t n, struct dlpd_start *how)
{
	char why[160];

	for (size_t i = 0; i < n; i++) {
		const char *name = fds[i].name;

		if (strncmp(name, DLPD_FDNAME_STORAGE, strlen(DLPD_FDNAME_STORAGE)) == 0 ||
		    strncmp(name, DLPD_FDNAME_STATE, strlen(DLPD_FDNAME_STATE)) == 0) {
			fds[how->nrestore++] = fds[i];
			continue;
		}
		/* a close the image we replaced left pending: dlpd_closers_adopt() took it */
		if (strcmp(name, DLPD_FDNAME_CLOSING) == 0)
			continue;
		if (strcmp(name, "lock") == 0 && how->lock_fd < 0) {
			how->lock_fd = fds[i].fd;
			continue;
		}
		/* anything else is what socket activation passes: one listening socket */
		if (dlpd_listen_check(fds[i].fd, why, sizeof(why)) < 0) {
			dlpd_log(LOG_ERR, "refusing to start: %s", why);
			return -1;
		}
		if (how->listen_fd >= 0) {
			dlpd_log(LOG_ERR,
				 "refusing to start: expected one socket from socket activation, "
				 "got fds %d and %d",
				 how->listen_fd, fds[i].fd);
			return -1;
		}
		how->listen_fd = fds[i].fd;
	}
	if (how->lock_fd >= 0 && how->listen_fd < 0) {
		dlpd_log(LOG_ERR, "refusing to start: a lock fd was passed without its socket");
		return -1;
	}
	return 0;
}

/* The socket to listen on, into how->path: the one socket activation passed (--socket is then
 * ignored), --socket, or the default one (written into @p defpath). 0, or -1 logged. */
static int choose_socket(struct dlpd_start *how, char *defpath, size_t size)
{
	const char *socket_path = dlpd_config.socket_path, *ignored, *ignored_env;
	int r;

	if (how->listen_fd >= 0) {
		ignored = dlpd_config_bind_option_given(&ignored_env);
		if (ignored && how->lock_fd < 0)
			dlpd_log(LOG_WARNING,
				 "ignoring --%s (or %s): the socket comes from socket activation",
				 ignored, ignored_env);
	} else if (!socket_path) {
		/* not dlpc_default_socket(): that is where clients look, which is the system
		 * socket for a user whose own daemon has not bound its socket yet */
		r = dlpc__listen_socket(defpath, size);
		if (r < 0) {
			dlpd_log(LOG_ERR, "no socket path: %s; pass --socket or set %s",
				 r == -ENOENT ? "XDG_RUNTIME_DIR is not set"
					      : "the path is too long",
				 DLPC_SOCKET_ENV);
			return -1;
		}
		socket_path = defpath;
	}
	how->path = socket_path;
	return 0;
}

/* Clients can connect as soon as the socket listens, which is before the signal handlers
 * exist: hold the signals back (@p set) until they do, so that none kills us by default
 * (SIGHUP included: an upgrade executes us with the socket already listening). */
static void hold_signals(sigset_t *set)
{
	sigemptyset(set);
	sigaddset(set, SIGTERM);
	sigaddset(set, SIGINT);
	sigaddset(set, SIGHUP);
	/* the exits of closers (closer.c), an upgrading image's among them: reaped once the
	 * handler is there */
	sigaddset(set, SIGCHLD);
	sigprocmask(SIG_BLOCK, set, NULL);
}

/* Close what was passed at start (@p passed, freed), the daemon not starting. */
static void close_passed(const struct dlpd_start *how, struct dlpd_passed_fd *passed)
{
	for (size_t i = 0; i < how->nrestore; i++)
		close(passed[i].fd);
	if (how->listen_fd >= 0)
		close(how->listen_fd);
	if (how->lock_fd >= 0)
		close(how->lock_fd);
	free(passed);
}

int main(int argc, char **argv)
{
	char defpath[108], why[160];
	struct dlpd_start how = {.listen_fd = -1, .lock_fd = -1};
	struct dlpd_passed_fd *passed = NULL;
	struct dlpd_server srv;
	sigset_t stop_signals;
	size_t npassed = 0;
	bool upgrading = false;
	uv_loop_t loop;
	int r;

	/* before anything opens an fd: the numbers it names are ours only until then */
	dlpd_closers_adopt();
	r = dlpd_config_load(argc, argv);
	if (r != 0)
		return r > 0 ? 0 : 2;
	dlpd_log_init();
	dlpd_notify_init();
	r = dlpd_passed_fds(&passed, &npassed, why, sizeof(why));
	if (r < 0 && r != -ENOENT) {
		dlpd_log(LOG_ERR, "refusing to start: %s", why);
		return 2;
	}
	/* an upgrade in place names the listening socket it hands over "listen" (upgrade.c) */
	for (size_t i = 0; i < npassed; i++)
		upgrading |= strcmp(passed[i].name, "listen") == 0;
	if (sort_passed(passed, npassed, &how) < 0) {
		free(passed);
		return 2;
	}
	how.restore = passed;
	if (choose_socket(&how, defpath, sizeof(defpath)) < 0) {
		free(passed);
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	/* A write past RLIMIT_FSIZE (the state journal, a memfd) fails with EFBIG, which persist.c
	 * answers, instead of killing the daemon. */
	signal(SIGXFSZ, SIG_IGN);
	raise_fd_limit();
	hold_signals(&stop_signals);
	uv_loop_init(&loop);
	r = dlpd_reaper_start();
	if (r < 0) {
		dlpd_log(LOG_ERR, "cannot start the fd reaper thread: %s", strerror(-r));
		uv_loop_close(&loop);
		close_passed(&how, passed);
		return 1;
	}
	/* fds a client sent that the wire layer drops go to their sender's closer (closer.c) */
	dlpc__set_closer(dlpd_close_untrusted);
	r = dlpd_server_start(&srv, &loop, &how, &dlpd_limits);
	free(passed);
	dlpd_upgrade_init(&srv, argv);
	/* returns once dlpd_server_stop() has closed every handle */
	if (r == 0) {
		sigprocmask(SIG_UNBLOCK, &stop_signals, NULL);
		note_shmem_huge_pages(upgrading);
		dlpd_notify("READY=1\nSTATUS=listening on %s, %zu entries", srv.path,
			    srv.reg.names.count);
	} else {
		/* close the handles the server set up before it failed */
		dlpd_server_stop(&srv);
	}
	uv_run(&loop, UV_RUN_DEFAULT);
	dlpd_server_free(&srv);
	dlpc__set_closer(NULL);
	dlpd_reaper_stop();
	uv_loop_close(&loop);
	if (r == 0)
		dlpd_log(LOG_NOTICE, "stopped");
	dlpd_closers_leave();
	return r == 0 ? 0 : 1;
}
