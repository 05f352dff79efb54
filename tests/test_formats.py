"""The table of weight formats (kernels/formats.py): what a GGUF file's tensor of each type becomes, which layer a
format's copy is, and that an unknown type or format is refused in one line."""

from __future__ import annotations

import itertools
from pathlib import Path

import gguf
import pytest

from helpers import qwen2_with_gguf
from viasd.errors import ViasdError
from viasd.kernels import formats, interface, switch
from viasd.models.gguf_file import GgufFile
from viasd.models.stored import view_bytes
from viasd.views.gguf import KERNEL_TYPES, GgufWeights
from viasd.views.linears import format_of, layer_class
from viasd.views.quantize import quantize
from viasd.views.recipe import KINDS, QuantRecipe


def test_every_gguf_type_the_file_index_knows_maps_to_exactly_one_format():
    for kind in gguf.GGMLQuantizationType.__members__:
        taking = [f for f in formats.FORMATS if kind in f.types]
        assert len(taking) <= 1, kind
        assert formats.taking(kind) is (taking[0] if taking else formats.FALLBACK), kind
    assert KERNEL_TYPES == formats.KERNEL_TYPES == ("Q4_K", "Q4_0", "Q4_1", "Q6_K", "Q8_0", "Q5_K", "Q5_0", "Q5_1")
    assert formats.REPACKED_TYPES.issubset(KERNEL_TYPES)
    assert [formats.taking(k).name for k in ("Q4_K", "Q6_K", "Q5_K", "F16", "Q3_K")] == [
        "int4a8", "int6a8", "int8a8", "int8wo", "int8wo",
    ]  # fmt: skip


def test_each_format_names_its_kernel_its_fused_product_and_its_layer():
    assert set(KINDS) <= {f.name for f in formats.FORMATS}  # every recipe kind is a format
    fused = [f.fused for f in formats.FORMATS if f.fused is not None]
    assert sorted(fused) == sorted({interface.FOUR_BIT, interface.SIX_BIT, interface.EIGHT_BIT})
    for found in formats.FORMATS:
        assert found.kernel is None or found.kernel in switch.KERNELS
        assert layer_class(found.name).format is found  # type: ignore[attr-defined]
        if found.fused is not None:
            assert formats.of_product(found.fused) is found
        if found.empty is not None:  # its layout: the layer's buffers are the weights' tensors, by their names
            empty = found.empty(24, 512)
            assert formats.of_weights(empty) is found and empty.n == 24 and empty.k == 512
            layer = layer_class(found.name)(empty, None)
            assert [key for key, _ in layer.named_buffers()] == list(found.keys)


def test_an_unknown_type_or_format_is_one_line():
    for refused in (lambda: formats.taking("Q9_Z"), lambda: formats.named("int3"), lambda: layer_class("int3")):
        with pytest.raises(ViasdError) as error:
            refused()
        assert "\n" not in str(error.value)


def test_the_gguf_view_makes_each_type_the_layer_of_its_format(tmp_path: Path):
    """A tiny model's Linear layers stored in every type a kernel takes, and one no kernel takes (F16): its `gguf`
    view's layer of each is the class of the format the table says."""
    kinds = itertools.cycle((*KERNEL_TYPES, "F16"))
    stored: dict[str, str] = {}

    def kind_of(name: str) -> str:
        stored[name] = next(kinds)
        return stored[name]

    model, path, _ = qwen2_with_gguf(tmp_path, kind_of=kind_of)
    assert set(stored.values()) == {*KERNEL_TYPES, "F16"}
    made = quantize(model, QuantRecipe.parse("gguf"), gguf=GgufWeights(path))
    for name, kind in stored.items():
        module = made.modules[name]
        assert type(module) is layer_class(formats.taking(kind).name), (name, kind)
        assert format_of(module) is formats.taking(kind)
    assert made.from_file == sum(kind in KERNEL_TYPES for kind in stored.values())


def test_a_views_memory_is_its_formats_layout(tmp_path: Path):
    """Q4_K's 144 bytes per 256 weights become 128 bytes of codes and 16 fp16 scales and minimums; an F16 tensor
    counts as the file holds it."""
    _, path, _ = qwen2_with_gguf(tmp_path, kind_of=lambda name: "Q4_K")
    file = GgufFile(path)
    four = [t for t in file.tensors.values() if t.kind == "Q4_K"]
    rest = [t for t in file.tensors.values() if t.kind != "Q4_K" and t.name != "token_embd.weight"]
    assert four and formats.INT4A8.bytes_per_weight == 0.625
    want = sum(t.nbytes * 160 / 144 for t in four) + sum(t.nbytes for t in rest)
    assert view_bytes(file) == pytest.approx(want, abs=len(four) + 1)
