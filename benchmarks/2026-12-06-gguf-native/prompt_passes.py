"""The prompt pass of the default target as its file stores it (every position through the file's blocks) against
the same target with its dense bf16 copy, which on a CPU with AMX reads the positions that need no logits with the
dense weights (views/recipe.py `OWN_WEIGHTS_FROM_AMX_CPU`): what the stored model gives up in reading prompts, and
what it saves in memory. Two engines, alternated, the median of 3 per prompt length.

    python benchmarks/2026-12-06-gguf-native/prompt_passes.py
"""

from __future__ import annotations

import json
import resource
import statistics
import time

from viasd.decode.base import GenerationConfig
from viasd.engine import Engine
from viasd.models.stored import densify
from viasd.spec import EngineSpec

LENGTHS = (32, 128, 512)
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls count the stars above the quiet river".split()


def prompt(engine: Engine, tokens: int) -> list[int]:
    text = " ".join(WORDS[i % len(WORDS)] for i in range(tokens * 2))
    return engine.tokenizer(text)["input_ids"][:tokens]


def first_token_seconds(engine: Engine, ids: list[int]) -> float:
    result = engine.generate(ids, "plain", GenerationConfig(max_new_tokens=1))
    return result.stats.first_token_seconds


stored = Engine(EngineSpec())
stored.decoder("plain")
dense = Engine(EngineSpec())
densify(dense.target.model, "to compare")
dense.decoder("plain")
rows = []
for tokens in LENGTHS:
    times: dict[str, list[float]] = {"stored": [], "dense": []}
    for _ in range(3):
        for name, engine in (("stored", stored), ("dense", dense)):
            ids = prompt(engine, tokens)
            start = time.perf_counter()
            first_token_seconds(engine, ids)
            times[name].append(time.perf_counter() - start)
    row = {"tokens": tokens, **{name: round(statistics.median(t), 3) for name, t in times.items()}}
    row["stored_over_dense"] = round(row["stored"] / row["dense"], 3)
    rows.append(row)
    print(json.dumps(row), flush=True)
print(json.dumps({"peak_rss_gb_both_engines": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}))
