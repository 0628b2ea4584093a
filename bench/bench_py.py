#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Python half of the dlpackd benchmarks: dlpack_ipc against what Python offers without it.

    /usr/bin/python3 bench/bench_py.py --socket PATH [--quick] [--sizes 4096,65536,...]
                                       [--only GROUP,...]

Prints one JSON object per line on stdout and nothing else there (progress goes to stderr):

    {"group": G, "impl": I, "size": BYTES or null, "median_us": F, "p99_us": F, "reps": N}

Times are microseconds per operation, median and 99th percentile (nearest rank) over `reps`
timed repetitions, each measured with time.perf_counter_ns after a few untimed warm-up ones.
Groups:

  attach_py  dlpack_ipc             attach + np.from_dlpack + read one element + release
                                    (a client without libdlpc's cache: one round trip each)
             dlpack_ipc_cached      the same on a client whose cache holds the entry (re-attach:
                                    no round trip; the default mode's copy-on-write mapping is
                                    handed out again, emptied of written pages)
             shared_memory          stdlib SharedMemory(name) + np.ndarray + read + close
  handoff    torch_multiprocessing  torch.multiprocessing Queue put of a shared tensor, a child
                                    process gets it, reads one element, acks on a second Queue
             dlpack_ipc             the same protocol, but the name goes through the Queue and the
                                    child attaches, torch.from_dlpack, reads, releases, acks
  channel    torch_multiprocessing  hand-off of a tensor already in shared memory to a waiting child
                                    process, which reads one element and acks one byte on a Unix
                                    socket:
                                    torch.multiprocessing Queue put / get
             dlpack_channel         dlpack_ipc channel send of empty() memory (no copy) / recv,
                                    torch.from_dlpack, release
             dlpack_channel_direct  the same over a direct channel (channel(direct=True)): the
                                    message goes between the processes, not through dlpackd
             dlpack_channel_direct_fresh  the same with the child's caches off: its storage
                                    mapped anew for each message (the two rows above keep the
                                    mapping of a storage that comes again, as a receiver does
                                    by default)
             fd_pass_mmap           the floor: the memfd passed over a Unix socket (SCM_RIGHTS),
                                    mmap, read, munmap, close
  pipeline   torch_queue            a producer process makes 64 MiB float32 batches as a DataLoader
                                    worker does (a new shared-memory tensor, filled) and puts them
                                    on a torch.multiprocessing Queue; this process takes them and
                                    reads one element: the time between batches
             channel_pool           the same batches filled into recycled channel buffers
                                    (Channel.empty) and sent over a channel of 4
  pipe_copy  multiprocessing_pipe   the bytes through multiprocessing.Pipe to a child that makes
                                    an array of them, reads one element and acks (<= 256 MiB)
  bundle     attach_dict            attach_dict of 500 tensors of 1024 float32 + release all
             single_x500            the same 500 published one by one: 500 attaches + releases
             single_x1              one of those single attaches + release

Everything this script creates (names, shared memory, child processes) is removed before it
exits, also on errors and on SIGTERM. Exit status: 0 when every row was produced, 1 when some
measurement failed (its traceback is on stderr, the other rows are still printed), 2 when the
daemon cannot be reached.
"""
import argparse
import gc
import json
import math
import os
import signal
import sys
import time
import traceback

import numpy as np

try:
    import dlpack_ipc
except ImportError:  # run from a source tree without PYTHONPATH: use the default build directory
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "build", "python"))
    import dlpack_ipc

DEFAULT_SIZES = [4096, 65536, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
QUICK_SIZES = [4096, 1 << 20]
PIPE_MAX = 256 << 20            # pipe_copy skips larger sizes: each hand-off copies them twice
BUNDLE_TENSORS = 500
BUNDLE_ELEMS = 1024
CHILD_TIMEOUT_S = 120           # a child that does not answer within this is taken as hung

_out = sys.stdout               # replaced in main() by a private copy of the real stdout


def log(msg):
    print(f"bench_py: {msg}", file=sys.stderr, flush=True)


def human(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


class Timer:
    """Warm-up, rep count and statistics shared by every measurement."""

    def __init__(self, quick):
        self.max_reps = 100 if quick else 2000
        self.min_reps = 15
        self.budget_s = 0.3 if quick else 1.5    # timed time per row, before the rep clamps
        self.warmup_max = 5 if quick else 20
        self.warmup_s = 0.1 if quick else 0.3

    def measure(self, op):
        """Run op() untimed a few times, then `reps` timed times; returns (median, p99, reps)."""
        gc.collect()
        start = time.perf_counter_ns()
        n = 0
        while True:  # 2 to warmup_max warm-up reps, fewer once warmup_s is spent
            op()
            n += 1
            spent = time.perf_counter_ns() - start
            if n >= 2 and (n >= self.warmup_max or spent >= self.warmup_s * 1e9):
                break
        per_op_s = spent / n / 1e9
        reps = int(min(self.max_reps, max(self.min_reps, self.budget_s / max(per_op_s, 1e-9))))
        times = [0] * reps
        counter = time.perf_counter_ns
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            for i in range(reps):
                t0 = counter()
                op()
                times[i] = counter() - t0
        finally:
            if gc_was_on:
                gc.enable()
        times.sort()
        mid = reps // 2
        median = times[mid] if reps % 2 else (times[mid - 1] + times[mid]) / 2
        p99 = times[max(0, math.ceil(0.99 * reps) - 1)]
        return median / 1e3, p99 / 1e3, reps


def emit(group, impl, size, result):
    median, p99, reps = result
    row = {"group": group, "impl": impl, "size": size,
           "median_us": round(median, 3), "p99_us": round(p99, 3), "reps": reps}
    _out.write(json.dumps(row) + "\n")
    _out.flush()
    log(f"{group:<9} {impl:<22} {'-' if size is None else human(size):>8}: "
        f"median {median:10.1f} us  p99 {p99:10.1f} us  ({reps} reps)")


def filled(nbytes):
    """A float32 array of nbytes bytes, every page written (1.0 everywhere)."""
    a = np.empty(nbytes // 4, dtype=np.float32)
    a.fill(1.0)
    return a


def unpublish_quietly(client, name):
    try:
        client.unpublish(name)
    except FileNotFoundError:
        pass
    except Exception as e:  # keep cleaning up the rest
        log(f"unpublish {name!r} failed: {e!r}")


# ---- attach_py -----------------------------------------------------------------------------------

def attach_dlpack_row(client, timer, prefix, size):
    name = f"{prefix}/attach/{size}"
    a = filled(size)
    client.publish(name, a, ephemeral=True)
    del a  # the entry has its own copy in a memfd
    try:
        def op():
            t = client.attach(name)
            a = np.from_dlpack(t)
            a[0]  # the read is the point
            del a
            t.release()
        emit("attach_py", "dlpack_ipc", size, timer.measure(op))
    finally:
        unpublish_quietly(client, name)


def cached_client(socket):
    """A client with libdlpc's caches at their defaults (main() turns them off for the rows that
    measure a round trip or a fresh mapping)."""
    saved = os.environ.pop("DLPC_CACHE_ENTRIES", None)
    try:
        return dlpack_ipc.Client(socket)
    finally:
        if saved is not None:
            os.environ["DLPC_CACHE_ENTRIES"] = saved


def attach_cached_row(socket, timer, prefix, size):
    name = f"{prefix}/reattach/{size}"
    client = cached_client(socket)
    a = filled(size)
    client.publish(name, a, ephemeral=True)
    del a
    try:
        def op():
            t = client.attach(name)
            a = np.from_dlpack(t)
            a[0]
            del a
            t.release()
        before = client.stat()["req_attach"]
        emit("attach_py", "dlpack_ipc_cached", size, timer.measure(op))
        log(f"attach_py dlpack_ipc_cached: {client.stat()['req_attach'] - before} ATTACH "
            "requests reached the daemon")
    finally:
        unpublish_quietly(client, name)
        client.close()


def attach_shm_row(timer, size):
    from multiprocessing import shared_memory
    # The creator lives in this process for the whole measurement and unlinks at the end: that
    # also unregisters the name from the resource tracker, which every attach below registers
    # again (a set, so no warning at exit and nothing left in /dev/shm).
    creator = shared_memory.SharedMemory(create=True, size=size,
                                         name=f"bench_py_{os.getpid()}_{size}")
    try:
        shm_name = creator.name
        shape = (size // 4,)
        view = np.ndarray(shape, np.float32, buffer=creator.buf)
        view.fill(1.0)
        del view

        def op():
            shm = shared_memory.SharedMemory(name=shm_name)
            a = np.ndarray(shape, np.float32, buffer=shm.buf)
            a[0]
            del a
            shm.close()
        emit("attach_py", "shared_memory", size, timer.measure(op))
    finally:
        creator.close()
        creator.unlink()


def bench_attach(client, timer, socket, prefix, sizes):
    """The rows of a size back to back, so that their ratio comes from the same conditions."""
    for size in sizes:
        attach_dlpack_row(client, timer, prefix, size)
        attach_cached_row(socket, timer, prefix, size)
        attach_shm_row(timer, size)


# ---- handoff -------------------------------------------------------------------------------------

def _handoff_child(socket, inq, ackq):
    """Long-lived receiver: ("torch", tensor) or ("dlpack", name) in, 1 out; ("stop",) ends."""
    try:
        import torch
        torch.set_num_threads(1)
        client = dlpack_ipc.Client(socket)
    except BaseException as e:
        ackq.put(("error", f"child start: {e!r}"))
        return
    ackq.put("ready")
    try:
        while True:
            msg = inq.get()
            if msg[0] == "stop":
                break
            try:
                if msg[0] == "torch":
                    t = msg[1]
                    del msg          # the tensor's storage goes with the last reference
                    t[0].item()
                    del t
                else:
                    st = client.attach(msg[1])
                    t = torch.from_dlpack(st)
                    t[0].item()
                    del t
                    st.release()
            except Exception as e:
                ackq.put(("error", f"{type(e).__name__}: {e}"))
                continue
            ackq.put(1)
    finally:
        client.close()


def stop_child(proc, stop):
    """Ask a child to end, then make sure it has: join, terminate, kill."""
    if proc is None:
        return
    if proc.is_alive():
        try:
            stop()
        except Exception:
            pass
        proc.join(10)
    if proc.is_alive():
        log(f"child {proc.pid} did not stop; terminating it")
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()


def bench_handoff(client, timer, socket, prefix, sizes):
    import torch
    import torch.multiprocessing as tmp
    torch.set_num_threads(1)
    ctx = tmp.get_context("spawn")
    inq, ackq = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_handoff_child, args=(socket, inq, ackq), daemon=True,
                       name="bench_py-handoff")
    try:
        log("starting the hand-off child (spawn, imports torch)")
        proc.start()
        ready = ackq.get(timeout=CHILD_TIMEOUT_S)
        if ready != "ready":
            raise RuntimeError(f"hand-off child failed: {ready}")

        def handoff(msg):
            inq.put(msg)
            ack = ackq.get(timeout=CHILD_TIMEOUT_S)
            if ack != 1:
                raise RuntimeError(f"hand-off child: {ack}")

        for size in sizes:
            # torch: a tensor already in shared memory (share_memory_ moves its storage there)
            t = torch.from_numpy(filled(size)).share_memory_()
            try:
                msg = ("torch", t)
                emit("handoff", "torch_multiprocessing", size, timer.measure(lambda: handoff(msg)))
            finally:
                del msg, t
            gc.collect()
            # ours: the name travels through the same Queue, the child attaches it
            name = f"{prefix}/handoff/{size}"
            a = filled(size)
            client.publish(name, a, ephemeral=True)
            del a
            try:
                msg = ("dlpack", name)
                emit("handoff", "dlpack_ipc", size, timer.measure(lambda: handoff(msg)))
            finally:
                unpublish_quietly(client, name)
    finally:
        stop_child(proc, lambda: inq.put(("stop",)))
        for q in (inq, ackq):
            q.close()
            q.join_thread()


# ---- channel: hand-off with a one-byte pipe ack, three ways -------------------------------------

def _channel_child(socket, chname, inq, sock):
    """Waits for tensors by the mode the parent names on inq, acks each with one byte on sock.

    ("torch",): tensors come through inq until ("stop",); ("channel",): messages from the
    channel until a bundle; ("fd",): memfds over sock until a message without one; ("end",)."""
    import mmap
    import socket as socketmod
    try:
        import torch
        torch.set_num_threads(1)
        # as a user's receiver is: the mapping of a storage that comes again is kept (maps.c)
        ch = dlpack_ipc.Channel(chname, client=cached_client(socket))
        dch = fch = None
    except BaseException as e:
        inq.put(("error", f"child start: {e!r}"))
        return
    sock.sendall(b"r")
    while True:
        mode = inq.get()
        if mode[0] == "end":
            break
        if mode[0] == "torch":
            while True:
                msg = inq.get()
                if msg[0] == "stop":
                    break
                t = msg[1]
                del msg
                t[0].item()
                del t
                sock.sendall(b"1")
        elif mode[0] in ("channel", "direct", "fresh"):
            if mode[0] == "direct" and dch is None:
                dch = dlpack_ipc.Channel(chname + "-direct", direct=True, client=ch._client)
            if mode[0] == "fresh" and fch is None:
                # a client without the caches: every message mapped anew
                fch = dlpack_ipc.Channel(chname + "-direct", direct=True,
                                         client=dlpack_ipc.Client(socket))
            rch = {"channel": ch, "direct": dch, "fresh": fch}[mode[0]]
            while True:
                st = rch.recv()
                if isinstance(st, dict):
                    del st
                    break
                t = torch.from_dlpack(st)
                t[0].item()
                del t
                st.release()
                sock.sendall(b"1")
        else:
            size = mode[1]
            while True:
                _, fds, _, _ = socketmod.recv_fds(sock, 8, 1)
                if not fds:
                    break
                m = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
                m[0]
                m.close()
                os.close(fds[0])
                sock.sendall(b"1")
        sock.sendall(b"d")


def bench_channel(client, timer, socket, prefix, sizes):
    import socket as socketmod
    import torch
    import torch.multiprocessing as tmp
    torch.set_num_threads(1)
    ctx = tmp.get_context("spawn")
    chname = f"{prefix}/channel"
    ch = client.channel(chname, 1)
    dch = client.channel(chname + "-direct", 1, direct=True)
    inq = ctx.Queue()
    # memfds go to the child over this socket, and its one-byte acks come back on it
    ps, cs = socketmod.socketpair(socketmod.AF_UNIX, socketmod.SOCK_STREAM)
    proc = ctx.Process(target=_channel_child, args=(socket, chname, inq, cs), daemon=True,
                       name="bench_py-channel")

    def ack(want=b"1"):
        got = ps.recv(1)
        if got != want:
            raise RuntimeError(f"channel child acked {got!r}")

    try:
        log("starting the channel child (spawn, imports torch)")
        proc.start()
        cs.close()
        ack(b"r")
        for size in sizes:
            t = torch.from_numpy(filled(size)).share_memory_()
            try:
                inq.put(("torch",))
                msg = ("t", t)

                def torch_op():
                    inq.put(msg)
                    ack()
                emit("channel", "torch_multiprocessing", size, timer.measure(torch_op))
                inq.put(("stop",))
                ack(b"d")
            finally:
                del msg, t
            gc.collect()
            buf = client.empty(size // 4, "float32")
            torch.from_dlpack(buf).fill_(1.0)
            inq.put(("channel",))

            def channel_op():
                ch.send(buf)
                ack()
            emit("channel", "dlpack_channel", size, timer.measure(channel_op))
            ch.send_dict({"stop": np.zeros(1)})
            ack(b"d")
            inq.put(("direct",))

            def direct_op():
                dch.send(buf)
                ack()
            emit("channel", "dlpack_channel_direct", size, timer.measure(direct_op))
            dch.send_dict({"stop": np.zeros(1)})
            ack(b"d")
            inq.put(("fresh",))
            emit("channel", "dlpack_channel_direct_fresh", size, timer.measure(direct_op))
            dch.send_dict({"stop": np.zeros(1)})
            ack(b"d")
            del buf
            fd = os.memfd_create("bench-floor", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, size)
                with open(f"/proc/self/fd/{fd}", "r+b", buffering=0) as f:
                    f.write(b"\1" * min(size, 1 << 20))
                inq.put(("fd", size))

                def fd_op():
                    socketmod.send_fds(ps, [b"f"], [fd])
                    ack()
                emit("channel", "fd_pass_mmap", size, timer.measure(fd_op))
                ps.sendall(b"s")
                ack(b"d")
            finally:
                os.close(fd)
    finally:
        stop_child(proc, lambda: inq.put(("end",)))
        ps.close()
        inq.close()
        inq.join_thread()
        for c in (ch, dch):
            try:
                c.remove()
            except OSError:
                pass


# ---- pipeline: a steady stream of 64 MiB batches -------------------------------------------------

PIPELINE_BYTES = 64 << 20


def _pipeline_child(socket, chname, q, kind, n, done):
    """Make n batches of PIPELINE_BYTES, as a DataLoader worker (kind "torch") or into recycled
    channel buffers (kind "channel"); stay until done is set (torch's fds are lent by the
    process that put them, as a DataLoader's workers stay)."""
    import torch
    torch.set_num_threads(1)
    elems = PIPELINE_BYTES // 4
    if kind == "torch":
        for k in range(n):
            out = torch.empty(elems).share_memory_()
            out.fill_(float(k))
            q.put(out)
            del out
        done.wait(CHILD_TIMEOUT_S)
        return
    ch = dlpack_ipc.Channel(chname, client=dlpack_ipc.Client(socket))
    for k in range(n):
        buf = ch.empty(elems, "float32")
        torch.from_dlpack(buf).fill_(float(k))
        ch.send(buf)
        del buf
    done.wait(CHILD_TIMEOUT_S)


def bench_pipeline(client, socket, prefix, quick):
    import torch
    import torch.multiprocessing as tmp
    n, warm = (8, 2) if quick else (60, 10)
    ctx = tmp.get_context("spawn")
    chname = f"{prefix}/pipeline"
    ch = client.channel(chname, 4, direct=False)  # its producer takes Channel.empty() buffers
    try:
        for kind in ("torch", "channel"):
            q, done = ctx.Queue(4), ctx.Event()
            proc = ctx.Process(target=_pipeline_child, args=(socket, chname, q, kind, n, done),
                               daemon=True, name="bench_py-pipeline")
            proc.start()
            stamps = []
            try:
                for k in range(n):
                    t = None
                    if kind == "torch":
                        t = q.get(timeout=CHILD_TIMEOUT_S)
                        v = float(t[-1])
                    else:
                        st = ch.recv(timeout=CHILD_TIMEOUT_S)
                        v = float(torch.from_dlpack(st)[-1])
                        st.release()
                        del st
                    if v != float(k):
                        raise RuntimeError(f"pipeline batch {k} holds {v}")
                    stamps.append(time.perf_counter_ns())
                    del t
                done.set()
                proc.join(CHILD_TIMEOUT_S)
            finally:
                stop_child(proc, lambda: None)
                q.close()
                q.join_thread()
            gaps = sorted(b - a for a, b in zip(stamps[warm:], stamps[warm + 1:]))
            mid = len(gaps) // 2
            median = gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2
            p99 = gaps[max(0, math.ceil(0.99 * len(gaps)) - 1)]
            emit("pipeline", "torch_queue" if kind == "torch" else "channel_pool",
                 PIPELINE_BYTES, (median / 1e3, p99 / 1e3, len(gaps)))
    finally:
        try:
            ch.remove()
        except OSError:
            pass


# ---- pipe_copy -----------------------------------------------------------------------------------

def _pipe_child(conn):
    """Receive byte messages as float32 arrays, read one element, ack; an empty message ends."""
    try:
        conn.send_bytes(b"ready")
        while True:
            buf = conn.recv_bytes()
            if not buf:
                break
            a = np.frombuffer(buf, dtype=np.float32)
            a[0]
            del a, buf
            conn.send_bytes(b"k")
    except EOFError:
        pass
    finally:
        conn.close()


def _pipe_sender(conn, a):
    def op():
        conn.send_bytes(a)
        if not conn.poll(CHILD_TIMEOUT_S):
            raise RuntimeError("pipe child did not answer")
        if conn.recv_bytes() != b"k":
            raise RuntimeError("pipe child sent a bad ack")
    return op


def bench_pipe(timer, sizes):
    import multiprocessing as mp
    skipped = [s for s in sizes if s > PIPE_MAX]
    sizes = [s for s in sizes if s <= PIPE_MAX]
    if skipped:
        log(f"pipe_copy: skipping {', '.join(human(s) for s in skipped)} "
            f"(above {human(PIPE_MAX)}, to bound the run time)")
    if not sizes:
        return
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_pipe_child, args=(child,), daemon=True, name="bench_py-pipe")
    try:
        proc.start()
        child.close()
        if not parent.poll(CHILD_TIMEOUT_S) or parent.recv_bytes() != b"ready":
            raise RuntimeError("pipe child did not start")
        for size in sizes:
            op = _pipe_sender(parent, filled(size))
            try:
                emit("pipe_copy", "multiprocessing_pipe", size, timer.measure(op))
            finally:
                del op  # and the array with it
    finally:
        stop_child(proc, lambda: parent.send_bytes(b""))
        parent.close()


