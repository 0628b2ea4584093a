# SPDX-License-Identifier: Apache-2.0
"""Push subscriptions (docs/bridge.md, "Fetching a name"): the exporting side's one watch of
the local dlpackd and the peer connections subscribed to each name; the importing side's
--follow, refetching at once on a push and polling as the safety net.

A pushed frame travels on the peer's own control connection, told from an answer by its op
("changed", "gone") and by carrying no request id: a subscription then ends with the
connection that made it, as a lease does, and needs no authentication of its own.
"""
import logging
import os
import threading
import time

import dlpack_ipc

from . import _wire
from ._importer import CONNECT_TIMEOUT

# Names one peer connection may subscribe to at once: each is a record here and a frame on
# every change of that name; a follower past it is refused (EAGAIN) and polls that name.
SUBSCRIPTIONS_PER_PEER_MAX = 64
# How often --follow still asks for the generation while a subscription is live, in seconds
# (--follow-subscribed-interval): only a push lost with a connection needs it.
FOLLOW_SUBSCRIBED_INTERVAL = 30.0
# After a failed attempt to reach the peer, a follow tries again this soon (seconds), doubling
# up to --follow-interval (at least RESUBSCRIBE_FIRST) and at most RESUBSCRIBE_MAX: a restarted
# peer is subscribed again within that much of its return.
RESUBSCRIBE_FIRST = 1.0
RESUBSCRIBE_MAX = 60.0
# The longest a connection's thread waits to send one push before it gives the peer up: a
# subscriber that does not read its pushes loses its connection, and never blocks anyone else.
PUSH_SEND_TIMEOUT = 10.0
# The watch thread looks at the bridge's stop flag this often, in seconds; a lost watch is
# opened again every WATCH_AGAIN seconds.
WATCH_TICK = 0.5
WATCH_AGAIN = 1.0

log = logging.getLogger("dlpackd-bridge")

# The kinds of dlpackd's watch events that change what a subscriber fetches.
_CHANGES = ("published", "replaced", "unpublished")


class Refused(Exception):
    """A subscribe the exporter refuses: errname goes in the error frame."""

    def __init__(self, errname, message):
        super().__init__(message)
        self.errname = errname


class Subscriber:
    """One peer connection's subscriptions, and the names changed since its thread last sent
    their state (coalesced: a name changed twice is sent once, as it is then)."""

    def __init__(self, who):
        self.who = who
        self.names = set()
        self.dirty = set()
        self.failing = False        # dlpackd could not be asked at the last flush


