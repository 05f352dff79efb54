#!/usr/bin/env bash
# Issue 62's "behaviour unchanged, not slower": the report split's 16 held-out tasks with the code before the
# restructuring (commit 1e292e2, a worktree at $BEFORE) and after it (this checkout), one after the other on an idle
# machine; the after run also has suffix drafting with the head on this prose and code mix.
set -euo pipefail
cd "$(dirname "$0")"
BEFORE=${BEFORE:-/tmp/before}
TASKS=translation:2,summarization:2,qa:2,math_reasoning:2,rag:2,writing:2,coding:2,reasoning:2
PYTHONPATH="$BEFORE/src" viasd bench --split report --categories "$TASKS" -n 128 --methods plain,auto --out before
viasd bench --split report --categories "$TASKS" -n 128 --methods plain,auto,sd:drafter=suffix+head --out after
