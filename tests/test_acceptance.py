"""Speculative sampling maths on constructed distributions."""

import pytest
import torch
from scipy.stats import chisquare

from viasd.errors import ViasdError
from viasd.verify.acceptance import residual, verify_block
from viasd.verify.sampling import SamplingParams, warp_probs

# Every statistical test here uses a false-alarm rate of 1e-4 per test: a correct implementation
# fails one with probability 1/10,000; a wrong one (tested by hand by breaking the residual) fails always.
ALPHA = 1e-4


def test_greedy_verification_is_exact_matching():
    q = warp_probs(torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]]), SamplingParams())
    gen = torch.Generator().manual_seed(0)
    p = warp_probs(torch.tensor([[0.0, 5.0, 1.0], [0.0, 3.0, 1.0]]), SamplingParams())
    verdict = verify_block([1, 1], p, q, gen)
    assert (verdict.accepted, verdict.next_token, verdict.rejected) == (1, 0, True)
    verdict = verify_block([1, 0], None, q, gen)
    assert (verdict.accepted, verdict.next_token, verdict.rejected) == (2, 2, False)


def test_first_token_follows_the_target_distribution():
    """Draw x ~ p, verify against q: the first committed token must be distributed as q."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.3])
    gen = torch.Generator().manual_seed(1234)
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        x = int(torch.multinomial(p, 1, generator=gen))
        verdict = verify_block([x], p[None], torch.stack([q, q]), gen)
        first = x if verdict.accepted else verdict.next_token
        counts[first] += 1
    assert chisquare(counts.numpy(), (q * n).numpy()).pvalue > ALPHA


def test_one_hot_drafts_also_follow_the_target():
    """A deterministic drafter (prompt lookup) always proposes token 3."""
    q = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.3])
    gen = torch.Generator().manual_seed(7)
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        verdict = verify_block([3], None, torch.stack([q, q]), gen)
        counts[3 if verdict.accepted else verdict.next_token] += 1
    assert chisquare(counts.numpy(), (q * n).numpy()).pvalue > ALPHA


def test_residual_is_normalised_positive_part():
    q = torch.tensor([0.5, 0.3, 0.2])
    p = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(q, p, 1), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual(q, None, 0), torch.tensor([0.0, 0.6, 0.4]))
    assert torch.allclose(residual(q, q, 0), q)


def test_top_k_and_top_p_warping():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_k = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top_k, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    top_p = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(top_p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    top_p = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(top_p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ],
)
def test_invalid_sampling_parameters_are_refused(kwargs, message):
    with pytest.raises(ViasdError, match=message):
        SamplingParams(**kwargs)
