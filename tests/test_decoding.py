"""Decoding methods: greedy speculative output equals plain greedy output token for token, sampling
speculative decoding follows the target's distribution, and stop conditions behave alike everywhere."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

from helpers import Recording
from tiny import ARCHITECTURES, tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter, lookup_continuation
from viasd.errors import ViasdError
from viasd.verify.sampling import SamplingParams, warp_probs
from viasd.views.layer_skip import LayerMask

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12]
ALPHA = 1e-4  # false-alarm rate of each statistical test


def drafters(arch, target):
    return {
        "small-model": ModelDrafter(tiny_model(arch, layers=2, seed=1)),
        "prompt-lookup": PromptLookupDrafter(),
        "self": ModelDrafter(target, LayerMask.skipping(4, [2]), name="self"),
        "target-itself": ModelDrafter(target),  # accepts everything: exercises the bonus path
    }


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_speculative_equals_plain(arch):
    target, tok = tiny_model(arch), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    assert plain.stats.target_calls == 32
    for name, drafter in drafters(arch, target).items():
        for gamma in (1, 5):
            out = SpeculativeDecoder(target, tok, drafter, gamma=gamma).generate(PROMPT, config)
            assert out.tokens == plain.tokens, f"{name} gamma={gamma}"
            assert out.text == plain.text
            stats = out.stats
            assert stats.new_tokens == 32
            assert stats.accepted <= stats.evaluated <= stats.drafted
            # One rejection at most per round: drafts after it are cut off unchecked, not counted as rejected.
            assert stats.evaluated - stats.accepted <= stats.rounds
            assert stats.target_calls <= stats.new_tokens
    perfect = SpeculativeDecoder(target, tok, ModelDrafter(target), gamma=4).generate(PROMPT, config)
    assert perfect.stats.rejection_rate == 0.0
    assert perfect.stats.tokens_per_target_call > 4.5


def test_the_first_round_splits_a_generation_into_first_token_and_decoding():
    """The first push's tokens and time mark where decoding proper starts (bench's decoding tokens/s): plain decoding
    commits one token there, a drafter the target always agrees with a whole round, a budget cuts it."""
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config).stats
    perfect = SpeculativeDecoder(target, tok, ModelDrafter(target), gamma=4).generate(PROMPT, config).stats
    assert (plain.first_tokens, perfect.first_tokens) == (1, 5)  # the first round: 4 drafts and the bonus token
    for stats in (plain, perfect):
        assert 0 < stats.first_token_seconds < stats.total_seconds
        after = stats.total_seconds - stats.first_token_seconds
        assert stats.decode_tokens_per_second == pytest.approx((16 - stats.first_tokens) / after)
        assert stats.to_dict()["decode_tokens_per_second"] == stats.decode_tokens_per_second
    short = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    cut = SpeculativeDecoder(target, tok, ModelDrafter(target), gamma=4).generate(PROMPT, short).stats
    assert cut.first_tokens == 3 and cut.decode_tokens_per_second is None  # nothing came after the first round


def test_repeated_generations_reuse_nothing_stale():
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    decoder = SpeculativeDecoder(target, tok, ModelDrafter(tiny_model("qwen2", layers=2, seed=1)), gamma=3)
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)
    for prompt in ([3, 4, 5], [9, 8, 7, 6, 5, 4], [3, 4, 5]):
        want = PlainDecoder(target, tok).generate(prompt, config).tokens
        assert decoder.generate(prompt, config).tokens == want


def test_stop_conditions_match_plain_decoding():
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    long = PlainDecoder(target, tok).generate(PROMPT, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    # EOS inside a draft block: make the 7th generated token the EOS token.
    eos = long.tokens[6]
    tok.eos_token = f"t{eos}"
    target.generation_config.eos_token_id = eos
    spec = SpeculativeDecoder(target, tok, ModelDrafter(target), gamma=5)
    for decoder in (PlainDecoder(target, tok), spec):
        out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=30))
        first = long.tokens.index(eos)
        assert out.tokens == long.tokens[:first] and out.finish_reason == "eos"
    # A stop string cuts the text; max_new_tokens cuts the tokens.
    stop = f" t{long.tokens[3]} "
    for decoder in (PlainDecoder(target, tok), spec):
        out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=30, stop_strings=(stop,), ignore_eos=True))
        assert out.finish_reason == "stop" and stop not in out.text and long.text.startswith(out.text)
        out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=5, ignore_eos=True))
        assert out.tokens == long.tokens[:5] and out.finish_reason == "length"


def test_streamed_text_equals_final_text():
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    pieces: list[str] = []
    out = SpeculativeDecoder(target, tok, PromptLookupDrafter()).generate(
        PROMPT, GenerationConfig(max_new_tokens=25, ignore_eos=True), on_text=pieces.append
    )
    assert "".join(pieces) == out.text and len(pieces) > 1


def test_context_limit_and_bad_prompts():
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    with pytest.raises(ViasdError, match="empty"):
        PlainDecoder(target, tok).generate([])
    with pytest.raises(ViasdError, match="context holds 256"):
        PlainDecoder(target, tok).generate([5] * 256)
    out = SpeculativeDecoder(target, tok, PromptLookupDrafter(), gamma=8).generate(
        [5] * 250, GenerationConfig(max_new_tokens=50, ignore_eos=True)
    )
    assert len(out.tokens) == 6 and out.finish_reason == "length"


def test_prompt_lookup_finds_latest_longest_match():
    assert lookup_continuation([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]
    assert lookup_continuation([1, 2, 3, 4], 3) == []
    assert lookup_continuation([5, 6, 5], 3) == [6, 5]


def exact_joint(target, prompt, params, vocab, length):
    """Exact probability of every token sequence of `length` under the warped target."""
    probs = {}
    for seq in itertools.product(range(vocab), repeat=length):
        p = 1.0
        for i in range(length):
            with torch.inference_mode():
                logits = target(input_ids=torch.tensor([prompt + list(seq[:i])])).logits[0, -1:]
            p *= float(warp_probs(logits, params)[0, seq[i]])
            if p == 0.0:
                break
        probs[seq] = p
    return probs


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)],
    ids=["t1", "t0.7-topk5-topp0.9"],
)
def test_sampling_speculative_follows_target_distribution(params):
    """Chi-square goodness of fit of 3-token continuations against the exact target law."""
    vocab, length, n = 6, 3, 1500
    target = tiny_model("qwen2", vocab_size=vocab, init_scale=0.15)
    drafter = ModelDrafter(tiny_model("qwen2", vocab_size=vocab, layers=2, seed=5, init_scale=0.15))
    tok = tiny_tokenizer(vocab)
    prompt = [2, 3, 4]
    expected = exact_joint(target, prompt, params, vocab, length)
    decoder = SpeculativeDecoder(target, tok, drafter, gamma=2)
    counts = dict.fromkeys(expected, 0)
    rejected = 0
    for seed in range(n):
        config = GenerationConfig(
            max_new_tokens=length,
            ignore_eos=True,
            sampling=SamplingParams(**{**params.__dict__, "seed": seed}),
        )
        out = decoder.generate(prompt, config)
        counts[tuple(out.tokens)] += 1
        rejected += out.stats.evaluated - out.stats.accepted
    assert rejected > n // 10, "the drafter must disagree often enough to exercise rejection"
    # Pool cells with small expectation so the chi-square approximation holds.
    cells = sorted(expected, key=expected.get)
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell in cells:
        if expected[cell] * n < 5:
            pool_o += counts[cell]
            pool_e += expected[cell] * n
        else:
            obs.append(counts[cell])
            exp.append(expected[cell] * n)
    obs.append(pool_o)
    exp.append(pool_e)
    assert len(obs) > 10
    total = sum(exp)
    assert abs(total - n) < 1e-6 * n
    assert chisquare(obs, [e * n / total for e in exp]).pvalue > ALPHA


def test_an_underflowing_temperature_decodes_as_greedy_with_every_method():
    """temperature 1e-300 is positive but too small to divide logits by: every decoder gives the greedy output."""
    from viasd.decode.hf_assisted import HFAssistedDecoder

    target, drafter, tok = tiny_model("llama"), tiny_model("llama", layers=2, seed=1), tiny_tokenizer(64)
    greedy = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    want = PlainDecoder(target, tok).generate(PROMPT, greedy).tokens
    tiny_t = GenerationConfig(
        max_new_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=1e-300, top_p=0.9)
    )
    decoders = {
        "plain": PlainDecoder(target, tok),
        "sd": SpeculativeDecoder(target, tok, ModelDrafter(drafter), gamma=3),
        "hf-assisted": HFAssistedDecoder(target, tok, drafter, gamma=3),
    }
    for name, decoder in decoders.items():
        assert decoder.generate(PROMPT, tiny_t).tokens == want, name


def test_drafts_after_a_long_prompt_get_the_cache_entries_plain_decoding_writes():
    """A prompt longer than a short pass runs another route (the model's own forward) than decoding steps (viasd's
    loop), which round bf16 differently; drafts of the first round are read in a pass of their own, not along with
    the prompt, so every cache entry equals plain decoding's bit for bit, and so do the tokens."""
    target, tok = tiny_model("qwen2", dtype=torch.bfloat16), tiny_tokenizer(64)
    prompt = [3, 4, 5, 9, 12, 7] * 6 + [3, 4, 5]  # 39 tokens: its tail repeats, so lookup drafts at once
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    plain = PlainDecoder(target, tok)
    expected = plain.generate(prompt, config).tokens
    recording = Recording(PromptLookupDrafter(3, 2))
    sd = SpeculativeDecoder(target, tok, recording, gamma=4)
    passes, extend_to = [], sd.session.extend_to

    def recorded(sequence, keep=1):
        passes.append((len(sd.session.tokens), len(sequence), keep))
        return extend_to(sequence, keep)

    sd.session.extend_to = recorded
    out = sd.generate(prompt, config)
    assert recording.rounds[0][1] == 4  # the first round drafted
    assert passes[:2] == [(0, len(prompt), 1), (len(prompt), len(prompt) + 4, 4)]  # the prompt as plain reads it
    assert out.tokens == expected
    length = min(plain.session.committed, sd.session.committed)
    assert length > len(prompt) + 4
    for mine, theirs in zip(sd.session.cache.layers, plain.session.cache.layers, strict=True):
        assert torch.equal(mine.keys[..., :length, :], theirs.keys[..., :length, :])
        assert torch.equal(mine.values[..., :length, :], theirs.values[..., :length, :])
