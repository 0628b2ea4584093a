# SPDX-License-Identifier: Apache-2.0
"""Lifetime of attached memory and references, ephemeral entries, and zero-copy empty()."""
import gc
import signal
import time

import numpy as np
import pytest
import torch

PUBLISH_RANGE = """
    import numpy as np, dlpack_ipc
    dlpack_ipc.publish("life/x", np.arange(1000, dtype=np.float64))
"""


def settle(daemon, refs):
    """Give fire-and-forget RELEASE messages a moment, then read STAT."""
    gc.collect()
    time.sleep(0.2)
    return daemon.stat()["references"] == refs


def test_array_outlives_dropped_shared_tensor(ipc, daemon, py):
    py.check(PUBLISH_RANGE)
    t = ipc.attach("life/x")
    a = np.from_dlpack(t)
    x = torch.from_dlpack(t)
    assert daemon.stat()["references"] == 1
    del t
    gc.collect()
    np.testing.assert_array_equal(a, np.arange(1000))
    assert settle(daemon, 1), "the arrays still hold the reference"
    del a
    assert settle(daemon, 1), "the torch tensor still holds the reference"
    assert x[999].item() == 999.0
    del x
    daemon.wait_stat(lambda s: s["references"] == 0, what="references == 0")


def test_array_outlives_release(ipc, daemon, py):
    py.check(PUBLISH_RANGE)
    t = ipc.attach("life/x")
    a1 = np.from_dlpack(t)
    a2 = np.from_dlpack(t)
    t.release()
    with pytest.raises(BufferError):
        np.from_dlpack(t)
    assert settle(daemon, 1)
    np.testing.assert_array_equal(a1, np.arange(1000))
    del a1
    assert settle(daemon, 1), "a2 still holds the reference"
    np.testing.assert_array_equal(a2, np.arange(1000))
    del a2
    daemon.wait_stat(lambda s: s["references"] == 0, what="references == 0")
    [e] = ipc.list("life/")
    assert e.refs == 0


def test_release_without_arrays_drops_reference(ipc, daemon, py):
    py.check(PUBLISH_RANGE)
    ts = [ipc.attach("life/x") for _ in range(3)]
    assert daemon.stat()["references"] == 3
    assert ipc.list("life/x")[0].refs == 3
    ts[0].release()
    daemon.wait_stat(lambda s: s["references"] == 2, what="references == 2")
    del ts[1]
    daemon.wait_stat(lambda s: s["references"] == 1, what="references == 1")
    with ts[1]:
        pass
    daemon.wait_stat(lambda s: s["references"] == 0, what="references == 0")


@pytest.mark.parametrize("how", ["exit", "os._exit", "SIGKILL"])
def test_child_exit_leaves_no_references(ipc, daemon, py, how):
    py.check(PUBLISH_RANGE)
    base = daemon.stat()["connections"]
    end = {"exit": "pass",
           "os._exit": "os._exit(0)",
           "SIGKILL": "os.kill(os.getpid(), signal.SIGKILL)"}[how]
    cp = py.run(f"""
        import os, signal, numpy as np, dlpack_ipc
        t = dlpack_ipc.attach("life/x")
        a = np.from_dlpack(t)
        d = [dlpack_ipc.attach("life/x") for _ in range(3)]
        st = dlpack_ipc.stat()
        print(st["references"], flush=True)
        {end}
    """)
    assert cp.returncode == (-signal.SIGKILL if how == "SIGKILL" else 0), py.describe(cp)
    assert cp.stdout.split() == ["4"]
    daemon.wait_stat(lambda s: s["references"] == 0 and s["connections"] == base,
                     what="child's references and connection gone")
    assert daemon.stat()["storages"] == 1, "the entry is still published"


def test_unpublished_storage_freed_after_last_array(ipc, daemon, py):
    py.check(PUBLISH_RANGE)
    t = ipc.attach("life/x")
    a = np.from_dlpack(t)
    held = daemon.stat()["bytes_held"]
    assert held >= 8000
    ipc.unpublish("life/x")
    st = daemon.stat()
    assert st["entries"] == 0 and st["storages"] == 1 and st["bytes_held"] == held
    with pytest.raises(FileNotFoundError):
        ipc.attach("life/x", timeout=0)
    np.testing.assert_array_equal(a, np.arange(1000))
    del t, a
    gc.collect()
    daemon.wait_stat(lambda s: s["storages"] == 0 and s["bytes_held"] == 0
                     and s["references"] == 0, what="storage freed")


