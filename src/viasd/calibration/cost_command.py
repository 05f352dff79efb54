"""`viasd costs`: what a pass costs on this machine, per view of the target (and drafter), per tokens per pass.

Views are named as on the command line: `full` (the model as loaded), a quantization recipe (`int8`, `int8wo`,
`int4`, `int8:keep=lm_head`, ...), `skip=R` (R of the layers skipped, evenly spread), `profile` (the routing
profile's slim mask), or a combination joined by `+` (`skip=0.25+int8`). `--shape` (and `--drafter-shape`) time
a randomly initialised model of a named real shape (models/shapes.py) instead of loading one: timing needs no
trained weights, and the weights are made on the device, so no checkpoint is fetched. `--context` takes several
cache lengths, each timed in turn. `--head` times the target's draft head drafting as the drafter view `head`.
`--out` writes the figures as JSON, which `viasd project` reads. `--kernels`
times the matrix kernels alone. Registered in cli.py; heavy imports happen inside the command.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from viasd.cli_options import DeviceOpt, DrafterOpt, DtypeOpt, ProfileOpt, TargetOpt, engine_spec
from viasd.errors import ViasdError
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.views.recipe import QuantRecipe


def _list(text: str, kind: type, option: str) -> list[Any]:
    try:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ViasdError(f"{option}: expected a comma-separated list, got {text!r}") from None
    if not values:
        raise ViasdError(f"{option}: no value given")
    return values


def parse_view(text: str, model: Any, quantized: Any, profile_mask: Any) -> Any:
    """A view of `model` from its name (see the module docstring); `quantized(recipe)` makes quantized copies."""
    from viasd.views.layer_skip import LayerMask, num_decoder_layers, spread_mask
    from viasd.views.view import View

    if text == "full":
        return None
    mask: LayerMask | None = None
    linears = None
    for part in text.split("+"):
        if part.startswith("skip="):
            try:
                ratio = float(part.removeprefix("skip="))
            except ValueError:
                raise ViasdError(f"view {text!r}: skip=R needs a ratio, e.g. skip=0.25") from None
            mask = spread_mask(num_decoder_layers(model), ratio)
        elif part == "profile":
            mask = profile_mask()
        else:
            linears = quantized(part).linears
    return View(mask=mask, linears=linears)


RANDOM_WEIGHTS = (
    "random weights of the named shape, made on the device: timing needs no trained weights (a pass does the same "
    "work whatever the weights hold)"
)


def costs(
    target: TargetOpt = DEFAULT_TARGET,
    drafter: DrafterOpt = DEFAULT_DRAFTER,
    shape: Annotated[
        str | None, typer.Option(help="Time a random model of this shape instead (e.g. qwen2.5-7b; see --help).")
    ] = None,
    drafter_shape: Annotated[
        str | None,
        typer.Option(help="Time a random drafter of this shape (e.g. qwen2.5-0.5b); its views: --drafter-views."),
    ] = None,
    views: Annotated[str, typer.Option(help="Views of the target, comma-separated.")] = "full,int8,int4",
    drafter_views: Annotated[
        str | None,
        typer.Option(
            help="Views of the drafter to time too (e.g. full,int4); default none (full with --drafter-shape)."
        ),
    ] = None,
    tokens: Annotated[str, typer.Option(help="Tokens per pass, comma-separated.")] = "1,2,4,8,12,16",
    context: Annotated[
        str,
        typer.Option(help="Tokens already in the cache before each pass; several, comma-separated, are timed in turn."),
    ] = "128",
    keep: Annotated[
        int,
        typer.Option(
            help="Most rows of logits a target pass keeps (a verification pass keeps its block; the drafter keeps 1)."
        ),
    ] = 16,
    repeats: Annotated[int, typer.Option(help="Timings per view and length (medians are reported).")] = 5,
    agreement: Annotated[
        int,
        typer.Option(
            help="Also score each view's greedy top-1 agreement with the model, teacher-forced on this many "
            "built-in prompts (the model's own continuations); 0: no."
        ),
    ] = 0,
    head: Annotated[
        bool,
        typer.Option(
            help="Also time the target's draft head drafting, as drafter view `head` (with --shape: a random head of "
            "the shipped design at that shape's width, as for a target without a head)."
        ),
    ] = False,
    kernels: Annotated[
        bool,
        typer.Option(
            help="Time the matrix kernels alone (bf16, int8, int8wo, int4, int4a8, int6a8, fbgemm): no model."
        ),
    ] = False,
    kernel_shape: Annotated[str, typer.Option(help="in,out features of the kernel matrices.")] = "1536,8960",
    profile: ProfileOpt = None,
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = None,
    out: Annotated[Path | None, typer.Option(help="Also write the figures as JSON to this file.")] = None,
) -> None:
    """Measure pass costs on this machine: each view of the target per tokens per pass, ms and ratio to full."""
    from rich.console import Console
    from rich.table import Table

    err = Console(stderr=True)
    lengths = _list(tokens, int, "--tokens")
    contexts = _list(context, int, "--context")
    if min(lengths) < 1 or min(contexts) < 1 or repeats < 1 or keep < 1:
        raise ViasdError("--tokens, --context, --keep and --repeats must be >= 1")
    record: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "tokens": lengths,
        "context": contexts[0] if len(contexts) == 1 else contexts,
        "contexts": contexts,
        "keep": keep,
        "repeats": repeats,
    }
    tables: dict[str, dict[str, list[float]]] = {}
    if kernels:
        from viasd.calibration.costs import measure_kernels

        in_features, out_features = _list(kernel_shape, int, "--kernel-shape")
        with err.status("timing kernels over 40 distinct matrices"):
            kinds = ["bf16", "int8", "int8wo", "int4", "int4a8", "fbgemm"]
            if in_features % 256 == 0:  # a GGUF file's 6-bit blocks hold 256 inputs
                kinds.insert(5, "int6a8")
            tables["kernels"] = measure_kernels(in_features, out_features, lengths, kinds, repeats=repeats)
        record["kernel_shape"] = [in_features, out_features]
    else:
        if drafter_shape is not None and drafter_views is None:
            drafter_views = "full"
        models = (target, drafter, shape, drafter_shape, views, drafter_views)
        record["tables"] = _model_tables(err, *models, lengths, contexts, keep, repeats, profile, dtype, device,
                                         record, agreement, head)  # fmt: skip
        for entry in record["tables"]:
            title = f"{entry['role']} {entry['model']}" + (
                f" @ context {entry['context']}" if len(contexts) > 1 else ""
            )
            tables[title] = entry["views"]
    record["load_average_at_finish"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    console = Console()
    for title, table in tables.items():
        rows = Table(title=f"{title}: ms per pass (ratio to the first row)")
        rows.add_column("view")
        for n in lengths:
            rows.add_column(f"{n} tok")
        base = next(iter(table.values()))
        for name, seconds in table.items():
            rows.add_row(name, *(f"{1e3 * s:.1f} ({s / b:.2f})" for s, b in zip(seconds, base, strict=True)))
        console.print(rows)
    for title, scores in record.get("agreement", {}).items():
        lines = ", ".join(f"{name} {a / n:.3f} ({a}/{n})" for name, (a, n) in scores.items())
        console.print(f"{title}: greedy top-1 agreement with the model as loaded: {lines}", highlight=False)
    if record.get("weights", {}).get("target") == RANDOM_WEIGHTS:
        console.print(f"weights: {RANDOM_WEIGHTS}", highlight=False)
    record["seconds"] = tables
    if out is not None:
        from viasd.fileio import write_atomic

        write_atomic(out, json.dumps(record, indent=2) + "\n")
        err.print(f"wrote {out}", highlight=False)


def _model_tables(
    err: Any,
    target: str,
    drafter: str,
    shape: str | None,
    drafter_shape: str | None,
    views: str,
    drafter_views: str | None,
    lengths: list[int],
    contexts: list[int],
    keep: int,
    repeats: int,
    profile: str | None,
    dtype: str,
    device: str | None,
    record: dict[str, Any],
    agreement: int,
    head: bool = False,
) -> list[dict[str, Any]]:
    """One table per model (target, then drafter, then the target's draft head) and context: {role, model, context,
    views: {view: seconds}}."""
    import random

    from rich.progress import Progress

    from viasd.calibration.costs import device_info, measure_views
    from viasd.calibration.teacher import view_agreement
    from viasd.engine import Engine
    from viasd.models.loading import LoadedModel, parse_dtype, resolve_device
    from viasd.models.shapes import random_model
    from viasd.models.stored import is_stored

    if shape is not None and drafter_views and drafter_shape is None:
        raise ViasdError(
            "--shape times a random target: name the drafter's shape too (--drafter-shape, e.g. qwen2.5-0.5b)"
        )
    spec = engine_spec(target, drafter, profile=profile, device=device, dtype=dtype)
    where = resolve_device(device)

    def random_loaded(name: str) -> LoadedModel:
        with err.status(f"making a random {name} on {where}"):
            return LoadedModel(random_model(name, where, parse_dtype(dtype, where)), None, name, name)  # type: ignore[arg-type]

    if shape is not None:
        engine = Engine(spec, target=random_loaded(shape))
    else:
        with err.status(f"loading {target}"):
            engine = Engine(spec)
    model = engine.target.model
    record.update(
        target=shape or target,
        shape=shape is not None,
        drafter=(drafter_shape or drafter) if drafter_views else None,
        dtype=str(next(model.parameters()).dtype),
        machine=device_info(next(model.parameters()).device),
        weights={"target": RANDOM_WEIGHTS if shape is not None else "as loaded"},
    )

    def tables(loaded: LoadedModel, role: str, names: list[str], rows: int) -> list[dict[str, Any]]:
        """Timings of each named view of `loaded` per context, as `role` (target or drafter) makes its passes."""
        random_weights = loaded.tokenizer is None

        def quantized(recipe: str) -> Any:
            if not random_weights:
                return engine.quantized(loaded, QuantRecipe.parse(recipe))
            # Random weights: quantize them for the timing, but never cache them on disk.
            from viasd.views.quantize import quantize
            from viasd.views.view import View

            return View(linears=quantize(loaded.model, QuantRecipe.parse(recipe)))

        profile_mask = lambda: engine.routing_profile().masks[0]  # noqa: E731
        chosen = {name: parse_view(name, loaded.model, quantized, profile_mask) for name in names}
        if agreement:
            with err.status(f"scoring the agreement of {len(chosen)} views of {loaded.name}"):
                scores = view_agreement(loaded.model, chosen, _agreement_sequences(engine, loaded, agreement))
            record.setdefault("agreement", {})[f"{loaded.name}"] = scores
        vocab = int(loaded.model.config.vocab_size)
        out = []
        for ctx in contexts:
            ids = [random.Random(0).randrange(vocab) for _ in range(ctx + max(lengths))]
            total = len(chosen) * len(lengths) * repeats  # timed passes (the warm-up is not counted)
            what = f"timing {len(chosen)} views of {loaded.name} x {len(lengths)} lengths, context {ctx}"
            with Progress(*Progress.get_default_columns(), console=err, transient=True) as bar:
                task = bar.add_task(what, total=total)
                seconds = measure_views(
                    loaded.model,
                    chosen,
                    lengths,
                    ids,
                    prefix=ctx,
                    repeats=repeats,
                    keep=rows,
                    on_step=lambda: bar.advance(task),  # noqa: B023 (used within this iteration only)
                    drafter=role == "drafter",
                    base=chosen.get("gguf") if is_stored(loaded.model) else None,
                )
            out.append({"role": role, "model": loaded.name, "context": ctx, "views": seconds})
        return out

    found = tables(engine.target, "target", _list(views, str, "--views"), keep)
    if drafter_views:
        if drafter_shape is not None:
            small = random_loaded(drafter_shape)
            record["weights"]["drafter"] = RANDOM_WEIGHTS
        else:
            small = engine.drafter
            record["weights"]["drafter"] = "as loaded"
        found += tables(small, "drafter", _list(drafter_views, str, "--drafter-views"), 1)
    if head:
        found += _head_tables(err, engine, shape is not None, lengths, contexts, repeats, record)
    return found


def _head_tables(
    err: Any, engine: Any, random_weights: bool, lengths: list[int], contexts: list[int], repeats: int, record: Any
) -> list[dict[str, Any]]:
    """The target's draft head as a drafter (view `head`), per context: one proposal after n folded tokens, as `via`
    and `sd` draft with it, on the target as it runs by default (a stored file's own blocks)."""
    import random

    import torch

    from viasd.calibration.costs import median_timings
    from viasd.calibration.head_drafts import HeadTimer
    from viasd.drafters.head import HeadDrafter
    from viasd.heads.attention import AttentionHead
    from viasd.heads.find import find_head
    from viasd.heads.network import DraftHead, HeadConfig

    loaded = engine.target
    model = loaded.model
    drafting: DraftHead | AttentionHead | None = None
    try:
        drafting = None if random_weights else find_head(model).head
        record["weights"]["head"] = "as found for the target"
    except ViasdError:
        err.print("no draft head for this target: timing a random one of the shipped design (the same work)")
    if drafting is None:  # a step does the same work whatever the weights hold
        vocab = min(HeadConfig.vocab, int(model.config.vocab_size))
        config = HeadConfig(hidden=int(model.config.hidden_size), vocab=vocab)
        drafting = DraftHead(config, torch.arange(config.vocab)).to(next(model.parameters()).device)
        record["weights"]["head"] = RANDOM_WEIGHTS
    view = engine.quantized(loaded, engine.target_recipe())
    vocab = int(model.config.vocab_size)
    out = []
    for ctx in contexts:
        ids = [random.Random(0).randrange(vocab) for _ in range(ctx + max(lengths))]
        with err.status(f"timing the draft head of {loaded.name} x {len(lengths)} lengths, context {ctx}"):
            step = HeadTimer(HeadDrafter(drafting, model), model, ids[:ctx], ids[ctx:], view).drafter_step
            medians = median_timings([("head", n) for n in lengths], lambda _, n, step=step: step(n), repeats)
        seconds = {"head": [medians[("head", n)] for n in lengths]}
        out.append({"role": "drafter", "model": f"{loaded.name} head", "context": ctx, "views": seconds})
    return out


def _agreement_sequences(engine: Any, loaded: Any, count: int) -> list[tuple[list[int], int]]:
    """(ids, start) of the first `count` built-in prompts with the model's own greedy continuation of 48 tokens;
    scored from the prediction of the first generated token on."""
    from viasd.calibration.prompts import CALIBRATION_PROMPTS, HELD_OUT_PROMPTS
    from viasd.decode.base import GenerationConfig
    from viasd.decode.plain import PlainDecoder
    from viasd.prompting import encode_prompt

    if loaded.tokenizer is None:
        raise ViasdError("--agreement needs a real model (a random --shape has no tokenizer and nothing to agree on)")
    texts = [text for _, text in (*HELD_OUT_PROMPTS, *CALIBRATION_PROMPTS)][:count]
    decoder = PlainDecoder(loaded.model, loaded.tokenizer)
    out = []
    for text in texts:
        ids = encode_prompt(loaded.tokenizer, text)
        tokens = decoder.generate(ids, GenerationConfig(max_new_tokens=48)).tokens
        out.append((ids + tokens[:-1], len(ids) - 1))
    return out
