#!/usr/bin/env bash
# Makes DIR a virtual environment of Debian's /usr/bin/python3 (3.11) with PyTorch 2.13.0 and the
# test tools from pip (exact versions below; the project's tested set), then builds and installs
# the extension (./python) into it against that torch (--no-build-isolation: pip must not fetch
# a second torch to build with).
#
#   bash python/venv.sh DIR          then DIR/bin/python -c "import mixattn"
#
# A DIR that already holds these versions is reused as it is (no index is consulted then); the
# build directory python/build is kept, so an unchanged source file is not compiled again.
#
# Environment: MIXATTN_JOBS (parallel compile jobs, default nproc), MIXATTN_TORCH_ARCH (the
# instruction-set flag, default -march=native; see python/setup.py), MIXATTN_TORCH_SANITIZE.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(realpath -m "${1:?usage: python/venv.sh DIR}")
# torch==2.13.0 exactly: an open range would bring a CUDA build several GB large.
pins=(torch==2.13.0 numpy==2.4.6 pytest==9.2.0 hypothesis==6.170.27 setuptools==84.2.1)
if [[ -f $venv/pyvenv.cfg ]] && grep -q '^include-system-site-packages *= *true' "$venv/pyvenv.cfg"
then
  rm -rf "$venv"  # the older layout, which saw Debian's torch 1.13: remade
fi
if [[ ! -x $venv/bin/python ]]; then
  /usr/bin/python3 -m venv "$venv"
fi
have=$("$venv/bin/python" -m pip freeze --disable-pip-version-check 2>/dev/null |
       sed -e 's/+cpu$//' | tr 'A-Z' 'a-z' | sort)
want=$(printf '%s\n' "${pins[@]}" | tr 'A-Z' 'a-z' | sort)
if [[ -n $(comm -13 <(echo "$have") <(echo "$want")) ]]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
fi
# ninja from the venv if pip put one there, else the system's (cmake/install-deps.sh).
PATH=$venv/bin:$PATH MAX_JOBS=${MIXATTN_JOBS:-$(nproc)} "$venv/bin/python" -m pip install \
  --no-build-isolation --no-index --no-deps --quiet --disable-pip-version-check "$root/python"
