# SPDX-License-Identifier: Apache-2.0
"""The processes that tests/gpu/gpu_check.py starts, one role each (real GPU only):

    python3 gpu_roles.py ROLE JSON_ARGUMENTS

A role reports to the driver in JSON lines, {"kind": ..., ...} each, on the descriptor that was
its stdout; stdout itself then goes to stderr, the role's log, so that nothing a library prints
can garble a report. It reads commands, {"op": ..., ...}, from stdin. A role that cannot go on
reports {"kind": "error", "why": ...} (its traceback is in the log) or {"kind": "skip", "why":
...} and ends. SIGUSR1 writes every thread's stack to the log: the driver sends it to a role
that does not answer in time, before killing it.

Tensors hold a pattern that depends on a seed (fill_pattern) and are compared by checksum(),
computed on the GPU, on the stream the tensor was ordered on. Every device is cuda:0.
"""
import contextlib
import errno
import faulthandler
import gc
import json
import os
import select
import signal
import sys
import threading
import time
import traceback

import torch
import torch.utils.dlpack

import dlpack_ipc

DEV = "cuda:0"
FILL_CHUNK = 1 << 24  # elements per step of fill_pattern
SUM_CHUNK = 1 << 20  # words per partial sum of checksum (each < 2^59: no int64 overflow)

_reports = None


class Skipped(Exception):
    """The role cannot run here (no CuPy): reported as a skip, not a failure."""


class Unavailable(Exception):
    """One tensor of a publisher cannot be made here (CuPy's MemoryAsyncPool)."""


def report(kind, **fields):
    fields["kind"] = kind
    _reports.write(json.dumps(fields) + "\n")
    _reports.flush()


def command(expect=None):
    line = sys.stdin.readline()
    if not line:  # the driver went away
        raise SystemExit(0)
    cmd = json.loads(line)
    if expect is not None and cmd.get("op") != expect:
        raise RuntimeError(f"expected the command {expect!r}, got {cmd!r}")
    return cmd


# ---- tensors: a pattern, a checksum, a long kernel ----

def fill_pattern(x, seed):
    """Write the pattern of `seed` into the contiguous tensor x (values < 2^24: exact in float32)
    on the current stream, and return x."""
    flat = x.view(-1)
    n = flat.numel()
    for s in range(0, n, FILL_CHUNK):
        e = min(n, s + FILL_CHUNK)
        i = torch.arange(s, e, dtype=torch.int64, device=x.device)
        flat[s:e].copy_((i * 2654435761 + seed * 1000003) % 16777213)
    return x


def pattern(n, seed):
    return fill_pattern(torch.empty(n, dtype=torch.float32, device=DEV), seed)


def checksum(x):
    """[sum of x's 32-bit words, sum weighted by position], over its bytes, as Python ints.

    Computed on the current stream, which it then waits for (the .tolist())."""
    flat = x.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.numel() == 0:
        return [0, 0]
    words = flat.view(torch.uint8)
    if words.numel() % 4 == 0:
        try:
            words = words.view(torch.int32)
        except RuntimeError:  # a storage offset that is not a multiple of 4 bytes
            pass
    parts = []
    for s in range(0, words.numel(), SUM_CHUNK):
        c = words[s:s + SUM_CHUNK].to(torch.int64)
        w = torch.arange(s, s + c.numel(), dtype=torch.int64, device=c.device) % 251 + 1
        parts.append(torch.stack([c.sum(), (c * w).sum()]))
    sums = torch.stack(parts).tolist()
    return [sum(a for a, _ in sums), sum(b for _, b in sums)]


_spin_rate = None  # torch.cuda._sleep cycles per second, or matmuls per second


