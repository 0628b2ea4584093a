# SPDX-License-Identifier: Apache-2.0
"""CUDA tensors through dlpack_ipc, in separate interpreters, against the fake CUDA driver.

torch.cuda and CuPy need a GPU, so the producer here is a small object exposing __dlpack__ and
__dlpack_device__ over memory from the fake driver (tests/fake_cuda), whose device pointers are
host addresses. What the module asked of the driver is read back from the fake's log.
"""
import json
import os
import subprocess
import textwrap
import time

import numpy as np
import pytest

FAKE = os.environ.get("FAKE_CUDA_LIB")

pytestmark = pytest.mark.skipif(
    not FAKE, reason="FAKE_CUDA_LIB is not set: run this file through CTest (test 'python')")

# A DLPack producer over fake device memory, for the child interpreters.
PRODUCER = r'''
import ctypes, os, sys
from ctypes import (CFUNCTYPE, POINTER, Structure, c_float, c_int, c_int32, c_int64, c_size_t,
                    c_uint8, c_uint16, c_uint32, c_uint64, c_void_p)

kDLCUDA = 2
fake = ctypes.CDLL(os.environ["DLPC_CUDA_LIBRARY"])
fake.cuInit(0)

class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]

class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]

class DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32),
                ("dtype", DLDataType), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]

class Version(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]

class Managed(Structure):
    pass

DELETER = CFUNCTYPE(None, POINTER(Managed))
Managed._fields_ = [("version", Version), ("manager_ctx", c_void_p), ("deleter", DELETER),
                    ("flags", c_uint64), ("dl_tensor", DLTensor)]

api = ctypes.pythonapi
api.PyCapsule_New.restype = ctypes.py_object
api.PyCapsule_New.argtypes = [c_void_p, ctypes.c_char_p, c_void_p]
api.PyCapsule_GetPointer.restype = c_void_p
api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

_keep = {}
deleted = []

@DELETER
def _deleter(p):
    deleted.append(ctypes.addressof(p.contents))
    marker = os.environ.get("DELETED_MARKER")
    if marker:
        open(marker, "w").close()

class FakeCudaArray:
    """n float32 at `offset` bytes into a fresh fake-device allocation of `alloc` bytes."""
    def __init__(self, n, offset=0, alloc=1 << 20):
        base = ctypes.c_uint64()
        assert fake.cuMemAlloc_v2(ctypes.byref(base), c_size_t(alloc)) == 0
        self.ptr = base.value + offset
        self.n = n
        self.streams = []
        vals = (c_float * n).from_address(self.ptr)
        for i in range(n):
            vals[i] = i * 0.5
    def __dlpack_device__(self):
        return (kDLCUDA, 0)
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.streams.append(stream)
        m = Managed()
        shape = (c_int64 * 1)(self.n)
        m.version = Version(1, 0)
        m.deleter = _deleter
        m.dl_tensor = DLTensor(self.ptr, DLDevice(kDLCUDA, 0), 1, DLDataType(2, 32, 1),
                               shape, None, 0)
        _keep[ctypes.addressof(m)] = (m, shape)
        return api.PyCapsule_New(ctypes.addressof(m), b"dltensor_versioned", None)

class PoolArray(FakeCudaArray):
    """n float32 from a stream-ordered pool (cuMemAllocAsync), which CUDA IPC cannot export."""
    def __init__(self, n):
        base = ctypes.c_uint64()
        assert fake.cuMemAllocAsync(ctypes.byref(base), c_size_t(1 << 20), None) == 0
        self.ptr, self.n, self.streams = base.value, n, []

def capsule_floats(cap, n):
    m = Managed.from_address(api.PyCapsule_GetPointer(cap, b"dltensor_versioned"))
    return list((c_float * n).from_address(m.dl_tensor.data))

def log_lines(text):
    me = "%d " % os.getpid()
    with open(os.environ["FAKE_CUDA_LOG"]) as f:
        return [l for l in f if l.startswith(me) and text in l]
'''


@pytest.fixture
def gpu_env(tmp_path):
    return {"DLPC_CUDA_LIBRARY": FAKE, "FAKE_CUDA_LOG": str(tmp_path / "fake_cuda.log"),
            "DELETED_MARKER": str(tmp_path / "deleted"), "GO": str(tmp_path / "go")}


