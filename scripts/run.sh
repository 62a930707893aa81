#!/usr/bin/env bash
# Set up and run kvtier's main job: `kvtier serve` in engine mode on a generated model
# (SmolLM-135M architecture, random weights, local tokenizer; nothing is downloaded) with
# the embedded default tiers (CPU arena + local disk, no Redis), then a multi-turn chat
# against it whose resumed turns restore the session's KV from disk instead of recomputing.
# On a terminal the server keeps serving afterwards (Ctrl-C stops it); otherwise it stops.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
model=${KVTIER_DEMO_MODEL:-out/models/smollm-135m}
port=${KVTIER_PORT:-8100}
if [ ! -f "$model/config.json" ]; then
  .venv/bin/kvtier make-model --preset smollm-135m --out "$model"
fi
mkdir -p out
export KVTIER_TIERS__DISK_DIR=${KVTIER_TIERS__DISK_DIR:-out/chunks}
.venv/bin/kvtier serve --model "$model" --port "$port" --threads 2 --log-level warning "$@" &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
.venv/bin/kvtier chat-demo --url "http://127.0.0.1:$port"
echo "metrics: http://127.0.0.1:$port/metrics   API docs: http://127.0.0.1:$port/docs"
if [ -t 0 ]; then
  echo "kvtier serve keeps running (Ctrl-C to stop)"
  wait "$server"
fi
