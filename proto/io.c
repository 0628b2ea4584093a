/* SPDX-License-Identifier: Apache-2.0 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "io.h"
#include "util.h"

#define RX_MIN DLPC_RX_BUF_SIZE

/*
 * The most fds one sendmsg() can carry (the kernel's SCM_MAX_FD). The control buffer of one
 * recvmsg() has room for all of them, not only for a frame's: the fds that do not fit are
 * dropped by the kernel in the receiving thread, and dropping the last reference of one can
 * block it (a TCP socket lingering with a full send queue). Those that arrive are closed
 * through the closer (dlpc__set_closer()).
 */
#define RX_FDS_MAX 253

/* The control buffer of one recvmsg() (CMSG_SPACE may round it up). */
union ctl_buf {
	struct cmsghdr align;
	char buf[CMSG_SPACE(sizeof(int) * RX_FDS_MAX)];
};
/* fds that fit in it: fewer arriving with MSG_CTRUNC means the kernel could not install them */
#define CTL_ROOM ((sizeof(union ctl_buf) - CMSG_LEN(0)) / sizeof(int))

void dlpc__close(int fd)
{
	int saved = errno;

	if (fd >= 0)
		close(fd);
	errno = saved;
}

static void (*closer)(int fd) = dlpc__close;

void dlpc__set_closer(void (*fn)(int fd))
{
	closer = fn ? fn : dlpc__close;
}

/* fds from a peer (or duplicates of ours): closing one may take long, so it goes through the
 * closer the program chose */
static void close_fds(const int *fds, unsigned n)
{
	for (unsigned i = 0; i < n; i++)
		if (fds[i] >= 0)
			closer(fds[i]);
}

void dlpc__rx_init(struct dlpc__rx *rx)
{
	memset(rx, 0, sizeof(*rx));
	rx->want = DLPC_FRAME_HDR_SIZE;
	rx->cap_max = SIZE_MAX;
}

void dlpc__rx_clear(struct dlpc__rx *rx)
{
	bool report = rx->report_lost_fds;

	for (unsigned b = 0; b < rx->nbatch; b++)
		close_fds(rx->batch[b].fds, rx->batch[b].n);
	free(rx->buf);
	dlpc__rx_init(rx);
	rx->report_lost_fds = report; /* the owner's choice outlives the buffer */
}

void dlpc__rx_release(struct dlpc__rx *rx)
{
	if (rx->end > rx->start)
		return;
	free(rx->buf);
	rx->buf = NULL;
	rx->cap = rx->start = rx->end = 0;
}

bool dlpc__rx_partial(const struct dlpc__rx *rx)
{
	return rx->end > rx->start || rx->nbatch > 0;
}

unsigned dlpc__rx_fds(const struct dlpc__rx *rx)
{
	unsigned n = 0;

	for (unsigned b = 0; b < rx->nbatch; b++)
		n += rx->batch[b].n;
	return n;
}

/* Make room for rx->want unparsed bytes (at least one more than we have) to read into; no
 * fewer than RX_MIN unless rx->cap_max allows no more. */
static int rx_reserve(struct dlpc__rx *rx)
{
	size_t have = rx->end - rx->start;
	size_t need = rx->want > have ? rx->want : have + 1;

	if (need > rx->cap && need > rx->cap_max)
		return -EDQUOT;
	if (need < RX_MIN) {
		size_t floor = RX_MIN < rx->cap_max ? RX_MIN : rx->cap_max;

		if (need < floor)
			need = floor;
	}
	if (have == 0) {
		rx->start = rx->end = 0;
		if (rx->cap > RX_MIN && need == RX_MIN) {
			free(rx->buf);
			rx->buf = NULL;
			rx->cap = 0;
		}
	}
	if (rx->start > 0 && rx->cap - rx->start < need) {
		memmove(rx->buf, rx->buf + rx->start, have);
		rx->start = 0;
		rx->end = have;
	}
	if (rx->cap < need) {
		uint8_t *p = realloc(rx->buf, need);

		if (!p)
			return -ENOMEM;
		rx->buf = p;
		rx->cap = need;
	}
	return 0;
}

