# SPDX-License-Identifier: Apache-2.0
"""dlpackd-bridge: one per host, an ordinary dlpackd client that moves entries between hosts
over NIXL (docs/bridge.md).

Threads: one accepts peers on --listen and one accepts local clients on --socket; each
connection gets a thread of its own that does all of its work (its leases included), and one
housekeeping thread gives back what an aborted transfer left in quarantine. The NIXL agent is
shared; its calls are serialized by NIXL itself (NIXL_THREAD_SYNC_STRICT).
"""
import base64
import errno
import logging
import os
import socket
import stat
import sys
import threading
import time

import dlpack_ipc

from . import _wire

# How long an exporter keeps a lease (and its dlpackd reference) for an importer that asked for
# a name's layout and has not sent its descriptors yet; also the longest one WRITE may take.
# --lease-ttl sets it.
LEASE_TTL = 30.0
# What an aborted transfer leaves registered (and mapped), in seconds, before it is
# deregistered and released: a WRITE the peer may still have in flight never lands in (or reads
# from) memory that is gone.
QUARANTINE = 60.0
# TCP keepalive on control connections: idle seconds, interval, probes (a dead peer is noticed
# in about 11 s even when no request is pending).
KEEPALIVE = (5, 2, 3)
# How long to wait for a peer's TCP connect, in seconds, when the fetch has no timeout.
CONNECT_TIMEOUT = 10.0
# A control connection's thread looks at its leases this often, in seconds.
TICK = 0.25
# Between two polls of a transfer's state or of the notifications, in seconds.
POLL = 0.0002
# Leases one peer connection may hold at once (each is a dlpackd reference).
LEASES_MAX = 64
# Local clients the bridge serves at once, and peers it accepts at once.
CLIENTS_MAX = 64
PEERS_MAX = 64

log = logging.getLogger("dlpackd-bridge")


def _keepalive(sock):
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, intvl, cnt = KEEPALIVE
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, intvl)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, cnt)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def parse_addr(text, what):
    """ADDR:PORT (or [V6ADDR]:PORT) to (host, port); ValueError naming what."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r} is not ADDR:PORT")
    return host.strip("[]"), int(port)


class Nixl:
    """The bridge's one NIXL agent, host memory only, WRITE over UCX."""

    def __init__(self, name, progress_thread):
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                 sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = nixl_agent(name, conf)
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend here")
        self.name = name
        self._lock = threading.Lock()
        self._notifs = set()
        self.registered = 0         # registrations not given back yet

    def metadata(self):
        return self.agent.get_agent_metadata()

    def add_remote(self, blob):
        return _text(self.agent.add_remote_agent(blob))

    def remove_remote(self, agent):
        try:
            self.agent.remove_remote_agent(agent)
        except Exception as e:  # a peer that never connected over UCX has nothing to remove
            log.debug("removing agent %s: %s", agent, e)
        with self._lock:
            self._notifs = {n for n in self._notifs if n[0] != agent}

    def register(self, base, length):
        reg = self.agent.register_memory([(base, length, 0, "")], "DRAM")
        with self._lock:
            self.registered += 1
        return reg

    def partial_metadata(self, reg):
        """What a peer needs to reach the registration reg (loaded with add_remote)."""
        return self.agent.get_partial_agent_metadata(reg, False, ["UCX"])

    def deregister(self, reg):
        self.agent.deregister_memory(reg)
        with self._lock:
            self.registered -= 1

    def write(self, local, remote, agent, notif):
        """Post a WRITE of the (addr, len) list local into remote on agent; the handle."""
        lo = self.agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
        re = self.agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
        h = self.agent.initialize_xfer("WRITE", lo, re, agent, notif)
        return h, self.agent.transfer(h)

    def state(self, h):
        return self.agent.check_xfer_state(h)

    def release(self, h):
        self.agent.release_xfer_handle(h)

    def notified(self, agent, msg):
        """Whether agent sent notification msg (consumed if so); progresses the worker."""
        with self._lock:
            for a, msgs in self.agent.get_new_notifs().items():
                for m in msgs:
                    self._notifs.add((_text(a), bytes(m)))
            if (agent, msg) in self._notifs:
                self._notifs.discard((agent, msg))
                return True
        return False


