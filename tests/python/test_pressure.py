# SPDX-License-Identifier: Apache-2.0
"""Python clients under pressure: Ctrl-C against a daemon that does not answer, Client.close()
waking a thread blocked in a call, and a process out of file descriptors."""
import errno
import signal
import threading
import time

import numpy as np
import pytest

import dlpack_ipc

CALLS = {
    "stat": "dlpack_ipc.stat()",
    "attach": "dlpack_ipc.attach('x')",
    "publish": "dlpack_ipc.publish('y', np.zeros(4))",
    "attach-forever": "dlpack_ipc.attach('never', timeout=float('inf'))",
    "connect": "dlpack_ipc.Client()",
}


# The start of every child: SIGUSR2 blocked before any thread starts (so that every thread
# inherits that), and the module imported.
CHILD_START = """
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
import numpy as np
import dlpack_ipc
"""
# ...then, once ready, it waits for SIGUSR2 (sent when the daemon is stopped) and makes its call.
CHILD_READY = """
print("ready", flush=True)
signal.sigwait({signal.SIGUSR2})
"""


def _start_blocked(py, body, connect=True, setup=""):
    """A child that runs `setup`, connects (unless not `connect`), and makes the call in `body`
    against a daemon stopped meanwhile."""
    code = CHILD_START + setup + ("dlpack_ipc.stat()\n" if connect else "") + CHILD_READY + body
    return py.popen(code, env={"DLPC_CALL_TIMEOUT_MS": "0"})


def _signal_in_call(daemon, p, sig):
    """Stop the daemon, let `p` start its call, and send `sig` to it half a second in."""
    assert p.stdout.readline().strip() == "ready", p.communicate()
    daemon.proc.send_signal(signal.SIGSTOP)
    p.send_signal(signal.SIGUSR2)
    time.sleep(0.5)  # the child is in its call, which the daemon will not answer
    p.send_signal(sig)


def _finish(p, timeout=10):
    """The child's output once it exits (killed if it does not within `timeout` s)."""
    try:
        return p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.mark.parametrize("call", list(CALLS))
def test_ctrl_c_against_a_stopped_daemon(ipc, daemon, py, call):
    ipc.publish("x", np.arange(4.0))
    p = _start_blocked(py, f"""
try:
    {CALLS[call]}
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    sys.exit(42)
print("returned", flush=True)
""", connect=call != "connect")
    try:
        _signal_in_call(daemon, p, signal.SIGINT)
        sent = time.monotonic()
        out, err = _finish(p)
        elapsed = time.monotonic() - sent
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        _finish(p, 0)
    assert p.returncode == 42, f"status {p.returncode}\n{out}\n{err}"
    assert out.split() == ["KeyboardInterrupt"]
    # a check every DLPC_INTERRUPT_CHECK_MS (200 ms) at worst; generous for a loaded machine
    assert elapsed < 3, f"the interrupt took {elapsed:.1f}s"
    # the daemon, running again, is none the worse
    assert ipc.stat()["daemon_pid"] == daemon.pid


def test_ctrl_c_behind_another_threads_stuck_write(ipc, daemon, py):
    """A call waiting to write its request behind another thread's request that a stopped
    daemon does not read (a bundle larger than the socket's buffer, no call timeout) is ended by
    Ctrl-C: nothing of it was sent, and the client is not broken by it."""
    ipc.publish("x", np.arange(4.0))
    p = _start_blocked(py, """
import os, platform, threading, time
# sendmsg, poll and ppoll: what a thread waiting to write is in (/proc's view of its call)
WRITING = {"x86_64": (46, 7, 271), "aarch64": (211, 73)}[platform.machine()]
def writing(tid):
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            return int(f.read().split()[0]) in WRITING
    except (OSError, ValueError):
        return False
big = {f"k{i:06d}" + "x" * 200: np.zeros(1, dtype=np.uint8) for i in range(8000)}
t = threading.Thread(target=dlpack_ipc.publish_dict, args=("big", big), daemon=True)
t.start()
end = time.monotonic() + 30
while not (t.native_id and writing(t.native_id)) and time.monotonic() < end:
    time.sleep(0.01)            # (it copies, then waits to write)
print("writing" if writing(t.native_id) else "not writing", flush=True)
try:
    dlpack_ipc.attach("x")
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    os._exit(42)                # (the stuck thread waits for as long as the daemon is stopped)
print("returned", flush=True)
os._exit(0)
""")
    try:
        assert p.stdout.readline().strip() == "ready", p.communicate()
        daemon.proc.send_signal(signal.SIGSTOP)
        p.send_signal(signal.SIGUSR2)
        assert p.stdout.readline().strip() == "writing", p.communicate()
        time.sleep(0.5)         # the attach waits behind the stuck publish
        assert p.poll() is None
        p.send_signal(signal.SIGINT)
        # (without the interrupt the call waits for as long as the daemon is stopped, and
        # _finish() kills the child after its 10 s)
        out, err = _finish(p)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        _finish(p, 0)
    assert p.returncode == 42, f"status {p.returncode}\n{out}\n{err}"
    assert out.split() == ["KeyboardInterrupt"]
    assert ipc.stat()["daemon_pid"] == daemon.pid


