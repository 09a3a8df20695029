"""Decode GEMV launches over raw GGUF blocks (``kernels/quant.cu``, ``quant_int8.cu``): how each launch is planned
(row splits, passes), the int8 activation that a one-token launch reads or that a row carries (:class:`Int8Rows`),
and the routed experts' per-pair launches. Up to :data:`GEMV_TOKENS` tokens take these kernels."""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

from ds4_core.backend import Weight

from . import split_hosting
from .modules import INT8_TYPES, quant_kernel
from .numerics import int8_enabled

F32 = cp.float32


#: Tokens per GEMV launch (MAX_TOKENS in quant.cu).
GEMV_TOKENS = 8
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
#: Blocks of one row that a warp stages at once in the integer kernels (CHUNK of I8<Q> in quant_int8.cu).
_CHUNK_BLOCKS_I8 = {"Q8_0": 32, "Q4_K": 4, "Q2_K": 4, "IQ2_XXS": 4, "MXFP4": 32}
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
