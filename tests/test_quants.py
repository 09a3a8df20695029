"""ds4_core.quants against the gguf package (gguf.quants), an oracle written outside this project.

Our dequantizers apply ggml's float operations in ggml's order, as gguf.quants does, so every
comparison below is exact (NaNs compare equal by position), not merely within rounding.
"""


import gguf.quants
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ds4_core import quants
from ds4_core.errors import ConversionError, GGUFTensorError

T = GGMLQuantizationType
FAST = settings(max_examples=25, deadline=None)
# gguf.quants has no I32 decoder, and ours refuses I32 (integers are not weights): tested separately.
DECODABLE = [name for name in quants.SUPPORTED_TYPES if name != "I32"]


def shapes_for(block_size: int) -> list[tuple[int, ...]]:
    """A single block row, a 2-D matrix and a 3-D expert stack, each row several blocks long."""
    return [(block_size,), (5, 3 * block_size), (4, 3, 2 * block_size)]


def oracle_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    return gguf.quants.dequantize(raw.reshape(byte_shape), qtype)


# ---------------------------------------------------------------- geometry and names


@pytest.mark.parametrize(
    ("name", "geometry"),
    [
        ("F32", (1, 4)),
        ("F16", (1, 2)),
        ("BF16", (1, 2)),
        ("I32", (1, 4)),
        ("Q8_0", (32, 34)),
        ("Q4_0", (32, 18)),
        ("Q4_K", (256, 144)),
        ("Q6_K", (256, 210)),
        ("Q2_K", (256, 84)),
        ("IQ2_XXS", (256, 66)),
        ("MXFP4", (32, 17)),
    ],
)
def test_block_geometry_is_ggmls(name, geometry):
    assert quants.block_geometry(name) == geometry == GGML_QUANT_SIZES[T[name]]


def test_quant_names_map_both_cases_to_the_type():
    for name in quants.SUPPORTED_TYPES:
        assert quants.QUANT_NAMES[name] == quants.QUANT_NAMES[name.lower()] == T[name]
    assert set(quants.QUANT_NAMES.values()) == {T[name] for name in quants.SUPPORTED_TYPES}


def test_types_are_accepted_as_enum_id_or_name():
    assert quants.block_geometry(T.Q4_K) == quants.block_geometry(12) == quants.block_geometry("q4_k")


@pytest.mark.parametrize("name", quants.SUPPORTED_TYPES)
@given(rows=st.lists(st.integers(0, 5), max_size=3), blocks_per_row=st.integers(0, 8))
@FAST
def test_tensor_nbytes_matches_gguf_byte_shape(name, rows, blocks_per_row):
    qtype = T[name]
    shape = (*rows, blocks_per_row * GGML_QUANT_SIZES[qtype][0])
    expected = int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)))
    assert quants.tensor_nbytes(qtype, shape) == expected


@pytest.mark.parametrize(("name", "row"), [("Q8_0", 33), ("Q4_K", 128), ("Q2_K", 300), ("MXFP4", 16), ("IQ2_XXS", 1)])
def test_tensor_nbytes_rejects_rows_of_partial_blocks(name, row):
    with pytest.raises(GGUFTensorError, match="whole blocks"):
        quants.tensor_nbytes(name, (4, row))


def test_tensor_nbytes_rejects_shapes_without_dimensions_or_with_negative_ones():
    for shape in [(), (-1, 32)]:
        with pytest.raises(GGUFTensorError, match="shape"):
            quants.tensor_nbytes("Q8_0", shape)


@pytest.mark.parametrize("qtype", ["q9_9", 999, T.Q5_K, T.IQ3_S])
def test_unknown_or_unsupported_types_are_rejected(qtype):
    with pytest.raises(GGUFTensorError, match="Q8_0"):  # the message lists what is supported
        quants.tensor_nbytes(qtype, (32,))
    with pytest.raises(GGUFTensorError):
        quants.dequantize(np.zeros(1024, np.uint8), qtype, (256,))


# ---------------------------------------------------------------- dequantize


