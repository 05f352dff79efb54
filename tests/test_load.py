"""Draft length under load (decode/load.py) and the pass costs it reads (passes/costs.py): the maths alone."""

from __future__ import annotations

import math

import pytest

from viasd.decode.load import DraftTally, Load, acceptance_estimate, best_draft_length, expected_tokens
from viasd.decode.stats import GenerationStats
from viasd.passes.costs import PassCosts, interpolated_cost


def test_costs_interpolate_between_measured_rows_and_grow_past_them():
    table = {1: 0.030, 8: 0.038, 16: 0.080}
    assert interpolated_cost({}, 4) is None
    assert interpolated_cost(table, 8) == 0.038
    assert interpolated_cost(table, 12) == pytest.approx(0.059)  # halfway from 8 to 16
    assert interpolated_cost({4: 0.05}, 1) == 0.05  # never cheaper than the smallest measured
    assert interpolated_cost(table, 32) == pytest.approx(0.160)  # past the largest: in proportion to rows


def test_costs_keep_a_running_average_per_row_count():
    costs = PassCosts()
    costs.record(4, 1.0)
    costs.record(4, 2.0)
    assert costs.table() == {4: pytest.approx(1.2)} and costs.estimate(4) == pytest.approx(1.2)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 3) == pytest.approx(1.875)


def step_then_rows(fixed: float, per_row: float, free_rows: int):
    """A pass that costs `fixed` up to `free_rows` rows, then `per_row` for every row beyond."""
    return lambda rows: fixed + per_row * max(0, rows - free_rows)


def test_free_rows_keep_the_configured_draft_and_costly_rows_cut_it():
    free = step_then_rows(0.03, 0.003, 64)
    assert best_draft_length(6, 1, 0.7, free, 0.0) == 6
    assert best_draft_length(6, 8, 0.7, free, 0.0) == 6  # 8 x 7 rows still fit in what one costs
    per_token = lambda rows: 0.01 * rows  # noqa: E731  (every row costs a token's pass: no speculation pays)
    assert best_draft_length(6, 1, 0.7, per_token, 0.0) == 0
    assert best_draft_length(6, 8, 0.0, step_then_rows(0.03, 0.003, 8), 0.0) == 0  # drafts never kept


def test_the_draft_shrinks_as_the_batch_grows():
    cost = step_then_rows(0.03, 0.0035, 8)  # like the 4-bit pass here: 8 rows for the price of one, then linear
    lengths = [best_draft_length(6, n, 0.7, cost, 0.002) for n in (1, 2, 4, 8, 16)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1], lengths
    assert lengths[0] >= 4 and lengths[-1] <= 1


def test_acceptance_estimate_starts_at_the_prior_and_follows_the_counts():
    stats = GenerationStats("sd")
    assert acceptance_estimate(stats) == pytest.approx(0.6)
    stats.accepted, stats.evaluated = 900, 1000
    assert math.isclose(acceptance_estimate(stats), 902.4 / 1004)


def test_alone_or_unmeasured_the_configured_gamma_stands():
    costs = PassCosts()
    assert Load(8, costs).draft_length(5, GenerationStats("sd"), DraftTally()) == 5  # nothing measured yet
    for rows in range(1, 65):
        costs.record(rows, 0.01 * rows)
    assert Load(1, costs).draft_length(5, GenerationStats("sd"), DraftTally()) == 5  # alone
    assert Load(8, costs).draft_length(5, GenerationStats("sd"), DraftTally()) == 0


def test_draft_cost_counts_only_rounds_that_drafted():
    tally = DraftTally()
    assert tally.per_token == 0.0
    tally.record(0.03, 3)
    tally.record(0.01, 0)  # asked for drafts, got none (no match for lookup): its time still counts
    assert tally.per_token == pytest.approx(0.04 / 3)
