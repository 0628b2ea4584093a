#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""A model's weights loaded by several worker processes: dlpack_ipc.torch against its peers.

    PY bench/bench_model.py --socket PATH [--quick] [--workers N] [--mib M] [--threads T]

The same model (Linear layers and a tied embedding, M MiB of float32 weights) reaches N worker
processes in each of these ways:

  dlpack_ipc       the parent share_module()s it; each worker builds the model on device="meta"
                   and attach_module()s it (which populates the mapping: populate=True)
  dlpack_ipc_lazy  the same with attach_module(populate=False): the first forward pass faults
                   the weights in as it reads them
  torch_load       the parent torch.save()s the state dict to /dev/shm; each worker builds the
                   model on "meta", to_empty(device="cpu"), then load_state_dict(torch.load(f)):
                   a private copy, whose warm forward pass is the reference
  torch_load_mmap  the same file, torch.load(f, mmap=True) and load_state_dict(assign=True)
  safetensors      the parent save_file()s the state dict to /dev/shm; each worker load_file()s
                   it (mapped, not read) and load_state_dict(assign=True)
  torch_mp         the parent calls model.share_memory() and puts the model on each worker's
                   torch.multiprocessing Queue; the worker get()s it
  ray              the parent ray.put()s the state dict as numpy arrays (a local Ray with a
                   small object store); each worker, a Ray actor, ray.get()s it, takes the
                   arrays with torch.from_numpy (no copy) and load_state_dict(assign=True)

