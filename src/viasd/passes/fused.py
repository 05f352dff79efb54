"""A model's decoder layers described for the fused-layers kernel (kernels/fused_layers.py), and the call.

Where every Linear layer of the decoder is one of viasd's low-bit ones (int4a8, or a GGUF file's 4-, 6- and 8-bit
blocks) in a bf16 model of a family the kernel computes (`FAMILIES`: Llama's layer, Qwen3's q/k norms, Gemma 3's
norms, GELU and local rotary table, sliding windows) and the attention kernel takes its shape, a short pass runs
the whole decoder stack as one C call; it is held to viasd's decoder layer (passes/layer_loop.py), checked at first
use (`agrees`) and in tests. The description (a plan) is made once per set of modules: a view swaps its own in, so
a plan remembers the modules it was made for, weakly (a plan must not keep a dropped view's weights alive), and is
made again when they are not all alive and in place; its pointers are only followed while they are valid.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Sequence

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicSlidingWindowLayer, get_layer_types_and_kwargs

from viasd.kernels import attention, fused_layers, w6a8
from viasd.kernels.build import Library
from viasd.kernels.fused_layers import Layers, LayerWeights, Norm, Product, SequenceCache
from viasd.kernels.interface import GELU_TANH, NORM_GEMMA, NORM_LLAMA, SILU
from viasd.kernels.notice import warn_once
from viasd.models import network
from viasd.models.stored import model_dtype
from viasd.passes import layer_loop, sliding_store
from viasd.passes.cache_layer import growing_cache
from viasd.passes.layer_loop import attention_kernel
from viasd.views.linears import Int4Int8Linear, Int6Int8Linear, format_of
from viasd.views.quantize import quantize
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View, applied

PLAN = "_viasd_fused_plan"  # the attribute under which a model keeps its last plan
LANES = attention.LANES  # hidden and intermediate sizes: whole vectors of the kernel


class Plan:
    """A model's layers as the kernel takes them, for the modules they had when it was made."""

    def __init__(self, modules: tuple[nn.Module, ...], described: Sequence[LayerWeights]) -> None:
        self.modules = tuple(weakref.ref(module) for module in modules)
        self.described = tuple(described)
        self.layers = Layers(described)
        self._without: dict[tuple[int, ...], Layers] = {}

    def made_for(self, modules: tuple[nn.Module, ...]) -> bool:
        return len(self.modules) == len(modules) and all(r() is m for r, m in zip(self.modules, modules, strict=True))

    def without(self, skipped: tuple[int, ...]) -> Layers:
        """The layers but those numbered in `skipped` (a slim view that skips whole layers), made once per set."""
        if not skipped:
            return self.layers
        if skipped not in self._without:
            self._without[skipped] = Layers([w for i, w in enumerate(self.described) if i not in set(skipped)])
        return self._without[skipped]


def _product(module: nn.Module) -> Product | None:
    """One low-bit product as the kernel takes it, or None for another kind of layer."""
    kind = _product_kind(module)
    if kind is None:
        return None
    bias = None if module.bias is None else module.bias.float().contiguous()  # type: ignore[union-attr]
    weights = module.weights  # its format's layout (kernels/formats.py), the tensors the kernel reads
    tensors: tuple[torch.Tensor, ...] = weights.tensors()
    return Product(kind, tensors, bias, weights.k, weights.n) if all(t.is_contiguous() for t in tensors) else None


def _product_kind(module: nn.Module | None) -> int | None:
    """The product kind the kernel takes `module` as (its format's, kernels/formats.py), or None."""
    found = None if module is None else format_of(module)
    return None if found is None else found.fused


def _together(members: tuple[nn.Module, ...]) -> tuple[Product, ...] | None:
    """The products of layers that take the same input: one, where they are siblings in this order, else each."""
    group = getattr(members[0], "siblings", None)
    if group is not None and all(getattr(m, "siblings", None) is group for m in members):
        edges = [group.columns[id(m)] for m in members]
        in_order = edges[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(edges))
        if in_order and edges[-1][1] == group.fused.out_features:  # the group's columns are these, in this order
            fused = _product(group.fused)
            return None if fused is None else (fused,)
    each = tuple(_product(m) for m in members)
    return None if any(product is None for product in each) else each  # type: ignore[return-value]


