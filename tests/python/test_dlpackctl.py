# SPDX-License-Identifier: Apache-2.0
"""dlpackctl against a real daemon, with entries published by other interpreters.

DLPACKCTL_BIN names the binary (CTest sets it); the man page is docs/dlpackctl.1.
"""
import json
import os
import re
import shutil
import signal
import subprocess

import numpy as np
import pytest

import dlpack_ipc

MAN = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "dlpackctl.1")


@pytest.fixture(scope="session")
def ctl_bin():
    path = os.environ.get("DLPACKCTL_BIN")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"DLPACKCTL_BIN={path!r} is not an executable dlpackctl", pytrace=False)
    return path


@pytest.fixture
def ctl(ctl_bin, daemon):
    """Run dlpackctl against this test's daemon (through $DLPACKD_SOCKET, as users would)."""

    def run(*args, timeout=60):
        return subprocess.run([ctl_bin, *args], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    return run


def ok(cp):
    assert cp.returncode == 0, f"exit {cp.returncode}\nstdout: {cp.stdout}\nstderr: {cp.stderr}"
    return cp


def test_ls_json_matches_what_another_process_published(ctl, py, ipc):
    cp = py.check("""
        import os, numpy as np, dlpack_ipc
        dlpack_ipc.publish("m/single", np.zeros((2, 3), np.float32))
        dlpack_ipc.publish("m/single", np.zeros((5, 7), np.int16), replace=True)
        dlpack_ipc.publish_dict("m/bundle", {"w": np.ones((4,)), "b": np.ones((2, 2), np.uint8)})
        dlpack_ipc.publish("n/outside", np.ones(1))
        print(os.getpid())
    """)
    pid = int(cp.stdout.split()[0])
    held = [ipc.attach("m/single"), ipc.attach("m/single"), ipc.attach_dict("m/bundle")]

    entries = json.loads(ok(ctl("ls", "m/", "--json")).stdout)
    assert [e["name"] for e in entries] == ["m/bundle", "m/single"]
    bundle, single = entries
    assert single["generation"] == 2
    assert single["refs"] == 2
    assert single["owner_pid"] == pid and single["owner_uid"] == os.getuid()
    assert single["device"] == "cpu" and not single["ephemeral"] and not single["writable"]
    assert single["ntensors"] == 1
    assert single["tensors"] == [{"key": "", "dtype": "int16", "shape": [5, 7], "nbytes": 70}]
    assert bundle["refs"] == 1 and bundle["ntensors"] == 2
    assert sorted((t["key"], t["dtype"], t["shape"]) for t in bundle["tensors"]) == [
        ("b", "uint8", [2, 2]), ("w", "float64", [4])]
    # the same as the library reports
    lib = {e.name: e for e in dlpack_ipc.list("m/")}
    for e in entries:
        assert (e["generation"], e["refs"], e["nbytes"]) == (
            lib[e["name"]].generation, lib[e["name"]].refs, lib[e["name"]].nbytes)

    # every entry, and the table
    assert len(json.loads(ok(ctl("ls", "--json")).stdout)) == 3
    table = ok(ctl("ls", "m/")).stdout.splitlines()
    assert table[0].split() == ["NAME", "GEN", "DEVICE", "TYPE", "SIZE", "REFS", "CACHED", "OWNER",
                                "AGE"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert set(rows) == {"m/bundle", "m/single"}
    assert rows["m/single"][1:4] == ["2", "cpu", "int16[5,7]"]
    assert rows["m/single"][6:8] == ["2", "0"] and rows["m/single"][8].endswith(f"/{pid}")
    assert rows["m/bundle"][3] == "bundle(2)"
    assert json.loads(ok(ctl("ls", "nothing/", "--json")).stdout) == []
    for h in held[:2]:
        h.release()
    del held


def test_names_are_escaped(ctl, ipc):
    name = 'we"ird\\name\n\ttab\x7f-✓-😀'
    ipc.publish(name, np.ones(1))
    entries = json.loads(ok(ctl("ls", "--json")).stdout)
    assert [e["name"] for e in entries] == [name]
    out = ok(ctl("ls")).stdout
    assert 'we"ird\\x5cname\\x0a\\x09tab\\x7f-✓-😀' in out


def test_terminal_controls_in_names_are_escaped(ctl, ipc):
    # a C1 control (8-bit CSI) and a right-to-left override would act on a terminal
    name = "c1\u009b31m-\u202eevil"
    ipc.publish(name, np.ones(1))
    out = ok(ctl("ls")).stdout
    assert "c1\\xc2\\x9b31m-\\xe2\\x80\\xaeevil" in out
    assert "\u009b" not in out and "\u202e" not in out
    assert json.loads(ok(ctl("ls", "--json")).stdout)[0]["name"] == name


def _read_lines(proc, n):
    lines = []
    for _ in range(n):
        line = proc.stdout.readline()
        assert line, f"watch ended early: {lines} {proc.stderr.read()}"
        lines.append(line.rstrip("\n"))
    return lines


def test_watch_that_cannot_write_fails(ctl_bin, daemon, ipc):
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen([ctl_bin, "watch", "full/"], stdout=full, stderr=subprocess.PIPE,
                                text=True, stdin=subprocess.DEVNULL)
    try:
        daemon.wait_stat(lambda s: s["watchers"] == 1, what="one watcher")
        ipc.publish("full/x", np.ones(1))
        assert proc.wait(timeout=10) == 1
        assert "cannot write the output" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_watch_prints_publish_replace_unpublish_in_order(ctl_bin, daemon, py):
    procs = [subprocess.Popen([ctl_bin, "watch", "w/", *extra], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for extra in ([], ["--json"])]
    try:
        daemon.wait_stat(lambda s: s["watchers"] == 2, what="two watchers")
        cp = py.check("""
            import os, numpy as np, dlpack_ipc
            dlpack_ipc.publish("w/x", np.zeros((3, 4), np.float32))
            dlpack_ipc.publish("elsewhere", np.zeros(1))
            dlpack_ipc.publish("w/x", np.zeros(8, np.int32), replace=True)
            dlpack_ipc.unpublish("w/x")
            print(os.getpid())
        """)
        pid = int(cp.stdout.split()[0])
        text = _read_lines(procs[0], 3)
        events = [json.loads(line) for line in _read_lines(procs[1], 3)]
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
            p.wait(timeout=30)

    assert [t.split()[:4] for t in text] == [
        ["published", "w/x", "gen", "1"],
        ["replaced", "w/x", "gen", "2"],
        ["unpublished", "w/x", "gen", "2"],
    ]
    assert "float32[3,4]" in text[0] and "48 B" in text[0] and f"/{pid}" in text[0]
    assert "(was 1)" in text[1] and "int32[8]" in text[1]
    assert "(by pid" in text[2]
    assert [(e["event"], e["name"], e["generation"]) for e in events] == [
        ("published", "w/x", 1), ("replaced", "w/x", 2), ("unpublished", "w/x", 2)]
    assert events[0]["tensors"][0]["shape"] == [3, 4]
    assert events[1]["previous_generation"] == 1
    assert events[2]["reason"] == "request" and events[2]["actor_pid"] == pid
    assert events[0]["owner_pid"] == pid
    assert events[1]["seq"] == events[0]["seq"] + 2  # "elsewhere" is not watched


def test_exit_codes_and_messages(ctl, ctl_bin, ipc, daemon):
    # usage errors: 2
    for args in ([], ["bogus"], ["ls", "--frobnicate"], ["rm"], ["rm", "a", "b"],
                 ["wait", "x", "--timeout", "-1"], ["wait", "x", "--timeout", "soon"],
                 ["stat", "--timeout", "1"], ["rm", "x", "--json"], ["--socket"]):
        cp = ctl(*args)
        assert cp.returncode == 2, (args, cp)
        assert cp.stderr.startswith("dlpackctl: ") and "--help" in cp.stderr, (args, cp.stderr)
    # failures: 1, naming the command, the name and the cause
    cp = ctl("rm", "missing")
    assert cp.returncode == 1
    assert cp.stderr == "dlpackctl: rm 'missing': no entry named 'missing'\n"
    cp = ctl("wait", "late", "--timeout", "0.1")
    assert cp.returncode == 1 and "wait 'late'" in cp.stderr and "appeared" in cp.stderr
    cp = subprocess.run([ctl_bin, "--socket", daemon.socket + ".nope", "ping"],
                        capture_output=True, text=True)
    assert cp.returncode == 1 and "cannot connect" in cp.stderr and ".nope" in cp.stderr
    # success: 0
    assert ok(ctl("ping")).stdout.startswith(f"dlpackd pid {daemon.pid} answers on ")
    ok(ctl("--socket", daemon.socket, "ping"))
    assert ok(ctl("--version")).stdout.strip() == f"dlpackctl {dlpack_ipc.libdlpc_version}"


def test_rm_wait_stat(ctl, ctl_bin, ipc, daemon, py):
    ipc.publish("gone", np.ones(1))
    ok(ctl("rm", "gone"))
    assert [e.name for e in ipc.list()] == []
    # wait returns once another process publishes the name
    waiter = subprocess.Popen([ctl_bin, "wait", "soon", "--timeout", "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        daemon.wait_stat(lambda s: s["waiters"] == 1, what="one waiter")
        py.check("""
            import numpy as np, dlpack_ipc
            dlpack_ipc.publish("soon", np.ones(2))
        """)
        out, err = waiter.communicate(timeout=60)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert waiter.returncode == 0, err
    ok(ctl("wait", "soon"))  # present: at once, and without a timeout
    # wait holds no reference after it returns
    daemon.wait_stat(lambda s: s["references"] == 0, what="no references")
    st = json.loads(ok(ctl("stat", "--json")).stdout)
    assert st["entries"] == 1 and st["daemon_pid"] == daemon.pid
    assert st["req_attach"] == 2 and st["watchers"] == 0
    assert set(st) >= {"connections", "bytes_held", "fds_open", "tx_queued", "queue_drops",
                       "events", "req_watch"}
    # the caller's uid: what it published that a name reaches, what it keeps alive unnamed
    assert st["uid_bytes_held"] > 0 and st["uid_bytes_pinned"] == 0
    assert st["uid_entries"] == 1 and st["uid_connections"] >= 1
    text = dict(line.split() for line in ok(ctl("stat")).stdout.splitlines())
    assert set(text) == set(st) and int(text["entries"]) == 1


# ---- the man page ----


def _help_sections(text):
    """{section title: [lines]} of the --help text (sections end with ':')."""
    sections, cur = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            cur = sections.setdefault(line[:-1], [])
        elif cur is not None and line.startswith("  "):
            cur.append(line)
    return sections


def _man_text():
    groff = shutil.which("groff")
    assert groff, "groff is not installed (scripts/dev installs groff-base)"
    cp = subprocess.run([groff, "-ww", "-man", "-Tascii", "-P-cbou", MAN], capture_output=True,
                        text=True, env={**os.environ, "LC_ALL": "C"})
    assert cp.returncode == 0 and cp.stderr == "", cp.stderr
    return cp.stdout.expandtabs()


def _man_sections(text):
    sections, cur = {}, None
    for line in text.splitlines():
        if re.match(r"^[A-Z][A-Z ]+$", line):
            cur = sections.setdefault(line, [])
        elif cur is not None:
            cur.append(line)
    return sections


def _tags(lines, indent):
    """Lines that start exactly at indent (the .TP tags of a man page section)."""
    return [line.strip() for line in lines
            if line.startswith(" " * indent) and not line.startswith(" " * (indent + 1))]


def _options(tag):
    """Leading option tokens of a line: '-h, --help  show' -> ['-h', '--help']."""
    out = []
    for tok in tag.split():
        if not tok.startswith("-"):
            break
        out.append(tok.rstrip(","))
    return out


def test_man_page_renders_without_warnings():
    cp = subprocess.run(["groff", "-ww", "-man", "-z", MAN], capture_output=True, text=True)
    assert cp.returncode == 0 and cp.stderr == "", cp.stderr


def test_help_matches_man_page(ctl_bin):
    helptext = subprocess.run([ctl_bin, "--help"], capture_output=True, text=True, check=True)
    h = _help_sections(helptext.stdout)
    m = _man_sections(_man_text())

    # every command, with the same arguments, in both
    help_cmds = {re.split(r"\s{2,}", line.strip())[0] for line in h["Commands"]}
    man_cmds = {re.split(r"\s{2,}", tag)[0] for tag in _tags(m["COMMANDS"], 7)}
    assert help_cmds == man_cmds

    # every option in both
    help_opts = {o for line in h["Options"] for o in _options(line.strip())}
    man_opts = {o for tag in _tags(m["OPTIONS"], 7) for o in _options(tag)}
    assert help_opts == man_opts
    assert {"--socket", "--json", "--timeout", "--help", "-h"} <= help_opts

    # and no option mentioned anywhere in one that the other does not know
    mentioned = set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*", helptext.stdout))
    assert mentioned <= help_opts, mentioned - help_opts
    man_mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", _man_text()))
    assert man_mentioned <= help_opts, man_mentioned - help_opts


# ---- help per command, aligned tables, the connect error ----

def test_each_command_has_its_own_help(ctl_bin):
    top = subprocess.run([ctl_bin, "--help"], capture_output=True, text=True, check=True).stdout
    cmds = [re.split(r"\s{2,}", line.strip())[0].split()[0]
            for line in _help_sections(top)["Commands"]]
    assert "ls" in cmds and "channels" in cmds
    for cmd in cmds:
        for flag in ("--help", "-h"):
            cp = subprocess.run([ctl_bin, cmd, flag], capture_output=True, text=True)
            assert cp.returncode == 0 and cp.stderr == "", (cmd, cp)
            assert cp.stdout.startswith(f"Usage: dlpackctl [--socket PATH] {cmd}"), cp.stdout
            assert cp.stdout != top and "Commands:" not in cp.stdout, cp.stdout
    # the options a command takes, and no other
    assert "--json" in ok(subprocess.run([ctl_bin, "ls", "--help"], capture_output=True,
                                         text=True)).stdout
    assert "--json" not in ok(subprocess.run([ctl_bin, "rm", "--help"], capture_output=True,
                                             text=True)).stdout
    assert "--timeout" in ok(subprocess.run([ctl_bin, "wait", "--help"], capture_output=True,
                                            text=True)).stdout


def _assert_aligned(text):
    """Every cell of a table starts where its column's heading does, two spaces after the
    cell before; the rows as lists of cells."""
    head, *rows = text.rstrip("\n").split("\n")
    starts = [m.start() for m in re.finditer(r"\S+", head)]
    out = []
    for row in rows:
        cells = []
        for k, at in enumerate(starts):
            assert len(row) > at and row[at] != " ", (k, head, row)
            if k:
                assert row[at - 2:at] == "  ", (k, head, row)
            end = starts[k + 1] if k + 1 < len(starts) else len(row)
            cells.append(row[at:end].strip())
        out.append(cells)
    return out


def _wait_channel(name, pred, what):
    for _ in range(6000):
        (info,) = [c for c in dlpack_ipc.channels(name) if c.name == name]
        if pred(info):
            return
        import time
        time.sleep(0.01)
    pytest.fail(f"channel {name}: never {what}")


def test_tables_align_and_waiting_reads(ctl, ipc, daemon):
    import threading
    long_name = "t/" + "a-rather-long-name-" * 4
    ipc.publish(long_name, np.zeros((300, 300)))
    ipc.publish("t/b", np.zeros(3, np.int8))
    rows = _assert_aligned(ok(ctl("ls", "t/")).stdout)
    assert [r[0] for r in rows] == [long_name, "t/b"]

    idle = dlpack_ipc.channel("t/idle-" + "x" * 40, capacity=65536, direct=False)
    for _ in range(3):
        idle.send(np.zeros(10000))
    full = dlpack_ipc.channel("t/full", capacity=1, direct=False)
    full.send(np.zeros(1))
    empty = dlpack_ipc.channel("t/empty", direct=False)
    other = dlpack_ipc.Client(daemon.socket)
    got = []
    # a receiver waits on t/empty, a sender on t/full (each on a connection of its own)
    rx = threading.Thread(target=lambda: got.append(
        dlpack_ipc.Channel("t/empty", client=other).recv(timeout=60)))
    tx = threading.Thread(target=lambda: dlpack_ipc.Channel(
        "t/full", client=dlpack_ipc.Client(daemon.socket)).send(np.ones(1), timeout=60))
    rx.start()
    tx.start()
    try:
        _wait_channel("t/empty", lambda c: c.receivers_waiting == 1, "a waiting receiver")
        _wait_channel("t/full", lambda c: c.senders_waiting == 1, "a waiting sender")
        rows = {r[0]: r for r in _assert_aligned(ok(ctl("channels", "t/")).stdout)}
        head = ok(ctl("channels", "t/")).stdout.split("\n")[0].split()
        waiting = {name: r[head.index("WAITING")] for name, r in rows.items()}
        assert waiting == {"t/empty": "1 recv", "t/full": "1 send", idle.name: "-"}, waiting
        assert rows["t/full"][head.index("KIND")] == "queued"
        assert rows[idle.name][head.index("DEPTH")] == "3/65536"
    finally:
        empty.send(np.zeros(1))
        full.recv(timeout=60)
        rx.join(60)
        tx.join(60)
    assert len(got) == 1

    # stat: every value in one column, however long the counter's name
    lines = ok(ctl("stat")).stdout.splitlines()
    starts = {re.search(r"\s(\d+)$", line).start(1) for line in lines}
    assert len(starts) == 1, lines


def test_connect_error_lists_every_path(ctl_bin, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DLPACKD_SOCKET"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)
    cp = subprocess.run([ctl_bin, "ping"], capture_output=True, text=True, env=env)
    if cp.returncode == 0:
        # this machine runs the service: found on the system socket, past the per-user one
        assert "answers on /run/dlpackd/dlpackd.sock" in cp.stdout, cp.stdout
        return
    assert cp.returncode == 1
    assert f"{tmp_path}/dlpackd.sock ($XDG_RUNTIME_DIR/dlpackd.sock): No such file" in cp.stderr
    assert "/run/dlpackd/dlpackd.sock (the system socket)" in cp.stderr, cp.stderr


def test_channels_state_shows_the_stream(ctl, ipc, py):
    """STATE: open or ended, with the producers that closed of the closes the end waits for;
    --json: ended and the three producer counts."""
    # producers in another process, which exits: its connection's end closes them
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.channel("s/ended").send(np.zeros(2))
        dlpack_ipc.channel("s/two", producers=2).send(np.zeros(2))
    """)
    ipc.channel("s/idle")
    mine = ipc.channel("s/open")
    mine.send(np.zeros(1))
    assert ipc.channel("s/ended").stat().ended  # the end came with the producer's exit

    out = ok(ctl("channels", "s/")).stdout
    head = out.split("\n")[0].split()
    assert head[-2:] == ["STATE", "OWNER"], head
    state = {r[0]: r[head.index("STATE")] for r in _assert_aligned(out)}
    assert state == {"s/ended": "ended, 1/1 closed", "s/idle": "open",
                     "s/open": "open, 0/1 closed", "s/two": "open, 1/2 closed"}, out

    got = {c["name"]: c for c in json.loads(ok(ctl("channels", "s/", "--json")).stdout)}
    counts = {n: (c["ended"], c["producers"], c["producers_closed"], c["producers_expected"])
              for n, c in got.items()}
    assert counts == {"s/ended": (True, 0, 1, 1), "s/idle": (False, 0, 0, 1),
                      "s/open": (False, 1, 0, 1), "s/two": (False, 0, 1, 2)}, counts
    info = {c.name: c for c in ipc.channels("s/")}
    assert info["s/two"].producers_expected == 2 and info["s/idle"].producers_expected == 1

    # what was queued is still received after the end, and the stream stays ended
    ipc.channel("s/ended").recv(timeout=60)
    assert state_of(ctl, "s/ended") == "ended, 1/1 closed"
    mine.close()
    assert state_of(ctl, "s/open") == "ended, 1/1 closed"


def state_of(ctl, name):
    out = ok(ctl("channels", name)).stdout
    head = out.split("\n")[0].split()
    (row,) = [r for r in _assert_aligned(out) if r[0] == name]
    return row[head.index("STATE")]
