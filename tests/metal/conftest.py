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
