"""VIA-SD tiered decoding: exact mode, gate routing on constructed distributions, caps, N tiers, caches."""

import math

import pytest
import torch

from helpers import ATOL, assert_cache_equals, fresh_cache
from tiny import tiny_model, tiny_tokenizer
from viasd.decode.base import GenerationConfig
from viasd.decode.plain import PlainDecoder
from viasd.decode.round import Round, RoundPolicy, play_round
from viasd.decode.speculative import SpeculativeDecoder
from viasd.decode.tiered import SlimViews, TieredDecoder
from viasd.drafters.base import Proposal
from viasd.drafters.model_drafter import ModelDrafter
from viasd.errors import ViasdError
from viasd.verify.gates import Gate, confidence_signal, draft_confidence, kl_signal
from viasd.verify.sampling import SamplingParams
from viasd.views.layer_skip import LayerMask

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12]
GREEDY = SamplingParams()


def onehot_logits(rows: list[int], vocab: int = 8, sharp: float = 30.0) -> torch.Tensor:
    out = torch.zeros(len(rows), vocab)
    for i, r in enumerate(rows):
        out[i, r] = sharp
    return out


def proposal(tokens: list[int], vocab: int = 8) -> Proposal:
    soft = onehot_logits(tokens, vocab, sharp=30.0).softmax(-1)
    return Proposal(tokens, onehot_logits(tokens, vocab).softmax(-1).round(), soft)


GEN = torch.Generator().manual_seed(0)


class ConstructedRound:
    """A round's parts over a fixed proposal and constructed slim logits; the full target is not run: a round
    that reaches it commits the marker -1."""

    def __init__(self, prop: Proposal, gate: Gate, *tiers: torch.Tensor) -> None:
        self.prop = prop
        self.calls: list[int] = []

        def view(j: int) -> torch.Tensor:
            self.calls.append(j)
            return tiers[j - 1]

        self.slim = SlimViews(prop, view, gate, GREEDY, GEN)
        self.signals, self.check, self.bonus = self.slim.signals, self.slim.check, self.slim.bonus
        self.gate = gate

    def judged(self):
        return self.gate.judges(self.prop.soft)

    def draft(self, k):
        return self.prop.tokens[:k], draft_confidence(self.prop.soft)

    def verify(self):
        return [-1], 0


def settle(prop: Proposal, gate: Gate, *tiers: torch.Tensor, budget: int = 32) -> tuple[Round, list[int]]:
    parts = ConstructedRound(prop, gate, *tiers)
    return play_round(RoundPolicy(gate, gamma=len(prop), cap=budget), parts, len(prop), 0), parts.calls


def test_all_accepted_takes_the_bonus_from_the_slim_view():
    out, calls = settle(proposal([1, 2, 3]), Gate("kl", (0.5, 5.0)), onehot_logits([1, 2, 3, 5]))
    assert out.committed == [1, 2, 3, 5] and out.settled == (0, 0, 0) and not out.full
    assert set(calls) == {1} and (out.evaluated, out.accepted) == (3, 3)


def test_slim_tier_rejection_regenerates_from_the_slim_view():
    # Signals are moderate (slim less sure than the drafter) -> slim tier; slim's argmax differs at position 1.
    slim = onehot_logits([1, 4, 3, 5], sharp=4.0)
    out, _ = settle(proposal([1, 2, 3]), Gate("kl", (1e-3, 100.0)), slim)
    assert out.committed == [1, 4] and out.settled == (1, 1) and out.slim_rejected
    assert (out.evaluated, out.accepted) == (2, 1)


def test_uncertain_first_token_goes_to_the_full_target():
    slim = torch.zeros(3, 8)  # uniform slim distribution: far from a confident drafter
    out, _ = settle(proposal([1, 2]), Gate("kl", (0.5, 1.0)), slim)
    assert out.full and out.committed == [-1] and out.views == (1,) and out.settled == ()


