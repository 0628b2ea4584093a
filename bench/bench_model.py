#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""A model's weights loaded by several worker processes: dlpack_ipc.torch against its peers.

    /usr/bin/python3 bench/bench_model.py --socket PATH [--quick] [--workers N] [--mib M]

The same model (Linear layers and a tied embedding, M MiB of float32 weights) reaches N worker
processes (torch.multiprocessing "spawn") in three ways:

  dlpack_ipc     the parent share_module()s it; each worker builds the model on device="meta"
                 and attach_module()s it
  torch_load     the parent torch.save()s the state dict to /dev/shm; each worker builds the
                 model on "meta", to_empty(device="cpu"), then load_state_dict(torch.load(f))
  torch_mp       the parent calls model.share_memory() and puts the model on each worker's
                 torch.multiprocessing Queue; the worker get()s it

Workers load one after another (the timing is one worker's, not a queue of them): load_ms is
from the start of loading to a model holding the weights; read_ms is the first full read of
every weight after it (a sum per tensor, as a first forward pass would fault the pages in).
Once every worker has loaded and read, each reports its unique memory (USS: the Private_Clean
and Private_Dirty of /proc/self/smaps_rollup), all N alive at once, so that pages the workers
share are counted as shared. uss_mib is the worker's USS then, uss_delta_mib its growth since
it had imported torch and built its (meta) model. Prints one JSON object per line:

    {"group": "model_load", "impl": I, "workers": N, "weights_mib": M, "load_ms": [...],
     "read_ms": [...], "uss_mib": [...], "uss_delta_mib": [...], "median_load_ms": F,
     "median_uss_delta_mib": F}

and removes what it made (the name, the /dev/shm file, the workers) on every path.
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

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


def worker(impl, shape, socket, source, go, report, out):
    """One worker: build the model's skeleton, load when told, read, report USS when told."""
    try:
        os.environ["DLPACKD_SOCKET"] = socket
        model = Model(*shape, device="meta")
        gc.collect()
        base = uss_kib()
        out.put(("ready", None))
        go.wait()
        t0 = time.perf_counter()
        if impl == "dlpack_ipc":
            dt.attach_module(model, NAME, timeout=60)
        elif impl == "torch_load":
            model = model.to_empty(device="cpu")
            model.load_state_dict(torch.load(source))
        else:
            model = source.get(timeout=TIMEOUT_S)
        t1 = time.perf_counter()
        with torch.no_grad():
            total = sum(float(v.sum()) for v in model.state_dict().values())
        t2 = time.perf_counter()
        gc.collect()
        out.put(("loaded", ((t1 - t0) * 1e3, (t2 - t1) * 1e3, total)))
        report.wait()
        out.put(("uss", (uss_kib() / 1024, (uss_kib() - base) / 1024)))
        report.wait()  # stay alive (mapped) until everyone has reported
    except BaseException as e:  # the parent reports it
        out.put(("error", repr(e)))


def run(impl, model, shape, nworkers, socket, shm_path):
    ctx = tmp.get_context("spawn")
    go = [ctx.Event() for _ in range(nworkers)]
    report, out = ctx.Event(), [ctx.Queue() for _ in range(nworkers)]
    feeds = [ctx.Queue() for _ in range(nworkers)] if impl == "torch_mp" else None
    procs = []
    try:
        for i in range(nworkers):
            source = feeds[i] if feeds else shm_path
            p = ctx.Process(target=worker, args=(impl, shape, socket, source, go[i], report,
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
        loads, reads, totals = [], [], set()
        for i in range(nworkers):
            if feeds:
                feeds[i].put(model)
            go[i].set()
            load_ms, read_ms, total = expect(i, "loaded")
            loads.append(round(load_ms, 2))
            reads.append(round(read_ms, 2))
            totals.add(round(total, 1))
        if len(totals) != 1:
            raise RuntimeError(f"{impl}: the workers read different weights: {totals}")
        report.set()
        uss = [expect(i, "uss") for i in range(nworkers)]
        return {"group": "model_load", "impl": impl, "workers": nworkers,
                "load_ms": loads, "read_ms": reads,
                "uss_mib": [round(u, 1) for u, _ in uss],
                "uss_delta_mib": [round(d, 1) for _, d in uss],
                "median_load_ms": statistics.median(loads),
                "median_read_ms": statistics.median(reads),
                "median_uss_delta_mib": statistics.median(d for _, d in uss),
                "checksum": totals.pop()}
    finally:
        report.set()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--quick", action="store_true", help="a small model and two workers")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--mib", type=int, help="weights in MiB (default 384; --quick 8)")
    args = ap.parse_args()
    nworkers = args.workers or (2 if args.quick else 4)
    shape = shape_for(args.mib or (8 if args.quick else 384))
    os.environ["DLPACKD_SOCKET"] = args.socket
    torch.manual_seed(0)
    model = Model(*shape).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    log(f"{shape[1]} layers of {shape[0]}x{shape[0]}, {nbytes / (1 << 20):.0f} MiB, "
        f"{nworkers} workers")
    shm_path = f"/dev/shm/dlpc-bench-model-{os.getpid()}.pt"
    rows = []
    try:
        dt.share_module(model, NAME, replace=True)
        torch.save(model.state_dict(), shm_path)
        model.share_memory()
        for impl in ("dlpack_ipc", "torch_load", "torch_mp"):
            row = run(impl, model, shape, nworkers, args.socket, shm_path)
            row["weights_mib"] = round(nbytes / (1 << 20), 1)
            rows.append(row)
            log(f"{impl:<11} load {row['median_load_ms']:8.1f} ms  read "
                f"{row['median_read_ms']:8.1f} ms  USS +{row['median_uss_delta_mib']:7.1f} MiB")
    finally:
        try:
            dlpack_ipc.unpublish(NAME)
        except FileNotFoundError:
            pass
        if os.path.exists(shm_path):
            os.unlink(shm_path)
    if len({r["checksum"] for r in rows}) != 1:
        raise SystemExit(f"bench_model: the methods loaded different weights: {rows}")
    for r in rows:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
