# SPDX-License-Identifier: Apache-2.0
"""Every tensor a user holds can be published (issue #16, section 2), each case across two
interpreters: read-only numpy arrays (which numpy 1.x will not export through DLPack), torch bool
tensors (which torch 1.x will not), and the torch tensors whose DLPack export refuses for other
reasons (parameters, conjugate and negative views)."""
import json

import numpy as np
import pytest
import torch

import dlpack_ipc


def numpy_exports_read_only():
    """Does this numpy export a read-only array through DLPack (numpy 2 does, 1.x refuses)?"""
    a = np.arange(2.0)
    a.setflags(write=False)
    try:
        a.__dlpack__()
    except BufferError:
        return False
    return True


def numpy_has_dlpack_bool():
    try:
        np.zeros(1, dtype=bool).__dlpack__()
    except BufferError:
        return False
    return True


def torch_has_dlpack_bool():
    try:
        torch.utils.dlpack.to_dlpack(torch.zeros(1, dtype=torch.bool))
    except RuntimeError:
        return False
    return True


# ---- read-only numpy arrays ----------------------------------------------------------------

# name: (how the publisher makes it, what it holds)
READ_ONLY = {
    "setflags": ("a = np.arange(12, dtype=np.float32).reshape(3, 4); a.setflags(write=False)",
                 np.arange(12, dtype=np.float32).reshape(3, 4)),
    "frombuffer": ("a = np.frombuffer(bytes(range(10, 34)), dtype=np.int16).reshape(4, 3)",
                   np.frombuffer(bytes(range(10, 34)), dtype=np.int16).reshape(4, 3)),
    "mmap": ("a = np.load(NPY, mmap_mode='r')", np.arange(30, dtype=np.float64).reshape(5, 6) / 7),
    "mmap_slice": ("a = np.load(NPY, mmap_mode='r')[1::2, ::-2]",
                   (np.arange(30, dtype=np.float64).reshape(5, 6) / 7)[1::2, ::-2]),
    "broadcast": ("a = np.broadcast_to(np.arange(5, dtype=np.int64), (3, 4, 5))",
                  np.broadcast_to(np.arange(5, dtype=np.int64), (3, 4, 5))),
    "broadcast_column": ("a = np.broadcast_to(np.array([[1.5], [2.5]]), (2, 6))",
                         np.broadcast_to(np.array([[1.5], [2.5]]), (2, 6))),
    "sliding_window": ("a = np.lib.stride_tricks.sliding_window_view("
                       "np.arange(10, dtype=np.uint16), 4)",
                       np.lib.stride_tricks.sliding_window_view(np.arange(10, dtype=np.uint16), 4)),
    "scalar": ("a = np.array(-3.25, dtype=np.float32); a.setflags(write=False)",
               np.array(-3.25, dtype=np.float32)),
    "empty": ("a = np.zeros((0, 4), dtype=np.complex64); a.setflags(write=False)",
              np.zeros((0, 4), dtype=np.complex64)),
    "bool": ("a = np.array([[True, False, True], [False, False, True]]); a.setflags(write=False)",
             np.array([[True, False, True], [False, False, True]])),
    # a field of a structured array: its stride (12 bytes) is not a whole number of int64s
    "record_field": ("r = np.zeros(4, dtype=[('x', '<i8'), ('y', '<i4')]); r['x'] = [5, 6, 7, 8]; "
                     "r.setflags(write=False); a = r['x']",
                     np.array([5, 6, 7, 8], dtype=np.int64)),
    # foreign byte order: published as the same values in native order
    "big_endian": ("a = np.arange(6, dtype='>i4').reshape(2, 3); a.setflags(write=False)",
                   np.arange(6, dtype=np.int32).reshape(2, 3)),
}


def test_read_only_numpy_arrays_publish(ipc, py, tmp_path):
    """Each read-only array published by another interpreter reads back the same values; what
    broadcasting or strides shared between elements is materialized C-contiguous by the copy."""
    npy = tmp_path / "weights.npy"
    np.save(npy, np.arange(30, dtype=np.float64).reshape(5, 6) / 7)
    lines = [f"NPY = {str(npy)!r}", "out = {}"]
    for name, (make, _) in READ_ONLY.items():
        lines += [make,
                  "assert not a.flags.writeable",
                  f"out[{name!r}] = dlpack_ipc.publish('ro/{name}', a)"]
    lines.append("print(json.dumps(out))")
    cp = py.check("import json, numpy as np, dlpack_ipc\n" + "\n".join(lines))
    assert json.loads(cp.stdout) == {name: 1 for name in READ_ONLY}
    bad = []
    for name, (_, want) in READ_ONLY.items():
        t = ipc.attach("ro/" + name)
        want = np.array(want, order="C")  # ascontiguousarray would make a 0-d array 1-d
        got = np.asarray(t)
        if (t.dtype, t.shape, t.nbytes) != (str(want.dtype), want.shape, want.nbytes):
            bad.append(f"{name}: {t.dtype}{t.shape} {t.nbytes} B, expected "
                       f"{want.dtype}{want.shape} {want.nbytes} B")
        elif not np.array_equal(got, want):
            bad.append(f"{name}: read {got!r}, expected {want!r}")
        elif want.size and got.strides != want.strides:
            bad.append(f"{name}: strides {got.strides}, expected C-contiguous {want.strides}")
        if not t.readonly:
            bad.append(f"{name}: attached writable")
    assert not bad, "\n".join(bad)