def _parts(layer: nn.Module) -> tuple[nn.Module, tuple[nn.Module, ...], nn.Module, nn.Module, tuple[nn.Module, ...],
                                     nn.Module]:  # fmt: skip
    """A decoder layer's modules as the kernel takes them: norm before attention, q|k|v (q, k and v, or one
    projection: Phi-3), output projection, norm before the MLP (Llama's post-attention norm, Gemma 3's
    pre-feedforward one), gate|up (gate and up, or one projection: Phi-3), down projection."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.qkv_proj,) if hasattr(attn, "qkv_proj") else (attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up = (mlp.gate_up_proj,) if hasattr(mlp, "gate_up_proj") else (mlp.gate_proj, mlp.up_proj)
    before_mlp = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
    return layer.input_layernorm, qkv, attn.o_proj, before_mlp, gate_up, mlp.down_proj


def _extra_norms(layer: nn.Module) -> tuple[nn.Module | None, ...]:
    """The norms a layer has besides the two before attention and the MLP, or None each: on the attention's and
    the MLP's outputs (Gemma 3), on each head's query and key (Qwen3, Gemma 3)."""
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    attn = layer.self_attn
    return (layer.post_attention_layernorm if gemma else None, getattr(layer, "post_feedforward_layernorm", None),
            getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))  # fmt: skip


def _modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules the plan depends on, layer by layer (norms, projections)."""
    parts: list[nn.Module] = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        norm1, qkv, o, norm2, gate_up, down = _parts(layer)
        parts += [norm1, *qkv, o, norm2, *gate_up, down, *(n for n in _extra_norms(layer) if n is not None)]
    return tuple(parts)


def _norm(module: nn.Module | None, kind: int) -> Norm | None:
    """A norm module as the kernel takes it: the float32 factor it multiplies by (Gemma's 1 + weight, as its
    forward computes it) and its epsilon."""
    if module is None:
        return None
    weight = module.weight.detach().float()
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    return Norm((1.0 + weight if kind == NORM_GEMMA else weight).contiguous(), float(eps))


ACTIVATIONS = {"silu": SILU, "swish": SILU, "gelu_pytorch_tanh": GELU_TANH}  # the MLP activations the kernel has


def activation_name(config: PretrainedConfig) -> str | None:
    """The MLP's activation as the config names it (Gemma's `hidden_activation`, the others' `hidden_act`)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def windows(config: PretrainedConfig) -> list[int]:
    """Each layer's sliding window (0: full attention), as transformers makes its cache layers."""
    kinds = get_layer_types_and_kwargs(config)[0]
    return [config.sliding_window if kind == "sliding_attention" else 0 for kind in kinds]


def _make_plan(model: nn.Module, modules: tuple[nn.Module, ...]) -> Plan | None:
    config = model.config  # type: ignore[union-attr]
    kind = NORM_GEMMA if config.model_type == "gemma3_text" else NORM_LLAMA
    activation = ACTIVATIONS[activation_name(config)]  # type: ignore[index]  # `fits` checked it
    described = []
    for layer, window in zip(model.model.layers, windows(config), strict=True):  # type: ignore[union-attr]
        norm1, q_k_v, o, norm2, gate_and_up, down = _parts(layer)
        qkv, gate_up, out, down_product = _together(q_k_v), _together(gate_and_up), _product(o), _product(down)
        if qkv is None or gate_up is None or out is None or down_product is None:
            return None
        post_attention, post_mlp, q_norm, k_norm = (_norm(n, kind) for n in _extra_norms(layer))
        described.append(LayerWeights(_norm(norm1, kind), _norm(norm2, kind), qkv, out, gate_up, down_product,  # type: ignore[arg-type]
                                      post_attention, post_mlp, q_norm, k_norm, kind, activation, window,
                                      local=window > 0))  # fmt: skip
    return Plan(modules, described)