def test_last_token_routed_to_full_discards_the_round():
    slim = onehot_logits([1, 2, 3, 4])
    slim[2] = 0.0  # last draft position uncertain
    out, _ = settle(proposal([1, 2, 3]), Gate("kl", (0.5, 1.0)), slim)
    assert out.full and out.committed == [-1]


def test_cap_forces_the_full_tier():
    out, _ = settle(proposal([1, 2, 3]), Gate("kl", (0.5, 5.0)), onehot_logits([1, 2, 3, 5]), budget=3)
    # Token 0 and 1 can be committed (with the closing token that makes 3); token 2 would exceed it.
    assert out.full
    out, _ = settle(proposal([1, 2, 3]), Gate("kl", (0.5, 5.0)), onehot_logits([1, 2, 3, 5]), budget=4)
    assert out.committed == [1, 2, 3, 5]
    # With room for fewer than 2 tokens the round goes straight to the full target: no slim pass at all.
    out, calls = settle(proposal([1, 2, 3]), Gate("kl", (0.5, 5.0)), onehot_logits([1, 2, 3, 5]), budget=1)
    assert out.full and out.views == () and calls == []


def test_confidence_gate_and_signals():
    slim = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    assert torch.allclose(confidence_signal(slim, None, [0, 2]), torch.tensor([0.0, 0.5]))
    assert kl_signal(slim, None, [0, 2]).isinf().all()
    assert torch.allclose(kl_signal(slim, slim, [0, 1]), torch.zeros(2), atol=1e-6)
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]]))
    prop = Proposal([0, 2], None, None)  # model-free drafter: only the confidence gate can clear it
    out, _ = settle(prop, Gate("confidence", (0.1, 0.6)), logits)
    # token 0: confidence 0 -> accept; token 2: 0.5 -> slim tier, greedy check fails -> regenerate argmax 1
    assert out.committed == [0, 1] and out.settled == (0, 1) and out.slim_rejected
    with pytest.raises(ViasdError, match="signal"):
        Gate("entropy", (1.0,))
    with pytest.raises(ViasdError, match="decrease"):
        Gate("kl", (2.0, 1.0))


def test_deeper_slim_tier_runs_only_when_reached():
    shallow = onehot_logits([1, 2, 3, 5], sharp=3.0)
    deep = onehot_logits([1, 2, 6, 5])
    prop = proposal([1, 2, 3])
    out, calls = settle(prop, Gate("kl", (1e-4, 1e-4, 100.0)), shallow, deep)
    # Every signal lands in tier 2 (thresholds 1e-4, 1e-4, 100): the deep view decides and rejects 3 -> 6.
    assert out.committed == [1, 2, 6] and out.settled == (2, 2, 2) and set(calls) == {1, 2} and out.views == (1, 2)
    out, calls = settle(prop, Gate("kl", (1e-4, 100.0, 100.0)), shallow, deep)
    assert out.committed == [1, 2, 3, 5] and 2 not in calls


def make(arch="llama"):
    target, tok = tiny_model(arch), tiny_tokenizer(64)
    drafter = ModelDrafter(tiny_model(arch, layers=2, seed=1))
    return target, tok, drafter


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.95, seed=11)], ids=["greedy", "sample"]
)
def test_exact_mode_reproduces_classic_sd(arch, params):
    target, tok, drafter = make(arch)
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True, sampling=params)
    sd = SpeculativeDecoder(target, tok, drafter, gamma=4).generate(PROMPT, config)
    via = TieredDecoder(target, tok, drafter, [LayerMask.skipping(4, [2])], RoundPolicy(Gate.exact(), gamma=4))
    out = via.generate(PROMPT, config)
    assert out.tokens == sd.tokens
    assert out.stats.target_calls == sd.stats.target_calls and out.stats.slim_calls == 0
    assert out.stats.unchecked_tokens == 0


