"""Helpers several test modules share: a prompt, cache comparisons, greedy outputs compared up to a near tie, GGUF
blocks and a tiny model converted from them, and a drafter that records its rounds. Test modules import them from
here, never from one another."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from torch import nn
from transformers import DynamicCache

from tiny import tiny_model
from viasd.drafters.base import Drafter, Proposal
from viasd.kernels.packed_attention import PACK_UP_TO
from viasd.passes import loop as short_pass
from viasd.passes.facts import gather
from viasd.passes.route import Schedule, Stack, decide
from viasd.passes.session import KVSession, new_cache
from viasd.verify.sampling import SamplingParams
from viasd.views.quantize import quantizable
from viasd.views.view import View, ViewLike, applied

PROMPT = [3, 4, 5, 6, 7, 3, 4, 5, 9, 12]

# ------------------------------------------------------------------------------------------------- caches


def fresh_cache(model: nn.Module, tokens: list[int], mask: ViewLike = None) -> DynamicCache:
    """The cache of one fresh pass over `tokens` (through `mask`, a view or layer mask)."""
    session = KVSession(model, base_view=mask)
    session.forward(tokens)
    return session.cache


# Gemma2 in transformers computes some steps in float32 even in a float64 model (a long prefill and
# single steps then differ at about 1e-6, with or without our cache code); the others are exact to 1e-10.
ATOL = {"gemma2": 1e-5}


def assert_cache_equals(
    cache: DynamicCache,
    reference: DynamicCache,
    length: int,
    layers: Collection[int] | None = None,
    atol: float = 1e-10,
) -> None:
    """`cache`'s first `length` entries equal `reference`'s (of that length), in every layer or those of `layers`."""
    for i, (layer, ref) in enumerate(zip(cache.layers, reference.layers, strict=False)):
        if layers is not None and i not in layers:
            continue
        assert ref.keys.shape[-2] == length
        assert torch.allclose(layer.keys[..., :length, :], ref.keys, atol=atol), f"layer {i} keys"
        assert torch.allclose(layer.values[..., :length, :], ref.values, atol=atol), f"layer {i} values"
        assert layer.keys.shape[-2] >= length


# ------------------------------------------------------------------------------------------- short passes


def ragged_stack(model: nn.Module, view: View | None) -> tuple[Stack, bool]:
    """The stack of a ragged pass of `model` as `view` (full layers) on sessions' caches, and whether it attends by
    the C kernel: the leg the route gives a batcher's segment (passes/route.py), as training asks for it."""
    leg = decide(1, 1, gather(model, new_cache(model), view, chunk=PACK_UP_TO)).legs[0]
    assert leg.schedule is Schedule.BATCHED, "viasd's loop runs this model's passes"
    return leg.stack, leg.attention_kernel


def own_and_short(model, view, seed=0):
    """Pairs of (own forward, short pass) logits over random blocks after a prompt, on two caches; and the caches."""
    rng = random.Random(seed)
    ids = [rng.randrange(64) for _ in range(200)]
    own, short = new_cache(model), new_cache(model)
    pairs = []
    stack = ragged_stack(model, view)
    with torch.inference_mode(), applied(model, view):
        for cache in (own, short):
            model(input_ids=torch.tensor([ids[:20]]), cache=cache, use_cache=True, logits_to_keep=1)
        at = 20
        for _ in range(12):
            length = rng.randint(1, PACK_UP_TO)
            block = torch.tensor([ids[at : at + length]])
            want = model(input_ids=block, cache=own, use_cache=True, logits_to_keep=length).logits
            pairs.append((want, short_pass.short_pass(model, block, short, length, *stack)))
            if rng.random() < 0.5:  # a rejected draft: both caches roll back alike
                drop = rng.randint(0, length - 1)
                for cache in (own, short):
                    cache.crop(-drop) if drop else None
                length -= drop
            at += length
    return pairs, own, short


# -------------------------------------------------------------------------------------- greedy outputs


def assert_same_until_a_near_tie(model: nn.Module, view: View, got: list[int], plain: list[int]) -> None:
    """`got` equals `plain` (the view's plain greedy output), or first differs where the view's top two logits,
    read in one pass over the plain output, are within 0.2 of each other (a tie that arithmetic noise breaks)."""
    parted = next((i for i, (a, b) in enumerate(zip(got, plain, strict=True)) if a != b), None)
    if parted is None:
        return
    with torch.inference_mode(), applied(model, view):
        logits = model(torch.tensor([PROMPT + plain])).logits[0, len(PROMPT) - 1 + parted].float()
    top = logits.topk(2).values
    assert float(top[0] - top[1]) < 0.2, f"parted at token {parted}, where the model leads by {top[0] - top[1]:.3f}"


