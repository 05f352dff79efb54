"""The table of weight formats (as ggml's type traits): each format a view's quantized layers come in, declared once
with the GGUF block types it takes as they are, its layout, kernel and dequantizer, and which stacks take it.

The rest of viasd asks this table: views/gguf.py which blocks a kernel takes and how they are converted or repacked,
views/store.py and views/quantize.py which format a copy is (each layer class of views/linears.py names its format),
passes/fused.py which product of the fused stack a layer is, models/stored.py the memory a view takes. Adding a
format is its tile (a C kernel and its binding, as w4a8.c and w4a8.py) plus one entry here and a layer class naming
it; adding a GGUF block type to a format is its conversion (kernels/gguf_blocks.py) plus one `Blocks` in the entry.

* int4a8 (w4a8.py): 4-bit codes in groups of 32 with an fp16 scale and minimum; made from dense weights or from
  Q4_K, Q4_0 and Q4_1 blocks.
* int6a8 (w6a8.py) and int8a8 (w8a8.py): made only from a GGUF file's blocks: Q6_K; Q8_0, Q5_K, Q5_0 and Q5_1.
* int8, int8wo and int4: torch's kernels (views/torch_kernels.py), made from dense weights; int8wo is also what a
  `gguf` view makes of a tensor stored in a type no format here takes (FALLBACK).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from viasd.errors import ViasdError
from viasd.kernels import gguf_blocks, w4a8, w6a8, w8a8
from viasd.kernels.interface import EIGHT_BIT, FOUR_BIT, SIX_BIT


@dataclass(frozen=True)
class Blocks:
    """A GGML block type that a format takes as it is: `convert` makes a tensor's raw bytes [rows, blocks * block
    bytes] the format's weights (None where a block leaves the format's range), `repack` names the C repacker's
    function that does the same faster (kernels/repack.c; None: numpy alone), and `scales` says where a block's fp16
    scales lie and how many there are (the repacker's check makes them finite)."""

    name: str
    convert: Callable[[np.ndarray, int, int], Any]
    repack: str | None = None
    scales: tuple[int, int] = (0, 1)


@dataclass(frozen=True)
class Format:
    """One weight format: its name (a recipe's kind and a `gguf` view's layer kind), the GGUF block types it takes as
    they are (in the order a tensor's weights are looked for), its kernel's name in VIASD_KERNELS (kernels/switch.py;
    None: torch's), the product kind the fused stack takes it as (viasd_kind; None: not fused), its weights' layout
    (a dataclass whose fields are the layer's buffers, with `tensors()`, `n` and `k`), how that layout is made
    empty, dequantized, filled at random (checks and timings) and quantized from a dense weight (None: made only
    from a file's blocks), its product (the kernel, else its torch reference) and its kernel's status, and whether
    layers that take one input compute as one product (views/linears.py `Siblings`). The torch formats have no
    layout of viasd's: those fields are None."""

    name: str
    blocks: tuple[Blocks, ...] = ()
    kernel: str | None = None
    fused: int | None = None
    weights: type | None = None
    empty: Callable[..., Any] | None = None  # (rows, columns, device="meta") -> weights
    dequantize: Callable[[Any], torch.Tensor] | None = None
    random: Callable[[int, int, torch.Generator], Any] | None = None
    quantize: Callable[[torch.Tensor], Any] | None = None
    product: Callable[[torch.Tensor, Any, torch.Tensor | None], torch.Tensor] | None = None  # x @ W^T + bias
    kernel_status: Callable[[], str] | None = None  # builds or loads its kernel; `compiled (BUILD)` or why not
    siblings: bool = False

    @property
    def types(self) -> tuple[str, ...]:
        """The GGML type names it takes."""
        return tuple(blocks.name for blocks in self.blocks)

    @property
    def keys(self) -> tuple[str, ...]:
        """The names of its weights' tensors (the layout's fields, in `tensors()`' order; no layout: none)."""
        return () if self.weights is None else tuple(f.name for f in dataclasses.fields(self.weights) if f.name != "n")

    @functools.cached_property
    def bytes_per_weight(self) -> float | None:
        """Memory its layout takes per weight (a whole tile of rows; a row of whole 256-weight super-blocks), or None
        for a torch format."""
        if self.empty is None:
            return None
        rows, columns = w4a8.TILE, 256
        return sum(t.numel() * t.element_size() for t in self.empty(rows, columns).tensors()) / (rows * columns)


INT8 = Format("int8", siblings=True)
INT8WO = Format("int8wo")
INT4 = Format("int4")
INT4A8 = Format(
    "int4a8",
    blocks=(
        Blocks("Q4_K", gguf_blocks.q4k_to_int4a8, "q4k_repack", (0, 2)),
        Blocks("Q4_0", gguf_blocks.q4_0_to_int4a8),
        Blocks("Q4_1", gguf_blocks.q4_1_to_int4a8),
    ),
    kernel="w4a8",
    fused=FOUR_BIT,
    weights=w4a8.FourBitWeights,
    empty=w4a8.empty,
    dequantize=w4a8.dequantize,
    random=w4a8.random_weights,
    product=w4a8.product,
    kernel_status=w4a8.kernel_status,
    quantize=w4a8.pack,
    siblings=True,
)
INT6A8 = Format(
    "int6a8",
    blocks=(Blocks("Q6_K", gguf_blocks.q6k_to_int6a8, "q6k_repack", (208, 1)),),
    kernel="w6a8",
    fused=SIX_BIT,
    weights=w6a8.SixBitWeights,
    empty=w6a8.empty,
    dequantize=w6a8.dequantize,
    random=w6a8.random_weights,
    product=w6a8.product,
    kernel_status=w6a8.kernel_status,
)
INT8A8 = Format(
    "int8a8",
    blocks=(
        Blocks("Q8_0", gguf_blocks.q8_0_to_int8a8, "q8_0_repack"),
        Blocks("Q5_K", gguf_blocks.q5k_to_int8a8),
        Blocks("Q5_0", gguf_blocks.q5_0_to_int8a8, "q5_0_repack"),
        Blocks("Q5_1", gguf_blocks.q5_1_to_int8a8),
    ),
    kernel="w8a8",
    fused=EIGHT_BIT,
    weights=w8a8.EightBitWeights,
    empty=w8a8.empty,
    dequantize=w8a8.dequantize,
    random=w8a8.random_weights,
    product=w8a8.product,
    kernel_status=w8a8.kernel_status,
)
FORMATS = (INT8, INT8WO, INT4, INT4A8, INT6A8, INT8A8)
FALLBACK = INT8WO  # what a `gguf` view makes of a tensor stored in a type no format takes
# The GGML types whose blocks one of viasd's kernels takes (in the order a tensor's weights are looked for), and those
# the C repacker rearranges.
KERNEL_TYPES = tuple(name for f in FORMATS for name in f.types)
REPACKED_TYPES = frozenset(b.name for f in FORMATS for b in f.blocks if b.repack is not None)


def named(name: str) -> Format:
    """The format of this name; a one-line ViasdError for any other."""
    for found in FORMATS:
        if found.name == name:
            return found
    raise ViasdError(f"unknown weight format {name!r}; viasd has {', '.join(f.name for f in FORMATS)}")


def blocks_of(gguf_type: str) -> Blocks | None:
    """How a format takes blocks of this GGML type, or None where none takes them as they are."""
    return next((b for f in FORMATS for b in f.blocks if b.name == gguf_type), None)


def taking(gguf_type: str) -> Format:
    """The format a `gguf` view makes of a tensor of this GGML type: the one that takes its blocks, else FALLBACK
    (quantized from the dense weights); a one-line ViasdError for a name that is no GGML type."""
    import gguf

    if gguf_type not in gguf.GGMLQuantizationType.__members__:
        raise ViasdError(f"{gguf_type!r} is no GGML tensor type viasd knows")
    return next((f for f in FORMATS if gguf_type in f.types), FALLBACK)


def of_weights(weights: Any) -> Format | None:
    """The format whose layout `weights` are, or None."""
    return next((f for f in FORMATS if f.weights is not None and isinstance(weights, f.weights)), None)


def of_product(kind: int) -> Format:
    """The format the fused stack takes as product kind `kind` (viasd_kind)."""
    return next(f for f in FORMATS if f.fused == kind)


def view_bytes(gguf_type: str, weights: int, nbytes: int) -> float:
    """About the memory a view's copy of a file's tensor takes (`weights` of them, `nbytes` in the file): its
    format's layout where one takes its blocks, else as many bytes as the file's."""
    found = next((f for f in FORMATS if gguf_type in f.types), None)
    per_weight = None if found is None else found.bytes_per_weight
    return nbytes if per_weight is None else weights * per_weight
