# SPDX-License-Identifier: Apache-2.0
"""The importing side: the control connection to one peer bridge, fetches and stats over it."""
import base64
import ctypes
import errno
import logging
import mmap
import random
import socket
import threading
import time

from . import _cuda, _nixl, _replicas, _wire
from ._nixl import _span

# How long to wait for a peer's TCP connect, in seconds, when the fetch has no timeout.
CONNECT_TIMEOUT = 10.0
# TCP keepalive on control connections: idle seconds, interval, probes (a dead peer is noticed
# in about 11 s even when no request is pending).
KEEPALIVE = (5, 2, 3)
# Between two polls of a transfer's state or of the notifications, in seconds.
POLL = 0.0002
# However long the caller lets a fetch take (timeout None included), the importer waits at most
# LAYOUT_TIMEOUT seconds for the answer to its get, and for the transfer at most its own
# deadline, transfer_deadline(bytes): TRANSFER_GRACE plus the bytes at TRANSFER_MIN_RATE (bytes a
# second), the slowest rate the bridge accepts. Both sides compute it from the layout (the
# exporter from the one it sent, the importer from the one it got) and the exporter gives up on
# the WRITE by then, so a peer that stalls cannot hold the per-peer lock for ever, and a large
# entry is not cut short by the lease TTL.
LAYOUT_TIMEOUT = 30.0
TRANSFER_GRACE = 10.0
TRANSFER_MIN_RATE = 64 << 20
# A fetch the peer refuses with an EAGAIN that says to try again (_wire.TRY_AGAIN: a limit of
# the peer's that frees soon, such as its connections not authenticated yet or PEERS_MAX while
# connecting, or its bytes under lease, quarantine or --staging-max for the get) is made again,
# REFUSED_TRIES times in all, after a pause that doubles from REFUSED_BACKOFF_FIRST seconds up
# to REFUSED_BACKOFF_MAX, of which a random half is left out so that importers refused together
# do not come back together. A pause that would end past the fetch's deadline is not taken:
# the fetch fails at once with the last refusal, as it does once the tries are spent.
REFUSED_TRIES = 6
REFUSED_BACKOFF_FIRST = 0.2
REFUSED_BACKOFF_MAX = 5.0


# What dlpack_ipc's allocation errors that are not OSError mean (python/src/errors.c).
_ALLOC_ERRNO = {MemoryError: errno.ENOMEM, BufferError: errno.EOPNOTSUPP}


def _alloc(dl, spec, bundle, device):
    """A replica's memory: {key: SharedTensor} for spec ({key: (shape, dtype)}) on device
    (None: the host)."""
    kw = {} if device is None else {"device": device}
    if bundle:
        return dl.empty_dict(spec, **kw)
    (k, (shape, dtype)), = spec.items()
    return {k: dl.empty(shape, dtype, **kw)}


def transfer_deadline(nbytes):
    """Seconds a transfer of nbytes may take: TRANSFER_GRACE + nbytes / TRANSFER_MIN_RATE."""
    return TRANSFER_GRACE + nbytes / TRANSFER_MIN_RATE


log = logging.getLogger("dlpackd-bridge")