def test_ephemeral_entry_vanishes_with_publisher(ipc, daemon, py):
    cp = py.check("""
        import numpy as np, dlpack_ipc
        print(dlpack_ipc.publish("eph/x", np.arange(5), ephemeral=True))
        dlpack_ipc.publish("eph/keep", np.arange(5))
        print(len(dlpack_ipc.list("eph/")))
    """)
    assert cp.stdout.split() == ["1", "2"]
    daemon.wait_stat(lambda s: s["entries"] == 1, what="ephemeral entry removed")
    assert [e.name for e in ipc.list("eph/")] == ["eph/keep"]
    with pytest.raises(FileNotFoundError, match="eph/x"):
        ipc.attach("eph/x", timeout=0)


def test_ephemeral_attached_memory_survives_publisher(ipc, daemon, py):
    p = py.popen("""
        import sys, time, numpy as np, dlpack_ipc
        dlpack_ipc.publish("eph/y", np.arange(7, dtype=np.int32), ephemeral=True)
        print("published", flush=True)
        time.sleep(60)
    """)
    try:
        assert p.stdout.readline().strip() == "published"
        t = ipc.attach("eph/y")
        a = np.from_dlpack(t)
        [e] = ipc.list("eph/")
        assert e.flags & 2, "DLPC_PUBLISH_EPHEMERAL is bit 1"
    finally:
        p.kill()
        p.wait()
    daemon.wait_stat(lambda s: s["entries"] == 0, what="ephemeral entry removed")
    np.testing.assert_array_equal(a, np.arange(7))
    assert daemon.stat()["storages"] == 1
    del t, a
    daemon.wait_stat(lambda s: s["storages"] == 0, what="storage freed")


# ---- empty(): zero-copy publish --------------------------------------------------------------


def test_empty_publish_is_zero_copy(ipc, daemon, py):
    s0 = daemon.stat()
    e = ipc.empty((10, 33), "float64")
    assert e.shape == (10, 33) and e.dtype == "float64" and e.nbytes == 2640
    assert e.readonly is False and e.device == "cpu" and repr(e).endswith(" writable>")
    assert daemon.stat()["storages"] == s0["storages"], "nothing is asked of the daemon yet"
    # numpy 1.24's from_dlpack is always read-only: fill in place through torch's numpy view
    w = torch.from_dlpack(e).numpy()
    assert w.ctypes.data == e.data_ptr
    w[...] = np.arange(330).reshape(10, 33) / 8
    a = np.from_dlpack(e)
    assert a.ctypes.data == e.data_ptr
    gen = ipc.publish("alloc/x", e)
    assert gen == 1
    s1 = daemon.stat()
    assert s1["bytes_held"] - s0["bytes_held"] == 2816, "2640 rounded up to 256, no more"
    assert s1["storages"] - s0["storages"] == 1
    assert e.readonly is True and repr(e).endswith(" read-only>"), repr(e)  # sealed since
    assert e.data_ptr == a.ctypes.data
    np.testing.assert_array_equal(a, np.arange(330).reshape(10, 33) / 8)
    cp = py.check("""
        import numpy as np, dlpack_ipc
        t = dlpack_ipc.attach("alloc/x")
        a = np.from_dlpack(t)
        assert np.array_equal(a, np.arange(330).reshape(10, 33) / 8), a
        print(t.shape, t.dtype, t.readonly)
    """)
    assert cp.stdout.strip() == "(10, 33) float64 True"


def test_empty_writable_publish_shares_later_writes(ipc, daemon, py):
    e = ipc.empty((4, 4), "int32")
    w = torch.from_dlpack(e)
    w.fill_(3)
    ipc.publish("alloc/w", e, writable=True)
    assert e.readonly is False
    # written after publishing: only visible to the attacher if nothing was copied
    w[2, 2] = 77
    cp = py.check("""
        import numpy as np, dlpack_ipc
        a = np.from_dlpack(dlpack_ipc.attach("alloc/w"))
        print(int(a[2, 2]), int(a.sum()))
    """)
    assert cp.stdout.split() == ["77", str(15 * 3 + 77)]


