"""Quantization recipes: which kind of quantized copy each Linear layer of a model gets (parsed once, at the edge:
the command line, a method variant or a routing profile, then passed on as this value).

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
  viasd's own CPU kernel (kernels/w4a8.py, for AVX-512 VNNI and AVX2), the cheapest single-token pass on x86.
* `gguf` (`int4a8:gguf`): the quantization of the GGUF file the model was converted from, taken over rather
  than made again: int4a8 layers with the file's own 4-bit codes, scales and minimums where it stores a tensor
  as Q4_K, Q4_0 or Q4_1, 6-bit layers (`Int6Int8Linear`, kernels/w6a8.py) with its own codes and scales where it
  stores one as Q6_K (Q4_K_M keeps the output head and some down and value projections so), 8-bit layers
  (`Int8Int8Linear`, kernels/w8a8.py) where it stores one as Q8_0, Q5_K, Q5_0 or Q5_1, and int8 weight-only
  (`int8wo`) for any other tensor (views/gguf.py). It computes what llama.cpp computes from the same file, up to
  the activations' rounding, whereas re-quantizing the dequantized weights would round them a second time onto
  another grid.
  The layers kept at more bits are the sensitive ones: as int8 with int8 activations per token the default
  target's greedy top-1 agreement with bf16 was 0.954, as int8wo 0.986 (as bf16 0.994; 347 teacher-forced
  positions); as the file's own 6-bit blocks, with activations in int8 per group of 32 (outliers stay within
  their group), 0.989 (351 positions; BENCHMARKS.md).

Layers named in `keep` stay as they are (bf16): measurement shows a few are sensitive (the MLP down projections of
Qwen2.5 take activations with large outlier channels). This module is free of torch, so that parsing stays cheap.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from viasd.errors import ViasdError
from viasd.kernels.cpu import cpu_flags

KINDS = ("int8", "int8wo", "int4", "int4a8")

# From how many positions that need no logits a pass reads them faster with the model's own bf16 weights (and the
# rest with the quantized copies, one extra pass) than with the quantized copies alone, on a CPU (x86 with AVX-512
# VNNI and BF16, 2 threads; `viasd costs --views full,int8,int8wo,int4,int4a8 --tokens 4,8,...,384 --context 1
# --keep 1`, BENCHMARKS.md). The weight-only kernels win on short blocks, where the weights' bytes decide, and lose
# on long ones (a prompt), where arithmetic does. Without AMX, int8 with int8 activations is never slower than
# bf16; with AMX (recent Xeons), torch's bf16 products of long blocks are several times faster and int8 loses
# from about 90 tokens on. int4a8's tiled kernel beats bf16 at every length on a Zen 5 EPYC (256 tokens: 834 ms
# against 1041; `viasd costs --views full,int4a8,gguf --tokens 8,16,32,64,128,256 --context 1 --keep 1`); its AMX
# figure is the earlier kernel's. Not measured on other devices: no switch.
OWN_WEIGHTS_FROM_CPU: dict[str, int | None] = {"int8": None, "int8wo": 16, "int4": 32, "int4a8": None}
OWN_WEIGHTS_FROM_AMX_CPU: dict[str, int | None] = {"int8": 96, "int8wo": 16, "int4": 32, "int4a8": 20}


@dataclass(frozen=True)
class QuantRecipe:
    """How to quantize a model's Linear layers.

    keep: glob patterns of module names left in bf16 (e.g. `*.mlp.down_proj`, `lm_head`).
    int8: glob patterns of module names quantized to int8 (with int8 activations) instead of `kind`: a mixed
        recipe, as llama.cpp's Q4_K_M keeps its output head and some down projections at 6 bits.
    smooth: the SmoothQuant migration strength a in [0, 1] (int8 only; 0: off).
    gguf: take the source GGUF file's own blocks where a kernel takes their type (int4a8 only; views/gguf.py), int8
        weight-only for its other tensors.
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
            raise ViasdError("gguf takes a GGUF file's blocks, 4-bit ones as int4a8 layers; write int4a8:gguf or gguf")
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

    def own_weights_from(self, device_type: str) -> int | None:
        """Tokens from which the positions of a pass that need no logits are read faster by the model's own
        weights on a device of this type (OWN_WEIGHTS_FROM_CPU, or OWN_WEIGHTS_FROM_AMX_CPU on CPUs with AMX);
        None: never."""
        if device_type != "cpu":
            return None
        return (OWN_WEIGHTS_FROM_AMX_CPU if "amx_bf16" in cpu_flags() else OWN_WEIGHTS_FROM_CPU)[self.kind]

    def keeps(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.keep)

    def kind_of(self, name: str) -> str:
        """The kind the named layer is quantized to: int8 where an `int8` pattern names it, else `kind`."""
        return "int8" if any(fnmatch.fnmatchcase(name, pattern) for pattern in self.int8) else self.kind


# What the target runs as, besides a recipe (`--quant`, a method's `quant=`; parsed at the edge, parse_target_quant):
# AS_STORED, the default: a model that comes from a GGUF file runs as the file stores it (its `gguf` view), any other
# model as loaded; DENSE (`none`): the model as loaded, its dense (bf16) weights, which for a model from a GGUF file
# are a copy dequantized from it (one more rounding of the file's weights).
AS_STORED = "file"
DENSE = "none"
TargetQuant = QuantRecipe | str  # a recipe, AS_STORED or DENSE


def parse_target_quant(text: str) -> TargetQuant:
    """`none` (DENSE), or a quantization recipe (`QuantRecipe.parse`)."""
    return DENSE if text.strip() == DENSE else QuantRecipe.parse(text)


# Recipes by a short name that fits where ':' and ',' cannot go (a method variant: `plain:quant=int4a8m`).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "int4a8m": ("int4a8", {"int8": ("lm_head", "*.mlp.down_proj")}),
    "gguf": ("int4a8", {"gguf": True}),
}
