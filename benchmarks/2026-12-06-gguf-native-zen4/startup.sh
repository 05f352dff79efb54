#!/usr/bin/env bash
# Warm start-up: the whole `viasd generate -n 1 "Hi"` command against llama.cpp's Python binding loading the same
# file and generating one token, alternated, each alone; wall seconds and peak memory (maximum resident set).
#   bash benchmarks/2026-12-06-gguf-native-zen4/startup.sh [REPEATS] > startup.jsonl
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
file="$(python -c "from viasd.models.fetch import ensure_default_gguf; print(ensure_default_gguf('qwen2.5-coder-1.5b'))")"
for _ in $(seq "${1:-3}"); do
    for runtime in viasd llama.cpp; do
        if [ "$runtime" = viasd ]; then
            /usr/bin/time -f "%M %e" -o /tmp/startup.time viasd generate -n 1 "Hi" > /dev/null 2>&1
        else
            /usr/bin/time -f "%M %e" -o /tmp/startup.time python "$here/../2026-12-06-gguf-native/llama_run.py" "$file" 1 "Hi" > /dev/null
        fi
        read -r peak wall < /tmp/startup.time
        echo "{\"runtime\": \"$runtime\", \"wall_seconds\": $wall, \"peak_gb\": $(python -c "print(round($peak / 1e6, 3))")}"
    done
done