def test_full_mask_slim_tier_is_lossless_and_catches_up_lazily():
    """With the full model as 'slim' view and no accept tier, relaxed VIA-SD is exact in greedy mode,
    while most rounds end without a full-target call (exercising the lazy catch-up and the cap)."""
    target, tok, drafter = make("qwen2")
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    for cap in (3, 8, 100):
        via = TieredDecoder(
            target, tok, drafter, [LayerMask.full(4)], RoundPolicy(Gate("kl", (-1.0, math.inf)), cap=cap)
        )
        out = via.generate(PROMPT, config)
        assert out.tokens == plain.tokens, f"cap={cap}"
        assert out.stats.unchecked_tokens > 0 and out.stats.tiers["slim"].decided > 0
        assert out.stats.target_calls < plain.stats.target_calls
    assert out.stats.target_calls <= 2  # the first round (it reads the prompt) and the last single-token step


def test_n_tier_with_a_degenerate_extra_tier_equals_three_tiers():
    target, tok, drafter = make("llama")
    slim = LayerMask.skipping(4, [1, 2])
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=3))
    three = TieredDecoder(target, tok, drafter, [slim], RoundPolicy(Gate("confidence", (0.05, 0.5))))
    four = TieredDecoder(
        target, tok, drafter, [slim, LayerMask.skipping(4, [2])], RoundPolicy(Gate("confidence", (0.05, 0.5, 0.5)))
    )
    three, four = three.generate(PROMPT, config), four.generate(PROMPT, config)
    assert four.tokens == three.tokens
    assert (
        four.stats.tiers["slim2"].decided == 0
        and four.stats.tiers["slim1"].decided == three.stats.tiers["slim"].decided
    )


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_target_cache_equals_fresh_pass_after_relaxed_rounds(arch):
    target, tok, drafter = make(arch)
    policy = RoundPolicy(Gate("confidence", (0.02, 0.6)), cap=6)
    via = TieredDecoder(target, tok, drafter, [LayerMask.skipping(4, [1])], policy)
    for n in (5, 17, 30):
        out = via.generate(PROMPT, GenerationConfig(max_new_tokens=n, ignore_eos=True))
        assert out.stats.tiers["slim"].decided + out.stats.tiers["accept"].decided > 0
        session = via.session
        assert session.tokens == (PROMPT + out.tokens)[: len(session.tokens)]
        assert_cache_equals(
            session.cache, fresh_cache(target, session.tokens), len(session.tokens), atol=ATOL.get(arch, 1e-10)
        )


