"""Penalties, logit bias, min_p, min_tokens and stop tokens: the logits maths against a plain reference, greedy
speculative output equal to plain greedy output under them with every drafter, and sampling that follows the
penalised target's law (chi-square, false-alarm rate ALPHA)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from helpers import Recording
from laws import ALPHA, pooled_pvalue
from test_head import random_head
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.hf_assisted import HFAssistedDecoder
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.head import HeadDrafter
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.errors import UnsupportedParameter, ViasdError
from viasd.verify.gates import Gate
from viasd.verify.penalties import Penalties, penalised
from viasd.verify.sampling import SamplingParams, warp_probs
from viasd.views.layer_skip import LayerMask

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12]


def reference(row: list[float], penalties: Penalties, prompt: list[int], output: list[int]) -> list[float]:
    """One position's adjusted logits, written out token by token as the definitions read."""
    out = list(row)
    for token, value in penalties.bias:
        if token < len(out):
            out[token] += value
    for token in range(len(out)):
        if len(output) < penalties.min_tokens and token in penalties.ends:
            out[token] = -math.inf
        if token in prompt or token in output:
            r = penalties.repetition
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = output.count(token)
        out[token] -= penalties.frequency * count + (penalties.presence if count else 0.0)
    return out


def test_penalised_rows_follow_the_definitions_for_each_position():
    """A verifier's rows over a block: row i sees the prompt, the output and the drafts before it."""
    torch.manual_seed(0)
    width, prompt, output, drafts = 12, [2, 3, 3, 11], [5, 5, 7], [9, 5, 1]
    penalties = Penalties(0.7, 0.4, 1.5, 5, ((1, 2.0), (6, -3.0), (40, 1.0)), len(prompt), frozenset({1, 10}))
    logits = torch.randn(len(drafts) + 1, width) * 3
    got = penalised(logits, penalties, prompt + output, drafts)
    for i in range(len(drafts) + 1):
        want = reference(logits[i].tolist(), penalties, prompt, output + drafts[:i])
        torch.testing.assert_close(got[i], torch.tensor(want), rtol=1e-6, atol=1e-6)
    # One row after all the drafts (a drafter's step), and drafts as a tensor: the same row.
    last = penalised(logits[-1:], penalties, prompt + output, torch.tensor(drafts))
    torch.testing.assert_close(last[0], got[-1])
    assert penalised(logits, Penalties(prompt_length=4), prompt + output, drafts) is logits  # neutral: untouched


def test_min_p_keeps_tokens_at_least_that_likely_relative_to_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    probs = warp_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))[0]
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.12, 0.0]) / 0.92)
    assert warp_probs(logits, SamplingParams(temperature=1.0, min_p=1.0))[0].tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: Penalties(presence=2.5), "presence_penalty must be a number in [-2, 2]"),
        (lambda: Penalties(frequency=math.nan), "frequency_penalty"),
        (lambda: Penalties(repetition=0.0), "repetition_penalty must be a number > 0"),
        (lambda: Penalties(min_tokens=-1), "min_tokens must be an integer >= 0"),
        (lambda: Penalties(bias=((3, 101.0),)), "logit_bias values must be numbers in [-100, 100]"),
        (lambda: SamplingParams(min_p=1.5), "min_p must be in [0, 1]"),
        (
            lambda: GenerationConfig(max_new_tokens=2, sampling=SamplingParams(penalties=Penalties(min_tokens=3))),
            "min_tokens",
        ),
    ],
)
def test_out_of_range_values_are_refused_in_one_line(make, words):
    with pytest.raises(ViasdError, match=words.replace("[", r"\[").replace("]", r"\]")):
        make()


GREEDY = SamplingParams(penalties=Penalties(presence=0.5, frequency=0.5, repetition=1.3, bias=((8, 1.5),)))
# The bias pushes EOS (t1), which min_tokens holds back for 12 tokens.
ENDING = SamplingParams(penalties=Penalties(presence=0.5, repetition=1.2, min_tokens=12, bias=((1, 3.0),)))


