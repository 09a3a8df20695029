"""Small file-system helpers for writes that must survive a crash."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries to disk, so that a rename into it survives a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