def plan(model: nn.Module) -> Plan:
    """The model's plan for the modules it has now (a view `fits` applied: made again after a view swapped others
    in). The model keeps its last plan (in its `__dict__`, not as a registered module)."""
    modules = _modules(model)
    found = model.__dict__.get(PLAN)
    if found is None or not found.made_for(modules):
        found = _make_plan(model, modules)
        if found is None:  # `fits` said every layer is a low-bit one; only a layer's tensors out of place fail here
            raise RuntimeError("the fused layers cannot take this view's layers (a tensor is not contiguous)")
        model.__dict__[PLAN] = found
    return found


# The decoder's Linear layers, as a view names its quantized copies (views/quantize.py): all low-bit, or no plan.
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")  # fmt: skip
FUSED_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")  # Phi-3's

# The families whose decoder layers the kernel computes (those of viasd's loop, passes/loop.py `MIRRORED`); other
# families' short passes run their own forward.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text")
WHY_NOT = "_viasd_fused_why_not"  # where a prepared model keeps `why_not`'s verdict (passes/prepare.py)


def why_not(config: PretrainedConfig) -> str | None:
    """Why the fused stack cannot compute a decoder of this config whatever its view (its family, its attention
    kinds, its activation, a soft cap), or None: a pure function of the config, read once per model (`remember`)."""
    family = getattr(config, "model_type", None)
    if family not in FAMILIES:
        return f"it has no {family} layers"
    kinds = set(get_layer_types_and_kwargs(config)[0])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return f"it has no {', '.join(sorted(kinds - {'full_attention', 'sliding_attention'}))} layers"
    if activation_name(config) not in ACTIVATIONS:
        return f"it has no {activation_name(config)} activation"
    if getattr(config, "attn_logit_softcapping", None):
        return "it has no soft cap of attention scores"
    return None


def remember(model: nn.Module) -> None:
    """Read `why_not`'s verdict for the model now (at load) and keep it on the model; where the stack could run its
    low-bit views (a family it computes, bf16 on a CPU, the kernel there), check now that it agrees with viasd's decoder
    layer (`agrees`, once per process), so that gathering a pass's facts (passes/facts.py) builds no model."""
    verdict = why_not(model.config)  # type: ignore[union-attr]
    model.__dict__[WHY_NOT] = verdict
    on_cpu = next(model.parameters()).device.type == "cpu"  # the stack is a CPU kernel (a GPU runs its own forward)
    if (
        verdict is None
        and on_cpu
        and model_dtype(model) == torch.bfloat16
        and isinstance(fused_layers.kernel(), Library)
    ):
        agrees()


def _why_not(model: nn.Module) -> str | None:
    return model.__dict__[WHY_NOT] if WHY_NOT in model.__dict__ else why_not(model.config)  # type: ignore[union-attr]


@functools.cache
def _names(layers: int, linears: tuple[str, ...]) -> tuple[str, ...]:
    """The names of the decoder Linear layers of a model of `layers` layers (made once: `fits` runs every pass)."""
    return tuple(f"model.layers.{i}.{name}" for i in range(layers) for name in linears)


