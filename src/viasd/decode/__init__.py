"""Decoding: the round policy and `play_round`, the plain, speculative and tiered decoders, their statistics.

A decoder takes its settings as checked where they entered (viasd.speculation): it checks none of them again.
"""
