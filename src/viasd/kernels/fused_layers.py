"""The decoder layers of a short pass of a low-bit bf16 model in one C call (`fused_layers.c`).

Per layer: RMSNorm, the q/k/v products, per-head q/k norms where the model has them (Qwen3, Gemma 3), attention
(kernels/attention.py: rotary embedding, cache write, a sliding window where the layer has one), the output product
(normed again: Gemma 3) and residual, RMSNorm, the gate/up products, SiLU or GELU (tanh) gating, the down product
(normed again: Gemma 3) and residual, with viasd's 4-, 6- and 8-bit product kernels and its attention kernel, and
bf16 rounding wherever torch's bf16 operations round.
That removes the per-layer torch operations and module calls around the products (about 5 ms of a 35-40 ms
decoding step of the 1.5B target's 4-bit view). It is held to viasd's decoder layer (passes/layer_loop.py), to
within torch's last-bit noise (a sum of squares, an exponential): passes/fused.py checks that where short passes
first take it, and describes a model's layers for it. At load it is checked to give each token the same bits in
any block and beside any other sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from viasd.kernels import attention, formats, w4a8, w6a8, w8a8
from viasd.kernels.build import Library, address, checked, ffi, status, usable
from viasd.kernels.interface import EIGHT_BIT, FOUR_BIT, GELU_TANH, NO_MEMORY, NORM_GEMMA, NORM_LLAMA, OK, SILU, SIX_BIT
from viasd.kernels.switch import OFF, switched_off


@dataclass(frozen=True)
class Product:
    """One low-bit product: kind FOUR_BIT (tensors: packed codes, scales, minimums), SIX_BIT
    (`w6a8.SixBitWeights`' four tensors) or EIGHT_BIT (`w8a8.EightBitWeights`' three), its weight's [n, k], and a
    float32 bias or None."""

    kind: int
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None
    k: int
    n: int


@dataclass(frozen=True)
class Norm:
    """An RMSNorm as the kernel takes it: the float32 factor it multiplies by (Gemma's 1 + weight) and its epsilon."""

    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class LayerWeights:
    """What one decoder layer computes with: its norms (NORM_LLAMA or NORM_GEMMA rounding, `norm_kind`), before
    attention and before the MLP, and where the model has them on the attention's and the MLP's outputs (Gemma 3)
    and on each head's query and key (Qwen3, Gemma 3); the q|k|v products (one, or q, k and v), the output product,
    the gate|up products (one, or gate and up), the down product; the MLP's activation (SILU or GELU_TANH); the
    layer's sliding window (0: none) and whether it rotates by the local table of cos and sin (Gemma 3's sliding
    layers)."""

    norm1: Norm
    norm2: Norm
    qkv: tuple[Product, ...]
    o: Product
    gate_up: tuple[Product, ...]
    down: Product
    post_attention: Norm | None = None
    post_mlp: Norm | None = None
    q_norm: Norm | None = None
    k_norm: Norm | None = None
    norm_kind: int = NORM_LLAMA
    activation: int = SILU
    window: int = 0
    local: bool = False


class Layers:
    """Layers as the kernel takes them (`viasd_layer[]` of viasd_kernels.h): pointers to the weights, which the
    caller keeps alive and in place while it uses them (the norms' factors and the biases, float32 copies, are held
    here)."""

    def __init__(self, layers: Sequence[LayerWeights]) -> None:
        self.count = len(layers)
        self.biases = [p.bias for layer in layers for p in (*layer.qkv, layer.o, *layer.gate_up, layer.down)]
        self.norms = [n for layer in layers for n in _norms(layer) if n is not None]
        self.array = ffi().new("viasd_layer[]", len(layers))
        for entry, layer in zip(self.array, layers, strict=True):
            for (name, eps), norm in zip(NORM_FIELDS, _norms(layer), strict=True):
                setattr(entry, name, ffi().NULL if norm is None else address(norm.weight))
                setattr(entry, eps, 0.0 if norm is None else norm.eps)
            entry.norm_kind, entry.activation, entry.window, entry.local = (layer.norm_kind, layer.activation,
                                                                            layer.window, int(layer.local))  # fmt: skip
            entry.inputs, entry.mlp_inputs = len(layer.qkv), len(layer.gate_up)
            for i, product in enumerate(layer.qkv):
                _fill(entry.qkv[i], product)
            for i, product in enumerate(layer.gate_up):
                _fill(entry.gate_up[i], product)
            _fill(entry.o, layer.o)
            _fill(entry.down, layer.down)


# `viasd_layer`'s norms and their epsilons, in `_norms`' order
NORM_FIELDS = (("norm1", "eps1"), ("norm2", "eps2"), ("post_attention", "eps_post_attention"),
               ("post_mlp", "eps_post_mlp"), ("q_norm", "eps_q"), ("k_norm", "eps_k"))  # fmt: skip


def _norms(layer: LayerWeights) -> tuple[Norm | None, ...]:
    return layer.norm1, layer.norm2, layer.post_attention, layer.post_mlp, layer.q_norm, layer.k_norm


def _fill(entry: Any, product: Product) -> None:
    entry.kind, entry.k, entry.n = product.kind, product.k, product.n
    entry.t0, entry.t1, entry.t2 = (address(t) for t in product.tensors[:3])
    entry.t3 = address(product.tensors[3]) if len(product.tensors) > 3 else ffi().NULL
    entry.bias = address(product.bias)


@dataclass(frozen=True)
class SequenceCache:
    """One sequence's cache for a pass: per layer its key and value stores ([1, kv_heads, capacity, dim]) and how
    many positions are filled before the pass (its entries go after them)."""

    stores: Sequence[tuple[torch.Tensor, torch.Tensor]]
    past: Sequence[int]


def run(
    library: Library,
    x: torch.Tensor,
    layers: Layers,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sequences: Sequence[SequenceCache],
    starts: Sequence[int],
    heads: int,
    scale: float,
    inner: int,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The layers on x [M, hidden] (bf16, contiguous: updated in place), rows starts[s] .. starts[s + 1] being
    sequence s's new tokens, attending over its own cache, whose stores get the pass's keys and values; cos and sin
    [M, dim] contiguous, and `local` the same for the layers marked local (None: cos and sin). Raises MemoryError
    or RuntimeError (a kernel refused its shapes) with the stores' pass positions maybe written (the caller crops
    them)."""
    interface = ffi()
    count, dim = layers.count, cos.shape[-1]
    stores = [pair for cache in sequences for pair in cache.stores]  # sequence by sequence, layer by layer
    keys = interface.new("uint16_t *[]", [interface.cast("uint16_t *", k.data_ptr()) for k, _ in stores])
    values = interface.new("uint16_t *[]", [interface.cast("uint16_t *", v.data_ptr()) for _, v in stores])
    capacity = interface.new("int64_t[]", [k.shape[-2] for k, _ in stores])
    positions = interface.new("int64_t[]", [p for cache in sequences for p in cache.past])
    bounds = interface.new("int64_t[]", list(starts))
    kv_heads = stores[0][0].shape[1]
    local_cos, local_sin = (cos, sin) if local is None else local
    status = library.lib.fused_layers(
        address(x), x.shape[0], x.shape[1], count, layers.array, address(cos), address(sin), address(local_cos),
        address(local_sin), len(sequences), bounds,
        keys, values, capacity, positions, heads, kv_heads, dim, scale, inner, torch.get_num_threads(),
    )  # fmt: skip
    if status == NO_MEMORY:
        raise MemoryError("the fused layers could not allocate their scratch memory")
    if status != OK:
        raise RuntimeError(f"a kernel of the fused layers refused its shapes (status {status})")


def _random_product(kind: int, n: int, k: int, generator: torch.Generator, bias: bool = False) -> Product:
    b = torch.randn(n, generator=generator) * 0.1 if bias else None
    return Product(kind, formats.of_product(kind).random(n, k, generator).tensors(), b, k, n)  # type: ignore[misc]


def _self_check(library: Library) -> str | None:
    """Why the kernel cannot be trusted here, or None: three layers (q|k|v and gate|up as one product, then as
    several; 4-, 6- and 8-bit products; a bias; then a Gemma 3 layer: its norms, q/k norms, GELU, a sliding window
    of 5 positions and the local table of cos and sin) over two sequences' caches must give finite hidden states,
    and each token the same bits and cache entries in a block of 3 beside another sequence as alone. What it
    computes is checked against viasd's decoder layer where short passes first take it (passes/fused.py `agrees`)
    and in tests/test_fused_layers.py."""
    generator = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, dim, inner = 64, 4, 2, 16, 256
    width = (heads + 2 * kv_heads) * dim
    layers = []

    def four(n: int, k: int, bias: bool = False) -> Product:
        return _random_product(FOUR_BIT, n, k, generator, bias)

    for fused in (True, False):
        qkv = (four(width, hidden, True),) if fused else tuple(
            four(n, hidden, True) for n in (heads * dim, kv_heads * dim, kv_heads * dim)
        )  # fmt: skip
        gate_up = (four(2 * inner, hidden),) if fused else tuple(four(inner, hidden) for _ in range(2))
        norms = (1.0 + 0.1 * torch.randn(2, hidden, generator=generator)).bfloat16().float()
        layers.append(LayerWeights(Norm(norms[0], 1e-6), Norm(norms[1], 1e-6), qkv, four(hidden, heads * dim),
                                   gate_up, _random_product(SIX_BIT, hidden, inner, generator)))  # fmt: skip
    gemma = [Norm(1.0 + 0.1 * torch.randn(size, generator=generator), 1e-6) for size in (hidden,) * 4 + (dim,) * 2]
    eight = tuple(_random_product(EIGHT_BIT, n, hidden, generator) for n in (heads * dim, *(kv_heads * dim,) * 2))
    layers.append(LayerWeights(gemma[0], gemma[1], eight, four(hidden, heads * dim), (four(2 * inner, hidden),),
                               _random_product(EIGHT_BIT, hidden, inner, generator), *gemma[2:], NORM_GEMMA,
                               GELU_TANH, window=5, local=True))  # fmt: skip
    x = torch.randn(3, hidden, generator=generator).bfloat16()
    tables = []
    for _ in range(2):  # the global table, the local one
        angles = torch.randn(3, dim // 2, generator=generator)
        tables.append((torch.cat([angles.cos()] * 2, 1).bfloat16(), torch.cat([angles.sin()] * 2, 1).bfloat16()))
    (cos, sin), local = tables
    prefix = torch.randn(3, 2, 1, kv_heads, 32, dim, generator=generator).bfloat16()

    def cache(past: int) -> SequenceCache:
        return SequenceCache([(prefix[i, 0].clone(), prefix[i, 1].clone()) for i in range(3)], (past,) * 3)

    # Two sequences in one pass: rows 0 .. 1 after 20 cached positions, row 2 after 9 of another cache.
    together = [cache(20), cache(9)]
    got = x.clone()
    plan = Layers(layers)
    run(library, got, plan, cos, sin, together, (0, 2, 3), heads, dim**-0.5, inner, local)
    if not bool(torch.isfinite(got.float()).all()):
        return "gives hidden states that are not finite"
    for rows, past, sequence in ((slice(0, 1), 20, 0), (slice(2, 3), 9, 1)):  # each sequence's first token, alone
        alone, own = x[rows].clone(), cache(past)
        alone_local = local[0][rows].contiguous(), local[1][rows].contiguous()
        run(library, alone, plan, cos[rows].contiguous(), sin[rows].contiguous(), [own], (0, 1), heads, dim**-0.5,
            inner, alone_local)  # fmt: skip
        if not torch.equal(alone, got[rows]):
            return "gives a token other bits in another block or beside another sequence"
        for mine, theirs in zip(own.stores, together[sequence].stores, strict=True):
            if not all(torch.equal(a[..., past, :], b[..., past, :]) for a, b in zip(mine, theirs, strict=True)):
                return "writes a token other cache entries in another block or beside another sequence"
    return None


@functools.cache
def compiled() -> Library | str:
    """The compiled kernel, checked once per process (whatever VIASD_KERNELS says), or why there is none."""
    # the kernels it calls must be sound
    for part in (w4a8.compiled(), w6a8.compiled(), w8a8.compiled(), attention.compiled()):
        if not isinstance(part, Library):
            return f"the fused layers need the kernels they call: {part}"
    return checked("fused layers", _self_check)


def kernel() -> Library | str:
    """The compiled kernel, checked once per process, or why it is not used (a sentence); off where VIASD_KERNELS
    leaves it or a kernel it calls out."""
    for name in (*(f.kernel for f in formats.FORMATS if f.fused is not None), "attention"):
        if switched_off(name):
            return OFF
    return usable("fused", compiled)


def kernel_status() -> str:
    """`compiled (BUILD)` when short passes of low-bit views run their layers in one call, else why not."""
    return status(kernel())
