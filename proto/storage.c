/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Host storage validation, by dlpackd and by the receivers of direct channels (which take a
 * sender's fd with no daemon between them). Neither maps the memory to judge it; the fd alone
 * proves that attachers can map it safely: a regular file on tmpfs (what memfd_create makes),
 * sealed so that it can neither shrink (a SIGBUS in every attacher) nor grow, sealed against
 * writes unless published writable, with a final seal set (F_SEAL_SEAL: nobody holding the fd
 * can later add a write seal that breaks writable attaches), large enough for the tensors
 * described, and with every page allocated (no attacher is charged for the publisher's pages).
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/vfs.h>

#include "storage.h"

static const char *file_kind(mode_t m)
{
	switch (m & S_IFMT) {
	case S_IFIFO:
		return "a pipe";
	case S_IFSOCK:
		return "a socket";
	case S_IFDIR:
		return "a directory";
	case S_IFCHR:
		return "a character device";
	case S_IFBLK:
		return "a block device";
	case S_IFLNK:
		return "a symbolic link";
	default:
		return "not a regular file";
	}
}

/* Are all the blocks of the file @p st describes allocated (@p bsize: its filesystem's)? */
static bool fully_allocated(const struct stat *st, uint64_t bsize)
{
	uint64_t size = (uint64_t)st->st_size, need;

	if (bsize == 0 || bsize > (1ull << 30))
		bsize = 4096;
	need = size / bsize * bsize + (size % bsize ? bsize : 0);
	return (uint64_t)st->st_blocks * 512 >= need;
}

/* Why @p fd, which F_GET_SEALS just refused (errno still its), cannot be a memfd: its kind, an
 * O_PATH descriptor, or the refusal. -EBADF, the reason in @p why. */
static int not_sealable(int fd, char *why, size_t whylen)
{
	int err = errno, fl;
	struct statx sx;

	/* naming the kind: cached attributes only, still no call into the filesystem */
	if (statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE, &sx) == 0 &&
	    !S_ISREG(sx.stx_mode))
		snprintf(why, whylen, "storage fd is %s, not a memfd", file_kind(sx.stx_mode));
	else if ((fl = fcntl(fd, F_GETFL)) >= 0 && (fl & O_PATH))
		snprintf(why, whylen, "storage fd is an O_PATH descriptor, not a memfd");
	else
		snprintf(why, whylen,
			 "storage fd is a file that cannot be sealed (not a memfd): %s",
			 strerror(err));
	return -EBADF;
}

/* Is @p fd a regular file on tmpfs or hugetlbfs (*@p st and *@p sfs: what fstat() and fstatfs()
 * say of it)? 0, or -EBADF and the reason. */
static int on_memfd_fs(int fd, struct stat *st, struct statfs *sfs, char *why, size_t whylen)
{
	if (fstat(fd, st) < 0 || !S_ISREG(st->st_mode)) {
		snprintf(why, whylen, "storage fd is not a regular file, not a memfd");
		return -EBADF;
	}
	if (fstatfs(fd, sfs) < 0 ||
	    (sfs->f_type != TMPFS_MAGIC && sfs->f_type != (typeof(sfs->f_type))HUGETLBFS_MAGIC)) {
		snprintf(why, whylen, "storage fd is on filesystem 0x%lx, not a memfd",
			 (unsigned long)sfs->f_type);
		return -EBADF;
	}
	return 0;
}

/* Do the @p seals of a memfd hold its size, its contents unless @p writable (and not its
 * contents if so), and themselves? 0, or -EPERM and the reason. */
static int seals_sound(int seals, bool writable, char *why, size_t whylen)
{
	if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
		bool shrink = !(seals & F_SEAL_SHRINK), grow = !(seals & F_SEAL_GROW);
		const char *missing = shrink && grow ? "F_SEAL_SHRINK and F_SEAL_GROW"
				      : shrink	     ? "F_SEAL_SHRINK"
						     : "F_SEAL_GROW";

		/* F_SEAL_SEAL alone is what a tmpfs file that never allowed sealing reports */
		if (seals == F_SEAL_SEAL)
			snprintf(why, whylen, "%s",
				 "storage fd is a tmpfs file that does not allow sealing (a "
				 "shm_open or /dev/shm file, or a memfd made without "
				 "MFD_ALLOW_SEALING), not a sealed memfd");
		else
			snprintf(why, whylen,
				 "storage memfd is not sealed against %s (%s missing, seals are "
				 "0x%x)",
				 shrink && grow ? "resizing"
				 : shrink	? "shrinking"
						: "growing",
				 missing, (unsigned)seals);
		return -EPERM;
	}
	/* F_SEAL_FUTURE_WRITE is not enough: it leaves alone every writable mapping made before
	 * it, so the publisher (or a child it forked) could go on writing under the attachers.
	 * F_SEAL_WRITE can only be added once no writable mapping exists anywhere. */
	if (!writable && !(seals & F_SEAL_WRITE)) {
		snprintf(why, whylen,
			 "read-only storage memfd is not sealed against writes: F_SEAL_WRITE "
			 "missing%s (required unless published writable)",
			 seals & F_SEAL_FUTURE_WRITE ? " (F_SEAL_FUTURE_WRITE does not revoke "
						       "writable mappings made before it)"
						     : "");
		return -EPERM;
	}
	if (!(seals & F_SEAL_SEAL)) {
		snprintf(why, whylen,
			 "storage memfd's seals are not final (F_SEAL_SEAL required, seals are "
			 "0x%x)",
			 (unsigned)seals);
		return -EPERM;
	}
	if (writable && (seals & (F_SEAL_FUTURE_WRITE | F_SEAL_WRITE))) {
		snprintf(why, whylen, "storage published writable is sealed against writes");
		return -EPERM;
	}
	return 0;
}

