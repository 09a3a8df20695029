"""Availability check that imports nothing heavy: MLX is looked up, not imported, and Metal is not initialised."""

from __future__ import annotations

import importlib.util
import platform
import sys


def apple_silicon() -> bool:
    """True on macOS on an Apple-silicon Mac, where MLX runs on the Metal GPU."""
    return sys.platform == "darwin" and platform.machine() == "arm64"


def probe() -> tuple[bool, str]:
    """(usable, reason): MLX installed; on Apple silicon it runs on the GPU, elsewhere on MLX's CPU device."""
    if importlib.util.find_spec("mlx") is None:
        hint = "pip install mlx" if apple_silicon() else "pip install 'mlx[cpu]' (CPU only, for testing)"
        return False, f"MLX is not installed; {hint}"
    if apple_silicon():
        return True, f"Apple silicon GPU through MLX (macOS {platform.mac_ver()[0]})"
    return True, "MLX on the CPU (no Metal here): correct but not fast; custom Metal kernels stay disabled"
