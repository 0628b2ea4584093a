# SPDX-License-Identifier: Apache-2.0
"""The peer of bench_gpu's attach rows: torch.multiprocessing's CUDA sharing (its reductions).

    python bench/bench_gpu_torch.py --sizes 4096,65536 --reps N

A producer process (spawned) holds an int32 CUDA tensor of each size (0, 1, 2, ...) and sends
it over a torch.multiprocessing queue on each request; this process times the request, the
receipt (torch rebuilds the tensor from its CUDA IPC handle), a first kernel read (the sum, on
the GPU, checked against n(n-1)/2) and the release, as bench_gpu does for libdlpc.
Prints one JSON object per line; where torch with CUDA cannot be imported, one row
{"group": "gpu_attach", "impl": "torch_mp", "skipped": reason}.
"""
import argparse
import json
import sys
import time


def producer(req, resp):
    import torch
    held = {}
    while True:
        size = req.get()
        if size is None:
            return
        if size not in held:
            held.clear()
            held[size] = torch.arange(size // 4, dtype=torch.int32, device="cuda")
            torch.cuda.synchronize()
        resp.put(held[size])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True, help="comma-separated sizes in bytes")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} has no CUDA device "
                               f"(torch.version.cuda is {torch.version.cuda})")
    except Exception as e:
        print(json.dumps({"group": "gpu_attach", "impl": "torch_mp",
                          "skipped": f"no torch with CUDA: {type(e).__name__}: {e}"}))
        return 0
    ctx = mp.get_context("spawn")
    req, resp = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=producer, args=(req, resp))
    p.start()
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            n = size // 4
            want = n * (n - 1) // 2
            ns = []
            for r in range(args.reps + 2):
                t0 = time.perf_counter_ns()
                req.put(size)
                t = resp.get()
                got = int(t.sum(dtype=torch.int64).item())
                del t
                t1 = time.perf_counter_ns()
                if got != want:
                    sys.exit(f"bench_gpu_torch: {size} bytes: the sum read {got}, "
                             f"the producer wrote {want}")
                if r >= 2:
                    ns.append(t1 - t0)
            ns.sort()
            print(json.dumps({"group": "gpu_attach", "impl": "torch_mp", "size": size,
                              "median_us": ns[len(ns) // 2] / 1e3,
                              "p99_us": ns[-(-len(ns) * 99 // 100) - 1] / 1e3,
                              "reps": len(ns), "checked": True}), flush=True)
    finally:
        req.put(None)
        p.join(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
