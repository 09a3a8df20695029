"""The recurrent core ops and the GLM 5.x / Qwen3.8 ops on CUDA against their numpy references."""

from __future__ import annotations

import numpy as np
import pytest

from ds4_core import ops as ref
from ds4_core import ops_recurrent as rref
from ds4_core.backend import Weight
from ds4_core.quants import block_geometry, dequantize, random_blocks

pytestmark = pytest.mark.gpu


def _pair(backend, qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[Weight, Weight]:
    """(numpy reference weight, CUDA weight) holding the same random blocks (F32: random normal values)."""
    if qtype == "F32":
        raw = rng.standard_normal(shape).astype(np.float32).view(np.uint8).reshape(-1)
    else:
        raw = random_blocks(qtype, int(np.prod(shape)) // block_geometry(qtype)[0], rng).reshape(-1)
    return Weight("w", qtype, shape, dequantize(raw, qtype, shape)), backend.upload("w", qtype, shape, raw)


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("T,channels,taps,dilation", [(1, 96, 4, 1), (5, 40, 4, 1), (2, 24, 3, 3), (70, 33, 2, 4)])
def test_short_conv(cuda_backend, rng, T, channels, taps, dilation):
    from ds4_backend_cuda.recurrent_ops import short_conv

    span = (taps - 1) * dilation
    x, history = _f32(rng, T, channels), _f32(rng, span, channels)
    w_ref, w = _pair(cuda_backend, "F32", (channels, taps), rng)
    y, new_history = short_conv(cuda_backend.asarray(x), cuda_backend.asarray(history), w, dilation)
    want_y, want_history = rref.short_conv(x, history, w_ref, dilation)
    np.testing.assert_allclose(cuda_backend.to_numpy(y), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cuda_backend.to_numpy(new_history), want_history)


def _delta_inputs(rng: np.random.Generator, T: int, H: int, dk: int, dv: int, per_channel: bool):
    q, k, v = _f32(rng, T, H, dk), _f32(rng, T, H, dk), _f32(rng, T, H, dv)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # unit keys, as both graphs feed them
    g = -rng.uniform(0.0, 0.7, (T, H, dk) if per_channel else (T, H)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, H)).astype(np.float32)
    return q, k, v, g, beta, _f32(rng, H, dk, dv)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("T,H,dk,dv", [(1, 4, 16, 16), (1, 2, 128, 128), (6, 3, 40, 20), (3, 2, 256, 33)])
def test_gated_delta_rule_kernel(cuda_backend, rng, per_channel, T, H, dk, dv):
    from ds4_backend_cuda.recurrent_ops import gated_delta_rule

    args = _delta_inputs(rng, T, H, dk, dv, per_channel)
    out, state = gated_delta_rule(*(cuda_backend.asarray(a) for a in args))
    want_out, want_state = rref.gated_delta_rule(*args)
    np.testing.assert_allclose(cuda_backend.to_numpy(out), want_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cuda_backend.to_numpy(state), want_state, rtol=1e-4, atol=1e-4)


def test_gated_delta_rule_refuses_too_wide_keys(cuda_backend, rng):
    from ds4_backend_cuda.recurrent_ops import gated_delta_rule

    from ds4_core.errors import BackendError

    args = _delta_inputs(rng, 1, 1, 320, 8, False)
    with pytest.raises(BackendError, match="320"):
        gated_delta_rule(*(cuda_backend.asarray(a) for a in args))


@pytest.mark.parametrize("per_channel", [False, True])
def test_gated_delta_rule_chunked_equals_the_recurrence(cuda_backend, rng, per_channel):
    from ds4_backend_cuda.recurrent_ops import gated_delta_rule_chunked

    args = _delta_inputs(rng, 150, 3, 32, 24, per_channel)  # two full chunks of 64 and a partial one
    out, state = gated_delta_rule_chunked(*(cuda_backend.asarray(a) for a in args))
    want_out, want_state = rref.gated_delta_rule(*args)
    np.testing.assert_allclose(cuda_backend.to_numpy(out), want_out, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(cuda_backend.to_numpy(state), want_state, rtol=1e-3, atol=1e-4)


def test_grouped_linear_with_a_3d_weight(cuda_backend, rng):
    from ds4_backend_cuda import ops

    for qtype, (G, rows, cols) in (("Q8_0", (4, 16, 64)), ("F16", (3, 16, 12)), ("F32", (2, 5, 8))):
        w_ref, w = _pair(cuda_backend, qtype, (G, rows, cols), rng)
        for T in (1, 3, 40):
            x = _f32(rng, T, G, cols)
            got = cuda_backend.to_numpy(ops.grouped_linear(cuda_backend.asarray(x), w))
            np.testing.assert_allclose(got, ref.grouped_linear(x, w_ref), rtol=1e-4, atol=1e-4)


def test_glm5_ops(cuda_backend, rng):
    from ds4_backend_cuda import glm5_ops as cu
    from ds4_model_glm5 import ops as glm

    xp, host = cuda_backend.asarray, cuda_backend.to_numpy
    x = _f32(rng, 5, 3, 32) * 2 + 1
    (w_ref, w), (b_ref, b) = _pair(cuda_backend, "F32", (32,), rng), _pair(cuda_backend, "F32", (32,), rng)
    np.testing.assert_allclose(host(cu.layer_norm(xp(x), w, b, 1e-6)), glm.layer_norm(x, w_ref, b_ref, 1e-6),
                               rtol=1e-5, atol=1e-5)
    bias_ref, bias = _pair(cuda_backend, "F32", (16,), rng)
    logits = _f32(rng, 9, 16) * 2
    for n_group, topk_group in ((1, 1), (4, 2), (8, 3)):
        for b_ref, b_cu in ((bias_ref, bias), (None, None)):
            for normalize in (True, False):
                idx, weights = cu.moe_route_sigmoid(xp(logits), b_cu, 4, 2.5, n_group, topk_group, normalize)
                want_idx, want_w = glm.moe_route_sigmoid(logits, b_ref, 4, 2.5, n_group, topk_group, normalize)
                np.testing.assert_array_equal(host(idx), want_idx)
                np.testing.assert_allclose(host(weights), want_w, rtol=1e-5)


def test_qwen38_ops(cuda_backend, rng):
    from ds4_backend_cuda import qwen38_ops as cu
    from ds4_model_qwen38 import ops as qwen

    xp, host = cuda_backend.asarray, cuda_backend.to_numpy
    x = _f32(rng, 5, 4, 32)
    pos = np.array([0, 3, 9, 200, 4000], dtype=np.int32)
    inv = (1.0 / 10000 ** (np.arange(12) / 12)).astype(np.float32)
    np.testing.assert_allclose(host(cu.rope_half(xp(x), xp(pos), xp(inv))), qwen.rope_half(x, pos, inv),
                               rtol=1e-4, atol=1e-4)

    T, n, D, R = 6, 3, 64, 8
    H = _f32(rng, T, n, D) * 3
    norm, down, up, inject = (_pair(cuda_backend, q, s, rng) for q, s in
                              (("F32", (n * D,)), ("F16", (R, n * D)), ("BF16", (n * D, R)), ("F32", (n, n * D))))
    for inj in (inject, None):
        got = cu.hc_mix(xp(H), norm[1], down[1], up[1], None if inj is None else inj[1], 1e-6)
        want = qwen.hc_mix(H, norm[0], down[0], up[0], None if inj is None else inj[0], 1e-6)
        np.testing.assert_allclose(host(got[0]), want[0], rtol=1e-4, atol=1e-5)
        assert (got[1] is None) == (want[1] is None)
        if want[1] is not None:
            np.testing.assert_allclose(host(got[1]), want[1], rtol=1e-4, atol=1e-5)

    q, k, v = _f32(rng, 5, 8, 16), _f32(rng, 11, 2, 16), _f32(rng, 11, 2, 24)
    mask = rng.random((5, 11)) < 0.4
    mask[np.arange(5), rng.integers(0, 11, 5)] = True  # every query sees at least one key
    np.testing.assert_allclose(host(cu.gqa_attention(xp(q), xp(k), xp(v), xp(mask), 0.25)),
                               qwen.gqa_attention(q, k, v, mask, 0.25), rtol=1e-4, atol=1e-5)

    logits = _f32(rng, 7, 12) * 2
    logits[0, 3] = logits[0, 8]  # a tie: the lower id first
    for normalize in (True, False):
        idx, weights = cu.moe_route_softmax(xp(logits), 4, normalize)
        want_idx, want_w = qwen.moe_route_softmax(logits, 4, normalize)
        np.testing.assert_array_equal(host(idx), want_idx)
        np.testing.assert_allclose(host(weights), want_w, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 40])
def test_moe_experts_with_widths_the_gemv_kernels_cannot_take(cuda_backend, rng, tokens):
    from ds4_backend_cuda import moe_ops

    E, inter, D, k = 6, 12, 24, 2  # Qwen3.8 tiny shapes: F16 rows of 12 values (24 bytes) for the down matrices
    g_ref, g = _pair(cuda_backend, "F16", (E, inter, D), rng)
    u_ref, u = _pair(cuda_backend, "F16", (E, inter, D), rng)
    d_ref, d = _pair(cuda_backend, "F16", (E, D, inter), rng)
    x = _f32(rng, tokens, D)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    got = moe_ops.moe_experts(cuda_backend.asarray(x), g, u, d, cuda_backend.asarray(idx),
                              cuda_backend.asarray(weights), 0.0)
    want = ref.moe_experts(x, g_ref, u_ref, d_ref, idx, weights, 0.0)
    np.testing.assert_allclose(cuda_backend.to_numpy(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
