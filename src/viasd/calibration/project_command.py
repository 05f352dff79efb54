"""`viasd project`: predicted tokens/s and speedups of plain, sd and via from measured costs and statistics.

The costs: a `viasd costs --out` file (any device, real or random weights of a named shape). The statistics,
one of: `--profile` (a routing profile's gate records, regenerated from its own prompts with the models it was
made for, as `calibrate --reselect` does; `--work` keeps them for the next run), or explicit figures
(`--acceptance`, `--tiers`, `--slim-agreement`: assumed, and labelled so). `--bench RUN` sets the projection
beside the speedups a `viasd bench` run measured; `--write-questions` writes a profile's prompts as bench
questions, so that the bench measures the workload the records describe. Registered in cli.py; heavy imports
happen inside the command.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from viasd.cli_options import DeviceOpt, DrafterOpt, DtypeOpt, TargetOpt, engine_spec
from viasd.errors import ViasdError
from viasd.jsonio import JSONFault, parse_json
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.speculation import DEFAULT_GAMMA

TOLERANCE = 0.10  # a projected speedup within 10% of the measured one counts as matching


def _numbers(text: str, option: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ViasdError(f"{option}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise ViasdError(f"{option}: no value given")
    return values


def project(
    costs: Annotated[Path | None, typer.Option(help="Pass costs: a JSON file written by `viasd costs --out`.")] = None,
    profile: Annotated[
        Path | None, typer.Option(help="Statistics from this routing profile's gate records (regenerated).")
    ] = None,
    acceptance: Annotated[
        float | None, typer.Option(help="Explicit statistics: the share of draft tokens that are the target's.")
    ] = None,
    tiers: Annotated[
        str, typer.Option(help="Explicit statistics: shares of draft tokens routed to accept,slim,full.")
    ] = "0,0,1",
    slim_agreement: Annotated[
        float,
        typer.Option(help="Explicit statistics: the share of positions where the slim view's top token is right."),
    ] = 1.0,
    tier_acceptance: Annotated[
        str | None, typer.Option(help="Explicit statistics: draft acceptance per tier (accept,slim,full).")
    ] = None,
    slim: Annotated[
        str | None,
        typer.Option(
            help="The costs' view(s) of the slim tier(s), e.g. skip=0.45 (default: the profile's, e.g. int8)."
        ),
    ] = None,
    drafter_view: Annotated[
        str | None,
        typer.Option(help="The costs' view of the drafter, e.g. int4 (default: the profile's drafter, else full)."),
    ] = None,
    full: Annotated[
        str,
        typer.Option(help="The costs' view of the full target, e.g. gguf for a target run as its file's blocks."),
    ] = "full",
    context: Annotated[int | None, typer.Option(help="Use the costs measured at the context nearest this.")] = None,
    sd_gamma: Annotated[
        int, typer.Option(help=f"Draft tokens per round of classic sd (sd's default: {DEFAULT_GAMMA}).")
    ] = DEFAULT_GAMMA,
    sd_stop: Annotated[
        float | None,
        typer.Option(
            help="Draft stop threshold of classic sd (default: sd's own, 0.5, with profile records; 0 with explicit "
            "statistics, which carry no drafter confidence)."
        ),
    ] = None,
    gamma: Annotated[
        int | None, typer.Option(help=f"via's draft length (default: the profile's, or {DEFAULT_GAMMA}).")
    ] = None,
    cap: Annotated[int | None, typer.Option(help="via's cap (default: the profile's, or 32).")] = None,
    prefill: Annotated[
        bool, typer.Option(help="Count reading the prompt (profile records know their prompts' lengths).")
    ] = True,
    reselect: Annotated[
        bool,
        typer.Option(
            help="With --profile: re-select via's round policy, and sd's gamma and stop, for these costs as `viasd "
            "calibrate` selects them (under the profile's recorded budget and search): does the slim tier pay here?"
        ),
    ] = False,
    bench: Annotated[
        Path | None, typer.Option(help="A `viasd bench` run directory: set its measured speedups beside these.")
    ] = None,
    bench_sd: Annotated[
        str | None,
        typer.Option(help="The bench's method to compare with sd (default: sd, or its one sd:... variant)."),
    ] = None,
    write_questions: Annotated[
        Path | None,
        typer.Option(help="Write the profile's prompts as bench questions (Spec-Bench JSONL) to this file and stop."),
    ] = None,
    work: Annotated[
        Path | None, typer.Option(help="Keep the regenerated continuations and records in this file.")
    ] = None,
    target: TargetOpt = DEFAULT_TARGET,
    drafter: DrafterOpt = DEFAULT_DRAFTER,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = None,
    out: Annotated[Path | None, typer.Option(help="Also write the projection as JSON to this file.")] = None,
) -> None:
    """Project tokens/s and speedups of plain, sd and via from pass costs and acceptance / gate statistics."""
    from rich.console import Console

    from viasd.calibration.projection import (
        EXPLICIT_GATE,
        Workload,
        costs_from_record,
        describe_explicit,
        explicit_records,
        project,
    )
    from viasd.decode.round import RoundPolicy
    from viasd.fileio import write_atomic
    from viasd.speculation import DEFAULT_STOP, check_gamma, check_stop
    from viasd.verify.gates import Gate

    err = Console(stderr=True)
    check_gamma(sd_gamma, "--sd-gamma")
    if gamma is not None:
        check_gamma(gamma, "--gamma")
    if (profile is None) == (acceptance is None):
        raise ViasdError("name the statistics: --profile PROFILE, or explicit ones starting with --acceptance")
    if write_questions is not None:
        if profile is None:
            raise ViasdError("--write-questions writes a profile's prompts: give --profile")
        _write_questions(profile, write_questions)
        err.print(f"wrote {write_questions}", highlight=False)
        return
    if costs is None:
        raise ViasdError("--costs: a JSON file written by `viasd costs --out` is needed")
    if reselect and profile is None:
        raise ViasdError("--reselect re-selects a profile's round policy: give --profile")
    if acceptance is not None:
        shares = _numbers(tiers, "--tiers")
        rates = _numbers(tier_acceptance, "--tier-acceptance") if tier_acceptance else None
        records = explicit_records(acceptance, shares, slim_agreement, rates)
        workload = Workload(records, [0] * len(records), describe_explicit(acceptance, shares, slim_agreement, rates))
        via = RoundPolicy(EXPLICIT_GATE, gamma=gamma or DEFAULT_GAMMA, cap=cap or 32)
    record = _read_json(costs, "costs file")
    routing = None
    if profile is not None:
        from viasd.profile import load_profile

        routing = load_profile(profile)
        named_slims, named_drafter = profile_views(routing)
        slim, drafter_view = slim or named_slims, drafter_view or named_drafter
        if drafter_view is None:
            raise ViasdError(
                "the profile drafts with the target's own view: name its costs with --drafter-view "
                "(and time that view of the target as the drafter)"
            )
    slims = [v.strip() for v in (slim or "").split(",") if v.strip()]
    if not slims:
        raise ViasdError("--slim: name the costs' view of the slim tier (e.g. skip=0.45)")
    # A bad costs file fails before any model loads.
    cost_model, used = costs_from_record(record, slims, context, full=full, drafter=drafter_view or "full")
    if routing is not None:
        from viasd.calibration.reselection import profile_data
        from viasd.calibration.workfile import WorkFile
        from viasd.engine import Engine

        if len(slims) != len(routing.masks):
            raise ViasdError(f"the profile has {len(routing.masks)} slim view(s); --slim names {len(slims)}")
        with err.status(f"loading {target} and {drafter}"):
            engine = Engine(engine_spec(target, drafter, device=device, dtype=dtype))
            pair = (engine.target, engine.drafter)
        routing.check_models(pair[0].model, pair[1].model)
        log = lambda text: err.print(f"[dim]{text}[/]", highlight=False)  # noqa: E731
        records, prompts = profile_data(routing, *pair, WorkFile(work), log, progress=True)
        label = f"measured: the gate records of {profile} ({len(records)} calibration prompts, regenerated)"
        workload = Workload(records, prompts if prefill else [0] * len(prompts), label)
        via = routing.policy(gamma=gamma, cap=cap)
    if sd_stop is None:
        sd_stop = 0.0 if acceptance is not None else DEFAULT_STOP
    sd = RoundPolicy(Gate.exact(), gamma=sd_gamma, stop=check_stop(sd_stop, "--sd-stop"))
    reselected = None
    if reselect and routing is not None:
        from viasd.calibration.selection import select_policy

        settings = recorded_search(routing.calibration)
        with err.status("re-selecting the round policies for these costs"):
            chosen = select_policy(workload.records, cost_model, **settings)
        via, sd = chosen.policy, chosen.sd_policy
        reselected = {**settings, "feasible": chosen.feasible, "candidates": chosen.candidates}
    result = project(workload, cost_model, sd, via)
    rows = _bench_rows(bench, bench_sd) if bench is not None else {}
    measured = {name: float(row["speedup"]) for name, row in rows.items()}

    report = {
        "costs": {"file": str(costs), **used},
        "statistics": workload.source,
        "prompt_counted": any(workload.prompts),
        "sequences": len(workload.records),
        "policies": {"sd": {"gamma": sd.gamma, "stop": sd.stop}, "via": _policy(via)},
        "methods": {name: m.to_dict() for name, m in result.items()},
    }
    if reselected is not None:
        report["reselected"] = reselected
    if measured:
        report["bench"] = {
            "run": str(bench),
            "measured_speedup": measured,
            "tolerance": TOLERANCE,
            "seconds_per_token_by_part": _part_comparison(result, rows),
        }
    _print(report, result, measured, cost_model)
    if out is not None:
        write_atomic(out, json.dumps(report, indent=2) + "\n")
        err.print(f"wrote {out}", highlight=False)


def profile_views(routing: Any) -> tuple[str, str | None]:
    """A profile's slim views and drafter as `viasd costs` names them: `profile` for its layer mask, its
    quantization recipe, or both joined by `+` (`profile+int8`), per tier; the drafter's recipe, `full`, or `head`
    for the target's draft head (None for the target's own view drafting: that table is the target's, not a
    drafter's)."""
    from viasd.calibration.head_drafts import HEAD

    slims = []
    for tier, mask in enumerate(routing.masks):
        recipe = routing.slim_quant(tier)
        parts = ([] if mask.is_full else ["profile"]) + ([recipe.name] if recipe else [])
        slims.append("+".join(parts) or "full")
    quant = routing.drafter_quant
    if routing.head_drafter:
        return ",".join(slims), HEAD
    drafter = None if routing.self_drafter else quant.name if quant else "full"
    return ",".join(slims), drafter


