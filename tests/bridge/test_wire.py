# SPDX-License-Identifier: Apache-2.0
"""The bridges' framing and authentication, over socketpairs, without NIXL (ctest: bridge_wire).

The bridge daemon's own handling of the same frames is driven over real sockets by netns.py.
"""
import errno
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from dlpack_ipc import bridge
from dlpack_ipc.bridge import _wire


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_roundtrip(pair):
    a, b = pair
    _wire.send(a, {"op": "x", "name": "w/ä", "n": [1, 2]})
    assert _wire.recv(b, time.monotonic() + 5) == {"op": "x", "name": "w/ä", "n": [1, 2]}


def test_frame_max_counts_a_bundle_max_layout():
    # BUNDLE_MAX tensors with 255-byte keys and 8 dimensions, and as many descriptors, fit
    import dlpack_ipc
    t = [["k" * dlpack_ipc.KEY_MAX, "float16", [2**31] * 8, 2**40]] * dlpack_ipc.BUNDLE_MAX
    assert len(_wire.encode({"op": "layout", "lease": "x" * 300, "tensors": t})) <= _wire.FRAME_MAX
    d = [[2**47, 2**40]] * dlpack_ipc.BUNDLE_MAX
    assert len(_wire.encode({"op": "put", "descs": d, "metadata": "m" * 4096})) <= _wire.FRAME_MAX


def test_oversized_frame_refused_before_reading_it(pair):
    a, b = pair
    a.sendall(struct.pack(">I", _wire.FRAME_MAX + 1))
    with pytest.raises(_wire.FrameError, match="FRAME_MAX") as e:
        _wire.recv(b, time.monotonic() + 5)
    assert e.value.errname == "EMSGSIZE"
    with pytest.raises(ValueError, match="FRAME_MAX"):
        _wire.encode({"op": "x", "pad": "p" * _wire.FRAME_MAX})


def test_frame_at_the_limit_accepted(pair):
    a, b = pair
    body = json.dumps({"op": "x", "pad": ""}).encode()
    body = body[:-2] + b" " * (_wire.FRAME_MAX - len(body)) + body[-2:]
    assert len(body) == _wire.FRAME_MAX
    t = threading.Thread(target=a.sendall, args=(struct.pack(">I", len(body)) + body,))
    t.start()
    assert _wire.recv(b, time.monotonic() + 10)["op"] == "x"
    t.join()


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"op": 3}', b"{}"])
def test_bad_json_refused(pair, body):
    a, b = pair
    a.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(_wire.FrameError) as e:
        _wire.recv(b, time.monotonic() + 5)
    assert e.value.errname == "EPROTO"


def test_truncated_frame_and_eof(pair):
    a, b = pair
    a.sendall(struct.pack(">I", 100) + b'{"op":')
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionResetError, match="inside a frame"):
        _wire.recv(b, time.monotonic() + 5)


def test_recv_honours_its_deadline(pair):
    a, b = pair
    a.sendall(struct.pack(">I", 10))
    with pytest.raises(TimeoutError):
        _wire.recv(b, time.monotonic() + 0.2)


def _auth(token_c, token_s, admit=None):
    """Run both sides of the authentication; (client's outcome, server's outcome, bytes seen)."""
    c, s = socket.socketpair()
    seen = bytearray()
    out = {}

    def server():
        try:
            out["server"] = _wire.auth_server(s, token_s, admit=admit)
        except Exception as e:  # the outcome under test
            out["server"] = e

    th = threading.Thread(target=server)
    th.start()
    real_send = _wire.send

    def spy(sock, obj):
        seen.extend(_wire.encode(obj))
        real_send(sock, obj)
    _wire.send = spy
    try:
        out["client"] = _wire.auth_client(c, token_c, "me", "A")
    except Exception as e:
        out["client"] = e
    finally:
        _wire.send = real_send
        th.join(10)
        c.close()
        s.close()
    return out["client"], out["server"], bytes(seen)


