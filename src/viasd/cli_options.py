"""Command-line options that every model-loading command shares, declared once, and the EngineSpec they make.

`viasd generate`, `bench`, `serve` and `calibrate` take the same model options with the same meaning; each
command declares them with these aliases and turns them into an EngineSpec with `engine_spec`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from viasd.spec import EngineSpec
from viasd.speculation import DEFAULT_SUFFIX_CACHE

TargetOpt = Annotated[
    str, typer.Option("--target", "-t", help="Target: default model name, directory, .gguf or hub id.")
]
DrafterOpt = Annotated[str, typer.Option("--drafter", "-d", help="Drafter model (same tokenizer as the target).")]
ProfileOpt = Annotated[str | None, typer.Option(help="Routing profile JSON for the via methods.")]
GammaOpt = Annotated[int | None, typer.Option(help="Draft tokens per round (default: 4, or the profile's).")]
DeviceOpt = Annotated[str | None, typer.Option(help="Device, e.g. cpu, cuda, cuda:1 (default: cuda if present).")]
DtypeOpt = Annotated[str, typer.Option(help="Weights dtype: auto, bf16, fp16, fp32.")]
DeviceMapOpt = Annotated[str | None, typer.Option(help="'auto' spreads a large target over several GPUs.")]
QuantOpt = Annotated[
    str | None,
    typer.Option(
        help="What the target runs as. Default: as its file stores it: a model from a GGUF file (the default "
        "models, a .gguf --target) runs as its gguf view, the file's own quantized blocks; any other model as loaded. "
        "'none': the model as loaded, for a GGUF file its dense bf16 copy (via always runs that). Or a quantized "
        "view (int8, int8wo, int4, int4a8, gguf; e.g. int8:keep=lm_head), quantized once and cached."
    ),
]
DrafterQuantOpt = Annotated[
    str | None,
    typer.Option("--drafter-quant", help="Run the drafter as its quantized view (int8, int8wo, int4, int4a8, gguf)."),
]


def engine_spec(
    target: str,
    drafter: str,
    *,
    profile: str | None = None,
    gamma: int | None = None,
    device: str | None = None,
    dtype: str = "auto",
    device_map: str | None = None,
    quant: str | None = None,
    drafter_quant: str | None = None,
    suffix_cache: int = DEFAULT_SUFFIX_CACHE,
) -> EngineSpec:
    """The EngineSpec of a command's shared options (quantization recipes checked here, before any model loads; no
    --quant: the target as its file stores it, resolved once the target is known)."""
    from viasd.methods import OPTIONS
    from viasd.views.recipe import AS_STORED

    return EngineSpec(
        target=target,
        drafter=drafter,
        device=device,
        dtype=dtype,
        device_map=device_map,
        profile=profile,
        gamma=gamma,
        quant=OPTIONS["quant"].parse("--quant", quant) if quant else AS_STORED,
        drafter_quant=OPTIONS["drafter_quant"].parse("--drafter-quant", drafter_quant) if drafter_quant else None,
        suffix_cache=suffix_cache,
    )
