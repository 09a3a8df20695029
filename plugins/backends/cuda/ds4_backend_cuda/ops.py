"""The core op vocabulary on CUDA: same signatures as :mod:`ds4_core.ops`, arrays are CuPy float32.

Quantized matrices are read as raw GGUF blocks: up to :data:`GEMV_TOKENS` tokens go through the GEMV
kernels (each warp streams four rows through shared memory with 16-byte loads); longer inputs dequantize row
chunks to float32 and use cuBLAS. Routed experts read only the selected experts, gate and up in one fused pass.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import cupy as cp
import numpy as np

from ds4_core.backend import Weight
from ds4_core.errors import BackendError

from . import split_hosting
from .modules import INT8_TYPES, glue_kernel, quant_kernel
from .prefill import (
    attend16,
    attend16_fits,
    gemm_rows,
    half_of,
    index_scores16,
    index_scores16_fits,
    per_token_products,
    prefill_grouped_linear,
    prefill_linear,
    prefill_linears,
    prefill_moe,
    rope_args,
    rope_to16,
)

F32 = cp.float32
#: Tokens per GEMV launch (MAX_TOKENS in quant.cu).
GEMV_TOKENS = 8
#: Above this many tokens a linear dequantizes and calls cuBLAS.
GEMV_MAX_TOKENS = 32
#: Routed (token, expert) pairs up to which MoE uses the per-pair GEMV kernels (no host synchronisation).
MOE_PAIR_LIMIT = 64
#: Elements dequantized per chunk on the float32 matmul path (bounds scratch memory to 256 MiB).
DEQUANT_CHUNK = 1 << 26
#: Prefill matmul precision: unset/"16" = fp16/bf16 tensor cores (prefill.py; the window attention's products on fp16
#: operands, the gathered attention's in TF32), 5x faster on a whole Flash model; "32" = float32 sgemm on exact
#: weights. tests/cuda/test_default_paths.py bounds what the 16-bit path moves.
PREFILL_ENV = "DS4_CUDA_PREFILL"
#: Rows per warp and warps per block of the GEMV kernels (GEMV_ROWS, GEMV_WARPS in quant.cu).
ROWS_PER_WARP = 4
WARPS_PER_BLOCK = 8
#: Blocks per multiprocessor a GEMV aims for before it splits rows over several warps. On the Flash shapes both kinds
#: ran fastest with about one: the integer `attn_output_a` 14.7 -> 11.7 us unsplit, `attn_output_b` 16.3 -> 13.1 us
#: in two splits instead of four; the float indexer query projection (8192 rows) in 256 unsplit blocks instead of
#: 512 of two splits, 0.6 us a layer off a decode step (docs/performance.md, session 51).
_WAVES = 1
#: Blocks per multiprocessor an integer GEMV keeps when it gives each block several passes over row groups, and the
#: most passes it gives.
PASS_BLOCKS = 1.5
MAX_PASSES = 8
#: Blocks of one row that a warp stages at once (CHUNK in quant.cu) and bytes per block.
_CHUNK_BLOCKS = {"F32": 32, "F16": 64, "BF16": 64, "Q8_0": 16, "Q4_0": 64, "Q4_K": 4, "Q6_K": 4, "Q2_K": 4,
                 "IQ2_XXS": 4, "MXFP4": 32}
_BLOCK_ELEMS = {"F32": 8, "F16": 8, "BF16": 8, "Q8_0": 32, "Q4_0": 32, "Q4_K": 256, "Q6_K": 256, "Q2_K": 256,
                "IQ2_XXS": 256, "MXFP4": 32}
_THREADS = 256
#: Environment switch of the integer decode path (int8 activations, ``__dp4a``), taken by one-token launches over
#: the formats of :data:`~.modules.INT8_TYPES`: on unless it is "0" (then the float32-activation kernels run).
INT8_ENV = "DS4_CUDA_INT8"
#: Blocks of one row that a warp stages at once in the integer kernels (CHUNK of I8<Q> in quant_int8.cu).
_CHUNK_BLOCKS_I8 = {"Q8_0": 32, "Q2_K": 4, "IQ2_XXS": 4}
#: Columns of one int8 activation group: codes with one scale and two half sums (``I8Act`` in quant_int8.cu).
ACT_GROUP = 32


def _i32(v: int) -> np.int32:
    return np.int32(v)


def _i64(v: int) -> np.int64:
    return np.int64(v)


@functools.cache
def _multiprocessors(device: int) -> int:
    return cp.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]


def _splits(qtype: str, nrows: int, ncols: int, chunk_blocks: int | None = None) -> int:
    """Warps that share one row group (1, 2, 4 or 8): :data:`_WAVES` blocks per multiprocessor, at most one warp per
    chunk."""
    chunks = -(-ncols // (_BLOCK_ELEMS[qtype] * (chunk_blocks or _CHUNK_BLOCKS[qtype])))
    target = _WAVES * _multiprocessors(cp.cuda.Device().id)
    splits = 1
    while (splits < WARPS_PER_BLOCK and 2 * splits <= chunks
           and -(-nrows // (WARPS_PER_BLOCK // splits * ROWS_PER_WARP)) < target):
        splits *= 2
    return splits


def _passes(blocks: int) -> int:
    """Passes per block (1, 2, 4 or 8) of an integer GEMV that needs ``blocks`` one-pass blocks: the most that leave
    :data:`PASS_BLOCKS` blocks per multiprocessor, so each warp streams several row groups back to back (on the
    Flash ``attn_q_b``, 1024 blocks in 4 passes ran 20% faster than in one)."""
    target = PASS_BLOCKS * _multiprocessors(cp.cuda.Device().id)
    passes = 1
    while passes < MAX_PASSES and blocks / (2 * passes) >= target:
        passes *= 2
    return passes


def tensor_core_prefill() -> bool:
    """Whether prefill matmuls run on 16-bit tensor cores (yes unless ``DS4_CUDA_PREFILL=32``)."""
    return os.environ.get(PREFILL_ENV, "16").strip() != "32"


def int8_enabled() -> bool:
    """Whether the decode launches take the integer path by default (yes unless ``DS4_CUDA_INT8=0``)."""
    return os.environ.get(INT8_ENV, "1").strip() != "0"


def numerics() -> dict[str, str]:
    """The arithmetic the environment selects for decode GEMVs and prefill matmuls, with the switch to the other."""
    return {"decode activations": "int8 (DS4_CUDA_INT8=0: float32)" if int8_enabled() else
            "float32 (unset DS4_CUDA_INT8: int8)",
            "prefill matmuls": "fp16/bf16 tensor cores (DS4_CUDA_PREFILL=32: float32)" if tensor_core_prefill() else
            "float32 (unset DS4_CUDA_PREFILL: fp16/bf16 tensor cores)"}


def use_int8(int8: bool | None, qtype: str) -> bool:
    """Whether a one-token GEMV over ``qtype`` takes the int8 kernels (``int8`` None: :func:`int8_enabled`)."""
    return (int8_enabled() if int8 is None else int8) and qtype in INT8_TYPES


def act_bytes(columns: int) -> int:
    """Bytes of ``columns`` int8 activation columns: codes, half sums and scales (``I8Act`` in quant_int8.cu)."""
    return columns + columns // 4 + columns // 8


class Int8Rows(cp.ndarray):
    """One token's float32 values ``[1, ...]`` (``D`` in all) that also carry their int8 activation (``int8``: uint8
    ``[act_bytes(D)]``), made by the kernel that wrote them as the int8 GEMVs would make it: they read it instead of
    quantizing the values in each block. Arrays derived from one (views, results) carry none; an op that wrote one
    in place would leave its codes stale, and none does."""

    int8: Any = None

    @classmethod
    def of(cls, rows: Any, act: Any) -> Int8Rows:
        out = cls(rows.shape, rows.dtype, rows.data, rows.strides)
        out.int8 = act
        return out


def int8_of(x: Any, ncols: int) -> Any:
    """The int8 activation that the token ``x [1, ...]`` of ``ncols`` values carries (:class:`Int8Rows`), else
    None."""
    act = x.int8 if isinstance(x, Int8Rows) else None
    return act if act is not None and x.shape[0] == 1 and x.size == ncols else None


def _activation_launch(kernel: Any, columns: int) -> Any:
    """An integer kernel bound to the dynamic shared memory that holds ``columns`` int8 activation columns, called
    like a ``cupy.RawKernel``."""
    nbytes = act_bytes(columns)
    if nbytes > kernel.max_dynamic_shared_size_bytes:
        kernel.max_dynamic_shared_size_bytes = nbytes
    return functools.partial(kernel, shared_mem=nbytes)


def _act_groups(rows_per_block: int, group_rows: int, groups: int) -> int:
    """Activation groups (of ``group_rows`` rows each) that a block of ``rows_per_block`` rows can touch."""
    if group_rows % rows_per_block == 0:
        return 1
    if rows_per_block % group_rows == 0:
        return min(groups, rows_per_block // group_rows)
    return min(groups, (rows_per_block + group_rows - 2) // group_rows + 1)


def _i8_plan(qtype: str, nrows: int, ncols: int) -> tuple[int, int, int]:
    """(splits, passes, one-pass blocks) of the int8 GEMV of ``nrows`` rows of ``ncols`` columns."""
    splits = _splits(qtype, nrows, ncols, _CHUNK_BLOCKS_I8[qtype])
    blocks = -(-nrows // (WARPS_PER_BLOCK // splits * ROWS_PER_WARP))
    return splits, _passes(blocks) if splits == 1 else 1, blocks


def writes_activation(qtype: str, nrows: int, ncols: int) -> bool:
    """Whether the int8 GEMV of ``nrows`` rows can also write its output as the next GEMV's int8 activation
    (``act_out`` of :func:`gemv_launch`): each block's rows must be whole groups of :data:`ACT_GROUP`."""
    return (use_int8(None, qtype) and nrows % ACT_GROUP == 0 and WARPS_PER_BLOCK * ROWS_PER_WARP == ACT_GROUP
            and _i8_plan(qtype, nrows, ncols)[0] == 1)


