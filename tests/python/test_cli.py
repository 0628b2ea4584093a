# SPDX-License-Identifier: Apache-2.0
"""python -m dlpack_ipc: dlpackctl's ls, rm, stat, watch and channels for pip users, run as a
command against a real daemon."""
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import _child_env

PROG = "python -m dlpack_ipc"


def cli(*args, socket=None, timeout=60):
    """Run `python -m dlpack_ipc [--socket S] ARGS...`; the CompletedProcess."""
    pre = ["--socket", socket] if socket else []
    return subprocess.run([sys.executable, "-m", "dlpack_ipc", *pre, *args], env=_child_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def columns(line):
    """The start of each column of a table line (cells are two or more spaces apart)."""
    return [m.start() for m in re.finditer(r"(?:^|(?<=  ))\S", line)]


def test_ls_shows_what_another_process_published(ipc, daemon, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("cli/a", np.zeros((2, 3), np.float32))
        dlpack_ipc.publish_dict("cli/long/bundle", {"w": np.zeros(4), "b": np.ones(2)})
        dlpack_ipc.publish("other", np.zeros(1))
    """)
    cp = cli("ls", "cli/", socket=daemon.socket)
    assert cp.returncode == 0 and cp.stderr == "", py.describe(cp)
    head, *rows = cp.stdout.splitlines()
    assert head.split() == ["NAME", "GEN", "DEVICE", "TYPE", "SIZE", "REFS", "CACHED", "OWNER",
                            "AGE"]
    assert [r.split()[0] for r in rows] == ["cli/a", "cli/long/bundle"]
    assert rows[0].split()[1:4] == ["1", "cpu", "float32[2,3]"]
    assert rows[1].split()[3] == "bundle(2)"
    # aligned: every column starts where its heading does
    for r in rows:
        assert columns(r) == columns(head), cp.stdout
    # the default socket ($DLPACKD_SOCKET, set by the fixture) and --socket after the command
    for cp in (cli("ls"), cli("ls", "--socket", daemon.socket)):
        assert cp.returncode == 0, cp.stderr
        assert [r.split()[0] for r in cp.stdout.splitlines()[1:]] == \
            ["cli/a", "cli/long/bundle", "other"]


def test_rm_removes_and_a_bad_name_is_one_line_and_exit_1(ipc, daemon):
    ipc.publish("cli/x", np.zeros(2))
    ipc.publish("cli/y", np.zeros(2))
    cp = cli("rm", "cli/x", socket=daemon.socket)
    assert (cp.returncode, cp.stdout, cp.stderr) == (0, "", "")
    assert [e.name for e in ipc.list()] == ["cli/y"]
    # every name is tried; the one that fails is named, on one line
    cp = cli("rm", "no/such", "cli/y", socket=daemon.socket)
    assert cp.returncode == 1
    assert cp.stderr == f"{PROG}: rm 'no/such': no entry named 'no/such'\n"
    assert ipc.list() == []


def test_stat_prints_the_counters_aligned(ipc, daemon):
    ipc.publish("cli/s", np.zeros(2))
    cp = cli("stat", socket=daemon.socket)
    assert cp.returncode == 0 and cp.stderr == "", cp.stderr
    rows = [ln.split() for ln in cp.stdout.splitlines()]
    got = {k: int(v) for k, v in rows}
    assert got["entries"] == 1 and got["daemon_pid"] == daemon.pid
    assert set(got) == set(ipc.stat())
    # the fd budget leaves out the daemon's own fds (stdio at least) and a reserve
    with open(f"/proc/{daemon.pid}/limits") as f:
        nofile = next(int(ln.split()[3]) for ln in f if ln.startswith("Max open files"))
    assert got["fds_own"] >= 3 and 0 < got["fd_budget"] < nofile - got["fds_own"]
    # aligned: every value starts in the same column
    assert len({len(ln) - len(ln.split()[-1]) for ln in cp.stdout.splitlines()}) == 1, cp.stdout


def test_channels_lists_both_kinds_aligned(ipc, daemon):
    q = ipc.channel("cli/q", direct=False)
    q.send(np.zeros(4), timeout=0)
    ipc.channel("cli/a-direct-channel", direct=True)
    cp = cli("channels", "cli/", socket=daemon.socket)
    assert cp.returncode == 0 and cp.stderr == "", cp.stderr
    head, *rows = cp.stdout.splitlines()
    assert head.split() == ["NAME", "KIND", "DEPTH", "QUEUED", "SENT", "RECEIVED", "WAITING",
                            "STATE", "OWNER"]
    assert [r.split()[:2] for r in rows] == [["cli/a-direct-channel", "direct"],
                                             ["cli/q", "queued"]]
    assert rows[0].split()[2].startswith("0/") and rows[1].split()[2] == "1/16"
    # bytes queued, sent, received, nobody waiting, this connection an open producer
    assert re.split(r"\s{2,}", rows[1])[3:8] == ["32 B", "1", "0", "-", "open, 0/1 closed"], \
        rows[1]
    assert re.split(r"\s{2,}", rows[0])[3:8] == ["-", "-", "-", "-", "open"], rows[0]
    for r in rows:
        assert columns(r) == columns(head), cp.stdout
    q.remove()


def test_channels_state_says_when_the_stream_ended(ipc, daemon, py):
    """STATE reads as dlpackctl's: "open" or "ended", and ", C/N closed" once producers came."""
    py.check("""
        import numpy as np, dlpack_ipc
        with dlpack_ipc.channel("cli/ended") as ch:
            ch.send(np.zeros(2))
        dlpack_ipc.channel("cli/two", producers=2).send(np.zeros(2))  # closed by its exit
    """)
    cp = cli("channels", "cli/", socket=daemon.socket)
    assert cp.returncode == 0 and cp.stderr == "", cp.stderr
    head, *rows = cp.stdout.splitlines()
    state = {re.split(r"\s{2,}", r)[0]: re.split(r"\s{2,}", r)[7] for r in rows}
    assert state == {"cli/ended": "ended, 1/1 closed", "cli/two": "open, 1/2 closed"}, cp.stdout
    for r in rows:
        assert columns(r) == columns(head), cp.stdout
    # the message queued before the end is still there, and the end stays
    ipc.channel("cli/ended").recv(timeout=60)
    with pytest.raises(ipc.ChannelClosed):
        ipc.channel("cli/ended").recv(timeout=60)
    cp = cli("channels", "cli/ended", socket=daemon.socket)
    assert re.split(r"\s{2,}", cp.stdout.splitlines()[1])[7] == "ended, 1/1 closed", cp.stdout


def test_channels_waiting_says_who_waits(ipc, daemon, py):
    """WAITING reads as dlpackctl's: "-", "2 recv", "1 send" or "2 recv, 1 send"."""
    ipc.channel("cli/w", 1, direct=False)
    waiters = [py.popen("""
        import dlpack_ipc
        try:
            dlpack_ipc.channel("cli/w").recv()
        except OSError:  # removed by the test
            pass
    """) for _ in range(2)]
    try:
        daemon.wait_stat(lambda s: ipc.channels("cli/w")[0].receivers_waiting == 2,
                         what="two receivers waiting")
        cp = cli("channels", "cli/w", socket=daemon.socket)
        assert cp.returncode == 0, cp.stderr
        assert re.split(r"\s{2,}", cp.stdout.splitlines()[1])[6] == "2 recv", cp.stdout
    finally:
        ipc.channel("cli/w").remove()
        for p in waiters:
            p.communicate(timeout=60)


def test_watch_prints_events_until_interrupted(ipc, daemon, py):
    p = subprocess.Popen([sys.executable, "-m", "dlpack_ipc", "--socket", daemon.socket,
                          "watch", "cli/"], env=_child_env(), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        daemon.wait_stat(lambda s: s["watchers"] == 1 or p.poll() is not None,
                         what="the watch registered")
        assert p.poll() is None, p.communicate()
        ipc.publish("cli/w", np.zeros(3, np.int16))
        ipc.publish("elsewhere", np.zeros(1))
        ipc.unpublish("cli/w")
        first = p.stdout.readline()
        second = p.stdout.readline()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert first.split()[:4] == ["published", "cli/w", "gen", "1"], first
    assert "int16[3]" in first
    assert second.split()[:2] == ["unpublished", "cli/w"] and "(by pid" in second, second
    assert out == ""
    # it dies of the signal, as a C tool does, without a traceback
    assert p.returncode == -signal.SIGINT and err == "", (p.returncode, err)


def test_watch_whose_reader_went_away_fails_in_one_line(ipc, daemon):
    """watch | head -1: once the reader is gone, the next event ends the watch with exit 1."""
    p = subprocess.Popen([sys.executable, "-m", "dlpack_ipc", "--socket", daemon.socket,
                          "watch"], env=_child_env(), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        daemon.wait_stat(lambda s: s["watchers"] == 1 or p.poll() is not None,
                         what="the watch registered")
        ipc.publish("cli/p1", np.zeros(1))
        assert p.stdout.readline().split()[:2] == ["published", "cli/p1"]
        p.stdout.close()
        i = 0
        while p.poll() is None:  # a pipe's buffer may take a few events first
            ipc.publish("cli/more", np.zeros(1), replace=True)
            i += 1
            assert i < 100000, "watch never noticed its reader was gone"
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
    assert p.returncode == 1
    assert err == f"{PROG}: watch: cannot write the output: Broken pipe\n", err


def test_usage_errors_exit_2_and_each_command_has_help(daemon):
    for args in ([], ["nosuch"], ["rm"], ["ls", "a", "b"], ["stat", "--bogus"]):
        cp = cli(*args)
        assert cp.returncode == 2, (args, cp.stderr)
        assert cp.stdout == "" and cp.stderr.startswith("usage: "), (args, cp.stderr)
    for cmd in ("ls", "rm", "stat", "watch", "channels"):
        cp = cli(cmd, "--help")
        assert cp.returncode == 0 and cp.stdout.startswith(f"usage: {PROG} {cmd} "), cp.stdout
    top = cli("--help")
    assert top.returncode == 0
    for cmd in ("ls", "rm", "stat", "watch", "channels"):
        assert cmd in top.stdout


def test_no_daemon_is_one_line_naming_the_socket(tmp_path):
    path = str(tmp_path / "none.sock")
    for cmd in ("ls", "stat", "channels", "watch"):
        cp = cli(cmd, socket=path)
        assert cp.returncode == 1, (cmd, cp.stderr)
        assert cp.stderr.count("\n") == 1 and path in cp.stderr, (cmd, cp.stderr)
        assert cp.stderr.startswith(f"{PROG}: {cmd}"), cp.stderr


def test_names_with_control_characters_are_escaped(ipc, daemon):
    ipc.publish("cli/\x1b[2J", np.zeros(1))
    cp = cli("ls", socket=daemon.socket)
    assert cp.returncode == 0 and "\x1b" not in cp.stdout
    assert "cli/\\x1b[2J" in cp.stdout
    cp = cli("rm", "cli/\x07", socket=daemon.socket)
    assert cp.returncode == 1 and "\x07" not in cp.stderr and "cli/\\x07" in cp.stderr


@pytest.mark.parametrize("cmd", ["ls", "channels"])
def test_nothing_there_prints_the_heading(ipc, daemon, cmd):
    cp = cli(cmd, socket=daemon.socket)
    assert cp.returncode == 0 and len(cp.stdout.splitlines()) == 1, cp.stdout


@pytest.mark.parametrize("cmd", ["ls", "rm", "channels", "watch"])
def test_a_name_too_long_is_one_line_and_exit_1(daemon, cmd):
    # refused by the library before it asks the daemon: one line naming the limit, no traceback
    cp = cli(cmd, "n" * 300, socket=daemon.socket)
    assert cp.returncode == 1, (cmd, cp.stderr)
    assert len(cp.stderr.splitlines()) == 1 and "Traceback" not in cp.stderr, cp.stderr
    assert cp.stderr.startswith(f"{PROG}: {cmd} ") and "255" in cp.stderr, cp.stderr


def test_a_per_user_socket_path_too_long_is_named_so(tmp_path):
    # XDG_RUNTIME_DIR set, but its dlpackd.sock longer than a socket address: the connect error
    # says that, not that the variable is not set
    if os.path.exists("/run/dlpackd/dlpackd.sock"):
        pytest.skip("a system socket exists here: the search would reach it")
    xdg = str(tmp_path / ("x" * 120))
    cp = subprocess.run([sys.executable, "-m", "dlpack_ipc", "ls"],
                        env=_child_env({"DLPACKD_SOCKET": None, "XDG_RUNTIME_DIR": xdg}),
                        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert cp.returncode == 1, cp.stderr
    assert "is not set" not in cp.stderr, cp.stderr
    assert "$XDG_RUNTIME_DIR/dlpackd.sock is longer than a socket address" in cp.stderr, \
        cp.stderr


def test_a_per_user_socket_of_another_uid_is_not_used(dlpackd_bin, tmp_path):
    """A process whose XDG_RUNTIME_DIR is another user's (su keeps it) does not talk to the
    daemon that user runs there: dlpc_connect(NULL) takes a per-user socket only where the
    daemon answering it runs as this process's own uid (a hostile user's daemon would hand it
    descriptors and tensors of its choosing)."""
    import shutil
    import tempfile
    import time
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run a daemon as uid 65534")
    if os.path.exists("/run/dlpackd/dlpackd.sock"):
        pytest.skip("a system socket exists here: the search would reach it")
    xdg = tempfile.mkdtemp(prefix="dlpc-xdg-")
    os.chmod(xdg, 0o777)
    sock = os.path.join(xdg, "dlpackd.sock")
    d = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                          dlpackd_bin, "--socket", sock, "--socket-mode", "0666"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while not os.path.exists(sock):
            assert d.poll() is None and time.monotonic() < deadline, "dlpackd did not start"
            time.sleep(0.01)
        env = _child_env({"DLPACKD_SOCKET": None, "XDG_RUNTIME_DIR": xdg})
        cp = subprocess.run([sys.executable, "-m", "dlpack_ipc", "ls"], env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=60)
        assert cp.returncode == 1, (cp.stdout, cp.stderr)
        assert sock in cp.stderr and "uid 65534" in cp.stderr, cp.stderr
        # named on purpose it is used: $DLPACKD_SOCKET is the caller's own choice
        env["DLPACKD_SOCKET"] = sock
        cp = subprocess.run([sys.executable, "-m", "dlpack_ipc", "ls"], env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True,
                            timeout=60)
        assert cp.returncode == 0, cp.stderr
    finally:
        d.terminate()
        d.wait(timeout=15)
        shutil.rmtree(xdg, ignore_errors=True)
