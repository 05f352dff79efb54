"""The `viasd` command line: generate, models (and calibrate, bench, serve)."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from contextlib import nullcontext
from functools import wraps
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from viasd.cli_options import (
    DeviceMapOpt,
    DeviceOpt,
    DrafterOpt,
    DrafterQuantOpt,
    DtypeOpt,
    GammaOpt,
    ProfileOpt,
    QuantOpt,
    TargetOpt,
    engine_spec,
)
from viasd.errors import ViasdError
from viasd.methods import parse_method
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.stopping import Stopped, signal_name, stop_signals

if TYPE_CHECKING:
    from viasd.decode.base import Decoder
    from viasd.engine import Engine
    from viasd.methods import MethodSpec
    from viasd.spec import EngineSpec

app = typer.Typer(
    help="Multi-tier speculative decoding (VIA-SD): drafter, slim verifier, full target.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(func: F, *, signals: bool = True) -> F:
    """Show ViasdError (and Ctrl-C) as one line on stderr with a non-zero exit, never a traceback. With `signals`,
    SIGTERM stops the command as Ctrl-C does (stopping.py), so it saves what Ctrl-C would; the exit status is then
    128 + the signal's number (130, 143)."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with stop_signals() if signals else nullcontext():
                return func(*args, **kwargs)
        except ViasdError as exc:
            # The message is text, not markup: a path like "[x]" or a port like ":-1:" must print as written.
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True, emoji=False)
            raise typer.Exit(2) from None
        except KeyboardInterrupt as exc:
            signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
            err.print("interrupted" if signum == signal.SIGINT else f"stopped by {signal_name(signum)}")
            raise typer.Exit(128 + signum) from None

    return wrapper  # type: ignore[return-value]


def _loaded(err: Console, method: MethodSpec, spec: EngineSpec) -> tuple[Engine, Decoder]:
    """The engine of `spec` and `method`'s decoder, loaded under a status line (naming the drafter where the method
    drafts with it)."""
    from viasd.engine import Engine

    with err.status(f"loading {spec.target}" + (f" and {spec.drafter}" if method.uses_drafter else "")):
        engine = Engine(spec)
        return engine, engine.decoder(method)


def _stream(piece: str) -> None:
    """Text as it is committed, to standard output."""
    sys.stdout.write(piece)
    sys.stdout.flush()


def _read_prompt(prompt: str | None) -> str:
    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            raise ViasdError("no prompt: pass it as an argument or on standard input")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise ViasdError("the prompt is empty")
    return prompt


