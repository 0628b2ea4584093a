# SPDX-License-Identifier: Apache-2.0
"""Bundles (publish_dict / attach_dict) and what LIST and STAT report about entries."""
import os
import re
import time

import numpy as np
import pytest
import torch

import dlpack_ipc

MODEL = """
import torch
def build(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(100)])
"""
_ns = {}
exec(MODEL, _ns)
build = _ns["build"]


def test_state_dict_bundle_between_processes(ipc, daemon, py):
    py.check(MODEL + """
import dlpack_ipc
sd = build(0).state_dict()
assert len(sd) == 200
print(dlpack_ipc.publish_dict("model/sd", sd))
""")
    ref = build(0)
    expected = ref.state_dict()

    s0 = daemon.stat()
    sd = ipc.attach_dict("model/sd")
    s1 = daemon.stat()
    assert s1["req_attach"] - s0["req_attach"] == 1, "attach_dict is one ATTACH request"
    assert s1["fds_sent"] - s0["fds_sent"] == 1, "attach_dict receives one storage fd"

    assert isinstance(sd, dict)
    assert list(sd) == list(expected), "keys, in the publisher's order"
    gens = {t.generation for t in sd.values()}
    assert gens == {1}
    for k, t in sd.items():
        assert t.name == "model/sd"
        assert t.key == k
        assert t.dtype == "float32"
        assert t.shape == tuple(expected[k].shape)
        assert t.readonly is True
    # one mapping: every tensor lies inside one storage, 256-byte aligned
    ptrs = sorted(t.data_ptr for t in sd.values())
    assert all(p % 256 == 0 for p in ptrs)
    assert ptrs[-1] - ptrs[0] < 200 * 512

    fresh = build(1)
    x = torch.randn(5, 8)
    assert not torch.equal(fresh(x), ref(x))
    fresh.load_state_dict({k: torch.from_dlpack(t) for k, t in sd.items()})
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k
    with torch.no_grad():
        assert torch.equal(fresh(x), ref(x))

    st = daemon.stat()
    assert st["entries"] == 1 and st["storages"] == 1
    assert st["references"] >= 1


def test_mixed_bundle_values_and_keys(ipc, py):
    py.check("""
        import numpy as np, torch, dlpack_ipc
        dlpack_ipc.publish_dict("mix", {
            "a": np.arange(10, dtype=np.int16),
            "b/c": torch.full((2, 3), 7.25, dtype=torch.float64),
            "": np.array(3, dtype=np.uint8),
            "strided": np.arange(36, dtype=np.float32).reshape(6, 6)[::2, 1::2],
            "bf": torch.ones(3, dtype=torch.bfloat16),
        })
    """)
    d = ipc.attach_dict("mix")
    assert sorted(d) == sorted(["a", "b/c", "", "strided", "bf"])
    assert [d[k].key for k in sorted(d)] == sorted(d)
    np.testing.assert_array_equal(np.from_dlpack(d["a"]), np.arange(10, dtype=np.int16))
    assert d["b/c"].dtype == "float64"
    np.testing.assert_array_equal(np.from_dlpack(d["b/c"]), np.full((2, 3), 7.25))
    assert d[""].shape == () and np.from_dlpack(d[""]) == 3
    np.testing.assert_array_equal(np.from_dlpack(d["strided"]),
                                  np.arange(36, dtype=np.float32).reshape(6, 6)[::2, 1::2])
    assert d["bf"].dtype == "bfloat16"
    assert torch.equal(torch.from_dlpack(d["bf"]), torch.ones(3, dtype=torch.bfloat16))
    # one storage for all of them
    [info] = ipc.list("mix")
    assert [(ti.key, ti.dtype, tuple(ti.shape)) for ti in info.tensors] == [
        ("a", "int16", (10,)), ("b/c", "float64", (2, 3)), ("", "uint8", ()),
        ("strided", "float32", (3, 3)), ("bf", "bfloat16", (3,))]


def test_bundle_mapping_lives_until_last_tensor(ipc, daemon, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish_dict("b", {"x": np.arange(5.0), "y": np.arange(7)})
    """)
    d = ipc.attach_dict("b")
    y = np.from_dlpack(d["y"])
    ipc.unpublish("b")
    del d
    # only y's array keeps the storage alive now
    st = daemon.wait_stat(lambda s: s["entries"] == 0, what="entries == 0")
    assert st["storages"] == 1
    np.testing.assert_array_equal(y, np.arange(7))
    del y
    daemon.wait_stat(lambda s: s["storages"] == 0 and s["references"] == 0
                     and s["bytes_held"] == 0, what="storage freed")


def test_attach_dict_of_single_tensor_and_missing(ipc, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("single", np.arange(4))
    """)
    d = ipc.attach_dict("single")
    assert list(d) == [""]
    np.testing.assert_array_equal(np.from_dlpack(d[""]), np.arange(4))
    with pytest.raises(FileNotFoundError, match="nothere"):
        ipc.attach_dict("nothere", timeout=0)
    with pytest.raises(TimeoutError, match="nothere"):
        ipc.attach_dict("nothere", timeout=0.1)


