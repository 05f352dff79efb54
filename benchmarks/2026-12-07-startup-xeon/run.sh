#!/usr/bin/env bash
# Warm start-up: the whole `viasd generate -n 1 "Hi"` (default method), by the code before this stop's start-up
# changes (BEFORE: a checkout of 78350ec's src/) and after (this tree), against llama.cpp's Python binding loading
# the same file and generating one token; alternated, each alone; then the import floors each start pays.
#   BEFORE=/path/to/78350ec/src bash benchmarks/2026-12-07-startup-xeon/run.sh [REPEATS] > startup.jsonl
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
file="$(python -c "from viasd.models.fetch import ensure_default_gguf; print(ensure_default_gguf('qwen2.5-coder-1.5b'))")"
timed() {  # LABEL COMMAND...: one JSON line of wall seconds and peak memory
    local label="$1"; shift
    /usr/bin/time -f "%M %e" -o /tmp/startup.time "$@" > /dev/null 2>&1
    read -r peak wall < /tmp/startup.time
    echo "{\"run\": \"$label\", \"wall_seconds\": $wall, \"peak_gb\": $(python -c "print(round($peak / 1e6, 3))")}"
}
PYTHONPATH="$BEFORE" viasd generate -n 1 "Hi" > /dev/null 2>&1  # the old code's auto choice read once (or probed)
viasd generate -n 1 "Hi" > /dev/null 2>&1
for _ in $(seq "${1:-3}"); do
    timed "viasd before" env PYTHONPATH="$BEFORE" viasd generate -n 1 "Hi"
    timed "viasd after" viasd generate -n 1 "Hi"
    timed "viasd after, plain" viasd generate --method plain -n 1 "Hi"
    timed "llama.cpp" python "$here/../2026-12-06-gguf-native/llama_run.py" "$file" 1 "Hi"
    timed "import torch" python -c "import torch"
    timed "import torch, transformers' tokenizer, cache and config code" python -c \
        "import torch, transformers.cache_utils, transformers.tokenization_utils_tokenizers, transformers.models.auto.configuration_auto"
    timed "import torch, transformers' qwen2 model code" python -c "import torch, transformers.models.qwen2.modeling_qwen2"
    timed "import llama_cpp" python -c "import llama_cpp"
done
