# SPDX-License-Identifier: Apache-2.0
"""multiprocessing (fork and spawn) workers, and attach (and receive) waiting as one request."""
import multiprocessing
import signal
import threading
import time
import traceback

import numpy as np
import pytest
import torch

import dlpack_ipc


def _worker(name_in, name_out, q):
    """Attach the parent's tensor with the module's default client, publish a result."""
    try:
        t = dlpack_ipc.attach(name_in, timeout=10)
        x = torch.from_dlpack(t)
        out = (x * 2).to(torch.float64)
        gen = dlpack_ipc.publish(name_out, out)
        q.put(("ok", float(x.sum().item()), gen, tuple(t.shape)))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def _run_worker(ctx, args):
    q = ctx.Queue()
    p = ctx.Process(target=_worker, args=args + (q,))
    p.start()
    try:
        res = q.get(timeout=120)
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            p.join()
    assert res[0] == "ok", f"worker failed:\n{res[1]}"
    assert p.exitcode == 0
    return res[1:]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multiprocessing_worker_attaches_and_publishes(ipc, daemon, method):
    ctx = multiprocessing.get_context(method)
    src = np.arange(24, dtype=np.float32).reshape(4, 6)
    # the parent uses the module's default client (and holds a tensor) before forking
    assert dlpack_ipc.publish(f"mp/{method}/in", src) == 1
    mine = dlpack_ipc.attach(f"mp/{method}/in")
    mine_arr = np.from_dlpack(mine)
    s0 = daemon.stat()
    total, gen, shape = _run_worker(ctx, (f"mp/{method}/in", f"mp/{method}/out"))
    assert total == float(src.sum()) and gen == 1 and shape == (4, 6)
    t = dlpack_ipc.attach(f"mp/{method}/out")
    assert t.dtype == "float64" and t.shape == (4, 6)
    np.testing.assert_array_equal(np.from_dlpack(t), src.astype(np.float64) * 2)
    out = [e for e in dlpack_ipc.list("mp/") if e.name == f"mp/{method}/out"]
    assert out and out[0].owner.pid not in (0, __import__("os").getpid()), \
        "the child published on a connection of its own"
    # the parent's connection and its tensors survived the child
    np.testing.assert_array_equal(mine_arr, src)
    daemon.wait_stat(lambda s: s["references"] == s0["references"] + 1,
                     what="only the parent's two references left")
    assert np.from_dlpack(dlpack_ipc.attach(f"mp/{method}/in")).sum() == src.sum()


def _publisher(name, q):
    try:
        q.put(("ok", dlpack_ipc.publish(name, np.full(3, 5, dtype=np.int8))))
    except BaseException:
        q.put(("error", traceback.format_exc()))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_parent_attaches_what_child_publishes(ipc, daemon, method):
    dlpack_ipc.stat()  # the default client exists before the fork
    ctx = multiprocessing.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=_publisher, args=(f"mp/{method}/child", q))
    p.start()
    res = q.get(timeout=120)
    p.join(timeout=60)
    assert res == ("ok", 1), res
    t = dlpack_ipc.attach(f"mp/{method}/child", timeout=5)
    np.testing.assert_array_equal(np.from_dlpack(t), np.full(3, 5, dtype=np.int8))


def test_several_forked_workers(ipc, daemon):
    ctx = multiprocessing.get_context("fork")
    dlpack_ipc.publish("mp/many/in", np.ones(100, dtype=np.float32))
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=("mp/many/in", f"mp/many/out{i}", q))
          for i in range(4)]
    for p in ps:
        p.start()
    res = [q.get(timeout=120) for _ in ps]
    for p in ps:
        p.join(timeout=60)
    assert all(r[0] == "ok" for r in res), res
    assert [e.name for e in dlpack_ipc.list("mp/many/out")] == [f"mp/many/out{i}" for i in range(4)]
    for i in range(4):
        np.testing.assert_array_equal(np.from_dlpack(dlpack_ipc.attach(f"mp/many/out{i}")), 2.0)


# ---- waiting for a name -----------------------------------------------------------------------


def test_attach_waits_for_publisher(ipc, py):
    p = py.popen("""
        import time, numpy as np, dlpack_ipc
        time.sleep(0.3)
        dlpack_ipc.publish("wait/x", np.arange(6, dtype=np.int16))
    """)
    try:
        t = ipc.attach("wait/x", timeout=5)
    finally:
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert t.generation == 1
    np.testing.assert_array_equal(np.from_dlpack(t), np.arange(6))


