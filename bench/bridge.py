# SPDX-License-Identifier: Apache-2.0
"""dlpackd-bridge between two network namespaces, beside a plain TCP stream over the same veth.

    sudo PYTHONPATH=build/python build/bridgevenv/venv/bin/python bench/bridge.py build/dlpackd \
        [--sizes 64M,1G] [--repeat 3] [--out bridge.json] [--shmem-thp MODE]

Needs what the bridge_netns test needs (root, `ip`, the bridge's venv: ctest -R bridge_venv makes
it) and reuses its two hosts (tests/bridge/netns.py). Per size: the best of --repeat runs of
  socket   B sends the bytes to A over one TCP connection (Python's sendall/recv_into, 4 MiB
           chunks) and A acknowledges the last byte: the floor over this veth;
  fetch    bridge.fetch("A:name") on B: layout, allocation, NIXL WRITE, publish of the replica;
and the time from fetch() of a 4 KiB entry to a usable local array (fetch + attach + asarray),
median of 20. GB/s are 10^9 bytes per second. Nothing is judged here: bench/run.py runs this
(as root, where the bridge's venv is) and holds the fetch to 0.7x the socket. The replica is
written into pages of B's memfd, so shmem huge pages (--shmem-thp, as bench/run.py's) matter.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "bridge"))
import netns  # noqa: E402  (exits 77 where the namespaces cannot be made)
import run  # noqa: E402  (bench/run.py: its shmem huge-page setting)

import numpy as np  # noqa: E402

from dlpack_ipc import bridge  # noqa: E402

SINK = r"""
import socket, sys
n = int(sys.argv[2]); s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7456)); s.listen(1); print("ready", flush=True)
for _ in range(int(sys.argv[3])):
    c, _ = s.accept(); buf = bytearray(4 << 20); got = 0
    while got < n:
        k = c.recv_into(buf)
        if not k: break
        got += k
    c.sendall(b"k"); c.close()
"""

SOURCE = r"""
import socket, sys, time
n = int(sys.argv[2]); data = memoryview(bytearray(b"x" * (4 << 20))); best = None
for _ in range(int(sys.argv[3])):
    c = socket.create_connection((sys.argv[1], 7456)); t0 = time.perf_counter(); left = n
    while left:
        k = min(left, len(data)); c.sendall(data[:k]); left -= k
    c.recv(1); dt = time.perf_counter() - t0; c.close()
    best = dt if best is None else min(best, dt); time.sleep(0.2)
print(best)
"""


def size(text):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * mult[text[-1]] if text[-1] in mult else int(text)


def socket_stream(w, n, repeat):
    sink = subprocess.Popen(["ip", "netns", "exec", w.ns["A"], sys.executable, "-c", SINK,
                             netns.ADDR_A, str(n), str(repeat)], stdout=subprocess.PIPE,
                            text=True)
    try:
        sink.stdout.readline()
        out = subprocess.run(["ip", "netns", "exec", w.ns["B"], sys.executable, "-c", SOURCE,
                              netns.ADDR_A, str(n), str(repeat)], capture_output=True,
                             text=True, check=True, timeout=600).stdout
        return float(out)
    finally:
        sink.wait(30)


def bridge_fetch(w, a, n, repeat):
    x = np.full(n, 7, dtype=np.uint8)
    a.publish("w/bench", x, replace=True)
    del x
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        bridge.fetch("A:w/bench", 600, socket=w.bridge_socket("bridge-B"))
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
        time.sleep(0.2)
    a.unpublish("w/bench")
    return best


def small(w, a, b, runs=20):
    a.publish("w/4k", np.arange(1024, dtype=np.float32), replace=True)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        local, _ = bridge.fetch("A:w/4k", 60, socket=w.bridge_socket("bridge-B"))
        t = b.attach(local)
        arr = np.asarray(t)
        assert arr[1023] == 1023.0
        times.append(time.perf_counter() - t0)
        del arr
        t.release()
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dlpackd")
    p.add_argument("--sizes", default="64M,1G")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--bridge-option", action="append", default=[],
                   help="one more option for both bridges (e.g. --progress-thread)")
    p.add_argument("--shmem-thp", choices=["never", "advise", "within_size", "always"],
                   help="run with the kernel's shmem huge pages set to this (root; put back at "
                        "the end)")
    args = p.parse_args()
    # a SIGTERM (bench/run.py's timeout) ends the run through the finally blocks: the
    # namespaces, the processes and the shmem setting are put back
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    found = run.set_shmem_thp(args.shmem_thp) if args.shmem_thp else None
    try:
        return measure(args)
    finally:
        if found is not None:
            with open(run.SHMEM_THP, "w") as f:
                f.write(found)


def measure(args):
    w = netns.World(args.dlpackd, ttl=120.0, extra=args.bridge_option)
    rows = []
    try:
        w.up()
        a, b = w.client("A"), w.client("B")
        for text in args.sizes.split(","):
            n = size(text)
            sock = socket_stream(w, n, args.repeat)
            fetch = bridge_fetch(w, a, n, args.repeat)
            rows.append({"size": n, "socket_s": sock, "fetch_s": fetch,
                         "socket_gbps": n / sock / 1e9, "fetch_gbps": n / fetch / 1e9,
                         "ratio": sock / fetch})
            r = rows[-1]
            print(f"{text:>6}: socket {r['socket_gbps']:.2f} GB/s, bridge fetch "
                  f"{r['fetch_gbps']:.2f} GB/s ({r['ratio']:.2f}x the socket)", flush=True)
        lat = small(w, a, b)
        print(f"4 KiB: fetch + attach to a usable array, median {lat * 1e3:.2f} ms")
    finally:
        w.close()
    result = {"rows": rows, "small_4k_s": lat, "cpus": os.cpu_count(),
              "repeat": args.repeat, "shmem_enabled": run.shmem_thp(),
              "nixl": __import__("importlib.metadata").metadata.version("nixl")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
