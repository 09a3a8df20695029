"""GLM-5.x-only ops on CUDA (same signatures as ``ds4_model_glm5.ops``), CuPy float32."""

from __future__ import annotations

from typing import Any

import cupy as cp

from ds4_core.backend import Weight

from .moe_ops import route_scores, route_topk, route_weights
from .ops import topk, values

F32 = cp.float32


def layer_norm(x: Any, w: Weight, b: Weight, eps: float) -> Any:
    """``(x − mean) · rsqrt(var + eps) · w + b`` over the last axis; ``x [..., D]``, ``w``/``b`` ``[D]``."""
    x = cp.asarray(x, dtype=F32)
    centred = x - x.mean(axis=-1, keepdims=True)
    y = centred / cp.sqrt(cp.mean(centred * centred, axis=-1, keepdims=True) + F32(eps))
    return (y * values(w) + values(b)).astype(F32)


def moe_route_sigmoid(logits: Any, bias: Weight | None, k: int, routed_scale: float, n_group: int,
                      topk_group: int, normalize: bool) -> tuple[Any, Any]:
    """Sigmoid, group-limited router: ``logits [T, E]`` -> (expert ids int32 ``[T, k]``, weights ``[T, k]``).

    Groups score the sum of their two best biased scores; the ``topk_group`` best groups stay; the top-k experts
    among them win (ties to the lowest id). Weights: the unbiased scores, renormalised if ``normalize``, times
    ``routed_scale``. Device top-k and masks only (no sort, no scatter), so a decode step stays graph-capturable.
    """
    if n_group <= 1:
        routed = route_topk(logits, bias, 1, k, normalize, routed_scale)
        if routed is not None:
            return routed
    scores, choice = route_scores(logits, bias, 1)
    if n_group > 1:
        T, E = choice.shape
        grouped = choice.reshape(T * n_group, E // n_group)
        best_two = cp.take_along_axis(grouped, topk(grouped, 2), axis=-1).sum(axis=-1).reshape(T, n_group)
        groups = cp.arange(n_group, dtype=cp.int32)
        kept = (topk(best_two, topk_group)[:, :, None] == groups).any(axis=1)  # [T, n_group]
        choice = cp.where(cp.repeat(kept, E // n_group, axis=1), choice, -cp.inf)
    idx = topk(choice, k)
    return idx, route_weights(scores, idx, normalize, routed_scale)
