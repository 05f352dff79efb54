"""Decisions where the logits live (verify/resident.py): the device path of every decoder, checked on the CPU.

Greedy decoding takes that path everywhere; sampling takes it off the CPU, and here by forcing
`SamplingParams.on_device`. The same exactness checks as on the host path (greedy output equals plain
decoding's, sampled output follows the target's law), and the property the path exists for: the decoders read
the device once per decision (a drafter's proposal, a slim view's pass, the full target's verdict, a plain
step), with nothing else reading a tensor on the host. tests/test_cuda.py repeats the checks on a GPU.
"""

import math

import pytest
import torch
from scipy.stats import chisquare

from host_reads import host_reads
from laws import ALPHA, chisquare_pvalue, exact_joint, pooled_pvalue, sample_counts
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import RoundPolicy
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.drafters.prompt_lookup import PromptLookupDrafter
from viasd.errors import ViasdError
from viasd.passes.session import KVSession
from viasd.verify.acceptance import match_width, residual, residual_rows
from viasd.verify.gates import Gate
from viasd.verify.resident import STANDS, batch_outcomes, block_outcomes, first_rejection, host_values
from viasd.verify.sampling import BAD_TOKEN, SamplingParams, checked_token, draw, pick, soft_probs, warp_probs
from viasd.views.layer_skip import LayerMask

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12]
GREEDY = SamplingParams()
SAMPLING = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]


@pytest.fixture
def device_sampling(monkeypatch):
    """Sampling decided as on a GPU (tensors, one read per decision), here on CPU tensors."""
    monkeypatch.setattr(SamplingParams, "on_device", lambda self, device: True)


# ------------------------------------------------------------------------------------------- pure maths


def test_chisquare_helper_agrees_with_scipy():
    obs, exp = [18, 25, 30, 27], [25.0, 25.0, 25.0, 25.0]
    assert math.isclose(chisquare_pvalue(obs, exp), chisquare(obs, exp).pvalue, rel_tol=1e-9)


def test_draw_follows_the_rows_and_flags_rows_that_are_not_distributions():
    p = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.3, 0.0])
    gen = torch.Generator().manual_seed(3)
    n = 20000
    counts = torch.bincount(draw(p.expand(n, -1).contiguous(), gen), minlength=6)
    assert counts[5] == 0  # a token without mass is never drawn
    assert chisquare_pvalue(counts[:5].tolist(), (p[:5] * n).tolist()) > ALPHA
    bad = torch.tensor([[float("nan"), 1.0], [0.0, 0.0], [0.5, float("inf")], [0.0, 2.0]])
    assert draw(bad, gen).tolist() == [BAD_TOKEN, BAD_TOKEN, BAD_TOKEN, 1]
    with pytest.raises(ViasdError, match="not finite"):
        checked_token(BAD_TOKEN)


@pytest.mark.parametrize("full_support_row", [False, True], ids=["candidates", "whole-rows"])
def test_draw_on_a_large_vocabulary_follows_the_rows(full_support_row):
    """On a CPU the race runs over each row's best candidates where they hold its whole support (top-p rows of a
    150k vocabulary), else over whole rows (one row of full support sends the batch there): the same law."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(20_000, generator=gen) * 3
    p = warp_probs(logits[None], SamplingParams(temperature=0.5, top_p=0.9))[0]
    assert 10 < int((p > 0).sum()) < 256
    rows = p.expand(2500, -1).clone()
    if full_support_row:
        rows[-1] = torch.full((20_000,), 1 / 20_000)
    counts: dict[int, int] = {}
    for _ in range(4):
        for token in draw(rows, gen)[: 2500 - full_support_row].tolist():
            counts[token] = counts.get(token, 0) + 1
    n = sum(counts.values())
    assert all(p[token] > 0 for token in counts)  # a token without mass is never drawn
    support = torch.nonzero(p)[:, 0].tolist()
    assert min(float(p[t]) for t in support) * n >= 5  # every cell expected often enough for the test
    assert chisquare_pvalue([counts.get(t, 0) for t in support], [float(p[t]) * n for t in support]) > ALPHA


def test_greedy_outcomes_compare_argmaxes():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [float("nan"), 1.0, 0.0]])
    outcomes = block_outcomes(torch.tensor([1, 1, 2]), None, logits, GREEDY, torch.Generator())
    assert outcomes.tolist() == [STANDS, 0, STANDS, 1]  # a NaN logit counts as lowest
    assert first_rejection(outcomes).tolist() == [1, 0]
    assert first_rejection(torch.tensor([STANDS, STANDS, 7])).tolist() == [2, 7]  # all stood: the bonus
    assert first_rejection(torch.tensor([4])).tolist() == [0, 4]  # nothing drafted
    wide = block_outcomes(torch.tensor([9]), None, logits[:2], GREEDY, torch.Generator())  # beyond the head
    assert wide.tolist() == [1, 0]


@pytest.mark.parametrize("drafted", ["model", "one-hot"])
def test_sampled_outcomes_commit_tokens_that_follow_the_target(drafted):
    """Draw x ~ p, decide the block on the device: the first committed token is distributed as q."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.1, 0.3, 0.05, 0.25, 0.3])
    logits = q.log().expand(2, -1)
    gen = torch.Generator().manual_seed(1234)
    params = SamplingParams(temperature=1.0)
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        x = int(torch.multinomial(p, 1, generator=gen)) if drafted == "model" else 3
        draft = p[None] if drafted == "model" else None
        kept, token = first_rejection(block_outcomes(torch.tensor([x]), draft, logits, params, gen)).tolist()
        counts[x if kept else token] += 1
    assert chisquare_pvalue(counts.tolist(), (q * n).tolist()) > ALPHA


