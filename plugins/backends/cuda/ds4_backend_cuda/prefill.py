"""Tensor-core prefill: quantized matrices times many tokens through cuBLAS 16-bit GEMMs with fp32 accumulation.

Weights are dequantized by row tiles (dense) or by groups of experts (MoE) into fp16 or bf16 scratch; activations
are converted once per call with one power-of-two scale that cuBLAS undoes through ``alpha``. The 16-bit type is
chosen per format by accuracy (:data:`HALF_OF`): fp16 (11 significant bits) for formats whose values are small
integers times an f16 scale, bf16 (8 bits, float32's range) where it is exact: BF16 weights and MXFP4 (E2M1 times
a power of two, whose exponents can leave fp16's range). F32 matrices stay float32 (sgemm, read in place).

Routed experts (:func:`prefill_moe`): the (token, slot) pairs are sorted by expert on the device. When gate and up
share a format, the tiles are listed on the device too (``moe_tiles``), and one kernel per matrix kind takes a tile
of up to 64 of an expert's tokens, dequantizes 64 rows of the expert's matrix a slice at a time and multiplies them
on tensor cores: the quantized weights are read once per token tile and no 16-bit copy is written. On compute
capability 9.0 that kernel is ``moe_wgmma16`` (Hopper's warpgroup MMA, built for sm_90a by
:func:`.modules.sm90a_module`; ``DS4_CUDA_WGMMA=0`` turns it off), elsewhere ``moe_mma16`` (``mma.sync``): one body
(``kernels/moe_tile.cu``) that decodes the weights into the MMAs' register operand, with the activations in its k64
order. Gate and up go together with SwiGLU applied on the way out (in 16 bits at once where a SwiGLU limit bounds it;
else float32, then a scale per row); the down kernel writes each pair's row times its routing weight; rows are summed
per token in a fixed order. Otherwise (gate and up in different formats) the per-expert counts are read to the host
once, and experts, largest first, go in groups that fit a scratch budget, each group dequantized to 16 bits once and
multiplied with all its tokens by one strided-batched cuBLAS GEMM.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

from ds4_core.backend import Weight
from ds4_core.errors import BackendError

from .modules import (
    HALF_TYPES,
    PREFILL_HALF_KERNELS,
    PREFILL_SOURCES,
    WGMMA_SOURCES,
    fill_iq2xxs_grid,
    iq2xxs_codes,
    prefill_kernels,
    program,
    sm90a_module,
    wgmma_kernels,
    write_global,
)

F32 = cp.float32
#: Weight format -> the 16-bit type its tiles are dequantized to (others: "f16").
HALF_OF: dict[str, str] = {"BF16": "bf16", "MXFP4": "bf16", "F32": "bf16"}
#: Dequantized weight elements per tile of :func:`prefill_linear` (64 MiB of 16-bit scratch).
TILE_ELEMS = 1 << 25
#: Bytes of 16-bit expert weights dequantized at once by :func:`prefill_moe`.
MOE_WEIGHT_SCRATCH = 1 << 30
#: Bytes of per-row buffers (padded activations, gate|up, h, down output) of one expert group.
MOE_ROW_SCRATCH = 1 << 29
#: Tokens per pass of :func:`prefill_moe`; each pass reads the selected experts' weights once.
MOE_TOKENS_PER_PASS = 8192

_CUDA_TYPE = {"f16": 2, "bf16": 14}  # cudaDataType: CUDA_R_16F, CUDA_R_16BF
_CUDA_R_32F = 0
_OP_N, _OP_T = 0, 1
_COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: fp32 accumulation
_GEMM_DEFAULT = -1
_POINTER_MODE_DEVICE = 1
_THREADS = 256
_MMA_TILE = 64  # rows and tokens of an expert tile, and its column step (MMA_BM, MMA_BN, MMA_BK in moe_tile.cu)
_TILE_ALIGN = 128  # tile rows rounded down to a multiple of this (cuBLAS tile shapes)

_AMAX_BLOCKS = 1024  # blocks of amax_abs: enough to stream a chunk's activations at full bandwidth
#: Environment switch: the routed experts' tiles on Hopper's warpgroup MMA (``moe_wgmma16``) unless it is "0".
WGMMA_ENV = "DS4_CUDA_WGMMA"


def _i32(v: int) -> np.int32:
    return np.int32(v)


def _i64(v: int) -> np.int64:
    return np.int64(v)


def half_of(qtype: str) -> str:
    """The 16-bit type (``"f16"`` or ``"bf16"``) weights of format ``qtype`` are dequantized to."""
    return HALF_OF.get(qtype, "f16")


@functools.cache
def _module(qtype: str) -> Any:
    """quant.cu + prefill.cu with the 16-bit dequantizer of ``qtype`` and the shared prefill kernels."""
    module = cp.RawModule(code=program(*PREFILL_SOURCES), options=("--std=c++17",),
                          name_expressions=prefill_kernels(qtype))
    if qtype == "IQ2_XXS":
        _fill_iq2xxs_tables(module)
    return module


def _fill_iq2xxs_tables(module: Any) -> None:
    write_global(module, "iq2xxs_selectors", _grid_selectors(fill_iq2xxs_grid(module)))


@functools.cache
def _wgmma_module(qtype: str) -> Any:
    """quant.cu + prefill.cu + moe_tile.cu + moe_wgmma.cu for sm_90a with ``moe_wgmma16`` of ``qtype``."""
    try:
        module = sm90a_module(program(*WGMMA_SOURCES), wgmma_kernels(qtype))
    except RuntimeError as error:
        raise BackendError(f"{error}; {WGMMA_ENV}=0 runs the routed experts on the portable kernels") from error
    if qtype == "IQ2_XXS":
        _fill_iq2xxs_tables(module)
    return module


def wgmma() -> bool:
    """Whether the routed experts' tiles run on ``moe_wgmma16``: a device of compute capability 9.0 (sm_90a code
    runs on no other) and not ``DS4_CUDA_WGMMA=0``."""
    return os.environ.get(WGMMA_ENV, "1").strip() != "0" and cp.cuda.Device().compute_capability == "90"


@functools.cache
def _tile_kernel_of(qtype: str, half: str, nw: int, core: str) -> Any:
    """``moe_wgmma16`` (``core`` "wgmma") or ``moe_mma16`` for ``nw`` matrices of ``qtype`` with ``half`` operands,
    launched with the dynamic shared memory they declare (``tile_smem``, read once)."""
    module = _wgmma_module(qtype) if core == "wgmma" else _module(qtype)
    smem = cp.zeros(1, dtype=cp.int32)
    module.get_function(f"tile_smem<{qtype}, {nw}>")((1,), (1,), (smem,))
    nbytes = int(smem.get()[0])
    kernel = module.get_function(f"moe_{core}16<{qtype}, {HALF_TYPES[half]}, {nw}>")
    if core == "wgmma":  # a driver function of the sm_90a cubin
        cp.cuda.driver.funcSetAttribute(kernel.ptr, cp.cuda.driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        nbytes)
    else:  # a cupy.RawKernel
        kernel.max_dynamic_shared_size_bytes = nbytes
    return functools.partial(kernel, shared_mem=nbytes)


def _tile_kernel(qtype: str, half: str, nw: int) -> Any:
    """The routed experts' tile kernel for ``nw`` matrices of ``qtype`` with ``half`` operands."""
    return _tile_kernel_of(qtype, half, nw, "wgmma" if wgmma() else "mma")


