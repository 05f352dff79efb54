"""Where a prompt's time goes in the fast mode: the int4a8 products of the 1.5B target's 28 layers (their shapes,
distinct random weights, so read from memory as a pass reads them) at M prompt tokens, against the whole prompt pass
of the default target (its GGUF view; logits for the last position only), per token.

    python benchmarks/2026-12-05-first-token-zen4/prompt_products.py --tokens 256 --threads 2

Run it on a quiet machine: the timings are wall-clock medians of 5.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from viasd.calibration.costs import PassTimer
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.kernels import w4a8
from viasd.models.catalog import DEFAULT_TARGET

HIDDEN, INTERMEDIATE, KV = 1536, 8960, 256
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),  # q k v o: (out, in)
          (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # gate up down  # fmt: skip
TEXT = "def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n"


def median_seconds(work, repeats: int = 5) -> float:
    work()  # untimed: first use
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    layers = [[w4a8.random_weights(n, k, generator) for n, k in SHAPES] for _ in range(28)]
    inputs = {k: torch.randn(args.tokens, k, dtype=torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}

    def products() -> None:
        for layer in layers:
            for (_, k), weights in zip(SHAPES, layer, strict=True):
                w4a8.product(inputs[k], weights)

    seconds = median_seconds(products)
    macs = 28 * sum(n * k for n, k in SHAPES) * args.tokens
    print(f"{args.tokens} tokens, {args.threads} threads: the products of 28 layers {seconds * 1000:.0f} ms, "
          f"{seconds / args.tokens * 1000:.2f} ms/token, {macs / seconds / 1e9:.0f} GMAC/s")  # fmt: skip

    engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET))
    loaded = engine.target
    view = engine.quantized(loaded, engine.target_recipe())
    ids = loaded.tokenizer(TEXT * 60)["input_ids"][: args.tokens]
    session = PassTimer(loaded.model, ids[:1], ids[1:], view).session

    def prompt() -> None:
        session.truncate(0)
        session.forward(ids)

    whole = median_seconds(prompt)
    print(f"the prompt pass: {whole * 1000:.0f} ms, {whole / args.tokens * 1000:.2f} ms/token; "
          f"the products are {seconds / whole:.0%} of it")  # fmt: skip


if __name__ == "__main__":
    main()
