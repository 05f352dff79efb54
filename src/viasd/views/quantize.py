"""Quantized copies of a model's Linear layers, and the recipe that says how to make them.

Kinds (`QuantRecipe.kind`):

* `int8`: int8 weights with one scale per output channel; activations quantized per token at run time, so
  the matrix product runs in int8 with int32 accumulation (VNNI on x86 CPUs). On a CPU the product is
  torch's fbgemm dynamic linear, which quantizes its input with one range per tensor: each row is divided
  by its own largest magnitude first and multiplied back after (rows scale through a matrix product), and
  two extra input columns holding +1 and -1 (with zero weights) pin every row's range to [-1, 1], so the
  quantization is per token and a row's result never depends on the other rows of its block (exact
  verification relies on that). Elsewhere (CUDA) the product is `torch._int_mm`. Optional SmoothQuant-style
  smoothing moves activation outliers into the weights: per input channel j, s_j = max|x_j|^a / max|w_j|^(1-a)
  from calibration activations; the layer computes (x / s) @ (W * s)^T.
* `int8wo`: int8 weights, bf16 activations (weight-only).
* `int4`: int4 weights in groups along the input (asymmetric: a scale and a zero per group), bf16 activations.
* `int4a8`: int4 weights in groups of 32 (an fp16 scale and minimum each), activations quantized per token and
  group to int8 at run time, so a single-token pass reads 5 bits per weight and multiplies in int8 (VNNI):
  viasd's own CPU kernel (models/w4a8.py, for AVX-512 VNNI and AVX2), the cheapest single-token pass on x86.
* `gguf` (`int4a8:gguf`): the quantization of the GGUF file the model was converted from, taken over rather
  than made again: int4a8 layers with the file's own 4-bit codes, scales and minimums where it stores a tensor
  as Q4_K, 6-bit layers (`Int6Int8Linear`, models/w6a8.py) with its own codes and scales where it stores one as
  Q6_K (Q4_K_M keeps the output head and some down and value projections so), and int8 weight-only (`int8wo`)
  for any other tensor. It computes what llama.cpp computes from the same file, up to the activations'
  rounding, whereas re-quantizing the dequantized weights would round them a second time onto another grid.
  The layers kept at more bits are the sensitive ones: as int8 with int8 activations per token the default
  target's greedy top-1 agreement with bf16 was 0.954, as int8wo 0.986 (as bf16 0.994; 347 teacher-forced
  positions); as the file's own 6-bit blocks, with activations in int8 per group of 32 (outliers stay within
  their group), 0.989 (351 positions; BENCHMARKS.md).

Layers named in `keep` stay as they are (bf16): measurement shows a few are sensitive (the MLP down
projections of Qwen2.5 take activations with large outlier channels). The quantized modules are new
modules with their own (smaller) tensors; the model's own weights are never changed or copied whole: one
Linear at a time is read while its quantized copy is made.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from viasd.errors import ViasdError
from viasd.kernels import w4a8, w6a8
from viasd.kernels.cpu import cpu_flags

if TYPE_CHECKING:
    from viasd.views.gguf import GgufWeights

KINDS = ("int8", "int8wo", "int4", "int4a8")

# From how many positions that need no logits a pass reads them faster with the model's own bf16 weights (and the
# rest with the quantized copies, one extra pass) than with the quantized copies alone, on a CPU (x86 with AVX-512
# VNNI and BF16, 2 threads; `viasd costs --views full,int8,int8wo,int4,int4a8 --tokens 4,8,...,384 --context 1
# --keep 1`, BENCHMARKS.md). The weight-only kernels win on short blocks, where the weights' bytes decide, and lose
# on long ones (a prompt), where arithmetic does. Without AMX, int8 with int8 activations is never slower than
# bf16; with AMX (recent Xeons), torch's bf16 products of long blocks are several times faster and int8 loses
# from about 90 tokens on. int4a8 was measured on the AMX machine only. Not measured on other devices: no switch.
OWN_WEIGHTS_FROM_CPU: dict[str, int | None] = {"int8": None, "int8wo": 16, "int4": 32, "int4a8": 20}
OWN_WEIGHTS_FROM_AMX_CPU: dict[str, int | None] = {"int8": 96, "int8wo": 16, "int4": 32, "int4a8": 20}


@dataclass(frozen=True)
class QuantRecipe:
    """How to quantize a model's Linear layers.

    keep: glob patterns of module names left in bf16 (e.g. `*.mlp.down_proj`, `lm_head`).
    int8: glob patterns of module names quantized to int8 (with int8 activations) instead of `kind`: a mixed
        recipe, as llama.cpp's Q4_K_M keeps its output head and some down projections at 6 bits.
    smooth: the SmoothQuant migration strength a in [0, 1] (int8 only; 0: off).
    gguf: take the source GGUF file's own Q4_K blocks (int4a8 only), int8 weight-only for its other tensors.
    """

    kind: str = "int8"
    keep: tuple[str, ...] = ()
    smooth: float = 0.0
    group_size: int = 64
    int8: tuple[str, ...] = ()
    gguf: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ViasdError(f"unknown quantization {self.kind!r}; choose one of {', '.join(KINDS)}")
        if not 0.0 <= self.smooth <= 1.0:
            raise ViasdError(f"quantization smoothing must be in [0, 1], got {self.smooth}")
        if self.smooth and self.kind != "int8":
            raise ViasdError("smoothing applies to int8 (activations are quantized only there)")
        if self.int8 and self.kind == "int8":
            raise ViasdError("int8=PATTERN mixes int8 layers into another kind; this recipe is int8 already")
        if self.gguf and self.kind != "int4a8":
            raise ViasdError("gguf takes a GGUF file's 4-bit blocks as int4a8 layers; write int4a8:gguf or gguf")
        if self.kind == "int4a8" and self.group_size != 64:
            raise ViasdError("int4a8's groups are fixed at 32 inputs (group=G is for int4)")
        if self.group_size not in (32, 64, 128, 256):
            raise ViasdError(f"int4 group size must be 32, 64, 128 or 256, got {self.group_size}")

    @property
    def name(self) -> str:
        """A short stable name, e.g. `int8:smooth=0.5:keep=*.mlp.down_proj`."""
        parts = [self.kind]
        if self.smooth:
            parts.append(f"smooth={self.smooth:g}")
        if self.kind == "int4" and self.group_size != 64:
            parts.append(f"group={self.group_size}")
        if self.gguf:
            parts.append("gguf")
        if self.keep:
            parts.append("keep=" + ",".join(self.keep))
        if self.int8:
            parts.append("int8=" + ",".join(self.int8))
        return ":".join(parts)

    @classmethod
    def parse(cls, text: str) -> QuantRecipe:
        """`KIND[:smooth=A][:group=G][:keep=PATTERN,...][:int8=PATTERN,...]`, as `name` writes it, or a preset
        (`int4a8m`: int4a8 with the LM head and the MLP down projections in int8; `gguf`: `int4a8:gguf`; names
        that fit a method variant)."""
        kind, *options = text.strip().split(":")
        values: dict[str, Any] = {}
        if kind in PRESETS:
            kind, preset = PRESETS[kind]
            values.update(preset)
        for option in options:
            key, sep, value = option.partition("=")
            try:
                if key == "smooth" and sep:
                    values["smooth"] = float(value)
                elif key == "group" and sep:
                    values["group_size"] = int(value)
                elif key == "keep" and sep:
                    values["keep"] = tuple(p for p in value.split(",") if p)
                elif key == "int8" and sep:
                    values["int8"] = tuple(p for p in value.split(",") if p)
                elif key == "gguf" and not sep:
                    values["gguf"] = True
                else:
                    raise ValueError
            except ValueError:
                raise ViasdError(
                    f"bad quantization option {option!r} in {text!r}: write smooth=A, group=G, keep=PATTERN,..., "
                    "int8=PATTERN,... or gguf"
                ) from None
        return cls(kind, **values)

    def own_weights_from(self, device: torch.device) -> int | None:
        """Tokens from which the positions of a pass that need no logits are read faster by the model's own
        weights (OWN_WEIGHTS_FROM_CPU, or OWN_WEIGHTS_FROM_AMX_CPU on CPUs with AMX); None: never."""
        if device.type != "cpu":
            return None
        return (OWN_WEIGHTS_FROM_AMX_CPU if "amx_bf16" in cpu_flags() else OWN_WEIGHTS_FROM_CPU)[self.kind]

    def keeps(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.keep)

    def kind_of(self, name: str) -> str:
        """The kind the named layer is quantized to: int8 where an `int8` pattern names it, else `kind`."""
        return "int8" if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.int8) else self.kind


# Recipes by a short name that fits where ':' and ',' cannot go (a method variant: `plain:quant=int4a8m`).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "int4a8m": ("int4a8", {"int8": ("lm_head", "*.mlp.down_proj")}),
    "gguf": ("int4a8", {"gguf": True}),
}


# ------------------------------------------------------------------------------------------ modules


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


_ANCHORS = torch.tensor([[1.0, -1.0]])  # the two columns that pin every row's range to [-1, 1]


def _fbgemm() -> bool:
    """Whether torch has its x86 int8 kernels (fbgemm), the fast int8 path on CPUs."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def _fbgemm_reduce_range() -> bool:
    """Whether fbgemm must quantize activations to 7 bits here. Without AVX-512 VNNI its products are AVX2's
    maddubs, which adds two byte products in 16 bits: 255 * 127 * 2 saturates them, 127 * 127 * 2 does not."""
    return "avx512_vnni" not in cpu_flags()


