"""What one draft step of the target's head costs, by the dtype it computes in: the head's step and its scores over
its vocabulary (the target's output rows), as `HeadDrafter` runs them, dtypes interleaved in a shuffled order per
repeat; the median per dtype in milliseconds. Memory-bound on a CPU: the bytes a step streams are printed beside.

    python scripts/head_step_costs.py                  # the shipped (or trained) head of the default target
    python scripts/head_step_costs.py --repeats 400 --head H.safetensors

Run it on a quiet machine: the timings are wall-clock.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from viasd.drafters.head import HeadDrafter, head_dtype
from viasd.engine import Engine, EngineSpec
from viasd.heads.find import find_head

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default=None, help="a head file (default: the target's, as sd finds it)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--steps", type=int, default=4, help="draft steps per timed chain")
    args = parser.parse_args()
    model = Engine(EngineSpec()).target.model
    head = find_head(model, args.head).head
    drafters = {name: HeadDrafter(head, model, dtype=dtype) for name, dtype in DTYPES.items()}
    hidden = drafters["float32"].rows.shape[1]
    start = torch.randn(hidden) * 2
    tokens = torch.randint(0, drafters["float32"].vocab_size, (args.steps,)).tolist()
    times: dict[str, list[float]] = {name: [] for name in drafters}
    with torch.inference_mode():
        for repeat in range(args.repeats + 5):
            order = list(drafters)
            random.shuffle(order)
            for name in order:
                drafter = drafters[name]
                state = start.to(drafter.rows.dtype)
                began = time.perf_counter()
                for token in tokens:
                    scores = (drafter.rows @ state).float()
                    state = drafter.head.step(state, drafter.embeddings.weight[token].to(drafter.rows.dtype))
                scores.argmax()
                if repeat >= 5:  # the first few warm caches and allocators
                    times[name].append((time.perf_counter() - began) / args.steps)
    default = head_dtype(torch.device("cpu"), torch.bfloat16)
    print(f"a draft step of {head.config.vocab} tokens; this CPU's default: {default}")
    for name, drafter in drafters.items():
        weights = sum(p.numel() for p in drafter.head.parameters()) + drafter.rows.numel()
        megabytes = weights * drafter.rows.element_size() / 1e6
        print(f"{name}: {statistics.median(times[name]) * 1e3:.2f} ms per step, {megabytes:.0f} MB streamed")


if __name__ == "__main__":
    main()
