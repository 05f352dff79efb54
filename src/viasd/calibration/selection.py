"""Choosing the round policy: the fastest gate, draft length and stop, cap and pre-gate within a quality budget.

Every candidate (signal, k_accept <= k_full, gamma, cap, pre-gate, draft stop threshold) is replayed along the
gate records with the measured costs (replay.py); the fastest whose estimated error rate (committed tokens that
differ from the target's greedy choice) stays within the budget wins. Classic SD is replayed with the same costs and
records for comparison, with every gamma and stop threshold.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from viasd.calibration.costs import Costs
from viasd.calibration.records import GateRecords
from viasd.calibration.replay import Prediction, replay
from viasd.decode.round import RoundPolicy
from viasd.errors import ViasdError
from viasd.verify.gates import SIGNALS, Gate

NO_ACCEPT = -1.0  # k_accept below every signal value (signals are >= 0): no accept tier
NO_FULL = 1e9  # k_full above every signal value: only the cap sends tokens to the full target


def policy_dict(policy: RoundPolicy) -> dict[str, Any]:
    """A policy as the profile records it."""
    return {
        "signal": policy.gate.signal,
        "thresholds": list(policy.gate.thresholds),
        "gamma": policy.gamma,
        "cap": policy.cap,
        "pregate": policy.pregate,
        "stop": policy.stop,
        "exact": policy.gate.always_full,
    }


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

    policy: RoundPolicy
    prediction: Prediction
    sd_policy: RoundPolicy
    sd_prediction: Prediction
    plain_tokens_per_second: float
    candidates: int
    feasible: int
    quality_budget: float
    min_tier_share: float = 0.0
    unconstrained: tuple[RoundPolicy, Prediction] | None = None  # the fastest within the budget, tier shares aside

    def to_dict(self) -> dict[str, Any]:
        out = {
            "quality_budget": self.quality_budget,
            "min_tier_share": self.min_tier_share,
            "candidates": self.candidates,
            "feasible": self.feasible,
            "via": {"policy": policy_dict(self.policy), **self.prediction.to_dict()},
            "sd": {"policy": policy_dict(self.sd_policy), **self.sd_prediction.to_dict()},
            "plain": {"tokens_per_second": self.plain_tokens_per_second},
        }
        if self.unconstrained is not None:
            policy, pred = self.unconstrained
            out["via_unconstrained"] = {"policy": policy_dict(policy), **pred.to_dict()}
        return out


def has_draft_confidence(records: Sequence[GateRecords]) -> bool:
    """Whether the records carry the drafter's confidence for every position (the pre-gate needs it)."""
    return all(len(seq.draft_top) == len(seq) for seq in records)


def select_policy(
    records: Sequence[GateRecords],
    costs: Costs,
    gammas: Sequence[int] = (2, 3, 4, 5, 6, 8),
    caps: Sequence[int] = (8, 16, 32),
    quality_budget: float = 0.02,
    signals: Sequence[str] = SIGNALS,
    quantiles: int = 20,
    min_tier_share: float = 0.0,
    pregates: Sequence[float] = (0.0,),
    stops: Sequence[float] = (0.0,),
) -> Selection:
    """The fastest one-slim-tier policy whose replayed error rate is within `quality_budget`, and the fastest
    classic SD gamma and stop threshold, under the same costs.

    `min_tier_share` > 0 also requires each tier (accept, slim, full) to decide at least that share of the
    draft tokens, for a profile that exercises all three tiers even where fewer would be faster; the fastest
    policy without that requirement is reported alongside.
    """
    if not gammas:
        raise ViasdError("calibration: no draft length gamma to select from")
    if not caps or min(caps) < 2:
        raise ViasdError("calibration: caps must be >= 2")
    if not 0.0 <= quality_budget < 1.0:
        raise ViasdError(f"calibration: the quality budget must be in [0, 1), got {quality_budget}")
    if not 0.0 <= min_tier_share <= 1.0 / 3.0:
        raise ViasdError(f"calibration: the minimum tier share must be in [0, 1/3], got {min_tier_share}")
    if not sum(len(s) for s in records):
        raise ViasdError("calibration: no gate records to select thresholds from")
    if not pregates or not all(0.0 <= v <= 1.0 for v in pregates):
        raise ViasdError(f"calibration: pre-gates must be in [0, 1], got {list(pregates)}")
    if not stops or not all(0.0 <= v <= 1.0 for v in stops):
        raise ViasdError(f"calibration: draft stop thresholds must be in [0, 1], got {list(stops)}")
    confident = has_draft_confidence(records)  # the pre-gate and the stop threshold judge the drafter's confidence
    pregate_values = sorted(set(pregates)) if confident else [0.0]
    stop_values = sorted(set(stops)) if confident else [0.0]
    sd_policies = (RoundPolicy(Gate.exact(), gamma=g, stop=v) for g, v in itertools.product(gammas, stop_values))
    sd = [(p, replay(records, p, costs)) for p in sd_policies]
    sd_policy, sd_pred = max(sd, key=lambda pair: pair[1].tokens_per_second)
    best: tuple[RoundPolicy, Prediction] | None = None
    free: tuple[RoundPolicy, Prediction] | None = None
    candidates = feasible = 0
    for signal in signals:
        values = threshold_candidates([v for seq in records for v in seq.signal(signal)], quantiles)
        accepts, fulls = [NO_ACCEPT, *values], [*values, NO_FULL]
        grid = itertools.product(gammas, caps, accepts, fulls, pregate_values, stop_values)
        for gamma, cap, ka, kf, pregate, stop in grid:
            if kf < ka:
                continue
            policy = RoundPolicy(Gate(signal, (ka, kf)), gamma, cap, pregate, stop)
            pred = replay(records, policy, costs)
            candidates += 1
            if pred.error_rate > quality_budget:
                continue
            if free is None or pred.tokens_per_second > free[1].tokens_per_second:
                free = (policy, pred)
            decided = pred.decided
            if min(decided.values()) < min_tier_share * sum(decided.values()):
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
