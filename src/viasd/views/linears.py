"""The quantized Linear layers a view swaps in for a model's own: int8 with int8 activations (torch's fbgemm, or
`torch._int_mm`), int8 and int4 weight-only (torch's kernels, their operands checked first: views/torch_kernels.py),
int4 x int8, 6-bit x int8 and int8 x int8 in groups (viasd's kernels, kernels/w4a8.py, w6a8.py and w8a8.py), and
`Siblings`, layers that take the same input computed as one product.

The modules are new ones with their own (smaller) tensors; the model's own weights are never changed or copied
whole: one Linear at a time is read while its quantized copy is made (views/quantize.py).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from viasd.errors import ViasdError
from viasd.kernels import formats, w4a8
from viasd.kernels.cpu import cpu_flags
from viasd.kernels.formats import Format
from viasd.models.stored import weight_device, weight_dtype
from viasd.views.torch_kernels import (
    int4_weight_only,
    int4_weights,
    int8_weight_only,
    int8_weight_only_fault,
    int8_weights,
)

if TYPE_CHECKING:
    from viasd.views.recipe import QuantRecipe


def flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


_ANCHORS = torch.tensor([[1.0, -1.0]])  # the two columns that pin every row's range to [-1, 1]


def _meta(linear: nn.Linear) -> nn.Linear:
    """A Linear of `linear`'s shapes and weight dtype on the meta device: what a probe (`empty`) is made from."""
    meta = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    return meta.to(weight_dtype(linear))


