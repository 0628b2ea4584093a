/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Test harness: a real dlpackd in a private temp dir, child processes, and polling helpers.
 *
 * Set DLPC_TEST_WRAPPER (e.g. "valgrind --leak-check=full ...") to run the daemon under a tool;
 * daemon_stop() then also checks the tool's verdict. DLPC_TEST_SLOW scales every deadline.
 */
#ifndef DLPC_TEST_HARNESS_H
#define DLPC_TEST_HARNESS_H

#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

#include <dlpc/dlpc.h>

struct daemon {
	pid_t pid;
	char dir[64];
	char sock[108];
	char log[128];
};

/* Start dlpackd on DIR/dlpackd.sock and wait until it accepts connections. */
void daemon_start(struct daemon *d);

/* How daemon_start_with() starts the daemon. */
struct daemon_opts {
	const char *const *args; /* extra command-line arguments, NULL-terminated, or NULL */
	unsigned long nofile;	 /* if not 0: RLIMIT_NOFILE (soft and hard) set before exec */
	uid_t uid; /* if not 0: the uid (and gid) it runs as, owning its directory (as root) */
	/* fds of /dev/null it is started with besides stdio, as a parent that did not mark its
	 * own close-on-exec leaves them */
	unsigned inherit;
};

/* daemon_start() with extra arguments and resource limits. */
void daemon_start_with(struct daemon *d, const struct daemon_opts *o);
/* Start another dlpackd process on @p sock; returns its pid (no waiting). */
pid_t daemon_spawn(const char *sock, const char *log);
/* Start dlpackd as socket activation does: @p listen_fd, a listening socket, becomes its fd 3
 * (LISTEN_PID, LISTEN_FDS=1). Returns its pid (no waiting): connections wait in the socket's
 * backlog until it accepts them. It leaves the socket file alone when it stops. */
pid_t daemon_spawn_activated(int listen_fd, const char *log);
/* Let other users reach @p d's socket: its temp dir is 0700 and the socket 0660 root:root. */
void daemon_open_for_others(const struct daemon *d);
/* SIGTERM, expect exit 0 and the socket removed; under a wrapper, no leak and no fd left. */
void daemon_stop(struct daemon *d);
/* Does the file @p log (a daemon's stderr) contain @p text so far? */
bool log_has(const char *log, const char *text);
/* One sendmsg() carrying @p len bytes and @p nfds fds (any number, past what libdlpc's sender
 * allows); sendmsg()'s result, or -1 with ENOMEM when no control buffer could be had. */
ssize_t send_fds_raw(int sock, const void *data, size_t len, const int *fds, unsigned nfds);
/* Open fds of a process, from /proc/PID/fd. */
int fd_count(pid_t pid);
/* The fds of process @p pid whose /proc/PID/fd link target (a path, "socket:[N]", ...) @p match
 * accepts (@p arg passed on); 0 when the process is gone. */
int fd_links(pid_t pid, bool (*match)(const char *target, void *arg), void *arg);
/* Milliseconds scaled by DLPC_TEST_SLOW. */
int scaled_ms(int ms);

dlpc_client *connect_or_die(const struct daemon *d);
dlpc_stats stat_or_die(dlpc_client *c);
/* One uid's share of the fd budget under the default --max-fd-share-per-uid: the
 * DLPC_UID_FD_SHARE_DEFAULT percent of the fd_budget STAT of @p c's daemon reports; 0 if STAT
 * fails. */
uint64_t default_fd_share(dlpc_client *c);
/* The channel @p name as STAT describes it, or the test fails. */
dlpc_channel_info chan_or_die(dlpc_client *c, const char *name);
/* Poll the channel until @p field reaches @p want; whether it did (within a scaled 5 s). */
#define WAIT_CHAN(c, name, field, want)                                                            \
	({                                                                                         \
		bool _ok = false;                                                                  \
		for (int _try = 0; _try < scaled_ms(5000) / 5 && !_ok; _try++) {                   \
			_ok = chan_or_die(c, name).field == (want);                                \
			if (!_ok)                                                                  \
				usleep(5000);                                                      \
		}                                                                                  \
		_ok;                                                                               \
	})

/* Undo what run_suite() set for the suites that count references: libdlpc's caches at their
 * defaults ($DLPC_CACHE_* unset), for a suite that tests them. */
void caches_at_defaults(void);
/* Run @p s in fork mode and free it; the process's exit status: 0 if every test passed. */
int run_suite(Suite *s);

/* Run @p fn(arg) in a forked child that exits 0 if fn returns 0. A child reports with CHILD_CHECK,
 * not Check's assertions (harness.c, spawn()). */
pid_t spawn(int (*fn)(void *), void *arg);
/* Wait for @p pid and return its exit status; a signal death returns 128 + signo. */
int wait_child(pid_t pid);
/* wait_child() until @p deadline_ms (CLOCK_MONOTONIC, in ms). A child still running then is
 * hung: say on stderr which (@p what) and where it waits (state, wait channel, kernel stack,
 * system call and the mapping it made it from), kill it and return -1. */
int wait_child_until(pid_t pid, long long deadline_ms, const char *what);

/*
 * The daemon @p d's open fds once it has settled: exactly @p conns connections and nothing
 * left for its closer thread (closing is asynchronous). Fails the test if it does not settle.
 */
int settled_fds(const struct daemon *d, dlpc_client *c, uint64_t conns);

/* Poll STAT until @p cond holds or @p ms pass; returns whether it held. */
bool wait_stat(dlpc_client *c, bool (*cond)(const dlpc_stats *s, void *arg), void *arg, int ms);

/* A float32 host tensor over @p data, not owned (deleter counts calls into *counter if set). */
DLManagedTensorVersioned *host_tensor(void *data, DLDataType dt, int ndim, const int64_t *shape,
				      const int64_t *strides, int *counter);
/* Publish (a copy) @p size bytes of @p fill under @p name, as uint8; the test fails if it fails. */
void publish_filled(dlpc_client *c, const char *name, size_t size, int fill);
/* This process's mappings of libdlpc's memfds ("/memfd:dlpc:" in /proc/self/maps). */
int dlpc_mappings(void);
/* How many pages (4 KiB) of the @p len bytes at @p map this process has mapped (present in its
 * page table: /proc/self/pagemap's bit 63). */
uint64_t pages_mapped(const void *map, uint64_t len);

/* The other user the suites act as: nobody. */
#define NOBODY 65534
/* In a child: become uid and gid NOBODY, with no supplementary groups, and dumpable again (setuid
 * made /proc/self root's: so that /proc/self/fd is its own to open). Exits 1 if it cannot. */
void become_nobody(void);

/* In a child process: print and exit 1 when @p cond fails. */
#define CHILD_CHECK(cond)                                                                          \
	do {                                                                                       \
		if (!(cond)) {                                                                     \
			fprintf(stderr, "%s:%d: child check failed: %s (%s)\n", __FILE__,          \
				__LINE__, #cond, dlpc_last_error());                               \
			_exit(1);                                                                  \
		}                                                                                  \
	} while (0)

/* Check's assertion with the library's last message appended. */
#define ck_assert_dlpc(expr, expected)                                                             \
	do {                                                                                       \
		long long _r = (expr);                                                             \
		ck_assert_msg(_r == (expected), "%s returned %lld, expected %lld: %s", #expr, _r,  \
			      (long long)(expected), dlpc_last_error());                           \
	} while (0)

#endif
