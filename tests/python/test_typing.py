# SPDX-License-Identifier: Apache-2.0
"""What a typed-Python user meets (issue #16, section 3): the stubs agree with the module
(stubtest), typed code using every function checks clean under mypy --strict and wrong code does
not, Client methods have real signatures and docstrings, EntryInfo.flags is an EntryFlags."""
import inspect
import os
import subprocess
import sys

import pytest

import dlpack_ipc

# mypy reads torch's and numpy's own annotations for minutes; what is checked here is ours
MYPY_INI = """
[mypy]
cache_dir = {cache}
[mypy-torch.*,numpy.*]
follow_imports = skip
follow_imports_for_stubs = True
# the bridge daemon's NIXL (an optional extra, docs/bridge.md) is not installed here
[mypy-nixl.*]
ignore_missing_imports = True
"""


@pytest.fixture
def mypy(tmp_path):
    """Run `python -m mypy` (or mypy.stubtest) of this interpreter; returns (rc, output)."""
    try:
        import mypy  # noqa: F401
    except ImportError:
        if os.path.realpath(sys.executable).startswith("/usr/bin/"):
            pytest.fail("mypy is missing for Debian's python3: install python3-mypy "
                        "(scripts/dev does)")
        pytest.skip(f"mypy is not installed for {sys.executable}")
    ini = tmp_path / "mypy.ini"
    ini.write_text(MYPY_INI.format(cache=tmp_path / "cache"))

    def run(module, *args):
        cp = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "MYPYPATH": ""})
        return cp.returncode, cp.stdout + cp.stderr
    run.ini = str(ini)
    run.dir = tmp_path
    return run


def test_stubs_agree_with_the_module(mypy):
    rc, out = mypy("mypy.stubtest", "--mypy-config-file", mypy.ini, "dlpack_ipc")
    assert rc == 0 and "Success" in out, out
    assert "14 modules" in out, ("dlpack_ipc, dlpack_ipc._core, dlpack_ipc.torch, "
                                 "dlpack_ipc.__main__ and dlpack_ipc.bridge's ten: " + out)


TYPED = '''
from typing import Dict, List, Optional, Tuple
import torch
import dlpack_ipc
import dlpack_ipc.torch
from dlpack_ipc import EntryFlags, EntryInfo, SharedTensor, WatchEvent


def names(prefix: str) -> List[str]:
    return [e.name for e in dlpack_ipc.list(prefix)]


def writable(entries: List[EntryInfo]) -> List[str]:
    return [e.name for e in entries if EntryFlags.WRITABLE in e.flags]


def shapes(name: str) -> Dict[str, Tuple[int, ...]]:
    return {k: t.shape for k, t in dlpack_ipc.attach_dict(name, timeout=1.5).items()}


def bucket() -> Dict[str, SharedTensor]:
    return dlpack_ipc.empty_dict({"w": ((4, 4), "float32"), "b": (4, "float32")})


def one(name: str) -> Optional[int]:
    with dlpack_ipc.Client(reconnect=True) as c:
        gen: int = c.publish(name, b"bytes", replace=True, ephemeral=True, writable=False)
        t = c.attach(name, timeout=float("inf"), mode="private", owner=0)
        for e in c.list(name):
            flags: EntryFlags = e.flags
            tensors = [(i.key, i.dtype, i.shape) for i in e.tensors]
        t.release()
        return gen


def load(model: "torch.nn.Module", name: str) -> List[str]:
    dlpack_ipc.torch.share_module(model, name + "/src", replace=True)
    got: dlpack_ipc.torch.IncompatibleKeys = dlpack_ipc.torch.attach_module(
        model, name, timeout=5.0, requires_grad=False, strict=False)
    return got.missing_keys + got.unexpected_keys


def follow(model: "torch.nn.Module", name: str) -> int:
    f: dlpack_ipc.torch.Follower = dlpack_ipc.torch.follow(model, name, timeout=5.0)
    swapped: bool = f.update()
    with f:
        model(torch.zeros(1))
    f.close()
    return f.generation + int(swapped)


def scoped(name: str) -> int:
    with dlpack_ipc.published(name, b"x", writable=True) as gen:
        with dlpack_ipc.published_dict(name + "/d", {"a": b"y"}, ephemeral=False) as g2:
            return gen + g2


def events(prefix: str) -> List[str]:
    with dlpack_ipc.watch(prefix) as w:
        evs: List[WatchEvent] = w.drain()
        return [ev.kind for ev in evs]
'''

