"""Probe check: the split fused stack's rows (write_layers_fused.py) against the layer loop's hooks
(write_layers.py) on real passes of the target's GGUF view: two sequences, a prompt chunk then two single tokens."""

import sys

import torch

import viasd.kernels.fused_layers as fused_layers
import write_layers_fused
from write_layers import step as loop_step
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.passes.session import new_cache
from viasd.views.recipe import QuantRecipe

engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET))
loaded = engine.target
view = engine.quantized(loaded, QuantRecipe.parse("gguf"))
tok = loaded.tokenizer
texts = ["Write a haiku about the sea and the wind.", "def fibonacci(n):\n    \"\"\"Return the n-th"]
ids = [tok(t)["input_ids"] for t in texts]


class C:
    def __init__(self):
        self.cache = new_cache(loaded.model)


results = {}
for name, step, patched in (("loop", loop_step, False), ("fused", write_layers_fused.step, True)):
    fused_layers.run = write_layers_fused.split_run if patched else write_layers_fused.whole_run
    cs = [C(), C()]
    got = [step(loaded.model, view, [(c, i) for c, i in zip(cs, ids)])]
    for t in (11, 13):
        got.append(step(loaded.model, view, [(c, [t]) for c in cs]))
    results[name] = got
H = 1536
for k, ((la, lf), (fa, ff)) in enumerate(zip(results["loop"], results["fused"])):
    for part in range(4):
        a, b = lf[:, part * H:(part + 1) * H], ff[:, part * H:(part + 1) * H]
        rel = float((a - b).norm() / a.norm())
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())
        print(f"pass {k} part {part}: relative difference {rel:.4f}, min cosine {cos:.5f}")
    print(f"pass {k} greedy equal: {bool(torch.equal(la.argmax(-1), fa.argmax(-1)))}")
