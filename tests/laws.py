"""Exact target laws and a chi-square test for sampling tests, in torch alone (the CUDA tests run where scipy
may be missing)."""

from __future__ import annotations

import itertools

import torch

from viasd.decode.base import GenerationConfig
from viasd.verify.sampling import SamplingParams, warp_probs

ALPHA = 1e-4  # false-alarm rate of each statistical test


def exact_joint(target, prompt, params, vocab, length):
    """Exact probability of every token sequence of `length` under the warped target."""
    device = next(target.parameters()).device
    probs = {}
    for seq in itertools.product(range(vocab), repeat=length):
        p = 1.0
        for i in range(length):
            with torch.inference_mode():
                logits = target(input_ids=torch.tensor([prompt + list(seq[:i])], device=device)).logits[0, -1:]
            p *= float(warp_probs(logits, params)[0, seq[i]])
            if p == 0.0:
                break
        probs[seq] = p
    return probs


def sample_counts(decoder, prompt, params, length, n):
    """How often each continuation came out of n seeded generations, and their statistics."""
    counts, stats = {}, []
    for seed in range(n):
        config = GenerationConfig(
            max_new_tokens=length, ignore_eos=True, sampling=SamplingParams(**{**params.__dict__, "seed": seed})
        )
        out = decoder.generate(prompt, config)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        stats.append(out.stats)
    return counts, stats


def chisquare_pvalue(observed, expected):
    """Pearson's chi-square goodness-of-fit p-value (df = cells - 1), as scipy.stats.chisquare gives it."""
    obs = torch.tensor(observed, dtype=torch.float64)
    exp = torch.tensor(expected, dtype=torch.float64)
    statistic = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor((len(observed) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, statistic / 2))


def pooled_pvalue(expected, counts, n):
    """Goodness of fit of `counts` (n draws) to the law `expected`, pooling the cells expected fewer than 5 times."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell in sorted(expected, key=expected.get):
        if expected[cell] * n < 5:
            pool_o += counts.get(cell, 0)
            pool_e += expected[cell] * n
        else:
            obs.append(counts.get(cell, 0))
            exp.append(expected[cell] * n)
    obs.append(pool_o)
    exp.append(pool_e)
    assert len(obs) > 10 and sum(counts.values()) == n
    total = sum(exp)
    return chisquare_pvalue(obs, [e * n / total for e in exp])
