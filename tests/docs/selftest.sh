#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The docs tests' own test: run_blocks.py and check_links.py on pages made to pass and to fail
# (tests/docs/fixtures/), so that a runner that passes everything cannot go unnoticed.
#
#   selftest.sh PYTHON SRC BUILD DLPACKD
set -euo pipefail
python=$1 src=$2 build=$3 dlpackd=$4
here=$src/tests/docs
fix=$here/fixtures
out=$(mktemp -d /tmp/dlpc-docs-selftest-XXXXXX)
trap 'rm -rf "$out"' EXIT
status=0

check() { # check WHAT FILE PATTERN...: every PATTERN (grep -E) is in FILE
	local what=$1 file=$2 p
	shift 2
	for p in "$@"; do
		grep -qE -- "$p" "$file" || {
			echo "selftest: $what: no line matches '$p' in:" >&2
			cat "$file" >&2
			status=1
		}
	done
}

runner=("$python" "$here/run_blocks.py" --src "$src" --build "$build" --python "$python"
	--pythonpath "$build/python" --dlpackd "$dlpackd")

# every block of pass.md passes: spawned workers, a C file compiled by the sh block after it,
# output blocks with and without `...`
rc=0
"${runner[@]}" "$fix/pass.md" >"$out/pass" 2>&1 || rc=$?
[ $rc -eq 0 ] || { echo "selftest: pass.md: exit $rc" >&2; cat "$out/pass" >&2; status=1; }
check pass.md "$out/pass" '^docs: 3 of 3 blocks passed in 1 file'

# each block of fail.md fails in its own way, named by file and line; the last one still runs
rc=0
"${runner[@]}" --timeout 3 "$fix/fail.md" >"$out/fail" 2>&1 || rc=$?
[ $rc -eq 1 ] || { echo "selftest: fail.md: exit $rc, not 1" >&2; cat "$out/fail" >&2; status=1; }
check fail.md "$out/fail" \
	'^docs: FAIL tests/docs/fixtures/fail\.md:5: python run: exit status 3$' \
	'^docs: FAIL tests/docs/fixtures/fail\.md:13: python run: its stdout differs' \
	'^docs: FAIL .* the `output` block at tests/docs/fixtures/fail\.md:18, which expects:$' \
	'^docs: FAIL tests/docs/fixtures/fail\.md:29: sh run: exit status 1$' \
	"error: .undeclared. undeclared" \
	'^docs: FAIL tests/docs/fixtures/fail\.md:35: sh run: still running after 3\.0 s \(killed\)$' \
	'^docs: tests/docs/fixtures/fail\.md:41: sh run: ok' \
	'^docs: 2 of 6 blocks passed in 1 file'

# a page without runnable blocks is an error, not a pass
rc=0
"${runner[@]}" "$fix/links/docs/a.md" >"$out/none" 2>&1 || rc=$?
[ $rc -eq 2 ] || { echo "selftest: a page without blocks: exit $rc, not 2" >&2; status=1; }
check "no blocks" "$out/none" '^docs: no runnable block'

# links: the good ones pass, each bad one is named
rc=0
"$python" "$here/check_links.py" "$fix/links" >"$out/links" 2>&1 || rc=$?
[ $rc -eq 1 ] || { echo "selftest: links: exit $rc, not 1" >&2; cat "$out/links" >&2; status=1; }
check links "$out/links" \
	'^links: README\.md:14: \(docs/a\.md#nope\) no heading of docs/a\.md has the anchor #nope$' \
	'^links: README\.md:14: \(docs/missing\.md\) docs/missing\.md does not exist$' \
	'^links: README\.md:14: \(\.\./\.\./\.\./\.\./\.\./etc/passwd\) points outside the source tree$' \
	'^links: README\.md:15: \(#install\) no heading of README\.md has the anchor #install$' \
	'^links: README\.md:22: \(docs/b\.md\) docs/b\.md does not exist$' \
	'^links: 10 of 15 relative links resolve in 2 file'
[ $status -eq 0 ] && echo "selftest: the docs tests catch what they should"
exit $status
