# SPDX-License-Identifier: Apache-2.0
"""A peer bridge that asks for a name's layout and then never takes it (tests/bridge/netns.py).

    python3 fake_importer.py ADDR:PORT TOKEN_FILE NAME [COUNT]

Authenticates, exchanges NIXL metadata as a bridge does, sends `get NAME` COUNT times (1),
prints "LEASE <id>" for each lease it got and "REFUSED <errno>" for each refusal, then sleeps
with the connection open until it is killed: the exporter must end the leases after its TTL, or
at once when this process dies.
"""
import base64
import os
import sys
import time

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_MODULES", "^ib")

from dlpack_ipc.bridge import _server, _wire  # noqa: E402


def main():
    addr, token_file, name = sys.argv[1:4]
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    host, port = _server.parse_addr(addr, "address")
    nixl = _server.Nixl(f"fake-importer/{time.time_ns()}", False)
    import socket
    sock = socket.create_connection((host, port), timeout=10)
    _wire.auth_client(sock, _wire.read_token(token_file), nixl.name, "exporter")
    nixl.add_remote(_wire.metadata(_wire.recv(sock, time.monotonic() + 10)))
    _wire.send(sock, {"op": "metadata", "metadata": base64.b64encode(nixl.metadata()).decode()})
    for i in range(count):
        _wire.send(sock, {"op": "get", "id": i + 1, "name": name})
        f = _wire.recv(sock, time.monotonic() + 10)
        if f["op"] == "layout":
            print(f"LEASE {f['lease']}", flush=True)
        else:
            print(f"REFUSED {f.get('errno')}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
