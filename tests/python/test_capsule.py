# SPDX-License-Identifier: Apache-2.0
"""The DLPack protocol at C level: capsules, versions, flags, keywords, the C exchange API."""
import ctypes
from ctypes import (CFUNCTYPE, POINTER, PYFUNCTYPE, Structure, byref, c_char_p, c_int, c_int32,
                    c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p, py_object)

import numpy as np
import pytest
import torch

import dlpack_ipc

READ_ONLY = 1 << 0
IS_COPIED = 1 << 1
kDLCPU = 1


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32),
                ("dtype", DLDataType), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure):
    pass


DELETER_V = PYFUNCTYPE(None, POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", c_void_p),
    ("flags", c_uint64), ("dl_tensor", DLTensor)]


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackExchangeAPI(Structure):
    _fields_ = [("version", DLPackVersion), ("prev_api", c_void_p),
                ("managed_tensor_allocator", c_void_p),
                ("managed_tensor_from_py_object_no_sync", c_void_p),
                ("managed_tensor_to_py_object_no_sync", c_void_p),
                ("dltensor_from_py_object_no_sync", c_void_p),
                ("current_work_stream", c_void_p)]


# Called with the GIL held (PYFUNCTYPE): they take Python objects.
FROM_PY = PYFUNCTYPE(c_int, py_object, POINTER(POINTER(DLManagedTensorVersioned)))
TO_PY = PYFUNCTYPE(c_int, POINTER(DLManagedTensorVersioned), POINTER(py_object))
DLTENSOR_FROM_PY = PYFUNCTYPE(c_int, py_object, POINTER(DLTensor))
WORK_STREAM = PYFUNCTYPE(c_int, c_int, c_int32, POINTER(c_void_p))
SET_ERROR = CFUNCTYPE(None, c_void_p, c_char_p, c_char_p)
ALLOCATOR = PYFUNCTYPE(c_int, POINTER(DLTensor), POINTER(POINTER(DLManagedTensorVersioned)),
                       c_void_p, SET_ERROR)

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = c_void_p
_api.PyCapsule_GetPointer.argtypes = [py_object, c_char_p]
_api.PyCapsule_GetName.restype = c_char_p
_api.PyCapsule_GetName.argtypes = [py_object]
_api.PyCapsule_IsValid.restype = c_int
_api.PyCapsule_IsValid.argtypes = [py_object, c_char_p]
_api.PyCapsule_New.restype = py_object
_api.PyCapsule_New.argtypes = [c_void_p, c_char_p, c_void_p]
_api.Py_DecRef.restype = None
_api.Py_DecRef.argtypes = [py_object]


def capsule_name(cap):
    return _api.PyCapsule_GetName(cap).decode()


def versioned(cap):
    ptr = _api.PyCapsule_GetPointer(cap, b"dltensor_versioned")
    return ctypes.cast(ptr, POINTER(DLManagedTensorVersioned)).contents


def legacy(cap):
    ptr = _api.PyCapsule_GetPointer(cap, b"dltensor")
    return ctypes.cast(ptr, POINTER(DLManagedTensor)).contents


def check_dltensor(dl, t, shape, code, bits):
    assert dl.data == t.data_ptr
    assert (dl.device.device_type, dl.device.device_id) == (kDLCPU, 0)
    assert dl.ndim == len(shape)
    assert [dl.shape[i] for i in range(dl.ndim)] == list(shape)
    assert (dl.dtype.code, dl.dtype.bits, dl.dtype.lanes) == (code, bits, 1)
    assert dl.byte_offset == 0
    # strides (in elements) are filled and C-contiguous
    assert dl.strides
    expect, acc = [], 1
    for n in reversed(shape):
        expect.insert(0, acc)
        acc *= n
    assert [dl.strides[i] for i in range(dl.ndim)] == expect


