#!/usr/bin/env bash
# Set up and run kvtier's test suite (CPU; Triton kernels run under TRITON_INTERPRET=1):
# lint (ruff, and lint-imports for the layers of docs/architecture.md), the unit and service tests in .venv, then the engine integration tests in their own
# environments: real vLLM (.venv-integration) and real LMCache (.venv-lmcache). Arguments go to the first pytest run and
# then only it runs (for a quick subset: bash scripts/test.sh tests/engine/test_engine.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python scripts/lint_imports.py
.venv/bin/python -m pytest "$@"
if [ "$#" -eq 0 ]; then
  bash scripts/setup_integration.sh
  .venv-integration/bin/python -m pytest -c tests_vllm/pytest.ini tests_vllm
  PYTHONHASHSEED=0 .venv-lmcache/bin/python -m pytest -c tests_lmcache/pytest.ini tests_lmcache
fi
