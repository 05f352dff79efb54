"""viasd's hybrid drafter as a vLLM speculative proposer (`speculative_config={"method": "custom_class", "model":
"viasd.vllm.proposer.HybridProposer", "num_speculative_tokens": K}`).

Each request drafts with its own hybrid drafter: a copy from its prompt or answer where the text repeats (prompt
lookup, from matches as short as `sd:drafter=hybrid` copies), the small drafter model elsewhere (its own KV session
per request, resynchronised to what vLLM committed, so rejected drafts are cropped; it stops after a draft token
under sd's stop threshold, `viasd.speculation.DEFAULT_STOP`; built by `viasd.methods.drafting`, as `sd:drafter=hybrid`
builds it, so no setting differs). vLLM verifies the drafts with its rejection sampler. The
number of drafts per request (at most K) follows the batch size, from step costs and acceptance measured while
serving (viasd.vllm.draft_length). Settings come from the environment, since vLLM builds the proposer from its
config alone:

* VIASD_DRAFTER: the drafter model (a default model name, a directory or a hub id; default qwen2.5-coder-0.5b).
* VIASD_DRAFTER_QUANT: run the drafter as its quantized view (int4a8, int8, ...; `none`: as loaded). Default:
  int4a8 where viasd's int4a8 kernel runs (an x86 CPU: a drafter step then reads 5 bits per weight, not 16), else
  as loaded.
* VIASD_STATS_SECONDS: seconds between the statistics lines it logs (default 10; 0: none).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from viasd.drafters.base import Proposal
from viasd.drafters.hybrid import HybridDrafter
from viasd.methods.drafting import hybrid_drafter, model_drafter
from viasd.models.catalog import DEFAULT_DRAFTER
from viasd.speculation import DEFAULT_STOP
from viasd.verify.sampling import SamplingParams
from viasd.vllm.draft_length import DraftLength
from viasd.vllm.sessions import SessionPool

log = logging.getLogger("vllm.viasd")  # under vLLM's own logger, so its handlers print the lines


def _setting(name: str, default: str) -> str:
    return os.environ.get(name, "").strip() or default


class HybridProposer:
    """Draft tokens for every request vLLM runs, from viasd's hybrid drafter (see the module docstring)."""

    def __init__(self, vllm_config: Any) -> None:
        from viasd.models.loading import load_model
        from viasd.passes.prepare import prepare

        spec = vllm_config.speculative_config
        self.most = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        name = _setting("VIASD_DRAFTER", DEFAULT_DRAFTER)
        self.drafter = load_model(name, device="cpu", dtype="bf16")
        prepare(self.drafter.model)
        self.view = None
        recipe = _setting("VIASD_DRAFTER_QUANT", "auto")
        if recipe == "auto":
            from viasd.auto import int4a8_is_fast

            recipe = "int4a8" if int4a8_is_fast(torch.device("cpu")) else "none"
        if recipe != "none":
            from viasd.views.make import quantized_view
            from viasd.views.recipe import QuantRecipe

            self.view = quantized_view(self.drafter, QuantRecipe.parse(recipe))
        self.sessions: SessionPool[Any] = SessionPool(self._new_session)  # a HybridDrafter per request (or more)
        self.lengths = DraftLength(self.most)
        self.params = SamplingParams()  # greedy drafts: vLLM's rejection sampler treats them as one-hot
        self.generator = torch.Generator().manual_seed(0)
        self.every = float(_setting("VIASD_STATS_SECONDS", "10"))
        self.last_return: float | None = None  # when the previous propose returned: the next call ends a step
        self.last_drafts: list[int] = []  # drafts given per row last step (rows as vLLM ordered them then)
        self.last_tokens = 0
        self.stats = {"steps": 0, "drafted": 0, "kept": 0, "lookup": 0, "model": 0}
        self.last_log = time.perf_counter()
        log.info(
            "viasd hybrid proposer: drafter %s%s, up to %d drafts", name, f" ({recipe})" if self.view else "", self.most
        )

    def _new_session(self) -> Any:
        # No request's token budget reaches a proposer, so the hybrid never leaves its model drafter out.
        return hybrid_drafter(model_drafter(self.drafter.model, self.view))

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM hands over its target here; the hybrid drafter needs none of it."""

    def propose(
        self,
        sampled_token_ids: Sequence[Sequence[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft tokens per row of vLLM's batch: rows with nothing sampled this step (a prompt still being read)
        or at the length limit get none."""
        now = time.perf_counter()
        rows: list[list[int] | None] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            rows.append(token_ids_cpu[i, :n].tolist() if len(sampled) and n < self.max_model_len else None)
        drafters, joined = self.sessions.assign(rows)
        self._observe(sampled_token_ids, now, joined or any(row is None for row in rows))
        active = sum(d is not None for d in drafters)
        k = self.lengths.length(active) if active else 0
        drafts: list[list[int]] = []
        for row, drafter in zip(rows, drafters, strict=True):
            if drafter is None or row is None or k == 0:
                drafts.append([])
                continue
            room = min(k, self.max_model_len - len(row) - 1)
            drafts.append(self._draft(drafter, row, room) if room > 0 else [])
        self.last_drafts = [len(d) for d in drafts]
        self.last_tokens = sum(1 + len(d) for d, r in zip(drafts, rows, strict=True) if r is not None)
        self._maybe_log(k, active)
        self.last_return = time.perf_counter()
        return drafts

    def _draft(self, drafter: Any, context: list[int], k: int) -> list[int]:
        return [int(t) for t in self._proposal(drafter, context, k).tokens]

    def _proposal(self, drafter: HybridDrafter, context: list[int], k: int) -> Proposal:
        """The hybrid drafter's proposal for one request, its cost and source counted."""
        start = time.perf_counter()
        proposal = drafter.propose(context, k, self.params, self.generator, DEFAULT_STOP)
        if proposal.source == "model":
            self.lengths.observe_drafter(len(proposal), time.perf_counter() - start)
            self.stats["model"] += len(proposal)
        else:
            self.stats["lookup"] += len(proposal)
        return proposal

    def _observe(self, sampled: Sequence[Sequence[int]], now: float, read_prompts: bool) -> None:
        """What the step that just ran tells: its time and size (unless it also read prompts: a request joined or
        is still being read), and how many of each row's drafts it kept (the rows keep their order within a
        step)."""
        if self.last_return is None or len(sampled) != len(self.last_drafts):
            return
        self.stats["steps"] += 1
        if not read_prompts:
            self.lengths.observe_step(self.last_tokens, now - self.last_return)
        for given, row in zip(self.last_drafts, sampled, strict=True):
            if given and len(row):
                kept = len(row) - 1
                self.lengths.observe_drafts(given, kept)
                self.stats["drafted"] += given
                self.stats["kept"] += kept

    def _maybe_log(self, k: int, active: int) -> None:
        if self.every <= 0 or time.perf_counter() - self.last_log < self.every:
            return
        self.last_log = time.perf_counter()
        s = self.stats
        kept = s["kept"] / s["drafted"] if s["drafted"] else 0.0
        log.info(
            "viasd: %d steps, %d drafts given to vLLM (proposed: %d copied, %d by the model), %.0f%% kept; "
            "%d requests now, %d drafts each; %d sessions (%d started, %d freed)",
            s["steps"],
            s["drafted"],
            s["lookup"],
            s["model"],
            100 * kept,
            active,
            k,
            len(self.sessions),
            self.sessions.started,
            self.sessions.dropped,
        )
