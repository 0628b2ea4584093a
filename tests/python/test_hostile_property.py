# SPDX-License-Identifier: Apache-2.0
"""No object crashes the module (issue 27, point 9): a property test with hypothesis over
publish, publish_dict, Channel.send, attach's modes and arguments, and empty() and
SharedTensor.__dlpack__'s arguments. Each surface runs in an
interpreter of its own (hostile_worker.py, which says what it draws and what it checks), so that
a SIGSEGV is this test's failure, reported with the example that caused it, not pytest's end.

Examples per surface: DLPC_HYPOTHESIS_EXAMPLES (default 300; the draws are derandomized, so a
run repeats the last). Debian's python3-hypothesis, or the venv's hypothesis (requirements-venv.txt).
"""
import os
import subprocess
import sys

import pytest

from conftest import _child_env

pytest.importorskip("hypothesis", reason="skipped: hypothesis is not installed "
                    "(Debian: python3-hypothesis; pip: hypothesis)")

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hostile_worker.py")
_EXAMPLES = int(os.environ.get("DLPC_HYPOTHESIS_EXAMPLES", "300"))


@pytest.mark.parametrize("surface", ["publish", "publish_dict", "send", "attach", "tensor"])
def test_no_object_crashes_the_module(daemon, surface):
    cp = subprocess.run([sys.executable, _WORKER, surface, str(_EXAMPLES)], env=_child_env(),
                        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    if cp.returncode < 0:
        last = cp.stderr.strip().splitlines()[-1:] or ["(nothing drawn)"]
        pytest.fail(f"the worker died of signal {-cp.returncode} on: {last[0]}\n"
                    f"--- stderr (last 4000 chars) ---\n{cp.stderr[-4000:]}", pytrace=False)
    assert cp.returncode == 0, (f"exit status {cp.returncode}\n--- stdout ---\n{cp.stdout}\n"
                                f"--- stderr (last 6000 chars) ---\n{cp.stderr[-6000:]}")
    assert f"{surface}: {_EXAMPLES} examples, no crash" in cp.stdout, cp.stdout
    # the daemon outlived every example too: the fixture checks it stops cleanly
