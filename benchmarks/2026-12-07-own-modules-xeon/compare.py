"""Side by side: tokens/s of each method before and after (both rounds), whether after's outputs equal before's,
and whether via's HumanEval tokens equal the fast mode's of 2026-12-06. Prints a markdown table."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).parent
PLAIN = HERE.parent / "2026-12-06-via-quality-xeon" / "report-plain-humaneval" / "results.jsonl"


def rows(folder: str) -> list[dict]:
    return [json.loads(line) for line in (HERE / folder / "results.jsonl").read_text().splitlines() if line.strip()]


def tokens(row: dict) -> list[list[int]]:
    return [turn["tokens"] for turn in row["turns"]]


def main() -> None:
    speed: dict[tuple[str, str], list[float]] = defaultdict(list)
    outputs: dict[tuple[str, str, str], list[list[int]]] = {}
    for side in ("before", "after"):
        for round_ in (1, 2):
            folder = f"{side}-{round_}"
            if not (HERE / folder / "results.jsonl").is_file():
                continue
            got = rows(folder)
            for method in sorted({r["method"] for r in got}):
                mine = [r for r in got if r["method"] == method]
                new = sum(r["stats"]["new_tokens"] for r in mine)
                seconds = sum(r["stats"]["total_seconds"] for r in mine)
                speed[(side, method)].append(new / seconds)
                for r in mine:
                    outputs[(side, method, r["key"])] = tokens(r)
    print("| method | before tok/s (rounds) | after tok/s (rounds) | after / before | outputs equal |")
    print("| --- | --- | --- | --- | --- |")
    for method in sorted({m for _, m in speed}):
        before, after = speed[("before", method)], speed[("after", method)]
        keys = [k for s, m, k in outputs if s == "after" and m == method]
        equal = sum(outputs[("after", method, k)] == outputs.get(("before", method, k)) for k in keys)
        ratio = (sum(after) / len(after)) / (sum(before) / len(before)) if before and after else float("nan")
        print(f"| {method} | {', '.join(f'{v:.2f}' for v in before)} | {', '.join(f'{v:.2f}' for v in after)} "
              f"| {ratio:.3f}x | {equal}/{len(keys)} task-rounds |")
    if (HERE / "via-humaneval" / "results.jsonl").is_file():
        plain = {json.loads(line)["key"]: json.loads(line) for line in PLAIN.read_text().splitlines() if line.strip()}
        via = rows("via-humaneval")
        same = sum(tokens(r) == tokens(plain[r["key"]]) for r in via if r["key"] in plain)
        kinds = sorted({turn["stats"]["task_kind"] for r in via for turn in r["turns"]})
        unchecked = sum(turn["stats"]["unchecked_tokens"] for r in via for turn in r["turns"])
        print(f"\nvia on {len(via)} HumanEval problems: tokens equal to the fast mode's of 2026-12-06 on {same}; "
              f"task kinds read {kinds}; tokens committed unchecked: {unchecked}")


if __name__ == "__main__":
    main()