def test_signal_handler_that_does_not_raise_lets_the_call_finish(daemon, py):
    """As for system calls (PEP 475): a handler that returns lets the call go on waiting."""
    p = _start_blocked(py, """
st = dlpack_ipc.stat()
print("stat", len(hits), st["daemon_pid"], flush=True)
""", setup="""
hits = []
signal.signal(signal.SIGUSR1, lambda *a: hits.append(1))
""")
    try:
        _signal_in_call(daemon, p, signal.SIGUSR1)
        time.sleep(0.5)
        assert p.poll() is None, p.communicate()
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    out, err = _finish(p)
    assert p.returncode == 0, f"status {p.returncode}\n{out}\n{err}"
    assert out.split() == ["stat", "1", str(daemon.pid)]


def test_signal_handler_that_calls_the_library(daemon, py):
    """A handler may use the same client while the call it interrupted waits: the waiting
    thread gives up its turn to read before the handler runs."""
    p = _start_blocked(py, """
st = dlpack_ipc.stat()
print("stat", seen == [st["daemon_pid"]], flush=True)
""", setup="""
seen = []
signal.signal(signal.SIGUSR1, lambda *a: seen.append(dlpack_ipc.stat()["daemon_pid"]))
""")
    try:
        _signal_in_call(daemon, p, signal.SIGUSR1)
        time.sleep(0.5)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    out, err = _finish(p)
    assert p.returncode == 0, f"status {p.returncode}\n{out}\n{err}"
    assert out.split() == ["stat", "True"]


def test_handler_that_raises_after_the_reply_came(ipc, daemon, py):
    """A handler that lets the daemon answer, reads the reply with a call of its own, then
    raises: its exception is what the interrupted attach raises (not a SystemError for a result
    with an exception set), and the reference the reply granted goes back."""
    ipc.publish("x", np.arange(4.0))
    p = _start_blocked(py, """
try:
    dlpack_ipc.attach("x")
except KeyboardInterrupt:
    print("KeyboardInterrupt", dlpack_ipc.stat()["daemon_pid"], flush=True)
    sys.exit(42)
print("returned", flush=True)
""", setup=f"""
import os
def resume_then_raise(*a):
    os.kill({daemon.pid}, signal.SIGCONT)
    dlpack_ipc.stat()
    raise KeyboardInterrupt
signal.signal(signal.SIGUSR1, resume_then_raise)
""")
    try:
        _signal_in_call(daemon, p, signal.SIGUSR1)
        out, err = _finish(p)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        _finish(p, 0)
    assert p.returncode == 42, f"status {p.returncode}\n{out}\n{err}"
    assert out.split() == ["KeyboardInterrupt", str(daemon.pid)]
    daemon.wait_stat(lambda s: s["references"] == 0, what="the attach's reference given back")


def test_ctrl_c_in_a_child_forked_from_a_thread(daemon, py):
    """The thread that forks is the child's main thread, where its signal handlers run: Ctrl-C
    interrupts a call there as anywhere else (connecting anew, against a stopped daemon)."""
    p = _start_blocked(py, """
import os, threading
status = []
def work():
    pid = os.fork()
    if pid == 0:
        # bounded, should the interrupt not work: the test fails rather than hangs
        os.environ["DLPC_CALL_TIMEOUT_MS"] = "5000"
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            dlpack_ipc.stat()
        except KeyboardInterrupt:
            os._exit(42)
        except BaseException:
            os._exit(1)
        os._exit(1)
    status.append(os.waitpid(pid, 0)[1])
t = threading.Thread(target=work)
t.start()
t.join(10)
print("child", os.waitstatus_to_exitcode(status[0]) if status else "hung", flush=True)
""")
    try:
        assert p.stdout.readline().strip() == "ready", p.communicate()
        daemon.proc.send_signal(signal.SIGSTOP)
        p.send_signal(signal.SIGUSR2)
        out, err = _finish(p, timeout=20)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
        _finish(p, 0)
    assert out.split() == ["child", "42"], f"{out}\n{err}"


def test_close_wakes_a_thread_waiting_forever(daemon):
    c = dlpack_ipc.Client(socket=daemon.socket)
    got = []

    def wait():
        try:
            c.attach("never/published", timeout=float("inf"))
        except BaseException as e:  # what it raises is the point
            got.append(e)

    t = threading.Thread(target=wait)
    t.start()
    daemon.wait_stat(lambda s: s["waiters"] == 1, what="the thread's wait")
    c.close()
    t.join(timeout=10)
    assert not t.is_alive(), "Client.close() left the thread waiting"
    assert len(got) == 1 and isinstance(got[0], OSError), got
    assert got[0].errno == errno.ECANCELED, got[0]
    assert "(Client.close())" in str(got[0]) and "dlpc_" not in str(got[0]), got[0]
    # (the STAT's own connection is the one left)
    daemon.wait_stat(lambda s: s["waiters"] == 0 and s["connections"] == 1,
                     what="the wait and the connection gone")


def test_attach_out_of_fds_is_emfile(ipc, daemon, py):
    ipc.publish("fd/x", np.arange(4.0))
    py.check("""
import errno, os, resource
import numpy as np
import dlpack_ipc
c = dlpack_ipc.Client()
c.stat()
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
spare = []
try:
    while True:
        spare.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    assert e.errno == errno.EMFILE
try:
    c.attach("fd/x")
    raise SystemExit("attach succeeded without a free fd")
except OSError as e:
    assert e.errno == errno.EMFILE, e
    assert "RLIMIT_NOFILE" in str(e), e
# the connection is fine: with an fd free the same client attaches
os.close(spare.pop())
t = c.attach("fd/x")
assert np.from_dlpack(t).tolist() == [0.0, 1.0, 2.0, 3.0]
""")
    daemon.wait_stat(lambda s: s["references"] == 0, what="references back to none")
