#!/usr/bin/env bash
# The PyTorch extension's tests (python/tests, pytest): makes a virtual environment of
# /usr/bin/python3 in the build directory with torch 2.13.0 from pip, builds the extension into
# it (python/venv.sh) and runs them with it. Skipped, with a message, when /usr/bin/python3
# cannot make a virtual environment (Debian: python3-venv).
#
# Environment: MIXATTN_PYTHON_VENV (default build/venv), MIXATTN_JOBS, MIXATTN_TORCH_ARCH.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=/usr/bin/python3
if ! "$py" -c "import ensurepip, venv" 2>/dev/null; then
  echo "== python: SKIPPED: $py cannot make a virtual environment (Debian: apt-get install" \
       "python3-venv python3-dev); the extension's tests did not run"
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