def test_auth_right_token():
    tok = os.urandom(24).hex().encode()
    client, server, seen = _auth(tok, tok)
    assert client["op"] == "welcome" and server["from"] == "me"
    assert tok not in seen and tok.hex().encode() not in seen


def test_auth_server_asks_admit_after_the_proof_and_before_the_welcome():
    """admit() is asked only once the proof checked out; a reason it gives turns the peer away
    with EAGAIN instead of the welcome (a bridge that dropped it meanwhile to make room for
    strangers), and it sees no proof of the server's."""
    tok = os.urandom(24).hex().encode()
    asked = []
    client, server, seen = _auth(tok, tok, admit=lambda: asked.append(1) or "dropped: full")
    assert asked == [1]
    assert isinstance(server, BlockingIOError) and server.errno == errno.EAGAIN
    assert isinstance(client, OSError) and "dropped: full: try again" in str(client), client
    client, server, _ = _auth(tok, tok, admit=lambda: asked.append(2))
    assert asked == [1, 2] and client["op"] == "welcome" and server["from"] == "me"
    client, server, _ = _auth(b"a" * 32, b"b" * 32, admit=lambda: asked.append(3))
    assert asked == [1, 2] and isinstance(server, PermissionError)


def test_auth_wrong_token_refused_on_both_sides():
    client, server, _ = _auth(b"a" * 32, b"b" * 32)
    assert isinstance(client, PermissionError) and "peer A" in str(client)
    # the server found the client's proof wrong first, and told it so in one error frame
    assert isinstance(server, PermissionError)


@pytest.mark.parametrize("wrong", ["0" * 64, "é" * 64])   # a non-ASCII proof is wrong too
def test_auth_server_refuses_a_wrong_client_proof(wrong):
    tok = b"t" * 32
    c, s = socket.socketpair()
    out = {}
    th = threading.Thread(target=lambda: out.update(r=_try(_wire.auth_server, s, tok)))
    th.start()
    cn = os.urandom(_wire.NONCE_BYTES)
    _wire.send(c, {"op": "hello", "version": _wire.PROTOCOL_VERSION, "from": "x",
                   "nonce": cn.hex()})
    ch = _wire.recv(c, time.monotonic() + 5)
    _wire.send(c, {"op": "auth", "proof": wrong})
    err = _wire.recv(c, time.monotonic() + 5)
    th.join(10)
    # the client proves first: a stranger gets no proof of the server's over its nonce
    assert ch["op"] == "challenge" and "proof" not in ch
    assert err == {"op": "error", "errno": "EPERM", "message": "authentication failed: wrong token"}
    assert isinstance(out["r"], PermissionError)
    c.close()
    s.close()


def test_auth_client_refuses_a_wrong_server_proof():
    # a server that lets the client prove and then answers with a proof of another token
    tok = b"t" * 32
    c, s = socket.socketpair()
    out = {}
    th = threading.Thread(target=lambda: out.update(r=_try(_wire.auth_client, c, tok, "me",
                                                           "A")))
    th.start()
    hello = _wire.recv(s, time.monotonic() + 5)
    sn = os.urandom(_wire.NONCE_BYTES)
    _wire.send(s, {"op": "challenge", "nonce": sn.hex()})
    auth = _wire.recv(s, time.monotonic() + 5)
    cn = bytes.fromhex(hello["nonce"])
    assert auth["proof"] == _wire.proof(tok, "client", cn, sn)
    _wire.send(s, {"op": "welcome", "proof": _wire.proof(b"u" * 32, "server", cn, sn)})
    err = _wire.recv(s, time.monotonic() + 5)
    th.join(10)
    assert err["errno"] == "EPERM"
    assert isinstance(out["r"], PermissionError) and "peer A" in str(out["r"])
    # a server that replays the client's own proof as its own is refused as well
    c2, s2 = socket.socketpair()
    th = threading.Thread(target=lambda: out.update(r=_try(_wire.auth_client, c2, tok, "me",
                                                           "A")))
    th.start()
    _wire.recv(s2, time.monotonic() + 5)
    _wire.send(s2, {"op": "challenge", "nonce": sn.hex()})
    auth = _wire.recv(s2, time.monotonic() + 5)
    _wire.send(s2, {"op": "welcome", "proof": auth["proof"]})
    assert _wire.recv(s2, time.monotonic() + 5)["errno"] == "EPERM"
    th.join(10)
    assert isinstance(out["r"], PermissionError)
    for x in (c, s, c2, s2):
        x.close()


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return e


