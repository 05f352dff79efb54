"""`viasd bench`: every method side by side on the same tasks and models, with quality and tier statistics.

Heavy imports (torch, transformers, matplotlib) happen inside the command so that `viasd --help` stays
fast. The command is registered in `viasd.cli`, which wraps it in `user_errors`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from viasd.cli_options import (
    DeviceMapOpt,
    DeviceOpt,
    DrafterOpt,
    DrafterQuantOpt,
    DtypeOpt,
    GammaOpt,
    ProfileOpt,
    QuantOpt,
    TargetOpt,
    engine_spec,
)
from viasd.errors import ViasdError
from viasd.jsonio import JSONFault, parse_json
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET

if TYPE_CHECKING:
    from viasd.spec import EngineSpec

DEFAULT_METHODS = "plain,sd,hf-assisted,lookup,self,via,via-exact"
# Settings that must be the same for rows of a resumed run to be comparable with the new ones.
RESUME_KEYS = (
    "target", "drafter", "profile", "dtype", "device", "max_new_tokens", "temperature",
    "top_p", "top_k", "seed", "gamma", "chat", "quant", "drafter_quant",
)  # fmt: skip


def parse_list(text: str | None) -> list[str] | None:
    return [c.strip() for c in text.split(",") if c.strip()] if text else None


def parse_category_budgets(text: str | None, code_budget: int | None, categories: Sequence[str]) -> dict[str, int]:
    """`--category-max-new-tokens CATEGORY=N,...` and `--code-max-new-tokens N`, checked once at the edge against
    the categories the run's tasks have. `--code-max-new-tokens` gives HumanEval and the run's code edits their budget.
    """
    from viasd.bench.edits import EDIT_KINDS
    from viasd.bench.tasks import HUMANEVAL_CATEGORY

    budgets: dict[str, int] = {}
    for item in parse_list(text) or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip().isdigit() or int(value) < 1:
            raise ViasdError(f"--category-max-new-tokens takes CATEGORY=N with N >= 1, got {item!r}")
        if name in budgets:
            raise ViasdError(f"--category-max-new-tokens names {name} twice")
        if name not in categories:
            known = ", ".join(sorted(set(categories))) or "none"
            raise ViasdError(f"--category-max-new-tokens names {name}, which no task of this run has (it has: {known})")
        budgets[name] = int(value)
    if code_budget is not None:
        if code_budget < 1:
            raise ViasdError(f"--code-max-new-tokens must be >= 1, got {code_budget}")
        if HUMANEVAL_CATEGORY in budgets:
            raise ViasdError(
                "HumanEval's budget is given twice: --code-max-new-tokens and humaneval= in --category-max-new-tokens"
            )
        budgets[HUMANEVAL_CATEGORY] = code_budget
        for kind in EDIT_KINDS:  # an edit's answer is a whole function too; a budget of its own comes first
            if kind in categories and kind not in budgets:
                budgets[kind] = code_budget
    return budgets


def _target_quant_name(spec: EngineSpec) -> str | None:
    """The recipe the target runs as by the run's --quant (None: as loaded), resolved from the target's file as
    `Engine.stored_recipe` resolves it: a run of the default target and one of its dense copy never mix on --resume."""
    from viasd.views.gguf import stored_view
    from viasd.views.recipe import AS_STORED, QuantRecipe

    if isinstance(spec.quant, QuantRecipe):
        return spec.quant.name
    recipe = stored_view(spec.target, spec.target)[0] if spec.quant == AS_STORED else None
    return recipe.name if recipe else None


def run_profile(target_quant: str | None, device: str | None) -> Path | None:
    """The profile `via` without profile= uses where the run's target will run as `target_quant` says
    (`_target_quant_name`; Engine.default_profile once loaded): the one of the file's blocks where it runs as them."""
    import torch

    from viasd.auto import int4a8_is_fast
    from viasd.models.loading import resolve_device
    from viasd.profile import default_profile_path
    from viasd.views.recipe import QuantRecipe

    stored = target_quant is not None and QuantRecipe.parse(target_quant).gguf
    return default_profile_path(int4a8_is_fast(torch.device(resolve_device(device))), stored)


