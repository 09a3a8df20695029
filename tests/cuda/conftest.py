"""GPU fixtures: tests that touch the device are marked ``gpu`` and skip cleanly without CuPy or a GPU."""

from __future__ import annotations

import functools

import numpy as np
import pytest

#: Decode GEMVs take int8 activations and prefill matmuls 16-bit tensor cores by default; most tests here compare
#: with numpy at float32 tolerance, so they pin the float32 paths. The fast paths are tested against their own
#: bounds (test_int8_gemv.py, test_prefill.py, test_default_paths.py), which ask for them explicitly.
FLOAT32_PATHS = {"DS4_CUDA_INT8": "0", "DS4_CUDA_PREFILL": "32"}


@pytest.fixture(autouse=True, scope="session")
def _float32_paths():
    with pytest.MonkeyPatch.context() as patch:
        for name, value in FLOAT32_PATHS.items():
            patch.setenv(name, value)
        yield


@functools.cache
def _gpu_reason() -> str | None:
    from ds4_backend_cuda.probe import probe

    ok, reason = probe()
    return None if ok else reason


@pytest.fixture(scope="session")
def cuda_backend():
    """The CUDA backend on device 0 (skips the test when no usable GPU)."""
    reason = _gpu_reason()
    if reason is not None:
        pytest.skip(f"no CUDA backend here: {reason}")
    from ds4_backend_cuda.backend import CudaBackend

    return CudaBackend()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def engines(request, tiny_gguf):
    """``{"numpy": Engine, "cuda": Engine}`` on the module's ``tiny_gguf`` (a path, or ``(name, path)``) with a
    context of the module's ``CTX``."""
    from ds4_core.engine import Engine

    path = tiny_gguf[1] if isinstance(tiny_gguf, tuple) else tiny_gguf
    loaded = {name: Engine.load(path, backend=name, ctx=request.module.CTX) for name in ("numpy", "cuda")}
    assert loaded["cuda"].backend.name == "cuda"
    yield loaded
    for engine in loaded.values():
        engine.close()
