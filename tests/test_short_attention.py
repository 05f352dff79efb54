"""The attention kernel of short bf16 passes: torch's cache entries bit for bit, attention as exact as bf16 allows
(closer to the float64 truth than torch's own), each query row the same in every block, both CPU builds alike."""

import platform
import shutil

import pytest
import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from viasd.kernels import attention as short_attention
from viasd.kernels import build
from viasd.kernels.build import Library
from viasd.kernels.cpu import cpu_flags
from viasd.passes import window_attention
from viasd.passes.cache_layer import GrowingLayer
from viasd.passes.layer_loop import LayerAttention

# Where it can be built (an x86 CPU with AVX2 and FMA, a C compiler), the kernel must also pass its own check.
pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not {"avx2", "fma"} <= cpu_flags() or not shutil.which("cc"),
    reason="the attention kernel is for x86 CPUs with AVX2 and a C compiler",
)


def test_the_kernel_is_built_and_passes_its_check():
    assert isinstance(short_attention.compiled(), Library), short_attention.compiled()


def kernel_pass(cos, sin, heads, scale, library=None):
    """A layer's attention in a pass by the kernel (the checked library, or `library`)."""
    return LayerAttention(cos, sin, heads, scale, library or short_attention.compiled())


def torch_pass(cos, sin, heads, scale):
    """The same by the kernel's torch reference (the model's own arithmetic)."""
    return LayerAttention(cos, sin, heads, scale, None)


def case(heads, kv_heads, dim, past, rows, seed=0):
    """Queries, keys and values as columns of one fused projection (strided rows), rotary tables, a cached prefix."""
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).bfloat16()
    query, key, value = fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    angles = torch.randn(rows, dim // 2, generator=generator) * 3
    cos, sin = torch.cat([angles.cos()] * 2, 1).bfloat16(), torch.cat([angles.sin()] * 2, 1).bfloat16()
    prefix = (torch.randn(2, 1, kv_heads, past, dim, generator=generator) * 2).bfloat16()
    return query, key, value, cos, sin, prefix


def layer_with(prefix):
    layer = GrowingLayer()
    if prefix.shape[-2]:
        layer.update(prefix[0], prefix[1])
    return layer


def truth(query, cos, sin, layer, heads, dim, window=0):
    """float64 attention over the rotated bf16 queries and the layer's (bf16) cache, causal (over the last `window`
    positions of each query's where `window` > 0): [M, heads * dim]."""
    rows = query.shape[0]
    rotated = short_attention.rotated(query.view(1, rows, heads, dim).transpose(1, 2), cos[None, None], sin[None, None])
    q, keys, values = rotated[0].double(), layer.keys[0].double(), layer.values[0].double()
    group = heads // keys.shape[0]
    past = keys.shape[1] - rows
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for h in range(heads):
        for m in range(rows):
            visible = past + m + 1
            first = max(0, visible - window) if window else 0
            weights = torch.softmax((keys[h // group, first:visible] @ q[h, m]) * dim**-0.5, dim=0)
            out[m, h] = weights @ values[h // group, first:visible]
    return out.reshape(rows, heads * dim)


SHAPES = [  # heads, kv heads, dim, cached positions, rows: the real pair's, a tail of scores, no prefix, MHA
    (12, 2, 128, 300, 1),
    (12, 2, 128, 37, 7),
    (14, 2, 64, 100, 16),
    (4, 2, 16, 0, 5),
    (8, 8, 32, 17, 2),
    (7, 1, 256, 3, 3),
]


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "past", "rows"), SHAPES)
def test_kernel_writes_torchs_cache_entries_and_attends_as_exactly_as_bf16_allows(heads, kv_heads, dim, past, rows):
    query, key, value, cos, sin, prefix = case(heads, kv_heads, dim, past, rows)
    torch_layer, kernel_layer = layer_with(prefix), layer_with(prefix)
    want = torch_pass(cos, sin, heads, dim**-0.5)(query, key, value, torch_layer)
    got = kernel_pass(cos, sin, heads, dim**-0.5)(query, key, value, kernel_layer)
    assert torch.equal(kernel_layer.keys, torch_layer.keys) and torch.equal(kernel_layer.values, torch_layer.values)
    exact = truth(query, cos, sin, kernel_layer, heads, dim)
    # Within one bf16 rounding of the truth (half a unit in the last place, plus float32 noise), and on average
    # no further from it than torch's result.
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 * 1.01 + 1e-6).all()
    assert (got.double() - exact).abs().mean() <= (want.double() - exact).abs().mean() * 1.001


def sliding_with(prefix, window, cropped):
    """transformers' sliding cache layer as sessions keep it (recording its past for rollbacks) after `prefix`;
    `cropped`: trimmed back to its last window - 1 positions, as a session's crop leaves it."""
    layer = DynamicSlidingWindowLayer(window)
    layer.activate_past_recording()
    if prefix.shape[-2]:
        layer.update(prefix[0], prefix[1])
    if cropped:
        layer.crop(0)
    return layer


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "past", "rows", "window", "cropped"), [
    (4, 1, 256, 40, 5, 8, True),  # gemma3-270m's heads, queries far past the window
    (4, 1, 256, 40, 5, 8, False),  # the layer holds more than the window: the kernel must look back no further
    (12, 2, 128, 37, 7, 20, True),
    (4, 2, 16, 3, 5, 4, False),  # the window reached within the pass
    (8, 8, 32, 17, 2, 64, False),  # a window longer than the context: causal attention
])  # fmt: skip
def test_a_sliding_window_layer_attends_over_its_window_as_exactly_as_bf16_allows(heads, kv_heads, dim, past, rows,
                                                                                  window, cropped):  # fmt: skip
    """The kernel over transformers' sliding layer writes what the layer's own update keeps, and each query sees
    exactly the last `window` positions up to its own (the model's sliding mask), within one bf16 rounding."""
    query, key, value, cos, sin, prefix = case(heads, kv_heads, dim, past, rows, seed=3)
    torch_layer, kernel_layer = sliding_with(prefix, window, cropped), sliding_with(prefix, window, cropped)
    want = window_attention.attend(query, key, value, cos, sin, torch_layer, heads, dim**-0.5)
    got = window_attention.attend_by_kernel(short_attention.compiled(), query, key, value, cos, sin, kernel_layer,
                                            heads, dim**-0.5)  # fmt: skip
    assert kernel_layer.get_seq_length() == torch_layer.get_seq_length() == past + rows
    assert torch.equal(kernel_layer.keys, torch_layer.keys) and torch.equal(kernel_layer.values, torch_layer.values)
    exact = truth(query, cos, sin, kernel_layer, heads, dim, window)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 * 1.01 + 1e-6).all()
    assert ((want.double() - exact).abs() <= exact.abs() * 2**-4 + 1e-2).all()  # torch's bf16: the same window
    if kernel_layer.keys.shape[-2] > window:  # the test can fail: a query seeing one position more is off
        wider = truth(query, cos, sin, kernel_layer, heads, dim, window + 1)
        assert not ((got.double() - wider).abs() <= wider.abs() * 2**-8 * 1.01 + 1e-6).all()


