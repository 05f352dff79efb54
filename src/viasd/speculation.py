"""The settings of a speculative round, each with its one default and its one check.

Every place that takes one of these settings from a user (a method's option, `--gamma`, a routing profile's file,
`viasd calibrate` and `viasd project`) checks it here, once, where it enters; the decoders, drafters and policies
built from it take it as checked. Free of torch: the method registry parses names before any model loads.
"""

from __future__ import annotations

from viasd.errors import ViasdError

MAX_GAMMA = 64  # draft tokens per round: far beyond any useful block, small enough to refuse a typo
# Draft tokens per round unless a method, its routing profile or the target's tile says otherwise (a dense target on
# the native bf16 kernel drafts more: methods/drafting.py, `round_gamma`).
DEFAULT_GAMMA = 4
# sd's draft stop threshold, chosen from counts on the development prompts (BENCHMARKS.md, "Drafts that adapt"):
# it cuts the drafts that no verifier looks at from 21.5% to 7.3% and is estimated 1.11x faster in decoding.
DEFAULT_STOP = 0.5
LOOKUP_MATCH = 1  # the lookup method's shortest match (prompt lookup as published: any n-gram from 3 down to 1)
# The hybrid drafter copies when the context's tail matches at least this many tokens earlier (2-token matches
# copied nothing right in HumanEval answers: 11 rounds, 0 tokens kept).
HYBRID_MATCH = 3
LONGEST_MATCH = 3  # the longest n-gram prompt lookup tries first (a longer shortest match raises it)
MAX_MATCH = 16
# Budget tokens per prompt token for the hybrid to use its model drafter (drafters.hybrid.uses_model): on the
# 2-core CPU its prefill costs about 3.3 ms per prompt token (2.6 s for 800 tokens) and it saves about 80 ms per
# generated token (a 0.24 s target step against sd's 0.16 s per token), so it pays back after 0.04 answer tokens
# per prompt token; twice that, for answers that use half their budget.
HYBRID_BUDGET = 0.08
# The most tokens a suffix drafter copies in a round from a long match (drafters/suffix.py): a match of m tokens
# drafts up to m, past gamma. The verification pass then reads reach + 1 tokens: at most 16
# (kernels/packed_attention.py, PACK_UP_TO), the longest pass viasd's fused layers run, whose rows are the same bits
# in any block; a longer one runs torch's attention, rounds otherwise, and a greedy output could part from plain
# decoding's (a bench of drafts of 16 did, on 3 of 13 edit tasks).
MAX_REACH = 15
DEFAULT_REACH = MAX_REACH
# Tokens of finished generations (prompts and answers) an engine's suffix drafters also copy from: about 40 requests
# of 1,600 tokens; 0 turns it off. Token ids only, in memory, for the engine's life (docs/serving.md).
DEFAULT_SUFFIX_CACHE = 1 << 16


def check_gamma(gamma: int, name: str = "the draft length gamma") -> int:
    """`gamma` when it is a draft length every decoder takes (1..MAX_GAMMA), else a one-line ViasdError naming it
    as the user gave it (`--gamma`, ...). 0 must not pass: decoders read a falsy gamma as unset."""
    if not 1 <= gamma <= MAX_GAMMA:
        raise ViasdError(f"{name} must be in 1..{MAX_GAMMA}, got {gamma}")
    return gamma


def check_stop(stop: float, name: str = "the draft stop threshold") -> float:
    """A draft stop threshold (a drafter probability; 0: off), refused in one line when out of range."""
    if not 0.0 <= stop <= 1.0:  # NaN fails too
        raise ViasdError(f"{name} must be a probability in [0, 1], got {stop}")
    return stop


def check_match(match: int, name: str = "the shortest lookup match") -> int:
    """The shortest n-gram that prompt lookup copies from (1..MAX_MATCH)."""
    if not 1 <= match <= MAX_MATCH:
        raise ViasdError(f"{name} must be in 1..{MAX_MATCH}, got {match}")
    return match


def check_budget(budget: float, name: str = "the hybrid's budget") -> float:
    """Budget tokens per prompt token below which the hybrid leaves its model drafter out (>= 0; 0: never)."""
    if not 0.0 <= budget < float("inf"):  # NaN fails too
        raise ViasdError(f"{name} must be a number >= 0, got {budget}")
    return budget


def check_reach(reach: int, name: str = "the suffix drafter's reach") -> int:
    """The most tokens a suffix drafter copies in a round (1..MAX_REACH: its verification stays on the fused passes)."""
    if not 1 <= reach <= MAX_REACH:
        raise ViasdError(f"{name} must be in 1..{MAX_REACH}, got {reach}")
    return reach


def check_suffix_cache(tokens: int, name: str = "the suffix cache") -> int:
    """Tokens of earlier generations a suffix drafter may copy from (>= 0; 0: off)."""
    if tokens < 0:
        raise ViasdError(f"{name} must be a number of tokens >= 0 (0 turns it off), got {tokens}")
    return tokens


def longest_match(shortest: int) -> int:
    """The longest n-gram prompt lookup tries first, for a shortest match of `shortest` tokens."""
    return max(LONGEST_MATCH, shortest)


# llama-server's n-gram speculative types (its `--spec-type`), which draft by copying earlier text with no draft model:
# the `llama-server` method's draft= choices beside `model` and `none` (decode/llama_server.py).
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
