"""The shipped trained tiny Qwen3.8 Flash Next model (``data/tiny-qwen38.gguf``): it has learned some Python.

Held-out text comes from the running interpreter's standard library, split by the documented rule (a file is held
out when ``sha1(relative path) % 10 == 0``, see docs/tiny-models.md), so no test data is shipped or downloaded.
"""

from __future__ import annotations

import hashlib
import math
import re
import sysconfig
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ds4_core.cli import cli
from ds4_core.engine import Engine

DATA = resources.files("ds4_model_qwen38").joinpath("data")
MODEL = Path(str(DATA.joinpath("tiny-qwen38.gguf")))
CARD = Path(str(DATA.joinpath("tiny-qwen38.md")))

# Held-out modules present in every supported Python version; the first SUBSET_TOKENS tokens of each are scored.
HELD_OUT_FILES = ("base64.py", "copy.py", "difflib.py", "gzip.py")
SUBSET_TOKENS = 256  # text tokens per file (Qwen frames files without BOS)
PREFIX_CHARS = 4000  # enough text for 256 tokens
# The card's number was measured on Python 3.11; other versions' copies of these files differ a little.
TOLERANCE = 0.2
# "Far below uniform": at least this many nats/token under ln(V) (the CPU-trained model is still weak).
MARGIN = 2.0


@pytest.fixture(scope="module")
def engine():
    eng = Engine.load(MODEL, backend="numpy")
    yield eng
    eng.close()


def card_value(label: str) -> float:
    """The number in the model card's table row whose first cell is ``label``."""
    match = re.search(rf"^\| {re.escape(label)} \| ([0-9.]+)", CARD.read_text(encoding="utf-8"), re.MULTILINE)
    assert match, f"the model card has no row {label!r}"
    return float(match.group(1))


def held_out_sources() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [root / name for name in HELD_OUT_FILES]
    if not all(p.is_file() for p in paths):
        pytest.skip(f"this interpreter ships no standard library sources under {root}")
    return [p.read_text(encoding="utf-8") for p in paths]


def cross_entropy(logits: np.ndarray, targets: list[int]) -> np.ndarray:
    """Per-position cross-entropy (nats) of float ``logits [n, V]`` against ``targets [n]``."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return -log_probs[np.arange(len(targets)), targets]


def test_shipped_file_is_small_q8_0_qwen38(engine):
    assert MODEL.stat().st_size <= 16 * 2**20
    assert engine.gguf.architecture == "qwen4exp"
    assert "Q8_0" in {t.type_name.upper() for t in engine.gguf.tensors.values()}
    assert engine.tokenizer.vocab_size == int(card_value("vocabulary"))


def test_files_scored_are_held_out_by_the_split_rule():
    for name in HELD_OUT_FILES:
        assert int(hashlib.sha1(name.encode()).hexdigest(), 16) % 10 == 0, name


def test_held_out_cross_entropy_far_below_uniform_and_as_in_the_card(engine):
    tok = engine.tokenizer
    assert tok.bos_id is None  # training files start with their text, as `ds4 run --raw` starts a prompt
    losses = []
    for text in held_out_sources():
        ids = tok.encode(text[:PREFIX_CHARS])[:SUBSET_TOKENS]
        assert len(ids) == SUBSET_TOKENS
        logits = engine.new_session().feed(ids)[:-1]
        losses.append(cross_entropy(logits, ids[1:]))
    loss = float(np.concatenate(losses).mean())
    uniform = math.log(tok.vocab_size)
    assert loss < uniform - MARGIN, f"held-out loss {loss:.3f} is not far below the uniform {uniform:.3f}"
    assert abs(loss - card_value("held-out test subset loss")) < TOLERANCE, loss


def test_ds4_run_tiny_qwen38_writes_text(monkeypatch, tmp_path):
    monkeypatch.setenv("DS4_CACHE", str(tmp_path))
    result = CliRunner().invoke(cli, ["run", "-m", "tiny:qwen38", "--raw", "-p", "import os", "-n", "12",
                                      "--temp", "0", "--backend", "numpy"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("import os") and len(result.stdout.strip()) > len("import os"), result.output
