"""Search for the slim verifier's layer mask: which decoder layers to skip.

The search space has one continuous score in [0, 1] per middle layer; a candidate skips the `skip_count`
middle layers with the lowest scores, so every candidate has exactly the requested skip ratio, and the
first and last layers always run. Trials come from Optuna: a uniform RandomSampler, interleaved every
`bo_every` trials with a Bayesian-optimisation sampler (TPE by default, or a Gaussian process) that
models which layers are cheap to skip (the search shape of the paper, SWIFT and Draft&Verify). Seed
candidates (for example the layers that are least harmful to skip one at a time) can be queued first.

Each candidate is scored by an `Evaluator`, a function from a mask to objective `Scores` (objectives.py);
`mask_evaluator` builds the teacher-forced one: the full target's logits over the calibration tokens are
computed once, each candidate costs one forward pass of the masked view per sequence (teacher.py).
Identical masks are scored once. With a storage file (SQLite) the search is resumable: a rerun with
`resume=True` continues the same study until `iterations` trials are complete.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from viasd.calibration.objectives import DEFAULT_MARGIN, OBJECTIVES, Scores, score
from viasd.calibration.teacher import TeacherSequence, slim_logits
from viasd.errors import ViasdError
from viasd.views.layer_skip import LayerMask, random_mask
from viasd.views.quantize import QuantizedLinears
from viasd.views.view import View

Evaluator = Callable[[LayerMask], Scores]
SAMPLERS = ("tpe", "gp")
BO_STARTUP = 6  # complete trials before the Bayesian sampler starts modelling (it draws at random until then)


def middle_layers(num_layers: int) -> list[int]:
    """The layers a mask may skip: all but the first and the last."""
    return list(range(1, num_layers - 1))


def _param(layer: int) -> str:
    return f"l{layer:03d}"


def mask_from_scores(num_layers: int, skip_count: int, scores: Sequence[float]) -> LayerMask:
    """Skip the `skip_count` middle layers with the lowest scores (scores[j] belongs to layer j + 1;
    ties go to the lower layer)."""
    middle = middle_layers(num_layers)
    if len(scores) != len(middle):
        raise ViasdError(f"mask search: {len(scores)} scores for {len(middle)} middle layers")
    if not 0 <= skip_count <= len(middle):
        raise ViasdError(f"mask search: cannot skip {skip_count} of {len(middle)} middle layers")
    order = sorted(range(len(middle)), key=lambda j: (scores[j], j))
    return LayerMask.skipping(num_layers, [middle[j] for j in order[:skip_count]])


def scores_for(num_layers: int, skipped: Sequence[int], preference: Sequence[float] | None = None) -> list[float]:
    """A score vector that maps back to exactly `skipped` (for seeding the search).

    Skipped layers score in [0, 0.1], the others in [0.2, 1]; within each group `preference` (one value
    per middle layer, lower = skip first) orders them, so a larger skip count would add the kept layer
    with the lowest preference next.
    """
    middle = middle_layers(num_layers)
    pref = list(preference) if preference is not None else [0.0] * len(middle)
    if len(pref) != len(middle):
        raise ViasdError(f"mask search: {len(pref)} preferences for {len(middle)} middle layers")
    skip = set(skipped)
    if not skip <= set(middle):
        raise ViasdError(f"mask search: only middle layers 1..{num_layers - 2} can be skipped, got {sorted(skip)}")
    out = [0.0] * len(middle)
    for group, low, high in ((skip, 0.0, 0.1), (set(middle) - skip, 0.2, 1.0)):
        members = sorted(group, key=lambda layer: (pref[layer - 1], layer))
        for rank, layer in enumerate(members):
            out[layer - 1] = low + (high - low) * (rank / max(len(members) - 1, 1))
    return out


def mask_evaluator(
    model: nn.Module,
    sequences: Sequence[TeacherSequence],
    chunk: int = 8,
    margin: float = DEFAULT_MARGIN,
    base: QuantizedLinears | None = None,
) -> Evaluator:
    """Score a mask against the full target on teacher-forced sequences (one masked pass per sequence); `base`: the
    quantized layers of the target's view the sequences were made with, which the masked passes run too."""
    if not sequences:
        raise ViasdError("mask search: no calibration sequences")

    def evaluate(mask: LayerMask) -> Scores:
        total = Scores()
        for seq in sequences:
            view = View(mask=mask, linears=base)
            total = total + score(slim_logits(model, view, seq, chunk), seq.full_logits, margin)
        return total

    return evaluate


