"""Sampling parameters and the pure maths that turns logits into the distributions we sample from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from viasd.errors import ViasdError

# The seeds a torch generator accepts: any 64-bit integer, signed or unsigned.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
# Temperatures below this are greedy: sampling at them is argmax up to float rounding, and dividing
# logits by them overflows float32 (or, in transformers' warpers, turns the distribution into NaN).
GREEDY_BELOW = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 (or below GREEDY_BELOW) means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ViasdError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ViasdError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_integer(self.top_k) or self.top_k < 0:
            raise ViasdError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and (not _is_integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ViasdError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh random generator, seeded when a seed is given."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """One-hot rows at the argmax of each row of `logits` [n, V] (NaN counts as lowest), float32."""
    scores = logits.float().nan_to_num(nan=float("-inf"))
    probs = torch.zeros_like(scores)
    probs.scatter_(-1, scores.argmax(dim=-1, keepdim=True), 1.0)
    return probs


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distributions to sample from, rows of `logits` [n, V] -> probs [n, V] (float32).

    Greedy gives one-hot rows at the argmax, so speculative sampling on them reduces to exact matching.
    Every row is a finite distribution: the largest score is shifted to 0 before dividing by the
    temperature (so tiny temperatures cannot overflow), top-p keeps at least the most likely token, and
    a row that still has no finite mass (NaN logits) falls back to its argmax.
    """
    logits = logits.float()
    if params.greedy:
        return one_hot_argmax(logits)
    scores = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first token always stays
        # (a top_p below float32's smallest number would otherwise drop it too).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim=-1)
    bad = ~torch.isfinite(probs).all(dim=-1) | ~(probs.sum(dim=-1) > 0)
    if bool(bad.any()):
        probs[bad] = one_hot_argmax(logits[bad])
    return probs


def soft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Smooth distributions for confidence gates: softmax at the sampling temperature (1 when greedy)."""
    temperature = params.temperature if not params.greedy else 1.0
    logits = logits.float()
    return ((logits - logits.amax(dim=-1, keepdim=True)) / temperature).softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from a single distribution [V]; refuses one that is not a finite distribution."""
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise ViasdError("cannot sample: the token distribution is not finite (the model produced NaN or inf logits)")
    if (probs > 0).sum() == 1:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))