class Publisher:
    """The exporting side: one watch of the local dlpackd for the whole bridge (opened at the
    first subscription, reopened if dlpackd drops it), and who is subscribed to what.

    The watch thread only marks names dirty, under a lock held for set operations: it never
    waits on a peer. Each connection's own thread sends its pushes (flush)."""

    def __init__(self, stop, dlpackd_socket, exports):
        self.stop = stop
        self.socket = dlpackd_socket
        self.prefix = os.path.commonprefix(list(exports)) if exports else ""
        self._lock = threading.Lock()
        self._subs = {}             # name -> {Subscriber}
        self._thread = None

    def subscribers(self):
        """Subscriptions held now, all connections together."""
        with self._lock:
            return sum(len(s) for s in self._subs.values())

    def subscribe(self, sub, name):
        """Subscribe sub to name; whether this added it (False: it was subscribed already, and
        nothing changes). Refused past SUBSCRIPTIONS_PER_PEER_MAX; OSError if the local
        dlpackd cannot be watched."""
        if name in sub.names:
            return False
        if len(sub.names) >= SUBSCRIPTIONS_PER_PEER_MAX:
            raise Refused("EAGAIN", f"{name!r}: this connection holds "
                          f"{SUBSCRIPTIONS_PER_PEER_MAX} subscriptions "
                          "(SUBSCRIPTIONS_PER_PEER_MAX)")
        # the watch is opened here, before the subscriber reads the generation (no change after
        # that read can be missed), outside the lock (the watch thread never waits on it); the
        # one opened by a thread that lost the race is closed
        w = None
        try:
            while True:
                with self._lock:
                    if self._thread is None and w is not None:
                        # changes made while no watch was open were missed: the names still
                        # subscribed are looked at again
                        for n, subs in self._subs.items():
                            for s in subs:
                                s.dirty.add(n)
                        self._thread = threading.Thread(target=self._run, args=(w,),
                                                        name="watch", daemon=True)
                        self._thread.start()
                        w = None
                    if self._thread is not None:
                        self._subs.setdefault(name, set()).add(sub)
                        sub.names.add(name)
                        return True
                w = dlpack_ipc.watch(self.prefix, socket=self.socket)
        finally:
            if w is not None:
                w.close()

    def unsubscribe(self, sub, name):
        """sub's subscription to name ends (none: nothing changes)."""
        with self._lock:
            subs = self._subs.get(name)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[name]
            sub.names.discard(name)
            sub.dirty.discard(name)

    def unsubscribe_all(self, sub):
        """sub's connection ended: its subscriptions end with it."""
        with self._lock:
            for name in sub.names:
                subs = self._subs.get(name)
                if subs is not None:
                    subs.discard(sub)
                    if not subs:
                        del self._subs[name]
            sub.names.clear()
            sub.dirty.clear()

    def _mark(self, names):
        with self._lock:
            for name in names:
                for sub in self._subs.get(name, ()):
                    sub.dirty.add(name)

    def _run(self, w):
        """The watch thread: mark each changed name dirty for its subscribers until stop; a
        watch lost, or failing in a way nothing expected, is opened again (_reopen()). If the
        thread ends all the same, the next subscription starts it again."""
        try:
            while w is not None:
                try:
                    while not self.stop.is_set():
                        ev = w.next_event(WATCH_TICK)
                        if ev is not None and ev.kind in _CHANGES:
                            self._mark([ev.name])
                except (OSError, ValueError) as e:
                    log.warning("the watch of this host's dlpackd was lost (%s): opening it "
                                "again", e)
                except Exception:
                    log.exception("the watch of this host's dlpackd failed: opening it again")
                finally:
                    w.close()
                w = self._reopen()
        finally:
            with self._lock:
                self._thread = None

    def _reopen(self):
        """A new watch, tried every WATCH_AGAIN until stop (then None); every subscribed name
        is marked, since changes made while no watch was open were missed."""
        while not self.stop.wait(WATCH_AGAIN):
            try:
                w = dlpack_ipc.watch(self.prefix, socket=self.socket)
            except OSError as e:
                log.debug("watching this host's dlpackd: %s", e)
                continue
            except Exception:
                log.exception("the watch of this host's dlpackd failed: opening it again")
                continue
            with self._lock:
                names = list(self._subs)
            self._mark(names)
            log.info("watching this host's dlpackd again; %d subscribed names checked",
                     len(names))
            return w
        return None

    def flush(self, sock, dl, sub):
        """Send sub's peer the state of each name changed since the last flush: `changed`
        (generation, created_ns) or `gone`. A name dlpackd cannot be asked about now stays
        dirty (dl, a client that reconnects, connects anew at the next flush); a peer that
        takes more than PUSH_SEND_TIMEOUT to take a push is given up (TimeoutError: its
        connection closes)."""
        with self._lock:
            names, sub.dirty = sorted(sub.dirty), set()
        for i, name in enumerate(names):
            try:
                entry = find(dl, name)
            except (OSError, ValueError) as e:
                if not sub.failing:
                    sub.failing = True
                    log.warning("pushes to %s: this host's dlpackd, asked about %s: %s: "
                                "tried again every TICK", sub.who, shown(name), e)
                with self._lock:
                    sub.dirty.update(n for n in names[i:] if n in sub.names)
                return
            if sub.failing:
                sub.failing = False
                log.info("pushes to %s go again", sub.who)
            frame = {"op": "gone", "name": name} if entry is None else \
                {"op": "changed", "name": name, "generation": entry.generation,
                 "created_ns": entry.created_ns}
            sock.settimeout(PUSH_SEND_TIMEOUT)
            _wire.send(sock, frame)


