"""Drafting with a language model: a small separate model, or a cheaper view of the target itself."""

from __future__ import annotations

import torch
from torch import nn

from viasd.drafters.base import Proposal, stops_after
from viasd.passes.session import KVSession
from viasd.verify.resident import host_values
from viasd.verify.sampling import (
    SamplingParams,
    adjusted,
    checked_token,
    draw,
    greedy_tokens,
    sample,
    soft_probs,
    warp_probs,
)
from viasd.views.view import ViewLike


class ModelDrafter:
    """Autoregressive drafting with its own KV cache, resynchronised to the committed tokens each round.

    Resynchronising by common prefix handles every rollback case: rejected draft tokens are cropped,
    and the verifier's correction or bonus token is fed together with the next round's first step.
    The last draft token of a round is never fed: if it is accepted, the next round feeds it. Rounds in
    which another drafter proposed (a hybrid drafter's copied drafts) are caught up the same way, in one pass.

    Each draft token is fed to the next step where it was picked, so a proposal reads the device once: its
    tokens and their top probabilities together, at the end (a draft stop threshold reads each step's top
    probability, because whether to take another step depends on it). Greedy drafts are argmaxes and carry no
    probability rows (`Proposal.probs` None: they are one-hot).
    """

    def __init__(self, model: nn.Module, view: ViewLike = None, name: str = "model") -> None:
        self.name = name
        self.session = KVSession(model, base_view=view)

    def describe(self) -> str:
        view = self.session.base_view
        return f"{self.name} ({view.describe() if view is not None else 'as loaded'})"

    @property
    def forward_passes(self) -> int:
        return self.session.forward_passes

    @property
    def pass_seconds(self) -> float:
        return self.session.pass_seconds

    @property
    def sessions(self) -> tuple[KVSession, ...]:
        return (self.session,)

    def reset(self, prompt_length: int | None = None, budget: int | None = None) -> None:
        self.session.reset()

    def follow(self, target: KVSession) -> None:
        """A model drafter reads the tokens, not the target's passes."""

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        """Up to k tokens, one drafter step each; after a token whose top probability (of the smooth
        distribution the gates and the pre-gate judge) is under `stop`, no further step is taken."""
        if k <= 0:
            return Proposal([], source=self.name)
        logits = self.session.extend_to(context, keep=1)
        on_device = params.on_device(logits.device)
        picked: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        soft: list[torch.Tensor] = []
        for i in range(k):
            if params.adjusts:  # the drafts so far are read where they were picked (a grammar reads them on the host)
                logits = adjusted(logits, params, context, torch.cat(picked) if picked else ())
            soft.append(soft_probs(logits, params))
            if params.greedy:
                picked.append(greedy_tokens(logits))
            else:
                probs.append(warp_probs(logits, params))
                if on_device:
                    picked.append(draw(probs[-1], generator))
                else:  # the host path of sampling on a CPU: the draws it always made
                    picked.append(torch.tensor([sample(probs[-1][0], generator)], device=logits.device))
            if i + 1 == k or (stop > 0 and stops_after(float(soft[-1].max()), stop)):
                break
            # A draw that found no distribution (BAD_TOKEN) is refused after the read; it must not index first.
            logits = self.session.forward(picked[-1].clamp_min(0), keep=1)
        smooth = torch.cat(soft)
        values, tops = host_values(torch.cat(picked), smooth.max(dim=-1).values)
        tokens = [checked_token(v) for v in values]
        self.session.learn(tokens[:-1])
        return Proposal(tokens, torch.cat(probs) if probs else None, smooth, self.name, tops)
