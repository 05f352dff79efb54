"""Drafting with a draft head: a chain of tokens from the target's own features, with no model pass of its own.

The head follows the target's KV session (`follow`): the session records the features its passes computed
(passes/features.py), and each proposal starts from the latest feature that the committed tokens still vouch for,
folds in the tokens after it (normally one: the target's correction or bonus token), and drafts step by step with
the head (heads/network.py). Exactness is untouched: the head only proposes, and its distributions are proper ones
over the whole vocabulary (zero outside its vocabulary), as speculative sampling needs. Its vocabulary is its own
tokens and, by default, the context's tokens it lacks (drafters/context_vocabulary.py).
"""

from __future__ import annotations

import copy
import time

import torch
from torch import nn

from viasd.drafters.base import Proposal
from viasd.drafters.chain import ScoredTokens, draft_chain
from viasd.drafters.context_vocabulary import ContextVocabulary
from viasd.heads.attention import AttentionCache, AttentionHead, AttentionHeadConfig
from viasd.heads.int8 import fits, int8_head, int8_weights
from viasd.heads.network import DraftHead
from viasd.kernels import w8a8
from viasd.kernels.build import Library
from viasd.kernels.cpu import native_bf16
from viasd.models.stored import OutputRows, embedding_rows
from viasd.passes.features import FeatureStore
from viasd.passes.session import KVSession, common_prefix_length
from viasd.verify.sampling import SamplingParams

CATCH_UP = 8  # the most committed tokens a proposal folds in before drafting; more: the round goes to the target
EXTEND_ROWS = 512  # the attention head's entries computed at once (a long prompt's in blocks)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# What a head's proposals score (the `head_vocab` option): its own tokens and the context's it lacks, or its own.
VOCABULARIES = ("context", "own")


def head_compute(device: torch.device, stored: torch.dtype, head: nn.Module, hidden: int) -> str:
    """What a head computes in: `int8` or a dtype's name. A draft step is a few matrix-vector products that stream
    the head's weights and its rows of the output head (about 80 MB in float32), so on a CPU it is memory-bound:
    int8 where viasd's 8-bit kernel runs (heads/int8.py: 1.05 against 2.42 ms per step on an AMX Xeon), else bf16
    where the CPU multiplies it natively (AMX, AVX-512 bf16), else float32, which torch runs faster than bf16 there
    (measured on an AVX-512 CPU without bf16: 24 against 29 ms per step). Elsewhere (a GPU): as stored."""
    if device.type != "cpu":
        return str(stored).removeprefix("torch.")
    if isinstance(w8a8.kernel(), Library) and fits(head, hidden):
        return "int8"
    return "bfloat16" if native_bf16() else "float32"


