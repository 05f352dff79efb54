#!/usr/bin/env bash
# The native bf16 kernel's row limit (NATIVE_MAX_ROWS in src/viasd/passes/bf16_linear.py) at 16 and at 40, alternated
# twice on the 8 report tasks with the dense target; run from the repo root, the repo's .venv active, on a quiet
# machine. It edits the constant in place and leaves it at 40.
set -euo pipefail
out=benchmarks/2026-12-05-first-token-zen4/native-rows
file=src/viasd/passes/bf16_linear.py
for i in 1 2; do
    for rows in 16 40; do
        sed -i "s/^NATIVE_MAX_ROWS = .*/NATIVE_MAX_ROWS = $rows/" "$file"
        viasd bench --quant none --split report \
            --categories translation:1,summarization:1,qa:1,math_reasoning:1,rag:1,writing:1,coding:1,reasoning:1 \
            -n 128 --methods auto,via --out "$out/rows$rows-$i"
    done
done
sed -i "s/^NATIVE_MAX_ROWS = .*/NATIVE_MAX_ROWS = 40/" "$file"
