#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Socket discovery across real processes and uids: where clients (dlpackctl, the Python module,
# both through libdlpc) look for dlpackd, where a daemon started without --socket listens, and
# what a client kept out of the system socket is told.
#
# The system socket must physically live in a temporary directory: the script runs itself in a
# private mount namespace, with a temporary directory bound over /run (so /run/dlpackd is a
# directory of the test's own) and a copy of /etc/group, with a `dlpack` line the test controls,
# bound over /etc/group. Nothing outside the namespace sees either.
#
# Usage: discovery.sh BUILD_DIR [PYTHON]   (PYTHON: run the Python module's part too)
set -euo pipefail
build=$(cd "$1" && pwd)
python=${2:-}
uid=65534 # the other user

if [ -z "${DLPC_DISCOVERY_NS:-}" ]; then
	if [ "$(id -u)" != 0 ]; then
		echo "SKIP: needs root (a mount namespace, and uid $uid to run clients as)"
		exit 77
	fi
	for tool in unshare setpriv; do
		if ! command -v "$tool" >/dev/null; then
			echo "SKIP: $tool (util-linux) is not installed"
			exit 77
		fi
	done
	if ! unshare --mount --propagation private true 2>/dev/null; then
		echo "SKIP: this machine allows no private mount namespace (unshare --mount failed)"
		exit 77
	fi
	DLPC_DISCOVERY_NS=1 exec unshare --mount --propagation private "$0" "$@"
fi

tmp=$(mktemp -d /tmp/dlpc-discovery-XXXXXX)
chmod 755 "$tmp"
pids=()
cleanup() {
	for p in "${pids[@]}"; do
		kill "$p" 2>/dev/null || true
	done
	for p in "${pids[@]}"; do
		wait "$p" 2>/dev/null || true
	done
	umount /etc/group 2>/dev/null || true
	umount /run 2>/dev/null || true
	rm -rf "$tmp"
}
trap cleanup EXIT

fail() {
	echo "FAIL: $*" >&2
	exit 1
}

# /run of our own, its dlpackd directory as the packaged socket unit makes it (root, 0755)
mkdir -p "$tmp/run/dlpackd"
mount --bind "$tmp/run" /run
[ -d /run/dlpackd ] && [ -z "$(ls -A /run/dlpackd)" ] || fail "/run/dlpackd is not the test's"

# the group `dlpack`: its gid if the machine has one, else a free one; no members listed
gid=$(getent group dlpack | cut -d: -f3 || true)
if [ -z "$gid" ]; then
	gid=64000
	while getent group "$gid" >/dev/null; do
		gid=$((gid - 1))
	done
fi
grep -v '^dlpack:' /etc/group >"$tmp/group"
echo "dlpack:x:$gid:" >>"$tmp/group"
chmod 644 "$tmp/group"
mount --bind "$tmp/group" /etc/group
[ "$(getent group dlpack | cut -d: -f3)" = "$gid" ] || fail "the copy of /etc/group is not in use"
user=$(getent passwd "$uid" | cut -d: -f1)
[ -n "$user" ] || fail "uid $uid has no name in /etc/passwd"

# a clean environment: no DLPACKD_SOCKET, no XDG_RUNTIME_DIR unless a case sets them
clean=(env -i PATH=/usr/bin:/bin HOME=/nonexistent LANG=C.UTF-8 DLPC_CALL_TIMEOUT_MS=10000)
as_member=(setpriv --reuid "$uid" --regid "$uid" --groups "$gid")
as_outsider=(setpriv --reuid "$uid" --regid "$uid" --clear-groups)

# Start a daemon (the command after "start"), wait until it answers on $1; its pid in $daemon.
start() {
	local sock=$1
	shift
	"$@" >>"$tmp/daemons.log" 2>&1 &
	daemon=$!
	pids+=("$daemon")
	for _ in $(seq 200); do
		if DLPACKD_SOCKET=$sock "$build/dlpackctl" ping >/dev/null 2>&1; then
			return 0
		fi
		kill -0 "$daemon" 2>/dev/null || break
		sleep 0.05
	done
	cat "$tmp/daemons.log" >&2
	fail "no daemon answered on $sock"
}

# "dlpackctl ping" as given (a prefix command and the environment), expecting the daemon $1 on
# socket $2 to answer; and the Python module's default client, where it is built, the same.
expect_ping() {
	local pid=$1 sock=$2 out
	shift 2
	out=$("$@" "$build/dlpackctl" ping 2>&1) || fail "ping failed: $out"
	case $out in
	"dlpackd pid $pid answers on $sock,"*) ;;
	*) fail "expected dlpackd pid $pid on $sock, got: $out" ;;
	esac
	[ -n "$python" ] || return 0
	out=$("$@" PYTHONPATH="$build/python" "$python" -c '
import dlpack_ipc
print(dlpack_ipc.stat()["daemon_pid"])' 2>&1) || fail "Python: $out"
	[ "$out" = "$pid" ] || fail "Python reached daemon '$out', not pid $pid"
}

# --- the system daemon: root, no --socket, the socket given to the group `dlpack` ---
start /run/dlpackd/dlpackd.sock "${clean[@]}" "$build/dlpackd" --socket-group dlpack
system=$daemon
sys_sock=/run/dlpackd/dlpackd.sock
[ -S $sys_sock ] || fail "root's daemon without --socket did not listen on $sys_sock"
[ "$(stat -c %g $sys_sock)" = "$gid" ] || fail "$sys_sock is not the group dlpack's"

# a per-user runtime directory with no socket in it
xdg=$tmp/xdg
mkdir -m 700 "$xdg"
chown "$uid:$uid" "$xdg"

