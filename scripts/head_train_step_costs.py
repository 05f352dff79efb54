"""What one optimiser step of the chain head's training costs, with its products in float32 and in bf16 (the
default where the CPU computes bf16 natively), at the default head's shapes: the median of each in milliseconds,
in alternating blocks of steps, beside the floating-point work of a step. The data are random, at the target's
scale: a step's cost does not depend on their values.

    python scripts/head_train_step_costs.py
    python scripts/head_train_step_costs.py --repeats 60 --batch 64
    python scripts/head_train_step_costs.py --width 2048      # a wider head (or --blocks 2: a deeper one)
    python scripts/head_train_step_costs.py --labels distribution   # aiming at the target's distribution

Run it on a quiet machine: the timings are wall-clock.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from viasd.heads.network import DraftHead, HeadConfig
from viasd.training.dataset import TrainingSet
from viasd.training.labels import LABELS
from viasd.training.train import PositionObjective, Target, TrainSettings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def step_flops(settings: TrainSettings, hidden: int) -> float:
    """Multiply-adds of a step, times two: the blocks forward and backward (inputs and weights), the output rows
    forward and backward to the state only (they are the target's, frozen), and with `labels=distribution` the
    target's own logits (forward only)."""
    block = 2 * (2 * hidden) * settings.width + settings.width * hidden
    teacher = hidden * settings.vocab if settings.labels == "distribution" else 0
    per_position = 3 * block * settings.blocks + 2 * hidden * settings.vocab + teacher
    return 2.0 * per_position * settings.depth * settings.batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536, help="the target's hidden size (the default target's)")
    parser.add_argument("--batch", type=int, default=TrainSettings.batch)
    parser.add_argument("--width", type=int, default=TrainSettings.width, help="the head's inner width")
    parser.add_argument("--blocks", type=int, default=TrainSettings.blocks, help="the head's residual blocks")
    parser.add_argument("--labels", choices=LABELS, default=TrainSettings.labels, help="what the loss aims at")
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.manual_seed(0)
    settings = TrainSettings(batch=args.batch, width=args.width, blocks=args.blocks, labels=args.labels)
    positions, vocab = 100_000, 151_936
    data = TrainingSet(
        tokens=torch.randint(0, 20_000, (positions,)),
        starts=torch.arange(0, positions + 1, 400),
        feature_at=torch.arange(positions),
        features=torch.randn(positions, args.hidden).to(torch.bfloat16),
        answer=torch.ones(positions, dtype=torch.bool),
    )
    ids = torch.arange(settings.vocab)
    # Sizes like the target's (its rows near 0.02): random rows at scale 1 make huge logits, and the float32
    # backward then runs on subnormal probabilities, several times slower.
    scale = 0.02
    target = Target(
        torch.randn(vocab, args.hidden).to(torch.bfloat16) * scale, torch.randn(settings.vocab, args.hidden) * scale
    )
    rows = torch.arange(positions)
    steps = {}
    for name, dtype in DTYPES.items():
        objective = PositionObjective(data, target, ids, settings, rows[:-5000], rows[-5000:], dtype)
        head = DraftHead(HeadConfig(args.hidden, settings.width, settings.blocks, settings.vocab), ids)
        optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, fused=True)

        def step(objective=objective, head=head, optimizer=optimizer) -> None:
            loss = objective.loss(head)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        for _ in range(3):  # warm-up, untimed
            step()
        steps[name] = step
    # Each in blocks of consecutive steps, as a training runs them (interleaved single steps would charge float32
    # for the AMX units' frequency after a bf16 step), the blocks alternating against drift.
    times: dict[str, list[float]] = {name: [] for name in DTYPES}
    for block in range(4):
        for name in list(DTYPES)[block % 2 :] + list(DTYPES)[: block % 2]:
            for _ in range(args.repeats // 4):
                began = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - began)
    flops = step_flops(settings, args.hidden)
    threads = torch.get_num_threads()
    shape = (
        f"width {settings.width} x {settings.blocks} block(s), batch {settings.batch} x depth {settings.depth}, "
        f"labels: {settings.labels}"
    )
    print(f"a step: {shape}, {flops / 1e9:.1f} GFLOP, {threads} threads")
    for name, each in times.items():
        median = statistics.median(each)
        print(f"{name:>9}: {median * 1e3:6.1f} ms  ({flops / median / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
