# SPDX-License-Identifier: Apache-2.0
"""dlpackd-bridge: one per host, an ordinary dlpackd client that moves entries between hosts
over NIXL (docs/bridge.md).

Threads: one accepts peers on --listen and one accepts local clients on --socket; each
connection gets a thread of its own that does all of its work (its leases and the pushes of its
subscriptions included), and one housekeeping thread gives back what an aborted transfer left in
quarantine, replaces a NIXL agent that had an aborted transfer and destroys the one replaced
once nothing uses it (_nixl.Agents). Subscriptions add one thread that watches the local
dlpackd; --follow adds one thread per followed name and one per peer followed, which reads the
pushes (_push.py). A NIXL agent is shared by the connections made while it was the one in use;
its calls are serialized by NIXL itself (NIXL_THREAD_SYNC_STRICT).
"""
import base64
import errno
import ipaddress
import logging
import os
import random
import socket
import stat
import struct
import sys
import threading
import time

import dlpack_ipc

from . import _cuda, _importer, _push, _registry, _replicas, _wire
from ._importer import POLL, PeerLink
from ._importer import keepalive as _keepalive
from ._nixl import QUARANTINE  # noqa: F401  (__main__ reads _server.QUARANTINE)
from ._nixl import QUARANTINE_MAX, Agents, MetadataRefused, Nixl, Quarantine, _quiet, _span

# How long an exporter keeps a lease (and its dlpackd reference) for an importer that asked for
# a name's layout and has not sent its descriptors yet; also the longest one WRITE may take.
# --lease-ttl sets it.
LEASE_TTL = 30.0
# A control connection's thread looks at its leases this often, in seconds.
TICK = 0.25
# Leases one peer connection may hold at once (each is a dlpackd reference).
LEASES_MAX = 64
# Bytes under lease: what one peer connection's leases may hold, and all of them together (a
# storage, one generation of an entry, counted once by each however many leases hold it: they
# pin one copy). Past either a get is refused with EAGAIN, naming the limit; one lease of any
# size is granted where the connection (or the bridge) holds none. A lease maps its entry
# without populating it, but holds the generation's memory in dlpackd after a REPLACE; an
# importer holds one lease at a time.
LEASE_BYTES_PER_CONNECTION_MAX = 64 << 30
LEASE_BYTES_MAX = 1 << 40
# Peers the bridge serves at once: a connection takes a slot only once its proof checked out.
PEERS_MAX = 64
# Connections not authenticated yet: at most UNAUTH_MAX at once, UNAUTH_PER_ADDR_MAX of them
# from one source (an IPv4 address, an IPv6 /64), each given AUTH_DEADLINE seconds from accept
# to prove the token. Past either, one such connection (of that source, or of all), chosen at
# random, is dropped to make room for the new one, so that strangers keep a peer out only with
# luck, or by opening many connections within its handshake (refusing the new one let a
# stranger on a peer's address keep it out by reconnecting every AUTH_DEADLINE; dropping the
# oldest let about 100 connections a second keep out a peer 50 ms away). A peer whose proof
# checked out is no longer among them when it is sent its welcome.
UNAUTH_MAX = 32
UNAUTH_PER_ADDR_MAX = 4
AUTH_DEADLINE = 2.0
# Connections the kernel queues for the accepting threads: a burst of strangers that fills the
# queue makes a peer's connect wait a second for its SYN to be sent again.
LISTEN_BACKLOG = 128
# Local clients the bridge serves at once (root's are not counted: no other uid can lock it
# out), those of one uid, root's included (SO_PEERCRED), and the seconds a local connection may
# wait between two requests before it is closed (bridge.fetch() and status() send theirs as they
# connect).
CLIENTS_MAX = 64
CLIENTS_PER_UID_MAX = 16
CLIENT_IDLE_TIMEOUT = 30.0
# Refused connections (at accept, or failing the authentication) are logged at most once every
# REFUSED_LOG_INTERVAL seconds: the first at once, the others summed up in one line at the end
# of the interval, by source (at most REFUSED_LOG_SOURCES named, the rest counted together).
REFUSED_LOG_INTERVAL = 10.0
REFUSED_LOG_SOURCES = 8
# Host memory the exporter holds at once for device entries staged on their way out (each is
# copied to host memory for its lease; --staging-max sets it), and device entries one peer
# connection may hold staged at once.
STAGING_MAX = 8 << 30
STAGED_PER_CONNECTION = 1
# The kinds of device entry an importer's get may name in its "devices", and how many names it
# may send.
DEVICE_KINDS = ("cuda",)
DEVICES_MAX = 8

log = logging.getLogger("dlpackd-bridge")


def parse_addr(text, what):
    """ADDR:PORT (or [V6ADDR]:PORT) to (host, port); ValueError naming what."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {text!r} is not ADDR:PORT")
    return host.strip("[]"), int(port)


class Lease:
    """An exported entry held for one importer: the attach is the dlpackd reference."""

    def __init__(self, lid, name, generation, tensors, ttl, storage=None, nbytes=0):
        self.id = lid
        self.name = name
        self.generation = generation
        self.tensors = tensors          # [(key, SharedTensor)]
        self.expires = time.monotonic() + ttl
        self.staged = 0                 # bytes of host memory staged for a device entry
        # what it is charged to in Bridge.leased: (name, generation, created_ns), or None
        self.storage = storage
        self.nbytes = nbytes


class _Pending:
    """A peer connection not authenticated yet (Bridge._unauth)."""

    def __init__(self, sock, source):
        self.sock = sock
        self.source = source
        self.since = time.monotonic()
        self.evicted = None             # why it was dropped to make room, naming the limit


def _source(addr):
    """Where a peer connection comes from, as UNAUTH_PER_ADDR_MAX counts: its IPv4 address, or
    its IPv6 /64 (a host may hold a whole /64)."""
    try:
        ip = ipaddress.ip_address(addr[0])
    except ValueError:
        return str(addr[0])
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class _Refusals:
    """Refused connections, logged at most once every REFUSED_LOG_INTERVAL: the first of a
    quiet spell at once, the others counted by where they came from and summed up in one
    line once the interval is over (flush(), from the housekeeping thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._quiet_from = 0.0      # time.monotonic() from which a refusal is logged at once
        self._counts = {}           # (what, source): [refusals, the last reason]
        self._others = 0            # refusals from sources past REFUSED_LOG_SOURCES

    def note(self, what, source, why):
        """A what ("peer", "local client") from source refused for why."""
        now = time.monotonic()
        with self._lock:
            at_once = now >= self._quiet_from and not self._counts and not self._others
            if at_once:
                self._quiet_from = now + REFUSED_LOG_INTERVAL
            elif (what, source) in self._counts or len(self._counts) < REFUSED_LOG_SOURCES:
                c = self._counts.setdefault((what, source), [0, why])
                c[0] += 1
                c[1] = why
            else:
                self._others += 1
        if at_once:
            log.warning("refusing a %s from %s: %s (further refusals are summed up every "
                        "%g s: REFUSED_LOG_INTERVAL)", what, source, why, REFUSED_LOG_INTERVAL)

    def flush(self):
        """Log the refusals counted, once the interval is over."""
        now = time.monotonic()
        with self._lock:
            if now < self._quiet_from or not (self._counts or self._others):
                return
            counts, others = self._counts, self._others
            self._counts, self._others = {}, 0
            self._quiet_from = now + REFUSED_LOG_INTERVAL
        parts = [f"{n} {what}s from {source} (last: {why})" for (what, source), (n, why) in
                 sorted(counts.items(), key=lambda kv: -kv[1][0])]
        if others:
            parts.append(f"{others} from other sources (past REFUSED_LOG_SOURCES)")
        log.warning("refused %d more connections within REFUSED_LOG_INTERVAL (%g s): %s",
                    sum(n for n, _ in counts.values()) + others, REFUSED_LOG_INTERVAL,
                    "; ".join(parts))


class Staging:
    """The host memory held for staged device entries, bounded by limit bytes."""

    def __init__(self, limit):
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, n, name):
        """Charge n bytes for name; OSError (EFBIG, EAGAIN) naming the limit if they do not
        fit."""
        if n > self.limit:
            raise OSError(errno.EFBIG, f"{name!r} is a device entry of {n} bytes, more than the "
                          f"{self.limit} bytes of host memory it is staged through "
                          "(--staging-max)")
        with self._lock:
            if self.held + n > self.limit:
                raise BlockingIOError(errno.EAGAIN, f"{name!r}: {self.held} bytes of host memory "
                                      f"are staged for other device entries (--staging-max "
                                      f"{self.limit}): try again later")
            self.held += n

    def give(self, n):
        with self._lock:
            self.held -= n


