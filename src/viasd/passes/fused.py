"""The decoder layers of a short pass of a low-bit bf16 view in one C call (the kernel in `fused_layers.c`).

After the attention kernel, a decoding step of the 1.5B target's 4-bit view still spent some 4 ms of its ~40 in
per-layer torch operations and module calls around the products (norms, SiLU gating, residual sums, the calls of
the quantized modules). Where every Linear layer of the decoder is one of viasd's low-bit ones (int4a8, or a GGUF
file's 4- and 6-bit blocks) and the attention kernel applies, `run_layers` hands the whole stack to one C call
that strings viasd's product and attention kernels together with those few elementwise steps. Its numbers are
the short loop's with the attention kernel to within torch's own last-bit noise (a sum of squares, an
exponential), and each token's result does not depend on its block (tested). `VIASD_FUSED_LAYERS=off` keeps the
loop.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import weakref
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from viasd.kernels import attention as short_attention
from viasd.kernels import w4a8, w6a8
from viasd.kernels.build import load_kernel
from viasd.passes.cache_layer import GrowingLayer
from viasd.views.quantize import Int4Int8Linear, Int6Int8Linear

SWITCH = "VIASD_FUSED_LAYERS"
PLAN = "_viasd_fused_plan"  # the attribute under which a model keeps its last plan
LANES = short_attention.LANES  # hidden and intermediate sizes: whole vectors of the kernel (bf16_vectors.h)


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("k", ctypes.c_int64), ("n", ctypes.c_int64), ("t0", ctypes.c_void_p),
                ("t1", ctypes.c_void_p), ("t2", ctypes.c_void_p), ("t3", ctypes.c_void_p),
                ("bias", ctypes.c_void_p)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("inputs", ctypes.c_int64), ("mlp_inputs", ctypes.c_int64),
                ("qkv", _Linear * 3), ("o", _Linear), ("gate_up", _Linear * 2), ("down", _Linear)]  # fmt: skip


class _Kernels(ctypes.Structure):
    _fields_ = [("w4a8", ctypes.c_void_p), ("w6a8", ctypes.c_void_p), ("attention", ctypes.c_void_p)]


class _Plan:
    """A model's layers as the kernel takes them, for the modules they had when it was made (a view swaps them).
    It holds the modules weakly (a plan must not keep a dropped view's weights alive): a plan whose modules are not
    all alive and in place is made again before use, so its pointers are only followed while they are valid."""

    def __init__(self, modules: tuple[nn.Module, ...], layers: Any, kept: list[torch.Tensor]) -> None:
        self.modules = tuple(weakref.ref(module) for module in modules)
        self.layers = layers  # a ctypes array of _Layer
        self.kept = kept  # tensors whose memory the layers point at (float32 biases)

    def made_for(self, modules: tuple[nn.Module, ...]) -> bool:
        return len(self.modules) == len(modules) and all(r() is m for r, m in zip(self.modules, modules, strict=True))


def _switched_off() -> bool:
    return os.environ.get(SWITCH, "").strip().lower() in ("0", "off", "no", "false")


@functools.cache
def _kernel() -> tuple[ctypes.CDLL, _Kernels] | str:
    """The compiled driver and the product and attention kernels it calls, or why not (a sentence)."""
    found = [w4a8._kernel(), w6a8._kernel(), short_attention._kernel()]
    for kernel in found:
        if not isinstance(kernel, ctypes.CDLL):
            return kernel
    loaded = load_kernel("fused_layers.c", short_attention.BUILDS, "fused layers", ("bf16_vectors.h",))
    if isinstance(loaded, str):
        return loaded
    library, _ = loaded
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.fused_layers.argtypes = [pointer, size, size, size, pointer, pointer, pointer, pointer, pointer,
                                     pointer, pointer, pointer, size, size, size, ctypes.c_float, size,
                                     ctypes.c_int]  # fmt: skip
    library.fused_layers.restype = ctypes.c_int
    four, six, attention = found
    functions = _Kernels(
        ctypes.cast(four.w4a8_linear, ctypes.c_void_p).value,  # type: ignore[union-attr]
        ctypes.cast(six.w6a8_linear, ctypes.c_void_p).value,  # type: ignore[union-attr]
        ctypes.cast(attention.short_attention, ctypes.c_void_p).value,  # type: ignore[union-attr]
    )
    return library, functions


def kernel_status() -> str:
    """`compiled` when short passes of low-bit views run their layers in one call, `off` when switched off, else
    why not."""
    if _switched_off():
        return "off"
    kernel = _kernel()
    return kernel if isinstance(kernel, str) else "compiled"


def _linear(module: nn.Module, kept: list[torch.Tensor]) -> _Linear | None:
    """One low-bit product as the kernel takes it, or None for another kind of layer."""
    if type(module) not in (Int4Int8Linear, Int6Int8Linear):
        return None
    bias = module.bias  # type: ignore[union-attr]
    if bias is not None:
        bias = bias.float().contiguous()
        kept.append(bias)
    address = None if bias is None else bias.data_ptr()
    if type(module) is Int4Int8Linear:
        packed, scale, low = module.packed, module.scale, module.low
        if not all(t.is_contiguous() for t in (packed, scale, low)):
            return None
        k = packed.shape[1] * 2
        return _Linear(4, k, packed.shape[0], packed.data_ptr(), scale.data_ptr(), low.data_ptr(), None, address)
    if type(module) is Int6Int8Linear:
        tensors = (module.low, module.high, module.sub, module.d)
        if not all(t.is_contiguous() for t in tensors):  # type: ignore[union-attr]
            return None
        k = module.low.shape[1] * 2  # type: ignore[union-attr, index]
        return _Linear(6, k, module.low.shape[0], *(t.data_ptr() for t in tensors), address)  # type: ignore[union-attr]
    return None


def _together(members: tuple[nn.Module, ...], kept: list[torch.Tensor]) -> list[_Linear] | None:
    """The products of layers that take the same input: one, where they are siblings in this order, else each."""
    group = getattr(members[0], "siblings", None)
    if group is not None and all(getattr(m, "siblings", None) is group for m in members):
        edges = [group.columns[id(m)] for m in members]
        in_order = edges[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(edges))
        if in_order and edges[-1][1] == group.fused.out_features:  # the group's columns are these, in this order
            fused = _linear(group.fused, kept)
            return None if fused is None else [fused]
    each = [_linear(m, kept) for m in members]
    return None if any(linear is None for linear in each) else each  # type: ignore[return-value]


def _modules(model: nn.Module) -> tuple[nn.Module, ...]:
    """The modules the plan depends on, layer by layer (norms, projections)."""
    parts: list[nn.Module] = []
    for layer in model.model.layers:  # type: ignore[union-attr]
        attention, mlp = layer.self_attn, layer.mlp
        parts += [layer.input_layernorm, attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                  layer.post_attention_layernorm, mlp.gate_proj, mlp.up_proj, mlp.down_proj]  # fmt: skip
    return tuple(parts)


def _make_plan(model: nn.Module, modules: tuple[nn.Module, ...]) -> _Plan | None:
    count = len(model.model.layers)  # type: ignore[union-attr]
    layers = (_Layer * count)()
    kept: list[torch.Tensor] = []
    for index in range(count):
        norm1, q, k, v, o, norm2, gate, up, down = modules[9 * index : 9 * index + 9]
        inputs, mlp_inputs = _together((q, k, v), kept), _together((gate, up), kept)
        out, down_product = _linear(o, kept), _linear(down, kept)
        if inputs is None or mlp_inputs is None or out is None or down_product is None:
            return None
        layer = layers[index]
        layer.norm1, layer.norm2 = norm1.weight.data_ptr(), norm2.weight.data_ptr()  # type: ignore[union-attr]
        layer.eps1, layer.eps2 = norm1.variance_epsilon, norm2.variance_epsilon  # type: ignore[union-attr]
        layer.inputs, layer.mlp_inputs = len(inputs), len(mlp_inputs)
        for i, linear in enumerate(inputs):
            layer.qkv[i] = linear
        for i, linear in enumerate(mlp_inputs):
            layer.gate_up[i] = linear
        layer.o, layer.down = out, down_product
    return _Plan(modules, layers, kept)


def _plan(model: nn.Module) -> _Plan | None:
    """The model's plan for the modules it has now (made again after a view swapped others in), or None where a
    layer is not a low-bit one. The model keeps its last plan (in its `__dict__`, not as a registered module)."""
    modules = _modules(model)
    plan = model.__dict__.get(PLAN)
    if plan is None or not plan.made_for(modules):
        plan = _make_plan(model, modules)
        model.__dict__[PLAN] = plan
    return plan


def plan_for(model: nn.Module, dtype: torch.dtype, cache: DynamicCache) -> _Plan | None:
    """The plan by which a short pass of `model` (which `short_pass.supports`, with the modules it has now) runs its
    layers in one call, or None where it may not: bf16, silu MLPs, sizes in whole vectors, the attention kernel,
    low-bit layers, in-place caches."""
    config = model.config  # type: ignore[union-attr]
    if _switched_off() or dtype != torch.bfloat16 or getattr(config, "hidden_act", None) not in ("silu", "swish"):
        return None
    if config.hidden_size % LANES or config.intermediate_size % LANES:
        return None
    attention = model.model.layers[0].self_attn  # type: ignore[union-attr, index]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if not short_attention.applies(dtype, heads, kv_heads, attention.head_dim):
        return None
    if not all(type(layer) is GrowingLayer for layer in cache.layers) or isinstance(_kernel(), str):
        return None
    return _plan(model)


def applies(model: nn.Module, dtype: torch.dtype, cache: DynamicCache) -> bool:
    """Whether a short pass of `model` runs its layers in one call (`plan_for`)."""
    return plan_for(model, dtype, cache) is not None


def run_layers(
    model: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: DynamicCache, plan: _Plan
) -> None:
    """All decoder layers of a short pass on x [1, M, hidden] (bf16, contiguous: updated in place), by the plan
    `plan_for` gave for this model and cache; cos and sin [M, dim]. The cache is extended by the pass's entries."""
    kernel = _kernel()
    assert not isinstance(kernel, str)
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError("the fused layers take contiguous bf16 hidden states")
    library, functions = kernel
    config = model.config  # type: ignore[union-attr]
    attention = model.model.layers[0].self_attn  # type: ignore[union-attr, index]
    dim, kv_heads, length = attention.head_dim, config.num_key_value_heads, x.shape[1]
    count = len(cache.layers)
    pointers, sizes = (ctypes.c_void_p * (2 * count))(), (ctypes.c_int64 * (2 * count))()
    for index, layer in enumerate(cache.layers):
        # Room for the pass's entries after the layer's; the attention kernel writes them.
        sizes[count + index] = layer.reserve((1, kv_heads, length, dim), x.dtype, x.device)  # type: ignore[union-attr]
        keys, values = layer.stores()  # type: ignore[union-attr]
        pointers[index], pointers[count + index], sizes[index] = keys.data_ptr(), values.data_ptr(), keys.shape[-2]
    cos, sin = cos.contiguous(), sin.contiguous()
    address = ctypes.addressof
    status = library.fused_layers(
        x.data_ptr(), length, x.shape[2], count, address(plan.layers), address(functions), cos.data_ptr(),
        sin.data_ptr(), address(pointers), address(pointers) + count * ctypes.sizeof(ctypes.c_void_p),
        address(sizes), address(sizes) + count * ctypes.sizeof(ctypes.c_int64), config.num_attention_heads,
        kv_heads, dim, attention.scaling, config.intermediate_size, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:  # the cache keeps what it had: the pass's positions were reserved, maybe not written
        for layer in cache.layers:
            layer.crop(-length)
        if status == -1:
            raise MemoryError("the fused layers could not allocate their scratch memory")
        raise RuntimeError(f"a kernel of the fused layers refused its shapes (status {status})")
