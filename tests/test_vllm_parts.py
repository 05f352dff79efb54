"""The parts of viasd's vLLM proposer that need no vLLM: matching vLLM's token rows to per-request drafter
sessions, and the draft length the measured costs call for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from viasd.vllm.draft_length import DraftLength, best_length, expected_kept
from viasd.vllm.sessions import SessionPool


def _pool() -> SessionPool[int]:
    made = iter(range(1000))
    return SessionPool(lambda: next(made))


def test_a_growing_row_keeps_its_session_and_a_new_row_gets_a_new_one() -> None:
    pool = _pool()
    states, new = pool.assign([[1, 2, 3], [7, 8]])
    assert states == [0, 1] and new == 2
    # Next step: vLLM reordered the rows, each grew by what it committed; a third request joined.
    states, new = pool.assign([[7, 8, 9, 9], [5, 5], [1, 2, 3, 4]])
    assert states == [1, 2, 0] and new == 1 and len(pool) == 3


def test_a_row_that_is_gone_frees_its_session() -> None:
    """A finished or cancelled request no longer appears: its session is dropped at the next step."""
    pool = _pool()
    pool.assign([[1, 2], [3, 4], [5, 6]])
    states, _ = pool.assign([[1, 2, 9], [5, 6, 9]])
    assert states == [0, 2] and len(pool) == 2 and pool.dropped == 1


def test_rows_with_the_same_tokens_get_sessions_of_their_own() -> None:
    pool = _pool()
    first, _ = pool.assign([[1, 2, 3], [1, 2, 3]])
    again, new = pool.assign([[1, 2, 3, 4], [1, 2, 3, 4]])
    assert sorted(first) == [0, 1] and sorted(again) == [0, 1] and new == 0


def test_a_row_that_is_not_an_extension_starts_over_and_rows_not_drafting_keep_none() -> None:
    pool = _pool()
    pool.assign([[1, 2, 3]])
    states, new = pool.assign([[1, 2, 4], None])  # a preempted request recomputed differently, a prefilling one
    assert states == [1, None] and new == 1 and pool.dropped == 1


def test_expected_kept_is_the_geometric_sum() -> None:
    assert expected_kept(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125) and expected_kept(0.9, 0) == 0


def test_drafts_shrink_as_the_batch_grows_and_stop_when_verifying_costs_too_much() -> None:
    """A step that costs little beyond its fixed part (memory-bound, one request) pays for long drafts; when every
    token carried costs about as much as the fixed part (a compute-bound batch), drafts do not pay."""
    one, _ = best_length(1, 0.7, fixed=0.1, per_token=0.002, draft_seconds=0.002, most=6)
    eight, _ = best_length(8, 0.7, fixed=0.1, per_token=0.002, draft_seconds=0.002, most=6)
    busy, _ = best_length(8, 0.7, fixed=0.1, per_token=0.1, draft_seconds=0.002, most=6)
    assert one >= eight >= 1 and one >= 3 and busy == 0


def test_the_measured_rule_explores_first_then_fits_the_step_costs() -> None:
    lengths = DraftLength(most=4)
    assert [lengths.length(2) for _ in range(1)] == [4]
    for tokens in (2, 4, 6, 8, 10, 2, 4, 6, 8, 10):
        lengths.observe_step(tokens, 0.1 + 0.1 * tokens)  # every carried token costs as much as the fixed part
    lengths.observe_drafts(4, 1)
    fixed, per_token = lengths.fit() or (0.0, 0.0)
    assert fixed == pytest.approx(0.1) and per_token == pytest.approx(0.1)
    assert lengths.alpha == pytest.approx(0.5) and lengths.length(2) == 0
    # Staying at one size (no drafts) for long does not make the rule forget the others and explore again.
    for _ in range(200):
        lengths.observe_step(2, 0.3)
    assert lengths.length(2) == 0


def test_the_cascade_keeps_accepted_drafts_replaces_where_the_slim_view_disagrees_and_stops_at_the_full_tier() -> None:
    from viasd.vllm.cascade import edit_block

    full = 2  # tiers: 0 accept, 1 slim view, 2 full target
    # The slim view agrees everywhere: the block stands, and its next token is one more draft.
    assert edit_block([5, 6, 7], [0, 1, 1], [5, 6, 7, 8], full, room=4) == [5, 6, 7, 8]
    assert edit_block([5, 6, 7], [0, 1, 1], [5, 6, 7, 8], full, room=3) == [5, 6, 7]
    # At the slim tier it disagrees on the second draft: replaced by its token, and the block ends there.
    assert edit_block([5, 6, 7], [1, 1, 1], [5, 9, 7, 8], full, room=4) == [5, 9]
    # An accepted draft stands even where the slim view would pick another token.
    assert edit_block([5, 6, 7], [0, 0, 0], [4, 4, 4, 4], full, room=4) == [5, 6, 7, 4]
    # At the full tier the slim view's token replaces a draft it disagrees with, and ends the block...
    assert edit_block([5, 6, 7], [1, full, 1], [5, 9, 9, 9], full, room=4) == [5, 9]
    # ...and a draft it agrees with ends the block as drafted: the gate trusts nothing beyond it.
    assert edit_block([5, 6, 7], [1, full, 1], [5, 6, 9, 9], full, room=4) == [5, 6]


class _RecordingDrafter:
    """A drafter that proposes fixed tokens and records the stop threshold it was asked for."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.stops = tokens, []

    def propose(self, context, k, params, generator, stop=0.0):
        from viasd.drafters.base import Proposal

        self.stops.append(stop)
        return Proposal(self.tokens[:k], source="model")


