"""Penalties, logit bias and min_tokens: logits adjusted by the tokens before each position, as vLLM's OpenAI server
defines them, applied alike to every model that scores a position (drafter, slim views, target).

Order, per row: logit_bias is added; end tokens are banned while fewer than min_tokens tokens were generated;
repetition_penalty divides positive (multiplies negative) logits of tokens seen in the prompt or the output (as in
HF and vLLM); frequency_penalty subtracts penalty x count and presence_penalty subtracts the penalty once, for each
token of the output so far. Temperature, min_p, top-k and top-p come after (`sampling.warp_probs`).

Speculative methods stay exact because each row is adjusted by exactly the tokens before its own position (prompt
+ committed + the drafts before it), which is what plain decoding would have seen there. A drafter that samples
(a model, a draft head) adjusts its own rows alike and reports the distributions it drew from, so its drafts are kept
often; a deterministic one (prompt lookup) needs nothing: its one-hot drafts are checked against the adjusted target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from viasd.errors import ViasdError

PENALTY_MAX = 2.0  # presence and frequency penalties lie in [-2, 2], as in OpenAI's API
BIAS_MAX = 100.0  # logit_bias values lie in [-100, 100], as in OpenAI's API


@dataclass(frozen=True)
class Penalties:
    """A generation's penalties (neutral by default) and what they need to know of its context.

    bias: (token id, value) pairs. prompt_length: where the output starts in a context; ends: the tokens that
    end a generation (EOS unless ignored, and stop tokens), which min_tokens bans. Decoders fill in the last two
    for each generation (`bound`).
    """

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_tokens: int = 0
    bias: tuple[tuple[int, float], ...] = ()
    prompt_length: int = 0
    ends: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        for name, value in (("presence_penalty", self.presence), ("frequency_penalty", self.frequency)):
            if not _finite(value) or abs(value) > PENALTY_MAX:
                raise ViasdError(f"{name} must be a number in [-2, 2], got {value}")
        if not _finite(self.repetition) or self.repetition <= 0:
            raise ViasdError(f"repetition_penalty must be a number > 0 (1 disables it), got {self.repetition}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ViasdError(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        for token, value in self.bias:
            if token < 0:
                raise ViasdError(f"logit_bias token ids must be >= 0, got {token}")
            if not _finite(value) or abs(value) > BIAS_MAX:
                raise ViasdError(f"logit_bias values must be numbers in [-100, 100], got {value} for token {token}")

    @property
    def neutral(self) -> bool:
        """Whether the logits stay as the model gave them."""
        return (
            self.presence == 0.0
            and self.frequency == 0.0
            and self.repetition == 1.0
            and self.min_tokens == 0
            and not self.bias
        )

    def first_set(self) -> str | None:
        """The API name of the first parameter away from its neutral value (for refusals), None if all are neutral."""
        for name, on in (
            ("presence_penalty", self.presence != 0.0),
            ("frequency_penalty", self.frequency != 0.0),
            ("repetition_penalty", self.repetition != 1.0),
            ("min_tokens", self.min_tokens != 0),
            ("logit_bias", bool(self.bias)),
        ):
            if on:
                return name
        return None

    def bound(self, prompt_length: int, ends: frozenset[int]) -> Penalties:
        """These penalties for one generation: its prompt's length and its end tokens."""
        return Penalties(
            self.presence, self.frequency, self.repetition, self.min_tokens, self.bias, prompt_length, frozenset(ends)
        )


def parse_bias(items: Sequence[str]) -> tuple[tuple[int, float], ...]:
    """`TOKEN_ID=BIAS` texts (the CLI's --logit-bias) as (token id, bias) pairs; the last one of a token counts."""
    bias: dict[int, float] = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise ViasdError(f"a logit bias is TOKEN_ID=BIAS (e.g. 42=-100), got {item!r}") from None
    return tuple(bias.items())


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def penalised(
    logits: torch.Tensor, penalties: Penalties, context: Sequence[int], drafts: Sequence[int] | torch.Tensor = ()
) -> torch.Tensor:
    """`logits` [n, V] adjusted by the tokens before each row's position.

    The rows score the positions after the last n prefixes of context + drafts: row n - 1 follows all of them, row
    i follows context + drafts[: len(drafts) - (n - 1 - i)] (so a verifier's rows over a block of k drafts, n = k + 1,
    follow context + drafts[:i]). `context` is the prompt then the committed output; drafts may be a tensor on the
    logits' device (read there, no host sync). Token ids beyond V are ignored. Neutral penalties return `logits`.
    """
    if penalties.neutral:
        return logits
    n, width = logits.shape
    device = logits.device
    out = logits.float().clone()
    drafted = drafts.to(device).reshape(-1) if isinstance(drafts, torch.Tensor) else _upload(drafts, torch.long, device)
    if drafted.numel() < n - 1:
        raise ValueError(f"{n} rows need at least {n - 1} drafts before them, got {drafted.numel()}")
    output = _upload(context[penalties.prompt_length :], torch.long, device)
    shared = torch.cat([output, drafted[: drafted.numel() - (n - 1)]])  # tokens every row follows
    tail = drafted[drafted.numel() - (n - 1) :]  # row i also follows tail[:i]
    counts = _counts(shared, width, device)[None].repeat(n, 1)
    if n > 1:
        steps = torch.zeros(n, width, device=device)
        inside = tail < width
        steps[1:].scatter_(1, tail.clamp(0, width - 1)[:, None], inside.float()[:, None])
        counts += steps.cumsum(dim=0)
    if penalties.bias:
        ids = _upload([t for t, _ in penalties.bias if t < width], torch.long, device)
        values = _upload([v for t, v in penalties.bias if t < width], torch.float32, device)
        out[:, ids] += values
    if penalties.min_tokens:
        generated = output.numel() + drafted.numel() - (n - 1) + torch.arange(n, device=device)
        ends = [t for t in penalties.ends if t < width]
        if ends:
            early = (generated < penalties.min_tokens)[:, None]
            banned = torch.zeros(width, dtype=torch.bool, device=device)
            banned[_upload(ends, torch.long, device)] = True
            out = out.masked_fill(early & banned[None], float("-inf"))
    if penalties.repetition != 1.0:
        prompt = _upload(context[: penalties.prompt_length], torch.long, device)
        seen = (counts > 0) | (_counts(prompt, width, device) > 0)[None]
        scaled = torch.where(out > 0, out / penalties.repetition, out * penalties.repetition)
        out = torch.where(seen, scaled, out)
    if penalties.frequency:
        out = out - penalties.frequency * counts
    if penalties.presence:
        out = out - penalties.presence * (counts > 0).float()
    return out


def _upload(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device`; to a GPU the copy is queued without waiting for the device (a copy from
    pageable memory would wait for every kernel queued before it)."""
    host = torch.tensor(list(values), dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def _counts(tokens: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """How often each token id below `width` occurs in `tokens`: [width] float32."""
    counts = torch.zeros(width, device=device)
    return counts.scatter_add_(0, tokens.clamp(0, width - 1), (tokens < width).float())  # masked, not indexed: no sync
