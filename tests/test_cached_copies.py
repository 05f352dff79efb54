"""A quantized copy read from the cache is the copy made in memory: the same tensors, in memory as aligned as torch's
own allocations, the same greedy tokens. torch's int8 weight-only kernel reads its weights with aligned vector loads;
a copy mapped from a file written by safetensors itself, 8 bytes past a boundary, killed the process on AVX-512 CPUs
at every start after the one that made it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import PROMPT, qwen2_with_gguf
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.views import store
from viasd.views.gguf import GgufWeights
from viasd.views.recipe import QuantRecipe
from viasd.views.tensor_file import to_bytes
from viasd.views.torch_kernels import ALIGNMENT, is_aligned
from viasd.views.view import View

SPECS = ("int8", "int8wo", "int4", "int4a8", "int4a8m", "gguf")


def _greedy(model: torch.nn.Module, linears: object, tokens: int = 8) -> list[int]:
    decoder = PlainDecoder(model, tiny_tokenizer(64), view=View(linears=linears))  # type: ignore[arg-type]
    return decoder.generate(PROMPT, GenerationConfig(max_new_tokens=tokens, ignore_eos=True)).tokens


@pytest.mark.parametrize("spec", SPECS)
def test_a_copy_read_from_the_cache_is_the_copy_made_in_memory(tmp_path: Path, monkeypatch, spec: str) -> None:
    if spec == "gguf":
        model, path, _ = qwen2_with_gguf(tmp_path, dtype=torch.bfloat16)
    else:
        model, path = tiny_model("qwen2", dtype=torch.bfloat16), None
    recipe, notes = QuantRecipe.parse(spec), []

    def copies() -> store.QuantizedLinears:
        source = (lambda: GgufWeights(path)) if path is not None else (lambda: None)
        return store.cached_quantize(model, recipe, lambda: [PROMPT], tmp_path / "q", notes.append, source)

    made = copies()
    with monkeypatch.context() as patch:
        patch.setattr(store, "quantize", lambda *a, **k: pytest.fail("quantized again"))
        read = copies()
    assert not notes and set(read.modules) == set(made.modules)
    for name, module in read.modules.items():
        mine = dict(made.modules[name].named_buffers())
        for key, tensor in module.named_buffers():
            want = mine[key]
            assert tensor.dtype == want.dtype and torch.equal(tensor, want), f"{name}/{key}"
            assert is_aligned(want), f"{name}/{key} made in memory"
            assert is_aligned(tensor), f"{name}/{key} read from the cache at {tensor.data_ptr() % ALIGNMENT} past 64"
    assert _greedy(model, read) == _greedy(model, made)


def test_the_cache_file_maps_every_tensor_at_a_64_byte_boundary(tmp_path: Path) -> None:
    tensors = {
        "a/odd": torch.arange(3, dtype=torch.float32),  # 12 bytes: laid out after the whole multiples of 64 bytes
        "a/weight": torch.randint(-127, 128, (48, 64), dtype=torch.int8),
        "a/scale": torch.rand(48, dtype=torch.bfloat16),  # 96 bytes: so is this one
        "b/bias": torch.rand(64, dtype=torch.bfloat16),
        "b/packed": torch.randint(0, 256, (2, 8, 64), dtype=torch.uint8),
        "b/scale": torch.rand(2, 1, 16, dtype=torch.float16),
        "empty": torch.zeros(0),
    }
    path = tmp_path / "copies.safetensors"
    path.write_bytes(to_bytes(tensors, {"format": "test"}))
    with safe_open(str(path), framework="pt") as file:  # safetensors' own reader: it maps the file
        assert file.metadata() == {"format": "test"}
        for key in tensors:
            tensor = file.get_tensor(key)
            assert tensor.dtype == tensors[key].dtype and torch.equal(tensor, tensors[key]), key
            whole = tensor.numel() * tensor.element_size() % ALIGNMENT == 0
            assert tensor.numel() == 0 or not whole or tensor.data_ptr() % ALIGNMENT == 0, key


def test_a_gguf_files_tensor_types_are_read_once_then_recorded_and_a_damaged_record_is_read_again(
    tmp_path, monkeypatch
):
    """Start-up asks a GGUF file for its tensor types; gguf's reader parses the whole header (seconds for a real
    vocabulary), so the answer is recorded in the cache per file, size and time, and a damaged record is ignored."""
    from viasd.views import gguf as gguf_view

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "cache"))
    _, path, _ = qwen2_with_gguf(tmp_path)
    gguf_view._read_tensor_types.cache_clear()
    types = gguf_view._tensor_types(path)
    assert types is not None and {"Q4_K", "Q6_K"} <= types
    (record,) = (tmp_path / "cache" / "gguf-types").iterdir()
    gguf_view._read_tensor_types.cache_clear()
    record.write_text('["Q8_0"]')  # what a later start-up believes comes from the record, not the header
    assert gguf_view._tensor_types(path) == {"Q8_0"}
    gguf_view._read_tensor_types.cache_clear()
    record.write_text("{damaged")
    assert gguf_view._tensor_types(path) == types
    gguf_view._read_tensor_types.cache_clear()