def _bare_proposer(cls):
    """A proposer without vLLM's config: what `__init__` sets that drafting reads, on a tiny drafter model."""
    import torch

    from tiny import tiny_model
    from viasd.verify.sampling import SamplingParams

    proposer = object.__new__(cls)
    proposer.drafter = SimpleNamespace(model=tiny_model())
    proposer.view = None
    proposer.params = SamplingParams()
    proposer.generator = torch.Generator().manual_seed(0)
    proposer.lengths = DraftLength(4)
    proposer.stats = {"steps": 0, "drafted": 0, "kept": 0, "lookup": 0, "model": 0, "edited": 0}
    return proposer


def test_the_proposer_drafts_as_sd_with_the_hybrid_drafter_does() -> None:
    """Inside vLLM the drafter model stops at sd's stop threshold and lookup copies from the matches sd's hybrid
    copies from: one setting each, so a change to sd's is a change to the proposer's."""
    from viasd.speculation import DEFAULT_STOP, HYBRID_BUDGET, HYBRID_MATCH, longest_match
    from viasd.vllm.proposer import HybridProposer

    proposer = _bare_proposer(HybridProposer)
    session = proposer._new_session()
    lookup = session.lookup
    assert (lookup.min_ngram, lookup.max_ngram, lookup.copy) == (HYBRID_MATCH, longest_match(HYBRID_MATCH), None)
    assert session.ratio == HYBRID_BUDGET  # no budget reaches a proposer: the model drafter is never left out
    drafter = _RecordingDrafter([5, 6, 7])
    assert proposer._draft(drafter, [1, 2, 3], 2) == [5, 6] and drafter.stops == [DEFAULT_STOP]


def _views_by_recipe(fail: str | None = None):
    """Parts whose quantized views are markers named by their recipe (`fail`: a recipe whose view cannot be made)."""
    from viasd.errors import ViasdError
    from viasd.views.view import View

    def quantized(model, recipe):
        if recipe is None:
            return None
        if recipe.name == fail:
            raise ViasdError(f"no GGUF file to take {recipe.name}'s blocks from")
        return View(linears=recipe.name)

    return SimpleNamespace(target=SimpleNamespace(), quantized=quantized)


def test_the_cascade_edits_each_task_kind_with_the_view_its_gate_was_calibrated_on() -> None:
    """The shipped int4a8 profile's code gate was calibrated on the int4a8:gguf view: code requests are edited by
    that view under that gate, others by the profile's int4a8 view under the profile's gate, as `via` routes them;
    where the code view cannot be made, code drafts go to vLLM unedited rather than judged by another view."""
    from viasd.profile import default_profile_path, load_profile
    from viasd.vllm.cascade import slim_routes

    profile = load_profile(default_profile_path(True))
    routes = slim_routes(_views_by_recipe(), profile)
    code, other = routes["code"], routes[None]
    assert code is not None and code.view.linears == "int4a8:gguf" and code.gate == profile.kinds["code"]["gate"]
    assert other is not None and other.view.linears == "int4a8" and other.gate == profile.gate
    assert code.view.mask == other.view.mask == profile.masks[0]
    assert slim_routes(_views_by_recipe(fail="int4a8:gguf"), profile) == {None: other, "code": None}


def test_a_cascade_request_takes_its_kinds_route_at_its_first_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slim view's session is made for the request's task kind once it is known, and a kind routed to None gets
    the hybrid's drafts as they are."""
    from viasd.verify.gates import Gate
    from viasd.views.view import View
    from viasd.vllm import cascade
    from viasd.vllm.cascade import CascadeProposer, CascadeSession, SlimRoute

    proposer = _bare_proposer(CascadeProposer)
    proposer.target = SimpleNamespace(model=proposer.drafter.model, tokenizer=SimpleNamespace(decode=str))
    code_view, other_view = View(), View()
    proposer.routes = {None: SlimRoute(other_view, Gate("confidence", (0.0, 0.0))), "code": None, "prose": None}
    proposer.routes["code"] = SlimRoute(code_view, Gate("kl", (0.2, 6.0)))
    monkeypatch.setattr(cascade, "prompt_kind", lambda text: "code")
    session = CascadeSession(_RecordingDrafter([5, 6, 7]))
    drafts = proposer._draft(session, [3, 4, 5], 3)
    assert session.slim is not None and session.slim.base_view is code_view and session.gate.signal == "kl"
    assert len(drafts) == 1  # no drafter distributions: the kl gate sends the first draft on, which ends the block
    monkeypatch.setattr(cascade, "prompt_kind", lambda text: "prose")
    unedited = CascadeSession(_RecordingDrafter([5, 6, 7]))
    assert proposer._draft(unedited, [3, 4, 5], 3) == [5, 6, 7] and unedited.routed and unedited.slim is None
