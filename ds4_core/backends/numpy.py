"""The numpy reference backend: weights dequantized to float32, every op its numpy reference."""

from __future__ import annotations

import numpy as np

from ..backend import Backend, Weight
from ..quants import QUANT_NAMES, dequantize


def probe() -> tuple[bool, str]:
    """Always available: numpy runs everywhere."""
    return True, f"numpy {np.__version__} on the CPU"


class NumpyBackend(Backend):
    """Holds every weight as a float32 array (integer tables stay integer)."""

    name = "numpy"
    xp = np

    def __init__(self, **options: object):
        self.options = options

    def upload(self, name: str, qtype: str, shape: tuple[int, ...], raw: np.ndarray) -> Weight:
        if qtype in ("I32", "I16", "I8", "I64"):
            data = np.frombuffer(raw, dtype=np.dtype(qtype.lower().replace("i", "int"))).reshape(shape).copy()
        else:
            data = dequantize(raw, QUANT_NAMES[qtype], shape)
        return Weight(name, qtype, shape, data)

    def free_memory(self) -> int | None:
        """``MemAvailable`` of the host (Linux), else unknown."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None
