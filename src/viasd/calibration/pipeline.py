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
    SearchResult,
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
from viasd.models.loading import LoadedModel
from viasd.profile import RoutingProfile
from viasd.prompting import encode_prompt
from viasd.views.layer_skip import LayerMask, layers_to_skip, num_decoder_layers, spread_mask
from viasd.views.quantize import QuantizedLinears
from viasd.views.view import View, applied

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
    stops: tuple[float, ...] = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6)  # draft stop thresholds to try (0: off)
    # Slim views beyond the searched layer masks: quantized views of the target (recipes, e.g. int8), alone and on
    # the best searched mask. With no skip ratios there is no mask search: quantized views only.
    slim_quants: tuple[str, ...] = ()
    # Drafter candidates: `model` (the drafter as loaded), `model:RECIPE` (its quantized view), `self:RECIPE`
    # (the target's own quantized view: no second model).
    drafters: tuple[str, ...] = ("model",)

    def check(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ViasdError(f"unknown objective {self.objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if not 1 <= self.prompts <= len(CALIBRATION_PROMPTS):
            raise ViasdError(f"--prompts must be between 1 and {len(CALIBRATION_PROMPTS)}, got {self.prompts}")
        if not 0 <= self.held_out <= len(HELD_OUT_PROMPTS):
            raise ViasdError(f"held-out prompts must be between 0 and {len(HELD_OUT_PROMPTS)}")
        if not all(0.0 < r < 1.0 for r in self.skip_ratios):
            raise ViasdError(f"skip ratios must be in (0, 1), got {list(self.skip_ratios)}")
        if not self.skip_ratios and not self.slim_quants:
            raise ViasdError("no slim view to calibrate: give --skip-ratio values, --slim-quants, or both")
        if not self.drafters:
            raise ViasdError("--drafters: no drafter candidate given")
        for name in self.drafters:
            parse_drafter(name)
        from viasd.views.quantize import QuantRecipe

        for recipe in self.slim_quants:
            QuantRecipe.parse(recipe)
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


def parse_drafter(name: str) -> tuple[bool, str | None]:
    """A drafter candidate's name -> (the target's own view?, quantization recipe or None)."""
    kind, _, recipe = name.partition(":")
    if kind not in ("model", "self") or (kind == "self" and not recipe):
        raise ViasdError(f"drafter candidate {name!r}: write model, model:RECIPE or self:RECIPE (e.g. self:int8)")
    return kind == "self", recipe or None


Quantizer = Callable[[LoadedModel, str], QuantizedLinears]


def quantize_plainly(model: LoadedModel, recipe: str) -> QuantizedLinears:
    """Quantized copies made on the spot (no disk cache, no smoothing calibration)."""
    from viasd.views.quantize import QuantRecipe, quantize

    return quantize(model.model, QuantRecipe.parse(recipe))


@dataclass(frozen=True)
class DraftSource:
    """A drafter candidate: a model (the drafter, or the target itself) and the view it drafts as."""

    name: str
    loaded: LoadedModel
    view: View | None
    is_self: bool
    recipe: str | None

    @classmethod
    def make(cls, name: str, target: LoadedModel, drafter: LoadedModel, quantized: Quantizer) -> DraftSource:
        is_self, recipe = parse_drafter(name)
        loaded = target if is_self else drafter
        view = View(linears=quantized(loaded, recipe)) if recipe else None
        return cls(name, loaded, view, is_self, recipe)

    def identity(self) -> list[Any]:
        """What its records depend on (the plain drafter keeps the key it always had)."""
        base = [model_fingerprint(self.loaded.model)]
        return base if self.name == "model" else [*base, self.name]

    def logits(self, seq: TeacherSequence) -> torch.Tensor:
        with applied(self.loaded.model, self.view):
            return model_logits(self.loaded.model, seq.ids, seq.start)

    def profile_entry(self) -> dict[str, Any]:
        entry = {"name": self.loaded.name, "fingerprint": model_fingerprint(self.loaded.model)}
        if self.recipe:
            entry["quant"] = self.recipe
        if self.is_self:
            entry["self"] = True
        return entry


@dataclass(frozen=True)
class SlimCandidate:
    """A slim view to calibrate: a layer mask (the full mask: none skipped) and quantized copies, or not."""

    mask: LayerMask
    recipe: str | None
    view: View

    @classmethod
    def make(cls, mask: LayerMask, recipe: str | None, target: LoadedModel, quantized: Quantizer) -> SlimCandidate:
        return cls(mask, recipe, View(mask=mask, linears=quantized(target, recipe) if recipe else None))

    def describe(self) -> dict[str, Any]:
        """The view as records keys and profiles name it (a bare mask as it always was)."""
        return self.mask.to_dict() if self.recipe is None else {**self.mask.to_dict(), "quant": self.recipe}

    @property
    def label(self) -> str:
        return self.view.describe()


def records_for(
    target: LoadedModel,
    drafter: DraftSource | LoadedModel,
    sequences: Sequence[TeacherSequence],
    slims: Sequence[SlimCandidate | LayerMask],
    chunk: int,
    work: WorkFile,
    resume: bool,
    progress: bool = False,
) -> list[GateRecords]:
    """Gate records of the slim views (one list per view inside each record) along the teacher-forced
    sequences, with `drafter`'s drafts; kept in the work file."""
    source = drafter if isinstance(drafter, DraftSource) else DraftSource("model", drafter, None, False, None)
    views = [s if isinstance(s, SlimCandidate) else SlimCandidate(s, None, View(mask=s)) for s in slims]
    key = work_key(
        "records",
        model_fingerprint(target.model),
        *source.identity(),
        str(next(target.model.parameters()).dtype),
        chunk,
        [v.describe() for v in views],
        [(seq.start, seq.ids) for seq in sequences],
    )
    cached = work.get(key) if resume else None
    if isinstance(cached, list):
        return [GateRecords.from_dict(seq) for seq in cached]
    records = []
    for seq in _steps(sequences, "gate records", progress):
        logits = [slim_logits(target.model, v.view, seq, chunk) for v in views]
        records.append(gate_records(source.logits(seq), logits, seq.full_logits))
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


def _select(
    records: Sequence[GateRecords],
    table: CostTable,
    index: int,
    settings: CalibrationSettings,
    drafter: str | None = None,
) -> Selection:
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

    reuse = " (reused from the work file when it has them)" if resume else ""
    log(f"generating the target's greedy continuations of {len(texts)} calibration prompts{reuse}")
    pairs = continuations(target, drafter, texts, settings.new_tokens, work, resume, progress)
    if not pairs:
        raise ViasdError("calibration: the target produced no continuation for any calibration prompt")
    sequences = teacher_sequences(target, pairs)
    log(f"calibration tokens: {sum(s.scored for s in sequences)} scored positions in {len(sequences)} sequences")
    searched, search_info = _search_masks(target, drafter, sequences, settings, storage, work, resume, log, progress)

    # The candidates: every searched mask, and each quantized view alone and on the smallest searched mask.
    slims = [SlimCandidate.make(result.mask, None, target, quantized) for result, _ in searched]
    for recipe in settings.slim_quants:
        slims.append(SlimCandidate.make(LayerMask.full(num_layers), recipe, target, quantized))
        if searched:
            slims.append(SlimCandidate.make(searched[0][0].mask, recipe, target, quantized))
    sources = [DraftSource.make(name, target, drafter, quantized) for name in settings.drafters]

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
        {source.name: (source.loaded.model, source.view) for source in sources},
        [slim.view for slim in slims],
        longest.ids,
        lengths,
        prefix=min(100, max(len(longest.ids) - 1, 1)),
        repeats=settings.cost_repeats,
        seed=settings.seed,
    )

    log("replaying rounds to pick the slim view, drafter, gate thresholds, gamma, cap, pre-gate and stop threshold")
    selections = {}
    for (d, v), recs in records.items():
        selections[d, v] = sel = _select(recs, table, v, settings, sources[d].name)
        log(
            f"  {slims[v].label}, drafter {sources[d].name}: via {sel.prediction.tokens_per_second:.2f} tok/s "
            f"(errors {sel.prediction.error_rate:.3f}), sd {sel.sd_prediction.tokens_per_second:.2f}, "
            f"plain {sel.plain_tokens_per_second:.2f}"
        )
    best = max(selections, key=lambda pair: selections[pair].prediction.tokens_per_second)
    source, slim, selection = sources[best[0]], slims[best[1]], selections[best]

    profile = RoutingProfile(
        target={"name": target.name, "fingerprint": fingerprint},
        drafter=source.profile_entry(),
        masks=[slim.mask],
        quant=[slim.recipe] if slim.recipe else [],
        search={
            **search_info,
            "candidates": [
                {
                    "slim": slims[v].describe(),
                    "drafter": sources[d].name,
                    "predicted_via_tokens_per_second": sel.prediction.tokens_per_second,
                    "predicted_via_error_rate": sel.prediction.error_rate,
                    "predicted_sd_tokens_per_second": sel.sd_prediction.tokens_per_second,
                    "gate": policy_dict(sel.policy),
                }
                for (d, v), sel in selections.items()
            ],
        },
        calibration={
            "date": utc_now(),
            "machine": machine_info(next(model.parameters()).device, next(model.parameters()).dtype),
            "costs": {**table.to_dict(), "slim_mask_index": best[1], "drafter": source.name},
            "statistics": summarize_records(records[best]),
            "predicted": selection.to_dict(),
            "quality_budget": settings.quality_budget,
            "gammas": list(settings.gammas),
            "caps": list(settings.caps),
            "pregates": list(settings.pregates),
            "stops": list(settings.stops),
            "slim_quants": list(settings.slim_quants),
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
    return _apply(profile, selection)


def _search_masks(
    target: LoadedModel,
    drafter: LoadedModel,
    sequences: Sequence[TeacherSequence],
    settings: CalibrationSettings,
    storage: str | os.PathLike[str] | None,
    work: WorkFile,
    resume: bool,
    log: Log,
    progress: bool,
) -> tuple[list[tuple[SearchResult, list[tuple[LayerMask, Scores]]]], dict[str, Any]]:
    """The mask search of every skip count (with random masks of each for comparison), smallest count first,
    and what the profile records of it; nothing when there are no skip ratios."""
    if not settings.skip_ratios:
        return [], {}
    model = target.model
    num_layers = num_decoder_layers(model)
    search_seqs = sequences[: max(1, settings.search_prompts)]
    evaluate = mask_evaluator(model, search_seqs, settings.chunk, settings.margin)
    key = _study_key(model_fingerprint(model), search_seqs, settings)
    preference: list[float] | None = None
    if settings.preference:
        preference = _cached_preference(evaluate, num_layers, settings.objective, key, work, resume, log)
    counts = sorted({layers_to_skip(num_layers, r) for r in settings.skip_ratios} - {0})
    if not counts:
        raise ViasdError("calibration: the skip ratios skip no layer of this model")
    search_start = time.perf_counter()
    searched: list[tuple[SearchResult, list[tuple[LayerMask, Scores]]]] = []
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
            f"{_baseline_info(baseline, settings.objective)['mean_value']:.4f}"
        )
    held = _held_out(target, drafter, [result.mask for result, _ in searched], settings, work, resume, log)
    first, first_baseline = searched[0]
    info = {
        **first.info(),
        "margin": settings.margin,
        "chunk": settings.chunk,
        "study_key": key,
        "sampler": f"random interleaved with {settings.sampler} every {settings.bo_every} trials (optuna)",
        "iterations": settings.iterations,
        "random_baseline": _baseline_info(first_baseline, settings.objective),
        "held_out": held,
        "layer_preference": preference,
        "masks": [
            {**result.info(), "random_baseline": _baseline_info(baseline, settings.objective)}
            for result, baseline in searched
        ],
    }
    return searched, info


def _held_out(
    target: LoadedModel,
    drafter: LoadedModel,
    masks: Sequence[LayerMask],
    settings: CalibrationSettings,
    work: WorkFile,
    resume: bool,
    log: Log,
) -> dict[str, Any]:
    """The searched masks against random ones on held-out prompts (the search never saw them)."""
    held_texts = [text for _, text in HELD_OUT_PROMPTS[: settings.held_out]]
    if not held_texts:
        return {}
    log(f"checking the masks on {len(held_texts)} held-out prompts against random masks")
    held_seqs = teacher_sequences(target, continuations(target, drafter, held_texts, settings.new_tokens, work, resume))
    if not held_seqs:
        return {}
    num_layers = num_decoder_layers(target.model)
    held_eval = mask_evaluator(target.model, held_seqs, settings.chunk, settings.margin)
    out: dict[str, Any] = {"prompts": held_texts, "positions": sum(s.scored for s in held_seqs), "masks": []}
    for mask in masks:
        count = len(mask.skipped_layers)
        searched = held_eval(mask)
        rand = random_baseline(held_eval, num_layers, count, settings.random_masks, settings.seed + 2000 + count)
        out["masks"].append(
            {
                "skip_layers": mask.skipped_layers,
                "searched": {"value": searched.value(settings.objective), **searched.summary()},
                "random": _baseline_info(rand, settings.objective),
            }
        )
    # The first mask's figures at the top level, where profiles have always had them.
    out["searched"], out["random"] = out["masks"][0]["searched"], out["masks"][0]["random"]
    return out


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
    quantized: Quantizer = quantize_plainly,
) -> tuple[list[GateRecords], list[int]]:
    """The gate records a profile was selected from, regenerated from its own prompts and settings (or read
    from the work file, where an earlier run left them), and the prompt length of each sequence."""
    texts, new_tokens = profile_prompts(profile)
    log(f"regenerating the gate records: the target's continuations of {len(texts)} prompts, teacher-forced")
    pairs = continuations(target, drafter, texts, new_tokens, work, True, progress)
    sequences = teacher_sequences(target, pairs)
    chunk = int(profile.search.get("chunk", 8))
    source = DraftSource.make(_drafter_name(profile), target, drafter, quantized)
    slims = [SlimCandidate.make(m, profile.slim_quant(i), target, quantized) for i, m in enumerate(profile.masks)]
    records = records_for(target, source, sequences, slims, chunk, work, True, progress)
    return records, [len(prompt) for prompt, _ in pairs]


def _drafter_name(profile: RoutingProfile) -> str:
    """A profile's drafter as a candidate name (model, model:RECIPE or self:RECIPE)."""
    entry = profile.drafter or {}
    recipe = entry.get("quant")
    return f"{'self' if entry.get('self') else 'model'}{':' + recipe if recipe else ''}"


def profile_records(
    profile: RoutingProfile,
    target: LoadedModel,
    drafter: LoadedModel,
    work: WorkFile,
    log: Log = lambda text: None,
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
    log: Log = lambda text: None,
    progress: bool = False,
    quantized: Quantizer = quantize_plainly,
) -> RoutingProfile:
    """`profile` with its round policy selected again under `settings` (quality budget, tier shares, gammas, caps,
    pre-gates, stop thresholds), from its own masks, measured costs and regenerated gate records."""
    settings.check()
    profile.check_models(target.model, None if profile.self_drafter else drafter.model)
    costs = profile.calibration.get("costs", {})
    table = CostTable.from_dict(costs)
    index = int(costs.get("slim_mask_index", 0))
    records = profile_records(profile, target, drafter, WorkFile(work_file), log, progress, quantized)
    log("replaying rounds to pick gate thresholds, gamma, cap, pre-gate and draft stop threshold")
    selection = _select(records, table, index, settings, costs.get("drafter"))
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
