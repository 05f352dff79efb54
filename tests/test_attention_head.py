"""The attention head: its cache and draft steps compute what training unrolls, its cache after a generation equals
one built fresh from the session's tokens and features, and drafting with it is exact (greedy tokens, sampling
law) through every decoder that takes a head."""

from __future__ import annotations

import pytest
import torch

from helpers import Recording
from laws import ALPHA, exact_joint, pooled_pvalue
from test_drafts import SAMPLING, sample_counts
from test_head import PROMPT
from tiny import ARCHITECTURES, tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.speculative import SpeculativeDecoder
from viasd.drafters.head import HeadDrafter
from viasd.drafters.hybrid import HybridDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.heads.attention import AttentionCache, AttentionHead, AttentionHeadConfig
from viasd.heads.file import load_head, save_head
from viasd.heads.find import find_head
from viasd.models.fingerprint import model_fingerprint
from viasd.training.attention_unroll import Batch, unroll


def random_attention_head(hidden: int, vocab: int, seed: int = 0, scale: float = 0.05, dtype=torch.float64):
    torch.manual_seed(seed)
    config = AttentionHeadConfig(hidden=hidden, heads=4, kv_heads=2, head_dim=8, width=24, vocab=vocab)
    head = AttentionHead(config, torch.arange(vocab)).to(dtype)
    for name, parameter in head.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(parameter, std=scale)
    return head


@pytest.mark.parametrize("hide_request", [True, False])
def test_the_cache_and_its_draft_steps_compute_what_training_unrolls(hide_request):
    """States from the cache (entries added in uneven blocks, cut and recomputed) and its draft entries equal the
    training-time test's states for every start row and step of two conversations of a padded batch (float64), with
    the request's features hidden (as drafting sees a prompt) or seen."""
    hidden, vocab, depth = 16, 12, 3
    head = random_attention_head(hidden, vocab, scale=0.3)
    generator = torch.Generator().manual_seed(1)
    embeddings = torch.randn(vocab, hidden, generator=generator, dtype=torch.float64)
    lengths, answers = [14, 11], [5, 3]
    longest = max(lengths)
    tokens = torch.randint(vocab, (2, longest + depth + 1), generator=generator)
    features = torch.randn(2, longest, hidden, generator=generator, dtype=torch.float64)
    have = torch.ones(2, longest, dtype=torch.bool)
    have[0, 3] = False  # a request position without a feature: hidden either way
    batch = Batch(features, have, tokens, torch.tensor(lengths), torch.tensor(answers))
    unrolled = unroll(head, embeddings, batch, depth, hide_request)
    for c, (length, answer_from) in enumerate(zip(lengths, answers, strict=True)):
        seen = [bool(have[c, j]) and (j >= answer_from - 1 or not hide_request) for j in range(length)]
        for origin in range(answer_from - 1, length - depth - 1):
            cache = AttentionCache(head)
            for begin, end in ((0, 2), (2, 7), (7, origin + 1)):  # uneven blocks, as rounds add entries
                if begin < end:
                    picked = torch.tensor(seen[begin:end])
                    embedded = embeddings[tokens[c, begin + 1 : end + 1]]
                    cache.extend(features[c, begin:end], picked, embedded, [0] * (end - begin))
            cache.cut(origin)  # a rejected entry, computed again
            embedded = embeddings[tokens[c, origin + 1]][None]
            cache.extend(features[c, origin : origin + 1], torch.tensor([True]), embedded, [0])
            state, chain = cache.last_state, []
            for step in range(depth):
                assert int(unrolled.labels[step][c, origin]) == int(tokens[c, origin + step + 2])
                torch.testing.assert_close(state, unrolled.states[step][c, origin], rtol=1e-10, atol=1e-10)
                state = cache.draft(state, embeddings[tokens[c, origin + step + 2]], chain)


def fresh_cache(drafter: HeadDrafter, tokens: list[int], entries: int) -> AttentionCache:
    """The cache built at once from the session's tokens and features, as a drafter starting now would build it."""
    store = drafter.target.features
    cache = AttentionCache(drafter.head)
    have = torch.tensor([p < store.known and store.have[p] for p in range(entries)])
    rows = torch.zeros(entries, drafter.hidden, dtype=drafter.dtype)
    rows[have] = store.rows[:entries][have].to(rows.dtype)
    embedded = drafter.embeddings.weight[tokens[1 : entries + 1]].to(rows.dtype)
    cache.extend(rows, have, embedded, tokens[1 : entries + 1])
    return cache


