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

`batch_outcomes` decides the blocks of several sequences in one call (each row gives what it would alone);
`block_outcomes` decides one sequence's, a greedy one as a batch of one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from viasd.verify.acceptance import accept_tests, match_width, residual_rows
from viasd.verify.sampling import BAD_TOKEN, SamplingParams, draw, greedy_tokens, warp_probs

STANDS = -2  # the outcome of a draft token that is kept (token ids are >= 0; BAD_TOKEN is -1)


def batch_outcomes(
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    params: SamplingParams | Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """Outcomes [B, k + 1] of the draft blocks of B sequences, decided in one call (as vLLM v1's rejection sampler).

    Row b: drafts `tokens[b, :n]` (on the logits' device), n = lengths[b] (None: every row has k), drawn from
    `draft_probs[b, :n]` ([B, k, V'], None: one-hot, a drafter without distributions; only sampling reads them),
    checked against `logits[b, : n + 1]` ([B, k + 1, V]) by the row's `params` (one for all rows, or one per row)
    and `generators[b]`; its outcomes at positions 0..n are what `block_outcomes` gives it alone, what follows its
    bonus is no outcome. Greedy rows are decided together, with no probability rows; a sampled row is warped and
    drawn from by itself (its nucleus and its draws must not depend on the other rows).
    """
    count, k = tokens.shape
    laws = [params] * count if isinstance(params, SamplingParams) else list(params)
    sizes = [k] * count if lengths is None else list(lengths)
    greedy = [b for b, law in enumerate(laws) if law.greedy]
    if len(greedy) == count:
        return _greedy_outcomes(tokens, logits, sizes)
    outcomes = torch.full((count, k + 1), BAD_TOKEN, dtype=torch.long, device=logits.device)
    if greedy:
        outcomes[greedy] = _greedy_outcomes(tokens[greedy], logits[greedy], [sizes[b] for b in greedy])
    for b, law in enumerate(laws):
        if not law.greedy:
            n = sizes[b]
            drafts = None if draft_probs is None else draft_probs[b, :n]
            outcomes[b, : n + 1] = block_outcomes(tokens[b, :n], drafts, logits[b, : n + 1], law, generators[b])
    return outcomes


def _greedy_outcomes(tokens: torch.Tensor, logits: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """Greedy outcomes [B, k + 1]: a draft stands where it is the verifier's argmax, which replaces it otherwise and
    is the bonus after the last draft (row b's at position sizes[b])."""
    count, k = tokens.shape
    top = greedy_tokens(logits.flatten(0, 1)).view(count, k + 1)
    stands = top[:, :k] == tokens
    if any(n < k for n in sizes):  # a shorter row's bonus is its argmax at its own length
        stands &= torch.arange(k, device=tokens.device) < torch.tensor(sizes, device=tokens.device)[:, None]
    return torch.cat([torch.where(stands, STANDS, top[:, :k]), top[:, k:]], dim=1)


def block_outcomes(
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> torch.Tensor:
    """Outcomes [k + 1] of one sequence's draft `tokens` [k] (on the logits' device) against a verifier's `logits`
    [k + 1, V]; `draft_probs` [k, V'] as `batch_outcomes` reads them. Greedy: a batch of one. Sampled: the accept
    tests, every position's replacement and the bonus, drawn in that order (how `batch_outcomes` decides a sampled
    row)."""
    k = tokens.shape[0]
    if params.greedy:
        return _greedy_outcomes(tokens[None], logits[None], [k])[0]
    q = warp_probs(logits, params)
    p = match_width(draft_probs, logits.shape[-1])
    if p is not None:
        p = p.to(q.device)
    stands = accept_tests(tokens, p, q, generator)
    replacements = draw(residual_rows(q[:k], p, tokens), generator)
    return torch.cat([torch.where(stands, STANDS, replacements), draw(q[k:], generator)])


def first_rejection(outcomes: torch.Tensor) -> torch.Tensor:
    """[kept, next token] of a block verified whole (outcomes [k + 1]; [B, k + 1] gives [B, 2]): the drafts before
    the first outcome that is not STANDS are kept, and that outcome follows them (a replacement, or the bonus token
    when every draft stood)."""
    stands = (outcomes[..., :-1] == STANDS).long()
    kept = stands.cumprod(dim=-1).sum(dim=-1, keepdim=True)
    return torch.cat([kept, outcomes.gather(-1, kept)], dim=-1)


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
