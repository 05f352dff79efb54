#!/usr/bin/env bash
# VIA-SD with the target's draft head as its drafter (a profile re-selected for it), against plain, auto and via with the
# 0.5B drafter (the shipped profile), on the held-out report split, one task per category, 128 new tokens.
#   bash benchmarks/2026-12-07-via-head-xeon/run.sh
set -euo pipefail
cd "$(dirname "$0")"
SHIPPED=../../src/viasd/profiles/qwen2.5-coder-0.5b__qwen2.5-coder-1.5b.gguf.json
# The shipped profile (calibrated on the file's blocks) re-selected for the draft head: its mask kept, the head's, the
# full target's and the slim view's pass costs measured here, gate records of the head at every draft depth.
viasd calibrate --reselect "$SHIPPED" --drafters head -o profile-head.json 2>&1 | tee reselect.log
# What would make the slim tier pay with the head's drafts (looser budgets, cheaper or always-right slim views).
viasd calibrate --reselect profile-head.json --what-if -o profile-head.json --quality-budget 0.002 \
    --gammas 4,5,6,8 --stops 0,0.5 --pregates 0,0.5 > what-if.md
# Speed side by side: `via` as the issue found it (the int4a8 profile over the dense bf16 copy), `via` as shipped
# (the 0.5B drafter on the file's blocks), `via` and `via-exact` with the head's profile, against plain and auto.
INT4A8=../../src/viasd/profiles/qwen2.5-coder-0.5b__qwen2.5-coder-1.5b.int4a8.json
viasd bench --split report --count 1 --max-new-tokens 128 --out speed \
    --methods "plain,auto,via:profile=$INT4A8,via,via:profile=profile-head.json,via-exact:profile=profile-head.json"
# Quality of `via` with the head's profile beside `auto` (exact: the fast mode's text), the prose categories of the
# quality runs of record (20 report-split questions each, maths answered in 512 tokens); its code requests go to the
# full target (the profile's exact code policy), so HumanEval is the fast mode's by construction.
viasd bench --split report --categories translation:20,summarization:20,math_reasoning:20,rag:20 \
    --max-new-tokens 64 --category-max-new-tokens math_reasoning=512 --methods "auto,via:profile=profile-head.json" \
    --out quality
# After via's first round went to the full target (it reads the prompt as plain decoding does): speed again, and
# the quality of via beside auto, summarization over all 29 report-split questions, the other prose categories at 20.
viasd bench --split report --count 1 --max-new-tokens 128 --out speed-opening --methods "plain,auto,via,via-exact"
viasd bench --split report --categories summarization:29 --max-new-tokens 64 --methods "auto,via" \
    --out quality-summarization
viasd bench --split report --categories translation:20,math_reasoning:20,rag:20 --max-new-tokens 64 \
    --category-max-new-tokens math_reasoning=512 --methods "auto,via" --out quality-opening
# HumanEval, all 164 problems (the report split's 124, then the calibration split's 40), via beside auto: measured,
# not only by construction.
viasd bench --split report --count 0 --humaneval 164 --max-new-tokens 64 --category-max-new-tokens humaneval=192 \
    --methods "auto,via" --out quality-humaneval-report
viasd bench --split calibration --count 0 --humaneval 40 --max-new-tokens 64 --category-max-new-tokens humaneval=192 \
    --methods "auto,via" --out quality-humaneval-calibration