def child(code):
    return PRODUCER + textwrap.dedent(code)


def wait_file(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def with_publisher(ipc, py, gpu_env, tmp_path, name, consumer, array="FakeCudaArray(100)",
                   check="pass"):
    """Publish `array` as name from a child interpreter (then `check`, one line, runs there),
    which stays until the entry is reclaimed and the producer's deleter has run; run `consumer`
    in another; then unpublish and see the publisher end well."""
    ready = str(tmp_path / "ready")
    pub = py.popen(child(f"""
        import dlpack_ipc, time
        a = {array}
        assert dlpack_ipc.publish({name!r}, a) == 1
        {check}
        open({ready!r}, "w").close()
        # idle until the entry is reclaimed: the deleter runs on libdlpc's thread
        deadline = time.monotonic() + 20
        while not deleted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert deleted, "the producer's deleter never ran"
    """), env=gpu_env)
    try:
        wait_file(ready)
        py.check(child(consumer), env=gpu_env)
        ipc.unpublish(name)
        out, err = pub.communicate(timeout=30)
        assert pub.returncode == 0, err
    finally:
        if pub.poll() is None:
            pub.kill()
            pub.wait()


def test_publish_attach_streams(ipc, py, gpu_env, tmp_path):
    # the producer was asked for its work ordered before the legacy default stream
    with_publisher(ipc, py, gpu_env, tmp_path, "pgpu/a", """
            import dlpack_ipc, numpy as np
            t = dlpack_ipc.attach("pgpu/a")
            assert t.device == "cuda:0", t.device
            assert t.__dlpack_device__() == (2, 0)
            assert t.shape == (100,)
            # no host access to device memory, no ambiguous stream, no copy
            for bad, exc in [(lambda: memoryview(t), BufferError),
                             (lambda: t.__dlpack__(stream=0), ValueError),
                             (lambda: t.__dlpack__(stream=1, copy=True), BufferError)]:
                try:
                    bad()
                except exc:
                    pass
                else:
                    raise AssertionError("no %s" % exc.__name__)
            # attach itself waited for nothing
            assert not log_lines("cuStreamWaitEvent") and not log_lines("cuEventSynchronize")
            s = ctypes.c_void_p()
            assert fake.cuStreamCreate(ctypes.byref(s), 0) == 0
            cap = t.__dlpack__(stream=s.value, max_version=(1, 0))
            assert capsule_floats(cap, 100) == [i * 0.5 for i in range(100)]
            assert len(log_lines("cuStreamWaitEvent stream=%#x " % s.value)) == 1
            t.__dlpack__(stream=None, max_version=(1, 0))
            t.__dlpack__(stream=1, max_version=(1, 0))
            assert len(log_lines("cuStreamWaitEvent stream=0x1 ")) == 2
            t.__dlpack__(stream=2, max_version=(1, 0))
            assert len(log_lines("cuStreamWaitEvent stream=0x2 ")) == 1
            t.__dlpack__(stream=-1, max_version=(1, 0))
            assert len(log_lines("cuStreamWaitEvent")) == 4
            # the host never waited
            assert not log_lines("cuEventSynchronize")
            assert len(log_lines("cuIpcOpenMemHandle")) == 1
        """,
                   array="FakeCudaArray(100, offset=1000)",
                   check="assert a.streams == [1], a.streams")


def test_stream_destroyed_before_the_array_is_dropped(ipc, py, gpu_env, tmp_path):
    """CuPy's `with cupy.cuda.Stream(): y = cupy.from_dlpack(t)` then `del y` later: the
    stream is destroyed when the block ends, before the deleter runs, which must not touch it
    (the fake aborts, as the real driver may crash)."""
    with_publisher(ipc, py, gpu_env, tmp_path, 'pgpu/s', """
            import dlpack_ipc, gc, time
            arrays = []
            for flags in (0, 1):  # blocking (CuPy's default), then CU_STREAM_NON_BLOCKING
                t = dlpack_ipc.attach("pgpu/s")
                s = ctypes.c_void_p()
                assert fake.cuStreamCreate(ctypes.byref(s), flags) == 0
                cap = t.__dlpack__(stream=s.value, max_version=(1, 0))
                assert capsule_floats(cap, 100) == [i * 0.5 for i in range(100)]
                # the `with` block ends: the stream goes, the array lives on
                assert fake.cuStreamDestroy_v2(s) == 0
                arrays += [t, cap]
            assert dlpack_ipc.stat()["references"] == 2
            del t, cap
            arrays.clear()
            gc.collect()
            # released by libdlpc's thread, with the consumer still connected
            deadline = time.monotonic() + 10
            while dlpack_ipc.stat()["references"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert dlpack_ipc.stat()["references"] == 0
            assert not log_lines("use-after-destroy")
            # a blocking stream's release waits on the legacy stream, a non-blocking one's on
            # the whole context
            assert [l for l in log_lines("cuEventRecord") if "stream=0x1" in l.split()]
            assert log_lines("cuCtxSynchronize")
        """)


def test_attach_names_the_consumer_stream(ipc, py, gpu_env, tmp_path):
    """attach(stream=s): s waits for the publisher at once (no host wait), and the release
    follows the work queued on s even when s is non-blocking and the tensor reaches its
    consumer without __dlpack__(stream=s) (the exchange API, a capsule taken with stream=None):
    a read queued on s behind a long kernel is still to run when the tensor is dropped, and
    the fake aborts if the memory goes before it."""
    with_publisher(ipc, py, gpu_env, tmp_path, 'pgpu/st', """
            import dlpack_ipc, gc, time
            fake.fake_cuda_read_later.argtypes = [c_void_p, c_void_p, c_void_p, c_size_t]
            fake.fake_cuda_stream_hold.argtypes = [c_void_p, c_int]
            for bad in (0, -1, True, "1", 1.5):
                try:
                    dlpack_ipc.attach("pgpu/st", stream=bad)
                except ValueError:
                    pass
                else:
                    raise AssertionError(f"stream={bad!r} accepted")
            s = ctypes.c_void_p()
            assert fake.cuStreamCreate(ctypes.byref(s), 1) == 0  # CU_STREAM_NON_BLOCKING
            t = dlpack_ipc.attach("pgpu/st", stream=s.value)
            assert len(log_lines("cuStreamWaitEvent stream=%#x " % s.value)) == 1
            assert not log_lines("cuEventSynchronize")
            cap = t.__dlpack__(stream=None, max_version=(1, 0))  # the legacy stream's
            ptr = Managed.from_address(api.PyCapsule_GetPointer(cap, b"dltensor_versioned"))
            got = (c_float * 100)()
            fake.fake_cuda_stream_hold(s, 1)
            fake.fake_cuda_read_later(s, ptr.dl_tensor.data, ctypes.addressof(got), 400)
            del t, cap, ptr
            gc.collect()
            time.sleep(0.2)
            assert dlpack_ipc.stat()["references"] == 1  # the read is still queued
            fake.fake_cuda_stream_hold(s, 0)
            deadline = time.monotonic() + 10
            while dlpack_ipc.stat()["references"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert dlpack_ipc.stat()["references"] == 0
            assert list(got) == [i * 0.5 for i in range(100)]
            assert not log_lines("freed-under-pending-work")
        """)


def test_releases_held_through_a_capture_on_a_non_blocking_stream(ipc, py, gpu_env, tmp_path):
    """cuda_releases_held(): tensors dropped while another thread captures a graph on a
    non-blocking stream, one read on a non-blocking stream (its context synchronization would
    invalidate the capture: the fake logs it, as the driver does it on an H200) and one on the
    legacy stream, are released only once the outer block of nested holds ends."""
    with_publisher(ipc, py, gpu_env, tmp_path, 'pgpu/cap', """
            import dlpack_ipc, gc, time
            fake.fake_cuda_capture.argtypes = [c_void_p, c_int]
            side, cap = ctypes.c_void_p(), ctypes.c_void_p()
            assert fake.cuStreamCreate(ctypes.byref(side), 1) == 0  # CU_STREAM_NON_BLOCKING
            assert fake.cuStreamCreate(ctypes.byref(cap), 1) == 0
            a = dlpack_ipc.attach("pgpu/cap", stream=side.value)
            b = dlpack_ipc.attach("pgpu/cap", stream=1)

            def refs_become(n):
                deadline = time.monotonic() + 10
                while dlpack_ipc.stat()["references"] != n and time.monotonic() < deadline:
                    time.sleep(0.01)
                return dlpack_ipc.stat()["references"] == n

            with dlpack_ipc.cuda_releases_held():
                with dlpack_ipc.cuda_releases_held():
                    fake.fake_cuda_capture(cap, 1)
                    del a, b
                    gc.collect()
                    time.sleep(0.2)
                    assert dlpack_ipc.stat()["references"] == 2
                    fake.fake_cuda_capture(cap, 0)
                time.sleep(0.2)
                assert dlpack_ipc.stat()["references"] == 2  # the outer hold still holds
            assert refs_become(0)
            assert not log_lines("capture-invalidated")
            assert log_lines("cuCtxSynchronize")
        """)


def test_attach_stream_is_ignored_for_host_entries(ipc):
    """stream= names a CUDA stream: a host entry attaches as without it."""
    ipc.publish("pgpu/host", np.arange(4, dtype=np.float32))
    ipc.publish_dict("pgpu/hostd", {"a": np.ones(2, dtype=np.int64)})
    t = ipc.attach("pgpu/host", stream=12345)
    d = ipc.attach_dict("pgpu/hostd", stream=12345)
    assert np.from_dlpack(t).tolist() == [0, 1, 2, 3]
    assert np.from_dlpack(d["a"]).tolist() == [1, 1]
    t.release()
    d["a"].release()
    ipc.unpublish("pgpu/host")
    ipc.unpublish("pgpu/hostd")


def test_empty_on_cuda_outlives_publisher(ipc, py, gpu_env):
    py.check(child("""
        import dlpack_ipc
        w = dlpack_ipc.watch("pgpu/")
        t = dlpack_ipc.empty((64,), "float32", device="cuda:0")
        assert t.device == "cuda:0"
        ptr = Managed.from_address(api.PyCapsule_GetPointer(
            t.__dlpack__(stream=-1, max_version=(1, 0)), b"dltensor_versioned")).dl_tensor.data
        (c_float * 64).from_address(ptr)[:] = [float(i) for i in range(64)]
        assert dlpack_ipc.publish("pgpu/v", t) == 1
        assert len(log_lines("cuMemCreate")) == 1
        assert [e.device for e in dlpack_ipc.list("pgpu/v")] == ["cuda:0"]
        # a watcher is told the device as list() says it (before: "other")
        ev = w.next_event(timeout=5)
        assert (ev.kind, ev.name, ev.device) == ("published", "pgpu/v", "cuda:0"), ev
        w.close()
    """), env=gpu_env)
    py.check(child("""
        import dlpack_ipc
        t = dlpack_ipc.attach("pgpu/v")
        assert t.device == "cuda:0"
        assert capsule_floats(t.__dlpack__(max_version=(1, 0)), 64) == [float(i) for i in range(64)]
        assert len(log_lines("cuMemImportFromShareableHandle")) == 1
        # shared in place: "read" and "strict" are read-only attaches, "private" is refused
        assert (t.mode, t.readonly) == ("read", True)
        s = dlpack_ipc.attach("pgpu/v", mode="strict")
        assert (s.mode, s.readonly) == ("strict", True)
        try:
            dlpack_ipc.attach("pgpu/v", mode="private")
        except BufferError as e:
            assert "copy-on-write" in str(e) and "CUDA" in str(e), e
        else:
            raise AssertionError("a copy-on-write attach of CUDA memory succeeded")
    """), env=gpu_env)
    with pytest.raises(ValueError):
        ipc.empty((4,), "float32", device="cuda:x")


def test_refused_cuda_publish_gives_the_producer_back(ipc, py, gpu_env):
    """A CUDA publish that is refused (here stream-ordered pool memory; expandable segments'
    several VMM mappings take the same path) runs the producer's deleter exactly once, before
    publish raises."""
    py.check(child("""
        import dlpack_ipc, gc, weakref
        a = PoolArray(16)
        alive = weakref.ref(a)
        try:
            dlpack_ipc.publish("pgpu/refused", a)
        except BufferError as e:
            refused = e
            assert "stream-ordered pool" in str(e), e
            # the deleter ran once, inside publish
            assert len(deleted) == 1, deleted
        else:
            raise AssertionError("stream-ordered pool memory was published")
        del a, refused
        gc.collect()
        assert alive() is None
        assert len(deleted) == 1, deleted
        assert not dlpack_ipc.list("pgpu/refused")
    """), env=gpu_env)


def test_refused_cuda_publish_frees_while_the_exception_lives(ipc, py, gpu_env):
    """A refused CUDA publish leaves the producer to its caller at once: while the exception is
    still alive (inside the except block, where a caller falls back to a copy that needs the
    memory), no frame of dlpack_ipc's in its traceback (publish(), publish_dict(), published())
    keeps the producer."""
    py.check(child("""
        import dlpack_ipc, weakref
        for how in ("publish", "publish_dict", "published"):
            a = PoolArray(16)
            alive = weakref.ref(a)
            try:
                if how == "publish":
                    dlpack_ipc.publish("pgpu/refused", a)
                elif how == "publish_dict":  # a bundle is copied, pool memory too, but not
                    # across devices
                    dlpack_ipc.publish_dict("pgpu/refused", {"w": a, "b": bytearray(8)})
                else:
                    with dlpack_ipc.published("pgpu/refused", a):
                        pass
            except BufferError as e:
                assert "stream-ordered pool" in str(e) or "one device" in str(e), e
                del a
                assert alive() is None, (how, e.__traceback__)
            else:
                raise AssertionError(f"{how} was not refused")
    """), env=gpu_env)


def test_no_driver(ipc, py, gpu_env):
    env = dict(gpu_env, DLPC_CUDA_LIBRARY="/nonexistent/libcuda.so.1")
    py.check(child("""
        import dlpack_ipc, errno
        try:
            dlpack_ipc.empty((4,), "float32", device="cuda:0")
        except OSError as e:
            assert e.errno == errno.ENODEV, e
            assert "CUDA driver (/nonexistent/libcuda.so.1) not found" in str(e), e
        else:
            raise AssertionError("empty() on cuda without a driver succeeded")
    """).replace('fake = ctypes.CDLL(os.environ["DLPC_CUDA_LIBRARY"])\nfake.cuInit(0)', ""),
        env=env)


def test_cuda_state_dict(ipc, py, gpu_env):
    """A dict of CUDA producers (a state dict on cuda:0) as one bundle, attached whole."""
    py.check(child("""
        import dlpack_ipc
        sd = {"w": FakeCudaArray(100, offset=1000), "b": FakeCudaArray(10, offset=4)}
        assert dlpack_ipc.publish_dict("pgpu/sd", sd) == 1
        # copied into one VMM allocation on the device, the producers given back at once
        assert len(log_lines("cuMemcpyDtoD")) == 2 and len(log_lines("cuMemCreate")) == 1
        assert len(deleted) == 2
    """), env=gpu_env)
    py.check(child("""
        import dlpack_ipc
        d = dlpack_ipc.attach_dict("pgpu/sd")
        assert sorted(d) == ["b", "w"], d
        assert d["w"].device == "cuda:0" and d["w"].shape == (100,)
        assert capsule_floats(d["w"].__dlpack__(max_version=(1, 0)), 100) == \\
            [i * 0.5 for i in range(100)]
        assert capsule_floats(d["b"].__dlpack__(max_version=(1, 0)), 10) == \\
            [i * 0.5 for i in range(10)]
        assert len(log_lines("cuMemImportFromShareableHandle")) == 1
    """), env=gpu_env)


def test_dlpackctl_check_finds_entries_whose_device_went_away(ipc, py, gpu_env, tmp_path):
    """Without persistence mode the driver frees exported memory once the device's last process
    exits (the fake models it with FAKE_CUDA_DEVICE_STATE): the VMM entry still lists, but no
    longer imports. `dlpackctl check` says which, attaches say why, and rm clears it."""
    ctl_bin = os.environ["DLPACKCTL_BIN"]
    env = dict(gpu_env, FAKE_CUDA_DEVICE_STATE=str(tmp_path / "device"),
               READY=str(tmp_path / "ready"))

    def check(*args):
        return subprocess.run([ctl_bin, "check", *args], capture_output=True, text=True,
                              timeout=60, env={**os.environ, **env}, stdin=subprocess.DEVNULL)

    # a process that keeps the device up (as nvidia-persistenced would) while the publisher exits
    holder = py.popen(child("""
        import time
        open(os.environ["READY"], "w").close()  # up: fake.cuInit ran above
        while not os.path.exists(os.environ["GO"]):
            time.sleep(0.01)
    """), env=env)
    try:
        wait_file(env["READY"])
        py.check(child("""
            import dlpack_ipc
            t = dlpack_ipc.empty((64,), "float32", device="cuda:0")
            assert dlpack_ipc.publish("pgpu/v", t) == 1
        """), env=env)
        ipc.publish("host/h", np.arange(4.0))
        cp = check()
        assert cp.returncode == 0, cp.stderr
        assert [l.split()[:2] for l in cp.stdout.splitlines()] == [["ok", "host/h"],
                                                                   ["ok", "pgpu/v"]], cp.stdout
    finally:
        open(gpu_env["GO"], "w").close()
        assert holder.wait(timeout=30) == 0
    # nobody holds the device now: the next process to use it starts it anew
    cp = check("--json")
    assert cp.returncode == 1, cp
    got = {e["name"]: e for e in json.loads(cp.stdout)}
    assert got["host/h"]["state"] == "ok" and got["host/h"]["error"] is None
    dead = got["pgpu/v"]
    assert (dead["state"], dead["device"], dead["generation"]) == ("failed", "cuda:0", 1), dead
    assert "persistence mode" in dead["error"] and "not running as seen from here" in \
        dead["error"], dead
    assert "1 of 2 entries cannot be attached" in cp.stderr, cp.stderr
    py.check(child("""
        import dlpack_ipc
        try:
            dlpack_ipc.attach("pgpu/v")
        except OSError as e:
            assert "cuMemImportFromShareableHandle" in str(e), e
            assert "nvidia-persistenced" in str(e), e
        else:
            raise AssertionError("an entry whose device was torn down attached")
    """), env=env)
    ipc.unpublish("pgpu/v")
    cp = check("pgpu/")
    assert (cp.returncode, cp.stdout) == (0, ""), cp


def test_exchange_api_orders_cuda_tensors(ipc, py, gpu_env, tmp_path):
    """The DLPack C exchange API's exports do no synchronization of their own: its consumer
    launches on current_work_stream()'s stream (NULL, the legacy default stream). That stream
    waits for the publisher's event before a CUDA SharedTensor is first handed out (once: the
    order lasts), and the tensor's release waits for the work queued there, which follows
    every blocking stream (a held one: a long kernel)."""
    ready, go = str(tmp_path / "ready"), str(tmp_path / "go")
    pub = py.popen(child(f"""
        import dlpack_ipc, time
        a = FakeCudaArray(100)
        assert dlpack_ipc.publish("pgpu/x", a) == 1
        print(os.getpid(), flush=True)
        open({ready!r}, "w").close()
        while not os.path.exists({go!r}):
            time.sleep(0.01)
    """), env=gpu_env)
    try:
        wait_file(ready)
        pub_pid = int(pub.stdout.readline())
        py.check(child(f"""
            import dlpack_ipc
            from ctypes import POINTER, byref, py_object, pointer
            class API(Structure):
                _fields_ = [("major", c_uint32), ("minor", c_uint32), ("prev", c_void_p),
                            ("alloc", c_void_p), ("from_py", c_void_p), ("to_py", c_void_p),
                            ("dl_from_py", c_void_p), ("stream", c_void_p)]
            cap = dlpack_ipc.SharedTensor.__dlpack_c_exchange_api__
            xapi = API.from_address(api.PyCapsule_GetPointer(cap, b"dlpack_exchange_api"))
            FROM_PY = ctypes.PYFUNCTYPE(c_int, py_object, POINTER(POINTER(Managed)))
            DL_FROM_PY = ctypes.PYFUNCTYPE(c_int, py_object, POINTER(DLTensor))
            STREAM = ctypes.PYFUNCTYPE(c_int, c_int32, c_int32, POINTER(c_void_p))
            waits = lambda: [l for l in log_lines("cuStreamWaitEvent stream=0x1 ")
                             if "event={pub_pid}:" in l]
            t = dlpack_ipc.attach("pgpu/x")
            assert t.device == "cuda:0" and waits() == []
            s = c_void_p(1234)
            assert STREAM(xapi.stream)(kDLCUDA, 0, byref(s)) == 0 and s.value is None
            out = POINTER(Managed)()
            assert FROM_PY(xapi.from_py)(t, byref(out)) == 0
            assert len(waits()) == 1, waits()
            vals = (c_float * 100).from_address(out.contents.dl_tensor.data)
            assert vals[99] == 99 * 0.5
            dl = DLTensor()
            assert DL_FROM_PY(xapi.dl_from_py)(t, byref(dl)) == 0
            assert len(waits()) == 1 and dl.data == out.contents.dl_tensor.data
            # a long kernel runs on a blocking stream: the release comes after it, since it
            # follows an event on the legacy stream
            s = c_void_p()
            assert fake.cuStreamCreate(byref(s), 0) == 0
            fake.fake_cuda_stream_hold(s, 1)
            out.contents.deleter(out)
            t.release()
            assert [l for l in log_lines("cuEventRecord") if "stream=0x1 " in l], \
                log_lines("cuEventRecord")
            time.sleep(0.3)
            assert not log_lines("cuIpcCloseMemHandle"), "released while the kernel ran"
            fake.fake_cuda_stream_hold(s, 0)
            deadline = time.monotonic() + 10
            while not log_lines("cuIpcCloseMemHandle") and time.monotonic() < deadline:
                time.sleep(0.01)
            assert log_lines("cuIpcCloseMemHandle")
            # the library's thread sleeps on its release event (cuEventSynchronize): no stream
            # or context of the consumer's was synchronized
            syncs = [l for l in log_lines("Synchronize") if "cuEventSynchronize" not in l]
            assert not syncs, syncs
        """).replace("import ctypes, os, sys", "import ctypes, os, sys, time"), env=gpu_env)
    finally:
        open(go, "w").close()
        pub.wait(timeout=30)


def test_empty_dict_on_cuda_is_a_bucket_published_as_it_is(ipc, py, gpu_env):
    py.check(child("""
        import dlpack_ipc
        d = dlpack_ipc.empty_dict({"w": ((100,), "float32"), "b": ((10,), "float32")},
                                  device="cuda:0")
        assert [t.device for t in d.values()] == ["cuda:0", "cuda:0"]
        for k, n in (("w", 100), ("b", 10)):
            ptr = Managed.from_address(api.PyCapsule_GetPointer(
                d[k].__dlpack__(stream=-1, max_version=(1, 0)),
                b"dltensor_versioned")).dl_tensor.data
            (c_float * n).from_address(ptr)[:] = [i * 0.5 for i in range(n)]
        assert dlpack_ipc.publish_dict("pgpu/bucket", d) == 1
        # one VMM allocation, published by its export fd: no device copy, no wait
        assert len(log_lines("cuMemCreate")) == 1 and not log_lines("cuMemcpyDtoD")
        assert not log_lines("Synchronize"), log_lines("Synchronize")
    """), env=gpu_env)
    py.check(child("""
        import dlpack_ipc
        d = dlpack_ipc.attach_dict("pgpu/bucket")
        assert capsule_floats(d["w"].__dlpack__(max_version=(1, 0)), 100) == \\
            [i * 0.5 for i in range(100)]
        assert capsule_floats(d["b"].__dlpack__(max_version=(1, 0)), 10) == \\
            [i * 0.5 for i in range(10)]
        assert len(log_lines("cuMemImportFromShareableHandle")) == 1
    """), env=gpu_env)


def test_producer_from_before_dlpack_1_still_orders_its_work(ipc, py, gpu_env):
    """A CUDA producer whose __dlpack__ knows no max_version is still asked for its work
    ordered before the legacy default stream (stream=1)."""
    py.check(child("""
        import dlpack_ipc
        class OldProducer(FakeCudaArray):
            def __dlpack__(self, stream=None):
                return FakeCudaArray.__dlpack__(self, stream=stream)
        a = OldProducer(16)
        assert dlpack_ipc.publish("pgpu/old", a) == 1
        assert a.streams == [1], a.streams
    """), env=gpu_env)
