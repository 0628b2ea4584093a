# SPDX-License-Identifier: Apache-2.0
"""What the bridge and fake_nixl.py take of NIXL's metadata, checked against real NIXL
(netns.py's case_nixl_metadata runs it with the bridge venv's interpreter):

    python3 nixl_metadata.py

- _nixl.metadata_agent reads the agent's name from its full and its partial metadata;
- fake_nixl.nixl_md lays a name out as NIXL does, and nixl_md_agent reads it as NIXL does;
- NIXL loads partial metadata only for an agent loaded, and a blob naming an agent loaded that
  fails to load erases that agent's entry (what fake_nixl models, and why the bridge never
  loads a blob that names another peer's agent);
- _nixl.Agents.load_partial refuses such a blob unloaded: the agent stays loaded.
Prints one line per check, "FAIL: ..." for each that failed; exits 1 if any did.
"""
import ctypes
import os
import struct
import sys

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_MODULES", "^ib")

from dlpack_ipc.bridge import _nixl  # noqa: E402
from fake_nixl import nixl_md, nixl_md_agent  # noqa: E402

failures = []


def check(cond, what):
    print(("ok: " if cond else "FAIL: ") + what, flush=True)
    if not cond:
        failures.append(what)


def loaded(nixl, name):
    return nixl.agent.check_remote_metadata(name)


def serdes(tag, value):
    """One field as NIXL's nixlSerDes writes it."""
    return tag + struct.pack("@N", len(value)) + value + b"|"


def main():
    a = _nixl.Nixl(f"md-check-a/{os.getpid()}", False)
    b = _nixl.Nixl(f"md-check-b/{os.getpid()}", False)
    buf = ctypes.create_string_buffer(4096)
    reg = a.register(ctypes.addressof(buf), len(buf))
    full, partial = a.metadata(), a.partial_metadata(reg)
    check(_nixl.metadata_agent(full) == a.name, "metadata_agent reads the full metadata's name")
    check(_nixl.metadata_agent(partial) == a.name, "and the partial metadata's")
    check(full.startswith(nixl_md(a.name, b"")), "nixl_md lays the name out as NIXL does")
    check(nixl_md_agent(full)[0] == a.name, "nixl_md_agent reads it as NIXL does")
    try:
        b.add_remote(partial)
        check(False, "NIXL refuses partial metadata of an agent not loaded")
    except Exception as e:  # NIXL's own error
        check("NOT_FOUND" in repr(e) and not loaded(b, a.name),
              f"NIXL refuses partial metadata of an agent not loaded ({e!r})")
    agents = _nixl.Agents(lambda name: b, b.name)
    check(agents.load(b, full) == (a.name, 0) and loaded(b, a.name), "a's metadata loaded")
    agents.load_partial(b, partial, a.name)
    check(loaded(b, a.name), "a's partial metadata loaded for a")
    # a's name, no connections, then memory sections that NIXL cannot load
    bad = nixl_md(a.name, serdes(b"Conns", struct.pack("@N", 0)) + serdes(b"", b"MemSection") +
                  b"sections that do not load")
    try:
        agents.load_partial(b, bad, "someone-else")
        check(False, "load_partial refuses metadata of another agent")
    except _nixl.MetadataRefused as e:
        check(loaded(b, a.name), f"load_partial refuses metadata of another agent unloaded "
              f"({e}): a stays loaded")
    try:
        b.add_remote(bad)
        check(False, "NIXL fails to load the blob")
    except Exception as e:  # NIXL's own error
        check(not loaded(b, a.name), f"NIXL, given it, erases a's entry ({e!r}), as fake_nixl "
              "models")
    a.deregister(reg)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
