#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU tensors on real hardware, in one command (scripts/dev gpu-test runs it after building).
# Not part of `scripts/dev test`: CI has no GPU and runs the same paths against the fake driver
# (tests/fake_cuda).
#
#   tests/gpu/run.sh [BUILD_DIR [GROUP]...]
#
# Starts a private dlpackd (BUILD_DIR/dlpackd) on a socket in a temporary directory, and runs
# gpu_check.py against it with the real libcuda.so.1; every publisher and attacher is a process
# of its own (gpu_roles.py), and each check prints one line on stdout:
#
#   ok|FAIL|skip  <check name>  <timing or detail>
#
# The groups of checks, in order (GROUPs, substrings of these names, select some):
#   ipc           torch.cuda tensors of 4 KiB and 1 GiB (legacy CUDA IPC) and dlpack_ipc.empty
#                 memory (VMM) attached by another process with torch.from_dlpack, contents
#                 compared by checksums computed on the GPU, attach timed; the same-process
#                 attach (the publisher's own pointer); the producer's deleter after unpublish;
#                 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (lent VMM memory, or refused
#                 naming the setting: the line says which) and backend:cudaMallocAsync (refused)
#   order         a publisher's long kernel, then the final values, published unsynchronized:
#                 read by an attacher on the default stream and on a side stream
#   reclaim       an attacher drops the tensor its long kernel still reads (ordered on a side
#                 stream, on the default stream, or on none); the publisher unpublishes and
#                 overwrites the memory once it has it back: the kernel read the original data
#   vmm-lifetime  empty() memory attached after its publisher exited, with another CUDA process
#                 alive and with none (where only persistence mode keeps it: a failure that
#                 says so is a skip; nvidia-smi's persistence mode is reported)
#   capture       a CUDA graph captured on a side stream while another thread's gc.collect()
#                 drops attached tensors: read on the default stream (no hold needed), and
#                 read on side streams too, inside dlpack_ipc.cuda_releases_held()
#   fork          a child forked from a process using CUDA through dlpack_ipc: GPU calls raise
#                 OSError(EBADFD), host calls work, it exits cleanly, the parent's tensors stay
#   many          25,000 legacy publications (past the 1000 interprocess events), a sample
#                 attached, all unpublished and STAT back to zero references
#   state-dict    publish_dict of a model's state_dict() on cuda:0 (copied), and of an
#                 empty_dict bucket filled from it (as it is), attach_dict elsewhere
#   cupy          cupy.from_dlpack of legacy and VMM entries, a CuPy array published, CuPy's
#                 MemoryAsyncPool refused ("skip" lines without CuPy)
# and last, always, that the daemon holds nothing and still runs. It takes a few minutes.
#
# Python: $PYTHON, else the first of /usr/bin/python3 and python3 on PATH whose torch has CUDA
# (torch.cuda.is_available()). dlpack_ipc comes from BUILD_DIR/python, so it must have been
# built for that interpreter (cmake -DPython3_EXECUTABLE=...). CuPy is optional.
#
# Exit status: 0 when no check failed; 77 ("skipped") when there is no CUDA driver (libcuda.so.1
# cannot be loaded) or no device, saying why; 1 when the checks cannot run, saying why, or when
# a check failed (then the daemon's and each process's logs are kept, and their directory named).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=${1:-$here/../../build}
if [ $# -gt 0 ]; then
	shift
fi
unset DLPC_CUDA_LIBRARY # the real driver, not a test's fake

say() {
	echo "gpu-test: $*" >&2
}

# An interpreter for the driver probe (any python3 has ctypes).
probe=${PYTHON:-}
if [ -z "$probe" ]; then
	if [ -x /usr/bin/python3 ]; then
		probe=/usr/bin/python3
	else
		probe=$(command -v python3 || true)
	fi
fi
if [ -z "$probe" ] || ! command -v "$probe" >/dev/null; then
	say "no Python interpreter (${probe:-python3}) to run the checks with; set PYTHON"
	exit 1
fi

# The driver and its devices, through the driver API itself: 77 without either.
rc=0
driver=$("$probe" - <<'EOF'
import ctypes
import sys


def stop(status, msg):
    print(msg)
    sys.exit(status)


try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    stop(77, f"skipped: no CUDA driver (libcuda.so.1 cannot be loaded: {e})")


def err(r):
    s = ctypes.c_char_p()
    if hasattr(cu, "cuGetErrorName") and cu.cuGetErrorName(r, ctypes.byref(s)) == 0 and s.value:
        return f"{s.value.decode()} ({r})"
    return f"error {r}"


r = cu.cuInit(0)
if r == 100:  # CUDA_ERROR_NO_DEVICE
    stop(77, f"skipped: no CUDA device (cuInit: {err(r)})")
if r != 0:
    stop(1, f"the CUDA driver does not start (cuInit: {err(r)})")
count = ctypes.c_int(0)
r = cu.cuDeviceGetCount(ctypes.byref(count))
if r != 0:
    stop(1, f"the CUDA driver does not count its devices (cuDeviceGetCount: {err(r)})")
if count.value == 0:
    stop(77, "skipped: no CUDA device (cuDeviceGetCount: 0)")
version, dev, name = ctypes.c_int(0), ctypes.c_int(0), ctypes.create_string_buffer(256)
if hasattr(cu, "cuDriverGetVersion"):
    cu.cuDriverGetVersion(ctypes.byref(version))
if not (hasattr(cu, "cuDeviceGetName") and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
        and cu.cuDeviceGetName(name, 256, dev) == 0):
    name.value = b"?"
print(f"CUDA driver {version.value // 1000}.{version.value % 1000 // 10}, "
      f"{count.value} device(s), device 0: {name.value.decode(errors='replace')}")
EOF
) || rc=$?
case $rc in
0) say "$driver" ;;
77)
	say "$driver"
	exit 77
	;;