def test_attach_dict_waits_for_publisher(ipc, py):
    p = py.popen("""
        import time, numpy as np, dlpack_ipc
        time.sleep(0.3)
        dlpack_ipc.publish_dict("wait/d", {"a": np.arange(3), "b": np.zeros(2)})
    """)
    try:
        d = ipc.attach_dict("wait/d", timeout=5)
    finally:
        p.communicate(timeout=60)
    assert sorted(d) == ["a", "b"]


def test_attach_timeout_expires(ipc, daemon):
    with pytest.raises(TimeoutError) as ei:
        ipc.attach("wait/never", timeout=0.2)
    assert "wait/never" in str(ei.value)
    with pytest.raises(FileNotFoundError, match="wait/never"):
        ipc.attach("wait/never", timeout=0)
    with pytest.raises(FileNotFoundError, match="wait/never"):
        ipc.attach_dict("wait/never", timeout=0)
    for bad in (-1, -0.5, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            ipc.attach("wait/never", timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            ipc.attach_dict("wait/never", timeout=bad)
    daemon.wait_stat(lambda s: s["waiters"] == 0, what="no waiters left")


@pytest.mark.parametrize("how", ["attach", "attach_dict", "module attach", "module attach_dict"])
def test_timeout_none_waits_as_long_as_it_takes(ipc, daemon, py, how):
    """timeout=None (the default) waits for the name, as queue.get() and Channel.recv() do."""
    api = dlpack_ipc if how.startswith("module") else ipc
    fn = getattr(api, how.split()[-1])
    result = {}

    def wait():
        try:
            result["v"] = fn("wait/none")  # no timeout: the default, None
        except BaseException as e:
            result["err"] = e

    th = threading.Thread(target=wait, daemon=True)
    th.start()
    daemon.wait_stat(lambda s: s["waiters"] == 1, what="waiters == 1")
    assert th.is_alive(), result
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("wait/none", np.arange(3))
    """)
    th.join(timeout=60)
    assert not th.is_alive()
    assert "err" not in result, result.get("err")
    t = result["v"][""] if isinstance(result["v"], dict) else result["v"]
    np.testing.assert_array_equal(np.from_dlpack(t), np.arange(3))


def test_waiting_attach_lets_other_threads_run(ipc, daemon, py):
    """A waiting attach is a daemon-side waiter and does not hold the GIL."""
    result = {}

    def wait():
        try:
            result["t"] = ipc.attach("wait/thread", timeout=float("inf"))
        except BaseException as e:
            result["err"] = e

    th = threading.Thread(target=wait, daemon=True)
    th.start()
    daemon.wait_stat(lambda s: s["waiters"] == 1, what="waiters == 1")
    assert th.is_alive()
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("wait/thread", np.arange(3))
    """)
    th.join(timeout=30)
    assert not th.is_alive()
    assert "err" not in result, result.get("err")
    np.testing.assert_array_equal(np.from_dlpack(result["t"]), np.arange(3))
    assert daemon.stat()["waiters"] == 0


@pytest.mark.parametrize("call", ['attach("wait/forever")', 'attach_dict("wait/forever")',
                                  'attach("wait/forever", timeout=None)',
                                  'attach("wait/forever", timeout=float("inf"))',
                                  'attach("wait/forever", timeout=1e300)',
                                  'Client().attach("wait/forever")'])
def test_keyboard_interrupt_stops_infinite_wait(daemon, py, call):
    p = py.popen(f"""
        import sys, dlpack_ipc
        try:
            dlpack_ipc.{call}
        except KeyboardInterrupt:
            print("KeyboardInterrupt", flush=True)
            sys.exit(42)
        print("returned", flush=True)
    """)
    try:
        # deterministic: wait until the daemon has the child's waiter, then a little more
        daemon.wait_stat(lambda s: s["waiters"] == 1 or p.poll() is not None, what="waiter")
        assert p.poll() is None, p.communicate()
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        sent = time.monotonic()
        out, err = p.communicate(timeout=10)
        elapsed = time.monotonic() - sent
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 42, f"status {p.returncode}\n{out}\n{err}"
    assert out.split() == ["KeyboardInterrupt"]
    assert elapsed < 3, f"the interrupt took {elapsed:.1f}s"
    daemon.wait_stat(lambda s: s["waiters"] == 0, what="the waiter is gone")


def test_uncaught_keyboard_interrupt_in_wait(daemon, py):
    p = py.popen("""
        import dlpack_ipc
        dlpack_ipc.attach("wait/forever", timeout=float("inf"))
    """)
    try:
        daemon.wait_stat(lambda s: s["waiters"] == 1 or p.poll() is not None, what="waiter")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert "KeyboardInterrupt" in err, err
    assert p.returncode != 0


# A wait is one ATTACH for its whole timeout: the daemon parks one waiter, and nothing polls it.
# (Cut into 100 ms slices, a 1.5 s wait was about 15 requests.) Two allows for nothing but
# a reconnect, which does not happen here.
WAIT_REQUESTS_MAX = 2


def test_attach_wait_with_timeout_is_one_request(daemon, py):
    before = daemon.stat()["req_attach"]
    cp = py.check("""
        import dlpack_ipc
        try:
            dlpack_ipc.attach("wait/counted", timeout=1.5)
        except TimeoutError as e:
            print("TimeoutError", e)
    """)
    assert cp.stdout.startswith("TimeoutError"), py.describe(cp)
    sent = daemon.stat()["req_attach"] - before
    assert 1 <= sent <= WAIT_REQUESTS_MAX, f"a 1.5 s wait sent {sent} ATTACH requests"


@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("call", ['attach("wait/counted")', 'attach_dict("wait/counted")'])
def test_unbounded_attach_wait_is_one_request(daemon, py, call, where):
    """Also on a thread other than the main one, which has no interrupt check."""
    before = daemon.stat()["req_attach"]
    p = py.popen(f"""
        import threading, dlpack_ipc
        def wait():
            dlpack_ipc.{call}
            print("attached", flush=True)
        if "{where}" == "main":
            wait()
        else:
            th = threading.Thread(target=wait)
            th.start()
            th.join()
    """)
    try:
        daemon.wait_stat(lambda s: s["waiters"] == 1 or p.poll() is not None, what="waiter")
        assert p.poll() is None, p.communicate()
        time.sleep(1.5)
        sent = daemon.stat()["req_attach"] - before
        py.check("""
            import numpy as np, dlpack_ipc
            dlpack_ipc.publish_dict("wait/counted", {"a": np.arange(3)})
        """ if "dict" in call else """
            import numpy as np, dlpack_ipc
            dlpack_ipc.publish("wait/counted", np.arange(3))
        """)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0 and out.split() == ["attached"], f"{p.returncode}\n{out}\n{err}"
    assert 1 <= sent <= WAIT_REQUESTS_MAX, f"a 1.5 s wait sent {sent} ATTACH requests"


def test_recv_wait_with_timeout_is_one_request(daemon, py):
    """A receive that waits on an empty channel and times out sends one RECV for its whole
    timeout, as an attach sends one ATTACH."""
    before = daemon.stat()["req_recv"]
    cp = py.check("""
        import dlpack_ipc
        try:
            dlpack_ipc.Channel("wait/recv-counted", direct=False).recv(timeout=1.5)
        except TimeoutError as e:
            print("TimeoutError", e)
    """)
    assert cp.stdout.startswith("TimeoutError"), py.describe(cp)
    sent = daemon.stat()["req_recv"] - before
    assert 1 <= sent <= WAIT_REQUESTS_MAX, f"a 1.5 s receive sent {sent} RECV requests"


@pytest.mark.parametrize("where", ["main", "thread"])
def test_unbounded_recv_wait_is_one_request(daemon, py, where):
    """A receive without a timeout that ends when a message comes is one RECV, also on a thread
    other than the main one (which has no interrupt check)."""
    before = daemon.stat()["req_recv"]
    p = py.popen(f"""
        import threading, dlpack_ipc
        def wait():
            t = dlpack_ipc.Channel("wait/recv-unbounded", direct=False).recv()
            print("received", bytes(memoryview(t)).hex(), flush=True)
        if "{where}" == "main":
            wait()
        else:
            th = threading.Thread(target=wait)
            th.start()
            th.join()
    """)
    try:
        with dlpack_ipc.Client(socket=daemon.socket) as c:
            ch = c.channel("wait/recv-unbounded", direct=False)
            deadline = time.monotonic() + 10
            while ch.stat().receivers_waiting != 1 and p.poll() is None:
                assert time.monotonic() < deadline, "the receive did not wait"
                time.sleep(0.01)
            assert p.poll() is None, p.communicate()
            time.sleep(1.5)
            sent = daemon.stat()["req_recv"] - before
            ch.send(np.arange(3, dtype=np.uint8))
            out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0 and out.split() == ["received", "000102"], f"{out}\n{err}"
    assert 1 <= sent <= WAIT_REQUESTS_MAX, f"a 1.5 s receive sent {sent} RECV requests"
