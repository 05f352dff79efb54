"""viasd's own modules for the decoder families it builds from a GGUF file's blocks (qwen2, llama, qwen3).

transformers' model classes import most of torch and transformers with them (torch's compiler and distributed
tensors among them: about 4 s of a 9 s start on a 2-core CPU); a model built from a file needs none of that. These
modules have the names, order and shapes of transformers' (so a fingerprint, a routing profile and a draft head fit
a model either way; tests/test_network.py compares them) and its forward's arithmetic in the same order: the norms,
rotary embedding, projections and attention by torch's sdpa, with short passes' query groups packed
(kernels/packed_attention.py) as a prepared transformers model runs them. viasd's loop and fused stack run most passes
(passes/loop.py); this forward runs the rest (long prompts, teacher-forced masks, layer-skipping views).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from viasd.kernels.attention import rotated
from viasd.kernels.packed_attention import NAME as PACKED
from viasd.kernels.packed_attention import packed_sdpa

FAMILIES = frozenset({"qwen2", "llama", "qwen3"})
ROTARY_TYPES = frozenset({"default", "linear", "llama3", "yarn"})  # frequencies fixed at build (no per-call rope)


def why_not(config: Any) -> str | None:
    """Why these modules cannot stand for transformers' model of `config` (None: they can)."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"they build {', '.join(sorted(FAMILIES))} decoders, not {family}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "they have no sliding-window layers"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"they have no {config.hidden_act} activation"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ROTARY_TYPES or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return f"they have no {rope.get('rope_type')} rotary embedding"
    return None


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32, rounded to the input's dtype before the weight (as transformers')."""

    def __init__(self, size: int, eps: float, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos and sin [batch, M, dim] of positions [batch, M], computed in float32 and returned in x's dtype."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        rope = config.rope_parameters
        if rope.get("rope_type", "default") == "default":
            dim = head_dim(config)
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
            inv_freq, self.attention_scaling = 1.0 / (rope["rope_theta"] ** exponents), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv_freq.float() @ position_ids[:, None, :].float()).transpose(1, 2)
            angles = torch.cat((freqs, freqs), dim=-1)
            cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Attention(nn.Module):
    """A layer's grouped-query attention: q, k, v and o projections (q/k norms per head: Qwen3)."""

    def __init__(self, config: Any, layer_idx: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = head_dim(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_key_value_groups = heads // kv_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=qkv_bias, device=device)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias, device=device)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias, device=device)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=o_bias, device=device)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key = self.q_proj(hidden_states).view(shape), self.k_proj(hidden_states).view(shape)
        if hasattr(self, "q_norm"):
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = (part.unsqueeze(1) for part in position_embeddings)
        query, key = rotated(query, cos, sin), rotated(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        out, _ = packed_sdpa(self, query, key, value, attention_mask, scaling=self.scaling)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), None


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config: Any, device: torch.device | str | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Norm, attention, residual; norm, MLP, residual."""

    def __init__(self, config: Any, layer_idx: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, device)
        self.mlp = MLP(config, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        assert position_embeddings is not None
        attended, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache)
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class Decoder(nn.Module):
    """The token embedding, the decoder layers, the final norm and the rotary embedding."""

    def __init__(self, config: Any, device: torch.device | str | None = None) -> None:
        super().__init__()
        # Its matrix as given, uninitialised (initialising one on the meta device imports torch's compiler: 1 s).
        matrix = torch.empty(config.vocab_size, config.hidden_size, device=device)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=matrix)
        self.layers = nn.ModuleList([DecoderLayer(config, i, device) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.rotary_emb = RotaryEmbedding(config)


@dataclass
class CausalLMOutput:
    """What a pass returns: the logits of its kept positions, and the cache it extended."""

    logits: torch.Tensor
    cache: Any = None


class CausalLM(nn.Module):
    """A decoder with its output head; `forward` as transformers' `...ForCausalLM` takes the arguments viasd passes
    (input ids, a cache, logits_to_keep; a 4-D mask and position ids for teacher forcing)."""

    def __init__(self, config: Any, device: torch.device | str | None = None) -> None:
        super().__init__()
        reason = why_not(config)
        if reason is not None:
            raise ValueError(f"viasd's modules cannot build this model: {reason}")
        config._attn_implementation = PACKED  # what a prepared transformers model attends by (passes/loop.py)
        self.config = config
        self.model = Decoder(config, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device)
        self.generation_config = None

    def get_decoder(self) -> Decoder:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutput:
        if kwargs:
            raise TypeError(f"viasd's model takes no {', '.join(sorted(kwargs))}")
        if attention_mask is not None and attention_mask.dim() != 4:
            raise ValueError("viasd's model takes a 4-D attention mask or none (it pads no batch)")
        if use_cache and cache is None:
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache(config=self.config)
        inner = self.model
        x = inner.embed_tokens(input_ids)
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = (torch.arange(x.shape[1], device=x.device) + past)[None]
        mask = attention_mask if attention_mask is not None else causal_mask(x.shape[1], past, x.device)
        angles = inner.rotary_emb(x, position_ids)
        for layer in inner.layers:
            x = layer(x, attention_mask=mask, position_embeddings=angles, cache=cache)
        x = inner.norm(x)
        kept = x if not logits_to_keep else x[:, -logits_to_keep:, :]
        return CausalLMOutput(self.lm_head(kept), cache if use_cache else None)


def causal_mask(length: int, past: int, device: torch.device) -> torch.Tensor | None:
    """Which cached and new positions each of `length` new tokens after `past` cached ones attends to ([1, 1, length,
    past + length], True: attends), or None where sdpa's own causal flag says it (no past) or nothing is hidden (one
    token): as transformers' sdpa mask builder leaves it."""
    if length == 1 or past == 0:
        return None
    rows = torch.arange(length, device=device)[:, None] + past
    return (torch.arange(past + length, device=device)[None, :] <= rows)[None, None]


def is_own(model: nn.Module) -> bool:
    """Whether `model` is built of these modules (not transformers')."""
    return isinstance(model, CausalLM)


def transformers_model(model: nn.Module) -> nn.Module:
    """transformers' own model of `model`'s weights, for code that needs its classes (their `generate`: the
    hf-assisted baseline); `model` itself where it is one. The weights are shared, not copied: `model` must hold
    them densely (models/stored.py `densify`)."""
    if not is_own(model):
        return model
    import copy

    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    config._attn_implementation = "sdpa"
    with init_empty_weights(include_buffers=False):
        theirs = AutoModelForCausalLM.from_config(config, dtype=model.lm_head.weight.dtype)
    theirs.load_state_dict(model.state_dict(), strict=True, assign=True)
    return theirs.eval()
