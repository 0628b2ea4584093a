/* SPDX-License-Identifier: Apache-2.0 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>

#include "harness.h"
#include "limits.h"

int scaled_ms(int ms)
{
	const char *s = getenv("DLPC_TEST_SLOW");
	int k = s ? atoi(s) : 1;

	return ms * (k > 0 ? k : 1);
}

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

int fd_count(pid_t pid)
{
	char path[64];
	struct dirent *de;
	DIR *dir;
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	dir = opendir(path);
	ck_assert_msg(dir, "cannot open %s", path);
	while ((de = readdir(dir)))
		n += de->d_name[0] != '.';
	closedir(dir);
	return pid == getpid() ? n - 1 : n;
}

int fd_links(pid_t pid, bool (*match)(const char *target, void *arg), void *arg)
{
	char path[300], target[512];
	struct dirent *de;
	DIR *dir;
	int n = 0;

	snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
	dir = opendir(path);
	while (dir && (de = readdir(dir))) {
		ssize_t len;

		snprintf(path, sizeof(path), "/proc/%d/fd/%s", (int)pid, de->d_name);
		len = readlink(path, target, sizeof(target) - 1);
		if (len <= 0)
			continue;
		target[len] = '\0';
		n += match(target, arg);
	}
	if (dir)
		closedir(dir);
	return n;
}

/* The daemon on @p sock, or (@p listen_fd >= 0) on the listening socket @p listen_fd passed as
 * socket activation passes it. */
static pid_t spawn_daemon(const char *sock, const char *log, const struct daemon_opts *o,
			  int listen_fd)
{
	const char *wrapper = getenv("DLPC_TEST_WRAPPER");
	pid_t pid = fork();

	if (pid == 0) {
		char *argv[48], timeout[24];
		int argc = 0, fd;

		fd = open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
		if (fd >= 0) {
			dup2(fd, STDERR_FILENO);
			dup2(fd, STDOUT_FILENO);
		}
		/* the daemon starts with stdin/stdout/stderr only, and fd 3 when activated
		 * (LISTEN_FDS, as systemd passes it) */
		if (listen_fd >= 0) {
			char buf[24];

			/* dup2() of an fd onto itself would leave its close-on-exec flag */
			if (listen_fd == 3 ? fcntl(3, F_SETFD, 0) < 0 : dup2(listen_fd, 3) < 0)
				_exit(126);
			snprintf(buf, sizeof(buf), "%d", (int)getpid());
			setenv("LISTEN_PID", buf, 1);
			setenv("LISTEN_FDS", "1", 1);
			setenv("LISTEN_FDNAMES", "dlpackd.socket", 1);
		}
		close_range(listen_fd >= 0 ? 4 : 3, ~0U, 0);
		for (unsigned i = 0; o && i < o->inherit; i++)
			if (open("/dev/null", O_RDONLY) < 0)
				_exit(126);
		if (wrapper && *wrapper) {
			char *w = strdup(wrapper);

			for (char *tok = strtok(w, " "); tok && argc < 24; tok = strtok(NULL, " "))
				argv[argc++] = tok;
		}
		argv[argc++] = (char *)DLPACKD_BIN;
		if (listen_fd < 0) {
			argv[argc++] = (char *)"--socket";
			argv[argc++] = (char *)sock;
		}
		argv[argc++] = (char *)"--log-level";
		argv[argc++] = (char *)"debug";
		/* a daemon slowed down by a wrapper still gives its clients the usual time for each
		 * frame (arguments of the test come later, and win) */
		snprintf(timeout, sizeof(timeout), "%d", scaled_ms(DLPC_FRAME_TIMEOUT_MS_DEFAULT));
		argv[argc++] = (char *)"--frame-timeout-ms";
		argv[argc++] = timeout;
		for (int i = 0; o && o->args && o->args[i] && argc < 47; i++)
			argv[argc++] = (char *)o->args[i];
		argv[argc] = NULL;
		if (o && o->nofile) {
			struct rlimit rl = {o->nofile, o->nofile};

			if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
				_exit(126);
		}
		if (o && o->uid && sock) {
			char dir[108];

			snprintf(dir, sizeof(dir), "%s", sock);
			*strrchr(dir, '/') = '\0';
			if (chown(dir, o->uid, o->uid) < 0 || setgroups(0, NULL) < 0 ||
			    setgid(o->uid) < 0 || setuid(o->uid) < 0)
				_exit(126);
		}
		execvp(argv[0], argv);
		_exit(127);
	}
	ck_assert_int_ge(pid, 0);
	return pid;
}

