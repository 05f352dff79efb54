"""The KV cache goes to a model's own forward under the name that forward takes: `cache` in newer transformers,
`past_key_values` in earlier 5.x releases (vLLM's CPU build pins one). Under a wrong name the forward would swallow
it in **kwargs and start a cache of its own, so a session's cache would silently stay empty."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from tiny import tiny_model
from viasd.passes.cache_argument import cache_argument
from viasd.passes.session import KVSession


class _OlderModel(nn.Module):
    def forward(self, input_ids: torch.Tensor, past_key_values: object = None, **kwargs: object) -> object:
        return past_key_values


def test_the_name_is_the_one_the_forward_takes() -> None:
    model = tiny_model("llama")
    (name,) = cache_argument(model, "c")
    assert name in inspect.signature(type(model).forward).parameters
    assert cache_argument(_OlderModel(), "c") == {"past_key_values": "c"}


def test_a_pass_through_the_models_own_forward_extends_the_sessions_cache() -> None:
    """A pass of a view with layers skipped runs the model's own forward, not viasd's loop."""
    from viasd.views.layer_skip import LayerMask

    session = KVSession(tiny_model("llama"))
    session.forward([1, 2, 3, 4])
    session.forward_slim([5, 6], LayerMask.skipping(4, [2]))
    assert session.cache.get_seq_length() == 6 == session.length
