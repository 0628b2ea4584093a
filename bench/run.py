#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Run every benchmark side by side against a private dlpackd and report ratios.

    /usr/bin/python3 bench/run.py [--quick] [--build DIR] [--out DIR] [--python PYTHON]
                                  [--shmem-thp MODE]

Starts dlpackd on a socket in a temporary directory, runs the C harness (bench_c), the
Python harness (bench_py.py), its peer groups against Ray, safetensors and
torch.multiprocessing (bench_py.py --peers, with --python), the model-loading one
(bench_model.py), the weight-sync one (weight_sync.py) and, as root where the bridge's venv is
(ctest -R bridge_venv), dlpackd-bridge between two network namespaces (bridge.py), prints a
markdown table of every
measurement and of the targets (each a ratio measured in this run), the peers' among them, and
writes bench.json and bench.png into --out (default docs/). Stops the daemon and removes what it
created; exits non-zero if a measurement is missing or a process or shared memory of the run
outlives it. A peer that cannot run (Ray not installed for --python) is recorded as skipped with
the reason, its targets as not measured.
--quick is the smoke test the test suite runs: small sizes, few repetitions, no plot.
"""
import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 1 << 20
FOOTPRINT_ENTRIES = 100_000
SHMEM_THP = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
PROCESS_GRACE_S = 10            # how long the run's processes may take to end after it
EXEC_SETTLE_TRIES = 20          # reads, 10 ms apart, of a process caught inside execve()
EXEC_SETTLE_AGE_S = 2.0         # only a process started this recently may be inside it


def human(n):
    if n is None:
        return "-"
    for unit, k in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n // k} {unit}"
    return f"{n} B"


def fd_limit_for_daemon():
    """A child hook: enough fds for one memfd per entry of the footprint test (root only)."""
    want = FOOTPRINT_ENTRIES + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < want and os.geteuid() == 0:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        except (ValueError, OSError):
            pass


class FdStore:
    """systemd's fd store, as the daemon sees it: a notification socket that keeps the fds sent
    with FDSTORE=1 and drops them on FDSTOREREMOVE=1, read by a thread as systemd reads it."""

    def __init__(self, path, cpu=None):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.path, self.fds, self.stop, self.cpu = path, {}, False, cpu
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        # systemd runs beside the daemon, not in its place: off the CPU the latency runs use
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})
        self.sock.settimeout(0.05)
        while not self.stop:
            try:
                msg, fds, _, _ = socket.recv_fds(self.sock, 4096, 8)
            except socket.timeout:
                continue
            lines = dict(l.split("=", 1) for l in msg.decode().splitlines() if "=" in l)
            name = lines.get("FDNAME", "stored")
            if lines.get("FDSTOREREMOVE") == "1":
                for fd in self.fds.pop(name, []):
                    os.close(fd)
            if lines.get("FDSTORE") == "1":
                self.fds.setdefault(name, []).extend(fds)
            else:
                for fd in fds:
                    os.close(fd)

    def close(self):
        self.stop = True
        self.thread.join()
        for fds in self.fds.values():
            for fd in fds:
                os.close(fd)
        self.sock.close()


def start_daemon(build, tmp, store=None):
    sock = os.path.join(tmp, "dlpackd.sock" if store is None else "dlpackd-store.sock")
    log = open(os.path.join(tmp, "dlpackd.log"), "a")
    env = dict(os.environ)
    if store is not None:
        env.update(NOTIFY_SOCKET=store.path, FDSTORE="4096")
    # one uid publishes the footprint run's entries: it may use the whole fd budget, not the
    # share (--max-fd-share-per-uid) a uid gets when others need room too
    proc = subprocess.Popen([os.path.join(build, "dlpackd"), "--socket", sock,
                             "--log-level", "warning", "--max-fd-share-per-uid", "100",
                             "--max-memory-per-uid", "1T"],
                            stdout=log, stderr=log, preexec_fn=fd_limit_for_daemon, env=env)
    for _ in range(500):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            return proc, sock
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.01)
    raise SystemExit("bench: dlpackd did not start; see " + log.name)


def stop_daemon(proc):
    proc.send_signal(signal.SIGTERM)
    if proc.wait(timeout=30) != 0:
        raise SystemExit(f"bench: dlpackd exited with {proc.returncode}")


def daemon_fd_room(proc):
    with open(f"/proc/{proc.pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    return 1024


HARNESS_PIDS = []               # every harness this run started (shm_left_behind)


def run_rows(cmd, env, pin=False):
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                          preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if pin else None) as p:
        HARNESS_PIDS.append(p.pid)
        out = p.communicate()[0]
    if p.returncode:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


# bench/bridge.py's fetch against a plain TCP stream over the same veth: the goal (issue 31)
BRIDGE_GOAL = 0.7
BRIDGE_SIZES = "64M,1G"
BRIDGE_TIMEOUT_S = 900


def bridge_rows(build, env):
    """bench/bridge.py's figures as rows, or one row saying why it did not run (not root, no
    bridge venv): dlpackd-bridge fetching between two network namespaces over NIXL, beside a
    TCP stream over the same veth. A run that fails fails the bench."""
    py = os.path.join(build, "bridgevenv", "venv", "bin", "python")
    why = ("not root: the two network namespaces need it" if os.geteuid() != 0 else
           None if os.path.exists(py) else
           f"no bridge venv at {py} (ctest --test-dir {build} -R bridge_venv makes it)")
    if why:
        print(f"bench: bridge: skipped: {why}", file=sys.stderr)
        return [{"group": "bridge", "impl": "fetch", "skipped": why}]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [py, os.path.join(HERE, "bridge.py"), os.path.join(build, "dlpackd"),
               "--sizes", BRIDGE_SIZES, "--out", out.name]
        with subprocess.Popen(cmd, env=env, stdout=sys.stderr) as p:
            try:
                rc = p.wait(BRIDGE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # SIGTERM first: bridge.py takes its namespaces and processes down on the way out
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                rc = None
        if rc == 77:  # the namespaces cannot be made here (no `ip`, no CAP_NET_ADMIN)
            why = "bridge.py could not make the network namespaces (its message is above)"
            print(f"bench: bridge: skipped: {why}", file=sys.stderr)
            return [{"group": "bridge", "impl": "fetch", "skipped": why}]
        if rc != 0:
            # no figure: the run fails once the others are printed and saved
            return [{"group": "bridge", "impl": "fetch",
                     "failed": f"bridge.py exited {rc}" if rc is not None else
                               f"bridge.py took over {BRIDGE_TIMEOUT_S} s"}]
        got = json.load(open(out.name))
    rows = []
    for r in got["rows"]:
        rows.append({"group": "bridge", "impl": "socket", "size": r["size"],
                     "best_s": r["socket_s"], "gbps": r["socket_gbps"]})
        rows.append({"group": "bridge", "impl": "fetch", "size": r["size"],
                     "best_s": r["fetch_s"], "gbps": r["fetch_gbps"]})
    rows.append({"group": "bridge", "impl": "fetch_attach", "size": 4096,
                 "median_us": got["small_4k_s"] * 1e6})
    return rows


def bridge_table(rows):
    """The bridge's figures (or why they are missing) and its checks: (target, ratio, met)."""
    skipped = next((r["skipped"] for r in rows if r.get("group") == "bridge" and
                    "skipped" in r), None)
    if skipped:
        return f"dlpackd-bridge between two network namespaces: skipped: {skipped}", []
    failed = next((r["failed"] for r in rows if r.get("group") == "bridge" and
                   "failed" in r), None)
    if failed:
        return f"dlpackd-bridge between two network namespaces: FAILED: {failed}", []
    sizes = sorted({r["size"] for r in rows if r.get("group") == "bridge" and
                    r["impl"] == "fetch"})
    lines = ["| dlpackd-bridge, namespace B fetches from A over NIXL (best of 3) | " +
             " | ".join(human(n) for n in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    checks = []
    for impl, desc in (("socket", "a TCP stream over the same veth, GB/s"),
                       ("fetch", "bridge.fetch(): layout, allocation, WRITE, publish, GB/s")):
        lines.append(f"| {desc} | " + " | ".join(
            f"{pick(rows, 'bridge', impl, n)['gbps']:.2f}" for n in sizes) + " |")
    for n in sizes:
        fetch, sock = (pick(rows, "bridge", impl, n) for impl in ("fetch", "socket"))
        ratio = fetch["gbps"] / sock["gbps"]
        checks.append((f"bridge fetch / TCP stream, {human(n)}", ratio,
                       ratio >= BRIDGE_GOAL))
    small = pick(rows, "bridge", "fetch_attach", 4096)
    lines.append(f"\n4 KiB entry, fetch + attach to a usable array: "
                 f"{small['median_us'] / 1e3:.2f} ms (median of 20)")
    lines += ["", "| bridge target | ratio | limit | met |", "|---|---:|---:|:---:|"]
    lines += [f"| {t} | {r:.2f} | ≥ {BRIDGE_GOAL} | {'yes' if m else 'no'} |"
              for t, r, m in checks]
    return "\n".join(lines), checks


def shm_left_behind(before):
    """What this run left in /dev/shm: the new names that carry the pid of one of its harnesses
    (each names what it makes there after its pid), so that other programs' shared memory,
    made meanwhile, is not taken for the run's."""
    pids = re.compile(r"[-_](" + "|".join(map(str, HARNESS_PIDS)) + r")(?![0-9])")
    return sorted(n for n in set(os.listdir("/dev/shm")) - before
                  if HARNESS_PIDS and pids.search(n))


def pick(rows, group, impl, size=None, clients=None):
    for r in rows:
        if r.get("group") == group and r.get("impl") == impl and \
           (size is None or r.get("size") == size) and \
           (clients is None or r.get("clients") == clients):
            return r
    return None


def metric(rows, name):
    for r in rows:
        if r.get("group") == "footprint" and r.get("metric") == name:
            return r["value"]
    return None


def median_ratio(rows, group, impl, base, size):
    a, b = pick(rows, group, impl, size), pick(rows, group, base, size)
    return a["median_us"] / b["median_us"] if a and b and b["median_us"] else None


def targets(rows, sizes, map_sizes):
    """(description, measured ratio, limit, met) for each target of the benchmark issue."""
    out = []

    def ratio(a, b):
        return a / b if a is not None and b else None

    def add(desc, value, limit, lower_is_better=True):
        met = value is not None and (value <= limit if lower_is_better else value >= limit)
        out.append((desc, value, limit, met, lower_is_better))

    for s in sizes:
        f, d = pick(rows, "attach_c", "floor", s), pick(rows, "attach_c", "dlpc", s)
        add(f"C attach+release / floor, {human(s)}",
            ratio(d and d["median_us"], f and f["median_us"]), 1.5)
    small, big = pick(rows, "attach_c", "dlpc", sizes[0]), pick(rows, "attach_c", "dlpc", sizes[-1])
    add(f"C attach {human(sizes[-1])} / attach {human(sizes[0])}",
        ratio(big and big["median_us"], small and small["median_us"]), 1.3)
    for s in sizes:
        p, m = pick(rows, "attach_py", "dlpack_ipc", s), pick(rows, "attach_py", "shared_memory", s)
        add(f"Python attach+from_dlpack+release / SharedMemory, {human(s)}",
            ratio(p and p["median_us"], m and m["median_us"]), 1.0)
    # the cache of idle references (issue 17.3)
    for s in sizes:
        r = pick(rows, "reattach_c", "dlpc_cached", s)
        add(f"C warm re-attach + release, {human(s)}, us", r and r["median_us"], 2.0)
    small, big = (pick(rows, "reattach_c", "dlpc_cached", s) for s in (sizes[0], sizes[-1]))
    add(f"C warm re-attach {human(sizes[-1])} / {human(sizes[0])}",
        ratio(big and big["median_us"], small and small["median_us"]), 1.3)
    p, m = (pick(rows, "attach_py", i, sizes[0]) for i in ("dlpack_ipc_cached", "shared_memory"))
    add(f"Python re-attach+from_dlpack+release / SharedMemory, {human(sizes[0])}",
        ratio(p and p["median_us"], m and m["median_us"]), 0.5)
    for s in sizes:
        t, o = pick(rows, "handoff", "torch_multiprocessing", s), pick(rows, "handoff", "dlpack_ipc", s)
        add(f"torch.multiprocessing hand-off / ours, {human(s)}",
            ratio(t and t["median_us"], o and o["median_us"]), 20.0, lower_is_better=False)
    # issue 17: a channel hand-off against torch.multiprocessing's queue and against the floor,
    # on a channel the daemon queues (direct=False) and on a direct one (channel()'s default
    # kind has its own targets in peer_targets)
    for impl, kind in (("dlpack_channel_queued", "queued channel"),
                       ("dlpack_channel_direct", "direct channel")):
        for s in sizes:
            t, o = pick(rows, "channel", "torch_multiprocessing", s), pick(rows, "channel", impl, s)
            add(f"torch.multiprocessing queue hand-off / {kind} hand-off, {human(s)}",
                ratio(t and t["median_us"], o and o["median_us"]), 10.0, lower_is_better=False)
        for s in sizes:
            o, f = pick(rows, "channel", impl, s), pick(rows, "channel", "fd_pass_mmap", s)
            add(f"{kind} hand-off / floor (fd pass + mmap), {human(s)}",
                ratio(o and o["median_us"], f and f["median_us"]), 2.0)
    b, one = pick(rows, "bundle_c", "attach_bundle"), pick(rows, "bundle_c", "single_x1")
    add("bundle of 500 / one single attach (C)", ratio(b and b["median_us"], one and one["median_us"]),
        3.0)
    b, one = pick(rows, "bundle", "attach_dict"), pick(rows, "bundle", "single_x1")
    add("bundle of 500 / one single attach (Python)",
        ratio(b and b["median_us"], one and one["median_us"]), 3.0)
    mc, mf, cp, zc = (pick(rows, "publish", i)
                      for i in ("memcpy", "memcpy_fresh", "dlpc_copy", "dlpc_alloc"))
    add(f"publish copy path / memcpy, {human(mc and mc['size'])}",
        ratio(cp and cp["median_us"], mc and mc["median_us"]), 1.25)
    add(f"publish copy path / memcpy into fresh memory, {human(mf and mf['size'])} (not a target of "
        "the issue: the floor a copy into new shared memory can reach)",
        ratio(cp and cp["median_us"], mf and mf["median_us"]), 1.25)
    tq, cp_ = pick(rows, "pipeline", "torch_queue"), pick(rows, "pipeline", "channel_pool")
    add("steady pipeline of 64 MiB batches, batches/s, channel with pool / torch DataLoader-style "
        "queue", ratio(tq and tq["median_us"], cp_ and cp_["median_us"]), 3.0,
        lower_is_better=False)
    pl = pick(rows, "publish", "dlpc_pool")
    add(f"publish into a recycled channel buffer (fill + send) / memcpy, {human(mc and mc['size'])}",
        ratio(pl and pl["median_us"], mc and mc["median_us"]), 1.25)
    att = pick(rows, "attach_c", "dlpc", sizes[0])
    add("zero-copy publish / attach", ratio(zc and zc["median_us"], att and att["median_us"]), 2.0)
    # the integrity issue: copy-on-write mappings at no cost to readers (within 10% here)
    add(f"attach + release, private / shared mapping, {human(map_sizes[0])}",
        median_ratio(rows, "mapping_attach", "private", "shared", map_sizes[0]), 1.1)
    for s in map_sizes:
        add(f"attach + full read + release, private / shared mapping, {human(s)}",
            median_ratio(rows, "mapping_read", "private", "shared", s), 1.1)
    tf, td = pick(rows, "throughput", "floor", clients=8), pick(rows, "throughput", "dlpc", clients=8)
    add("throughput at 8 clients / floor server's", ratio(td and td["ops_per_s"], tf and tf["ops_per_s"]),
        0.6, lower_is_better=False)
    tc = pick(rows, "throughput", "dlpc_cached", clients=8)
    add("throughput at 8 clients, cache on / off (a report, no target)",
        ratio(tc and tc["ops_per_s"], td and td["ops_per_s"]), 1.0, lower_is_better=False)
    fo, gb = pick(rows, "weight_sync", "follow"), pick(rows, "weight_sync", "gloo_broadcast")
    add(f"weight sync to {fo and fo['workers']} workers, gloo broadcast / follow() (publish to "
        "the last forward pass on the new weights)",
        ratio(gb and gb["median_ms"], fo and fo["median_ms"]), 1.0, lower_is_better=False)
    # a model's weights in every worker, to its first forward pass, against the
    # forward pass of a private copy already in memory (torch.load's, warm)
    ours, private = pick(rows, "model_load", "dlpack_ipc"), pick(rows, "model_load", "torch_load")
    add(f"{ours and ours.get('weights_mib', 0):.0f} MiB state dict to {ours and ours['workers']} "
        "workers: ready + first forward pass / a private warm copy's forward pass",
        ratio(ours and ours.get("median_ready_first_ms"),
              private and private.get("median_warm_forward_ms")), 1.2)
    add("daemon idle RSS, MiB", metric(rows, "idle_rss"), 4.0)
    add("daemon RSS per entry, KiB", (metric(rows, "rss_per_entry") or 0) / 1024 or None, 1.0)
    add(f"LIST of {int(metric(rows, 'entries') or 0)} entries, ms", metric(rows, "list_ms"), 100.0)
    return out


# ---- the peers (Ray, safetensors, torch.multiprocessing) and their targets ----------

PEER_IMPLS = {
    "fresh": [("dlpack_channel", "channel(), the default kind"),
              ("dlpack_channel_direct", "direct channel"),
              ("dlpack_channel_queued", "queued channel"),
              ("ray", "ray.put + an actor's ray.get"),
              ("torch_multiprocessing", "torch.multiprocessing Queue")],
    "publish_fresh": [("dlpack_ipc", "publish (copy path)"), ("ray", "ray.put")],
    "state_dict": [("dlpack_ipc", "publish_dict"), ("ray", "ray.put of the dict"),
                   ("ray_numpy", "ray.put of the dict as numpy arrays"),
                   ("safetensors", "safetensors save_file to /dev/shm")],
    "readers": [("dlpack_ipc", "attach + np.from_dlpack + release (cache on)"),
                ("shared_memory", "stdlib SharedMemory + ndarray + close"),
                ("ray", "ray.get of the same ObjectRef")],
}


def fmt_us(us):
    return "-" if us is None else f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.1f} µs"


def peer_cell(r, key="median_us"):
    if r is None:
        return "-"
    if "skipped" in r:
        return "skipped"
    return f"{r[key]:,.0f}/s" if key == "ops_per_s" else fmt_us(r[key])


def peers_table(rows):
    """The peer groups of bench_py.py --peers, by size."""
    out = []
    for group, title in (("fresh", "hand-off of a fresh array (send copies), median"),
                         ("publish_fresh", "publish of a fresh array, median"),
                         ("state_dict", "publish of a state dict, median"),
                         ("readers", "8 readers re-attaching one entry, attaches/s")):
        sizes = sorted({r["size"] for r in rows if r.get("group") == group})
        if not sizes:
            continue
        key = "ops_per_s" if group == "readers" else "median_us"
        lines = [f"| {title} | " + " | ".join(human(s) for s in sizes) + " |",
                 "|---|" + "---:|" * len(sizes)]
        for impl, desc in PEER_IMPLS[group]:
            lines.append(f"| {desc} | " +
                         " | ".join(peer_cell(pick(rows, group, impl, s), key) for s in sizes)
                         + " |")
        out.append("\n".join(lines))
    why = sorted({r["skipped"] for r in rows if "skipped" in r})
    out += [f"skipped: {w}" for w in why]
    return "\n\n".join(out)


def peer_targets(rows):
    """The copy path's and the default channel's targets against the peers, from this run:
    dicts of target, ours, peer (µs), ratio, limit, met and, where a peer could not run,
    skipped (the reason)."""
    out = []

    def add(target, ours, peer, limit, higher=False, key="median_us"):
        skipped = next((r["skipped"] for r in (ours, peer) if r and "skipped" in r), None)
        a = ours.get(key) if ours and not skipped else None
        b = peer.get(key) if peer and not skipped else None
        ratio = (b / a if higher else a / b) if a and b else None
        met = ratio is not None and (ratio >= limit if higher else ratio <= limit)
        out.append({"target": target, "ours_us": a, "peer_us": b, "ratio": ratio,
                    "limit": limit, "higher_is_better": higher, "met": met,
                    "skipped": skipped})

    def largest(group, want):
        sizes = [r["size"] for r in rows if r.get("group") == group]
        return want if want in sizes else max(sizes, default=None)

    s = largest("fresh", 64 * MIB)
    ours = pick(rows, "fresh", "dlpack_channel", s)
    add(f"fresh-array hand-off {human(s)}, channel() ({ours and ours.get('kind')}) / "
        "ray.put + actor ray.get", ours, pick(rows, "fresh", "ray", s), 1.0)
    s = largest("publish_fresh", 64 * MIB)
    add(f"publish of a fresh {human(s)} array / ray.put", pick(rows, "publish_fresh",
        "dlpack_ipc", s), pick(rows, "publish_fresh", "ray", s), 1.0)
    r = pick(rows, "state_dict", "dlpack_ipc")
    s = r and r["size"]
    # Ray's faster way to put it: the dict of torch tensors or the same as numpy arrays
    peer = min((p for p in (pick(rows, "state_dict", i, s) for i in ("ray", "ray_numpy")) if p),
               key=lambda p: p.get("median_us", float("inf")), default=None)
    add(f"{human(s)} state dict ({r and r.get('tensors')} tensors), publish_dict / ray.put "
        f"({'numpy arrays' if peer and peer['impl'] == 'ray_numpy' else 'torch tensors'})",
        r, peer, 1.0)
    cp, mc = pick(rows, "publish", "dlpc_copy"), pick(rows, "publish", "memcpy")
    add(f"{human(cp and cp['size'])} copy-path publish / warm memcpy", cp, mc, 1.5)
    for s in sorted({r["size"] for r in rows if r.get("group") == "channel"}):
        ours = pick(rows, "channel", "dlpack_channel", s)
        kind = ours and ours.get("kind")
        add(f"default channel ({kind}), torch.multiprocessing / channel, {human(s)}", ours,
            pick(rows, "channel", "torch_multiprocessing", s), 10.0, higher=True)
        add(f"default channel ({kind}) / floor (fd pass + mmap), {human(s)}", ours,
            pick(rows, "channel", "fd_pass_mmap", s), 1.5)
    return out


def peer_targets_table(checks):
    lines = ["| target against the peers | ours | peer | ratio | limit | met |",
             "|---|---:|---:|---:|---:|:---:|"]
    for c in checks:
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}"
        met = ("not measured (a peer skipped: see above)" if c["skipped"] else
               "yes" if c["met"] else "no" if c["ratio"] is not None else "not measured")
        lines.append(f"| {c['target']} | {fmt_us(c['ours_us'])} | {fmt_us(c['peer_us'])} | "
                     f"{ratio} | {'≥' if c['higher_is_better'] else '≤'} {c['limit']:g} | "
                     f"{met} |")
    return "\n".join(lines)


