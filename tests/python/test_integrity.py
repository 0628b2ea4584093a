# SPDX-License-Identifier: Apache-2.0
"""Attach modes and owner checks across real processes (issue #11).

"read" (the default) keeps DLPack's read-only flag but maps copy-on-write, so torch, which
ignores the flag, writes into pages of its own; "private" is writable copy-on-write; "strict"
is the plain read-only shared mapping, where a write is SIGSEGV. Whatever a consumer does, the
publisher and every other attacher keep reading the published bytes. owner= refuses, or waits
past, an entry another uid squatted.
"""
import ctypes
import errno
import os
import signal
import threading

import numpy as np
import pytest

import dlpack_ipc

READ_ONLY = 1 << 0
NOBODY = 65534

# "int/x": 64 float32 0..63 in empty() memory, published without a copy (the publisher keeps
# reading it through its own mapping); "int/w": the same values published writable (a mapping
# mistakenly made shared would let writes through to everyone); "int/d": a bundle.
PUBLISHER = """
    import numpy as np, dlpack_ipc
    want = np.arange(64, dtype=np.float32)
    e = dlpack_ipc.empty((64,), "float32")
    np.asarray(e)[:] = want
    dlpack_ipc.publish("int/x", e)
    dlpack_ipc.publish("int/w", want, writable=True)
    dlpack_ipc.publish_dict("int/d", {"a": want, "b": np.arange(6).reshape(2, 3)})
    print("ready", flush=True)
    dlpack_ipc.attach("int/done", timeout=60)
    print("publisher reads", "original" if np.array_equal(np.asarray(e), want) else
          np.asarray(e).tolist(), flush=True)
"""

# In another interpreter: every entry still holds the published bytes.
CHECK_ORIGINALS = """
    import numpy as np, dlpack_ipc
    want = np.arange(64, dtype=np.float32)
    for name in ("int/x", "int/w"):
        np.testing.assert_array_equal(np.from_dlpack(dlpack_ipc.attach(name)), want)
    d = dlpack_ipc.attach_dict("int/d")
    np.testing.assert_array_equal(np.from_dlpack(d["a"]), want)
    np.testing.assert_array_equal(np.from_dlpack(d["b"]), np.arange(6).reshape(2, 3))
    print("originals")
"""


