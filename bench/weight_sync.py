#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Weight sync: a trainer's new weights to four inference workers, dlpack_ipc.torch.follow()
against torch.distributed.broadcast over gloo.

    python3 bench/weight_sync.py --socket PATH [--quick] [--workers N] [--mib M] [--rounds R]

One model (bench_model.Model: Linear layers and a tied embedding, M MiB of float32 weights,
400 by default) is trained by one process and run by N workers (4), in three ways:

  follow          the trainer share_module(..., replace=True)s each new generation (a copy into
                  sealed shared memory); each worker, built on device="meta", follows it with
                  dt.follow() and waits in update(timeout=None)
  follow_bucket   the same, the trainer training in dlpackd memory (dt.to_shared(), once at
                  the start and again after each publish, which seals the bucket it
                  publishes with no copy)
  gloo_broadcast  N + 1 processes in one gloo process group (torch.distributed, CPU); the
                  trainer (rank 0) torch.distributed.broadcast()s every parameter to the
                  workers, which hold a model of their own

Each round the trainer changes every weight (off the clock) and the workers wait, idle; the
clock starts when the trainer starts publishing (or broadcasting) and stops when the last
worker has finished a forward pass on the new weights (time.monotonic(), one clock for every
process of the machine). Every worker's output is checked against the trainer's own forward
pass of that generation. Prints one JSON object per line:

    {"group": "weight_sync", "impl": I, "workers": N, "weights_mib": M, "rounds": R,
     "ms": [...], "median_ms": F, "publish_ms": [...], "median_publish_ms": F}

ms: from the start of the publish to the last worker's forward pass done; publish_ms: the
trainer's share_module() (or its broadcasts) alone; follow_bucket rows add copy_ms and
median_copy_ms: the trainer's to_shared() after each publish (off the clock: the workers do not
wait for it, but the trainer does before its next step).
"""
import argparse
import json
import math
import os
import socket as socketlib
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import Model, shape_for  # noqa: E402  (the same model as the load benchmark)

NAME = "bench/weight_sync"
TIMEOUT_S = 300
IDS = [[1, 2, 3, 5, 8, 13, 21, 34]]


def log(msg):
    print(f"weight_sync: {msg}", file=sys.stderr, flush=True)


def forward(model):
    with torch.no_grad():
        return float(model(torch.tensor(IDS)).double().sum())


def step(model, generation):
    """The trainer's "training": every weight changes, deterministically (and the outputs
    stay finite, so that the workers' can be compared with the trainer's)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.99)


# ---- dlpack_ipc.torch.follow() -------------------------------------------------------------

def follow_worker(shape, socket, rounds, ready, out):
    try:
        os.environ["DLPACKD_SOCKET"] = socket
        torch.set_num_threads(1)
        model = Model(*shape, device="meta").eval()
        f = dt.follow(model, NAME, timeout=TIMEOUT_S)
        for _ in range(rounds):
            ready.put(f.generation)
            if not f.update(timeout=TIMEOUT_S):
                raise RuntimeError(f"no new generation within {TIMEOUT_S} s")
            value = forward(model)
            out.put((time.monotonic(), f.generation, value))
        f.close()
    except BaseException as e:  # the parent reports it
        out.put(("error", repr(e), None))


def run_follow(impl, model, shape, nworkers, socket, rounds):
    ctx = tmp.get_context("spawn")
    ready, out = ctx.Queue(), [ctx.Queue() for _ in range(nworkers)]
    dt.share_module(model, NAME, replace=True)  # generation 1: what the workers start from
    if impl == "follow_bucket":
        dt.to_shared(model)  # the trainer trains in dlpackd memory from now on
    procs = [ctx.Process(target=follow_worker, args=(shape, socket, rounds, ready, out[i]))
             for i in range(nworkers)]
    for p in procs:
        p.start()
    ms, publish_ms, copy_ms = [], [], []
    try:
        for r in range(rounds):
            for _ in range(nworkers):
                ready.get(timeout=TIMEOUT_S)  # every worker waiting in update()
            step(model, r + 2)
            want = forward(model)
            if not math.isfinite(want):
                raise RuntimeError(f"{impl}: the model's output is {want}")
            t0 = time.monotonic()
            generation = dt.share_module(model, NAME, replace=True)  # bucket: no copy
            t1 = time.monotonic()
            done = []
            for q in out:
                t, gen, value = q.get(timeout=TIMEOUT_S)
                if t == "error":
                    raise RuntimeError(f"{impl} worker: {gen}")
                if gen != generation or value != want:
                    raise RuntimeError(f"{impl}: a worker ran generation {gen} ({value}), "
                                       f"not {generation} ({want})")
                done.append(t)
            ms.append(round((max(done) - t0) * 1e3, 2))
            publish_ms.append(round((t1 - t0) * 1e3, 2))
            if impl == "follow_bucket":
                # the published bucket is read-only: the trainer copies its weights into a new
                # one before its next step (its own cost, which the workers do not wait for)
                t2 = time.monotonic()
                dt.to_shared(model)
                copy_ms.append(round((time.monotonic() - t2) * 1e3, 2))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return ms, publish_ms, copy_ms


