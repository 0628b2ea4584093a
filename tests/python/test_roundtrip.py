# SPDX-License-Identifier: Apache-2.0
"""Tensors published in one interpreter and attached in another: values, dtypes, shapes, zero-copy."""
import ctypes
import json

import numpy as np
import pytest
import torch

import dlpack_ipc

# The same 3x4x5 float32 payload, built by each producer library.
PAYLOAD = {
    "numpy": "(np.arange(60).reshape(3, 4, 5) * 1.5 - 20).astype(np.float32)",
    "torch": "(torch.arange(60).reshape(3, 4, 5) * 1.5 - 20).to(torch.float32)",
}
EXPECTED = (np.arange(60).reshape(3, 4, 5) * 1.5 - 20).astype(np.float32)


def consume(lib, t):
    """The attached tensor as a numpy array, through `lib`'s from_dlpack."""
    if lib == "numpy":
        return np.from_dlpack(t)
    x = torch.from_dlpack(t)
    assert isinstance(x, torch.Tensor)
    return x.numpy()


@pytest.mark.parametrize("consumer", ["numpy", "torch"])
@pytest.mark.parametrize("producer", ["numpy", "torch"])
def test_publish_in_child_attach_here(ipc, py, producer, consumer):
    cp = py.check(f"""
        import numpy as np, torch, dlpack_ipc
        x = {PAYLOAD[producer]}
        print(dlpack_ipc.publish("rt/{producer}", x))
    """)
    assert cp.stdout.split() == ["1"], "first publication must be generation 1"
    t = ipc.attach(f"rt/{producer}")
    assert t.name == f"rt/{producer}"
    assert t.generation == 1
    assert t.shape == (3, 4, 5)
    assert t.dtype == "float32"
    assert t.device == "cpu"
    assert t.nbytes == 60 * 4
    assert t.readonly is True
    assert t.__dlpack_device__() == (1, 0)
    got = consume(consumer, t)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, EXPECTED)


@pytest.mark.parametrize("consumer", ["numpy", "torch"])
def test_publish_here_attach_in_child(ipc, py, consumer):
    gen = ipc.publish("rt/here", torch.from_numpy(EXPECTED.copy()))
    assert gen == 1
    read = "np.from_dlpack(t)" if consumer == "numpy" else "torch.from_dlpack(t).numpy()"
    cp = py.check(f"""
        import numpy as np, torch, dlpack_ipc
        t = dlpack_ipc.attach("rt/here")
        a = {read}
        print(a.dtype, a.shape, float(a.sum()), float(a[2, 3, 4]))
    """)
    assert cp.stdout.split() == ["float32", "(3,", "4,", "5)", str(float(EXPECTED.sum())),
                                 str(float(EXPECTED[2, 3, 4]))]


def test_from_dlpack_is_zero_copy(ipc, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("zc/a", np.arange(1000, dtype=np.int64))
    """)
    t = ipc.attach("zc/a")
    a1 = np.from_dlpack(t)
    a2 = np.from_dlpack(t)
    x = torch.from_dlpack(t)
    assert isinstance(t.data_ptr, int) and t.data_ptr != 0
    assert a1.ctypes.data == t.data_ptr
    assert a2.__array_interface__["data"][0] == t.data_ptr
    assert x.data_ptr() == t.data_ptr
    assert t.data_ptr % 256 == 0, "tensor data is 256-byte aligned in its storage"
    np.testing.assert_array_equal(a1, np.arange(1000))


def test_writable_attach_write_seen_by_other_attaches(ipc, daemon, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("zc/w", np.zeros((4, 8), dtype=np.int32), writable=True)
    """)
    w = ipc.attach("zc/w", writable=True)
    r = ipc.attach("zc/w")
    assert w.readonly is False
    assert r.readonly is True
    # numpy 1.24's from_dlpack always makes read-only arrays: write through torch's view
    aw = torch.from_dlpack(w).numpy()
    assert aw.flags.writeable
    ar = np.from_dlpack(r)
    assert aw.ctypes.data == w.data_ptr and ar.ctypes.data == r.data_ptr
    np.testing.assert_array_equal(ar, 0)
    aw[...] = np.arange(32, dtype=np.int32).reshape(4, 8)
    aw[3, 7] = -5
    # the read-only attach in this process sees it through its own mapping
    assert ar[3, 7] == -5
    np.testing.assert_array_equal(ar[:3], np.arange(24).reshape(3, 8))
    # and so does a fresh attach in another process
    cp = py.check("""
        import numpy as np, dlpack_ipc
        a = np.from_dlpack(dlpack_ipc.attach("zc/w"))
        print(int(a[3, 7]), int(a.sum()))
    """)
    assert cp.stdout.split() == ["-5", str(int(np.arange(31).sum()) - 5)]
    # a writer in another process is seen here
    py.check("""
        import numpy as np, dlpack_ipc
        import torch
        a = torch.from_dlpack(dlpack_ipc.attach("zc/w", writable=True))
        a[0, 0] = 1234
    """)
    assert ar[0, 0] == 1234 and aw[0, 0] == 1234


