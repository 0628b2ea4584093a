#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# dlpack_ipc as pip users get it, on the Python stack they run in 2026 (numpy 2, torch 2, jax),
# beside the Debian stack the `python` test covers.
#
#   pystack.sh setup PYTHON SRC DIR   make DIR/venv with PYTHON and tests/python/requirements-venv.txt
#                                     (kept while both are unchanged), then `pip install SRC` into it
#   pystack.sh venv PYTHON SRC DIR REQ
#                                     make DIR/venv with PYTHON and the requirements file REQ only
#                                     (the bench's venv: bench/requirements.txt), kept likewise; a
#                                     requirement marked `# optional` that cannot be installed is
#                                     left out, saying why, and tried again the next time
#   pystack.sh test PYTHON SRC DIR    the pytest suite (tests/python, stack2026/ included) with
#                                     that venv's interpreter, against the dlpackd pip installed
#                                     there
#   pystack.sh wheel PYTHON SRC DIR [PYTHON...]
#                                     `pip wheel SRC` (build isolation, as users build it); install
#                                     the wheel offline into fresh venvs of PYTHON and each further
#                                     PYTHON, use it there across processes, uninstall it
#
# The first setup downloads the stack from PyPI (torch==2.13.0 is the CPU build kept on the
# machine's disk); later ones reuse the venv and rebuild the project incrementally (DIR/skbuild).
set -euo pipefail
mode=$1 python=$2 src=$3 dir=$4
shift 4
venv=$dir/venv
req=$src/tests/python/requirements-venv.txt
pip_q=(--quiet --disable-pip-version-check)

fail() {
	echo "pystack: $*" >&2
	exit 1
}

need_venv() {
	[ -x "$venv/bin/python" ] || fail "no venv in $venv: the pystack_setup test makes it"
}

# make_venv: DIR/venv with PYTHON and $req, reused while both are unchanged; the lines of $req
# marked `# optional` are installed one by one, and those that fail are listed in
# DIR/venv/.dlpc-missing and tried again on the next call
make_venv() {
	local stamp line err
	[ "$python" != NOTFOUND ] || fail "no CPython 3.11 found (pyenv's): configure with" \
		"-DDLPC_STACK_PYTHON=/path/to/python3.11, or =OFF to leave the venv tests out"
	"$python" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' ||
		fail "$python cannot run or is older than 3.11: configure with -DDLPC_STACK_PYTHON=..."
	stamp=$({
		"$python" -c 'import sys; print(sys.executable, sys.version)'
		cat "$req"
	} | sha256sum)
	if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.dlpc-stamp" 2>/dev/null)" = "$stamp" ]; then
		echo "pystack: reusing $venv"
	else
		echo "pystack: making $venv with $python"
		rm -rf "$venv"
		"$python" -m venv "$venv"
		"$venv/bin/python" -m pip install "${pip_q[@]}" -r <(grep -v '# optional' "$req")
		# (a requirements file without optional lines lists none: grep's status 1 is no error)
		{ grep '# optional' "$req" || true; } | sed 's/ *#.*//' >"$venv/.dlpc-missing"
		echo "$stamp" >"$venv/.dlpc-stamp"
	fi
	[ -s "$venv/.dlpc-missing" ] || return 0
	while read -r line; do
		if err=$("$venv/bin/python" -m pip install "${pip_q[@]}" "$line" 2>&1); then
			sed -i "\|^$line\$|d" "$venv/.dlpc-missing"
		else
			echo "pystack: $line cannot be installed (left out; tried again next time):" \
				"$(echo "$err" | grep -v '^ *$' | tail -1)" >&2
		fi
	done <"$venv/.dlpc-missing"
}

setup() {
	make_venv
	# the project from the source tree, as `pip install .` builds it; without build isolation
	# so that scikit-build-core keeps its build directory between runs
	"$venv/bin/python" -m pip install "${pip_q[@]}" --no-deps --no-build-isolation \
		--force-reinstall --config-settings=build-dir="$dir/skbuild" "$src"
	"$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null |
		grep -E '^(dlpack-ipc|numpy|torch|jax|jaxlib|ml_dtypes|pytest) '
}

run_tests() {
	need_venv
	# from DIR, with no PYTHONPATH: `import dlpack_ipc` must find the installed package
	cd "$dir"
	env -u PYTHONPATH DLPACKD_BIN="$venv/bin/dlpackd" DLPC_TEST_PIP_INSTALLED=1 \
		PYTHONDONTWRITEBYTECODE=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
		"$src/tests/python" "$@"
}

wheel() {
	local tmp whl py n=0
	need_venv
	tmp=$(mktemp -d /tmp/dlpc-wheel-XXXXXX)
	# shellcheck disable=SC2064 # expand now
	trap "rm -rf '$tmp'" EXIT
	"$venv/bin/python" -m pip wheel "${pip_q[@]}" --no-deps -w "$tmp/dist" "$src"
	whl=$(echo "$tmp"/dist/dlpack_ipc-*.whl)
	echo "pystack: built $(basename "$whl")"
	# one wheel for CPython >= 3.11: the stable ABI, checked symbol by symbol
	case $whl in
	*-cp311-abi3-linux_*.whl) ;;
	*) fail "$whl is not a cp311-abi3 wheel" ;;
	esac
	"$venv/bin/abi3audit" --strict --summary --assume-minimum-abi3 3.11 "$whl"
	for py in "$python" "$@"; do
		n=$((n + 1))
		"$py" -m venv "$tmp/env$n"
		"$tmp/env$n/bin/python" -m pip install "${pip_q[@]}" --no-index --no-deps "$whl"
		(cd "$tmp" && env -u PYTHONPATH PYTHONDONTWRITEBYTECODE=1 \
			"$tmp/env$n/bin/python" "$src/tests/python/wheel_smoke.py")
		# pip lists it, and takes all of it away again
		"$tmp/env$n/bin/python" -m pip show "${pip_q[@]}" dlpack-ipc >/dev/null
		"$tmp/env$n/bin/python" -m pip uninstall "${pip_q[@]}" -y dlpack-ipc
		[ ! -e "$tmp/env$n/bin/dlpackd" ] || fail "pip uninstall left bin/dlpackd"
		! compgen -G "$tmp/env$n/lib/python3*/site-packages/dlpack_ipc*" >/dev/null ||
			fail "pip uninstall left $(echo "$tmp/env$n"/lib/python3*/site-packages/dlpack_ipc*)"
	done
}

case $mode in
setup) setup ;;
venv)
	req=$1
	make_venv
	;;
test) run_tests "$@" ;;
wheel) wheel "$@" ;;
*) fail "unknown mode $mode" ;;
esac