*)
	say "${driver:-the CUDA driver probe failed (status $rc)}"
	exit 1
	;;
esac

# The interpreter: the first whose torch has CUDA.
torch_probe='
import sys
try:
    import torch
except Exception as e:
    sys.exit(f"no torch ({type(e).__name__}: {e})")
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} has no CUDA (torch.version.cuda is {torch.version.cuda})")
try:
    import cupy
    cp = f"cupy {cupy.__version__}"
except Exception:
    cp = "no cupy"
print(f"Python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), {cp}")
'
candidates=()
if [ -n "${PYTHON:-}" ]; then
	candidates=("$PYTHON")
else
	if [ -x /usr/bin/python3 ]; then
		candidates+=(/usr/bin/python3)
	fi
	p=$(command -v python3 || true)
	if [ -n "$p" ] && [ "$p" != /usr/bin/python3 ]; then
		candidates+=("$p")
	fi
fi
py=
tried=()
for c in "${candidates[@]}"; do
	if out=$("$c" -c "$torch_probe" 2>&1); then
		py=$c
		info=${out##*$'\n'}
		break
	fi
	tried+=("$c: ${out##*$'\n'}")
done
if [ -z "$py" ]; then
	say "no Python whose torch has CUDA:"
	printf '  %s\n' "${tried[@]}" >&2
	say "install a CUDA build of torch there, or set PYTHON to an interpreter that has one"
	exit 1
fi
say "python: $py ($info)"

if [ ! -x "$build/dlpackd" ] || [ ! -d "$build/python/dlpack_ipc" ]; then
	say "no dlpackd and python/dlpack_ipc in $build: build first (scripts/dev build)"
	exit 1
fi
build=$(cd "$build" && pwd)
export PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH}
if ! out=$("$py" -c 'import dlpack_ipc' 2>&1); then
	built_for=$(sed -n 's/^_\{0,1\}Python3_EXECUTABLE:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null |
		head -n 1 || true)
	say "$py cannot import dlpack_ipc from $build/python: ${out##*$'\n'}"
	say "it was built for ${built_for:-another interpreter}: configure with -DPython3_EXECUTABLE=$py"
	exit 1
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/dlpc-gpu-test.XXXXXX")
daemon=
keep=
# shellcheck disable=SC2317 # run by the EXIT trap
cleanup() {
	if [ -n "$daemon" ]; then
		kill "$daemon" 2>/dev/null || true
		wait "$daemon" 2>/dev/null || true
	fi
	if [ -n "$keep" ]; then
		say "logs kept in $dir"
	else
		rm -rf "$dir"
	fi
}
trap cleanup EXIT
trap 'keep=1; exit 1' INT TERM
export DLPACKD_SOCKET=$dir/dlpackd.sock
"$build/dlpackd" --socket "$DLPACKD_SOCKET" >"$dir/dlpackd.log" 2>&1 &
daemon=$!
for _ in $(seq 200); do
	if [ -S "$DLPACKD_SOCKET" ] || ! kill -0 "$daemon" 2>/dev/null; then
		break
	fi
	sleep 0.05
done
if [ ! -S "$DLPACKD_SOCKET" ]; then
	say "dlpackd did not start:"
	cat "$dir/dlpackd.log" >&2
	keep=1
	exit 1
fi

status=0
"$py" "$here/gpu_check.py" --dir "$dir" "$@" || status=1
if ! kill -0 "$daemon" 2>/dev/null; then
	say "dlpackd is gone (its log: $dir/dlpackd.log)"
	status=1
fi
if [ $status -ne 0 ]; then
	keep=1
fi
exit $status
