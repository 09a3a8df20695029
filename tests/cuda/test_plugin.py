"""CPU-side checks of the CUDA plugin: registration and the probe never need a GPU."""

from __future__ import annotations

import subprocess
import sys

from ds4_backend_cuda import plugin
from ds4_backend_cuda.probe import probe

from ds4_core.descriptors import BackendSpec, KernelSpec
from ds4_core.ops import CORE_OPS


def _cuda_ops() -> set[str]:
    kernels: list[KernelSpec] = []
    plugin.register_kernels(kernels.append)
    assert {k.backend for k in kernels} == {"cuda"}
    return {k.op for k in kernels}


def test_registers_backend_and_a_kernel_for_every_deepseek4_graph_op():
    backends: list[BackendSpec] = []
    plugin.register_backends(backends.append)
    assert [b.name for b in backends] == ["cuda"]
    from ds4_model_deepseek4.opnames import FUSED_OPS, GRAPH_OPS, MODEL_OPS

    assert set(GRAPH_OPS) | set(MODEL_OPS) | set(FUSED_OPS) <= _cuda_ops()
    assert set(plugin.CORE_OPS) == set(CORE_OPS)  # the whole core vocabulary, hyper-connection and recurrent ops too


def test_a_kernel_for_every_glm5_and_qwen38_graph_op():
    from ds4_model_glm5.next_opnames import NEXT_GRAPH_OPS
    from ds4_model_glm5.opnames import GRAPH_OPS as GLM52_OPS
    from ds4_model_glm5.opnames import MODEL_OPS as GLM5_MODEL_OPS
    from ds4_model_qwen38.opnames import GRAPH_OPS as QWEN38_OPS
    from ds4_model_qwen38.opnames import MODEL_OPS as QWEN38_MODEL_OPS

    assert set(GLM52_OPS) | set(NEXT_GRAPH_OPS) | set(QWEN38_OPS) <= _cuda_ops()
    assert set(plugin.MODEL_KERNELS["glm5_ops"]) == set(GLM5_MODEL_OPS)
    assert set(plugin.MODEL_KERNELS["qwen38_ops"]) == set(QWEN38_MODEL_OPS)


def test_kernel_references_name_modules_and_functions_of_the_package():
    """Each reference names a module of the package whose source defines that function at top level (read without
    importing it, so without CuPy)."""
    import ast
    import importlib.util
    from pathlib import Path

    for op, ref in plugin.kernel_refs().items():
        module, function = ref.split(":")
        assert function == op and module.startswith("ds4_backend_cuda.")
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, ref
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        assert function in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, ref


def test_importing_the_plugin_and_probing_leave_cupy_unimported():
    code = ("import sys, ds4_backend_cuda.plugin as p; from ds4_backend_cuda.probe import probe; "
            "ok, reason = probe(); assert isinstance(reason, str) and reason; print('cupy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_probe_gives_a_reason_either_way():
    ok, reason = probe()
    assert isinstance(ok, bool) and len(reason) > 10
