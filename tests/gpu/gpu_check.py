# SPDX-License-Identifier: Apache-2.0
"""The GPU checks of tests/gpu/run.sh, against the dlpackd at $DLPACKD_SOCKET (real GPU only).

    python3 gpu_check.py --dir DIR [GROUP]...

Prints one line per check on stdout,

    ok|FAIL|skip  <check name>  <timing or detail>

and exits 1 if any check failed, else 0. GROUPs (substrings of the group names below) select
some; the daemon's final check always runs. This process never touches CUDA, so that it keeps
no device alive: every publisher and attacher is a process of its own running gpu_roles.py
with this interpreter, and its log goes to DIR (the tail of each of a failed group's logs is
copied to stderr). Check names begin with their group's name.
"""
import argparse
import importlib.util
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback

import dlpack_ipc

HERE = os.path.dirname(os.path.abspath(__file__))
ROLES = os.path.join(HERE, "gpu_roles.py")
SPIN = 2.0  # seconds of a publisher's or consumer's long kernel
GIB = 1 << 30


class Fail(Exception):
    pass


class Skip(Exception):
    pass


def fmt_s(s):
    if s is None:
        return "never"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.0f} µs"


def clip(text, n=240):
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."


class Role:
    """A process running gpu_roles.py ROLE, spoken to in JSON lines."""

    def __init__(self, ctx, role, env, args):
        self.name = role
        ctx.seq += 1
        self.log_path = os.path.join(ctx.dir, f"{ctx.seq:02d}-{ctx.group}-{role}.log")
        full_env = dict(ctx.env)
        for k, v in (env or {}).items():
            if v is None:
                full_env.pop(k, None)
            else:
                full_env[k] = v
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, ROLES, role, json.dumps(args)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env=full_env)
        self.buf = b""

    def send(self, **cmd):
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise Fail(f"{self.name} exited ({self._status()}): {self.last_log_line()}") from None

    def expect(self, kinds, timeout):
        """The next report, which must be of one of `kinds` (a str or a tuple)."""
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.dump_stacks()
                raise Fail(f"{self.name}: no {'/'.join(kinds)} report within {timeout:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    raise Fail(f"{self.name} exited ({self._status()}) before its "
                               f"{'/'.join(kinds)} report: {self.last_log_line()}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if msg["kind"] == "error":
            raise Fail(f"{self.name}: {msg['why']}")
        if msg["kind"] == "skip":
            raise Skip(msg["why"])
        if msg["kind"] not in kinds:
            raise Fail(f"{self.name}: a {msg['kind']} report instead of {'/'.join(kinds)}")
        return msg

    def wait(self, timeout=60):
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            raise Fail(f"{self.name} did not exit within {timeout:.0f} s") from None
        if rc != 0:
            raise Fail(f"{self.name} exited ({self._status()}): {self.last_log_line()}")

    def _status(self):
        try:
            rc = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return "still running"
        return f"signal {-rc}" if rc < 0 else f"status {rc}"

    def dump_stacks(self):
        """Have a role that does not answer write its threads' stacks to its log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass

    def log_tail(self, n=30):
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read().splitlines()[-n:]
        except OSError:
            return []

    def last_log_line(self):
        lines = [line for line in self.log_tail() if line.strip()]
        return clip(lines[-1]) if lines else "(nothing in its log)"


class Ctx:
    def __init__(self, dirname):
        self.dir = dirname
        self.seq = 0
        self.group = None
        self.counts = {"ok": 0, "FAIL": 0, "skip": 0}
        self.pending = []
        self.roles = []
        self.env = dict(os.environ)
        # the checks set the allocator up themselves
        self.env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        self.env["PYTHONFAULTHANDLER"] = "1"

    def role(self, role, env=None, **args):
        r = Role(self, role, env, args)
        self.roles.append(r)
        return r

    def line(self, status, check, detail):
        if check in self.pending:
            self.pending.remove(check)
        self.counts[status] += 1
        print(f"{status:<4}  {check}  {clip(detail, 400)}", flush=True)

    def ok(self, check, detail):
        self.line("ok", check, detail)

    def fail(self, check, detail):
        self.line("FAIL", check, detail)

    def skip(self, check, detail):
        self.line("skip", check, detail)

    def run(self, fn):
        self.group, self.pending, self.roles = fn.group, list(fn.checks), []
        failed = self.counts["FAIL"]
        status, why = "FAIL", "not reported (a bug in gpu_check.py)"
        try:
            fn(self)
        except Skip as e:
            status, why = "skip", str(e)
        except Fail as e:
            why = str(e)
        except Exception as e:
            traceback.print_exc()
            why = f"{type(e).__name__}: {e}"
        finally:
            for r in self.roles:
                r.stop()
        for check in list(self.pending):
            self.line(status, check, why)
        if self.counts["FAIL"] > failed:
            for r in self.roles:
                print(f"--- {r.log_path} (last lines)", file=sys.stderr)
                for line in r.log_tail():
                    print(f"  | {line}", file=sys.stderr)
        try:
            for e in dlpack_ipc.list(f"gpu/{fn.group}/"):
                try:
                    dlpack_ipc.unpublish(e.name)
                except FileNotFoundError:
                    pass
        except OSError as e:
            print(f"gpu-test: cleaning up gpu/{fn.group}/: {e}", file=sys.stderr)


GROUPS = []


def group(name, checks):
    """A function that runs checks `checks` (names that begin with `name`) and prints their
    lines; a line it leaves out fails with the exception that ended it, or is skipped."""
    def deco(fn):
        fn.group, fn.checks = name, [f"{name}: {c}" for c in checks]
        GROUPS.append(fn)
        return fn
    return deco


def spec(name, kind, n, seed, offset=0):
    return {"name": name, "kind": kind, "n": n, "seed": seed, "offset": offset}


def size_tag(n):
    nbytes = 4 * n
    return f"{nbytes // GIB} GiB" if nbytes >= GIB else f"{nbytes >> 10} KiB"


def path_of(r, kind):
    """How an entry went, from whether the daemon holds an fd for it."""
    if kind == "vmm":
        return "VMM" if r["fd"] else "VMM, yet no fd in the daemon?"
    return "lent VMM (an fd)" if r["fd"] else "legacy IPC"


def judge_attach(ctx, check, n, pub, att, path):
    if not pub.get("published"):
        return ctx.fail(check, f"publish refused: {pub['error']}")
    problems = []
    if att["device"] != "cuda:0" or att["tensor_device"] != "cuda:0":
        problems.append(f"on {att['device']} / {att['tensor_device']}, not cuda:0")
    if att["shape"] != [n] or att["dtype"] != "torch.float32":
        problems.append(f"{att['dtype']} {att['shape']}, not torch.float32 [{n}]")
    if att["checksum"] != pub["checksum"]:
        problems.append(f"contents differ (checksum {att['checksum']}, "
                        f"published {pub['checksum']})")
    if problems:
        return ctx.fail(check, "; ".join(problems))
    again = " (same mapping)" if att["same_mapping"] else ""
    ctx.ok(check, f"attach+from_dlpack {fmt_s(att['attach_s'])}, again {fmt_s(att['again_s'])}"
                  f"{again}; publish {fmt_s(pub['publish_s'])}; {path}; contents match")


# ---- 1. legacy IPC, VMM, allocator settings ----

IPC_SIZES = (1024, 1 << 28)  # float32: 4 KiB and 1 GiB


@group("ipc", [f"{what} {size_tag(n)}" for what in ("torch", "vmm empty()")
               for n in IPC_SIZES]
       + ["torch same-process attach", "torch producer's deleter after unpublish"]
       + [f"{what} {size_tag(n)}" for what in ("expandable_segments", "cudaMallocAsync")
          for n in IPC_SIZES])
def g_ipc(ctx):
    """torch.cuda tensors (inside larger allocations) and dlpack_ipc.empty memory, published
    by one process and attached by another; then the same torch tensors under
    expandable_segments:True and backend:cudaMallocAsync. A row that cannot run fails (or
    skips) its own lines only."""
    reclaims = []
    for alloc, conf in (("torch", None), ("expandable_segments", "expandable_segments:True"),
                        ("cudaMallocAsync", "backend:cudaMallocAsync")):
        rows = [c for c in ctx.pending if c.startswith(f"ipc: {alloc} ")
                or alloc == "torch" and c.startswith("ipc: vmm ")]
        try:
            ipc_row(ctx, alloc, conf, reclaims)
        except (Fail, Skip) as e:
            for check in rows:
                if check in ctx.pending:
                    ctx.line("skip" if isinstance(e, Skip) else "FAIL", check, str(e))
    check = "ipc: torch producer's deleter after unpublish"  # unless its row failed
    late = [a for a, s in reclaims if s is None]
    text = ", ".join(f"{a} {fmt_s(s)}" for a, s in reclaims)
    if check not in ctx.pending:
        pass
    elif late:
        ctx.fail(check, f"torch's allocator never got the memory back ({', '.join(late)}) "
                        f"within 60 s of unpublish: {text}")
    elif reclaims:
        ctx.ok(check, f"memory back in torch's allocator after unpublish: {text}")
    else:
        ctx.skip(check, "no torch tensor was published")


def ipc_row(ctx, alloc, conf, reclaims):
    specs = [spec(f"gpu/ipc/{alloc}-{n}", "torch", n, 1 + i, offset=256)
             for i, n in enumerate(IPC_SIZES)]
    if alloc == "torch":
        specs += [spec(f"gpu/ipc/vmm-{n}", "vmm", n, 3 + i) for i, n in enumerate(IPC_SIZES)]
    pub = ctx.role("publisher", env={"PYTORCH_CUDA_ALLOC_CONF": conf}, specs=specs,
                   same_process=specs[0]["name"] if alloc == "torch" else None)
    res = pub.expect("published", 300)["results"]
    items = [{"name": s["name"]} for s in specs if res[s["name"]].get("published")]
    att = {}
    if items:
        sub = ctx.role("attacher", items=items)
        sub.expect("ready", 180)
        sub.send(op="go")
        att = sub.expect("attached", 300)["results"]
        sub.wait()
    pub.send(op="unpublish")
    un = pub.expect("unpublished", 120)
    pub.wait()
    if items and alloc != "cudaMallocAsync":
        reclaims.append((alloc, un["reclaim_s"]))
    for s in specs:
        name, n = s["name"], s["n"]
        r = res[name]
        what = "vmm empty()" if s["kind"] == "vmm" else alloc
        check = f"ipc: {what} {size_tag(n)}"
        if alloc == "torch":
            judge_attach(ctx, check, n, r, att.get(name),
                         path_of(r, s["kind"]) if r.get("published") else "")
        elif r.get("published"):
            if alloc == "cudaMallocAsync":
                ctx.fail(check, "published; expected a BufferError naming cudaMallocAsync")
            else:
                judge_attach(ctx, check, n, r, att[name], path_of(r, s["kind"])
                             + ("" if r["fd"] else " (expected lent VMM)"))
        elif alloc == "expandable_segments":
            if "expandable" not in r["error"].lower():
                ctx.fail(check, f"refused without naming expandable segments: {r['error']}")
            elif not r["freed"]:
                ctx.fail(check, f"refused, but the producer's memory was not freed: "
                                f"{r['error']}")
            else:
                ctx.ok(check, f"refused, naming the setting: {r['error']}")
        elif r["error_type"] != "BufferError" or "cudaMallocAsync" not in r["error"]:
            ctx.fail(check, f"expected a BufferError naming cudaMallocAsync: {r['error']}")
        else:
            freed = "" if r["freed"] else " (torch's allocator did not show it freed)"
            ctx.ok(check, f"refused: {r['error']}{freed}")
    if alloc == "torch":
        check = "ipc: torch same-process attach"
        want = res[specs[0]["name"]]
        here = want.get("same_process")
        if here is None:
            ctx.fail(check, f"not attached: publish refused: {want.get('error')}")
        elif not here["same_ptr"] or here["checksum"] != want["checksum"]:
            ctx.fail(check, f"same pointer: {here['same_ptr']}, same contents: "
                            f"{here['checksum'] == want['checksum']}")
        else:
            ctx.ok(check, f"attach+from_dlpack {fmt_s(here['attach_s'])}: the publisher's own "
                          "pointer, contents match")


# ---- 2. ordering behind a publisher's long kernel ----

ORDER = (("default", "default stream (torch.from_dlpack)"),
         ("side", "side stream (torch.from_dlpack under torch.cuda.stream)"),
         ("capsule", "side stream (__dlpack__(stream=s))"))


@group("order", [what for _, what in ORDER])
def g_order(ctx):
    """The publisher queues a long kernel and then the final values, and publishes at once;
    the consumer, which attaches while the kernel runs, must read the final values."""
    n = 1 << 24
    pub = ctx.role("order_pub", n=n, seconds=SPIN)
    sub = ctx.role("order_sub")
    pub.expect("ready", 180)
    sub.expect("ready", 180)
    for i, (variant, what) in enumerate(ORDER):
        check = f"order: {what}"
        name, seed = f"gpu/order/{variant}", 11 + i
        pub.send(op="publish", name=name, seed=seed)
        p = pub.expect("published", 60 + SPIN)
        sub.send(op="attach", name=name, seed=seed, n=n, variant=variant)
        r = sub.expect("read", 60 + SPIN)
        k = pub.expect("kernel_end", 60 + SPIN)
        pub.send(op="unpublish", name=name)
        pub.expect("unpublished", 30)
        took = r["t_attached"] - r["t_attach"]
        if r["checksum"] != r["expected"]:
            got = "zeros" if r["checksum"] == [0, 0] else "other values"
            ctx.fail(check, f"read {got}, not the values the publisher's kernel wrote last "
                            f"(attached {k['t_end'] - r['t_attached']:.2f} s before it ended)")
        elif not p["running"]:
            if p["publish_s"] > SPIN / 2:
                ctx.fail(check, f"publish waited on the host for the kernel "
                                f"({fmt_s(p['publish_s'])})")
            else:
                ctx.skip(check, f"the kernel had ended when publish returned: nothing to order "
                                f"(it ran {fmt_s(k['kernel_s'])}, publish took "
                                f"{fmt_s(p['publish_s'])})")
        elif r["t_attached"] >= k["t_end"]:
            if took > SPIN / 2 and r["t_attach"] < k["t_end"]:
                ctx.fail(check, f"attach and from_dlpack waited on the host for the "
                                f"publisher's kernel ({fmt_s(took)})")
            else:
                ctx.skip(check, "the consumer attached after the kernel ended: nothing to order")
        else:
            ctx.ok(check, f"attached {k['t_end'] - r['t_attached']:.2f} s before the publisher's "
                          f"kernel ended, read its final values; publish {fmt_s(p['publish_s'])}"
                          f", attach+from_dlpack {fmt_s(took)} (the host did not wait)")
    pub.send(op="exit")
    sub.send(op="exit")
    pub.wait()
    sub.wait()


# ---- 3. the reclaim race ----

RECLAIM = (("side", "consumer's side stream"), ("default", "default stream"),
           ("none", "no stream named (__dlpack__(stream=-1)), read on the default stream"))


@group("reclaim", [what for _, what in RECLAIM])
def g_reclaim(ctx):
    """The consumer queues a long kernel and then a read of the attached tensor, and drops
    the tensor at once; the publisher unpublishes, takes its memory back as soon as the
    library gives it (the producer's deleter ran) and overwrites it. The consumer's read
    must hold the original data, and the memory come back only after it."""
    n = 1 << 26  # 256 MiB
    pub = ctx.role("reclaim_pub", n=n)
    sub = ctx.role("reclaim_sub")
    pub.expect("ready", 180)
    sub.expect("ready", 180)
    for i, (variant, what) in enumerate(RECLAIM):
        check = f"reclaim: {what}"
        name, seed = f"gpu/reclaim/{variant}", 21 + i
        pub.send(op="publish", name=name, seed=seed)
        pub.expect("published", 60)
        sub.send(op="read", name=name, seed=seed, n=n, variant=variant, seconds=SPIN)
        sub.expect("dropped", 60)
        pub.send(op="unpublish", name=name, timeout=60 + SPIN)
        o = pub.expect("overwritten", 120 + SPIN)
        sub.send(op="check")
        c = sub.expect("checked", 180)
        if o["t_freed"] is None:
            ctx.fail(check, f"the producer's deleter had not run {60 + SPIN:.0f} s after "
                            "unpublish")
        elif c["checksum"] != c["expected"]:
            ctx.fail(check, "the consumer's kernel read data the publisher wrote after getting "
                            f"the memory back ({c['t_end'] - o['t_freed']:.3f} s before the "
                            "kernel ended)")
        elif c["t_end"] is None:
            ctx.fail(check, "the consumer's kernel never ended")
        elif o["t_freed"] < c["t_end"] - 0.05:
            ctx.fail(check, f"the memory came back {c['t_end'] - o['t_freed']:.3f} s before the "
                            "consumer's kernel ended")
        elif o["t_unpublish"] >= c["t_end"]:
            ctx.skip(check, "the consumer's kernel ended before unpublish: nothing raced")
        else:
            reuse = ("the same block taken again and overwritten" if o["reused"] else
                     "(torch's allocator gave another block: not overwritten)")
            ctx.ok(check, f"memory back {fmt_s(o['t_freed'] - o['t_unpublish'])} after unpublish,"
                          f" {fmt_s(max(0.0, o['t_freed'] - c['t_end']))} after the consumer's "
                          f"kernel ended; {reuse}; the consumer read the original data")
    pub.send(op="exit")
    sub.send(op="exit")
    pub.wait()
    sub.wait()


# ---- 4. VMM entries outliving their publisher ----

def persistence():
    """(True/False/None, words) for persistence mode, from nvidia-smi -q."""
    daemon = False
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/comm") as f:
                daemon = daemon or f.read().strip() == "nvidia-persiste"
        except OSError:
            pass
    running = ", nvidia-persistenced running" if daemon else ""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None, f"persistence mode unknown (no nvidia-smi){running}"
    try:
        out = subprocess.run([smi, "-q"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"persistence mode unknown (nvidia-smi -q: {e}){running}"
    modes = re.findall(r"^\s*Persistence Mode\s*:\s*(\S+)", out, re.M)
    if not modes:
        return None, f"persistence mode unknown (not in nvidia-smi -q){running}"
    return all(m == "Enabled" for m in modes), f"persistence mode {'/'.join(modes)}{running}"


def other_cuda_processes():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        out = subprocess.run(
            [smi, "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    procs = [line.strip() for line in out.splitlines() if line.strip()]
    return f", other CUDA processes: {'; '.join(procs)}" if procs else ", no other CUDA process"


@group("vmm-lifetime", ["attach after the publisher exited, another CUDA process alive",
                        "attach after the publisher exited, no CUDA process left"])
def g_vmm_lifetime(ctx):
    """dlpack_ipc.empty memory, filled and published by a process that then exits, attached
    by another: while a third process keeps the device up, and with nothing left (where only
    persistence mode keeps exported memory: a failure there, named so, is a skip)."""
    checks = list(ctx.pending)
    n = 1 << 20
    keeper = ctx.role("keeper")
    keeper.expect("ready", 180)
    for i, alone in enumerate((False, True)):
        check = checks[i]
        name = f"gpu/vmm-lifetime/{'alone' if alone else 'kept'}"
        if alone:
            keeper.send(op="exit")
            keeper.wait()
            enabled, words = persistence()
            words += other_cuda_processes()
        pub = ctx.role("publisher", specs=[spec(name, "vmm", n, 31 + i)], then="exit")
        r = pub.expect("published", 180)["results"][name]
        pub.wait()
        if not r.get("published"):
            ctx.fail(check, f"publish refused: {r['error']}")
            continue
        time.sleep(1.0)
        if not dlpack_ipc.list(name):
            ctx.fail(check, "the entry went with its publisher")
            continue
        sub = ctx.role("late_attacher", name=name)
        a = sub.expect(("attached", "failed"), 180)
        sub.wait()
        if a["kind"] == "attached" and a["checksum"] == r["checksum"]:
            ctx.ok(check, "attached and read after its publisher exited"
                          + (f" ({words})" if alone else ""))
        elif a["kind"] == "attached":
            ctx.fail(check, "attached after its publisher exited, but the contents differ")
        elif not alone:
            ctx.fail(check, a["error"])
        elif enabled:
            ctx.fail(check, f"{words}, yet: {a['error']}")
        elif "persistence" not in a["error"]:
            ctx.fail(check, f"the error does not name persistence mode ({words}): {a['error']}")
        else:
            ctx.skip(check, f"{words}: the driver let the memory go with the device's last "
                            f"process, and the error says so: {a['error']}")


# ---- 5. a graph captured while another thread drops attached tensors ----

CAPTURES = [
    # (check, streams the tensors are read on, inside cuda_releases_held())
    ("a CUDA graph captured while another thread drops tensors read on the default stream",
     ("default",), False),
    ("the same, tensors read on side streams too, inside cuda_releases_held()",
     ("default", "side", "capture"), True),
]


@group("capture", [what for what, _, _ in CAPTURES])
def g_capture(ctx):
    """A graph captured on a side stream (non-blocking, as PyTorch's are) while another thread
    drops attached tensors. A release ordered by the legacy stream needs no hold: that stream
    does not follow a non-blocking one. A tensor read on a non-blocking stream is released
    after a context synchronization, which would invalidate the capture: held until the end of
    cuda_releases_held() (docs/gpu.md, the stream rule)."""
    n = 1 << 18
    specs = ([spec(f"gpu/capture/t{i}", "torch", n, 40 + i) for i in range(24)]
             + [spec(f"gpu/capture/v{i}", "vmm", n, 80 + i) for i in range(3)])
    pub = ctx.role("publisher", specs=specs)
    res = pub.expect("published", 180)["results"]
    refused = [f"{k}: {v['error']}" for k, v in res.items() if not v.get("published")]
    if refused:
        raise Fail(f"publish refused: {refused[0]}")
    items = [{"name": k, "checksum": v["checksum"]} for k, v in res.items()]
    # each check: 8 or 16 torch tensors (legacy IPC) and VMM entries
    parts = [items[:8] + items[24:25], items[8:24] + items[25:]]
    results = []
    for (_, wheres, hold), part in zip(CAPTURES, parts):
        sub = ctx.role("capture_sub", items=part, wheres=wheres, hold=hold)
        results.append(sub.expect("captured", 180))
        sub.wait()
    pub.send(op="unpublish")
    un = pub.expect("unpublished", 120)
    pub.wait()
    for check, (_, wheres, hold), part, r in zip(list(ctx.pending), CAPTURES, parts, results):
        after = "the capture" + (" and the hold" if hold else "")
        if r["capture_error"]:
            ctx.fail(check, f"the capture failed: {r['capture_error']}")
        elif r.get("drop_error"):
            ctx.fail(check, f"the dropping thread: {r['drop_error']}")
        elif r["timed_out"]:
            ctx.fail(check, "the dropping thread had not finished 20 s into the capture")
        elif r["bad"]:
            ctx.fail(check, f"contents differ before the capture: {', '.join(r['bad'])}")
        elif not r["replay_ok"]:
            ctx.fail(check, "the graph's replay computed something else than the same work "
                            "eagerly")
        elif r["released_s"] is None:
            ctx.fail(check, f"the dropped tensors' references were still held 10 s after "
                            f"{after}")
        elif un["reclaim_s"] is None:
            ctx.fail(check, "the publisher never got its memory back")
        else:
            ctx.ok(check, f"{r['ops']} ops captured on a side stream while the other thread's "
                          f"gc.collect() dropped {len(part)} tensors (ordered on "
                          f"{', '.join(wheres)}; legacy and VMM) in {fmt_s(r['drop_s'])}; "
                          f"replay right; references gone {fmt_s(r['released_s'])} after "
                          f"{after} ended")


# ---- 6. fork ----

@group("fork", ["child's GPU calls raise OSError(EBADFD)",
                "child's publish of inherited VMM memory raises OSError(EBADFD)",
                "child's host calls work, inherited tensors dropped, clean exit",
                "parent's tensors intact after the child"])
def g_fork(ctx):
    """A process that used CUDA through dlpack_ipc (attach of a legacy and a VMM entry,
    empty() on the device, a capsule ordered on a stream) forks; what the child may and may
    not do, and the parent's tensors after it."""
    checks = list(ctx.pending)
    specs = [spec("gpu/fork/legacy", "torch", 1 << 16, 61),
             spec("gpu/fork/vmm", "vmm", 1 << 16, 62)]
    pub = ctx.role("publisher", specs=specs)
    res = pub.expect("published", 180)["results"]
    for s in specs:
        if not res[s["name"]].get("published"):
            raise Fail(f"publish refused: {res[s['name']]['error']}")
    user = ctx.role("fork_user", prefix="gpu/fork",
                    items=[{"name": s["name"], "checksum": res[s["name"]]["checksum"]}
                           for s in specs])
    r = user.expect("forked", 180)
    user.wait()
    pub.send(op="unpublish")
    pub.expect("unpublished", 120)
    pub.wait()
    child = r["child"] or {"crash": f"no results ({r['child_status']})"}
    if "crash" in child:
        for check in checks[:3]:
            ctx.fail(check, f"the child failed: {clip(child['crash'])}")
    else:
        if child["gpu"]:
            ctx.fail(checks[0], "; ".join(child["gpu"]))
        else:
            ctx.ok(checks[0], "attach (legacy IPC, VMM), empty(device=\"cuda:0\"), "
                              "__dlpack__(stream=1), publish of an attached tensor: each "
                              "OSError(EBADFD) naming the fork")
        if child["publish_vmm"]:
            ctx.fail(checks[1], "; ".join(child["publish_vmm"]))
        else:
            ctx.ok(checks[1], "publish of inherited empty() memory and of an attached VMM "
                              "tensor: OSError(EBADFD)")
        if child["host"] or r["child_status"] != "exit 0":
            ctx.fail(checks[2], "; ".join(child["host"] + [f"child: {r['child_status']}"]))
        else:
            ctx.ok(checks[2], f"a host entry published and read back; exit 0 after "
                              f"{fmt_s(r['child_s'])}")
    note = "" if not r["torch_cuda_before_fork"] else " (torch had started CUDA before the fork)"
    if r["parent"]:
        ctx.fail(checks[3], "; ".join(r["parent"]) + note)
    else:
        ctx.ok(checks[3], "legacy (attached, and through a capsule made before the fork), VMM "
                          f"and empty() memory read and written through torch afterwards{note}")


# ---- 7. 25,000 publications ----

MANY = 25000


@group("many", [f"{MANY} publications of slices", "attach a sample elsewhere",
                "unpublish all, memory back, STAT at zero"])
def g_many(ctx):
    """25,000 slices of five torch.cuda allocations published by legacy IPC (the library holds
    at most 1000 interprocess events; past that they share one completed event)."""
    checks = list(ctx.pending)
    per, allocs = 16, 5
    rng = random.Random(7)
    sample = sorted({0, 1, 998, 999, 1000, 1001, 4999, 5000, MANY - 1}
                    | set(rng.sample(range(MANY), 100)))
    pub = ctx.role("many_pub", prefix="gpu/many", count=MANY, per=per, allocs=allocs)
    p = pub.expect("published", 600)
    rest = (p["total_s"] - p["first_s"]) / (MANY - 1000)
    ctx.ok(checks[0], f"{MANY} in {fmt_s(p['total_s'])}: the first 1000 (interprocess events) "
                      f"{fmt_s(p['first_s'] / 1000)} each, then {fmt_s(rest)} each")
    sub = ctx.role("many_sub", prefix="gpu/many", count=MANY, per=per, allocs=allocs,
                   sample=sample)
    sub.expect("ready", 180)
    sub.send(op="go")
    a = sub.expect("attached", 300)
    sub.wait()
    if a["bad"]:
        ctx.fail(checks[1], f"contents differ for {len(a['bad'])} of {len(sample)}: "
                            f"#{', #'.join(map(str, a['bad'][:10]))}")
    else:
        ctx.ok(checks[1], f"{len(sample)} entries, across the 1000-event boundary: "
                          f"attach+from_dlpack {fmt_s(a['mean_s'])} on average, at most "
                          f"{fmt_s(a['max_s'])}; contents match")
    pub.send(op="unpublish")
    u = pub.expect("unpublished", 600)
    t0 = time.monotonic()
    while True:
        s = dlpack_ipc.stat()
        left = len(dlpack_ipc.list("gpu/many/"))
        if (s["references"] == 0 and left == 0) or time.monotonic() > t0 + 30:
            break
        time.sleep(0.05)
    pub.wait()
    if u["reclaim_s"] is None:
        ctx.fail(checks[2], f"unpublished in {fmt_s(u['unpublish_s'])}, but the producers' "
                            "memory was not back in torch's allocator 120 s later")
    elif s["references"] or left:
        ctx.fail(checks[2], f"STAT: {s['references']} references, {left} entries left")
    else:
        ctx.ok(checks[2], f"unpublished in {fmt_s(u['unpublish_s'])}; every producer's deleter "
                          f"had run {fmt_s(u['reclaim_s'])} after the first unpublish; STAT: 0 "
                          "references, 0 entries")


# ---- 8. a state dict ----

def bundle_problems(meta, got):
    problems = []
    if sorted(got) != sorted(meta):
        problems.append(f"keys {sorted(got)} instead of {sorted(meta)}")
    for k, want in meta.items():
        y = got.get(k)
        if y is None:
            continue
        if y["device"] != "cuda:0" or y["dtype"] != want["dtype"] or y["shape"] != want["shape"]:
            problems.append(f"{k}: {y['dtype']} {y['shape']} on {y['device']}, not "
                            f"{want['dtype']} {want['shape']} on cuda:0")
        elif y["checksum"] != want["checksum"]:
            problems.append(f"{k}: contents differ")
    return problems


@group("state-dict", ["publish_dict of a model's state_dict() (copied), attach_dict elsewhere",
                      "an empty_dict bucket filled from it, publish_dict as it is, attach_dict "
                      "elsewhere"])
def g_state_dict(ctx):
    copied, bucket = list(ctx.pending)
    names = ["gpu/state-dict/model", "gpu/state-dict/bucket"]
    pub = ctx.role("sd_pub", name=names[0], bucket_name=names[1])
    p = pub.expect("published", 180)
    sub = ctx.role("sd_sub", names=names)
    a = sub.expect("attached", 180)["results"]
    sub.wait()
    pub.send(op="exit")
    pub.wait()
    mib = 1 << 20
    problems = bundle_problems(p["meta"], a[names[0]]["got"])
    if problems:
        ctx.fail(copied, "; ".join(problems))
    elif p["freed"] < p["nbytes"]:
        ctx.fail(copied, f"the producers' memory was not freed when publish_dict returned "
                         f"({p['freed']} of {p['nbytes']} bytes)")
    else:
        ctx.ok(copied, f"{len(p['meta'])} tensors, {p['nbytes']} bytes (float32, int64, "
                       f"bfloat16): publish_dict {fmt_s(p['publish_s'])} (took "
                       f"{p['copy_took'] / mib:.0f} MiB of device memory), producers freed at "
                       f"once; attach_dict+from_dlpack {fmt_s(a[names[0]]['attach_s'])}, all "
                       f"within {a[names[0]]['span']} bytes; contents match")
    problems = bundle_problems(p["meta"], a[names[1]]["got"])
    if problems:
        ctx.fail(bucket, "; ".join(problems))
    elif p["bucket_took"] >= mib and p["copy_took"] >= mib:
        ctx.fail(bucket, f"publish_dict took {p['bucket_took'] / mib:.0f} MiB of device memory, "
                         "as the copying path does: the bucket was copied")
    else:
        how = ("no device memory taken (no copy)" if p["copy_took"] >= mib else
               "(free device memory does not tell copies apart here)")
        ctx.ok(bucket, f"publish_dict {fmt_s(p['bucket_s'])}, {how}; attach_dict+from_dlpack "
                       f"{fmt_s(a[names[1]]['attach_s'])}, all within {a[names[1]]['span']} "
                       "bytes; contents match")


# ---- CuPy ----

@group("cupy", ["cupy.from_dlpack of a legacy IPC entry", "cupy.from_dlpack of a VMM entry",
                "a CuPy array published, torch.from_dlpack elsewhere",
                "CuPy MemoryAsyncPool memory refused"])
def g_cupy(ctx):
    checks = list(ctx.pending)
    if importlib.util.find_spec("cupy") is None:
        raise Skip(f"no cupy (not importable by {sys.executable})")
    n = 1 << 18
    specs = [spec("gpu/cupy/torch", "torch", n, 51, offset=256), spec("gpu/cupy/vmm", "vmm", n, 52),
             spec("gpu/cupy/cupy", "cupy", n, 53, offset=256),
             spec("gpu/cupy/async", "cupy-async", 1024, 54)]
    pub = ctx.role("publisher", specs=specs)
    res = pub.expect("published", 180)["results"]
    items = [dict(s) for s in specs[:3] if res[s["name"]].get("published")]
    att = {}
    if items:
        sub = ctx.role("cupy_sub", items=items)
        att = sub.expect("attached", 180)["results"]
        sub.wait()
    pub.send(op="unpublish")
    pub.expect("unpublished", 120)
    pub.wait()
    for check, s in zip(checks[:2], specs[:2]):
        r, a = res[s["name"]], att.get(s["name"])
        if not r.get("published"):
            ctx.fail(check, f"publish refused: {r['error']}")
        elif not (a["default"] and a["side"]):
            ctx.fail(check, f"contents differ (CuPy's current stream: {a['default']}, a side "
                            f"stream: {a['side']})")
        else:
            ctx.ok(check, f"{path_of(r, s['kind'])}: attach+from_dlpack {fmt_s(a['attach_s'])};"
                          " contents match on CuPy's current stream and on a side stream")
    r, a = res["gpu/cupy/cupy"], att.get("gpu/cupy/cupy")
    if not r.get("published"):
        ctx.fail(checks[2], f"publish refused: {r['error']}")
    elif a["checksum"] != r["checksum"]:
        ctx.fail(checks[2], "contents differ")
    else:
        ctx.ok(checks[2], f"{path_of(r, 'cupy')}, publish {fmt_s(r['publish_s'])}; contents match")
    r = res["gpu/cupy/async"]
    if "unavailable" in r:
        ctx.skip(checks[3], r["unavailable"])
    elif r.get("published"):
        ctx.fail(checks[3], "published; expected a BufferError naming it")
    elif r["error_type"] != "BufferError" or "MemoryAsyncPool" not in r["error"]:
        ctx.fail(checks[3], f"expected a BufferError naming MemoryAsyncPool: {r['error']}")
    else:
        ctx.ok(checks[3], f"refused: {r['error']}")


# ---- the daemon, last ----

@group("daemon", ["nothing left behind, still running"])
def g_daemon(ctx):
    check = ctx.pending[0]
    t0 = time.monotonic()
    while True:
        s = dlpack_ipc.stat()
        left = [e.name for e in dlpack_ipc.list("gpu/")]
        if (s["references"] == 0 and not left) or time.monotonic() > t0 + 10:
            break
        time.sleep(0.1)
    if s["references"] or left:
        ctx.fail(check, f"{s['references']} references and {len(left)} entries "
                        f"({', '.join(left[:5])}) left")
    else:
        ctx.ok(check, f"0 entries, 0 references; {s['req_publish']} publishes, "
                      f"{s['req_attach']} attaches, {s['protocol_errors']} protocol errors")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="where the processes' logs go")
    ap.add_argument("groups", nargs="*", metavar="GROUP",
                    help=f"run these only: {', '.join(g.group for g in GROUPS[:-1])}")
    args = ap.parse_args()
    chosen = [g for g in GROUPS[:-1] if not args.groups or any(a in g.group for a in args.groups)]
    unknown = [a for a in args.groups if not any(a in g.group for g in GROUPS[:-1])]
    if unknown:
        ap.error(f"no check group named {', '.join(unknown)}")
    ctx = Ctx(args.dir)
    t0 = time.perf_counter()
    for fn in chosen + GROUPS[-1:]:
        ctx.run(fn)
    c = ctx.counts
    print(f"gpu-test: {c['ok']} ok, {c['FAIL']} FAIL, {c['skip']} skip in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 1 if c["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
