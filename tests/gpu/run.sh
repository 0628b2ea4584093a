#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU tensors on real hardware, in one command (scripts/dev gpu-test runs it after building):
# starts a private dlpackd, publishes a torch.cuda tensor (legacy CUDA IPC) and a VMM tensor
# (dlpack_ipc.empty on cuda:0) from one process, attaches them in another with torch.from_dlpack
# and cupy.from_dlpack, checks their contents, and times attach for 4 KiB and 1 GiB.
#
# Not part of `scripts/dev test`: CI has no GPU and runs the same paths against the fake driver
# (tests/fake_cuda). Without a CUDA driver this says why and exits 77 ("skipped").
#
#   tests/gpu/run.sh [BUILD_DIR]
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$(cd "${1:-$here/../../build}" && pwd)
py=/usr/bin/python3

if ! "$py" -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>/dev/null; then
	echo "gpu-test: skipped: no CUDA driver on this machine (libcuda.so.1 cannot be loaded)" >&2
	exit 77
fi
for m in torch cupy; do
	if ! "$py" -c "import $m" 2>/dev/null; then
		echo "gpu-test: $m is not importable by $py; install it to run the GPU checks" >&2
		exit 1
	fi
done
if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
	echo "gpu-test: torch sees no CUDA device" >&2
	exit 1
fi

dir=$(mktemp -d)
daemon=
cleanup() {
	[ -n "$daemon" ] && kill "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
	rm -rf "$dir"
}
trap cleanup EXIT
export DLPACKD_SOCKET=$dir/dlpackd.sock PYTHONPATH=$build/python
unset DLPC_CUDA_LIBRARY
"$build/dlpackd" --socket "$DLPACKD_SOCKET" >"$dir/dlpackd.log" 2>&1 &
daemon=$!
for _ in $(seq 100); do
	[ -S "$DLPACKD_SOCKET" ] && break
	sleep 0.05
done

"$py" "$here/gpu_check.py" publish "$dir" &
publisher=$!
while [ ! -e "$dir/published" ]; do
	kill -0 "$publisher" 2>/dev/null || { wait "$publisher"; exit 1; }
	sleep 0.05
done
"$py" "$here/gpu_check.py" attach "$dir"
touch "$dir/attached"
wait "$publisher"
echo "gpu-test: passed"