@app.command()
@user_errors
def generate(
    prompt: Annotated[str | None, typer.Argument(help="The prompt; '-' or nothing reads standard input.")] = None,
    method: Annotated[
        str, typer.Option("--method", "-m", help="Decoding method or variant, e.g. via:gamma=4 (`viasd methods`).")
    ] = "auto",
    target: TargetOpt = DEFAULT_TARGET,
    drafter: DrafterOpt = DEFAULT_DRAFTER,
    profile: ProfileOpt = None,
    gamma: GammaOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n")] = 256,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables top-k.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p x the top probability; 0 disables it.")] = 0.0,
    presence_penalty: Annotated[float, typer.Option(help="-2 to 2: subtracted once per token in the output.")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(help="-2 to 2: subtracted per use in the output.")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option(help="> 0, on prompt and output tokens; 1 disables it.")] = 1.0,
    min_tokens: Annotated[int, typer.Option(help="No end token or stop string before this many tokens.")] = 0,
    logit_bias: Annotated[
        list[str] | None, typer.Option(help="TOKEN_ID=BIAS, BIAS in [-100, 100], added to that logit (repeatable).")
    ] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    stop_token_id: Annotated[list[int] | None, typer.Option(help="Token id that ends the output (repeatable).")] = None,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    chat: Annotated[bool, typer.Option(help="Apply the model's chat template.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with text and statistics.")] = False,
    stats: Annotated[bool, typer.Option(help="Print statistics to stderr after the text.")] = True,
    device: DeviceOpt = None,
    dtype: DtypeOpt = "auto",
    device_map: DeviceMapOpt = None,
    quant: QuantOpt = None,
    drafter_quant: DrafterQuantOpt = None,
) -> None:
    """Generate text for a prompt, streaming it to the terminal."""
    from viasd.decode.base import GenerationConfig
    from viasd.prompting import encode_prompt
    from viasd.verify.penalties import Penalties, parse_bias
    from viasd.verify.sampling import SamplingParams

    text = _read_prompt(prompt)
    penalties = Penalties(
        presence=presence_penalty,
        frequency=frequency_penalty,
        repetition=repetition_penalty,
        min_tokens=min_tokens,
        bias=parse_bias(logit_bias or ()),
    )
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p, penalties=penalties
    )
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_strings=tuple(stop or ()),
        stop_token_ids=tuple(stop_token_id or ()),
    )
    spec = engine_spec(
        target,
        drafter,
        profile=profile,
        gamma=gamma,
        device=device,
        dtype=dtype,
        device_map=device_map,
        quant=quant,
        drafter_quant=drafter_quant,
    )
    method_spec = parse_method(method)  # a bad method name fails before any model loads
    engine, decoder = _loaded(err, method_spec, spec)
    ids = encode_prompt(engine.tokenizer, text, chat=chat, system=system)

    result = decoder.generate(ids, config, on_text=None if as_json else _stream)
    if as_json:
        setup = engine.describe(method_spec)  # what ran: views, drafter, profile, kernels
        out = {
            "method": method,
            "exact": setup["exact"],  # with respect to the target as run
            "target": target,
            "target_as_run": setup["target_as_run"],  # e.g. "gguf view of <file>", "bf16 copy of <file>"
            "target_view": setup["target_view"],
            "setup": setup,
            "text": result.text,
            "tokens": result.tokens,
            "finish_reason": result.finish_reason,
            "stats": result.stats.to_dict(),
        }
        if len(engine.loaded_models) > 1:  # the drafter model drafted (not a head profile's `via`, nor lookup)
            out["drafter"] = drafter
        print(json.dumps(out, ensure_ascii=False))
        return
    sys.stdout.write("\n")
    if stats:
        s = result.stats
        line = (
            f"{s.new_tokens} tokens in {s.total_seconds:.2f}s ({s.tokens_per_second:.2f} tok/s), "
            f"{s.target_calls} target calls ({s.tokens_per_target_call:.2f} tokens/call)"
        )
        if s.decode_tokens_per_second is not None:  # the prompt's read apart from decoding, as llama.cpp shows them
            line += f", first token after {s.first_token_seconds:.2f}s, then {s.decode_tokens_per_second:.2f} tok/s"
        if s.drafted:
            line += f", rejection rate {s.rejection_rate:.2f}"
        if s.tiers:
            line += ", tiers " + " ".join(f"{k}={v.decided}" for k, v in s.tiers.items())
        if s.task_kind:  # via with per-kind policies: which kind's policy routed the request
            line += f", routed as {s.task_kind}"
        if s.unchecked_tokens and s.new_tokens:  # relaxed tiers: what the full target never verified
            line += f", {s.unchecked_tokens / s.new_tokens:.0%} of tokens never checked by the target"
        if len(s.sources) > 1:  # a hybrid drafter: what each part drafted and got kept
            line += ", drafts " + " ".join(f"{k}={v.rounds} rounds/{v.accepted} kept" for k, v in s.sources.items())
        err.print(f"[dim]{line}, finish: {s.finish_reason}[/]", highlight=False, soft_wrap=True)