def test_empty_sizes(ipc, daemon):
    cases = [((1,), "uint8", 256), ((64,), "float32", 256), ((65,), "float32", 512),
             ((0, 5), "float64", 256), ((), "complex128", 256), ((3, 100), "bfloat16", 768)]
    bad = []
    for i, (shape, dtype, size) in enumerate(cases):
        s0 = daemon.stat()["bytes_held"]
        e = ipc.empty(shape, dtype)
        assert e.shape == shape and e.dtype == dtype
        name = f"alloc/{i}"
        ipc.publish(name, e)
        got = daemon.stat()["bytes_held"] - s0
        if got != size:
            bad.append(f"{shape} {dtype}: bytes_held grew by {got}, expected {size}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case", ["empty_then_publish", "strict_attach"])
def test_write_to_read_only_memory_segfaults(ipc, py, case):
    if case == "empty_then_publish":
        code = """
            import torch, dlpack_ipc
            e = dlpack_ipc.empty((1024,), "float32")
            x = torch.from_dlpack(e)
            x[0] = 1.0
            dlpack_ipc.publish("ro/e", e)
            print("published", flush=True)
            x[1] = 2.0
            print("wrote", flush=True)
        """
    else:
        py.check("""
            import numpy as np, dlpack_ipc
            dlpack_ipc.publish("ro/a", np.zeros(1024, dtype=np.float32))
        """)
        code = """
            import torch, dlpack_ipc
            x = torch.from_dlpack(dlpack_ipc.attach("ro/a", mode="strict"))
            print("published", flush=True)
            x[1] = 2.0
            print("wrote", flush=True)
        """
    cp = py.run(code)
    assert cp.returncode == -signal.SIGSEGV, py.describe(cp)
    assert cp.stdout.split() == ["published"]


def test_empty_dict_bucket_is_published_without_a_copy(ipc, daemon, py):
    s0 = daemon.stat()
    d = ipc.empty_dict({"w": ((4, 5), "float32"), "b": (7, "int16"), "e": ((0,), "uint8")})
    assert list(d) == ["w", "b", "e"]
    assert [t.shape for t in d.values()] == [(4, 5), (7,), (0,)]
    # one allocation, each tensor at the next 256-byte boundary
    assert d["b"].data_ptr - d["w"].data_ptr == 256
    assert d["e"].data_ptr - d["w"].data_ptr == 512
    w, b = torch.from_dlpack(d["w"]), torch.from_dlpack(d["b"])
    w.copy_(torch.arange(20, dtype=torch.float32).reshape(4, 5))
    b.fill_(-3)
    assert ipc.publish_dict("alloc/bucket", d, writable=True) == 1
    assert daemon.stat()["bytes_held"] - s0["bytes_held"] == 512, "the allocation, no copy"
    # written after publishing: seen by the attacher only because nothing was copied
    w[3, 4] = 77
    cp = py.check("""
        import numpy as np, dlpack_ipc
        d = dlpack_ipc.attach_dict("alloc/bucket")
        print(sorted(d), float(np.from_dlpack(d["w"])[3, 4]), int(np.from_dlpack(d["b"]).sum()),
              d["e"].shape)
    """)
    assert cp.stdout.strip() == "['b', 'e', 'w'] 77.0 -21 (0,)"
    with pytest.raises(TypeError):
        ipc.empty_dict([("w", ((2,), "float32"))])
    with pytest.raises(TypeError):
        ipc.empty_dict({"w": (2, "float32", "extra")})
    with pytest.raises(ValueError):
        ipc.empty_dict({})
    with pytest.raises(ValueError):
        ipc.empty_dict({"w": ((-1,), "float32")})


# ---- published() / published_dict(): an entry for the duration of a with block ----------------

ATTACH_AND_CHECK = """
    import sys, numpy as np, dlpack_ipc
    try:
        t = dlpack_ipc.attach(sys.argv[1] if len(sys.argv) > 1 else "{name}", timeout=0)
    except FileNotFoundError:
        print("absent")
    else:
        print("present", np.from_dlpack(t).sum())
"""


