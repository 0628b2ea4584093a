# SPDX-License-Identifier: Apache-2.0
"""Behaviour a review found broken: each test failed (crashed or leaked) before its fix."""
import gc
import textwrap
import threading
import time

import pytest

import dlpack_ipc


def test_close_while_a_call_waits(daemon, py):
    """Closing a Client while another thread waits in attach() used to free the connection
    under the waiting thread (a crash); the close now ends the wait (ECANCELED), and the
    connection goes once the call has left it."""
    cp = py.run(textwrap.dedent(f"""
        import errno, threading, time, dlpack_ipc as d
        c = d.Client({daemon.socket!r})
        seen = []
        def waiter():
            try:
                c.attach("never", timeout=1)
            except OSError as e:
                seen.append(errno.errorcode[e.errno])
        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.25)
        c.close()
        th.join()
        assert seen == ["ECANCELED"], seen
        try:
            c.attach("never")
        except ValueError as e:
            assert "closed" in str(e)
        else:
            raise AssertionError("a closed Client must refuse calls")
        print("ok")
        """))
    py.assert_ok(cp)
    assert cp.stdout.strip() == "ok"
    daemon.wait_stat(lambda s: s["connections"] == 1)  # only the stat() probe itself


@pytest.mark.parametrize("how", ["refused", "bundle"])
def test_frozen_empty_memory_reports_read_only(daemon, py, how):
    """empty() memory that libdlpc sealed read-only (a refused publish, or a one-tensor bundle
    published without a copy) used to claim to be writable, and writing crashed."""
    cp = py.run(textwrap.dedent(f"""
        import dlpack_ipc as d
        c = d.Client({daemon.socket!r})
        t = c.empty((4,), "float32")
        if {how!r} == "refused":
            c.publish("x", c.empty((4,), "float32"))
            try:
                c.publish("x", t)
            except FileExistsError:
                pass
        else:
            c.publish_dict("x", {{"w": t}})
        assert t.readonly
        assert memoryview(t).readonly
        try:
            memoryview(t).cast("B")[0] = 1
        except TypeError:
            pass
        else:
            raise AssertionError("a write went through")
        print("ok")
        """))
    py.assert_ok(cp)
    assert cp.stdout.strip() == "ok"


def test_failed_publish_dict_keeps_nothing(daemon):
    """A publish_dict that fails on a later value used to leak the share taken of an earlier
    SharedTensor: the daemon kept the attach reference after release()."""
    c = dlpack_ipc.Client(daemon.socket)
    src = c.empty((16,), "float32")
    c.publish("src", src)
    s = c.attach("src")
    with pytest.raises(TypeError):
        c.publish_dict("y", {"a": s, "b": object()})
    s.release()
    gc.collect()
    daemon.wait_stat(lambda st: st["references"] == 0)
    c.close()


def test_wait_that_runs_out_is_a_timeout(daemon):
    """A finite wait never turns into 'forever' or 'absent' at its very end."""
    c = dlpack_ipc.Client(daemon.socket)
    for timeout in (0.001, 0.05, 0.101):
        with pytest.raises(TimeoutError):
            c.attach("never", timeout=timeout)
    c.close()