def keepalive(sock):
    """TCP keepalive (KEEPALIVE) and no Nagle on a control connection."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, intvl, cnt = KEEPALIVE
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, intvl)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, cnt)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# The replica's pages (allocated by dlpc_alloc's reservation) are mapped here ahead of the WRITE
# by a thread of their own (MADV_POPULATE_WRITE, Linux 5.14), POPULATE_CHUNK bytes at a time in
# the order the WRITE fills them: the receiving side then copies into mapped pages instead of
# taking a fault per 4 KiB page (docs/bridge.md, Limits: what it saved). The exporter maps the
# entry it serves so as well (MADV_POPULATE_READ), once the WRITE starts.
POPULATE_CHUNK = 8 << 20
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
_ADVICE = {MADV_POPULATE_READ: "MADV_POPULATE_READ", MADV_POPULATE_WRITE: "MADV_POPULATE_WRITE"}
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class _Populate(threading.Thread):
    """Populate the (address, length) ranges in a thread with advice (MADV_POPULATE_WRITE, or
    _READ), chunk by chunk, until done or stopped; a kernel without it ends it at the first
    chunk (logged)."""

    def __init__(self, ranges, advice=MADV_POPULATE_WRITE):
        super().__init__(name="populate", daemon=True)
        self.ranges = ranges
        self.advice = advice
        self._halt = threading.Event()
        self.start()

    def run(self):
        page = mmap.PAGESIZE
        for addr, n in self.ranges:
            end = addr + n
            a = addr & ~(page - 1)
            while a < end and not self._halt.is_set():
                b = min(end, a + POPULATE_CHUNK)
                if _libc.madvise(a, (b - a + page - 1) & ~(page - 1), self.advice):
                    log.info("pages are faulted in by the transfer: madvise(%s): %s",
                             _ADVICE[self.advice], errno.errorcode.get(ctypes.get_errno()))
                    return
                a = b

    def finish(self):
        self._halt.set()
        self.join()


def _bound(deadline, seconds):
    """The earlier of deadline (None: none) and seconds from now."""
    limit = time.monotonic() + seconds
    return limit if deadline is None else min(deadline, limit)


def _left(deadline, what):
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(errno.ETIMEDOUT, f"timed out {what}")
    return left


# The ops of the frames a peer pushes unasked (a subscription's news, _push.py): they carry no
# request id, and whoever reads the connection hands them on.
PUSHES = ("changed", "gone")
# The pushes' reader (pump) holds the connection's lock for at most PUMP_FRAMES frames, and
# gives a frame it started reading at most PUMP_READ seconds to arrive whole: a request waits
# for the lock at most PUMP_FRAMES * PUMP_READ against a peer that trickles frames (the lock is
# not fair: after a full batch the waiter is likely, not certain, to take it next).
PUMP_FRAMES = 64
PUMP_READ = 2.0


def subscribe_error(frame, peer):
    """The OSError for a subscribe the peer answered with an error. Marked subscribe_refused
    only where the follow polls instead: an older bridge that knows no subscribe (EOPNOTSUPP),
    a connection's subscriptions full (EAGAIN), a name the peer cannot take (ENAMETOOLONG,
    EINVAL: asking again would not change it). Any other error (EIO: the peer's dlpackd could
    not be asked) is a failure, tried again; an export refusal (ENOENT) stays a plain
    FileNotFoundError."""
    message = str(frame.get("message"))
    if frame.get("errno") == "EPROTO" and "unknown op" in message:
        e = OSError(errno.EOPNOTSUPP, f"peer {peer} does not know subscribe (an older bridge: "
                    f"{message})")
    else:
        e = _wire.to_oserror(frame, f"peer {peer} refused the subscription"
                             if frame.get("errno") == "EAGAIN" else
                             f"peer {peer} could not set up the subscription")
    if e.errno in (errno.EOPNOTSUPP, errno.EAGAIN, errno.ENAMETOOLONG, errno.EINVAL):
        e.subscribe_refused = True  # type: ignore[attr-defined]
    return e


class Forgotten(ConnectionAbortedError):
    """The link was dropped from the peers found in the registry before this fetch took it:
    the caller asks for the peer's link again."""


class _Stale(Exception):
    """The peer closed the connection before it answered a get: nothing was leased."""


