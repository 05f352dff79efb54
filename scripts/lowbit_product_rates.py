"""viasd's 4-bit and 6-bit products (Q4_K's and Q6_K's kernels) at a model's layer shapes, by tokens per pass.

A verification pass multiplies a block of tokens by every weight matrix once, so the products are timed the way a
model uses them: each layer's seven products (q, k, v, o, gate, up, down) over several distinct layers, all in one
format, so nothing is served from cache. Printed per block size and format: milliseconds per layer, the rate the
weights were read at, and the integer operations per second (2 per weight and token), beside the one-token time:
how far a block of drafts is from costing one decoding step.

    python scripts/lowbit_product_rates.py                        # Qwen2.5-14B's shapes
    python scripts/lowbit_product_rates.py --shape qwen2.5-7b --rows 1,4,8

Run it on a quiet machine: the timings are wall-clock.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from bf16_product_rates import best_seconds  # the scripts folder is on the path when a script runs

from viasd.kernels import w4a8, w6a8
from viasd.kernels.build import Library

# hidden, intermediate, key/value width: the models' configs
SHAPES = {
    "qwen2.5-1.5b": (1536, 8960, 256),
    "qwen2.5-7b": (3584, 18944, 512),
    "llama-3.1-8b": (4096, 14336, 1024),
    "qwen2.5-14b": (5120, 13824, 1024),
}
FORMATS: dict[str, Any] = {"Q4_K (int4 x int8)": w4a8, "Q6_K (6-bit x int8)": w6a8}
BITS = {"Q4_K (int4 x int8)": 4.5, "Q6_K (6-bit x int8)": 6.5625}  # bits per weight read, scales included


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-14b", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma-separated tokens per pass")
    parser.add_argument("--layers", type=int, default=4, help="distinct layers per format (more than the caches)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    hidden, inner, kv = SHAPES[args.shape]
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inner, hidden), (inner, hidden)]
    shapes.append((hidden, inner))
    weights_per_layer = sum(n * k for n, k in shapes)
    generator = torch.Generator().manual_seed(0)
    rows_list = sorted({int(part) for part in args.rows.split(",")} | {1})
    print(f"{args.shape}: {weights_per_layer / 1e6:.0f}M weights per layer, {args.layers} distinct layers per format")
    print(f"{'format':<20} {'rows':>4} {'ms/layer':>9} {'GB/s':>6} {'GOP/s':>6} {'/ 1 row':>8}")
    for name, module in FORMATS.items():
        if not isinstance(module.kernel(), Library):
            print(f"{name}: {module.kernel()}")
            continue
        layers = [[module.random_weights(n, k, generator) for n, k in shapes] for _ in range(args.layers)]
        one = 0.0
        for rows in rows_list:
            narrow, wide = torch.randn(rows, hidden).bfloat16(), torch.randn(rows, inner).bfloat16()

            def step(
                narrow: torch.Tensor = narrow,
                wide: torch.Tensor = wide,
                layers: list[list[Any]] = layers,
                module: Any = module,
            ) -> None:
                for layer in layers:
                    for w in layer:
                        module.product(wide if w.k == inner else narrow, w)

            seconds = best_seconds(step, args.repeats) / args.layers
            one = one or seconds
            read = weights_per_layer * BITS[name] / 8 / seconds / 1e9
            ops = 2 * weights_per_layer * rows / seconds / 1e9
            print(f"{name:<20} {rows:>4} {seconds * 1e3:>9.2f} {read:>6.1f} {ops:>6.0f} {seconds / one:>8.2f}")


if __name__ == "__main__":
    main()
