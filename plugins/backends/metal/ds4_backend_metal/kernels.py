"""Custom Metal kernels (sources in ``kernels/*.metal``) and the self-test that decides whether each may run.

No Apple GPU is available to this project's CI, so a custom kernel is never trusted blindly: at backend start on a
Mac, :func:`verify_and_enable` runs every kernel on small random inputs and compares it with its MLX-op path (the
exact fallback). Only kernels that pass are enabled; a failing one is logged as a warning and the ops keep using
the MLX-op path. Ops ask :func:`active` for a kernel and get ``None`` when it is not enabled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from importlib import resources

import attrs
import mlx.core as mx
import numpy as np

from ds4_core.log import get_logger

from .quant import RawBlocks, _iq2xxs_tables, dequantize_raw

# Kernels that passed the self-test in this process, by name.
_ENABLED: dict[str, Callable] = {}


def active(name: str) -> Callable | None:
    """The enabled implementation of custom kernel ``name``, or ``None`` (use the MLX-op path)."""
    return _ENABLED.get(name)


def metal_available() -> bool:
    """True when MLX can run Metal kernels here (an Apple GPU)."""
    try:
        return bool(mx.metal.is_available())
    except (AttributeError, RuntimeError):
        return False


def _source(name: str) -> str:
    return resources.files(__package__).joinpath("kernels", f"{name}.metal").read_text()


# ------------------------------------------------------------ kernels and their MLX-op references

def _gemv_reference(x: mx.array, blocks: mx.array, idx: mx.array, qtype: str) -> mx.array:
    """``x [T, k|1, 1, in]`` times raw expert rows ``blocks[idx[t, j]]`` transposed -> ``[T, k, 1, out]``."""
    chosen = dequantize_raw(RawBlocks(blocks[idx], qtype))
    return mx.matmul(x, chosen.swapaxes(-1, -2))


@functools.cache
def _gemv_kernel(name: str) -> Callable:
    inputs = ["x", "blocks", "expert"] + (["grid_table", "sign_table"] if name == "iq2_xxs_gemv" else [])
    return mx.fast.metal_kernel(name=f"ds4_{name}", input_names=inputs, output_names=["y"], source=_source(name))


def _gemv(name: str) -> Callable:
    """The custom gathered-GEMV kernel ``name`` with the signature of :func:`_gemv_reference` (minus qtype)."""
    def run(x: mx.array, blocks: mx.array, idx: mx.array) -> mx.array:
        T, k = idx.shape
        n_in, out, row_bytes = x.shape[-1], blocks.shape[-2], blocks.shape[-1]
        rows = mx.broadcast_to(x.reshape(T, -1, n_in), (T, k, n_in)).reshape(T * k, n_in).astype(mx.float32)
        tables = [t.reshape(-1) for t in _iq2xxs_tables()] if name == "iq2_xxs_gemv" else []
        (y,) = _gemv_kernel(name)(
            inputs=[rows, blocks, idx.reshape(-1).astype(mx.int32), *tables],
            template=[("O", out), ("NB", n_in // 256), ("RB", row_bytes)],
            grid=(32 * out, T * k, 1), threadgroup=(32, 1, 1),
            output_shapes=[(T * k, out)], output_dtypes=[mx.float32])
        return y.reshape(T, k, 1, out)
    return run


@functools.cache
def _sinkhorn_kernel() -> Callable:
    return mx.fast.metal_kernel(name="ds4_sinkhorn", input_names=["logits", "eps"], output_names=["comb"],
                                source=_source("sinkhorn"))


def _sinkhorn_metal(logits: mx.array, iters: int, eps: float) -> mx.array:
    T, n, _ = logits.shape
    (comb,) = _sinkhorn_kernel()(
        inputs=[logits.astype(mx.float32), mx.array([eps], dtype=mx.float32)],
        template=[("N", n), ("ITERS", iters)], grid=(T, 1, 1), threadgroup=(min(T, 256), 1, 1),
        output_shapes=[(T, n, n)], output_dtypes=[mx.float32])
    return comb


def _sinkhorn_reference(logits: mx.array, iters: int, eps: float) -> mx.array:
    from .hc_ops import sinkhorn

    return sinkhorn(logits, iters, eps)


def _gemv_sample(qtype: str) -> Callable[[np.random.Generator], tuple]:
    def sample(rng: np.random.Generator) -> tuple:
        from ds4_core.quants import block_geometry, random_blocks

        experts, out, n_in, T, k = 4, 8, 512, 3, 2
        nbytes = block_geometry(qtype)[1] * (n_in // 256)
        blocks = random_blocks(qtype, experts * out * n_in // 256, rng).reshape(experts, out, nbytes)
        x = rng.standard_normal((T, 1, 1, n_in)).astype(np.float32)
        idx = rng.integers(0, experts, (T, k)).astype(np.int32)
        return mx.array(x), mx.array(blocks), mx.array(idx)
    return sample


def _sinkhorn_sample(rng: np.random.Generator) -> tuple:
    return mx.array(rng.standard_normal((5, 4, 4)).astype(np.float32) * 3), 20, 1e-6


@functools.cache
def _delta_kernel() -> Callable:
    return mx.fast.metal_kernel(name="ds4_gated_delta_rule", input_names=["q", "k", "v", "g", "beta", "state"],
                                output_names=["o", "new_state"], source=_source("gated_delta_rule"))


def _delta_metal(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                 state: mx.array) -> tuple[mx.array, mx.array]:
    """The custom gated-delta-rule kernel with the signature of :func:`.recurrent_ops.delta_rule_steps`."""
    T, H, dk = k.shape
    dv = v.shape[-1]
    return tuple(_delta_kernel()(
        inputs=[a.astype(mx.float32) for a in (q, k, v, g, beta, state)],
        template=[("H", H), ("DK", dk), ("DV", dv), ("GK", g.shape[-1])],
        grid=(dv, H, 1), threadgroup=(min(dv, 256), 1, 1),
        output_shapes=[(T, H, dv), (H, dk, dv)], output_dtypes=[mx.float32, mx.float32]))


def _delta_reference(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                     state: mx.array) -> tuple[mx.array, mx.array]:
    from .recurrent_ops import delta_rule_steps

    return delta_rule_steps(q, k, v, g, beta, state)


def _delta_sample(per_channel: bool) -> Callable[[np.random.Generator], tuple]:
    def sample(rng: np.random.Generator) -> tuple:
        T, H, dk, dv = 3, 2, 128, 128  # the head sizes of the released models
        q, k = (rng.standard_normal((T, H, dk)).astype(np.float32) for _ in range(2))
        q, k = q / np.linalg.norm(q, axis=-1, keepdims=True), k / np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.standard_normal((T, H, dv)).astype(np.float32)
        g = -rng.random((T, H, dk if per_channel else 1)).astype(np.float32)
        beta = rng.random((T, H)).astype(np.float32)
        state = rng.standard_normal((H, dk, dv)).astype(np.float32)
        return tuple(mx.array(a) for a in (q, k, v, g, beta, state))
    return sample


@functools.cache
def _attention_kernel() -> Callable:
    return mx.fast.metal_kernel(name="ds4_sparse_attention_gather", input_names=["q", "kv", "idx", "sinks", "scale"],
                                output_names=["out"], source=_source("sparse_attention_gather"))


def _attention_metal(q: mx.array, kv: mx.array, idx: mx.array, sink: mx.array | None, scale: float) -> mx.array:
    """The custom sparse-attention gather with the signature of :func:`.ops.gathered_attention`; ``[T, H, d]``."""
    T, H, d = q.shape
    sinks = mx.zeros((H,), dtype=mx.float32) if sink is None else sink.astype(mx.float32)
    (out,) = _attention_kernel()(
        inputs=[q.astype(mx.float32), kv.astype(mx.float32), idx.astype(mx.int32), sinks,
                mx.array([scale], dtype=mx.float32)],
        template=[("D", d), ("SINK", sink is not None)], grid=(32, H, T), threadgroup=(32, 1, 1),
        output_shapes=[(T, H, d)], output_dtypes=[mx.float32])
    return out


def _attention_reference(q: mx.array, kv: mx.array, idx: mx.array, sink: mx.array | None,
                         scale: float) -> mx.array:
    from .ops import gathered_attention

    return gathered_attention(q, kv, idx, sink, scale)


def _attention_sample(with_sinks: bool) -> Callable[[np.random.Generator], tuple]:
    # DeepSeek V4: head dim 512 with per-head sinks; GLM 5.x: the 576-wide latent (512 + 64 rope), no sinks.
    # K = 640 selected rows, about a quarter of them -1; logits spread like a trained model's (std about 3).
    d = 512 if with_sinks else 576

    def sample(rng: np.random.Generator) -> tuple:
        T, H, N, K = 3, 4, 1024, 640
        q = (rng.standard_normal((T, H, d)) * 3).astype(np.float32)
        kv = rng.standard_normal((N, d)).astype(np.float32)
        idx = np.stack([rng.permutation(N)[:K] for _ in range(T)]).astype(np.int32)
        idx[rng.random((T, K)) < 0.25] = -1
        idx[:, 0] = rng.integers(0, N, T)  # every query sees at least one row (none and no sink is 0/0)
        sink = mx.array((rng.standard_normal(H) * 2 + 4).astype(np.float32)) if with_sinks else None
        return mx.array(q), mx.array(kv), mx.array(idx), sink, d ** -0.5
    return sample


@attrs.frozen
class CustomKernel:
    """A custom kernel: ``build()`` compiles it (Metal only); ``reference`` is its exact MLX-op path with the same
    signature; ``sample(rng)`` makes small random arguments; outputs (an array or a tuple of arrays) must agree within
    ``rtol``/``atol``."""

    name: str
    build: Callable[[], Callable]
    reference: Callable
    sample: Callable[[np.random.Generator], tuple]
    rtol: float = 1e-4
    atol: float = 1e-5
    #: Stem of its ``kernels/*.metal`` source (the name unless kernels share one).
    source: str = attrs.field(default=attrs.Factory(lambda self: self.name, takes_self=True))


KERNELS: dict[str, CustomKernel] = {k.name: k for k in (
    CustomKernel("iq2_xxs_gemv", lambda: _gemv("iq2_xxs_gemv"),
                 lambda x, b, i: _gemv_reference(x, b, i, "IQ2_XXS"), _gemv_sample("IQ2_XXS")),
    CustomKernel("q2_k_gemv", lambda: _gemv("q2_k_gemv"),
                 lambda x, b, i: _gemv_reference(x, b, i, "Q2_K"), _gemv_sample("Q2_K")),
    CustomKernel("sinkhorn", lambda: _sinkhorn_metal, _sinkhorn_reference, _sinkhorn_sample),
    CustomKernel("gated_delta_rule", lambda: _delta_metal, _delta_reference, _delta_sample(False)),
    CustomKernel("gated_delta_rule_kda", lambda: _delta_metal, _delta_reference, _delta_sample(True),
                 source="gated_delta_rule"),
    CustomKernel("sparse_attention_gather", lambda: _attention_metal, _attention_reference, _attention_sample(True)),
    CustomKernel("sparse_attention_gather_nosink", lambda: _attention_metal, _attention_reference,
                 _attention_sample(False), source="sparse_attention_gather"),
)}


# ------------------------------------------------------------ the self-test

@attrs.frozen
class CheckResult:
    """Outcome of one kernel's self-test: ``status`` is ``"passed"``, ``"failed"`` or ``"skipped"``."""

    name: str
    status: str
    detail: str