def _grid_selectors(grid: np.ndarray) -> np.ndarray:
    """IQ2_XXS's grid ``[256, 8]`` (magnitudes 8, 25, 43) as ``[256, 4]`` prmt selectors, one per pair of weights:
    for codes a, b (0, 1, 2) of the pair, the fp16 bytes of magnitude a then b from (lo, hi) = (8s | 25s << 16, 43s)
    (``IQ2Half`` in ``kernels/prefill.cu``)."""
    code = iq2xxs_codes(grid).reshape(256, 4, 2)
    x = code[..., 0] | code[..., 1] << 2  # a | b << 2
    return ((x + (x & 0xC) * 63) * 0x22 + 0x1010).astype(np.uint16)


@functools.cache
def _kernel(qtype: str, name: str) -> Any:
    return _module(qtype).get_function(name)


#: The format whose module also holds the kernels every format shares (:func:`_shared`).
SHARED_QTYPE = "F16"


def _shared(name: str) -> Any:
    """A kernel that does not depend on the weight format (compiled with the :data:`SHARED_QTYPE` module)."""
    return _kernel(SHARED_QTYPE, name)


def warm(qtype: str) -> None:
    """Compile (or load from CuPy's cache) the prefill kernels of ``qtype`` now rather than at the first prompt:
    its dequantizers and expert tiles, and with :data:`SHARED_QTYPE` the kernels every format shares."""
    for half, o in HALF_TYPES.items():
        _kernel(qtype, f"dequant16<{qtype}, {o}>")
        for nw in (1, 2):
            _tile_kernel(qtype, half, nw)
    if qtype == SHARED_QTYPE:
        for name in ("gather16", "scatter_pairs", "sum_pairs", "amax_abs", "moe_tiles", "index_scores16", "attend16",
                     *(f"{k}<{o}>" for k in PREFILL_HALF_KERNELS for o in HALF_TYPES.values())):
            _shared(name)


