#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The Debian packages, built and installed as an operator gets them.
#
#   package.sh build SRC OUT      build the .debs from a copy of SRC into OUT (dpkg-buildpackage,
#                                 the unit suites included), then lintian: any error fails
#   package.sh check SRC [DEBS]   build them into a temporary directory (or take the .debs in
#                                 DEBS), then install them with dpkg into a throwaway copy of
#                                 this machine and check them there (the ctest test "package")
#
# The copy is an overlay of / in a private mount and PID namespace, its changes on a tmpfs that
# goes with the namespace: dpkg, the maintainer scripts and the checks run there as root and
# nothing on this machine changes. There:
#   - the packages install, each file is where Debian puts it and belongs to its package;
#   - the postinst created the user and groups from the sysusers file and enabled
#     dlpackd.socket; systemd-analyze verify passes on the installed units with no message;
#   - the installed dlpackd, started by hand as the dlpackd user on a temporary socket (no
#     systemd runs here), serves clients that run as an unprivileged member of the dlpack group:
#     the installed Python module (/usr/bin/python3 -I, no PYTHONPATH) and a C program built with
#     pkg-config dlpc and with find_package(dlpc) (shared and static) each publish in one process
#     and attach what the others published; the installed dlpackctl lists both entries;
#   - the package version is the one dlpackd, pkg-config and the Python module report;
#   - purging the packages leaves none of their files.
# Installing needs root: as another user, that step runs through sudo -n.
set -euo pipefail

packages=(dlpackd dlpackctl libdlpc0 libdlpc-dev python3-dlpack-ipc)

die() {
	echo "package: $*" >&2
	exit 1
}

# Copy the source tree without what .gitignore leaves out (build directories, debian/'s
# build output), so that the package is built from the sources alone.
copy_source() {
	local src=$1 dest=$2
	mkdir -p "$dest"
	if git -C "$src" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
		git -C "$src" ls-files -z --cached --others --exclude-standard |
			(cd "$src" && tar --null -T - -c) | tar -x -C "$dest"
	else
		tar -C "$src" --exclude-vcs --exclude-vcs-ignores -c . | tar -x -C "$dest"
	fi
	[ -f "$dest/debian/control" ] || die "no debian/control in $src"
}

