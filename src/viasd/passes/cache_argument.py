"""The name under which a model's own forward takes its KV cache, which changed across transformers 5.x releases:
newer ones call it `cache`, earlier ones `past_key_values` (vLLM's CPU build 0.32 pins transformers < 5.20, and
viasd's proposers run inside vLLM). An unknown keyword would be swallowed by the forward's **kwargs and the model
would start a cache of its own, so the name is read from the forward's signature."""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_argument(model: nn.Module, cache: Any) -> dict[str, Any]:
    """`{name: cache}` to pass to `model(...)` so that its forward reads and extends `cache`."""
    return {_cache_keyword(type(model)): cache}