@dataclass
class SearchResult:
    """The best mask of a search, its scores, and every trial (in order)."""

    mask: LayerMask
    objective: str
    value: float
    scores: Scores
    trials: int
    seconds: float
    stopped: str  # "iterations" or "time"
    history: list[dict[str, Any]] = field(default_factory=list)
    study_name: str = ""

    @property
    def skip_ratio(self) -> float:
        return self.mask.skip_ratio

    def info(self) -> dict[str, Any]:
        """A JSON-ready summary for the routing profile."""
        return {
            "objective": self.objective,
            "value": self.value,
            **{f"mean_{k}": v for k, v in self.scores.summary().items()},
            "skip_ratio": self.skip_ratio,
            "skip_layers": self.mask.skipped_layers,
            "trials": self.trials,
            "seconds": round(self.seconds, 1),
            "stopped": self.stopped,
            "study": self.study_name,
        }


def _bo_sampler(kind: str, seed: int) -> optuna.samplers.BaseSampler:
    if kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=BO_STARTUP)
    if kind == "gp":
        return optuna.samplers.GPSampler(seed=seed, deterministic_objective=True, n_startup_trials=BO_STARTUP)
    raise ViasdError(f"unknown search sampler {kind!r}; choose one of {', '.join(SAMPLERS)}")


def _open_study(storage: str | Path | None, study_name: str, resume: bool) -> optuna.Study:
    url = None
    if storage is not None:
        path = Path(storage)
        path.parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{path}"
    try:
        if url is not None and not resume:
            with suppress(KeyError):
                optuna.delete_study(study_name=study_name, storage=url)
        study = optuna.create_study(storage=url, study_name=study_name, direction="minimize", load_if_exists=True)
    except Exception as exc:  # a corrupt or foreign database file
        raise ViasdError(f"cannot open the search log {storage}: {type(exc).__name__}: {exc}") from exc
    # Trials left running by an interrupted run never finish: mark them failed so they are not counted.
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    return study


