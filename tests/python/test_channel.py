# SPDX-License-Identifier: Apache-2.0
"""dlpack_ipc.channel: send/recv across interpreters, iteration, timeouts, bundles, removal."""
import errno
import multiprocessing
import os
import signal
import time
import traceback

import numpy as np
import pytest
import torch

import dlpack_ipc


def _sender(name, n, q):
    try:
        ch = dlpack_ipc.channel(name)
        for i in range(n):
            ch.send(torch.full((4, 8), float(i)))
        q.put(("ok", os.getpid()))
    except BaseException:
        q.put(("error", traceback.format_exc()))


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_send_recv_across_processes(ipc, daemon, method):
    ctx = multiprocessing.get_context(method)
    ch = dlpack_ipc.channel("py/ch", capacity=3, direct=False)
    assert ch.capacity == 3
    q = ctx.Queue()
    p = ctx.Process(target=_sender, args=("py/ch", 40, q))
    p.start()
    try:
        for i in range(40):
            t = ch.recv(timeout=30)
            assert t.shape == (4, 8) and t.dtype == "float32"
            x = torch.from_dlpack(t)
            assert float(x[3, 7]) == float(i)
            assert t.owner.pid == p.pid
            del x, t
        res = q.get(timeout=60)
        assert res[0] == "ok", res[1]
    finally:
        p.join(timeout=60)
    info = ch.stat()
    assert info.sent == 40 and info.received == 40 and info.depth == 0
    daemon.wait_stat(lambda s: s["storages"] == 0 and s["references"] == 0,
                     what="every message freed")
    ch.remove()


def test_timeouts_backpressure_and_bundles(ipc, daemon):
    ch = dlpack_ipc.channel("py/bp", capacity=1, direct=False)
    with pytest.raises(BlockingIOError) as e:
        ch.recv(timeout=0)
    assert "py/bp" in str(e.value)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        ch.recv(timeout=0.1)
    assert time.monotonic() - t0 >= 0.09
    ch.send(np.arange(5, dtype=np.int64))
    with pytest.raises(BlockingIOError):
        ch.send(np.arange(3), timeout=0)
    with pytest.raises(TimeoutError):
        ch.send(np.arange(3), timeout=0.05)
    assert ch.stat().depth == 1
    got = ch.recv()
    np.testing.assert_array_equal(np.from_dlpack(got), np.arange(5))
    with pytest.raises(ValueError):
        np.from_dlpack(got)[0] = 1  # read-only flag: numpy refuses
    ch.send_dict({"a": np.ones(3, np.float32), "b": torch.arange(4)})
    d = ch.recv()
    assert sorted(d) == ["a", "b"]
    assert torch.equal(torch.from_dlpack(d["b"]), torch.arange(4))
    ch.send(np.zeros(2))
    d = ch.recv_dict()
    assert list(d) == [""]
    names = [c.name for c in dlpack_ipc.channels("py/")]
    assert names == ["py/bp"]
    s = dlpack_ipc.stat()
    assert s["channels"] == 1 and s["req_send"] >= 3
    with pytest.raises(FileExistsError):
        dlpack_ipc.channel("py/bp", capacity=5)
    with pytest.raises(ValueError):
        dlpack_ipc.channel("py/big", capacity=dlpack_ipc.CHANNEL_CAPACITY_MAX + 1)


def _receiver(name, q):
    try:
        got = [int(np.from_dlpack(t)[0]) for t in dlpack_ipc.channel(name)]
        q.put(("ok", got))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def test_iteration_ends_when_removed(ipc, daemon):
    ctx = multiprocessing.get_context("fork")
    ch = dlpack_ipc.channel("py/it", direct=False)
    q = ctx.Queue()
    p = ctx.Process(target=_receiver, args=("py/it", q))
    p.start()
    for i in range(10):
        ch.send(np.array([i]))
    daemon.wait_stat(lambda s: s["messages"] == 0, what="every message received")
    deadline = time.monotonic() + 10
    while ch.stat().receivers_waiting != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    ch.remove()
    res = q.get(timeout=30)
    p.join(timeout=30)
    assert res == ("ok", list(range(10)))
    with pytest.raises(FileNotFoundError):
        ch.send(np.array([1]))
    with pytest.raises(OSError) as e:
        dlpack_ipc.Channel("py/it2")._client._recv("py/it3", timeout=0)
    assert e.value.errno == errno.ENOENT