static pid_t spawn_with(const char *sock, const char *log, const struct daemon_opts *o)
{
	return spawn_daemon(sock, log, o, -1);
}

pid_t daemon_spawn(const char *sock, const char *log)
{
	return spawn_with(sock, log, NULL);
}

pid_t daemon_spawn_activated(int listen_fd, const char *log)
{
	return spawn_daemon(NULL, log, NULL, listen_fd);
}

static bool can_connect(const char *sock)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	bool ok;

	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
	ok = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
	close(fd);
	return ok;
}

void daemon_start(struct daemon *d)
{
	daemon_start_with(d, NULL);
}

void daemon_start_with(struct daemon *d, const struct daemon_opts *o)
{
	long long deadline = now_ms() + scaled_ms(10000);

	snprintf(d->dir, sizeof(d->dir), "/tmp/dlpc-test-XXXXXX");
	ck_assert_msg(mkdtemp(d->dir), "mkdtemp: %s", strerror(errno));
	snprintf(d->sock, sizeof(d->sock), "%s/dlpackd.sock", d->dir);
	snprintf(d->log, sizeof(d->log), "%s/dlpackd.log", d->dir);
	d->pid = spawn_with(d->sock, d->log, o);
	while (!can_connect(d->sock)) {
		int st;

		ck_assert_msg(waitpid(d->pid, &st, WNOHANG) == 0, "dlpackd exited at start");
		ck_assert_msg(now_ms() < deadline, "dlpackd did not start listening");
		usleep(5000);
	}
}

static void dump(const char *path)
{
	char line[512];
	FILE *f = fopen(path, "r");

	if (!f)
		return;
	while (fgets(line, sizeof(line), f))
		fprintf(stderr, "  | %s", line);
	fclose(f);
}

/* Under valgrind --track-fds (reporting on the daemon's stderr, i.e. its log), the daemon must
 * leave only stdin, stdout, stderr and the fds it was started with open at exit: every fd the
 * report lists besides those three must be "<inherited from parent>". */
static void check_tool_report(const struct daemon *d)
{
	char line[512];
	bool bad = false, listed = false;
	FILE *f = fopen(d->log, "r");

	while (f && fgets(line, sizeof(line), f)) {
		/* the line after an fd's says where it came from */
		if (listed && !strstr(line, "<inherited from parent>"))
			bad = true;
		/* "Open file descriptor N:", "Open AF_UNIX socket N:" and the like */
		listed = strstr(line, "== Open ") != NULL;
	}
	if (f)
		fclose(f);
	if (bad)
		dump(d->log);
	ck_assert_msg(!bad, "dlpackd left file descriptors open at exit (log above)");
}

void daemon_stop(struct daemon *d)
{
	char path[160];
	int st;

	ck_assert_int_eq(kill(d->pid, SIGTERM), 0);
	ck_assert_int_eq(waitpid(d->pid, &st, 0), d->pid);
	if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
		dump(d->log);
	ck_assert_msg(WIFEXITED(st), "dlpackd died of signal %d", WTERMSIG(st));
	ck_assert_msg(WEXITSTATUS(st) == 0, "dlpackd exited %d (99: the wrapper found errors)",
		      WEXITSTATUS(st));
	ck_assert_msg(access(d->sock, F_OK) != 0, "dlpackd left its socket behind");
	check_tool_report(d);
	snprintf(path, sizeof(path), "rm -rf '%s'", d->dir);
	ck_assert_int_eq(system(path), 0);
}

