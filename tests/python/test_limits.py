# SPDX-License-Identifier: Apache-2.0
"""Quotas seen from Python: EDQUOT is an OSError with errno EDQUOT and the limit in its message."""
import errno
import time

import numpy as np
import pytest

import dlpack_ipc


def _is_edquot(e, *words):
    assert type(e) is OSError, type(e)
    assert e.errno == errno.EDQUOT
    for w in words:
        assert w in str(e), str(e)


@pytest.mark.dlpackd_args("--max-entries-per-uid", "2")
def test_entries_quota(ipc, daemon):
    ipc.publish("q/a", np.zeros(4))
    ipc.publish("q/b", np.zeros(4))
    with pytest.raises(OSError) as ei:
        ipc.publish("q/c", np.zeros(4))
    _is_edquot(ei.value, "q/c", "the limit is 2", "--max-entries-per-uid")
    with pytest.raises(OSError) as ei:
        ipc.publish_dict("q/d", {"x": np.zeros(4)})
    _is_edquot(ei.value, "q/d")
    # a replace of one's own entry fits; an unpublish makes room
    ipc.publish("q/a", np.ones(4), replace=True)
    ipc.unpublish("q/b")
    ipc.publish("q/c", np.zeros(4))
    st = ipc.stat()
    assert st["uid_entries"] == 2
    assert st["entries"] == 2


@pytest.mark.dlpackd_args("--max-bytes-per-uid", "1K")
def test_bytes_quota(ipc):
    ipc.publish("small", np.zeros(128, dtype=np.uint8))
    with pytest.raises(OSError) as ei:
        ipc.publish("large", np.zeros(1024, dtype=np.uint8))
    _is_edquot(ei.value, "large", "1024 bytes", "--max-bytes-per-uid")
    assert ipc.stat()["uid_bytes_held"] == 128


@pytest.mark.dlpackd_args("--max-bytes-per-uid", "1K")
def test_pinned_bytes_count_for_the_holder(ipc):
    ipc.publish("p", np.zeros(128, dtype=np.uint8))
    held = ipc.attach("p")
    ipc.publish("p", np.zeros(128, dtype=np.uint8), replace=True)
    st = ipc.stat()
    # the old generation is no name's any more: charged as kept alive by this reference
    assert st["uid_bytes_held"] == 128 and st["uid_bytes_pinned"] == 128
    del held
    for _ in range(100):
        if ipc.stat()["uid_bytes_pinned"] == 0:
            break
        time.sleep(0.01)
    assert ipc.stat()["uid_bytes_pinned"] == 0 and ipc.stat()["uid_bytes_held"] == 128


@pytest.mark.dlpackd_args("--max-connections-per-uid", "1")
def test_connections_quota(daemon):
    c = dlpack_ipc.Client(socket=daemon.socket)
    try:
        with pytest.raises(OSError) as ei:
            dlpack_ipc.Client(socket=daemon.socket)
        _is_edquot(ei.value, "the limit is 1", "--max-connections-per-uid")
        assert c.stat()["uid_connections"] == 1
    finally:
        c.close()


@pytest.mark.dlpackd_args("--max-refs-per-connection", "1")
def test_refs_quota(ipc):
    ipc.publish("r", np.arange(4.0))
    held = ipc.attach("r")
    with pytest.raises(OSError) as ei:
        ipc.attach("r")
    _is_edquot(ei.value, "'r'", "--max-refs-per-connection")
    held.release()
    with ipc.attach("r") as t:
        np.testing.assert_array_equal(np.from_dlpack(t), np.arange(4.0))
