"""DeepSeek V4 decoding state: chunked prefill == token by token, snapshots, context limits, QAT roundings, config."""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import pytest
from ds4_model_deepseek4 import qat
from ds4_model_deepseek4.config import DeepSeekV4Config
from ds4_model_deepseek4.loader import load
from ds4_model_deepseek4.ops import DEEPSEEK4_OPS
from gguf import GGUFWriter

from ds4_core.backend import Ops, WeightLoader
from ds4_core.backends.numpy import NumpyBackend
from ds4_core.errors import ContextError, ModelConfigError
from ds4_core.gguf import GGUFFile
from ds4_core.model import copy_state
from ds4_core.ops import CORE_OPS

# 5 layers: sliding, sliding, CSA (m=4), HCA (m=8), CSA; hash routing in layers 0-1; window 8; indexer top-3 of
# 8 heads, so the indexer really selects once a query has more than 3 complete rows.
TINY = DeepSeekV4Config(
    vocab_size=64, hidden_size=32, num_layers=5, context_length=64, num_heads=4, num_kv_heads=1, head_dim=32,
    value_dim=32, rope_dim=8, q_lora_rank=16, o_lora_rank=8, o_groups=2, n_experts=6, n_experts_used=2,
    expert_ffn=8, n_shared_experts=1, n_hash_layers=2, sliding_window=8, index_n_heads=8, index_head_dim=32,
    index_topk=3, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
    yarn_factor=16.0, yarn_original_context=32, yarn_beta_fast=32.0, yarn_beta_slow=1.0, routed_scaling_factor=1.5,
    expert_weights_norm=True, rms_norm_eps=1e-6, compress_ratios=(0, 0, 4, 8, 4), swiglu_limits=(0.5,) * 5)