@app.command()
@user_errors
def chat(
    method: Annotated[
        str, typer.Option("--method", "-m", help="Decoding method or variant, e.g. sd:gamma=4 (`viasd methods`).")
    ] = "auto",
    target: TargetOpt = DEFAULT_TARGET,
    drafter: DrafterOpt = DEFAULT_DRAFTER,
    profile: ProfileOpt = None,
    gamma: GammaOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="New tokens per answer at most.")] = 512,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 disables top-k.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    min_p: Annotated[float, typer.Option(help="Drop tokens below min_p x the top probability; 0 disables it.")] = 0.0,
    presence_penalty: Annotated[float, typer.Option(help="-2 to 2: subtracted once per token in the output.")] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(help="-2 to 2: subtracted per use in the output.")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option(help="> 0, on prompt and output tokens; 1 disables it.")] = 1.0,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string (repeatable).")] = None,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    stats: Annotated[bool, typer.Option(help="Print each turn's statistics to stderr.")] = True,
    device: DeviceOpt = None,
    dtype: DtypeOpt = "auto",
    device_map: DeviceMapOpt = None,
    quant: QuantOpt = None,
    drafter_quant: DrafterQuantOpt = None,
) -> None:
    """Chat in the terminal: one message a line on standard input (a pipe works too), answers streamed; /reset
    forgets the conversation, /exit or end of input ends it, Ctrl-C stops an answer (not kept). The conversation's KV
    is kept between turns, so a turn reads only its new message (docs/chat.md)."""
    from viasd.chat import Conversation
    from viasd.decode.base import GenerationConfig
    from viasd.verify.penalties import Penalties
    from viasd.verify.sampling import SamplingParams

    penalties = Penalties(presence=presence_penalty, frequency=frequency_penalty, repetition=repetition_penalty)
    sampling = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p, penalties=penalties
    )
    config = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, stop_strings=tuple(stop or ()))
    spec = engine_spec(
        target,
        drafter,
        profile=profile,
        gamma=gamma,
        device=device,
        dtype=dtype,
        device_map=device_map,
        quant=quant,
        drafter_quant=drafter_quant,
    )
    method_spec = parse_method(method)  # a bad method name fails before any model loads
    engine, decoder = _loaded(err, method_spec, spec)
    conversation = Conversation(decoder, engine.encode, config, system=system)
    terminal = sys.stdin.isatty()

    while True:
        try:
            line = input(">>> ") if terminal else sys.stdin.readline()
        except EOFError:
            line = ""
        if not line or line.strip() == "/exit":  # end of input, or asked
            if terminal:
                sys.stdout.write("\n" if not line else "")
            return
        if line.strip() == "/reset":
            conversation.reset()
            err.print("[dim]the conversation is forgotten[/]", highlight=False)
            continue
        try:
            turn = conversation.say(line.rstrip("\r\n"), on_text=_stream)
        except ViasdError as exc:  # a message too long for the context: refused, the conversation goes on
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True, emoji=False)
            continue
        except KeyboardInterrupt as exc:
            if isinstance(exc, Stopped) and exc.signum != signal.SIGINT:  # SIGTERM ends the chat
                raise
            sys.stdout.write("\n")
            err.print("[dim]stopped: this answer is not kept in the conversation[/]", highlight=False)
            continue
        if turn is None:  # an empty message
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if stats:
            err.print(f"[dim]{turn.summary()}[/]", highlight=False, soft_wrap=True)


