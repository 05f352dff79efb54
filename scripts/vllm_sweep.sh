#!/usr/bin/env bash
# vLLM's server on the default target, without speculation, with vLLM's own methods and with viasd's proposers,
# one at a time, each swept with scripts/serve_sweep.sh (aiperf, Spec-Bench prompts) at the given concurrencies.
#
#   scripts/vllm_sweep.sh OUT [CONCURRENCIES...]          (default: 1 4 8; run in the environment vLLM is in)
#
# OUT/<config>/ gets the sweep of each config and OUT/<config>.server.log its server's log (viasd's statistics
# lines included). CONFIGS='none hybrid' picks configs; AIPERF as for serve_sweep.sh.
set -euo pipefail
out=$1
shift
[ $# -gt 0 ] && concurrencies=("$@") || concurrencies=(1 4 8)
here=$(cd "$(dirname "$0")/.." && pwd)
target=$(python -c 'from viasd.models.fetch import ensure_default_model as e; print(e("qwen2.5-coder-1.5b"))')
drafter=$(python -c 'from viasd.models.fetch import ensure_default_model as e; print(e("qwen2.5-coder-0.5b"))')
port=8321
declare -A spec=(
  [none]=''
  [ngram]='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
  [draft_model]="{\"method\": \"draft_model\", \"model\": \"$drafter\", \"num_speculative_tokens\": 4}"
  [hybrid]='{"method": "custom_class", "model": "viasd.vllm.proposer.HybridProposer", "num_speculative_tokens": 4}'
  [cascade]='{"method": "custom_class", "model": "viasd.vllm.cascade.CascadeProposer", "num_speculative_tokens": 4}'
)
mkdir -p "$out"
for config in ${CONFIGS:-none ngram draft_model hybrid cascade}; do
  # vLLM's OpenAI-compatible server as a module: the CPU build's `vllm` command (0.32) fails before it starts,
  # looking for its own version under the CUDA build's package name.
  args=(-m vllm.entrypoints.openai.api_server --model "$target" --port "$port" --dtype bfloat16 --max-model-len 4096 --max-num-seqs 8
        --kv-cache-memory-bytes 2147483648 --served-model-name qwen2.5-coder-1.5b)
  [ -n "${spec[$config]}" ] && args+=(--speculative-config "${spec[$config]}")
  python "${args[@]}" > "$out/$config.server.log" 2>&1 &
  server=$!
  ready=0
  for _ in $(seq 600); do
    if curl -sf "http://localhost:$port/v1/models" > /dev/null; then ready=1; break; fi
    if ! kill -0 $server 2>/dev/null; then break; fi
    sleep 1
  done
  if [ $ready = 1 ]; then
    "$here/scripts/serve_sweep.sh" "$out/$config" "http://localhost:$port" qwen2.5-coder-1.5b "$target" \
      "${concurrencies[@]}"
  else
    echo "$config: the server did not start (see $out/$config.server.log)"
  fi
  kill $server 2>/dev/null || true
  wait $server 2>/dev/null || true
done
