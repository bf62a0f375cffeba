#!/usr/bin/env bash
# Makes DIR a virtual environment that sees Debian's python3-torch (--system-site-packages) and
# builds and installs the extension (./python) into it, offline: no index is consulted, the
# build uses the installed torch, setuptools and wheel (--no-build-isolation).
#
#   bash python/venv.sh DIR          then DIR/bin/python -c "import mixattn"
#
# Environment: MIXATTN_JOBS (parallel compile jobs, default nproc), MIXATTN_TORCH_ARCH (the
# instruction-set flag, default -march=native; see python/setup.py).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(realpath -m "${1:?usage: python/venv.sh DIR}")
if [[ ! -x $venv/bin/python ]]; then
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
# The build directory python/build is kept: an unchanged source file is not compiled again.
MAX_JOBS=${MIXATTN_JOBS:-$(nproc)} "$venv/bin/python" -m pip install --no-build-isolation \
  --no-index --no-deps --quiet --disable-pip-version-check "$root/python"
