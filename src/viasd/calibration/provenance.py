"""What a profile records of its calibration besides the policy: where and when it ran, what was selected under which
settings, and how each candidate fared, so a profile can be judged (and re-derived) from the file alone."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import torch
import transformers

from viasd.calibration.candidates import DraftSource, SlimCandidate
from viasd.calibration.records import GateRecords, summarize_records
from viasd.calibration.selection import Selection, policy_dict
from viasd.calibration.settings import CalibrationSettings

if TYPE_CHECKING:
    from viasd.calibration.head_drafts import HeadSource


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
    """The time now, in UTC, to the second (ISO 8601)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def selection_fields(
    records: Sequence[GateRecords], selection: Selection, settings: CalibrationSettings
) -> dict[str, Any]:
    """The calibration entries a selection writes: the records' statistics, the predictions and the settings it
    searched under (the same whether the profile is made from scratch or re-selected)."""
    return {
        "statistics": summarize_records(records),
        "predicted": selection.to_dict(),
        "quality_budget": settings.quality_budget,
        "gammas": list(settings.gammas),
        "caps": list(settings.caps),
        "pregates": list(settings.pregates),
        "stops": list(settings.stops),
    }


def candidate_summaries(
    selections: Mapping[tuple[int, int], Selection],
    sources: Sequence[DraftSource | HeadSource],
    slims: Sequence[SlimCandidate],
) -> list[dict[str, Any]]:
    """Each (drafter, slim view) candidate's best policy and its predictions, keyed as `selections` is:
    (index in `sources`, index in `slims`)."""
    return [
        {
            "slim": slims[v].describe(),
            "drafter": sources[d].name,
            "predicted_via_tokens_per_second": sel.prediction.tokens_per_second,
            "predicted_via_error_rate": sel.prediction.error_rate,
            "predicted_sd_tokens_per_second": sel.sd_prediction.tokens_per_second,
            "gate": policy_dict(sel.policy),
        }
        for (d, v), sel in selections.items()
    ]
