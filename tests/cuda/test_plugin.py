"""CPU-side checks of the CUDA plugin: registration and the probe never need a GPU."""

from __future__ import annotations

import functools
import subprocess
import sys

from ds4_backend_cuda import plugin
from ds4_backend_cuda.probe import device_verdict, probe

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


@functools.cache
def _top_level_names(module: str) -> frozenset[str]:
    """Names a module of the package binds at top level, read from its source (no import, so no CuPy)."""
    import ast
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    names: set[str] = set()
    for node in ast.parse(Path(spec.origin).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return frozenset(names)


def test_gpu_tests_use_what_the_backend_modules_define():
    """The GPU tests skip here, so a name they take from a module of the package that no longer defines it would
    only fail on a GPU: every ``from ds4_backend_cuda.m import f`` and every ``alias.f`` of a module imported as
    ``from ds4_backend_cuda import m as alias`` must name something ``m`` binds at top level."""
    import ast
    from pathlib import Path

    package, checked = "ds4_backend_cuda", 0

    def modules_imported(scope: ast.AST) -> dict[str, str]:  # alias -> module, and each imported name checked
        nonlocal checked
        aliases = {}
        for node in ast.walk(scope):
            if isinstance(node, ast.ImportFrom) and node.module == package:
                aliases |= {a.asname or a.name: f"{package}.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package + "."):
                for a in node.names:
                    assert a.name in _top_level_names(node.module), f"{path.name}: {node.module}.{a.name}"
                    checked += 1
        return aliases

    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = modules_imported(ast.Module(body=[n for n in tree.body if not isinstance(n, ast.FunctionDef)],
                                          type_ignores=[]))
        for scope in (n for n in tree.body if isinstance(n, ast.FunctionDef)):  # imports inside a test are its own
            aliases = top | modules_imported(scope)
            for node in ast.walk(scope):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                    module = aliases[node.value.id]
                    assert node.attr in _top_level_names(module), f"{path.name}:{node.lineno}: {module}.{node.attr}"
                    checked += 1
    assert checked > 100  # the tests do take most of what they run from the package


def test_importing_the_plugin_and_probing_leave_cupy_unimported():
    code = ("import sys, ds4_backend_cuda.plugin as p; from ds4_backend_cuda.probe import probe; "
            "ok, reason = probe(); assert isinstance(reason, str) and reason; print('cupy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_probe_gives_a_reason_either_way():
    ok, reason = probe()
    assert isinstance(ok, bool) and len(reason) > 10


def test_device_verdict_refuses_devices_below_ampere_with_the_numbers():
    info = {"count": 1, "name": "Tesla T4", "cc": [7, 5], "cupy": "14.2.0"}
    ok, reason = device_verdict(info)
    assert not ok and "Tesla T4" in reason and "7.5" in reason and "8.0" in reason
    ok, reason = device_verdict({**info, "name": "NVIDIA A100", "cc": [8, 0]})
    assert ok and reason == "NVIDIA A100 (compute capability 8.0), CuPy 14.2.0"
    ok, reason = device_verdict({**info, "count": 0})
    assert not ok and "CUDA_VISIBLE_DEVICES" in reason
