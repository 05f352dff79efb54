"""Calibration of VIA-SD for one model pair on this machine: costs, gate statistics, gate thresholds and gamma.

1. Costs (`measure_costs`): median seconds of a drafter pass, a slim pass and a full pass over L new
   tokens after a ~100-token prefix, for L = 1..gamma+1 and a few longer blocks (catch-up), with the
   measurements of every kind and length interleaved in a shuffled order, so drift in machine load
   spreads evenly over them.
2. Gate statistics (`position_stats`): along the target's greedy continuation of each calibration
   prompt (teacher forcing), at every position the drafter's soft distribution p and greedy token x,
   the slim view's s (frontier semantics of teacher.py) and the target's q give the gate signals
   KL(s || p) and 1 - s(x) / max s, and whether x == argmax q, argmax s == argmax q, argmax s == x.
3. Selection (`simulate`, `select_policy`): the tiered decoder's greedy rounds are replayed along those
   records with a cost model built from the measured costs, for every candidate (signal, k_accept,
   k_full, gamma, cap); the fastest candidate whose estimated error rate (committed tokens that differ
   from the target's greedy choice at that position) stays within the quality budget wins. Classic SD
   is replayed with the same costs and records for comparison.

Cost model of one round with k = gamma draft tokens (prefill excluded, the same for every method):
    drafter: k steps of cost c_d(1) (the first step may feed 2 tokens; in bf16 that costs the same)
    slim:    one pass over k + 1 tokens, c_s(k + 1) (the last committed token plus the block)
    full:    when a token reaches the full tier or the cap forces it, one pass over every token it has
             not processed: c_f(1 + unchecked + k), where `unchecked` counts tokens committed since its
             last pass; classic SD pays c_d(1) * k + c_f(k + 1) every round.
A full-tier round is classic speculative sampling of the whole block (lossless); the lower tiers'
decisions in that round are dropped, as in decode/round.py. Records are assumed to hold along the
committed path even after a wrong token is committed (teacher forcing cannot follow the drift).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from viasd.decode.base import GenerationConfig
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.errors import ViasdError
from viasd.models.loading import LoadedModel
from viasd.models.routing import RoutingMask, num_decoder_layers
from viasd.models.session import KVSession
from viasd.prompting import encode_prompt
from viasd.routing.masks import layers_to_skip, spread_mask
from viasd.routing.objectives import DEFAULT_MARGIN, DEFAULT_RIVALS, OBJECTIVES, Scores
from viasd.routing.profile import RoutingProfile, model_fingerprint, write_json_atomic
from viasd.routing.search import (
    Evaluator,
    layer_preference,
    mask_evaluator,
    middle_layers,
    random_baseline,
    scores_for,
    search_mask,
)
from viasd.routing.teacher import TeacherSequence, model_logits, slim_logits, teacher_force
from viasd.verify.gates import SIGNALS, Gate, confidence_signal, kl_signal

# Calibration prompts: varied on purpose (code, QA, math, chat, summarising, translating). The
# Spec-Bench file is kept for evaluation; none of these appears in it.
CALIBRATION_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."),
    ("qa", "What causes the seasons on Earth? Answer in a short paragraph."),
    ("math", "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Explain step by step."),
    ("chat", "I have a job interview tomorrow and I am nervous. Any advice?"),
    ("code", "Implement a stack class in Python with push, pop, peek and is_empty methods."),
    (
        "summary",
        "Summarize in two sentences: the printing press, invented by Gutenberg around 1440, made books "
        "cheaper, spread literacy across Europe and helped the ideas of the Reformation and the scientific "
        "revolution travel faster than ever before.",
    ),
    ("code", "Write a SQL query that lists the ten customers with the highest total order amount."),
    ("translate", "Translate into French: The library opens at nine in the morning and closes at six."),
    ("math", "Solve for x: 3x + 7 = 22. Show your work."),
    ("code", "Write a bash command that counts the lines of all .py files in a directory tree."),
    ("qa", "Who wrote 'Pride and Prejudice', and what is the novel about?"),
    ("code", "Explain the difference between a list and a tuple in Python, with a short example."),
)
# Held out from calibration: used only to check that the searched mask generalises.
HELD_OUT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function that checks whether a number is prime."),
    ("qa", "Why is the sky blue? Keep it brief."),
    ("code", "Write a C function that reverses a string in place."),
    ("math", "What is 15% of 240? Show the calculation."),
    ("chat", "Suggest three names for a small coffee shop and say why."),
)

NO_ACCEPT = -1.0  # k_accept below every signal value (signals are >= 0): no accept tier
NO_FULL = 1e9  # k_full above every signal value: only the cap sends tokens to the full target


# ---------------------------------------------------------------------------------------------- costs


@dataclass(frozen=True)
class Costs:
    """Median seconds of a pass over L new tokens, per length in `lengths`, for one slim mask."""

    lengths: tuple[int, ...]
    drafter: tuple[float, ...]
    slim: tuple[float, ...]
    full: tuple[float, ...]

    def _at(self, values: tuple[float, ...], n: int) -> float:
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

    def slim_pass(self, n: int) -> float:
        return self._at(self.slim, n)

    def full_pass(self, n: int) -> float:
        return self._at(self.full, n)


@dataclass
class CostTable:
    """Measured medians: 'drafter', 'full' and one 'slim:<i>' entry per mask, over `lengths`."""

    lengths: list[int]
    seconds: dict[str, list[float]]
    prefix: int
    repeats: int

    def costs(self, slim: int = 0) -> Costs:
        return Costs(
            tuple(self.lengths),
            tuple(self.seconds["drafter"]),
            tuple(self.seconds[f"slim:{slim}"]),
            tuple(self.seconds["full"]),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "lengths": self.lengths,
            "seconds": {k: [round(v, 5) for v in vs] for k, vs in self.seconds.items()},
            "prefix_tokens": self.prefix,
            "repeats": self.repeats,
            "statistic": "median, interleaved shuffled repeats",
        }


def measure_costs(
    target: nn.Module,
    drafter: nn.Module,
    masks: Sequence[RoutingMask],
    tokens: Sequence[int],
    lengths: Sequence[int],
    prefix: int = 100,
    repeats: int = 5,
    seed: int = 0,
) -> CostTable:
    """Time drafter, full and slim passes over L new tokens after `prefix` tokens of `tokens`.

    The slim pass runs as in decoding: on the full target's session, attending to its KV of the prefix.
    """
    lengths = sorted(set(lengths))
    if not lengths or lengths[0] < 1:
        raise ViasdError("cost measurement: lengths must be >= 1")
    need = prefix + lengths[-1]
    if len(tokens) < need:
        tokens = (list(tokens) * (need // max(len(tokens), 1) + 1))[:need]
    head, tail = list(tokens[:prefix]), list(tokens[prefix:need])
    full_session, draft_session = KVSession(target), KVSession(drafter)
    full_session.forward(head)
    draft_session.forward(head)

    def run(kind: str, n: int) -> float:
        ids = tail[:n]
        t0 = time.perf_counter()
        if kind == "drafter":
            draft_session.forward(ids, keep=1)
            elapsed = time.perf_counter() - t0
            draft_session.truncate(prefix)
        elif kind == "full":
            full_session.forward(ids, keep=n)
            elapsed = time.perf_counter() - t0
            full_session.truncate(prefix)
        else:
            full_session.forward_routed(ids, masks[int(kind.split(":")[1])], keep=n)
            elapsed = time.perf_counter() - t0
            full_session.truncate_pending(0)
        return elapsed

    kinds = ["drafter", "full", *(f"slim:{i}" for i in range(len(masks)))]
    jobs = [(kind, n) for kind in kinds for n in lengths]
    for kind in kinds:  # warm-up
        run(kind, lengths[0])
    samples: dict[tuple[str, int], list[float]] = {job: [] for job in jobs}
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(jobs)
        for job in jobs:
            samples[job].append(run(*job))
    seconds = {kind: [float(torch.tensor(samples[(kind, n)]).median()) for n in lengths] for kind in kinds}
    return CostTable(list(lengths), seconds, prefix, repeats)


# ------------------------------------------------------------------------------------ gate statistics


@dataclass
class SequenceStats:
    """Teacher-forced records of one sequence, one entry per position (see the module docstring)."""

    kl: list[float]
    confidence: list[float]
    draft_ok: list[bool]  # the drafter's greedy token is the target's
    slim_ok: list[bool]  # the slim view's top token is the target's
    slim_agrees: list[bool]  # the slim view's top token is the drafter's
    draft_top: list[float] = field(default_factory=list)  # the drafter's top probability (for the pre-gate)

    def __len__(self) -> int:
        return len(self.kl)

    def signal(self, name: str) -> list[float]:
        if name not in SIGNALS:
            raise ViasdError(f"unknown gate signal {name!r}")
        return self.kl if name == "kl" else self.confidence


def position_stats(drafter_logits: torch.Tensor, slim_logits: torch.Tensor, full_logits: torch.Tensor) -> SequenceStats:
    """Gate records from the three models' logits over the same positions (greedy decoding: the gate sees
    the drafter's and slim view's softmax at temperature 1, as in the decoder)."""
    if not drafter_logits.shape[0] == slim_logits.shape[0] == full_logits.shape[0]:
        raise ViasdError("gate statistics: the three models' logits cover different positions")
    p = drafter_logits.float().softmax(dim=-1)
    s = slim_logits.float().softmax(dim=-1)
    x = drafter_logits.argmax(dim=-1)
    top_s, top_q = slim_logits.argmax(dim=-1), full_logits.argmax(dim=-1)
    tokens = x.tolist()
    return SequenceStats(
        kl=kl_signal(s, p, tokens).tolist(),
        confidence=confidence_signal(s, p, tokens).clamp_min(0.0).tolist(),
        draft_ok=(x == top_q).tolist(),
        slim_ok=(top_s == top_q).tolist(),
        slim_agrees=(top_s == x).tolist(),
        draft_top=p.max(dim=-1).values.tolist(),
    )


def summarize_stats(stats: Sequence[SequenceStats]) -> dict[str, Any]:
    """Rates and signal quantiles over all positions, for the profile."""

    def flat(name: str) -> list[Any]:
        return [v for seq in stats for v in getattr(seq, name)]

    n = sum(len(seq) for seq in stats)
    out: dict[str, Any] = {"positions": n, "sequences": len(stats)}
    if not n:
        return out
    for name in ("draft_ok", "slim_ok", "slim_agrees"):
        out[f"{name}_rate"] = sum(flat(name)) / n
    qs = [0.1, 0.25, 0.5, 0.75, 0.9]
    for signal in SIGNALS:
        values = torch.tensor(flat(signal), dtype=torch.float64)
        out[f"{signal}_quantiles"] = {str(q): float(values.quantile(q)) for q in qs}
    return out


# ------------------------------------------------------------------------------------- round replay


@dataclass(frozen=True)
class Policy:
    """A gate configuration to replay; `exact` replays classic SD (every round verified by the full target)."""

    signal: str = "kl"
    k_accept: float = NO_ACCEPT
    k_full: float = NO_FULL
    gamma: int = 4
    cap: int = 32
    exact: bool = False
    pregate: float = 0.0  # skip the slim pass of a round whose least confident draft has a lower top probability

    def tier(self, value: float) -> int:
        """0 accept, 1 slim, 2 full (as Gate.tier: g <= k_accept -> 0, g <= k_full -> 1; NaN -> full)."""
        if value <= self.k_accept:
            return 0
        return 1 if value <= self.k_full else 2


@dataclass
class Prediction:
    """Replayed counts and seconds of a policy over the calibration records."""

    tokens: int = 0
    seconds: float = 0.0
    errors: int = 0
    rounds: int = 0
    target_calls: int = 0
    slim_calls: int = 0
    drafter_steps: int = 0
    evaluated: int = 0
    accepted: int = 0
    decided: dict[str, int] = field(default_factory=lambda: {"accept": 0, "slim": 0, "full": 0})

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def error_rate(self) -> float:
        return self.errors / self.tokens if self.tokens else 0.0

    @property
    def rejection_rate(self) -> float:
        return (self.evaluated - self.accepted) / self.evaluated if self.evaluated else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.tokens / self.target_calls if self.target_calls else math.inf

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            tokens_per_second=self.tokens_per_second,
            error_rate=self.error_rate,
            rejection_rate=self.rejection_rate,
            tokens_per_target_call=self.tokens_per_target_call if self.target_calls else None,
        )
        return data


def simulate(stats: Sequence[SequenceStats], policy: Policy, costs: Costs) -> Prediction:
    """Replay greedy VIA-SD (or classic SD) rounds along each sequence's records; see the module docstring."""
    out = Prediction()
    step = costs.step
    for seq in stats:
        signal = seq.signal(policy.signal)
        m = len(seq)
        j = unchecked = 0
        while True:
            k = min(policy.gamma, m - 1 - j)  # the round's closing token needs a record too
            if k < 1:
                break
            out.rounds += 1
            out.seconds += k * step
            out.drafter_steps += k
            if not policy.exact and policy.cap - unchecked >= 2 and not _pregated(seq, j, k, policy.pregate):
                out.seconds += costs.slim_pass(k + 1)
                out.slim_calls += 1
                budget = policy.cap - unchecked
                committed = errors = kept = 0
                decided = [0, 0]
                needs_full = False
                for i in range(k):
                    r = j + i
                    tier = policy.tier(signal[r])
                    if i + 2 > budget:
                        tier = 2
                    if tier == 2:
                        needs_full = True
                        break
                    decided[tier] += 1
                    if tier == 0 or seq.slim_agrees[r]:
                        kept += 1
                        committed += 1
                        errors += not seq.draft_ok[r]
                        continue
                    committed += 1  # the slim view regenerates the token and the round ends
                    errors += not seq.slim_ok[r]
                    break
                else:
                    committed += 1  # bonus token from the slim view
                    errors += not seq.slim_ok[j + k]
                if not needs_full:
                    out.tokens += committed
                    out.errors += errors
                    out.evaluated += decided[0] + decided[1]
                    out.accepted += kept
                    out.decided["accept"] += decided[0]
                    out.decided["slim"] += decided[1]
                    j += committed
                    unchecked += committed
                    continue
            # Full round: classic speculative decoding of the block, after catching up.
            out.seconds += costs.full_pass(1 + unchecked + k)
            out.target_calls += 1
            a = 0
            while a < k and seq.draft_ok[j + a]:
                a += 1
            out.evaluated += min(a + 1, k)
            out.accepted += a
            out.decided["full"] += min(a + 1, k)
            out.tokens += a + 1
            j += a + 1
            unchecked = 0
    return out