ssize_t dlpc__rx_read(struct dlpc__rx *rx, int sock, char *why, size_t whylen)
{
	return dlpc__rx_read_flags(rx, sock, 0, why, whylen);
}

ssize_t dlpc__rx_read_flags(struct dlpc__rx *rx, int sock, int flags, char *why, size_t whylen)
{
	union ctl_buf ctl;
	struct iovec iov;
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
	int fds[RX_FDS_MAX];
	unsigned nfds = 0;
	ssize_t n;
	int r;

	r = rx_reserve(rx);
	if (r < 0)
		return r;
	iov.iov_base = rx->buf + rx->end;
	iov.iov_len = rx->cap - rx->end;
	msg.msg_control = ctl.buf;
	msg.msg_controllen = sizeof(ctl.buf);
	do
		n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno == EWOULDBLOCK ? -EAGAIN : -errno;

	for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		unsigned k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (unsigned i = 0; i < k && nfds < sizeof(fds) / sizeof(fds[0]); i++)
			memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
	}
	if (msg.msg_flags & MSG_CTRUNC) {
		/* A full control buffer means the peer sent more fds than a message may carry; one
		 * with room left means the kernel could not install them here (no free fd). */
		bool lost = rx->report_lost_fds && nfds < CTL_ROOM;

		close_fds(fds, nfds);
		if (!lost) {
			snprintf(why, whylen, "control data truncated (%u fds arrived)", nfds);
			return -EPROTO;
		}
		nfds = 0;
		if (rx->nbatch == DLPC_RX_BATCH_MAX) {
			snprintf(why, whylen, "fds arrived faster than frames claimed them");
			return -EPROTO;
		}
		rx->batch[rx->nbatch++] = (struct dlpc__fdbatch){
			.lost = true, .end = rx->off + (rx->end - rx->start) + (size_t)n};
	}
	if (nfds > DLPC_FRAME_FDS_MAX) {
		close_fds(fds, nfds);
		snprintf(why, whylen, "more than %d fds in one message (%u)", DLPC_FRAME_FDS_MAX,
			 nfds);
		return -EPROTO;
	}
	if (nfds > 0) {
		if (rx->nbatch == DLPC_RX_BATCH_MAX) {
			close_fds(fds, nfds);
			snprintf(why, whylen, "fds arrived faster than frames claimed them");
			return -EPROTO;
		}
		struct dlpc__fdbatch *b = &rx->batch[rx->nbatch++];
		memcpy(b->fds, fds, nfds * sizeof(int));
		b->n = nfds;
		b->lost = false;
		b->end = rx->off + (rx->end - rx->start) + (size_t)n;
	}
	rx->end += (size_t)n;
	return n;
}

int dlpc__rx_next(struct dlpc__rx *rx, struct dlpc__frame *f, char *why, size_t whylen)
{
	size_t have = rx->end - rx->start;
	struct dlpc__hdr h;
	int r;

	f->nfds = 0;
	f->lost = 0;
	if (rx->nbatch > 0 && rx->batch[0].end <= rx->off) {
		snprintf(why, whylen, "%u fds arrived without a frame to carry them",
			 rx->batch[0].n);
		return -EPROTO;
	}
	if (have < DLPC_FRAME_HDR_SIZE) {
		rx->want = DLPC_FRAME_HDR_SIZE;
		return 0;
	}
	dlpc__hdr_decode(rx->buf + rx->start, &h);
	r = dlpc__hdr_check(&h);
	if (r == -EMSGSIZE) {
		snprintf(why, whylen, "frame of %u bytes exceeds the limit of %u", h.len,
			 DLPC_FRAME_MAX);
		return r;
	}
	if (r < 0) {
		snprintf(why, whylen, "bad frame header (%u fds, flags 0x%x)", h.nfds, h.flags);
		return r;
	}
	if (have < DLPC_FRAME_HDR_SIZE + (size_t)h.len) {
		rx->want = DLPC_FRAME_HDR_SIZE + (size_t)h.len;
		return 0;
	}
	if (h.nfds > 0 && rx->nbatch > 0 && rx->batch[0].lost) {
		f->lost = h.nfds;
		rx->nbatch--;
		memmove(&rx->batch[0], &rx->batch[1], rx->nbatch * sizeof(rx->batch[0]));
	} else if (h.nfds > 0) {
		if (rx->nbatch == 0 || rx->batch[0].n != h.nfds) {
			snprintf(why, whylen, "frame declares %u fds but %u arrived with it",
				 h.nfds, rx->nbatch ? rx->batch[0].n : 0);
			return -EPROTO;
		}
		memcpy(f->fds, rx->batch[0].fds, h.nfds * sizeof(int));
		f->nfds = h.nfds;
		rx->nbatch--;
		memmove(&rx->batch[0], &rx->batch[1], rx->nbatch * sizeof(rx->batch[0]));
	}
	f->hdr = h;
	f->payload = rx->buf + rx->start + DLPC_FRAME_HDR_SIZE;
	rx->start += DLPC_FRAME_HDR_SIZE + (size_t)h.len;
	rx->off += DLPC_FRAME_HDR_SIZE + (uint64_t)h.len;
	rx->want = DLPC_FRAME_HDR_SIZE;
	return 1;
}

