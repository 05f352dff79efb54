"""viasd's forward pass: short passes (decoding steps, verification blocks) of Llama-style decoders as one plain loop.

A pass of a model goes one of two ways (passes/route.py decides which, once per pass). The model's own forward
(transformers') is the reference and runs any architecture; prompts, layer-skipping views and architectures this
loop does not cover take it. A pass of up to `PACK_UP_TO` tokens of a covered model (the families of `MIRRORED`, on
a CPU: `covers`; docs/design.md has the table) takes this loop over the model's own modules (its norms, projections
or their quantized copies, rotary embedding and cache layers), without transformers' per-layer plumbing (output
capturing, mask builders, attention lookup, wrappers), which cost a decoding step of the 4-bit target several
milliseconds. In the loop each operation is a kernel of viasd's or that kernel's torch reference (kernels/): the
attention of a bf16 model is kernels/attention.py's kernel, and a bf16 view whose Linear layers are all low-bit runs
its whole decoder stack as one kernel (passes/fused.py).

With the references (float32 and float64 models, or `VIASD_KERNELS=off`) the loop is the model's own arithmetic:
the same torch operations in the same order, so its logits and cache entries are bit-identical to the model's
forward (tested). With the kernels, each kernel keeps its own contract (kernels/): the same result for a token in
any block, and agreement with the reference to the dtype's rounding.

The loop mirrors transformers' layer code, so it names the classes it mirrors (`MIRRORED`): a model whose classes
are others (another architecture, or a transformers release that renamed them) runs its own forward, and says so
once (one line on stderr), rather than silently running slower.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from viasd.kernels.notice import warn_once
from viasd.kernels.packed_attention import NAME as PACKED
from viasd.models import network
from viasd.models.network import is_own
from viasd.passes import fused, layer_loop
from viasd.passes.cache_argument import cache_argument
from viasd.passes.cache_layer import GrowingLayer
from viasd.passes.route import Leg, Stack

# The transformers classes whose forward the loop mirrors, by architecture (checked by name: a release that renames
# or restructures them falls back to the model's own forward with a line saying so, and the bit-identity tests
# catch a change of arithmetic).
MIRRORED = {
    "llama": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    "qwen2": ("Qwen2DecoderLayer", "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm"),
    "qwen3": ("Qwen3DecoderLayer", "Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm"),  # + per-head q/k norms
    "mistral": ("MistralDecoderLayer", "MistralAttention", "MistralMLP", "MistralRMSNorm"),  # + sliding windows
    "phi3": ("Phi3DecoderLayer", "Phi3Attention", "Phi3MLP", "Phi3RMSNorm"),  # q|k|v and gate|up as one projection
    # Gemma 3's text decoder: feed-forward norms, q/k norms, a rotary embedding per layer type, sliding layers
    "gemma3_text": ("Gemma3DecoderLayer", "Gemma3Attention", "Gemma3MLP", "Gemma3RMSNorm"),
}
# viasd's own modules for the families it builds from a file's blocks (models/network.py), mirrored as those are.
OWN = (network.DecoderLayer.__name__, network.Attention.__name__, network.MLP.__name__, network.RMSNorm.__name__)
FEED_FORWARD_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")  # Gemma 3's, besides Llama's two


def rope_parameters(config: object) -> list[dict]:
    """The config's rotary parameters: one set, or one per layer type (Gemma 3: `{layer type: parameters}`)."""
    rope = getattr(config, "rope_parameters", None) or {}
    nested = [value for value in rope.values() if isinstance(value, dict)]
    return nested or [rope]


def per_call_rope(rope_type: str) -> bool:
    """Whether a rotary embedding's frequencies depend on the longest position of the call (as transformers'
    `dynamic_rope_update` picks them): a merged pass computes them per sequence (`rotary`), as its own pass would."""
    return "dynamic" in rope_type or rope_type == "longrope"


