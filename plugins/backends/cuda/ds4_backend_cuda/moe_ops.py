"""The mixture of experts on CUDA (same signatures as :mod:`ds4_core.ops`): the router (scores, choice and weights;
its GEMV and choice in one launch) and the routed experts, per (token, expert) pair for a few tokens, grouped by
expert on tensor cores for a prefill."""

from __future__ import annotations

from typing import Any

import cupy as cp
import numpy as np

from ds4_core.backend import Weight

from . import host_experts
from .gemv import (
    GEMV_TOKENS,
    WARPS_PER_BLOCK,
    _i32,
    _i64,
    act_bytes,
    gate_up_writes_activation,
    int8_of,
    moe_down_sum_launch,
    moe_gate_up_launch,
    moe_gemv_launch,
    use_int8,
)
from .modules import glue_kernel
from .numerics import tensor_core_prefill
from .ops import _THREADS, linear, matmul_raw, swiglu, topk, values_or_null, weighted_rows
from .prefill import prefill_moe

F32 = cp.float32


#: Routed (token, expert) pairs up to which MoE uses the per-pair GEMV kernels (no host synchronisation).
MOE_PAIR_LIMIT = 64

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
    of 8): grouped on the host through :func:`matmul_raw`. Experts kept in host memory are first copied to the
    device: the few pairs' own (:func:`host_experts.gathered`), or for many pairs, which read every expert, the
    tensors whole (:func:`host_experts.on_device`).
    """
    T, D = x.shape
    k = idx.shape[1]
    if T * k <= MOE_PAIR_LIMIT and gate_exps.shape[2] % 8 == 0 and down_exps.shape[2] % 8 == 0:
        flat = cp.ascontiguousarray(idx.reshape(-1), dtype=cp.int32)
        if gathered := host_experts.gathered((gate_exps, up_exps, down_exps), flat):
            (gate_exps, up_exps, down_exps), flat = gathered
        if _sums_experts(gate_exps, up_exps, down_exps, k):
            return _experts_summed(x, gate_exps, up_exps, down_exps, flat, k, weights, swiglu_limit)
        h = _expert_gate_up(gate_exps, up_exps, flat, x, k, swiglu_limit)
        return weighted_rows(weights, _expert_gemv(down_exps, flat, h, 1).reshape(T, k, D))
    gate_exps, up_exps, down_exps = (host_experts.on_device(w) for w in (gate_exps, up_exps, down_exps))
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
