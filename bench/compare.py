#!/usr/bin/python3
# SPDX-License-Identifier: Apache-2.0
"""Compare two builds of dlpackd on the same benchmarks, alternating them in one run.

    /usr/bin/python3 bench/compare.py --old BUILD_A --new BUILD_B [--rounds N] [--quick]
                                      [--out FILE.json]

For a change that should not change speed (a restructuring), "within noise" is only a claim
when both trees ran on the same machine in the same minutes. Each round runs both builds, in
the order old-new on even rounds and new-old on odd ones, each against a private dlpackd of its
own build: bench_c's attach, reattach, bundle and publish_small groups, and bench_py.py's
attach_py, handoff, channel and bundle groups (the Python module of that build). Every
measurement is pinned to CPU 0, as bench/run.py pins them.

Prints, for every row, the median over the rounds of each build, the ratio new/old and the
noise: the larger of the two builds' spreads between their own rounds, (max - min) / median.
A row is "slower" or "faster" only when the ratio leaves 1 by more than that noise. Writes
every round's rows to --out (default: nothing written). Exits 1 if a row is missing.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run  # noqa: E402  (bench/run.py: the daemon's start and stop, row reading)

C_GROUPS = "attach,reattach,bundle,publish_small"
PY_GROUPS = "attach_py,handoff,channel,bundle"


def one_round(build, quick):
    """Every row of one build, against a daemon of its own."""
    tmp = tempfile.mkdtemp(prefix="dlpc-compare-")
    env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
    proc = None
    try:
        proc, sock = run.start_daemon(build, tmp)
        os.sched_setaffinity(proc.pid, {0})
        cmd = [os.path.join(build, "bench", "bench_c"), "--socket", sock, "--only", C_GROUPS,
               "--pin", "0"] + (["--quick"] if quick else [])
        rows = run.run_rows(cmd, env)
        cmd = [sys.executable, os.path.join(HERE, "bench_py.py"), "--socket", sock,
               "--only", PY_GROUPS] + (["--quick"] if quick else [])
        rows += run.run_rows(cmd, env, pin=True)
        run.stop_daemon(proc)
        proc = None
        return rows
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def key(row):
    return (row["group"], row["impl"], row.get("size"), row.get("clients"))


def spread(values):
    m = statistics.median(values)
    return (max(values) - min(values)) / m if m else 0.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="build directory of the tree before")
    ap.add_argument("--new", required=True, help="build directory of the tree after")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of both builds (default 4)")
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    ap.add_argument("--out", default=None, help="write every round's rows here (JSON)")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2: noise is measured between rounds")
    builds = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    got = {"old": {}, "new": {}}  # tree -> key -> [median_us of each round]
    log = []
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for tree in order:
            print(f"compare: round {r + 1}/{args.rounds}, {tree} ({builds[tree]})",
                  file=sys.stderr, flush=True)
            for row in one_round(builds[tree], args.quick):
                if row.get("median_us") is None:
                    continue
                got[tree].setdefault(key(row), []).append(row["median_us"])
                log.append(dict(row, tree=tree, round=r))

    missing = sorted(set(got["old"]) ^ set(got["new"]), key=str)
    print("| group | impl | size | old µs | new µs | new/old | noise | verdict |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    summary = []
    for k in sorted(set(got["old"]) & set(got["new"]), key=str):
        old, new = got["old"][k], got["new"][k]
        mo, mn = statistics.median(old), statistics.median(new)
        ratio = mn / mo if mo else float("nan")
        noise = max(spread(old), spread(new))
        verdict = ("slower" if ratio > 1 + noise else "faster" if ratio < 1 - noise
                   else "within noise")
        group, impl, size, clients = k
        what = run.human(size) if size is not None else "-"
        if clients:
            what += f" ×{clients}"
        print(f"| {group} | {impl} | {what} | {mo:.2f} | {mn:.2f} | {ratio:.3f} | "
              f"±{noise:.1%} | {verdict} |")
        summary.append({"group": group, "impl": impl, "size": size, "clients": clients,
                        "old_us": mo, "new_us": mn, "ratio": ratio, "noise": noise,
                        "verdict": verdict})
    for k in missing:
        print(f"compare: row {k} came from one build only", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": run.machine(), "old": builds["old"], "new": builds["new"],
                       "rounds": args.rounds, "summary": summary, "rows": log}, f, indent=1)
            f.write("\n")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