def why_not(model: nn.Module) -> str | None:
    """None when the loop computes what `model`'s own forward computes (a CPU model of a family in `MIRRORED`, of
    transformers' own classes, prepared with packed attention: passes/prepare.py; sliding-window layers in the
    cache layers transformers makes for them; any rotary scaling, taken from the model's own rotary embedding);
    else why not."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    classes = MIRRORED.get(model_type or "")
    inner = getattr(model, "model", None)
    if classes is None or inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return f"they cover {' and '.join(MIRRORED)} decoders, not {model_type or type(model).__name__}"
    kinds = set(get_layer_types_and_kwargs(config)[0])  # what transformers makes the cache layers by
    if not kinds <= {"full_attention", "sliding_attention"}:
        return f"they cover full and sliding-window attention, not {', '.join(sorted(kinds))}"
    if any(rope.get("partial_rotary_factor", 1.0) != 1.0 for rope in rope_parameters(config)):
        return "they rotate every dimension of a head, not a part of it (partial_rotary_factor)"
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
        if getattr(config, field, None):
            return f"they have no {field}"
    if getattr(config, "_attn_implementation", None) != PACKED:
        return f"the model attends by {getattr(config, '_attn_implementation', None)!r}, not packed sdpa"
    if is_own(model):  # viasd's own modules (models/network.py): the classes below, for every family
        classes = OWN
    layer_class, attention_class, mlp_class, norm_class = classes
    want = (layer_class, attention_class, mlp_class, norm_class, norm_class)
    for layer in inner.layers:
        parts = (layer, layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm)
        got = tuple(type(part).__name__ for part in parts)
        if got != want:
            return f"its layers are {', '.join(got)}, not the {', '.join(want)} they mirror"
        for owner, names in ((layer.self_attn, ("q_norm", "k_norm")), (layer, FEED_FORWARD_NORMS)):
            extra = [type(getattr(owner, name, None)).__name__ for name in names]
            if extra != ["NoneType"] * 2 and extra != [norm_class] * 2:
                return f"its {' and '.join(names)} are {', '.join(extra)}, not {norm_class}"
    if type(inner.norm).__name__ != norm_class:
        return f"its final norm is {type(inner.norm).__name__}, not {norm_class}"
    return None


COVERS = "_viasd_loop_covers"  # where a prepared model keeps `covers`' verdict (passes/prepare.py)


def covers(model: nn.Module) -> bool:
    """Whether short passes of `model` go through the loop. On a CPU, a model it does not cover is said once.

    A prepared model's verdict was read at load (`remember_covers`): read again while another generation's pass has
    a layer-skipping view applied, its layers' classes would be the view's stand-ins, not the model's."""
    known = model.__dict__.get(COVERS)
    return _covers(model) if known is None else known


def remember_covers(model: nn.Module) -> None:
    """Read `covers`' verdict now, while no view is applied (at load), and keep it on the model for its sessions."""
    model.__dict__[COVERS] = _covers(model)


def _covers(model: nn.Module) -> bool:
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return False  # the loop is for CPUs; GPUs run the model's own forward
    reason = why_not(model)
    if reason is not None:
        warn_once(f"viasd's short passes do not run this model ({reason}): transformers' forward runs them, slower")
    return reason is None


