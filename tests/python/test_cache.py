# SPDX-License-Identifier: Apache-2.0
"""libdlpc's cache of idle references, seen from Python: a re-attach of an unchanged entry asks
the daemon nothing, and a replace or unpublish by another client is seen by the very next
attach."""
import numpy as np
import pytest

pytestmark = pytest.mark.client_cache


def test_reattach_asks_the_daemon_once(ipc, daemon):
    ipc.publish("cache/x", np.arange(1024, dtype=np.float32))
    before = daemon.stat()["req_attach"]
    for mode in ("read", "private", "read", "private"):
        for _ in range(25):
            with ipc.attach("cache/x", mode=mode) as t:
                a = np.from_dlpack(t)
                np.testing.assert_array_equal(a, np.arange(1024, dtype=np.float32))
                del a
    assert daemon.stat()["req_attach"] == before + 1
    daemon.wait_stat(lambda s: s["references"] == 1 and s["cached_references"] == 1,
                     what="one reference, cached")
    [e] = ipc.list("cache/")
    assert (e.refs, e.cached_refs) == (1, 1)
    with ipc.attach("cache/x"):
        daemon.wait_stat(lambda s: s["cached_references"] == 0, what="in use: not cached")
        [e] = ipc.list("cache/")
        assert (e.refs, e.cached_refs) == (1, 0)


def test_replace_and_unpublish_seen_at_once(ipc, daemon):
    import dlpack_ipc

    other = dlpack_ipc.Client(daemon.socket)
    for i in range(50):
        other.publish("cache/y", np.full(256, i, dtype=np.int64), replace=True)
        for _ in range(2):
            with ipc.attach("cache/y") as t:
                assert int(np.from_dlpack(t)[0]) == i
    other.unpublish("cache/y")
    with pytest.raises(FileNotFoundError):
        ipc.attach("cache/y", timeout=0)
    assert daemon.stat()["invalidations"] > 0
    other.close()
