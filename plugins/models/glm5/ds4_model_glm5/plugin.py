"""Registration of the GLM 5.x family. Imports only the standard library and ds4_core.

Two ModelSpecs, one per GGUF architecture, each with its own loader, converter and op list; they share the chat
format (:mod:`.chat`). GLM 5.2 lives in ``model.py``/``convert.py``, GLM 5.3 Flash in ``next_*.py``; the only ops
the family declares itself are in :mod:`.opnames` (the rest are core ops).
"""

from __future__ import annotations

from collections.abc import Callable

from ds4_core.descriptors import KernelSpec, ModelSpec
from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1
_CHAT = "ds4_model_glm5.chat:GlmChat"


@hookimpl
def register_models(register: Callable[[ModelSpec], None]) -> None:
    from .next_opnames import NEXT_GRAPH_OPS
    from .opnames import GRAPH_OPS

    register(ModelSpec(
        name="glm52",
        architectures=("glm-dsa",),
        aliases=("glm5", "glm-5", "glm-5.2", "glm_moe_dsa"),
        loader="ds4_model_glm5.loader:load",
        chat=_CHAT,
        hf_architectures=("GlmMoeDsaForCausalLM", "glm_moe_dsa"),
        converter="ds4_model_glm5.convert:convert",
        ops=GRAPH_OPS,
        describe="ds4_model_glm5.describe:describe",
        description="GLM-5 / 5.1 / 5.2 / full 5.3 (MLA + DSA indexer with IndexShare, sigmoid MoE)",
    ))
    register(ModelSpec(
        name="glm53",
        architectures=("glm5-next",),
        aliases=("glm-5.3-flash", "glm5_next"),
        loader="ds4_model_glm5.next_loader:load",
        chat=_CHAT,
        hf_architectures=("Glm5NextForConditionalGeneration", "glm5_next"),
        converter="ds4_model_glm5.next_convert:convert",
        ops=NEXT_GRAPH_OPS,
        describe="ds4_model_glm5.describe:describe_next",
        tiny="ds4_model_glm5.next_tiny:trained_model",
        description="GLM-5.3 Flash (KDA + NoPE MLA with a pooled indexer, hyper-connections, clamped MoE)",
    ))


@hookimpl
def register_kernels(register: Callable[[KernelSpec], None]) -> None:
    from .opnames import MODEL_OPS

    for op in MODEL_OPS:
        register(KernelSpec(op, "numpy", f"ds4_model_glm5.ops:{op}"))
