#!/usr/bin/env bash
# The default target on viasd's own model modules (after) against transformers' (before: a checkout of 78350ec's src/)
# on the held-out report split, one task per category, 128 new tokens: speeds side by side and exact outputs equal.
# Then `via` (the shipped profile, code now verified by the full target) on the report split's HumanEval problems,
# whose tokens are compared with the fast mode's of 2026-12-06 (benchmarks/2026-12-06-via-quality-xeon).
#   BEFORE=/path/to/78350ec/src AFTER=/path/to/this/src bash benchmarks/2026-12-07-own-modules-xeon/run.sh
set -euo pipefail
cd "$(dirname "$0")"
for round in 1 2; do
    PYTHONPATH="$BEFORE" viasd bench --split report --count 1 --methods plain,auto --out "before-$round"
    PYTHONPATH="$AFTER" viasd bench --split report --count 1 --methods plain,auto --out "after-$round"
done
PYTHONPATH="$AFTER" viasd bench --split report --count 0 --humaneval 164 --max-new-tokens 64 \
    --category-max-new-tokens humaneval=192 --methods via --out via-humaneval
python compare.py