def _pregated(seq: SequenceStats, start: int, k: int, pregate: float) -> bool:
    """Whether the pre-gate sends the round drafting positions start..start+k-1 straight to the full target."""
    return pregate > 0.0 and bool(seq.draft_top) and min(seq.draft_top[start : start + k]) < pregate


def has_draft_confidence(stats: Sequence[SequenceStats]) -> bool:
    """Whether the records carry the drafter's confidence (work files of older calibrations do not)."""
    return all(len(seq.draft_top) == len(seq) for seq in stats)


def threshold_candidates(values: Sequence[float], count: int = 20) -> list[float]:
    """Distinct quantiles of the observed signal (0..100% in `count` steps), plus 0."""
    if not values:
        return [0.0]
    data = torch.tensor(values, dtype=torch.float64)
    qs = torch.linspace(0, 1, count + 1, dtype=torch.float64)
    found = {round(float(v), 6) for v in data.quantile(qs)} | {0.0}
    return sorted(found)


@dataclass
class Selection:
    """The chosen policy and its prediction, and the baselines replayed with the same costs."""

    policy: Policy
    prediction: Prediction
    sd_policy: Policy
    sd_prediction: Prediction
    plain_tokens_per_second: float
    candidates: int
    feasible: int
    quality_budget: float
    min_tier_share: float = 0.0
    unconstrained: tuple[Policy, Prediction] | None = None  # the fastest within the budget, ignoring tier shares

    def to_dict(self) -> dict[str, Any]:
        out = {
            "quality_budget": self.quality_budget,
            "min_tier_share": self.min_tier_share,
            "candidates": self.candidates,
            "feasible": self.feasible,
            "via": {"policy": asdict(self.policy), **self.prediction.to_dict()},
            "sd": {"policy": asdict(self.sd_policy), **self.sd_prediction.to_dict()},
            "plain": {"tokens_per_second": self.plain_tokens_per_second},
        }
        if self.unconstrained is not None:
            policy, pred = self.unconstrained
            out["via_unconstrained"] = {"policy": asdict(policy), **pred.to_dict()}
        return out


