"""GrowingLayer: in-place KV writes hold exactly what transformers' concatenating layer holds, through any
sequence of passes, crops and resets, and reuse their store instead of copying the cache at every pass."""

import random

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tiny import tiny_model
from viasd.passes import cache_layer
from viasd.passes.cache_layer import GrowingLayer, growing_cache
from viasd.passes.session import KVSession


def states(length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, length, 4, generator=generator), torch.randn(1, 2, length, 4, generator=generator)


@pytest.mark.parametrize("room", [1, 4, 256])
def test_growing_layer_holds_what_the_concatenating_layer_holds(monkeypatch, room):
    monkeypatch.setattr(cache_layer, "MIN_ROOM", room)
    rng, generator = random.Random(room), torch.Generator().manual_seed(room)
    growing, reference = GrowingLayer(), DynamicLayer()
    for _ in range(200):
        op = rng.choice(["update", "update", "crop", "reset"] if reference.get_seq_length() else ["update"])
        if op == "update":
            keys, values = states(rng.randint(1, 9), generator)
            got, want = growing.update(keys, values), reference.update(keys, values)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        elif op == "crop":
            drop = rng.randint(1, reference.get_seq_length())
            growing.crop(-drop)
            reference.crop(-drop)
        else:
            growing.reset()
            reference.reset()
        assert growing.get_seq_length() == reference.get_seq_length()


def test_a_pass_after_a_crop_writes_into_the_same_store():
    layer, generator = GrowingLayer(), torch.Generator().manual_seed(0)
    layer.update(*states(10, generator))
    store = layer.keys.data_ptr()
    for _ in range(20):  # decoding steps and a rolled-back draft: never a new store while there is room
        layer.update(*states(3, generator))
        layer.crop(-2)
    assert layer.keys.data_ptr() == store and layer.get_seq_length() == 30


def test_a_store_replaced_from_outside_is_adopted():
    """Transformers' own batch operations replace `keys` with new tensors: the next pass starts from those."""
    layer, generator = GrowingLayer(), torch.Generator().manual_seed(1)
    layer.update(*states(5, generator))
    layer.batch_repeat_interleave(2)
    keys, values = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    before = layer.keys.clone()
    got_keys, _ = layer.update(keys, values)
    assert torch.equal(got_keys[..., :5, :], before) and torch.equal(got_keys[..., 5:, :], keys)


def test_only_plain_full_attention_layers_are_replaced():
    model = tiny_model("qwen2")
    cache = growing_cache(DynamicCache(config=model.config))
    assert all(type(layer) is GrowingLayer for layer in cache.layers)
    assert isinstance(KVSession(model).cache.layers[0], GrowingLayer)


def test_decoding_with_a_growing_cache_gives_the_logits_of_one_full_pass(monkeypatch):
    monkeypatch.setattr(cache_layer, "MIN_ROOM", 2)  # the store grows several times on the way
    model = tiny_model("qwen2")
    ids = list(range(3, 40))
    session = KVSession(model)
    session.forward(ids[:5])
    steps = [session.forward([token]) for token in ids[5:]]
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    assert torch.allclose(torch.cat(steps), full[5:], atol=1e-10)