class PeerLink:
    """The importing side's control connection to one peer bridge, made on first use."""

    def __init__(self, bridge, name, addr, resolve=None):
        self.bridge = bridge
        self.name = name
        # (host, port); None until resolve(self) first sets it, for a peer to be looked up
        self.addr = addr
        self.where = "not looked up yet" if addr is None else f"{addr[0]}:{addr[1]}"
        # resolve(self, deadline) is called before each new connection and may change addr;
        # looked_up is when it last looked (time.monotonic(), None: never)
        self._resolve = resolve
        self.looked_up = None
        self.lock = threading.Lock()
        self.sock = None
        self.agent = None           # the peer's agent, loaded into nixl
        self.nixl = None            # this bridge's agent the connection was made with (held)
        self._rid = 0
        # each new connection's number: a subscription lives on the one it was made on
        self.epoch = 0
        self.follows = {}           # rname -> [_push.Follow], set up before any thread runs
        self._no_subscribe = None   # the agent of a peer that knows no subscribe
        # the number of the last frame read from the peer (all connections), and of the last
        # answer among them: a push numbered below an answer was sent before it
        self.frames = 0
        self.answered = 0
        # set (under self.lock) when the bridge dropped this link from the peers it found in
        # the registry: a fetch that got it just before asks for the peer's link again
        self.forgotten = False

    def connected(self):
        return self.sock is not None

    def _connect(self, deadline):
        if self._resolve is not None:
            self._resolve(self, deadline)
        left = _left(deadline, f"connecting to {self.where}")
        try:
            sock = socket.create_connection(self.addr, timeout=min(left or CONNECT_TIMEOUT,
                                                                   CONNECT_TIMEOUT))
        except socket.timeout:
            raise TimeoutError(errno.ETIMEDOUT, f"connecting to {self.where} timed out") \
                from None
        # the agent in use now serves this connection to its end (a replaced one too)
        nixl = self.bridge.agents.hold()
        agent = None
        try:
            keepalive(sock)
            _wire.auth_client(sock, self.bridge.token, nixl.name, self.name)
            f = _wire.recv(sock, time.monotonic() + _wire.AUTH_TIMEOUT)
            if f["op"] == "error":          # welcomed, then refused (PEERS_MAX)
                raise _wire.to_oserror(f, f"peer {self.name} refused the connection")
            if f["op"] != "metadata":
                raise _wire.FrameError("EPROTO", f"expected metadata, got {f['op']!r}")
            agent, _ = self.bridge.agents.load(nixl, _wire.metadata(f))
            _wire.send(sock, {"op": "metadata", "metadata":
                              base64.b64encode(nixl.metadata()).decode()})
        except BaseException as e:
            sock.close()
            if agent is not None:
                self.bridge.agents.unload(nixl, agent)
            self.bridge.agents.let_go(nixl)
            if isinstance(e, _wire.FrameError):
                raise ConnectionError(errno.EPROTO, f"protocol error: {e}") from None
            raise
        self.sock, self.agent, self.nixl = sock, agent, nixl
        self.epoch += 1
        log.info("connected to peer %s at %s (agent %s)", self.name, self.where, agent)

    def drop(self):
        """Close the connection and remove the peer's agent; whether that agent is gone (its
        UCX connections closed: it can no longer write here)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            for follows in self.follows.values():
                for follow in follows:
                    follow.lost()
        removed = True
        if self.agent is not None:
            # (not removed while another connection holds the same agent: not fenced off)
            removed = self.bridge.agents.unload(self.nixl, self.agent)
            self.agent = None
        if self.nixl is not None:
            self.bridge.agents.let_go(self.nixl)
            self.nixl = None
        return removed

    def close_if_retired(self):
        """Close the connection if it is idle and was made with an agent this bridge has
        since replaced (_nixl.Agents): the next use connects again with the agent in use."""
        if not self.lock.acquire(blocking=False):
            return              # in use: its next use looks (_renew)
        try:
            self._renew()
        finally:
            self.lock.release()

    def _renew(self):
        """Close the connection if it was made with an agent since replaced, so that the use
        about to start (or the next one) connects with the agent in use; the caller holds the
        lock. Each use looks, as well as the housekeeping thread: a link busy with one fetch
        after another is never idle at its tick."""
        if self.sock is not None and self.bridge.agents.retired(self.nixl):
            log.info("closing the connection to peer %s, made with NIXL agent %s, since "
                     "replaced", self.name, self.nixl.name)
            self.drop()

    def _read(self, sock, deadline):
        """The next frame from sock (_wire.recv), numbered; the caller holds the lock."""
        f = _wire.recv(sock, deadline)
        self.frames += 1
        return f

    def _recv(self, deadline, what):
        """The next frame, or None when it was a push (handed on)."""
        try:
            f = self._read(self.sock, deadline)
        except TimeoutError:
            raise TimeoutError(errno.ETIMEDOUT, f"timed out {what}") from None
        except ConnectionResetError:
            raise ConnectionResetError(errno.ECONNRESET, f"connection lost {what}") from None
        except _wire.FrameError as e:
            raise ConnectionError(errno.EPROTO, f"protocol error {what}: {e}") from None
        return None if self._pushed(f) else f

    def _answer(self, deadline):
        """The next frame that is not a push (pushes are handed on on the way); _wire.recv's
        exceptions."""
        while True:
            f = self._read(self.sock, deadline)
            if not self._pushed(f):
                self.answered = self.frames
                return f

    def _pushed(self, f):
        """Whether f (the last frame read) is a push; if so, handed to the follows of its
        name with its number (a push for a name nothing here follows is dropped)."""
        if f["op"] not in PUSHES or "id" in f:
            return False
        name = f.get("name")
        for follow in self.follows.get(name, ()) if isinstance(name, str) else ():
            follow.push(f, self.frames)
        return True

    def pump(self, timeout):
        """Read what the peer pushed while no request is in flight, waiting up to timeout;
        False when there is no connection (or it was lost here)."""
        sock = self.sock
        if sock is None:
            return False
        try:
            if not _wire.readable(sock, timeout):
                return True
        except (OSError, ValueError):         # closed by a request meanwhile
            return False
        if not self.lock.acquire(blocking=False):
            time.sleep(0.05)                  # the request in flight reads it
            return True
        try:
            # bounded: a request waiting for the lock waits at most PUMP_FRAMES frames
            for _ in range(PUMP_FRAMES):
                if self.sock is not sock or not _wire.readable(sock, 0):
                    break
                try:
                    f = self._read(sock, time.monotonic() + PUMP_READ)
                except (OSError, _wire.FrameError) as e:
                    log.info("connection to peer %s lost: %s", self.name, e)
                    self.drop()
                    return False
                if not self._pushed(f):
                    log.warning("peer %s sent %r unasked: disconnecting", self.name, f["op"])
                    self.drop()
                    return False
            return True
        finally:
            self.lock.release()

    def refuses_subscribe(self):
        """Whether the peer connected now is known to know no subscribe (an older bridge)."""
        return self.agent is not None and self.agent == self._no_subscribe

    def _ask(self, frame, deadline, what):
        """Send frame, connecting first if needed (and once more if the idle connection was
        found dead), and return the answer; the caller holds the lock."""
        for attempt in (0, 1):
            self._renew()
            if self.sock is None:
                self._connect(deadline)
            self._rid += 1
            try:
                _wire.send(self.sock, {**frame, "id": self._rid})
                return self._answer(deadline)
            except (ConnectionResetError, BrokenPipeError):
                self.drop()
                if attempt:
                    raise
            except (TimeoutError, _wire.FrameError) as e:
                self.drop()
                raise TimeoutError(errno.ETIMEDOUT, f"{what}: {e}") from None
        raise AssertionError("not reached")

    def _lock_until(self, deadline):
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(errno.ETIMEDOUT, "timed out waiting for a fetch from this peer")

    def subscribe(self, rname, deadline):
        """Subscribe to rname's changes on this peer: ((generation, created_ns) there now, or
        None when it has no such entry; the connection's epoch; the answer's frame number).
        FileNotFoundError if rname is not exported; an OSError marked subscribe_refused when the
        peer refuses (subscribe_error)."""
        self._lock_until(deadline)
        try:
            self._renew()
            if self.sock is None:
                self._connect(deadline)
            if self.refuses_subscribe():
                e = OSError(errno.EOPNOTSUPP, f"peer {self.name} does not know subscribe (an "
                            "older bridge)")
                e.subscribe_refused = True  # type: ignore[attr-defined]
                raise e
            f = self._ask({"op": "subscribe", "name": rname}, deadline,
                          f"subscription to {rname!r}")
            if f["op"] == "error":
                e = subscribe_error(f, self.name)
                if getattr(e, "subscribe_refused", False) and e.errno == errno.EOPNOTSUPP:
                    self._no_subscribe = self.agent
                    self.drop()             # an older bridge closes it after that refusal
                raise e
            if f["op"] != "subscribed" or f.get("name") != rname:
                self.drop()
                raise ConnectionError(errno.EPROTO, f"expected subscribed, got {f['op']!r}")
            gen = f.get("generation")
            return (None if gen is None else (gen, f.get("created_ns"))), self.epoch, \
                self.answered
        finally:
            self.lock.release()

    def fetch(self, dl, rname, local, deadline, uid, layout=None):
        """Get rname from this peer and publish it here as local, a replica charged to uid
        (the local caller's; the bridge's own for --follow); the remote generation. A dict
        given as layout gets what the peer's layout said of the entry fetched: "generation",
        "created_ns" (None from an older peer) and "frame", the answer's frame number. A
        refusal of the peer's that says to try again is tried again (REFUSED_TRIES), the
        link's lock let go of in between."""
        for tried in range(1, REFUSED_TRIES + 1):
            try:
                return self._fetch_once(dl, rname, local, deadline, uid, layout)
            except OSError as e:
                if not getattr(e, "try_again", False) or tried == REFUSED_TRIES:
                    raise
                cap = min(REFUSED_BACKOFF_MAX, REFUSED_BACKOFF_FIRST * 2 ** (tried - 1))
                pause = cap / 2 + random.uniform(0, cap / 2)
                if deadline is not None and time.monotonic() + pause >= deadline:
                    raise
                log.info("fetch of %r from %s refused (%d of REFUSED_TRIES %d): %s; trying "
                         "again in %.2f s", rname, self.name, tried, REFUSED_TRIES,
                         e.strerror, pause)
                if self.bridge.stop.wait(pause):
                    raise
        raise AssertionError("not reached")

    def _fetch_once(self, dl, rname, local, deadline, uid, layout):
        """fetch(), one try."""
        if not self.lock.acquire(timeout=-1 if deadline is None else
                                 max(0.0, deadline - time.monotonic())):
            raise TimeoutError(errno.ETIMEDOUT, "timed out waiting for another fetch from "
                               "this peer")
        try:
            if self.forgotten:
                raise Forgotten(errno.ECONNABORTED, f"the link to {self.name} was dropped")
            if self.bridge.quarantine.full():
                raise BlockingIOError(errno.EAGAIN, f"{_nixl.QUARANTINE_MAX} failed transfers "
                                      "are in quarantine (QUARANTINE_MAX): try again later")
            self._renew()
            if self.sock is None:
                self._connect(deadline)
            try:
                return self._guarded(dl, rname, local, deadline, uid, layout)
            except _Stale:
                # the idle connection was dead (the peer restarted): one new one, at once
                log.info("connection to peer %s was lost while idle: reconnecting", self.name)
                self._connect(deadline)
                try:
                    return self._guarded(dl, rname, local, deadline, uid, layout)
                except _Stale:
                    raise ConnectionResetError(errno.ECONNRESET, "the peer closed the "
                                               "connection before answering") from None
        finally:
            self.lock.release()

    def _guarded(self, dl, rname, local, deadline, uid, layout):
        """_fetch, dropping the connection unless the peer answered the get in good order."""
        try:
            return self._fetch(dl, rname, local, deadline, uid, layout)
        except _Stale:
            self.drop()
            raise
        except OSError as e:
            if not getattr(e, "peer_answer", False):
                self.drop()
            raise
        except Exception:
            self.drop()            # the connection's state is unknown
            raise

    def stat(self, rname, deadline):
        """((generation, created_ns) of rname on this peer, the answer's frame number);
        FileNotFoundError if it has none (its frame number as e.frame)."""
        self._lock_until(deadline)
        try:
            f = self._ask({"op": "stat", "name": rname}, deadline, f"stat of {rname!r}")
            if f["op"] == "error":
                e = _wire.to_oserror(f, f"peer {self.name}")
                e.frame = self.answered     # type: ignore[attr-defined]
                raise e
            return (f["generation"], f["created_ns"]), self.answered
        finally:
            self.lock.release()

    def _fetch(self, dl, rname, local, deadline, uid, layout):
        self._rid += 1
        rid = self._rid
        t0 = time.monotonic()
        try:
            # "devices": the kinds of entry this bridge takes besides host ones (an older
            # exporter ignores it and refuses device entries)
            devices, why = self.bridge.takes_devices()
            get = {"op": "get", "id": rid, "name": rname}
            if devices:
                get["devices"] = devices
            _wire.send(self.sock, get)
            f = self._answer(_bound(deadline, LAYOUT_TIMEOUT))
            if f["op"] == "staging" and f.get("id") == rid:
                # a device entry copied to host memory first: that long more, once, for at
                # most as many bytes as one uid's replicas may hold (more cannot be taken)
                n = f.get("bytes")
                if not devices or isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise _wire.FrameError("EPROTO", f"staging of {str(n)[:32]!r} bytes" +
                                           ("" if devices else " for a get of host entries"))
                n = min(n, self.bridge.replicas.bytes_max)
                f = self._answer(_bound(deadline, LAYOUT_TIMEOUT + transfer_deadline(n)))
        except (ConnectionResetError, BrokenPipeError):
            raise _Stale() from None
        except TimeoutError:
            raise TimeoutError(errno.ETIMEDOUT, "timed out waiting for the layout (LAYOUT_TIMEOUT "
                               f"{LAYOUT_TIMEOUT:g} s, or the fetch's timeout)") from None
        except _wire.FrameError as e:
            raise ConnectionError(errno.EPROTO, f"protocol error waiting for the layout: {e}") \
                from None
        if f["op"] == "error":
            err = _wire.to_oserror(f, "the peer says")
            if err.errno == errno.EOPNOTSUPP and why:
                err = OSError(err.errno, f"{err.strerror} (this bridge takes no device "
                              f"entries: {why})")
            err.peer_answer = True  # type: ignore[attr-defined]  # the connection stays
            err.frame = self.answered  # type: ignore[attr-defined]
            raise err
        if f["op"] != "layout" or f.get("id") != rid:
            raise ConnectionError(errno.EPROTO, f"expected the layout, got {f['op']!r}")
        lid, gen, tensors, bundle = str(f["lease"]), f["generation"], f["tensors"], f["bundle"]
        device = f.get("device")
        if device is not None and not (isinstance(device, str) and len(device) <= 16 and
                                       device.startswith("cuda:") and device[5:].isascii() and
                                       device[5:].isdigit()):
            raise ConnectionError(errno.EPROTO, f"layout on device {str(device)[:32]!r}")
        if layout is not None:
            layout.update(generation=gen, created_ns=f.get("created_ns"), frame=self.answered)
        ttl = f.get("ttl")
        if not isinstance(ttl, (int, float)) or not ttl > 0:
            raise ConnectionError(errno.EPROTO, f"layout with a lease TTL of {ttl!r}")
        t1 = time.monotonic()
        # sized and charged to the caller's uid before anything is allocated: a peer that
        # announces a huge layout is refused here (ValueError: a malformed one)
        nbytes = _replicas.layout_bytes(tensors)
        try:
            self.bridge.replicas.reserve(dl, uid, local, nbytes)
        except OSError as e:
            _wire.send(self.sock, {"op": "release", "lease": lid})
            e.peer_answer = True    # type: ignore[attr-defined]  # the connection stays
            raise
        try:
            gen_here = self._transfer(dl, rname, local, deadline, rid, lid, tensors, bundle,
                                      device)
        except BaseException:
            self.bridge.replicas.cancel(local)
            raise
        self.bridge.replicas.commit(local, gen_here)
        log.info("fetched %r from %s (generation %d, %d bytes) for uid %d in %.3f s, layout "
                 "%.3f", rname, self.name, gen, nbytes, uid, time.monotonic() - t0, t1 - t0)
        return gen

    def _transfer(self, dl, rname, local, deadline, rid, lid, tensors, bundle, device):
        """Allocate the replica, have the peer WRITE into it, publish it as local; its local
        generation. A device entry (device "cuda:N" on the peer) lands in host memory and is
        copied from there to a replica on this host's --cuda-device."""
        spec = {k: (tuple(shape), dtype) for k, dtype, shape, _ in tensors}
        if device is None:
            return self._land(dl, rname, local, deadline, rid, lid, spec, bundle, None)
        here = f"cuda:{self.bridge.cuda_device}"
        try:
            replica = _alloc(dl, spec, bundle, here)
        except (OSError, ValueError, TypeError, MemoryError, BufferError) as e:
            _wire.send(self.sock, {"op": "release", "lease": lid})
            code = getattr(e, "errno", None) or _ALLOC_ERRNO.get(type(e), errno.EINVAL)
            e2 = OSError(code, f"{rname!r} is a device entry ({device} on peer {self.name}), "
                         f"and its replica cannot be allocated on {here} (--cuda-device): "
                         f"{str(e) or type(e).__name__}")
            e2.peer_answer = True   # type: ignore[attr-defined]  # the connection stays
            raise e2 from None
        try:
            return self._land(dl, rname, local, deadline, rid, lid, spec, bundle,
                              (here, replica))
        finally:
            for t in replica.values():
                t.release()

    def _land(self, dl, rname, local, deadline, rid, lid, spec, bundle, onto):
        """_transfer's work: the bytes land in host memory, and are published from there, or
        from onto's (device, {key: SharedTensor}) after a copy. The connection's agent is held
        throughout: a failed transfer drops the connection before its memory goes to
        quarantine."""
        nixl = self.bridge.agents.hold(self.nixl)
        try:
            return self._land_with(nixl, dl, rname, local, deadline, rid, lid, spec, bundle,
                                   onto)
        finally:
            self.bridge.agents.let_go(nixl)

    def _land_with(self, nixl, dl, rname, local, deadline, rid, lid, spec, bundle, onto):
        t1 = time.monotonic()
        try:
            alloc = _alloc(dl, spec, bundle, None)
        except (OSError, ValueError, TypeError, MemoryError) as e:
            _wire.send(self.sock, {"op": "release", "lease": lid})
            raise OSError(getattr(e, "errno", None) or _ALLOC_ERRNO.get(type(e), errno.EINVAL),
                          f"cannot allocate the replica: {str(e) or type(e).__name__}") \
                from None
        live = [t for t in alloc.values() if t.nbytes]
        pop = _Populate([(t.data_ptr, t.nbytes) for t in live]) if live else None
        try:
            reg = nixl.register(*_span(live)) if live else None
        except BaseException:
            if pop is not None:
                pop.finish()
            raise
        t2 = time.monotonic()
        landed = False
        # whether the exporter may have written: the put left, and no answer said that nothing
        # was posted (an error other than EIO's "WRITE failed" comes before any WRITE)
        posted = False
        tlimit = transfer_deadline(sum(t.nbytes for t in live))
        tdeadline = _bound(deadline, tlimit)
        try:
            md = nixl.partial_metadata(reg) if live else b""
            self.sock.settimeout(_left(tdeadline, f"sending the descriptors of {rname!r}"))
            posted = True      # (a put cut short may have been read whole)
            _wire.send(self.sock, {"op": "put", "id": rid, "lease": lid,
                                   "metadata": base64.b64encode(md).decode(),
                                   "descs": [[t.data_ptr, t.nbytes] for t in live]})
            done = False
            notified = not live
            what = f"waiting for the transfer of {rname!r} ({tlimit:g} s: TRANSFER_GRACE " \
                f"{TRANSFER_GRACE:g} s + its bytes at TRANSFER_MIN_RATE, or the fetch's timeout)"
            while not (done and notified):
                _left(tdeadline, what)
                if not notified:
                    notified = nixl.notified(self.agent, lid.encode())
                if not done and _wire.readable(self.sock, 0 if not notified else 0.05):
                    f = self._recv(tdeadline, what)
                    if f is None:
                        continue            # a push, handed on
                    if f["op"] == "error":
                        posted = f.get("errno") == "EIO"
                        raise _wire.to_oserror(f, "transfer failed")
                    if f["op"] != "done" or f.get("lease") != lid:
                        raise ConnectionError(errno.EPROTO, f"expected done, got {f['op']!r}")
                    done = True
                elif not notified:
                    time.sleep(POLL)
            landed = True
        finally:
            if pop is not None:
                pop.finish()
            if landed or reg is None:
                if reg is not None:
                    nixl.deregister(reg)
            else:
                # the exporter may still be writing into it: close the control connection
                # (it cancels there), remove its agent (UCX closes its connection: nothing
                # lands later) and keep the memory registered for a while; kept for good if
                # the agent could not be removed. If a WRITE may have started, this bridge's
                # agent is replaced: only its end frees what UCX may keep of that connection.
                # (Nothing posted, nothing to fence off: the exporter wrote nothing.)
                fenced = self.drop() or not posted
                self.bridge.quarantine.add(nixl, f"replica of {rname!r} from {self.name}",
                                           None, reg, alloc.values(), fenced=fenced)
                if posted:
                    self.bridge.agents.aborted(nixl)
        t3 = time.monotonic()
        n = sum(t.nbytes for t in live)
        try:
            out = alloc
            if onto is not None:
                here, out = onto
                _cuda.to_device(here, [(out[k].data_ptr, t.data_ptr, t.nbytes)
                                       for k, t in alloc.items()])
            if bundle:
                gen_here = dl.publish_dict(local, out, replace=True)
            else:
                gen_here = dl.publish(local, out[""], replace=True)
        finally:
            for t in alloc.values():
                t.release()
        t4 = time.monotonic()
        log.info("fetched %r from %s (%d bytes): allocate and register %.3f s, transfer %.3f "
                 "(%.2f GB/s), publish %.3f", rname, self.name, n, t2 - t1, t3 - t2,
                 n / max(t3 - t2, 1e-9) / 1e9, t4 - t3)
        return gen_here
