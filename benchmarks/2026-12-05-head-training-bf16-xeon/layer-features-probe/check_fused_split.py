"""Probe check: the split fused stack's rows (write_layers_fused.py) against the layer loop's hooks
(write_layers.py) on real passes of the target's GGUF view: two sequences, a prompt chunk then two single tokens."""

import sys

import torch

import viasd.kernels.fused_layers as fused_layers
import write_layers_fused
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.passes.features import head_inputs
from viasd.passes.loop import Segment, Stack, ragged_pass
from viasd.passes.route import attention_kernel
from viasd.passes.session import new_cache
from viasd.views.recipe import QuantRecipe
from viasd.views.view import applied

LAYERS = write_layers_fused.LAYERS


def loop_step(model, view, parts):
    """write_layers.py's step: the layers one by one, hooks on the layers' inputs."""
    segments = [Segment(c.cache, torch.tensor(ids), 1) for c, ids in parts]
    ends = torch.tensor([len(ids) for _, ids in parts]).cumsum(0) - 1
    seen_layers = {index: [] for index in LAYERS}
    hooks = [
        model.model.layers[index].input_layernorm.register_forward_pre_hook(
            lambda m, args, index=index: seen_layers[index].append(args[0].reshape(-1, args[0].shape[-1])[ends])
        )
        for index in LAYERS
    ]
    try:
        with torch.inference_mode(), applied(model, view), head_inputs(model) as seen:
            out = ragged_pass(model, segments, Stack.LOOP, attention_kernel(model))
    finally:
        for hook in hooks:
            hook.remove()
    features = torch.cat([seen[-1].float()] + [seen_layers[index][-1].float() for index in LAYERS], dim=-1)
    return torch.stack([rows[-1].float() for rows in out]), features


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
