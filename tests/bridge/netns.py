# SPDX-License-Identifier: Apache-2.0
"""Two hosts on one machine: dlpackd + dlpackd-bridge in each of two network namespaces joined
by a veth pair, NIXL over UCX's TCP between them (ctest: bridge_netns).

    netns.py DLPACKD        (as root, with the bridge venv's interpreter, PYTHONPATH=<build>/python)

Host A exports w/ and sd/; host B's bridge knows A as peer "A". Every namespace, link, daemon
and bridge is removed on every exit path. Exits 77, saying why, where it cannot run (not root,
no `ip`, no NIXL in this interpreter).

The veth moves about 2 GB/s, so the cases whose event must land during a transfer (a REPLACE,
the publisher, either bridge killed, the link taken down) shape the link with tc's tbf for their
duration (World.slow_link), at a rate that makes their transfer last about SHAPED seconds, and
prove that the event landed mid-way (mid_transfer): A's bridge still writing, fewer bytes across
A's veth than the transfer's, and an outcome that a finished transfer could not give. A kernel
without tbf fails the test (it is not skipped).
"""
import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
# the /30 between the namespaces (private, and only inside them)
ADDR_A, ADDR_B, PREFIX = "10.231.77.1", "10.231.77.2", 30
PORT = 7455
TTL = 10.0              # the exporter's --lease-ttl (and bound on one WRITE) in this test
QUARANTINE = 6.0        # and --quarantine, beyond UCX's keepalive (KEEPALIVE) here
KEEPALIVE = {"UCX_TCP_KEEPIDLE": "1s", "UCX_TCP_KEEPINTVL": "1s", "UCX_TCP_KEEPCNT": "2"}
WAIT = 30.0             # the longest any expected state is waited for
FOLLOW_INTERVAL = 60    # bridge-B's --follow-interval: its --follow lives on pushes
FOLLOW_SUBSCRIBED_INTERVAL = 3600  # and no safety poll lands within the case
PUSHED = 10.0           # the longest a pushed change may take to reach B's replica
SHAPED = 3.0            # seconds a shaped transfer lasts (World.slow_link, shaped_rate())
BIG = 128 << 20         # w/big, the entry of the bridges killed and of the link taken down
ETCD_PORT = 2379        # case_registry's etcd, on A's address (and 2380 on A's loopback)


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


if os.geteuid() != 0:
    skip("needs root (network namespaces)")
if not shutil.which("ip"):
    skip("no `ip` (Debian: iproute2)")
try:
    import nixl  # noqa: F401
except ImportError as e:
    skip(f"no NIXL in {sys.executable} ({e}): the bridge_venv test makes the venv")

import numpy as np  # noqa: E402

