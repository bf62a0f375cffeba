#!/usr/bin/env bash
# Installs the Debian 12 packages mixattn's build, tests and benchmarks need (as root).
# Usage: cmake/install-deps.sh [test|bench]   — "bench" adds plotting (python3-matplotlib) and
# OpenBLAS for PyTorch's eager baselines (libopenblas0-pthread).
# Both include what the PyTorch extension (python/) needs beside what python/venv.sh takes from
# pip (torch 2.13.0, pytest, hypothesis, numpy, setuptools): Python's headers, venv (with pip),
# and ninja for a parallel build,
# and bible-kjv, whose text (4.4 MB of English prose) the character-level language-modelling
# example, examples/char_lm.cpp, trains on.
set -euo pipefail
what=${1:-test}
pkgs=(build-essential cmake libeigen3-dev libxsimd-dev googletest libgtest-dev libbenchmark-dev bible-kjv
      clang libclang-rt-14-dev python3
      python3-dev python3-venv ninja-build)
if [[ $what == bench ]]; then
  pkgs+=(python3-matplotlib libopenblas0-pthread)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  if [[ $(id -u) -ne 0 ]]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
