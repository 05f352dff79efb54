"""Sampling parameters and the pure maths that turns logits into the distributions we sample from.

Two ways to pick a token: `sample` on the host (a Python int; the CPU path of sampling), and `pick` / `draw`
where the logits live, as a tensor, with no host sync (greedy decoding everywhere, sampling on accelerators).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from viasd.errors import ViasdError
from viasd.verify.grammar import Grammar, constrained
from viasd.verify.penalties import Penalties, penalised

# The seeds a torch generator accepts: any 64-bit integer, signed or unsigned.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
# Temperatures below this are greedy: sampling at them is argmax up to float rounding, and dividing
# logits by them overflows float32 (or, in transformers' warpers, turns the distribution into NaN).
GREEDY_BELOW = 1e-6
# What `draw` gives for a row that is not a finite distribution; the host refuses it when it reads the token.
BAD_TOKEN = -1
# The most likely tokens among which `nucleus` looks for a row's top-p nucleus first, and `draw` for a CPU row's
# whole support (a top-p row's nucleus is rarely larger; a larger one takes the slower path over the whole row).
NUCLEUS_CANDIDATES = 256


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 (or below GREEDY_BELOW) means greedy (argmax).

    min_p: tokens less likely than min_p times the most likely one (after the temperature) are dropped (0: off).
    penalties: adjust the logits by the tokens before each position first (verify/penalties.py).
    grammar: structured output; masks what it forbids after the penalties (verify/grammar.py; None: off).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    penalties: Penalties = field(default_factory=Penalties)
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ViasdError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ViasdError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_integer(self.top_k) or self.top_k < 0:
            raise ViasdError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and (not _is_integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ViasdError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {self.seed}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ViasdError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")

    def first_set(self) -> str | None:
        """The API name of the first parameter set beyond temperature, top-p, top-k and seed (min_p, the penalties,
        response_format), for methods that honour only those; None when there is none."""
        if self.min_p:
            return "min_p"
        return self.penalties.first_set() or ("response_format" if self.grammar is not None else None)

    @property
    def adjusts(self) -> bool:
        """Whether the logits are adjusted by the tokens before each position (penalties or a grammar)."""
        return not self.penalties.neutral or self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh random generator on `device`, seeded when a seed is given."""
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen

    def on_device(self, device: torch.device) -> bool:
        """Whether tokens are picked where the logits live (`pick`, verify/resident.py), else on the host.

        Greedy decoding always is: argmax comparisons give the tokens the host path gave, without its one-hot
        probability rows. Sampling is on any device but the CPU, where host decisions would wait for the device
        at every token; on the CPU sampling keeps its host path, and with it the draws (and seeded outputs) it
        always made.
        """
        return self.greedy or device.type != "cpu"


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def adjusted(
    logits: torch.Tensor, params: SamplingParams, context: Sequence[int], drafts: Sequence[int] | torch.Tensor = ()
) -> torch.Tensor:
    """`logits` [n, V] adjusted by the tokens before each row's position: the penalties, then the grammar's mask
    (rows placed as `penalties.penalised` places them)."""
    return constrained(penalised(logits, params.penalties, context, drafts), params.grammar, context, drafts)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of `logits` [n, V] (NaN counts as lowest): token ids [n], where the logits are."""
    return logits.float().nan_to_num(nan=float("-inf")).argmax(dim=-1)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """One-hot rows at the argmax of each row of `logits` [n, V] (NaN counts as lowest), float32."""
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return probs.scatter_(-1, greedy_tokens(logits)[:, None], 1.0)


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distributions to sample from, rows of `logits` [n, V] -> probs [n, V] (float32).

    Greedy gives one-hot rows at the argmax, so speculative sampling on them reduces to exact matching.
    Every row is a finite distribution: the largest score is shifted to 0 before dividing by the
    temperature (so tiny temperatures cannot overflow), top-p keeps at least the most likely token, and
    a row that still has no finite mass (NaN logits) falls back to its argmax. Order: temperature, min-p, top-k,
    top-p (as vLLM).
    """
    logits = logits.float()
    if params.greedy:
        return one_hot_argmax(logits)
    scores = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    if params.min_p > 0.0:
        # p(v) >= min_p * p(top) <=> score(v) >= log(min_p), the top score being 0; the top token always stays.
        scores = scores.masked_fill(scores < math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = nucleus(scores, params.top_p)
    probs = scores.softmax(dim=-1)
    bad = ~torch.isfinite(probs).all(dim=-1) | ~(probs.sum(dim=-1) > 0)
    return torch.where(bad[:, None], one_hot_argmax(logits), probs)  # no host sync: the rows are picked on the device


def nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """`scores` [n, V] with every token outside each row's top-p nucleus set to -inf: a token is dropped when the
    tokens more likely than it already hold top_p of the mass; the most likely token always stays (a top_p below
    float32's smallest number would otherwise drop it too).

    On a CPU the nucleus is looked for among the NUCLEUS_CANDIDATES best tokens of each row first (a partial
    selection: sorting rows of 150k scores costs about forty times as much): the tokens past them are dropped
    exactly when they reach top_p. Elsewhere, or where they do not, the whole rows are sorted (no host read)."""
    ranked = _ranked_candidates(scores, top_p) if scores.device.type == "cpu" else None
    if ranked is None:
        best, order = torch.sort(scores, dim=-1, descending=True)
        probs = best.softmax(dim=-1)
    else:
        probs, order = ranked
    keep = (probs.cumsum(dim=-1) - probs) < top_p
    keep[..., 0] = True
    kept = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, order, keep)
    return scores.masked_fill(~kept, float("-inf"))