def fits(model: nn.Module, view: View | None) -> bool:
    """Whether short passes of `model` (one the loop covers, on in-place caches) as `view` run their layers in one call:
    bf16, sizes in whole vectors, the attention kernel's shapes, every decoder Linear layer one of the view's
    low-bit copies, a family the kernel computes (`why_not`), the kernel there and not switched off. Read from the view
    and the model's config, not from the modules in place (another generation's pass may have its view swapped in)."""
    if view is None or view.linears is None or (view.mask is not None and not view.mask.is_full):
        return False
    config = model.config  # type: ignore[union-attr]
    dtype = model_dtype(model)
    copies = view.linears.modules
    linears = FUSED_LINEARS if getattr(config, "model_type", None) == "phi3" else LINEARS
    names = _names(config.num_hidden_layers, linears)
    if dtype != torch.bfloat16 or not all(_product_kind(copies.get(name)) is not None for name in names):
        return False
    family = _why_not(model)
    if family is not None:  # a view the kernel would take, of a decoder it does not compute: said once
        warn_once(f"the fused layers do not run this model ({family}): short passes of low-bit views run their "
                  "layers one by one")  # fmt: skip
        return False
    if config.hidden_size % LANES or config.intermediate_size % LANES:
        return False
    head_dim = model.model.layers[0].self_attn.head_dim  # type: ignore[union-attr, index]
    if not attention.takes(dtype, config.num_attention_heads, config.num_key_value_heads, head_dim):
        return False
    return isinstance(fused_layers.kernel(), Library) and agrees()


def skips_whole_layers(view: View | None) -> bool:
    """Whether `view` skips layers, whole ones only (the fused stack leaves those out: `run_layers`' `skipped`)."""
    mask = None if view is None else view.mask
    return mask is not None and not mask.is_full and mask.attention == mask.mlp


def layers_of(view: View | None) -> View | None:
    """`view`'s layers without its mask: the stack's part of a view that skips whole layers (`skips_whole_layers`)."""
    return None if view is None or view.linears is None else View(linears=view.linears)


def agrees() -> bool:
    """Whether the fused stack computes what viasd's decoder layer computes (passes/layer_loop.py, the reference it
    is held to), checked once per process, on a tiny model of its own: when a model is prepared (`remember`), or
    else where `fits` first asks; where it does not, short passes run layer by layer, and one line says so."""
    problem = _disagreement()
    if problem is not None:
        warn_once(f"the fused layers {problem}: short passes of low-bit views run their layers one by one")
    return problem is None


