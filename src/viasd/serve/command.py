"""`viasd serve`: load the models once and serve them over an OpenAI-compatible HTTP API.

Heavy imports (torch, transformers, FastAPI, uvicorn) happen inside the command, so that `viasd --help`
stays fast. The command is registered in `viasd.cli`, which wraps it in `user_errors`.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import threading
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

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
from viasd.models.catalog import DEFAULT_DRAFTER, DEFAULT_TARGET
from viasd.serve.settings import AUTO, DEFAULT_PREFIX_CACHE_MB
from viasd.speculation import DEFAULT_SUFFIX_CACHE

if TYPE_CHECKING:
    import uvicorn

    from viasd.passes.executor import PassExecutor
    from viasd.serve.drain import Drain

API_KEY_ENV = "VIASD_API_KEY"


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind the listening socket up front, so a busy port fails before minutes of model loading."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ViasdError(f"cannot listen on {host}:{port}: unknown host ({error.strerror})") from error
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise ViasdError(f"cannot listen on {host}:{port}: {error.strerror or error}") from error
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _log_to_stderr(level: str) -> None:
    """Send the server's own log lines (viasd.*) to stderr in uvicorn's format."""
    import logging

    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    logger = logging.getLogger("viasd")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def serve(
    target: TargetOpt = DEFAULT_TARGET,
    drafter: DrafterOpt = DEFAULT_DRAFTER,
    methods: Annotated[
        str,
        typer.Option(help="Decoding methods to load, comma-separated; the first is the default, requests pick one."),
    ] = "auto,plain",
    profile: ProfileOpt = None,
    gamma: GammaOpt = None,
    host: Annotated[str, typer.Option(help="Address to bind; the default accepts local clients only.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0 picks a free one).")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(envvar=API_KEY_ENV, help="Require 'Authorization: Bearer <key>' (default: no key needed)."),
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model id clients use and /v1/models lists (default: the --target value).")
    ] = None,
    max_body_bytes: Annotated[int, typer.Option(help="Largest request body accepted (413 beyond).")] = 1 << 20,
    max_prompt_tokens: Annotated[int, typer.Option(help="Longest prompt accepted, in tokens (400 beyond).")] = 4096,
    max_tokens_limit: Annotated[
        int, typer.Option(help="Largest max_tokens a request may ask for (400 beyond).")
    ] = 2048,
    default_max_tokens: Annotated[int, typer.Option(help="max_tokens when a request gives none.")] = 256,
    max_active: Annotated[
        int, typer.Option(help="Generations that run at once, their model passes merged (continuous batching).")
    ] = 4,
    max_rows: Annotated[int, typer.Option(help="Most tokens of all active generations in one model pass.")] = 64,
    adaptive_drafts: Annotated[
        bool,
        typer.Option(
            "--adaptive-drafts/--fixed-drafts",
            help="Speculative requests draft fewer tokens as the batch grows, from measured pass costs "
            "(seeded sampled requests always keep theirs).",
        ),
    ] = True,
    prefix_cache_mb: Annotated[
        str,
        typer.Option(
            metavar="<MiB>",
            help="MiB of finished requests' KV caches kept for later prompts that start the same way (a chat's "
            "earlier turns), least recently used out; 0 turns the prefix cache off. 'auto' (the default): "
            f"{DEFAULT_PREFIX_CACHE_MB} MiB for the methods whose target runs viasd's fused low-bit layers (the "
            "default GGUF view on a CPU), where prompts are read in pieces of 16 tokens so that a resumed prompt "
            "gets a fresh read's text bit for bit; off for the others (a dense copy, a GPU), said in one line, "
            "where a resumed prompt may round otherwise and its text differ.",
        ),
    ] = AUTO,
    suffix_cache: Annotated[
        int,
        typer.Option(
            metavar="<tokens>",
            help="Tokens of finished requests (prompts and answers, as token ids, in memory) that greedy requests' "
            "suffix drafters (sd:drafter=suffix, suffix+head) copy from as well, oldest out; 0 turns it off. Drafts "
            "are verified, so no answer changes, but a request's speed can tell whether others sent the same text.",
        ),
    ] = DEFAULT_SUFFIX_CACHE,
    max_queue: Annotated[
        int, typer.Option(help="Requests that may wait while --max-active generate; more are refused with 503.")
    ] = 16,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            help="Seconds to let in-flight requests finish on Ctrl-C or SIGTERM; those still running then end "
            "with a shutting_down error (a stream: an error event and [DONE]). A second signal ends them at once."
        ),
    ] = 30.0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = "auto",
    device_map: DeviceMapOpt = None,
    quant: QuantOpt = None,
    drafter_quant: DrafterQuantOpt = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = True,
) -> None:
    """Serve the target over an OpenAI-compatible HTTP API (chat and text completions, streaming)."""
    from rich.console import Console

    from viasd.serve.settings import ServeSettings, parse_megabytes, parse_methods

    err = Console(stderr=True)
    if not 0 <= port <= 65535:
        raise ViasdError(f"--port must be in [0, 65535] (0 picks a free one), got {port}")
    if log_level.lower() not in {"debug", "info", "warning", "error", "critical"}:
        raise ViasdError(f"unknown --log-level {log_level!r} (debug, info, warning or error)")
    settings = ServeSettings(
        model_id=served_model_name or target,
        methods=parse_methods(methods),
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
        default_max_tokens=min(default_max_tokens, max_tokens_limit),
        max_active=max_active,
        max_rows=max_rows,
        adaptive_drafts=adaptive_drafts,
        max_queue=max_queue,
        shutdown_timeout=shutdown_timeout,
        prefix_cache_mb=parse_megabytes(prefix_cache_mb),
    )
    sock = bind_socket(host, port)
    try:
        import uvicorn

        from viasd.engine import Engine
        from viasd.passes.executor import PassExecutor
        from viasd.serve.app import create_app
        from viasd.serve.drain import UVICORN_MARGIN

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
            suffix_cache=suffix_cache,
        )
        with err.status(f"loading {target} for {', '.join(settings.methods)}"):
            engine = Engine(spec)
            for method in settings.parsed.values():
                engine.decoder(method)
        if not is_loopback(host) and settings.api_key is None:
            err.print(
                f"[bold yellow]warning:[/] listening on {host} without an API key: anyone who can reach this "
                f"port can use the model (set --api-key or {API_KEY_ENV})",
                highlight=False,
            )
        _log_to_stderr(log_level)
        executor = PassExecutor()  # this thread loaded the models: it runs their passes too
        app = create_app(engine, settings, executor)
        config = uvicorn.Config(
            app,
            host=host,
            port=sock.getsockname()[1],
            log_level=log_level.lower(),
            access_log=access_log,
            # The app ends what still runs at --shutdown-timeout itself (serve/drain.py); uvicorn only backs it up.
            timeout_graceful_shutdown=shutdown_timeout + UVICORN_MARGIN,
            lifespan="on",
        )
        server = uvicorn.Server(config)
        bound = sock.getsockname()
        url = f"http://{f'[{bound[0]}]' if ':' in bound[0] else bound[0]}:{bound[1]}"
        target_as_run = engine.target_as_run(settings.parsed[settings.default_method])
        err.print(
            f"serving {settings.model_id} at {url}/v1 (methods: {', '.join(settings.methods)}; "
            f"default {settings.default_method}, target {target_as_run}"
            f"{'; API key required' if settings.api_key else ''})",
            highlight=False,
            soft_wrap=True,
        )
        serve_with_passes_here(server, sock, executor, app.state.drain)
    finally:
        sock.close()
    if not server.started:
        raise ViasdError("the server did not start (see the log above)")


def serve_with_passes_here(
    server: uvicorn.Server, sock: socket.socket, executor: PassExecutor, drain: Drain | None = None
) -> None:
    """Run the HTTP server on a thread of its own and the model passes on this one (the main thread, which loaded
    the models; passes/executor.py says why one thread) until the HTTP server has shut down.

    Python runs signal handlers on the main thread, so Ctrl-C and SIGTERM are caught here and handed to uvicorn,
    which drains the requests in flight as when it owns the signals, and to the app's `drain`, which ends those
    still running when --shutdown-timeout is over; afterwards they are raised again, as uvicorn does, so the
    process ends the way the signal asks."""
    caught: list[int] = []

    def on_signal(sig: int, frame: FrameType | None) -> None:
        caught.append(sig)
        if drain is not None:
            drain.begin()
        server.handle_exit(sig, frame)

    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="viasd-http")
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        executor.serve(until=lambda: not http.is_alive())
        http.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for sig in reversed(caught):
        signal.raise_signal(sig)
