/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The warm pool: memfds whose pages are allocated before a publish needs them.
 *
 * The copy path of a publish (and of a channel's send) writes host tensors into a fresh memfd.
 * Allocating (and zeroing) that memfd's pages costs more than the copy itself, inside the
 * caller's critical path. The pool keeps, for each size the copy path used twice or more in the
 * last $DLPC_WARM_IDLE_MS (a size used once, or less often than that, is not worth the memory
 * and the CPU of a refill that nobody takes), one memfd (two, for a size asked for faster than
 * it was refilled) whose pages a background thread allocated beforehand; the copy path takes
 * one of a fitting size (dlpc__warm_take()), sizes it down to the storage's exact size, writes
 * and seals it. From
 * DLPC__WARM_MAP_MIN bytes the thread also maps the memfd (MADV_DONTFORK) and faults its pages
 * in (MADV_POPULATE_WRITE): the copy is then a memcpy() that takes no fault, and the copy path
 * unmaps it before the seal (F_SEAL_WRITE is refused while a writable mapping exists). A memfd
 * leaves the pool when it is taken and never comes back: every storage is written by one
 * publish only, and the read-only guarantee holds as for any other. dlpc_alloc() takes from the
 * pool too (alloc.c): it keeps the mapping as its region's, and the pool refills once that
 * memory is published.
 *
 * Bounds: at most $DLPC_WARM_BYTES bytes ready or being filled (0 turns the pool off), at most
 * DLPC__WARM_FDS_MAX memfds. A size not used for $DLPC_WARM_IDLE_MS is forgotten and its memfds
 * closed; the thread then sleeps with no deadline until the next take (it never polls). A fill
 * that fails (the memory cgroup's or /dev/shm's limit) lowers the bytes the pool tries to hold,
 * until the pool next empties; a publish never fails for the pool, nor waits on it but to get
 * memory back: one that finds no room while the pool holds or fills memory has it all given
 * back (a fill under way waited for) and tries again (dlpc__warm_drop()). From
 * DLPC__WARM_MAP_MIN bytes, a memfd is faulted into its mapping only while the memory cgroups
 * have DLPC__WARM_MAP_ROOM to spare: the mapping's page tables are charged there, and a charge
 * that fails in a fault calls the OOM killer where fallocate() only fails.
 *
 * The pages are the process's: charged to its memory cgroup while kept warm, and, for the memfds
 * kept mapped, in its resident set (RSS, PSS) as shared memory too. In a forked child
 * the parent's thread does not run: the child closes its copies of the pool's memfds and starts
 * a pool of its own when it first needs one. When the process's last client closes, the pool
 * empties (waiting for a fill under way), so the process holds no memfd of the pool's.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core.h"
#include "region.h"

/* A ready memfd: pages allocated, @p size bytes; from DLPC__WARM_MAP_MIN bytes (where the
 * kernel could) mapped at @p map, writable, its pages faulted in, and NULL otherwise. */
struct warm_fd {
	int fd;
	uint64_t size;
	void *map;
};

/* A size the copy path or dlpc_alloc() used: when last, and how many memfds of it to keep
 * ready (0 after its first use). */
struct warm_want {
	uint64_t size;
	int64_t used_ms;
	unsigned depth;
};

static struct {
	pthread_mutex_t mu;
	pthread_cond_t cv;	  /* the thread waits on it for work (CLOCK_MONOTONIC) */
	pthread_cond_t idle_cv;	  /* warm_last_client() waits on it for a fill to end */
	pthread_rwlock_t closing; /* read: closing memfds taken out; write: a fork() */
	bool thread;		  /* started in this process */
	bool kick;		  /* taken from since the thread was last woken */
	uint64_t max_bytes;	  /* $DLPC_WARM_BYTES */
	int64_t idle_ms;	  /* $DLPC_WARM_IDLE_MS */
	uint64_t cap;	/* bytes the pool tries to hold: max_bytes, less after a failure */
	uint64_t bytes; /* ready or being filled */
	struct warm_fd ready[DLPC__WARM_FDS_MAX];
	size_t nready;
	struct warm_want want[DLPC__WARM_SIZES_MAX];
	size_t nwant;
	int filling; /* the memfd the thread fills now (its pages are not counted ready), or -1 */
	unsigned epoch; /* bumped when the pool empties: a fill from before is dropped */
} warm = {
	.mu = PTHREAD_MUTEX_INITIALIZER,
	.idle_cv = PTHREAD_COND_INITIALIZER,
	.closing = PTHREAD_RWLOCK_INITIALIZER,
	.filling = -1,
};

static pthread_once_t config_once = PTHREAD_ONCE_INIT;

/* $@p env as a whole number, or @p def when unset or not one (the pool never fails a publish,
 * so a bad value cannot be reported; dlpc(3) says so). */
static uint64_t env_or(const char *env, uint64_t def)
{
	const char *s = getenv(env);
	unsigned long long n;
	char *end;

	if (!s || !*s || s[0] == '-')
		return def;
	errno = 0;
	n = strtoull(s, &end, 10);
	return errno || *end ? def : n;
}

/* warm.cv: its deadlines are monotonic (dlpc__deadline_in()). */
static void cv_init(void)
{
	pthread_condattr_t attr;

	pthread_condattr_init(&attr);
	pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
	pthread_cond_init(&warm.cv, &attr);
	pthread_condattr_destroy(&attr);
}

static void configure(void)
{
	cv_init();
	warm.max_bytes = env_or(DLPC_WARM_BYTES_ENV, DLPC_WARM_BYTES_DEFAULT);
	warm.idle_ms = (int64_t)env_or(DLPC_WARM_IDLE_MS_ENV, DLPC_WARM_IDLE_MS_DEFAULT);
	if (warm.idle_ms <= 0 || warm.idle_ms > DLPC__WARM_IDLE_MS_MAX)
		warm.idle_ms = warm.idle_ms <= 0 ? 0 : DLPC__WARM_IDLE_MS_MAX;
	if (warm.idle_ms == 0)
		warm.max_bytes = 0;
	warm.cap = warm.max_bytes;
}

/* Does a memfd of @p have bytes serve a storage of @p need bytes? Not too much larger: what is
 * cut off was allocated for nothing. */
static bool fits(uint64_t have, uint64_t need)
{
	return have >= need && have - need <= have / 8;
}

/* Take a ready memfd that fits @p need, the smallest, into *@p w; false if none. Under warm.mu. */
static bool ready_take(uint64_t need, struct warm_fd *w)
{
	size_t best = warm.nready;

	for (size_t i = 0; i < warm.nready; i++)
		if (fits(warm.ready[i].size, need) &&
		    (best == warm.nready || warm.ready[i].size < warm.ready[best].size))
			best = i;
	if (best == warm.nready)
		return false;
	*w = warm.ready[best];
	warm.bytes -= w->size;
	warm.ready[best] = warm.ready[--warm.nready];
	return true;
}

/* Note a use of @p size at @p now; a miss (@p hit false) of a size used before (within the idle
 * time) asks for one more memfd of it kept ready. A size used for the first time asks for none:
 * a one-off publish (a trainer's weights, published minutes apart) would have the pool fill,
 * hold and give back a copy's worth of memory for nothing. Under warm.mu. */
static void want_note(uint64_t size, int64_t now, bool hit)
{
	struct warm_want *w = NULL;

	for (size_t i = 0; i < warm.nwant && !w; i++)
		if (fits(warm.want[i].size, size) || fits(size, warm.want[i].size))
			w = &warm.want[i];
	/* a size last used before the idle time is a first use again, though the pool's thread
	 * (not started, or asleep with nothing kept) has not forgotten it yet */
	if (w && now - w->used_ms >= warm.idle_ms) {
		w->size = size;
		w->depth = 0;
	} else if (w) {
		if (!hit && w->depth < DLPC__WARM_DEPTH_MAX)
			w->depth++;
		w->size = size > w->size ? size : w->size;
	} else {
		if (warm.nwant < DLPC__WARM_SIZES_MAX) {
			w = &warm.want[warm.nwant++];
		} else { /* the least recently used size goes, one used once first */
			w = NULL;
			for (size_t i = 0; i < warm.nwant; i++)
				if (!w || (warm.want[i].depth == 0) > (w->depth == 0) ||
				    ((warm.want[i].depth == 0) == (w->depth == 0) &&
				     warm.want[i].used_ms < w->used_ms))
					w = &warm.want[i];
		}
		w->size = size;
		w->depth = 0;
	}
	w->used_ms = now;
}

/* Is a ready memfd of @p size still wanted? Under warm.mu. */
static bool wanted(uint64_t size)
{
	for (size_t i = 0; i < warm.nwant; i++)
		if (fits(size, warm.want[i].size))
			return true;
	return false;
}

/*
 * Forget the sizes idle since @p now - idle_ms, and move the ready memfds nobody wants any more
 * (all of them when @p all) to @p out (*@p nout), to be closed outside the lock. The monotonic
 * ms when the next size falls idle, or 0 for none. Under warm.mu.
 */
static int64_t expire(int64_t now, bool all, struct warm_fd *out, size_t *nout)
{
	int64_t next = 0;

	for (size_t i = 0; i < warm.nwant;) {
		int64_t end = warm.want[i].used_ms + warm.idle_ms;

		if (all || end <= now) {
			warm.want[i] = warm.want[--warm.nwant];
			continue;
		}
		next = next == 0 || end < next ? end : next;
		i++;
	}
	for (size_t i = 0; i < warm.nready;) {
		if (!all && wanted(warm.ready[i].size)) {
			i++;
			continue;
		}
		out[(*nout)++] = warm.ready[i];
		warm.bytes -= warm.ready[i].size;
		warm.ready[i] = warm.ready[--warm.nready];
	}
	if (warm.nwant == 0)
		warm.cap = warm.max_bytes; /* all idle: a failure before says nothing of now */
	return next;
}

/* A size to fill next (0: none): a wanted one with fewer memfds ready than its depth, that fits
 * the bounds. Under warm.mu. */
static uint64_t next_fill(void)
{
	if (warm.filling >= 0 || warm.nready >= DLPC__WARM_FDS_MAX)
		return 0;
	for (size_t i = 0; i < warm.nwant; i++) {
		const struct warm_want *w = &warm.want[i];
		unsigned have = 0;

		for (size_t j = 0; j < warm.nready; j++)
			have += fits(warm.ready[j].size, w->size);
		if (have < w->depth && warm.bytes + w->size <= warm.cap)
			return w->size;
	}
	return 0;
}

/* Map @p w's memfd, if it is to be kept mapped (DLPC__WARM_MAP_MIN) or must be touched through
 * a mapping for huge pages (shmem_enabled advise: only pages first touched through a mapping that
 * asks for them are huge). Under warm.mu: a child forked before MADV_DONTFORK would keep a
 * writable mapping, and the seal of the memfd would fail. */
static void fill_map(struct warm_fd *w)
{
	bool advise = dlpc__huge_for(w->size, false) == DLPC__HUGE_ADVISE;

	if (advise || w->size >= DLPC__WARM_MAP_MIN)
		w->map = dlpc__huge_map(w->fd, (size_t)w->size, advise);
}

/* Allocate every page of @p w's memfd, huge ones where the machine allows them, and fault them
 * into its mapping if it is kept (else unmap it). 0 or negative errno. */
static int fill_pages(struct warm_fd *w)
{
	bool advise = w->map && dlpc__huge_for(w->size, false) == DLPC__HUGE_ADVISE;
	int r = 0;

	if (advise) /* the pages are first touched through the mapping */
		r = dlpc__huge_fill(w->map, 0, (size_t)w->size, w->fd);
	else /* allocated first: a memory cgroup without room fails it, a fault would be killed */
		while ((r = fallocate(w->fd, 0, 0, (off_t)w->size) < 0 ? -errno : 0) == -EINTR)
			;
	/* faulted in, those allocated already, if the memory cgroups have room to spare for the
	 * page tables that takes (a charge that fails in a fault calls the OOM killer, where
	 * fallocate() and write() only fail); without MADV_POPULATE_WRITE (Linux 5.14) they
	 * stay unmapped */
	if (r == 0 && w->map && w->size >= DLPC__WARM_MAP_MIN &&
	    (advise || (dlpc__size_fits("warm", DLPC__WARM_MAP_ROOM) == 0 &&
			madvise(w->map, (size_t)w->size, MADV_POPULATE_WRITE) == 0)))
		return 0;
	if (w->map)
		munmap(w->map, (size_t)w->size);
	w->map = NULL;
	return r;
}

/* Give back the @p n memfds of @p w: unmapped and closed. */
static void release_all(const struct warm_fd *w, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (w[i].map)
			munmap(w[i].map, (size_t)w[i].size);
		close(w[i].fd);
	}
}

