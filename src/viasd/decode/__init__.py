"""Decoding: the round policy and `play_round`, the plain, speculative and tiered decoders, their statistics.

This file stays free of torch: the method registry reads MAX_GAMMA from here when it parses method names.
"""

from viasd.errors import ViasdError

MAX_GAMMA = 64  # draft tokens per round: far beyond any useful block, small enough to refuse a typo


def check_gamma(gamma: int, name: str = "the draft length gamma") -> int:
    """`gamma` when it is a draft length every decoder takes (1..MAX_GAMMA), else a one-line ViasdError naming it
    as the user gave it (`--gamma`, ...). 0 must not pass: decoders read a falsy gamma as unset."""
    if not 1 <= gamma <= MAX_GAMMA:
        raise ViasdError(f"{name} must be in 1..{MAX_GAMMA}, got {gamma}")
    return gamma