@pytest.mark.parametrize(
    ("arch", "config"),
    [
        ("llama", GenerationConfig(max_new_tokens=32, ignore_eos=True, sampling=GREEDY)),
        ("qwen2", GenerationConfig(max_new_tokens=32, ignore_eos=True, sampling=GREEDY)),
        ("llama", GenerationConfig(max_new_tokens=32, sampling=ENDING)),
    ],
    ids=["llama", "qwen2", "llama-min-tokens"],
)
def test_greedy_speculative_equals_plain_under_penalties(arch, config):
    """Every drafter and via's slim path give plain greedy's tokens under penalties."""
    target, tok = tiny_model(arch), tiny_tokenizer(64)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    unpenalised = PlainDecoder(target, tok).generate(PROMPT, GenerationConfig(max_new_tokens=32, ignore_eos=True))
    assert plain.tokens[:12] != unpenalised.tokens[:12]  # the penalties change the output
    if config.sampling.penalties.min_tokens:  # EOS came, but not before min_tokens
        assert 12 <= len(plain.tokens) < 32 and plain.finish_reason == "eos"
    small = tiny_model(arch, layers=2, seed=1)
    drafters = {
        "small-model": ModelDrafter(small),
        "prompt-lookup": PromptLookupDrafter(),
        "self": ModelDrafter(target, LayerMask.skipping(4, [2]), name="self"),
        "head": Recording(HeadDrafter(random_head(64, 64), target)),
        "target-itself": ModelDrafter(target),  # its drafts all stand: each row sees the drafts before it
    }
    for name, drafter in drafters.items():
        out = SpeculativeDecoder(target, tok, drafter, gamma=4).generate(PROMPT, config)
        assert (out.tokens, out.finish_reason) == (plain.tokens, plain.finish_reason), name
    assert out.stats.accepted > len(plain.tokens) // 2
    for drafter in (ModelDrafter(small), ModelDrafter(target)):
        lossless = TieredDecoder(  # every draft checked by a slim view that is the whole target
            target, tok, drafter, [LayerMask.full(4)], RoundPolicy(Gate("kl", (-1.0, math.inf)), cap=8)
        )
        out = lossless.generate(PROMPT, config)
        assert out.tokens == plain.tokens and out.stats.unchecked_tokens > 0
    exact = TieredDecoder(target, tok, ModelDrafter(small), [LayerMask.skipping(4, [2])], RoundPolicy(Gate.exact()))
    assert exact.generate(PROMPT, config).tokens == plain.tokens


def test_stop_tokens_end_the_output_and_min_tokens_holds_them_back():
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    plain = PlainDecoder(target, tok)
    free = plain.generate(PROMPT, GenerationConfig(max_new_tokens=16, ignore_eos=True)).tokens
    stop = free[3]
    first = free.index(stop)
    out = plain.generate(PROMPT, GenerationConfig(max_new_tokens=16, ignore_eos=True, stop_token_ids=(stop,)))
    assert (out.tokens, out.finish_reason) == (free[:first], "stop")
    kept = plain.generate(
        PROMPT,
        GenerationConfig(max_new_tokens=16, ignore_eos=True, stop_token_ids=(stop,), include_stop_str_in_output=True),
    )
    assert kept.tokens == free[: first + 1] and kept.text.endswith(f"t{stop}")
    held = plain.generate(
        PROMPT,
        GenerationConfig(
            max_new_tokens=16,
            ignore_eos=True,
            stop_token_ids=(stop,),
            sampling=SamplingParams(penalties=Penalties(min_tokens=first + 2)),
        ),
    )
    assert len(held.tokens) >= first + 2 and stop not in held.tokens[: first + 2]