Every worker but Ray's is a torch.multiprocessing "spawn" process. A peer that cannot run here
(not installed, or a torch without mmap=/assign=) is skipped with the reason printed, and a row
{"impl": I, "skipped": REASON}. Workers load one after another (the timing is one worker's, not
a queue of them), each with the parent's torch thread count (--threads) and torch set up
beforehand by a forward pass of a one-layer model of its own (warm_up()): ready_ms is from the
start of loading to a model holding the weights, first_forward_ms its first forward pass (a few
tokens: it reads every weight once), faults the minor page faults of that pass (the kernel
counts a populate's own page-ins as faults too, inside ready_ms), warm_forward_ms the median of
the passes after it; ready_cpu_ms, first_forward_cpu_ms and warm_forward_cpu_ms are the CPU
time (all the worker's threads) of the same, steadier than wall time where other work shares
the machine. Once
every worker is done, each reports its unique memory (USS: the Private_Clean and Private_Dirty
of /proc/self/smaps_rollup), all N alive at once, so that pages the workers share are counted
as shared. uss_mib is the worker's USS then, uss_delta_mib its growth since it had imported
torch and built its (meta) model. Prints one JSON object per line:

    {"group": "model_load", "impl": I, "workers": N, "weights_mib": M, "ready_ms": [...],
     "first_forward_ms": [...], "ready_first_ms": [...], "warm_forward_ms": [...],
     "faults": [...], "ready_cpu_ms": [...], "first_forward_cpu_ms": [...],
     "warm_forward_cpu_ms": [...],
     "uss_mib": [...], "uss_delta_mib": [...], "median_ready_ms": F, ... (a median_ of each
     list), "median_uss_delta_mib": F}

and removes what it made (the name, the /dev/shm files, the workers, Ray) on every path.
"""
import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
import warnings

import torch
import torch.multiprocessing as tmp

try:
    import dlpack_ipc
except ImportError:  # run from a source tree without PYTHONPATH: use the default build directory
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "build", "python"))
    import dlpack_ipc
import dlpack_ipc.torch as dt

NAME = "bench/model"
TIMEOUT_S = 300
# tokens of a forward pass: few, so that it reads every weight once and computes little
FORWARD_TOKENS = 4
# forward passes after the first, whose median is the warm forward pass
WARM_PASSES = 5
IMPLS = ("dlpack_ipc", "dlpack_ipc_lazy", "torch_load", "torch_load_mmap", "safetensors",
         "torch_mp", "ray")


def log(msg):
    print(f"bench_model: {msg}", file=sys.stderr, flush=True)


class Model(torch.nn.Module):
    def __init__(self, width, layers, vocab, device=None):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width, device=device)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, device=device)
                                          for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab, bias=False, device=device)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def shape_for(mib):
    """(width, layers, vocab) for about mib MiB of weights: 1024-wide layers of 4 MiB each and
    a tied embedding of 32 MiB (256-wide, 256 KiB and 2 MiB below 64 MiB)."""
    width = 1024 if mib >= 64 else 256
    vocab = 8 * width
    per_layer = (width * width + width) * 4
    layers = max(1, int((mib * (1 << 20) - vocab * width * 4) // per_layer))
    return width, layers, vocab


def uss_kib():
    with open("/proc/self/smaps_rollup") as f:
        fields = dict((l.split()[0].rstrip(":"), l.split()[1]) for l in f if l.count(" ") > 1)
    return int(fields["Private_Clean"]) + int(fields["Private_Dirty"])


def minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def untied(sd):
    """sd without the keys whose tensor another key already holds (safetensors refuses tied
    tensors), and {dropped key: the key kept}."""
    kept, seen, ties = {}, {}, {}
    for k, v in sd.items():
        if v.data_ptr() in seen:
            ties[k] = seen[v.data_ptr()]
        else:
            seen[v.data_ptr()] = k
            kept[k] = v.contiguous()
    return kept, ties


def load(impl, model, source):
    """Give the meta model the weights by way of impl; the model that holds them."""
    if impl in ("dlpack_ipc", "dlpack_ipc_lazy"):
        dt.attach_module(model, NAME, timeout=60, populate=impl == "dlpack_ipc")
    elif impl == "torch_load":
        model = model.to_empty(device="cpu")
        model.load_state_dict(torch.load(source))
    elif impl == "torch_load_mmap":
        model.load_state_dict(torch.load(source, mmap=True, weights_only=True), assign=True)
    elif impl == "safetensors":
        import safetensors.torch

        path, ties = source
        sd = safetensors.torch.load_file(path)
        sd.update((k, sd[v]) for k, v in ties.items())
        model.load_state_dict(sd, assign=True)
    elif impl == "ray":
        import ray

        with warnings.catch_warnings():  # the object store's arrays are read-only
            warnings.simplefilter("ignore")
            sd = {k: torch.from_numpy(v) for k, v in ray.get(source[0]).items()}
        model.load_state_dict(sd, assign=True)
    else:
        model = source.get(timeout=TIMEOUT_S)
    return model


def measure(impl, model, source, ids):
    """Load by way of impl and run the forward passes: (timings, the model)."""
    c0, t0 = time.process_time(), time.perf_counter()
    model = load(impl, model, source)
    before = minflt()
    c1, t1 = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        model(ids)
        c2, t2 = time.process_time(), time.perf_counter()
        faults = minflt() - before
        warm, warm_cpu = [], []
        for _ in range(WARM_PASSES):
            c, t = time.process_time(), time.perf_counter()
            model(ids)
            warm.append((time.perf_counter() - t) * 1e3)
            warm_cpu.append((time.process_time() - c) * 1e3)
        total = sum(float(v.double().sum()) for v in model.state_dict().values())
    return {"ready_ms": (t1 - t0) * 1e3, "first_forward_ms": (t2 - t1) * 1e3,
            "warm_forward_ms": statistics.median(warm), "faults": faults,
            "ready_cpu_ms": (c1 - c0) * 1e3, "first_forward_cpu_ms": (c2 - c1) * 1e3,
            "warm_forward_cpu_ms": statistics.median(warm_cpu),
            "total": total}, model


def warm_up(shape, ids):
    """Set torch up in this worker as a long-lived one is: run the forward pass of a model of the
    same layer shapes with weights of its own (one layer), twice, and free it. Its intra-op
    threads, allocator and kernels are then ready before any timing, in every way alike (the
    private copy's load_state_dict() would otherwise set them up inside its ready time, and the
    others' inside their first forward pass)."""
    width, _, vocab = shape
    with torch.inference_mode():
        model = Model(width, 1, vocab)
        for _ in range(2):
            model(ids)
    del model
    gc.collect()


def worker(impl, shape, threads, socket, source, go, report, out):
    """One worker: build the model's skeleton, load when told and run forward passes, report USS
    when told."""
    try:
        os.environ["DLPACKD_SOCKET"] = socket
        torch.set_num_threads(threads)
        model = Model(*shape, device="meta")
        ids = torch.arange(FORWARD_TOKENS).unsqueeze(0)
        warm_up(shape, ids)
        gc.collect()
        base = uss_kib()
        out.put(("ready", None))
        go.wait()
        timings, model = measure(impl, model, source, ids)
        gc.collect()
        out.put(("loaded", timings))
        report.wait()
        out.put(("uss", (uss_kib() / 1024, (uss_kib() - base) / 1024)))
        report.wait()  # stay alive (mapped) until everyone has reported
    except BaseException as e:  # the parent reports it
        out.put(("error", repr(e)))


def row(impl, nworkers, timings, uss):
    """The JSON row of impl from its workers' timings and USS, checked to have read the same."""
    totals = {round(t["total"], 1) for t in timings}
    if len(totals) != 1:
        raise RuntimeError(f"{impl}: the workers read different weights: {totals}")
    r = {"group": "model_load", "impl": impl, "workers": nworkers}
    for t in timings:
        t["ready_first_ms"] = t["ready_ms"] + t["first_forward_ms"]
    for key in ("ready_ms", "first_forward_ms", "ready_first_ms", "warm_forward_ms", "faults",
                "ready_cpu_ms", "first_forward_cpu_ms", "warm_forward_cpu_ms"):
        r[key] = [round(t[key], 2) for t in timings]
        r["median_" + key] = statistics.median(r[key])
    r["uss_mib"] = [round(u, 1) for u, _ in uss]
    r["uss_delta_mib"] = [round(d, 1) for _, d in uss]
    r["median_uss_delta_mib"] = statistics.median(d for _, d in uss)
    r["checksum"] = totals.pop()
    return r


def run(impl, model, shape, nworkers, socket, source):
    ctx = tmp.get_context("spawn")
    go = [ctx.Event() for _ in range(nworkers)]
    report, out = ctx.Event(), [ctx.Queue() for _ in range(nworkers)]
    feeds = [ctx.Queue() for _ in range(nworkers)] if impl == "torch_mp" else None
    procs = []
    try:
        for i in range(nworkers):
            p = ctx.Process(target=worker, args=(impl, shape, torch.get_num_threads(), socket,
                                                 feeds[i] if feeds else source, go[i], report,
                                                 out[i]))
            p.start()
            procs.append(p)

        def expect(i, what):
            kind, value = out[i].get(timeout=TIMEOUT_S)
            if kind != what:
                raise RuntimeError(f"{impl} worker {i}: {kind} {value}")
            return value

        for i in range(nworkers):
            expect(i, "ready")
        timings = []
        for i in range(nworkers):
            if feeds:
                feeds[i].put(model)
            go[i].set()
            timings.append(expect(i, "loaded"))
        report.set()
        return row(impl, nworkers, timings, [expect(i, "uss") for i in range(nworkers)])
    finally:
        report.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


class RayWorker:
    """worker() as a Ray actor (made a remote class by run_ray())."""

    def __init__(self, shape, threads):
        torch.set_num_threads(threads)
        self.model = Model(*shape, device="meta")
        self.ids = torch.arange(FORWARD_TOKENS).unsqueeze(0)
        warm_up(shape, self.ids)
        gc.collect()
        self.base = uss_kib()

    def load(self, refs):
        # the reference inside a list: Ray would resolve a bare one before the call, untimed
        timings, self.model = measure("ray", self.model, refs, self.ids)
        gc.collect()
        return timings

    def uss(self):
        return uss_kib() / 1024, (uss_kib() - self.base) / 1024


def run_ray(model, shape, nworkers, nbytes):
    """The ray row: a local Ray of its own, with an object store of the weights and some room."""
    import shutil
    import ray
    from ray_local import ray_init, ray_temp_dir

    tmpdir = ray_temp_dir()
    try:
        ray_init(ray, tmpdir, num_cpus=1, object_store_memory=max(nbytes + (64 << 20), 96 << 20))
        ref = ray.put({k: v.detach().numpy() for k, v in model.state_dict().items()})
        actor = ray.remote(num_cpus=0)(RayWorker)
        workers = [actor.remote(shape, torch.get_num_threads()) for _ in range(nworkers)]
        timings = [ray.get(w.load.remote([ref]), timeout=TIMEOUT_S) for w in workers]
        uss = ray.get([w.uss.remote() for w in workers], timeout=TIMEOUT_S)
        return row("ray", nworkers, timings, uss)
    finally:
        ray.shutdown()
        shutil.rmtree(tmpdir, ignore_errors=True)


def unavailable(impl):
    """Why impl cannot run with this interpreter, or None."""
    import inspect

    mods = {"safetensors": "safetensors.torch", "ray": "ray"}
    if impl in mods:
        try:
            __import__(mods[impl])
        except ImportError as e:
            return f"cannot import {mods[impl]}: {e}"
    if impl in ("torch_load_mmap", "safetensors", "ray") and \
            "assign" not in inspect.signature(torch.nn.Module.load_state_dict).parameters:
        return f"torch {torch.__version__} has no load_state_dict(assign=True)"
    if impl == "torch_load_mmap" and "mmap" not in inspect.signature(torch.load).parameters:
        return f"torch {torch.__version__} has no torch.load(mmap=True)"
    if impl == "dlpack_ipc_lazy" and \
            "populate" not in inspect.signature(dt.attach_module).parameters:
        return "this dlpack_ipc has no attach_module(populate=)"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--quick", action="store_true", help="a small model and two workers")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--mib", type=int, help="weights in MiB (default 400; --quick 8)")
    ap.add_argument("--only", nargs="+", choices=IMPLS, help="these ways only")
    ap.add_argument("--threads", type=int,
                    help="torch threads of every worker (default: torch's own count); 1 keeps "
                         "the forward passes steady on a machine that other work shares")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    nworkers = args.workers or (2 if args.quick else 4)
    shape = shape_for(args.mib or (8 if args.quick else 400))
    os.environ["DLPACKD_SOCKET"] = args.socket
    torch.manual_seed(0)
    model = Model(*shape).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    log(f"{shape[1]} layers of {shape[0]}x{shape[0]}, {nbytes / (1 << 20):.0f} MiB, "
        f"{len(model.state_dict())} tensors, {nworkers} workers, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")
    shm_path = f"/dev/shm/dlpc-bench-model-{os.getpid()}.pt"
    st_path = f"/dev/shm/dlpc-bench-model-{os.getpid()}.safetensors"
    rows = []
    try:
        dt.share_module(model, NAME, replace=True)
        torch.save(model.state_dict(), shm_path)
        model.share_memory()
        for impl in args.only or IMPLS:
            why = unavailable(impl)
            if why:
                log(f"{impl:<15} skipped: {why}")
                rows.append({"group": "model_load", "impl": impl, "workers": nworkers,
                             "skipped": why})
                continue
            if impl == "ray":
                row_ = run_ray(model, shape, nworkers, nbytes)
            else:
                source = shm_path
                if impl == "safetensors":
                    import safetensors.torch

                    kept, ties = untied(model.state_dict())
                    safetensors.torch.save_file(kept, st_path)
                    source = (st_path, ties)
                row_ = run(impl, model, shape, nworkers, args.socket, source)
            row_["weights_mib"] = round(nbytes / (1 << 20), 1)
            rows.append(row_)
            log(f"{impl:<15} ready {row_['median_ready_ms']:7.1f} ms (CPU "
                f"{row_['median_ready_cpu_ms']:6.1f})  first forward "
                f"{row_['median_first_forward_ms']:6.1f} ms (CPU "
                f"{row_['median_first_forward_cpu_ms']:6.1f}, {row_['median_faults']:.0f} "
                f"faults)  warm forward {row_['median_warm_forward_ms']:6.1f} ms (CPU "
                f"{row_['median_warm_forward_cpu_ms']:6.1f})  USS "
                f"+{row_['median_uss_delta_mib']:6.1f} MiB")
    finally:
        try:
            dlpack_ipc.unpublish(NAME)
        except FileNotFoundError:
            pass
        for path in (shm_path, st_path):
            if os.path.exists(path):
                os.unlink(path)
    if len({r["checksum"] for r in rows if "checksum" in r}) > 1:
        raise SystemExit(f"bench_model: the methods loaded different weights: {rows}")
    for r in rows:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
