"""`viasd calibrate`: make a routing profile for a model pair, or re-select the round policy of an existing one.

Registered in cli.py as `app.command("calibrate")(user_errors(calibrate))` (one-line errors, like the other
commands). Heavy imports happen inside the command so that `viasd --help` stays fast.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer

from viasd.cli_options import DeviceOpt, DrafterOpt, DtypeOpt, TargetOpt, engine_spec
from viasd.errors import ViasdError
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.views.recipe import QuantRecipe


def _numbers(text: str, kind: type, option: str) -> tuple[Any, ...]:
    """Parse a comma-separated list such as '2,3,4' or '0.18,0.25'."""
    try:
        values = tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ViasdError(f"{option}: expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise ViasdError(f"{option}: no value given")
    return values


def _default_output(drafter: str, target: str, quant: str | None = None) -> Path:
    def stem(name: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name).name.removesuffix(".gguf")).strip("-") or "model"

    view = f".{stem(quant)}" if quant else ""  # a profile calibrated on a view of the target: <pair>.gguf.json
    return Path(f"{stem(drafter)}__{stem(target)}{view}.json")


def calibrate(
    target: TargetOpt = DEFAULT_TARGET,
    drafter: DrafterOpt = DEFAULT_DRAFTER,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Profile JSON to write (default: <drafter>__<target>.json).")
    ] = None,
    reselect: Annotated[
        Path | None,
        typer.Option(
            help="Re-select the round policy of this profile (its masks and measured costs kept; gate records "
            "regenerated from its own prompts) under the selection options given; no mask search."
        ),
    ] = None,
    what_if: Annotated[
        bool, typer.Option("--what-if", help="With --reselect: print what-if scenarios instead of writing a profile.")
    ] = False,
    kind: Annotated[
        str | None,
        typer.Option(
            help="With --reselect: select a round policy of the profile's own for requests of this task kind (code "
            "or prose), from the calibration split of that kind's benchmark tasks (code: HumanEval's; never the "
            "split `viasd bench --split report` reports), with --new-tokens per task; the rest of the profile kept."
        ),
    ] = None,
    kind_tasks: Annotated[
        int | None, typer.Option(help="With --kind: how many of that kind's calibration-split tasks (default: all).")
    ] = None,
    kind_slim_quant: Annotated[
        str | None,
        typer.Option(
            help="With --kind: the kind's slim view as this quantization of the target instead of the profile's "
            "(e.g. int4a8:gguf); its pass costs are measured here."
        ),
    ] = None,
    by_tasks: Annotated[
        Path | None,
        typer.Option(
            "--by-tasks",
            help="A `viasd bench --split calibration` run of via:profile=FILE candidates beside --reference: write "
            "the fastest candidate within --quality-points of it on every category (no model is loaded).",
        ),
    ] = None,
    reference: Annotated[
        str, typer.Option(help="With --by-tasks: the exact method of the run that stands for the target.")
    ] = "auto",
    quality_points: Annotated[
        float,
        typer.Option(
            help="With --by-tasks: the largest mean loss allowed per category, in points of its metric "
            "(pass@1 and accuracies in percentage points); a loss significant at 5% fails too."
        ),
    ] = 1.0,
    objective: Annotated[str, typer.Option(help="Mask search objective: margin, kl or agreement.")] = "margin",
    skip_ratio: Annotated[
        str,
        typer.Option(
            "--skip-ratio", help="Skip ratio(s) to search, comma-separated; the fastest wins ('none': no layer masks)."
        ),
    ] = "0.18,0.21,0.25",
    quant: Annotated[
        str | None,
        typer.Option(
            "--quant",
            help="Calibrate on this view of the target, which via then verifies against (gguf: the file's own blocks, "
            "its slim views those with layers skipped); default: the target as loaded.",
        ),
    ] = None,
    slim_quants: Annotated[
        str | None,
        typer.Option(
            help="Quantized views of the target to consider as slim views too (e.g. int8), alone and on the "
            "smallest searched mask; comma-separated."
        ),
    ] = None,
    drafters: Annotated[
        str,
        typer.Option(
            help="Drafter candidates: model (the drafter as loaded), model:RECIPE (its quantized view), self:RECIPE "
            "(the target's own quantized view), head (the target's draft head, which via then drafts with, prompt "
            "lookup first where it matches); comma-separated. The fastest with the gate wins. With --reselect: head "
            "re-selects the profile for the head (its pass costs measured here)."
        ),
    ] = "model",
    iterations: Annotated[int, typer.Option(help="Search trials per skip ratio.")] = 60,
    time_budget: Annotated[
        float | None, typer.Option("--time-budget", help="Seconds for all mask searches together.")
    ] = None,
    quality_budget: Annotated[
        float | None,
        typer.Option(
            "--quality-budget",
            help="Max share of committed tokens that differ from the target's (default 0.02, or the profile's).",
        ),
    ] = None,
    gammas: Annotated[
        str | None, typer.Option(help="Draft lengths to consider (default 2,3,4,5,6,8, or the profile's).")
    ] = None,
    caps: Annotated[
        str | None, typer.Option(help="Caps on unchecked tokens to consider (default 8,16,32, or the profile's).")
    ] = None,
    pregates: Annotated[
        str, typer.Option(help="Pre-gate thresholds to consider (drafter confidence; 0 = off), comma-separated.")
    ] = "0,0.3,0.5",
    stops: Annotated[
        str,
        typer.Option(
            help="Draft stop thresholds to consider (the drafter stops drafting after a token whose top probability "
            "is under it; 0 = off), comma-separated."
        ),
    ] = "0,0.2,0.3,0.4,0.5,0.6",
    min_tier_share: Annotated[
        float | None,
        typer.Option(
            help="Require each tier (accept, slim, full) to decide at least this share of draft tokens "
            "(default 0, or the profile's)."
        ),
    ] = None,
    prompts: Annotated[int, typer.Option(help="Number of built-in calibration prompts (1-12).")] = 8,
    search_prompts: Annotated[int, typer.Option(help="Of those, how many drive the mask search.")] = 4,
    new_tokens: Annotated[int, typer.Option(help="Target continuation length per prompt.")] = 64,
    sampler: Annotated[str, typer.Option(help="Bayesian sampler interleaved with random search: tpe or gp.")] = "tpe",
    resume: Annotated[
        bool, typer.Option(help="Continue the searches and reuse the work file's continuations and records.")
    ] = False,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = None,
    seed: Annotated[int, typer.Option(help="Seed of the search samplers and random baselines.")] = 0,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Find the slim verifier's layer mask and calibrate the gate, gamma, stop, cap and pre-gate for a model pair."""
    from rich.console import Console

    from viasd.calibration.settings import CalibrationSettings

    err = Console(stderr=True)
    if by_tasks is not None:
        from viasd.calibration.task_check import QualityBudget
        from viasd.calibration.task_command import choose_by_tasks

        if output is None:
            raise ViasdError("--by-tasks needs --output: the profile file to write")
        choose_by_tasks(by_tasks, reference, QualityBudget(points=quality_points), output)
        return
    if sampler not in ("tpe", "gp"):
        raise ViasdError(f"--sampler must be tpe or gp, got {sampler!r}")
    if what_if and reselect is None:
        raise ViasdError("--what-if needs --reselect PROFILE: the profile whose selection to question")
    task_kind = _task_kind(kind, kind_tasks, reselect is not None, what_if)
    if kind_slim_quant is not None and task_kind is None:
        raise ViasdError("--kind-slim-quant needs --kind: the task kind whose slim view it is")
    own_quant = QuantRecipe.parse(kind_slim_quant) if kind_slim_quant is not None else None
    base: dict[str, Any] = {}
    if reselect is not None:
        from viasd.profile import load_profile

        recorded = load_profile(reselect).calibration
        base = {
            "quality_budget": recorded.get("quality_budget"),
            "gammas": tuple(recorded["gammas"]) if recorded.get("gammas") else None,
            "caps": tuple(recorded["caps"]) if recorded.get("caps") else None,
            "min_tier_share": recorded.get("predicted", {}).get("min_tier_share"),
        }
    given = {
        "quality_budget": quality_budget,
        "gammas": _numbers(gammas, int, "--gammas") if gammas else None,
        "caps": _numbers(caps, int, "--caps") if caps else None,
        "min_tier_share": min_tier_share,
    }
    selection = {
        k: v for k, v in {**base, **{k: v for k, v in given.items() if v is not None}}.items() if v is not None
    }
    settings = CalibrationSettings(
        objective=objective,
        skip_ratios=() if skip_ratio.strip() == "none" else _numbers(skip_ratio, float, "--skip-ratio"),
        slim_quants=tuple(QuantRecipe.parse(part) for part in (slim_quants or "").split(",") if part.strip()),
        drafters=tuple(part.strip() for part in drafters.split(",") if part.strip()),
        target_quant=QuantRecipe.parse(quant) if quant is not None else None,
        iterations=iterations,
        time_budget=time_budget,
        prompts=prompts,
        search_prompts=search_prompts,
        new_tokens=new_tokens,
        sampler=sampler,
        seed=seed,
        pregates=_numbers(pregates, float, "--pregates"),
        stops=_numbers(stops, float, "--stops"),
        **selection,
    )
    settings.check()
    if quant is not None and reselect is not None:
        raise ViasdError("--quant with --reselect: a profile is reselected on the view it was calibrated on")
    out = output or (reselect if reselect is not None and what_if else None) or _default_output(drafter, target, quant)
    work_file = out.with_name(out.name + ".work")  # JSON; not *.json, so package data globs skip it
    log = lambda text: err.print(f"[dim]{text}[/]", highlight=False, soft_wrap=True)  # noqa: E731

    from viasd.engine import Engine

    with err.status(f"loading {target} and {drafter}"):
        engine = Engine(engine_spec(target, drafter, device=device, dtype=dtype))
        pair = (engine.target, engine.drafter)

    def quantized(loaded: Any, recipe: QuantRecipe) -> Any:  # made once per model and recipe, cached on disk
        view = engine.quantized(loaded, recipe)
        assert view is not None and view.linears is not None
        return view.linears

    if reselect is not None and task_kind is not None:
        _reselect_kind(
            reselect, out, task_kind, kind_tasks, pair, settings, work_file, log, err, progress, quantized, own_quant
        )
        return
    if reselect is not None:
        _reselect(reselect, out, what_if, pair, settings, work_file, log, err, progress, quantized)
        return

    import optuna

    from viasd.calibration.pipeline import calibrate_pair
    from viasd.profile import save_profile

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    try:
        profile = calibrate_pair(
            *pair,
            settings,
            storage=out.with_name(out.name + ".search.db"),
            work_file=work_file,
            resume=resume,
            log=log,
            progress=progress,
            quantized=quantized,
        )
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (cli.py handles both alike): what was done is on disk
        err.print(f"interrupted: {work_file.name} and the search studies keep what was done; --resume goes on")
        raise
    save_profile(profile, out)
    err.print(f"wrote {out}: {_describe(profile)}", highlight=False, soft_wrap=True)


