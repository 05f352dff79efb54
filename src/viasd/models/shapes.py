"""Randomly initialised models of named real shapes, for timing: a pass costs the same whatever the weights.

The shapes are the published configurations of well-known models (layers, widths, heads, vocabulary); the
weights are drawn on the device, so no checkpoint is needed. A shape that does not fit the device is refused
with the memory it needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from viasd.errors import ViasdError

# model_type and the config fields that decide a pass's cost (from each model's published config.json).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064),
    "qwen2.5-32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
    "gemma2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                      sliding_window=4096, query_pre_attn_scalar=256),
    "gemma2-27b": dict(model_type="gemma2", hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=256000,
                       sliding_window=4096, query_pre_attn_scalar=144),
}  # fmt: skip


def shape_config(name: str) -> Any:
    """The transformers config of a named shape."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ViasdError(f"unknown model shape {name!r}; choose one of: {', '.join(SHAPES)}")
    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, max_position_embeddings=8192, **fields)


def parameter_count(config: Any) -> int:
    """Parameters of a decoder-only model of this config (embeddings, attention, MLP, norms, head)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    embeddings = config.vocab_size * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return layers * per_layer + embeddings + h


def free_memory(device: torch.device) -> int:
    """Bytes a new model may use on `device`."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def random_model(name: str, device: str, dtype: torch.dtype) -> nn.Module:
    """A model of shape `name` with random weights made on `device` (refused when it would not fit)."""
    from transformers import AutoModelForCausalLM

    config = shape_config(name)
    target = torch.device(device)
    need = parameter_count(config) * torch.finfo(dtype).bits // 8
    available = free_memory(target)
    if need > 0.9 * available:
        raise ViasdError(
            f"shape {name} needs about {need / 2**30:.1f} GiB for its weights in {str(dtype).removeprefix('torch.')}; "
            f"{target} has {available / 2**30:.1f} GiB free"
        )
    with target:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