def _calibrate():
    """After some work first: an idle GPU runs at a lower clock, and a rate measured then
    would make every later spin() shorter than asked."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(200_000_000)
        a.record()
        torch.cuda._sleep(100_000_000)
        b.record()
        b.synchronize()
        return 100_000_000 / max(a.elapsed_time(b), 1e-3) * 1e3
    m = torch.randn(2048, 2048, device=DEV)
    out = torch.empty_like(m)
    for _ in range(50):
        torch.mm(m, m, out=out)
    a.record()
    for _ in range(50):
        torch.mm(m, m, out=out)
    b.record()
    b.synchronize()
    return 50 / max(a.elapsed_time(b), 1e-3) * 1e3


def spin(seconds):
    """Queue about `seconds` of GPU work on the current stream (the host does not wait)."""
    global _spin_rate
    if _spin_rate is None:
        _spin_rate = _calibrate()
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(max(1, int(seconds * _spin_rate)))
        return
    m = torch.randn(2048, 2048, device=DEV)
    out = torch.empty_like(m)
    for _ in range(max(1, int(seconds * _spin_rate))):
        torch.mm(m, m, out=out)


def warm():
    """Start CUDA in torch and in libdlpc, connect to dlpackd and calibrate spin(), so that
    what is timed later is the work itself."""
    torch.cuda.init()
    torch.zeros(1, device=DEV)
    spin(0)
    torch.cuda.synchronize()
    dlpack_ipc.stat()
    dlpack_ipc.empty((1,), "float32", device=DEV).release()


def allocated():
    """Bytes torch's allocator has handed out, or None where it does not count them (the
    cudaMallocAsync backend of some torch versions)."""
    try:
        return torch.cuda.memory_allocated()
    except RuntimeError:
        return None


def memory_back(target, timeout, since):
    """Wait until torch's allocator holds at most `target` bytes: seconds from `since`
    (a perf_counter), or None after `timeout` seconds (or if it does not count)."""
    if target is None:
        return None
    deadline = time.perf_counter() + timeout
    while True:
        if allocated() <= target:
            return time.perf_counter() - since
        if time.perf_counter() > deadline:
            return None
        time.sleep(0.0005)


class EventWatch(threading.Thread):
    """Notes when a CUDA event completes (time.monotonic(), comparable across processes)."""

    def __init__(self, event):
        super().__init__(daemon=True)
        self.event = event
        self.at = None
        self.start()

    def run(self):
        while not self.event.query():
            time.sleep(0.0005)
        self.at = time.monotonic()

    def result(self, timeout):
        self.join(timeout)
        return self.at


def _cupy():
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library CuPy cannot load
        raise Skipped(f"no cupy ({type(e).__name__}: {e})") from None
    return cupy


def _cupy_pattern(cupy, n, seed):
    i = cupy.arange(n, dtype=cupy.int64)
    return ((i * 2654435761 + seed * 1000003) % 16777213).astype(cupy.float32)


# ---- publishers and attachers used by several checks ----

def _make(kind, n, seed, offset):
    """(what to publish, a torch view of its memory) holding the pattern of `seed`."""
    if kind == "torch":  # torch's allocator, as PYTORCH_CUDA_ALLOC_CONF sets it up
        base = torch.empty(n + 2 * offset, dtype=torch.float32, device=DEV)
        x = fill_pattern(base[offset:offset + n], seed)
        return x, x
    if kind == "vmm":
        v = dlpack_ipc.empty((n,), "float32", device=DEV)
        x = fill_pattern(torch.from_dlpack(v), seed)
        torch.cuda.synchronize()  # a VMM entry carries no event: finish writing first (dlpc.h)
        return v, x
    cupy = _cupy()
    if kind == "cupy":  # CuPy's default memory pool
        a = cupy.empty(n + 2 * offset, dtype=cupy.float32)[offset:offset + n]
        a[...] = _cupy_pattern(cupy, n, seed)
        return a, torch.from_dlpack(a)
    if kind == "cupy-async":
        try:
            pool = cupy.cuda.MemoryAsyncPool()
            with cupy.cuda.using_allocator(pool.malloc):
                a = cupy.empty(n, dtype=cupy.float32)
        except Exception as e:
            raise Unavailable(f"CuPy's MemoryAsyncPool: {type(e).__name__}: {e}") from None
        a[...] = _cupy_pattern(cupy, n, seed)
        return a, torch.from_dlpack(a)
    raise ValueError(f"unknown kind {kind!r}")


def _publish_one(spec):
    name = spec["name"]
    mem_before = allocated()
    try:
        obj, view = _make(spec["kind"], spec["n"], spec["seed"], spec.get("offset", 0))
    except Unavailable as e:
        return {"unavailable": str(e)}
    r = {"checksum": checksum(view), "ptr": view.data_ptr()}
    fds = dlpack_ipc.stat()["fds_open"]
    t0 = time.perf_counter()
    refused = None
    try:
        dlpack_ipc.publish(name, obj)
    except (BufferError, ValueError, OSError) as e:
        refused = e
    if refused is not None:
        # libdlpc ran the producer's deleter before publish raised, and no frame of
        # dlpack_ipc's in the exception's traceback keeps the tensor: once this role drops its
        # own references, the memory is torch's again while the exception is still alive (a
        # caller's fallback copy needs it there)
        r.update(published=False, error=f"{type(refused).__name__}: {refused}",
                 error_type=type(refused).__name__)
        del obj, view
        r["freed"] = memory_back(mem_before, 5, t0) is not None
        del refused
        return r
    # the daemon holds an fd for a VMM entry (dlpc_alloc or lent), none for legacy IPC
    r.update(published=True, publish_s=time.perf_counter() - t0,
             fd=dlpack_ipc.stat()["fds_open"] > fds)
    # only the library holds a legacy or lent tensor now; a VMM entry's memory the daemon's fd
    return r


def _attach_here(name, r):
    """Attach `name` in the process that published it: its own pointer, no import."""
    t0 = time.perf_counter()
    t = dlpack_ipc.attach(name)
    y = torch.from_dlpack(t)
    out = {"attach_s": time.perf_counter() - t0, "same_ptr": y.data_ptr() == r["ptr"],
           "checksum": checksum(y)}
    del y
    t.release()
    return out


def publisher(specs, same_process=None, then="unpublish"):
    """Publish every spec ({name, kind, n, seed, offset}), dropping its own references, and
    report each result; then exit, or wait for "unpublish" and report how long the library
    took to give the memory back (torch's allocator shows it free again)."""
    warm()
    mem0 = allocated()
    results = {}
    for spec in specs:
        results[spec["name"]] = _publish_one(spec)
    if same_process and results[same_process].get("published"):
        results[same_process]["same_process"] = _attach_here(same_process,
                                                             results[same_process])
    report("published", results=results)
    if then == "exit":
        return
    command("unpublish")
    t0 = time.perf_counter()
    for name, r in results.items():
        if r.get("published"):
            dlpack_ipc.unpublish(name)
    unpublish_s = time.perf_counter() - t0
    gc.collect()
    report("unpublished", unpublish_s=unpublish_s, reclaim_s=memory_back(mem0, 60, t0))


def attacher(items):
    """Attach every item ({name}) with torch.from_dlpack, twice, once told "go"."""
    warm()
    report("ready")
    command("go")
    out = {}
    for it in items:
        name = it["name"]
        t0 = time.perf_counter()
        t = dlpack_ipc.attach(name)
        y = torch.from_dlpack(t)
        t1 = time.perf_counter()
        r = {"attach_s": t1 - t0, "device": t.device, "tensor_device": str(y.device),
             "shape": list(y.shape), "dtype": str(y.dtype), "checksum": checksum(y)}
        t2 = time.perf_counter()
        again = dlpack_ipc.attach(name)
        y2 = torch.from_dlpack(again)
        r["again_s"] = time.perf_counter() - t2
        r["same_mapping"] = y2.data_ptr() == y.data_ptr()
        del y, y2
        t.release()
        again.release()
        out[name] = r
    report("attached", results=out)


def late_attacher(name):
    """Attach `name` (perhaps after its publisher exited): report the checksum, or why not."""
    torch.cuda.init()
    try:
        t = dlpack_ipc.attach(name)
        got = checksum(torch.from_dlpack(t))
        t.release()
    except Exception as e:
        report("failed", error=f"{type(e).__name__}: {e}")
        return
    report("attached", checksum=got)


def keeper():
    """A CUDA process that keeps the device up until told "exit"."""
    torch.cuda.init()
    torch.zeros(1, device=DEV)
    torch.cuda.synchronize()
    report("ready")
    command("exit")


# ---- ordering behind a publisher's long kernel ----

def order_pub(n, seconds):
    """For each "publish": zeros, synchronized; then a long kernel and the pattern queued on
    the default stream, and publish at once, without synchronizing."""
    warm()
    # once, untimed: the first fill and publish. On an H200 the first variant's kernel (2.07
    # s) had ended when its publish (330 us) returned, and only the first's: the host waited
    # in the first fill_pattern, whose kernels had never run (CUDA loads them lazily)
    x = fill_pattern(torch.zeros(n, dtype=torch.float32, device=DEV), 0)
    dlpack_ipc.publish("gpu/order/warm-up", x)
    dlpack_ipc.unpublish("gpu/order/warm-up")
    del x
    torch.cuda.synchronize()
    report("ready")
    while True:
        cmd = command()
        if cmd["op"] == "exit":
            return
        if cmd["op"] == "unpublish":
            dlpack_ipc.unpublish(cmd["name"])
            report("unpublished")
            continue
        x = torch.zeros(n, dtype=torch.float32, device=DEV)
        torch.cuda.synchronize()
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        spin(seconds)
        fill_pattern(x, cmd["seed"])
        done.record()
        t0 = time.perf_counter()
        dlpack_ipc.publish(cmd["name"], x)
        publish_s = time.perf_counter() - t0
        running = not done.query()
        del x
        report("published", publish_s=publish_s, running=running)
        while not done.query():
            time.sleep(0.0005)
        report("kernel_end", t_end=time.monotonic(), kernel_s=start.elapsed_time(done) / 1e3)


def order_sub():
    """For each "attach": attach and read at once, ordered on the default stream, on a side
    stream (torch.from_dlpack under torch.cuda.stream) or by __dlpack__(stream=side)."""
    warm()
    side = torch.cuda.Stream()
    report("ready")
    while True:
        cmd = command()
        if cmd["op"] == "exit":
            return
        variant = cmd["variant"]
        t0 = time.monotonic()
        t = dlpack_ipc.attach(cmd["name"], timeout=30)
        if variant == "default":
            stream = torch.cuda.current_stream()
            y = torch.from_dlpack(t)
        elif variant == "side":
            stream = side
            with torch.cuda.stream(side):
                y = torch.from_dlpack(t)
        else:  # "capsule": the consumer's stream given to __dlpack__ itself
            stream = side
            y = torch.utils.dlpack.from_dlpack(t.__dlpack__(stream=side.cuda_stream))
        t1 = time.monotonic()
        with torch.cuda.stream(stream):
            got = checksum(y)
        del y
        t.release()
        report("read", t_attach=t0, t_attached=t1, checksum=got,
               expected=checksum(pattern(cmd["n"], cmd["seed"])))


# ---- the reclaim race ----

def reclaim_pub(n):
    """"publish": the pattern, synchronized, published, own references dropped. "unpublish":
    unpublish, wait for the library to hand the memory back (the producer's deleter frees it
    in torch's allocator), take it again at once and overwrite it."""
    warm()
    report("ready")
    ptr = held = None
    while True:
        cmd = command()
        if cmd["op"] == "exit":
            return
        if cmd["op"] == "publish":
            x = fill_pattern(torch.empty(n, dtype=torch.float32, device=DEV), cmd["seed"])
            torch.cuda.synchronize()
            ptr, held = x.data_ptr(), torch.cuda.memory_allocated()
            dlpack_ipc.publish(cmd["name"], x)
            del x
            report("published")
            continue
        t_unpublish = time.monotonic()
        dlpack_ipc.unpublish(cmd["name"])
        t_freed = reused = None
        while time.monotonic() < t_unpublish + cmd["timeout"]:
            if torch.cuda.memory_allocated() <= held - 4 * n:
                t_freed = time.monotonic()
                break
            time.sleep(0.0005)
        if t_freed is not None:
            z = torch.empty(n, dtype=torch.float32, device=DEV)
            reused = z.data_ptr() == ptr
            z.fill_(-1.0)
            torch.cuda.synchronize()
            del z
        report("overwritten", t_unpublish=t_unpublish, t_freed=t_freed, reused=reused)


def reclaim_sub():
    """"read": attach, queue a long kernel and then a copy of the tensor, drop the tensor at
    once. "check": wait for that work and report what the copy holds."""
    warm()
    side = torch.cuda.Stream()
    report("ready")
    pending = None
    while True:
        cmd = command()
        if cmd["op"] == "exit":
            return
        if cmd["op"] == "read":
            variant = cmd["variant"]
            t = dlpack_ipc.attach(cmd["name"], timeout=30)
            stream = side if variant == "side" else torch.cuda.current_stream()
            with torch.cuda.stream(stream):
                if variant == "none":  # no stream named: the release's event goes on the
                    # legacy default stream, which this work is on
                    y = torch.utils.dlpack.from_dlpack(t.__dlpack__(stream=-1))
                else:
                    y = torch.from_dlpack(t)
                spin(cmd["seconds"])
                out = y.clone()
                end = torch.cuda.Event()
                end.record()
            del y, t
            gc.collect()
            pending = (out, stream, EventWatch(end), cmd)
            report("dropped", t_dropped=time.monotonic())
            continue
        out, stream, watch, read = pending
        pending = None
        t_end = watch.result(120)
        with torch.cuda.stream(stream):
            got = checksum(out)
        del out
        report("checked", t_end=t_end, checksum=got,
               expected=checksum(pattern(read["n"], read["seed"])))


# ---- a CUDA graph captured while another thread drops attached tensors ----

def capture_sub(items, wheres=("default", "side", "capture"), hold=False, max_s=20.0):
    """Attach every item, ordered in turn on the streams of wheres (the legacy default stream,
    a side stream, the stream that will capture; PyTorch's side streams are non-blocking), and
    read it there. Then one thread captures a graph on that stream (inside
    dlpack_ipc.cuda_releases_held() with hold) while another drops every attached tensor
    (reference cycles, freed by its gc.collect()); the capture must succeed and replay right,
    and the references go once it is over."""
    warm()
    gc.disable()  # only the dropping thread collects
    streams = {"default": torch.cuda.current_stream(), "side": torch.cuda.Stream(),
               "capture": torch.cuda.Stream()}
    holders, bad = [], []
    for i, it in enumerate(items):
        where = wheres[i % len(wheres)]
        t = dlpack_ipc.attach(it["name"])
        with torch.cuda.stream(streams[where]):
            x = torch.from_dlpack(t)
            if checksum(x) != it["checksum"]:
                bad.append(it["name"])
        h = {"t": t, "x": x}
        h["self"] = h
        holders.append(h)
    del t, x, h
    cap = streams["capture"]
    static = torch.ones(1 << 16, device=DEV)
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):  # warm-up, as torch.cuda.graph asks
        for _ in range(3):
            static.mul_(1.0).add_(0.0)
    torch.cuda.current_stream().wait_stream(cap)
    torch.cuda.synchronize()
    refs = dlpack_ipc.stat()["references"]
    box = {"holders": holders}  # reachable until the dropper clears it
    del holders
    capturing, dropped = threading.Event(), threading.Event()
    info = {}

    def drop():
        try:
            if not capturing.wait(120):
                info["drop_error"] = "the capture never began"
                return
            t0 = time.perf_counter()
            box["holders"].clear()
            info["collected"] = gc.collect()
            info["drop_s"] = time.perf_counter() - t0
        except BaseException as e:
            info["drop_error"] = f"{type(e).__name__}: {e}"
        finally:
            dropped.set()

    dropper = threading.Thread(target=drop)
    dropper.start()
    g = torch.cuda.CUDAGraph()
    ops, timed_out, capture_error = 0, False, None
    t0 = time.perf_counter()
    try:
        with dlpack_ipc.cuda_releases_held() if hold else contextlib.nullcontext():
            with torch.cuda.graph(g, stream=cap):
                capturing.set()
                while ops < 200 or not dropped.is_set():
                    static.mul_(1.0001).add_(0.001)
                    ops += 1
                    if time.perf_counter() - t0 > max_s:
                        timed_out = True
                        break
    except Exception as e:
        capture_error = f"{type(e).__name__}: {e}"
    t_cap_end = time.monotonic()
    capturing.set()
    dropper.join(60)
    gc.enable()
    replay_ok = None
    if capture_error is None:
        g.replay()
        ref = torch.ones_like(static)
        for _ in range(ops):
            ref.mul_(1.0001).add_(0.001)
        torch.cuda.synchronize()
        replay_ok = bool(torch.allclose(static, ref, rtol=1e-5, atol=0))
    released_s = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if dlpack_ipc.stat()["references"] <= refs - len(items):
            released_s = time.monotonic() - t_cap_end
            break
        time.sleep(0.002)
    report("captured", ops=ops, timed_out=timed_out, capture_error=capture_error,
           replay_ok=replay_ok, released_s=released_s, bad=bad, **info)


