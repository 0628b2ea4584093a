# SPDX-License-Identifier: Apache-2.0
"""Which driver calls, made on another thread while a graph captures, lose the capture? The
capture rules of tests/fake_cuda were read off an H200 (driver 580) with this probe; run it again
on a new driver before trusting the fake's model there.

    python3 tests/gpu/capture_probe.py SCENARIO MODE KIND     one case, one line on stdout
    xargs -P 8 -L 1 python3 tests/gpu/capture_probe.py < tests/gpu/capture_probe.cases

One thread captures a torch CUDA graph (torch.cuda.graph: global capture mode) on a stream of
KIND (nonblocking: torch's side stream; blocking: a cuStreamCreate(0) stream); another thread, in
capture mode MODE (global, the default, or relaxed), makes the driver calls of SCENARIO meanwhile.
The line gives their CUresults and whether the capture survived. Needs torch with CUDA."""
import ctypes as C, sys, threading, subprocess, time
import torch

scen, mode, kind = sys.argv[1], sys.argv[2], sys.argv[3]
cu = C.CDLL("libcuda.so.1")
torch.cuda.init()
y = torch.ones(1 << 16, device="cuda")
torch.cuda.synchronize()
ctx = C.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(C.byref(ctx), 0) == 0
LEGACY = C.c_void_p(1)
prep = {}


def ev_recorded():
    ev = C.c_void_p()
    assert cu.cuEventCreate(C.byref(ev), 3) == 0
    assert cu.cuEventRecord(ev, LEGACY) == 0
    assert cu.cuEventSynchronize(ev) == 0
    return ev


class Prop(C.Structure):
    _fields_ = [("type", C.c_int), ("handles", C.c_int), ("loctype", C.c_int), ("locid", C.c_int),
                ("win32", C.c_void_p), ("ctype", C.c_ubyte), ("rdma", C.c_ubyte),
                ("usage", C.c_ushort), ("res", C.c_ubyte * 4)]


class Access(C.Structure):
    _fields_ = [("loctype", C.c_int), ("locid", C.c_int), ("flags", C.c_int)]


def vmm_prep():
    p = Prop(type=1, handles=1, loctype=1, locid=0)
    h, d = C.c_ulonglong(), C.c_ulonglong()
    sz = 2 << 20
    assert cu.cuMemCreate(C.byref(h), C.c_size_t(sz), C.byref(p), C.c_ulonglong(0)) == 0
    assert cu.cuMemAddressReserve(C.byref(d), C.c_size_t(sz), C.c_size_t(0), C.c_ulonglong(0),
                                  C.c_ulonglong(0)) == 0
    assert cu.cuMemMap(d, C.c_size_t(sz), C.c_size_t(0), h, C.c_ulonglong(0)) == 0
    a = Access(1, 0, 3)
    assert cu.cuMemSetAccess(d, C.c_size_t(sz), C.byref(a), C.c_size_t(1)) == 0
    return h, d, sz


class IpcHandle(C.Structure):
    _fields_ = [("reserved", C.c_char * 64)]     # CUipcMemHandle, passed by value


# another process's allocation, its IPC handle on stdout (a process cannot open its own)
CHILD = r'''
import ctypes as C, sys
cu = C.CDLL("libcuda.so.1"); cu.cuInit(0)
ctx = C.c_void_p(); cu.cuDevicePrimaryCtxRetain(C.byref(ctx), 0); cu.cuCtxSetCurrent(ctx)
d = C.c_ulonglong(); assert cu.cuMemAlloc_v2(C.byref(d), C.c_size_t(1 << 20)) == 0
h = (C.c_char * 64)(); assert cu.cuIpcGetMemHandle(C.byref(h), d) == 0
sys.stdout.write(bytes(h).hex() + "\n"); sys.stdout.flush(); sys.stdin.read()
'''


def ipc_prep():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    h = IpcHandle.from_buffer_copy(bytes.fromhex(p.stdout.readline().decode().strip()))
    d = C.c_ulonglong()
    cu.cuCtxSetCurrent(ctx)
    cu.cuIpcOpenMemHandle_v2.argtypes = (C.POINTER(C.c_ulonglong), IpcHandle, C.c_uint)
    r = cu.cuIpcOpenMemHandle_v2(C.byref(d), h, 1)  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    assert r == 0, f"cuIpcOpenMemHandle: {r}"
    return p, d


def act():
    st = C.c_int(-1)
    if scen == "is_capturing_legacy":
        return cu.cuStreamIsCapturing(LEGACY, C.byref(st)), st.value
    if scen == "push_pop":
        c = C.c_void_p()
        return cu.cuCtxPushCurrent_v2(ctx), cu.cuCtxPopCurrent_v2(C.byref(c))
    if scen == "record_legacy":
        ev = C.c_void_p()
        a = cu.cuEventCreate(C.byref(ev), 3)
        return a, cu.cuEventRecord(ev, LEGACY)
    if scen == "event_query":
        return cu.cuEventQuery(prep["ev"])
    if scen == "event_sync":
        return cu.cuEventSynchronize(prep["ev"])
    if scen == "ctx_sync":
        return cu.cuCtxSynchronize()
    if scen == "vmm_unmap":
        h, d, sz = prep["vmm"]
        return (cu.cuMemUnmap(d, C.c_size_t(sz)), cu.cuMemAddressFree(d, C.c_size_t(sz)),
                cu.cuMemRelease(h))
    if scen == "ipc_close":
        return cu.cuIpcCloseMemHandle(prep["ipc"][1])
    if scen == "none":
        return 0
    raise SystemExit("unknown " + scen)


if scen in ("event_query", "event_sync"):
    prep["ev"] = ev_recorded()
if scen == "vmm_unmap":
    prep["vmm"] = vmm_prep()
if scen == "ipc_close":
    prep["ipc"] = ipc_prep()

if kind == "blocking":
    sp = C.c_void_p()
    assert cu.cuStreamCreate(C.byref(sp), 0) == 0
    stream = torch.cuda.ExternalStream(sp.value)
else:
    stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    for _ in range(3):
        y.mul_(1.0)
torch.cuda.synchronize()
started, done, res = threading.Event(), threading.Event(), {}


def other():
    cu.cuCtxSetCurrent(ctx)
    if mode == "relaxed":
        m = C.c_int(2)
        cu.cuThreadExchangeStreamCaptureMode(C.byref(m))
    started.wait()
    try:
        res["rc"] = act()
    except BaseException as e:
        res["rc"] = repr(e)
    done.set()


th = threading.Thread(target=other)
th.start()
g = torch.cuda.CUDAGraph()
err, n = None, 0
try:
    with torch.cuda.graph(g, stream=stream):
        started.set()
        while not done.is_set() or n < 50:
            y.mul_(1.0001)
            n += 1
            if n > 200000:
                break
except Exception as e:
    err = repr(e).splitlines()[0][:160]
th.join()
torch.cuda.synchronize()
print(f"{scen:20s} other={mode:8s} capture-on={kind:11s} rc={res.get('rc')}  capture:",
      "ok" if err is None else err, flush=True)
if scen == "ipc_close":
    prep["ipc"][0].stdin.close()
