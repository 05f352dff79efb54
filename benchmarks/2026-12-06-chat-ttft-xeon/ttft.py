"""Time to the first token of each turn of a multi-turn chat, through the official `openai` client with streaming,
against `viasd serve` (its prefix cache as it is by default), llama.cpp's `llama-server` (its prompt cache on, as
by default; the binary on PATH or in VIASD_LLAMA_SERVER) and llama-cpp-python's server (`--cache true`) on the same
GGUF file; each server alone, warmed up on another conversation first.

    python ttft.py FILE [--turns 4] [--tokens 96] > ttft.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from openai import OpenAI

FIRST = "Write a Python function that returns the n-th Fibonacci number iteratively."
FOLLOW_UPS = [
    "Add type hints and a docstring to that function.",
    "Now rename the function to fib and its argument to k, and show the whole function again.",
    "Add a check that raises ValueError for negative input, and show the whole function again.",
    "Write three pytest tests for it.",
]
WARM = ["What is a binary search? Answer in two sentences.", "Give one example in Python."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(client: OpenAI, process: subprocess.Popen, limit: float = 600.0) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode})")
        try:
            client.models.list()
            return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1.0)
    raise SystemExit("the server did not come up")


def turn(client: OpenAI, model: str, messages: list[dict], tokens: int) -> tuple[float, float, str]:
    """(seconds to the first content, whole seconds, the answer) of one streamed greedy turn."""
    start = time.perf_counter()
    first, parts = None, []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=tokens, temperature=0.0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
    whole = time.perf_counter() - start
    return (first if first is not None else whole), whole, "".join(parts)


def conversation(client: OpenAI, model: str, questions: list[str], tokens: int) -> list[dict]:
    messages: list[dict] = []
    rows = []
    for index, question in enumerate(questions, 1):
        messages.append({"role": "user", "content": question})
        first, whole, answer = turn(client, model, messages, tokens)
        messages.append({"role": "assistant", "content": answer})
        rows.append({"turn": index, "first_token_seconds": round(first, 3), "seconds": round(whole, 3),
                     "answer_chars": len(answer)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--servers", default="viasd,llama-server,llama.cpp")
    args = parser.parse_args()
    questions = [FIRST, *FOLLOW_UPS][: args.turns]
    threads = str(len(os.sched_getaffinity(0)))
    for server in args.servers.split(","):
        port = free_port()
        if server == "viasd":
            command = ["viasd", "serve", "--port", str(port)]
        elif server == "llama-server":  # llama.cpp's own server: its prompt cache is on by default
            binary = os.environ.get("VIASD_LLAMA_SERVER", "llama-server")
            command = [binary, "-m", args.file, "--port", str(port), "-c", "4096", "-t", threads, "-tb", threads,
                       "-np", "1", "--no-webui"]  # fmt: skip
        else:
            command = [sys.executable, "-m", "llama_cpp.server", "--model", args.file, "--port", str(port),
                       "--n_ctx", "4096", "--n_threads", threads, "--n_threads_batch", threads, "--cache", "true"]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
            wait_ready(client, process)
            model = client.models.list().data[0].id
            conversation(client, model, WARM, args.tokens)  # kernels built, caches warm, on another conversation
            for row in conversation(client, model, questions, args.tokens):
                print(json.dumps({"server": server, **row}), flush=True)
        finally:
            process.terminate()
            process.wait(timeout=60)


if __name__ == "__main__":
    main()