def random_tensors(cfg: DeepSeekV4Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under the GGUF names, numpy shapes; sinks, biases, ape and HC base/scale non-trivial."""
    rng = np.random.default_rng(seed)
    D, n, H, hd, E, F = cfg.hidden_size, cfg.hc_mult, cfg.num_heads, cfg.head_dim, cfg.n_experts, cfg.expert_ffn

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def vec(*shape: int, center: float = 0.0, scale: float = 0.5) -> np.ndarray:
        return (center + scale * rng.standard_normal(shape)).astype(np.float32)

    out = {"token_embd.weight": vec(cfg.vocab_size, D, scale=1.0), "output.weight": mat(cfg.vocab_size, D),
           "output_norm.weight": vec(D, center=1.0, scale=0.2), "output_hc_fn.weight": mat(n, n * D),
           "output_hc_base.weight": vec(n), "output_hc_scale.weight": vec(1, center=1.0, scale=0.3)}
    for layer in range(cfg.num_layers):
        b, m = f"blk.{layer}.", cfg.compress_ratios[layer]
        for sub in ("attn", "ffn"):
            out |= {f"{b}hc_{sub}_fn.weight": mat((2 + n) * n, n * D), f"{b}hc_{sub}_base.weight": vec((2 + n) * n),
                    f"{b}hc_{sub}_scale.weight": vec(3, center=1.0, scale=0.3)}
        out |= {f"{b}attn_norm.weight": vec(D, center=1.0, scale=0.2), f"{b}ffn_norm.weight": vec(D, center=1.0),
                f"{b}attn_q_a.weight": mat(cfg.q_lora_rank, D), f"{b}attn_q_b.weight": mat(H * hd, cfg.q_lora_rank),
                f"{b}attn_q_a_norm.weight": vec(cfg.q_lora_rank, center=1.0), f"{b}attn_kv.weight": mat(hd, D),
                f"{b}attn_kv_a_norm.weight": vec(hd, center=1.0), f"{b}attn_sinks.weight": vec(H),
                f"{b}attn_output_a.weight": mat(cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups),
                f"{b}attn_output_b.weight": mat(D, cfg.o_groups * cfg.o_lora_rank),
                f"{b}ffn_gate_inp.weight": mat(E, D), f"{b}ffn_gate_exps.weight": mat(E, F, D),
                f"{b}ffn_up_exps.weight": mat(E, F, D), f"{b}ffn_down_exps.weight": mat(E, D, F),
                f"{b}ffn_gate_shexp.weight": mat(F, D), f"{b}ffn_up_shexp.weight": mat(F, D),
                f"{b}ffn_down_shexp.weight": mat(D, F)}
        if cfg.is_hash_layer(layer):
            table = np.stack([rng.permutation(E)[:cfg.n_experts_used] for _ in range(cfg.vocab_size)])
            out[f"{b}ffn_gate_tid2eid.weight"] = table.astype(np.int32)
        else:
            out[f"{b}exp_probs_b.bias"] = vec(E)
        kind = cfg.layer_kind(layer)
        if kind == "sliding":
            continue
        width = 2 * hd if kind == "csa" else hd
        out |= {f"{b}attn_compressor_ape.weight": vec(m, width), f"{b}attn_compressor_kv.weight": mat(width, D),
                f"{b}attn_compressor_gate.weight": mat(width, D), f"{b}attn_compressor_norm.weight": vec(hd, center=1)}
        if kind == "csa":
            ih, nih = cfg.index_head_dim, cfg.index_n_heads
            out |= {f"{b}indexer.attn_q_b.weight": mat(nih * ih, cfg.q_lora_rank),
                    f"{b}indexer.proj.weight": mat(nih, D),
                    f"{b}indexer_compressor_ape.weight": vec(m, 2 * ih),
                    f"{b}indexer_compressor_kv.weight": mat(2 * ih, D),
                    f"{b}indexer_compressor_gate.weight": mat(2 * ih, D),
                    f"{b}indexer_compressor_norm.weight": vec(ih, center=1.0)}
    return out


def write_model(path: Path, cfg: DeepSeekV4Config, tensors: dict[str, np.ndarray]) -> Path:
    writer = GGUFWriter(str(path), "deepseek4")
    for key, (value, vtype, sub_type) in cfg.to_gguf_metadata().items():
        writer.add_key_value(key, value, vtype, sub_type)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def open_model(path: Path, **options):
    gguf = GGUFFile.open(path)
    backend = NumpyBackend()
    return load(gguf, WeightLoader(gguf, backend), Ops(backend, {**CORE_OPS, **DEEPSEEK4_OPS}), options)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("ds4") / "tiny.gguf", TINY, random_tensors(TINY))


@pytest.fixture(scope="module")
def model(tiny_path):
    return open_model(tiny_path)


IDS = np.random.default_rng(7).integers(0, TINY.vocab_size, 44).astype(np.int32)


def feed(model, splits, ids=IDS, state=None):
    state = model.new_state(64) if state is None else state
    outs, start = [], 0
    for n in splits:
        outs.append(model.forward(ids[start:start + n], state))
        start += n
    return np.concatenate(outs), state


@pytest.fixture(scope="module")
def one_by_one(model):
    return feed(model, [1] * len(IDS))[0]


# ---------------------------------------------------------------- chunked == token by token


@pytest.mark.parametrize("splits", [[44], [7, 1, 13, 23], [3, 5, 9, 2, 25], [8, 8, 8, 20], [1, 2, 41]])
def test_chunked_prefill_equals_token_by_token_at_every_position(model, one_by_one, splits):
    chunked, state = feed(model, splits)
    assert chunked.shape == (44, TINY.vocab_size) and state.n_tokens == 44
    np.testing.assert_allclose(chunked, one_by_one, atol=1e-5 * np.abs(one_by_one).max())


def test_indexer_selection_matters_in_the_tiny_model(tiny_path, one_by_one):
    every_row = open_model(tiny_path)
    every_row.blocks[2].attn.indexer.topk = every_row.blocks[4].attn.indexer.topk = 64
    logits = feed(every_row, [44])[0]
    late = slice(4 * (TINY.index_topk + 1), None)  # queries with more complete rows than top-k
    assert np.abs(logits[late] - one_by_one[late]).max() > 1e-3
    np.testing.assert_allclose(logits[:15], one_by_one[:15], atol=1e-5 * np.abs(one_by_one).max())


def test_state_holds_the_spec_arrays(model):
    _, state = feed(model, [13])
    csa, hca, sliding = state.layers[2], state.layers[3], state.layers[0]
    assert sliding.compressor is None and sliding.raw.shape == (8, 32)
    assert hca.compressor.buf_kv.shape == (8, 32) and hca.compressor.prev_kv is None and hca.indexer is None
    assert csa.compressor.buf_kv.shape == (4, 64) and csa.compressor.prev_kv.shape == (4, 32)
    assert csa.indexer.rows.shape == (16, 32) and csa.compressor.rows.shape == (16, 32)
    assert np.abs(csa.compressor.rows[:3]).sum() > 0 and not csa.compressor.rows[3:].any()  # 13 tokens: 3 windows
    assert model.state_nbytes(64) == sum(a.nbytes for a in _arrays(state))


def _arrays(state):
    for layer in state.layers:
        yield layer.raw
        for comp in (layer.compressor, layer.indexer):
            if comp is not None:
                yield from (a for a in attrs.astuple(comp, recurse=False)[1:] if a is not None)


# ---------------------------------------------------------------- snapshots and limits


def test_snapshot_restore_is_exact(model):
    _, state = feed(model, [11])
    snap = copy_state(state)
    first = model.forward(IDS[11:30], state)
    again = model.forward(IDS[11:30], snap)
    np.testing.assert_array_equal(first, again)
    other = copy_state(state)
    model.forward(IDS[30:35], other)
    assert state.n_tokens == 30 and other.n_tokens == 35


def test_ring_and_compressed_rows_are_views_of_one_key_buffer_in_copies_too(model):
    _, state = feed(model, [13])
    snap = copy_state(state)
    for original, copied in zip(state.layers, snap.layers, strict=True):
        assert not np.shares_memory(original.keys, copied.keys)
        for ls in (original, copied):
            rows = ls.compressor.rows if ls.compressor is not None else np.zeros((0, TINY.head_dim), np.float32)
            assert np.shares_memory(ls.raw, ls.keys) and (rows.size == 0 or np.shares_memory(rows, ls.keys))
            np.testing.assert_array_equal(ls.keys, np.concatenate([ls.raw, rows]))
    # the one-token step attends over the keys: a copy whose views came apart would decode otherwise
    steps = [model.decode_step(IDS[13:14], np.array([13], np.int32), s)[0] for s in (state, snap)]
    np.testing.assert_array_equal(*steps)
    assert np.abs(state.layers[2].keys[TINY.sliding_window:]).sum() > 0


def test_decode_step_without_aliasing_slices_concatenates_the_keys(model, one_by_one, monkeypatch):
    from ds4_model_deepseek4 import state as state_module

    monkeypatch.setattr(state_module, "slices_alias", lambda xp: False)  # as on MLX: raw and rows of their own
    state = copy_state(model.new_state(64))
    assert all(ls.keys is None for ls in state.layers)
    out = [model.decode_step(IDS[p:p + 1], np.array([p], np.int32), state)[0] for p in range(len(IDS))]
    np.testing.assert_allclose(np.concatenate(out), one_by_one, atol=1e-5 * np.abs(one_by_one).max())
    assert model.state_nbytes(64) == sum(a.nbytes for a in _arrays(state))


def test_feeding_past_the_context_raises(model):
    state = model.new_state(16)
    model.forward(IDS[:10], state)
    with pytest.raises(ContextError, match="do not fit"):
        model.forward(IDS[10:20], state)
    assert state.n_tokens == 10


# ---------------------------------------------------------------- QAT rounding


def test_fp8_rounding_matches_torch_float8_e4m3():
    torch = pytest.importorskip("torch")
    x = np.concatenate([np.linspace(-448, 448, 20001), np.geomspace(2.0 ** -12, 448, 4001)]).astype(np.float32)
    expected = torch.from_numpy(x).to(torch.float8_e4m3fn).to(torch.float32).numpy()
    np.testing.assert_array_equal(qat.round_minifloat(x, *qat.E4M3[1:]), expected)


def test_fp4_rounding_is_nearest_e2m1_value_ties_to_even_code():
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    x = np.concatenate([np.linspace(0, 6, 1201), (grid[1:] + grid[:-1]) / 2]).astype(np.float32)
    dist = np.abs(x[:, None] - grid[None])
    best = dist.min(axis=1, keepdims=True)
    candidates = np.where(dist == best, np.arange(8), 99)
    # the code of a tie: the even one among the (at most two) nearest codes
    code = np.where((candidates % 2 == 0) & (candidates < 99), candidates, 99).min(axis=1)
    code = np.where(code == 99, candidates.min(axis=1), code)
    expected = grid[code]
    np.testing.assert_array_equal(qat.round_minifloat(x, *qat.E2M1[1:]), expected)
    np.testing.assert_array_equal(qat.round_minifloat(-x, *qat.E2M1[1:]), -expected)


def test_fp8_kv_round_uses_power_of_two_block_scales_and_keeps_rope_channels():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 512)) * np.geomspace(1e-3, 100, 512)).astype(np.float32)
    y = qat.fp8_kv_round(x, rope_dim=64)
    np.testing.assert_array_equal(y[:, 448:], x[:, 448:])
    for block in range(7):
        part = slice(64 * block, 64 * block + 64)
        scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(x[:, part]).max(axis=1, keepdims=True), 1e-4) / 448))
        np.testing.assert_array_equal(y[:, part] / scale, qat.round_minifloat(x[:, part] / scale, 3, -6))
    assert 0 < np.abs(y[:, :448] - x[:, :448]).max() <= np.abs(x).max() / 16


def test_hadamard_is_orthonormal_sylvester():
    h = qat.hadamard(128)
    np.testing.assert_allclose(h @ h.T, np.eye(128), atol=1e-5)
    i = np.arange(128)
    parity = np.array([[bin(int(a & b)).count("1") % 2 for b in i] for a in i])
    signs = 1 - 2 * parity  # Sylvester: H[i, j] = (-1)^popcount(i & j)
    np.testing.assert_allclose(h * np.sqrt(128), signs, rtol=1e-6)


def test_fp4_hadamard_round_is_a_blockwise_fp4_image_of_the_rotation():
    x = np.random.default_rng(2).standard_normal((4, 128)).astype(np.float32)
    y = qat.fp4_hadamard_round(x)
    rotated = (x @ qat.hadamard(128)).reshape(4, 4, 32)
    scale = 2.0 ** np.ceil(np.log2(np.abs(rotated).max(axis=-1, keepdims=True) / 6))
    values = y.reshape(4, 4, 32) / scale
    assert set(np.abs(values).ravel()) <= {0, 0.5, 1, 1.5, 2, 3, 4, 6}
    assert np.abs(values - rotated / scale).max() <= 1.0  # half the widest FP4 gap


def test_qat_rounding_changes_logits_slightly_and_keeps_chunking_exact(tiny_path, one_by_one):
    model = open_model(tiny_path, qat_rounding=True)
    chunked = feed(model, [7, 1, 13, 23])[0]
    stepped = feed(model, [1] * len(IDS))[0]
    scale = np.abs(one_by_one).max()
    np.testing.assert_allclose(chunked, stepped, atol=1e-5 * scale)
    assert 1e-4 * scale < np.abs(chunked - one_by_one).max() < 0.5 * scale


# ---------------------------------------------------------------- config


def test_config_round_trips_through_gguf_metadata(tiny_path):
    gguf = GGUFFile.open(tiny_path)
    read = DeepSeekV4Config.from_metadata(gguf.metadata)
    for field in attrs.fields(DeepSeekV4Config):
        ours, theirs = getattr(read, field.name), getattr(TINY, field.name)
        assert np.array_equal(np.float32(ours), np.float32(theirs)), field.name  # floats are stored as f32
    assert TINY.variant == "custom" and [TINY.layer_kind(i) for i in range(5)] == ["sliding"] * 2 + ["csa", "hca",
                                                                                                      "csa"]


@pytest.mark.parametrize(("change", "message"), [
    ({"o_groups": 3}, "must divide head_count"),
    ({"rope_dim": 7}, "must be even"),
    ({"compress_ratios": (0, 0, 4, 2, 4)}, "compress ratio 2 of layer 3"),
    ({"num_kv_heads": 2}, "head_count_kv must be 1"),
    ({"swiglu_limits": (10.0,)}, "one entry per layer"),
])
def test_inconsistent_config_is_rejected(change, message):
    with pytest.raises(ModelConfigError, match=message):
        attrs.evolve(TINY, **change)


def test_missing_metadata_key_names_the_key():
    meta = {key: value for key, (value, _, _) in TINY.to_gguf_metadata().items()}
    del meta["deepseek4.attention.indexer.top_k"]
    with pytest.raises(ModelConfigError, match=r"deepseek4\.attention\.indexer\.top_k.*missing"):
        DeepSeekV4Config.from_metadata(meta)


def test_unknown_model_option_is_rejected(tiny_path):
    with pytest.raises(ModelConfigError, match="qat_rounding"):
        open_model(tiny_path, qat_roundin=True)


def test_flash_schedule_from_metadata_values():
    ratios = (0, 0, *(4 if layer % 2 == 0 else 128 for layer in range(2, 43)))
    flash = attrs.evolve(TINY, hidden_size=4096, num_layers=43, n_experts=256, n_experts_used=6, compress_ratios=ratios,
                         swiglu_limits=(10.0,) * 43, n_hash_layers=3, rope_dim=64, head_dim=512, value_dim=512,
                         index_head_dim=128)
    assert flash.variant == "flash"
    kinds = [flash.layer_kind(layer) for layer in range(43)]
    assert kinds[:4] == ["sliding", "sliding", "csa", "hca"] and kinds.count("csa") == 21 and kinds.count("hca") == 20
    assert [flash.is_hash_layer(layer) for layer in range(4)] == [True, True, True, False]


# ---------------------------------------------------------------- the one-token step with a device position


@pytest.mark.parametrize("p", [0, 5, 127, 130, 2047])
def test_step_index_lays_out_the_slot_window_limits_and_dense_rows(p):
    from ds4_model_deepseek4.ops import step_index

    W, specs = 128, ((4, 0), (128, 20))
    window = [s if s <= p else -1 for s in range(W)]
    want = [p % W, *window]
    for m, n in specs:
        limit = (p + 1) // m
        want.append(limit)
        if n:
            want += window + [W + w if w < limit else -1 for w in range(n)]
    got = step_index(np.array([p], np.int32), W, specs)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("ctx", [64, 46])  # 46: the last windows of 4 and 8 tokens do not fit the row slots
def test_decode_step_with_device_position_equals_token_by_token(model, one_by_one, ctx):
    state, out = model.new_state(ctx), []
    for p, token in enumerate(IDS):
        logits, streams = model.decode_step(np.array([token], np.int32), np.array([p], np.int32), state)
        assert streams.shape == (1, TINY.hc_mult, TINY.hidden_size)
        out.append(logits)
    np.testing.assert_allclose(np.concatenate(out), one_by_one, atol=1e-5 * np.abs(one_by_one).max())


def test_the_step_without_index_choice_equals_token_by_token_while_every_compressed_row_is_visible(model, one_by_one):
    """Top-3 of rows of 4 tokens: through position 14 a CSA layer has at most 3 complete rows, and the step's form
    that reads them all, without index queries or scores, gives the token-by-token logits. Past it the indexer's
    choice matters: the same form (the first 3 rows) no longer does."""
    assert [model.all_visible(p) for p in (0, 14, 15, 43)] == [True, True, False, False]
    state, out = model.new_state(64), []
    for p, token in enumerate(IDS):
        out.append(model.decode_step(np.array([token], np.int32), np.array([p], np.int32), state, True)[0])
    out = np.concatenate(out)
    tol = 1e-5 * np.abs(one_by_one).max()
    np.testing.assert_allclose(out[:15], one_by_one[:15], atol=tol)
    assert np.abs(out[15:] - one_by_one[15:]).max() > 100 * tol


def test_decode_steps_in_a_context_too_short_for_a_compressed_row_attend_the_window_alone(model, one_by_one):
    """A 3-token context holds no row of 4 (CSA) or 8 (HCA) tokens: both forms of the step read the window's rows."""
    for visible in (True, False):
        state = model.new_state(3)
        out = [model.decode_step(IDS[p:p + 1], np.array([p], np.int32), state, visible)[0] for p in range(3)]
        np.testing.assert_allclose(np.concatenate(out), one_by_one[:3], atol=1e-5 * np.abs(one_by_one).max())


def test_recorded_steps_take_the_form_each_position_needs(model, one_by_one):
    from ds4_core.decode_graph import DecodeGraphs

    model.decode_graphs = graphs = DecodeGraphs(model.ops.backend, model.decode_step, variant=model.all_visible)
    try:
        got, state = feed(model, [1] * len(IDS))
        assert set(graphs._recordings[id(state)]) == {(True,), (False,)}
    finally:
        model.decode_graphs = None
    np.testing.assert_allclose(got, one_by_one, atol=1e-5 * np.abs(one_by_one).max())


def test_decode_step_continues_a_chunked_prefill_with_qat_rounding(tiny_path):
    qat_model = open_model(tiny_path, qat_rounding=True)
    want, _ = feed(qat_model, [1] * len(IDS))
    _, state = feed(qat_model, [21])  # 21: inside a window of 4 and of 8, past the sliding window
    got = [qat_model.decode_step(IDS[p:p + 1], np.array([p], np.int32), state)[0] for p in range(21, len(IDS))]
    np.testing.assert_allclose(np.concatenate(got), want[21:], atol=1e-5 * np.abs(want).max())