def flags_of(t):
    """The flags of a versioned DLPack capsule exported by @p t."""
    class V(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                    ("ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                    ("flags", ctypes.c_uint64)]

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    cap = t.__dlpack__(max_version=(1, 0))
    return ctypes.cast(get(cap, b"dltensor_versioned"), ctypes.POINTER(V)).contents.flags


class Entries:
    """The publisher of int/x, int/w and int/d, alive until finish()."""

    def __init__(self, ipc, py):
        self.ipc, self.py = ipc, py
        self.proc = py.popen(PUBLISHER)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"publisher failed: {line}{out}\n{err}")

    def check_originals(self):
        """A fresh attacher in another process, this one, and the publisher (once, at the end)
        all read the published bytes."""
        cp = self.py.check(CHECK_ORIGINALS)
        assert cp.stdout.split() == ["originals"], self.py.describe(cp)
        want = np.arange(64, dtype=np.float32)
        for name in ("int/x", "int/w"):
            np.testing.assert_array_equal(np.from_dlpack(self.ipc.attach(name)), want)
        np.testing.assert_array_equal(np.from_dlpack(self.ipc.attach_dict("int/d")["a"]), want)

    def finish(self):
        self.ipc.publish("int/done", np.zeros(1))
        out, err = self.proc.communicate(timeout=60)
        assert self.proc.returncode == 0, err
        assert out.strip() == "publisher reads original", out

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture
def entries(ipc, py):
    e = Entries(ipc, py)
    try:
        yield e
    finally:
        e.kill()


def test_torch_writes_in_default_mode_stay_private(entries, py):
    cp = py.run("""
        import numpy as np, torch, dlpack_ipc
        want = np.arange(64, dtype=np.float32)
        for name in ("int/x", "int/w"):
            t = dlpack_ipc.attach(name)
            assert t.mode == "read" and t.readonly
            x = torch.from_dlpack(t).add_(1)          # torch ignores the read-only flag
            assert torch.equal(x, torch.from_numpy(want + 1))
            assert torch.equal(torch.from_dlpack(t), x), "one attach, one mapping"
            # a second attach maps again: the published bytes
            np.testing.assert_array_equal(np.from_dlpack(dlpack_ipc.attach(name)), want)
        d = dlpack_ipc.attach_dict("int/d")
        assert {v.mode for v in d.values()} == {"read"}
        sd = {k: torch.from_dlpack(v) for k, v in d.items()}
        sd["a"].mul_(2)
        sd["b"].add_(10)
        assert torch.equal(sd["a"], torch.from_numpy(want * 2))
        assert sd["b"].tolist() == [[10, 11, 12], [13, 14, 15]]
        np.testing.assert_array_equal(np.from_dlpack(dlpack_ipc.attach_dict("int/d")["a"]), want)
        print("wrote")
    """)
    assert cp.returncode == 0 and cp.stdout.split() == ["wrote"], py.describe(cp)
    entries.check_originals()
    entries.finish()


def test_default_mode_is_read_only_for_numpy(ipc, entries):
    for name in ("int/x", "int/w"):
        t = ipc.attach(name)
        assert t.mode == "read"
        assert t.readonly is True
        assert flags_of(t) & READ_ONLY, "the versioned capsule carries the read-only flag"
        assert memoryview(t).readonly
        a = np.from_dlpack(t)
        assert not a.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 1
        b = np.asarray(t)  # the buffer protocol: read-only too
        with pytest.raises(ValueError, match="read-only"):
            b[0] = 1
    for v in ipc.attach_dict("int/d").values():
        assert v.readonly and flags_of(v) & READ_ONLY
    entries.finish()


def test_private_mode_is_writable_and_private(ipc, entries, py):
    cp = py.run("""
        import numpy as np, torch, dlpack_ipc
        want = np.arange(64, dtype=np.float32)
        for name in ("int/x", "int/w"):
            t = dlpack_ipc.attach(name, mode="private")
            assert t.mode == "private" and t.readonly is False
            a = np.asarray(t)                       # a writable buffer
            a[:] += 1
            x = torch.from_dlpack(t).add_(1)
            np.testing.assert_array_equal(x.numpy(), want + 2)
            np.testing.assert_array_equal(a, want + 2)
            np.testing.assert_array_equal(np.from_dlpack(dlpack_ipc.attach(name)), want)
        d = dlpack_ipc.attach_dict("int/d", mode="private")
        assert {(v.mode, v.readonly) for v in d.values()} == {("private", False)}
        np.asarray(d["b"])[:] = -1
        assert torch.from_dlpack(d["b"]).tolist() == [[-1] * 3] * 2
        print("wrote")
    """)
    assert cp.returncode == 0 and cp.stdout.split() == ["wrote"], py.describe(cp)
    t = ipc.attach("int/x", mode="private")
    assert not flags_of(t) & READ_ONLY, "no read-only flag in the capsule"
    assert not memoryview(t).readonly
    entries.check_originals()
    entries.finish()


def test_strict_mode_write_is_sigsegv(ipc, entries, py):
    t = ipc.attach("int/x", mode="strict")
    assert t.mode == "strict" and t.readonly and flags_of(t) & READ_ONLY
    cp = py.run("""
        import torch, dlpack_ipc
        x = torch.from_dlpack(dlpack_ipc.attach("int/x", mode="strict"))
        print("attached", flush=True)
        x.add_(1)
        print("wrote", flush=True)
    """)
    assert cp.returncode == -signal.SIGSEGV, py.describe(cp)
    assert cp.stdout.split() == ["attached"]
    entries.check_originals()
    entries.finish()


def test_mode_arguments(ipc, entries):
    with pytest.raises(ValueError) as ei:
        ipc.attach("int/x", mode="copy")
    for m in ("read", "private", "strict", "write", "copy"):
        assert m in str(ei.value)
    with pytest.raises(ValueError, match="contradicts"):
        ipc.attach("int/w", mode="read", writable=True)
    with pytest.raises(ValueError, match="contradicts"):
        ipc.attach_dict("int/d", mode="write", writable=False)
    with pytest.raises(ValueError):
        ipc.attach("int/x", owner=-1)
    with pytest.raises(ValueError):
        ipc.attach("int/x", owner=2**32 - 1)
    with pytest.raises(TypeError):
        ipc.attach("int/x", owner="0")
    # writable=True is mode="write"; writable=False is the default
    w = ipc.attach("int/w", writable=True)
    assert (w.mode, w.readonly) == ("write", False)
    assert ipc.attach("int/w", mode="write", writable=True).mode == "write"
    assert ipc.attach("int/x", writable=False).mode == "read"
    with pytest.raises(PermissionError):
        ipc.attach("int/x", mode="write")
    # who published what was attached; empty() memory has no owner and no mode
    t = ipc.attach("int/x", owner=os.getuid())
    assert t.owner == dlpack_ipc.Owner(os.getuid(), entries.proc.pid)
    assert isinstance(t.owner, dlpack_ipc.Owner)
    assert t.generation == 1
    e = ipc.empty(4, "float32")
    assert e.owner is None and e.mode is None
    entries.finish()


# (everything imported before dropping to uid 65534: an interpreter under a 0700 home, as
# pyenv's in /root, is out of that uid's reach)
SQUATTER = f"""
    import os
    import numpy as np, dlpack_ipc
    os.setgroups([])
    os.setgid({NOBODY})
    os.setuid({NOBODY})
    dlpack_ipc.publish("own/m", np.full(8, 7.0))
    print("ready", flush=True)
    dlpack_ipc.attach("own/go", timeout=60)
    dlpack_ipc.unpublish("own/m")
    print("gone", flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a squatter as uid 65534")
@pytest.mark.dlpackd_for_others
def test_owner_refuses_and_waits_past_a_squatter(ipc, daemon, py):
    sq = py.popen(SQUATTER)
    try:
        line = sq.stdout.readline()
        assert line.strip() == "ready", line + sq.communicate()[1]

        # by name alone: the squatter's bytes, and .owner says so
        t = ipc.attach("own/m")
        assert t.owner == (NOBODY, sq.pid)
        np.testing.assert_array_equal(np.from_dlpack(t), np.full(8, 7.0))
        assert ipc.attach("own/m", owner=NOBODY).owner.uid == NOBODY
        t.release()

        # insisting on root: absent, with both uids named
        for attach in (ipc.attach, ipc.attach_dict):
            with pytest.raises(FileNotFoundError) as ei:
                attach("own/m", owner=0, timeout=0)
            assert ei.value.errno == errno.ENOENT
            assert "uid 0" in str(ei.value) and f"uid {NOBODY}" in str(ei.value), ei.value
        with pytest.raises(TimeoutError, match="published by uid 0"):
            ipc.attach("own/m", owner=0, timeout=0.2)

        # a waiting attach keeps waiting past the squatter until root publishes
        got = {}

        def waiter():
            try:
                got["t"] = ipc.attach("own/m", owner=0, timeout=30)
            except BaseException as e:  # reported by the main thread
                got["error"] = e

        th = threading.Thread(target=waiter)
        th.start()
        try:
            daemon.wait_stat(lambda s: s["waiters"] >= 1 or not th.is_alive(),
                             what="the owner-checked attach waiting")
            assert th.is_alive(), got
            ipc.publish("own/go", np.zeros(1))
            out, err = sq.communicate(timeout=30)
            assert sq.returncode == 0 and out.split() == ["gone"], err
            assert th.is_alive(), got
            ipc.publish("own/m", np.arange(8.0))
        finally:
            th.join(timeout=30)
        assert not th.is_alive()
        assert "error" not in got, got
        t = got["t"]
        assert t.owner == (0, os.getpid())
        np.testing.assert_array_equal(np.from_dlpack(t), np.arange(8.0))
    finally:
        if sq.poll() is None:
            sq.kill()
            sq.communicate()
