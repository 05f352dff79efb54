"""Projected tokens/s of plain, sd and via: measured pass costs combined with acceptance and gate statistics.

The costs are a `viasd costs --out` file, measured on the device that would run the models (the GPU a large
target needs; a random model of the target's shape times the same). The statistics are gate records
(records.py) along sequences of the target's continuations: from a calibration of a real pair (a routing
profile's records, regenerated as `--reselect` does), or made from explicit figures (`explicit_records`:
acceptance, tier fractions and slim agreement that someone assumed or read elsewhere, labelled as such). The
decoder's own round (replay.py) is played along the records with the costs, so the projection follows the rules
the decoder follows.

Per sequence of T tokens after a prompt of P tokens (the prompt terms only with `prefill`), with c_f the full
target's pass, c_d the drafter's:
    plain: c_f(P) + (T - 1) c_f(1)                  (without the prompt: T c_f(1))
    sd, via: the replayed rounds + c_f(P + gamma) - c_f(1 + gamma) + c_d(P) - c_d(1)
(the first round of both goes to the full target, which reads the prompt with its first block; the drafter reads
the prompt in its first step; a draft head reads none, so its c_d(P) - c_d(1) is 0). Per-round
Python work is left out. Speedups are geometric means over sequences of each sequence's tokens/s over plain
decoding's, as `viasd bench` reports them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from viasd.calibration.costs import Costs
from viasd.calibration.head_drafts import HEAD
from viasd.calibration.records import GateRecords
from viasd.calibration.replay import PARTS, replay
from viasd.decode.round import RoundPolicy
from viasd.errors import ViasdError
from viasd.verify.gates import Gate

# The gate of explicit records: their signals put each position squarely inside one tier.
EXPLICIT_GATE = Gate("kl", (0.5, 2.0))
_EXPLICIT_SIGNALS = {"kl": (0.0, 1.0, 4.0), "confidence": (0.0, 0.5, 1.0)}  # per tier: accept, slim, full


@dataclass(frozen=True)
class Workload:
    """Gate records per sequence, each sequence's prompt length (0: none), and where the statistics come from."""

    records: list[GateRecords]
    prompts: list[int]
    source: str

    def __post_init__(self) -> None:
        if len(self.records) != len(self.prompts) or not self.records or not all(len(r) for r in self.records):
            raise ViasdError("projection: no sequences to replay, or a prompt length missing")


@dataclass
class MethodProjection:
    """One method's projection: tokens and seconds summed over the sequences, its speedup over plain, and the
    replayed counts (sd and via)."""

    method: str
    tokens: int
    seconds: float
    speedup: float
    counts: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "speedup": self.speedup,
            **self.counts,
        }


def geometric_mean(values: Sequence[float]) -> float:
    """Geometric mean of positive values."""
    return math.exp(sum(math.log(v) for v in values) / len(values))


def plain_seconds(tokens: int, prompt: int, costs: Costs) -> float:
    """Plain decoding of `tokens` after a prompt of `prompt` tokens (0: the prompt not counted)."""
    if prompt <= 0:
        return tokens * costs.full_pass(1)
    return costs.full_pass(prompt) + (tokens - 1) * costs.full_pass(1)


def prompt_parts(prompt: int, gamma: int, costs: Costs) -> dict[str, float]:
    """What reading the prompt adds to a drafting method's replayed rounds (the module docstring's terms), by
    part: the drafter's and the target's."""
    if prompt <= 0:
        return {"draft": 0.0, "verify": 0.0}
    drafter = costs.drafter_pass(prompt) - costs.step if costs.drafter_reads_prompt else 0.0
    return {"draft": drafter, "verify": costs.full_pass(prompt + gamma) - costs.full_pass(1 + gamma)}


def project(
    workload: Workload, costs: Costs, sd_policy: RoundPolicy, via_policy: RoundPolicy | None
) -> dict[str, MethodProjection]:
    """Predicted plain, sd and via (None: not projected) over the workload's sequences with these costs."""
    if not sd_policy.gate.always_full:
        raise ViasdError("projection: the sd policy must be exact (every token to the full target)")
    policies = {"sd": sd_policy, **({"via": via_policy} if via_policy is not None else {})}
    lengths = [len(seq) for seq in workload.records]
    plain = [plain_seconds(n, p, costs) for n, p in zip(lengths, workload.prompts, strict=True)]
    counts = {"target_calls": sum(lengths), "seconds_by_part": {"draft": 0.0, "slim": 0.0, "verify": sum(plain)}}
    out = {"plain": MethodProjection("plain", sum(lengths), sum(plain), 1.0, counts)}
    for method, policy in policies.items():
        seconds = []
        parts = dict.fromkeys(PARTS, 0.0)
        for seq, prompt in zip(workload.records, workload.prompts, strict=True):
            played = replay([seq], policy, costs)
            reading = prompt_parts(prompt, policy.gamma, costs)
            for part in PARTS:
                parts[part] += played.parts[part] + reading.get(part, 0.0)
            seconds.append(played.seconds + sum(reading.values()))
        ratios = [base / mine for base, mine in zip(plain, seconds, strict=True)]
        counts = replay(workload.records, policy, costs).to_dict()
        for total in ("seconds", "tokens", "tokens_per_second"):  # kept with the prompt terms in MethodProjection
            del counts[total]
        counts["seconds_by_part"] = parts
        out[method] = MethodProjection(method, sum(lengths), sum(seconds), geometric_mean(ratios), counts)
    return out


# --------------------------------------------------------------------------------- explicit statistics


