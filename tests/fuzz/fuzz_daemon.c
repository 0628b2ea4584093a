/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libFuzzer target: the daemon's frame parser, protobuf unpacking, dispatch and handlers, run
 * in-process on a real libuv loop. Each input is one client connection over a socketpair (see
 * fuzz_daemon.h for the format); its bytes and synthetic fds go in with sendmsg() exactly as a
 * client's would. After the input the client hangs up and the server state is torn down.
 *
 * Besides the sanitizers' verdicts, each input must leave no fd open, no libuv handle active,
 * and the registry's counters consistent (no reference or waiter outlives its connection, no
 * storage outlives the registry); any of these aborts, so that libFuzzer reports the input.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dispatch.h"
#include "server.h"
#include "fuzz_daemon.h"

/* Loop turns per "run" step: enough to drain every input libFuzzer makes (max_len 64 KiB). */
#define RUN_TURNS 256

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uv_loop_t loop;
static int templates[FUZZ_FD_KINDS];
static int pipe_write = -1, sock_other = -1;

static void die(const char *what)
{
	fprintf(stderr, "fuzz_daemon: %s\n", what);
	abort();
}

static int open_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *de;
	int n = 0;

	if (!d)
		die("cannot open /proc/self/fd");
	while ((de = readdir(d)))
		n += de->d_name[0] != '.';
	closedir(d);
	return n - 1;
}

static int memfd(int seals)
{
	int fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	if (fd < 0 || ftruncate(fd, FUZZ_MEMFD_SIZE) < 0 ||
	    fallocate(fd, 0, 0, FUZZ_MEMFD_SIZE) < 0 ||
	    (seals && fcntl(fd, F_ADD_SEALS, seals) < 0))
		die("cannot make a memfd");
	return fd;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	char path[] = "/tmp/dlpc-fuzz-XXXXXX";
	int p[2], sv[2];

	(void)argc;
	(void)argv;
	signal(SIGPIPE, SIG_IGN);
	if (!getenv("DLPC_FUZZ_LOG"))
		dlpd_log_level = LOG_EMERG - 1; /* silent unless asked */
	else
		dlpd_log_level = LOG_DEBUG;
	templates[FUZZ_FD_MEMFD_RO] =
		memfd(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
	templates[FUZZ_FD_MEMFD_RW] = memfd(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
	templates[FUZZ_FD_MEMFD_BARE] = memfd(0);
	templates[FUZZ_FD_MEMFD_NOSEAL] = memfd(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE);
	if (pipe2(p, O_CLOEXEC) < 0 || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		die("cannot make a pipe or socketpair");
	templates[FUZZ_FD_PIPE] = p[0];
	pipe_write = p[1];
	templates[FUZZ_FD_SOCKET] = sv[0];
	sock_other = sv[1];
	templates[FUZZ_FD_FILE] = mkostemp(path, O_CLOEXEC);
	if (templates[FUZZ_FD_FILE] < 0 || ftruncate(templates[FUZZ_FD_FILE], 4096) < 0)
		die("cannot make a regular file");
	unlink(path);
	templates[FUZZ_FD_DEVNULL] = open("/dev/null", O_RDWR | O_CLOEXEC);
	if (templates[FUZZ_FD_DEVNULL] < 0 || uv_loop_init(&loop) < 0)
		die("cannot open /dev/null or make a loop");
	return 0;
}

/* Read and discard what the daemon sent; fds that came with it are closed. Any progress? */
static bool drain(int sock)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * 64)];
	} ctl;
	static uint8_t buf[1 << 16];
	bool got = false;

	for (;;) {
		struct iovec iov = {.iov_base = buf, .iov_len = sizeof(buf)};
		struct msghdr msg = {.msg_iov = &iov,
				     .msg_iovlen = 1,
				     .msg_control = ctl.buf,
				     .msg_controllen = sizeof(ctl.buf)};
		ssize_t n = recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);

		if (n <= 0)
			return got;
		got = true;
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
			size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);

			if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
				continue;
			for (size_t i = 0; i < k; i++) {
				int fd;

				memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
				close(fd);
			}
		}
	}
}

/* Let the daemon read what is queued for it and answer, until nothing moves. Unless @p read,
 * its replies are left unread. */
static void run(struct dlpd_server *s, int daemon_end, int client, bool read)
{
	for (int i = 0; i < RUN_TURNS; i++) {
		int queued = 0;
		bool got;

		uv_run(&loop, UV_RUN_NOWAIT);
		got = read && drain(client);
		if (s->npeers == 0)
			return;
		if (ioctl(daemon_end, FIONREAD, &queued) < 0)
			queued = 0;
		/* a marked connection is destroyed on the next turn */
		if (queued == 0 && !got && dlpd_list_empty(&s->failed))
			return;
	}
}

