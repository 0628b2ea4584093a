#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The daemon's files depend on each other without a cycle, and the registry on nothing but the
# base. A file's module is its name without .c or .h; "a includes b.h" makes a depend on b.
# Usage: layering.sh DAEMON_DIR
set -euo pipefail
dir=$1
edges=$(mktemp /tmp/dlpc-layering-XXXXXX)
trap 'rm -f "$edges"' EXIT

for f in "$dir"/*.c "$dir"/*.h; do
	mod=$(basename "${f%.*}")
	echo "$mod $mod" >>"$edges"
	sed -n 's/^#include "\([a-z_]*\)\.h"$/\1/p' "$f" | while read -r dep; do
		if [ -e "$dir/$dep.h" ] && [ "$dep" != "$mod" ]; then
			echo "$dep $mod" >>"$edges"
		fi
	done
done

fail=0
if ! tsort "$edges" >/dev/null 2>"$edges.err"; then
	echo "daemon/ has an include cycle:" >&2
	cat "$edges.err" >&2
	fail=1
fi
rm -f "$edges.err"
# pure data: registry.c and registry.h use the base alone
bad=$(awk '$2 == "registry" && $1 != "base" && $1 != "registry"' "$edges")
if [ -n "$bad" ]; then
	echo "registry depends on more than base.h: $bad" >&2
	fail=1
fi
echo "daemon/ modules in dependency order:"
tsort "$edges" 2>/dev/null | tr '\n' ' '
echo
exit $fail
