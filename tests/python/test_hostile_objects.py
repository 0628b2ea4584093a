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
