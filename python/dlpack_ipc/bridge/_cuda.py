# SPDX-License-Identifier: Apache-2.0
"""Copies between device and host memory for GPU entries, staged through host memory.

The bridge moves a device entry as host bytes: the exporter copies it to a host buffer that it
registers with NIXL, the importer lands it in a host buffer and copies that into a device replica
(docs/bridge.md, "GPU entries"). The copies go through the CUDA driver loaded at run time, the
same library libdlpc loads ($DLPC_CUDA_LIBRARY, else libcuda.so.1), on the legacy default stream
of the device's primary context, and each waits for its own end: once copy() returns, the bytes
are where they were sent. The driver is loaded and initialized at the importer's first fetch
(check(): whether --cuda-device exists, so that the get says whether device entries are taken)
or the exporter's first device entry; a bridge that only exports host entries, or is started
with --cuda-device none, never touches it.
"""
import ctypes
import errno
import os
import threading

_lock = threading.Lock()
_driver = None


class _Driver:
    def __init__(self):
        path = os.environ.get("DLPC_CUDA_LIBRARY") or "libcuda.so.1"
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as e:
            raise OSError(errno.ENODEV, f"the CUDA driver ({path}) cannot be loaded: {e}") \
                from None
        self.pid = os.getpid()
        self.ctx = {}               # ordinal -> the primary context retained for the bridge
        self.ctx_lock = threading.Lock()
        self.lib.cuGetErrorString.argtypes = (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self._check(self.lib.cuInit(0), "cuInit", errno.ENODEV)

    def _check(self, r, what, err=errno.EIO):
        if r == 0:
            return
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorString(r, ctypes.byref(text)) != 0 or not text.value:
            msg = f"CUDA error {r}"
        else:
            msg = text.value.decode(errors="replace")
        # 100: no device; 101: invalid device ordinal; 2: out of memory
        code = {100: errno.ENODEV, 101: errno.ENODEV, 2: errno.ENOMEM}.get(r, err)
        raise OSError(code, f"{what}: {msg}")

    def context(self, ordinal):
        with self.ctx_lock:
            return self._context(ordinal)

    def _context(self, ordinal):
        ctx = self.ctx.get(ordinal)
        if ctx is None:
            dev = ctypes.c_int()
            self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)),
                        f"cuDeviceGet(cuda:{ordinal})", errno.ENODEV)
            ctx = ctypes.c_void_p()
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                        f"cuDevicePrimaryCtxRetain(cuda:{ordinal})")
            self.ctx[ordinal] = ctx
        return ctx

    def copy(self, ordinal, ranges, to_device):
        if os.getpid() != self.pid:
            raise OSError(errno.EBADFD, f"CUDA was initialized in process {self.pid}, which "
                          "forked this one: a forked child cannot use it")
        ctx = self.context(ordinal)
        self._check(self.lib.cuCtxPushCurrent_v2(ctx), f"cuCtxPushCurrent(cuda:{ordinal})")
        try:
            for dst, src, n in ranges:
                if not n:
                    continue
                if to_device:
                    r = self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(dst), ctypes.c_void_p(src),
                                                 ctypes.c_size_t(n))
                    self._check(r, f"cuMemcpyHtoD of {n} bytes to cuda:{ordinal}")
                else:
                    r = self.lib.cuMemcpyDtoH_v2(ctypes.c_void_p(dst), ctypes.c_uint64(src),
                                                 ctypes.c_size_t(n))
                    self._check(r, f"cuMemcpyDtoH of {n} bytes from cuda:{ordinal}")
            # a copy from pageable host memory may return before it has reached the device
            self._check(self.lib.cuCtxSynchronize(), f"cuCtxSynchronize(cuda:{ordinal})")
        finally:
            self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


def _get():
    global _driver
    with _lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def check(n):
    """Whether this host has CUDA device n: None, or why not (the driver cannot be loaded or
    initialized, or has no such device). Makes no context."""
    try:
        d = _get()
        dev = ctypes.c_int()
        d._check(d.lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(n)), f"cuDeviceGet(cuda:{n})",
                 errno.ENODEV)
    except OSError as e:
        return e.strerror or str(e)
    return None


def ordinal(device):
    """N of "cuda:N"; ValueError for anything else."""
    kind, sep, n = device.partition(":")
    if kind != "cuda" or not sep or not n.isdigit():
        raise ValueError(f"{device!r} is not a CUDA device (cuda:N)")
    return int(n)


def to_host(device, ranges):
    """Copy each (host_dst, device_src, nbytes) of ranges from device ("cuda:N") to the host,
    and wait for them; OSError naming the call that failed."""
    _get().copy(ordinal(device), ranges, False)


def to_device(device, ranges):
    """Copy each (device_dst, host_src, nbytes) of ranges from the host to device ("cuda:N"),
    and wait for them to reach it; OSError naming the call that failed."""
    _get().copy(ordinal(device), ranges, True)
