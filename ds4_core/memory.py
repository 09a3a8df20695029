"""Memory figures: what the host has available, and byte counts as people read them."""

from __future__ import annotations


def available_host_memory() -> int | None:
    """``MemAvailable`` of the host (Linux), else unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def human_bytes(nbytes: float) -> str:
    """``1536`` -> ``"1.50 KiB"``: binary units, two decimals above a KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return ""
