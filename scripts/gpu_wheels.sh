#!/usr/bin/env bash
# Build .gpu-wheels/ (ignored by git): the binary wheels (CPython 3.12, manylinux x86_64) of
# every runtime dependency the lent GPU machines lack, never torch, triton or CUDA packages.
# Run it here (the package index is reachable), then carry .gpu-wheels with the working tree
# and run scripts/gpu_check.sh on the GPU machine (docs/gpu.md). Arguments go to
# scripts/gpu_wheels.py (--list prints the requirements; --dest DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
"$py" -m pip --version >/dev/null 2>&1 || py=.venv/bin/python
[ -x "$py" ] || command -v "$py" >/dev/null || { bash scripts/setup.sh; py=.venv/bin/python; }
exec "$py" scripts/gpu_wheels.py "$@"