# The model of the check: a tiny Qwen2 (biases on q, k and v), in bf16, of whole vectors and the kernel's shapes.
CHECK_MODEL = {"vocab_size": 32, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def _check_model() -> tuple[nn.Module, View]:
    """The check's model in an int4a8 view: layer 0's q|k|v and gate|up one product each (siblings), layer 1's as
    separate products and its down projection 6-bit (a GGUF file's Q6_K layout)."""
    from transformers import Qwen2Config

    with torch.random.fork_rng(devices=[]):  # the random initialisation leaves torch's generator as it was
        torch.manual_seed(0)
        model = network.CausalLM(Qwen2Config(**CHECK_MODEL))
        for module in model.modules():  # as transformers initialises a model: weights of 0.02, biases 0, norms 1
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        model = model.to(torch.bfloat16).eval()
    linears = quantize(model, QuantRecipe.parse("int4a8"))
    layer = model.model.layers[1]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        linears.modules[f"model.layers.1.{name}"] = Int4Int8Linear.from_linear(layer.get_submodule(name))
    down = layer.mlp.down_proj
    six = w6a8.random_weights(down.out_features, down.in_features, torch.Generator().manual_seed(0))
    linears.modules["model.layers.1.mlp.down_proj"] = Int6Int8Linear.from_linear(down, six)
    return model, View(linears=linears)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to bf16 noise carried through a few layers (3% of the largest magnitude): the products and attention
    are the same kernels; the norms and SiLU may differ from torch's in a last bit now and then."""
    return torch.allclose(got.float(), want.float(), rtol=3e-2, atol=3e-2 * float(want.abs().max()))


@functools.cache
def _disagreement() -> str | None:
    """Why the fused stack cannot be trusted, or None: on the check's model, two sequences in one pass (two tokens
    after 20 cached positions, one after 9) must get the layer loop's hidden states and cache entries."""
    model, view = _check_model()
    inner = model.model
    kernel = attention_kernel(model)
    generator = torch.Generator().manual_seed(1)

    def rotary(x: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = inner.rotary_emb(x, torch.tensor([positions]))
        return cos[0].contiguous(), sin[0].contiguous()

    prefix = torch.randn(1, 29, 64, generator=generator).bfloat16()
    x = torch.randn(1, 3, 64, generator=generator).bfloat16()
    with torch.inference_mode(), applied(model, view):
        sets = []
        for _ in range(2):  # the loop's caches and the fused stack's, alike after the prefix
            caches = [growing_cache(DynamicCache(config=model.config)) for _ in range(2)]
            layer_loop.run(model, prefix, *rotary(prefix, [*range(20), *range(9)]), caches, (0, 20, 29), kernel)
            sets.append(caches)
        cos, sin = rotary(x, [20, 21, 9])
        want = layer_loop.run(model, x, cos, sin, sets[0], (0, 2, 3), kernel)
        got = x.clone()
        run_layers(model, got, cos, sin, sets[1], (0, 2, 3))
    if not _close(got, want):
        return "disagree with viasd's decoder layer"
    for loop_cache, fused_cache in zip(*sets, strict=True):
        for a, b in zip(loop_cache.layers, fused_cache.layers, strict=True):
            if not (_close(b.keys, a.keys) and _close(b.values, a.values)):
                return "write other cache entries than viasd's decoder layer"
    return None


def run_layers(
    model: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    caches: Sequence[DynamicCache],
    starts: Sequence[int],
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
    skipped: Sequence[int] = (),
) -> None:
    """All decoder layers of a short pass on x [1, M, hidden] (bf16, contiguous: updated in place), whose rows
    starts[s] .. starts[s + 1] are the new tokens of the sequence whose cache is caches[s], for a view that `fits`
    (applied); cos and sin [M, dim], `local` those of the sliding-window layers where they have their own (Gemma 3).
    Each cache is extended by its sequence's entries; on failure every cache keeps what it had. The layers numbered
    in `skipped` (a slim view's whole layers, `skips_whole_layers`) are left out: the hidden states pass them as
    they are and their caches get no entries, as the model's forward with the mask's stand-ins does."""
    left_out = set(skipped)
    layers = plan(model).without(tuple(sorted(left_out)))
    library = fused_layers.kernel()
    assert isinstance(library, Library), "fits said the kernel is there"
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError("the fused layers take contiguous bf16 hidden states")
    config = model.config  # type: ignore[union-attr]
    first = model.model.layers[0].self_attn  # type: ignore[union-attr, index]
    dim, kv_heads = first.head_dim, config.num_key_value_heads
    sequences, sliding = [], []
    for cache, a, b in zip(caches, starts, starts[1:], strict=False):
        shape = (1, kv_heads, b - a, dim)
        stores, past = [], []
        for index, layer in enumerate(cache.layers):
            if index in left_out:
                continue
            if type(layer) is DynamicSlidingWindowLayer:  # a new store: the layer takes it once the pass is done
                pair, held = sliding_store.room(layer, shape, x.dtype)
                sliding.append((layer, pair, b - a))
                stores.append(pair)
                past.append(held)
            else:  # room for the sequence's entries after the layer's; the attention kernel writes them
                past.append(layer.reserve(shape, x.dtype, x.device))  # type: ignore[union-attr]
                stores.append(layer.stores())  # type: ignore[union-attr]
        sequences.append(SequenceCache(stores, past))
    try:
        fused_layers.run(library, x[0], layers, cos.contiguous(), sin.contiguous(), sequences, starts,
                         config.num_attention_heads, first.scaling, config.intermediate_size,
                         None if local is None else (local[0].contiguous(), local[1].contiguous()))  # fmt: skip
    except (MemoryError, RuntimeError):  # the pass's positions were reserved, maybe not written: not kept
        for cache, a, b in zip(caches, starts, starts[1:], strict=False):
            for index, layer in enumerate(cache.layers):
                if type(layer) is not DynamicSlidingWindowLayer and index not in left_out:
                    layer.crop(-(b - a))
        raise
    for layer, pair, added in sliding:
        sliding_store.commit(layer, pair, added)
