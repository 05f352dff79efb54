"""A validated request's generation settings: its sampling parameters, penalties, stop conditions and output options,
checked against what the server and the chosen method can honour (a refusal is a 400 that names the parameter)."""

from __future__ import annotations

from viasd.decode.base import GenerationConfig
from viasd.errors import ViasdError
from viasd.methods import MethodSpec
from viasd.serve.errors import APIError
from viasd.serve.schemas import ChatCompletionRequest, CompletionRequest
from viasd.serve.settings import ServeSettings
from viasd.serve.structured import requested_schema
from viasd.verify.grammar import Grammar
from viasd.verify.penalties import Penalties
from viasd.verify.sampling import SamplingParams

# The parameters a method without `Method.penalties` refuses, as the request names them, and their values that change
# nothing (which it accepts).
_NEUTRAL: dict[str, object] = {
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "logit_bias": {},
}


def generation_config(
    req: ChatCompletionRequest | CompletionRequest,
    settings: ServeSettings,
    method: MethodSpec,
    vocab_size: int,
    grammar: Grammar | None = None,
) -> GenerationConfig:
    """The request as a GenerationConfig for `method`, its output following `grammar` (structured output, compiled
    from the request by serve/structured.py); refuses with a 400 naming the parameter what cannot be done."""
    max_tokens = req.requested_max_tokens()
    if max_tokens is None:
        max_tokens = settings.default_max_tokens
    elif max_tokens > settings.max_tokens_limit:
        raise APIError(
            400,
            f"max_tokens is {max_tokens}; this server allows at most {settings.max_tokens_limit} (--max-tokens-limit)",
            code="max_tokens_too_large",
            param="max_tokens",
        )
    top, echoed = logprob_request(req)
    if max_tokens == 0 and not (echoed and top is not None):
        message = "max_tokens may be 0 only with echo and logprobs (the prompt scored, nothing generated)"
        raise APIError(400, message, param="max_tokens")
    if echoed and req.stream:
        raise APIError(400, "echo is not streamed here; send stream false or leave echo out", param="echo")
    if top is not None and not method.method.logprobs:
        message = f"method {method.name!r} cannot report the target's log-probabilities; leave logprobs out"
        raise APIError(400, message, param="logprobs")
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
    for name, ids in (("logit_bias", [t for t, _ in req.bias_pairs()]), ("stop_token_ids", req.stop_token_ids or [])):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            message = f"{name}: token id {outside[0]} is outside the vocabulary (0..{vocab_size - 1})"
            raise APIError(400, message, param=name)
    if not method.method.penalties:
        for name, neutral in _NEUTRAL.items():
            value = getattr(req, name)
            if value is not None and value != neutral:
                raise APIError(400, f"method {method.name!r} cannot honour {name}; leave it out", param=name)
        if grammar is not None:
            name = (requested_schema(req) or ("response_format", None))[0]
            message = f"method {method.name!r} cannot honour structured output ({name}); leave it out"
            raise APIError(400, message, param=name)
    try:
        penalties = Penalties(
            presence=req.presence_penalty or 0.0,
            frequency=req.frequency_penalty or 0.0,
            repetition=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_tokens=req.min_tokens or 0,
            bias=req.bias_pairs(),
        )
        sampling = SamplingParams(
            temperature=settings.default_temperature if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=req.seed,
            min_p=req.min_p or 0.0,
            penalties=penalties,
            grammar=grammar,
        )
    except ViasdError as error:  # the schema's ranges are the same; kept as a backstop with the field named
        raise APIError(400, str(error), param=str(error).split()[0]) from error
    return GenerationConfig(
        max_new_tokens=max_tokens,
        sampling=sampling,
        stop_strings=req.stop_strings(),
        ignore_eos=req.ignore_eos,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
        logprobs=top,
        prompt_logprobs=echoed and top is not None,
    )


def logprob_request(req: ChatCompletionRequest | CompletionRequest) -> tuple[int | None, bool]:
    """How many alternatives each token's log-probability lists (None: no log-probabilities), and whether the prompt
    is echoed (text completions)."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None, False
    return req.logprobs, bool(req.echo)