@pytest.mark.parametrize("drafted", ["model", "one-hot"])
@pytest.mark.parametrize("laws", ["per-row", "shared"])
def test_a_batch_of_blocks_gives_each_sequence_what_it_gets_alone(drafted, laws):
    """B sequences' blocks decided in one call (`batch_outcomes`): each row's outcomes up to its bonus, and its
    [kept, next token], are exactly what the sequence gets alone with a generator of the same seed. Rows of
    different draft lengths (a padded draft that is the verifier's argmax must not stand), greedy and sampled rows
    with their own parameters, or one set of parameters for all."""
    k, vocab, seeds = 4, 300, [11, 12, 13, 14, 15]
    lengths = [4, 2, 4, 0, 3]
    per_row = [GREEDY, *SAMPLING, GREEDY, SamplingParams(temperature=1.3, top_p=0.8)]
    params = per_row if laws == "per-row" else SAMPLING[0]
    row_laws = per_row if laws == "per-row" else [SAMPLING[0]] * len(seeds)
    torch.manual_seed(0)
    kept_total = rejected = 0
    for _ in range(20):
        logits = torch.randn(len(seeds), k + 1, vocab) * 3
        near = (logits[:, :k] + torch.randn(len(seeds), k, vocab)).flatten(0, 1)
        draft = warp_probs(near, SamplingParams(temperature=1.0)).view(len(seeds), k, vocab)
        tokens = draft.flatten(0, 1).multinomial(1).view(len(seeds), k)
        tokens[0, :2] = logits[0, :2].argmax(dim=-1)  # a greedy row whose first drafts stand
        tokens[3, 0] = logits[3, 0].argmax(dim=-1)  # past row 3's length (0): its bonus, never a standing draft
        draft = draft if drafted == "model" else None
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        batch = batch_outcomes(tokens, draft, logits, params, generators, lengths)
        decided = first_rejection(batch)
        for b, (n, law, seed) in enumerate(zip(lengths, row_laws, seeds, strict=True)):
            alone = block_outcomes(
                tokens[b, :n],
                None if draft is None else draft[b, :n],
                logits[b, : n + 1],
                law,
                torch.Generator().manual_seed(seed),
            )
            assert batch[b, : n + 1].tolist() == alone.tolist()
            assert decided[b].tolist() == first_rejection(alone).tolist()
            kept_total += int(decided[b, 0])
            rejected += int(decided[b, 0]) < n
    assert kept_total > 20 and rejected > 20  # standing drafts and replacements both compared


