/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Entries that outlive the daemon. The test plays systemd's part with its documented fd-store
 * protocol: a notification socket that keeps the fds sent with FDSTORE=1 under their FDNAME=
 * (up to FileDescriptorStoreMax, here FDSTORE=), drops them on FDSTOREREMOVE=1, and starts the
 * daemon again with them as LISTEN_FDS/LISTEN_FDNAMES, after the socket of socket activation.
 * Then the daemon is SIGKILLed under a publish/attach load and restarted; upgraded in place
 * (SIGHUP, dlpackctl upgrade) with clients running; and fed hostile state journals.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>

#include "cuda_api.h"
#include "harness.h"
#include "persist.h"
#include "raw.h"

/* The fds the fake manager keeps (FDSTORE=, FileDescriptorStoreMax=): more than
 * DLPD_NOTIFY_QUEUE_MAX, for test_given_up_journal. */
#define STORE_MAX 2048
/* Floats in each test tensor. */
#define NV 1024
/* Load processes during a kill or an upgrade. */
#define LOADERS 3

struct stored {
	int fd;
	char name[DLPD_FDNAME_MAX + 1];
};

/* The service manager: its notification socket, the socket it activates the daemon with, and
 * its fd store. */
struct mgr {
	char dir[64], sock[108], log[128], notify[108];
	int notify_fd, listen_fd;
	bool activate;	/* pass listen_fd (else the daemon binds sock itself) */
	bool relative;	/* the daemon binds "dlpackd.sock" in dir, its working directory */
	bool store_off; /* the daemon is told FDSTORE=0, the store still passes what it has */
	unsigned store_max;
	rlim_t fsize;	  /* not 0: the daemon's RLIMIT_FSIZE (soft and hard) */
	rlim_t nofile;	  /* not 0: the daemon's RLIMIT_NOFILE (soft and hard) */
	char status[256]; /* the last STATUS= it sent */
	struct stored store[STORE_MAX];
	size_t nstore;
	unsigned readies, reloads;
	pid_t pid;
	/* a thread reads the notifications as they come, as systemd does */
	pthread_t reader;
	pthread_mutex_t mu;
	bool quit;
	bool stalled; /* the reader takes nothing: a service manager that reads slowly */
};

static long long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

static void *mgr_read(void *arg);
static bool mgr_take(struct mgr *m, int ms);

static void mgr_init(struct mgr *m, bool activate, unsigned store_max)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};

	memset(m, 0, sizeof(*m));
	m->pid = -1;
	m->activate = activate;
	m->store_max = store_max;
	snprintf(m->dir, sizeof(m->dir), "/tmp/dlpc-dur-XXXXXX");
	ck_assert_ptr_nonnull(mkdtemp(m->dir));
	chmod(m->dir, 0755);
	snprintf(m->sock, sizeof(m->sock), "%s/dlpackd.sock", m->dir);
	snprintf(m->log, sizeof(m->log), "%s/dlpackd.log", m->dir);
	snprintf(m->notify, sizeof(m->notify), "%s/notify", m->dir);
	m->notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	ck_assert_int_ge(m->notify_fd, 0);
	strcpy(sa.sun_path, m->notify);
	ck_assert_int_eq(bind(m->notify_fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
	/* room for a burst of FDSTORE=1 datagrams while the test is busy elsewhere */
	int big = 4 << 20;
	setsockopt(m->notify_fd, SOL_SOCKET, SO_RCVBUF, &big, sizeof(big));
	m->listen_fd = -1;
	if (activate) {
		struct sockaddr_un ls = {.sun_family = AF_UNIX};

		m->listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
		strcpy(ls.sun_path, m->sock);
		ck_assert_int_eq(bind(m->listen_fd, (struct sockaddr *)&ls, sizeof(ls)), 0);
		chmod(m->sock, 0666);
		ck_assert_int_eq(listen(m->listen_fd, 128), 0);
	}
	pthread_mutex_init(&m->mu, NULL);
	ck_assert_int_eq(pthread_create(&m->reader, NULL, mgr_read, m), 0);
}

/* Storages named @p prefix... in the store, once every notification sent so far is taken. */
static size_t store_count(struct mgr *m, const char *prefix)
{
	size_t n = 0;

	pthread_mutex_lock(&m->mu);
	while (mgr_take(m, 0))
		;
	for (size_t i = 0; i < m->nstore; i++)
		n += strncmp(m->store[i].name, prefix, strlen(prefix)) == 0;
	pthread_mutex_unlock(&m->mu);
	return n;
}

static void store_remove(struct mgr *m, const char *name)
{
	for (size_t i = 0; i < m->nstore;)
		if (strcmp(m->store[i].name, name) == 0) {
			close(m->store[i].fd);
			m->store[i] = m->store[--m->nstore];
		} else {
			i++;
		}
}

/* Take one notification, as systemd does; false if none came within @p ms. */
static bool mgr_take(struct mgr *m, int ms)
{
	union {
		struct cmsghdr h;
		char buf[CMSG_SPACE(sizeof(int) * 8)];
	} ctl;
	struct pollfd pfd = {.fd = m->notify_fd, .events = POLLIN};
	char msg[1024], name[DLPD_FDNAME_MAX + 1] = "stored";
	struct iovec iov = {.iov_base = msg, .iov_len = sizeof(msg) - 1};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
	int fds[8], nfds = 0;
	bool fdstore = false, remove = false;
	ssize_t n;

	if (poll(&pfd, 1, ms) <= 0)
		return false;
	mh.msg_control = ctl.buf;
	mh.msg_controllen = sizeof(ctl.buf);
	n = recvmsg(m->notify_fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
	if (n < 0)
		return false;
	ck_assert_msg(!(mh.msg_flags & MSG_CTRUNC), "fds of a notification were cut off");
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));

			memcpy(fds + nfds, CMSG_DATA(c), sizeof(int) * (size_t)k);
			nfds += k;
		}
	msg[n] = '\0';
	for (char *save, *line = strtok_r(msg, "\n", &save); line;
	     line = strtok_r(NULL, "\n", &save)) {
		if (strcmp(line, "READY=1") == 0)
			m->readies++;
		else if (strcmp(line, "RELOADING=1") == 0)
			m->reloads++;
		else if (strcmp(line, "FDSTORE=1") == 0)
			fdstore = true;
		else if (strcmp(line, "FDSTOREREMOVE=1") == 0)
			remove = true;
		else if (strncmp(line, "FDNAME=", 7) == 0)
			snprintf(name, sizeof(name), "%s", line + 7);
		else if (strncmp(line, "STATUS=", 7) == 0)
			snprintf(m->status, sizeof(m->status), "%s", line + 7);
	}
	if (remove)
		store_remove(m, name);
	for (int i = 0; i < nfds; i++) {
		/* systemd refuses fds past the store's size, and any without FDSTORE=1 */
		if (fdstore && m->nstore < m->store_max) {
			m->store[m->nstore].fd = fds[i];
			snprintf(m->store[m->nstore].name, sizeof(m->store[0].name), "%s", name);
			m->nstore++;
		} else {
			close(fds[i]);
		}
	}
	return true;
}

/* Take every notification already sent. */
static void mgr_drain(struct mgr *m)
{
	pthread_mutex_lock(&m->mu);
	while (mgr_take(m, 0))
		;
	pthread_mutex_unlock(&m->mu);
}

static void *mgr_read(void *arg)
{
	struct mgr *m = arg;

	while (!__atomic_load_n(&m->quit, __ATOMIC_ACQUIRE)) {
		struct pollfd pfd = {.fd = m->notify_fd, .events = POLLIN};

		if (__atomic_load_n(&m->stalled, __ATOMIC_ACQUIRE)) {
			usleep(20000);
			continue;
		}
		/* one at a time, so that a stall set while notifications keep coming stops it */
		if (poll(&pfd, 1, 20) > 0) {
			pthread_mutex_lock(&m->mu);
			while (!__atomic_load_n(&m->stalled, __ATOMIC_ACQUIRE) && mgr_take(m, 0))
				;
			pthread_mutex_unlock(&m->mu);
		}
	}
	return NULL;
}

static unsigned readies(struct mgr *m)
{
	unsigned n;

	pthread_mutex_lock(&m->mu);
	n = m->readies;
	pthread_mutex_unlock(&m->mu);
	return n;
}

/* Wait until READY=1 has come @p n times in all. */
static void mgr_wait_ready(struct mgr *m, unsigned n)
{
	long long deadline = now_ms() + scaled_ms(15000);

	while (readies(m) < n) {
		ck_assert_msg(now_ms() < deadline, "dlpackd never said READY=1 (log %s)", m->log);
		ck_assert_msg(waitpid(m->pid, NULL, WNOHANG) == 0, "dlpackd exited (log %s)",
			      m->log);
		usleep(5000);
	}
}

/* Start the daemon with the store's fds (after the activated socket), as systemd would. */
static void mgr_start(struct mgr *m)
{
	unsigned before = readies(m);
	pid_t pid;

	/* the store does not change under the fork */
	pthread_mutex_lock(&m->mu);
	pid = fork();
	if (pid > 0)
		pthread_mutex_unlock(&m->mu);
	if (pid == 0) {
		int src[STORE_MAX + 1], tmp[STORE_MAX + 1], n = 0, log;
		char names[(DLPD_FDNAME_MAX + 1) * (STORE_MAX + 1)] = "", buf[64], store[32];

		if (m->activate) {
			src[n++] = m->listen_fd;
			strcat(names, "dlpackd.socket");
		}
		for (size_t i = 0; i < m->nstore; i++) {
			if (n)
				strcat(names, ":");
			strcat(names, m->store[i].name);
			src[n++] = m->store[i].fd;
		}
		for (int i = 0; i < n; i++)
			tmp[i] = fcntl(src[i], F_DUPFD_CLOEXEC, 3 + n + 8);
		for (int i = 0; i < n; i++)
			if (tmp[i] < 0 || dup2(tmp[i], 3 + i) < 0)
				_exit(126);
		log = open(m->log, O_WRONLY | O_CREAT | O_APPEND, 0644);
		if (log < 0)
			_exit(126);
		dup2(log, STDERR_FILENO);
		dup2(log, STDOUT_FILENO);
		close_range(3 + (unsigned)n, ~0U, 0);
		snprintf(buf, sizeof(buf), "%d", (int)getpid());
		setenv("LISTEN_PID", buf, 1);
		snprintf(buf, sizeof(buf), "%d", n);
		setenv("LISTEN_FDS", buf, 1);
		setenv("LISTEN_FDNAMES", names, 1);
		setenv("NOTIFY_SOCKET", m->notify, 1);
		snprintf(store, sizeof(store), "%u", m->store_off ? 0 : m->store_max);
		setenv("FDSTORE", store, 1);
		if (m->fsize) {
			struct rlimit rl = {m->fsize, m->fsize};

			if (setrlimit(RLIMIT_FSIZE, &rl) < 0)
				_exit(126);
		}
		if (m->nofile) {
			struct rlimit rl = {m->nofile, m->nofile};

			if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
				_exit(126);
		}
		if (m->relative && chdir(m->dir) < 0)
			_exit(126);
		if (m->activate)
			execl(DLPACKD_BIN, DLPACKD_BIN, "-l", "debug", (char *)NULL);
		else
			execl(DLPACKD_BIN, DLPACKD_BIN, "-l", "debug", "--socket-mode", "0666",
			      "--socket", m->relative ? "dlpackd.sock" : m->sock, (char *)NULL);
		_exit(127);
	}
	ck_assert_int_ge(pid, 0);
	m->pid = pid;
	mgr_wait_ready(m, before + 1);
}

