"""llama.cpp (through llama-cpp-python) behind the Decoder interface: the baseline CPU users would otherwise pick.

It runs the target's GGUF file (for a default model, the same verified file viasd converts) with llama.cpp's
own kernels: plain decoding, or llama-cpp-python's prompt-lookup speculation. The prompt ids are viasd's, so
every method sees the same tokens; each generation starts from an empty cache (no prefix reuse between
generations, as for every viasd method). It is another runtime on quantized weights, so it is not exact with
respect to the bf16 target; the benchmark compares its outputs with plain decoding like any method's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd.decode.base import Decoder
from viasd.decode.output import OutputSink
from viasd.decode.round import Round
from viasd.decode.stats import GenerationStats
from viasd.errors import ViasdError
from viasd.verify.sampling import SamplingParams

INSTALL = "pip install 'viasd[llamacpp]' (it builds llama.cpp from source: a C++ compiler and cmake, a few minutes)"


def load_llama(gguf: Path, threads: int, context: int, lookup: int) -> Any:
    """A llama-cpp-python model on `gguf` (`lookup` > 0: with prompt-lookup drafts of that many tokens)."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as error:
        raise ViasdError(f"the llama.cpp method needs llama-cpp-python: {INSTALL}") from error
    draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
    try:
        return llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            # Speculation keeps the logits of every position; llama-cpp-python turns that on by itself but sizes
            # its buffer for one batch only unless asked here, and a prompt longer than a batch then overflows it.
            logits_all=bool(lookup),
            verbose=False,
        )
    except (ValueError, RuntimeError) as error:
        raise ViasdError(f"llama.cpp cannot load {gguf}: {error}") from error


class LlamaCppDecoder(Decoder):
    """Generation by llama.cpp; `target` and `tokenizer` are the Hugging Face side of the same model (stop
    tokens, context size, text)."""

    method = "llama.cpp"
    honours_penalties = False  # llama.cpp's samplers order and define them differently
    gives_logprobs = False  # its target passes are not viasd's: no logits to read them from

    def __init__(
        self,
        target: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        llama: Any,
        lookup: int = 0,
        method: str | None = None,
    ) -> None:
        super().__init__(target, tokenizer)
        self.llama = llama
        self.lookup = lookup
        if method:
            self.method = method

    def describe(self) -> dict[str, Any]:
        return {"target_view": "llama.cpp on the GGUF file", "lookup": self.lookup}

    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        if len(prompt) + sink.remaining > self.llama.n_ctx():
            raise ViasdError(f"llama.cpp was loaded with a context of {self.llama.n_ctx()} tokens; this needs more")
        self.llama.reset()  # no KV reuse from the previous generation
        if params.seed is not None:
            self.llama.set_seed(params.seed % 2**32)
        options: dict[str, Any] = {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
        if not params.greedy:
            options = {"temp": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": 0.0}
        with stats.timed("verify"):
            for token in self.llama.generate(prompt, reset=True, repeat_penalty=1.0, **options):
                taken = sink.push([int(token)])
                if not self.lookup:  # one pass per token; llama-cpp-python does not report its speculation
                    stats.record(Round([int(token)], 0, full_kept=0), taken)
                if sink.done:
                    break
