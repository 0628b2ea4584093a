/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The input format of the daemon fuzz target, shared with the seed corpus generator.
 *
 * An input is a sequence of chunks; each becomes one sendmsg() from a client into the daemon:
 *
 *   byte 0     control: bits 0-2 the number of fds to attach (0-7: more than
 *              DLPC_FRAME_FDS_MAX truncates the daemon's control buffer), bit 3 "let the
 *              daemon run before the next chunk", bit 4 "shut down the client's side after it",
 *              bit 5 "and do not read its replies meanwhile" (they pile up in its send queue:
 *              the daemon's socket buffer is small), bit 6 "wait 2 ms first" (short ATTACH
 *              timeouts expire)
 *   bytes      one kind byte per fd (enum fuzz_fd, modulo FUZZ_FD_KINDS)
 *   2 bytes    little-endian length of the data
 *   data       the bytes sent (cut short at the end of the input)
 */
#ifndef DLPC_FUZZ_DAEMON_H
#define DLPC_FUZZ_DAEMON_H

#define FUZZ_NFDS_MASK 0x07
#define FUZZ_RUN 0x08
#define FUZZ_SHUTDOWN 0x10
#define FUZZ_HOLD 0x20
#define FUZZ_WAIT 0x40

/* Synthetic fds an input can attach. */
enum fuzz_fd {
	FUZZ_FD_MEMFD_RO,     /* sealed memfd, acceptable for a read-only entry */
	FUZZ_FD_MEMFD_RW,     /* sealed memfd without a write seal, acceptable for WRITABLE */
	FUZZ_FD_MEMFD_BARE,   /* memfd with no seals */
	FUZZ_FD_MEMFD_NOSEAL, /* sealed memfd whose seals are not final */
	FUZZ_FD_PIPE,	      /* read end of a pipe */
	FUZZ_FD_FILE,	      /* regular file on a disk filesystem */
	FUZZ_FD_DEVNULL,      /* a character device */
	FUZZ_FD_SOCKET,	      /* one end of a socketpair */
	FUZZ_FD_KINDS
};

/* Size of the synthetic memfds: the largest storage_size a publish can get through with. */
#define FUZZ_MEMFD_SIZE 65536

#endif
