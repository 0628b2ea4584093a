# SPDX-License-Identifier: Apache-2.0
"""The exporting and importing sides' handling of a misbehaving peer, NIXL faked, over
socketpairs (ctest: bridge_server). The real NIXL path is driven by netns.py."""
import base64
import contextlib
import errno
import importlib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import pytest

from dlpack_ipc import bridge
from dlpack_ipc.bridge import _importer, _nixl, _push, _registry, _replicas, _server, _wire
from fake_nixl import FULL, PARTIAL, nixl_md, nixl_md_agent


def md64(name, rest=FULL):
    """NIXL metadata of agent name (fake_nixl.nixl_md; rest PARTIAL: a registration's), in
    base64 as a frame carries it."""
    return base64.b64encode(nixl_md(name, rest)).decode()


class FakeNixl:
    """Records the calls; fail names methods that raise."""

    def __init__(self, fail=(), name="exporter-agent"):
        self.name = name
        self.closed = False
        self.fail = set(fail)
        self.calls = []
        self.registered = 0
        self.remotes = set()

    def _do(self, what, *args):
        self.calls.append((what, *args))
        if what in self.fail:
            raise RuntimeError(f"injected failure of {what}")

    def metadata(self):
        return nixl_md(self.name)

    def add_remote(self, blob):
        self._do("add_remote", blob)
        name = nixl_md_agent(blob)[0]
        self.remotes.add(name)
        return name

    def remote_names(self):
        return set(self.remotes)

    def remove_remote(self, agent):
        self.remotes.discard(agent)
        try:
            self._do("remove_remote", agent)
        except RuntimeError:
            return False
        return True

    def partial_metadata(self, reg):
        return nixl_md("importer-agent", PARTIAL)

    def notified(self, agent, msg):
        return False

    def register(self, base, length):
        self._do("register", base, length)
        self.registered += 1
        return ("reg", base, length)

    def deregister(self, reg):
        self._do("deregister", reg)
        self.registered -= 1

    def write(self, local, remote, agent, notif):
        self._do("write", agent)
        return "xfer", self.write_state

    write_state = "DONE"

    def state(self, h):
        return "DONE"

    def release(self, h):
        self._do("release", h)

    def close(self):
        assert not self.closed, "an agent destroyed twice"
        self.closed = True


# the bridge's own uid in these tests (its replicas' owner in dlpackd)
BRIDGE_UID = 990


def fake_bridge(nixl=None, token=b"t" * 32):
    b = _server.Bridge.__new__(_server.Bridge)
    b.token = token
    b.agent_name = "exporter-agent"
    # the agent in use until an abort replaces it; a name the real Bridge lacks, so that a
    # leftover bridge-wide agent in the code under test fails here
    b.fake_nixl = nixl or FakeNixl()
    b.agents = _nixl.Agents(lambda name: b.fake_nixl if name == "exporter-agent" else
                            FakeNixl(name=name), "exporter-agent")
    b.quarantine = _server.Quarantine(b.agents, 60.0)
    b.stop = threading.Event()
    b._lock = threading.Lock()
    b._lease_seq = 0
    b.leases = 0
    b.ttl = 5.0
    b.exports = ["w/"]
    b.counts = {"served": 0, "fetched": 0, "refused": 0, "aborted": 0, "writing": 0}
    b.replicas = _replicas.Ledger(BRIDGE_UID)
    b.follow = []
    b.follows = []
    b.publisher = _push.Publisher(b.stop, None, b.exports)
    b.staging = _server.Staging(_server.STAGING_MAX)
    b.cuda_device = 0
    b._cuda_why = None          # looked at: takes device entries
    b._cuda_lock = threading.Lock()
    b.registry = b.registration = None
    b.found = {}
    b._init_limits()
    return b


def stop_fake_bridge(b):
    """Stop fake_bridge()'s publisher, and wait for its watch thread if it started one."""
    b.stop.set()
    if b.publisher._thread is not None:
        b.publisher._thread.join(5)


def tcp_pair():
    """Two ends of a loopback TCP connection (the bridge sets TCP options on its sockets)."""
    with socket.create_server(("127.0.0.1", 0)) as ls:
        c = socket.create_connection(ls.getsockname())
        s, _ = ls.accept()
    return c, s


def run_peer_thread(b, send):
    """Run the exporter's connection thread against send(sock); the frames it answered."""
    c, s = tcp_pair()
    th = threading.Thread(target=b._peer_thread, args=(s, ("192.0.2.1", 1)))
    th.start()
    try:
        send(c)
        frames = []
        while True:
            try:
                frames.append(_wire.recv(c, time.monotonic() + 5))
            except (ConnectionResetError, TimeoutError):
                break
            if frames[-1]["op"] == "error":
                break
    finally:
        th.join(10)
        alive = th.is_alive()
        c.close()
        s.close()
    assert not alive, "the connection's thread did not end"
    return frames


@pytest.mark.parametrize("body", [None, b'{"op":"hello","x":' + b"[" * 1000,
                                  b"\xff", b'{"op":"hello"}'])
def test_malformed_hello_refused_and_counted(body):
    b = fake_bridge()

    def send(c):
        if body is None:
            c.sendall(struct.pack(">I", _wire.FRAME_MAX))   # a stranger's 8 MiB hello
        else:
            c.sendall(struct.pack(">I", len(body)) + body)
    frames = run_peer_thread(b, send)
    assert [f["op"] for f in frames] == ["error"]
    assert frames[0]["errno"] == ("EMSGSIZE" if body is None else "EPROTO")
    assert b.counts["refused"] == 1


class FakeTensor:
    def __init__(self, nbytes, ptr=4096):
        self.nbytes = nbytes
        self.data_ptr = ptr
        self.released = 0

    def release(self):
        self.released += 1


def lease_of(b, tensors, name="w/x"):
    lease = _server.Lease(b.new_lease_id(), name, 1,
                          [(str(i), t) for i, t in enumerate(tensors)], b.ttl)
    return {lease.id: lease}, lease


def put_frame(lease, tensors, agent="importer-agent"):
    return {"op": "put", "id": 1, "lease": lease.id,
            "metadata": md64(agent, PARTIAL),
            "descs": [[1 << 20, t.nbytes] for t in tensors]}


def one_put(nixl):
    """A put of one 100-byte tensor on a fresh lease of a bridge with nixl; (bridge, its
    leases, the tensor, the exporter's answer or what _put raised)."""
    b = fake_bridge(nixl)
    tensors = [FakeTensor(100)]
    leases, lease = lease_of(b, tensors)
    c, s = tcp_pair()
    try:
        b._put(s, put_frame(lease, tensors), leases, b.fake_nixl, "importer-agent", "peer")
        reply = _wire.recv(c, time.monotonic() + 5)
    except Exception as e:  # the outcome under test
        reply = e
    finally:
        c.close()
        s.close()
    return b, leases, tensors, reply


@pytest.mark.parametrize("fail", [(), ("release",), ("deregister",), ("release", "deregister")])
def test_a_done_put_gives_the_lease_back_whatever_nixl_raises(fail):
    b, leases, tensors, reply = one_put(FakeNixl(fail))
    assert reply["op"] == "done"         # the bytes landed: the transfer is done
    assert b.leases == 0 and leases == {}
    if fail:
        # what NIXL did not give back keeps its mapping, in quarantine
        assert len(b.quarantine) == 1 and tensors[0].released == 0
        b.quarantine.sweep(all_=True)
        if "release" in fail:            # a handle NIXL keeps keeps its memory too
            assert len(b.quarantine) == 1 and tensors[0].released == 0
            b.fake_nixl.fail.clear()
            b.quarantine.sweep(all_=True)
    assert len(b.quarantine) == 0 and tensors[0].released == 1
    assert b.counts["served"] == 1


class FakeDlpackd:
    """The names the bridge publishes, owned by BRIDGE_UID, each publish a new generation."""

    def __init__(self):
        self.made = []
        self.entries = {}        # name -> (owner uid, generation)
        self.generation = 0

    def empty(self, shape, dtype):
        self.made.append(FakeTensor(0))
        return self.made[-1]

    def empty_dict(self, spec):
        return {k: self.empty(shape, dtype) for k, (shape, dtype) in spec.items()}

    def publish(self, name, t, replace=False, uid=BRIDGE_UID):
        self.generation += 1
        self.entries[name] = (uid, self.generation)
        return self.generation

    def publish_dict(self, name, ts, replace=False):
        return self.publish(name, None, replace)

    def unpublish(self, name, generation=None):
        if name not in self.entries:
            raise FileNotFoundError(errno.ENOENT, name)
        if generation is not None and self.entries[name][1] != generation:
            raise OSError(errno.ESTALE, name)
        del self.entries[name]

    def list(self, prefix=""):
        class Owner:
            def __init__(self, uid):
                self.uid = uid

        class Info:
            def __init__(self, name, uid, generation):
                self.name, self.owner, self.generation = name, Owner(uid), generation
        return [Info(n, u, g) for n, (u, g) in sorted(self.entries.items())
                if n.startswith(prefix)]

    def close(self):
        pass