# ---- bundle --------------------------------------------------------------------------------------

def bench_bundle(client, timer, prefix):
    arrays = {f"t{i:03d}": np.full(BUNDLE_ELEMS, i, dtype=np.float32)
              for i in range(BUNDLE_TENSORS)}
    bundle = f"{prefix}/bundle"
    singles = [f"{prefix}/single/{key}" for key in arrays]
    published = []
    try:
        client.publish_dict(bundle, arrays, ephemeral=True)
        published.append(bundle)
        for name, a in zip(singles, arrays.values()):
            client.publish(name, a, ephemeral=True)
            published.append(name)

        def attach_dict():
            d = client.attach_dict(bundle)
            if len(d) != BUNDLE_TENSORS:
                raise RuntimeError(f"attach_dict gave {len(d)} tensors")
            for t in d.values():
                t.release()

        def single_x500():
            ts = [client.attach(name) for name in singles]
            for t in ts:
                t.release()

        first = singles[0]

        def single_x1():
            client.attach(first).release()

        emit("bundle", "attach_dict", None, timer.measure(attach_dict))
        emit("bundle", "single_x500", None, timer.measure(single_x500))
        emit("bundle", "single_x1", None, timer.measure(single_x1))
    finally:
        for name in published:
            unpublish_quietly(client, name)