/*
 * release_all() the @p n memfds of @p w, taken out of the pool under warm.mu, which is held
 * and let go meanwhile (closing a large memfd frees its pages: nobody waits on the lock for
 * that). A fork() waits for closes under way (warm.closing, taken before warm.mu is let go), so
 * that no child is born holding a copy of a memfd that is neither in the pool nor closed.
 */
static void give_back(const struct warm_fd *w, size_t n)
{
	if (n == 0)
		return;
	pthread_rwlock_rdlock(&warm.closing);
	pthread_mutex_unlock(&warm.mu);
	release_all(w, n);
	pthread_rwlock_unlock(&warm.closing);
	pthread_mutex_lock(&warm.mu);
}

/*
 * Fill one memfd of @p size bytes and make it ready. Called and returns under warm.mu, which is
 * let go meanwhile. The memfd is made under the lock, so that a fork sees it (as warm.filling)
 * and the child closes its copy.
 */
static void fill_one(uint64_t size)
{
	unsigned epoch = warm.epoch;
	struct warm_fd w = {-1, size, NULL};
	int r;

	warm.bytes += size;
	pthread_mutex_unlock(&warm.mu);
	r = dlpc__size_fits("warm", size * DLPC__WARM_ROOM_FACTOR);
	pthread_mutex_lock(&warm.mu);
	w.fd = r < 0 || epoch != warm.epoch ? -1 : dlpc__memfd_open("warm", size, 0);
	if (w.fd >= 0)
		fill_map(&w);
	warm.filling = w.fd;
	pthread_mutex_unlock(&warm.mu);
	r = w.fd < 0 ? -ENOSPC : fill_pages(&w);
	pthread_mutex_lock(&warm.mu);
	warm.filling = -1;
	pthread_cond_broadcast(&warm.idle_cv);
	if (r == 0 && epoch == warm.epoch && wanted(size)) {
		warm.ready[warm.nready++] = w;
		/* kept for the idle time from now: a slow fill (huge pages the kernel had to compact
		 * memory for) must not be given back as soon as it is ready */
		for (size_t i = 0; i < warm.nwant; i++)
			if (fits(size, warm.want[i].size))
				warm.want[i].used_ms = dlpc__mono_ms();
		return;
	}
	warm.bytes -= size;
	if (r < 0 && epoch == warm.epoch) /* no room for this much: hold less from now on */
		warm.cap = warm.bytes;
	if (w.fd >= 0)
		give_back(&w, 1);
}

