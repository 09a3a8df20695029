"""The recurrent core ops and the GLM / Qwen model ops on MLX against their numpy references (the definitions)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from ds4_backend_metal import glm5_ops, qwen38_ops, recurrent_ops
from ds4_model_glm5 import ops as glm_ref
from ds4_model_qwen38 import ops as qwen_ref

from ds4_core import ops_recurrent as rec_ref
from ds4_core.backend import Weight


def _close(got, want, rtol=1e-4):
    got, want = np.array(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, float(np.abs(want).max())))


def _x(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _weights(a: np.ndarray) -> tuple[Weight, Weight]:
    """The same float32 tensor as a numpy-backend and a Metal-backend weight."""
    return Weight("w", "F32", a.shape, a), Weight("w", "F32", a.shape, mx.array(a))


def _mx(*arrays):
    return [mx.array(a) for a in arrays]


# ------------------------------------------------------------ recurrent core ops

@pytest.mark.parametrize(("taps", "dilation"), [(4, 1), (3, 2), (1, 1)])
def test_short_conv(rng, taps, dilation):
    x, history = _x(rng, 7, 6), _x(rng, (taps - 1) * dilation, 6)
    wn, wm = _weights(_x(rng, 6, taps))
    got_y, got_h = recurrent_ops.short_conv(*_mx(x, history), wm, dilation)
    want_y, want_h = rec_ref.short_conv(x, history, wn, dilation)
    _close(got_y, want_y)
    np.testing.assert_array_equal(np.array(got_h), want_h)
    with pytest.raises(ValueError, match="history has"):
        recurrent_ops.short_conv(mx.array(x), mx.zeros((taps * dilation, 6)), wm, dilation)


def _delta_inputs(rng, T, H=3, dk=16, dv=8, per_channel=False, decay_scale=1.0):
    def unit(a):
        return (a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)).astype(np.float32)

    q, k = unit(_x(rng, T, H, dk)), unit(_x(rng, T, H, dk))
    v = _x(rng, T, H, dv)
    g = (-decay_scale * rng.random((T, H, dk) if per_channel else (T, H))).astype(np.float32)
    beta = rng.random((T, H)).astype(np.float32)
    return q, k, v, g, beta, _x(rng, H, dk, dv)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_gated_delta_rule(rng, per_channel):
    args = _delta_inputs(rng, 5, per_channel=per_channel)
    got_o, got_s = recurrent_ops.gated_delta_rule(*_mx(*args))
    want_o, want_s = rec_ref.gated_delta_rule(*args)
    _close(got_o, want_o)
    _close(got_s, want_s)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
@pytest.mark.parametrize("chunk", [rec_ref.DELTA_CHUNK, 16])
def test_gated_delta_rule_chunked(rng, per_channel, chunk):
    # 150 tokens: several chunks and a ragged last one; against the token-by-token definition
    args = _delta_inputs(rng, 150, per_channel=per_channel)
    got_o, got_s = recurrent_ops.gated_delta_rule_chunked(*_mx(*args), chunk=chunk)
    want_o, want_s = rec_ref.gated_delta_rule(*args)
    _close(got_o, want_o, rtol=2e-4)
    _close(got_s, want_s, rtol=2e-4)


def test_gated_delta_rule_chunked_survives_strong_decay(rng):
    # Cumulative log-decays of thousands: unmasked exponents would overflow to inf and poison the chunk.
    args = _delta_inputs(rng, 64, per_channel=True, decay_scale=60.0)
    got_o, got_s = recurrent_ops.gated_delta_rule_chunked(*_mx(*args))
    assert np.isfinite(np.array(got_o)).all()
    want_o, want_s = rec_ref.gated_delta_rule(*args)
    _close(got_o, want_o)
    _close(got_s, want_s)


def test_gated_delta_rule_rejects_a_misshaped_decay(rng):
    q, k, v, g, beta, state = _mx(*_delta_inputs(rng, 3))
    with pytest.raises(ValueError, match="log_decay has shape"):
        recurrent_ops.gated_delta_rule(q, k, v, g[:, :2], beta, state)


# ------------------------------------------------------------ GLM 5.x ops

def test_layer_norm(rng):
    x = _x(rng, 5, 3, 32) * 4 + 2
    (wn, wm), (bn, bm) = _weights(_x(rng, 32)), _weights(_x(rng, 32))
    _close(glm5_ops.layer_norm(mx.array(x), wm, bm, 1e-6), glm_ref.layer_norm(x, wn, bn, 1e-6))


@pytest.mark.parametrize(("n_group", "topk_group", "normalize", "with_bias"),
                         [(1, 1, True, True), (4, 2, True, True), (4, 1, False, False), (2, 1, True, False)])
def test_moe_route_sigmoid(rng, n_group, topk_group, normalize, with_bias):
    logits = _x(rng, 9, 16) * 3
    bn, bm = _weights(_x(rng, 16) * 0.5) if with_bias else (None, None)
    got_i, got_w = glm5_ops.moe_route_sigmoid(mx.array(logits), bm, 4, 2.5, n_group, topk_group, normalize)
    want_i, want_w = glm_ref.moe_route_sigmoid(logits, bn, 4, 2.5, n_group, topk_group, normalize)
    np.testing.assert_array_equal(np.array(got_i), want_i)
    _close(got_w, want_w)


# ------------------------------------------------------------ Qwen3.8 ops

def test_rope_half(rng):
    x = _x(rng, 6, 3, 32)
    pos = np.array([0, 1, 5, 100, 4000, 65000], dtype=np.int32)
    inv_freq = (10000.0 ** -(np.arange(8) / 8)).astype(np.float32)  # rotates the leading 16 of 32 channels
    got = qwen38_ops.rope_half(*_mx(x, pos, inv_freq))
    _close(got, qwen_ref.rope_half(x, pos, inv_freq), rtol=2e-4)
    np.testing.assert_array_equal(np.array(got)[..., 16:], x[..., 16:])


@pytest.mark.parametrize("with_inject", [True, False])
def test_hc_mix(rng, with_inject):
    T, n, D, R = 5, 3, 16, 6
    H = _x(rng, T, n, D) * 2
    (nn, nm), (dn, dm), (un, um) = (_weights(a) for a in (1 + 0.1 * _x(rng, n * D), _x(rng, R, n * D) / 4,
                                                           _x(rng, n * D, R) / 2))
    inj_n, inj_m = _weights(_x(rng, n, n * D) / 4) if with_inject else (None, None)
    got_x, got_inj = qwen38_ops.hc_mix(mx.array(H), nm, dm, um, inj_m, 1e-6)
    want_x, want_inj = qwen_ref.hc_mix(H, nn, dn, un, inj_n, 1e-6)
    _close(got_x, want_x)
    if with_inject:
        _close(got_inj, want_inj)
    else:
        assert got_inj is None and want_inj is None


@pytest.mark.parametrize(("heads", "groups"), [(8, 2), (4, 4)])
def test_gqa_attention(rng, heads, groups):
    T, N, d, dv = 5, 12, 16, 8
    q, k, v = _x(rng, T, heads, d), _x(rng, N, groups, d), _x(rng, N, groups, dv)
    mask = rng.random((T, N)) < 0.5
    mask[np.arange(T), rng.integers(0, N, T)] = True  # every query sees something
    got = qwen38_ops.gqa_attention(*_mx(q, k, v, mask), 0.3)
    _close(got, qwen_ref.gqa_attention(q, k, v, mask, 0.3))


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_route_softmax(rng, normalize):
    logits = _x(rng, 7, 12) * 2
    got_i, got_w = qwen38_ops.moe_route_softmax(mx.array(logits), 3, normalize)
    want_i, want_w = qwen_ref.moe_route_softmax(logits, 3, normalize)
    np.testing.assert_array_equal(np.array(got_i), want_i)
    _close(got_w, want_w)
