"""Registration of the Metal (MLX) backend, its kernels and its self-test. Imports no MLX."""

from __future__ import annotations

import sys
from collections.abc import Callable

from ds4_core.descriptors import BackendSpec, KernelSpec
from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1

#: Core ops (:mod:`ds4_core.ops` and its ``ops_hc`` / ``ops_recurrent`` parts), by implementing module.
CORE_OPS: dict[str, tuple[str, ...]] = {
    "ops": ("embed", "linear", "grouped_linear", "rms_norm", "rope", "swiglu", "topk", "sparse_attention",
            "indexer_scores", "moe_route", "moe_experts"),
    "hc_ops": ("hc_pre", "hc_post", "hc_head", "softmax_pool"),
    "recurrent_ops": ("short_conv", "gated_delta_rule", "gated_delta_rule_chunked"),
}
#: Ops a model family declares itself, by implementing module.
MODEL_OPS: dict[str, tuple[str, ...]] = {
    "deepseek4_ops": ("fp8_kv_round", "fp4_hadamard_round"),
    "glm5_ops": ("layer_norm", "moe_route_sigmoid"),
    "qwen38_ops": ("rope_half", "hc_mix", "gqa_attention", "moe_route_softmax"),
}
#: GGML types the backend holds (integer tables included).
QUANT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K", "IQ2_XXS", "MXFP4",
                                "I32")


@hookimpl
def register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(
        name="metal",
        device="gpu",
        probe="ds4_backend_metal.probe:probe",
        factory="ds4_backend_metal.backend:MetalBackend",
        # On a Mac MLX means the GPU; elsewhere it is MLX's CPU device, which `auto` should not prefer to numpy.
        priority=90 if sys.platform == "darwin" else -10,
        quant_types=QUANT_TYPES,
        aliases=("mlx",),
        self_test="ds4_backend_metal.selftest:self_test",
        description="Apple GPUs through MLX: exact MLX-quantized weights, self-tested custom Metal kernels",
    ))


@hookimpl
def register_kernels(register: Callable[[KernelSpec], None]) -> None:
    for table in (CORE_OPS, MODEL_OPS):
        for module, ops in table.items():
            for op in ops:
                register(KernelSpec(op, "metal", f"ds4_backend_metal.{module}:{op}"))
