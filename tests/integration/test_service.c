/* SPDX-License-Identifier: Apache-2.0 */
/*
 * dlpackd as a service: socket activation (under systemd-socket-activate, and with hand-made
 * LISTEN_FDS), readiness notification, journald log prefixes, and the configuration from flags
 * and environment. No systemd needs to run: the test plays the service manager's part.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>

#include "harness.h"

/* Values the publisher writes and the attacher checks. */
#define NVALUES 4096

struct svc {
	char dir[64];
	char sock[108];
	char log[128];
	char notify[96]; /* "@name": an abstract address, or a path */
	int notify_fd;
	pid_t pid;
};

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* A private directory and a datagram socket to receive notifications on. */
static void svc_init(struct svc *s, bool abstract)
{
	static int serial;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	socklen_t len;

	memset(s, 0, sizeof(*s));
	s->pid = -1;
	snprintf(s->dir, sizeof(s->dir), "/tmp/dlpc-svc-XXXXXX");
	ck_assert_msg(mkdtemp(s->dir), "mkdtemp: %s", strerror(errno));
	snprintf(s->sock, sizeof(s->sock), "%s/dlpackd.sock", s->dir);
	snprintf(s->log, sizeof(s->log), "%s/dlpackd.log", s->dir);
	if (abstract)
		snprintf(s->notify, sizeof(s->notify), "@dlpc-svc-%d-%d", (int)getpid(), serial++);
	else
		snprintf(s->notify, sizeof(s->notify), "%s/notify", s->dir);
	s->notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	ck_assert_int_ge(s->notify_fd, 0);
	memcpy(sa.sun_path, s->notify, strlen(s->notify));
	len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + strlen(s->notify));
	if (abstract)
		sa.sun_path[0] = '\0';
	ck_assert_msg(bind(s->notify_fd, (struct sockaddr *)&sa, len) == 0, "bind %s: %s",
		      s->notify, strerror(errno));
}

static void svc_clear(struct svc *s)
{
	char cmd[160];

	close(s->notify_fd);
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s->dir);
	ck_assert_int_eq(system(cmd), 0);
}

static void dump_log(const struct svc *s)
{
	char line[512];
	FILE *f = fopen(s->log, "r");

	while (f && fgets(line, sizeof(line), f))
		fprintf(stderr, "  | %s", line);
	if (f)
		fclose(f);
}

/* Does the daemon's log hold a line containing every one of @p a, @p b (b may be NULL)? */
static bool svc_log_has(const struct svc *s, const char *a, const char *b)
{
	char line[1024];
	bool found = false;
	FILE *f = fopen(s->log, "r");

	while (f && !found && fgets(line, sizeof(line), f))
		found = strstr(line, a) && (!b || strstr(line, b));
	if (f)
		fclose(f);
	return found;
}

/* Wait for a notification datagram holding the line @p what; false if none comes in time. */
static bool notified(const struct svc *s, const char *what)
{
	long long deadline = now_ms() + scaled_ms(10000);

	for (;;) {
		struct pollfd pfd = {.fd = s->notify_fd, .events = POLLIN};
		long long left = deadline - now_ms();
		char msg[512];
		ssize_t n;

		if (left <= 0 || poll(&pfd, 1, (int)left) <= 0)
			return false;
		n = recv(s->notify_fd, msg, sizeof(msg) - 1, 0);
		if (n <= 0)
			return false;
		msg[n] = '\0';
		/* one datagram may carry several NAME=VALUE lines */
		for (char *line = strtok(msg, "\n"); line; line = strtok(NULL, "\n"))
			if (strcmp(line, what) == 0)
				return true;
	}
}

/*
 * Start @p argv with stderr on the log. @p env: extra NAME=VALUE strings. @p fd3 >= 0 becomes
 * fd 3 with LISTEN_PID/LISTEN_FDS set for it (LISTEN_FDS from @p listen_fds).
 */
static pid_t start(struct svc *s, char *const argv[], char *const env[], int fd3,
		   const char *listen_fds)
{
	pid_t pid = fork();

	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		int fd = open(s->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
		char pidbuf[32];

		if (fd < 0)
			_exit(126);
		dup2(fd, STDERR_FILENO);
		dup2(fd, STDOUT_FILENO);
		if (fd3 >= 0) {
			if (fd3 != 3 && dup2(fd3, 3) < 0)
				_exit(126);
			fcntl(3, F_SETFD, 0);
			snprintf(pidbuf, sizeof(pidbuf), "%d", (int)getpid());
			setenv("LISTEN_PID", pidbuf, 1);
			setenv("LISTEN_FDS", listen_fds, 1);
		}
		close_range(fd3 >= 0 ? 4 : 3, ~0U, 0);
		for (int i = 0; env && env[i]; i++)
			putenv(env[i]);
		execv(argv[0], argv);
		_exit(127);
	}
	s->pid = pid;
	return pid;
}

