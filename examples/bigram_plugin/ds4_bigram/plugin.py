"""Hook implementations: imports only ds4_core and the standard library, names everything else lazily."""

from __future__ import annotations

from collections.abc import Callable

from ds4_core.descriptors import ModelSpec
from ds4_core.hookspecs import hookimpl

DS4_PLUGIN_API = 1


@hookimpl
def register_models(register: Callable[[ModelSpec], None]) -> None:
    register(ModelSpec(
        name="bigram",
        architectures=("bigram",),
        loader="ds4_bigram.model:load",
        ops=("embed", "linear"),
        description="bigram language model (example plugin)",
    ))