def _holder(name, q):
    ch = dlpack_ipc.channel(name)
    held = [ch.recv(), ch.recv()]
    q.put(len(held))
    signal.pause()


def test_killed_receiver_frees_its_messages(ipc, daemon):
    ctx = multiprocessing.get_context("fork")
    ch = dlpack_ipc.channel("py/kill", direct=False)
    ch.send(np.ones(1 << 16))
    ch.send(np.ones(1 << 16))
    q = ctx.Queue()
    p = ctx.Process(target=_holder, args=("py/kill", q))
    p.start()
    assert q.get(timeout=30) == 2
    assert daemon.stat()["storages"] == 2
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=30)
    daemon.wait_stat(lambda s: s["storages"] == 0 and s["bytes_held"] == 0,
                     what="the killed receiver's messages freed")


@pytest.mark.parametrize("direct", [False, True], ids=["queued", "direct"])
def test_dataloader_example(ipc, daemon, direct):
    """examples/dataloader_channel.py at a small size, over queued channels and over direct
    ones: every batch equals torch DataLoader's."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, DLPACKD_SOCKET=daemon.socket)
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "dataloader_channel.py"),
                        "--batches", "6", "--workers", "2", "--batch-size", "4",
                        "--shape", "3,8,8", "--check"] + (["--direct"] if direct else []),
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every batch equals torch DataLoader's" in r.stdout
    assert ("direct channels" in r.stdout) == direct
    assert dlpack_ipc.channels() == []


def test_dlpackctl_channels(ipc, daemon):
    import json
    import subprocess
    ctl = os.environ.get("DLPACKCTL_BIN")
    if not ctl:
        pytest.fail("DLPACKCTL_BIN is not set", pytrace=False)
    ch = dlpack_ipc.channel("ctl/q", capacity=4, direct=False)
    ch.send(np.zeros(100, np.float64))

    def run(*args):
        return subprocess.run([ctl, "--socket", daemon.socket, *args], capture_output=True,
                              text=True, timeout=60)
    r = run("channels", "--json")
    assert r.returncode == 0, r.stderr
    (c,) = json.loads(r.stdout)
    assert (c["name"], c["capacity"], c["depth"], c["bytes_queued"]) == ("ctl/q", 4, 1, 800)
    assert c["owner_pid"] == os.getpid()
    r = run("channels", "ctl/")
    assert r.returncode == 0 and "ctl/q" in r.stdout and "1/4" in r.stdout
    assert "channels" in run("stat").stdout
    r = run("rmchan", "ctl/q")
    assert r.returncode == 0, r.stderr
    daemon.wait_stat(lambda s: s["storages"] == 0 and s["channels"] == 0,
                     what="the removed channel's message freed")
    r = run("rmchan", "ctl/q")
    assert r.returncode == 1 and "ctl/q" in r.stderr
    # a direct channel: the daemon counts its queue only
    dch = dlpack_ipc.channel("ctl/d", capacity=4, direct=True)
    dch.send(np.zeros(100, np.float64))
    r = run("channels", "--json")
    assert r.returncode == 0, r.stderr
    (c,) = json.loads(r.stdout)
    assert (c["name"], c["direct"], c["depth"], c["bytes_queued"], c["sent"]) == \
        ("ctl/d", True, 1, 0, 0)
    assert c["capacity"] == dch.capacity
    r = run("channels", "ctl/")
    assert r.returncode == 0 and "direct" in r.stdout and f"1/{dch.capacity}" in r.stdout
    assert run("rmchan", "ctl/d").returncode == 0


def test_pooled_empty_recycles(ipc, daemon):
    """Channel.empty(): after a receive and release the same pages come back, writable."""
    ch = dlpack_ipc.channel("py/pool", capacity=2, direct=False)
    rx = dlpack_ipc.Channel("py/pool", client=dlpack_ipc.Client(daemon.socket))
    first = None
    for i in range(4):
        buf = ch.empty((256,), "float32")
        x = torch.from_dlpack(buf)
        x.fill_(float(i))
        ptr = x.data_ptr()
        first = ptr if first is None else first
        assert ptr == first, "the buffer was not recycled"
        ch.send(buf)
        del buf, x
        got = rx.recv(timeout=10)
        assert float(torch.from_dlpack(got)[255]) == float(i)
        del got
        rx._client.stat()  # the release rides with this request
        daemon.wait_stat(lambda s: s["storages"] == 0, what="the pooled message freed")
    rx.remove()


def test_ctrl_c_ends_a_waiting_recv_and_send(ipc, daemon):
    """SIGINT raises KeyboardInterrupt in a recv() waiting on an empty channel and in a send()
    waiting for room; nothing is left queued or waiting."""
    from conftest import popen_py
    dlpack_ipc.channel("py/int", capacity=1, direct=False).send(np.zeros(1))
    dlpack_ipc.channel("py/int2", direct=False)
    for op in ("dlpack_ipc.channel('py/int2').recv()",
               "dlpack_ipc.channel('py/int').send(np.zeros(1))"):
        p = popen_py(f"""
            import sys, numpy as np, dlpack_ipc
            print("ready", flush=True)
            try:
                {op}
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                sys.exit(0)
            sys.exit(3)
        """)
        assert p.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        name = "py/int2" if "recv" in op else "py/int"
        while time.monotonic() < deadline:
            try:
                info = dlpack_ipc.Channel(name).stat()
            except FileNotFoundError:
                info = None
            if info and (info.receivers_waiting or info.senders_waiting):
                break
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=10)
        assert p.returncode == 0 and "interrupted" in out, out + err
    daemon.wait_stat(lambda s: s["messages"] == 1, what="only the first message queued")
    info = dlpack_ipc.Channel("py/int").stat()
    assert info.senders_waiting == 0 and info.receivers_waiting == 0


def test_ctrl_c_cancels_the_wait_in_the_daemon(ipc, daemon):
    """A wait interrupted by Ctrl-C leaves the daemon at once (CANCEL), while the interrupted
    process and its connection live on: an attach, a recv and a send, each waiting without end."""
    from conftest import popen_py
    dlpack_ipc.channel("py/cfull", capacity=1, direct=False).send(np.zeros(1))
    dlpack_ipc.channel("py/cempty", direct=False)
    ops = ("dlpack_ipc.attach('py/cnever', timeout=float('inf'))",
           "dlpack_ipc.channel('py/cempty').recv()",
           "dlpack_ipc.channel('py/cfull').send(np.zeros(1))")
    for op in ops:
        p = popen_py(f"""
            import time, numpy as np, dlpack_ipc
            print("ready", flush=True)
            try:
                {op}
            except KeyboardInterrupt:
                print("interrupted", flush=True)
            time.sleep(60)
        """)
        try:
            assert p.stdout.readline().strip() == "ready"

            def waiting(s):
                return (s["waiters"] + dlpack_ipc.Channel("py/cempty").stat().receivers_waiting
                        + dlpack_ipc.Channel("py/cfull").stat().senders_waiting) == 1
            daemon.wait_stat(waiting, what=f"one wait ({op})")
            os.kill(p.pid, signal.SIGINT)
            assert p.stdout.readline().strip() == "interrupted"
            # gone from the daemon while the process (and its connection) lives
            daemon.wait_stat(lambda s: not waiting(s) and s["connections"] >= 2,
                             what=f"the interrupted wait gone ({op})")
            assert p.poll() is None
        finally:
            p.kill()
            p.communicate(timeout=10)
    assert dlpack_ipc.Channel("py/cfull").stat().depth == 1


def _bad_key_sender(name, q):
    """In another process: every bad key refused by send_dict() as publish_dict() refuses it
    (and a mapping whose only key is '', which would come back as one tensor), then a bundle
    whose key is exactly KEY_MAX bytes sent, with a key '' beside it."""
    try:
        ch = dlpack_ipc.channel(name)
        out = []
        bad = [{"ok": np.zeros(2), key: np.ones(2)}
               for key in ("a\0b", "k" * (dlpack_ipc.KEY_MAX + 1), "é" * 128, 7)]
        for mapping in bad + [{"": np.ones(2)}]:
            got = []
            for call in (lambda m: dlpack_ipc.publish_dict("py/keys", m),
                         lambda m: ch.send_dict(m)):
                try:
                    call(mapping)
                    got.append(None)
                except (TypeError, ValueError) as e:
                    got.append((type(e).__name__, str(e)))
            out.append(got)
        ch.send_dict({"k" * dlpack_ipc.KEY_MAX: np.arange(3), "": np.ones(1)})
        q.put(("ok", out))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def test_send_dict_refuses_the_keys_publish_dict_refuses(ipc, daemon):
    """One key check for publish_dict() and send_dict(): a key with a NUL (which would reach
    libdlpc cut short), one over KEY_MAX bytes, one of 256 bytes in 128 characters, one that is
    not str, a mapping whose only key is '': the same exception, the same words but the verb,
    and nothing sent or published."""
    ch = dlpack_ipc.channel("py/keys", capacity=4, direct=False)
    q = multiprocessing.get_context("spawn").Queue()
    p = multiprocessing.get_context("spawn").Process(target=_bad_key_sender,
                                                     args=("py/keys", q))
    p.start()
    try:
        res = q.get(timeout=60)
    finally:
        p.join(timeout=60)
    assert res[0] == "ok", res[1]
    says = ["contains NUL", "is too long", "is too long", "keys must be str, not int (key 7)",
            "only key is '' would come back as one tensor, not a dict"]
    assert len(res[1]) == len(says)
    for (pub, snd), what in zip(res[1], says):
        assert pub is not None and snd is not None, (pub, snd)
        assert pub[0] == snd[0], (pub, snd)
        assert pub[1].startswith("cannot publish 'py/keys': "), pub
        assert snd[1] == pub[1].replace("cannot publish", "cannot send to channel", 1), (pub, snd)
        assert what in snd[1], snd
    assert ipc.list() == []
    d = ch.recv_dict(timeout=0)
    assert list(d) == ["k" * dlpack_ipc.KEY_MAX, ""]
    np.testing.assert_array_equal(np.from_dlpack(d["k" * dlpack_ipc.KEY_MAX]), np.arange(3))
    del d
    info = ch.stat()
    assert info.sent == 1 and info.depth == 0
    assert daemon.stat()["protocol_errors"] == 0
    ch.remove()


def _direct_sender(name, n, q):
    try:
        ch = dlpack_ipc.channel(name, direct=True)
        assert ch.direct
        for i in range(n):
            ch.send(torch.full((4, 8), float(i)) if i % 2 else np.full((4, 8), i, np.float32))
        ch.send_dict({"a": np.arange(5, dtype=np.int64), "b": torch.ones(3, dtype=torch.float64)})
        q.put(("ok", os.getpid()))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def test_direct_channel_across_processes(ipc, daemon):
    """A direct channel between two processes: numpy and torch in, torch.from_dlpack out, in
    order, owned by the sender; a bundle via send_dict/recv_dict; nothing through dlpackd."""
    ctx = multiprocessing.get_context("fork")
    ch = dlpack_ipc.channel("py/direct", capacity=4, direct=True)
    assert ch.direct and "direct=True" in repr(ch)
    assert 2 <= ch.capacity <= 4
    q = ctx.Queue()
    p = ctx.Process(target=_direct_sender, args=("py/direct", 30, q))
    p.start()
    try:
        for i in range(30):
            t = ch.recv(timeout=30)
            assert t.shape == (4, 8) and t.dtype == "float32"
            x = torch.from_dlpack(t)
            assert torch.equal(x, torch.full((4, 8), float(i)))
            assert t.owner.pid == p.pid and t.owner.uid == os.getuid()
            del x, t
        d = ch.recv_dict(timeout=30)
        assert list(d) == ["a", "b"]
        np.testing.assert_array_equal(np.from_dlpack(d["a"]), np.arange(5))
        assert torch.equal(torch.from_dlpack(d["b"]), torch.ones(3, dtype=torch.float64))
        del d
        res = q.get(timeout=60)
        assert res[0] == "ok", res[1]
    finally:
        p.join(timeout=60)
    info = ch.stat()
    assert info.direct and info.depth == 0 and info.sent == 0 and info.received == 0
    assert [c.direct for c in dlpack_ipc.channels("py/direct")] == [True]
    s = daemon.stat()
    assert s["storages"] == 0 and s["req_send"] == 0
    # its only producer exited: that was its close, and the stream has ended
    assert info.ended and info.producers == 0 and info.producers_closed == 1
    with pytest.raises(BrokenPipeError, match="py/direct"):
        ch.send(np.zeros(3))
    with pytest.raises(dlpack_ipc.ChannelClosed):
        ch.recv(timeout=0)
    assert not dlpack_ipc.channel("py/queued", direct=False).stat().direct
    with pytest.raises(FileExistsError, match="as a queued channel"):
        dlpack_ipc.channel("py/queued", direct=True)
    # opened by name, a channel is the kind it is; asked for the other kind, refused
    assert dlpack_ipc.channel("py/direct").direct
    with pytest.raises(FileExistsError, match="as a direct channel"):
        dlpack_ipc.channel("py/direct", direct=False)
    # no recycled buffers: ENOTSUP, which the module raises as BufferError throughout
    with pytest.raises(BufferError, match="it is direct"):
        ch.empty((4,), "float32")
    ch.remove()


def _direct_receiver(name, q):
    try:
        got = [int(np.from_dlpack(t)[0]) for t in dlpack_ipc.channel(name, direct=True)]
        q.put(("ok", got))
    except BaseException:
        q.put(("error", traceback.format_exc()))


def test_direct_iteration_ends_when_removed(ipc, daemon):
    ctx = multiprocessing.get_context("fork")
    ch = dlpack_ipc.channel("py/dit", direct=True)
    q = ctx.Queue()
    p = ctx.Process(target=_direct_receiver, args=("py/dit", q))
    p.start()
    for i in range(10):
        ch.send(np.array([i]))
    deadline = time.monotonic() + 10
    while ch.stat().depth and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the receiver back in its wait (either way iteration must end)
    ch.remove()
    res = q.get(timeout=30)
    p.join(timeout=30)
    assert res == ("ok", list(range(10)))
    with pytest.raises(FileNotFoundError):
        ch.send(np.array([1]))


def _same_buffer_sender(name, direct, n, q):
    try:
        # a forked child: torch's thread pool is the parent's (OpenMP is not fork-safe)
        torch.set_num_threads(1)
        ch = dlpack_ipc.channel(name, direct=direct)
        buf = dlpack_ipc.empty((64, 1024), "float32")
        torch.from_dlpack(buf).copy_(torch.arange(64 * 1024, dtype=torch.float32).view(64, 1024))
        for _ in range(n):
            ch.send(buf)
        q.put(("ok", None))
    except BaseException:
        q.put(("error", traceback.format_exc()))


@pytest.mark.client_cache
@pytest.mark.parametrize("direct", [False, True], ids=["queued", "direct"])
def test_kept_mapping_never_shows_a_consumers_writes(ipc, daemon, direct):
    """One buffer sent again and again: from its second message on the receiver hands out the
    mapping it kept (the same address), and what torch wrote into a received tensor (torch
    ignores the read-only flag; the default mode maps copy-on-write) never shows in the next."""
    ctx = multiprocessing.get_context("fork")
    name = f"py/kept-{direct}"
    ch = dlpack_ipc.channel(name, capacity=8, direct=direct)
    q = ctx.Queue()
    p = ctx.Process(target=_same_buffer_sender, args=(name, direct, 6, q))
    p.start()
    want = torch.arange(64 * 1024, dtype=torch.float32).view(64, 1024)
    ptrs = []
    try:
        for i in range(6):
            t = ch.recv(timeout=30)
            x = torch.from_dlpack(t)
            assert torch.equal(x, want), f"message {i} shows an earlier consumer's writes"
            ptrs.append(x.data_ptr())
            if i % 2:
                x.fill_(-1.0)
            else:
                x[::3, 5] = 7.0
            del x, t
        res = q.get(timeout=60)
        assert res[0] == "ok", res[1]
    finally:
        p.join(timeout=60)
    # the second message's mapping was kept and handed out for the rest
    assert len(set(ptrs[2:])) == 1 and ptrs[2] == ptrs[1], ptrs
    ch.remove()


# ---- end of stream ----

def _end_producer(name, base, n, q):
    try:
        with dlpack_ipc.channel(name) as ch:
            for i in range(n):
                ch.send(np.array([base + i]))
        q.put(("ok", None))
    except BaseException:
        q.put(("error", traceback.format_exc()))


@pytest.mark.parametrize("direct", [False, True], ids=["queued", "direct"])
def test_end_two_producers_slow_consumer(ipc, daemon, direct):
    """Two producer processes and a slow consumer: 100 messages of 100, then the loop ends by
    itself (before end of stream it never did: only remove() ended it, dropping what was
    queued)."""
    ctx = multiprocessing.get_context("fork")
    name = "py/end-d" if direct else "py/end"
    ch = dlpack_ipc.channel(name, capacity=4, direct=direct, producers=2)
    q = ctx.Queue()
    ps = [ctx.Process(target=_end_producer, args=(name, 50 * k, 50, q)) for k in range(2)]
    for p in ps:
        p.start()
    got = []
    with ch:
        for t in ch:
            got.append(int(np.from_dlpack(t)[0]))
            del t
            time.sleep(0.002)  # slow: the producers wait for room
    for p in ps:
        p.join(timeout=60)
        assert q.get(timeout=10) == ("ok", None)
    assert sorted(got) == list(range(100))
    info = ch.stat()
    assert info.ended and info.producers == 0 and info.producers_closed == 2
    # the consumer's with block closed nothing: it only received
    with pytest.raises(dlpack_ipc.ChannelClosed) as e:
        ch.recv()
    assert isinstance(e.value, EOFError) and name in str(e.value)
    with pytest.raises(BrokenPipeError):
        ch.send(np.zeros(1))
    ch.remove()
    # a new stream: open it again
    with dlpack_ipc.channel(name, direct=direct) as ch2:
        assert not ch2.stat().ended
        ch2.send(np.array([7]))
    assert [int(np.from_dlpack(t)[0]) for t in ch2] == [7]
    ch2.remove()


def _end_waiter(name, q):
    try:
        ch = dlpack_ipc.channel(name)
        first = int(np.from_dlpack(ch.recv(timeout=30))[0])
        q.put(("first", first))
        try:
            ch.recv()  # waits: woken by the end
            q.put(("error", "a second message came"))
        except dlpack_ipc.ChannelClosed as e:
            q.put(("ok", str(e)))
    except BaseException:
        q.put(("error", traceback.format_exc()))


@pytest.mark.parametrize("direct", [False, True], ids=["queued", "direct"])
def test_end_wakes_a_waiting_receiver(ipc, daemon, direct):
    ctx = multiprocessing.get_context("fork")
    ch = dlpack_ipc.channel("py/wake", direct=direct)
    q = ctx.Queue()
    p = ctx.Process(target=_end_waiter, args=("py/wake", q))
    p.start()
    ch.send(np.array([5]))
    assert q.get(timeout=30) == ("first", 5)
    if not direct:
        deadline = time.monotonic() + 10
        while ch.stat().receivers_waiting != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ch.stat().receivers_waiting == 1
    ch.close()
    res = q.get(timeout=30)
    p.join(timeout=30)
    assert res[0] == "ok" and "py/wake" in res[1], res
    ch.remove()


def _crasher(name, q):
    ch = dlpack_ipc.channel(name)
    for i in range(3):
        ch.send(np.array([i]))
    q.put("sent")
    q.close()
    q.join_thread()  # (the queue's thread has written it before the kill)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("direct", [False, True], ids=["queued", "direct"])
def test_end_when_a_producer_dies_without_close(ipc, daemon, direct):
    """A producer killed before close(): its connection's end is its close, so the consumer
    gets what it sent and its loop ends, rather than waiting on the dead for ever."""
    ctx = multiprocessing.get_context("fork")
    ch = dlpack_ipc.channel("py/crash", direct=direct)
    q = ctx.Queue()
    p = ctx.Process(target=_crasher, args=("py/crash", q))
    p.start()
    assert q.get(timeout=30) == "sent"
    p.join(timeout=30)
    assert p.exitcode == -signal.SIGKILL
    assert [int(np.from_dlpack(t)[0]) for t in ch] == [0, 1, 2]
    assert ch.stat().producers_closed == 1
    ch.remove()


def test_close_by_a_consumer_or_a_second_producer(ipc, daemon):
    prod = dlpack_ipc.channel("py/who", direct=False)
    prod.send(np.array([1]))
    cons = dlpack_ipc.Channel("py/who", client=dlpack_ipc.Client())
    assert int(np.from_dlpack(cons.recv())[0]) == 1
    cons.close()  # it only received: nothing
    assert ch_state(prod) == (False, 1, 0)
    # a connection that never sent nor received closes as a producer with nothing to send:
    # the stream goes on while the producer that sent has not closed
    other = dlpack_ipc.Channel("py/who", client=dlpack_ipc.Client())
    other.close()
    other.close()  # twice is as once
    assert ch_state(prod) == (False, 1, 1)
    with pytest.raises(BrokenPipeError, match="closed its side"):
        other.send(np.array([2]))
    prod.send(np.array([3]))
    prod.close()
    assert ch_state(prod) == (True, 0, 2)
    assert [int(np.from_dlpack(t)[0]) for t in cons] == [3]
    prod.remove()


def ch_state(ch):
    i = ch.stat()
    return i.ended, i.producers, i.producers_closed


@pytest.mark.parametrize("direct", [False, True], ids=["queued", "direct"])
def test_close_all_and_remove(ipc, daemon, direct):
    """close(all=True) ends the stream for every producer and keeps what is queued for the
    consumers; remove() drops what is queued."""
    ch = dlpack_ipc.channel("py/all", capacity=4, direct=direct)
    prod = dlpack_ipc.Channel("py/all", client=dlpack_ipc.Client())
    prod.send(np.array([1]))
    prod.send(np.array([2]))
    ch.close(all=True)
    assert ch.stat().ended and ch.stat().producers == 1
    with pytest.raises(BrokenPipeError):
        prod.send(np.array([3]))
    assert [int(np.from_dlpack(t)[0]) for t in ch] == [1, 2]
    ch.remove()
    # remove(): what is queued is dropped, unread
    ch = dlpack_ipc.channel("py/all", direct=direct)
    with ch:
        ch.send(np.ones(1 << 14))
        ch.send(np.ones(1 << 14))
    assert ch.stat().depth == 2 and ch.stat().ended
    ch.remove()
    daemon.wait_stat(lambda s: s["storages"] == 0 and s["channels"] == 0,
                     what="the removed channel's messages dropped")
    assert "dropped" in dlpack_ipc.Channel.remove.__doc__


def test_ordinary_channel_use_logs_no_warning(ipc, daemon):
    """Opening, sending to and receiving from channels is no reason for the daemon to warn
    (every client asked a queued channel's kind and was refused with a warning)."""
    for direct in (False, True):
        with dlpack_ipc.channel(f"py/quiet{int(direct)}", direct=direct) as ch:
            ch.send(np.zeros(4))
        assert len(list(dlpack_ipc.channel(f"py/quiet{int(direct)}"))) == 1
        ch.remove()
    daemon.wait_stat(lambda s: s["channels"] == 0, what="the channels removed")
    assert ": warning: " not in daemon.log_text()


def test_with_block_exception_survives_a_failed_close(ipc, daemon):
    """The exception raised in a `with channel` block is the one that propagates, even when
    the close on leaving then fails (here the block closed the client: its connection, and
    with it this producer, ended already)."""
    import dlpack_ipc
    c = dlpack_ipc.Client()
    with pytest.raises(KeyError):
        with dlpack_ipc.channel("with/err", client=c) as ch:
            ch.send(np.zeros(2), timeout=0)
            c.close()
            raise KeyError("b")
    # the message sent before stays for the consumer, then the end (the producer went)
    rx = ipc.channel("with/err")
    assert rx.recv(timeout=0).torch().tolist() == [0.0, 0.0]
    with pytest.raises(dlpack_ipc.ChannelClosed):
        rx.recv(timeout=0)
    # without an exception in the block, the close's own error is the one to see
    c = dlpack_ipc.Client()
    with pytest.raises(ValueError):
        with dlpack_ipc.channel("with/err", client=c):
            c.close()
    rx.remove()


@pytest.mark.parametrize("direct", [False, True])
def test_a_forked_consumer_is_not_a_producer(ipc, direct):
    """A Channel object inherited across fork() carries nothing of the parent's role: a child
    that only receives, and leaves a `with` block, ends nothing for the producers (it used to
    count as the parent, a producer, and end the stream of two producers after one)."""
    ch = dlpack_ipc.channel(f"py/forked{int(direct)}", capacity=4, direct=direct, producers=2)
    ch.send(np.arange(2))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with ch:
                np.testing.assert_array_equal(np.from_dlpack(ch.recv(timeout=30)), np.arange(2))
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    info = ch.stat()
    assert info.producers_closed == 0 and not info.ended, info
    ch.close()
    info = ch.stat()
    assert info.producers_closed == 1 and not info.ended, info
    ch.remove()
