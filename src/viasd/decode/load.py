"""Draft length under load: when several generations share each pass, fewer draft tokens per sequence.

A pass over R rows costs c(R), measured by the pass batcher as it runs (passes/batching.py). With n generations
in step, each drafting k tokens, a round costs about c(n (k + 1)) plus k drafter steps and commits 1 + a + ... + a^k
tokens per sequence (a: the chance a draft token is kept, from this generation's own counts). Alone, rows are
nearly free and the configured draft length stands; as the batch fills, extra rows cost what a token costs and the
best k falls. The rows a pass can take cheaply are shared between batching and speculation.

Only the draft length moves, so exact methods stay exact and a greedy request's tokens stay what they are alone.
A sampled request with a seed keeps its draft length: its random draws then repeat exactly, whatever the load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from viasd.decode.stats import GenerationStats
from viasd.passes.batching import batcher_of
from viasd.passes.costs import PassCosts, interpolated_cost
from viasd.verify.sampling import SamplingParams
from viasd.views.view import View

PRIOR_TRIALS = 4.0  # draft tokens' worth of prior belief in the acceptance rate, before a generation has its own
PRIOR_ACCEPTANCE = 0.6


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round commits on average with k draft tokens each kept with chance `acceptance` until the first
    rejection: 1 + a + a^2 + ... + a^k (the last term is the target's own token after k kept drafts)."""
    return sum(acceptance**i for i in range(k + 1))


def best_draft_length(
    gamma: int, sequences: int, acceptance: float, pass_seconds: Callable[[int], float], draft_seconds: float
) -> int:
    """The draft length in 0..gamma with the most committed tokens per second when `sequences` generations each
    draft that many and are verified in one pass; ties go to the longer draft (it was the configured choice)."""
    best, best_rate = gamma, -1.0
    for k in range(gamma, -1, -1):
        seconds = pass_seconds(sequences * (k + 1)) + k * draft_seconds
        rate = expected_tokens(acceptance, k) / seconds if seconds > 0 else float("inf")
        if rate > best_rate * (1 + 1e-6):
            best, best_rate = k, rate
    return best


def acceptance_estimate(stats: GenerationStats) -> float:
    """The chance a draft token is kept: kept over looked-at draft tokens (each looked-at token is one trial
    until the first rejection), pulled towards a prior while a generation has few of its own."""
    return (stats.accepted + PRIOR_ACCEPTANCE * PRIOR_TRIALS) / (stats.evaluated + PRIOR_TRIALS)


def adapts(params: SamplingParams) -> bool:
    """Whether a request's draft length may follow the load: not when it is sampled with a seed (see above)."""
    return params.greedy or params.seed is None


@dataclass
class DraftTally:
    """What drafting has cost a generation: the seconds of the drafter's passes (not the wall time, which under
    load includes waiting for other generations' passes) over the tokens drafted, in the rounds that drafted."""

    seconds: float = 0.0
    tokens: int = 0

    def record(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else 0.0


@dataclass(frozen=True)
class Load:
    """What a generation sees of the others when it chooses its draft length: how many share its passes, and
    the measured cost of a pass by rows."""

    sequences: int
    costs: PassCosts

    def draft_length(self, gamma: int, stats: GenerationStats, drafting: DraftTally) -> int:
        """`gamma` alone or before any cost is measured; else the best length for this load (see the module)."""
        table = self.costs.table()
        if self.sequences < 2 or not table:
            return gamma

        def pass_seconds(rows: int) -> float:
            return interpolated_cost(table, rows) or 0.0

        return best_draft_length(gamma, self.sequences, acceptance_estimate(stats), pass_seconds, drafting.per_token)


def load_on(model: nn.Module, view: View | None, params: SamplingParams) -> Load | None:
    """The load a generation's draft length follows: None (keep it) without a pass batcher on the model, when the
    batcher's drafts are fixed, or for a request that must repeat exactly (`adapts`)."""
    batcher = batcher_of(model)
    if batcher is None or not batcher.adapt_drafts or not adapts(params):
        return None
    return Load(batcher.sequences, batcher.costs(view))