def _text(name):
    return name.decode() if isinstance(name, bytes) else name


class Quarantine:
    """What an aborted transfer left registered: deregistered and released after QUARANTINE."""

    def __init__(self, nixl, seconds=QUARANTINE):
        self.seconds = seconds
        self._nixl = nixl
        self._lock = threading.Lock()
        self._items = []

    def add(self, why, xfer=None, reg=None, tensors=()):
        log.warning("quarantined for %.0f s: %s", self.seconds, why)
        with self._lock:
            self._items.append((time.monotonic() + self.seconds, why, xfer, reg, list(tensors)))

    def __len__(self):
        with self._lock:
            return len(self._items)

    def sweep(self, all_=False):
        now = time.monotonic()
        with self._lock:
            due = [i for i in self._items if all_ or i[0] <= now]
            self._items = [i for i in self._items if i not in due]
        for _, why, xfer, reg, tensors in due:
            # the order matters: the transfer, then the registration, then the mapping
            if xfer is not None:
                _quiet(self._nixl.release, xfer)
            if reg is not None:
                _quiet(self._nixl.deregister, reg)
            for t in tensors:
                t.release()
            log.info("released after quarantine: %s", why)


def _quiet(fn, *args):
    try:
        fn(*args)
    except Exception as e:
        log.warning("%s: %s", getattr(fn, "__name__", fn), e)


def _span(tensors):
    """The (base, length) that covers every tensor with bytes (one mapping: one storage)."""
    live = [t for t in tensors if t.nbytes]
    if not live:
        return None
    base = min(t.data_ptr for t in live)
    return base, max(t.data_ptr + t.nbytes for t in live) - base


class Lease:
    """An exported entry held for one importer: the attach is the dlpackd reference."""

    def __init__(self, lid, name, generation, tensors, ttl):
        self.id = lid
        self.name = name
        self.generation = generation
        self.tensors = tensors          # [(key, SharedTensor)]
        self.expires = time.monotonic() + ttl


