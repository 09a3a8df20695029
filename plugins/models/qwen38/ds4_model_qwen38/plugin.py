"""Registration of the Qwen3.8 Flash Next family. Imports only the standard library and ds4_core."""

from __future__ import annotations

from collections.abc import Callable

from ds4_core.descriptors import KernelSpec, ModelSpec
from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1


@hookimpl
def register_models(register: Callable[[ModelSpec], None]) -> None:
    from .opnames import GRAPH_OPS

    register(ModelSpec(
        name="qwen38",
        architectures=("qwen4exp", "qwen4_exp"),
        aliases=("qwen3.8", "qwen3.8-flash-next", "qwen4exp"),
        loader="ds4_model_qwen38.loader:load",
        chat="ds4_model_qwen38.chat:Qwen38Chat",
        hf_architectures=("Qwen4ExpForCausalLM", "qwen4_exp_text"),
        converter="ds4_model_qwen38.convert:convert",
        ops=GRAPH_OPS,
        describe="ds4_model_qwen38.describe:describe",
        tiny="ds4_model_qwen38.tiny:trained_model",
        description="Qwen3.8 Flash Next (gated delta-net + QSA attention, n-gram embeddings on disk)",
    ))


@hookimpl
def register_kernels(register: Callable[[KernelSpec], None]) -> None:
    from .opnames import MODEL_OPS

    for op in MODEL_OPS:
        register(KernelSpec(op, "numpy", f"ds4_model_qwen38.ops:{op}"))