# dpkg-buildpackage in a copy of SRC; the .debs and the .changes end up in OUT.
build() {
	local src=$1 out=$2 tools=(dpkg-buildpackage dh dh_python3 lintian) t work jobs
	for t in "${tools[@]}"; do
		command -v "$t" >/dev/null ||
			die "$t is missing (scripts/dev test installs debhelper, dh-python and lintian)"
	done
	mkdir -p "$out"
	out=$(cd "$out" && pwd)
	# what an earlier build left there, perhaps of another version
	rm -f "$out"/*.deb "$out"/*.changes "$out"/*.buildinfo "$out/build.log"
	work=$(mktemp -d /tmp/dlpc-deb-XXXXXX)
	# shellcheck disable=SC2064 # $work is fixed now
	trap "rm -rf '$work'" RETURN
	copy_source "$src" "$work/src"
	jobs=$(nproc)
	echo "building the packages (dpkg-buildpackage, parallel=$jobs; log: $out/build.log)"
	if ! (cd "$work/src" && DEB_BUILD_OPTIONS="parallel=$jobs" \
		dpkg-buildpackage -us -uc -b >"$out/build.log" 2>&1); then
		tail -n 80 "$out/build.log" >&2
		die "dpkg-buildpackage failed: the end of its log is above"
	fi
	grep -A20 '^Test project' "$out/build.log" | sed -n '/tests passed/p'
	cp "$work"/*.deb "$work"/*.changes "$work"/*.buildinfo "$out/"
	echo "lintian (any error fails):"
	lintian --fail-on error --info "$out"/*.changes || die "lintian reports errors"
	ls "$out"/*.deb
}

# Mount the overlay, run the checks inside it with chroot. Runs as PID 1 of its own PID
# namespace, so every process it starts (the daemon too) ends with it.
overlay() {
	local share=$1 ovl root
	ovl=$(dirname "$share")/overlay
	mkdir -p "$ovl"
	mount -t tmpfs -o mode=0755 dlpc-package "$ovl"
	mkdir "$ovl/upper" "$ovl/work" "$ovl/root"
	mount -t overlay -o "lowerdir=/,upperdir=$ovl/upper,workdir=$ovl/work" dlpc-package \
		"$ovl/root" || die "cannot mount an overlay of / (needs root and overlayfs)"
	root=$ovl/root
	mount -t proc proc "$root/proc"
	mount --rbind /sys "$root/sys"
	mount --rbind /dev "$root/dev"
	# no service manager in here: the maintainer scripts see none and start nothing
	mount -t tmpfs -o mode=0755 run "$root/run"
	mount -t tmpfs -o mode=1777 tmp "$root/tmp"
	mkdir "$root/tmp/share"
	mount --bind "$share" "$root/tmp/share"
	chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 \
		HOME=/root /bin/bash /tmp/share/package.sh inside /tmp/share
}

# The checks, as root inside the overlay; SHARE holds debs/, the test program and this script.
inside() {
	local share=$1 ma debs=() p f owner version sock run daemon_pid py user=nobody deps
	ma=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
	for p in "${packages[@]}"; do
		f=$(compgen -G "$share/debs/${p}_*.deb") || die "no ${p}_*.deb in the packages"
		debs+=("$f")
	done
	echo "== dpkg -i ${debs[*]##*/}"
	DEBIAN_FRONTEND=noninteractive dpkg -i "${debs[@]}" || die "dpkg -i failed"
	for p in "${packages[@]}"; do
		[ "$(dpkg-query -W -f='${db:Status-Status}' "$p")" = installed ] ||
			die "$p is not installed"
	done

	echo "== files and their packages"
	local files=(
		"/usr/sbin/dlpackd dlpackd"
		"/lib/systemd/system/dlpackd.service dlpackd"
		"/lib/systemd/system/dlpackd.socket dlpackd"
		"/usr/lib/sysusers.d/dlpackd.conf dlpackd"
		"/usr/lib/sysusers.d/dlpackd-bridge.conf dlpackd"
		"/lib/systemd/system/dlpackd-bridge.service dlpackd"
		"/usr/share/man/man8/dlpackd.8.gz dlpackd"
		"/usr/bin/dlpackctl dlpackctl"
		"/usr/share/man/man1/dlpackctl.1.gz dlpackctl"
		"/usr/lib/$ma/libdlpc.so.0 libdlpc0"
		"/usr/include/dlpc/dlpc.h libdlpc-dev"
		"/usr/include/dlpc/dlpack1.h libdlpc-dev"
		"/usr/lib/$ma/libdlpc.so libdlpc-dev"
		"/usr/lib/$ma/libdlpc.a libdlpc-dev"
		"/usr/lib/$ma/pkgconfig/dlpc.pc libdlpc-dev"
		"/usr/lib/$ma/cmake/dlpc/dlpcConfig.cmake libdlpc-dev"
		"/usr/share/man/man3/dlpc.3.gz libdlpc-dev"
		"/usr/lib/python3/dist-packages/dlpack_ipc/__init__.py python3-dlpack-ipc"
		"/usr/lib/python3/dist-packages/dlpack_ipc/__init__.pyi python3-dlpack-ipc"
		"/usr/lib/python3/dist-packages/dlpack_ipc/__main__.py python3-dlpack-ipc"
		"/usr/lib/python3/dist-packages/dlpack_ipc/py.typed python3-dlpack-ipc"
		"/usr/lib/python3/dist-packages/dlpack_ipc/torch.py python3-dlpack-ipc"
		"/usr/lib/python3/dist-packages/dlpack_ipc/_core.abi3.so python3-dlpack-ipc"
	)
	for f in "${files[@]}"; do
		set -- $f
		[ -e "$1" ] || die "$1 is not installed"
		owner=$(dpkg-query -S "$1" | sed 's/:.*//')
		[ "$owner" = "$2" ] || die "$1 belongs to '$owner', not $2"
		echo "  $1 ($2)"
	done
	# the extension uses the packaged library, not a copy of its own
	ext=/usr/lib/python3/dist-packages/dlpack_ipc/_core.abi3.so
	loads=$(ldd "$ext" | awk '$1 == "libdlpc.so.0" { print $3 }')
	[ -n "$loads" ] && [ "$(readlink -f "$loads")" = "$(readlink -f "/usr/lib/$ma/libdlpc.so.0")" ] ||
		die "dlpack_ipc/_core.abi3.so loads '${loads:-no libdlpc.so.0}', not /usr/lib/$ma/libdlpc.so.0"
	dpkg-query -W -f='${Depends}' python3-dlpack-ipc | grep -q libdlpc0 ||
		die "python3-dlpack-ipc does not depend on libdlpc0"
	# CPython 3.11 at least (the module's stable ABI, and its Python code): the source's
	# X-Python3-Version says so to dh_python3, whose own guess for an abi3 module is 3~
	deps=$(dpkg-query -W -f='${Depends}' python3-dlpack-ipc)
	[[ $deps == *"python3 (>= 3.11)"* && $deps != *"(>= 3~)"* ]] ||
		die "python3-dlpack-ipc depends on '$deps': not on python3 (>= 3.11)"
	echo "  python3-dlpack-ipc: Depends: $deps"
	[ "$(readelf -d "/usr/lib/$ma/libdlpc.so.0" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')" = \
		libdlpc.so.0 ] || die "the SONAME of libdlpc.so.0 is not libdlpc.so.0 (libdlpc0)"

	echo "== maintainer scripts and units"
	getent passwd dlpackd >/dev/null || die "postinst created no user dlpackd"
	getent group dlpackd >/dev/null || die "postinst created no group dlpackd"
	getent group dlpack >/dev/null || die "postinst created no group dlpack"
	getent passwd dlpackd-bridge >/dev/null || die "postinst created no user dlpackd-bridge"
	id -nG dlpackd-bridge | grep -qw dlpack || die "the user dlpackd-bridge is not in the group dlpack"
	echo "  users dlpackd and dlpackd-bridge, groups dlpackd and dlpack (sysusers)"
	[ "$(readlink /etc/systemd/system/sockets.target.wants/dlpackd.socket)" = \
		/lib/systemd/system/dlpackd.socket ] || die "postinst did not enable dlpackd.socket"
	echo "  dlpackd.socket enabled (sockets.target.wants)"
	local out
	out=$(SYSTEMD_LOG_LEVEL=notice systemd-analyze verify /lib/systemd/system/dlpackd.socket \
		/lib/systemd/system/dlpackd.service 2>&1) ||
		{ echo "$out" >&2; die "systemd-analyze verify failed"; }
	# verify reports unknown or bad settings as messages without failing: any message fails
	[ -z "$out" ] || { echo "$out" >&2; die "systemd-analyze verify complained"; }
	echo "  systemd-analyze verify: dlpackd.socket and dlpackd.service pass"

	version=$(dpkg-query -W -f='${Version}' dlpackd)
	[ "$(dlpackd --version | awk '{ print $2 }')" = "$version" ] ||
		die "dlpackd --version says '$(dlpackd --version)', the package is $version"
	[ "$(pkg-config --modversion dlpc)" = "$version" ] ||
		die "pkg-config dlpc says $(pkg-config --modversion dlpc), the package is $version"

	echo "== building against libdlpc-dev"
	local build=/tmp/consumer
	mkdir -p "$build"
	# shellcheck disable=SC2046 # word splitting of the flags is wanted
	cc -std=c11 -Wall -Werror -o "$build/consumer_pc" "$share/consumer/consumer.c" \
		$(pkg-config --cflags --libs dlpc) || die "cannot build against pkg-config dlpc"
	cmake -S "$share/consumer" -B "$build/cmake" -DCMAKE_BUILD_TYPE=Release \
		>"$build/cmake.log" 2>&1 || { cat "$build/cmake.log" >&2; die "find_package(dlpc) failed"; }
	cmake --build "$build/cmake" >"$build/build.log" 2>&1 ||
		{ cat "$build/build.log" >&2; die "the find_package(dlpc) build failed"; }
	for p in "$build/consumer_pc" "$build/cmake/consumer"; do
		f=$(ldd "$p" | sed -n 's/.*libdlpc\.so\.0 => \([^ ]*\).*/\1/p')
		[ -n "$f" ] && [ "$(readlink -f "$f")" = "$(readlink -f "/usr/lib/$ma/libdlpc.so.0")" ] ||
			{ ldd "$p" >&2; die "$p does not load the installed libdlpc.so.0"; }
	done
	! ldd "$build/cmake/consumer_static" | grep libdlpc >/dev/null ||
		die "consumer_static links libdlpc dynamically"
	chmod -R a+rX "$build"
	echo "  consumer_pc (pkg-config), consumer and consumer_static (find_package)"

	echo "== the installed daemon as user dlpackd, clients as $user in group dlpack"
	run=/tmp/dlpackd
	mkdir -m 0750 "$run"
	chown dlpackd:dlpack "$run"
	sock=$run/dlpackd.sock
	# (a member of dlpack, as it must be to give the socket to that group)
	setpriv --reuid=dlpackd --regid=dlpackd --groups=dlpack \
		/usr/sbin/dlpackd --socket="$sock" --socket-group=dlpack 2>/tmp/dlpackd.log &
	daemon_pid=$!
	# ready once it answers; it may also have stopped, saying why
	for _ in $(seq 200); do
		kill -0 "$daemon_pid" 2>/dev/null || break
		DLPACKD_SOCKET=$sock dlpackctl ping >/dev/null 2>&1 && break
		sleep 0.1
	done
	DLPACKD_SOCKET=$sock dlpackctl ping ||
		{ cat /tmp/dlpackd.log >&2; die "the installed dlpackd does not answer on $sock"; }
	as_user() {
		setpriv --reuid="$user" --regid=nogroup --groups=dlpack \
			env -i PATH=/usr/bin:/bin HOME=/nonexistent DLPACKD_SOCKET="$sock" "$@"
	}
	# each command a process of its own: publish from C and from Python, then attach both
	# from the C programs and from Python
	as_user "$build/consumer_pc" publish pkg/c
	py=/usr/bin/python3
	as_user "$py" -I -c '