bool log_has(const char *log, const char *text)
{
	char line[1024];
	bool found = false;
	FILE *f = fopen(log, "r");

	while (f && !found && fgets(line, sizeof(line), f))
		found = strstr(line, text) != NULL;
	if (f)
		fclose(f);
	return found;
}

dlpc_client *connect_or_die(const struct daemon *d)
{
	dlpc_client *c = NULL;
	int r = dlpc_connect(d->sock, &c);

	ck_assert_msg(r == 0, "dlpc_connect: %s", dlpc_last_error());
	return c;
}

dlpc_stats stat_or_die(dlpc_client *c)
{
	dlpc_stats s = {.size = sizeof(s)};

	ck_assert_msg(dlpc_stat(c, &s) == 0, "dlpc_stat: %s", dlpc_last_error());
	return s;
}

uint64_t default_fd_share(dlpc_client *c)
{
	dlpc_stats s = {.size = sizeof(s)};

	return dlpc_stat(c, &s) == 0 ? s.fd_budget * DLPC_UID_FD_SHARE_DEFAULT / 100 : 0;
}

dlpc_channel_info chan_or_die(dlpc_client *c, const char *name)
{
	dlpc_channel_info i = {.size = sizeof(i)};

	ck_assert_msg(dlpc_channel_stat(c, name, &i) == 0, "dlpc_channel_stat('%s'): %s", name,
		      dlpc_last_error());
	return i;
}

/*
 * The child never calls into Check: every assertion, even one that holds, takes Check's lock
 * (it records the place), and a fork() while another thread of the test held it (a thread that
 * asserts, as test_durability's service manager does) leaves the child a lock nobody releases.
 */
pid_t spawn(int (*fn)(void *), void *arg)
{
	pid_t pid = fork();

	if (pid == 0)
		_exit(fn(arg) == 0 ? 0 : 1);
	ck_assert_int_ge(pid, 0);
	return pid;
}