def test_residual_rows_equal_the_residual_of_each_row():
    q = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.5, 0.3, 0.2]])
    p = torch.tensor([[0.2, 0.6, 0.2], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]])
    tokens = torch.tensor([1, 0, 2])
    rows = residual_rows(q, p, tokens)
    assert all(torch.allclose(rows[i], residual(q[i], p[i], int(tokens[i]))) for i in range(3))
    assert torch.allclose(rows[1], q[1])  # q == p: nothing left over, so q itself
    one_hot = residual_rows(q, None, torch.tensor([1, 0, 7]))
    assert torch.allclose(one_hot[0], torch.tensor([0.5, 0.0, 0.2]) / 0.7)
    assert torch.allclose(one_hot[2], q[2])  # a token beyond the width takes no mass


def test_host_values_read_several_tensors_in_one_transfer_exactly():
    tokens = torch.tensor([0, 151935, 2**40])
    signals = torch.tensor([0.125, float("inf")])
    with host_reads(pytest.MonkeyPatch()) as reads:
        got = host_values(tokens, signals)
    assert got == [[0.0, 151935.0, float(2**40)], [0.125, float("inf")]] and reads.reads == ["tolist"]


@pytest.mark.parametrize("params", [GREEDY, *SAMPLING], ids=["greedy", "t1", "t0.7-topk5-topp0.9"])
def test_the_device_side_maths_never_reads_a_tensor_on_the_host(params, monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(5, 32)
    logits[2, 3] = float("nan")  # a bad row takes the fallback path, still without a read
    draft = warp_probs(torch.randn(4, 30), SamplingParams(temperature=1.0))
    tokens = torch.tensor([1, 2, 3, 31])
    gen = torch.Generator().manual_seed(0)
    with host_reads(monkeypatch) as reads:
        probs = warp_probs(logits, params)
        pick(logits, params, gen)
        first_rejection(block_outcomes(tokens, draft, logits, params, gen))
        block_outcomes(tokens, None, logits, params, gen)
        mixed = [GREEDY, params]  # a batch of a greedy row and a row of these parameters, of different lengths
        batch_outcomes(torch.stack([tokens, tokens]), None, torch.stack([logits, logits]), mixed, [gen, gen], [4, 2])
        for signal in ("kl", "confidence"):
            Gate(signal).signals(soft_probs(logits[:4], params), draft, tokens)
        residual_rows(probs[:4], match_width(draft, 32), tokens)
    assert reads.reads == []


# ------------------------------------------------------------------------------------------- the session


def test_ids_fed_from_the_device_are_committed_like_host_ids():
    model = tiny_model("qwen2")
    host, device = KVSession(model), KVSession(model)
    want = host.forward([3, 4, 5, 6], keep=1)
    device.forward([3, 4], keep=1)
    got = device.forward(torch.tensor([5, 6]), keep=1)
    assert torch.allclose(got, want) and device.committed == 4
    device.learn([5, 6])  # told: no read needed
    assert device.tokens == [3, 4, 5, 6]
    device.forward(torch.tensor([7]))
    assert device.tokens == [3, 4, 5, 6, 7]  # not told: read from the device when asked for
    with pytest.raises(ValueError, match="one value per id"):
        device.forward(torch.tensor([8, 9]))
        device.learn([8])


# ------------------------------------------------------------------------------------- the decoders


def via_decoder(target, tok, drafter, slim=None, gate=None, cap=6):
    slim = LayerMask.skipping(4, [1]) if slim is None else slim
    return TieredDecoder(target, tok, drafter, [slim], RoundPolicy(gate or Gate("confidence", (0.02, 0.6)), cap=cap))


@pytest.mark.parametrize("params", [GREEDY, SAMPLING[1]], ids=["greedy", "sampling"])
def test_each_decision_reads_the_device_once_and_nothing_else_does(params, device_sampling, monkeypatch):
    """plain: one read per token; sd: one per proposal and one per verdict; via: one per proposal, one per slim
    view pass (gate signals and checks together), one per full verdict."""
    target, tok = tiny_model("llama"), tiny_tokenizer(64)
    small = tiny_model("llama", layers=2, seed=1)
    config = GenerationConfig(
        max_new_tokens=30, ignore_eos=True, sampling=SamplingParams(**{**params.__dict__, "seed": 5})
    )
    with host_reads(monkeypatch) as reads:
        out = PlainDecoder(target, tok).generate(PROMPT, config)
    assert len(reads.reads) == out.stats.new_tokens == 30
    with host_reads(monkeypatch) as reads:
        out = SpeculativeDecoder(target, tok, ModelDrafter(small), gamma=4).generate(PROMPT, config)
    assert len(reads.reads) == out.stats.rounds + out.stats.sources["model"].rounds
    with host_reads(monkeypatch) as reads:
        out = SpeculativeDecoder(target, tok, PromptLookupDrafter(), gamma=4).generate(PROMPT, config)
    assert len(reads.reads) == out.stats.rounds
    with host_reads(monkeypatch) as reads:
        out = via_decoder(target, tok, ModelDrafter(small), gate=Gate("kl", (0.05, math.inf))).generate(PROMPT, config)
    s = out.stats
    full_verdicts = s.target_calls  # the first round's pass reads the prompt and verifies its drafts
    assert len(reads.reads) == s.sources["model"].rounds + s.slim_calls + full_verdicts
    assert s.slim_calls > 0 and full_verdicts > 0 and s.tiers["accept"].decided + s.tiers["slim"].decided > 0
    assert set(reads.reads) == {"tolist"}  # every read is one host_values transfer


def test_greedy_on_the_device_path_still_equals_plain_with_every_drafter():
    """Greedy decisions are device-side on every device: the host path's one-hot rows are gone, the tokens not."""
    target, tok = tiny_model("gemma2"), tiny_tokenizer(64)
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config).tokens
    for drafter in (ModelDrafter(tiny_model("gemma2", layers=2, seed=1)), PromptLookupDrafter(), ModelDrafter(target)):
        assert SpeculativeDecoder(target, tok, drafter, gamma=3).generate(PROMPT, config).tokens == plain
    via = via_decoder(target, tok, ModelDrafter(target), slim=LayerMask.full(4), gate=Gate("kl", (-1.0, math.inf)))
    assert via.generate(PROMPT, config).tokens == plain


