# SPDX-License-Identifier: Apache-2.0
"""The bridge's NIXL agents (host memory, WRITE over UCX), their replacement after an aborted
transfer, and the quarantine of what such a transfer left registered."""
import gc
import logging
import struct
import threading
import time

# What an aborted transfer leaves registered (and mapped), in seconds, before it is
# deregistered and released: a WRITE the peer may still have in flight never lands in (or reads
# from) memory that is gone. --quarantine sets it; it must outlast UCX's TCP keepalive.
QUARANTINE = 60.0
# Quarantined transfers (each a registration and the attach or replica that maps it) past
# which the bridge refuses new gets and fetches with EAGAIN: failed transfers free their lease
# slot, so LEASES_MAX does not bound these.
QUARANTINE_MAX = 64
# Notifications received and not (yet) matched to a transfer that are kept, the oldest dropped
# first: a peer may send any number.
NOTIFS_MAX = 1024
# Agents replaced after an aborted transfer and still used (by a connection, a transfer or the
# quarantine) past which the agent in use is not replaced again until one of them is destroyed:
# each holds a UCX worker (its data ports and threads) until nothing uses it.
RETIRED_MAX = 4
# Seconds between two attempts to make the agent that replaces one with an aborted transfer,
# when making it fails (UCX finds no usable device while the link that broke the transfer is
# still down).
AGENT_RETRY = 2.0

# Where NIXL 1.5's serialized agent metadata, full (get_agent_metadata) or partial
# (get_partial_agent_metadata), names its agent: nixlSerDes's header "nixlSerDes|", the tag
# "Agent", the name's length (a size_t, as the host lays it out), the name, "|". NIXL has no
# call that reads the name without loading the blob (loadRemoteMD merges a blob into the entry
# of the agent it names, and a blob that fails to load erases that entry), so the bridge reads
# it here, strictly: a blob whose header does not match is refused, not loaded. Agents checks
# the layout against the metadata of every agent it makes (_checked), so a NIXL that lays it
# out otherwise is refused at once, not misread.
MD_HEAD = b"nixlSerDes|Agent"
MD_LEN = struct.Struct("@N")
# A peer-given agent name in a log line or an error is cut to this many characters.
NAME_SHOWN_MAX = 200

log = logging.getLogger("dlpackd-bridge")


class MetadataRefused(Exception):
    """A peer's NIXL metadata that the bridge does not load (not in NIXL's layout, or of an
    agent other than the peer's): the reason, naming what it found."""


def metadata_agent(blob):
    """The name of the agent that NIXL metadata blob (full or partial) describes, read without
    loading it (MD_HEAD); MetadataRefused, saying why, for a blob not laid out so."""
    start = len(MD_HEAD) + MD_LEN.size
    if not blob.startswith(MD_HEAD) or len(blob) < start:
        raise MetadataRefused(f"not NIXL agent metadata: it does not start with {MD_HEAD!r} "
                              "and the name's length")
    n = MD_LEN.unpack_from(blob, len(MD_HEAD))[0]
    if n == 0 or n >= len(blob) - start or blob[start + n] != ord("|"):
        raise MetadataRefused(f"not NIXL agent metadata: an agent name of {n} bytes in "
                              f"{len(blob)} bytes of metadata, not ended by '|'")
    try:
        return blob[start:start + n].decode()
    except UnicodeDecodeError:
        raise MetadataRefused("NIXL agent metadata whose agent name is not UTF-8") from None


def _checked(agent):
    """agent, once its own metadata names it where metadata_agent reads (RuntimeError else:
    this NIXL lays its metadata out otherwise, and peers' metadata cannot be told apart)."""
    try:
        name = metadata_agent(agent.metadata())
    except MetadataRefused as e:
        name = e
    if name != agent.name:
        raise RuntimeError(f"NIXL agent {agent.name!r}: its own metadata does not name it as "
                           f"NIXL 1.5 lays it out ({name}): this bridge reads which agent a "
                           "peer's metadata names before loading it, and cannot with this NIXL")
    return agent