def _ranked_candidates(scores: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The probabilities and ids of each row's best NUCLEUS_CANDIDATES tokens, most likely first, where they hold
    top_p of every row's mass; None where some row's nucleus may reach past them."""
    if scores.shape[-1] <= NUCLEUS_CANDIDATES:
        return None
    best, order = torch.topk(scores, NUCLEUS_CANDIDATES, dim=-1)
    probs = (best - scores.logsumexp(dim=-1, keepdim=True)).exp()
    return (probs, order) if bool((probs.sum(dim=-1) >= top_p).all()) else None


def soft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Smooth distributions for confidence gates: softmax at the sampling temperature (1 when greedy)."""
    temperature = params.temperature if not params.greedy else 1.0
    logits = logits.float()
    return ((logits - logits.amax(dim=-1, keepdim=True)) / temperature).softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from a single distribution [V]; refuses one that is not a finite distribution."""
    if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0:
        raise ViasdError("cannot sample: the token distribution is not finite (the model produced NaN or inf logits)")
    if (probs > 0).sum() == 1:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [n, V], drawn where the rows live, without waiting for the device.

    The exponential race: argmax_v p(v) / E_v with E_v ~ Exp(1) is v with probability p(v) / sum p, which is how
    torch.multinomial draws one sample, less its validity checks (they read the tensor on the host; on a CPU, where
    there is no device to wait for, the race may run over each row's best candidates). A row that is not a finite
    distribution with some mass gives BAD_TOKEN instead (the host refuses it on reading).
    """
    ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    rows = torch.where(ok[:, None], probs, 1.0)
    if rows.device.type == "cpu" and rows.shape[-1] > NUCLEUS_CANDIDATES:
        # A token of probability 0 never wins the race, so where every row's support lies among its best
        # candidates (top-p, top-k, min-p rows) the race runs over those alone: an exponential for each of 150k
        # tokens costs a CPU more than the pass that made the logits. The host reads one flag to know.
        best, order = torch.topk(rows, NUCLEUS_CANDIDATES, dim=-1)
        if bool((best[:, -1] == 0).all()):
            race = torch.empty_like(best).exponential_(generator=generator).clamp_min(torch.finfo(best.dtype).tiny)
            won = order.gather(-1, (best / race).argmax(dim=-1, keepdim=True))[:, 0]
            return torch.where(ok, won, BAD_TOKEN)
    race = torch.empty_like(rows).exponential_(generator=generator).clamp_min(torch.finfo(rows.dtype).tiny)
    return torch.where(ok, (rows / race).argmax(dim=-1), BAD_TOKEN)


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Token ids [n] for the rows of `logits` [n, V], where they live: the argmax when greedy, else a `draw` from
    the warped distribution."""
    return greedy_tokens(logits) if params.greedy else draw(warp_probs(logits, params), generator)


def checked_token(value: float) -> int:
    """A token id read from the device, refused in one line when a draw found no finite distribution."""
    token = int(value)
    if token < 0:
        raise ViasdError("cannot sample: the token distribution is not finite (the model produced NaN or inf logits)")
    return token
