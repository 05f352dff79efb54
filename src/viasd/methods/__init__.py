"""Decoding methods as values: `registry` names them and parses a method name once, `options` what their variants
set, `drafting` builds every drafter, `builders`, `via` and `baselines` build the decoders."""

from viasd.methods.method import Method, MethodSpec, Parts, first_set
from viasd.methods.options import OPTIONS
from viasd.methods.registry import METHODS, parse_method, parse_method_list

__all__ = ["METHODS", "OPTIONS", "Method", "MethodSpec", "Parts", "first_set", "parse_method", "parse_method_list"]