class Bridge:
    def __init__(self, args, token):
        self.args = args
        self.token = token
        self.exports = args.export or []
        self.ttl = args.lease_ttl
        self.peers = {}
        for p in args.peer or []:
            name, sep, addr = p.partition("=")
            if not sep or not name or ":" in name:
                raise ValueError(f"--peer {p!r} is not NAME=ADDR:PORT (NAME without ':')")
            self.peers[name] = PeerLink(self, name, parse_addr(addr, f"--peer {name}"))
        self.follow = []
        for name in getattr(args, "follow", None) or []:
            peer, sep, rname = name.partition(":")
            if not sep or peer not in self.peers or not rname:
                raise ValueError(f"--follow {name!r} is not PEER:NAME with a --peer PEER")
            self.follow.append((self.peers[peer], rname, name))
        self.host = socket.gethostname()
        self.agent_name = f"dlpackd-bridge/{self.host}/{time.time_ns()}"
        self.nixl = Nixl(self.agent_name, args.progress_thread)
        self.quarantine = Quarantine(self.nixl, args.quarantine)
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._lease_seq = 0
        self.leases = 0
        self.counts = {"served": 0, "fetched": 0, "refused": 0, "aborted": 0, "writing": 0}
        self._clients = threading.BoundedSemaphore(CLIENTS_MAX)
        self._peers_in = threading.BoundedSemaphore(PEERS_MAX)

    def count(self, what, n=1):
        with self._lock:
            self.counts[what] += n

    def dlpackd(self):
        return dlpack_ipc.Client(self.args.dlpackd_socket) if self.args.dlpackd_socket \
            else dlpack_ipc.Client()

    def exported(self, name):
        return any(name.startswith(p) for p in self.exports)

    def new_lease_id(self):
        with self._lock:
            self._lease_seq += 1
            self.leases += 1
            return f"{self.agent_name}/{self._lease_seq}"

    def lease_ended(self):
        with self._lock:
            self.leases -= 1

    # -- threads --------------------------------------------------------------------------

    def serve(self, tcp, unix):
        threads = [threading.Thread(target=self._housekeeping, name="housekeeping",
                                    daemon=True)]
        if tcp is not None:
            threads.append(threading.Thread(target=self._accept, args=(tcp, self._peer_thread,
                                            self._peers_in, "peer"), daemon=True))
        threads.append(threading.Thread(target=self._accept, args=(unix, self._client_thread,
                                        self._clients, "client"), daemon=True))
        for link, rname, local in self.follow:
            threads.append(threading.Thread(target=self._follow, args=(link, rname, local),
                                            daemon=True))
        for t in threads:
            t.start()
        while not self.stop.wait(1.0):
            pass

    def _follow(self, link, rname, local):
        """--follow: keep the replica local of link's rname fresh, by polling its generation
        every --follow-interval; unpublish the replica when the peer's entry is gone."""
        dl = self.dlpackd()
        seen = None            # (generation, created_ns) of the peer's entry last fetched
        wait = 0.0
        try:
            while not self.stop.wait(wait):
                wait = self.args.follow_interval
                try:
                    now = link.stat(rname, time.monotonic() + CONNECT_TIMEOUT)
                    if now != seen:
                        link.fetch(dl, rname, local, time.monotonic() + max(self.ttl, 60.0))
                        seen = now
                        self.count("fetched")
                except FileNotFoundError:
                    if seen is not None:
                        log.info("follow %r: gone on %s: unpublishing the replica", local,
                                 link.name)
                        try:
                            dl.unpublish(local)
                        except FileNotFoundError:
                            pass
                        seen = None
                except OSError as e:
                    log.warning("follow %r: %s; trying again in %s s", local, e, wait)
                except Exception:
                    log.exception("follow %r", local)
        finally:
            dl.close()

    def _housekeeping(self):
        while not self.stop.wait(1.0):
            self.quarantine.sweep()

    def _accept(self, lsock, target, slots, what):
        lsock.settimeout(0.5)
        while not self.stop.is_set():
            try:
                sock, addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self.stop.is_set():
                    return
                log.error("accepting a %s: %s", what, e)
                time.sleep(0.1)
                continue
            if not slots.acquire(blocking=False):
                log.warning("refusing a %s from %s: %d already served", what, addr,
                            CLIENTS_MAX if what == "client" else PEERS_MAX)
                _wire.send_error(sock, "EAGAIN", f"too many {what}s")
                sock.close()
                continue
            threading.Thread(target=self._run, args=(target, sock, addr, slots),
                             daemon=True).start()

    def _run(self, target, sock, addr, slots):
        try:
            target(sock, addr)
        except Exception:
            log.exception("connection from %s", addr)
        finally:
            sock.close()
            slots.release()

    # -- the exporting side: a peer's control connection ---------------------------------

    def _peer_thread(self, sock, addr):
        who = f"{addr[0]}:{addr[1]}"
        leases = {}
        remote = None
        dl = None
        try:
            _keepalive(sock)
            try:
                hello = _wire.auth_server(sock, self.token)
            except PermissionError as e:
                self.count("refused")
                log.warning("peer %s refused: %s", who, e.strerror or e)
                return
            who = f"{hello.get('from', '?')} at {who}"
            _wire.send(sock, {"op": "welcome", "agent": self.agent_name,
                              "metadata": base64.b64encode(self.nixl.metadata()).decode()})
            f = _wire.recv(sock, time.monotonic() + _wire.AUTH_TIMEOUT)
            if f["op"] != "metadata":
                raise _wire.FrameError("EPROTO", f"expected metadata, got {f['op']!r}")
            remote = self.nixl.add_remote(_metadata(f))
            log.info("peer %s connected (agent %s)", who, remote)
            dl = self.dlpackd()
            while not self.stop.is_set():
                self._expire(leases, who)
                if not _wire.readable(sock, TICK):
                    continue
                f = _wire.recv(sock, time.monotonic() + _wire.AUTH_TIMEOUT)
                op = f["op"]
                if op == "get":
                    self._get(sock, dl, f, leases, who)
                elif op == "put":
                    self._put(sock, f, leases, remote, who)
                elif op == "stat":
                    self._stat(sock, dl, f)
                elif op == "release":
                    self._end(leases.pop(str(f.get("lease")), None), "released")
                else:
                    raise _wire.FrameError("EPROTO", f"unknown op {op!r}")
        except _wire.FrameError as e:
            log.warning("peer %s: %s: disconnecting", who, e)
            _wire.send_error(sock, e.errname, str(e))
        except TimeoutError as e:
            log.warning("peer %s: %s: disconnecting", who, e)
        except ConnectionError as e:
            log.info("peer %s gone: %s", who, e)
        except OSError as e:
            log.warning("peer %s: %s: disconnecting", who, e)
        finally:
            for lease in list(leases.values()):
                self._end(lease, "connection lost")
            if remote is not None:
                self.nixl.remove_remote(remote)
            if dl is not None:
                dl.close()

    def _expire(self, leases, who):
        now = time.monotonic()
        for lid in [lid for lid, lease in leases.items() if lease.expires <= now]:
            log.info("peer %s: lease %s expired", who, lid)
            self._end(leases.pop(lid), "expired")

    def _end(self, lease, why):
        if lease is None:
            return
        for _, t in lease.tensors:
            t.release()
        lease.tensors = []
        self.lease_ended()
        log.debug("lease %s on %r ended: %s", lease.id, lease.name, why)

    def _stat(self, sock, dl, f):
        """A name's generation and creation time, for a peer that follows it."""
        rid, name = f.get("id"), f.get("name")
        if not isinstance(name, str) or not self.exported(name):
            return _wire.send(sock, _wire.error_frame(
                "ENOENT", f"{name!r} is not exported by this bridge", id=rid))
        try:
            found = [e for e in dl.list(name) if e.name == name]
        except (OSError, ValueError) as e:
            return _wire.send(sock, _wire.error_frame("EIO", f"{name!r}: {e}", id=rid))
        if not found:
            return _wire.send(sock, _wire.error_frame(
                "ENOENT", f"{name!r}: no entry named {name!r}", id=rid))
        _wire.send(sock, {"op": "stat", "id": rid, "generation": found[0].generation,
                          "created_ns": found[0].created_ns})

    def _get(self, sock, dl, f, leases, who):
        rid, name = f.get("id"), f.get("name")
        if not isinstance(name, str) or not self.exported(name):
            log.info("peer %s asked for %r, which is not exported", who, name)
            return _wire.send(sock, _wire.error_frame(
                "ENOENT", f"{name!r} is not exported by this bridge", id=rid))
        if len(leases) >= LEASES_MAX:
            return _wire.send(sock, _wire.error_frame(
                "EAGAIN", f"{name!r}: this connection holds {LEASES_MAX} leases (LEASES_MAX)",
                id=rid))
        try:
            ts = dl.attach_dict(name, timeout=0, mode="strict")
        except OSError as e:
            return _wire.send(sock, _wire.error_frame(
                errno.errorcode.get(e.errno, "EIO"), f"{name!r}: {e.strerror or e}", id=rid))
        except (ValueError, TypeError) as e:
            return _wire.send(sock, _wire.error_frame("EINVAL", f"{name!r}: {e}", id=rid))
        tensors = list(ts.items())
        if any(t.device != "cpu" for _, t in tensors):
            for _, t in tensors:
                t.release()
            return _wire.send(sock, _wire.error_frame(
                "EOPNOTSUPP", f"{name!r} is a device entry: the bridge moves host memory "
                "only", id=rid))
        gen = tensors[0][1].generation
        lease = Lease(self.new_lease_id(), name, gen, tensors, self.ttl)
        leases[lease.id] = lease
        bundle = not (len(tensors) == 1 and tensors[0][0] == "")
        _wire.send(sock, {"op": "layout", "id": rid, "lease": lease.id, "generation": gen,
                          "bundle": bundle, "ttl": self.ttl,
                          "tensors": [[k, t.dtype, list(t.shape), t.nbytes]
                                      for k, t in tensors]})

    def _put(self, sock, f, leases, remote, who):
        rid, lid = f.get("id"), str(f.get("lease"))
        lease = leases.get(lid)
        if lease is None:
            return _wire.send(sock, _wire.error_frame(
                "ESTALE", f"lease {lid} is not held (expired or released)", id=rid))
        live = [t for _, t in lease.tensors if t.nbytes]
        descs = f.get("descs")
        if (not isinstance(descs, list) or len(descs) != len(live) or
                any(not isinstance(d, list) or len(d) != 2 or d[1] != t.nbytes or
                    not isinstance(d[0], int) for d, t in zip(descs, live))):
            self._end(leases.pop(lid), "bad descriptors")
            raise _wire.FrameError("EPROTO", f"put for lease {lid}: descriptors do not "
                                   "match the layout")
        if not live:
            self._end(leases.pop(lid), "done (no bytes)")
            self.count("served")
            return _wire.send(sock, {"op": "done", "id": rid, "lease": lid})
        try:
            # the importer's registration of its replica: loaded for each transfer
            self.nixl.add_remote(_metadata(f))
        except _wire.FrameError:
            self._end(leases.pop(lid), "bad metadata")
            raise
        except Exception as e:
            self._end(leases.pop(lid), "metadata refused")
            return _wire.send(sock, _wire.error_frame(
                "EPROTO", f"put for lease {lid}: NIXL refused the metadata: {e!r}", id=rid))
        # registered only for the transfer; deregistered before the attach is dropped
        reg = self.nixl.register(*_span(live))
        xfer = None
        ok = False
        failure = None
        try:
            t0 = time.monotonic()
            self.count("writing")
            xfer, st = self.nixl.write([(t.data_ptr, t.nbytes) for t in live],
                                       [tuple(d) for d in descs], remote, lid.encode())
            deadline = t0 + self.ttl
            while st == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"WRITE of {lease.name!r} not done in {self.ttl} s")
                if _peer_closed(sock):
                    raise ConnectionResetError("importer closed the connection mid-transfer")
                time.sleep(POLL)
                st = self.nixl.state(xfer)
            if st != "DONE":
                raise ConnectionError(f"WRITE of {lease.name!r} failed ({st})")
            ok = True
        except (OSError, _wire.FrameError):
            raise
        except Exception as e:       # NIXL's own errors: this transfer fails, not the bridge
            failure = f"WRITE of {lease.name!r} failed: {e!r}"
            log.warning("peer %s: %s", who, failure)
        else:
            dt = time.monotonic() - t0
            n = sum(t.nbytes for t in live)
            log.info("peer %s: wrote %r (generation %d, %d bytes) in %.3f s, %.2f GB/s",
                     who, lease.name, lease.generation, n, dt, n / max(dt, 1e-9) / 1e9)
        finally:
            self.count("writing", -1)
            leases.pop(lid, None)
            if ok:
                self.nixl.release(xfer)
                self.nixl.deregister(reg)
                self._end(lease, "done")
            else:
                self.count("aborted")
                self.quarantine.add(f"WRITE of {lease.name!r} to {who}", xfer, reg,
                                    [t for _, t in lease.tensors])
                lease.tensors = []
                self.lease_ended()
        if failure is not None:
            return _wire.send(sock, _wire.error_frame("EIO", failure, id=rid))
        self.count("served")
        _wire.send(sock, {"op": "done", "id": rid, "lease": lid})

    # -- the local side ----------------------------------------------------------------------

    def _client_thread(self, sock, addr):
        dl = None
        try:
            while not self.stop.is_set():
                if not _wire.readable(sock, 0.5):
                    continue
                try:
                    f = _wire.recv(sock, time.monotonic() + _wire.AUTH_TIMEOUT)
                except ConnectionResetError:
                    return
                if f["op"] == "status":
                    reply = self.status()
                elif f["op"] == "fetch":
                    if dl is None:
                        dl = self.dlpackd()
                    reply = self._fetch(dl, f)
                else:
                    raise _wire.FrameError("EPROTO", f"unknown op {f['op']!r}")
                _wire.send(sock, reply)
        except _wire.FrameError as e:
            log.warning("local client: %s: disconnecting", e)
            _wire.send_error(sock, e.errname, str(e))
        except OSError as e:
            log.info("local client: %s", e)
        finally:
            if dl is not None:
                dl.close()

    def status(self):
        with self._lock:
            return {"op": "status", "agent": self.agent_name, "leases": self.leases,
                    "registered": self.nixl.registered,
                    "quarantined": len(self.quarantine), "exports": self.exports,
                    "peers": {n: p.connected() for n, p in self.peers.items()},
                    **self.counts}

    def _fetch(self, dl, f):
        name, timeout = f.get("name"), f.get("timeout")
        if not isinstance(name, str) or ":" not in name:
            return _wire.error_frame("EINVAL", f"{name!r} is not 'peer:name'")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            return _wire.error_frame("EINVAL", f"timeout {timeout!r} is not a number >= 0")
        if len(name.encode()) > dlpack_ipc.NAME_MAX:
            return _wire.error_frame("ENAMETOOLONG", f"{name!r} is longer than NAME_MAX "
                                     f"({dlpack_ipc.NAME_MAX} bytes)")
        peer, _, rname = name.partition(":")
        link = self.peers.get(peer)
        if link is None:
            return _wire.error_frame("ENOENT", f"no peer {peer!r} is configured "
                                     f"(--peer: {', '.join(self.peers) or 'none'})")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            gen = link.fetch(dl, rname, name, deadline)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("fetch %r: malformed answer from peer %s: %r", name, peer, e)
            return _wire.error_frame("EPROTO", f"peer {peer} ({link.where}), {rname!r}: "
                                     f"malformed answer: {e!r}")
        except OSError as e:
            code = errno.errorcode.get(e.errno) or (
                "ETIMEDOUT" if isinstance(e, TimeoutError) else
                "ECONNRESET" if isinstance(e, ConnectionError) else "EIO")
            log.info("fetch %r: %s", name, e)
            return _wire.error_frame(code, f"peer {peer} ({link.where}), {rname!r}: "
                                     f"{e.strerror or e}")
        except Exception as e:     # NIXL's own errors: this fetch fails, not the bridge
            log.warning("fetch %r: %r", name, e)
            return _wire.error_frame("EIO", f"peer {peer} ({link.where}), {rname!r}: {e!r}")
        self.count("fetched")
        return {"op": "fetched", "name": name, "generation": gen}


