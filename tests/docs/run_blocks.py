# SPDX-License-Identifier: Apache-2.0
"""Run the runnable code blocks of the project's markdown files against a real dlpackd.

A fenced block is runnable when its info string starts with one of:

  ```python run        a Python script: written to block_L<LINE>.py and run as
                       `PYTHON block_L<LINE>.py`, a real __main__ script (multiprocessing's
                       "spawn" works; guard the entry with `if __name__ == "__main__":`)
  ```c run [FILE]      a C source file, written to FILE (default example.c); nothing more: the
                       `sh run` block after it compiles and runs it with the line the docs give
  ```sh run            a bash script, run as `bash -euo pipefail BLOCK`

and, right after a `python run` or `sh run` block, an optional

  ```text output       what the block prints on stdout, line by line (trailing blanks ignored);
                       a line `...` stands for any number of lines

Every other fence is prose to this runner. Blocks of one markdown file run in order, each its
own process, in one working directory per file: a fresh temp directory shaped like the checkout
root after `scripts/dev build`, i.e. symlinks to every top-level entry of the source tree and
`build` pointing at the build tree under test. So a compile line written for a reader at the
checkout root (`cc example.c -Iinclude -Lbuild -ldlpc ...`) runs as written, and blocks share
the files they write, never variables. Each markdown file gets its own dlpackd: --dlpackd BIN
is started on a socket in the temp directory and named by DLPACKD_SOCKET; with --no-daemon the
blocks find the daemon the caller started the way a user's would (tests/newcomer.sh: the
pip-installed dlpackd on its default per-user socket, DLPACKD_SOCKET unset), and with --bare
the working directory is an empty temp directory, as a pip user's would be.

A block fails on a non-zero exit, on output that differs from its `output` block, or when it
runs longer than --timeout seconds (its process group is then killed); the message names the
markdown file and the line of the block's fence, and shows what it printed.

Usage: run_blocks.py --src DIR [--build DIR] [--python PY] [--pythonpath DIR] [--dlpackd BIN |
       --no-daemon] [--bare] [--kinds python,c,sh] [--timeout S] [--list] [FILE.md ...]
Without FILE arguments: README.md and docs/*.md of --src. Exit status 0 when every block
passed, 1 when one failed, 2 on a usage error or when no runnable block was found.
"""
import argparse
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

KINDS = ("python", "c", "sh")
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")
# how long a started dlpackd may take to listen on its socket
DAEMON_START_TIMEOUT_S = 20
# how long a block may run, unless --timeout says otherwise
BLOCK_TIMEOUT_S = 120
# output shown when a block fails: the last this many characters of it
SHOWN_OUTPUT_MAX = 6000


class Block:
    def __init__(self, path, line, kind, words, text):
        self.path = path  # the markdown file
        self.line = line  # 1-based line of the opening fence
        self.kind = kind  # python, c, sh; or "output"
        self.words = words  # the info string's words after the kind
        self.text = text
        self.output = None  # the Block of an `output` fence right after it

    def where(self):
        return f"{self.path}:{self.line}"