def test_exact_via_equals_sd_when_sampling_on_the_device_path(device_sampling):
    target, tok = tiny_model("qwen2"), tiny_tokenizer(64)
    small = tiny_model("qwen2", layers=2, seed=1)
    config = GenerationConfig(
        max_new_tokens=40, ignore_eos=True, sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    )
    sd = SpeculativeDecoder(target, tok, ModelDrafter(small), gamma=4).generate(PROMPT, config)
    via = TieredDecoder(
        target, tok, ModelDrafter(small), [LayerMask.skipping(4, [2])], RoundPolicy(Gate.exact(), gamma=4)
    )
    out = via.generate(PROMPT, config)
    assert out.tokens == sd.tokens and out.stats.target_calls == sd.stats.target_calls
    assert sd.stats.evaluated > sd.stats.accepted  # rejections happened: the residual draws were used


def law_setup():
    vocab, length = 6, 3
    target = tiny_model("qwen2", vocab_size=vocab, init_scale=0.15)
    small = tiny_model("qwen2", vocab_size=vocab, layers=2, seed=5, init_scale=0.15)
    return vocab, length, target, small, tiny_tokenizer(vocab), [2, 3, 4]


def test_sd_sampling_on_the_device_path_follows_the_target(device_sampling):
    vocab, length, target, small, tok, prompt = law_setup()
    params, n = SAMPLING[1], 1500
    counts, stats = sample_counts(
        SpeculativeDecoder(target, tok, ModelDrafter(small), gamma=2), prompt, params, length, n
    )
    assert sum(s.evaluated - s.accepted for s in stats) > n // 10
    assert pooled_pvalue(exact_joint(target, prompt, params, vocab, length), counts, n) > ALPHA


def test_a_slim_tier_that_is_the_target_samples_the_targets_law(device_sampling):
    """Relaxed VIA-SD with the full model as its slim view and no accept tier: every check and bonus comes from
    the slim view, whose law is the target's, so the output follows the target exactly."""
    vocab, length, target, small, tok, prompt = law_setup()
    params, n = SAMPLING[0], 1500
    via = TieredDecoder(
        target, tok, ModelDrafter(small), [LayerMask.full(4)], RoundPolicy(Gate("kl", (-1.0, math.inf)), gamma=2, cap=8)
    )
    counts, stats = sample_counts(via, prompt, params, length, n)
    assert sum(s.tiers["slim"].rejected for s in stats) > n // 10  # the residual draws were used
    assert pooled_pvalue(exact_joint(target, prompt, params, vocab, length), counts, n) > ALPHA
