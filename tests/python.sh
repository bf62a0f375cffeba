#!/usr/bin/env bash
# The PyTorch extension's tests (python/tests, pytest): builds the extension into a virtual
# environment in the build directory (python/venv.sh) and runs them with it. Skipped, with a
# message, when /usr/bin/python3 has no PyTorch.
#
# Environment: MIXATTN_PYTHON_VENV (default build/venv), MIXATTN_JOBS, MIXATTN_TORCH_ARCH.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=/usr/bin/python3
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "== python: SKIPPED: PyTorch is not installed for $py (Debian: apt-get install" \
       "python3-torch libtorch-dev pybind11-dev); the extension's tests did not run"
  exit 0
fi
venv=${MIXATTN_PYTHON_VENV:-build/venv}
start=$SECONDS
echo "== python: build the extension into $venv"
bash python/venv.sh "$venv"
echo "== python: built in $((SECONDS - start)) s; pytest python/tests"
rc=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider python/tests || rc=$?
if ((rc == 5)); then  # pytest: no tests collected, which here means nothing was tested
  echo "tests/python.sh: pytest collected no tests in python/tests" >&2
  exit 1
fi
((rc == 0)) || exit "$rc"
echo "== python: $((SECONDS - start)) s"
