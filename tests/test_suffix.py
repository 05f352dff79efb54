"""Suffix drafting: the index finds the longest earlier match, long matches draft past gamma, earlier generations
are matched through the engine's store, and every method that drafts with it stays exact."""

import random
import re

import pytest
import torch

from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.drafters.base import Proposal, reach_of
from viasd.drafters.hybrid import HybridDrafter
from viasd.drafters.suffix import (
    LONGEST,
    RESYNC_AFTER,
    SEED,
    CopyRun,
    Index,
    SuffixDrafter,
    SuffixStore,
    continue_run,
    followed,
    resync,
)
from viasd.engine import Engine, EngineSpec
from viasd.errors import ViasdError
from viasd.kernels.packed_attention import PACK_UP_TO
from viasd.methods import parse_method
from viasd.models.loading import LoadedModel
from viasd.passes.prefix_cache import REREAD, read_prompt
from viasd.verify.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _longest_by_brute_force(tokens: list[int], tail: list[int], before: int) -> int:
    """The longest match of `tail`'s end (at least SEED tokens, at most LONGEST) ending before `before`."""
    best = 0
    for end in range(SEED, before):
        length = 0
        while length < min(LONGEST, end, len(tail)) and tokens[end - length - 1] == tail[-length - 1]:
            length += 1
        if length >= SEED:
            best = max(best, length)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_index_grown_piece_by_piece_finds_the_longest_match_brute_force_finds(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(300)]  # a small alphabet: many matches of every length
    index = Index()
    start = 0
    while start < len(tokens):  # grown as a generation grows: a prompt, then rounds of a few tokens
        step = rng.randrange(1, 40)
        index.extend(tokens[start : start + step])
        start += step
        seen = tokens[:start]
        found = index.matches(seen, before=len(seen))
        expected = _longest_by_brute_force(seen, seen, len(seen))
        # CANDIDATES bounds the occurrences tried: the latest ones; on this alphabet the longest is among them or
        # as long as one that is.
        assert max((length for length, _ in found), default=0) == expected or len(found) == 32
        for length, end in found:
            assert seen[end - length : end] == seen[len(seen) - length :] and end < len(seen)


def test_a_long_match_drafts_past_gamma_and_a_short_one_as_prompt_lookup():
    drafter = SuffixDrafter(reach=16)  # the class takes any reach; the method option stops at MAX_REACH
    run = list(range(10, 40))  # 30 distinct tokens
    context = [1, 2, *run, 3, *run[:12]]  # the tail repeats 12 tokens of the run
    params, generator = SamplingParams(temperature=0.0), torch.Generator()
    assert drafter.reach(context, GREEDY) == 12  # a match of 12 tokens: up to 12 drafts
    assert drafter.propose(context, 12, params, generator).tokens == run[12:24]
    assert drafter.propose(context, 4, params, generator).tokens == run[12:16]  # k bounds it
    assert SuffixDrafter(reach=5).reach(context, GREEDY) == 5
    short = [7, 8, 9, 7]  # no 3-token match: prompt lookup's 1-gram, up to k
    assert drafter.reach(short, GREEDY) == 0 and drafter.propose(short, 3, params, generator).tokens == [8, 9, 7]
    assert SuffixDrafter(short=False).propose(short, 3, params, generator).tokens == []
    # A new context that is not an extension of the last starts a new index: no stale matches.
    assert drafter.reach([50, 51, 52, 53], GREEDY) == 0