def test_auth_bad_nonce_and_version(pair):
    a, b = pair
    _wire.send(a, {"op": "hello", "version": _wire.PROTOCOL_VERSION, "nonce": "zz"})
    with pytest.raises(_wire.FrameError, match="nonce"):
        _wire.auth_server(b, b"t" * 32)
    _wire.send(a, {"op": "hello", "version": 99, "nonce": "00" * 32})
    with pytest.raises(_wire.FrameError, match="version"):
        _wire.auth_server(b, b"t" * 32)


def test_token_file(tmp_path):
    p = tmp_path / "tok"
    p.write_bytes(b"s" * 32 + b"\n")
    p.chmod(0o640)
    with pytest.raises(PermissionError, match="group or others"):
        _wire.read_token(str(p))
    p.chmod(0o600)
    assert _wire.read_token(str(p)) == b"s" * 32
    p.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least TOKEN_MIN"):
        _wire.read_token(str(p))
    p.write_bytes(b"s" * (_wire.TOKEN_MIN - 1))
    with pytest.raises(ValueError, match=f"holds {_wire.TOKEN_MIN - 1} bytes"):
        _wire.read_token(str(p))
    p.write_bytes(b"s" * _wire.TOKEN_MIN)
    assert _wire.read_token(str(p)) == b"s" * _wire.TOKEN_MIN


def test_error_frames_map_to_oserror_subclasses():
    for name, cls in (("ENOENT", FileNotFoundError), ("EPERM", PermissionError),
                      ("ETIMEDOUT", TimeoutError), ("ECONNRESET", ConnectionResetError)):
        e = _wire.to_oserror(_wire.error_frame(name, "it"), "peer A, 'w/x'")
        assert type(e) is cls and "peer A, 'w/x': it" in str(e)


def test_fetch_arguments_and_no_bridge(tmp_path):
    with pytest.raises(ValueError, match="peer:name"):
        bridge.fetch("nocolon")
    with pytest.raises(ValueError, match="negative"):
        bridge.fetch("A:x", timeout=-1)
    with pytest.raises(ConnectionRefusedError, match="no bridge listens"):
        bridge.fetch("A:x", 1, socket=str(tmp_path / "none.sock"))


def test_fetch_of_a_bridge_that_answers_an_error(tmp_path):
    path = str(tmp_path / "b.sock")
    ls = socket.socket(socket.AF_UNIX)
    ls.bind(path)
    ls.listen(1)

    def serve():
        c, _ = ls.accept()
        f = _wire.recv(c, time.monotonic() + 5)
        _wire.send(c, _wire.error_frame("ENOENT", f"no {f['name']}"))
        c.close()
    th = threading.Thread(target=serve)
    th.start()
    with pytest.raises(FileNotFoundError, match="fetch 'A:w/x': no A:w/x"):
        bridge.fetch("A:w/x", 5, socket=path)
    th.join()
    ls.close()


