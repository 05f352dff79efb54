"""The target's log-probabilities of committed tokens: the raw distribution of the pass that verified each one.

As vLLM reports them by default: log_softmax of the target's logits before temperature, top-p/top-k, min-p,
penalties or logit_bias, so that the numbers describe the model and not the request's sampling. Exact methods
read them from the rows of the target pass that checked each token, so every exact method reports the same
numbers as plain decoding; tokens the full target never checked (via's accept and slim tiers) get none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target and the `top` most likely tokens of that same distribution,
    most likely first. logprob None: the full target never checked this token (a relaxed tier committed it)."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row i of `logits` [>= len(tokens), V] is the target's distribution for tokens[i]: each token's log-probability
    and the `top` (0 or more) most likely tokens, from log_softmax in float64."""
    if not tokens:
        return []
    rows = torch.log_softmax(logits[: len(tokens)].to("cpu", torch.float64), dim=-1)
    ids = torch.tensor(list(tokens), dtype=torch.long)
    chosen = rows.gather(1, ids[:, None])[:, 0].tolist()
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen, strict=True)]
    values, indices = torch.topk(rows, min(top, rows.shape[-1]), dim=-1)
    return [
        TokenLogprob(t, lp, tuple(zip(i, v, strict=True)))
        for t, lp, i, v in zip(tokens, chosen, indices.tolist(), values.tolist(), strict=True)
    ]


def unchecked(tokens: Sequence[int]) -> list[TokenLogprob]:
    """Entries for tokens committed without the full target: no number is made up for them."""
    return [TokenLogprob(t, None) for t in tokens]
