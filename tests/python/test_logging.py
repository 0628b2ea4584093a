# SPDX-License-Identifier: Apache-2.0
"""What dlpackd logs during ordinary use: the refusals a client causes and expects (no such
name, name taken, a wait that expires, a read-only entry, a quota, an empty or full channel, an
argument over a limit) are debug lines, never warnings. Warnings are left for what an operator
must act on."""
import errno
import re

import numpy as np
import pytest

import dlpack_ipc


def _lines(daemon, level):
    with open(daemon.log, encoding="utf-8", errors="replace") as f:
        return [line for line in f if re.search(rf"dlpackd\[\d+\]: {level}: ", line)]


@pytest.mark.dlpackd_args("--max-entries-per-uid", "3")
def test_expected_refusals_log_at_debug(ipc, daemon):
    refused = []

    def expect(exc, call, *args, **kw):
        with pytest.raises(exc) as ei:
            call(*args, **kw)
        refused.append(ei.value)

    ipc.publish("log/a", np.zeros(4))
    expect(FileNotFoundError, ipc.attach, "log/absent", timeout=0)
    expect(FileExistsError, ipc.publish, "log/a", np.ones(4))
    expect(TimeoutError, ipc.attach, "log/late", timeout=0.05)
    expect(PermissionError, ipc.attach, "log/a", writable=True)
    ch = dlpack_ipc.channel("log/q", capacity=1, direct=False)
    expect(OSError, ch.recv, timeout=0)  # empty
    ch.send(np.zeros(1))
    expect(OSError, ch.send, np.zeros(1), timeout=0)  # full
    # refused by libdlpc before it asks dlpackd: no line in the daemon's log for this one
    with pytest.raises(ValueError):
        dlpack_ipc.channel("log/huge", capacity=1 << 20)
    ipc.publish("log/b", np.zeros(1))
    expect(OSError, ipc.publish, "log/c", np.zeros(1))  # a fourth name (log/q counts): over
    assert refused[-1].errno == errno.EDQUOT, refused[-1]

    debug = [line for line in _lines(daemon, "debug") if " refused: " in line]
    # one debug line per refusal the daemon made (the quota's...), with its reason
    assert len(debug) >= len(refused), "".join(debug)
    for what in ("no entry named 'log/absent'", "'log/a' is already published",
                 "'log/late' appeared within", "not published writable", "'log/q' is empty",
                 "'log/q' is full"):
        assert any(what in line for line in debug), (what, "".join(debug))
    assert _lines(daemon, "warning") == [], "".join(_lines(daemon, "warning"))
