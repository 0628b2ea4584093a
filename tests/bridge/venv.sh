#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The bridge's venv (ctest: bridge_venv, the fixture of bridge_netns):
#
#   venv.sh PYTHON DIR REQ    make DIR/venv with PYTHON and the requirements file REQ, each
#                             installed with --no-deps; kept while PYTHON and REQ are unchanged
#
# The first run downloads NIXL (about 60 MB with its bundled UCX) and numpy from PyPI.
set -euo pipefail
python=$1 dir=$2 req=$3
venv=$dir/venv
stamp=$({
	"$python" -c 'import sys; print(sys.executable, sys.version)'
	cat "$req"
} | sha256sum)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.dlpc-stamp" 2>/dev/null)" = "$stamp" ]; then
	echo "bridge venv: reusing $venv"
	exit 0
fi
echo "bridge venv: making $venv with $python"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$req"
# NIXL finds its UCX plugin without CUDA (UCX_MODULES as the bridge sets it)
UCX_MODULES='^ib' "$venv/bin/python" -c 'from nixl._api import nixl_agent; import numpy'
echo "$stamp" >"$venv/.dlpc-stamp"
"$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | grep -Ei '^(nixl|numpy)'
