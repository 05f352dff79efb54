"""A hybrid drafter: copy from the context when prompt lookup finds a match, else draft with the model.

Neither drafter wins everywhere: prompt lookup drafts for free and is right where the answer copies the
prompt or itself (summaries, retrieval answers, edited code), the model drafter where the answer is new text.
Each round the hybrid asks prompt lookup first and uses its draft when the context's tail matches an earlier
n-gram of at least the lookup's `min_ngram` tokens; otherwise the model drafts. One source per round, so a
block is either all copied (one-hot draft distributions) or all drafted by the model.

The model drafter's cache follows the committed tokens whichever part proposed: it resynchronises by
common prefix at its next proposal, feeding every token committed since its last step in one pass (a
round that copies costs the model drafter nothing; the catch-up pass costs about one drafter step).
"""

from __future__ import annotations

import torch

from viasd.drafters.base import Proposal
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.verify.sampling import SamplingParams


class HybridDrafter:
    """Prompt lookup when it matches, the model drafter otherwise; proposals name the part that made them."""

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter, name: str = "hybrid") -> None:
        self.name = name
        self.lookup = lookup
        self.model = model

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        """A copied draft when the context's tail has an earlier match, else the model's (which obeys `stop`)."""
        copied = self.lookup.propose(context, k, params, generator)
        if len(copied):
            return copied
        return self.model.propose(context, k, params, generator, stop)