import sys, numpy as np, dlpack_ipc
want = "/usr/lib/python3/dist-packages/dlpack_ipc/__init__.py"
assert dlpack_ipc.__file__ == want, dlpack_ipc.__file__
assert dlpack_ipc.libdlpc_version == sys.argv[1], dlpack_ipc.libdlpc_version
gen = dlpack_ipc.publish("pkg/py", np.arange(1000, dtype=np.int32) * 7 - 3)
print("publish pkg/py: generation", gen, "from", dlpack_ipc.__file__)
' "$version"
	for p in "$build/consumer_pc" "$build/cmake/consumer" "$build/cmake/consumer_static"; do
		as_user "$p" attach pkg/c
		as_user "$p" attach pkg/py
	done
	as_user "$py" -I -c '
import numpy as np, dlpack_ipc
for name in ("pkg/c", "pkg/py"):
    a = np.from_dlpack(dlpack_ipc.attach(name, timeout=5))
    assert a.dtype == np.int32 and (a == np.arange(1000, dtype=np.int32) * 7 - 3).all(), name
    print("attach", name, "from python: 1000 int32 as published")
'
	[ "$(as_user dlpackctl ls pkg/ --json | "$py" -I -c \
		'import json, sys; print(sorted(e["name"] for e in json.load(sys.stdin)))')" = \
		"['pkg/c', 'pkg/py']" ] || die "dlpackctl ls does not list pkg/c and pkg/py"
	echo "  dlpackctl ls: pkg/c, pkg/py"
	kill -TERM "$daemon_pid"
	local status=0
	wait "$daemon_pid" || status=$?
	[ "$status" -eq 0 ] || { cat /tmp/dlpackd.log >&2; die "dlpackd exited with status $status"; }
	[ ! -e "$sock" ] || die "dlpackd left $sock behind"

	echo "== dpkg --purge"
	DEBIAN_FRONTEND=noninteractive dpkg --purge "${packages[@]}" || die "dpkg --purge failed"
	for f in "${files[@]}"; do
		set -- $f
		[ ! -e "$1" ] || die "$1 is still there after the purge"
	done
	[ ! -e /usr/lib/python3/dist-packages/dlpack_ipc ] ||
		die "/usr/lib/python3/dist-packages/dlpack_ipc is still there after the purge"
	[ ! -L /etc/systemd/system/sockets.target.wants/dlpackd.socket ] ||
		die "dlpackd.socket is still enabled after the purge"
	echo "  no file of the packages left"
}