# ---- main ----------------------------------------------------------------------------------------

def parse_sizes(text):
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of byte counts: {text!r}")
    bad = [s for s in sizes if s <= 0 or s % 4]
    if not sizes or bad:
        raise argparse.ArgumentTypeError(
            f"sizes must be positive multiples of 4 (float32): {text!r}")
    return sizes


def _sigterm(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through every finally: nothing is left behind


def main():
    global _out
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, help="dlpackd's socket")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke test: sizes {','.join(map(str, QUICK_SIZES))}, at most 100 reps")
    ap.add_argument("--sizes", type=parse_sizes, default=None,
                    help="comma-separated byte counts of float32 data "
                         f"(default {','.join(map(str, DEFAULT_SIZES))})")
    ap.add_argument("--only", default=None,
                    help="comma-separated groups to run (default: every group)")
    args = ap.parse_args()
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)

    # stdout carries the rows only: keep a private copy of it for them and point fd 1 (which the
    # children inherit, as does any C library that prints) at stderr.
    sys.stdout.flush()
    _out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGTERM, _sigterm)

    timer = Timer(args.quick)
    prefix = f"bench_py/{os.getpid()}"
    # every row but attach_py/dlpack_ipc_cached measures the round trip: no cache of idle
    # references in this process or its children (read when a client connects)
    os.environ["DLPC_CACHE_ENTRIES"] = "0"
    try:
        client = dlpack_ipc.Client(args.socket)
    except OSError as e:
        log(f"cannot reach dlpackd at {args.socket}: {e}")
        return 2
    failed = []
    start = time.monotonic()
    try:
        for label, run in [
            ("attach_py", lambda: bench_attach(client, timer, args.socket, prefix, sizes)),
            ("handoff", lambda: bench_handoff(client, timer, args.socket, prefix, sizes)),
            ("channel", lambda: bench_channel(client, timer, args.socket, prefix, sizes)),
            ("pipeline", lambda: bench_pipeline(client, args.socket, prefix, args.quick)),
            ("pipe_copy", lambda: bench_pipe(timer, sizes)),
            ("bundle", lambda: bench_bundle(client, timer, prefix)),
        ]:
            if args.only is not None and label not in args.only.split(","):
                continue
            try:
                run()
            except Exception:
                failed.append(label)
                log(f"{label} failed:\n{traceback.format_exc()}")
            gc.collect()
    except (KeyboardInterrupt, SystemExit):
        log("interrupted: cleaned up, stopping")
        raise
    finally:
        client.close()
    log(f"done in {time.monotonic() - start:.1f} s" +
        (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
