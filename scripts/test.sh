#!/usr/bin/env bash
# Set up and run kvtier's test suite (CPU; Triton kernels run under TRITON_INTERPRET=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
