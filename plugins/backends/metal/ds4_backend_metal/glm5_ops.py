"""GLM-5.x-only ops (:mod:`ds4_model_glm5.ops`) on MLX arrays: the indexer key LayerNorm and the sigmoid,
group-limited MoE router."""

from __future__ import annotations

import mlx.core as mx

from ds4_core.backend import Weight

from .ops import topk

F32 = mx.float32


def layer_norm(x: mx.array, w: Weight, b: Weight, eps: float) -> mx.array:
    """``(x − mean) · rsqrt(var + eps) · w + b`` over the last axis; ``x [..., D]``, ``w``/``b`` ``[D]``."""
    x = x.astype(F32)
    centred = x - x.mean(axis=-1, keepdims=True)
    y = centred / mx.sqrt(mx.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return y * w.data.astype(F32) + b.data.astype(F32)


def moe_route_sigmoid(logits: mx.array, bias: Weight | None, k: int, routed_scale: float, n_group: int,
                      topk_group: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """Sigmoid, group-limited router: ``logits [T, E]`` -> (expert ids int32 ``[T, k]``, weights ``[T, k]``).

    Groups score the sum of their two best biased scores; only the ``topk_group`` best groups compete (see the
    numpy reference). Exactly tied scores may be ordered differently from numpy (see :func:`.ops.topk`).
    """
    scores = mx.sigmoid(logits.astype(F32))
    choice = scores + bias.data.astype(F32) if bias is not None else scores
    if n_group > 1:
        T, E = choice.shape
        grouped = choice.reshape(T, n_group, E // n_group)
        best_two = (-mx.sort(-grouped, axis=-1)[:, :, :2]).sum(axis=-1)  # [T, n_group]
        kept = mx.put_along_axis(mx.zeros((T, n_group), dtype=mx.bool_), topk(best_two, topk_group),
                                 mx.array(True), axis=-1)
        choice = mx.where(mx.repeat(kept, E // n_group, axis=1), choice, -mx.inf)
    idx = topk(choice, k)
    w = mx.take_along_axis(scores, idx, axis=-1)
    if normalize:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
    return idx, w * routed_scale
