"""GLM-5.2-only ops (numpy references): the indexer key LayerNorm and the sigmoid, group-limited MoE router.

Registered for backend ``"numpy"`` through ``register_kernels`` (names in :mod:`.opnames`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ds4_core.backend import Weight
from ds4_core.ops import topk
from ds4_core.ops_hc import sigmoid

F32 = np.float32


def layer_norm(x: np.ndarray, w: Weight, b: Weight, eps: float) -> np.ndarray:
    """``(x − mean) · rsqrt(var + eps) · w + b`` over the last axis; ``x [..., D]``, ``w``/``b`` ``[D]``."""
    x = np.asarray(x, dtype=F32)
    centred = x - x.mean(axis=-1, keepdims=True)
    y = centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + F32(eps))
    return (y * w.data + b.data).astype(F32)


def moe_route_sigmoid(logits: np.ndarray, bias: Weight | None, k: int, routed_scale: float, n_group: int,
                      topk_group: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Sigmoid, group-limited MoE router: ``logits [T, E]`` -> (expert ids int32 ``[T, k]``, weights ``[T, k]``).

    Experts are chosen on ``sigmoid(logits) + bias``: each of ``n_group`` equal groups scores the sum of its two
    best biased scores, the ``topk_group`` best groups stay, and the top-k experts among them win (ties to the
    lowest id). Weights are the chosen *unbiased* scores, renormalised to sum 1 when ``normalize``, times
    ``routed_scale``.
    """
    scores = sigmoid(np.asarray(logits, dtype=F32))
    choice = scores + bias.data if bias is not None else scores
    if n_group > 1:
        T, E = choice.shape
        grouped = choice.reshape(T, n_group, E // n_group)
        best_two = -np.sort(-grouped, axis=-1)[:, :, :2].sum(axis=-1)  # [T, n_group]
        kept = np.zeros((T, n_group), dtype=bool)
        np.put_along_axis(kept, topk(best_two, topk_group), True, axis=-1)
        choice = np.where(np.repeat(kept, E // n_group, axis=1), choice, -np.inf)
    idx = topk(choice, k)
    w = np.take_along_axis(scores, idx, axis=-1)
    if normalize:
        w = w / (w.sum(axis=-1, keepdims=True) + F32(1e-20))
    return idx, (w * F32(routed_scale)).astype(F32)


GLM52_OPS: dict[str, Callable] = {"layer_norm": layer_norm, "moe_route_sigmoid": moe_route_sigmoid}
