# SPDX-License-Identifier: Apache-2.0
"""The bridges' framing, their authentication and their error frames (no NIXL here).

A frame is a 4-byte big-endian length and that many bytes of a UTF-8 JSON object. The same
framing serves the TCP control connection between bridges and the local Unix socket.
"""
import base64
import errno
import hashlib
import hmac
import json
import os
import re
import select
import socket
import struct
import time

# The largest frame either side accepts. The biggest frame is a layout or a descriptor list:
# a ~100 MiB state dict of a few hundred tensors is tens of KiB; BUNDLE_MAX (16,384) tensors
# with 255-byte keys, 8 dimensions and their descriptors come to about 7 MiB of JSON.
FRAME_MAX = 8 << 20
# The largest frame read before the peer is authenticated (hello, challenge, auth): a hello
# is about 200 bytes. Parsing costs many times a frame's size in memory (an 8 MiB frame of
# small JSON values takes ~180 MiB), so a stranger gets no more than this.
AUTH_FRAME_MAX = 1 << 10
# The largest frame a local client may send the bridge (fetch, drop, status): a name of NAME_MAX
# bytes, each escaped as \uXXXX, takes 1,530.
LOCAL_FRAME_MAX = 4 << 10
# The most commas and opening brackets (outside strings) a frame may hold: they bound the JSON
# values parsing makes, each a Python object of 30-70 bytes (an 8 MiB frame of "{}," would
# make 2.8 million of them, ~200 MiB). A layout of BUNDLE_MAX tensors of NDIM_MAX (32)
# dimensions holds ~610,000.
VALUES_MAX = 1 << 20
# The most a request of a peer to the exporter (get, put, stat, subscribe, release, metadata)
# may hold: the largest, a put of BUNDLE_MAX (16,384) descriptors, holds 3 a descriptor.
REQUEST_VALUES_MAX = 1 << 16
# How long the connecting side gives the authentication, and a frame to arrive whole once it
# began, in seconds (the accepting bridge gives a peer _server.AUTH_DEADLINE to authenticate).
AUTH_TIMEOUT = 10.0
# Bytes of randomness in each side's nonce.
NONCE_BYTES = 32
# The control protocol's version, sent in the hello frame (2: the client proves first).
PROTOCOL_VERSION = 2
# The shortest token accepted, in bytes: the token is the only secret of the control connection.
TOKEN_MIN = 32

_HEADER = struct.Struct(">I")
# A JSON string, to count the structure outside strings: one left open runs to the end, so
# that every quote starts a match (a search that fails from quote after quote, over a frame of
# escaped quotes, took time quadratic in its size); and the escape of a UTF-16 surrogate,
# which json.loads turns into a lone surrogate when it is not half of a pair.
_STRING = re.compile(rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)')
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


# The longest message a FrameError keeps: what a peer put in a frame (an op, a lease id) may
# be megabytes long, and the message goes to the log and back to the peer.
FRAME_ERROR_TEXT_MAX = 500


class FrameError(Exception):
    """A frame that breaks the framing (too large, not a JSON object): the connection closes.

    errname is the errno name sent to the peer in the error frame. The message is cut to
    FRAME_ERROR_TEXT_MAX characters.
    """

    def __init__(self, errname, message):
        if len(message) > FRAME_ERROR_TEXT_MAX:
            message = f"{message[:FRAME_ERROR_TEXT_MAX]}... ({len(message)} characters)"
        super().__init__(message)
        self.errname = errname


def encode(obj):
    """One frame's bytes for the JSON object obj; ValueError if it exceeds FRAME_MAX."""
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > FRAME_MAX:
        raise ValueError(f"frame of {len(body)} bytes exceeds FRAME_MAX ({FRAME_MAX})")
    return _HEADER.pack(len(body)) + body


def send(sock, obj):
    """Send one frame (blocking, within the socket's timeout)."""
    sock.sendall(encode(obj))


def _recv_exact(sock, n, deadline):
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out reading a frame")
            sock.settimeout(left)
        else:
            sock.settimeout(None)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except socket.timeout:
            raise TimeoutError("timed out reading a frame") from None
        if not chunk:
            raise ConnectionResetError("connection closed" if not buf else
                                       "connection closed inside a frame")
        buf += chunk
    return bytes(buf)


def _values(body):
    """body's commas and opening brackets, and 1: at least the JSON values it holds."""
    return body.count(b",") + body.count(b"[") + body.count(b"{") + 1