def runs_on(model: nn.Module, cache: DynamicCache) -> bool:
    """Whether passes on `cache` may go through the loop, for a model it `covers` (the pass's length apart: the route
        decides that, passes/route.py): in-place cache layers (sessions make them) or transformers' sliding-window ones
    (passes/window_attention.py), one per decoder layer, and no forward
        hooks on the model (its own forward gives hooks their arguments: the loop has none to give)."""
    if not all(type(layer) in (GrowingLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
        return False
    for module in (model, model.model):  # type: ignore[union-attr]
        if module._forward_hooks or module._forward_pre_hooks:
            return False
    return len(cache.layers) == len(model.model.layers)  # type: ignore[union-attr, arg-type]


@dataclass(frozen=True)
class Segment:
    """One sequence's part of a pass: its cache, its new tokens (a 1-D tensor of ids), and how many of their last
    positions need logits."""

    cache: DynamicCache
    ids: torch.Tensor
    keep: int


def short_pass(
    model: nn.Module,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    keep: int,
    stack: Stack,
    attention_kernel: bool,
    skipped: Sequence[int] = (),
) -> torch.Tensor:
    """Logits [1, keep, vocab] of the last `keep` of `input_ids` [1, M] after the cache's tokens, the cache extended
    by them: what `model(input_ids=..., cache=cache, use_cache=True, logits_to_keep=keep).logits` returns, for a
    model the loop `covers`, a cache it `runs_on` and a pass of up to PACK_UP_TO tokens; `stack` (LOOP or FUSED) and
    `attention_kernel` as the pass's route says (passes/route.py); `skipped`: whole layers the FUSED stack leaves
    out (a slim view's)."""
    return ragged_pass(model, [Segment(cache, input_ids[0], keep)], stack, attention_kernel, skipped)[0][None]


def leg_pass(
    model: nn.Module,
    input_ids: torch.Tensor,
    cache: DynamicCache | None,
    leg: Leg,
    skipped: Sequence[int] = (),
    **inputs: Any,
) -> torch.Tensor:
    """Logits [1, leg.keep, vocab] of one leg of a route run alone, by its stack: this loop (`short_pass`, LOOP or
    FUSED) or the model's own forward on `cache` (None: a pass that keeps no cache); `inputs` (a pass's own attention
    mask and position ids: teacher forcing) go to the model's own forward, the one stack that takes them."""
    if leg.stack is not Stack.MODEL:
        assert cache is not None and not inputs, "the loop runs on a cache, with the masks it builds itself"
        return short_pass(model, input_ids, cache, leg.keep, leg.stack, leg.attention_kernel, skipped)
    kept = cache_argument(model, cache) if cache is not None else {}
    out = model(input_ids=input_ids, use_cache=cache is not None, logits_to_keep=leg.keep, **kept, **inputs)
    return out.logits


Angles = tuple[torch.Tensor, torch.Tensor]  # cos and sin [M, dim]


def rotary(model: nn.Module, x: torch.Tensor, positions: torch.Tensor, starts: Sequence[int]) -> dict[str, Angles]:
    """cos and sin [M, dim] of the pass's positions [1, M] by the model's own rotary embedding (so any scaling its
    config names is applied as its forward applies it), by layer type ("all" where one embedding serves every
    layer; Gemma 3's has one per type); per sequence (rows starts[s] .. starts[s + 1]) where the frequencies
    depend on the call's longest position, one call otherwise (each angle is one product: the same bits in any
    call)."""
    rotary_emb = model.model.rotary_emb  # type: ignore[union-attr]
    kinds = getattr(rotary_emb, "layer_types", None) or [None]
    per_call = any(per_call_rope(rope.get("rope_type", "default")) for rope in rope_parameters(model.config))
    spans = list(itertools.pairwise(starts)) if per_call and len(starts) > 2 else [(0, positions.shape[1])]
    angles = {}
    for kind in kinds:
        extra = () if kind is None else (kind,)
        parts = [rotary_emb(x[:, a:b], positions[:, a:b], *extra) for a, b in spans]
        cos, sin = (parts[0][i][0] if len(parts) == 1 else torch.cat([part[i][0] for part in parts]) for i in (0, 1))
        angles["all" if kind is None else kind] = (cos, sin)
    return angles


def ragged_pass(
    model: nn.Module, segments: Sequence[Segment], stack: Stack, attention_kernel: bool, skipped: Sequence[int] = ()
) -> list[torch.Tensor]:
    """One pass over the new tokens of several sequences, each after its own cache: logits [keep, vocab] per
    segment, each cache extended by its tokens. The products, norms and MLPs run over all rows together, attention
    per sequence over its own cache; every kernel gives a row the same result whatever else is in its pass, so a
    sequence's logits are those of a pass of its own (with the torch references, up to how torch blocks a product
    of more rows). Each segment's cache must be one the loop `runs_on`; the layers run as `stack` (LOOP or FUSED)
    says, attending by the C kernel where `attention_kernel` (LOOP; FUSED always does): the route decided both."""
    inner = model.model  # type: ignore[union-attr]
    starts = [0, *itertools.accumulate(len(segment.ids) for segment in segments)]
    x = inner.embed_tokens(torch.cat([segment.ids for segment in segments])[None])
    positions = torch.cat([
        torch.arange(past, past + len(segment.ids), device=x.device)
        for segment in segments
        for past in [segment.cache.layers[0].get_seq_length()]
    ])[None]  # fmt: skip
    angles = rotary(model, x, positions, starts)
    cos, sin = angles.get("all") or angles.get("full_attention") or angles["sliding_attention"]
    caches = [segment.cache for segment in segments]
    if stack is Stack.FUSED:  # a low-bit bf16 view: all layers in one call
        fused.run_layers(model, x, cos, sin, caches, starts, angles.get("sliding_attention"), skipped)
    else:
        x = layer_loop.run(model, x, cos, sin, caches, starts, attention_kernel, angles.get("sliding_attention"))
    rows = torch.cat([torch.arange(b - segment.keep, b) for segment, b in zip(segments, starts[1:], strict=True)])
    if not len(rows):  # chunks of prompts whose logits nobody needs
        return [x.new_empty((0, 0)) for _ in segments]
    logits = model.lm_head(inner.norm(x[:, rows.to(x.device), :]))[0]  # type: ignore[operator]
    return list(logits.split([segment.keep for segment in segments]))
