# SPDX-License-Identifier: Apache-2.0
"""The kind dlpack_ipc.channel() picks by default (docs/channels.md, "Which kind"): a new channel
is direct where that kind can serve, queued (with Channel.fallback saying why) where it cannot;
an existing channel opens as the kind it is; what a direct channel cannot do is refused naming
the way out (direct=False). Across processes, against a real dlpackd."""
import ast
import errno
import multiprocessing
import traceback

import numpy as np
import pytest
import torch

import dlpack_ipc


def _producer(name, n, q):
    try:
        with dlpack_ipc.channel(name) as ch:
            kind = (ch.direct, ch.fallback)
            for i in range(n):
                ch.send(np.full(16, i, np.int64))
        q.put(("ok", kind))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def test_default_is_direct_across_processes(ipc, daemon):
    """Created with plain arguments: direct; a producer in another process opens it as it is,
    and the consumer's loop gets every message in order, then the end; nothing through
    dlpackd."""
    ch = dlpack_ipc.channel("def/plain")
    assert ch.direct and ch.fallback is None
    assert "direct=True" in repr(ch)
    assert ch.capacity >= dlpack_ipc.CHANNEL_CAPACITY_DEFAULT
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_producer, args=("def/plain", 40, q))
    p.start()
    try:
        got = [int(np.from_dlpack(t)[5]) for t in ch]
        res = q.get(timeout=60)
    finally:
        p.join(timeout=60)
    assert res == ("ok", (True, None)), res
    assert got == list(range(40))
    info = ch.stat()
    assert info.direct and info.ended and info.producers_closed == 1
    assert daemon.stat()["req_send"] == 0  # the messages never passed through the daemon
    ch.remove()


def _open_elsewhere(py, name):
    """(direct, fallback, capacity) of the channel name as channel(name) opens it in another
    process."""
    cp = py.check(f"""
        import dlpack_ipc
        ch = dlpack_ipc.channel({name!r})
        print(repr((ch.direct, ch.fallback, ch.capacity)))
    """)
    return ast.literal_eval(cp.stdout.strip())


def test_default_falls_back_for_a_capacity_a_direct_channel_cannot_queue(ipc, daemon, py):
    """A capacity beyond what the kernel lets a direct channel queue here (net.core.wmem_max)
    makes a queued channel with that capacity, and says why; one the direct kind holds stays
    direct. Another process opens each as it is."""
    top = dlpack_ipc.CHANNEL_CAPACITY_MAX
    probe = dlpack_ipc.channel("def/probe", top, direct=True)
    held = dlpack_ipc.channel("def/held", probe.capacity)
    assert held.direct and held.fallback is None
    assert held.stat().fallback is None
    assert _open_elsewhere(py, "def/held")[:2] == (True, None)
    big = dlpack_ipc.channel("def/big", top)
    if probe.capacity < top:
        assert not big.direct and big.capacity == top
        assert "net.core.wmem_max" in big.fallback and "queued" in big.fallback
        assert "direct=False" in repr(big)
        assert _open_elsewhere(py, "def/big") == (False, big.fallback, top)
        info = big.stat()
        assert not info.direct and info.capacity == top
        # stat() and the list say why too, in this process and in another
        assert info.fallback == big.fallback
        assert [c.fallback for c in dlpack_ipc.channels("def/big")] == [big.fallback]
        cp = py.check("""
            import dlpack_ipc
            print(dlpack_ipc.channels("def/big")[0].fallback)
        """)
        assert cp.stdout.strip() == big.fallback
    else:  # this kernel lets a direct channel queue the most a channel may: it serves
        assert big.direct and big.fallback is None
    for ch in (probe, held, big):
        ch.remove()


def test_an_existing_channel_opens_as_the_kind_it_is(ipc, daemon, py):
    """A queued channel (made with direct=False, or by a C program's dlpc_channel_open()) stays
    queued when the default opens it, in this process and in another; a direct one direct."""
    ipc.channel("def/q", 4, direct=False)
    ch = dlpack_ipc.channel("def/q")
    assert not ch.direct and ch.fallback is None
    assert ch.stat().fallback is None  # queued as asked: no fallback
    assert _open_elsewhere(py, "def/q") == (False, None, 4)
    ipc.channel("def/d", direct=True)
    assert dlpack_ipc.channel("def/d").direct
    assert _open_elsewhere(py, "def/d")[:2] == (True, None)
    for name in ("def/q", "def/d"):
        ipc.channel(name).remove()


def test_what_a_default_channel_cannot_do_names_the_way_out(ipc, daemon):
    """Recycled buffers (empty()) and a bundle of many tensors need the queued kind: on a
    default (direct) channel they are refused naming direct=False, and with direct=False they
    work."""
    ch = dlpack_ipc.channel("def/refuse")
    assert ch.direct
    with pytest.raises(BufferError) as e:
        ch.empty((4,), "float32")
    assert "def/refuse" in str(e.value) and "direct=False" in str(e.value)
    many = {f"t{i:03d}": np.full(2, i) for i in range(128)}
    with pytest.raises(OSError) as e:
        ch.send_dict(many)
    assert e.value.errno == errno.EMSGSIZE
    assert "def/refuse" in str(e.value) and "direct=False" in str(e.value)
    ch.remove()
    q = dlpack_ipc.channel("def/queued", direct=False)
    buf = q.empty((4,), "float32")
    torch.from_dlpack(buf).fill_(1.5)
    q.send(buf)
    del buf
    q.send_dict(many)
    assert float(np.from_dlpack(q.recv())[3]) == 1.5
    d = q.recv()
    assert len(d) == 128 and int(np.from_dlpack(d["t127"])[0]) == 127
    del d
    q.remove()
