# SPDX-License-Identifier: Apache-2.0
"""The bridge daemon with NIXL faked, for real processes on one host (tests/bridge/test_server.py):

    python3 fake_nixl.py BRIDGE-ARGS...

runs `python3 -m dlpack_ipc.bridge BRIDGE-ARGS...` with the bridge's Nixl replaced by FakeNixl:
its metadata names the process (pid), and a WRITE copies the bytes into the importer's memory
with process_vm_writev(2) (same uid, or root), so a replica holds what the exporter served.
As NIXL, it writes only to an agent loaded (add_remote) and not removed since, and loads a
transfer's partial metadata only for an agent loaded. Everything else (dlpackd, the control
connections, the leases, the pushes) is the bridge's own. In the environment:
FAKE_NIXL_RESUBSCRIBE_MAX sets _push.RESUBSCRIBE_MAX (seconds); FAKE_NIXL_CONSTANTS, a JSON
object {"_server.NAME": value, "_wire.NAME": value...}, sets those constants (each must exist);
FAKE_NIXL_WRITE_GATE names a file: each WRITE stays in progress until that file exists.
"""
import ctypes
import json
import os
import sys
import threading

from dlpack_ipc.bridge import __main__ as bridge_main
from dlpack_ipc.bridge import _push, _server, _wire

_libc = ctypes.CDLL(None, use_errno=True)


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = (ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                                    ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong)


def _iovs(ranges):
    arr = (_Iovec * len(ranges))()
    for i, (addr, n) in enumerate(ranges):
        arr[i].base, arr[i].len = addr, n
    return arr


class FakeNixl:
    """_nixl.Nixl's calls, without UCX: agents are "fake/PID/NAME"."""

    def __init__(self, name, progress_thread):
        self.name = f"fake/{os.getpid()}/{name}"
        self.registered = 0
        self._lock = threading.Lock()
        self._remotes = set()

    def metadata(self):
        return self.name.encode()

    def add_remote(self, blob):
        name = blob.decode()
        partial = name.startswith("partial:")
        if partial:
            name = name[len("partial:"):]
        if not name.startswith("fake/"):
            raise ValueError(f"not a fake agent's metadata: {name[:64]!r}")
        with self._lock:
            if partial and name not in self._remotes:
                raise RuntimeError(f"NIXL_ERR_NOT_FOUND: partial metadata of {name!r}, an "
                                   "agent not loaded")
            self._remotes.add(name)
        return name

    def remote_names(self):
        with self._lock:
            return set(self._remotes)

    def remove_remote(self, agent):
        with self._lock:
            self._remotes.discard(agent)
        return True

    def register(self, base, length):
        with self._lock:
            self.registered += 1
        return ("reg", base, length)

    def partial_metadata(self, reg):
        return b"partial:" + self.metadata()

    def deregister(self, reg):
        with self._lock:
            self.registered -= 1

    def write(self, local, remote, agent, notif):
        with self._lock:
            if agent not in self._remotes:
                raise RuntimeError(f"NIXL_ERR_NOT_FOUND: agent {agent!r} is not loaded")
        h = [agent, local, remote]
        if os.environ.get("FAKE_NIXL_WRITE_GATE"):
            return h, self.state(h)
        self._copy(*h)
        return h, "DONE"

    def _copy(self, agent, local, remote):
        pid = int(agent.split("/")[1])
        want = sum(n for _, n in local)
        got = _libc.process_vm_writev(pid, _iovs(local), len(local), _iovs(remote),
                                      len(remote), 0)
        if got != want:
            raise RuntimeError(f"process_vm_writev to pid {pid}: {got} of {want} bytes "
                               f"({os.strerror(ctypes.get_errno())})")

    def state(self, h):
        if h[1] is not None:
            if not os.path.exists(os.environ["FAKE_NIXL_WRITE_GATE"]):
                return "PROC"
            self._copy(*h)
            h[1] = None
        return "DONE"

    def release(self, h):
        pass

    def notified(self, agent, msg):
        # the WRITE is done before the exporter sends `done`, which the importer waits for too
        return True


if __name__ == "__main__":
    _server.Nixl = FakeNixl
    # a test's lower cap on the wait between two attempts to reach a lost peer
    if os.environ.get("FAKE_NIXL_RESUBSCRIBE_MAX"):
        _push.RESUBSCRIBE_MAX = float(os.environ["FAKE_NIXL_RESUBSCRIBE_MAX"])
    # a test's own limits
    for key, value in json.loads(os.environ.get("FAKE_NIXL_CONSTANTS", "{}")).items():
        module, _, name = key.partition(".")
        module = {"_server": _server, "_wire": _wire, "_push": _push}[module]
        assert hasattr(module, name), f"FAKE_NIXL_CONSTANTS: no {key}"
        setattr(module, name, value)
    sys.exit(bridge_main.main(sys.argv[1:]))