def _tier_shares(decided: dict[str, int] | None) -> str:
    """The shares of draft tokens each tier decided, e.g. `0% / 4% / 96%` ("-" for plain, which drafts none)."""
    total = sum((decided or {}).values())
    if not decided or not total:
        return "-"
    return " / ".join(f"{decided.get(tier, 0) / total:.0%}" for tier in ("accept", "slim", "full"))


def recorded_search(calibration: dict[str, Any]) -> dict[str, Any]:
    """The search a profile's policy was selected under (`calibration`'s budget, gammas, caps, pre-gates and stops),
    as `select_policy` takes it; calibrate's defaults for what an older profile did not record."""
    from viasd.calibration.settings import CalibrationSettings

    defaults = CalibrationSettings()
    try:
        return {
            "quality_budget": float(calibration.get("quality_budget", defaults.quality_budget)),
            "gammas": tuple(int(v) for v in calibration.get("gammas", defaults.gammas)),
            "caps": tuple(int(v) for v in calibration.get("caps", defaults.caps)),
            "pregates": tuple(float(v) for v in calibration.get("pregates", defaults.pregates)),
            "stops": tuple(float(v) for v in calibration.get("stops", defaults.stops)),
        }
    except (TypeError, ValueError) as exc:
        raise ViasdError(f"the profile's recorded search settings are malformed: {exc}") from None


