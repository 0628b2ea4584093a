#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""What one local user can make dlpackd hold: the daemon's memory per resource, measured.

    /usr/bin/python3 bench/neighbours.py [--build DIR] [--out FILE]

For each resource a client can make the daemon hold (connections, entries, references,
channels), starts a dlpackd of its own (as root, on a socket in a temporary directory, with the
packaged service's fd limit where it may raise it, else its hard limit) and lets a child running
as uid 65534 take as many as the daemon allows through dlpack_ipc, up to what the child itself can
hold. It reads the daemon's resident memory (VmRSS) before, while they are held, and after the
child is killed, and reports what refused the child, the daemon's growth and what it kept after
the release. Prints a markdown table and writes the figures as JSON to --out (default
docs/neighbours.json); docs/security.md quotes them.
"""
import argparse
import errno
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NOBODY = 65534
# the packaged service's LimitNOFILE (systemd/dlpackd.service.in)
SERVICE_NOFILE = 1048576


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_daemon(build, tmp):
    sock = os.path.join(tmp, "dlpackd.sock")

    def limits():
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (SERVICE_NOFILE, SERVICE_NOFILE))
        except (ValueError, OSError):  # no CAP_SYS_RESOURCE: the hard limit it has
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    log = open(os.path.join(tmp, "dlpackd.log"), "w")
    d = subprocess.Popen([os.path.join(build, "dlpackd"), "--socket", sock, "--socket-mode",
                          "0666"], stderr=log, preexec_fn=limits)
    deadline = time.monotonic() + 10
    sys.path.insert(0, os.path.join(build, "python"))
    import dlpack_ipc
    while True:
        try:
            dlpack_ipc.Client(sock).close()
            break
        except OSError:
            if time.monotonic() > deadline or d.poll() is not None:
                raise RuntimeError("dlpackd did not answer")
            time.sleep(0.02)
    return d, sock


# What the child does for each resource: take as many as the daemon lets it (up to n), and hold
# them. Returns what it holds and how many.
REFUSAL = re.compile(r"\((--[a-z-]+)\)")


def until_refused(take, n):
    global refused_by
    held = []
    for i in range(n):
        try:
            held.append(take(i))
        except OSError as e:
            if e.errno != errno.EDQUOT:
                raise
            flag = REFUSAL.search(str(e))
            refused_by = flag.group(1) if flag else str(e)
            break
    return held


refused_by = None


def take_connections(dlpack_ipc, sock, n):
    def one(i):
        c = dlpack_ipc.Client(sock)
        c.list("none/")
        return c
    return until_refused(one, n)


def take_entries(dlpack_ipc, sock, n):
    import numpy as np
    c = dlpack_ipc.Client(sock)
    one = np.zeros(1, np.float32)
    return [c] + until_refused(lambda i: c.publish(f"nb/e/{i}", one, ephemeral=True), n)


def take_bundles(dlpack_ipc, sock, n):
    import numpy as np
    c = dlpack_ipc.Client(sock)
    sd = {f"layer.{i:03d}.attention.weight": np.zeros((4, 4), np.float32) for i in range(500)}
    return [c] + until_refused(lambda i: c.publish_dict(f"nb/b/{i}", sd, ephemeral=True), n)


def take_references(dlpack_ipc, sock, n):
    global refused_by
    import numpy as np
    c = dlpack_ipc.Client(sock)
    c.publish("nb/r", np.zeros(1, np.float32), ephemeral=True)
    # a process maps each reference, and vm.max_map_count (65530) bounds its mappings: the
    # references come from several processes of the uid, each holding up to PER_PROCESS
    taken, pipes = 0, []
    while taken < n:
        r, w = os.pipe()
        if os.fork() == 0:
            os.close(r)
            mine = dlpack_ipc.Client(sock)
            held = until_refused(lambda i: mine.attach("nb/r"), PER_PROCESS)
            os.write(w, f"{len(held)} {refused_by}".encode())
            time.sleep(3600)
            os._exit(0)
        os.close(w)
        got, by = os.read(r, 200).decode().split(maxsplit=1)
        os.close(r)
        taken += int(got)
        if by != "None":
            refused_by = by
            break
    return [c] + [None] * taken


PER_PROCESS = 60_000


def take_channels(dlpack_ipc, sock, n):
    c = dlpack_ipc.Client(sock)
    return [c] + until_refused(lambda i: c.channel(f"nb/c/{i}"), n)


RESOURCES = {
    # name: (taker, most to take: what the child process itself can hold)
    "connection": (take_connections, 5000),
    "entry of one tensor (one memfd)": (take_entries, 200_000),
    "entry of 500 tensors (one memfd)": (take_bundles, 2000),
    "reference": (take_references, 2_000_000),
    "channel": (take_channels, 1_000_000),
}


def measure(d, sock, name):
    taker, most = RESOURCES[name]
    before = rss_kib(d.pid)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.setpgid(0, 0)  # its own process group, which the parent kills whole
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            # every attach is a reference of its own (the cache would share one)
            os.environ["DLPC_CACHE_ENTRIES"] = "0"
            import dlpack_ipc
            keep = taker(dlpack_ipc, sock, most)
            os.write(w, f"ok {len(keep) - (name != 'connection')} {refused_by}".encode())
            time.sleep(3600)
        except BaseException as e:  # report it to the parent, whatever it is
            os.write(w, repr(e).encode()[:1000])
        os._exit(1)
    os.close(w)
    said = os.read(r, 1000).decode()
    os.close(r)
    held = rss_kib(d.pid)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    time.sleep(1.5)  # the daemon closes what the child left
    after = rss_kib(d.pid)
    if not said.startswith("ok "):
        raise RuntimeError(f"{name}: the child failed: {said}")
    n, by = int(said.split()[1]), said.split(maxsplit=2)[2]
    return {"resource": name, "taken": n,
            "bound": by if by != "None" else f"none reached ({most} taken)",
            "rss_before_kib": before, "rss_held_kib": held, "rss_after_kib": after,
            "bytes_per_item": round((held - before) * 1024 / max(n, 1)),
            "growth_bytes": (held - before) * 1024,
            "retained_bytes": (after - before) * 1024}


def human(n):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "neighbours.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("neighbours.py: run as root (the attacker drops to uid 65534)")
    rows = []
    # a daemon of its own for each resource: memory freed by one would hide the next one's
    for name in RESOURCES:
        with tempfile.TemporaryDirectory(prefix="dlpc-nb-") as tmp:
            os.chmod(tmp, 0o755)
            d, sock = start_daemon(os.path.abspath(a.build), tmp)
            try:
                rows.append(measure(d, sock, name))
            finally:
                d.terminate()
                d.wait()
    print("| resource | taken by one uid | refused by | daemon bytes each | daemon RSS growth | "
          "RSS kept after release |")
    print("|---|---:|---|---:|---:|---:|")
    for x in rows:
        print(f"| {x['resource']} | {x['taken']} | {x['bound']} | {x['bytes_per_item']} | "
              f"{human(x['growth_bytes'])} | {human(x['retained_bytes'])} |")
    with open(a.out, "w") as f:
        json.dump({"machine": platform.node() and platform.machine(),
                   "kernel": platform.release(), "date": time.strftime("%Y-%m-%d"),
                   "rows": rows}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
