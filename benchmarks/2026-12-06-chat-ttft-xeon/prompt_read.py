"""Time a prompt read as one pass (the model's forward with the gguf view) against pieces of 16 (fused layers).

    python prompt_read.py > prompt_read.txt
"""
import sys
import time

import torch

from viasd.engine import Engine
from viasd.cli_options import engine_spec
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET

engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_DRAFTER))
decoder = engine.decoder("plain")
session = decoder.session
text = open(sys.argv[1]).read() if len(sys.argv) > 1 else "def f(x):\n    return x * 2\n" * 200
ids = engine.target.tokenizer(text)["input_ids"]
for n in (64, 256, 1024):
    prompt = (ids * (n // len(ids) + 1))[:n]
    for how in ("whole", "pieces16", "whole", "pieces16"):
        session.reset()
        start = time.perf_counter()
        with torch.inference_mode():
            if how == "whole":
                session.forward(prompt)
            else:
                for b in range(0, n, 16):
                    session.forward(prompt[b : b + 16])
        took = time.perf_counter() - start
        print(f"{n:5d} {how:9s} {took:.3f} s  {1000 * took / n:.2f} ms/token  routes={dict(session.routes)}", flush=True)
