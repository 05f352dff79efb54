"""llama.cpp (its Python binding) on a GGUF file as a CPU user runs it: load, a chat prompt, N new tokens (the end
token suppressed, as viasd's --min-tokens does), context 4096, the machine's cores. Prints one JSON line: load
seconds, time to the first token, decoding tokens/s after it."""

from __future__ import annotations

import json
import os
import sys
import time

import llama_cpp

path, count, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
threads = len(os.sched_getaffinity(0))
start = time.perf_counter()
model = llama_cpp.Llama(model_path=path, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
loaded = time.perf_counter() - start
stream = model.create_chat_completion(
    [{"role": "user", "content": prompt}],
    max_tokens=count,
    temperature=0.0,
    logit_bias={model.token_eos(): -1e9},
    stream=True,
)
begin, first, tokens = time.perf_counter(), None, 0
for chunk in stream:
    if chunk["choices"][0]["delta"].get("content") is not None:
        tokens += 1
        if first is None:
            first = time.perf_counter()
end = time.perf_counter()
print(json.dumps({
    "runtime": "llama.cpp", "load_seconds": round(loaded, 3), "first_token_seconds": round((first or end) - begin, 3),
    "tokens": tokens, "decode_tokens_per_second": round((tokens - 1) / (end - first), 3) if first else None,
}))