static int exit_status(pid_t pid)
{
	long long deadline = now_ms() + scaled_ms(15000);
	int st;

	while (waitpid(pid, &st, WNOHANG) == 0) {
		ck_assert_msg(now_ms() < deadline, "process %d did not exit", (int)pid);
		usleep(5000);
	}
	return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void mgr_kill(struct mgr *m, int sig)
{
	ck_assert_int_eq(kill(m->pid, sig), 0);
	ck_assert_int_eq(exit_status(m->pid), sig == SIGKILL ? 128 + SIGKILL : 0);
	/* what the daemon sent before it died is still queued: systemd reads it too */
	mgr_drain(m);
}

static void mgr_clear(struct mgr *m)
{
	char cmd[128];

	__atomic_store_n(&m->quit, true, __ATOMIC_RELEASE);
	pthread_join(m->reader, NULL);
	for (size_t i = 0; i < m->nstore; i++)
		close(m->store[i].fd);
	m->nstore = 0;
	if (m->listen_fd >= 0)
		close(m->listen_fd);
	close(m->notify_fd);
	snprintf(cmd, sizeof(cmd), "rm -rf %s", m->dir);
	if (system(cmd) != 0)
		fprintf(stderr, "cannot remove %s\n", m->dir);
}

static void dump_log(const struct mgr *m)
{
	char cmd[200];

	snprintf(cmd, sizeof(cmd), "tail -n 60 %s >&2", m->log);
	if (system(cmd) != 0)
		fprintf(stderr, "no log at %s\n", m->log);
}

/* ---- the tensors: their bytes follow from name and generation ---- */

static uint32_t seed_of(const char *name, uint64_t gen)
{
	uint32_t h = 2166136261u;

	for (const char *p = name; *p; p++)
		h = (h ^ (uint8_t)*p) * 16777619u;
	return h ^ (uint32_t)(gen * 2654435761u);
}

static void fill(float *v, const char *name, uint64_t gen)
{
	uint32_t s = seed_of(name, gen);

	for (int i = 0; i < NV; i++)
		v[i] = (float)((s + (uint32_t)i * 7919u) % 100003u);
}

static int publish(dlpc_client *c, const char *name, uint64_t gen, uint32_t flags)
{
	static float data[NV];
	int64_t shape[1] = {NV};

	fill(data, name, gen);
	return dlpc_publish(c, name,
			    host_tensor(data, (DLDataType){kDLFloat, 32, 1}, 1, shape, NULL, NULL),
			    flags);
}

/* Attach @p name: its generation if its bytes are those of that generation, else -EILSEQ. */
static int64_t attach_check(dlpc_client *c, const char *name)
{
	static float want[NV];
	DLManagedTensorVersioned *t;
	dlpc_attach_info info = {.size = sizeof(info)};
	int r = dlpc_attach(c, name, NULL, &t);
	int64_t gen;

	if (r < 0)
		return r;
	gen = r;
	if (dlpc_tensor_attach_info(t, &info) == 0)
		gen = (int64_t)info.generation;
	fill(want, name, (uint64_t)gen);
	if (t->dl_tensor.ndim != 1 || t->dl_tensor.shape[0] != NV ||
	    memcmp(t->dl_tensor.data, want, sizeof(want)) != 0)
		gen = -EILSEQ;
	t->deleter(t);
	return gen;
}

/* ---- load: processes that publish, replace and attach until told to stop ---- */

struct load {
	const char *sock;
	int id;
	char ack_path[128];  /* each acknowledged publish: "name generation\n" */
	char stop_path[128]; /* once it exists the loader stops */
	bool reconnect;	     /* DLPC_CONNECT_RECONNECT, riding through (else stop at a loss) */
	uint64_t reconnects; /* with reconnect: how many times it must have connected anew */
};

static void ack(int fd, const char *name, long long gen)
{
	char line[96];
	int n = snprintf(line, sizeof(line), "%s %lld\n", name, gen);

	CHILD_CHECK(write(fd, line, (size_t)n) == n);
}

/* Publish new names, replace its own churn/<id> (written with generation 0's bytes whatever
 * its generation) and attach keep/3, logging what the daemon acknowledged. */
static int loader(void *arg)
{
	const struct load *l = arg;
	int fd = open(l->ack_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	dlpc_client *c = NULL;
	long long lost_since = 0;
	char name[64];
	int n = 0, r;

	CHILD_CHECK(fd >= 0);
	CHILD_CHECK(dlpc_connect_flags(l->sock, l->reconnect ? DLPC_CONNECT_RECONNECT : 0, &c) ==
		    0);
	while (access(l->stop_path, F_OK) != 0) {
		snprintf(name, sizeof(name), "load/%d/%d", l->id, n);
		r = publish(c, name, 1, 0);
		if (r == 1) {
			ack(fd, name, 1);
			n++;
		}
		if (r >= 0) {
			snprintf(name, sizeof(name), "churn/%d", l->id);
			r = publish(c, name, 0, DLPC_PUBLISH_REPLACE);
			if (r > 0)
				ack(fd, name, r);
		}
		if (r >= 0)
			r = (int)attach_check(c, "keep/3");
		CHILD_CHECK(r != -EILSEQ);
		if (r >= 0) {
			lost_since = 0;
			continue;
		}
		/* the daemon went away: the next call connects anew, if asked to */
		if (!l->reconnect)
			break;
		if (!lost_since)
			lost_since = now_ms();
		CHILD_CHECK(now_ms() - lost_since < 10000);
		usleep(2000);
	}
	if (l->reconnect)
		CHILD_CHECK(dlpc_reconnects(c) == l->reconnects);
	dlpc_close(c);
	close(fd);
	return 0;
}

/* Attach churn/N: true if its bytes are whole. */
static bool churn_ok(dlpc_client *c, const char *name)
{
	static float want[NV];
	DLManagedTensorVersioned *t;
	bool ok;

	if (dlpc_attach(c, name, NULL, &t) < 0)
		return false;
	fill(want, name, 0);
	ok = memcmp(t->dl_tensor.data, want, sizeof(want)) == 0;
	t->deleter(t);
	return ok;
}

struct loaders {
	struct load l[LOADERS];
	pid_t pid[LOADERS];
};

static void loaders_start(struct loaders *ls, const struct mgr *m, bool reconnect,
			  uint64_t reconnects)
{
	for (int i = 0; i < LOADERS; i++) {
		struct load *l = &ls->l[i];

		l->sock = m->sock;
		l->id = i;
		l->reconnect = reconnect;
		l->reconnects = reconnects;
		snprintf(l->ack_path, sizeof(l->ack_path), "%s/ack-%d", m->dir, i);
		snprintf(l->stop_path, sizeof(l->stop_path), "%s/stop", m->dir);
		ls->pid[i] = spawn(loader, l);
	}
}

/* Lines acknowledged so far by loader @p i. */
static int acked(const struct loaders *ls, int i)
{
	FILE *f = fopen(ls->l[i].ack_path, "re");
	int n = 0, ch;

	while (f && (ch = fgetc(f)) != EOF)
		n += ch == '\n';
	if (f)
		fclose(f);
	return n;
}

static void loaders_wait_acks(const struct loaders *ls, int min)
{
	long long deadline = now_ms() + scaled_ms(15000);

	for (int i = 0; i < LOADERS; i++)
		while (acked(ls, i) < min) {
			ck_assert_msg(now_ms() < deadline, "loader %d acknowledged %d publishes", i,
				      acked(ls, i));
			usleep(5000);
		}
}

static void loaders_stop(struct loaders *ls, const struct mgr *m)
{
	char stop[128];
	int fd;

	snprintf(stop, sizeof(stop), "%s/stop", m->dir);
	fd = open(stop, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
	ck_assert_int_ge(fd, 0);
	close(fd);
	for (int i = 0; i < LOADERS; i++)
		ck_assert_msg(wait_child(ls->pid[i]) == 0, "loader %d failed", i);
	unlink(stop);
}

/* Every publish a loader saw acknowledged is there, whole; a replaced churn/N has the
 * generation last acknowledged, or the one after (a replace whose answer the kill lost).
 * Returns the number of acknowledged names. */
static size_t check_acks(dlpc_client *c, const struct loaders *ls)
{
	size_t names = 0;

	for (int i = 0; i < LOADERS; i++) {
		FILE *f = fopen(ls->l[i].ack_path, "re");
		char name[64], churn[64] = "";
		long long gen, churn_gen = 0;

		ck_assert_ptr_nonnull(f);
		while (fscanf(f, "%63s %lld", name, &gen) == 2) {
			if (strncmp(name, "churn/", 6) == 0) {
				snprintf(churn, sizeof(churn), "%s", name);
				churn_gen = gen;
				continue;
			}
			ck_assert_msg(attach_check(c, name) == gen, "%s: acknowledged, then lost",
				      name);
			names++;
		}
		fclose(f);
		if (churn[0]) {
			dlpc_entry_info *e;
			size_t cnt;

			ck_assert_dlpc(dlpc_list(c, churn, &e, &cnt), 0);
			ck_assert_uint_eq(cnt, 1);
			ck_assert_msg(e[0].generation == (uint64_t)churn_gen ||
					      e[0].generation == (uint64_t)churn_gen + 1,
				      "%s: generation %llu, acknowledged %lld", churn,
				      (unsigned long long)e[0].generation, churn_gen);
			dlpc_list_free(e, cnt);
			ck_assert_msg(churn_ok(c, churn), "%s: bytes changed", churn);
			names++;
		}
	}
	return names;
}

/* keep/0..29 (0..9 replaced once, 20..24 writable, 25..29 unpublished) and, from @p eph
 * (which stays connected), eph/0..4, ephemeral. */
static void publish_fixture(dlpc_client *c, dlpc_client *eph)
{
	char name[64];

	for (int i = 0; i < 30; i++) {
		snprintf(name, sizeof(name), "keep/%d", i);
		ck_assert_dlpc(publish(c, name, 1, i >= 20 && i < 25 ? DLPC_PUBLISH_WRITABLE : 0),
			       1);
	}
	for (int i = 0; i < 10; i++) {
		snprintf(name, sizeof(name), "keep/%d", i);
		ck_assert_dlpc(publish(c, name, 2, DLPC_PUBLISH_REPLACE), 2);
	}
	for (int i = 25; i < 30; i++) {
		snprintf(name, sizeof(name), "keep/%d", i);
		ck_assert_dlpc(dlpc_unpublish(c, name), 0);
	}
	for (int i = 0; i < 5; i++) {
		snprintf(name, sizeof(name), "eph/%d", i);
		ck_assert_dlpc(publish(eph, name, 1, DLPC_PUBLISH_EPHEMERAL), 1);
	}
}

/* What publish_fixture() left is back, ephemeral entries excepted; a writable one still is. */
static void check_fixture(dlpc_client *c)
{
	dlpc_entry_info *e;
	char name[64];
	size_t cnt;

	for (int i = 0; i < 30; i++) {
		int64_t want = i < 10 ? 2 : i < 25 ? 1 : -ENOENT;

		snprintf(name, sizeof(name), "keep/%d", i);
		ck_assert_msg(attach_check(c, name) == want, "%s: not as published", name);
	}
	ck_assert_dlpc(dlpc_list(c, "keep/2", &e, &cnt), 0);
	for (size_t i = 0; i < cnt; i++) {
		bool writable = e[i].name[6] != '\0' && e[i].name[6] < '5';

		ck_assert_msg(!!(e[i].flags & DLPC_PUBLISH_WRITABLE) == writable, "%s: flags 0x%x",
			      e[i].name, e[i].flags);
		ck_assert_uint_eq(e[i].owner_uid, getuid());
	}
	dlpc_list_free(e, cnt);
	ck_assert_dlpc(dlpc_list(c, "eph/", &e, &cnt), 0);
	ck_assert_msg(cnt == 0, "an ephemeral entry came back");
	dlpc_list_free(e, cnt);
}

/* STAT agrees with LIST, every listed entry is whole, and (with a store) the store holds one
 * storage per entry and one journal. Returns the number of entries. */
static size_t check_consistent(dlpc_client *c, struct mgr *m)
{
	dlpc_stats st = stat_or_die(c);
	uint64_t bytes = 0, mine = 0;
	dlpc_entry_info *e;
	size_t cnt;

	ck_assert_dlpc(dlpc_list(c, NULL, &e, &cnt), 0);
	for (size_t i = 0; i < cnt; i++) {
		if (strncmp(e[i].name, "churn/", 6) == 0)
			ck_assert_msg(churn_ok(c, e[i].name), "%s is not whole", e[i].name);
		else
			ck_assert_msg(attach_check(c, e[i].name) == (int64_t)e[i].generation,
				      "%s is not whole", e[i].name);
		if (e[i].owner_uid == getuid()) {
			bytes += e[i].nbytes;
			mine++;
		}
	}
	ck_assert_uint_eq(st.entries, cnt);
	ck_assert_uint_eq(st.storages, cnt);
	ck_assert_uint_eq(st.uid_entries, mine);
	ck_assert_uint_eq(st.uid_bytes_held, bytes);
	dlpc_list_free(e, cnt);
	if (m->store_max) {
		ck_assert_uint_eq(store_count(m, DLPD_FDNAME_STORAGE), cnt);
		ck_assert_uint_eq(store_count(m, DLPD_FDNAME_STATE), 1);
	}
	return cnt;
}

/* STAT's entries and storages, which must agree. */
static size_t check_consistent_gpu(dlpc_client *c)
{
	dlpc_stats st = stat_or_die(c);

	ck_assert_uint_eq(st.entries, st.storages);
	return st.entries;
}

static dlpc_client *connect_to(const struct mgr *m)
{
	dlpc_client *c;

	ck_assert_dlpc(dlpc_connect(m->sock, &c), 0);
	return c;
}

/* On failure, the daemon's log helps: Check's message alone rarely says why. @p cond is
 * evaluated once. */
#define ck_assert_log(m, cond, ...)                                                                \
	do {                                                                                       \
		bool ok_ = (cond);                                                                 \
		if (!ok_)                                                                          \
			dump_log(m);                                                               \
		ck_assert_msg(ok_, __VA_ARGS__);                                                   \
	} while (0)

/* SIGKILL under load, then a restart from the store: everything acknowledged is back, whole,
 * with its generation, flags and owner; nothing ephemeral or unpublished is; STAT, LIST and the
 * store agree. Then a clean stop and a second restart keep the same set. */
START_TEST(test_kill_under_load)
{
	struct mgr m;
	struct loaders ls;
	dlpc_client *c, *eph;
	size_t n, entries;

	mgr_init(&m, true, STORE_MAX);
	mgr_start(&m);
	c = connect_to(&m);
	eph = connect_to(&m);
	publish_fixture(c, eph);
	loaders_start(&ls, &m, false, 0);
	loaders_wait_acks(&ls, 20);
	mgr_kill(&m, SIGKILL);
	loaders_stop(&ls, &m);
	dlpc_close(c);
	dlpc_close(eph);
	ck_assert_uint_gt(store_count(&m, DLPD_FDNAME_STORAGE), 0);

	mgr_start(&m);
	/* dropping orphans from the store happens before READY=1; take those messages */
	mgr_drain(&m);
	c = connect_to(&m);
	check_fixture(c);
	n = check_acks(c, &ls);
	entries = check_consistent(c, &m);
	/* acknowledged ones, and perhaps one publish per loader whose answer the kill lost */
	fprintf(stderr, "kill under load: %zu acknowledged load entries, %zu entries back\n", n,
		entries);
	ck_assert_uint_ge(entries, n + 25);
	ck_assert_uint_le(entries, n + 25 + LOADERS);
	ck_assert_msg(log_has(m.log, "restored "), "no restore logged");
	dlpc_close(c);

	/* a clean stop (systemctl restart) keeps the store as it is */
	mgr_kill(&m, SIGTERM);
	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	check_fixture(c);
	ck_assert_uint_eq(check_acks(c, &ls), n);
	ck_assert_uint_eq(check_consistent(c, &m), entries);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* Upgrades in place without a store, by SIGHUP and by dlpackctl upgrade, with loaders that
 * reconnect running throughout: the pid stays, every acknowledged entry is back, ephemeral
 * entries and the old connections are gone, and the socket path stays the daemon's. */
START_TEST(test_upgrade_under_load)
{
	struct mgr m;
	struct loaders ls;
	dlpc_client *c, *eph;
	dlpc_entry_info *e;
	size_t n, cnt;
	pid_t pid;

	mgr_init(&m, false, 0);
	mgr_start(&m);
	pid = m.pid;
	c = connect_to(&m);
	eph = connect_to(&m);
	publish_fixture(c, eph);
	loaders_start(&ls, &m, true, 2);
	loaders_wait_acks(&ls, 10);
	for (int round = 0; round < 2; round++) {
		unsigned before = readies(&m);
		int acks[LOADERS];
		char cmd[256];

		for (int i = 0; i < LOADERS; i++)
			acks[i] = acked(&ls, i);
		if (round == 0) {
			ck_assert_int_eq(kill(pid, SIGHUP), 0);
		} else {
			snprintf(cmd, sizeof(cmd), "%s --socket %s upgrade >%s/ctl.out 2>&1",
				 DLPACKCTL_BIN, m.sock, m.dir);
			ck_assert_log(&m, system(cmd) == 0, "dlpackctl upgrade failed");
		}
		mgr_wait_ready(&m, before + 1);
		/* the loaders go on through it */
		loaders_wait_acks(&ls, 0);
		for (int i = 0; i < LOADERS; i++) {
			long long deadline = now_ms() + scaled_ms(15000);

			while (acked(&ls, i) < acks[i] + 10) {
				ck_assert_log(&m, now_ms() < deadline,
					      "loader %d stalled after upgrade %d", i, round);
				usleep(5000);
			}
		}
	}
	loaders_stop(&ls, &m);
	ck_assert_msg(waitpid(pid, NULL, WNOHANG) == 0, "the daemon's pid changed");
	ck_assert(log_has(m.log, "upgrading: executing"));
	/* the connections of the old image are gone, its ephemeral entries with them */
	ck_assert_int_lt(dlpc_list(eph, NULL, &e, &cnt), 0);
	dlpc_close(eph);
	dlpc_close(c);
	c = connect_to(&m);
	check_fixture(c);
	n = check_acks(c, &ls);
	ck_assert_uint_eq(check_consistent(c, &m), n + 25);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	ck_assert_msg(access(m.sock, F_OK) != 0, "the upgraded daemon left its socket behind");
	mgr_clear(&m);
}
END_TEST

/* With a store: an upgrade keeps it whole (one journal, a storage per entry), and a kill
 * after it loses nothing published before or after. */
START_TEST(test_upgrade_then_kill)
{
	struct mgr m;
	dlpc_client *c, *eph;
	unsigned before;

	mgr_init(&m, true, STORE_MAX);
	mgr_start(&m);
	c = connect_to(&m);
	eph = connect_to(&m);
	publish_fixture(c, eph);
	dlpc_close(eph);
	/* two at once: the second waits for the new image to be ready, and upgrades it again */
	before = readies(&m);
	ck_assert_int_eq(kill(m.pid, SIGHUP), 0);
	ck_assert_int_eq(kill(m.pid, SIGHUP), 0);
	mgr_wait_ready(&m, before + 1);
	usleep(200000);
	mgr_drain(&m);
	ck_assert_log(&m, waitpid(m.pid, NULL, WNOHANG) == 0, "a second SIGHUP killed dlpackd");
	mgr_wait_ready(&m, readies(&m) > before + 1 ? before + 2 : before + 1);
	dlpc_close(c);
	c = connect_to(&m);
	ck_assert_uint_eq(check_consistent(c, &m), 25);
	ck_assert_dlpc(publish(c, "after/upgrade", 1, 0), 1);
	dlpc_close(c);
	mgr_kill(&m, SIGKILL);
	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	check_fixture(c);
	ck_assert_int_eq(attach_check(c, "after/upgrade"), 1);
	ck_assert_uint_eq(check_consistent(c, &m), 26);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* ---- a storm of upgrades under waiting attaches ---- */

/* SIGHUPs of the storm, and the pause between two. */
#define STORM_SIGHUPS 100
#define STORM_PAUSE_US 5000
/* Waiting attaches started during the storm: C (libdlpc) and Python processes. */
#define STORM_C 15
#define STORM_PY 15
/* Processes that connect (dlpc_connect(), no flags), ask STAT and close, over and over. */
#define STORM_CONNECTORS 3
/* How long each attach waits (the Python one's timeout= says it in seconds). */
#define STORM_WAIT_MS 60000
/* Past the publish, how long the storm's processes may take to end: an attach whose wait is lost
 * fails at STORM_WAIT_MS after it began (before the publish); a connect, with its HELLO, is
 * bounded by the call timeout (DLPC_CALL_TIMEOUT_MS_DEFAULT, shorter). A process still there is
 * hung, and named. */
#define STORM_END_MS (STORM_WAIT_MS + 5000)
/* Publishes after the storm, each dropped by an upgrade a held-back SIGHUP began. */
#define STORM_PUBLISH_TRIES 3

static const char *storm_sock;

/* A C process that starts a waiting attach during the storm: it must end with the entry. */
static int storm_attacher(void *arg)
{
	dlpc_attach_opts o = {.size = sizeof(o), .timeout_ms = STORM_WAIT_MS};
	DLManagedTensorVersioned *t;
	static float want[NV];
	dlpc_client *c;
	int r;

	(void)arg;
	r = dlpc_connect_flags(storm_sock, DLPC_CONNECT_RECONNECT, &c);
	if (r < 0) {
		fprintf(stderr, "storm attacher %d: connect: %s\n", (int)getpid(),
			dlpc_last_error());
		return 1;
	}
	r = dlpc_attach(c, "storm/x", &o, &t);
	if (r < 0) {
		fprintf(stderr, "storm attacher %d: attach: %s\n", (int)getpid(),
			dlpc_last_error());
		return 1;
	}
	fill(want, "storm/x", 1);
	CHILD_CHECK(r == 1 && t->dl_tensor.shape[0] == NV &&
		    memcmp(t->dl_tensor.data, want, sizeof(want)) == 0);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* A process that connects and closes until @p arg (a path) exists: every connect works. */
static int storm_connector(void *arg)
{
	const char *stop = arg;
	int n = 0;

	while (access(stop, F_OK) != 0) {
		dlpc_client *c;
		int r = dlpc_connect(storm_sock, &c);

		if (r < 0) {
			fprintf(stderr, "storm connector %d: connect %d: %s\n", (int)getpid(), n,
				dlpc_last_error());
			return 1;
		}
		dlpc_close(c);
		n++;
	}
	return n > 0 ? 0 : 2;
}

/* The Python half: dlpack_ipc.attach() with the module's own client, waiting; the bytes are
 * fill()'s for ("storm/x", 1). */
static const char storm_py[] =
	"import sys, numpy as np, dlpack_ipc\n"
	"name, gen = 'storm/x', 1\n"
	"h = 2166136261\n"
	"for b in name.encode():\n"
	"    h = ((h ^ b) * 16777619) & 0xffffffff\n"
	"s = h ^ ((gen * 2654435761) & 0xffffffff)\n"
	"i = np.arange(1024, dtype=np.uint64)\n"
	"want = (((s + i * 7919) & 0xffffffff) % 100003).astype(np.float32)\n"
	"try:\n"
	"    t = dlpack_ipc.attach(name, timeout=60)\n"
	"except OSError as e:\n"
	"    print('storm python attacher:', type(e).__name__, e, file=sys.stderr)\n"
	"    sys.exit(1)\n"
	"a = np.from_dlpack(t)\n"
	"sys.exit(0 if a.shape == (1024,) and (a == want).all() else 3)\n";

/* Start the Python attacher, or return -1 (and say why once) where it cannot run. */
static pid_t storm_python(void)
{
#ifdef DLPC_TEST_PYTHONPATH
	pid_t pid;

	if (access(DLPC_TEST_PYTHON, X_OK) != 0)
		return -1;
	/* the child calls no Check assertion (spawn() says why) */
	pid = fork();
	if (pid == 0) {
		setenv("PYTHONPATH", DLPC_TEST_PYTHONPATH, 1);
		setenv(DLPC_SOCKET_ENV, storm_sock, 1);
		setenv("PYTHONDONTWRITEBYTECODE", "1", 1);
		execl(DLPC_TEST_PYTHON, DLPC_TEST_PYTHON, "-c", storm_py, (char *)NULL);
		_exit(127);
	}
	ck_assert_int_ge(pid, 0);
	return pid;
#else
	return -1;
#endif
}

static void *storm_signals(void *arg)
{
	pid_t pid = *(pid_t *)arg;

	for (int i = 0; i < STORM_SIGHUPS; i++) {
		kill(pid, SIGHUP);
		usleep(STORM_PAUSE_US);
	}
	return NULL;
}

/* Once every upgrade begun (RELOADING=1) has ended (READY=1), the number begun. */
static unsigned storm_settled(struct mgr *m)
{
	long long deadline = now_ms() + scaled_ms(15000);

	for (;;) {
		unsigned ready, reloads;

		pthread_mutex_lock(&m->mu);
		ready = m->readies;
		reloads = m->reloads;
		pthread_mutex_unlock(&m->mu);
		if (ready == reloads + 1)
			return reloads;
		ck_assert_log(m, now_ms() < deadline, "dlpackd did not come back after the storm");
		usleep(10000);
	}
}

/* Whether the manager hears of an upgrade begun after the @p before it had heard of. */
static bool storm_upgraded_since(struct mgr *m, unsigned before)
{
	long long deadline = now_ms() + scaled_ms(5000);
	unsigned reloads;

	do {
		pthread_mutex_lock(&m->mu);
		reloads = m->reloads;
		pthread_mutex_unlock(&m->mu);
		if (reloads > before)
			return true;
		usleep(10000);
	} while (now_ms() < deadline);
	return false;
}

/*
 * Publish "storm/x" after the storm; the publish is not the test. A SIGHUP that reached dlpackd
 * while an image was executing is held back (main.c) and starts one more upgrade right after
 * that image's READY=1, dropping this connection like the others: only then, the manager having
 * been told of that upgrade, does the publish go again (and find the entry if the first one
 * made it). The connection that published (or found it published), kept open to the end.
 */
static dlpc_client *storm_publish(struct mgr *m)
{
	for (int tries = 1;; tries++) {
		unsigned before = storm_settled(m);
		dlpc_client *c = NULL;
		int r = dlpc_connect(m->sock, &c);
		bool lost;

		if (r >= 0)
			r = publish(c, "storm/x", 1, 0);
		if (r < 0)
			fprintf(stderr, "upgrade storm: publish %d: %s\n", tries,
				dlpc_last_error());
		if (r == 1 || (tries > 1 && r == -EEXIST))
			return c;
		dlpc_close(c);
		lost = r == -EPIPE || r == -ECONNRESET;
		ck_assert_log(m, lost, "the publish after the storm (try %d) returned %d", tries,
			      r);
		ck_assert_log(m, tries < STORM_PUBLISH_TRIES,
			      "the publish after the storm lost its connection %d times", tries);
		ck_assert_log(m, storm_upgraded_since(m, before),
			      "the publish after the storm (try %d) lost its connection with no "
			      "upgrade since",
			      tries);
	}
}

/* 100 SIGHUPs 5 ms apart while 30 processes (C and Python) start a waiting attach of a name
 * not published yet, and others connect over and over: no connect fails, and every attach
 * ends with the entry once it is published after the storm. */
START_TEST(test_upgrade_storm)
{
	pid_t att[STORM_C + STORM_PY], conn[STORM_CONNECTORS];
	bool att_py[STORM_C + STORM_PY];
	char stop[128], hung[1024] = "";
	int failed = 0, python = 0, fd;
	long long deadline;
	pthread_t storm;
	dlpc_client *c;
	struct mgr m;

	mgr_init(&m, false, 0);
	mgr_start(&m);
	storm_sock = m.sock;
	snprintf(stop, sizeof(stop), "%s/stop-connectors", m.dir);
	for (int i = 0; i < STORM_CONNECTORS; i++)
		conn[i] = spawn(storm_connector, stop);
	ck_assert_int_eq(pthread_create(&storm, NULL, storm_signals, &m.pid), 0);
	/* the attaches start during the storm, a C one and a Python one in turn */
	for (int i = 0; i < STORM_C + STORM_PY; i++) {
		att[i] = -1;
		if (i % 2)
			att[i] = storm_python();
		att_py[i] = att[i] >= 0;
		python += att_py[i];
		if (att[i] < 0)
			att[i] = spawn(storm_attacher, NULL);
		usleep(STORM_SIGHUPS * STORM_PAUSE_US / (STORM_C + STORM_PY));
	}
	pthread_join(storm, NULL);
	if (!python)
		fprintf(stderr,
			"upgrade storm: skipped: the Python half (dlpack_ipc is not built "
			"or %s is absent); C attaches only\n",
#ifdef DLPC_TEST_PYTHON
			DLPC_TEST_PYTHON
#else
			"python3"
#endif
		);
	c = storm_publish(&m);
	/* the storm is over: the connectors stop too, and every process has the same bound */
	fd = open(stop, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
	ck_assert_int_ge(fd, 0);
	close(fd);
	deadline = now_ms() + scaled_ms(STORM_END_MS);
	for (int i = 0; i < STORM_C + STORM_PY + STORM_CONNECTORS; i++) {
		bool attacher = i < STORM_C + STORM_PY;
		pid_t pid = attacher ? att[i] : conn[i - STORM_C - STORM_PY];
		char what[64];
		int r;

		snprintf(what, sizeof(what), "storm %s %d",
			 attacher ? (att_py[i] ? "Python attacher" : "C attacher") : "connector",
			 attacher ? i : i - STORM_C - STORM_PY);
		r = wait_child_until(pid, deadline, what);
		failed += r != 0;
		if (r < 0)
			snprintf(hung + strlen(hung), sizeof(hung) - strlen(hung), "%s%s (pid %d)",
				 hung[0] ? ", " : "", what, (int)pid);
	}
	fprintf(stderr,
		"upgrade storm: %d of %d waiting attaches (%d Python) and %d connectors failed\n",
		failed, STORM_C + STORM_PY, python, STORM_CONNECTORS);
	ck_assert_log(&m, waitpid(m.pid, NULL, WNOHANG) == 0, "dlpackd died in the storm");
	ck_assert_log(&m, !hung[0], "still running %d s after the publish (killed): %s",
		      scaled_ms(STORM_END_MS) / 1000, hung);
	ck_assert_log(&m, failed == 0, "%d processes failed in the upgrade storm", failed);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* ---- forking beside a thread that asserts ---- */

/* Children made while another thread marks Check's points. */
#define BESIDE_CHILDREN 50

/* What the manager's thread does on each notification (mgr_take()'s assertion): mark a point. */
static void *marking(void *arg)
{
	const bool *quit = arg;

	while (!__atomic_load_n(quit, __ATOMIC_ACQUIRE))
		mark_point();
	return NULL;
}

static int ends_at_once(void *arg)
{
	(void)arg;
	return 0;
}

/* spawn() while another thread of the test marks Check's points, as the upgrade storm spawns its
 * attachers while the manager's thread takes notifications: every child ends. A child that
 * called Check itself waited forever for its lock, taken by that thread at the fork. */
START_TEST(test_spawn_beside_asserting_thread)
{
	pid_t pids[BESIDE_CHILDREN];
	long long deadline;
	bool quit = false;
	int failed = 0;
	pthread_t th;

	ck_assert_int_eq(pthread_create(&th, NULL, marking, &quit), 0);
	/* spaced as the storm spaces its attachers, so that the thread runs between two forks */
	for (int i = 0; i < BESIDE_CHILDREN; i++) {
		pids[i] = spawn(ends_at_once, NULL);
		usleep(2000);
	}
	__atomic_store_n(&quit, true, __ATOMIC_RELEASE);
	pthread_join(th, NULL);
	deadline = now_ms() + scaled_ms(10000);
	for (int i = 0; i < BESIDE_CHILDREN; i++) {
		char what[64];

		snprintf(what, sizeof(what), "child %d", i);
		failed += wait_child_until(pids[i], deadline, what) != 0;
	}
	ck_assert_msg(failed == 0,
		      "%d of %d children spawned beside a thread that asserts failed or hung",
		      failed, BESIDE_CHILDREN);
}
END_TEST

/* ---- hostile state journals ---- */

/* A memfd holding the bytes of (@p name, @p gen), sealed as a publish seals it, or not. */
static int storage_fd(const char *name, uint64_t gen, bool seal)
{
	static float v[NV];
	int fd = memfd_create("hostile", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	ck_assert_int_ge(fd, 0);
	fill(v, name, gen);
	ck_assert_int_eq(write(fd, v, sizeof(v)), (ssize_t)sizeof(v));
	if (seal)
		ck_assert_int_eq(fcntl(fd, F_ADD_SEALS,
				       F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL),
				 0);
	return fd;
}

struct journal {
	uint8_t *b;
	size_t len;
};

static void jput_raw(struct journal *j, uint16_t kind, const void *payload, size_t len, bool damage)
{
	struct dlpd_rec_hdr h = {.len = (uint32_t)len, .kind = kind, .flags = DLPD_REC_STORED};

	h.check = dlpd_journal_check(kind, h.flags, payload, len) ^ (damage ? 1 : 0);
	j->b = realloc(j->b, j->len + sizeof(h) + len);
	ck_assert_ptr_nonnull(j->b);
	memcpy(j->b + j->len, &h, sizeof(h));
	memcpy(j->b + j->len + sizeof(h), payload, len);
	j->len += sizeof(h) + len;
}

/* A PUT of one float32 tensor of @p nv values in a storage of @p size bytes. */
static void jput(struct journal *j, const char *name, uint64_t sid, uint64_t gen, uint32_t flags,
		 int64_t nv, uint64_t size, bool damage)
{
	Dlpackd__V1__Publish pub = DLPACKD__V1__PUBLISH__INIT;
	Dlpackd__V1__TensorDesc td = DLPACKD__V1__TENSOR_DESC__INIT, *tds[1] = {&td};
	struct dlpd_put_fixed fx = {
		.sid = sid, .generation = gen, .uid = 4242, .pid = 77, .created_ns = 123456789};
	size_t plen;
	uint8_t *buf;

	td.dtype_code = kDLFloat;
	td.dtype_bits = 32;
	td.dtype_lanes = 1;
	td.n_shape = 1;
	td.shape = &nv;
	pub.name.data = (uint8_t *)name;
	pub.name.len = strlen(name);
	pub.flags = flags;
	pub.device_type = kDLCPU;
	pub.storage_size = size;
	pub.n_tensors = 1;
	pub.tensors = tds;
	plen = dlpackd__v1__publish__get_packed_size(&pub);
	buf = malloc(sizeof(fx) + plen);
	ck_assert_ptr_nonnull(buf);
	memcpy(buf, &fx, sizeof(fx));
	dlpackd__v1__publish__pack(&pub, buf + sizeof(fx));
	jput_raw(j, DLPD_REC_PUT, buf, sizeof(fx) + plen, damage);
	free(buf);
}

/* A memfd holding @p j behind a header of @p epoch (@p magic: a right one or not). */
static int journal_fd(const struct journal *j, uint64_t epoch, bool magic)
{
	struct dlpd_journal_hdr h = {.journal_gen = epoch};
	int fd = memfd_create("journal", MFD_CLOEXEC);

	memcpy(h.magic, magic ? DLPD_JOURNAL_MAGIC : "NOTOURS!", sizeof(h.magic));
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(write(fd, &h, sizeof(h)), (ssize_t)sizeof(h));
	if (j->len)
		ck_assert_int_eq(write(fd, j->b, j->len), (ssize_t)j->len);
	return fd;
}

static void store_put(struct mgr *m, int fd, const char *fmt, uint64_t num)
{
	pthread_mutex_lock(&m->mu);
	m->store[m->nstore].fd = fd;
	snprintf(m->store[m->nstore].name, sizeof(m->store[0].name), fmt, num);
	m->nstore++;
	pthread_mutex_unlock(&m->mu);
}

static bool stored(struct mgr *m, const char *name)
{
	bool found = false;

	pthread_mutex_lock(&m->mu);
	while (mgr_take(m, 0))
		;
	for (size_t i = 0; i < m->nstore && !found; i++)
		found = strcmp(m->store[i].name, name) == 0;
	pthread_mutex_unlock(&m->mu);
	return found;
}

/* Every kind of bad record is refused alone, with its reason; the good entry comes back with
 * its owner, generation and time; what no good record claims leaves the store. */
START_TEST(test_hostile_journal)
{
	static const struct {
		const char *name, *reason;
	} refused[] = {
		{"bad/size", "holds 4096 bytes, the tensors need 8192"},
		{"bad/unsealed", "is not sealed against resizing"},
		{"bad/shape", "do not fit an aligned place"},
		{"bad/flags", "are not those of an entry that outlives"},
		{"bad/missing", "its storage st-6 was not passed back"},
		{"bad/dup", "its storage st-1 belongs to another entry"},
		{"bad/pipe", "not a memfd"},
		{"bad/generation", "bad generation 0"},
	};
	struct journal j = {0};
	struct mgr m;
	dlpc_client *c;
	dlpc_entry_info *e;
	char junk[40];
	int pipefd[2];
	size_t cnt;

	mgr_init(&m, true, STORE_MAX);
	jput(&j, "good/a", 1, 3, 0, NV, NV * 4, false);
	store_put(&m, storage_fd("good/a", 3, true), "st-%llx", 1);
	jput(&j, "bad/size", 2, 1, 0, NV, 2 * NV * 4, false);
	store_put(&m, storage_fd("bad/size", 1, true), "st-%llx", 2);
	jput(&j, "bad/unsealed", 3, 1, 0, NV, NV * 4, false);
	store_put(&m, storage_fd("bad/unsealed", 1, false), "st-%llx", 3);
	jput(&j, "bad/shape", 4, 1, 0, 4 * NV, NV * 4, false);
	store_put(&m, storage_fd("bad/shape", 1, true), "st-%llx", 4);
	jput(&j, "bad/flags", 5, 1, DLPC_PUBLISH_EPHEMERAL, NV, NV * 4, false);
	store_put(&m, storage_fd("bad/flags", 1, true), "st-%llx", 5);
	jput(&j, "bad/missing", 6, 1, 0, NV, NV * 4, false);
	jput(&j, "bad/dup", 1, 1, 0, NV, NV * 4, false);
	jput(&j, "bad/checksum", 8, 1, 0, NV, NV * 4, true);
	store_put(&m, storage_fd("bad/checksum", 1, true), "st-%llx", 8);
	memset(junk, 0xff, sizeof(junk));
	jput_raw(&j, DLPD_REC_PUT, junk, sizeof(junk), false);
	jput(&j, "gone/b", 10, 1, 0, NV, NV * 4, false);
	jput_raw(&j, DLPD_REC_DEL, "gone/b", 6, false);
	store_put(&m, storage_fd("gone/b", 1, true), "st-%llx", 10);
	ck_assert_int_eq(pipe2(pipefd, O_CLOEXEC), 0);
	close(pipefd[1]);
	jput(&j, "bad/pipe", 11, 1, 0, NV, NV * 4, false);
	store_put(&m, pipefd[0], "st-%llx", 11);
	jput(&j, "bad/generation", 12, 0, 0, NV, NV * 4, false);
	store_put(&m, storage_fd("bad/generation", 1, true), "st-%llx", 12);
	store_put(&m, storage_fd("orphan", 1, true), "st-%llx", 0x63);
	/* a record torn by the kill: its header promises more than follows */
	jput(&j, "torn/c", 13, 1, 0, NV, NV * 4, false);
	j.len -= 10;
	store_put(&m, storage_fd("torn/c", 1, true), "st-%llx", 13);
	store_put(&m, journal_fd(&j, 7, true), "state-%llx", 7);
	/* a newer journal that is not one: the older one is used */
	store_put(&m, journal_fd(&j, 8, false), "state-%llx", 8);
	free(j.b);

	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	ck_assert_dlpc(dlpc_list(c, NULL, &e, &cnt), 0);
	ck_assert_log(&m, cnt == 1, "%zu entries restored, expected good/a alone", cnt);
	ck_assert_str_eq(e[0].name, "good/a");
	ck_assert_uint_eq(e[0].generation, 3);
	ck_assert_uint_eq(e[0].owner_uid, 4242);
	ck_assert_int_eq(e[0].owner_pid, 77);
	ck_assert_int_eq(e[0].created_ns, 123456789);
	dlpc_list_free(e, cnt);
	ck_assert_int_eq(attach_check(c, "good/a"), 3);
	for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
		char line[128];

		snprintf(line, sizeof(line), "not restoring '%s'", refused[i].name);
		ck_assert_log(&m, log_has(m.log, line) && log_has(m.log, refused[i].reason),
			      "%s: no line saying '%s'", refused[i].name, refused[i].reason);
	}
	ck_assert_log(&m,
		      log_has(m.log, "is damaged") && log_has(m.log, "cannot be decoded") &&
			      log_has(m.log, "more than the journal holds") &&
			      log_has(m.log, "state-8 is not one of dlpackd's"),
		      "damaged records not reported");
	/* the store keeps good/a's storage and a new journal, nothing else */
	ck_assert_msg(stored(&m, "st-1"), "good/a's storage left the store");
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 1);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STATE), 1);
	ck_assert_msg(stored(&m, "state-9"), "no journal of the next epoch");
	/* and it serves */
	ck_assert_dlpc(publish(c, "new/d", 1, 0), 1);
	ck_assert_uint_eq(check_consistent(c, &m), 2);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* A complete journal of 10 entries and a newer one whose header is right but whose first record
 * is damaged: the newer is skipped, with its reason, and the 10 entries come back. */
START_TEST(test_damaged_newer_journal)
{
	struct journal j = {0}, bad = {0};
	dlpc_entry_info *e;
	struct mgr m;
	dlpc_client *c;
	char name[32];
	size_t cnt;

	mgr_init(&m, true, STORE_MAX);
	for (int i = 0; i < 10; i++) {
		snprintf(name, sizeof(name), "x/%d", i);
		jput(&j, name, (uint64_t)i + 1, 1, 0, NV, NV * 4, false);
		store_put(&m, storage_fd(name, 1, true), "st-%llx", (uint64_t)i + 1);
	}
	store_put(&m, journal_fd(&j, 5, true), "state-%llx", 5);
	/* the same records, the first one's length damaged: nothing after it can be read */
	for (int i = 0; i < 10; i++) {
		snprintf(name, sizeof(name), "x/%d", i);
		jput(&bad, name, (uint64_t)i + 1, 1, 0, NV, NV * 4, false);
	}
	{
		struct dlpd_rec_hdr h;

		memcpy(&h, bad.b, sizeof(h));
		h.len ^= 0x40000000u;
		memcpy(bad.b, &h, sizeof(h));
	}
	store_put(&m, journal_fd(&bad, 6, true), "state-%llx", 6);
	free(j.b);
	free(bad.b);
	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	ck_assert_dlpc(dlpc_list(c, "x/", &e, &cnt), 0);
	dlpc_list_free(e, cnt);
	ck_assert_log(&m, cnt == 10, "%zu of 10 entries restored", cnt);
	for (int i = 0; i < 10; i++) {
		snprintf(name, sizeof(name), "x/%d", i);
		ck_assert_int_eq(attach_check(c, name), 1);
	}
	ck_assert_log(
		&m,
		log_has(m.log, "skipping state journal state-6: the record at byte 16 claims") &&
			log_has(m.log, "from state journal state-5"),
		"the skipped journal and its reason are not logged");
	/* a journal of the next epoch replaces both */
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STATE), 1);
	ck_assert_msg(stored(&m, "state-7"), "no journal of the next epoch");
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* The manager stops reading its notification socket (its queue holds net.unix.max_dgram_qlen
 * datagrams, 10 by default) for longer than DLPD_NOTIFY_WAIT_MS while 30 entries are published,
 * x/0 unpublished and x/1 replaced, then reads again: nothing is given up, and after a kill the
 * restart has exactly what was there (no x/0, x/1 with its new bytes, the 30 new ones). */
START_TEST(test_slow_manager)
{
	long long deadline;
	dlpc_entry_info *e;
	struct mgr m;
	dlpc_client *c;
	char name[32];
	size_t cnt;

	mgr_init(&m, true, STORE_MAX);
	mgr_start(&m);
	c = connect_to(&m);
	ck_assert_dlpc(publish(c, "x/0", 1, 0), 1);
	ck_assert_dlpc(publish(c, "x/1", 1, 0), 1);
	mgr_drain(&m);
	__atomic_store_n(&m.stalled, true, __ATOMIC_RELEASE);
	for (int i = 0; i < 30; i++) {
		snprintf(name, sizeof(name), "fill/%d", i);
		ck_assert_dlpc(publish(c, name, 1, 0), 1);
	}
	ck_assert_dlpc(dlpc_unpublish(c, "x/0"), 0);
	ck_assert_dlpc(publish(c, "x/1", 2, DLPC_PUBLISH_REPLACE), 2);
	/* longer than a notification ever waited */
	usleep((DLPD_NOTIFY_WAIT_MS + 500) * 1000);
	__atomic_store_n(&m.stalled, false, __ATOMIC_RELEASE);
	/* the manager catches up: x/1 and the 30 fill/ storages, and the removal of x/1's first
	 * storage (st-2), the last notification, so that everything before it is in (31 could be
	 * counted before it with st-1 and st-2 still there) */
	deadline = now_ms() + scaled_ms(5000);
	while ((store_count(&m, DLPD_FDNAME_STORAGE) != 31 || stored(&m, "st-2")) &&
	       now_ms() < deadline)
		usleep(10000);
	dlpc_close(c);
	mgr_kill(&m, SIGKILL);
	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	ck_assert_log(&m, attach_check(c, "x/0") == -ENOENT, "x/0, unpublished, came back");
	ck_assert_log(&m, attach_check(c, "x/1") == 2, "x/1 did not come back as replaced");
	ck_assert_dlpc(dlpc_list(c, "fill/", &e, &cnt), 0);
	dlpc_list_free(e, cnt);
	ck_assert_log(&m, cnt == 30, "%zu of 30 entries published meanwhile came back", cnt);
	ck_assert_uint_eq(check_consistent(c, &m), 31);
	ck_assert_log(&m, !log_has(m.log, "cannot hand a storage to the service manager"),
		      "persistence was given up");
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* The fd limit of the daemon whose budget test_full_fd_budget_through_restarts fills. */
#define FULL_NOFILE 256

/* Publish "@p prefix/N" until one is refused; how many were not, and the refusal in *@p r. */
static long publish_until_refused(dlpc_client *c, const char *prefix, int *r)
{
	char name[32];
	long n = 0;

	do {
		snprintf(name, sizeof(name), "%s/%ld", prefix, n);
		*r = publish(c, name, 1, 0);
	} while (*r == 1 && ++n < FULL_NOFILE);
	return n;
}

/* Wait for the store to hold @p n storages; whether it did (within a scaled 10 s). */
static bool store_holds(struct mgr *m, size_t n)
{
	long long deadline = now_ms() + scaled_ms(10000);

	while (store_count(m, DLPD_FDNAME_STORAGE) != n && now_ms() < deadline)
		usleep(10000);
	return store_count(m, DLPD_FDNAME_STORAGE) == n;
}

/*
 * A daemon whose fd budget one uid filled (its share 100%) goes through what a service goes
 * through. An upgrade in place hands every entry over (moving the fds to their slots used to
 * take the fd table past its limit, and the daemon died past its point of no return, losing
 * them all). A service manager that stops reading makes publishes fail for the budget, named,
 * not cut off by a full fd table (the copies of fds waiting for it counted nowhere). A restart
 * with less room restores what its budget holds and still accepts clients.
 */
START_TEST(test_full_fd_budget_through_restarts)
{
	dlpc_stats st = {.size = sizeof(st)};
	dlpc_client *c, *x;
	unsigned before;
	long n, more;
	struct mgr m;
	char name[32];
	int r;

	setenv("DLPACKD_MAX_FD_SHARE_PER_UID", "100", 1);
	mgr_init(&m, true, STORE_MAX);
	m.nofile = FULL_NOFILE;
	mgr_start(&m);
	c = connect_to(&m);
	n = publish_until_refused(c, "full", &r);
	ck_assert_log(&m, r == -EDQUOT && strstr(dlpc_last_error(), "fds of its own"),
		      "publish %ld: %d %s", n, r, dlpc_last_error());
	ck_assert_log(&m, store_holds(&m, (size_t)n), "the store missed storages");
	before = readies(&m);
	ck_assert_int_eq(kill(m.pid, SIGHUP), 0);
	mgr_wait_ready(&m, before + 1);
	ck_assert_log(&m, log_has(m.log, "upgrading: executing"), "no upgrade");
	dlpc_close(c);
	c = connect_to(&m);
	ck_assert_log(&m, check_consistent(c, &m) == (size_t)n, "the upgrade lost entries");
	/* half of them go; the manager stops reading; then publish until refused */
	for (long i = 0; i < n / 2; i++) {
		snprintf(name, sizeof(name), "full/%ld", i);
		ck_assert_dlpc(dlpc_unpublish(c, name), 0);
	}
	ck_assert_log(&m, store_holds(&m, (size_t)(n - n / 2)), "the store kept removed ones");
	__atomic_store_n(&m.stalled, true, __ATOMIC_RELEASE);
	more = publish_until_refused(c, "more", &r);
	ck_assert_log(&m, r == -EDQUOT && strstr(dlpc_last_error(), "fds of its own"),
		      "publish %ld with the manager stalled: %d %s", more, r, dlpc_last_error());
	x = connect_to(&m);
	ck_assert_dlpc(dlpc_stat(x, &st), 0);
	ck_assert_uint_eq(st.protocol_errors, 0);
	dlpc_close(x);
	__atomic_store_n(&m.stalled, false, __ATOMIC_RELEASE);
	ck_assert_log(&m, store_holds(&m, (size_t)(n - n / 2 + more)), "the store missed some");
	dlpc_close(c);
	/* restarted with 80 fds less: it restores what its budget holds, and serves */
	mgr_kill(&m, SIGKILL);
	m.nofile = FULL_NOFILE - 80;
	mgr_start(&m);
	c = connect_to(&m);
	ck_assert_dlpc(dlpc_stat(c, &st), 0);
	fprintf(stderr,
		"restarted at RLIMIT_NOFILE %d: %llu of %ld storages restored, budget %llu\n",
		FULL_NOFILE - 80, (unsigned long long)st.storages, n - n / 2 + more,
		(unsigned long long)st.fd_budget);
	ck_assert_uint_gt(st.storages, 0);
	ck_assert_uint_le(st.storages, st.fd_budget);
	ck_assert(log_has(m.log, "not restoring"));
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
	unsetenv("DLPACKD_MAX_FD_SHARE_PER_UID");
}
END_TEST

/* In a child, as nobody: publish and unpublish DLPD_NOTIFY_QUEUE_MAX entries, one after the
 * other, while the manager does not read. */
static int nobody_churns(void *arg)
{
	const struct mgr *m = arg;
	dlpc_client *c;
	char name[32];

	CHILD_CHECK(setgroups(0, NULL) == 0);
	CHILD_CHECK(setgid(65534) == 0 && setuid(65534) == 0);
	CHILD_CHECK(dlpc_connect(m->sock, &c) == 0);
	for (int i = 0; i < DLPD_NOTIFY_QUEUE_MAX; i++) {
		snprintf(name, sizeof(name), "churn/%d", i);
		CHILD_CHECK(publish(c, name, 1, 0) == 1);
		CHILD_CHECK(dlpc_unpublish(c, name) == 0);
	}
	dlpc_close(c);
	return 0;
}

/* Another user publishes and unpublishes in a loop while the manager reads slowly: a storage
 * whose FDSTORE=1 has not left when it goes leaves nothing behind (neither its FDSTORE nor an
 * FDSTOREREMOVE waits for the manager), so the backlog does not grow with the churn and never
 * ends persistence for everyone; what root published before and meanwhile survives a kill. */
START_TEST(test_churn_while_manager_slow)
{
	long long deadline;
	char last[32];
	struct mgr m;
	dlpc_client *c;

	mgr_init(&m, true, STORE_MAX);
	mgr_start(&m);
	c = connect_to(&m);
	ck_assert_dlpc(publish(c, "keep/0", 1, 0), 1);
	mgr_drain(&m);
	__atomic_store_n(&m.stalled, true, __ATOMIC_RELEASE);
	ck_assert_int_eq(wait_child(spawn(nobody_churns, &m)), 0);
	ck_assert_dlpc(publish(c, "keep/1", 1, 0), 1);
	__atomic_store_n(&m.stalled, false, __ATOMIC_RELEASE);
	/* keep/1's storage, the last of a fresh daemon's (keep/0 had 1, the churn the next
	 * DLPD_NOTIFY_QUEUE_MAX), goes after everything before it: once it is in the store, the
	 * store holds what the daemon meant it to */
	snprintf(last, sizeof(last), DLPD_FDNAME_STORAGE "%x", 2 + DLPD_NOTIFY_QUEUE_MAX);
	deadline = now_ms() + scaled_ms(10000);
	while (!stored(&m, last)) {
		ck_assert_log(&m, now_ms() < deadline, "%s never reached the store", last);
		usleep(10000);
	}
	ck_assert_log(&m, !log_has(m.log, "cannot hand a storage to the service manager"),
		      "persistence was given up");
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 2);
	dlpc_close(c);
	mgr_kill(&m, SIGKILL);
	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	ck_assert_log(&m, attach_check(c, "keep/0") == 1, "keep/0 did not come back");
	ck_assert_log(&m, attach_check(c, "keep/1") == 1, "keep/1 did not come back");
	ck_assert_uint_eq(stat_or_die(c).entries, 2);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* An upgrade refused because the manager did not take what waited for it (SIGHUP while it does
 * not read) has said RELOADING=1: it says READY=1 after it too, so the manager, once it reads
 * again, does not hold the service as reloading for good; the daemon goes on serving. */
START_TEST(test_refused_upgrade_says_ready)
{
	long long deadline;
	unsigned ready = 0, reloads = 0;
	struct mgr m;
	dlpc_client *c;
	char name[32];

	mgr_init(&m, true, STORE_MAX);
	mgr_start(&m);
	c = connect_to(&m);
	mgr_drain(&m);
	__atomic_store_n(&m.stalled, true, __ATOMIC_RELEASE);
	for (int i = 0; i < 20; i++) {
		snprintf(name, sizeof(name), "x/%d", i);
		ck_assert_dlpc(publish(c, name, 1, 0), 1);
	}
	ck_assert_int_eq(kill(m.pid, SIGHUP), 0);
	deadline = now_ms() + scaled_ms(15000);
	while (!log_has(m.log, "not upgrading: the service manager did not take"))
		ck_assert_log(&m, now_ms() < deadline, "the upgrade was not refused");
	__atomic_store_n(&m.stalled, false, __ATOMIC_RELEASE);
	deadline = now_ms() + scaled_ms(5000);
	while (now_ms() < deadline) {
		pthread_mutex_lock(&m.mu);
		while (mgr_take(&m, 0))
			;
		ready = m.readies;
		reloads = m.reloads;
		pthread_mutex_unlock(&m.mu);
		if (reloads == 1 && ready == 2)
			break;
		usleep(10000);
	}
	ck_assert_log(&m, reloads == 1 && ready == 2,
		      "%u RELOADING=1 and %u READY=1 (one at start) told the manager", reloads,
		      ready);
	ck_assert_int_eq(attach_check(c, "x/19"), 1);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* A manager that stops reading for good: once DLPD_NOTIFY_QUEUE_MAX notifications wait, the
 * daemon gives up persisting, and the journal it gave up on, still in the store (its removal
 * never reached the manager), is never restored: nothing comes back, not even an entry
 * unpublished after the daemon gave up. */
START_TEST(test_given_up_journal)
{
	dlpc_stats st;
	struct mgr m;
	dlpc_client *c;
	char name[32];

	/* every publish of this one uid goes to the store (its share is a quarter by default) */
	setenv("DLPACKD_MAX_FD_SHARE_PER_UID", "100", 1);
	mgr_init(&m, true, STORE_MAX);
	mgr_start(&m);
	c = connect_to(&m);
	ck_assert_dlpc(publish(c, "gone/0", 1, 0), 1);
	mgr_drain(&m);
	__atomic_store_n(&m.stalled, true, __ATOMIC_RELEASE);
	for (int i = 0; i < DLPD_NOTIFY_QUEUE_MAX + 20; i++) {
		snprintf(name, sizeof(name), "many/%d", i);
		ck_assert_dlpc(publish(c, name, 1, 0), 1);
	}
	ck_assert_dlpc(dlpc_unpublish(c, "gone/0"), 0);
	dlpc_close(c);
	mgr_kill(&m, SIGKILL);
	__atomic_store_n(&m.stalled, false, __ATOMIC_RELEASE);
	mgr_drain(&m);
	ck_assert_log(&m, log_has(m.log, "cannot hand a storage to the service manager"),
		      "persistence was not given up");
	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	st = stat_or_die(c);
	ck_assert_log(&m, st.entries == 0, "%llu entries came back from a journal given up",
		      (unsigned long long)st.entries);
	ck_assert_log(&m, log_has(m.log, "was given up by the daemon that wrote it"),
		      "the given-up journal is not named");
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
	unsetenv("DLPACKD_MAX_FD_SHARE_PER_UID");
}
END_TEST

/* Storages without any journal that reads: all closed and dropped, the daemon serves empty. */
START_TEST(test_no_journal)
{
	struct journal j = {0};
	struct mgr m;
	dlpc_client *c;
	dlpc_stats st;

	mgr_init(&m, true, STORE_MAX);
	jput(&j, "a", 1, 1, 0, NV, NV * 4, false);
	store_put(&m, storage_fd("a", 1, true), "st-%llx", 1);
	store_put(&m, storage_fd("b", 1, true), "st-%llx", 2);
	store_put(&m, journal_fd(&j, 1, false), "state-%llx", 1);
	free(j.b);
	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	st = stat_or_die(c);
	ck_assert_uint_eq(st.entries, 0);
	ck_assert_uint_eq(st.storages, 0);
	ck_assert(log_has(m.log, "2 storages were passed without a state journal that reads"));
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 0);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STATE), 1);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* After a restart: the daemon at @p m lists exactly @p want[0..n-1] under @p prefix, in order;
 * the generation of each where @p gens is not NULL, the owner of the first where @p uid0 >= 0. */
static void restored_are(struct mgr *m, const char *prefix, const char *const *want,
			 const uint64_t *gens, size_t n, long uid0)
{
	dlpc_entry_info *e;
	dlpc_client *c = connect_to(m);
	size_t cnt;

	ck_assert_dlpc(dlpc_list(c, prefix, &e, &cnt), 0);
	ck_assert_uint_eq(cnt, n);
	for (size_t i = 0; i < n; i++) {
		ck_assert_str_eq(e[i].name, want[i]);
		if (gens)
			ck_assert_uint_eq(e[i].generation, gens[i]);
	}
	if (uid0 >= 0)
		ck_assert_uint_eq(e[0].owner_uid, (uid_t)uid0);
	dlpc_list_free(e, cnt);
	dlpc_close(c);
}

/* A store of 5 fds keeps 3 storages (2 are the journal's): the fourth and fifth entries are
 * served but not kept, with a warning; once one kept entry is removed, the next one is kept. */
START_TEST(test_store_full)
{
	struct mgr m;
	dlpc_client *c;
	char name[32];

	/* one uid may fill the whole store here (its share is a quarter by default) */
	setenv("DLPACKD_MAX_FD_SHARE_PER_UID", "100", 1);
	mgr_init(&m, true, 5);
	mgr_start(&m);
	c = connect_to(&m);
	for (int i = 0; i < 5; i++) {
		snprintf(name, sizeof(name), "full/%d", i);
		ck_assert_dlpc(publish(c, name, 1, 0), 1);
	}
	ck_assert_log(&m, log_has(m.log, "the fd store is full (5 fds"), "no warning");
	ck_assert_dlpc(dlpc_unpublish(c, "full/0"), 0);
	ck_assert_dlpc(publish(c, "full/5", 1, 0), 1);
	dlpc_close(c);
	mgr_kill(&m, SIGKILL);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 3);
	mgr_start(&m);
	restored_are(&m, "full/", (const char *const[]){"full/1", "full/2", "full/5"}, NULL, 3, -1);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
	unsetenv("DLPACKD_MAX_FD_SHARE_PER_UID");
}
END_TEST

/* As uid nobody: publish "nobody/0" .. "nobody/7" on the daemon at @p arg, each served. */
static int publish_as_nobody(void *arg)
{
	const struct mgr *m = arg;
	dlpc_client *c;
	char name[32];

	become_nobody();
	CHILD_CHECK(dlpc_connect(m->sock, &c) == 0);
	for (int i = 0; i < 8; i++) {
		snprintf(name, sizeof(name), "nobody/%d", i);
		CHILD_CHECK(publish(c, name, 1, 0) == 1);
	}
	dlpc_close(c);
	return 0;
}

/* As uid nobody, after a restart that brought its 2 stored entries back: "nobody/8", served. */
static int publish_one_more_as_nobody(void *arg)
{
	const struct mgr *m = arg;
	dlpc_client *c;

	become_nobody();
	CHILD_CHECK(dlpc_connect(m->sock, &c) == 0);
	CHILD_CHECK(publish(c, "nobody/8", 1, 0) == 1);
	dlpc_close(c);
	return 0;
}

/* A store of 10 fds keeps 8 storages, a quarter of them (2, --max-fd-share-per-uid 25) for each
 * uid: nobody publishes 8 lasting entries, which fit the store, and only 2 are kept, with a
 * warning naming the uid and the share; root's 2 are kept after them, and a SIGKILL brings back
 * those 4 (before: nobody's 8 took every slot and root's were lost at the restart). Then, with
 * the counts rebuilt from what came back: nobody's next entry is not kept; root's REPLACE at
 * its share is (the storage it replaces gives up its place); an entry unpublished while
 * attached leaves the store with its name, so root's next one is kept in its place. */
START_TEST(test_store_share_per_uid)
{
	DLManagedTensorVersioned *t;
	struct mgr m;
	dlpc_client *c;

	mgr_init(&m, true, 10);
	mgr_start(&m);
	ck_assert_int_eq(chmod(m.sock, 0666), 0);
	ck_assert_int_eq(wait_child(spawn(publish_as_nobody, &m)), 0);
	ck_assert_log(&m,
		      log_has(m.log, "uid 65534 holds 2 entries in the fd store, its share "
				     "(25% of 8 slots, --max-fd-share-per-uid)"),
		      "no warning");
	c = connect_to(&m);
	ck_assert_dlpc(publish(c, "root/0", 1, 0), 1);
	ck_assert_dlpc(publish(c, "root/1", 1, 0), 1);
	dlpc_close(c);
	mgr_kill(&m, SIGKILL);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 4);
	mgr_start(&m);
	restored_are(&m, "", (const char *const[]){"nobody/0", "nobody/1", "root/0", "root/1"},
		     NULL, 4, 65534);
	c = connect_to(&m);
	/* the restart counted what came back: nobody's next entry is served, not kept */
	ck_assert_int_eq(wait_child(spawn(publish_one_more_as_nobody, &m)), 0);
	/* at its share, root's REPLACE is kept (the old storage's place is the new one's) */
	ck_assert_dlpc(publish(c, "root/0", 2, DLPC_PUBLISH_REPLACE), 2);
	/* an entry removed while attached leaves the store with its name: its place is free */
	ck_assert_dlpc(dlpc_attach(c, "root/1", NULL, &t), 1);
	ck_assert_dlpc(dlpc_unpublish(c, "root/1"), 0);
	ck_assert_dlpc(publish(c, "root/2", 1, 0), 1);
	t->deleter(t);
	dlpc_close(c);
	mgr_kill(&m, SIGKILL);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 4);
	mgr_start(&m);
	restored_are(&m, "", (const char *const[]){"nobody/0", "nobody/1", "root/0", "root/2"},
		     (const uint64_t[]){1, 1, 2, 1}, 4, 65534);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* A daemon under a file size limit (RLIMIT_FSIZE, `ulimit -f`, LimitFSIZE=) smaller than its
 * state journal: the journal's write past the limit fails (EFBIG, not the SIGXFSZ that would
 * kill the daemon), persistence stops with a message, the journal leaves the store, and every
 * publish is still served. A restart then brings nothing back, rather than a journal that
 * stopped halfway. */
START_TEST(test_journal_past_file_size_limit)
{
	dlpc_entry_info *e;
	struct mgr m;
	dlpc_client *c;
	char name[32];
	size_t cnt;

	mgr_init(&m, true, STORE_MAX);
	m.fsize = 8192;
	mgr_start(&m);
	c = connect_to(&m);
	for (int i = 0; i < 200; i++) {
		snprintf(name, sizeof(name), "fsize/%d", i);
		ck_assert_dlpc(publish(c, name, 1, 0), 1);
	}
	/* (the log, a file here, is cut short by the same limit: the status tells) */
	mgr_drain(&m);
	pthread_mutex_lock(&m.mu);
	ck_assert_str_eq(m.status, "entries no longer persisted: cannot write the state journal");
	pthread_mutex_unlock(&m.mu);
	ck_assert_dlpc(dlpc_list(c, "fsize/", &e, &cnt), 0);
	ck_assert_uint_eq(cnt, 200);
	dlpc_list_free(e, cnt);
	dlpc_close(c);
	mgr_kill(&m, SIGKILL);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STATE), 0);
	m.fsize = 0;
	mgr_start(&m);
	c = connect_to(&m);
	ck_assert_dlpc(dlpc_list(c, "fsize/", &e, &cnt), 0);
	ck_assert_uint_eq(cnt, 0);
	dlpc_list_free(e, cnt);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 0);
	mgr_clear(&m);
}
END_TEST