import dlpack_ipc  # noqa: E402
from dlpack_ipc import bridge  # noqa: E402
from dlpack_ipc.bridge import _registry  # noqa: E402

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def wait_for(pred, what, timeout=WAIT, every=0.005):
    """Wait (bounded) until pred() is true, trying every that many seconds; a failed check
    naming what if it never is."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except OSError:
            pass
        time.sleep(every)
    check(False, f"{what} (not within {timeout:.0f} s)")
    return False


def sh(*cmd, check_rc=True):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check_rc and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


class World:
    """The namespaces, the link, the daemons and the bridges; torn down by close()."""

    def __init__(self, dlpackd, ttl=TTL, extra=()):
        self.ttl = ttl
        self.extra = list(extra)       # more options for every bridge
        tag = os.getpid()
        self.ns = {"A": f"dlpb-a-{tag}", "B": f"dlpb-b-{tag}"}
        self.veth = {"A": f"dlpa{tag}", "B": f"dlpb{tag}"}
        self.dlpackd = dlpackd
        self.tmp = tempfile.mkdtemp(prefix="dlpc-bridge-")
        self.procs = {}
        self.logs = {}
        self.token = self._token("token", os.urandom(24).hex())
        self.wrong = self._token("wrong", os.urandom(24).hex())

    def _token(self, name, text):
        path = os.path.join(self.tmp, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, text.encode())
        os.close(fd)
        return path

    def path(self, *p):
        return os.path.join(self.tmp, *p)

    def up(self):
        # what a run killed by SIGKILL (a ctest timeout) left: its pid is in the names
        for line in sh("ip", "netns", "list").stdout.splitlines():
            name = line.split()[0] if line.split() else ""
            if name.startswith("dlpb-") and not os.path.exists(f"/proc/{name.rsplit('-', 1)[1]}"):
                sh("ip", "netns", "del", name, check_rc=False)
        for h in "AB":
            sh("ip", "netns", "add", self.ns[h])
        sh("ip", "link", "add", self.veth["A"], "type", "veth", "peer", "name", self.veth["B"])
        for h, addr in (("A", ADDR_A), ("B", ADDR_B)):
            sh("ip", "link", "set", self.veth[h], "netns", self.ns[h])
            sh("ip", "-n", self.ns[h], "addr", "add", f"{addr}/{PREFIX}", "dev", self.veth[h])
            sh("ip", "-n", self.ns[h], "link", "set", self.veth[h], "up")
            sh("ip", "-n", self.ns[h], "link", "set", "lo", "up")
            self.start(f"dlpackd-{h}", h, [self.dlpackd, "-s", self.path(f"dlpackd-{h}.sock")])
        for h in "AB":
            wait_for(lambda: os.path.exists(self.path(f"dlpackd-{h}.sock")), f"dlpackd on {h}")
        self.start_bridge("A")
        self.start_bridge("B")
        self.start_bridge("B", name="bridge-Bwrong", token=self.wrong)

    def start(self, name, host, argv):
        log = open(self.path(f"{name}.log"), "ab")
        self.logs[name] = self.path(f"{name}.log")
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *argv], stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env={**os.environ, **KEEPALIVE})
        log.close()
        self.procs[name] = p
        return p

    def bridge_socket(self, name):
        return self.path(f"{name}.sock")

    def start_bridge(self, host, name=None, token=None):
        name = name or f"bridge-{host}"
        sock = self.bridge_socket(name)
        argv = [sys.executable, "-m", "dlpack_ipc.bridge", "--socket", sock,
                "--dlpackd-socket", self.path(f"dlpackd-{host}.sock"),
                "--token-file", token or self.token, "--lease-ttl", str(self.ttl),
                "--quarantine", str(QUARANTINE), *self.extra]
        if host == "A":
            argv += ["--listen", f"{ADDR_A}:{PORT}", "--export", "w/", "--export", "sd/"]
        else:
            # a poll cannot explain a change that arrives within PUSHED: only a push can
            argv += ["--peer", f"A={ADDR_A}:{PORT}", "--follow", "A:w/follow",
                     "--follow-interval", str(FOLLOW_INTERVAL),
                     "--follow-subscribed-interval", str(FOLLOW_SUBSCRIBED_INTERVAL)]
        p = self.start(name, host, argv)
        wait_for(lambda: bridge.status(socket=sock)["agent"], f"{name} answers")
        return p

    def wire_bytes(self, host="A"):
        """The bytes sent out of host's veth so far: past its qdisc, what the link carried.
        Read from /proc/PID/net/dev of host's dlpackd (in its namespace): no process started,
        so that polling it does not take the CPU from the bridges."""
        with open(f"/proc/{self.procs[f'dlpackd-{host}'].pid}/net/dev") as f:
            for line in f:
                dev, _, counters = line.partition(":")
                if dev.strip() == self.veth[host]:
                    return int(counters.split()[8])
        raise RuntimeError(f"no {self.veth[host]} in namespace {self.ns[host]}")

    @contextlib.contextmanager
    def slow_link(self, rate):
        """tbf at rate (tc's spelling: "160mbit") on both ends of the veth for the with block,
        removed after it, on every exit path. tc missing or tbf refused is an error, never a
        skip: the mid-transfer cases cannot prove anything on the unshaped link."""
        if not shutil.which("tc"):
            raise RuntimeError("no `tc` (Debian: iproute2): the mid-transfer cases shape the link")
        shaped = []
        try:
            for h in "AB":
                r = sh("ip", "netns", "exec", self.ns[h], "tc", "qdisc", "replace", "dev",
                       self.veth[h], "root", "tbf", "rate", rate, "burst", "256kb", "latency",
                       "200ms", check_rc=False)
                if r.returncode:
                    raise RuntimeError(f"tc refused tbf at {rate} on {self.veth[h]} "
                                       f"({r.stderr.strip()}): the mid-transfer cases need it")
                shaped.append(h)
            yield
        finally:
            for h in shaped:
                r = sh("ip", "netns", "exec", self.ns[h], "tc", "qdisc", "del", "dev",
                       self.veth[h], "root", check_rc=False)
                check(r.returncode == 0, f"tbf removed from {self.veth[h]}" +
                      (f" ({r.stderr.strip()})" if r.returncode else ""))

    def kill(self, name, sig=signal.SIGKILL):
        p = self.procs.pop(name, None)
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p

    def client(self, host):
        return dlpack_ipc.Client(self.path(f"dlpackd-{host}.sock"))

    def close(self, show_logs=False):
        for name in list(self.procs):
            if name.startswith("bridge"):
                self.kill(name, signal.SIGTERM)
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)
        for h in "AB":
            sh("ip", "netns", "del", self.ns[h], check_rc=False)
        sh("ip", "link", "del", self.veth["A"], check_rc=False)
        if failures or show_logs:
            for name, path in self.logs.items():
                with open(path, errors="replace") as f:
                    print(f"--- {name} log (last lines)\n" + "".join(f.readlines()[-25:]))
        shutil.rmtree(self.tmp, ignore_errors=True)


def fds(p):
    """The fds of the process p (ip netns exec execs the command: the same pid)."""
    return len(os.listdir(f"/proc/{p.pid}/fd"))


def fd_list(p):
    out = []
    for f in os.listdir(f"/proc/{p.pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{p.pid}/fd/{f}"))
        except OSError:
            pass
    return sorted(out)


def ucx_sockets(w, host):
    """bridge-host's UCX sockets, from ss: its listening data ports (one per NIXL agent alive),
    and its data connections with the other host (not the control PORT, not etcd's; in any
    state that holds an fd: CLOSE-WAIT too), counted as (into its own data ports, out of
    them)."""
    p = w.procs[f"bridge-{host}"]
    other = ADDR_B if host == "A" else ADDR_A
    listen, conns = set(), []
    for line in sh("ip", "netns", "exec", w.ns[host], "ss", "-tanp").stdout.splitlines():
        f = line.split()
        if len(f) < 5 or f"pid={p.pid}," not in line:
            continue
        lport = int(f[3].rsplit(":", 1)[1])
        rhost, rport = f[4].rsplit(":", 1)
        if f[0] == "LISTEN" and lport != PORT:
            listen.add(lport)
        elif f[0] != "TIME-WAIT" and rhost == other and PORT not in (lport, int(rport)) and \
                int(rport) not in (ETCD_PORT, ETCD_PORT + 1):
            conns.append(lport)
    into = sum(1 for port in conns if port in listen)
    return listen, into, len(conns) - into


def fd_state(w, host):
    """bridge-host's fds: (how many, how many of them are UCX data connections)."""
    _, into, out = ucx_sockets(w, host)
    return fds(w.procs[f"bridge-{host}"]), into + out


def agents_settled(w, host, before, what):
    """After transfers aborted: bridge-host's old NIXL agents are destroyed and nothing of
    theirs is left. Each bridge then has one agent (one UCX data port) and at most one data
    connection each way with the other host: an older agent's connection left open after its
    aborted transfer would be a second one. Its other fds number as many as before (fd_state()),
    or one more: after a replacement UCX may keep one socket that is in no TCP table (seen in
    one bridge of two, once, never growing over four link drops in a row). Whether new agents
    keep one data connection each way or share one depends on which connected first. (Each
    status call holds a connection to the bridge, and its thread there, for up to half a
    second: none is made while the fds are counted.)"""
    p = w.procs[f"bridge-{host}"]
    sock = w.bridge_socket(f"bridge-{host}")
    fds0, conns0 = before
    agents = wait_for(lambda: bridge.status(socket=sock)["agents"] == 1,
                      f"{what}: bridge-{host}'s old agents destroyed")
    time.sleep(1.0)     # (the threads of those status calls see their clients go)

    def settled():
        listen, into, out = ucx_sockets(w, host)
        return len(listen) == 1 and into <= 1 and out <= 1 and \
            fds(p) - into - out <= fds0 - conns0 + 1
    ok = agents and wait_for(settled, f"{what}: bridge-{host} settled")
    listen, into, out = ucx_sockets(w, host)
    n = fds(p)
    check(ok, f"{what}: bridge-{host} has {bridge.status(socket=sock)['agents']} NIXL agent(s), "
          f"data ports {sorted(listen)}, {into} data connection(s) in and {out} out with the "
          f"other host, {n} fds ({fds0} before, {conns0} of them data connections)")
    return ok


def refs(client, name):
    """dlpackd's live references to name, those of the attach cache left out."""
    e = [e for e in client.list(name) if e.name == name]
    return e[0].refs - e[0].cached_refs if e else None


def status_a(w):
    return bridge.status(socket=w.bridge_socket("bridge-A"))


def writing(w):
    """Whether A's bridge has a WRITE in flight."""
    return status_a(w)["writing"] >= 1


def shaped_rate(nbytes):
    """The tbf rate (tc's spelling) at which nbytes take about SHAPED seconds on the wire."""
    return f"{max(1, int(nbytes * 8 / SHAPED / 1e6))}mbit"


def mid_transfer(w, th, total, tx0, what):
    """Wait until A's bridge is writing and an eighth of total bytes crossed A's veth since
    tx0; a check that the transfer is then live: the fetch th not returned, A still writing,
    and strictly between 0 and total bytes across (headers included: fewer payload bytes).
    The caller fires its event at once, and checks an outcome a finished transfer cannot give."""
    wait_for(lambda: not th.is_alive() or (w.wire_bytes() - tx0 >= total // 8 and writing(w)),
             f"{what}: an eighth of the WRITE across", every=0.02)
    moved = w.wire_bytes() - tx0
    live = th.is_alive() and writing(w)
    check(live and 0 < moved < total, f"{what}: mid-transfer (A writing: {live}, "
          f"{moved / 2**20:.1f} of {total / 2**20:.0f} MiB across the link)")
    return live


def fetch(w, name, timeout=20.0, sock="bridge-B"):
    return bridge.fetch(name, timeout, socket=w.bridge_socket(sock))


def case_tensor(w, a, b):
    x = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
    gen = a.publish("w/t", x, replace=True)
    local, rgen = fetch(w, "A:w/t")
    check(local == "A:w/t" and rgen == gen, f"fetch returns the local name and the generation "
          f"({local!r}, {rgen} == {gen})")
    t = b.attach("A:w/t")
    check(np.array_equal(np.asarray(t), x), "the tensor attached on B has A's bytes")
    check(t.dtype == "uint8" and t.shape == x.shape, "and its dtype and shape")
    t.release()
    check(wait_for(lambda: refs(a, "w/t") == 0, "lease ended after the transfer"),
          "A's dlpackd reference to w/t is back after the transfer")
    check(bridge.status(socket=w.bridge_socket("bridge-A"))["leases"] == 0,
          "A's bridge holds no lease")


def case_data_ports(w, a, b):
    """UCX's data ports only on the interface the bridges use: each bridge listens on its own
    veth address alone (not on lo, not on a wildcard), and says so in its log."""
    for name, host, addr in (("bridge-A", "A", ADDR_A), ("bridge-B", "B", ADDR_B)):
        pid = w.procs[name].pid
        out = sh("ip", "netns", "exec", w.ns[host], "ss", "-Htlnp").stdout
        ports = [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]
        check(ports and all(p.rpartition(":")[0] == addr for p in ports),
              f"{name} listens on {addr} only ({ports})")
        with open(w.logs[name], errors="replace") as f:
            log = f.read()
        check(f"UCX_NET_DEVICES={w.veth[host]}:" in log,
              f"{name} logs UCX_NET_DEVICES={w.veth[host]}")


def case_64m(w, a, b):
    x = np.arange(16 << 20, dtype=np.float32)
    a.publish("w/64m", x, replace=True)
    t0 = time.monotonic()
    fetch(w, "A:w/64m")
    dt = time.monotonic() - t0
    t = b.attach("A:w/64m")
    check(np.array_equal(np.asarray(t), x), "64 MiB: equal bytes on B")
    t.release()
    print(f"info: 64 MiB fetched over the veth in {dt:.3f} s ({x.nbytes / dt / 1e9:.2f} GB/s, "
          "fetch call to published replica)")


def case_per_uid(w, a, b):
    """Replicas charged to the caller's uid (SO_PEERCRED), checked against B's real dlpackd:
    after case_tensor and case_64m this uid holds w/t and w/64m; a refetch counts in place of
    the old one (the other record confirmed by dlpackd's list), and a replica unpublished on B
    stops counting at the next fetch."""
    uid = str(os.geteuid())

    def held():
        return bridge.status(socket=w.bridge_socket("bridge-B"))["replicas"].get(uid)
    both = [2, (1 << 20) + (64 << 20)]
    check(held() == both, f"uid {uid} holds w/t and w/64m ({held()} == {both})")
    fetch(w, "A:w/t")
    check(held() == both, f"a refetch of w/t counts in place of the old one ({held()})")
    b.unpublish("A:w/64m")
    fetch(w, "A:w/t")
    check(held() == [1, 1 << 20], f"w/64m, unpublished on B, no longer counts ({held()})")


def state_dict():
    rng = np.random.default_rng(2)
    sd = {}
    for i in range(24):
        sd[f"layers.{i}.weight"] = rng.standard_normal((1024, 1024), dtype=np.float32)
        sd[f"layers.{i}.bias"] = rng.standard_normal(1024).astype(np.float16)
        sd[f"layers.{i}.idx"] = np.arange(i * 7 + 1, dtype=np.int64)
    sd["empty"] = np.zeros((0, 3), dtype=np.float32)
    sd["flag"] = np.array([True, False, True])
    return sd


def case_state_dict(w, a, b):
    sd = state_dict()
    total = sum(v.nbytes for v in sd.values())
    gen = a.publish_dict("sd/model", sd, replace=True)
    local, rgen = fetch(w, "A:sd/model", timeout=60)
    check(rgen == gen, f"state dict: generation {rgen} == {gen}")
    got = b.attach_dict(local)
    check(list(got) == list(sd), f"state dict: the {len(sd)} keys, in order")
    check(all(np.array_equal(np.asarray(got[k]), v) and got[k].shape == v.shape
              for k, v in sd.items()), f"state dict: {total / 2**20:.0f} MiB, equal bytes, "
          "dtypes and shapes on B")
    for t in got.values():
        t.release()
    check(wait_for(lambda: refs(a, "sd/model") == 0, "state dict lease ended"),
          "A's reference to sd/model is back after the transfer")


def case_device(w, a, b):
    """A device entry and a device bundle on A (the fake CUDA driver, $FAKE_CUDA_LIB, whose
    device pointers are host addresses) reach B as device replicas with A's bytes."""
    import ctypes
    rng = np.random.default_rng(3)
    x = rng.integers(0, 255, (3 << 20) + 5, dtype=np.uint8)
    t = a.empty(x.shape, "uint8", device="cuda:0")
    ctypes.memmove(t.data_ptr, x.ctypes.data, x.nbytes)
    gen = a.publish("w/dev", t, replace=True)
    t.release()
    sd = {"w": rng.standard_normal((256, 300), dtype=np.float32),
          "b": rng.standard_normal(300).astype(np.float16)}
    bucket = a.empty_dict({k: (v.shape, str(v.dtype)) for k, v in sd.items()}, device="cuda:0")
    for k, v in sd.items():
        ctypes.memmove(bucket[k].data_ptr, v.ctypes.data, v.nbytes)
    gen_sd = a.publish_dict("sd/dev", bucket, replace=True)
    for v in bucket.values():
        v.release()
    check(fetch(w, "A:w/dev")[1] == gen, "device entry: fetched, A's generation")
    r = b.attach("A:w/dev")
    check(r.device == "cuda:0" and r.shape == x.shape, f"device entry on B: {r.device}, "
          f"{r.shape}")
    check(ctypes.string_at(r.data_ptr, r.nbytes) == x.tobytes(), "device entry: A's bytes on B")
    r.release()
    check(fetch(w, "A:sd/dev")[1] == gen_sd, "device bundle: fetched, A's generation")
    got = b.attach_dict("A:sd/dev")
    check(sorted(got) == ["b", "w"] and all(v.device == "cuda:0" for v in got.values()),
          "device bundle on B: its keys, on cuda:0")
    check(all(ctypes.string_at(got[k].data_ptr, v.nbytes) == v.tobytes() for k, v in sd.items()),
          "device bundle: A's bytes on B")
    for v in got.values():
        v.release()
    check(wait_for(lambda: refs(a, "w/dev") == 0 and refs(a, "sd/dev") == 0,
                   "device leases ended"), "A's references to the device entries are back")
    st = bridge.status(socket=w.bridge_socket("bridge-A"))
    check(st["staged"] == 0 and st["leases"] == 0, f"A's bridge holds no staging ({st['staged']})"
          " and no lease")


def case_errors(w, a, b):
    a.publish("secret/x", np.ones(4), replace=True)
    for name, what in (("A:secret/x", "a name A does not export"),
                       ("A:w/absent", "a name A lacks"),
                       ("Z:w/t", "a peer not configured")):
        try:
            fetch(w, name, timeout=10)
            check(False, f"{what}: FileNotFoundError")
        except FileNotFoundError as e:
            check(name.split(":")[1] in str(e) or "'Z'" in str(e),
                  f"{what}: FileNotFoundError naming it ({e})")
    check(b.list("A:secret") == [], "nothing published on B for them")
    try:
        fetch(w, "A:w/" + "x" * dlpack_ipc.NAME_MAX, timeout=10)
        check(False, "a local name over NAME_MAX: ENAMETOOLONG")
    except OSError as e:
        check(e.errno == errno.ENAMETOOLONG, f"a local name over NAME_MAX: ENAMETOOLONG ({e})")


def case_nixl_metadata(w, a, b):
    """What the bridge and fake_nixl.py take of NIXL's metadata holds for this NIXL
    (nixl_metadata.py, in B's namespace)."""
    r = subprocess.run(["ip", "netns", "exec", w.ns["B"], sys.executable,
                        os.path.join(HERE, "nixl_metadata.py")], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, env={**os.environ, **KEEPALIVE}, timeout=WAIT)
    said = [ln for ln in r.stdout.splitlines() if ln.startswith(("ok: ", "FAIL: "))]
    check(r.returncode == 0 and said and not [ln for ln in said if ln.startswith("FAIL")],
          "NIXL's metadata as the bridge and fake_nixl.py read it (nixl_metadata.py): " +
          ("; ".join(said) if r.returncode == 0 else r.stdout + r.stderr))


def case_wrong_token(w, a, b):
    try:
        fetch(w, "A:w/t", timeout=10, sock="bridge-Bwrong")
        check(False, "a peer with a wrong token: PermissionError")
    except PermissionError as e:
        check("peer A" in str(e), f"a peer with a wrong token: PermissionError naming the peer "
              f"({e})")
    st = bridge.status(socket=w.bridge_socket("bridge-A"))
    check(st["refused"] >= 1, f"A counted the refusal ({st['refused']})")
    local, _ = fetch(w, "A:w/t")
    check(local == "A:w/t", "A still serves the right peer after refusing the wrong one")


PROBE = r"""
import socket, struct, sys, time
from dlpack_ipc.bridge import _wire
head = {"big": struct.pack(">I", _wire.FRAME_MAX + 1), "json": struct.pack(">I", 5) + b"{nope"}
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.sendall(head[sys.argv[3]])
f = _wire.recv(s, time.monotonic() + 10)
print(f["errno"], s.recv(1) == b"")
"""


def case_bad_frames(w, a, b):
    """An oversized frame and one of bad JSON, to A's TCP port and to its local socket."""
    for kind, want in (("big", "EMSGSIZE"), ("json", "EPROTO")):
        r = subprocess.run(["ip", "netns", "exec", w.ns["B"], sys.executable, "-c", PROBE,
                            ADDR_A, str(PORT), kind], capture_output=True, text=True, timeout=60)
        check(r.stdout.split() == [want, "True"], f"peer port, {kind} frame: one {want} error "
              f"frame, then closed ({r.stdout.strip()} {r.stderr.strip()[-200:]})")
        import socket
        import struct
        s = socket.socket(socket.AF_UNIX)
        s.connect(w.bridge_socket("bridge-A"))
        s.sendall(struct.pack(">I", bridge.FRAME_MAX + 1) if kind == "big" else
                  struct.pack(">I", 5) + b"{nope")
        from dlpack_ipc.bridge import _wire
        f = _wire.recv(s, time.monotonic() + 10)
        check(f["errno"] == want and s.recv(1) == b"", f"local socket, {kind} frame: {want}, "
              "then closed")
        s.close()
    check(w.procs["bridge-A"].poll() is None, "A's bridge lives on")


def replica(b, name):
    """The bytes of B's replica name as a numpy array, or None where there is none."""
    try:
        t = b.attach(name, timeout=0)
    except FileNotFoundError:
        return None
    x = np.asarray(t).copy()
    t.release()
    return x


def case_follow(w, a, b):
    """--follow A:w/follow: B's replica follows A's entry through replaces and its removal,
    each pushed (B polls every FOLLOW_INTERVAL s: each change must arrive within PUSHED)."""
    def followed():
        return bridge.status(socket=w.bridge_socket("bridge-B"))["follows"]["A:w/follow"]

    def pushed(what, value, generation):
        if value is None:
            ok = wait_for(lambda: replica(b, "A:w/follow") is None and
                          followed()["generation"] is None, f"follow: {what}", PUSHED, 0.05)
        else:
            ok = wait_for(lambda: (r := replica(b, "A:w/follow")) is not None and
                          bool((r == value).all()) and followed()["generation"] == generation,
                          f"follow: {what}", PUSHED, 0.05)
        check(ok, f"follow: {what} on A reaches B's replica within {PUSHED:g} s (pushed)")

    check(wait_for(lambda: followed()["subscribed"], "follow: subscribed"),
          "follow: B is subscribed to A's w/follow")
    ones = np.full(1 << 20, 1, np.uint8)
    pushed("a publish", 1, a.publish("w/follow", ones, replace=True))
    pushed("a REPLACE", 2, a.publish("w/follow", ones * 2, replace=True))
    a.unpublish("w/follow")
    pushed("an unpublish", None, None)
    pushed("a new publish", 3, a.publish("w/follow", ones * 3))
    a.unpublish("w/follow")


def case_limits(w, a, b):
    """LEASES_MAX leases per peer connection, CLIENTS_PER_UID_MAX local clients of one uid at
    once."""
    from dlpack_ipc.bridge import _server
    a.publish("w/held", np.ones(1000), replace=True)
    p = subprocess.Popen(["ip", "netns", "exec", w.ns["B"], sys.executable,
                          os.path.join(HERE, "fake_importer.py"), f"{ADDR_A}:{PORT}", w.token,
                          "w/held", str(_server.LEASES_MAX + 1)], stdout=subprocess.PIPE,
                         text=True)
    try:
        lines = []
        while len(lines) < _server.LEASES_MAX + 1:
            line = p.stdout.readline()
            if not line:
                break
            if line.startswith(("LEASE ", "REFUSED ")):     # (NIXL logs there too)
                lines.append(line.strip())
        check(lines[:-1] == [ln for ln in lines[:-1] if ln.startswith("LEASE ")] and
              lines[-1] == "REFUSED EAGAIN", f"LEASES_MAX ({_server.LEASES_MAX}) leases on one "
              f"connection, then EAGAIN ({lines[-1]})")
        # (one client attaching one entry 64 times: dlpackd may count one reference)
        check(refs(a, "w/held") >= 1, "the leases hold the entry in A's dlpackd")
    finally:
        p.kill()
        p.wait()
    check(wait_for(lambda: refs(a, "w/held") == 0, "LEASES_MAX: references back"),
          "and all of them come back when the connection goes")
    import socket
    from dlpack_ipc.bridge import _wire
    held = []
    try:
        for _ in range(_server.CLIENTS_PER_UID_MAX):
            s = socket.socket(socket.AF_UNIX)
            s.connect(w.bridge_socket("bridge-A"))
            held.append(s)
        s = socket.socket(socket.AF_UNIX)
        s.connect(w.bridge_socket("bridge-A"))
        held.append(s)
        f = _wire.recv(s, time.monotonic() + 10)
        check(f.get("errno") == "EAGAIN" and "CLIENTS_PER_UID_MAX" in f.get("message", ""),
              f"CLIENTS_PER_UID_MAX ({_server.CLIENTS_PER_UID_MAX}) local clients of root, "
              f"then EAGAIN naming it ({f})")
    finally:
        for s in held:
            s.close()
    check(wait_for(lambda: bridge.status(socket=w.bridge_socket("bridge-A"))["agent"],
                   "A answers again"), "and A serves local clients again when they go")


def case_lease_ttl(w, a, b):
    """An importer that takes a lease and never sends its descriptors."""
    a.publish("w/held", np.ones(1000), replace=True)
    for how in ("ttl", "killed"):
        p = w.start(f"fake-{how}", "B", [sys.executable, os.path.join(HERE, "fake_importer.py"),
                                         f"{ADDR_A}:{PORT}", w.token, "w/held"])
        ok = wait_for(lambda: refs(a, "w/held") == 1, f"{how}: the fake importer holds a lease")
        check(ok, f"{how}: A's dlpackd holds a reference for the lease")
        t0 = time.monotonic()
        if how == "killed":
            w.kill(f"fake-{how}")
        ok = wait_for(lambda: refs(a, "w/held") == 0, f"{how}: lease ended")
        dt = time.monotonic() - t0
        check(ok, f"{how}: the lease ended ({'TTL' if how == 'ttl' else 'connection lost'}) "
              f"and A's reference is back after {dt:.1f} s")
        if how == "ttl":
            check(p.poll() is None, "ttl: while the importer's connection was still open")
            w.kill(f"fake-{how}")


def _fetch_in_thread(w, name, timeout):
    res = {}

    def run():
        try:
            res["r"] = fetch(w, name, timeout=timeout)
        except OSError as e:
            res["e"] = e
    th = threading.Thread(target=run)
    th.start()
    return th, res


def case_replace_during(w, a, b):
    """A REPLACE on A while B's fetch of the old generation is on the wire (64 MiB shaped to
    about SHAPED s, then an unshaped fetch of the new one: 3.5 s here)."""
    n = 64 << 20
    old = np.full(n, 1, dtype=np.uint8)
    new = np.full(n, 2, dtype=np.uint8)
    g1 = a.publish("w/rep", old, replace=True)
    with w.slow_link(shaped_rate(n)):
        served = status_a(w)["served"]
        tx0 = w.wire_bytes()
        th, res = _fetch_in_thread(w, "A:w/rep", 60)
        mid_transfer(w, th, n, tx0, "replace")
        g2 = a.publish("w/rep", new, replace=True)
        st = status_a(w)
        moved = w.wire_bytes() - tx0
        check(th.is_alive() and st["writing"] >= 1 and st["served"] == served and moved < n,
              f"replace: the REPLACE returned while the old generation was being written "
              f"({moved / 2**20:.1f} of {n >> 20} MiB across)")
        th.join(90)
        moved = w.wire_bytes() - tx0
    check("r" in res and res["r"][1] == g1, f"replace during a transfer: the fetch got generation "
          f"{res.get('r', (0, None))[1]} == {g1} (replaced by {g2} meanwhile; "
          f"{moved / 2**20:.1f} MiB across) {res.get('e') or ''}")
    if "r" in res:
        t = b.attach("A:w/rep")
        check(np.array_equal(np.asarray(t), old), "and its bytes are the old generation's, whole")
        t.release()
    _, rgen = fetch(w, "A:w/rep", timeout=60)
    t = b.attach("A:w/rep")
    check(rgen == g2 and np.array_equal(np.asarray(t), new), "the next fetch gets the new one")
    t.release()


def case_exporter_killed(w, a, b):
    """The exporting bridge SIGKILLed before a fetch and in the middle of one (BIG shaped to
    about SHAPED s, killed an eighth of the way; two restarts and an unshaped refetch: 3 s
    here)."""
    big = np.full(BIG, 3, dtype=np.uint8)
    a.publish("w/big", big, replace=True)
    w.kill("bridge-A")
    try:
        fetch(w, "A:w/t", timeout=5)
        check(False, "exporter killed before: the fetch fails")
    except ConnectionRefusedError as e:
        check(f"peer A ({ADDR_A}:{PORT}), 'w/t'" in str(e) and "refused" in str(e),
              f"exporter killed before: ConnectionRefusedError naming the peer and the name "
              f"({e})")
    w.start_bridge("A")
    local, _ = fetch(w, "A:w/t")
    check(local == "A:w/t", "a restarted exporter serves again")

    gen_before = [e.generation for e in b.list("A:w/big")]
    with w.slow_link(shaped_rate(BIG)):
        tx0 = w.wire_bytes()
        th, res = _fetch_in_thread(w, "A:w/big", 20)
        t0 = time.monotonic()
        mid_transfer(w, th, BIG, tx0, "exporter killed")
        w.kill("bridge-A")
        th.join(40)
    dt = time.monotonic() - t0
    check(not th.is_alive(), f"exporter killed mid-way: the fetch returned after {dt:.1f} s "
          "(timeout 20 s)")
    # a transfer that had finished would have been published: a fetch that succeeds fails here
    check(isinstance(res.get("e"), (ConnectionError, TimeoutError)),
          f"exporter killed mid-way: the fetch failed: {type(res.get('e')).__name__} ({res})")
    check([e.generation for e in b.list("A:w/big")] == gen_before,
          "no replica was published from the broken transfer")
    check(w.procs["bridge-B"].poll() is None, "B's bridge is alive")
    w.start_bridge("A")
    local, _ = fetch(w, "A:w/big", timeout=60)
    t = b.attach(local)
    check(np.array_equal(np.asarray(t), big), "a restarted exporter serves w/big whole")
    t.release()


def case_publisher_killed(w, a, b):
    """The publisher on A dies (its ephemeral entry goes) while its entry is on the wire
    (BIG shaped to about SHAPED s: 4 s here with the publisher's start)."""
    code = ("import sys, time, numpy as np, dlpack_ipc; c = dlpack_ipc.Client(sys.argv[1]); "
            f"c.publish('w/eph', np.full({BIG}, 5, np.uint8), ephemeral=True, replace=True);"
            " print('ready', flush=True); time.sleep(600)")
    pub = subprocess.Popen([sys.executable, "-c", code, w.path("dlpackd-A.sock")],
                           stdout=subprocess.PIPE, text=True)
    try:
        check(pub.stdout.readline().strip() == "ready", "publisher: published w/eph")
        with w.slow_link(shaped_rate(BIG)):
            served = status_a(w)["served"]
            tx0 = w.wire_bytes()
            th, res = _fetch_in_thread(w, "A:w/eph", 60)
            mid_transfer(w, th, BIG, tx0, "publisher killed")
            pub.kill()
            pub.wait()
            wait_for(lambda: not a.list("w/eph"), "publisher: its ephemeral entry is gone")
            st = status_a(w)
            moved = w.wire_bytes() - tx0
            check(not a.list("w/eph") and th.is_alive() and st["writing"] >= 1 and
                  st["served"] == served and moved < BIG,
                  f"publisher killed: its entry was gone while the WRITE went on "
                  f"({moved / 2**20:.1f} of {BIG >> 20} MiB across)")
            th.join(90)
            moved = w.wire_bytes() - tx0
        check("r" in res, f"publisher killed during the fetch: the fetch completed "
              f"({moved / 2**20:.1f} MiB across) {res.get('e') or ''}")
        if "r" in res:
            t = b.attach("A:w/eph")
            check(np.all(np.asarray(t) == 5) and t.nbytes == BIG,
                  "from the leased mapping: whole")
            t.release()
        try:
            fetch(w, "A:w/eph", timeout=10)
            check(False, "after the publisher died: FileNotFoundError")
        except FileNotFoundError:
            check(True, "after the publisher died: FileNotFoundError")
    finally:
        if pub.poll() is None:
            pub.kill()
            pub.wait()


def case_importer_killed(w, a, b):
    """The importing bridge SIGKILLed mid-transfer: the exporter aborts, lives on, gives the
    lease back (after its quarantine), and serves the restarted importer (BIG shaped to about
    SHAPED s, killed an eighth of the way, then QUARANTINE and an unshaped refetch: 8 s
    here)."""
    st0 = status_a(w)
    with w.slow_link(shaped_rate(BIG)):
        tx0 = w.wire_bytes()
        th, res = _fetch_in_thread(w, "A:w/big", 60)
        mid_transfer(w, th, BIG, tx0, "importer killed")
        w.kill("bridge-B")
        th.join(30)
        check(isinstance(res.get("e"), ConnectionError),
              f"importer killed: the fetch call failed ({res})")
        # a finished transfer is counted served, never aborted
        check(wait_for(lambda: status_a(w)["aborted"] == st0["aborted"] + 1,
                       "importer killed: A aborts the WRITE"),
              "importer killed: A aborted the WRITE")
    st = status_a(w)
    check(st["served"] == st0["served"], f"importer killed: A served nothing meanwhile "
          f"({st['served']} == {st0['served']})")
    check(wait_for(lambda: refs(a, "w/big") == 0, "importer killed: A's reference back"),
          "importer killed: A's reference to w/big is back")
    check(w.procs["bridge-A"].poll() is None, "importer killed: A's bridge lives on")
    w.start_bridge("B")
    local, _ = fetch(w, "A:w/big", timeout=60)
    t = b.attach(local)
    check(np.all(np.asarray(t) == 3), "importer restarted: w/big whole")
    t.release()


def case_link_down(w, a, b):
    """The link taken down mid-transfer: the fetch fails within its timeout, nothing crashes, after
    the link is back a fetch works, and each bridge, having replaced its NIXL agent, gives every fd
    back once the old agent is destroyed (BIG shaped to about SHAPED s, down an eighth of the way;
    the fetch's timeout, A's abort at its WRITE's deadline, B's quarantine, an unshaped refetch: 22
    s here, the longest case)."""
    time.sleep(1.0)     # (the threads of earlier status calls see their clients go)
    before = {h: fd_state(w, h) for h in "AB"}
    replaced = {h: bridge.status(socket=w.bridge_socket(f"bridge-{h}"))["replaced"]
                for h in "AB"}
    ss0 = {h: sh("ip", "netns", "exec", w.ns[h], "ss", "-tanpe").stdout for h in "AB"}
    st0 = status_a(w)
    with w.slow_link(shaped_rate(BIG)):
        tx0 = w.wire_bytes()
        th, res = _fetch_in_thread(w, "A:w/big", 8)
        mid_transfer(w, th, BIG, tx0, "link down")
        t0 = time.monotonic()
        sh("ip", "-n", w.ns["A"], "link", "set", w.veth["A"], "down")
        try:
            th.join(60)
            dt = time.monotonic() - t0
            check(not th.is_alive(), f"link down mid-way: the fetch returned after {dt:.1f} s "
                  f"(timeout 8 s): {res}")
            # a transfer that had finished would have been published: a fetch that succeeds fails
            check(isinstance(res.get("e"), (TimeoutError, ConnectionError)),
                  f"link down: the fetch failed: {type(res.get('e')).__name__}")
            check(wait_for(lambda: status_a(w)["aborted"] == st0["aborted"] + 1,
                           "link down: A aborts the WRITE"), "link down: A aborted the WRITE")
            check(status_a(w)["served"] == st0["served"], "link down: A served nothing meanwhile")
            check(wait_for(lambda: refs(a, "w/big") == 0, "link down: A's reference back"),
                  "link down: the exporter's lease ended")
            # the worst order: both sides give the memory back while the link is still down, and
            # only then does it come back with whatever A's kernel still had to send
            wait_for(lambda: bridge.status(socket=w.bridge_socket("bridge-B"))["quarantined"] == 0,
                     "link down: B's quarantine emptied")
        finally:     # up again whatever failed: the cases after this one use the link
            sh("ip", "-n", w.ns["A"], "link", "set", w.veth["A"], "up")
    time.sleep(2)       # (not a timing assert: what A's kernel retransmits lands meanwhile)
    local, _ = fetch(w, "A:w/big", timeout=60)
    t = b.attach(local)
    check(np.all(np.asarray(t) == 3), "link back: w/big whole")
    t.release()
    for name in ("bridge-A", "bridge-B"):
        check(w.procs[name].poll() is None, f"link down: {name} lives on")
    # UCX may keep the data connection of the aborted WRITE open in either bridge after the
    # link comes back, which only the end of its NIXL agent closes: each bridge replaced its
    # agent, and destroys the old one once its quarantine and connections let go of it
    for host in "AB":
        sock = w.bridge_socket(f"bridge-{host}")
        # (while the link is down no new agent can be made: it may come a little later)
        check(wait_for(lambda: bridge.status(socket=sock)["replaced"] == replaced[host] + 1,
                       f"link down: bridge-{host} replaces its agent"),
              f"link down: bridge-{host} replaced its agent once "
              f"({bridge.status(socket=sock)['replaced']} times, {replaced[host]} before)")
        if not agents_settled(w, host, before[host], "link down"):
            print(f"before:\n{ss0[host]}\nafter:\n" +
                  sh("ip", "netns", "exec", w.ns[host], "ss", "-tanpe").stdout)


def case_registry(w, a, b):
    """No --peer: B's second bridge finds A's second one in etcd (on host A), and fetches from
    it over UCX; the record goes with the exporter."""
    etcd = shutil.which("etcd")
    check(etcd is not None, "etcd is installed (Debian: etcd-server)")
    if etcd is None:
        return
    url = f"http://{ADDR_A}:{ETCD_PORT}"
    w.start("etcd", "A", [etcd, "--name", "a", "--data-dir", w.path("etcd"),
                          "--listen-client-urls", url, "--advertise-client-urls", url,
                          "--listen-peer-urls", "http://127.0.0.1:2380",
                          "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
                          "--initial-cluster", "a=http://127.0.0.1:2380"])
    common = [sys.executable, "-m", "dlpack_ipc.bridge", "--token-file", w.token,
              "--registry", url, "--lease-ttl", str(w.ttl), "--quarantine", str(QUARANTINE)]
    w.start("bridge-Areg", "A", common + [
        "--socket", w.bridge_socket("bridge-Areg"), "--dlpackd-socket", w.path("dlpackd-A.sock"),
        "--listen", f"{ADDR_A}:{PORT + 1}", "--export", "w/", "--name", "hostA",
        "--registry-names"])
    w.start("bridge-Breg", "B", common + [
        "--socket", w.bridge_socket("bridge-Breg"), "--dlpackd-socket", w.path("dlpackd-B.sock")])

    def registry(name):
        try:
            return bridge.status(socket=w.bridge_socket(name)).get("registry") or {}
        except OSError:         # not listening yet
            return None
    check(wait_for(lambda: registry("bridge-Breg") is not None, "bridge-Breg answers"),
          "B's second bridge answers")
    check(wait_for(lambda: (registry("bridge-Areg") or {}).get("registered"),
                   "bridge-Areg registered"), "A's bridge wrote its record in etcd")
    x = np.random.default_rng(7).integers(0, 255, 1 << 20, dtype=np.uint8)
    gen = a.publish("w/reg", x, replace=True)
    local, rgen = fetch(w, "hostA:w/reg", sock="bridge-Breg")
    check(local == "hostA:w/reg" and rgen == gen, f"fetched by the registered name ({local!r})")
    t = b.attach(local)
    check(np.array_equal(np.asarray(t), x), "the tensor found through etcd has A's bytes")
    t.release()
    st = bridge.status(socket=w.bridge_socket("bridge-Breg"))["registry"]
    check(st["found"] == {"hostA": True}, f"B's bridge found hostA in etcd ({st['found']})")
    y = x[::-1].copy()
    a.publish("w/reg", y, replace=True)
    key = _registry.holders_prefix(_registry.REGISTRY_PREFIX, "w/reg") + "hostA"

    def written():
        return key in sh("ip", "netns", "exec", w.ns["A"], "etcdctl", "--endpoints", url, "get",
                         "--keys-only", key, check_rc=False).stdout
    check(wait_for(written, "w/reg's key written"), "A's bridge wrote w/reg's key")
    local, _ = fetch(w, "*:w/reg", sock="bridge-Breg")
    t = b.attach(local)
    check(local == "hostA:w/reg" and np.array_equal(np.asarray(t), y),
          f"fetched as *:w/reg from the bridge that holds it ({local!r})")
    t.release()
    try:
        fetch(w, "hostZ:w/reg", timeout=5, sock="bridge-Breg")
        check(False, "a name nobody registered is refused")
    except FileNotFoundError as e:
        check(url in str(e), f"a name nobody registered: FileNotFoundError naming etcd ({e})")
    w.kill("bridge-Areg", signal.SIGTERM)
    left = sh("ip", "netns", "exec", w.ns["A"], "etcdctl", "--endpoints", url, "get",
              "--prefix", "/dlpackd-bridge/", check_rc=False)
    check(left.returncode == 0 and left.stdout.strip() == "",
          f"the stopped exporter's record is gone ({left.stdout.strip()!r} {left.stderr.strip()})")
    w.kill("bridge-Breg", signal.SIGTERM)
    for name in ("bridge-A", "bridge-B"):
        check(w.procs[name].poll() is None, f"registry: {name} lives on")
    w.kill("etcd", signal.SIGTERM)


def timed(case, w, a, b):
    t0 = time.monotonic()
    case(w, a, b)
    print(f"info: {case.__name__} took {time.monotonic() - t0:.1f} s", flush=True)


def main():
    dlpackd = sys.argv[1]
    # device entries (case_device) through the fake CUDA driver, in every process here
    if not os.environ.get("FAKE_CUDA_LIB"):
        print("FAKE_CUDA_LIB is not set: ctest sets it (by hand: build/tests/libfake_cuda.so)",
              file=sys.stderr)
        return 2
    os.environ["DLPC_CUDA_LIBRARY"] = os.environ["FAKE_CUDA_LIB"]
    w = World(dlpackd)
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        w.up()
        a, b = w.client("A"), w.client("B")
        timed(case_tensor, w, a, b)
        timed(case_nixl_metadata, w, a, b)
        timed(case_data_ports, w, a, b)
        time.sleep(1.0)     # the threads of the status calls above see their clients go
        fd_b = fd_state(w, "B")
        fdl_b = fd_list(w.procs["bridge-B"])
        ss_b = sh("ip", "netns", "exec", w.ns["B"], "ss", "-tanp").stdout
        fd_a = fds(w.procs["bridge-A"])
        timed(case_64m, w, a, b)
        timed(case_per_uid, w, a, b)
        timed(case_state_dict, w, a, b)
        timed(case_device, w, a, b)
        timed(case_errors, w, a, b)
        timed(case_wrong_token, w, a, b)
        timed(case_follow, w, a, b)
        timed(case_limits, w, a, b)
        timed(case_bad_frames, w, a, b)
        timed(case_lease_ttl, w, a, b)
        timed(case_replace_during, w, a, b)
        timed(case_registry, w, a, b)
        check(wait_for(lambda: fds(w.procs["bridge-A"]) == fd_a, "A's fds"),
              f"no fd leaked in A's bridge ({fds(w.procs['bridge-A'])} == {fd_a})")
        timed(case_exporter_killed, w, a, b)
        timed(case_publisher_killed, w, a, b)
        wait_for(lambda: bridge.status(socket=w.bridge_socket("bridge-B"))["quarantined"] == 0,
                 "B's quarantine emptied")
        # B replaced its NIXL agent after the aborted fetches: its fds are those of the new one
        if not agents_settled(w, "B", fd_b, "no fd leaked in B's bridge"):
            print("before:", fdl_b, "\nafter: ", fd_list(w.procs["bridge-B"]))
            print(ss_b + "\n" + sh("ip", "netns", "exec", w.ns["B"], "ss", "-tanp").stdout)
        timed(case_link_down, w, a, b)
        for name in ("bridge-A", "bridge-B", "bridge-Bwrong"):
            check(w.procs[name].poll() is None, f"{name} did not crash")
        for name in ("bridge-A", "bridge-B"):
            check(wait_for(lambda: bridge.status(socket=w.bridge_socket(name))["registered"] == 0,
                           f"{name}'s registrations"),
                  f"{name} gave every NIXL registration back")
        timed(case_importer_killed, w, a, b)
    except BaseException:
        signal.signal(signal.SIGTERM, old)
        w.close(show_logs=True)
        raise
    else:
        signal.signal(signal.SIGTERM, old)
        w.close()
    left = sh("ip", "netns", "list").stdout
    check(w.ns["A"] not in left and w.ns["B"] not in left, "the namespaces are gone")
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