# ---- torch.distributed.broadcast over gloo -------------------------------------------------

def gloo_rank(rank, world, port, shape, rounds, out):
    import torch.distributed as dist
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        torch.manual_seed(0)
        model = Model(*shape).eval()  # every rank holds the weights (rank 0's are the truth)
        params = [p.data for p in model.parameters()]
        for p in params:
            dist.broadcast(p, 0)
        for r in range(rounds):
            want = None
            if rank == 0:
                step(model, r + 2)
                want = forward(model)
            dist.barrier()  # every worker idle, the trainer done with its step
            t0 = time.monotonic()
            for p in params:
                dist.broadcast(p, 0)
            t1 = time.monotonic()
            value = want if rank == 0 else forward(model)
            out.put((rank, r, t0, t1, time.monotonic(), value))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # the parent reports it
        out.put((rank, "error", repr(e), None, None, None))


def free_port():
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Tries of the gloo group: its port, free when picked, may be taken before rank 0 binds it.
GLOO_TRIES = 3


def gloo_once(ctx, shape, world, rounds):
    """Run the ranks once; {(rank, round): (t0, t1, t2, value)}. RuntimeError naming a rank's
    error (the others then killed)."""
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=gloo_rank, args=(rank, world, port, shape, rounds, out))
             for rank in range(world)]
    for p in procs:
        p.start()
    failed = True
    try:
        got = {}
        for _ in range(world * rounds):
            rank, r, t0, t1, t2, value = out.get(timeout=TIMEOUT_S)
            if r == "error":
                raise RuntimeError(f"gloo rank {rank}: {t0}")
            got[rank, r] = (t0, t1, t2, value)
        failed = False
    finally:
        for p in procs:
            # a rank left waiting for a group that will not form is no use
            p.join(timeout=1 if failed else 60)
            if p.is_alive():
                p.kill()
                p.join()
    return got


def run_gloo(shape, nworkers, rounds):
    ctx = tmp.get_context("spawn")
    world = nworkers + 1
    for attempt in range(GLOO_TRIES):
        try:
            got = gloo_once(ctx, shape, world, rounds)
            break
        except RuntimeError as e:
            if "EADDRINUSE" not in str(e) or attempt == GLOO_TRIES - 1:
                raise
            print(f"weight_sync: gloo's port was taken meanwhile ({e}); trying another",
                  file=sys.stderr)
    ms, publish_ms = [], []
    for r in range(rounds):
        t0, t1, _, want = got[0, r]
        values = {got[k, r][3] for k in range(1, world)}
        if values != {want}:
            raise RuntimeError(f"gloo: the workers ran {values}, the trainer {want}")
        ms.append(round((max(got[k, r][2] for k in range(1, world)) - t0) * 1e3, 2))
        publish_ms.append(round((t1 - t0) * 1e3, 2))
    return ms, publish_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--quick", action="store_true", help="a small model, two workers, 2 rounds")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--mib", type=int, help="weights in MiB (default 400; --quick 8)")
    ap.add_argument("--rounds", type=int, help="generations timed (default 7; --quick 2)")
    ap.add_argument("--only", choices=["follow", "follow_bucket", "gloo_broadcast"],
                    action="append", help="run these only (default: all three)")
    args = ap.parse_args()
    nworkers = args.workers or (2 if args.quick else 4)
    rounds = args.rounds or (2 if args.quick else 7)
    shape = shape_for(args.mib or (8 if args.quick else 400))
    os.environ["DLPACKD_SOCKET"] = args.socket
    torch.set_num_threads(1)  # as the workers: one thread each, the same sums bit for bit
    torch.manual_seed(0)
    model = Model(*shape).eval()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    log(f"{shape[1]} layers of {shape[0]}x{shape[0]}, {nbytes / (1 << 20):.0f} MiB, "
        f"{nworkers} workers, {rounds} rounds")
    rows = []
    try:
        for impl in args.only or ("follow", "follow_bucket", "gloo_broadcast"):
            torch.manual_seed(0)
            model = Model(*shape).eval()
            if impl == "gloo_broadcast":
                ms, publish_ms = run_gloo(shape, nworkers, rounds)
                copy_ms = []
            else:
                ms, publish_ms, copy_ms = run_follow(impl, model, shape, nworkers, args.socket,
                                                     rounds)
            row = {"group": "weight_sync", "impl": impl, "workers": nworkers,
                   "weights_mib": round(nbytes / (1 << 20), 1), "rounds": rounds,
                   "ms": ms, "median_ms": statistics.median(ms), "publish_ms": publish_ms,
                   "median_publish_ms": statistics.median(publish_ms)}
            if copy_ms:
                row.update(copy_ms=copy_ms, median_copy_ms=statistics.median(copy_ms))
            rows.append(row)
            log(f"{impl:<14} publish to {nworkers} forward passes {row['median_ms']:8.1f} ms "
                f"(publish alone {row['median_publish_ms']:7.1f} ms)")
    finally:
        try:
            dlpack_ipc.unpublish(NAME)
        except FileNotFoundError:
            pass
    for r in rows:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
