# SPDX-License-Identifier: Apache-2.0
"""The cases numpy's and PyTorch's own DLPack tests try, tried through publish -> attach, with
dlpack_ipc as the foreign producer (and consumer) in between (issue #16, section 2): every
dtype, 0-d, empty, 32-d, strided and negative-stride inputs, the arguments of __dlpack__,
capsule renaming, a SharedTensor deleted while views live, and the keyword-only calls and
retry rules of DLPack 1.x (numpy 2). Each publishes in one interpreter and reads in another."""
import ctypes
import gc
import json

import numpy as np
import pytest
import torch

import dlpack_ipc
from test_capsule import IS_COPIED, READ_ONLY, capsule_name, legacy, versioned
from test_publish_any import numpy_has_dlpack_bool, torch_has_dlpack_bool

# ---- dtypes --------------------------------------------------------------------------------

# The same values on both sides: extremes, signed zero, infinities and NaN where the type has
# them. VALUES defines numpy_values(name) and torch_values(name).
VALUES = r"""
import numpy as np, torch

def numpy_values(name):
    if name == "bool":
        return np.array([[True, False, False, True], [False, True, True, False]])
    dt = np.dtype(name)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        v = [info.min, info.max, 0, 1, info.max // 3, info.min // 5 if dt.kind == "i" else 7,
             42, info.max - 1]
        return np.array(v, dtype=dt).reshape(2, 4)
    f = [-np.inf, -1.5, -0.0, 0.0, 1 / 3, 6.5e4 if dt.itemsize == 2 else 1e30, np.inf, np.nan]
    if dt.kind == "c":
        c = np.empty(8, dtype=dt)
        c.real, c.imag = f, f[::-1]
        return c.reshape(2, 4)
    return np.array(f, dtype=dt).reshape(2, 4)

def torch_values(name):
    if name == "bfloat16":
        return torch.tensor([-np.inf, -1.5, -0.0, 0.0, 1 / 3, 3e38, np.inf, np.nan],
                            dtype=torch.bfloat16).reshape(2, 4)
    return torch.from_numpy(numpy_values(name).copy())
"""
_ns = {}
exec(VALUES, _ns)
numpy_values, torch_values = _ns["numpy_values"], _ns["torch_values"]

NUMPY_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]
# torch 1.x has no uint16..uint64; torch 2.3 and later do
TORCH_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "float16", "bfloat16",
                "float32", "float64", "complex64", "complex128"] + \
    [d for d in ("uint16", "uint32", "uint64") if hasattr(torch, d)]


def raw(t):
    return ctypes.string_at(t.data_ptr, t.nbytes)


def bytes_of(x):
    if isinstance(x, torch.Tensor):
        x = x.contiguous()
        return ctypes.string_at(x.data_ptr(), x.numel() * x.element_size())
    return np.ascontiguousarray(x).tobytes()


def same(got, want):
    """Equal values, NaN equal to NaN and -0.0 told from 0.0 (compared as bits)."""
    return bytes_of(got) == bytes_of(want) and tuple(got.shape) == tuple(want.shape)


@pytest.mark.parametrize("producer", ["numpy", "torch"])
def test_every_dtype_through_each_consumer(ipc, py, producer):
    dtypes = NUMPY_DTYPES if producer == "numpy" else TORCH_DTYPES
    make = "numpy_values" if producer == "numpy" else "torch_values"
    py.check(VALUES + f"""
import dlpack_ipc
dlpack_ipc.publish_dict("dt", {{n: {make}(n) for n in {dtypes!r}}})
for n in {dtypes!r}:
    dlpack_ipc.publish("dt/" + n, {make}(n))
""")
    bundle = ipc.attach_dict("dt")
    assert list(bundle) == dtypes
    bad = []
    for name in dtypes:
        want = numpy_values(name) if producer == "numpy" else torch_values(name)
        for t in (bundle[name], ipc.attach("dt/" + name)):
            if (t.dtype, t.shape) != (name, (2, 4)) or raw(t) != bytes_of(want):
                bad.append(f"{name}: {t.dtype}{t.shape} {raw(t).hex()}, "
                           f"want {bytes_of(want).hex()}")
                continue
            # numpy: from_dlpack, or for bool where numpy lacks DLPack bool the buffer protocol
            if name != "bfloat16":
                a = np.asarray(t) if name == "bool" and not numpy_has_dlpack_bool() \
                    else np.from_dlpack(t)
                if a.dtype != np.dtype(name) or not same(a, numpy_values(name)):
                    bad.append(f"{name}: numpy read {a!r}")
            # torch: SharedTensor.torch() always; from_dlpack wherever torch has the dtype
            x = t.torch() if name in TORCH_DTYPES else None
            if x is not None and (str(x.dtype) != "torch." + name or not same(x, want)):
                bad.append(f"{name}: torch() read {x!r}")
            if name in TORCH_DTYPES and (name != "bool" or torch_has_dlpack_bool()):
                x = torch.from_dlpack(t)
                if str(x.dtype) != "torch." + name or not same(x, want):
                    bad.append(f"{name}: torch.from_dlpack read {x!r}")
            elif name not in TORCH_DTYPES:
                # this torch has no such dtype: it refuses, and numpy reads it
                with pytest.raises((RuntimeError, BufferError, TypeError)):
                    torch.from_dlpack(t)
    assert not bad, "\n".join(bad)


