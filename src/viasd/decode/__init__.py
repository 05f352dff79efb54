"""Decoding: the round policy and `play_round`, the plain, speculative and tiered decoders, their statistics.

This file stays free of torch: the method registry reads MAX_GAMMA from here when it parses method names.
"""

MAX_GAMMA = 64  # draft tokens per round: far beyond any useful block, small enough to refuse a typo