def test_finished_generations_are_matched_through_the_store_and_the_oldest_dropped():
    store = SuffixStore(tokens=100)
    first = SuffixDrafter(store=store)
    earlier = list(range(20, 80))  # 60 tokens
    first.propose(earlier, 4, SamplingParams(temperature=0.0), torch.Generator())
    first.reset()  # the generation ended: its tokens go to the store
    assert store.held == 60
    second = SuffixDrafter(store=store)
    context = [5, 6, *earlier[10:30]]  # a new request quoting 20 tokens of the earlier one
    assert second.reach(context, GREEDY) == 15 and second.best(context)[1][:3] == earlier[30:33]
    assert second.reach(context, SamplingParams(temperature=0.7)) == 0  # sampling: its own tokens only
    alone = SuffixDrafter(store=None)
    assert alone.reach(context, GREEDY) == 0  # without the store nothing matches
    store.add(list(range(100, 150)))  # 110 tokens > 100: the oldest goes
    # A new generation finds nothing (`second`'s copy run, lined up with the dropped sequence, may still read it).
    assert store.held == 50 and SuffixDrafter(store=store).reach(context, GREEDY) == 0
    SuffixStore(tokens=0).add(earlier)  # off: keeps nothing, no error


def _engine(**spec) -> Engine:
    tok = tiny_tokenizer(64)
    return Engine(
        EngineSpec(target="t", drafter="d", **spec),
        target=LoadedModel(tiny_model("llama"), tok, "t", "t"),
        drafter=LoadedModel(tiny_model("llama", layers=2, seed=1), tok, "d", "d"),
    )


RUN = [(7 * i + 3) % 60 + 2 for i in range(40)]
COPY_PROMPT = [RUN[0], *RUN, 2, *RUN[:20]]  # its tail matches 20 tokens of the run


def _draft_lengths(decoder, monkeypatch) -> list[int]:
    """The lengths of the drafts `decoder`'s drafter proposes from now on, round by round."""
    lengths: list[int] = []
    propose = decoder.drafter.propose

    def recording(context, k, *args):
        proposal = propose(context, k, *args)
        lengths.append(len(proposal))
        return proposal

    monkeypatch.setattr(decoder.drafter, "propose", recording)
    return lengths


@pytest.mark.parametrize("method", ["sd:drafter=suffix", "sd:drafter=suffix:reach=9", "sd:drafter=suffix+head"])
def test_suffix_methods_give_plain_decodings_tokens_with_drafts_past_gamma(method, capsys, monkeypatch):
    engine = _engine()
    prompt = COPY_PROMPT
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    decoder = engine.decoder(method)
    assert decoder.gamma == 4
    reach = 9 if "reach" in method else 15  # the match is 20 tokens long
    assert reach_of(decoder.drafter, prompt, GREEDY) == reach  # the first round drafts past gamma
    lengths = _draft_lengths(decoder, monkeypatch)
    out = engine.generate(prompt, method, config)
    assert out.tokens == engine.generate(prompt, "plain", config).tokens
    assert lengths[0] == reach and max(lengths) > decoder.gamma
    if method.endswith("+head"):  # the tiny target has no head: the next-best drafter, said in one line
        assert isinstance(decoder.drafter, HybridDrafter) and isinstance(decoder.drafter.lookup, SuffixDrafter)
        assert "next-best drafter" in capsys.readouterr().err


def test_a_round_after_a_prompt_read_in_pieces_verifies_at_most_the_fused_passes_rows(monkeypatch):
    """A prompt read in pieces (a prefix cache's resume, `viasd chat`) leaves its last 2 tokens to the first round:
    the copy drafts 14, not 15, so that round's pass is 16 rows, the longest the fused layers run."""
    engine = _engine()
    prompt = COPY_PROMPT
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    decoder = engine.decoder("sd:drafter=suffix")
    lengths = _draft_lengths(decoder, monkeypatch)
    out = decoder.generate(prompt, config, resume=lambda sessions, tokens: read_prompt(sessions[0], tokens))
    assert lengths[0] == PACK_UP_TO - REREAD  # not MAX_REACH: 2 + 15 rows would leave the fused layers
    assert out.tokens == engine.generate(prompt, "plain", config).tokens


def test_a_seeded_sampling_request_gets_what_it_gets_alone_whatever_came_before():
    """Its drafts shape which random draws are used, so a sampling request drafts from its own tokens only: the
    store of earlier requests (the first run below) changes nothing."""
    engine = _engine()
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=3))
    one = engine.generate(prompt, "sd:drafter=suffix", config)
    assert one.tokens == engine.generate(prompt, "sd:drafter=suffix", config).tokens
    assert one.tokens == _engine(suffix_cache=0).generate(prompt, "sd:drafter=suffix", config).tokens
    assert all(0 <= t < 64 for t in one.tokens) and len(one.tokens) == 24