def select_policy(
    stats: Sequence[SequenceStats],
    costs: Costs,
    gammas: Sequence[int] = (2, 3, 4, 5, 6, 8),
    caps: Sequence[int] = (8, 16, 32),
    quality_budget: float = 0.02,
    signals: Sequence[str] = SIGNALS,
    quantiles: int = 20,
    min_tier_share: float = 0.0,
    pregates: Sequence[float] = (0.0,),
) -> Selection:
    """The fastest gate (signal, k_accept <= k_full), gamma and cap whose replayed error rate is within
    `quality_budget`, and the fastest classic SD gamma, under the same costs.

    `pregates` are the pre-gate thresholds to try (0: off); records without the drafter's confidence allow
    only 0. `min_tier_share` > 0 also requires each tier (accept, slim, full) to decide at least that share of
    the draft tokens, for a profile that exercises all three tiers even where fewer would be faster; the
    fastest policy without that requirement is reported alongside.
    """
    if not gammas or min(gammas) < 1:
        raise ViasdError("calibration: gammas must be >= 1")
    if not caps or min(caps) < 2:
        raise ViasdError("calibration: caps must be >= 2")
    if not 0.0 <= quality_budget < 1.0:
        raise ViasdError(f"calibration: the quality budget must be in [0, 1), got {quality_budget}")
    if not 0.0 <= min_tier_share <= 1.0 / 3.0:
        raise ViasdError(f"calibration: the minimum tier share must be in [0, 1/3], got {min_tier_share}")
    if not sum(len(s) for s in stats):
        raise ViasdError("calibration: no gate statistics to select thresholds from")
    if not pregates or not all(0.0 <= v <= 1.0 for v in pregates):
        raise ViasdError(f"calibration: pre-gates must be in [0, 1], got {list(pregates)}")
    pregate_values = sorted(set(pregates)) if has_draft_confidence(stats) else [0.0]
    sd = [(Policy(gamma=g, exact=True), simulate(stats, Policy(gamma=g, exact=True), costs)) for g in gammas]
    sd_policy, sd_pred = max(sd, key=lambda pair: pair[1].tokens_per_second)
    best: tuple[Policy, Prediction] | None = None
    free: tuple[Policy, Prediction] | None = None
    candidates = feasible = 0
    for signal in signals:
        values = threshold_candidates([v for seq in stats for v in seq.signal(signal)], quantiles)
        accepts = [NO_ACCEPT, *values]
        fulls = [*values, NO_FULL]
        for gamma in gammas:
            for cap in caps:
                for ka, kf, pregate in itertools.product(accepts, fulls, pregate_values):
                    if kf < ka:
                        continue
                    policy = Policy(signal, ka, kf, gamma, cap, pregate=pregate)
                    pred = simulate(stats, policy, costs)
                    candidates += 1
                    if pred.error_rate > quality_budget:
                        continue
                    if free is None or pred.tokens_per_second > free[1].tokens_per_second:
                        free = (policy, pred)
                    decided = sum(pred.decided.values())
                    if min(pred.decided.values()) < min_tier_share * decided:
                        continue
                    feasible += 1
                    if best is None or pred.tokens_per_second > best[1].tokens_per_second:
                        best = (policy, pred)
    if best is None:
        raise ViasdError(
            "calibration: no gate configuration meets the quality budget"
            + (" with every tier in use; lower --min-tier-share" if min_tier_share > 0 else "")
        )
    plain = 1.0 / costs.full_pass(1)
    return Selection(
        best[0], best[1], sd_policy, sd_pred, plain, candidates, feasible, quality_budget, min_tier_share, free
    )


