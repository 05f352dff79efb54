"""What one draft step of the target's head costs, by what it computes in (int8, bf16, float32): the head's step and
its scores over its vocabulary (the target's output rows), as `HeadDrafter` runs them, interleaved in a shuffled
order per repeat; the median of each in milliseconds. Memory-bound on a CPU: the bytes a step streams are beside.

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

from viasd.drafters.head import HeadDrafter, head_compute
from viasd.engine import Engine, EngineSpec
from viasd.heads.find import find_head

COMPUTES = ("int8", "bfloat16", "float32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", default=None, help="a head file (default: the target's, as sd finds it)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--steps", type=int, default=4, help="draft steps per timed chain")
    args = parser.parse_args()
    model = Engine(EngineSpec()).target.model
    head = find_head(model, args.head).head
    drafters = {name: HeadDrafter(head, model, compute=name) for name in COMPUTES}
    hidden = drafters["float32"].hidden
    start = torch.randn(hidden) * 2
    tokens = torch.randint(0, drafters["float32"].vocab_size, (args.steps,)).tolist()
    times: dict[str, list[float]] = {name: [] for name in drafters}
    with torch.inference_mode():
        for repeat in range(args.repeats + 5):
            order = list(drafters)
            random.shuffle(order)
            for name in order:
                drafter = drafters[name]
                state = start.to(drafter.dtype)
                began = time.perf_counter()
                for token in tokens:
                    scores = drafter.logits(state)
                    state = drafter.head.step(state, drafter.embed(token))
                scores.argmax()
                if repeat >= 5:  # the first few warm caches and allocators
                    times[name].append((time.perf_counter() - began) / args.steps)
    default = head_compute(torch.device("cpu"), torch.bfloat16, head, hidden)
    print(f"a draft step of {head.config.vocab} tokens; this CPU's default: {default}")
    weights = sum(p.numel() for p in head.parameters()) + head.config.vocab * hidden
    for name in drafters:
        # int8: a byte per weight and a float32 scale per group of 32
        megabytes = weights * ({"int8": 1 + 4 / 32, "bfloat16": 2, "float32": 4}[name]) / 1e6
        print(f"{name}: {statistics.median(times[name]) * 1e3:.2f} ms per step, {megabytes:.0f} MB streamed")


if __name__ == "__main__":
    main()