/* The length of the newest journal in the store, and its name in @p name. */
static off_t journal_len(struct mgr *m, char *name, size_t len)
{
	uint64_t best = 0;
	off_t size = -1;

	mgr_drain(m);
	pthread_mutex_lock(&m->mu);
	for (size_t i = 0; i < m->nstore; i++) {
		uint64_t epoch;
		struct stat st;

		if (sscanf(m->store[i].name, DLPD_FDNAME_STATE "%" SCNx64, &epoch) != 1 ||
		    epoch <= best || fstat(m->store[i].fd, &st) < 0)
			continue;
		best = epoch;
		size = st.st_size;
		snprintf(name, len, "%s", m->store[i].name);
	}
	pthread_mutex_unlock(&m->mu);
	ck_assert_msg(size >= 0, "no state journal in the store");
	return size;
}

/* An unpublish whose record sets off the journal's rewrite, while a reference still holds the
 * storage in the store: the rewritten journal leaves the entry out, and a restart does not
 * bring it back. */
START_TEST(test_compaction_on_removal)
{
	char keep[DLPC_NAME_MAX + 1], before[64], after[64];
	DLManagedTensorVersioned *held;
	dlpc_entry_info *e;
	dlpc_client *c, *reader;
	off_t len, put = 0;
	size_t cnt, del;
	uint64_t gen = 1;
	struct mgr m;

	mgr_init(&m, true, STORE_MAX);
	mgr_start(&m);
	c = connect_to(&m);
	reader = connect_to(&m);
	/* a long name: its DEL record is longer than a PUT of "f" */
	memset(keep, 'k', 200);
	keep[200] = '\0';
	del = sizeof(struct dlpd_rec_hdr) + strlen(keep);
	ck_assert_dlpc(publish(c, keep, 1, 0), 1);
	ck_assert_dlpc(dlpc_attach(reader, keep, NULL, &held), 1);
	ck_assert_dlpc(publish(c, "f", gen, 0), 1);
	/* replaces of "f" grow the journal, one PUT each, up to just short of a rewrite */
	len = journal_len(&m, before, sizeof(before));
	for (;;) {
		off_t now;

		ck_assert_dlpc(publish(c, "f", ++gen, DLPC_PUBLISH_REPLACE), (int)gen);
		now = journal_len(&m, after, sizeof(after));
		ck_assert_str_eq(after, before);
		put = now - len;
		len = now;
		if (len + put >= (off_t)DLPD_JOURNAL_COMPACT_MIN)
			break;
	}
	ck_assert_uint_ge(del, (size_t)put);
	ck_assert_int_ge(len + (off_t)del, (off_t)DLPD_JOURNAL_COMPACT_MIN);
	ck_assert_dlpc(dlpc_unpublish(c, keep), 0);
	/* the DEL set off the rewrite: a journal of the next epoch, with one live record */
	len = journal_len(&m, after, sizeof(after));
	ck_assert_log(&m, strcmp(after, before) != 0, "the unpublish did not rewrite %s", before);
	ck_assert_int_lt(len, 4096);
	/* the reference keeps the storage, but not in the store: no name reaches it */
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 1);
	mgr_kill(&m, SIGKILL);
	held->deleter(held);
	dlpc_close(reader);
	dlpc_close(c);

	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	ck_assert_int_eq(
		dlpc_attach(c, keep, &(dlpc_attach_opts){.size = sizeof(dlpc_attach_opts)}, &held),
		-ENOENT);
	ck_assert_dlpc(dlpc_list(c, NULL, &e, &cnt), 0);
	ck_assert_uint_eq(cnt, 1);
	ck_assert_str_eq(e[0].name, "f");
	ck_assert_uint_eq(e[0].generation, gen);
	dlpc_list_free(e, cnt);
	ck_assert_int_eq(attach_check(c, "f"), (int64_t)gen);
	/* the storage only the dead reference held was closed and left the store */
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 1);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* With a store, an upgrade while a reference holds the storage of an unpublished entry: that
 * storage leaves the store (its connection ends with the exec), and storage ids are never
 * given twice, so an entry published after the upgrade comes back after a kill with its own
 * bytes. Then the daemon started with the store off takes the entries back and empties it. */
