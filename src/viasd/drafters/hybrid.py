"""A hybrid drafter: copy from the context when prompt lookup finds a match, else draft with the model.

Neither drafter wins everywhere: prompt lookup drafts for free and is right where the answer copies the
prompt or itself (summaries, retrieval answers, edited code), the model drafter where the answer is new text.
Each round the hybrid asks prompt lookup first and uses its draft when the context's tail matches an earlier
n-gram of at least the lookup's `min_ngram` tokens; otherwise the model drafts. One source per round, so a
block is either all copied (one-hot draft distributions) or all drafted by the model.

The model drafter has a fixed cost prompt lookup has not: its first step reads the whole prompt (on a CPU a
1,000-token prompt costs the small drafter about as much as a dozen target steps), which a short answer to a
long prompt never earns back. So the hybrid starts the model drafter only once the answer has `start` tokens
per prompt token (a ski-rental rule: wait until the steps spent without the model could have paid for its
prefill, then pay it); until then it copies whenever any n-gram matches (a copied draft costs nothing, and a
target pass over a few tokens costs about what one token does) and drafts nothing otherwise.

The model drafter's cache follows the committed tokens whichever part proposed: it resynchronises by
common prefix at its next proposal, feeding every token committed since its last step in one pass (a
round that copies costs the model drafter nothing; the catch-up pass costs about one drafter step).
Every choice depends on the committed tokens only, so speculative sampling stays exact.
"""

from __future__ import annotations

import torch

from viasd.drafters.base import Proposal
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.verify.sampling import SamplingParams


class HybridDrafter:
    """Prompt lookup when it matches, the model drafter otherwise; proposals name the part that made them.

    start: answer tokens per prompt token before the model drafter first drafts (0: from the first round).
    """

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter, start: float = 0.0, name: str = "hybrid"):
        if not start >= 0.0:  # NaN fails too
            raise ValueError("need start >= 0")
        self.name = name
        self.lookup = lookup
        self.model = model
        self.start = start
        # Before the model drafter starts, any match is worth copying: the same lookup with 1-gram matches.
        self.any_match = PromptLookupDrafter(lookup.max_ngram, 1, lookup.copy, lookup.name)
        self.prompt_length: int | None = None
        self.started = False

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()
        self.prompt_length = None
        self.started = False

    def model_started(self, context: list[int]) -> bool:
        """Whether the model drafter drafts from now on: once the answer has `start` tokens per prompt token."""
        if self.prompt_length is None:
            self.prompt_length = len(context)  # the first proposal of a generation follows the prompt
        self.started = self.started or len(context) - self.prompt_length >= self.start * self.prompt_length
        return self.started

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        """A copied draft when the context's tail has an earlier match, else the model's (which obeys `stop`);
        before the model drafter starts, a copy of any match or nothing."""
        if not self.model_started(context):
            return self.any_match.propose(context, k, params, generator)
        copied = self.lookup.propose(context, k, params, generator)
        if len(copied):
            return copied
        return self.model.propose(context, k, params, generator, stop)
