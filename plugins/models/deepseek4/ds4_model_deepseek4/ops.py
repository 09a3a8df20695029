"""DeepSeek-V4-only ops (numpy references): the QAT roundings of spec §10, the fused compressor step, shared
expert, indexer selection, projections of one input, a sub-layer's normalised input, RMSNorm with RoPE and sparse
attention with the inverse RoPE.

Registered for backend ``"numpy"`` through ``register_kernels`` (names in :mod:`.opnames`). The
hyper-connection and compressor-pool ops the graph also uses are core ops (:mod:`ds4_core.ops_hc`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ds4_core.backend import Ops
from ds4_core.backends.numpy import NumpyBackend
from ds4_core.ops import CORE_OPS

from .model import (
    compose_compress_step,
    compose_hc_post_head_norm,
    compose_hc_post_pre_norm,
    compose_hc_pre_norm,
    compose_index_select,
    compose_linears,
    compose_moe_gate_route,
    compose_norm_linear,
    compose_norm_rope,
    compose_norm_rope_attention,
    compose_norm_rope_into,
    compose_norm_rope_window_attention,
    compose_output_projection,
    compose_shared_expert,
    compose_step_index,
)
from .qat import fp4_hadamard_round, fp8_kv_round

_NUMPY_OPS = Ops(NumpyBackend(), CORE_OPS)


def compress_step(kv_row: Any, gate_row: Any, ape: Any, pos: Any, buf_kv: Any, buf_gate: Any, prev_kv: Any,
                  prev_gate: Any, rows: Any, norm: Any, eps: float, inv_freq: Any) -> Any:
    """One token through a compressor (:func:`.model.compose_compress_step` over the core numpy ops), the reference
    of backends that run the step in fewer launches; arrays written in place, returns ``rows``."""
    return compose_compress_step(_NUMPY_OPS, kv_row, gate_row, ape, pos, buf_kv, buf_gate, prev_kv, prev_gate, rows,
                                 norm, eps, inv_freq)


def shared_expert(x: Any, gate: Any, up: Any, down: Any, limit: float) -> Any:
    """The shared expert (:func:`.model.compose_shared_expert` over the core numpy ops), the reference of backends
    that run its gate and up projections and the SwiGLU in one launch."""
    return compose_shared_expert(_NUMPY_OPS, x, gate, up, down, limit)


def index_select(scores: Any, limit: Any, k: int, offset: int, prefix: Any = None) -> Any:
    """The indexer's top-``k`` complete rows (``w < limit[t]``) of ``scores [T, R]`` plus ``offset``, ``-1`` where
    fewer are complete -> int32 ``[T, min(k, R)]``, after ``prefix [P]`` when given
    (:func:`.model.compose_index_select` over the core numpy ops), the reference of backends that choose them in one
    launch."""
    return compose_index_select(_NUMPY_OPS, scores, limit, k, offset, prefix)


def norm_rope_into(x: Any, w: Any, eps: float, positions: Any, inv_freq: Any, out: Any, rows: Any) -> None:
    """``norm_rope`` of ``x`` into the rows ``rows`` of ``out`` (:func:`.model.compose_norm_rope_into` over the core
    numpy ops), the reference of backends that write the rows where they go in the same launch."""
    compose_norm_rope_into(_NUMPY_OPS, x, w, eps, positions, inv_freq, out, rows)


def step_index(pos: Any, window: int, specs: tuple[tuple[int, int], ...]) -> Any:
    """A one-token step's index arrays in one buffer (:func:`.model.compose_step_index` over numpy), the reference of
    backends that make them in one launch."""
    return compose_step_index(_NUMPY_OPS, pos, window, specs)


def linears(x: Any, weights: tuple[Any, ...]) -> tuple[Any, ...]:
    """``x`` through each of ``weights`` (:func:`.model.compose_linears` over the core numpy ops), the reference of
    backends that read several projections of one input in one launch."""
    return compose_linears(_NUMPY_OPS, x, weights)


def norm_linear(x: Any, norm: Any, eps: float, w: Any) -> Any:
    """RMSNorm then a projection (:func:`.model.compose_norm_linear` over the core numpy ops), the reference of
    backends that fold the norm into the projection's launch."""
    return compose_norm_linear(_NUMPY_OPS, x, norm, eps, w)


def hc_pre_norm(S: Any, fn: Any, scale: Any, base: Any, iters: int, eps: float, norm_eps: float,
                norm: Any) -> tuple[Any, Any, Any]:
    """A sub-layer's normalised input from the streams (:func:`.model.compose_hc_pre_norm` over the core numpy ops),
    the reference of backends that split, collapse and normalise in one launch."""
    return compose_hc_pre_norm(_NUMPY_OPS, S, fn, scale, base, iters, eps, norm_eps, norm)


