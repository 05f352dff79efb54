"""The `auto` method: the fastest exact method on this machine for this model pair, chosen by measuring.

At first use a short probe times every candidate (plain decoding among them) on two small prompts, each
method in turn per prompt; the few it has close to the fastest run again on longer answers to other prompts (the
run-off), and the fastest there is kept (`pick`); plain decoding wins unless another method beats it. The choice is
cached per machine, torch build, models, dtype and candidates, so later runs start at once. The decoder then runs
the chosen method, and its statistics say what was chosen and why.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from viasd.cache import cache_folder
from viasd.decode.base import Decoder, GenerationConfig
from viasd.decode.output import OutputSink
from viasd.decode.stats import GenerationStats
from viasd.fileio import write_atomic
from viasd.models.fingerprint import model_fingerprint
from viasd.prompting import encode_prompt
from viasd.verify.sampling import SamplingParams

if TYPE_CHECKING:
    from viasd.passes.session import KVSession

PROBE_PROMPTS = (
    "Write a Python function that returns the largest of three numbers.",
    "Explain in two sentences what a compiler does.",
)
PROBE_TOKENS = 32
# The probe's prompts do not repeat themselves, so prompt lookup cannot show there what it gains where a context
# does (a summary, a document's answer, code edited): a drafter's variant that copies from the context first is
# taken over the drafter alone when the probe has it this close (Zen 4, 16 report tasks: `sd:drafter=lookup+head`
# 1.11x `sd:drafter=head`, which the probe had 2% ahead; BENCHMARKS.md).
LOOKUP_TIE = 0.05
# Two prompts of 32 tokens cannot rank methods they have within a few percent: on the dense target (Zen 4) the probe
# had the head 1% ahead of the 0.5B drafter's int4a8 view, which then kept 1.8x more tokens per full pass on the
# report tasks. The methods within RUNOFF_TIE of the fastest (at most RUNOFF_SIZE) run again on longer answers to
# prompts of other kinds, a summary and a worked sum, and this run-off decides between them (the same machine: the
# head 13-23% behind there, benchmarks/2026-12-05-auto-runoff-zen4).
RUNOFF_TIE = 0.10
RUNOFF_SIZE = 4
RUNOFF_TOKENS = 96
RUNOFF_PROMPTS = (
    "Summarize in three sentences: The city council met on Tuesday to discuss the new bicycle lanes planned for the "
    "river district. Supporters said the lanes would make the commute safer for the thousands of students who cycle "
    "to the university each day, and that shops along the route would gain customers. Opponents worried that "
    "removing two hundred parking spaces would hurt the same shops, and asked for a study of traffic on the bridge "
    "first. The council agreed to build the lanes in two stages, starting with the section by the university in "
    "spring, and to count cars and bicycles on the bridge before deciding on the second stage.",
    "A shop sells pencils at 3 for 45 cents and erasers at 2 for 30 cents. Tom buys 12 pencils and 5 erasers. How "
    "much does he pay? Think step by step.",
)


def candidates(
    drafter_fits: bool | None,
    quantize: bool = True,
    int4a8: bool = False,
    gguf: bool = False,
    quantized_target: bool = False,
    head: bool = False,
    drafter_gguf: bool = False,
    via: bool = False,
) -> list[str]:
    """The exact methods worth probing: plain first, the drafter's methods only when the drafter fits. Quantized
    drafters are int4a8 views where viasd's int4a8 kernel runs (`int4a8_is_fast`), else int4 (the drafter's)
    and int8 (the target's own); the target drafts for itself with its `gguf` view where that runs on the kernel
    and its GGUF file has blocks a kernel takes (`gguf`: a better guesser than int4a8 at about its cost). A target
    that runs as a quantized view itself (--quant) drafts for itself with its own layers skipped. A target with a
    draft head (`head`) drafts with it, alone, after prompt lookup and after suffix drafting (long copies past
    gamma); those need no drafter model. A drafter whose
    GGUF file has such blocks (`drafter_gguf`) drafts with them too, and where drafters are quantized none drafts
    as its dense copy: slower than its views on a CPU, and a copy in memory the probe would make for nothing. Where
    a routing profile fits the target as it runs (`via`), exact VIA-SD (`via-exact`: the full target decides every
    token, in rounds of the profile's gamma, cap and stop) drafts as the head's candidates do; the relaxed `via`,
    whose slim tier settles tokens, is never a candidate."""
    names = ["plain", "lookup"]
    small, own = ("int4a8", "gguf" if gguf else "int4a8") if int4a8 else ("int4", "int8")
    if int4a8 and drafter_gguf:
        small = "gguf"
    if quantize:
        names.append("self" if quantized_target else f"self:drafter_quant={own}")
    if drafter_fits is not False:
        names += [f"sd:drafter_quant={small}", f"sd:drafter=hybrid:drafter_quant={small}"] if quantize else ["sd"]
    if head:  # suffix drafting with the head: 2.09x plain on edits where lookup+head ran 1.91x, 1.33x on prose (1.29x)
        names += ["sd:drafter=head", "sd:drafter=lookup+head", "sd:drafter=suffix+head"]
    if via:
        names.append("via-exact:drafter=lookup+head" if head else "via-exact")
    return names


def with_lookup(name: str) -> str | None:
    """The candidate that drafts as `name` does after prompt lookup (`sd:drafter=lookup+head` for the head,
    `sd:drafter=hybrid:...` for the small drafter's view), or None."""
    if name == "sd:drafter=head":
        return "sd:drafter=lookup+head"
    if name.startswith("sd:drafter_quant="):
        return "sd:drafter=hybrid:" + name.removeprefix("sd:")
    return None


def pick(rates: dict[str, float]) -> str:
    """The method `auto` runs, from the probe's tokens/s: the fastest (plain on a tie), or its variant with prompt
    lookup where that is within LOOKUP_TIE of it and faster than plain (never one slower than plain in the probe)."""
    fastest = max(rates, key=lambda name: (rates[name], name == "plain"))
    sibling = with_lookup(fastest)
    if sibling not in rates:
        return fastest
    close = rates[sibling] >= (1 - LOOKUP_TIE) * rates[fastest]
    return sibling if close and rates[sibling] > rates.get("plain", 0.0) else fastest


def contenders(rates: dict[str, float]) -> list[str]:
    """The methods a run-off decides between, fastest first: those within RUNOFF_TIE of the probe's fastest, at
    most RUNOFF_SIZE; none where the probe has only one there. Plain is among them only when it is that close, so
    every method a run-off can choose was faster than plain in the probe."""
    ranked = sorted(rates, key=lambda name: (-rates[name], name != "plain"))
    close = [name for name in ranked if rates[name] >= (1 - RUNOFF_TIE) * rates[ranked[0]]][:RUNOFF_SIZE]
    return close if len(close) > 1 else []


def deciding_rates(record: dict[str, Any]) -> dict[str, float]:
    """The timings `pick` chooses by: the run-off's where the probe had one, else the probe's."""
    return record.get("runoff") or record["tokens_per_second"]


def why(chosen: str, rates: dict[str, float], in_runoff: bool = False) -> str:
    """The reason `pick` gives for `chosen` from `rates` (a run-off's, if `in_runoff`), in words."""
    fastest = max(rates, key=lambda name: (rates[name], name == "plain"))
    where = f"a run-off of the {len(rates)} closest in a probe" if in_runoff else "a probe"
    if chosen == fastest:
        return f"fastest exact method in {where} on this machine"
    return f"{fastest} with prompt lookup first: within {LOOKUP_TIE:.0%} of it in {where} on this machine"


def int4a8_is_fast(device: torch.device) -> bool:
    """Whether int4a8 views run on viasd's compiled kernel here (an x86 CPU with AVX-512 VNNI or AVX2), not the
    slow torch reference."""
    from viasd.kernels import w4a8
    from viasd.kernels.build import Library

    return device.type == "cpu" and isinstance(w4a8.kernel(), Library)


def probe_key(target: torch.nn.Module, settings: dict[str, Any], names: Sequence[str]) -> str:
    """What a probe's result depends on: machine, torch, models and their settings, the candidates."""
    parameter = next(target.parameters())
    device = parameter.device
    from viasd.kernels.bf16_linear import CpuBf16Linear, NativeBf16Linear
    from viasd.kernels.cpu import cpu_model
    from viasd.kernels.state import kernel_states
    from viasd.passes import loop

    machine = [platform.machine(), cpu_model(), os.cpu_count(), torch.get_num_threads(), str(device)]
    kernels = (CpuBf16Linear, NativeBf16Linear)
    machine.append(any(isinstance(module, kernels) for module in target.modules()))  # viasd's bf16 kernels
    machine.append(loop.covers(target))  # steps and blocks run viasd's loop: other costs
    if device.type == "cpu":  # which of viasd's kernels run here, and their sources (a changed kernel: probe again)
        machine += [kernel_states(), _kernel_sources()]
    if device.type == "cuda":
        machine.append(torch.cuda.get_device_name(device))
    parts = [machine, torch.__version__, model_fingerprint(target), str(parameter.dtype), settings, list(names)]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _kernel_sources() -> str:
    """A digest of viasd's C kernels as installed."""
    from importlib import resources

    files = sorted(resources.files("viasd.kernels").iterdir(), key=lambda f: f.name)
    return hashlib.sha256(b"".join(f.read_bytes() for f in files if f.name.endswith((".c", ".h")))).hexdigest()[:12]


def probe(
    decoder_of: Callable[[str], Decoder],
    names: Sequence[str],
    tokenizer: Any,
    log: Callable[[str], None],
    texts: Sequence[str] = PROBE_PROMPTS,
    new_tokens: int = PROBE_TOKENS,
    label: str = "auto",
) -> dict[str, float]:
    """Tokens/s of each method over `texts` (greedy, `new_tokens` each, prefill included), methods in turn per
    prompt."""
    config = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = [encode_prompt(tokenizer, text) for text in texts]
    decoders = {name: decoder_of(name) for name in names}
    for decoder in decoders.values():  # warm-up, untimed
        decoder.generate(prompts[0], GenerationConfig(max_new_tokens=4, ignore_eos=True))
    tokens = dict.fromkeys(names, 0)
    seconds = dict.fromkeys(names, 0.0)
    for index, prompt in enumerate(prompts):
        order = list(names[index % len(names) :]) + list(names[: index % len(names)])
        for name in order:
            stats = decoders[name].generate(prompt, config).stats
            tokens[name] += stats.new_tokens
            seconds[name] += stats.total_seconds
    rates = {name: tokens[name] / seconds[name] for name in names}
    log(f"{label}: " + ", ".join(f"{name} {rate:.2f} tok/s" for name, rate in rates.items()))
    return rates


def runoff(
    decoder_of: Callable[[str], Decoder], names: Sequence[str], tokenizer: Any, log: Callable[[str], None]
) -> dict[str, float]:
    """Tokens/s of the probe's `contenders` on the run-off's longer answers."""
    log(f"auto: {len(names)} methods within {RUNOFF_TIE:.0%} of the fastest; timing them on longer answers")
    return probe(decoder_of, names, tokenizer, log, RUNOFF_PROMPTS, RUNOFF_TOKENS, "auto run-off")


MAX_RECORD_BYTES = 1 << 20  # a probe record is a few hundred bytes
_RECORD_KEYS = ("chosen", "candidates", "tokens_per_second", "date")


def _record_problem(record: Any, names: Sequence[str]) -> str | None:
    """Why a cached probe record cannot be used for these candidates, or None when it can."""
    if not isinstance(record, dict):
        return "not a JSON object"
    missing = [key for key in _RECORD_KEYS if key not in record]
    if missing:
        return f"no {', '.join(missing)}"
    rates = record["tokens_per_second"]
    if record["candidates"] != list(names) or record["chosen"] not in names:
        return "made for other candidates"
    if not isinstance(rates, dict) or set(rates) != set(names):
        return "its timings are not one per candidate"
    if not _numbers(rates.values()):
        return "its timings are not numbers"
    final = record.get("runoff")
    if final is not None and not (isinstance(final, dict) and set(final) <= set(names) and _numbers(final.values())):
        return "its run-off is not timings of its candidates"
    return None if isinstance(record["date"], str) else "its date is not text"


def _numbers(values: Any) -> bool:
    return all(isinstance(value, int | float) and not isinstance(value, bool) for value in values)


def _read_record(path: Path, names: Sequence[str]) -> tuple[dict[str, Any] | None, str | None]:
    """The cached probe for these candidates, or None and why it cannot be used (no reason: there is none)."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_RECORD_BYTES + 1)
    except (FileNotFoundError, NotADirectoryError):  # none yet, or no cache folder (saving will say so)
        return None, None
    except OSError as error:
        return None, f"unreadable: {error.strerror or error}"
    if len(raw) > MAX_RECORD_BYTES:
        return None, "too large"
    try:
        record = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return None, "not JSON"
    problem = _record_problem(record, names)
    return (record, None) if problem is None else (None, problem)


def _save_record(path: Path, record: dict[str, Any], log: Callable[[str], None] | None) -> None:
    """Cache a probe's result; where the cache cannot be written, one line (unless `log` is None: the fault was
    reported already) says the probe will run again."""
    try:
        write_atomic(path, json.dumps(record, indent=2) + "\n")
    except OSError as error:
        if log is not None:
            log(f"auto: cannot save the choice at {path} ({error.strerror or error}); the next start times them again")


def choose(
    decoder_of: Callable[[str], Decoder],
    names: Sequence[str],
    tokenizer: Any,
    key: str,
    cache: Path | None = None,
    log: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
) -> dict[str, Any]:
    """The fastest of `names` by the cached probe for `key`, probing first when there is none. A cached record that
    cannot be used (unreadable, not JSON, missing keys, other candidates) is probed again, and a cache that cannot
    be written is not saved to: one line each, never a traceback."""
    path = (cache or cache_folder("auto")) / f"{key}.json"
    record, problem = _read_record(path, names)
    if record is not None:  # chosen again from its timings: a rule changed since keeps no stale choice
        close = contenders(record["tokens_per_second"])
        if set(record.get("runoff") or ()) != set(close):  # made before run-offs, or under another tie: run it now
            record = _decided(record, close, runoff(decoder_of, close, tokenizer, log) if close else None)
            _save_record(path, record, log)
        return {**record, "chosen": pick(deciding_rates(record)), "cached": str(path)}
    if problem is not None:
        log(f"auto: the cached choice at {path} cannot be used ({problem}); timing {len(names)} methods again")
    else:
        log(f"auto: timing {len(names)} methods once on this machine to pick the fastest (cached for next time)")
    rates = probe(decoder_of, names, tokenizer, log)
    record = {
        "chosen": pick(rates),
        "candidates": list(names),
        "tokens_per_second": rates,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "probe": {"prompts": len(PROBE_PROMPTS), "new_tokens": PROBE_TOKENS, "greedy": True},
    }
    close = contenders(rates)
    if close:
        record = _decided(record, close, runoff(decoder_of, close, tokenizer, log))
    _save_record(path, record, log if problem is None else None)  # one line per fault
    return record


def _decided(record: dict[str, Any], close: list[str], final: dict[str, float] | None) -> dict[str, Any]:
    """`record` with the run-off `final` of the methods `close` (None: there was none) and the choice it makes."""
    record = {key: value for key, value in record.items() if key != "runoff"}
    how = record.get("probe")
    how = {key: value for key, value in how.items() if key != "runoff"} if isinstance(how, dict) else {}
    if final is not None:
        record["runoff"] = final
        how["runoff"] = {"prompts": len(RUNOFF_PROMPTS), "new_tokens": RUNOFF_TOKENS, "within": RUNOFF_TIE}
    return {**record, "probe": how, "chosen": pick(deciding_rates(record))}


class AutoDecoder(Decoder):
    """Runs the chosen method; every result's statistics carry the choice (`stats.choice`)."""

    method = "auto"

    def __init__(self, chosen: Decoder, choice: dict[str, Any], method: str | None = None) -> None:
        super().__init__(chosen.target, chosen.tokenizer, chosen.view)
        self.chosen = chosen
        self.choice = choice
        self.honours_penalties = chosen.honours_penalties
        self.gives_logprobs = chosen.gives_logprobs
        if method:
            self.method = method

    def describe(self) -> dict[str, Any]:
        return {"chosen": self.choice["chosen"], **self.chosen.describe()}

    def sessions(self) -> tuple[KVSession, ...]:
        return self.chosen.sessions()

    def reset(self, prompt_length: int, budget: int) -> None:
        self.chosen.reset(prompt_length, budget)

    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        stats.choice = {
            "method": self.choice["chosen"],
            "why": why(self.choice["chosen"], deciding_rates(self.choice), "runoff" in self.choice),
            "tokens_per_second": self.choice["tokens_per_second"],
            "runoff": self.choice.get("runoff"),
            "probed": self.choice["date"],
        }
        self.chosen._decode(prompt, sink, params, stats)