def peer_fetch(dl, script, b=None, wait=10, stalled="the fetch did not end", deadline=None):
    """A fetch from a fake peer (within deadline, None: none): script(peer, get) plays the
    exporter on its socket; the fetch's outcome, and the link. The fetch must end within wait
    seconds of the script (AssertionError saying stalled)."""
    b = b or fake_bridge()
    link = _importer.PeerLink(b, "A", ("192.0.2.1", 1))
    link.sock, peer = socket.socketpair()
    link.agent, link.nixl = "exporter-agent", b.agents.hold()
    out = {}

    def run():
        try:
            out["r"] = link.fetch(dl, "w/x", "A:w/x", deadline, 1000)
        except Exception as e:  # the outcome under test
            out["r"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        script(peer, _wire.recv(peer, time.monotonic() + 5))
        th.join(wait)
    finally:
        peer.close()      # lets a fetch that still waits see EOF (the test fails then)
    assert not th.is_alive(), stalled
    return out["r"], link


def stalled_fetch(monkeypatch, layout, b=None, dl=None):
    """A fetch with no timeout from a peer that answers up to layout (None: sends half a
    layout), then sends half a frame and stalls; the fetch's outcome."""
    monkeypatch.setattr(_importer, "LAYOUT_TIMEOUT", 0.3, raising=False)
    monkeypatch.setattr(_importer, "TRANSFER_GRACE", 0.3, raising=False)

    def exporter(peer, get):
        if layout is not None:
            _wire.send(peer, {**layout, "id": get["id"]})
            assert _wire.recv(peer, time.monotonic() + 5)["op"] == "put"
        peer.sendall(struct.pack(">I", 100) + b'{"op":')   # half a frame, then nothing

    return peer_fetch(dl or FakeDlpackd(), exporter, b, wait=20,
                      stalled="the fetch waited on a stalled peer")[0]


class NoDeviceMemory(FakeDlpackd):
    """Host memory as FakeDlpackd's; device memory runs out, as libdlpc says it (MemoryError)."""

    def empty(self, shape, dtype, device=None):
        if device is not None:
            raise MemoryError()
        return super().empty(shape, dtype)

    def empty_dict(self, spec, device=None):
        if device is not None:
            raise MemoryError()
        return super().empty_dict(spec)


DEVICE_LAYOUT = {"op": "layout", "lease": "L1", "generation": 1, "bundle": False, "ttl": 5.0,
                 "device": "cuda:0", "tensors": [["", "uint8", [1 << 20], 1 << 20]]}


def test_a_device_replica_that_does_not_fit_is_refused_and_the_lease_released():
    got = {}

    def exporter(peer, get):
        got["get"] = get
        _wire.send(peer, {**DEVICE_LAYOUT, "id": get["id"]})
        got["next"] = _wire.recv(peer, time.monotonic() + 5)

    dl = NoDeviceMemory()
    r, link = peer_fetch(dl, exporter)
    assert got["get"]["devices"] == ["cuda"]
    assert got["next"] == {"op": "release", "lease": "L1"}
    assert isinstance(r, OSError) and r.errno == errno.ENOMEM
    assert "cuda:0 (--cuda-device)" in str(r) and "MemoryError" in str(r)
    # an answer in good order: the connection stays, and nothing was allocated on the host
    assert link.sock is not None and dl.made == []


def test_the_importer_waits_for_the_layout_while_the_exporter_stages(monkeypatch):
    """After `staging`, the layout may come later than LAYOUT_TIMEOUT, within its bytes'
    transfer deadline; a second `staging` is not taken as the answer."""
    monkeypatch.setattr(_importer, "LAYOUT_TIMEOUT", 0.3, raising=False)
    monkeypatch.setattr(_importer, "TRANSFER_GRACE", 0.3, raising=False)
    got = {}

    def exporter(peer, get):
        _wire.send(peer, {"op": "staging", "id": get["id"], "bytes": 1 << 20})
        time.sleep(0.6)                 # past LAYOUT_TIMEOUT, within 0.6 s + 1 MiB's deadline
        _wire.send(peer, {**DEVICE_LAYOUT, "id": get["id"]})
        got["next"] = _wire.recv(peer, time.monotonic() + 5)

    r, _ = peer_fetch(NoDeviceMemory(), exporter)
    assert got["next"]["op"] == "release" and isinstance(r, OSError) and r.errno == errno.ENOMEM

    def twice(peer, get):
        for _ in range(2):
            _wire.send(peer, {"op": "staging", "id": get["id"], "bytes": 1 << 20})
        time.sleep(2)

    r, _ = peer_fetch(NoDeviceMemory(), twice)
    assert isinstance(r, ConnectionError) and "expected the layout, got 'staging'" in str(r)

    # bytes past any float: taken as the most one uid's replicas may hold, not a crash
    def huge(peer, get):
        _wire.send(peer, {"op": "staging", "id": get["id"], "bytes": 10 ** 400})
        _wire.send(peer, {**DEVICE_LAYOUT, "id": get["id"]})
        got["next"] = _wire.recv(peer, time.monotonic() + 5)

    r, _ = peer_fetch(NoDeviceMemory(), huge)
    assert got["next"]["op"] == "release" and isinstance(r, OSError) and r.errno == errno.ENOMEM

    # not a count: a protocol error
    for n in (True, -1, "1"):
        def odd(peer, get, n=n):
            _wire.send(peer, {"op": "staging", "id": get["id"], "bytes": n})
            time.sleep(1)

        r, link = peer_fetch(NoDeviceMemory(), odd)
        assert isinstance(r, ConnectionError) and r.errno == errno.EPROTO, (n, r)
        assert link.sock is None                # dropped


def test_a_staging_frame_for_a_get_of_host_entries_is_a_protocol_error():
    """An importer that takes no device entries never waits longer for a layout."""
    def exporter(peer, get):
        assert "devices" not in get
        _wire.send(peer, {"op": "staging", "id": get["id"], "bytes": 1 << 20})
        time.sleep(1)

    b = fake_bridge()
    b._cuda_why = "--cuda-device none"
    r, _ = peer_fetch(FakeDlpackd(), exporter, b)
    assert isinstance(r, ConnectionError) and "for a get of host entries" in str(r)


def test_fetch_without_timeout_bounded_waiting_for_the_layout(monkeypatch):
    r = stalled_fetch(monkeypatch, None)
    assert isinstance(r, TimeoutError) and "LAYOUT_TIMEOUT" in str(r)


def test_fetch_without_timeout_bounded_by_the_lease_ttl_during_the_transfer(monkeypatch):
    layout = {"op": "layout", "lease": "L1", "generation": 1, "bundle": False, "ttl": 0.2,
              "tensors": [["", "float32", [0], 0]]}
    r = stalled_fetch(monkeypatch, layout)
    assert isinstance(r, TimeoutError) and "TRANSFER_GRACE" in str(r)


@pytest.mark.skipif(not shutil.which("ip"), reason="no `ip` (Debian: iproute2)")
def test_ucx_net_devices_follow_the_bridges_addresses():
    main = importlib.import_module("dlpack_ipc.bridge.__main__")
    assert main.net_devices("127.0.0.1:7455", None) == "lo"             # --listen's interface
    assert main.net_devices("0.0.0.0:7455", ["A=127.0.0.1:7455"]) == "lo"   # the peer's route
    with pytest.raises(ValueError, match="wildcard"):
        main.net_devices("0.0.0.0:7455", None)


def test_gets_and_fetches_refused_past_quarantine_max():
    b = fake_bridge()
    for i in range(_nixl.QUARANTINE_MAX):
        b.quarantine.add(b.fake_nixl, f"test {i}")
    c, s = tcp_pair()
    b._get(s, None, {"op": "get", "id": 7, "name": "w/x"}, {}, "peer")
    reply = _wire.recv(c, time.monotonic() + 5)
    assert reply["errno"] == "EAGAIN" and "QUARANTINE_MAX" in reply["message"]
    assert reply["id"] == 7 and b.leases == 0
    link = _importer.PeerLink(b, "A", ("192.0.2.1", 1))
    with pytest.raises(BlockingIOError, match="QUARANTINE_MAX"):
        link.fetch(FakeDlpackd(), "w/x", "A:w/x", None, 1000)
    c.close()
    s.close()


# An empty entry's layout: a fetch of it needs no NIXL (serve_empty()).
EMPTY_LAYOUT = {"op": "layout", "lease": "L1", "generation": 7, "bundle": False, "ttl": 5.0,
                "tensors": [["", "float32", [0], 0]]}
# What an exporter at a limit that frees soon answers a get with (Bridge._lease_take's words).
AT_A_LIMIT = ("'w/x': its 4096 bytes would take what this bridge holds under lease from "
              "1024 bytes past LEASE_BYTES_MAX (2048): try again later")


def serve_empty(peer, get):
    """Answer get with EMPTY_LAYOUT, take the put and say done."""
    _wire.send(peer, {**EMPTY_LAYOUT, "id": get["id"]})
    put = _wire.recv(peer, time.monotonic() + 5)
    assert put["op"] == "put" and put["descs"] == [], put
    _wire.send(peer, {"op": "done", "id": put["id"], "lease": "L1"})


@pytest.fixture
def quick_backoff(monkeypatch):
    monkeypatch.setattr(_importer, "REFUSED_BACKOFF_FIRST", 0.01)
    monkeypatch.setattr(_importer, "REFUSED_BACKOFF_MAX", 0.02)


def test_a_get_refused_until_a_limit_frees_is_tried_again(quick_backoff):
    """A get the peer refuses with an EAGAIN that says to try again is asked again on the same
    connection: the fetch gets the entry once the limit freed."""
    gets = []

    def exporter(peer, get):
        for i in range(2):
            gets.append(get)
            _wire.send(peer, _wire.error_frame("EAGAIN", AT_A_LIMIT, id=get["id"]))
            get = _wire.recv(peer, time.monotonic() + 5)
        gets.append(get)
        serve_empty(peer, get)

    dl = FakeDlpackd()
    r, link = peer_fetch(dl, exporter)
    assert r == 7, r
    assert [g["op"] for g in gets] == ["get"] * 3 and len({g["id"] for g in gets}) == 3
    assert "A:w/x" in dl.entries and link.sock is not None


def test_refusals_that_say_try_again_are_tried_refused_tries_times(quick_backoff):
    """Past REFUSED_TRIES refusals the fetch fails with the last one's message; no more gets."""
    def exporter(peer, get):
        for i in range(1, _importer.REFUSED_TRIES + 1):
            assert get["op"] == "get"
            _wire.send(peer, _wire.error_frame("EAGAIN", f"refusal {i}: {AT_A_LIMIT}",
                                               id=get["id"]))
            if i < _importer.REFUSED_TRIES:
                get = _wire.recv(peer, time.monotonic() + 5)

    r, link = peer_fetch(FakeDlpackd(), exporter, stalled="the fetch asked past REFUSED_TRIES")
    assert isinstance(r, BlockingIOError), r
    assert str(r) == (f"[Errno {errno.EAGAIN}] the peer says: refusal "
                      f"{_importer.REFUSED_TRIES}: {AT_A_LIMIT}")
    assert link.sock is not None                # (the connection stays: answered in order)


def test_a_refusal_is_not_tried_again_past_the_fetchs_deadline(monkeypatch):
    """A pause before the next try that would end past the fetch's deadline is not taken: the
    refusal fails the fetch at once (a fetch that waited would be failed by peer_fetch)."""
    monkeypatch.setattr(_importer, "REFUSED_BACKOFF_FIRST", 3600.0)
    monkeypatch.setattr(_importer, "REFUSED_BACKOFF_MAX", 3600.0)

    def exporter(peer, get):
        _wire.send(peer, _wire.error_frame("EAGAIN", AT_A_LIMIT, id=get["id"]))

    r, link = peer_fetch(FakeDlpackd(), exporter, deadline=time.monotonic() + 60,
                         stalled="the fetch waited past its deadline to try again")
    assert isinstance(r, BlockingIOError) and str(r).endswith(AT_A_LIMIT), r


@pytest.mark.parametrize("errname,message", [
    ("EDQUOT", "uid 1000 asks for 100 bytes and holds 200: REPLICA_BYTES_PER_UID_MAX is 260"),
    ("EPERM", "'w/x' is not yours"), ("ENOENT", "'w/x': no such name"),
    ("EAGAIN", "'w/x': this connection holds 64 leases (LEASES_MAX)"),
    ("EFBIG", "'w/x' is a device entry of 9 bytes, more than the 8 bytes of host memory it is "
              "staged through (--staging-max): try again")])
def test_refusals_that_will_not_change_are_not_tried_again(quick_backoff, errname, message):
    """(A fetch that asked again would wait for the answer until peer_fetch fails it.)"""
    def exporter(peer, get):
        _wire.send(peer, _wire.error_frame(errname, message, id=get["id"]))

    r, _ = peer_fetch(FakeDlpackd(), exporter, stalled="the fetch asked again")
    assert isinstance(r, OSError) and r.errno == getattr(errno, errname), r
    assert str(r).endswith(message)


def _exporter_refusing(refusals, token, got, serve=True):
    """A listening exporter that refuses one connection for each of refusals ("admit": in
    auth_server's admission, as a stranger's eviction does; "peers": welcomed, then PEERS_MAX;
    "token": another token), then (serve) serves one get of the empty entry, and stops
    listening; (its port, its thread). got["connections"] counts the connections it
    accepted."""
    ls = socket.create_server(("127.0.0.1", 0))
    got["connections"] = 0

    def run():
        with ls:
            for refusal in list(refusals) + ([None] if serve else []):
                ls.settimeout(10)
                try:
                    s, _ = ls.accept()
                except socket.timeout:
                    return
                got["connections"] += 1
                with s:
                    if refusal == "token":
                        with pytest.raises(PermissionError):
                            _wire.auth_server(s, b"u" * 32, 5)
                        continue
                    if refusal == "admit":
                        with pytest.raises(BlockingIOError):
                            _wire.auth_server(s, token, 5, admit=lambda: (
                                "dropped before it authenticated: 4 other connections from "
                                "127.0.0.1 came (UNAUTH_PER_ADDR_MAX 4)"))
                        continue
                    _wire.auth_server(s, token, 5)
                    if refusal == "peers":
                        _wire.send_error(s, "EAGAIN", "64 peers are connected (PEERS_MAX): "
                                         "try again later")
                        continue
                    _wire.send(s, {"op": "metadata", "metadata": md64("exporter-x")})
                    assert _wire.recv(s, time.monotonic() + 5)["op"] == "metadata"
                    serve_empty(s, _wire.recv(s, time.monotonic() + 5))
                    got["served"] = True
                    _wire.readable(s, 5)        # until the importer closes
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return ls.getsockname()[1], th


@pytest.mark.parametrize("refusals", [["admit"], ["peers"], ["admit", "peers", "admit"]])
def test_a_connection_refused_until_a_limit_frees_is_made_again(quick_backoff, refusals):
    """An exporter that turns the connection away with EAGAIN, saying to try again (a stranger
    flood evicted it before its welcome, or PEERS_MAX just after), is connected to again within
    the fetch: the fetch gets the entry."""
    b = fake_bridge()
    got = {}
    port, th = _exporter_refusing(refusals, b.token, got)
    link = _importer.PeerLink(b, "A", ("127.0.0.1", port))
    try:
        assert link.fetch(FakeDlpackd(), "w/x", "A:w/x", time.monotonic() + 60, 1000) == 7
    finally:
        link.drop()
        th.join(10)
    assert got == {"connections": len(refusals) + 1, "served": True}
    assert not th.is_alive() and b.agents.now.remotes == set()


def test_a_wrong_token_is_not_tried_again(quick_backoff):
    b = fake_bridge()
    got = {}
    port, th = _exporter_refusing(["token"], b.token, got, serve=False)
    link = _importer.PeerLink(b, "A", ("127.0.0.1", port))
    try:
        # (a second connection would be refused: ConnectionRefusedError)
        with pytest.raises(PermissionError, match="authentication failed"):
            link.fetch(FakeDlpackd(), "w/x", "A:w/x", time.monotonic() + 60, 1000)
    finally:
        link.drop()
        th.join(10)
    assert got == {"connections": 1} and not th.is_alive()


def test_a_put_never_posted_is_not_quarantined():
    b, _, tensors, reply = one_put(FakeNixl(("write",)))
    assert reply["op"] == "error" and reply["errno"] == "EIO"
    assert len(b.quarantine) == 0 and b.leases == 0 and tensors[0].released == 1
    assert b.fake_nixl.registered == 0 and b.counts["aborted"] == 1


def test_a_put_in_flight_when_it_fails_is_quarantined():
    nixl = FakeNixl()
    nixl.write_state = "ERR"
    b, _, tensors, raised = one_put(nixl)
    assert isinstance(raised, ConnectionError)
    assert len(b.quarantine) == 1 and b.leases == 0 and tensors[0].released == 0
    b.quarantine.sweep(all_=True)
    assert tensors[0].released == 1 and b.fake_nixl.registered == 0


@pytest.mark.parametrize("blob", [nixl_md("someone-else", PARTIAL),
                                  nixl_md("someone-else", b"sections that do not load"),
                                  b"someone-else", nixl_md("importer-agent")[:20],
                                  nixl_md("importer-agent").replace(b"t|", b"tX", 1)])
def test_a_put_with_another_agents_metadata_is_refused_unloaded(blob):
    """Metadata that names an agent other than the peer's, or does not name one as NIXL lays
    it out (a name not ended by '|' NIXL would read all the same), never reaches NIXL: loaded,
    it would be merged into that agent's entry (another peer's), or erase it."""
    b = fake_bridge()
    b.fake_nixl.remotes.update({"importer-agent", "someone-else"})
    tensors = [FakeTensor(100)]
    leases, lease = lease_of(b, tensors)
    frame = {**put_frame(lease, tensors), "metadata": base64.b64encode(blob).decode()}
    c, s = tcp_pair()
    with pytest.raises(_wire.FrameError) as e:
        b._put(s, frame, leases, b.fake_nixl, "importer-agent", "peer")
    c.close()
    s.close()
    assert e.value.errname == "EPROTO" and f"put for lease {lease.id}: " in str(e.value)
    assert ("not of the peer's 'importer-agent': refused, not loaded" in str(e.value) or
            "not NIXL agent metadata" in str(e.value)), e.value
    assert not [call for call in b.fake_nixl.calls if call[0] in ("add_remote", "write")]
    assert b.fake_nixl.remotes == {"importer-agent", "someone-else"}
    assert leases == {} and b.leases == 0 and tensors[0].released == 1


def test_the_peers_own_metadata_is_loaded_for_its_put():
    b, leases, tensors, reply = one_put(FakeNixl())
    assert reply["op"] == "done"
    assert ("add_remote", nixl_md("importer-agent", PARTIAL)) in b.fake_nixl.calls


def test_a_nixl_whose_metadata_does_not_name_its_agent_so_is_refused():
    """The layout the bridge reads a peer's agent name in is checked against each agent it
    makes: a NIXL that lays its metadata out otherwise is refused, not misread."""
    class Other(FakeNixl):
        def metadata(self):
            return b"nixlSerDes2|" + nixl_md(self.name)

    with pytest.raises(RuntimeError, match="its own metadata does not name it as NIXL 1.5"):
        _nixl.Agents(lambda name: Other(name=name), "exporter-agent")
    agents = _nixl.Agents(lambda name: (FakeNixl if name == "first" else Other)(name=name),
                          "first")
    agents.aborted(agents.now)
    agents.tick("second")                  # not replaced by an agent it cannot read peers of
    assert agents.now.name == "first" and agents.replaced == 0


def test_unmatched_notifications_bounded_oldest_dropped():
    class Agent:
        def __init__(self):
            self.batches = []

        def get_new_notifs(self):
            return self.batches.pop(0) if self.batches else {}

    n = _nixl.Nixl.__new__(_nixl.Nixl)
    n.agent = Agent()
    n._lock = threading.Lock()
    n._notifs = {}
    n.agent.batches.append({"peer": [b"%d" % i for i in range(_nixl.NOTIFS_MAX + 10)]})
    assert not n.notified("peer", b"wanted")
    assert len(n._notifs) == _nixl.NOTIFS_MAX
    assert ("peer", b"0") not in n._notifs and ("peer", b"9") not in n._notifs
    assert n.notified("peer", b"%d" % (_nixl.NOTIFS_MAX + 9))      # the newest kept


class SlowNixl(FakeNixl):
    """A WRITE that stays in progress for `seconds` after it is posted (forever: None)."""

    def __init__(self, seconds, fail=()):
        super().__init__(fail)
        self.seconds = seconds
        self.write_state = "PROC"

    def write(self, local, remote, agent, notif):
        self.posted = time.monotonic()
        return super().write(local, remote, agent, notif)

    def state(self, h):
        if self.seconds is None or time.monotonic() < self.posted + self.seconds:
            return "PROC"
        return "DONE"


def test_a_transfer_longer_than_the_lease_ttl_within_its_own_deadline_completes(monkeypatch):
    # 100 bytes at 100 bytes/s: a deadline of 1 s + grace, far past the lease TTL of 0.02 s
    monkeypatch.setattr(_importer, "TRANSFER_GRACE", 0.5)
    monkeypatch.setattr(_importer, "TRANSFER_MIN_RATE", 100)
    nixl = SlowNixl(0.1)
    b = fake_bridge(nixl)
    b.ttl = 0.02
    tensors = [FakeTensor(100)]
    leases, lease = lease_of(b, tensors)
    c, s = tcp_pair()
    try:
        b._put(s, put_frame(lease, tensors), leases, b.fake_nixl, "importer-agent", "peer")
        reply = _wire.recv(c, time.monotonic() + 5)
    finally:
        c.close()
        s.close()
    assert reply["op"] == "done" and b.counts["served"] == 1
    assert len(b.quarantine) == 0 and tensors[0].released == 1 and nixl.registered == 0


def test_a_transfer_past_its_own_deadline_fails(monkeypatch):
    monkeypatch.setattr(_importer, "TRANSFER_GRACE", 0.05)
    monkeypatch.setattr(_importer, "TRANSFER_MIN_RATE", 1 << 30)
    b, _, tensors, raised = one_put(SlowNixl(None))
    assert isinstance(raised, TimeoutError) and "TRANSFER_MIN_RATE" in str(raised)
    assert len(b.quarantine) == 1 and b.leases == 0


def test_the_transfer_deadline_grows_with_its_size():
    assert _importer.transfer_deadline(0) == _importer.TRANSFER_GRACE
    big = 100 << 30
    assert _importer.transfer_deadline(big) == \
        _importer.TRANSFER_GRACE + big / _importer.TRANSFER_MIN_RATE > _server.LEASE_TTL


def test_an_aborted_transfer_in_progress_stays_in_quarantine_until_done(monkeypatch):
    monkeypatch.setattr(_importer, "TRANSFER_GRACE", 0.05)
    b, _, tensors, raised = one_put(SlowNixl(None))
    assert isinstance(raised, TimeoutError) and len(b.quarantine) == 1
    b.quarantine.sweep(all_=True)        # its time has come; NIXL says it is in progress
    b.quarantine.sweep(all_=True)
    assert len(b.quarantine) == 1 and tensors[0].released == 0 and b.fake_nixl.registered == 1
    assert not any(c[0] in ("release", "deregister") for c in b.fake_nixl.calls)
    b.fake_nixl.seconds = 0                    # now done
    b.quarantine.sweep(all_=True)
    assert len(b.quarantine) == 0 and tensors[0].released == 1 and b.fake_nixl.registered == 0
    assert [c[0] for c in b.fake_nixl.calls][-2:] == ["release", "deregister"]


def test_a_handle_nixl_does_not_release_stays_in_quarantine():
    nixl = FakeNixl(("release",))
    nixl.write_state = "ERR"
    b, _, tensors, raised = one_put(nixl)
    assert isinstance(raised, ConnectionError) and len(b.quarantine) == 1
    b.quarantine.sweep(all_=True)
    assert len(b.quarantine) == 1 and tensors[0].released == 0 and nixl.registered == 1
    assert not any(c[0] == "deregister" for c in nixl.calls)
    nixl.fail.clear()
    b.quarantine.sweep(all_=True)
    assert len(b.quarantine) == 0 and tensors[0].released == 1 and nixl.registered == 0


class ReplicaDlpackd(FakeDlpackd):
    def empty(self, shape, dtype):
        self.made.append(FakeTensor(100))
        return self.made[-1]


@pytest.mark.parametrize("fence", [True, False])
def test_an_aborted_replica_is_freed_only_once_the_exporter_is_fenced_off(monkeypatch, fence):
    layout = {"op": "layout", "lease": "L1", "generation": 1, "bundle": False, "ttl": 0.2,
              "tensors": [["", "float32", [25], 100]]}
    nixl = FakeNixl(() if fence else ("remove_remote",))
    b, dl = fake_bridge(nixl), ReplicaDlpackd()
    r = stalled_fetch(monkeypatch, layout, b, dl)
    assert isinstance(r, TimeoutError)
    assert ("remove_remote", "exporter-agent") in nixl.calls
    assert len(b.quarantine) == 1 and nixl.registered == 1
    b.quarantine.sweep(all_=True)
    if fence:
        assert len(b.quarantine) == 0 and nixl.registered == 0 and dl.made[0].released == 1
    else:                                 # the exporter could still write: kept, counted
        assert len(b.quarantine) == 1 and nixl.registered == 1 and dl.made[0].released == 0
        # until the end of this bridge's agent cuts it off: once replaced, and held by such
        # entries alone, the agent is destroyed, then the memory given back
        b.agents.tick("agent-2")
        assert not nixl.closed and len(b.quarantine) == 1
        b.quarantine.sweep()
        assert nixl.closed and len(b.quarantine) == 0 and dl.made[0].released == 1
        assert b.agents.alive() == [b.agents.now]


# -- an agent with an aborted transfer is replaced (_nixl.Agents) ----------------------------


def test_an_agent_whose_write_aborted_is_replaced_and_destroyed_once_nothing_uses_it():
    nixl = FakeNixl()
    nixl.write_state = "ERR"            # posted, then failed: it goes to quarantine
    b, _, tensors, raised = one_put(nixl)
    assert isinstance(raised, ConnectionError) and len(b.quarantine) == 1
    b.agents.tick("agent-2")
    new = b.agents.now
    assert new is not nixl and new.name == "agent-2" and b.agents.replaced == 1
    assert b.agents.retired(nixl) and not b.agents.retired(new)
    assert b.agents.alive() == [new, nixl] and not nixl.closed     # the quarantine holds it
    b.agents.tick("agent-3")            # nothing of the new one aborted: kept
    assert b.agents.now is new and b.agents.alive() == [new, nixl]
    b.quarantine.sweep(all_=True)       # released by the agent it belongs to
    assert len(b.quarantine) == 0 and nixl.registered == 0 and tensors[0].released == 1
    assert not new.calls
    b.agents.tick("agent-3")
    assert b.agents.alive() == [new] and nixl.closed and not new.closed


def test_a_write_done_or_never_posted_keeps_the_agent():
    for fail in ((), ("write",)):
        b, _, _, _ = one_put(FakeNixl(fail))
        b.agents.tick("agent-2")
        assert b.agents.now is b.fake_nixl and b.agents.replaced == 0


class LeaseDl:
    """A dlpackd that holds one 100-byte host tensor under any name."""

    def attach_dict(self, name, **kw):
        t = FakeTensor(100)
        t.generation, t.device, t.dtype, t.shape = 1, "cpu", "float32", (25,)
        return {"": t}

    def list(self, prefix):
        return []

    def close(self):
        pass


def _peer_connection(b, importer="importer"):
    """The exporter's thread for a peer connected over loopback TCP, past the handshake
    (importer: the peer's agent); (its socket, the thread)."""
    b.dlpackd = lambda reconnect=False: LeaseDl()
    c, s = tcp_pair()
    th = threading.Thread(target=b._run, args=(b._peer_thread, s, ("192.0.2.1", 1)),
                          daemon=True)
    th.start()
    _wire.auth_client(c, b.token, importer, "A")
    f = _wire.recv(c, time.monotonic() + 5)
    assert f["op"] == "metadata" and f["agent"] == b.agents.now.name
    _wire.send(c, {"op": "metadata", "metadata": md64(importer)})
    return c, th


def test_a_peer_connection_made_with_a_replaced_agent_is_closed_once_idle():
    b = fake_bridge()
    old = b.fake_nixl
    c, th = _peer_connection(b)
    try:
        c.settimeout(5)
        _wire.send(c, {"op": "stat", "id": 1, "name": "elsewhere"})   # it serves requests
        assert _wire.recv(c, time.monotonic() + 5)["errno"] == "ENOENT"
        th.join(3 * _server.TICK)
        assert th.is_alive() and b.agents.alive() == [old]
        b.agents.aborted(old)
        b.agents.tick("agent-2")
        th.join(5)
        assert not th.is_alive(), "the idle connection of a replaced agent stays open"
        assert c.recv(1) == b""              # closed: the peer connects again
        assert ("remove_remote", "importer") in old.calls
        b.agents.tick("agent-3")
        assert b.agents.alive() == [b.agents.now] and old.closed
        # a new connection gets the new agent's metadata
        c2, th2 = _peer_connection(b, "importer-2")
        c2.close()
        th2.join(5)
        assert ("add_remote", nixl_md("importer-2")) in b.agents.now.calls
    finally:
        c.close()
        stop_fake_bridge(b)


def test_a_peer_connection_holding_a_lease_is_closed_only_once_the_lease_ends():
    b = fake_bridge()
    old = b.fake_nixl
    c, th = _peer_connection(b)
    try:
        c.settimeout(5)
        _wire.send(c, {"op": "get", "id": 1, "name": "w/x"})
        layout = _wire.recv(c, time.monotonic() + 5)
        assert layout["op"] == "layout" and b.leases == 1
        b.agents.aborted(old)
        b.agents.tick("agent-2")
        th.join(4 * _server.TICK)
        assert th.is_alive(), "a connection holding a lease was closed"
        _wire.send(c, {"op": "release", "lease": layout["lease"]})
        th.join(5)
        assert not th.is_alive() and c.recv(1) == b"" and b.leases == 0
        b.agents.tick("agent-3")
        assert old.closed and b.agents.alive() == [b.agents.now]
    finally:
        c.close()
        stop_fake_bridge(b)


@pytest.mark.parametrize("errname, replaced", [("ESTALE", 0), ("EPROTO", 0), ("EIO", 1)])
def test_an_importer_replaces_its_agent_only_after_a_write_that_may_have_started(
        errname, replaced):
    """An exporter's error other than EIO ("WRITE failed") comes before any WRITE: nothing
    can linger in UCX, and the agent stays; nor is there anything to fence off, so the replica's
    memory goes after its quarantine even though the exporter's agent could not be removed.
    After an EIO it waits for the end of this bridge's replaced agent."""
    layout = {"op": "layout", "lease": "L1", "generation": 1, "bundle": False, "ttl": 5.0,
              "tensors": [["", "float32", [25], 100]]}

    def exporter(peer, get):
        _wire.send(peer, {**layout, "id": get["id"]})
        put = _wire.recv(peer, time.monotonic() + 5)
        assert put["op"] == "put"
        _wire.send(peer, _wire.error_frame(errname, "said by the test", id=put["id"]))
    b, dl = fake_bridge(FakeNixl(("remove_remote",))), ReplicaDlpackd()
    r, _ = peer_fetch(dl, exporter, b)
    assert isinstance(r, OSError) and "said by the test" in str(r)
    b.agents.tick("agent-2")
    assert b.agents.replaced == replaced
    b.quarantine.sweep(all_=True)
    assert len(b.quarantine) == 0 and dl.made[0].released == 1
    # posted: released by the end of the replaced agent, which it alone held; else as fenced
    assert b.fake_nixl.closed == bool(replaced)


def test_a_busy_link_made_with_a_replaced_agent_connects_anew_at_its_next_use(monkeypatch):
    """A link that fetches one entry after another is never idle at the housekeeping's tick:
    its next use closes the connection of the replaced agent and connects with the new one."""
    b = fake_bridge()
    old = b.fake_nixl
    ex = FakeExporter(b, {"w/x": 100})
    connects = []

    def connect(deadline):          # a new connection to the same fake exporter
        connects.append(deadline)
        ex.link.sock, ex.peer = socket.socketpair()
        ex.link.agent, ex.link.nixl = "exporter-agent", b.agents.hold()
        threading.Thread(target=ex._serve, daemon=True).start()
    monkeypatch.setattr(ex.link, "_connect", connect)
    try:
        assert ex.fetch(FakeDlpackd(), "w/x", 1000) == 7 and not connects
        with ex.link.lock:          # the tick finds it in use
            b.agents.aborted(old)
            b.agents.tick("agent-2")
            ex.link.close_if_retired()
        assert ex.link.nixl is old
        assert ex.fetch(FakeDlpackd(), "w/x", 1000) == 7
        assert len(connects) == 1 and ex.link.nixl is b.agents.now is not old
        assert ("remove_remote", "exporter-agent") in old.calls
        b.agents.tick("agent-3")
        assert old.closed
    finally:
        ex.close()


def test_an_importers_link_made_with_a_replaced_agent_is_closed_once_idle():
    b = fake_bridge()
    old = b.fake_nixl
    link = _importer.PeerLink(b, "A", ("192.0.2.1", 1))
    link.sock, peer = socket.socketpair()
    link.agent, link.nixl = "exporter-agent", b.agents.hold()
    lost = []

    class Follow:
        def lost(self):
            lost.append(1)
    link.follows = {"w/f": [Follow()]}
    try:
        link.close_if_retired()
        assert link.connected()              # its agent is the one in use
        b.agents.aborted(old)
        b.agents.tick("agent-2")
        with link.lock:                      # a fetch under way: left alone
            link.close_if_retired()
            assert link.connected()
        link.close_if_retired()
        assert not link.connected() and link.nixl is None and lost == [1]
        assert peer.recv(1) == b"" and ("remove_remote", "exporter-agent") in old.calls
        b.agents.tick("agent-3")
        assert b.agents.alive() == [b.agents.now] and old.closed
    finally:
        peer.close()


def test_an_aborted_fetch_replaces_the_agent_which_lives_while_its_replica_is_quarantined(
        monkeypatch):
    layout = {"op": "layout", "lease": "L1", "generation": 1, "bundle": False, "ttl": 0.2,
              "tensors": [["", "float32", [25], 100]]}
    b, dl = fake_bridge(), ReplicaDlpackd()
    old = b.fake_nixl
    assert isinstance(stalled_fetch(monkeypatch, layout, b, dl), TimeoutError)
    assert len(b.quarantine) == 1
    b.agents.tick("agent-2")
    assert b.agents.now is not old and b.agents.alive() == [b.agents.now, old]
    b.agents.tick("agent-3")
    assert not old.closed                   # the replica in quarantine holds it
    b.quarantine.sweep(all_=True)
    assert old.registered == 0 and dl.made[0].released == 1
    b.agents.tick("agent-3")
    assert old.closed and b.agents.alive() == [b.agents.now]


def test_retired_max_agents_still_used_stop_replacement_until_one_goes(caplog):
    b = fake_bridge()
    held = []
    for i in range(_nixl.RETIRED_MAX):
        held.append(b.agents.hold())
        b.agents.aborted(held[-1])
        b.agents.tick(f"agent-{i}")
    assert b.agents.replaced == _nixl.RETIRED_MAX
    assert len(b.agents.alive()) == _nixl.RETIRED_MAX + 1
    now = b.agents.now
    b.agents.aborted(now)
    with caplog.at_level("WARNING", logger="dlpackd-bridge"):
        b.agents.tick("one-more")
        b.agents.tick("one-more")
    assert b.agents.now is now and b.agents.replaced == _nixl.RETIRED_MAX
    assert sum("RETIRED_MAX" in r.getMessage() for r in caplog.records) == 1   # logged once
    b.agents.let_go(held[0])
    b.agents.tick("one-more")
    assert held[0].closed and b.agents.now.name == "one-more"
    assert len(b.agents.alive()) == _nixl.RETIRED_MAX + 1
    assert not any(a.closed for a in held[1:]) and not now.closed


def test_an_agent_that_cannot_be_made_yet_is_tried_again_every_agent_retry(
        caplog, monkeypatch):
    made, tries = [], []

    def make(name):
        tries.append(name)
        if made and len(tries) < 4:     # as UCX while the link that broke a transfer is down
            raise RuntimeError("UCX: no usable transports/devices")
        made.append(FakeNixl(name=name))
        return made[-1]
    monkeypatch.setattr(_nixl, "AGENT_RETRY", 0.5)
    agents = _nixl.Agents(make, "first")
    agents.aborted(agents.now)
    with caplog.at_level("WARNING", logger="dlpackd-bridge"):
        agents.tick("second")
        assert agents.now is made[0] and agents.replaced == 0 and not made[0].closed
        agents.tick("third")                # within AGENT_RETRY: not tried
        assert tries == ["first", "second"]
        time.sleep(0.6)
        agents.tick("third")
        time.sleep(0.6)
        agents.tick("fourth")
    assert tries == ["first", "second", "third", "fourth"]
    assert agents.now.name == "fourth" and agents.replaced == 1
    assert [r.getMessage() for r in caplog.records
            if "no new agent" in r.getMessage()] == [
        "NIXL agent first had an aborted transfer, and no new agent could be made: UCX: no "
        "usable transports/devices; trying again every 0.5 s (AGENT_RETRY), said once"]


def test_an_import_longer_than_the_lease_ttl_within_its_own_deadline_completes(monkeypatch):
    # the importer's deadline comes from the layout's bytes: 100 at 100 bytes/s, not the TTL
    monkeypatch.setattr(_importer, "TRANSFER_GRACE", 0.05)
    monkeypatch.setattr(_importer, "TRANSFER_MIN_RATE", 100)

    class Notified(FakeNixl):
        def notified(self, agent, msg):
            return True
    b = fake_bridge(Notified())

    def exporter(peer, get):
        _wire.send(peer, {"op": "layout", "id": get["id"], "lease": "L1", "generation": 1,
                          "bundle": False, "ttl": 0.01, "tensors": [["", "float32", [25], 100]]})
        put = _wire.recv(peer, time.monotonic() + 5)
        assert put["op"] == "put"
        time.sleep(0.3)                   # longer than TTL + TRANSFER_GRACE
        _wire.send(peer, {"op": "done", "id": put["id"], "lease": "L1"})

    r, _ = peer_fetch(ReplicaDlpackd(), exporter, b)
    assert r == 1 and len(b.quarantine) == 0 and b.fake_nixl.registered == 0


# -- local callers charged per uid (_replicas) ----------------------------------------------

class FakeExporter:
    """The peer's side of a PeerLink: answers each get with the layout of sizes[name] (bytes
    of float32, or a list of tensors as sent), each put with done; records the releases."""

    def __init__(self, b, sizes):
        self.link = _importer.PeerLink(b, "A", ("192.0.2.1", 1))
        self.link.sock, self.peer = socket.socketpair()
        self.link.agent, self.link.nixl = "exporter-agent", b.agents.hold()
        self.sizes = sizes
        self.released = []
        self.th = threading.Thread(target=self._serve, daemon=True)
        self.th.start()

    def _serve(self):
        n = 0
        while True:
            try:
                f = _wire.recv(self.peer, None)
            except (OSError, _wire.FrameError):
                return
            if f["op"] == "get":
                n += 1
                size = self.sizes[f["name"]]
                tensors = size if isinstance(size, list) else \
                    [["", "float32", [size // 4], size]]
                _wire.send(self.peer, {"op": "layout", "id": f["id"], "lease": f"L{n}",
                                       "generation": 7, "bundle": False, "ttl": 5,
                                       "tensors": tensors})
            elif f["op"] == "put":
                _wire.send(self.peer, {"op": "done", "id": f["id"], "lease": f["lease"]})
            elif f["op"] == "release":
                self.released.append(f["lease"])

    def fetch(self, dl, name, uid):
        return self.link.fetch(dl, name, "A:" + name, time.monotonic() + 5, uid)

    def wait_released(self, n):
        t = time.monotonic() + 5
        while len(self.released) < n and time.monotonic() < t:
            time.sleep(0.01)
        return len(self.released)

    def close(self):
        self.peer.close()
        if self.link.sock is not None:
            self.link.sock.close()
        self.th.join(5)


@pytest.fixture
def peer_a():
    made = []

    def make(sizes, replicas_max=_replicas.REPLICAS_PER_UID_MAX,
             bytes_max=_replicas.REPLICA_BYTES_PER_UID_MAX):
        b = fake_bridge()
        b.replicas = _replicas.Ledger(BRIDGE_UID, replicas_max, bytes_max)
        made.append(FakeExporter(b, sizes))
        return b, made[-1], FakeDlpackd()
    yield make
    for e in made:
        e.close()


def test_layout_bytes_come_from_the_shapes():
    assert _replicas.layout_bytes([["a", "float32", [2, 3], 24], ["b", "bfloat16", [], 2],
                                   ["c", "bool", [0, 5], 0]]) == 26
    with pytest.raises(ValueError, match="4 bytes announced"):
        _replicas.layout_bytes([["", "float32", [1 << 40], 4]])
    with pytest.raises(ValueError, match="not one the bridge sizes"):
        _replicas.layout_bytes([["", "float31", [1], 4]])
    with pytest.raises(ValueError, match="sizes >= 0"):
        _replicas.layout_bytes([["", "float32", [-1], -4]])
    with pytest.raises(ValueError, match="not a list"):
        _replicas.layout_bytes({"": 1})


def test_replicas_per_uid_max_and_another_uid_keeps_working(peer_a):
    b, ex, dl = peer_a({"w/a": 100, "w/b": 100, "w/c": 100}, replicas_max=2)
    assert ex.fetch(dl, "w/a", 1000) == 7 and ex.fetch(dl, "w/b", 1000) == 7
    made = len(dl.made)
    with pytest.raises(OSError, match="uid 1000 holds 2 replicas: REPLICAS_PER_UID_MAX is 2") \
            as e:
        ex.fetch(dl, "w/c", 1000)
    assert e.value.errno == errno.EDQUOT
    assert len(dl.made) == made and "A:w/c" not in dl.entries     # nothing allocated
    assert ex.wait_released(1) == 1                                # the lease given back
    assert ex.link.connected()                                     # the connection stays
    assert ex.fetch(dl, "w/c", 1001) == 7                          # another uid: served
    assert ex.fetch(dl, "w/a", 1000) == 7                          # its own refetch: served
    assert b.replicas.held(1000) == (2, 200) and b.replicas.held(1001) == (1, 100)
    assert b.replicas.summary() == {"1000": [2, 200], "1001": [1, 100]}


def test_replica_bytes_per_uid_max_refused_before_allocating(peer_a):
    b, ex, dl = peer_a({"w/a": 100, "w/b": 100, "w/c": 100}, bytes_max=260)
    ex.fetch(dl, "w/a", 1000)
    ex.fetch(dl, "w/b", 1000)
    made = len(dl.made)
    with pytest.raises(OSError, match="uid 1000 asks for 100 bytes and holds 200: "
                       "REPLICA_BYTES_PER_UID_MAX is 260") as e:
        ex.fetch(dl, "w/c", 1000)
    assert e.value.errno == errno.EDQUOT and len(dl.made) == made
    assert ex.fetch(dl, "w/c", 1001) == 7                          # another uid: served
    ex.sizes["w/a"] = 160                     # its own refetch: counted in place of the old
    ex.fetch(dl, "w/a", 1000)
    assert b.replicas.held(1000) == (2, 260)


def test_a_huge_layout_is_refused_before_anything_is_allocated(peer_a):
    huge = 1 << 62
    b, ex, dl = peer_a({"w/huge": [["", "float32", [huge // 4], huge]],
                        "w/lies": [["", "float32", [huge // 4], 4]]})
    with pytest.raises(OSError, match=f"asks for {huge} bytes and holds 0: "
                       "REPLICA_BYTES_PER_UID_MAX") as e:
        ex.fetch(dl, "w/huge", 1000)
    assert e.value.errno == errno.EDQUOT
    with pytest.raises(ValueError, match="4 bytes announced"):     # EPROTO for the caller
        ex.fetch(dl, "w/lies", 1000)
    assert dl.made == [] and b.replicas.held(1000) == (0, 0)


def test_an_unpublished_replica_stops_counting_at_the_next_look(peer_a):
    b, ex, dl = peer_a({"w/a": 100, "w/b": 100}, replicas_max=1)
    ex.fetch(dl, "w/a", 1000)
    with pytest.raises(OSError, match="REPLICAS_PER_UID_MAX"):
        ex.fetch(dl, "w/b", 1000)
    dl.unpublish("A:w/a")                     # by someone else (an admin)
    assert ex.fetch(dl, "w/b", 1000) == 7
    assert b.replicas.held(1000) == (1, 100)
    dl.unpublish("A:w/b")
    dl.publish("A:w/b", None)                 # a publish the bridge did not make
    assert ex.fetch(dl, "w/a", 1000) == 7     # w/b's record is gone: never counted twice
    assert b.replicas.held(1000) == (1, 100) and b.replicas.summary() == {"1000": [1, 100]}


def test_only_the_callers_own_replica_is_replaced(peer_a):
    b, ex, dl = peer_a({"w/a": 100, "w/b": 100})
    ex.fetch(dl, "w/a", 1000)
    before = dl.entries["A:w/a"]
    with pytest.raises(PermissionError, match="'A:w/a' holds the replica uid 1000 fetched: "
                       "uid 1001 may not replace it"):
        ex.fetch(dl, "w/a", 1001)
    assert dl.entries["A:w/a"] == before and b.replicas.held(1001) == (0, 0)
    dl.unpublish("A:w/a")                     # gone: the name is free again
    ex.fetch(dl, "w/a", 1001)
    assert b.replicas.held(1000) == (0, 0) and b.replicas.held(1001) == (1, 100)
    dl.publish("A:w/b", None, uid=1234)       # someone published the name first
    with pytest.raises(FileExistsError, match="published by uid 1234, not by the bridge"):
        ex.fetch(dl, "w/b", 1001)


def test_a_replica_from_before_a_restart_is_replaced_by_the_first_fetch(peer_a):
    b, ex, dl = peer_a({"w/a": 100})
    dl.publish("A:w/a", None)                 # the bridge's, not in this bridge's ledger
    ex.fetch(dl, "w/a", 1000)
    assert b.replicas.held(1000) == (1, 100)
    with pytest.raises(PermissionError):
        ex.fetch(dl, "w/a", 1001)


def test_a_failed_fetch_keeps_the_replica_it_was_to_replace(peer_a):
    b, ex, dl = peer_a({"w/a": 100})
    ex.fetch(dl, "w/a", 1000)
    ex.sizes["w/a"] = 200

    def refuse(*a, **k):
        raise OSError(errno.EDQUOT, "dlpackd says no")
    dl.publish = refuse
    with pytest.raises(OSError, match="dlpackd says no"):
        ex.fetch(dl, "w/a", 1000)
    assert b.replicas.held(1000) == (1, 100) and b.replicas.summary() == {"1000": [1, 100]}


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="a second uid needs root and setpriv (util-linux)")
def test_local_callers_are_charged_to_their_uid_from_so_peercred(peer_a):
    """Through the local socket: root and uid 65534 (setpriv), each charged to its own uid."""
    b, ex, dl = peer_a({"w/a": 100, "w/b": 100}, replicas_max=1)
    b.peers = {"A": ex.link}
    b.dlpackd = lambda: dl
    d = tempfile.mkdtemp(prefix="dlpc-bridge-uid-")
    os.chmod(d, 0o755)
    path = os.path.join(d, "bridge.sock")
    unix = _server._listen_unix(path, 0o666)
    th = threading.Thread(target=b._accept, args=(unix, b._admit_client), daemon=True)
    th.start()

    def as_nobody(name):
        code = ("import sys\nfrom dlpack_ipc import bridge\n"
                f"try:\n    print(bridge.fetch({name!r}, 5, socket={path!r}))\n"
                "except OSError as e:\n    print(type(e).__name__, e.strerror)\n")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()
    try:
        assert bridge.fetch("A:w/a", 5, socket=path) == ("A:w/a", 7)          # root
        with pytest.raises(OSError, match="uid 0 holds 1 replicas: REPLICAS_PER_UID_MAX") \
                as e:
            bridge.fetch("A:w/b", 5, socket=path)
        assert e.value.errno == errno.EDQUOT and "peer A" in str(e.value)
        assert as_nobody("A:w/b") == "('A:w/b', 7)"          # root at its limit: served
        assert as_nobody("A:w/a") == ("PermissionError fetch 'A:w/a': peer A (192.0.2.1:1), "
                                      "'w/a': 'A:w/a' holds the replica uid 0 fetched: uid "
                                      "65534 may not replace it (only its own)")
        assert b.replicas.summary() == {"0": [1, 100], "65534": [1, 100]}
        assert bridge.status(socket=path)["replicas"] == {"0": [1, 100], "65534": [1, 100]}
        code = ("from dlpack_ipc import bridge\n"
                f"try:\n    bridge.drop('A:w/a', socket={path!r})\n"
                "except OSError as e:\n    print(type(e).__name__)\n")
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=30)
        assert r.stdout.strip() == "PermissionError", r.stderr    # root's: not 65534's
        bridge.drop("A:w/a", socket=path)                           # root's own
        assert bridge.status(socket=path)["replicas"] == {"65534": [1, 100]}
        assert bridge.fetch("A:w/a", 5, socket=path) == ("A:w/a", 7)  # room again
    finally:
        b.stop.set()
        th.join(5)
        unix.close()
        shutil.rmtree(d)


def test_the_per_uid_options():
    main = importlib.import_module("dlpack_ipc.bridge.__main__")
    args = main._args(["--replicas-per-uid", "3", "--replica-bytes-per-uid", "2G"])
    assert args.replicas_per_uid == 3 and args.replica_bytes_per_uid == 2 << 30
    assert main._args([]).replica_bytes_per_uid is None       # the constants, in Bridge
    assert main.size("4096") == 4096 and main.size("1t") == 1 << 40
    with pytest.raises(SystemExit):
        main._args(["--replica-bytes-per-uid", "lots"])
    assert main.main(["--replicas-per-uid", "0"]) == 2
    assert main.main(["--replica-bytes-per-uid", "0"]) == 2


def test_follow_replicas_are_the_bridges_own(peer_a):
    b, ex, dl = peer_a({"w/f": 100})
    ex.fetch(dl, "w/f", b.replicas.own_uid)                # as _follow fetches
    with pytest.raises(PermissionError, match=f"uid {BRIDGE_UID} fetched: uid 1000 may not"):
        ex.fetch(dl, "w/f", 1000)
    dl.unpublish("A:w/f")                                  # _follow: the peer's entry went
    b.replicas.forget("A:w/f")
    assert b.replicas.held(BRIDGE_UID) == (0, 0) and b.replicas.summary() == {}
    b.replicas.forget("A:w/f")                             # twice: nothing below zero
    assert b.replicas.held(BRIDGE_UID) == (0, 0)


def test_a_followed_name_is_not_fetched_by_a_local_caller(peer_a):
    """--follow keeps its replica as the bridge's own: a local caller's fetch of that name is
    refused (it would take the replica over, and the follow could never replace it again), and
    the follow's own fetch still goes."""
    b, ex, dl = peer_a({"w/f": 100, "w/g": 100})
    b.peers = {"A": ex.link}
    b.follow = [(ex.link, "w/f", "A:w/f")]
    r = b._fetch(dl, {"op": "fetch", "name": "A:w/f"}, 1000, 4242)
    assert r["op"] == "error" and r["errno"] == "EPERM" and "--follow" in r["message"]
    assert b.replicas.held(1000) == (0, 0) and "A:w/f" not in dl.entries
    assert b._fetch(dl, {"op": "fetch", "name": "A:w/g"}, 1000, 4242)["op"] == "fetched"
    ex.fetch(dl, "w/f", b.replicas.own_uid)                # as _follow fetches
    assert b.replicas.held(BRIDGE_UID) == (1, 100)


def _resident(addr, n):
    """Pages of [addr, addr + n) (page-aligned) that are mapped in, by mincore(2)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    vec = ctypes.create_string_buffer(n // 4096)
    assert libc.mincore(addr, n, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw)


def test_populate_maps_the_ranges_and_stops_when_told(monkeypatch, caplog):
    """The importer's populate thread maps an unaligned range's pages in (MADV_POPULATE_WRITE),
    stops part-way when finished early, and a kernel that refuses the advice ends it at once
    with one line in the log."""
    import ctypes
    import mmap
    size = 16 << 20
    m = mmap.mmap(-1, size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    try:
        assert _resident(base, size) == 0
        p = _importer._Populate([(base + 100, size - 200)])
        p.join(10)
        assert not p.is_alive() and _resident(base, size) == size // 4096
        m2 = mmap.mmap(-1, size)
        base2 = ctypes.addressof(ctypes.c_char.from_buffer(m2))
        monkeypatch.setattr(_importer, "POPULATE_CHUNK", 1 << 20)
        real, calls = _importer._libc.madvise, []

        def slow(a, n, advice):
            calls.append(n)
            time.sleep(0.2)                 # 16 chunks: 3.2 s, stopped well before
            return real(a, n, advice)
        monkeypatch.setattr(_importer._libc, "madvise", slow)
        p = _importer._Populate([(base2, size)])
        time.sleep(0.3)
        p.finish()
        assert 1 <= len(calls) < 16 and 0 < _resident(base2, size) < size // 4096
        monkeypatch.setattr(_importer._libc, "madvise", lambda a, n, advice: -1)
        monkeypatch.setattr(_importer.log, "propagate", True)   # the bridge's main turns it off
        with caplog.at_level("INFO", logger="dlpackd-bridge"):
            p = _importer._Populate([(base2, size)])
            p.join(10)
        assert not p.is_alive()
        assert sum("MADV_POPULATE_WRITE" in r.getMessage() for r in caplog.records) == 1
        del base2
        m2.close()
    finally:
        del base
        m.close()


def test_a_caller_drops_its_own_replica(peer_a):
    """drop: the replica's fetcher (or root) gives it back: unpublished and no longer charged;
    another uid's, an unknown name and a followed one are refused, naming why."""
    b, ex, dl = peer_a({"w/a": 100, "w/b": 100, "w/f": 100}, replicas_max=1)
    b.follow = [(ex.link, "w/f", "A:w/f")]
    ex.fetch(dl, "w/a", 1000)
    ex.fetch(dl, "w/b", 1001)

    def drop(name, uid):
        return b._drop(dl, {"op": "drop", "name": name}, uid, 4242)
    r = drop("A:w/a", 1001)
    assert r["errno"] == "EPERM" and "uid 1001 may not drop it" in r["message"]
    assert drop("A:w/a", 1000) == {"op": "dropped", "name": "A:w/a"}
    assert "A:w/a" not in dl.entries and b.replicas.held(1000) == (0, 0)
    assert drop("A:w/a", 1000)["errno"] == "ENOENT"
    assert drop("A:w/f", 0)["errno"] == "EPERM"
    assert drop("w/b", 1001)["errno"] == "EINVAL"
    dl.unpublish("A:w/b")                       # gone already: the record goes all the same
    assert drop("A:w/b", 0)["op"] == "dropped" and b.replicas.summary() == {}
    assert ex.fetch(dl, "w/a", 1000) == 7       # at its limit before: room again


# -- push subscriptions: two real bridges (NIXL faked: fake_nixl.py) on one real dlpackd ------

FAKE_NIXL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_nixl.py")
# The follower's --follow-interval in these tests: a change that reaches its replica within
# PUSHED (well under it) can only have been pushed.
FOLLOW_INTERVAL = 60
PUSHED = 10.0
# Its --follow-subscribed-interval: no safety poll lands within a test.
FOLLOW_SUBSCRIBED_INTERVAL = 3600
# Its RESUBSCRIBE_MAX (fake_nixl.py): a restarted exporter is tried every second.
RESUBSCRIBE_MAX = 1.0


def _wait(pred, what, timeout=PUSHED):
    """pred()'s first true value within timeout seconds; AssertionError naming what if none."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.02)


def _free_port():
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


class Hosts:
    """One dlpackd, an exporting bridge "A" (--export w/) and a following one (--follow
    A:w/p, --follow-interval FOLLOW_INTERVAL, --follow-subscribed-interval
    FOLLOW_SUBSCRIBED_INTERVAL), as real processes; logs shown on failure."""

    def __init__(self, dlpackd):
        self.tmp = tempfile.mkdtemp(prefix="dlpc-bridge-push-")
        self.dlpackd_bin = dlpackd
        self.dlpackd_sock = self.path("dlpackd.sock")
        self.token = self.path("token")
        fd = os.open(self.token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(24).hex().encode())
        os.close(fd)
        self.port = _free_port()
        self.procs = {}
        self.start_dlpackd()

    def start_dlpackd(self):
        """dlpackd, and self.dl a client of it once it answers."""
        import dlpack_ipc

        def client():
            try:
                return dlpack_ipc.Client(self.dlpackd_sock)
            except OSError:
                return None
        self.start("dlpackd", [self.dlpackd_bin, "-s", self.dlpackd_sock])
        self.dl = _wait(client, "dlpackd answering on its socket")

    def path(self, name):
        return os.path.join(self.tmp, name)

    def start(self, name, argv, env=None):
        with open(self.path(f"{name}.log"), "ab") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env)
        return self.procs[name]

    def start_bridge(self, name, *argv, env=None):
        sock = self.path(f"{name}.sock")
        env = {**os.environ, "FAKE_NIXL_RESUBSCRIBE_MAX": str(RESUBSCRIBE_MAX), **(env or {})}
        p = self.start(name, [sys.executable, FAKE_NIXL, "--socket", sock, "--dlpackd-socket",
                              self.dlpackd_sock, "--token-file", self.token,
                              "--log-level", "debug", *argv], env)
        _wait(lambda: p.poll() is not None or os.path.exists(sock), f"{name}'s socket")
        assert p.poll() is None, f"{name} exited: {self.log(name)}"
        return p

    def exporter(self):
        return self.start_bridge("A", "--listen", f"127.0.0.1:{self.port}", "--export", "w/")

    def follower(self):
        return self.start_bridge("B", "--peer", f"A=127.0.0.1:{self.port}", "--follow",
                                 "A:w/p", "--follow-interval", str(FOLLOW_INTERVAL),
                                 "--follow-subscribed-interval",
                                 str(FOLLOW_SUBSCRIBED_INTERVAL))

    def status(self, name):
        return bridge.status(socket=self.path(f"{name}.sock"))

    def followed(self):
        return self.status("B")["follows"]["A:w/p"]

    def replica(self, name="A:w/p"):
        """The bytes of the replica name here (the follower's by default), or None where there
        is none."""
        import numpy as np
        try:
            t = self.dl.attach(name, timeout=0)
        except FileNotFoundError:
            return None
        try:
            return np.asarray(t).copy()
        finally:
            t.release()

    def stop(self, name):
        p = self.procs.pop(name)
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def log(self, name, lines=40):
        """The last lines of name's log (None: all of it)."""
        with open(self.path(f"{name}.log"), errors="replace") as f:
            return "".join(f.readlines()[-lines:] if lines else f.readlines())

    def close(self, failed):
        self.dl.close()
        for name in [n for n in self.procs if n != "dlpackd"] + ["dlpackd"]:
            if name in self.procs:
                self.stop(name)
        if failed:
            for name in sorted(f[:-4] for f in os.listdir(self.tmp) if f.endswith(".log")):
                if os.path.exists(self.path(f"{name}.log")):
                    print(f"--- {name}'s log (last lines)\n{self.log(name)}")
        shutil.rmtree(self.tmp, ignore_errors=True)


def _dlpackd_bin():
    """The dlpackd binary the tests run (DLPACKD_BIN); the test fails saying how to set it."""
    dlpackd = os.environ.get("DLPACKD_BIN")
    if not dlpackd or not os.access(dlpackd, os.X_OK):
        pytest.fail(f"DLPACKD_BIN={dlpackd!r} is not the dlpackd binary (ctest sets it; by "
                    "hand: DLPACKD_BIN=build/dlpackd)", pytrace=False)
    return dlpackd


@contextlib.contextmanager
def _closed_after(request, h):
    """h, closed when the block ends (its logs printed if a test failed meanwhile)."""
    failed_before = request.session.testsfailed
    try:
        yield h
    finally:
        h.close(request.session.testsfailed != failed_before)


@pytest.fixture(scope="module")
def hosts(request):
    with _closed_after(request, Hosts(_dlpackd_bin())) as h:
        h.exporter()
        h.follower()
        yield h


def _publish(h, value, n=1 << 16):
    import numpy as np
    return h.dl.publish("w/p", np.full(n, value, np.uint8), replace=True)


def _replicated(h, value, generation):
    """Whether the follower's replica holds value throughout and says generation."""
    r = h.replica()
    return r is not None and bool((r == value).all()) and \
        h.followed() == {"subscribed": True, "generation": generation}


def test_a_replace_is_pushed_to_the_follower_well_before_its_poll(hosts):
    g1 = _publish(hosts, 1)
    _wait(lambda: _replicated(hosts, 1, g1), "the first replica", timeout=30)
    g2 = _publish(hosts, 2)
    assert g2 != g1
    # --follow-interval is 60 s, --follow-subscribed-interval an hour, and the follower
    # polled when it subscribed: only a push explains the new bytes within PUSHED
    _wait(lambda: _replicated(hosts, 2, g2), "the REPLACE's bytes on the follower")
    assert hosts.status("A")["subscribers"] == 1


def test_an_unpublish_is_pushed_and_the_replica_goes(hosts):
    if hosts.replica() is None:
        g = _publish(hosts, 3)
        _wait(lambda: _replicated(hosts, 3, g), "a replica to take away", timeout=30)
    hosts.dl.unpublish("w/p")
    _wait(lambda: hosts.replica() is None and hosts.followed()["generation"] is None,
          "the replica unpublished after the UNPUBLISH")
    g = _publish(hosts, 4)           # published anew: pushed as well
    _wait(lambda: _replicated(hosts, 4, g), "the entry published anew, replicated anew")


def _threads_and_fds(p):
    return len(os.listdir(f"/proc/{p.pid}/task")), len(os.listdir(f"/proc/{p.pid}/fd"))


def _subscriber(h):
    """A raw peer connection to the exporter, authenticated, NIXL metadata exchanged."""
    sock = socket.create_connection(("127.0.0.1", h.port), timeout=10)
    with open(h.token, "rb") as f:
        token = f.read().strip()
    _wire.auth_client(sock, token, "raw-subscriber", "A")
    assert _wire.recv(sock, time.monotonic() + 10)["op"] == "metadata"
    _wire.send(sock, {"op": "metadata", "metadata": md64(f"fake/{os.getpid()}/raw")})
    return sock


def _ask(sock, frame):
    _wire.send(sock, frame)
    return _wire.recv(sock, time.monotonic() + 10)


def _settled(p):
    """p's threads and fds once two looks half a second apart agree (a local client's thread
    of the status call just made ends on its own)."""
    last = None
    while (now := _threads_and_fds(p)) != last:
        last = now
        time.sleep(0.5)
    return now


def test_subscriptions_per_peer_max_and_they_end_with_the_connection(hosts):
    ex = hosts.procs["A"]
    # the exporter has served the follower once: what its dlpackd client keeps from an
    # attach is there before the count
    g = _publish(hosts, 8)
    _wait(lambda: _replicated(hosts, 8, g), "a replica before the count", timeout=30)
    assert hosts.status("A")["subscribers"] == 1
    before = _settled(ex)
    sock = _subscriber(hosts)
    try:
        limit = _push.SUBSCRIPTIONS_PER_PEER_MAX
        for i in range(limit):
            r = _ask(sock, {"op": "subscribe", "id": i, "name": f"w/s{i}"})
            assert r == {"op": "subscribed", "id": i, "name": f"w/s{i}", "generation": None,
                         "created_ns": None}
        r = _ask(sock, {"op": "subscribe", "id": limit, "name": "w/one-more"})
        assert r["op"] == "error" and r["errno"] == "EAGAIN" and r["id"] == limit
        assert r["message"] == (f"'w/one-more': this connection holds {limit} subscriptions "
                                "(SUBSCRIPTIONS_PER_PEER_MAX)")
        r = _ask(sock, {"op": "subscribe", "id": 0, "name": "w/s0"})     # again: no new one
        assert r["op"] == "subscribed"
        r = _ask(sock, {"op": "subscribe", "id": 1, "name": "x/not-exported"})
        assert r["op"] == "error" and r["errno"] == "ENOENT" and "not exported" in r["message"]
        assert hosts.status("A")["subscribers"] == 1 + limit
        # a subscribed name's change is pushed to this connection too: no id, its state now
        g = hosts.dl.publish("w/s3", b"x" * 8)
        f = _wire.recv(sock, time.monotonic() + PUSHED)
        assert f["op"] == "changed" and f["name"] == "w/s3" and f["generation"] == g \
            and "id" not in f
        hosts.dl.unpublish("w/s3")
        assert _wire.recv(sock, time.monotonic() + PUSHED) == {"op": "gone", "name": "w/s3"}
        # this subscriber stops reading: the follower's pushes still go
        g = _publish(hosts, 5)
        _wait(lambda: _replicated(hosts, 5, g), "a push while another subscriber sleeps")
        hosts.dl.publish("w/s4", b"y" * 8)
        hosts.dl.unpublish("w/s4")
    finally:
        sock.close()
    _wait(lambda: hosts.status("A")["subscribers"] == 1,
          "the closed connection's subscriptions gone")
    time.sleep(0.5)          # the status calls' own client threads end
    now = []
    try:
        _wait(lambda: now.append(_threads_and_fds(ex)) or now[-1] == before, "")
    except AssertionError:
        raise AssertionError(f"the exporter's threads and fds: {now[-1]}, not back to "
                             f"{before}: {os.listdir(f'/proc/{ex.pid}/fd')}") from None


def test_a_restarted_exporter_is_subscribed_again(hosts):
    """The follower subscribes again once the exporter is back (tried every RESUBSCRIBE_MAX
    here), fetches what was replaced while it was away (the generation the subscription
    answers with), and gets the pushes that follow."""
    hosts.stop("A")
    _wait(lambda: not hosts.followed()["subscribed"], "the follower sees the subscription go")
    g = _publish(hosts, 6)                       # while the exporter is down: no push
    hosts.exporter()
    _wait(lambda: _replicated(hosts, 6, g), "the REPLACE made while the exporter was down, "
          "fetched on subscribing again")
    g = _publish(hosts, 7)
    _wait(lambda: _replicated(hosts, 7, g), "a REPLACE after the restart, pushed")


def test_pushes_go_again_after_the_exporters_dlpackd_restarts(hosts):
    """dlpackd restarts under both bridges: the exporter's watch is opened again and its peer
    connection's dlpackd client connects anew (the follower's as well), so a publish on the
    new dlpackd is pushed (the follower's poll is an hour away) and fetched, the peers'
    connection untouched."""
    g = _publish(hosts, 10)
    _wait(lambda: _replicated(hosts, 10, g), "a replica before the restart", timeout=30)
    hosts.dl.close()
    hosts.stop("dlpackd")
    if os.path.exists(hosts.dlpackd_sock):
        os.unlink(hosts.dlpackd_sock)
    hosts.start_dlpackd()
    g = _publish(hosts, 11)
    _wait(lambda: _replicated(hosts, 11, g), "a publish on the restarted dlpackd, pushed")


class OldExporter:
    """A peer bridge from before subscriptions, on a real TCP port: authenticates, answers
    stat (and get/put for a tensor of no bytes) and, asked to subscribe, does what such a
    bridge does with an op it does not know: an EPROTO error frame, then it disconnects.
    Counts what it was asked; pushes=True sends malformed pushes before each answer.
    subscribe=True: a current bridge's answer instead; fail_gets, fail_subscribes: that many
    gets, subscribes answered EIO first (the connection stays)."""

    def __init__(self, token, pushes=False, subscribe=False, fail_gets=0, fail_subscribes=0):
        self.token = token
        self.pushes = pushes
        self.subscribe = subscribe
        self.fail_gets = fail_gets
        self.fail_subscribes = fail_subscribes
        self.asked = {"subscribe": 0, "stat": 0, "get": 0, "connections": 0}
        self.generation = 5
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.addr = self.lsock.getsockname()
        self.th = threading.Thread(target=self._accept, daemon=True)
        self.th.start()

    def _accept(self):
        while True:
            try:
                s, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(s,), daemon=True).start()

    def _serve(self, s):
        with s:
            try:
                _wire.auth_server(s, self.token)
                self.asked["connections"] += 1
                _wire.send(s, {"op": "metadata", "metadata": md64("old-exporter")})
                _wire.recv(s, time.monotonic() + 5)
                while True:
                    f = _wire.recv(s, None)
                    self.asked[f["op"]] = self.asked.get(f["op"], 0) + 1
                    if self.pushes:
                        for bad in ({"op": "changed", "name": ["w/f"]}, {"op": "gone"},
                                    {"op": "changed", "name": "not-followed", "generation": 1}):
                            _wire.send(s, bad)
                    if f["op"] == "stat":
                        _wire.send(s, {"op": "stat", "id": f["id"],
                                       "generation": self.generation, "created_ns": 1})
                    elif f["op"] == "subscribe" and self.subscribe and \
                            self.asked["subscribe"] <= self.fail_subscribes:
                        _wire.send(s, _wire.error_frame("EIO", "injected: dlpackd cannot be "
                                                        "asked", id=f["id"]))
                    elif f["op"] == "subscribe" and self.subscribe:
                        _wire.send(s, {"op": "subscribed", "id": f["id"], "name": f["name"],
                                       "generation": self.generation, "created_ns": 1})
                    elif f["op"] == "get" and self.asked["get"] <= self.fail_gets:
                        _wire.send(s, _wire.error_frame("EIO", "injected", id=f["id"]))
                    elif f["op"] == "get":
                        _wire.send(s, {"op": "layout", "id": f["id"], "lease": "L",
                                       "generation": self.generation, "bundle": False,
                                       "ttl": 5, "tensors": [["", "float32", [0], 0]]})
                    elif f["op"] == "put":
                        _wire.send(s, {"op": "done", "id": f["id"], "lease": "L"})
                    else:
                        _wire.send(s, _wire.error_frame("EPROTO", f"unknown op {f['op']!r}"))
                        return
            except (OSError, _wire.FrameError):
                return

    def close(self):
        self.lsock.close()


def following(b, ex, interval=0.1):
    """A Follow of ex's w/f run in a thread by bridge b, polling every interval; (follow,
    the thread, dl)."""
    import types
    b.args = types.SimpleNamespace(follow_interval=interval, follow_subscribed_interval=30.0)
    dl = FakeDlpackd()
    b.dlpackd = lambda reconnect=False: dl
    link = _importer.PeerLink(b, "A", ex.addr)
    follow = _push.Follow(b, link, "w/f", "A:w/f")
    th = threading.Thread(target=follow.run, daemon=True)
    th.start()
    return follow, th, dl


@pytest.mark.parametrize("pushes", [False, True])
def test_an_older_peer_refusing_subscribe_is_polled_logged_once(caplog, monkeypatch, pushes):
    """A peer that knows no subscribe (it disconnects on it): the follow falls back to
    polling at --follow-interval, says so once, does not ask again on that peer's new
    connections, and still follows the generation. Malformed and unfollowed pushes from a
    peer are dropped without harm."""
    b = fake_bridge()
    ex = OldExporter(b.token, pushes)
    # the bridge's logger propagates to the root or not (main() stops it, test_the_per_uid_
    # options): caplog's handler on it, and on it only
    logger = _server.log
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(caplog.handler)
    with caplog.at_level("INFO", logger="dlpackd-bridge"):
        follow, th, dl = following(b, ex)
        try:
            _wait(lambda: "A:w/f" in dl.entries and ex.asked["stat"] >= 3, "polls")
            ex.generation = 6
            _wait(lambda: follow.generation == 6, "the new generation, polled")
        finally:
            stop_following(b, follow, th, ex)
            logger.removeHandler(caplog.handler)
    assert not th.is_alive()
    assert ex.asked["subscribe"] == 1 and not follow.subscribed
    said = [r.getMessage() for r in caplog.records if "does not know subscribe" in
            r.getMessage()]
    assert said == ["follow 'A:w/f': peer A does not know subscribe (an older bridge: "
                    "unknown op 'subscribe'): polling every 0.1 s instead"]


def test_the_follow_options():
    main = importlib.import_module("dlpack_ipc.bridge.__main__")
    args = main._args(["--follow-subscribed-interval", "5", "--follow-interval", "2"])
    assert args.follow_subscribed_interval == 5.0 and args.follow_interval == 2.0
    assert main._args([]).follow_subscribed_interval is None     # the constant, in main()
    assert _push.FOLLOW_SUBSCRIBED_INTERVAL == 30.0
    assert main.main(["--follow-subscribed-interval", "0"]) == 2
    assert main.main(["--follow-interval", "-1"]) == 2


def test_a_follow_given_twice_or_too_long_stops_the_bridge_at_start():
    import dlpack_ipc
    main = importlib.import_module("dlpack_ipc.bridge.__main__")
    for follow, why in ((["A:w/x", "A:w/x"], "given twice"),
                        (["A:w/" + "n" * dlpack_ipc.NAME_MAX], "longer than NAME_MAX")):
        args = main._args(["--peer", "A=127.0.0.1:9", "--token-file", "/dev/null"] +
                          [a for f in follow for a in ("--follow", f)])
        with pytest.raises(ValueError, match=why):
            _server.Bridge(args, b"t" * 32)
    # a PEER that is neither a --peer nor, with a --registry, a bridge's name
    args = main._args(["--token-file", "/dev/null", "--registry", "http://127.0.0.1:9",
                       "--listen", "127.0.0.1:9", "--name", "me", "--follow", "me:w/x"])
    with pytest.raises(ValueError, match="names this bridge"):
        _server.Bridge(args, b"t" * 32)
    for follow, extra in (("B:w/x", []), ("*:w/x", ["--registry", "http://127.0.0.1:9"]),
                          ("a/b:w/x", ["--registry", "http://127.0.0.1:9"]),
                          ("A:", [])):
        args = main._args(["--peer", "A=127.0.0.1:9", "--token-file", "/dev/null",
                           "--follow", follow] + extra)
        with pytest.raises(ValueError, match="is not PEER:NAME with a --peer PEER, or a "
                           "bridge's name in the --registry"):
            _server.Bridge(args, b"t" * 32)


def test_pushes_coalesce_and_a_subscriber_that_does_not_read_is_given_up(monkeypatch):
    """The watch thread's marks coalesce to one push per name; a connection whose peer stops
    reading fails its thread's send after PUSH_SEND_TIMEOUT (the connection then closes)
    instead of waiting on it for ever."""
    monkeypatch.setattr(_push, "PUSH_SEND_TIMEOUT", 0.2)
    pub = _push.Publisher(threading.Event(), None, ["w/"])
    sub = _push.Subscriber("peer")
    names = [f"w/{i:05d}" + "x" * 2000 for i in range(4000)]   # ~8 MB of pushes
    pub._subs = {n: {sub} for n in names}          # as subscribe() leaves them, watch aside
    sub.names = set(names)
    for _ in range(3):
        pub._mark(names)
    assert sub.dirty == set(names)                 # three changes each: one push each

    class Dl:
        def list(self, prefix):
            class Info:
                name, generation, created_ns = prefix, 1, 2
            return [Info()]
    c, s = socket.socketpair()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            pub.flush(s, Dl(), sub)                 # c never reads
        assert time.monotonic() - t0 < 5
        f = _wire.recv(c, time.monotonic() + 5)
        assert f == {"op": "changed", "name": names[0], "generation": 1, "created_ns": 2}
    finally:
        c.close()
        s.close()
    pub.unsubscribe_all(sub)
    assert pub._subs == {} and sub.names == set() and pub.subscribers() == 0


def test_a_fetch_that_fails_while_subscribed_is_tried_again_soon():
    """Subscribed (the next poll 30 s away, --follow-interval 60), a failed fetch is tried
    again after RESUBSCRIBE_FIRST (1 s), doubling: not at the next poll."""
    b = fake_bridge()
    ex = OldExporter(b.token, subscribe=True, fail_gets=2)
    follow, th, dl = following(b, ex, interval=60)
    try:
        _wait(lambda: "A:w/f" in dl.entries, "the replica after two failed gets")
        assert follow.generation == 5 and follow.subscribed
        assert ex.asked["get"] == 3 and ex.asked["subscribe"] == 1
    finally:
        stop_following(b, follow, th, ex)
    assert not th.is_alive()


# -- the review's cases: what a follow holds, a dlpackd that goes, threads that must not die --

class FakeLink:
    """A PeerLink's calls as a Follow makes them, each answer numbered as the link numbers the
    frames it reads: subscribe answers (5, 1); each fetch first hands on a `gone` push (read
    before its answer), then answers with a layout of generation 6, created_ns 2; stat
    answers (6, 2). subscribe_error: raised by subscribe instead."""

    name, where, epoch = "A", "192.0.2.1:1", 1

    def __init__(self, subscribe_error=None):
        self.follows = {}
        self.frames = 0
        self.subscribe_error = subscribe_error
        self.asked = {"subscribe": 0, "fetch": 0, "stat": 0}

    def connected(self):
        return True

    def refuses_subscribe(self):
        return False

    def _frame(self):
        self.frames += 1
        return self.frames

    def subscribe(self, rname, deadline):
        self.asked["subscribe"] += 1
        if self.subscribe_error is not None:
            raise self.subscribe_error
        return (5, 1), self.epoch, self._frame()

    def fetch(self, dl, rname, local, deadline, uid, layout=None):
        self.asked["fetch"] += 1
        for follow in self.follows[rname]:
            follow.push({"op": "gone", "name": rname}, self._frame())
        layout.update(generation=6, created_ns=2, frame=self._frame())
        return dl.publish(local, None)

    def stat(self, rname, deadline):
        self.asked["stat"] += 1
        return (6, 2), self._frame()


class RecordingDlpackd(FakeDlpackd):
    """Records the unpublishes; fail: what unpublish raises instead."""

    def __init__(self, fail=None):
        super().__init__()
        self.fail = fail
        self.unpublished = []

    def unpublish(self, name, generation=None):
        self.unpublished.append(name)
        if self.fail is not None:
            raise self.fail
        super().unpublish(name, generation)


def run_follow(link, dl, subscribed_interval, seen=None):
    """A Follow of link's w/f (--follow-interval 60), run in a thread; seen: the peer's
    (generation, created_ns) of a replica it holds already. (bridge, follow, thread)"""
    import types
    b = fake_bridge()
    b.args = types.SimpleNamespace(follow_interval=60,
                                   follow_subscribed_interval=subscribed_interval)
    b.dlpackd = lambda reconnect=False: dl
    follow = _push.Follow(b, link, "w/f", "A:w/f")
    if seen is not None:
        follow._seen, follow.generation = seen, seen[0]
    th = threading.Thread(target=follow.run, daemon=True)
    th.start()
    return b, follow, th


def stop_following(b, follow, th, ex):
    """End a follow against a fake exporter: the bridge stopped, the follow's thread joined,
    the exporter closed and the link dropped (the caller asserts on the thread)."""
    b.stop.set()
    follow.lost()
    th.join(5)
    ex.close()
    follow.link.drop()


def stop_follow(b, follow, th):
    b.stop.set()
    follow.lost()
    th.join(5)
    assert not th.is_alive(), "the follow's thread did not end"


def test_a_follow_holds_what_it_fetched_and_drops_the_pushes_read_before_the_answer():
    """Subscribed at generation 5, the fetch gets generation 6 and a `gone` read before that
    layout: the follow says 6, keeps the replica (the `gone` is older news), and its polls,
    which answer 6, fetch nothing again."""
    link, dl = FakeLink(), RecordingDlpackd()
    b, follow, th = run_follow(link, dl, 0.05)
    try:
        _wait(lambda: link.asked["stat"] >= 3, "three polls after the fetch")
    finally:
        stop_follow(b, follow, th)
    assert follow.generation == 6 and "A:w/f" in dl.entries
    assert link.asked["fetch"] == 1 and dl.unpublished == []


def test_a_follow_survives_a_replica_it_cannot_unpublish():
    """The peer no longer exports the name and the replica cannot be unpublished here: logged,
    and tried again after RESUBSCRIBE_FIRST; the follow's thread goes on."""
    link = FakeLink(FileNotFoundError(errno.ENOENT, "'w/f' is not exported by this bridge"))
    dl = RecordingDlpackd(PermissionError(errno.EPERM, "injected"))
    b, follow, th = run_follow(link, dl, 3600, seen=(1, 1))
    try:
        _wait(lambda: link.asked["subscribe"] >= 2 and len(dl.unpublished) >= 2,
              "a second attempt after the failed unpublish")
        assert th.is_alive()
    finally:
        stop_follow(b, follow, th)


def test_a_subscription_the_peer_could_not_set_up_is_tried_again_not_polled():
    """Only EOPNOTSUPP (an older bridge) and EAGAIN (subscriptions full) are refusals the
    follow polls after; an EIO answer is a failure: subscribed again after RESUBSCRIBE_FIRST,
    no poll."""
    def refused(errname):
        e = _importer.subscribe_error({"op": "error", "errno": errname, "message": "m"}, "A")
        return getattr(e, "subscribe_refused", False)
    assert refused("EAGAIN") and not refused("EIO") and not refused("ENOENT")
    assert _importer.subscribe_error({"op": "error", "errno": "EPROTO",
                                      "message": "unknown op 'subscribe'"}, "A").subscribe_refused
    b = fake_bridge()
    ex = OldExporter(b.token, subscribe=True, fail_subscribes=1)
    follow, th, dl = following(b, ex, interval=60)
    try:
        _wait(lambda: follow.subscribed and "A:w/f" in dl.entries, "subscribed at the second try")
        assert ex.asked["subscribe"] == 2 and ex.asked["stat"] == 0
    finally:
        stop_following(b, follow, th, ex)
    assert not th.is_alive()


class FakeWatch:
    """What dlpack_ipc.watch returns: next_event waits a little and has no event, or raises
    fail once lose is set."""

    def __init__(self, fail=None, lose=None):
        self.fail = fail
        self.lose = lose
        self.closed = False

    def next_event(self, timeout):
        if self.fail is not None and self.lose is not None and self.lose.is_set():
            raise self.fail
        time.sleep(min(timeout, 0.02))
        return None

    def close(self):
        self.closed = True


@pytest.fixture
def bridge_log(caplog, monkeypatch):
    """caplog on the bridge's logger, whether or not it propagates (main() stops it)."""
    monkeypatch.setattr(_server.log, "propagate", False)
    _server.log.addHandler(caplog.handler)
    with caplog.at_level("DEBUG", logger="dlpackd-bridge"):
        yield caplog
    _server.log.removeHandler(caplog.handler)


def test_a_lost_watch_is_opened_again_and_every_subscribed_name_looked_at(monkeypatch):
    """dlpackd drops the watch: it is opened again (every WATCH_AGAIN) and every subscribed
    name is marked for each of its subscribers; the watch is never opened under the
    Publisher's lock."""
    monkeypatch.setattr(_push, "WATCH_AGAIN", 0.05)
    lose = threading.Event()
    opened, locked = [], []
    stop = threading.Event()
    pub = _push.Publisher(stop, None, ["w/"])

    def watch(prefix, socket=None):
        locked.append(pub._lock.locked())
        opened.append(FakeWatch(ConnectionResetError(errno.ECONNRESET, "dlpackd went away")
                                if not opened else None, lose))
        return opened[-1]
    monkeypatch.setattr(_push.dlpack_ipc, "watch", watch)
    a, b = _push.Subscriber("a"), _push.Subscriber("b")
    pub.subscribe(a, "w/1")
    pub.subscribe(b, "w/1")
    pub.subscribe(b, "w/2")
    th = pub._thread
    assert len(opened) == 1 and a.dirty == set() and b.dirty == set()
    lose.set()
    try:
        _wait(lambda: len(opened) == 2 and a.dirty == {"w/1"} and b.dirty == {"w/1", "w/2"},
              "the watch opened again, every name marked")
    finally:
        stop.set()
        th.join(5)
    assert not th.is_alive() and pub._thread is None
    assert opened[0].closed and opened[1].closed and locked == [False, False]


def test_a_watch_thread_that_fails_opens_its_watch_again(monkeypatch, bridge_log):
    """What the watch thread did not expect (a ValueError opening the watch again) is logged,
    and the thread itself opens a new watch and marks the names subscribed (their changes may
    have been missed): the subscribers do not have to wait for another subscription."""
    monkeypatch.setattr(_push, "WATCH_AGAIN", 0.05)
    lose = threading.Event()
    calls = []

    def watch(prefix, socket=None):
        calls.append(prefix)
        if len(calls) == 2:
            raise ValueError("injected")
        return FakeWatch(ConnectionResetError(errno.ECONNRESET, "gone") if len(calls) == 1
                         else None, lose)
    monkeypatch.setattr(_push.dlpack_ipc, "watch", watch)
    stop = threading.Event()
    pub = _push.Publisher(stop, None, ["w/"])
    a = _push.Subscriber("a")
    assert pub.subscribe(a, "w/1") is True
    assert pub.subscribe(a, "w/1") is False      # held already: nothing changes
    th = pub._thread
    lose.set()
    try:
        _wait(lambda: len(calls) == 3 and a.dirty == {"w/1"}, "the watch opened again")
        assert pub._thread is th and th.is_alive()
        assert any("the watch of this host's dlpackd failed" in r.getMessage()
                   for r in bridge_log.records)
    finally:
        stop.set()
        th.join(5)
    assert not th.is_alive() and pub._thread is None


def test_a_repeated_subscribe_that_fails_keeps_the_subscription_held(monkeypatch):
    """A peer subscribes to a name it holds already, and dlpackd cannot say the name's state
    this time: the EIO answer leaves the subscription made before in place."""
    monkeypatch.setattr(_push.dlpack_ipc, "watch", lambda prefix, socket=None: FakeWatch())

    class Dl:
        fail = False

        def list(self, prefix):
            if self.fail:
                raise ConnectionResetError(errno.ECONNRESET, "dlpackd went away")
            return []
    b = fake_bridge()
    sub = _push.Subscriber("peer")
    dl = Dl()
    c, s = tcp_pair()
    try:
        b._subscribe(s, dl, {"op": "subscribe", "id": 1, "name": "w/p"}, sub, "peer")
        first = _wire.recv(c, time.monotonic() + 5)
        dl.fail = True
        b._subscribe(s, dl, {"op": "subscribe", "id": 2, "name": "w/p"}, sub, "peer")
        second = _wire.recv(c, time.monotonic() + 5)
    finally:
        c.close()
        s.close()
        stop_fake_bridge(b)
    assert first["op"] == "subscribed" and first["generation"] is None
    assert second["op"] == "error" and second["errno"] == "EIO" and second["id"] == 2
    assert b.publisher.subscribers() == 1 and sub.names == {"w/p"}


def test_a_subscription_whose_state_cannot_be_read_is_not_kept(monkeypatch):
    """Subscribed, then dlpackd cannot say the name's state: the subscription is undone
    before the EIO answer (the follower tries again; nothing is left pushing to it)."""
    monkeypatch.setattr(_push.dlpack_ipc, "watch", lambda prefix, socket=None: FakeWatch())
    b = fake_bridge()

    class Dl:
        def list(self, prefix):
            raise ConnectionResetError(errno.ECONNRESET, "dlpackd went away")
    sub = _push.Subscriber("peer")
    c, s = tcp_pair()
    try:
        b._subscribe(s, Dl(), {"op": "subscribe", "id": 3, "name": "w/p"}, sub, "peer")
        r = _wire.recv(c, time.monotonic() + 5)
    finally:
        c.close()
        s.close()
        stop_fake_bridge(b)
    assert r["op"] == "error" and r["errno"] == "EIO" and r["id"] == 3
    assert "dlpackd went away" in r["message"]
    assert b.publisher.subscribers() == 0 and sub.names == set() and sub.dirty == set()


def test_a_name_longer_than_name_max_is_refused_and_cut_in_the_log(bridge_log):
    """A subscribe for a name past NAME_MAX is refused (ENAMETOOLONG) before anything is held
    or logged whole; a get for a long name that is not exported is logged cut as well."""
    import dlpack_ipc
    b = fake_bridge()
    sub = _push.Subscriber("peer")
    long_name = "w/" + "n" * (1 << 20)
    c, s = tcp_pair()
    try:
        b._subscribe(s, None, {"op": "subscribe", "id": 1, "name": long_name}, sub, "peer")
        r = _wire.recv(c, time.monotonic() + 5)
        b._get(s, None, {"op": "get", "id": 2, "name": "x" + long_name}, {}, "peer")
        g = _wire.recv(c, time.monotonic() + 5)
    finally:
        c.close()
        s.close()
    assert r["op"] == "error" and r["errno"] == "ENAMETOOLONG" and r["id"] == 1
    assert f"longer than NAME_MAX ({dlpack_ipc.NAME_MAX} bytes)" in r["message"]
    assert len(r["message"]) < 1000
    assert g["errno"] == "ENOENT" and len(g["message"]) < 1000
    assert b.publisher.subscribers() == 0 and sub.names == set() and b.publisher._thread is None
    said = [rec.getMessage() for rec in bridge_log.records]
    assert any("longer than NAME_MAX" in m for m in said)
    assert any("which is not exported" in m for m in said)
    assert max(len(m) for m in said) < 1000


def test_a_subscriber_that_stops_reading_is_disconnected_and_its_subscriptions_end(monkeypatch):
    """Over a real connection thread: a peer subscribed to SUBSCRIPTIONS_PER_PEER_MAX names
    that stops reading, with small socket buffers, while every name keeps changing: the
    thread's send gives up after PUSH_SEND_TIMEOUT, the connection closes and its
    subscriptions end."""
    monkeypatch.setattr(_push, "PUSH_SEND_TIMEOUT", 0.2)
    monkeypatch.setattr(_push.dlpack_ipc, "watch", lambda prefix, socket=None: FakeWatch())
    b = fake_bridge()

    class Dl:
        def list(self, prefix):
            class Info:
                name, generation, created_ns = prefix, 1, 2
            return [Info()]

        def close(self):
            pass
    b.dlpackd = lambda reconnect=False: Dl()
    with socket.create_server(("127.0.0.1", 0)) as ls:
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # before the handshake
        c.connect(ls.getsockname())
        s, addr = ls.accept()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    th = threading.Thread(target=b._run, args=(b._peer_thread, s, addr), daemon=True)
    th.start()
    try:
        _wire.auth_client(c, b.token, "raw-subscriber", "A")
        assert _wire.recv(c, time.monotonic() + 5)["op"] == "metadata"
        _wire.send(c, {"op": "metadata", "metadata": md64("importer")})
        names = [f"w/{i:02d}" + "x" * 200 for i in range(_push.SUBSCRIPTIONS_PER_PEER_MAX)]
        for i, name in enumerate(names):
            assert _ask(c, {"op": "subscribe", "id": i, "name": name})["op"] == "subscribed"
        assert b.publisher.subscribers() == len(names)
        end = time.monotonic() + 20
        while th.is_alive() and time.monotonic() < end:      # c reads nothing more
            b.publisher._mark(names)
            th.join(0.05)
        assert not th.is_alive(), "the connection's thread still waits on its peer"
        assert b.publisher.subscribers() == 0
        c.settimeout(5)
        while c.recv(1 << 16):          # what was sent, then the end of the connection
            pass
    finally:
        c.close()
        stop_fake_bridge(b)


def test_the_pushes_reader_holds_the_lock_for_at_most_pump_frames():
    """Pushes queued beyond PUMP_FRAMES are read by the next hold of the connection's lock;
    each is handed on with its frame number."""
    b = fake_bridge()
    link = _importer.PeerLink(b, "A", ("192.0.2.1", 1))
    link.sock, peer = socket.socketpair()
    got = []

    class Follow:
        def push(self, f, number):
            got.append((f["generation"], number))

        def lost(self):
            pass
    link.follows["w/p"] = [Follow()]
    n = _importer.PUMP_FRAMES + 10
    try:
        for i in range(n):
            _wire.send(peer, {"op": "changed", "name": "w/p", "generation": i, "created_ns": 1})
        assert link.pump(5.0)
        assert got == [(i, i + 1) for i in range(_importer.PUMP_FRAMES)]
        assert link.pump(5.0)
        assert got == [(i, i + 1) for i in range(n)] and link.frames == n
    finally:
        peer.close()
        link.drop()


def test_the_pushes_reader_survives_what_it_did_not_expect(bridge_log):
    """An exception the pushes' reader did not expect is logged, the connection dropped (the
    follows subscribe again), and the reading goes on."""
    class Link:
        name = "A"
        lock = threading.Lock()
        calls = drops = 0

        def pump(self, timeout):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("injected")
            time.sleep(0.01)
            return True

        def drop(self):
            self.drops += 1
    link, stop = Link(), threading.Event()
    th = threading.Thread(target=_push.pump, args=(link, stop), daemon=True)
    th.start()
    try:
        _wait(lambda: link.calls >= 3, "the reading after the exception")
    finally:
        stop.set()
        th.join(5)
    assert not th.is_alive() and link.drops == 1
    assert any("reading the pushes of peer A" in r.getMessage() for r in bridge_log.records)


def test_the_replica_ledger_is_kept_across_a_restart(tmp_path):
    """With a state file, a restarted bridge's ledger still charges each replica to the uid
    whose fetch made it and refuses another uid's REPLACE (root may); a replica gone from
    dlpackd meanwhile, or replaced there, is dropped at the next fetch (and from the file); a
    drop is kept too."""
    path = str(tmp_path / _replicas.STATE_FILE)
    # a link planted where the bridge writes its new file is removed, never written through
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    os.symlink(victim, f"{path}.{os.getpid()}.new")
    dl = FakeDlpackd()
    led = _replicas.Ledger(BRIDGE_UID, path=path)
    for uid, name, n in ((1000, "A:w/one", 4096), (1001, "A:w/two", 8192),
                         (1002, "A:w/three", 1)):
        led.reserve(dl, uid, name, n)
        led.commit(name, dl.publish(name, None))
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert victim.read_text() == "untouched" and not os.path.islink(path)
    dl.unpublish("A:w/three")
    led.forget("A:w/three")                                    # dropped by its uid

    again = _replicas.Ledger(BRIDGE_UID, path=path)           # the bridge restarted
    assert again.held(1000) == (1, 4096) and again.held(1001) == (1, 8192)
    assert again.held(1002) == (0, 0)
    with pytest.raises(PermissionError, match="uid 1000 fetched"):
        again.reserve(dl, 1001, "A:w/one", 4096)
    again.reserve(dl, 0, "A:w/one", 4096)                      # root may
    again.cancel("A:w/one")
    assert again.droppable("A:w/two", 1001) == dl.entries["A:w/two"][1]

    del dl.entries["A:w/two"]                                  # unpublished meanwhile
    dl.publish("A:w/one", None)                                # replaced by hand meanwhile
    with pytest.raises(PermissionError, match="no record of whose fetch"):
        again.reserve(dl, 1000, "A:w/one", 4096)               # whose it is: not known now
    assert again.held(1001) == (0, 0) and again.held(1000) == (0, 0)
    assert _replicas.Ledger(BRIDGE_UID, path=path).summary() == {}
    again.reserve(dl, 1001, "A:w/two", 8192)                   # gone: free for anyone
    again.cancel("A:w/two")


def test_a_fetch_under_way_when_the_bridge_stopped_keeps_its_replica(tmp_path):
    """The reservation is written before the fetch: a bridge that stopped between the
    REPLACE in dlpackd and the commit gives the replica, at its next start, to the uid whose
    fetch made it; one that stopped before the publish leaves the old record as it was."""
    path = str(tmp_path / _replicas.STATE_FILE)
    dl = FakeDlpackd()
    led = _replicas.Ledger(BRIDGE_UID, path=path)
    led.reserve(dl, 1000, "A:w/x", 10)
    led.commit("A:w/x", dl.publish("A:w/x", None))
    led.reserve(dl, 1000, "A:w/x", 20)
    dl.publish("A:w/x", None)                                  # REPLACEd, then the crash
    led.reserve(dl, 1005, "A:w/new", 30)                       # a first fetch, not published
    again = _replicas.Ledger(BRIDGE_UID, path=path)
    with pytest.raises(PermissionError, match="uid 1000 fetched"):
        again.reserve(dl, 1001, "A:w/x", 20)
    assert again.held(1000) == (1, 20) and again.held(1005) == (0, 0)
    assert again.droppable("A:w/x", 1000) == dl.entries["A:w/x"][1]


def test_the_bridge_s_own_replicas_follow_its_follow_set(tmp_path):
    """A replica --follow made (the bridge's own uid) and no longer followed after a restart is
    no longer charged; one a local caller made is taken over by a --follow added for it."""
    path = str(tmp_path / _replicas.STATE_FILE)
    dl = FakeDlpackd()
    led = _replicas.Ledger(BRIDGE_UID, path=path)
    led.reserve(dl, BRIDGE_UID, "A:w/followed", 1)
    led.commit("A:w/followed", dl.publish("A:w/followed", None))
    led.reserve(dl, 1000, "A:w/users", 1)
    led.commit("A:w/users", dl.publish("A:w/users", None))
    again = _replicas.Ledger(BRIDGE_UID, path=path)
    again.keep_own({"A:w/users"})
    assert again.held(BRIDGE_UID) == (0, 0)
    again.reserve(dl, BRIDGE_UID, "A:w/users", 1)              # the new --follow refreshes it
    again.commit("A:w/users", dl.publish("A:w/users", None))
    assert again.held(1000) == (0, 0) and again.held(BRIDGE_UID) == (1, 1)


@pytest.mark.parametrize("text", [
    "{not json", "[]", '{"version": 2, "live": {}}', '{"version": 1, "live": []}',
    '{"version": 1, "live": {"A:w": [1, 2]}}', '{"version": 1, "live": {"A:w": [1, 2, true]}}',
    '{"version": 1, "live": {"A:w": [1, -2, 3]}}', '{"version": 1, "live": {"nocolon": [1, 2, 3]}}',
    '{"version": 1, "live": {}, "pending": {"A:w": [1, 2, 3]}}', "[" * 100000],
    ids=lambda t: t[:40] if len(t) < 100 else f"{t[:4]}... ({len(t)} characters)")
def test_a_state_file_that_cannot_be_parsed_is_set_aside(tmp_path, text):
    path = tmp_path / _replicas.STATE_FILE
    path.write_text(text)
    path.chmod(0o600)
    led = _replicas.Ledger(BRIDGE_UID, path=str(path))
    assert led.summary() == {}
    assert len(list(tmp_path.glob(_replicas.STATE_FILE + ".bad.*"))) == 1
    assert json.loads(path.read_text())["live"] == {}          # a fresh one written at start


def test_a_state_directory_or_file_others_could_write_stops_the_bridge(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ValueError, match="only it may write"):
        _replicas.Ledger(BRIDGE_UID, path=str(open_dir / _replicas.STATE_FILE))
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    (d / "elsewhere.json").write_text('{"version": 1, "live": {}}')
    os.symlink(d / "elsewhere.json", d / _replicas.STATE_FILE)
    with pytest.raises(OSError):                               # not followed (ELOOP)
        _replicas.Ledger(BRIDGE_UID, path=str(d / _replicas.STATE_FILE))
    os.unlink(d / _replicas.STATE_FILE)
    (d / _replicas.STATE_FILE).write_text('{"version": 1, "live": {}}')
    (d / _replicas.STATE_FILE).chmod(0o644)
    with pytest.raises(ValueError, match="mode 0600"):
        _replicas.Ledger(BRIDGE_UID, path=str(d / _replicas.STATE_FILE))


def test_the_bridge_keeps_its_ledger_in_the_state_dir(tmp_path, monkeypatch):
    """--state-dir reaches the ledger (NIXL faked: only the wiring is looked at)."""
    main = importlib.import_module("dlpack_ipc.bridge.__main__")
    monkeypatch.setattr(_server, "Nixl", lambda *a: FakeNixl())
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    b = _server.Bridge(main._args(["--state-dir", str(state)]), b"t" * 32)
    try:
        assert b.replicas.path == str(state / _replicas.STATE_FILE)
        assert os.path.exists(b.replicas.path)
    finally:
        b.stop.set()


def test_the_state_dir_comes_from_systemd(monkeypatch):
    main = importlib.import_module("dlpack_ipc.bridge.__main__")
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/dlpackd-bridge:/var/lib/other")
    assert main._args([]).state_dir == "/var/lib/dlpackd-bridge"
    assert main._args(["--state-dir", "/tmp/x"]).state_dir == "/tmp/x"
    monkeypatch.delenv("STATE_DIRECTORY")
    assert main._args([]).state_dir is None


# -- device entries: two real bridges (NIXL faked) and the fake CUDA driver -----------------

class GpuHosts(Hosts):
    """One dlpackd; an exporting bridge "A" (--export w/, --staging-max GPU_STAGING_MAX) and an
    importing one "B" (--peer A), both with the fake CUDA driver (tests/fake_cuda), whose
    device pointers are host addresses: the test fills and reads device memory directly. The
    driver's log is self.cuda_log."""

    def __init__(self, dlpackd):
        super().__init__(dlpackd)
        self.cuda_log = self.path("cuda.log")

    def cuda_calls(self, name, what):
        """The fake driver's log lines of what, made by bridge name's process."""
        pid = str(self.procs[name].pid)
        with open(self.cuda_log) as f:
            return [ln.split() for ln in f if ln.split()[:2] == [pid, what]]


# Host memory exporter A of GpuHosts may stage device entries through at once.
GPU_STAGING_MAX = 4 << 20


@pytest.fixture(scope="module")
def gpu_hosts(request):
    dlpackd = os.environ.get("DLPACKD_BIN")
    fake = os.environ.get("FAKE_CUDA_LIB")
    if not dlpackd or not fake or not os.path.exists(fake):
        pytest.fail(f"DLPACKD_BIN={dlpackd!r}, FAKE_CUDA_LIB={fake!r}: ctest sets both (by hand: "
                    "DLPACKD_BIN=build/dlpackd FAKE_CUDA_LIB=build/tests/libfake_cuda.so)",
                    pytrace=False)
    # this process and the bridges it starts (they inherit the environment) use the fake driver
    saved = {k: os.environ.get(k) for k in ("DLPC_CUDA_LIBRARY", "FAKE_CUDA_LOG")}
    os.environ["DLPC_CUDA_LIBRARY"] = fake
    h = GpuHosts(dlpackd)
    os.environ["FAKE_CUDA_LOG"] = h.cuda_log
    failed_before = request.session.testsfailed
    try:
        h.start_bridge("A", "--listen", f"127.0.0.1:{h.port}", "--export", "w/",
                       "--staging-max", str(GPU_STAGING_MAX))
        h.start_bridge("B", "--peer", f"A=127.0.0.1:{h.port}")
        yield h
    finally:
        h.close(request.session.testsfailed != failed_before)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _device_fill(t, seed):
    """Fill t (fake device memory) with bytes from seed; those bytes."""
    import ctypes
    data = bytes((seed + 7 * i) & 0xFF for i in range(256)) * (t.nbytes // 256 + 1)
    data = data[:t.nbytes]
    ctypes.memmove(t.data_ptr, data, t.nbytes)
    return data


def _device_bytes(t):
    import ctypes
    return ctypes.string_at(t.data_ptr, t.nbytes)


def _fetch_b(h, name, timeout=20.0):
    return bridge.fetch(name, timeout, socket=h.path("B.sock"))


def test_a_device_entry_is_fetched_into_a_device_replica(gpu_hosts):
    h = gpu_hosts
    t = h.dl.empty((1 << 20) + 3, "uint8", device="cuda:0")
    want = _device_fill(t, 1)
    gen = h.dl.publish("w/g", t)
    t.release()
    before_a = len(h.cuda_calls("A", "cuMemcpyDtoH"))
    before_b = len(h.cuda_calls("B", "cuMemcpyHtoD"))
    assert _fetch_b(h, "A:w/g") == ("A:w/g", gen)
    r = h.dl.attach("A:w/g", timeout=0)
    try:
        assert r.device == "cuda:0" and r.shape == ((1 << 20) + 3,) and r.dtype == "uint8"
        assert _device_bytes(r) == want
    finally:
        r.release()
    # A copied the entry to the host, B from the host to the device and waited for the copy
    # before publishing
    n = str((1 << 20) + 3)
    assert [ln[2] for ln in h.cuda_calls("A", "cuMemcpyDtoH")[before_a:]] == [f"bytes={n}"]
    assert [ln[2] for ln in h.cuda_calls("B", "cuMemcpyHtoD")[before_b:]] == [f"bytes={n}"]
    with open(h.cuda_log) as f:
        b_calls = [ln.split()[1] for ln in f if ln.split()[0] == str(h.procs["B"].pid)]
    last_copy = len(b_calls) - 1 - b_calls[::-1].index("cuMemcpyHtoD")
    assert "cuCtxSynchronize" in b_calls[last_copy:]
    # what A staged for the lease is given back, and nothing is held
    st = _wait(lambda: (s := h.status("A"))["leases"] == 0 and s, "A's lease given back")
    assert st["staged"] == 0 and st["registered"] == 0
    assert h.status("B")["registered"] == 0


def test_a_device_bundle_is_fetched_into_one_device_bucket(gpu_hosts):
    h = gpu_hosts
    b = h.dl.empty_dict({"w": ((64, 33), "float32"), "b": ((33,), "float32"),
                         "e": ((0,), "int64")}, device="cuda:0")
    want = {k: _device_fill(v, i) for i, (k, v) in enumerate(b.items())}
    gen = h.dl.publish_dict("w/sd", b)
    for v in b.values():
        v.release()
    assert _fetch_b(h, "A:w/sd") == ("A:w/sd", gen)
    got = h.dl.attach_dict("A:w/sd", timeout=0)
    try:
        assert sorted(got) == ["b", "e", "w"]
        assert {k: (v.device, v.shape, v.dtype) for k, v in got.items()} == {
            "w": ("cuda:0", (64, 33), "float32"), "b": ("cuda:0", (33,), "float32"),
            "e": ("cuda:0", (0,), "int64")}
        assert {k: _device_bytes(v) for k, v in got.items()} == want
    finally:
        for v in got.values():
            v.release()
    _wait(lambda: h.status("A")["staged"] == 0, "A's staging given back")


def test_a_device_entry_larger_than_the_staging_is_refused_naming_it(gpu_hosts):
    h = gpu_hosts
    t = h.dl.empty(GPU_STAGING_MAX + 1, "uint8", device="cuda:0")
    h.dl.publish("w/big", t)
    t.release()
    with pytest.raises(OSError, match="--staging-max") as e:
        _fetch_b(h, "A:w/big")
    assert e.value.errno == errno.EFBIG
    with pytest.raises(FileNotFoundError):
        h.dl.attach("A:w/big", timeout=0)
    # nothing held on either side, and the connection still serves
    assert h.status("A")["staged"] == 0 and h.status("A")["leases"] == 0
    import numpy as np
    h.dl.publish("w/host", np.arange(1000, dtype=np.int32), replace=True)
    assert _fetch_b(h, "A:w/host")[0] == "A:w/host"


@pytest.mark.parametrize("device", ["5", "none"])
def test_an_importer_without_the_device_is_refused_before_any_copy(gpu_hosts, device):
    """An importer whose --cuda-device does not exist (or is none) says it takes no device
    entries; the exporter refuses it before copying anything, and the error says why."""
    h = gpu_hosts
    t = h.dl.empty(4096, "uint8", device="cuda:0")
    _device_fill(t, 3)
    h.dl.publish("w/nodev", t, replace=True)
    t.release()
    copies = len(h.cuda_calls("A", "cuMemcpyDtoH"))
    h.start_bridge("C", "--peer", f"A=127.0.0.1:{h.port}", "--cuda-device", device)
    try:
        why = r"cuDeviceGet\(cuda:5\)" if device == "5" else "--cuda-device none"
        with pytest.raises(OSError, match=f"host entries only.*takes no device entries: {why}") \
                as e:
            bridge.fetch("A:w/nodev", 20.0, socket=h.path("C.sock"))
        assert e.value.errno == errno.EOPNOTSUPP
        with pytest.raises(FileNotFoundError):
            h.dl.attach("A:w/nodev", timeout=0)
        assert len(h.cuda_calls("A", "cuMemcpyDtoH")) == copies
        assert h.cuda_calls("C", "cuMemcpyHtoD") == []
        _wait(lambda: h.status("A")["leases"] == 0 and h.status("A")["staged"] == 0,
              "A holds no lease and no staging")
        assert h.status("C")["registered"] == 0 and h.status("C")["replicas"] == {}
        # the same connection still serves host entries
        import numpy as np
        h.dl.publish("w/host2", np.arange(10, dtype=np.int16), replace=True)
        assert bridge.fetch("A:w/host2", 20.0, socket=h.path("C.sock"))[0] == "A:w/host2"
        h.dl.unpublish("A:w/host2")
    finally:
        h.stop("C")


def test_device_entries_go_only_to_importers_that_take_them_one_staged_at_a_time(gpu_hosts):
    h = gpu_hosts
    t = h.dl.empty(8192, "uint8", device="cuda:0")
    want = _device_fill(t, 5)
    h.dl.publish("w/g2", t)
    t.release()
    b = fake_bridge()
    c, s = tcp_pair()
    leases = {}
    try:
        # an older importer says nothing of devices: refused, nothing staged or held
        b._get(s, h.dl, {"op": "get", "id": 1, "name": "w/g2"}, leases, "peer")
        reply = _wire.recv(c, time.monotonic() + 5)
        assert reply["errno"] == "EOPNOTSUPP" and "host entries only" in reply["message"]
        assert leases == {} and b.leases == 0 and b.staging.held == 0
        # one that takes them gets the layout, with the device; the lease holds a host copy
        b._get(s, h.dl, {"op": "get", "id": 2, "name": "w/g2", "devices": ["cuda"]}, leases,
               "peer")
        # first how much it copies to the host, then the layout
        assert _wire.recv(c, time.monotonic() + 5) == {"op": "staging", "id": 2, "bytes": 8192}
        reply = _wire.recv(c, time.monotonic() + 5)
        assert reply["op"] == "layout" and reply["device"] == "cuda:0"
        assert reply["tensors"] == [["", "uint8", [8192], 8192]]
        (lease,) = leases.values()
        assert b.staging.held == 8192 == lease.staged
        import ctypes
        assert ctypes.string_at(lease.tensors[0][1].data_ptr, 8192) == want
        # a second device entry on the same connection waits for the first
        b._get(s, h.dl, {"op": "get", "id": 3, "name": "w/g2", "devices": ["cuda"]}, leases,
               "peer")
        reply = _wire.recv(c, time.monotonic() + 5)
        assert reply["errno"] == "EAGAIN" and "STAGED_PER_CONNECTION" in reply["message"]
        # past --staging-max for all connections together: EAGAIN too, naming it
        b.staging.take(_server.STAGING_MAX - 8192, "another connection's")
        reply = _wire.recv(c, time.monotonic() + 5) if b._get(
            s, h.dl, {"op": "get", "id": 5, "name": "w/g2", "devices": ["cuda"]}, {},
            "peer") is None else None
        assert reply == {"op": "staging", "id": 5, "bytes": 8192}
        reply = _wire.recv(c, time.monotonic() + 5)
        assert reply["errno"] == "EAGAIN" and "--staging-max" in reply["message"]
        b.staging.give(_server.STAGING_MAX - 8192)
        # a malformed devices closes the connection (the caller's FrameError)
        for bad in (5, "cuda", [1], ["x" * 17], ["cuda"] * 9):
            with pytest.raises(_wire.FrameError, match="devices"):
                b._get(s, h.dl, {"op": "get", "id": 6, "name": "w/g2", "devices": bad}, {},
                       "peer")
        assert len(leases) == 1 and b.staging.held == 8192
        # a host entry does not
        import numpy as np
        h.dl.publish("w/h2", np.ones(16, np.float32), replace=True)
        b._get(s, h.dl, {"op": "get", "id": 4, "name": "w/h2", "devices": ["cuda"]}, leases,
               "peer")
        reply = _wire.recv(c, time.monotonic() + 5)
        assert reply["op"] == "layout" and "device" not in reply and len(leases) == 2
        for lid in list(leases):
            b._end(leases.pop(lid), "test")
        assert b.staging.held == 0 and b.leases == 0
    finally:
        for lid in list(leases):
            b._end(leases.pop(lid), "test")
        c.close()
        s.close()
        stop_fake_bridge(b)


def test_a_legacy_ipc_entry_is_copied_after_the_publishers_work(gpu_hosts):
    """cuMemAlloc memory published with an interprocess event (tests/python/test_gpu.py's
    producer, in this process): A's copy to the host is queued on the legacy default stream
    after that stream waits for the event."""
    h = gpu_hosts
    spec = importlib.util.spec_from_file_location(
        "gpu_producer", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                     "test_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ns = {}
    exec(mod.PRODUCER, ns)
    arr = ns["FakeCudaArray"](1000)
    gen = h.dl.publish("w/legacy", arr)
    try:
        assert _fetch_b(h, "A:w/legacy") == ("A:w/legacy", gen)
        r = h.dl.attach("A:w/legacy", timeout=0)
        try:
            import numpy as np
            got = np.frombuffer(_device_bytes(r), np.float32)
            assert r.device == "cuda:0" and (got == np.arange(1000) * 0.5).all()
        finally:
            r.release()
        with open(h.cuda_log) as f:
            a_calls = [ln.split() for ln in f if ln.split()[0] == str(h.procs["A"].pid)]
        copy = max(i for i, ln in enumerate(a_calls) if ln[1:3] == ["cuMemcpyDtoH", "bytes=4000"])
        opened = max(i for i, ln in enumerate(a_calls[:copy]) if ln[1] == "cuIpcOpenMemHandle")
        waits = [ln for ln in a_calls[opened:copy] if ln[1] == "cuStreamWaitEvent"]
        # the legacy default stream is CU_STREAM_LEGACY, 0x1
        assert waits and waits[-1][2] == "stream=0x1", a_calls[:copy]
    finally:
        h.dl.unpublish("w/legacy")
        h.dl.unpublish("A:w/legacy")


# ---- the registry (etcd, --registry) ----------------------------------------------------------

ETCD = shutil.which("etcd")
REGISTRY_TTL = 2            # the exporters' --registry-ttl here: a killed one's record ends soon


class EtcdServer:
    """A real etcd (Debian's etcd-server) on loopback ports of its own, its data in dirname."""

    def __init__(self, dirname):
        if ETCD is None:
            pytest.fail("etcd is not installed (Debian's etcd-server: scripts/dev installs it)",
                        pytrace=False)
        self.dir = dirname
        self.port, peer = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.peer_url = f"http://127.0.0.1:{peer}"
        self.proc = None
        self.client = _registry.Etcd(self.url, timeout=2.0)

    def start(self):
        log = open(os.path.join(self.dir, "etcd.log"), "ab")
        self.proc = subprocess.Popen(
            [ETCD, "--name", "t", "--data-dir", os.path.join(self.dir, "etcd"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
             "--initial-cluster", f"t={self.peer_url}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

        def up():
            try:
                return self.client.call("/v3/kv/range", {"key": "eA=="}) is not None
            except OSError:
                return self.proc.poll() is not None
        _wait(up, "etcd answering", 30)
        assert self.proc.poll() is None, "etcd exited: see etcd.log"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(20)

    def record(self, name):
        v = self.client.get(_registry.record_key(_registry.REGISTRY_PREFIX, name))
        return None if v is None else json.loads(v)


class RegistryHosts(Hosts):
    """Hosts with an etcd: "RA" exports w/ and registers as "ra" (--registry-ttl
    REGISTRY_TTL); "RB" has no --peer and finds peers there."""

    def __init__(self, dlpackd):
        super().__init__(dlpackd)
        self.etcd = EtcdServer(self.tmp)
        self.etcd.start()

    def registered(self, name, port, *extra):
        p = self.start_bridge(name, "--listen", f"127.0.0.1:{port}", "--export", "w/",
                              "--registry", self.etcd.url, "--registry-ttl",
                              str(REGISTRY_TTL), *extra)
        return p

    def close(self, failed):
        super().close(failed)
        if self.etcd.proc and self.etcd.proc.poll() is None:
            self.etcd.stop()


@pytest.fixture(scope="module")
def reg_hosts(request):
    dlpackd = os.environ.get("DLPACKD_BIN")
    if not dlpackd or not os.access(dlpackd, os.X_OK):
        pytest.fail(f"DLPACKD_BIN={dlpackd!r} is not the dlpackd binary", pytrace=False)
    h = RegistryHosts(dlpackd)
    failed_before = request.session.testsfailed
    try:
        h.ra_port = _free_port()
        h.registered("RA", h.ra_port, "--name", "ra", "--registry-names")
        h.start_bridge("RB", "--registry", h.etcd.url)
        _wait(lambda: (h.status("RA")["registry"] or {}).get("registered"), "RA registered",
              10)
        yield h
    finally:
        h.close(request.session.testsfailed != failed_before)
        if request.session.testsfailed != failed_before:
            for name in ("RA", "RB", "RC", "RF"):
                if os.path.exists(h.path(f"{name}.log")):
                    print(f"--- {name}'s log (last lines)\n{h.log(name)}")


def _reg_fetch(h, name, timeout=10.0):
    return bridge.fetch(name, timeout, socket=h.path("RB.sock"))


@contextlib.contextmanager
def _raw_keys(h, items):
    """Keys (key, value bytes) written straight into the module's etcd for the with block,
    deleted after it: no test sees another's."""
    for key, value in items:
        h.etcd.client.call("/v3/kv/put", {"key": _registry._b64(key.encode()),
                                          "value": _registry._b64(value)})
    try:
        yield
    finally:
        for key, _ in items:
            h.etcd.client.call("/v3/kv/deleterange", {"key": _registry._b64(key.encode())})


def test_a_registered_exporter_is_fetched_without_a_peer_option(reg_hosts):
    import numpy as np
    h = reg_hosts
    rec = h.etcd.record("ra")
    assert rec["addr"] == f"127.0.0.1:{h.ra_port}" and rec["exports"] == ["w/"]
    assert rec["agent"] == h.status("RA")["agent"]
    h.dl.publish("w/r", np.arange(1 << 16, dtype=np.uint32), replace=True)
    local, gen = _reg_fetch(h, "ra:w/r")
    t = h.dl.attach(local)
    try:
        assert local == "ra:w/r" and np.array_equal(np.asarray(t), np.arange(1 << 16))
    finally:
        t.release()
    st = h.status("RB")["registry"]
    assert st["found"] == {"ra": True} and st["registered"] is None and st["url"] == h.etcd.url


def test_a_name_nobody_registered_is_not_found_naming_the_registry(reg_hosts):
    with pytest.raises(FileNotFoundError) as e:
        _reg_fetch(reg_hosts, "nobody:w/r")
    assert "'nobody'" in str(e.value) and reg_hosts.etcd.url in str(e.value)
    assert "nobody" not in reg_hosts.status("RB")["registry"]["found"]


def test_a_stopped_exporter_revokes_its_record_and_a_killed_ones_ends_with_its_lease(reg_hosts):
    h = reg_hosts
    for how in ("stop", "kill"):
        port = _free_port()
        p = h.registered("RC", port, "--name", "rc")
        _wait(lambda: h.etcd.record("rc"), "rc registered", 10)
        assert h.etcd.record("rc")["addr"] == f"127.0.0.1:{port}"
        if how == "stop":
            h.stop("RC")
            # revoked on the way out: gone before its TTL could have ended it
            assert h.etcd.record("rc") is None
        else:
            p.kill()
            p.wait()
            h.procs.pop("RC")
            assert h.etcd.record("rc") is not None, "a killed bridge cannot revoke its lease"
            _wait(lambda: h.etcd.record("rc") is None, "the killed bridge's record ended",
                  REGISTRY_TTL + 5)
        with pytest.raises(FileNotFoundError):
            _reg_fetch(h, "rc:w/r")


def test_a_name_a_live_bridge_holds_is_not_taken_over(reg_hosts):
    h = reg_hosts
    held = h.etcd.record("ra")
    h.registered("RC", _free_port(), "--name", "ra")
    try:
        _wait(lambda: "held by another bridge" in h.log("RC"), "RC sees ra held", 10)
        assert h.status("RC")["registry"]["registered"] is False
        assert h.etcd.record("ra") == held
    finally:
        h.stop("RC")
    assert h.etcd.record("ra") == held, "the bridge that did not hold the record left it"


def test_a_record_that_is_not_a_bridges_is_a_protocol_error(reg_hosts):
    h = reg_hosts
    for name, value in (("bad1", b"not json"), ("bad2", b'{"addr": "no port"}'),
                        ("bad3", b'["127.0.0.1:1"]'),
                        ("bad4", b'{"addr": "127.0.0.1:1", "pad": "' + b"x" * 5000 + b'"}'),
                        ("bad5", b"[" * 2000 + b"]" * 2000)):            # nested too deep
        key = _registry.record_key(_registry.REGISTRY_PREFIX, name)
        with _raw_keys(h, [(key, value)]):
            with pytest.raises(OSError) as e:
                _reg_fetch(h, f"{name}:w/r")
        assert e.value.errno == errno.EPROTO and key in str(e.value), (name, e.value)
    assert h.procs["RB"].poll() is None


class FakeEtcd:
    """An HTTP server on loopback that answers every request with what answer() returns:
    (status line, headers, body) bytes."""

    def __init__(self, answer):
        self.answer = answer
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.srv.getsockname()[1]}"
        self.th = threading.Thread(target=self._serve, daemon=True)
        self.th.start()

    def _serve(self):
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            with c:
                c.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += c.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                n = int(next((line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")), b"0"))
                while len(body) < n:
                    body += c.recv(65536)
                status, headers, out = self.answer()
                c.sendall(status + b"\r\n" + headers + b"Content-Length: " +
                          str(len(out)).encode() + b"\r\nConnection: close\r\n\r\n" + out)

    def close(self):
        self.srv.close()


@pytest.mark.parametrize("answer", [
    (b"HTTP/1.1 abc", b"", b"{}"),                                  # not a status line
    (b"HTTP/1.1 200 OK", b"", b'{"kvs": 5}'),                       # kvs not a list
    (b"HTTP/1.1 200 OK", b"", b'{"kvs": [5]}'),
    (b"HTTP/1.1 200 OK", b"", b"[" * 100000 + b"]" * 100000),       # nested past recursion
    (b"HTTP/1.1 500 Oops", b"", b"{" * 100000),
    (b"HTTP/1.1 200 OK", b"", b"x" * (_registry.ANSWER_MAX + 10)),
    (b"HTTP/1.1 302 Found", b"Location: http://127.0.0.1:9/elsewhere\r\n", b""),
    (b"HTTP/1.1 200 OK", b"", b'{"error": {"grpc_code": 14, "message": "no leader"}}'),
], ids=["status", "kvs-int", "kvs-item", "deep", "deep-error", "big", "redirect", "error"])
def test_a_malformed_answer_from_the_registry_is_a_protocol_error(answer):
    srv = FakeEtcd(lambda: answer)
    try:
        e = _registry.Etcd(srv.url, timeout=5)
        for call in (lambda: _registry.lookup(e, _registry.REGISTRY_PREFIX, "x"),
                     lambda: _registry.holders(e, _registry.REGISTRY_PREFIX, "w/x"),
                     lambda: e.keepalive("1")):
            with pytest.raises(OSError) as err:
                call()
            assert srv.url in str(err.value)
            assert type(err.value) in (OSError, PermissionError) and \
                err.value.errno in (errno.EPROTO, errno.EACCES), err.value
    finally:
        srv.close()


def test_only_etcds_own_credential_errors_are_permission_errors():
    for msg, cls in (("etcdserver: invalid auth token", PermissionError),
                     ("etcdserver: permission denied", PermissionError),
                     ("proxy: no route for /v3/auth/authenticate", OSError),
                     ("the author field is wrong", OSError)):
        with pytest.raises(OSError) as e:
            _registry._refused("http://x", 400, 3, msg)
        assert type(e.value) is cls, msg


def test_a_keepalive_error_is_not_taken_for_a_lost_lease():
    """An error etcd answers a renewal with (no leader during an election) is an error, not
    the end of the lease: the record is not written on a new lease meanwhile."""
    srv = FakeEtcd(lambda: (b"HTTP/1.1 200 OK", b"",
                            b'{"error": {"grpc_code": 14, "message": "etcdserver: no leader"}}'))
    try:
        r = _registry.Registration(_registry.Etcd(srv.url, timeout=5), _registry.REGISTRY_PREFIX,
                                   "k", {"addr": "h:1"}, 10, threading.Event())
        r.lease, r.registered = "7", True
        with pytest.raises(OSError, match="no leader"):
            r._step()
        assert r.lease == "7"
    finally:
        srv.close()


def test_the_registry_restarted_the_bridge_registers_again_and_fetches_resume(reg_hosts):
    import numpy as np
    h = reg_hosts
    h.dl.publish("w/r", np.full(4096, 6, np.uint8), replace=True)
    _reg_fetch(h, "ra:w/r")             # the link to ra is up
    h.etcd.stop()
    try:
        _wait(lambda: not h.status("RA")["registry"]["registered"], "RA sees etcd gone",
              REGISTRY_TTL + 10)
        with pytest.raises(ConnectionError) as e:
            _reg_fetch(h, "elsewhere:w/r")
        assert h.etcd.url in str(e.value)
        # a link that is connected is used without the registry
        h.dl.publish("w/r", np.full(4096, 7, np.uint8), replace=True)
        local, _ = _reg_fetch(h, "ra:w/r")
        t = h.dl.attach(local)
        try:
            assert np.all(np.asarray(t) == 7)
        finally:
            t.release()
    finally:
        h.etcd.start()
    _wait(lambda: h.status("RA")["registry"]["registered"], "RA registered again", 15)
    assert h.etcd.record("ra")["addr"] == f"127.0.0.1:{h.ra_port}"
    # and the names' keys are there (--registry-names; the lease survived the restart)
    _wait(lambda: _holders(h, "w/r") == ["ra"], "w/r's key written again", 10)


def test_the_registry_options_are_checked_at_start(reg_hosts, tmp_path):
    h = reg_hosts
    base = [sys.executable, FAKE_NIXL, "--socket", str(tmp_path / "x.sock"),
            "--dlpackd-socket", h.dlpackd_sock, "--token-file", h.token]
    for extra, rc, says in (
            (["--registry", h.etcd.url, "--name", "a:b"], 2, "--name"),
            (["--registry", h.etcd.url, "--registry-ttl", "1"], 2, "--registry-ttl"),
            (["--advertise", "127.0.0.1:1"], 2, "--advertise needs --registry"),
            (["--registry", h.etcd.url, "--name", "*"], 2, "--name"),
            (["--registry", h.etcd.url, "--registry-names"], 2, "--registry-names needs"),
            (["--registry", h.etcd.url, "--name", "x"], 2, "--name needs --listen"),
            (["--peer", "*=127.0.0.1:1"], 1, "not '*'"),
            (["--registry", "ftp://x"], 1, "is not http"),
            (["--registry", h.etcd.url, "--listen", "0.0.0.0:0"], 1, "--advertise"),
            (["--registry", h.etcd.url, "--registry-auth-file", str(tmp_path / "none")], 1,
             "No such file")):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=30)
        assert r.returncode == rc and says in r.stderr, (extra, r.returncode, r.stderr[-500:])


def _found_by(etcd):
    """A fake bridge with no --peer that finds its peers through the etcd client etcd."""
    b = fake_bridge()
    b.peers = {}
    b.registry, b.registry_prefix = etcd, _registry.REGISTRY_PREFIX
    return b


def test_peers_found_in_the_registry_are_bounded(reg_hosts, monkeypatch):
    h = reg_hosts
    b = _found_by(h.etcd.client)
    monkeypatch.setattr(_registry, "FOUND_PEERS_MAX", 2)
    keys = [(_registry.record_key(_registry.REGISTRY_PREFIX, f"many{i}"),
             b'{"addr": "127.0.0.1:9"}') for i in range(3)]
    try:
        with _raw_keys(h, keys):
            links = [b._peer("many0"), b._peer("many1")]
            assert [ln.addr for ln in links] == [("127.0.0.1", 9)] * 2
            for ln in links:            # both in use: a fetch under way holds the lock
                ln.lock.acquire()
            with pytest.raises(BlockingIOError) as e:
                b._peer("many2")
            assert "FOUND_PEERS_MAX" in str(e.value) and len(b.found) == 2
            links[0].lock.release()     # one idle: it makes room
            assert b._peer("many2").addr == ("127.0.0.1", 9)
            assert set(b.found) == {"many1", "many2"}
            links[1].lock.release()
            # a link a --follow uses is never the one forgotten, idle as it may be
            b.found["many2"].follows = {"w/x": []}
            assert b._peer("many0").addr == ("127.0.0.1", 9)
            assert set(b.found) == {"many0", "many2"}
    finally:
        stop_fake_bridge(b)


def test_a_found_peer_is_looked_up_within_the_fetch_s_deadline_and_not_twice_at_once(
        monkeypatch):
    """_resolve, before a connection to a peer found in the registry: the lookup's timeout is
    at most what is left of the deadline, a deadline already past is ETIMEDOUT without a
    lookup, a lookup within LOOKUP_FRESH is not repeated, and a peer no longer registered is
    NotRegistered (ENOENT, a ConnectionError: a --follow keeps its replica)."""
    b = _found_by(_registry.Etcd("http://127.0.0.1:9", timeout=5.0))
    asked = []

    def lookup(etcd, prefix, name, timeout=None):
        asked.append(timeout)
        if name == "gone":
            raise FileNotFoundError(errno.ENOENT, f"no peer {name!r} is registered")
        return ("127.0.0.1", 7)
    monkeypatch.setattr(_registry, "lookup", lookup)
    try:
        link = _importer.PeerLink(b, "p", None, b._resolve)
        b._resolve(link, time.monotonic() + 0.5)
        assert link.addr == ("127.0.0.1", 7) and link.where == "127.0.0.1:7"
        assert len(asked) == 1 and 0 < asked[0] <= 0.5
        b._resolve(link, None)                  # looked up just now: not again
        assert len(asked) == 1
        link.looked_up -= _registry.LOOKUP_FRESH
        b._resolve(link, None)
        assert asked[1:] == [5.0]
        link.looked_up = None
        with pytest.raises(TimeoutError):
            b._resolve(link, time.monotonic() - 1)
        assert len(asked) == 2
        gone = _importer.PeerLink(b, "gone", ("127.0.0.1", 7), b._resolve)
        with pytest.raises(_registry.NotRegistered) as e:
            b._resolve(gone, None)
        assert e.value.errno == errno.ENOENT and not isinstance(e.value, FileNotFoundError)
    finally:
        stop_fake_bridge(b)


def test_a_link_forgotten_while_a_fetch_held_it_is_asked_for_again(reg_hosts, monkeypatch):
    h = reg_hosts
    b = _found_by(h.etcd.client)
    monkeypatch.setattr(_registry, "FOUND_PEERS_MAX", 1)
    keys = [(_registry.record_key(_registry.REGISTRY_PREFIX, f"gone{i}"),
             json.dumps({"addr": f"127.0.0.1:{_free_port()}"}).encode()) for i in range(2)]
    try:
        with _raw_keys(h, keys):
            old = b._peer("gone0")
            b._peer("gone1")            # makes room: gone0's idle link is forgotten
            assert old.forgotten and "gone0" not in b.found
            with pytest.raises(_importer.Forgotten):
                old.fetch(FakeDlpackd(), "w/x", "gone0:w/x", time.monotonic() + 5, 1000)
            # the fetch that got it asks for a link again, and so reaches the peer (refused)
            r = b._fetch(FakeDlpackd(), {"op": "fetch", "name": "gone0:w/x"}, 1000, 4242)
            assert r["errno"] == "ECONNREFUSED" and b.found["gone0"] is not old
    finally:
        stop_fake_bridge(b)


def test_a_follow_of_a_registered_bridge_waits_for_it_keeps_the_replica_and_finds_it_moved(
        reg_hosts):
    """--follow rf:w/f with no --peer rf: the follower finds rf in the registry once rf
    registers, keeps its replica while rf is away (its record revoked), and reaches rf again
    at the new address it registers from."""
    import numpy as np
    h = reg_hosts
    unregistered = "no peer 'rf' is configured (--peer) or registered"
    h.start_bridge("RF", "--registry", h.etcd.url, "--follow", "rf:w/f",
                   "--follow-interval", "0.2")
    try:
        _wait(lambda: unregistered in h.log("RF", None), "RF finds no rf registered", 10)
        assert h.status("RF")["follows"]["rf:w/f"] == {"subscribed": False, "generation": None}
        g1 = h.dl.publish("w/f", np.full(4096, 1, np.uint8), replace=True)
        h.registered("RC", _free_port(), "--name", "rf")

        def replicated(value, gen):
            r = h.replica("rf:w/f")
            return r is not None and bool((r == value).all()) and \
                h.status("RF")["follows"]["rf:w/f"] == {"subscribed": True, "generation": gen}
        _wait(lambda: replicated(1, g1), "rf's w/f followed", 20)
        assert h.status("RF")["registry"]["found"] == {"rf": True}
        # away: its record is revoked as it stops; the follower keeps what it holds
        h.stop("RC")
        before = h.log("RF", None).count(unregistered)
        _wait(lambda: h.log("RF", None).count(unregistered) >= before + 2 or
              h.replica("rf:w/f") is None,
              "RF tries rf again and finds it unregistered", 15)
        held = h.replica("rf:w/f")
        assert held is not None and (held == 1).all(), "the replica went with rf's record"
        # to a local caller, a peer that is no longer registered is not found, naming etcd
        with pytest.raises(FileNotFoundError) as e:
            bridge.fetch("rf:w/other", 5.0, socket=h.path("RF.sock"))
        assert unregistered in str(e.value) and h.etcd.url in str(e.value)
        assert h.status("RF")["follows"]["rf:w/f"]["generation"] == g1
        # back, from another port: found there, and followed again
        h.registered("RC", _free_port(), "--name", "rf")
        g2 = h.dl.publish("w/f", np.full(4096, 2, np.uint8), replace=True)
        _wait(lambda: replicated(2, g2), "rf's w/f followed at its new address", 20)
        assert "peer rf moved from 127.0.0.1:" in h.log("RF", None)
    finally:
        for name in ("RC", "RF"):
            if name in h.procs:
                h.stop(name)
        for name in ("w/f", "rf:w/f"):
            try:
                h.dl.unpublish(name)
            except FileNotFoundError:
                pass


def test_a_record_deleted_by_hand_is_written_again_with_the_names_keys(reg_hosts):
    import numpy as np
    h = reg_hosts
    h.dl.publish("w/del", np.zeros(8, np.uint8), replace=True)
    _wait(lambda: _holders(h, "w/del") == ["ra"], "w/del's key", 10)
    p = _registry.REGISTRY_PREFIX.encode()
    h.etcd.client.call("/v3/kv/deleterange", {"key": _registry._b64(p),
                                              "range_end": _registry._b64(_registry._after(p))})
    _wait(lambda: h.etcd.record("ra"), "ra's record written again", REGISTRY_TTL + 10)
    _wait(lambda: _holders(h, "w/del") == ["ra"], "w/del's key written again", 10)
    h.dl.unpublish("w/del")


def test_a_lease_revoked_under_the_bridge_is_replaced_and_everything_written_again(reg_hosts):
    import numpy as np
    h = reg_hosts
    h.dl.publish("w/lease", np.zeros(8, np.uint8), replace=True)
    _wait(lambda: _holders(h, "w/lease") == ["ra"], "w/lease's key", 10)
    key = _registry.record_key(_registry.REGISTRY_PREFIX, "ra")
    kv = h.etcd.client.call("/v3/kv/range", {"key": _registry._b64(key.encode())})["kvs"][0]
    h.etcd.client.revoke(kv["lease"])
    assert h.etcd.record("ra") is None and _holders(h, "w/lease") == []
    _wait(lambda: h.etcd.record("ra"), "ra's record written again", REGISTRY_TTL + 10)
    _wait(lambda: _holders(h, "w/lease") == ["ra"], "w/lease's key written again", 10)
    kv2 = h.etcd.client.call("/v3/kv/range", {"key": _registry._b64(key.encode())})["kvs"][0]
    assert kv2["lease"] != kv["lease"]
    assert "writing the record again" in h.log("RA")
    h.dl.unpublish("w/lease")


def test_holders_that_are_not_bridge_names_are_passed_over_and_so_is_itself(reg_hosts):
    h = reg_hosts
    under = _registry.holders_prefix(_registry.REGISTRY_PREFIX, "w/odd")
    with _raw_keys(h, [(under + n, b"{}") for n in ("q:x", "*", "", "ok")]):
        assert _holders(h, "w/odd") == ["ok"]
    b = _found_by(h.etcd.client)
    b.registration = _registry.Registration(h.etcd.client, _registry.REGISTRY_PREFIX, "self",
                                            {"addr": "127.0.0.1:9"}, 10, b.stop)
    try:
        with _raw_keys(h, [(under + "self", b"{}")]):
            r = b._fetch(FakeDlpackd(), {"op": "fetch", "name": "*:w/odd"}, 1000, 4242)
            assert r["errno"] == "ENOENT" and "no bridge holds" in r["message"]
    finally:
        stop_fake_bridge(b)


def test_a_fetch_of_any_host_tries_at_most_holders_tried_max(reg_hosts):
    import numpy as np
    h = reg_hosts
    h.dl.publish("w/try", np.ones(8, np.uint8), replace=True)
    _wait(lambda: _holders(h, "w/try") == ["ra"], "w/try's key", 10)
    under = _registry.holders_prefix(_registry.REGISTRY_PREFIX, "w/try")
    dead = [f"a{i}" for i in range(_registry.HOLDERS_TRIED_MAX)]
    keys = [(under + d, b"{}") for d in dead] + [
        (_registry.record_key(_registry.REGISTRY_PREFIX, d),
         json.dumps({"addr": f"127.0.0.1:{_free_port()}"}).encode()) for d in dead]
    h.start_bridge("RE", "--registry", h.etcd.url)
    try:
        with _raw_keys(h, keys):
            with pytest.raises(ConnectionError):
                bridge.fetch("*:w/try", 10.0, socket=h.path("RE.sock"))
            assert h.log("RE").count("trying the next bridge") == len(dead) - 1
        local, _ = bridge.fetch("*:w/try", 10.0, socket=h.path("RE.sock"))
        assert local == "ra:w/try"
    finally:
        h.stop("RE")
        h.dl.unpublish("w/try")


def test_a_registry_with_authentication_takes_only_the_bridges_credentials(tmp_path):
    etcd = EtcdServer(str(tmp_path))
    etcd.start()
    try:
        ctl = [shutil.which("etcdctl") or "etcdctl", "--endpoints", etcd.url]
        env = {**os.environ, "ETCDCTL_API": "3"}
        for cmd in (["user", "add", "root:rootpw"], ["user", "add", "bridge:bridgepw"],
                    ["role", "add", "bridges"],
                    ["role", "grant-permission", "bridges", "--prefix=true", "readwrite",
                     _registry.REGISTRY_PREFIX],
                    ["user", "grant-role", "bridge", "bridges"], ["auth", "enable"]):
            subprocess.run(ctl + cmd, check=True, capture_output=True, env=env, timeout=30)
        creds = tmp_path / "creds"
        creds.write_text("bridge:bridgepw\n")
        creds.chmod(0o644)
        with pytest.raises(PermissionError, match="chmod 600"):
            _registry.read_auth(str(creds))
        creds.chmod(0o600)
        good = _registry.Etcd(etcd.url, _registry.read_auth(str(creds)))
        stop = threading.Event()
        r = _registry.Registration(good, _registry.REGISTRY_PREFIX, "authd",
                                   {"addr": "127.0.0.1:9"}, REGISTRY_TTL, stop)
        assert r._step() > 0 and r.registered
        good._token = "expired"          # etcd's tokens expire: authenticated again
        assert _registry.lookup(good, _registry.REGISTRY_PREFIX, "authd") == ("127.0.0.1", 9)
        with pytest.raises(PermissionError) as e:
            _registry.lookup(etcd.client, _registry.REGISTRY_PREFIX, "authd")
        assert etcd.url in str(e.value)
        wrong = _registry.Etcd(etcd.url, ("bridge", "wrong"))
        with pytest.raises(PermissionError):
            wrong.get("x")
        r.close()
        assert good.get(_registry.record_key(_registry.REGISTRY_PREFIX, "authd")) is None
    finally:
        etcd.stop()


def _holders(h, name):
    return _registry.holders(h.etcd.client, _registry.REGISTRY_PREFIX, name)


def test_a_name_is_fetched_from_whichever_bridge_holds_it(reg_hosts):
    import numpy as np
    h = reg_hosts
    x = np.arange(1 << 14, dtype=np.uint16)
    h.dl.publish("w/any", x, replace=True)
    h.dl.publish("w/any2/sub", x, replace=True)     # its key is not under w/any's
    h.dl.publish("elsewhere/any", x, replace=True)  # not exported: not written
    _wait(lambda: _holders(h, "w/any") == ["ra"], "ra holds w/any in the registry", 10)
    local, _ = _reg_fetch(h, "*:w/any")
    t = h.dl.attach(local)
    try:
        assert local == "ra:w/any" and np.array_equal(np.asarray(t), x)
    finally:
        t.release()
    assert _holders(h, "w/any2") == [] and _holders(h, "elsewhere/any") == []
    assert _holders(h, "w/any2/sub") == ["ra"]
    # a holder that cannot serve it (its bridge is gone) is passed over for the next
    dead = _free_port()
    stale = [(_registry.holders_prefix(_registry.REGISTRY_PREFIX, "w/any") + "aa",
              b'{"host": "aa"}'),
             (_registry.record_key(_registry.REGISTRY_PREFIX, "aa"),
              json.dumps({"addr": f"127.0.0.1:{dead}"}).encode())]
    with _raw_keys(h, stale):
        _any_holders_in_order(h, x, dead)
    h.dl.unpublish("w/any")
    _wait(lambda: "ra" not in _holders(h, "w/any"), "w/any's key gone with the name", 10)
    with pytest.raises(FileNotFoundError) as e:
        _reg_fetch(h, "*:w/any")
    assert "no bridge holds 'w/any'" in str(e.value) and h.etcd.url in str(e.value)
    assert h.status("RA")["registry"]["names"] >= 1


def _any_holders_in_order(h, x, dead):
    import numpy as np
    assert _holders(h, "w/any") == ["aa", "ra"]
    h.dl.publish("w/any", x + 1, replace=True)
    # a bridge connected to neither tries them in the registry's order
    h.start_bridge("RD", "--registry", h.etcd.url)
    try:
        local, _ = bridge.fetch("*:w/any", 10.0, socket=h.path("RD.sock"))
        t = h.dl.attach(local)
        try:
            assert local == "ra:w/any" and np.array_equal(np.asarray(t), x + 1)
        finally:
            t.release()
        assert f"127.0.0.1:{dead}" in h.log("RD") and "trying the next bridge" in h.log("RD")
        # RB, connected to ra, asks ra first
        local, _ = _reg_fetch(h, "*:w/any")
        assert local == "ra:w/any" and "aa" not in h.status("RB")["registry"]["found"]
    finally:
        h.stop("RD")


def test_names_past_one_request_are_written_and_deleted_in_batches(reg_hosts):
    import numpy as np
    h = reg_hosts
    n = _registry.TXN_OPS_MAX * 2 + 10
    names_ = _registry.REGISTRY_PREFIX + "names/"

    def written():
        return sum(k.endswith("/ra") for k in h.etcd.client.keys(names_, 100000))
    before = written()
    for i in range(n):
        h.dl.publish(f"w/batch/{i}", np.zeros(4, np.uint8), replace=True)
    _wait(lambda: written() == before + n, f"{n} more keys written", 20)
    for i in range(n):
        h.dl.unpublish(f"w/batch/{i}")
    _wait(lambda: written() == before, "their keys deleted", 20)


def test_any_host_needs_a_registry():
    b = fake_bridge()
    b.peers = {}
    try:
        r = b._fetch(FakeDlpackd(), {"op": "fetch", "name": "*:w/x"}, 1000, 4242)
        assert r["errno"] == "ENOENT" and "--registry" in r["message"]
    finally:
        stop_fake_bridge(b)


def test_the_names_written_are_bounded(monkeypatch, bridge_log):
    monkeypatch.setattr(_registry, "NAMES_MAX", 2)
    r = _registry.Registration(None, _registry.REGISTRY_PREFIX, "n", {"addr": "h:1"}, 10,
                               threading.Event(), names=lambda n: True)
    r.set_names(["a", "b", "c"])
    r.name_changed("d", True)
    r.name_changed("a", False)
    r.name_changed("e", True)
    assert r._names == {"b", "e"}
    assert sum("NAMES_MAX" in m for m in bridge_log.messages) == 1


# -- strangers and misbehaving token holders: real bridges (NIXL faked) on a real dlpackd ------

# H's limits (FAKE_NIXL_CONSTANTS), small enough for a test to reach; the others are the
# bridge's own
H_LIMITS = {"_server.CLIENT_IDLE_TIMEOUT": 5, "_server.REFUSED_LOG_INTERVAL": 1,
            "_server.LEASE_BYTES_PER_CONNECTION_MAX": 1 << 20,
            "_server.LEASE_BYTES_MAX": 3 << 20}


class Guarded(Hosts):
    """One dlpackd and two exporting bridges (--export w/): "H" with H_LIMITS and a local socket
    any uid may reach, and "S" with a lease TTL of 1 s whose WRITEs stay in progress until
    the file self.gate exists (FAKE_NIXL_WRITE_GATE)."""

    def __init__(self, dlpackd):
        super().__init__(dlpackd)
        os.chmod(self.tmp, 0o755)           # uids other than root reach H's socket
        self.gate = self.path("write-gate")
        self.start_bridge("H", "--listen", f"127.0.0.1:{self.port}", "--export", "w/",
                          "--socket-mode", "0666",
                          env={"FAKE_NIXL_CONSTANTS": json.dumps(H_LIMITS)})
        self.sport = _free_port()
        self.start_bridge("S", "--listen", f"127.0.0.1:{self.sport}", "--export", "w/",
                          "--lease-ttl", "1", env={"FAKE_NIXL_WRITE_GATE": self.gate})


@pytest.fixture(scope="module")
def guarded(request):
    with _closed_after(request, Guarded(_dlpackd_bin())) as h:
        yield h


def _raw_peer(h, port, me, agent=None, source="127.0.0.1"):
    """A peer connection to the bridge on port from source, authenticated as me, NIXL metadata
    exchanged (agent: the fake agent it names, by default one of this process's, named me)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10,
                                    source_address=(source, 0))
    with open(h.token, "rb") as f:
        token = f.read().strip()
    _wire.auth_client(sock, token, me, "H")
    assert _wire.recv(sock, time.monotonic() + 10)["op"] == "metadata"
    agent = agent or f"fake/{os.getpid()}/{me}"
    _wire.send(sock, {"op": "metadata", "metadata": md64(agent)})
    return sock


def _put(sock, layout, buf, agent):
    """Send the put of layout's lease into the numpy array buf, this process's memory, as the
    fake agent agent; the exporter's answer."""
    _wire.send(sock, {"op": "put", "id": 2, "lease": layout["lease"],
                      "metadata": md64(agent, PARTIAL),
                      "descs": [[buf.ctypes.data, buf.nbytes]]})
    return _wire.recv(sock, time.monotonic() + 30)


def _no_leases(h, name="H"):
    _wait(lambda: h.status(name)["leases"] == 0, f"{name}'s leases of earlier tests ended")


def _ends(sock, timeout):
    """The error frames sock reads until the bridge closes it (AssertionError if it does not
    within timeout seconds)."""
    frames = []
    end = time.monotonic() + timeout
    while True:
        try:
            frames.append(_wire.recv(sock, end))
        except ConnectionError:
            return frames
        except TimeoutError:
            raise AssertionError(f"the bridge kept the connection past {timeout:g} s "
                                 f"({frames})") from None


def test_strangers_that_never_authenticate_keep_no_peer_out(guarded):
    """PEERS_MAX idle connections from one address, and UNAUTH_PER_ADDR_MAX from each of ten
    more (past UNAUTH_MAX): a peer with the token, from the first address, gets in and is served
    meanwhile; the strangers dropped to make room are told why, naming the limit, and every one
    of them is closed (within AUTH_DEADLINE, asserted with a generous bound) and counted as
    refused."""
    h = guarded
    before = h.status("H")["refused"]
    held = [socket.create_connection(("127.0.0.1", h.port), timeout=10)
            for _ in range(_server.PEERS_MAX)]
    for i in range(10):
        held += [socket.create_connection(("127.0.0.1", h.port), timeout=10,
                                          source_address=(f"127.0.1.{i + 1}", 0))
                 for _ in range(_server.UNAUTH_PER_ADDR_MAX)]
    # the peer's own address has UNAUTH_PER_ADDR_MAX strangers authenticating as it connects
    held += [socket.create_connection(("127.0.0.1", h.port), timeout=10)
             for _ in range(_server.UNAUTH_PER_ADDR_MAX)]
    try:
        sock = _raw_peer(h, h.port, "legit")
        try:
            r = _ask(sock, {"op": "stat", "id": 1, "name": "w/nothing"})
            assert r["op"] == "error" and r["errno"] == "ENOENT", r
        finally:
            sock.close()
        said = [f for c in held for f in _ends(c, _server.AUTH_DEADLINE + 30)]
    finally:
        for c in held:
            c.close()
    assert all(f["errno"] == "EAGAIN" for f in said), said
    per_addr = [f["message"] for f in said if "UNAUTH_PER_ADDR_MAX" in f["message"]]
    assert len(per_addr) >= _server.PEERS_MAX - 2 * _server.UNAUTH_PER_ADDR_MAX, said
    n = _server.UNAUTH_PER_ADDR_MAX
    assert per_addr[0] == (f"dropped before it authenticated: {n} other connections from "
                           f"127.0.0.1 came (UNAUTH_PER_ADDR_MAX {n}): try again")
    assert any(f"(UNAUTH_MAX {_server.UNAUTH_MAX})" in f["message"] for f in said), said
    _wait(lambda: h.status("H")["refused"] - before == len(held),
          "every stranger counted as refused")


def test_refused_connections_are_summed_up_in_the_log(guarded):
    """Fifty malformed hellos from one address: each is answered and closed, and the log says
    so in a few lines (one at once, then one a REFUSED_LOG_INTERVAL, 1 s here) that count all
    fifty, by address."""
    h = guarded
    # earlier refusals summed up first (with more than REFUSED_LOG_SOURCES sources in one
    # interval, this test's would be counted among "other sources"): nothing new for 3 s, two
    # intervals and a housekeeping tick
    since = [0.0, None]

    def settled():
        now = (h.status("H")["refused"], h.log("H", None).count("refus"))
        if now != since[1]:
            since[:] = [time.monotonic(), now]
        return time.monotonic() - since[0] > 3
    _wait(settled, "H's refusals logged", timeout=60)
    n = 50
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", h.port), timeout=10,
                                     source_address=("127.0.0.7", 0))
        try:
            c.sendall(struct.pack(">I", 5) + b"{nope")
            assert [f["errno"] for f in _ends(c, 30)] == ["EPROTO"]
        finally:
            c.close()

    def logged():
        lines = [ln for ln in h.log("H", None).splitlines() if "127.0.0.7" in ln]
        once = sum("refusing a peer from 127.0.0.7: " in ln for ln in lines)
        summed = sum(int(k) for ln in lines
                     for k in re.findall(r"(\d+) peers from 127\.0\.0\.7", ln))
        return once + summed == n and lines
    lines = _wait(logged, f"H's log counting the {n} refusals", timeout=30)
    assert len(lines) < 10, lines


def test_a_lease_maps_nothing_until_its_write(guarded):
    """A get attaches the entry without mapping its pages (the exporter's RssShmem does not
    grow by the entry), and the put then writes it whole."""
    import numpy as np
    h = guarded
    _no_leases(h)
    n = 32 << 20
    h.dl.publish("w/populate", np.full(n, 7, np.uint8), replace=True)
    pid = h.procs["H"].pid

    def rss_shmem():
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) << 10 for ln in f if ln.startswith("RssShmem:"))
    agent = f"fake/{os.getpid()}/populate"
    sock = _raw_peer(h, h.port, "populate", agent)
    try:
        before = rss_shmem()
        layout = _ask(sock, {"op": "get", "id": 1, "name": "w/populate"})
        assert layout["op"] == "layout", layout
        grown = rss_shmem() - before
        assert grown < n // 4, f"a lease mapped {grown} bytes of its {n}-byte entry"
        buf = np.zeros(n, np.uint8)
        assert _put(sock, layout, buf, agent)["op"] == "done"
        assert (buf == 7).all()
    finally:
        sock.close()
        h.dl.unpublish("w/populate")


def test_bytes_under_lease_are_bounded_per_connection_and_for_the_bridge(guarded):
    """H's LEASE_BYTES_PER_CONNECTION_MAX is 1 MiB and LEASE_BYTES_MAX 3 MiB: entries of
    768 KiB are leased one to a connection, four to the bridge; a fifth is refused with EAGAIN
    naming the limit, one already leased elsewhere is not (counted once), nor a second lease of
    the entry a connection holds (one copy pinned: counted once), and a release makes room."""
    import numpy as np
    h = guarded
    _no_leases(h)
    size = 768 << 10
    names = [f"w/lease{i}" for i in range(5)]
    for name in names:
        h.dl.publish(name, np.ones(size, np.uint8), replace=True)
    socks = [_raw_peer(h, h.port, f"leaser{i}") for i in range(6)]
    try:
        got = [_ask(socks[i], {"op": "get", "id": 1, "name": names[i]}) for i in range(4)]
        assert [f["op"] for f in got] == ["layout"] * 4, got
        r = _ask(socks[0], {"op": "get", "id": 2, "name": names[1]})
        assert r["op"] == "error" and r["errno"] == "EAGAIN" and r["id"] == 2, r
        assert r["message"] == (f"'{names[1]}': its {size} bytes would take this connection's "
                                f"leases from {size} bytes past LEASE_BYTES_PER_CONNECTION_MAX "
                                f"({1 << 20}): finish or release a lease first")
        again = _ask(socks[0], {"op": "get", "id": 6, "name": names[0]})
        assert again["op"] == "layout" and again["lease"] != got[0]["lease"], again
        assert h.status("H")["leases"] == 5
        r = _ask(socks[4], {"op": "get", "id": 3, "name": names[4]})
        assert r["op"] == "error" and r["errno"] == "EAGAIN", r
        assert r["message"] == (f"'{names[4]}': its {size} bytes would take what this bridge "
                                f"holds under lease from {4 * size} bytes past LEASE_BYTES_MAX "
                                f"({3 << 20}): try again later")
        assert _ask(socks[4], {"op": "get", "id": 4, "name": names[0]})["op"] == "layout"
        _wire.send(socks[1], {"op": "release", "lease": got[1]["lease"]})
        _wait(lambda: h.status("H")["leases"] == 5, "the release")
        assert _ask(socks[5], {"op": "get", "id": 5, "name": names[4]})["op"] == "layout"
    finally:
        for s in socks:
            s.close()
        for name in names:
            h.dl.unpublish(name)
    _no_leases(h)


def test_a_frame_of_tiny_values_is_refused_before_it_is_parsed(guarded):
    """An 8 MiB request of '{},' values (~200 MiB once parsed) is refused from its count
    (REQUEST_VALUES_MAX), the connection closed; a local request past LOCAL_FRAME_MAX is
    refused from its header. H serves on."""
    h = guarded
    n = (_wire.FRAME_MAX - 40) // 3
    body = b'{"op":"stat","pad":[' + b"{}," * (n - 1) + b"{}]}"
    assert len(body) <= _wire.FRAME_MAX
    sock = _raw_peer(h, h.port, "values")
    try:
        sock.sendall(struct.pack(">I", len(body)) + body)
        frames = _ends(sock, 30)
    finally:
        sock.close()
    assert [(f["op"], f["errno"]) for f in frames] == [("error", "EMSGSIZE")]
    assert frames[0]["message"] == (f"frame of {2 * n + 2} commas and opening brackets exceeds "
                                    f"REQUEST_VALUES_MAX ({_wire.REQUEST_VALUES_MAX})")
    c = socket.socket(socket.AF_UNIX)
    try:
        c.connect(h.path("H.sock"))
        c.sendall(struct.pack(">I", _wire.LOCAL_FRAME_MAX + 1))
        frames = _ends(c, 30)
    finally:
        c.close()
    assert [f["errno"] for f in frames] == ["EMSGSIZE"]
    assert frames[0]["message"] == (f"frame of {_wire.LOCAL_FRAME_MAX + 1} bytes exceeds "
                                    f"LOCAL_FRAME_MAX ({_wire.LOCAL_FRAME_MAX})")
    assert h.status("H")["agent"]


def test_requests_are_let_go_of_before_the_next_is_awaited(monkeypatch):
    """The frames a peer's and a local client's connection threads parsed are freed once
    answered, not kept while the thread waits for the next request."""
    b = fake_bridge()
    b.dlpackd = lambda reconnect=False: FakeDlpackd()
    parsed = []
    real = _wire.recv

    class Frame(dict):
        pass

    def recv(*args, **kw):
        f = real(*args, **kw)
        if threading.current_thread() is threading.main_thread() or \
                f["op"] not in ("metadata", "stat", "drop"):
            return f            # (the hello names the peer in the log for its connection)
        f = Frame(f)
        parsed.append(weakref.ref(f))
        return f
    monkeypatch.setattr(_wire, "recv", recv)
    c, th = _peer_connection(b)
    a, s = socket.socketpair()
    try:
        assert _ask(c, {"op": "stat", "id": 1, "name": "elsewhere"})["errno"] == "ENOENT"
        b._admit_client(s, None)
        assert _ask(a, {"op": "drop", "name": "no-colon"})["errno"] == "EINVAL"
        # both threads wait for their next request now
        _wait(lambda: len(parsed) == 3 and all(r() is None for r in parsed),
              "every frame parsed freed", timeout=5)
        assert th.is_alive()
    finally:
        c.close()
        a.close()
        th.join(5)
        stop_fake_bridge(b)


# A uid's connections to the bridge's local socket, made and held by a process of that uid
# (stdlib only): prints {"open": how many the bridge kept, "refused": [their messages]}, then
# once the bridge closed those it kept, {"ended": [what each last read]}.
_LOCAL_HOLDER = r"""
import json, socket, struct, sys, time
path, n = sys.argv[1], int(sys.argv[2])

def frame(s, timeout):
    s.settimeout(timeout)
    try:
        head = s.recv(4, socket.MSG_WAITALL)
    except socket.timeout:
        return None
    if len(head) < 4:
        return "closed"
    return json.loads(s.recv(struct.unpack(">I", head)[0], socket.MSG_WAITALL))

socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    socks.append(s)
time.sleep(1)
got = [frame(s, 0.01) for s in socks]
kept = [s for s, f in zip(socks, got) if f is None]
print(json.dumps({"open": len(kept), "refused": [f["message"] for f in got if f]}), flush=True)
print(json.dumps({"ended": [(frame(s, 60) or {}).get("message") for s in kept]}), flush=True)
"""

_LOCAL_STATUS = r"""
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
body = json.dumps({"op": "status"}).encode()
s.sendall(struct.pack(">I", len(body)) + body)
s.settimeout(10)
n = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))[0]
print(json.loads(s.recv(n, socket.MSG_WAITALL))["op"])
"""


def _as_uid(uid, code, *args, **kw):
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable,
            "-c", code, *args]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="other uids need root and setpriv (util-linux)")
def test_one_local_uid_cannot_lock_the_others_out(guarded):
    """uid 65534 opens CLIENTS_MAX connections to H's socket and sends nothing: it keeps
    CLIENTS_PER_UID_MAX, the others are refused naming the limit; root and uid 65533 are served
    meanwhile; those it kept are closed after CLIENT_IDLE_TIMEOUT (5 s here), saying so."""
    h = guarded
    path = h.path("H.sock")
    p = subprocess.Popen(_as_uid(65534, _LOCAL_HOLDER, path, str(_server.CLIENTS_MAX)),
                         stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(p.stdout.readline() or "null")
        assert first is not None, "the holder died"
        assert h.status("H")["agent"]                          # root
        r = subprocess.run(_as_uid(65533, _LOCAL_STATUS, path), capture_output=True, text=True,
                           timeout=30)
        assert r.stdout.strip() == "status", r.stderr
        assert first["open"] == _server.CLIENTS_PER_UID_MAX, first
        limit = _server.CLIENTS_PER_UID_MAX
        assert first["refused"] == [f"uid 65534 has {limit} connections to this bridge "
                                    f"(CLIENTS_PER_UID_MAX {limit}): try again later"] * \
            (_server.CLIENTS_MAX - limit)
        last = json.loads(p.stdout.readline() or "null")
        assert last == {"ended": [f"no request within CLIENT_IDLE_TIMEOUT "
                                  f"({H_LIMITS['_server.CLIENT_IDLE_TIMEOUT']:g} s): "
                                  "closed"] * limit}, last
    finally:
        p.kill()
        p.wait()


def test_a_peer_replaying_anothers_metadata_leaves_its_agent_loaded(guarded):
    """A token holder connects with the NIXL metadata of a connected peer's agent, then
    leaves: the exporter keeps that agent loaded for the peer (counted), whose put is written."""
    import numpy as np
    h = guarded
    _no_leases(h)
    h.dl.publish("w/victim", np.full(4096, 5, np.uint8), replace=True)
    agent = f"fake/{os.getpid()}/victim"
    victim = _raw_peer(h, h.port, "victim", agent)
    try:
        assert _ask(victim, {"op": "stat", "id": 1, "name": "w/none"})["errno"] == "ENOENT"
        replay = _raw_peer(h, h.port, "replayer", agent)
        assert _ask(replay, {"op": "stat", "id": 1, "name": "w/none"})["errno"] == "ENOENT"
        replay.close()
        _wait(lambda: re.search(r"peer 'replayer' at 127\.0\.0\.1:\d+ gone", h.log("H", None)),
              "the replayer's connection ended")
        layout = _ask(victim, {"op": "get", "id": 2, "name": "w/victim"})
        assert layout["op"] == "layout", layout
        buf = np.zeros(4096, np.uint8)
        r = _put(victim, layout, buf, agent)
        assert r["op"] == "done", r
        assert (buf == 5).all()
        assert re.search(f"peer 'replayer' at 127\\.0\\.0\\.1:\\d+: agent '{agent}' is loaded "
                         r"for 1 other connection\(s\) as well", h.log("H", None))
    finally:
        victim.close()
        h.dl.unpublish("w/victim")


def test_a_put_naming_another_peers_agent_leaves_that_peer_loaded(guarded):
    """A token holder's put whose metadata names a connected peer's agent, and does not load
    (NIXL then erases the entry of the agent it names): refused with EPROTO and disconnected,
    the blob never loaded; the peer's own put is then written."""
    import numpy as np
    h = guarded
    _no_leases(h)
    h.dl.publish("w/victim2", np.full(4096, 6, np.uint8), replace=True)
    agent = f"fake/{os.getpid()}/victim2"
    victim = _raw_peer(h, h.port, "victim2", agent)
    attacker = _raw_peer(h, h.port, "attacker")
    try:
        stolen = _ask(attacker, {"op": "get", "id": 1, "name": "w/victim2"})
        assert stolen["op"] == "layout", stolen
        buf = np.zeros(4096, np.uint8)
        _wire.send(attacker, {"op": "put", "id": 2, "lease": stolen["lease"],
                              "metadata": md64(agent, b"sections that do not load"),
                              "descs": [[buf.ctypes.data, buf.nbytes]]})
        refused = _wire.recv(attacker, time.monotonic() + 30)
        # the victim first: on a bridge that loaded the blob, NIXL no longer knows its agent
        layout = _ask(victim, {"op": "get", "id": 3, "name": "w/victim2"})
        assert layout["op"] == "layout", layout
        r = _put(victim, layout, buf, agent)
        assert r["op"] == "done", r
        assert (buf == 6).all()
        assert (refused["errno"], refused["message"]) == (
            "EPROTO", f"put for lease {stolen['lease']}: metadata of agent {agent!r}, not of "
            f"the peer's 'fake/{os.getpid()}/attacker': refused, not loaded"), refused
        assert _ends(attacker, 30) == []        # and disconnected
    finally:
        attacker.close()
        victim.close()
        h.dl.unpublish("w/victim2")


def test_a_lone_surrogate_is_refused_wherever_a_name_arrives(guarded):
    """A name with an escaped lone surrogate ("w/\\ud800") in a get, stat, subscribe or
    release, and in a local fetch: answered EPROTO naming it, the connection closed, no
    traceback in the log; H serves on."""
    h = guarded
    for op in ("get", "stat", "subscribe", "release"):
        sock = _raw_peer(h, h.port, f"surrogate-{op}")
        try:
            body = b'{"op":"%s","id":1,"name":"w/\\ud800","lease":"\\ud800"}' % op.encode()
            sock.sendall(struct.pack(">I", len(body)) + body)
            frames = _ends(sock, 30)
        finally:
            sock.close()
        assert [(f["errno"], f["message"]) for f in frames] == [
            ("EPROTO", "frame holds a lone UTF-16 surrogate (\\ud800-\\udfff): not Unicode "
             "text")], (op, frames)
    c = socket.socket(socket.AF_UNIX)
    try:
        c.connect(h.path("H.sock"))
        body = b'{"op":"fetch","name":"A:w/\\ud800"}'
        c.sendall(struct.pack(">I", len(body)) + body)
        frames = _ends(c, 30)
    finally:
        c.close()
    assert [f["errno"] for f in frames] == ["EPROTO"], frames
    assert "Traceback" not in h.log("H", None)
    assert h.status("H")["agent"]


def test_leases_expire_while_the_connection_waits_for_a_write(guarded):
    """S (lease TTL 1 s) WRITEs one lease of a connection and the WRITE stalls: the
    connection's other lease ends at its TTL meanwhile; the WRITE then completes."""
    import numpy as np
    h = guarded
    _no_leases(h, "S")
    for name in ("w/idle", "w/written"):
        h.dl.publish(name, np.full(4096, 9, np.uint8), replace=True)
    agent = f"fake/{os.getpid()}/staller"
    sock = _raw_peer(h, h.sport, "staller", agent)
    try:
        assert _ask(sock, {"op": "get", "id": 1, "name": "w/idle"})["op"] == "layout"
        layout = _ask(sock, {"op": "get", "id": 1, "name": "w/written"})
        assert layout["op"] == "layout" and h.status("S")["leases"] == 2
        buf = np.zeros(4096, np.uint8)
        _wire.send(sock, {"op": "put", "id": 2, "lease": layout["lease"],
                          "metadata": md64(agent, PARTIAL),
                          "descs": [[buf.ctypes.data, buf.nbytes]]})
        # (the WRITE's own deadline is TRANSFER_GRACE, 10 s: the other lease ends well before)
        _wait(lambda: h.status("S")["writing"] == 1 and h.status("S")["leases"] == 1,
              "the idle lease ended at its TTL during the WRITE", timeout=8)
        with open(h.gate, "w"):
            pass
        assert _wire.recv(sock, time.monotonic() + 10)["op"] == "done"
        assert (buf == 9).all()
    finally:
        sock.close()
        for name in ("w/idle", "w/written"):
            h.dl.unpublish(name)


def test_a_refused_local_client_reads_why(tmp_path):
    """A bridge that refuses a local connection (its client limits) writes why and closes it,
    maybe before the request goes: bridge.status() raises that reason, not a bare broken pipe
    (a request larger than the socket's buffer cannot go whole before the close)."""
    path = str(tmp_path / "refusing.sock")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lsock.bind(path)
    lsock.listen(8)
    said = "too many connections of uid 0 (CLIENTS_PER_UID_MAX 16): try again later"

    def refuse():
        for _ in range(2):
            c, _ = lsock.accept()
            _wire.send_error(c, "EAGAIN", said)
            c.close()

    th = threading.Thread(target=refuse)
    th.start()
    try:
        for frame in ({"op": "status"}, {"op": "status", "pad": "x" * (4 << 20)}):
            with pytest.raises(BlockingIOError, match="CLIENTS_PER_UID_MAX 16"):
                bridge._request(frame, 5, path, "status")
    finally:
        th.join(10)
        lsock.close()
