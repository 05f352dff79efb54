#!/usr/bin/env bash
# The low-bit kernels' prefetch into L1 (as shipped, locality 3) against L2 (locality 2), alternated twice: whole
# passes of the fast mode, then 8 report tasks end to end. It edits src/viasd/kernels/lowbit.h in place (viasd
# rebuilds its kernels when their sources change) and restores it on exit. Run from the repo root, .venv active,
# on a quiet machine.
set -euo pipefail
header=src/viasd/kernels/lowbit.h
trap 'git checkout -- "$header"' EXIT
hint() { sed -i "s/__builtin_prefetch(at + PREFETCH + 64 \* i, 0, [0-3]);/__builtin_prefetch(at + PREFETCH + 64 * i, 0, $1);/" "$header"; }
for run in 1 2; do
    for locality in 3 2; do
        hint "$locality"
        echo "locality $locality, run $run"
        python scripts/verification_costs.py --rows 1,4,8 --repeats 5
    done
done
for run in 1 2; do
    for locality in 2 3; do
        hint "$locality"
        viasd bench --split report --categories translation:1,summarization:1,qa:1,math_reasoning:1,rag:1,writing:1,coding:1,reasoning:1 \
            -n 128 --methods plain,sd:drafter=lookup+head --out "/tmp/lowbit-ab-l$locality-$run"
    done
done
