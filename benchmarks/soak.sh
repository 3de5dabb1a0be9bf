#!/usr/bin/env bash
# Soak run (issue 12): `pagedserve serve` under a mixed streaming load for DURATION seconds (default 600)
# with 20% of the streams dropped part-way by the client. Reports errors by status, the server's RSS at
# start and end, and KV usage once the load is over (must be 0: only the prefix cache's cached-free
# blocks may remain). Writes benchmarks/soak.json.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-600}
PORT=${PORT:-8123}
.venv/bin/pagedserve serve --port "$PORT" --log-interval 60 > /tmp/pagedserve-soak.log 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 1
done
.venv/bin/pagedserve bench serve --base-url "http://127.0.0.1:$PORT" --duration "$DURATION" --abort-fraction 0.2 \
    --max-concurrency 16 --num-prompts 64 --input-len 64 --output-len 64 --quiet --json benchmarks/soak.json \
    > /dev/null
.venv/bin/python - <<'PY'
import json
r = json.load(open("benchmarks/soak.json"))
keys = ("num_prompts", "completed", "dropped", "failed", "errors_by_status", "output_tokens_per_s", "ttft_s_p50",
        "ttft_s_p99", "server_start", "server_end")
print(json.dumps({k: r[k] for k in keys}, indent=1))
PY
