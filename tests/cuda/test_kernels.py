"""Each CUDA kernel against its numpy reference op on random inputs and random valid quant blocks."""

from __future__ import annotations

import numpy as np
import pytest

from ds4_core import ops as ref
from ds4_core.backend import Weight
from ds4_core.errors import BackendError
from ds4_core.quants import block_geometry, dequantize, random_blocks

pytestmark = pytest.mark.gpu

QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K", "IQ2_XXS", "MXFP4")


def _raw(qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    qk, _ = block_geometry(qtype)
    return random_blocks(qtype, int(np.prod(shape)) // qk, rng).reshape(-1)


def _pair(backend, qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[Weight, Weight]:
    """(numpy reference weight, CUDA weight) holding the same random blocks."""
    raw = _raw(qtype, shape, rng)
    return Weight("w", qtype, shape, dequantize(raw, qtype, shape)), backend.upload("w", qtype, shape, raw)


def _bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Float32 summation error scale of ``x @ w.T``: eps · (|x| @ |w|.T) · sqrt(n) with a floor."""
    return 1e-6 * (np.abs(x) @ np.abs(w).T) * np.sqrt(x.shape[-1]) + 1e-30


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_the_numpy_oracle(cuda_backend, qtype, rng):
    from ds4_backend_cuda.ops import dequantize_rows

    shape = (5, 512)
    w_ref, w = _pair(cuda_backend, qtype, shape, rng)
    got = cuda_backend.to_numpy(dequantize_rows(w.data, qtype, shape[1]))
    scale = np.abs(w_ref.data).max()
    np.testing.assert_allclose(got, w_ref.data, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 8, 20, 40])
def test_linear_matches_reference(cuda_backend, qtype, tokens, rng):
    from ds4_backend_cuda import ops

    w_ref, w = _pair(cuda_backend, qtype, (67, 768), rng)
    x = rng.standard_normal((tokens, 768), dtype=np.float32)
    got = cuda_backend.to_numpy(ops.linear(cuda_backend.asarray(x), w))
    want = ref.linear(x, w_ref)
    assert got.shape == want.shape
    assert np.all(np.abs(got - want) <= _bound(x, w_ref.data))


@pytest.mark.parametrize("ncols", [96, 160])  # rows of 102 and 170 bytes: every 2-byte alignment within 16 bytes
@pytest.mark.parametrize("tokens", [1, 3])
def test_q8_0_rows_at_any_alignment(cuda_backend, ncols, tokens, rng):
    from ds4_backend_cuda import ops

    w_ref, w = _pair(cuda_backend, "Q8_0", (37, ncols), rng)
    x = rng.standard_normal((tokens, ncols), dtype=np.float32)
    got = cuda_backend.to_numpy(ops.linear(cuda_backend.asarray(x), w))
    assert np.all(np.abs(got - ref.linear(x, w_ref)) <= _bound(x, w_ref.data))


def test_linear_keeps_leading_axes_and_odd_float_widths(cuda_backend, rng):
    from ds4_backend_cuda import ops

    w_ref, w = _pair(cuda_backend, "F32", (6, 3), rng)
    x = rng.standard_normal((2, 4, 3), dtype=np.float32)
    got = cuda_backend.to_numpy(ops.linear(cuda_backend.asarray(x), w))
    np.testing.assert_allclose(got, ref.linear(x, w_ref), rtol=1e-5, atol=1e-5)


def test_embed_and_grouped_linear(cuda_backend, rng):
    from ds4_backend_cuda import ops

    table_ref, table = _pair(cuda_backend, "Q8_0", (50, 64), rng)
    ids = np.array([3, 0, 49, 3], dtype=np.int32)
    np.testing.assert_allclose(cuda_backend.to_numpy(ops.embed(table, cuda_backend.asarray(ids))),
                               ref.embed(table_ref, ids), rtol=1e-6)
    w_ref, w = _pair(cuda_backend, "Q8_0", (4 * 24, 64), rng)
    x = rng.standard_normal((3, 4, 64), dtype=np.float32)
    got = cuda_backend.to_numpy(ops.grouped_linear(cuda_backend.asarray(x), w))
    np.testing.assert_allclose(got, ref.grouped_linear(x, w_ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("gate_type,down_type", [("IQ2_XXS", "Q2_K"), ("Q4_K", "Q4_K"), ("MXFP4", "Q8_0"),
                                                 ("F16", "BF16")])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_moe_experts_reads_selected_experts(cuda_backend, gate_type, down_type, tokens, rng):
    from ds4_backend_cuda import moe_ops

    E, inter, D, k = 8, 256, 512, 3
    g_ref, g = _pair(cuda_backend, gate_type, (E, inter, D), rng)
    u_ref, u = _pair(cuda_backend, gate_type, (E, inter, D), rng)
    d_ref, d = _pair(cuda_backend, down_type, (E, D, inter), rng)
    x = rng.standard_normal((tokens, D), dtype=np.float32)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(tokens)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (tokens, k)).astype(np.float32)
    want = ref.moe_experts(x, g_ref, u_ref, d_ref, idx, weights, 0.8)
    got = cuda_backend.to_numpy(moe_ops.moe_experts(cuda_backend.asarray(x), g, u, d, cuda_backend.asarray(idx),
                                                    cuda_backend.asarray(weights), 0.8))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_elementwise_and_norm_ops(cuda_backend, rng):
    from ds4_backend_cuda import ops

    xp = cuda_backend.asarray
    x = rng.standard_normal((5, 3, 64), dtype=np.float32) * 3
    norm_ref, norm = _pair(cuda_backend, "F32", (64,), rng)
    np.testing.assert_allclose(cuda_backend.to_numpy(ops.rms_norm(xp(x), norm, 1e-6)),
                               ref.rms_norm(x, norm_ref, 1e-6), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cuda_backend.to_numpy(ops.rms_norm(xp(x), None, 1e-6)),
                               ref.rms_norm(x, None, 1e-6), rtol=1e-5, atol=1e-6)
    # rows past the 8 elements a thread of a full block holds (norm.cu's HELD), width not a warp multiple
    wide = rng.standard_normal((2, 9000), dtype=np.float32)
    wide_ref, wide_w = _pair(cuda_backend, "F32", (9000,), rng)
    np.testing.assert_allclose(cuda_backend.to_numpy(ops.rms_norm(xp(wide), wide_w, 1e-6)),
                               ref.rms_norm(wide, wide_ref, 1e-6), rtol=1e-5, atol=1e-6)
    pos = np.array([0, 1, 7, 100, 5000], dtype=np.int32)
    inv = (1.0 / 10000 ** (np.arange(8) / 8)).astype(np.float32)
    for inverse in (False, True):
        np.testing.assert_allclose(cuda_backend.to_numpy(ops.rope(xp(x), xp(pos), xp(inv), inverse)),
                                   ref.rope(x, pos, inv, inverse), rtol=1e-4, atol=1e-4)
    flat = x[:, 1, :]  # a strided [T, d] view, int64 positions
    np.testing.assert_allclose(cuda_backend.to_numpy(ops.rope(xp(x)[:, 1, :], xp(pos.astype(np.int64)), xp(inv))),
                               ref.rope(flat, pos, inv), rtol=1e-4, atol=1e-4)
    with pytest.raises(BackendError, match="one position per token"):
        ops.rope(xp(x), xp(pos[:2]), xp(inv))
    gate, up = x[0] * 4, x[1] * 4
    for limit in (0.0, 2.5):
        np.testing.assert_allclose(cuda_backend.to_numpy(ops.swiglu(xp(gate), xp(up), limit)),
                                   ref.swiglu(gate, up, limit), rtol=1e-5, atol=1e-6)


def test_topk_orders_ties_like_numpy(cuda_backend, rng):
    from ds4_backend_cuda import ops

    scores = rng.integers(-3, 4, (6, 40)).astype(np.float32)
    scores[0, :5] = -0.0
    scores[1, -3:] = -np.inf
    got = cuda_backend.to_numpy(ops.topk(cuda_backend.asarray(scores), 7))
    np.testing.assert_array_equal(got, ref.topk(scores, 7))


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 5000, 512), (3, 300, 6), (2, 5, 9)])
def test_topk_on_larger_rows_and_k_beyond_the_row(cuda_backend, rng, rows, n, k):
    from ds4_backend_cuda import ops

    scores = rng.standard_normal((rows, n)).astype(np.float32)
    scores[:, ::7] = np.round(scores[:, ::7])  # ties
    got = cuda_backend.to_numpy(ops.topk(cuda_backend.asarray(scores), k))
    assert got.shape == (rows, min(k, n))
    np.testing.assert_array_equal(got, ref.topk(scores, k)[:, :min(k, n)])


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(("T", "K"), [(4, 6), (3, 300), (2, 700), (12, 6)])  # few-token kernels (K over tiles); arrays
def test_sparse_attention_and_indexer(cuda_backend, with_sinks, T, K, rng):
    from ds4_backend_cuda import attention_ops

    H, d, N = 11, 40, 20  # heads over two blocks, channels over two warps' widths
    q = rng.standard_normal((T, H, d), dtype=np.float32)
    kv = rng.standard_normal((N, d), dtype=np.float32)
    idx = rng.integers(-1, N, (T, K)).astype(np.int32)
    idx[0] = -1  # a query that sees nothing
    sinks_ref, sinks = _pair(cuda_backend, "F32", (H,), rng) if with_sinks else (None, None)
    xp = cuda_backend.asarray
    got = cuda_backend.to_numpy(attention_ops.sparse_attention(xp(q), xp(kv), xp(idx), sinks, d ** -0.5))
    np.testing.assert_allclose(got, ref.sparse_attention(q, kv, idx, sinks_ref, d ** -0.5), rtol=1e-4, atol=1e-5)
    hw = rng.standard_normal((T, H), dtype=np.float32)
    got = cuda_backend.to_numpy(attention_ops.indexer_scores(xp(q), xp(kv), xp(hw), 0.3))
    np.testing.assert_allclose(got, ref.indexer_scores(q, kv, hw, 0.3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tiles_only", [False, True])
@pytest.mark.parametrize(("T", "H", "D", "R"), [(1, 64, 128, 544), (1, 64, 128, 3000), (1, 64, 128, 20000),
                                                (3, 64, 128, 33), (1, 64, 128, 1), (2, 32, 128, 500),
                                                (8, 7, 40, 100), (2, 65, 128, 300), (9, 64, 128, 200),
                                                (2, 11, 42, 50), (1, 8, 132, 40)])
def test_indexer_scores_at_indexer_shapes(cuda_backend, monkeypatch, tiles_only, T, H, D, R, rng):
    """The lightning indexer's scores at DeepSeek V4's shape (64 heads of 128) and GLM 5's (32), for one and a few query
    rows over keys that fill no, one or many blocks, heads and channels that fill no group of 4 and no warp's share: in
    blocks of 8 keys where they take a multiprocessor each at most (a decode step's 544 keys at 2K context), else of 32
    (3000, 20000 keys, or past 128 channels), and with blocks of 32 alone; past 64 heads, 8 query rows, or on rows of no
    whole float4s, the products go to the two-launch path."""
    from ds4_backend_cuda import attention_ops

    if tiles_only:
        monkeypatch.setattr(attention_ops, "_SPREAD_BLOCKS", 0)
    q = rng.standard_normal((T, H, D), dtype=np.float32)
    keys = rng.standard_normal((R, D), dtype=np.float32)
    hw = rng.standard_normal((T, H), dtype=np.float32)
    xp = cuda_backend.asarray
    got = cuda_backend.to_numpy(attention_ops.indexer_scores(xp(q), xp(keys), xp(hw), D ** -0.5))
    np.testing.assert_allclose(got, ref.indexer_scores(q, keys, hw, D ** -0.5), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtypes", [("F16",) * 3, ("Q8_0",) * 3, ("F16", "Q8_0", "F16")])
@pytest.mark.parametrize("T", [1, 3])
def test_linears_of_one_input(cuda_backend, qtypes, T, rng):
    """Several projections of one input in one launch: row counts that end segments inside a warp's row group, each
    result its own matrix's product; mixed formats take one launch each."""
    from ds4_backend_cuda import ops

    ncols = 256
    pairs = [_pair(cuda_backend, q, (r, ncols), rng) for q, r in zip(qtypes, (37, 64, 5), strict=True)]
    x = rng.standard_normal((T, ncols)).astype(np.float32)
    got = ops.linears(cuda_backend.asarray(x), tuple(w for _, w in pairs))
    assert len(got) == len(pairs)
    for (w_ref, _), y in zip(pairs, got, strict=True):
        want = ref.linear(x, w_ref)
        assert y.shape == want.shape
        np.testing.assert_array_less(np.abs(cuda_backend.to_numpy(y) - want), _bound(x, w_ref.data))


@pytest.mark.parametrize(("T", "K", "d"), [(1, 640, 512), (3, 100, 512), (1, 40, 1600), (2, 50, 42)])
def test_sparse_attention_at_decode_shapes(cuda_backend, T, K, d, rng):
    """Flash's 64 heads of 512 over a CSA layer's 640 rows (20 row tiles merged), a tile cut short, and heads too
    wide for the few-token kernels' shared memory or not a multiple of 4 wide (the prefill path takes them)."""
    from ds4_backend_cuda import attention_ops

    H, N = 64, 700
    q = rng.standard_normal((T, H, d), dtype=np.float32)
    kv = rng.standard_normal((N, d), dtype=np.float32)
    idx = rng.integers(-1, N, (T, K)).astype(np.int32)
    idx[0, :attention_ops._ATTEND_ROWS] = -1  # a tile of masked rows
    sinks_ref, sinks = _pair(cuda_backend, "F32", (H,), rng)
    xp = cuda_backend.asarray
    got = cuda_backend.to_numpy(attention_ops.sparse_attention(xp(q), xp(kv), xp(idx), sinks, d ** -0.5))
    np.testing.assert_allclose(got, ref.sparse_attention(q, kv, idx, sinks_ref, d ** -0.5), rtol=1e-4, atol=1e-5)


# (T, n_prev, n_comp): whole blocks of 64 queries and a rest (by row lists), a window reaching before the first row
# or not, compressed rows or none, a few tokens; two passes of blocks with ATTEND_TOKENS at 64; the 16-bit prefill's
# fp16 operands, with rows of 48 (the queries' norm in float32, then cast) and of 128 (the norm launch writes fp16),
# the output converted for the F16 grouped projection by rope_to16 (T > 32) with its scale from kv's bound
@pytest.mark.parametrize(("T", "n_prev", "n_comp", "passes", "fp16", "d"), [
    (200, 7, 30, False, False, 48), (200, 7, 30, True, False, 48), (128, 15, 0, False, False, 48),
    (130, 0, 3, True, False, 48), (5, 3, 4, False, False, 48), (200, 7, 30, True, True, 48),
    (200, 7, 30, False, True, 128), (130, 0, 3, True, True, 128), (5, 3, 4, False, True, 128)])
def test_norm_rope_window_attention(cuda_backend, T, n_prev, n_comp, passes, fp16, d, rng, monkeypatch):
    """A prefill's queries normed and rotated, then their window and complete compressed rows read in place (bands
    of 64 queries, cuBLAS, window_softmax), the output rotated back and through the grouped projection, against the
    numpy reference, which lists each query's rows: at float32 tolerance, or fp16's (the 16-bit prefill's operands,
    10-bit mantissas)."""
    from ds4_backend_cuda import attention_ops
    from ds4_model_deepseek4 import ops as dref

    if passes:
        monkeypatch.setattr(attention_ops, "ATTEND_TOKENS", 64)
    if fp16:
        monkeypatch.setenv("DS4_CUDA_PREFILL", "16")
    H, W, eps, G = 5, 16, 1e-6, 2
    first, comp_start = n_prev - W + 1, n_prev + T
    q = 3 * rng.standard_normal((T, H, d), dtype=np.float32)
    kv = rng.standard_normal((comp_start + n_comp, d), dtype=np.float32)
    limit = np.minimum((np.arange(T) + n_prev + 1) // 4, n_comp).astype(np.int32) if n_comp else None
    sinks_ref, sinks = _pair(cuda_backend, "F32", (H,), rng)
    out_ref, out_a = _pair(cuda_backend, "F16", (G * 16, H * d // G), rng)
    pos = (n_prev + np.arange(T)).astype(np.int32)
    inv_freq = (10000.0 ** -(np.arange(8) / 8)).astype(np.float32)  # the last 16 channels rotate
    xp = cuda_backend.asarray
    got = cuda_backend.to_numpy(attention_ops.norm_rope_window_attention(
        xp(q), eps, xp(kv), first, W, comp_start, None if limit is None else xp(limit), sinks, d ** -0.5, xp(pos),
        xp(inv_freq), out_a, G))
    want = dref.norm_rope_window_attention(q, eps, kv, first, W, comp_start, limit, sinks_ref, d ** -0.5, pos,
                                           inv_freq, out_ref, G)
    assert got.shape == want.shape == (T, G, 16)
    if fp16:
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _rotated_attention(backend, rng: np.random.Generator, T: int, K: int, d: int, half: int) -> tuple:
    """Inputs of ``norm_rope_attention`` at Flash's 64 heads: queries ``[T, 64, d]``, 700 K=V rows, ``K`` rows a
    query (some masked), sinks (reference, device), positions up to 40K and ``half`` rotated pairs."""
    H, N = 64, 700
    q = rng.standard_normal((T, H, d), dtype=np.float32) * 3
    kv = rng.standard_normal((N, d), dtype=np.float32)
    idx = rng.integers(-1, N, (T, K)).astype(np.int32)
    sinks = _pair(backend, "F32", (H,), rng)
    pos = rng.integers(0, 40000, T).astype(np.int32)
    inv_freq = (10000.0 ** (-np.arange(half) / half)).astype(np.float32)
    return q, kv, idx, sinks, pos, inv_freq


# (2, 37, 68, 33): the rotated channels start at 2, inside a float4 of the queries
@pytest.mark.parametrize(("T", "K", "d", "half"), [(1, 640, 512, 32), (3, 100, 512, 32), (1, 40, 1600, 32),
                                                   (2, 50, 42, 21), (2, 37, 68, 33)])
def test_norm_rope_attention(cuda_backend, T, K, d, half, rng):
    """The queries' RMSNorm and RoPE in the rows launch and the inverse RoPE in the merge launch (Flash's 64 heads of
    512, 64 rotated channels, at positions up to 40K) against the three ops one after the other, and the numpy
    reference; the shapes the few-token kernels do not take go through the ops."""
    from ds4_backend_cuda import attention_ops, ops
    from ds4_model_deepseek4 import ops as dref

    q, kv, idx, (sinks_ref, sinks), pos, inv_freq = _rotated_attention(cuda_backend, rng, T, K, d, half)
    xp, host = cuda_backend.asarray, cuda_backend.to_numpy
    got = host(attention_ops.norm_rope_attention(xp(q), 1e-6, xp(kv), xp(idx), sinks, d ** -0.5, xp(pos), xp(inv_freq)))
    rotated = ops.norm_rope(xp(q), None, 1e-6, xp(pos), xp(inv_freq))
    plain = host(attention_ops.sparse_attention(rotated, xp(kv), xp(idx), sinks, d ** -0.5))
    apart = host(ops.rope(xp(plain), xp(pos), xp(inv_freq), inverse=True))
    np.testing.assert_allclose(got, apart, rtol=1e-5, atol=1e-6)
    want = dref.norm_rope_attention(q, 1e-6, kv, idx, sinks_ref, d ** -0.5, pos, inv_freq)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(got[..., -2 * half:], plain[..., -2 * half:])  # the output's rotation happened
    unrotated = host(attention_ops.sparse_attention(ops.rms_norm(xp(q), None, 1e-6), xp(kv), xp(idx), sinks, d ** -0.5))
    assert not np.allclose(plain, unrotated, rtol=1e-3)  # and the queries'


@pytest.mark.parametrize("with_sinks", [False, True])
def test_sparse_attention_in_token_passes(cuda_backend, with_sinks, rng, monkeypatch):
    """Prefill attention taken ATTEND_TOKENS queries at a time equals one pass and the oracle."""
    from ds4_backend_cuda import attention_ops

    T, K, H, d, N = 23, 37, 5, 48, 30
    q = rng.standard_normal((T, H, d), dtype=np.float32)
    kv = rng.standard_normal((N, d), dtype=np.float32)
    idx = rng.integers(-1, N, (T, K)).astype(np.int32)
    idx[7] = -1
    sinks_ref, sinks = _pair(cuda_backend, "F32", (H,), rng) if with_sinks else (None, None)
    xp = cuda_backend.asarray
    whole = cuda_backend.to_numpy(attention_ops.sparse_attention(xp(q), xp(kv), xp(idx), sinks, d ** -0.5))
    monkeypatch.setattr(attention_ops, "ATTEND_TOKENS", 10)  # passes of 10, 10 and 3 queries
    got = cuda_backend.to_numpy(attention_ops.sparse_attention(xp(q), xp(kv), xp(idx), sinks, d ** -0.5))
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-6)  # cuBLAS may pick another order per batch size
    np.testing.assert_allclose(got, ref.sparse_attention(q, kv, idx, sinks_ref, d ** -0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("T", "H", "D", "R"), [(40, 64, 128, 300), (33, 64, 128, 64), (9, 32, 128, 1000),
                                                (20, 16, 64, 7), (17, 48, 96, 130)])
def test_indexer_scores_of_a_prefill_on_tensor_cores(cuda_backend, monkeypatch, T, H, D, R, rng):
    """A prefill's indexer scores in one tensor-core launch (``index_scores16``): Flash's 64 heads of 128 and GLM 5's
    32, tokens that leave a block's last warps without one, keys that fill no, one or many tiles; fp16 operands, so
    within fp16's rounding of the float32 oracle, and the float32 prefill (``DS4_CUDA_PREFILL=32``) within float32's."""
    from ds4_backend_cuda import attention_ops

    monkeypatch.setenv("DS4_CUDA_PREFILL", "16")  # the suite defaults to the float32 prefill

    q = rng.standard_normal((T, H, D), dtype=np.float32) * 4
    keys = rng.standard_normal((R, D), dtype=np.float32)
    hw = rng.standard_normal((T, H), dtype=np.float32)
    want = ref.indexer_scores(q, keys, hw, D ** -0.5)
    xp = cuda_backend.asarray
    got = cuda_backend.to_numpy(attention_ops.indexer_scores(xp(q), xp(keys), xp(hw), D ** -0.5))
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2 * np.abs(want).max())
    assert np.linalg.norm(got - want) <= 3e-3 * np.linalg.norm(want)
    monkeypatch.setenv("DS4_CUDA_PREFILL", "32")
    got = cuda_backend.to_numpy(attention_ops.indexer_scores(xp(q), xp(keys), xp(hw), D ** -0.5))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(attention_ops, "DEQUANT_CHUNK", 3 * H * R)  # the float32 path's products three tokens at a time
    sliced = cuda_backend.to_numpy(attention_ops.indexer_scores(xp(q), xp(keys), xp(hw), D ** -0.5))
    np.testing.assert_allclose(sliced, want, rtol=1e-4, atol=1e-4)  # cuBLAS may sum another way for 3 tokens


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(("T", "H", "d", "K"), [(12, 64, 512, 640), (10, 64, 512, 100), (9, 16, 256, 70),
                                                (11, 48, 512, 129)])
def test_sparse_attention_of_a_prefill_on_tensor_cores(cuda_backend, monkeypatch, with_sinks, T, H, d, K, rng):
    """A prefill's sparse attention in one tensor-core launch (``attend16``: one block a query, its rows read in place
    64 at a time): Flash's 64 heads of 512 over a CSA layer's 640 rows, a tile cut short, fewer heads, repeated and
    masked rows, a query that sees nothing (zeros with a sink, NaN without, as the oracle) and one whose rows are
    all masked but the last tile's; fp16 operands, so within fp16's rounding of the float32 oracle, and the float32
    prefill within float32's."""
    from ds4_backend_cuda import attention_ops

    monkeypatch.setenv("DS4_CUDA_PREFILL", "16")  # the suite defaults to the float32 prefill

    N = 900
    q = rng.standard_normal((T, H, d), dtype=np.float32) * 3
    kv = rng.standard_normal((N, d), dtype=np.float32)
    idx = rng.integers(-1, N, (T, K)).astype(np.int32)
    idx[1] = -1
    idx[2, :-3] = -1
    idx[3, 1::2] = idx[3, 0]
    sinks_ref, sinks = _pair(cuda_backend, "F32", (H,), rng) if with_sinks else (None, None)
    want = ref.sparse_attention(q, kv, idx, sinks_ref, d ** -0.5)
    xp = cuda_backend.asarray
    got = cuda_backend.to_numpy(attention_ops.sparse_attention(xp(q), xp(kv), xp(idx), sinks, d ** -0.5))
    assert np.isnan(got[1]).all() != with_sinks
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=3e-3)
    seen = ~np.isnan(want)
    assert np.linalg.norm(got[seen] - want[seen]) <= 3e-3 * np.linalg.norm(want[seen])
    monkeypatch.setenv("DS4_CUDA_PREFILL", "32")
    got = cuda_backend.to_numpy(attention_ops.sparse_attention(xp(q), xp(kv), xp(idx), sinks, d ** -0.5))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_norm_rope_attention_of_a_prefill_on_tensor_cores(cuda_backend, monkeypatch, rng):
    """A prefill's queries normed and rotated straight into fp16 for ``attend16``, its output rotated back: Flash's
    64 heads of 512 with 64 rotated channels, within fp16's rounding of the numpy reference; the float32 prefill
    within float32's."""
    from ds4_backend_cuda import attention_ops
    from ds4_model_deepseek4 import ops as dref

    monkeypatch.setenv("DS4_CUDA_PREFILL", "16")  # the suite defaults to the float32 prefill

    q, kv, idx, (sinks_ref, sinks), pos, inv_freq = _rotated_attention(cuda_backend, rng, 12, 200, 512, 32)
    d = q.shape[-1]
    want = dref.norm_rope_attention(q, 1e-6, kv, idx, sinks_ref, d ** -0.5, pos, inv_freq)
    xp, host = cuda_backend.asarray, cuda_backend.to_numpy

    def got():
        return host(attention_ops.norm_rope_attention(xp(q), 1e-6, xp(kv), xp(idx), sinks, d ** -0.5, xp(pos),
                                                      xp(inv_freq)))

    np.testing.assert_allclose(got(), want, rtol=1e-2, atol=3e-3)
    assert np.linalg.norm(got() - want) <= 3e-3 * np.linalg.norm(want)
    monkeypatch.setenv("DS4_CUDA_PREFILL", "32")
    np.testing.assert_allclose(got(), want, rtol=1e-4, atol=1e-5)


# The first three and the many ties take route_choose's two rounds (warps' candidates, then their ranks); (2, 40, 12)
# has more candidates than experts and (1, 100, 40) k over a warp: both count over all experts.
@pytest.mark.parametrize(("T", "E", "k"), [(5, 16, 4), (1, 256, 6), (3, 40, 8), (2, 40, 12), (1, 100, 40)])
@pytest.mark.parametrize("ties", ["some", "many"])
def test_moe_route(cuda_backend, rng, T, E, k, ties):
    """Flash's 256 experts, a count that is not a whole number of warps, and ties (rounded logits, no bias): some,
    or logits of five values, so that equal choices lie in every warp and the lower index must win across warps."""
    from ds4_backend_cuda import moe_ops

    logits = rng.standard_normal((T, E), dtype=np.float32) * 4
    if ties == "some":
        logits[:, ::3] = np.round(logits[:, ::3])
    else:
        logits = np.clip(np.round(logits / 4), -2, 2).astype(np.float32)
    bias_ref, bias = _pair(cuda_backend, "F32", (E,), rng)
    xp = cuda_backend.asarray
    cases = ((bias_ref, bias, None), (None, None, None), (None, None, rng.integers(0, E, (T, k)).astype(np.int32)))
    for b_ref, b, fixed in cases:
        idx, w = moe_ops.moe_route(xp(logits), b, k, 1.5, None if fixed is None else xp(fixed))
        want_idx, want_w = ref.moe_route(logits, b_ref, k, 1.5, fixed)
        np.testing.assert_array_equal(cuda_backend.to_numpy(idx), want_idx)
        np.testing.assert_allclose(cuda_backend.to_numpy(w), want_w, rtol=1e-5)


# (1, 256, 4096, 6): Flash's router; E = 77 leaves a block's warps idle; E = 300 is more than a block chooses among,
# and D = 20 is not whole groups of 8 columns: both take the projection, then moe_route
@pytest.mark.parametrize(("T", "E", "D", "k"), [(1, 256, 4096, 6), (3, 77, 512, 8), (2, 300, 256, 4), (1, 64, 20, 2)])
@pytest.mark.parametrize("qtype", ["F16", "BF16", "F32"])
def test_moe_gate_route(cuda_backend, rng, T, E, D, k, qtype):
    """The router's projection and choice in one launch (the last block to finish chooses) against the projection
    then moe_route and the numpy reference; three launches in a row, so the blocks' counts are back at 0 after each.
    Then a hash layer's experts (given ids, repeats among them, no bias) weighed in the same launch, and read from its
    table by token id in the launch."""
    from ds4_backend_cuda import moe_ops, ops
    from ds4_model_deepseek4 import ops as dref

    xp, host = cuda_backend.asarray, cuda_backend.to_numpy
    gate_ref, gate = _pair(cuda_backend, qtype, (E, D), rng)
    bias_ref, bias = _pair(cuda_backend, "F32", (E,), rng)
    for _ in range(3):
        x = rng.standard_normal((T, D), dtype=np.float32)
        idx, w = map(host, moe_ops.moe_gate_route(xp(x), gate, bias, k, 1.5))
        apart_idx, apart_w = map(host, moe_ops.moe_route(ops.linear(xp(x), gate), bias, k, 1.5))
        np.testing.assert_array_equal(idx, apart_idx)  # random logits: no choice within the sums' rounding
        np.testing.assert_allclose(w, apart_w, rtol=1e-5)
        want_idx, want_w = dref.moe_gate_route(x, gate_ref, bias_ref, k, 1.5)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_allclose(w, want_w, rtol=1e-4)
    fixed = rng.integers(0, E, (T, k)).astype(np.int32)
    fixed[0, -1] = fixed[0, 0]
    x = rng.standard_normal((T, D), dtype=np.float32)
    for _ in range(2):
        idx, w = map(host, moe_ops.moe_gate_route(xp(x), gate, None, k, 1.5, xp(fixed)))
        np.testing.assert_array_equal(idx, fixed)
        apart_w = host(moe_ops.moe_route(ops.linear(xp(x), gate), None, k, 1.5, xp(fixed))[1])
        np.testing.assert_allclose(w, apart_w, rtol=1e-5)
        np.testing.assert_allclose(w, dref.moe_gate_route(x, gate_ref, None, k, 1.5, fixed)[1], rtol=1e-4)
    table = rng.integers(0, E, (9, k)).astype(np.int32)  # a hash layer's table, read by token id in the launch
    rows = rng.integers(0, 9, T).astype(np.int32)
    idx, w = map(host, moe_ops.moe_gate_route(xp(x), gate, None, k, 1.5, xp(table), xp(rows)))
    np.testing.assert_array_equal(idx, table[rows])
    np.testing.assert_allclose(w, dref.moe_gate_route(x, gate_ref, None, k, 1.5, table, rows)[1], rtol=1e-4)


# n = 6: the Sinkhorn matrix spans two registers per lane and is summed lane by lane; n = 2, 4: by butterflies.
# n · D a multiple of 1024 takes the fused mix (four column slices for (4, 256), 32 for (4, 2048), 48 for (4, 3072):
# a lane's second slice for half the lanes, and for (6, 512) 48 mix rows, more than a warp's lanes); the others the
# unfused one. hc_pre_norm: one launch for (4, 256), (4, 2048) and (4, 3072), the composition for the others;
# hc_post_pre_norm and hc_post_head_norm: hc_expand_mix_norm for the same three.
# T = 40 (a prefill): for n = 4, the mix by a GEMM with the squares of row_squares or hc_expand_rows; T = 300: its
# Sinkhorn a thread a token, in two blocks (the second partly empty).
@pytest.mark.parametrize("T", [3, 40, 300])
@pytest.mark.parametrize("n, D", [(4, 64), (6, 64), (2, 64), (4, 256), (4, 2048), (4, 3072), (6, 512)])
def test_hc_and_deepseek4_ops(cuda_backend, n, D, T, rng):
    from ds4_backend_cuda import deepseek4_ops as cu
    from ds4_backend_cuda import hc_ops as hc
    from ds4_model_deepseek4 import ops as dref

    from ds4_core import ops_hc

    xp, host = cuda_backend.asarray, cuda_backend.to_numpy
    atol = 1e-5 if T <= 8 else 2e-4  # a prefill's mix: a GEMM over n·D columns in cuBLAS's order, then Sinkhorn
    S = rng.standard_normal((T, n, D), dtype=np.float32)
    fn_ref, fn = _pair(cuda_backend, "F16", ((2 + n) * n, n * D), rng)
    sc_ref, sc = _pair(cuda_backend, "F32", (3,), rng)
    base_ref, base = _pair(cuda_backend, "F32", ((2 + n) * n,), rng)
    got = hc.hc_pre(xp(S), fn, sc, base, 20, 1e-6, 1e-6)
    want = ops_hc.hc_pre(S, fn_ref, sc_ref, base_ref, 20, 1e-6, 1e-6)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(host(g), w, rtol=1e-4, atol=atol)
    norm_ref, norm = _pair(cuda_backend, "F32", (D,), rng)  # hc_pre then RMSNorm, fused for n = 4 with slices
    fused = hc.hc_pre_norm(xp(S), fn, sc, base, 20, 1e-6, 1e-6, norm)
    for g, w in zip(fused, dref.hc_pre_norm(S, fn_ref, sc_ref, base_ref, 20, 1e-6, 1e-6, norm_ref), strict=True):
        np.testing.assert_allclose(host(g), w, rtol=1e-4, atol=atol)
    if hc._split_norm_fits(T, n, D):  # hc_split_norm's Sinkhorn in one lane, hc_split's in a warp: the same bits
        for g, w in zip(fused[1:], got[1:], strict=True):
            np.testing.assert_array_equal(host(g), host(w))
    y = rng.standard_normal((T, D), dtype=np.float32)
    np.testing.assert_allclose(host(hc.hc_post(xp(S), xp(y), got[1], got[2])),
                               ops_hc.hc_post(S, y, want[1], want[2]), rtol=1e-4, atol=atol)
    # hc_post of the outputs' sum then hc_pre_norm, the sum, the expansion and the next mix in one launch for n = 4
    # with slices: bit for bit the CUDA ops one after the other (the same arithmetic; a prefill's streams too, its
    # squares summed in another order), and the numpy reference on the same post and comb; one output (attention's)
    # and two (a MoE's routed and shared experts)
    ffn = [_pair(cuda_backend, "F16", ((2 + n) * n, n * D), rng), _pair(cuda_backend, "F32", (3,), rng),
           _pair(cuda_backend, "F32", ((2 + n) * n,), rng), _pair(cuda_backend, "F32", (D,), rng)]
    (fn2_ref, fn2), (sc2_ref, sc2), (base2_ref, base2), (norm2_ref, norm2) = ffn
    for ys in ((y,), (y, rng.standard_normal((T, D), dtype=np.float32))):
        both = hc.hc_post_pre_norm(xp(S), tuple(map(xp, ys)), got[1], got[2], fn2, sc2, base2, 20, 1e-6, 1e-6, norm2)
        S2 = hc.hc_post(xp(S), sum(map(xp, ys[1:]), xp(ys[0])), got[1], got[2])
        apart = (S2, *hc.hc_pre_norm(S2, fn2, sc2, base2, 20, 1e-6, 1e-6, norm2))
        np.testing.assert_array_equal(host(both[0]), host(apart[0]))
        for g, w in zip(both[1:], apart[1:], strict=True):
            if hc._prefill_norm_fits(T, n, D):
                np.testing.assert_allclose(host(g), host(w), rtol=1e-5, atol=1e-6)
            else:
                np.testing.assert_array_equal(host(g), host(w))
        want_both = dref.hc_post_pre_norm(S, ys, host(got[1]), host(got[2]), fn2_ref, sc2_ref, base2_ref, 20, 1e-6,
                                          1e-6, norm2_ref)
        for g, w in zip(both, want_both, strict=True):
            np.testing.assert_allclose(host(g), w, rtol=1e-4, atol=atol)
    hfn_ref, hfn = _pair(cuda_backend, "F16", (n, n * D), rng)
    hs_ref, hs = _pair(cuda_backend, "F32", (1,), rng)
    hb_ref, hb = _pair(cuda_backend, "F32", (n,), rng)
    np.testing.assert_allclose(host(hc.hc_head(xp(S), hfn, hs, hb, 1e-6, 1e-6)),
                               ops_hc.hc_head(S, hfn_ref, hs_ref, hb_ref, 1e-6, 1e-6), rtol=1e-4, atol=atol)
    # the last hc_post, hc_head and the output norm: one launch for n = 4 with slices (hc_expand_mix_norm's head), the
    # composition for the others; one output and two, twice per weight (its count). The streams: hc_post's bits. The
    # output against the numpy reference within 1e-4 of its unit RMS: the norm divides by the collapse's RMS, which
    # magnifies the mix's rounding (sums of n · D products in another order) where a token's weights are small
    for ys in ((y,), (y, rng.standard_normal((T, D), dtype=np.float32))):
        streams, out = hc.hc_post_head_norm(xp(S), tuple(map(xp, ys)), got[1], got[2], hfn, hs, hb, 1e-6, 1e-6,
                                            norm2)
        S2 = hc.hc_post(xp(S), sum(map(xp, ys[1:]), xp(ys[0])), got[1], got[2])
        np.testing.assert_array_equal(host(streams), host(S2))
        want_streams, want_out = dref.hc_post_head_norm(S, ys, host(got[1]), host(got[2]), hfn_ref, hs_ref, hb_ref,
                                                        1e-6, 1e-6, norm2_ref)
        np.testing.assert_allclose(host(streams), want_streams, rtol=1e-4, atol=atol)
        np.testing.assert_allclose(host(out), want_out, rtol=1e-4, atol=1e-4)
    kv = rng.standard_normal((2, 8, 16), dtype=np.float32)
    gate = rng.standard_normal((2, 8, 16), dtype=np.float32)
    gate[0, :4] = -np.inf
    np.testing.assert_allclose(host(hc.softmax_pool(xp(kv), xp(gate))), ops_hc.softmax_pool(kv, gate),
                               rtol=1e-5, atol=1e-6)
    rows = rng.standard_normal((5, 96), dtype=np.float32) * 3
    np.testing.assert_allclose(host(cu.fp8_kv_round(xp(rows), 32)), dref.fp8_kv_round(rows, 32), rtol=1e-6)
    np.testing.assert_allclose(host(cu.fp4_hadamard_round(xp(rows[:, :64]))), dref.fp4_hadamard_round(rows[:, :64]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("shape", "weighted"), [((3, 5, 64), False), ((2, 512), True), ((1, 9000), True),
                                                 ((40, 5, 512), False), ((40, 1024), True), ((40, 3, 128), True)])
def test_norm_rope_is_rope_of_rms_norm(cuda_backend, shape, weighted, rng):
    """RMSNorm and RoPE in one launch (a query's heads, a KV row) equal the two core ops; a row wider than a block's
    threads hold takes the two launches; a prefill's short rows (40 tokens) a warp a row, and RMSNorm alone too."""
    from ds4_backend_cuda import ops
    from ds4_model_deepseek4 import ops as dref

    x = rng.standard_normal(shape, dtype=np.float32) * 3
    w_ref, w = _pair(cuda_backend, "F32", (shape[-1],), rng) if weighted else (None, None)
    pos = rng.integers(0, 5000, shape[0]).astype(np.int32)
    inv_freq = (10000.0 ** -(np.arange(16) / 16)).astype(np.float32)
    xp = cuda_backend.asarray
    got = cuda_backend.to_numpy(ops.norm_rope(xp(x), w, 1e-6, xp(pos), xp(inv_freq)))
    np.testing.assert_allclose(got, dref.norm_rope(x, w_ref, 1e-6, pos, inv_freq), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cuda_backend.to_numpy(ops.rms_norm(xp(x), w, 1e-6)), ref.rms_norm(x, w_ref, 1e-6),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("T", "d", "rows"), [(1, 512, [5]), (2, 512, [3, 0]), (1, 9000, [1])])
def test_norm_rope_into_writes_the_rows_where_they_go_and_no_others(cuda_backend, T, d, rows, rng):
    """A decode step's raw row normalised, rotated and written into its ring slot in one launch; 9000 wide takes
    the launches apart (wider than a block's threads hold) and a copy, with the same result."""
    from ds4_backend_cuda import ops
    from ds4_model_deepseek4 import ops as dref

    x = rng.standard_normal((T, d), dtype=np.float32) * 3
    w_ref, w = _pair(cuda_backend, "F32", (d,), rng)
    pos = rng.integers(0, 5000, T).astype(np.int32)
    inv_freq = (10000.0 ** -(np.arange(16) / 16)).astype(np.float32)
    ring = rng.standard_normal((6, d), dtype=np.float32)
    want = ring.copy()
    dref.norm_rope_into(x, w_ref, 1e-6, pos, inv_freq, want, np.array(rows, np.int32))
    xp = cuda_backend.asarray
    out = xp(ring)
    ops.norm_rope_into(xp(x), w, 1e-6, xp(pos), xp(inv_freq), out, xp(np.array(rows, np.int32)))
    np.testing.assert_allclose(cuda_backend.to_numpy(out), want, rtol=1e-5, atol=1e-5)
    untouched = [r for r in range(6) if r not in rows]
    np.testing.assert_array_equal(cuda_backend.to_numpy(out)[untouched], ring[untouched])


def test_upload_keeps_raw_blocks(cuda_backend, rng):
    raw = _raw("IQ2_XXS", (4, 32, 256), rng)
    w = cuda_backend.upload("experts", "IQ2_XXS", (4, 32, 256), raw)
    assert w.data.nbytes == raw.nbytes
    np.testing.assert_array_equal(cuda_backend.to_numpy(w.data).reshape(-1), raw)


@pytest.mark.parametrize("T", [1, 3, 12])  # 12: above the few-token kernels, through cuBLAS
@pytest.mark.parametrize("shared", [False, True])
def test_small_contractions_match_numpy(cuda_backend, rng, T, shared):
    from ds4_backend_cuda import ops

    a = rng.standard_normal((T, 5, 40)).astype(np.float32)
    b = rng.standard_normal((37, 40) if shared else (T, 37, 40)).astype(np.float32)
    p = rng.standard_normal((T, 5, 37)).astype(np.float32)
    sub, dev = "jd" if shared else "tjd", cuda_backend.asarray
    np.testing.assert_allclose(cuda_backend.to_numpy(ops.contract_dot(dev(a), dev(b))),
                               np.einsum(f"tid,{sub}->tij", a, b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cuda_backend.to_numpy(ops.contract_mix(dev(p), dev(b))),
                               np.einsum(f"tij,{sub}->tid", p, b), rtol=1e-5, atol=1e-5)
