/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The input format of the state-journal fuzz target (fuzz_journal.c), shared with its seed
 * generator (mkjournal.c).
 *
 *   byte 0     control: bits 0-2 how many storages are passed with the journal (st-1 to st-N),
 *              bits 3-4 what they are (enum fuzz_journal_fd), bit 5 "pass an older journal
 *              too" (state-1, the same records, with a sound header), bit 6 "damage the newest
 *              journal's header", bit 7 "pass an fd whose name is not one of dlpackd's"
 *   records    each: a control byte (bits 0-1: 0 PUT, 1 DEL, 2 a kind dlpackd does not know,
 *              3 raw bytes written as they are, no record header; bit 2 DLPD_REC_STORED;
 *              bit 3 "a wrong check"), 2 bytes little-endian length, the payload (cut short
 *              at the end of the input). The target writes each record's header and check, so
 *              that what the fuzzer varies is what a check cannot refuse: the payloads (a PUT's
 *              dlpd_put_fixed and packed Publish, a DEL's name) and the records' order.
 *
 * The newest journal is state-2; its bytes are a dlpd_journal_hdr (epoch 2) and the records.
 */
#ifndef DLPC_FUZZ_JOURNAL_H
#define DLPC_FUZZ_JOURNAL_H

#define FJ_STORAGES_MASK 0x07
#define FJ_KIND_SHIFT 3
#define FJ_OLDER 0x20
#define FJ_BAD_HEADER 0x40
#define FJ_FOREIGN 0x80

#define FJ_REC_PUT 0
#define FJ_REC_DEL 1
#define FJ_REC_UNKNOWN 2
#define FJ_REC_RAW 3
#define FJ_REC_STORED 0x04
#define FJ_REC_BAD_CHECK 0x08

/* What the passed storages are. */
enum fuzz_journal_fd {
	FJ_FD_MEMFD_RO,	  /* sealed memfd, as a read-only entry's storage */
	FJ_FD_MEMFD_RW,	  /* sealed memfd without a write seal, as a WRITABLE entry's */
	FJ_FD_MEMFD_BARE, /* memfd with no seals */
	FJ_FD_PIPE,	  /* read end of a pipe */
	FJ_FD_KINDS
};

/* Size of the storages: what a PUT's storage_size should say. */
#define FJ_STORAGE_SIZE 65536

#endif
