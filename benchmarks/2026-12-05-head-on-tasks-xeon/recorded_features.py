"""Every position's feature (the input of the target's output head) over a token sequence, as `viasd train-drafter`
records them (passes of the target's view in chunks, on one cache), and the default target those probes load:
shared by the probes that teacher-force a head."""

import torch
from torch import nn

from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.heads.find import find_head
from viasd.heads.network import DraftHead
from viasd.models.catalog import DEFAULT_TARGET
from viasd.passes.features import head_inputs
from viasd.passes.loop import Segment, ragged_pass
from viasd.passes.route import short_stack
from viasd.passes.session import new_cache
from viasd.views.recipe import QuantRecipe
from viasd.views.view import View, applied


def default_target() -> tuple[nn.Module, object, View | None, DraftHead]:
    """The default target, its tokenizer, its GGUF view (what the fast mode runs) and its shipped head in float32."""
    engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET))
    loaded = engine.target
    view = engine.quantized(loaded, QuantRecipe.parse("gguf"))
    return loaded.model, loaded.tokenizer, view, find_head(loaded.model).head.float()


def features_of(model: nn.Module, view: View | None, tokens: list[int], chunk: int = 32) -> torch.Tensor:
    """[len(tokens), hidden] float32: every position's feature, from passes of `view` in chunks of `chunk`."""
    cache, seen_all = new_cache(model), []
    stack, kernel = short_stack(model, view)
    for begin in range(0, len(tokens), chunk):
        ids = torch.tensor(tokens[begin : begin + chunk])
        with torch.inference_mode(), applied(model, view), head_inputs(model) as seen:
            ragged_pass(model, [Segment(cache, ids, len(ids))], stack, kernel)
        seen_all.append(seen[-1].float())
    return torch.cat(seen_all)
