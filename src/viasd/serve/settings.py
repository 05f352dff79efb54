"""Server settings: what is served and the limits that keep one process safe under load."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from viasd.errors import ViasdError
from viasd.methods import MethodSpec, parse_method

DEFAULT_MAX_BODY_BYTES = 1 << 20
# The prefix cache's size where it is on by default: for the methods whose target runs viasd's fused low-bit layers
# (the default GGUF view on a CPU), whose prompts are then read so that a resumed prompt is a fresh read bit for bit
# (passes/prefix_cache.py, `exact_reuse`). Elsewhere (a dense copy, a GPU) a resumed prompt may round otherwise, so it
# is off unless --prefix-cache-mb asks. 512 MiB holds about 13,000 tokens of the default pair's KV (both models).
DEFAULT_PREFIX_CACHE_MB = 512
AUTO = "auto"  # --prefix-cache-mb's default: DEFAULT_PREFIX_CACHE_MB for the methods it is exact for, off for others


@dataclass(frozen=True)
class ServeSettings:
    """Everything the HTTP app needs besides the engine; validated on construction."""

    model_id: str
    methods: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = 2048
    default_max_tokens: int = 256
    max_active: int = 4  # generations that run at once, their passes merged (continuous batching)
    max_rows: int = 64  # tokens of all active generations in one pass
    adaptive_drafts: bool = True  # speculative requests draft fewer tokens as the batch grows (decode/load.py)
    max_queue: int = 16  # requests that may wait while `max_active` generate; more get 503
    default_temperature: float = 1.0  # OpenAI's default when a request leaves temperature out
    shutdown_timeout: float = 30.0  # seconds requests in flight may run on after SIGTERM or Ctrl-C (serve/drain.py)
    # Finished generations' KV kept for later prompts: MiB for every method (0: off), or None (AUTO): the default size
    # for the methods a resumed prompt is exact for, none for the others.
    prefix_cache_mb: int | None = None
    # The served methods as parsed, once, here: a request names one of them and gets its MethodSpec (`method`).
    parsed: Mapping[str, MethodSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.methods:
            raise ViasdError("no decoding method to serve: pass --methods, e.g. --methods sd,plain")
        # Unknown methods and bad variant options fail here, before loading models.
        object.__setattr__(self, "parsed", {name: parse_method(name) for name in self.methods})
        if len(set(self.methods)) != len(self.methods):
            raise ViasdError(f"--methods names a method twice: {','.join(self.methods)}")
        positive = {
            "--max-body-bytes": self.max_body_bytes,
            "--max-prompt-tokens": self.max_prompt_tokens,
            "--max-tokens-limit": self.max_tokens_limit,
            "--default-max-tokens": self.default_max_tokens,
            "--max-active": self.max_active,
            "--max-rows": self.max_rows,
        }
        for name, value in positive.items():
            if value < 1:
                raise ViasdError(f"{name} must be >= 1, got {value}")
        if not 0 <= self.shutdown_timeout < math.inf:  # NaN fails this too
            raise ViasdError(f"--shutdown-timeout must be a finite number of seconds >= 0, got {self.shutdown_timeout}")
        if self.prefix_cache_mb is not None and self.prefix_cache_mb < 0:
            raise ViasdError(
                f"--prefix-cache-mb must be >= 0 (0 turns the prefix cache off), got {self.prefix_cache_mb}"
            )
        if self.max_queue < 0:
            raise ViasdError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.default_max_tokens > self.max_tokens_limit:
            raise ViasdError(
                f"--default-max-tokens ({self.default_max_tokens}) exceeds --max-tokens-limit ({self.max_tokens_limit})"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ViasdError("the API key is empty: pass a non-empty --api-key (or VIASD_API_KEY), or none")

    @property
    def default_method(self) -> str:
        return self.methods[0]

    def method(self, name: str | None) -> MethodSpec | None:
        """The served method `name` as parsed at start (None: the default), or None when it is not served."""
        return self.parsed.get(name or self.default_method)


def parse_megabytes(text: str) -> int | None:
    """--prefix-cache-mb's '512' -> 512: a whole number of MiB >= 0 (0: off), or 'auto' -> None; refused in one line
    otherwise."""
    value = text.strip()
    if value.lower() == AUTO:
        return None
    if not (value.isascii() and value.isdigit()):  # ASCII digits only: no sign, point, exponent, NaN or '²'
        raise ViasdError(
            "--prefix-cache-mb must be 'auto' or a whole number of MiB >= 0 (0 turns the prefix cache off), "
            f"got {text!r}"
        )
    return int(value)


def parse_methods(text: str) -> tuple[str, ...]:
    """'sd, plain' -> ('sd', 'plain'); the first is the default method."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
