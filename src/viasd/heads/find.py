"""Which draft head a target drafts with: a file named by the user, else the one trained here, else the shipped one.

Heads trained by `viasd train-drafter` live in viasd's cache by the target's fingerprint
(`<cache>/heads/<fingerprint>/head.safetensors`); heads shipped with the package (heads/shipped/) are found by the
fingerprint in their metadata. A head made for another target is refused: its features would be another model's.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from viasd.cache import cache_folder
from viasd.errors import ViasdError
from viasd.heads.file import HeadFile, load_head
from viasd.models.fingerprint import model_fingerprint

SHIPPED = Path(__file__).parent / "shipped"


def trained_head_path(fingerprint: str) -> Path:
    """Where `viasd train-drafter` writes the head of the target with this fingerprint."""
    return cache_folder("heads") / fingerprint / "head.safetensors"


def find_head(target: nn.Module, path: str | Path | None = None) -> HeadFile:
    """The head for `target`: `path`, else the one trained here, else a shipped one; a one-line ViasdError when
    there is none, or the one named was made for another target."""
    fingerprint = model_fingerprint(target)
    if path is not None:
        return _for(load_head(Path(path)), fingerprint, Path(path))
    trained = trained_head_path(fingerprint)
    if trained.exists():
        return _for(load_head(trained), fingerprint, trained)
    for shipped in sorted(SHIPPED.glob("*.safetensors")):
        found = load_head(shipped)
        if found.target == fingerprint:
            return found
    raise ViasdError(f"no draft head for this target (fingerprint {fingerprint}): train one with `viasd train-drafter`")


def _for(found: HeadFile, fingerprint: str, path: Path) -> HeadFile:
    """`found`, when it was trained for the target with this fingerprint."""
    if found.target != fingerprint:
        raise ViasdError(
            f"draft head {path} was trained for another target (fingerprint {found.target}, this target's is "
            f"{fingerprint})"
        )
    return found