def parse(path, shown=None):
    """The runnable blocks of a markdown file, in order, with their `output` blocks attached;
    messages name the file as shown (default: path)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    path = shown or path
    blocks = []
    last = None  # the runnable block just closed, if nothing but blank lines followed it
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                last = None
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        start = i
        body = []
        i += 1
        closed = False
        while i < len(lines):
            c = FENCE.match(lines[i])
            if (c and c.group(2)[0] == fence[0] and len(c.group(2)) >= len(fence)
                    and not c.group(3).strip()):
                closed = True
                break
            # the content loses up to the opening fence's indentation
            line = lines[i]
            strip = min(indent, len(line) - len(line.lstrip(" ")))
            body.append(line[strip:])
            i += 1
        i += 1
        words = info.split()
        runnable = len(words) >= 2 and words[0] in KINDS and words[1] == "run"
        is_output = len(words) >= 2 and words[1] == "output"
        if (runnable or is_output) and not closed:
            raise SyntaxError(f"{path}:{start + 1}: the fence ```{info} is never closed")
        if runnable:
            b = Block(path, start + 1, words[0], words[2:], "\n".join(body) + "\n")
            if b.kind != "c" and b.words:
                raise SyntaxError(f"{b.where()}: ```{info}: only `c run` takes a file name")
            if b.kind == "c" and len(b.words) > 1:
                raise SyntaxError(f"{b.where()}: ```{info}: `c run` takes one file name")
            if b.kind == "c" and b.words and not re.fullmatch(r"[A-Za-z0-9_.-]+\.[ch]", b.words[0]):
                raise SyntaxError(f"{b.where()}: `{b.words[0]}` is not a plain C file name")
            blocks.append(b)
            last = b
        elif is_output:
            if last is None or last.kind == "c":
                raise SyntaxError(f"{path}:{start + 1}: an `output` block must follow a "
                                  "`python run` or `sh run` block (blank lines between only)")
            last.output = Block(path, start + 1, "output", words[2:], "\n".join(body) + "\n")
            last = None
        else:
            last = None
    return blocks


def output_matches(expected, got):
    """Does got (the block's stdout) match expected line by line? `...` is any run of lines."""
    exp = [line.rstrip() for line in expected.rstrip("\n").split("\n")]
    out = [line.rstrip() for line in got.rstrip("\n").split("\n")] if got.strip() else []

    def match(e, o):
        if e == len(exp):
            return o == len(out)
        if exp[e] == "...":
            return any(match(e + 1, k) for k in range(o, len(out) + 1))
        return o < len(out) and exp[e] == out[o] and match(e + 1, o + 1)

    return match(0, 0)


def listening(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def start_daemon(binary, sock, log):
    env = dict(os.environ)
    env.pop("DLPACKD_SOCKET", None)
    proc = subprocess.Popen([binary, "--socket", sock], stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
    while not listening(sock):
        if proc.poll() is not None:
            raise RuntimeError(f"{binary} exited with status {proc.returncode} before it "
                               f"listened on {sock}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{binary} did not listen on {sock} within "
                               f"{DAEMON_START_TIMEOUT_S} s")
        time.sleep(0.05)
    return proc


def stop_daemon(proc):
    """SIGTERM, as a service manager stops it; a daemon that does not exit 0 is an error."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=DAEMON_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "no exit within %d s of SIGTERM" % DAEMON_START_TIMEOUT_S


def checkout_view(src, build, workdir):
    """Fill workdir with symlinks to src's top-level entries, and `build` -> the build tree."""
    for name in os.listdir(src):
        if name in (".git", "build") or os.path.exists(os.path.join(workdir, name)):
            continue
        os.symlink(os.path.join(src, name), os.path.join(workdir, name))
    if os.path.isdir(build):
        os.symlink(build, os.path.join(workdir, "build"))


def run_block(b, args, workdir, env):
    if b.kind == "c":
        name = b.words[0] if b.words else "example.c"
        target = os.path.join(workdir, name)
        if os.path.islink(target):
            raise SyntaxError(f"{b.where()}: `{name}` would replace the checkout's {name}")
        with open(target, "w", encoding="utf-8") as f:
            f.write(b.text)
        return None
    if b.kind == "python":
        script = os.path.join(workdir, f"block_L{b.line}.py")
        argv = [args.python, os.path.basename(script)]
    else:
        script = os.path.join(workdir, f"block_L{b.line}.sh")
        argv = ["bash", "-euo", "pipefail", os.path.basename(script)]
    with open(script, "w", encoding="utf-8") as f:
        f.write(b.text)
    proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    # what the block left running (a worker it did not join) goes with it
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    problem = None
    if timed_out:
        problem = f"still running after {args.timeout} s (killed)"
    elif proc.returncode != 0:
        problem = f"exit status {proc.returncode}"
    elif b.output is not None and not output_matches(b.output.text, out):
        problem = (f"its stdout differs from the `output` block at {b.output.where()}, "
                   f"which expects:\n{b.output.text.rstrip()}")
    return problem, out, err


def tail(text):
    return text if len(text) <= SHOWN_OUTPUT_MAX else "..." + text[-SHOWN_OUTPUT_MAX:]


def run_file(md, blocks, args):
    """Run one markdown file's blocks in order; the number that failed."""
    failed = 0
    workdir = tempfile.mkdtemp(prefix="dlpc-docs-")
    daemon = log = None
    try:
        if not args.bare:
            checkout_view(args.src, args.build, workdir)
        env = dict(os.environ)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        if args.pythonpath:
            env["PYTHONPATH"] = args.pythonpath
        else:
            env.pop("PYTHONPATH", None)
        if args.dlpackd:
            sock = os.path.join(workdir, "dlpackd.sock")
            log = open(os.path.join(workdir, "dlpackd.log"), "w+")
            daemon = start_daemon(args.dlpackd, sock, log)
            env["DLPACKD_SOCKET"] = sock
        for b in blocks:
            started = time.monotonic()
            result = run_block(b, args, workdir, env)
            if result is None:
                print(f"docs: {b.where()}: c run: wrote {b.words[0] if b.words else 'example.c'}")
                continue
            problem, out, err = result
            took = time.monotonic() - started
            if problem is None:
                print(f"docs: {b.where()}: {b.kind} run: ok ({took:.1f} s)")
                if args.verbose and out:
                    sys.stdout.write(out)
                continue
            failed += 1
            print(f"docs: FAIL {b.where()}: {b.kind} run: {problem}", file=sys.stderr)
            print(f"--- stdout\n{tail(out)}--- stderr\n{tail(err)}---", file=sys.stderr)
    finally:
        if daemon is not None:
            status = stop_daemon(daemon)
            if status != 0:
                failed += 1
                log.seek(0)
                print(f"docs: FAIL {md}: the test's dlpackd ended with {status}; its log:\n"
                      f"{tail(log.read())}", file=sys.stderr)
        if log is not None:
            log.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", required=True, help="the source tree (checkout root)")
    ap.add_argument("--build", help="the build tree (default: SRC/build)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for `python run`")
    ap.add_argument("--pythonpath", help="PYTHONPATH for the blocks (e.g. BUILD/python)")
    d = ap.add_mutually_exclusive_group()
    d.add_argument("--dlpackd", help="start this dlpackd for each markdown file")
    d.add_argument("--no-daemon", action="store_true",
                   help="start none: the blocks find the caller's daemon")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="the kinds of block to run (default: python,c,sh)")
    ap.add_argument("--timeout", type=float, default=BLOCK_TIMEOUT_S)
    ap.add_argument("--bare", action="store_true",
                    help="run the blocks in an empty directory, not a view of the checkout")
    ap.add_argument("--list", action="store_true", help="list the blocks, run nothing")
    ap.add_argument("-v", "--verbose", action="store_true", help="show what passing blocks print")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    args.src = os.path.abspath(args.src)
    args.build = os.path.abspath(args.build or os.path.join(args.src, "build"))
    if args.dlpackd:
        args.dlpackd = os.path.abspath(args.dlpackd)
    elif not args.no_daemon and not args.list:
        ap.error("name the daemon to start (--dlpackd BIN) or say --no-daemon")
    kinds = set(args.kinds.split(","))
    if not kinds <= set(KINDS):
        ap.error(f"--kinds: unknown {sorted(kinds - set(KINDS))}")
    files = args.files or ([os.path.join(args.src, "README.md")]
                           + sorted(glob.glob(os.path.join(args.src, "docs", "*.md"))))

    todo = []
    try:
        for md in files:
            shown = os.path.relpath(md, args.src)
            if shown.startswith(".."):
                shown = md
            blocks = [b for b in parse(md, shown) if b.kind in kinds]
            if blocks:
                todo.append((md, blocks))
    except (OSError, SyntaxError) as e:
        print(f"docs: {e}", file=sys.stderr)
        return 2
    total = sum(len(b) for _, b in todo)
    if args.list:
        for _, blocks in todo:
            for b in blocks:
                print(f"{b.where()}: {b.kind} run {' '.join(b.words)}".rstrip()
                      + (f" (output at line {b.output.line})" if b.output else ""))
        return 0
    if total == 0:
        print(f"docs: no runnable block ({', '.join(sorted(kinds))}) in {', '.join(files)}",
              file=sys.stderr)
        return 2
    failed = 0
    for md, blocks in todo:
        try:
            failed += run_file(blocks[0].path, blocks, args)
        except (OSError, RuntimeError, SyntaxError) as e:
            print(f"docs: FAIL {md}: {e}", file=sys.stderr)
            failed += 1
    print(f"docs: {total - failed if failed <= total else 0} of {total} blocks passed "
          f"in {len(todo)} file(s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