@contextmanager
def _progress(enabled: bool, total: int, done: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr; yields a function that advances it with a status text."""
    if not enabled:
        yield lambda text: None
        return
    columns = (
        TextColumn("mask search"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("", total=total, completed=done)
        yield lambda text: bar.update(task, advance=1, description=text)


def _record(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    attrs = trial.user_attrs
    sums = attrs.get("scores", {})
    count = sums.get("count", 0) or 1
    return {
        "trial": trial.number,
        "sampler": attrs.get("sampler", ""),
        "skip": attrs.get("skip", []),
        "value": trial.value,
        "margin": sums.get("margin", 0.0) / count,
        "kl": sums.get("kl", 0.0) / count,
        "agreement": sums.get("agreement", 0.0) / count,
        "seconds": attrs.get("seconds", 0.0),
    }


def search_mask(
    evaluate: Evaluator,
    num_layers: int,
    skip_count: int,
    *,
    objective: str = "margin",
    iterations: int = 60,
    time_budget: float | None = None,
    bo_every: int = 2,
    sampler: str = "tpe",
    seed: int = 0,
    storage: str | Path | None = None,
    study_name: str | None = None,
    resume: bool = False,
    seeds: Sequence[Sequence[float]] = (),
    progress: bool = False,
) -> SearchResult:
    """Find the mask skipping `skip_count` middle layers that minimises `objective` under `evaluate`.

    Stops after `iterations` complete trials (counting those of a resumed study) or when `time_budget`
    seconds have passed in this call, whichever comes first. Trial i (0-based) is proposed by the
    Bayesian sampler when i % bo_every == bo_every - 1, else at random; queued `seeds` (score vectors,
    see `scores_for`) go first.
    """
    if objective not in OBJECTIVES:
        raise ViasdError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if iterations < 1:
        raise ViasdError(f"mask search: iterations must be >= 1, got {iterations}")
    if bo_every < 1:
        raise ViasdError(f"mask search: bo_every must be >= 1, got {bo_every}")
    middle = middle_layers(num_layers)
    if not 1 <= skip_count <= len(middle):
        raise ViasdError(f"mask search: cannot skip {skip_count} layers of a {num_layers}-layer model")
    name = study_name or f"viasd-{objective}-skip{skip_count}of{num_layers}"
    study = _open_study(storage, name, resume)
    complete = optuna.trial.TrialState.COMPLETE

    # Scores already known from a resumed study: identical masks are never evaluated twice.
    known: dict[tuple[int, ...], Scores] = {}
    for trial in study.get_trials(deepcopy=False, states=(complete,)):
        sums = trial.user_attrs.get("scores")
        if sums:
            known[tuple(trial.user_attrs.get("skip", []))] = Scores(**sums)
    for vector in seeds:
        params = {_param(layer): float(v) for layer, v in zip(middle, vector, strict=True)}
        study.enqueue_trial(params, user_attrs={"sampler": "seed"}, skip_if_exists=True)

    done = len(study.get_trials(deepcopy=False, states=(complete,)))
    # Distinct streams: the Bayesian sampler draws at random during its start-up trials, and with the same
    # seed it would repeat the random sampler's candidates.
    random_sampler = optuna.samplers.RandomSampler(seed=seed * 7919 + done)
    bo_sampler = _bo_sampler(sampler, seed * 7919 + done + 104729)
    start = time.perf_counter()
    stopped = "iterations"
    with _progress(progress, iterations, min(done, iterations)) as advance:
        while done < iterations:
            if time_budget is not None and time.perf_counter() - start >= time_budget:
                stopped = "time"
                break
            use_bo = done % bo_every == bo_every - 1
            study.sampler = bo_sampler if use_bo else random_sampler
            trial = study.ask()
            kind = trial.user_attrs.get("sampler") or ("bo-" + sampler if use_bo else "random")
            values = [trial.suggest_float(_param(layer), 0.0, 1.0) for layer in middle]
            mask = mask_from_scores(num_layers, skip_count, values)
            key = tuple(mask.skipped_layers)
            t0 = time.perf_counter()
            try:
                scores = known[key] if key in known else evaluate(mask)
            except BaseException:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            known[key] = scores
            value = scores.value(objective)
            trial.set_user_attr("sampler", kind)
            trial.set_user_attr("skip", list(key))
            trial.set_user_attr(
                "scores",
                {"margin": scores.margin, "kl": scores.kl, "agreement": scores.agreement, "count": scores.count},
            )
            trial.set_user_attr("seconds", round(time.perf_counter() - t0, 3))
            study.tell(trial, value if math.isfinite(value) else float("inf"))
            done += 1
            best = study.best_trial
            advance(f"best {best.value:.4f} skip {best.user_attrs.get('skip')}")
    trials = study.get_trials(deepcopy=False, states=(complete,))
    if not trials:
        raise ViasdError("mask search: no candidate was evaluated (time budget too small?)")
    best = study.best_trial
    best_mask = LayerMask.skipping(num_layers, best.user_attrs["skip"])
    return SearchResult(
        mask=best_mask,
        objective=objective,
        value=float(best.value),
        scores=known[tuple(best_mask.skipped_layers)],
        trials=len(trials),
        seconds=time.perf_counter() - start,
        stopped=stopped,
        history=[_record(t) for t in sorted(trials, key=lambda t: t.number)],
        study_name=name,
    )


def layer_preference(evaluate: Evaluator, num_layers: int, objective: str) -> list[float]:
    """The objective when each middle layer alone is skipped (lower = cheaper to skip); one pass per layer."""
    return [evaluate(LayerMask.skipping(num_layers, [layer])).value(objective) for layer in middle_layers(num_layers)]


def random_baseline(
    evaluate: Evaluator, num_layers: int, skip_count: int, count: int, seed: int = 0
) -> list[tuple[LayerMask, Scores]]:
    """Scores of `count` random masks of the same skip count: the baseline a searched mask must beat."""
    rng = random.Random(seed)
    ratio = skip_count / num_layers
    masks = [random_mask(num_layers, ratio, rng) for _ in range(count)]
    return [(mask, evaluate(mask)) for mask in masks]
