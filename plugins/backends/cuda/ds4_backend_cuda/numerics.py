"""The arithmetic the environment selects: int8 activations for the decode GEMVs and 16-bit tensor cores for the
prefill matmuls, each with its switch to float32."""

from __future__ import annotations

import os

#: Prefill matmul precision: unset/"16" = fp16/bf16 tensor cores (prefill.py; the window attention's products on fp16
#: operands, the gathered attention's in TF32), 5x faster on a whole Flash model; "32" = float32 sgemm on exact
#: weights. tests/cuda/test_default_paths.py bounds what the 16-bit path moves.
PREFILL_ENV = "DS4_CUDA_PREFILL"
#: Environment switch of the integer decode path (int8 activations, ``__dp4a``), taken by one-token launches over
#: the formats of :data:`~.modules.INT8_TYPES`: on unless it is "0" (then the float32-activation kernels run).
INT8_ENV = "DS4_CUDA_INT8"


def tensor_core_prefill() -> bool:
    """Whether prefill matmuls run on 16-bit tensor cores (yes unless ``DS4_CUDA_PREFILL=32``)."""
    return os.environ.get(PREFILL_ENV, "16").strip() != "32"


def int8_enabled() -> bool:
    """Whether the decode launches take the integer path by default (yes unless ``DS4_CUDA_INT8=0``)."""
    return os.environ.get(INT8_ENV, "1").strip() != "0"


def numerics() -> dict[str, str]:
    """The arithmetic the environment selects for decode GEMVs and prefill matmuls, with the switch to the other."""
    return {"decode activations": "int8 (DS4_CUDA_INT8=0: float32)" if int8_enabled() else
            "float32 (unset DS4_CUDA_INT8: int8)",
            "prefill matmuls": "fp16/bf16 tensor cores (DS4_CUDA_PREFILL=32: float32)" if tensor_core_prefill() else
            "float32 (unset DS4_CUDA_PREFILL: fp16/bf16 tensor cores)"}