def gemv_launch(raw: Any, qtype: str, ncols: int, x: Any, ntok: int, y: Any, x_stride: int | None = None,
                group_rows: int | None = None, *, int8: bool | None = None, segments: tuple[Any, int] | None = None,
                norm: tuple[Any, float] | None = None, act_in: Any = None,
                act_out: Any = None) -> tuple[Any, tuple[int, ...], tuple[int, ...], tuple]:
    """(kernel, grid, block, args) of ``y[t, r] = W[r] . x[t]`` for ``t < ntok <= GEMV_TOKENS``.

    ``raw``: ``[R, row bytes]``; ``x``: float32 with token ``t`` at ``x[t * x_stride:]`` (default ``ncols``);
    ``y``: float32 ``[ntok, R]``. ``group_rows`` (a multiple of :data:`ROWS_PER_WARP`): row ``r`` reads the
    activation ``x[t * x_stride + (r // group_rows) * ncols:]`` (a block-diagonal projection). ``int8`` (default
    :func:`int8_enabled`), one token and a format of :data:`~.modules.INT8_TYPES`: the ``__dp4a`` GEMV, which
    quantizes the activation into int8 blocks of 32 on the way in (``x`` 16-byte aligned). ``segments``: W's
    ``R`` rows lie in several buffers of ``raw``'s row width, ``(table, R)`` from :func:`_segment_table`. ``norm``
    ``(weights, eps)``, the int8 GEMV of one activation only: ``x`` is RMSNormed with those weights on the way in.
    ``act_in``, the int8 GEMV without a norm: its activations already quantized, one after the other (uint8
    ``[act_bytes(groups · ncols)]``, as an ``act_out`` or a kernel of ``act.cuh`` wrote them), read in place of
    ``x``. ``act_out``, an int8 GEMV for which :func:`writes_activation` holds: ``y`` is also written there
    quantized, as the next GEMV's activation.
    """
    nrows = raw.shape[0] if segments is None else segments[1]
    segs = (np.uint64(0), _i32(1)) if segments is None else (segments[0], _i32(segments[0].size // 2))
    if ntok == 1 and use_int8(int8, qtype):
        group_rows = nrows if group_rows is None else group_rows
        splits, passes, blocks = _i8_plan(qtype, nrows, ncols)
        groups = _act_groups(WARPS_PER_BLOCK // splits * ROWS_PER_WARP * passes, group_rows, -(-nrows // group_rows))
        if norm is not None and groups != 1:
            raise ValueError("a GEMV that folds an RMSNorm in reads one activation, not a block-diagonal projection")
        columns = -(-nrows // group_rows) * ncols  # of every activation group
        if act_in is not None and (norm is not None or act_in.nbytes != act_bytes(columns)):
            raise ValueError(f"a quantized activation is read by a GEMV without a norm, as {act_bytes(columns)} "
                             f"bytes; got {act_in.nbytes} bytes")
        if act_out is not None and (not writes_activation(qtype, nrows, ncols) or act_out.nbytes != act_bytes(nrows)):
            raise ValueError(f"this GEMV cannot write its {nrows} rows as a quantized activation of "
                             f"{act_bytes(nrows)} bytes (see writes_activation)")
        null, split = np.uint64(0), split_hosting.take()
        args = (raw, _i64(raw.shape[1]), _i32(nrows), _i32(ncols), x, _i32(group_rows), y, _i32(splits),
                _i32(passes), *segs, null if norm is None else norm[0], F32(0 if norm is None else norm[1]),
                null if act_in is None else act_in, null if act_out is None else act_out,
                *(split or split_hosting.NO_SPLIT))
        kernel = _activation_launch(quant_kernel("gemv1_i8", qtype), 0 if act_in is not None else groups * ncols)
        return kernel, (-(-blocks // passes) + (split is not None),), (32 * WARPS_PER_BLOCK,), args
    if norm is not None or act_in is not None or act_out is not None:
        raise ValueError("only the int8 GEMV of one token folds an RMSNorm in or reads or writes a quantized "
                         "activation")
    splits = _splits(qtype, nrows, ncols)
    rows_per_block = WARPS_PER_BLOCK // splits * ROWS_PER_WARP
    kernel = quant_kernel("gemv1" if ntok == 1 else "gemv8", qtype)
    args = (raw, _i64(raw.shape[1]), _i32(nrows), _i32(ncols), x, _i64(ncols if x_stride is None else x_stride),
            _i32(nrows if group_rows is None else group_rows), _i32(ntok), y, _i32(splits), *segs)
    return kernel, (-(-nrows // rows_per_block),), (32 * WARPS_PER_BLOCK,), args


def moe_gemv_launch(w: Weight, idx: Any, x: Any, x_div: int, y: Any, *,
                    int8: bool | None = None) -> tuple[Any, tuple[int, ...], tuple[int, ...], tuple]:
    """(kernel, grid, block, args) of ``y[p] = W_{idx[p]} @ x[p // x_div]``: ``w [E, R, C]``, ``y [P, R]``.

    ``x``: contiguous float32 rows of ``C``. ``int8`` as in :func:`gemv_launch`.
    """
    _, nrows, ncols = w.shape
    row_bytes = w.data.shape[1]
    grid = (-(-nrows // (WARPS_PER_BLOCK * ROWS_PER_WARP)), idx.shape[0])
    args = (w.data, _i64(nrows * row_bytes), _i64(row_bytes), _i32(nrows), _i32(ncols), idx, x, _i32(x_div), y)
    if use_int8(int8, w.qtype):
        return _activation_launch(quant_kernel("moe_gemv_i8", w.qtype), ncols), grid, (32 * WARPS_PER_BLOCK,), args
    return quant_kernel("moe_gemv", w.qtype), grid, (32 * WARPS_PER_BLOCK,), args


#: Warps a block of ``moe_gate_up_i8`` for each format (``GateUp<Q>::WARPS`` in kernels/quant_int8.cu), and of the
#: float kernel.
_GATE_UP_WARPS_I8 = {"Q8_0": 4}
_GATE_UP_WARPS = WARPS_PER_BLOCK // 2
#: Blocks per multiprocessor the int8 gate/up aims for before it splits its rows' chunks over several warps: the
#: Flash shared expert's one set of rows (128 blocks) stays unsplit. It runs beside the router and then beside the
#: routed gate/up, which must wait for the multiprocessors it holds: in 12-layer decode steps (one call, four rounds)
#: unsplit 595-598 t/s against 584-595 in two splits (256 blocks, three a multiprocessor: ~85 held), though alone the
#: two splits are slower (7.9 µs unsplit, 8.9 in two).
_GATE_UP_BLOCKS = 0.5


def _gate_up_warps(qtype: str, int8: bool) -> int:
    return _GATE_UP_WARPS_I8.get(qtype, WARPS_PER_BLOCK) if int8 else _GATE_UP_WARPS


def _gate_up_splits(qtype: str, nrows: int, ncols: int, pairs: int) -> int:
    """Warps that share one row group of the int8 gate/up (1, 2, 4 ...): as :func:`_splits`, for ``pairs`` row
    sets."""
    warps = _gate_up_warps(qtype, True)
    chunks = -(-ncols // (_BLOCK_ELEMS[qtype] * _CHUNK_BLOCKS_I8[qtype]))
    target = _GATE_UP_BLOCKS * _multiprocessors(cp.cuda.Device().id)
    splits = 1
    while splits < warps and 2 * splits <= chunks and pairs * -(-nrows // (warps // splits * ROWS_PER_WARP)) < target:
        splits *= 2
    return splits


def gate_up_writes_activation(qtype: str, nrows: int) -> bool:
    """Whether the int8 gate/up of ``nrows`` rows an expert can also write its output as the down projection's int8
    activation (``act_out`` of :func:`moe_gate_up_launch`): a block's rows must be one group of :data:`ACT_GROUP`."""
    return (use_int8(None, qtype) and nrows % ACT_GROUP == 0
            and _gate_up_warps(qtype, True) * ROWS_PER_WARP == ACT_GROUP)


def moe_gate_up_launch(gate: Weight, up: Weight, idx: Any | None, x: Any, x_div: int, limit: float, h: Any, *,
                       int8: bool | None = None, act_in: Any = None, act_out: Any = None,
                       splits: int | None = None) -> tuple[Any, tuple[int, ...], tuple[int, ...], tuple]:
    """(kernel, grid, block, args) of ``h[p] = swiglu(G_{idx[p]} x, U_{idx[p]} x)``, ``x = x[p // x_div]``.

    ``gate``, ``up``: ``[E, R, C]`` of one format; ``x``: contiguous float32 rows of ``C``; ``h``: float32
    ``[P, R]``; ``idx`` None: expert 0 for each of the ``P`` rows of ``h``. One pass reads both matrices. ``int8``
    as in :func:`gemv_launch`; ``act_in``, on the int8 path with one row ``x``: that row already quantized (uint8
    ``[act_bytes(C)]``), read in its place. ``act_out``, where :func:`gate_up_writes_activation` holds: ``h`` is also
    written there quantized (uint8 ``[act_bytes(P · R)]``), as :func:`moe_down_sum_launch` reads it. ``splits``
    (int8, a power of two up to the block's warps; default planned, 1 with ``act_out``): warps that share a row
    group, each a share of its chunks.
    """
    _, nrows, ncols = gate.shape
    row_bytes = gate.data.shape[1]
    int8 = use_int8(int8, gate.qtype)
    warps = _gate_up_warps(gate.qtype, int8)
    grid = (-(-nrows // (warps * ROWS_PER_WARP)), h.shape[0])
    args = (gate.data, up.data, _i64(nrows * row_bytes), _i64(row_bytes), _i32(nrows), _i32(ncols),
            np.uint64(0) if idx is None else idx, x, _i32(x_div), F32(limit), h)
    if int8:
        if act_in is not None and (act_in.nbytes != act_bytes(ncols) or x.size != ncols):
            raise ValueError(f"a quantized activation is one row of {act_bytes(ncols)} bytes; got {act_in.nbytes} "
                             f"bytes for {x.size // ncols} rows")
        if act_out is not None and (not gate_up_writes_activation(gate.qtype, nrows)
                                    or act_out.nbytes != act_bytes(h.size)):
            raise ValueError(f"this gate/up cannot write its {h.size} values as a quantized activation of "
                             f"{act_bytes(h.size)} bytes (see gate_up_writes_activation)")
        splits = splits or (1 if act_out is not None else _gate_up_splits(gate.qtype, nrows, ncols, h.shape[0]))
        if splits & (splits - 1) or not 0 < splits <= warps:
            raise ValueError(f"a row group of this gate/up is split over 1, 2, 4 ... {warps} warps; got {splits}")
        if act_out is not None and splits != 1:
            raise ValueError("a gate/up that splits its rows over warps cannot write its output quantized")
        split = split_hosting.take()
        grid = (-(-nrows // (warps // splits * ROWS_PER_WARP)) + (split is not None), h.shape[0])
        kernel = _activation_launch(quant_kernel("moe_gate_up_i8", gate.qtype), 0 if act_in is not None else ncols)
        null = np.uint64(0)
        return kernel, grid, (32 * warps,), (*args, _i32(splits), null if act_in is None else act_in,
                                              null if act_out is None else act_out,
                                              *(split or split_hosting.NO_SPLIT))
    if act_in is not None or act_out is not None:
        raise ValueError("only the int8 kernels read or write a quantized activation")
    return quant_kernel("moe_gate_up", gate.qtype), grid, (32 * warps,), args


def moe_down_sum_launch(w: Weight, idx: Any, k: int, h: Any, weights: Any, out: Any, *,
                        act_in: Any = None) -> tuple[Any, tuple[int, ...], tuple[int, ...], tuple]:
    """(kernel, grid, block, args) of ``out[t] = Σ_j weights[t, j] · W_{idx[t, j]} @ h[t · k + j]`` on the int8
    path, in one launch: the down projections of a token's ``k <= WARPS_PER_BLOCK`` experts and their weighted sum,
    with the same bits as :func:`moe_gemv_launch`'s rows summed by :func:`weighted_rows`.

    ``w [E, R, C]`` of a format of :data:`~.modules.INT8_TYPES`; ``idx``: int32 ``[T · k]``; ``h``: contiguous
    float32 ``[T · k, C]``; ``weights``: float32 ``[T, k]``; ``out``: float32 ``[T, R]``. ``act_in``: ``h``
    already quantized (uint8 ``[act_bytes(T · k · C)]``, as :func:`moe_gate_up_launch`'s ``act_out`` writes it),
    read in its place."""
    _, nrows, ncols = w.shape
    T = out.shape[0]
    if not (w.qtype in INT8_TYPES and 0 < k <= WARPS_PER_BLOCK and idx.size == h.shape[0] == T * k
            and h.shape[1] == ncols):
        raise ValueError(f"the summed down projection takes 1 to {WARPS_PER_BLOCK} experts a token on the int8 "
                         f"path, rows of its {ncols} columns; got {k} for {T} tokens and {h.shape[0]} rows of "
                         f"{h.shape[1]} ({w.qtype})")
    if act_in is not None and act_in.nbytes != act_bytes(h.size):
        raise ValueError(f"a quantized activation of {h.shape[0]} rows is {act_bytes(h.size)} bytes; got "
                         f"{act_in.nbytes} bytes")
    row_bytes = w.data.shape[1]
    args = (w.data, _i64(nrows * row_bytes), _i64(row_bytes), _i32(nrows), _i32(ncols), idx, _i32(k), h, weights,
            out, np.uint64(0) if act_in is None else act_in)
    kernel = _activation_launch(quant_kernel("moe_down_sum_i8", w.qtype), 0 if act_in is not None else k * ncols)
    return kernel, (-(-nrows // ROWS_PER_WARP), T), (32 * k,), args


def _float_rows(raw: Any, qtype: str, ncols: int) -> Any:
    """Rows of a float-format tensor as float32 with CuPy views (any width)."""
    if qtype == "F32":
        return raw.view(cp.float32).reshape(-1, ncols)
    if qtype == "F16":
        return raw.view(cp.float16).reshape(-1, ncols).astype(F32)
    return (raw.view(cp.uint16).reshape(-1, ncols).astype(cp.uint32) << 16).view(F32)


def dequantize_rows(raw: Any, qtype: str, ncols: int, rows: Any = None) -> Any:
    """Rows ``rows`` (int32 ``[n]``, or all) of a raw tensor ``[R, row bytes]`` as float32 ``[n, ncols]``."""
    if ncols % 8:
        values = _float_rows(raw, qtype, ncols)
        return values if rows is None else values[rows]
    n = raw.shape[0] if rows is None else rows.shape[0]
    out = cp.empty((n, ncols), dtype=F32)
    units = n * ncols // 8
    if units:
        rows_arg = np.uint64(0) if rows is None else cp.ascontiguousarray(rows, dtype=cp.int32)
        quant_kernel("dequant_rows", qtype)(
            ((units + _THREADS - 1) // _THREADS,), (_THREADS,),
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
    """Rows ``ids`` (int ``[T]``) of the table ``w`` ``[V, D]`` -> ``[T, D]``."""
    return dequantize_rows(w.data, w.qtype, w.shape[-1], cp.asarray(ids, dtype=cp.int32).reshape(-1))


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


#: Heads and rows that one block of ``attend_rows`` takes (ATTEND_HEADS, ATTEND_ROWS in kernels/attention.cu).
_ATTEND_HEADS, _ATTEND_ROWS = 4, 32
#: Shared memory the few-token attention may take without asking for more (attend_rows: its heads' queries, and
#: with the queries' RoPE one (cos, sin) per rotated pair).
_ATTEND_SHARED = 48 * 1024
#: Widest head the few-token kernels take (a multiple of 4 wide): ``attend_rows`` holds its block's heads of q in
#: shared memory.
_ATTEND_MAX_D = _ATTEND_SHARED // (4 * _ATTEND_HEADS)
#: Query tokens per pass of the prefill attention: their gathered rows ([tokens, K, d] float32) are its scratch,
#: 0.67 GB at DeepSeek V4 Flash's K = 640 rows of 512 values.
ATTEND_TOKENS = 512


def sparse_attention(q: Any, kv: Any, idx: Any, sinks: Weight | None, scale: float) -> Any:
    """Multi-query attention of each query ``q [T, H, d]`` over its rows ``idx [T, K]`` of ``kv [N, d]``.

    Few tokens: two launches split over the rows (``kernels/attention.cu``); prefill under the 16-bit prefill: one
    launch on tensor cores that reads each query's rows in place (``attend16``: heads a multiple of 16 up to 64, 256
    or 512 wide, on compute capability 9.0), else each query's rows gathered, then two batched cuBLAS products around
    one softmax launch (TF32 under the 16-bit prefill)."""
    T, H, d = q.shape
    K = idx.shape[1]
    sink = values_or_null(sinks)
    if _attends_rows(q, idx):
        return _attend_rows(q, kv, idx, sink, scale, (np.uint64(0), np.uint64(0), _i32(0), F32(0)))
    if tensor_core_prefill() and attend16_fits(H, d, K):
        return attend16(q, kv, idx, sink, scale)
    q = cp.ascontiguousarray(q, dtype=F32)
    idx = cp.ascontiguousarray(idx, dtype=cp.int32)
    kv = cp.ascontiguousarray(kv, dtype=F32)
    out = cp.empty((T, H, d), dtype=F32)
    for t0 in range(0, T, ATTEND_TOKENS):
        t1 = min(T, t0 + ATTEND_TOKENS)
        rows = kv[cp.maximum(idx[t0:t1], 0)]  # [t, K, d]
        p = per_token_products(q[t0:t1], rows, True, tensor_core_prefill())  # [t, H, K], softmax-ed in place
        if p.size:
            glue_kernel("attend_softmax")((-(-(t1 - t0) * H // 8),), (256,), (
                p, idx[t0:t1], sink, _i32(H), _i32(K), _i64((t1 - t0) * H), F32(scale)))
        out[t0:t1] = per_token_products(p, rows, False, tensor_core_prefill())
    return out


#: Query tokens of one batch entry of :func:`norm_rope_window_attention`'s products: its band is WINDOW_BLOCK + W - 1
#: rows (WINDOW_BLOCK in ``kernels/attention.cu``'s ``window_softmax``, which takes the block as an argument).
_WINDOW_BLOCK = 64
#: Operand rows of those products are padded to multiples of this many elements: 16-byte aligned rows of fp16
#: keep cuBLAS on its vector kernels (odd strides took its align1 ones, twice as slow).
_WINDOW_PAD = 8


def _window_rows(T: int, first: int, window: int, comp_start: int, n_comp: int, limit: Any) -> Any:
    """``[T, window (+ n_comp)]`` int32 row lists of :func:`norm_rope_window_attention`'s queries, for the row-list
    path."""
    band = first + cp.arange(T, dtype=cp.int32)[:, None] + cp.arange(window, dtype=cp.int32)[None, :]
    parts = [cp.where(band >= 0, band, -1)]
    if limit is not None:
        w = cp.arange(n_comp, dtype=cp.int32)[None, :]
        parts.append(cp.where(w < cp.asarray(limit).reshape(-1, 1), w + comp_start, -1))
    return cp.ascontiguousarray(cp.concatenate(parts, axis=1), dtype=cp.int32)


def _padded(n: int) -> int:
    return -(-n // _WINDOW_PAD) * _WINDOW_PAD


def norm_rope_window_attention(q: Any, eps: float, kv: Any, first: int, window: int, comp_start: int, limit: Any,
                               sinks: Weight | None, scale: float, positions: Any, inv_freq: Any, out_a: Weight,
                               groups: int) -> Any:
    """A chunk's queries ``q [T, H, d]`` RMSNormed (no weight) and RoPE'd at ``positions``, then their sparse
    attention over the sliding window (query ``t``: rows ``first + t ..`` of ``kv``, ``window`` of them, none below
    0) and, with ``limit [T]``, the rows ``comp_start + w`` for ``w < limit[t]``; the output is rotated back by the
    inverse RoPE and goes through the grouped projection ``out_a`` (:func:`_grouped_output`) -> ``[T, groups, rows]``.

    Prefill reads the rows in place: the queries go by blocks of :data:`_WINDOW_BLOCK`, each multiplied on cuBLAS
    with the band of window rows its queries share (contiguous in ``kv``) and with all the compressed rows, and one
    launch masks and normalises the scores between the two products (``window_softmax``), so no row is gathered
    per query (gathers were 11% of a Flash prefill). The 16-bit prefill multiplies fp16 operands (the norm launch
    writes the queries so, ``window_softmax`` the weights): TF32's 10-bit mantissas at twice its rate, and in
    range: a normalised query's channels are at most sqrt(d). A few tokens, and the queries past the last whole
    block, take their row lists to :func:`sparse_attention`."""
    T, H, d = q.shape
    n_comp = kv.shape[0] - comp_start if limit is not None else 0
    whole = T // _WINDOW_BLOCK * _WINDOW_BLOCK if T > GEMV_TOKENS else 0
    kv = cp.ascontiguousarray(kv, dtype=F32)
    positions = cp.ascontiguousarray(positions, dtype=cp.int32).reshape(-1)
    out = cp.empty((T, H, d), dtype=F32)
    if whole < T:
        rest = _window_rows(T - whole, first + whole, window, comp_start, n_comp,
                            None if limit is None else limit[whole:])
        q_rest = norm_rope(q[whole:], None, eps, positions[whole:], inv_freq)
        out[whole:] = sparse_attention(q_rest, kv, rest, sinks, scale)
    if whole == 0:
        return _grouped_output(out, kv, positions, inv_freq, out_a, groups)
    fp16 = tensor_core_prefill()
    dtype, size = (cp.float16, 2) if fp16 else (F32, 4)
    q = _norm_rope(q[:whole], None, eps, positions[:whole], inv_freq, dtype)
    B, W = _WINDOW_BLOCK, window
    L = _padded(B + W - 1)
    pad = max(0, -first)  # zero rows in front of the window's, so that every band starts at a row
    s0 = first + pad  # the band of query 0 starts at row s0 of the padded rows
    # every row of kv after pad zero rows, zeros past them to the last band's end; the compressed rows in place
    kw = cp.zeros((max(s0 + whole - B + L, pad + kv.shape[0]), d), dtype=dtype)
    kw[pad:pad + kv.shape[0]] = kv
    lim = np.uint64(0) if limit is None else cp.ascontiguousarray(limit, dtype=cp.int32).reshape(-1)
    sink, ldp = values_or_null(sinks), L + _padded(n_comp)
    per_pass = max(1, ATTEND_TOKENS // B)
    for b0 in range(0, whole // B, per_pass):
        nb = min(per_pass, whole // B - b0)
        t0, rows = b0 * B, nb * B * H
        p = cp.empty((rows, ldp), dtype=F32)
        w = cp.empty((rows, ldp), dtype=cp.float16) if fp16 else p  # the weights, the second products' operand
        qa, oa = q.data.ptr + size * t0 * H * d, out.data.ptr + 4 * t0 * H * d
        band = kw.data.ptr + size * (s0 + t0) * d
        comp = kw.data.ptr + size * (pad + comp_start) * d
        gemm_rows(qa, d, band, d, p.data.ptr, ldp, B * H, L, d, transpose_b=True, batch=nb,
                  strides=(B * H * d, B * d, B * H * ldp), fp16=fp16)
        if n_comp:
            gemm_rows(qa, d, comp, d, p.data.ptr + 4 * L, ldp, B * H, n_comp, d, transpose_b=True, batch=nb,
                      strides=(B * H * d, 0, B * H * ldp), fp16=fp16)
        glue_kernel("window_softmax")((-(-rows // 8),), (256,), (
            p, _i32(ldp), _i32(B), _i32(L), _i32(H), _i32(W), _i32(n_comp), _i32(t0), _i32(s0), _i32(pad), lim,
            sink, F32(scale), _i64(rows), w if fp16 else np.uint64(0)))
        gemm_rows(w.data.ptr, ldp, band, d, oa, d, B * H, d, L, transpose_b=False, batch=nb,
                  strides=(B * H * ldp, B * d, B * H * d), fp16=fp16)
        if n_comp:
            gemm_rows(w.data.ptr + size * L, ldp, comp, d, oa, d, B * H, d, n_comp, transpose_b=False, batch=nb,
                      strides=(B * H * ldp, 0, B * H * d), accumulate=True, fp16=fp16)
    return _grouped_output(out, kv, positions, inv_freq, out_a, groups)


def _grouped_output(o: Any, kv: Any, positions: Any, inv_freq: Any, out_a: Weight, groups: int) -> Any:
    """The attention output ``o [T, H, d]`` over rows of ``kv``, rotated back by the inverse RoPE at ``positions``,
    through the grouped projection ``out_a`` -> ``[T, groups, rows]``. A 16-bit prefill converts ``o`` for the
    projection in the rotation's pass (:func:`.prefill.rope_to16`), scaled by a bound known beforehand: each output is
    a combination of kv's rows with weights of sum at most 1 (the sink takes the rest), so ``|o| <= max|kv|``, and a
    rotated pair's values at most sqrt(2) times that; the pass that found ``max|o|`` (and the rotation's) are gone."""
    T, H, d = o.shape
    ncols = H * d // groups
    if (T > GEMV_MAX_TOKENS and tensor_core_prefill() and out_a.qtype != "F32" and d % 8 == 0
            and 2 * inv_freq.shape[0] <= d):
        converted = rope_to16(o, half_of(out_a.qtype), positions, inv_freq, kv, math.sqrt(2))
        return prefill_grouped_linear(o.reshape(T, groups, ncols), out_a.data, out_a.qtype, ncols, converted)
    return grouped_linear(_rope_in_place(o, positions, inv_freq).reshape(T, groups, ncols), out_a)


def _rope_in_place(x: Any, positions: Any, inv_freq: Any) -> Any:
    """``x [T, ..., d]`` (contiguous float32) rotated back by the inverse RoPE at ``positions`` in place; -> x."""
    half, d = inv_freq.shape[0], x.shape[-1]
    if 2 * half > d:
        raise BackendError(f"RoPE of {2 * half} channels does not fit rows of {d}")
    n = x.size // d * half
    if n:
        pos, freq, _ = rope_args(positions, inv_freq)
        glue_kernel("rope_tail")((-(-n // _THREADS),), (_THREADS,), (
            x, pos, freq, _i64(n), _i32(d), _i32(half), _i32(x.size // d // x.shape[0]), _i32(1)))
    return x


def _attends_rows(q: Any, idx: Any) -> bool:
    """Whether the queries ``q [T, H, d]`` over ``idx [T, K]`` take the few-token kernels (attend_rows, merge)."""
    T, _, d = q.shape
    return 0 < T <= GEMV_TOKENS and idx.shape[1] > 0 and d % 4 == 0 and d <= _ATTEND_MAX_D


def _attend_rows(q: Any, kv: Any, idx: Any, sink: Any, scale: float, rope_args: tuple,
                 quantized: bool = False) -> Any:
    """The few-token attention in two launches; ``rope_args`` (positions, inv_freq, half, eps) RMSNorm and rotate
    the queries in the first and rotate the output back in the merge (null pointers: neither). ``quantized``, one
    token on the int8 decode path: the merge also writes the output as the int8 activation of the GEMV that reads it
    (:class:`Int8Rows`)."""
    T, H, d = q.shape
    K = idx.shape[1]
    q, kv = cp.ascontiguousarray(q, dtype=F32), cp.ascontiguousarray(kv, dtype=F32)
    idx = cp.ascontiguousarray(idx, dtype=cp.int32)
    tiles = -(-K // _ATTEND_ROWS)
    part, stats = cp.empty((T, H, tiles, d), dtype=F32), cp.empty((T, H, tiles, 2), dtype=F32)
    out = cp.empty((T, H, d), dtype=F32)
    act = cp.empty(act_bytes(H * d), cp.uint8) if quantized and T == 1 and d % ACT_GROUP == 0 else None
    glue_kernel("attend_rows")((tiles, -(-H // _ATTEND_HEADS), T), (32 * _ATTEND_HEADS,), (
        q, kv, idx, _i32(H), _i32(K), _i32(d), F32(scale), part, stats, *rope_args),
        shared_mem=4 * _ATTEND_HEADS * d + 8 * int(rope_args[2]))
    glue_kernel("attend_merge")((-(-d // 128), H, T), (128,), (
        part, stats, sink, _i32(H), _i32(tiles), _i32(d), out, *rope_args[:3], np.uint64(0) if act is None else act),
        shared_mem=4 * tiles)
    return out if act is None else Int8Rows.of(out, act)


def norm_rope_attention(q: Any, eps: float, kv: Any, idx: Any, sinks: Weight | None, scale: float, positions: Any,
                        inv_freq: Any) -> Any:
    """:func:`norm_rope` of the queries (no weight), :func:`sparse_attention`, then :func:`rope` of its output with
    ``inverse``: a decode step's few tokens take the queries' norm and rotation in the attention's first launch and
    the output's rotation in its merge launch, and write the output of one token also as the int8 activation of
    the projection after it (:class:`Int8Rows`); a prefill under the 16-bit prefill, in :func:`.prefill.attend16`'s
    shapes, has its queries normed and rotated straight into fp16 (normed rows need no scale) and the output's
    rotation done in that launch."""
    half, d = inv_freq.shape[0], q.shape[2]
    few = _attends_rows(q, idx)
    if not few and tensor_core_prefill() and attend16_fits(q.shape[1], d, idx.shape[1]):
        q16 = _norm_rope(q, None, eps, positions, inv_freq, cp.float16)
        return attend16(q16, kv, idx, values_or_null(sinks), scale, (positions, inv_freq))
    rope_fits = 2 * half <= d and half <= 32 * _ATTEND_HEADS and 4 * _ATTEND_HEADS * d + 8 * half <= _ATTEND_SHARED
    if not (few and rope_fits and positions.size == q.shape[0]):
        out = sparse_attention(norm_rope(q, None, eps, positions, inv_freq), kv, idx, sinks, scale)
        return rope(out, positions, inv_freq, inverse=True)
    sink = values_or_null(sinks)
    return _attend_rows(q, kv, idx, sink, scale, (*rope_args(positions, inv_freq), F32(eps)),
                        quantized=int8_enabled())


#: Most heads and the keys of one block of ``indexer_scores_rows`` (SCORE_HEADS, SCORE_KEYS in ``kernels/rows.cu``).
_SCORE_HEADS, _SCORE_KEYS = 64, 32
#: ``indexer_scores_spread``'s keys a block, most channels and threads (SPREAD_* in ``kernels/rows.cu``), and the most
#: blocks a multiprocessor for which it is taken: one (at 2048 keys, two a multiprocessor took 5.8 µs on the H200
#: where blocks of 32 keys took 5.0; at 1024 keys, 3.4 against 5.0: ``benchmarks/indexer_kernels.py``).
_SPREAD_KEYS, _SPREAD_DEPTH, _SPREAD_THREADS, _SPREAD_BLOCKS = 8, 128, 256, 1


def indexer_scores(q: Any, keys: Any, head_weights: Any, scale: float) -> Any:
    """``s[t, r] = Σ_h head_weights[t, h] · ReLU(q[t, h] · keys[r]) · scale`` -> ``[T, R]``. Few tokens: one launch that
    reads each key once per token, in blocks of 8 keys where those take one block a multiprocessor
    (``indexer_scores_spread``: a decode step up to ~4K tokens of context), else of 32 (``indexer_scores_rows``); many
    tokens under the 16-bit prefill: one launch on tensor cores that keeps every head's products on chip
    (``index_scores16``, heads a multiple of 16, up to 128 channels); else the products by cuBLAS, then one launch
    for the rest (``relu_head_sum``), tokens at a time so that their products stay within :data:`DEQUANT_CHUNK`
    values."""
    q = cp.ascontiguousarray(q, dtype=F32)
    keys = cp.ascontiguousarray(keys, dtype=F32)
    head_weights = cp.ascontiguousarray(head_weights, dtype=F32)
    T, H, D = q.shape
    R = keys.shape[0]
    out = cp.empty((T, R), dtype=F32)
    if not out.size:
        return out
    if T <= GEMV_TOKENS and H <= _SCORE_HEADS and D % 4 == 0:  # rows of whole float4s
        args = (q, keys, head_weights, _i32(H), _i32(R), _i32(D), F32(scale), out)
        spread = -(-R // _SPREAD_KEYS)
        if D <= _SPREAD_DEPTH and spread * T <= _SPREAD_BLOCKS * _multiprocessors(cp.cuda.Device().id):
            glue_kernel("indexer_scores_spread")((spread, T), (_SPREAD_THREADS,), args)
        else:
            glue_kernel("indexer_scores_rows")((-(-R // _SCORE_KEYS), T), (_SCORE_HEADS // 4 * _SCORE_KEYS // 4,), args)
        return out
    if tensor_core_prefill() and index_scores16_fits(H, D):
        return index_scores16(q, keys, head_weights, scale)
    step = max(1, DEQUANT_CHUNK // (H * R))  # tokens whose [t, H, R] products fit the float32 path's scratch bound
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        dots = cp.ascontiguousarray(contract_dot(q[t0:t1], keys), dtype=F32)
        glue_kernel("relu_head_sum")((-(-R // _THREADS), t1 - t0), (_THREADS,), (
            dots, head_weights[t0:t1], _i32(H), _i32(R), F32(scale), out[t0:t1]))
    return out


def route_scores(logits: Any, bias: Weight | None, kind: int) -> tuple[Any, Any]:
    """(scores, choice = scores + bias) of router ``logits [T, E]`` in one launch (``kernels/route.cu``): scores are
    ``sqrt(softplus(logits))`` for ``kind`` 0 and ``sigmoid(logits)`` for ``kind`` 1."""
    logits = cp.ascontiguousarray(logits, dtype=F32)
    scores, choice = cp.empty_like(logits), cp.empty_like(logits)
    if logits.size:
        b = values_or_null(bias)
        glue_kernel("route_scores")((-(-logits.size // _THREADS),), (_THREADS,), (
            logits, b, _i32(kind), _i64(logits.size), _i32(logits.shape[-1]), scores, choice))
    return scores, choice


def route_weights(scores: Any, idx: Any, normalize: bool, routed_scale: float) -> Any:
    """``scores`` at the chosen experts ``idx [T, k]``, renormalised to sum 1 when ``normalize``, times the scale."""
    T, k = idx.shape
    w = cp.empty((T, k), dtype=F32)
    if w.size:
        glue_kernel("route_weights")((-(-T // 128),), (128,), (
            scores, cp.ascontiguousarray(idx, dtype=cp.int32), _i32(T), _i32(scores.shape[-1]), _i32(k),
            _i32(int(normalize)), F32(routed_scale), w))
    return w


def route_topk(logits: Any, bias: Weight | None, kind: int, k: int, normalize: bool,
               routed_scale: float) -> tuple[Any, Any] | None:
    """:func:`route_scores`, :func:`topk` of the choice and :func:`route_weights` in one launch (``route_topk``)
    when a block's threads can take the ``E`` experts; else None."""
    T, E = logits.shape
    if not (0 < k <= E <= 1024 and T > 0):
        return None
    idx, w = cp.empty((T, k), dtype=cp.int32), cp.empty((T, k), dtype=F32)
    b = values_or_null(bias)
    glue_kernel("route_topk")((T,), (-(-E // 32) * 32,), (
        cp.ascontiguousarray(logits, dtype=F32), b, _i32(kind), _i32(E), _i32(k), _i32(int(normalize)),
        F32(routed_scale), idx, w), shared_mem=4 * (E + k))
    return idx, w


#: ``route_linear_topk``'s threads a block (the most experts it chooses among) and router rows a block
#: (ROUTER_THREADS and ROUTER_ROWS in ``kernels/route.cu``), and the formats of the rows it reads.
_ROUTER_THREADS, _ROUTER_ROWS, _ROUTER_FORMATS = 256, 2, {"F32": 0, "F16": 1, "BF16": 2}
#: Per weight (by address), the counts of finished blocks per token of the launches that read it and finish a
#: token's work in its last block (which resets the count).
_block_counts: dict[int, Any] = {}


def block_counts(w: Weight) -> Any:
    """The int32 counts ``[GEMV_TOKENS]`` of the last-block launches that read ``w``, zeros when new: made before a
    decode step is recorded (its first steps run eagerly), and reset by every launch that uses them."""
    count = _block_counts.get(w.data.data.ptr)
    if count is None:
        count = _block_counts[w.data.data.ptr] = cp.zeros(GEMV_TOKENS, dtype=cp.int32)
    return count


def moe_gate_route(x: Any, gate: Weight, bias: Weight | None, k: int, routed_scale: float, fixed_idx: Any = None,
                   fixed_rows: Any = None) -> tuple[Any, Any]:
    """:func:`moe_route` of :func:`linear` ``(x, gate)``: a decode step's few tokens choose (or, given
    ``fixed_idx``, weigh those experts) in the launch that projects them (``route_linear_topk``: the last block to
    finish makes the choice). With ``fixed_rows [T]``, the tokens' experts are those rows of the table
    ``fixed_idx``, which the launch reads itself (a hash layer's, by token id: no gather launch before it)."""
    T, D = x.shape
    E = gate.shape[0]
    fmt = _ROUTER_FORMATS.get(gate.qtype)
    if fmt is None or not (0 < T <= GEMV_TOKENS and 0 < k <= E <= _ROUTER_THREADS and D % 8 == 0):
        fixed = fixed_idx if fixed_rows is None else fixed_idx[fixed_rows]
        return moe_route(linear(x, gate), bias, k, routed_scale, fixed)
    count = block_counts(gate)
    logits, idx, w = cp.empty((T, E), F32), cp.empty((T, k), dtype=cp.int32), cp.empty((T, k), F32)
    b = values_or_null(bias)
    fixed = np.uint64(0) if fixed_idx is None else cp.ascontiguousarray(fixed_idx, dtype=cp.int32)
    glue_kernel("route_linear_topk")((-(-E // _ROUTER_ROWS), T), (_ROUTER_THREADS,), (
        gate.data, _i32(fmt), cp.ascontiguousarray(x, dtype=F32), _i32(D), _i32(E), logits, count, b, _i32(0), _i32(k),
        _i32(1), F32(routed_scale), idx, w, fixed,
        np.uint64(0) if fixed_rows is None else cp.ascontiguousarray(fixed_rows, dtype=cp.int32)),
        shared_mem=4 * (E + k))
    return idx, w


def moe_route(logits: Any, bias: Weight | None, k: int, routed_scale: float,
              fixed_idx: Any = None) -> tuple[Any, Any]:
    """sqrt-softplus router: ``logits [T, E]`` -> (expert ids int32 ``[T, k]``, weights ``[T, k]``)."""
    if fixed_idx is None:
        routed = route_topk(logits, bias, 0, k, True, routed_scale)
        if routed is not None:
            return routed
    scores, choice = route_scores(logits, bias, 0)
    idx = topk(choice, k) if fixed_idx is None else cp.asarray(fixed_idx, dtype=cp.int32)
    return idx, route_weights(scores, idx, True, routed_scale)


def _expert_gemv(w: Weight, idx: Any, x: Any, x_div: int) -> Any:
    """``y[p] = W_{idx[p]} @ x[p // x_div]`` for flat pair ids ``idx [P]`` -> ``[P, rows]``."""
    y = cp.empty((idx.shape[0], w.shape[1]), dtype=F32)
    kernel, grid, block, args = moe_gemv_launch(w, idx, cp.ascontiguousarray(x, dtype=F32), x_div, y)
    kernel(grid, block, args)
    return y


def _expert_gate_up(gate: Weight, up: Weight, idx: Any, x: Any, x_div: int, limit: float,
                    act_out: Any = None) -> Any:
    """``swiglu(G_{idx[p]} x, U_{idx[p]} x)`` with ``x = x[p // x_div]``, fused when both share a format (then
    ``act_out`` as in :func:`moe_gate_up_launch`)."""
    if gate.qtype != up.qtype or gate.shape != up.shape:
        return swiglu(_expert_gemv(gate, idx, x, x_div), _expert_gemv(up, idx, x, x_div), limit)
    h = cp.empty((idx.shape[0], gate.shape[1]), dtype=F32)
    act = int8_of(x, gate.shape[2]) if use_int8(None, gate.qtype) else None
    kernel, grid, block, args = moe_gate_up_launch(gate, up, idx, cp.ascontiguousarray(x, dtype=F32), x_div, limit,
                                                   h, act_in=act, act_out=act_out)
    kernel(grid, block, args)
    return h


def _sums_experts(gate: Weight, up: Weight, down: Weight, k: int) -> bool:
    """Whether :func:`moe_experts` of a few pairs takes :func:`_experts_summed`."""
    return (use_int8(None, down.qtype) and k <= WARPS_PER_BLOCK and gate.qtype == up.qtype and gate.shape == up.shape
            and gate_up_writes_activation(gate.qtype, gate.shape[1]))


def _experts_summed(x: Any, gate: Weight, up: Weight, down: Weight, idx: Any, k: int, weights: Any,
                    limit: float) -> Any:
    """:func:`moe_experts` of a few pairs ``idx [T · k]`` whose gate/up hands its output over quantized: the gate/up,
    then the down projections and their weighted sum in one launch (without the handover each of its blocks would
    quantize all k rows: 18.2 µs on the Flash shapes against 10.4 for the per-pair GEMV and 1.8 for the sum)."""
    pairs = idx.shape[0]
    act = cp.empty(act_bytes(pairs * gate.shape[1]), cp.uint8)
    h = _expert_gate_up(gate, up, idx, x, k, limit, act)
    out = cp.empty((pairs // k, down.shape[1]), dtype=F32)
    kernel, grid, block, args = moe_down_sum_launch(down, idx, k, h, cp.ascontiguousarray(weights, dtype=F32), out,
                                                    act_in=act)
    kernel(grid, block, args)
    return out


def moe_experts(x: Any, gate_exps: Weight, up_exps: Weight, down_exps: Weight, idx: Any, weights: Any,
                swiglu_limit: float) -> Any:
    """``Σ_j weights[t, j] · Expert_{idx[t, j]}(x[t])`` for ``x [T, D]``; reads only the selected experts.

    Few pairs: per-pair GEMVs with the expert ids read on the device (where the int8 gate/up hands its output over
    quantized, the down projections and their weighted sum in one launch, :func:`moe_down_sum_launch`). Many
    (prefill): tokens grouped by expert on the device, one tensor-core GEMM per expert group
    (:func:`prefill.prefill_moe`); with float32 prefill, or rows whose width the kernels cannot take (not a multiple
    of 8): grouped on the host through :func:`matmul_raw`.
    """
    T, D = x.shape
    k = idx.shape[1]
    if T * k <= MOE_PAIR_LIMIT and gate_exps.shape[2] % 8 == 0 and down_exps.shape[2] % 8 == 0:
        flat = cp.ascontiguousarray(idx.reshape(-1), dtype=cp.int32)
        if _sums_experts(gate_exps, up_exps, down_exps, k):
            return _experts_summed(x, gate_exps, up_exps, down_exps, flat, k, weights, swiglu_limit)
        h = _expert_gate_up(gate_exps, up_exps, flat, x, k, swiglu_limit)
        return weighted_rows(weights, _expert_gemv(down_exps, flat, h, 1).reshape(T, k, D))
    if tensor_core_prefill() and gate_exps.shape[2] % 8 == 0 and down_exps.shape[2] % 8 == 0:
        return prefill_moe(x, gate_exps, up_exps, down_exps, idx, weights, swiglu_limit)
    return _moe_grouped(x, gate_exps, up_exps, down_exps, idx, weights, swiglu_limit)


def _expert_matmul(x: Any, w: Weight, e: int) -> Any:
    rows = w.shape[1]
    return matmul_raw(x, w.data[e * rows:(e + 1) * rows], w.qtype, w.shape[2])


def _moe_grouped(x: Any, gate_exps: Weight, up_exps: Weight, down_exps: Weight, idx: Any, weights: Any,
                 swiglu_limit: float) -> Any:
    out = cp.zeros(x.shape, dtype=F32)
    host_idx = cp.asnumpy(idx)
    weights = cp.asarray(weights, dtype=F32)
    for e in np.unique(host_idx):
        if e < 0:
            continue
        tok, slot = np.nonzero(host_idx == e)
        tok_d, slot_d = cp.asarray(tok), cp.asarray(slot)
        xe = x[tok_d]
        h = swiglu(_expert_matmul(xe, gate_exps, int(e)), _expert_matmul(xe, up_exps, int(e)), swiglu_limit)
        y = _expert_matmul(h, down_exps, int(e)) * weights[tok_d, slot_d][:, None]
        cp.add.at(out, tok_d, y)
    return out