def machine_info(device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
    """Where the costs were measured."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


Log = Callable[[str], None]


# ------------------------------------------------------------------------------------------ pipeline


@dataclass
class CalibrationSettings:
    """Everything `calibrate_pair` does, with the defaults used for the shipped profile."""

    objective: str = "margin"
    skip_ratios: tuple[float, ...] = (0.18, 0.21, 0.25)
    iterations: int = 60  # search trials per skip ratio
    time_budget: float | None = None  # seconds for all mask searches together
    quality_budget: float = 0.02
    gammas: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
    caps: tuple[int, ...] = (8, 16, 32)
    prompts: int = 8  # calibration prompts (gate statistics); the first `search_prompts` also drive the search
    search_prompts: int = 4
    held_out: int = 4
    new_tokens: int = 64
    chunk: int = 8
    margin: float = DEFAULT_MARGIN
    sampler: str = "tpe"
    bo_every: int = 2
    seed: int = 0
    random_masks: int = 4
    cost_repeats: int = 5
    preference: bool = True  # seed the search with the layers that are cheapest to skip one at a time
    min_tier_share: float = 0.0  # > 0: each tier must decide at least this share of draft tokens
    pregates: tuple[float, ...] = (0.0, 0.3, 0.5)  # pre-gate thresholds to try (0: off)

    def check(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ViasdError(f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if not 1 <= self.prompts <= len(CALIBRATION_PROMPTS):
            raise ViasdError(f"--prompts must be between 1 and {len(CALIBRATION_PROMPTS)}, got {self.prompts}")
        if not 0 <= self.held_out <= len(HELD_OUT_PROMPTS):
            raise ViasdError(f"held-out prompts must be between 0 and {len(HELD_OUT_PROMPTS)}")
        if not self.skip_ratios or not all(0.0 < r < 1.0 for r in self.skip_ratios):
            raise ViasdError(f"skip ratios must be in (0, 1), got {list(self.skip_ratios)}")
        if self.iterations < 1:
            raise ViasdError(f"--iterations must be >= 1, got {self.iterations}")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ViasdError(f"--time-budget must be > 0 seconds, got {self.time_budget}")
        if not self.gammas or min(self.gammas) < 1:
            raise ViasdError(f"--gammas must be >= 1, got {list(self.gammas)}")
        if not 0.0 <= self.quality_budget < 1.0:
            raise ViasdError(f"--quality-budget must be in [0, 1), got {self.quality_budget}")
        if not 0.0 <= self.min_tier_share <= 1.0 / 3.0:
            raise ViasdError(f"--min-tier-share must be in [0, 1/3], got {self.min_tier_share}")
        if not self.pregates or not all(0.0 <= v <= 1.0 for v in self.pregates):
            raise ViasdError(f"--pregates must be in [0, 1], got {list(self.pregates)}")


def _continuations(
    target: LoadedModel, drafter: LoadedModel, prompts: Sequence[tuple[str, str]], new_tokens: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy continuation) per prompt; generated with exact SD for speed."""
    decoder = SpeculativeDecoder(target.model, target.tokenizer, ModelDrafter(drafter.model, name="small"), gamma=4)
    out = []
    for _, text in prompts:
        ids = encode_prompt(target.tokenizer, text)
        result = decoder.generate(ids, GenerationConfig(max_new_tokens=new_tokens))
        if len(result.tokens) >= 2:
            out.append((ids, result.tokens))
    return out


def cached_continuations(
    target: LoadedModel,
    drafter: LoadedModel,
    prompts: Sequence[tuple[str, str]],
    new_tokens: int,
    work_file: str | os.PathLike[str] | None,
    resume: bool,
) -> list[tuple[list[int], list[int]]]:
    """`_continuations`, kept in `work_file` (JSON, keyed by target, dtype, length and prompts) so that a
    resumed calibration does not generate them again."""
    param = next(target.model.parameters())
    key = hashlib.sha256(
        json.dumps([model_fingerprint(target.model), str(param.dtype), new_tokens, [t for _, t in prompts]]).encode()
    ).hexdigest()[:16]
    cache = _read_work(work_file)
    if resume and isinstance(cache.get(key), list):
        return [(list(p), list(c)) for p, c in cache[key]]
    pairs = _continuations(target, drafter, prompts, new_tokens)
    if work_file is not None:
        cache[key] = pairs
        write_json_atomic(work_file, cache)
    return pairs


def _read_work(work_file: str | os.PathLike[str] | None) -> dict[str, Any]:
    if work_file is None or not Path(work_file).is_file():
        return {}
    try:
        data = json.loads(Path(work_file).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def stats_key(study_key: str, mask: RoutingMask) -> str:
    """Where the gate statistics of a mask live in the work file."""
    return f"stats-{study_key}-skip{'-'.join(map(str, mask.skipped_layers))}"


def load_stats(work_file: str | os.PathLike[str], study_key: str, mask: RoutingMask) -> list[SequenceStats] | None:
    """Gate statistics that a calibration stored in its work file, or None."""
    data = _read_work(work_file).get(stats_key(study_key, mask))
    if not isinstance(data, list):
        return None
    return [SequenceStats(**seq) for seq in data]


def _cached_preference(
    evaluate: Evaluator,
    num_layers: int,
    objective: str,
    key: str,
    work_file: str | os.PathLike[str] | None,
    resume: bool,
    log: Log,
) -> list[float]:
    """`layer_preference`, kept in the work file for a resumed calibration."""
    name = f"preference-{objective}-{key}"
    cache = _read_work(work_file)
    if resume and isinstance(cache.get(name), list) and len(cache[name]) == num_layers - 2:
        return [float(v) for v in cache[name]]
    log(f"scoring each of the {num_layers - 2} middle layers skipped alone")
    preference = layer_preference(evaluate, num_layers, objective)
    if work_file is not None:
        cache = _read_work(work_file)
        cache[name] = preference
        write_json_atomic(work_file, cache)
    return preference


def _teacher(target: nn.Module, pairs: Sequence[tuple[list[int], list[int]]]) -> list[TeacherSequence]:
    return [teacher_force(target, prompt + cont, len(prompt)) for prompt, cont in pairs]


def _study_key(fingerprint: str, sequences: Sequence[TeacherSequence], settings: CalibrationSettings) -> str:
    """Identifies what a search scores, so a resumed study never mixes different calibration data."""
    digest = hashlib.sha256(f"{fingerprint}|{settings.chunk}|{settings.margin}|{DEFAULT_RIVALS}".encode())
    for seq in sequences:
        digest.update(f"{seq.start}:{seq.ids}".encode())
    return digest.hexdigest()[:10]


def _baseline_info(pairs: Sequence[tuple[RoutingMask, Scores]], objective: str) -> dict[str, Any]:
    values = [s.value(objective) for _, s in pairs]
    agreement = [s.mean("agreement") for _, s in pairs]
    return {
        "masks": [m.skipped_layers for m, _ in pairs],
        "values": values,
        "agreement": agreement,
        "mean_value": sum(values) / len(values) if values else None,
        "mean_agreement": sum(agreement) / len(agreement) if agreement else None,
    }


def calibrate_pair(
    target: LoadedModel,
    drafter: LoadedModel,
    settings: CalibrationSettings,
    *,
    storage: str | os.PathLike[str] | None = None,
    work_file: str | os.PathLike[str] | None = None,
    resume: bool = False,
    log: Log = lambda text: None,
    progress: bool = False,
) -> RoutingProfile:
    """Search the slim mask, measure costs, collect gate statistics and pick the gate: a routing profile.

    `storage` (SQLite) logs the mask searches and `work_file` (JSON) keeps the generated continuations;
    with `resume` both are reused. Costs are always measured afresh.
    """
    settings.check()
    started = time.perf_counter()
    model = target.model
    num_layers = num_decoder_layers(model)
    fingerprint = model_fingerprint(model)
    prompts = CALIBRATION_PROMPTS[: settings.prompts]
    held_prompts = HELD_OUT_PROMPTS[: settings.held_out]

    reuse = " (reused from the work file when it has them)" if resume else ""
    log(f"generating the target's greedy continuations of {len(prompts)} calibration prompts{reuse}")
    pairs = cached_continuations(target, drafter, prompts, settings.new_tokens, work_file, resume)
    if not pairs:
        raise ViasdError("calibration: the target produced no continuation for any calibration prompt")
    sequences = _teacher(model, pairs)
    drafter_logits = [model_logits(drafter.model, seq.ids, seq.start) for seq in sequences]
    search_seqs = sequences[: max(1, settings.search_prompts)]
    evaluate = mask_evaluator(model, search_seqs, settings.chunk, settings.margin)
    key = _study_key(fingerprint, search_seqs, settings)
    log(
        f"calibration tokens: {sum(s.scored for s in sequences)} scored positions in {len(sequences)} sequences "
        f"({sum(s.scored for s in search_seqs)} in the {len(search_seqs)} that drive the search)"
    )

    preference: list[float] | None = None
    if settings.preference:
        preference = _cached_preference(evaluate, num_layers, settings.objective, key, work_file, resume, log)

    counts = sorted({layers_to_skip(num_layers, r) for r in settings.skip_ratios} - {0})
    if not counts:
        raise ViasdError("calibration: the skip ratios skip no layer of this model")
    search_start = time.perf_counter()
    candidates: list[dict[str, Any]] = []
    previous: RoutingMask | None = None
    for index, count in enumerate(counts):
        # Equal shares, plus whatever earlier searches left unused: an early overrun cannot starve later ones.
        budget = None
        if settings.time_budget is not None:
            left = settings.time_budget - (time.perf_counter() - search_start)
            budget = max(left / (len(counts) - index), settings.time_budget / len(counts) / 2)
        seeds: list[list[float]] = [scores_for(num_layers, spread_mask(num_layers, count / num_layers).skipped_layers)]
        if preference is not None:
            order = sorted(middle_layers(num_layers), key=lambda layer: (preference[layer - 1], layer))
            seeds.append(scores_for(num_layers, order[:count], preference))
        if previous is not None and len(previous.skipped_layers) < count:
            seeds.append(scores_for(num_layers, previous.skipped_layers, preference))
        log(f"searching a mask that skips {count}/{num_layers} layers ({settings.iterations} trials)")
        result = search_mask(
            evaluate,
            num_layers,
            count,
            objective=settings.objective,
            iterations=settings.iterations,
            time_budget=budget,
            bo_every=settings.bo_every,
            sampler=settings.sampler,
            seed=settings.seed + count,
            storage=storage,
            study_name=f"{settings.objective}-skip{count}of{num_layers}-{key}",
            resume=resume,
            seeds=seeds,
            progress=progress,
        )
        previous = result.mask
        baseline = random_baseline(evaluate, num_layers, count, settings.random_masks, settings.seed + 1000 + count)
        stats = [
            position_stats(d, slim_logits(model, result.mask, seq, settings.chunk), seq.full_logits)
            for seq, d in zip(sequences, drafter_logits, strict=True)
        ]
        candidates.append({"result": result, "baseline": baseline, "stats": stats})
        if work_file is not None:  # kept for replays under other budgets or costs (scripts/calibration_whatif.py)
            cache = _read_work(work_file)
            cache[stats_key(key, result.mask)] = [asdict(seq) for seq in stats]
            write_json_atomic(work_file, cache)
        log(
            f"  best {result.mask.describe()}: {settings.objective} {result.value:.4f}, "
            f"agreement {result.scores.mean('agreement'):.3f}; random masks: "
            f"{_baseline_info(baseline, settings.objective)['mean_value']:.4f}"
        )

    log("measuring drafter, slim and full pass costs on this machine")
    lengths = sorted(set(range(1, max(settings.gammas) + 2)) | {12, 16, 24, 32, 48})
    longest = max(sequences, key=lambda s: len(s.ids))
    table = measure_costs(
        model,
        drafter.model,
        [c["result"].mask for c in candidates],
        longest.ids,
        lengths,
        prefix=min(100, max(len(longest.ids) - 1, 1)),
        repeats=settings.cost_repeats,
        seed=settings.seed,
    )

    log("replaying rounds to pick gate thresholds, gamma and cap")
    for i, cand in enumerate(candidates):
        cand["selection"] = select_policy(
            cand["stats"],
            table.costs(i),
            settings.gammas,
            settings.caps,
            settings.quality_budget,
            min_tier_share=settings.min_tier_share,
            pregates=settings.pregates,
        )
        sel = cand["selection"]
        log(
            f"  skip {len(cand['result'].mask.skipped_layers)}: via {sel.prediction.tokens_per_second:.2f} tok/s "
            f"(errors {sel.prediction.error_rate:.3f}), sd {sel.sd_prediction.tokens_per_second:.2f}, "
            f"plain {sel.plain_tokens_per_second:.2f}"
        )
    chosen_index = max(range(len(candidates)), key=lambda i: candidates[i]["selection"].prediction.tokens_per_second)
    chosen = candidates[chosen_index]
    result, selection = chosen["result"], chosen["selection"]

    held: dict[str, Any] = {}
    if held_prompts:
        log(f"checking the mask on {len(held_prompts)} held-out prompts against random masks")
        held_pairs = cached_continuations(target, drafter, held_prompts, settings.new_tokens, work_file, resume)
        held_seqs = _teacher(model, held_pairs)
        if held_seqs:
            held_eval = mask_evaluator(model, held_seqs, settings.chunk, settings.margin)
            count = len(result.mask.skipped_layers)
            searched = held_eval(result.mask)
            rand = random_baseline(held_eval, num_layers, count, settings.random_masks, settings.seed + 2000 + count)
            held = {
                "prompts": [text for _, text in held_prompts],
                "positions": sum(s.scored for s in held_seqs),
                "searched": {"value": searched.value(settings.objective), **searched.summary()},
                "random": _baseline_info(rand, settings.objective),
            }

    policy = selection.policy
    profile = RoutingProfile(
        target={"name": target.name, "fingerprint": fingerprint},
        drafter={"name": drafter.name, "fingerprint": model_fingerprint(drafter.model)},
        masks=[result.mask],
        gate=Gate(policy.signal, (policy.k_accept, policy.k_full)),
        gamma=policy.gamma,
        cap=policy.cap,
        pregate=policy.pregate,
        search={
            **result.info(),
            "margin": settings.margin,
            "chunk": settings.chunk,
            "study_key": key,
            "sampler": f"random interleaved with {settings.sampler} every {settings.bo_every} trials (optuna)",
            "iterations": settings.iterations,
            "random_baseline": _baseline_info(chosen["baseline"], settings.objective),
            "held_out": held,
            "layer_preference": preference,
            "candidates": [
                {
                    **c["result"].info(),
                    "random_baseline_mean_value": _baseline_info(c["baseline"], settings.objective)["mean_value"],
                    "random_baseline_mean_agreement": _baseline_info(c["baseline"], settings.objective)[
                        "mean_agreement"
                    ],
                    "predicted_via_tokens_per_second": c["selection"].prediction.tokens_per_second,
                    "predicted_via_error_rate": c["selection"].prediction.error_rate,
                    "predicted_sd_tokens_per_second": c["selection"].sd_prediction.tokens_per_second,
                    "gate": asdict(c["selection"].policy),
                }
                for c in candidates
            ],
        },
        calibration={
            "date": utc_now(),
            "machine": machine_info(next(model.parameters()).device, next(model.parameters()).dtype),
            "costs": {**table.to_dict(), "slim_mask_index": chosen_index},
            "statistics": summarize_stats(chosen["stats"]),
            "predicted": selection.to_dict(),
            "quality_budget": settings.quality_budget,
            "gammas": list(settings.gammas),
            "caps": list(settings.caps),
            "prompts": [text for _, text in prompts],
            "search_prompts": len(search_seqs),
            "new_tokens": settings.new_tokens,
            "positions": sum(s.scored for s in sequences),
            "seconds": round(time.perf_counter() - started, 1),
        },
        created=utc_now(),
    )
    return profile
