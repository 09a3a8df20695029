"""Plugin discovery and the registries built from the hooks.

Plugins are found through entry points in group ``ds4`` (plus the built-in
modules in :data:`DEFAULT_PLUGINS`). One failing plugin never stops the others:
its error is recorded, logged, shown by ``ds4 plugins`` and named in selection
errors. Environment variables:

``DS4_LOAD_PLUGINS``     comma-separated allow-list of entry-point names (empty: none)
``DS4_DISABLE_PLUGINS``  comma-separated deny-list of entry-point names
``DS4_STRICT_PLUGINS``   any non-empty value: a failing plugin raises instead
``DS4_TRACE_PLUGINS``    any non-empty value: log every hook call
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from importlib import metadata
from typing import Any

import attrs
import pluggy

from . import PLUGIN_API_VERSION, hookspecs
from .descriptors import BackendSpec, DrafterSpec, KernelSpec, KVStoreSpec, ModelSpec, SamplerSpec
from .errors import PluginError

ENTRY_POINT_GROUP = "ds4"
DEFAULT_PLUGINS: tuple[str, ...] = ("ds4_core.builtin",)


@attrs.frozen
class PluginInfo:
    """What ``ds4 plugins`` reports about one plugin."""

    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...] = ()
    error: str | None = None


@attrs.define
class Registry:
    """Everything the plugins registered, keyed by name."""

    models: dict[str, ModelSpec] = attrs.Factory(dict)
    backends: dict[str, BackendSpec] = attrs.Factory(dict)
    kernels: dict[tuple[str, str], KernelSpec] = attrs.Factory(dict)
    samplers: dict[str, SamplerSpec] = attrs.Factory(dict)
    kv_stores: dict[str, KVStoreSpec] = attrs.Factory(dict)
    drafters: dict[str, DrafterSpec] = attrs.Factory(dict)
    owners: dict[tuple[str, str], str] = attrs.Factory(dict)

    def model_for_architecture(self, arch: str) -> ModelSpec | None:
        for spec in self.models.values():
            if arch in spec.architectures:
                return spec
        return None

    def model_for_hf_architecture(self, hf_arch: str) -> ModelSpec | None:
        for spec in self.models.values():
            if hf_arch in spec.hf_architectures:
                return spec
        return None

    def backend(self, name: str) -> BackendSpec | None:
        for spec in self.backends.values():
            if name == spec.name or name in spec.aliases:
                return spec
        return None

    def kernels_for(self, backend: str) -> dict[str, KernelSpec]:
        return {op: k for (op, b), k in self.kernels.items() if b == backend}

    def ops(self) -> set[str]:
        """The op vocabulary: every op with a numpy reference."""
        return {op for (op, b) in self.kernels if b == "numpy"}


def _env_list(name: str) -> list[str] | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


class PluginManager:
    """A pluggy manager for group ``ds4`` with per-plugin failure isolation."""

    def __init__(self, *, load_entrypoints: bool = True, plugins: Iterable[Any] = (),
                 defaults: Iterable[str] = DEFAULT_PLUGINS):
        self.pm = pluggy.PluginManager("ds4")
        self.pm.add_hookspecs(hookspecs)
        self.infos: list[PluginInfo] = []
        self._dist_of: dict[str, str] = {}
        self.strict = bool(os.environ.get("DS4_STRICT_PLUGINS"))
        self.trace = bool(os.environ.get("DS4_TRACE_PLUGINS"))
        for module_name in defaults:
            self._add(lambda m=module_name: importlib.import_module(m), module_name, "ds4-core", _version("ds4-core"))
        if load_entrypoints:
            self._load_entrypoints()
        for plugin in plugins:
            name = getattr(plugin, "__name__", type(plugin).__name__)
            self._add(lambda p=plugin: p, name, getattr(plugin, "__dist__", name), "")
        self._registry: Registry | None = None

    def _load_entrypoints(self) -> None:
        allow = _env_list("DS4_LOAD_PLUGINS")
        deny = set(_env_list("DS4_DISABLE_PLUGINS") or ())
        seen: set[str] = set()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in seen or ep.name in deny or (allow is not None and ep.name not in allow):
                continue
            seen.add(ep.name)
            dist = ep.dist.name if ep.dist else ep.name
            version = ep.dist.version if ep.dist else ""
            self._add(ep.load, ep.name, dist, version)

    def _add(self, load: Callable[[], Any], name: str, dist: str, version: str) -> None:
        plugin = None
        try:
            plugin = load()
            api = getattr(plugin, "DS4_PLUGIN_API", PLUGIN_API_VERSION)
            if api != PLUGIN_API_VERSION:
                raise PluginError(f"targets plugin API {api}, this ds4-core provides {PLUGIN_API_VERSION}; "
                                  f"upgrade {dist} or ds4-core so they match")
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except Exception as exc:
            if plugin is not None and self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            message = f"{type(exc).__name__}: {exc}"
            self.infos.append(PluginInfo(name, dist, version, error=message))
            _log_failure(name, dist, message)
            if self.strict:
                raise PluginError(f"plugin {name!r} ({dist}) failed to load: {message}") from exc
            return
        hooks = tuple(sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()))
        self._dist_of[name] = dist
        self.infos.append(PluginInfo(name, dist, version, hooks))

    @property
    def registry(self) -> Registry:
        """The registries, collected once from every registered plugin."""
        if self._registry is None:
            self._registry = self._collect()
        return self._registry

    def _collect(self) -> Registry:
        reg = Registry()
        tables: dict[str, tuple[dict, Callable[[Any], Any]]] = {
            "register_models": (reg.models, lambda s: s.name),
            "register_backends": (reg.backends, lambda s: s.name),
            "register_kernels": (reg.kernels, lambda s: (s.op, s.backend)),
            "register_samplers": (reg.samplers, lambda s: s.name),
            "register_kv_stores": (reg.kv_stores, lambda s: s.name),
            "register_drafters": (reg.drafters, lambda s: s.name),
        }
        for hook_name, (table, key_of) in tables.items():
            caller = getattr(self.pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                owner = impl.plugin_name
                dist = self._dist_of.get(owner, owner)

                def register(spec: Any, _table=table, _key_of=key_of, _dist=dist, _hook=hook_name) -> None:
                    key = _key_of(spec)
                    label = "@".join(key) if isinstance(key, tuple) else key
                    if key in _table:
                        other = reg.owners[(_hook, label)]
                        raise PluginError(f"{_hook}: {label!r} is registered by both {other} and {_dist}; "
                                          f"uninstall one of them or disable it with DS4_DISABLE_PLUGINS")
                    _table[key] = spec
                    reg.owners[(_hook, label)] = _dist
                    if self.trace:
                        print(f"[ds4 plugins] {_hook}: {_dist} registered {label!r}", file=sys.stderr)

                try:
                    impl.function(register)
                except PluginError:
                    raise
                except Exception as exc:
                    message = f"{hook_name} failed: {type(exc).__name__}: {exc}"
                    self._mark_failed(owner, message)
                    if self.strict:
                        raise PluginError(f"plugin {owner!r} ({dist}): {message}") from exc
        return reg

    def _mark_failed(self, name: str, message: str) -> None:
        for i, info in enumerate(self.infos):
            if info.name == name:
                self.infos[i] = attrs.evolve(info, error=message)
        _log_failure(name, self._dist_of.get(name, name), message)

    def add_commands(self, cli: Any) -> None:
        """Let every plugin add its click commands to ``cli``."""
        for impl in self.pm.hook.register_commands.get_hookimpls():
            if self.trace:
                print(f"[ds4 plugins] register_commands: {impl.plugin_name}", file=sys.stderr)
            try:
                impl.function(cli)
            except Exception as exc:
                self._mark_failed(impl.plugin_name, f"register_commands failed: {type(exc).__name__}: {exc}")
                if self.strict:
                    raise

    def errors(self) -> list[PluginInfo]:
        """Plugins that failed to import or whose hooks raised (collects the registries first)."""
        self.registry  # noqa: B018 - hook failures are found while collecting
        return [info for info in self.infos if info.error]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def _log_failure(name: str, dist: str, message: str) -> None:
    from .log import get_logger

    get_logger().warning("plugin failed to load; it is skipped", plugin=name, distribution=dist, error=message)


_default: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager with entry points loaded (created on first use)."""
    global _default
    if _default is None:
        _default = PluginManager()
    return _default
