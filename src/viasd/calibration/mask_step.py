"""The mask-search step of a calibration: a layer mask per skip count (search.py), seeded and resumable, each checked
against random masks of the same count on the calibration prompts and on held-out ones the search never saw."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from viasd.calibration.continuations import continuations, teacher_sequences
from viasd.calibration.objectives import DEFAULT_RIVALS, Scores
from viasd.calibration.progress import Log
from viasd.calibration.prompts import HELD_OUT_PROMPTS
from viasd.calibration.search import (
    Evaluator,
    SearchResult,
    layer_preference,
    mask_evaluator,
    middle_layers,
    random_baseline,
    scores_for,
    search_mask,
)
from viasd.calibration.settings import CalibrationSettings
from viasd.calibration.teacher import TeacherSequence
from viasd.calibration.workfile import WorkFile, work_key
from viasd.errors import ViasdError
from viasd.models.fingerprint import model_fingerprint
from viasd.models.loading import LoadedModel
from viasd.views.layer_skip import LayerMask, layers_to_skip, num_decoder_layers, spread_mask
from viasd.views.quantize import QuantizedLinears

Searched = list[tuple[SearchResult, list[tuple[LayerMask, Scores]]]]  # per skip count: the search, random masks


def search_masks(
    target: LoadedModel,
    drafter: LoadedModel,
    sequences: Sequence[TeacherSequence],
    settings: CalibrationSettings,
    storage: str | os.PathLike[str] | None,
    work: WorkFile,
    resume: bool,
    log: Log,
    progress: bool,
    base: QuantizedLinears | None = None,
) -> tuple[Searched, dict[str, Any]]:
    """The mask search of every skip count (with random masks of each for comparison), smallest count first,
    and what the profile records of it; nothing when there are no skip ratios. `base`: the target's view the
    sequences were made with (its layers skipped by each mask), None: the target as loaded."""
    if not settings.skip_ratios:
        return [], {}
    model = target.model
    num_layers = num_decoder_layers(model)
    search_seqs = sequences[: max(1, settings.search_prompts)]
    evaluate = mask_evaluator(model, search_seqs, settings.chunk, settings.margin, base)
    fingerprint = model_fingerprint(model) + (f"+{base.recipe.name}" if base is not None else "")
    key = study_key(fingerprint, search_seqs, settings)
    preference: list[float] | None = None
    if settings.preference:
        preference = cached_preference(evaluate, num_layers, settings.objective, key, work, resume, log)
    counts = sorted({layers_to_skip(num_layers, r) for r in settings.skip_ratios} - {0})
    if not counts:
        raise ViasdError("calibration: the skip ratios skip no layer of this model")
    search_start = time.perf_counter()
    searched: Searched = []
    previous: LayerMask | None = None
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
        searched.append((result, baseline))
        log(
            f"  best {result.mask.describe()}: {settings.objective} {result.value:.4f}, "
            f"agreement {result.scores.mean('agreement'):.3f}; random masks: "
            f"{baseline_info(baseline, settings.objective)['mean_value']:.4f}"
        )
    held = held_out(target, drafter, [result.mask for result, _ in searched], settings, work, resume, log, base)
    first, first_baseline = searched[0]
    info = {
        **first.info(),
        "margin": settings.margin,
        "chunk": settings.chunk,
        "study_key": key,
        "sampler": f"random interleaved with {settings.sampler} every {settings.bo_every} trials (optuna)",
        "iterations": settings.iterations,
        "random_baseline": baseline_info(first_baseline, settings.objective),
        "held_out": held,
        "layer_preference": preference,
        "masks": [
            {**result.info(), "random_baseline": baseline_info(baseline, settings.objective)}
            for result, baseline in searched
        ],
    }
    return searched, info


def held_out(
    target: LoadedModel,
    drafter: LoadedModel,
    masks: Sequence[LayerMask],
    settings: CalibrationSettings,
    work: WorkFile,
    resume: bool,
    log: Log,
    base: QuantizedLinears | None = None,
) -> dict[str, Any]:
    """The searched masks against random ones on held-out prompts (the search never saw them)."""
    held_texts = [text for _, text in HELD_OUT_PROMPTS[: settings.held_out]]
    if not held_texts:
        return {}
    log(f"checking the masks on {len(held_texts)} held-out prompts against random masks")
    pairs = continuations(target, drafter, held_texts, settings.new_tokens, work, resume, base=base)
    held_seqs = teacher_sequences(target, pairs, base)
    if not held_seqs:
        return {}
    num_layers = num_decoder_layers(target.model)
    held_eval = mask_evaluator(target.model, held_seqs, settings.chunk, settings.margin, base)
    out: dict[str, Any] = {"prompts": held_texts, "positions": sum(s.scored for s in held_seqs), "masks": []}
    for mask in masks:
        count = len(mask.skipped_layers)
        searched = held_eval(mask)
        rand = random_baseline(held_eval, num_layers, count, settings.random_masks, settings.seed + 2000 + count)
        out["masks"].append(
            {
                "skip_layers": mask.skipped_layers,
                "searched": {"value": searched.value(settings.objective), **searched.summary()},
                "random": baseline_info(rand, settings.objective),
            }
        )
    # The first mask's figures at the top level, where profiles have always had them.
    out["searched"], out["random"] = out["masks"][0]["searched"], out["masks"][0]["random"]
    return out


def cached_preference(
    evaluate: Evaluator, num_layers: int, objective: str, key: str, work: WorkFile, resume: bool, log: Log
) -> list[float]:
    """`layer_preference`, kept in the work file for a resumed calibration."""
    name = f"preference-{objective}-{key}"
    cached = work.get(name) if resume else None
    if isinstance(cached, list) and len(cached) == num_layers - 2:
        return [float(v) for v in cached]
    log(f"scoring each of the {num_layers - 2} middle layers skipped alone")
    preference = layer_preference(evaluate, num_layers, objective)
    work.put(name, preference)
    return preference


def study_key(fingerprint: str, sequences: Sequence[TeacherSequence], settings: CalibrationSettings) -> str:
    """Identifies what a search scores, so a resumed study never mixes different calibration data."""
    return work_key(
        "study", fingerprint, settings.chunk, settings.margin, DEFAULT_RIVALS, [(s.start, s.ids) for s in sequences]
    ).removeprefix("study-")[:10]


def baseline_info(pairs: Sequence[tuple[LayerMask, Scores]], objective: str) -> dict[str, Any]:
    """Random masks' values and agreement, and their means, as the profile records them."""
    values = [s.value(objective) for _, s in pairs]
    agreement = [s.mean("agreement") for _, s in pairs]
    return {
        "masks": [m.skipped_layers for m, _ in pairs],
        "values": values,
        "agreement": agreement,
        "mean_value": sum(values) / len(values) if values else None,
        "mean_agreement": sum(agreement) / len(agreement) if agreement else None,
    }
