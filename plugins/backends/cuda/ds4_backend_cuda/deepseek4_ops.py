"""DeepSeek-V4-only ops on CUDA (same signatures as ``ds4_model_deepseek4.qat``), CuPy float32.

The hyper-connection and softmax-pool ops DeepSeek V4 also calls are core ops (:mod:`.hc_ops`).
"""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

from ds4_core.backend import Weight

from .gemv import act_bytes, gemv_launch, int8_of, moe_gate_up_launch, use_int8, writes_activation
from .modules import glue_kernel
from .moe_ops import MOE_PAIR_LIMIT
from .ops import MAX_GRID_Y, grouped_linear, linear, linears, rms_norm, swiglu, values

F32 = cp.float32

_E4M3 = (448.0, 3, -6)
_E2M1 = (6.0, 1, 0)


def _round_minifloat(x: Any, mantissa_bits: int, min_exp: int) -> Any:
    mag = cp.abs(x).astype(F32)
    exp = cp.floor(cp.log2(cp.maximum(mag, F32(2.0 ** min_exp))))
    quantum = cp.exp2(exp - mantissa_bits).astype(F32)
    return (cp.sign(x) * cp.rint(mag / quantum) * quantum).astype(F32)


def _block_round(x: Any, fmt: tuple[float, int, int], amax_floor: float) -> Any:
    top, mantissa_bits, min_exp = fmt
    amax = cp.maximum(cp.abs(x).max(axis=-1, keepdims=True), F32(amax_floor)).astype(F32)
    scale = cp.exp2(cp.ceil(cp.log2(amax / F32(top)))).astype(F32)
    return (_round_minifloat(cp.clip(x / scale, -top, top), mantissa_bits, min_exp) * scale).astype(F32)


def fp8_kv_round(x: Any, rope_dim: int, block: int = 64) -> Any:
    """FP8 E4M3 round-trip of the leading ``d − rope_dim`` channels of ``x [..., d]`` in blocks of ``block``."""
    out = cp.array(x, dtype=F32)
    nope = x.shape[-1] - rope_dim
    for start in range(0, nope, block):
        stop = min(start + block, nope)
        out[..., start:stop] = _block_round(out[..., start:stop], _E4M3, 1e-4)
    return out


@functools.cache
def _hadamard(d: int) -> Any:
    from ds4_model_deepseek4.qat import hadamard

    return cp.asarray(hadamard(d))