def shown(name, limit=200):
    """A peer-given name for a log line: quoted, cut to about limit characters."""
    text = repr(name)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def find(dl, name):
    """The EntryInfo of name in dlpackd dl, or None."""
    found = [e for e in dl.list(name) if e.name == name]
    return found[0] if found else None


# -- the importing side: --follow --------------------------------------------------------

_KEEP = object()        # no news of the peer's entry this round


class Follow:
    """--follow PEER:NAME: the replica local of link's rname kept fresh. Subscribed, it
    refetches as soon as a push says the entry changed, and polls every
    --follow-subscribed-interval; without a live subscription (the peer refused it, or the
    connection is down) it polls every --follow-interval and subscribes again on each new
    connection, checking the generation once."""

    def __init__(self, bridge, link, rname, local):
        self.bridge = bridge
        self.link = link
        self.rname = rname
        self.local = local
        self.subscribed = False
        self.generation = None      # the peer's generation of the replica held
        self._seen = None           # (generation, created_ns) of the peer's entry fetched
        self._epoch = None          # the link's connection the subscription lives on
        self._refused = None        # the link's connection that refused it
        self._said = set()
        self._lock = threading.Lock()
        self._pushed = _KEEP
        self._wake = threading.Event()
        link.follows.setdefault(rname, []).append(self)

    def push(self, frame, number):
        """A push for rname from the peer, the link's frame number (any thread; never
        waits)."""
        if frame["op"] == "gone":
            state = None
        else:
            state = (frame.get("generation"), frame.get("created_ns"))
        with self._lock:
            self._pushed = (state, number)
        self._wake.set()

    def lost(self):
        """The link's connection is gone: subscribe again."""
        self._wake.set()

    def _take(self):
        with self._lock:
            pushed, self._pushed = self._pushed, _KEEP
        return pushed

    def _answered(self, number):
        """An answer read as frame number is applied: a push read before it is older news,
        dropped."""
        if number is None:
            return
        with self._lock:
            if self._pushed is not _KEEP and self._pushed[1] < number:
                self._pushed = _KEEP

    def _once(self, key, level, msg, *args):
        if key not in self._said:
            self._said.add(key)
            log.log(level, msg, *args)

    def run(self):
        args = self.bridge.args
        link = self.link
        # reconnect=True: a dlpackd restarted here is reached again at the next attempt
        dl = self.bridge.dlpackd(reconnect=True)
        retry = RESUBSCRIBE_FIRST
        next_poll = 0.0
        try:
            while not self.bridge.stop.is_set():
                wait = None
                try:
                    polled = self._round(args, link, dl, next_poll)
                    if polled is not None:
                        next_poll = polled
                    retry = RESUBSCRIBE_FIRST
                except FileNotFoundError as e:
                    # gone (or not there yet) on the peer: a live subscription pushes the entry
                    # when it comes, so only the safety net polls
                    next_poll = time.monotonic() + (args.follow_subscribed_interval
                                                    if self.subscribed else args.follow_interval)
                    try:
                        self._apply(dl, None, getattr(e, "frame", None))
                    except OSError as e2:
                        log.warning("follow %r: gone on %s, and the replica could not be "
                                    "unpublished: %s; trying again in %g s", self.local,
                                    link.name, e2, retry)
                        wait = retry
                        retry = min(retry * 2, self._retry_max(args))
                        next_poll = 0.0
                except OSError as e:
                    if getattr(e, "subscribe_refused", False):
                        # an older bridge, or this connection's subscriptions are full: the
                        # poll carries on at once
                        self._refused = link.epoch
                        self._once(("refused", e.errno), logging.WARNING,
                                   "follow %r: %s: polling every %g s instead", self.local,
                                   e.strerror or e, args.follow_interval)
                        next_poll = 0.0
                        continue
                    log.warning("follow %r: peer %s (%s): %s; trying again in %g s", self.local,
                                link.name, link.where, e.strerror or e, retry)
                    wait = retry
                    retry = min(retry * 2, self._retry_max(args))
                    next_poll = 0.0     # a failed fetch is tried again then, subscribed or not
                except Exception:
                    log.exception("follow %r", self.local)
                    wait = args.follow_interval
                    next_poll = 0.0
                if wait is None:
                    wait = max(0.0, next_poll - time.monotonic())
                self._wake.wait(wait)
                self._wake.clear()
        finally:
            dl.close()

    @staticmethod
    def _retry_max(args):
        return min(max(args.follow_interval, RESUBSCRIBE_FIRST), RESUBSCRIBE_MAX)

    def _round(self, args, link, dl, next_poll):
        """One look at the peer's entry: subscribe, take a push or poll, as due, and make the
        replica match; the time of the next poll where this round set it, else None."""
        live = self._epoch is not None and self._epoch == link.epoch and link.connected()
        if self._epoch is not None and not live:
            log.info("follow %r: the connection to %s was lost: subscribing again",
                     self.local, link.name)
            self._epoch = None
        self.subscribed = live
        pushed = self._take()
        answer = None               # the frame number of the answer state comes from
        refused = self._refused is not None and self._refused == link.epoch
        if not live and not refused and not link.refuses_subscribe():
            state, self._epoch, answer = link.subscribe(
                self.rname, time.monotonic() + CONNECT_TIMEOUT)
            self.subscribed = True
            log.info("follow %r: subscribed on %s (generation %s there)",
                     self.local, link.name, "none" if state is None else state[0])
        elif pushed is not _KEEP:
            state = pushed[0]
        elif time.monotonic() >= next_poll:
            state, answer = link.stat(self.rname, time.monotonic() + CONNECT_TIMEOUT)
        else:
            return None
        every = args.follow_subscribed_interval if self.subscribed else args.follow_interval
        polled = time.monotonic() + every
        self._apply(dl, state, answer)
        return polled

    def _apply(self, dl, state, answer):
        """Make the replica match state: the peer's (generation, created_ns), None when the
        entry is gone there, from the answer read as frame number answer (None: a push). What
        is then held is what the fetch's layout said, and pushes read before that answer are
        dropped."""
        if state is not None and state == self._seen:
            self._answered(answer)
            return
        if state is not None:
            layout = {}
            try:
                # the bridge's own replica, charged to its uid
                self.link.fetch(dl, self.rname, self.local,
                                time.monotonic() + max(self.bridge.ttl, 60.0),
                                self.bridge.replicas.own_uid, layout=layout)
            except FileNotFoundError as e:
                state = None            # gone between the news and the get
                answer = getattr(e, "frame", None)
            else:
                fetched = (layout.get("generation"), layout.get("created_ns"))
                if fetched[1] is None and fetched[0] == state[0]:
                    fetched = state     # an older peer's layout: no created_ns
                self._seen, self.generation = fetched, fetched[0]
                self._answered(layout.get("frame"))
                self.bridge.count("fetched")
                return
        self._answered(answer)
        if self._seen is not None:
            log.info("follow %r: gone on %s: unpublishing the replica", self.local,
                     self.link.name)
            try:
                dl.unpublish(self.local)
            except FileNotFoundError:
                pass
            self.bridge.replicas.forget(self.local)
            self._seen = self.generation = None


def pump(link, stop):
    """Read the pushes a peer sends while no request is in flight (a request in flight reads
    them itself), until stop; whatever goes wrong, the connection is dropped and the reading
    goes on."""
    while not stop.is_set():
        try:
            if not link.pump(0.5):
                stop.wait(0.2)
        except Exception:
            log.exception("reading the pushes of peer %s: dropping its connection", link.name)
            with link.lock:
                link.drop()
            stop.wait(1.0)
