"""Training a draft head on the target's own conversations, on a CPU, with a time budget, checkpoints and resume.

Each example starts at a position p of a conversation with the target's feature h_p and unrolls the head `depth`
steps, folding in the conversation's tokens x_{p+1}, x_{p+2}, ... as a drafter folds in the tokens it chose (they
agree whenever the drafts are right, which is the case that matters): step d predicts x_{p+d+1}, the token the
target wrote there (greedily, in answers). Loss per step: cross-entropy over the head's vocabulary (requests, which
the target sampled, weigh less than answers), plus a smooth-L1 pull of the head's state towards the target's own
feature at that position (EAGLE's regression term: a dense signal that small data needs). The head's first steps
matter most, as every later draft needs them right: step d weighs 0.8^(d-1). The cross-entropy's label is the
written token (`labels="tokens"`) or, with `labels="distribution"`, the target's own distribution there over the
head's vocabulary, read from its recorded feature through the same output rows (EAGLE's classification loss): the
same top token in greedy answers, plus how the target ranks the others (tokens without a recorded feature keep
their written token).

The attention head (heads/attention.py) trains on whole conversations instead, each unrolled from every answer
position at once (training/attention_unroll.py), with the same losses.

A run is resumable at any point: the checkpoint (head, optimiser, step, seconds spent, random state) is written
atomically every `every` seconds and at the end; a run started again continues from it, with the same settings.
A run holds the checkpoint's lock (a second run on it is refused in one line), and a stop asked by a signal
(stopping.py) ends it after the step in progress, with the checkpoint written.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.nn import functional
from tqdm import tqdm

from viasd.errors import ViasdError
from viasd.fileio import exclusive, write_atomic
from viasd.heads.attention import AttentionHead, AttentionHeadConfig
from viasd.heads.network import DraftHead, HeadConfig
from viasd.kernels.cpu import native_bf16
from viasd.stopping import StopRequest
from viasd.training.attention_unroll import (
    conversation_bounds,
    held_out_measures,
    make_batch,
    unrolled_loss,
)
from viasd.training.attention_unroll import unroll as unroll_conversations
from viasd.training.dataset import TrainingSet
from viasd.training.labels import LABELS


@dataclass(frozen=True)
class TrainSettings:
    """How a head is trained (a resume must use the same)."""

    design: str = "chain"  # or "attention" (heads/attention.py): then `batch` counts conversations
    width: int = 1024
    blocks: int = 1
    vocab: int = 8192
    depth: int = 4
    batch: int = 64
    lr: float = 1e-3
    seed: int = 0
    seconds: float = 3600.0  # the whole training's budget, over all resumes
    steps: int = 0  # the most optimiser steps, over all resumes (0: as many as the time allows)
    labels: str = "tokens"  # LABELS: what a step's cross-entropy aims at (chain head only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def head_vocabulary(data: TrainingSet, size: int, always: set[int]) -> torch.Tensor:
    """The `size` tokens the target wrote most often (and `always`, the turn's stop tokens), by id."""
    counts = torch.bincount(data.tokens, minlength=int(data.tokens.max()) + 1).float()
    for token in always:
        if token < len(counts):
            counts[token] = float("inf")
    size = min(size, int((counts > 0).sum()))
    return torch.sort(torch.topk(counts, size).indices).values


@dataclass
class Examples:
    """The positions examples start from, and lookups over the training set."""

    starts: torch.Tensor  # feature rows whose position has at least two more tokens in its conversation
    row_of: torch.Tensor  # [N] feature row of each token position, -1 where none
    end_of: torch.Tensor  # [N] the end (exclusive) of each position's conversation
    label_of: torch.Tensor  # [V_full] index in the head's vocabulary, -1 outside it


def examples(data: TrainingSet, token_ids: torch.Tensor, rows: torch.Tensor) -> Examples:
    """Examples over the feature rows `rows` of `data` (a split)."""
    n = len(data.tokens)
    row_of = torch.full((n,), -1, dtype=torch.long)
    row_of[data.feature_at] = torch.arange(len(data.feature_at))
    lengths = data.starts[1:] - data.starts[:-1]
    end_of = torch.repeat_interleave(data.starts[1:], lengths)
    at = data.feature_at[rows]
    starts = rows[at + 2 < end_of[at]]
    vocab = int(max(int(data.tokens.max()), int(token_ids.max()))) + 1
    label_of = torch.full((vocab,), -1, dtype=torch.long)
    label_of[token_ids] = torch.arange(len(token_ids))
    return Examples(starts, row_of, end_of, label_of)


@dataclass(frozen=True)
class Target:
    """What the head borrows from the target: its embeddings, and its output head's rows of the head's vocabulary."""

    embeddings: torch.Tensor  # [V_full, hidden]
    rows: torch.Tensor  # [vocab, hidden]


@dataclass
class Unrolled:
    """A batch unrolled `depth` steps: the head's logits [depth, B, vocab], the written labels [depth, B] (-1: none),
    the regression loss, and (where asked) the target's logits over the vocabulary [depth, B, vocab] with where they
    are known [depth, B] (the label's position has a recorded feature)."""

    logits: torch.Tensor
    labels: torch.Tensor
    regression: torch.Tensor
    teacher: torch.Tensor | None = None
    taught: torch.Tensor | None = None


def unroll(
    head: DraftHead,
    target: Target,
    data: TrainingSet,
    ex: Examples,
    batch: torch.Tensor,
    depth: int,
    teacher: bool = False,
) -> Unrolled:
    """Unroll the head from the feature rows `batch`, step d predicting the token after position p + d; `teacher`:
    also the target's own logits there (its recorded feature times the same output rows)."""
    at = data.feature_at[batch]
    end = ex.end_of[at]
    state = data.features[batch].float()
    logits, labels, regression = [], [], state.new_zeros(())
    taught, known = [], []
    for d in range(1, depth + 1):
        position = at + d
        inside = position + 1 < end
        token_in = data.tokens[position.clamp(max=len(data.tokens) - 1)]
        state = head.step(state, target.embeddings[token_in].float())
        logits.append(state @ target.rows.T)
        label = ex.label_of[data.tokens[(position + 1).clamp(max=len(data.tokens) - 1)]]
        labels.append(torch.where(inside, label, -1))
        # The feature at p + d is the one the target's head read to choose the token at p + d + 1: the label.
        row = ex.row_of[position.clamp(max=len(data.tokens) - 1)]
        has = inside & (row >= 0)
        if teacher:
            with torch.no_grad():
                taught.append(data.features[row.clamp_min(0)].float() @ target.rows.T)
            known.append(has)
        if bool(has.any()):
            wanted = data.features[row[has]].float()
            regression = regression + functional.smooth_l1_loss(state[has], wanted) * 0.8 ** (d - 1)
    if not teacher:
        return Unrolled(torch.stack(logits), torch.stack(labels), regression)
    return Unrolled(torch.stack(logits), torch.stack(labels), regression, torch.stack(taught), torch.stack(known))


def step_weights(depth: int) -> torch.Tensor:
    return torch.tensor([0.8**d for d in range(depth)])


def loss_of(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher: torch.Tensor | None = None,
    taught: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy per step, weighted by step and by the label's weight (answers 1, requests less): against the
    written token, or where `taught`, against the distribution of the `teacher` logits (softmax over the vocabulary).
    A step's examples without a written label (past their conversation's end) count for nothing either way."""
    depth, b, vocab = logits.shape
    each = functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1).clamp_min(0), reduction="none")
    each = each.reshape(depth, b)
    if teacher is not None and taught is not None:
        soft = -(torch.softmax(teacher.float(), dim=-1) * torch.log_softmax(logits, dim=-1)).sum(-1)
        each = torch.where(taught, soft, each)
    each = each * (labels >= 0) * weights
    per_step = each.sum(dim=1) / (labels >= 0).sum(dim=1).clamp_min(1)
    return (per_step * step_weights(depth)).sum() / step_weights(depth).sum()


@torch.inference_mode()
def evaluate(head: DraftHead, target: Target, data: TrainingSet, ex: Examples, depth: int, limit: int = 4096) -> dict:
    """On held-out examples: top-1 accuracy per step, and the mean length of the run of right drafts from step 1
    (what a greedy chain of `depth` drafts would get accepted, teacher-forced)."""
    starts = ex.starts[:limit]
    right_runs, hits, counts = [], torch.zeros(depth), torch.zeros(depth)
    for chunk in starts.split(512):
        unrolled = unroll(head, target, data, ex, chunk, depth)
        labels = unrolled.labels
        right = (unrolled.logits.argmax(-1) == labels) & (labels >= 0)
        hits += right.sum(1).float()
        counts += (labels >= 0).sum(1).float()
        right_runs.append(right.long().cumprod(0).sum(0).float())
    return {
        "accuracy": [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counts, strict=True)],
        "accepted_per_chain": round(float(torch.cat(right_runs).mean()), 3) if right_runs else 0.0,
        "examples": len(starts),
    }


class Objective(Protocol):
    """What a design trains on: a batch's loss, and what the head measures on held-out conversations."""

    label_of: torch.Tensor
    examples: int  # what one unit of `batch` counts: start positions, or conversations

    def loss(self, head: Any) -> torch.Tensor: ...

    def evaluate(self, head: Any) -> dict: ...


class PositionObjective:
    """The chain head's: unrolls from random feature rows (answers weigh 1, the target's sampled requests 0.3), its
    products in `dtype` (autocast; the head's weights and optimiser stay float32). It measures in float32."""

    def __init__(
        self,
        data: TrainingSet,
        target: Target,
        token_ids: torch.Tensor,
        settings: TrainSettings,
        rows: torch.Tensor,
        held_out: torch.Tensor,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.data, self.target, self.settings = data, target, settings
        self.train = examples(data, token_ids, rows)
        self.held_out = examples(data, token_ids, held_out)
        self.label_of, self.examples = self.train.label_of, len(self.train.starts)
        self.answer_weight = torch.where(data.answer, 1.0, 0.3)
        self.dtype = dtype
        # The frozen output rows in the products' dtype, cast once: autocast would cast them at every step.
        self.computed = Target(target.embeddings, target.rows.to(dtype))

    def loss(self, head: DraftHead) -> torch.Tensor:
        data, depth = self.data, self.settings.depth
        batch = self.train.starts[torch.randint(len(self.train.starts), (self.settings.batch,))]
        teacher = self.settings.labels == "distribution"
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32):
            unrolled = unroll(head, self.computed, data, self.train, batch, depth, teacher)
        at = data.feature_at[batch]
        last = len(data.tokens) - 1
        weights = torch.stack([self.answer_weight[(at + d + 1).clamp(max=last)] for d in range(1, depth + 1)])
        logits = unrolled.logits.float()
        return loss_of(logits, unrolled.labels, weights, unrolled.teacher, unrolled.taught) + unrolled.regression

    def evaluate(self, head: DraftHead) -> dict:
        return evaluate(head, self.target, self.data, self.held_out, self.settings.depth)


class ConversationObjective:
    """The attention head's: whole conversations unrolled at once (training/attention_unroll.py), its products in
    `dtype` (autocast)."""

    def __init__(
        self,
        data: TrainingSet,
        target: Target,
        token_ids: torch.Tensor,
        settings: TrainSettings,
        trained: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.data, self.target, self.settings = data, target, settings
        self.answer_from, self.row_of = conversation_bounds(data)
        self.trained = trained  # conversations [0, trained) train, the rest are held out
        self.label_of = torch.full((target.embeddings.shape[0],), -1, dtype=torch.long)
        self.label_of[token_ids] = torch.arange(len(token_ids))
        self.examples = trained
        self.token_ids = token_ids
        self.dtype = dtype

    def loss(self, head: AttentionHead) -> torch.Tensor:
        chosen = torch.randint(self.trained, (self.settings.batch,)).tolist()
        batch = make_batch(self.data, self.row_of, self.answer_from, chosen, self.settings.depth)
        with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype != torch.float32):
            unrolled = unroll_conversations(head, self.target.embeddings, batch, self.settings.depth)
            loss = unrolled_loss(unrolled, batch, self.target.rows, self.label_of)
        return loss

    @torch.inference_mode()
    def evaluate(self, head: AttentionHead) -> dict:
        held = list(range(self.trained, self.data.conversations))
        return held_out_measures(head, self.target.embeddings, self.target.rows, self.token_ids, self.data, held,
                                 self.answer_from, self.row_of, self.settings.depth)  # fmt: skip


def products_dtype() -> torch.dtype:
    """What a head's training multiplies in: bf16 where the CPU computes it natively (AMX, AVX-512 bf16: a chain
    head's step costs half of float32's), else float32 (emulated bf16 products are slower, not faster)."""
    return torch.bfloat16 if native_bf16() else torch.float32


class Checkpoint:
    """The training state in one file, written atomically, by one run at a time (`held`)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def held(self) -> AbstractContextManager[None]:
        """The checkpoint's lock, held for a block; a one-line ViasdError where another process holds it."""
        return exclusive(
            self.path.with_name(self.path.name + ".lock"),
            lambda by: (
                f"the training checkpoint {self.path} is in use by another viasd train-drafter{by}: wait for "
                "it to end, or give this run another --out"
            ),
        )

    def save(self, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, buffer.getvalue())
        except OSError as error:
            raise ViasdError(f"cannot write the training checkpoint {self.path}: {error.strerror or error}") from None

    def load(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        try:
            return torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception as error:  # a truncated or foreign file: say which, never half-resume
            raise ViasdError(
                f"training checkpoint {self.path} cannot be read ({type(error).__name__}); remove it to start over"
            ) from None


def train(
    data: TrainingSet,
    target_embeddings: torch.Tensor,
    target_head: torch.Tensor,
    settings: TrainSettings,
    checkpoint: Checkpoint,
    always: set[int],
    every: float = 120.0,
    start: DraftHead | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    dtype: torch.dtype | None = None,
    stop: StopRequest | None = None,
) -> tuple[DraftHead | AttentionHead, dict[str, Any]]:
    """Train (or go on training) a head until the budget is spent or `stop` is asked; the head and what the training
    measured (after a stop, no held-out measures: it ends at once, with `stopped_by`).

    `start`: a trained chain head a new attention head begins as (its block and vocabulary). `dtype`: what the
    products run in (default: `products_dtype()`); a resume may change it."""
    with checkpoint.held():
        return _train(data, target_embeddings, target_head, settings, checkpoint, always, every, start, progress, log,
                      dtype, stop)  # fmt: skip


def _train(
    data: TrainingSet,
    target_embeddings: torch.Tensor,
    target_head: torch.Tensor,
    settings: TrainSettings,
    checkpoint: Checkpoint,
    always: set[int],
    every: float,
    start: DraftHead | None,
    progress: bool,
    log: Callable[[str], None],
    dtype: torch.dtype | None,
    stop: StopRequest | None,
) -> tuple[DraftHead | AttentionHead, dict[str, Any]]:
    dtype = dtype or products_dtype()
    torch.manual_seed(settings.seed)
    state = checkpoint.load()
    if settings.labels not in LABELS:
        raise ViasdError(f"labels must be one of {', '.join(LABELS)}, got {settings.labels!r}")
    if settings.design == "attention" and settings.labels != "tokens":
        raise ViasdError("the attention head trains on the written tokens only (labels=tokens)")
    if state is not None:  # checkpoints from before the attention head, and before labels could be distributions
        state["settings"] = {"design": "chain", "labels": "tokens", **state["settings"]}
    if state is not None and state["settings"] != settings.to_dict():
        changed = sorted(k for k, v in settings.to_dict().items() if state["settings"].get(k) != v)
        if set(changed) - {"seconds", "steps"}:  # a budget may grow between runs
            raise ViasdError(
                f"the checkpoint {checkpoint.path} was trained with other settings ({', '.join(changed)}): "
                "train with the same ones, or remove it to start over"
            )
    if state is not None:
        token_ids = state["token_ids"]
    elif start is not None:
        token_ids = start.token_ids
    else:
        token_ids = head_vocabulary(data, settings.vocab, always)
    hidden = data.features.shape[1]
    head: DraftHead | AttentionHead
    if settings.design == "attention":
        head = AttentionHead(AttentionHeadConfig(hidden, width=settings.width, vocab=len(token_ids)), token_ids)
    else:
        head = DraftHead(HeadConfig(hidden, settings.width, settings.blocks, len(token_ids)), token_ids)
    if start is not None and state is None:  # a new attention head begins as this chain head (heads/attention.py)
        if not isinstance(head, AttentionHead) or start.config.blocks != 1 or start.config.width != settings.width:
            raise ViasdError("--start-from takes a chain head of one block of the same --width, for --design attention")
        head.block.load_state_dict(start.blocks[0].state_dict())
    # Fused: one pass over each parameter's state instead of several (a fifth of a bf16 chain step otherwise).
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0, fused=True)
    step, spent = 0, 0.0
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        for group in optimizer.param_groups:  # a checkpoint from before the fused optimiser restores its flags
            group.update(fused=True, foreach=None)
        step, spent = state["step"], state["seconds"]
        torch.set_rng_state(state["rng"])
    target = Target(target_embeddings, target_head[token_ids].float().contiguous())
    conversations = data.conversations
    held_out = max(1, conversations // 20)  # the last 5% of conversations: never trained on
    split = int(data.starts[conversations - held_out])
    rows = torch.arange(len(data.feature_at))
    objective: Objective
    if isinstance(head, AttentionHead):
        objective = ConversationObjective(data, target, token_ids, settings, conversations - held_out, dtype)
    else:
        trained = data.feature_at < split
        objective = PositionObjective(data, target, token_ids, settings, rows[trained], rows[~trained], dtype)
    covered = float((objective.label_of[data.tokens] >= 0).float().mean())
    products = str(dtype).removeprefix("torch.")
    log(f"head: {len(token_ids)} tokens cover {covered:.1%} of the data; {objective.examples} examples; {products}")

    def save() -> None:
        checkpoint.save(
            {
                "settings": settings.to_dict(),
                "head": head.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "seconds": spent,
                "rng": torch.get_rng_state(),
                "token_ids": token_ids,
            }
        )

    bar = tqdm(
        total=round(settings.seconds),
        initial=round(spent),
        unit="s",
        desc="training the head",
        disable=not progress,
        dynamic_ncols=True,
    )
    began, saved = time.monotonic(), time.monotonic()
    try:
        while spent < settings.seconds and not 0 < settings.steps <= step and not stop:
            t0 = time.monotonic()
            fraction = max(spent / settings.seconds, step / settings.steps if settings.steps else 0.0)
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * min(1.0, (step + 1) / 100) * (1.0 - 0.9 * fraction)
            loss = objective.loss(head)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            step += 1
            spent += time.monotonic() - t0
            bar.update(round(spent) - bar.n)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
            if time.monotonic() - saved >= every:
                save()
                saved = time.monotonic()
    finally:
        bar.close()
        save()
    measured: dict[str, Any] = {"stopped_by": stop.name} if stop else objective.evaluate(head)
    measured.update(
        {
            "steps": step,
            "seconds": round(spent),
            "coverage": round(covered, 4),
            "products": products,
            "tokens": len(data.tokens),
            "conversations": conversations,
            "epochs": round(step * settings.batch / max(1, objective.examples), 3),
            "this_run_seconds": round(time.monotonic() - began),
        }
    )
    log(("stopped: " if stop else "held-out: ") + json.dumps(measured))
    return head, measured