# ---- fork ----

def _ebadfd(what, fn):
    """None if fn() raises OSError(EBADFD) naming the fork, else what it did."""
    try:
        fn()
    except OSError as e:
        if e.errno == errno.EBADFD and "fork" in str(e):
            return None
        return f"{what}: {type(e).__name__} (errno {e.errno}): {e}"
    except Exception as e:
        return f"{what}: {type(e).__name__}: {e}"
    return f"{what}: no error"


def _forked_child(prefix, legacy, vmm, held, wfd):
    """In the child: GPU calls refused, host calls working, the inherited tensors dropped; the
    results go to the parent through wfd, then a normal interpreter exit."""
    code = 0
    try:
        res = {"gpu": [], "publish_vmm": [], "host": []}
        calls = [
            ("attach of a legacy IPC entry", lambda: dlpack_ipc.attach(legacy["name"])),
            ("attach of a VMM entry", lambda: dlpack_ipc.attach(vmm["name"])),
            ('empty(device="cuda:0")', lambda: dlpack_ipc.empty((4,), "float32", device=DEV)),
            ("__dlpack__(stream=1) of an inherited tensor",
             lambda: held["a"].__dlpack__(stream=1)),
            ("publish of an inherited legacy IPC tensor",
             lambda: dlpack_ipc.publish(f"{prefix}/child-legacy", held["a"])),
        ]
        for what, fn in calls:
            problem = _ebadfd(what, fn)
            if problem:
                res["gpu"].append(problem)
        calls = [
            ("publish of inherited empty() memory",
             lambda: dlpack_ipc.publish(f"{prefix}/child-empty", held["e"])),
            ("publish of an inherited VMM tensor",
             lambda: dlpack_ipc.publish(f"{prefix}/child-vmm", held["b"])),
        ]
        for what, fn in calls:
            problem = _ebadfd(what, fn)
            if problem:
                res["publish_vmm"].append(problem)
        try:
            dlpack_ipc.publish(f"{prefix}/child-host", torch.arange(4, dtype=torch.float32))
            with dlpack_ipc.attach(f"{prefix}/child-host") as t:
                values = memoryview(t).tolist()
            dlpack_ipc.unpublish(f"{prefix}/child-host")
            if values != [0.0, 1.0, 2.0, 3.0]:
                res["host"].append(f"a host entry read back as {values}")
        except Exception as e:
            res["host"].append(f"host publish and attach: {type(e).__name__}: {e}")
        held.clear()  # the inherited GPU tensors: their deleters release nothing here
        gc.collect()
    except BaseException:
        res = {"crash": traceback.format_exc()}
        code = 3
    data = json.dumps(res).encode()
    while data:
        data = data[os.write(wfd, data):]
    os.close(wfd)
    sys.exit(code)