def explicit_records(
    acceptance: float,
    tiers: Sequence[float] = (0.0, 0.0, 1.0),
    slim_agreement: float = 1.0,
    tier_acceptance: Sequence[float] | None = None,
    sequences: int = 32,
    length: int = 128,
    seed: int = 0,
) -> list[GateRecords]:
    """Synthetic gate records of given statistics (not measured), for a projection from assumed figures.

    Each position independently: its tier (accept, slim, full) drawn with the `tiers` fractions and put squarely
    inside it for EXPLICIT_GATE; the draft is the target's token with probability `acceptance` (or the tier's
    entry of `tier_acceptance`); the slim view's top token is the target's with probability `slim_agreement`
    (it then agrees with the draft where the draft is right). The drafter is always confident (no pre-gate).
    """
    _probability(acceptance, "acceptance")
    _probability(slim_agreement, "slim agreement")
    if len(tiers) != 3 or any(not 0.0 <= t <= 1.0 for t in tiers) or abs(sum(tiers) - 1.0) > 1e-6:
        raise ViasdError(
            f"tier fractions must be three shares (accept, slim, full) that add up to 1, got {list(tiers)}"
        )
    rates = tuple(tier_acceptance) if tier_acceptance is not None else (acceptance,) * 3
    if len(rates) != 3:
        raise ViasdError(f"per-tier acceptance needs three rates (accept, slim, full), got {list(rates)}")
    for rate in rates:
        _probability(rate, "per-tier acceptance")
    if sequences < 1 or length < 2:
        raise ViasdError("explicit statistics need at least one sequence of two positions")
    rng = random.Random(seed)
    out = []
    for _ in range(sequences):
        tier = rng.choices(range(3), weights=tiers, k=length)
        draft_ok = [rng.random() < rates[t] for t in tier]
        slim_ok = [rng.random() < slim_agreement for _ in range(length)]
        out.append(
            GateRecords(
                kl=[_EXPLICIT_SIGNALS["kl"][t] for t in tier],
                confidence=[_EXPLICIT_SIGNALS["confidence"][t] for t in tier],
                draft_ok=draft_ok,
                draft_top=[1.0] * length,
                slim_ok=[slim_ok],
                slim_agrees=[[s and d for s, d in zip(slim_ok, draft_ok, strict=True)]],
            )
        )
    return out


def describe_explicit(
    acceptance: float, tiers: Sequence[float], slim_agreement: float, tier_acceptance: Sequence[float] | None
) -> str:
    """The label of explicit statistics: what was assumed."""
    rates = f", per-tier acceptance {'/'.join(f'{r:g}' for r in tier_acceptance)}" if tier_acceptance else ""
    return (
        f"explicit, assumed (not measured): draft acceptance {acceptance:g}{rates}, tiers accept/slim/full "
        f"{'/'.join(f'{t:g}' for t in tiers)}, slim agreement {slim_agreement:g}"
    )


def _probability(value: float, what: str) -> None:
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ViasdError(f"the {what} must be a probability in [0, 1], got {value}")


# ------------------------------------------------------------------------------------------ cost tables


def costs_from_record(
    record: Mapping[str, Any],
    slims: Sequence[str],
    context: int | None = None,
    full: str = "full",
    drafter: str = "full",
) -> tuple[Costs, dict[str, Any]]:
    """Costs from a `viasd costs --out` record: the target's `full` view, the slim views (one per tier) and the
    drafter's view, at the measured context nearest `context` (None: the first measured). Also what was used."""
    tables = record.get("tables")
    if not isinstance(tables, list) or not tables:
        raise ViasdError("the costs file has no model tables: write it with `viasd costs --out` (not --kernels)")
    try:
        lengths = tuple(int(n) for n in record["tokens"])
        targets = [t for t in tables if t["role"] == "target"]
        drafters = [t for t in tables if t["role"] == "drafter"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ViasdError(f"the costs file is malformed: {exc}") from exc
    if not targets:
        raise ViasdError("the costs file has no target table")
    if not drafters:
        raise ViasdError(
            "the costs file has no drafter table: run `viasd costs` with --drafter-views full (or --drafter-shape)"
        )
    contexts = sorted({int(t["context"]) for t in targets})
    chosen = contexts[0] if context is None else min(contexts, key=lambda c: (abs(c - context), c))
    target = next(t for t in targets if int(t["context"]) == chosen)
    holding = [t for t in drafters if drafter in t.get("views", {})] or drafters  # the head's table or a model's
    small = min(holding, key=lambda t: (abs(int(t["context"]) - chosen), int(t["context"])))

    def series(table: Mapping[str, Any], view: str, role: str) -> tuple[float, ...]:
        if view not in table["views"]:
            raise ViasdError(f"no {role} view {view!r} in the costs file (measured: {', '.join(table['views'])})")
        values = tuple(float(v) for v in table["views"][view])
        if len(values) != len(lengths):
            raise ViasdError(
                f"the costs file's {role} view {view!r} has {len(values)} values for {len(lengths)} lengths"
            )
        return values

    costs = Costs(
        lengths,
        series(small, drafter, "drafter"),
        series(target, full, "target"),
        tuple(series(target, view, "target") for view in slims),
        drafter_reads_prompt=drafter != HEAD,
    )
    info = {
        "target": target["model"],
        "drafter": small["model"],
        "context": chosen,
        "drafter_context": int(small["context"]),
        "full_view": full,
        "slim_views": list(slims),
        "drafter_view": drafter,
        "lengths": list(lengths),
        "machine": record.get("machine"),
        "weights": record.get("weights"),
    }
    return costs, info
