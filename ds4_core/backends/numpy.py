"""The numpy reference backend: weights dequantized to float32, every op its numpy reference."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from ..backend import Backend, Weight
from ..memory import available_host_memory
from ..quants import QUANT_NAMES, dequantize

if TYPE_CHECKING:
    from ..gguf import TensorInfo

_INTEGER_TYPES = ("I8", "I16", "I32", "I64")


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
        if qtype in _INTEGER_TYPES:
            data = np.frombuffer(raw, dtype=np.dtype(qtype.lower().replace("i", "int"))).reshape(shape).copy()
        else:
            data = dequantize(raw, QUANT_NAMES[qtype], shape)
        return Weight(name, qtype, shape, data)

    def weights_nbytes(self, tensors: Iterable[TensorInfo]) -> int:
        """Every float tensor is dequantized to float32 at upload; integer tensors keep their width."""
        return sum(t.nbytes if t.type_name in _INTEGER_TYPES else 4 * t.n_elements for t in tensors)

    def free_memory(self) -> int | None:
        return available_host_memory()