class _Staged:
    """One tensor of a device entry's host copy, as a lease holds it: releasing the last of
    an entry's gives its bytes back to the Staging."""

    def __init__(self, t, ledger):
        self.t = t
        self.data_ptr = t.data_ptr
        self.nbytes = t.nbytes
        self.shape = t.shape
        self.dtype = t.dtype
        self.ledger = ledger            # [parts left, bytes, Staging]

    def release(self):
        staging = self.ledger[2]
        with staging._lock:
            t, self.t = self.t, None
            if t is not None:
                self.ledger[0] -= 1
            last = t is not None and self.ledger[0] == 0
        if t is None:
            return
        try:
            t.release()
        finally:
            if last:
                staging.give(self.ledger[1])


def _devices(f):
    """The device kinds a get frame f says its importer takes; FrameError if malformed."""
    d = f.get("devices")
    if d is None:
        return ()
    if (not isinstance(d, list) or len(d) > DEVICES_MAX or
            any(not isinstance(k, str) or len(k) > 16 for k in d)):
        raise _wire.FrameError("EPROTO", f"get with devices {str(d)[:64]!r}: not a list of "
                               f"at most {DEVICES_MAX} names")
    return tuple(k for k in d if k in DEVICE_KINDS)


def _stage(dl, name, tensors, staging, bundle):
    """A host copy of a device entry's tensors ([(key, SharedTensor)], on one device), charged
    to staging: [(key, _Staged)]. The device tensors are left to the caller."""
    n = sum(t.nbytes for _, t in tensors)
    staging.take(n, name)
    host = {}
    try:
        spec = {k: (tuple(t.shape), t.dtype) for k, t in tensors}
        try:
            if bundle:
                host = dl.empty_dict(spec)
            else:
                (k, (shape, dtype)), = spec.items()
                host = {k: dl.empty(shape, dtype)}
        except MemoryError:         # libdlpc's ENOMEM / ENOSPC
            raise OSError(errno.ENOMEM, f"{name!r}: no host memory for its {n} bytes staged "
                          "on their way out") from None
        try:
            _cuda.to_host(tensors[0][1].device, [(host[k].data_ptr, t.data_ptr, t.nbytes)
                                                 for k, t in tensors])
        except OSError as e:
            raise OSError(e.errno, f"{name!r}: {e.strerror or e}") from None
    except BaseException:
        for t in host.values():
            _quiet(t.release)
        staging.give(n)
        raise
    ledger = [len(host), n, staging]
    return [(k, _Staged(host[k], ledger)) for k, _ in tensors]


