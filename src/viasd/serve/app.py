"""The OpenAI-compatible HTTP app, built by `create_app` from a loaded engine and the server settings.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events or not),
GET /v1/models, /health and /metrics, and vLLM's operators' endpoints POST /tokenize and /detokenize and
GET /version. All state (queue, metrics, executors) lives in the app that the factory returns, so two apps
in one process share nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import viasd.serve.structured as structured
import viasd.serve.tokenization as tokenization
from viasd import __version__
from viasd.decode.base import GenerationConfig, GenerationResult
from viasd.decode.logprobs import TokenLogprob
from viasd.engine import Engine
from viasd.errors import ViasdError
from viasd.methods import MethodSpec
from viasd.passes.executor import PassExecutor
from viasd.passes.prefix_cache import PrefixCache, exact_reuse
from viasd.prompting import PLAIN_TEMPLATE, ChatTemplate, Message, encode_messages
from viasd.serve.drain import Drain, Drained
from viasd.serve.errors import APIError, error_body
from viasd.serve.generation import GenerationCancelled, GenerationService, Job
from viasd.serve.logprobs import TokenText, chat_logprobs, completion_logprobs, text_offsets
from viasd.serve.metrics import Metrics, prefix_cache_text
from viasd.serve.middleware import GuardMiddleware
from viasd.serve.openapi import Served, completion_responses, error_responses, install_openapi
from viasd.serve.request_config import generation_config as request_generation_config
from viasd.serve.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Health,
    ModelCard,
    ModelList,
    QueueState,
    Usage,
    field_range,
)
from viasd.serve.settings import DEFAULT_PREFIX_CACHE_MB, ServeSettings
from viasd.serve.structured import GrammarTokenizer, request_grammar, requested_schema
from viasd.serve.tools import ToolUse, text_answer, tool_answer, tool_use
from viasd.toolcalls.formats import template_format
from viasd.toolcalls.streaming import ToolCallStream
from viasd.verify.grammar import Grammar

log = logging.getLogger("viasd.serve")

PATHS = (
    *("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json"),
    *("/tokenize", "/detokenize", "/version"),
)
# pydantic error types about a number out of its range (or not finite), answered with the field's whole range
_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"})
# pydantic error types about a value of another JSON type than the field's (strict: true is no integer) -> its type
_TYPE_ERRORS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean (true or false)",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
}
# A union member in a pydantic error location: a builtin type, a model (CamelCase) or a generic (`list[int]`).
_UNION_MEMBER = re.compile(r"str|int|float|bool|dict|list|none|[A-Z]\w*|\w+\[.*\]")
_DISCONNECT_POLL_SECONDS = 0.25
# our finish reasons -> OpenAI's
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
RequestT = TypeVar("RequestT", bound=BaseModel)
ResultT = TypeVar("ResultT")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: BaseModel | dict[str, Any] | str) -> str:
    """One server-sent event carrying a JSON payload (or the literal [DONE])."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    elif isinstance(payload, dict):
        data = json.dumps(payload)
    else:
        data = payload
    return f"data: {data}\n\n"


def validation_message(errors: Sequence[Any], model: type[BaseModel] | None = None) -> str:
    """A one-line account of what is wrong with a request body, from pydantic's error list.

    A number out of range (or NaN, or infinite) is reported with the field's whole range, read from `model`.
    """
    problems: list[str] = []
    for item in errors:
        if item.get("type") == "json_invalid":
            detail = str(item.get("msg", "")).removeprefix("Invalid JSON: ")
            return f"the request body is not valid JSON ({detail})" if detail else "the request body is not valid JSON"
        loc = field_path(item.get("loc", ()))
        where = ".".join(loc) or "body"
        message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
        bounds = field_range(model, loc[0]) if model is not None and len(loc) == 1 else None
        if item.get("type") in _RANGE_ERRORS and bounds:
            problems.append(f"{where} must be {bounds}, got {_shown(item.get('input'))}")
        elif item.get("type") == "extra_forbidden":
            problems.append(f"{where}: unknown parameter (not in OpenAI's API nor among the extensions served here)")
        elif item.get("type") in _TYPE_ERRORS:
            problems.append(f"{where} must be {_TYPE_ERRORS[item['type']]}, got {_shown(item.get('input'))}")
        else:
            problems.append(f"{where}: {message}")
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return "invalid request: " + "; ".join(problems[:5]) + more


