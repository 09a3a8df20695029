"""The core op vocabulary on CUDA, but attention (:mod:`.attention_ops`) and the MoE (:mod:`.moe_ops`): the embedding,
projections, norms, RoPE, SwiGLU and top-k, with the same signatures as :mod:`ds4_core.ops`; arrays are CuPy float32.

Quantized matrices are read as raw GGUF blocks: up to :data:`~.gemv.GEMV_TOKENS` tokens go through the GEMV kernels
(:mod:`.gemv`); a prefill's on tensor cores (:mod:`.prefill`), or dequantized row chunks and cuBLAS in float32.
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

from ds4_core.backend import Weight
from ds4_core.errors import BackendError

from .gemv import GEMV_TOKENS, ROWS_PER_WARP, _i32, _i64, gemv_launch, int8_of, use_int8
from .modules import glue_kernel, quant_kernel
from .numerics import tensor_core_prefill
from .prefill import prefill_grouped_linear, prefill_linear, prefill_linears, rope_args

F32 = cp.float32


#: Above this many tokens a linear dequantizes and calls cuBLAS.
GEMV_MAX_TOKENS = 32
#: Elements dequantized per chunk on the float32 matmul path (bounds scratch memory to 256 MiB).
DEQUANT_CHUNK = 1 << 26
_THREADS = 256

def _float_rows(raw: Any, qtype: str, ncols: int) -> Any:
    """Rows of a float-format tensor as float32 with CuPy views (any width)."""
    if qtype == "F32":
        return raw.view(cp.float32).reshape(-1, ncols)
    if qtype == "F16":
        return raw.view(cp.float16).reshape(-1, ncols).astype(F32)
    return (raw.view(cp.uint16).reshape(-1, ncols).astype(cp.uint32) << 16).view(F32)


def dequantize_rows(raw: Any, qtype: str, ncols: int, rows: Any = None, plain: bool = False) -> Any:
    """Rows ``rows`` (int32 ``[n]``, or all) of a raw tensor ``[R, row bytes]`` as float32 ``[n, ncols]``; ``plain``:
    launched without the programmatic attribute (:mod:`.launch`)."""
    if ncols % 8:
        values = _float_rows(raw, qtype, ncols)
        return values if rows is None else values[rows]
    n = raw.shape[0] if rows is None else rows.shape[0]
    out = cp.empty((n, ncols), dtype=F32)
    units = n * ncols // 8
    if units:
        rows_arg = np.uint64(0) if rows is None else cp.ascontiguousarray(rows, dtype=cp.int32)
        kernel = quant_kernel("dequant_rows", qtype)
        (kernel.raw if plain else kernel)(((units + _THREADS - 1) // _THREADS,), (_THREADS,),
                                          (raw, _i64(raw.shape[1]), _i32(ncols), rows_arg, _i32(n), out))
    return out


def values(w: Weight) -> Any:
    """The weight as a float32 CuPy array of its logical shape (a view for F32; small tensors only)."""
    if w.qtype == "F32":
        return w.data.view(F32).reshape(w.shape)
    return dequantize_rows(w.data, w.qtype, w.shape[-1]).reshape(w.shape)


def values_or_null(w: Weight | None) -> Any:
    """A kernel argument for an optional small weight: its contiguous float32 values, or a null pointer."""
    return np.uint64(0) if w is None else cp.ascontiguousarray(values(w), dtype=F32)


def matmul_raw(x: Any, raw: Any, qtype: str, ncols: int) -> Any:
    """``x [T, ncols] @ W.T`` for raw rows ``W [R, row bytes]`` -> float32 ``[T, R]``."""
    x = cp.ascontiguousarray(x, dtype=F32)
    T, nrows = x.shape[0], raw.shape[0]
    out = cp.empty((T, nrows), dtype=F32)
    if T == 0 or nrows == 0:
        return out
    if ncols % 8 == 0 and T <= GEMV_MAX_TOKENS:
        for t0 in range(0, T, GEMV_TOKENS):
            n = min(GEMV_TOKENS, T - t0)
            kernel, grid, block, args = gemv_launch(raw, qtype, ncols, x[t0:t0 + n], n, out[t0:t0 + n])
            kernel(grid, block, args)
        return out
    if tensor_core_prefill():
        return prefill_linear(x, raw, qtype, ncols)
    step = max(1, DEQUANT_CHUNK // ncols)
    for r0 in range(0, nrows, step):
        w = dequantize_rows(raw[r0:r0 + step], qtype, ncols)
        out[:, r0:r0 + step] = x @ w.T
    return out


def embed(w: Weight, ids: Any) -> Any:
    """Rows ``ids`` (int ``[T]``) of the table ``w`` ``[V, D]`` -> ``[T, D]``. A decode step's first launch, so a plain
    one: with the programmatic attribute, the replayed step's next kernel started 10-15 µs after it ended, and steps
    took 3-4 µs longer (docs/performance.md, session 59)."""
    return dequantize_rows(w.data, w.qtype, w.shape[-1], cp.asarray(ids, dtype=cp.int32).reshape(-1), plain=True)


def linear(x: Any, w: Weight) -> Any:
    """``x @ w.T``: ``x [..., in]``, ``w [out, in]`` -> ``[..., out]``. One token that carries its int8 activation
    (:class:`Int8Rows`, such as the model's normalised output for its head): the GEMV reads it in its place."""
    lead = x.shape[:-1]
    act = int8_of(x, w.shape[-1]) if use_int8(None, w.qtype) else None
    if act is not None:
        y = cp.empty((1, w.shape[0]), dtype=F32)
        kernel, grid, block, args = gemv_launch(w.data, w.qtype, w.shape[-1], cp.ascontiguousarray(x, dtype=F32), 1,
                                                y, act_in=act)
        kernel(grid, block, args)
    else:
        y = matmul_raw(x.reshape(-1, x.shape[-1]), w.data, w.qtype, w.shape[-1])
    return y.reshape(*lead, w.shape[0])


@functools.cache
def _segment_table(rows: tuple[int, ...], addresses: tuple[int, ...]) -> Any:
    """Device int64 pairs (first row, base address) of buffers holding ``rows`` rows each, for ``row_at`` in
    kernels/quant.cu. Built once per set of weights, outside CuPy's pools: a decode step's first run allocates in a
    private pool that its CUDA graph owns."""
    starts = np.cumsum((0, *rows[:-1]))
    table = np.array([v for pair in zip(starts, addresses, strict=True) for v in pair], dtype=np.int64)
    memory = cp.cuda.MemoryPointer(cp.cuda.Memory(table.nbytes), 0)
    memory.copy_from_host(table.ctypes.data, table.nbytes)
    return cp.ndarray(table.shape, cp.int64, memory)


def linears(x: Any, weights: tuple[Weight, ...]) -> tuple[Any, ...]:
    """``x @ w.T`` for each of ``weights`` (``[out_i, in]``): ``x [..., in]`` -> ``[..., out_i]`` each. A few tokens
    and one format: one GEMV launch over the matrices' rows in turn (launches, not bytes, are what the small
    projections of a decode step cost); a prefill converts ``x`` to 16 bits once for all of them; else one linear
    each."""
    lead, ncols = x.shape[:-1], x.shape[-1]
    T = int(np.prod(lead))
    first = weights[0]
    if T > GEMV_MAX_TOKENS and tensor_core_prefill() and all(len(w.shape) == 2 for w in weights):
        outs = prefill_linears(x.reshape(T, ncols), tuple((w.data, w.qtype, ncols) for w in weights))
        return tuple(y.reshape(*lead, w.shape[0]) for y, w in zip(outs, weights, strict=True))
    if not (0 < T <= GEMV_TOKENS and ncols % 8 == 0 and len(weights) > 1
            and all(w.qtype == first.qtype and w.shape[1:] == first.shape[1:] and len(w.shape) == 2
                    and w.data.shape[1] == first.data.shape[1] for w in weights)):
        return tuple(linear(x, w) for w in weights)
    rows = tuple(w.shape[0] for w in weights)
    table = _segment_table(rows, tuple(w.data.data.ptr for w in weights))
    out = cp.empty((T, sum(rows)), dtype=F32)
    act = int8_of(x, ncols) if use_int8(None, first.qtype) else None
    kernel, grid, block, args = gemv_launch(first.data, first.qtype, ncols, cp.ascontiguousarray(x, dtype=F32), T,
                                            out, segments=(table, sum(rows)), act_in=act)
    kernel(grid, block, args)
    ends = np.cumsum(rows)
    return tuple(out[:, end - r:end].reshape(*lead, r) for end, r in zip(ends, rows, strict=True))


def grouped_linear(x: Any, w: Weight) -> Any:
    """Block-diagonal projection: ``x [T, G, in]``, ``w [G·out, in]`` or ``[G, out, in]`` -> ``[T, G, out]``."""
    T, groups, ncols = x.shape
    if T > GEMV_MAX_TOKENS and tensor_core_prefill():
        return prefill_grouped_linear(x, w.data, w.qtype, ncols)
    rows = w.shape[1] if len(w.shape) == 3 else w.shape[0] // groups
    out = cp.empty((T, groups, rows), dtype=F32)
    if T <= GEMV_TOKENS and rows % ROWS_PER_WARP == 0 and ncols % 8 == 0 and T > 0:
        x = cp.ascontiguousarray(x, dtype=F32)
        kernel, grid, block, args = gemv_launch(w.data, w.qtype, ncols, x, T, out, groups * ncols, rows)
        kernel(grid, block, args)
        return out
    for g in range(groups):
        out[:, g] = matmul_raw(x[:, g], w.data[g * rows:(g + 1) * rows], w.qtype, ncols)
    return out


def rms_norm(x: Any, w: Weight | None, eps: float) -> Any:
    """``x · rsqrt(mean(x²) + eps) [· w]`` over the last axis, one launch (``kernels/norm.cu``)."""
    x = cp.ascontiguousarray(x, dtype=F32)
    y = cp.empty_like(x)
    if x.size:
        _norm_rows(x, w, eps, y, (np.uint64(0), np.uint64(0), _i32(0), _i32(1)))
    return y


def _norm_threads(d: int) -> int:
    return min(1024, max(32, -(-d // 128) * 32))  # about four elements per thread


#: Float4s a lane of ``rms_norm_warps`` holds (WARP_QUADS in kernels/norm.cu): rows up to 128 of them wide.
_WARP_QUADS = 8


def _warp_rows(x: Any) -> bool:
    """Whether ``x [T, ..., d]`` takes ``rms_norm_warps``: a prefill's short rows."""
    d = x.shape[-1]
    return x.shape[0] > GEMV_MAX_TOKENS and d % 128 == 0 and d <= 128 * _WARP_QUADS


def _norm_rows(x: Any, w: Weight | None, eps: float, y: Any, rope_args: tuple, y16: Any = None,
               y_rows: Any = None) -> None:
    """RMSNorm (and with ``rope_args`` RoPE) of the rows of ``x`` into ``y``, or into ``y16`` (float16; only where
    :func:`_warp_rows`); with ``y_rows`` (int32, one a row of ``x``), row ``r`` into row ``y_rows[r]`` of ``y``."""
    d, rows = x.shape[-1], x.size // x.shape[-1]
    scale = values_or_null(w)
    if _warp_rows(x) and y_rows is None:
        glue_kernel("rms_norm_warps")((-(-rows // 8),), (256,), (
            x, scale, _i32(d), F32(eps), y if y16 is None else np.uint64(0), np.uint64(0) if y16 is None else y16,
            _i64(rows), *rope_args))
        return
    glue_kernel("rms_norm_rows")((rows,), (_norm_threads(d),), (x, scale, _i32(d), F32(eps), y, *rope_args,
                                                                 np.uint64(0) if y_rows is None else y_rows))


def norm_rope(x: Any, w: Weight | None, eps: float, positions: Any, inv_freq: Any) -> Any:
    """:func:`rope` of :func:`rms_norm`, ``x [T, ..., d]``, in one launch where a block's threads hold a row
    (``d`` up to 8 · 1024)."""
    return _norm_rope(x, w, eps, positions, inv_freq, F32)


def norm_rope_into(x: Any, w: Weight | None, eps: float, positions: Any, inv_freq: Any, out: Any, rows: Any) -> None:
    """:func:`norm_rope` of ``x [T, d]`` written to the rows ``rows [T]`` (int32, on the device) of ``out [R, d]``:
    one launch that writes the rows where they go (a decode step's raw row into its ring slot), not a CuPy copy after
    it, which would sit outside the chain of programmatic launches."""
    x = cp.ascontiguousarray(x, dtype=F32)
    rope_args = _row_rope_args(x, positions, inv_freq)
    if (rope_args is None or x.ndim != 2 or out.dtype != F32 or out.shape[1:] != x.shape[1:]
            or not out.flags.c_contiguous or rows.size != x.shape[0]):
        out[rows] = norm_rope(x, w, eps, positions, inv_freq)
        return
    _norm_rows(x, w, eps, out, rope_args, y_rows=cp.ascontiguousarray(rows, dtype=cp.int32).reshape(-1))


def _row_rope_args(x: Any, positions: Any, inv_freq: Any) -> tuple | None:
    """The RoPE arguments of :func:`_norm_rows` for ``x [T, ..., d]`` (float32, contiguous) at ``positions [T]``, or
    None where the one-launch kernels do not take it (no rows, or wider than a block's threads hold)."""
    d = x.shape[-1]
    args = rope_args(positions, inv_freq)
    if not x.size or d > 8 * _norm_threads(d) or args[0].size != x.shape[0]:
        return None
    return *args, _i32(x.size // d // x.shape[0])


def _norm_rope(x: Any, w: Weight | None, eps: float, positions: Any, inv_freq: Any, dtype: Any) -> Any:
    """:func:`norm_rope` as ``dtype``: float32, or float16 for 16-bit operands (in the launch for a prefill's
    short rows, else by a cast)."""
    x = cp.ascontiguousarray(x, dtype=F32)
    rope_args = _row_rope_args(x, positions, inv_freq)
    if rope_args is None:
        return rope(rms_norm(x, w, eps), positions, inv_freq).astype(dtype, copy=False)
    if dtype != F32 and _warp_rows(x):
        y16 = cp.empty(x.shape, dtype=cp.float16)
        _norm_rows(x, w, eps, None, rope_args, y16)
        return y16
    y = cp.empty_like(x)
    _norm_rows(x, w, eps, y, rope_args)
    return y.astype(dtype, copy=False)


def rope(x: Any, positions: Any, inv_freq: Any, inverse: bool = False) -> Any:
    """Interleaved RoPE on the trailing ``2·len(inv_freq)`` channels of ``x [T, ..., d]``, one launch."""
    x = cp.ascontiguousarray(x, dtype=F32)
    y = cp.empty_like(x)
    if x.size:
        pos, freq, half = rope_args(positions, inv_freq)
        if pos.size != x.shape[0]:
            raise BackendError(f"rope needs one position per token: {pos.size} positions for {x.shape[0]} tokens")
        d = x.shape[-1]
        glue_kernel("rope_rows")((-(-x.size // _THREADS),), (_THREADS,), (
            x, pos, freq, _i64(x.size), _i32(d), half, _i32(x.size // d // x.shape[0]), _i32(int(inverse)), y))
    return y


def weighted_rows(w: Any, rows: Any) -> Any:
    """``Σ_j w[t, j] · rows[t, j]`` -> ``[T, D]`` for ``w [T, n]`` and ``rows [T, n, D]``, in one launch."""
    rows, w = cp.ascontiguousarray(rows, dtype=F32), cp.ascontiguousarray(w, dtype=F32)
    T, n, D = rows.shape
    out = cp.empty((T, D), F32)
    if out.size:
        block = min(256, -(-D // 32) * 32)
        glue_kernel("hc_collapse")((-(-D // block), T), (block,), (w, rows, _i32(n), _i32(D), out))
    return out


_swiglu_kernel = cp.ElementwiseKernel(
    "float32 g, float32 u, float32 limit", "float32 out",
    """
    float gg = g, uu = u;
    if (limit > 0) { gg = fminf(gg, limit); uu = fminf(fmaxf(uu, -limit), limit); }
    out = gg / (1.0f + expf(-gg)) * uu;
    """,
    "ds4_swiglu")


def swiglu(gate: Any, up: Any, limit: float) -> Any:
    """``silu(min(gate, L)) · clip(up, -L, L)`` elementwise; ``limit <= 0`` means no clamp."""
    return _swiglu_kernel(gate.astype(F32, copy=False), up.astype(F32, copy=False), F32(limit))


_SELECT_THREADS = 256
#: Most blocks a launch takes along grid y.
MAX_GRID_Y = 65535


def topk(scores: Any, k: int) -> Any:
    """Indices ``[T, min(k, R)]`` (int32) of the ``k`` largest of each row of ``scores [T, R]``, largest first, ties
    to the lowest index; on the device, without host synchronisation (``kernels/select.cu``)."""
    scores = cp.ascontiguousarray(scores, dtype=F32)
    T, n = scores.shape
    k = min(k, n)
    out = cp.empty((T, k), dtype=cp.int32)
    kernel = glue_kernel("topk_rank")
    for r0 in range(0, T if k else 0, MAX_GRID_Y):
        rows = min(MAX_GRID_Y, T - r0)
        kernel((-(-n // _SELECT_THREADS), rows), (_SELECT_THREADS,), (scores[r0:r0 + rows], _i32(n), _i32(k),
               out[r0:r0 + rows]), shared_mem=_SELECT_THREADS * 4)
    return out


def _contract(kernel: str, a: Any, b: Any, J: int, n: int) -> Any:
    a, b = cp.ascontiguousarray(a, dtype=F32), cp.ascontiguousarray(b, dtype=F32)
    T, rows = a.shape[:2]
    c = cp.empty((T, rows, n), dtype=F32)
    if c.size:
        batch = np.int64(0 if b.ndim == 2 else b.shape[1] * b.shape[2])
        D = b.shape[-1] if kernel == "dot_rows" else n
        per_block = 4 if kernel == "dot_rows" else 128  # dot_rows: a warp per output; mix_rows: a thread
        glue_kernel(kernel)((-(-n // per_block), rows, T), (128,),
                                             (a, b, c, _i32(rows), _i32(J), _i32(D), batch))
    return c


def contract_dot(a: Any, b: Any) -> Any:
    """``c[t, i, j] = Σ_d a[t, i, d] · b[t, j, d]`` for ``a [T, I, d]`` and ``b [T, J, d]`` (or ``[J, d]``, shared).

    Few tokens: ``kernels/rows.cu`` (CuPy refuses cuBLAS while a decode step is recorded as a graph); else cuBLAS.
    """
    if a.shape[0] > GEMV_TOKENS:
        return cp.einsum("tid,tjd->tij" if b.ndim == 3 else "tid,jd->tij", a, b)
    return _contract("dot_rows", a, b, b.shape[-2], b.shape[-2])


def contract_mix(p: Any, b: Any) -> Any:
    """``c[t, i, d] = Σ_j p[t, i, j] · b[t, j, d]`` for ``p [T, I, J]`` and ``b [T, J, d]`` (or ``[J, d]``)."""
    if p.shape[0] > GEMV_TOKENS:
        return cp.einsum("tij,tjd->tid" if b.ndim == 3 else "tij,jd->tid", p, b)
    return _contract("mix_rows", p, b, b.shape[-2], b.shape[-1])
