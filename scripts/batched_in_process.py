"""Concurrent generations in one process, as `viasd serve` runs them but without HTTP or a load generator: N worker
threads (OpenMP confined to themselves), every pass on this thread through a pass executor, passes merged by a
batcher per model. Prints output tokens/s per N, and the draft tokens per round (speculative methods).

    python scripts/batched_in_process.py plain:quant=gguf 1,4,8
    python scripts/batched_in_process.py sd:quant=gguf:drafter=hybrid:drafter_quant=int4a8 1,2,4,8

Prompts: the first 64 development questions of Spec-Bench (viasd's bench data), 64 new tokens each, greedy,
`--per-thread` generations per thread (default 2). Also an OpenMP check: a parallel torch op timed on this thread,
and on a second thread while another thread's OpenMP team exists (the reason for the executor).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from importlib import resources

import torch

from viasd.decode.base import GenerationConfig, GenerationResult
from viasd.engine import Engine
from viasd.passes.batching import PassBatcher
from viasd.passes.executor import PassExecutor, confine_openmp
from viasd.spec import EngineSpec


def region_microseconds(repeats: int = 20000) -> float:
    """Microseconds per `add_` of 200k floats: one OpenMP parallel region each."""
    a, b = torch.randn(200_000), torch.randn(200_000)
    for _ in range(200):
        a.add_(b)
    start = time.perf_counter()
    for _ in range(repeats):
        a.add_(b)
    return (time.perf_counter() - start) / repeats * 1e6


def openmp_check() -> None:
    """The cost of a parallel region on this thread, and on a second thread while a third holds a team."""
    print(f"OpenMP region on the main thread: {region_microseconds():.1f} us", flush=True)
    release = threading.Event()
    holder = threading.Thread(target=lambda: (torch.ones(200_000).add_(1), release.wait()))
    holder.start()
    measured: list[float] = []
    other = threading.Thread(target=lambda: measured.append(region_microseconds()))
    other.start()
    other.join()
    release.set()
    holder.join()
    print(f"OpenMP region on a second thread, a third thread's team alive: {measured[0]:.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method")
    parser.add_argument("threads", help="comma-separated thread counts, e.g. 1,4,8")
    parser.add_argument("--per-thread", type=int, default=2)
    args = parser.parse_args()
    counts = [int(part) for part in args.threads.split(",")]
    openmp_check()
    engine = Engine(EngineSpec())
    data = resources.files("viasd.bench") / "data" / "question_dev.jsonl"
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()][:64]
    prompts = [engine.encode([{"role": "user", "content": row["turns"][0]}]) for row in rows]
    config = GenerationConfig(max_new_tokens=64, ignore_eos=True)
    for slot in range(max(counts)):
        engine.decoder(args.method, slot)
    engine.generate(prompts[0], args.method, config)  # warm-up
    executor = PassExecutor()
    for count in counts:
        batchers = [PassBatcher(loaded.model, executor=executor).attach() for loaded in engine.loaded_models]
        results: list[GenerationResult] = []

        def work(slot: int, batchers: list[PassBatcher] = batchers, results: list[GenerationResult] = results) -> None:
            confine_openmp()
            with contextlib.ExitStack() as active:
                for batcher in batchers:
                    active.enter_context(batcher.active())
                for turn in range(args.per_thread):
                    prompt = prompts[(slot * args.per_thread + turn) % len(prompts)]
                    results.append(engine.generate(prompt, args.method, config, slot=slot))

        start = time.perf_counter()
        threads = [threading.Thread(target=work, args=(slot,)) for slot in range(count)]
        for thread in threads:
            thread.start()
        executor.serve(until=lambda threads=threads: not any(thread.is_alive() for thread in threads))
        seconds = time.perf_counter() - start
        for batcher in batchers:
            batcher.detach()
        tokens = sum(len(result.tokens) for result in results)
        rounds = sum(result.stats.rounds for result in results)
        drafted = sum(result.stats.drafted for result in results)
        print(
            f"{count} threads: {tokens / seconds:.1f} tokens/s, {drafted / max(rounds, 1):.2f} draft tokens per round, "
            f"passes {[batcher.passes for batcher in batchers]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
