# SPDX-License-Identifier: Apache-2.0
"""bench/run.py's own clean-up: what a run leaves behind is killed and reported even when one of
its harnesses fails."""
import argparse
import importlib.util
import os
import signal
import subprocess
import sys

import pytest

RUN_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "bench", "run.py")


def _load_run():
    spec = importlib.util.spec_from_file_location("bench_run", RUN_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_failed_run_kills_what_it_left(monkeypatch, tmp_path, capsys):
    """A harness that fails after starting a process of the run (as Ray's would be): the run
    still fails with the harness's error, and the process is killed and named on stderr."""
    run = _load_run()
    started = []

    def failing_start(build, tmp, store=None):
        started.append(subprocess.Popen(["sleep", "600"], env=dict(os.environ, DLPC_BENCH_RUN=tmp)))
        raise RuntimeError("the harness failed")

    monkeypatch.setattr(run, "start_daemon", failing_start)
    monkeypatch.setattr(run, "PROCESS_GRACE_S", 0)
    args = argparse.Namespace(quick=True, build=str(tmp_path), out=str(tmp_path), no_pin=True,
                              python=sys.executable, shmem_thp=None)
    try:
        with pytest.raises(RuntimeError, match="the harness failed"):
            run.bench(args)
        assert started[0].wait(timeout=30) == -signal.SIGKILL
        err = capsys.readouterr().err
        assert f"process left behind (killed): {started[0].pid} sleep 600" in err
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_process_caught_inside_exec_is_found(tmp_path):
    """A process the run started a moment ago may still be inside execve(), where /proc shows an
    empty environment: it is read again until it shows one, and found by the run's marker. Each
    of the 50 tries reads /proc right after Popen returns; a single read missed the marker in
    about one try in four on this machine kind."""
    run = _load_run()
    marker = str(tmp_path)
    for _ in range(50):
        p = subprocess.Popen(["sleep", "600"], env=dict(os.environ, DLPC_BENCH_RUN=marker))
        try:
            environ, cmd = run._environ_and_cmdline(p.pid)
            assert f"DLPC_BENCH_RUN={marker}".encode() in environ.split(b"\0")
            assert cmd == b"sleep\x00600\x00"
            assert run.leftover_processes(marker) == [(p.pid, "sleep 600")]
        finally:
            p.kill()
            p.wait()
    assert run.leftover_processes(marker) == []


def test_only_a_young_user_process_is_read_again(monkeypatch):
    """An empty environment is read again only for a process started within
    EXEC_SETTLE_AGE_S that is not a kernel thread: one started with an empty environment, or
    kthreadd, is not waited on."""
    run = _load_run()
    p = subprocess.Popen(["sleep", "600"], env={})
    try:
        assert run._inside_exec(p.pid)
        monkeypatch.setattr(run, "EXEC_SETTLE_AGE_S", 0.0)
        assert not run._inside_exec(p.pid)
        assert run._environ_and_cmdline(p.pid)[0] == b""
    finally:
        p.kill()
        p.wait()
    monkeypatch.undo()
    if os.path.exists("/proc/2/stat"):         # kthreadd, where this pid namespace has it
        with open("/proc/2/stat") as f:
            if "(kthreadd)" in f.read():
                assert not run._inside_exec(2)
