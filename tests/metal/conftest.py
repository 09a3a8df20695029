"""Metal-backend tests run on MLX's CPU device on Linux (``pip install 'mlx[cpu]'``); they skip without MLX."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")


@pytest.fixture(scope="session")
def metal_backend():
    """The Metal backend with its custom kernels left disabled (tests enable them explicitly)."""
    from ds4_backend_metal.backend import MetalBackend

    return MetalBackend(self_test=False)


@pytest.fixture(scope="session")
def numpy_backend():
    from ds4_core.backends.numpy import NumpyBackend

    return NumpyBackend()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# One tiny model per family, built with transformers (random weights) and converted to an f32 GGUF, as in
# tests/glm5/conftest.py and tests/qwen38/conftest.py. Configs keep
# each family's sparse selection active within a few dozen tokens.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    # GLM 5.2: layers F F S F, index_topk 5, 8 experts in 2 groups
    "glm52": ("ds4_model_glm5.tiny", "ds4_model_glm5.convert", {"index_n_heads": 16}),
    # GLM 5.3 Flash: K K K D K D, 4-token pools, top-8 = 2 pools, hc_mult 4
    "glm53": ("ds4_model_glm5.next_tiny", "ds4_model_glm5.next_convert", {}),
    # Qwen3.8: GDN GDN GDN QSA (budget 4, blocks of 2), two PLE layers, sigmoid gate
    "qwen38": ("ds4_model_qwen38.tiny", "ds4_model_qwen38.convert", {}),
}


@pytest.fixture(scope="session")
def family_gguf(tmp_path_factory):
    """``family_gguf(family) -> path`` of a converted tiny model of :data:`FAMILIES`, built once per session."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib

    built = {}

    def get(family: str):
        if family not in built:
            tiny_module, convert_module, overrides = FAMILIES[family]
            directory = tmp_path_factory.mktemp(f"metal-{family}")
            importlib.import_module(tiny_module).build_tiny_hf(directory / "hf", overrides, seed=5)
            built[family] = directory / f"{family}-f32.gguf"
            importlib.import_module(convert_module).convert(directory / "hf", built[family], "f32")
        return built[family]

    return get