def _read_all(fd, deadline):
    data = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    os.close(fd)
    return data


def _wait_child(pid, deadline):
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return f"killed by signal {os.WTERMSIG(status)}"
            return f"exit {os.WEXITSTATUS(status)}"
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung: killed after 60 s"
        time.sleep(0.01)


def fork_user(prefix, items):
    """Use CUDA through dlpack_ipc only (torch's CUDA stays off until after the fork): attach a
    legacy and a VMM entry, allocate empty() memory, order a capsule on the legacy stream;
    fork; then check that this process's tensors are still whole."""
    legacy, vmm = items
    held = {"a": dlpack_ipc.attach(legacy["name"]), "b": dlpack_ipc.attach(vmm["name"]),
            "e": dlpack_ipc.empty((256,), "float32", device=DEV)}
    held["cap"] = held["a"].__dlpack__(stream=1)
    torch_cuda = torch.cuda.is_initialized()
    rfd, wfd = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _forked_child(prefix, legacy, vmm, held, wfd)
    os.close(wfd)
    data = _read_all(rfd, t0 + 60)
    status = _wait_child(pid, t0 + 60)
    child_s = time.monotonic() - t0
    try:
        child = json.loads(data) if data else None
    except ValueError:
        child = {"crash": f"unreadable results: {data[:200]!r}"}
    parent = []
    x = torch.utils.dlpack.from_dlpack(held.pop("cap"))
    if checksum(x) != legacy["checksum"]:
        parent.append("the legacy tensor through the capsule made before the fork differs")
    del x
    if checksum(torch.from_dlpack(held["a"])) != legacy["checksum"]:
        parent.append("the legacy tensor differs")
    if checksum(torch.from_dlpack(held["b"])) != vmm["checksum"]:
        parent.append("the VMM tensor differs")
    e = torch.from_dlpack(held["e"])
    e.fill_(3.0)
    if not bool((e == 3.0).all()):
        parent.append("empty() memory does not keep what is written")
    del e
    held.clear()
    gc.collect()
    report("forked", child=child, child_status=status, child_s=child_s,
           torch_cuda_before_fork=torch_cuda, parent=parent)


