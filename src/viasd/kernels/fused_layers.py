"""The decoder layers of a short pass of a low-bit bf16 model in one C call (`fused_layers.c`).

Per layer: RMSNorm, the q/k/v products, attention (kernels/attention.py: rotary embedding, cache write), the output
product and residual, RMSNorm, the gate/up products, SiLU gating, the down product and residual, with viasd's
4- and 6-bit product kernels and its attention kernel, and bf16 rounding wherever torch's bf16 operations round.
That removes the per-layer torch operations and module calls around the products (about 5 ms of a 35-40 ms
decoding step of the 1.5B target's 4-bit view). `reference` is the same stack in torch operations on the
kernels' torch references; the kernel agrees with it to within torch's last-bit noise (a sum of squares, an
exponential) and gives each token the same bits in any block (checked at load). passes/fused.py describes a
model's layers for it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from viasd.kernels import attention, w4a8, w6a8
from viasd.kernels.build import Library, address, checked, ffi, status, usable
from viasd.kernels.interface import FOUR_BIT, NO_MEMORY, OK, SIX_BIT
from viasd.kernels.switch import OFF, switched_off


@dataclass(frozen=True)
class Product:
    """One low-bit product: kind FOUR_BIT (tensors: packed codes, scales, minimums) or SIX_BIT
    (`w6a8.SixBitWeights`' four tensors), its weight's [n, k], and a float32 bias or None."""

    kind: int
    tensors: tuple[torch.Tensor, ...]
    bias: torch.Tensor | None
    k: int
    n: int

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, k] bf16 @ W^T + bias by the kernel's torch reference, rounded once to bf16."""
        if self.kind == FOUR_BIT:
            out = w4a8.reference(x.float(), w4a8.FourBitWeights(*self.tensors, self.n))
        else:
            out = w6a8.reference(x.float(), w6a8.SixBitWeights(*self.tensors, self.n))
        return (out if self.bias is None else out + self.bias).bfloat16()


@dataclass(frozen=True)
class LayerWeights:
    """What one decoder layer computes with: RMSNorm weights (bf16) and epsilons, the q|k|v products (one, or q, k
    and v), the output product, the gate|up products (one, or gate and up), the down product."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    eps1: float
    eps2: float
    qkv: tuple[Product, ...]
    o: Product
    gate_up: tuple[Product, ...]
    down: Product


class Layers:
    """Layers as the kernel takes them (`viasd_layer[]` of viasd_kernels.h): pointers to the weights, which the
    caller keeps alive and in place while it uses them (only the biases, float32 copies, are held here)."""

    def __init__(self, layers: Sequence[LayerWeights]) -> None:
        self.count = len(layers)
        self.biases = [p.bias for layer in layers for p in (*layer.qkv, layer.o, *layer.gate_up, layer.down)]
        self.array = ffi().new("viasd_layer[]", len(layers))
        for entry, layer in zip(self.array, layers, strict=True):
            entry.norm1, entry.norm2 = address(layer.norm1), address(layer.norm2)
            entry.eps1, entry.eps2 = layer.eps1, layer.eps2
            entry.inputs, entry.mlp_inputs = len(layer.qkv), len(layer.gate_up)
            for i, product in enumerate(layer.qkv):
                _fill(entry.qkv[i], product)
            for i, product in enumerate(layer.gate_up):
                _fill(entry.gate_up[i], product)
            _fill(entry.o, layer.o)
            _fill(entry.down, layer.down)


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


def reference(
    x: torch.Tensor,
    layers: Sequence[LayerWeights],
    cos: torch.Tensor,
    sin: torch.Tensor,
    sequences: Sequence[SequenceCache],
    starts: Sequence[int],
    heads: int,
    scale: float,
) -> torch.Tensor:
    """The layers on x [M, hidden] bf16 in torch operations (as transformers' Llama and Qwen2 layers compute, on the
    kernels' references): rows starts[s] .. starts[s + 1] are sequence s's new tokens, attending over its own cache,
    whose stores get the pass's keys and values. Returns the new x."""
    for index, layer in enumerate(layers):
        h = _rms_norm(x, layer.norm1, layer.eps1)
        qkv = torch.cat([product.reference(h) for product in layer.qkv], dim=1)
        width = heads * cos.shape[-1]
        kv_width = (qkv.shape[1] - width) // 2
        q, k, v = qkv.split([width, kv_width, kv_width], dim=1)
        attended = torch.cat([
            attention.reference(q[a:b], k[a:b], v[a:b], cos[a:b], sin[a:b], cache.stores[index], cache.past[index],
                                heads, scale)
            for cache, a, b in zip(sequences, starts, starts[1:], strict=False)
        ])  # fmt: skip
        x = x + layer.o.reference(attended)
        h = _rms_norm(x, layer.norm2, layer.eps2)
        gate, up = torch.cat([product.reference(h) for product in layer.gate_up], dim=1).chunk(2, dim=1)
        x = x + layer.down.reference(F.silu(gate) * up)
    return x


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen2 RMSNorm of bf16 rows."""
    wide = x.float()
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


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
) -> None:
    """`reference` by the kernel, on x [M, hidden] (bf16, contiguous: updated in place); cos and sin [M, dim]
    contiguous. Raises MemoryError or RuntimeError (a kernel refused its shapes) with the stores' pass positions
    maybe written (the caller crops them)."""
    interface = ffi()
    count, dim = layers.count, cos.shape[-1]
    stores = [pair for cache in sequences for pair in cache.stores]  # sequence by sequence, layer by layer
    keys = interface.new("uint16_t *[]", [interface.cast("uint16_t *", k.data_ptr()) for k, _ in stores])
    values = interface.new("uint16_t *[]", [interface.cast("uint16_t *", v.data_ptr()) for _, v in stores])
    capacity = interface.new("int64_t[]", [k.shape[-2] for k, _ in stores])
    positions = interface.new("int64_t[]", [p for cache in sequences for p in cache.past])
    bounds = interface.new("int64_t[]", list(starts))
    kv_heads = stores[0][0].shape[1]
    status = library.lib.fused_layers(
        address(x), x.shape[0], x.shape[1], count, layers.array, address(cos), address(sin), len(sequences), bounds,
        keys, values, capacity, positions, heads, kv_heads, dim, scale, inner, torch.get_num_threads(),
    )  # fmt: skip
    if status == NO_MEMORY:
        raise MemoryError("the fused layers could not allocate their scratch memory")
    if status != OK:
        raise RuntimeError(f"a kernel of the fused layers refused its shapes (status {status})")


def _random_product(kind: int, n: int, k: int, generator: torch.Generator, bias: bool = False) -> Product:
    b = torch.randn(n, generator=generator) * 0.1 if bias else None
    if kind == FOUR_BIT:
        tensors: tuple[torch.Tensor, ...] = w4a8.pack(torch.randn(n, k, generator=generator) * k**-0.5).tensors()
    else:
        tensors = w6a8.random_weights(n, k, generator).tensors()
    return Product(kind, tensors, b, k, n)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to bf16 noise carried through a few layers (3% of the largest magnitude)."""
    return torch.allclose(got.float(), want.float(), rtol=3e-2, atol=3e-2 * float(want.abs().max()))


def _self_check(library: Library) -> str | None:
    """Why the kernel cannot be trusted here, or None: two layers (q|k|v and gate|up as one product, then as
    several; 4- and 6-bit products; a bias) over a cache of 20 positions must give `reference`'s hidden states and
    cache entries, and each token the same bits in a block of 3 as alone."""
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
        norms = (1.0 + 0.1 * torch.randn(2, hidden, generator=generator)).bfloat16()
        layers.append(LayerWeights(norms[0], norms[1], 1e-6, 1e-6, qkv, four(hidden, heads * dim), gate_up,
                                   _random_product(SIX_BIT, hidden, inner, generator)))  # fmt: skip
    x = torch.randn(3, hidden, generator=generator).bfloat16()
    angles = torch.randn(3, dim // 2, generator=generator)
    cos, sin = torch.cat([angles.cos()] * 2, 1).bfloat16(), torch.cat([angles.sin()] * 2, 1).bfloat16()
    prefix = torch.randn(2, 2, 1, kv_heads, 32, dim, generator=generator).bfloat16()

    def cache(past: int) -> SequenceCache:
        return SequenceCache([(prefix[i, 0].clone(), prefix[i, 1].clone()) for i in range(2)], (past, past))

    # Two sequences in one pass: rows 0 .. 1 after 20 cached positions, row 2 after 9 of another cache.
    wanted, got_caches = [cache(20), cache(9)], [cache(20), cache(9)]
    want = reference(x, layers, cos, sin, wanted, (0, 2, 3), heads, dim**-0.5)
    got = x.clone()
    plan = Layers(layers)
    run(library, got, plan, cos, sin, got_caches, (0, 2, 3), heads, dim**-0.5, inner)
    if not _close(got, want):
        return "disagrees with its torch reference"
    for want_cache, got_cache in zip(wanted, got_caches, strict=True):
        for want_pair, got_pair in zip(want_cache.stores, got_cache.stores, strict=True):
            if not (_close(got_pair[0], want_pair[0]) and _close(got_pair[1], want_pair[1])):
                return "writes other cache entries than its torch reference"
    for rows, past in ((slice(0, 1), 20), (slice(2, 3), 9)):  # each sequence's first token, alone
        alone = x[rows].clone()
        run(library, alone, plan, cos[rows].contiguous(), sin[rows].contiguous(), [cache(past)], (0, 1), heads,
            dim**-0.5, inner)  # fmt: skip
        if not torch.equal(alone, got[rows]):
            return "gives a token other bits in another block or beside another sequence"
    return None


@functools.cache
def compiled() -> Library | str:
    """The compiled kernel, checked once per process (whatever VIASD_KERNELS says), or why there is none."""
    for part in (w4a8.compiled(), w6a8.compiled(), attention.compiled()):  # the kernels it calls must be sound
        if not isinstance(part, Library):
            return f"the fused layers need the kernels they call: {part}"
    return checked("fused layers", _self_check)


def kernel() -> Library | str:
    """The compiled kernel, checked once per process, or why it is not used (a sentence); off where VIASD_KERNELS
    leaves it or a kernel it calls out."""
    for name in ("w4a8", "w6a8", "attention"):
        if switched_off(name):
            return OFF
    return usable("fused", compiled)


def kernel_status() -> str:
    """`compiled (BUILD)` when short passes of low-bit views run their layers in one call, else why not."""
    return status(kernel())