/* One sendmsg() of @p len bytes with @p nfds fresh duplicates of the chosen templates. */
static void send_chunk(struct dlpd_server *s, int daemon_end, int client, const uint8_t *p,
		       size_t len, const uint8_t *kinds, unsigned nfds)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * FUZZ_NFDS_MASK)];
	} ctl;
	int fds[FUZZ_NFDS_MASK];
	struct iovec iov = {.iov_base = (void *)p, .iov_len = len};
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
	static const uint8_t zero;

	if (len == 0) {
		/* fds need at least one byte to ride on */
		if (nfds == 0)
			return;
		iov.iov_base = (void *)&zero;
		iov.iov_len = 1;
	}
	for (unsigned i = 0; i < nfds; i++) {
		fds[i] = fcntl(templates[kinds[i] % FUZZ_FD_KINDS], F_DUPFD_CLOEXEC, 3);
		if (fds[i] < 0)
			die("cannot duplicate a template fd");
	}
	if (nfds > 0) {
		struct cmsghdr *c;

		memset(&ctl, 0, sizeof(ctl));
		msg.msg_control = ctl.buf;
		msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
	}
	while (iov.iov_len > 0 && s->npeers > 0) {
		ssize_t n = sendmsg(client, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);

		if (n < 0 && errno == EAGAIN) {
			run(s, daemon_end, client, true);
			continue;
		}
		if (n <= 0)
			break;
		iov.iov_base = (uint8_t *)iov.iov_base + n;
		iov.iov_len -= (size_t)n;
		msg.msg_control = NULL;
		msg.msg_controllen = 0;
	}
	/* the kernel holds its own references to what it carries */
	for (unsigned i = 0; i < nfds; i++)
		close(fds[i]);
}

static uint64_t refs_held(struct dlpd_server *s)
{
	uint64_t n = 0;

	for (struct dlpd_list *l = s->peers.next; l != &s->peers; l = l->next)
		n += dlpd_container_of(l, struct dlpd_peer, link)->held.refs.count;
	return n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct dlpd_server srv;
	int before = open_fds(), sv[2];
	size_t i = 0;

	dlpd_server_init(&srv, &loop, &dlpd_limits);
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) < 0)
		die("cannot make a socketpair");
	/* a small send buffer, so that replies a client does not read soon fill the queue */
	if (setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &(int){4096}, sizeof(int)) < 0 ||
	    !dlpd_peer_new(&srv, sv[0]))
		die("cannot make a peer");

	while (i < size && srv.npeers > 0) {
		uint8_t ctl = data[i++];
		unsigned nfds = ctl & FUZZ_NFDS_MASK;
		const uint8_t *kinds = data + i;
		size_t len;

		if (size - i < nfds + 2)
			break;
		i += nfds;
		len = (size_t)data[i] | (size_t)data[i + 1] << 8;
		i += 2;
		if (len > size - i)
			len = size - i;
		send_chunk(&srv, sv[0], sv[1], data + i, len, kinds, nfds);
		i += len;
		if (ctl & FUZZ_WAIT)
			usleep(2000);
		if (ctl & FUZZ_RUN)
			run(&srv, sv[0], sv[1], !(ctl & FUZZ_HOLD));
		if (ctl & FUZZ_SHUTDOWN)
			break;
	}
	run(&srv, sv[0], sv[1], true);
	/* every reference the registry counts is held by a live connection */
	if (srv.reg.refs != refs_held(&srv))
		die("reference count differs from the references connections hold");

	/* hang up: the daemon must notice and drop the connection by itself */
	shutdown(sv[1], SHUT_WR);
	run(&srv, sv[0], sv[1], true);
	if (srv.npeers != 0)
		die("the daemon kept a connection whose client hung up");
	dlpd_server_stop(&srv);
	for (int turns = 0; uv_loop_alive(&loop); turns++) {
		if (turns == RUN_TURNS)
			die("a libuv handle is still active after the connection closed");
		uv_run(&loop, UV_RUN_NOWAIT);
	}
	if (srv.reg.refs != 0 || srv.reg.waiters != 0 || srv.peers_closing != 0)
		die("references or waiters outlived their connection");
	drain(sv[1]);
	close(sv[1]);
	dlpd_server_free(&srv);
	if (srv.reg.storages != 0 || srv.reg.bytes != 0)
		die("storages outlived the registry");
	if (open_fds() != before)
		die("file descriptors leaked");
	return 0;
}