def _describe(profile: Any) -> str:
    predicted = profile.calibration["predicted"]
    quant = f" + {profile.slim_quant(0).name}" if profile.slim_quant(0) else ""
    from viasd.calibration.candidates import drafter_name

    drafter_text = f"drafter {drafter_name(profile)}, "
    return (
        f"{profile.masks[0].describe()}{quant}, {drafter_text}"
        f"gate {profile.gate.signal} {list(profile.gate.thresholds)}, "
        f"gamma {profile.gamma}, stop {profile.stop:g}, cap {profile.cap}, pre-gate {profile.pregate:g}; predicted "
        f"{predicted['via']['tokens_per_second']:.2f} tok/s (error rate {predicted['via']['error_rate']:.3f}) "
        f"vs sd {predicted['sd']['tokens_per_second']:.2f}, plain {predicted['plain']['tokens_per_second']:.2f}"
    )


def _task_kind(kind: str | None, count: int | None, reselecting: bool, what_if: bool) -> str | None:
    """`--kind` and `--kind-tasks`, checked before any model loads."""
    from viasd.task_kind import parse_kind

    if kind is None:
        if count is not None:
            raise ViasdError("--kind-tasks needs --kind")
        return None
    if not reselecting or what_if:
        raise ViasdError("--kind needs --reselect PROFILE (and no --what-if): the profile to add the kind's policy to")
    parsed = parse_kind(kind)
    if parsed is None:
        raise ViasdError("--kind: give code or prose (auto is how requests are read, not a kind to calibrate)")
    if count is not None and count < 1:
        raise ViasdError(f"--kind-tasks must be >= 1, got {count}")
    return parsed