def _fbgemm() -> bool:
    """Whether torch has its x86 int8 kernels (fbgemm), the fast int8 path on CPUs."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def _fbgemm_reduce_range() -> bool:
    """Whether fbgemm must quantize activations to 7 bits here. Without AVX-512 VNNI its products are AVX2's
    maddubs, which adds two byte products in 16 bits: 255 * 127 * 2 saturates them, 127 * 127 * 2 does not."""
    return "avx512_vnni" not in cpu_flags()


class Int8DynamicLinear(nn.Module):
    """y = x @ W^T + b with W in int8 (per output channel) and x quantized per token (row) at run time."""

    format: ClassVar[Format] = formats.INT8

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, smooth: torch.Tensor | None
    ):
        super().__init__()
        self.register_buffer("weight_t", weight.t().contiguous())  # [in, out] int8: the layout _int_mm takes
        self.register_buffer("scale", scale.float())  # [out]
        self.register_buffer("bias", bias)
        self.register_buffer("inv_smooth", None if smooth is None else (1.0 / smooth))  # [in], x is divided by s
        self._packed: Any = None  # fbgemm's packed copy of the weight, made at the first CPU pass
        self.siblings: Siblings | None = None  # layers that take the same input, computed in one product

    @property
    def out_features(self) -> int:
        return self.weight_t.shape[1]

    @classmethod
    def stacked(cls, members: Sequence[Int8DynamicLinear]) -> Int8DynamicLinear:
        """One layer whose outputs are the members' outputs side by side (a copy of their weights)."""
        weights = torch.cat([m.weight_t for m in members], dim=1).t()
        return cls(weights, torch.cat([m.scale for m in members]), stacked_bias(members), None)

    def prepare(self) -> None:
        """Pack the weights for torch's CPU int8 kernel now (see `QuantizedLinears.prepare`): this layer's, or the
        stacked layer's that computes it with its siblings."""
        computes = self.siblings.fused if self.siblings is not None else self
        if computes.weight_t.device.type == "cpu" and _fbgemm():
            computes._fbgemm_packed()

    def _fbgemm_packed(self) -> Any:
        if self._packed is None:
            weight = self.weight_t.t()
            anchors = torch.zeros(weight.shape[0], 2, dtype=torch.int8)  # zero weights for the +1/-1 columns
            weight = torch.cat([weight, anchors], dim=1).contiguous()
            zeros = torch.zeros(weight.shape[0], dtype=torch.long)
            with warnings.catch_warnings():  # torch marks its quantized tensors deprecated; 2.13 still has them
                warnings.simplefilter("ignore", UserWarning)
                quantized = torch._make_per_channel_quantized_tensor(weight, self.scale.double(), zeros, 0)
                self._packed = torch.ops.quantized.linear_prepack(quantized, None)
        return self._packed

    @classmethod
    def from_linear(cls, linear: nn.Linear, smooth: torch.Tensor | None = None) -> Int8DynamicLinear:
        weight = linear.weight.detach().float()
        if smooth is not None:
            weight = weight * smooth[None, :]
        scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale, bias, None if smooth is None else smooth.to(linear.weight.dtype))

    @classmethod
    def empty(cls, linear: nn.Linear, recipe: QuantRecipe) -> Int8DynamicLinear:
        """A module of the shapes and dtypes `linear`'s copy by `recipe` has, on the meta device (a cached copy's
        tensors go in its place)."""
        smooth = torch.ones(linear.in_features, device="meta") if recipe.smooth else None
        return cls.from_linear(_meta(linear), smooth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.siblings is not None:
            return self.siblings.output(x, self)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b for this layer alone."""
        rows = flat(x).float()
        if self.inv_smooth is not None:
            rows = rows * self.inv_smooth
        amax = rows.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        if rows.device.type == "cpu" and _fbgemm():
            pinned = torch.cat([rows / amax, _ANCHORS.expand(rows.shape[0], 2)], dim=1)
            out = torch.ops.quantized.linear_dynamic(pinned, self._fbgemm_packed(), _fbgemm_reduce_range()) * amax
        else:
            step = amax / 127.0
            q = torch.round(rows / step).to(torch.int8)
            out = torch._int_mm(q, self.weight_t).float() * step * self.scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


# Layers of one block that read the same input, by the names Llama-style decoders give them.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Siblings:
    """Quantized layers that take the same input (a block's q, k and v projections; its gate and up projections),
    computed as one product: the input is quantized once and the weights are read in one pass. The first
    sibling called with an input computes every sibling's output; the others take their columns of it."""

    def __init__(self, members: Sequence[Int8DynamicLinear | Int4Int8Linear]) -> None:
        self.fused = type(members[0]).stacked(members)
        edges = torch.tensor([0, *(m.out_features for m in members)]).cumsum(0).tolist()
        self.columns = {id(m): (edges[i], edges[i + 1]) for i, m in enumerate(members)}
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def output(self, x: torch.Tensor, member: nn.Module) -> torch.Tensor:
        if x is not self._input:  # holding the input keeps its identity from being reused by another tensor
            self._output = self.fused.product(x)
            self._input = x
        assert self._output is not None
        start, stop = self.columns[id(member)]
        return self._output[..., start:stop]


def stacked_bias(members: Sequence[nn.Module]) -> torch.Tensor | None:
    """The members' biases side by side in float32 (zeros for a member without one); None where none has one."""
    if all(m.bias is None for m in members):
        return None
    return torch.cat([torch.zeros(m.out_features) if m.bias is None else m.bias.float() for m in members])


def join_siblings(modules: Mapping[str, nn.Module]) -> None:
    """Compute sibling int8 or int4a8 layers together (see `Siblings`); layers with smoothing keep their own, and so
    do int4a8 layers that are not whole tiles of rows."""
    for names in SIBLINGS:
        parents = {name.rpartition(".")[0] for name in modules if name.rpartition(".")[2] == names[0]}
        for parent in parents:
            members = [modules.get(f"{parent}.{child}" if parent else child) for child in names]
            kind = type(members[0])
            found = format_of(members[0])  # type: ignore[arg-type]
            if (
                found is not None
                and found.siblings
                and all(type(m) is kind and getattr(m, "inv_smooth", None) is None for m in members)
                and (not issubclass(kind, LowBitLinear) or all(m.out_features % w4a8.TILE == 0 for m in members))
            ):
                group = Siblings(members)  # type: ignore[arg-type]
                for member in members:
                    member.siblings = group  # type: ignore[union-attr]


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ W^T + b with W in int8 (per output channel), x as it comes (bf16)."""

    format: ClassVar[Format] = formats.INT8WO

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out], the activations' dtype
        self.register_buffer("bias", bias)
        self._checked: tuple[torch.Tensor, torch.Tensor] | None = None  # the buffers torch's kernel was checked on

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        fault = int8_weight_only_fault(linear.in_features)
        if fault is not None:
            raise ViasdError(f"int8wo: {fault}")
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale.to(linear.weight.dtype), bias)

    @classmethod
    def empty(cls, linear: nn.Linear, recipe: QuantRecipe) -> Int8WeightOnlyLinear:
        """A module of the shapes `linear`'s copy has, on the meta device (as `Int8DynamicLinear.empty`)."""
        return cls.from_linear(_meta(linear))

    def prepare(self) -> None:
        """Check the weights for torch's kernel now (see `QuantizedLinears.prepare`), not in the first pass."""
        self._sound()

    def _sound(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as torch's kernel takes them (views/torch_kernels.py), checked again whenever the buffers
        are other tensors (a copy read from the cache, a move to another device), else as checked last."""
        if self._checked is None or self._checked[0] is not self.weight or self._checked[1] is not self.scale:
            self.weight, self.scale = int8_weights(self.weight, self.scale)
            self._checked = (self.weight, self.scale)
        return self._checked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, scale = self._sound()
        out = int8_weight_only(flat(x).to(scale.dtype), weight, scale)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


class Int4WeightOnlyLinear(nn.Module):
    """y = x @ W^T + b with W in int4 groups along the input (a scale and a zero per group), x in bf16."""

    format: ClassVar[Format] = formats.INT4

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("packed", packed)  # torch's CPU int4 layout
        self.register_buffer("scales_zeros", scales_zeros)  # [in / group, out, 2] bf16
        self.register_buffer("bias", bias)
        self.group_size = group_size
        self._checked: tuple[torch.Tensor, torch.Tensor] | None = None  # the buffers torch's kernel was checked on

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 64) -> Int4WeightOnlyLinear:
        out_features, in_features = linear.weight.shape
        if in_features % group_size:
            raise ViasdError(f"int4: {in_features} input features are not a multiple of the group size {group_size}")
        groups = linear.weight.detach().float().reshape(out_features, in_features // group_size, group_size)
        low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15.0).clamp_min(1e-12)
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
        # torch's kernel dequantises (q - 8) * scale + zero, so zero = low + 8 * scale.
        scales_zeros = torch.cat([scale, low + 8.0 * scale], dim=-1).transpose(0, 1).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(packed, scales_zeros.to(torch.bfloat16), group_size, bias)

    @classmethod
    def empty(cls, linear: nn.Linear, recipe: QuantRecipe) -> Int4WeightOnlyLinear:
        """A module of `linear`'s shapes, on the meta device: torch's CPU int4 packing keeps [out, in/2] bytes and
        [in/group, out, 2] bf16 scales and zeros (packing a zero weight of the same shape instead took seconds)."""
        empty = functools.partial(torch.empty, device="meta")
        rows, columns = linear.out_features, linear.in_features
        packed = empty(rows, columns // 2, dtype=torch.uint8)
        scales_zeros = empty(columns // recipe.group_size, rows, 2, dtype=torch.bfloat16)
        bias = None if linear.bias is None else empty(rows, dtype=linear.bias.dtype)
        return cls(packed, scales_zeros, recipe.group_size, bias)

    def prepare(self) -> None:
        """Check the weights for torch's kernel now (see `QuantizedLinears.prepare`), not in the first pass."""
        self._sound()

    def _sound(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as torch's kernel takes them (as `Int8WeightOnlyLinear._sound`)."""
        if self._checked is None or self._checked[0] is not self.packed or self._checked[1] is not self.scales_zeros:
            self.packed, self.scales_zeros = int4_weights(self.packed, self.group_size, self.scales_zeros)
            self._checked = (self.packed, self.scales_zeros)
        return self._checked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, scales_zeros = self._sound()
        out = int4_weight_only(flat(x).to(torch.bfloat16), packed, self.group_size, scales_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


class LowBitLinear(nn.Module):
    """y = x @ W^T + b with W in one of viasd's low-bit formats (`format`, kernels/formats.py) and x quantized per
    token and group to int8 by its kernel, in the kernel's tiles of 16 rows: the buffers are the weights' tensors,
    by the names of their layout's fields, and the bias."""

    format: ClassVar[Format]

    def __init__(self, weights: Any, bias: torch.Tensor | None) -> None:
        super().__init__()
        for key, tensor in zip(self.format.keys, weights.tensors(), strict=True):
            self.register_buffer(key, tensor)
        self.register_buffer("bias", bias)
        self.out_features = weights.n

    @property
    def weights(self) -> Any:
        return self.format.weights(*(getattr(self, key) for key in self.format.keys), self.out_features)  # type: ignore[misc]

    @classmethod
    def from_linear(cls, linear: nn.Linear, weights: Any = None) -> Any:
        """The layer's copy: `weights` (the same weight in the format's layout, e.g. a GGUF file's own) when given,
        else its weight quantized here (where the format is made from dense weights)."""
        name = cls.format.name
        if linear.in_features % w4a8.GROUP:
            raise ViasdError(f"{name}: {linear.in_features} input features are not a multiple of {w4a8.GROUP}")
        if weights is None:
            if cls.format.quantize is None:
                raise ViasdError(f"{name} layers are made only from a GGUF file's blocks")
            weights = cls.format.quantize(linear.weight)
        device = weight_device(linear)
        moved = type(weights)(*(t.to(device) for t in weights.tensors()), weights.n)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        cls.format.kernel_status()  # type: ignore[misc]  # build (once per machine) or load the kernel now
        return cls(moved, bias)

    @classmethod
    def empty(cls, linear: nn.Linear, recipe: QuantRecipe) -> Any:
        """A module of the shapes and dtypes `linear`'s copy has, on the meta device (shapes only: packing a meta
        weight instead ran every packing op, about 5 ms a layer at each start)."""
        return cls(cls.format.empty(linear.out_features, linear.in_features), _meta(linear).bias)  # type: ignore[misc]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b for this layer alone."""
        return self.format.product(flat(x), self.weights, self.bias).reshape(*x.shape[:-1], -1)  # type: ignore[misc]


class Int4Int8Linear(LowBitLinear):
    """int4a8: W in int4 groups of 32 with an fp16 scale and minimum each (kernels/w4a8.py), from dense weights or a
    GGUF file's 4-bit blocks; siblings compute as one product."""

    format: ClassVar[Format] = formats.INT4A8

    def __init__(self, weights: w4a8.FourBitWeights, bias: torch.Tensor | None):
        super().__init__(weights, bias)
        self.siblings: Siblings | None = None  # layers that take the same input, computed in one product

    @classmethod
    def stacked(cls, members: Sequence[Int4Int8Linear]) -> Int4Int8Linear:
        """One layer whose outputs are the members' outputs side by side (each a whole number of tiles). The
        members' tensors become tile slices of the stacked ones, so stacking costs no memory."""
        keys = cls.format.keys
        tensors = [torch.cat([getattr(m, key) for m in members]) for key in keys]
        n = sum(m.out_features for m in members)
        fused = cls(w4a8.FourBitWeights(*tensors, n), stacked_bias(members))
        start = 0
        for member in members:
            stop = start + member.packed.shape[0]
            for key in keys:
                setattr(member, key, getattr(fused, key)[start:stop])
            start = stop
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.siblings is not None:
            return self.siblings.output(x, self)
        return self.product(x)


class Int6Int8Linear(LowBitLinear):
    """int6a8: W a GGUF file's 6-bit (Q6_K) weights (kernels/w6a8.py). Made only from a file's blocks: there is no
    6-bit recipe of dense weights."""

    format: ClassVar[Format] = formats.INT6A8


class Int8Int8Linear(LowBitLinear):
    """int8a8: W a GGUF file's Q8_0, Q5_K, Q5_0 or Q5_1 weights as int8 codes in groups of 32 with a float32 scale and
    minimum each (kernels/w8a8.py). Made only from a file's blocks (views/gguf.py)."""

    format: ClassVar[Format] = formats.INT8A8


# Every quantized layer class, one per format (`layer_class`).
LAYERS: tuple[type[nn.Module], ...] = (
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    Int4WeightOnlyLinear,
    Int4Int8Linear,
    Int6Int8Linear,
    Int8Int8Linear,
)


def layer_class(name: str) -> type[nn.Module]:
    """The layer class of the format named `name` (kernels/formats.py); a one-line ViasdError for an unknown one."""
    wanted = formats.named(name)
    return next(layer for layer in LAYERS if layer.format is wanted)  # type: ignore[attr-defined]


def format_of(module: nn.Module) -> Format | None:
    """The format of a quantized layer, or None for another module."""
    return getattr(type(module), "format", None)
