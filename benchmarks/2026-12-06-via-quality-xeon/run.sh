#!/usr/bin/env bash
# Quality of `via` (relaxed VIA-SD on the file's blocks, the shipped routing profile) with the commands and splits
# that measured the default's quality (benchmarks/2026-12-04-quality-default-xeon: `auto`, exact, so the fast mode's
# text): 20 report-split questions per scored category and the report split's 124 HumanEval problems, then the
# calibration split's 40 (all 164 together). Quality only: it shared the machine, so its speeds are not results.
set -euo pipefail
cd "$(dirname "$0")"
viasd bench --split report --categories translation:20,summarization:20,math_reasoning:20,rag:20 --humaneval 164 \
    --max-new-tokens 64 --category-max-new-tokens humaneval=192,math_reasoning=512 --methods via --out report
viasd bench --split calibration --count 0 --humaneval 40 --max-new-tokens 64 \
    --category-max-new-tokens humaneval=192 --methods via --out calibration
# The fast mode's HumanEval the same day (report split), to tell via's change from the code's since 2026-12-04.
viasd bench --split report --count 0 --humaneval 164 --max-new-tokens 64 --category-max-new-tokens humaneval=192 \
    --methods plain --out report-plain-humaneval
