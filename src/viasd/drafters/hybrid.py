"""A hybrid drafter: copy from the context when prompt lookup finds a match, else draft with the model.

Neither drafter wins everywhere: prompt lookup drafts for free and is right where the answer copies the
prompt or itself (summaries, retrieval answers, edited code), the model drafter where the answer is new text.
Each round the hybrid asks prompt lookup first and uses its draft when the context's tail matches an earlier
n-gram of at least the lookup's `min_ngram` tokens; otherwise the model drafts. One source per round, so a
block is either all copied (one-hot draft distributions) or all drafted by the model.

When the model drafter drafts. It has a fixed cost that prompt lookup has not: its first step reads the whole
prompt, and a short answer to a long prompt never earns that back (on the 2-core CPU a 1,000-token prompt costs
the small drafter 3.3 s, and it saves about 0.08 s per generated token: it pays back after 0.04 answer tokens
per prompt token). So the hybrid uses the model drafter only in a generation whose token budget is at least
`budget` tokens per prompt token (the default, 0.08, assumes an answer uses half its budget); in the others it
is prompt lookup alone, copying any n-gram match (a copied draft costs nothing, and a target pass over a few
tokens costs about what one token does).

The model drafter's cache follows the committed tokens whichever part proposed: it resynchronises by
common prefix at its next proposal, feeding every token committed since its last step in one pass (a
round that copies costs the model drafter nothing; the catch-up pass costs about one drafter step).
Every choice depends on the prompt length, the budget and the committed tokens only, so speculative sampling
stays exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from viasd.drafters.base import Drafter, Proposal, reach_of
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.drafters.suffix import SuffixDrafter
from viasd.verify.sampling import SamplingParams

if TYPE_CHECKING:
    from viasd.passes.session import KVSession


def uses_model(prompt_length: int, budget: int | None, ratio: float) -> bool:
    """Whether a generation of at most `budget` tokens (None: unbounded) after a prompt of `prompt_length` tokens
    is long enough for the model drafter to earn back its prefill: `ratio` budget tokens per prompt token."""
    return budget is None or budget >= ratio * prompt_length


class HybridDrafter:
    """Prompt lookup when it matches, the model drafter otherwise; proposals name the part that made them.

    budget: budget tokens per prompt token for a generation to use the model drafter (`uses_model`; 0: always).
    """

    def __init__(
        self, lookup: PromptLookupDrafter | SuffixDrafter, model: Drafter, budget: float = 0.0, name: str = "hybrid"
    ):
        if not budget >= 0.0:  # NaN fails too
            raise ValueError("need budget >= 0")
        self.name = name
        self.lookup = lookup
        self.model = model
        self.ratio = budget
        # Without the model drafter any match is worth copying: the same lookup with 1-gram matches.
        self.any_match: PromptLookupDrafter | SuffixDrafter = (
            PromptLookupDrafter(lookup.max_ngram, 1, lookup.copy, lookup.name)
            if isinstance(lookup, PromptLookupDrafter)
            else SuffixDrafter(lookup.reach_most, lookup.store, short=True, name=lookup.name)
        )
        self.budget: int | None = None
        self.with_model: bool | None = None  # decided at a generation's first proposal

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    @property
    def pass_seconds(self) -> float:
        return self.model.pass_seconds

    @property
    def sessions(self) -> tuple[KVSession, ...]:
        return self.model.sessions

    def describe(self) -> str:
        return f"hybrid: {self.lookup.describe()}, else {self.model.describe()}"

    def follow(self, target: KVSession) -> None:
        self.model.follow(target)

    def reach(self, context: list[int], params: SamplingParams) -> int:
        """Past gamma only where its copying part has a long match (then the model is not asked this round)."""
        return reach_of(self.lookup if self.with_model is not False else self.any_match, context, params)

    def reset(self, prompt_length: int | None = None, budget: int | None = None) -> None:
        self.lookup.reset()
        self.any_match.reset()
        self.model.reset()
        self.budget = budget
        self.with_model = None if prompt_length is None else uses_model(prompt_length, budget, self.ratio)

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        """A copied draft when the context's tail has an earlier match, else the model's (which obeys `stop`);
        in a generation too short for the model drafter, a copy of any match or nothing."""
        if self.with_model is None:  # not told at reset: the first proposal of a generation follows the prompt
            self.with_model = uses_model(len(context), self.budget, self.ratio)
        if not self.with_model:
            return self.any_match.propose(context, k, params, generator)
        copied = self.lookup.propose(context, k, params, generator)
        if len(copied):
            return copied
        return self.model.propose(context, k, params, generator, stop)