def test_published_lives_for_the_with_block(ipc, daemon, py):
    import dlpack_ipc
    with dlpack_ipc.published("with/x", np.arange(4.0)) as gen:
        assert gen == 1
        assert py.check(ATTACH_AND_CHECK.format(name="with/x")).stdout.split() == \
            ["present", "6.0"]
        (e,) = dlpack_ipc.list("with/x")
        assert dlpack_ipc.EntryFlags.EPHEMERAL in e.flags
    assert dlpack_ipc.list() == []
    assert py.check(ATTACH_AND_CHECK.format(name="with/x")).stdout.split() == ["absent"]
    with dlpack_ipc.published_dict("with/d", {"a": np.ones(2), "b": np.ones(3)}) as gen:
        assert gen == 1
        assert sorted(py.check("""
            import dlpack_ipc
            print(*dlpack_ipc.attach_dict("with/d", timeout=0))
        """).stdout.split()) == ["a", "b"]
    assert dlpack_ipc.list() == []
    assert daemon.stat()["protocol_errors"] == 0


def test_published_unpublishes_on_an_exception(ipc, daemon):
    import dlpack_ipc
    with pytest.raises(ZeroDivisionError):
        with dlpack_ipc.published("with/err", np.zeros(2), ephemeral=False):
            assert [e.name for e in dlpack_ipc.list()] == ["with/err"]
            1 / 0
    assert dlpack_ipc.list() == []
    with pytest.raises(KeyError):
        with dlpack_ipc.published_dict("with/err", {"a": np.zeros(2)}):
            raise KeyError("a")
    assert dlpack_ipc.list() == []
    # the block's exception stays the one raised, whatever the clean-up meets: here a client
    # closed inside the block (its ephemeral entry went with its connection)
    c = dlpack_ipc.Client()
    with pytest.raises(KeyError):
        with dlpack_ipc.published("with/closed", np.zeros(2), client=c):
            c.close()
            raise KeyError("b")
    daemon.wait_stat(lambda s: s["entries"] == 0, what="the ephemeral entry gone")
    # without an exception, the clean-up's own error is the one to see
    c = dlpack_ipc.Client()
    with pytest.raises(ValueError):
        with dlpack_ipc.published("with/closed", np.zeros(2), client=c):
            c.close()


def test_published_leaves_what_replaced_it_alone(ipc, daemon, py):
    """A generation published by someone else inside the block is not ours to unpublish."""
    import dlpack_ipc
    with dlpack_ipc.published("with/r", np.zeros(2)) as gen:
        py.check("""
            import numpy as np, dlpack_ipc
            assert dlpack_ipc.publish("with/r", np.ones(2), replace=True) == 2
        """)
    (e,) = dlpack_ipc.list("with/r")
    assert gen == 1 and e.generation == 2
    np.testing.assert_array_equal(np.from_dlpack(dlpack_ipc.attach("with/r", timeout=0)), 1.0)
    # gone already (unpublished inside, or unpublished and published anew): nothing to do
    with dlpack_ipc.published("with/g", np.zeros(2)):
        dlpack_ipc.unpublish("with/g")
    with dlpack_ipc.published("with/g", np.zeros(2)):
        dlpack_ipc.unpublish("with/g")
        py.check("""
            import numpy as np, dlpack_ipc
            dlpack_ipc.publish("with/g", np.full(2, 5.0))
        """)
    np.testing.assert_array_equal(np.from_dlpack(dlpack_ipc.attach("with/g", timeout=0)), 5.0)
    assert sorted(e.name for e in dlpack_ipc.list()) == ["with/g", "with/r"]


def test_published_exit_leaves_a_replace_that_raced_it_alone(ipc, daemon, py):
    """A replace by another process that lands after published()'s exit made sure the entry is
    still its own, just before its UNPUBLISH goes out, survives: the daemon checks that the
    entry is this publish's and removes it in one step (with a check first and an UNPUBLISH
    after, this replace was removed)."""
    import dlpack_ipc

    class ReplacedBeforeUnpublish(dlpack_ipc.Client):
        # the race, made deterministic: the replace lands after whatever published() checks
        # on its side, right before its UNPUBLISH
        def unpublish(self, name, **kw):
            py.check("""
                import numpy as np, dlpack_ipc
                assert dlpack_ipc.publish("with/race", np.full(2, 7.0), replace=True) == 2
            """)
            return super().unpublish(name, **kw)

    with ReplacedBeforeUnpublish() as c:
        for publish_for_block, obj in ((dlpack_ipc.published, np.zeros(2)),
                                       (dlpack_ipc.published_dict, {"a": np.zeros(2)})):
            with publish_for_block("with/race", obj, client=c) as gen:
                assert gen == 1
            (e,) = dlpack_ipc.list("with/race")
            assert e.generation == 2, publish_for_block
            np.testing.assert_array_equal(
                np.from_dlpack(dlpack_ipc.attach("with/race", timeout=0)), 7.0)
            dlpack_ipc.unpublish("with/race")
    assert dlpack_ipc.list() == []


