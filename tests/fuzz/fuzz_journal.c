/* SPDX-License-Identifier: Apache-2.0 */
/*
 * libFuzzer target: the restore of the state journal (daemon/persist.c), which a restart with
 * systemd's fd store and every upgrade go through: the records replayed, each PUT's Publish
 * unpacked and checked as a publish is, the storages it names claimed. Each input is a journal
 * and the fds passed with it (see fuzz_journal.h); they go to dlpd_persist_restore() on a
 * fresh server, which is then stopped and freed.
 *
 * Besides the sanitizers' verdicts, each input must leave no fd open (the restore owns every
 * fd passed: it keeps or closes each), no libuv handle active, no reference taken, and no
 * storage or byte counted once the registry is freed; any of these aborts.
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "persist.h"
#include "server.h"
#include "fuzz_journal.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static uv_loop_t loop;
static int templates[FJ_FD_KINDS];
static int pipe_write = -1;

static void die(const char *what)
{
	fprintf(stderr, "fuzz_journal: %s\n", what);
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
	int fd = memfd_create("fuzz-storage", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	if (fd < 0 || ftruncate(fd, FJ_STORAGE_SIZE) < 0 ||
	    fallocate(fd, 0, 0, FJ_STORAGE_SIZE) < 0 ||
	    (seals && fcntl(fd, F_ADD_SEALS, seals) < 0))
		die("cannot make a memfd");
	return fd;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	int p[2];

	(void)argc;
	(void)argv;
	if (!getenv("DLPC_FUZZ_LOG"))
		dlpd_log_level = LOG_EMERG - 1; /* silent unless asked */
	else
		dlpd_log_level = LOG_DEBUG;
	/* the restore tells no service manager anything */
	unsetenv("NOTIFY_SOCKET");
	templates[FJ_FD_MEMFD_RO] = memfd(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
	templates[FJ_FD_MEMFD_RW] = memfd(F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
	templates[FJ_FD_MEMFD_BARE] = memfd(0);
	if (pipe2(p, O_CLOEXEC) < 0 || uv_loop_init(&loop) < 0)
		die("cannot make a pipe or a loop");
	templates[FJ_FD_PIPE] = p[0];
	pipe_write = p[1];
	return 0;
}

static void put(int fd, const void *p, size_t len)
{
	if (len && write(fd, p, len) != (ssize_t)len)
		die("cannot write a journal");
}

/* A journal of epoch @p epoch (header damaged if @p bad) holding the records of @p data. */
static int journal(uint64_t epoch, bool bad, const uint8_t *data, size_t size)
{
	static const uint16_t kinds[] = {DLPD_REC_PUT, DLPD_REC_DEL, 3};
	struct dlpd_journal_hdr jh = {.journal_gen = epoch};
	int fd = memfd_create("fuzz-journal", MFD_CLOEXEC);
	size_t i = 0;

	if (fd < 0)
		die("cannot make a journal memfd");
	memcpy(jh.magic, DLPD_JOURNAL_MAGIC, sizeof(jh.magic));
	if (bad)
		jh.magic[7] ^= 1;
	put(fd, &jh, sizeof(jh));
	while (i < size) {
		uint8_t ctl = data[i++];
		size_t len;

		if (size - i < 2)
			break;
		len = (size_t)data[i] | (size_t)data[i + 1] << 8;
		i += 2;
		if (len > size - i)
			len = size - i;
		if ((ctl & 3) != FJ_REC_RAW) {
			struct dlpd_rec_hdr h = {
				.len = (uint32_t)len,
				.kind = kinds[ctl & 3],
				.flags = ctl & FJ_REC_STORED ? DLPD_REC_STORED : 0,
			};

			h.check = dlpd_journal_check(h.kind, h.flags, data + i, len) ^
				  (ctl & FJ_REC_BAD_CHECK ? 1 : 0);
			put(fd, &h, sizeof(h));
		}
		put(fd, data + i, len);
		i += len;
	}
	return fd;
}

static struct dlpd_passed_fd passed(int fd, const char *name)
{
	struct dlpd_passed_fd p = {.fd = fd};

	if (fd < 0)
		die("cannot duplicate a template fd");
	snprintf(p.name, sizeof(p.name), "%s", name);
	return p;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct dlpd_passed_fd fds[FJ_STORAGES_MASK + 3];
	struct dlpd_server srv;
	int before = open_fds();
	size_t n = 0;
	uint8_t ctl;

	if (size == 0)
		return 0;
	ctl = data[0];
	fds[n++] = passed(journal(2, ctl & FJ_BAD_HEADER, data + 1, size - 1), "state-2");
	if (ctl & FJ_OLDER)
		fds[n++] = passed(journal(1, false, data + 1, size - 1), "state-1");
	for (unsigned k = 1; k <= (ctl & FJ_STORAGES_MASK); k++) {
		char name[16];

		snprintf(name, sizeof(name), DLPD_FDNAME_STORAGE "%x", k);
		fds[n++] = passed(fcntl(templates[(ctl >> FJ_KIND_SHIFT) & 3], F_DUPFD_CLOEXEC, 3),
				  name);
	}
	if (ctl & FJ_FOREIGN)
		fds[n++] = passed(fcntl(templates[FJ_FD_PIPE], F_DUPFD_CLOEXEC, 3), "other");

	dlpd_server_init(&srv, &loop, &dlpd_limits);
	if (dlpd_persist_restore(&srv, fds, n) < 0)
		die("the restore ran out of memory");
	if (srv.reg.refs != 0 || srv.reg.waiters != 0)
		die("a restore took references or waiters");
	dlpd_server_stop(&srv);
	for (int turns = 0; uv_loop_alive(&loop); turns++) {
		if (turns == 256)
			die("a libuv handle is still active after the server stopped");
		uv_run(&loop, UV_RUN_NOWAIT);
	}
	dlpd_server_free(&srv);
	if (srv.reg.storages != 0 || srv.reg.bytes != 0)
		die("storages outlived the registry");
	if (open_fds() != before)
		die("file descriptors leaked");
	return 0;
}
