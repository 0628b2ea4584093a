#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The ML engineer's first contact, played as the README tells it:
#
#   newcomer.sh PYTHON SRC [README]
#
# (README: the markdown file to take the examples from; default SRC/README.md)
# 1. a fresh venv of PYTHON (no system site-packages), `pip install SRC` with build isolation
#    as a user installs the project, then the Python stack the README's examples use (numpy and
#    torch, pinned as in tests/python/requirements-venv.txt: an unpinned torch is a CUDA build
#    of several GB);
# 2. as an ordinary user (uid 65534 when run as root), with XDG_RUNTIME_DIR a fresh directory,
#    HOME another, and no DLPACKD_SOCKET: the daemon started as the README says (`env/bin/dlpackd
#    &`: the dlpackd pip put into the venv, on its default per-user socket);
# 3. README.md's `python run` blocks, unmodified, extracted and run in order by
#    tests/docs/run_blocks.py with the venv's interpreter in an empty directory; the README must
#    have a model example with spawned workers and a channel example among them;
#    and they leave no entry and no channel behind (`python -m dlpack_ipc ls`, `channels`);
# 4. two producers and a slow consumer (tests/docs/slow_consumer.py): 100 of 100 messages, then
#    the consumer's loop ends by itself;
# 5. the daemon stopped with SIGTERM exits 0.
#
# The venv is made anew on every run (pip's wheel cache and the CPU torch wheel on the machine's
# disk keep it short); the project is built by pip in its own temporary build directory.
set -euo pipefail
python=$1 src=$(cd "$2" && pwd) readme=${3:-$2/README.md}
req=$src/tests/python/requirements-venv.txt
# what the README's examples import, besides the project
stack=(numpy torch)
# how long one README block may run (the model example spawns four interpreters that import
# torch)
block_timeout=120
pip_q=(--quiet --disable-pip-version-check)

fail() {
	echo "newcomer: $*" >&2
	exit 1
}

[ "$python" != NOTFOUND ] || fail "no CPython 3.11 found: configure with -DDLPC_STACK_PYTHON=..."
"$python" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' ||
	fail "$python cannot run or is older than 3.11"

tmp=$(mktemp -d /tmp/dlpc-newcomer-XXXXXX)
daemon=
cleanup() {
	if [ -n "$daemon" ]; then
		kill -KILL "$daemon" 2>/dev/null || true
		wait "$daemon" 2>/dev/null || true
	fi
	rm -rf "$tmp"
}
trap cleanup EXIT
chmod 755 "$tmp"

# ---- 1. as the user installs it ----
started=$SECONDS
pins=()
for p in "${stack[@]}"; do
	pin=$(grep -E "^$p(\[[^]]*\])?==" "$req") || fail "$req pins no $p"
	pins+=("$pin")
done
"$python" -m venv "$tmp/venv"
venv=$tmp/venv
"$venv/bin/python" -c 'import sys; assert sys.prefix != sys.base_prefix' || fail "not a venv"
(cd "$src" && "$venv/bin/python" -m pip install "${pip_q[@]}" .)
"$venv/bin/python" -m pip install "${pip_q[@]}" "${pins[@]}"
echo "newcomer: venv with ${pins[*]} and the project in $((SECONDS - started)) s"
"$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null |
	grep -E '^(dlpack-ipc|numpy|torch) '

# what the user's side needs, readable by the user whatever the checkout's permissions
mkdir -p "$tmp/src/tests/docs" "$tmp/run" "$tmp/home" "$tmp/work"
cp "$readme" "$tmp/src/README.md"
cp "$src/tests/docs/run_blocks.py" "$src/tests/docs/slow_consumer.py" "$tmp/src/tests/docs/"
chmod -R a+rX "$tmp/src"

