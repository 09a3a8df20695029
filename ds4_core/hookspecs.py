"""The plugin contract: every hook a ds4 plugin may implement.

Each hook receives a ``register`` callback (or, for commands, the click group)
and hands it descriptors from :mod:`ds4_core.descriptors`. Hook
implementations must be cheap: import heavy libraries only inside the
implementations the descriptors name.
"""

from __future__ import annotations

from collections.abc import Callable

import click
import pluggy

from .descriptors import BackendSpec, DrafterSpec, KernelSpec, KVStoreSpec, ModelSpec, SamplerSpec

hookspec = pluggy.HookspecMarker("ds4")
hookimpl = pluggy.HookimplMarker("ds4")


@hookspec
def register_models(register: Callable[[ModelSpec], None]) -> None:
    """Register model families: call ``register(ModelSpec(...))`` once per family."""


@hookspec
def register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register compute backends: call ``register(BackendSpec(...))`` once per backend."""


@hookspec
def register_kernels(register: Callable[[KernelSpec], None]) -> None:
    """Register op implementations: call ``register(KernelSpec(op, backend, impl))``.

    A kernel for backend ``"numpy"`` declares the op and is its reference.
    """


@hookspec
def register_samplers(register: Callable[[SamplerSpec], None]) -> None:
    """Register sampler-chain stages: call ``register(SamplerSpec(name, order, impl))``."""


@hookspec
def register_kv_stores(register: Callable[[KVStoreSpec], None]) -> None:
    """Register session stores: call ``register(KVStoreSpec(name, factory))``."""


@hookspec
def register_drafters(register: Callable[[DrafterSpec], None]) -> None:
    """Register speculative drafters: call ``register(DrafterSpec(name, models, factory))``."""


@hookspec
def register_commands(cli: click.Group) -> None:
    """Add click commands to the ``ds4`` group with ``cli.add_command(...)``.

    Keep module-level imports light; import heavy modules inside the command body.
    """
