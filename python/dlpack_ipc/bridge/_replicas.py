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

With a state file (--state-dir; systemd's StateDirectory=), the live records are written there
at each change (a new file renamed over the old, mode 0600) and read back at start, so that a
restarted bridge still charges each replica to its uid and still refuses another uid's REPLACE.
A record read back counts until a fetch finds that dlpackd no longer holds the replica at that
generation (each fetch looks, as for any record). A state file that cannot be
read or parsed is set aside (renamed *.bad) and the bridge starts with none, saying so.
"""
import errno
import json
import logging
import os
import threading

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

# The state file's format (--state-dir): {"version": 1, "live": {name: [uid, bytes, generation]}}
STATE_VERSION = 1
# Its name in the state directory.
STATE_FILE = "replicas.json"

log = logging.getLogger("dlpackd-bridge")


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
        if path is not None:
            self._load()

    def _load(self):
        """The live records of the state file, if there is one."""
        try:
            with open(self.path, encoding="utf-8") as f:
                state = json.load(f)
            live = state["live"]
            if state.get("version") != STATE_VERSION or not isinstance(live, dict):
                raise ValueError(f"version {state.get('version')!r}, not {STATE_VERSION}")
            for name, (uid, nbytes, generation) in live.items():
                if not (isinstance(name, str) and all(type(v) is int and v >= 0
                                                      for v in (uid, nbytes, generation))):
                    raise ValueError(f"record {name!r:.60} is not [uid, bytes, generation]")
                r = _Replica(uid, nbytes)
                r.generation = generation
                self._live[name] = r
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._live = {}
            bad = self.path + ".bad"
            try:
                os.replace(self.path, bad)
            except OSError:
                bad = None
            log.warning("replica ledger %s cannot be read (%s): starting with none%s", self.path,
                        e, f"; it is kept as {bad}" if bad else "")
            return
        log.info("replica ledger %s: %d replicas, as charged before the restart", self.path,
                 len(self._live))

    def _save(self):
        """Write the live records to the state file (under self._lock). A failure is logged:
        the records in memory stay what counts while the bridge runs."""
        if self.path is None:
            return
        tmp = f"{self.path}.{os.getpid()}.new"
        state = {"version": STATE_VERSION,
                 "live": {n: [r.uid, r.nbytes, r.generation] for n, r in self._live.items()}}
        try:
            # a new file of the bridge's own, never one someone put there (O_EXCL: a symlink
            # is not followed); one a crashed write left behind goes first
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("replica ledger %s cannot be written: %s (kept in memory)", self.path, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass

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
        """Drop the records of replicas no longer in dlpackd as the bridge published them; the
        (owner uid, generation) of what dlpackd holds at local now, or None."""
        with self._lock:
            snapshot = dict(self._live)
        prefixes = {n.partition(":")[0] + ":" for n in snapshot}
        prefixes.add(local.partition(":")[0] + ":")
        seen, dropped = {}, False
        for p in sorted(prefixes):
            for e in dl.list(p):
                seen[e.name] = (e.owner.uid, e.generation)
        with self._lock:
            for name, r in snapshot.items():
                # a record made after the listing is another object: left alone
                if self._live.get(name) is r and seen.get(name) != (self.own_uid, r.generation):
                    del self._live[name]
                    dropped = True
                    log.info("replica %r (uid %d's, generation %s) is gone from dlpackd: no "
                             "longer charged", name, r.uid, r.generation)
            if dropped:
                self._save()
        return seen.get(local)

    def reserve(self, dl, uid, local, nbytes):
        """Allow uid's fetch of nbytes into local, before anything is allocated, or raise the
        OSError that says why not: another uid's replica there (EPERM), a name the bridge did
        not publish (EEXIST), a fetch into it under way (EAGAIN), uid's limits (EDQUOT)."""
        there = self._look(dl, local)
        with self._lock:
            if local in self._pending:
                raise BlockingIOError(errno.EAGAIN, f"{local!r}: another fetch into it is under "
                                      "way")
            cur = self._live.get(local)
            if cur is not None and cur.uid != uid:
                raise PermissionError(errno.EPERM, f"{local!r} holds the replica uid {cur.uid} "
                                      f"fetched: uid {uid} may not replace it (only its own)")
            if cur is None and there is not None:
                if there[0] != self.own_uid:
                    raise FileExistsError(errno.EEXIST, f"{local!r} is published by uid "
                                          f"{there[0]}, not by the bridge")
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

    def commit(self, local, generation):
        """The reserved fetch into local was published as generation: it is live, in place
        of the replica it replaced."""
        with self._lock:
            r = self._pending.pop(local)
            r.generation = generation
            self._live[local] = r
            self._save()

    def cancel(self, local):
        """The reserved fetch into local failed: the replica it was to replace stays."""
        with self._lock:
            self._pending.pop(local, None)

    def forget(self, local, generation=None):
        """The bridge unpublished local itself (the replica of that generation, if given)."""
        with self._lock:
            r = self._live.get(local)
            if r is not None and generation in (None, r.generation):
                del self._live[local]
                self._save()

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
