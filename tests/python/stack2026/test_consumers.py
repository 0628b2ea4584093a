# SPDX-License-Identifier: Apache-2.0
"""numpy 2 and torch 2 as consumers of tensors another process published.

Run on the venv's stack only (tests/pystack.sh, tests/python/requirements-venv.txt): Debian's
numpy 1.24 makes every from_dlpack array read-only and asks for the legacy capsule, and its torch
1.13 has neither bool nor uint16..64 in DLPack nor the C exchange API.
"""
import ctypes
import gc
from ctypes import PYFUNCTYPE, POINTER, byref, c_char_p, c_int, c_uint32, c_void_p, py_object

import numpy as np
import pytest
import torch

import dlpack_ipc


def test_the_venv_has_the_2026_stack():
    # what the rest of this directory relies on, so that a wrong venv says so first
    assert int(np.__version__.split(".")[0]) >= 2, np.__version__
    assert int(torch.__version__.split(".")[0]) >= 2, torch.__version__


def test_numpy2_honours_read_only(ipc, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("np2/r", np.arange(24, dtype=np.int32).reshape(4, 6), writable=True)
    """)
    t = ipc.attach("np2/r")
    a = np.from_dlpack(t)
    assert a.ctypes.data == t.data_ptr, "zero-copy"
    assert not a.flags.writeable, "the versioned capsule's read-only flag is honoured"
    with pytest.raises(ValueError, match="read-only"):
        a[0, 0] = -1
    # numpy 2 passes copy=True on: a private, writable copy
    c = np.from_dlpack(t, copy=True)
    assert c.flags.writeable and c.ctypes.data != t.data_ptr
    c[0, 0] = -1
    # and device="cpu" as dl_device
    d = np.from_dlpack(t, device="cpu")
    assert d.ctypes.data == t.data_ptr
    # a writable attach gives a writable array, whose writes another process sees
    w = np.from_dlpack(ipc.attach("np2/r", writable=True))
    assert w.flags.writeable
    w[3, 5] = 1000
    cp = py.check("""
        import numpy as np, dlpack_ipc
        a = np.from_dlpack(dlpack_ipc.attach("np2/r"))
        print(int(a[0, 0]), int(a[3, 5]))
    """)
    assert cp.stdout.split() == ["0", "1000"], "the private copy stayed private"


def test_torch2_bool_and_unsigned_dtypes(ipc, py):
    py.check("""
        import torch, dlpack_ipc
        dlpack_ipc.publish("t2/bool", torch.tensor([[True, False, True], [False, False, True]]))
        for dt in (torch.uint16, torch.uint32, torch.uint64):
            big = torch.iinfo(dt).max if dt is not torch.uint64 else 2**63
            dlpack_ipc.publish("t2/" + str(dt)[6:],
                               torch.tensor([0, 1, 7, big], dtype=dt).reshape(2, 2))
    """)
    t = ipc.attach("t2/bool")
    assert t.dtype == "bool"
    x = torch.from_dlpack(t)
    assert x.dtype == torch.bool and x.data_ptr() == t.data_ptr
    assert x.tolist() == [[True, False, True], [False, False, True]]
    a = np.from_dlpack(t)
    assert a.dtype == np.bool_ and a.tolist() == x.tolist()
    for dt in (torch.uint16, torch.uint32, torch.uint64):
        name = str(dt)[6:]
        t = ipc.attach("t2/" + name)
        assert t.dtype == name
        x = torch.from_dlpack(t)
        big = torch.iinfo(dt).max if dt is not torch.uint64 else 2**63
        assert x.dtype == dt and x.data_ptr() == t.data_ptr
        assert np.from_dlpack(t).tolist() == [[0, 1], [7, big]]


# ---- the DLPack C exchange API: torch's table and ours, used by C code as a consumer would ----

_api = ctypes.pythonapi
_api.PyCapsule_GetPointer.restype = c_void_p
_api.PyCapsule_GetPointer.argtypes = [py_object, c_char_p]
_api.Py_DecRef.argtypes = [py_object]
FROM_PY = PYFUNCTYPE(c_int, py_object, POINTER(c_void_p))
TO_PY = PYFUNCTYPE(c_int, c_void_p, POINTER(py_object))


def exchange_table(tp):
    """(major, minor), from_py, to_py of the type's __dlpack_c_exchange_api__ (DLPack 1.2
    layout: version, prev_api, allocator, from_py, to_py, ...)."""
    p = _api.PyCapsule_GetPointer(tp.__dlpack_c_exchange_api__, b"dlpack_exchange_api")
    fn = [c_void_p.from_address(p + 8 * i).value for i in range(2, 5)]
    version = (c_uint32.from_address(p).value, c_uint32.from_address(p + 4).value)
    return version, FROM_PY(fn[1]), TO_PY(fn[2])


def to_py(fn, mt):
    obj = py_object()
    assert fn(mt, byref(obj)) == 0
    o = obj.value
    _api.Py_DecRef(o)  # the reference written into obj's slot, now held by o
    return o


def test_torch_exchange_api_takes_a_shared_tensor(ipc, daemon, py):
    """Our from_py, then torch's own to_py: a torch.Tensor on the shared memory without a
    Python __dlpack__ call, whose deleter gives the daemon's reference back."""
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("xa/t", np.arange(60, dtype=np.float32).reshape(3, 4, 5))
    """)
    ours, our_from, _ = exchange_table(dlpack_ipc.SharedTensor)
    theirs, _, torch_to = exchange_table(torch.Tensor)
    assert ours[0] == theirs[0] == 1, (ours, theirs)
    t = ipc.attach("xa/t")
    mt = c_void_p()
    assert our_from(t, byref(mt)) == 0
    x = to_py(torch_to, mt)
    assert type(x) is torch.Tensor
    assert x.dtype == torch.float32 and tuple(x.shape) == (3, 4, 5)
    assert x.data_ptr() == t.data_ptr
    assert torch.equal(x, torch.arange(60, dtype=torch.float32).reshape(3, 4, 5))
    t.release()
    del t
    gc.collect()
    assert float(x.sum()) == float(sum(range(60))), "torch's tensor keeps the mapping"
    assert daemon.stat()["references"] == 1
    del x
    daemon.wait_stat(lambda s: s["references"] == 0, what="torch's deleter released it")


def test_our_exchange_api_refuses_torch_memory(ipc):
    """torch's from_py, then our to_py: not libdlpc memory, refused with BufferError."""
    _, _, our_to = exchange_table(dlpack_ipc.SharedTensor)
    _, torch_from, _ = exchange_table(torch.Tensor)
    src = torch.arange(4)
    mt = c_void_p()
    assert torch_from(src, byref(mt)) == 0
    obj = py_object()
    with pytest.raises(BufferError, match="only hold memory made by dlpack_ipc"):
        our_to(mt, byref(obj))
    assert src.tolist() == [0, 1, 2, 3]
