"""Scratch: where a prompt pass of the GGUF view spends its time."""
import sys, time
from pathlib import Path
import torch
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.drafters.model_drafter import ModelDrafter
engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET, quant=None))
loaded = engine.target
view = engine.quantized(loaded, engine.target_recipe())
print("recipe", engine.target_recipe())
text = (Path("README.md").read_text() + Path("docs/design.md").read_text())
ids = loaded.tokenizer(text)["input_ids"]
session = ModelDrafter(loaded.model, view).session
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
for _ in range(2):
    t0 = time.perf_counter(); session.forward(ids[:n]); print(n, "tokens", (time.perf_counter()-t0)*1e3/n, "ms/token"); session.truncate(0)
if "--prof" in sys.argv:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        session.forward(ids[:n])
    session.truncate(0)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
