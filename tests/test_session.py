"""KV-cache invariant: after any sequence of extend/crop/slim operations, the committed cache equals
the cache of one fresh forward pass over the committed tokens."""

import random

import pytest
import torch

from helpers import ATOL, assert_cache_equals, fresh_cache
from tiny import ARCHITECTURES, tiny_model
from viasd.passes import cache_layer
from viasd.passes.session import KVSession, common_prefix_length
from viasd.views.layer_skip import LayerMask


@pytest.mark.parametrize("room", [1, cache_layer.MIN_ROOM])  # 1: the in-place stores grow at nearly every pass
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_random_extend_crop_slim_sequences_keep_the_invariant(arch, room, monkeypatch):
    monkeypatch.setattr(cache_layer, "MIN_ROOM", room)
    model = tiny_model(arch)
    slim = LayerMask.skipping(4, [1, 2])
    rng = random.Random(0)
    session = KVSession(model)
    for _ in range(25):
        op = rng.choice(["extend", "crop", "slim", "slim_crop", "extend_to"])
        if op == "extend" or not session.tokens:
            session.forward([rng.randrange(64) for _ in range(rng.randint(1, 5))])
        elif op == "crop":
            session.truncate(rng.randint(1, len(session.tokens)))
        elif op == "slim":
            session.forward_slim([rng.randrange(64) for _ in range(rng.randint(1, 4))], slim)
        elif op == "slim_crop":
            session.truncate_pending(rng.randint(0, len(session.pending)))
        else:
            prefix = session.tokens[: rng.randint(1, len(session.tokens))]
            session.extend_to(prefix + [rng.randrange(64) for _ in range(3)], keep=2)
        n = len(session.tokens)
        assert_cache_equals(session.cache, fresh_cache(model, session.tokens), n, atol=ATOL.get(arch, 1e-10))
        # The cache length transformers reads (layer 0) is committed plus pending.
        assert session.cache.get_seq_length() == session.length
        # Skipped layers never hold slim entries beyond the committed frontier.
        for i in slim.skipped_layers:
            layer = session.cache.layers[i]
            assert layer.keys.shape[-2] == n


def test_slim_entries_equal_a_slim_pass_over_the_full_prefix():
    """Design (b): the slim view attends to the full model's KV for committed positions."""
    model = tiny_model("qwen2")
    slim = LayerMask.skipping(4, [2])
    session = KVSession(model)
    session.forward([3, 4, 5, 6])
    got = session.forward_slim([7, 8], slim, keep=2)
    # Reference: full KV for the prefix, then the slim view on top, computed by hand.
    ref = KVSession(model)
    ref.forward([3, 4, 5, 6])
    want = ref.forward_slim([7], slim)
    assert torch.allclose(got[0], want[0], atol=1e-10)


def test_logits_from_cached_steps_equal_one_full_pass():
    model = tiny_model("llama")
    tokens = [5, 9, 3, 17, 22, 8, 40, 11]
    session = KVSession(model)
    stepped = [session.forward(tokens[:3], keep=1)[-1]]
    stepped += [session.forward([t], keep=1)[-1] for t in tokens[3:]]
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([tokens])).logits[0, 2:]
    assert torch.allclose(torch.stack(stepped), full.float(), atol=1e-10)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2]) == 2


def test_features_grown_in_inference_mode_take_writes_from_outside_it():
    """A session's own pass grows the feature buffer in inference mode; a batched pass then writes rows outside it
    (`viasd serve` with a draft head: every request was a 500 before)."""
    from viasd.passes.features import FeatureStore

    store = FeatureStore()
    first, second = torch.randn(3, 8), torch.randn(2, 8)
    with torch.inference_mode():
        store.write(0, first)
    store.write(3, second)
    store.write(600, second)  # grown outside inference mode, the rows so far kept
    assert torch.equal(store.rows[:5], torch.cat([first, second])) and torch.equal(store.rows[600:602], second)
