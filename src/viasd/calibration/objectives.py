"""Objectives for the mask search: how far a slim distribution s is from the full target q, per position.

All functions take logits (or log-probabilities: they are normalised here) of shape [N, V], compute in
float32 and return one value per position, so callers can sum over many sequences and average once.

* margin (the paper's "sum of margin violations" in ReLU form). With t = argmax q and the log-probability
  gaps d_s(v) = log s(v) - log s(t) and d_q(v) = log q(t) - log q(v) >= 0:

      cost = sum over v in R of relu(d_s(v) + min(margin, d_q(v)))

  where R holds the slim view's `rivals` most likely tokens. The slim view should rank the target's top
  token t above every rival v by at least the target's own gap, capped at `margin` nats. The cost is
  zero exactly when s's top token is t and it leads every rival by min(margin, d_q(v)). Capping by d_q
  does not punish s for a near-tie that q itself has. Summing over s's top tokens rather than the whole
  vocabulary keeps one broken position (s nearly flat: 10^5 tokens above t) from outweighing hundreds
  of good ones, so the mean over positions stays a usable ranking of masks; a token outside s's top
  `rivals` cannot be s's choice anyway. This is what greedy verification needs (argmax s == argmax q),
  with a safety margin.
* kl: KL(q || s) in nats, the usual distillation divergence.
* agreement: 1.0 where argmax s == argmax q (higher is better; the search minimises 1 - agreement).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from viasd.errors import ViasdError

OBJECTIVES = ("margin", "kl", "agreement")
DEFAULT_MARGIN = 1.0
DEFAULT_RIVALS = 16
_ROWS = 64  # rows per step: bounds the [rows, V] temporaries (V is 150k for Qwen)


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(dim=-1)


def _check(slim: torch.Tensor, target: torch.Tensor) -> None:
    if slim.shape != target.shape or slim.dim() != 2:
        raise ViasdError(f"objective: slim {tuple(slim.shape)} and target {tuple(target.shape)} must both be [N, V]")


def margin_violation(
    slim: torch.Tensor, target: torch.Tensor, margin: float = DEFAULT_MARGIN, rivals: int = DEFAULT_RIVALS
) -> torch.Tensor:
    """Per-position margin-violation cost [N] (see the module docstring)."""
    _check(slim, target)
    out = []
    k = min(rivals, slim.shape[-1])
    for i in range(0, slim.shape[0], _ROWS):
        ls, lq = _log_probs(slim[i : i + _ROWS]), _log_probs(target[i : i + _ROWS])
        top = lq.argmax(dim=-1, keepdim=True)
        best_s, idx = ls.topk(k, dim=-1)
        d_s = best_s - ls.gather(-1, top)
        d_q = lq.gather(-1, top) - lq.gather(-1, idx)
        out.append(torch.relu(d_s + d_q.clamp(max=margin)).sum(dim=-1))
    return torch.cat(out) if out else torch.zeros(0)


def kl_target_slim(slim: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-position KL(q || s) in nats [N]."""
    _check(slim, target)
    out = []
    for i in range(0, slim.shape[0], _ROWS):
        ls, lq = _log_probs(slim[i : i + _ROWS]), _log_probs(target[i : i + _ROWS])
        out.append((lq.exp() * (lq - ls)).sum(dim=-1).clamp_min(0.0))
    return torch.cat(out) if out else torch.zeros(0)


def top1_agreement(slim: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-position 1.0 where the slim and target top tokens agree, else 0.0 [N]."""
    _check(slim, target)
    return (slim.argmax(dim=-1) == target.argmax(dim=-1)).float()


@dataclass(frozen=True)
class Scores:
    """Sums of the three objectives over `count` positions; add Scores to pool sequences."""

    margin: float = 0.0
    kl: float = 0.0
    agreement: float = 0.0
    count: int = 0

    def __add__(self, other: Scores) -> Scores:
        return Scores(
            self.margin + other.margin, self.kl + other.kl, self.agreement + other.agreement, self.count + other.count
        )

    def mean(self, name: str) -> float:
        """Mean of one objective per position ('margin', 'kl' or 'agreement')."""
        if name not in OBJECTIVES:
            raise ViasdError(f"unknown objective {name!r}; choose one of {', '.join(OBJECTIVES)}")
        return getattr(self, name) / self.count if self.count else float("nan")

    def value(self, objective: str) -> float:
        """The objective as the search minimises it: margin, KL, or 1 - agreement."""
        mean = self.mean(objective)
        return 1.0 - mean if objective == "agreement" else mean

    def summary(self) -> dict[str, float]:
        return {"margin": self.mean("margin"), "kl": self.mean("kl"), "agreement": self.mean("agreement")}


def score(slim: torch.Tensor, target: torch.Tensor, margin: float = DEFAULT_MARGIN) -> Scores:
    """All three objectives of a slim view against the target over N positions."""
    return Scores(
        float(margin_violation(slim, target, margin).sum()),
        float(kl_target_slim(slim, target).sum()),
        float(top1_agreement(slim, target).sum()),
        int(slim.shape[0]),
    )
