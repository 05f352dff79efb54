"""Tabulate and plot concurrency sweeps made by scripts/serve_sweep.sh: one row per server and concurrency (output
tokens/s, time to first token and inter-token latency p50/p99), and a figure of two panels (aggregate throughput;
p50 inter-token latency) against concurrency.

    python scripts/serve_sweep_report.py --plot PNG NAME=OUT [NAME=OUT ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def sweep(folder: Path) -> dict[int, dict[str, float]]:
    """Concurrency -> the figures of one aiperf run in `folder`/cN."""
    found = {}
    for run in sorted(folder.glob("c*/profile_export_aiperf.json")):
        data = json.loads(run.read_text())
        found[int(run.parent.name[1:])] = {
            "tokens_per_second": data["output_token_throughput"]["avg"],
            "ttft_p50": data["time_to_first_token"]["p50"],
            "ttft_p99": data["time_to_first_token"]["p99"],
            "itl_p50": data["inter_token_latency"]["p50"],
            "itl_p99": data["inter_token_latency"]["p99"],
            "requests": data["request_count"]["avg"],
        }
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", help="NAME=FOLDER")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    sweeps = {name: sweep(Path(folder)) for name, folder in (item.split("=", 1) for item in args.sweeps)}
    print("| server | clients | output tokens/s | x one client | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, runs in sweeps.items():
        one = runs.get(1, {}).get("tokens_per_second")
        for clients, r in sorted(runs.items()):
            scale = f"{r['tokens_per_second'] / one:.2f}x" if one else "-"
            print(f"| {name} | {clients} | {r['tokens_per_second']:.1f} | {scale} | {r['ttft_p50']:.0f} / "
                  f"{r['ttft_p99']:.0f} | {r['itl_p50']:.0f} / {r['itl_p99']:.0f} |")  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for name, runs in sweeps.items():
            clients = sorted(runs)
            left.plot(clients, [runs[c]["tokens_per_second"] for c in clients], marker="o", label=name)
            right.plot(clients, [runs[c]["itl_p50"] for c in clients], marker="o", label=name)
        left.set(title="Aggregate output tokens/s", xlabel="concurrent clients", xscale="log", xticks=clients)
        right.set(title="Inter-token latency p50 (ms)", xlabel="concurrent clients", xscale="log", xticks=clients)
        for axis in (left, right):
            axis.set_xticklabels([str(c) for c in clients])
            axis.grid(alpha=0.3)
        left.legend()
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
