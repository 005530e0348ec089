#!/usr/bin/env bash
# Download what the GPU check machine lacks (Python 3.12, x86_64; it has torch, triton, transformers,
# tokenizers, safetensors but no pyzmq, msgspec, textual and no network) into wheels/, an ignored folder
# that travels with the working tree. scripts/gpu_check.sh installs from it with --no-index.
# Run on any machine with network access:  scripts/fetch_gpu_wheels.sh [wheels-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-wheels}"
mkdir -p "$dest"
pip="${PIP:-python3 -m pip}"
# The project's light dependencies (not torch/transformers, which that machine has in its own builds),
# the test runner, and setuptools for the project's isolated build.
packages=(pyzmq msgspec textual typer tqdm httpx fastapi uvicorn prometheus-client pytest pytest-timeout
          "setuptools>=68")
# Several manylinux tags: pip picks, per package, a wheel that runs on glibc >= 2.17.
$pip download --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform linux_x86_64 --dest "$dest" "${packages[@]}"
du -sh "$dest"
total=$(du -sm "$dest" | cut -f1)
if [ "$total" -gt 60 ]; then
    echo "wheels/ is ${total} MiB: over the 64 MiB the tree may carry" >&2
    exit 1
fi
