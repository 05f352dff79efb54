#!/usr/bin/env bash
# Peak memory, start-up and decoding speed of viasd's default target path (the model as its GGUF file stores it)
# against llama.cpp's Python binding on the same files, each command run alone, one after another.
#   bash benchmarks/2026-12-06-gguf-native-zen4/run.sh FILE [FILE ...] > results.jsonl
# FILE: a GGUF file, or the name of a default model (its cached file). Synthetic 7B-14B-shape files come from
# scripts/synthetic_gguf.py (random weights: speed and memory only, never quality).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
tokens="${TOKENS:-64}"
prompt="${PROMPT:-Write a Python function that merges two sorted lists.}"
for spec in "$@"; do
    file="$spec"
    if [ ! -f "$file" ]; then
        file="$(python -c "from viasd.models.fetch import ensure_default_gguf; print(ensure_default_gguf('$spec'))")"
    fi
    for runtime in viasd llama.cpp; do
        log="$(mktemp)"
        if [ "$runtime" = viasd ]; then
            /usr/bin/time -f "%M %e" -o "$log.time" viasd generate --target "$spec" --method "${METHOD:-plain}" \
                -n "$tokens" --min-tokens "$tokens" --json "$prompt" > "$log" 2> "$log.err" || { cat "$log.err" >&2; exit 1; }
            line="$(python -c "
import json, sys
out = json.load(open('$log'))
s = out['stats']
print(json.dumps({'runtime': 'viasd', 'method': out.get('method'), 'first_token_seconds': round(s['first_token_seconds'], 3),
                  'tokens': s['new_tokens'], 'decode_tokens_per_second': round(s['decode_tokens_per_second'], 3)}))")"
        else
            /usr/bin/time -f "%M %e" -o "$log.time" python "$here/../2026-12-06-gguf-native/llama_run.py" "$file" "$tokens" "$prompt" > "$log"
            line="$(cat "$log")"
        fi
        read -r peak wall < "$log.time"
        python -c "
import json
row = json.loads('''$line''')
row.update(file='$(basename "$file")', peak_gb=round($peak / 1e6, 3), wall_seconds=$wall)
print(json.dumps(row))"
        rm -f "$log" "$log.time" "$log.err"
    done
done