def test_read_only_numpy_arrays_in_a_bundle(ipc, py, tmp_path):
    """A state dict loaded with np.load(mmap_mode="r") goes out as one bundle; the publisher's
    arrays stay as they were (mapped, read-only)."""
    np.savez(tmp_path / "sd.npz", w=np.arange(12.0).reshape(3, 4), b=np.arange(3, dtype=np.int8))
    for k in ("w", "b"):
        np.save(tmp_path / f"{k}.npy", np.load(tmp_path / "sd.npz")[k])
    py.check(f"""
        import numpy as np, dlpack_ipc
        sd = {{k: np.load({str(tmp_path)!r} + "/" + k + ".npy", mmap_mode="r") for k in "wb"}}
        assert all(isinstance(v, np.memmap) and not v.flags.writeable for v in sd.values())
        assert dlpack_ipc.publish_dict("ro/sd", sd) == 1
        np.testing.assert_array_equal(sd["w"], np.arange(12.0).reshape(3, 4))
    """)
    d = ipc.attach_dict("ro/sd")
    assert sorted(d) == ["b", "w"]
    np.testing.assert_array_equal(np.asarray(d["w"]), np.arange(12.0).reshape(3, 4))
    np.testing.assert_array_equal(np.asarray(d["b"]), np.arange(3, dtype=np.int8))


def test_buffer_objects_publish(ipc, py):
    """Anything with the buffer protocol, which is the route numpy 1.x's read-only arrays take:
    bytes, a memoryview cast to a shape, array.array."""
    py.check("""
        import array, dlpack_ipc
        dlpack_ipc.publish("buf/bytes", b"dlpack")
        dlpack_ipc.publish("buf/view", memoryview(bytes(range(24))).cast("i", (2, 3)))
        dlpack_ipc.publish("buf/array", array.array("d", [0.5, -1.0, 2.25]))
    """)
    t = ipc.attach("buf/bytes")
    assert (t.dtype, t.shape) == ("uint8", (6,)) and bytes(np.asarray(t)) == b"dlpack"
    t = ipc.attach("buf/view")
    assert (t.dtype, t.shape) == ("int32", (2, 3))
    np.testing.assert_array_equal(np.asarray(t),
                                  np.frombuffer(bytes(range(24)), np.int32).reshape(2, 3))
    t = ipc.attach("buf/array")
    assert t.dtype == "float64" and np.asarray(t).tolist() == [0.5, -1.0, 2.25]


def test_what_dlpack_cannot_say_is_still_refused(ipc):
    """Object arrays and lists are not tensors: the producer's own error, nothing published."""
    with pytest.raises(BufferError):
        ipc.publish("no/object", np.array([object(), 1], dtype=object))
    with pytest.raises(TypeError, match="list"):
        ipc.publish("no/list", [1, 2, 3])
    with pytest.raises(BufferError, match="tensor 'o'"):
        ipc.publish_dict("no/bundle", {"fine": np.zeros(2), "o": np.array([None])})
    assert ipc.list() == []


def test_readonly_publish_is_documented_route_on_this_numpy(ipc):
    """The fallback is what publishes on numpy 1.x: its DLPack export does refuse."""
    a = np.arange(3.0)
    a.setflags(write=False)
    if numpy_exports_read_only():
        # numpy 2: the versioned capsule carries the read-only flag; no fallback needed
        assert int(np.__version__.split(".")[0]) >= 2
    else:
        with pytest.raises(BufferError):
            a.__dlpack__()
    assert ipc.publish("ro/route", a) == 1
    np.testing.assert_array_equal(np.asarray(ipc.attach("ro/route")), a)


def test_numpy_bool_arrays_publish(ipc, py):
    """numpy 1.x exports no bool through DLPack, writable or not: the buffer protocol carries
    it; numpy 2 exports it as kDLBool itself. Either way the entry is bool."""
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("np/bool", np.array([True, False, True]))
        dlpack_ipc.publish("np/bool2d", np.eye(3, dtype=bool)[:, ::-1])
    """)
    t = ipc.attach("np/bool")
    assert t.dtype == "bool" and np.asarray(t).tolist() == [True, False, True]
    t = ipc.attach("np/bool2d")
    np.testing.assert_array_equal(np.asarray(t), np.eye(3, dtype=bool)[:, ::-1])
    assert torch.equal(t.torch(), torch.eye(3, dtype=torch.bool).flip(1))


# ---- torch bool tensors --------------------------------------------------------------------

MASK = """
import torch
mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
"""
_ns = {}
exec(MASK, _ns)
EXPECTED_MASK = _ns["mask"]


def test_torch_bool_tensors_publish_as_bool(ipc, py):
    """An attention mask (and its transpose, a 0-d bool, a bundle) published from torch, whose
    1.x has no DLPack bool, arrive as kDLBool: numpy gets a bool array through the buffer
    protocol, torch through SharedTensor.torch()."""
    py.check(MASK + """