def test_the_engines_store_carries_one_generation_to_the_next_and_can_be_off():
    engine = _engine()
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    first = engine.generate(list(range(2, 30)), "sd:drafter=suffix", config)
    engine.generate([3, 4], "sd:drafter=suffix", config)  # its reset put the first generation in the store
    store = engine.suffix_store()
    # The drafter saw the context up to its last round: all but that round's tokens (at most gamma + 1).
    assert store is not None and 28 + len(first.tokens) - 5 <= store.held <= 28 + len(first.tokens)
    assert _engine(suffix_cache=0).suffix_store() is None
    with pytest.raises(ViasdError, match="--suffix-cache must be a number of tokens >= 0"):
        EngineSpec(suffix_cache=-1)


def test_side_by_side_each_method_copies_only_its_own_answers_and_none_from_a_forgotten_warm_up():
    """The bench's engine: one method's answer to a task never drafts another method's run of it (the second would
    copy it whole), nor does a warm-up's generation of a timed task's prompt."""
    engine = _engine(suffix_per_method=True)
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    engine.generate(list(range(2, 30)), "sd:drafter=suffix", config)
    engine.generate([3, 4], "sd:drafter=suffix", config)  # its reset kept the first generation
    own, other = engine.suffix_store("sd:drafter=suffix"), engine.suffix_store("sd:drafter=suffix+head")
    assert own is not None and own.held >= 28 and other is not None and other.held == 0
    engine.forget_finished()
    assert own.held == 0 and engine.suffix_store("sd:drafter=suffix") is own  # the drafters' store, emptied
    shared = _engine()  # elsewhere (generate, chat, serve) every method of an engine shares one store
    assert shared.suffix_store("a") is shared.suffix_store("b")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sd:reach=8", "option 'reach' needs drafter=suffix or drafter=suffix+head"),
        ("sd:drafter=suffix:match=2", "option 'match' needs drafter=lookup, hybrid or lookup+head"),
        ("sd:drafter=suffix:stop=0.3", "option 'stop' needs a model drafter"),
        ("sd:drafter=suffix:reach=0", "method option reach must be in 1..15, got 0"),
        ("sd:drafter=suffix:reach=16", "method option reach must be in 1..15, got 16"),
    ],
)
def test_suffix_options_are_refused_where_they_mean_nothing(text, message):
    with pytest.raises(ViasdError, match=re.escape(message)):
        parse_method(text)


def test_the_longest_suffix_draft_is_verified_on_the_fused_passes():
    """reach + 1 rows is the verification pass: at most the longest pass the fused layers run (block-invariant)."""
    from viasd.kernels.packed_attention import PACK_UP_TO
    from viasd.speculation import DEFAULT_REACH, MAX_REACH

    assert MAX_REACH + 1 == PACK_UP_TO and DEFAULT_REACH <= MAX_REACH


def _edited_copy() -> tuple[list[int], list[int]]:
    """A prompt holding a run of 30 distinct tokens, and the run as an answer copies it with its 11th token edited."""
    run = list(range(10, 40))
    return [1, *run, 2], [*run[:10], 99, *run[11:]]


