"""A draft block decided where the logits live: speculative sampling on the device, read by the host once.

On a GPU every host read of a tensor (`int()`, `.item()`, `.tolist()`, a Python `if` on a tensor) waits for all
the work queued before it. The functions here never read a tensor on the host: they turn a verifier's logits
over a draft block into a small tensor of *outcomes* on the logits' device, and the decoders move it to the host
with one `host_values` call per decision (docs/gpu.md counts them per round).

Outcomes of k draft tokens x_i against a verifier's logits [k + 1, V], one per position: for i < k, STANDS when
x_i is kept, else the token that replaces it; at k, the bonus token. Greedy: x_i stands when it is the
verifier's argmax, which also replaces it and gives the bonus; no probability rows are built. Sampling: x_i
stands with probability min(1, q_i(x_i) / p_i(x_i)), a rejected one is replaced by a draw from
norm(max(0, q_i - p_i)), the bonus is a draw from q_k. Every position's accept test and replacement are drawn up
front, independently (the host path draws a replacement only where one is used). A verifier keeps the drafts
before the first outcome that is not STANDS and then commits that outcome, so the committed tokens follow q
exactly as classic speculative sampling does: the draws of later positions are simply not used. The accept test
and the residual are verify/acceptance.py's, which the host path uses too.
"""

from __future__ import annotations

import torch

from viasd.verify.acceptance import accept_tests, match_width, residual_rows
from viasd.verify.sampling import SamplingParams, draw, greedy_tokens, warp_probs

STANDS = -2  # the outcome of a draft token that is kept (token ids are >= 0; BAD_TOKEN is -1)


def block_outcomes(
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> torch.Tensor:
    """Outcomes [k + 1] of draft `tokens` [k] (on the logits' device) against a verifier's `logits` [k + 1, V].

    draft_probs: the distributions [k, V'] the drafts were drawn from (None: one-hot, a drafter without
    distributions); only sampling reads them. A draft token beyond the verifier's width never stands.
    """
    k = tokens.shape[0]
    if params.greedy:
        top = greedy_tokens(logits)
        return torch.cat([torch.where(top[:k] == tokens, STANDS, top[:k]), top[k:]])
    q = warp_probs(logits, params)
    p = match_width(draft_probs, logits.shape[-1])
    if p is not None:
        p = p.to(q.device)
    stands = accept_tests(tokens, p, q, generator)
    replacements = draw(residual_rows(q[:k], p, tokens), generator)
    return torch.cat([torch.where(stands, STANDS, replacements), draw(q[k:], generator)])


def first_rejection(outcomes: torch.Tensor) -> torch.Tensor:
    """[kept, next token] of a block verified whole: the drafts before the first outcome that is not STANDS are
    kept, and that outcome follows them (a replacement, or the bonus token when every draft stood)."""
    stands = (outcomes[:-1] == STANDS).long()
    kept = stands.cumprod(dim=0).sum()
    return torch.stack([kept, outcomes.gather(0, kept[None])[0]])


def host_values(*tensors: torch.Tensor) -> list[list[float]]:
    """Small tensors moved to the host in one transfer (one wait for the device), as lists of numbers.

    They travel as float64 (float32 where the device has no float64), so token ids and counts come back exact.
    """
    kind = torch.float32 if tensors[0].device.type == "mps" else torch.float64
    values = torch.cat([t.reshape(-1).to(kind) for t in tensors]).tolist()
    out, at = [], 0
    for tensor in tensors:
        out.append(values[at : at + tensor.numel()])
        at += tensor.numel()
    return out
