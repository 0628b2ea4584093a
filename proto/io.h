/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Layer 2: byte and fd buffers over a SOCK_STREAM Unix socket. Knows frame boundaries (through
 * frame.h) but nothing of protobuf.
 *
 * Receiving: fds arrive with the recvmsg() that returns the first byte of the frame they belong
 * to, and Linux never returns fds of two sendmsg() calls in one recvmsg(). So each read yields at
 * most one batch of fds, tagged with the stream offset where that read ended. A frame that starts
 * at offset o and declares n fds takes the oldest batch, which must hold exactly n fds and must
 * have arrived after o; a batch that arrived before the frame now being parsed belongs to no
 * frame. Either is a protocol violation.
 */
#ifndef DLPC_PROTO_IO_H
#define DLPC_PROTO_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "frame.h"

/* fd batches that may be pending at once: the current frame's and the next one's. */
#define DLPC_RX_BATCH_MAX 2

struct dlpc__fdbatch {
	int fds[DLPC_FRAME_FDS_MAX];
	unsigned n;
	uint64_t end; /* stream offset just past the read that brought them */
	bool lost;    /* the kernel could not install them here (see report_lost_fds); n is 0 */
};

struct dlpc__rx {
	uint8_t *buf;
	size_t cap, start, end; /* unparsed bytes are buf[start..end) */
	size_t want;		/* bytes the next frame needs, counted from start */
	uint64_t off;		/* stream offset of buf[start] */
	struct dlpc__fdbatch batch[DLPC_RX_BATCH_MAX];
	unsigned nbatch;
	/*
	 * Set by an owner that can live with it (libdlpc; never the daemon): fds the peer sent
	 * but the kernel could not install in this process, because it has no free fd
	 * (MSG_CTRUNC with room left in the control buffer), are reported on the frame that
	 * declared them (dlpc__frame.lost) instead of failing the read. The bytes arrived all the
	 * same, so the stream stays intact. Left false, any truncation is a protocol violation.
	 */
	bool report_lost_fds;
	/*
	 * The most the buffer may grow to (SIZE_MAX after init: no bound). A read that would need
	 * a larger buffer reads nothing and fails with -EDQUOT. The daemon sets it before each
	 * read from what the sending uid may still buffer (--max-pending-bytes-per-uid).
	 */
	size_t cap_max;
};

/* One received frame. It owns its fds: take one with dlpc__frame_take_fd(); clearing the frame
 * closes the rest. The payload points into the rx buffer and is valid until the next
 * dlpc__rx_read() on it. */
struct dlpc__frame {
	struct dlpc__hdr hdr;
	const uint8_t *payload;
	int fds[DLPC_FRAME_FDS_MAX];
	unsigned nfds;
	unsigned lost; /* fds the frame declared that never arrived (report_lost_fds); nfds is 0 */
};

void dlpc__rx_init(struct dlpc__rx *rx);
/* Free the buffer and close every fd still queued (report_lost_fds is kept). */
void dlpc__rx_clear(struct dlpc__rx *rx);
/* Free the buffer if it holds no unparsed byte (a later read allocates it again). */
void dlpc__rx_release(struct dlpc__rx *rx);
/* Does the buffer hold part of a frame (bytes or fds not yet claimed)? */
bool dlpc__rx_partial(const struct dlpc__rx *rx);
/* The fds received and not yet claimed by a complete frame (at most DLPC_RX_BATCH_MAX *
 * DLPC_FRAME_FDS_MAX). */
unsigned dlpc__rx_fds(const struct dlpc__rx *rx);
/*
 * One recvmsg() into the buffer. Returns the bytes read, 0 at end of stream, -EAGAIN, another
 * negative errno from recvmsg(), or -EPROTO when the control data was truncated or fds piled up
 * (the fds that did arrive are closed; @p why says what happened). With rx->report_lost_fds, a
 * truncation that left room in the control buffer (this process is out of fds) is no error:
 * what arrived is closed and the frame is later returned with its @c lost count set.
 */
