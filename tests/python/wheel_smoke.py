# SPDX-License-Identifier: Apache-2.0
"""An installed wheel, used as a new user would with nothing else installed (tests/pystack.sh).

Starts the dlpackd the wheel put beside this interpreter, publishes from this process and
attaches from another, through the buffer protocol alone (no numpy here).
"""
import ast
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import dlpack_ipc

exe_dir = os.path.dirname(sys.executable)
site = os.path.dirname(os.path.dirname(os.path.realpath(dlpack_ipc.__file__)))
assert site.startswith(os.path.realpath(sys.prefix)), (site, sys.prefix)
assert os.path.isfile(os.path.join(os.path.dirname(dlpack_ipc._core.__file__), "libdlpc.so.0"))
assert metadata.version("dlpack-ipc") == dlpack_ipc.__version__
daemon = shutil.which("dlpackd", path=exe_dir)
assert daemon, f"no dlpackd in {exe_dir}"
assert subprocess.run([daemon, "--version"], capture_output=True, text=True,
                      check=True).stdout.split()[1] == dlpack_ipc.__version__

tmp = tempfile.mkdtemp(prefix="dlpc-smoke-")
sock = os.path.join(tmp, "dlpackd.sock")
proc = subprocess.Popen([daemon, "--socket", sock], stdin=subprocess.DEVNULL)
try:
    deadline = time.monotonic() + 15
    while not os.path.exists(sock):
        assert proc.poll() is None, f"dlpackd exited with {proc.returncode}"
        assert time.monotonic() < deadline, "dlpackd did not listen within 15 s"
        time.sleep(0.02)
    with dlpack_ipc.Client(socket=sock) as c:
        t = c.empty((4, 8), "int32")
        m = memoryview(t)
        assert m.format == "i" and m.shape == (4, 8) and not m.readonly
        for i in range(32):
            m[i // 8, i % 8] = i * 3 - 7
        m.release()
        c.publish("smoke/x", t)
    child = subprocess.run([sys.executable, "-c", f"""
import dlpack_ipc
with dlpack_ipc.Client(socket={sock!r}) as c:
    m = memoryview(c.attach("smoke/x"))
    assert m.readonly and m.shape == (4, 8)
    print(m.tolist())
"""], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    got = ast.literal_eval(child.stdout)
    assert got == [[(r * 8 + k) * 3 - 7 for k in range(8)] for r in range(4)], got
    # the wheel's command line (python -m dlpack_ipc) lists and removes it
    ls = subprocess.run([sys.executable, "-m", "dlpack_ipc", "--socket", sock, "ls"],
                        capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0 and "smoke/x" in ls.stdout, (ls.stdout, ls.stderr)
    subprocess.run([sys.executable, "-m", "dlpack_ipc", "--socket", sock, "rm", "smoke/x"],
                   check=True, timeout=60)
finally:
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=15)
    shutil.rmtree(tmp, ignore_errors=True)
assert rc == 0, f"dlpackd exited with {rc}"
print(f"wheel smoke: dlpack_ipc {dlpack_ipc.__version__} on Python {sys.version.split()[0]}: "
      "published here, attached in another process")
