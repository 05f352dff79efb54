"""Scratch: a prompt pass's time and page faults by length, as the default target runs it (split route)."""
import json, resource, statistics, sys, time
from pathlib import Path
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.drafters.model_drafter import ModelDrafter
engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET, quant=None))
loaded = engine.target
view = engine.quantized(loaded, engine.target_recipe())
ids = loaded.tokenizer((Path(__file__).resolve().parents[2] / "README.md").read_text())["input_ids"]
session = ModelDrafter(loaded.model, view).session
out = {}
for n in [80, 300, 700, 1000]:
    session.forward(ids[:n]); session.truncate(0)
    times, faults = [], []
    for _ in range(5):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter(); session.forward(ids[:n]); times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        session.truncate(0)
    out[n] = (statistics.median(times), statistics.median(faults))
print(sys.argv[1], json.dumps(out))