PF_KTHREAD = 0x00200000         # a kernel thread, in /proc/PID/stat's flags


def _inside_exec(pid):
    """Whether an empty environment may mean a process caught inside execve(): started within
    EXEC_SETTLE_AGE_S, and neither a kernel thread nor a zombie, which show an empty one for
    good (as does a process started with an empty environment)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return fields[0] != b"Z" and not int(fields[6]) & PF_KTHREAD and age < EXEC_SETTLE_AGE_S


def _environ_and_cmdline(pid):
    """A process's environment and command line, or None when it is gone or not ours to read.
    A process in the middle of execve() shows an empty environment for a moment (the new
    image's is set up after the old one is dropped): it is read again, briefly, until it shows
    one."""
    try:
        for _ in range(EXEC_SETTLE_TRIES):
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if environ or not _inside_exec(pid):
                break
            time.sleep(0.01)
    except OSError:  # gone meanwhile, or not ours to read
        return None
    return environ, cmd


def leftover_processes(marker):
    """Processes that carry this run's marker in their environment (every process the
    harnesses start does, Ray's own included) and are still running: (pid, command line)."""
    key = f"DLPC_BENCH_RUN={marker}".encode()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        got = _environ_and_cmdline(d)
        if got is None or key not in got[0].split(b"\0"):
            continue
        found.append((int(d), got[1].replace(b"\0", b" ").decode(errors="replace").strip()))
    return found


def check_processes(marker):
    """The processes of the run that outlived it (after a grace period for Ray's shutdown), as
    lines for the run's failure; they are killed, by pid."""
    deadline = time.monotonic() + PROCESS_GRACE_S
    while True:
        left = leftover_processes(marker)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return [f"process left behind (killed): {pid} {cmd[:120]}" for pid, cmd in left]


def mapping_table(rows, map_sizes):
    """The shared read-only mapping against the copy-on-write ones, by size."""
    lines = ["| mapping (C) | " + " | ".join(human(s) for s in map_sizes) + " |",
             "|---|" + "---:|" * len(map_sizes)]
    for group, what in (("mapping_attach", "attach + first byte + release"),
                        ("mapping_read", "attach + full read (every cache line) + release")):
        for impl, desc in (("shared", "shared, PROT_READ (default)"),
                           ("private", "DLPC_ATTACH_PRIVATE"), ("guarded", "DLPC_ATTACH_GUARDED")):
            cells = []
            for s in map_sizes:
                r = pick(rows, group, impl, s)
                cells.append(f"{r['median_us']:.1f} ({r['p99_us']:.1f})" if r else "-")
            lines.append(f"| {what}, {desc}, µs median (p99) | " + " | ".join(cells) + " |")
        for impl in ("private", "guarded"):
            cells = [median_ratio(rows, group, impl, "shared", s) for s in map_sizes]
            lines.append(f"| {what}, {impl} / shared | " +
                         " | ".join("-" if c is None else f"{c:.2f}" for c in cells) + " |")
    cells = []
    for s in map_sizes:
        f = [pick(rows, "mapping_read", i, s) for i in ("shared", "private")]
        cells.append(" / ".join(f"{r['minflt']:.0f}" for r in f) if all(f) else "-")
    lines.append("| minor faults per full read, shared / private | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(rows, sizes, map_sizes, checks):
    lines = ["| measurement | " + " | ".join(human(s) for s in sizes) + " |",
             "|---|" + "---:|" * len(sizes)]
    latency = [("attach_c", "floor", "floor: AF_UNIX fd + mmap/munmap (C)"),
               ("attach_c", "dlpc", "dlpc_attach + read + release (C)"),
               ("reattach_c", "dlpc_cached", "warm re-attach from the cache + read + release (C)"),
               ("attach_py", "dlpack_ipc", "attach + np.from_dlpack + release (Python)"),
               ("attach_py", "dlpack_ipc_cached", "re-attach from the cache + np.from_dlpack + "
                "release (Python)"),
               ("attach_py", "shared_memory", "stdlib SharedMemory + ndarray + close"),
               ("handoff", "dlpack_ipc", "hand-off to a process: name + attach (ours)"),
               ("handoff", "torch_multiprocessing", "hand-off: torch.multiprocessing queue"),
               ("channel", "dlpack_channel",
                "hand-off over channel()'s default kind, socket ack (ours)"),
               ("channel", "dlpack_channel_queued",
                "hand-off over a queued channel (direct=False), socket ack (ours)"),
               ("channel", "dlpack_channel_direct",
                "hand-off over a direct channel (direct=True), socket ack (ours)"),
               ("channel", "dlpack_channel_direct_fresh",
                "the same, receiver's caches off: a fresh mapping per message (ours)"),
               ("channel", "torch_multiprocessing",
                "hand-off: torch.multiprocessing queue, socket ack"),
               ("channel", "fd_pass_mmap", "hand-off floor: fd pass + mmap, socket ack"),
               ("pipe_copy", "multiprocessing_pipe", "copy through multiprocessing.Pipe")]
    for group, impl, desc in latency:
        cells = []
        for s in sizes:
            r = pick(rows, group, impl, s)
            cells.append(f"{r['median_us']:.1f} ({r['p99_us']:.1f})" if r else "-")
        lines.append(f"| {desc}, µs median (p99) | " + " | ".join(cells) + " |")
    out = ["\n".join(lines), ""]
    other = ["| measurement | median µs | p99 µs |", "|---|---:|---:|"]
    for group, impl, desc in [("bundle_c", "attach_bundle",
                               "dlpc_attach_bundle of a 500-tensor bundle, every tensor taken and "
                               "released (C)"),
                              ("bundle_c", "single_x1", "one dlpc_attach + release (C)"),
                              ("bundle", "attach_dict", "attach_dict of a 500-tensor bundle"),
                              ("bundle", "single_x500", "500 single attaches"),
                              ("bundle", "single_x1", "one single attach"),
                              ("publish", "memcpy", "one memcpy (warm destination)"),
                              ("publish", "memcpy_fresh", "one memcpy into fresh memory"),
                              ("publish", "dlpc_copy", "dlpc_publish, copy path"),
                              ("publish", "dlpc_alloc", "dlpc_publish of dlpc_alloc memory"),
                              ("publish", "dlpc_alloc_written",
                               "dlpc_publish of dlpc_alloc memory written first"),
                              ("pipeline", "torch_queue",
                               "64 MiB batch, DataLoader-style: new shared tensor, filled, "
                               "torch.multiprocessing Queue (time between batches)"),
                              ("pipeline", "channel_pool",
                               "64 MiB batch filled into a recycled buffer, channel (time "
                               "between batches)"),
                              ("publish", "dlpc_pool",
                               "fill a recycled channel buffer (dlpc_channel_alloc) + dlpc_send"),
                              ("publish_small", "publish", "dlpc_publish, copy path, no fd store"),
                              ("publish_small", "publish_fdstore",
                               "dlpc_publish, copy path, with systemd's fd store"),
                              ("publish_small", "unpublish", "dlpc_unpublish, no fd store"),
                              ("publish_small", "unpublish_fdstore",
                               "dlpc_unpublish, with systemd's fd store")]:
        r = pick(rows, group, impl)
        if r:
            size = f", {human(r['size'])}" if r.get("size") else ""
            other.append(f"| {desc}{size} | {r['median_us']:.1f} | {r['p99_us']:.1f} |")
    out += ["\n".join(other), "", mapping_table(rows, map_sizes), ""]
    tp = ["| clients | floor ops/s | dlpackd ops/s | ratio | cache on, ops/s | cache on / off |",
          "|---:|---:|---:|---:|---:|---:|"]
    for n in (1, 2, 4, 8):
        f, d = pick(rows, "throughput", "floor", clients=n), pick(rows, "throughput", "dlpc", clients=n)
        cc = pick(rows, "throughput", "dlpc_cached", clients=n)
        if f and d:
            tp.append(f"| {n} | {f['ops_per_s']:.0f} | {d['ops_per_s']:.0f} | "
                      f"{d['ops_per_s'] / f['ops_per_s']:.2f} | "
                      f"{cc['ops_per_s'] if cc else 0:.0f} | "
                      f"{cc['ops_per_s'] / d['ops_per_s'] if cc else 0:.2f} |")
    out += ["\n".join(tp), ""]
    tg = ["| target | measured | limit | met |", "|---|---:|---:|:---:|"]
    for desc, value, limit, met, lower in checks:
        v = "-" if value is None else f"{value:.2f}"
        tg.append(f"| {desc} | {v} | {'≤' if lower else '≥'} {limit:g} | {'yes' if met else 'no'} |")
    out += [model_table(rows), "", sync_table(rows), ""]
    out.append("\n".join(tg))
    return "\n".join(out)


MODEL_IMPLS = [("dlpack_ipc", "dlpack_ipc.torch.attach_module into a meta model (populated)"),
               ("dlpack_ipc_lazy", "the same, attach_module(populate=False)"),
               ("torch_load", "torch.load from /dev/shm + load_state_dict (a private copy)"),
               ("torch_load_mmap", "torch.load(mmap=True) from /dev/shm, assign=True"),
               ("safetensors", "safetensors load_file from /dev/shm, assign=True"),
               ("torch_mp", "torch.multiprocessing: model.share_memory(), Queue"),
               ("ray", "Ray: ray.put of the numpy state dict, ray.get in actors")]


def model_table(rows):
    """Loading one model's weights in each of several workers, to its first forward pass."""
    got = {r["impl"]: r for r in rows if r.get("group") == "model_load"}
    ours, private = got.get("dlpack_ipc"), got.get("torch_load")
    if not ours or "skipped" in ours:
        return ""
    warm = private.get("median_warm_forward_ms") if private else None
    lines = [f"| a {ours['weights_mib']:.0f} MiB state dict into each of {ours['workers']} "
             "workers, medians | ready, ms | first forward, ms | ready + first forward, ms | "
             "/ private warm forward | minor faults | warm forward, ms | USS growth per worker, "
             "MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for impl, desc in MODEL_IMPLS:
        r = got.get(impl)
        if r and "skipped" in r:
            lines.append(f"| {desc} | skipped: {r['skipped']} | | | | | | |")
        elif r:
            ratio = f"{r['median_ready_first_ms'] / warm:.2f}" if warm else "-"
            lines.append(f"| {desc} | {r['median_ready_ms']:.1f} | "
                         f"{r['median_first_forward_ms']:.1f} | {r['median_ready_first_ms']:.1f} | "
                         f"{ratio} | {r['median_faults']:.0f} | {r['median_warm_forward_ms']:.1f} | "
                         f"{r['median_uss_delta_mib']:.1f} |")
    return "\n".join(lines)


SYNC_IMPLS = [("follow", "dlpack_ipc.torch: share_module(replace=True), workers follow()"),
              ("follow_bucket", "the same, published from a to_shared() bucket"),
              ("gloo_broadcast", "torch.distributed.broadcast over gloo, per parameter")]


def sync_table(rows):
    """A trainer's new weights to the workers, to their first forward pass on them."""
    got = {r["impl"]: r for r in rows if r.get("group") == "weight_sync"}
    ours = got.get("follow")
    if not ours:
        return ""
    lines = [f"| new weights ({ours['weights_mib']:.0f} MiB) to {ours['workers']} workers, "
             f"median of {ours['rounds']} | publish to last forward pass, ms | / follow() | "
             "publish alone, ms |", "|---|---:|---:|---:|"]
    for impl, desc in SYNC_IMPLS:
        r = got.get(impl)
        if r:
            ratio = r["median_ms"] / ours["median_ms"] if ours["median_ms"] else 0
            lines.append(f"| {desc} | {r['median_ms']:.1f} | {ratio:.1f} | "
                         f"{r['median_publish_ms']:.1f} |")
    return "\n".join(lines)


def plot(rows, sizes, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for group, impl, label in [("attach_c", "floor", "floor (C)"), ("attach_c", "dlpc", "dlpc_attach (C)"),
                               ("attach_py", "dlpack_ipc", "dlpack_ipc attach (Python)"),
                               ("attach_py", "shared_memory", "stdlib SharedMemory"),
                               ("handoff", "torch_multiprocessing", "torch.multiprocessing hand-off"),
                               ("handoff", "dlpack_ipc", "dlpack_ipc hand-off"),
                               ("pipe_copy", "multiprocessing_pipe", "multiprocessing.Pipe copy")]:
        pts = [(s, pick(rows, group, impl, s)) for s in sizes]
        pts = [(s, r["median_us"]) for s, r in pts if r]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (bytes)")
    ax.set_ylabel("median time per attach / hand-off (µs)")
    ax.set_title("Sharing one tensor between processes (lower is better)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def machine():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)),
            "shmem_enabled": shmem_thp(), "date": datetime.date.today().isoformat()}


def shmem_thp():
    """The kernel's setting for shmem huge pages (the bracketed word), or None if it has none."""
    try:
        with open(SHMEM_THP) as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


def set_shmem_thp(mode):
    """Set shmem huge pages to @mode for this run (root only); the setting found, to restore."""
    found = shmem_thp()
    if found is None:
        raise SystemExit(f"bench: --shmem-thp: {SHMEM_THP} cannot be read: no shmem huge pages")
    try:
        with open(SHMEM_THP, "w") as f:
            f.write(mode)
    except OSError as e:
        raise SystemExit(f"bench: --shmem-thp {mode}: cannot write {SHMEM_THP}: {e}"
                         " (it takes root)")
    print(f"bench: shmem huge pages {found} -> {mode} for this run", file=sys.stderr)
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, few reps")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"), help="CMake build directory")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"), help="where results go")
    ap.add_argument("--no-pin", action="store_true",
                    help="let the scheduler place processes (latency then varies 2x run to run "
                         "on small VMs, with the two ends on the same CPU or not)")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter of the torch benchmarks and of the peers "
                         "(bench_model.py, weight_sync.py, bench_py.py --peers); scripts/dev "
                         "bench passes the bench's venv (bench/requirements.txt: torch 2, Ray, "
                         "safetensors)")
    ap.add_argument("--shmem-thp", choices=["never", "advise", "within_size", "always"],
                    help="run with the kernel's shmem huge pages set to this (root; the setting "
                         "found is put back at the end, on every exit): what libdlpc's huge "
                         "pages (DLPC_HUGE_PAGES, docs/operations.md) change")
    args = ap.parse_args()
    # a SIGTERM ends the run through the finally below, which puts the setting back
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    found = set_shmem_thp(args.shmem_thp) if args.shmem_thp else None
    try:
        bench(args)
    finally:
        if found is not None:
            with open(SHMEM_THP, "w") as f:
                f.write(found)


def bench(args):
    build = os.path.abspath(args.build)
    sizes = [4096, MIB] if args.quick else [4096, 65536, MIB, 16 * MIB, 256 * MIB, 1 << 30]
    # the sizes of bench_c's mapping group
    map_sizes = [4096, MIB] if args.quick else [4096, MIB, 64 * MIB, 1 << 30]
    tmp = tempfile.mkdtemp(prefix="dlpc-bench-")
    # DLPC_BENCH_RUN marks every process the harnesses start (check_processes)
    env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"), DLPC_BENCH_RUN=tmp)
    proc, ok = None, False
    shm_before = set(os.listdir("/dev/shm"))
    try:
        proc, sock = start_daemon(build, tmp)
        entries = 1000 if args.quick else min(FOOTPRINT_ENTRIES, daemon_fd_room(proc) - 256)
        cmd = [os.path.join(build, "bench", "bench_c"), "--socket", sock, "--entries", str(entries)]
        cmd += ["--quick"] if args.quick else []
        cmd += [] if args.no_pin else ["--pin", "0"]
        rows = run_rows(cmd, env)
        cmd = [sys.executable, os.path.join(HERE, "bench_py.py"), "--socket", sock]
        cmd += ["--quick"] if args.quick else []
        if not args.no_pin:
            # every Python measurement is a latency: harness, its children and daemon on CPU 0
            os.sched_setaffinity(proc.pid, {0})
        rows += run_rows(cmd, env, pin=not args.no_pin)
        # the peers (Ray, safetensors, torch.multiprocessing) with the --python
        # interpreter, unpinned: Ray's own processes and the 8 readers use every CPU
        if not args.no_pin:
            os.sched_setaffinity(proc.pid, range(os.cpu_count()))
        cmd = [args.python, os.path.join(HERE, "bench_py.py"), "--socket", sock, "--peers"]
        cmd += ["--quick"] if args.quick else []
        rows += run_rows(cmd, env)
        if not args.no_pin:  # the daemon as the runs below have always found it
            os.sched_setaffinity(proc.pid, {0})
        # a model's weights into several workers: not a latency, so not pinned
        cmd = [args.python, os.path.join(HERE, "bench_model.py"), "--socket", sock]
        cmd += ["--quick"] if args.quick else []
        rows += run_rows(cmd, env)
        # a trainer's new weights to four workers: follow() against a gloo broadcast
        cmd = [args.python, os.path.join(HERE, "weight_sync.py"), "--socket", sock]
        cmd += ["--quick"] if args.quick else []
        rows += run_rows(cmd, env)
        stop_daemon(proc)
        proc = None
        # two more dlpackd of its own, in network namespaces, with a bridge each
        if not args.quick:
            rows += bridge_rows(build, env)
        # the same small publishes against a daemon that keeps its entries in an fd store
        store = FdStore(os.path.join(tmp, "notify"),
                        None if args.no_pin or os.cpu_count() < 2 else os.cpu_count() - 1)
        try:
            proc, sock = start_daemon(build, tmp, store)
            if not args.no_pin:
                os.sched_setaffinity(proc.pid, {0})
            cmd = [os.path.join(build, "bench", "bench_c"), "--socket", sock,
                   "--only", "publish_small"]
            cmd += ["--quick"] if args.quick else []
            cmd += [] if args.no_pin else ["--pin", "0"]
            for r in run_rows(cmd, env):
                r["impl"] += "_fdstore"
                rows.append(r)
            stop_daemon(proc)
            proc = None
        finally:
            store.close()
        ok = True
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        # what outlived the run (Ray's processes, a harness's workers) is killed whether the
        # run got through or not; a run that failed says so here, one that got through below
        left = check_processes(tmp)
        left += [f"shared memory left behind: {n}" for n in shm_left_behind(shm_before)]
        if not ok:
            for line in left:
                print(f"bench: {line}", file=sys.stderr)
    # the figures are printed and saved first; then the run fails on what outlived it

    checks = targets(rows, sizes, map_sizes)
    print(table(rows, sizes, map_sizes, checks))
    i30 = peer_targets(rows)
    print("\n" + peers_table(rows) + "\n\n" + peer_targets_table(i30))
    bridge_text, i31 = bridge_table(rows) if not args.quick else ("", [])
    if bridge_text:
        print("\n" + bridge_text)
    missing = [c[0] for c in checks if c[1] is None]
    missing += [f"model_load {impl}" for impl, _ in MODEL_IMPLS
                if not any(r.get("group") == "model_load" and r.get("impl") == impl
                           for r in rows)]
    missing += [f"weight_sync {impl}" for impl, _ in SYNC_IMPLS
                if not any(r.get("group") == "weight_sync" and r.get("impl") == impl
                           for r in rows)]
    missing += [c["target"] for c in i30 if c["ratio"] is None and not c["skipped"]]
    missing += [f"bridge ({r['failed']})" for r in rows
                if r.get("group") == "bridge" and "failed" in r]
    bad = [r for r in rows if any(isinstance(v, float) and not v == v for v in r.values())]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"machine": machine(), "quick": args.quick, "rows": rows,
                   "targets": [{"target": c[0], "measured": c[1], "limit": c[2], "met": c[3]}
                               for c in checks],
                   "peer_targets": i30,
                   "bridge_targets": [{"target": t, "measured": r, "limit": BRIDGE_GOAL,
                                       "met": m} for t, r, m in i31]}, f, indent=1)
    if not args.quick:
        plot(rows, sizes, os.path.join(args.out, "bench.png"))
    if left:
        raise SystemExit("bench: " + "; ".join(left))
    if missing or bad:
        raise SystemExit(f"bench: no number for {missing + [str(b) for b in bad]}")
    met = sum(c[3] for c in checks)
    print(f"\n{met} of {len(checks)} targets met")
    print(f"against the peers: {sum(c['met'] for c in i30)} of {len(i30)} targets met, "
          f"{sum(bool(c['skipped']) for c in i30)} not measured (a peer skipped)")
    if i31:
        print(f"the bridge: {sum(m for _, _, m in i31)} of {len(i31)} targets met")


if __name__ == "__main__":
    main()
