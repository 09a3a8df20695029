"""The integer decode path (int8 activations, ``__dp4a``) against the numpy reference ops.

Error bound: each block b of 32 activations becomes ``q · d_b`` with ``d_b = max|x_b| / 127`` and
``|x - q · d_b| <= d_b / 2``, and the integer dot products are exact, so for a row whose element i is
``a_i · code_i - m_i`` (``m_i`` the Q2_K or Q4_K min term, applied to the exact activation sums, else 0)

    |y_int8 - y| <= ½ Σ_i |a_i code_i| d_b(i)          (worst case)
    rms(y_int8 - y) ≈ sqrt(Σ_i (a_i code_i)² d_b(i)² / 12)   (independent uniform rounding)

plus float32 rounding. Each kernel is checked three ways: against a numpy emulation of the int8 activations (float
tolerance), against the reference op within the worst-case bound, and its error's RMS against the prediction.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4_core import ops as ref
from ds4_core.backend import Weight
from ds4_core.quants import block_geometry, dequantize, random_blocks

pytestmark = pytest.mark.gpu

INT8_TYPES = ("Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "MXFP4")


def _pair(backend, qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[Weight, Weight, np.ndarray]:
    """(numpy reference weight, CUDA weight, per-element min offsets m_i) holding the same random blocks."""
    qk, nbytes = block_geometry(qtype)
    raw = random_blocks(qtype, int(np.prod(shape)) // qk, rng).reshape(-1)
    mins = np.zeros(shape, dtype=np.float64)
    if qtype == "Q2_K":  # m_i = dmin · (scale byte >> 4) of element i's 16-element sub-block
        blocks = raw.reshape(-1, nbytes)
        dmin = blocks[:, 82:84].copy().view(np.float16).astype(np.float64)
        mins = np.repeat(dmin * (blocks[:, :16] >> 4), 16, axis=1).reshape(shape)
    if qtype == "Q4_K":  # m_i = dmin · the 6-bit min of element i's 32-element sub-block
        blocks = raw.reshape(-1, nbytes)
        dmin = blocks[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float64)
        packed = blocks[:, 4:16].astype(np.int64)
        m = np.concatenate([packed[:, 4:8] & 63, (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)], axis=1)
        mins = np.repeat(dmin[:, None] * m, 32, axis=1).reshape(shape)
    return (Weight("w", qtype, shape, dequantize(raw, qtype, shape)), backend.upload("w", qtype, shape, raw), mins)


def _activations(rng: np.random.Generator, rows: int, ncols: int) -> np.ndarray:
    """Gaussian rows whose 32-blocks have scales over two decades, and one all-zero block."""
    scale = 10.0 ** rng.uniform(-1, 1, (rows, ncols // 32, 1))
    x = (rng.standard_normal((rows, ncols // 32, 32)) * scale).astype(np.float32)
    x[0, 1] = 0
    return x.reshape(rows, ncols)


def _quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q int8, d float32 per block of 32) computed as the kernel does: q = rint(x · (127 / max|x|))."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.rint(blocks * inv.astype(np.float32)).astype(np.int8)
    return q.reshape(x.shape), (amax / np.float32(127)).astype(np.float32)[..., 0]


def _check(got: np.ndarray, x: np.ndarray, w: np.ndarray, mins: np.ndarray,
           pooled: list[tuple[np.ndarray, float]] | None = None) -> None:
    """``got [T, R]`` against ``x [T, C] @ w.T`` with int8 activations (emulation, bound and RMS as in the doc).

    ``pooled``: collect (errors, predicted mean square) there instead of checking the RMS of a few rows alone.
    """
    q, d = _quantize(x)
    d_cols = np.repeat(d.astype(np.float64), 32, axis=1)
    x_hat = q * d_cols
    scaled = w.astype(np.float64) + mins  # a_i code_i
    # min terms use the exact activation sums, the scaled codes the int8 activations
    emulated = x_hat @ scaled.T - x.astype(np.float64) @ mins.T
    magnitude = np.abs(x_hat) @ np.abs(scaled).T + np.abs(x) @ np.abs(mins).T
    np.testing.assert_array_less(np.abs(got - emulated), 1e-5 * magnitude + 1e-30)
    want = ref.linear(x, Weight("w", "F32", w.shape, w)).astype(np.float64)
    worst = 0.5 * d_cols @ np.abs(scaled).T
    float_err = 1e-6 * (np.abs(x) @ np.abs(scaled).T) * np.sqrt(x.shape[1])
    err = np.abs(got - want)
    np.testing.assert_array_less(err, worst * (1 + 1e-4) + float_err + 1e-30)
    predicted = np.mean((d_cols**2 / 12) @ (scaled**2).T)
    if pooled is not None:
        pooled.append((err.reshape(-1), predicted))
        return
    _check_rms(err.reshape(-1), predicted)


def _check_rms(err: np.ndarray, predicted: float) -> None:
    """The error's RMS within half and 1.5 times the one predicted for independent uniform rounding."""
    assert 0.5 * np.sqrt(predicted) < np.sqrt(np.mean(err**2)) < 1.5 * np.sqrt(predicted)


