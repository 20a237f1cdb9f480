#!/usr/bin/env bash
# The serving table: `qwen35-tvm serve` on 127.0.0.1, then `qwen35-tvm bench` from the same host
# at concurrency 1, 8 and 16 and at a Poisson rate of 16 requests/s (1,024-token prompts,
# 256 output tokens, EOS ignored).
# Usage: benchmarks/serving.sh ARTIFACT OUT_DIR [PROMPTS_PER_LEVEL] [MAX_BATCH]
set -euo pipefail
art=$1 out=$2 n=${3:-16} max_batch=${4:-16}
cli=(python3 -m qwen35_tvm.cli.main)
port=${PORT:-8000}
url=http://127.0.0.1:$port
mkdir -p "$out"
# SERVE_ARGS: more `serve` options (e.g. --mixed-step-share 0.5); LEVELS: the concurrencies;
# PORT: the server's (default 8000); BENCH_ARGS: more `bench` options (e.g. sampled traffic:
# --temperature 0.7 --top-p 0.8 --top-k 20)
"${cli[@]}" serve "$art" --device "${DEVICE:-cuda}" --max-batch "$max_batch" --port "$port" ${SERVE_ARGS:-} >"$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 1 180); do
  curl -sf "$url/health" >/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$out/server.log"; exit 1; }
  sleep 1
done
bench() {  # NAME [extra args]
  local name=$1
  shift
  "${cli[@]}" bench --url $url --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-256}" --num-prompts "$n" \
    --logprobs --out "$out/$name.json" --plot "$out/$name.png" ${BENCH_ARGS:-} "$@"
  local rc=$?
  # the server's step histograms so far (cumulative over the levels run before this one)
  curl -s "$url/metrics" >"$out/$name.metrics.txt" || true
  return $rc
}
bench levels --concurrency "${LEVELS:-1,8,16}" || true
bench qps16 --concurrency 16 --request-rate 16 || true
curl -s "$url/metrics" | grep -E '^[a-z0-9_]+(requests_total|generation_tokens_total)' || true
