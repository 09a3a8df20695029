"""Registration of the CUDA backend and its kernels. Imports only the standard library and ds4_core."""

from __future__ import annotations

from collections.abc import Callable

from ds4_core.descriptors import BackendSpec, KernelSpec
from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1

#: The core vocabulary on CUDA, by the module of this package that implements each op.
CORE_KERNELS: dict[str, tuple[str, ...]] = {
    "ops": ("embed", "linear", "grouped_linear", "rms_norm", "rope", "swiglu", "topk"),
    "attention_ops": ("sparse_attention", "indexer_scores"),
    "moe_ops": ("moe_route", "moe_experts"),
    "hc_ops": ("hc_pre", "hc_post", "hc_head", "softmax_pool"),
    "recurrent_ops": ("short_conv", "gated_delta_rule", "gated_delta_rule_chunked"),
}
#: Model-specific ops (declared by the model plugins, numpy references there), by implementing module.
MODEL_KERNELS: dict[str, tuple[str, ...]] = {
    "deepseek4_ops": ("fp8_kv_round", "fp4_hadamard_round", "compress_step", "shared_expert", "index_select",
                      "norm_linear", "output_projection", "step_index"),
    # DeepSeek V4's, beside the core kernels they extend
    "ops": ("linears", "norm_rope", "norm_rope_into"),
    "attention_ops": ("norm_rope_attention", "norm_rope_window_attention"),
    "moe_ops": ("moe_gate_route",),
    "hc_ops": ("hc_pre_norm", "hc_post_pre_norm", "hc_post_head_norm"),
    "glm5_ops": ("layer_norm", "moe_route_sigmoid"),
    "qwen38_ops": ("rope_half", "hc_mix", "gqa_attention", "moe_route_softmax"),
}
CORE_OPS: tuple[str, ...] = tuple(op for ops in CORE_KERNELS.values() for op in ops)
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


def kernel_refs() -> dict[str, str]:
    """``op -> "module:function"`` of every CUDA kernel (core and model-specific)."""
    return {op: f"ds4_backend_cuda.{module}:{op}"
            for table in (CORE_KERNELS, MODEL_KERNELS) for module, ops in table.items() for op in ops}


@hookimpl
def register_kernels(register: Callable[[KernelSpec], None]) -> None:
    for op, ref in kernel_refs().items():
        register(KernelSpec(op, "cuda", ref))
