"""Unrolling the attention head over whole conversations, as it drafts: the training-time test of EAGLE-3.

A batch is a few conversations, padded. Step 1 runs the layer over every entry (f_j, x_{j+1}) with causal
attention: its state at row j predicts x_{j+2}. Step k > 1 feeds each row's previous state back as the feature,
(s_j^{k-1}, x_{j+k}), at position j+k-1, and its query attends to the true entries 0..j and to that row's own chain
entries of steps 2..k: exactly what the head's cache holds when it drafts k tokens from the feature at j. As at
inference, where the prompt's pass keeps only its last row, the features of a conversation's request are hidden
(the learned `missing` vector stands in), and drafts start only inside the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.nn import functional

from viasd.heads.attention import AttentionHead
from viasd.training.dataset import TrainingSet


@dataclass(frozen=True)
class Batch:
    """Conversations padded to one length T: entry j is (features[j], tokens[j + 1])."""

    features: torch.Tensor  # [B, T, hidden] float, zeros where none
    have: torch.Tensor  # [B, T] whether entry j has a feature the head may see
    tokens: torch.Tensor  # [B, T + depth + 1] the conversation's tokens, padded with 0
    length: torch.Tensor  # [B] tokens in each conversation
    answer_from: torch.Tensor  # [B] first answer position


def conversation_bounds(data: TrainingSet) -> tuple[torch.Tensor, torch.Tensor]:
    """Per conversation: its first answer position (relative), and a [N] map of feature rows by token position."""
    n = len(data.tokens)
    row_of = torch.full((n,), -1, dtype=torch.long)
    row_of[data.feature_at] = torch.arange(len(data.feature_at))
    firsts = []
    for c in range(data.conversations):
        a, b = int(data.starts[c]), int(data.starts[c + 1])
        answer = data.answer[a:b].nonzero()
        firsts.append(int(answer[0]) if len(answer) else b - a)
    return torch.tensor(firsts), row_of


def make_batch(
    data: TrainingSet, row_of: torch.Tensor, answer_from: torch.Tensor, chosen: list[int], depth: int
) -> Batch:
    """The conversations `chosen`, padded."""
    lengths = [int(data.starts[c + 1] - data.starts[c]) for c in chosen]
    t = max(lengths)
    hidden = data.features.shape[1]
    features = torch.zeros(len(chosen), t, hidden)
    have = torch.zeros(len(chosen), t, dtype=torch.bool)
    tokens = torch.zeros(len(chosen), t + depth + 1, dtype=torch.long)
    for i, (c, n) in enumerate(zip(chosen, lengths, strict=True)):
        a = int(data.starts[c])
        rows = row_of[a : a + n]
        found = rows >= 0
        features[i, :n][found] = data.features[rows[found]].float()
        have[i, :n] = found
        tokens[i, :n] = data.tokens[a : a + n]
    return Batch(features, have, tokens, torch.tensor(lengths), answer_from[chosen])


@dataclass(frozen=True)
class Unrolled:
    """Per step k (0-based): the states [B, T, hidden], the labels [B, T] (-1: no draft starts there)."""

    states: list[torch.Tensor]
    labels: list[torch.Tensor]


def unroll(
    head: AttentionHead, embeddings: torch.Tensor, batch: Batch, depth: int, hide_request: bool = True
) -> Unrolled:
    """Run the head `depth` draft steps from every row at once (training-time test); `hide_request`: the request's
    features are hidden, as drafting sees a prompt whose pass computed only its last row's."""
    b, t, _ = batch.features.shape
    rows = torch.arange(t)
    real = rows[None, :] < (batch.length[:, None] - 1)  # entry j needs x_{j+1}
    seen = batch.have & real
    if hide_request:
        seen = seen & (rows[None, :] >= (batch.answer_from[:, None] - 1))
    x = head.entries(batch.features, seen, embeddings[batch.tokens[:, 1 : t + 1]].float())
    q, k, v = head.project(x, rows)
    keys, values = head.expand(k), head.expand(v)
    scale = 1.0 / math.sqrt(head.config.head_dim)
    causal = (rows[None, :] <= rows[:, None])[None, None] & real[:, None, None, :]  # [B, 1, T(q), T(k)]
    true_scores = (q @ keys.transpose(-1, -2)) * scale
    true_scores = true_scores.masked_fill(~causal, float("-inf"))
    state = head.finish(x, torch.softmax(true_scores, dim=-1) @ values)
    states, labels = [state], []
    chain_k: list[torch.Tensor] = []
    chain_v: list[torch.Tensor] = []
    starts = (rows[None, :] >= (batch.answer_from[:, None] - 1)) & real
    for step in range(1, depth + 1):
        label_at = (rows[None, :] + step + 1).expand(b, -1)
        label = batch.tokens.gather(1, label_at.clamp(max=batch.tokens.shape[1] - 1))
        labels.append(torch.where(starts & (label_at < batch.length[:, None]), label, -1))
        if step == depth:
            break
        # Step `step` + 1: the entry (state, x_{j+step+1}) at position j + step.
        x = head.entries(
            state, torch.ones(b, t, dtype=torch.bool), embeddings[batch.tokens[:, step + 1 : step + 1 + t]].float()
        )
        q, kc, vc = head.project(x, rows + step)
        chain_k.append(head.expand(kc))
        chain_v.append(head.expand(vc))
        scores = (q @ keys.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        own = torch.stack([(q * key).sum(-1) * scale for key in chain_k], dim=-1)  # [B, H, T, steps]
        weights = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1)
        attended = weights[..., :t] @ values
        attended = attended + (weights[..., t:, None] * torch.stack(chain_v, dim=-2)).sum(-2)
        state = head.finish(x, attended)
        states.append(state)
    return Unrolled(states, labels)


