"""Drafting with a language model: a small separate model, or a cheaper view of the target itself."""

from __future__ import annotations

import torch
from torch import nn

from viasd.drafters.base import Proposal, SessionCounts
from viasd.drafters.chain import draft_chain
from viasd.passes.session import KVSession
from viasd.verify.sampling import SamplingParams
from viasd.views.view import ViewLike


class ModelDrafter(SessionCounts):
    """Autoregressive drafting with its own KV cache, resynchronised to the committed tokens each round.

    Resynchronising by common prefix handles every rollback case: rejected draft tokens are cropped,
    and the verifier's correction or bonus token is fed together with the next round's first step.
    The last draft token of a round is never fed: if it is accepted, the next round feeds it. Rounds in
    which another drafter proposed (a hybrid drafter's copied drafts) are caught up the same way, in one pass.

    Its proposal loop is `drafters.chain.draft_chain`; a step is one pass of its model over the picked token.
    """

    def __init__(self, model: nn.Module, view: ViewLike = None, name: str = "model") -> None:
        self.name = name
        self.session = KVSession(model, base_view=view)

    def describe(self) -> str:
        view = self.session.base_view
        return f"{self.name} ({view.describe() if view is not None else 'as loaded'})"

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
        """Up to k tokens, one drafter step each (`draft_chain`, which also says how `stop` ends it)."""
        if k <= 0:
            return Proposal([], source=self.name)
        first = self.session.extend_to(context, keep=1)
        proposal = draft_chain(
            first,
            lambda token: self.session.forward(token, keep=1),
            k,
            context,
            params,
            generator,
            stop,
            self.name,
        )
        self.session.learn(proposal.tokens[:-1])
        return proposal