ssize_t dlpc__rx_read(struct dlpc__rx *rx, int sock, char *why, size_t whylen);
/* dlpc__rx_read() with more recvmsg() @p flags (MSG_DONTWAIT: -EAGAIN when nothing is there). */
ssize_t dlpc__rx_read_flags(struct dlpc__rx *rx, int sock, int flags, char *why, size_t whylen);
/*
 * Take the next complete frame: 1 and @p f filled, 0 if more bytes are needed, or -EMSGSIZE /
 * -EPROTO for a bad header or fds that do not match it (@p why says which).
 */
int dlpc__rx_next(struct dlpc__rx *rx, struct dlpc__frame *f, char *why, size_t whylen);

/* Take fd @p i out of @p f (the frame no longer closes it). */
int dlpc__frame_take_fd(struct dlpc__frame *f, unsigned i);
/* Close the fds @p f still owns. */
void dlpc__frame_clear(struct dlpc__frame *f);

/* Frames waiting to be written to a non-blocking socket. Queued chunks own duplicates of their
 * fds until those have been sent. */
struct dlpc__txchunk;
struct dlpc__tx {
	struct dlpc__txchunk *head, **tail;
	size_t bytes;  /* queued and not yet written */
	unsigned nfds; /* fds queued and not yet sent */
	/*
	 * Set by the owner: how many fds may still be written (UINT32_MAX after init: no bound). A
	 * frame with more is not written but queued, and a flush stops in front of it (returning
	 * 0, as for a full socket); each frame written takes its fds off. Set to 0 here when the
	 * kernel refuses fds in flight (ETOOMANYREFS: the sending user's RLIMIT_NOFILE of them is
	 * in flight): that is the sender's shortage, not a broken connection.
	 */
	uint32_t fds_room;
	uint64_t fds_sent; /* fds written so far, counted for the owner */
};

void dlpc__tx_init(struct dlpc__tx *tx);
void dlpc__tx_clear(struct dlpc__tx *tx);
/*
 * Write a whole frame, or queue what the socket does not take now. @p fds are only borrowed:
 * they are duplicated if they must wait in the queue.
 * @return 0, or a negative errno (the connection is broken).
 */
int dlpc__tx_send(struct dlpc__tx *tx, int sock, const void *data, size_t len, const int *fds,
		  unsigned nfds);
/* Write queued data: 1 if the queue is empty now, 0 if the socket is full (or the next frame
 * carries more fds than fds_room), negative errno. */
int dlpc__tx_flush(struct dlpc__tx *tx, int sock);
/* Is the next frame to write one with more fds than fds_room? */
bool dlpc__tx_held(const struct dlpc__tx *tx);

/* Write a whole frame to a blocking socket. 0 or negative errno. */
int dlpc__send_all(int sock, const void *data, size_t len, const int *fds, unsigned nfds);
/* The same, also telling in @p sent how many bytes went out before a failure. */
int dlpc__send_counted(int sock, const void *data, size_t len, const int *fds, unsigned nfds,
		       size_t *sent);
/* dlpc__send_counted() that gives up with -EAGAIN once @p timeout_ms (> 0; else no bound) have
 * passed since it began, however the peer reads meanwhile (a little at a time restarts no
 * clock), and with -ECANCELED when @p stop (NULL: never), asked with @p arg whenever the peer
 * takes nothing and at least every DLPC_SEND_CHECK_MS while it waits, says so. */
int dlpc__send_within(int sock, const void *data, size_t len, const int *fds, unsigned nfds,
		      int64_t timeout_ms, bool (*stop)(void *), void *arg, size_t *sent);

/* close() that keeps errno and ignores -1. */
void dlpc__close(int fd);
/*
 * Route the closing of fds that came from a peer, or that wait in a send queue, through @p fn
 * (NULL: close at once). Closing such an fd can block: the last close of a large memfd frees
 * its memory, and a file on a stalling filesystem (FUSE) may wait for it. The daemon hands
 * them to a thread.
 */
void dlpc__set_closer(void (*fn)(int fd));

#endif