START_TEST(test_upgrade_held_storage)
{
	DLManagedTensorVersioned *held;
	dlpc_entry_info *e;
	dlpc_client *c, *reader;
	unsigned before;
	struct mgr m;
	size_t cnt;

	mgr_init(&m, true, STORE_MAX);
	mgr_start(&m);
	c = connect_to(&m);
	reader = connect_to(&m);
	ck_assert_dlpc(publish(c, "a", 1, 0), 1);
	ck_assert_dlpc(publish(c, "b", 1, 0), 1);
	ck_assert_dlpc(dlpc_attach(reader, "b", NULL, &held), 1);
	ck_assert_dlpc(dlpc_unpublish(c, "b"), 0);
	mgr_drain(&m);
	/* b's storage, held by the reference, left the store with its name */
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 1);
	before = readies(&m);
	ck_assert_int_eq(kill(m.pid, SIGHUP), 0);
	mgr_wait_ready(&m, before + 1);
	mgr_drain(&m);
	/* a's storage only */
	ck_assert_log(&m, store_count(&m, DLPD_FDNAME_STORAGE) == 1,
		      "%zu storages in the store after the upgrade, not 1",
		      store_count(&m, DLPD_FDNAME_STORAGE));
	held->deleter(held);
	dlpc_close(reader);
	dlpc_close(c);
	c = connect_to(&m);
	ck_assert_dlpc(publish(c, "c", 7, 0), 1);
	dlpc_close(c);
	mgr_kill(&m, SIGKILL);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 2);

	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	ck_assert_int_eq(attach_check(c, "a"), 1);
	/* published as generation 1 with the bytes of "c" at 7 */
	ck_assert_int_eq(dlpc_attach(c, "c", NULL, &held), 1);
	{
		static float want[NV];

		fill(want, "c", 7);
		ck_assert_int_eq(memcmp(held->dl_tensor.data, want, sizeof(want)), 0);
	}
	held->deleter(held);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);

	/* the store off: what it passes comes back, and it is emptied */
	m.store_off = true;
	mgr_start(&m);
	mgr_drain(&m);
	c = connect_to(&m);
	ck_assert_dlpc(dlpc_list(c, NULL, &e, &cnt), 0);
	ck_assert_uint_eq(cnt, 2);
	dlpc_list_free(e, cnt);
	ck_assert_int_eq(attach_check(c, "a"), 1);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 0);
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STATE), 0);
	dlpc_close(c);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
}
END_TEST

