# SPDX-License-Identifier: Apache-2.0
"""Objects that used to crash the module (issue 27, point 9), each in an interpreter of its own so
that a crash is this test's failure, not pytest's: numpy's datetime64 and timedelta64 scalars,
whose buffer has no strides although publish() asks for them; buffers whose format DLPack cannot
say; _testbuffer's conformant buffers (where the interpreter has it). The property
test over every kind of object is test_hostile_property.py."""
import pytest


def _child(py, body):
    """Run body in a fresh interpreter: it must exit 0 (a SIGSEGV is a failure with its status)."""
    cp = py.run("import numpy as np, dlpack_ipc\n" + body)
    assert cp.returncode == 0, "child interpreter failed: " + py.describe(cp)
    return cp.stdout


@pytest.mark.parametrize("expr", ['np.datetime64("2021-05-27")', 'np.timedelta64(5, "s")',
                                  'np.array(["2021-05-27"], dtype="M8[D]")',
                                  'np.array([5], dtype="m8[s]")'])
def test_datetime_and_timedelta_are_refused_not_a_crash(daemon, py, expr):
    """Until issue 27 the scalars' buffer (8 bytes, ndim 1, strides NULL) crashed publish,
    publish_dict and Channel.send; now DLPack's refusal stands (numpy has no DLPack datetime)
    and nothing is published."""
    out = _child(py, f"""
x = {expr}
for what, call in [("publish", lambda: dlpack_ipc.publish("x", x)),
                   ("publish_dict", lambda: dlpack_ipc.publish_dict("d", {{"k": x}})),
                   ("send", lambda: dlpack_ipc.channel("c").send(x, timeout=0))]:
    try:
        call()
    except BufferError as e:
        print(what, "BufferError", e)
    else:
        raise SystemExit(what + " published a datetime/timedelta")
assert dlpack_ipc.list() == [], dlpack_ipc.list()
assert dlpack_ipc.channel("c").stat().depth == 0
""")
    assert out.count("BufferError") == 3, out


def test_numpy_scalars_publish_as_0d_arrays(daemon, py):
    """A numpy scalar goes as the 0-d array it is (not through its buffer, which for datetime64
    is its bytes as uint8), on numpy 1.x (no DLPack for scalars) as on 2.x."""
    _child(py, """
for x in [np.float16(1.5), np.bool_(True), np.complex64(2 - 1j), np.uint64(2**64 - 1),
          np.int8(-3), np.float64(-0.0)]:
    dlpack_ipc.publish("s", x, replace=True)
    t = dlpack_ipc.attach("s")
    a = np.asarray(x)
    assert (t.dtype, t.shape) == (a.dtype.name, ()), (x, t.dtype, t.shape)
    assert bytes(memoryview(t).cast("B")) == a.tobytes(), x
    del t
""")


def test_buffer_formats_dlpack_cannot_say_name_the_format(daemon, py):
    """An object without __dlpack__ whose buffer's format has no DLPack dtype: TypeError naming
    the format (before: the generic "supports neither DLPack" message)."""
    out = _child(py, """
import array, ctypes
for x in [memoryview(b"ab").cast("c"), array.array("u", "ab"), memoryview(bytes(8)).cast("P"),
          (ctypes.c_char * 2)(), ctypes.c_longdouble(1)]:
    try:
        dlpack_ipc.publish("f", x)
    except TypeError as e:
        assert "format '" in str(e), e
        print(e)
    else:
        raise SystemExit(f"{x!r} was published")
assert dlpack_ipc.list() == []
""")
    assert out.count("format '") == 5, out


def test_testbuffer_arrays(daemon, py):
    """_testbuffer's ndarray hands out exactly what a request asks for: 2-d buffers publish as
    they are; a PIL-style one (suboffsets) is refused. (A buffer without strides is the
    datetime64 scalar's, above.)"""
    cp = py.run("import _testbuffer")
    if cp.returncode != 0:
        pytest.skip("skipped: this interpreter has no _testbuffer (Debian's python3 has it)")
    _child(py, """
import _testbuffer as tb
# ndim 2, C-contiguous, formats numpy and DLPack both know
for fmt, items in [("i", list(range(6))), ("d", [0.5 * i for i in range(6)]),
                   ("?", [True, False] * 3)]:
    nd = tb.ndarray(items, shape=[2, 3], format=fmt)
    dlpack_ipc.publish("tb", nd, replace=True)
    t = dlpack_ipc.attach("tb")
    a = np.asarray(nd)
    assert (t.dtype, t.shape) == (a.dtype.name, (2, 3)), (fmt, t.dtype, t.shape)
    assert bytes(memoryview(t).cast("B")) == a.tobytes(), fmt
    del t
# a PIL-style (suboffsets) buffer cannot be had with the request publish makes
nd = tb.ndarray(list(range(6)), shape=[2, 3], format="i", flags=tb.ND_PIL)
try:
    dlpack_ipc.publish("pil", nd)
except (TypeError, BufferError) as e:
    print(e)
else:
    raise SystemExit("a PIL-style buffer was published")
""")


