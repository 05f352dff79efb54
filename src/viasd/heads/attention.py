"""The attention head: the chain head's step (heads/network.py) with an attention over the sequence's entries added.

Entry j folds the embedding of x_{j+1} into the target's feature f_j (the state that predicted x_{j+1}; a learned
`missing` vector where no pass computed one, as in the prompt, whose pass keeps only its last row) with the chain
head's residual block: u_j = f_j + block(f_j, e(x_{j+1})). A causal attention over the entries (rotary positions)
adds what the rest of the sequence says: s_j = u_j + o(attention(u_0..u_j)). The target's output head (the rows of
the head's vocabulary) reads x_{j+2} from s_j, and the next draft step is the entry (s_j, x_{j+2}). With `o` at
zero this is exactly the chain head, which is how training starts (from a trained chain head): the attention then
learns what a single feature cannot hold, such as a name in the prompt (EAGLE's head attends over its features too).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from viasd.heads.network import _Block, _Norm


@dataclass(frozen=True)
class AttentionHeadConfig:
    """An attention head's shape: the target's hidden size, the attention's heads, the MLP's width, the vocabulary."""

    hidden: int
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    width: int = 1024
    vocab: int = 8192
    rope_theta: float = 1e6
    design: str = "attention"

    def to_dict(self) -> dict[str, int | float | str]:
        return asdict(self)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of x [..., n, dim] at `positions` [n] (or broadcastable), half-split layout."""
    dim = x.shape[-1]
    freqs = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim)
    angles = positions.float()[..., None] * freqs  # [..., n, dim/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


class AttentionHead(nn.Module):
    """The head's own weights and vocabulary; the target's embeddings and output-head rows come from outside."""

    def __init__(self, config: AttentionHeadConfig, token_ids: torch.Tensor) -> None:
        super().__init__()
        if token_ids.shape != (config.vocab,):
            raise ValueError(f"a head of vocabulary {config.vocab} needs {config.vocab} token ids")
        h, d = config.hidden, config.head_dim
        self.config = config
        self.missing = nn.Parameter(torch.zeros(h))
        self.block = _Block(h, config.width)
        self.attention_norm = _Norm(h)
        self.q = nn.Linear(h, config.heads * d, bias=True)
        self.k = nn.Linear(h, config.kv_heads * d, bias=True)
        self.v = nn.Linear(h, config.kv_heads * d, bias=True)
        self.o = nn.Linear(config.heads * d, h, bias=False)
        nn.init.zeros_(self.o.weight)  # starts as the chain head its block comes from
        self.register_buffer("token_ids", token_ids.long(), persistent=True)

    def entries(self, features: torch.Tensor, have: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The entries u [..., hidden] from features (any values where `have` is False) and token embeddings."""
        state = torch.where(have[..., None], features, self.missing.to(features.dtype))
        return self.block(state, embedded)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [..., heads, n, d], keys and values [..., kv_heads, n, d] of entries x [..., n, hidden]."""
        c = self.config
        normed = self.attention_norm(x)
        shape = x.shape[:-1]

        def split(t: torch.Tensor, heads: int) -> torch.Tensor:
            return t.reshape(*shape, heads, c.head_dim).transpose(-2, -3)

        q = rotary(split(self.q(normed), c.heads), positions, c.rope_theta)
        k = rotary(split(self.k(normed), c.kv_heads), positions, c.rope_theta)
        return q, k, split(self.v(normed), c.kv_heads)

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The states [..., n, hidden] from the entries and their attention outputs [..., heads, n, d]."""
        return x + self.o(attended.transpose(-2, -3).reshape(*x.shape[:-1], -1))

    def expand(self, kv: torch.Tensor) -> torch.Tensor:
        """Keys or values [..., kv_heads, n, d] repeated for every query head."""
        return kv.repeat_interleave(self.config.heads // self.config.kv_heads, dim=-3)


class AttentionCache:
    """The attention head's entries for one sequence, as the drafter extends and cuts them (its own KV cache).

    Invariant: entries [0, length) were computed from `tokens[j + 1]` and, where `featured[j]`, the target's feature
    at j; an entry whose token or feature status no longer matches the session is cut with everything after it,
    because every later entry attended to it.
    """

    def __init__(self, head: AttentionHead) -> None:
        self.head = head
        c = head.config
        self.keys = torch.empty(c.kv_heads, 0, c.head_dim)
        self.values = torch.empty(c.kv_heads, 0, c.head_dim)
        self.tokens: list[int] = []  # tokens[j] is x_{j+1}, the token entry j folded in
        self.featured: list[bool] = []
        self.last_state: torch.Tensor | None = None  # the state of entry length - 1

    @property
    def length(self) -> int:
        return len(self.tokens)

    def cut(self, length: int) -> None:
        if length < self.length:
            del self.tokens[length:], self.featured[length:]
            self.keys, self.values = self.keys[:, :length], self.values[:, :length]
            self.last_state = None

    def extend(self, features: torch.Tensor, have: torch.Tensor, embedded: torch.Tensor, tokens: list[int]) -> None:
        """Append entries (features [n, hidden], have [n], embeddings [n, hidden]) after the cached ones."""
        head, start, n = self.head, self.length, len(tokens)
        x = head.entries(features, have, embedded)
        positions = torch.arange(start, start + n)
        q, k, v = head.project(x, positions)
        keys = torch.cat([self.keys.to(k.dtype), k], dim=1)
        values = torch.cat([self.values.to(v.dtype), v], dim=1)
        mask = torch.arange(start + n)[None, :] <= positions[:, None]  # [n, start + n]: causal
        scores = (q @ head.expand(keys).transpose(-1, -2)) / math.sqrt(head.config.head_dim)
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        self.last_state = head.finish(x, weights @ head.expand(values))[-1]
        self.keys, self.values = keys, values
        self.tokens += tokens
        self.featured += have.tolist()

    def draft(
        self, state: torch.Tensor, embedded: torch.Tensor, chain: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """The state after a draft entry (state, token) placed after the cached entries and the `chain` of earlier
        draft entries' (key, value), which this call extends; the cache itself is not changed."""
        head = self.head
        position = torch.tensor([self.length + len(chain)])
        x = head.entries(state[None], torch.ones(1, dtype=torch.bool), embedded[None])
        q, k, v = head.project(x, position)
        chain.append((k, v))
        keys = torch.cat([self.keys.to(k.dtype), *(key for key, _ in chain)], dim=1)
        values = torch.cat([self.values.to(v.dtype), *(value for _, value in chain)], dim=1)
        scores = (q @ head.expand(keys).transpose(-1, -2)) / math.sqrt(head.config.head_dim)
        return head.finish(x, torch.softmax(scores, dim=-1) @ head.expand(values))[0]