class Nixl:
    """A NIXL agent of the bridge's (_nixl.Agents), host memory only, WRITE over UCX."""

    def __init__(self, name, progress_thread):
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        conf = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                 sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = nixl_agent(name, conf)
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend here")
        self.name = name
        self._lock = threading.Lock()
        self._notifs = {}           # (agent, message): None, oldest first
        self._remotes = set()       # the remote agents loaded
        self.registered = 0         # registrations not given back yet

    def metadata(self):
        return self.agent.get_agent_metadata()

    def close(self):
        """Let go of the agent: NIXL destroys it, and UCX closes its worker's connections."""
        self.agent = None
        gc.collect()        # whatever cycle still held the agent's wrapper

    def add_remote(self, blob):
        name = _text(self.agent.add_remote_agent(blob))
        with self._lock:
            self._remotes.add(name)
        return name

    def remote_names(self):
        with self._lock:
            return set(self._remotes)

    def remove_remote(self, agent):
        """Remove agent (NIXL closes its UCX connections to it); whether NIXL did."""
        try:
            self.agent.remove_remote_agent(agent)
            removed = True
        except Exception as e:  # a peer that never connected over UCX has nothing to remove
            log.debug("removing agent %s: %s", agent, e)
            removed = False
        with self._lock:
            self._remotes.discard(agent)
            self._notifs = {n: None for n in self._notifs if n[0] != agent}
        return removed

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
                    self._notifs[(_text(a), bytes(m))] = None
            if (agent, msg) in self._notifs:
                del self._notifs[(agent, msg)]
                return True
            while len(self._notifs) > NOTIFS_MAX:
                oldest = next(iter(self._notifs))
                log.warning("notification %r of agent %r dropped: %d unmatched (NOTIFS_MAX)",
                            oldest[1][:64], oldest[0], NOTIFS_MAX)
                del self._notifs[oldest]
        return False


