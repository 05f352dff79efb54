"""Scratch: the seconds of one queued own-weights chunk (the model's bf16 forward) of M tokens after 200 of context."""
from pathlib import Path
import statistics, time, torch
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.passes.session import new_cache
engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET, quant=None))
model = engine.target.model
ids = engine.target.tokenizer((Path(__file__).resolve().parents[2] / "README.md").read_text())["input_ids"]
sizes = [32, 64, 96, 128, 192, 256]
res = {m: [] for m in sizes}
with torch.inference_mode():
    cache = new_cache(model)
    model(input_ids=torch.tensor([ids[:200]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    for r in range(4):
        for m in sizes:
            t = time.perf_counter()
            model(input_ids=torch.tensor([ids[200:200 + m]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            if r: res[m].append(time.perf_counter() - t)
            [layer.crop(-(layer.get_seq_length() - 200)) for layer in cache.layers]
for m in sizes:
    s = statistics.median(res[m]); print(f"M={m:4d} {s*1000:7.1f} ms/chunk  {m/s:6.0f} tok/s")