def field_path(loc: Sequence[Any]) -> list[str]:
    """The request field a pydantic error is about, as the client names it: without the members of a union pydantic
    adds to the location (`prompt.list[int].0` is `prompt.0`, `stop.str` is `stop`)."""
    return [str(part) for part in loc if part != "body" and not _UNION_MEMBER.fullmatch(str(part))]


def _shown(value: Any) -> str:
    """A rejected input as the client wrote it in JSON, cut short: NaN and Infinity by their JSON names."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN (not a number)" if math.isnan(value) else f"{'-' if value < 0 else ''}Infinity"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


async def parse_body(request: Request, model: type[RequestT]) -> RequestT:
    """The JSON body as `model`, whatever the Content-Type (curl sends form encoding by default)."""
    body = await request.body()
    if not body.strip():
        raise APIError(400, "the request body is empty: send a JSON object", code="invalid_request")
    try:
        return model.model_validate_json(body)
    except ValidationError as error:
        errors = error.errors()
        first = field_path(errors[0].get("loc", ())) if errors else []
        param = ".".join(first) or None
        raise APIError(400, validation_message(errors, model), code="invalid_request", param=param) from error


def prefix_cache_for(
    engine: Engine, settings: ServeSettings
) -> tuple[PrefixCache | None, frozenset[str], frozenset[str] | None]:
    """The prefix cache --prefix-cache-mb asks for (None: off), the methods whose prompts resume exactly from it
    (passes/prefix_cache.py, `exact_reuse`) and those it serves (None: all): 'auto' keeps DEFAULT_PREFIX_CACHE_MB
    for the exact ones alone and says in one line which methods go without it and why; a size serves every
    method."""
    why_not = {
        name: exact_reuse(engine.decoder(spec).sessions(), f"method {name!r}") for name, spec in settings.parsed.items()
    }
    exact = frozenset(name for name, why in why_not.items() if why is None)
    megabytes = settings.prefix_cache_mb
    if megabytes is None:  # auto
        off: dict[str, list[str]] = {}
        for name, why in why_not.items():
            if why is not None:
                off.setdefault(why, []).append(name)
        if off:
            reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in off.items())
            log.info("prefix cache: off for %s (--prefix-cache-mb sets a size for every method)", reasons)
        return (PrefixCache(DEFAULT_PREFIX_CACHE_MB << 20) if exact else None), exact, exact
    return (PrefixCache(megabytes << 20) if megabytes else None), exact, None


def create_app(engine: Engine, settings: ServeSettings, executor: PassExecutor | None = None) -> FastAPI:
    """Build the app. The engine must already hold (or be able to build) a decoder for every method. With an
    executor, every model pass runs on its thread (`viasd serve`: the main thread; passes/executor.py says why)."""
    metrics = Metrics(settings.methods, model_name=settings.model_id)
    for slot in range(settings.max_active):  # each generation that may run at once has decoders of its own
        for method in settings.parsed.values():
            engine.decoder(method, slot)
    prefix_cache, exact, cached = prefix_cache_for(engine, settings)
    service = GenerationService(
        engine,
        metrics,
        settings.max_queue,
        settings.max_active,
        settings.max_rows,
        settings.adaptive_drafts,
        executor,
        prefix_cache,
        exact,
        cached,
    )
    # When --shutdown-timeout is over, the requests still running are told so and their generations stopped.
    drain = Drain(settings.shutdown_timeout, on_end=lambda: service.close(wait=False))
    tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="viasd-tokenize")
    grammar_pool = ThreadPoolExecutor(max_workers=structured.COMPILE_WORKERS, thread_name_prefix="viasd-grammar")
    watchers: set[asyncio.Task[None]] = set()
    created = int(time.time())
    vocab_size = len(engine.tokenizer)
    default_decoder = engine.decoder(settings.parsed[settings.default_method])
    context_limit = default_decoder.context_limit
    # Structured output's view of the tokenizer (as wide as the model's logits): built on the first request asking.
    logits_width = getattr(getattr(default_decoder.target, "config", None), "vocab_size", None) or 0
    grammar_tokenizer = GrammarTokenizer(engine.tokenizer, default_decoder.eos_ids, max(vocab_size, logits_width))
    # /tokenize's max_model_len: the model's context, or (when its config does not say) what this server lets in
    max_model_len = context_limit or settings.max_prompt_tokens + settings.max_tokens_limit
    tool_format = template_format(getattr(engine.tokenizer, "chat_template", None))  # None: tools are refused

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        drain.bind(asyncio.get_running_loop())
        try:
            yield
        finally:
            # Uvicorn has drained the in-flight requests (or given up after its timeout): stop the rest.
            await asyncio.to_thread(service.close, True)
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)
            grammar_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="viasd",
        version=__version__,
        summary="OpenAI-compatible server for speculative decoding (VIA-SD)",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.drain = drain  # begun by `viasd serve` on SIGTERM or Ctrl-C
    served = Served(
        model_id=settings.model_id,
        methods=settings.methods,
        max_tokens=settings.max_tokens_limit,
        vocab_size=vocab_size,
        api_key=settings.api_key is not None,
        tools=tool_format is not None,
    )
    install_openapi(
        app,
        {
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/completions": CompletionRequest,
            "/tokenize": tokenization.TokenizeRequest,
            "/detokenize": tokenization.DetokenizeRequest,
        },
        events=[ChatCompletionChunk],
        served=served,
    )
    keyed = settings.api_key is not None
    app.add_middleware(
        GuardMiddleware,
        metrics=metrics,
        api_key=settings.api_key,
        max_body_bytes=settings.max_body_bytes,
        known_paths=PATHS,
    )

    # ------------------------------------------------------------------------------------ errors

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, validation_message(exc.errors()), "invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ViasdError)
    async def user_error(request: Request, exc: ViasdError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc), param=getattr(exc, "param", None)), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal server error ({type(exc).__name__})"), status_code=500)

    # ------------------------------------------------------------------------- request handling

    def check_model(model: str | None) -> None:
        if model and model != settings.model_id:
            raise APIError(
                404,
                f"model {model!r} is not served here; this server serves {settings.model_id!r}",
                code="model_not_found",
                param="model",
            )

    def pick_method(method: str | None) -> MethodSpec:
        """The request's method among those served, as parsed at start (no request parses a method name)."""
        chosen = settings.method(method)
        if chosen is None:
            raise APIError(
                400,
                f"method {method!r} is not loaded on this server; loaded: {', '.join(settings.methods)}",
                code="method_not_loaded",
                param="method",
            )
        return chosen

    async def generation_config(req: ChatCompletionRequest | CompletionRequest, method: MethodSpec) -> GenerationConfig:
        asked = requested_schema(req)
        grammar = await compile_grammar(req, asked[0]) if asked else None
        return request_generation_config(req, settings, method, vocab_size, grammar)

    async def compile_grammar(req: ChatCompletionRequest | CompletionRequest, name: str) -> Grammar | None:
        """The request's grammar, compiled on the grammar workers within COMPILE_SECONDS, else a 400 naming `name`."""
        compiling = asyncio.get_running_loop().run_in_executor(grammar_pool, request_grammar, req, grammar_tokenizer)
        try:
            return await asyncio.wait_for(compiling, structured.COMPILE_SECONDS)
        except TimeoutError:
            raise structured.compile_too_slow(name) from None

    async def encode(messages: Sequence[Message], chat: bool, template: ChatTemplate = PLAIN_TEMPLATE) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(tokenizer_pool, encode_messages, engine.tokenizer, messages, chat, template)

    def check_vocabulary(ids: Sequence[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            message = f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})"
            raise APIError(400, message, param=param)

    def check_prompt(ids: Sequence[int], param: str) -> None:
        if len(ids) > settings.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; this server accepts at most {settings.max_prompt_tokens} "
                "(--max-prompt-tokens)",
                code="prompt_too_long",
                param=param,
            )
        if context_limit is not None and len(ids) >= context_limit:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens; the model's context holds {context_limit}",
                code="prompt_too_long",
                param=param,
            )

    async def watch_disconnect(request: Request, job: Job) -> None:
        """Cancel the job when its client goes away, whether it waits in the queue or generates."""
        while not job.done():
            if await request.is_disconnected():
                log.debug("client went away; cancelling its %s generation", job.method)
                job.cancel.set()
                return
            await asyncio.wait([job.result], timeout=_DISCONNECT_POLL_SECONDS)

    def start(request: Request, prompt: list[int], method: MethodSpec, config: GenerationConfig) -> Job:
        job = service.submit(prompt, method, config)
        watcher = asyncio.create_task(watch_disconnect(request, job))
        watchers.add(watcher)
        watcher.add_done_callback(watchers.discard)
        return job

    async def finish(job: Job) -> GenerationResult:
        """The job's result; a failure, or the end of a shutdown's drain, becomes an API error."""
        try:
            with drain.running():
                return await drain.race(asyncio.shield(job.result))
        except Drained as error:
            raise APIError(503, drain.message, code="shutting_down") from error
        except GenerationCancelled as error:
            raise APIError(499, "the client closed the request", code="cancelled") from error
        except ViasdError as error:
            raise APIError(400, str(error), param=getattr(error, "param", None)) from error
        finally:
            job.cancel.set()  # no-op when finished; stops the generation if this handler was cancelled

    def usage(prompt: Sequence[int], result: GenerationResult) -> Usage:
        n = len(result.tokens)
        return Usage(
            prompt_tokens=len(prompt),
            completion_tokens=n,
            total_tokens=len(prompt) + n,
            speculative=result.stats.to_dict(),
        )

    async def stream(
        job: Job,
        prompt: Sequence[int],
        first: str | None,
        piece_event: Callable[[str, list[TokenLogprob]], str],
        finish_event: Callable[[str, list[TokenLogprob]], str],
        usage_event: Callable[[Usage], str] | None,
    ) -> AsyncIterator[str]:
        """The SSE body: text pieces as they are committed (each with the log-probabilities of the tokens committed
        since the last, when asked for), the finish reason (with those of tokens that made no text), usage if asked,
        [DONE]. A stream the end of a shutdown's drain cuts short ends with an error event and [DONE], so that its
        client knows."""
        scored: list[TokenLogprob] = []  # log-probabilities not sent yet: they go with the next text
        try:
            if first is not None:
                yield first
            try:
                with drain.running():
                    while (piece := await drain.race(job.pieces.get())) is not None:
                        if isinstance(piece, list):
                            scored.extend(piece)
                            continue
                        # Empty while a tool call's text is held: its scores wait for the next event.
                        if event := piece_event(piece, scored):
                            yield event
                            scored = []
                    result = await drain.race(asyncio.shield(job.result))
            except Drained:
                yield sse(error_body(503, drain.message, "shutting_down"))
                yield sse("[DONE]")
                return
            except GenerationCancelled:
                return
            except Exception as error:
                if not isinstance(error, ViasdError):
                    log.error("generation failed mid-stream", exc_info=error)
                status = 400 if isinstance(error, ViasdError) else 500
                message = str(error) if isinstance(error, ViasdError) else f"internal error ({type(error).__name__})"
                yield sse(error_body(status, message))
                yield sse("[DONE]")
                return
            yield finish_event(_FINISH.get(result.finish_reason, result.finish_reason), scored)
            if usage_event is not None:
                yield usage_event(usage(prompt, result))
            yield sse("[DONE]")
        finally:
            job.cancel.set()

    # ------------------------------------------------------------------------------------ routes

    @app.get("/health")
    async def health() -> Health:
        waiting, running = service.depth()
        queue = QueueState(waiting=waiting, running=running, capacity=service.capacity)
        return Health(model=settings.model_id, methods=list(settings.methods), queue=queue)

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(api_key=keyed))
    async def prometheus() -> PlainTextResponse:
        waiting, running = service.depth()
        text = metrics.render(waiting=waiting, running=running, capacity=service.capacity)
        if service.prefix_cache is not None:
            text += prefix_cache_text(service.prefix_cache.counts())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> ModelCard:
        return ModelCard(id=settings.model_id, created=created, methods=list(settings.methods))

    @app.get("/version", responses=error_responses(api_key=keyed))
    async def version() -> tokenization.VersionInfo:
        return tokenization.VersionInfo(version=__version__)

    def answers(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
        """The documented answers of an operators' route: `model` at once, or an error (no queue, no stream)."""
        return {
            200: {"model": model, "description": "Successful Response"},
            **error_responses(400, 404, 413, api_key=keyed),
        }

    async def off_loop(function: Callable[..., ResultT], *args: Any) -> ResultT:
        """Run tokenizer work on the tokenizer's thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(tokenizer_pool, function, *args)

    @app.post("/tokenize", response_model=None, responses=answers(tokenization.TokenizeResponse))
    async def tokenize_route(request: Request) -> tokenization.TokenizeResponse:
        req = await parse_body(request, tokenization.TokenizeRequest)
        check_model(req.model)
        if req.prompt is not None and req.messages is not None:
            raise APIError(400, "send prompt (text) or messages (chat), not both", "invalid_request", "messages")
        if req.prompt is None and req.messages is None:
            raise APIError(
                400, "nothing to tokenize: send prompt (text) or messages (chat)", "invalid_request", "prompt"
            )
        if req.prompt is not None:  # the template's options would change nothing: refused, not ignored
            for name in tokenization.MESSAGES_ONLY:
                if getattr(req, name) is not None:
                    raise APIError(400, f"{name} applies to messages only, not to a prompt", "invalid_request", name)
        offered = tool_use(req.tools, None, None, tool_format).offered
        try:
            ids = await off_loop(tokenization.tokenize, engine.tokenizer, req, offered)
        except ViasdError as error:
            param = getattr(error, "param", "prompt" if req.prompt is not None else "messages")
            raise APIError(400, str(error), "invalid_request", param) from error
        strings = await off_loop(tokenization.token_strings, engine.tokenizer, ids) if req.return_token_strs else None
        return tokenization.TokenizeResponse(
            count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strings
        )

    @app.post("/detokenize", response_model=None, responses=answers(tokenization.DetokenizeResponse))
    async def detokenize_route(request: Request) -> tokenization.DetokenizeResponse:
        req = await parse_body(request, tokenization.DetokenizeRequest)
        check_model(req.model)
        check_vocabulary(req.tokens, "tokens")
        return tokenization.DetokenizeResponse(
            prompt=await off_loop(tokenization.detokenize, engine.tokenizer, req.tokens)
        )

    @app.get("/v1/models", responses=error_responses(api_key=keyed))
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", responses=error_responses(404, api_key=keyed))
    async def get_model(model_id: str) -> ModelCard:
        check_model(model_id)
        return model_card()

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses=completion_responses(ChatCompletion, ChatCompletionChunk, keyed),
    )
    async def chat_completions(request: Request) -> Response | ChatCompletion:
        req = await parse_body(request, ChatCompletionRequest)
        check_model(req.model)
        method = pick_method(req.method)
        config = await generation_config(req, method)
        use = tool_use(req.tools, req.tool_choice, req.parallel_tool_calls, tool_format)
        messages = [m.as_prompt_message() for m in req.messages]
        prompt = await encode(messages, chat=True, template=req.template(use.offered))
        prompt = prompt[-(req.truncate_prompt_tokens or len(prompt)) :]
        check_prompt(prompt, "messages")
        job = start(request, prompt, method, config)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        token_text = TokenText(engine.tokenizer)
        if not req.stream:
            result = await finish(job)
            logprobs = None
            if result.logprobs is not None:
                logprobs = await off_loop(chat_logprobs, result.logprobs, token_text)
            answer = text_answer(result.text, use, _FINISH.get(result.finish_reason, result.finish_reason))
            message = ChatMessageOut(content=answer.content, tool_calls=answer.calls or None)
            return ChatCompletion(
                id=rid,
                created=now,
                model=settings.model_id,
                choices=[ChatChoice(message=message, logprobs=logprobs, finish_reason=answer.finish_reason)],
                usage=usage(prompt, result),
            )

        def chunk(delta: ChatDelta, finish_reason: str | None = None, scored: Sequence[TokenLogprob] = ()) -> str:
            logprobs = chat_logprobs(scored, token_text) if config.logprobs is not None and scored else None
            choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
            return sse(ChatCompletionChunk(id=rid, created=now, model=settings.model_id, choices=[choice]))

        def usage_chunk(u: Usage) -> str:
            return sse(ChatCompletionChunk(id=rid, created=now, model=settings.model_id, choices=[], usage=u))

        piece_event, finish_event = chat_events(chunk, use)
        body = stream(
            job,
            prompt,
            first=chunk(ChatDelta(role="assistant", content="")),
            piece_event=piece_event,
            finish_event=finish_event,
            usage_event=usage_chunk if req.include_usage() else None,
        )
        return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)

    def chat_events(
        chunk: Callable[[ChatDelta, str | None, Sequence[TokenLogprob]], str], use: ToolUse
    ) -> tuple[Callable[[str, list[TokenLogprob]], str], Callable[[str, list[TokenLogprob]], str]]:
        """A chat stream's events for a piece of text and for the end, each with the log-probabilities of the tokens
        not sent yet; with tools to call, content until a call starts, then at the end the rest of the content and
        each call whole (or all of it as content, if the calls are badly written), the held scores on the last."""
        if use.format is None:
            return (
                lambda piece, scored: chunk(ChatDelta(content=piece), None, scored),
                lambda reason, scored: chunk(ChatDelta(), reason, scored),
            )
        calls = ToolCallStream(use.format, use.names)

        def piece_event(piece: str, scored: list[TokenLogprob]) -> str:
            content = calls.feed(piece)
            return chunk(ChatDelta(content=content), None, scored) if content else ""

        def finish_event(reason: str, scored: list[TokenLogprob]) -> str:
            tail, parsed = calls.finish()
            answer = tool_answer(parsed, use, reason, indexed=True)
            events = chunk(ChatDelta(content=tail), None, ()) if tail else ""
            events += "".join(chunk(ChatDelta(tool_calls=[call]), None, ()) for call in answer.calls)
            return events + chunk(ChatDelta(), answer.finish_reason, scored)

        return piece_event, finish_event

    @app.post("/v1/completions", response_model=None, responses=completion_responses(Completion, Completion, keyed))
    async def completions(request: Request) -> Response | Completion:
        req = await parse_body(request, CompletionRequest)
        check_model(req.model)
        method = pick_method(req.method)
        config = await generation_config(req, method)
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            prompt = [int(t) for t in req.prompt]
            check_vocabulary(prompt, "prompt")
        else:
            text = req.prompt if isinstance(req.prompt, str) else str(req.prompt[0])
            prompt = await encode([{"role": "user", "content": text}], chat=False)
        prompt = prompt[-(req.truncate_prompt_tokens or len(prompt)) :]
        check_prompt(prompt, "prompt")
        job = start(request, prompt, method, config)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        token_text = TokenText(engine.tokenizer)

        def completion(choices: list[CompletionChoice], u: Usage | None = None) -> Completion:
            return Completion(id=rid, created=now, model=settings.model_id, choices=choices, usage=u)

        def echoed_logprobs(result: GenerationResult, echo: list[int], echoed: str) -> CompletionLogprobs:
            """The choice's log-probabilities: the echoed prompt's tokens (when asked), then the output's."""
            skip = config.skip_special_tokens
            offsets = text_offsets(engine.tokenizer, echo, skip)
            offsets += [len(echoed) + at for at in text_offsets(engine.tokenizer, result.tokens, skip)]
            entries = [*(result.prompt_logprobs or []), *(result.logprobs or [])]
            return completion_logprobs(entries, token_text, offsets, first_unscored=1 if echo else 0)

        if not req.stream:
            result = await finish(job)
            reason = _FINISH.get(result.finish_reason, result.finish_reason)
            echoed = ""
            if req.echo:  # the prompt as sent; as the model reads it when it was token ids or truncated
                sent = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
                whole = isinstance(sent, str) and req.truncate_prompt_tokens is None
                echoed = str(sent) if whole else engine.tokenizer.decode(prompt)
            logprobs = None
            if result.logprobs is not None:
                logprobs = await off_loop(echoed_logprobs, result, prompt if req.echo else [], echoed)
            choice = CompletionChoice(text=echoed + result.text, logprobs=logprobs, finish_reason=reason)
            return completion([choice], usage(prompt, result))

        streamed: list[int] = []  # the output's tokens streamed so far, for their offsets in the text

        def piece_logprobs(scored: Sequence[TokenLogprob]) -> CompletionLogprobs | None:
            if config.logprobs is None or not scored:
                return None
            start_at = len(streamed)
            streamed.extend(entry.token for entry in scored)
            offsets = text_offsets(engine.tokenizer, streamed, config.skip_special_tokens, start_at)
            return completion_logprobs(scored, token_text, offsets)

        def piece_event(piece: str, scored: Sequence[TokenLogprob]) -> str:
            return sse(completion([CompletionChoice(text=piece, logprobs=piece_logprobs(scored))]))

        def finish_event(reason: str, scored: Sequence[TokenLogprob]) -> str:
            logprobs = piece_logprobs(scored)
            return sse(completion([CompletionChoice(text="", logprobs=logprobs, finish_reason=reason)]))

        body = stream(
            job,
            prompt,
            first=None,
            piece_event=piece_event,
            finish_event=finish_event,
            usage_event=(lambda u: sse(completion([], u))) if req.include_usage() else None,
        )
        return StreamingResponse(body, media_type="text/event-stream", headers=_SSE_HEADERS)

    return app
