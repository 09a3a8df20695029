"""Registration of the DeepSeek V4 family. Imports only the standard library and ds4_core."""

from __future__ import annotations

from collections.abc import Callable

from ds4_core.descriptors import KernelSpec, ModelSpec
from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1


@hookimpl
def register_models(register: Callable[[ModelSpec], None]) -> None:
    from .opnames import GRAPH_OPS

    register(ModelSpec(
        name="deepseek4",
        architectures=("deepseek4",),
        aliases=("deepseek-v4", "deepseek_v4", "dsv4"),
        loader="ds4_model_deepseek4.loader:load",
        chat="ds4_model_deepseek4.chat:DeepSeekV4Chat",
        hf_architectures=("DeepseekV4ForCausalLM", "deepseek_v4"),
        converter="ds4_model_deepseek4.convert:convert",
        ops=GRAPH_OPS,
        describe="ds4_model_deepseek4.describe:describe",
        tiny="ds4_model_deepseek4.tiny:trained_model",
        description="DeepSeek V4 Flash / V4.1 Flash / V4 PRO",
    ))


@hookimpl
def register_kernels(register: Callable[[KernelSpec], None]) -> None:
    from .opnames import MODEL_OPS

    for op in MODEL_OPS:
        register(KernelSpec(op, "numpy", f"ds4_model_deepseek4.ops:{op}"))