def dequantize16(raw: Any, qtype: str, ncols: int, half: str, out: Any, matrix_rows: int = 0,
                 experts: Any = None, out_stride: int = 0) -> None:
    """Rows of raw blocks as 16-bit ``half`` values into ``out`` (uint16 bits; ``ncols % 8 == 0``).

    Dense: ``raw [R, row bytes]`` -> ``out [R, ncols]``. Experts: ``raw`` holds matrices of ``matrix_rows`` rows;
    matrix ``experts[j]`` (int32 device ``[n]``) goes to ``out`` at ``j * out_stride`` elements, ``[matrix_rows,
    ncols]`` each.
    """
    if ncols % 8:
        raise BackendError(f"16-bit dequantization needs rows of a multiple of 8 values, not {ncols}")
    row_bytes = raw.shape[1]
    nrows = matrix_rows or raw.shape[0]
    groups = 1 if experts is None else experts.shape[0]
    units = nrows * ncols // 8
    if units == 0 or groups == 0:
        return
    kernel = _kernel(qtype, f"dequant16<{qtype}, {HALF_TYPES[half]}>")
    kernel((-(-units // _THREADS), groups), (_THREADS,),
           (raw, _i64(nrows * row_bytes), _i64(row_bytes), _i32(nrows), _i32(ncols),
            np.uint64(0) if experts is None else experts, _i64(out_stride), out))


def to16(x: Any, half: str, k64: bool = False) -> tuple[Any, Any]:
    """``x`` (float32, contiguous) as 16-bit ``half`` times one power of two s; -> (bits, device ``[1/s, 0]``).

    s brings ``max|x|`` into [2^13, 2^14): in fp16 nothing overflows and values down to 2^-27 of the largest stay
    normal numbers. The pair is the ``alpha, beta`` of a GEMM that undoes s. ``k64``: each 64 values of a row in
    the expert tile kernels' operand order (``k64_position`` in ``kernels/prefill.cu``; rows of a multiple of 64).
    """
    if k64 and x.shape[-1] % _MMA_TILE:
        raise BackendError(f"the k64 order needs rows of a multiple of {_MMA_TILE} values, not {x.shape[-1]}")
    out = cp.empty(x.shape, dtype=cp.uint16)
    alpha_beta, amax = cp.empty(2, dtype=F32), cp.zeros(1, dtype=F32)
    n = x.size
    _shared("amax_abs")((max(1, min(_AMAX_BLOCKS, -(-n // (4 * _THREADS)))),), (_THREADS,), (x, _i64(n), amax))
    _shared(f"to16<{HALF_TYPES[half]}>")((max(1, -(-n // (8 * _THREADS))),), (_THREADS,),
                                        (x, _i64(n), amax, out, alpha_beta, _i32(k64)))
    return out, alpha_beta


def rope_to16(x: Any, half: str, positions: Any, inv_freq: Any, bound_of: Any, factor: float) -> tuple[Any, Any]:
    """:func:`to16` of ``x [T, ..., d]`` (float32, contiguous; ``d % 8 == 0``) after the inverse RoPE at
    ``positions`` of its trailing ``2 · len(inv_freq)`` channels, with the scale of ``max|bound_of| · factor``, a
    bound of ``max|x|`` (an attention output's: its values' largest magnitude times sqrt(2) for the rotation), so no
    pass over ``x`` finds its maximum first. One read of ``x``."""
    out = cp.empty(x.shape, dtype=cp.uint16)
    alpha_beta, amax = cp.empty(2, dtype=F32), cp.zeros(1, dtype=F32)
    bound_of = cp.ascontiguousarray(bound_of, dtype=F32)
    _shared("amax_abs")((max(1, min(_AMAX_BLOCKS, -(-bound_of.size // (4 * _THREADS)))),), (_THREADS,),
                        (bound_of, _i64(bound_of.size), amax))
    d, n = x.shape[-1], x.size
    _shared(f"rope_to16<{HALF_TYPES[half]}>")((max(1, -(-n // (8 * _THREADS))),), (_THREADS,), (
        x, _i64(n), _i32(d), _i32(inv_freq.shape[0]), *rope_args(positions, inv_freq)[:2], _i32(n // d // x.shape[0]),
        amax, F32(factor), out, alpha_beta))
    return out, alpha_beta


def _gemm_nt(w16: Any, half: str, x16: Any, out: Any, m: int, n: int, k: int, ldc: int, alpha_beta: Any,
             batch: int = 1, stride_w: int = 0, stride_x: int = 0, stride_out: int = 0, ldx: int = 0) -> None:
    """``out[b, t, r] = alpha · Σ_c w16[b, r, c] x16[b, t, c]`` (fp32 accumulate and output; ``r < m``, ``t < n``,
    ``c < k``); ``out`` a device pointer whose rows are ``ldc`` floats apart, ``x16``'s rows ``ldx`` values apart
    (0: ``k``). Scalars read on the device."""
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, _POINTER_MODE_DEVICE)
    kind = _CUDA_TYPE[half]
    alpha, beta = alpha_beta.data.ptr, alpha_beta.data.ptr + 4
    ldx = ldx or k
    try:
        if batch == 1:
            cublas.gemmEx(handle, _OP_T, _OP_N, m, n, k, alpha, w16.data.ptr, kind, k, x16.data.ptr, kind, ldx, beta,
                          out, _CUDA_R_32F, ldc, _COMPUTE_32F, _GEMM_DEFAULT)
        else:
            cublas.gemmStridedBatchedEx(handle, _OP_T, _OP_N, m, n, k, alpha, w16.data.ptr, kind, k, stride_w,
                                        x16.data.ptr, kind, ldx, stride_x, beta, out, _CUDA_R_32F, ldc, stride_out,
                                        batch, _COMPUTE_32F, _GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)


_COMPUTE_32F_TF32 = 77  # CUBLAS_COMPUTE_32F_FAST_TF32: float32 data, tensor cores with 10-bit mantissas


@functools.cache
def _unit_scalars(device: int) -> Any:
    """``alpha, beta`` pairs on ``device`` for GEMMs that read their scalars there: ``(1, 0)`` at element 0 (a
    product) and ``(1, 1)`` at element 2 (a product added to C). Made once per device, not uploaded by each GEMM
    (a prefill layer ran ~14 such copies). The copy is waited for: GEMMs on other streams read the array too."""
    scalars = cp.asarray([1.0, 0.0, 1.0, 1.0], dtype=F32)
    cp.cuda.get_current_stream().synchronize()
    return scalars


def _alpha_beta(accumulate: bool = False) -> int:
    """The device address of ``alpha = 1`` followed by ``beta`` (1 when ``accumulate``, else 0)."""
    return _unit_scalars(cp.cuda.runtime.getDevice()).data.ptr + (8 if accumulate else 0)


def per_token_products(a: Any, b: Any, transpose_b: bool, tf32: bool) -> Any:
    """Token by token on cuBLAS, reading both operands in place: ``a [T, I, J] @ b [T, J, n]`` -> ``[T, I, n]``, or
    with ``transpose_b`` ``a [T, I, n] @ b[t].T`` for ``b [T, J, n]`` -> ``[T, I, J]``. float32 (contiguous) in and
    out; ``tf32`` multiplies on tensor cores with TF32 inputs (the 16-bit prefill's precision class)."""
    T, m = a.shape[:2]
    J, n = b.shape[1], b.shape[2]
    cols = J if transpose_b else n  # the result's last axis
    out = cp.empty((T, m, cols), dtype=F32)
    if out.size == 0:
        return out
    inner = a.shape[2]
    one_zero = _alpha_beta()
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, _POINTER_MODE_DEVICE)
    try:  # column-major: out[t].T = op(b[t].T) @ a[t].T
        cublas.gemmStridedBatchedEx(handle, _OP_T if transpose_b else _OP_N, _OP_N, cols, m, inner,
                                    one_zero, b.data.ptr, _CUDA_R_32F, n, J * n, a.data.ptr, _CUDA_R_32F,
                                    inner, m * inner, one_zero + 4, out.data.ptr, _CUDA_R_32F, cols,
                                    m * cols, T, _COMPUTE_32F_TF32 if tf32 else _COMPUTE_32F, _GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)
    return out


#: Warps of ``index_scores16`` and its widest heads; warps of ``attend16``, its most heads, its widest and its rows a
#: tile (``IDX_WARPS``, ``IDX_MAX_D``, ``ATT_WARPS``, ``ATT_MAX_H``, ``ATT_MAX_D``, ``ATT_ROWS`` in
#: ``kernels/prefill_attend.cu``).
_IDX_WARPS, _IDX_MAX_D = 16, 128
_ATT_WARPS, _ATT_MAX_H, _ATT_MAX_D, _ATT_ROWS = 16, 64, 512, 64
#: attend16's dynamic shared memory: 16-bit rows of the queries, two tiles of rows and a tile's probabilities, then
#: 8 floats a head and 2 ints a tile row
_ATT_SHARED = (2 * ((_ATT_MAX_H + 2 * _ATT_ROWS) * (_ATT_MAX_D + 8) + _ATT_MAX_H * (_ATT_ROWS + 8))
               + 4 * (8 * _ATT_MAX_H + 2 * _ATT_ROWS))


def index_scores16_fits(H: int, D: int) -> bool:
    """Whether :func:`index_scores16` takes ``H`` heads of ``D`` channels."""
    return H % 16 == 0 and 16 <= H <= 16 * _IDX_WARPS and D % 32 == 0 and 0 < D <= _IDX_MAX_D


def index_scores16(q: Any, keys: Any, head_weights: Any, scale: float) -> Any:
    """The lightning indexer's scores ``[T, R]`` of queries ``q [T, H, D]`` over ``keys [R, D]`` (float32) on tensor
    cores, fp16 operands: ``s[t, r] = scale · Σ_h head_weights[t, h] · ReLU(q[t, h] · keys[r])`` in one launch that
    keeps every head's products on chip (:func:`index_scores16_fits` shapes)."""
    T, H, D = q.shape
    R = keys.shape[0]
    out = cp.empty((T, R), dtype=F32)
    if out.size:
        q16, aq = to16(cp.ascontiguousarray(q, dtype=F32), "f16")
        k16, ak = to16(cp.ascontiguousarray(keys, dtype=F32), "f16")
        per = _IDX_WARPS // (H // 16)
        _shared("index_scores16")((-(-T // per),), (32 * _IDX_WARPS,), (
            q16, k16, cp.ascontiguousarray(head_weights, dtype=F32), _i32(T), _i32(H), _i32(R), _i32(D), F32(scale),
            aq, ak, out))
    return out


def attend16_fits(H: int, d: int, K: int) -> bool:
    """Whether :func:`attend16` takes ``H`` heads of ``d`` channels over ``K`` rows a query: on a device whose
    blocks may have its ~207 KB of shared memory (compute capability 9.0; 8.x has at most 163 KB)."""
    return (H % 16 == 0 and 0 < H <= _ATT_MAX_H and d % 256 == 0 and 0 < d <= _ATT_MAX_D and K > 0
            and _shared_optin(cp.cuda.Device().id) >= _ATT_SHARED)


@functools.cache
def _shared_optin(device: int) -> int:
    return int(cp.cuda.runtime.deviceGetAttribute(cp.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device))


def rope_args(positions: Any, inv_freq: Any) -> tuple[Any, Any, np.int32]:
    """(positions as int32 [T], inv_freq as float32, its length): the RoPE arguments of every rotating kernel."""
    return (cp.ascontiguousarray(positions, dtype=cp.int32).reshape(-1), cp.ascontiguousarray(inv_freq, dtype=F32),
            _i32(inv_freq.shape[0]))


def _rope_args(rope_back: tuple[Any, Any] | None) -> tuple[Any, Any, np.int32]:
    return (np.uint64(0), np.uint64(0), _i32(0)) if rope_back is None else rope_args(*rope_back)


@functools.cache
def _attend16() -> Any:
    kernel = _shared("attend16")
    kernel.max_dynamic_shared_size_bytes = _ATT_SHARED
    return functools.partial(kernel, shared_mem=_ATT_SHARED)


def attend16(q: Any, kv: Any, idx: Any, sinks: Any, scale: float, rope_back: tuple[Any, Any] | None = None) -> Any:
    """Multi-query attention of each query ``q [T, H, d]`` over its rows ``idx [T, K]`` of ``kv [N, d]`` (``-1``
    masked; ``sinks`` a kernel argument: ``[H]`` float32 logits in the denominator, or a null pointer) on tensor
    cores, fp16 operands, one block a query: its rows are read from ``kv`` in place, never gathered
    (:func:`attend16_fits` shapes). ``q`` float32, or float16 taken as it is. ``rope_back`` (positions ``[T]``,
    inv_freq): the output's inverse RoPE (``ops.rope(..., inverse=True)``, the same bits) in the same launch."""
    T, H, d = q.shape
    out = cp.empty((T, H, d), dtype=F32)
    if T:
        if q.dtype == cp.float16:
            q16, aq = cp.ascontiguousarray(q).view(cp.uint16), cp.ones(1, dtype=F32)  # no scale: a fill, no copy
        else:
            q16, aq = to16(cp.ascontiguousarray(q, dtype=F32), "f16")
        kv16, ak = to16(cp.ascontiguousarray(kv, dtype=F32), "f16")
        _attend16()((T,), (32 * _ATT_WARPS,), (
            q16, kv16, cp.ascontiguousarray(idx, dtype=cp.int32), _i32(H), _i32(idx.shape[1]), _i32(d),
            sinks, F32(scale), aq, ak, *_rope_args(rope_back), out))
    return out


def gemm_rows(a: int, lda: int, b: int, ldb: int, c: int, ldc: int, m: int, n: int, k: int, *, transpose_b: bool,
              batch: int = 1, strides: tuple[int, int, int] = (0, 0, 0), accumulate: bool = False,
              tf32: bool = False, fp16: bool = False) -> None:
    """Row-major products at device addresses, batched: ``C_i = A_i @ B_i`` (``B_i [k, n]``) or with
    ``transpose_b`` ``A_i @ B_i.T`` (``B_i [n, k]``), ``A_i [m, k]``, ``C_i [m, n]`` (plus ``C_i`` when
    ``accumulate``); ``ld*`` are row strides and ``strides`` the batch strides of A, B and C, in elements (0: every
    product reads the same matrix, and the matrices of different products may overlap). float32 operands, on tensor
    cores with TF32 inputs when ``tf32``; ``fp16``: fp16 operands. C is float32, accumulated in float32."""
    scalars = _alpha_beta(accumulate)
    handle = cp.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cp.cuda.get_current_stream().ptr)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, _POINTER_MODE_DEVICE)
    sa, sb, sc = strides
    operands = _CUDA_TYPE["f16"] if fp16 else _CUDA_R_32F
    try:  # column-major: C_i.T = op(B_i.T) @ A_i.T
        cublas.gemmStridedBatchedEx(handle, _OP_T if transpose_b else _OP_N, _OP_N, n, m, k, scalars, b,
                                    operands, ldb, sb, a, operands, lda, sa, scalars + 4, c, _CUDA_R_32F,
                                    ldc, sc, batch, _COMPUTE_32F_TF32 if tf32 and not fp16 else _COMPUTE_32F,
                                    _GEMM_DEFAULT)
    finally:
        cublas.setPointerMode(handle, mode)


def _tile_rows(nrows: int, ncols: int) -> int:
    rows = max(1, TILE_ELEMS // ncols)
    if rows >= _TILE_ALIGN:
        rows -= rows % _TILE_ALIGN
    return min(rows, nrows)


def prefill_linear(x: Any, raw: Any, qtype: str, ncols: int, converted: tuple[Any, Any] | None = None) -> Any:
    """``x [T, ncols] @ W.T`` for raw rows ``W [R, row bytes]`` on tensor cores -> float32 ``[T, R]``.

    Quantized ``W`` is dequantized by tiles of :data:`TILE_ELEMS` elements; F16 and BF16 rows are the GEMM's
    operand in place; F32 goes through float32 sgemm. Scratch: one tile plus ``x`` in 16 bits, or ``converted``,
    :func:`to16` of ``x`` in the format's 16-bit type made by the caller.
    """
    x = cp.ascontiguousarray(x, dtype=F32)
    T, nrows = x.shape[0], raw.shape[0]
    out = cp.empty((T, nrows), dtype=F32)
    if T == 0 or nrows == 0:
        return out
    raw = cp.ascontiguousarray(raw)
    if qtype == "F32":
        return cp.matmul(x, raw.view(F32).reshape(nrows, ncols).T, out=out)
    half = half_of(qtype)
    x16, alpha_beta = converted or to16(x, half)
    if qtype in ("F16", "BF16"):
        _gemm_nt(raw, half, x16, out.data.ptr, nrows, T, ncols, nrows, alpha_beta)
        return out
    step = _tile_rows(nrows, ncols)
    tile = cp.empty((step, ncols), dtype=cp.uint16)
    for r0 in range(0, nrows, step):
        n = min(step, nrows - r0)
        dequantize16(raw[r0:r0 + n], qtype, ncols, half, tile)
        _gemm_nt(tile, half, x16, out.data.ptr + 4 * r0, n, T, ncols, nrows, alpha_beta)
    return out


def prefill_linears(x: Any, mats: tuple[tuple[Any, str, int], ...]) -> tuple[Any, ...]:
    """:func:`prefill_linear` of one ``x [T, ncols]`` and each of ``mats`` (raw rows, format, ncols), ``x``
    converted to 16 bits once per 16-bit type rather than once per matrix."""
    x = cp.ascontiguousarray(x, dtype=F32)
    converted: dict[str, tuple[Any, Any]] = {}
    outs = []
    for raw, qtype, ncols in mats:
        half = half_of(qtype)
        if qtype != "F32" and half not in converted and x.size:
            converted[half] = to16(x, half)
        outs.append(prefill_linear(x, raw, qtype, ncols, converted.get(half)))
    return tuple(outs)


def prefill_grouped_linear(x: Any, raw: Any, qtype: str, ncols: int, converted: tuple[Any, Any] | None = None) -> Any:
    """Block-diagonal ``x [T, G, ncols]`` times the G row blocks of raw rows ``W [G·R, row bytes]`` on tensor cores
    -> float32 ``[T, G, R]``: ``x`` converted to 16 bits once (or ``converted``, its :func:`to16` in the format's
    16-bit type made by the caller; not for F32 rows), and one strided-batched GEMM per tile of whole groups that reads
    each group's columns and writes its outputs in place (a GEMM per group needed two copies of each)."""
    x = cp.ascontiguousarray(x, dtype=F32)
    T, groups = x.shape[:2]
    rows = raw.shape[0] // groups
    out = cp.empty((T, groups, rows), dtype=F32)
    if out.size == 0:
        return out
    raw = cp.ascontiguousarray(raw)
    wide = groups * ncols  # x's row stride
    if qtype == "F32":
        gemm_rows(x.data.ptr, wide, raw.data.ptr, ncols, out.data.ptr, groups * rows, T, rows, ncols,
                  transpose_b=True, batch=groups, strides=(ncols, rows * ncols, rows))
        return out
    half = half_of(qtype)
    x16, alpha_beta = converted or to16(x, half)
    x16 = x16.reshape(T, wide)
    if qtype in ("F16", "BF16"):
        _gemm_nt(raw, half, x16, out.data.ptr, rows, T, ncols, groups * rows, alpha_beta, groups, rows * ncols, ncols,
                 rows, ldx=wide)
        return out
    step = max(1, TILE_ELEMS // (rows * ncols))  # whole groups a tile
    tile = cp.empty((min(step, groups) * rows, ncols), dtype=cp.uint16)
    for g0 in range(0, groups, step):
        n = min(step, groups - g0)
        dequantize16(raw[g0 * rows:(g0 + n) * rows], qtype, ncols, half, tile)
        _gemm_nt(tile, half, x16[:, g0 * ncols:], out.data.ptr + 4 * g0 * rows, rows, T, ncols, groups * rows,
                 alpha_beta, n, rows * ncols, ncols, rows, ldx=wide)
    return out


def _expert_groups(counts: np.ndarray, weight_bytes: int, row_bytes: int) -> list[tuple[int, int, int]]:
    """(first, end, padded tokens) of consecutive experts (counts descending) that fit the scratch budgets."""
    most = max(1, MOE_WEIGHT_SCRATCH // weight_bytes)
    groups, j = [], 0
    while j < len(counts):
        m_pad = -(-int(counts[j]) // 8) * 8
        n = min(most, len(counts) - j, max(1, MOE_ROW_SCRATCH // (m_pad * row_bytes)))
        groups.append((j, j + n, m_pad))
        j += n
    return groups


def prefill_moe(x: Any, gate_exps: Weight, up_exps: Weight, down_exps: Weight, idx: Any, weights: Any,
                swiglu_limit: float) -> Any:
    """``Σ_j weights[t, j] · Expert_{idx[t, j]}(x[t])`` for ``x [T, D]`` on tensor cores -> float32 ``[T, D]``.

    Same semantics as :func:`ds4_backend_cuda.moe_ops.moe_experts`: ``gate_exps``/``up_exps`` ``[E, I, D]``,
    ``down_exps`` ``[E, D, I]``, ``idx`` int ``[T, k]`` (negative ids contribute nothing), ``weights [T, k]``.
    ``D`` and ``I`` must be multiples of 8. Tokens go in passes of :data:`MOE_TOKENS_PER_PASS`; only experts whose
    gate and up differ in format read the per-expert counts to the host, once per pass.
    """
    _, inter, D = gate_exps.shape
    if D % 8 or inter % 8:
        raise BackendError(f"prefill_moe needs expert rows of a multiple of 8 values, not {D} and {inter}; "
                           "use ops.moe_experts")
    x = cp.ascontiguousarray(x, dtype=F32)
    idx = cp.asarray(idx, dtype=cp.int32)
    weights = cp.ascontiguousarray(weights, dtype=F32)
    T = x.shape[0]
    if T <= MOE_TOKENS_PER_PASS:
        return _moe_pass(x, gate_exps, up_exps, down_exps, idx, weights, swiglu_limit)
    out = cp.empty((T, D), dtype=F32)
    for t0 in range(0, T, MOE_TOKENS_PER_PASS):
        t1 = min(T, t0 + MOE_TOKENS_PER_PASS)
        out[t0:t1] = _moe_pass(x[t0:t1], gate_exps, up_exps, down_exps, idx[t0:t1], weights[t0:t1], swiglu_limit)
    return out


def _moe_pass(x: Any, gate_exps: Weight, up_exps: Weight, down_exps: Weight, idx: Any, weights: Any,
              swiglu_limit: float) -> Any:
    E, _, D = gate_exps.shape
    T, k = idx.shape
    flat = cp.ascontiguousarray(idx.reshape(-1))
    key = cp.where((flat < 0) | (flat >= E), E, flat).astype(cp.int32)
    pairs = cp.argsort(key).astype(cp.int32)  # (token, slot) ids grouped by expert
    ypairs = cp.empty((T * k, D), dtype=F32)  # rows of slots without an expert stay unwritten and unread
    if _fused(gate_exps, up_exps, down_exps):
        _moe_fused(x, gate_exps, up_exps, down_exps, pairs, key[pairs], k, weights, swiglu_limit, ypairs)
    else:
        _moe_grouped(x, gate_exps, up_exps, down_exps, pairs, key, k, weights, swiglu_limit, ypairs)
    out = cp.empty((T, D), dtype=F32)
    _shared("sum_pairs")((-(-D // (4 * _THREADS)), T), (_THREADS,), (ypairs, flat, _i32(k), _i32(E), _i32(D), out))
    return out


def _moe_grouped(x: Any, gate_exps: Weight, up_exps: Weight, down_exps: Weight, pairs: Any, key: Any, k: int,
                 weights: Any, swiglu_limit: float, ypairs: Any) -> None:
    """The routed experts in groups of whole experts, each dequantized to 16 bits and multiplied by cuBLAS (gate and
    up in different formats); the per-expert counts ``key``'s ids give are read once to the host."""
    E, inter, D = gate_exps.shape
    counts = cp.asnumpy(cp.bincount(key, minlength=E + 1))[:E]  # the one host read of the pass
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    active = np.argsort(-counts, kind="stable")
    active = active[counts[active] > 0]
    if not active.size:
        return
    gu_half = half_of(gate_exps.qtype) if half_of(gate_exps.qtype) == half_of(up_exps.qtype) else "bf16"
    down_half = half_of(down_exps.qtype)
    x16, alpha_beta = to16(x, gu_half)
    one_zero = _unit_scalars(cp.cuda.runtime.getDevice())  # (1, 0) first
    experts = cp.asarray(active.astype(np.int32))
    seg_off = cp.asarray(starts[active].astype(np.int32))
    seg_cnt = cp.asarray(counts[active].astype(np.int32))
    weight_bytes = 2 * 3 * inter * D
    row_bytes = 2 * D + 4 * 2 * inter + 2 * inter + 4 * D + 4
    groups = _expert_groups(counts[active], weight_bytes, row_bytes)
    most = max(b - a for a, b, _ in groups)
    rows = max((b - a) * m for a, b, m in groups)
    w_gu = cp.empty((most, 2 * inter, D), dtype=cp.uint16)
    w_down = cp.empty((most, D, inter), dtype=cp.uint16)
    xp, gu = cp.empty((rows, D), dtype=cp.uint16), cp.empty((rows, 2 * inter), dtype=F32)
    h, hs, y = cp.empty((rows, inter), dtype=cp.uint16), cp.empty(rows, dtype=F32), cp.empty((rows, D), F32)
    for a, b, m_pad in groups:
        _expert_group(x16, alpha_beta, one_zero, gate_exps, up_exps, down_exps, experts[a:b], seg_off[a:b],
                      seg_cnt[a:b], m_pad, pairs, k, weights, swiglu_limit, gu_half, down_half,
                      (w_gu, w_down, xp, gu, h, hs, y), ypairs)


def _fused(gate_exps: Weight, up_exps: Weight, down_exps: Weight) -> bool:
    """Whether :func:`_moe_fused` takes these experts: gate and up in one format, rows in whole 64-value slices."""
    _, inter, D = gate_exps.shape
    return gate_exps.qtype == up_exps.qtype and D % _MMA_TILE == 0 and inter % _MMA_TILE == 0


def _moe_fused(x: Any, gate_exps: Weight, up_exps: Weight, down_exps: Weight, pairs: Any, sorted_ids: Any, k: int,
               weights: Any, limit: float, ypairs: Any) -> None:
    """The routed experts by tiles of up to 64 tokens of one expert (see the module docstring); the
    tiles are made on the device (``moe_tiles``) from the pairs' expert ids in sorted order, ``sorted_ids``."""
    E, inter, D = gate_exps.shape
    gu_half, down_half = half_of(gate_exps.qtype), half_of(down_exps.qtype)
    rows = pairs.shape[0]  # the pairs with an expert come first in the sorted order; the rest are never read
    max_tiles = min(E, rows) + rows // _MMA_TILE  # an expert with c pairs takes ceil(c / 64) <= c / 64 + 1 tiles
    tiles = cp.empty(3 * max_tiles, dtype=cp.int32)
    _shared("moe_tiles")((1,), (1024,), (sorted_ids, _i32(rows), _i32(E), tiles, _i32(max_tiles)))
    x16, alpha_beta = to16(x, gu_half, k64=True)  # the tile kernels' operand order
    none = np.uint64(0)
    h16 = cp.empty((rows, inter), dtype=cp.uint16)
    # A SwiGLU limit bounds |h| by limit², so the gate/up tiles write h in 16 bits at once, scaled by one power of
    # two; unbounded, h goes through float32 and a scale per row.
    direct = limit > 0 and gu_half == down_half
    h = None if direct else cp.empty((rows, inter), dtype=F32)
    s16 = _up_scale(limit * limit) if direct else 1.0
    _tile_kernel(gate_exps.qtype, gu_half, 2)(
        (inter // _MMA_TILE, max_tiles), (128,),
        (gate_exps.data, up_exps.data, _i64(inter * gate_exps.data.shape[-1]), _i64(gate_exps.data.shape[-1]),
         _i32(inter), _i32(D), tiles, x16, pairs, _i32(k), _i32(1), alpha_beta, F32(limit), none, none,
         none if direct else h, _i32(inter), h16 if direct else none, F32(s16)))
    if direct:
        hs, alpha = none, cp.full(1, 1.0 / s16, dtype=F32)
    else:
        hs, alpha = cp.empty(rows, dtype=F32), cp.ones(1, dtype=F32)
        _shared(f"rows_to16<{HALF_TYPES[down_half]}>")((rows,), (_THREADS,), (h, _i32(inter), h16, hs))
    _tile_kernel(down_exps.qtype, down_half, 1)(
        (D // _MMA_TILE, max_tiles), (128,),
        (down_exps.data, none, _i64(D * down_exps.data.shape[-1]), _i64(down_exps.data.shape[-1]), _i32(D),
         _i32(inter), tiles, h16, pairs, _i32(k), _i32(0), alpha, F32(0), hs, weights, ypairs, _i32(D), none,
         F32(1)))


def _up_scale(bound: float) -> float:
    """The power of two that brings ``bound`` into [2^13, 2^14), as ``up_scale`` in ``kernels/prefill.cu``: values
    up to ``bound`` times it fit fp16 with room, and values down to 2^-27 of it stay normal numbers."""
    _, e = math.frexp(bound)  # bound = m · 2^e, m in [0.5, 1)
    return math.ldexp(1.0, min(14 - e, 126))


def _expert_group(x16: Any, alpha_beta: Any, one_zero: Any, gate_exps: Weight, up_exps: Weight, down_exps: Weight,
                  experts: Any, seg_off: Any, seg_cnt: Any, m_pad: int, pairs: Any, k: int, weights: Any,
                  limit: float, gu_half: str, down_half: str, buffers: tuple, ypairs: Any) -> None:
    """One group of experts: dequantize, gather, gate|up GEMM, SwiGLU, down GEMM, weighted scatter."""
    w_gu, w_down, xp, gu, h, hs, y = buffers
    _, inter, D = gate_exps.shape
    n = experts.shape[0]
    grid_rows = (m_pad, n)
    for w, offset in ((gate_exps, 0), (up_exps, inter * D)):
        dequantize16(w.data, w.qtype, D, gu_half, w_gu.reshape(-1)[offset:], inter, experts, 2 * inter * D)
    dequantize16(down_exps.data, down_exps.qtype, inter, down_half, w_down, D, experts, D * inter)
    _shared("gather16")(grid_rows, (128,), (x16, _i32(D), pairs, _i32(k), seg_off, seg_cnt, _i32(m_pad), xp))
    _gemm_nt(w_gu, gu_half, xp, gu.data.ptr, 2 * inter, m_pad, D, 2 * inter, alpha_beta, n, 2 * inter * D,
             m_pad * D, m_pad * 2 * inter)
    _shared(f"swiglu16<{HALF_TYPES[down_half]}>")(grid_rows, (_THREADS,),
                                                 (gu, _i32(inter), F32(limit), seg_cnt, _i32(m_pad), h, hs))
    _gemm_nt(w_down, down_half, h, y.data.ptr, D, m_pad, inter, D, one_zero, n, D * inter, m_pad * inter,
             m_pad * D)
    _shared("scatter_pairs")(grid_rows, (128,), (y, _i32(D), hs, pairs, weights, seg_off, seg_cnt, _i32(m_pad),
                                                 ypairs))