def _policy(policy: Any) -> dict[str, Any]:
    from viasd.calibration.selection import policy_dict

    return policy_dict(policy)


def _read_json(path: Path, what: str, kind: type = dict, missing: str | None = None) -> Any:
    """The JSON value in `path`, which must be a `kind`; one-line errors naming `what` (or `missing`)."""
    try:
        data = parse_json(path.read_bytes())
    except FileNotFoundError:
        raise ViasdError(missing or f"{what} not found: {path}") from None
    except (OSError, JSONFault) as exc:
        raise ViasdError(f"cannot read {what} {path}: {exc}") from None
    if not isinstance(data, kind):
        raise ViasdError(f"cannot read {what} {path}: not a {what}")
    return data


def _write_questions(profile: Path, path: Path) -> None:
    """The profile's calibration prompts as Spec-Bench questions, one category, in the profile's order."""
    from viasd.calibration.reselection import profile_prompts
    from viasd.fileio import write_atomic
    from viasd.profile import load_profile

    texts, _ = profile_prompts(load_profile(profile))
    lines = [json.dumps({"question_id": i, "category": "calibration", "turns": [t]}) for i, t in enumerate(texts)]
    write_atomic(path, "\n".join(lines) + "\n")


def _bench_rows(run: Path, sd: str | None = None) -> dict[str, dict[str, Any]]:
    """Each method's overall row in a bench run's summary.json, with the run's sd method (`sd`, its only `sd:...`
    variant, or the one named) under the name sd."""
    path = run / "summary.json"
    missing = f"no bench summary at {path}: run `viasd bench --out RUN` (or --report-only) first"
    rows = [r for r in _read_json(path, "bench summary", list, missing) if isinstance(r, dict)]
    found = {
        str(r["method"]): r for r in rows if r.get("category") == "all" and isinstance(r.get("speedup"), int | float)
    }
    variants = [name for name in found if name == "sd" or name.startswith("sd:")]
    if sd is None and "sd" not in found and len(variants) > 1:
        raise ViasdError(f"the bench ran several sd methods ({', '.join(variants)}): name one with --bench-sd")
    chosen = sd or ("sd" if "sd" in found else (variants[0] if variants else None))
    if chosen is not None and chosen not in found:
        raise ViasdError(f"--bench-sd: the bench has no method {chosen!r} (it ran {', '.join(found)})")
    out = {name: row for name, row in found.items() if name not in variants}
    if chosen is not None:
        out["sd"] = found[chosen]
    return out