def recv(sock, deadline=None, limit=FRAME_MAX, limit_name="FRAME_MAX", values=VALUES_MAX,
         values_name="VALUES_MAX"):
    """Read one frame; a dict. deadline: time.monotonic() value or None (wait for ever);
    limit: the largest body accepted (AUTH_FRAME_MAX before authentication), named limit_name;
    values: the most commas and opening brackets outside strings it may hold (VALUES_MAX;
    REQUEST_VALUES_MAX for a peer's request), named values_name.

    Raises FrameError (oversized frame, too many values, bad UTF-8 or JSON, a lone surrogate,
    nested too deep, not an object), TimeoutError, ConnectionResetError (EOF).
    """
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if n > limit:
        raise FrameError("EMSGSIZE", f"frame of {n} bytes exceeds {limit_name} ({limit})")
    body = _recv_exact(sock, n, deadline)
    # counted before parsing, which is what costs: commas inside strings count too at first,
    # and only a frame over the limit so is counted again without its strings
    if _values(body) > values and (count := _values(_STRING.sub(b"", body))) > values:
        raise FrameError("EMSGSIZE", f"frame of {count - 1} commas and opening brackets "
                         f"exceeds {values_name} ({values})")
    try:
        obj = json.loads(body.decode())
        # names and keys go to dlpackd and the log as UTF-8: an escaped lone surrogate
        # ("\\ud800") is not text (only a frame that escapes a surrogate is looked at)
        if _SURROGATE.search(body):
            json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise FrameError("EPROTO", "frame holds a lone UTF-16 surrogate (\\ud800-\\udfff): "
                         "not Unicode text") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise FrameError("EPROTO", f"frame is not UTF-8 JSON: {e}") from None
    except RecursionError:
        raise FrameError("EPROTO", "frame's JSON is nested too deep") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("op"), str):
        raise FrameError("EPROTO", "frame is not a JSON object with a string \"op\"")
    return obj


def readable(sock, timeout):
    """Whether sock has something to read (a frame or EOF) within timeout seconds."""
    r, _, _ = select.select([sock], [], [], timeout)
    return bool(r)


def error_frame(errname, message, **extra):
    """The error frame: errno name (ENOENT, EPERM...) and a message naming what failed."""
    return {"op": "error", "errno": errname, "message": message, **extra}


# What an EAGAIN refusal says when the limit refused at frees soon (connections not
# authenticated yet, PEERS_MAX, bytes under lease, the quarantine, --staging-max): asking again
# after a while is worth it. An EAGAIN that does not say it (a connection's own limits, which
# its holder frees) is not.
TRY_AGAIN = "try again"


def to_oserror(frame, context):
    """The OSError subclass for an error frame (OSError picks it from the errno); marked
    try_again when it is an EAGAIN that says TRY_AGAIN."""
    code = getattr(errno, str(frame.get("errno")), None) or errno.EPROTO
    message = str(frame.get("message", "error"))
    e = OSError(code, f"{context}: {message}")
    if code == errno.EAGAIN and TRY_AGAIN in message:
        e.try_again = True  # type: ignore[attr-defined]
    return e


def metadata(frame):
    """The NIXL metadata a frame carries (base64); FrameError if it carries none."""
    try:
        return base64.b64decode(frame["metadata"], validate=True)
    except (KeyError, TypeError, ValueError):
        raise FrameError("EPROTO", f"{frame.get('op')!r} frame without base64 metadata") \
            from None


def send_error(sock, errname, message, **extra):
    """Send an error frame, best effort (the connection is about to close anyway)."""
    try:
        sock.settimeout(1.0)
        send(sock, error_frame(errname, message, **extra))
    except OSError:
        pass


# Authentication: a mutual challenge-response over both sides' nonces. The token never goes
# over the wire; each side proves it holds it by an HMAC-SHA256 that includes the other side's
# fresh nonce, labelled by role so that one side's proof cannot be replayed as the other's. The
# client proves first: the server answers with its own proof only to a client that proved, so
# a stranger gets no HMAC of the token over anything it chose.

