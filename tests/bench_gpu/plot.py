#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""The GPU bench's plot (bench/run_gpu.py, bench_gpu.png): the ctest bench_gpu_plot.

    plot.py FAKE_OUT

FAKE_OUT is the --out of the ctest bench_gpu_fake (its fixture, run first): its
bench_gpu.png must be a PNG written after its bench_gpu.json. `run_gpu.py --plot` must draw
h200_2026-11-28.json (beside this file): the bench_gpu.json of a hardware run, copied unchanged
from bench/run_gpu.py on one NVIDIA H200 (driver CUDA 13.0), 2026-11-28 (the run docs/gpu.md
reports, each attach row's reps in a block of their own); its figure must carry the device and the driver in its title, a
line per attach implementation and a bar per state-dict row. Without matplotlib, run_gpu.py
must say in one line that no plot was made, write none and exit 0; that is checked with any
interpreter (a stand-in matplotlib that cannot be imported), the rest only where matplotlib can
be imported (exit 77 otherwise, after the first check).
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RUN_GPU = os.path.join(ROOT, "bench", "run_gpu.py")
HW = os.path.join(HERE, "h200_2026-11-28.json")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC and os.path.getsize(path) > 1000


def run_plot(out, env=None):
    return subprocess.run([sys.executable, RUN_GPU, "--plot", HW, "--out", out], env=env,
                          capture_output=True, text=True, timeout=120)


def without_matplotlib(tmp):
    """A matplotlib that raises ImportError first on the path: one line, no file, status 0."""
    stub = os.path.join(tmp, "stub", "matplotlib")
    os.makedirs(stub)
    with open(os.path.join(stub, "__init__.py"), "w") as f:
        f.write("raise ImportError('a stand-in for a missing matplotlib')\n")
    out = os.path.join(tmp, "without")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(stub))
    p = run_plot(out, env)
    lines = p.stdout.splitlines()
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("bench-gpu: no plot made: matplotlib"), lines
    assert "a stand-in for a missing matplotlib" in lines[0], lines
    assert not os.path.exists(os.path.join(out, "bench_gpu.png"))
    print("ok  without matplotlib: " + lines[0])


def hardware_json(tmp):
    """--plot on the hardware run's JSON writes a PNG; its figure says what it shows."""
    out = os.path.join(tmp, "hw")
    p = run_plot(out)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    png = os.path.join(out, "bench_gpu.png")
    assert is_png(png), p.stdout
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import matplotlib
    matplotlib.use("Agg")
    import run_gpu
    with open(HW) as f:
        fig = run_gpu.figure(json.load(f))
    title = " ".join(t.get_text() for t in fig.texts)  # the suptitle
    assert "NVIDIA H200" in title and "driver CUDA 13.0" in title, title
    att, dic = fig.axes
    labels = att.get_legend_handles_labels()[1]
    assert labels == ["floor_legacy", "dlpc_legacy", "floor_vmm", "dlpc_vmm", "torch_mp"], labels
    assert att.get_xscale() == "log" and att.get_yscale() == "log"
    assert [t.get_text() for t in dic.get_xticklabels()] == list(run_gpu.DICT_IMPLS)
    heights = [round(b.get_height(), 1) for b in dic.patches]
    assert heights == [2078.0, 107759.0, 3200.6, 4520.2], heights  # the medians, as in the JSON
    print(f"ok  --plot {os.path.basename(HW)}: {png} ({title})")


def fake_run(out):
    """bench_gpu_fake's run drew its plot beside its JSON, after it."""
    png, js = os.path.join(out, "bench_gpu.png"), os.path.join(out, "bench_gpu.json")
    assert os.path.exists(js), f"{js}: bench_gpu_fake has not run"
    assert os.path.exists(png) and is_png(png), f"{png}: no PNG beside {js}"
    assert os.path.getmtime(png) >= os.path.getmtime(js), "the plot is older than the JSON"
    print(f"ok  bench_gpu_fake's run: {png}")


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dlpc-bench-gpu-plot.") as tmp:
        without_matplotlib(tmp)
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            print(f"skip: matplotlib cannot be imported by {sys.executable} ({e})")
            return 77
        hardware_json(tmp)
    fake_run(sys.argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
