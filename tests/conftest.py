"""Suite-wide settings and fixtures: under CI, hypothesis runs a fixed set of examples so a red build is
reproducible; ``load_script`` imports a script that no package holds (``benchmarks/``, ``tools/``, another test
file) by its path."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def load_script():
    """A function that imports the Python file at a path as a module of its own, under the name given."""

    def load(path: Path, name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
