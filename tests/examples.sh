#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The example programs (examples/, docs/c.md), run for real: publish in one process, attach in
# another.
# Usage: examples.sh DLPACKD PUBLISH ATTACH
set -euo pipefail
dir=$(mktemp -d /tmp/dlpc-example-XXXXXX)
export DLPACKD_SOCKET=$dir/dlpackd.sock
"$1" >"$dir/log" 2>&1 &
daemon=$!
trap 'kill $daemon 2>/dev/null; wait $daemon 2>/dev/null; rm -rf "$dir"' EXIT
# the socket file exists a moment before the daemon listens on it: wait until it accepts
listening() {
	/usr/bin/python3 -c 'import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])' \
		"$DLPACKD_SOCKET" 2>/dev/null
}
for _ in $(seq 200); do listening && break; sleep 0.05; done
"$2" demo/weights
out=$("$3" demo/weights)
echo "$out"
[ "$out" = "demo/weights generation 1, shape [2, 3]: 1 2 3 4 5 6" ]
kill -TERM $daemon
wait $daemon
trap 'rm -rf "$dir"' EXIT
[ ! -e "$DLPACKD_SOCKET" ]
