#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The installed systemd files, checked by systemd's own tools (no running systemd needed).
#   systemd.sh verify   BUILD PREFIX SBINDIR UNITDIR SYSUSERSDIR MANDIR
#   systemd.sh security BUILD PREFIX SBINDIR UNITDIR SYSUSERSDIR MANDIR
# verify: systemd-analyze verify passes on both units, with man:dlpackd(8) resolved against the
# installed man pages, and systemd-sysusers accepts the sysusers.d snippet.
# security: systemd-analyze security --offline rates the service at most DLPC_MAX_EXPOSURE.
set -euo pipefail
mode=$1 build=$2 prefix=$3 sbindir=$4 unitdir=$5 sysusersdir=$6 mandir=$7
# the highest exposure level (0.0 best, 10.0 worst) the service may have
DLPC_MAX_EXPOSURE=2.0

full() { case $1 in /*) echo "$1" ;; *) echo "$prefix/$1" ;; esac; }
tmp=$(mktemp -d /tmp/dlpc-systemd-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
DESTDIR=$tmp/root cmake --install "$build" >"$tmp/install.log"
units=$tmp/root$(full "$unitdir")
daemon=$(full "$sbindir")/dlpackd

case $mode in
verify)
	# the unit starts the daemon where the install put it...
	grep -qx "ExecStart=$daemon" "$units/dlpackd.service" ||
		{ echo "ExecStart of dlpackd.service is not $daemon" >&2; exit 1; }
	[ -x "$tmp/root$daemon" ] || { echo "no $daemon in the install tree" >&2; exit 1; }
	# ...which exists only under DESTDIR: verify copies that say so (nothing else changes)
	mkdir "$tmp/units"
	sed "s|^ExecStart=$daemon|ExecStart=$tmp/root$daemon|" "$units/dlpackd.service" \
		>"$tmp/units/dlpackd.service"
	cp "$units/dlpackd.socket" "$tmp/units/"
	out=$(MANPATH=$tmp/root$(full "$mandir") SYSTEMD_LOG_LEVEL=notice \
		systemd-analyze verify "$tmp/units/dlpackd.socket" "$tmp/units/dlpackd.service" 2>&1) ||
		{ echo "$out" >&2; echo "systemd-analyze verify failed" >&2; exit 1; }
	# verify reports unknown or bad settings as messages without failing: any message fails
	[ -z "$out" ] || { echo "$out" >&2; echo "systemd-analyze verify complained" >&2; exit 1; }
	mkdir "$tmp/sysroot"
	systemd-sysusers --root="$tmp/sysroot" --dry-run \
		"$tmp/root$(full "$sysusersdir")/dlpackd.conf" \
		"$tmp/root$(full "$sysusersdir")/dlpackd-bridge.conf" 2>&1 | tee "$tmp/sysusers.log"
	grep -q "Creating user 'dlpackd'" "$tmp/sysusers.log"
	grep -q "Creating group 'dlpack'" "$tmp/sysusers.log"
	# the bridge's static user, the one its unit names (its replicas outlive the service)
	grep -q "Creating user 'dlpackd-bridge'" "$tmp/sysusers.log"
	grep -qx "User=dlpackd-bridge" "$units/dlpackd-bridge.service" ||
		{ echo "dlpackd-bridge.service does not run as User=dlpackd-bridge" >&2; exit 1; }
	! grep -q "^DynamicUser=" "$units/dlpackd-bridge.service" ||
		{ echo "dlpackd-bridge.service has DynamicUser=" >&2; exit 1; }
	# its replica ledger survives restarts: the state directory (--state-dir's default)
	grep -qx "StateDirectory=dlpackd-bridge" "$units/dlpackd-bridge.service" ||
		{ echo "dlpackd-bridge.service has no StateDirectory=dlpackd-bridge" >&2; exit 1; }
	grep -qx "StateDirectoryMode=0700" "$units/dlpackd-bridge.service" ||
		{ echo "dlpackd-bridge.service's state directory is not mode 0700" >&2; exit 1; }
	echo "verify: dlpackd.socket and dlpackd.service pass"
	# the bridge's unit (its interpreter is the build's DLPC_BRIDGE_PYTHON, outside DESTDIR)
	out=$(MANPATH=$tmp/root$(full "$mandir") SYSTEMD_LOG_LEVEL=notice \
		systemd-analyze verify "$tmp/units/dlpackd.socket" \
		"$units/dlpackd-bridge.service" 2>&1) ||
		{ echo "$out" >&2; echo "systemd-analyze verify failed (bridge)" >&2; exit 1; }
	[ -z "$out" ] || { echo "$out" >&2; echo "systemd-analyze verify complained (bridge)" >&2; exit 1; }
	echo "verify: dlpackd-bridge.service passes"
	;;
security)
	out=$(systemd-analyze security --offline=true "$units/dlpackd.service" 2>&1) ||
		{ echo "$out" >&2; exit 1; }
	echo "$out" | grep -v '✓' || true
	level=$(echo "$out" | sed -n 's/.*Overall exposure level for dlpackd.service: \([0-9.]*\).*/\1/p')
	[ -n "$level" ] || { echo "no exposure level in the output" >&2; exit 1; }
	echo "exposure level $level (at most $DLPC_MAX_EXPOSURE)"
	awk -v l="$level" -v m="$DLPC_MAX_EXPOSURE" 'BEGIN { exit !(l <= m) }'
	out=$(systemd-analyze security --offline=true "$units/dlpackd-bridge.service" 2>&1) ||
		{ echo "$out" >&2; exit 1; }
	level=$(echo "$out" | sed -n 's/.*Overall exposure level for dlpackd-bridge.service: \([0-9.]*\).*/\1/p')
	echo "bridge: exposure level ${level:-missing} (at most $DLPC_MAX_EXPOSURE)"
	[ -n "$level" ] && awk -v l="$level" -v m="$DLPC_MAX_EXPOSURE" 'BEGIN { exit !(l <= m) }'
	;;
*)
	echo "usage: systemd.sh verify|security BUILD PREFIX SBINDIR UNITDIR SYSUSERSDIR MANDIR" >&2
	exit 2
	;;
esac
