"""Gate records: along a teacher-forced sequence, what the drafter, each slim view and the target would do.

At every position of the target's greedy continuation of a calibration prompt: the drafter's greedy token
x and its top probability, the gate signals KL(s || p) and 1 - s(x) / max s of the shallowest slim view s
against the drafter's p, and per slim view whether its top token is the target's and whether it is x.
The replay (replay.py) plays rounds along these records instead of running models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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

    def __len__(self) -> int:
        return len(self.kl)

    @property
    def views(self) -> int:
        return len(self.slim_ok)

    def signal(self, name: str) -> list[float]:
        if name not in SIGNALS:
            raise ViasdError(f"unknown gate signal {name!r}")
        return self.kl if name == "kl" else self.confidence

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateRecords:
        try:
            records = cls(**data)
        except TypeError as exc:
            raise ViasdError(f"malformed gate records: {exc}") from exc
        n = len(records)
        lists = [records.confidence, records.draft_ok, records.draft_top, *records.slim_ok, *records.slim_agrees]
        if not records.slim_ok or any(len(values) != n for values in lists):
            raise ViasdError("malformed gate records: the lists differ in length")
        return records


def gate_records(
    drafter_logits: torch.Tensor, slim_logits: Sequence[torch.Tensor], full_logits: torch.Tensor
) -> GateRecords:
    """Records from the models' logits over the same positions (greedy decoding: the gate sees the drafter's
    and the shallowest slim view's softmax at temperature 1, as in the decoder)."""
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
    views = min(seq.views for seq in records)
    out["slim_ok_rate"] = [sum(sum(seq.slim_ok[v]) for seq in records) / n for v in range(views)]
    out["slim_agrees_rate"] = [sum(sum(seq.slim_agrees[v]) for seq in records) / n for v in range(views)]
    qs = [0.1, 0.25, 0.5, 0.75, 0.9]
    for signal in SIGNALS:
        values = torch.tensor([v for seq in records for v in seq.signal(signal)], dtype=torch.float64)
        out[f"{signal}_quantiles"] = {str(q): float(values.quantile(q)) for q in qs}
    return out
