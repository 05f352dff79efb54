#!/usr/bin/env bash
# A concurrency sweep of an OpenAI-compatible server with aiperf (a maintained load generator), on Spec-Bench prompts.
#
#   scripts/serve_sweep.sh OUT URL MODEL TOKENIZER_DIR [CONCURRENCIES...]     (default concurrencies: 1 2 4 8 16)
#
# OUT gets one aiperf run per concurrency (OUT/cN/profile_export_aiperf.json and its log); then
# `python scripts/serve_sweep_report.py OUT...` tabulates and plots one or several sweeps side by side.
# aiperf is installed apart from viasd (its dependencies are its own): python3 -m venv /tmp/aiperf &&
# /tmp/aiperf/bin/pip install aiperf; AIPERF=/tmp/aiperf/bin/aiperf. Requests: the first 64 development
# questions of Spec-Bench (viasd's bench data), 64 new tokens each, greedy, streamed; 4 requests per client
# (at least 12), one warm-up. The load generator shares the machine with the server: on a 2-core machine its own
# processes take CPU from both servers alike. EXTRA='{...}' adds fields to every request:
# '{"method": "plain"}' picks one of the methods `viasd serve --methods` loaded; '{"cache_prompt": false}' keeps
# llama.cpp's server from reusing a prompt it saw in an earlier run of the sweep (the runs replay the same prompts).
set -euo pipefail
out=$1 url=$2 model=$3 tokenizer=$4
shift 4
[ $# -gt 0 ] && concurrencies=("$@") || concurrencies=(1 2 4 8 16)
aiperf=${AIPERF:-aiperf}
extra=$(python3 -c 'import json, sys; print(json.dumps({"max_tokens": 64, "temperature": 0, "ignore_eos": True,
    **json.loads(sys.argv[1])}))' "${EXTRA:-{\}}")
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
python3 - "$here/src/viasd/bench/data/question_dev.jsonl" "$out/prompts.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
with open(sys.argv[2], "w", encoding="utf-8") as out:
    for row in rows[:64]:
        out.write(json.dumps({"text": row["turns"][0]}) + "\n")
PY
# aiperf 0.13's timing manager polls without sleeping while every concurrency slot is busy: a core's worth of CPU
# that, on a 2-core machine, would be taken from the server under test. It only hands out the next request when a
# slot frees, so it runs at the lowest priority (its timestamps are taken by other aiperf processes, left as they are).
quiet_timing_manager() {
  for _ in $(seq 120); do
    sleep 0.5
    if pids=$(pgrep -f "aiperf timing_manager"); then renice -n 19 -p $pids > /dev/null; return; fi
  done
}
for c in "${concurrencies[@]}"; do
  requests=$(( c * 4 > 12 ? c * 4 : 12 ))
  "$aiperf" profile -m "$model" --url "$url" --endpoint-type chat --streaming \
    --input-file "$out/prompts.jsonl" --custom-dataset-type single-turn --tokenizer "$tokenizer" \
    --concurrency "$c" --request-count "$requests" --warmup-request-count 1 \
    --extra-inputs "$extra" --ui-type simple \
    --artifact-dir "$out/c$c" > "$out/c$c.log" 2>&1 &
  quiet_timing_manager
  wait $!
  echo "concurrency $c: done ($out/c$c)"
done
