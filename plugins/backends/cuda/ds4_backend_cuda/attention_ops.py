"""Attention and the indexer on CUDA (same signatures as :mod:`ds4_core.ops`): a few tokens' sparse attention over
listed rows (``kernels/attention.cu``), a prefill's over its window and on tensor cores (:mod:`.prefill`), and the
indexer's scores."""

from __future__ import annotations

import math
from typing import Any

import cupy as cp
import numpy as np

from ds4_core.backend import Weight
from ds4_core.errors import BackendError

from .gemv import ACT_GROUP, GEMV_TOKENS, Int8Rows, _i32, _i64, _multiprocessors, act_bytes
from .modules import glue_kernel
from .numerics import int8_enabled, tensor_core_prefill
from .ops import (
    _THREADS,
    DEQUANT_CHUNK,
    GEMV_MAX_TOKENS,
    _norm_rope,
    contract_dot,
    grouped_linear,
    norm_rope,
    rope,
    values_or_null,
)
from .prefill import (
    attend16,
    attend16_fits,
    gemm_rows,
    half_of,
    index_scores16,
    index_scores16_fits,
    per_token_products,
    prefill_grouped_linear,
    rope_args,
    rope_to16,
)

F32 = cp.float32


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