# ---- shapes: 0-d, empty, 32 dimensions, size-1 dimensions with any stride -------------------

SHAPES = r"""
import numpy as np, torch
from numpy.lib.stride_tricks import as_strided

def numpy_shapes():
    deep = np.moveaxis(np.arange(24, dtype=np.int32).reshape((1,) * 29 + (2, 3, 4)), -1, 0)
    base = np.arange(6.0)
    return {
        "0d": np.array(7, dtype=np.int16),
        "0d_c": np.array(1 - 2j, dtype=np.complex64),
        "empty": np.zeros((0,), dtype=np.float32),
        "empty_mid": np.zeros((3, 0, 2), dtype=np.int64),
        "empty_all": np.zeros((0, 0, 0), dtype=np.uint8),
        "deep": deep,
        # size-1 dimensions may carry any stride (numpy's own test): they are never stepped
        "ones": as_strided(base, shape=(1, 6, 1), strides=(12345 * 8, 8, 999 * 8)),
    }

def torch_shapes():
    deep = torch.arange(24, dtype=torch.int32).reshape((1,) * 29 + (2, 3, 4)).movedim(-1, 0)
    return {
        "0d": torch.tensor(7, dtype=torch.int16),
        "0d_c": torch.tensor(1 - 2j, dtype=torch.complex64),
        "empty": torch.zeros((0,), dtype=torch.float32),
        "empty_mid": torch.zeros((3, 0, 2), dtype=torch.int64),
        "empty_all": torch.zeros((0, 0, 0), dtype=torch.uint8),
        "deep": deep,
        "ones": torch.arange(6.0, dtype=torch.float64).as_strided((1, 6, 1), (12345, 1, 999)),
    }
"""
_ns = {}
exec(SHAPES, _ns)
numpy_shapes = _ns["numpy_shapes"]


def c_strides(shape, itemsize):
    out, acc = [], itemsize
    for n in reversed(shape):
        out.insert(0, acc)
        acc *= n
    return tuple(out)


@pytest.mark.parametrize("producer", ["numpy", "torch"])
def test_0d_empty_deep_and_size_one_dimensions(ipc, py, producer):
    fn = "numpy_shapes" if producer == "numpy" else "torch_shapes"
    py.check(SHAPES + f"""
import dlpack_ipc
assert {fn}()["deep"].ndim == 32
for k, v in {fn}().items():
    assert v.ndim <= dlpack_ipc.NDIM_MAX
    dlpack_ipc.publish("sh/" + k, v)
""")
    bad = []
    for k, want in numpy_shapes().items():
        t = ipc.attach("sh/" + k)
        a = np.from_dlpack(t)
        x = torch.from_dlpack(t)
        if t.shape != want.shape or a.shape != want.shape or tuple(x.shape) != want.shape:
            bad.append(f"{k}: shapes {t.shape} {a.shape} {tuple(x.shape)}, want {want.shape}")
        elif not np.array_equal(a, want) or not np.array_equal(x.numpy(), want):
            bad.append(f"{k}: read {a!r} / {x!r}, want {want!r}")
        elif want.size and a.strides != c_strides(want.shape, want.itemsize):
            bad.append(f"{k}: strides {a.strides}")
        mt = versioned(t.__dlpack__(max_version=(1, 0)))
        if mt.dl_tensor.ndim != want.ndim or (want.ndim and not mt.dl_tensor.strides):
            bad.append(f"{k}: capsule ndim {mt.dl_tensor.ndim}, strides filled: "
                       f"{bool(mt.dl_tensor.strides)}")
    assert ipc.attach("sh/deep").shape == (4,) + (1,) * 29 + (2, 3)
    assert not bad, "\n".join(bad)


# ---- strided and negative-stride inputs ----------------------------------------------------

