"""The plugin ds4-core registers for itself: the numpy backend, its kernels and the sampler stages."""

from __future__ import annotations

from collections.abc import Callable

from .descriptors import BackendSpec, KernelSpec, SamplerSpec
from .hookspecs import hookimpl


@hookimpl
def register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(BackendSpec(
        name="numpy",
        device="cpu",
        probe="ds4_core.backends.numpy:probe",
        factory="ds4_core.backends.numpy:NumpyBackend",
        priority=0,
        quant_types=("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K", "IQ2_XXS", "MXFP4", "I32"),
        description="reference backend: plain numpy in float32 on the CPU (exact, slow)",
    ))


@hookimpl
def register_kernels(register: Callable[[KernelSpec], None]) -> None:
    from .ops import CORE_OPS

    for op, fn in CORE_OPS.items():
        doc = (fn.__doc__ or "").strip().split("\n")[0]
        register(KernelSpec(op, "numpy", f"{fn.__module__}:{fn.__name__}", doc=doc))


@hookimpl
def register_samplers(register: Callable[[SamplerSpec], None]) -> None:
    from .sampling import SAMPLER_SPECS

    for spec in SAMPLER_SPECS:
        register(spec)
