#!/usr/bin/env bash
# The edit workload (bench/edits.py) on the report split: suffix drafting against prompt lookup with the draft
# head (auto's choice here), plain decoding and llama.cpp (plain and its prompt lookup) on the same file.
set -euo pipefail
cd "$(dirname "$0")"
viasd bench --split report \
    --categories edit_types:2,edit_rename:3,edit_fix:3,edit_comprehension:2,chat_revise:3 \
    --methods plain,sd:drafter=lookup+head,sd:drafter=suffix+head,sd:drafter=suffix,llama.cpp,llama.cpp:lookup=10 \
    -n 256 --code-max-new-tokens 384 --out bench