int wait_child(pid_t pid)
{
	int st;

	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* The first line of /proc/@p pid/@p file into @p buf, without its newline ("?" if unreadable). */
static void proc_line(pid_t pid, const char *file, char *buf, int len)
{
	char path[64];
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/%s", (int)pid, file);
	snprintf(buf, (size_t)len, "?");
	f = fopen(path, "r");
	if (!f)
		return;
	if (!fgets(buf, len, f))
		snprintf(buf, (size_t)len, "?");
	buf[strcspn(buf, "\n")] = '\0';
	fclose(f);
}

/* The file and offset of @p pid's mapping that holds @p addr, into @p buf ("?" if none). */
static void proc_addr(pid_t pid, unsigned long addr, char *buf, int len)
{
	char path[64], line[512], file[400];
	unsigned long lo, hi, off;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/maps", (int)pid);
	snprintf(buf, (size_t)len, "?");
	f = fopen(path, "r");
	if (!f)
		return;
	while (fgets(line, sizeof(line), f)) {
		file[0] = '\0';
		if (sscanf(line, "%lx-%lx %*s %lx %*s %*s %399s", &lo, &hi, &off, file) < 3 ||
		    addr < lo || addr >= hi)
			continue;
		snprintf(buf, (size_t)len, "%s+0x%lx", file[0] ? file : "[anonymous]",
			 addr - lo + off);
		break;
	}
	fclose(f);
}

/* Say on stderr where the child @p pid (@p what) is stuck: its command and state, its kernel
 * wait channel and stack, its system call and the code it made it from. */
static void describe_stuck(pid_t pid, const char *what)
{
	char stat[256], state[128] = "?", wchan[128], sys[256], line[256], path[64];
	char where[512] = "?", stack[512] = "";
	const char *comm, *end;
	FILE *f;

	/* "pid (comm) S ...": the command and its state letter */
	proc_line(pid, "stat", stat, sizeof(stat));
	comm = strchr(stat, '(');
	end = strrchr(stat, ')');
	if (comm && end && end[1] == ' ' && end[2])
		snprintf(state, sizeof(state), "%.*s %c", (int)(end + 1 - comm), comm, end[2]);
	proc_line(pid, "wchan", wchan, sizeof(wchan));
	/* "NR args... sp pc", or "-1 sp pc" outside a system call: the last word is the pc */
	proc_line(pid, "syscall", sys, sizeof(sys));
	end = strrchr(sys, ' ');
	if (end)
		proc_addr(pid, strtoul(end + 1, NULL, 16), where, sizeof(where));
	snprintf(path, sizeof(path), "/proc/%d/stack", (int)pid);
	f = fopen(path, "r");
	/* lines "[<0>] function+0x46/0x90" */
	while (f && fgets(line, sizeof(line), f) && strlen(stack) < sizeof(stack) - 64) {
		line[strcspn(line, "+\n")] = '\0';
		end = strchr(line, ' ');
		snprintf(stack + strlen(stack), sizeof(stack) - strlen(stack), "%s%s",
			 stack[0] ? " < " : "", end ? end + 1 : line);
	}
	if (f)
		fclose(f);
	fprintf(stderr,
		"%s (pid %d) did not end: %s; wchan %s; kernel stack %s; syscall %s, "
		"called from %s\n",
		what, (int)pid, state, wchan, stack[0] ? stack : "?", sys, where);
}

int wait_child_until(pid_t pid, long long deadline_ms, const char *what)
{
	int st;

	for (;;) {
		pid_t r = waitpid(pid, &st, WNOHANG);

		ck_assert_int_ge(r, 0);
		if (r == pid)
			return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
		if (now_ms() >= deadline_ms)
			break;
		usleep(10000);
	}
	describe_stuck(pid, what);
	kill(pid, SIGKILL);
	ck_assert_int_eq(waitpid(pid, &st, 0), pid);
	return -1;
}

static bool settled(const dlpc_stats *s, void *arg)
{
	return s->connections == *(const uint64_t *)arg && s->fds_closing == 0;
}

int settled_fds(const struct daemon *d, dlpc_client *c, uint64_t conns)
{
	ck_assert_msg(wait_stat(c, settled, &conns, 2000), "dlpackd did not settle");
	return fd_count(d->pid);
}

bool wait_stat(dlpc_client *c, bool (*cond)(const dlpc_stats *s, void *arg), void *arg, int ms)
{
	long long deadline = now_ms() + scaled_ms(ms);

	for (;;) {
		dlpc_stats s = stat_or_die(c);

		if (cond(&s, arg))
			return true;
		if (now_ms() >= deadline)
			return false;
		usleep(1000);
	}
}

struct host {
	DLManagedTensorVersioned t;
	int *counter;
	int64_t dims[2 * DLPC_NDIM_MAX];
};

static void host_deleter(DLManagedTensorVersioned *t)
{
	struct host *h = (struct host *)t;

	if (h->counter)
		(*h->counter)++;
	free(h);
}

DLManagedTensorVersioned *host_tensor(void *data, DLDataType dt, int ndim, const int64_t *shape,
				      const int64_t *strides, int *counter)
{
	struct host *h = calloc(1, sizeof(*h));

	ck_assert_ptr_nonnull(h);
	memcpy(h->dims, shape, (size_t)ndim * sizeof(int64_t));
	if (strides)
		memcpy(h->dims + DLPC_NDIM_MAX, strides, (size_t)ndim * sizeof(int64_t));
	h->counter = counter;
	h->t.version.major = DLPACK_MAJOR_VERSION;
	h->t.version.minor = DLPACK_MINOR_VERSION;
	h->t.deleter = host_deleter;
	h->t.dl_tensor.data = data;
	h->t.dl_tensor.device.device_type = kDLCPU;
	h->t.dl_tensor.ndim = ndim;
	h->t.dl_tensor.dtype = dt;
	h->t.dl_tensor.shape = h->dims;
	h->t.dl_tensor.strides = strides ? h->dims + DLPC_NDIM_MAX : NULL;
	return &h->t;
}

void publish_filled(dlpc_client *c, const char *name, size_t size, int fill)
{
	int64_t shape[1] = {(int64_t)size};
	uint8_t *src = malloc(size);
	int r;

	ck_assert_ptr_nonnull(src);
	memset(src, fill, size);
	r = dlpc_publish(c, name,
			 host_tensor(src, (DLDataType){kDLUInt, 8, 1}, 1, shape, NULL, NULL), 0);
	ck_assert_msg(r > 0, "publish %s: %d: %s", name, r, dlpc_last_error());
	free(src);
}

int dlpc_mappings(void)
{
	char line[512];
	FILE *f = fopen("/proc/self/maps", "re");
	int n = 0;

	while (f && fgets(line, sizeof(line), f))
		n += strstr(line, "/memfd:dlpc:") != NULL;
	if (f)
		fclose(f);
	return n;
}

uint64_t pages_mapped(const void *map, uint64_t len)
{
	int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
	uint64_t n = 0, e;

	ck_assert_int_ge(fd, 0);
	for (uint64_t off = 0; off < len; off += 4096) {
		ck_assert_int_eq(
			pread(fd, &e, sizeof(e), (off_t)(((uintptr_t)map + off) / 4096 * 8)),
			(ssize_t)sizeof(e));
		n += e >> 63;
	}
	close(fd);
	return n;
}

void caches_at_defaults(void)
{
	unsetenv(DLPC_CACHE_ENTRIES_ENV);
	unsetenv(DLPC_CACHE_BYTES_ENV);
	unsetenv(DLPC_CACHE_IDLE_MS_ENV);
}

int run_suite(Suite *s)
{
	SRunner *sr = srunner_create(s);
	int failed;

	srunner_set_fork_status(sr, CK_FORK);
	/* The suites count references and round trips as the daemon sees them: they run without
	 * the client's cache of idle references, which has a suite of its own (test_cache.c)
	 * that turns it on where it wants it. */
	setenv(DLPC_CACHE_ENTRIES_ENV, "0", 1);
	srunner_run_all(sr, CK_ENV); /* CK_VERBOSITY=verbose lists every test */
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed > 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}

ssize_t send_fds_raw(int sock, const void *data, size_t len, const int *fds, unsigned nfds)
{
	size_t space = CMSG_SPACE(sizeof(int) * nfds);
	char *ctl = calloc(1, space);
	struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
	ssize_t n;

	if (!ctl) {
		errno = ENOMEM;
		return -1;
	}
	if (nfds > 0) {
		struct cmsghdr *c;

		msg.msg_control = ctl;
		msg.msg_controllen = space;
		c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
	}
	n = sendmsg(sock, &msg, MSG_NOSIGNAL);
	free(ctl);
	return n;
}

void become_nobody(void)
{
	CHILD_CHECK(setgroups(0, NULL) == 0);
	CHILD_CHECK(setgid(NOBODY) == 0);
	CHILD_CHECK(setuid(NOBODY) == 0);
	CHILD_CHECK(getuid() == NOBODY && geteuid() == NOBODY);
	CHILD_CHECK(prctl(PR_SET_DUMPABLE, 1) == 0);
}

void daemon_open_for_others(const struct daemon *d)
{
	ck_assert_int_eq(chmod(d->dir, 0755), 0);
	ck_assert_int_eq(chmod(d->sock, 0666), 0);
}
