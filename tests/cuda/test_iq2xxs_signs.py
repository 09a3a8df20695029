"""The IQ2_XXS signed weights of the integer kernels (``I8<IQ2_XXS>`` in quant_int8.cu), made on the host as the device
makes them: the tables the host writes at load (:func:`iq2xxs_int8_words`), a grid row's code word or-ed with a sign
index's word, select bytes of the kernel's two palette words through PTX ``prmt.b32``, with the palette read from the
kernel source."""

from __future__ import annotations

import re

import numpy as np
from ds4_backend_cuda.modules import iq2xxs_int8_words, source

from ds4_core.quants import iq2xxs_tables


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32 d, a, b, selector`` (default mode) for selector nibbles below 8, the only ones the palette's
    selectors hold: byte n of d is byte ``sel`` of the pair (b:a)."""
    pool = (b << 32) | a
    out = 0
    for n in range(4):
        sel = (selector >> (4 * n)) & 0xF
        assert sel < 8, "a selector nibble in prmt's sign mode"
        out |= ((pool >> (8 * sel)) & 0xFF) << (8 * n)
    return out


def _signed(word: int) -> list[int]:
    return [((word >> (8 * i)) & 0xFF) - (256 if (word >> (8 * i)) & 0x80 else 0) for i in range(4)]


def test_palette_picks_give_every_grid_row_under_every_sign_index():
    text = source("quant_int8.cu")
    pos = int(re.search(r"PALETTE_POS = (0x[0-9A-Fa-f]+)u", text).group(1), 16)
    neg = int(re.search(r"PALETTE_NEG = (0x[0-9A-Fa-f]+)u", text).group(1), 16)
    assert "u32 iq2xxs_i8_words[256 + 128];" in text  # the device array the host's words are copied into
    grid = np.asarray(iq2xxs_tables()[0]).reshape(256, 8).astype(int)
    assert set(np.unique(grid)) == {8, 25, 43}  # what the three codes stand for

    words = iq2xxs_int8_words(grid)
    assert words.dtype == np.uint32 and words.shape == (256 + 128,)
    for index, row in enumerate(grid):
        for s7 in range(128):
            selectors = int(words[index] | words[256 + s7])
            got = _signed(_prmt(pos, neg, selectors & 0xFFFF)) + _signed(_prmt(pos, neg, selectors >> 16))
            negative = [bool(s7 >> e & 1) for e in range(7)]
            negative.append(sum(negative) % 2 == 1)  # the eighth sign makes the count of negatives even
            assert got == [-int(m) if neg_e else int(m) for m, neg_e in zip(row, negative, strict=True)], (row, s7)
