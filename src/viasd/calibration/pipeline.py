"""The calibration of one model pair on this machine, step by step: a routing profile from scratch.

`calibrate_pair`:
1. the target's greedy continuations of the calibration prompts (prompts.py), teacher-forced (continuations.py);
2. a layer-mask search per skip count (mask_step.py over search.py and objectives.py), checked against random masks;
3. gate records of each candidate slim view and drafter along the continuations (candidates.py, candidate_records.py);
4. pass costs measured on this machine (costs.py);
5. per candidate, the fastest round policy within the quality budget by replaying the decoder's own round code
   along the records (policy_choice.py over replay.py and selection.py); the fastest candidate wins, and the
   profile records how it was chosen (provenance.py).

`reselection.reselect` repeats step 5 for a finished profile with other selection settings.
"""

from __future__ import annotations

import os
import time

from viasd.calibration.candidate_records import records_for
from viasd.calibration.candidates import Quantizer, SlimCandidate, drafter_source, quantize_plainly
from viasd.calibration.continuations import continuations, teacher_sequences
from viasd.calibration.costs import measure_costs
from viasd.calibration.mask_step import search_masks
from viasd.calibration.policy_choice import select_under, with_policy
from viasd.calibration.progress import Log, silent
from viasd.calibration.prompts import CALIBRATION_PROMPTS
from viasd.calibration.provenance import candidate_summaries, machine_info, selection_fields, utc_now
from viasd.calibration.selection import Selection
from viasd.calibration.settings import CalibrationSettings
from viasd.calibration.workfile import WorkFile
from viasd.errors import ViasdError
from viasd.models.fingerprint import model_fingerprint
from viasd.models.loading import LoadedModel
from viasd.profile import RoutingProfile
from viasd.views.layer_skip import LayerMask, num_decoder_layers
from viasd.views.view import View


def calibrate_pair(
    target: LoadedModel,
    drafter: LoadedModel,
    settings: CalibrationSettings,
    *,
    storage: str | os.PathLike[str] | None = None,
    work_file: str | os.PathLike[str] | None = None,
    resume: bool = False,
    log: Log = silent,
    progress: bool = False,
    quantized: Quantizer = quantize_plainly,
) -> RoutingProfile:
    """Search the slim mask, measure costs, collect gate records and pick the round policy: a routing profile.

    The slim view is chosen among the searched layer masks and the quantized views of `settings.slim_quants`,
    and the drafter among `settings.drafters`, by predicted tokens/s within the quality budget. `storage`
    (SQLite) logs the mask searches and `work_file` (JSON) keeps the continuations, layer scores and gate
    records; with `resume` both are reused. Costs are always measured afresh. `quantized` makes quantized copies.
    """
    settings.check()
    started = time.perf_counter()
    work = WorkFile(work_file)
    model = target.model
    num_layers = num_decoder_layers(model)
    fingerprint = model_fingerprint(model)
    texts = [text for _, text in CALIBRATION_PROMPTS[: settings.prompts]]
    # The full target as calibrated: its view by settings.target_quant (the file's blocks), else as loaded.
    base = quantized(target, settings.target_quant) if settings.target_quant is not None else None
    on = f" ({settings.target_quant.name} view)" if settings.target_quant is not None else ""

    reuse = " (reused from the work file when it has them)" if resume else ""
    log(f"generating the target's{on} greedy continuations of {len(texts)} calibration prompts{reuse}")
    pairs = continuations(target, drafter, texts, settings.new_tokens, work, resume, progress, base=base)
    if not pairs:
        raise ViasdError("calibration: the target produced no continuation for any calibration prompt")
    sequences = teacher_sequences(target, pairs, base)
    log(f"calibration tokens: {sum(s.scored for s in sequences)} scored positions in {len(sequences)} sequences")
    searched, search_info = search_masks(
        target, drafter, sequences, settings, storage, work, resume, log, progress, base
    )

    # The candidates: every searched mask (over the target as calibrated), and each quantized view alone and on the
    # smallest searched mask.
    slims = [SlimCandidate.make(result.mask, None, target, quantized, base) for result, _ in searched]
    for recipe in settings.slim_quants:
        slims.append(SlimCandidate.make(LayerMask.full(num_layers), recipe, target, quantized))
        if searched:
            slims.append(SlimCandidate.make(searched[0][0].mask, recipe, target, quantized))
    sources = [drafter_source(name, target, drafter, quantized, base) for name in settings.drafters]

    log(f"gate records of {len(slims)} slim view(s) with {len(sources)} drafter(s)")
    records = {
        (d, v): records_for(target, source, sequences, [slim], settings.chunk, work, resume, progress)
        for d, source in enumerate(sources)
        for v, slim in enumerate(slims)
    }

    log("measuring drafter, slim and full pass costs on this machine")
    lengths = sorted(set(range(1, max(settings.gammas) + 2)) | {12, 16, 24, 32, 48})
    longest = max(sequences, key=lambda s: len(s.ids))
    table = measure_costs(
        model,
        {source.name: source.timed() for source in sources},
        [slim.view for slim in slims],
        longest.ids,
        lengths,
        prefix=min(100, max(len(longest.ids) - 1, 1)),
        repeats=settings.cost_repeats,
        seed=settings.seed,
        full_view=View(linears=base) if base is not None else None,
    )

    log("replaying rounds to pick the slim view, drafter, gate thresholds, gamma, cap, pre-gate and stop threshold")
    selections: dict[tuple[int, int], Selection] = {}
    for (d, v), recs in records.items():
        selections[d, v] = sel = select_under(recs, table, v, settings, sources[d].name)
        log(
            f"  {slims[v].label}, drafter {sources[d].name}: via {sel.prediction.tokens_per_second:.2f} tok/s "
            f"(errors {sel.prediction.error_rate:.3f}), sd {sel.sd_prediction.tokens_per_second:.2f}, "
            f"plain {sel.plain_tokens_per_second:.2f}"
        )
    best = max(selections, key=lambda pair: selections[pair].prediction.tokens_per_second)
    source, slim, selection = sources[best[0]], slims[best[1]], selections[best]

    calibrated_on = {"quant": settings.target_quant.name} if settings.target_quant is not None else {}
    profile = RoutingProfile(
        target={"name": target.name, "fingerprint": fingerprint, **calibrated_on},
        drafter=source.profile_entry(),
        masks=[slim.mask],
        quant=[slim.recipe] if slim.recipe else [],
        search={**search_info, "candidates": candidate_summaries(selections, sources, slims)},
        calibration={
            "date": utc_now(),
            "machine": machine_info(next(model.parameters()).device, next(model.parameters()).dtype),
            "costs": {**table.to_dict(), "slim_mask_index": best[1], "drafter": source.name},
            **selection_fields(records[best], selection, settings),
            "slim_quants": [recipe.name for recipe in settings.slim_quants],
            "drafters": list(settings.drafters),
            "prompts": texts,
            "search_prompts": min(len(sequences), max(1, settings.search_prompts)),
            "new_tokens": settings.new_tokens,
            "positions": sum(s.scored for s in sequences),
            "memory": {"quantized_slim_bytes": slim.view.linears.nbytes() if slim.view.linears else 0},
            "seconds": round(time.perf_counter() - started, 1),
        },
        created=utc_now(),
    )
    return with_policy(profile, selection)
