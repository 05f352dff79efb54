"""Teacher forcing for the mask search and the gate statistics: every model's predictions over fixed tokens.

The full target runs once over a token sequence (its logits and its KV cache are kept). A slim view is
then scored over the same tokens the way the tiered decoder uses it (docs/design.md, "Caches"): the
slim verifier attends to the full target's KV for every position the target has processed (the
frontier) and to its own entries beyond it. Under teacher forcing the frontier advances in steps of
`chunk` tokens: positions [start, N) are cut into chunks, and a position in the chunk that starts at `a`
attends to the full target's KV for [0, a) and to the slim view's own KV for [a, itself]. A chunk of
about one draft block plus some catch-up (8 tokens) mirrors decoding; a chunk >= N - start is the
plainest reading (the slim view runs alone after the prompt).

With sdpa or eager attention one forward pass does every chunk at once: the sequence's tokens are fed
again after the full cache, at their real positions, under a custom 4D attention mask. Other attention
kernels (flash attention) take one pass per chunk, which gives the same numbers more slowly.

Every pass asks the route (passes/route.py) for its stack, as a session's does, from the facts of its cache, view and
mask (passes/facts.py): viasd's loop does not run on a teacher's cache (snapshots are restored by reference, which
the loop's in-place writes would break), and every position is the view's (no prompt read by the model's own
weights), so the route gives the model's own forward, in one leg.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from viasd.errors import ViasdError
from viasd.passes.facts import gather
from viasd.passes.features import head_inputs
from viasd.passes.loop import leg_pass
from viasd.passes.route import decide
from viasd.views.view import View, ViewLike, applied, as_view

# Attention implementations that take a custom additive 4D mask as is.
_MASKABLE = ("sdpa", "eager")


@dataclass
class TeacherSequence:
    """A token sequence with the full target's pass over it.

    `start` is the first position whose prediction is scored (the first generated token: the prompt is
    prefilled by the full target in decoding, the slim verifier never processes it). `full_logits` holds
    the target's float32 logits at positions start..N-1 (on the CPU); `cache` its KV over all N positions;
    `features` the rows its output head read at positions start - 1..N-1 (float32, CPU), which a draft head drafts
    from (the prompt's last row included: decoding's first round drafts from it).
    """

    ids: list[int]
    start: int
    full_logits: torch.Tensor
    cache: DynamicCache
    features: torch.Tensor | None = None

    @property
    def scored(self) -> int:
        """Number of scored positions."""
        return len(self.ids) - self.start


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _pass(
    model: nn.Module,
    view: View | None,
    cache: DynamicCache | None,
    ids: Sequence[int],
    keep: int,
    **mask: torch.Tensor,
) -> torch.Tensor:
    """float32 logits [keep, V] (CPU) of one pass of `model` as `view` (applied by the caller) over `ids` after
    `cache` (None: none kept), by the route's stack; `mask`: the pass's own attention mask and positions."""
    # Not by viasd's loop: a teacher's cache is restored from snapshots that hold its tensors by reference, and the
    # loop writes its layers' entries in place. Every position is the view's, as calibration has always read it.
    facts = gather(model, cache, view, covered=False, own_weights=False, masked=bool(mask))
    (leg,) = decide(len(ids), keep, facts).legs  # no batcher and no own weights: one leg
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=_device(model))
    return leg_pass(model, input_ids, cache, leg, **mask)[0].float().cpu()


def model_logits(model: nn.Module, ids: Sequence[int], start: int) -> torch.Tensor:
    """float32 logits [N - start, V] of a plain forward pass at positions start..N-1 (CPU)."""
    if not 0 <= start < len(ids):
        raise ViasdError(f"teacher forcing: start {start} outside a sequence of {len(ids)} tokens")
    with torch.inference_mode():
        return _pass(model, None, None, ids, len(ids) - start)


def teacher_force(model: nn.Module, ids: Sequence[int], start: int, view: ViewLike = None) -> TeacherSequence:
    """The full target's pass (as `view`, None: as loaded) over `ids`: logits from `start` on, the features from
    `start` - 1 on, and the KV cache of every position."""
    if not 0 < start < len(ids):
        raise ViasdError(f"teacher forcing: start {start} must be inside the sequence (1..{len(ids) - 1})")
    cache = DynamicCache(config=model.config)
    view = as_view(view)
    with torch.inference_mode(), applied(model, view), head_inputs(model) as seen:
        logits = _pass(model, view, cache, ids, len(ids) - start + 1)
    features = torch.cat(seen).float().cpu() if seen else None
    if features is not None and features.shape[0] != logits.shape[0]:
        features = None  # a route that read its rows in pieces the hook did not see whole: no features
    return TeacherSequence(list(ids), start, logits[1:], cache, features)


def _snapshot(cache: DynamicCache) -> tuple[list[Any], list[dict[str, Any]]]:
    """The cache's layer list and each layer's attributes (tensors by reference: updates replace them)."""
    return list(cache.layers), [dict(vars(layer)) for layer in cache.layers]


def _restore(cache: DynamicCache, snap: tuple[list[Any], list[dict[str, Any]]]) -> None:
    layers, states = snap
    cache.layers = list(layers)
    for layer, state in zip(layers, states, strict=True):
        vars(layer).clear()
        vars(layer).update(state)


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer (the layer's own crop keeps its bookkeeping right)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


def frontier_mask(n: int, start: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [1, 1, M, N + M] for re-feeding positions start..N-1 after a cache of N.

    Query i (real position t = start + i, chunk start a) may see cached keys [0, a) and re-fed keys of
    real positions [a, t]. Pure function; exposed for tests.
    """
    pos = torch.arange(start, n)
    chunk_start = start + ((pos - start) // chunk) * chunk
    see_full = torch.arange(n)[None, :] < chunk_start[:, None]
    see_slim = (pos[None, :] >= chunk_start[:, None]) & (pos[None, :] <= pos[:, None])
    allowed = torch.cat([see_full, see_slim], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def slim_logits(
    model: nn.Module, view: ViewLike, seq: TeacherSequence, chunk: int = 8, batched: bool | None = None
) -> torch.Tensor:
    """float32 logits [N - start, V] of `model` as `view` at positions start..N-1, with the frontier
    advancing every `chunk` tokens (see the module docstring). The sequence's cache is left as it was.

    `batched`: one pass with a 4D mask (True) or one pass per chunk (False); None picks by attention kernel.
    """
    if chunk < 1:
        raise ViasdError(f"teacher forcing: chunk must be >= 1, got {chunk}")
    n, m, device = len(seq.ids), seq.scored, _device(model)
    view = as_view(view)
    snap = _snapshot(seq.cache)
    try:
        with torch.inference_mode(), applied(model, view):
            if batched is None:
                batched = model.config._attn_implementation in _MASKABLE
            if batched:
                return _pass(
                    model, view, seq.cache, seq.ids[seq.start :], m,
                    position_ids=torch.arange(seq.start, n, device=device)[None],
                    attention_mask=frontier_mask(n, seq.start, chunk, _dtype(model)).to(device),
                )  # fmt: skip
            pieces = []
            for a in range(seq.start, n, chunk):
                _restore(seq.cache, snap)
                _crop(seq.cache, a)
                ids = seq.ids[a : min(a + chunk, n)]
                pieces.append(_pass(model, view, seq.cache, ids, len(ids)))
            return torch.cat(pieces)
    finally:
        _restore(seq.cache, snap)


def view_agreement(
    model: nn.Module, views: dict[str, ViewLike], sequences: Sequence[tuple[Sequence[int], int]]
) -> dict[str, tuple[int, int]]:
    """Per view, how many of the teacher-forced positions its top token equals the model's: (agreeing, positions).

    Each sequence is (token ids, start); positions start..N-1 are scored. The view runs the whole sequence
    itself (as a quantized model or a drafter does), so this measures the view as a model of its own.
    """
    totals = {name: [0, 0] for name in views}
    for ids, start in sequences:
        reference = model_logits(model, ids, start).argmax(dim=-1)
        for name, view in views.items():
            with applied(model, view):
                top = model_logits(model, ids, start).argmax(dim=-1)
            totals[name][0] += int((top == reference).sum())
            totals[name][1] += int(reference.numel())
    return {name: (agree, n) for name, (agree, n) in totals.items()}
