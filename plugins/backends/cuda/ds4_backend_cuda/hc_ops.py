"""Hyper-connection and softmax-pool core ops on CUDA (same signatures as :mod:`ds4_core.ops_hc`), CuPy float32.

Shared by DeepSeek V4 and GLM 5.3 Flash. ``S [T, n, D]`` is the residual state of ``n`` streams per token.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import cupy as cp
import numpy as np

from ds4_core.backend import Weight
from ds4_core.errors import BackendError

from . import split_hosting
from .gemv import ACT_GROUP, GEMV_TOKENS, Int8Rows, act_bytes
from .modules import glue_kernel, quant_kernel
from .moe_ops import block_counts
from .numerics import int8_enabled, tensor_core_prefill
from .ops import linear, rms_norm, values, weighted_rows
from .prefill import gemm_rows

#: Most streams ``kernels/hc.cu`` takes (a token's n × n matrix fills at most two registers per lane of a warp).
HC_MAX = 8
#: Columns per block of ``mix_slices`` (kernels/quant.cu), the mix of a few tokens with its norm folded in.
MIX_SLICE = 256
#: ``hc_split_norm`` (kernels/hc.cu): its threads, streams, and widest stream (HC_NORM_THREADS, HC_NORM_STREAMS,
#: 4 · HC_QUADS · HC_NORM_THREADS).
HC_NORM_THREADS, HC_NORM_STREAMS, HC_NORM_COLUMNS = 256, 4, 4 * 4 * 256

F32 = cp.float32


def _sigmoid(x: Any) -> Any:
    return (1 / (1 + cp.exp(-x))).astype(F32)


def _check_streams(n: int) -> None:
    if n > HC_MAX:
        raise BackendError(f"the CUDA hyper-connection kernels take at most {HC_MAX} streams, not {n}; "
                           "use --backend numpy")


def _hc_mix(S: Any, fn: Weight, norm_eps: float) -> Any:
    return linear(rms_norm(S.reshape(S.shape[0], -1), None, norm_eps), fn)


def _sliced(T: int, K: int) -> bool:
    """Whether a decode step's mix of ``T`` tokens over ``K = n·D`` columns goes by column slices (``mix_slices``)."""
    return T <= GEMV_TOKENS and K % (4 * MIX_SLICE) == 0


def _mix_slices(S: Any, fn: Weight) -> tuple[int, Any]:
    """(slices, part [T, M + 1, slices]): the column slices' products with ``fn`` and sums of squares of the
    contiguous streams ``S [T, n, D]``, which ``hc_split`` finishes."""
    T, n = S.shape[:2]
    K, M = S[0].size, (2 + n) * n
    slices = K // MIX_SLICE
    part = cp.empty((T, M + 1, slices), F32)
    quant_kernel("mix_slices", fn.qtype)((slices, T), (256,), (
        fn.data, np.int64(fn.data.shape[1]), np.int32(M), np.int32(K), S, part))
    return slices, part