# 16384 columns: the block's int8 activation (22.5 KB) and the staging pass the default 48 KB of shared memory.
# 20000 rows: enough blocks that each makes several passes (the last one ragged) on GPUs of up to 208 SMs.
@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("nrows, ncols", [(67, 1536), (9, 16384), (20000, 256)])
def test_gemv_int8_within_the_rounding_bound(cuda_backend, qtype, nrows, ncols, rng):
    from ds4_backend_cuda.gemv import gemv_launch

    w_ref, w, mins = _pair(cuda_backend, qtype, (nrows, ncols), rng)
    x = _activations(rng, 1, ncols)
    y = cuda_backend.xp.empty((1, nrows), dtype=np.float32)
    kernel, grid, block, args = gemv_launch(w.data, qtype, ncols, cuda_backend.asarray(x), 1, y, int8=True)
    assert (int(args[8]) > 1) == (nrows == 20000)  # passes per block (the argument after the splits)
    kernel(grid, block, args)
    _check(cuda_backend.to_numpy(y), x, w_ref.data, mins)


# A block's 32 rows span parts of three groups of 24 rows, or eight groups of 4; with 20000 rows blocks make
# several passes and some straddle the two groups.
def test_linears_int8_over_several_matrices(cuda_backend, monkeypatch, rng):
    """The integer GEMV over rows that lie in three buffers (the last ends inside a warp's row group)."""
    from ds4_backend_cuda import numerics, ops

    monkeypatch.setenv(numerics.INT8_ENV, "1")
    ncols = 1024
    pairs = [_pair(cuda_backend, "Q8_0", (r, ncols), rng) for r in (36, 64, 6)]
    x = _activations(rng, 1, ncols)
    got = ops.linears(cuda_backend.asarray(x), tuple(w for _, w, _ in pairs))
    pooled: list[tuple[np.ndarray, float]] = []
    for (w_ref, _, mins), y in zip(pairs, got, strict=True):
        _check(cuda_backend.to_numpy(y), x, w_ref.data, mins, pooled)
    _check_rms(np.concatenate([e for e, _ in pooled]), float(np.mean([p for _, p in pooled])))


@pytest.mark.parametrize("groups, rows", [(4, 24), (12, 4), (2, 10000)])
def test_grouped_gemv_int8(cuda_backend, groups, rows, rng):
    from ds4_backend_cuda.gemv import gemv_launch

    ncols = 256
    w_ref, w, mins = _pair(cuda_backend, "Q8_0", (groups * rows, ncols), rng)
    x = _activations(rng, 1, groups * ncols)
    y = cuda_backend.xp.empty((1, groups * rows), dtype=np.float32)
    kernel, grid, block, args = gemv_launch(w.data, "Q8_0", ncols, cuda_backend.asarray(x), 1, y, groups * ncols,
                                            rows, int8=True)
    kernel(grid, block, args)
    got = cuda_backend.to_numpy(y).reshape(groups, rows)
    pooled: list[tuple[np.ndarray, float]] = []
    for g in range(groups):
        sl = slice(g * rows, (g + 1) * rows)
        _check(got[g][None], x[:, g * ncols:(g + 1) * ncols], w_ref.data[sl], mins[sl], pooled)
    _check_rms(np.concatenate([e for e, _ in pooled]), float(np.mean([p for _, p in pooled])))


