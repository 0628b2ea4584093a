# SPDX-License-Identifier: Apache-2.0
"""Errors: OSError subclasses carrying errno and the entry's name, DLPack misuse, bad arguments."""
import errno
import os
import socket

import numpy as np
import pytest

import dlpack_ipc


def test_missing_name(ipc, daemon):
    with pytest.raises(FileNotFoundError) as ei:
        ipc.attach("no/such/name", timeout=0)
    assert ei.value.errno == errno.ENOENT
    assert "no/such/name" in str(ei.value)
    with pytest.raises(FileNotFoundError, match="no/such/dict"):
        ipc.attach_dict("no/such/dict", timeout=0)
    with pytest.raises(FileNotFoundError, match="no/such/entry"):
        ipc.unpublish("no/such/entry")
    assert daemon.stat()["protocol_errors"] == 0


def test_taken_name(ipc, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("taken", np.zeros(2))
    """)
    with pytest.raises(FileExistsError) as ei:
        ipc.publish("taken", np.ones(2))
    assert ei.value.errno == errno.EEXIST
    assert "taken" in str(ei.value)
    with pytest.raises(FileExistsError, match="taken"):
        ipc.publish_dict("taken", {"a": np.ones(2)})
    # the failed publishes changed nothing
    np.testing.assert_array_equal(np.from_dlpack(ipc.attach("taken")), 0.0)
    assert ipc.publish("taken", np.ones(2), replace=True) == 2
    np.testing.assert_array_equal(np.from_dlpack(ipc.attach("taken")), 1.0)


def test_unpublish_then_attach(ipc, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("gone", np.zeros(2))
    """)
    assert ipc.unpublish("gone") is None
    with pytest.raises(FileNotFoundError, match="gone"):
        ipc.attach("gone", timeout=0)
    assert ipc.publish("gone", np.zeros(3)) >= 1, "the name is free again"
    np.testing.assert_array_equal(np.from_dlpack(ipc.attach("gone")), np.zeros(3))


def test_no_daemon_missing_socket(tmp_path):
    path = str(tmp_path / "nobody.sock")
    with pytest.raises(FileNotFoundError) as ei:
        dlpack_ipc.Client(socket=path)
    assert ei.value.errno == errno.ENOENT
    assert not isinstance(ei.value, ConnectionRefusedError)