def test_importing_the_client_api_does_not_import_nixl():
    code = ("import sys, dlpack_ipc, dlpack_ipc.bridge; "
            "assert not [m for m in sys.modules if m.startswith('nixl')], 'nixl imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_auth_timeout(pair, monkeypatch):
    # a peer that connects and says nothing is given AUTH_TIMEOUT, then dropped
    a, b = pair
    monkeypatch.setattr(_wire, "AUTH_TIMEOUT", 0.2)
    with pytest.raises(TimeoutError):
        _wire.auth_server(b, b"t" * 32)
    _wire.send(a, {"op": "hello", "version": _wire.PROTOCOL_VERSION, "nonce": "00" * 32})
    with pytest.raises(TimeoutError):       # ...and one that stops after its hello as well
        _wire.auth_server(b, b"t" * 32)


def test_pre_auth_frames_limited_to_auth_frame_max(pair, monkeypatch):
    # a stranger's hello over AUTH_FRAME_MAX is refused from its header, its body never read
    a, b = pair
    monkeypatch.setattr(_wire, "AUTH_TIMEOUT", 2.0)
    a.sendall(struct.pack(">I", _wire.AUTH_FRAME_MAX + 1))
    with pytest.raises(_wire.FrameError, match="AUTH_FRAME_MAX") as e:
        _wire.auth_server(b, b"t" * 32)
    assert e.value.errname == "EMSGSIZE"
    # and a hello of exactly AUTH_FRAME_MAX bytes is read
    body = json.dumps({"op": "hello", "version": _wire.PROTOCOL_VERSION, "nonce": "zz",
                       "from": ""}).encode()
    body = body[:-2] + b"x" * (_wire.AUTH_FRAME_MAX - len(body)) + body[-2:]
    a.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(_wire.FrameError, match="nonce"):
        _wire.auth_server(b, b"t" * 32)


def test_json_nested_too_deep_is_a_protocol_error(pair):
    a, b = pair
    body = b"[" * 100000
    t = threading.Thread(target=a.sendall, args=(struct.pack(">I", len(body)) + body,))
    t.start()
    with pytest.raises(_wire.FrameError, match="nested too deep") as e:
        _wire.recv(b, time.monotonic() + 10)
    t.join()
    assert e.value.errname == "EPROTO"
    body = b'{"op":"hello","x":' + b"[" * 1000
    a.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(_wire.FrameError, match="nested too deep"):
        _wire.auth_server(b, b"t" * 32)


def test_a_frame_error_cuts_what_the_peer_sent():
    """An op of a megabyte named in a FrameError (logged, sent back) is cut to
    FRAME_ERROR_TEXT_MAX characters, and says how long it was."""
    e = _wire.FrameError("EPROTO", f"unknown op {'x' * (1 << 20)!r}")
    text = str(e)
    assert len(text) < _wire.FRAME_ERROR_TEXT_MAX + 40
    assert text.startswith("unknown op 'xxx") and text.endswith(" characters)")
    assert str(_wire.FrameError("EPROTO", "short")) == "short"


def _frame(sock, body):
    """Send body as one frame from a thread (it may pass the socket buffer); the thread."""
    t = threading.Thread(target=sock.sendall, args=(struct.pack(">I", len(body)) + body,))
    t.start()
    return t


def test_a_frame_of_too_many_values_is_refused_before_it_is_parsed(pair, monkeypatch):
    """Commas and opening brackets outside strings are counted before parsing: past the limit
    given (REQUEST_VALUES_MAX for a peer's request) the frame is refused, naming it; commas in
    strings do not count; the largest legitimate frames are within the limits."""
    a, b = pair
    body = b'{"op":"stat","pad":[' + b"{}," * _wire.REQUEST_VALUES_MAX + b"{}]}"
    t = _frame(a, body)
    with pytest.raises(_wire.FrameError, match="exceeds REQUEST_VALUES_MAX") as e:
        _wire.recv(b, time.monotonic() + 10, values=_wire.REQUEST_VALUES_MAX,
                   values_name="REQUEST_VALUES_MAX")
    t.join()
    assert e.value.errname == "EMSGSIZE"
    assert str(e.value) == (f"frame of {2 * _wire.REQUEST_VALUES_MAX + 4} commas and opening "
                            f"brackets exceeds REQUEST_VALUES_MAX ({_wire.REQUEST_VALUES_MAX})")
    # a name of commas, and escaped quotes, is one value
    name = 'w/",' + "," * (2 * _wire.REQUEST_VALUES_MAX)
    t = _frame(a, _wire.encode({"op": "stat", "name": name})[4:])
    assert _wire.recv(b, time.monotonic() + 10, values=_wire.REQUEST_VALUES_MAX)["name"] == name
    t.join()
    # a frame of escaped quotes and commas, no string closed, is counted in one pass (under a
    # second): the search for strings once failed from each quote anew, hours for this frame
    for tail in (b"", b"\\"):
        body = b"x" + b'\\"' * (1 << 20) + b"," * (2 * _wire.REQUEST_VALUES_MAX) + tail
        t = _frame(a, body)
        with pytest.raises(_wire.FrameError, match="not UTF-8 JSON"):
            _wire.recv(b, time.monotonic() + 60, values=_wire.REQUEST_VALUES_MAX)
        t.join()
    # a layout of BUNDLE_MAX tensors of NDIM_MAX dimensions, and a put of as many descriptors
    import dlpack_ipc
    layout = {"op": "layout", "tensors": [[f"k{i}", "uint8", [1] * dlpack_ipc.NDIM_MAX, 1]
                                          for i in range(dlpack_ipc.BUNDLE_MAX)]}
    t = _frame(a, _wire.encode(layout)[4:])
    assert _wire.recv(b, time.monotonic() + 10) == layout
    t.join()
    put = {"op": "put", "id": 1, "lease": "l", "metadata": "m" * 4096,
           "descs": [[2**47, 2**40]] * dlpack_ipc.BUNDLE_MAX}
    t = _frame(a, _wire.encode(put)[4:])
    assert _wire.recv(b, time.monotonic() + 10, values=_wire.REQUEST_VALUES_MAX) == put
    t.join()


@pytest.mark.parametrize("name", ["w/\\ud800", "w/\\udfff-x", "\\ude00w/"])
def test_a_lone_surrogate_is_a_protocol_error(pair, name):
    """A name that escapes half of a UTF-16 surrogate pair is no Unicode text: EPROTO, naming
    it. A whole pair, and an escaped backslash before "ud800", are text."""
    a, b = pair
    a.sendall(struct.pack(">I", len(name) + 22) + b'{"op":"get","name":"%s"}' % name.encode())
    with pytest.raises(_wire.FrameError, match="lone UTF-16 surrogate") as e:
        _wire.recv(b, time.monotonic() + 5)
    assert e.value.errname == "EPROTO"
    for text, parsed in ((b"w/\\ud83d\\ude00", "w/\U0001F600"), (b"w/\\\\ud800", "w/\\ud800")):
        body = b'{"op":"get","name":"%s"}' % text
        a.sendall(struct.pack(">I", len(body)) + body)
        assert _wire.recv(b, time.monotonic() + 5)["name"] == parsed


# Far above ctest's bound on bridge_wire (TIMEOUT 300 s): an authentication that waited
# AUTH_TIMEOUT so long instead of its own deadline would be failed by that bound.
AUTH_TIMEOUT_HANGS = 3600.0


@pytest.mark.parametrize("says_hello", [False, True])
def test_auth_server_takes_a_deadline_of_its_own(pair, monkeypatch, says_hello):
    """The accepting bridge gives a peer _server.AUTH_DEADLINE for the whole authentication,
    whatever AUTH_TIMEOUT is: a peer that says nothing, or stops after its hello, times out at
    the deadline auth_server was given (one that waited AUTH_TIMEOUT would hang here)."""
    monkeypatch.setattr(_wire, "AUTH_TIMEOUT", AUTH_TIMEOUT_HANGS)
    a, b = pair
    if says_hello:
        _wire.send(a, {"op": "hello", "version": _wire.PROTOCOL_VERSION, "from": "staller",
                       "nonce": os.urandom(_wire.NONCE_BYTES).hex()})
    with pytest.raises(TimeoutError, match="timed out reading a frame"):
        _wire.auth_server(b, b"t" * 32, 0.2)
    if says_hello:       # it answered the hello, and then waited for the proof
        assert _wire.recv(a, time.monotonic() + 5)["op"] == "challenge"