class Agents:
    """The bridge's NIXL agent in use, and those it replaced.

    A transfer aborted in the middle (a link down, a peer killed) can leave UCX's data connection
    to the peer open after the link comes back, its late bytes unread, and NIXL 1.5 has no call
    that closes it: only destroying the agent does. So an agent with an aborted transfer is
    replaced (tick(), from the housekeeping thread) by a new one with a new name: connections
    made after that use the new agent, and peers load its metadata then. The old agent keeps
    serving what still uses it (hold() / let_go(): a control connection, a transfer, an entry
    in quarantine); its idle connections are closed (retired()), and it is destroyed once
    nothing holds it. make(name) makes an agent (Nixl, or a test's fake)."""

    def __init__(self, make, name):
        self._make = make
        self._lock = threading.Lock()
        self.now = _checked(make(name))
        self._held = {id(self.now): 0}      # id(agent): holders, for every agent alive
        self._alive = [self.now]
        self._aborted = False               # the agent in use had an aborted transfer
        self._retry_at = 0.0                # time.monotonic() of the next attempt
        self._full_logged = False
        self._failed_logged = False
        self.replaced = 0
        # (agent, peer's agent name): the connections that loaded that peer into agent. Held
        # across NIXL's add and remove, so that a remove never undoes another's add.
        self._loaded = {}
        self._load_lock = threading.Lock()

    def hold(self, agent=None):
        """Hold agent (None: the one in use) until let_go(agent); the agent. An agent held
        already may be held again; one nothing holds only while it is the one in use."""
        with self._lock:
            if agent is None:
                agent = self.now
            assert id(agent) in self._held, f"NIXL agent {agent.name} held after its end"
            self._held[id(agent)] += 1
            return agent

    def load(self, agent, blob):
        """Load a peer's metadata blob into agent for one connection: (the peer's agent name,
        how many other connections had loaded it). NIXL knows a peer's agent by name only and
        loads the same metadata twice, so a name loaded for several connections (two links to
        one bridge, or a token holder replaying another peer's metadata) is counted, and
        removed by the last unload()."""
        with self._load_lock:
            name = agent.add_remote(blob)
            others = self._loaded.get((agent, name), 0)
            self._loaded[(agent, name)] = others + 1
        return name, others

    def load_partial(self, agent, blob, expected):
        """Load blob, a transfer's metadata of the peer's agent expected, into agent.
        MetadataRefused, with blob not loaded, if it names another agent (metadata_agent): NIXL
        would merge it into that agent's entry, or erase the entry if it failed to load, and
        that agent may be another connection's peer."""
        name = metadata_agent(blob)
        if name != expected:
            raise MetadataRefused(f"metadata of agent {name[:NAME_SHOWN_MAX]!r}, not of the "
                                  f"peer's {expected!r}: refused, not loaded")
        with self._load_lock:
            known = agent.remote_names()
            loaded = agent.add_remote(blob)
            if loaded != name and loaded not in known:
                agent.remove_remote(loaded)
        if loaded != name:      # _checked makes this unreachable; fail closed all the same
            log.error("NIXL loaded metadata whose header names agent %r as agent %r: its "
                      "layout is not the one this bridge reads", name[:NAME_SHOWN_MAX],
                      loaded[:NAME_SHOWN_MAX])
            raise MetadataRefused(f"metadata that NIXL loaded as agent "
                                  f"{loaded[:NAME_SHOWN_MAX]!r}, not as {name!r}")

    def unload(self, agent, name):
        """A connection lets go of the peer's agent name it load()ed: removed from agent once
        no connection holds it; whether it was (its UCX connections closed: it can no longer
        write here)."""
        with self._load_lock:
            left = self._loaded.get((agent, name), 1) - 1
            if left > 0:
                self._loaded[(agent, name)] = left
                return False
            self._loaded.pop((agent, name), None)
            return agent.remove_remote(name)

    def let_go(self, agent):
        with self._lock:
            assert self._held[id(agent)] > 0, f"NIXL agent {agent.name} let go once too often"
            self._held[id(agent)] -= 1

    def end(self, agent, holds):
        """Destroy agent now if it was replaced and holds (the quarantine's entries that only
        its end can release) are all that hold it; whether it was."""
        with self._lock:
            if agent is self.now or self._held.get(id(agent)) != holds:
                return False
            self._alive.remove(agent)
            del self._held[id(agent)]
        getattr(agent, "close", lambda: None)()
        log.info("NIXL agent %s destroyed: only quarantine entries its end releases held it",
                 agent.name)
        return True

    def aborted(self, agent):
        """A transfer of agent was aborted midway: if it is the one in use, replace it."""
        with self._lock:
            if agent is self.now:
                self._aborted = True

    def retired(self, agent):
        """Whether agent was replaced (its connections close once idle)."""
        return agent is not self.now

    def alive(self):
        """Every agent not destroyed yet, the one in use first."""
        with self._lock:
            return list(self._alive)

    def registered(self):
        return sum(a.registered for a in self.alive())

    def tick(self, name):
        """Destroy the replaced agents nothing holds, then replace the one in use if one of
        its transfers aborted (named name); called from one thread only."""
        with self._lock:
            dead = [a for a in self._alive[1:] if self._held[id(a)] == 0]
            for a in dead:
                self._alive.remove(a)
                del self._held[id(a)]
            replace = self._aborted
            retired = len(self._alive) - 1
        for a in dead:
            getattr(a, "close", lambda: None)()
            log.info("NIXL agent %s destroyed: nothing uses it any more", a.name)
        if not replace or time.monotonic() < self._retry_at:
            return
        if retired >= RETIRED_MAX:
            if not self._full_logged:
                self._full_logged = True
                log.warning("NIXL agent %s had an aborted transfer, and is not replaced: %d "
                            "replaced agents are still in use (RETIRED_MAX)", self.now.name,
                            RETIRED_MAX)
            return
        try:
            new = _checked(self._make(name))
        except Exception as e:    # keep the one in use, and try again
            self._retry_at = time.monotonic() + AGENT_RETRY
            if not self._failed_logged:
                self._failed_logged = True
                log.warning("NIXL agent %s had an aborted transfer, and no new agent could be "
                            "made: %s; trying again every %g s (AGENT_RETRY), said once",
                            self.now.name, e, AGENT_RETRY)
            return
        with self._lock:
            old, self.now = self.now, new
            self._held[id(new)] = 0
            self._alive.insert(0, new)
            self._aborted = False
            self._full_logged = self._failed_logged = False
            self.replaced += 1
        log.info("NIXL agent %s replaced by %s after an aborted transfer; the old one serves "
                 "what uses it and is destroyed after that", old.name, new.name)