# ---- dtypes and shapes ---------------------------------------------------------------------

DTYPES = ["int8", "int16", "int32", "int64", "uint8", "float16", "float32", "float64",
          "complex64", "complex128"]

# Deterministic values for each dtype, the same formula on both sides.
VALUES = """
def values(dt, shape=(3, 5)):
    n = 1
    for s in shape:
        n *= s
    base = np.arange(n, dtype=np.int64) * 37 % 101 - 50
    if dt.startswith("uint"):
        base = base + 50
    a = base.astype(dt)
    if dt.startswith("complex"):
        a = a + 1j * base[::-1].astype(dt)
    if dt.startswith("float") or dt.startswith("complex"):
        a = a / 4
    return a.astype(dt).reshape(shape)
"""
_ns = {"np": np}
exec(VALUES, _ns)
values = _ns["values"]


@pytest.mark.parametrize("producer", ["numpy", "torch"])
def test_every_shared_dtype_round_trips(ipc, py, producer):
    conv = "a" if producer == "numpy" else "torch.from_numpy(a)"
    py.check("import numpy as np, torch, dlpack_ipc\n" + VALUES + f"""
for dt in {DTYPES!r}:
    a = values(dt)
    dlpack_ipc.publish("dt/" + dt, {conv})
""")
    bad = []
    for dt in DTYPES:
        t = ipc.attach("dt/" + dt)
        exp = values(dt)
        if t.dtype != dt or t.shape != (3, 5) or t.nbytes != exp.nbytes:
            bad.append(f"{dt}: dtype {t.dtype!r} shape {t.shape} nbytes {t.nbytes}")
            continue
        a = np.from_dlpack(t)
        x = torch.from_dlpack(t).numpy()
        if a.dtype != np.dtype(dt) or not np.array_equal(a, exp):
            bad.append(f"{dt}: numpy read {a.dtype} {a!r}")
        if x.dtype != np.dtype(dt) or not np.array_equal(x, exp):
            bad.append(f"{dt}: torch read {x.dtype} {x!r}")
    assert not bad, "\n".join(bad)


def test_bfloat16_through_torch(ipc, py):
    py.check("""
        import torch, dlpack_ipc
        x = torch.linspace(-3, 3, 24).reshape(2, 3, 4).to(torch.bfloat16)
        dlpack_ipc.publish("dt/bf16", x)
    """)
    t = ipc.attach("dt/bf16")
    assert t.dtype == "bfloat16"
    assert t.shape == (2, 3, 4)
    assert t.nbytes == 48
    x = torch.from_dlpack(t)
    assert x.dtype == torch.bfloat16
    assert torch.equal(x, torch.linspace(-3, 3, 24).reshape(2, 3, 4).to(torch.bfloat16))


def test_bool_round_trips_through_shared_memory(ipc, py):
    # Neither numpy 1.24 nor torch 1.13 speaks kDLBool over DLPack: fill through the address.
    bits = bytes([1, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1])
    e = ipc.empty((3, 4), "bool")
    assert e.dtype == "bool" and e.shape == (3, 4) and e.nbytes == 12
    ctypes.memmove(e.data_ptr, bits, len(bits))
    ipc.publish("dt/bool", e)
    cp = py.check("""
        import ctypes, dlpack_ipc
        t = dlpack_ipc.attach("dt/bool")
        print(t.dtype, list(t.shape), t.nbytes, ctypes.string_at(t.data_ptr, t.nbytes).hex())
    """)
    assert cp.stdout.split() == ["bool", "[3,", "4]", "12", bits.hex()]
    info = [e for e in ipc.list("dt/") if e.name == "dt/bool"][0]
    assert [(ti.dtype, tuple(ti.shape)) for ti in info.tensors] == [("bool", (3, 4))]