int dlpc__frame_take_fd(struct dlpc__frame *f, unsigned i)
{
	int fd = f->fds[i];

	f->fds[i] = -1;
	return fd;
}

void dlpc__frame_clear(struct dlpc__frame *f)
{
	close_fds(f->fds, f->nfds);
	f->nfds = 0;
}

struct dlpc__txchunk {
	struct dlpc__txchunk *next;
	size_t len, sent;
	int fds[DLPC_FRAME_FDS_MAX];
	unsigned nfds; /* fds still to send with the chunk's first byte */
	uint8_t data[];
};

void dlpc__tx_init(struct dlpc__tx *tx)
{
	tx->head = NULL;
	tx->tail = &tx->head;
	tx->bytes = 0;
	tx->nfds = 0;
	tx->fds_room = UINT32_MAX;
	tx->fds_sent = 0;
}

static void chunk_free(struct dlpc__txchunk *c)
{
	close_fds(c->fds, c->nfds);
	free(c);
}

void dlpc__tx_clear(struct dlpc__tx *tx)
{
	while (tx->head) {
		struct dlpc__txchunk *c = tx->head;

		tx->head = c->next;
		chunk_free(c);
	}
	dlpc__tx_init(tx);
}

/* One sendmsg(): the fds go with the first byte. Returns bytes written or negative errno. */
static ssize_t send_some(int sock, const uint8_t *p, size_t len, const int *fds, unsigned nfds,
			 int flags)
{
	union {
		struct cmsghdr align;
		char buf[CMSG_SPACE(sizeof(int) * DLPC_FRAME_FDS_MAX)];
	} ctl;
	struct iovec iov = {.iov_base = (void *)p, .iov_len = len};
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
	ssize_t n;

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
	do
		n = sendmsg(sock, &msg, MSG_NOSIGNAL | flags);
	while (n < 0 && errno == EINTR);
	if (n < 0)
		return errno == EWOULDBLOCK ? -EAGAIN : -errno;
	return n;
}

/* @p n fds went out: counted, and taken off the room. */
static void sent_fds(struct dlpc__tx *tx, unsigned n)
{
	tx->fds_sent += n;
	if (tx->fds_room != UINT32_MAX)
		tx->fds_room -= n;
}

bool dlpc__tx_held(const struct dlpc__tx *tx)
{
	return tx->head && tx->head->nfds > tx->fds_room;
}

int dlpc__tx_flush(struct dlpc__tx *tx, int sock)
{
	while (tx->head) {
		struct dlpc__txchunk *c = tx->head;
		ssize_t n;

		if (c->nfds > tx->fds_room)
			return 0;
		n = send_some(sock, c->data + c->sent, c->len - c->sent, c->fds, c->nfds, 0);
		if (n == -ETOOMANYREFS) {
			tx->fds_room = 0;
			return 0;
		}
		if (n == -EAGAIN)
			return 0;
		if (n < 0)
			return (int)n;
		close_fds(c->fds, c->nfds);
		sent_fds(tx, c->nfds);
		tx->nfds -= c->nfds;
		c->nfds = 0;
		c->sent += (size_t)n;
		tx->bytes -= (size_t)n;
		if (c->sent < c->len)
			continue;
		tx->head = c->next;
		if (!tx->head)
			tx->tail = &tx->head;
		free(c);
	}
	return 1;
}