def _reselect_kind(
    source: Path,
    out: Path,
    kind: str,
    count: int | None,
    pair: tuple[Any, Any],
    settings: Any,
    work_file: Path,
    log: Any,
    err: Any,
    progress: bool,
    quantized: Any,
    slim_quant: QuantRecipe | None,
) -> None:
    """`--reselect P --kind K`: P with a round policy of its own for requests of task kind K (on a slim view of its
    own with --kind-slim-quant)."""
    from viasd.calibration.reselection import reselect_kind
    from viasd.fileio import file_sha256
    from viasd.profile import load_profile, save_profile

    profile = load_profile(source)
    new = reselect_kind(
        profile,
        file_sha256(source),
        *pair,
        settings,
        kind,
        count,
        work_file=work_file,
        log=log,
        progress=progress,
        quantized=quantized,
        slim_quant=slim_quant,
    )
    save_profile(new, out)
    own = new.policy(kind)
    predicted = new.calibration["kinds"][kind]["predicted"]["via"]
    err.print(
        f"wrote {out}: for {kind}: gate {own.gate.signal} {list(own.gate.thresholds)}, gamma {own.gamma}, "
        f"stop {own.stop:g}, cap {own.cap}, pre-gate {own.pregate:g}"
        + (f", slim view {slim_quant.name}" if slim_quant else "")
        + f"; predicted {predicted['tokens_per_second']:.2f} "
        f"tok/s (error rate {predicted['error_rate']:.3f})",
        highlight=False,
        soft_wrap=True,
    )


def _reselect(
    source: Path,
    out: Path,
    what_if: bool,
    pair: tuple[Any, Any],
    settings: Any,
    work_file: Path,
    log: Any,
    err: Any,
    progress: bool,
    quantized: Any,
) -> None:
    """`--reselect`: the profile's round policy selected again, or (`--what-if`) the scenario table."""
    from viasd.calibration.reselection import profile_records, reselect
    from viasd.calibration.workfile import WorkFile
    from viasd.fileio import file_sha256
    from viasd.profile import load_profile, save_profile

    profile = load_profile(source)
    if what_if:
        from viasd.calibration.whatif import what_if_table

        profile.check_models(pair[0].model, None if profile.self_drafter else pair[1].model)
        records = profile_records(profile, *pair, WorkFile(work_file), log, progress, quantized)
        print(what_if_table(profile, records, settings))
        return
    sha = file_sha256(source)
    new = reselect(profile, sha, *pair, settings, work_file=work_file, log=log, progress=progress, quantized=quantized)
    save_profile(new, out)
    err.print(f"wrote {out}: {_describe(new)}", highlight=False, soft_wrap=True)
