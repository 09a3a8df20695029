"""Descriptors that plugins hand to the registration hooks.

Each descriptor is a small frozen value. Implementations are named by
``"module:attr"`` strings and imported only when chosen, so listing plugins
never imports a GPU library.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

from .errors import PluginError


def resolve(ref: str) -> Any:
    """Import ``"package.module:attr.sub"`` and return the named object."""
    module_name, _, attr_path = ref.partition(":")
    if not module_name or not attr_path:
        raise PluginError(f"implementation reference {ref!r} is not of the form 'module:attr'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"cannot import {module_name!r} for {ref!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"{ref!r}: module {module_name!r} has no attribute {attr_path!r}") from exc
    return obj


def _ref(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or value.count(":") != 1):
        raise PluginError(f"{type(instance).__name__}.{attribute.name} must be a 'module:attr' string, got {value!r}")


def _tuple(value: Any) -> tuple:
    return tuple(value)


@attrs.frozen
class ModelSpec:
    """A model family.

    ``loader`` names ``load(gguf, weights, ops, options) -> Model`` (see :mod:`ds4_core.model`);
    ``ops`` lists the ops the graph calls, checked against the backend before any weight loads;
    ``chat`` names a zero-argument factory of a :class:`ds4_core.chat.ChatFormat`;
    ``converter`` names ``convert(src_dir, out_path, outtype, progress) -> None`` for the
    Hugging Face ``hf_architectures`` it accepts; ``describe`` names
    ``describe(gguf) -> dict[str, str]`` (the summary ``ds4 info`` prints); ``tiny`` names
    ``tiny_model(cache_dir) -> Path``, the small embedded model ``-m tiny:<name>`` selects.
    """

    name: str
    architectures: tuple[str, ...] = attrs.field(converter=_tuple)
    loader: str = attrs.field(validator=_ref)
    chat: str | None = attrs.field(default=None, validator=_ref)
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    hf_architectures: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    converter: str | None = attrs.field(default=None, validator=_ref)
    ops: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    describe: str | None = attrs.field(default=None, validator=_ref)
    tiny: str | None = attrs.field(default=None, validator=_ref)
    description: str = ""


@attrs.frozen
class BackendSpec:
    """A compute backend.

    ``probe`` names ``probe() -> tuple[bool, str]`` (available, reason); it must be
    cheap and must not initialise a device in the calling process. ``factory`` names
    ``create(**options) -> Backend`` (see :mod:`ds4_core.backend`). ``self_test`` optionally names
    ``self_test() -> list[dict]`` (rows with ``check``, ``status`` in passed/failed/skipped, ``detail``),
    what ``ds4 backends --self-test`` runs.
    """

    name: str
    device: str
    probe: str = attrs.field(validator=_ref)
    factory: str = attrs.field(validator=_ref)
    priority: int = 0
    quant_types: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    aliases: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    self_test: str | None = attrs.field(default=None, validator=_ref)
    description: str = ""


@attrs.frozen
class KernelSpec:
    """An implementation of op ``op`` for backend ``backend``.

    The kernel registered for backend ``"numpy"`` is the op's reference: an op
    exists in the vocabulary exactly when it has one.
    """

    op: str
    backend: str
    impl: str = attrs.field(validator=_ref)
    doc: str = ""


@attrs.frozen
class SamplerSpec:
    """A stage of the sampler chain; stages run in ascending ``order``.

    ``impl`` names ``stage(candidates, params) -> candidates`` (see :mod:`ds4_core.sampling`).
    """

    name: str
    order: int
    impl: str = attrs.field(validator=_ref)
    description: str = ""


@attrs.frozen
class KVStoreSpec:
    """Session persistence: ``factory`` names ``create(directory, budget_bytes, **options)``."""

    name: str
    factory: str = attrs.field(validator=_ref)
    description: str = ""


@attrs.frozen
class DrafterSpec:
    """A speculative drafter for the model families named in ``models``."""

    name: str
    models: tuple[str, ...] = attrs.field(converter=_tuple)
    factory: str = attrs.field(validator=_ref)
    description: str = ""
