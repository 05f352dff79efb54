"""Drafting with a language model: a small separate model, or a cheaper view of the target itself."""

from __future__ import annotations

import torch
from torch import nn

from viasd.drafters.base import Proposal, stops_after
from viasd.models.session import KVSession
from viasd.models.views import ViewLike
from viasd.verify.sampling import SamplingParams, sample, soft_probs, warp_probs


class ModelDrafter:
    """Autoregressive drafting with its own KV cache, resynchronised to the committed tokens each round.

    Resynchronising by common prefix handles every rollback case: rejected draft tokens are cropped,
    and the verifier's correction or bonus token is fed together with the next round's first step.
    The last draft token of a round is never fed: if it is accepted, the next round feeds it. Rounds in
    which another drafter proposed (a hybrid drafter's copied drafts) are caught up the same way, in one pass.
    """

    def __init__(self, model: nn.Module, view: ViewLike = None, name: str = "model") -> None:
        self.name = name
        self.session = KVSession(model, base_view=view)

    @property
    def forward_passes(self) -> int:
        return self.session.forward_passes

    def reset(self) -> None:
        self.session.reset()

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        """Up to k tokens, one drafter step each; after a token whose top probability (of the smooth
        distribution the gates and the pre-gate judge) is under `stop`, no further step is taken."""
        if k <= 0:
            return Proposal([], source=self.name)
        logits = self.session.extend_to(context, keep=1)[-1]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        soft: list[torch.Tensor] = []
        for i in range(k):
            p = warp_probs(logits[None], params)[0]
            token = sample(p, generator)
            tokens.append(token)
            probs.append(p)
            soft.append(soft_probs(logits[None], params)[0])
            if i + 1 == k or stops_after(float(soft[-1].max()), stop):
                break
            logits = self.session.forward([token], keep=1)[-1]
        return Proposal(tokens, torch.stack(probs), torch.stack(soft), self.name)