# The bench's cost split (`bench.metrics.COST_PARTS`) under the projection's part names.
_BENCH_PARTS = {"draft": "drafting", "slim": "slim verifier", "verify": "full target"}


def _part_comparison(result: dict[str, Any], rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method, projected and measured seconds per committed token of each part (draft, slim, verify)."""
    out: dict[str, dict[str, Any]] = {}
    for name, projected in result.items():
        measured = (rows.get(name) or {}).get("cost_per_token") or {}
        parts = projected.counts.get("seconds_by_part", {})
        out[name] = {
            part: {"projected": seconds / projected.tokens, "measured": measured.get(_BENCH_PARTS[part])}
            for part, seconds in parts.items()
            if seconds or measured.get(_BENCH_PARTS[part])
        }
    return out


def _print(report: dict[str, Any], result: dict[str, Any], measured: dict[str, float], costs: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    used = report["costs"]
    machine = used.get("machine") or {}
    where = machine.get("gpu") or machine.get("device") or "?"
    console.print(
        f"costs: {used['file']} ({where}; target {used['target']}, slim {', '.join(used['slim_views'])}, drafter "
        f"{used['drafter']}; context {used['context']}); full pass {1e3 * costs.full_pass(1):.2f} ms, slim "
        f"{1e3 * costs.slim_pass(1):.2f} ms, drafter step {1e3 * costs.step:.2f} ms (1 token)",
        highlight=False,
    )
    console.print(f"statistics: {report['statistics']}", highlight=False)
    if "reselected" in report:
        via, sd = report["policies"]["via"], report["policies"]["sd"]
        console.print(
            f"policies re-selected for these costs (quality budget {report['reselected']['quality_budget']}): sd "
            f"gamma {sd['gamma']}, stop {sd['stop']}; via {via}",
            highlight=False,
        )
    console.print(
        f"{report['sequences']} sequences; prompt {'counted' if report['prompt_counted'] else 'not counted'}",
        highlight=False,
    )
    table = Table(title="projected")
    columns = ["method", "tokens/s", "speedup over plain", "tokens per target call", "errors", "accept / slim / full"]
    if measured:
        columns += ["measured speedup", "projected / measured"]
    for column in columns:
        table.add_column(column)
    for name, m in result.items():
        per_call = m.counts.get("tokens_per_target_call") or 1.0
        errors = m.counts.get("error_rate")
        row = [name, f"{m.tokens_per_second:.2f}", f"{m.speedup:.2f}x", f"{per_call:.2f}"]
        row.append("-" if errors is None else f"{errors:.3f}")
        row.append(_tier_shares(m.counts.get("decided")))
        if measured:
            got = measured.get(name)
            if got is None:
                row += ["-", "-"]
            else:
                ratio = m.speedup / got
                verdict = "within 10%" if abs(ratio - 1) <= TOLERANCE else "OFF"
                row += [f"{got:.2f}x", f"{ratio:.3f} ({verdict})"]
        table.add_row(*row)
    console.print(table)
    for name, got in measured.items():
        if name in result and name != "plain":
            ratio = result[name].speedup / got
            verdict = "within 10%" if abs(ratio - 1) <= TOLERANCE else f"OFF by {100 * (ratio - 1):+.1f}%"
            console.print(
                f"{name}: projected {result[name].speedup:.3f}x, measured {got:.3f}x, projected / measured "
                f"{ratio:.3f} ({verdict})",
                highlight=False,
            )
    for name, parts in report.get("bench", {}).get("seconds_per_token_by_part", {}).items():
        cells = [
            f"{part} {1e3 * v['projected']:.1f}"
            + (f" / {1e3 * v['measured']:.1f}" if isinstance(v["measured"], int | float) else " / -")
            for part, v in parts.items()
        ]
        console.print(f"{name}: ms per token, projected / measured: {', '.join(cells)}", highlight=False)
