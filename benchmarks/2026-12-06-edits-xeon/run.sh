#!/usr/bin/env bash
# The edit workload (bench/edits.py) on the report split, each method copying only from its own earlier answers
# (one suffix store per method, emptied after the warm-up): suffix drafting alone and with the draft head, auto (the
# default), plain decoding, and llama.cpp on the same file: llama-server plain and with its n-gram drafter
# (ngram-map-k, 64 tokens a round as its docs run it), and the Python binding's prompt lookup.
#   VIASD_LLAMA_SERVER=/path/to/llama-server bash benchmarks/2026-12-06-edits-xeon/run.sh
set -euo pipefail
cd "$(dirname "$0")"
viasd bench --split report \
    --categories edit_types:2,edit_rename:3,edit_fix:3,edit_comprehension:2,chat_revise:3 \
    --methods plain,auto,sd:drafter=suffix+head,sd:drafter=suffix,llama-server,llama-server:draft=ngram-map-k:gamma=64,llama.cpp:lookup=10 \
    -n 256 --code-max-new-tokens 384 --out bench
