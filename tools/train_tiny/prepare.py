"""Build the tiny models' corpus and tokenizer from the running interpreter's standard library (CPU, no network).

Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``/``dist-packages``
excluded, files that are not valid UTF-8 skipped), in sorted relative-path order. A file is *held out* when
``int(sha1(relative_posix_path), 16) % 10 == 0``; the rule depends only on the name, so the same files are held out
under every Python version. Each file becomes ``BOS + tokens + EOS`` and the files are concatenated.

Each family (``families.py``) gets its own tokenizer and streams. Writes into ``--out/<family>``:
``tokenizer.json`` + ``tokenizer_config.json`` (byte-level BPE with the family's pre-tokenizer, and its special
tokens at ids 0..), ``tokens.npz`` (uint16 token streams ``train`` and ``heldout``, compressed so that three
families travel to the GPU machine together) and ``corpus.json`` (interpreter version, file lists, token counts).
Each file becomes ``doc_prefix + tokens + doc_suffix`` of its family, e.g. ``BOS + tokens + EOS``.

Run: ``PYTHONPATH=.:plugins/models/deepseek4:plugins/models/glm5:plugins/models/qwen38 \
python tools/train_tiny/prepare.py --family glm53 --out .carry/train_tiny``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
from families import FAMILIES, Family
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from ds4_core.pretokenizers import pre_tokenizer
from ds4_core.tokenizer import Tokenizer as Ds4Tokenizer
from ds4_core.tokenizer import tokenizer_metadata_from_hf

VOCAB_SIZE = 4096
HELD_OUT_MODULUS = 10
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relative_path: str) -> bool:
    """True for the ~10% of files (by a hash of the POSIX relative path) kept out of training."""
    return int(hashlib.sha1(relative_path.encode("utf-8")).hexdigest(), 16) % HELD_OUT_MODULUS == 0


def stdlib_sources(root: Path | None = None) -> dict[str, str]:
    """Relative POSIX path -> source text of every UTF-8 ``*.py`` file of the standard library, sorted by path."""
    root = root or stdlib_root()
    out = {}
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS & set(rel.parts) or not path.is_file():
            continue
        try:
            out[rel.as_posix()] = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


def train_tokenizer(family: Family, texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE of ``vocab_size`` tokens with the family's splits (and NFC) and its special tokens first."""
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre_tokenizer(family.pre).hf_split_patterns]
    tokenizer = Tokenizer(models.BPE())
    if family.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(family.special_tokens()),
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def token_stream(family: Family, tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """``doc_prefix + ids + doc_suffix`` of each text, concatenated, as uint16 ``[n_tokens]``."""
    prefix = [tokenizer.token_to_id(t) for t in family.doc_prefix]
    suffix = [tokenizer.token_to_id(t) for t in family.doc_suffix]
    parts = [[*prefix, *enc.ids, *suffix] for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return np.fromiter((t for p in parts for t in p), dtype=np.uint16)


def check_loader_round_trip(family: Family, directory: Path, tokenizer: Tokenizer, texts: list[str]) -> None:
    """Raise AssertionError unless ds4's own tokenizer (built from GGUF keys) matches HF on ``texts``."""
    ours = Ds4Tokenizer.from_metadata(tokenizer_metadata_from_hf(directory, pre=family.pre))
    for text in texts:
        ids = ours.encode(text)
        assert ids == tokenizer.encode(text, add_special_tokens=False).ids, "ds4 tokenizer disagrees with HF"
        assert ours.decode(ids) == text, "ds4 tokenizer does not round-trip"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="parent folder; the family's files go to OUT/FAMILY")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()

    sources = stdlib_sources()
    train = {k: v for k, v in sources.items() if not is_held_out(k)}
    held = {k: v for k, v in sources.items() if is_held_out(k)}
    family = FAMILIES[args.family]
    out = args.out / family.name
    tokenizer = train_tokenizer(family, list(train.values()), args.vocab_size)
    family.write_tokenizer_files(out, tokenizer.to_str())
    check_loader_round_trip(family, out, tokenizer, list(held.values())[:20])
    streams = {"train": token_stream(family, tokenizer, list(train.values())),
               "heldout": token_stream(family, tokenizer, list(held.values()))}
    np.savez_compressed(out / "tokens.npz", **streams)
    manifest = {
        "family": family.name, "pre_tokenizer": family.pre, "doc_prefix": family.doc_prefix,
        "doc_suffix": family.doc_suffix, "python": sys.version.split()[0],
        "stdlib": str(stdlib_root()), "vocab_size": tokenizer.get_vocab_size(),
        "split_rule": f"held out iff int(sha1(relative_posix_path), 16) % {HELD_OUT_MODULUS} == 0",
        "train_files": len(train), "heldout_files": len(held),
        "train_bytes": sum(len(t.encode()) for t in train.values()),
        "heldout_bytes": sum(len(t.encode()) for t in held.values()),
        "train_tokens": int(streams["train"].size), "heldout_tokens": int(streams["heldout"].size),
        "heldout_paths": sorted(held),
    }
    (out / "corpus.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    print(json.dumps({k: v for k, v in manifest.items() if k != "heldout_paths"}, indent=1))


if __name__ == "__main__":
    main()
