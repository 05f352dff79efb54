#!/usr/bin/env bash
# The device check (docs/gpu.md): on a machine with a GPU and no network, from a checkout of this repository,
#   1. the CUDA tests on tiny models (tests/test_cuda.py: exactness, chi-square, device reads and syncs per round),
#   2. pass costs of two large shapes with random weights made on the GPU (no checkpoint is fetched):
#      Qwen2.5-32B with a Qwen2.5-0.5B drafter and Gemma2-27B with a Gemma2-2B drafter, bf16, the full target and
#      slim views with 25/35/45% of the layers skipped, M = 1..16 tokens per pass (and prompt lengths) at
#      three context lengths,
#   3. projections of plain, sd and via onto those costs, from explicit statistics (labelled as assumed),
# every result written under OUT. It keeps to a time budget (default 450 s; each step gets what is left),
# so it ends within 8 minutes on one H200.
#
#   scripts/device_check.sh OUT            on a GPU
#   scripts/device_check.sh OUT --cpu      the smoke test: the same steps on a CPU with small shapes
#
# Environment: PYTHON (default python3; a Python whose torch sees the device), VIASD_WHEELS (a folder of wheels:
# packages missing next to that torch are installed from it, offline), DEVICE_CHECK_BUDGET (seconds). viasd itself
# runs from src/ (PYTHONPATH); nothing is fetched from the network.
set -u -o pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 OUT [--cpu]" >&2
    exit 2
fi
OUT=$1
MODE=${2:-gpu}
case "$MODE" in gpu | --gpu) MODE=gpu ;; --cpu) MODE=cpu ;; *) echo "unknown option $MODE (--cpu)" >&2; exit 2 ;; esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
BUDGET=${DEVICE_CHECK_BUDGET:-450}
START=$(date +%s)
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
cd "$ROOT" || exit 2

if [ "$MODE" = gpu ]; then
    DEVICE=cuda
    DTYPE=bf16
    PAIRS="qwen2.5-32b:qwen2.5-0.5b gemma2-27b:gemma2-2b"
    TOKENS=1,2,3,4,5,6,8,12,16,32,64,256
    CONTEXTS=256,1024,4096
    PROJECT_CONTEXT=1024
    REPEATS=5
else
    DEVICE=cpu
    DTYPE=fp32 # torch's one-row bf16 kernels are slow on many CPUs; the smoke test checks the steps, not speed
    PAIRS="qwen2.5-0.5b:qwen2.5-0.5b"
    TOKENS=1,2,4
    CONTEXTS=16,32
    PROJECT_CONTEXT=32
    REPEATS=1
fi
VIEWS=full,skip=0.25,skip=0.35,skip=0.45
FAILED=0

left() { echo $((BUDGET - ($(date +%s) - START))); }

# step NAME CAP COMMAND...: run COMMAND with at most CAP seconds (less when the budget runs short), its output in
# OUT/NAME.txt, and a line in summary.txt.
step() {
    local name=$1 cap=$2
    shift 2
    local limit
    limit=$(left)
    [ "$limit" -gt "$cap" ] && limit=$cap
    if [ "$limit" -lt 10 ]; then
        echo "$name: skipped (out of time)" | tee -a "$SUMMARY"
        FAILED=1
        return
    fi
    local began status
    began=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    status=$?
    local took=$(($(date +%s) - began))
    if [ $status -eq 0 ]; then
        echo "$name: ok (${took} s)" | tee -a "$SUMMARY"
    else
        [ $status -eq 124 ] && why="timed out after ${limit} s" || why="exit $status"
        echo "$name: FAILED, $why (${took} s); see $name.txt" | tee -a "$SUMMARY"
        FAILED=1
    fi
}

# The Python: its own torch, and the other packages from VIASD_WHEELS when they are missing.
NEEDED="transformers tokenizers safetensors typer rich psutil pytest"
missing() { "$1" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" $NEEDED; }
if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "$PY has no torch: set PYTHON to the Python whose torch sees the device" | tee -a "$SUMMARY"
    exit 2
fi
if ! missing "$PY"; then
    if [ -z "${VIASD_WHEELS:-}" ]; then
        echo "$PY lacks some of: $NEEDED; set VIASD_WHEELS to a folder of their wheels (docs/gpu.md)" | tee -a "$SUMMARY"
        exit 2
    fi
    # Into the Python's own environment (the machine is lent and wiped after), where pip counts its torch and
    # numpy as installed; a read-only or externally managed one gets a user install instead.
    offline=(-m pip install -q --no-index --find-links "$VIASD_WHEELS")
    timeout 120 "$PY" "${offline[@]}" $NEEDED >"$OUT/pip.txt" 2>&1 ||
        timeout 120 "$PY" "${offline[@]}" --user --break-system-packages $NEEDED >>"$OUT/pip.txt" 2>&1
    if ! missing "$PY"; then
        echo "installing from $VIASD_WHEELS did not provide: $NEEDED (see pip.txt)" | tee -a "$SUMMARY"
        exit 2
    fi
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    echo "torch sees no CUDA device here: run with --cpu for the smoke test" | tee -a "$SUMMARY"
    exit 2
fi

"$PY" - "$OUT/environment.json" "$MODE" <<'EOF'
import json, os, platform, subprocess, sys, torch, transformers
info = {"mode": sys.argv[2], "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "cpu_count": os.cpu_count()}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), gpus=torch.cuda.device_count())
try:
    info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
except OSError:
    info["commit"] = None
json.dump(info, open(sys.argv[1], "w"), indent=2)
EOF
echo "environment: $(tr -d '\n' <"$OUT/environment.json" | tr -s ' ')" | tee -a "$SUMMARY"
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1

step tests 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py --junitxml "$OUT/tests.xml"

for pair in $PAIRS; do
    target=${pair%%:*}
    drafter=${pair##*:}
    step "costs-$target" 110 "$PY" -m viasd costs --shape "$target" --drafter-shape "$drafter" --views "$VIEWS" \
        --tokens "$TOKENS" --context "$CONTEXTS" --repeats "$REPEATS" --dtype "$DTYPE" --device "$DEVICE" \
        --out "$OUT/costs-$target.json"
done

# Illustrative statistics, labelled as assumed: the default pair's calibration rates (Qwen2.5-Coder 0.5B -> 1.5B:
# 92% of draft tokens are the target's, the slim view's top token is right at 88% of positions, its gate puts
# about 60/30/10% of positions in the accept/slim/full tiers), as if they held at this scale.
for pair in $PAIRS; do
    target=${pair%%:*}
    [ -f "$OUT/costs-$target.json" ] || continue
    for slim in skip=0.25 skip=0.45; do
        step "projection-$target-$slim" 30 "$PY" -m viasd project --costs "$OUT/costs-$target.json" \
            --acceptance 0.92 --tiers 0.6,0.3,0.1 --slim-agreement 0.88 --slim "$slim" --gamma 4 --cap 16 \
            --context "$PROJECT_CONTEXT" --out "$OUT/projection-$target-$slim.json"
    done
done

echo "total: $(($(date +%s) - START)) s of a $BUDGET s budget; results in $OUT" | tee -a "$SUMMARY"
exit $FAILED
