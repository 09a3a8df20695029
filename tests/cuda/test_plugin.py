"""CPU-side checks of the CUDA plugin: registration and the probe never need a GPU."""

from __future__ import annotations

import subprocess
import sys

from ds4_backend_cuda import plugin
from ds4_backend_cuda.probe import probe

from ds4_core.descriptors import BackendSpec, KernelSpec
from ds4_core.ops import CORE_OPS


def test_registers_backend_and_a_kernel_for_every_deepseek4_graph_op():
    backends: list[BackendSpec] = []
    kernels: list[KernelSpec] = []
    plugin.register_backends(backends.append)
    plugin.register_kernels(kernels.append)
    assert [b.name for b in backends] == ["cuda"]
    ops = {k.op for k in kernels if k.backend == "cuda"}
    from ds4_model_deepseek4.opnames import GRAPH_OPS, MODEL_OPS

    assert set(GRAPH_OPS) | set(MODEL_OPS) <= ops
    assert set(plugin.CORE_OPS) <= set(CORE_OPS)  # every CUDA core kernel names an op of the vocabulary


def test_importing_the_plugin_and_probing_leave_cupy_unimported():
    code = ("import sys, ds4_backend_cuda.plugin as p; from ds4_backend_cuda.probe import probe; "
            "ok, reason = probe(); assert isinstance(reason, str) and reason; print('cupy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_probe_gives_a_reason_either_way():
    ok, reason = probe()
    assert isinstance(ok, bool) and len(reason) > 10