def test_unpublish_only_the_entry_meant(ipc, daemon, py):
    """unpublish(name, generation=, created_ns=): that entry or nothing, also once the name
    was freed and published anew at generation 1 by another process."""
    import errno
    import dlpack_ipc
    assert dlpack_ipc.publish("only/x", np.zeros(2)) == 1
    (e,) = dlpack_ipc.list("only/x")
    assert e.created_ns > 0 and abs(e.created_ns / 1e9 - e.created) < 1e-3
    for wrong in ({"generation": 2}, {"generation": 1, "created_ns": e.created_ns + 1}):
        with pytest.raises(OSError) as ei:
            dlpack_ipc.unpublish("only/x", **wrong)
        assert ei.value.errno == errno.ESTALE, wrong
        assert "cannot unpublish 'only/x'" in str(ei.value)
    assert dlpack_ipc.list("only/x") == [e]
    dlpack_ipc.unpublish("only/x", generation=1, created_ns=e.created_ns)
    assert dlpack_ipc.list() == []
    py.check("""
        import numpy as np, dlpack_ipc
        assert dlpack_ipc.publish("only/x", np.ones(2)) == 1
    """)
    (again,) = dlpack_ipc.list("only/x")
    assert again.generation == 1 and again.created_ns != e.created_ns
    with pytest.raises(OSError) as ei:
        dlpack_ipc.unpublish("only/x", generation=1, created_ns=e.created_ns)
    assert ei.value.errno == errno.ESTALE
    assert dlpack_ipc.list("only/x") == [again]
    for bad in ({"generation": 0}, {"created_ns": -1}):
        with pytest.raises(ValueError, match="must be None or above 0"):
            dlpack_ipc.unpublish("only/x", **bad)
    dlpack_ipc.unpublish("only/x", generation=again.generation, created_ns=again.created_ns)
    with pytest.raises(FileNotFoundError):
        dlpack_ipc.unpublish("only/x", generation=1)
    assert dlpack_ipc.list() == []


RERUN = """
    import subprocess, sys, numpy as np, dlpack_ipc
    with dlpack_ipc.published("with/script", np.arange(3.0)):
        out = subprocess.run([sys.executable, "-c", sys.argv[1]], capture_output=True,
                             text=True, check=True).stdout
    print(out.strip())
"""


def test_a_script_using_published_runs_twice(ipc, daemon, py):
    """The script that publish() made fail on its second run (FileExistsError) runs again."""
    import subprocess
    import sys
    import textwrap
    from conftest import _child_env
    for _ in range(2):
        cp = subprocess.run([sys.executable, "-c", textwrap.dedent(RERUN),
                             textwrap.dedent(ATTACH_AND_CHECK.format(name="with/script"))],
                            env=_child_env(), capture_output=True, text=True, timeout=60)
        assert cp.returncode == 0, py.describe(cp)
        assert cp.stdout.split() == ["present", "3.0"], py.describe(cp)
    import dlpack_ipc
    assert dlpack_ipc.list() == []


def test_published_entry_goes_with_a_killed_process(ipc, daemon, py):
    """ephemeral (published()'s default): a process killed inside the block leaves no entry."""
    import dlpack_ipc
    p = py.popen("""
        import time, numpy as np, dlpack_ipc
        with dlpack_ipc.published("with/killed", np.zeros(2)):
            print("in", flush=True)
            time.sleep(600)
    """)
    try:
        assert p.stdout.readline().strip() == "in", p.communicate()[1]
        assert [e.name for e in dlpack_ipc.list()] == ["with/killed"]
        p.kill()
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    daemon.wait_stat(lambda s: s["entries"] == 0, what="the entry gone with its publisher")
