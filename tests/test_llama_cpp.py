"""The llama.cpp baseline: a clear error when llama-cpp-python is missing, and on a real GGUF model the same
prompts, stop conditions and text handling as every viasd method."""

import sys

import pytest

from viasd.decode.llama_cpp import load_llama
from viasd.errors import ViasdError


def test_a_missing_llama_cpp_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(ViasdError, match=r"pip install 'viasd\[llamacpp\]'"):
        load_llama(tmp_path / "model.gguf", 1, 512, 0)


def test_the_target_must_be_a_gguf_file_or_a_default_model(tmp_path):
    from tiny import tiny_model, tiny_tokenizer
    from viasd.engine import Engine, EngineSpec
    from viasd.models.loading import LoadedModel

    target = LoadedModel(tiny_model("llama"), tiny_tokenizer(64), "dir", str(tmp_path))
    engine = Engine(EngineSpec(target=str(tmp_path)), target=target)
    with pytest.raises(ViasdError, match=r"llama\.cpp reads GGUF files"):
        engine.decoder("llama.cpp")


@pytest.mark.real
def test_llama_cpp_generates_with_viasd_prompts_and_stops():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra (viasd[llamacpp])")
    from viasd.decode.base import GenerationConfig
    from viasd.engine import Engine, EngineSpec

    engine = Engine(EngineSpec(target="smollm2-135m", dtype="fp32", device="cpu"))
    ids = engine.encode([{"role": "user", "content": "Name three colours."}])
    plain = engine.generate(ids, "plain", GenerationConfig(max_new_tokens=24))
    for method in ("llama.cpp", "llama.cpp:lookup=4"):
        out = engine.generate(ids, method, GenerationConfig(max_new_tokens=24))
        assert 0 < len(out.tokens) <= 24 and out.text.strip() and out.stats.method == method
        # The same weights (the GGUF that viasd converted) and greedy decoding: the first tokens agree.
        assert out.tokens[:3] == plain.tokens[:3]
    # A prompt longer than llama.cpp's batch (512 tokens): its lookup keeps every position's logits.
    story = " ".join(f"Line {i}: the red fox jumps over the lazy dog." for i in range(80))
    long = engine.encode([{"role": "user", "content": f"{story}\nRepeat the last line."}])
    assert len(long) > 600
    looked = engine.generate(long, "llama.cpp:lookup=4", GenerationConfig(max_new_tokens=12))
    assert looked.tokens[:3] == engine.generate(long, "plain", GenerationConfig(max_new_tokens=3)).tokens
    short = engine.generate(ids, "llama.cpp", GenerationConfig(max_new_tokens=5, ignore_eos=True))
    assert len(short.tokens) == 5 and short.finish_reason == "length" and short.stats.target_calls == 5
