# SPDX-License-Identifier: Apache-2.0
"""The replicas the bridge published, charged to the uid of the local caller whose fetch made
each (docs/bridge.md, Local callers and their limits).

Every replica lives in dlpackd under the bridge's own uid, so dlpackd's quotas see one user;
this ledger is what tells the callers apart. A replica counts against its caller's uid from the
moment its fetch is allowed (a reservation, before anything is allocated) until the bridge sees
it gone: replaced by the same uid's refetch of the same name, unpublished by --follow, or no
longer found in dlpackd with the bridge's uid and the generation the bridge published (someone
unpublished it), which the bridge looks for at each fetch. Counts are sums over the ledger's
records, so they cannot go negative; a failed fetch drops its reservation and keeps the replica
it was to replace.

With a state file (--state-dir; systemd's StateDirectory=), the records are written there at
each change (a new file of mode 0600 renamed over the old, outside the ledger's lock) and read
back at start, so that a restarted bridge still charges each replica to its uid and still
refuses another uid's REPLACE. A reservation is written before its fetch begins: a fetch under
way when the bridge stopped is given the replica dlpackd then holds at its name. A record
counts until a fetch finds its replica gone from dlpackd at that generation. A bridge-owned
replica with no record (a state file that could not be parsed is set aside, *.bad.<ns>) may be
replaced by root only. The directory and the file must be the bridge's uid's alone, and the
file writable, or the bridge does not start.
"""
import errno
import json
import logging
import os
import stat
import threading
import time

import dlpack_ipc

# The live replicas one uid's fetches may hold at once. Each is a dlpackd entry of the bridge's
# uid: 64 covers a user's working set (a model's shards, a few caches), and 16 uids at the limit
# hold 1,024 entries, far within dlpackd's entries and daemon memory per uid. --replicas-per-uid.
REPLICAS_PER_UID_MAX = 64
# Their bytes (the tensors' sizes, as dlpackd's --max-bytes-per-uid counts declared sizes):
# 256 GiB holds a 100-billion-parameter bf16 state dict, and four uids at the limit stay within
# dlpackd's default 1 TiB for the bridge's uid, so that one user alone cannot fill it.
# --replica-bytes-per-uid.
REPLICA_BYTES_PER_UID_MAX = 256 << 30

# Bytes per element of the dtypes dlpack_ipc names (python/src/tensor.c): a layout is sized
# from its shapes and dtypes, the way empty() will allocate it, not from the sizes it announces.
DTYPE_BYTES = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8,
    "complex64": 8, "complex128": 16,
}

# The state file's format (--state-dir): {"version": 1, "live": {name: [uid, bytes,
# generation]}, "pending": {name: [uid, bytes]}}, at most STATE_BYTES_MAX bytes.
STATE_VERSION = 1
STATE_BYTES_MAX = 16 << 20
# Its name in the state directory.
STATE_FILE = "replicas.json"

log = logging.getLogger("dlpackd-bridge")


def _records(obj, width):
    """{name: [non-negative ints]} of a state file, checked: names a replica's (PEER:NAME, at
    most NAME_MAX bytes), width numbers each; ValueError naming what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError(f"records of {type(obj).__name__}, not an object")
    for name, rec in obj.items():
        if not isinstance(name, str) or ":" not in name or \
                len(name.encode()) > dlpack_ipc.NAME_MAX:
            raise ValueError(f"record name {name!r:.60} is not a replica's")
        if not isinstance(rec, list) or len(rec) != width or \
                any(type(v) is not int or not 0 <= v < 1 << 63 for v in rec):
            raise ValueError(f"record {name!r:.60} is not {width} numbers")
    return obj


def layout_bytes(tensors):
    """The bytes a layout's [key, dtype, shape, nbytes] list allocates; ValueError naming the
    tensor when it is malformed or its announced size is not its shape's."""
    if not isinstance(tensors, list) or not tensors:
        raise ValueError(f"a layout of {type(tensors).__name__} {tensors!r:.60}, "
                         "not a list of tensors")
    total = 0
    for t in tensors:
        if not isinstance(t, list) or len(t) != 4:
            raise ValueError(f"tensor {t!r:.60} is not [key, dtype, shape, nbytes]")
        key, dtype, shape, nbytes = t
        size = DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None
        if size is None:
            raise ValueError(f"tensor {key!r}: dtype {dtype!r:.40} is not one the bridge sizes")
        if not isinstance(shape, list) or any(
                type(d) is not int or d < 0 for d in shape):
            raise ValueError(f"tensor {key!r}: shape {shape!r:.60} is not a list of sizes >= 0")
        n = size
        for d in shape:
            n *= d
        if type(nbytes) is not int or nbytes != n:
            raise ValueError(f"tensor {key!r}: {nbytes!r:.30} bytes announced, but "
                             f"{shape!r:.60} of {dtype} is {n} bytes")
        total += n
    return total


