# SPDX-License-Identifier: Apache-2.0
"""The bridge daemon with NIXL faked, for real processes on one host (tests/bridge/test_server.py):

    python3 fake_nixl.py BRIDGE-ARGS...

runs `python3 -m dlpack_ipc.bridge BRIDGE-ARGS...` with the bridge's Nixl replaced by FakeNixl:
its agent's name names the process (pid), and a WRITE copies the bytes into the importer's
memory with process_vm_writev(2) (same uid, or root), so a replica holds what the exporter
served. As NIXL 1.5.1 (checked against its wheel): its metadata names the agent in nixlSerDes's
header (nixl_md(); the rest is FULL or PARTIAL), which add_remote reads as NIXL does; it writes
only to an agent loaded and not removed since; it loads a transfer's partial metadata only for
an agent loaded; and a blob that names an agent loaded but does not load erases that agent's
entry (NIXL's loadRemoteSections), so that the agent can no longer be written to. Everything
else (dlpackd, the control connections, the leases, the pushes) is the bridge's own. In the
environment:
FAKE_NIXL_RESUBSCRIBE_MAX sets _push.RESUBSCRIBE_MAX (seconds); FAKE_NIXL_CONSTANTS, a JSON
object {"_server.NAME": value, "_wire.NAME": value...}, sets those constants (each must exist);
FAKE_NIXL_WRITE_GATE names a file: each WRITE stays in progress until that file exists.
"""
import ctypes
import json
import os
import struct
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


# The rest of a fake agent's metadata, after its header: all of it, or a registration's.
FULL = b"fake:full|"
PARTIAL = b"fake:partial|"


def nixl_md(name, rest=FULL):
    """Metadata of agent name as NIXL 1.5 serializes it: "nixlSerDes|", the tag "Agent", the
    name's length (a native size_t), the name, "|"; then rest (NIXL's connections and memory
    sections; here FULL or PARTIAL, anything else a blob that fails to load)."""
    n = name.encode()
    return b"nixlSerDes|Agent" + struct.pack("@N", len(n)) + n + b"|" + rest


def nixl_md_agent(blob):
    """(the agent name, the rest of blob) as NIXL 1.5's loadRemoteMD reads them (nixlSerDes's
    getStr: the name's length within the blob, the byte after the name skipped unchecked);
    RuntimeError NIXL_ERR_MISMATCH as NIXL's own."""
    head = b"nixlSerDes|Agent"
    start = len(head) + struct.calcsize("@N")
    if not blob.startswith(head) or len(blob) < start:
        raise RuntimeError("NIXL_ERR_MISMATCH: no agent name in the metadata")
    n = struct.unpack_from("@N", blob, len(head))[0]
    if len(blob) < start + n + 1 or n == 0:
        raise RuntimeError("NIXL_ERR_MISMATCH: no agent name in the metadata")
    return blob[start:start + n].decode(), blob[start + n + 1:]


class FakeNixl:
    """_nixl.Nixl's calls, without UCX: agents are "fake/PID/NAME"."""

    def __init__(self, name, progress_thread):
        self.name = f"fake/{os.getpid()}/{name}"
        self.registered = 0
        self._lock = threading.Lock()
        self._remotes = set()

    def metadata(self):
        return nixl_md(self.name)

    def add_remote(self, blob):
        name, rest = nixl_md_agent(blob)
        if name == self.name:
            raise RuntimeError("NIXL_ERR_INVALID_PARAM: metadata of the agent itself")
        with self._lock:
            if rest not in (FULL, PARTIAL):
                # NIXL: a blob whose memory sections fail to load erases the entry of the
                # agent it names, loaded before or not (nixl_metadata.py checks it); here any
                # rest but FULL and PARTIAL
                self._remotes.discard(name)
                raise RuntimeError(f"NIXL_ERR_MISMATCH: metadata of {name!r} does not load")
            if not name.startswith("fake/"):
                raise ValueError(f"not a fake agent's metadata: {name[:64]!r}")
            if rest == PARTIAL and name not in self._remotes:
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
        return nixl_md(self.name, PARTIAL)

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