@app.command()
@user_errors
def models(
    fetch: Annotated[list[str] | None, typer.Option(help="Fetch a default model (repeatable).")] = None,
    fetch_all: Annotated[bool, typer.Option("--all", help="Fetch every default model.")] = False,
    force: Annotated[
        bool, typer.Option(help="With --fetch or --all: fetch again even when cached (repairs a damaged copy).")
    ] = False,
    verify: Annotated[
        bool, typer.Option(help="Check every cached file's SHA-256 against the manifest written with it.")
    ] = False,
    dense: Annotated[
        bool,
        typer.Option(help="With --fetch or --all: also write a dense bf16 copy, for runtimes that read no GGUF: vLLM."),
    ] = False,
) -> None:
    """List the embedded default models and fetch them into the local cache."""
    from viasd.models.catalog import default_model_names
    from viasd.models.export import ensure_dense_directory
    from viasd.models.fetch import ensure_default_model, list_default_models, repair_command

    names = default_model_names() if fetch_all else list(fetch or [])
    if force and not names:
        raise ViasdError("--force fetches again what --fetch NAME or --all names; name a model")
    if dense and not names:
        raise ViasdError("--dense writes a dense copy of what --fetch NAME or --all names; name a model")
    for name in names:
        path = ensure_default_model(name, force=force)
        err.print(f"{name}: ready at {path}")
        if dense:
            err.print(f"{name}: its dense bf16 copy is at {ensure_dense_directory(name)}")
    table = Table(title="default models")
    for column in ("name", "role", "size", "cached", "description"):
        table.add_column(column)
    statuses = list_default_models(verify=verify)
    shown = {"ok": "yes, verified" if verify else "yes", "unverified": "yes, no manifest", "damaged": "DAMAGED"}
    for status in statuses:
        role = {DEFAULT_TARGET: "target", DEFAULT_DRAFTER: "drafter"}.get(status.name, "")
        table.add_row(
            status.name,
            role,
            f"{status.download_size / 1e6:.0f} MB",
            shown.get(status.state, "no"),
            status.description,
        )
    Console().print(table)
    if verify:
        for status in statuses:
            if status.state == "unverified":
                err.print(
                    f"{status.name}: cached before viasd recorded manifests, so it cannot be verified; "
                    f"`{repair_command(status.name)}` rebuilds it with one",
                    highlight=False,
                    soft_wrap=True,
                )
    damaged = [status for status in statuses if status.state == "damaged"]
    if damaged:
        what = "; ".join(f"{status.name} is damaged: {status.problem}" for status in damaged)
        command = "viasd models " + " ".join(f"--fetch {status.name}" for status in damaged) + " --force"
        raise ViasdError(f"{what}. Repair with: {command}")


@app.command()
def methods() -> None:
    """List the decoding methods and the options their variants take (`via:gamma=4:pregate=0.5`)."""
    from viasd.methods import METHODS, OPTIONS

    table = Table(title="decoding methods (variant: METHOD:key=value[:key=value])")
    for column in ("method", "what it is", "target it runs", "exact", "options"):
        table.add_column(column)
    runs = {
        "view": "--quant (default: as its file stores it)",
        "dense": "as loaded (dense)",
        "profile": "as its routing profile was calibrated",
        "file": "its GGUF file",
    }
    for method in METHODS.values():
        exact, options = "yes" if method.exact else "no", ", ".join(method.options) or "-"
        table.add_row(method.name, escape(method.description), runs[method.target], exact, options)
    Console().print(table)
    Console().print(
        "Exact means exact with respect to the target as run. By default a target from a GGUF file (the default "
        "models, a .gguf --target) runs as the file stores it, its gguf view (the file's own quantized blocks); other "
        "models run as loaded. --quant none (or quant=none in a variant) runs the dense bf16 copy instead; via and "
        "via-exact run the target their routing profile was calibrated on; hf-assisted always runs the dense copy. "
        "`generate --json` names the target as run (target_as_run).",
        highlight=False,
    )
    for option in OPTIONS.values():
        Console().print(f"  {option.name}: {option.help}", highlight=False)


from viasd.serve.command import serve  # noqa: E402  (light: heavy imports happen inside the command)

# The server handles SIGTERM itself: it drains the requests in flight, then ends by the signal (serve/command.py).
app.command("serve")(user_errors(serve, signals=False))


from viasd.bench.command import bench  # noqa: E402  (light: heavy imports happen inside the command)

app.command("bench")(user_errors(bench))


from viasd.calibration.command import calibrate  # noqa: E402  (light: heavy imports happen inside the command)

app.command("calibrate")(user_errors(calibrate))


from viasd.calibration.cost_command import costs  # noqa: E402  (light: heavy imports happen inside the command)

app.command("costs")(user_errors(costs))


from viasd.calibration.project_command import project  # noqa: E402  (light: heavy imports happen inside the command)

app.command("project")(user_errors(project))


from viasd.training.command import train_drafter  # noqa: E402  (light: heavy imports happen inside the command)

app.command("train-drafter")(user_errors(train_drafter))


def main() -> None:  # pragma: no cover - console entry
    app()