static int exit_status(pid_t pid)
{
	long long deadline = now_ms() + scaled_ms(10000);
	int st;

	while (waitpid(pid, &st, WNOHANG) == 0) {
		ck_assert_msg(now_ms() < deadline, "process %d did not exit", (int)pid);
		usleep(5000);
	}
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Is a socket at @p path listening? /proc/net/unix lists it with the accepting flag
 * (__SO_ACCEPTCON, 0x10000) once listen() was called, under the name it was bound to: @p path
 * (socket activation), or PATH.new, which the daemon renames to @p path once it listens. */
static bool listening(const char *path)
{
	char line[512], sockpath[256], bound[256];
	unsigned long flags;
	bool found = false;
	FILE *f = fopen("/proc/net/unix", "re");

	snprintf(bound, sizeof(bound), "%s.new", path);
	while (f && !found && fgets(line, sizeof(line), f))
		found = sscanf(line, "%*s %*s %*s %lx %*s %*s %*s %255s", &flags, sockpath) == 2 &&
			(strcmp(sockpath, path) == 0 ||
			 (strcmp(sockpath, bound) == 0 && access(path, F_OK) == 0)) &&
			(flags & 0x10000);
	if (f)
		fclose(f);
	return found;
}

static void wait_for_socket(const struct svc *s)
{
	long long deadline = now_ms() + scaled_ms(10000);

	/* not only there but listening, or a client racing the listen() is refused */
	while (!listening(s->sock)) {
		ck_assert_msg(waitpid(s->pid, NULL, WNOHANG) == 0, "the service exited at start");
		ck_assert_msg(now_ms() < deadline, "%s did not appear", s->sock);
		usleep(5000);
	}
}

static const char *child_sock;

static int publish_values(void *arg)
{
	static float data[NVALUES];
	int64_t shape[1] = {NVALUES};
	dlpc_client *c;

	for (int i = 0; i < NVALUES; i++)
		data[i] = (float)i * 0.5f;
	CHILD_CHECK(dlpc_connect(child_sock, &c) == 0);
	CHILD_CHECK(
		dlpc_publish(c, (const char *)arg,
			     host_tensor(data, (DLDataType){kDLFloat, 32, 1}, 1, shape, NULL, NULL),
			     0) == 1);
	dlpc_close(c);
	return 0;
}

static int attach_values(void *arg)
{
	dlpc_attach_opts opts = {.size = sizeof(opts), .timeout_ms = scaled_ms(5000)};
	DLManagedTensorVersioned *t;
	const float *v;
	dlpc_client *c;

	CHILD_CHECK(dlpc_connect(child_sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, (const char *)arg, &opts, &t) == 1);
	CHILD_CHECK(t->dl_tensor.ndim == 1 && t->dl_tensor.shape[0] == NVALUES);
	v = t->dl_tensor.data;
	for (int i = 0; i < NVALUES; i++)
		CHILD_CHECK(v[i] == (float)i * 0.5f);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* An attach the daemon refuses: writable, of an entry published read-only. */
static int attach_writable(void *arg)
{
	dlpc_attach_opts opts = {.size = sizeof(opts), .flags = DLPC_ATTACH_WRITABLE};
	DLManagedTensorVersioned *t;
	dlpc_client *c;

	CHILD_CHECK(dlpc_connect(child_sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, (const char *)arg, &opts, &t) == -EACCES);
	dlpc_close(c);
	return 0;
}

/* systemd-socket-activate binds the socket, waits for the first client, then runs dlpackd with
 * the listening socket as fd 3: publish and attach go through that socket from two processes. */
START_TEST(test_socket_activate)
{
	char notify_env[128], journal_env[96], lock[160];
	char *argv[] = {(char *)SOCKET_ACTIVATE_BIN,
			(char *)"-l",
			NULL,
			(char *)"--fdname=dlpackd",
			(char *)"-E",
			notify_env,
			(char *)"-E",
			journal_env,
			(char *)"-E",
			(char *)"DLPACKD_LOG_LEVEL=debug",
			(char *)DLPACKD_BIN,
			NULL};
	struct svc s;
	struct stat st;
	pid_t pub;

	ck_assert_msg(access(SOCKET_ACTIVATE_BIN, X_OK) == 0,
		      "systemd-socket-activate (package systemd) is needed: %s",
		      SOCKET_ACTIVATE_BIN);
	svc_init(&s, true);
	argv[2] = s.sock;
	snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", s.notify);
	/* the log file is the daemon's stderr: JOURNAL_STREAM naming it asks for <N> prefixes */
	close(open(s.log, O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
	ck_assert_int_eq(stat(s.log, &st), 0);
	snprintf(journal_env, sizeof(journal_env), "JOURNAL_STREAM=%llu:%llu",
		 (unsigned long long)st.st_dev, (unsigned long long)st.st_ino);
	start(&s, argv, NULL, -1, NULL);
	wait_for_socket(&s);
	child_sock = s.sock;
	/* the publisher's connection is what starts the daemon */
	pub = spawn(publish_values, "svc/values");
	ck_assert_msg(notified(&s, "READY=1"), "no READY=1 on %s", s.notify);
	ck_assert_int_eq(wait_child(pub), 0);
	ck_assert_int_eq(wait_child(spawn(attach_values, "svc/values")), 0);
	ck_assert_int_eq(wait_child(spawn(attach_values, "svc/values")), 0);

	ck_assert_int_eq(kill(s.pid, SIGTERM), 0);
	ck_assert_msg(notified(&s, "STOPPING=1"), "no STOPPING=1 on %s", s.notify);
	if (exit_status(s.pid) != 0)
		dump_log(&s);
	ck_assert_int_eq(exit_status(s.pid), 0);
	/* journald prefixes: notice for the start, debug for each client accepted */
	ck_assert_msg(svc_log_has(&s, "<5>dlpackd ", "listening on") &&
			      svc_log_has(&s, "<7>client ", "accepted"),
		      "no <N>-prefixed lines in %s", s.log);
	ck_assert_msg(svc_log_has(&s, "(socket activation)", NULL), "activation not logged");
	/* the socket is systemd's: left in place, never locked */
	ck_assert_msg(stat(s.sock, &st) == 0 && S_ISSOCK(st.st_mode),
		      "dlpackd removed the socket it was given");
	snprintf(lock, sizeof(lock), "%s.lock", s.sock);
	ck_assert_msg(access(lock, F_OK) != 0, "dlpackd made a lock file for a passed socket");
	svc_clear(&s);
}
END_TEST

/* A listening socket bound by the test, passed as fd 3: the hand-made equivalent. */
static int listening_socket(const char *path, int type, bool do_listen)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);

	ck_assert_int_ge(fd, 0);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	if (do_listen)
		ck_assert_int_eq(listen(fd, 16), 0);
	return fd;
}

/* With the socket passed in, options about binding are ignored with a warning, and the
 * daemon serves the passed socket, not the path given. */
START_TEST(test_passed_socket_wins)
{
	char other[160];
	char *argv[] = {(char *)DLPACKD_BIN, (char *)"--socket", other,
			(char *)"--socket-mode=0600", NULL};
	char notify_env[128];
	char *env[] = {notify_env, NULL};
	struct svc s;
	int fd;

	svc_init(&s, false);
	snprintf(other, sizeof(other), "%s/other.sock", s.dir);
	snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", s.notify);
	fd = listening_socket(s.sock, SOCK_STREAM, true);
	start(&s, argv, env, fd, "1");
	close(fd);
	ck_assert_msg(notified(&s, "READY=1"), "no READY=1 on %s", s.notify);
	child_sock = s.sock;
	ck_assert_int_eq(wait_child(spawn(publish_values, "svc/passed")), 0);
	ck_assert_int_eq(wait_child(spawn(attach_values, "svc/passed")), 0);
	ck_assert_msg(access(other, F_OK) != 0, "dlpackd bound --socket despite activation");
	ck_assert_msg(svc_log_has(&s, "warning: ignoring --socket", "socket activation"),
		      "ignored options not reported");
	ck_assert_int_eq(kill(s.pid, SIGTERM), 0);
	ck_assert_msg(notified(&s, "STOPPING=1"), "no STOPPING=1");
	ck_assert_int_eq(exit_status(s.pid), 0);
	ck_assert_msg(access(s.sock, F_OK) == 0, "dlpackd removed the socket it was given");
	svc_clear(&s);
}
END_TEST

/* Socket activation with the wrong thing as fd 3 is refused with a reason, exit status 2. */
START_TEST(test_bad_activation_refused)
{
	static const struct {
		const char *what, *listen_fds, *reason;
	} cases[] = {
		{"file", "1", "is not a socket"},	 {"dgram", "1", "is not a stream socket"},
		{"unlistened", "1", "is not listening"}, {"inet", "1", "is not an AF_UNIX socket"},
		{"stream", "2", "but fd 4 is not open"}, {"stream", "x", "bad LISTEN_FDS=x"},
	};
	char *argv[] = {(char *)DLPACKD_BIN, NULL};
	const char *what = cases[_i].what;
	struct svc s;
	int fd;

	svc_init(&s, false);
	if (strcmp(what, "file") == 0)
		fd = open(s.dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	else if (strcmp(what, "dgram") == 0)
		fd = listening_socket(s.sock, SOCK_DGRAM, false);
	else if (strcmp(what, "unlistened") == 0)
		fd = listening_socket(s.sock, SOCK_STREAM, false);
	else if (strcmp(what, "inet") == 0)
		fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	else
		fd = listening_socket(s.sock, SOCK_STREAM, true);
	ck_assert_int_ge(fd, 0);
	start(&s, argv, NULL, fd, cases[_i].listen_fds);
	close(fd);
	if (exit_status(s.pid) != 2)
		dump_log(&s);
	ck_assert_int_eq(exit_status(s.pid), 2);
	ck_assert_msg(svc_log_has(&s, "refusing to start", cases[_i].reason),
		      "%s: no line saying '%s'", what, cases[_i].reason);
	svc_clear(&s);
}
END_TEST

/* LISTEN_PID naming another process: the variables are not ours, the daemon binds itself. */
START_TEST(test_foreign_listen_pid)
{
	char *argv[] = {(char *)DLPACKD_BIN, (char *)"--socket", NULL, NULL};
	char *env[] = {(char *)"LISTEN_PID=1", (char *)"LISTEN_FDS=1", NULL};
	struct svc s;

	svc_init(&s, false);
	argv[2] = s.sock;
	start(&s, argv, env, -1, NULL);
	wait_for_socket(&s);
	child_sock = s.sock;
	ck_assert_int_eq(wait_child(spawn(publish_values, "svc/own")), 0);
	ck_assert_int_eq(wait_child(spawn(attach_values, "svc/own")), 0);
	ck_assert_int_eq(kill(s.pid, SIGTERM), 0);
	ck_assert_int_eq(exit_status(s.pid), 0);
	ck_assert_msg(access(s.sock, F_OK) != 0, "dlpackd left its own socket behind");
	svc_clear(&s);
}
END_TEST

/* A flag wins over its variable even when the variable holds a bad value; LISTEN_FDS=0 for
 * us passes nothing, so the daemon binds its own socket (and leaves the stray fd 3 alone). */
START_TEST(test_flag_beats_bad_env_and_no_fds)
{
	char *argv[] = {(char *)DLPACKD_BIN, (char *)"--socket", NULL,
			(char *)"-l",	     (char *)"debug",	 NULL};
	char *env[] = {(char *)"DLPACKD_LOG_LEVEL=loud", NULL};
	struct svc s;
	int fd;

	svc_init(&s, false);
	argv[2] = s.sock;
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	ck_assert_int_ge(fd, 0);
	start(&s, argv, env, fd, "0");
	close(fd);
	wait_for_socket(&s);
	child_sock = s.sock;
	ck_assert_int_eq(wait_child(spawn(publish_values, "svc/nofds")), 0);
	ck_assert_int_eq(kill(s.pid, SIGTERM), 0);
	ck_assert_int_eq(exit_status(s.pid), 0);
	ck_assert_msg(svc_log_has(&s, "debug: client ", "): accepted"), "-l debug did not apply");
	ck_assert_msg(!svc_log_has(&s, "socket activation", NULL),
		      "LISTEN_FDS=0 taken as activation");
	svc_clear(&s);
}
END_TEST

/* Bound by the daemon itself: mode and group from flags or environment, readiness on a path
 * NOTIFY_SOCKET, plain timestamped log lines with the accepts and the refusals a client expects
 * (debug, not warning). */
START_TEST(test_own_socket_config)
{
	char group[32], notify_env[128];
	char *argv[] = {(char *)DLPACKD_BIN, (char *)"--socket-mode", (char *)"0640", NULL};
	char sock_env[160], group_env[64];
	char *env[] = {notify_env, sock_env, group_env, (char *)"DLPACKD_SOCKET_MODE=0600",
		       (char *)"DLPACKD_LOG_LEVEL=debug",
		       /* names some other file: journald is not reading our stderr */
		       (char *)"JOURNAL_STREAM=1:1", NULL};
	gid_t gid = getuid() == 0 ? 4242 : getegid();
	struct svc s;
	struct stat st;

	svc_init(&s, false);
	snprintf(group, sizeof(group), "%u", (unsigned)gid);
	snprintf(notify_env, sizeof(notify_env), "NOTIFY_SOCKET=%s", s.notify);
	snprintf(sock_env, sizeof(sock_env), "DLPACKD_SOCKET=%s", s.sock);
	snprintf(group_env, sizeof(group_env), "DLPACKD_SOCKET_GROUP=%s", group);
	start(&s, argv, env, -1, NULL);
	ck_assert_msg(notified(&s, "READY=1"), "no READY=1 on %s", s.notify);
	ck_assert_int_eq(stat(s.sock, &st), 0);
	/* the flag (0640) wins over the environment (0600) */
	ck_assert_msg((st.st_mode & 07777) == 0640, "socket mode %o", st.st_mode & 07777);
	ck_assert_int_eq(st.st_gid, gid);
	child_sock = s.sock;
	ck_assert_int_eq(wait_child(spawn(publish_values, "svc/cfg")), 0);
	ck_assert_int_eq(wait_child(spawn(attach_writable, "svc/cfg")), 0);
	ck_assert_int_eq(kill(s.pid, SIGTERM), 0);
	ck_assert_msg(notified(&s, "STOPPING=1"), "no STOPPING=1");
	ck_assert_int_eq(exit_status(s.pid), 0);
	ck_assert_msg(svc_log_has(&s, "debug: client ", "): accepted"),
		      "no debug line for the accepted client");
	ck_assert_msg(svc_log_has(&s, "debug: client ", "was not published writable"),
		      "no debug line for the refused attach");
	ck_assert_msg(!svc_log_has(&s, "warning: ", ""), "a warning in an ordinary session");
	ck_assert_msg(!svc_log_has(&s, "<", ">dlpackd"),
		      "journal prefixes with a JOURNAL_STREAM that is not our stderr");
	svc_clear(&s);
}
END_TEST

/*
 * The socket file appears only once the daemon listens: a client that finds the path connects
 * at once and is never refused. listen() is made to wait 300 ms first (a preloaded test double,
 * helpers/listen_delay.c), so a socket file made before listen() would be found refusing
 * connections for that long. Mode and group still apply, and no temporary name stays behind.
 */
START_TEST(test_socket_appears_listening)
{
	char *argv[] = {(char *)DLPACKD_BIN, (char *)"--socket-mode", (char *)"0660", NULL};
	char sock_env[160], preload[300], tmp[160];
	char *env[] = {sock_env, preload, (char *)"DLPC_TEST_LISTEN_DELAY_MS=300", NULL};
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int seen = 0, refused = 0, fd, r, err;
	long long deadline;
	struct svc s;
	struct stat st;

	svc_init(&s, false);
	snprintf(sock_env, sizeof(sock_env), "DLPACKD_SOCKET=%s", s.sock);
	snprintf(preload, sizeof(preload), "LD_PRELOAD=%s", LISTEN_DELAY_LIB);
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", s.sock);
	start(&s, argv, env, -1, NULL);
	deadline = now_ms() + scaled_ms(10000);
	for (;;) {
		ck_assert_msg(now_ms() < deadline, "the daemon did not answer within 10 s");
		if (access(s.sock, F_OK) != 0) {
			usleep(100);
			continue;
		}
		seen++;
		fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		ck_assert_int_ge(fd, 0);
		r = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
		err = errno;
		close(fd);
		if (r == 0)
			break;
		ck_assert_msg(err == ECONNREFUSED, "connect: %s", strerror(err));
		refused++;
		usleep(100);
	}
	ck_assert_msg(refused == 0,
		      "%d of %d connects to the socket file were refused: it was there before the "
		      "daemon listened",
		      refused, seen);
	ck_assert_int_eq(stat(s.sock, &st), 0);
	ck_assert_msg((st.st_mode & 07777) == 0660, "socket mode %o", st.st_mode & 07777);
	snprintf(tmp, sizeof(tmp), "%s.new", s.sock);
	ck_assert_msg(access(tmp, F_OK) != 0, "%s is left behind", tmp);
	ck_assert_int_eq(kill(s.pid, SIGTERM), 0);
	ck_assert_int_eq(exit_status(s.pid), 0);
	ck_assert_msg(access(s.sock, F_OK) != 0, "the socket stays after the daemon stopped");
	svc_clear(&s);
}
END_TEST

/* Bad values, from flags or environment: exit status 2 and a message naming the value. */
START_TEST(test_bad_config_refused)
{
	static const struct {
		const char *flag, *env, *says;
	} cases[] = {
		{"--socket-mode=999", NULL, "--socket-mode '999'"},
		{"--socket-mode=rw", NULL, "--socket-mode 'rw'"},
		{"--socket-mode=-1", NULL, "--socket-mode '-1'"},
		{NULL, "DLPACKD_SOCKET_MODE=1000", "DLPACKD_SOCKET_MODE '1000'"},
		{"--socket-group=no-such-group-dlpc", NULL, "no such group"},
		{"--socket-group=4294967295", NULL, "not a group number"},
		{NULL, "DLPACKD_SOCKET_GROUP=12x", "not a group number"},
		{"--log-level=loud", NULL, "--log-level 'loud'"},
		{"-l9", NULL, "--log-level '9'"},
		{NULL, "DLPACKD_LOG_LEVEL=loud", "DLPACKD_LOG_LEVEL 'loud'"},
		{"--socket=", NULL, "the path is empty"},
		{NULL,
		 "DLPACKD_SOCKET=/tmp/" /* 120 bytes: too long for sun_path */
		 "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
		 "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx",
		 "longer than 103 bytes"},
		{NULL,
		 "DLPACKD_SOCKET=/tmp/" /* 104 bytes: PATH.new would not fit */
		 "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"
		 "xxxxxxxxxxxxxxxxxxxx",
		 "DLPC_DAEMON_SOCKET_PATH_MAX"},
		{"--no-such-flag", NULL, "unrecognized option"},
		{"stray", NULL, "unexpected argument 'stray'"},
	};
	char *argv[] = {(char *)DLPACKD_BIN, (char *)cases[_i].flag, NULL};
	char sock_env[160];
	/* the test's own socket unless the case is about the path: a bad value that were accepted
	 * must not reach a default socket (for root, the system one) */
	char *env[] = {sock_env, (char *)cases[_i].env, NULL};
	struct svc s;

	svc_init(&s, false);
	snprintf(sock_env, sizeof(sock_env), "DLPACKD_SOCKET=%s", s.sock);
	start(&s, argv, env, -1, NULL);
	if (exit_status(s.pid) != 2)
		dump_log(&s);
	ck_assert_int_eq(exit_status(s.pid), 2);
	ck_assert_msg(svc_log_has(&s, cases[_i].says, NULL), "case %d: no message with '%s'", _i,
		      cases[_i].says);
	ck_assert_msg(access(s.sock, F_OK) != 0, "a socket was made despite the bad value");
	svc_clear(&s);
}
END_TEST

static Suite *service_suite(void)
{
	Suite *s = suite_create("service");
	TCase *act = tcase_create("activation"), *cfg = tcase_create("config");

	tcase_set_timeout(act, scaled_ms(60000) / 1000);
	tcase_add_test(act, test_socket_activate);
	tcase_add_test(act, test_passed_socket_wins);
	tcase_add_loop_test(act, test_bad_activation_refused, 0, 6);
	tcase_add_test(act, test_foreign_listen_pid);
	suite_add_tcase(s, act);
	tcase_set_timeout(cfg, scaled_ms(60000) / 1000);
	tcase_add_test(cfg, test_own_socket_config);
	tcase_add_test(cfg, test_flag_beats_bad_env_and_no_fds);
	tcase_add_loop_test(cfg, test_bad_config_refused, 0, 15);
	tcase_add_test(cfg, test_socket_appears_listening);
	suite_add_tcase(s, cfg);
	return s;
}

int main(void)
{
	return run_suite(service_suite());
}
