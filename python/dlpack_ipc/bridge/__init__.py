# SPDX-License-Identifier: Apache-2.0
"""Names of other hosts, through the local dlpackd-bridge (docs/bridge.md).

    from dlpack_ipc import bridge
    local, generation = bridge.fetch("hostA:weights")   # the bridge copies it here ...
    t = dlpack_ipc.attach(local)                          # ... and it is a local entry

fetch("peer:name") asks this host's bridge (python -m dlpack_ipc.bridge) to get the entry name
from the peer bridge configured as peer (or registered as peer, with --registry), over NIXL,
and to publish it locally, replacing any earlier replica, under the name "peer:name";
fetch("*:name") asks the registry which bridge holds name. Importing this module does not
import NIXL: only the bridge process itself needs it (pip install dlpack-ipc[bridge]).
"""
import os
import socket
import time

from . import _wire
from ._wire import FRAME_MAX

__all__ = ["fetch", "drop", "status", "default_socket", "FRAME_MAX", "FETCH_GRACE"]

# A fetch with a timeout waits this much longer than the bridge does for the bridge's answer,
# so that the bridge's own TimeoutError (naming the peer and the name) is the one raised.
FETCH_GRACE = 5.0


def default_socket():
    """The local bridge's socket: $DLPACKD_BRIDGE_SOCKET, else $XDG_RUNTIME_DIR/
    dlpackd-bridge.sock for a user other than root with a runtime directory, else
    /run/dlpackd-bridge/bridge.sock (the service's, systemd/dlpackd-bridge.service)."""
    env = os.environ.get("DLPACKD_BRIDGE_SOCKET")
    if env:
        return env
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.getuid() != 0:
        return os.path.join(xdg, "dlpackd-bridge.sock")
    return "/run/dlpackd-bridge/bridge.sock"


def _request(frame, timeout, socket_path, what):
    path = socket_path or default_socket()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            s.connect(path)
        except FileNotFoundError:
            raise ConnectionRefusedError(f"{what}: no bridge listens on {path}") from None
        except OSError as e:
            raise type(e)(e.errno, f"{what}: cannot reach the bridge on {path}: "
                          f"{e.strerror}") from None
        s.settimeout(FETCH_GRACE)
        deadline = None if timeout is None else time.monotonic() + timeout + FETCH_GRACE
        try:
            _wire.send(s, frame)
        except (BrokenPipeError, ConnectionResetError):
            # a bridge that refuses the connection (its client limits) says why and closes
            # it, maybe before the request went: its reason waits to be read
            deadline = time.monotonic() + FETCH_GRACE
        try:
            reply = _wire.recv(s, deadline)
        except TimeoutError:
            raise TimeoutError(f"{what}: no answer from the bridge on {path}") from None
        except ConnectionResetError:
            raise ConnectionResetError(f"{what}: the bridge on {path} closed the "
                                       "connection") from None
    finally:
        s.close()
    if reply["op"] == "error":
        raise _wire.to_oserror(reply, what)
    return reply


def fetch(name, timeout=None, *, socket=None):
    """Copy the entry name ("peer:remote_name") from that peer here; returns
    (local_name, remote_generation).

    The local bridge gets the entry from the peer bridge and publishes it in the local dlpackd
    under local_name (name itself, but for "*:"), replacing an earlier replica; attach it (or
    attach_dict() for a state dict) as any entry. remote_generation is the entry's generation
    on the peer. A CUDA entry on the peer becomes a CUDA replica on the local bridge's
    --cuda-device (docs/bridge.md, GPU entries). timeout as everywhere in dlpack_ipc: None
    waits as long as the transfer takes, a number of seconds then TimeoutError; the bridge
    bounds either way its wait for a stalled peer (docs/bridge.md: LAYOUT_TIMEOUT, the lease
    TTL plus TRANSFER_GRACE).
    name "*:remote_name" asks the bridge's registry (--registry) which bridges hold
    remote_name (those started with --registry-names write it there) and fetches from the first
    that serves it: local_name is then "that_peer:remote_name".
    FileNotFoundError: the peer has no such name or does not export it (or no such peer is
    configured or registered, or no bridge holds it); PermissionError: the peers' tokens
    differ, or local holds a replica another uid fetched (only the caller's own is replaced);
    FileExistsError: local is published by someone other than the bridge; OSError EDQUOT: the
    caller's uid is at the bridge's REPLICAS_PER_UID_MAX or REPLICA_BYTES_PER_UID_MAX
    (docs/bridge.md, Local callers and their limits); OSError ENODEV: a CUDA entry, and no
    such device here; EFBIG or EAGAIN: a CUDA entry larger than the peer's --staging-max, or
    than what is left of it; BlockingIOError (EAGAIN): the caller's uid holds
    CLIENTS_PER_UID_MAX connections to the local bridge, or the peer holds LEASE_BYTES_MAX
    under lease (docs/bridge.md, naming the limit; a peer's limit that frees soon is asked
    again first, REFUSED_TRIES times within timeout, and this is its last refusal);
    ConnectionError: the peer or the local bridge is unreachable or went away.
    """
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"bridge name {name!r} is not 'peer:name'")
    if timeout is not None and not (timeout >= 0):
        raise ValueError(f"timeout {timeout!r} is negative or NaN")
    if timeout == float("inf"):
        timeout = None
    reply = _request({"op": "fetch", "name": name, "timeout": timeout}, timeout, socket,
                     f"fetch {name!r}")
    return reply["name"], reply["generation"]


def drop(name, *, socket=None):
    """Give back the replica name ("peer:name") that the caller's fetch made: the bridge
    unpublishes it, and it no longer counts against the caller's uid (attached tensors stay
    valid until released). root may drop any. FileNotFoundError: no such replica;
    PermissionError: another uid's, or one --follow keeps; BlockingIOError: a fetch into it is
    under way; ConnectionError: the local bridge is unreachable."""
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"bridge name {name!r} is not 'peer:name'")
    _request({"op": "drop", "name": name}, 10.0, socket, f"drop {name!r}")


def status(*, socket=None):
    """The local bridge's state, a dict: its agent name (that of the NIXL agent it started with),
    the NIXL "agents" alive (1, more while replaced ones still serve what uses them) and how many
    times its agent was "replaced" after an aborted transfer, peers, live leases, transfers, the
    replicas each local uid holds ("replicas": {"uid": [replicas, bytes]}), each --follow
    ("follows": {"peer:name": {"subscribed": bool, "generation": the peer's generation of the
    replica held, or None}}), the subscriptions peers hold here ("subscribers") and, with
    --registry, the registry ("registry": {"url", "name", "registered": whether this bridge's record
    is in place, "names": how many exported names it wrote there (both None where it does not
    --listen), "found": {"peer": connected}})."""
    return _request({"op": "status"}, 10.0, socket, "bridge status")