echo "a member of dlpack with XDG_RUNTIME_DIR and no DLPACKD_SOCKET reaches the system daemon"
expect_ping $system $sys_sock "${as_member[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg"
"${as_member[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg" "$build/dlpackctl" ls >/dev/null ||
	fail "ls as a member"
if [ -n "$python" ]; then
	out=$("${as_member[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg" PYTHONPATH="$build/python" \
		"$python" -c '
import numpy as np, dlpack_ipc
dlpack_ipc.publish("discovery/x", np.arange(3.0), ephemeral=True)
t = np.from_dlpack(dlpack_ipc.attach("discovery/x"))
print(dlpack_ipc.stat()["daemon_pid"], t.tolist())
' 2>&1) || fail "Python as a member: $out"
	[ "$out" = "$system [0.0, 1.0, 2.0]" ] || fail "Python as a member: $out"
fi

echo "one outside the group is told the socket's group and how to join it"
if out=$("${as_outsider[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg" "$build/dlpackctl" ping 2>&1); then
	fail "an outsider reached the daemon: $out"
fi
for want in "$xdg/dlpackd.sock" "No such file or directory" "$sys_sock" "Permission denied" \
	"group 'dlpack'" "sudo usermod -aG dlpack \$USER" "log in again"; do
	[[ $out == *"$want"* ]] || fail "outsider's message lacks '$want': $out"
done
if [ -n "$python" ]; then
	out=$("${as_outsider[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg" PYTHONPATH="$build/python" \
		"$python" -c '
import dlpack_ipc
try:
    dlpack_ipc.stat()
except PermissionError as e:
    print("PermissionError:", e)
' 2>&1) || fail "Python as an outsider: $out"
	for want in "PermissionError:" "$sys_sock" "group 'dlpack'" "usermod -aG dlpack"; do
		[[ $out == *"$want"* ]] || fail "Python outsider's message lacks '$want': $out"
	done
fi

echo "a member since the session began is told to log in again (its group of 5000 members)"
# (rewritten in place: the bind mount holds the file's inode); the members take ~60 KB, past the
# first buffers libdlpc offers getgrgid_r()
members=$(seq -f "member%g" 5000 | paste -sd,)
sed "s/^dlpack:x:$gid:\$/dlpack:x:$gid:$members,$user/" "$tmp/group" >"$tmp/group.new"
cat "$tmp/group.new" >"$tmp/group"
out=$("${as_outsider[@]}" "${clean[@]}" "$build/dlpackctl" ping 2>&1) && fail "reached: $out"
[[ $out == *"log in again (or run 'newgrp dlpack')"* ]] || fail "no 'log in again': $out"
[[ $out == *"usermod"* ]] && fail "told to join a group it is in: $out"
[[ $out == *'$XDG_RUNTIME_DIR is not set'* ]] || fail "no word of XDG_RUNTIME_DIR: $out"

echo "a per-user daemon (not root, no --socket) listens on \$XDG_RUNTIME_DIR/dlpackd.sock"
start "$xdg/dlpackd.sock" "${as_outsider[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg" \
	"$build/dlpackd"
own=$daemon
[ "$(stat -c %u "$xdg/dlpackd.sock")" = "$uid" ] || fail "per-user socket not the user's"

echo "the per-user socket, where it exists, wins over the system socket"
expect_ping $own "$xdg/dlpackd.sock" "${as_member[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg"

echo "\$DLPACKD_SOCKET wins over both"
start "$tmp/third.sock" "${clean[@]}" "$build/dlpackd" --socket "$tmp/third.sock" \
	--socket-mode 0666
third=$daemon
expect_ping $third "$tmp/third.sock" "${as_member[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg" \
	DLPACKD_SOCKET="$tmp/third.sock"
echo "... and is the only place tried"
out=$("${as_member[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg" DLPACKD_SOCKET="$tmp/none.sock" \
	"$build/dlpackctl" ping 2>&1) && fail "reached: $out"
[[ $out == *"$tmp/none.sock"* && $out != *"$sys_sock"* && $out != *"$xdg"* ]] ||
	fail "tried more than \$DLPACKD_SOCKET: $out"

echo "root follows the same rule: the per-user socket if it exists, else the system socket"
rootxdg=$tmp/rootxdg
mkdir -m 700 "$rootxdg"
expect_ping $system $sys_sock "${clean[@]}" XDG_RUNTIME_DIR="$rootxdg"
start "$rootxdg/dlpackd.sock" "${clean[@]}" "$build/dlpackd" --socket "$rootxdg/dlpackd.sock"
expect_ping $daemon "$rootxdg/dlpackd.sock" "${clean[@]}" XDG_RUNTIME_DIR="$rootxdg"

echo "a stale per-user socket (nobody listens) is passed over for the system socket"
kill "$own"
wait "$own" 2>/dev/null || true
if [ -n "$python" ]; then
	rm -f "$xdg/dlpackd.sock"
	"${as_outsider[@]}" "$python" -c '
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
' "$xdg/dlpackd.sock"
	[ -S "$xdg/dlpackd.sock" ] || fail "no stale socket made"
	expect_ping $system $sys_sock "${as_member[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg"
	out=$("${as_outsider[@]}" "${clean[@]}" XDG_RUNTIME_DIR="$xdg" \
		"$build/dlpackctl" ping 2>&1) && fail "reached: $out"
	[[ $out == *"$xdg/dlpackd.sock"*"Connection refused"*"$sys_sock"*"Permission denied"* ]] ||
		fail "stale socket not listed: $out"
fi

echo "PASS"
