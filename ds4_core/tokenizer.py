"""Byte-level BPE tokenizer built from GGUF tokenizer metadata (``tokenizer.ggml.*`` keys).

Text is normalized and cut into pieces by the family's pre-tokenizer (``tokenizer.ggml.pre``); each piece's UTF-8
bytes start as one symbol per byte and adjacent symbols are merged lowest merge rank first (ties: leftmost), the
way Hugging Face ``tokenizers`` does. Special tokens are never produced by BPE; ``encode(special=True)`` maps
their literal strings to their ids.
"""

from __future__ import annotations

import codecs
import heapq
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import regex

from .errors import TokenizerError
from .pretokenizers import PreTokenizer, pre_tokenizer

# GGUF token types (llama.cpp numbering).
TOKEN_UNDEFINED, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(7)

_SPECIAL_ID_KEYS = ("bos", "eos", "padding", "unknown", "seperator", "cls", "mask", "eot", "eom")
_BYTE_TOKEN = regex.compile(r"<0x([0-9A-F]{2})>")
_CACHE_MAX_PIECE = 256  # longer pieces are rare and would bloat the cache
_CACHE_MAX_ENTRIES = 200_000


def _byte_level_alphabet() -> list[str]:
    """GPT-2's reversible byte -> printable character map: index = byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


BYTE_TO_CHAR: list[str] = _byte_level_alphabet()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def byte_level_decode(token: str) -> bytes:
    """Bytes of a byte-level token string; a string outside the alphabet stands for its own UTF-8 (as in HF)."""
    try:
        return bytes(CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


class Tokenizer:
    """Byte-level BPE tokenizer of one model. Build with :meth:`from_metadata`.

    ``special_ids`` maps GGUF names (``bos``, ``eos``, ``padding``, ``eot``...) to the ids the metadata declares.
    """

    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str], pre: PreTokenizer,
                 special_ids: Mapping[str, int]):
        self.vocab_size = len(tokens)
        self.pre = pre
        self._tokens = tokens
        self._types = token_types
        self.bos_id: int | None = special_ids.get("bos")
        self.eos_id: int | None = special_ids.get("eos")
        self.pad_id: int | None = special_ids.get("padding")
        self.special_ids = dict(special_ids)
        by_id = list(enumerate(tokens))[::-1]  # reversed so that the first of duplicate strings wins
        self._id_of = {t: i for i, t in by_id}
        self._bpe_ids = {t: i for i, t in by_id if token_types[i] in (TOKEN_UNDEFINED, TOKEN_NORMAL)}
        self._bytes: list[bytes | None] = [None] * len(tokens)
        self._byte_ids = self._find_byte_ids()
        self._merges = self._build_merges(merges)
        self._cache: dict[str, list[int]] = {}
        self._special_regex = self._build_special_regex()

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, md: Mapping[str, object]) -> Tokenizer:
        """Build from GGUF metadata (a dict or any mapping with ``.get``); raise TokenizerError if malformed."""
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') vocabularies are supported"
            )
        pre_name = md.get("tokenizer.ggml.pre")
        if not isinstance(pre_name, str):
            raise TokenizerError("tokenizer.ggml.pre is missing; the GGUF must name its pre-tokenizer")
        pre = pre_tokenizer(pre_name)
        tokens = _str_list(md.get("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("tokenizer.ggml.tokens is missing or empty")
        merges = _str_list(md.get("tokenizer.ggml.merges"), "tokenizer.ggml.merges")
        raw_types = md.get("tokenizer.ggml.token_type")
        types = [TOKEN_NORMAL] * len(tokens) if raw_types is None else [int(t) for t in raw_types]
        if len(types) != len(tokens):
            raise TokenizerError(
                f"tokenizer.ggml.token_type has {len(types)} entries but tokenizer.ggml.tokens has {len(tokens)}"
            )
        for i, t in enumerate(types):
            if not TOKEN_UNDEFINED <= t <= TOKEN_BYTE:
                raise TokenizerError(f"token {i} ({tokens[i]!r}) has unknown token type {t}")
            if t == TOKEN_BYTE and not _BYTE_TOKEN.fullmatch(tokens[i]):
                raise TokenizerError(f"byte token {i} is {tokens[i]!r}; byte tokens must be spelled <0xHH>")
        special_ids = {}
        for name in _SPECIAL_ID_KEYS:
            value = md.get(f"tokenizer.ggml.{name}_token_id")
            if value is None:
                continue
            if not 0 <= int(value) < len(tokens):
                raise TokenizerError(
                    f"tokenizer.ggml.{name}_token_id is {int(value)}, outside the vocabulary of {len(tokens)} tokens"
                )
            special_ids[name] = int(value)
        return cls(tokens, types, merges, pre, special_ids)

    def _find_byte_ids(self) -> list[int | None]:
        ids: list[int | None] = [self._bpe_ids.get(c) for c in BYTE_TO_CHAR]
        for i, t in enumerate(self._types):  # a <0xHH> token covers a byte the byte-level alphabet lacks
            if t == TOKEN_BYTE:
                b = int(self._tokens[i][3:5], 16)
                ids[b] = ids[b] if ids[b] is not None else i
        return ids

    def _build_merges(self, merges: list[str]) -> dict[int, tuple[int, int]]:
        """(left id * vocab + right id) -> (rank, merged id)."""
        table: dict[int, tuple[int, int]] = {}
        vocab = self._bpe_ids
        n = self.vocab_size
        for rank, merge in enumerate(merges):
            parts = merge.split(" ")
            if len(parts) != 2:
                raise TokenizerError(f"merge {rank} {merge!r} is not two tokens separated by one space")
            left, right = parts
            ids = vocab.get(left), vocab.get(right), vocab.get(left + right)
            if None in ids:
                missing = [t for t, i in zip((left, right, left + right), ids, strict=True) if i is None]
                raise TokenizerError(f"merge {rank} {merge!r} refers to tokens not in the vocabulary: {missing}")
            table.setdefault(ids[0] * n + ids[1], (rank, ids[2]))
        return table

    def _build_special_regex(self) -> regex.Pattern | None:
        literals = [
            t for t, kind in zip(self._tokens, self._types, strict=True) if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
        ]
        literals = [t for t in literals if t]
        if not literals:
            return None
        return regex.compile(_trie_pattern(literals))

    # ---- lookups ------------------------------------------------------------------------------------------

    def token_bytes(self, id: int) -> bytes:
        """The bytes token ``id`` stands for (control and user-defined tokens: their text in UTF-8)."""
        if not 0 <= id < self.vocab_size:
            raise TokenizerError(f"token id {id} is outside the vocabulary of {self.vocab_size} tokens")
        cached = self._bytes[id]
        if cached is None:
            text, kind = self._tokens[id], self._types[id]
            if kind in (TOKEN_NORMAL, TOKEN_UNDEFINED):
                cached = byte_level_decode(text)
            elif kind == TOKEN_BYTE:
                cached = bytes([int(text[3:5], 16)])
            else:
                cached = text.encode("utf-8")
            self._bytes[id] = cached
        return cached

    def token_id(self, text: str) -> int | None:
        """Id of the vocabulary entry spelled exactly ``text`` (e.g. ``"<｜User｜>"``), or None."""
        return self._id_of.get(text)

    def is_special(self, id: int) -> bool:
        """True for control tokens (BOS, EOS, role markers...): never produced by BPE, hidden by skip_special."""
        return 0 <= id < self.vocab_size and self._types[id] == TOKEN_CONTROL

    # ---- encode -------------------------------------------------------------------------------------------

    def contains_special(self, text: str) -> bool:
        """Whether ``text`` holds the literal string of a control or user-defined token."""
        return self._special_regex is not None and self._special_regex.search(text) is not None

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """Token ids of ``text`` (no BOS added).

        With ``special=True`` literal control/user-defined token strings become their ids (leftmost, longest
        match first); otherwise all text is tokenized as plain text.
        """
        if not special or self._special_regex is None:
            return self._encode_plain(text)
        ids: list[int] = []
        pos = 0
        for m in self._special_regex.finditer(text):
            ids += self._encode_plain(text[pos:m.start()])
            ids.append(self._id_of[m.group()])
            pos = m.end()
        ids += self._encode_plain(text[pos:])
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        ids: list[int] = []
        cache = self._cache
        for piece in self.pre.split(self.pre.normalize(text)):
            piece_ids = cache.get(piece)
            if piece_ids is None:
                piece_ids = self._bpe(piece)
                if len(piece) <= _CACHE_MAX_PIECE:
                    if len(cache) >= _CACHE_MAX_ENTRIES:
                        cache.clear()
                    cache[piece] = piece_ids
            ids += piece_ids
        return ids

    def _bpe(self, piece: str) -> list[int]:
        """Merge one piece; a heap keyed rank * n + position keeps it O(n log n) for arbitrarily long pieces."""
        byte_ids = self._byte_ids
        ids = []
        for b in piece.encode("utf-8", "surrogatepass"):
            i = byte_ids[b]
            if i is None:
                raise TokenizerError(
                    f"the vocabulary has no token for byte 0x{b:02X}; the GGUF vocabulary is incomplete"
                )
            ids.append(i)
        n = len(ids)
        if n < 2:
            return ids
        merges, v = self._merges, self.vocab_size
        heap = []
        for i in range(n - 1):
            m = merges.get(ids[i] * v + ids[i + 1])
            if m is not None:
                heap.append(m[0] * n + i)
        if not heap:
            return ids
        heapq.heapify(heap)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        while heap:
            rank, i = divmod(heapq.heappop(heap), n)
            left = ids[i]
            j = nxt[i]
            if left < 0 or j >= n:
                continue
            m = merges.get(left * v + ids[j])
            if m is None or m[0] != rank:  # stale: a neighbour was merged away since this entry was pushed
                continue
            ids[i] = m[1]
            ids[j] = -1
            k = nxt[j]
            nxt[i] = k
            if k < n:
                prv[k] = i
                m = merges.get(ids[i] * v + ids[k])
                if m is not None:
                    heapq.heappush(heap, m[0] * n + i)
            p = prv[i]
            if p >= 0:
                m = merges.get(ids[p] * v + ids[i])
                if m is not None:
                    heapq.heappush(heap, m[0] * n + p)
        return [t for t in ids if t >= 0]

    # ---- decode -------------------------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD. ``skip_special`` drops control tokens."""
        parts = [self.token_bytes(i) for i in ids if not (skip_special and self.is_special(i))]
        return b"".join(parts).decode("utf-8", "replace")

    def incremental_decoder(self, *, skip_special: bool = False) -> IncrementalDecoder:
        """A streaming decoder that never emits half a UTF-8 character."""
        return IncrementalDecoder(self, skip_special=skip_special)


