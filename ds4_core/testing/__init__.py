"""Helpers for plugin authors' tests: a fresh plugin manager, descriptor checks, kernel conformance.

``ds4_core.testing.gguf_files`` writes tiny and malformed GGUF files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ..descriptors import resolve
from ..plugins import PluginManager, Registry


def fresh_plugin_manager(*plugins: Any, load_entrypoints: bool = False) -> PluginManager:
    """A plugin manager with the built-ins and ``plugins`` only (installed entry points ignored by default)."""
    pm = PluginManager(load_entrypoints=load_entrypoints, plugins=plugins)
    pm.pm.check_pending()
    return pm


def check_registry(registry: Registry, *, backends: Iterable[str] | None = None) -> list[str]:
    """Resolve every ``module:attr`` a registry names; return the problems found (empty when sound).

    Kernels are resolved only for ``backends`` (default: those whose probe reports them available
    here), since a GPU backend's kernel modules import its GPU library.
    """
    if backends is None:
        backends = [b.name for b in registry.backends.values() if resolve(b.probe)()[0]]
    backends = set(backends)
    problems = []
    refs: list[tuple[str, str | None]] = []
    for m in registry.models.values():
        refs += [(f"model {m.name}.{f}", getattr(m, f)) for f in ("loader", "chat", "converter", "describe", "tiny")]
        missing = sorted(set(m.ops) - registry.ops())
        if missing:
            problems.append(f"model {m.name} uses ops with no numpy reference: {', '.join(missing)}")
    for b in registry.backends.values():
        refs += [(f"backend {b.name}.probe", b.probe), (f"backend {b.name}.factory", b.factory)]
    refs += [(f"kernel {k.op}@{k.backend}", k.impl) for k in registry.kernels.values() if k.backend in backends]
    refs += [(f"sampler {s.name}", s.impl) for s in registry.samplers.values()]
    for label, ref in refs:
        if ref is None:
            continue
        try:
            resolve(ref)
        except Exception as exc:
            problems.append(f"{label}: {exc}")
    for (op, backend) in registry.kernels:
        if backend != "numpy" and (op, "numpy") not in registry.kernels:
            problems.append(f"kernel {op}@{backend} has no numpy reference")
    return problems


def assert_kernels_match(registry: Registry, backend: str, cases: Mapping[str, Callable[[np.random.Generator], Any]],
                         *, to_backend: Callable[[Any], Any], to_numpy: Callable[[Any], np.ndarray],
                         rtol: float = 1e-4, atol: float = 1e-5, seed: int = 0,
                         ops: Iterable[str] | None = None) -> None:
    """Run each op of ``backend`` and its numpy reference on the same random inputs and compare.

    ``cases[op](rng)`` returns ``(args, kwargs)`` of host values; ``to_backend`` moves one argument
    to the backend; ``to_numpy`` brings a result back. Tuples of results are compared element-wise.
    """
    rng = np.random.default_rng(seed)
    for op in ops if ops is not None else sorted(cases):
        args, kwargs = cases[op](rng)
        ref = resolve(registry.kernels[(op, "numpy")].impl)(*args, **kwargs)
        got = resolve(registry.kernels[(op, backend)].impl)(*[to_backend(a) for a in args], **kwargs)
        refs, gots = (ref, got) if isinstance(ref, tuple) else ((ref,), (got,))
        for i, (r, g) in enumerate(zip(refs, gots, strict=True)):
            np.testing.assert_allclose(to_numpy(g), np.asarray(r), rtol=rtol, atol=atol,
                                       err_msg=f"op {op!r} output {i} on backend {backend!r}")
