# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the dlpack_ipc suite: a private dlpackd per test and helpers for other interpreters.

Environment (CTest sets both):
  DLPACKD_BIN  the daemon binary (<build>/dlpackd); required
  PYTHONPATH   must make `import dlpack_ipc` work (<build>/python), unless the interpreter has
               it installed (tests/pystack.sh: a venv where pip installed the project, and
               DLPC_TEST_PIP_INSTALLED=1)
"""
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

# A Unix socket path must fit in sun_path (108 bytes with the NUL).
_SUN_PATH_MAX = 100


def _dlpackd_bin():
    path = os.environ.get("DLPACKD_BIN")
    if not path:
        pytest.fail(
            "DLPACKD_BIN is not set: point it at the dlpackd binary, e.g. "
            "DLPACKD_BIN=build/dlpackd PYTHONPATH=build/python python3 -m pytest tests/python",
            pytrace=False,
        )
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"DLPACKD_BIN={path!r} is not an executable file", pytrace=False)
    return os.path.abspath(path)


def _import_module():
    try:
        import dlpack_ipc  # noqa: F401
    except ImportError as e:
        pytest.fail(
            f"cannot import dlpack_ipc ({e}); PYTHONPATH={os.environ.get('PYTHONPATH')!r} "
            "must name the build's python/ directory",
            pytrace=False,
        )
    return dlpack_ipc


def reset_default_client():
    """Drop the module's lazily created default client, if the module allows it."""
    mod = sys.modules.get("dlpack_ipc")
    if mod is not None and hasattr(mod, "_reset_default"):
        mod._reset_default()


def _can_connect(path):
    """Does a dlpackd answer HELLO on path? A connect alone is not enough: the listening socket
    of a daemon just killed stays open for a moment in its closer processes (dlpackd(8), CLOSING
    DESCRIPTORS), and takes connections that are then reset."""
    import dlpack_ipc
    try:
        dlpack_ipc.Client(socket=path).close()
        return True
    except OSError:
        return False


class Daemon:
    """A running dlpackd owned by one test."""

    def __init__(self, proc, sock, log):
        self.proc = proc
        self.socket = sock
        self.log = log

    @property
    def pid(self):
        return self.proc.pid

    def log_text(self):
        try:
            with open(self.log, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"<cannot read {self.log}: {e}>"

    def stat(self):
        """STAT through a fresh connection of its own."""
        import dlpack_ipc

        c = dlpack_ipc.Client(socket=self.socket)
        try:
            return c.stat()
        finally:
            c.close()

    def wait_stat(self, pred, timeout=10.0, what="condition"):
        """Poll STAT until pred(stat) holds; return that stat, fail with the last one otherwise.

        Releases are fire-and-forget, so counters settle a little after the Python side acts.
        """
        deadline = time.monotonic() + timeout
        while True:
            gc.collect()
            st = self.stat()
            if pred(st):
                return st
            if time.monotonic() > deadline:
                pytest.fail(f"dlpackd STAT never satisfied {what} within {timeout}s; last: {st}")
            time.sleep(0.02)


def _socket_dir(tmp_path, for_others=False):
    # pytest's temp tree is 0700: a socket other users must reach lives in a dir of its own
    if not for_others and len(str(tmp_path / "dlpackd.sock.lock")) <= _SUN_PATH_MAX:
        return str(tmp_path), None
    d = tempfile.mkdtemp(prefix="dlpc-", dir="/tmp")
    if for_others:
        os.chmod(d, 0o755)
    return d, d


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "dlpackd_args(*args): extra command-line arguments for the test's dlpackd"
    )
    config.addinivalue_line(
        "markers", "dlpackd_for_others: other uids may connect (socket 0666 in a 0755 dir)"
    )
    config.addinivalue_line(
        "markers", "client_cache: libdlpc's cache of idle references stays on (DLPC_CACHE_*)"
    )


@pytest.fixture(scope="session")
def dlpackd_bin():
    return _dlpackd_bin()


