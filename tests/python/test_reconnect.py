# SPDX-License-Identifier: Apache-2.0
"""A daemon restart under a client: the call that finds the connection closed raises
ConnectionResetError, the next one connects anew (module-level functions, Client(reconnect=True)),
a plain Client keeps raising, and memory attached before the restart stays readable.

Each test runs real dlpackd processes, one after another, on one socket path.
"""
import errno
import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from conftest import _can_connect, _socket_dir, reset_default_client

import dlpack_ipc

# What a call may raise while the daemon is away, and nothing else.
NO_DAEMON = (ConnectionRefusedError, FileNotFoundError)
DOCUMENTED = (ConnectionResetError,) + NO_DAEMON

KILLS = [pytest.param(signal.SIGKILL, id="SIGKILL"), pytest.param(signal.SIGTERM, id="SIGTERM")]


def _accepts_connect(path):
    """Does anything hold a listening socket on path (connect() alone, no HELLO)?"""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
            return True
        except (ConnectionRefusedError, FileNotFoundError):
            return False


class Restarts:
    """dlpackd processes started, stopped and started again on one socket path."""

    def __init__(self, dlpackd_bin, tmp_path):
        sockdir, self._cleanup = _socket_dir(tmp_path)
        self.socket = os.path.join(sockdir, "dlpackd.sock")
        self._bin = dlpackd_bin
        self._dir = tmp_path
        self._n = 0
        self.proc = None
        self.logs = []

    def start(self):
        """Start a dlpackd and return once it accepts."""
        assert self.proc is None, "one daemon at a time"
        self._n += 1
        log = str(self._dir / f"dlpackd.{self._n}.log")
        self.logs.append(log)
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [self._bin, "--socket", self.socket, "--log-level", "debug"],
                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not _can_connect(self.socket):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                pytest.fail(f"dlpackd #{self._n} did not start:\n{self.log_text()}")
            time.sleep(0.01)
        self.proc = proc
        return proc

    def kill(self, sig):
        """Stop the running dlpackd with sig and wait for it."""
        proc, self.proc = self.proc, None
        proc.send_signal(sig)
        rc = proc.wait(timeout=15)
        if sig == signal.SIGTERM:
            assert rc == 0, f"dlpackd exited with {rc} after SIGTERM:\n{self.log_text()}"
            assert not os.path.exists(self.socket), "dlpackd left its socket behind"
        else:
            assert rc == -sig
            # Its closers (dlpackd(8), CLOSING DESCRIPTORS) share its fd table and hold the
            # listening socket until they notice and quit: a connect meanwhile lands in a
            # backlog that nobody accepts, and is reset. Nobody listens once one is refused.
            deadline = time.monotonic() + 10
            while _accepts_connect(self.socket):
                assert time.monotonic() < deadline, "the killed dlpackd's socket still accepts"
                time.sleep(0.01)

    def stat(self):
        """STAT of the running dlpackd, through a connection of its own."""
        with dlpack_ipc.Client(socket=self.socket) as c:
            return c.stat()

    def log_text(self):
        out = []
        for log in self.logs:
            with open(log, "rb") as f:
                out.append(f"--- {log} ---\n" + f.read().decode("utf-8", "replace"))
        return "\n".join(out)

    def close(self):
        problems = []
        if self.proc is not None:
            if self.proc.poll() is not None:
                problems.append(f"dlpackd died during the test with status {self.proc.returncode}")
            else:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    rc = self.proc.wait(timeout=15)
                    if rc != 0:
                        problems.append(f"dlpackd exited with {rc} after SIGTERM")
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    problems.append("dlpackd did not exit within 15s of SIGTERM")
            self.proc = None
        if self._cleanup:
            shutil.rmtree(self._cleanup, ignore_errors=True)
        if problems:
            pytest.fail("; ".join(problems) + "\n" + self.log_text(), pytrace=False)


@pytest.fixture
def restarts(dlpackd_bin, tmp_path, monkeypatch):
    """Restarts on a socket the module's default client uses; no daemon runs yet."""
    r = Restarts(dlpackd_bin, tmp_path)
    monkeypatch.setenv("DLPACKD_SOCKET", r.socket)
    reset_default_client()
    try:
        yield r
    finally:
        reset_default_client()
        gc.collect()
        r.close()


def expect_reset(call):
    """call() must raise the documented error for a connection dlpackd closed."""
    with pytest.raises(ConnectionResetError) as e:
        call()
    assert e.value.errno == errno.ECONNRESET
    assert "dlpackd closed the connection" in str(e.value)


