"""How one method compares with another in a `viasd bench` run: per-task speed ratios, their geometric mean,
10th-90th percentile and how many tasks the method was faster on.

    python scripts/method_ratio.py benchmarks/2026-11-30-cpu-pregate via:pregate=0.3 via
"""

from __future__ import annotations

import argparse
from pathlib import Path

from viasd.bench.metrics import ALL, per_prompt_speedups, summarize
from viasd.bench.report import RESULTS_JSONL
from viasd.bench.runner import read_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a bench output directory")
    parser.add_argument("method")
    parser.add_argument("baseline")
    args = parser.parse_args()
    rows, _ = read_rows(args.run / RESULTS_JSONL)
    methods = {r["method"] for r in rows}
    missing = [m for m in (args.method, args.baseline) if m not in methods]
    if missing:
        raise SystemExit(f"{args.run}: no rows for {', '.join(missing)}; methods: {', '.join(sorted(methods))}")
    good = [r for r in rows if not r.get("error")]
    ratios = [v for (m, _), v in per_prompt_speedups(good, args.baseline).items() if m == args.method]
    s = next(s for s in summarize(good, args.baseline) if s.method == args.method and s.category == ALL)
    faster = sum(v > 1.0 for v in ratios)
    print(
        f"{args.method} over {args.baseline}: {s.speedup:.3f}x (geometric mean over {len(ratios)} tasks), "
        f"10th-90th percentile {s.speedup_p10:.2f}-{s.speedup_p90:.2f}x, faster on {faster} of {len(ratios)} tasks"
    )


if __name__ == "__main__":
    main()
