#!/usr/bin/env bash
# The test command: installs what it needs, builds everything (tests, examples, benchmarks),
# runs the test suite under ctest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash cmake/install-deps.sh test
jobs=${MIXATTN_JOBS:-$(nproc)}
build=${MIXATTN_BUILD_DIR:-build/test}

cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs"
