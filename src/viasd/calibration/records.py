"""Gate records: along a teacher-forced sequence, what the drafter, each slim view and the target would do.

At every position of the target's greedy continuation of a calibration prompt: the drafter's greedy token
x and its top probability, the gate signals KL(s || p) and 1 - s(x) / max s of the shallowest slim view s
against the drafter's p, and per slim view whether its top token is the target's and whether it is x.
The replay (replay.py) plays rounds along these records instead of running models.

A model drafter reads every token, so its prediction at a position is the same whichever draft of a round it is. A
draft head's is not: the i-th draft of a round (depth i + 1) comes from a chain of head steps that started at the
target's feature i + 1 positions back, so a head's records hold one set of drafter fields per depth (`depths`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from viasd.errors import ViasdError
from viasd.verify.gates import SIGNALS, confidence_signal, kl_signal


@dataclass
class GateRecords:
    """Teacher-forced records of one sequence, one entry per position."""

    kl: list[float]  # KL(s || p) of the shallowest slim view
    confidence: list[float]  # 1 - s(x) / max s of the shallowest slim view
    draft_ok: list[bool]  # the drafter's greedy token is the target's
    draft_top: list[float]  # the drafter's top probability (for the pre-gate)
    slim_ok: list[list[bool]]  # per slim view: its top token is the target's
    slim_agrees: list[list[bool]]  # per slim view: its top token is the drafter's
    # A chain drafter's records at depths 2, 3, ... (the drafter fields as the i-th draft of a round would have them,
    # i >= 1); empty: the drafter's predictions do not depend on the depth (a model drafter).
    depths: list[GateRecords] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.kl)

    @property
    def views(self) -> int:
        return len(self.slim_ok)

    def signal(self, name: str) -> list[float]:
        if name not in SIGNALS:
            raise ViasdError(f"unknown gate signal {name!r}")
        return self.kl if name == "kl" else self.confidence

    def at_depth(self, depth: int) -> GateRecords:
        """The records of the drafts at `depth` (1: a round's first draft); the deepest recorded beyond them."""
        if depth <= 1 or not self.depths:
            return self
        return self.depths[min(depth, len(self.depths) + 1) - 2]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateRecords:
        if not isinstance(data, dict):
            raise ViasdError("malformed gate records: not a mapping")
        deeper = data.get("depths", [])
        if not isinstance(deeper, list):
            raise ViasdError("malformed gate records: depths is not a list")
        try:
            records = cls(**{**data, "depths": [cls.from_dict(d) for d in deeper]})
        except TypeError as exc:
            raise ViasdError(f"malformed gate records: {exc}") from exc
        n = len(records)
        lists = [records.confidence, records.draft_ok, records.draft_top, *records.slim_ok, *records.slim_agrees]
        if not records.slim_ok or any(len(values) != n for values in lists):
            raise ViasdError("malformed gate records: the lists differ in length")
        if any(len(d) != n or d.views != records.views for d in records.depths):
            raise ViasdError("malformed gate records: a depth's records cover other positions or views")
        return records


def gate_records(
    drafter_logits: torch.Tensor | Sequence[torch.Tensor],
    slim_logits: Sequence[torch.Tensor],
    full_logits: torch.Tensor,
) -> GateRecords:
    """Records from the models' logits over the same positions (greedy decoding: the gate sees the drafter's
    and the shallowest slim view's softmax at temperature 1, as in the decoder). `drafter_logits`: one tensor, or
    one per depth (a chain drafter's: the first for a round's first draft, then deeper)."""
    if not isinstance(drafter_logits, torch.Tensor):
        first, *deeper = drafter_logits
        records = gate_records(first, slim_logits, full_logits)
        records.depths = [gate_records(logits, slim_logits, full_logits) for logits in deeper]
        return records
    if not slim_logits:
        raise ViasdError("gate records: no slim view")
    if any(s.shape[0] != full_logits.shape[0] for s in (drafter_logits, *slim_logits)):
        raise ViasdError("gate records: the models' logits cover different positions")
    p = drafter_logits.float().softmax(dim=-1)
    s = slim_logits[0].float().softmax(dim=-1)
    x = drafter_logits.argmax(dim=-1)
    top_q = full_logits.argmax(dim=-1)
    tokens = x.tolist()
    return GateRecords(
        kl=kl_signal(s, p, tokens).tolist(),
        confidence=confidence_signal(s, p, tokens).clamp_min(0.0).tolist(),
        draft_ok=(x == top_q).tolist(),
        draft_top=p.max(dim=-1).values.tolist(),
        slim_ok=[(view.argmax(dim=-1) == top_q).tolist() for view in slim_logits],
        slim_agrees=[(view.argmax(dim=-1) == x).tolist() for view in slim_logits],
    )


def summarize_records(records: Sequence[GateRecords]) -> dict[str, Any]:
    """Rates and signal quantiles over all positions, for the profile."""
    n = sum(len(seq) for seq in records)
    out: dict[str, Any] = {"positions": n, "sequences": len(records)}
    if not n:
        return out
    out["draft_ok_rate"] = sum(sum(seq.draft_ok) for seq in records) / n
    depths = min(len(seq.depths) for seq in records) + 1
    if depths > 1:
        out["draft_ok_rate_by_depth"] = [
            sum(sum(seq.at_depth(d).draft_ok) for seq in records) / n for d in range(1, depths + 1)
        ]
    views = min(seq.views for seq in records)
    out["slim_ok_rate"] = [sum(sum(seq.slim_ok[v]) for seq in records) / n for v in range(views)]
    out["slim_agrees_rate"] = [sum(sum(seq.slim_agrees[v]) for seq in records) / n for v in range(views)]
    qs = [0.1, 0.25, 0.5, 0.75, 0.9]
    for signal in SIGNALS:
        values = torch.tensor([v for seq in records for v in seq.signal(signal)], dtype=torch.float64)
        out[f"{signal}_quantiles"] = {str(q): float(values.quantile(q)) for q in qs}
    return out