@pytest.fixture
def published(ipc, py):
    """A 3x4x5 float32 entry "cap/x" (writable-publishable), published by another process."""
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("cap/x", np.arange(60, dtype=np.float32).reshape(3, 4, 5),
                           writable=True)
    """)
    return "cap/x"


def test_versioned_capsule_fields(ipc, published):
    t = ipc.attach(published)
    cap = t.__dlpack__(max_version=(1, 0))
    assert capsule_name(cap) == "dltensor_versioned"
    mt = versioned(cap)
    assert mt.version.major == 1
    assert mt.flags & READ_ONLY, "read-only attach must set DLPACK_FLAG_BITMASK_READ_ONLY"
    assert not mt.flags & IS_COPIED
    assert mt.deleter
    check_dltensor(mt.dl_tensor, t, (3, 4, 5), code=2, bits=32)  # kDLFloat
    vals = np.ctypeslib.as_array(ctypes.cast(mt.dl_tensor.data, POINTER(ctypes.c_float)),
                                 shape=(60,))
    np.testing.assert_array_equal(vals, np.arange(60, dtype=np.float32))
    # a newer minor or major is answered with a 1.x versioned capsule too
    for mv in [(1, 7), (2, 0)]:
        c = t.__dlpack__(max_version=mv)
        assert capsule_name(c) == "dltensor_versioned"
        assert versioned(c).version.major == 1


def test_writable_attach_has_no_read_only_flag(ipc, published):
    t = ipc.attach(published, writable=True)
    assert t.readonly is False
    mt = versioned(t.__dlpack__(max_version=(1, 0)))
    assert not mt.flags & READ_ONLY
    check_dltensor(mt.dl_tensor, t, (3, 4, 5), code=2, bits=32)


@pytest.mark.parametrize("kw", [{}, {"max_version": None}, {"max_version": (0, 8)},
                                {"stream": None}, {"dl_device": (1, 0)}, {"copy": False}])
def test_legacy_capsule(ipc, published, kw):
    t = ipc.attach(published)
    cap = t.__dlpack__(**kw)
    assert capsule_name(cap) == "dltensor"
    mt = legacy(cap)
    assert mt.deleter
    check_dltensor(mt.dl_tensor, t, (3, 4, 5), code=2, bits=32)


def test_dtype_codes_in_capsule(ipc, py):
    py.check("""
        import numpy as np, torch, dlpack_ipc
        dlpack_ipc.publish_dict("codes", {
            "i8": np.zeros(2, np.int8), "u16": torch.zeros(2, dtype=torch.int16),
            "u8": np.zeros(2, np.uint8), "f16": np.zeros(2, np.float16),
            "c128": np.zeros(2, np.complex128), "bf16": torch.zeros(2, dtype=torch.bfloat16)})
    """)
    d = ipc.attach_dict("codes")
    want = {"i8": (0, 8), "u16": (0, 16), "u8": (1, 8), "f16": (2, 16), "c128": (5, 128),
            "bf16": (4, 16)}
    for k, (code, bits) in want.items():
        mt = versioned(d[k].__dlpack__(max_version=(1, 0)))
        check_dltensor(mt.dl_tensor, d[k], (2,), code=code, bits=bits)


def test_each_call_makes_a_distinct_capsule(ipc, published):
    t = ipc.attach(published)
    caps = [t.__dlpack__(), t.__dlpack__(), t.__dlpack__(max_version=(1, 0)),
            t.__dlpack__(max_version=(1, 0))]
    assert len({id(c) for c in caps}) == 4
    ptrs = [_api.PyCapsule_GetPointer(c, _api.PyCapsule_GetName(c)) for c in caps]
    assert len(set(ptrs)) == 4, "each capsule owns its own managed tensor"
    assert legacy(caps[0]).dl_tensor.data == versioned(caps[3]).dl_tensor.data == t.data_ptr


def test_consumed_capsules_are_renamed_and_released_once(ipc, daemon, published):
    t = ipc.attach(published)
    cap = t.__dlpack__()
    x = torch.utils.dlpack.from_dlpack(cap)
    assert capsule_name(cap) == "used_dltensor"
    del cap
    x2 = torch.from_dlpack(t)      # __dlpack__ + consume inside torch
    a = np.from_dlpack(t)          # and inside numpy
    unused = t.__dlpack__(max_version=(1, 0))  # never consumed: its destructor must free it
    t.release()
    import gc
    gc.collect()
    assert daemon.stat()["references"] == 1
    assert x[2, 3, 4].item() == 59.0 and x2.data_ptr() == x.data_ptr()
    np.testing.assert_array_equal(a.ravel(), np.arange(60))
    del x, x2, a
    gc.collect()
    assert daemon.stat()["references"] == 1, "the unconsumed capsule still holds the tensor"
    del unused
    daemon.wait_stat(lambda s: s["references"] == 0, what="references == 0")


def test_copy_true_gives_private_writable_copy(ipc, py, published):
    # in a child: a write through a wrong (shared, read-only) mapping would kill it with SIGSEGV
    cp = py.run("""
        import ctypes, numpy as np, dlpack_ipc
        from ctypes import POINTER, Structure, c_void_p, c_uint64, c_uint32, c_char_p, py_object
        class V(Structure):
            _fields_ = [("major", c_uint32), ("minor", c_uint32), ("ctx", c_void_p),
                        ("deleter", c_void_p), ("flags", c_uint64), ("data", c_void_p)]
        g = ctypes.pythonapi.PyCapsule_GetPointer
        g.restype, g.argtypes = c_void_p, [py_object, c_char_p]
        t = dlpack_ipc.attach("cap/x")
        cap = t.__dlpack__(max_version=(1, 0), copy=True)
        mt = ctypes.cast(g(cap, b"dltensor_versioned"), POINTER(V)).contents
        assert mt.major == 1
        assert mt.flags & 2, "IS_COPIED"
        assert not mt.flags & 1, "the copy is writable"
        assert mt.data != t.data_ptr
        assert ctypes.string_at(mt.data, 240) == ctypes.string_at(t.data_ptr, 240)
        ctypes.memset(mt.data, 0x7f, 240)
        np.testing.assert_array_equal(np.from_dlpack(t).ravel(), np.arange(60))
        del cap
        # a legacy copy too
        c2 = t.__dlpack__(copy=True)
        p = ctypes.cast(g(c2, b"dltensor"), POINTER(c_void_p))[0]
        assert p != t.data_ptr
        ctypes.memset(p, 0, 240)
        np.testing.assert_array_equal(np.from_dlpack(t).ravel(), np.arange(60))
        print("OK")
    """)
    assert cp.returncode == 0 and cp.stdout.split() == ["OK"], py.describe(cp)
    np.testing.assert_array_equal(np.from_dlpack(ipc.attach("cap/x")).ravel(), np.arange(60))


def test_dlpack_keywords(ipc, published):
    t = ipc.attach(published)
    assert t.__dlpack_device__() == (1, 0)
    assert all(isinstance(v, int) for v in t.__dlpack_device__())
    assert capsule_name(t.__dlpack__(dl_device=(1, 0), max_version=(1, 0))) == \
        "dltensor_versioned"
    assert capsule_name(t.__dlpack__(stream=None, max_version=None, dl_device=None,
                                     copy=None)) == "dltensor"
    with pytest.raises(TypeError):
        t.__dlpack__(foo=1)
    with pytest.raises(TypeError):
        t.__dlpack__(None)  # keyword-only
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        t.__dlpack__(stream=1)
    zc = versioned(t.__dlpack__(max_version=(1, 0), copy=False))
    assert zc.dl_tensor.data == t.data_ptr and not zc.flags & IS_COPIED


def test_release_and_context_manager(ipc, daemon, published):
    t = ipc.attach(published)
    assert published in repr(t)
    a = np.from_dlpack(t)
    t.release()
    t.release()  # idempotent
    with pytest.raises(BufferError):
        t.__dlpack__()
    with pytest.raises(BufferError):
        t.__dlpack__(max_version=(1, 0))
    with pytest.raises(BufferError):
        np.from_dlpack(t)
    np.testing.assert_array_equal(a.ravel(), np.arange(60))  # arrays keep their memory
    assert isinstance(repr(t), str)
    with ipc.attach(published) as t2:
        assert isinstance(t2, dlpack_ipc.SharedTensor)
        b = torch.from_dlpack(t2)
    with pytest.raises(BufferError):
        t2.__dlpack__()
    assert b.sum().item() == float(np.arange(60).sum())
    del a, b
    daemon.wait_stat(lambda s: s["references"] == 0, what="references == 0")


def test_publish_from_capsules_and_foreign_objects(ipc, py):
    # capsules made by numpy/torch (legacy) are accepted
    ipc.publish("in/cap", torch.utils.dlpack.to_dlpack(torch.arange(6, dtype=torch.int32)))
    # a hand-made legacy capsule of kDLBool, with a deleter that must run exactly once
    calls = []
    buf = (c_uint8 * 5)(1, 0, 1, 1, 0)
    shape = (c_int64 * 1)(5)
    mt = DLManagedTensor()
    mt.dl_tensor.data = ctypes.addressof(buf)
    mt.dl_tensor.device = DLDevice(kDLCPU, 0)
    mt.dl_tensor.ndim = 1
    mt.dl_tensor.dtype = DLDataType(6, 8, 1)
    mt.dl_tensor.shape = shape
    deleter = PYFUNCTYPE(None, c_void_p)(lambda p: calls.append(p))
    mt.deleter = ctypes.cast(deleter, c_void_p)
    cap = _api.PyCapsule_New(ctypes.addressof(mt), b"dltensor", None)
    assert ipc.publish("in/bool", cap) == 1
    assert calls == [ctypes.addressof(mt)], "the producer's deleter runs once, at publish"
    assert capsule_name(cap) == "used_dltensor"
    with pytest.raises((BufferError, ValueError, TypeError)):
        ipc.publish("in/again", cap)  # a consumed capsule cannot be published twice
    assert calls == [ctypes.addressof(mt)]
    cp = py.check("""
        import ctypes, numpy as np, dlpack_ipc
        t = dlpack_ipc.attach("in/bool")
        print(t.dtype, ctypes.string_at(t.data_ptr, 5).hex())
        print(np.from_dlpack(dlpack_ipc.attach("in/cap")).tolist())
    """)
    assert cp.stdout.split("\n")[:2] == ["bool 0100010100", "[0, 1, 2, 3, 4, 5]"]


# ---- the C exchange API --------------------------------------------------------------------


def exchange_api():
    cap = dlpack_ipc.SharedTensor.__dlpack_c_exchange_api__
    assert capsule_name(cap) == "dlpack_exchange_api"
    ptr = _api.PyCapsule_GetPointer(cap, b"dlpack_exchange_api")
    assert ptr
    return ctypes.cast(ptr, POINTER(DLPackExchangeAPI)).contents


def test_exchange_api_capsule_on_type(ipc, published):
    api = exchange_api()
    assert api.version.major == 1
    assert api.managed_tensor_from_py_object_no_sync
    assert api.managed_tensor_to_py_object_no_sync
    assert api.managed_tensor_allocator
    assert api.current_work_stream
    t = ipc.attach(published)
    assert type(t).__dlpack_c_exchange_api__ is dlpack_ipc.SharedTensor.__dlpack_c_exchange_api__
    stream = c_void_p(1234)
    assert WORK_STREAM(api.current_work_stream)(kDLCPU, 0, byref(stream)) == 0
    assert stream.value is None, "host memory has no stream"


def test_exchange_api_managed_tensor_from_py_object(ipc, daemon, published):
    api = exchange_api()
    t = ipc.attach(published)
    out = POINTER(DLManagedTensorVersioned)()
    rc = FROM_PY(api.managed_tensor_from_py_object_no_sync)(t, byref(out))
    assert rc == 0 and out
    mt = out.contents
    assert mt.version.major == 1
    assert mt.flags & READ_ONLY
    check_dltensor(mt.dl_tensor, t, (3, 4, 5), code=2, bits=32)
    assert ctypes.cast(mt.dl_tensor.data, POINTER(ctypes.c_float))[59] == 59.0
    # the managed tensor owns a reference of its own, independent of t
    t.release()
    import gc
    gc.collect()
    assert daemon.stat()["references"] == 1
    assert mt.deleter
    DELETER_V(mt.deleter)(out)
    daemon.wait_stat(lambda s: s["references"] == 0, what="deleter released the reference")
    # a released tensor cannot be exported this way either
    out2 = POINTER(DLManagedTensorVersioned)()
    with pytest.raises(BufferError):
        FROM_PY(api.managed_tensor_from_py_object_no_sync)(t, byref(out2))


def test_exchange_api_dltensor_and_to_py_object(ipc, published):
    api = exchange_api()
    t = ipc.attach(published)
    if api.dltensor_from_py_object_no_sync:  # optional in the DLPack spec
        dl = DLTensor()
        assert DLTENSOR_FROM_PY(api.dltensor_from_py_object_no_sync)(t, byref(dl)) == 0
        check_dltensor(dl, t, (3, 4, 5), code=2, bits=32)
    out = POINTER(DLManagedTensorVersioned)()
    assert FROM_PY(api.managed_tensor_from_py_object_no_sync)(t, byref(out)) == 0
    obj = py_object()
    assert TO_PY(api.managed_tensor_to_py_object_no_sync)(out, byref(obj)) == 0  # steals out
    o = obj.value
    _api.Py_DecRef(o)  # the new reference written into obj's slot, now held by o
    assert hasattr(o, "__dlpack__")
    a = np.from_dlpack(o)
    assert a.ctypes.data == t.data_ptr
    np.testing.assert_array_equal(a.ravel(), np.arange(60))
