"""The shipped trained tiny Qwen3.8 Flash Next model (``data/tiny-qwen38.gguf``): it has learned some Python.

Held-out text comes from the running interpreter's standard library, split by the documented rule (a file is held
out when ``sha1(relative path) % 10 == 0``, see docs/tiny-models.md), so no test data is shipped or downloaded.
"""

from __future__ import annotations

import functools
import math
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner
from ds4_model_qwen38.mtp import mtp_cross_entropy

from ds4_core.cli import cli
from ds4_core.engine import Engine
from ds4_core.testing.heldout import HELD_OUT_FILES, card_value, held_out_sources, is_held_out, mean_loss, mtp_mean_loss

DATA = resources.files("ds4_model_qwen38").joinpath("data")
MODEL = Path(str(DATA.joinpath("tiny-qwen38.gguf")))
CARD = Path(str(DATA.joinpath("tiny-qwen38.md")))

SUBSET_TOKENS = 256  # text tokens per file (Qwen frames files without BOS)
PREFIX_CHARS = 4000  # enough text for 256 tokens
# The card's number was measured on Python 3.11; other versions' copies of these files differ a little.
TOLERANCE = 0.2
# "Far below uniform": at least this many nats/token under ln(V).
MARGIN = 4.0


@pytest.fixture(scope="module")
def engine():
    eng = Engine.load(MODEL, backend="numpy")
    yield eng
    eng.close()








def test_shipped_file_is_small_q8_0_qwen38(engine):
    assert MODEL.stat().st_size <= 16 * 2**20
    assert engine.gguf.architecture == "qwen4exp"
    assert "Q8_0" in {t.type_name.upper() for t in engine.gguf.tensors.values()}
    assert engine.tokenizer.vocab_size == int(card_value(CARD, "vocabulary"))


def test_files_scored_are_held_out_by_the_split_rule():
    for name in HELD_OUT_FILES:
        assert is_held_out(name), name


def test_held_out_cross_entropy_far_below_uniform_and_as_in_the_card(engine):
    tok = engine.tokenizer
    assert tok.bos_id is None  # training files start with their text, as `ds4 run --raw` starts a prompt
    loss = mean_loss(engine, list(held_out_texts().values()), tokens=SUBSET_TOKENS, prefix_chars=PREFIX_CHARS,
                     bos=False)
    uniform = math.log(tok.vocab_size)
    assert loss < uniform - MARGIN, f"held-out loss {loss:.3f} is not far below the uniform {uniform:.3f}"
    assert abs(loss - card_value(CARD, "held-out test subset loss")) < TOLERANCE, loss


def test_mtp_head_predicts_the_token_after_next_as_in_the_card(engine):
    loss = mtp_mean_loss(engine, functools.partial(mtp_cross_entropy, engine.model), list(held_out_texts().values()),
                         tokens=SUBSET_TOKENS, prefix_chars=PREFIX_CHARS, bos=False)
    uniform = math.log(engine.tokenizer.vocab_size)
    assert loss < uniform - MARGIN, f"MTP held-out loss {loss:.3f} is not far below the uniform {uniform:.3f}"
    assert abs(loss - card_value(CARD, "MTP held-out test subset loss")) < TOLERANCE, loss


def test_ds4_run_tiny_qwen38_writes_text(monkeypatch, tmp_path):
    monkeypatch.setenv("DS4_CACHE", str(tmp_path))
    result = CliRunner().invoke(cli, ["run", "-m", "tiny:qwen38", "--raw", "-p", "import os", "-n", "12",
                                      "--temp", "0", "--backend", "numpy"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("import os") and len(result.stdout.strip()) > len("import os"), result.output


def held_out_texts() -> dict[str, str]:
    sources = held_out_sources()
    if sources is None:
        pytest.skip("this interpreter ships no standard library sources")
    return sources