class _Replica:
    __slots__ = ("uid", "nbytes", "generation")

    def __init__(self, uid, nbytes):
        self.uid = uid
        self.nbytes = nbytes
        self.generation = None      # the local generation, once published


class Ledger:
    """Which uid's fetch made each replica, and what each uid holds."""

    def __init__(self, own_uid, replicas_max=REPLICAS_PER_UID_MAX,
                 bytes_max=REPLICA_BYTES_PER_UID_MAX, path=None):
        self.own_uid = own_uid
        self.replicas_max = replicas_max
        self.bytes_max = bytes_max
        self.path = path       # the state file, or None: in memory only
        self._lock = threading.Lock()
        self._live = {}        # local name -> _Replica, published by the bridge
        self._pending = {}     # local name -> _Replica, allowed and being fetched
        # read back from a state file: fetches that were under way when the bridge stopped;
        # the replica dlpackd holds under the bridge's uid at such a name is theirs
        self._adopt = {}
        self._save_lock = threading.Lock()
        self._seq = 0          # the state's changes, numbered under _lock
        self._written = 0      # the last one written to the file
        if path is not None:
            self._open_state()

    def _open_state(self):
        """Check the state directory, read the state file back, and write it once: a directory
        or file another user could have written, or one the bridge cannot write, stops it at
        start (OSError, ValueError naming it)."""
        d = os.path.dirname(os.path.abspath(self.path))
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ValueError(f"state directory {d}: not a directory of uid {os.geteuid()} that "
                             "only it may write (see --state-dir)")
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        if fd is not None:
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or \
                        st.st_mode & 0o077:
                    raise ValueError(f"state file {self.path}: not a file of uid "
                                     f"{os.geteuid()} that only it may read (mode 0600)")
                text = f.read(STATE_BYTES_MAX + 1)
            self._parse(text)
        with self._lock:
            state, seq = self._state()
        if not self._write(state, seq):
            raise OSError(errno.EROFS, f"state file {self.path} cannot be written (see the "
                          "warning above)")

    def _parse(self, text):
        """The records of a state file's text; one that cannot be parsed or checked is set
        aside (a new name: *.bad.<ns>) and the bridge starts with none, saying so."""
        try:
            if len(text) > STATE_BYTES_MAX:
                raise ValueError(f"over STATE_BYTES_MAX ({STATE_BYTES_MAX} bytes)")
            state = json.loads(text)
            if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
                raise ValueError(f"not a state of version {STATE_VERSION}")
            live = _records(state.get("live"), 3)
            adopt = _records(state.get("pending", {}), 2)
        except (ValueError, RecursionError, MemoryError) as e:
            bad = f"{self.path}.bad.{time.time_ns()}"
            os.replace(self.path, bad)
            log.warning("replica ledger %s cannot be parsed (%s): starting with none; it is kept "
                        "as %s, and the bridge's replicas with no record may be fetched over "
                        "by root only", self.path, e, bad)
            return
        for name, (uid, nbytes, generation) in live.items():
            self._live[name] = _Replica(uid, nbytes)
            self._live[name].generation = generation
        for name, (uid, nbytes) in adopt.items():
            self._adopt[name] = _Replica(uid, nbytes)
        log.info("replica ledger %s: %d replicas and %d fetches under way when the bridge "
                 "stopped, as charged then", self.path, len(self._live), len(self._adopt))

    def _state(self):
        """(the state to write, its number), under self._lock."""
        self._seq += 1
        return ({"version": STATE_VERSION,
                 "live": {n: [r.uid, r.nbytes, r.generation] for n, r in self._live.items()},
                 "pending": {n: [r.uid, r.nbytes] for n, r in
                             {**self._adopt, **self._pending}.items()}}, self._seq)

    def _write(self, state, seq):
        """Write state (number seq) to the state file, unless a later one was written: a new
        file of the bridge's own (O_EXCL: never one someone put there, a stale one removed
        first), synced, renamed over the old, the directory synced. Outside self._lock (a slow
        disk holds no fetch up). Whether it was written; a failure is logged, and the records
        in memory stay what counts while the bridge runs."""
        if self.path is None:
            return True
        tmp = f"{self.path}.{os.getpid()}.new"
        with self._save_lock:
            if seq <= self._written:
                return True
            try:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                             os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
                dfd = os.open(os.path.dirname(os.path.abspath(self.path)),
                              os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            except OSError as e:
                log.warning("replica ledger %s cannot be written: %s (kept in memory)",
                            self.path, e)
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                return False
            self._written = seq
            return True

    def keep_own(self, names):
        """At start: the records of the bridge's own replicas (--follow's) whose names it no
        longer follows are dropped (the names are free for local callers again)."""
        with self._lock:
            gone = [n for n, r in self._live.items() if r.uid == self.own_uid and n not in names]
            for n in gone:
                del self._live[n]
            state, seq = self._state()
        if gone:
            log.info("replicas %s were --follow's and are no longer followed: no longer "
                     "charged to the bridge", sorted(gone))
            self._write(state, seq)

    def held(self, uid):
        """(replicas, bytes) uid holds: its live replicas, a pending fetch in place of the one
        it replaces."""
        with self._lock:
            return self._held(uid, None)

    def _held(self, uid, skip):
        rs = [r for n, r in self._live.items() if r.uid == uid and n not in self._pending
              and n != skip]
        rs += [r for n, r in self._pending.items() if r.uid == uid and n != skip]
        return len(rs), sum(r.nbytes for r in rs)

    def summary(self):
        """{uid: [replicas, bytes]} for the status."""
        with self._lock:
            uids = {r.uid for r in (*self._live.values(), *self._pending.values())}
            return {str(u): list(self._held(u, None)) for u in sorted(uids)}

    def _look(self, dl, local):
        """Drop the records of replicas no longer in dlpackd as the bridge published them, and
        give a fetch that was under way when the bridge stopped the replica it made; the
        (owner uid, generation) of what dlpackd holds at local now, or None."""
        with self._lock:
            snapshot, adopt = dict(self._live), dict(self._adopt)
        prefixes = {n.partition(":")[0] + ":" for n in (*snapshot, *adopt)}
        prefixes.add(local.partition(":")[0] + ":")
        seen, changed = {}, False
        for p in sorted(prefixes):
            for e in dl.list(p):
                seen[e.name] = (e.owner.uid, e.generation)
        with self._lock:
            for name, r in snapshot.items():
                # a record made after the listing is another object: left alone
                if self._live.get(name) is r and seen.get(name) != (self.own_uid, r.generation):
                    del self._live[name]
                    changed = True
                    log.info("replica %r (uid %d's, generation %s) is gone from dlpackd: no "
                             "longer charged", name, r.uid, r.generation)
            for name, r in adopt.items():
                if self._adopt.get(name) is not r:
                    continue
                del self._adopt[name]
                changed = True
                there = seen.get(name)
                if there is not None and there[0] == self.own_uid and name not in self._live:
                    r.generation = there[1]
                    self._live[name] = r
                    log.info("replica %r (generation %d): uid %d's fetch, under way when the "
                             "bridge stopped, made it", name, there[1], r.uid)
            state, seq = self._state() if changed else (None, 0)
        if changed:
            self._write(state, seq)
        return seen.get(local)

    def reserve(self, dl, uid, local, nbytes):
        """Allow uid's fetch of nbytes into local, before anything is allocated, or raise the
        OSError that says why not: another uid's replica there (EPERM; root and the bridge's
        own --follow may replace any), a name the bridge did not publish (EEXIST), a fetch into
        it under way (EAGAIN), uid's limits (EDQUOT). With a state file the reservation is
        written there before the fetch begins."""
        there = self._look(dl, local)
        with self._lock:
            if local in self._pending:
                raise BlockingIOError(errno.EAGAIN, f"{local!r}: another fetch into it is under "
                                      "way")
            cur = self._live.get(local)
            if cur is not None and uid not in (cur.uid, 0, self.own_uid):
                raise PermissionError(errno.EPERM, f"{local!r} holds the replica uid {cur.uid} "
                                      f"fetched: uid {uid} may not replace it (only its own)")
            if cur is None and there is not None:
                if there[0] != self.own_uid:
                    raise FileExistsError(errno.EEXIST, f"{local!r} is published by uid "
                                          f"{there[0]}, not by the bridge")
                if self.path is not None and uid not in (0, self.own_uid):
                    # the ledger was kept, yet has no record of it: whose it is is not known
                    raise PermissionError(errno.EPERM, f"{local!r} is a replica of the "
                                          "bridge's with no record of whose fetch made it: "
                                          "root may replace or unpublish it")
                # the bridge's, from before it restarted: whose fetch made it is not known
                log.info("replica %r (generation %d) predates this bridge: uid %d's fetch "
                         "replaces it", local, there[1], uid)
            count, held = self._held(uid, local)
            if count + 1 > self.replicas_max:
                raise OSError(errno.EDQUOT, f"uid {uid} holds {count} replicas: "
                              f"REPLICAS_PER_UID_MAX is {self.replicas_max}")
            if held + nbytes > self.bytes_max:
                raise OSError(errno.EDQUOT, f"uid {uid} asks for {nbytes} bytes and holds "
                              f"{held}: REPLICA_BYTES_PER_UID_MAX is {self.bytes_max}")
            self._pending[local] = _Replica(uid, nbytes)
            state, seq = self._state()
        self._write(state, seq)

    def commit(self, local, generation):
        """The reserved fetch into local was published as generation: it is live, in place
        of the replica it replaced."""
        with self._lock:
            r = self._pending.pop(local)
            r.generation = generation
            self._live[local] = r
            state, seq = self._state()
        self._write(state, seq)

    def cancel(self, local):
        """The reserved fetch into local failed: the replica it was to replace stays."""
        with self._lock:
            if self._pending.pop(local, None) is None:
                return
            state, seq = self._state()
        self._write(state, seq)

    def forget(self, local, generation=None):
        """The bridge unpublished local itself (the replica of that generation, if given)."""
        with self._lock:
            r = self._live.get(local)
            if r is None or generation not in (None, r.generation):
                return
            del self._live[local]
            state, seq = self._state()
        self._write(state, seq)

    def droppable(self, local, uid):
        """The generation of the live replica at local, if uid may drop it (the uid whose fetch
        made it, or root); else the OSError that says why not: no such replica (ENOENT), a
        fetch into it under way (EAGAIN), another uid's (EPERM)."""
        with self._lock:
            if local in self._pending:
                raise BlockingIOError(errno.EAGAIN, f"{local!r}: a fetch into it is under way")
            r = self._live.get(local)
            if r is None:
                raise FileNotFoundError(errno.ENOENT, f"{local!r} is no replica the bridge "
                                        "holds for anyone")
            if uid not in (r.uid, 0):
                raise PermissionError(errno.EPERM, f"{local!r} holds the replica uid {r.uid} "
                                      f"fetched: uid {uid} may not drop it (only its own)")
            return r.generation
