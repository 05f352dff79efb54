"""What the target as run costs to verify a block of drafts, by the block's rows: a target's verification pass.

`viasd costs --views` times a view as a slim verifier checks a block (gate signals included). Speculation over the
fast mode needs the other number: the target's own pass over a block of 1 + drafts rows, as `sd` makes it. This
times exactly that (`PassTimer.verification`), lengths interleaved in a shuffled order per repeat, and prints the
median per length in milliseconds and in single-token steps:

    python scripts/verification_costs.py                       # the default target as run (its GGUF view)
    python scripts/verification_costs.py --rows 1,4,8,16 --repeats 15 --quant none
    python scripts/verification_costs.py --rows 1,8 --kernels on,-fused   # an A/B of kernel sets, one process

Run it on a quiet machine: the timings are wall-clock.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

from viasd.calibration.costs import PassTimer
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.kernels.switch import SWITCH
from viasd.models.catalog import DEFAULT_TARGET

TEXT = "def fibonacci(n):\n    '''Return the n-th Fibonacci number.'''\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--quant", default=None, help="the target's view (default: as its file stores it)")
    parser.add_argument("--rows", default="1,2,4,5,6,8,10,12,16", help="comma-separated block sizes")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--context", type=int, default=100, help="tokens in the cache before each block")
    parser.add_argument(
        "--kernels",
        default="",
        help="comma-separated VIASD_KERNELS values to interleave, e.g. on,-fused (default: as set)",
    )
    args = parser.parse_args()
    settings = [part.strip() for part in args.kernels.split(",") if part.strip()] or [os.environ.get(SWITCH, "on")]
    lengths = sorted({int(part) for part in args.rows.split(",")} | {1})
    engine = Engine(engine_spec(args.target, args.target, quant=args.quant))
    loaded = engine.target
    view = engine.quantized(loaded, engine.target_recipe())
    ids = loaded.tokenizer(TEXT * 40)["input_ids"]
    if len(ids) < args.context + lengths[-1]:
        raise SystemExit(f"--context + the largest block must be at most {len(ids)} tokens")
    timer = PassTimer(loaded.model, ids[: args.context], ids[args.context : args.context + lengths[-1]], view)
    jobs = [(setting, n) for setting in settings for n in lengths]
    seconds: dict[tuple[str, int], list[float]] = {job: [] for job in jobs}

    def run(setting: str, n: int) -> float:
        os.environ[SWITCH] = setting  # read at each kernel call (kernels/switch.py)
        return timer.verification(n, n)

    for job in jobs:  # first passes of each shape and setting, untimed
        run(*job)
    for _ in range(args.repeats):
        for job in random.sample(jobs, len(jobs)):
            seconds[job].append(run(*job))
    print(f"target: {args.target} as {view.linears.recipe.name if view is not None else 'loaded'}")
    print("kernels  rows  ms/pass  steps  spread (ms)")
    for setting in settings:
        step = statistics.median(seconds[(setting, 1)])
        for n in lengths:
            times = seconds[(setting, n)]
            median = statistics.median(times)
            print(
                f"{setting:>7}  {n:>4}  {median * 1000:>7.1f}  {median / step:>5.2f}  "
                f"{min(times) * 1000:.0f}-{max(times) * 1000:.0f}"
            )


if __name__ == "__main__":
    main()