@pytest.fixture
def daemon(request, tmp_path, monkeypatch, dlpackd_bin):
    """Start `dlpackd --socket <tmp>/dlpackd.sock --log-level debug` and point clients at it.

    A test marked `@pytest.mark.dlpackd_args("--flag", "value", ...)` passes those arguments too;
    one marked `@pytest.mark.dlpackd_for_others` gets a socket that every uid can connect to.
    """
    _import_module()
    for_others = request.node.get_closest_marker("dlpackd_for_others") is not None
    sockdir, cleanup = _socket_dir(tmp_path, for_others)
    sock = os.path.join(sockdir, "dlpackd.sock")
    log = str(tmp_path / "dlpackd.log")
    marker = request.node.get_closest_marker("dlpackd_args")
    extra = [str(a) for a in marker.args] if marker else []
    if for_others:
        extra += ["--socket-mode", "0666"]
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            [dlpackd_bin, "--socket", sock, "--log-level", "debug", *extra],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
    d = Daemon(proc, sock, log)
    request.node._dlpackd = d

    deadline = time.monotonic() + 15
    while not _can_connect(sock):
        if proc.poll() is not None:
            pytest.fail(f"dlpackd exited with {proc.returncode} before listening:\n{d.log_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"dlpackd did not accept on {sock} within 15s:\n{d.log_text()}")
        time.sleep(0.01)

    monkeypatch.setenv("DLPACKD_SOCKET", sock)
    # the tests count references as the daemon sees them: without libdlpc's cache of idle
    # references (a re-attach would share one) unless marked client_cache (test_cache.py)
    if request.node.get_closest_marker("client_cache") is None:
        monkeypatch.setenv("DLPC_CACHE_ENTRIES", "0")
    else:
        monkeypatch.delenv("DLPC_CACHE_ENTRIES", raising=False)
    reset_default_client()
    try:
        yield d
    finally:
        reset_default_client()
        gc.collect()
        problems = []
        if proc.poll() is not None:
            problems.append(f"dlpackd died during the test with status {proc.returncode}")
        else:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = None
                problems.append("dlpackd did not exit within 15s of SIGTERM")
            if rc is not None and rc != 0:
                problems.append(f"dlpackd exited with status {rc} after SIGTERM, expected 0")
        if os.path.exists(sock):
            problems.append(f"dlpackd left its socket {sock} behind")
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
        if problems:
            pytest.fail("; ".join(problems) + "\n--- dlpackd log ---\n" + d.log_text(), pytrace=False)


@pytest.fixture
def ipc(daemon):
    """What the tests call publish/attach/... on: the module itself when its default client can be
    reset between daemons, else an explicit Client bound to this test's daemon."""
    import dlpack_ipc

    if hasattr(dlpack_ipc, "_reset_default"):
        yield dlpack_ipc
    else:
        c = dlpack_ipc.Client(socket=daemon.socket)
        try:
            yield c
        finally:
            c.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the daemon's log to the report of a failed test."""
    outcome = yield
    rep = outcome.get_result()
    d = getattr(item, "_dlpackd", None)
    if d is not None and rep.failed:
        text = d.log_text()
        if len(text) > 20000:
            text = "...\n" + text[-20000:]
        rep.sections.append((f"dlpackd log ({rep.when})", text))


# ---- other interpreters -------------------------------------------------------------------


def _child_env(env=None):
    e = dict(os.environ)
    e.setdefault("PYTHONPATH", "")
    # the child must import the same dlpack_ipc we do, whatever its cwd
    paths = [p for p in e["PYTHONPATH"].split(os.pathsep) if p]
    e["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in paths)
    e.pop("PYTHONFAULTHANDLER", None)
    if env:
        for k, v in env.items():
            if v is None:
                e.pop(k, None)
            else:
                e[k] = v
    return e


def run_py(code, env=None, timeout=60):
    """Run `sys.executable -c code` with DLPACKD_SOCKET and PYTHONPATH passed on."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_child_env(env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def popen_py(code, env=None, **kw):
    """Start `sys.executable -c code` without waiting (stdout/stderr piped, text)."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_child_env(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def describe(cp):
    return f"exit status {cp.returncode}\n--- stdout ---\n{cp.stdout}\n--- stderr ---\n{cp.stderr}"


def assert_py_ok(cp):
    assert cp.returncode == 0, "child interpreter failed: " + describe(cp)
    return cp


def check_py(code, env=None, timeout=60):
    """run_py() that must exit 0; returns the CompletedProcess."""
    return assert_py_ok(run_py(code, env=env, timeout=timeout))


class Py:
    run = staticmethod(run_py)
    popen = staticmethod(popen_py)
    check = staticmethod(check_py)
    assert_ok = staticmethod(assert_py_ok)
    describe = staticmethod(describe)


@pytest.fixture
def py():
    """Helpers for other interpreters: py.run(code), py.check(code), py.popen(code), ..."""
    return Py


@pytest.fixture(name="run_py")
def _run_py_fixture():
    return run_py


@pytest.fixture(name="check_py")
def _check_py_fixture():
    return check_py