import dlpack_ipc
assert dlpack_ipc.publish("mask", mask) == 1
assert dlpack_ipc.publish("mask/t", mask.t()) == 1
assert dlpack_ipc.publish("mask/0d", torch.tensor(True)) == 1
dlpack_ipc.publish_dict("mask/bundle", {"mask": mask, "ids": torch.arange(5)})
assert mask.dtype == torch.bool  # the producer's tensor is left alone
""")
    t = ipc.attach("mask")
    assert (t.dtype, t.shape, t.nbytes) == ("bool", (3, 5), 15)
    assert [(i.dtype, i.shape) for e in ipc.list("mask") if e.name == "mask"
            for i in e.tensors] == [("bool", (3, 5))]
    a = np.asarray(t)
    assert a.dtype == np.bool_ and a.tolist() == EXPECTED_MASK.tolist()
    x = t.torch()
    assert x.dtype == torch.bool and torch.equal(x, EXPECTED_MASK)
    assert x.data_ptr() == t.data_ptr, "torch() is zero-copy"
    assert torch.equal(ipc.attach("mask/t").torch(), EXPECTED_MASK.t())
    z = ipc.attach("mask/0d")
    assert z.shape == () and z.torch().item() is True and np.asarray(z).item() is True
    d = ipc.attach_dict("mask/bundle")
    assert d["mask"].dtype == "bool" and torch.equal(d["mask"].torch(), EXPECTED_MASK)
    assert torch.equal(d["ids"].torch(), torch.arange(5))


def test_bool_through_each_library_s_own_from_dlpack(ipc, py):
    """Where numpy's or torch's from_dlpack knows kDLBool it is used as is; where it does not
    (numpy 1.x, torch 1.x) it refuses, and the documented routes above are the way."""
    py.check(MASK + """
import dlpack_ipc
dlpack_ipc.publish("mask", mask)
""")
    t = ipc.attach("mask")
    if numpy_has_dlpack_bool():
        assert np.from_dlpack(t).tolist() == EXPECTED_MASK.tolist()
    else:
        with pytest.raises((RuntimeError, BufferError, TypeError)):
            np.from_dlpack(t)
        assert np.asarray(t).dtype == np.bool_
    if torch_has_dlpack_bool():
        assert torch.equal(torch.from_dlpack(t), EXPECTED_MASK)
    else:
        with pytest.raises((RuntimeError, BufferError)):
            torch.from_dlpack(t)
        assert torch.equal(t.torch(), EXPECTED_MASK)


def test_torch_routes_for_other_dtypes(ipc, py):
    """SharedTensor.torch() is torch.from_dlpack for everything that is not bool."""
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("f", np.arange(6, dtype=np.float32).reshape(2, 3))
    """)
    t = ipc.attach("f")
    x = t.torch()
    assert x.dtype == torch.float32 and x.data_ptr() == t.data_ptr
    assert torch.equal(x, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    t.release()
    with pytest.raises(BufferError):
        t.torch()


# ---- torch tensors whose DLPack export refuses ---------------------------------------------


def test_torch_tensors_that_refuse_dlpack_publish(ipc, py):
    """A parameter (requires grad), a conjugate view, a negative view, an expanded (zero-stride)
    and a sliding-window view: published with the values they show."""
    cp = py.check("""
        import json, torch, dlpack_ipc
        p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
        c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
        n = torch.tensor([1 + 2j, -3j], dtype=torch.complex128).conj().imag
        e = torch.arange(3, dtype=torch.int32).reshape(3, 1).expand(3, 4)
        w = torch.arange(8, dtype=torch.int16).unfold(0, 3, 2)
        out = {}
        for k, v in {"param": p, "conj": c, "neg": n, "expand": e, "window": w}.items():
            out[k] = dlpack_ipc.publish("t/" + k, v)
        dlpack_ipc.publish_dict("t/params", dict(torch.nn.Linear(3, 2).named_parameters()))
        assert p.requires_grad and c.is_conj()
        print(json.dumps(out))
    """)
    assert set(json.loads(cp.stdout).values()) == {1}
    got = {k: ipc.attach("t/" + k).torch() for k in ("param", "conj", "neg", "expand", "window")}
    assert torch.equal(got["param"], torch.arange(6.0).reshape(2, 3))
    assert not got["param"].requires_grad
    assert torch.equal(got["conj"], torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    assert not got["conj"].is_conj()
    assert torch.equal(got["neg"], torch.tensor([-2.0, 3.0], dtype=torch.float64))
    assert torch.equal(got["expand"], torch.arange(3, dtype=torch.int32).reshape(3, 1).expand(3, 4))
    assert got["expand"].stride() == (4, 1), "materialized C-contiguous"
    assert torch.equal(got["window"], torch.tensor([[0, 1, 2], [2, 3, 4], [4, 5, 6]],
                                                   dtype=torch.int16))
    d = ipc.attach_dict("t/params")
    assert sorted(d) == ["bias", "weight"] and d["weight"].shape == (2, 3)
