"""GGUF blocks in MLX form: MLX's own dequantization must reproduce gguf-py's values bit for bit."""

from __future__ import annotations

import gguf.quants
import mlx.core as mx
import numpy as np
import pytest
from ds4_backend_metal.quant import QuantMatrix, RawBlocks, dequantize_matrix, dequantize_raw, to_mlx
from gguf.constants import GGMLQuantizationType

from ds4_core.quants import block_geometry, random_blocks

SHAPE = (3, 5, 512)  # experts, rows, columns: two super-blocks per row


def _raw(qtype: str, rng: np.random.Generator) -> np.ndarray:
    block_elems, _ = block_geometry(qtype)
    return random_blocks(qtype, int(np.prod(SHAPE)) // block_elems, rng)


def _oracle(raw: np.ndarray, qtype: str) -> np.ndarray:
    rows = raw.reshape(int(np.prod(SHAPE[:-1])), -1)
    return gguf.quants.dequantize(rows, GGMLQuantizationType[qtype]).reshape(SHAPE).astype(np.float32)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_K", "MXFP4"])
def test_native_types_are_mlx_quantized_and_bit_exact(qtype, rng):
    raw = _raw(qtype, rng)
    m = to_mlx(qtype, SHAPE, raw)
    assert isinstance(m, QuantMatrix)
    assert m.mode == ("mxfp4" if qtype == "MXFP4" else "affine")
    got = np.array(dequantize_matrix(m))
    want = _oracle(raw, qtype)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # sign of zero included


def test_mxfp4_negative_zero_code_decodes_to_positive_zero():
    block = np.zeros((1, 17), np.uint8)
    block[0, 0], block[0, 1:] = 127, 0x88  # every code is 8, the E2M1 "-0"
    got = np.array(dequantize_matrix(to_mlx("MXFP4", (1, 32), block)))
    want = gguf.quants.dequantize(block, GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q2_K"])
def test_raw_types_stay_raw_for_experts_and_decode_bit_exact(qtype, rng):
    raw = _raw(qtype, rng)
    r = to_mlx(qtype, SHAPE, raw)
    assert isinstance(r, RawBlocks)
    got = np.array(dequantize_raw(r))
    np.testing.assert_array_equal(got.view(np.uint32), _oracle(raw, qtype).view(np.uint32))
    matrix = to_mlx(qtype, SHAPE[1:], raw[: len(raw) // SHAPE[0]])  # a 2-D tensor is dequantized at load
    assert isinstance(matrix, mx.array) and matrix.dtype == mx.float32
    np.testing.assert_array_equal(np.array(matrix), _oracle(raw, qtype)[0])


@pytest.mark.parametrize("qtype", ["Q6_K", "F16", "BF16", "F32"])
def test_other_types_load_exactly(qtype, rng):
    block_elems, _ = block_geometry(qtype)
    raw = random_blocks(qtype, int(np.prod(SHAPE[1:])) // block_elems, rng)
    got = np.array(to_mlx(qtype, SHAPE[1:], raw).astype(mx.float32))
    rows = raw.reshape(SHAPE[1], -1)
    want = gguf.quants.dequantize(rows, GGMLQuantizationType[qtype]).reshape(SHAPE[1:]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "MXFP4"])
def test_quantized_matmul_matches_dequantized_product(qtype, rng):
    raw = _raw(qtype, rng)[: int(np.prod(SHAPE[1:])) // block_geometry(qtype)[0]]
    m = to_mlx(qtype, SHAPE[1:], raw)
    x = rng.standard_normal((4, SHAPE[-1])).astype(np.float32)
    got = np.array(mx.quantized_matmul(mx.array(x), m.w, m.scales, m.biases, transpose=True, **m.kwargs()))
    want = x.astype(np.float64) @ _oracle(np.tile(raw, (SHAPE[0], 1)), qtype)[0].T.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