class HeadDrafter:
    """A draft head on one target: the target's embeddings are shared, its output head's rows of the head's
    vocabulary gathered once, and the head's own (small) weights held as it computes (`compute`: `int8`, heads/int8.py,
    or a dtype's name; default: `head_compute`'s choice for the target's device). `vocabulary`: `context` (the
    default) also scores the context's tokens that the head's vocabulary lacks (drafters/context_vocabulary.py),
    `own` its own tokens only."""

    def __init__(
        self,
        head: DraftHead | AttentionHead,
        target: nn.Module,
        name: str = "head",
        compute: str | None = None,
        vocabulary: str = "context",
    ) -> None:
        self.name = name
        rows = OutputRows(target)  # the rows it needs, read from a stored head's blocks (no dense copy)
        hidden = int(rows.shape[1])
        self.compute = compute or head_compute(rows.device, next(head.parameters()).dtype, head, hidden)
        if self.compute not in (*DTYPES, "int8"):
            raise ValueError(f"a head computes in int8 or one of {', '.join(DTYPES)}, not {self.compute!r}")
        if vocabulary not in VOCABULARIES:
            raise ValueError(f"a head's vocabulary is one of {', '.join(VOCABULARIES)}, not {vocabulary!r}")
        if self.compute == "int8" and (rows.device.type != "cpu" or not fits(head, hidden)):
            raise ValueError("int8 drafting needs a target on the CPU and a head whose products take groups of 32")
        mine = rows[head.token_ids]  # [vocab, hidden]
        self.dtype = torch.float32 if self.compute == "int8" else DTYPES[self.compute]
        self.head: DraftHead | AttentionHead
        if self.compute == "int8":
            self.head = int8_head(head)  # type: ignore[assignment]  (its linear layers swapped, same class)
            self.rows: torch.Tensor | w8a8.EightBitWeights = int8_weights(mine)
        else:
            self.head = copy.deepcopy(head).to(device=rows.device, dtype=self.dtype)
            self.rows = mine.to(self.dtype).contiguous()
        self.hidden = hidden
        self.embeddings = target.get_input_embeddings()  # type: ignore[operator]
        self.rows_device = rows.device
        self.vocab_size = int(rows.shape[0])
        self.target: KVSession | None = None
        self.cache = AttentionCache(self.head) if isinstance(self.head, AttentionHead) else None
        self.vocabulary = ContextVocabulary(self.head.token_ids, rows, self.dtype) if vocabulary == "context" else None
        self.forward_passes = 0  # head steps
        self.pass_seconds = 0.0

    @property
    def sessions(self) -> tuple[KVSession, ...]:
        """None: its steps are the head's, on the features of the target's passes (counted there)."""
        return ()

    def describe(self) -> str:
        config = self.head.config
        if isinstance(config, AttentionHeadConfig):
            shape = f"attention, {config.heads} heads, MLP {config.width}"
        else:
            shape = f"{config.blocks} x {config.width}"
        words = f"{config.vocab} tokens" + (" and the context's" if self.vocabulary is not None else "")
        return f"{self.name} (draft head: {shape}, {words}, {self.compute})"

    def follow(self, target: KVSession) -> None:
        """Draft from the features of `target`'s passes (the decoder's session of the target)."""
        self.target = target
        if target.features is None:
            target.features = FeatureStore()

    def reset(self, prompt_length: int | None = None, budget: int | None = None) -> None:
        if self.cache is not None:
            self.cache.cut(0)
        if self.vocabulary is not None:
            self.vocabulary.clear()

    def _start(self, context: list[int]) -> torch.Tensor | None:
        """The head's state after the last token of `context` (which predicts the next one), or None."""
        session = self.target
        if session is None or session.features is None or len(context) < 2:
            return None
        held = session.tokens + session.pending
        valid = min(common_prefix_length(held, context), len(context) - 1)  # rows [0, valid) describe `context`
        position = session.features.latest(valid - 1)
        if position is None or len(context) - 1 - position > CATCH_UP:
            return None
        if self.cache is not None:
            return self._start_attention(context, session.features, valid)
        state = session.features.row(position).to(self.dtype)
        for token in context[position + 1 :]:
            state = self.head.step(state, self.embed(token))
            self.forward_passes += 1
        return state

    def _start_attention(self, context: list[int], store: FeatureStore, valid: int) -> torch.Tensor:
        """The attention head's state after `context`: its cache cut where it no longer matches the context and
        the session's features, then extended by the entries it lacks (entry j: feature j, token j + 1)."""
        cache = self.cache
        assert cache is not None
        need = len(context) - 1
        known = min(valid, store.known)
        have = store.have[:known] + [False] * (need - known)
        keep = common_prefix_length(cache.tokens, context[1 : need + 1])
        if cache.featured[:keep] != have[:keep]:
            keep = common_prefix_length(cache.featured[:keep], have[:keep])
        if keep == need and cache.last_state is None:
            keep -= 1  # the last entry's state is needed again: compute that entry anew
        cache.cut(keep)
        for begin in range(keep, need, EXTEND_ROWS):  # long prompts in blocks: the scores are [rows, length]
            end = min(begin + EXTEND_ROWS, need)
            flags = torch.tensor(have[begin:end], dtype=torch.bool)
            rows = torch.zeros(end - begin, self.hidden, dtype=self.dtype)
            if bool(flags.any()):
                assert store.rows is not None
                rows[flags] = store.rows[begin:end][flags].to(self.dtype)
            embedded = self.embedded(context[begin + 1 : end + 1])
            cache.extend(rows, flags, embedded, context[begin + 1 : end + 1])
            self.forward_passes += 1
        assert cache.last_state is not None
        return cache.last_state

    def _advance(
        self, state: torch.Tensor, token: torch.Tensor, chain: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """The state after drafting `token` [1] from `state`."""
        embedded = self.embedded(token)[0]
        self.forward_passes += 1
        if self.cache is not None:
            return self.cache.draft(state, embedded, chain)
        return self.head.step(state, embedded)

    def _scores(self, state: torch.Tensor) -> torch.Tensor:
        """Logits [1, n] of the tokens it scores: its own, and the context's it lacks where it adds them."""
        scores = self.logits(state)
        return scores if self.vocabulary is None else self.vocabulary.logits(scores, state)

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        """Up to k tokens (`drafters.chain.draft_chain`, each step one of the head); none when no feature of the
        target describes the context yet (the round is then a target step, whose pass records one)."""
        start = time.perf_counter()
        with torch.inference_mode():
            state = self._start(context) if k > 0 else None
            if state is None:
                return Proposal([], source=self.name)
            if self.vocabulary is not None:
                self.vocabulary.follow(context)
            ids = self.head.token_ids if self.vocabulary is None else self.vocabulary.ids
            chain: list[tuple[torch.Tensor, torch.Tensor]] = []  # the attention head's draft entries
            current: torch.Tensor = state

            def advance(token: torch.Tensor) -> torch.Tensor:
                nonlocal current
                current = self._advance(current, token, chain)
                return self._scores(current)

            scored = ScoredTokens(ids, self.vocab_size)
            proposal = draft_chain(self._scores(state), advance, k, context, params, generator, stop, self.name, scored)
        self.pass_seconds += time.perf_counter() - start
        return proposal

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Logits [1, vocab] of the head's own tokens: the target's output head, its rows of the head's vocabulary."""
        if isinstance(self.rows, w8a8.EightBitWeights):
            return w8a8.product(state.reshape(1, -1), self.rows)
        return (self.rows @ state).float()[None]

    def embed(self, token: int) -> torch.Tensor:
        """The target's embedding of `token`, in the dtype the head computes in."""
        return self.embedded([token])[0]

    def embedded(self, tokens: list[int] | torch.Tensor) -> torch.Tensor:
        """The target's embeddings of `tokens` [len, hidden] in the head's dtype (a stored embedding's rows read from
        its blocks, as a pass reads them)."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.rows_device)
        return embedding_rows(self.embeddings, ids).to(self.dtype)
