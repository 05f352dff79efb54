"""Measured speed of VIA-SD (the shipped or a given profile) against classic SD and plain decoding.

Loads the default pair once and runs the methods in turn on each prompt, `--repeats` times, so that a
busy machine slows them alike; prints per-method medians of tokens/s,
target calls per token, rejection rate, tier counts, and how much of the first method's output each
method reproduces (docs/calibration.md). Times include the prefill.

    python scripts/compare_via_sd.py --repeats 2 -n 64
"""

from __future__ import annotations

import argparse
import statistics

from viasd.decode.base import GenerationConfig
from viasd.engine import Engine, EngineSpec
from viasd.prompting import encode_prompt

PROMPTS = (
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a JavaScript function that debounces another function.",
    "Explain what a Python generator is, with a short example.",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="plain,sd,via")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()
    engine = Engine(EngineSpec(dtype=args.dtype, profile=args.profile))
    methods = args.methods.split(",")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in methods}
    tiers: dict[str, dict[str, int]] = {m: {} for m in methods}
    same: dict[str, list[float]] = {m: [] for m in methods}
    for prompt in PROMPTS:
        ids = encode_prompt(engine.tokenizer, prompt)
        engine.generate(ids, "sd", GenerationConfig(max_new_tokens=4))  # warm-up
        reference = None
        for _ in range(args.repeats):
            for method in methods:
                out = engine.generate(ids, method, config)
                s = out.stats
                rows[method].append(
                    {
                        "tok/s": s.tokens_per_second,
                        "target calls/token": s.target_calls_per_token,
                        "rejection": s.rejection_rate,
                    }
                )
                for name, tier in s.tiers.items():
                    tiers[method][name] = tiers[method].get(name, 0) + tier.decided
                if reference is None:
                    reference = out.tokens
                n = min(len(reference), len(out.tokens))
                prefix = next((i for i in range(n) if reference[i] != out.tokens[i]), n)
                same[method].append(prefix / max(len(reference), 1))
    print(f"| method | tok/s | target calls/token | rejection | same prefix as {methods[0]} | tiers |")
    print("| --- | --- | --- | --- | --- | --- |")
    for method in methods:
        med = {k: statistics.median(r[k] for r in rows[method]) for k in rows[method][0]}
        print(
            f"| {method} | {med['tok/s']:.2f} | {med['target calls/token']:.3f} | "
            f"{med['rejection']:.3f} | {statistics.mean(same[method]):.2f} | {tiers[method] or '-'} |"
        )


if __name__ == "__main__":
    main()