# Eight tokens: a format whose scaled codes are all positive (Q2_K, Q4_K) gives one expert's rows nearly the same
# rounding error, so the error's RMS is a statistic of about one draw a token, not one a row.
def _moe_case(backend, qtype: str, rng: np.random.Generator):
    E, rows, ncols, T, k = 4, 36, 512, 8, 3
    w_ref, w, mins = _pair(backend, qtype, (E, rows, ncols), rng)
    idx = rng.integers(0, E, T * k).astype(np.int32)
    idx[[1, 10]] = -1
    return w_ref, w, mins, _activations(rng, T, ncols), idx, k


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_moe_gemv_int8(cuda_backend, qtype, rng):
    from ds4_backend_cuda.gemv import moe_gemv_launch

    w_ref, w, mins, x, idx, k = _moe_case(cuda_backend, qtype, rng)
    y = cuda_backend.xp.full((idx.size, w.shape[1]), np.nan, dtype=np.float32)
    kernel, grid, block, args = moe_gemv_launch(w, cuda_backend.asarray(idx), cuda_backend.asarray(x), k, y,
                                                int8=True)
    kernel(grid, block, args)
    got = cuda_backend.to_numpy(y)
    pooled: list[tuple[np.ndarray, float]] = []
    for p, e in enumerate(idx):
        if e < 0:
            np.testing.assert_array_equal(got[p], 0)
        else:
            _check(got[p][None], x[p // k][None], w_ref.data[e], mins[e], pooled)
    _check_rms(np.concatenate([e for e, _ in pooled]), float(np.mean([p for _, p in pooled])))


def _silu(g: np.ndarray) -> np.ndarray:
    return g / (1 + np.exp(-g))


@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("limit", [0.0, 0.8])
def test_moe_gate_up_int8(cuda_backend, qtype, limit, rng):
    from ds4_backend_cuda.gemv import moe_gate_up_launch

    g_ref, g, g_mins, x, idx, k = _moe_case(cuda_backend, qtype, rng)
    u_ref, u, u_mins = _pair(cuda_backend, qtype, g.shape, rng)
    h = cuda_backend.xp.full((idx.size, g.shape[1]), np.nan, dtype=np.float32)
    kernel, grid, block, args = moe_gate_up_launch(g, u, cuda_backend.asarray(idx), cuda_backend.asarray(x), k,
                                                   limit, h, int8=True)
    kernel(grid, block, args)
    got = cuda_backend.to_numpy(h)
    for p, e in enumerate(idx):
        if e < 0:
            np.testing.assert_array_equal(got[p], 0)
            continue
        xt = x[p // k][None]
        gate, up = (ref.linear(xt, Weight("w", "F32", w.shape[1:], w.data[e]))[0].astype(np.float64)
                    for w in (g_ref, u_ref))
        _, d = _quantize(xt)
        d_cols = np.repeat(d.astype(np.float64), 32, axis=1)[0]
        dg, du = (0.5 * d_cols @ np.abs(w.data[e] + m[e]).T * (1 + 1e-4) + 1e-5 * np.abs(xt[0]) @ np.abs(w.data[e]).T
                  for w, m in ((g_ref, g_mins), (u_ref, u_mins)))
        want = ref.swiglu(gate.astype(np.float32), up.astype(np.float32), limit).astype(np.float64)
        bound = 1.1 * dg * (np.abs(up) + du) + (np.abs(_silu(gate)) + 0.3 + 1.1 * dg) * du
        np.testing.assert_array_less(np.abs(got[p] - want), bound + 1e-6 * np.abs(want) + 1e-30)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_gate_up_split_over_warps_sums_the_same_chunks(cuda_backend, qtype, rng):
    """A gate/up row group split over 2 or 4 warps (each a share of its 4 chunks, summed in a fixed order) gives the
    unsplit sums up to float32 rounding; the shared expert's one set of rows (a null idx) is split by default."""
    from ds4_backend_cuda import gemv

    (_, gate, _), (_, up, _) = (_pair(cuda_backend, qtype, (2, 40, 4096), rng) for _ in range(2))
    x = cuda_backend.asarray(_activations(rng, 1, 4096))
    idx = cuda_backend.asarray(np.array([1, -1, 0], np.int32))
    out = {}
    for splits in (1, 2, 4, None):
        for ids, pairs in ((idx, 3), (None, 1)):
            h = cuda_backend.xp.full((pairs, 40), np.nan, dtype=np.float32)
            kernel, grid, block, args = gemv.moe_gate_up_launch(gate, up, ids, x, pairs, 0.8, h, int8=True,
                                                                splits=splits)
            kernel(grid, block, args)
            out[splits, pairs] = cuda_backend.to_numpy(h)
    assert gemv._gate_up_splits(qtype, 40, 4096, 1) > 1
    for pairs in (3, 1):
        plain = out[1, pairs]
        assert np.isfinite(plain).all() and np.abs(plain).max() > 0
        for splits in (2, 4, None):
            np.testing.assert_allclose(out[splits, pairs], plain, rtol=1e-5, atol=1e-6 * np.abs(plain).max())
    np.testing.assert_array_equal(out[4, 3][1], 0)
    h = cuda_backend.xp.empty((3, 40), dtype=np.float32)
    with pytest.raises(ValueError, match="split over 1, 2, 4"):
        gemv.moe_gate_up_launch(gate, up, idx, x, 3, 0.0, h, int8=True, splits=3)


@pytest.mark.parametrize("int8", [False, True])
def test_gate_up_without_ids_is_expert_zero(cuda_backend, int8, rng):
    """A null id array (the shared expert) is expert 0 for every pair: the same sums as explicit zero ids."""
    from ds4_backend_cuda.gemv import moe_gate_up_launch

    _, gate, _ = _pair(cuda_backend, "Q8_0", (1, 40, 512), rng)
    _, up, _ = _pair(cuda_backend, "Q8_0", (1, 40, 512), rng)
    x = cuda_backend.asarray(_activations(rng, 3, 512))
    out = []
    for idx in (None, cuda_backend.asarray(np.zeros(3, np.int32))):
        h = cuda_backend.xp.full((3, 40), np.nan, dtype=np.float32)
        kernel, grid, block, args = moe_gate_up_launch(gate, up, idx, x, 1, 0.0, h, int8=int8)
        kernel(grid, block, args)
        out.append(cuda_backend.to_numpy(h))
    np.testing.assert_array_equal(out[0], out[1])
    assert np.isfinite(out[0]).all() and np.abs(out[0]).max() > 0


def test_graph_replay_equals_eager(cuda_backend, rng):
    import cupy as cp
    from ds4_backend_cuda.gemv import gemv_launch, moe_gate_up_launch, moe_gemv_launch

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _, w8, _ = _pair(cuda_backend, "Q8_0", (40, 512), rng)
        _, gate, _ = _pair(cuda_backend, "IQ2_XXS", (4, 64, 512), rng)
        _, up, _ = _pair(cuda_backend, "IQ2_XXS", (4, 64, 512), rng)
        _, down, _ = _pair(cuda_backend, "Q2_K", (4, 512, 256), rng)
        x = cp.asarray(_activations(rng, 1, 512))
        idx = cp.asarray(np.array([3, 0, 2], dtype=np.int32))
        y, h, out = (cp.empty(shape, dtype=cp.float32) for shape in ((1, 40), (3, 64), (3, 512)))
        x_down = cp.asarray(_activations(rng, 3, 256))
        launches = [gemv_launch(w8.data, "Q8_0", 512, x, 1, y, int8=True),
                    moe_gate_up_launch(gate, up, idx, x, 3, 0.0, h, int8=True),
                    moe_gemv_launch(down, idx, x_down, 1, out, int8=True)]
        for kernel, grid, block, args in launches:
            kernel(grid, block, args)
        eager = [cp.asnumpy(o) for o in (y, h, out)]
        for o in (y, h, out):
            o.fill(np.nan)
        stream.begin_capture()
        for kernel, grid, block, args in launches:
            kernel(grid, block, args)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        for want, got in zip(eager, (y, h, out), strict=True):
            np.testing.assert_array_equal(cp.asnumpy(got), want)
    assert all(np.isfinite(e).all() for e in eager)


def test_environment_switch_selects_the_path(cuda_backend, monkeypatch, rng):
    from ds4_backend_cuda import gemv, numerics, ops

    _, w, _ = _pair(cuda_backend, "Q8_0", (32, 256), rng)
    x = cuda_backend.asarray(_activations(rng, 1, 256))
    results = {}
    for int8 in (False, True):
        y = cuda_backend.xp.empty((1, 32), dtype=np.float32)
        kernel, grid, block, args = gemv.gemv_launch(w.data, "Q8_0", 256, x, 1, y, int8=int8)
        kernel(grid, block, args)
        results[int8] = cuda_backend.to_numpy(y)
    assert not np.array_equal(results[False], results[True])
    for env, int8 in (("1", True), ("0", False), (None, True)):  # unset: int8 is the default
        if env is None:
            monkeypatch.delenv(numerics.INT8_ENV)
        else:
            monkeypatch.setenv(numerics.INT8_ENV, env)
        np.testing.assert_array_equal(cuda_backend.to_numpy(ops.linear(x, w)), results[int8])


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_norm_linear_folds_the_rms_norm_into_the_int8_gemv(cuda_backend, monkeypatch, qtype, rng):
    """One token's RMSNorm folded into the int8 GEMV (DeepSeek V4's query latent into ``attn_q_b``): divided by the
    norm's scale rsqrt(mean(x²) + eps), the result is the int8 GEMV of x · norm within the rounding bound; two
    tokens take the composition (``rms_norm``, then ``linear``), bit for bit."""
    from ds4_backend_cuda import deepseek4_ops as cu
    from ds4_backend_cuda import numerics, ops

    monkeypatch.setenv(numerics.INT8_ENV, "1")
    ncols = 1024
    w_ref, w, mins = _pair(cuda_backend, qtype, (300, ncols), rng)
    x = _activations(rng, 2, ncols)
    gain = rng.uniform(0.5, 2.0, ncols).astype(np.float32)
    norm = cuda_backend.upload("n", "F32", (ncols,), gain.view(np.uint8))
    got = cuda_backend.to_numpy(cu.norm_linear(cuda_backend.asarray(x[:1]), norm, 1e-6, w))
    scale = 1 / np.sqrt(np.mean(x[:1].astype(np.float64) ** 2) + 1e-6)
    _check(got / scale, x[:1] * gain, w_ref.data, mins)
    xs = cuda_backend.asarray(x)
    np.testing.assert_array_equal(cuda_backend.to_numpy(cu.norm_linear(xs, norm, 1e-6, w)),
                                  cuda_backend.to_numpy(ops.linear(ops.rms_norm(xs, norm, 1e-6), w)))


# 4 groups of 64 rows: one pass a block; 4 groups of 4096 rows: several passes a block on GPUs of up to 170 SMs.
@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("groups, rows", [(4, 64), (4, 4096)])
def test_output_projection_hands_over_the_quantized_activation(cuda_backend, monkeypatch, qtype, groups, rows, rng):
    """DeepSeek V4's grouped output projection of one token: ``attn_output_a``'s GEMV writes its output quantized and
    ``attn_output_b``'s reads it, which gives the two launches' result bit for bit (the codes are those the second
    GEMV would make); two tokens take the composition."""
    from ds4_backend_cuda import deepseek4_ops as cu
    from ds4_backend_cuda import gemv, numerics, ops

    monkeypatch.setenv(numerics.INT8_ENV, "1")
    ncols = 256
    _, out_a, _ = _pair(cuda_backend, qtype, (groups * rows, ncols), rng)
    _, out_b, _ = _pair(cuda_backend, qtype, (96, groups * rows), rng)
    assert gemv.writes_activation(qtype, groups * rows, ncols)
    if groups * rows > 4096:
        assert int(gemv.gemv_launch(out_a.data, qtype, ncols, None, 1, None, groups * ncols, rows)[3][8]) > 1
    o = cuda_backend.asarray(_activations(rng, 2, groups * ncols).reshape(2, 2 * groups, ncols // 2))
    for t in (slice(0, 1), slice(0, 2)):
        apart = ops.linear(ops.grouped_linear(o[t].reshape(t.stop, groups, ncols), out_a).reshape(t.stop, -1), out_b)
        np.testing.assert_array_equal(cuda_backend.to_numpy(cu.output_projection(o[t], out_a, out_b, groups)),
                                      cuda_backend.to_numpy(apart))


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_attention_hands_its_output_over_quantized(cuda_backend, monkeypatch, qtype, rng):
    """A decode step's attention output (``norm_rope_attention``'s merge) comes with its int8 activation, the codes
    and scales the GEMVs' own quantization makes; the grouped output projection reads it, bit for bit the result of
    the same values without it."""
    from ds4_backend_cuda import attention_ops, gemv, numerics
    from ds4_backend_cuda import deepseek4_ops as cu

    monkeypatch.setenv(numerics.INT8_ENV, "1")
    xp, host = cuda_backend.asarray, cuda_backend.to_numpy
    H, d, half, N, groups = 8, 256, 32, 300, 2
    q = xp(rng.standard_normal((1, H, d), dtype=np.float32))
    kv = xp(rng.standard_normal((N, d), dtype=np.float32))
    idx = xp(rng.integers(-1, N, (1, 100)).astype(np.int32))
    sinks = _pair(cuda_backend, "F32", (H,), rng)[1]
    inv_freq = xp((10000.0 ** (-np.arange(half) / half)).astype(np.float32))
    o = attention_ops.norm_rope_attention(q, 1e-6, kv, idx, sinks, d ** -0.5, xp(np.array([1234], np.int32)), inv_freq)
    assert isinstance(o, gemv.Int8Rows) and gemv.int8_of(o, H * d) is not None
    act, flat = host(o.int8), host(o).reshape(1, -1)
    codes, scales = _quantize(flat)
    np.testing.assert_array_equal(act[:H * d].view(np.int8), codes[0])
    np.testing.assert_array_equal(act[H * d + H * d // 4:].view(np.float32), scales[0])
    halves = flat.reshape(-1, 2, 16).astype(np.float64).sum(axis=-1)
    np.testing.assert_allclose(act[H * d:H * d + H * d // 4].view(np.float32).reshape(-1, 2), halves, rtol=1e-5,
                               atol=1e-5)
    out_a = _pair(cuda_backend, qtype, (groups * 128, H * d // groups), rng)[1]
    out_b = _pair(cuda_backend, qtype, (96, groups * 128), rng)[1]
    assert gemv.writes_activation(qtype, groups * 128, H * d // groups)
    got = host(cu.output_projection(o, out_a, out_b, groups))
    np.testing.assert_array_equal(got, host(cu.output_projection(o.copy(), out_a, out_b, groups)))
    assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_quantized_activation_refusals(cuda_backend, monkeypatch, rng):
    """A GEMV that cannot hand over or take a quantized activation says so instead of writing or reading past it."""
    from ds4_backend_cuda import gemv, numerics

    monkeypatch.setenv(numerics.INT8_ENV, "1")
    xp = cuda_backend.xp
    _, w, _ = _pair(cuda_backend, "Q8_0", (64, 1024), rng)
    x, y = xp.zeros((1, 1024), dtype=np.float32), xp.empty((1, 64), dtype=np.float32)
    act = xp.empty(gemv.act_bytes(1024), dtype=np.uint8)
    with pytest.raises(ValueError, match="without a norm"):
        gemv.gemv_launch(w.data, "Q8_0", 1024, x, 1, y, int8=True, act_in=act, norm=(xp.ones(1024, np.float32), 1e-6))
    with pytest.raises(ValueError, match="as 1408 bytes; got 1407"):
        gemv.gemv_launch(w.data, "Q8_0", 1024, x, 1, y, int8=True, act_in=act[:-1])
    assert gemv.writes_activation("Q8_0", 64, 1024)
    with pytest.raises(ValueError, match="cannot write its 64 rows as a quantized activation of 88 bytes"):
        gemv.gemv_launch(w.data, "Q8_0", 1024, x, 1, y, int8=True, act_out=act)
    _, wide, _ = _pair(cuda_backend, "Q8_0", (64, 16384), rng)  # 16 chunks a row: its rows are split over warps
    assert not gemv.writes_activation("Q8_0", 64, 16384)
    with pytest.raises(ValueError, match="cannot write its 64 rows"):
        gemv.gemv_launch(wide.data, "Q8_0", 16384, xp.zeros((1, 16384), np.float32), 1, y, int8=True,
                         act_out=act[:gemv.act_bytes(64)])
    with pytest.raises(ValueError, match="only the int8 GEMV of one token"):
        gemv.gemv_launch(w.data, "Q8_0", 1024, xp.zeros((2, 1024), np.float32), 2, xp.empty((2, 64), np.float32),
                         act_in=act)


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_hc_split_norm_hands_its_row_over_quantized(cuda_backend, monkeypatch, qtype, rng):
    """A decode step's sub-layer input (``hc_split_norm``, DeepSeek V4's ``hc_pre_norm`` and ``hc_post_pre_norm``)
    and the model's normalised output (``hc_post_head_norm``) come with their int8 activation: the codes and scales
    the GEMVs' own quantization makes, which a projection, the projections of one input, the routed experts' gate/up
    and the shared expert's read in its place, bit for bit the results of the same row without it. A row derived
    from it, or made with int8 off, carries none."""
    from ds4_backend_cuda import deepseek4_ops as cu
    from ds4_backend_cuda import gemv, moe_ops, numerics, ops
    from ds4_backend_cuda import hc_ops as hc

    monkeypatch.setenv(numerics.INT8_ENV, "1")
    xp, host = cuda_backend.asarray, cuda_backend.to_numpy
    n, D, E, F = 4, 1024, 4, 256
    S = xp(_activations(rng, n, D)[None])
    fn, sc, base, norm = (_pair(cuda_backend, q, shape, rng)[1] for q, shape in (
        ("F16", ((2 + n) * n, n * D)), ("F32", (3,)), ("F32", ((2 + n) * n,)), ("F32", (D,))))
    x, post, comb = hc.hc_pre_norm(S, fn, sc, base, 20, 1e-6, 1e-6, norm)
    x2 = hc.hc_post_pre_norm(S, (xp(_activations(rng, 1, D)),), post, comb, fn, sc, base, 20, 1e-6, 1e-6, norm)[1]
    hfn, hsc, hbase = (_pair(cuda_backend, q, shape, rng)[1] for q, shape in (
        ("F16", (n, n * D)), ("F32", (1,)), ("F32", (n,))))
    x3 = hc.hc_post_head_norm(S, (xp(_activations(rng, 1, D)),), post, comb, hfn, hsc, hbase, 1e-6, 1e-6, norm)[1]
    gate, up = (_pair(cuda_backend, qtype, (E, F, D), rng)[1] for _ in range(2))
    down = _pair(cuda_backend, qtype, (E, D, F), rng)[1]
    shared = [_pair(cuda_backend, qtype, shape, rng)[1] for shape in ((F, D), (F, D), (D, F))]
    idx, weights = xp(np.array([[3, 0, 2]], np.int32)), xp(np.array([[0.5, 0.3, 0.2]], np.float32))
    for row in (x, x2, x3):
        assert isinstance(row, gemv.Int8Rows) and gemv.int8_of(row, D) is not None
        act = host(row.int8)
        q, d = _quantize(host(row))
        np.testing.assert_array_equal(act[:D].view(np.int8), q[0])
        np.testing.assert_array_equal(act[D + D // 4:].view(np.float32), d[0])
        halves = host(row).reshape(-1, 2, 16).astype(np.float64).sum(axis=-1)
        np.testing.assert_allclose(act[D:D + D // 4].view(np.float32).reshape(-1, 2), halves, rtol=1e-5, atol=1e-5)
        plain = row.copy()
        assert gemv.int8_of(plain, D) is None and gemv.int8_of(row.reshape(1, D), D) is None
        for got, want in (
                ((ops.linear(row, shared[0]),), (ops.linear(plain, shared[0]),)),
                (ops.linears(row, shared[:2]), ops.linears(plain, shared[:2])),
                ((moe_ops.moe_experts(row, gate, up, down, idx, weights, 0.0),),
                 (moe_ops.moe_experts(plain, gate, up, down, idx, weights, 0.0),)),
                ((cu.shared_expert(row, *shared, 0.0),), (cu.shared_expert(plain, *shared, 0.0),))):
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(host(g), host(w))
                assert np.isfinite(host(g)).all() and np.abs(host(g)).max() > 0
    monkeypatch.setenv(numerics.INT8_ENV, "0")
    assert not isinstance(hc.hc_pre_norm(S, fn, sc, base, 20, 1e-6, 1e-6, norm)[0], gemv.Int8Rows)


@pytest.mark.parametrize("host", ["gemv", "gate/up", "none", "another stream"])
def test_a_recorded_steps_split_runs_in_the_next_int8_launch(cuda_backend, monkeypatch, host, rng):
    """While a step is recorded (``split_hosting.hosting``), a one-token ``hc_post_pre_norm`` leaves its Sinkhorn
    to the next int8 GEMV or gate/up launched on its stream, as one extra block, and post and comb come out bit for
    bit as the kernel makes them itself; with no such launch, or one on a stream not ordered after it, the split
    runs when the recording ends. The launch's own output is unchanged."""
    from ds4_backend_cuda import hc_ops as hc
    from ds4_backend_cuda import moe_ops, numerics, ops, split_hosting

    monkeypatch.setenv(numerics.INT8_ENV, "1")
    xp, host_of = cuda_backend.asarray, cuda_backend.to_numpy
    n, D, E, F = 4, 1024, 4, 256
    S, y = xp(_activations(rng, n, D)[None]), xp(_activations(rng, 1, D))
    fn, sc, base, norm = (_pair(cuda_backend, q, shape, rng)[1] for q, shape in (
        ("F16", ((2 + n) * n, n * D)), ("F32", (3,)), ("F32", ((2 + n) * n,)), ("F32", (D,))))
    _, post, comb = hc.hc_pre_norm(S, fn, sc, base, 20, 1e-6, 1e-6, norm)
    w = _pair(cuda_backend, "Q8_0", (64, D), rng)[1]
    gate, up = (_pair(cuda_backend, "Q8_0", (E, F, D), rng)[1] for _ in range(2))
    down = _pair(cuda_backend, "Q8_0", (E, D, F), rng)[1]
    idx, weights = xp(np.array([[3, 0]], np.int32)), xp(np.array([[0.6, 0.4]], np.float32))

    def launch(x):
        if host == "gate/up":
            return moe_ops.moe_experts(x, gate, up, down, idx, weights, 0.0)
        if host == "another stream":
            other = cuda_backend.xp.cuda.Stream(non_blocking=True)
            other.wait_event(cuda_backend.xp.cuda.get_current_stream().record())
            with other:
                out = ops.linear(x, w)
            cuda_backend.xp.cuda.get_current_stream().wait_event(other.record())
            return out
        return ops.linear(x, w)

    want = hc.hc_post_pre_norm(S, (y,), post, comb, fn, sc, base, 20, 1e-6, 1e-6, norm)
    want_out = launch(want[1]) if host != "none" else None
    with split_hosting.hosting():
        got = hc.hc_post_pre_norm(S, (y,), post, comb, fn, sc, base, 20, 1e-6, 1e-6, norm)
        assert split_hosting.pending()
        if host != "none":
            np.testing.assert_array_equal(host_of(launch(got[1])), host_of(want_out))
        assert split_hosting.pending() == (host in ("none", "another stream"))
    assert not split_hosting.pending() and not split_hosting.enabled()
    for g, wanted in zip(got, want, strict=True):
        np.testing.assert_array_equal(host_of(g), host_of(wanted))
    assert np.abs(host_of(got[3])).max() > 0  # comb
    with pytest.raises(RuntimeError, match="a failed step"), split_hosting.hosting():
        hc.hc_post_pre_norm(S, (y,), post, comb, fn, sc, base, 20, 1e-6, 1e-6, norm)
        raise RuntimeError("a failed step")
    assert not split_hosting.pending() and not split_hosting.enabled()


def test_gate_up_refuses_a_quantized_activation_of_the_wrong_size(cuda_backend, rng):
    from ds4_backend_cuda import gemv

    _, gate, _ = _pair(cuda_backend, "Q8_0", (1, 40, 512), rng)
    x, h = cuda_backend.xp.zeros((2, 512), np.float32), cuda_backend.xp.empty((2, 40), np.float32)
    act = cuda_backend.xp.empty(gemv.act_bytes(512), np.uint8)
    with pytest.raises(ValueError, match="one row of 704 bytes; got 704 bytes for 2 rows"):
        gemv.moe_gate_up_launch(gate, gate, None, x, 1, 0.0, h, int8=True, act_in=act)
    with pytest.raises(ValueError, match="only the int8 kernels"):
        gemv.moe_gate_up_launch(gate, gate, None, x[:1], 1, 0.0, h[:1], int8=False, act_in=act)


def _routed_case(backend, qtype: str, rng: np.random.Generator, F: int = 256):
    """(gate, up, down, x [T, D], idx [T, k] with a negative id, weights [T, k]) of a routed MoE on CUDA."""
    E, D, T, k = 4, 512, 2, 3
    gate, up = (_pair(backend, qtype, (E, F, D), rng)[1] for _ in range(2))
    down = _pair(backend, qtype, (E, 70, F), rng)[1]  # 70 rows: a partial block of rows at the end
    idx = np.array([[2, -1, 0], [3, 2, 1]], dtype=np.int32)
    weights = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return gate, up, down, backend.asarray(_activations(rng, T, D)), idx, weights


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_down_sum_has_the_bits_of_the_pairs_rows_summed(cuda_backend, qtype, rng):
    """The routed experts' down projections and their weighted sum in one launch give the bits of the per-pair
    GEMV's rows (``moe_gemv_i8``, checked against numpy above) summed by ``weighted_rows`` (``hc_collapse``); a
    negative id adds nothing."""
    from ds4_backend_cuda import gemv, ops

    xp, host = cuda_backend.xp, cuda_backend.to_numpy
    _, _, down, _, idx, weights = _routed_case(cuda_backend, qtype, rng)
    T, k = idx.shape
    h = xp.asarray(_activations(rng, T * k, down.shape[2]))
    flat, w = xp.asarray(idx.reshape(-1)), xp.asarray(weights)
    rows = xp.full((T * k, 70), np.nan, dtype=np.float32)
    kernel, grid, block, args = gemv.moe_gemv_launch(down, flat, h, 1, rows, int8=True)
    kernel(grid, block, args)
    want = host(ops.weighted_rows(w, rows.reshape(T, k, 70)))
    out = xp.full((T, 70), np.nan, dtype=np.float32)
    kernel, grid, block, args = gemv.moe_down_sum_launch(down, flat, k, h, w, out)
    kernel(grid, block, args)
    np.testing.assert_array_equal(host(out), want)
    assert np.isfinite(want).all() and np.abs(want).max() > 0


@pytest.mark.parametrize("qtype", ["Q2_K", "IQ2_XXS"])
def test_gate_up_hands_its_output_to_the_summed_down_quantized(cuda_backend, monkeypatch, qtype, rng):
    """The routed gate/up of the 2-bit formats (a block's 32 rows one group) also writes its SwiGLU output in the
    int8 layout: the codes and scales the down's own quantization makes, which the summed down reads in their place
    with the same bits as from the float rows. ``moe_experts`` takes both launches."""
    from ds4_backend_cuda import gemv, moe_ops, numerics

    monkeypatch.setenv(numerics.INT8_ENV, "1")
    xp, host = cuda_backend.xp, cuda_backend.to_numpy
    gate, up, down, x, idx, weights = _routed_case(cuda_backend, qtype, rng)
    T, k = idx.shape
    F = gate.shape[1]
    assert gemv.gate_up_writes_activation(qtype, F) and not gemv.gate_up_writes_activation("Q8_0", F)
    flat, w = xp.asarray(idx.reshape(-1)), xp.asarray(weights)
    h = xp.full((T * k, F), np.nan, dtype=np.float32)
    act = xp.zeros(gemv.act_bytes(h.size), dtype=np.uint8)
    kernel, grid, block, args = gemv.moe_gate_up_launch(gate, up, flat, x, k, 0.0, h, int8=True, act_out=act)
    kernel(grid, block, args)
    n, got = h.size, host(act)
    q, d = _quantize(host(h).reshape(1, n))
    np.testing.assert_array_equal(got[:n].view(np.int8), q[0])
    np.testing.assert_array_equal(got[n + n // 4:].view(np.float32), d[0])
    halves = host(h).reshape(-1, 2, 16).astype(np.float64).sum(axis=-1)
    np.testing.assert_allclose(got[n:n + n // 4].view(np.float32).reshape(-1, 2), halves, rtol=1e-5, atol=1e-5)
    out = []
    for a in (act, None):
        y = xp.full((T, 70), np.nan, dtype=np.float32)
        kernel, grid, block, args = gemv.moe_down_sum_launch(down, flat, k, h, w, y, act_in=a)
        kernel(grid, block, args)
        out.append(host(y))
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_array_equal(host(moe_ops.moe_experts(x, gate, up, down, xp.asarray(idx), w, 0.0)), out[0])
    assert np.isfinite(out[0]).all() and np.abs(out[0]).max() > 0


def test_routed_handover_refusals(cuda_backend, monkeypatch, rng):
    """A gate/up that cannot write its output quantized, or a summed down given what it cannot take, says so."""
    from ds4_backend_cuda import gemv, numerics

    monkeypatch.setenv(numerics.INT8_ENV, "1")
    xp = cuda_backend.xp
    gate, up, down, x, idx, weights = _routed_case(cuda_backend, "Q8_0", rng, F=64)
    flat, w = xp.asarray(idx.reshape(-1)), xp.asarray(weights)
    h = xp.empty((6, 64), dtype=np.float32)
    act = xp.empty(gemv.act_bytes(h.size), dtype=np.uint8)
    with pytest.raises(ValueError, match="cannot write its 384 values as a quantized activation of 528 bytes"):
        gemv.moe_gate_up_launch(gate, up, flat, x, 3, 0.0, h, int8=True, act_out=act)  # Q8_0: 16 rows a block
    gate2 = _pair(cuda_backend, "Q2_K", (4, 64, 512), rng)[1]
    with pytest.raises(ValueError, match="cannot write its 384 values"):
        gemv.moe_gate_up_launch(gate2, gate2, flat, x, 3, 0.0, h, int8=True, act_out=act[:-1])
    with pytest.raises(ValueError, match="only the int8 kernels"):
        gemv.moe_gate_up_launch(gate2, gate2, flat, x, 3, 0.0, h, int8=False, act_out=act)
    with pytest.raises(ValueError, match="splits its rows over warps cannot write"):
        gemv.moe_gate_up_launch(gate2, gate2, flat, x, 3, 0.0, h, int8=True, act_out=act, splits=2)
    y = xp.empty((2, 70), dtype=np.float32)
    with pytest.raises(ValueError, match="is 528 bytes; got 527"):
        gemv.moe_down_sum_launch(down, flat, 3, h, w, y, act_in=act[:-1])
    many = xp.zeros(18, dtype=np.int32)
    with pytest.raises(ValueError, match="takes 1 to 8 experts a token on the int8 path, rows of its 64 columns; "
                                         "got 9 for 2 tokens"):
        gemv.moe_down_sum_launch(down, many, 9, xp.empty((18, 64), np.float32), xp.ones((2, 9), np.float32), y)
    with pytest.raises(ValueError, match="got 3 for 2 tokens and 6 rows of 32"):
        gemv.moe_down_sum_launch(down, flat, 3, h[:, :32], w, y)
