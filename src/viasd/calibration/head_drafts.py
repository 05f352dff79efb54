"""A draft head as a calibration drafter: what it would draft at every position of a teacher-forced sequence, as a
round's first, second, ... draft, from the target's own features.

In decoding a round's first draft comes from the latest feature the target computed (the row that predicted the last
checked token) with the token after it folded in; its i-th draft (depth i + 1) from the chain continued over the
earlier drafts. Along a teacher-forced sequence the drafts that matter are the target's own tokens (a round commits
drafts only while they are right), so the depth-d prediction at position t is the chain that starts at the feature of
t - d (no earlier than the prompt's last row, which decoding's first round starts from) and folds in the sequence's
tokens up to t. The scores cover the head's vocabulary and the tokens the context has shown so far that it lacks,
as the drafter scores them (drafters/context_vocabulary.py); every other token has probability zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from viasd.calibration.costs import GREEDY, wait_for
from viasd.calibration.teacher import TeacherSequence
from viasd.drafters.head import CATCH_UP, HeadDrafter
from viasd.errors import ViasdError
from viasd.heads.attention import AttentionHead
from viasd.heads.network import DraftHead
from viasd.models.fingerprint import model_fingerprint
from viasd.models.stored import OutputRows
from viasd.passes.session import KVSession
from viasd.views.view import ViewLike

HEAD = "head"  # the drafter candidate that is the target's draft head


def chain_states(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    embed: Callable[[torch.Tensor], torch.Tensor],
    features: torch.Tensor,
    ids: torch.Tensor,
    start: int,
    depth: int,
) -> torch.Tensor:
    """States [N - start, hidden] of the chains of `depth` steps that predict the tokens after positions start..N-1.

    features: rows of positions start - 1..N-1; ids: the sequence's tokens [N]; step(state, embedded) a head step;
    embed(tokens) the target's embeddings. A chain whose origin would lie before start - 1 starts there, shorter."""
    n = ids.shape[0]
    positions = torch.arange(start, n)
    origin = (positions - depth).clamp_min(start - 1)
    state = features[origin - (start - 1)]
    for e in range(1, depth + 1):
        at = origin + e
        live = at <= positions
        if not bool(live.any()):
            break
        stepped = step(state, embed(ids[at.clamp_max(n - 1)]))
        state = torch.where(live[:, None], stepped, state)
    return state


def context_additions(ids: list[int], own: set[int]) -> tuple[list[int], list[int]]:
    """The tokens of `ids` the head's vocabulary lacks, and the first position each appears at (first-seen order): a
    row scores only those its context has shown (`HeadSource.logits` masks the others)."""
    added: dict[int, int] = {}
    for position, token in enumerate(ids):
        if token not in own and token not in added:
            added[token] = position
    return list(added), list(added.values())


@dataclass
class HeadSource:
    """The draft head as a drafter candidate: its per-depth predictions (`logits`) and its name in records and
    profiles. `drafter` is a HeadDrafter on the target computing in float32 (the decoder's may draft in int8 or bf16:
    the same head, rounded differently)."""

    drafter: HeadDrafter
    head: DraftHead
    target: nn.Module
    digest: str
    depths: int
    view: ViewLike = None  # the target as calibrated, which its features come from
    name: str = HEAD

    @classmethod
    def make(
        cls, target: nn.Module, head: DraftHead | AttentionHead, digest: str, depths: int, view: ViewLike = None
    ) -> HeadSource:
        if isinstance(head, AttentionHead):
            raise ViasdError(
                "calibrating with an attention draft head is not built: its drafts depend on every earlier entry, "
                "which teacher-forced records do not replay; use a chain head (viasd train-drafter --design chain)"
            )
        drafter = HeadDrafter(head, target, compute="float32", vocabulary="context")
        return cls(drafter, head, target, digest, depths, view)

    def identity(self) -> list[Any]:
        """What its records depend on: the target, the head and the depths recorded."""
        return [model_fingerprint(self.target), HEAD, self.digest, self.depths]

    def logits(self, seq: TeacherSequence) -> list[torch.Tensor]:
        """float32 logits [N - start, V] per depth 1..depths (the first for a round's first draft)."""
        if seq.features is None:
            raise ViasdError("a draft head's records need the target's features, which this pass did not record")
        drafter = self.drafter
        vocab = int(self.target.config.vocab_size)  # type: ignore[union-attr]
        ids = torch.tensor(seq.ids, dtype=torch.long)
        own_ids = drafter.head.token_ids.cpu()
        rows = drafter.rows
        assert isinstance(rows, torch.Tensor)
        added, first = context_additions(seq.ids, set(own_ids.tolist()))
        positions = torch.arange(seq.start, len(seq.ids))
        output = OutputRows(self.target)
        extra_rows = output[torch.tensor(added, dtype=torch.long)].float() if added else None
        unseen = torch.tensor(first)[None, :] > positions[:, None] if added else None

        def embed(tokens: torch.Tensor) -> torch.Tensor:
            return drafter.embedded(tokens).float()

        out = []
        with torch.inference_mode():
            features = seq.features.float()
            for depth in range(1, self.depths + 1):
                state = chain_states(drafter.head.step, embed, features, ids, seq.start, depth)
                logits = torch.full((state.shape[0], vocab), float("-inf"))
                logits[:, own_ids] = (state @ rows.float().T).float()
                if extra_rows is not None and unseen is not None:
                    scores = state @ extra_rows.T
                    logits[:, torch.tensor(added)] = scores.masked_fill(unseen, float("-inf"))
                out.append(logits)
        return out

    def profile_entry(self) -> dict[str, Any]:
        return {"name": HEAD, "head": self.digest}

    def timed(self) -> Callable[[list[int], list[int]], HeadTimer]:
        """What the cost table times: the head drafting on the target's features."""
        return self.timer

    def timer(self, head: list[int], tail: list[int]) -> HeadTimer:
        """A timer of its drafting as `via` drafts with it (computing as the decoder's head does)."""
        return HeadTimer(HeadDrafter(self.head, self.target), self.target, head, tail, self.view)


class HeadTimer:
    """Times the head's drafting as the decoder makes it: a proposal of one draft after n tokens it folds in (the
    tokens since the target's latest feature; at most CATCH_UP, beyond which the head does not draft)."""

    def __init__(self, drafter: HeadDrafter, model: nn.Module, head: list[int], tail: list[int], view: ViewLike):
        self.drafter = drafter
        self.head, self.tail = list(head), list(tail)
        self.session = KVSession(model, base_view=view)
        drafter.follow(self.session)
        self.session.forward(self.head)  # its last row: the feature the first fold starts from
        self.generator = torch.Generator(self.session.device)

    def drafter_step(self, n: int) -> float:
        context = self.head + self.tail[: min(max(n, 1), CATCH_UP)]
        wait_for(self.session.device)
        t0 = time.perf_counter()
        proposal = self.drafter.propose(context, 1, GREEDY, self.generator)
        wait_for(self.session.device)
        elapsed = time.perf_counter() - t0
        if not proposal.tokens:
            raise ViasdError("timing the draft head: it drafted nothing from the target's feature")
        return elapsed
