"""Registration of the CUDA backend and its kernels. Imports only the standard library and ds4_core."""

from __future__ import annotations

from collections.abc import Callable

from ds4_core.descriptors import BackendSpec, KernelSpec
from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1

#: Ops implemented in :mod:`ds4_backend_cuda.ops` (the core vocabulary).
CORE_OPS: tuple[str, ...] = ("embed", "linear", "grouped_linear", "rms_norm", "rope", "swiglu", "topk",
                             "sparse_attention", "indexer_scores", "moe_route", "moe_experts")
#: Ops implemented in :mod:`ds4_backend_cuda.deepseek4_ops` (DeepSeek V4 only).
DEEPSEEK4_OPS: tuple[str, ...] = ("hc_pre", "hc_post", "hc_head", "softmax_pool", "fp8_kv_round",
                                  "fp4_hadamard_round")
#: GGML types the backend holds (integer tables included).
QUANT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K", "IQ2_XXS", "MXFP4",
                                "I32")


@hookimpl
def register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(
        name="cuda",
        device="gpu",
        probe="ds4_backend_cuda.probe:probe",
        factory="ds4_backend_cuda.backend:CudaBackend",
        priority=100,
        quant_types=QUANT_TYPES,
        aliases=("gpu", "nvidia"),
        description="NVIDIA GPUs through CuPy: raw GGUF blocks on the device, NVRTC-compiled kernels",
    ))


@hookimpl
def register_kernels(register: Callable[[KernelSpec], None]) -> None:
    for op in CORE_OPS:
        register(KernelSpec(op, "cuda", f"ds4_backend_cuda.ops:{op}"))
    for op in DEEPSEEK4_OPS:
        register(KernelSpec(op, "cuda", f"ds4_backend_cuda.deepseek4_ops:{op}"))