def test_an_edited_copy_resumes_from_a_match_shorter_than_the_seed_and_goes_on_while_accepted():
    prompt, answer = _edited_copy()
    drafter, generator = SuffixDrafter(short=False), torch.Generator()  # a hybrid's copier: no prompt lookup of its own
    # A seed match drafts the source: its 11th token is wrong (the edit), the target's is kept.
    assert drafter.propose(prompt + answer[:10], 4, GREEDY, generator).tokens == prompt[11:15]
    assert drafter.propose(prompt + answer[:11], 4, GREEDY, generator).tokens == []  # the edit: nothing to copy
    # One source token after the edit: a 1-token match, at the source position where the copy broke.
    resumed = prompt + answer[:12]
    assert drafter.index.matches(resumed, before=len(resumed)) == []  # shorter than the seed
    assert drafter.propose(resumed, 1, GREEDY, generator).tokens == answer[12:13]
    # Its draft accepted: the tail [99, a11, a12] has no seed match, the copy goes on where it was.
    accepted = prompt + answer[:13]
    assert drafter.index.matches(accepted, before=len(accepted)) == []
    assert drafter.propose(accepted, 4, GREEDY, generator).tokens == answer[13:17]
    assert drafter.reach(accepted, GREEDY) == 2  # the run's length so far: 1 matched, 1 followed


def test_a_resumed_copy_that_misses_at_once_is_over_and_a_broken_one_waits_only_so_long():
    prompt, answer = _edited_copy()
    drafter, generator = SuffixDrafter(short=False), torch.Generator()
    drafter.propose(prompt + answer[:10], 4, GREEDY, generator)
    assert drafter.propose(prompt + answer[:12], 4, GREEDY, generator).tokens == answer[12:16]
    missed = prompt + answer[:12] + [98]  # new text after the short match: it was no copy
    assert drafter.propose(missed, 4, GREEDY, generator).tokens == [] and drafter.run is None
    assert drafter.propose([*missed, answer[13]], 4, GREEDY, generator).tokens == []
    # A run broken at an edit resumes within RESYNC_AFTER tokens of new text, not after.
    for new_text, resumes in ((RESYNC_AFTER - 1, True), (RESYNC_AFTER + 1, False)):
        drafter = SuffixDrafter(short=False)
        drafter.propose(prompt + answer[:10], 4, GREEDY, generator)
        edited = prompt + answer[:10] + list(range(100, 100 + new_text))
        drafter.propose(edited, 4, GREEDY, generator)
        drafted = drafter.propose([*edited, answer[11]], 4, GREEDY, generator).tokens
        assert drafted == (answer[12:16] if resumes else [])


def test_a_copy_run_is_a_pure_function_of_the_tokens():
    source = [5, 6, 7, 8, 9, 10, 11, 12]
    run = CopyRun(source, 2, 10, 3, shared=False)  # source[2] expected after 10 context tokens
    context = list(range(100, 110))
    assert followed(source, 2, [7, 8, 0]) == 2 and followed(source, 7, [12, 13]) == 1
    went_on = continue_run(run, [*context, 7, 8])  # both follow: it goes on at source[4]
    assert went_on == (CopyRun(source, 4, 12, 5, False), (5, 4))
    broken = continue_run(run, [*context, 7, 0])  # the edit replaced source[3]: it waits there
    assert broken == (CopyRun(source, 3, 11, 0, False), None)
    resumed = continue_run(run, [*context, 7, 0, 9])  # source[4] after the edit: resumed at 5, a 1-token match
    assert resumed == (CopyRun(source, 5, 13, 1, False), (1, 5))
    assert resync(source, 3, [0, 9, 10]) == (2, 6) and resync(source, 3, [0]) is None
    assert resync(source, 0, [12]) is None  # the source's last token: nothing follows it
    assert continue_run(CopyRun(source, 3, 11, 1, False), [*context, 7, 0]) is None  # a short resumption missed


def test_the_hybrid_copies_an_edited_run_where_it_handed_it_to_its_model():
    prompt, answer = _edited_copy()

    class Model:
        name, forward_passes, pass_seconds, sessions = "model", 0, 0.0, ()

        def reset(self, prompt_length=None, budget=None):
            pass

        def propose(self, context, k, params, generator, stop=0.0):
            return Proposal([0] * k, source="model")

    hybrid = HybridDrafter(SuffixDrafter(short=False), Model())
    hybrid.reset(len(prompt), None)
    sources = [hybrid.propose(prompt + answer[:length], 4, GREEDY, torch.Generator()).source for length in (10, 11, 12)]
    assert sources == ["suffix", "model", "suffix"]  # the seed match, the edit, the 1-token match after it
