"""Scratch: the main thread's decoding speed beside a sleeping, a confined and an unconfined second thread."""
import sys, threading, time, torch
from viasd.cli_options import engine_spec
from viasd.engine import Engine
from viasd.models.catalog import DEFAULT_TARGET
from viasd.passes.executor import confine_openmp
from viasd.decode.base import GenerationConfig
engine = Engine(engine_spec(DEFAULT_TARGET, DEFAULT_TARGET, quant=None))
dec = engine.decoder("plain")
ids = engine.target.tokenizer("Write a long story about a dragon.")["input_ids"]
cfg = GenerationConfig(max_new_tokens=64, ignore_eos=True)
def work(tag):
    t = time.perf_counter(); dec.generate(ids, cfg); b = time.perf_counter() - t
    print(tag, f"{b/64*1000:.1f} ms/token", flush=True)
work("main")
stop = threading.Event()
def idle(kind):
    if kind == "confined": confine_openmp()
    if kind == "torch-op": torch.randn(1000000).sum()
    if kind == "confined+op": confine_openmp(); torch.randn(1000000).softmax(0)
    stop.wait()
for kind in ["sleeper", "confined", "confined+op", "torch-op"]:
    stop.clear(); th = threading.Thread(target=idle, args=(kind,)); th.start(); time.sleep(0.2)
    work("main with a " + kind + " thread")
    stop.set(); th.join()
    work("main after")
