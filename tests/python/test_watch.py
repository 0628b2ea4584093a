# SPDX-License-Identifier: Apache-2.0
"""dlpack_ipc.watch(): events of changes made by other interpreters, timeouts, Ctrl-C, close."""
import os
import select
import signal
import threading
import time

import numpy as np
import pytest

import dlpack_ipc


def test_events_of_another_process_in_order(ipc, py):
    with dlpack_ipc.watch("w/") as w:
        cp = py.check("""
            import os, numpy as np, dlpack_ipc
            print(os.getpid())
            dlpack_ipc.publish("w/a", np.zeros((2, 3), np.float32))
            dlpack_ipc.publish("other", np.zeros(1))
            dlpack_ipc.publish("w/a", np.arange(4), replace=True)
            dlpack_ipc.unpublish("w/a")
            dlpack_ipc.publish_dict("w/b", {"x": np.ones(2), "y": np.ones(3)})
            dlpack_ipc.publish_dict("w/c", {"x": np.ones(2)})
            dlpack_ipc.publish("w/e", np.ones(1), ephemeral=True)
        """)
        pid = int(cp.stdout.split()[0])
        evs = [w.next_event(timeout=10) for _ in range(7)]
        assert w.next_event(timeout=0) is None
    assert all(e is not None for e in evs), evs
    assert [(e.kind, e.name, e.generation) for e in evs] == [
        ("published", "w/a", 1),
        ("replaced", "w/a", 2),
        ("unpublished", "w/a", 2),
        ("published", "w/b", 1),
        ("published", "w/c", 1),
        ("published", "w/e", 1),
        ("unpublished", "w/e", 1),
    ]
    a, rep, unp, b, c, e, gone = evs
    assert (a.dtype, a.shape, a.ntensors, a.nbytes) == ("float32", (2, 3), 1, 24)
    assert a.owner.pid == pid and a.actor.pid == pid
    assert rep.previous_generation == 1 and rep.dtype == "int64" and rep.shape == (4,)
    assert unp.reason == "request" and unp.actor.pid == pid
    assert (b.dtype, b.shape, b.ntensors) == (None, None, 2)
    assert (c.dtype, c.shape, c.ntensors) == (None, None, 1)  # a dict of one is a bundle too
    assert gone.reason == "disconnect"
    assert a.reason is None and rep.reason is None
    seqs = [x.seq for x in evs]
    assert seqs == sorted(seqs) and seqs[1] == seqs[0] + 2  # "other" is outside the prefix
    assert isinstance(a, dlpack_ipc.WatchEvent)


def test_timeout_fileno_and_close(ipc):
    w = dlpack_ipc.watch()
    assert w.next_event(timeout=0) is None
    assert w.next_event(timeout=0.05) is None
    assert select.select([w.fileno()], [], [], 0)[0] == []
    ipc.publish("p", np.ones(1))
    assert select.select([w.fileno()], [], [], 10)[0] == [w.fileno()]
    ev = next(w)
    assert (ev.kind, ev.name) == ("published", "p")
    w.close()
    assert w.closed
    assert list(w) == []  # a closed watch ends iteration
    with pytest.raises(ValueError):
        w.next_event(timeout=0)
    with pytest.raises(ValueError):
        w.next_event(timeout=-1)
    with pytest.raises(ValueError):
        dlpack_ipc.watch("x" * (dlpack_ipc.NAME_MAX + 1))


def test_select_then_drain_gets_events_read_together(ipc):
    """Two events may come in one read: after select() says readable, drain() takes both."""
    with dlpack_ipc.watch("sel/") as w:
        ipc.publish("sel/1", np.ones(1))
        ipc.publish("sel/2", np.ones(1))
        time.sleep(0.1)  # both are most likely in the socket now, and come in one read
        got, deadline = [], time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            if select.select([w.fileno()], [], [], 1)[0]:
                got += w.drain()
        assert [ev.name for ev in got] == ["sel/1", "sel/2"]
        assert w.drain() == []


def test_watch_on_explicit_socket_and_stat(daemon):
    with dlpack_ipc.Watch("", socket=daemon.socket) as w:
        st = daemon.stat()
        assert st["watchers"] == 1 and st["req_watch"] == 1
        assert not w.closed
    daemon.wait_stat(lambda s: s["watchers"] == 0, what="watchers == 0")


def test_close_from_another_thread_ends_iteration(ipc):
    w = dlpack_ipc.watch()
    got, started = [], threading.Event()

    def reader():
        started.set()
        got.extend(w)

    t = threading.Thread(target=reader)
    t.start()
    started.wait()
    time.sleep(0.2)  # most likely inside the wait by now; either way the iteration must end
    w.close()
    t.join(timeout=30)
    assert not t.is_alive()
    assert got == [] and w.closed


def test_ctrl_c_interrupts_a_waiting_watch(daemon, py):
    p = py.popen("""
        import sys, dlpack_ipc
        w = dlpack_ipc.watch()
        print("ready", flush=True)
        try:
            for ev in w:
                print("event", ev, flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(0)
    """)
    try:
        assert p.stdout.readline().strip() == "ready"
        daemon.wait_stat(lambda s: s["watchers"] == 1, what="watchers == 1")
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert out.strip() == "interrupted"


def test_a_signal_handler_that_returns_lets_the_watch_wait_on(daemon, py):
    """A signal whose handler does not raise runs its handler during the wait (libdlpc's
    interrupt check), and the same wait goes on to deliver the next event."""
    p = py.popen("""
        import signal, dlpack_ipc
        signal.signal(signal.SIGUSR1, lambda *a: print("handled", flush=True))
        w = dlpack_ipc.watch("sig/")
        print("ready", flush=True)
        ev = w.next_event(timeout=None)
        print("event", ev.name, flush=True)
    """)
    try:
        assert p.stdout.readline().strip() == "ready"
        daemon.wait_stat(lambda s: s["watchers"] == 1, what="watchers == 1")
        os.kill(p.pid, signal.SIGUSR1)
        assert p.stdout.readline().strip() == "handled"
        with dlpack_ipc.Client(socket=daemon.socket) as c:
            c.publish("sig/after", np.ones(1))
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert out.strip() == "event sig/after"


@pytest.mark.parametrize("timeout", [None, float("inf")])
def test_next_event_waits_as_long_as_it_takes(ipc, daemon, py, timeout):
    """timeout=None and float("inf") wait for the next event, as attach() and recv() do; a
    negative timeout is refused before anything is read."""
    got = {}
    with dlpack_ipc.watch("forever/") as w:
        with pytest.raises(ValueError, match="timeout"):
            w.next_event(timeout=-0.5)

        def wait():
            try:
                got["ev"] = w.next_event(timeout)
            except BaseException as e:  # reported by the main thread
                got["err"] = e

        th = threading.Thread(target=wait, daemon=True)
        th.start()
        py.check("""
            import numpy as np, dlpack_ipc
            dlpack_ipc.publish("forever/x", np.ones(1))
        """)
        th.join(timeout=60)
        assert not th.is_alive() and "err" not in got, got
        assert (got["ev"].kind, got["ev"].name) == ("published", "forever/x")
