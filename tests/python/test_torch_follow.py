# SPDX-License-Identifier: Apache-2.0
"""dlpack_ipc.torch.follow(): a worker's module kept on the newest generation a trainer in
another process publishes with share_module(..., replace=True); swaps between forward passes,
never half old and half new, and old generations freed once swapped."""
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import dlpack_ipc
import dlpack_ipc.torch as dt
from conftest import _child_env

MODEL = """
import threading
import torch

class Net(torch.nn.Module):
    def __init__(self, device=None):
        super().__init__()
        self.a = torch.nn.Linear(8, 16, device=device)
        self.b = torch.nn.Linear(16, 4, device=device)
        self.register_buffer("scale", torch.ones(16, device=device), persistent=False)
        self.mid = None  # a hook between the two layers (the torn-state test)

    def forward(self, x):
        h = torch.relu(self.a(x)) * self.scale
        if self.mid is not None:
            self.mid()
        return self.b(h)

def build(seed, device=None):
    torch.manual_seed(seed)
    net = Net(device)
    if device != "meta":
        with torch.no_grad():
            net.scale.fill_(1.0 + seed)
    return net.eval()

X = torch.linspace(-1, 1, 24).reshape(3, 8)
"""
_ns = {}
exec(MODEL, _ns)
build, X = _ns["build"], _ns["X"]

TRAINER = MODEL + """
import sys
import dlpack_ipc, dlpack_ipc.torch as dt
for line in sys.stdin:
    cmd, *arg = line.split()
    if cmd == "publish":      # a new generation, copied
        print(dt.share_module(build(int(arg[0])), "policy", replace=True), flush=True)
    elif cmd == "bucket":     # a new generation from dlpackd memory: no copy
        net = dt.to_shared(build(int(arg[0])))
        print(dt.share_module(net, "policy", replace=True), flush=True)
        del net
    elif cmd == "unpublish":
        dlpack_ipc.unpublish("policy")
        print("gone", flush=True)
"""