def unrolled_loss(
    unrolled: Unrolled, batch: Batch, head_rows: torch.Tensor, label_of: torch.Tensor, decay: float = 0.8
) -> torch.Tensor:
    """Cross-entropy over the head's vocabulary per step (weighted decay^k) plus a smooth-L1 pull of each state
    towards the target's feature it stands for."""
    total, weight_sum = torch.zeros(()), 0.0
    t = batch.features.shape[1]
    rows = torch.arange(t)
    for k, (state, label) in enumerate(zip(unrolled.states, unrolled.labels, strict=True)):
        where = label >= 0
        target = label_of[label.clamp_min(0)]
        where = where & (target >= 0)
        chosen = state[where]
        if not len(chosen):
            continue
        logits = chosen @ head_rows.T
        wanted = target[where]
        ce = functional.cross_entropy(logits.float(), wanted)
        at = (rows[None, :] + k + 1).clamp(max=t - 1).expand(len(state), -1)
        has = where & batch.have.gather(1, at) & (rows[None, :] + k + 1 < t)
        regression = (
            functional.smooth_l1_loss(
                state[has].float(), batch.features.gather(1, at[..., None].expand(-1, -1, state.shape[-1]))[has]
            )
            if bool(has.any())
            else torch.zeros(())
        )
        total = total + decay**k * (ce + regression)
        weight_sum += decay**k
    return total / max(weight_sum, 1e-9)


def held_out_measures(
    head: AttentionHead,
    embeddings: torch.Tensor,
    head_rows: torch.Tensor,
    token_ids: torch.Tensor,
    data: TrainingSet,
    conversations: list[int],
    answer_from: torch.Tensor,
    row_of: torch.Tensor,
    depth: int,
    hide_request: bool = True,
) -> dict:
    """Teacher-forced top-1 per step over every answer position of `conversations` (a token outside the head's
    vocabulary counts as missed), and the mean run of right drafts from step 1: what a chain of `depth` keeps."""
    hits, counts, runs = torch.zeros(depth), torch.zeros(depth), []
    for first in range(0, len(conversations), 4):
        batch = make_batch(data, row_of, answer_from, conversations[first : first + 4], depth)
        unrolled = unroll(head, embeddings, batch, depth, hide_request)
        full = unrolled.labels[-1] >= 0  # rows with all `depth` labels
        right = []
        for k in range(depth):
            label = unrolled.labels[k]
            drafted = token_ids[(unrolled.states[k].float() @ head_rows.T).argmax(-1)]
            hit = (drafted == label) & (label >= 0)
            hits[k] += hit.sum()
            counts[k] += (label >= 0).sum()
            right.append(hit[full])
        runs.append(torch.stack(right).long().cumprod(0).sum(0).float())
    return {
        "accuracy": [round(float(h / max(c, 1)), 4) for h, c in zip(hits, counts, strict=True)],
        "accepted_per_chain": round(float(torch.cat(runs).mean()), 3) if runs else 0.0,
        "examples": int(counts[0]),
    }
