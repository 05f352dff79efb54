"""`viasd train-drafter`: write the target's own training data, then train its draft head, both resumable and
bounded in time. Registered in cli.py; heavy imports happen inside the command.

The data is the target's, in viasd's cache, written by one run at a time (its folder's lock); the checkpoint is the
head's: beside --out where the head goes there, else in the cache, trained by one run at a time (its lock). SIGINT
and SIGTERM alike end the step in progress and save: the finished conversations, the checkpoint, and the head as
trained so far; the same command then goes on from them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from viasd.cli_options import TargetOpt, engine_spec
from viasd.errors import ViasdError
from viasd.models.catalog import DEFAULT_TARGET
from viasd.training.labels import LABELS

MAX_REQUEST, MAX_ANSWER = 64, 256  # tokens of a written request and of its answer
DESIGNS = ("chain", "attention")
TASK_WEIGHT = 3  # how many times the calibration tasks' conversations count in training (they are few)


def train_drafter(
    target: TargetOpt = DEFAULT_TARGET,
    data_minutes: Annotated[
        float, typer.Option(help="Time for writing training data (resumes where it stopped).")
    ] = 60,
    train_minutes: Annotated[float, typer.Option(help="Time for training, over all runs of this training.")] = 60,
    tokens: Annotated[int, typer.Option(help="Stop writing data once it holds this many tokens.")] = 400_000,
    quant: Annotated[
        str | None,
        typer.Option(
            help="The target's view that writes the data (default: gguf for a GGUF model, else int4a8; none: the "
            "dense weights)."
        ),
    ] = None,
    rows: Annotated[int, typer.Option(help="Conversations written at once (one pass serves them all).")] = 16,
    design: Annotated[
        str,
        typer.Option(
            help="The head's design: chain (drafts from the last feature) or attention (the chain head's step plus an "
            "attention over the sequence's entries)."
        ),
    ] = "chain",
    labels: Annotated[
        str,
        typer.Option(
            help="What the chain head learns to predict: tokens (the target's written tokens) or distribution (the "
            "target's own distribution over the head's vocabulary, where its feature is recorded)."
        ),
    ] = "tokens",
    width: Annotated[int, typer.Option(help="The width of the head's residual block.")] = 1024,
    vocab: Annotated[int, typer.Option(help="Tokens the head can draft (the target's most written).")] = 8192,
    depth: Annotated[int, typer.Option(help="Draft steps unrolled in training.")] = 4,
    seed: Annotated[int, typer.Option(help="Seed of the data and the training.")] = 0,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where to write the head (default: viasd's cache, found there); its checkpoint goes beside it, "
            "NAME.checkpoint.pt."
        ),
    ] = None,
    tasks: Annotated[
        bool,
        typer.Option(
            help="Also answer the benchmark's calibration-split tasks (never its report split) and train on those "
            "conversations too: requests of the kinds and lengths people bring."
        ),
    ] = False,
    start_from: Annotated[
        Path | None,
        typer.Option(
            help="Start a new attention head from this chain head of the target (its block and vocabulary) instead "
            "of from scratch."
        ),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Train a draft head for the target on this machine: data the target writes itself, then the head."""
    for name, value in (("--rows", rows), ("--width", width), ("--vocab", vocab), ("--depth", depth)):
        if value < 1:
            raise ViasdError(f"{name} must be >= 1, got {value}")
    if design not in DESIGNS:
        raise ViasdError(f"--design must be one of {', '.join(DESIGNS)}, got {design!r}")
    if labels not in LABELS:
        raise ViasdError(f"--labels must be one of {', '.join(LABELS)}, got {labels!r}")
    if design == "attention" and labels != "tokens":
        raise ViasdError("--labels distribution trains the chain head only; the attention head learns the tokens")
    if data_minutes < 0 or train_minutes < 0 or tokens < 0:
        raise ViasdError("--data-minutes, --train-minutes and --tokens must be >= 0")
    spec = engine_spec(target, target, quant=quant)

    import torch

    from viasd.cache import cache_folder
    from viasd.engine import Engine
    from viasd.heads.file import save_head
    from viasd.heads.find import trained_head_path
    from viasd.models.fingerprint import model_fingerprint
    from viasd.models.loading import vocabulary_fingerprint
    from viasd.stopping import Stopped, deferred_stop
    from viasd.training.dataset import DataFolder, joined
    from viasd.training.prompts import task_openers
    from viasd.training.train import Checkpoint, TrainSettings, train
    from viasd.training.writing import write_data
    from viasd.views.gguf import source_gguf
    from viasd.views.recipe import DENSE, QuantRecipe

    engine = Engine(spec)
    loaded = engine.target
    # The view that writes the data: --quant's recipe; `none`: the dense weights; by default the file's own (a
    # GGUF file's gguf view), else int4a8, the fast kernels' view (the head drafts for the target as run).
    if isinstance(spec.quant, QuantRecipe):
        recipe: QuantRecipe | None = spec.quant
    elif spec.quant == DENSE:
        recipe = None
    else:
        recipe = QuantRecipe.parse("gguf" if source_gguf(loaded.name, loaded.path) else "int4a8")
    view = engine.quantized(loaded, recipe)
    view_name = recipe.name if recipe is not None else DENSE
    fingerprint = model_fingerprint(loaded.model)
    home = cache_folder("heads") / fingerprint
    folder = DataFolder(
        home / "data", {"view": view_name, "seed": seed, "max_request": MAX_REQUEST, "max_answer": MAX_ANSWER}
    )
    task_folder = DataFolder(home / "data-tasks", {"view": view_name, "max_answer": MAX_ANSWER}) if tasks else None
    with deferred_stop() as stop:  # the first SIGINT or SIGTERM: save at a whole step, then stop
        began = time.monotonic()
        if task_folder is not None:  # first: they are few, and the data's time budget covers both
            requests = task_openers()
            held = write_data(
                loaded.model, loaded.tokenizer, view, task_folder, data_minutes * 60, 1 << 62, rows, seed,
                MAX_REQUEST, MAX_ANSWER, progress, source=requests, stop=stop,
            )  # fmt: skip
            typer.echo(f"calibration tasks: {task_folder.conversations()} of {len(requests)} answered, {held} tokens")
        held = write_data(
            loaded.model, loaded.tokenizer, view, folder, max(0.0, data_minutes * 60 - (time.monotonic() - began)),
            tokens, rows, seed, MAX_REQUEST, MAX_ANSWER, progress, stop=stop,
        )  # fmt: skip
        typer.echo(f"training data: {held} tokens in {folder.path}")
        if stop:
            typer.echo(f"stopped by {stop.name}: the finished conversations are kept; the same command goes on")
            raise Stopped(stop.signum)
        if train_minutes == 0:
            return  # data only: a later run trains (and may write more data first)
        data = folder.load()
        if task_folder is not None and task_folder.shards():
            # The target's own conversations last: training holds out the last 5% of conversations, theirs.
            data = joined([task_folder.load()] * TASK_WEIGHT + [data])
        # Attention: `batch` counts conversations; a head that starts from a trained chain head moves more gently.
        shape = {"batch": 8, "lr": 2e-4 if start_from else 6e-4} if design == "attention" else {}
        settings = TrainSettings(
            design=design,
            width=width,
            vocab=vocab,
            depth=depth,
            seed=seed,
            seconds=train_minutes * 60,
            labels=labels,
            **shape,
        )
        stops = {
            int(t)
            for t in (loaded.tokenizer.eos_token_id, loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"))
            if isinstance(t, int)
        }
        model = loaded.model
        start, started_from = None, None
        if start_from is not None:
            from viasd.heads.find import find_head
            from viasd.heads.network import DraftHead

            found = find_head(model, start_from)
            if not isinstance(found.head, DraftHead):
                raise ViasdError(f"--start-from needs a chain head; {start_from} holds an attention head")
            start, started_from = found.head, found.digest
        head, measured = train(
            data,
            model.get_input_embeddings().weight.detach(),
            model.get_output_embeddings().weight.detach(),
            settings,
            Checkpoint(checkpoint_path(home, out, design, started_from)),
            stops,
            progress=progress,
            log=typer.echo,
            start=start,
            stop=stop,
        )
        if stop and not measured["steps"]:  # nothing trained: a head written now would replace one for nothing
            typer.echo(f"stopped by {stop.name} before the first training step: no head written")
            raise Stopped(stop.signum)
        path = out or trained_head_path(fingerprint)
        info = {**settings.to_dict(), **measured, "data_view": view_name}
        save_head(path, head.to(torch.bfloat16), fingerprint, vocabulary_fingerprint(loaded.tokenizer), info)
        typer.echo(f"draft head written to {path}: use it with --method sd:drafter=head")
        if stop:
            typer.echo(
                f"stopped by {stop.name}: the checkpoint and the head so far are saved; the same command goes on"
            )
            raise Stopped(stop.signum)


def checkpoint_path(home: Path, out: Path | None, design: str, started_from: str | None = None) -> Path:
    """Where a head's training checkpoint goes: beside `out` (NAME.checkpoint.pt) where the head goes there, so that
    each head has its own, else in the target's folder of the cache; one per design, and for an attention head
    started from a chain head, one per chain head (`started_from`: its digest)."""
    name = "checkpoint" if design == "chain" else f"checkpoint-{design}"
    if started_from is not None:
        name += f"-from-{started_from[:12]}"
    return home / f"{name}.pt" if out is None else out.with_name(f"{out.stem}.{name}.pt")
