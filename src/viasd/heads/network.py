"""The draft head: a recurrent network over the target's features that drafts a chain of tokens.

The target's pass leaves, at every position it computed logits for, the feature its output head read: h_t, which
predicted token x_{t+1}. The head starts from that feature and, one draft step at a time, folds in the embedding of
the token just chosen: s_0 = h_t, s_d = s_{d-1} + blocks(s_{d-1}, e(x_{t+d})), and reads its logits with the target's
own output head, restricted to the head's vocabulary (the tokens the target writes most): logits_d = W[ids] s_d
predicts x_{t+d+1}. It shares the target's embeddings and output head (no copy is stored) and reads no prompt: a
draft costs a few small products, not a model's pass (the recurrent drafter design, Apple's ReDrafter; EAGLE's
head attends over its own cache instead, which needs every prompt position's feature).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional


@dataclass(frozen=True)
class HeadConfig:
    """A head's shape: the target's hidden size, the width and number of its residual blocks, its vocabulary."""

    hidden: int
    width: int = 1024
    blocks: int = 1
    vocab: int = 8192

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class _Norm(nn.Module):
    """RMS normalisation with a learned scale."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (x.float() * scale).to(x.dtype) * self.weight.to(x.dtype)


class _Block(nn.Module):
    """One residual update of the state from (state, token embedding): a gated MLP (SwiGLU) over both, normalised."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.state_norm, self.token_norm = _Norm(hidden), _Norm(hidden)
        self.gate = nn.Linear(2 * hidden, width, bias=False)
        self.up = nn.Linear(2 * hidden, width, bias=False)
        self.down = nn.Linear(width, hidden, bias=False)
        nn.init.zeros_(self.down.weight)  # starts as the identity on the state

    def forward(self, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.state_norm(state), self.token_norm(token)], dim=-1)
        return state + self.down(functional.silu(self.gate(x)) * self.up(x))


class DraftHead(nn.Module):
    """The head's own weights (its blocks) and vocabulary; the target's embeddings and head rows come from outside."""

    def __init__(self, config: HeadConfig, token_ids: torch.Tensor) -> None:
        super().__init__()
        if token_ids.shape != (config.vocab,):
            raise ValueError(f"a head of vocabulary {config.vocab} needs {config.vocab} token ids")
        self.config = config
        self.blocks = nn.ModuleList(_Block(config.hidden, config.width) for _ in range(config.blocks))
        self.register_buffer("token_ids", token_ids.long(), persistent=True)

    def step(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The next state [..., hidden] from the state and the embedding of the token just chosen."""
        for block in self.blocks:
            state = block(state, embedded)
        return state
