# SPDX-License-Identifier: Apache-2.0
"""dlpack_ipc.torch: a module's weights shared by one interpreter and attached by another
without a copy (issue #16, section 3), on a model with buffers, tied weights, a submodule
reached twice, a bool buffer and a non-persistent one."""
import json

import pytest
import torch

import dlpack_ipc
import dlpack_ipc.torch as dt

MODEL = """
import torch

class Net(torch.nn.Module):
    def __init__(self, device=None, width=16):
        super().__init__()
        self.emb = torch.nn.Embedding(50, width, device=device)
        self.block = torch.nn.Sequential(torch.nn.Linear(width, 32, device=device),
                                         torch.nn.ReLU(),
                                         torch.nn.Linear(32, width, device=device))
        self.norm = torch.nn.BatchNorm1d(width, device=device)
        self.head = torch.nn.Linear(width, 50, bias=False, device=device)
        self.head.weight = self.emb.weight             # tied: one parameter, two keys
        self.again = self.block                        # one submodule under two names
        self.register_buffer("mask", torch.arange(width, device=device) % 3 != 0)
        self.register_buffer("scratch", torch.full((4,), 5.0, device=device), persistent=False)

    def forward(self, ids):
        x = self.again(self.block(self.emb(ids))).flatten(0, 1)
        return self.head(self.norm(x) * self.mask).unflatten(0, ids.shape)

def build(seed, device=None):
    torch.manual_seed(seed)
    net = Net(device)
    if device != "meta":
        with torch.no_grad():
            net.norm.running_mean.uniform_(-1, 1)
            net.norm.running_var.uniform_(0.5, 2)
            net.norm.num_batches_tracked.fill_(7)
    return net.eval()

IDS = torch.tensor([[1, 4, 9, 16], [25, 36, 49, 0]])
"""
_ns = {}
exec(MODEL, _ns)
build, IDS = _ns["build"], _ns["IDS"]

SHARE = MODEL + """
import dlpack_ipc, dlpack_ipc.torch as dt
print(dt.share_module(build(0), "net"))
"""


def mapping_of(ptr):
    """The file /proc/self/maps names for the mapping holding address ptr."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return None


def state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_attach_module_on_meta_is_zero_copy(ipc, py, daemon):
    assert py.check(SHARE).stdout.split() == ["1"]
    net = build(99, device="meta")
    assert all(p.is_meta for p in net.parameters())
    assert dt.attach_module(net, "net") == dt.IncompatibleKeys([], [])
    ref = build(0)
    for k, v in ref.state_dict().items():
        got = net.state_dict()[k]
        assert got.dtype == v.dtype and torch.equal(got, v), k
    with torch.no_grad():
        assert torch.equal(net(IDS), ref(IDS))
    # every parameter and persistent buffer views the published memory: nothing was copied
    for k, v in net.state_dict().items():
        assert mapping_of(v.data_ptr()).startswith("/memfd:dlpc:net"), (k, mapping_of(v.data_ptr()))
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad
               for p in net.parameters())
    assert net.head.weight is net.emb.weight, "the tie is one parameter again"
    assert net.again is net.block
    assert net.mask.dtype == torch.bool
    # the non-persistent buffer (not in a state dict) came from the bundle too: none on meta
    assert torch.equal(net.scratch, torch.full((4,), 5.0))
    assert mapping_of(net.scratch.data_ptr()).startswith("/memfd:dlpc:net")
    assert not any(t.is_meta for t in [*net.parameters(), *net.buffers()])
    # the bundle held each tied tensor once, with the other keys as aliases
    bundle = ipc.attach_dict("net")
    aliases = json.loads(bytes(memoryview(bundle.pop(dt.ALIASES_KEY))))["aliases"]
    assert aliases == {"head.weight": "emb.weight", "again.0.weight": "block.0.weight",
                       "again.0.bias": "block.0.bias", "again.2.weight": "block.2.weight",
                       "again.2.bias": "block.2.bias"}
    assert sorted(bundle) == sorted([k for k in ref.state_dict() if k not in aliases] +
                                    [dt.NONPERSISTENT_PREFIX + "scratch"])
    del bundle
    # one attach: one reference, however many parameters
    daemon.wait_stat(lambda s: s["references"] == 1, what="the module's one reference")
    del net, got, v  # the module, and the last of its tensors the loops above held
    daemon.wait_stat(lambda s: s["references"] == 0, what="the module's tensors released")


def test_attach_module_replaces_allocated_weights_and_trains_privately(ipc, py):
    py.check(SHARE)
    net = build(5)
    assert not torch.equal(net.emb.weight, build(0).emb.weight)
    assert dt.attach_module(net, "net", requires_grad=True) == dt.IncompatibleKeys([], [])
    assert all(p.requires_grad for p in net.parameters())
    assert not net.norm.running_mean.requires_grad
    before = state(net)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    net(IDS).square().mean().backward()
    opt.step()
    assert not torch.equal(net.block[0].weight, before["block.0.weight"]), "the step wrote"
    assert net.head.weight is net.emb.weight
    # the step wrote into pages of this process only: another process reads the published bytes
    cp = py.check(MODEL + """
