#!/bin/bash
# Mooncake's conversation trace replayed against headwater and Dynamo, each with its
# round-robin router and its KV router, over four simulated workers (mockers) whose caches
# cannot hold the whole working set: docs/routing.md, "The trace benchmark".
#
#   bash scripts/bench_kv_trace.sh [ROUNDS] [REQUESTS] [TIME_SCALE]
#
# Each round runs the four setups in turn (headwater rr, headwater kv, Dynamo rr, Dynamo
# kv), each on a fresh cluster, and prints one JSON line per run (scripts/trace_replay.py).
# Needs Dynamo's peer installed (bash scripts/peers/dynamo/install.sh). Loopback only.
set -euo pipefail
ROUNDS=${1:-2}
REQUESTS=${2:-1200}
SCALE=${3:-8}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
BLOCKS=4096  # per worker: 4 x 4096 x 64 tokens, under the replayed prompts' working set
MOCKER=(--speedup-ratio 1 --block-size 64)
REPLAY=(--requests "$REQUESTS" --time-scale "$SCALE" --block-tokens 64 --max-tokens 64)
HW_PORT=8100
DYN_PORT=8200

wait_ready() {  # URL
  for _ in $(seq 120); do
    curl -sf "$1/v1/models" | grep -q deepseek-v4 && return 0
    sleep 1
  done
  echo "not ready: $1" >&2
  return 1
}

headwater() {  # ROUTER
  PYTHONPATH=$HERE "$PY" -m headwater launch --agg 4 --port $HW_PORT --discovery static \
    --num-gpu-blocks $BLOCKS "${MOCKER[@]}" -- --router "$1" --processes 1 \
    >/tmp/headwater-trace.log 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:$HW_PORT
  sleep 2
  PYTHONPATH=$HERE "$PY" -m scripts.trace_replay --url http://127.0.0.1:$HW_PORT \
    "${REPLAY[@]}" --label "headwater $1"
  kill -INT $pid
  wait $pid || true
}

dynamo() {  # ROUTER
  # shellcheck source=/dev/null
  source "$HERE/scripts/peers/dynamo/env.sh"
  rm -rf "$DYN_DIR/kvstore"
  mkdir -p "$DYN_DIR/logs"
  "$DYN_DIR/venv/bin/python" -m dynamo.frontend --http-host 127.0.0.1 --http-port $DYN_PORT \
    --discovery-backend file --request-plane tcp --router-mode "$1" \
    --kv-cache-block-size 64 >"$DYN_DIR/logs/trace-frontend.log" 2>&1 &
  local fe=$!
  "$DYN_DIR/venv/bin/python" -m dynamo.mocker --model-path "$DYN_DIR/model" \
    --model-name deepseek-v4 --discovery-backend file --request-plane tcp --num-workers 4 \
    --num-gpu-blocks-override $BLOCKS "${MOCKER[@]}" >"$DYN_DIR/logs/trace-mocker.log" 2>&1 &
  local mocker=$!
  wait_ready http://127.0.0.1:$DYN_PORT
  sleep 3  # every mocker worker registered
  PYTHONPATH=$HERE "$PY" -m scripts.trace_replay --url http://127.0.0.1:$DYN_PORT \
    "${REPLAY[@]}" --label "dynamo $1"
  kill $fe $mocker
  wait $fe $mocker 2>/dev/null || true
}

uptime >&2
for _ in $(seq "$ROUNDS"); do
  headwater round-robin
  headwater kv
  dynamo round-robin
  dynamo kv
done
uptime >&2
