"""Scratch: the dense bf16 target's prompt pass (torch's bf16 products), tokens/s and GFLOP/s at 128 and 512 tokens."""
import time
from pathlib import Path
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.drafters.model_drafter import ModelDrafter
engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET, quant="none"))
loaded = engine.target
ids = loaded.tokenizer(Path("README.md").read_text())["input_ids"]
session = ModelDrafter(loaded.model, None).session
for n in (128, 512):
    session.forward(ids[:n]); session.truncate(0)
    t0 = time.perf_counter(); session.forward(ids[:n]); dt = time.perf_counter() - t0; session.truncate(0)
    print(f"{n} tokens: {dt:.2f} s, {n/dt:.0f} tokens/s, {n*2*1.54e9/dt/1e9:.0f} GFLOP/s")
