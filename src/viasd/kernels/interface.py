"""What the kernels' C interface defines besides sizes, as viasd_kernels.h says it (read through cffi, as
`build.sizes` reads the sizes): the status codes its functions return, and the kinds of low-bit product."""

from __future__ import annotations

from viasd.kernels.build import constants

_STATUS = constants("viasd_status")
OK = _STATUS["VIASD_OK"]
NO_MEMORY = _STATUS["VIASD_NO_MEMORY"]  # scratch memory could not be had
BAD_SHAPE = _STATUS["VIASD_BAD_SHAPE"]  # shapes (or a product kind) the kernel does not take

_KIND = constants("viasd_kind")
FOUR_BIT = _KIND["VIASD_FOUR_BIT"]  # w4a8's packed codes, scales and minimums
SIX_BIT = _KIND["VIASD_SIX_BIT"]  # w6a8's low nibbles, high bit pairs, sub-block and super-block scales
