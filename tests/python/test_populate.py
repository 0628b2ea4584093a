# SPDX-License-Identifier: Apache-2.0
"""attach(populate=True), attach_dict(populate=True), attach_module() and follow(), which
populate by default: a 64 MiB entry published by this process and attached by another interpreter is read
whole there with (nearly) no minor page faults; without populate the same read takes one per
64 KiB (one per 2 MiB at least, with shmem huge pages). Faults are counted with getrusage()
around the read alone."""
import json

import numpy as np
import pytest

ENTRY_BYTES = 64 << 20
# a read of a populated mapping takes none; a few allow for the interpreter's own allocations
POPULATED_FAULTS_MAX = 16
# one per 2 MiB even with shmem huge pages (1,024 with 4 KiB pages and 64 KiB fault-around)
UNPOPULATED_FAULTS_MIN = ENTRY_BYTES // (2 << 20)

# The reader: ATTACH is an expression giving a dict of arrays-to-be (SharedTensor or torch
# tensors) by key; prints the faults of reading them all, and their sum.
READER = """
import json, resource, sys
import numpy as np
import dlpack_ipc
{setup}
got = {attach}
arrays = [np.from_dlpack(v) if not hasattr(v, "numpy") else v.detach().numpy()
          for v in got.values()]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
total = 0
for a in arrays:
    total += int(np.add.reduce(a.reshape(-1).view(np.uint64), dtype=np.uint64))
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({{"faults": faults, "sum": total}}))
"""

WORDS = ENTRY_BYTES // 8
WORDS_SUM = WORDS * (WORDS - 1) // 2 % (1 << 64)


def read_in_child(py, attach, setup=""):
    out = py.check(READER.format(attach=attach, setup=setup)).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["sum"] == WORDS_SUM, "the reader saw other bytes than were published"
    return got["faults"]


def assert_fits(faults, populate, what):
    if populate:
        assert faults <= POPULATED_FAULTS_MAX, f"{what}: {faults} faults reading a populated mapping"
    else:
        assert faults >= UNPOPULATED_FAULTS_MIN, f"{what}: only {faults} faults without populate"


@pytest.mark.parametrize("mode", ["read", "private", "strict", "write"])
@pytest.mark.parametrize("populate", [True, False])
def test_attach_populate(ipc, py, mode, populate):
    ipc.publish("w", np.arange(WORDS, dtype=np.uint64), writable=True)
    faults = read_in_child(
        py, f'{{"": dlpack_ipc.attach("w", mode="{mode}", populate={populate})}}')
    assert_fits(faults, populate, f"attach mode={mode}")


@pytest.mark.parametrize("populate", [True, False])
def test_attach_dict_populate(ipc, py, populate):
    w = np.arange(WORDS, dtype=np.uint64)
    ipc.publish_dict("d", {"a": w[:WORDS // 2], "b": w[WORDS // 2:]})
    faults = read_in_child(py, f'dlpack_ipc.attach_dict("d", populate={populate})')
    assert_fits(faults, populate, "attach_dict")


MODULE = """
import torch
import dlpack_ipc.torch as dt
net = torch.nn.Linear({n}, {n}, bias=False, device="meta")
"""


@pytest.mark.parametrize("populate", [None, False])
def test_attach_module_populates_by_default(ipc, py, populate):
    import torch
    import dlpack_ipc.torch as dt

    n = 4096  # a 4096 x 4096 float32 weight: 64 MiB
    net = torch.nn.Linear(n, n, bias=False)
    with torch.no_grad():
        net.weight.view(torch.int64).copy_(torch.arange(WORDS, dtype=torch.int64).view(n, -1))
    dt.share_module(net, "net", client=ipc)
    kw = "" if populate is None else f", populate={populate}"
    faults = read_in_child(py, f'(dt.attach_module(net, "net"{kw}), dict(net.state_dict()))[1]',
                           setup=MODULE.format(n=n))
    assert_fits(faults, populate is None, f"attach_module(populate={populate})")


FOLLOW = MODULE + """
def follow(**kw):
    global follower  # kept: it holds the watch of the name
    follower = dt.follow(net, "net", **kw)
    return dict(net.state_dict())
"""


@pytest.mark.parametrize("populate", [None, False])
def test_follow_populates_by_default(ipc, py, populate):
    """follow() attaches as attach_module() does: populated unless populate=False."""
    import torch
    import dlpack_ipc.torch as dt

    n = 4096
    net = torch.nn.Linear(n, n, bias=False)
    with torch.no_grad():
        net.weight.view(torch.int64).copy_(torch.arange(WORDS, dtype=torch.int64).view(n, -1))
    dt.share_module(net, "net", client=ipc)
    kw = "" if populate is None else f"populate={populate}"
    faults = read_in_child(py, f"follow({kw})", setup=FOLLOW.format(n=n))
    assert_fits(faults, populate is None, f"follow(populate={populate})")