class Trainer:
    """Another interpreter that publishes generations of "policy" when told."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TRAINER)],
                                     env=_child_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __call__(self, *cmd):
        self.proc.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.stdin.close()
            pytest.fail(f"trainer died: {self.proc.wait(10)} {self.proc.stderr.read()}")
        return line.strip()

    def close(self):
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0, self.proc.stderr.read()


@pytest.fixture
def trainer(daemon):
    t = Trainer()
    yield t
    t.close()


def mapping_of(ptr):
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return None


def expected(seed):
    with torch.no_grad():
        return build(seed)(X)


def run(net):
    with torch.no_grad():
        return net(X)


def test_follow_swaps_to_each_new_generation_and_frees_the_old(ipc, daemon, trainer):
    assert trainer("publish", 1) == "1"
    net = build(99, device="meta")
    f = dt.follow(net, "policy", timeout=30)
    assert f.generation == 1 and f.module is net
    assert not any(t.is_meta for t in [*net.parameters(), *net.buffers()])
    assert torch.equal(run(net), expected(1))
    assert f.update() is False, "nothing newer"
    assert f.update(timeout=0.05) is False, "nothing newer within the timeout"
    assert trainer("publish", 2) == "2"
    assert f.update(timeout=30) and f.generation == 2
    assert torch.equal(run(net), expected(2)), "every parameter and buffer of generation 2"
    assert f.update() is False
    # generation 1 is nobody's: freed (the trainer copied it, the follower swapped)
    [e] = ipc.list("policy")
    daemon.wait_stat(lambda s: s["storages"] == 1 and s["bytes_held"] == e.nbytes,
                     what="generation 1 freed")
    # a generation from dlpackd memory (to_shared): published as it is, no copy
    assert trainer("bucket", 3) == "3"
    assert f.update(timeout=30) and f.generation == 3
    assert torch.equal(run(net), expected(3))
    assert mapping_of(net.a.weight.data_ptr()).startswith("/memfd:dlpc:dlpc_alloc_bundle"), \
        "the trainer's bucket itself"
    daemon.wait_stat(lambda s: s["storages"] == 1, what="generation 2 freed")
    # a tensor the user still holds keeps its generation; freed with it
    held = net.b.bias
    assert trainer("publish", 4) == "4"
    assert f.update(timeout=30) and torch.equal(run(net), expected(4))
    assert torch.equal(held, build(3).b.bias)
    daemon.wait_stat(lambda s: s["storages"] == 2, what="generation 3 held by one tensor")
    del held
    daemon.wait_stat(lambda s: s["storages"] == 1, what="generation 3 freed")
    # unpublished: nothing to swap to, the module keeps what it has; published anew (its
    # generation starts over at 1): swapped to
    assert trainer("unpublish") == "gone"
    assert f.update(timeout=0.2) is False and torch.equal(run(net), expected(4))
    assert trainer("publish", 5) == "1"
    assert f.update(timeout=30) and f.generation == 1 and torch.equal(run(net), expected(5))
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.update()
    assert torch.equal(run(net), expected(5)), "a closed follower's module keeps its weights"


def test_with_follower_never_sees_half_of_two_generations(ipc, trainer):
    """A forward pass inside `with follower:` while the trainer replaces the weights and
    another thread calls update(): all of it on generation 1; the update waits for the block
    and swaps after."""
    assert trainer("publish", 1) == "1"
    net = build(0, device="meta")
    f = dt.follow(net, "policy", timeout=30)
    reached, go = threading.Event(), threading.Event()
    net.mid = lambda: (reached.set(), go.wait(30))
    result = {}

    def forward():
        with f:
            result["out"] = run(net)

    def update():
        result["swapped"] = f.update()

    a = threading.Thread(target=forward)
    a.start()
    assert reached.wait(30), "the forward pass reached its middle"
    assert trainer("publish", 2) == "2"  # replaced while the forward pass runs
    deadline = time.monotonic() + 20
    while not f._newer():  # the follower has seen generation 2's event
        assert time.monotonic() < deadline, "no event of generation 2"
        time.sleep(0.01)
    b = threading.Thread(target=update)
    b.start()
    time.sleep(0.2)
    assert "swapped" not in result, "update() waits for the forward pass inside `with`"
    go.set()
    a.join(30)
    b.join(30)
    net.mid = None
    assert torch.equal(result["out"], expected(1)), "the whole pass on generation 1"
    assert result["swapped"] is True and f.generation == 2
    assert torch.equal(run(net), expected(2))
    # entering swaps to the newest generation when nobody else is inside
    assert trainer("publish", 3) == "3"
    deadline = time.monotonic() + 20
    while f.generation != 3:
        assert time.monotonic() < deadline, "no event of generation 3"
        with f:
            out = run(net)
        time.sleep(0.01)
    assert torch.equal(out, expected(3))
    with f:
        with pytest.raises(RuntimeError, match="inside `with`"):
            f.update()
    f.close()


def test_a_generation_that_does_not_fit_is_refused(ipc, daemon):
    ipc.publish_dict("p", {k: v for k, v in build(1).state_dict().items()})
    net = build(0)
    f = dt.follow(net, "p", timeout=5)
    weight = net.a.weight
    ipc.publish_dict("p", {"a.weight": torch.zeros(2, 2)}, replace=True)
    deadline = time.monotonic() + 20
    with pytest.raises(KeyError, match="missing keys"):
        while time.monotonic() < deadline:
            f.update()
            time.sleep(0.01)
    assert net.a.weight is weight and f.generation == 1, "it keeps the generation it has"
    f.close()
    with pytest.raises(FileNotFoundError):
        dt.follow(build(0, device="meta"), "absent", timeout=0)


def test_a_follower_waiting_for_the_first_generation(ipc, py):
    """follow(timeout=...) waits for a name not published yet; the event of the generation it
    then attached is no newer generation."""
    got = {}

    def follow():
        got["f"] = dt.follow(build(0, device="meta"), "late", timeout=60)

    t = threading.Thread(target=follow)
    t.start()
    deadline = time.monotonic() + 30
    while not ipc.stat()["waiters"]:  # the follower's attach waits for the name
        assert time.monotonic() < deadline, "no attach waiting"
        time.sleep(0.01)
    py.check(MODEL + """
import dlpack_ipc.torch as dt
dt.share_module(build(1), "late")
""")
    t.join(60)
    f = got["f"]
    assert f.generation == 1 and torch.equal(run(f.module), expected(1))
    assert f.update(timeout=0.2) is False, "generation 1's own event is not a newer one"
    f.close()
