"""Sliding-window attention with a context longer than the window: the caches keep each layer's window right
through drafts, rollbacks and slim passes, so every exact method reproduces transformers' own greedy output."""

import pytest
import torch
from transformers import GenerationConfig as HFGenerationConfig

from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.verify.gates import Gate
from viasd.views.layer_skip import LayerMask

WINDOW = 6
PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12, 3, 4]  # already longer than the window
NEW = 40


def reference(model) -> list[int]:
    """transformers' own greedy generation, through EOS like `ignore_eos` (min_new_tokens would mask EOS out)."""
    model.generation_config.eos_token_id = None
    config = HFGenerationConfig(max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("arch", ["gemma2", "mistral", "gemma3"])
def test_exact_methods_equal_transformers_generate_beyond_the_window(arch):
    target = tiny_model(arch, sliding_window=WINDOW)
    drafter = ModelDrafter(tiny_model(arch, layers=2, seed=1, sliding_window=WINDOW))
    tok = tiny_tokenizer(64)
    want = reference(target)
    config = GenerationConfig(max_new_tokens=NEW, ignore_eos=True)
    decoders = {
        "plain": PlainDecoder(target, tok),
        "sd": SpeculativeDecoder(target, tok, drafter, gamma=4),
        "lookup": SpeculativeDecoder(target, tok, PromptLookupDrafter(), gamma=3),
        "via-exact": TieredDecoder(target, tok, drafter, [LayerMask.skipping(4, [2])], RoundPolicy(Gate.exact())),
        # Slim views that agree with the target keep relaxed VIA-SD exact: this exercises pending slim entries on
        # sliding layers, rolled back and caught up past the window.
        "via-full-view": TieredDecoder(
            target, tok, drafter, [LayerMask.full(4)], RoundPolicy(Gate("kl", (-1.0, float("inf"))), cap=6)
        ),
    }
    for name, decoder in decoders.items():
        out = decoder.generate(PROMPT, config)
        assert out.tokens == want, name
    assert out.stats.unchecked_tokens > 0  # the relaxed rounds did commit without the full target