def default_out_dir(now: dt.datetime | None = None) -> Path:
    stamp = (now or dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"bench-{stamp}"


def _comparable(key: str, value: Any) -> Any:
    """A setting as resuming compares it: the shipped profile by its place in the package, not its absolute path."""
    if key == "profile" and isinstance(value, str):
        from viasd.profile import shipped_place

        return shipped_place(value) or value
    return value


def check_resumable(previous: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuse to resume a run made with different models or generation settings.

    The profile's content is compared by hash where both runs recorded one, and so is the questions file's: rows
    are keyed by question id, so other questions under the same ids would keep the old answers (its name may change).
    """
    from viasd.bench.report import recorded_budgets

    keys = [*RESUME_KEYS, *(["profile_sha256"] if previous.get("profile_sha256") else [])]
    differing = {
        k: (previous.get(k), current.get(k))
        for k in keys
        if _comparable(k, previous.get(k)) != _comparable(k, current.get(k))
    }
    if recorded_budgets(previous) != recorded_budgets(current):
        differing["category_max_new_tokens"] = (recorded_budgets(previous), recorded_budgets(current))
    old_questions, new_questions = previous.get("questions_sha256"), current.get("questions_sha256")
    if old_questions and new_questions and old_questions != new_questions:
        differing["questions"] = (_questions_label(previous), _questions_label(current))
    if differing:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in differing.items())
        raise ViasdError(f"cannot resume: the run was made with other settings ({detail})")


def _questions_label(settings: Mapping[str, Any]) -> str:
    """A run's questions file as a refused resume names it: its path and the start of its content's hash."""
    return f"{settings.get('questions')} (sha256 {str(settings.get('questions_sha256'))[:12]})"


def read_environment(path: Path) -> dict[str, Any]:
    """A run's environment record, or a one-line error when it is unreadable, not JSON or not a record."""
    try:
        env = parse_json(path.read_bytes())
    except (OSError, JSONFault) as error:
        raise ViasdError(f"{path} is damaged ({error}); move the run elsewhere or pick another --out") from None
    if not isinstance(env, dict) or not isinstance(env.get("settings", {}), dict):
        raise ViasdError(f"{path} is damaged (not a run's environment record); pick another --out")
    return env


def bench(
    methods: Annotated[
        str,
        typer.Option(
            help="Comma-separated methods to compare, baseline 'plain' first; variants as via:gamma=4:pregate=0.5. "
            "Without quant= a method runs the target as --quant says (default: a GGUF file's target as the file "
            "stores it); plain:quant=none names its dense bf16 copy."
        ),
    ] = DEFAULT_METHODS,
    questions: Annotated[
        Path | None, typer.Option(help="Spec-Bench-format JSONL (default: the shipped development half).")
    ] = None,
    categories: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated categories (default: all of the questions file); name:N gives one category its own "
            "count. The edit workload's are named only: edit_types, edit_rename, edit_fix, edit_comprehension, "
            "chat_revise."
        ),
    ] = None,
    count: Annotated[int, typer.Option(help="Questions per category, spread over it (0: none).")] = 5,
    humaneval: Annotated[int, typer.Option(help="HumanEval problems, spread over the 164 (0: none).")] = 0,
    split: Annotated[
        str,
        typer.Option(
            help="Tasks to draw from: all, calibration (the fixed quarter that task-outcome calibration tunes on) "
            "or report (the rest); with --compare, the rows compared."
        ),
    ] = "all",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Token budget per turn.")] = 128,
    code_max_new_tokens: Annotated[
        int | None,
        typer.Option(help="Token budget for HumanEval answers and code edits (default: --max-new-tokens)."),
    ] = None,
    category_max_new_tokens: Annotated[
        str | None,
        typer.Option(
            help="Token budgets of single categories, CATEGORY=N[,CATEGORY=N] (e.g. math_reasoning=256: a worked "
            "answer needs more room than a short prose one); the others get --max-new-tokens."
        ),
    ] = None,
    temperature: Annotated[float, typer.Option(help="0 means greedy (the default, as in Spec-Bench).")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables top-k.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    gamma: GammaOpt = None,
    target: TargetOpt = DEFAULT_TARGET,
    drafter: DrafterOpt = DEFAULT_DRAFTER,
    profile: ProfileOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = "auto",
    device_map: DeviceMapOpt = None,
    quant: QuantOpt = None,
    drafter_quant: DrafterQuantOpt = None,
    out: Annotated[Path | None, typer.Option(help="Output directory (default: runs/bench-<timestamp>).")] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in --out, skipping finished rows.")] = False,
    warmup: Annotated[
        bool,
        typer.Option(
            help="Warm up before timing anything: every kernel built and checked, and untimed generations of every "
            "method on its longest and shortest prompts."
        ),
    ] = True,
    chat: Annotated[bool, typer.Option(help="Apply the model's chat template.")] = True,
    humaneval_timeout: Annotated[float, typer.Option(help="Seconds a HumanEval test may run.")] = 10.0,
    report_only: Annotated[
        bool, typer.Option(help="Only rewrite the summary and plot of the run in --out from its results.")
    ] = False,
    into: Annotated[
        Path | None,
        typer.Option(help="With --report-only: also put the summary into this markdown file (e.g. BENCHMARKS.md)."),
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option(help="METHOD,BASELINE: per-task speed ratio of two methods of the run in --out (no models)."),
    ] = None,
    allow_unsandboxed_code: Annotated[
        bool,
        typer.Option(
            "--allow-unsandboxed-code",
            help="Where bubblewrap is missing, run model-written HumanEval code anyway, under an in-process guard "
            "that deliberate code can undo (the risk is yours).",
        ),
    ] = False,
) -> None:
    """Benchmark decoding methods side by side: speed, tier statistics and quality, on Spec-Bench and HumanEval."""

    from viasd.bench.edits import EDIT_SOURCE
    from viasd.bench.memory import PeakMemory
    from viasd.bench.report import (
        ENV_JSON,
        RESULTS_JSONL,
        environment,
        load_average,
        warmup_line,
        write_atomic,
        write_report,
    )
    from viasd.bench.runner import ResultsFile, RunSettings, pending_pairs
    from viasd.bench.sandbox import require_sandbox
    from viasd.bench.splits import parse_split
    from viasd.bench.tasks import build_tasks, default_questions_path
    from viasd.engine import Engine
    from viasd.fileio import file_sha256
    from viasd.methods import parse_method_list
    from viasd.verify.sampling import SamplingParams

    err = Console(stderr=True)
    task_split = parse_split(split)
    if compare is not None:
        _compare(out, compare, task_split)
        return
    if into is not None and not report_only:
        raise ViasdError("--into needs --report-only: it writes a finished run's summary into a document")
    if report_only:
        _report_only(err, out, into)
        return
    specs = {m.name: m for m in parse_method_list(methods)}  # parsed once, here; rows are labelled by name
    method_list = list(specs)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if max_new_tokens < 1:
        raise ViasdError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not 0 < humaneval_timeout < float("inf"):  # NaN fails this too
        raise ViasdError(f"--humaneval-timeout must be a finite number of seconds > 0, got {humaneval_timeout}")
    tasks = build_tasks(questions, parse_list(categories), count, humaneval, task_split)
    budgets = parse_category_budgets(category_max_new_tokens, code_max_new_tokens, [t.category for t in tasks])
    questions_file = questions or default_questions_path()
    runs_code = any(t.source in ("humaneval", EDIT_SOURCE) for t in tasks)
    if runs_code and not allow_unsandboxed_code:
        require_sandbox()  # before any model is loaded, not at the first HumanEval answer hours later

    if resume and out is None:
        raise ViasdError("--resume needs --out: the directory of the run to continue")
    out_dir = out or default_out_dir()
    if out_dir.exists() and not out_dir.is_dir():
        raise ViasdError(f"--out {out_dir} is a file: name a directory for the run's files")
    results_path = out_dir / RESULTS_JSONL
    if results_path.exists() and not resume:
        raise ViasdError(f"{out_dir} already holds a run: pass --resume to continue it, or another --out")
    spec = engine_spec(
        target,
        drafter,
        profile=profile,
        gamma=gamma,
        device=device,
        dtype=dtype,
        device_map=device_map,
        quant=quant,
        drafter_quant=drafter_quant,
    )
    spec = dataclasses.replace(spec, suffix_per_method=True)  # methods side by side: none copies another's answer
    target_quant = _target_quant_name(spec)
    profile_path = profile or run_profile(target_quant, device)
    settings: dict[str, Any] = {
        "methods": method_list,
        "target": target,
        "drafter": drafter,
        "profile": str(profile_path) if profile_path else None,
        "profile_sha256": file_sha256(profile_path) if profile_path and Path(profile_path).is_file() else None,
        "dtype": dtype,
        "device": device,
        "max_new_tokens": max_new_tokens,
        "category_max_new_tokens": budgets,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "gamma": gamma,
        "quant": target_quant,
        "drafter_quant": spec.drafter_quant.name if spec.drafter_quant else None,
        "chat": chat,
        "questions": str(questions_file),
        "questions_sha256": file_sha256(questions_file) if count else None,
        "categories": parse_list(categories),
        "count": count,
        "humaneval": humaneval,
        "split": task_split,
        "tasks": len(tasks),
        "humaneval_sandbox": _sandbox_label(runs_code),
    }
    env_path = out_dir / ENV_JSON
    previous_env: dict[str, Any] = {}
    if resume and env_path.exists():
        previous_env = read_environment(env_path)
        check_resumable(previous_env.get("settings", {}), settings)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ViasdError(f"cannot create --out {out_dir}: {error.strerror or error}") from None

    with err.status(f"loading {target}"):
        engine = Engine(spec)
    recipe = engine.target_recipe()  # as the loaded target resolves it (a default model fetched just now has its file)
    if settings["quant"] != (recipe.name if recipe else None):
        settings["quant"] = recipe.name if recipe else None
        if previous_env:
            check_resumable(previous_env.get("settings", {}), settings)
    parameter = next(engine.target.model.parameters())
    models = {
        "target": target,
        "target_path": engine.target.path,
        "drafter": drafter,
        "profile": settings["profile"],
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "device": str(parameter.device),
    }
    env = environment(settings, models)
    if previous_env.get("date"):  # a resumed run keeps its first start and lists the resumes
        env["resumed"] = [*previous_env.get("resumed", []), env["date"]]
        env["date"] = previous_env["date"]
    write_atomic(env_path, json.dumps(env, indent=2) + "\n")

    results = ResultsFile(results_path, on_damage=_warn_damaged("its task runs again"))
    run_settings = RunSettings(
        methods=method_list,
        max_new_tokens=max_new_tokens,
        category_max_new_tokens=budgets,
        sampling=sampling,
        chat=chat,
        warmup=warmup,
        humaneval_timeout=humaneval_timeout,
        allow_unsandboxed_code=allow_unsandboxed_code,
    )
    done = [(r["key"], r["method"]) for r in results.load()]
    total = len(pending_pairs(tasks, method_list, done))
    err.print(
        f"{len(tasks)} tasks x {len(method_list)} methods: {total} to run"
        + (f" ({len(done)} already done)" if done else "")
        + f"; results in {out_dir}",
        highlight=False,
    )
    interrupted: KeyboardInterrupt | None = None
    if not warmup:
        env["warmup"] = None  # said in the summary: each method's first task carries its start-up

    def decoder_for(name: str) -> Any:
        return engine.decoder(specs[name])

    def warmed(done: Any) -> None:
        engine.forget_finished()  # the warm-up generated timed tasks' own answers: no method may copy them
        env["warmup"] = done.to_dict()
        err.print(warmup_line(done.to_dict()), highlight=False, soft_wrap=True)

    try:  # Ctrl-C or SIGTERM (cli.py handles both alike): the report of what the run has, then the same stop
        memory = PeakMemory(models["device"])
        rows = _run_with_progress(err, total, tasks, engine, decoder_for, run_settings, results, memory, warmed)
    except KeyboardInterrupt as stop:
        interrupted = stop
        rows = results.load()
    wanted = {t.key for t in tasks}
    rows = [r for r in rows if r["key"] in wanted and r["method"] in method_list]
    env["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    env["load_average_at_finish"] = load_average()
    env["rows"] = len(rows)
    # What each method ran as (views, drafter, profile, kernels), now that every decoder has been built.
    env["setup"] = {name: engine.describe(spec) for name, spec in specs.items()}
    write_atomic(env_path, json.dumps(env, indent=2) + "\n")
    if rows:
        paths = write_report(out_dir, rows, env, baseline="plain")
        _print_overview(rows, env)
        err.print(f"summary: {paths['markdown']}\nplot: {paths['plot']}\nresults: {results_path}", highlight=False)
    if interrupted is not None:
        err.print(f"interrupted: continue with --resume --out {out_dir}")
        raise interrupted


def _sandbox_label(runs_code: bool) -> str | None:
    """What HumanEval code runs in, for the run's record (None: the run has no HumanEval tasks)."""
    if not runs_code:
        return None
    from viasd.bench.isolation import find_bubblewrap

    return "bubblewrap" if find_bubblewrap()[0] is not None else "in-process guard only (--allow-unsandboxed-code)"


def _warn_damaged(what_then: str) -> Callable[[Any], None]:
    """Report a damaged results line once, on stderr, as `file:line: why`, and what happens to it."""

    def warn(line: Any) -> None:
        print(f"warning: {line}; skipped ({what_then})", file=sys.stderr, flush=True)

    return warn


def missing_pairs(env: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], methods: Sequence[str]) -> int | None:
    """How many (task, method) rows of `methods` the run is still missing (None when its record cannot tell).

    The run's record names how many tasks it has: each method needs a row (or error row) for that many tasks.
    """
    tasks = env.get("settings", {}).get("tasks")
    if not isinstance(tasks, int) or isinstance(tasks, bool) or not methods:
        return None
    keys: dict[str, set[str]] = {method: set() for method in methods}
    for row in rows:
        if row["method"] in keys:
            keys[row["method"]].add(row["key"])
    return sum(max(0, tasks - len(found)) for found in keys.values())


def _load_run(
    out: Path | None, option: str, methods: Sequence[str] | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The environment record and result rows of the run in `out`, without loading any model.

    Reading never changes the results file. A damaged line would make the report or comparison silently leave
    out its row, so `--report-only` and `--compare` refuse (exit 2, naming the line) unless every row the run
    should have is there anyway (its task was run again by `--resume`): then the line is reported and skipped.
    `methods`: those the command needs complete (None: all of the run's).
    """
    from viasd.bench.report import ENV_JSON, RESULTS_JSONL
    from viasd.bench.runner import ResultsFile

    if out is None:
        raise ViasdError(f"{option} needs --out: the directory of the run")
    env_path, results_path = out / ENV_JSON, out / RESULTS_JSONL
    if not env_path.exists() or not results_path.exists():
        raise ViasdError(f"{out} holds no benchmark run (no {ENV_JSON} and {RESULTS_JSONL})")
    env = read_environment(env_path)
    results = ResultsFile(results_path, on_damage=None)
    rows = results.load()
    if results.damaged:
        wanted = env.get("settings", {}).get("methods") if methods is None else methods
        missing = missing_pairs(env, rows, wanted if isinstance(wanted, list) else [])
        if missing != 0:
            more = len(results.damaged) - 1
            raise ViasdError(
                f"{results.damaged[0]}{f' (and {more} more damaged lines)' if more else ''}: {option} would "
                "leave its row out; run the benchmark again with --resume to redo it, or remove the line"
            )
        for line in results.damaged:
            _warn_damaged("the run has every row without it")(line)
    if not rows:
        raise ViasdError(f"{results_path} holds no results")
    return env, rows


def _report_only(err: Console, out: Path | None, into: Path | None) -> None:
    """Rewrite the report files of a finished or interrupted run (and embed its summary in a document)."""
    from viasd.bench.report import embed, write_report

    env, rows = _load_run(out, "--report-only")
    assert out is not None
    paths = write_report(out, rows, env, baseline="plain")
    _print_overview(rows, env)
    err.print(f"summary: {paths['markdown']}\nplot: {paths['plot']}", highlight=False)
    if into is not None:
        embed(into, out, paths["markdown"].read_text(encoding="utf-8"))
        err.print(f"wrote the summary into {into}", highlight=False)


def _compare(out: Path | None, pair: str, split: Any = "all") -> None:
    """`--compare METHOD,BASELINE`: a few lines on standard output, over the rows of `split`."""
    from viasd.bench.report import comparison
    from viasd.bench.splits import in_split

    names = [name.strip() for name in pair.split(",")]
    if len(names) != 2 or not all(names):
        raise ViasdError(f"--compare takes two methods of the run, METHOD,BASELINE; got {pair!r}")
    _, rows = _load_run(out, "--compare", names)
    rows = [r for r in rows if in_split(r["key"], split)]
    if split != "all":
        print(f"{split} split: {len({r['key'] for r in rows})} tasks")
    print(comparison(rows, names[0], names[1]))


def _run_with_progress(
    err: Console,
    total: int,
    tasks: Sequence[Any],
    engine: Any,
    decoder_for: Callable[[str], Any],
    settings: Any,
    results: Any,
    memory: Any,
    on_warmup: Callable[[Any], None],
) -> list[dict[str, Any]]:
    """run_benchmark under a rich progress bar on stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from viasd.bench.runner import run_benchmark

    if not err.is_terminal:  # a log file: one plain line per finished row
        finished = 0

        def log_row(row: dict[str, Any]) -> None:
            nonlocal finished
            finished += 1
            stats = row.get("stats") or {}
            what = (
                f"error: {row['error']}"
                if row.get("error")
                else (f"{stats.get('new_tokens', 0)} tokens, {stats.get('tokens_per_second', 0):.2f} tok/s")
            )
            err.print(f"[{finished}/{total}] {row['key']} {row['method']}: {what}", highlight=False, soft_wrap=True)

        return run_benchmark(
            tasks, decoder_for, engine.tokenizer, settings, results, memory, on_row=log_row, on_warmup=on_warmup
        )
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
    )
    with Progress(*columns, console=err, transient=False) as progress:
        bar = progress.add_task("starting", total=total, last="")

        def on_start(task: Any, method: str) -> None:
            progress.update(bar, description=f"{task.key} {method}")

        def on_row(row: dict[str, Any]) -> None:
            stats = row.get("stats") or {}
            last = "error" if row.get("error") else f"{row['method']} {stats.get('tokens_per_second', 0):.2f} tok/s"
            progress.update(bar, advance=1, last=last)

        return run_benchmark(
            tasks, decoder_for, engine.tokenizer, settings, results, memory, on_start, on_row, on_warmup
        )


def _print_overview(rows: Sequence[Mapping[str, Any]], env: Mapping[str, Any]) -> None:
    """The overall table on standard output."""
    from viasd.bench.metrics import ALL, summarize
    from viasd.bench.report import report_baseline

    baseline = report_baseline(rows, env)
    table = Table(title=f"viasd bench (all tasks; speedups over {baseline})")
    columns = ("method", "tasks", "tokens/s", "speedup", "tokens/full call", "rejection", f"identical to {baseline}")
    for column in columns:
        table.add_column(column)
    for s in summarize(rows, baseline):
        if s.category != ALL:
            continue
        table.add_row(
            s.method,
            str(s.prompts),
            f"{s.tokens_per_second:.2f}",
            "-" if s.speedup is None else f"{s.speedup:.2f}x",
            "-" if s.tokens_per_target_call is None else f"{s.tokens_per_target_call:.2f}",
            "-" if s.rejection_rate is None else f"{100 * s.rejection_rate:.1f}%",
            "-" if s.identical_to_baseline is None else f"{100 * s.identical_to_baseline:.0f}%",
        )
    console = Console()
    if not console.is_terminal:  # a pipe or a file: do not squeeze the table into 80 columns
        console = Console(width=120)
    console.print(table)