def no_daemon_error(sig):
    # SIGKILL leaves the socket file, which nobody accepts on; SIGTERM removes it
    return ConnectionRefusedError if sig == signal.SIGKILL else FileNotFoundError


def publish_and_attach(api):
    """Publish a persistent and an ephemeral entry through api; attach the first."""
    api.publish("rc/w", np.arange(1000, dtype=np.float64))
    api.publish("rc/eph", np.ones(4), ephemeral=True)
    t = api.attach("rc/w")
    a = np.from_dlpack(t)
    np.testing.assert_array_equal(a, np.arange(1000))
    return t, a


def check_works_on(api, restarts, t, a):
    """api talks to the daemon now running, which holds nothing of the old one; the memory
    attached from the old daemon is still readable and its release reaches nobody."""
    pid = restarts.proc.pid
    assert api.stat()["daemon_pid"] == pid
    assert [e.name for e in api.list("rc/")] == [], "a new daemon starts empty"
    api.publish("rc/w", np.full(8, 7.0))
    np.testing.assert_array_equal(np.from_dlpack(api.attach("rc/w")), np.full(8, 7.0))
    np.testing.assert_array_equal(a, np.arange(1000))
    t.release()
    del a
    gc.collect()
    np.testing.assert_array_equal(np.from_dlpack(api.attach("rc/w")), np.full(8, 7.0))
    deadline = time.monotonic() + 10
    while True:  # releases are fire-and-forget: they settle a little later
        gc.collect()
        st = restarts.stat()
        if st["references"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert st["references"] == 0, st
    assert st["protocol_errors"] == 0, st
    assert st["daemon_pid"] == pid


@pytest.mark.parametrize("sig", KILLS)
def test_module_functions_reconnect_after_restart(restarts, sig):
    """The first call after the restart raises ConnectionResetError, once; the next works."""
    restarts.start()
    t, a = publish_and_attach(dlpack_ipc)
    restarts.kill(sig)
    np.testing.assert_array_equal(a, np.arange(1000))
    restarts.start()
    expect_reset(lambda: dlpack_ipc.publish("rc/x", np.zeros(2)))
    np.testing.assert_array_equal(a, np.arange(1000))
    check_works_on(dlpack_ipc, restarts, t, a)


@pytest.mark.parametrize("sig", KILLS)
def test_reconnect_client_while_no_daemon_listens(restarts, sig):
    """ConnectionResetError, then the reconnect fails while nobody listens and is tried again by
    every call, until a daemon is up."""
    restarts.start()
    c = dlpack_ipc.Client(socket=restarts.socket, reconnect=True)
    t, a = publish_and_attach(c)
    restarts.kill(sig)
    expect_reset(c.stat)
    for _ in range(3):
        with pytest.raises(no_daemon_error(sig)):
            c.list()
    np.testing.assert_array_equal(a, np.arange(1000))
    restarts.start()
    check_works_on(c, restarts, t, a)
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.stat()


def test_module_functions_wait_for_a_first_daemon(restarts):
    """No daemon at first use: the error of a missing socket, then success once one is up."""
    for _ in range(2):
        with pytest.raises(FileNotFoundError):
            dlpack_ipc.stat()
    restarts.start()
    assert dlpack_ipc.stat()["daemon_pid"] == restarts.proc.pid


@pytest.mark.parametrize("sig", KILLS)
def test_plain_client_keeps_raising(restarts, sig):
    """Without reconnect=True the break is reported by every call; a new Client works."""
    restarts.start()
    c = dlpack_ipc.Client(socket=restarts.socket)
    t, a = publish_and_attach(c)
    restarts.kill(sig)
    restarts.start()
    for call in (c.stat, c.list, lambda: c.publish("rc/x", np.zeros(2)),
                 lambda: c.attach("rc/w"), lambda: c.unpublish("rc/w"), c.stat):
        expect_reset(call)
    np.testing.assert_array_equal(a, np.arange(1000))
    with dlpack_ipc.Client(socket=restarts.socket) as fresh:
        check_works_on(fresh, restarts, t, a)
    expect_reset(c.stat)
    c.close()


def test_idle_and_in_flight_calls_see_the_same_error(restarts):
    """A call waiting in the daemon when it dies (on a plain Client), and the next call of an
    idle client, both get ConnectionResetError (one found the socket closed reading, the other
    writing)."""
    restarts.start()
    idle = dlpack_ipc.Client(socket=restarts.socket, reconnect=True)
    idle.stat()
    waiter = dlpack_ipc.Client(socket=restarts.socket)
    got = []

    def wait():
        try:
            waiter.attach("rc/never", timeout=float("inf"))
        except BaseException as e:  # noqa: B036 - reported to the main thread
            got.append(e)

    th = threading.Thread(target=wait)
    th.start()
    wait_for_waiters(restarts, 1)
    restarts.kill(signal.SIGKILL)
    th.join(10)
    assert not th.is_alive()
    [e] = got
    assert isinstance(e, ConnectionResetError) and e.errno == errno.ECONNRESET, repr(e)
    expect_reset(idle.stat)
    restarts.start()
    assert idle.stat()["daemon_pid"] == restarts.proc.pid
    assert idle.reconnects == 1
    idle.close()
    waiter.close()


def wait_for_waiters(restarts, n):
    """Until the daemon counts n waiting attaches."""
    deadline = time.monotonic() + 10
    while restarts.stat()["waiters"] != n:
        assert time.monotonic() < deadline, "the attaches did not wait"
        time.sleep(0.01)


@pytest.mark.parametrize("timeout", [float("inf"), 30.0], ids=["forever", "bounded"])
def test_waiting_attach_survives_a_restart(restarts, timeout):
    """With reconnect=True an attach waiting for a name rides through a daemon restart: it
    connects again, waits again, and completes when the name is published on the new daemon;
    memory attached before stays readable and the client counts one reconnect."""
    restarts.start()
    c = dlpack_ipc.Client(socket=restarts.socket, reconnect=True)
    t, a = publish_and_attach(c)
    got = []

    def wait():
        try:
            got.append(np.from_dlpack(c.attach("rc/later", timeout=timeout)).copy())
        except BaseException as e:  # noqa: B036 - reported to the main thread
            got.append(e)

    th = threading.Thread(target=wait)
    th.start()
    wait_for_waiters(restarts, 1)
    restarts.kill(signal.SIGKILL)
    time.sleep(0.3)  # no daemon for a while: the wait goes on
    assert th.is_alive(), got
    restarts.start()
    wait_for_waiters(restarts, 1)
    with dlpack_ipc.Client(socket=restarts.socket) as p:
        p.publish("rc/later", np.arange(5, dtype=np.int32))
    th.join(10)
    assert not th.is_alive()
    [r] = got
    np.testing.assert_array_equal(r, np.arange(5, dtype=np.int32))
    assert c.reconnects == 1
    np.testing.assert_array_equal(a, np.arange(1000))
    c.close()


def test_signal_handler_calling_another_client_while_an_attach_waits(restarts):
    """A signal handler that calls another client, on its second connection, while an attach
    waits on this one: the tensor the attach returns still belongs to this client's connection,
    so its release reaches the daemon (it used to be dropped as one of a replaced connection)."""
    restarts.start()
    other = dlpack_ipc.Client(socket=restarts.socket, reconnect=True)
    other.stat()
    restarts.kill(signal.SIGKILL)
    restarts.start()
    expect_reset(other.stat)
    other.stat()
    assert other.reconnects == 1
    c = dlpack_ipc.Client(socket=restarts.socket, reconnect=True)
    calls = []

    def handler(signum, frame):
        calls.append(other.stat()["daemon_pid"])

    def poke_then_publish():
        wait_for_waiters(restarts, 1)
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs in the waiting thread
            time.sleep(0.05)
        with dlpack_ipc.Client(socket=restarts.socket) as p:
            p.publish("rc/nested", np.arange(6, dtype=np.int32))

    old = signal.signal(signal.SIGUSR1, handler)
    th = threading.Thread(target=poke_then_publish)
    try:
        th.start()
        t = c.attach("rc/nested", timeout=30.0)
    finally:
        th.join(15)
        signal.signal(signal.SIGUSR1, old)
    assert calls == [restarts.proc.pid] * len(calls) and calls, calls
    a = np.from_dlpack(t)
    np.testing.assert_array_equal(a, np.arange(6, dtype=np.int32))
    del a
    t.release()
    deadline = time.monotonic() + 10
    while True:  # releases are fire-and-forget: they settle a little later
        gc.collect()
        st = restarts.stat()
        if st["references"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert st["references"] == 0, st
    c.close()
    other.close()


def test_empty_memory_outlives_the_connection(restarts):
    """empty() memory from before the restart is this process's: it publishes after it."""
    restarts.start()
    e = dlpack_ipc.empty((16,), "float32")
    np.asarray(e)[:] = 3.0  # (numpy 1.x makes from_dlpack arrays read-only)
    restarts.kill(signal.SIGKILL)
    restarts.start()
    expect_reset(dlpack_ipc.stat)
    dlpack_ipc.publish("rc/e", e)
    np.testing.assert_array_equal(np.from_dlpack(dlpack_ipc.attach("rc/e")), np.full(16, 3.0))


def test_old_connections_are_closed(restarts):
    """After the reconnect, and the release of what was attached through it, the old
    connection's socket is closed: one socket per reconnect is not left behind."""
    def fds():
        gc.collect()
        out = []
        for f in os.listdir("/proc/self/fd"):
            try:
                # the new connection's socket has another inode than the first one's
                out.append(os.readlink(f"/proc/self/fd/{f}").split(":")[0])
            except OSError:  # listdir's own
                pass
        # libdlpc's fds of the process, made once and not per connection: its /proc/self/pagemap
        # (opened at its first copy-on-write cleaning, kept while a client lives: dlpc(3)) and
        # its thread's eventfd (made the first time that thread polls a socket, here for the
        # cache's idle entries); run alone, this test sees them made during its loop
        once = [f for f in out if f.endswith("/pagemap") or f.startswith("anon_inode")]
        return sorted(f for f in out if f not in once), once

    restarts.start()
    dlpack_ipc.stat()
    base, base_once = fds()
    for _ in range(3):
        t, a = publish_and_attach(dlpack_ipc)
        restarts.kill(signal.SIGKILL)
        restarts.start()
        expect_reset(dlpack_ipc.stat)
        check_works_on(dlpack_ipc, restarts, t, a)
        dlpack_ipc.unpublish("rc/w")
        del t, a  # the array held the old connection (its release would go there)
    now, now_once = fds()
    assert now == base, f"{now} != {base}"
    # at most the two made once (the client's own eventfd was in base_once already)
    assert 0 <= len(now_once) - len(base_once) <= 2, (now_once, base_once)
    assert restarts.stat()["connections"] == 2  # the default client's and STAT's own


HAMMER = """
    import json, os, threading, time
    import dlpack_ipc

    stop = STOP
    c = dlpack_ipc.Client(reconnect=True)
    seen = {"errors": {}, "pids": [], "calls": 0}
    lock = threading.Lock()

    def note(key):
        with lock:
            seen["errors"][key] = seen["errors"].get(key, 0) + 1

    def hammer(call):
        while not os.path.exists(stop):
            try:
                pid = call()["daemon_pid"]
                with lock:
                    seen["calls"] += 1
                    if not seen["pids"] or seen["pids"][-1] != pid:
                        seen["pids"].append(pid)
            except OSError as e:
                note(f"{type(e).__name__}:{e.errno}")
                time.sleep(0.001)
            except Exception as e:
                note(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=hammer, args=(f,))
               for f in (dlpack_ipc.stat, dlpack_ipc.stat, c.stat, c.stat)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(seen))
"""


def test_threads_hammering_through_restarts(restarts, py, tmp_path):
    """Threads calling stat() through restarts (SIGKILL, then SIGTERM with a pause while nobody
    listens) see only the documented errors, no crash, and end on the last daemon."""
    stop = str(tmp_path / "stop")
    restarts.start()
    pids = [restarts.proc.pid]
    child = py.popen(HAMMER.replace("STOP", repr(stop)), env={"DLPACKD_SOCKET": restarts.socket})
    try:
        time.sleep(0.3)
        for sig, pause in ((signal.SIGKILL, 0), (signal.SIGTERM, 0.3), (signal.SIGKILL, 0.3)):
            restarts.kill(sig)
            time.sleep(pause)
            pids.append(restarts.start().pid)
            time.sleep(0.3)
        open(stop, "w").close()
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, f"hammering interpreter failed ({child.returncode}):\n{err}"
    seen = json.loads(out)
    allowed = {"ConnectionResetError:104", "ConnectionRefusedError:111", "FileNotFoundError:2"}
    assert set(seen["errors"]) <= allowed, seen
    assert "ConnectionResetError:104" in seen["errors"], seen
    assert seen["pids"][-1] == pids[-1], (seen, pids)
    assert set(seen["pids"]) <= set(pids), (seen, pids)