def fp4_hadamard_round(x: Any, block: int = 32) -> Any:
    """Hadamard rotation of ``x [..., d]``, then an FP4 E2M1 round-trip in blocks of ``block``."""
    d = x.shape[-1]
    y = cp.matmul(cp.asarray(x, dtype=F32), _hadamard(d))
    blocks = y.reshape(*y.shape[:-1], d // block, block)
    return _block_round(blocks, _E2M1, 6.0 * 2.0 ** -126).reshape(y.shape)


def compress_step(kv_row: Any, gate_row: Any, ape: Any, pos: Any, buf_kv: Any, buf_gate: Any, prev_kv: Any,
                  prev_gate: Any, rows: Any, norm: Weight, eps: float, inv_freq: Any) -> Any:
    """One token through a compressor, as ``ds4_model_deepseek4``'s ``Compressor.step`` composes it from core ops,
    in two launches (``kernels/compress.cu``): ``kv_row``/``gate_row [1, width]`` (the token's projections) go to
    slot ``pos % m`` of ``buf_kv``/``buf_gate [m, width]`` (gate plus ``ape [m, width]``), the window is pooled,
    normalised with ``norm``, RoPE'd and stored in ``rows [R, d]`` when the token completes it; ``prev_kv``/
    ``prev_gate [m, d]`` (None without overlap) then take its first halves. Writes the state arrays in place and
    returns ``rows``; ``pos`` is an int32 device array ``[1]``, so the launches are the same at every position."""
    m, d = buf_kv.shape[0], rows.shape[1]
    overlap = prev_kv is not None
    none = np.uint64(0)
    pos = cp.ascontiguousarray(pos, dtype=cp.int32)
    pooled = cp.empty(d, dtype=F32)
    glue_kernel("compress_pool")((-(-d // 32),), (32, 8), (  # POOL_CHANNELS x POOL_GROUPS threads
        cp.ascontiguousarray(kv_row, dtype=F32), cp.ascontiguousarray(gate_row, dtype=F32), ape, pos, np.int32(m),
        np.int32(d), np.int32(overlap), buf_kv, buf_gate, prev_kv if overlap else none,
        prev_gate if overlap else none, pooled))
    if rows.shape[0]:
        glue_kernel("compress_finish")((1,), (256,), (
            pooled, pos, np.int32(m), np.int32(d), rows, np.int32(rows.shape[0]),
            cp.ascontiguousarray(values(norm), dtype=F32), F32(eps), cp.ascontiguousarray(inv_freq, dtype=F32),
            np.int32(inv_freq.shape[0])), shared_mem=4 * d)
    return rows


def norm_linear(x: Any, norm: Weight, eps: float, w: Weight) -> Any:
    """``linear(rms_norm(x, norm, eps), w)``, ``x [T, D]``. One token through an int8 GEMV: the norm's scale comes
    from the block's own pass over ``x`` as it quantizes the activation, so the norm takes no launch of its own."""
    x = cp.ascontiguousarray(x, dtype=F32)
    if not (x.ndim == 2 and x.shape[0] == 1 and len(w.shape) == 2 and use_int8(None, w.qtype)
            and x.shape[1] % 32 == 0):
        return linear(rms_norm(x, norm, eps), w)
    y = cp.empty((1, w.shape[0]), dtype=F32)
    kernel, grid, block, args = gemv_launch(w.data, w.qtype, x.shape[1], x, 1, y,
                                            norm=(cp.ascontiguousarray(values(norm), dtype=F32), eps))
    kernel(grid, block, args)
    return y


def output_projection(o: Any, out_a: Weight, out_b: Weight, groups: int) -> Any:
    """The attention's heads ``o [T, H, hd]`` through the grouped output projection: ``groups`` blocks of ``out_a``,
    then ``out_b`` -> ``[T, D]``, as ``ds4_model_deepseek4``'s ``compose_output_projection``. One token on the int8
    path: ``out_a``'s GEMV reads the int8 activation that ``o`` carries (:class:`.ops.Int8Rows`, from the attention's
    merge) and writes its own output quantized, as ``out_b``'s GEMV would quantize it, which that GEMV reads: neither
    quantizes its activation (no prologue, no block barrier), and the result is the same."""
    T = o.shape[0]
    ncols = o.size // (T * groups) if T else 0
    low_rows = groups * (out_a.shape[1] if len(out_a.shape) == 3 else out_a.shape[0] // groups)
    if not (T == 1 and ncols % 8 == 0 and len(out_b.shape) == 2 and out_b.shape[1] == low_rows
            and writes_activation(out_a.qtype, low_rows, ncols) and use_int8(None, out_b.qtype)):
        return linear(grouped_linear(o.reshape(T, groups, -1), out_a).reshape(T, -1), out_b)
    low, y = cp.empty((1, low_rows), dtype=F32), cp.empty((1, out_b.shape[0]), dtype=F32)
    act = cp.empty(act_bytes(low_rows), dtype=cp.uint8)
    kernel, grid, block, args = gemv_launch(out_a.data, out_a.qtype, ncols, cp.ascontiguousarray(o, dtype=F32), 1,
                                            low, groups * ncols, low_rows // groups, act_in=int8_of(o, groups * ncols),
                                            act_out=act)
    kernel(grid, block, args)
    kernel, grid, block, args = gemv_launch(out_b.data, out_b.qtype, low_rows, low, 1, y, act_in=act)
    kernel(grid, block, args)
    return y


def shared_expert(x: Any, gate: Weight, up: Weight, down: Weight, limit: float) -> Any:
    """``down(swiglu(gate x, up x))`` for ``x [T, D]``, as ``ds4_model_deepseek4``'s ``compose_shared_expert``: the
    gate and up projections and the SwiGLU in one launch (the routed experts' ``moe_gate_up`` kernel, with expert 0
    for every token) when the two share a format and few tokens come."""
    act = int8_of(x, gate.shape[1]) if use_int8(None, gate.qtype) else None
    x = cp.ascontiguousarray(x, dtype=F32)
    if x.shape[0] > MOE_PAIR_LIMIT or gate.qtype != up.qtype or gate.shape != up.shape or gate.shape[1] % 8:
        return linear(swiglu(*linears(x, (gate, up)), limit), down)
    h = cp.empty((x.shape[0], gate.shape[0]), dtype=F32)
    one = [Weight(w.name, w.qtype, (1, *w.shape), w.data) for w in (gate, up)]
    kernel, grid, block, args = moe_gate_up_launch(*one, None, x, 1, limit, h, act_in=act)
    kernel(grid, block, args)
    return linear(h, down)


_SELECT_ENTRIES, _SELECT_SLICES = 32, 8  # the block of index_select (SELECT_* in kernels/select.cu)
_RADIX_THREADS = 1024  # the block of index_select_radix (RADIX_THREADS), also the most entries it can choose
# A one-row call (a decode step) of up to this many rows takes the rank-counting kernel: its O(R^2) count is spread
# over ceil(R / 32) blocks, while the radix kernel's single block runs its passes one after another. Timed on the
# H200 in CUDA graphs (k = 512): rank count 3.7, 14.7, 48.9 us and radix 10.3, 17.6, 30.0 us at R = 2048, 8192,
# 16384. Several rows (prefill) always take the radix kernel when k allows: O(T R^2) there is the far larger cost.
_RANK_COUNT_MAX_ROWS = 8192


def _select_kernel(T: int, n: int, k: int) -> str:
    """The kernel of :func:`index_select` for ``scores [T, n]`` and ``k <= n``."""
    return "index_select_radix" if k <= _RADIX_THREADS and (T > 1 or n > _RANK_COUNT_MAX_ROWS) else "index_select"


@functools.cache
def _step_specs(specs: tuple[tuple[int, int], ...]) -> Any:
    """The ``(m, n)`` pairs of :func:`step_index` on the device, made once (on a step's first, eager run: never
    inside a recording)."""
    return cp.asarray(np.array(specs, dtype=np.int32).reshape(-1, 2))


def step_index(pos: Any, window: int, specs: tuple[tuple[int, int], ...]) -> Any:
    """``ds4_model_deepseek4``'s ``compose_step_index`` (a one-token step's index arrays in one int32 buffer) in one
    launch (``step_index`` in ``kernels/select.cu``) where it was a dozen CuPy launches, outside the chain of
    programmatic launches. ``pos [1]`` a device int array."""
    size = 1 + window + sum(1 + (window + n if n else 0) for _, n in specs)
    out = cp.empty(size, dtype=cp.int32)
    table = _step_specs(specs) if specs else np.uint64(0)
    glue_kernel("step_index")((1,), (256,), (cp.ascontiguousarray(pos, dtype=cp.int32), np.int32(window), table,
                                             np.int32(len(specs)), out))
    return out


def index_select(scores: Any, limit: Any, k: int, offset: int, prefix: Any = None) -> Any:
    """The indexer's top-``k`` complete rows (``w < limit[t]``) of ``scores [T, R]`` plus ``offset``, ranked as
    ``topk`` ranks them, ``-1`` where fewer are complete -> int32 ``[T, min(k, R)]``, each row after ``prefix [P]``
    when given (``[T, P + min(k, R)]``); ``ds4_model_deepseek4``'s ``compose_index_select`` in one launch
    (``kernels/select.cu``: a radix select, O(R) per row, or for a short single row or ``k`` over 1024 the rank count,
    O(limit^2)), without host synchronisation. ``limit [T]`` is a device int array."""
    scores = cp.ascontiguousarray(scores, dtype=F32)
    limit = cp.ascontiguousarray(limit, dtype=cp.int32)
    T, n = scores.shape
    k = min(k, n)
    P = 0 if prefix is None else prefix.shape[0]
    out = cp.empty((T, P + k), dtype=cp.int32)
    head = np.uint64(0) if prefix is None else cp.ascontiguousarray(prefix, dtype=cp.int32)
    if k == 0:  # no compressed row yet: only the prefix
        if P:
            out[:] = head
        return out
    name = _select_kernel(T, n, k)
    kernel = glue_kernel(name)
    grid_x, block = ((1, (_RADIX_THREADS,)) if name == "index_select_radix"
                     else (-(-n // _SELECT_ENTRIES), (_SELECT_ENTRIES, _SELECT_SLICES)))
    for r0 in range(0, T, MAX_GRID_Y):
        rows = min(MAX_GRID_Y, T - r0)
        kernel((grid_x, rows), block, (scores[r0:r0 + rows], limit[r0:r0 + rows], np.int32(n), np.int32(k),
                                       np.int32(offset), out[r0:r0 + rows], np.int32(P + k), head, np.int32(P)))
    return out