class Bridge:
    def __init__(self, args, token):
        self.args = args
        self.token = token
        self.exports = args.export or []
        self.ttl = args.lease_ttl
        self.staging = Staging(getattr(args, "staging_max", None) or STAGING_MAX)
        # None: --cuda-device none (device entries are not taken from peers)
        self.cuda_device = getattr(args, "cuda_device", 0)
        self._cuda_why = False          # not looked at yet; then None or why not
        self._cuda_lock = threading.Lock()  # not self._lock: the look loads the driver
        self.peers = {}
        for p in args.peer or []:
            name, sep, addr = p.partition("=")
            if not sep or not name or ":" in name or name == _registry.ANY_HOST:
                raise ValueError(f"--peer {p!r} is not NAME=ADDR:PORT (NAME without ':', "
                                 f"not '{_registry.ANY_HOST}')")
            self.peers[name] = PeerLink(self, name, parse_addr(addr, f"--peer {name}"))
        self.host = socket.gethostname()
        # the bridge's name among NIXL agents: its first agent's (a replaced one gets a new
        # name, new_agent_name()); lease ids and its registry record carry it
        self.agent_name = self.new_agent_name()
        self.stop = threading.Event()
        self._registry(args)
        self.follow = []
        for name in getattr(args, "follow", None) or []:
            peer, sep, rname = name.partition(":")
            if not sep or not rname or peer == _registry.ANY_HOST or \
                    (peer not in self.peers and not (self.registry is not None and
                                                     _registry.valid_name(peer))):
                raise ValueError(f"--follow {name!r} is not PEER:NAME with a --peer PEER, or "
                                 "a bridge's name in the --registry")
            if peer not in self.peers and self.registration is not None and \
                    peer == self.name:
                raise ValueError(f"--follow {name!r} names this bridge (--name {self.name})")
            if any(local == name for _, _, local in self.follow):
                raise ValueError(f"--follow {name!r} is given twice")
            if len(name.encode()) > dlpack_ipc.NAME_MAX:
                raise ValueError(f"--follow {name!r}: the replica's name is longer than "
                                 f"NAME_MAX ({dlpack_ipc.NAME_MAX} bytes)")
            link = self.peers.get(peer) or self.found.get(peer)
            if link is None:
                # looked up in the registry before each connection (_resolve); never forgotten
                if len(self.found) >= _registry.FOUND_PEERS_MAX:
                    raise ValueError(f"--follow {name!r}: more than FOUND_PEERS_MAX "
                                     f"({_registry.FOUND_PEERS_MAX}) bridges to follow")
                link = self.found[peer] = PeerLink(self, peer, None, self._resolve)
            self.follow.append((link, rname, name))
        self.follows = [_push.Follow(self, link, rname, local)
                        for link, rname, local in self.follow]
        self.agents = Agents(lambda name: Nixl(name, args.progress_thread), self.agent_name)
        self.quarantine = Quarantine(self.agents, args.quarantine)
        state_dir = getattr(args, "state_dir", None)
        self.replicas = _replicas.Ledger(
            os.geteuid(),
            getattr(args, "replicas_per_uid", None) or _replicas.REPLICAS_PER_UID_MAX,
            getattr(args, "replica_bytes_per_uid", None) or _replicas.REPLICA_BYTES_PER_UID_MAX,
            os.path.join(state_dir, _replicas.STATE_FILE) if state_dir else None)
        self.replicas.keep_own({local for _, _, local in self.follow})
        self.publisher = _push.Publisher(self.stop, args.dlpackd_socket, self.exports)
        self._lock = threading.Lock()
        self._lease_seq = 0
        self.leases = 0
        self.counts = {"served": 0, "fetched": 0, "refused": 0, "aborted": 0, "writing": 0}
        self._init_limits()

    def _init_limits(self):
        """The connections' and leases' counts (under self._lock)."""
        self._peers_in = threading.BoundedSemaphore(PEERS_MAX)
        self._unauth = {}           # source: [_Pending], in order of accept
        self._unauth_n = 0
        self._clients_of = {}       # uid: its local connections
        self._clients_n = 0         # local connections of uids other than root
        self.leased = {}            # Lease.storage: [leases, bytes]
        self.leased_bytes = 0
        self.refusals = _Refusals()

    def _registry(self, args):
        """--registry: the etcd client, this bridge's record if it exports (--listen), and
        the links to peers found there (self.found)."""
        self.registry = self.registration = None
        self.found = {}
        url = getattr(args, "registry", None)
        if not url:
            return
        auth = getattr(args, "registry_auth_file", None)
        self.registry = _registry.Etcd(url, _registry.read_auth(auth) if auth else None)
        self.registry_prefix = getattr(args, "registry_prefix", None) or \
            _registry.REGISTRY_PREFIX
        self.name = getattr(args, "name", None) or self.host
        if not args.listen:
            return
        if not _registry.valid_name(self.name):
            raise ValueError(f"the host name {self.name!r} cannot name this bridge in the "
                             "registry: --name one")
        advertise = getattr(args, "advertise", None) or args.listen
        host, _ = parse_addr(advertise, "--advertise")
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            wildcard = False            # a host name: peers resolve it
        if wildcard:
            raise ValueError(f"{advertise} is a wildcard address: --advertise the ADDR:PORT "
                             "peers connect to, for the registry")
        # its own client: requests short enough that the lease is renewed in time
        self.registration = _registry.Registration(
            _registry.Etcd(url, self.registry.auth,
                           max(0.5, min(_registry.REQUEST_TIMEOUT, (getattr(
                               args, "registry_ttl", None) or _registry.REGISTRY_TTL) / 4))),
            self.registry_prefix, self.name,
            {"addr": advertise, "agent": self.agent_name, "exports": self.exports},
            getattr(args, "registry_ttl", None) or _registry.REGISTRY_TTL, self.stop,
            self.exported if getattr(args, "registry_names", False) else None)

    def _peer(self, name):
        """The link to peer name: a --peer, else one found in the registry. OSError saying why
        there is none."""
        link = self.peers.get(name)
        if link is not None:
            return link
        if self.registry is None:
            raise FileNotFoundError(errno.ENOENT, f"no peer {name!r} is configured "
                                    f"(--peer: {', '.join(self.peers) or 'none'})")
        with self._lock:
            link = self.found.get(name)
        if link is not None:
            return link
        addr = _registry.lookup(self.registry, self.registry_prefix, name)
        with self._lock:
            link = self.found.get(name)
            if link is None:
                if len(self.found) >= _registry.FOUND_PEERS_MAX:
                    self._forget_one()
                link = self.found[name] = PeerLink(self, name, addr, self._resolve)
                link.looked_up = time.monotonic()
        return link

    def _resolve(self, link, deadline):
        """Before each new connection to a peer found in the registry (the caller holds
        link.lock): its address looked up again, within deadline (None: none), so that a bridge
        restarted elsewhere is reached; the last one while etcd cannot be reached. A peer no
        longer registered is _registry.NotRegistered."""
        now = time.monotonic()
        if link.looked_up is not None and now - link.looked_up < _registry.LOOKUP_FRESH:
            return
        timeout = self.registry.timeout
        if deadline is not None:
            if deadline <= now:
                raise TimeoutError(errno.ETIMEDOUT, f"timed out before looking {link.name} up "
                                   f"in the registry ({self.registry.url})")
            timeout = min(timeout, deadline - now)
        try:
            addr = _registry.lookup(self.registry, self.registry_prefix, link.name, timeout)
        except FileNotFoundError as e:
            raise _registry.NotRegistered(errno.ENOENT, e.strerror) from None
        except ConnectionError as e:
            if link.addr is None:
                raise
            log.info("peer %s: tried at %s, its last address: %s", link.name, link.where, e)
            return
        link.looked_up = time.monotonic()
        if link.addr != addr:
            if link.addr is not None:
                log.info("peer %s moved from %s to %s:%d (registry)", link.name, link.where,
                         *addr)
            link.addr, link.where = addr, f"{addr[0]}:{addr[1]}"

    def _forget_one(self):
        """Make room in self.found (under self._lock): a link that holds nothing (no
        connection, no NIXL agent, no fetch under way, no follow) goes; BlockingIOError EAGAIN
        when every one is in use."""
        for n, link in self.found.items():
            if link.follows or link.sock is not None or link.agent is not None:
                continue
            if link.lock.acquire(blocking=False):
                try:
                    if link.sock is None and link.agent is None:
                        link.forgotten = True   # a fetch that holds it asks again
                        del self.found[n]
                        return
                finally:
                    link.lock.release()
        raise BlockingIOError(errno.EAGAIN, f"{len(self.found)} peers found in the registry "
                              "are in use (FOUND_PEERS_MAX)")

    def count(self, what, n=1):
        with self._lock:
            self.counts[what] += n

    def dlpackd(self, reconnect=False):
        """A client of this host's dlpackd; reconnect=True for one a thread keeps for its
        life (after dlpackd restarts, the call that finds it gone fails, the next connects)."""
        return dlpack_ipc.Client(self.args.dlpackd_socket or None, reconnect=reconnect)

    def exported(self, name):
        return any(name.startswith(p) for p in self.exports)

    def takes_devices(self):
        """The device kinds this bridge takes from peers (["cuda"], or []) and why not (None or
        a message): looked at once, at the first fetch (the driver is loaded then)."""
        with self._cuda_lock:
            if self._cuda_why is False:
                self._cuda_why = "--cuda-device none" if self.cuda_device is None else \
                    _cuda.check(self.cuda_device)
                if self._cuda_why:
                    log.info("this bridge takes no device entries from peers: %s",
                             self._cuda_why)
            why = self._cuda_why
        return ([] if why else ["cuda"]), why

    def new_agent_name(self):
        """A NIXL agent name no other bridge, or restart of this one, has used: the host and
        the time (a peer never meets stale metadata under it)."""
        return f"dlpackd-bridge/{self.host}/{time.time_ns()}"

    def new_lease_id(self):
        with self._lock:
            self._lease_seq += 1
            self.leases += 1
            return f"{self.agent_name}/{self._lease_seq}"

    def lease_ended(self, lease):
        with self._lock:
            self.leases -= 1
        if lease.storage is not None:
            self._lease_give(lease.storage)

    def _lease_take(self, leases, name, storage, n):
        """Charge a lease of n bytes of storage ((name, generation, created_ns)) to the
        connection holding leases and to the bridge, each storage counted once by each (several
        leases of it pin one copy); BlockingIOError EAGAIN naming the limit it would pass
        (LEASE_BYTES_PER_CONNECTION_MAX, LEASE_BYTES_MAX)."""
        pinned = {lease.storage if lease.storage is not None else lease.id: lease.nbytes
                  for lease in leases.values()}
        here = sum(pinned.values())
        if storage not in pinned and here and here + n > LEASE_BYTES_PER_CONNECTION_MAX:
            raise BlockingIOError(errno.EAGAIN, f"{name!r}: its {n} bytes would take this "
                                  f"connection's leases from {here} bytes past "
                                  f"LEASE_BYTES_PER_CONNECTION_MAX "
                                  f"({LEASE_BYTES_PER_CONNECTION_MAX}): finish or release a "
                                  "lease first")
        with self._lock:
            held = self.leased.get(storage)
            if held is None:
                if self.leased_bytes and self.leased_bytes + n > LEASE_BYTES_MAX:
                    raise BlockingIOError(errno.EAGAIN, f"{name!r}: its {n} bytes would take "
                                          f"what this bridge holds under lease from "
                                          f"{self.leased_bytes} bytes past LEASE_BYTES_MAX "
                                          f"({LEASE_BYTES_MAX}): try again later")
                held = self.leased[storage] = [0, n]
                self.leased_bytes += n
            held[0] += 1

    def _lease_give(self, storage):
        """Give back one lease's charge on storage (_lease_take)."""
        with self._lock:
            held = self.leased[storage]
            held[0] -= 1
            if held[0] == 0:
                del self.leased[storage]
                self.leased_bytes -= held[1]

    # -- threads --------------------------------------------------------------------------

    def serve(self, tcp, unix):
        threads = [threading.Thread(target=self._housekeeping, name="housekeeping",
                                    daemon=True)]
        if tcp is not None:
            threads.append(threading.Thread(target=self._accept, args=(tcp, self._admit_peer),
                                            daemon=True))
        threads.append(threading.Thread(target=self._accept, args=(unix, self._admit_client),
                                        daemon=True))
        for follow in self.follows:
            threads.append(threading.Thread(target=follow.run, name=f"follow {follow.local}",
                                            daemon=True))
        for link in {follow.link for follow in self.follows}:
            threads.append(threading.Thread(target=_push.pump, args=(link, self.stop),
                                            name=f"pushes of {link.name}", daemon=True))
        registry = None
        if self.registration is not None:
            registry = threading.Thread(target=self.registration.run, name="registry",
                                        daemon=True)
            threads.append(registry)
            if self.registration.exported is not None:
                threads.append(threading.Thread(
                    target=self.registration.watch_names, name="registry names", daemon=True,
                    args=(self.args.dlpackd_socket, os.path.commonprefix(self.exports))))
        for t in threads:
            t.start()
        while not self.stop.wait(1.0):
            pass
        if registry is not None:     # its record revoked before the process ends
            registry.join(_registry.STOP_WAIT)

    def _housekeeping(self):
        failed = {}         # step: what it last failed with (logged once, until it changes)
        while not self.stop.wait(1.0):
            # each step on its own: one that fails must not end the others for good
            for step in (self.quarantine.sweep, self._agents_tick, self._close_retired,
                         self.refusals.flush):
                try:
                    step()
                    failed.pop(step.__name__, None)
                except Exception as e:
                    if failed.get(step.__name__) != repr(e):
                        failed[step.__name__] = repr(e)
                        log.exception("housekeeping: %s (said once while it fails so)",
                                      step.__name__)

    def _agents_tick(self):
        self.agents.tick(self.new_agent_name())

    def _close_retired(self):
        """A connection to a peer made with a replaced agent is closed once idle; the next use
        connects again with the agent in use."""
        with self._lock:
            links = list(self.peers.values()) + list(self.found.values())
        for link in links:
            link.close_if_retired()

    def _accept(self, lsock, admit):
        """Accept connections on lsock, each handed to admit(sock, addr), which serves it on a
        thread of its own or refuses it."""
        lsock.settimeout(0.5)
        while not self.stop.is_set():
            try:
                sock, addr = lsock.accept()
            except socket.timeout:
                continue
            except OSError as e:
                if self.stop.is_set():
                    return
                log.error("accepting a connection: %s", e)
                time.sleep(0.1)
                continue
            try:
                admit(sock, addr)
            except Exception:
                log.exception("admitting a connection from %s", addr)
                sock.close()

    def _refuse(self, sock, what, source, errname, why):
        """Refuse a connection at accept: one error frame, closed, the log rate-limited."""
        self.refusals.note(what, source, why)
        _wire.send_error(sock, errname, why)
        sock.close()

    def _run(self, target, sock, *args, who="?"):
        try:
            target(sock, *args)
        except Exception:
            log.exception("connection %s", who)
        finally:
            sock.close()

    # -- the exporting side: a peer's control connection ---------------------------------

    def _admit_peer(self, sock, addr):
        """A peer connection, counted among those not authenticated yet (UNAUTH_MAX,
        UNAUTH_PER_ADDR_MAX; past either one of them, chosen at random, makes room), served on
        a thread of its own."""
        pending = _Pending(sock, _source(addr))
        with self._lock:
            mine = self._unauth.get(pending.source, [])
            victim = None
            if len(mine) >= UNAUTH_PER_ADDR_MAX:
                victim = random.choice(mine)
                victim.evicted = (f"dropped before it authenticated: {len(mine)} other "
                                  f"connections from {pending.source} came (UNAUTH_PER_ADDR_MAX "
                                  f"{UNAUTH_PER_ADDR_MAX})")
            elif self._unauth_n >= UNAUTH_MAX:
                victim = random.choice([p for ps in self._unauth.values() for p in ps])
                victim.evicted = (f"dropped before it authenticated: {self._unauth_n} other "
                                  f"connections came (UNAUTH_MAX {UNAUTH_MAX})")
            if victim is not None:
                # its thread reads the end of the connection and says why. Shut down under the
                # lock, while that thread, which takes it to let go of its entry, cannot have
                # closed the socket yet
                self._unauthenticated(victim)
                try:
                    victim.sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
            self._unauth.setdefault(pending.source, []).append(pending)
            self._unauth_n += 1
        threading.Thread(target=self._run, args=(self._peer_thread, sock, addr, pending),
                         kwargs={"who": f"from {addr}"}, daemon=True).start()

    def _unauthenticated(self, pending):
        """pending no longer counts among the connections not authenticated (under
        self._lock); whether it still did."""
        mine = self._unauth.get(pending.source, [])
        if pending not in mine:
            return False
        mine.remove(pending)
        if not mine:
            del self._unauth[pending.source]
        self._unauth_n -= 1
        return True

    def _authenticate(self, sock, addr, pending):
        """The peer's hello once it proved the token within AUTH_DEADLINE, or None (refused,
        counted and logged at most once every REFUSED_LOG_INTERVAL). pending (None: not
        counted) is let go of either way: once the proof checked out, before the welcome, so
        that a peer welcomed is never dropped to make room for a stranger."""
        hello = why = None

        def admit():
            with self._lock:
                if self._unauthenticated(pending):
                    return None
            return pending.evicted

        try:
            try:
                hello = _wire.auth_server(sock, self.token, AUTH_DEADLINE,
                                          admit if pending is not None else None)
            except PermissionError as e:
                why = e.strerror or str(e)
            except _wire.FrameError as e:   # a malformed hello or proof: refused as well
                why = str(e)
                _wire.send_error(sock, e.errname, why)
            except TimeoutError:
                why = f"not authenticated within AUTH_DEADLINE ({AUTH_DEADLINE:g} s)"
            except BlockingIOError as e:    # admit() said why, and the peer was told
                why = e.strerror
            except OSError as e:
                why = str(e) or type(e).__name__
        finally:
            if pending is not None:
                with self._lock:
                    dropped = not self._unauthenticated(pending) and hello is None
                if dropped and pending.evicted and why != pending.evicted:
                    # the end came from the shutdown of its eviction: say why
                    why = pending.evicted
                    _wire.send_error(sock, "EAGAIN", f"{why}: try again")
        if hello is None:
            self.count("refused")
            self.refusals.note("peer", _source(addr), f"{addr[0]}:{addr[1]}: {why}")
        return hello

    def _peer_thread(self, sock, addr, pending=None):
        who = f"{addr[0]}:{addr[1]}"
        leases = {}
        remote = None
        nixl = None
        dl = None
        slot = False
        sub = _push.Subscriber(who)
        try:
            _keepalive(sock)
            hello = self._authenticate(sock, addr, pending)
            if hello is None:
                return
            if not self._peers_in.acquire(blocking=False):
                self.count("refused")
                why = f"{PEERS_MAX} peers are connected (PEERS_MAX): try again later"
                self.refusals.note("peer", _source(addr), f"{who}: {why}")
                _wire.send_error(sock, "EAGAIN", why)
                return
            slot = True
            who = f"{str(hello.get('from', '?'))[:200]!r} at {who}"  # peer-chosen: quoted
            # the agent in use now serves this connection to its end (a replaced one too)
            nixl = self.agents.hold()
            _wire.send(sock, {"op": "metadata", "agent": nixl.name,
                              "metadata": base64.b64encode(nixl.metadata()).decode()})
            f = _recv_request(sock)
            if f["op"] != "metadata":
                raise _wire.FrameError("EPROTO", f"expected metadata, got {f['op']!r}")
            remote, others = self.agents.load(nixl, _wire.metadata(f))
            log.info("peer %s connected (agent %r)", who, remote)
            if others:
                log.info("peer %s: agent %r is loaded for %d other connection(s) as well: it "
                         "stays loaded until the last of them ends", who, remote, others)
            del f
            dl = self.dlpackd(reconnect=True)
            sub.who = who
            while not self.stop.is_set():
                self._expire(leases, who)
                if not leases and self.agents.retired(nixl):
                    # the peer connects again, with this bridge's new agent, at its next
                    # request (and subscribes again); a lease in flight is let finish first
                    log.info("peer %s: closing its connection, idle, made with NIXL agent %s, "
                             "since replaced", who, nixl.name)
                    return
                if sub.names:
                    self.publisher.flush(sock, dl, sub)
                if _wire.readable(sock, TICK):
                    self._peer_request(sock, dl, leases, nixl, remote, sub, who)
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
            if sub.names:
                log.info("peer %s: its %d subscriptions end with its connection", who,
                         len(sub.names))
            self.publisher.unsubscribe_all(sub)
            for lease in list(leases.values()):
                self._end(lease, "connection lost")
            if remote is not None:
                self.agents.unload(nixl, remote)
            if nixl is not None:
                self.agents.let_go(nixl)
            if dl is not None:
                dl.close()
            if slot:
                self._peers_in.release()

    def _peer_request(self, sock, dl, leases, nixl, remote, sub, who):
        """Read and serve one request of the peer: the frame is let go of on return, before
        the connection waits for the next one."""
        f = _recv_request(sock)
        op = f["op"]
        if op == "get":
            self._get(sock, dl, f, leases, who)
        elif op == "put":
            self._put(sock, f, leases, nixl, remote, who)
        elif op == "stat":
            self._stat(sock, dl, f)
        elif op == "subscribe":
            self._subscribe(sock, dl, f, sub, who)
        elif op == "release":
            self._end(leases.pop(str(f.get("lease")), None), "released")
        else:
            raise _wire.FrameError("EPROTO", f"unknown op {op!r}")

    def _expire(self, leases, who, busy=None):
        """End the leases past their TTL, but busy (the lease id of the WRITE under way)."""
        now = time.monotonic()
        for lid in [lid for lid, lease in leases.items() if lease.expires <= now and
                    lid != busy]:
            log.info("peer %s: lease %s expired", who, lid)
            self._end(leases.pop(lid), "expired")

    def _end(self, lease, why):
        """End lease: release its attach, every tensor tried, and free its slot."""
        if lease is None:
            return
        tensors, lease.tensors = lease.tensors, []
        try:
            for _, t in tensors:
                _quiet(t.release)
        finally:
            self.lease_ended(lease)
        log.debug("lease %s on %r ended: %s", lease.id, lease.name, why)

    def _quarantine(self, lease, nixl, why, xfer, reg):
        """Hand what lease still holds (its attach, xfer and reg of agent nixl where not None)
        to the quarantine, and free its slot."""
        self.quarantine.add(nixl, why, xfer, reg, [t for _, t in lease.tensors])
        lease.tensors = []
        self.lease_ended(lease)

    def _finish(self, lease, nixl, xfer, reg, who):
        """A transfer done (or never posted: xfer None): give back its handle, its
        registration, then the lease. Each step is tried; what a failed one leaves registered
        goes to quarantine with the attach (the mapping must outlive the registration)."""
        released = xfer is None or _quiet(nixl.release, xfer)
        deregistered = _quiet(nixl.deregister, reg)
        if released and deregistered:
            self._end(lease, "done")
        else:
            self._quarantine(lease, nixl, f"what NIXL did not give back after the WRITE of "
                             f"{lease.name!r} to {who}", None if released else xfer,
                             None if deregistered else reg)

    def _stat(self, sock, dl, f):
        """A name's generation and creation time, for a peer that follows it."""
        rid, name = f.get("id"), f.get("name")
        if not isinstance(name, str) or not self.exported(name):
            return _wire.send(sock, _wire.error_frame(
                "ENOENT", f"{name!r} is not exported by this bridge", id=rid))
        try:
            entry = _push.find(dl, name)
        except (OSError, ValueError) as e:
            return _wire.send(sock, _wire.error_frame("EIO", f"{name!r}: {e}", id=rid))
        if entry is None:
            return _wire.send(sock, _wire.error_frame(
                "ENOENT", f"{name!r}: no entry named {name!r}", id=rid))
        _wire.send(sock, {"op": "stat", "id": rid, "generation": entry.generation,
                          "created_ns": entry.created_ns})

    def _subscribe(self, sock, dl, f, sub, who):
        """A peer subscribes to a name's changes: answered with its state now (generation
        and created_ns, None for both when there is no such entry yet); each later PUBLISH,
        REPLACE or UNPUBLISH of it is pushed (_push.Publisher.flush)."""
        rid, name = f.get("id"), f.get("name")
        shown = _push.shown(name)
        if isinstance(name, str) and len(name.encode()) > dlpack_ipc.NAME_MAX:
            log.info("peer %s asked to subscribe to %s, longer than NAME_MAX", who, shown)
            return _wire.send(sock, _wire.error_frame(
                "ENAMETOOLONG", f"{shown} is longer than NAME_MAX ({dlpack_ipc.NAME_MAX} "
                "bytes)", id=rid))
        if not isinstance(name, str) or not self.exported(name):
            log.info("peer %s asked to subscribe to %s, which is not exported", who, shown)
            return _wire.send(sock, _wire.error_frame(
                "ENOENT", f"{shown} is not exported by this bridge", id=rid))
        try:
            added = self.publisher.subscribe(sub, name)
        except _push.Refused as e:
            log.info("peer %s: subscription to %s refused: %s", who, shown, e)
            return _wire.send(sock, _wire.error_frame(e.errname, str(e), id=rid))
        except OSError as e:
            log.warning("peer %s: subscription to %s: this host's dlpackd cannot be watched: "
                        "%s", who, shown, e)
            return _wire.send(sock, _wire.error_frame(
                "EIO", f"{shown}: this host's dlpackd cannot be watched: {e}", id=rid))
        log.debug("peer %s subscribed to %s", who, shown)
        try:
            entry = _push.find(dl, name)
        except (OSError, ValueError) as e:
            # not subscribed after all (a subscription held before this request is kept): the
            # peer tries again (a failure, not a refusal)
            if added:
                self.publisher.unsubscribe(sub, name)
            log.warning("peer %s: subscription to %s: this host's dlpackd: %s", who, shown, e)
            return _wire.send(sock, _wire.error_frame(
                "EIO", f"{shown}: this host's dlpackd: {e}", id=rid))
        _wire.send(sock, {"op": "subscribed", "id": rid, "name": name,
                          "generation": None if entry is None else entry.generation,
                          "created_ns": None if entry is None else entry.created_ns})

    def _get(self, sock, dl, f, leases, who):
        rid, name = f.get("id"), f.get("name")
        devices = _devices(f)       # a malformed list closes the connection
        if not isinstance(name, str) or not self.exported(name):
            log.info("peer %s asked for %s, which is not exported", who, _push.shown(name))
            return _wire.send(sock, _wire.error_frame(
                "ENOENT", f"{_push.shown(name)} is not exported by this bridge", id=rid))
        if len(leases) >= LEASES_MAX:
            return _wire.send(sock, _wire.error_frame(
                "EAGAIN", f"{name!r}: this connection holds {LEASES_MAX} leases (LEASES_MAX)",
                id=rid))
        if self.quarantine.full():
            return _wire.send(sock, _wire.error_frame(
                "EAGAIN", f"{name!r}: {QUARANTINE_MAX} failed transfers are in quarantine "
                "(QUARANTINE_MAX): try again later", id=rid))
        try:
            # a device entry's copy to the host waits on the legacy default stream for the
            # publisher's work (host entries ignore the stream). Not populated: its pages are
            # mapped when the WRITE reads them (_put), not for as long as a lease waits.
            ts = dl.attach_dict(name, timeout=0, mode="strict", stream=1, populate=False)
        except OSError as e:
            return _wire.send(sock, _wire.error_frame(
                errno.errorcode.get(e.errno, "EIO"), f"{name!r}: {e.strerror or e}", id=rid))
        except (ValueError, TypeError) as e:
            return _wire.send(sock, _wire.error_frame("EINVAL", f"{name!r}: {e}", id=rid))
        tensors = list(ts.items())
        del ts
        gen = tensors[0][1].generation
        bundle = not (len(tensors) == 1 and tensors[0][0] == "")
        device = tensors[0][1].device
        created = _created_ns(dl, name, gen)
        storage = (name, gen, created)
        n = sum(t.nbytes for _, t in tensors)
        try:
            self._lease_take(leases, name, storage, n)
        except OSError as e:
            for _, t in tensors:
                _quiet(t.release)
            log.info("peer %s: %s", who, e.strerror)
            return _wire.send(sock, _wire.error_frame("EAGAIN", e.strerror, id=rid))
        staged = 0
        if device != "cpu":
            try:
                tensors = self._staged(sock, dl, f.get("id"), devices, leases, name, tensors,
                                       bundle)
            except OSError as e:
                self._lease_give(storage)
                log.info("peer %s: %s", who, e.strerror or e)
                # the name older bridges sent for a device entry (errorcode says ENOTSUP)
                errname = "EOPNOTSUPP" if e.errno == errno.EOPNOTSUPP else \
                    errno.errorcode.get(e.errno, "EIO")
                return _wire.send(sock, _wire.error_frame(errname, e.strerror or str(e),
                                                          id=rid))
            except BaseException:
                self._lease_give(storage)
                raise
            staged = n
        lease = Lease(self.new_lease_id(), name, gen, tensors, self.ttl, storage, n)
        lease.staged = staged
        leases[lease.id] = lease
        layout = {"op": "layout", "id": rid, "lease": lease.id, "generation": gen,
                  "created_ns": created,
                  "bundle": bundle, "ttl": self.ttl,
                  "tensors": [[k, t.dtype, list(t.shape), t.nbytes] for k, t in tensors]}
        if device != "cpu":
            layout["device"] = device
        _wire.send(sock, layout)

    def _staged(self, sock, dl, rid, devices, leases, name, tensors, bundle):
        """A device entry's tensors copied to host memory for a lease ([(key, _Staged)]); the
        device tensors are released either way. OSError naming what refused it."""
        try:
            if "cuda" not in devices:
                raise OSError(errno.EOPNOTSUPP, f"{name!r} is a device entry, and the "
                              "importing bridge takes host entries only (an older bridge, or "
                              "one without a CUDA device: its --cuda-device)")
            if len({t.device for _, t in tensors}) != 1:
                raise OSError(errno.EOPNOTSUPP, f"{name!r} has tensors on more than one device")
            if sum(1 for le in leases.values() if le.staged) >= STAGED_PER_CONNECTION:
                raise BlockingIOError(errno.EAGAIN, f"{name!r}: this connection holds "
                                      f"{STAGED_PER_CONNECTION} staged device entry "
                                      "(STAGED_PER_CONNECTION): finish it first")
            n = sum(t.nbytes for _, t in tensors)
            if n > self.staging.limit:
                self.staging.take(n, name)          # EFBIG, naming the option
            # the importer waits longer for the layout while the copy is made
            _wire.send(sock, {"op": "staging", "id": rid, "bytes": n})
            return _stage(dl, name, tensors, self.staging, bundle)
        finally:
            for _, t in tensors:
                _quiet(t.release)

    def _put(self, sock, f, leases, nixl, remote, who):
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
            # the importer's registration of its replica: loaded for each transfer, into the
            # peer's own agent (removed when the connection closes); metadata that names
            # another agent is refused before NIXL sees it
            self.agents.load_partial(nixl, _wire.metadata(f), remote)
        except _wire.FrameError:
            self._end(leases.pop(lid), "bad metadata")
            raise
        except MetadataRefused as e:
            self._end(leases.pop(lid), "metadata refused")
            raise _wire.FrameError("EPROTO", f"put for lease {lid}: {e}") from None
        except Exception as e:
            self._end(leases.pop(lid), "metadata refused")
            return _wire.send(sock, _wire.error_frame(
                "EPROTO", f"put for lease {lid}: NIXL refused the metadata: {e!r}", id=rid))
        # registered only for the transfer; deregistered before the attach is dropped
        reg = nixl.register(*_span(live))
        xfer = None
        pop = None
        ok = False
        failure = None
        try:
            t0 = time.monotonic()
            # the transfer's own deadline, from the layout sent; the lease lives at least as long
            limit = _importer.transfer_deadline(sum(t.nbytes for t in live))
            lease.expires = max(lease.expires, t0 + limit)
            self.count("writing")
            if not lease.staged:
                # the entry's pages are mapped ahead of the WRITE, which reads every byte
                # (a staged copy was written here: mapped already)
                pop = _importer._Populate([(t.data_ptr, t.nbytes) for t in live],
                                          _importer.MADV_POPULATE_READ)
            xfer, st = nixl.write([(t.data_ptr, t.nbytes) for t in live],
                                  [tuple(d) for d in descs], remote, lid.encode())
            deadline = t0 + limit
            look = t0 + TICK
            while st == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"WRITE of {lease.name!r} not done in {limit:g} s "
                                       "(TRANSFER_GRACE + its bytes at TRANSFER_MIN_RATE)")
                if now >= look:
                    # no frame is read meanwhile: the connection's other leases expire here
                    self._expire(leases, who, busy=lid)
                    look = now + TICK
                if _peer_closed(sock):
                    raise ConnectionResetError("importer closed the connection mid-transfer")
                time.sleep(POLL)
                st = nixl.state(xfer)
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
            if pop is not None:
                pop.finish()
            self.count("writing", -1)
            leases.pop(lid, None)
            if ok:
                self._finish(lease, nixl, xfer, reg, who)
            elif xfer is None:      # nothing was posted: nothing can land late
                self.count("aborted")
                self._finish(lease, nixl, None, reg, who)
            else:
                self.count("aborted")
                self._quarantine(lease, nixl, f"WRITE of {lease.name!r} to {who}", xfer, reg)
                self.agents.aborted(nixl)
        if failure is not None:
            return _wire.send(sock, _wire.error_frame("EIO", failure, id=rid))
        self.count("served")
        _wire.send(sock, {"op": "done", "id": rid, "lease": lid})

    # -- the local side ----------------------------------------------------------------------

    def _admit_client(self, sock, addr):
        """A local connection, counted against its uid's CLIENTS_PER_UID_MAX and, but root's,
        CLIENTS_MAX: served on a thread of its own, or refused."""
        # the caller, from the kernel: its fetches are charged to its uid
        # struct ucred: pid_t pid, uid_t uid, gid_t gid (uid_t and gid_t unsigned)
        pid, uid, _ = struct.unpack("iII", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                           struct.calcsize("iII")))
        with self._lock:
            mine = self._clients_of.get(uid, 0)
            if mine >= CLIENTS_PER_UID_MAX:
                why = (f"uid {uid} has {mine} connections to this bridge (CLIENTS_PER_UID_MAX "
                       f"{CLIENTS_PER_UID_MAX}): try again later")
            elif uid != 0 and self._clients_n >= CLIENTS_MAX:
                why = (f"{self._clients_n} local clients are served (CLIENTS_MAX "
                       f"{CLIENTS_MAX}): try again later")
            else:
                why = None
                self._clients_of[uid] = mine + 1
                self._clients_n += uid != 0
        if why is not None:
            return self._refuse(sock, "local client", f"uid {uid}", "EAGAIN", why)
        threading.Thread(target=self._run, args=(self._client_thread, sock, uid, pid),
                         kwargs={"who": f"of local uid {uid} (pid {pid})"}, daemon=True).start()

    def _client_thread(self, sock, uid, pid):
        conn = {"dl": None}
        idle = time.monotonic()
        try:
            while not self.stop.is_set():
                if not _wire.readable(sock, 0.5):
                    if time.monotonic() - idle > CLIENT_IDLE_TIMEOUT:
                        log.info("local client uid %d (pid %d): idle for CLIENT_IDLE_TIMEOUT "
                                 "(%g s): closing", uid, pid, CLIENT_IDLE_TIMEOUT)
                        _wire.send_error(sock, "ETIMEDOUT", "no request within "
                                         f"CLIENT_IDLE_TIMEOUT ({CLIENT_IDLE_TIMEOUT:g} s): "
                                         "closed")
                        return
                    continue
                if not self._client_request(sock, conn, uid, pid):
                    return
                idle = time.monotonic()
        except _wire.FrameError as e:
            log.warning("local client uid %d (pid %d): %s: disconnecting", uid, pid, e)
            _wire.send_error(sock, e.errname, str(e))
        except OSError as e:
            log.info("local client uid %d (pid %d): %s", uid, pid, e)
        finally:
            if conn["dl"] is not None:
                conn["dl"].close()
            with self._lock:
                self._clients_of[uid] -= 1
                if not self._clients_of[uid]:
                    del self._clients_of[uid]
                self._clients_n -= uid != 0

    def _client_request(self, sock, conn, uid, pid):
        """Read and answer one request of a local client (at most LOCAL_FRAME_MAX): whether the
        connection is still open. The frame is let go of on return, before the connection waits
        for the next one; conn["dl"] is the connection's dlpackd client, made at its first
        fetch or drop."""
        try:
            f = _wire.recv(sock, time.monotonic() + _wire.AUTH_TIMEOUT, _wire.LOCAL_FRAME_MAX,
                           "LOCAL_FRAME_MAX")
        except ConnectionResetError:
            return False
        if f["op"] == "status":
            reply = self.status()
        elif f["op"] in ("fetch", "drop"):
            handle = self._fetch if f["op"] == "fetch" else self._drop
            try:
                if conn["dl"] is None:
                    conn["dl"] = self.dlpackd()
            except OSError as e:
                reply = _wire.error_frame(
                    "ECONNREFUSED", f"this host's dlpackd cannot be reached: {e}")
            else:
                reply = handle(conn["dl"], f, uid, pid)
        else:
            raise _wire.FrameError("EPROTO", f"unknown op {f['op']!r}")
        _wire.send(sock, reply)
        return True

    def status(self):
        replicas = self.replicas.summary()      # not under the bridge's lock
        with self._lock:
            return {"op": "status", "agent": self.agent_name, "leases": self.leases,
                    "registered": self.agents.registered(),
                    "agents": len(self.agents.alive()), "replaced": self.agents.replaced,
                    "quarantined": len(self.quarantine), "exports": self.exports,
                    "staged": self.staging.held,
                    "peers": {n: p.connected() for n, p in self.peers.items()},
                    "registry": self.registry and {
                        "url": self.registry.url, "name": self.name,
                        "registered": self.registration and self.registration.registered,
                        "names": self.registration and len(self.registration.names()),
                        "found": {n: p.connected() for n, p in self.found.items()}},
                    "replicas": replicas,
                    "subscribers": self.publisher.subscribers(),
                    "follows": {f.local: {"subscribed": f.subscribed,
                                          "generation": f.generation}
                                for f in self.follows},
                    **self.counts}

    def _drop(self, dl, f, uid, pid):
        """A local caller gives back a replica its fetch made (root: any): the reply frame."""
        name = f.get("name")
        if not isinstance(name, str) or ":" not in name:
            return _wire.error_frame("EINVAL", f"{name!r} is not 'peer:name'")
        if any(local == name for _, _, local in self.follow):
            return _wire.error_frame("EPERM", f"{name!r} is kept fresh by --follow: the bridge's "
                                     "own")
        try:
            gen = self.replicas.droppable(name, uid)
            try:
                dl.unpublish(name, generation=gen)
            except FileNotFoundError:
                pass                # unpublished already: the record goes all the same
        except OSError as e:
            return _wire.error_frame(errno.errorcode.get(e.errno, "EIO"), e.strerror or str(e))
        self.replicas.forget(name, gen)
        log.info("replica %r (generation %d) dropped for uid %d (pid %d)", name, gen, uid, pid)
        return {"op": "dropped", "name": name}

    def _fetch(self, dl, f, uid, pid):
        """A local caller's fetch (uid and pid from SO_PEERCRED): the reply frame."""
        name, timeout = f.get("name"), f.get("timeout")
        if not isinstance(name, str) or ":" not in name:
            return _wire.error_frame("EINVAL", f"{name!r} is not 'peer:name'")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            return _wire.error_frame("EINVAL", f"timeout {timeout!r} is not a number >= 0")
        if len(name.encode()) > dlpack_ipc.NAME_MAX:
            return _wire.error_frame("ENAMETOOLONG", f"{name!r} is longer than NAME_MAX "
                                     f"({dlpack_ipc.NAME_MAX} bytes)")
        peer, _, rname = name.partition(":")
        deadline = None if timeout is None else time.monotonic() + timeout
        if peer != _registry.ANY_HOST:
            return self._fetch_from(dl, peer, rname, deadline, uid, pid)
        if self.registry is None:
            return _wire.error_frame("ENOENT", f"{name!r}: '{_registry.ANY_HOST}:' asks the "
                                     "registry which bridge holds the name; there is no "
                                     "--registry")
        try:
            hosts = _registry.holders(self.registry, self.registry_prefix, rname)
        except OSError as e:
            return _wire.error_frame(errno.errorcode.get(e.errno, "EIO"), e.strerror or str(e))
        if self.registration is not None:    # never itself, over the network
            hosts = [h for h in hosts if h != self.registration.name]
        if not hosts:
            return _wire.error_frame("ENOENT", f"no bridge holds {rname!r} in the registry "
                                     f"({_registry.holders_prefix(self.registry_prefix, rname)}"
                                     f" at {self.registry.url})")
        with self._lock:       # those connected already first, then in the registry's order
            def idle(h):
                link = self.peers.get(h) or self.found.get(h)
                return not (link is not None and link.connected())
            hosts.sort(key=idle)
        tried = hosts[:_registry.HOLDERS_TRIED_MAX]
        for i, host in enumerate(tried):
            reply = self._fetch_from(dl, host, rname, deadline, uid, pid)
            if reply["op"] != "error" or reply.get("errno") not in _NEXT_HOLDER or \
                    i == len(tried) - 1 or \
                    (deadline is not None and time.monotonic() >= deadline):
                return reply
            log.info("fetch %r for uid %d (pid %d): %s; trying the next bridge", name, uid,
                     pid, reply.get("message"))
        return reply

    def _fetch_from(self, dl, peer, rname, deadline, uid, pid):
        """Fetch rname from peer into the replica peer:rname: the reply frame."""
        name = f"{peer}:{rname}"
        if len(name.encode()) > dlpack_ipc.NAME_MAX:
            return _wire.error_frame("ENAMETOOLONG", f"{name!r} is longer than NAME_MAX "
                                     f"({dlpack_ipc.NAME_MAX} bytes)")
        try:
            link = self._peer(peer)
        except OSError as e:
            return _wire.error_frame(errno.errorcode.get(e.errno, "EIO"), e.strerror or str(e))
        if any(local == name for _, _, local in self.follow):
            # --follow keeps it fresh as the bridge's own: a caller's fetch would take the
            # replica over, and the follow could then never replace it
            return _wire.error_frame("EPERM", f"{name!r} is kept fresh by --follow: attach "
                                     "it, no fetch is needed")
        try:
            try:
                gen = link.fetch(dl, rname, name, deadline, uid)
            except _importer.Forgotten:         # dropped just now: once more, on a new one
                link = self._peer(peer)
                gen = link.fetch(dl, rname, name, deadline, uid)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("fetch %r for uid %d (pid %d): malformed answer from peer %s: %r", name,
                        uid, pid, peer, e)
            return _wire.error_frame("EPROTO", f"peer {peer} ({link.where}), {rname!r}: "
                                     f"malformed answer: {e!r}")
        except OSError as e:
            code = errno.errorcode.get(e.errno) or (
                "ETIMEDOUT" if isinstance(e, TimeoutError) else
                "ECONNRESET" if isinstance(e, ConnectionError) else "EIO")
            log.info("fetch %r for uid %d (pid %d): %s", name, uid, pid, e)
            return _wire.error_frame(code, f"peer {peer} ({link.where}), {rname!r}: "
                                     f"{e.strerror or e}")
        except Exception as e:     # NIXL's own errors: this fetch fails, not the bridge
            log.warning("fetch %r for uid %d (pid %d): %r", name, uid, pid, e)
            return _wire.error_frame("EIO", f"peer {peer} ({link.where}), {rname!r}: {e!r}")
        self.count("fetched")
        return {"op": "fetched", "name": name, "generation": gen}


# What a fetch of *:name takes as "this bridge cannot serve it now": the next one is tried.
_NEXT_HOLDER = ("ENOENT", "ECONNREFUSED", "ECONNRESET", "ECONNABORTED", "ETIMEDOUT",
                "EHOSTUNREACH", "ENETUNREACH", "EPROTO", "EIO")


def _created_ns(dl, name, generation):
    """The creation time of name's entry at generation (a follower tells two entries of one
    generation apart by it), or None where dlpackd no longer shows that one."""
    try:
        entry = _push.find(dl, name)
    except (OSError, ValueError):
        return None
    return entry.created_ns if entry is not None and entry.generation == generation else None


def _recv_request(sock):
    """A peer's next request (its first bytes have arrived), refused past REQUEST_VALUES_MAX
    before it is parsed."""
    return _wire.recv(sock, time.monotonic() + _wire.AUTH_TIMEOUT,
                      values=_wire.REQUEST_VALUES_MAX, values_name="REQUEST_VALUES_MAX")


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
    s.listen(LISTEN_BACKLOG)
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
    s.listen(LISTEN_BACKLOG)
    return s
