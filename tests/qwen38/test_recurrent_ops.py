"""Core recurrent ops: the delta rule against transformers' reference, chunked == recurrent, short_conv."""

from __future__ import annotations

import numpy as np
import pytest

from ds4_core.backend import Weight
from ds4_core.ops import CORE_OPS
from ds4_core.ops_recurrent import gated_delta_rule, gated_delta_rule_chunked, short_conv


def _inputs(T: int, H: int, dk: int, dv: int, per_channel: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, T, H, dk)).astype(np.float32)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    v = rng.standard_normal((T, H, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 3.0, (T, H, dk) if per_channel else (T, H)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, H)).astype(np.float32)
    state = rng.standard_normal((H, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


def test_ops_are_in_the_core_vocabulary():
    assert {"short_conv", "gated_delta_rule", "gated_delta_rule_chunked"} <= set(CORE_OPS)


def test_recurrent_matches_transformers_reference():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen4_exp.modeling_qwen4_exp import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, state = _inputs(23, 3, 8, 5, per_channel=False)
    dk = q.shape[-1]
    ours, ours_state = gated_delta_rule(q, k, v, g, beta, state)
    # transformers scales queries by 1/sqrt(dk) itself
    theirs, theirs_state = torch_recurrent_gated_delta_rule(
        *(torch.from_numpy(a)[None] for a in (q * np.sqrt(dk), k, v, g, beta)),
        initial_state=torch.from_numpy(state)[None], output_final_state=True)
    np.testing.assert_allclose(ours, theirs[0].numpy(), atol=2e-5)
    np.testing.assert_allclose(ours_state, theirs_state[0].numpy(), atol=2e-5)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize(("T", "chunk"), [(1, 64), (37, 8), (130, 64)])
def test_chunked_equals_recurrent(per_channel, T, chunk):
    q, k, v, g, beta, state = _inputs(T, 2, 8, 6, per_channel, seed=T)
    o1, s1 = gated_delta_rule(q, k, v, g, beta, state)
    o2, s2 = gated_delta_rule_chunked(q, k, v, g, beta, state, chunk=chunk)
    np.testing.assert_allclose(o2, o1, atol=2e-5)
    np.testing.assert_allclose(s2, s1, atol=2e-5)


def test_per_channel_decay_with_equal_channels_is_per_head_decay():
    q, k, v, g, beta, state = _inputs(19, 2, 4, 3, per_channel=False)
    per_head = gated_delta_rule(q, k, v, g, beta, state)
    per_channel = gated_delta_rule(q, k, v, np.repeat(g[..., None], 4, axis=-1), beta, state)
    np.testing.assert_allclose(per_channel[0], per_head[0], atol=1e-6)


def test_strong_per_channel_decay_does_not_overflow():
    q, k, v, g, beta, state = _inputs(64, 1, 4, 2, per_channel=True)
    o, s = gated_delta_rule_chunked(q, k, v, g * 40, beta, state)
    assert np.isfinite(o).all() and np.isfinite(s).all()


@pytest.mark.parametrize("dilation", [1, 3])
def test_short_conv_matches_numpy_convolve_across_splits(dilation):
    rng = np.random.default_rng(dilation)
    T, C, K = 17, 5, 4
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    weight = Weight("w", "F32", (C, K), w)
    span = (K - 1) * dilation
    expected = np.stack([np.convolve(np.concatenate([np.zeros(span), x[:, c]]),
                                     _dilated(w[c], dilation)[::-1],
                                     mode="valid") for c in range(C)], axis=1)
    history = np.zeros((span, C), np.float32)
    parts = []
    for piece in (x[:1], x[1:8], x[8:]):
        y, history = short_conv(piece, history, weight, dilation)
        parts.append(y)
    np.testing.assert_allclose(np.concatenate(parts), expected, atol=1e-5)
    np.testing.assert_array_equal(history, x[T - span:])


def _dilated(taps: np.ndarray, dilation: int) -> np.ndarray:
    out = np.zeros((len(taps) - 1) * dilation + 1)
    out[::dilation] = taps
    return out