SHAPES = {
    "scalar": ("np.array(2.5, dtype=np.float64)", "torch.tensor(2.5, dtype=torch.float64)"),
    "empty": ("np.zeros((0, 3), dtype=np.float32)", "torch.zeros((0, 3), dtype=torch.float32)"),
    "step": ("np.arange(40, dtype=np.int32).reshape(8, 5)[::2]",
             "torch.arange(40, dtype=torch.int32).reshape(8, 5)[::2]"),
    "transpose": ("np.arange(40, dtype=np.int16).reshape(8, 5).T",
                  "torch.arange(40, dtype=torch.int16).reshape(8, 5).t()"),
    "slice": ("np.arange(120, dtype=np.float64).reshape(4, 5, 6)[1:3, 2, 1:5]",
              "torch.arange(120, dtype=torch.float64).reshape(4, 5, 6)[1:3, 2, 1:5]"),
    "colslice": ("np.arange(60, dtype=np.int64).reshape(6, 10)[:, 3:7]",
                 "torch.arange(60, dtype=torch.int64).reshape(6, 10)[:, 3:7]"),
}
EXPECTED_SHAPES = {
    "scalar": np.array(2.5, dtype=np.float64),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "step": np.arange(40, dtype=np.int32).reshape(8, 5)[::2],
    "transpose": np.arange(40, dtype=np.int16).reshape(8, 5).T,
    "slice": np.arange(120, dtype=np.float64).reshape(4, 5, 6)[1:3, 2, 1:5],
    "colslice": np.arange(60, dtype=np.int64).reshape(6, 10)[:, 3:7],
}


@pytest.mark.parametrize("producer", [0, 1], ids=["numpy", "torch"])
def test_shapes_and_strided_inputs_round_trip(ipc, py, producer):
    lines = "\n".join(
        f"x = {src[producer]}\n"
        f"if {k!r} in ('step', 'transpose', 'slice', 'colslice'):\n"
        f"    assert not (x.flags['C_CONTIGUOUS'] if hasattr(x, 'flags') else x.is_contiguous())\n"
        f"dlpack_ipc.publish('sh/{k}', x)"
        for k, src in SHAPES.items())
    py.check("import numpy as np, torch, dlpack_ipc\n" + lines)
    bad = []
    for k, exp in EXPECTED_SHAPES.items():
        t = ipc.attach("sh/" + k)
        if t.shape != exp.shape or t.dtype != str(exp.dtype) or t.nbytes != exp.nbytes:
            bad.append(f"{k}: shape {t.shape} dtype {t.dtype} nbytes {t.nbytes}, "
                       f"expected {exp.shape} {exp.dtype} {exp.nbytes}")
            continue
        a = np.from_dlpack(t)
        if a.shape != exp.shape or not np.array_equal(a, exp):
            bad.append(f"{k}: numpy read {a!r}, expected {exp!r}")
        elif exp.size and not a.flags["C_CONTIGUOUS"]:
            bad.append(f"{k}: attached tensor is not C-contiguous (strides {a.strides})")
        x = torch.from_dlpack(t)
        if tuple(x.shape) != exp.shape or not np.array_equal(x.numpy(), exp):
            bad.append(f"{k}: torch read {x!r}")
    assert not bad, "\n".join(bad)


def test_module_functions_use_dlpackd_socket(daemon, py):
    # A fresh interpreter with only DLPACKD_SOCKET set reaches this test's daemon by default.
    cp = py.check("""
        import json, numpy as np, dlpack_ipc
        g = dlpack_ipc.publish("env/x", np.ones(3))
        print(json.dumps([g, dlpack_ipc.stat()["daemon_pid"]]))
    """)
    assert json.loads(cp.stdout) == [1, daemon.pid]
    with dlpack_ipc.Client(socket=daemon.socket) as c:
        assert [e.name for e in c.list()] == ["env/x"]