/* A daemon that bound a relative path keeps its lock across an upgrade: a second daemon on the
 * path is refused, and the stop removes the socket. */
START_TEST(test_upgrade_relative_path)
{
	char cmd[512];
	unsigned before;
	dlpc_client *c;
	struct mgr m;

	mgr_init(&m, false, 0);
	m.relative = true;
	mgr_start(&m);
	c = connect_to(&m);
	ck_assert_dlpc(publish(c, "r", 1, 0), 1);
	dlpc_close(c);
	before = readies(&m);
	ck_assert_int_eq(kill(m.pid, SIGHUP), 0);
	mgr_wait_ready(&m, before + 1);
	c = connect_to(&m);
	ck_assert_int_eq(attach_check(c, "r"), 1);
	dlpc_close(c);
	snprintf(cmd, sizeof(cmd), "cd %s && %s --socket dlpackd.sock >%s/second.log 2>&1", m.dir,
		 DLPACKD_BIN, m.dir);
	ck_assert_int_ne(system(cmd), 0);
	snprintf(cmd, sizeof(cmd), "%s/second.log", m.dir);
	ck_assert_msg(log_has(cmd, "already running"),
		      "a second daemon was not refused by the lock");
	mgr_kill(&m, SIGTERM);
	ck_assert_msg(access(m.sock, F_OK) != 0, "the upgraded daemon left its socket behind");
	mgr_clear(&m);
}
END_TEST

