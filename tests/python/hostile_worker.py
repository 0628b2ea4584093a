# SPDX-License-Identifier: Apache-2.0
"""The interpreter test_hostile_property.py runs for one surface, so that a crash is a failed test
with the example that caused it, not a dead pytest:

    python3 hostile_worker.py SURFACE MAX_EXAMPLES     (DLPACKD_SOCKET names the daemon)

SURFACE is publish, publish_dict, send, attach (its modes and arguments) or tensor (empty()'s
shape and dtype, a SharedTensor's __dlpack__ keywords). Hypothesis draws objects of every kind a user
or a hostile producer can hand the module (numpy arrays and scalars of every dtype and byte
order, their views, memoryviews of every format, array.array, ctypes, objects whose __dlpack__
or __dlpack_device__ misbehave, hand-made DLPack capsules with any fields) and each call must
end in an exception or a faithful copy: the name attached (in each attach mode) or the message
received holds the same dtype, shape and bytes. Where the object is a plain native numeric
array, the copy is required. Before each example its description goes to stderr, so the last
line of a crash names its cause.
"""
import array
import ctypes
import datetime
import sys

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import hypothesis.extra.numpy as hnp

import dlpack_ipc

# ---- what a faithful copy is -------------------------------------------------------------

# buffer-protocol formats the module publishes (native order); every other is refused
_FORMATS = set("?bhilqnBHILQNefd") | {"Zf", "Zd"}
_DL_NAMES = {(0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
             (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
             (2, 16): "float16", (2, 32): "float32", (2, 64): "float64",
             (5, 64): "complex64", (5, 128): "complex128", (6, 8): "bool"}


class Expect:
    """What a publish of an object may give: dtype name, shape and bytes of its copy, and
    whether it must succeed (None: it must fail or nothing is known but that it must not crash)."""

    def __init__(self, dtype=None, shape=None, data=None, must=False):
        self.dtype, self.shape, self.data, self.must = dtype, shape, data, must


def _numpy_expect(a, must=True):
    a = np.asarray(a)
    if a.dtype.kind not in "biufc" or a.dtype.itemsize > 16 or a.dtype.fields:
        return Expect()
    if a.dtype.kind == "f" and a.dtype.itemsize > 8 or a.dtype.kind == "c" and a.dtype.itemsize > 16:
        return Expect()
    # (not ascontiguousarray: numpy 1.x makes a 0-d array 1-d)
    n = a.astype(a.dtype.newbyteorder("="), order="C")
    return Expect(n.dtype.name, a.shape, n.tobytes(), must)


def _buffer_expect(obj):
    m = memoryview(obj)
    fmt = m.format
    if fmt[:1] in "@=<":
        fmt = fmt[1:]
    if fmt not in _FORMATS:
        return Expect()
    try:
        a = np.asarray(m)
    except Exception:  # noqa: BLE001 - numpy cannot say it either: nothing to compare with
        return Expect()
    e = _numpy_expect(a)
    if e.dtype is not None:
        e.data = m.tobytes()  # numpy agrees on dtype and shape; the bytes are the buffer's
    return e


# ---- the objects -------------------------------------------------------------------------

_shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)
_dtypes = st.one_of(
    hnp.scalar_dtypes(), hnp.byte_string_dtypes(max_len=3), hnp.unicode_string_dtypes(max_len=3),
    hnp.datetime64_dtypes(), hnp.timedelta64_dtypes(),
    hnp.integer_dtypes(endianness="?"), hnp.unsigned_integer_dtypes(endianness="?"),
    hnp.floating_dtypes(endianness="?", sizes=(16, 32, 64)),
    hnp.complex_number_dtypes(endianness="?"), hnp.array_dtypes(max_size=3),
    st.sampled_from([np.dtype(object), np.dtype("V3"), np.dtype([]), np.dtype("?"),
                     np.dtype(np.longdouble), np.dtype(np.clongdouble)]))


@st.composite
def numpy_arrays(draw):
    dt = draw(_dtypes)
    shape = draw(_shapes)
    if dt.kind == "O":
        a = np.empty(shape, dt)
        a.fill(draw(st.sampled_from([0, None, "x", 1.5])))
    elif dt.itemsize == 0 or dt.kind == "V" and not dt.fields:
        a = np.zeros(shape, dt)
    else:
        a = draw(hnp.arrays(dt, shape))
    how = draw(st.sampled_from(["as is", "reversed", "step", "transposed", "broadcast",
                                "read-only", "scalar", "field"]))
    if how == "reversed" and a.ndim:
        a = a[::-1]
    elif how == "step" and a.ndim:
        a = a[..., ::-2]
    elif how == "transposed":
        a = a.T
    elif how == "broadcast":
        a = np.broadcast_to(a, (2,) + a.shape)
    elif how == "read-only":
        a = a.copy()
        a.setflags(write=False)
    elif how == "scalar" and a.size:
        a = a.reshape(-1)[0]  # a numpy scalar (or the object an object array holds)
    elif how == "field" and a.dtype.fields:
        a = a[next(iter(a.dtype.fields))]
    e = _numpy_expect(a, must=isinstance(a, (np.ndarray, np.generic)))
    return f"numpy {how} {dt.str} {np.shape(a)}", a, e


# formats memoryview.cast() takes
_CASTS = list("bBhHiIlLqQnNfd?cP")


@st.composite
def memoryviews(draw):
    fmt = draw(st.sampled_from(_CASTS))
    size = memoryview(bytes(16)).cast(fmt).itemsize
    # cast() takes extents > 0 (shape [] is 0-d); None: 1-d, of 0 to 4 items
    shape = draw(st.one_of(st.none(), st.lists(st.integers(1, 3), min_size=0, max_size=3)))
    n = draw(st.integers(0, 4)) if shape is None else int(np.prod(shape))
    raw = bytearray(draw(st.binary(min_size=n * size, max_size=n * size)))
    m = memoryview(raw).cast(fmt) if shape is None else memoryview(raw).cast(fmt, shape)
    how = draw(st.sampled_from(["as is", "reversed", "step", "read-only", "bytes"]))
    if how == "reversed" and m.ndim == 1:
        m = m[::-1]
    elif how == "step" and m.ndim == 1:
        m = m[::2]
    elif how == "read-only":
        m = m.toreadonly()
    elif how == "bytes":
        m = memoryview(bytes(raw))
    return f"memoryview {how} {m.format!r} {m.shape}", m, _buffer_expect(m)


@st.composite
def other_buffers(draw):
    kind = draw(st.sampled_from(["array", "ctypes array", "ctypes scalar", "ctypes struct",
                                 "numpy memoryview", "bytes", "bytearray"]))
    if kind == "array":
        code = draw(st.sampled_from(array.typecodes))
        k = draw(st.integers(0, 4))
        obj = array.array(code, "ab" if code in "uw" else [0.5] * k if code in "fd" else [1] * k)
    elif kind == "ctypes array":
        t = draw(st.sampled_from([ctypes.c_int, ctypes.c_double, ctypes.c_bool, ctypes.c_char,
                                  ctypes.c_longdouble, ctypes.c_void_p, ctypes.c_uint16]))
        obj = (t * draw(st.integers(0, 3)) * draw(st.integers(1, 2)))()
    elif kind == "ctypes scalar":
        obj = draw(st.sampled_from([ctypes.c_int8, ctypes.c_float, ctypes.c_long,
                                    ctypes.c_wchar, ctypes.c_longdouble]))()
    elif kind == "ctypes struct":
        class S(ctypes.Structure):
            _fields_ = [("a", ctypes.c_int), ("b", ctypes.c_double)]
        obj = (S * 2)()
    elif kind == "numpy memoryview":
        _, a, _ = draw(numpy_arrays())
        try:
            obj = memoryview(a)
        except (TypeError, ValueError, BufferError):
            obj = a
    elif kind == "bytes":
        obj = draw(st.binary(max_size=8))
    else:
        obj = bytearray(draw(st.binary(max_size=8)))
    try:
        e = _buffer_expect(obj)
    except (TypeError, ValueError, BufferError):
        e = Expect()
    return f"{kind} {type(obj).__name__}", obj, e


# -- producers that misbehave, and capsules made by hand --

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", _DELETER)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]

_keep = []  # what hand-made capsules point at, kept for the life of the worker
deleted = []  # the hand-made tensors whose deleter ran, once per run


@_DELETER
def _deleter(ptr):
    deleted.append(ptr)


_INT64_MAX = 2**63 - 1


@st.composite
def crafted_capsules(draw):
    """A DLPack capsule with fields drawn from good and bad values; where the fields describe a
    small valid tensor its bytes are really there (a producer that lies about its memory cannot
    be defended against), where they describe a huge one data is NULL."""
    versioned = draw(st.booleans())
    ndim = draw(st.sampled_from([0, 1, 2, 3, 4, -1, 33, 1000]))
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**62, _INT64_MAX]),
                          min_size=max(ndim, 0) if 0 <= ndim <= 4 else 0, max_size=4))
    code, bits = draw(st.sampled_from(sorted(_DL_NAMES) + [(2, 8), (0, 0), (99, 8), (0, 7)]))
    lanes = draw(st.sampled_from([1, 1, 1, 0, 2]))
    device = draw(st.sampled_from([1, 1, 1, 2, 13, 99]))
    shape_null = draw(st.booleans()) and ndim > 0 and draw(st.booleans())
    strides_kind = draw(st.sampled_from(["none", "c", "zero"]))
    major = draw(st.sampled_from([1, 1, 1, 0, 2]))
    with_deleter = draw(st.booleans())
    n = max(ndim, len(shape), 1)
    dims = (ctypes.c_int64 * n)(*(shape + [1] * (n - len(shape))))
    ext = list(dims)[:max(ndim, 0)]
    # what libdlpc will make of it (proto/util.c's dlpc__tensor_nbytes)
    nbytes, valid = None, 0 <= ndim <= 32 and bits * lanes > 0 and not shape_null
    if valid and any(e < 0 for e in ext):
        valid = False
    if valid:
        prod = 1
        for e in ext:
            prod *= e or 1
        valid = prod <= _INT64_MAX and bits * lanes * prod < 2**64
        nbytes = 0 if 0 in ext else (bits * lanes * prod + 7) // 8
    small = valid and nbytes <= 4096
    buf = (ctypes.c_uint8 * max(nbytes if small else 1, 1))()
    if small:
        ctypes.memmove(buf, draw(st.binary(min_size=nbytes, max_size=nbytes)), nbytes)
    strides = None
    if strides_kind != "none" and 0 < ndim <= 32 and small:
        s, acc = [], 1
        for e in reversed(ext):
            s.insert(0, acc if strides_kind == "c" else 0)
            acc *= e or 1
        strides = (ctypes.c_int64 * ndim)(*s)
    t = _DLTensor(ctypes.cast(buf, ctypes.c_void_p) if small else None, _DLDevice(device, 0),
                  ndim, _DLDataType(code, bits, lanes), None if shape_null else dims, strides, 0)
    if versioned:
        m = _DLManagedTensorVersioned(major, 0, None, _deleter if with_deleter else _DELETER(),
                                      draw(st.sampled_from([0, 1, 2, 3])), t)
        name = b"dltensor_versioned"
    else:
        m = _DLManagedTensor(t, None, _deleter if with_deleter else _DELETER())
        name = b"dltensor"
    _keep.append((buf, dims, strides, m))
    cap = _capsule_new(ctypes.addressof(m), name, None)
    e = Expect()
    if (small and device == 1 and (code, bits) in _DL_NAMES and lanes == 1
            and (major == 1 or not versioned)):
        # zero strides: every element is the first one
        if strides_kind == "zero" and ndim > 0 and nbytes:
            data = bytes(buf)[:bits // 8] * (nbytes // (bits // 8))
        else:
            data = bytes(buf)[:nbytes]
        e = Expect(_DL_NAMES[code, bits], tuple(ext), data, must=True)
    return (f"capsule versioned={versioned} major={major} ndim={ndim} shape={ext} "
            f"shape_null={shape_null} dtype=({code},{bits},{lanes}) device={device} "
            f"strides={strides_kind} deleter={with_deleter}"), cap, e


class Producer:
    """An object whose __dlpack__ and __dlpack_device__ do what the example says."""

    def __init__(self, export, device):
        self._export, self._device = export, device

    def __dlpack__(self, **kw):
        return self._export(**kw)

    def __dlpack_device__(self):
        if isinstance(self._device, type) and issubclass(self._device, BaseException):
            raise self._device("no device")
        return self._device


class NotCallable:
    __dlpack__ = 5


def _raise(exc):
    def f(**kw):
        raise exc("refused by the test")
    return f


@st.composite
def producers(draw):
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    kind = draw(st.sampled_from(["honest", "raises", "wrong name", "used", "other type",
                                 "not a capsule", "crafted", "not callable", "legacy only"]))
    device = draw(st.sampled_from([(1, 0), (1, 0), (2, 0), (99, 0), (1,), "cpu", (2**80, 0),
                                   ("1", 0), ValueError, AttributeError, None]))
    e = Expect()
    if kind == "honest":
        export = a.__dlpack__
        if device == (1, 0) or device is AttributeError:
            e = _numpy_expect(a)
    elif kind == "legacy only":
        def export(**kw):  # a producer from before DLPack 1.0
            if "max_version" in kw:
                raise TypeError("unexpected keyword max_version")
            return a.__dlpack__()
        if device == (1, 0) or device is AttributeError:
            e = _numpy_expect(a)
    elif kind == "raises":
        export = _raise(draw(st.sampled_from([BufferError, TypeError, ValueError, RuntimeError,
                                              KeyError, ZeroDivisionError, MemoryError])))
    elif kind == "wrong name":
        n = draw(st.sampled_from([b"dltensor_x", b"DLTENSOR", b"", b"used_dltensor_versioned"]))
        cap = _capsule_new(ctypes.addressof(_keep_buf), n, None)
        export = lambda **kw: cap  # noqa: E731
    elif kind == "used":
        cap = np.arange(3.0).__dlpack__()
        _capsule_set_name(cap, b"used_dltensor")
        export = lambda **kw: cap  # noqa: E731
    elif kind == "other type":
        cap = draw(st.sampled_from([datetime.datetime_CAPI,
                                    dlpack_ipc.SharedTensor.__dlpack_c_exchange_api__]))
        export = lambda **kw: cap  # noqa: E731
    elif kind == "not a capsule":
        v = draw(st.sampled_from([None, 42, "dltensor", b"dltensor", a]))
        export = lambda **kw: v  # noqa: E731
    elif kind == "crafted":
        desc, cap, ce = draw(crafted_capsules())
        export = lambda **kw: cap  # noqa: E731
        if device == (1, 0) or device is AttributeError:
            e = ce
        kind += " " + desc
    else:
        return "producer not callable", NotCallable(), Expect()
    # device AttributeError: as if it had no __dlpack_device__ (an old producer)
    p = Producer(export, device)
    e.must = False  # a producer's promise is not the module's
    return f"producer {kind} device={device}", p, e


_keep_buf = (ctypes.c_uint8 * 64)()

objects = st.one_of(numpy_arrays(), memoryviews(), other_buffers(), producers(),
                    crafted_capsules())


# ---- the surfaces ------------------------------------------------------------------------

def _same(t, e, what):
    """t (a SharedTensor) holds the faithful copy e describes."""
    assert (t.dtype, tuple(t.shape)) == (e.dtype, tuple(e.shape)), \
        f"{what}: got {t.dtype} {t.shape}, expected {e.dtype} {e.shape}"
    got = bytes(memoryview(t).cast("B")) if e.data else b""
    assert got == e.data, f"{what}: the bytes differ: {got[:64]!r} vs {e.data[:64]!r}"


def _outcome(desc, e, call):
    """Run call(); an exception is fine unless e.must; return whether it published."""
    try:
        call()
    except Exception as ex:  # noqa: BLE001 - any Python exception is an answer
        assert not e.must, f"{desc}: refused what must publish: {type(ex).__name__}: {ex}"
        return False
    assert e.dtype is not None or not e.must, desc
    return True


_modes = st.sampled_from(["read", "private", "strict", "write"])


def _note(desc):
    print(desc, file=sys.stderr, flush=True)


def _dtype_name(dtype):
    """The dtype empty() makes of dtype, as SharedTensor.dtype names it."""
    s = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None) or str(dtype)
    return s[len("torch."):] if s.startswith("torch.") else s