def test_eos_inside_a_slim_block_ends_the_output():
    target, tok, _ = make("qwen2")
    gate = Gate("kl", (-1.0, math.inf))
    long = PlainDecoder(target, tok).generate(PROMPT, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    eos = long.tokens[5]
    target.generation_config.eos_token_id = eos
    tok.eos_token = f"t{eos}"
    out = TieredDecoder(target, tok, ModelDrafter(target), [LayerMask.full(4)], RoundPolicy(gate)).generate(
        PROMPT, GenerationConfig(max_new_tokens=30)
    )
    assert out.tokens == long.tokens[: long.tokens.index(eos)] and out.finish_reason == "eos"


def test_bad_configurations_are_refused():
    target, tok, drafter = make("llama")
    with pytest.raises(ViasdError, match="thresholds"):
        TieredDecoder(target, tok, drafter, [LayerMask.skipping(4, [1])], RoundPolicy(Gate("kl", (0.1, 0.2, 0.3))))
    with pytest.raises(ViasdError, match="cap"):
        RoundPolicy(Gate(), cap=0)
    with pytest.raises(ViasdError, match="pre-gate"):
        RoundPolicy(Gate(), pregate=1.5)


def test_draft_confidence_is_the_least_top_probability_and_the_pregate_judges_by_it():
    soft = torch.tensor([[0.9, 0.1], [0.55, 0.45], [0.8, 0.2]])
    assert draft_confidence(soft) == pytest.approx(0.55)
    assert draft_confidence(None) is None and draft_confidence(soft[:0]) is None
    policy = RoundPolicy(Gate(), pregate=0.6)
    assert not policy.tries_lower_tiers(3, 0, 0.55) and policy.tries_lower_tiers(3, 0, 0.65)
    assert policy.tries_lower_tiers(3, 0, None)  # no distributions (prompt lookup): the pre-gate cannot judge
    assert RoundPolicy(Gate()).tries_lower_tiers(3, 0, 0.01)  # pre-gate off
    assert not RoundPolicy(Gate.exact()).tries_lower_tiers(3, 0, 1.0) and not policy.tries_lower_tiers(0, 0, 1.0)


def test_pregate_sends_doubtful_rounds_straight_to_the_full_target():
    target, tok, drafter = make("qwen2")
    mask, gate = [LayerMask.skipping(4, [1])], Gate("confidence", (0.02, 0.6))
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    sd = SpeculativeDecoder(target, tok, drafter, gamma=4).generate(PROMPT, config)

    def via(pregate: float):
        return TieredDecoder(target, tok, drafter, mask, RoundPolicy(gate, gamma=4, pregate=pregate))

    # Every drafter distribution has a top probability below 1: pregate 1 skips every slim pass, which is classic SD.
    always = via(1.0).generate(PROMPT, config)
    assert always.tokens == sd.tokens and always.stats.slim_calls == 0 and always.stats.unchecked_tokens == 0
    assert always.stats.target_calls == sd.stats.target_calls  # sd's rounds: the first reads the prompt as sd's does
    free, some = via(0.0).generate(PROMPT, config), via(0.3).generate(PROMPT, config)
    assert 0 < some.stats.slim_calls < free.stats.slim_calls


def test_a_task_kinds_own_policy_routes_its_requests():
    """A profile's stricter policy for code: with the exact gate for code, a code request gets plain greedy decoding's
    tokens with nothing unchecked, while prose requests keep the relaxed policy (and leave tokens unchecked)."""
    target, tok, drafter = make("llama")
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    relaxed = RoundPolicy(Gate("confidence", (0.3, 0.9)), cap=16)
    kinds = {"code": RoundPolicy(Gate.exact(), gamma=4)}
    slims = [LayerMask.skipping(4, [1, 2])]
    code = TieredDecoder(target, tok, drafter, slims, relaxed, kinds=kinds, kind="code").generate(PROMPT, config)
    assert code.tokens == plain.tokens and code.stats.unchecked_tokens == 0 and code.stats.task_kind == "code"
    prose = TieredDecoder(target, tok, drafter, slims, relaxed, kinds=kinds, kind="prose").generate(PROMPT, config)
    assert prose.stats.unchecked_tokens > 0 and prose.stats.task_kind == "prose"
    read = TieredDecoder(target, tok, drafter, slims, relaxed, kinds=kinds)  # no kind given: read from the prompt
    assert read.routing(PROMPT) == ("prose", relaxed)  # the tiny vocabulary's words t0..t63 read as prose


def test_a_kl_gate_sends_copied_drafts_to_the_full_target_without_a_slim_pass():
    """Prompt lookup drafts have no distributions, so a KL gate cannot judge them: their rounds are classic SD (the
    target's tokens, nothing unchecked) and spend no slim pass; a confidence gate needs only the slim view's."""
    from viasd.drafters.prompt_lookup import PromptLookupDrafter

    target, tok, _ = make("llama")
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    lookup = PromptLookupDrafter(3, 1)
    slims = [LayerMask.skipping(4, [1])]
    kl = TieredDecoder(target, tok, lookup, slims, RoundPolicy(Gate("kl", (0.5, 10.0)), gamma=4)).generate(
        PROMPT, config
    )
    assert kl.stats.drafted > 0, "the lookup drafter must have drafted for this test to mean anything"
    assert kl.tokens == plain.tokens and kl.stats.slim_calls == 0 and kl.stats.unchecked_tokens == 0
    confidence = RoundPolicy(Gate("confidence", (0.3, 0.9)), gamma=4)
    judged = TieredDecoder(target, tok, lookup, slims, confidence).generate(PROMPT, config)
    assert judged.stats.slim_calls > 0
    policy = RoundPolicy(Gate("kl", (0.5, 10.0)))
    assert not policy.tries_lower_tiers(3, 0, None, judged=Gate("kl").judges(None))
    assert Gate("confidence").judges(None) and Gate("kl").judges(torch.ones(1, 4))


def test_a_task_kind_may_verify_on_slim_views_of_its_own():
    """A kind's own slim view serves that kind's requests only: code checked by the full-mask view (the target
    itself, so greedy output is the target's) while prose keeps the profile's skipping view (and differs)."""
    target, tok, drafter = make("qwen2")
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain = PlainDecoder(target, tok).generate(PROMPT, config)
    checked = RoundPolicy(Gate("kl", (-1.0, math.inf)), cap=16)  # no accept tier: every token checked by a view

    def via(kind: str) -> TieredDecoder:
        skipping, full = [LayerMask.skipping(4, [1, 2])], [LayerMask.full(4)]
        return TieredDecoder(
            target, tok, drafter, skipping, checked, kinds={"code": checked}, kind=kind, kind_slims={"code": full}
        )

    code, prose = via("code").generate(PROMPT, config), via("prose").generate(PROMPT, config)
    assert code.tokens == plain.tokens and code.stats.tiers["slim"].decided > 0
    assert prose.tokens != plain.tokens, "the skipping view must differ from the target for this test to mean anything"
    assert "slim_views_code" in via("code").describe()
    with pytest.raises(ViasdError, match=r"2 slim tier\(s\) need 3 gate thresholds, got 2"):
        TieredDecoder(
            target,
            tok,
            drafter,
            [LayerMask.full(4)],
            checked,
            kinds={"code": checked},
            kind_slims={"code": [LayerMask.full(4), LayerMask.full(4)]},
        )
    with pytest.raises(ViasdError, match="without a policy of their own: maths"):
        TieredDecoder(target, tok, drafter, [LayerMask.full(4)], checked, kind_slims={"maths": [LayerMask.full(4)]})


def test_over_a_quantized_view_of_the_target_via_verifies_against_that_view():
    """`view` is the full target (a profile calibrated on the file's blocks verifies against them): exact mode gives
    classic sd's tokens over the same view, and a slim tier that is the view itself, unskipped, is lossless with
    respect to it."""
    from viasd.views.quantize import quantize
    from viasd.views.recipe import QuantRecipe
    from viasd.views.view import View

    target, tok, drafter = make("qwen2")
    base = View(linears=quantize(target, QuantRecipe.parse("int8")))
    config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    sd = SpeculativeDecoder(target, tok, drafter, gamma=4, view=base).generate(PROMPT, config)
    exact = TieredDecoder(
        target, tok, drafter, [View(mask=LayerMask.skipping(4, [2]), linears=base.linears)],
        RoundPolicy(Gate.exact(), gamma=4), view=base,
    ).generate(PROMPT, config)  # fmt: skip
    assert exact.tokens == sd.tokens and exact.stats.target_calls == sd.stats.target_calls
    plain = PlainDecoder(target, tok, view=base).generate(PROMPT, config)
    relaxed = TieredDecoder(
        target, tok, drafter, [View(mask=LayerMask.full(4), linears=base.linears)],
        RoundPolicy(Gate("kl", (-1.0, math.inf)), cap=8), view=base,
    )  # fmt: skip
    out = relaxed.generate(PROMPT, config)
    assert out.tokens == plain.tokens and out.stats.tiers["slim"].decided > 0
    assert relaxed.session.base_view == base
