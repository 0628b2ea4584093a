#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Huge pages, as root: shared memory's transparent huge pages set to "advise" and then to
# "within_size", and a hugetlbfs pool reserved, each for test_huge (DLPC_TEST_HUGE=thp, then
# hugetlb), and dlpackd's notice at start where shared memory has no huge pages (in "never" and
# only there). The machine's settings are put back on every exit path (the EXIT trap). Not
# root, or no writable sysfs: exit 77 with the reason.
# Usage: huge.sh TEST_HUGE DLPACKD
set -euo pipefail
bin=$1 dlpackd=$2
thp=/sys/kernel/mm/transparent_hugepage
if [ "$(id -u)" != 0 ]; then
	echo "huge.sh: skipped: not root, so shmem_enabled and vm.nr_hugepages cannot be set"
	exit 77
fi
if [ ! -w "$thp/shmem_enabled" ] || [ ! -w /proc/sys/vm/nr_hugepages ]; then
	echo "huge.sh: skipped: $thp/shmem_enabled or /proc/sys/vm/nr_hugepages is not writable here"
	exit 77
fi
chosen() { sed 's/.*\[\(.*\)\].*/\1/' "$1"; }
per=$thp/hugepages-$(($(cat "$thp/hpage_pmd_size") / 1024))kB/shmem_enabled
old_thp=$(chosen "$thp/shmem_enabled")
old_per=
if [ -w "$per" ]; then old_per=$(chosen "$per"); fi
old_nr=$(cat /proc/sys/vm/nr_hugepages)
# Every setting is put back even when another cannot be (no set -e here); one that could not
# fails the run, naming it.
restore() {
	local rc=$? failed=
	set +e
	echo "$old_thp" >"$thp/shmem_enabled" || failed+=" $thp/shmem_enabled=$old_thp"
	if [ -n "$old_per" ]; then echo "$old_per" >"$per" || failed+=" $per=$old_per"; fi
	echo "$old_nr" >/proc/sys/vm/nr_hugepages || failed+=" vm.nr_hugepages=$old_nr"
	if [ -n "$failed" ]; then
		echo "huge.sh: FAILED to restore:$failed (set them back by hand)" >&2
		exit 1
	fi
	if [ -n "$tmp" ]; then rm -rf "$tmp"; fi
	echo "huge.sh: restored shmem_enabled $old_thp${old_per:+ ($per: $old_per)}, vm.nr_hugepages $old_nr"
	exit "$rc"
}
tmp=
trap restore EXIT
trap 'exit 130' INT TERM HUP
tmp=$(mktemp -d /tmp/dlpc-huge-XXXXXX)

# dlpackd started with shmem_enabled as it is now: whether its log at start has the notice
# about huge pages (it is written before READY, so before "listening" is not enough: wait for
# the daemon to answer, then stop it)
daemon_notes() {
	local pid n=0
	"$dlpackd" --socket "$tmp/d.sock" 2>"$tmp/d.log" &
	pid=$!
	until grep -q "limits:" "$tmp/d.log" 2>/dev/null && [ -S "$tmp/d.sock" ]; do
		n=$((n + 1))
		if [ "$n" -gt 500 ] || ! kill -0 "$pid" 2>/dev/null; then
			kill "$pid" 2>/dev/null || true
			echo "huge.sh: dlpackd did not start:" >&2
			cat "$tmp/d.log" >&2
			exit 1
		fi
		sleep 0.01
	done
	sleep 0.2
	kill "$pid"
	wait "$pid" || true
	grep -q "no transparent huge pages" "$tmp/d.log"
}

if [ -n "$old_per" ]; then echo inherit >"$per"; fi
for mode in advise within_size; do
	echo "$mode" >"$thp/shmem_enabled"
	echo "huge.sh: shmem_enabled $mode"
	DLPC_TEST_HUGE=thp "$bin"
	if daemon_notes; then
		echo "huge.sh: FAILED: dlpackd says shared memory has no huge pages with $mode:" >&2
		cat "$tmp/d.log" >&2
		exit 1
	fi
done
echo never >"$thp/shmem_enabled"
if ! daemon_notes; then
	echo "huge.sh: FAILED: dlpackd did not say that shared memory has no huge pages (never):" >&2
	cat "$tmp/d.log" >&2
	exit 1
fi
echo "huge.sh: dlpackd notes the missing huge pages with never, and only then"
# 2 + 32 pages for the test, a few more for the rest of the machine's use
echo $((old_nr + 40)) >/proc/sys/vm/nr_hugepages
free=$(awk '/^HugePages_Free:/ { print $2 }' /proc/meminfo)
if [ "$free" -lt 34 ]; then
	echo "huge.sh: skipped the hugetlbfs part: only $free huge pages could be reserved" \
		"(memory too fragmented); the transparent huge pages part passed"
	exit 77
fi
echo "huge.sh: vm.nr_hugepages $((old_nr + 40)), $free free"
DLPC_TEST_HUGE=hugetlb "$bin"
