"""Classic speculative decoding (Leviathan et al. 2023; Chen et al. 2023): exact with respect to the target."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from viasd.decode.base import Decoder, decision_generator
from viasd.decode.load import DraftTally, load_on
from viasd.decode.output import OutputSink
from viasd.decode.round import Round, draft_length
from viasd.decode.stats import GenerationStats
from viasd.drafters.base import Drafter, Proposal, reach_of
from viasd.passes.route import Stack
from viasd.passes.session import KVSession, common_prefix_length, upload_ids
from viasd.speculation import DEFAULT_GAMMA, MAX_REACH
from viasd.verify.acceptance import verify_block
from viasd.verify.resident import block_outcomes, first_rejection, host_values
from viasd.verify.sampling import SamplingParams, adjusted, checked_token, warp_probs
from viasd.views.view import View


def target_rows(session: KVSession, context: list[int], drafts: list[int]) -> torch.Tensor:
    """The target's logits [len(drafts) + 1, V] after `context` and after each draft: one pass over what the
    session has not read yet and the drafts.

    Where that pass would run the model's own forward (a prompt and the drafts of the first round, say), whose
    products round by the pass's length, the context is read first, alone, as plain decoding reads it, and the
    drafts follow in a pass of their own: the drafts' cache entries are then those plain decoding's steps write, and
    greedy output stays the same bit for bit. Passes of viasd's loop (a via catch-up) stay one pass: their kernels
    give a token the same bits in any block."""
    unread = len(context) - common_prefix_length(session.tokens, context)
    if drafts and unread > 1:
        merged = session.route(unread + len(drafts), session.base_view, len(drafts) + 1)
        if any(leg.stack is Stack.MODEL or leg.own_weights for leg in merged.legs):
            first = session.extend_to(context, keep=1)
            return torch.cat([first, session.extend_to(context + drafts, keep=len(drafts))])
    return session.extend_to(context + drafts, keep=len(drafts) + 1)


def verify_with_target(
    session: KVSession, context: list[int], proposal: Proposal, params: SamplingParams, generator: torch.Generator
) -> tuple[list[int], int, torch.Tensor]:
    """Verify a draft block against the full target: one pass over every token it has not processed yet plus
    the block, then speculative sampling. Returns the committed tokens, how many drafts were kept, and the pass's
    raw logits (row i: the target's distribution for committed token i, before penalties: decode/logprobs.py).

    Where the logits live (`SamplingParams.on_device`), the verdict is made there and read with one transfer:
    how many drafts were kept and the token after them.
    """
    raw = target_rows(session, context, proposal.tokens)
    logits = adjusted(raw, params, context, proposal.tokens)  # row i follows the drafts before it
    if params.on_device(logits.device):
        tokens = upload_ids(proposal.tokens, logits.device)
        outcomes = block_outcomes(tokens, proposal.probs, logits, params, generator)
        ((kept, token),) = host_values(first_rejection(outcomes))
        return [*proposal.tokens[: int(kept)], checked_token(token)], int(kept), raw
    probs = warp_probs(logits, params)  # the host path of sampling on a CPU (no drafts: the bonus alone)
    verdict = verify_block(proposal.tokens, proposal.probs, probs, generator)
    return [*proposal.tokens[: verdict.accepted], verdict.next_token], verdict.accepted, raw


class SpeculativeDecoder(Decoder):
    """Draft up to gamma tokens, verify them in one target pass, keep the accepted prefix plus one target token.

    stop: a model drafter stops drafting after a token whose top probability is under it (0: always gamma
    tokens); see `drafters.base.stops_after`.
    """

    method = "sd"

    def __init__(
        self,
        target: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        drafter: Drafter,
        gamma: int = DEFAULT_GAMMA,
        method: str | None = None,
        view: View | None = None,
        stop: float = 0.0,
    ) -> None:
        super().__init__(target, tokenizer, view)
        self.drafter = drafter
        self.gamma, self.stop = gamma, stop  # checked where they entered (viasd.speculation)
        self.session = KVSession(target, view)
        drafter.follow(self.session)
        if method:
            self.method = method

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "drafter": self.drafter.describe(), "gamma": self.gamma, "stop": self.stop}

    def sessions(self) -> tuple[KVSession, ...]:
        return (self.session, *self.drafter.sessions)

    def reset(self, prompt_length: int, budget: int) -> None:
        super().reset(prompt_length, budget)
        self.drafter.reset(prompt_length, budget)

    def _decode(self, prompt: list[int], sink: OutputSink, params: SamplingParams, stats: GenerationStats) -> None:
        generator = decision_generator(params, self.session.device)
        drafter_before = self.drafter.forward_passes
        drafting = DraftTally()
        while not sink.done:
            context = prompt + sink.tokens
            load = load_on(self.target, self.view, params)  # served among others: the draft length follows the load
            gamma = self.gamma if load is None else load.draft_length(self.gamma, stats, drafting)
            # A copy drafter's long match drafts past gamma (a long run being copied: drafters/suffix.py). A round
            # whose pass would fit the fused layers (MAX_REACH + 1 rows, the tokens the target has yet to read
            # included: 2 after a prompt read in pieces, passes/prefix_cache.py) stays within them; a round that
            # reads a whole prompt is one long pass anyway.
            reach = reach_of(self.drafter, context, params)
            if reach > gamma:
                unread = len(context) - common_prefix_length(self.session.tokens, context)
                if unread <= MAX_REACH + 1:
                    reach = min(reach, MAX_REACH + 1 - unread)
                gamma = max(gamma, reach)
            k = draft_length(gamma, sink.remaining, len(context), self.context_limit)
            if k:
                before = self.drafter.pass_seconds
                with stats.timed("draft"):
                    # Text the grammar forces (a JSON key, say) is drafted as the library spells it; the drafter
                    # goes on after it.
                    forced = params.grammar.forced(context)[:k] if params.grammar is not None else []
                    proposal = (
                        self.drafter.propose(context + forced, k - len(forced), params, generator, self.stop)
                        if k > len(forced)
                        else Proposal([])
                    )
                    proposal = proposal.after(forced).within(params, context)
                drafting.record(self.drafter.pass_seconds - before, len(proposal))
            else:  # nothing to draft (the load, or the last token): the drafter catches up when next asked
                proposal = Proposal([])
            with stats.timed("verify"):
                committed, kept, raw = verify_with_target(self.session, context, proposal, params, generator)
            taken = sink.push(committed, raw)
            stats.record(Round(committed, len(proposal), full_kept=kept), taken, source=proposal.source)
        stats.drafter_calls = self.drafter.forward_passes - drafter_before
