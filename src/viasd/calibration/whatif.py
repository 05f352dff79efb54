"""What would it take for the slim tier to pay? A profile's selection replayed under other budgets and under
hypothetical costs or verifiers, as a markdown table (`viasd calibrate --reselect PROFILE --what-if`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from viasd.calibration.costs import Costs, CostTable
from viasd.calibration.records import GateRecords
from viasd.calibration.selection import select_policy
from viasd.calibration.settings import CalibrationSettings
from viasd.profile import RoutingProfile


def always_right(records: Sequence[GateRecords]) -> list[GateRecords]:
    """The records of a slim verifier that always agrees with the target (the drafter unchanged, at every depth)."""

    def right(seq: GateRecords) -> GateRecords:
        return dataclasses.replace(
            seq,
            slim_ok=[[True] * len(seq) for _ in seq.slim_ok],
            slim_agrees=[list(seq.draft_ok) for _ in seq.slim_agrees],
            depths=[right(deeper) for deeper in seq.depths],
        )

    return [right(seq) for seq in records]


def at_half_cost(costs: Costs) -> Costs:
    """Costs with every slim pass at half a full pass of the same length."""
    return dataclasses.replace(costs, slim=tuple(tuple(0.5 * v for v in costs.full) for _ in costs.slim))


def flat_in_the_block(costs: Costs) -> Costs:
    """Costs with every slim pass as cheap as the slim view's one-token pass, whatever the block (a kernel whose
    block of tokens costs what one token does, as the full target's nearly does on a CPU with AMX)."""
    return dataclasses.replace(costs, slim=tuple(tuple(slim[0] for _ in slim) for slim in costs.slim))


def what_if_table(profile: RoutingProfile, records: Sequence[GateRecords], settings: CalibrationSettings) -> str:
    """Rows: the selection as configured, then looser budgets, then a cheaper or always-right slim verifier."""
    cost_data = profile.calibration.get("costs", {})
    measured = CostTable.from_dict(cost_data).costs(
        int(cost_data.get("slim_mask_index", 0)), drafter=cost_data.get("drafter")
    )
    budget, share, gates = settings.quality_budget, settings.min_tier_share, settings.pregates
    right = always_right(records)
    pct = f"{100 * budget:g}%"  # 0.5%, 2%
    scenarios = [
        (f"as configured (budget {pct}, every tier >= {100 * share:g}%, pre-gates {list(gates)}, "
         f"stops {list(settings.stops)})", records, measured, budget, share, gates),
        (f"budget {pct}, tiers free", records, measured, budget, 0.0, gates),
        ("budget 5%, tiers free", records, measured, 0.05, 0.0, gates),
        ("budget 10%, tiers free", records, measured, 0.10, 0.0, gates),
        (f"slim pass at half a full pass, budget {pct}", records, at_half_cost(measured), budget, 0.0, gates),
        (f"slim pass at its 1-token cost for any block, budget {pct}", records, flat_in_the_block(measured), budget,
         0.0, gates),
        (f"slim verifier always right, measured cost, budget {pct}", right, measured, budget, 0.0, gates),
        (f"slim always right and at half cost, budget {pct}", right, at_half_cost(measured), budget, 0.0, gates),
    ]  # fmt: skip
    lines = [
        "| scenario | via tok/s | sd tok/s | via/sd | gate | gamma | stop | cap | pre-gate | errors | tiers a/s/f |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, data, costs, quality, tier_share, pregates in scenarios:
        sel = select_policy(
            data,
            costs,
            settings.gammas,
            settings.caps,
            quality,
            min_tier_share=tier_share,
            pregates=pregates,
            stops=settings.stops,
        )
        p, pred = sel.policy, sel.prediction
        d = pred.decided
        thresholds = ", ".join(f"{t:.3g}" for t in p.gate.thresholds)
        lines.append(
            f"| {name} | {pred.tokens_per_second:.2f} | {sel.sd_prediction.tokens_per_second:.2f} | "
            f"{pred.tokens_per_second / sel.sd_prediction.tokens_per_second:.2f} | {p.gate.signal} [{thresholds}] | "
            f"{p.gamma} | {p.stop:g} | {p.cap} | {p.pregate:g} | {pred.error_rate:.3f} | "
            f"{d['accept']}/{d['slim']}/{d['full']} |"
        )
    return "\n".join(lines)
