"""A draft head's vocabulary widened by the context (drafters/context_vocabulary.py): it follows a growing context,
starts over on another, scores exactly the target's output rows of the tokens it adds, and keeps speculative
decoding exact (greedy tokens, sampling law) while its drafts reach tokens outside the head's own vocabulary."""

from __future__ import annotations

import pytest
import torch

from helpers import Recording
from laws import ALPHA, exact_joint, pooled_pvalue
from test_drafts import SAMPLING, sample_counts
from test_head import random_head
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters import context_vocabulary
from viasd.drafters.context_vocabulary import ContextVocabulary
from viasd.drafters.head import HeadDrafter
from viasd.heads.network import DraftHead, HeadConfig


class Keeping(Recording):
    """A recording drafter that also keeps every proposal's tokens."""

    def __init__(self, drafter: HeadDrafter) -> None:
        super().__init__(drafter)
        self.proposals: list[list[int]] = []
        self.contexts: list[list[int]] = []

    def propose(self, context, k, params, generator, stop=0.0):
        out = super().propose(context, k, params, generator, stop)
        self.proposals.append(list(out.tokens))
        self.contexts.append(list(context))
        return out


def partial_head(hidden: int, own: list[int], seed: int = 0, scale: float = 0.05) -> DraftHead:
    """A random head whose vocabulary is `own` only."""
    full = random_head(hidden, len(own), seed=seed, scale=scale)
    head = DraftHead(HeadConfig(hidden=hidden, width=32, vocab=len(own)), torch.tensor(own)).double()
    head.load_state_dict({**full.state_dict(), "token_ids": torch.tensor(own)})
    return head


def test_it_adds_the_contexts_tokens_the_head_lacks_in_order_and_starts_over_on_another_context():
    output = torch.randn(20, 8, dtype=torch.float64)
    vocabulary = ContextVocabulary(torch.tensor([0, 1, 2]), output, torch.float64)
    vocabulary.follow([1, 7, 2, 7, 5])
    assert vocabulary.ids.tolist() == [0, 1, 2, 7, 5]
    vocabulary.follow([1, 7, 2, 7, 5, 9, 0, 5, 11])  # the same context, grown
    assert vocabulary.ids.tolist() == [0, 1, 2, 7, 5, 9, 11]
    torch.testing.assert_close(vocabulary.rows, output[[7, 5, 9, 11]])
    state = torch.randn(8, dtype=torch.float64)
    own = (output[[0, 1, 2]] @ state).float()[None]
    torch.testing.assert_close(vocabulary.logits(own, state), (output[vocabulary.ids] @ state).float()[None])
    vocabulary.follow([3, 7])  # another context: not a continuation of the one seen
    assert vocabulary.ids.tolist() == [0, 1, 2, 3, 7] and vocabulary.rows.shape == (2, 8)
    vocabulary.follow([3, 6, 50])  # diverges after its first token; 50 is no token of the output head
    assert vocabulary.ids.tolist() == [0, 1, 2, 3, 6]


def test_a_long_context_adds_at_most_the_cap(monkeypatch):
    monkeypatch.setattr(context_vocabulary, "MOST_ADDED", 3)
    vocabulary = ContextVocabulary(torch.tensor([0]), torch.randn(20, 4), torch.float32)
    vocabulary.follow([4, 5, 6, 7, 8])
    vocabulary.follow([4, 5, 6, 7, 8, 9])
    assert vocabulary.ids.tolist() == [0, 4, 5, 6] and vocabulary.rows.shape == (3, 4)


def test_greedy_drafts_reach_the_contexts_tokens_and_stay_exact():
    """A head that owns half the tokens drafts tokens of the other half that the context holds (never one the
    context lacks), and the output is plain greedy's, token for token; with `own` it drafts only its own."""
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    prompt = [3, 40, 5, 41, 7, 42, 12, 3, 43, 5]
    plain = PlainDecoder(target, tok).generate(prompt, config).tokens
    head = partial_head(64, list(range(32)), scale=0.3)
    for vocabulary in ("context", "own"):
        recording = Keeping(HeadDrafter(head, target, vocabulary=vocabulary))
        out = SpeculativeDecoder(target, tok, recording, gamma=4).generate(prompt, config)
        assert out.tokens == plain
        drafted = {t for proposal in recording.proposals for t in proposal}
        context = set(prompt) | set(plain)
        outside = drafted - set(range(32))
        if vocabulary == "context":
            assert outside and outside <= context, (outside, context)
        else:
            assert not outside


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "t0.7-topk5-topp0.9"])
def test_sampling_with_a_context_vocabulary_follows_the_target_distribution(params):
    """The head owns 4 of 6 tokens and the prompt holds a fifth: its drafts are proper distributions over those
    five (zero on the sixth until the answer writes it), and the output follows the warped target's law
    (chi-square, false-alarm rate ALPHA)."""
    vocab, length, n = 6, 3, 1500
    target = tiny_model("qwen2", vocab_size=vocab, init_scale=0.15)
    head = partial_head(64, [0, 1, 2, 3], seed=3, scale=0.3)
    recording = Keeping(HeadDrafter(head, target))
    decoder = SpeculativeDecoder(target, tiny_tokenizer(vocab), recording, gamma=2)
    prompt = [2, 4, 3, 2]
    counts, _ = sample_counts(decoder, prompt, params, length, n)
    assert any(4 in proposal for proposal in recording.proposals)  # the prompt's token was drafted
    pairs = zip(recording.contexts, recording.proposals, strict=True)
    assert all(5 in context for context, proposal in pairs if 5 in proposal)  # the sixth only once written
    assert pooled_pvalue(exact_joint(target, prompt, params, vocab, length), counts, n) > ALPHA
