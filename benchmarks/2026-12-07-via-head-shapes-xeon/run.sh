#!/usr/bin/env bash
# Does VIA-SD's slim tier pay with the draft head as its drafter, at 1.5B, 7B and 14B, on this CPU? Each size's pass
# costs (the file's blocks; a fifth of the layers skipped; the draft head) measured here, the shipped head profile's
# gate records (the default pair's, regenerated from its calibration prompts) replayed with them: once with the
# profile's own policy, once with the policies re-selected for that size as `viasd calibrate` selects them.
#   SYNTH=/a/folder/with/room bash benchmarks/2026-12-07-via-head-shapes-xeon/run.sh
# The 7B and 14B files are synthetic (scripts/synthetic_gguf.py: random blocks of the Q4_K_M mix at real shapes, 4.7
# and 9.0 GB): pass costs only, never quality. Their heads are random ones of the shipped design: the same work.
set -euo pipefail
cd "$(dirname "$0")"
SYNTH=${SYNTH:?name a folder for the synthetic files}
PROFILE=../../src/viasd/profiles/head__qwen2.5-coder-1.5b.gguf.json
declare -A TARGETS=(
    [qwen2.5-coder-1.5b]=qwen2.5-coder-1.5b
    [qwen2.5-7b-shape]=$SYNTH/qwen2.5-7b-shape-q4_k_m.gguf
    [qwen2.5-14b-shape]=$SYNTH/qwen2.5-14b-shape-q4_k_m.gguf
)
for shape in qwen2.5-7b qwen2.5-14b; do
    file=$SYNTH/$shape-shape-q4_k_m.gguf
    [ -f "$file" ] || python ../../scripts/synthetic_gguf.py --shape "$shape" --out "$file"
done
# Pass costs first, each alone on the machine; then the projections (no timing).
for name in qwen2.5-coder-1.5b qwen2.5-7b-shape qwen2.5-14b-shape; do
    viasd costs --target "${TARGETS[$name]}" --views gguf,skip=0.22+gguf --head --tokens 1,2,3,4,5,6,7,8,12,16 \
        --context 256 --repeats 3 --out "costs-$name.json" 2>&1 | tee "costs-$name.log"
done
for name in qwen2.5-coder-1.5b qwen2.5-7b-shape qwen2.5-14b-shape; do
    for how in profiled reselected; do
        viasd project --costs "costs-$name.json" --profile "$PROFILE" --full gguf --slim skip=0.22+gguf \
            $([ $how = reselected ] && echo --reselect) --work "${WORK:-records.work}" \
            --out "projection-$name-$how.json" 2>&1 | tee "projection-$name-$how.log"
    done
done
