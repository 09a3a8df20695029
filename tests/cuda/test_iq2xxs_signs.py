"""The IQ2_XXS sign masks of the integer kernels (``I8<IQ2_XXS>::sign_masks`` in quant_int8.cu), computed on the
host as the device computes them: the 64-bit multiply, the parity's multiply-add modulo 2^32 and PTX ``prmt.b32``'s
sign mode, with the constants read from the kernel source."""

from __future__ import annotations

import re

from ds4_backend_cuda.modules import source


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32 d, a, b, selector`` (default mode): byte n of d is byte ``sel & 7`` of the pair (b:a), or, when
    the selector nibble's top bit is set, that byte's top bit spread over all eight bits."""
    pool = (b << 32) | a
    out = 0
    for n in range(4):
        sel = (selector >> (4 * n)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * n)
    return out


def test_sign_masks_flag_the_negative_elements_of_every_sign_index():
    text = source("quant_int8.cu")
    multiplier = int(re.search(r"\(u64\)s7 \* (0x[0-9A-Fa-f]+)ull", text).group(1), 16)
    parity_weight = int(re.search(r"mad\.lo\.u32 %0, %1, (0x[0-9A-Fa-f]+), %2;", text).group(1), 16)
    selector = int(re.search(r'prmt\.b32 %0, %1, 0, (0x[0-9A-Fa-f]+);', text).group(1), 16)

    for s7 in range(128):
        spread = (s7 * multiplier) & (1 << 64) - 1
        hi = (bin(s7).count("1") * parity_weight + (spread >> 32)) & 0xFFFFFFFF
        masks = _prmt(spread & 0xFFFFFFFF, 0, selector) | _prmt(hi, 0, selector) << 32
        bits = s7 | (bin(s7).count("1") & 1) << 7  # the eighth sign makes the count of negatives even
        assert masks == sum(0xFF << (8 * i) for i in range(8) if bits >> i & 1), s7