def _text(name):
    return name.decode() if isinstance(name, bytes) else name


class Quarantine:
    """What an aborted transfer left registered, a fence as well as a timer: given back after
    QUARANTINE, and then only once NIXL no longer reports its transfer in progress and has
    released its handle (exporter), and once the peer that wrote into it was fenced off
    (importer: its remote agent removed, so UCX closed that connection). An entry that cannot
    be given back is retried at each sweep and keeps counting towards QUARANTINE_MAX. Each
    entry holds the agent its registration and transfer belong to (Agents.hold)."""

    def __init__(self, agents, seconds=QUARANTINE):
        self.seconds = seconds
        self._agents = agents
        self._lock = threading.Lock()
        self._items = []

    def add(self, agent, why, xfer=None, reg=None, tensors=(), fenced=True):
        """agent: the one reg and xfer belong to. fenced False: the peer that may write into
        reg could not be cut off (its remote agent not removed): reg and tensors are given back
        only once agent, replaced, is destroyed (_end_unfenced)."""
        log.warning("quarantined for %.0f s: %s", self.seconds, why)
        self._agents.hold(agent)
        with self._lock:
            self._items.append({"due": time.monotonic() + self.seconds, "why": why,
                                "agent": agent, "xfer": xfer, "reg": reg,
                                "tensors": list(tensors), "fenced": fenced, "logged": False})

    def __len__(self):
        with self._lock:
            return len(self._items)

    def full(self):
        """Whether QUARANTINE_MAX transfers are in quarantine (new ones are refused)."""
        return len(self) >= QUARANTINE_MAX

    def sweep(self, all_=False):
        now = time.monotonic()
        with self._lock:
            due = [i for i in self._items if all_ or i["due"] <= now]
        for i in due:
            # the order matters: the transfer, then the registration, then the mapping
            held = self._held(i)
            if held is not None:
                if not i["logged"]:
                    i["logged"] = True
                    log.warning("still in quarantine past %.0f s (%s): %s", self.seconds,
                                held, i["why"])
                continue
            if i["reg"] is not None:
                _quiet(i["agent"].deregister, i["reg"])
                i["reg"] = None
            for t in i["tensors"]:
                t.release()
            with self._lock:
                self._items.remove(i)
            self._agents.let_go(i["agent"])
            log.info("released after quarantine: %s", i["why"])
        self._end_unfenced()

    def _end_unfenced(self):
        """An entry whose peer could not be fenced off (its remote agent not removed) is
        released once its agent, replaced, is held by such entries alone: the agent is
        destroyed first (UCX closes every connection it had: nothing lands any more), then
        the memory is given back (its registration ended with the agent)."""
        with self._lock:
            by_agent = {}
            for i in self._items:
                if not i["fenced"]:
                    by_agent.setdefault(id(i["agent"]), []).append(i)
        for items in by_agent.values():
            if not self._agents.end(items[0]["agent"], len(items)):
                continue
            for i in items:
                with self._lock:
                    self._items.remove(i)
                for t in i["tensors"]:
                    _quiet(t.release)
                log.info("released after quarantine, its NIXL agent destroyed: %s", i["why"])

    def _held(self, i):
        """Why entry i cannot be given back yet (None: it can); releases its handle if so."""
        if not i["fenced"]:
            return "the peer could not be fenced off"
        xfer = i["xfer"]
        if xfer is not None:
            try:
                st = i["agent"].state(xfer)
            except Exception as e:
                st = f"state unknown: {e}"
            if st == "PROC":
                return "its transfer is still in progress"
            if not _quiet(i["agent"].release, xfer):
                return "NIXL did not release its transfer handle"
            i["xfer"] = None
        return None


def _quiet(fn, *args):
    """fn(*args), its exception logged instead of raised; whether it succeeded."""
    try:
        fn(*args)
    except Exception as e:
        log.warning("%s: %s", getattr(fn, "__name__", fn), e)
        return False
    return True


def _span(tensors):
    """The (base, length) that covers every tensor with bytes (one mapping: one storage)."""
    live = [t for t in tensors if t.nbytes]
    if not live:
        return None
    base = min(t.data_ptr for t in live)
    return base, max(t.data_ptr + t.nbytes for t in live) - base
