"""Rows per second of one ragged pass of the GGUF view (and of the dense bf16 copy) over ROWS conversations of 100
tokens each, one new token each: how fast the data writer's passes can go.

    python ragged_pass_rate.py
"""

import time

import torch

from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.passes.features import head_inputs
from viasd.passes.loop import Segment, ragged_pass
from viasd.passes.route import short_stack
from viasd.passes.session import new_cache
from viasd.views.recipe import QuantRecipe
from viasd.views.view import applied

engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET))
model = engine.target.model
gguf = engine.quantized(engine.target, QuantRecipe.parse("gguf"))
torch.manual_seed(0)
for name, view in (("gguf", gguf), ("dense", None)):
    for rows in (16, 32, 64):
        caches = [new_cache(model) for _ in range(rows)]
        stack, kernel = short_stack(model, view)
        # a 100-token context in each
        with torch.inference_mode(), applied(model, view):
            ragged_pass(model, [Segment(c, torch.randint(0, 30000, (100,)), 1) for c in caches], stack, kernel)
        times = []
        for _ in range(6):
            segs = [Segment(c, torch.randint(0, 30000, (1,)), 1) for c in caches]
            t = time.perf_counter()
            with torch.inference_mode(), applied(model, view), head_inputs(model) as seen:
                ragged_pass(model, segs, stack, kernel)
            times.append(time.perf_counter() - t)
        best = sorted(times)[len(times) // 2]
        print(f"{name} rows={rows}: median {best * 1000:.0f} ms per pass, {rows / best:.0f} rows/s", flush=True)