@pytest.mark.parametrize("name", DECODABLE)
def test_dequantize_random_valid_blocks_equals_gguf(name):
    qtype, rng = T[name], np.random.default_rng(1234)
    for shape in shapes_for(GGML_QUANT_SIZES[qtype][0]):
        raw = quants.random_blocks(qtype, quants.tensor_nbytes(qtype, shape) // GGML_QUANT_SIZES[qtype][1], rng)
        ours = quants.dequantize(raw.reshape(-1), qtype, shape)
        assert ours.dtype == np.float32 and ours.shape == shape
        np.testing.assert_array_equal(ours, oracle_dequantize(raw, qtype, shape))


@pytest.mark.parametrize("name", DECODABLE)
@given(data=st.data())
@FAST
def test_dequantize_arbitrary_bytes_equals_gguf(name, data):
    """Any bit pattern, including inf/NaN/subnormal scales, decodes as gguf decodes it."""
    qtype = T[name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    raw = np.frombuffer(
        data.draw(st.binary(min_size=rows * blocks_per_row * type_size, max_size=rows * blocks_per_row * type_size)),
        dtype=np.uint8,
    )
    shape = (rows, blocks_per_row * block_size)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(quants.dequantize(raw, qtype, shape), oracle_dequantize(raw, qtype, shape))


def test_mxfp4_every_scale_byte_equals_gguf():
    raw = np.random.default_rng(7).integers(0, 256, (256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)  # E8M0 from the subnormal 2**-127 up to 2**128 (ggml has no NaN scale)
    with np.errstate(over="ignore"):  # the top scales overflow to inf in both
        np.testing.assert_array_equal(
            quants.dequantize(raw, "MXFP4", (2, 4096)), oracle_dequantize(raw, T.MXFP4, (2, 4096))
        )


def test_mxfp4_element_order_is_low_nibbles_then_high_nibbles():
    block = np.zeros(17, np.uint8)
    block[0] = 128  # scale 2: the doubled E2M1 table times 2**-1 times 2 gives the plain E2M1 value times 2
    block[1] = 0x71  # element 0: code 1 (0.5), element 16: code 7 (6.0)
    out = quants.dequantize(block, "MXFP4", (32,))
    assert out[0] == 1.0 and out[16] == 12.0 and not out[[i for i in range(32) if i not in (0, 16)]].any()


def test_dequantize_rejects_a_wrong_byte_count():
    with pytest.raises(GGUFTensorError, match="needs 68 bytes but 67"):
        quants.dequantize(np.zeros(67, np.uint8), "Q8_0", (2, 32))


def test_dequantize_refuses_integer_tensors():
    with pytest.raises(GGUFTensorError, match="int32"):
        quants.dequantize(np.zeros(8, np.uint8), "I32", (2,))


def test_dequantize_reads_a_read_only_buffer_and_returns_a_new_array():
    raw = quants.random_blocks("Q4_K", 2, np.random.default_rng(3)).reshape(-1)
    raw.setflags(write=False)
    out = quants.dequantize(raw, "Q4_K", (512,))
    assert out.flags.writeable and not np.shares_memory(out, raw)


# ---------------------------------------------------------------- random blocks


@pytest.mark.parametrize("name", quants.SUPPORTED_TYPES)
def test_random_blocks_are_well_formed_and_reproducible(name):
    block_size, type_size = quants.block_geometry(name)
    blocks = quants.random_blocks(name, 64, np.random.default_rng(11))
    assert blocks.dtype == np.uint8 and blocks.shape == (64, type_size)
    np.testing.assert_array_equal(blocks, quants.random_blocks(name, 64, np.random.default_rng(11)))
    if name != "I32":
        values = quants.dequantize(blocks, name, (64 * block_size,))
        assert np.isfinite(values).all() and 0 < np.abs(values).max() < 100


# ---------------------------------------------------------------- quantize

block_rows = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda blocks: 32 * blocks)),
    # Zero or at least 1e-6 in size: smaller block maxima make 1/d overflow in ggml and in gguf alike.
    elements=st.floats(-1e4, 1e4, width=32).map(lambda v: v if abs(v) >= 1e-6 else 0.0),
)


@given(x=block_rows)
@FAST
def test_quantize_q8_0_is_bit_exact_with_gguf(x):
    np.testing.assert_array_equal(quants.quantize(x, "Q8_0"), gguf.quants.quantize(x, T.Q8_0))


@given(halves=hnp.arrays(np.int32, 32, elements=st.integers(-254, 254)))
@FAST
def test_quantize_q8_0_rounds_ties_like_gguf(halves):
    x = (halves / 2).astype(np.float32)
    x[0] = 127  # d = 1, so every half-integer element is an exact tie
    np.testing.assert_array_equal(quants.quantize(x, "Q8_0"), gguf.quants.quantize(x, T.Q8_0))


def test_quantize_q8_0_rounds_half_away_from_zero():
    x = np.zeros(32, np.float32)
    x[:6] = [127, 2.5, -2.5, 0.5, -0.5, 1.5]
    codes = quants.quantize(x, "Q8_0")[2:8].view(np.int8)
    np.testing.assert_array_equal(codes, [127, 3, -3, 1, -1, 2])


@given(x=block_rows)
@FAST
def test_q8_0_round_trip_error_is_about_half_a_step(x):
    restored = quants.dequantize(quants.quantize(x, "Q8_0"), "Q8_0", x.shape)
    step = np.abs(x).reshape(-1, 32).max(axis=1, keepdims=True) / 127
    # Half a step from rounding the code, plus up to 127 codes times the f16 rounding of the step (2**-11).
    assert (np.abs(restored - x).reshape(-1, 32) <= step * (0.5 + 127 * 2.0**-11) * (1 + 1e-3)).all()


@given(x=hnp.arrays(np.float32, st.integers(1, 40), elements=st.floats(width=32)))
@FAST
def test_quantize_bf16_is_bit_exact_with_gguf_including_nan_and_inf(x):
    np.testing.assert_array_equal(quants.quantize(x, "BF16"), gguf.quants.quantize(x, T.BF16))


@given(x=hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.integers(1, 8)), elements=st.floats(width=32)))
@FAST
def test_quantize_float_types_is_bit_exact_with_gguf_and_round_trips(x):
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(quants.quantize(x, "F16"), gguf.quants.quantize(x, T.F16).view(np.uint8))
    np.testing.assert_array_equal(quants.dequantize(quants.quantize(x, "F32"), "F32", x.shape), x)


def test_quantize_rejects_unimplemented_targets():
    with pytest.raises(ConversionError, match="Q4_K is not implemented"):
        quants.quantize(np.zeros(256, np.float32), "Q4_K")


def test_quantize_rejects_partial_blocks_and_non_finite_q8_0_input():
    with pytest.raises(GGUFTensorError, match="whole blocks"):
        quants.quantize(np.zeros((2, 31), np.float32), "Q8_0")
    x = np.zeros(32, np.float32)
    x[3] = np.inf
    with pytest.raises(ConversionError, match="NaN or infinity"):
        quants.quantize(x, "Q8_0")