check() {
	local src=$1 debs=${2:-} tmp start sudo=()
	start=$(date +%s)
	src=$(cd "$src" && pwd)
	tmp=$(mktemp -d /tmp/dlpc-package-XXXXXX)
	# shellcheck disable=SC2064 # $tmp is fixed now
	trap "rm -rf '$tmp'" EXIT
	mkdir "$tmp/share" "$tmp/share/debs" "$tmp/share/consumer"
	if [ -z "$debs" ]; then
		build "$src" "$tmp/share/debs"
	else
		cp "$debs"/*.deb "$tmp/share/debs/"
	fi
	cp "$src/tests/install/consumer.c" "$src/tests/install/CMakeLists.txt" "$tmp/share/consumer/"
	cp "$0" "$tmp/share/package.sh"
	chmod -R a+rX "$tmp/share"
	command -v unshare >/dev/null || die "unshare (util-linux) is missing"
	if [ "$(id -u)" -ne 0 ]; then
		sudo=(sudo -n)
		sudo -n true 2>/dev/null ||
			die "installing the packages needs root: run as root, or where sudo -n works"
	fi
	"${sudo[@]}" unshare --mount --pid --fork --propagation private \
		/bin/bash "$tmp/share/package.sh" overlay "$tmp/share"
	echo "package: built, installed, served and purged in $(($(date +%s) - start)) s"
}

case "${1:-}" in
build) build "$2" "$3" ;;
check) check "$2" "${3:-}" ;;
overlay) overlay "$2" ;;
inside) inside "$2" ;;
*)
	sed -n '3,9p' "$0" >&2
	exit 2
	;;
esac
