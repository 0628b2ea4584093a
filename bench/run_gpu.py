#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Run the GPU benchmark against a private dlpackd and check its goals (docs/gpu.md, "Figures").

    /usr/bin/python3 bench/run_gpu.py [--quick] [--build DIR] [--out DIR] [--python PYTHON]
    /usr/bin/python3 bench/run_gpu.py --table build/gpu-figures/bench_gpu.json
    /usr/bin/python3 bench/run_gpu.py --plot build/gpu-figures/bench_gpu.json [--out DIR]

Starts dlpackd on a socket in a temporary directory, runs bench_gpu (attach + first kernel read
+ release, legacy IPC and VMM, beside the driver's own import; the state dict) and
bench_gpu_torch.py (torch.multiprocessing's CUDA sharing, with --python, else the first of this
interpreter and python3 on PATH whose torch has CUDA; a skipped row saying why without one),
prints one line per row as it comes (and appends it to bench_gpu.rows.jsonl in --out, so that
a run cut short keeps the rows it finished) and per target, and writes bench_gpu.json into
--out (default build/gpu-figures), and beside it bench_gpu.md, the tables of docs/gpu.md ("Figures"). The
driver is $DLPC_CUDA_LIBRARY, else libcuda.so.1: without one (or without a device) it says why
and exits 77. Exits 1 when a row is missing or a kernel read did not find what the publisher
wrote. Targets are computed, never asserted: "met" says. --table prints the tables of
docs/gpu.md ("Figures") from such a file. Where matplotlib can be imported (Debian's
python3-matplotlib), bench_gpu.png goes beside bench_gpu.json: attach time against size
(log-log, the median with a whisker up to p99) per implementation, and the state dict's rows as
bars, titled with the device and the driver; without matplotlib one line says no plot was made
and why, and the run goes on as before. --plot draws it from such a file into --out (default:
beside it).

Sizes, chosen to finish inside scripts/dev gpu-test's 150 s on one GPU (29 s on an H200;
the host's own sum of what each tensor holds, a loop over its words, is most of it): attach
4 KiB to 1 GiB, 20 reps each; the state dict 500 tensors of 4 GiB in all, 5 reps. --quick
(CI's run against the fake driver): 4 KiB and 64 KiB, 3 reps; 8 tensors of 1 MiB, 2 reps.
"""
import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run  # noqa: E402  (start_daemon, stop_daemon, run_rows, machine)

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
QUICK_SIZES = [4 << 10, 64 << 10]
ATTACH_GOAL = 1.5  # attach + read + release within 1.5x of the driver's own import
DICT_GOAL = 2.0    # the bucketed state dict within 2x of one attach of the same bytes
KINDS = ("legacy", "vmm")
DICT_IMPLS = ("bundle", "per_tensor", "single", "d2d_copy")
ATTACH_IMPLS = ("floor_legacy", "dlpc_legacy", "floor_vmm", "dlpc_vmm", "torch_mp")
PLOT = "bench_gpu.png"  # beside bench_gpu.json, where matplotlib can be imported


def device_info():
    """The driver and device 0, through the driver API, as far as the library answers."""
    lib = os.environ.get("DLPC_CUDA_LIBRARY") or "libcuda.so.1"
    info = {"library": lib}
    try:
        cu = ctypes.CDLL(lib)
    except OSError as e:
        return info, f"no CUDA driver ({lib} cannot be loaded: {e})"
    r = cu.cuInit(0)
    if r == 100:
        return info, "no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)"
    if r != 0:
        return info, f"the CUDA driver does not start (cuInit: {r})"
    if hasattr(cu, "cuDriverGetVersion"):
        v = ctypes.c_int(0)
        cu.cuDriverGetVersion(ctypes.byref(v))
        info["driver_cuda"] = f"{v.value // 1000}.{v.value % 1000 // 10}"
    if hasattr(cu, "cuDeviceGetName"):
        dev, name = ctypes.c_int(0), ctypes.create_string_buffer(256)
        if cu.cuDeviceGet(ctypes.byref(dev), 0) == 0 and cu.cuDeviceGetName(name, 256, dev) == 0:
            info["device"] = name.value.decode(errors="replace")
    return info, None


def torch_python(given):
    """--python, else the first of this interpreter and python3 whose torch has CUDA."""
    if given:
        return given
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    for c in (sys.executable, "python3"):
        try:
            if subprocess.run([c, "-c", probe], capture_output=True, timeout=120).returncode == 0:
                return c
        except (OSError, subprocess.TimeoutExpired):
            pass
    return sys.executable


def pick(rows, group, impl, size=None):
    for r in rows:
        if r.get("group") == group and r.get("impl") == impl and (size is None or r.get("size") == size):
            return r
    return None


def targets(rows, sizes):
    """The goals, each a ratio of two rows of this run: attach against the floor at every size
    and kind, the bucketed dict against one attach; beside them, ratios with no goal."""
    out = []
    for kind in KINDS:
        for s in sizes:
            a, f = pick(rows, "gpu_attach", "dlpc_" + kind, s), pick(rows, "gpu_attach", "floor_" + kind, s)
            ratio = a["median_us"] / f["median_us"]
            out.append({"name": f"attach_{kind}_vs_floor", "size": s, "ratio": round(ratio, 3),
                        "goal": ATTACH_GOAL, "met": ratio <= ATTACH_GOAL})
    b, one = pick(rows, "gpu_dict", "bundle"), pick(rows, "gpu_dict", "single")
    ratio = b["median_us"] / one["median_us"]
    out.append({"name": "dict_bundle_vs_one_attach", "size": b["size"], "ratio": round(ratio, 3),
                "goal": DICT_GOAL, "met": ratio <= DICT_GOAL})
    for other in ("per_tensor", "d2d_copy"):
        o = pick(rows, "gpu_dict", other)
        out.append({"name": f"dict_bundle_vs_{other}", "size": b["size"],
                    "ratio": round(b["median_us"] / o["median_us"], 3), "goal": None, "met": None})
    for s in sizes:
        t, a = pick(rows, "gpu_attach", "torch_mp", s), pick(rows, "gpu_attach", "dlpc_legacy", s)
        if t is not None:
            out.append({"name": "attach_legacy_vs_torch_mp", "size": s,
                        "ratio": round(a["median_us"] / t["median_us"], 3), "goal": None, "met": None})
    return out


def missing(rows, sizes):
    """What a complete run has and this one lacks (every row here was checked by its harness)."""
    want = [("gpu_attach", i + "_" + k, s) for s in sizes for k in KINDS for i in ("floor", "dlpc")]
    want += [("gpu_dict", i, None) for i in DICT_IMPLS]
    gone = [f"{g} {i} {s or ''}".strip() for g, i, s in want if pick(rows, g, i, s) is None]
    if not any(r.get("impl") == "torch_mp" for r in rows):
        gone.append("gpu_attach torch_mp (neither rows nor a skip)")
    gone += [f"{r['group']} {r['impl']} {r.get('size')}: not checked"
             for r in rows if "skipped" not in r and r.get("checked") is not True]
    return gone


def human(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def say_row(r):
    if "skipped" in r:
        print(f"row     {r['group']} {r['impl']}  skipped: {r['skipped']}", flush=True)
        return
    print(f"row     {r['group']} {r['impl']}  {human(r['size'])}  median {r['median_us']:.1f} us  "
          f"p99 {r['p99_us']:.1f} us  ({r['reps']} reps, reads checked)", flush=True)


def stream_rows(cmd, env, log):
    """Run cmd, printing each row of its stdout as it comes and appending it to the file log
    (JSON lines), so that a run cut short (a time limit, a crash, a failed read at the largest
    size) keeps every row it finished; the rows, or CalledProcessError."""
    rows = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as p:
        run.HARNESS_PIDS.append(p.pid)
        for line in p.stdout:
            if not line.strip():
                continue
            r = json.loads(line)
            say_row(r)
            log.write(json.dumps(r) + "\n")
            log.flush()
            rows.append(r)
    if p.returncode:
        raise subprocess.CalledProcessError(p.returncode, cmd)
    return rows


def say_target(t):
    verdict = "" if t["goal"] is None else f" (goal <= {t['goal']}x: {'met' if t['met'] else 'NOT met'})"
    print(f"target  {t['name']}  {human(t['size'])}  {t['ratio']:.2f}x{verdict}", flush=True)


def markdown(path, out=sys.stdout):
    """docs/gpu.md's tables ("Figures") from a bench_gpu.json, written to @out."""
    with open(path) as f:
        res = json.load(f)

    def w(*line):
        print(*line, file=out)

    rows = res["rows"]
    sizes = sorted({r["size"] for r in rows if r.get("group") == "gpu_attach" and "size" in r})
    d = res.get("driver", {})
    w(f"{d.get('device', '?')}, driver CUDA {d.get('driver_cuda', '?')} ({d.get('library')}), "
      f"{res['machine']['date']}; median (p99) in us\n")
    w("| attach + first read + release | " + " | ".join(human(s) for s in sizes) + " |")
    w("|---|" + "---:|" * len(sizes))
    for impl in ATTACH_IMPLS:
        cells = [pick(rows, "gpu_attach", impl, s) for s in sizes]
        w(f"| {impl} | " + " | ".join(f"{c['median_us']:.1f} ({c['p99_us']:.1f})" if c else "skipped"
                                          for c in cells) + " |")
    w("\n| state dict | tensors | bytes | until the consumer can run |\n|---|---:|---:|---:|")
    for impl in DICT_IMPLS:
        r = pick(rows, "gpu_dict", impl)
        w(f"| {impl} | {r['tensors']} | {human(r['size'])} | {r['median_us']:.1f} ({r['p99_us']:.1f}) |")
    w("\n| target | size | ratio | goal | met |\n|---|---:|---:|---:|---|")
    for t in res["targets"]:
        goal = "" if t["goal"] is None else f"<= {t['goal']}"
        met = "" if t["met"] is None else ("yes" if t["met"] else "**no**")
        w(f"| {t['name']} | {human(t['size'])} | {t['ratio']:.2f} | {goal} | {met} |")
    return 0


def figure(res):
    """The figure of a bench_gpu.json's contents (matplotlib, imported by the caller): attach
    time against size (log-log, median with a p99 whisker) per implementation, and the state
    dict's rows as bars (log scale: per_tensor is tens of times the others)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    def log_us(ax):  # 1-2-5 steps, plain numbers: a reader compares rows, not decades
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_locator(LogLocator(base=10, subs="auto"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))

    rows = [r for r in res["rows"] if "skipped" not in r]
    d = res.get("driver", {})
    fig, (att, dic) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    quick = " (--quick: tiny sizes, few reps)" if res.get("quick") else ""
    fig.suptitle(f"{d.get('device', '?')}, driver CUDA {d.get('driver_cuda', '?')} "
                 f"({d.get('library', '?')}), {res.get('machine', {}).get('date', '?')}{quick}")
    sizes = set()
    for impl in ATTACH_IMPLS:
        pts = sorted((r["size"], r["median_us"], r["p99_us"]) for r in rows
                     if r.get("group") == "gpu_attach" and r.get("impl") == impl)
        if not pts:
            continue
        x, med, p99 = zip(*pts)
        sizes.update(x)
        att.errorbar(x, med, yerr=[[0] * len(x), [max(p - m, 0) for m, p in zip(med, p99)]],
                     marker="o", markersize=4, capsize=3, label=impl,
                     linestyle="--" if impl.startswith("floor") else "-")
    att.set_xscale("log", base=2)
    log_us(att)
    if sizes:
        att.set_xticks(sorted(sizes))
        att.set_xticklabels([human(s) for s in sorted(sizes)])
        att.xaxis.set_minor_locator(NullLocator())
    att.set_xlabel("tensor size")
    att.set_ylabel("us (median; whisker up to p99)")
    att.set_title("attach + first kernel read + release")
    att.grid(True, which="both", alpha=0.3)
    att.legend(fontsize="small")
    bars = [pick(rows, "gpu_dict", impl) for impl in DICT_IMPLS]
    bars = [b for b in bars if b is not None]
    if bars:
        med = [b["median_us"] for b in bars]
        up = [max(b["p99_us"] - b["median_us"], 0) for b in bars]
        dic.bar([b["impl"] for b in bars], med, yerr=[[0] * len(bars), up], capsize=4,
                color=[f"C{i}" for i in range(len(bars))])
        for i, (m, u) in enumerate(zip(med, up)):
            dic.annotate(f"{m / 1000:.1f} ms" if m >= 1000 else f"{m:.0f} us", (i, m + u), textcoords="offset points",
                         xytext=(0, 4), ha="center", fontsize="small")
        log_us(dic)
        dic.set_title(f"state dict: {bars[0].get('tensors', '?')} tensors, "
                      f"{human(bars[0]['size'])}")
    else:
        dic.set_title("state dict: no rows")
    dic.set_ylabel("until the consumer can run, us (median; whisker up to p99)")
    dic.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    return fig


def plot(path, out):
    """Draw bench_gpu.png into the folder out from the bench_gpu.json at path: its path, or None
    after one line saying why no plot was made (matplotlib is optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"bench-gpu: no plot made: matplotlib cannot be imported by {sys.executable} ({e})",
              flush=True)
        return None
    with open(path) as f:
        fig = figure(json.load(f))
    png = os.path.join(out, PLOT)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, few reps")
    ap.add_argument("--build", default=os.path.join(run.ROOT, "build"), help="CMake build directory")
    ap.add_argument("--out", help="where bench_gpu.json goes (default BUILD/gpu-figures)")
    ap.add_argument("--python", help="interpreter for the torch.multiprocessing row")
    ap.add_argument("--table", metavar="JSON", help="print docs/gpu.md's tables from a "
                    "bench_gpu.json (run nothing)")
    ap.add_argument("--plot", metavar="JSON", help="draw bench_gpu.png from a bench_gpu.json "
                    "into --out (default: beside it; run nothing)")
    args = ap.parse_args()
    if args.table:
        return markdown(args.table)
    if args.plot:
        out = args.out or os.path.dirname(os.path.abspath(args.plot))
        os.makedirs(out, exist_ok=True)
        png = plot(args.plot, out)
        if png:
            print(f"bench-gpu: plot in {png}", flush=True)
        return 0
    # stopped (scripts/dev gpu-test's time limit): the daemon and the temporary directory go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    out = args.out or os.path.join(args.build, "gpu-figures")
    info, why = device_info()
    if why:
        print(f"bench-gpu: skipped: {why}", file=sys.stderr)
        return 77
    sizes = QUICK_SIZES if args.quick else SIZES
    cmd = [os.path.join(args.build, "bench", "bench_gpu"), "--sizes", ",".join(map(str, sizes))]
    cmd += (["--reps", "3", "--dict-tensors", "8", "--dict-bytes", "1M", "--dict-reps", "2"]
            if args.quick else ["--reps", "20", "--dict-tensors", "500", "--dict-bytes", "4G",
                                "--dict-reps", "5"])
    os.makedirs(out, exist_ok=True)
    partial = os.path.join(out, "bench_gpu.rows.jsonl")
    if os.path.exists(os.path.join(out, PLOT)):
        os.unlink(os.path.join(out, PLOT))  # an earlier run's plot never sits beside this one's
    try:
        with tempfile.TemporaryDirectory(prefix="dlpc-bench-gpu.") as tmp, \
                open(partial, "w") as log:
            proc, sock = run.start_daemon(args.build, tmp)
            try:
                rows = stream_rows(cmd + ["--socket", sock], dict(os.environ), log)
            finally:
                run.stop_daemon(proc)
            py = torch_python(args.python)
            rows += stream_rows([py, os.path.join(HERE, "bench_gpu_torch.py"), "--sizes",
                                 ",".join(map(str, sizes)), "--reps",
                                 "3" if args.quick else "20"], dict(os.environ), log)
    except subprocess.CalledProcessError as e:
        name = next((os.path.basename(c) for c in e.cmd if "bench_gpu" in c), e.cmd[0])
        print(f"bench-gpu: {name} failed (status {e.returncode}; why above); the rows done "
              f"are in {partial}", file=sys.stderr)
        return 1
    gone = missing(rows, sizes)
    if gone:
        print("bench-gpu: rows missing: " + "; ".join(gone), file=sys.stderr)
        return 1
    checks = targets(rows, sizes)
    for t in checks:
        say_target(t)
    path = os.path.join(out, "bench_gpu.json")
    with open(path, "w") as f:
        json.dump({"machine": run.machine(), "driver": info, "quick": args.quick,
                   "rows": rows, "targets": checks}, f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "bench_gpu.md"), "w") as f:
        markdown(path, f)  # read back: well formed, as written
    print(f"bench-gpu: figures in {path}, as docs/gpu.md's tables in bench_gpu.md", flush=True)
    try:
        png = plot(path, out)
    except Exception as e:  # the figures are written: a plot that fails costs only itself
        print(f"bench-gpu: no plot made: drawing it failed ({type(e).__name__}: {e})", flush=True)
        png = None
    if png:
        print(f"bench-gpu: plot in {png}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