# ---- 25,000 publications ----

def _slice(bases, i, per):
    k, j = divmod(i, bases[0].numel() // per)
    return bases[k][j * per:(j + 1) * per]


def many_pub(prefix, count, per, allocs):
    """Publish `count` slices of `per` floats of `allocs` allocations, each under a name."""
    warm()
    mem0 = torch.cuda.memory_allocated()
    bases = [pattern(count // allocs * per, 1000 + k) for k in range(allocs)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    t_events = None
    for i in range(count):
        try:
            dlpack_ipc.publish(f"{prefix}/{i}", _slice(bases, i, per))
        except Exception as e:
            raise RuntimeError(f"publish #{i} failed: {type(e).__name__}: {e}") from e
        if i == 999:
            t_events = time.perf_counter()
    total_s = time.perf_counter() - t0
    del bases
    report("published", total_s=total_s, first_s=t_events - t0)
    command("unpublish")
    t0 = time.perf_counter()
    for i in range(count):
        dlpack_ipc.unpublish(f"{prefix}/{i}")
    unpublish_s = time.perf_counter() - t0
    report("unpublished", unpublish_s=unpublish_s, reclaim_s=memory_back(mem0, 120, t0))


def many_sub(prefix, count, per, allocs, sample):
    """Attach the names in `sample` and compare each with its slice of the pattern."""
    warm()
    expect = [pattern(count // allocs * per, 1000 + k) for k in range(allocs)]
    report("ready")
    command("go")
    bad, times = [], []
    for i in sample:
        t0 = time.perf_counter()
        t = dlpack_ipc.attach(f"{prefix}/{i}")
        y = torch.from_dlpack(t)
        times.append(time.perf_counter() - t0)
        if not torch.equal(y, _slice(expect, i, per)):
            bad.append(i)
        del y
        t.release()
    report("attached", mean_s=sum(times) / len(times), max_s=max(times), bad=bad)


# ---- a state dict ----

def _device_free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def sd_pub(name, bucket_name):
    """publish_dict of a small model's state_dict() on cuda:0 (float32, int64, bfloat16),
    which copies it into one VMM allocation of libdlpc's; and of an empty_dict bucket filled
    from it, which goes as it is. Free device memory around each publish says which copied."""
    warm()
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({
        "conv": torch.nn.Conv2d(3, 8, 3), "bn": torch.nn.BatchNorm2d(8),
        "fc": torch.nn.Linear(8 * 6 * 6, 10), "head": torch.nn.Linear(10, 4),
    }).to(DEV)
    model["head"].to(torch.bfloat16)
    with torch.no_grad():  # one training step of the batch norm's statistics
        h = model["bn"](model["conv"](torch.randn(4, 3, 8, 8, device=DEV))).relu()
        model["head"](model["fc"](h.flatten(1)).to(torch.bfloat16))
    del h
    sd = model.state_dict()
    meta = {k: {"dtype": str(v.dtype), "shape": list(v.shape), "checksum": checksum(v)}
            for k, v in sd.items()}
    nbytes = sum(v.numel() * v.element_size() for v in sd.values())
    bucket = dlpack_ipc.empty_dict({k: (tuple(v.shape), v.dtype) for k, v in sd.items()},
                                   device=DEV)
    for k, v in sd.items():
        torch.from_dlpack(bucket[k]).copy_(v)
    torch.cuda.synchronize()  # a bucket carries no event either: finish writing first (dlpc.h)
    gc.collect()
    before, free = torch.cuda.memory_allocated(), _device_free()
    t0 = time.perf_counter()
    dlpack_ipc.publish_dict(name, sd)
    publish_s = time.perf_counter() - t0
    copy_took = free - _device_free()
    del sd, model  # copied: the producers had their tensors back at once
    gc.collect()
    freed = before - torch.cuda.memory_allocated()
    free = _device_free()
    t0 = time.perf_counter()
    dlpack_ipc.publish_dict(bucket_name, bucket)
    bucket_s = time.perf_counter() - t0
    bucket_took = free - _device_free()
    report("published", meta=meta, nbytes=nbytes, publish_s=publish_s, freed=freed,
           copy_took=copy_took, bucket_s=bucket_s, bucket_took=bucket_took)
    command("exit")


def sd_sub(names):
    """attach_dict of each name, each tensor through torch.from_dlpack: what they hold."""
    warm()
    out = {}
    for name in names:
        t0 = time.perf_counter()
        d = dlpack_ipc.attach_dict(name)
        ts = {k: torch.from_dlpack(v) for k, v in d.items()}
        attach_s = time.perf_counter() - t0
        got = {k: {"dtype": str(y.dtype), "shape": list(y.shape), "device": str(y.device),
                   "checksum": checksum(y)} for k, y in ts.items()}
        ptrs = [(y.data_ptr(), y.numel() * y.element_size()) for y in ts.values()]
        span = max(p + n for p, n in ptrs) - min(p for p, _ in ptrs)
        del ts
        d.clear()
        out[name] = {"attach_s": attach_s, "got": got, "span": span}
    report("attached", results=out)


# ---- CuPy ----

def cupy_sub(items):
    """cupy.from_dlpack of entries published from torch (legacy IPC) and dlpack_ipc.empty
    (VMM), on CuPy's current stream and on a side stream; torch.from_dlpack of an entry that
    CuPy published."""
    cupy = _cupy()
    warm()
    out = {}
    for it in items:
        name = it["name"]
        if it["kind"] == "cupy":
            t = dlpack_ipc.attach(name)
            out[name] = {"checksum": checksum(torch.from_dlpack(t))}
            t.release()
            continue
        want = _cupy_pattern(cupy, it["n"], it["seed"])
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        a = cupy.from_dlpack(dlpack_ipc.attach(name))
        r = {"attach_s": time.perf_counter() - t0, "default": bool(cupy.array_equal(a, want))}
        with cupy.cuda.Stream(non_blocking=True):
            b = cupy.from_dlpack(dlpack_ipc.attach(name))
            r["side"] = bool(cupy.array_equal(b, want))
        del a, b
        out[name] = r
    report("attached", results=out)


ROLES = {f.__name__: f for f in (
    publisher, attacher, late_attacher, keeper, order_pub, order_sub, reclaim_pub, reclaim_sub,
    capture_sub, fork_user, many_pub, many_sub, sd_pub, sd_sub, cupy_sub)}


def main():
    global _reports
    _reports = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    role, args = sys.argv[1], json.loads(sys.argv[2])
    try:
        ROLES[role](**args)
    except SystemExit:
        raise
    except Skipped as e:
        report("skip", why=str(e))
    except BaseException as e:
        traceback.print_exc()
        report("error", why=f"{type(e).__name__}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