/* Does the access of @p fd (mode in @p st) suit storage of @p kind: read-write when writable;
 * read-only, with no write permission to reopen it by, when pooled? 0, or a negative errno and
 * the reason. */
static int access_sound(int fd, const struct stat *st, enum dlpc__storage_kind kind, char *why,
			size_t whylen)
{
	int fl;

	if (kind == DLPC__STORAGE_WRITABLE &&
	    ((fl = fcntl(fd, F_GETFL)) < 0 || (fl & O_ACCMODE) != O_RDWR)) {
		snprintf(why, whylen, "writable storage fd was not opened read-write");
		return -EBADF;
	}
	/* a recycled buffer is written by its sender only, through a mapping of its own */
	if (kind == DLPC__STORAGE_POOLED &&
	    ((fl = fcntl(fd, F_GETFL)) < 0 || (fl & O_ACCMODE) != O_RDONLY)) {
		snprintf(why, whylen,
			 "a pooled message's storage fd is writable; it must be read-only "
			 "(O_RDONLY), so that no receiver can write its sender's buffer");
		return -EPERM;
	}
	if (kind == DLPC__STORAGE_POOLED && (st->st_mode & 0222)) {
		snprintf(why, whylen,
			 "a pooled message's storage memfd has write permission (mode 0%o); it "
			 "must have none, so that no receiver can reopen it writable",
			 (unsigned)(st->st_mode & 07777));
		return -EPERM;
	}
	return 0;
}

int dlpc__storage_check(int fd, uint64_t size, enum dlpc__storage_kind kind, char *why,
			size_t whylen)
{
	struct stat st;
	struct statfs sfs;
	int seals, r;

	/* F_GET_SEALS first: it answers from the inode without calling into the file's
	 * filesystem, so a descriptor on a stalling filesystem (FUSE) cannot block the daemon in
	 * fstat() below; it fails for anything that is not shmem or hugetlbfs, and for O_PATH. */
	seals = fcntl(fd, F_GET_SEALS);
	if (seals < 0)
		return not_sealable(fd, why, whylen);
	if ((r = on_memfd_fs(fd, &st, &sfs, why, whylen)) < 0 ||
	    (r = seals_sound(seals, kind != DLPC__STORAGE_SEALED, why, whylen)) < 0 ||
	    (r = access_sound(fd, &st, kind, why, whylen)) < 0)
		return r;
	if ((uint64_t)st.st_size < size) {
		snprintf(why, whylen, "storage memfd holds %lld bytes, the tensors need %llu",
			 (long long)st.st_size, (unsigned long long)size);
		return -EINVAL;
	}
	/* Pages the publisher never allocated would be allocated by the first attacher that reads
	 * them, charged to that attacher's memory cgroup (an OOM kill there, not an error here).
	 * Every page of the file must be allocated already; the file's size rounds up to whole
	 * blocks of the filesystem (a tmpfs page, a huge page). */
	if (!fully_allocated(&st, (uint64_t)sfs.f_bsize)) {
		snprintf(why, whylen,
			 "storage memfd is sparse: %llu of its %lld bytes are allocated (allocate "
			 "every page before publishing, with fallocate or by writing it)",
			 (unsigned long long)st.st_blocks * 512, (long long)st.st_size);
		return -EINVAL;
	}
	return 0;
}

/*
 * The character-device major of NVIDIA's kernel driver. A CUDA VMM POSIX-fd export is an open
 * file of the driver's control device (/dev/nvidiactl) with the allocation attached to it.
 */
#define NVIDIA_DEVICE_MAJOR 195

int dlpc__device_storage_check(int fd, char *why, size_t whylen)
{
	struct statx sx;
	int fl = fcntl(fd, F_GETFL);

	/* cached attributes only: nothing here calls into the file's filesystem or driver */
	if (fl < 0 || (fl & O_PATH)) {
		snprintf(why, whylen, "CUDA VMM storage fd is an O_PATH descriptor");
		return -EBADF;
	}
	if (statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE, &sx) < 0) {
		snprintf(why, whylen, "CUDA VMM storage fd cannot be examined: %s",
			 strerror(errno));
		return -EBADF;
	}
	/* what the NVIDIA driver exports */
	if (S_ISCHR(sx.stx_mode) && sx.stx_rdev_major == NVIDIA_DEVICE_MAJOR)
		return 0;
	/* shmem, such as the memfd the project's fake driver exports (F_GET_SEALS answers for
	 * shmem alone, from the inode): memory, whose close cannot block */
	if (S_ISREG(sx.stx_mode) && fcntl(fd, F_GET_SEALS) >= 0)
		return 0;
	if (S_ISCHR(sx.stx_mode))
		snprintf(why, whylen,
			 "CUDA VMM storage fd is a character device of major %u, not NVIDIA's "
			 "(%d): not a driver export",
			 sx.stx_rdev_major, NVIDIA_DEVICE_MAJOR);
	else
		snprintf(why, whylen,
			 "CUDA VMM storage fd is %s, not a driver export (a character device of "
			 "major %d) or shmem (a memfd)",
			 S_ISREG(sx.stx_mode) ? "a file that is not shmem" : file_kind(sx.stx_mode),
			 NVIDIA_DEVICE_MAJOR);
	return -EBADF;
}