class Int8DynamicLinear(nn.Module):
    """y = x @ W^T + b with W in int8 (per output channel) and x quantized per token (row) at run time."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.siblings is not None:
            return self.siblings.output(x, self)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b for this layer alone."""
        rows = _flat(x).float()
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
    """Compute sibling int8 or int4a8 layers together (see `Siblings`); layers with smoothing keep their own."""
    for names in SIBLINGS:
        parents = {name.rpartition(".")[0] for name in modules if name.rpartition(".")[2] == names[0]}
        for parent in parents:
            members = [modules.get(f"{parent}.{child}" if parent else child) for child in names]
            kind = type(members[0])
            if kind in (Int8DynamicLinear, Int4Int8Linear) and all(
                type(m) is kind and getattr(m, "inv_smooth", None) is None for m in members
            ):
                group = Siblings(members)  # type: ignore[arg-type]
                for member in members:
                    member.siblings = group  # type: ignore[union-attr]


class Int8WeightOnlyLinear(nn.Module):
    """y = x @ W^T + b with W in int8 (per output channel), x as it comes (bf16)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out], the activations' dtype
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
        q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, scale.to(linear.weight.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _flat(x)
        out = torch.ops.aten._weight_int8pack_mm(rows.to(self.scale.dtype), self.weight, self.scale)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


class Int4WeightOnlyLinear(nn.Module):
    """y = x @ W^T + b with W in int4 groups along the input (a scale and a zero per group), x in bf16."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("packed", packed)  # torch's CPU int4 layout
        self.register_buffer("scales_zeros", scales_zeros)  # [in / group, out, 2] bf16
        self.register_buffer("bias", bias)
        self.group_size = group_size

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = _flat(x).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)


