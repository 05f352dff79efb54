"""One round, two players: the calibration replay, fed the records of a greedy generation, plays exactly the
rounds the tiered decoder played (so a profile is chosen by the rules the decoder follows)."""

import copy
from dataclasses import asdict

import pytest
import torch

from helpers import Recording
from tiny import tiny_model, tiny_tokenizer
from viasd.calibration.records import gate_records
from viasd.calibration.replay import replay
from viasd.calibration.teacher import model_logits, slim_logits, teacher_force
from viasd.decode.base import GenerationConfig
from viasd.decode.round import RoundPolicy
from viasd.decode.tiered import TieredDecoder
from viasd.drafters.model_drafter import ModelDrafter
from viasd.verify.gates import Gate
from viasd.views.layer_skip import LayerMask

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12]
LAYERS = 6
# Records along the committed sequence hold what the decoder saw as long as every token a lower tier keeps is the
# target's: a wrong token kept and then corrected by a full pass in the same round would have conditioned the
# gate's later signals on a prefix that the final sequence does not contain. Slim views that agree with the target
# (here: every layer) make that so, while the rules of the round (gate, cap, pre-gate, bonus, tiers) are all played.
FULL = LayerMask.full(LAYERS)


def pair():
    """A target and a drafter close to it (the target's weights, slightly perturbed): they agree on most tokens."""
    target, drafter = tiny_model("qwen2", layers=LAYERS), tiny_model("qwen2", layers=LAYERS)
    noise = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(0.002 * torch.randn(param.shape, generator=noise, dtype=param.dtype))
    return target, drafter


def honest_pair():
    """A target and a drafter that is sure where it is right and unsure where it is wrong: the target's own logits,
    sharpened, except after tokens divisible by 4, where its two best tokens swap and it flattens its distribution.
    Its logits at a position depend only on the token there, so cached decoding and teacher forcing agree."""
    target = tiny_model("qwen2", layers=LAYERS)
    drafter = copy.deepcopy(target)
    seen: dict[str, torch.Tensor] = {}

    def keep_ids(module, args, kwargs):
        seen["ids"] = kwargs["input_ids"]

    def reshape(module, args, logits):
        ids = seen["ids"][:, -logits.shape[1] :]
        top2 = logits.topk(2, dim=-1).indices
        swapped = logits.scatter(-1, top2, logits.gather(-1, top2.flip(-1)))
        return torch.where((ids % 4 == 0)[..., None], swapped / 10.0, logits * 5.0)

    drafter.register_forward_pre_hook(keep_ids, with_kwargs=True)
    drafter.lm_head.register_forward_hook(reshape)
    return target, drafter


def records_of(target, drafter, tokens, masks):
    """Gate records of the predictions of each generated token (the first is made at the prompt's last position)."""
    seq = teacher_force(target, PROMPT + tokens[:-1], len(PROMPT) - 1)
    views = [slim_logits(target, mask, seq, chunk=4) for mask in masks]
    return gate_records(model_logits(drafter, seq.ids, seq.start), views, seq.full_logits)


@pytest.mark.parametrize(
    ("slims", "policy"),
    [
        (1, RoundPolicy(Gate("kl", (0.01, 0.05)), gamma=4, cap=12)),
        (1, RoundPolicy(Gate("confidence", (0.0, 0.5)), gamma=3, cap=5)),
        (2, RoundPolicy(Gate("kl", (0.01, 0.03, 0.1)), gamma=5, cap=16)),
    ],
    ids=["kl", "confidence", "two-slim-tiers"],
)
def test_replay_of_a_greedy_generation_plays_the_decoders_rounds(slims, policy):
    target, drafter = pair()
    masks = [FULL] * slims
    decoder = TieredDecoder(target, tiny_tokenizer(64), ModelDrafter(drafter), masks, policy)
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=80, ignore_eos=True))
    played = replay([records_of(target, drafter, out.tokens, masks)], policy)
    assert played.errors == 0  # the condition above: no lower tier kept a token the target would not have chosen
    want, got = out.stats, played.stats
    counts = ("new_tokens", "rounds", "target_calls", "drafted", "evaluated", "accepted", "unchecked_tokens")
    assert {k: getattr(got, k) for k in counts} == {k: getattr(want, k) for k in counts}
    assert {n: asdict(t) for n, t in got.tiers.items()} == {n: asdict(t) for n, t in want.tiers.items()}
    # Every tier had work to do, or the comparison would prove little.
    assert all(t.decided > 0 for t in want.tiers.values()), want.tiers


def test_a_pregate_that_doubts_every_draft_plays_classic_sd_rounds_in_both():
    # The pre-gate judges a whole block, whose later drafts follow earlier ones that may be wrong, while records
    # follow the final sequence: the replay's pre-gate is exact only where that does not matter, as here.
    target, drafter = pair()
    policy = RoundPolicy(Gate("kl", (0.01, 0.05)), gamma=4, cap=12, pregate=1.0)
    out = TieredDecoder(target, tiny_tokenizer(64), ModelDrafter(drafter), [FULL], policy).generate(
        PROMPT, GenerationConfig(max_new_tokens=40, ignore_eos=True)
    )
    played = replay([records_of(target, drafter, out.tokens, [FULL])], policy)
    assert (played.stats.rounds, played.stats.target_calls, played.stats.slim_calls) == (
        out.stats.rounds, out.stats.target_calls, 0
    )  # fmt: skip
    assert played.stats.tiers["full"] == out.stats.tiers["full"]


@pytest.mark.parametrize(
    "policy",
    [RoundPolicy(Gate("confidence", (0.0, 0.5)), gamma=6, cap=12, stop=0.7), RoundPolicy(Gate.exact(), 6, stop=0.7)],
    ids=["via", "classic-sd"],
)
def test_replay_with_a_draft_stop_threshold_plays_the_decoders_rounds(policy):
    """The drafter stops drafting after a token it is unsure of, and the replay stops where the records say it
    would, by the same rule (`drafters.base.stops_after`). The records hold the drafter's confidence along the
    committed sequence, so the replay is exact while no round drafts on past a wrong draft (its confidence after
    one is not recorded); a drafter that is unsure exactly where it is wrong makes that so."""
    target, drafter = honest_pair()
    recording = Recording(ModelDrafter(drafter))
    decoder = TieredDecoder(target, tiny_tokenizer(64), recording, [FULL], policy)
    out = decoder.generate(PROMPT, GenerationConfig(max_new_tokens=80, ignore_eos=True))
    played = replay([records_of(target, drafter, out.tokens, [FULL])], policy)
    assert played.errors == 0
    want, got = out.stats, played.stats
    counts = ("new_tokens", "rounds", "target_calls", "drafted", "evaluated", "accepted", "unchecked_tokens")
    assert {k: getattr(got, k) for k in counts} == {k: getattr(want, k) for k in counts}
    assert {n: asdict(t) for n, t in got.tiers.items()} == {n: asdict(t) for n, t in want.tiers.items()}
    # The threshold cut rounds short and let others run long; drafts were rejected; in VIA-SD every tier decided.
    assert any(n < k for k, n, _ in recording.rounds) and any(n > 3 for _, n, _ in recording.rounds)
    assert want.evaluated > want.accepted
    assert policy.gate.always_full or all(t.decided > 0 for t in want.tiers.values()), want.tiers
