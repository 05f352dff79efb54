"""Does VIA-SD's slim tier pay at 1.5B, 7B and 14B on this CPU? The shipped gguf profile's gate records (the default
pair's, regenerated from its calibration prompts) replayed with each size's measured pass costs, the round policy
re-selected per size as `viasd calibrate` selects it (thresholds, gamma, cap, pre-gate, stop), against classic sd
selected on the same records and costs.

    python benchmarks/2026-12-06-via-gguf-zen4/reselect_at_shapes.py WORK.json > reselect-at-shapes.txt

WORK.json: the work file of an earlier `viasd project --profile ... --work WORK.json` (else the records are made
again, about a minute). The records are the 1.5B pair's: at 7B and 14B the slim view's agreement and the drafts'
acceptance are the 1.5B's, a stand-in (deeper models lose less to a skipped layer).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from viasd.calibration.projection import costs_from_record
from viasd.calibration.reselection import profile_data
from viasd.calibration.selection import select_policy
from viasd.calibration.workfile import WorkFile
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.profile import GGUF_PROFILE, load_profile, shipped_profile_path

HERE = Path(__file__).parent
SIZES = {
    "qwen2.5-coder-1.5b (real)": "costs-qwen2.5-coder-1.5b.json",
    "Qwen2.5-7B shape (synthetic)": "costs-qwen2.5-7b-shape.json",
    "Qwen2.5-14B shape (synthetic)": "costs-qwen2.5-14b-shape.json",
}


def main(work: str | None) -> None:
    path = shipped_profile_path(GGUF_PROFILE)
    assert path is not None
    profile = load_profile(path)
    engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_DRAFTER))
    records, _ = profile_data(profile, engine.target, engine.drafter, WorkFile(work))
    for size, name in SIZES.items():
        record = json.loads((HERE / name).read_text())
        costs, _ = costs_from_record(record, ["skip=0.22+gguf"], 256, full="gguf", drafter="int4a8")
        for budget in (0.002, 0.02):
            chosen = select_policy(
                records, costs, quality_budget=budget, pregates=(0.0, 0.5, 0.7, 0.9), stops=(0.0, 0.3, 0.5)
            )
            via, sd = chosen.prediction, chosen.sd_prediction
            out = chosen.to_dict()["via"]
            decided = via.decided
            total = sum(decided.values()) or 1
            shares = "/".join(f"{tier} {count / total:.0%}" for tier, count in decided.items())
            print(
                f"{size}, quality budget {budget}: plain {chosen.plain_tokens_per_second:.2f} tok/s, "
                f"sd {sd.tokens_per_second:.2f} ({sd.tokens_per_second / chosen.plain_tokens_per_second:.2f}x), "
                f"via {via.tokens_per_second:.2f} ({via.tokens_per_second / sd.tokens_per_second:.3f}x sd), "
                f"errors {via.error_rate:.4f}; tiers {shares}; via policy {out['policy']}"
            )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
