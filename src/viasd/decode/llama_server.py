"""llama.cpp's own server (`llama-server`) behind the Decoder interface: llama.cpp's plain decoding and its own
speculative decoding, with a draft model (`-md`) or by one of its n-gram drafters (`--spec-type ngram-...`: copies
from earlier text, the answer to viasd's prompt lookup and suffix drafting), the baselines llama.cpp users run.

The binary is the user's (on PATH, or named by the VIASD_LLAMA_SERVER environment variable); viasd starts it once
per decoder on a free local port with the cores torch uses, and stops it when the decoder goes. Each generation
sends viasd's prompt ids to `/completion` with the prompt cache off, so every method reads every prompt in full.
llama.cpp runs the GGUF file's own quantization: it is not exact with respect to viasd's target, and the benchmark
compares its text with plain decoding like any method's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from collections import deque
from pathlib import Path
from threading import Thread
from typing import Any

from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd.decode.base import Decoder
from viasd.decode.output import OutputSink
from viasd.decode.round import Round
from viasd.decode.stats import GenerationStats
from viasd.errors import ViasdError
from viasd.verify.sampling import SamplingParams

BINARY_VARIABLE = "VIASD_LLAMA_SERVER"
BUILD = (
    "build it from llama.cpp's sources (cmake -B build -DLLAMA_CURL=OFF && cmake --build build --target "
    f"llama-server) and put it on PATH or name it in {BINARY_VARIABLE}"
)
START_SECONDS = 300.0  # loading a model (and, with -md, its drafter) from a cold disk


def find_binary() -> Path:
    """The llama-server binary: $VIASD_LLAMA_SERVER, else `llama-server` on PATH."""
    named = os.environ.get(BINARY_VARIABLE)
    if named:
        path = Path(named)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ViasdError(f"{BINARY_VARIABLE}={named} is not an executable file")
        return path
    found = shutil.which("llama-server")
    if found is None:
        raise ViasdError(f"the llama-server method needs llama.cpp's llama-server binary: {BUILD}")
    return Path(found)


def server_arguments(
    gguf: Path,
    threads: int,
    context: int,
    port: int,
    draft: Path | None,
    draft_max: int | None,
    ngram: str | None = None,
) -> list[str]:
    """llama-server's command line (after the binary): one slot, the prompt cache off by request, no web UI; a draft
    model (`draft`) or an n-gram drafter (`ngram`, one of NGRAM_TYPES), at most `draft_max` tokens a round."""
    arguments = ["-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(context)]
    arguments += ["--host", "127.0.0.1", "--port", str(port), "-np", "1", "--no-webui"]
    if draft is not None:
        arguments += ["-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads), "-tbd", str(threads)]
        if draft_max is not None:
            arguments += ["--spec-draft-n-max", str(draft_max)]
    elif ngram is not None:
        arguments += ["--spec-type", ngram]
        if draft_max is not None:
            arguments += ["--spec-draft-n-max", str(draft_max)]
    return arguments


def completion_request(prompt: list[int], budget: int, params: SamplingParams, ignore_eos: bool) -> dict[str, Any]:
    """The /completion body: the prompt as token ids, llama.cpp's samplers set to viasd's (greedy: top-k 1), and
    no repetition penalty, min-p or prompt cache."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "n_predict": budget,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
        "ignore_eos": ignore_eos,
        "repeat_penalty": 1.0,
        "min_p": 0.0,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_k": 1 if params.greedy else params.top_k,
        "top_p": 1.0 if params.greedy else params.top_p,
    }
    if params.seed is not None:
        body["seed"] = params.seed % 2**32
    return body


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


class LlamaServer:
    """A running llama-server process, stopped when this object goes (or at exit)."""

    def __init__(self, binary: Path, arguments: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        try:
            self.process = subprocess.Popen(
                [str(binary), *arguments], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
        except OSError as error:
            raise ViasdError(f"cannot start {binary}: {error}") from error
        self._stopper = weakref.finalize(self, _stop, self.process)
        self._log: deque[str] = deque(maxlen=20)  # its last lines, for an error that says why it stopped
        Thread(target=self._read_log, daemon=True).start()
        self._wait_ready()

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._log.append(line.decode(errors="replace").rstrip())

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                errors = [line for line in self._log if "error" in line.lower()] or list(self._log)[-1:]
                raise ViasdError(f"llama-server stopped while loading: {errors[-1] if errors else 'no output'}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # still loading (503) or not listening yet
            time.sleep(0.25)
        self.close()
        raise ViasdError(f"llama-server did not answer within {START_SECONDS:.0f} s")

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request) as answer:
                return dict(json.loads(answer.read()))
        except urllib.error.HTTPError as error:
            raise ViasdError(f"llama-server refused the request: {error.read().decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as error:
            raise ViasdError(f"llama-server is gone: {error}") from None

    def close(self) -> None:
        self._stopper()


def start_server(
    gguf: Path, threads: int, context: int, draft: Path | None, draft_max: int | None, ngram: str | None = None
) -> LlamaServer:
    """llama-server on `gguf` (with `draft` as its draft model, or drafting by the n-gram type `ngram`), ready."""
    port = _free_port()
    return LlamaServer(find_binary(), server_arguments(gguf, threads, context, port, draft, draft_max, ngram), port)


class LlamaServerDecoder(Decoder):
    """Generation by a llama-server process; `target` and `tokenizer` are the Hugging Face side of the same model
    (stop tokens, context size, text)."""

    method = "llama-server"
    honours_penalties = False  # llama.cpp's penalties are defined and ordered differently: refused, not mapped
    gives_logprobs = False  # its target passes are not viasd's: no logits to read them from

    def __init__(
        self,
        target: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        server: LlamaServer,
        context: int,
        draft: str | None,
        method: str | None = None,
    ) -> None:
        super().__init__(target, tokenizer)
        self.server = server
        self.context = context
        self.draft = draft  # how llama.cpp drafts: "model" (-md), an n-gram type, or None (plain decoding)
        self.speculative = draft is not None
        if method:
            self.method = method

    def describe(self) -> dict[str, Any]:
        return {
            "target_view": "llama-server on the GGUF file",
            "draft": {None: "none", "model": "its own draft model (-md)"}.get(self.draft, f"its {self.draft} drafter"),
        }

    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        if len(prompt) + sink.remaining > self.context:
            raise ViasdError(f"llama-server was started with a context of {self.context} tokens; this needs more")
        ignore_eos = not sink.stop.eos_token_ids  # viasd's ignore_eos leaves the stop set empty
        with stats.timed("verify"):
            answer = self.server.post("/completion", completion_request(prompt, sink.remaining, params, ignore_eos))
        tokens = [int(t) for t in answer.get("tokens", [])]
        timings = answer.get("timings", {})
        drafted, accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
        if self.speculative:  # llama.cpp reports its drafts for the whole generation, not per round
            stats.drafted, stats.accepted, stats.evaluated = drafted, accepted, drafted
        for token in tokens:
            taken = sink.push([token])
            if not self.speculative:
                stats.record(Round([token], 0, full_kept=0), taken)
            if sink.done:
                break