def _reserves_much(shape):
    """Would empty(shape, ...) reserve more than 1 MiB that the machine has? (It reserves what it
    is asked for: a few GiB that fit would be taken from the machine.)"""
    ext = [shape] if isinstance(shape, int) else shape if isinstance(shape, (list, tuple)) else []
    if not ext or not all(isinstance(e, int) for e in ext) or any(e < 0 for e in ext):
        return False
    n = 16  # the widest dtype's bytes
    for e in ext:
        n *= e
    return 2**20 < n < 2**64


def _deleted_once(desc):
    """No hand-made tensor's deleter ran twice (each is at its own address, kept alive)."""
    assert len(set(deleted)) == len(deleted), f"{desc}: a deleter ran twice"


def run(surface, n):
    _settings = settings(deadline=None, derandomize=True, database=None, max_examples=n,
                         suppress_health_check=list(HealthCheck))
    ch = dlpack_ipc.channel("hostile/c", 4) if surface == "send" else None

    @_settings
    @given(objects, _modes, st.booleans())
    def publish(o, mode, writable):
        desc, obj, e = o
        _note(f"publish {desc} mode={mode} writable={writable}")
        ok = _outcome(desc, e, lambda: dlpack_ipc.publish("hostile/p", obj, replace=True,
                                                           writable=writable))
        _deleted_once(desc)
        if not ok:
            return
        if e.dtype is None:
            return  # published what nothing here describes: enough that it did not crash
        if mode == "write" and not writable:
            try:
                dlpack_ipc.attach("hostile/p", mode=mode)
            except PermissionError:
                return
        t = dlpack_ipc.attach("hostile/p", mode=mode)
        _same(t, e, desc)
        t.release()

    @_settings
    @given(objects, _modes)
    def publish_dict(o, mode):
        desc, obj, e = o
        _note(f"publish_dict {desc} mode={mode}")
        other = np.arange(5, dtype=np.int16)
        ok = _outcome(desc, e, lambda: dlpack_ipc.publish_dict(
            "hostile/d", {"x": obj, "y": other}, replace=True, writable=True))
        _deleted_once(desc)
        if not ok:
            return
        d = dlpack_ipc.attach_dict("hostile/d", mode=mode)
        assert sorted(d) == ["x", "y"], desc
        _same(d["y"], _numpy_expect(other), desc + " (its neighbour)")
        if e.dtype is not None:
            _same(d["x"], e, desc)
        for t in d.values():
            t.release()

    @_settings
    @given(objects, st.sampled_from(["read", "private", "strict"]))
    def send(o, mode):
        desc, obj, e = o
        _note(f"send {desc} mode={mode}")
        ok = _outcome(desc, e, lambda: ch.send(obj, timeout=0))
        _deleted_once(desc)
        if not ok:
            assert ch.stat().depth == 0, f"{desc}: a refused send left a message"
            return
        t = ch.recv(timeout=0, mode=mode)
        if e.dtype is not None:
            _same(t, e, desc)
        t.release()

    @_settings
    @given(st.one_of(st.text(max_size=8), st.none(), st.integers(), st.binary(max_size=4)),
           st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=3)),
           st.one_of(st.none(), st.integers(-2**70, 2**70), st.text(max_size=3),
                     st.floats(allow_nan=True)),
           st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True),
                     st.integers(-2**70, 2**70), st.text(max_size=2)))
    def attach(mode, writable, owner, timeout):
        # the attach modes' arguments, arbitrary: an entry or an exception
        _note(f"attach mode={mode!r} writable={writable!r} owner={owner!r} "
              f"timeout={timeout!r}")
        kw = {"mode": mode, "writable": writable, "owner": owner, "timeout": timeout}
        kw = {k: v for k, v in kw.items() if v is not None}
        if timeout is None or (isinstance(timeout, (int, float)) and timeout == timeout
                               and timeout > 0.01):
            kw["timeout"] = 0.01  # a wait for a name that never comes (None: forever)
        for name in ["hostile/a", "hostile/none"]:
            try:
                t = dlpack_ipc.attach(name, **kw)
            except Exception:  # noqa: BLE001 - any Python exception is an answer
                continue
            _same(t, _numpy_expect(np.arange(4.0)), f"attach {kw}")
            t.release()

    # extents small, negative or huge enough that the byte count overflows
    _extent = st.one_of(st.integers(-3, 64), st.integers(2**62, 2**70),
                        st.integers(-2**70, -2**62))
    _anything = st.one_of(st.none(), st.booleans(), _extent,
                          st.text(max_size=4), st.binary(max_size=4),
                          st.floats(allow_nan=True, allow_infinity=True),
                          st.tuples(_extent, _extent),
                          st.lists(_extent, max_size=40),
                          st.sampled_from([np.float32, np.dtype(">i4"), np.dtype("M8[s]"),
                                           "float32", "bool", "int4", object, (1, 0), (2, 0),
                                           (1, 0, 0), ("1", 0)]))

    @_settings
    @given(_anything, _anything, st.dictionaries(
        st.sampled_from(["stream", "max_version", "dl_device", "copy"]), _anything))
    def tensor(shape, dtype, dlpack_kw):
        # empty()'s shape and dtype, and a SharedTensor's __dlpack__ keywords, arbitrary
        _note(f"tensor shape={shape!r} dtype={dtype!r} __dlpack__({dlpack_kw!r})")
        if _reserves_much(shape):
            shape = (2, 3)
        try:
            t = dlpack_ipc.empty(shape, dtype)
        except Exception:  # noqa: BLE001 - any Python exception is an answer
            t = dlpack_ipc.empty((2, 3), "float32")
        else:
            assert t.dtype == _dtype_name(dtype), (t.dtype, dtype)
        try:
            cap = t.__dlpack__(**dlpack_kw)
        except Exception:  # noqa: BLE001
            cap = None
        if cap is not None:
            assert type(cap).__name__ == "PyCapsule", type(cap)
        del cap
        t.release()

    if surface == "attach":
        dlpack_ipc.publish("hostile/a", np.arange(4.0), writable=True)
    fn = {"publish": publish, "publish_dict": publish_dict, "send": send, "attach": attach,
          "tensor": tensor}
    fn[surface]()
    print(f"{surface}: {n} examples, no crash; {len(deleted)} hand-made tensors deleted")


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]))
