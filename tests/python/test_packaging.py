# SPDX-License-Identifier: Apache-2.0
"""What the module is as installed: its version, and the one libdlpc it shares with C code.

Run on both stacks: Debian's (the build tree on PYTHONPATH, no distribution metadata) and the
virtual environment's (the project pip-installed; CTest sets DLPC_TEST_PIP_INSTALLED=1 there).
"""
import os
import subprocess
from importlib import metadata

import numpy as np

import dlpack_ipc

PIP_INSTALLED = os.environ.get("DLPC_TEST_PIP_INSTALLED") == "1"


def test_version_is_the_projects(dlpackd_bin):
    out = subprocess.run([dlpackd_bin, "--version"], capture_output=True, text=True, check=True)
    daemon_version = out.stdout.split()[1]
    assert dlpack_ipc.__version__ == daemon_version
    assert dlpack_ipc.libdlpc_version == daemon_version
    core = os.path.realpath(dlpack_ipc._core.__file__)
    if PIP_INSTALLED:
        # pip's record of the install: the version, and the files it would uninstall
        dist = metadata.distribution("dlpack-ipc")
        assert dist.version == dlpack_ipc.__version__
        files = {os.path.realpath(dist.locate_file(f)) for f in dist.files}
        assert core in files
        assert os.path.realpath(dlpack_ipc.__file__) in files
    else:
        # the build tree's module: nothing claims it
        for dist in metadata.distributions():
            assert dist.metadata["Name"] != "dlpack-ipc" or not any(
                os.path.realpath(dist.locate_file(f)) == core for f in dist.files or [])


def test_one_libdlpc_shared_with_c(ipc, py):
    """A process that imports dlpack_ipc and loads libdlpc.so.0 holds one copy of it: memory
    the C library allocates is memory the module recognises as its own (the exchange API's
    to_py takes nothing else), and what it publishes another process attaches."""
    cp = py.check("""
        import ctypes, os
        from ctypes import (POINTER, PYFUNCTYPE, Structure, byref, c_char_p, c_int, c_int32,
                            c_int64, c_uint8, c_uint16, c_void_p, py_object)
        import dlpack_ipc

        def mapped():
            return {l.split()[-1] for l in open("/proc/self/maps")
                    if os.path.basename(l.split()[-1]).startswith("libdlpc.so")}

        before = mapped()
        assert len(before) == 1, before
        lib = ctypes.CDLL("libdlpc.so.0")  # by SONAME: the copy the extension loaded
        assert mapped() == before, (before, mapped())

        class DLDevice(Structure):
            _fields_ = [("device_type", c_int32), ("device_id", c_int32)]

        class DLDataType(Structure):
            _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]

        lib.dlpc_alloc.restype = c_int
        lib.dlpc_alloc.argtypes = [c_void_p, DLDevice, DLDataType, c_int32, POINTER(c_int64),
                                   POINTER(c_void_p)]
        out = c_void_p()
        shape = (c_int64 * 1)(16)
        assert lib.dlpc_alloc(None, DLDevice(1, 0), DLDataType(0, 32, 1), 1, shape,
                              byref(out)) == 0
        # DLManagedTensorVersioned: version, manager_ctx, deleter, flags, then dl_tensor.data
        data = c_void_p.from_address(out.value + 32).value
        (c_int32 * 16).from_address(data)[:] = range(100, 116)

        api = ctypes.pythonapi
        api.PyCapsule_GetPointer.restype = c_void_p
        api.PyCapsule_GetPointer.argtypes = [py_object, c_char_p]
        api.Py_DecRef.argtypes = [py_object]
        table = api.PyCapsule_GetPointer(dlpack_ipc.SharedTensor.__dlpack_c_exchange_api__,
                                         b"dlpack_exchange_api")
        # header (version, prev_api), allocator, from_py, then to_py
        to_py = PYFUNCTYPE(c_int, c_void_p, POINTER(py_object))(
            c_void_p.from_address(table + 32).value)
        obj = py_object()
        assert to_py(out, byref(obj)) == 0, "libdlpc's memory was not recognised"
        t = obj.value
        api.Py_DecRef(t)
        dlpack_ipc.publish("pkg/from-c", t)
        print(before.pop())
    """)
    path = cp.stdout.strip()
    if PIP_INSTALLED:
        # the wheel's own copy, beside the extension
        assert os.path.dirname(path) == os.path.dirname(os.path.realpath(dlpack_ipc._core.__file__))
    a = np.from_dlpack(ipc.attach("pkg/from-c"))
    np.testing.assert_array_equal(a, np.arange(100, 116, dtype=np.int32))
