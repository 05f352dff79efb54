"""`viasd calibrate`: search the slim verifier's mask and calibrate the gate for a model pair; write a profile.

Registered in cli.py as `app.command("calibrate")(user_errors(calibrate))` (one-line errors, like the other
commands). Heavy imports happen inside the command so that `viasd --help` stays fast.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer

from viasd.errors import ViasdError
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET


def _numbers(text: str, kind: type, option: str) -> tuple[Any, ...]:
    """Parse a comma-separated list such as '2,3,4' or '0.18,0.25'."""
    try:
        values = tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ViasdError(f"{option}: expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise ViasdError(f"{option}: no value given")
    return values


def _default_output(drafter: str, target: str) -> Path:
    def stem(name: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name).name.removesuffix(".gguf")).strip("-") or "model"

    return Path(f"{stem(drafter)}__{stem(target)}.json")


def calibrate(
    target: Annotated[str, typer.Option("--target", "-t", help="Target model (name, directory, .gguf, hub id).")] = (
        DEFAULT_TARGET
    ),
    drafter: Annotated[str, typer.Option("--drafter", "-d", help="Drafter model (same tokenizer).")] = DEFAULT_DRAFTER,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Profile JSON to write (default: <drafter>__<target>.json).")
    ] = None,
    objective: Annotated[str, typer.Option(help="Mask search objective: margin, kl or agreement.")] = "margin",
    skip_ratio: Annotated[
        str, typer.Option("--skip-ratio", help="Skip ratio(s) to search, comma-separated; the fastest wins.")
    ] = "0.18,0.21,0.25",
    iterations: Annotated[int, typer.Option(help="Search trials per skip ratio.")] = 60,
    time_budget: Annotated[
        float | None, typer.Option("--time-budget", help="Seconds for all mask searches together.")
    ] = None,
    quality_budget: Annotated[
        float, typer.Option("--quality-budget", help="Max share of committed tokens that differ from the target's.")
    ] = 0.02,
    gammas: Annotated[str, typer.Option(help="Draft lengths to consider, comma-separated.")] = "2,3,4,5,6,8",
    pregates: Annotated[
        str, typer.Option(help="Pre-gate thresholds to consider (drafter confidence; 0 = off), comma-separated.")
    ] = "0,0.3,0.5",
    prompts: Annotated[int, typer.Option(help="Number of built-in calibration prompts (1-12).")] = 8,
    search_prompts: Annotated[int, typer.Option(help="Of those, how many drive the mask search.")] = 4,
    new_tokens: Annotated[int, typer.Option(help="Target continuation length per prompt.")] = 64,
    sampler: Annotated[str, typer.Option(help="Bayesian sampler interleaved with random search: tpe or gp.")] = "tpe",
    min_tier_share: Annotated[
        float,
        typer.Option(help="Require each tier (accept, slim, full) to decide at least this share of draft tokens."),
    ] = 0.0,
    resume: Annotated[
        bool, typer.Option(help="Continue the searches and reuse the continuations logged next to the output.")
    ] = False,
    dtype: Annotated[str, typer.Option(help="Weights dtype: auto, bf16, fp16, fp32.")] = "auto",
    device: Annotated[str | None, typer.Option(help="Device, e.g. cpu, cuda (default: cuda if present).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the search samplers and random baselines.")] = 0,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Find the slim verifier's routing mask and calibrate gate thresholds and gamma for a model pair."""
    import optuna
    from rich.console import Console

    from viasd.engine import Engine, EngineSpec
    from viasd.routing.calibrate import CalibrationSettings, calibrate_pair
    from viasd.routing.profile import save_profile

    err = Console(stderr=True)
    settings = CalibrationSettings(
        objective=objective,
        skip_ratios=_numbers(skip_ratio, float, "--skip-ratio"),
        iterations=iterations,
        time_budget=time_budget,
        quality_budget=quality_budget,
        gammas=_numbers(gammas, int, "--gammas"),
        pregates=_numbers(pregates, float, "--pregates"),
        prompts=prompts,
        search_prompts=search_prompts,
        new_tokens=new_tokens,
        sampler=sampler,
        seed=seed,
        min_tier_share=min_tier_share,
    )
    settings.check()
    if new_tokens < 8:
        raise ViasdError(f"--new-tokens must be >= 8, got {new_tokens}")
    if sampler not in ("tpe", "gp"):
        raise ViasdError(f"--sampler must be tpe or gp, got {sampler!r}")
    out = output or _default_output(drafter, target)
    storage = out.with_name(out.name + ".search.db")
    work_file = out.with_name(out.name + ".work")  # JSON; not *.json, so package data globs skip it
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    with err.status(f"loading {target} and {drafter}"):
        engine = Engine(EngineSpec(target=target, drafter=drafter, device=device, dtype=dtype))
        drafter_model = engine.drafter
    profile = calibrate_pair(
        engine.target,
        drafter_model,
        settings,
        storage=storage,
        work_file=work_file,
        resume=resume,
        log=lambda text: err.print(f"[dim]{text}[/]", highlight=False, soft_wrap=True),
        progress=progress,
    )
    save_profile(profile, out)
    predicted = profile.calibration["predicted"]
    err.print(
        f"wrote {out}: {profile.masks[0].describe()}, gate {profile.gate.signal} {list(profile.gate.thresholds)}, "
        f"gamma {profile.gamma}, cap {profile.cap}; predicted {predicted['via']['tokens_per_second']:.2f} tok/s "
        f"(error rate {predicted['via']['error_rate']:.3f}) vs sd {predicted['sd']['tokens_per_second']:.2f}, "
        f"plain {predicted['plain']['tokens_per_second']:.2f}",
        highlight=False,
        soft_wrap=True,
    )
