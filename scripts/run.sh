#!/usr/bin/env bash
# Set up and run kvtier's main job. Until the service exists (see docs/), that is the
# fragmentation analyzer: four workload patterns plus a Mooncake trace, every strategy,
# a table on the terminal and JSON + PNG under out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
trace=../shared/traces/mooncake_synthetic_trace.jsonl
[ -f "$trace" ] || trace=tests/data/mooncake_excerpt.jsonl
mkdir -p out
exec .venv/bin/kvtier bench fragmentation --trace "$trace" \
  --out out/fragmentation.json --plot out/fragmentation.png "$@"