/* The pool's thread: fill what is wanted, give back what fell idle, sleep until the next size
 * falls idle or, with nothing kept, until woken. */
static void *warm_thread(void *arg)
{
	struct warm_fd out[DLPC__WARM_FDS_MAX];

	(void)arg;
	pthread_setname_np(pthread_self(), "dlpc-warm");
	pthread_mutex_lock(&warm.mu);
	for (;;) {
		size_t nout = 0;
		int64_t next = expire(dlpc__mono_ms(), false, out, &nout);
		uint64_t size;

		if (nout > 0) {
			give_back(out, nout);
			continue;
		}
		size = next_fill();
		if (size > 0) {
			fill_one(size);
			continue;
		}
		if (next == 0) {
			pthread_cond_wait(&warm.cv, &warm.mu);
		} else {
			struct timespec dl;

			dlpc__deadline_in(&dl, next - dlpc__mono_ms());
			pthread_cond_timedwait(&warm.cv, &warm.mu, &dl);
		}
	}
	return NULL;
}

int dlpc__warm_take(uint64_t size, void **map, size_t *map_len)
{
	struct warm_fd w = {-1, 0, NULL};
	bool hit;

	*map = NULL;
	*map_len = 0;
	if (size < DLPC_WARM_SIZE_MIN)
		return -1;
	pthread_once(&config_once, configure);
	if (warm.max_bytes == 0)
		return -1;
	pthread_mutex_lock(&warm.mu);
	hit = ready_take(size, &w);
	want_note(size, dlpc__mono_ms(), hit);
	warm.kick = true;
	pthread_mutex_unlock(&warm.mu);
	if (!hit)
		return -1;
	/* the tail cut off is given back (and unmapped by the kernel); what stays was allocated
	 * whole */
	if (w.size != size && ftruncate(w.fd, (off_t)size) < 0) {
		release_all(&w, 1);
		return -1;
	}
	*map = w.map;
	*map_len = (size_t)w.size;
	return w.fd;
}

