"""What the kernels' C interface defines besides sizes, as viasd_kernels.h says it (read through cffi, as
`build.sizes` reads the sizes): the status codes its functions return, the kinds of low-bit product, of norm and
of activation."""

from __future__ import annotations

from viasd.kernels.build import constants

_STATUS = constants("viasd_status")
OK = _STATUS["VIASD_OK"]
NO_MEMORY = _STATUS["VIASD_NO_MEMORY"]  # scratch memory could not be had
BAD_SHAPE = _STATUS["VIASD_BAD_SHAPE"]  # shapes (or a product kind) the kernel does not take

_KIND = constants("viasd_kind")
FOUR_BIT = _KIND["VIASD_FOUR_BIT"]  # w4a8's packed codes, scales and minimums
SIX_BIT = _KIND["VIASD_SIX_BIT"]  # w6a8's low nibbles, high bit pairs, sub-block and super-block scales
EIGHT_BIT = _KIND["VIASD_EIGHT_BIT"]  # w8a8's int8 codes, float32 scales and minimums

_NORM = constants("viasd_norm")
NORM_LLAMA = _NORM["VIASD_NORM_LLAMA"]  # rounds the normed row to bf16, then times the weight
NORM_GEMMA = _NORM["VIASD_NORM_GEMMA"]  # times (1 + weight) in float32, rounded once

_ACTIVATION = constants("viasd_activation")
SILU = _ACTIVATION["VIASD_SILU"]
GELU_TANH = _ACTIVATION["VIASD_GELU_TANH"]  # GELU's tanh approximation
