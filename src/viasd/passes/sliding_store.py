"""Room in a sliding-window cache layer for a pass whose keys and values a C kernel writes (passes/fused.py).

Sliding layers stay transformers' `DynamicSlidingWindowLayer` (sessions crop them by its rules, the prefix cache
reads them: passes/session.py, passes/prefix_cache.py). The kernel takes a store of consecutive positions with room
after them, so a pass copies the positions the layer holds into a new store with room for its own (as the layer's
`update` concatenates them) and the kernel attends over the last `window` of each query's. Once the pass has
succeeded, `commit` makes the store the layer's keys and values, as `update` would have left them; until then the
layer is untouched, so a failed pass leaves it as it was.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer


def room(layer: DynamicSlidingWindowLayer, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[
        tuple[torch.Tensor, torch.Tensor], int]:  # fmt: skip
    """Key and value stores [1, kv_heads, held + M, dim] for a pass of entries of `shape` ([1, kv_heads, M, dim]):
    the layer's held positions, then room for the pass's; and how many it holds (where the pass's go)."""
    held = layer.keys.shape[-2] if layer.is_initialized and layer.keys.numel() else 0
    keys = torch.empty((*shape[:-2], held + shape[-2], shape[-1]), dtype=dtype)
    values = torch.empty_like(keys)
    if held:
        keys[..., :held, :] = layer.keys
        values[..., :held, :] = layer.values
    return (keys, values), held


def commit(layer: DynamicSlidingWindowLayer, stores: tuple[torch.Tensor, torch.Tensor], added: int) -> None:
    """The layer as its `update` with the pass's `added` entries leaves it: `stores` (written by the pass) its keys
    and values, trimmed to the last window - 1 positions unless it records its past for a rollback."""
    keys, values = stores
    if not layer.is_initialized:
        layer.lazy_initialization(keys[..., :0, :], values[..., :0, :])
    layer.cumulative_length += added
    if not layer.record_past:
        keys, values = keys[..., -layer.sliding_window + 1 :, :], values[..., -layer.sliding_window + 1 :, :]
    layer.keys, layer.values = keys, values