def hc_pre(S: Any, fn: Weight, scale: Weight, base: Weight, iters: int, eps: float,
           norm_eps: float) -> tuple[Any, Any, Any]:
    """``S [T, n, D]`` -> (``c [T, D]``, ``post [T, n]``, ``comb [T, n, n]``), Sinkhorn-balanced ``comb``.

    The gates and the Sinkhorn iterations of each token are one warp of ``kernels/hc.cu`` (n ≤ 8)."""
    T, n = S.shape[:2]
    _check_streams(n)
    S = cp.ascontiguousarray(S, dtype=F32)
    K = S[0].size
    pre, post, comb = cp.empty((T, n), F32), cp.empty((T, n), F32), cp.empty((T, n, n), F32)
    if T == 0:
        return cp.empty((0, S.shape[2]), F32), post, comb
    if _sliced(T, K):  # decode: hc_split finishes the mix from the slices
        slices, part = _mix_slices(S, fn)
        mix = cp.empty((T, (2 + n) * n), F32)
    else:
        slices, mix = 0, cp.ascontiguousarray(_hc_mix(S, fn, norm_eps), dtype=F32)
        part = mix
    glue_kernel("hc_split")((-(-T // 4),), (128,), (  # a warp per token
        mix, part, np.int32(slices), np.int32(K), F32(norm_eps), cp.ascontiguousarray(values(scale), dtype=F32),
        cp.ascontiguousarray(values(base), dtype=F32), np.int32(T), np.int32(n), np.int32(iters), F32(eps), pre,
        post, comb))
    return weighted_rows(pre, S), post, comb


def _split_norm_fits(T: int, n: int, D: int) -> bool:
    """Whether a step of ``T`` tokens of ``n`` streams of ``D`` takes ``hc_split_norm`` after a sliced mix."""
    return 0 < T and n == HC_NORM_STREAMS and D % 4 == 0 and D <= HC_NORM_COLUMNS and _sliced(T, n * D)


def _act_of(T: int, D: int) -> Any:
    """Where a hyper-connection's normalised collapse of ``T`` tokens of width ``D`` is also written as the int8
    activation of the GEMVs after it (:class:`Int8Rows`): one token on the int8 decode path; else None."""
    return cp.empty(act_bytes(D), cp.uint8) if T == 1 and D % ACT_GROUP == 0 and int8_enabled() else None


def _split_norm(S: Any, slices: int, part: Any, scale: Weight, base: Weight, iters: int, eps: float,
                norm_eps: float, norm: Weight) -> tuple[Any, Any, Any]:
    """(normalised collapse ``[T, D]``, post, comb) of the streams ``S`` from their mix's column slices ``part`` (a
    token's ``[M + 1, slices]`` contiguous, tokens ``part.strides[0]`` bytes apart). One token on the int8 decode
    path: the collapse is also written quantized, as the int8 GEMVs after it would quantize it (:class:`Int8Rows`)."""
    T, n, D = S.shape
    pre, post, comb, out = cp.empty((T, n), F32), cp.empty((T, n), F32), cp.empty((T, n, n), F32), cp.empty((T, D), F32)
    act = _act_of(T, D)
    sinks = -(-T // HC_NORM_THREADS) if slices == 1 else T  # Sinkhorn blocks: HC_SINKS in kernels/hc.cu
    glue_kernel("hc_split_norm_rows" if slices == 1 else "hc_split_norm")((sinks + T,), (HC_NORM_THREADS,), (
        part, np.int32(part.strides[0] // 4), np.int32(slices), np.int32(n * D), F32(norm_eps),
        cp.ascontiguousarray(values(scale), dtype=F32), cp.ascontiguousarray(values(base), dtype=F32), np.int32(iters),
        F32(eps), pre, post, comb, S, np.int32(D), cp.ascontiguousarray(values(norm), dtype=F32), out, np.int32(T),
        np.uint64(0) if act is None else act))
    return (out if act is None else Int8Rows.of(out, act)), post, comb


def _rows_part(T: int, M: int) -> Any:
    """A prefill's ``part`` for :func:`_mix_rows`: ``T`` rows of the mix's ``M`` columns and the sum of squares,
    padded to a multiple of 4 floats (16-byte rows keep cuBLAS off its slower unaligned kernels)."""
    return cp.empty((T, -(-(M + 1) // 4) * 4), F32)


def _mix_rows(S: Any, fn: Weight, part: Any = None) -> Any:
    """part (:func:`_rows_part`): a prefill's mix of the contiguous streams ``S [T, n, D]`` with ``fn``, before the
    norm (one GEMM reading ``S`` in place; TF32 on the tensor-core prefill path), and each token's sum of squares in
    column ``M``, which ``hc_split_norm`` turns into the norm's scale (given ``part``, that column already holds
    them): the streams are read, never written."""
    T, n, D = S.shape
    K, M = n * D, (2 + n) * n
    squared = part is not None
    if not squared:
        part = _rows_part(T, M)
    ld = part.shape[1]
    fn32 = cp.ascontiguousarray(values(fn), dtype=F32)
    gemm_rows(S.data.ptr, K, fn32.data.ptr, K, part.data.ptr, ld, T, M, K, transpose_b=True,
              tf32=tensor_core_prefill())
    if not squared:
        glue_kernel("row_squares")((T,), (256,), (S, np.int32(K), part[:, M:], np.int32(ld)))
    return part


def _prefill_norm_fits(T: int, n: int, D: int) -> bool:
    """Whether a prefill's ``T`` tokens of ``n`` streams of ``D`` take the mix by a GEMM and ``hc_split_norm``."""
    return T > GEMV_TOKENS and n == HC_NORM_STREAMS and D % 4 == 0 and D <= HC_NORM_COLUMNS


def hc_pre_norm(S: Any, fn: Weight, scale: Weight, base: Weight, iters: int, eps: float, norm_eps: float,
                norm: Weight) -> tuple[Any, Any, Any]:
    """:func:`hc_pre`, then ``c`` RMSNormed with weight ``norm`` (eps ``norm_eps``): four streams take one launch
    for the split, the collapse and the norm (``hc_split_norm``) after the mix's (a decode step's few tokens, one
    launch by column slices; a prefill's, a GEMM and the sums of squares)."""
    T, n, D = S.shape
    if _split_norm_fits(T, n, D):
        S = cp.ascontiguousarray(S, dtype=F32)
        slices, part = _mix_slices(S, fn)
        return _split_norm(S, slices, part, scale, base, iters, eps, norm_eps, norm)
    if _prefill_norm_fits(T, n, D):
        S = cp.ascontiguousarray(S, dtype=F32)
        return _split_norm(S, 1, _mix_rows(S, fn), scale, base, iters, eps, norm_eps, norm)
    c, post, comb = hc_pre(S, fn, scale, base, iters, eps, norm_eps)
    return rms_norm(c, norm, norm_eps), post, comb


def hc_post_pre_norm(S: Any, ys: tuple[Any, ...], post: Any, comb: Any, fn: Weight, scale: Weight, base: Weight,
                     iters: int, eps: float, norm_eps: float, norm: Weight) -> tuple[Any, Any, Any, Any]:
    """:func:`hc_post` of the sum of the sub-layer's outputs ``ys``, then :func:`hc_pre_norm` of its streams ->
    (streams, normalised input, post, comb): a decode step's few tokens of four streams take one launch for the sum
    (of up to two outputs: a MoE's routed and shared experts), the expansion, the next mix, and in each token's last
    block to finish the split, the collapse and its norm (``hc_expand_mix_norm``); a prefill's, one for the sum, the
    expansion and the streams' squares (``hc_expand_rows``), the mix's GEMM and ``hc_split_norm``."""
    split_hosting.flush()  # post and comb are read here
    T, n, D = S.shape
    if len(ys) <= 2 and _prefill_norm_fits(T, n, D):  # the expansion also sums the outputs and squares the streams
        S, M = cp.ascontiguousarray(S, dtype=F32), (2 + n) * n
        out, part = cp.empty_like(S), _rows_part(T, M)
        y2 = cp.ascontiguousarray(ys[1], dtype=F32) if len(ys) == 2 else np.uint64(0)
        glue_kernel("hc_expand_rows")((T,), (HC_NORM_THREADS,), (
            S, cp.ascontiguousarray(ys[0], dtype=F32), y2, cp.ascontiguousarray(post, dtype=F32),
            cp.ascontiguousarray(comb, dtype=F32), np.int32(D), out, part[:, M:], np.int32(part.shape[1])))
        return (out, *_split_norm(out, 1, _mix_rows(out, fn, part), scale, base, iters, eps, norm_eps, norm))
    if not _split_norm_fits(T, n, D) or len(ys) > 2:
        S = hc_post(S, functools.reduce(operator.add, ys), post, comb)
        return (S, *hc_pre_norm(S, fn, scale, base, iters, eps, norm_eps, norm))
    return _expand_mix_norm(S, ys, post, comb, fn, scale, base, iters, eps, norm_eps, norm, head=False)


def _expand_mix_norm(S: Any, ys: tuple[Any, ...], post: Any, comb: Any, fn: Weight, scale: Weight, base: Weight,
                     iters: int, eps: float, norm_eps: float, norm: Weight, head: bool) -> tuple[Any, ...]:
    """``hc_expand_mix_norm`` of a decode step's few tokens (:func:`_split_norm_fits`, at most two outputs ``ys``):
    (streams, normalised input (:class:`Int8Rows` for one token on the int8 path), post, comb) of the next
    sub-layer, or with ``head`` (streams, the model's normalised output) of ``hc_head`` and the output norm. One
    token while a step is recorded (:func:`.split_hosting.hosting`): the split of the next sub-layer's mix row is
    left to a later launch."""
    T, n, D = S.shape
    S = cp.ascontiguousarray(S, dtype=F32)
    out, M, slices = cp.empty_like(S), n if head else (2 + n) * n, n * D // MIX_SLICE
    part, normed, act, null = cp.empty((T, M + 1, slices), F32), cp.empty((T, D), F32), _act_of(T, D), np.uint64(0)
    sinkhorn = () if head else (cp.empty((T, n), F32), cp.empty((T, n), F32), cp.empty((T, n, n), F32))
    y2 = cp.ascontiguousarray(ys[1], dtype=F32) if len(ys) == 2 else null
    scale32, base32 = cp.ascontiguousarray(values(scale), dtype=F32), cp.ascontiguousarray(values(base), dtype=F32)
    row = cp.empty((T, M), F32) if not head and T == 1 and split_hosting.enabled() else None
    quant_kernel("hc_expand_mix_norm", fn.qtype)((slices, T), (HC_NORM_THREADS + 32,), (
        fn.data, np.int64(fn.data.shape[1]), np.int32(M), S, cp.ascontiguousarray(ys[0], dtype=F32), y2,
        cp.ascontiguousarray(post, dtype=F32), cp.ascontiguousarray(comb, dtype=F32), np.int32(D), out, part,
        block_counts(fn), F32(norm_eps), scale32, base32, np.int32(iters), F32(eps), *(sinkhorn or (null,) * 3),
        cp.ascontiguousarray(values(norm), dtype=F32), normed, null if act is None else act,
        null if row is None else row))
    if row is not None:
        split_hosting.defer(row, scale32, base32, iters, eps, *sinkhorn)
    return (out, normed if act is None else Int8Rows.of(normed, act), *sinkhorn[1:])  # post and comb


def hc_post_head_norm(S: Any, ys: tuple[Any, ...], post: Any, comb: Any, fn: Weight, scale: Weight, base: Weight,
                      eps: float, norm_eps: float, norm: Weight) -> tuple[Any, Any]:
    """:func:`hc_post` of the sum of the last sub-layer's outputs ``ys``, then :func:`hc_head` of its streams and
    the RMSNorm with weight ``norm`` -> (streams, the model's normalised output): a decode step's few tokens of four
    streams in one launch (``hc_expand_mix_norm`` with its head), where a dozen small launches ran; else the
    composition."""
    split_hosting.flush()  # post and comb are read here
    T, n, D = S.shape
    if len(ys) > 2 or not _split_norm_fits(T, n, D):
        S = hc_post(S, functools.reduce(operator.add, ys), post, comb)
        return S, rms_norm(hc_head(S, fn, scale, base, eps, norm_eps), norm, norm_eps)
    return _expand_mix_norm(S, ys, post, comb, fn, scale, base, 0, eps, norm_eps, norm, head=True)


def hc_post(S: Any, y: Any, post: Any, comb: Any) -> Any:
    """``S'_k = post_k · y + Σ_i comb[i, k] · S_i``; ``S [T, n, D]`` -> ``[T, n, D]``, one launch."""
    split_hosting.flush()  # post and comb are read here
    S = cp.ascontiguousarray(S, dtype=F32)
    T, n, D = S.shape
    _check_streams(n)
    out = cp.empty_like(S)
    if out.size:
        block = min(256, -(-D // 32) * 32)
        glue_kernel("hc_expand")((-(-D // block), T), (block,), (
            S, cp.ascontiguousarray(y, dtype=F32), cp.ascontiguousarray(post, dtype=F32),
            cp.ascontiguousarray(comb, dtype=F32), np.int32(n), np.int32(D), out))
    return out


def hc_head(S: Any, fn: Weight, scale: Weight, base: Weight, eps: float, norm_eps: float) -> Any:
    """Final collapse of the streams ``S [T, n, D]`` -> ``[T, D]``."""
    w = _sigmoid(_hc_mix(S, fn, norm_eps) * values(scale)[0] + values(base)) + F32(eps)
    return weighted_rows(w, S)


def softmax_pool(kv: Any, gate: Any) -> Any:
    """Per channel, softmax of ``gate [N, S, d]`` over slots weights ``kv [N, S, d]`` -> ``[N, d]``."""
    p = cp.exp(gate - gate.max(axis=1, keepdims=True))
    p = p / p.sum(axis=1, keepdims=True)
    return cp.sum(p * kv, axis=1).astype(F32)