def hc_post_pre_norm(S: Any, ys: tuple[Any, ...], post: Any, comb: Any, fn: Any, scale: Any, base: Any, iters: int,
                     eps: float, norm_eps: float, norm: Any) -> tuple[Any, Any, Any, Any]:
    """A sub-layer's outputs (summed) into the streams, then the next one's normalised input
    (:func:`.model.compose_hc_post_pre_norm` over the core numpy ops), the reference of backends that add the
    outputs, expand the streams and start the next mix in one launch."""
    return compose_hc_post_pre_norm(_NUMPY_OPS, S, ys, post, comb, fn, scale, base, iters, eps, norm_eps, norm)


def norm_rope(x: Any, w: Any, eps: float, positions: Any, inv_freq: Any) -> Any:
    """RMSNorm then RoPE (:func:`.model.compose_norm_rope` over the core numpy ops), the reference of backends that
    do both in one launch."""
    return compose_norm_rope(_NUMPY_OPS, x, w, eps, positions, inv_freq)


def norm_rope_attention(q: Any, eps: float, kv: Any, idx: Any, sinks: Any, scale: float, positions: Any,
                        inv_freq: Any) -> Any:
    """The queries' RMSNorm and RoPE, sparse attention, then the inverse RoPE
    (:func:`.model.compose_norm_rope_attention` over the core numpy ops), the reference of backends that do the
    rotations in the attention's launches."""
    return compose_norm_rope_attention(_NUMPY_OPS, q, eps, kv, idx, sinks, scale, positions, inv_freq)


def moe_gate_route(x: Any, gate: Any, bias: Any, k: int, scale: float, fixed: Any = None,
                   fixed_rows: Any = None) -> tuple[Any, Any]:
    """The router's projection and choice (:func:`.model.compose_moe_gate_route` over the core numpy ops), the
    reference of backends that choose in the projection's launch."""
    return compose_moe_gate_route(_NUMPY_OPS, x, gate, bias, k, scale, fixed, fixed_rows)


def norm_rope_window_attention(q: Any, eps: float, kv: Any, first: int, window: int, comp_start: int, limit: Any,
                               sinks: Any, scale: float, positions: Any, inv_freq: Any, out_a: Any,
                               groups: int) -> Any:
    """The queries' norm and rotation, then sparse attention over a prefill's window and complete compressed rows,
    its output rotated back and through the grouped projection ``out_a``
    (:func:`.model.compose_norm_rope_window_attention` over the core numpy ops), the reference of backends that read
    those rows in place instead of by a list per query."""
    return compose_norm_rope_window_attention(_NUMPY_OPS, q, eps, kv, first, window, comp_start, limit, sinks, scale,
                                              positions, inv_freq, out_a, groups)


def output_projection(o: Any, out_a: Any, out_b: Any, groups: int) -> Any:
    """The attention's grouped output projection (:func:`.model.compose_output_projection` over the core numpy ops),
    the reference of backends that hand its input and its intermediate over in their own form."""
    return compose_output_projection(_NUMPY_OPS, o, out_a, out_b, groups)


def hc_post_head_norm(S: Any, ys: tuple[Any, ...], post: Any, comb: Any, fn: Any, scale: Any, base: Any, eps: float,
                      norm_eps: float, norm: Any) -> tuple[Any, Any]:
    """The last sub-layer's outputs (summed) into the streams, then the model's normalised output
    (:func:`.model.compose_hc_post_head_norm` over the core numpy ops), the reference of backends that add the
    outputs, expand, mix, collapse and normalise in one launch."""
    return compose_hc_post_head_norm(_NUMPY_OPS, S, ys, post, comb, fn, scale, base, eps, norm_eps, norm)


DEEPSEEK4_OPS: dict[str, Callable] = {
    "fp8_kv_round": fp8_kv_round,
    "fp4_hadamard_round": fp4_hadamard_round,
    "compress_step": compress_step,
    "shared_expert": shared_expert,
    "index_select": index_select,
    "linears": linears,
    "norm_linear": norm_linear,
    "hc_pre_norm": hc_pre_norm,
    "hc_post_pre_norm": hc_post_pre_norm,
    "hc_post_head_norm": hc_post_head_norm,
    "norm_rope": norm_rope,
    "norm_rope_into": norm_rope_into,
    "norm_rope_attention": norm_rope_attention,
    "moe_gate_route": moe_gate_route,
    "norm_rope_window_attention": norm_rope_window_attention,
    "output_projection": output_projection,
    "step_index": step_index,
}
