"""Tiny DeepSeek V4 models on the Metal backend (MLX CPU here) against the numpy reference backend."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ds4_core.engine import Engine

PROMPT_TOKENS = 90  # past the indexer's top-k and several compressed windows


def _build(directory: Path, outtype: str, overrides: dict) -> Path:
    from ds4_model_deepseek4 import tiny
    from ds4_model_deepseek4.convert import ArraySource, build_gguf

    path = directory / f"tiny-{outtype}.gguf"
    config = tiny.tiny_config({**tiny.DEFAULT_MODEL_OVERRIDES, **overrides})
    scratch = Path(tempfile.mkdtemp(dir=directory))
    tiny.write_tokenizer_files(scratch, tiny.shipped_tokenizer_json())
    build_gguf(ArraySource(tiny.random_weights(config, 3)), config, scratch, path, outtype, "tiny")
    shutil.rmtree(scratch)
    return path


@pytest.fixture(scope="module", params=["default-q8_0", "bf16-hc2"])
def tiny_gguf(request, tmp_path_factory) -> Path:
    from ds4_model_deepseek4 import tiny

    directory = tmp_path_factory.mktemp("tiny")
    if request.param == "default-q8_0":
        return tiny.ensure_default_model(directory)
    # qat_rounding needs an indexer head of 32 or more
    return _build(directory, "bf16", {"hc_mult": 2, "sliding_window": 6, "index_head_dim": 32})


def _feed(path: Path, backend: str, chunks: list[int], ids: np.ndarray, **options) -> np.ndarray:
    engine = Engine.load(path, backend=backend, ctx=256, **options)
    try:
        session, out, start = engine.new_session(), [], 0
        for n in chunks:
            out.append(session.feed(ids[start:start + n]))
            start += n
        return np.concatenate(out)
    finally:
        engine.close()


def _ids(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(9, 512, n).astype(np.int32)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("qat", [False, True])
def test_prefill_matches_numpy_at_every_position(tiny_gguf, qat):
    if qat and "bf16" not in tiny_gguf.name:
        pytest.skip("the default tiny model's indexer head is too narrow for qat_rounding")
    ids = _ids(PROMPT_TOKENS)
    want = _feed(tiny_gguf, "numpy", [PROMPT_TOKENS], ids, qat_rounding=qat)
    got = _feed(tiny_gguf, "metal", [PROMPT_TOKENS], ids, qat_rounding=qat)
    assert got.shape == want.shape == (PROMPT_TOKENS, 512)
    _close(got, want)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_chunked_equals_token_by_token(tiny_gguf):
    ids = _ids(PROMPT_TOKENS)
    whole = _feed(tiny_gguf, "mlx", [PROMPT_TOKENS], ids)  # the alias selects the same backend
    ragged = _feed(tiny_gguf, "metal", [3, 1, 17, 40, 29], ids)
    _close(ragged, whole)
    # One token per call is slow on MLX's CPU device (per-op dispatch); 40 tokens already pass several compressed
    # windows and more CSA rows than the indexer keeps.
    by_token = _feed(tiny_gguf, "metal", [1] * 40, ids[:40])
    _close(by_token, whole[:40])


def test_snapshot_restore_replays_exactly(tiny_gguf):
    engine = Engine.load(tiny_gguf, backend="metal", ctx=64)
    try:
        session = engine.new_session()
        session.feed(_ids(20))
        snap = session.snapshot()
        first = session.feed([42, 43])
        session.restore(snap)
        np.testing.assert_array_equal(session.feed([42, 43]), first)
    finally:
        engine.close()


def test_ds4_run_on_metal_matches_numpy(tmp_path):
    from ds4_model_deepseek4 import tiny

    from ds4_core.cli import cli

    path = str(tiny.ensure_default_model(tmp_path))
    args = ["run", "-m", path, "-p", "Hello world", "-n", "12", "--temp", "0", "--raw"]
    runner = CliRunner()
    on_metal = runner.invoke(cli, [*args, "--backend", "metal"])
    on_numpy = runner.invoke(cli, [*args, "--backend", "numpy"])
    assert on_metal.exit_code == 0, on_metal.output
    assert on_numpy.exit_code == 0, on_numpy.output
    assert on_metal.stdout == on_numpy.stdout and on_metal.stdout.strip()
