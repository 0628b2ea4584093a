#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Python half of the dlpackd benchmarks: dlpack_ipc against what Python offers without it.

    /usr/bin/python3 bench/bench_py.py --socket PATH [--quick] [--sizes 4096,65536,...]
                                       [--only GROUP,...] [--peers]

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
                                    torch.from_dlpack, release, on channel()'s default kind
                                    (the row's kind: direct where it can serve)
             dlpack_channel_queued  the same over a queued channel (channel(direct=False)):
                                    the message goes through dlpackd
             dlpack_channel_direct  the same over a direct channel (channel(direct=True)): the
                                    message goes between the processes, not through dlpackd
             dlpack_channel_direct_fresh  the same with the child's caches off: its storage
                                    mapped anew for each message (the rows above keep the
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

With --peers, the groups that compare against Ray, safetensors and torch.multiprocessing instead
(bench/requirements.txt; Ray runs locally, started once, its start-up timed by no row). Their
sizes are their own (--sizes does not apply). A peer that cannot run prints a row
{"group": G, "impl": I, "size": S, "skipped": REASON} instead, and the reason on stderr.

  fresh      a new array (made, not timed, before each rep) handed to a waiting process that
             reads one element and acks one byte on a socket (4 KiB, 1 MiB, 64 MiB, 256 MiB):
             dlpack_channel         Channel.send (a copy) / recv on channel()'s default kind
                                    (the row's "kind"), torch.from_dlpack, release
             dlpack_channel_direct, dlpack_channel_queued  the same on each kind
             ray                    ray.put, then an actor's method ray.get()s the ObjectRef
                                    (passed in a list) and returns the element: the ack
             torch_multiprocessing  the tensor put on a torch.multiprocessing Queue (which moves
                                    it into new shared memory), got by the child
  publish_fresh  a new 64 MiB array: dlpack_ipc (publish, the copy path) / ray (ray.put); the
             name unpublished and the ObjectRef dropped between reps, not timed
  state_dict a 400 MiB state dict of 200 float32 tensors: dlpack_ipc (publish_dict) / ray
             (ray.put of the dict) / ray_numpy (ray.put of the same dict as numpy arrays, which
             Ray serializes out of band) / safetensors (save_file to a file in /dev/shm); row
             key "tensors"
  readers    8 processes re-attach one entry for 1 s (4 KiB, 64 MiB): dlpack_ipc (attach +
             np.from_dlpack + read + release, caches at their defaults) / shared_memory
             (SharedMemory(name) + ndarray + read + close) / ray (8 actors, ray.get of the same
             ObjectRef + read); rows {"group": "readers", "impl": I, "size": S, "clients": 8,
             "ops_per_s": F}

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

from ray_local import ray_init, ray_temp_dir

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

    def measure(self, op, setup=None):
        """Run op() untimed a few times, then `reps` timed times; returns (median, p99, reps).
        With setup, each rep runs op(setup()) and only op is timed (the rep count allows for
        setup's time too)."""
        gc.collect()
        run = op if setup is None else (lambda: op(setup()))
        start = time.perf_counter_ns()
        n = 0
        while True:  # 2 to warmup_max warm-up reps, fewer once warmup_s is spent
            run()
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
            if setup is None:
                for i in range(reps):
                    t0 = counter()
                    op()
                    times[i] = counter() - t0
            else:
                for i in range(reps):
                    arg = setup()
                    t0 = counter()
                    op(arg)
                    times[i] = counter() - t0
                    del arg
        finally:
            if gc_was_on:
                gc.enable()
        return self._stats(times)

    @staticmethod
    def _stats(times):
        times.sort()
        reps = len(times)
        mid = reps // 2
        median = times[mid] if reps % 2 else (times[mid - 1] + times[mid]) / 2
        p99 = times[max(0, math.ceil(0.99 * reps) - 1)]
        return median / 1e3, p99 / 1e3, reps


def emit(group, impl, size, result, **extra):
    median, p99, reps = result
    row = {"group": group, "impl": impl, "size": size,
           "median_us": round(median, 3), "p99_us": round(p99, 3), "reps": reps, **extra}
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

def attach_op(client, name):
    """One attach of name + np.from_dlpack + read one element + release."""
    def op():
        t = client.attach(name)
        a = np.from_dlpack(t)
        a[0]  # the read is the point
        del a
        t.release()
    return op


def shm_op(shm_name, shape):
    """One stdlib SharedMemory(shm_name) + float32 ndarray of shape + read one element + close."""
    from multiprocessing import shared_memory

    def op():
        shm = shared_memory.SharedMemory(name=shm_name)
        a = np.ndarray(shape, np.float32, buffer=shm.buf)
        a[0]
        del a
        shm.close()
    return op


def attach_dlpack_row(client, timer, prefix, size):
    name = f"{prefix}/attach/{size}"
    a = filled(size)
    client.publish(name, a, ephemeral=True)
    del a  # the entry has its own copy in a memfd
    try:
        emit("attach_py", "dlpack_ipc", size, timer.measure(attach_op(client, name)))
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
        before = client.stat()["req_attach"]
        emit("attach_py", "dlpack_ipc_cached", size, timer.measure(attach_op(client, name)))
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
        emit("attach_py", "shared_memory", size, timer.measure(shm_op(shm_name, shape)))
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
    channel (channel()'s default kind; "queued", "direct": the channel of that kind, "fresh":
    the direct one without the caches) until a bundle (("named", NAME): from the channel NAME,
    as it was created);
    ("fd",): memfds over sock until a message without one; ("end",)."""
    import mmap
    import socket as socketmod
    try:
        import torch
        torch.set_num_threads(1)
        # as a user's receiver is: the mapping of a storage that comes again is kept (maps.c)
        ch = dlpack_ipc.Channel(chname, client=cached_client(socket))
        dch = fch = qch = None
        named = {}
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
        elif mode[0] in ("channel", "queued", "direct", "fresh", "named"):
            if mode[0] == "named" and mode[1] not in named:
                named[mode[1]] = dlpack_ipc.Channel(mode[1], client=ch._client)
            if mode[0] == "queued" and qch is None:
                qch = dlpack_ipc.Channel(chname + "-queued", direct=False, client=ch._client)
            if mode[0] == "direct" and dch is None:
                dch = dlpack_ipc.Channel(chname + "-direct", direct=True, client=ch._client)
            if mode[0] == "fresh" and fch is None:
                # a client without the caches: every message mapped anew
                fch = dlpack_ipc.Channel(chname + "-direct", direct=True,
                                         client=dlpack_ipc.Client(socket))
            rch = named[mode[1]] if mode[0] == "named" else \
                {"channel": ch, "queued": qch, "direct": dch, "fresh": fch}[mode[0]]
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


class ChannelChild:
    """_channel_child in a spawned process: inq takes its modes and tensors, ps is the socket
    that carries the floor's memfds to it and its one-byte acks back (ack())."""

    def __init__(self, socket, chname, label):
        import socket as socketmod
        import torch.multiprocessing as tmp
        ctx = tmp.get_context("spawn")
        self.label, self.inq = label, ctx.Queue()
        self.ps, cs = socketmod.socketpair(socketmod.AF_UNIX, socketmod.SOCK_STREAM)
        self.proc = ctx.Process(target=_channel_child, args=(socket, chname, self.inq, cs),
                                daemon=True, name=f"bench_py-{label}")
        try:
            log(f"starting the {label} child (spawn, imports torch)")
            self.proc.start()
            cs.close()
            self.ack(b"r")
        except BaseException:
            cs.close()
            self.close()
            raise

    def ack(self, want=b"1"):
        got = self.ps.recv(1)
        if got != want:
            raise RuntimeError(f"{self.label} child acked {got!r}")

    def close(self):
        stop_child(self.proc, lambda: self.inq.put(("end",)))
        self.ps.close()
        self.inq.close()
        self.inq.join_thread()


def bench_channel(client, timer, socket, prefix, sizes):
    import socket as socketmod
    import torch
    torch.set_num_threads(1)
    chname = f"{prefix}/channel"
    ch = client.channel(chname, 1)  # channel()'s default kind
    qch = client.channel(chname + "-queued", 1, direct=False)
    dch = client.channel(chname + "-direct", 1, direct=True)
    child = None
    try:
        child = ChannelChild(socket, chname, "channel")
        inq, ps, ack = child.inq, child.ps, child.ack
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
            # the same buffer over channel()'s default kind, a queued and a direct channel,
            # and the direct one again to a receiver without the caches ("fresh")
            for mode, impl, c, kind in (
                    ("channel", "dlpack_channel", ch, "direct" if ch.direct else "queued"),
                    ("queued", "dlpack_channel_queued", qch, "queued"),
                    ("direct", "dlpack_channel_direct", dch, "direct"),
                    ("fresh", "dlpack_channel_direct_fresh", dch, None)):
                inq.put((mode,))

                def channel_op(c=c):
                    c.send(buf)
                    ack()
                extra = {"kind": kind} if kind else {}
                emit("channel", impl, size, timer.measure(channel_op), **extra)
                c.send_dict({"stop": np.zeros(1)})
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
        if child is not None:
            child.close()
        for c in (ch, qch, dch):
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


# ---- peers: Ray, safetensors (bench/requirements.txt) --------------------------------------------

FRESH_SIZES = [4096, 1 << 20, 64 << 20, 256 << 20]
QUICK_FRESH_SIZES = [4096, 1 << 20]
PUBLISH_BYTES = 64 << 20        # publish_fresh's array (quick: 1 MiB)
STATE_TENSORS = 200             # state_dict: 200 tensors of 2 MiB (quick: 20 of 64 KiB)
STATE_BYTES = 400 << 20
READERS = 8
READERS_S = 1.0                 # each readers row counts for this long (quick: 0.2 s)
READER_SIZES = [4096, 64 << 20]
RAY_STORE_BYTES = 2 << 30       # Ray's object store: room for 4 of the largest object here
RAY_QUICK_STORE_BYTES = 128 << 20


def emit_skipped(group, impl, size, why):
    """A row that could not be measured, and why (run.py reports it; never a silent gap)."""
    _out.write(json.dumps({"group": group, "impl": impl, "size": size, "skipped": why}) + "\n")
    _out.flush()
    log(f"{group:<9} {impl:<22} {'-' if size is None else human(size):>8}: skipped: {why}")


class Ray:
    """A local Ray for this run: started on first use, its start-up timed by no row, its
    object store filled once and emptied (so that puts find it mapped and faulted in, as a
    running Ray does), shut down by close() with its directory. get() returns the ray module
    or None, with the reason in self.why."""

    def __init__(self, store_bytes):
        self.store_bytes, self.tmpdir = store_bytes, ray_temp_dir()
        self.ray, self.why, self._takers = None, None, []

    def get(self):
        if self.ray is None and self.why is None:
            try:
                self._start()
            except Exception as e:
                self.why = f"Ray did not start: {type(e).__name__}: {e}"
                log(self.why)
        return self.ray

    def _start(self):
        try:
            import ray
        except ImportError as e:
            self.why = (f"ray cannot be imported by {sys.executable} ({e}): scripts/dev bench "
                        "installs bench/requirements.txt into the bench's venv")
            log(self.why)
            return
        log(f"starting Ray {ray.__version__} (object store {human(self.store_bytes)}; "
            "not timed)")
        import logging
        ray_init(ray, self.tmpdir, num_cpus=2, object_store_memory=self.store_bytes,
                 logging_level=logging.WARNING)
        self.ray = ray
        chunk = min(64 << 20, self.store_bytes // 8)
        refs = [ray.put(np.ones(chunk // 4, np.float32))
                for _ in range(self.store_bytes * 3 // 4 // chunk)]
        del refs

    def takers(self, n):
        """n actors in processes of their own, each with take() and reread() (see below)."""
        ray = self.ray

        @ray.remote(num_cpus=0)
        class Taker:
            def ready(self):
                return os.getpid()

            def take(self, refs):
                a = ray.get(refs[0])
                v = float(a.reshape(-1)[0])
                del a
                return v

            def reread(self, refs, start_at, stop_at):
                ref, n = refs[0], 0
                while time.monotonic() < start_at:
                    time.sleep(0.0002)
                while time.monotonic() < stop_at:
                    a = ray.get(ref)
                    a[0]
                    del a
                    n += 1
                return n

        while len(self._takers) < n:
            self._takers.append(Taker.remote())
        ray.get([t.ready.remote() for t in self._takers])
        return self._takers[:n]

    def close(self):
        import shutil
        if self.ray is not None:
            self._takers.clear()
            self.ray.shutdown()
            self.ray = None
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def fresh_array(size):
    """What a producer just computed: a new array in private memory, every page written."""
    a = np.empty(size // 4, dtype=np.float32)
    a.fill(1.0)
    return a


def bench_fresh(client, timer, socket, prefix, sizes, ray):
    """A new array each time, sent (copied) to a waiting process that reads one element."""
    import torch
    torch.set_num_threads(1)
    base = f"{prefix}/fresh"
    chans = [("dlpack_channel", client.channel(base, 1), ("channel",)),
             ("dlpack_channel_direct", client.channel(base + "-direct", 1, direct=True),
              ("named", base + "-direct")),
             ("dlpack_channel_queued", client.channel(base + "-queued", 1, direct=False),
              ("named", base + "-queued"))]
    kind = "direct" if chans[0][1].direct else "queued"
    held = []  # Ray's last object, dropped untimed before the next rep
    child = None
    try:
        r = ray.get()
        taker = ray.takers(1)[0] if r else None
        child = ChannelChild(socket, base, "fresh hand-off")
        inq, ack = child.inq, child.ack
        for size in sizes:
            inq.put(("torch",))

            def torch_op(a):
                inq.put(("t", torch.from_numpy(a)))  # put() moves it into shared memory
                ack()
            emit("fresh", "torch_multiprocessing", size,
                 timer.measure(torch_op, lambda: fresh_array(size)))
            inq.put(("stop",))
            ack(b"d")
            for impl, ch, mode in chans:
                inq.put(mode)

                def send_op(a, ch=ch):
                    ch.send(a)
                    ack()
                extra = {"kind": kind} if impl == "dlpack_channel" else {}
                emit("fresh", impl, size, timer.measure(send_op, lambda: fresh_array(size)),
                     **extra)
                ch.send_dict({"stop": np.zeros(1)})
                ack(b"d")
            if r is None:
                emit_skipped("fresh", "ray", size, ray.why)
                continue

            def ray_setup():
                held.clear()
                return fresh_array(size)

            def ray_op(a):
                ref = r.put(a)
                if r.get(taker.take.remote([ref])) != 1.0:
                    raise RuntimeError("Ray's actor read a wrong value")
                held.append(ref)
            emit("fresh", "ray", size, timer.measure(ray_op, ray_setup))
            held.clear()
    finally:
        held.clear()
        if child is not None:
            child.close()
        for _, c, _ in chans:
            try:
                c.remove()
            except OSError:
                pass


def publish_vs_ray(client, timer, group, name, size, ray, publish, make, **extra):
    """publish(arg) (ours, under name) against ray.put(arg), arg = make() before each rep;
    between reps name is unpublished and Ray's object dropped: none of that is timed."""
    r = ray.get()
    held = []

    def setup():
        unpublish_quietly(client, name)
        held.clear()
        return make()
    try:
        emit(group, "dlpack_ipc", size, timer.measure(publish, setup), **extra)
        if r is None:
            emit_skipped(group, "ray", size, ray.why)
        else:
            emit(group, "ray", size, timer.measure(lambda a: held.append(r.put(a)), setup),
                 **extra)
    finally:
        held.clear()
        unpublish_quietly(client, name)


def bench_publish_fresh(client, timer, prefix, size, ray):
    """Publishing a new array (the copy path) against ray.put of it."""
    name = f"{prefix}/publish_fresh"
    publish_vs_ray(client, timer, "publish_fresh", name, size, ray,
                   lambda a: client.publish(name, a, ephemeral=True), lambda: fresh_array(size))


def bench_state_dict(client, timer, prefix, ntensors, nbytes, ray):
    """A state dict of ntensors float32 tensors published by publish_dict, ray.put of the
    dict and safetensors' save_file to /dev/shm."""
    import torch
    elems = nbytes // ntensors // 4
    sd = {f"layer{i:03d}.weight": torch.full((elems // 1024, 1024), float(i))
          for i in range(ntensors)}
    name = f"{prefix}/state_dict"
    publish_vs_ray(client, timer, "state_dict", name, nbytes, ray,
                   lambda d: client.publish_dict(name, d, ephemeral=True), lambda: sd,
                   tensors=ntensors)
    # Ray serializes numpy arrays out of band, torch tensors by pickling: the same dict as numpy
    # arrays (views, no copy) is Ray's best way to put it
    r = ray.get()
    if r is None:
        emit_skipped("state_dict", "ray_numpy", nbytes, ray.why)
    else:
        nd, held = {k: v.numpy() for k, v in sd.items()}, []
        emit("state_dict", "ray_numpy", nbytes,
             timer.measure(lambda _: held.append(r.put(nd)), held.clear), tensors=ntensors)
        held.clear()
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        emit_skipped("state_dict", "safetensors", nbytes,
                     f"safetensors cannot be imported by {sys.executable} ({e})")
        return
    path = f"/dev/shm/bench_py_{os.getpid()}.safetensors"

    def unlink():
        if os.path.exists(path):
            os.unlink(path)
    try:
        emit("state_dict", "safetensors", nbytes,
             timer.measure(lambda _: save_file(sd, path), unlink), tensors=ntensors)
    finally:
        unlink()


def _reader(kind, socket, name, size, ready, go, start_at, seconds, out):
    """One of the readers: re-attach name (ours or SharedMemory) as often as it can for seconds
    from start_at, reading one element each time; puts the count on out."""
    op = attach_op(cached_client(socket), name) if kind == "dlpack_ipc" else \
        shm_op(name, (size // 4,))
    op()
    ready.put(1)
    go.wait(CHILD_TIMEOUT_S)
    t0 = start_at.value
    while time.monotonic() < t0:
        time.sleep(0.0002)
    n, stop = 0, t0 + seconds
    while time.monotonic() < stop:
        op()
        n += 1
    out.put(n)


def readers_row(kind, socket, name, size, seconds):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    procs = [ctx.Process(target=_reader, daemon=True, name=f"bench_py-reader{i}",
                         args=(kind, socket, name, size, ready, go, start_at, seconds, out))
             for i in range(READERS)]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.get(timeout=CHILD_TIMEOUT_S)
        start_at.value = time.monotonic() + 0.1
        go.set()
        return sum(out.get(timeout=CHILD_TIMEOUT_S) for _ in procs) / seconds
    finally:
        for p in procs:
            stop_child(p, lambda: None)


def bench_readers(client, prefix, sizes, seconds, ray, socket):
    """READERS processes re-attaching one entry over and over: attaches per second, all told."""
    from multiprocessing import shared_memory
    r = ray.get()
    takers = ray.takers(READERS) if r else []

    def emit_rate(impl, size, rate):
        _out.write(json.dumps({"group": "readers", "impl": impl, "size": size,
                               "clients": READERS, "ops_per_s": round(rate)}) + "\n")
        _out.flush()
        log(f"readers   {impl:<22} {human(size):>8}: {rate:10.0f} attaches/s ({READERS} readers)")

    for size in sizes:
        name = f"{prefix}/readers/{size}"
        client.publish(name, fresh_array(size), ephemeral=True)
        try:
            emit_rate("dlpack_ipc", size, readers_row("dlpack_ipc", socket, name, size, seconds))
        finally:
            unpublish_quietly(client, name)
        creator = shared_memory.SharedMemory(create=True, size=size,
                                             name=f"bench_py_{os.getpid()}_readers_{size}")
        try:
            np.ndarray((size // 4,), np.float32, buffer=creator.buf).fill(1.0)
            emit_rate("shared_memory", size,
                      readers_row("shared_memory", socket, creator.name, size, seconds))
        finally:
            creator.close()
            creator.unlink()
        if r is None:
            emit_skipped("readers", "ray", size, ray.why)
            continue
        ref = r.put(fresh_array(size))
        try:
            start_at = time.monotonic() + 0.2
            counts = r.get([t.reread.remote([ref], start_at, start_at + seconds)
                            for t in takers])
            emit_rate("ray", size, sum(counts) / seconds)
        finally:
            del ref


def peer_groups(client, timer, socket, prefix, quick, ray):
    """The peer groups, as (label, run) pairs; ray: the Ray they share."""
    return [
        ("fresh", lambda: bench_fresh(client, timer, socket, prefix,
                                      QUICK_FRESH_SIZES if quick else FRESH_SIZES, ray)),
        ("publish_fresh", lambda: bench_publish_fresh(
            client, timer, prefix, (1 << 20) if quick else PUBLISH_BYTES, ray)),
        ("state_dict", lambda: bench_state_dict(
            client, timer, prefix, 20 if quick else STATE_TENSORS,
            (20 << 16) if quick else STATE_BYTES, ray)),
        ("readers", lambda: bench_readers(client, prefix, QUICK_SIZES if quick else READER_SIZES,
                                          0.2 if quick else READERS_S, ray, socket)),
    ]


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
    ap.add_argument("--peers", action="store_true",
                    help="run the peer groups (fresh, publish_fresh, state_dict, readers: Ray, "
                         "safetensors, torch.multiprocessing) instead of the others")
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
    only = None if args.only is None else args.only.split(",")
    ray = Ray(RAY_QUICK_STORE_BYTES if args.quick else RAY_STORE_BYTES) if args.peers else None
    try:
        for label, run in peer_groups(client, timer, args.socket, prefix, args.quick,
                                      ray) if args.peers else [
            ("attach_py", lambda: bench_attach(client, timer, args.socket, prefix, sizes)),
            ("handoff", lambda: bench_handoff(client, timer, args.socket, prefix, sizes)),
            ("channel", lambda: bench_channel(client, timer, args.socket, prefix, sizes)),
            ("pipeline", lambda: bench_pipeline(client, args.socket, prefix, args.quick)),
            ("pipe_copy", lambda: bench_pipe(timer, sizes)),
            ("bundle", lambda: bench_bundle(client, timer, prefix)),
        ]:
            if only is not None and label not in only:
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
        if ray is not None:
            ray.close()
        client.close()
    log(f"done in {time.monotonic() - start:.1f} s" +
        (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