void dlpc__warm_refill(uint64_t size)
{
	int64_t now;

	pthread_once(&config_once, configure);
	if (warm.max_bytes == 0)
		return;
	now = dlpc__mono_ms();
	pthread_mutex_lock(&warm.mu);
	/* the size was used until now: a copy slower than the idle time must not have it
	 * forgotten before its refill */
	for (size_t i = 0; i < warm.nwant; i++)
		if (fits(warm.want[i].size, size))
			warm.want[i].used_ms = now;
	if (warm.kick && !warm.thread)
		warm.thread = dlpc__start_thread(warm_thread, NULL);
	if (warm.kick)
		pthread_cond_signal(&warm.cv);
	warm.kick = false;
	pthread_mutex_unlock(&warm.mu);
}

bool dlpc__warm_drop(void)
{
	struct warm_fd out[DLPC__WARM_FDS_MAX];
	size_t nout = 0;
	bool filling;

	pthread_once(&config_once, configure);
	if (warm.max_bytes == 0)
		return false;
	pthread_mutex_lock(&warm.mu);
	for (size_t i = 0; i < warm.nready; i++) {
		out[nout++] = warm.ready[i];
		warm.bytes -= warm.ready[i].size;
	}
	warm.nready = 0;
	warm.cap = 0;
	warm.epoch++; /* a fill under way is dropped too: waited for, it gives its memory back */
	filling = warm.filling >= 0;
	while (warm.filling >= 0)
		pthread_cond_wait(&warm.idle_cv, &warm.mu);
	give_back(out, nout);
	pthread_mutex_unlock(&warm.mu);
	return nout > 0 || filling;
}

