"""Registration of the Metal (MLX) backend, its kernels and ``ds4 metal-self-test``. Imports no MLX."""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from ds4_core.descriptors import BackendSpec, KernelSpec
from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1

#: Ops implemented in :mod:`ds4_backend_metal.ops` (the core vocabulary).
CORE_OPS: tuple[str, ...] = ("embed", "linear", "grouped_linear", "rms_norm", "rope", "swiglu", "topk",
                             "sparse_attention", "indexer_scores", "moe_route", "moe_experts")
#: Ops implemented in :mod:`ds4_backend_metal.deepseek4_ops` (DeepSeek V4 only).
DEEPSEEK4_OPS: tuple[str, ...] = ("hc_pre", "hc_post", "hc_head", "softmax_pool", "fp8_kv_round",
                                  "fp4_hadamard_round")
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
        description="Apple GPUs through MLX: exact MLX-quantized weights, self-tested custom Metal kernels",
    ))


@hookimpl
def register_kernels(register: Callable[[KernelSpec], None]) -> None:
    for op in CORE_OPS:
        register(KernelSpec(op, "metal", f"ds4_backend_metal.ops:{op}"))
    for op in DEEPSEEK4_OPS:
        register(KernelSpec(op, "metal", f"ds4_backend_metal.deepseek4_ops:{op}"))


@click.command("metal-self-test")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def metal_self_test(as_json: bool) -> None:
    """Run the custom Metal kernels against their exact MLX-op paths (what the backend does at load)."""
    from .selftest_command import run_self_test_command

    run_self_test_command(as_json=as_json)


@hookimpl
def register_commands(cli: click.Group) -> None:
    cli.add_command(metal_self_test)
