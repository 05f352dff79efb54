"""How the reference methods build their decoders: transformers' assisted generation, llama.cpp through its Python
binding, and llama.cpp's own server, each on the same target (and the same cores) as viasd's methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

from viasd.errors import ViasdError
from viasd.methods.method import MethodSpec, Parts, first_set
from viasd.views.recipe import QuantRecipe

if TYPE_CHECKING:
    from viasd.decode.base import Decoder


def _refuse_views(parts: Parts, why: str) -> None:
    """A runtime that runs the file (or the model) its own way takes no quantized view of viasd's (--quant none is
    what it runs anyway)."""
    if isinstance(parts.spec.quant, QuantRecipe) or parts.spec.drafter_quant:
        raise ViasdError(why)


def hf_assisted(parts: Parts, spec: MethodSpec) -> Decoder:
    from viasd.decode.hf_assisted import HFAssistedDecoder
    from viasd.models.network import transformers_model

    _refuse_views(parts, "hf-assisted runs transformers' own models: it takes no quantized view (--quant)")
    target = parts.target
    gamma = first_set(spec.get("gamma"), parts.spec.gamma)  # None keeps transformers' own draft policy
    # transformers' generate runs it: a model of viasd's own modules (one built from a file) gets its classes
    drafter = transformers_model(parts.drafter.model)
    return HFAssistedDecoder(transformers_model(target.model), target.tokenizer, drafter, gamma, spec.name)


def llama_cpp(parts: Parts, spec: MethodSpec) -> Decoder:
    """llama.cpp on the target's GGUF file, with the threads torch uses, so both runtimes get the same cores."""
    import torch

    from viasd.decode.base import context_limit
    from viasd.decode.llama_cpp import LlamaCppDecoder, load_llama

    _refuse_views(parts, "llama.cpp runs the GGUF file's own quantization: it takes no --quant")
    target, lookup = parts.target, spec.get("lookup") or 0
    # With lookup, llama-cpp-python keeps context x vocabulary float logits (2.5 GB for Qwen2.5 at 4096 tokens).
    context = min(context_limit(target.model) or 8192, 4096 if lookup else 8192)
    llama = load_llama(parts.gguf(), torch.get_num_threads(), context, lookup)
    return LlamaCppDecoder(target.model, target.tokenizer, llama, lookup, spec.name)


def llama_server(parts: Parts, spec: MethodSpec) -> Decoder:
    """llama.cpp's own server on the target's GGUF file (draft=model: with the drafter's GGUF file as its draft
    model; draft=ngram-...: one of its n-gram drafters), with the threads torch uses."""
    import torch

    from viasd.decode.base import context_limit
    from viasd.decode.llama_server import LlamaServerDecoder, start_server
    from viasd.views.gguf import source_gguf

    _refuse_views(parts, "llama-server runs the GGUF file's own quantization: it takes no --quant")
    draft = None
    if spec.get("gamma") is not None and spec.get("draft") in (None, "none"):
        raise ViasdError(f"method {spec.name!r}: option 'gamma' needs draft=model or an n-gram type")
    if spec.get("draft") == "model":
        drafter = parts.spec.drafter
        draft = source_gguf(drafter, drafter)
        if draft is None:
            raise ViasdError(f"llama-server:draft=model reads the drafter's GGUF file: {drafter!r} is not one")
    target = parts.target
    context = min(context_limit(target.model) or 8192, 8192)
    kind = spec.get("draft")
    ngram = kind if kind not in (None, "none", "model") else None
    server = start_server(parts.gguf(), torch.get_num_threads(), context, draft, spec.get("gamma"), ngram)
    how = "model" if draft is not None else ngram
    return LlamaServerDecoder(target.model, target.tokenizer, server, context, how, spec.name)