/* ---- CUDA entries, against the fake driver ---- */

static const char *gpu_sock;

static void fill_dev(float *p, float base)
{
	for (int i = 0; i < NV; i++)
		p[i] = base + (float)i;
}

static int vmm_publisher(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	int64_t n = NV;
	dlpc_client *c;

	(void)arg;
	CHILD_CHECK(dlpc_connect(gpu_sock, &c) == 0);
	CHILD_CHECK(dlpc_alloc(c, (DLDevice){kDLCUDA, 0}, (DLDataType){kDLFloat, 32, 1}, 1, &n,
			       &t) == 0);
	fill_dev(t->dl_tensor.data, 5.0f);
	CHILD_CHECK(dlpc_publish(c, "gpu/vmm", t, 0) == 1);
	dlpc_close(c);
	return 0;
}

static int vmm_reader(void *arg)
{
	DLManagedTensorVersioned *t = NULL;
	float want[NV];
	dlpc_client *c;

	(void)arg;
	fill_dev(want, 5.0f);
	CHILD_CHECK(dlpc_connect(gpu_sock, &c) == 0);
	CHILD_CHECK(dlpc_attach(c, "gpu/vmm", NULL, &t) == 1);
	CHILD_CHECK(t->dl_tensor.device.device_type == kDLCUDA);
	CHILD_CHECK(memcmp(t->dl_tensor.data, want, sizeof(want)) == 0);
	t->deleter(t);
	dlpc_close(c);
	return 0;
}

