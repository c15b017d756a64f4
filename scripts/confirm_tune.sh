#!/usr/bin/env bash
# The confirmation run of docs/benchmarks.md ("tessera tune"): `tessera bench serve` against two
# InferenceService files (the defaults and tessera tune's tuned.yaml), each started with
# `tessera up`, rounds alternated, at one rate and one goodput SLO.
#
#   scripts/confirm_tune.sh examples/tune-bench.yaml bench-results/tune-bench/tuned.yaml 32 tpot:30
set -euo pipefail
cd "$(dirname "$0")/.."
defaults=$1 tuned=$2 rate=$3 slo=$4
out=${OUT:-bench-results/tune-confirm}
mkdir -p "$out"

run() {  # $1 resource file, $2 tag, $3 round
    local http grpc up
    http=$(.venv/bin/python -c "from tessera.child_process import free_port; print(free_port())")
    grpc=$(.venv/bin/python -c "from tessera.child_process import free_port; print(free_port())")
    .venv/bin/tessera up -f "$1" --models-dir models --http-port "$http" --grpc-port "$grpc" --no-pin \
        --log-dir "$out/logs-$2-$3" > "$out/up-$2-$3.log" 2>&1 &
    up=$!
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$http/health" > /dev/null && break; sleep 1; done
    .venv/bin/tessera bench serve --base-url "http://127.0.0.1:$http/v1" --model bench --tokenizer models/bench \
        --num-prompts 150 --max-prompt-len 1024 --max-output-len 64 --request-rates "$rate" --num-warmups 150 \
        --goodput "$slo" --metric-percentiles 50,99 --disable-tqdm --output-json "$out/$2-$3.json" \
        > "$out/serve-$2-$3.log" 2>&1
    kill -TERM "$up"
    wait "$up" || true
}

for round in 1 2; do
    if [ "$round" = 1 ]; then order="defaults tuned"; else order="tuned defaults"; fi
    for tag in $order; do
        if [ "$tag" = defaults ]; then run "$defaults" "$tag" "$round"; else run "$tuned" "$tag" "$round"; fi
    done
done
.venv/bin/python - "$out" <<'PY'
import json, sys
from pathlib import Path
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    run = json.loads(path.read_text())["runs"][0]
    print(path.stem, {k: run[k] for k in ("request_goodput", "request_throughput", "median_tpot_ms", "p99_tpot_ms",
                                          "median_ttft_ms", "p99_ttft_ms")})
PY
