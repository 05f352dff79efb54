"""Speculative sampling maths on constructed distributions."""

import pytest
import torch
from scipy.stats import chisquare

from viasd.errors import ViasdError
from viasd.verify.acceptance import check_token, residual, verify_block
from viasd.verify.resident import block_outcomes, first_rejection
from viasd.verify.sampling import SamplingParams, sample, warp_probs

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


def _mass_before(scores: torch.Tensor) -> torch.Tensor:
    """The top-p definition's numbers, by sorting whole rows in float64: for each token, the mass of the tokens
    ranked before it (it stays in the nucleus while that is below top_p; the best token always stays)."""
    ordered, order = torch.sort(scores.double(), dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    before[..., 0] = 0.0
    return torch.zeros_like(before).scatter(-1, order, before)


@pytest.mark.parametrize("temperature", [0.3, 0.8, 1.5, 50.0])
def test_top_p_on_a_large_vocabulary_keeps_the_nucleus_that_sorting_defines(temperature):
    """The nucleus is looked for among a row's best candidates first (sorting 150k scores costs more than a CPU
    pass); peaked rows end there, flat ones (temperature 50) need the whole row: both give sorting's nucleus, up
    to a token whose mass-before lies within float32 rounding of top_p, renormalised."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 20_000, generator=gen, dtype=torch.float64).float() * 4
    logits[0, :5000] = float("-inf")  # a row with banned tokens
    scores = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    before = _mass_before(scores)
    for top_p in (0.5, 0.9, 0.95, 0.999):
        probs = warp_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))
        kept = before < top_p
        borderline = (before - top_p).abs() < 1e-5
        assert not ((probs > 0) != kept)[~borderline].any()
        law = scores.double().softmax(dim=-1) * (probs > 0)
        assert torch.allclose(probs.double(), law / law.sum(dim=-1, keepdim=True), rtol=1e-4, atol=1e-9)
    assert int((warp_probs(logits, SamplingParams(temperature=temperature, top_p=0.5)) > 0).sum()) >= 6


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
        ({"seed": 2**64}, r"seed must be an integer in \[-9223372036854775808, 18446744073709551615\]"),
        ({"seed": -(2**63) - 1}, "seed must be"),
        ({"seed": 1.5}, "seed must be"),
    ],
)
def test_invalid_sampling_parameters_are_refused(kwargs, message):
    with pytest.raises(ViasdError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-300),
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-300, top_p=0.5, top_k=3),
        SamplingParams(temperature=0.5, top_p=1e-300),
        SamplingParams(temperature=1e-3, top_p=5e-324),
    ],
    ids=["t1e-300", "t1e-40", "t1e-300-topp-topk", "topp1e-300", "t1e-3-topp-denormal"],
)
def test_tiny_temperature_or_top_p_gives_the_argmax_not_nan(params):
    """Positive values so small that the warped distribution underflows behave as greedy sampling."""
    logits = torch.tensor([[1.0, 7.5, -3.0, 7.25], [-80.0, 90.0, 0.0, 89.0], [0.0, 0.0, 0.0, 1e-3]])
    probs = warp_probs(logits, params)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(dim=-1), torch.ones(3))
    assert probs.argmax(dim=-1).tolist() == [1, 1, 3] and (probs.max(dim=-1).values == 1.0).all()
    gen = params.generator()
    assert [sample(row, gen) for row in probs] == [1, 1, 3]


def test_seeds_across_the_whole_64_bit_range_work_and_repeat():
    logits = torch.tensor([[0.0, 0.1, 0.2, 0.3]])
    for seed in (-(2**63), -1, 0, 2**63, 2**64 - 1):
        params = SamplingParams(temperature=1.0, seed=seed)
        probs = warp_probs(logits, params)[0]
        draws = [sample(probs, params.generator()) for _ in range(2)]
        assert draws[0] == draws[1]


def test_non_finite_distributions_never_reach_sampling():
    nan_row = torch.tensor([[float("nan"), 1.0, 2.0, float("nan")]])
    probs = warp_probs(nan_row, SamplingParams(temperature=0.7))
    assert probs.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    with pytest.raises(ViasdError, match="not finite"):
        sample(torch.tensor([float("nan"), 0.5]), torch.Generator())


@pytest.mark.parametrize("drafted", ["model", "one-hot"])
def test_the_host_and_device_paths_make_the_same_accept_decisions(drafted):
    """Both paths run one accept test (`accept_tests`): from the same generator state they keep the same drafts;
    only their replacements are drawn differently (the host draws the one it uses). A one-token host check is the
    first test of the block."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0)
    agreed = kept_some = rejected_some = 0
    for seed in range(200):
        logits = torch.randn(4, 6) * 2
        q = warp_probs(logits, params)
        p = warp_probs(torch.randn(3, 6) * 2, params) if drafted == "model" else None
        tokens = [int(torch.multinomial(p[i], 1)) if p is not None else i for i in range(3)]
        host = verify_block(tokens, p, q, torch.Generator().manual_seed(seed))
        outcomes = block_outcomes(torch.tensor(tokens), p, logits, params, torch.Generator().manual_seed(seed))
        kept, _ = first_rejection(outcomes).tolist()
        first = check_token(tokens[0], None if p is None else p[0], q[0], torch.Generator().manual_seed(seed))
        agreed += host.accepted == kept and (first is None) == (kept > 0)
        kept_some += kept > 0
        rejected_some += kept < 3
    assert agreed == 200 and kept_some > 20 and rejected_some > 20  # both branches were exercised


def test_a_draft_beyond_the_verifier_width_never_stands_on_the_host():
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    assert verify_block([7], None, q, torch.Generator().manual_seed(0)).accepted == 0
    assert check_token(7, None, q[0], torch.Generator().manual_seed(0)) in (0, 1)