def _outputs(result: object) -> list[np.ndarray]:
    """A kernel's result (one array or a tuple of them) as host arrays."""
    return [np.array(a) for a in (result if isinstance(result, tuple | list) else (result,))]


def check(kernel: CustomKernel, impl: Callable, seed: int = 0) -> CheckResult:
    """Run ``impl`` and ``kernel.reference`` on the same random inputs and compare every output."""
    args = kernel.sample(np.random.default_rng(seed))
    wanted = _outputs(kernel.reference(*args))
    try:
        got_all = _outputs(impl(*args))
    except Exception as exc:  # a kernel that does not even compile or run is a failed kernel
        return CheckResult(kernel.name, "failed", f"raised {type(exc).__name__}: {exc}")
    if len(got_all) != len(wanted):
        return CheckResult(kernel.name, "failed", f"{len(got_all)} outputs, expected {len(wanted)}")
    details = []
    for i, (got, want) in enumerate(zip(got_all, wanted, strict=True)):
        which = f"output {i}: " if len(wanted) > 1 else ""
        if got.shape != want.shape:
            return CheckResult(kernel.name, "failed", f"{which}shape {got.shape}, expected {want.shape}")
        if not np.isfinite(got).all():
            return CheckResult(kernel.name, "failed", f"{which}non-finite output")
        err = float(np.abs(got - want).max())
        bound = kernel.atol + kernel.rtol * float(np.abs(want).max())
        if err > bound:
            return CheckResult(kernel.name, "failed", f"{which}max error {err:.3g} exceeds {bound:.3g}")
        details.append(f"{which}max error {err:.3g} (bound {bound:.3g})")
    return CheckResult(kernel.name, "passed", "; ".join(details))


