"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept, reject, resample.

Given draft tokens x_i drawn from p_i and verifier distributions q_i, token i is kept with
probability min(1, q_i(x_i) / p_i(x_i)); the first rejected position is replaced by a sample from
norm(max(0, q_i - p_i)). The committed tokens then follow q exactly. With one-hot (greedy) p and q
this is exact matching against argmax q.

The maths is here once (`accept_tests`, `residual_rows`), for both ways of deciding a block: on the host
(`verify_block`, `check_token`: sampling on a CPU, which draws only the replacement it uses) and where the logits
live (verify/resident.py: greedy decoding everywhere, sampling off the CPU, with no host read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from viasd.verify.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying a block: how many draft tokens were kept and the token that follows them."""

    accepted: int
    next_token: int
    rejected: bool  # True when next_token replaces a rejected draft token (False: it is a bonus token)


def residual_rows(target: torch.Tensor, draft: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """norm(max(0, q_i - p_i)) per row of `target` [n, V], without a host sync; a one-hot draft (None) puts row
    i's mass on tokens[i] (a token beyond the row's width takes none of it)."""
    if draft is None:
        inside = tokens < target.shape[-1]
        cut = target.scatter(-1, tokens.clamp(0, target.shape[-1] - 1)[:, None], 0.0)
        out = torch.where(inside[:, None], cut, target)
    else:
        out = (target - draft).clamp_min(0.0)
    total = out.sum(dim=-1, keepdim=True)
    # q <= p everywhere only happens through rounding when q == p; then q itself is the right law.
    return torch.where(total > 0, out / total, target)


def residual(target: torch.Tensor, draft: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(0, q - p)) for one position; a one-hot draft (None) puts its mass on `token`."""
    tokens = torch.tensor([token], dtype=torch.long, device=target.device)
    return residual_rows(target[None], None if draft is None else draft[None], tokens)[0]


def match_width(probs: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """Zero-pad (or cut) distributions to the verifier's logit width: heads may be padded differently."""
    if probs is None or probs.shape[-1] == width:
        return probs
    if probs.shape[-1] > width:
        return probs[..., :width]
    return torch.nn.functional.pad(probs, (0, width - probs.shape[-1]))


def accept_probability(target_p: torch.Tensor, draft_p: torch.Tensor) -> torch.Tensor:
    """min(1, q(x)/p(x)) elementwise, with 0/0 treated as reject."""
    return torch.where(draft_p > 0, (target_p / draft_p.clamp_min(1e-30)).clamp(max=1.0), 0.0)


def accept_tests(
    tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """Which drafts `tokens` [k] pass the accept test, where the rows live (no host read): x_i stands when
    u_i < min(1, q_i(x_i) / p_i(x_i)), one uniform draw u_i each, in order. q_i: row i of `target_probs` [>= k, V];
    p_i: row i of `draft_probs` [k, V] (widths matched: `match_width`; None: one-hot drafts, p_i(x_i) = 1). A token
    beyond the verifier's width never stands. The one accept test of the host and the device paths."""
    k = tokens.shape[0]
    width = target_probs.shape[-1]
    index = tokens.clamp(0, width - 1)[:, None]
    q_x = target_probs[:k].gather(-1, index)[:, 0] * (tokens < width)
    p_x = torch.ones_like(q_x) if draft_probs is None else draft_probs.gather(-1, index)[:, 0]
    return torch.rand(k, generator=generator, device=q_x.device) < accept_probability(q_x, p_x)


def first_rejected(
    tokens: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor, generator: torch.Generator
) -> tuple[int, int | None]:
    """The host path over drafts `tokens` (`accept_tests`' arguments, on the host): how many stand before the first
    that fails its test, and the token that replaces it, drawn from the residual (None: every draft stood). Only
    the replacement that is used is drawn: on a CPU a draw over a whole vocabulary costs about what the test does."""
    if not tokens:
        return 0, None
    index = torch.tensor(tokens, dtype=torch.long, device=target_probs.device)
    draft_probs = None if draft_probs is None else draft_probs.to(target_probs.device)
    stands = accept_tests(index, draft_probs, target_probs, generator)
    if bool(stands.all()):
        return len(tokens), None
    at = int((~stands).nonzero()[0, 0])
    law = residual(target_probs[at], None if draft_probs is None else draft_probs[at], tokens[at])
    return at, sample(law, generator)


def verify_block(
    tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling over a block on the host: `target_probs` has len(tokens) + 1 rows (the last is the
    bonus)."""
    k = len(tokens)
    assert target_probs.shape[0] == k + 1, "target_probs needs one row per draft token plus the bonus row"
    draft_probs = match_width(draft_probs, target_probs.shape[-1])
    kept, replacement = first_rejected(tokens, draft_probs, target_probs, generator)
    if replacement is not None:
        return Verdict(kept, replacement, True)
    return Verdict(k, sample(target_probs[k], generator), False)


def check_token(token: int, draft: torch.Tensor | None, target: torch.Tensor, generator: torch.Generator) -> int | None:
    """Speculative-sampling check of one draft token against one verifier distribution [V], on the host.

    Returns None when the token is kept, else the replacement drawn from the residual.
    """
    draft = match_width(draft, target.shape[-1])
    return first_rejected([token], None if draft is None else draft[None], target[None], generator)[1]