/* The last client closed: empty the pool, and wait for a fill under way, so that no memfd of the
 * pool's outlives the last dlpc_close(). */
static void warm_last_client(void)
{
	struct warm_fd out[DLPC__WARM_FDS_MAX];
	size_t nout = 0;

	pthread_mutex_lock(&warm.mu);
	warm.epoch++;
	expire(0, true, out, &nout);
	while (warm.filling >= 0)
		pthread_cond_wait(&warm.idle_cv, &warm.mu);
	give_back(out, nout);
	pthread_mutex_unlock(&warm.mu);
}

/* fork(): the lock is held across it; the child has no thread and closes its copies of the
 * parent's memfds (they are the child's fds, the parent keeps its own). The parent's mappings
 * of them are not the child's (MADV_DONTFORK): it has nothing to unmap. */
static void warm_atfork(int phase)
{
	if (phase == 0) {
		pthread_mutex_lock(&warm.mu);
		pthread_rwlock_wrlock(&warm.closing);
		dlpc__huge_atfork(0);
		return;
	}
	if (phase == 1) {
		dlpc__huge_atfork(1);
		pthread_rwlock_unlock(&warm.closing);
		pthread_mutex_unlock(&warm.mu);
		return;
	}
	dlpc__huge_atfork(2);
	for (size_t i = 0; i < warm.nready; i++)
		close(warm.ready[i].fd);
	if (warm.filling >= 0)
		close(warm.filling);
	warm.filling = -1;
	warm.nready = 0;
	warm.nwant = 0;
	warm.bytes = 0;
	warm.cap = warm.max_bytes;
	warm.epoch++;
	warm.thread = false;
	warm.kick = false;
	/* the parent's thread may count as a waiter of the condition variables */
	cv_init();
	pthread_cond_init(&warm.idle_cv, NULL);
	pthread_mutex_init(&warm.mu, NULL);
	pthread_rwlock_init(&warm.closing, NULL);
}

void dlpc__warm_register(void)
{
	static const struct dlpc__hooks hooks = {
		.atfork = warm_atfork,
		.last_client = warm_last_client,
	};

	dlpc__hooks_add(&hooks);
}
