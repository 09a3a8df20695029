"""Pre-tokenizers: how each model family cuts text into pieces before byte-level BPE.

A family is chosen by the GGUF key ``tokenizer.ggml.pre``. Each family records the ``Split`` regexes of its
Hugging Face ``tokenizer.json`` (so a converter can check it is given the right family) and one compiled regex
that yields exactly the same pieces in a single pass over the text.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

import regex

from .errors import TokenizerError

# The cl100k-style contractions and classes shared by GLM 4/5 and Qwen.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"

_GLM4_PATTERN = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_PATTERN = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# DeepSeek V3/V4 ("joyai-llm"): three Split passes, each re-splitting every piece of the previous one: digit
# groups, then CJK/kana runs, then the general rule. The single-pass form below yields the same pieces: the
# general rule is applied separately outside CJK runs (classes exclude digits and CJK, and "end of piece" becomes
# "next char is a digit or CJK") and inside them (classes intersected with CJK). Unmatched characters are the
# one thing a single pass could glue across a CJK boundary, so gap runs are taken inside or outside CJK only.
_CJK = "一-龥぀-ゟ゠-ヿ"
_ASCII_PUNCT = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]"""
_DEEPSEEK_SPLITS = (
    r"\p{N}{1,3}",
    f"[{_CJK}]+",
    _ASCII_PUNCT + r"[A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_SINGLE_PASS = (
    r"\p{N}{1,3}"
    f"|{_ASCII_PUNCT}[A-Za-z]+"
    f"|[^\\r\\n\\p{{L}}\\p{{P}}\\p{{S}}\\p{{N}}{_CJK}]?[[\\p{{L}}\\p{{M}}]--[{_CJK}]]+"
    f"|[[{_CJK}]--[\\p{{L}}\\p{{P}}\\p{{S}}]]?[[\\p{{L}}\\p{{M}}]&&[{_CJK}]]+"
    f"| ?[[\\p{{P}}\\p{{S}}]--[{_CJK}]]+[\\r\\n]*"
    f"|[[\\p{{P}}\\p{{S}}]&&[{_CJK}]]+"
    r"|\s*[\r\n]+"
    f"|\\s+(?![^\\s\\p{{N}}{_CJK}])"
    r"|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """One family's text normalisation and splitting rule."""

    name: str
    hf_split_patterns: tuple[str, ...]  # the tokenizer.json Split regexes, in order (all "Isolated")
    nfc: bool  # the tokenizer.json applies an NFC normalizer first
    pattern: regex.Pattern  # matches every piece, including runs of characters the rule leaves unmatched

    def normalize(self, text: str) -> str:
        """Return ``text`` as the model's normalizer would see it (NFC or unchanged)."""
        return unicodedata.normalize("NFC", text) if self.nfc else text

    def split(self, text: str) -> list[str]:
        """Cut normalized ``text`` into pieces whose concatenation is ``text``."""
        return self.pattern.findall(text)


def _with_gaps(rule: str, gap_classes: tuple[str, ...] = ("(?s:.)",), flags: int = 0) -> regex.Pattern:
    """Compile ``rule`` plus a last alternative taking each run of characters where ``rule`` matches nowhere.

    HF "Isolated" splitting keeps such runs as pieces; a run is never mixed across ``gap_classes``.
    """
    gaps = "|".join(f"(?:(?!{rule}){cls})+" for cls in gap_classes)
    return regex.compile(f"{rule}|{gaps}", flags)


_FAMILIES = (
    (
        ("joyai-llm", "deepseek-v3", "deepseek4", "deepseek-v4"),
        PreTokenizer("joyai-llm", _DEEPSEEK_SPLITS, False,
                     _with_gaps(_DEEPSEEK_SINGLE_PASS, (f"[{_CJK}]", f"[^{_CJK}]"), regex.V1)),
    ),
    (("glm4", "chatglm4", "glm5"), PreTokenizer("glm4", (_GLM4_PATTERN,), False, _with_gaps(_GLM4_PATTERN))),
    (("qwen35", "qwen3.5", "qwen38"), PreTokenizer("qwen35", (_QWEN35_PATTERN,), True, _with_gaps(_QWEN35_PATTERN))),
)

#: ``tokenizer.ggml.pre`` values (canonical names first, then accepted aliases) -> pre-tokenizer.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {alias: pre for names, pre in _FAMILIES for alias in names}


def pre_tokenizer(name: str) -> PreTokenizer:
    """Return the pre-tokenizer for a ``tokenizer.ggml.pre`` value; raise TokenizerError when unknown."""
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise TokenizerError(
            f"unknown tokenizer.ggml.pre {name!r}; supported pre-tokenizers: {known}. "
            "Re-convert the model with one of these names or add the family's pre-tokenizer."
        ) from None
