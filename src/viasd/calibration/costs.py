"""What a pass costs on this machine: drafter steps, slim views and the full target, by tokens per pass.

Median seconds of a pass over L new tokens after a ~100-token prefix, for several L, with the measurements
of every kind and length interleaved in a shuffled order, so drift in machine load spreads evenly over them.
A pass is timed as a decoder makes it (`PassTimer`): the drafter's own step (its probabilities and the read of
its token), a slim view's check of a draft block (gate signals, outcomes, their read), the full target's
verification of one; the work around a forward pass is several percent of a cheap pass. On a GPU a pass only
queues its kernels, so every timing waits for the device before it starts and before it stops (`wait_for`).
"""

from __future__ import annotations

import bisect
import os
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from viasd.drafters.base import Proposal
from viasd.errors import ViasdError
from viasd.verify.gates import Gate
from viasd.verify.sampling import SamplingParams
from viasd.views.view import ViewLike

Job = tuple[str, int]  # what to time: a kind (or view name) and the tokens of the pass


def wait_for(device: torch.device) -> None:
    """Wait until the device has run everything queued on it (a no-op on the CPU, where passes are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_info(device: torch.device) -> dict[str, Any]:
    """What the costs were measured on: the device (a GPU's name and memory), torch, CUDA and the host."""
    import platform

    import transformers

    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return info


@dataclass(frozen=True)
class Costs:
    """Median seconds of a pass over L new tokens, per length in `lengths`; one `slim` series per slim tier.
    `drafter_reads_prompt`: False for a draft head, which starts from the target's feature and reads no prompt."""

    lengths: tuple[int, ...]
    drafter: tuple[float, ...]
    full: tuple[float, ...]
    slim: tuple[tuple[float, ...], ...] = ()
    drafter_reads_prompt: bool = True

    def _at(self, values: Sequence[float], n: int) -> float:
        """Linear interpolation between measured lengths; beyond the ends the end segments continue."""
        xs = self.lengths
        if len(xs) == 1:
            return values[0]
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], values[i - 1], values[i]
        return max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), 0.0)

    @property
    def step(self) -> float:
        """One drafter step (one new token)."""
        return self._at(self.drafter, 1)

    def drafter_pass(self, n: int) -> float:
        """A drafter pass over n new tokens (reading the prompt, catching up after copied drafts)."""
        return self._at(self.drafter, n)

    def slim_pass(self, n: int, tier: int = 1) -> float:
        return self._at(self.slim[tier - 1], n)

    def full_pass(self, n: int) -> float:
        return self._at(self.full, n)