import dlpack_ipc, dlpack_ipc.torch as dt
net = build(7, device="meta")
dt.attach_module(net, "net")
ref = build(0)
print(all(torch.equal(v, ref.state_dict()[k]) for k, v in net.state_dict().items()))
""")
    assert cp.stdout.split() == ["True"]


def test_requires_grad_leaves_integer_parameters_without(ipc):
    """requires_grad=True on a module with an integer parameter (which cannot require
    gradients): the floating-point ones require them, the integer one does not, and every
    parameter is bound (before: RuntimeError with part of the module already bound)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.idx = torch.nn.Parameter(torch.arange(3), requires_grad=False)
            self.z = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    src = Net()
    with torch.no_grad():
        src.w.mul_(2)
    dt.share_module(src, "intparam")
    net = Net()
    assert dt.attach_module(net, "intparam", requires_grad=True) == dt.IncompatibleKeys([], [])
    assert (net.w.requires_grad, net.idx.requires_grad, net.z.requires_grad) == \
        (True, False, True)
    assert net.w.tolist() == [2.0, 2.0, 2.0] and net.idx.tolist() == [0, 1, 2]
    with dt.follow(Net(), "intparam", requires_grad=True) as f:
        assert not f.module.idx.requires_grad and f.module.w.requires_grad


def test_plain_state_dict_bundles_attach_too(ipc, py):
    """A bundle from publish_dict(model.state_dict()) (tied tensors published twice, no
    non-persistent buffers) attaches to a module built as usual, which keeps its own
    non-persistent buffer; what the module ties stays tied. Built on meta, the module would
    keep that buffer on meta: refused, naming it, before anything is replaced."""
    py.check(MODEL + """
import dlpack_ipc
dlpack_ipc.publish_dict("sd", build(0).state_dict())
""")
    net = build(1)
    own = net.scratch
    assert dt.attach_module(net, "sd") == dt.IncompatibleKeys([], [])
    assert net.head.weight is net.emb.weight
    assert net.scratch is own
    with torch.no_grad():
        assert torch.equal(net(IDS), build(0)(IDS))
    meta = build(1, device="meta")
    weight = meta.emb.weight
    with pytest.raises(ValueError, match=r"cannot attach 'sd' to Net: scratch \(non-persistent "
                                         r"buffer\) would stay on device 'meta'"):
        dt.attach_module(meta, "sd")
    assert meta.emb.weight is weight, "a refused attach replaces nothing"
    # strict=False does not let a meta tensor through either
    with pytest.raises(ValueError, match="would stay on device 'meta'"):
        dt.attach_module(meta, "sd", strict=False)
    extra = build(1, device="meta")
    extra.extra = torch.nn.Linear(2, 2, device="meta")
    py.check(SHARE.replace('"net"', '"full"'))
    with pytest.raises(ValueError, match=r"extra.weight, extra.bias would stay on device"):
        dt.attach_module(extra, "full", strict=False)


def test_keys_shapes_and_dtypes_must_match(ipc, py):
    py.check(SHARE)
    wider = _ns["Net"](device="meta", width=8)
    with pytest.raises(ValueError, match=r"emb.weight: \(50, 8\) torch.float32 in the module, "
                                         r"\(50, 16\) torch.float32 in 'net'"):
        dt.attach_module(wider, "net")
    half = build(3).half()
    with pytest.raises(ValueError, match="torch.float16 in the module"):
        dt.attach_module(half, "net")
    extra = build(3)
    extra.extra = torch.nn.Linear(2, 2)
    own = extra.emb.weight
    with pytest.raises(KeyError, match=r"missing keys \['extra.weight', 'extra.bias'\]"):
        dt.attach_module(extra, "net")
    assert extra.emb.weight is own, "a refused attach replaces nothing"
    got = dt.attach_module(extra, "net", strict=False)
    assert got == dt.IncompatibleKeys(["extra.weight", "extra.bias"], [])
    assert torch.equal(extra.emb.weight, build(0).emb.weight)
    smaller = build(3)
    del smaller.norm
    smaller.norm = torch.nn.Identity()
    got = dt.attach_module(smaller, "net", strict=False)
    assert got.missing_keys == [] and got.unexpected_keys == [
        "norm.bias", "norm.num_batches_tracked", "norm.running_mean", "norm.running_var",
        "norm.weight"]


def test_share_module_refuses_what_it_cannot_share(ipc):
    with pytest.raises(ValueError, match="device 'meta'"):
        dt.share_module(build(0, device="meta"), "x")

    class Extra(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def get_extra_state(self):
            return {"step": 3}

        def set_extra_state(self, state):
            pass

    with pytest.raises(TypeError, match="'_extra_state'"):
        dt.share_module(Extra(), "x")
    assert ipc.list() == []


def test_to_shared_publishes_a_tied_module_without_a_copy(ipc, py):
    """to_shared() moves a module with ties, a submodule under two names and a non-persistent
    buffer into one dlpackd allocation (the aliases record in it too): share_module() then
    publishes that allocation as it is, and another process attaches it."""
    net = build(0)
    params = list(net.parameters())
    ref = build(0)
    assert dt.to_shared(net) is net
    assert list(net.parameters()) == params, "the same Parameter objects (an optimizer's)"
    assert net.head.weight is net.emb.weight
    maps = {mapping_of(t.data_ptr()) for t in [*net.parameters(), *net.buffers()]}
    assert maps == {"/memfd:dlpc:dlpc_alloc_bundle (deleted)"}, maps
    with torch.no_grad():
        assert torch.equal(net(IDS), ref(IDS))
    assert dt.share_module(net, "bucket") == 1
    cp = py.check(MODEL + """
import dlpack_ipc.torch as dt
net = build(7, device="meta")
dt.attach_module(net, "bucket")
with open("/proc/self/maps") as f:
    print(sorted({l.split(None, 5)[5].strip() for l in f if "memfd:dlpc" in l}))
with torch.no_grad():
    print(torch.equal(net(IDS), build(0)(IDS)), net.head.weight is net.emb.weight)
""")
    assert cp.stdout.split("\n")[:2] == ["['/memfd:dlpc:dlpc_alloc_bundle (deleted)']",
                                         "True True"], cp.stdout
