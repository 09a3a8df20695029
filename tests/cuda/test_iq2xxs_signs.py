"""The IQ2_XXS signed weights of the integer kernels (``I8<IQ2_XXS>`` in quant_int8.cu), made on the host as the device
makes them: a grid row's code nibbles or-ed with a sign index's spread bits select bytes of the kernel's two palette
words through PTX ``prmt.b32``, with the palette read from the kernel source."""

from __future__ import annotations

import re

import numpy as np
from ds4_backend_cuda.modules import source

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
    grid = np.asarray(iq2xxs_tables()[0]).reshape(256, 8).astype(int)
    assert set(np.unique(grid)) == {8, 25, 43}  # what the three codes stand for
    code = {8: 0, 25: 1, 43: 2}

    for row in grid:
        codes = sum(code[int(m)] << (4 * e) for e, m in enumerate(row))  # fill()'s code word
        for s7 in range(128):
            bits = s7 | (bin(s7).count("1") & 1) << 7  # the eighth sign makes the count of negatives even
            spread = sum(((bits >> e) & 1) << (4 * e + 2) for e in range(8))  # fill()'s sign word
            selectors = codes | spread
            got = _signed(_prmt(pos, neg, selectors & 0xFFFF)) + _signed(_prmt(pos, neg, selectors >> 16))
            assert got == [int(m) * (-1 if bits >> e & 1 else 1) for e, m in enumerate(row)], (row, s7)