STRIDED = r"""
import numpy as np, torch
from numpy.lib.stride_tricks import as_strided

def numpy_strided():
    a = np.arange(60, dtype=np.float64).reshape(6, 10)
    return {
        "reversed": np.arange(12, dtype=np.int32)[::-1],
        "reversed2d": a[::-2, 7::-3],
        "transposed": a.T,
        "transposed_reversed": a.T[::-1, 1::2],
        "zero_stride": as_strided(np.arange(3.0), shape=(4, 3), strides=(0, 8)),
        "overlap": as_strided(np.arange(10, dtype=np.int16), shape=(4, 4), strides=(4, 2)),
        "fortran": np.asfortranarray(a),
    }

def torch_strided():
    a = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    return {
        "step2d": a[1::2, ::3],
        "transposed": a.t(),
        "every_third": a[:, 1::3],
        "expanded": torch.arange(3, dtype=torch.int64).expand(4, 3),
        "channels_last": torch.arange(24.0).reshape(1, 2, 3, 4).contiguous(
            memory_format=torch.channels_last),
        "unfold": torch.arange(10, dtype=torch.int16).unfold(0, 4, 2),
        "offset_view": a[2:, 3:7],
    }
"""
_ns = {}
exec(STRIDED, _ns)
numpy_strided, torch_strided = _ns["numpy_strided"], _ns["torch_strided"]


@pytest.mark.parametrize("producer", ["numpy", "torch"])
def test_strided_and_negative_stride_inputs(ipc, py, producer):
    fn = "numpy_strided" if producer == "numpy" else "torch_strided"
    cp = py.check(STRIDED + f"""
import json, dlpack_ipc
out = {{}}
for k, v in {fn}().items():
    contiguous = v.flags["C_CONTIGUOUS"] if isinstance(v, np.ndarray) else v.is_contiguous()
    out[k] = [contiguous, dlpack_ipc.publish("st/" + k, v)]
dlpack_ipc.publish_dict("st", {fn}())
print(json.dumps(out))
""")
    made = json.loads(cp.stdout)
    assert not any(c for c, _ in made.values()), f"every input is strided: {made}"
    want_all = {k: (v if isinstance(v, np.ndarray) else v.numpy())
                for k, v in (numpy_strided() if producer == "numpy" else torch_strided()).items()}
    bundle = ipc.attach_dict("st")
    bad = []
    for k, want in want_all.items():
        for t in (ipc.attach("st/" + k), bundle[k]):
            a = np.from_dlpack(t)
            if a.shape != want.shape or not np.array_equal(a, want):
                bad.append(f"{k}: read {a!r}, want {want!r}")
            elif a.strides != c_strides(want.shape, want.itemsize):
                bad.append(f"{k}: strides {a.strides}, want C-contiguous")
    assert not bad, "\n".join(bad)


# ---- the arguments of __dlpack__, as consumers pass them ------------------------------------