def test_no_daemon_stale_socket(tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    assert os.path.exists(path)
    with pytest.raises(ConnectionRefusedError) as ei:
        dlpack_ipc.Client(socket=path)
    assert ei.value.errno == errno.ECONNREFUSED


def test_default_client_without_daemon(tmp_path, py):
    cp = py.run("""
        import dlpack_ipc
        for f in (lambda: dlpack_ipc.attach("x"), dlpack_ipc.stat):
            try:
                f()
            except FileNotFoundError as e:
                print("FileNotFoundError", e.errno)
            else:
                print("no error")
    """, env={"DLPACKD_SOCKET": str(tmp_path / "nobody.sock")})
    assert cp.returncode == 0, py.describe(cp)
    assert cp.stdout.split() == ["FileNotFoundError", str(errno.ENOENT)] * 2


def test_wrong_device(ipc, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("dev", np.zeros(2))
    """)
    t = ipc.attach("dev")
    for dev in [(2, 0), (1, 1), (13, 0)]:
        with pytest.raises(BufferError):
            t.__dlpack__(dl_device=dev)
        with pytest.raises(BufferError):
            t.__dlpack__(dl_device=dev, max_version=(1, 0))
    assert t.__dlpack__(dl_device=(1, 0)) is not None
    with pytest.raises((ValueError, OSError)):
        ipc.empty((2,), "float32", device="nonsense")


def test_writable_attach_of_read_only_entry(ipc, daemon, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("ro", np.zeros(2))
    """)
    with pytest.raises(PermissionError) as ei:
        ipc.attach("ro", writable=True)
    assert ei.value.errno in (errno.EACCES, errno.EPERM)
    assert "ro" in str(ei.value)
    # the refusal left no reference behind and a read-only attach still works
    daemon.wait_stat(lambda s: s["references"] == 0, what="no references")
    assert ipc.attach("ro").readonly is True


def test_bad_arguments(ipc, daemon):
    with pytest.raises(TypeError):
        ipc.publish("bad", object())
    with pytest.raises(TypeError):
        ipc.publish("bad", [1, 2, 3])
    with pytest.raises(TypeError):
        ipc.publish("bad", np.zeros(2), bogus=True)
    with pytest.raises(TypeError):
        ipc.publish("bad", np.zeros(2), True)  # flags are keyword-only
    with pytest.raises(TypeError):
        ipc.attach("bad", 5)
    with pytest.raises(TypeError):
        ipc.attach("bad", bogus=1)
    with pytest.raises(TypeError):
        ipc.publish_dict("bad", {"a": object()})
    with pytest.raises(TypeError):
        ipc.publish_dict("bad", {1: np.zeros(2)})
    with pytest.raises(TypeError):
        dlpack_ipc.Client(socket=daemon.socket, bogus=1)
    # nothing was published by any of these
    assert ipc.list() == []
    assert daemon.stat()["entries"] == 0 and daemon.stat()["protocol_errors"] == 0


def test_messages_speak_python(ipc, py):
    """What libdlpc and dlpackd say in C's words reaches Python in Python's: the keyword to
    pass, the function called."""
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("taken", np.zeros(2))
    """)
    with pytest.raises(FileExistsError) as ei:
        ipc.publish("taken", np.ones(2))
    assert "publish with replace=True to take it over" in str(ei.value)
    assert "REPLACE" not in str(ei.value)
    with pytest.raises(ValueError) as ei:
        ipc.empty((1 << 62, 8), "float32")
    assert str(ei.value).startswith("empty(): ") and "dlpc_" not in str(ei.value)
    with pytest.raises(ValueError) as ei:
        ipc.empty_dict({"a": ((4,), "int8"), "b": ((1 << 62, 8), "float32")})
    assert str(ei.value).startswith("empty_dict(): ") and "dlpc_" not in str(ei.value)


def test_bundle_errors_name_the_key(ipc, daemon):
    """Whoever refuses a bundle's tensor, the message names its key, not its place."""
    import torch
    deep = torch.zeros((1,) * (dlpack_ipc.NDIM_MAX + 1))
    with pytest.raises(ValueError) as ei:
        ipc.publish_dict("b", {"ok": torch.zeros(2), "deep.weight": deep})
    assert (f"cannot publish 'b': tensor 'deep.weight' has {dlpack_ipc.NDIM_MAX + 1} "
            "dimensions") in str(ei.value)
    with pytest.raises(ValueError, match="cannot publish 'one': the tensor has"):
        ipc.publish("one", deep)
    with pytest.raises(TypeError, match="cannot publish 'b': tensor 'l': an object of type "
                                        "list has no __dlpack__"):
        ipc.publish_dict("b", {"ok": torch.zeros(2), "l": [1.0]})
    with pytest.raises(TypeError, match=r"keys must be str, not int \(key 7\)"):
        ipc.publish_dict("b", {"ok": torch.zeros(2), 7: torch.zeros(2)})
    with pytest.raises(ValueError, match=r"key 'a\\x00b' contains NUL"):
        ipc.publish_dict("b", {"a\0b": torch.zeros(2)})
    with pytest.raises(ValueError, match="is too long"):
        ipc.publish_dict("b", {"k" * 256: torch.zeros(2)})
    assert ipc.list() == [] and daemon.stat()["protocol_errors"] == 0


def test_errors_name_the_entry_for_bundles_and_waits(ipc):
    with pytest.raises(TimeoutError) as ei:
        ipc.attach_dict("some/bundle", timeout=0.1)
    assert ei.value.errno == errno.ETIMEDOUT
    assert "some/bundle" in str(ei.value)
    with pytest.raises(TimeoutError, match="some/tensor"):
        ipc.attach("some/tensor", timeout=0.1)


def test_daemon_survives_client_errors(ipc, daemon):
    for _ in range(20):
        with pytest.raises(FileNotFoundError):
            ipc.attach("none", timeout=0)
    ipc.publish("ok", np.arange(2))
    st = daemon.stat()
    assert st["entries"] == 1 and st["protocol_errors"] == 0 and st["references"] == 0


# ---- messages that name the call to make instead ---------------------------------------------


def test_bundle_attached_as_a_tensor_names_attach_dict(ipc, daemon):
    ipc.publish_dict("bund", {"a": np.zeros(2), "b": np.ones(2)})
    with pytest.raises(ValueError) as ei:
        ipc.attach("bund", timeout=0)
    assert "'bund' is a bundle of 2 tensors" in str(ei.value)
    assert "attach_dict()" in str(ei.value)
    assert sorted(ipc.attach_dict("bund", timeout=0)) == ["a", "b"]
    # one tensor under a key is a bundle too: attach() would lose the key
    ipc.publish_dict("one", {"weight": np.arange(3)})
    with pytest.raises(ValueError) as ei:
        ipc.attach("one", timeout=0)
    assert "'one' is a bundle of one tensor, under the key 'weight'" in str(ei.value)
    assert "attach_dict()" in str(ei.value)
    np.testing.assert_array_equal(np.from_dlpack(ipc.attach_dict("one")["weight"]),
                                  np.arange(3))
    assert daemon.stat()["protocol_errors"] == 0


def test_a_mapping_where_a_tensor_goes_names_the_dict_call(ipc, daemon):
    import collections
    import torch
    for m in ({"a": np.zeros(2)}, collections.OrderedDict(w=torch.zeros(2)),
              torch.nn.Linear(2, 2).state_dict()):
        with pytest.raises(TypeError) as ei:
            ipc.publish("sd", m)
        assert str(ei.value).startswith(
            f"cannot publish 'sd': publish() takes one tensor, not {type(m).__name__}; "
            "publish_dict()"), str(ei.value)
    ch = ipc.channel("err/ch")
    with pytest.raises(TypeError) as ei:
        ch.send({"a": np.zeros(2)}, timeout=0)
    assert "send() takes one tensor, not dict; send_dict()" in str(ei.value)
    assert "publish" not in str(ei.value)
    # and the other way round: what is not a mapping, given to publish_dict()
    for obj, hint in ((np.zeros(2), " (publish() publishes one tensor)"), ([1, 2], ""),
                      (3, "")):
        with pytest.raises(TypeError) as ei:
            ipc.publish_dict("sd", obj)
        assert str(ei.value) == (f"cannot publish 'sd': publish_dict() takes a mapping of str "
                                 f"keys to tensors, not {type(obj).__name__}{hint}")
    # what is not a mapping, given to send_dict(): the same TypeError, in a channel's words
    for obj, hint in ((np.zeros(2), " (send() sends one tensor)"), ([1, 2], ""), (3, "")):
        with pytest.raises(TypeError) as ei:
            ch.send_dict(obj, timeout=0)
        assert str(ei.value) == (f"cannot send to channel 'err/ch': send_dict() takes a "
                                 f"mapping of str keys to tensors, not "
                                 f"{type(obj).__name__}{hint}")
    assert ch.stat().depth == 0
    ch.remove()
    assert ipc.list() == [] and daemon.stat()["protocol_errors"] == 0


@pytest.mark.parametrize("obj", [3, 2.5, object(), "str", None, [1.0]])
def test_unpublishable_objects_read_as_english(ipc, obj):
    """No "cannot publish a int": the type is named, not given an article."""
    with pytest.raises(TypeError) as ei:
        ipc.publish("x", obj)
    msg = str(ei.value)
    assert msg == (f"cannot publish 'x': an object of type {type(obj).__qualname__} has no "
                   "__dlpack__ method and is not a DLPack capsule"), msg
    for wrong in ("a int", "a object", "a float", "a str", "a NoneType", "a list"):
        assert wrong not in msg, msg


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to publish as uid 65534")
@pytest.mark.dlpackd_for_others
def test_another_uids_name_does_not_suggest_replace(ipc, daemon, py):
    """replace=True cannot take over another uid's name (only its uid or root may): neither
    the refusal of the publish nor that of the replace suggests it."""
    ipc.publish("theirs", np.zeros(2))
    cp = py.check("""
        import os
        import numpy as np, dlpack_ipc
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        for replace in (False, True):
            try:
                dlpack_ipc.publish("theirs", np.ones(2), replace=replace)
            except OSError as e:
                print(type(e).__name__, "|", e, flush=True)
    """)
    lines = cp.stdout.splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == ["FileExistsError", "PermissionError"], lines
    for ln in lines:
        assert "theirs" in ln, ln
        assert "replace=True" not in ln and "REPLACE" not in ln, ln
    np.testing.assert_array_equal(np.from_dlpack(ipc.attach("theirs", timeout=0)), 0.0)


class _Producer:
    """Exports a numpy array, on the device it is told to claim; or refuses with the error given."""

    def __init__(self, device=(1, 0), refusal=None):
        self.device, self.refusal = device, refusal

    def __dlpack__(self, **kw):
        if self.refusal:
            raise self.refusal
        return np.zeros(2).__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.device


def test_one_tensor_errors_name_the_entry(ipc, daemon):
    """publish() and a channel's send() of one tensor name the entry (the channel), as
    publish_dict() names it and the key; a __dlpack_device__() that returns no (type, id) pair
    is named with what it returned."""
    with pytest.raises(BufferError) as ei:
        ipc.publish("one", _Producer(refusal=BufferError("not exportable today")))
    assert str(ei.value) == "cannot publish 'one': not exportable today"
    with pytest.raises(BufferError) as ei:
        ipc.publish_dict("b", {"w": _Producer(refusal=BufferError("not exportable today"))})
    assert str(ei.value) == "cannot publish 'b': tensor 'w': not exportable today"
    with pytest.raises(TypeError) as ei:
        ipc.publish("one", _Producer("cpu"))
    assert str(ei.value) == ("cannot publish 'one': _Producer.__dlpack_device__() returned "
                             "'cpu', not a (device type, device id) pair of ints")
    for device in ((1,), ("1", 0), None):
        with pytest.raises(TypeError, match=r"__dlpack_device__\(\) returned"):
            ipc.publish("one", _Producer(device))
    for device, shown in (((99, 0), "99"), ((2**80, 0), str(2**80)), ((-1, 0), "-1")):
        with pytest.raises(BufferError) as ei:
            ipc.publish("one", _Producer(device))
        assert str(ei.value) == (f"cannot publish 'one': a tensor of type _Producer on DLPack "
                                 f"device type {shown}: only host (CPU) and CUDA memory can be "
                                 "shared")
    ch = ipc.channel("errs/one", direct=False)
    with pytest.raises(BufferError) as ei:
        ch.send(_Producer((99, 0)))
    assert str(ei.value).startswith("cannot send to channel 'errs/one': a tensor of type "
                                    "_Producer on DLPack device type 99"), str(ei.value)
    assert ch.stat().depth == 0
    ch.remove()
    # the producer's own exception of another type goes through as it is
    with pytest.raises(KeyError):
        ipc.publish("one", _Producer(refusal=KeyError("k")))
    # a claim of the host that is true publishes
    assert ipc.publish("one", _Producer()) == 1
    np.testing.assert_array_equal(np.from_dlpack(ipc.attach("one")), 0.0)
    assert daemon.stat()["protocol_errors"] == 0


def test_client_init_again(daemon):
    """__init__() on a connected Client is refused and leaves its connection as it was; on a
    closed one it connects anew, where that call says."""
    c = dlpack_ipc.Client(socket=daemon.socket)
    c.publish("init/x", np.ones(2))
    with pytest.raises(RuntimeError, match="connected already"):
        c.__init__(socket="/nonexistent/dlpackd.sock")
    np.testing.assert_array_equal(np.from_dlpack(c.attach("init/x")), 1.0)
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.attach("init/x")
    with pytest.raises(FileNotFoundError, match="/nonexistent/dlpackd.sock"):
        c.__init__(socket="/nonexistent/dlpackd.sock")
    c.__init__(socket=daemon.socket)
    np.testing.assert_array_equal(np.from_dlpack(c.attach("init/x")), 1.0)
    c.unpublish("init/x")
    c.close()
