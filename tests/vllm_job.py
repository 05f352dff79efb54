"""One vLLM engine on the default target, with or without one of viasd's proposers, run through a fixed schedule:
four requests of different lengths start together, two join later, one is cancelled midway. Writes each request's
token ids (JSON) for tests/test_vllm.py, which runs this in a process of its own per engine.

    python tests/vllm_job.py none|hybrid|cascade OUT.json
"""

from __future__ import annotations

import json
import sys

PROMPTS = (
    ("Write a Python function that merges two sorted lists.", 40),
    ("Translate into French: The library opens at nine in the morning and closes at six.", 12),
    ("Explain what a hash map is, with an example in Python.", 64),
    ("List the planets of the solar system in order from the sun.", 24),
    ("Write a SQL query that counts the orders of each customer.", 32),  # joins at step 5
    ("What causes the seasons on Earth?", 16),  # joins at step 5
)
JOIN_AT, LATE, CANCEL_AT, CANCELLED = 5, (4, 5), 8, "r2"


def main() -> None:
    spec, out = sys.argv[1], sys.argv[2]
    from transformers import AutoTokenizer
    from vllm import EngineArgs, LLMEngine, SamplingParams

    from viasd.models.export import ensure_dense_directory
    from viasd.prompting import encode_prompt

    target = str(ensure_dense_directory("qwen2.5-coder-1.5b", progress=False))  # vLLM reads no GGUF blocks
    proposers = {"hybrid": "viasd.vllm.proposer.HybridProposer", "cascade": "viasd.vllm.cascade.CascadeProposer"}
    speculative = None
    if spec in proposers:
        speculative = {"method": "custom_class", "model": proposers[spec], "num_speculative_tokens": 4}
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=target,
            dtype="bfloat16",
            max_model_len=2048,
            max_num_seqs=8,
            kv_cache_memory_bytes=2 << 30,  # on a CPU: what vLLM reserves for the KV cache, beside all else
            enforce_eager=True,
            speculative_config=speculative,
            seed=0,
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(target)

    def add(i: int) -> None:
        text, tokens = PROMPTS[i]
        ids = encode_prompt(tokenizer, text)  # the chat template, as viasd encodes a prompt
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=tokens))

    for i in range(len(PROMPTS)):
        if i not in LATE:
            add(i)
    results: dict[str, dict] = {}
    step = 0
    while engine.has_unfinished_requests():
        if step == JOIN_AT:
            for i in LATE:
                add(i)
        if step == CANCEL_AT:
            engine.abort_request([CANCELLED])
        for output in engine.step():
            if output.finished:
                results[output.request_id] = {"tokens": list(output.outputs[0].token_ids)}
        step += 1
    with open(out, "w") as handle:
        json.dump({"steps": step, "results": results}, handle)


if __name__ == "__main__":
    main()
