"""How fast `viasd train-drafter` writes its data: the target's conversations, ROWS at a time, for STEPS ragged passes
of its GGUF view (training/conversations.py), timed with the passes apart from the rest (sampling the requests).

    python writer_rate.py ROWS STEPS     # from a checkout; PYTHONPATH=<another checkout>/src times that one
"""

import sys
import time

import viasd
import viasd.training.conversations as C
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.training.prompts import openers, stdlib_functions
from viasd.views.recipe import QuantRecipe

rows, steps = int(sys.argv[1]), int(sys.argv[2])
print("viasd from", viasd.__file__)
engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET))
loaded = engine.target
view = engine.quantized(loaded, QuantRecipe.parse("gguf"))
functions = stdlib_functions()


def opener(i):
    return openers(1, i, functions)[0]


orig, count = C._step, {"n": 0, "fed": 0, "pass": 0.0}


def counted(model, view, parts):
    start = time.perf_counter()
    out = orig(model, view, parts)
    count["pass"] += time.perf_counter() - start
    count["n"] += 1
    count["fed"] += sum(len(ids) for _, ids in parts)
    return out


C._step = counted
t0, tokens, done = time.perf_counter(), 0, 0
written = C.write_conversations(
    loaded.model, loaded.tokenizer, view, opener, 0, rows=rows, max_request=64, max_answer=256
)
for w in written:
    tokens, done = tokens + len(w.tokens), done + 1
    if count["n"] >= steps:
        break
el = time.perf_counter() - t0
print(
    f"{count['n']} steps of {rows} rows: {el:.1f} s, passes {count['pass']:.1f} s, other {el - count['pass']:.1f} s; "
    f"{count['fed'] / el:.1f} fed rows/s; {done} conversations finished, {tokens} tokens"
)