/* Publishes gpu/ipc from cuMemAlloc memory (legacy IPC), says so on fds[1], stays until
 * fds[0] reads end of file (fds[2] and fds[3]: the parent's ends). */
static int ipc_publisher(void *arg)
{
	int *fds = arg;
	DLManagedTensorVersioned *t;
	int64_t shape[1] = {NV};
	CUdeviceptr p;
	dlpc_client *c;
	char b;

	close(fds[2]);
	close(fds[3]);
	CHILD_CHECK(dlpc_connect(gpu_sock, &c) == 0);
	CHILD_CHECK(cuInit(0) == CUDA_SUCCESS);
	CHILD_CHECK(cuMemAlloc(&p, NV * sizeof(float)) == CUDA_SUCCESS);
	fill_dev((float *)(uintptr_t)p, 9.0f);
	t = host_tensor((void *)(uintptr_t)p, (DLDataType){kDLFloat, 32, 1}, 1, shape, NULL, NULL);
	t->dl_tensor.device = (DLDevice){kDLCUDA, 0};
	CHILD_CHECK(dlpc_publish(c, "gpu/ipc", t, 0) == 1);
	CHILD_CHECK(write(fds[1], "P", 1) == 1);
	while (read(fds[0], &b, 1) > 0)
		;
	dlpc_close(c);
	return 0;
}

