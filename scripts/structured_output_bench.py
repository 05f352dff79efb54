"""Structured output: plain constrained decoding against speculative constrained decoding, in one process.

Each prompt asks for JSON under a schema (`response_format` json_schema in the server); every method generates it,
greedy, under the same grammar, and the script prints tokens/s per method and prompt with the ratio to plain, and
whether each method's tokens equal plain's (the exact methods must: a grammar keeps them exact).

    python scripts/structured_output_bench.py                                  # the default pair, as `serve` runs it
    python scripts/structured_output_bench.py --methods plain,lookup,sd:drafter=lookup+head,auto --repeats 3

Run it on a quiet machine: the timings are wall-clock. `--target DIR --drafter DIR` take any models viasd loads.
"""

from __future__ import annotations

import argparse
import statistics
import time

from viasd.decode.base import GenerationConfig
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.spec import EngineSpec
from viasd.verify.grammar import Grammar, grammar_tokenizer
from viasd.verify.sampling import SamplingParams

# (request, JSON schema): extractions that copy from the prompt (an order, a meeting), records invented (a function's
# description, a bug report), lists of records (capitals, review labels).
TASKS: tuple[tuple[str, dict], ...] = (
    (
        "Extract the order as JSON: 'Order 1042 from Ada Lovelace, 3 notebooks at 4.50 each, ship to 12 Analytical "
        "Row, London, express shipping.'",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer"},
                "customer": {"type": "string"},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string"},
                            "quantity": {"type": "integer"},
                            "unit_price": {"type": "number"},
                        },
                        "required": ["name", "quantity", "unit_price"],
                        "additionalProperties": False,
                    },
                },
                "address": {"type": "string"},
                "express": {"type": "boolean"},
            },
            "required": ["order_id", "customer", "items", "address", "express"],
            "additionalProperties": False,
        },
    ),
    (
        "Describe the Python function `sorted` as JSON: its name, a one-sentence summary, its parameters and what "
        "it returns.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "summary": {"type": "string"},
                "parameters": {"type": "array", "items": {"type": "string"}},
                "returns": {"type": "string"},
            },
            "required": ["name", "summary", "parameters", "returns"],
            "additionalProperties": False,
        },
    ),
    (
        "List three European capitals with their countries and populations in millions, as JSON.",
        {
            "type": "object",
            "properties": {
                "cities": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string"},
                            "country": {"type": "string"},
                            "population_millions": {"type": "number"},
                        },
                        "required": ["city", "country", "population_millions"],
                        "additionalProperties": False,
                    },
                    "minItems": 3,
                    "maxItems": 3,
                }
            },
            "required": ["cities"],
            "additionalProperties": False,
        },
    ),
    (
        "Extract the meeting from this email as JSON: 'Hi Grace, can we move the design review to Thursday 14 March "
        "at 15:30 in room B2? Linus and Margaret will join; please bring the latency numbers. Thanks, Alan.'",
        {
            "type": "object",
            "properties": {
                "topic": {"type": "string"},
                "day": {"type": "string"},
                "date": {"type": "string"},
                "time": {"type": "string"},
                "room": {"type": "string"},
                "attendees": {"type": "array", "items": {"type": "string"}},
                "to_bring": {"type": "string"},
            },
            "required": ["topic", "day", "date", "time", "room", "attendees", "to_bring"],
            "additionalProperties": False,
        },
    ),
    (
        "Review this Python function and report the bug as JSON (line, problem, fix):\n\n"
        "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
        "    return total / len(values) - 1\n",
        {
            "type": "object",
            "properties": {
                "line": {"type": "integer"},
                "problem": {"type": "string"},
                "fix": {"type": "string"},
                "severity": {"enum": ["low", "medium", "high"]},
            },
            "required": ["line", "problem", "fix", "severity"],
            "additionalProperties": False,
        },
    ),
    (
        "Classify the sentiment of each review as JSON: 1. 'The battery lasts two days, superb.' 2. 'Screen cracked "
        "after a week.' 3. 'It works, nothing special.' 4. 'Support never answered my emails.'",
        {
            "type": "object",
            "properties": {
                "reviews": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "number": {"type": "integer"},
                            "sentiment": {"enum": ["positive", "neutral", "negative"]},
                            "reason": {"type": "string"},
                        },
                        "required": ["number", "sentiment", "reason"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["reviews"],
            "additionalProperties": False,
        },
    ),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER)
    parser.add_argument("--methods", default="plain,auto,sd:drafter=lookup+head", help="comma-separated; plain first")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=1, help="runs per method and prompt (the median is kept)")
    parser.add_argument("--tasks", type=int, default=len(TASKS), help=f"how many of the {len(TASKS)} prompts")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or methods[0] != "plain":
        parser.error("--methods must start with plain (the baseline of the ratios)")

    engine = Engine(EngineSpec(target=args.target, drafter=args.drafter))
    tokenizer = engine.tokenizer
    plain_decoder = engine.decoder("plain")
    width = getattr(getattr(plain_decoder.target, "config", None), "vocab_size", None) or len(tokenizer)
    grammar_tokens = grammar_tokenizer(tokenizer, plain_decoder.eos_ids, max(width, len(tokenizer)))
    warm_grammar = Grammar.json_schema(grammar_tokens, TASKS[0][1])
    warm = GenerationConfig(max_new_tokens=8, sampling=SamplingParams(grammar=warm_grammar))
    for method in methods:  # built (auto's probe run, first passes made) before any timing
        engine.generate(engine.encode([{"role": "user", "content": TASKS[0][0]}]), method, warm)

    print(f"{'task':>4}  {'method':<28} {'tokens':>6} {'tok/s':>8} {'x plain':>8}  same as plain  finish")
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    for number, (request, schema) in enumerate(TASKS[: args.tasks], start=1):
        grammar = Grammar.json_schema(grammar_tokens, schema)
        config = GenerationConfig(max_new_tokens=args.max_tokens, sampling=SamplingParams(grammar=grammar))
        prompt = engine.encode([{"role": "user", "content": request}])
        baseline: list[int] | None = None
        plain_rate = 0.0
        for method in methods:
            rates = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                result = engine.generate(prompt, method, config)
                rates.append(len(result.tokens) / (time.perf_counter() - start))
            rate = statistics.median(rates)
            if baseline is None:
                baseline, plain_rate = result.tokens, rate
            ratio = rate / plain_rate if plain_rate else float("nan")
            ratios[method].append(ratio)
            same = "yes" if result.tokens == baseline else "no"
            print(
                f"{number:>4}  {method:<28} {len(result.tokens):>6} {rate:>8.2f} {ratio:>8.2f}  {same:<13}  "
                f"{result.finish_reason}"
            )
    print("\ngeometric mean of the ratios to plain:")
    for method, values in ratios.items():
        mean = statistics.geometric_mean(values) if values and all(v > 0 for v in values) else float("nan")
        print(f"  {method:<28} {mean:.2f}x")


if __name__ == "__main__":
    main()
