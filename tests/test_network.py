"""viasd's own modules (models/network.py) stand for transformers' model of a family: the same parameters under the
same names in the same order (fingerprints, profiles and heads fit either), and the same logits and cache entries,
bit for bit in float64, for prompts, continuations on a cache, single tokens and teacher-forced masks."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from tiny import tiny_model
from viasd.models.fingerprint import model_fingerprint
from viasd.models.network import CausalLM, why_not
from viasd.passes.loop import why_not as loop_why_not


def own_copy(model: torch.nn.Module) -> CausalLM:
    """viasd's modules with the transformers model's weights."""
    own = CausalLM(copy.deepcopy(model.config)).to(model.dtype).eval()
    own.load_state_dict(model.state_dict(), strict=True)
    return own


@pytest.mark.parametrize("arch", ["qwen2", "llama", "llama3", "qwen3"])
def test_own_modules_have_transformers_names_order_and_fingerprint(arch):
    model = tiny_model(arch)
    own = own_copy(model)
    assert [name for name, _ in own.named_parameters()] == [name for name, _ in model.named_parameters()]
    assert [name for name, _ in own.named_modules() if "." in name] == [
        name for name, _ in model.named_modules() if "." in name and not name.endswith("act_fn")
    ]
    assert model_fingerprint(own) == model_fingerprint(model)
    assert loop_why_not(own) is None  # viasd's loop runs it as it runs transformers' model


@pytest.mark.parametrize("arch", ["qwen2", "llama", "llama3", "qwen3"])
def test_own_forward_is_transformers_forward_bit_for_bit(arch):
    model = tiny_model(arch)
    own = own_copy(model)
    ids = torch.randint(3, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    with torch.inference_mode():
        for start, stop, keep in ((0, 17, 0), (17, 21, 3), (21, 22, 1), (22, 24, 1)):  # prompt, block, token, two
            theirs = model(input_ids=ids[:, start:stop], cache=caches[0], use_cache=True, logits_to_keep=keep)
            mine = own(input_ids=ids[:, start:stop], cache=caches[1], use_cache=True, logits_to_keep=keep)
            assert torch.equal(mine.logits, theirs.logits), (start, stop)
        for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        # teacher forcing: a 4-D mask of its own and position ids, no cache
        mask = torch.tril(torch.ones(24, 24, dtype=torch.bool))
        mask[12:, 6:12] = False  # the second half does not see the middle
        kwargs = {"attention_mask": mask[None, None], "position_ids": torch.arange(24)[None], "use_cache": False}
        assert torch.equal(own(input_ids=ids, **kwargs).logits, model(input_ids=ids, **kwargs).logits)


def test_families_and_settings_they_do_not_build_are_named():
    assert "gemma3_text" in (why_not(tiny_model("gemma3").config) or "")
    config = copy.deepcopy(tiny_model("qwen2").config)
    config.hidden_act = "gelu"
    assert why_not(config) == "they have no gelu activation"
    with pytest.raises(ValueError, match="gelu"):
        CausalLM(config)
    with pytest.raises(TypeError, match="output_attentions"):
        own_copy(tiny_model("qwen2"))(input_ids=torch.tensor([[3, 4]]), output_attentions=True)