# ------------------------------------------------------------------------------------------- GGUF blocks

Q4_K = gguf.GGMLQuantizationType.Q4_K
Q6_K = gguf.GGMLQuantizationType.Q6_K


def random_q4k(rows: int, columns: int, seed: int) -> np.ndarray:
    """Random Q4_K bytes [rows, columns / 256 * 144]: any codes and 6-bit scales make a valid block; d and dmin
    are kept to the magnitudes real layers have."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * columns // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 1e-3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-4, 2e-3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, columns // 256 * 144)


def random_q6k(rows: int, columns: int, seed: int) -> np.ndarray:
    """Random Q6_K bytes [rows, columns / 256 * 210]: any code bytes and int8 scales make a valid block; d is kept
    to the magnitudes real layers have."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * columns // 256, 210), dtype=np.uint8)
    blocks[:, 208:210] = rng.uniform(1e-4, 1e-3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, columns // 256 * 210)


def random_q5k(rows: int, columns: int, seed: int) -> np.ndarray:
    """Random Q5_K bytes [rows, columns / 256 * 176]: any codes, fifth bits and 6-bit scales make a valid block; d
    and dmin are kept to the magnitudes real layers have."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * columns // 256, 176), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(5e-5, 5e-4, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-4, 2e-3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, columns // 256 * 176)


def random_blocks(kind: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Raw blocks of GGML type `kind` [rows, bytes]: random bytes of real magnitudes for the K types, the gguf
    package's own quantization of a random weight for the others."""
    made = {"Q4_K": random_q4k, "Q5_K": random_q5k, "Q6_K": random_q6k}
    if kind in made:
        return made[kind](rows, columns, seed)
    weight = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32) * 0.05
    return gguf_quantize(weight, gguf.GGMLQuantizationType[kind])


def q4k_but_q6k_values(name: str) -> str:
    """Q4_K_M's mix: Q4_K, but Q6_K for the value projections (as Q4_K_M keeps some at 6 bits)."""
    return "Q6_K" if name.endswith("v_proj") else "Q4_K"


def qwen2_with_gguf(
    tmp_path: Path,
    dtype: torch.dtype = torch.float32,
    kind_of: Callable[[str], str] = q4k_but_q6k_values,
    layers: int = 2,
) -> tuple[torch.nn.Module, Path, set[str]]:
    """A tiny Qwen2 whose Linear weights are the dequantized blocks of a GGUF file written beside it, each layer in
    the GGML type `kind_of(name)` (by default Q4_K_M's mix), but float32 for the head. Also returns the names of the
    layers the file has blocks for."""
    model = tiny_model("qwen2", hidden=256, layers=layers, dtype=dtype)
    writer = gguf.GGUFWriter(tmp_path / "tiny.gguf", "qwen2")
    writer.add_block_count(layers)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, layers)
    in_blocks: set[str] = set()
    with torch.no_grad():
        for i, (name, linear) in enumerate(quantizable(model).items()):
            rows, columns = linear.weight.shape
            if name == "lm_head" or columns % 256:
                writer.add_tensor(f"{names.get_name(name)}.weight", linear.weight.float().numpy())
                continue
            kind = gguf.GGMLQuantizationType[kind_of(name)]
            raw = random_blocks(kind.name, rows, columns, i)
            linear.weight.copy_(torch.from_numpy(gguf_dequantize(raw, kind).astype(np.float32)))
            writer.add_tensor(f"{names.get_name(name)}.weight", raw, raw_dtype=kind)
            in_blocks.add(name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tmp_path / "tiny.gguf", in_blocks


# ------------------------------------------------------------------------------------------------ drafters


class Recording:
    """A drafter wrapper that remembers each round's limit k and what was proposed."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter, self.name = drafter, drafter.name
        self.rounds: list[tuple[int, int, str]] = []  # (k, drafted, source)

    @property
    def forward_passes(self) -> int:
        return self.drafter.forward_passes

    @property
    def pass_seconds(self) -> float:
        return self.drafter.pass_seconds

    @property
    def sessions(self):
        return self.drafter.sessions

    def reset(self, prompt_length: int | None = None, budget: int | None = None) -> None:
        self.drafter.reset(prompt_length, budget)

    def follow(self, target: object) -> None:
        self.drafter.follow(target)  # type: ignore[arg-type]

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, stop: float = 0.0
    ) -> Proposal:
        out = self.drafter.propose(context, k, params, generator, stop)
        self.rounds.append((k, len(out), out.source))
        return out
