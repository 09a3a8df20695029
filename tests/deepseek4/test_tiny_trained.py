"""The shipped trained tiny DeepSeek V4 model (``data/tiny-deepseek4.gguf``): it has learned Python.

Held-out text comes from the running interpreter's standard library, split by the documented rule (a file is held
out when ``sha1(relative path) % 10 == 0``, see docs/tiny-models.md), so no test data is shipped or downloaded.
"""

from __future__ import annotations

import ast
import math
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from ds4_model_deepseek4.mtp import MtpDrafter

from ds4_core.engine import Engine
from ds4_core.testing.heldout import HELD_OUT_FILES, card_value, held_out_sources, is_held_out, mean_loss, mtp_mean_loss

DATA = resources.files("ds4_model_deepseek4").joinpath("data")
MODEL = Path(str(DATA.joinpath("tiny-deepseek4.gguf")))
CARD = Path(str(DATA.joinpath("tiny-deepseek4.md")))

SUBSET_TOKENS = 512  # BOS + 511 text tokens per file
PREFIX_CHARS = 4000  # enough text for 511 tokens (the corpus averages 3.5 characters per token)
# The card's number was measured on Python 3.11; other versions' copies of these files differ a little.
TOLERANCE = 0.2


@pytest.fixture(scope="module")
def engine():
    eng = Engine.load(MODEL, backend="numpy")
    yield eng
    eng.close()


def greedy(engine: Engine, prompt: str, n_tokens: int) -> str:
    tok = engine.tokenizer
    session = engine.new_session()
    logits = session.feed([tok.bos_id, *tok.encode(prompt)])[-1]
    out = []
    for _ in range(n_tokens):
        out.append(int(np.argmax(logits)))
        logits = session.feed(out[-1:])[-1]
    return tok.decode(out)


def parsing_lines(text: str) -> int:
    """How many leading lines of ``text`` form valid Python (the longest parsing prefix cut at a line boundary)."""
    lines = text.splitlines(keepends=True)
    for n in range(len(lines), 0, -1):
        try:
            ast.parse("".join(lines[:n]))
        except SyntaxError:
            continue
        return n
    return 0


def test_shipped_file_is_small_q8_0_deepseek4(engine):
    assert MODEL.stat().st_size <= 16 * 2**20
    assert engine.gguf.architecture == "deepseek4"
    types = {t.type_name for t in engine.gguf.tensors.values()}
    assert "Q8_0" in {t.upper() for t in types}
    assert engine.tokenizer.vocab_size == int(card_value(CARD, "vocabulary"))


def test_info_reports_the_shipped_mtp_block(engine):
    from ds4_model_deepseek4.describe import describe

    assert describe(engine.gguf)["MTP block"].startswith("present (32 mtp.0.* tensors")


def test_files_scored_are_held_out_by_the_split_rule():
    for name in HELD_OUT_FILES:
        assert is_held_out(name), name


def test_tokenizer_round_trips_held_out_source(engine):
    for name, text in held_out_texts().items():
        prefix = text[:PREFIX_CHARS]
        assert engine.tokenizer.decode(engine.tokenizer.encode(prefix)) == prefix, name


def test_held_out_cross_entropy_far_below_uniform_and_as_in_the_card(engine):
    tok = engine.tokenizer
    loss = mean_loss(engine, list(held_out_texts().values()), tokens=SUBSET_TOKENS, prefix_chars=PREFIX_CHARS,
                     bos=True)
    uniform = math.log(tok.vocab_size)
    assert loss < 0.5 * uniform, f"held-out loss {loss:.3f} is not far below the uniform {uniform:.3f}"
    assert abs(loss - card_value(CARD, "held-out test subset loss")) < TOLERANCE, loss


def test_mtp_held_out_cross_entropy_far_below_uniform_and_as_in_the_card(engine):
    # The MTP block drafts the token after next; on the trunk's held-out test subset (BOS + 511 tokens per file)
    # it scores tokens 2..510 of each window from the trunk's states at 0..508 and tokens 1..509.
    loss = mtp_mean_loss(engine, MtpDrafter(engine.model).cross_entropy, list(held_out_texts().values()),
                         tokens=SUBSET_TOKENS, prefix_chars=PREFIX_CHARS, bos=True)
    uniform = math.log(engine.tokenizer.vocab_size)
    assert loss < 0.7 * uniform, f"held-out MTP loss {loss:.3f} is not far below the uniform {uniform:.3f}"
    assert abs(loss - card_value(CARD, "MTP held-out test subset loss")) < TOLERANCE, loss


def test_greedy_function_body_is_python(engine):
    # A docstring pins the function's topic; the body the model writes must parse for at least two lines.
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    text = prompt + greedy(engine, prompt, 40)
    assert parsing_lines(text) >= prompt.count("\n") + 2, text


def test_greedy_continuation_of_def_fibonacci_is_python_for_several_lines(engine):
    prompt = "def fibonacci(n):"
    text = prompt + greedy(engine, prompt, 40)
    assert parsing_lines(text) >= 4, text


@pytest.mark.xfail(strict=True, reason="greedy decoding after the signature and its newline does not parse yet "
                                       "(see the model card); more training should fix this (docs/tiny-models.md)")
def test_greedy_continuation_of_signature_line_is_python(engine):
    prompt = "def fibonacci(n):\n"  # "):\n" is one pre-token piece, so this prompt ends at a different boundary
    text = prompt + greedy(engine, prompt, 40)
    assert parsing_lines(text) >= 3, text


def held_out_texts() -> dict[str, str]:
    sources = held_out_sources()
    if sources is None:
        pytest.skip("this interpreter ships no standard library sources")
    return sources