@pytest.fixture
def entry(ipc, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("args/x", np.arange(12, dtype=np.float32).reshape(3, 4))
    """)
    return "args/x"


def test_max_version(ipc, entry):
    t = ipc.attach(entry)
    for mv in (None, (0, 8), (0, 99)):
        cap = t.__dlpack__(max_version=mv)
        assert capsule_name(cap) == "dltensor", mv
        assert legacy(cap).dl_tensor.data == t.data_ptr
    for mv in ((1, 0), (1, 3), (2, 0), (99, 1)):
        cap = t.__dlpack__(max_version=mv)
        assert capsule_name(cap) == "dltensor_versioned", mv
        mt = versioned(cap)
        assert (mt.version.major, mt.flags & READ_ONLY) == (1, READ_ONLY), mv
    for bad in ((1,), "1.0", (1, "0")):
        with pytest.raises(TypeError):
            t.__dlpack__(max_version=bad)


def test_dl_device(ipc, entry):
    t = ipc.attach(entry)
    assert t.__dlpack_device__() == (1, 0)
    assert capsule_name(t.__dlpack__(dl_device=(1, 0), max_version=(1, 0))) == \
        "dltensor_versioned"
    for dev in ((2, 0), (1, 1), (3, 0), (13, 0)):  # CUDA, another CPU, pinned, OneAPI
        with pytest.raises(BufferError):
            t.__dlpack__(dl_device=dev, max_version=(1, 0))
    with pytest.raises(TypeError):
        t.__dlpack__(dl_device="cpu")


def test_copy(ipc, entry):
    t = ipc.attach(entry)
    for copy in (None, False):
        mt = versioned(t.__dlpack__(max_version=(1, 0), copy=copy))
        assert mt.dl_tensor.data == t.data_ptr and not mt.flags & IS_COPIED, copy
    cap = t.__dlpack__(max_version=(1, 0), copy=True)
    mt = versioned(cap)
    assert mt.dl_tensor.data != t.data_ptr
    assert mt.flags & IS_COPIED and not mt.flags & READ_ONLY
    ctypes.memset(mt.dl_tensor.data, 0, 48)
    np.testing.assert_array_equal(np.from_dlpack(t), np.arange(12).reshape(3, 4))
    with pytest.raises(TypeError):
        t.__dlpack__(copy=1)
    # numpy 2 and torch 2 pass copy= and device= on: where they take them, the same holds
    try:
        a = np.from_dlpack(t, copy=True, device="cpu")
    except TypeError:  # numpy 1.x's from_dlpack has neither: the capsule calls above are it
        a = None
    if a is not None:
        assert a.flags.writeable and a.ctypes.data != t.data_ptr
        a[...] = -1
        np.testing.assert_array_equal(np.from_dlpack(t, copy=False), np.arange(12).reshape(3, 4))


def test_stream(ipc, entry):
    t = ipc.attach(entry)
    assert capsule_name(t.__dlpack__(stream=None)) == "dltensor"
    for s in (1, 2, -1, 0):  # a host tensor has no stream; numpy raises for these too
        with pytest.raises(BufferError):
            t.__dlpack__(stream=s)


def test_positional_arguments_refused(ipc, entry):
    t = ipc.attach(entry)
    with pytest.raises(TypeError):
        t.__dlpack__(None)
    with pytest.raises(TypeError):
        t.__dlpack__(None, (1, 0))


# ---- capsule renaming ----------------------------------------------------------------------


class Holder:
    """A producer that hands out a SharedTensor's capsules and keeps them to look at."""

    def __init__(self, t):
        self.t = t
        self.calls = []
        self.caps = []

    def __dlpack__(self, *args, **kw):
        self.calls.append((args, kw))
        cap = self.t.__dlpack__(*args, **kw)
        self.caps.append(cap)
        return cap

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_capsules_consumed_are_renamed(ipc, daemon, py, entry):
    t = ipc.attach(entry)
    # consumers rename what they take, whichever kind they asked for
    h = Holder(t)
    a = np.from_dlpack(h)
    x = torch.from_dlpack(h)
    assert [capsule_name(c) for c in h.caps] == [
        "used_dltensor_versioned" if "max_version" in kw and kw["max_version"] else
        "used_dltensor" for _, kw in h.calls]
    np.testing.assert_array_equal(a, np.arange(12).reshape(3, 4))
    assert torch.equal(x, torch.arange(12, dtype=torch.float32).reshape(3, 4))
    # publish is a consumer too: of our own capsules and of torch's
    v = t.__dlpack__(max_version=(1, 0))
    leg = torch.utils.dlpack.to_dlpack(torch.arange(5))
    assert ipc.publish("caps/v", v) == 1 and ipc.publish("caps/l", leg) == 1
    assert capsule_name(v) == "used_dltensor_versioned" and capsule_name(leg) == "used_dltensor"
    for used in (v, leg):
        with pytest.raises(BufferError, match="unused DLPack capsule"):
            ipc.publish("caps/again", used)
    cp = py.check("""
        import numpy as np, dlpack_ipc
        print(np.from_dlpack(dlpack_ipc.attach("caps/v")).sum(),
              np.from_dlpack(dlpack_ipc.attach("caps/l")).tolist())
    """)
    assert cp.stdout.split(None, 1) == ["66.0", "[0, 1, 2, 3, 4]\n"]
    # capsules nobody consumed free their tensor when they go
    unused = [t.__dlpack__(), t.__dlpack__(max_version=(1, 0))]
    del a, x, h, t, v
    gc.collect()
    assert daemon.stat()["references"] == 1
    del unused
    daemon.wait_stat(lambda s: s["references"] == 0, what="every capsule's reference released")


# ---- a SharedTensor deleted while views live ------------------------------------------------


def test_deleting_the_shared_tensor_while_views_live(ipc, daemon, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("views/x", np.arange(20, dtype=np.float64).reshape(4, 5))
    """)
    want = np.arange(20, dtype=np.float64).reshape(4, 5)
    t = ipc.attach("views/x")
    views = {
        "from_dlpack": np.from_dlpack(t),
        "asarray": np.asarray(t),
        "memoryview": memoryview(t),
        "torch": torch.from_dlpack(t),
        "torch()": t.torch(),
        "slice": np.from_dlpack(t)[1::2, ::-1],
        "torch_t": torch.from_dlpack(t).t(),
    }
    cap = t.__dlpack__(max_version=(1, 0))
    del t
    gc.collect()
    st = daemon.stat()
    assert st["references"] == 1, "one attach, one reference, however many views"
    # the publisher replaces the name: the views keep the bytes they had
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("views/x", -np.ones((4, 5)), replace=True)
    """)

    def check(k, v):
        if k == "memoryview":
            v = np.asarray(v)
        elif isinstance(v, torch.Tensor):
            v = v.numpy()
        exp = want[1::2, ::-1] if k == "slice" else want.T if k == "torch_t" else want
        np.testing.assert_array_equal(v, exp, err_msg=k)

    for k in views:
        check(k, views[k])
    np.testing.assert_array_equal(np.from_dlpack(ipc.attach("views/x")), -1.0)
    ipc.publish("views/cap", cap)  # the capsule outlived its SharedTensor too
    # drop the views one by one: the reference lasts until the last one goes
    for k in list(views):
        check(k, views.pop(k))
        gc.collect()
        if views:
            assert daemon.stat()["references"] >= 1, f"released while {sorted(views)} live"
    daemon.wait_stat(lambda s: s["references"] == 0, what="the last view's release")
    cp = py.check("""
        import numpy as np, dlpack_ipc
        print(np.from_dlpack(dlpack_ipc.attach("views/cap")).sum())
    """)
    assert cp.stdout.split() == [str(float(want.sum()))]


# ---- DLPack 1.x calls: keyword-only, max_version, retry without it on TypeError -------------

PRODUCERS = r"""
import json, numpy as np, dlpack_ipc

class Producer:
    # records how it is asked; mode: "new" takes every keyword, "old" is from before DLPack
    # 1.0 (TypeError for max_version), "broken" raises TypeError always, "refuses" BufferError
    def __init__(self, mode):
        self.mode, self.calls = mode, []
        self.a = np.arange(6, dtype=np.int32) * 3

    def __dlpack__(self, *args, **kw):
        self.calls.append([list(args), sorted(kw.items())])
        if self.mode == "broken" or (self.mode == "old" and "max_version" in kw):
            raise TypeError("__dlpack__() got an unexpected keyword argument 'max_version'")
        if self.mode == "refuses":
            raise BufferError("cannot export this")
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)

out = {}
for mode in ("new", "old", "broken", "refuses"):
    p = Producer(mode)
    try:
        out[mode] = [dlpack_ipc.publish("kw/" + mode, p), p.calls]
    except (TypeError, BufferError) as e:
        out[mode] = [type(e).__name__, p.calls]
print(json.dumps(out))
"""


def test_producers_are_asked_keyword_only_and_retried_without_max_version(ipc, py):
    cp = py.check(PRODUCERS)
    out = json.loads(cp.stdout)
    asked = [[], [["max_version", [1, 0]]]]
    plain = [[], []]
    assert out["new"] == [1, [asked]], "one keyword-only call with max_version=(1, 0)"
    assert out["old"] == [1, [asked, plain]], "TypeError: asked again without max_version"
    assert out["broken"] == ["TypeError", [asked, plain]], "its error, after the one retry"
    assert out["refuses"] == ["BufferError", [asked]], "only TypeError is retried"
    for mode in ("new", "old"):
        np.testing.assert_array_equal(np.from_dlpack(ipc.attach("kw/" + mode)),
                                      np.arange(6) * 3)
    assert sorted(e.name for e in ipc.list("kw/")) == ["kw/new", "kw/old"]


def test_consumers_calls_are_taken_as_they_come(ipc, py, entry):
    """numpy and torch call SharedTensor.__dlpack__ their own way (numpy 2 keyword-only with
    max_version, dl_device and copy): taken the first time, so that nobody retries, and
    answered with the kind of capsule asked for."""
    for mode in ("read", "private"):
        t = ipc.attach(entry, mode=mode)
        h = Holder(t)
        a = np.from_dlpack(h)
        x = torch.from_dlpack(h)
        assert len(h.calls) == 2, f"one call each, no retry: {h.calls}"
        for (args, kw), cap in zip(h.calls, h.caps):
            assert args == (), "keyword-only"
            if kw.get("max_version") and kw["max_version"] >= (1, 0):
                assert capsule_name(cap) == "used_dltensor_versioned"
            else:
                assert capsule_name(cap) == "used_dltensor"
        (_, np_kw) = h.calls[0]
        if np_kw.get("max_version"):
            # a versioned capsule says read-only, and numpy 2 honours it
            assert a.flags.writeable == (mode == "private"), (mode, np_kw)
        np.testing.assert_array_equal(a, np.arange(12).reshape(3, 4))
        assert torch.equal(x, torch.arange(12, dtype=torch.float32).reshape(3, 4))