WRONG = '''
import dlpack_ipc

for e in dlpack_ipc.list():
    e.nmae
dlpack_ipc.publish("x", b"", replace="yes")
dlpack_ipc.attach("x", mode="rw")
n: str = dlpack_ipc.list()[0].generation
dlpack_ipc.torch.attach_module(None, "x", strict="no")
'''


def test_typed_code_checks_clean_and_wrong_code_does_not(mypy):
    (mypy.dir / "typed.py").write_text(TYPED)
    (mypy.dir / "wrong.py").write_text(WRONG)
    rc, out = mypy("mypy", "--config-file", mypy.ini, "--strict", "typed.py")
    assert rc == 0, out
    rc, out = mypy("mypy", "--config-file", mypy.ini, "--strict", "wrong.py")
    lines = [ln for ln in out.splitlines() if ": error:" in ln]
    assert rc == 1 and [ln.split(":")[1] for ln in lines] == ["5", "6", "7", "8", "9"], out


# ---- signatures and docstrings -------------------------------------------------------------

KEYWORDS = {
    "publish": ["replace", "ephemeral", "writable"],
    "publish_dict": ["replace", "ephemeral", "writable"],
    "attach": ["timeout", "mode", "writable", "owner"],
    "attach_dict": ["timeout", "mode", "writable", "owner"],
    "empty": ["device"],
    "empty_dict": ["device"],
}


@pytest.mark.parametrize("where", ["Client", "module"])
def test_signatures_and_docstrings(where):
    for name, kws in KEYWORDS.items():
        f = getattr(dlpack_ipc.Client if where == "Client" else dlpack_ipc, name)
        params = inspect.signature(f).parameters
        for kw in kws:
            assert kw in params, f"{where}.{name}: no {kw} in {inspect.signature(f)}"
            if name.startswith(("publish", "attach")):
                assert params[kw].kind == inspect.Parameter.KEYWORD_ONLY, (name, kw)
            assert kw in f.__doc__, f"{where}.{name}'s docstring does not say what {kw} does"
    for name in ("unpublish", "stat", "close", "list"):
        f = getattr(dlpack_ipc.Client, name)
        inspect.signature(f)
        assert f.__doc__ and len(f.__doc__) > 20, name
    sig = inspect.signature(dlpack_ipc.Client)
    assert list(sig.parameters) == ["socket", "reconnect"]
    assert sig.parameters["reconnect"].kind == inspect.Parameter.KEYWORD_ONLY
    assert "unpublish" in dir(dlpack_ipc.Client)
    assert list(inspect.signature(dlpack_ipc.SharedTensor.__dlpack__).parameters) == [
        "self", "stream", "max_version", "dl_device", "copy"]


def test_unpublish_takes_name_by_keyword(ipc, py):
    py.check("""
        import numpy as np, dlpack_ipc
        dlpack_ipc.publish("kw", np.zeros(1))
    """)
    ipc.unpublish(name="kw")
    assert ipc.list() == []


# ---- EntryInfo.flags -----------------------------------------------------------------------


def test_entry_flags_are_named(ipc, py, daemon):
    assert int(dlpack_ipc.EntryFlags.EPHEMERAL) == 2 and int(dlpack_ipc.EntryFlags.WRITABLE) == 4
    p = py.popen("""
        import sys, time, numpy as np, dlpack_ipc
        dlpack_ipc.publish("f/both", np.zeros(2), ephemeral=True, writable=True)
        dlpack_ipc.publish("f/plain", np.zeros(2))
        dlpack_ipc.publish("f/w", np.zeros(2), writable=True)
        print("ready", flush=True)
        time.sleep(60)
    """)
    try:
        assert p.stdout.readline().split() == ["ready"], p.stderr.read()
        with dlpack_ipc.watch("f/", socket=daemon.socket) as w:
            got = {e.name: e.flags for e in ipc.list("f/")}
            F = dlpack_ipc.EntryFlags
            assert got == {"f/both": F.EPHEMERAL | F.WRITABLE, "f/plain": F(0), "f/w": F.WRITABLE}
            assert all(isinstance(f, F) for f in got.values())
            assert F.WRITABLE in got["f/both"] and F.EPHEMERAL not in got["f/w"]
            assert not got["f/plain"]
            p.kill()
            ev = w.next_event(timeout=10)
            assert (ev.kind, ev.name, ev.reason) == ("unpublished", "f/both", "disconnect")
            assert isinstance(ev.flags, F) and ev.flags == F.EPHEMERAL | F.WRITABLE
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()
    assert sorted(e.name for e in ipc.list("f/")) == ["f/plain", "f/w"]
