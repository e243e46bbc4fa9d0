#!/usr/bin/env bash
# The stall detector's cost at a short-prompt load: frontend CPU per request with the
# instrumentation on (the default) and off (--no-instrument), alternating, on loopback.
# Usage: bash scripts/bench_instrument_on_off.sh [ROUNDS] [REQUESTS]   (from the repository root)
# One frontend process (--processes 1): the CPU measured is that process's.
set -euo pipefail
rounds=${1:-3}
requests=${2:-1500}
py=.venv/bin/python
for round in $(seq "$rounds"); do
  for flag in "" "--no-instrument"; do
    port=$($py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    $py -m headwater serve --port "$port" --processes 1 --speedup-ratio 1000 $flag \
      --log-level warning >/dev/null &
    pid=$!
    trap 'kill $pid 2>/dev/null || true' EXIT
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
    label="instrument ${flag:-on}"
    $py -m scripts.bench.loadgen --url "http://127.0.0.1:$port" --scenario short \
      --concurrency 16 --requests "$requests" --pid "$pid" --label "$label round $round" --no-progress \
      | grep "^{"
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done
