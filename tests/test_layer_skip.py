"""Routed views: no weight copies, full mask == full model, skipping a layer == removing it."""

import copy

import pytest
import torch

from tiny import ARCHITECTURES, tiny_model
from viasd.errors import ViasdError
from viasd.views.layer_skip import LayerMask, decoder_layers, skipping

IDS = torch.tensor([[5, 9, 3, 17, 22, 8, 40, 11, 2, 7, 13, 31]])


def logits(model, ids=IDS):
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_full_mask_gives_exactly_the_full_model(arch):
    model = tiny_model(arch)
    with skipping(model, LayerMask.full(4)):
        masked = logits(model)
    assert torch.equal(masked, logits(model))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_skipping_a_layer_equals_the_model_without_it(arch):
    model = tiny_model(arch)
    with skipping(model, LayerMask.skipping(4, [2])):
        masked = logits(model)
    pruned = copy.deepcopy(model)
    layers = decoder_layers(pruned)
    del layers[2]
    # Keep per-layer attention types aligned with the layers that remain.
    if getattr(pruned.config, "layer_types", None):
        pruned.config.layer_types = [t for i, t in enumerate(pruned.config.layer_types) if i != 2]
    pruned.config.num_hidden_layers = 3
    for i, layer in enumerate(layers):
        layer.self_attn.layer_idx = i
    assert torch.allclose(masked, logits(pruned), atol=1e-10)
    assert not torch.allclose(masked, logits(model), atol=1e-3)


def test_skipping_only_the_mlp_changes_output_and_shares_weights():
    model = tiny_model("qwen2")
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    full = logits(model)
    mask = LayerMask((True,) * 4, (True, False, True, True))
    with skipping(model, mask):
        attn_only = logits(model)
        # The view runs the same parameter tensors: nothing was copied.
        assert {n: p.data_ptr() for n, p in model.named_parameters() if n in pointers}.items() <= pointers.items()
    assert not torch.allclose(full, attn_only)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers


def test_model_is_restored_after_an_error():
    model = tiny_model("llama")
    before = list(decoder_layers(model))
    with pytest.raises(RuntimeError), skipping(model, LayerMask.skipping(4, [1, 2])):
        raise RuntimeError("boom")
    assert list(decoder_layers(model)) == before
    assert torch.equal(logits(model), logits(tiny_model("llama")))


def test_mask_validation_and_round_trip():
    with pytest.raises(ViasdError, match="layer 0"):
        LayerMask.skipping(4, [0])
    with pytest.raises(ViasdError, match="outside"):
        LayerMask.skipping(4, [7])
    mask = LayerMask((True, False, True, True), (True, True, False, True))
    assert LayerMask.from_dict(mask.to_dict()) == mask
    assert mask.skip_ratio == 2 / 8
    assert LayerMask.full(4).contains(mask) and not mask.contains(LayerMask.full(4))
    with pytest.raises(ViasdError, match="4 layers"), skipping(tiny_model("llama", layers=2), mask):
        pass
