"""The fast mode's passes are the same bit for bit in any block: the GGUF view's logits for 16 tokens after 240 of
context, read one at a time and in blocks split every way below, compared (the check behind the notes' exactness
section; the 6-token, 60-context variant gave the same).

    python block_invariance.py
"""

import torch

from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.passes.loop import Segment, ragged_pass
from viasd.passes.route import short_stack
from viasd.passes.session import new_cache
from viasd.views.recipe import QuantRecipe
from viasd.views.view import applied

engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET))
model = engine.target.model
view = engine.quantized(engine.target, QuantRecipe.parse("gguf"))
stack, kernel = short_stack(model, view)
print(stack, kernel)
torch.manual_seed(1)
prompt = torch.randint(0, 30000, (240,))
nxt = torch.randint(0, 30000, (16,))


def run(blocks):
    c = new_cache(model)
    outs = []
    with torch.inference_mode(), applied(model, view):
        ragged_pass(model, [Segment(c, prompt, 1)], stack, kernel)
        i = 0
        for b in blocks:
            out = ragged_pass(model, [Segment(c, nxt[i : i + b], b)], stack, kernel)
            outs.append(out[0].float())
            i += b
    return torch.cat(outs)


one = run([1] * 16)
for blocks in ([16], [8, 8], [9, 7], [4, 12], [5] * 3 + [1]):
    other = run(blocks)
    d = (one - other).abs().max().item()
    print(blocks, "max |diff|", d, "argmax equal", bool((one.argmax(-1) == other.argmax(-1)).all()))
