"""Compilation of the ``.cu`` sources through ``cupy.RawModule`` (NVRTC), once per process.

CuPy keys its on-disk kernel cache by source text and options, so an unchanged source compiles once per
machine; :func:`warm` forces that compilation at load time rather than at the first token.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import numpy as np

#: Weight formats the quant kernels are instantiated for (the struct names in kernels/quant.cu).
QUANT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K", "IQ2_XXS", "MXFP4")
_QUANT_KERNELS = ("gemv", "moe_gemv", "dequant_rows")
_OPTIONS = ("--std=c++17",)


def source(name: str) -> str:
    """Text of ``kernels/<name>`` shipped in this package."""
    return resources.files(__package__).joinpath("kernels", name).read_text(encoding="utf-8")


@functools.cache
def quant_module() -> Any:
    """The compiled ``quant.cu`` with every (kernel, format) instantiation, IQ2_XXS grid filled in."""
    import cupy

    from ds4_core.quants import _iq2xxs_tables

    names = [f"{kernel}<{qtype}>" for kernel in _QUANT_KERNELS for qtype in QUANT_TYPES]
    module = cupy.RawModule(code=source("quant.cu"), options=_OPTIONS, name_expressions=names)
    grid, _ = _iq2xxs_tables()
    table = cupy.ndarray((grid.size,), cupy.uint8, module.get_global("iq2xxs_grid"))
    table[...] = cupy.asarray(grid.astype(np.uint8).reshape(-1))
    return module


def quant_kernel(kernel: str, qtype: str) -> Any:
    """The ``cupy.RawKernel`` of ``kernel`` (gemv, moe_gemv, dequant_rows) for weight format ``qtype``."""
    return quant_module().get_function(f"{kernel}<{qtype}>")


def warm() -> None:
    """Compile (or load from CuPy's cache) every module now."""
    for qtype in QUANT_TYPES:
        for kernel in _QUANT_KERNELS:
            quant_kernel(kernel, qtype)