def test_list_reports_entries(ipc, daemon, py):
    before = time.time()
    cp = py.check("""
        import os, numpy as np, torch, dlpack_ipc
        dlpack_ipc.publish("ls/a", np.zeros((2, 3), dtype=np.float32))
        dlpack_ipc.publish_dict("ls/b", {"w": torch.zeros(4, dtype=torch.int64),
                                        "v": np.zeros(1, dtype=np.complex64)})
        dlpack_ipc.publish("other", np.zeros(1), writable=True)
        print(os.getpid())
    """)
    after = time.time()
    child = int(cp.stdout)
    t = ipc.attach("ls/a")
    entries = ipc.list("ls/")
    assert [e.name for e in entries] == ["ls/a", "ls/b"]
    assert [e.name for e in ipc.list()] == ["ls/a", "ls/b", "other"]
    assert ipc.list("nope") == []
    a, b = entries
    assert isinstance(a, dlpack_ipc.EntryInfo)
    assert a.generation == 1 and a.device == "cpu"
    assert a.tensors == [dlpack_ipc.TensorInfo("", "float32", a.tensors[0].shape)]
    assert tuple(a.tensors[0].shape) == (2, 3)
    assert a.nbytes >= 24 and b.nbytes >= 256 + 8
    assert a.refs == 1 and b.refs == 0
    assert a.owner == dlpack_ipc.Owner(os.getuid(), child)
    assert a.owner.uid == os.getuid() and a.owner.pid == child
    assert isinstance(a.created, float)
    assert before - 5 <= a.created <= after + 5
    assert a.flags == 0
    assert [(ti.key, ti.dtype, tuple(ti.shape)) for ti in b.tensors] == [
        ("w", "int64", (4,)), ("v", "complex64", (1,))]
    [other] = ipc.list("other")
    assert other.flags & 4, "DLPC_PUBLISH_WRITABLE is bit 2"
    del t


def test_stat_keys(ipc, daemon):
    st = ipc.stat()
    keys = {"daemon_pid", "uptime_ms", "connections", "entries", "storages", "bytes_held",
            "references", "waiters", "fds_open", "fds_sent", "req_hello", "req_publish",
            "req_attach", "req_release", "req_unpublish", "req_list", "req_stat",
            "protocol_errors"}
    assert isinstance(st, dict)
    assert keys <= set(st), f"missing {keys - set(st)}"
    assert all(isinstance(st[k], int) for k in keys)
    assert st["daemon_pid"] == daemon.pid
    assert st["connections"] >= 1 and st["req_hello"] >= 1 and st["req_stat"] >= 1
    assert st["entries"] == 0 and st["protocol_errors"] == 0


def test_replace_makes_new_generation_old_stays_valid(ipc, daemon, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("gen", np.full(4, 1.0))
    """)
    old = ipc.attach("gen")
    old_arr = np.from_dlpack(old)
    cp = py.check("""
        import numpy as np, dlpack_ipc
        print(dlpack_ipc.publish("gen", np.full(4, 2.0), replace=True))
    """)
    assert cp.stdout.split() == ["2"]
    new = ipc.attach("gen")
    assert old.generation == 1 and new.generation == 2
    np.testing.assert_array_equal(old_arr, 1.0)
    np.testing.assert_array_equal(np.from_dlpack(new), 2.0)
    assert daemon.stat()["storages"] == 2
    del old, old_arr
    daemon.wait_stat(lambda s: s["storages"] == 1, what="old generation freed")
    assert [(e.name, e.generation) for e in ipc.list()] == [("gen", 2)]


def test_client_objects_and_context_manager(daemon):
    with dlpack_ipc.Client(socket=daemon.socket) as c1, dlpack_ipc.Client(daemon.socket) as c2:
        assert c1.publish("cl/x", np.arange(3)) == 1
        t = c2.attach("cl/x")
        np.testing.assert_array_equal(np.from_dlpack(t), np.arange(3))
        assert [e.name for e in c2.list("cl/")] == ["cl/x"]
        assert c1.stat()["entries"] == 1
        c1.unpublish("cl/x")
        with pytest.raises(FileNotFoundError):
            c2.attach("cl/x", timeout=0)
        t.release()
    daemon.wait_stat(lambda s: s["references"] == 0 and s["storages"] == 0,
                     what="everything released")
    # both connections are closed: only the STAT connection itself remains
    daemon.wait_stat(lambda s: s["connections"] == 1, what="connections == 1")
    assert daemon.stat()["protocol_errors"] == 0


def test_stat_doc_names_every_key(ipc):
    keys = set(ipc.stat())
    doc = dlpack_ipc.stat.__doc__
    assert keys and all(isinstance(v, int) for v in ipc.stat().values())
    assert [k for k in sorted(keys) if not re.search(rf"\b{k}\b", doc)] == []
