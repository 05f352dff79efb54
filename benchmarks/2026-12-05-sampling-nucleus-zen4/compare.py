"""Two `viasd bench` runs of the same command, before and after a change: per method, the geometric mean over tasks
of the tokens/s ratio, and how many tasks gave the same tokens.

    python compare.py BEFORE_FOLDER AFTER_FOLDER
"""

import json
import math
import sys
from pathlib import Path


def rows(folder: str) -> dict[tuple[str, str], dict]:
    lines = (Path(folder) / "results.jsonl").read_text().splitlines()
    return {(r["method"], r["key"]): r for r in map(json.loads, lines)}


before, after = rows(sys.argv[1]), rows(sys.argv[2])
for method in dict.fromkeys(m for m, _ in before):
    keys = [k for m, k in before if m == method and (m, k) in after]
    ratios = [
        after[method, k]["stats"]["tokens_per_second"] / before[method, k]["stats"]["tokens_per_second"] for k in keys
    ]
    same = sum(after[method, k]["turns"][0]["tokens"] == before[method, k]["turns"][0]["tokens"] for k in keys)
    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(
        f"{method}: {mean:.3f}x after/before over {len(keys)} tasks ({min(ratios):.2f}-{max(ratios):.2f}), "
        f"same tokens on {same} of {len(keys)}"
    )
