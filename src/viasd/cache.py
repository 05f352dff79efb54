"""Where viasd keeps what it makes once: one cache folder, `$VIASD_CACHE_DIR` or the user's cache dir's `viasd`.

Inside it: `models/` (converted default models), `quantized/` (quantized copies), `kernels/` (compiled C kernels:
private, see `private_folder`) and `auto/` (the `auto` method's probes). Every folder is inside the one the user
configured, never beside it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from viasd.errors import ViasdError

CACHE_ENV_VAR = "VIASD_CACHE_DIR"


def cache_root() -> Path:
    """viasd's cache folder: `$VIASD_CACHE_DIR` if set, else the user cache dir's `viasd`."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("viasd"))


def cache_folder(name: str) -> Path:
    """`<cache>/<name>` (not created here)."""
    return cache_root() / name


def private_folder(name: str) -> Path:
    """`<cache>/<name>`, created owner-only (0700) if missing, and refused (a one-line ViasdError) where it is not
    a directory of this user that nobody else may write: what is loaded into the process from there (compiled
    kernels) must not be replaceable by another user."""
    folder = cache_folder(name)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.lstat()
    except OSError as error:
        raise ViasdError(f"cannot use {folder}: {error.strerror or error}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ViasdError(f"cannot use {folder}: it is not a directory")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise ViasdError(f"cannot use {folder}: it belongs to another user")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ViasdError(f"cannot use {folder}: others may write to it (chmod 700 it)")
    return folder
