"""Sampling parameters and the pure maths that turns logits into the distributions we sample from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from viasd.errors import ViasdError


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ViasdError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ViasdError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ViasdError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh random generator, seeded when a seed is given."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distributions to sample from, rows of `logits` [n, V] -> probs [n, V] (float32).

    Greedy gives one-hot rows at the argmax, so speculative sampling on them reduces to exact matching.
    """
    logits = logits.float()
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first token always stays).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def soft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Smooth distributions for confidence gates: softmax at the sampling temperature (1 when greedy)."""
    temperature = params.temperature if not params.greedy else 1.0
    return (logits.float() / temperature).softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from a single distribution [V]."""
    if (probs > 0).sum() == 1:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))
