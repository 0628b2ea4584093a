#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Layering, read two ways, and the length of functions.
#
# Includes: the daemon's files depend on each other without a cycle, and the registry on nothing
# but the base. A file's module is its name without .c or .h; "a includes b.h" makes a depend on b.
#
# Calls (with BUILD_DIR): from `nm` of the object files CMake built there, a file that calls a
# function defined in another file depends on it (static functions are no symbols, so only calls
# across files count). Every circle among the files of daemon/, proto/, client/ and python/src
# (a strongly connected component of more than one file) is printed with the functions that tie
# it, and fails the test.
# Object files map to sources by CMake's layout, <target>.dir/<source path>.o, so any build
# directory works (the ASan one too). A source of daemon/, proto/ or client/ without an object
# fails the test (build first); one of python/src is said and skipped (the ASan build makes no
# Python module); an object whose source is gone is skipped, and so is a build tree nested in
# BUILD_DIR.
#
# Lengths: no function of daemon/, proto/ or client/ over MAX_FUNCTION_LINES lines.
# Usage: layering.sh DAEMON_DIR [BUILD_DIR]
set -euo pipefail
dir=$1
build=${2:-}
edges=$(mktemp /tmp/dlpc-layering-XXXXXX)
trap 'rm -f "$edges" "$edges".*' EXIT

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
# pure data: registry.c and registry.h use the base alone
bad=$(awk '$2 == "registry" && $1 != "base" && $1 != "registry"' "$edges")
if [ -n "$bad" ]; then
	echo "registry depends on more than base.h: $bad" >&2
	fail=1
fi
echo "daemon/ modules in dependency order:"
tsort "$edges" 2>/dev/null | tr '\n' ' '
echo

# ---- lengths ----
# No function of daemon/, proto/ or client/ runs over MAX_FUNCTION_LINES lines, counted from the
# `{` that opens it in column 0 to the `}` that closes it there (the project's brace style).
MAX_FUNCTION_LINES=80
root=$(dirname "$dir")
long=$(for f in "$root"/daemon/*.c "$root"/proto/*.c "$root"/client/*.c; do
	awk -v f="${f#"$root"/}" -v max=$MAX_FUNCTION_LINES '
		/^{/ { start = FNR; name = head; next }
		/^}/ && start { if (FNR - start + 1 > max) printf "  %s:%d %s: %d lines\n", f, start, name, FNR - start + 1; start = 0 }
		/^[^ \t#\/]/ { head = $0 }' "$f"
done)
if [ -n "$long" ]; then
	echo "functions over $MAX_FUNCTION_LINES lines:" >&2
	echo "$long" >&2
	fail=1
fi

[ -n "$build" ] || exit $fail

# ---- calls ----
# "<source> <D|U> <symbol>" for every global function an object defines and every symbol it
# leaves undefined
syms="$edges.syms"
: >"$syms"
# a build tree inside this one (the pystack test builds the Python package under build/pystack)
# holds objects of other sources, or of the same sources at another time: not read
prune=()
while IFS= read -r -d '' nested; do
	prune+=(-path "$(dirname "$nested")" -prune -o)
done < <(find "$build" -mindepth 2 -name CMakeCache.txt -print0)
for d in daemon proto client python/src; do
	built=" "
	while IFS= read -r -d '' o; do
		src=${o#*.dir/}
		src=${src%.o}
		case "$src" in "$d"/*.c) ;; *) continue ;; esac
		if [ ! -e "$root/$src" ]; then
			echo "calls: $o is left from a source that is gone: not read"
			continue
		fi
		built="$built$src "
		nm -P "$o" | awk -v s="$src" '
			$2 == "T" || $2 == "W" { print s, "D", $1 }
			$2 == "U" { print s, "U", $1 }' >>"$syms"
	done < <(find "$build" "${prune[@]}" -path "*/CMakeFiles/*.dir/$d/*.c.o" -print0)
	for f in "$root/$d"/*.c; do
		src=${f#"$root"/}
		case "$built" in *" $src "*) continue ;; esac
		# (the ASan build makes no Python module)
		case "$d" in
		daemon | proto | client)
			echo "calls: $src has no object in $build: build it first" >&2
			fail=1
			;;
		*) echo "calls: $src has no object in $build: not checked" ;;
		esac
	done
done

python3 - "$syms" <<'EOF' || fail=1
import sys
from collections import defaultdict

defs, uses = {}, defaultdict(set)
for line in open(sys.argv[1]):
    src, kind, sym = line.split()
    if kind == "D":
        defs.setdefault(sym, src)  # a source built into several targets defines it once
    else:
        uses[src].add(sym)
files = sorted(set(defs.values()) | set(uses))
ties = defaultdict(set)  # (caller, callee) -> functions
for src in files:
    for sym in uses[src]:
        owner = defs.get(sym)
        if owner is not None and owner != src:
            ties[(src, owner)].add(sym)
out = defaultdict(set)
for a, b in ties:
    out[a].add(b)

# Tarjan's strongly connected components, iterative
index, low, on, stack, sccs, n = {}, {}, set(), [], [], 0
for root in files:
    if root in index:
        continue
    work = [(root, iter(sorted(out[root])))]
    index[root] = low[root] = n
    n += 1
    stack.append(root)
    on.add(root)
    while work:
        v, it = work[-1]
        w = next(it, None)
        if w is not None:
            if w not in index:
                index[w] = low[w] = n
                n += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(out[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
            continue
        work.pop()
        if work:
            low[work[-1][0]] = min(low[work[-1][0]], low[v])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

for comp in sorted(sccs):
    print(f"call circle among {len(comp)} files: {' '.join(comp)}")
    members = set(comp)
    for (a, b), fns in sorted(ties.items()):
        if a in members and b in members:
            print(f"  {a} -> {b}: {' '.join(sorted(fns))}")
print(f"calls: {len(files)} files, {len(ties)} arrows, {len(sccs)} circles")
if sccs:
    print("files call each other in a circle (above)", file=sys.stderr)
sys.exit(1 if sccs else 0)
EOF
exit $fail
