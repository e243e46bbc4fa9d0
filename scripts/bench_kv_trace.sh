#!/bin/bash
# Mooncake's conversation trace replayed against headwater and Dynamo, each with its
# round-robin router and its KV router, over four simulated workers (mockers) whose caches
# cannot hold the whole working set: docs/routing.md, "The trace benchmark".
#
#   bash scripts/bench_kv_trace.sh [ROUNDS] [REQUESTS] [TIME_SCALE]
#   SPEEDUP=0.3 ROUTERS="round-robin least-loaded kv" LAYOUT=disagg bash scripts/...
#
# Each round runs every setup in turn (headwater, then Dynamo, each router of ROUTERS),
# each on a fresh cluster, and prints one JSON line per run (scripts/trace_replay.py) with
# the frontend process's CPU seconds per request added. LAYOUT agg: 4 aggregated
# workers; disagg: 2 prefill + 2 decode. SPEEDUP: the mockers' (1: the fitted GPU's
# speed; below 1 a slower one, where prefill dominates the time to first token).
# PROCESSES: headwater's frontend processes; PEERS: "headwater dynamo" or either alone.
# Needs Dynamo's peer installed (bash scripts/peers/dynamo/install.sh). Loopback only.
set -euo pipefail
ROUNDS=${1:-2}
REQUESTS=${2:-1200}
SCALE=${3:-8}
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
BLOCKS=4096  # per worker: 4 x 4096 x 64 tokens, under the replayed prompts' working set
SPEEDUP=${SPEEDUP:-1}
ROUTERS=${ROUTERS:-round-robin kv}
LAYOUT=${LAYOUT:-agg}
PROCESSES=${PROCESSES:-1}  # headwater's frontend processes (each with its own index)
PEERS=${PEERS:-headwater dynamo}
MOCKER=(--speedup-ratio "$SPEEDUP" --block-size 64)
REPLAY=(--requests "$REQUESTS" --time-scale "$SCALE" --block-tokens 64 --max-tokens 64)
HW_PORT=8100
DYN_PORT=8200

cpu_seconds() {  # PID: user + system CPU seconds so far
  awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$1/stat"
}

replay() {  # URL FRONTEND_PID LABEL
  local before out
  before=$(cpu_seconds "$2")
  out=$(PYTHONPATH=$HERE "$PY" -m scripts.trace_replay --url "$1" "${REPLAY[@]}" --label "$3")
  "$PY" -c 'import json, sys
r = json.loads(sys.argv[1])
cpu = float(sys.argv[3]) - float(sys.argv[2])
r["frontend_cpu_ms_per_request"] = round(1000 * cpu / r["requests"], 2)
print(json.dumps(r), flush=True)' "$out" "$before" "$(cpu_seconds "$2")"
}

wait_ready() {  # URL
  for _ in $(seq 120); do
    curl -sf "$1/v1/models" | grep -q deepseek-v4 && return 0
    sleep 1
  done
  echo "not ready: $1" >&2
  return 1
}

headwater() {  # ROUTER
  local workers=(--agg 4)
  [ "$LAYOUT" = disagg ] && workers=(--prefill 2 --decode 2)
  PYTHONPATH=$HERE "$PY" -m headwater launch "${workers[@]}" --port $HW_PORT \
    --discovery static --num-gpu-blocks $BLOCKS "${MOCKER[@]}" -- --router "$1" \
    --processes "$PROCESSES" >/tmp/headwater-trace.log 2>&1 &
  local pid=$!
  wait_ready http://127.0.0.1:$HW_PORT
  sleep 2
  local fe
  fe=$(awk '$1 == "frontend" && $2 == "pid" { print $3 }' /tmp/headwater-trace.log)
  replay http://127.0.0.1:$HW_PORT "$fe" "headwater $LAYOUT $1 speedup $SPEEDUP processes $PROCESSES"
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
  local mockers=()
  if [ "$LAYOUT" = disagg ]; then
    "$DYN_DIR/venv/bin/python" -m dynamo.mocker --model-path "$DYN_DIR/model" \
      --model-name deepseek-v4 --discovery-backend file --request-plane tcp --num-workers 2 \
      --disaggregation-mode prefill --num-gpu-blocks-override $BLOCKS "${MOCKER[@]}" \
      >"$DYN_DIR/logs/trace-prefill.log" 2>&1 &
    mockers+=($!)
    "$DYN_DIR/venv/bin/python" -m dynamo.mocker --model-path "$DYN_DIR/model" \
      --model-name deepseek-v4 --discovery-backend file --request-plane tcp --num-workers 2 \
      --disaggregation-mode decode --num-gpu-blocks-override $BLOCKS "${MOCKER[@]}" \
      >"$DYN_DIR/logs/trace-decode.log" 2>&1 &
    mockers+=($!)
  else
    "$DYN_DIR/venv/bin/python" -m dynamo.mocker --model-path "$DYN_DIR/model" \
      --model-name deepseek-v4 --discovery-backend file --request-plane tcp --num-workers 4 \
      --num-gpu-blocks-override $BLOCKS "${MOCKER[@]}" >"$DYN_DIR/logs/trace-mocker.log" 2>&1 &
    mockers+=($!)
  fi
  wait_ready http://127.0.0.1:$DYN_PORT
  sleep 3  # every mocker worker registered
  replay http://127.0.0.1:$DYN_PORT "$fe" "dynamo $LAYOUT $1 speedup $SPEEDUP"
  kill "$fe" "${mockers[@]}"
  wait "$fe" "${mockers[@]}" 2>/dev/null || true
}

if [[ " $PEERS " == *" dynamo "* ]]; then  # the peer, installed once (~60 s)
  # shellcheck source=/dev/null
  source "$HERE/scripts/peers/dynamo/env.sh"
  [ -x "$DYN_DIR/venv/bin/python" ] || bash "$HERE/scripts/peers/dynamo/install.sh" >&2
fi
uptime >&2
for _ in $(seq "$ROUNDS"); do
  for peer in $PEERS; do
    for router in $ROUTERS; do "$peer" "$router"; done
  done
done
uptime >&2