START_TEST(test_gpu_entries)
{
	char logpath[128];
	int to_child[2], from_child[2], fds[4];
	DLManagedTensorVersioned *t = NULL;
	struct mgr m;
	dlpc_client *c;
	unsigned before;
	pid_t ipc;
	char b;

	mgr_init(&m, true, STORE_MAX);
	snprintf(logpath, sizeof(logpath), "%s/fake_cuda.log", m.dir);
	setenv("FAKE_CUDA_LOG", logpath, 1);
	setenv(DLPC_CUDA_LIBRARY_ENV, FAKE_CUDA_LIB, 1);
	gpu_sock = m.sock;
	mgr_start(&m);
	ck_assert_int_eq(wait_child(spawn(vmm_publisher, NULL)), 0);
	ck_assert_int_eq(pipe2(to_child, O_CLOEXEC), 0);
	ck_assert_int_eq(pipe2(from_child, O_CLOEXEC), 0);
	fds[0] = to_child[0];
	fds[1] = from_child[1];
	fds[2] = to_child[1];
	fds[3] = from_child[0];
	ipc = spawn(ipc_publisher, fds);
	close(to_child[0]);
	close(from_child[1]);
	ck_assert_int_eq(read(from_child[0], &b, 1), 1);
	mgr_drain(&m);
	/* the VMM export is in the store; legacy IPC has no fd to keep */
	ck_assert_uint_eq(store_count(&m, DLPD_FDNAME_STORAGE), 1);

	mgr_kill(&m, SIGKILL);
	mgr_start(&m);
	ck_assert_int_eq(wait_child(spawn(vmm_reader, NULL)), 0);
	c = connect_to(&m);
	ck_assert_dlpc(dlpc_attach(c, "gpu/ipc", NULL, &t), -ENOENT);
	dlpc_close(c);

	before = readies(&m);
	ck_assert_int_eq(kill(m.pid, SIGHUP), 0);
	mgr_wait_ready(&m, before + 1);
	ck_assert_int_eq(wait_child(spawn(vmm_reader, NULL)), 0);
	c = connect_to(&m);
	ck_assert_uint_eq(check_consistent_gpu(c), 1);
	dlpc_close(c);
	close(to_child[1]);
	ck_assert_int_eq(wait_child(ipc), 0);
	close(from_child[0]);
	mgr_kill(&m, SIGTERM);
	mgr_clear(&m);
	unsetenv(DLPC_CUDA_LIBRARY_ENV);
}
END_TEST

/* ---- dlpackctl upgrade of a daemon of another build ---- */

static volatile sig_atomic_t hup_seen;

static void on_hup(int sig)
{
	(void)sig;
	hup_seen = 1;
}

/* A stand-in for a dlpackd of another build on socket @p path: it answers HELLO with another
 * protocol minor until it gets SIGHUP (an upgrade's signal), then as an image of this build, and
 * answers that connection's STAT as a new image does (uptime 0, 3 entries). It writes a byte to
 * @p ready once it listens. */
struct other_build {
	const char *path;
	int ready;
	bool restarted; /* after SIGHUP, answer STAT as another daemon (another pid) would */
};

static int other_build_daemon(void *arg)
{
	const struct other_build *o = arg;
	struct sigaction sa = {.sa_handler = on_hup}; /* no SA_RESTART: accept() sees EINTR */
	struct sockaddr_un un = {.sun_family = AF_UNIX};
	int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	CHILD_CHECK(sigaction(SIGHUP, &sa, NULL) == 0 && lfd >= 0);
	snprintf(un.sun_path, sizeof(un.sun_path), "%s", o->path);
	CHILD_CHECK(bind(lfd, (struct sockaddr *)&un, sizeof(un)) == 0 && listen(lfd, 8) == 0);
	CHILD_CHECK(write(o->ready, "r", 1) == 1);
	for (;;) {
		Dlpackd__V1__HelloReply hr = DLPACKD__V1__HELLO_REPLY__INIT;
		Dlpackd__V1__StatReply sr = DLPACKD__V1__STAT_REPLY__INIT;
		int fd = accept(lfd, NULL, NULL);
		struct dlpc__hdr h;
		uint8_t buf[4096];
		bool upgraded;

		if (fd < 0 && errno == EINTR)
			continue;
		CHILD_CHECK(fd >= 0);
		/* dlpackctl's look at who listens sends nothing */
		if (raw_recv(fd, &h, buf, sizeof(buf)) == 0) {
			close(fd);
			continue;
		}
		CHILD_CHECK(h.type == DLPC_MSG_HELLO);
		upgraded = hup_seen;
		hr.version_major = DLPC_PROTO_MAJOR;
		hr.version_minor = upgraded ? DLPC_PROTO_MINOR : DLPC_PROTO_MINOR - 1;
		hr.server = "dlpackd of another build";
		hr.max_frame = DLPC_FRAME_MAX;
		raw_send(fd, DLPC_MSG_HELLO | DLPC_MSG_REPLY, h.id, &hr.base, NULL, 0);
		if (upgraded) {
			CHILD_CHECK(raw_recv(fd, &h, buf, sizeof(buf)) == 1 &&
				    h.type == DLPC_MSG_STAT);
			sr.daemon_pid = (uint32_t)(o->restarted ? getppid() : getpid());
			sr.entries = 3;
			raw_send(fd, DLPC_MSG_STAT | DLPC_MSG_REPLY, h.id, &sr.base, NULL, 0);
		}
		CHILD_CHECK(raw_recv(fd, &h, buf, sizeof(buf)) == 0);
		close(fd);
		if (upgraded)
			return 0;
	}
}

/* dlpackctl upgrade is how a daemon of another build (another protocol version, which this
 * dlpackctl cannot talk to) is replaced: it says so, signals it all the same, and waits for an
 * image it can talk to. It used to fail at connecting. Where another pid answers after the
 * signal (a restart by the service manager, not an upgrade in place), it fails saying so. */
START_TEST(test_upgrade_other_version)
{
	char dir[] = "/tmp/dlpc-upgrade-XXXXXX", sock[64], out[64], cmd[512], text[2048] = "",
	     want[128], b;
	struct other_build o;
	int ready[2], r;
	pid_t pid;
	FILE *f;

	ck_assert_ptr_nonnull(mkdtemp(dir));
	snprintf(sock, sizeof(sock), "%s/other.sock", dir);
	snprintf(out, sizeof(out), "%s/ctl.out", dir);
	ck_assert_int_eq(pipe2(ready, O_CLOEXEC), 0);
	o.path = sock;
	o.ready = ready[1];
	o.restarted = _i == 1;
	pid = spawn(other_build_daemon, &o);
	close(ready[1]);
	ck_assert_int_eq(read(ready[0], &b, 1), 1);
	close(ready[0]);
	snprintf(cmd, sizeof(cmd), "%s --socket %s upgrade >%s 2>&1", DLPACKCTL_BIN, sock, out);
	r = system(cmd);
	f = fopen(out, "r");
	ck_assert_ptr_nonnull(f);
	text[fread(text, 1, sizeof(text) - 1, f)] = '\0';
	fclose(f);
	snprintf(want, sizeof(want), "dlpackd at %s speaks %d.%d;", sock, DLPC_PROTO_MAJOR,
		 DLPC_PROTO_MINOR - 1);
	ck_assert_msg(strstr(text, want), "%s", text);
	if (o.restarted) {
		ck_assert_msg(r != 0, "dlpackctl upgrade: %s", text);
		snprintf(want, sizeof(want), "dlpackd pid %d is gone; pid %d answers", (int)pid,
			 (int)getpid());
		ck_assert_msg(strstr(text, want), "%s", text);
		ck_assert_msg(strstr(text, "not an upgrade in place"), "%s", text);
	} else {
		ck_assert_msg(r == 0, "dlpackctl upgrade: %s", text);
		ck_assert_msg(strstr(text, "upgraded in place from another protocol version: 3 "
					   "entries"),
			      "%s", text);
	}
	ck_assert_int_eq(wait_child(pid), 0);
	unlink(out);
	unlink(sock);
	rmdir(dir);
}
END_TEST

static Suite *durability_suite(void)
{
	Suite *s = suite_create("durability");
	TCase *tc = tcase_create("store");

	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_kill_under_load);
	tcase_add_test(tc, test_upgrade_under_load);
	tcase_add_test(tc, test_upgrade_then_kill);
	tcase_add_test(tc, test_hostile_journal);
	tcase_add_test(tc, test_no_journal);
	tcase_add_test(tc, test_gpu_entries);
	tcase_add_test(tc, test_store_full);
	tcase_add_test(tc, test_store_share_per_uid);
	tcase_add_test(tc, test_compaction_on_removal);
	tcase_add_test(tc, test_upgrade_held_storage);
	tcase_add_test(tc, test_upgrade_relative_path);
	tcase_add_loop_test(tc, test_upgrade_other_version, 0, 2);
	tcase_add_test(tc, test_journal_past_file_size_limit);
	suite_add_tcase(s, tc);
	/* upgrades, restores and a slow service manager (CK_RUN_CASE=resilience) */
	tc = tcase_create("resilience");
	tcase_set_timeout(tc, 120);
	tcase_add_test(tc, test_upgrade_storm);
	tcase_add_test(tc, test_spawn_beside_asserting_thread);
	tcase_add_test(tc, test_damaged_newer_journal);
	tcase_add_test(tc, test_slow_manager);
	tcase_add_test(tc, test_full_fd_budget_through_restarts);
	tcase_add_test(tc, test_churn_while_manager_slow);
	tcase_add_test(tc, test_refused_upgrade_says_ready);
	tcase_add_test(tc, test_given_up_journal);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return run_suite(durability_suite());
}
