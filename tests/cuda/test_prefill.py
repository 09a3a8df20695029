"""Tensor-core prefill (``ds4_backend_cuda.prefill``) against the numpy oracle on random valid quant blocks.

Tolerance, from the rounding of the 16-bit operands: with u the unit roundoff of the type a format is multiplied
in (fp16: 2^-11, bf16: 2^-8; F32 stays float32, u = 0), a product of two rounded operands is off by at most
(2u + u²)·|x·w|, and a float32 sum of n terms (the GEMM's and the oracle's) by at most n·2^-24·Σ|x·w| each. So
``|got - want| <= (2u + u² + 2n·2^-24) · (|x| @ |w|.T)``, plus 2^-38·max|x|·Σ|w| for activations that fall
below fp16's normal range after the power-of-two scaling (which puts max|x| in [2^13, 2^14)).

That worst-case bound is loose by about sqrt(n), and through SwiGLU and a second matmul (MoE) it says little, so
results are also compared with an emulation: the same 16-bit roundings done by numpy (float16 casts; bf16 by
round-to-nearest-even of the float32 bits) in float64. A linear may differ from it only by float32 summation
(the bound above with u = 0); the MoE by that and an occasional flipped rounding of the SwiGLU output, so its
distance to the emulation must be well under (a quarter of) the emulation's distance to the float32 oracle: the
GPU is as accurate as the 16-bit rounding allows, and no less.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4_core import ops as ref
from ds4_core.backend import Weight
from ds4_core.quants import block_geometry, dequantize, random_blocks

pytestmark = pytest.mark.gpu

QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K", "IQ2_XXS", "MXFP4")
UNIT = {"f16": 2.0**-11, "bf16": 2.0**-8}
SUM = 2.0**-24


def _pair(backend, qtype: str, shape: tuple[int, ...], rng: np.random.Generator) -> tuple[Weight, Weight]:
    """(numpy reference weight, CUDA weight) holding the same random blocks."""
    qk, _ = block_geometry(qtype)
    raw = random_blocks(qtype, int(np.prod(shape)) // qk, rng).reshape(-1)
    return Weight("w", qtype, shape, dequantize(raw, qtype, shape)), backend.upload("w", qtype, shape, raw)


def _unit(qtype: str) -> float:
    from ds4_backend_cuda.prefill import half_of

    return 0.0 if qtype == "F32" else UNIT[half_of(qtype)]


def _round16(a: np.ndarray, half: str) -> np.ndarray:
    """``a`` rounded to fp16 or bf16 (nearest even), as float64."""
    if half == "f16":
        return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float64)
    bits = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return bits.view(np.float32).astype(np.float64)


def _scaled16(a: np.ndarray, half: str, bound: float | None = None) -> np.ndarray:
    """``a`` as the kernels hold it: times the power of two putting max|a| (or ``bound``) in [2^13, 2^14), rounded,
    scaled back."""
    _, e = np.frexp(np.float32(np.abs(a).max() if bound is None else bound))
    s = 2.0 ** min(14 - int(e), 126)
    return _round16(np.asarray(a, dtype=np.float32) * np.float32(s), half) / s


def _linear_bound(x: np.ndarray, w: np.ndarray, u: float) -> np.ndarray:
    ax, aw = np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64))
    return ((2 * u + u * u + 2 * x.shape[-1] * SUM) * (ax @ aw.T) + 2.0**-38 * ax.max() * aw.sum(1)[None, :]
            + 1e-30)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tile_rows", [None, 64])
def test_prefill_linear_matches_the_oracle(cuda_backend, qtype, tile_rows, rng, monkeypatch):
    from ds4_backend_cuda import prefill

    if tile_rows:  # several tiles, the last one partial
        monkeypatch.setattr(prefill, "TILE_ELEMS", tile_rows * 768)
    w_ref, w = _pair(cuda_backend, qtype, (200, 768), rng)
    x = rng.standard_normal((48, 768), dtype=np.float32) * rng.uniform(0.01, 100, (48, 1)).astype(np.float32)
    got = cuda_backend.to_numpy(prefill.prefill_linear(cuda_backend.asarray(x), w.data, qtype, 768))
    want = ref.linear(x, w_ref)
    assert got.shape == want.shape == (48, 200)
    err = np.abs(got.astype(np.float64) - want)
    bound = _linear_bound(x, w_ref.data, _unit(qtype))
    assert np.all(err <= bound), f"worst error / bound: {np.max(err / bound):.3g}"
    if qtype != "F32":  # the same roundings in numpy: only the float32 summation differs
        half = prefill.half_of(qtype)
        x16, w16 = _scaled16(x, half), _round16(w_ref.data, half)
        emulated = x16 @ w16.T
        assert np.all(np.abs(got - emulated) <= _linear_bound(x16, w16, 0.0))


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("groups_a_tile", [None, 2])
def test_prefill_grouped_linear_matches_the_oracle(cuda_backend, qtype, groups_a_tile, rng, monkeypatch):
    """Each group's block of rows times that group's columns; with two groups a tile, three GEMMs, the last one
    group: the strides of both operands and of the output hold across tiles."""
    from ds4_backend_cuda import prefill

    G, rows, cols, T = 5, 48, 256, 40
    if groups_a_tile:
        monkeypatch.setattr(prefill, "TILE_ELEMS", groups_a_tile * rows * cols)
    w_ref, w = _pair(cuda_backend, qtype, (G * rows, cols), rng)
    x = rng.standard_normal((T, G, cols), dtype=np.float32) * rng.uniform(0.01, 100, (T, G, 1)).astype(np.float32)
    got = cuda_backend.to_numpy(prefill.prefill_grouped_linear(cuda_backend.asarray(x), w.data, qtype, cols))
    want = ref.grouped_linear(x, w_ref)
    assert got.shape == want.shape == (T, G, rows)
    blocks = w_ref.data.reshape(G, rows, cols)
    for g in range(G):
        err = np.abs(got[:, g].astype(np.float64) - want[:, g])
        tiny = 2.0**-38 * np.abs(x).max() * np.abs(blocks[g]).sum(1)  # x's scale is the whole of x's
        assert np.all(err <= _linear_bound(x[:, g], blocks[g], _unit(qtype)) + tiny), f"group {g}"
    if qtype != "F32":  # one power-of-two scale for the whole of x, as the kernels hold it
        half = prefill.half_of(qtype)
        x16 = _scaled16(x, half)
        for g in range(G):
            w16 = _round16(blocks[g], half)
            assert np.all(np.abs(got[:, g] - x16[:, g] @ w16.T) <= _linear_bound(x16[:, g], w16, 0.0)), f"group {g}"


@pytest.mark.parametrize("qtype", ["F16", "BF16", "F32"])
def test_prefill_linear_odd_float_widths(cuda_backend, qtype, rng):
    from ds4_backend_cuda import prefill

    w_ref, w = _pair(cuda_backend, qtype, (37, 13), rng)
    x = rng.standard_normal((40, 13), dtype=np.float32)
    got = cuda_backend.to_numpy(prefill.prefill_linear(cuda_backend.asarray(x), w.data, qtype, 13))
    assert np.all(np.abs(got - ref.linear(x, w_ref)) <= _linear_bound(x, w_ref.data, _unit(qtype)))


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q8_0", "MXFP4", "Q2_K", "Q4_K"])
def test_dequantize16_rounds_the_oracle_once(cuda_backend, qtype, rng):
    """16-bit weight tiles are the oracle's values rounded once: bit for bit where float32 holds them exactly
    (IQ2_XXS's scale times grid, Q8_0, MXFP4); for d·sc·q - dmin·m formats the kernels may fuse the float32
    multiply and subtract, so within one unit in the last place plus that float32 rounding."""
    from ds4_backend_cuda import prefill

    w_ref, w = _pair(cuda_backend, qtype, (48, 512), rng)
    half = prefill.half_of(qtype)
    out = cuda_backend.asarray(np.zeros((48, 512), dtype=np.uint16))
    prefill.dequantize16(w.data, qtype, 512, half, out)
    bits = cuda_backend.to_numpy(out)
    got = (bits.view(np.float16).astype(np.float64) if half == "f16"
           else (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64))
    want = _round16(w_ref.data, half)
    if qtype in ("IQ2_XXS", "Q8_0", "MXFP4"):
        np.testing.assert_array_equal(got, want)
    else:
        assert np.all(np.abs(got - want) <= 2 * UNIT[half] * np.abs(want) + 2.0**-22 * np.abs(w_ref.data).max())


def test_prefill_linear_scales_activations_out_of_fp16_range(cuda_backend, rng):
    """Activations of 1e6 (fp16 overflows at 65504) and 1e-6 (subnormal) keep their precision."""
    from ds4_backend_cuda import prefill

    w_ref, w = _pair(cuda_backend, "Q8_0", (64, 256), rng)
    for scale in (1e6, 1e-6):
        x = rng.standard_normal((40, 256), dtype=np.float32) * np.float32(scale)
        got = cuda_backend.to_numpy(prefill.prefill_linear(cuda_backend.asarray(x), w.data, "Q8_0", 256))
        assert np.all(np.abs(got - ref.linear(x, w_ref)) <= _linear_bound(x, w_ref.data, UNIT["f16"]))


def _silu(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return v / (1.0 + np.exp(-v))


def _moe_emulated(x, g, u, d, idx, weights, limit, gu_half, down_half, h_bound, dtype=np.float64) -> np.ndarray:
    """The MoE with the kernels' 16-bit roundings, computed in ``dtype``; ``h_bound``: the bound of SwiGLU's output
    whose scale h takes (None: each row's own maximum)."""
    x16 = _scaled16(x, gu_half).astype(dtype)
    out = np.zeros(x.shape, dtype=dtype)
    for t, j in zip(*np.nonzero(idx >= 0), strict=True):
        wg, wu = (_round16(m[idx[t, j]], gu_half).astype(dtype) for m in (g, u))
        gc, uc = wg @ x16[t], wu @ x16[t]
        if limit > 0:
            gc, uc = np.minimum(gc, limit), np.clip(uc, -limit, limit)
        h16 = _scaled16((_silu(gc) * uc).astype(np.float32), down_half, h_bound).astype(dtype)
        out[t] += dtype(weights[t, j]) * (_round16(d[idx[t, j]], down_half).astype(dtype) @ h16)
    return out


@pytest.mark.parametrize("gate_type,up_type,down_type", [("IQ2_XXS", "IQ2_XXS", "Q2_K"), ("Q4_K", "Q4_K", "Q4_K"),
                                                         ("MXFP4", "MXFP4", "Q8_0"), ("F16", "F16", "BF16"),
                                                         ("Q8_0", "MXFP4", "Q6_K")])
@pytest.mark.parametrize("small_budgets,T", [(False, 40), (True, 40), (False, 200)])
@pytest.mark.parametrize("tiles", ["mma", "wgmma"])
@pytest.mark.parametrize("limit", [0.8, 0.0])
def test_prefill_moe_matches_the_oracle(cuda_backend, gate_type, up_type, down_type, small_budgets, T, tiles, limit,
                                        rng, monkeypatch):
    """T = 200 gives experts 0 and 1 more than one 64-token tile of the fused kernel; ``tiles`` picks its tile
    kernel (``moe_mma16``, or ``moe_wgmma16`` on compute capability 9.0). With a SwiGLU limit the fused kernels
    write h in 16 bits scaled by limit²'s power of two; without one, h is scaled row by row."""
    from ds4_backend_cuda import prefill

    monkeypatch.setenv(prefill.WGMMA_ENV, "1" if tiles == "wgmma" else "0")
    if tiles == "wgmma" and not prefill.wgmma():
        pytest.skip("moe_wgmma16 runs on compute capability 9.0 only")
    E, inter, D, k = 8, 256, 512, 3
    if small_budgets:  # several token passes and expert groups of one or two experts
        monkeypatch.setattr(prefill, "MOE_TOKENS_PER_PASS", 16)
        monkeypatch.setattr(prefill, "MOE_WEIGHT_SCRATCH", 2 * 6 * inter * D)
    g_ref, g = _pair(cuda_backend, gate_type, (E, inter, D), rng)
    u_ref, u = _pair(cuda_backend, up_type, (E, inter, D), rng)
    d_ref, d = _pair(cuda_backend, down_type, (E, D, inter), rng)
    x = rng.standard_normal((T, D), dtype=np.float32)
    idx = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    idx[:T // 2, 0] = rng.integers(0, 2, T // 2)  # uneven counts: experts 0 and 1 take many more tokens
    for t in range(T // 2):
        idx[t, 1:] = [e for e in rng.permutation(E) if e != idx[t, 0]][:k - 1]
    weights = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    idx_dev = idx.copy()
    idx_dev[3, 2] = -1  # a slot without an expert contributes nothing
    weights_ref = weights.copy()
    weights_ref[3, 2] = 0
    want = ref.moe_experts(x, g_ref, u_ref, d_ref, idx, weights_ref, limit)
    xp = cuda_backend.asarray
    got = cuda_backend.to_numpy(prefill.prefill_moe(xp(x), g, u, d, xp(idx_dev), xp(weights), limit))
    again = cuda_backend.to_numpy(prefill.prefill_moe(xp(x), g, u, d, xp(idx_dev), xp(weights), limit))
    np.testing.assert_array_equal(got, again)  # a fixed summation order
    gu_half = prefill.half_of(gate_type) if prefill.half_of(gate_type) == prefill.half_of(up_type) else "bf16"
    down_half = prefill.half_of(down_type)
    direct = gate_type == up_type and gu_half == down_half and limit > 0  # the fused kernels' h in 16 bits
    emulated = _moe_emulated(x, g_ref.data, u_ref.data, d_ref.data, idx_dev, weights, limit, gu_half, down_half,
                             limit * limit if direct else None)
    assert np.linalg.norm(got - emulated) <= 0.25 * np.linalg.norm(want - emulated)


@pytest.mark.parametrize("half", ["f16", "bf16"])
def test_rope_to16_is_the_inverse_rope_then_the_scaled_rounding(cuda_backend, half, rng):
    """rope_to16's bits are rope_rows' inverse rotation of the trailing channels (the same sincosf arithmetic) times
    the power of two that puts max|bound_of| · factor in [2^13, 2^14), rounded to nearest even; rows of 48 channels,
    the last 16 rotated, five rows a token."""
    import cupy as cp
    from ds4_backend_cuda import ops
    from ds4_backend_cuda.prefill import rope_to16

    T, H, d = 40, 5, 48
    x = rng.standard_normal((T, H, d), dtype=np.float32)
    kv = (rng.standard_normal((70, d)) * 3).astype(np.float32)
    pos = (100 + np.arange(T)).astype(np.int32)
    inv_freq = (10000.0 ** -(np.arange(8) / 8)).astype(np.float32)
    got, alpha_beta = rope_to16(cp.asarray(x), half, cp.asarray(pos), cp.asarray(inv_freq), cp.asarray(kv), 1.5)
    rotated = cp.asnumpy(ops.rope(cp.asarray(x), cp.asarray(pos), cp.asarray(inv_freq), inverse=True))
    _, e = np.frexp(np.float32(np.abs(kv).max() * np.float32(1.5)))
    s = np.float32(2.0 ** min(14 - int(e), 126))
    scaled = rotated * s
    if half == "f16":
        want = scaled.astype(np.float16).view(np.uint16)
    else:
        want = (_round16(scaled, "bf16").astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    np.testing.assert_array_equal(cp.asnumpy(alpha_beta), np.array([1 / s, 0], dtype=np.float32))


# 8 whole groups of 8; a tail of 5 past them; a view 4 bytes into its buffer (no 16-byte accesses); NaNs among them
@pytest.mark.parametrize("half", ["f16", "bf16"])
def test_to16_k64_writes_the_same_bits_in_the_wgmma_operand_order(cuda_backend, half, rng):
    """With ``k64`` (moe_wgmma16's operands), to16 writes the bits it writes without, column o = 16t + 4q + 2h + e of
    every 64 at position 16q + 8h + 2t + e, so that thread t of a quad finds its A fragments' columns 16t .. 16t + 15
    (four 4-byte stores of pairs a thread); rows that are not a multiple of 64 are refused."""
    import cupy as cp
    from ds4_backend_cuda.prefill import to16

    from ds4_core.errors import BackendError

    x = cp.asarray((rng.standard_normal((7, 192)) * 5.0).astype(np.float32))
    plain, alpha_beta = to16(x, half)
    ordered, alpha_beta_k64 = to16(x, half, k64=True)
    o = np.arange(64)
    position = (o >> 2 & 3) * 16 + (o >> 1 & 1) * 8 + (o >> 4) * 2 + (o & 1)
    assert sorted(position) == list(range(64))
    want = np.empty((7 * 3, 64), dtype=np.uint16)
    want[:, position] = cp.asnumpy(plain).reshape(-1, 64)
    np.testing.assert_array_equal(cp.asnumpy(ordered).reshape(-1, 64), want)
    np.testing.assert_array_equal(cp.asnumpy(alpha_beta_k64), cp.asnumpy(alpha_beta))
    with pytest.raises(BackendError, match="multiple of 64"):
        to16(x[:, :100].copy(), half, k64=True)


@pytest.mark.parametrize(("n", "offset", "nan"), [(4096 * 16, 0, False), (64 + 5, 0, False), (1003, 1, False),
                                                 (777, 0, True)])
@pytest.mark.parametrize("half", ["f16", "bf16"])
def test_to16_is_the_scaled_rounding(cuda_backend, n, offset, nan, half, rng):
    """to16's 16-bit bits are x times the power of two that puts max|x| in [2^13, 2^14), rounded to nearest even,
    and its alpha the inverse of that power: whatever the alignment of x and the length's remainder modulo 8, with
    NaNs skipped by the maximum as numpy's nanmax skips them."""
    import cupy as cp
    from ds4_backend_cuda.prefill import to16

    x = (rng.standard_normal(n + offset) * 37.0).astype(np.float32)
    if nan:
        x[offset + 3] = np.nan
    got, alpha_beta = to16(cp.asarray(x)[offset:], half)
    amax = np.nanmax(np.abs(x[offset:]))
    _, e = np.frexp(amax)
    s = np.float32(2.0 ** min(14 - int(e), 126))
    scaled = x[offset:] * s
    if half == "f16":
        want = scaled.astype(np.float16).view(np.uint16)
    else:
        want = (_round16(scaled, "bf16").astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    finite = ~np.isnan(scaled)
    np.testing.assert_array_equal(cp.asnumpy(got)[finite], want[finite])
    exp_mask, man_mask = (0x7C00, 0x03FF) if half == "f16" else (0x7F80, 0x007F)
    nan_bits = cp.asnumpy(got)[~finite]
    assert ((nan_bits & exp_mask) == exp_mask).all() and (nan_bits & man_mask).all()  # a NaN stays a NaN
    np.testing.assert_array_equal(cp.asnumpy(alpha_beta), np.array([1 / s, 0], dtype=np.float32))