class Int4Int8Linear(nn.Module):
    """y = x @ W^T + b with W in int4 groups of 32 and x quantized per token and group to int8 (models/w4a8.py)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("packed", packed)  # [out, in / 2] uint8, two codes per byte
        self.register_buffer("scale", scale)  # [out, in / 32] fp16
        self.register_buffer("low", low)  # [out, in / 32] fp16, each group's minimum
        self.register_buffer("bias", bias)
        self.siblings: Siblings | None = None  # layers that take the same input, computed in one product

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @classmethod
    def stacked(cls, members: Sequence[Int4Int8Linear]) -> Int4Int8Linear:
        """One layer whose outputs are the members' outputs side by side. The members' tensors become row slices of
        the stacked ones, so stacking costs no memory."""
        tensors = (torch.cat([getattr(m, key) for m in members]) for key in ("packed", "scale", "low"))
        fused = cls(*tensors, stacked_bias(members))
        start = 0
        for member in members:
            stop = start + member.out_features
            for key in ("packed", "scale", "low"):
                setattr(member, key, getattr(fused, key)[start:stop])
            start = stop
        return fused

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    ) -> Int4Int8Linear:
        """The layer's copy: `blocks` (packed codes, scales, minimums of the same weight, e.g. a GGUF file's own)
        when given, else its weight quantized here."""
        if linear.in_features % w4a8.CHUNK:
            raise ViasdError(f"int4a8: {linear.in_features} input features are not a multiple of {w4a8.CHUNK}")
        packed, scale, low = blocks if blocks is not None else w4a8.pack(linear.weight)
        device = linear.weight.device
        packed, scale, low = packed.to(device), scale.to(device), low.to(device)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        w4a8.kernel_status()  # build (once per machine) or load the kernel now, not in the first pass
        return cls(packed, scale, low, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.siblings is not None:
            return self.siblings.output(x, self)
        return self.product(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b for this layer alone."""
        out = w4a8.product(_flat(x), self.packed, self.scale, self.low, self.bias)
        return out.reshape(*x.shape[:-1], -1)


