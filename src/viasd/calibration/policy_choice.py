"""Choosing the round policy of one slim view and drafter under the calibration settings (selection.py's search, with
that pair's measured costs), and writing the chosen policy into a routing profile."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from viasd.calibration.costs import CostTable
from viasd.calibration.records import GateRecords
from viasd.calibration.selection import Selection, select_policy
from viasd.calibration.settings import CalibrationSettings
from viasd.profile import RoutingProfile


def select_under(
    records: Sequence[GateRecords],
    table: CostTable,
    index: int,
    settings: CalibrationSettings,
    drafter: str | None = None,
) -> Selection:
    """The fastest policy within the settings' budget along `records`, with the costs of slim view `index` and
    `drafter` (None: the drafter as loaded)."""
    return select_policy(
        records,
        table.costs(index, drafter=drafter),
        settings.gammas,
        settings.caps,
        settings.quality_budget,
        min_tier_share=settings.min_tier_share,
        pregates=settings.pregates,
        stops=settings.stops,
    )


def with_policy(profile: RoutingProfile, selection: Selection) -> RoutingProfile:
    """The profile with the selected round policy."""
    policy = selection.policy
    return dataclasses.replace(
        profile, gate=policy.gate, gamma=policy.gamma, cap=policy.cap, pregate=policy.pregate, stop=policy.stop
    )