def test_each_query_row_gets_the_same_bits_in_every_block():
    heads, kv_heads, dim = 12, 2, 128
    query, key, value, cos, sin, prefix = case(heads, kv_heads, dim, 50, 9, seed=1)
    blocked = layer_with(prefix)
    whole = kernel_pass(cos, sin, heads, dim**-0.5)(query, key, value, blocked)
    stepped, parts, at = layer_with(prefix), [], 0
    for size in (1, 3, 1, 4):  # the same rows in other blocks, after the same cache
        rows = slice(at, at + size)
        attention = kernel_pass(cos[rows], sin[rows], heads, dim**-0.5)
        parts.append(attention(query[rows], key[rows], value[rows], stepped))
        at += size
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(stepped.keys, blocked.keys) and torch.equal(stepped.values, blocked.values)


def test_the_layer_grows_under_the_kernel():
    heads, kv_heads, dim = 4, 2, 16
    query, key, value, cos, sin, _ = case(heads, kv_heads, dim, 0, 1)
    kernel_layer, torch_layer = GrowingLayer(), GrowingLayer()
    for step in range(300):  # past MIN_ROOM: the store doubles while the kernel writes into it
        if step == 120:
            kernel_layer.crop(-20), torch_layer.crop(-20)
        kernel_pass(cos, sin, heads, 0.25)(query, key, value, kernel_layer)
        torch_pass(cos, sin, heads, 0.25)(query, key, value, torch_layer)
    assert kernel_layer.get_seq_length() == 280 and kernel_layer.stores()[0].shape[-2] == 512
    assert torch.equal(kernel_layer.keys, torch_layer.keys) and torch.equal(kernel_layer.values, torch_layer.values)


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="compares the AVX-512 build with the AVX2 one")
def test_the_avx2_build_gives_the_avx512_builds_bits():
    avx2 = build.load(build.BUILDS[-1])
    assert isinstance(avx2, Library) and avx2.build == "avx2" and short_attention._self_check(avx2) is None
    heads, kv_heads, dim = 12, 2, 128
    query, key, value, cos, sin, prefix = case(heads, kv_heads, dim, 70, 4, seed=2)
    outputs = [
        kernel_pass(cos, sin, heads, dim**-0.5, library)(query, key, value, layer_with(prefix))
        for library in (short_attention.compiled(), avx2)
    ]
    assert torch.equal(*outputs)


def test_what_the_kernel_does_not_take(monkeypatch):
    assert short_attention.takes(torch.bfloat16, 12, 2, 128) and isinstance(short_attention.kernel(), Library)
    assert not short_attention.takes(torch.float32, 12, 2, 128)  # float32 and float64 models: torch's ops
    assert not short_attention.takes(torch.bfloat16, 12, 2, 72)  # a head dim that is not whole vectors
    assert not short_attention.takes(torch.bfloat16, 34, 2, 64)  # more query heads per group than it holds
    monkeypatch.setenv("VIASD_KERNELS", "-attention")
    assert short_attention.kernel_status() == "switched off (VIASD_KERNELS)"
    monkeypatch.delenv("VIASD_KERNELS")
    query, key, value, cos, sin, prefix = case(4, 2, 16, 5, 2)
    attention = kernel_pass(cos, sin, 4, 0.25)
    with pytest.raises(ValueError, match="side by side"):
        attention(query, key.t().contiguous().t(), value, layer_with(prefix))
    query, key, value, cos, sin, prefix = case(34, 2, 16, 5, 2)  # 17 query heads per group: more than it holds
    layer = layer_with(prefix)
    with pytest.raises(ValueError, match="does not take 34 heads"):
        kernel_pass(cos, sin, 34, 0.25)(query, key, value, layer)
    assert layer.get_seq_length() == 5  # nothing half-written kept
