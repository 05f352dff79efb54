"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept, reject, resample.

Given draft tokens x_i drawn from p_i and verifier distributions q_i, token i is kept with
probability min(1, q_i(x_i) / p_i(x_i)); the first rejected position is replaced by a sample from
norm(max(0, q_i - p_i)). The committed tokens then follow q exactly. With one-hot (greedy) p and q
this is exact matching against argmax q.
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


def draft_token_probs(tokens: torch.Tensor, draft_probs: torch.Tensor | None) -> torch.Tensor:
    """p_i(x_i) for each draft token; one-hot proposals (draft_probs None) give 1."""
    if draft_probs is None:
        return torch.ones(len(tokens), dtype=torch.float32)
    return draft_probs.gather(-1, tokens[:, None])[:, 0]


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


def verify_block(
    tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling over a block: `target_probs` has len(tokens) + 1 rows (the last is the bonus)."""
    k = len(tokens)
    assert target_probs.shape[0] == k + 1, "target_probs needs one row per draft token plus the bonus row"
    draft_probs = match_width(draft_probs, target_probs.shape[-1])
    if k:
        idx = torch.tensor(tokens, dtype=torch.long, device=target_probs.device)
        q = target_probs[:k].gather(-1, idx[:, None])[:, 0].cpu()
        p = draft_token_probs(idx.cpu(), None if draft_probs is None else draft_probs.cpu())
        u = torch.rand(k, generator=generator)
        keep = u < accept_probability(q, p)
        rejected_at = int((~keep).nonzero()[0, 0]) if not bool(keep.all()) else k
    else:
        rejected_at = 0
    if rejected_at < k:
        draft_row = None if draft_probs is None else draft_probs[rejected_at].to(target_probs.device)
        law = residual(target_probs[rejected_at], draft_row, tokens[rejected_at])
        return Verdict(rejected_at, sample(law, generator), True)
    return Verdict(k, sample(target_probs[k], generator), False)


def check_token(token: int, draft: torch.Tensor | None, target: torch.Tensor, generator: torch.Generator) -> int | None:
    """Speculative-sampling check of one draft token against one verifier distribution [V].

    Returns None when the token is kept, else the replacement drawn from the residual.
    """
    draft = match_width(draft, target.shape[-1])
    p = 1.0 if draft is None else float(draft[token])
    q = float(target[token])
    u = float(torch.rand((), generator=generator))
    if p > 0 and u < min(1.0, q / p):
        return None
    return sample(residual(target, draft, token), generator)