int dlpc__tx_send(struct dlpc__tx *tx, int sock, const void *data, size_t len, const int *fds,
		  unsigned nfds)
{
	struct dlpc__txchunk *c;
	size_t sent = 0;

	if (!tx->head && nfds <= tx->fds_room) {
		ssize_t n = send_some(sock, data, len, fds, nfds, 0);

		if (n == -ETOOMANYREFS)
			tx->fds_room = 0;
		else if (n < 0 && n != -EAGAIN)
			return (int)n;
		if (n > 0) {
			sent = (size_t)n;
			sent_fds(tx, nfds);
			nfds = 0; /* they went with the first byte */
		}
		if (sent == len)
			return 0;
	}
	c = malloc(sizeof(*c) + len - sent);
	if (!c)
		return -ENOMEM;
	c->next = NULL;
	c->len = len - sent;
	c->sent = 0;
	c->nfds = 0;
	memcpy(c->data, (const uint8_t *)data + sent, len - sent);
	for (; c->nfds < nfds; c->nfds++) {
		c->fds[c->nfds] = fcntl(fds[c->nfds], F_DUPFD_CLOEXEC, 3);
		if (c->fds[c->nfds] < 0) {
			int r = -errno;

			chunk_free(c);
			return r;
		}
	}
	*tx->tail = c;
	tx->tail = &c->next;
	tx->bytes += c->len;
	tx->nfds += c->nfds;
	return 0;
}

int dlpc__send_counted(int sock, const void *data, size_t len, const int *fds, unsigned nfds,
		       size_t *sent)
{
	return dlpc__send_within(sock, data, len, fds, nfds, 0, NULL, NULL, sent);
}

int dlpc__send_within(int sock, const void *data, size_t len, const int *fds, unsigned nfds,
		      int64_t timeout_ms, bool (*stop)(void *), void *arg, size_t *sent)
{
	const uint8_t *p = data;
	int64_t now = dlpc__mono_ms(), deadline = INT64_MAX;
	bool polled;

	/* (a bound past the clock's end is none) */
	if (timeout_ms > 0 && timeout_ms <= INT64_MAX - now)
		deadline = now + timeout_ms;
	/* with neither a bound nor stop(): plain blocking writes (SO_SNDTIMEO, if any, applies) */
	polled = deadline != INT64_MAX || stop;
	*sent = 0;
	while (len > 0) {
		ssize_t n = send_some(sock, p, len, fds, nfds, polled ? MSG_DONTWAIT : 0);
		struct pollfd pfd = {.fd = sock, .events = POLLOUT};
		int64_t left;

		if (n == -EAGAIN && polled) {
			/* one deadline for the whole frame: a peer that reads a little at a time
			 * cannot stretch it; stop() is asked at least every DLPC_SEND_CHECK_MS */
			left = deadline - dlpc__mono_ms();
			if (left <= 0)
				return -EAGAIN;
			if (stop && stop(arg))
				return -ECANCELED;
			if (stop && left > DLPC_SEND_CHECK_MS)
				left = DLPC_SEND_CHECK_MS;
			if (poll(&pfd, 1, left > INT32_MAX ? INT32_MAX : (int)left) < 0 &&
			    errno != EINTR)
				return -errno;
			continue;
		}
		if (n < 0)
			return (int)n;
		nfds = 0;
		p += n;
		len -= (size_t)n;
		*sent += (size_t)n;
	}
	return 0;
}

int dlpc__send_all(int sock, const void *data, size_t len, const int *fds, unsigned nfds)
{
	size_t sent;

	return dlpc__send_counted(sock, data, len, fds, nfds, &sent);
}