def _metadata(f):
    try:
        return base64.b64decode(f["metadata"], validate=True)
    except (KeyError, TypeError, ValueError):
        raise _wire.FrameError("EPROTO", "metadata frame without base64 metadata") from None


def _peer_closed(sock):
    """Whether the peer closed (EOF waiting) without consuming a frame it may have sent."""
    if not _wire.readable(sock, 0):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _left(deadline, what):
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(errno.ETIMEDOUT, f"timed out {what}")
    return left


class _Stale(Exception):
    """The peer closed the connection before it answered a get: nothing was leased."""


class PeerLink:
    """The importing side's control connection to one peer bridge, made on first use."""

    def __init__(self, bridge, name, addr):
        self.bridge = bridge
        self.name = name
        self.addr = addr
        self.where = f"{addr[0]}:{addr[1]}"
        self.lock = threading.Lock()
        self.sock = None
        self.agent = None
        self._rid = 0

    def connected(self):
        return self.sock is not None

    def _connect(self, deadline):
        left = _left(deadline, f"connecting to {self.where}")
        try:
            sock = socket.create_connection(self.addr, timeout=min(left or CONNECT_TIMEOUT,
                                                                   CONNECT_TIMEOUT))
        except socket.timeout:
            raise TimeoutError(errno.ETIMEDOUT, f"connecting to {self.where} timed out") \
                from None
        try:
            _keepalive(sock)
            w = _wire.auth_client(sock, self.bridge.token, self.bridge.agent_name, self.name)
            agent = self.bridge.nixl.add_remote(_metadata(w))
            _wire.send(sock, {"op": "metadata", "metadata":
                              base64.b64encode(self.bridge.nixl.metadata()).decode()})
        except _wire.FrameError as e:
            sock.close()
            raise ConnectionError(errno.EPROTO, f"protocol error: {e}") from None
        except BaseException:
            sock.close()
            raise
        self.sock, self.agent = sock, agent
        log.info("connected to peer %s at %s (agent %s)", self.name, self.where, agent)

    def drop(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.agent is not None:
            self.bridge.nixl.remove_remote(self.agent)
            self.agent = None

    def _recv(self, deadline, what):
        try:
            f = _wire.recv(self.sock, deadline)
        except TimeoutError:
            raise TimeoutError(errno.ETIMEDOUT, f"timed out {what}") from None
        except ConnectionResetError:
            raise ConnectionResetError(errno.ECONNRESET, f"connection lost {what}") from None
        except _wire.FrameError as e:
            raise ConnectionError(errno.EPROTO, f"protocol error {what}: {e}") from None
        return f

    def fetch(self, dl, rname, local, deadline):
        """Get rname from this peer and publish it here as local; the remote generation."""
        if not self.lock.acquire(timeout=-1 if deadline is None else
                                 max(0.0, deadline - time.monotonic())):
            raise TimeoutError(errno.ETIMEDOUT, "timed out waiting for another fetch from "
                               "this peer")
        try:
            reused = self.sock is not None
            if not reused:
                self._connect(deadline)
            try:
                return self._fetch(dl, rname, local, deadline)
            except _Stale:
                # the idle connection was dead (the peer restarted): one new one, at once
                self.drop()
                log.info("connection to peer %s was lost while idle: reconnecting", self.name)
                self._connect(deadline)
                return self._fetch(dl, rname, local, deadline)
            except OSError as e:
                if not getattr(e, "peer_answer", False):
                    self.drop()
                raise
            except Exception:
                self.drop()        # the connection's state is unknown
                raise
        finally:
            self.lock.release()

    def stat(self, rname, deadline):
        """(generation, created_ns) of rname on this peer; FileNotFoundError if it has none."""
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(errno.ETIMEDOUT, "timed out waiting for a fetch from this peer")
        try:
            for attempt in (0, 1):
                if self.sock is None:
                    self._connect(deadline)
                self._rid += 1
                try:
                    _wire.send(self.sock, {"op": "stat", "id": self._rid, "name": rname})
                    f = _wire.recv(self.sock, deadline)
                except (ConnectionResetError, BrokenPipeError):
                    self.drop()
                    if attempt:
                        raise
                    continue
                except (TimeoutError, _wire.FrameError) as e:
                    self.drop()
                    raise TimeoutError(errno.ETIMEDOUT, f"stat of {rname!r}: {e}") from None
                if f["op"] == "error":
                    raise _wire.to_oserror(f, f"peer {self.name}")
                return f["generation"], f["created_ns"]
        finally:
            self.lock.release()

    def _fetch(self, dl, rname, local, deadline):
        self._rid += 1
        rid = self._rid
        t0 = time.monotonic()
        try:
            _wire.send(self.sock, {"op": "get", "id": rid, "name": rname})
            f = _wire.recv(self.sock, deadline)
        except (ConnectionResetError, BrokenPipeError):
            raise _Stale() from None
        except TimeoutError:
            raise TimeoutError(errno.ETIMEDOUT, "timed out waiting for the layout") from None
        except _wire.FrameError as e:
            raise ConnectionError(errno.EPROTO, f"protocol error waiting for the layout: {e}") \
                from None
        if f["op"] == "error":
            e = _wire.to_oserror(f, "the peer says")
            e.peer_answer = True    # the connection is in a known state: it stays
            raise e
        if f["op"] != "layout" or f.get("id") != rid:
            raise ConnectionError(errno.EPROTO, f"expected the layout, got {f['op']!r}")
        lid, gen, tensors, bundle = str(f["lease"]), f["generation"], f["tensors"], f["bundle"]
        t1 = time.monotonic()
        try:
            spec = {k: (tuple(shape), dtype) for k, dtype, shape, _ in tensors}
            if bundle:
                alloc = dl.empty_dict(spec)
            else:
                (k, (shape, dtype)), = spec.items()
                alloc = {k: dl.empty(shape, dtype)}
        except (OSError, ValueError, TypeError) as e:
            _wire.send(self.sock, {"op": "release", "lease": lid})
            raise OSError(getattr(e, "errno", None) or errno.EINVAL,
                          f"cannot allocate the replica: {e}") from None
        live = [t for t in alloc.values() if t.nbytes]
        reg = self.bridge.nixl.register(*_span(live)) if live else None
        t2 = time.monotonic()
        landed = False
        try:
            md = self.bridge.nixl.partial_metadata(reg) if live else b""
            _wire.send(self.sock, {"op": "put", "id": rid, "lease": lid,
                                   "metadata": base64.b64encode(md).decode(),
                                   "descs": [[t.data_ptr, t.nbytes] for t in live]})
            done = False
            notified = not live
            while not (done and notified):
                _left(deadline, f"waiting for {rname!r}")
                if not notified:
                    notified = self.bridge.nixl.notified(self.agent, lid.encode())
                if not done and _wire.readable(self.sock, 0 if not notified else 0.05):
                    f = self._recv(deadline, "waiting for the transfer")
                    if f["op"] == "error":
                        raise _wire.to_oserror(f, "transfer failed")
                    if f["op"] != "done" or f.get("lease") != lid:
                        raise ConnectionError(errno.EPROTO, f"expected done, got {f['op']!r}")
                    done = True
                elif not notified:
                    time.sleep(POLL)
            landed = True
        finally:
            if landed or reg is None:
                if reg is not None:
                    self.bridge.nixl.deregister(reg)
            else:
                # the exporter may still be writing into it: close the control connection
                # (it cancels there) and keep the memory registered for a while
                self.drop()
                self.bridge.quarantine.add(f"replica of {rname!r} from {self.name}", None, reg,
                                           alloc.values())
        t3 = time.monotonic()
        n = sum(t.nbytes for t in live)
        if bundle:
            dl.publish_dict(local, alloc, replace=True)
        else:
            dl.publish(local, alloc[""], replace=True)
        for t in alloc.values():
            t.release()
        t4 = time.monotonic()
        log.info("fetched %r from %s (generation %d, %d bytes) in %.3f s: layout %.3f, "
                 "allocate and register %.3f, transfer %.3f (%.2f GB/s), publish %.3f", rname,
                 self.name, gen, n, t4 - t0, t1 - t0, t2 - t1, t3 - t2,
                 n / max(t3 - t2, 1e-9) / 1e9, t4 - t3)
        return gen


class _Journal(logging.Formatter):
    """Log lines with journald's priority prefixes (<3> error ... <7> debug)."""
    PRIO = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
            logging.CRITICAL: 2}

    def format(self, record):
        return f"<{self.PRIO.get(record.levelno, 6)}>{super().format(record)}"


def _logging(level):
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(_Journal("%(message)s"))
    log.addHandler(h)
    log.setLevel(level)
    log.propagate = False


def _listen_tcp(addr):
    host, port = parse_addr(addr, "--listen")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    family, _, _, _, sa = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(sa)
    s.listen(16)
    return s


def _listen_unix(path, mode):
    try:
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise FileExistsError(errno.EEXIST, f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)            # a dead bridge's socket
        else:
            raise FileExistsError(errno.EADDRINUSE, f"a bridge already listens on {path}")
        finally:
            probe.close()
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    old = os.umask(0o777 & ~mode)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, mode)
    s.listen(16)
    return s