class IncrementalDecoder:
    """Turns a stream of token ids into text; the concatenated output equals ``Tokenizer.decode``."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text completed by it (a partial UTF-8 sequence is held back)."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._utf8.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """Return what is held back (an incomplete sequence becomes U+FFFD) and reset."""
        return self._utf8.decode(b"", final=True)


def _trie_pattern(literals: Iterable[str]) -> str:
    """A regex matching any of ``literals``, the longest one where several start at the same place."""
    trie: dict = {}
    for lit in literals:
        node = trie
        for ch in lit:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict) -> str:
        branches = [regex.escape(ch) + emit(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return emit(trie)


def _str_list(value: object, key: str) -> list[str]:
    if value is None:
        raise TokenizerError(f"{key} is missing; the GGUF has no complete tokenizer")
    out = list(value)
    for i, v in enumerate(out):
        if isinstance(v, bytes):
            try:
                out[i] = v.decode("utf-8")
            except UnicodeDecodeError:
                raise TokenizerError(f"{key}[{i}] is not valid UTF-8") from None
        elif not isinstance(v, str):
            raise TokenizerError(f"{key}[{i}] is {type(v).__name__}, expected a string")
    return out


# ---- Hugging Face tokenizer.json -> GGUF keys -------------------------------------------------------------------


def tokenizer_metadata_from_hf(tokenizer_json: Path | str | dict, *, pre: str) -> dict[str, object]:
    """GGUF ``tokenizer.*`` keys for a Hugging Face byte-level BPE ``tokenizer.json``.

    ``tokenizer_json`` is a parsed tokenizer.json, its path, or a checkpoint directory (then its
    ``tokenizer_config.json`` supplies BOS/EOS/PAD, add_bos/add_eos and the chat template). ``pre`` names the
    family; the tokenizer.json's normalizer and pre-tokenizer must be that family's. Returns tokens (index = id,
    gaps filled with unused ``[PAD<id>]`` entries), merges ("left right"), token types, special ids.
    """
    config: dict = {}
    template: str | None = None
    if isinstance(tokenizer_json, dict):
        tj = tokenizer_json
    else:
        path = Path(tokenizer_json)
        if path.is_dir():
            if (path / "tokenizer_config.json").is_file():
                config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            if (path / "chat_template.jinja").is_file():
                template = (path / "chat_template.jinja").read_text(encoding="utf-8")
            path = path / "tokenizer.json"
        try:
            tj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot read {path}: {e}") from e
    family = pre_tokenizer(pre)
    _check_hf_pipeline(tj, family)

    model = tj["model"]
    by_id: dict[int, tuple[str, int]] = {i: (t, TOKEN_NORMAL) for t, i in model["vocab"].items()}
    for added in tj.get("added_tokens", []):
        kind = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
        by_id[int(added["id"])] = (added["content"], kind)
    size = max(by_id) + 1
    tokens = [by_id.get(i, (f"[PAD{i}]", TOKEN_UNUSED)) for i in range(size)]
    merges = []
    for m in model.get("merges", []):
        left, right = m.split(" ") if isinstance(m, str) else m
        if " " in left or " " in right:
            raise TokenizerError(f"merge {m!r} has a token containing a space; it cannot be stored in a GGUF")
        merges.append(f"{left} {right}")

    md: dict[str, object] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": family.name,
        "tokenizer.ggml.tokens": [t for t, _ in tokens],
        "tokenizer.ggml.token_type": [k for _, k in tokens],
        "tokenizer.ggml.merges": merges,
    }
    ids = {t: i for i, (t, _) in reversed(list(enumerate(tokens)))}
    for field, key in (("bos_token", "bos"), ("eos_token", "eos"), ("pad_token", "padding")):
        value = config.get(field)
        content = value.get("content") if isinstance(value, dict) else value
        if content is None:
            continue
        if content not in ids:
            raise TokenizerError(f"tokenizer_config.json {field} {content!r} is not in the vocabulary")
        md[f"tokenizer.ggml.{key}_token_id"] = ids[content]
    for field in ("add_bos_token", "add_eos_token"):
        if isinstance(config.get(field), bool):
            md[f"tokenizer.ggml.{field}"] = config[field]
    template = template if template is not None else config.get("chat_template")
    if isinstance(template, list):  # named templates: keep the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if isinstance(template, str):
        md["tokenizer.chat_template"] = template
    return md


def _check_hf_pipeline(tj: dict, family: PreTokenizer) -> None:
    """Raise TokenizerError unless ``tj`` is byte-level BPE with exactly ``family``'s normalizer and splits."""
    model = tj.get("model") or {}
    if model.get("type", "BPE") != "BPE" or "vocab" not in model:
        raise TokenizerError("tokenizer.json is not a BPE model; only byte-level BPE can be converted")
    if model.get("byte_fallback") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise TokenizerError(
            "tokenizer.json uses byte_fallback or subword affixes; only plain byte-level BPE is supported"
        )
    if model.get("ignore_merges"):
        raise TokenizerError("tokenizer.json sets ignore_merges, which GGUF cannot record; it is not supported")

    norm = tj.get("normalizer")
    steps = norm.get("normalizers", []) if norm and norm.get("type") == "Sequence" else [norm] if norm else []
    nfc = [s.get("type") for s in steps] == ["NFC"]
    if (steps and not nfc) or nfc != family.nfc:
        raise TokenizerError(
            f"tokenizer.json normalizer {norm!r} does not match pre-tokenizer {family.name!r} "
            f"(expects {'NFC' if family.nfc else 'none'}); pick the right pre name"
        )

    pt = tj.get("pre_tokenizer") or {}
    steps = pt.get("pretokenizers", []) if pt.get("type") == "Sequence" else [pt]
    splits = [s for s in steps if s.get("type") == "Split"]
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    patterns = tuple(_spell_escapes((s.get("pattern") or {}).get("Regex") or "") for s in splits)
    ok = (
        len(splits) + len(byte_level) == len(steps)
        and len(byte_level) == 1 and steps[-1] is byte_level[0]
        and byte_level[0].get("use_regex") is False
        and not byte_level[0].get("add_prefix_space", False)
        and all(s.get("behavior") == "Isolated" and not s.get("invert") for s in splits)
        and patterns == tuple(map(_spell_escapes, family.hf_split_patterns))
    )
    if not ok:
        raise TokenizerError(
            f"tokenizer.json pre-tokenizer does not match {family.name!r} (expected Split regexes "
            f"{family.hf_split_patterns} then ByteLevel without regex); pick the right pre name"
        )


def _spell_escapes(pattern: str) -> str:
    """Write literal CR/LF as regex escapes: tokenizer.json files spell the same pattern both ways."""
    return pattern.replace("\r", "\\r").replace("\n", "\\n")