def test_the_cache_after_a_generation_equals_one_built_fresh():
    """After rounds that kept and rejected drafts, the drafter's entries (keys, values) equal those of a cache built
    in one block from the session's final tokens and features: no entry outlived the feature or token it read."""
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    drafter = HeadDrafter(random_attention_head(64, 64, scale=0.2), target)
    decoder = SpeculativeDecoder(target, tok, Recording(drafter), gamma=4)
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    stats = out.stats.sources["head"]
    assert 0 < stats.accepted < stats.evaluated  # drafts were kept and rejected
    cache = drafter.cache
    entries = cache.length
    assert entries > len(PROMPT) + 10
    fresh = fresh_cache(drafter, decoder.session.tokens, entries)
    assert fresh.tokens == cache.tokens and fresh.featured == cache.featured
    torch.testing.assert_close(cache.keys, fresh.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.values, fresh.values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_with_an_attention_head_equals_plain(arch):
    target, tok = tiny_model(arch), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config).tokens
    head = random_attention_head(64, 64)
    sd = SpeculativeDecoder(target, tok, Recording(HeadDrafter(head, target)), gamma=5).generate(PROMPT, config)
    assert sd.tokens == plain
    assert sd.stats.sources["head"].drafted > 40
    both = HybridDrafter(PromptLookupDrafter(3, 2), HeadDrafter(head, target), 0.0)
    assert SpeculativeDecoder(target, tok, both, gamma=5, stop=0.3).generate(PROMPT, config).tokens == plain


@pytest.mark.parametrize("params", SAMPLING, ids=["t1", "t0.7-topk5-topp0.9"])
def test_sampling_with_an_attention_head_follows_the_target_distribution(params):
    """Chi-square against the exact law of the warped target (false-alarm rate ALPHA per test)."""
    vocab, length, n = 6, 3, 1500
    target = tiny_model("qwen2", vocab_size=vocab, init_scale=0.15)
    head = random_attention_head(64, 5, seed=3, scale=0.1)  # 5 of the 6 tokens: p is 0 on the last one
    decoder = SpeculativeDecoder(target, tiny_tokenizer(vocab), Recording(HeadDrafter(head, target)), gamma=2)
    counts, stats = sample_counts(decoder, [2, 3, 4, 2], params, length, n)
    drafted = sum(s.sources["head"].evaluated for s in stats if "head" in s.sources)
    kept = sum(s.sources["head"].accepted for s in stats if "head" in s.sources)
    assert n // 10 < kept < drafted - n // 10, (kept, drafted)
    assert pooled_pvalue(exact_joint(target, [2, 3, 4, 2], params, vocab, length), counts, n) > ALPHA


def test_attention_head_files_round_trip(tmp_path):
    target = tiny_model("qwen2")
    head = random_attention_head(64, 64, dtype=torch.float32)
    path = tmp_path / "head.safetensors"
    save_head(path, head, model_fingerprint(target), "vocab", {"design": "attention"})
    loaded = find_head(target, path).head
    assert isinstance(loaded, AttentionHead) and loaded.config == head.config
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name].float(), tensor.to(torch.bfloat16).float())
    assert load_head(path).digest == find_head(target, path).digest


def test_a_trained_attention_head_drafts_better_than_an_untrained_one_and_stays_exact(tmp_path):
    """`train` with the attention design: held-out top-1 and the chain's kept drafts rise over an untrained head's,
    and drafting with it gives plain greedy's tokens."""
    from test_head import borrowed, tiny_data
    from viasd.training.train import Checkpoint, TrainSettings, train

    target, tok, folder = tiny_data(tmp_path, 96)
    data = folder.load()
    weights = borrowed(target)
    quiet = {"progress": False, "log": lambda _: None}
    shape = {"design": "attention", "width": 64, "vocab": 320, "depth": 3, "batch": 8, "seconds": 600}
    settings = TrainSettings(**shape, lr=3e-3, steps=120)
    head, measured = train(data, *weights, settings, Checkpoint(tmp_path / "ckpt.pt"), {2}, **quiet)
    untrained = TrainSettings(**shape, lr=0.0, steps=1)
    _, before = train(data, *weights, untrained, Checkpoint(tmp_path / "ckpt0.pt"), {2}, **quiet)
    assert isinstance(head, AttentionHead)
    assert sum(measured["accuracy"]) > sum(before["accuracy"]) + 0.15, (measured, before)
    assert measured["accepted_per_chain"] > before["accepted_per_chain"], (measured, before)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    kept = 0
    for c in range(data.conversations - 4, data.conversations):  # the held-out conversations' requests
        start, end = int(data.starts[c]), int(data.starts[c + 1])
        prompt = data.tokens[start : start + int(torch.nonzero(data.answer[start:end])[0])].tolist()
        plain = PlainDecoder(target, tok).generate(prompt, config).tokens
        out = SpeculativeDecoder(target, tok, HeadDrafter(head.double(), target), gamma=4).generate(prompt, config)
        assert out.tokens == plain
        kept += out.stats.sources["head"].accepted
    assert kept >= 4


