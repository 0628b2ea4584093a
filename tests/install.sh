#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# cmake --install into a temporary DESTDIR, then build a program from outside the project
# (tests/install/) against the installed tree twice: with pkg-config, and with
# find_package(dlpc CONFIG) for the shared and the static library. Run them against the
# installed dlpackd: each publishes in one process and the others attach and check the bytes.
# Then the build tree's compile lines (dlpc-uninstalled.pc, and -I/-L/-rpath by hand), and
# `scripts/dev install PREFIX` followed by the documented pkg-config line.
# Usage: install.sh BUILD SRC PREFIX SBINDIR LIBDIR INCLUDEDIR MANDIR UNITDIR SYSUSERSDIR [PYDIR]
set -euo pipefail
build=$1 src=$2 prefix=$3 sbindir=$4 libdir=$5 includedir=$6 mandir=$7 unitdir=$8
sysusersdir=$9 pydir=${10:-} bindir=${11:-bin}

full() { case $1 in /*) echo "$1" ;; *) echo "$prefix/$1" ;; esac; }
tmp=$(mktemp -d /tmp/dlpc-install-XXXXXX)
daemon_pid=
cleanup() {
	[ -z "$daemon_pid" ] || kill "$daemon_pid" 2>/dev/null || true
	rm -rf "$tmp"
}
trap cleanup EXIT
dest=$tmp/root
DESTDIR=$dest cmake --install "$build" >"$tmp/install.log"
lib=$dest$(full "$libdir")

echo "installed under $dest:"
(cd "$dest" && find . \( -type f -o -type l \) | sort | sed 's/^\./  /')
for f in "$(full "$sbindir")/dlpackd" "$(full "$includedir")/dlpc/dlpc.h" \
	"$(full "$includedir")/dlpc/dlpack1.h" "$(full "$libdir")/libdlpc.a" \
	"$(full "$libdir")/pkgconfig/dlpc.pc" "$(full "$libdir")/cmake/dlpc/dlpcConfig.cmake" \
	"$(full "$libdir")/cmake/dlpc/dlpcConfigVersion.cmake" \
	"$(full "$unitdir")/dlpackd.service" "$(full "$unitdir")/dlpackd.socket" \
	"$(full "$sysusersdir")/dlpackd.conf" "$(full "$sysusersdir")/dlpackd-bridge.conf" \
	"$(full "$unitdir")/dlpackd-bridge.service" "$(full "$mandir")/man8/dlpackd.8" \
	"$(full "$mandir")/man3/dlpc.3" "$(full "$bindir")/dlpackctl" \
	"$(full "$mandir")/man1/dlpackctl.1"; do
	[ -f "$dest$f" ] || { echo "missing: $f" >&2; exit 1; }
done
soname=$(readelf -d "$lib/libdlpc.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libdlpc.so.0 ] || { echo "SONAME is '$soname', expected libdlpc.so.0" >&2; exit 1; }
[ -L "$lib/libdlpc.so.0" ] && [ -f "$(readlink -f "$lib/libdlpc.so.0")" ]

# 1. pkg-config: the .pc file names the final prefix; the sysroot maps it into DESTDIR
export PKG_CONFIG_PATH=$lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$dest
[ "$(pkg-config --modversion dlpc)" = "$("$dest$(full "$sbindir")/dlpackd" --version |
	awk '{ print $2 }')" ]
# shellcheck disable=SC2046 # word splitting of the flags is wanted
cc -std=c11 -Wall -Werror -o "$tmp/consumer_pc" "$src/tests/install/consumer.c" \
	$(pkg-config --cflags --libs dlpc)
unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR

# 2. CMake: find_package(dlpc CONFIG), shared (dlpc::dlpc) and static (dlpc::dlpc_static)
cmake -S "$src/tests/install" -B "$tmp/cmake" -DCMAKE_PREFIX_PATH="$dest$prefix" \
	-DCMAKE_BUILD_TYPE=Release >"$tmp/cmake.log" || { cat "$tmp/cmake.log" >&2; exit 1; }
cmake --build "$tmp/cmake" >"$tmp/build.log" || { cat "$tmp/build.log" >&2; exit 1; }

# the shared builds load the installed library, not the build tree's
export LD_LIBRARY_PATH=$lib
for prog in "$tmp/consumer_pc" "$tmp/cmake/consumer"; do
	# (no grep -q in pipes: with pipefail, ldd's SIGPIPE would fail them)
	ldd "$prog" | grep "libdlpc.so.0 => $lib/libdlpc.so.0" >/dev/null ||
		{ ldd "$prog" >&2; echo "$prog does not use $lib/libdlpc.so.0" >&2; exit 1; }
done
! ldd "$tmp/cmake/consumer_static" | grep libdlpc >/dev/null ||
	{ echo "consumer_static links libdlpc dynamically" >&2; exit 1; }

# a live daemon: the installed one, on a private socket
export DLPACKD_SOCKET=$tmp/dlpackd.sock
"$dest$(full "$sbindir")/dlpackd" 2>"$tmp/dlpackd.log" &
daemon_pid=$!
# (the socket file exists a moment before the daemon listens on it: wait for an answer)
for _ in $(seq 400); do
	LD_LIBRARY_PATH=$lib "$dest$(full "$bindir")/dlpackctl" ping >/dev/null 2>&1 && break
	sleep 0.05
done
LD_LIBRARY_PATH=$lib "$dest$(full "$bindir")/dlpackctl" ping >/dev/null ||
	{ cat "$tmp/dlpackd.log" >&2; exit 1; }

"$tmp/consumer_pc" publish install/pc
"$tmp/cmake/consumer" publish install/cmake
for prog in "$tmp/consumer_pc" "$tmp/cmake/consumer" "$tmp/cmake/consumer_static"; do
	"$prog" attach install/pc
	"$prog" attach install/cmake
done
# the installed dlpackctl finds the installed library and sees both entries
LD_LIBRARY_PATH=$lib "$dest$(full "$bindir")/dlpackctl" ping
[ "$(LD_LIBRARY_PATH=$lib "$dest$(full "$bindir")/dlpackctl" ls install/ --json |
	/usr/bin/python3 -c 'import json, sys; print(sorted(e["name"] for e in json.load(sys.stdin)))')" \
	= "['install/cmake', 'install/pc']" ]
if [ -n "$pydir" ]; then
	# the extension links the installed libdlpc.so.0 (one copy beside C code in a process);
	# outside the loader's own path it finds it through its RUNPATH, relative to itself
	core=$(echo "$dest$(full "$pydir")"/dlpack_ipc/_core*.so)
	ldd "$core" | grep "libdlpc.so.0 => $lib/libdlpc.so.0" >/dev/null ||
		{ ldd "$core" >&2; echo "$core does not use $lib/libdlpc.so.0" >&2; exit 1; }
	if readelf -d "$core" | grep RUNPATH >/dev/null; then
		found=$(env -u LD_LIBRARY_PATH ldd "$core" | sed -n 's/.*libdlpc.so.0 => \(.*\) (0x.*/\1/p')
		[ -n "$found" ] && [ "$(readlink -f "$found")" = "$(readlink -f "$lib/libdlpc.so.0")" ] ||
			{ readelf -d "$core" >&2; echo "$core: its RUNPATH misses $lib" >&2; exit 1; }
	fi
	PYTHONPATH=$dest$(full "$pydir") PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 - <<'PY'
import numpy as np, dlpack_ipc
assert dlpack_ipc.__file__.startswith(__import__("os").environ["PYTHONPATH"]), dlpack_ipc.__file__
a = np.from_dlpack(dlpack_ipc.attach("install/pc"))
assert (a == np.arange(1000, dtype=np.int32) * 7 - 3).all()
print("python: installed dlpack_ipc attached install/pc")
import dlpack_ipc.torch
assert dlpack_ipc.torch.__file__.startswith(__import__("os").environ["PYTHONPATH"])
PY
fi
unset LD_LIBRARY_PATH

# 3. The build tree, not installed: the two compile lines the docs give. Each program finds the
# build tree's libdlpc.so.0 through its run path (no LD_LIBRARY_PATH).
# shellcheck disable=SC2046 # word splitting of the flags is wanted
cc -o "$tmp/tree_pc" "$src/tests/install/consumer.c" \
	$(PKG_CONFIG_PATH=$build pkg-config --cflags --libs dlpc)
cc -o "$tmp/tree_flags" "$src/tests/install/consumer.c" -I"$src/include" -L"$build" \
	-Wl,-rpath,"$build" -ldlpc
for prog in "$tmp/tree_pc" "$tmp/tree_flags"; do
	ldd "$prog" | grep "libdlpc.so.0 => $build/libdlpc.so.0" >/dev/null ||
		{ ldd "$prog" >&2; echo "$prog does not use $build/libdlpc.so.0" >&2; exit 1; }
	"$prog" attach install/pc
done
echo "build tree: both compile lines ran against the daemon"

# 4. scripts/dev install PREFIX (a build of its own, configured for PREFIX), then the documented
# line: the program, and the installed dlpackctl, find PREFIX's library with no LD_LIBRARY_PATH.
prefix_dir=$tmp/prefix
DLPC_BUILD_DIR=$tmp/devbuild DLPC_CMAKE_ARGS="-DDLPC_BUILD_TESTS=OFF" DLPC_SKIP_DEPS=1 \
	"$src/scripts/dev" install "$prefix_dir" >"$tmp/dev-install.log" 2>&1 ||
	{ cat "$tmp/dev-install.log" >&2; exit 1; }
for f in sbin/dlpackd bin/dlpackctl include/dlpc/dlpc.h lib/libdlpc.so.0 lib/pkgconfig/dlpc.pc \
	share/man/man1/dlpackctl.1 share/man/man3/dlpc.3 share/man/man8/dlpackd.8; do
	[ -e "$prefix_dir/$f" ] || { echo "scripts/dev install: missing $prefix_dir/$f" >&2; exit 1; }
done
grep -F "PKG_CONFIG_PATH=$prefix_dir/lib/pkgconfig pkg-config --cflags --libs dlpc" \
	"$tmp/dev-install.log" >/dev/null ||
	{ cat "$tmp/dev-install.log" >&2; echo "scripts/dev install gave no compile line" >&2; exit 1; }
# shellcheck disable=SC2046 # word splitting of the flags is wanted
cc -o "$tmp/prefix_pc" "$src/tests/install/consumer.c" \
	$(PKG_CONFIG_PATH=$prefix_dir/lib/pkgconfig pkg-config --cflags --libs dlpc)
ldd "$tmp/prefix_pc" | grep "libdlpc.so.0 => $prefix_dir/lib/libdlpc.so.0" >/dev/null ||
	{ ldd "$tmp/prefix_pc" >&2; echo "prefix_pc does not use $prefix_dir/lib" >&2; exit 1; }
"$tmp/prefix_pc" publish install/prefix
"$tmp/prefix_pc" attach install/pc
"$prefix_dir/bin/dlpackctl" ls install/prefix | grep install/prefix >/dev/null ||
	{ echo "the installed dlpackctl does not see install/prefix" >&2; exit 1; }
echo "scripts/dev install: the documented line ran against the daemon"

kill -TERM "$daemon_pid"
wait "$daemon_pid"
daemon_pid=
[ ! -e "$DLPACKD_SOCKET" ]
echo "install: pkg-config and find_package builds ran against the installed dlpackd"
