"""Probe: as write_layers.py (rows [final | layer L0 | L1 | L2], the residual stream entering layers 2, 14, 25), but
the fused C stack runs the layers in four calls split at those layers, and the rows are copied between calls: the
same speed as the real writer. `check` compares its features with write_layers.py's hooks on a few real steps."""

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import viasd.kernels.fused_layers as fused_layers
import viasd.training.conversations as conversations
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.passes.features import head_inputs
from viasd.passes.loop import Segment, ragged_pass
from viasd.passes.route import short_stack
from viasd.training.dataset import DataFolder
from viasd.training.writing import write_data
from viasd.views.recipe import QuantRecipe
from viasd.views.view import applied

LAYERS = (2, 14, 25)
whole_run = fused_layers.run
taps: list[torch.Tensor] = []  # the current pass's [rows, hidden] residual entering each of LAYERS


def split_run(library, x, layers, cos, sin, sequences, starts, *rest, **named):
    """fused_layers.run in segments [0, 2), [2, 14), [14, 25), [25, 28), copying x's rows at each boundary."""
    if layers.count <= LAYERS[-1]:  # a kernel's own check on a few layers, not the target's stack
        return whole_run(library, x, layers, cos, sin, sequences, starts, *rest, **named)
    bounds = (0, *LAYERS, layers.count)
    for a, b in zip(bounds, bounds[1:]):
        if a:
            taps.append(x.clone())
        part = SimpleNamespace(count=b - a, array=layers.array + a)
        sub = [fused_layers.SequenceCache(c.stores[a:b], c.past[a:b]) for c in sequences]
        whole_run(library, x, part, cos, sin, sub, starts, *rest, **named)


def step(model, view, parts):
    segments = [Segment(c.cache, torch.tensor(ids), 1) for c, ids in parts]
    ends = torch.tensor([len(ids) for _, ids in parts]).cumsum(0) - 1
    stack, kernel = short_stack(model, view)
    taps.clear()
    with torch.inference_mode(), applied(model, view), head_inputs(model) as seen:
        out = ragged_pass(model, segments, stack, kernel)
    assert len(taps) == len(LAYERS), "the pass took the fused stack"
    features = torch.cat([seen[-1].float()] + [t[ends].float() for t in taps], dim=-1)
    return torch.stack([rows[-1].float() for rows in out]), features


if __name__ == "__main__":
    fused_layers.run = split_run
    conversations._step = step
    out, tokens = Path(sys.argv[1]), int(sys.argv[2])
    engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET))
    loaded = engine.target
    view = engine.quantized(loaded, QuantRecipe.parse("gguf"))
    settings = {"view": "gguf", "seed": 0, "max_request": 64, "max_answer": 256, "layers": list(LAYERS)}
    folder = DataFolder(out, settings)
    began = time.monotonic()
    held = write_data(loaded.model, loaded.tokenizer, view, folder, 10**6, tokens, 32, 0, 64, 256, progress=True)
    print(f"{held} tokens in {time.monotonic() - began:.0f} s", flush=True)
