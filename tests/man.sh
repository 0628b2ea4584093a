#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The man pages render without a warning, and dlpackd(8) documents exactly the options and
# environment variables that dlpackd --help lists, for the version dlpackd reports.
# Usage: man.sh DLPACKD DOCS_DIR
set -euo pipefail
dlpackd=$1 docs=$2
tmp=$(mktemp -d /tmp/dlpc-man-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail=0

for page in "$docs"/*.[1-8]; do
	groff -ww -man -z "$page" 2>"$tmp/groff" || fail=1
	MANWIDTH=80 man --warnings -l "$page" 2>"$tmp/man" >/dev/null || fail=1
	if [ -s "$tmp/groff" ] || [ -s "$tmp/man" ]; then
		cat "$tmp/groff" "$tmp/man" >&2
		fail=1
	fi
	echo "rendered $(basename "$page")"
done

page=$docs/dlpackd.8
"$dlpackd" --help >"$tmp/help"
# long options: in --help, every "--name"; in the page, the tags of the OPTIONS section
grep -o -- '--[a-z][a-z-]*' "$tmp/help" | sort -u >"$tmp/help.opts"
sed 's/\\-/-/g' "$page" |
	awk '/^\.SH / { opts = ($2 == "OPTIONS") } opts && tag { print } { tag = /^\.TP/ }' |
	grep -o -- '--[a-z][a-z-]*' | sort -u >"$tmp/man.opts"
# environment variables: "[env NAME]" in --help, DLPACKD_* tags of the ENVIRONMENT section
grep -o 'env DLPACKD_[A-Z_]*' "$tmp/help" | sed 's/env //' | sort -u >"$tmp/help.env"
sed 's/\\-/-/g' "$page" |
	awk '/^\.SH / { env = ($2 == "ENVIRONMENT") } env && tag { print } { tag = /^\.T[PQ]/ }' |
	grep -o 'DLPACKD_[A-Z_]*' | sort -u >"$tmp/man.env"
for what in opts env; do
	if ! diff -u "$tmp/help.$what" "$tmp/man.$what" >&2; then
		echo "dlpackd --help and dlpackd.8 disagree on $what (-: --help, +: man page)" >&2
		fail=1
	fi
	[ -s "$tmp/help.$what" ] || { echo "no $what found in --help" >&2; fail=1; }
done
version=$("$dlpackd" --version | awk '{ print $2 }')
grep -q "^\.TH DLPACKD 8 .*\"dlpackd $version\"" "$page" ||
	{ echo "dlpackd.8 is not for version $version" >&2; fail=1; }
grep -q "^\.TH DLPC 3 .*\"dlpackd $version\"" "$docs/dlpc.3" ||
	{ echo "dlpc.3 is not for version $version" >&2; fail=1; }
grep -q "^\.TH DLPACKCTL 1 .*\"dlpackd $version\"" "$docs/dlpackctl.1" ||
	{ echo "dlpackctl.1 is not for version $version" >&2; fail=1; }
echo "options: $(tr '\n' ' ' <"$tmp/help.opts")"
echo "environment: $(tr '\n' ' ' <"$tmp/help.env")"
exit $fail
