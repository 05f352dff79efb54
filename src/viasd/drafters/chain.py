"""The proposal loop of model-like drafters (a model drafter, a draft head), written once.

Such a drafter scores the next token, picks one, takes a step with it and scores again, up to k tokens or its stop
threshold. What differs between drafters is how they step and what they score (a model over the whole vocabulary,
a head over its own tokens); `draft_chain` does the rest: the penalties and the grammar, the smooth distributions
the gates judge, the pick (greedy, drawn where the scores live, or sampled on the host on a CPU) and the stop rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from viasd.drafters.base import Proposal, stops_after
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


@dataclass(frozen=True)
class ScoredTokens:
    """The tokens a drafter's scores are over: `ids` [n] of a vocabulary of `size` tokens (ids None: the whole
    vocabulary, in order). Distributions are spread over the whole vocabulary, as speculative sampling needs."""

    ids: torch.Tensor | None = None
    size: int = 0

    def spread(self, values: torch.Tensor, fill: float) -> torch.Tensor:
        """Rows over the scored tokens [1, n] as rows over the whole vocabulary [1, size], `fill` elsewhere."""
        if self.ids is None:
            return values
        full = torch.full((values.shape[0], self.size), fill, device=values.device)
        return full.index_copy_(1, self.ids, values)

    def narrow(self, values: torch.Tensor) -> torch.Tensor:
        """Rows over the whole vocabulary [1, size] cut to the scored tokens [1, n]."""
        return values if self.ids is None else values[:, self.ids]

    def token(self, index: torch.Tensor) -> torch.Tensor:
        """The token ids of positions `index` among the scored tokens."""
        return index if self.ids is None else self.ids[index]


WHOLE_VOCABULARY = ScoredTokens()


def draft_chain(
    scores: torch.Tensor,
    advance: Callable[[torch.Tensor], torch.Tensor],
    k: int,
    context: list[int],
    params: SamplingParams,
    generator: torch.Generator,
    stop: float = 0.0,
    source: str = "",
    scored: ScoredTokens = WHOLE_VOCABULARY,
) -> Proposal:
    """Up to k >= 1 drafts after `context`, from `scores` [1, n] (the drafter's over `scored` after the context);
    `advance(token)` takes a step with the picked token [1] and gives the next scores. After a token whose top
    probability (of the smooth distribution the gates and the pre-gate judge) is under `stop`, no step is taken.

    Each token is fed to the next step where it was picked, so the proposal reads the device once: its tokens and
    top probabilities together, at the end (a stop threshold reads each step's top probability, because whether to
    step again depends on it). Greedy drafts are argmaxes and carry no probability rows (they are one-hot).
    """
    on_device = params.on_device(scores.device)
    picked: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    soft: list[torch.Tensor] = []
    for i in range(k):
        if params.adjusts:  # the drafts so far are read where they were picked (a grammar reads them on the host)
            drafts = torch.cat(picked) if picked else ()
            scores = scored.narrow(adjusted(scored.spread(scores, float("-inf")), params, context, drafts))
        soft.append(scored.spread(soft_probs(scores, params), 0.0))
        if params.greedy:
            picked.append(scored.token(greedy_tokens(scores)))
        else:
            probs.append(warp_probs(scored.spread(scores, float("-inf")), params))
            if on_device:
                picked.append(draw(probs[-1], generator))
            else:  # the host path of sampling on a CPU: the draws it always made
                picked.append(torch.tensor([sample(probs[-1][0], generator)], device=scores.device))
        if i + 1 == k or (stop > 0 and stops_after(float(soft[-1].max()), stop)):
            break
        # A draw that found no distribution (BAD_TOKEN) is refused after the read; it must not index first.
        scores = advance(picked[-1].clamp_min(0))
    smooth = torch.cat(soft)
    values, tops = host_values(torch.cat(picked), smooth.max(dim=-1).values)
    tokens = [checked_token(v) for v in values]
    return Proposal(tokens, torch.cat(probs) if probs else None, smooth, source, tops)
