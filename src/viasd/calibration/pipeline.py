"""The calibration pipeline for one model pair on this machine: a routing profile from scratch, or re-selected.

`calibrate_pair`:
1. the target's greedy continuations of the calibration prompts (prompts.py), teacher-forced (teacher.py);
2. a layer-mask search per skip count (search.py, objectives.py), checked against random masks;
3. gate records of each searched mask along the continuations (records.py);
4. pass costs measured on this machine (costs.py);
5. per mask, the fastest round policy within the quality budget by replaying the decoder's own round code
   along the records (replay.py, selection.py); the fastest mask wins.

`reselect` repeats step 5 for a finished profile with other selection settings: it keeps the profile's masks
and measured costs and regenerates the records from the profile's own prompts (or takes them from the work
file), so the shipped profile can be re-derived from the repository alone.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import torch
import transformers

from viasd.calibration.costs import CostTable, measure_costs
from viasd.calibration.objectives import DEFAULT_MARGIN, DEFAULT_RIVALS, OBJECTIVES, Scores
from viasd.calibration.prompts import CALIBRATION_PROMPTS, HELD_OUT_PROMPTS
from viasd.calibration.records import GateRecords, gate_records, summarize_records
from viasd.calibration.search import (
    Evaluator,
    layer_preference,
    mask_evaluator,
    middle_layers,
    random_baseline,
    scores_for,
    search_mask,
)
from viasd.calibration.selection import Selection, policy_dict, select_policy
from viasd.calibration.teacher import TeacherSequence, model_logits, slim_logits, teacher_force
from viasd.calibration.workfile import WorkFile, work_key
from viasd.decode.base import GenerationConfig
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.errors import ViasdError
from viasd.models.fingerprint import model_fingerprint
from viasd.models.layer_skip import LayerMask, layers_to_skip, num_decoder_layers, spread_mask
from viasd.models.loading import LoadedModel
from viasd.profile import RoutingProfile
from viasd.prompting import encode_prompt

Log = Callable[[str], None]
Pairs = list[tuple[list[int], list[int]]]  # (prompt ids, the target's greedy continuation)
T = TypeVar("T")


def _steps(items: Sequence[T], what: str, progress: bool) -> Iterable[T]:
    """`items`, with a progress bar on stderr when `progress` is on (calibration steps take minutes)."""
    if not progress:
        return items
    from rich.console import Console
    from rich.progress import track

    return track(items, description=what, console=Console(stderr=True), transient=True)


@dataclass
class CalibrationSettings:
    """Everything `calibrate_pair` does, with defaults."""

    objective: str = "margin"
    skip_ratios: tuple[float, ...] = (0.18, 0.21, 0.25)
    iterations: int = 60  # search trials per skip ratio
    time_budget: float | None = None  # seconds for all mask searches together
    quality_budget: float = 0.02
    gammas: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
    caps: tuple[int, ...] = (8, 16, 32)
    prompts: int = 8  # calibration prompts (gate records); the first `search_prompts` also drive the search
    search_prompts: int = 4
    held_out: int = 4
    new_tokens: int = 64
    chunk: int = 8
    margin: float = DEFAULT_MARGIN
    sampler: str = "tpe"
    bo_every: int = 2
    seed: int = 0
    random_masks: int = 4
    cost_repeats: int = 5
    preference: bool = True  # seed the search with the layers that are cheapest to skip one at a time
    min_tier_share: float = 0.0  # > 0: each tier must decide at least this share of draft tokens
    pregates: tuple[float, ...] = (0.0, 0.3, 0.5)  # pre-gate thresholds to try (0: off)
    stops: tuple[float, ...] = (0.0,)  # draft stop thresholds to try (0: off)

    def check(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ViasdError(f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if not 1 <= self.prompts <= len(CALIBRATION_PROMPTS):
            raise ViasdError(f"--prompts must be between 1 and {len(CALIBRATION_PROMPTS)}, got {self.prompts}")
        if not 0 <= self.held_out <= len(HELD_OUT_PROMPTS):
            raise ViasdError(f"held-out prompts must be between 0 and {len(HELD_OUT_PROMPTS)}")
        if not self.skip_ratios or not all(0.0 < r < 1.0 for r in self.skip_ratios):
            raise ViasdError(f"skip ratios must be in (0, 1), got {list(self.skip_ratios)}")
        if self.iterations < 1:
            raise ViasdError(f"--iterations must be >= 1, got {self.iterations}")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ViasdError(f"--time-budget must be > 0 seconds, got {self.time_budget}")
        if not self.gammas or min(self.gammas) < 1:
            raise ViasdError(f"--gammas must be >= 1, got {list(self.gammas)}")
        if not self.caps or min(self.caps) < 2:
            raise ViasdError(f"--caps must be >= 2, got {list(self.caps)}")
        if not 0.0 <= self.quality_budget < 1.0:
            raise ViasdError(f"--quality-budget must be in [0, 1), got {self.quality_budget}")
        if not 0.0 <= self.min_tier_share <= 1.0 / 3.0:
            raise ViasdError(f"--min-tier-share must be in [0, 1/3], got {self.min_tier_share}")
        if not self.pregates or not all(0.0 <= v <= 1.0 for v in self.pregates):
            raise ViasdError(f"--pregates must be in [0, 1], got {list(self.pregates)}")
        if not self.stops or not all(0.0 <= v <= 1.0 for v in self.stops):
            raise ViasdError(f"--stops must be in [0, 1], got {list(self.stops)}")
        if self.new_tokens < 8:
            raise ViasdError(f"--new-tokens must be >= 8, got {self.new_tokens}")


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
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ----------------------------------------------------------------------------------- calibration data


def continuations(
    target: LoadedModel,
    drafter: LoadedModel,
    texts: Sequence[str],
    new_tokens: int,
    work: WorkFile,
    resume: bool,
    progress: bool = False,
) -> Pairs:
    """(prompt ids, the target's greedy continuation) per prompt, generated with exact SD for speed and kept in
    the work file (keyed by target, dtype, length and prompts) for `--resume` and `--reselect`."""
    param = next(target.model.parameters())
    key = work_key("continuations", model_fingerprint(target.model), str(param.dtype), new_tokens, list(texts))
    cached = work.get(key) if resume else None
    if isinstance(cached, list):
        return [(list(p), list(c)) for p, c in cached]
    decoder = SpeculativeDecoder(target.model, target.tokenizer, ModelDrafter(drafter.model, name="small"), gamma=4)
    pairs: Pairs = []
    for text in _steps(texts, "continuations", progress):
        ids = encode_prompt(target.tokenizer, text)
        result = decoder.generate(ids, GenerationConfig(max_new_tokens=new_tokens))
        if len(result.tokens) >= 2:
            pairs.append((ids, result.tokens))
    work.put(key, pairs)
    return pairs


def teacher_sequences(target: LoadedModel, pairs: Pairs) -> list[TeacherSequence]:
    return [teacher_force(target.model, prompt + cont, len(prompt)) for prompt, cont in pairs]


def records_for(
    target: LoadedModel,
    drafter: LoadedModel,
    sequences: Sequence[TeacherSequence],
    masks: Sequence[LayerMask],
    chunk: int,
    work: WorkFile,
    resume: bool,
    progress: bool = False,
) -> list[GateRecords]:
    """Gate records of slim views `masks` along the teacher-forced sequences, kept in the work file."""
    key = work_key(
        "records",
        model_fingerprint(target.model),
        model_fingerprint(drafter.model),
        str(next(target.model.parameters()).dtype),
        chunk,
        [m.to_dict() for m in masks],
        [(seq.start, seq.ids) for seq in sequences],
    )
    cached = work.get(key) if resume else None
    if isinstance(cached, list):
        return [GateRecords.from_dict(seq) for seq in cached]
    records = []
    for seq in _steps(sequences, "gate records", progress):
        drafts = model_logits(drafter.model, seq.ids, seq.start)
        views = [slim_logits(target.model, mask, seq, chunk) for mask in masks]
        records.append(gate_records(drafts, views, seq.full_logits))
    work.put(key, [asdict(seq) for seq in records])
    return records


def _cached_preference(
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


def _study_key(fingerprint: str, sequences: Sequence[TeacherSequence], settings: CalibrationSettings) -> str:
    """Identifies what a search scores, so a resumed study never mixes different calibration data."""
    return work_key(
        "study", fingerprint, settings.chunk, settings.margin, DEFAULT_RIVALS, [(s.start, s.ids) for s in sequences]
    ).removeprefix("study-")[:10]


def _baseline_info(pairs: Sequence[tuple[LayerMask, Scores]], objective: str) -> dict[str, Any]:
    values = [s.value(objective) for _, s in pairs]
    agreement = [s.mean("agreement") for _, s in pairs]
    return {
        "masks": [m.skipped_layers for m, _ in pairs],
        "values": values,
        "agreement": agreement,
        "mean_value": sum(values) / len(values) if values else None,
        "mean_agreement": sum(agreement) / len(agreement) if agreement else None,
    }


def _select(records: Sequence[GateRecords], table: CostTable, index: int, settings: CalibrationSettings) -> Selection:
    return select_policy(
        records,
        table.costs(index),
        settings.gammas,
        settings.caps,
        settings.quality_budget,
        min_tier_share=settings.min_tier_share,
        pregates=settings.pregates,
        stops=settings.stops,
    )


def _apply(profile: RoutingProfile, selection: Selection) -> RoutingProfile:
    """The profile with the selected round policy."""
    policy = selection.policy
    return dataclasses.replace(
        profile, gate=policy.gate, gamma=policy.gamma, cap=policy.cap, pregate=policy.pregate, stop=policy.stop
    )


# ------------------------------------------------------------------------------------------ pipeline


def calibrate_pair(
    target: LoadedModel,
    drafter: LoadedModel,
    settings: CalibrationSettings,
    *,
    storage: str | os.PathLike[str] | None = None,
    work_file: str | os.PathLike[str] | None = None,
    resume: bool = False,
    log: Log = lambda text: None,
    progress: bool = False,
) -> RoutingProfile:
    """Search the slim mask, measure costs, collect gate records and pick the round policy: a routing profile.

    `storage` (SQLite) logs the mask searches and `work_file` (JSON) keeps the continuations, layer scores and
    gate records; with `resume` both are reused. Costs are always measured afresh.
    """
    settings.check()
    started = time.perf_counter()
    work = WorkFile(work_file)
    model = target.model
    num_layers = num_decoder_layers(model)
    fingerprint = model_fingerprint(model)
    texts = [text for _, text in CALIBRATION_PROMPTS[: settings.prompts]]
    held_texts = [text for _, text in HELD_OUT_PROMPTS[: settings.held_out]]

    reuse = " (reused from the work file when it has them)" if resume else ""
    log(f"generating the target's greedy continuations of {len(texts)} calibration prompts{reuse}")
    pairs = continuations(target, drafter, texts, settings.new_tokens, work, resume, progress)
    if not pairs:
        raise ViasdError("calibration: the target produced no continuation for any calibration prompt")
    sequences = teacher_sequences(target, pairs)
    search_seqs = sequences[: max(1, settings.search_prompts)]
    evaluate = mask_evaluator(model, search_seqs, settings.chunk, settings.margin)
    key = _study_key(fingerprint, search_seqs, settings)
    log(
        f"calibration tokens: {sum(s.scored for s in sequences)} scored positions in {len(sequences)} sequences "
        f"({sum(s.scored for s in search_seqs)} in the {len(search_seqs)} that drive the search)"
    )

    preference: list[float] | None = None
    if settings.preference:
        preference = _cached_preference(evaluate, num_layers, settings.objective, key, work, resume, log)

    counts = sorted({layers_to_skip(num_layers, r) for r in settings.skip_ratios} - {0})
    if not counts:
        raise ViasdError("calibration: the skip ratios skip no layer of this model")
    search_start = time.perf_counter()
    candidates: list[dict[str, Any]] = []
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
        records = records_for(target, drafter, sequences, [result.mask], settings.chunk, work, resume, progress)
        candidates.append({"result": result, "baseline": baseline, "records": records})
        log(
            f"  best {result.mask.describe()}: {settings.objective} {result.value:.4f}, "
            f"agreement {result.scores.mean('agreement'):.3f}; random masks: "
            f"{_baseline_info(baseline, settings.objective)['mean_value']:.4f}"
        )

    log("measuring drafter, slim and full pass costs on this machine")
    lengths = sorted(set(range(1, max(settings.gammas) + 2)) | {12, 16, 24, 32, 48})
    longest = max(sequences, key=lambda s: len(s.ids))
    table = measure_costs(
        model,
        drafter.model,
        [c["result"].mask for c in candidates],
        longest.ids,
        lengths,
        prefix=min(100, max(len(longest.ids) - 1, 1)),
        repeats=settings.cost_repeats,
        seed=settings.seed,
    )

    log("replaying rounds to pick gate thresholds, gamma, cap, pre-gate and draft stop threshold")
    for i, cand in enumerate(candidates):
        cand["selection"] = sel = _select(cand["records"], table, i, settings)
        log(
            f"  skip {len(cand['result'].mask.skipped_layers)}: via {sel.prediction.tokens_per_second:.2f} tok/s "
            f"(errors {sel.prediction.error_rate:.3f}), sd {sel.sd_prediction.tokens_per_second:.2f}, "
            f"plain {sel.plain_tokens_per_second:.2f}"
        )
    chosen_index = max(range(len(candidates)), key=lambda i: candidates[i]["selection"].prediction.tokens_per_second)
    chosen = candidates[chosen_index]
    result, selection = chosen["result"], chosen["selection"]

    held: dict[str, Any] = {}
    if held_texts:
        log(f"checking the mask on {len(held_texts)} held-out prompts against random masks")
        held_seqs = teacher_sequences(
            target, continuations(target, drafter, held_texts, settings.new_tokens, work, resume)
        )
        if held_seqs:
            held_eval = mask_evaluator(model, held_seqs, settings.chunk, settings.margin)
            count = len(result.mask.skipped_layers)
            searched = held_eval(result.mask)
            rand = random_baseline(held_eval, num_layers, count, settings.random_masks, settings.seed + 2000 + count)
            held = {
                "prompts": held_texts,
                "positions": sum(s.scored for s in held_seqs),
                "searched": {"value": searched.value(settings.objective), **searched.summary()},
                "random": _baseline_info(rand, settings.objective),
            }

    profile = RoutingProfile(
        target={"name": target.name, "fingerprint": fingerprint},
        drafter={"name": drafter.name, "fingerprint": model_fingerprint(drafter.model)},
        masks=[result.mask],
        search={
            **result.info(),
            "margin": settings.margin,
            "chunk": settings.chunk,
            "study_key": key,
            "sampler": f"random interleaved with {settings.sampler} every {settings.bo_every} trials (optuna)",
            "iterations": settings.iterations,
            "random_baseline": _baseline_info(chosen["baseline"], settings.objective),
            "held_out": held,
            "layer_preference": preference,
            "candidates": [
                {
                    **c["result"].info(),
                    "random_baseline_mean_value": _baseline_info(c["baseline"], settings.objective)["mean_value"],
                    "random_baseline_mean_agreement": _baseline_info(c["baseline"], settings.objective)[
                        "mean_agreement"
                    ],
                    "predicted_via_tokens_per_second": c["selection"].prediction.tokens_per_second,
                    "predicted_via_error_rate": c["selection"].prediction.error_rate,
                    "predicted_sd_tokens_per_second": c["selection"].sd_prediction.tokens_per_second,
                    "gate": policy_dict(c["selection"].policy),
                }
                for c in candidates
            ],
        },
        calibration={
            "date": utc_now(),
            "machine": machine_info(next(model.parameters()).device, next(model.parameters()).dtype),
            "costs": {**table.to_dict(), "slim_mask_index": chosen_index},
            "statistics": summarize_records(chosen["records"]),
            "predicted": selection.to_dict(),
            "quality_budget": settings.quality_budget,
            "gammas": list(settings.gammas),
            "caps": list(settings.caps),
            "pregates": list(settings.pregates),
            "stops": list(settings.stops),
            "prompts": texts,
            "search_prompts": len(search_seqs),
            "new_tokens": settings.new_tokens,
            "positions": sum(s.scored for s in sequences),
            "seconds": round(time.perf_counter() - started, 1),
        },
        created=utc_now(),
    )
    return _apply(profile, selection)


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
    log: Log = lambda text: None,
    progress: bool = False,
) -> tuple[list[GateRecords], list[int]]:
    """The gate records a profile was selected from, regenerated from its own prompts and settings (or read
    from the work file, where an earlier run left them), and the prompt length of each sequence."""
    texts, new_tokens = profile_prompts(profile)
    log(f"regenerating the gate records: the target's continuations of {len(texts)} prompts, teacher-forced")
    pairs = continuations(target, drafter, texts, new_tokens, work, True, progress)
    sequences = teacher_sequences(target, pairs)
    chunk = int(profile.search.get("chunk", 8))
    records = records_for(target, drafter, sequences, profile.masks, chunk, work, True, progress)
    return records, [len(prompt) for prompt, _ in pairs]


def profile_records(
    profile: RoutingProfile,
    target: LoadedModel,
    drafter: LoadedModel,
    work: WorkFile,
    log: Log = lambda text: None,
    progress: bool = False,
) -> list[GateRecords]:
    """The gate records a profile was selected from (`profile_data` without the prompt lengths)."""
    return profile_data(profile, target, drafter, work, log, progress)[0]


def reselect(
    profile: RoutingProfile,
    source_sha256: str,
    target: LoadedModel,
    drafter: LoadedModel,
    settings: CalibrationSettings,
    *,
    work_file: str | os.PathLike[str] | None = None,
    log: Log = lambda text: None,
    progress: bool = False,
) -> RoutingProfile:
    """`profile` with its round policy selected again under `settings` (quality budget, tier shares, gammas, caps,
    pre-gates, stop thresholds), from its own masks, measured costs and regenerated gate records."""
    settings.check()
    profile.check_models(target.model, drafter.model)
    table = CostTable.from_dict(profile.calibration.get("costs", {}))
    index = int(profile.calibration.get("costs", {}).get("slim_mask_index", 0))
    records = profile_records(profile, target, drafter, WorkFile(work_file), log, progress)
    log("replaying rounds to pick gate thresholds, gamma, cap, pre-gate and draft stop threshold")
    selection = _select(records, table, index, settings)
    calibration = {
        **profile.calibration,
        "statistics": summarize_records(records),
        "predicted": selection.to_dict(),
        "quality_budget": settings.quality_budget,
        "gammas": list(settings.gammas),
        "caps": list(settings.caps),
        "pregates": list(settings.pregates),
        "stops": list(settings.stops),
        "reselected": {"from_sha256": source_sha256, "date": utc_now()},
    }
    return _apply(dataclasses.replace(profile, calibration=calibration), selection)