def verify_and_enable(candidates: Mapping[str, Callable] | None = None,
                      kernels: Iterable[CustomKernel] | None = None) -> list[CheckResult]:
    """Self-test each custom kernel and enable exactly those that pass; return one result per kernel.

    Implementations come from ``candidates`` (by name) when given, else from ``build()`` on a Metal device; without
    Metal a kernel is ``skipped`` and stays disabled. Failures are logged as warnings.
    """
    candidates = dict(candidates or {})
    has_metal = metal_available()
    log = get_logger(backend="metal")
    results = []
    for kernel in kernels if kernels is not None else KERNELS.values():
        _ENABLED.pop(kernel.name, None)
        if kernel.name not in candidates and not has_metal:
            results.append(CheckResult(kernel.name, "skipped", "no Metal device; the MLX-op path is used"))
            continue
        # Building is lazy (MLX compiles at the first call), so compile errors surface inside check().
        impl = candidates.get(kernel.name) or kernel.build()
        result = check(kernel, impl)
        if result.status == "passed":
            _ENABLED[kernel.name] = impl
        else:
            log.warning("custom Metal kernel disabled; using the exact MLX-op path", kernel=kernel.name,
                        reason=result.detail)
        results.append(result)
    return results


def disable_all() -> None:
    """Disable every custom kernel (the MLX-op paths run)."""
    _ENABLED.clear()