@dataclass
class CostTable:
    """Measured medians: 'drafter', 'full' and one 'slim:<i>' entry per mask, over `lengths`."""

    lengths: list[int]
    seconds: dict[str, list[float]]
    prefix: int
    repeats: int

    def costs(self, *slims: int, drafter: str | None = None) -> Costs:
        """Costs with the given slim views (indices into the measured ones) as slim tiers 1, 2, ..., and the
        named drafter candidate's steps (None: the one drafter of a table that measured one)."""
        if "drafter" in self.seconds:  # a table of one drafter
            key = "drafter"
        elif drafter is not None:
            key = f"drafter:{drafter}"
        else:
            named = [k for k in self.seconds if k.startswith("drafter:")]
            key = named[0] if len(named) == 1 else "drafter: none named"
        if key not in self.seconds:
            raise ViasdError(f"the cost table has no drafter {drafter!r}")
        return Costs(
            tuple(self.lengths),
            tuple(self.seconds[key]),
            tuple(self.seconds["full"]),
            tuple(tuple(self.seconds[f"slim:{i}"]) for i in slims),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": self.lengths,
            "seconds": {k: [round(v, 5) for v in vs] for k, vs in self.seconds.items()},
            "prefix_tokens": self.prefix,
            "repeats": self.repeats,
            "statistic": "median, interleaved shuffled repeats",
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostTable:
        """The table a routing profile recorded (`calibration.costs`)."""
        try:
            return cls(
                [int(n) for n in data["lengths"]],
                {k: [float(v) for v in vs] for k, vs in data["seconds"].items()},
                int(data.get("prefix_tokens", 0)),
                int(data.get("repeats", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ViasdError(f"the profile's measured costs are malformed: {exc}") from exc


# A CPU runs faster in its first seconds under load than it does sustained, which is how decoding runs it: timings
# start after this long of untimed passes.
WARM_UP_SECONDS = 5.0


def median_timings(
    jobs: Sequence[Job],
    run: Callable[[str, int], float],
    repeats: int,
    seed: int = 0,
    on_step: Callable[[], None] = lambda: None,
    warm_up: float = WARM_UP_SECONDS,
) -> dict[Job, float]:
    """Median of `repeats` timings of each (kind, n) job, `run(kind, n)` returning one; the jobs interleaved in a
    new shuffled order each round, after every job once and then random ones for `warm_up` seconds (at most three
    per job: small models need no settling), untimed."""
    rng = random.Random(seed)
    start = time.perf_counter()
    for job in jobs:  # first calls allocate and pick kernels
        run(*job)
    for _ in range(3 * len(jobs)):
        if time.perf_counter() - start >= warm_up:
            break
        run(*rng.choice(jobs))
    samples: dict[Job, list[float]] = {job: [] for job in jobs}
    order = list(jobs)
    for _ in range(repeats):
        rng.shuffle(order)
        for job in order:
            samples[job].append(run(*job))
            on_step()
    return {job: statistics.median(times) for job, times in samples.items()}


GREEDY = SamplingParams(temperature=0.0)
TIMING_GATE = Gate("kl", (0.1, 1.0))  # the thresholds do not change the work of a check


class PassTimer:
    """Times passes of one model after `head` tokens, as the decoders make them, and puts the cache back after each.

    The new tokens of a pass are the first n of `tail`. `drafter_step(n)`: a model drafter's step that feeds n
    tokens (one; more when it catches up) and picks its draft. `verification(n, rows)`: the full target's pass
    over n tokens verifying the last rows - 1 of them as drafts. `slim_check(n, rows, view)`: a slim view's pass
    over n tokens (its own entries beyond the committed ones) and its verdict on the last rows - 1 as drafts,
    with the gate's signals against a drafter's distributions.
    """

    def __init__(self, model: nn.Module, head: Sequence[int], tail: Sequence[int], view: ViewLike = None) -> None:
        from viasd.drafters.model_drafter import ModelDrafter

        self.head, self.tail = list(head), list(tail)
        self.drafter = ModelDrafter(model, view)
        self.session = self.drafter.session
        self.session.forward(self.head)
        self.generator = torch.Generator(self.session.device)
        self._soft: torch.Tensor | None = None

    @property
    def soft(self) -> torch.Tensor:
        """A drafter's distributions over the tail (random: the gate's arithmetic is the same whatever they hold)."""
        if self._soft is None:
            vocab = int(self.session.model.config.vocab_size)
            noise = torch.randn(len(self.tail), vocab, generator=torch.Generator().manual_seed(0))
            self._soft = torch.softmax(noise, -1).to(self.session.device)
        return self._soft

    def _timed(self, work: Callable[[], object]) -> float:
        wait_for(self.session.device)
        t0 = time.perf_counter()
        work()
        wait_for(self.session.device)
        return time.perf_counter() - t0

    def drafter_step(self, n: int) -> float:
        sequence = self.head + self.tail[:n]
        elapsed = self._timed(lambda: self.drafter.propose(sequence, 1, GREEDY, self.generator))
        self.session.truncate(len(self.head))
        return elapsed

    def verification(self, n: int, rows: int) -> float:
        from viasd.decode.speculative import verify_with_target

        split = len(self.head) + n - rows + 1
        sequence = self.head + self.tail[:n]
        proposal = Proposal(sequence[split:])
        elapsed = self._timed(
            lambda: verify_with_target(self.session, sequence[:split], proposal, GREEDY, self.generator)
        )
        self.session.truncate(len(self.head))
        return elapsed

    def slim_check(self, n: int, rows: int, view: ViewLike) -> float:
        from viasd.decode.tiered import SlimViews

        sequence = self.head + self.tail[:n]
        drafts = sequence[len(sequence) - rows + 1 :]
        keep, session = rows, self.session
        if not drafts:  # a slim view always checks a draft; one row is its bare pass
            elapsed = self._timed(lambda: session.extend_slim_to(sequence, view, keep=keep))
        else:
            proposal = Proposal(drafts, soft=self.soft[: len(drafts)])
            slim = SlimViews(
                proposal,
                lambda tier: session.extend_slim_to(sequence, view, keep=keep),
                TIMING_GATE,
                GREEDY,
                self.generator,
            )
            elapsed = self._timed(lambda: (slim.signals(), slim.check(0, 1)))
        session.truncate_pending(0)
        return elapsed


class StepTimer(Protocol):
    """Times a drafter's step over n new tokens (PassTimer's for a model; calibration/head_drafts.py's for a head)."""

    def drafter_step(self, n: int) -> float: ...


# A drafter to time: a model and the view it drafts as, or what makes a timer of its own from the head and tail tokens.
Timed = tuple[nn.Module, ViewLike] | Callable[[list[int], list[int]], StepTimer]


def measure_costs(
    target: nn.Module,
    drafter: nn.Module | Mapping[str, Timed],
    slims: Sequence[ViewLike],
    tokens: Sequence[int],
    lengths: Sequence[int],
    prefix: int = 100,
    repeats: int = 5,
    seed: int = 0,
    full_view: ViewLike = None,
) -> CostTable:
    """Time drafter steps, full passes and slim-view passes over L new tokens after `prefix` tokens of `tokens`.

    The full target is `target` as `full_view` (None: as loaded). The slim pass runs as in decoding: on the full
    target's session, attending to its KV of the prefix.
    `drafter` is one model (kind `drafter`) or named candidates, each a model and the view it drafts as, or a
    maker of its own timer (kinds `drafter:<name>`).
    """
    lengths = sorted(set(lengths))
    if not lengths or lengths[0] < 1:
        raise ViasdError("cost measurement: lengths must be >= 1")
    need = prefix + lengths[-1]
    if len(tokens) < need:
        tokens = (list(tokens) * (need // max(len(tokens), 1) + 1))[:need]
    head, tail = list(tokens[:prefix]), list(tokens[prefix:need])
    full = PassTimer(target, head, tail, full_view)
    candidates = (
        {"drafter": (drafter, None)}
        if isinstance(drafter, nn.Module)
        else {f"drafter:{name}": pair for name, pair in drafter.items()}
    )
    drafters: dict[str, StepTimer] = {
        kind: PassTimer(what[0], head, tail, what[1]) if isinstance(what, tuple) else what(head, tail)
        for kind, what in candidates.items()
    }

    def run(kind: str, n: int) -> float:
        if kind in drafters:
            return drafters[kind].drafter_step(n)
        if kind == "full":
            return full.verification(n, n)
        return full.slim_check(n, n, slims[int(kind.split(":")[1])])

    kinds = [*drafters, "full", *(f"slim:{i}" for i in range(len(slims)))]
    medians = median_timings([(kind, n) for kind in kinds for n in lengths], run, repeats, seed)
    seconds = {kind: [medians[(kind, n)] for n in lengths] for kind in kinds}
    return CostTable(list(lengths), seconds, prefix, repeats)


def measure_views(
    model: nn.Module,
    views: Mapping[str, ViewLike],
    lengths: Sequence[int],
    tokens: Sequence[int],
    prefix: int = 100,
    repeats: int = 5,
    seed: int = 0,
    on_step: Callable[[], None] = lambda: None,
    keep: int | None = None,
    drafter: bool = False,
    base: ViewLike = None,
) -> dict[str, list[float]]:
    """Median seconds of a pass of each view over L new tokens after `prefix` tokens, per L in `lengths`.

    As a decoder makes them (`PassTimer`): a target's views check a draft block as a slim view does (on the full
    model's cache of the prefix), the full model (view None) verifies one; a pass keeps the logits of its last
    min(L, keep) positions (None: all L). With `drafter`, each view is a drafter of its own and a pass is its
    step over L tokens. Jobs are interleaved in a shuffled order, `repeats` times. `base`: the view that reads the
    prefix (a model run from its GGUF file's blocks reads it with its gguf view, so that no dense copy is made).
    """
    lengths = sorted(set(lengths))
    need = prefix + lengths[-1]
    tokens = (list(tokens) * (need // max(len(tokens), 1) + 1))[:need]
    head, tail = tokens[:prefix], tokens[prefix:need]
    if drafter:
        timers = {name: PassTimer(model, head, tail, view) for name, view in views.items()}
    else:
        target = PassTimer(model, head, tail, base)

    def run(name: str, n: int) -> float:
        view = views[name]
        rows = n if keep is None else min(n, keep)
        if drafter:
            elapsed = timers[name].drafter_step(n)
        elif view is None:
            elapsed = target.verification(n, rows)
        else:
            elapsed = target.slim_check(n, rows, view)
        return elapsed

    medians = median_timings([(name, n) for name in views for n in lengths], run, repeats, seed, on_step)
    return {name: [medians[(name, n)] for n in lengths] for name in views}


def measure_kernels(
    in_features: int,
    out_features: int,
    rows: Sequence[int],
    kinds: Sequence[str],
    matrices: int = 40,
    repeats: int = 5,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Median seconds of one [rows, in] x [in, out] product per kernel kind, per row count.

    Each timing runs the input through `matrices` distinct weight matrices, as a model does, so the weights come
    from memory and not from cache (one matrix timed over and over looks several times faster). Kinds:
    `bf16` (torch's linear), a weight format's name (kernels/formats.py: `int8`, `int8wo`, `int4`, `int4a8`, and
    `int6a8` and `int8a8`, a GGUF file's blocks, with random codes and scales: the timing is the same), `fbgemm`
    (torch's dynamic int8 linear: per-channel weights, one activation scale per tensor, fp32 in and out).
    """
    from viasd.kernels import formats
    from viasd.views.linears import layer_class

    torch.manual_seed(seed)
    layers = [nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16) for _ in range(matrices)]

    def build(kind: str) -> tuple[list[nn.Module], torch.dtype]:
        if kind == "bf16":
            return layers, torch.bfloat16
        if kind == "fbgemm":
            from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

            modules = []
            for layer in layers:
                module = DynamicLinear(in_features, out_features, bias_=False)
                weight = layer.weight.float()
                scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
                zeros = torch.zeros(out_features, dtype=torch.long)
                module.set_weight_bias(torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8), None)
                modules.append(module)
            return modules, torch.float32
        if kind not in (f.name for f in formats.FORMATS):
            names = ", ".join(f.name for f in formats.FORMATS)
            raise ViasdError(f"unknown kernel kind {kind!r}; choose from bf16, {names}, fbgemm")
        found, make = formats.named(kind), layer_class(kind).from_linear  # type: ignore[attr-defined]
        if found.random is not None and found.quantize is None:  # made only from a file's blocks
            generator = torch.Generator().manual_seed(seed)
            return [make(m, found.random(out_features, in_features, generator)) for m in layers], torch.bfloat16
        return [make(m) for m in layers], torch.bfloat16

    built = {kind: build(kind) for kind in kinds}
    inputs = {n: torch.randn(n, in_features) for n in rows}

    def run(kind: str, n: int) -> float:
        modules, dtype = built[kind]
        x = inputs[n].to(dtype)
        with torch.inference_mode():
            t0 = time.perf_counter()
            for module in modules:
                module(x)
            return (time.perf_counter() - t0) / len(modules)

    medians = median_timings([(kind, n) for kind in kinds for n in rows], run, repeats, seed)
    return {kind: [medians[(kind, n)] for n in rows] for kind in kinds}