def test_stop_strings_count_from_min_tokens_on():
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    free = PlainDecoder(target, tok).generate(PROMPT, GenerationConfig(max_new_tokens=12, ignore_eos=True))
    word = f"t{free.tokens[1]}"
    early = GenerationConfig(max_new_tokens=12, ignore_eos=True, stop_strings=(word,))
    assert PlainDecoder(target, tok).generate(PROMPT, early).finish_reason == "stop"
    late = GenerationConfig(
        max_new_tokens=12,
        ignore_eos=True,
        stop_strings=(word,),
        sampling=SamplingParams(penalties=Penalties(min_tokens=3)),
    )
    out = PlainDecoder(target, tok).generate(PROMPT, late)
    assert out.text.startswith(free.text.split(word)[0] + word)  # the early match was passed over


def test_a_method_that_cannot_honour_a_penalty_refuses_it_by_name():
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    decoder = HFAssistedDecoder(target, tok, tiny_model("llama", layers=2, seed=1), gamma=3)
    for params, name in (
        (SamplingParams(min_p=0.1, temperature=1.0), "min_p"),
        (SamplingParams(penalties=Penalties(repetition=1.1)), "repetition_penalty"),
        (SamplingParams(penalties=Penalties(bias=((3, 1.0),))), "logit_bias"),
    ):
        with pytest.raises(UnsupportedParameter, match=name) as caught:
            decoder.generate(PROMPT, GenerationConfig(max_new_tokens=2, sampling=params))
        assert caught.value.param == name


SAMPLED = SamplingParams(
    temperature=0.9,
    min_p=0.05,
    penalties=Penalties(presence=0.8, frequency=0.5, repetition=1.4, min_tokens=3, bias=((0, 1.5), (4, -1.0))),
)


def penalised_law(target, prompt, params, vocab, length, ends):
    """Exact probability of every continuation under the penalised, warped target, from `reference`."""
    penalties = Penalties(**{**params.penalties.__dict__, "prompt_length": len(prompt), "ends": frozenset(ends)})
    law = {}
    for seq in itertools.product(range(vocab), repeat=length):
        p = 1.0
        for i in range(length):
            with torch.inference_mode():
                logits = target(input_ids=torch.tensor([prompt + list(seq[:i])])).logits[0, -1]
            row = torch.tensor([reference(logits.tolist(), penalties, prompt, list(seq[:i]))])
            p *= float(warp_probs(row, params)[0, seq[i]])
            if p == 0.0:
                break
        law[seq] = p
    return law


@pytest.mark.parametrize("drafter", ["model", "head"])
def test_sampling_under_penalties_follows_the_penalised_target(drafter):
    """Chi-square of 3-token continuations against the exact penalised law (false-alarm rate ALPHA); token 5 is a
    stop token that min_tokens bans at every position, so it never comes."""
    vocab, length, n = 6, 3, 1500
    target = tiny_model("qwen2", vocab_size=vocab, init_scale=0.15)
    if drafter == "model":
        drafts = ModelDrafter(tiny_model("qwen2", vocab_size=vocab, layers=2, seed=5, init_scale=0.15))
    else:
        drafts = HeadDrafter(random_head(64, 5, seed=3, scale=0.3), target)
    decoder = SpeculativeDecoder(target, tiny_tokenizer(vocab), drafts, gamma=2)
    prompt = [2, 3, 4, 2]
    counts: dict[tuple[int, ...], int] = {}
    rejected = 0
    for seed in range(n):
        sampling = SamplingParams(**{**SAMPLED.__dict__, "seed": seed})
        config = GenerationConfig(max_new_tokens=length, ignore_eos=True, stop_token_ids=(5,), sampling=sampling)
        out = decoder.generate(prompt, config)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        rejected += out.stats.evaluated - out.stats.accepted
    assert rejected > n // 10, "the drafter must disagree often enough to exercise rejection"
    assert not any(5 in seq for seq in counts)
    law = penalised_law(target, prompt, SAMPLED, vocab, length, ends={5})
    assert pooled_pvalue(law, counts, n) > ALPHA
