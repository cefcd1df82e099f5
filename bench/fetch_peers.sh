#!/usr/bin/env bash
# Download the peer kernels the GPU suite times beside ours (bench/peers.py) into one folder to carry to
# the GPU machine, which has no network: gemlite's sdist built into a pure-Python wheel, torchao's wheel.
#   bash bench/fetch_peers.sh [DIR]      (default bench/peers_files, ignored by git)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-bench/peers_files}
PY=${PY:-.venv/bin/python}
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --no-binary :all: gemlite==0.6.0.post2 -d "$DIR"
"$PY" -m pip wheel -q --no-deps --no-build-isolation "$DIR"/gemlite-0.6.0.post2.tar.gz -w "$DIR"
rm "$DIR"/gemlite-0.6.0.post2.tar.gz
# cp310-abi3: one wheel for every CPython >= 3.10 on the GPU image; its dense paths call torch core ops.
"$PY" -m pip download -q --no-deps --only-binary :all: --python-version 3.11 \
  --platform manylinux_2_28_x86_64 torchao==0.18.0 -d "$DIR"
ls -l "$DIR"