class Int6Int8Linear(nn.Module):
    """y = x @ W^T + b with W a GGUF file's 6-bit (Q6_K) weights and x quantized per token and group to int8
    (models/w6a8.py). Made only from a file's blocks: there is no 6-bit recipe of dense weights."""

    def __init__(self, weights: w6a8.SixBitWeights, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("low", weights.low)  # [out, in / 2] uint8, the codes' low nibbles
        self.register_buffer("high", weights.high)  # [out, in / 4] uint8, their top two bits
        self.register_buffer("sub", weights.sub)  # [out, in / 16] int8, a scale per 16 inputs
        self.register_buffer("d", weights.d)  # [out, in / 256] fp16, a scale per 256 inputs
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, weights: w6a8.SixBitWeights) -> Int6Int8Linear:
        device = linear.weight.device
        moved = w6a8.SixBitWeights(*(t.to(device) for t in weights.tensors()))
        bias = None if linear.bias is None else linear.bias.detach().clone()
        w6a8.kernel_status()  # build (once per machine) or load the kernel now, not in the first pass
        return cls(moved, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = w6a8.SixBitWeights(self.low, self.high, self.sub, self.d)
        return w6a8.product(_flat(x), weights, self.bias).reshape(*x.shape[:-1], -1)


# --------------------------------------------------------------------------------------- a model's copy


def quantizable(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers a recipe may quantize: every Linear of the decoder and the LM head."""
    return {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def activation_ranges(model: nn.Module, names: Sequence[str], sequences: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Per input channel, the largest |activation| that each named Linear sees over the token sequences."""
    modules = dict(model.named_modules())
    ranges: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax = _flat(args[0]).abs().amax(dim=0).float()
            ranges[name] = amax if name not in ranges else torch.maximum(ranges[name], amax)

        return record

    handles = [modules[name].register_forward_pre_hook(hook(name)) for name in names]
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for ids in sequences:
                model(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return ranges


def smoothing(act_range: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factor s = max|x|^a / max|w|^(1-a) (clamped away from 0)."""
    w_range = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    return (act_range.clamp_min(1e-5).pow(alpha) / w_range.pow(1.0 - alpha)).clamp_min(1e-5)


@dataclass(eq=False)
class QuantizedLinears:
    """A model's quantized Linear layers by module name, swapped in for a pass by `applied`.

    Compared by identity: two quantizations are never the same view, even of the same recipe.
    """

    recipe: QuantRecipe
    modules: dict[str, nn.Module] = field(default_factory=dict)
    from_file: int = 0  # how many layers took a GGUF file's own blocks (4- or 6-bit)
    _owners: dict[int, list[tuple[nn.Module, str, nn.Module]]] = field(default_factory=dict, repr=False)

    def nbytes(self) -> int:
        """Memory the quantized copies take (the model's own weights are not counted)."""
        return sum(t.numel() * t.element_size() for m in self.modules.values() for t in m.buffers())

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """Run `model` with these layers swapped in; restored on exit (also on error). Not re-entrant."""
        if id(model) not in self._owners:  # (parent, attribute, quantized copy), looked up once per model
            owners = dict(model.named_modules())
            self._owners[id(model)] = [
                (owners[name.rpartition(".")[0]], name.rpartition(".")[2], module)
                for name, module in self.modules.items()
            ]
        # Each swapped layer is a registered submodule of its parent, so swapping is one entry of the parent's
        # `_modules` (what nn.Module.__setattr__ ends up doing for a module, minus its checks: some 200 swaps in
        # and out per pass of a quantized view cost 1-2 ms of a 40 ms decoding step that way).
        swapped: list[tuple[dict[str, nn.Module | None], str, nn.Module | None]] = []
        try:
            for parent, child, module in self._owners[id(model)]:
                registry = parent._modules
                swapped.append((registry, child, registry[child]))
                registry[child] = module
            yield
        finally:
            for registry, child, original in reversed(swapped):
                registry[child] = original


def quantize(
    model: nn.Module,
    recipe: QuantRecipe,
    sequences: Sequence[Sequence[int]] = (),
    gguf: GgufWeights | None = None,
) -> QuantizedLinears:
    """Quantized copies of the model's Linear layers by `recipe` (`sequences`: token ids for smoothing). A `gguf`
    recipe takes the 4-bit blocks of `gguf`, the file the model was converted from, where it stores them as Q4_K,
    and makes the other layers int8 weight-only."""
    if recipe.gguf and gguf is None:
        raise ViasdError("quantization gguf takes the blocks of the GGUF file the model came from: it has none")
    names = [name for name in quantizable(model) if not recipe.keeps(name)]
    if not names:
        raise ViasdError(f"quantization {recipe.name}: it keeps every Linear layer; nothing to quantize")
    ranges: Mapping[str, torch.Tensor] = {}
    if recipe.smooth:
        if not sequences:
            raise ViasdError("smoothing needs calibration token sequences")
        ranges = activation_ranges(model, names, sequences)
    layers = quantizable(model)
    out = QuantizedLinears(recipe)
    with torch.inference_mode():
        for name in names:
            linear = layers[name]
            kind = recipe.kind_of(name)
            if kind == "int8":
                smooth = smoothing(ranges[name], linear.weight, recipe.smooth) if name in ranges else None
                out.modules[name] = Int8DynamicLinear.from_linear(linear, smooth)
            elif kind == "int8wo":
                out.modules[name] = Int8WeightOnlyLinear.from_linear(linear)
            elif kind == "int4a8" and gguf is not None and recipe.gguf:
                weight = linear.weight
                out.modules[name] = _from_file(linear, gguf.int4a8(name, weight), gguf.int6a8(name, weight))
                out.from_file += not isinstance(out.modules[name], Int8WeightOnlyLinear)
            elif kind == "int4a8":
                out.modules[name] = Int4Int8Linear.from_linear(linear)
            else:
                out.modules[name] = Int4WeightOnlyLinear.from_linear(linear, recipe.group_size)
    join_siblings(out.modules)
    return out


def _from_file(
    linear: nn.Linear,
    four: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    six: w6a8.SixBitWeights | None,
) -> nn.Module:
    """A layer's copy from its GGUF file's own blocks (4-bit, else 6-bit); int8 weight-only where the file has
    neither for it (int8 keeps what a tensor stored at more bits holds)."""
    if four is not None:
        return Int4Int8Linear.from_linear(linear, four)
    if six is not None:
        return Int6Int8Linear.from_linear(linear, six)
    return Int8WeightOnlyLinear.from_linear(linear)