def read_token(path):
    """The shared token from path: refused if the file is readable by group or others."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_mode & 0o077:
            raise PermissionError(f"token file {path} is accessible by group or others "
                                  f"(mode {st.st_mode & 0o777:o}): chmod 600 it")
        token = f.read().strip()
    if len(token) < TOKEN_MIN:
        raise ValueError(f"token file {path} holds {len(token)} bytes; at least TOKEN_MIN "
                         f"({TOKEN_MIN}) needed: the token is all that guards the control "
                         "connection (head -c 32 /dev/urandom | base64 makes one)")
    return token


def proof(token, role, client_nonce, server_nonce):
    """HMAC-SHA256 of role ("client" or "server") and both nonces, keyed by the token; hex."""
    msg = b"dlpackd-bridge " + role.encode() + b"\0" + client_nonce + server_nonce
    return hmac.new(token, msg, hashlib.sha256).hexdigest()


def _recv_auth(sock, deadline):
    """One frame of the authentication, before the peer is known: at most AUTH_FRAME_MAX."""
    return recv(sock, deadline, AUTH_FRAME_MAX, "AUTH_FRAME_MAX")


def _proof_ok(frame, expected):
    """Whether frame carries the proof expected, compared in constant time (as bytes: a
    peer's non-ASCII text is a wrong proof, not an exception)."""
    got = frame.get("proof")
    if not isinstance(got, str):
        return False
    return hmac.compare_digest(got.encode(), expected.encode())


def _nonce(frame, what):
    try:
        n = bytes.fromhex(frame["nonce"])
    except (KeyError, TypeError, ValueError):
        raise FrameError("EPROTO", f"{what} frame without a hex nonce") from None
    if len(n) != NONCE_BYTES:
        raise FrameError("EPROTO", f"{what} nonce of {len(n)} bytes, not {NONCE_BYTES}")
    return n


def auth_client(sock, token, me, peer):
    """The connecting side: prove the token first, then check the server's proof; returns
    the server's welcome frame.

    Raises PermissionError naming peer when the server refuses or its proof is wrong.
    """
    deadline = time.monotonic() + AUTH_TIMEOUT
    cn = os.urandom(NONCE_BYTES)
    send(sock, {"op": "hello", "version": PROTOCOL_VERSION, "from": me, "nonce": cn.hex()})
    f = _recv_auth(sock, deadline)
    if f["op"] == "error":
        raise to_oserror(f, f"peer {peer}")
    if f["op"] != "challenge":
        raise FrameError("EPROTO", f"expected a challenge, got {f['op']!r}")
    sn = _nonce(f, "challenge")
    send(sock, {"op": "auth", "proof": proof(token, "client", cn, sn)})
    f = _recv_auth(sock, deadline)
    if f["op"] == "error":
        raise to_oserror(f, f"peer {peer}")
    if f["op"] != "welcome":
        raise FrameError("EPROTO", f"expected welcome, got {f['op']!r}")
    if not _proof_ok(f, proof(token, "server", cn, sn)):
        send_error(sock, "EPERM", "authentication failed: wrong token")
        raise PermissionError(errno.EPERM, f"peer {peer}: authentication failed: "
                              "its proof does not match our token (wrong token?)")
    return f


def auth_server(sock, token, timeout=None, admit=None):
    """The accepting side: check the client's proof, and only then prove the token in the
    welcome frame, all within timeout seconds (None: AUTH_TIMEOUT); returns the client's hello
    frame. admit(), if given, is asked once the proof checked out, before the welcome: a reason
    to turn the peer away after all (or None).

    Raises PermissionError (after sending the peer one error frame) when the proof is wrong,
    BlockingIOError EAGAIN (after sending it) when admit() gave a reason.
    """
    deadline = time.monotonic() + (AUTH_TIMEOUT if timeout is None else timeout)
    hello = _recv_auth(sock, deadline)
    if hello["op"] != "hello":
        raise FrameError("EPROTO", f"expected hello, got {hello['op']!r}")
    if hello.get("version") != PROTOCOL_VERSION:
        raise FrameError("EPROTO", f"protocol version {hello.get('version')!r}, "
                         f"this bridge speaks {PROTOCOL_VERSION}")
    cn = _nonce(hello, "hello")
    sn = os.urandom(NONCE_BYTES)
    send(sock, {"op": "challenge", "nonce": sn.hex()})
    f = _recv_auth(sock, deadline)
    if f["op"] == "error":
        raise to_oserror(f, "peer")
    if f["op"] != "auth":
        raise FrameError("EPROTO", f"expected auth, got {f['op']!r}")
    if not _proof_ok(f, proof(token, "client", cn, sn)):
        send_error(sock, "EPERM", "authentication failed: wrong token")
        raise PermissionError(errno.EPERM, "authentication failed: wrong token")
    why = admit() if admit is not None else None
    if why is not None:
        send_error(sock, "EAGAIN", f"{why}: try again")
        raise BlockingIOError(errno.EAGAIN, why)
    send(sock, {"op": "welcome", "proof": proof(token, "server", cn, sn)})
    return hello