def test_a_release_during_torch_or_dlpack_is_not_a_use_after_free(daemon, py):
    """release() run by Python code inside .torch() (a gc callback during torch.from_dlpack) or
    inside __dlpack__ (max_version's __index__): the call either fails with BufferError or hands
    out a view of its own, and nothing is freed under it (before: a freed struct was shared and
    the interpreter aborted within a few hundred rounds)."""
    out = _child(py, """
import gc
try:
    import torch
except ImportError:
    torch = None
dlpack_ipc.publish("bl", np.array([True, False, True]), replace=True)
dlpack_ipc.publish("f", np.array([1.0, 2.0, 3.0]), replace=True)
outcomes = {}
for i in range(300):
    st = dlpack_ipc.attach("bl")
    armed = [True]
    x = None
    def cb(phase, info):
        if armed[0] and phase == "start":
            armed[0] = False
            st.release()
    if torch is not None:
        gc.callbacks[:] = [cb]
        gc.set_threshold(1, 1, 1)
        try:
            x = st.torch()
            assert x.tolist() == [True, False, True], x
            outcomes["torch view"] = outcomes.get("torch view", 0) + 1
        except BufferError:
            outcomes["torch refused"] = outcomes.get("torch refused", 0) + 1
        finally:
            gc.set_threshold(700, 10, 10)
            gc.callbacks[:] = []
        del x
    st = dlpack_ipc.attach("f")
    class H:
        def __index__(self):
            st.release()
            return 0            # a legacy capsule, which numpy 1.x takes too
    cap = st.__dlpack__(max_version=(H(), 0))
    assert st.released
    a = np.from_dlpack(type("C", (), {"__dlpack__": lambda self, **kw: cap,
                                      "__dlpack_device__": lambda self: (1, 0)})())
    assert a.tolist() == [1.0, 2.0, 3.0]
    del a, cap
    outcomes["dlpack view"] = outcomes.get("dlpack view", 0) + 1
gc.collect()
assert [e.refs for e in dlpack_ipc.list()] == [0, 0], dlpack_ipc.list()
print(outcomes)
""")
    assert "'dlpack view': 300" in out, out


@pytest.mark.parametrize("items", ['[["k", np.zeros(1)]]', '[1]', '[("a",)]',
                                   '[("a", np.zeros(1), "extra")]', '["ab"]'])
def test_a_mapping_whose_items_are_not_pairs(daemon, py, items):
    """A mapping whose items() gives something other than (key, tensor) pairs: a list pair is
    taken as a pair, anything else is TypeError naming it (before: a segfault, or a third item
    silently dropped); nothing is published or sent."""
    out = _child(py, f"""
class M:
    def items(self):
        return {items}
    def keys(self):
        return [kv[0] for kv in self.items()]
    def __getitem__(self, k):
        return np.zeros(1)
ch = dlpack_ipc.channel("c")
for what, call in [("publish_dict", lambda: dlpack_ipc.publish_dict("m", M())),
                   ("send_dict", lambda: ch.send_dict(M(), timeout=0))]:
    try:
        call()
    except TypeError as e:
        assert "(key, tensor) pairs" in str(e), e
        print(what, "TypeError")
    else:
        print(what, "ok")
""")
    if items.startswith('[["k"'):
        assert out.count(" ok") == 2, out
    else:
        assert out.count("TypeError") == 2, out


def test_a_mapping_that_changes_its_items_list_during_the_call(daemon, py):
    """items() returns a list the mapping keeps, and a value's __dlpack__ empties it during the
    call: what the call took is what goes (its own copy), with no use-after-free (before:
    double free)."""
    _child(py, """
import gc
L = []
class H:
    def __dlpack__(self, **kw):
        L.clear()
        gc.collect()
        return np.arange(3.0).__dlpack__()
    def __dlpack_device__(self):
        return (1, 0)
class M:
    def items(self):
        return L
    def keys(self):
        return [k for k, _ in L]
    def __getitem__(self, k):
        return dict(L)[k]
for i in range(20):
    L[:] = [("firstkeykeykey", H())] + [("k%d" % j + "x" * 20, np.full(1000, j))
                                         for j in range(50)]
    dlpack_ipc.publish_dict("uaf", M(), replace=True)
    d = dlpack_ipc.attach_dict("uaf")
    assert len(d) == 51 and np.asarray(d["k7" + "x" * 20])[0] == 7
    assert np.asarray(d["firstkeykeykey"]).tolist() == [0.0, 1.0, 2.0]
    for t in d.values():
        t.release()
""")


def test_channel_counts_are_not_taken_modulo_anything(daemon, py):
    """capacity and producers past what fits: ValueError giving the value as passed (before:
    2**64 + 4 became 4, and -1 read as 18446744073709551615)."""
    out = _child(py, """
for kw, v in [("capacity", 2**64 + 4), ("capacity", -1), ("producers", 2**64 + 2),
              ("producers", -5), ("capacity", 10**30)]:
    try:
        dlpack_ipc.channel("c" + str(abs(v) % 97), **{kw: v})
    except ValueError as e:
        assert str(v) in str(e) and kw in str(e), e
        print("refused", e)
    else:
        raise SystemExit(f"{kw}={v} was taken")
try:
    dlpack_ipc.channel("f", capacity=2.5)
except TypeError as e:
    print("refused", e)
assert dlpack_ipc.channel("ok", capacity=4).capacity == 4
""")
    assert out.count("refused") == 6, out
