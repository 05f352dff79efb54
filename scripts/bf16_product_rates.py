"""bf16 products as a dense model's pass makes them: torch's against viasd's kernels, by tokens per pass.

A decoding step of a dense bf16 model streams every weight matrix once, so a product is timed the way a model uses
it: the seven products of each of 28 layers of the default target's shape (Qwen2.5-1.5B), each layer's weights
distinct, so nothing is served from cache. Printed per block size: milliseconds for the 28 layers and the rate the
weights were read at, beside the machine's own read rate (a float32 sum over 1 GiB, the bound a one-token product
works against). Kernels that do not run here are left out, saying why.

    python scripts/bf16_product_rates.py
    python scripts/bf16_product_rates.py --rows 1,4,8,16 --repeats 5

Run it on a quiet machine: the timings are wall-clock.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from viasd.kernels import bf16, bf16_native
from viasd.kernels.build import Library

HIDDEN, INTERMEDIATE, KV, LAYERS = 1536, 8960, 256, 28  # qwen2.5-coder-1.5b


def best_seconds(work: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed runs of `work`, after one untimed."""
    work()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def read_rate(repeats: int) -> float:
    """Bytes per second a float32 sum over 1 GiB reads at: the machine's streaming read rate, about."""
    data = torch.ones(1 << 28)
    return data.numel() * 4 / best_seconds(lambda: data.sum(), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,5,8,9,16", help="comma-separated tokens per pass")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    shapes = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)]
    shapes += [(INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    layers = [[torch.randn(n, k).bfloat16() for n, k in shapes] for _ in range(LAYERS)]
    size = sum(w.numel() * 2 for layer in layers for w in layer)
    products: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "torch": lambda x, w: torch.nn.functional.linear(x, w)
    }
    for name, module, wants in (("bf16native", bf16_native, torch.bfloat16), ("bf16", bf16, torch.float32)):
        if isinstance(module.kernel(), Library):
            products[name] = lambda x, w, m=module, d=wants: m.product(x.to(d), w)
        else:
            print(f"{name}: {module.kernel()}")
    rate = read_rate(args.repeats)
    print(f"weights {size / 1e9:.2f} GB over {LAYERS} layers; the machine reads {rate / 1e9:.1f} GB/s")
    print("rows  " + "  ".join(f"{name:>22}" for name in products))
    for rows in sorted({int(part) for part in args.rows.split(",")}):
        narrow, wide = torch.randn(rows, HIDDEN).bfloat16(), torch.randn(rows, INTERMEDIATE).bfloat16()
        cells = []
        for product in products.values():

            def step(
                product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = product,
                narrow: torch.Tensor = narrow,
                wide: torch.Tensor = wide,
            ) -> None:
                for layer in layers:
                    for w in layer:
                        product(wide if w.shape[1] == INTERMEDIATE else narrow, w)

            seconds = best_seconds(step, args.repeats)
            cells.append(f"{seconds * 1e3:7.1f} ms {size / seconds / 1e9:5.1f} GB/s")
        print(f"{rows:4d}  " + "  ".join(f"{cell:>22}" for cell in cells))


if __name__ == "__main__":
    main()