def test_an_attention_head_started_from_a_chain_head_drafts_what_the_chain_head_drafts(tmp_path):
    """Untrained past its start (`o` at zero), the attention head is the chain head: the same drafts, round by round;
    a start that cannot be one (another width) is refused in one line."""
    from test_head import borrowed, random_head, tiny_data
    from viasd.errors import ViasdError
    from viasd.training.train import Checkpoint, TrainSettings, train

    target, tok, folder = tiny_data(tmp_path, 16)
    data = folder.load()
    chain = random_head(64, 320, scale=0.3, dtype=torch.float32)
    shape = {"design": "attention", "width": 32, "vocab": 320, "depth": 2, "batch": 4, "seconds": 600}
    quiet = {"progress": False, "log": lambda _: None}
    head, _ = train(data, *borrowed(target), TrainSettings(**shape, lr=0.0, steps=1), Checkpoint(tmp_path / "c.pt"),
                    {2}, start=chain, **quiet)  # fmt: skip
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompt = data.tokens[: int(torch.nonzero(data.answer)[0])].tolist()
    runs = []
    for drafter in (HeadDrafter(chain.double(), target), HeadDrafter(head.double(), target)):
        drafted: list[list[int]] = []
        propose = drafter.propose

        def recorded(*args, propose=propose, drafted=drafted, **kwargs):
            proposal = propose(*args, **kwargs)
            drafted.append(list(proposal.tokens))
            return proposal

        drafter.propose = recorded  # type: ignore[method-assign]
        SpeculativeDecoder(target, tok, drafter, gamma=3).generate(prompt, config)
        runs.append(drafted)
    assert runs[0] == runs[1] and sum(len(p) for p in runs[0]) > 20
    with pytest.raises(ViasdError, match="same --width"):
        train(data, *borrowed(target), TrainSettings(**{**shape, "width": 16}, lr=0.0, steps=1),
              Checkpoint(tmp_path / "d.pt"), {2}, start=chain, **quiet)  # fmt: skip


def test_train_drafter_trains_an_attention_head_and_refuses_bad_designs(tmp_path, monkeypatch):
    """`--design attention` writes an attention head that drafting finds, `--start-from` an attention head or an
    unknown design is one line."""
    from typer.testing import CliRunner

    from tiny import tiny_chat_tokenizer
    from viasd.cli import app
    from viasd.heads.find import trained_head_path
    from viasd.models.loading import LoadedModel

    tok = tiny_chat_tokenizer(320)
    target = tiny_model("qwen2", vocab_size=320, hidden=64, dtype=torch.float32)
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr("viasd.engine.load_model", lambda name, **_: LoadedModel(target, tok, name, name))
    args = ["train-drafter", "--target", "tiny", "--width", "32", "--vocab", "64", "--depth", "2", "--rows", "4"]
    args += ["--tokens", "300", "--no-progress", "--design", "attention"]
    first = CliRunner().invoke(app, [*args, "--train-minutes", "0.02"])
    assert first.exit_code == 0, first.output
    path = trained_head_path(model_fingerprint(target))
    assert isinstance(find_head(target).head, AttentionHead)
    again = CliRunner().invoke(app, [*args, "--train-minutes", "0.02", "--start-from", str(path)])
    assert again.exit_code == 2 and "--start-from needs a chain head" in again.output
    bad = CliRunner().invoke(app, [*args, "--design", "tree"])
    assert bad.exit_code == 2 and "--design must be one of chain, attention" in bad.output
