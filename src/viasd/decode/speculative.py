"""Classic speculative decoding (Leviathan et al. 2023; Chen et al. 2023): exact with respect to the target."""

from __future__ import annotations

import time

from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd.decode.base import Decoder
from viasd.decode.output import OutputSink
from viasd.decode.stats import GenerationStats
from viasd.drafters.base import Drafter
from viasd.errors import ViasdError
from viasd.models.session import KVSession
from viasd.verify.acceptance import verify_block
from viasd.verify.sampling import SamplingParams, sample, warp_probs


def draft_length(gamma: int, remaining: int, context_len: int, context_limit: int | None) -> int:
    """Draft tokens worth proposing this round: a round commits at most k + 1 tokens, within the context."""
    k = min(gamma, remaining - 1)
    if context_limit is not None:
        k = min(k, context_limit - context_len - 1)
    return max(k, 0)


class SpeculativeDecoder(Decoder):
    """Draft gamma tokens, verify them in one target pass, keep the accepted prefix plus one target token."""

    method = "sd"

    def __init__(
        self,
        target: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        drafter: Drafter,
        gamma: int = 4,
        method: str | None = None,
    ) -> None:
        super().__init__(target, tokenizer)
        if gamma < 1:
            raise ViasdError(f"the draft length gamma must be >= 1, got {gamma}")
        self.drafter = drafter
        self.gamma = gamma
        self.session = KVSession(target)
        if method:
            self.method = method

    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        generator = params.generator()
        self.session.reset()
        self.drafter.reset()
        target_before = self.session.forward_passes
        drafter_before = self.drafter.forward_passes
        while not sink.done:
            context = prompt + sink.tokens
            k = draft_length(self.gamma, sink.remaining, len(context), self.context_limit)
            t0 = time.perf_counter()
            proposal = self.drafter.propose(context, k, params, generator)
            t1 = time.perf_counter()
            logits = self.session.extend_to(context + proposal.tokens, keep=len(proposal) + 1)
            if len(proposal):
                verdict = verify_block(proposal.tokens, proposal.probs, warp_probs(logits, params), generator)
                committed = [*proposal.tokens[: verdict.accepted], verdict.next_token]
                stats.accepted += verdict.accepted
                # Drafts after the first rejected one are cut off unchecked: they count as drafted, not evaluated.
                stats.evaluated += min(verdict.accepted + 1, len(proposal))
            else:
                committed = [sample(warp_probs(logits, params)[-1], generator)]
            t2 = time.perf_counter()
            stats.rounds += 1
            stats.drafted += len(proposal)
            stats.draft_seconds += t1 - t0
            stats.verify_seconds += t2 - t1
            sink.push(committed)
        stats.target_calls = self.session.forward_passes - target_before
        stats.drafter_calls = self.drafter.forward_passes - drafter_before
