#!/usr/bin/env bash
# Create .venv and install kvtier with its dev extras. Idempotent: a second run is quick.
# torch is installed first and pinned to the 2.13.0 CPU wheel, so that nothing later pulls
# the registry's newest CUDA build (several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.kvtier-installed
stale=0
for f in pyproject.toml setup.py gpu_pool/kernels/native/*.c; do
  [ "$f" -nt "$stamp" ] && stale=1
done
if [ ! -f "$stamp" ] || [ "$stale" = 1 ]; then
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q "torch==${KVTIER_TORCH_VERSION:-2.13.0}"
  "$VPY" -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