# the README has the examples this test is about
"$venv/bin/python" - "$tmp/src" <<'EOF' || fail "README.md lacks an example this test runs"
import os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tests", "docs"))
import run_blocks
blocks = [b for b in run_blocks.parse(os.path.join(sys.argv[1], "README.md"), "README.md")
          if b.kind == "python"]
need = {
    "a model shared with spawned workers (spawn, share_module/attach_module)":
        lambda t: "spawn" in t and ("share_module" in t or "attach_module" in t),
    "a channel example (channel(...))": lambda t: "channel(" in t,
}
missing = [what for what, ok in need.items() if not any(ok(b.text) for b in blocks)]
for what in missing:
    print(f"newcomer: no `python run` block of README.md is {what}", file=sys.stderr)
print(f"newcomer: README.md has {len(blocks)} `python run` block(s)")
sys.exit(1 if missing else 0)
EOF

# ---- 2. to 5. as an ordinary user ----
as_user=()
if [ "$(id -u)" -eq 0 ]; then
	chown 65534:65534 "$tmp/run" "$tmp/home" "$tmp/work"
	as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups)
fi
chmod 700 "$tmp/run"
user_env=(env -u DLPACKD_SOCKET -u PYTHONPATH -u PYTHONHOME -u VIRTUAL_ENV
	HOME="$tmp/home" XDG_RUNTIME_DIR="$tmp/run" TMPDIR="$tmp/work"
	PATH="$venv/bin:/usr/bin:/bin" PYTHONDONTWRITEBYTECODE=1)

# the daemon as the README starts it: the venv's dlpackd, in the background
(cd "$tmp/work" && exec "${as_user[@]}" "${user_env[@]}" "$venv/bin/dlpackd") \
	>"$tmp/dlpackd.log" 2>&1 &
daemon=$!
sock=$tmp/run/dlpackd.sock
for _ in $(seq 400); do
	[ -S "$sock" ] && "${as_user[@]}" "${user_env[@]}" python -c \
		'import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])' "$sock" \
		2>/dev/null && break
	kill -0 "$daemon" 2>/dev/null || { cat "$tmp/dlpackd.log" >&2; fail "dlpackd exited"; }
	sleep 0.05
done
[ -S "$sock" ] || fail "dlpackd did not make its per-user socket $sock"

status=0
(cd "$tmp/work" && "${as_user[@]}" "${user_env[@]}" python "$tmp/src/tests/docs/run_blocks.py" \
	--src "$tmp/src" --python "$venv/bin/python" --no-daemon --bare --kinds python \
	--timeout "$block_timeout" -v "$tmp/src/README.md") || status=1
# the examples leave nothing behind: `python -m dlpack_ipc ls` (as the README shows it) and
# `channels` list no entry below their header line
for what in ls channels; do
	left=$(cd "$tmp/work" && "${as_user[@]}" "${user_env[@]}" python -m dlpack_ipc "$what") || {
		echo "newcomer: FAIL python -m dlpack_ipc $what" >&2
		status=1
		continue
	}
	if [ -n "$(tail -n +2 <<<"$left")" ]; then
		echo "newcomer: FAIL README.md's examples left behind (python -m dlpack_ipc $what):" >&2
		echo "$left" >&2
		status=1
	fi
done
(cd "$tmp/work" && "${as_user[@]}" "${user_env[@]}" timeout 120 \
	python "$tmp/src/tests/docs/slow_consumer.py") || {
	echo "newcomer: FAIL two producers and a slow consumer (tests/docs/slow_consumer.py)" >&2
	status=1
}

kill -TERM "$daemon"
rc=0
wait "$daemon" || rc=$?
daemon=
if [ "$rc" -ne 0 ]; then
	echo "newcomer: dlpackd exited with status $rc on SIGTERM; its log:" >&2
	cat "$tmp/dlpackd.log" >&2
	status=1
fi
[ ! -e "$sock" ] || { echo "newcomer: dlpackd left $sock behind" >&2; status=1; }
echo "newcomer: done in $((SECONDS - started)) s"
exit $status
