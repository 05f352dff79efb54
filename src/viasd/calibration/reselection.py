"""Re-selecting a finished profile's round policy under other settings: its masks and measured costs kept, its gate
records regenerated from its own prompts (or read from the work file), so a shipped profile can be re-derived from the
repository alone."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from viasd.calibration.candidate_records import records_for
from viasd.calibration.candidates import Quantizer, SlimCandidate, drafter_name, drafter_source, quantize_plainly
from viasd.calibration.continuations import Pairs, continuations, teacher_sequences
from viasd.calibration.costs import CostTable, measure_costs
from viasd.calibration.head_drafts import HEAD
from viasd.calibration.policy_choice import select_under, with_policy
from viasd.calibration.progress import Log, silent
from viasd.calibration.provenance import selection_fields, utc_now
from viasd.calibration.records import GateRecords
from viasd.calibration.settings import CalibrationSettings
from viasd.calibration.workfile import WorkFile
from viasd.errors import ViasdError
from viasd.models.loading import LoadedModel
from viasd.profile import RoutingProfile
from viasd.views.quantize import QuantizedLinears
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View


def profile_prompts(profile: RoutingProfile) -> tuple[list[str], int]:
    """The calibration prompts a profile recorded and the continuation length it generated for each."""
    cal = profile.calibration
    try:
        return [str(t) for t in cal["prompts"]], int(cal["new_tokens"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ViasdError(f"the profile does not record its calibration prompts: {exc}") from exc


def profile_data(
    profile: RoutingProfile,
    target: LoadedModel,
    drafter: LoadedModel,
    work: WorkFile,
    log: Log = silent,
    progress: bool = False,
    quantized: Quantizer = quantize_plainly,
) -> tuple[list[GateRecords], list[int]]:
    """The gate records a profile was selected from, regenerated from its own prompts and settings (or read
    from the work file, where an earlier run left them), and the prompt length of each sequence."""
    texts, new_tokens = profile_prompts(profile)
    log(f"regenerating the gate records: the target's continuations of {len(texts)} prompts, teacher-forced")
    base = calibrated_view(profile, target, quantized)
    pairs = continuations(target, drafter, texts, new_tokens, work, True, progress, base=base)
    return records_of(profile, target, drafter, pairs, work, progress, quantized), [len(prompt) for prompt, _ in pairs]


def calibrated_view(profile: RoutingProfile, target: LoadedModel, quantized: Quantizer) -> QuantizedLinears | None:
    """The quantized layers of the view of the target `profile` was calibrated on (None: the target as loaded)."""
    recipe = profile.target_quant
    return quantized(target, recipe) if recipe is not None else None


def records_of(
    profile: RoutingProfile,
    target: LoadedModel,
    drafter: LoadedModel,
    pairs: Pairs,
    work: WorkFile,
    progress: bool = False,
    quantized: Quantizer = quantize_plainly,
) -> list[GateRecords]:
    """The gate records of the profile's drafter and slim views along (prompt, the target's continuation) pairs."""
    base = calibrated_view(profile, target, quantized)
    sequences = teacher_sequences(target, pairs, base)
    chunk = int(profile.search.get("chunk", 8))
    source = drafter_source(drafter_name(profile), target, drafter, quantized, base)
    slims = [SlimCandidate.make(m, profile.slim_quant(i), target, quantized, base) for i, m in enumerate(profile.masks)]
    return records_for(target, source, sequences, slims, chunk, work, True, progress)


def profile_records(
    profile: RoutingProfile,
    target: LoadedModel,
    drafter: LoadedModel,
    work: WorkFile,
    log: Log = silent,
    progress: bool = False,
    quantized: Quantizer = quantize_plainly,
) -> list[GateRecords]:
    """The gate records a profile was selected from (`profile_data` without the prompt lengths)."""
    return profile_data(profile, target, drafter, work, log, progress, quantized)[0]


def reselect(
    profile: RoutingProfile,
    source_sha256: str,
    target: LoadedModel,
    drafter: LoadedModel,
    settings: CalibrationSettings,
    *,
    work_file: str | os.PathLike[str] | None = None,
    log: Log = silent,
    progress: bool = False,
    quantized: Quantizer = quantize_plainly,
) -> RoutingProfile:
    """`profile` with its round policy selected again under `settings` (quality budget, tier shares, gammas, caps,
    pre-gates, stop thresholds), from its own masks, measured costs and regenerated gate records."""
    settings.check()
    profile.check_models(target.model, None if profile.self_drafter or profile.head_drafter else drafter.model)
    costs = profile.calibration.get("costs", {})
    table = CostTable.from_dict(costs)
    index = int(costs.get("slim_mask_index", 0))
    work = WorkFile(work_file)
    switched: dict[str, object] = {}
    if settings.drafters == (HEAD,) and not profile.head_drafter:
        headed = _with_head(profile, table, target, drafter, work, log, progress, quantized, settings)
        profile, table, index, costs = headed
        switched = {"costs": costs, "drafters": [HEAD]}
    records = profile_records(profile, target, drafter, work, log, progress, quantized)
    log("replaying rounds to pick gate thresholds, gamma, cap, pre-gate and draft stop threshold")
    selection = select_under(records, table, index, settings, costs.get("drafter"))
    calibration = {
        **profile.calibration,
        **switched,
        **selection_fields(records, selection, settings),
        "reselected": {"from_sha256": source_sha256, "date": utc_now()},
    }
    return with_policy(dataclasses.replace(profile, calibration=calibration), selection)


def _with_head(
    profile: RoutingProfile,
    table: CostTable,
    target: LoadedModel,
    drafter: LoadedModel,
    work: WorkFile,
    log: Log,
    progress: bool,
    quantized: Quantizer,
    settings: CalibrationSettings,
) -> tuple[RoutingProfile, CostTable, int, dict[str, Any]]:
    """`profile` with the target's draft head as its drafter, and the pass costs of the head, the full target and
    the profile's first slim view measured here together (the head's cost is not in the profile's table)."""
    from viasd.heads.find import find_head

    found = find_head(target.model)
    headed = dataclasses.replace(profile, drafter={"name": HEAD, "head": found.digest}, kinds={})
    texts, new_tokens = profile_prompts(profile)
    base = calibrated_view(profile, target, quantized)
    pairs = continuations(target, drafter, texts, new_tokens, work, True, progress, base=base)
    log("measuring the draft head's, the full target's and the slim view's pass costs on this machine")
    measured = kind_costs(headed, table, target, drafter, pairs, settings.seed, quantized)
    costs = {**measured.to_dict(), "slim_mask_index": 0, "drafter": HEAD}
    kinds = {kind: own for kind, own in profile.kinds.items() if own["gate"].always_full}  # exact kinds stay exact
    return dataclasses.replace(headed, kinds=kinds), measured, 0, costs


