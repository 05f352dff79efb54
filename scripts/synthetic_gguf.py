"""Write a synthetic GGUF target with the real shapes of a model CPU users run (Qwen2.5-7B, Llama-3.1-8B, Qwen2.5-14B),
for measuring speed and memory at those sizes, never quality.

Its tensors are random blocks of llama.cpp's Q4_K_M type mix (Q4_K; Q6_K for the output head and, on the layers
llama.cpp gives more bits, the value and down projections), with scales of real magnitudes; norms are ones, biases
zeros. Its tokenizer and chat template are the real ones of a catalog model's file (the default target's: Qwen2.5's
152k vocabulary; the Llama shape keeps Qwen's vocabulary in place of Llama 3's 128k, 1.5% more weights). The file is
written tensor by tensor, so memory holds one tensor at a time.

    python scripts/synthetic_gguf.py --shape qwen2.5-7b --out /path/qwen2.5-7b-shape-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    """A model's shapes, as its config gives them."""

    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    bias: bool  # query, key and value biases (Qwen2)
    rope_base: float
    context: int


SHAPES = {
    "qwen2.5-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, True, 1_000_000.0, 32768),
    "llama-3.1-8b": Shape("llama", 4096, 14336, 32, 32, 8, False, 500_000.0, 131072),
    "qwen2.5-14b": Shape("qwen2", 5120, 13824, 48, 40, 8, True, 1_000_000.0, 32768),
}
_SIZES = {"Q4_K": 144, "Q6_K": 210}


def more_bits(layer: int, layers: int) -> bool:
    """Whether llama.cpp's Q4_K_M gives a layer's value and down projections 6 bits (`use_more_bits`)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_blocks(kind: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks [rows, bytes] whose fp16 scales have real magnitudes (random codes, sub-scales)."""
    blocks = rng.integers(0, 256, size=(rows * (columns // 256), _SIZES[kind]), dtype=np.uint8)
    scales = rng.uniform(1e-4, 1e-3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":
        blocks[:, 0:2] = scales
        blocks[:, 2:4] = scales
    else:
        blocks[:, 208:210] = scales
    return blocks.reshape(rows, -1)


def tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor as (name, [rows, columns] or [n], GGML type), in a file's order."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (vocab, shape.hidden), "Q4_K"),
        ("output_norm.weight", (shape.hidden,), "F32"),
        ("output.weight", (vocab, shape.hidden), "Q6_K"),
    ]
    for i in range(shape.layers):
        six = "Q6_K" if more_bits(i, shape.layers) else "Q4_K"
        block = f"blk.{i}"
        out += [
            (f"{block}.attn_norm.weight", (shape.hidden,), "F32"),
            (f"{block}.attn_q.weight", (shape.hidden, shape.hidden), "Q4_K"),
            (f"{block}.attn_k.weight", (kv, shape.hidden), "Q4_K"),
            (f"{block}.attn_v.weight", (kv, shape.hidden), six),
            (f"{block}.attn_output.weight", (shape.hidden, shape.hidden), "Q4_K"),
            (f"{block}.ffn_norm.weight", (shape.hidden,), "F32"),
            (f"{block}.ffn_gate.weight", (shape.intermediate, shape.hidden), "Q4_K"),
            (f"{block}.ffn_up.weight", (shape.intermediate, shape.hidden), "Q4_K"),
            (f"{block}.ffn_down.weight", (shape.hidden, shape.intermediate), six),
        ]
        if shape.bias:
            out += [(f"{block}.attn_{p}.bias", (n,), "F32") for p, n in (("q", shape.hidden), ("k", kv), ("v", kv))]
    return out


def copy_tokenizer(source: Path, writer: gguf.GGUFWriter, rows: int | None = None) -> int:
    """Copy the tokenizer's and chat template's fields of `source` into `writer`; the vocabulary's size. `rows`: pad
    the token list to this many with unused tokens, as llama.cpp's converter pads Qwen's (its embedding has 152,064
    rows for 151,936 tokens: llama.cpp wants a token per row)."""
    reader = gguf.GGUFReader(source)
    size = 0
    count = len(reader.fields["tokenizer.ggml.tokens"].data)
    extra = max(0, (rows or count) - count)
    pads = {
        "tokenizer.ggml.tokens": [f"[PAD{count + i}]" for i in range(extra)],
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * extra,
        "tokenizer.ggml.scores": [0.0] * extra,
    }
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            item = field.types[1]
            values = [field.parts[index] for index in field.data]
            if item == gguf.GGUFValueType.STRING:
                values = [bytes(value).decode("utf-8", errors="replace") for value in values]
            else:
                values = [value.tolist()[0] for value in values]
            values += pads.get(key, [])
            if key == "tokenizer.ggml.tokens":
                size = len(values)
            writer.add_array(key, values)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, bytes(field.parts[field.data[0]]).decode("utf-8"))
        else:
            writer.add_key_value(key, field.parts[field.data[0]].tolist()[0], kind)
    return size


def write(shape: Shape, name: str, source: Path, out: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(out, shape.arch)
    writer.add_name(f"synthetic {name} shape (random Q4_K_M blocks)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens = len(gguf.GGUFReader(source).fields["tokenizer.ggml.tokens"].data)
    rows = -(-tokens // 256) * 256 if shape.arch == "qwen2" else tokens  # Qwen pads its heads (152,064 rows)
    vocab = copy_tokenizer(source, writer, rows)
    planned = tensors(shape, vocab)
    for tensor_name, dims, kind in planned:
        if kind == "F32":
            writer.add_tensor_info(tensor_name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            rows, columns = dims
            nbytes = rows * (columns // 256) * _SIZES[kind]
            writer.add_tensor_info(tensor_name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes,
                                   raw_dtype=gguf.GGMLQuantizationType[kind])  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for done, (tensor_name, dims, kind) in enumerate(planned, 1):
        if kind == "F32":
            data = np.ones(dims, np.float32) if tensor_name.endswith("norm.weight") else np.zeros(dims, np.float32)
        else:
            data = random_blocks(kind, dims[0], dims[1], rng)
        writer.write_tensor_data(data)
        print(f"\r{out.name}: {done}/{len(planned)} tensors", end="", file=sys.stderr, flush=True)
    writer.close()
    print(f"\n{out}: {out.stat().st_size / 1e9:.2f} GB", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--tokenizer-from", type=Path, help="the GGUF file whose tokenizer to copy (default: the default target's)"
    )
    args = parser.parse_args()
    source = args.tokenizer_from
    if source is None:
        from viasd.models.catalog import DEFAULT_TARGET
        from viasd.models.fetch import ensure_default_gguf

        source = ensure_default_gguf(DEFAULT_TARGET)
    write(SHAPES[args.shape], args.shape, source, args.out)


if __name__ == "__main__":
    main()