def kind_costs(
    viewed: RoutingProfile,
    table: CostTable,
    target: LoadedModel,
    drafter: LoadedModel,
    pairs: Pairs,
    seed: int,
    quantized: Quantizer = quantize_plainly,
) -> CostTable:
    """The pass costs of `viewed`'s drafter, full target and slim view at the lengths of `table`, measured now in one
    interleaved run (as calibration measures them) along the longest of the kind's sequences."""
    base = calibrated_view(viewed, target, quantized)
    source = drafter_source(drafter_name(viewed), target, drafter, quantized, base)
    slim = SlimCandidate.make(viewed.masks[0], viewed.slim_quant(0), target, quantized, base)
    longest = max((prompt + continuation for prompt, continuation in pairs), key=len)
    model = target.model
    return measure_costs(
        model,
        {source.name: source.timed()},
        [slim.view],
        longest,
        table.lengths,
        prefix=min(table.prefix or 100, max(len(longest) - 1, 1)),
        repeats=table.repeats or 5,
        seed=seed,
        full_view=View(linears=base) if base is not None else None,
    )


def reselect_kind(
    profile: RoutingProfile,
    source_sha256: str,
    target: LoadedModel,
    drafter: LoadedModel,
    settings: CalibrationSettings,
    kind: str,
    count: int | None,
    *,
    work_file: str | os.PathLike[str] | None = None,
    log: Log = silent,
    progress: bool = False,
    quantized: Quantizer = quantize_plainly,
    slim_quant: QuantRecipe | None = None,
) -> RoutingProfile:
    """`profile` with a round policy of its own for requests of task `kind`, selected under `settings` from the
    gate records along the target's continuations of `count` calibration-split tasks of that kind (the profile's
    masks, views and measured costs kept; its other policies untouched).

    slim_quant: the kind's slim view as this quantization of the target instead of the profile's; its gate records
    are made with it, and the pass costs (drafter, full target and that view) are measured again here, together,
    as the profile's were, so that the replay weighs the view's real cost.
    """
    from viasd.bench.tasks import HUMANEVAL_STOP
    from viasd.calibration.kind_prompts import kind_prompts
    from viasd.task_kind import CODE

    settings.check()
    profile.check_models(target.model, None if profile.self_drafter else drafter.model)
    costs = profile.calibration.get("costs", {})
    table = CostTable.from_dict(costs)
    index = int(costs.get("slim_mask_index", 0))
    if slim_quant is not None and len(profile.masks) != 1:
        raise ViasdError(f"a slim view of {kind}'s own needs a profile with one slim view, not {len(profile.masks)}")
    viewed = profile if slim_quant is None else dataclasses.replace(profile, quant=[slim_quant], kinds={})
    prompts, source = kind_prompts(target.tokenizer, kind, count)
    stops = HUMANEVAL_STOP if kind == CODE else ()
    work = WorkFile(work_file)
    log(f"{kind}: the target's continuations of {source} ({settings.new_tokens} tokens at most), teacher-forced")
    base = calibrated_view(profile, target, quantized)
    pairs = continuations(target, drafter, prompts, settings.new_tokens, work, True, progress, stops, base)
    records = records_of(viewed, target, drafter, pairs, work, progress, quantized)
    own_costs = {}
    if slim_quant is not None:
        log(f"{kind}: measuring drafter, full and {slim_quant.name} slim pass costs on this machine")
        table = kind_costs(viewed, table, target, drafter, pairs, settings.seed, quantized)
        index, own_costs = 0, {"costs": {**table.to_dict(), "slim_mask_index": 0, "drafter": drafter_name(viewed)}}
    log(f"{kind}: replaying rounds to pick gate thresholds, gamma, cap, pre-gate and draft stop threshold")
    selection = select_under(records, table, index, settings, costs.get("drafter"))
    chosen = selection.policy
    own = {
        "gate": chosen.gate,
        "gamma": chosen.gamma,
        "cap": chosen.cap,
        "pregate": chosen.pregate,
        "stop": chosen.stop,
        **({"quant": [slim_quant]} if slim_quant is not None else {}),
    }
    recorded = {
        **own_costs,
        "prompts": source,
        "new_tokens": settings.new_tokens,
        "stop_strings": list(stops),
        **selection_fields(records, selection, settings),
        "from_sha256": source_sha256,
        "date": utc_now(),
    }
    kinds_recorded = {**profile.calibration.get("kinds", {}), kind: recorded}
    return dataclasses.replace(
        profile, kinds={**profile.kinds, kind: own}, calibration={**profile.calibration, "kinds": kinds_recorded}
    )
